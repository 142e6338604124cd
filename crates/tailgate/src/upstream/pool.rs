//! A per-endpoint pool of upstream connections: HTTP/1.1 ones driven inline
//! ([`super::h1`]), HTTP/2 ones on `hyper::client::conn` (hyper-util's legacy pool cannot
//! cap requests per connection or lifetime, nor pre-connect).
//!
//! What it does so that a request never pays for a connect (seed 004: a spike on every 80th
//! request when the server sent `Connection: close`):
//! - HTTP/1.1: idle connections are kept most-recently-used first; the coldest expire after
//!   `idle_timeout` (kept below common server keep-alive timeouts).
//! - HTTP/2: a few connections shared by all requests ([`super::multiplex`]); a request
//!   takes a stream, and only opens a connection when every open one is at the server's
//!   stream limit. While one is being opened, requests wait for it rather than open more.
//! - Warm spares: a background task per endpoint keeps `min_warm` connections open (idle
//!   HTTP/1.1 ones, or open HTTP/2 ones), opening them at start and replacing each one as
//!   soon as it is taken, retired or closed; it also opens an HTTP/2 connection's successor
//!   when it is due for rotation.
//! - Rotation: a connection is retired after `max_requests` requests or `max_lifetime`,
//!   before the server's own limit; for HTTP/1.1 the server's limit is learned from its
//!   closes (the same count [`LEARN_AGREEMENTS`] times in a row) and the pool then rotates
//!   one request earlier. Without warm spares, a connection's successor is opened when it
//!   has one request left (when it is retired, under a cap of one request).
//! - `https://` endpoints: TCP, then a TLS handshake with the cluster's shared client config
//!   (see [`super::tls`]), so replacements resume the TLS session; all of the above works
//!   the same over TLS. With [`Protocol::Auto`], ALPN picks the protocol per connection.
//! - `max_connections_per_endpoint`: at most that many HTTP/1.1 connections open; past it
//!   requests queue for one (see [`super::limit`]).
//! - Every event is counted in [`PoolStats`].

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::net::TcpStream;
use tokio::sync::Notify;

use super::conn::{Conn, Protocol, Sender, handshake_h2};
use super::h1::{H1Conn, IdleGone, Transport};
use super::limit::{ConnLimit, ConnPermit, Handed, Turn, Waiting};
use super::multiplex::H2Set;
use super::tls::{EndpointTls, Handshake};
use crate::config::Cluster;
use crate::pipeline::body::ReqBody;
use crate::pipeline::error::ProxyError;

/// Closes in a row after the same number of successful requests that teach the server's
/// limit.
const LEARN_AGREEMENTS: u32 = 3;
/// A spare the server closes sooner than this after its connect, before any request was
/// sent on it, counts against the endpoint as a failed connect does (see
/// `EndpointPool::died_young`): a server that accepts and closes at once (at its own
/// connection limit, say) would otherwise have the keeper reopen its spares at every
/// request, several connects per request against a server already overloaded.
pub(super) const DIED_YOUNG: Duration = Duration::from_secs(1);
/// How long a learned limit is trusted before it is learned again.
const LEARNED_TTL: Duration = Duration::from_secs(600);
/// The longest between two looks over a pool's idle connections when no keeper runs: how
/// long a connection the server closed may sit in CLOSE_WAIT once traffic stops.
const SWEEP_TICK: Duration = Duration::from_secs(2);

/// An idle HTTP/1.1 connection and what the pool knows of it.
pub(super) struct Idle {
    conn: Box<H1Conn>,
    since: Instant,
    created: Instant,
    uses: u32,
}

/// Connection events of one endpoint on one worker.
#[derive(Debug, Default)]
pub struct PoolStats {
    /// Connections opened on a request's path (the request waited for the connect).
    pub connects_on_request: AtomicU64,
    /// Connections opened ahead of need (warm spares, replacements, HTTP/2 successors).
    pub preconnects: AtomicU64,
    /// Requests sent on a connection that already existed (for HTTP/2, a stream on an open
    /// connection).
    pub reuses: AtomicU64,
    pub retired_max_requests: AtomicU64,
    pub retired_lifetime: AtomicU64,
    pub retired_idle: AtomicU64,
    /// Idle connections closed because `max_idle_per_endpoint` were idle already.
    pub retired_idle_cap: AtomicU64,
    /// The server closed it (`Connection: close`, FIN, reset, or an HTTP/2 GOAWAY).
    pub closed_by_server: AtomicU64,
    /// HTTP/1.1 connections the gateway closed on their return because the exchange left
    /// them unusable (an answer before the upload ended, a failure once the answer was
    /// read), or because the server wrote bytes no request asked for. (Not one dropped
    /// with its exchange mid-response, its client gone: that one is never given back.)
    pub retired_unusable: AtomicU64,
    /// Requests sent again on a fresh connection after a pooled one failed.
    pub retries: AtomicU64,
    /// Requests the server refused before processing them (HTTP/2 `REFUSED_STREAM`, or
    /// above a GOAWAY's last stream id), sent again on a fresh connection.
    pub refused_resends: AtomicU64,
    /// Connects that failed: refused, timed out, or a failed TLS handshake.
    pub connect_failures: AtomicU64,
    /// TLS handshakes that paid the full price (certificate chain, key exchange).
    pub tls_full_handshakes: AtomicU64,
    /// TLS handshakes that resumed an earlier session (a ticket or session id).
    pub tls_resumed_handshakes: AtomicU64,
    /// TLS handshakes that failed (certificate not trusted, wrong name, protocol error);
    /// also counted in `connect_failures`.
    pub tls_handshake_failures: AtomicU64,
    /// HTTP/2 connections opened.
    pub h2_connections: AtomicU64,
    /// Requests that waited for an HTTP/2 connection being opened by another request
    /// instead of opening one more.
    pub h2_waits_for_connect: AtomicU64,
    /// The server's requests-per-connection limit as learned from its closes (0: none seen).
    pub learned_limit: AtomicU32,
    /// Requests that found `max_connections_per_endpoint` connections open and none idle,
    /// and queued for one.
    pub queued: AtomicU64,
    /// Queued requests that got no connection within the connect timeout (`503
    /// upstream_queue_timeout`).
    pub queue_timeouts: AtomicU64,
    /// Requests refused at once because 1024 (the queue's bound) were queued
    /// already (`503 upstream_queue_full`).
    pub queue_overflows: AtomicU64,
}

impl PoolStats {
    /// Adds every counter of `other` to these (not `learned_limit`, which is no count).
    fn add_from(&self, other: &PoolStats) {
        let add = |to: &AtomicU64, from: &AtomicU64| {
            to.fetch_add(from.load(Ordering::Relaxed), Ordering::Relaxed);
        };
        add(&self.connects_on_request, &other.connects_on_request);
        add(&self.preconnects, &other.preconnects);
        add(&self.reuses, &other.reuses);
        add(&self.retired_max_requests, &other.retired_max_requests);
        add(&self.retired_lifetime, &other.retired_lifetime);
        add(&self.retired_idle, &other.retired_idle);
        add(&self.retired_idle_cap, &other.retired_idle_cap);
        add(&self.closed_by_server, &other.closed_by_server);
        add(&self.retired_unusable, &other.retired_unusable);
        add(&self.retries, &other.retries);
        add(&self.refused_resends, &other.refused_resends);
        add(&self.connect_failures, &other.connect_failures);
        add(&self.tls_full_handshakes, &other.tls_full_handshakes);
        add(&self.tls_resumed_handshakes, &other.tls_resumed_handshakes);
        add(&self.tls_handshake_failures, &other.tls_handshake_failures);
        add(&self.h2_connections, &other.h2_connections);
        add(&self.h2_waits_for_connect, &other.h2_waits_for_connect);
        add(&self.queued, &other.queued);
        add(&self.queue_timeouts, &other.queue_timeouts);
        add(&self.queue_overflows, &other.queue_overflows);
    }
}

/// The counters of one address's drained pools, over every worker.
#[derive(Debug)]
pub struct GoneEndpoint {
    pub addr: SocketAddr,
    /// Pools of the address not drained yet, over every worker (live or parked, or being
    /// made).
    pools: usize,
    pub stats: PoolStats,
    /// Its outlier-detection ejections.
    pub ejections: u64,
}

/// What a cluster's drained pools counted, over every worker.
#[derive(Debug, Default)]
pub struct Gone {
    /// Addresses some worker has a pool for: the counts of those of their pools drained.
    pub by_addr: Vec<GoneEndpoint>,
    /// The counts of addresses no worker has a pool for any more (`endpoint="_removed"`).
    pub removed: Option<GoneEndpoint>,
}

impl Gone {
    /// A pool of `addr` is made (under the lock of the list it joins).
    fn register(&mut self, addr: SocketAddr) {
        match self.by_addr.iter_mut().find(|g| g.addr == addr) {
            Some(g) => g.pools += 1,
            None => self.by_addr.push(GoneEndpoint {
                addr,
                pools: 1,
                stats: PoolStats::default(),
                ejections: 0,
            }),
        }
    }

    /// A pool of `addr` is drained with these counts. Once no worker has a pool for the
    /// address, its counts go to `removed`, for good: an address that comes back starts a
    /// series of its own from zero (a counter reset, as a restart is), and `removed` never
    /// goes back.
    fn drained(&mut self, addr: SocketAddr, stats: &PoolStats, ejections: u64) {
        let Some(i) = self.by_addr.iter().position(|g| g.addr == addr) else {
            return;
        };
        let g = &mut self.by_addr[i];
        g.stats.add_from(stats);
        g.ejections += ejections;
        g.pools = g.pools.saturating_sub(1);
        if g.pools > 0 {
            return;
        }
        let g = self.by_addr.swap_remove(i);
        match &mut self.removed {
            Some(r) => {
                r.stats.add_from(&g.stats);
                r.ejections += g.ejections;
            }
            None => self.removed = Some(g),
        }
    }
}

/// The counts of a cluster's drained pools over every worker (one for the cluster, shared
/// by the workers), so that what `/metrics` sums per endpoint never goes back when a pool
/// is drained (each worker drains its own on its own tick), and memory stays bounded by the
/// addresses in use. A scrape reads every worker's pools of the cluster (live and parked)
/// and these under this lock, and a worker adds, drains, parks or brings back a pool under
/// it: a pool's counts show once, as a pool's or here, never both and never neither.
/// Taken by a worker only when the cluster's addresses change or a pool is drained, never
/// on a request's path, and never waited for there: a worker that finds it held tries
/// again later ([`GonePools::acquire`], or its pool's next tick). The scrape holds it on a
/// `SCHED_IDLE` thread, which a busy core may not run for a long while; a worker blocked on
/// it meanwhile would stall every request it serves.
#[derive(Debug, Default)]
pub struct GonePools(Mutex<Gone>);

impl GonePools {
    /// The lock, waited for: for the admin thread and tests, never a worker.
    pub fn lock(&self) -> MutexGuard<'_, Gone> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The lock if it is free now.
    pub fn try_lock(&self) -> Option<MutexGuard<'_, Gone>> {
        match self.0.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// The lock, for a worker's task: tried every millisecond while another holds it, the
    /// worker's runtime going on meanwhile.
    pub async fn acquire(&self) -> MutexGuard<'_, Gone> {
        loop {
            if let Some(g) = self.try_lock() {
                return g;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

/// The pool of one endpoint on one worker.
pub struct EndpointPool {
    pub addr: SocketAddr,
    pub stats: PoolStats,
    /// Load and health, for the balancer and outlier detection.
    pub load: super::balance::EndpointLoad,
    protocol: Protocol,
    // Held only for a push or pop, never across an await; one worker uses it.
    idle: Mutex<VecDeque<Idle>>,
    h2: H2Set,
    /// HTTP/2 connects under way, and their end (success or not).
    h2_connecting: AtomicU32,
    h2_opened: Notify,
    /// HTTP/2-capable connects that failed (their waiters fail with them, see
    /// [`Self::checkout_h2`]).
    h2_failed: AtomicU64,
    /// Connections found closed by the server before their first request (HTTP/1.1 spares,
    /// HTTP/2 connections before their first stream), within [`DIED_YOUNG`] of their
    /// connect: the keeper backs off as after a failed connect.
    died_young: AtomicU32,
    /// An HTTP/2 connection was made to this endpoint (for [`Protocol::Auto`]).
    h2_seen: AtomicBool,
    /// The server's concurrent-stream limit as its connections last heard it from the
    /// server, in their SETTINGS (`usize::MAX`: none yet, or no limit).
    h2_stream_limit: Arc<std::sync::atomic::AtomicUsize>,
    /// HTTP/2 PING interval (`None`: no pings).
    h2_keepalive_interval: Option<Duration>,
    max_idle: usize,
    idle_timeout: Duration,
    connect_timeout: Duration,
    max_requests: u32,
    max_lifetime: Option<Duration>,
    min_warm: usize,
    /// `Some` for an `https://` endpoint.
    tls: Option<EndpointTls>,
    /// Its handshake failures' warning, at most every 10 s (per endpoint and worker: each
    /// worker has its own pool).
    tls_warned: crate::pace::Every,
    /// Paces the warning for bytes from the server that no request asked for.
    stray_warned: crate::pace::Every,
    /// Wakes the warm keeper; shared with each HTTP/2 connection's task, which wakes it
    /// when the connection ends (the server closed it: a warm one is missing).
    refill: Arc<Notify>,
    /// When the first idle HTTP/1.1 connection expires (idle timeout or lifetime), in ms
    /// after `epoch`, as [`Self::idle_len`] last saw (`u64::MAX`: none idle): the keeper
    /// wakes then, so a spare that expires is replaced at once, not at its next tick.
    idle_next_ms: AtomicU64,
    /// Woken when a connection has one request left before its rotation (or is retired,
    /// under a cap of one) and no keeper runs to replace it (see [`Self::owe_ahead`]).
    ahead: Notify,
    /// Uses at the last server close after a success, how many closes in a row agreed on
    /// it, and when a limit was learned (seconds since `epoch`).
    close_uses: AtomicU32,
    close_agreements: AtomicU32,
    learned_at_s: AtomicU64,
    epoch: Instant,
    /// Replacements the keeper owes for busy connections that ended (see `owe_replacement`).
    owed: AtomicU32,
    /// Removed from its cluster (DNS): keeps no idle connections, opens no spares.
    retired: AtomicBool,
    /// Left out of its cluster's latest DNS answer since this many ms after `epoch`
    /// (`u64::MAX`: not parked): takes no new requests and opens no spares, but keeps its
    /// connections and state in case the address comes back (see
    /// `ClusterPools::set_addrs_locked`); its own task drains it after `idle_timeout`.
    parked_at_ms: AtomicU64,
    /// `max_connections_per_endpoint` (HTTP/1.1 connections), when set.
    limit: Option<Arc<ConnLimit>>,
    /// Where its counters go when it is drained (its cluster's, on this worker).
    gone: Arc<GonePools>,
}

impl EndpointPool {
    /// A pool of `addr`, counted among the address's pools in `gone` (its cluster's,
    /// `locked` by the caller, who puts the pool in the cluster's lists under that lock).
    pub fn new(
        addr: SocketAddr,
        cluster: &Cluster,
        gone: &Arc<GonePools>,
        locked: &mut Gone,
    ) -> EndpointPool {
        locked.register(addr);
        EndpointPool {
            gone: gone.clone(),
            addr,
            stats: PoolStats::default(),
            load: super::balance::EndpointLoad::new(
                cluster.eject_after_failures,
                cluster.eject_duration,
            ),
            protocol: cluster.protocol,
            idle: Mutex::new(VecDeque::new()),
            h2: H2Set::new(
                cluster.max_requests_per_connection,
                cluster.max_connection_lifetime,
            ),
            h2_connecting: AtomicU32::new(0),
            h2_opened: Notify::new(),
            h2_failed: AtomicU64::new(0),
            died_young: AtomicU32::new(0),
            h2_seen: AtomicBool::new(false),
            h2_stream_limit: Arc::new(std::sync::atomic::AtomicUsize::new(usize::MAX)),
            h2_keepalive_interval: cluster.http2_keepalive_interval,
            max_idle: cluster.max_idle_per_endpoint,
            idle_timeout: cluster.idle_timeout,
            connect_timeout: cluster.connect_timeout,
            max_requests: cluster.max_requests_per_connection,
            max_lifetime: cluster.max_connection_lifetime,
            min_warm: cluster.min_warm_connections,
            tls: cluster.tls.as_ref().map(|t| EndpointTls::new(t, addr)),
            tls_warned: crate::pace::Every::new(Duration::from_secs(10)),
            stray_warned: crate::pace::Every::new(Duration::from_secs(10)),
            refill: Arc::new(Notify::new()),
            ahead: Notify::new(),
            close_uses: AtomicU32::new(0),
            close_agreements: AtomicU32::new(0),
            learned_at_s: AtomicU64::new(0),
            epoch: Instant::now(),
            idle_next_ms: AtomicU64::new(u64::MAX),
            owed: AtomicU32::new(0),
            retired: AtomicBool::new(false),
            parked_at_ms: AtomicU64::new(u64::MAX),
            limit: (cluster.max_connections_per_endpoint > 0
                && cluster.protocol != Protocol::Http2)
                .then(|| ConnLimit::new(cluster.max_connections_per_endpoint)),
        }
    }

    /// HTTP/1.1 connections open now under `max_connections_per_endpoint` (`None`: no cap).
    pub fn capped_open(&self) -> Option<usize> {
        self.limit.as_ref().map(|l| l.open())
    }

    /// Sets the pool aside while its address is out of the cluster's DNS answer: its
    /// connections stay (they expire as idle ones do), the warm keeper opens no more, and
    /// its task (keeper or sweeper) drains it once it has been parked for `idle_timeout`.
    pub(super) fn park(&self) {
        let now = self.epoch.elapsed().as_millis() as u64;
        self.parked_at_ms.store(now, Ordering::Relaxed);
        // Requests queued for one of its connections go to an endpoint still in the answer.
        if let Some(limit) = &self.limit {
            limit.close();
        }
        self.refill.notify_one();
    }

    /// Its address is back: spares are kept again. False if it was drained meanwhile (it
    /// cannot come back then).
    pub(super) fn unpark(&self) -> bool {
        if self.retired.load(Ordering::Relaxed) {
            return false;
        }
        self.parked_at_ms.store(u64::MAX, Ordering::Relaxed);
        if let Some(limit) = &self.limit {
            limit.reopen();
        }
        self.refill.notify_one();
        true
    }

    /// Out of its cluster's DNS answer (drained or not).
    pub(super) fn is_parked(&self) -> bool {
        self.parked_at_ms.load(Ordering::Relaxed) != u64::MAX
    }

    /// Parked, and not drained yet.
    pub(super) fn is_parked_live(&self) -> bool {
        self.is_parked() && !self.retired.load(Ordering::Relaxed)
    }

    /// A parked pool's upkeep, from its own task: idle connections expired and those the
    /// server closed dropped (HTTP/2 ones too), and the pool drained once it has been
    /// parked for `idle_timeout`. True when it was drained (the task ends).
    fn parked_upkeep(&self) -> bool {
        let at = self.parked_at_ms.load(Ordering::Relaxed);
        if at == u64::MAX {
            return false;
        }
        let now = self.epoch.elapsed().as_millis() as u64;
        if now.saturating_sub(at) >= self.idle_timeout.as_millis() as u64 {
            // Held by a scrape: drained on a later tick instead (see `GonePools`).
            if let Some(mut gone) = self.gone.try_lock() {
                self.retire_into(&mut gone);
                return true;
            }
        }
        self.idle_len();
        if self.protocol != Protocol::Http1 {
            self.tidy_h2(self.idle_timeout, 0);
        }
        false
    }

    /// A place under `max_connections_per_endpoint`, as a connection opened would hold.
    #[cfg(test)]
    pub(super) fn take_place(&self) -> Option<ConnPermit> {
        self.limit.as_ref()?.try_take()
    }

    #[cfg(test)]
    pub(super) fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Relaxed)
    }

    /// Drains the pool of an endpoint removed from its cluster: idle connections close, the
    /// warm keeper stops, HTTP/2 connections take no new streams, connections still
    /// serving requests close when they finish, and requests queued for a connection
    /// (`max_connections_per_endpoint`) are let go to try another endpoint. Its counters
    /// are added to `gone` (its cluster's, locked by the caller, who takes it out of the
    /// cluster's lists under the same lock). Counted once: a request still in flight on it
    /// may count a little more, which is not shown.
    pub(super) fn retire_into(&self, gone: &mut Gone) {
        if !self.retired.swap(true, Ordering::Relaxed) {
            let ejections = self.load.ejections.load(Ordering::Relaxed);
            gone.drained(self.addr, &self.stats, ejections);
        }
        if let Some(limit) = &self.limit {
            limit.close();
        }
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        self.h2.clear();
        self.refill.notify_one();
    }

    /// PING interval and timeout for HTTP/2 connections: a ping unanswered within the
    /// connect timeout (both measure a round trip to the server) closes the connection.
    fn h2_keepalive(&self) -> Option<(Duration, Duration)> {
        self.h2_keepalive_interval
            .map(|interval| (interval, self.connect_timeout))
    }

    pub(super) fn idle_timeout(&self) -> Duration {
        self.idle_timeout
    }

    pub(super) fn tls_enabled(&self) -> bool {
        self.tls.is_some()
    }

    /// Requests a connection may serve: the configured cap, or one less than the server's
    /// learned limit, whichever is lower (0: no cap).
    fn request_cap(&self) -> u32 {
        let learned = self.stats.learned_limit.load(Ordering::Relaxed);
        let learned_cap = learned.saturating_sub(1);
        match (self.max_requests, learned_cap) {
            (0, l) => l,
            (c, 0) => c,
            (c, l) => c.min(l),
        }
    }

    pub(super) fn give_back(&self, conn: Conn, now: Instant) {
        let h1 = match conn.sender {
            // Dropping the slot frees the stream; the connection stays shared.
            Sender::H2(_) => return,
            Sender::H1(c) => c,
        };
        let uses = conn.uses + 1;
        if !h1.reusable() {
            // Only the server's own closes after a success teach its limit; the gateway's
            // (a body left unread, bytes after the response, a broken exchange) do not,
            // nor one that only ended a body with no length.
            if h1.peer_closed() {
                self.stats.closed_by_server.fetch_add(1, Ordering::Relaxed);
                if conn.response_ok && !h1.closed_to_end_a_body() {
                    self.learn_from_close(uses);
                }
            } else {
                self.stats.retired_unusable.fetch_add(1, Ordering::Relaxed);
                if h1.stray_bytes() {
                    self.warn_stray("after a response's end");
                }
            }
            self.owe_replacement();
            return;
        }
        let cap = self.request_cap();
        if cap > 0 && uses >= cap {
            self.expire_learned_limit();
            self.stats
                .retired_max_requests
                .fetch_add(1, Ordering::Relaxed);
            // A cap of one (`max_requests_per_connection = 1`, or a learned limit of two):
            // no use came before the last to open the successor ahead, so it is opened now.
            if cap == 1 {
                self.owe_ahead();
            }
            self.owe_replacement();
            return;
        }
        if cap > 0 && uses + 1 == cap {
            self.owe_ahead();
        }
        if self.past_lifetime(conn.created, now) {
            self.stats.retired_lifetime.fetch_add(1, Ordering::Relaxed);
            self.owe_replacement();
            return;
        }
        self.put(Idle {
            conn: h1,
            since: now,
            created: conn.created,
            uses,
        });
    }

    /// A close after `uses` successful responses. The same count [`LEARN_AGREEMENTS`] times
    /// in a row is the server's limit; closes after errors never count, so a burst of
    /// failures cannot teach a limit of one or two.
    fn learn_from_close(&self, uses: u32) {
        let prev = self.close_uses.swap(uses, Ordering::Relaxed);
        let agreeing = if prev == uses {
            self.close_agreements.fetch_add(1, Ordering::Relaxed) + 1
        } else {
            self.close_agreements.store(1, Ordering::Relaxed);
            1
        };
        if agreeing >= LEARN_AGREEMENTS {
            self.stats.learned_limit.store(uses, Ordering::Relaxed);
            self.learned_at_s
                .store(self.epoch.elapsed().as_secs(), Ordering::Relaxed);
        }
    }

    /// A learned limit is forgotten after [`LEARNED_TTL`] (checked when a connection is
    /// rotated by it): if the server's limit was raised, tailgate learns the new one; if not,
    /// the server's next closes teach the same one again at no cost to a request (its
    /// closes are graceful and the connection is replaced in the background).
    fn expire_learned_limit(&self) {
        if self.stats.learned_limit.load(Ordering::Relaxed) > 0
            && self.epoch.elapsed().as_secs()
                >= self.learned_at_s.load(Ordering::Relaxed) + LEARNED_TTL.as_secs()
        {
            self.stats.learned_limit.store(0, Ordering::Relaxed);
            self.close_agreements.store(0, Ordering::Relaxed);
        }
    }

    /// A busy connection ended (rotated, or closed by the server): with warm spares on, the
    /// keeper opens one in its place, so rotation never shrinks the pool below the size its
    /// traffic grew it to (only idle expiry does) and a burst still finds warm connections.
    fn owe_replacement(&self) {
        if self.min_warm > 0 {
            let _ = self
                .owed
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                    // (Compared as `usize`: a cap past `u32::MAX` cut to `u32` could be 0.)
                    ((n as usize) < self.max_idle).then_some(n + 1)
                });
        }
        self.refill.notify_one();
    }

    /// A connection has one request left before its rotation. With no warm spares kept
    /// (`min_warm_connections` 0, the default), nothing would open its successor before
    /// the request after that one needs it, and that request would pay for the connect
    /// the rotation was to spare it (seed 004's spike, one request earlier): the successor
    /// is opened now, in the background, ready when the connection is retired. (With warm
    /// spares the keeper replaces it, and a spare is there meanwhile.) Under a cap of one
    /// request, called when the connection is retired: no use came before the last.
    fn owe_ahead(&self) {
        if self.min_warm > 0 {
            return;
        }
        let owed = self
            .owed
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                ((n as usize) < self.max_idle).then_some(n + 1)
            });
        if owed.is_ok() {
            // The keeper of an `auto` or `http2` endpoint, or the sweeper of an `http1` one.
            self.refill.notify_one();
            self.ahead.notify_one();
        }
    }

    /// Takes one owed replacement, if any.
    fn take_owed(&self) -> bool {
        self.owed
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok()
    }

    /// An idle connection goes to the first request queued for one, if any, else to the
    /// idle list.
    pub(super) fn put(&self, idle: Idle) {
        self.put_at(idle, false);
    }

    /// [`put`](Self::put), as the coldest idle connection when `last`: taken after every
    /// other (a successor opened ahead of a rotation must not take its predecessor's last
    /// request; the predecessor, left idle short of its cap, would never be rotated).
    fn put_at(&self, idle: Idle, last: bool) {
        let idle = match &self.limit {
            Some(limit) => match limit.hand_idle(idle) {
                Some(idle) => idle,
                None => return,
            },
            None => idle,
        };
        if self.retired.load(Ordering::Relaxed) {
            return;
        }
        if self.max_idle == 0 {
            self.stats.retired_idle_cap.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let mut list = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        while list
            .front()
            .is_some_and(|i| idle.since.duration_since(i.since) >= self.idle_timeout)
        {
            list.pop_front();
            self.stats.retired_idle.fetch_add(1, Ordering::Relaxed);
        }
        if list.len() >= self.max_idle {
            self.stats.retired_idle_cap.fetch_add(1, Ordering::Relaxed);
            // A spare opened ahead, with the list full of warm ones, is not needed.
            if last {
                return;
            }
            list.pop_front();
        }
        if last {
            list.push_front(idle);
        } else {
            list.push_back(idle);
        }
    }

    /// The most recently used idle connection, and how many stay idle after it.
    fn pop(&self) -> Option<(Idle, usize)> {
        let mut list = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let idle = list.pop_back()?;
        Some((idle, list.len()))
    }

    /// At its `max_connections_per_endpoint` with none of those idle (and no HTTP/2 seen,
    /// whose streams need no place): a request sent here now would queue. Without the
    /// setting, a branch.
    pub(super) fn is_full(&self) -> bool {
        self.limit.as_ref().is_some_and(|l| l.is_full())
            && !self.h2_seen.load(Ordering::Relaxed)
            && self
                .idle
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_empty()
    }

    /// A reused connection from [`Self::checkout_at`] was taken from the idle list without
    /// waiting: only HTTP/1.1 connections (no wait for an HTTP/2 one being opened), and no
    /// `max_connections_per_endpoint` (no wait in its queue).
    pub fn reuse_never_waits(&self) -> bool {
        self.protocol == Protocol::Http1 && self.limit.is_none()
    }

    /// A ready connection: a stream on a shared HTTP/2 connection, or the most recently used
    /// idle HTTP/1.1 one that is still open, else a new one.
    /// (Queued under `max_connections_per_endpoint`, in the lane of no tenant.)
    pub async fn checkout(self: &Arc<Self>) -> Result<Conn, ProxyError> {
        self.checkout_at(Instant::now(), None).await
    }

    /// [`Self::checkout`] at `now`, a clock reading the caller already took (the request
    /// path's stage timing), so a request reads the clock once fewer; a wait under
    /// `max_connections_per_endpoint` is in `tenant`'s lane of the queue.
    pub async fn checkout_at(
        self: &Arc<Self>,
        mut now: Instant,
        tenant: Option<usize>,
    ) -> Result<Conn, ProxyError> {
        if self.h2_possible() {
            if let Some(conn) = self.checkout_h2().await? {
                return Ok(conn);
            }
            // The HTTP/2 path may have waited for a connection being opened.
            now = Instant::now();
        }
        while let Some((mut idle, left)) = self.pop() {
            if now.saturating_duration_since(idle.since) >= self.idle_timeout {
                self.stats.retired_idle.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            // Closed by the server while idle (seen from the readiness the runtime holds,
            // without a system call).
            if let Some(gone) = idle.conn.idle_gone() {
                self.count_idle_gone(gone);
                self.note_died_young(&idle);
                continue;
            }
            // Aged out while idle: never send on a connection past its lifetime.
            if self.past_lifetime(idle.created, now) {
                self.stats.retired_lifetime.fetch_add(1, Ordering::Relaxed);
                self.owe_replacement();
                continue;
            }
            // Wake the keeper only when the spares run low, not on every request.
            if left < self.min_warm {
                self.refill.notify_one();
            }
            return Ok(self.reuse(idle));
        }
        let permit = match &self.limit {
            None => None,
            Some(limit) => match limit.take_or_queue(tenant) {
                Turn::Now(p) => Some(p),
                Turn::Closed => return Err(ProxyError::EndpointRemoved),
                Turn::Full => {
                    self.stats.queue_overflows.fetch_add(1, Ordering::Relaxed);
                    return Err(ProxyError::UpstreamQueueFull);
                }
                Turn::Queued(rx) => match self.wait_turn(rx).await? {
                    // Handed straight from the request that gave it back, as the idle list
                    // would give it: unless the server closed it or wrote to it meanwhile
                    // (while the rest of an early-answered upload went out, say). Then its
                    // place is taken for a new one.
                    Handed::Idle(mut idle) => {
                        let Some(gone) = idle.conn.idle_gone() else {
                            return Ok(self.reuse(idle));
                        };
                        self.count_idle_gone(gone);
                        idle.conn.take_permit()
                    }
                    // An endpoint that speaks HTTP/2 (`auto`) may have a stream free by
                    // now: taken rather than another connection opened.
                    // (Without waiting for a connect under way: this place would be held
                    // meanwhile.)
                    Handed::Room(p) => {
                        if self.h2_seen.load(Ordering::Relaxed)
                            && let Some(conn) = self.take_h2_stream()
                        {
                            return Ok(conn);
                        }
                        Some(p)
                    }
                },
            },
        };
        self.refill.notify_one();
        self.connect_on_request(permit).await
    }

    /// A connect on a request's path (a checkout that found none idle, or a replacement
    /// for a connection that failed under a request), counted once it opened: one refused
    /// or timed out is a connect failure (`connect_failures`), not a connection.
    pub(super) async fn connect_on_request(
        self: &Arc<Self>,
        permit: Option<ConnPermit>,
    ) -> Result<Conn, ProxyError> {
        let conn = self.connect_with(permit).await?;
        self.stats
            .connects_on_request
            .fetch_add(1, Ordering::Relaxed);
        Ok(conn)
    }

    /// Waits in the queue of `max_connections_per_endpoint` for a connection given back or
    /// a place freed, up to the connect timeout.
    async fn wait_turn(
        &self,
        rx: tokio::sync::oneshot::Receiver<Handed>,
    ) -> Result<Handed, ProxyError> {
        self.stats.queued.fetch_add(1, Ordering::Relaxed);
        let mut waiting = Waiting { rx, pool: self };
        match tokio::time::timeout(self.connect_timeout, &mut waiting.rx).await {
            Ok(Ok(handed)) => Ok(handed),
            // Let go unsent: the address left the cluster's answer (the pool was parked or
            // drained).
            Ok(Err(_)) => Err(ProxyError::EndpointRemoved),
            Err(_) => {
                self.stats.queue_timeouts.fetch_add(1, Ordering::Relaxed);
                Err(ProxyError::UpstreamQueueTimeout)
            }
        }
    }

    /// May a request find an HTTP/2 connection here: an `http2` endpoint, or an `auto` one
    /// whose server has picked HTTP/2. An `auto` endpoint speaking HTTP/1.1 has none to
    /// look at, nor to keep warm: looking woke the keeper at every request (its count of
    /// fresh HTTP/2 connections, none, always short of `min_warm_connections`).
    fn h2_possible(&self) -> bool {
        self.protocol == Protocol::Http2
            || self.protocol == Protocol::Auto && self.h2_seen.load(Ordering::Relaxed)
    }

    /// A stream on an open HTTP/2 connection. While none has room and one is being opened,
    /// waits for it (up to the connect timeout in all) rather than open another: a burst
    /// on a cold endpoint shares one new connection. `None`: the caller opens one.
    ///
    /// When the connects waited for failed (none is under way any more, and one failed
    /// meanwhile), or the wait reaches the connect timeout with one failed, the request
    /// fails as that connect did (and fails over as a request whose own connect failed):
    /// opening a connect of its own each would turn a burst on an endpoint that hangs (a
    /// SYN dropped, a TLS handshake never answered) into a connect per request, each
    /// request waiting twice the connect timeout. A wait that reaches the connect timeout
    /// while connects succeed (a burst past a connection's stream limit opens one after
    /// another) waits again for the one under way.
    async fn checkout_h2(self: &Arc<Self>) -> Result<Option<Conn>, ProxyError> {
        if !self.h2_possible() {
            return Ok(None);
        }
        let mut deadline: Option<Instant> = None;
        let failed_before = self.h2_failed.load(Ordering::Relaxed);
        let failed = || self.h2_failed.load(Ordering::Relaxed) != failed_before;
        loop {
            // Idle expiry is the keeper's job (`Duration::MAX` here): a request only drops
            // closed connections and hands over rotated ones.
            let (fresh, due) = self.tidy_h2(Duration::MAX, self.min_warm);
            if fresh < self.min_warm || (fresh == 0 && due > 0) {
                self.refill.notify_one();
            }
            if let Some(conn) = self.take_h2_stream() {
                return Ok(Some(conn));
            }
            if self.h2_connecting.load(Ordering::Relaxed) == 0 {
                // The server allows no stream now (`SETTINGS_MAX_CONCURRENT_STREAMS` 0) on
                // any connection open to it: a connection per request would be told the
                // same. As with no connection to be had, another endpoint may be tried
                // (nothing was sent). The keeper replaces such a connection after a
                // second (`multiplex::REFUSING_FOR`): behind a load balancer the next may
                // reach a server that takes streams.
                if self.h2.all_refuse(self.h2_said_zero()) {
                    return Err(ProxyError::UpstreamConnect(std::io::Error::other(
                        "the upstream's HTTP/2 server takes no new streams now (its SETTINGS_MAX_CONCURRENT_STREAMS is 0)",
                    )));
                }
                // (A spare of the keeper's that failed while the request's connect was
                // under way is no reason: only once none is left.)
                if deadline.is_some() && failed() {
                    return Err(ProxyError::UpstreamConnect(std::io::Error::other(
                        "the connection this request waited for failed to open",
                    )));
                }
                return Ok(None);
            }
            let now = Instant::now();
            if deadline.is_none() {
                self.stats
                    .h2_waits_for_connect
                    .fetch_add(1, Ordering::Relaxed);
            }
            let until = *deadline.get_or_insert(now + self.connect_timeout);
            let mut left = until.saturating_duration_since(now);
            if left.is_zero() {
                if failed() {
                    return Err(ProxyError::ConnectTimeout);
                }
                deadline = Some(now + self.connect_timeout);
                left = self.connect_timeout;
            }
            // Registered before the next await, so the end of that connect is not missed
            // (this worker runs nothing else in between).
            let opened = self.h2_opened.notified();
            let _ = tokio::time::timeout(left, opened).await;
        }
    }

    /// An idle HTTP/1.1 connection taken for a request (counted as a reuse).
    fn reuse(self: &Arc<Self>, idle: Idle) -> Conn {
        self.stats.reuses.fetch_add(1, Ordering::Relaxed);
        Conn {
            sender: Sender::H1(idle.conn),
            pool: self.clone(),
            reused: true,
            created: idle.created,
            uses: idle.uses,
            response_ok: false,
            _slot: None,
            h2_progress: None,
        }
    }

    /// A stream on an open HTTP/2 connection with room for one, if any (no wait).
    fn take_h2_stream(self: &Arc<Self>) -> Option<Conn> {
        let (sender, slot, created) = self.h2.take(self.h2_said_zero())?;
        self.stats.reuses.fetch_add(1, Ordering::Relaxed);
        Some(Conn {
            sender: Sender::H2(sender),
            pool: self.clone(),
            reused: true,
            created,
            uses: 0,
            response_ok: false,
            _slot: Some(slot),
            h2_progress: None,
        })
    }

    /// Did the server say it allows no stream, on the last connection to give its word?
    fn h2_said_zero(&self) -> bool {
        self.h2_stream_limit.load(Ordering::Relaxed) == 0
    }

    /// Takes no new streams on the HTTP/2 connection `slot` is on.
    pub(super) fn forget_h2(&self, slot: &super::multiplex::StreamSlot) {
        self.h2.forget(slot);
    }

    /// Counts a request sent again after a failure.
    pub fn count_retry(&self) {
        self.stats.retries.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a request sent again because the server refused it unprocessed.
    pub fn count_refused_resend(&self) {
        self.stats.refused_resends.fetch_add(1, Ordering::Relaxed);
    }

    /// A new connection, bypassing the idle list (an HTTP/2 one joins the shared set).
    ///
    /// The connect's state (TCP, TLS and HTTP/2 handshakes: kilobytes) lives on the heap,
    /// allocated only when a connect happens: inline, it would make every future that may
    /// connect (a checkout, and so each request's) that large, and moving those costs a
    /// copy of it on every request.
    ///
    /// Under `max_connections_per_endpoint` an HTTP/1.1 connection holds `permit`, its
    /// place (taken or handed on by the caller).
    pub(super) async fn connect_with(
        self: &Arc<Self>,
        permit: Option<ConnPermit>,
    ) -> Result<Conn, ProxyError> {
        Box::pin(self.connect_inline(permit)).await
    }

    async fn connect_inline(
        self: &Arc<Self>,
        permit: Option<ConnPermit>,
    ) -> Result<Conn, ProxyError> {
        let conn = match self.open(true, permit).await? {
            Opened::H1(s) => Conn {
                sender: Sender::H1(s),
                pool: self.clone(),
                reused: false,
                created: Instant::now(),
                uses: 0,
                response_ok: false,
                _slot: None,
                h2_progress: None,
            },
            Opened::H2(sender, slot, created) => Conn {
                sender: Sender::H2(sender),
                pool: self.clone(),
                reused: false,
                created,
                uses: 0,
                response_ok: false,
                _slot: slot,
                h2_progress: None,
            },
        };
        Ok(conn)
    }

    /// Opens a connection and runs the handshakes. An HTTP/2 one joins the shared set (with
    /// a stream taken on it when `take`), and the requests waiting for it are woken.
    async fn open(&self, take: bool, permit: Option<ConnPermit>) -> Result<Opened, ProxyError> {
        // Counted while under way, and announced when it ends — also when the request that
        // opened it goes away mid-connect (the guard's drop), or the waiters would wait for
        // a connect that never ends.
        let _announce = (self.protocol != Protocol::Http1).then(|| H2Connecting::start(self));
        match self.open_inner().await {
            Ok(Handshaken::H1(mut s)) => {
                s.hold(permit);
                Ok(Opened::H1(s))
            }
            Ok(Handshaken::H2(s, max)) => {
                self.h2_seen.store(true, Ordering::Relaxed);
                self.stats.h2_connections.fetch_add(1, Ordering::Relaxed);
                Ok(if take {
                    let (sender, slot, created) = self.h2.add_and_take(s, max);
                    Opened::H2(sender, Some(slot), created)
                } else {
                    let created = self.h2.add(s.clone(), max);
                    Opened::H2(s, None, created)
                })
            }
            Err(e) => {
                // (Before the guard's drop wakes the requests waiting for it.)
                if self.protocol != Protocol::Http1 {
                    self.h2_failed.fetch_add(1, Ordering::Relaxed);
                }
                Err(e)
            }
        }
    }

    async fn open_inner(&self) -> Result<Handshaken, ProxyError> {
        // The connect timeout covers the TLS handshake too: a server that accepts and then
        // stalls must not hold a request (or the warm keeper) forever.
        let dialed = tokio::time::timeout(self.connect_timeout, self.dial()).await;
        match dialed {
            Ok(Ok(io)) => {
                let h2 = match (self.protocol, &io) {
                    (Protocol::Http2, _) => true,
                    (Protocol::Auto, Transport::Tls(s)) => {
                        s.get_ref().1.alpn_protocol() == Some(b"h2")
                    }
                    _ => false,
                };
                if h2 {
                    self.handshake_h2(io).await
                } else {
                    Ok(Handshaken::H1(Box::new(H1Conn::new(io))))
                }
            }
            Ok(Err(e)) => {
                self.stats.connect_failures.fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
            Err(_) => {
                self.stats.connect_failures.fetch_add(1, Ordering::Relaxed);
                Err(ProxyError::ConnectTimeout)
            }
        }
    }

    async fn handshake_h2<I>(&self, io: I) -> Result<Handshaken, ProxyError>
    where
        I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let limit = self.h2_stream_limit.clone();
        let (sender, max) = handshake_h2(
            io,
            self.addr,
            limit,
            self.h2_keepalive(),
            self.refill.clone(),
        )
        .await?;
        Ok(Handshaken::H2(sender, max))
    }

    /// TCP connect, then the TLS handshake for an `https://` endpoint.
    async fn dial(&self) -> Result<Transport, ProxyError> {
        let tcp = TcpStream::connect(self.addr)
            .await
            .map_err(ProxyError::UpstreamConnect)?;
        let _ = tcp.set_nodelay(true);
        let Some(tls) = &self.tls else {
            return Ok(Transport::Tcp(tcp));
        };
        // `protocol = "http2"` offers only `h2` by ALPN; a server that ignores ALPN (an
        // HTTP/1.1-only one, TLS set up with no protocols) completes the handshake with
        // none chosen, and the HTTP/2 preface it would get answers nothing it can read:
        // every request failed as an `upstream_reset`, nothing saying why.
        let handshake = tls.handshake(tcp).await.and_then(|(s, kind)| {
            let h2_refused = self.protocol == Protocol::Http2
                && s.get_ref().1.alpn_protocol() != Some(b"h2".as_slice());
            if h2_refused {
                return Err(std::io::Error::other(
                    "the server chose no `h2` by ALPN (protocol = \"http2\" over TLS needs it; \"auto\" speaks what it chooses)",
                ));
            }
            Ok((s, kind))
        });
        match handshake {
            Ok((s, kind)) => {
                let counter = match kind {
                    Handshake::Full => &self.stats.tls_full_handshakes,
                    Handshake::Resumed => &self.stats.tls_resumed_handshakes,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                Ok(Transport::Tls(Box::new(s)))
            }
            Err(e) => {
                self.stats
                    .tls_handshake_failures
                    .fetch_add(1, Ordering::Relaxed);
                // The reason is the operator's (a client's 502 does not carry it): a
                // warning, at most every 10 s per endpoint, the rest at debug.
                if self.tls_warned.due() {
                    tracing::warn!(upstream.addr = %self.addr, error = %e, "upstream TLS handshake failed");
                } else {
                    tracing::debug!(upstream.addr = %self.addr, error = %e, "upstream TLS handshake failed");
                }
                Err(ProxyError::UpstreamTls(e))
            }
        }
    }

    /// Keeps `min_warm` connections open, for as long as the worker runs: opens them at
    /// start, and replaces each one taken, retired or closed; opens an HTTP/2 connection's
    /// successor when it is due for rotation. Backs off while the endpoint refuses
    /// connections.
    pub async fn keep_warm(self: Arc<Self>) {
        if self.min_warm == 0 && self.protocol == Protocol::Http1 {
            return self.sweep_idle().await;
        }
        let mut backoff = Duration::from_millis(100);
        // When a spare last died young (see `died_young`).
        let mut last_death: Option<Instant> = None;
        loop {
            if self.retired.load(Ordering::Relaxed) {
                return;
            }
            if self.parked_upkeep() {
                return;
            }
            while !self.retired.load(Ordering::Relaxed) && !self.is_parked() {
                let missing = self.warm_missing();
                if !missing && self.owed.load(Ordering::Relaxed) == 0 {
                    break;
                }
                // Spares the server closed as soon as they were opened: backed off as
                // after a failed connect, until none has died so for a while. (Before a
                // place is taken: none is held while it sleeps.)
                if self.died_young.swap(0, Ordering::Relaxed) > 0 {
                    tracing::debug!(upstream.addr = %self.addr, "warm connections closed by the server as soon as opened; backing off");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    last_death = Some(Instant::now());
                    continue;
                } else if last_death.is_some_and(|at| at.elapsed() >= DIED_YOUNG * 5) {
                    last_death = None;
                    backoff = Duration::from_millis(100);
                }
                // Spares take a place under `max_connections_per_endpoint` too; with none
                // free, the connections open are in use, and none is missing (an owed
                // replacement is kept for when one is).
                let permit = match &self.limit {
                    None => None,
                    Some(limit) => match limit.try_take() {
                        Some(p) => Some(p),
                        None => break,
                    },
                };
                if !missing && !self.take_owed() {
                    break;
                }
                match self.open(false, permit).await {
                    Ok(Opened::H1(conn)) => {
                        // Without warm spares, opened only ahead of a rotation.
                        self.put_spare(conn, self.min_warm == 0);
                        if last_death.is_none() {
                            backoff = Duration::from_millis(100);
                        }
                    }
                    Ok(Opened::H2(..)) => {
                        self.stats.preconnects.fetch_add(1, Ordering::Relaxed);
                        // (A handshake is done once the preface is written: one the server
                        // closes at once is seen later, as one that died young.)
                        if last_death.is_none() {
                            backoff = Duration::from_millis(100);
                        }
                    }
                    Err(e) => {
                        tracing::debug!(upstream.addr = %self.addr, error = %e, "warm connection failed");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(5));
                    }
                }
            }
            // Woken when a take leaves too few spares, at a retirement and a close, and when
            // the first idle connection expires; the tick catches the rest.
            let _ = tokio::time::timeout(self.keeper_wait(), self.refill.notified()).await;
        }
    }

    /// With no connection to keep warm: only looks over the idle HTTP/1.1 connections now
    /// and then, so that those past `idle_timeout` and those the server closed (left in
    /// CLOSE_WAIT) are closed when traffic stops, not at the next request. On a timer of its
    /// own, not woken by the requests' takes (that would be a task wake-up per request).
    ///
    /// Woken also, once per rotation, to open a connection's successor ahead of it
    /// ([`Self::owe_ahead`]).
    async fn sweep_idle(self: Arc<Self>) {
        let tick = self
            .idle_timeout
            .clamp(Duration::from_millis(100), SWEEP_TICK);
        loop {
            let _ = tokio::time::timeout(tick, self.ahead.notified()).await;
            if self.retired.load(Ordering::Relaxed) || self.parked_upkeep() {
                return;
            }
            self.idle_len();
            while !self.is_parked() && self.owed.load(Ordering::Relaxed) > 0 {
                // A place under `max_connections_per_endpoint` too; with none free, the
                // connections open are in use and the rotated one's place will be its
                // successor's then: the debt is let go (kept, it would open a connection
                // nobody needs later).
                let permit = match &self.limit {
                    None => None,
                    Some(limit) => match limit.try_take() {
                        Some(p) => Some(p),
                        None => {
                            self.take_owed();
                            break;
                        }
                    },
                };
                if !self.take_owed() {
                    break;
                }
                match self.open(false, permit).await {
                    Ok(Opened::H1(conn)) => self.put_spare(conn, true),
                    // (An `http1` endpoint opens no HTTP/2 connection.)
                    Ok(Opened::H2(..)) => {}
                    Err(e) => {
                        tracing::debug!(upstream.addr = %self.addr, error = %e, "connection opened ahead of a rotation failed");
                        break;
                    }
                }
            }
        }
    }

    /// A connection opened ahead of need goes idle (counted as a preconnect); `last`: taken
    /// after every other (see [`Self::put_at`]).
    fn put_spare(&self, conn: Box<H1Conn>, last: bool) {
        self.stats.preconnects.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        let idle = Idle {
            conn,
            since: now,
            created: now,
            uses: 0,
        };
        self.put_at(idle, last);
    }

    /// How often the keeper looks without being woken: often enough to see idle expiry and,
    /// for HTTP/2, a connection's lifetime running out.
    fn keeper_tick(&self) -> Duration {
        let lifetime = self.max_lifetime.map_or(Duration::MAX, |l| l / 2);
        self.idle_timeout
            .min(lifetime)
            .max(Duration::from_millis(100))
    }

    /// Is a connection opened at `created` past `max_connection_lifetime` at `now`?
    fn past_lifetime(&self, created: Instant, now: Instant) -> bool {
        self.max_lifetime
            .is_some_and(|l| now.saturating_duration_since(created) >= l)
    }

    /// The HTTP/2 connections tidied ([`H2Set::tidy`]): those closed dropped (counted as
    /// died young before their first stream), those idle past `idle_timeout` beyond `keep`;
    /// how many are fresh and how many due for rotation.
    fn tidy_h2(&self, idle_timeout: Duration, keep: usize) -> (usize, usize) {
        self.h2
            .tidy(&self.stats, idle_timeout, keep, &self.died_young)
    }

    /// How long the keeper sleeps unless woken: its tick, or until the first idle
    /// connection expires if sooner.
    fn keeper_wait(&self) -> Duration {
        let tick = self.keeper_tick();
        let next = self.idle_next_ms.load(Ordering::Relaxed);
        if next == u64::MAX {
            return tick;
        }
        let now = self.epoch.elapsed().as_millis() as u64;
        tick.min(Duration::from_millis(next.saturating_sub(now).max(1)))
    }

    /// Does the keeper need to open a connection: fewer than `min_warm` ready, or an HTTP/2
    /// connection due for rotation with no successor yet?
    fn warm_missing(&self) -> bool {
        let (fresh, due) = if self.protocol == Protocol::Http1 {
            (0, 0)
        } else {
            self.tidy_h2(self.idle_timeout, self.min_warm)
        };
        let idle = if self.protocol == Protocol::Http2 {
            0
        } else {
            self.idle_len()
        };
        idle + fresh < self.min_warm || (fresh == 0 && due > 0)
    }

    /// An idle connection found closed by the server: one that never carried a request and
    /// lived less than [`DIED_YOUNG`] is noted for the keeper's backoff. (The clock is read
    /// only for such a one: `idle_len` runs at each wake of the keeper.)
    fn note_died_young(&self, idle: &Idle) {
        if idle.uses == 0 && idle.created.elapsed() < DIED_YOUNG {
            self.died_young.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// An idle HTTP/1.1 connection found unusable: closed by the server, or written to
    /// with no request out (counted as closed by the gateway, with a warning).
    fn count_idle_gone(&self, gone: IdleGone) {
        match gone {
            IdleGone::Closed => {
                self.stats.closed_by_server.fetch_add(1, Ordering::Relaxed);
            }
            IdleGone::Stray => {
                self.stats.retired_unusable.fetch_add(1, Ordering::Relaxed);
                self.warn_stray("on an idle connection");
            }
        }
    }

    /// Bytes from the server that no request asked for: a protocol violation worth an
    /// operator's look (at most one warning per endpoint every 10 s; the rest at debug).
    fn warn_stray(&self, when: &'static str) {
        if self.stray_warned.due() {
            tracing::warn!(upstream.addr = %self.addr, when, "upstream sent bytes no request asked for; connection closed");
        } else {
            tracing::debug!(upstream.addr = %self.addr, when, "upstream sent bytes no request asked for; connection closed");
        }
    }

    /// Idle HTTP/1.1 connections held now (still open, and usable by a checkout).
    /// Those the server closed count as `closed_by_server` (written to, as
    /// `retired_unusable`), those past `idle_timeout` as `retired_idle`, those past
    /// `max_connection_lifetime` as `retired_lifetime`, as at a checkout.
    pub fn idle_len(&self) -> usize {
        let mut list = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let (mut closed, mut stray, mut expired, mut aged) = (0u64, 0u64, 0u64, 0u64);
        let now = Instant::now();
        let mut next: Option<Instant> = None;
        list.retain_mut(|i| {
            if let Some(gone) = i.conn.idle_gone() {
                match gone {
                    IdleGone::Closed => closed += 1,
                    IdleGone::Stray => stray += 1,
                }
                self.note_died_young(i);
                false
            } else if now.saturating_duration_since(i.since) >= self.idle_timeout {
                expired += 1;
                false
            } else if self.past_lifetime(i.created, now) {
                // A checkout would not send on it: not a spare (the keeper opens one in
                // its place).
                aged += 1;
                false
            } else {
                let at = i.since + self.idle_timeout;
                let at = self.max_lifetime.map_or(at, |l| at.min(i.created + l));
                next = Some(next.map_or(at, |n| n.min(at)));
                true
            }
        });
        // Rounded up: woken then, the connection has expired.
        let next_ms = next.map_or(u64::MAX, |n| {
            n.saturating_duration_since(self.epoch).as_millis() as u64 + 1
        });
        self.idle_next_ms.store(next_ms, Ordering::Relaxed);
        if aged > 0 {
            self.stats
                .retired_lifetime
                .fetch_add(aged, Ordering::Relaxed);
        }
        if expired > 0 {
            self.stats
                .retired_idle
                .fetch_add(expired, Ordering::Relaxed);
        }
        if closed > 0 {
            self.stats
                .closed_by_server
                .fetch_add(closed, Ordering::Relaxed);
        }
        let len = list.len();
        drop(list);
        if stray > 0 {
            self.stats
                .retired_unusable
                .fetch_add(stray, Ordering::Relaxed);
            self.warn_stray("on an idle connection");
        }
        len
    }
}

/// An HTTP/2-capable connect under way: counted while it lives; its end (success, failure or
/// cancellation) wakes the requests waiting for it.
struct H2Connecting<'a>(&'a EndpointPool);

impl<'a> H2Connecting<'a> {
    fn start(pool: &'a EndpointPool) -> H2Connecting<'a> {
        pool.h2_connecting.fetch_add(1, Ordering::Relaxed);
        H2Connecting(pool)
    }
}

impl Drop for H2Connecting<'_> {
    fn drop(&mut self) {
        self.0.h2_connecting.fetch_sub(1, Ordering::Relaxed);
        self.0.h2_opened.notify_waiters();
    }
}

/// A connection after its HTTP handshake.
enum Handshaken {
    H1(Box<H1Conn>),
    /// With what its transport and task publish (the server's concurrent-stream limit as
    /// the task last saw it, the reads).
    H2(
        hyper::client::conn::http2::SendRequest<ReqBody>,
        Arc<super::multiplex::H2Live>,
    ),
}

/// A connection just opened.
enum Opened {
    H1(Box<H1Conn>),
    /// Its sender, the stream taken on it (if asked for), and when it was opened.
    H2(
        hyper::client::conn::http2::SendRequest<ReqBody>,
        Option<super::multiplex::StreamSlot>,
        Instant,
    ),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool for `https://{addr}` with `extra` cluster settings (a CA of its own, which
    /// no server here speaks); the directory holds the CA file while the pool lives.
    fn tls_pool(addr: SocketAddr, extra: &str) -> (Arc<EndpointPool>, tempfile::TempDir) {
        let ck = rcgen::generate_simple_self_signed(vec!["ca.test".to_owned()]).expect("cert");
        let tmp = tempfile::Builder::new()
            .prefix("tailgate-pool-")
            .tempdir()
            .expect("dir");
        std::fs::write(tmp.path().join("ca.pem"), ck.cert.pem()).expect("write");
        let text = format!(
            "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"https://{addr}\"]\ntls_ca = \"ca.pem\"\n{extra}\n"
        );
        let cfg = crate::Config::parse(&tmp.path().join("t.toml"), &text).expect("valid config");
        let gone = Arc::default();
        let pool = Arc::new(EndpointPool::new(
            addr,
            &cfg.clusters[0],
            &gone,
            &mut gone.lock(),
        ));
        (pool, tmp)
    }

    /// A request that goes away while its connect is under way must not leave the pool
    /// believing a connect is still coming (later requests would wait for it in vain).
    #[tokio::test]
    async fn a_cancelled_connect_is_no_longer_awaited() {
        // Accepts TCP and never answers the TLS handshake.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = l.accept().await {
                held.push(s);
            }
        });
        let (pool, _ca) = tls_pool(addr, "protocol = \"http2\"\nconnect_timeout = \"10s\"");
        let cancelled = tokio::time::timeout(Duration::from_millis(50), pool.checkout()).await;
        assert!(cancelled.is_err(), "the handshake never completes");
        assert_eq!(pool.h2_connecting.load(Ordering::Relaxed), 0);
    }

    /// A burst on an endpoint that hangs (TCP accepted, TLS never answered) shares one
    /// connect, and fails with it: the requests that waited for it did not each open one
    /// of their own when it failed (twenty connects, each request waiting twice the
    /// connect timeout).
    #[tokio::test]
    async fn a_burst_waiting_for_a_connect_that_fails_fails_with_it() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = accepted.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = l.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                held.push(s);
            }
        });
        let (pool, _ca) = tls_pool(addr, "protocol = \"http2\"\nconnect_timeout = \"300ms\"");
        let burst: Vec<_> = (0..20)
            .map(|_| {
                let pool = pool.clone();
                tokio::spawn(async move { pool.checkout().await.map(|_| ()) })
            })
            .collect();
        for b in burst {
            let r = tokio::time::timeout(Duration::from_secs(5), b)
                .await
                .expect("ends within the connect timeout")
                .expect("task");
            assert!(r.as_ref().is_err_and(ProxyError::is_no_connection), "{r:?}");
        }
        let n = accepted.load(Ordering::SeqCst);
        assert!(n <= 2, "{n} connects for one burst");
    }

    /// A connect that fails while another is still under way (a keeper's spare beside the
    /// request's own) does not fail the requests waiting: only once none is left.
    #[tokio::test]
    async fn a_waiter_fails_only_once_no_connect_is_left() {
        use futures_util::FutureExt as _;
        let addr = "127.0.0.1:9".parse().expect("addr");
        let (pool, _ca) = tls_pool(addr, "protocol = \"http2\"\nconnect_timeout = \"10s\"");
        let under_way = H2Connecting::start(&pool);
        let mut waiter = Box::pin(pool.checkout_h2());
        assert!(
            (&mut waiter).now_or_never().is_none(),
            "waits for the connect"
        );
        // Another connect, ended in failure.
        let other = H2Connecting::start(&pool);
        pool.h2_failed.fetch_add(1, Ordering::Relaxed);
        drop(other);
        assert!(
            (&mut waiter).now_or_never().is_none(),
            "failed with a connect still under way"
        );
        drop(under_way);
        let r = (&mut waiter)
            .now_or_never()
            .expect("ends once none is left");
        assert!(r.is_err_and(|e| e.is_no_connection()));
    }

    /// An `auto` endpoint whose server has not picked HTTP/2 has no HTTP/2 connection to
    /// look for: a request does not wake the keeper for HTTP/2 spares it will never keep.
    #[tokio::test]
    async fn an_auto_endpoint_speaking_http1_does_not_wake_the_keeper_per_request() {
        use futures_util::FutureExt as _;
        let addr = "127.0.0.1:9".parse().expect("addr");
        let (pool, _ca) = tls_pool(addr, "protocol = \"auto\"\nmin_warm_connections = 1");
        assert!(pool.checkout_h2().await.expect("no error").is_none());
        assert!(
            pool.refill.notified().now_or_never().is_none(),
            "the keeper was woken"
        );
        // Once the server picked HTTP/2, its connections are looked for (and kept warm).
        pool.h2_seen.store(true, Ordering::Relaxed);
        assert!(pool.checkout_h2().await.expect("no error").is_none());
        assert!(pool.refill.notified().now_or_never().is_some());
    }
}
