//! A per-endpoint pool of HTTP/1.1 keep-alive connections, built on `hyper::client::conn`
//! (hyper-util's legacy pool cannot cap requests per connection or lifetime, nor pre-connect).
//!
//! What it does so that a request never pays for a connect (seed 004: a spike on every 80th
//! request when the server sent `Connection: close`):
//! - Idle connections are kept most-recently-used first; the coldest expire after
//!   `idle_timeout` (kept below common server keep-alive timeouts).
//! - Warm spares: a background task per endpoint keeps `min_warm` idle connections open,
//!   opening them at start and replacing each one as soon as it is taken, retired or closed.
//! - Rotation: a connection is retired after `max_requests` requests or `max_lifetime`,
//!   before the server's own limit; the server's limit is learned from its closes (the same
//!   count twice in a row) and the pool then rotates one request earlier.
//! - `https://` endpoints: TCP, then a TLS handshake with the cluster's shared client config
//!   (see [`super::tls`]), so replacements resume the TLS session; all of the above works
//!   the same over TLS.
//! - Every event is counted in [`PoolStats`].

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::Notify;

use super::tls::{EndpointTls, Handshake};
use crate::config::Cluster;
use crate::pipeline::body::ReqBody;
use crate::pipeline::error::ProxyError;

struct Idle {
    sender: http1::SendRequest<ReqBody>,
    since: Instant,
    created: Instant,
    uses: u32,
}

/// Connection events of one endpoint on one worker.
#[derive(Debug, Default)]
pub struct PoolStats {
    /// Connections opened on a request's path (the request waited for the connect).
    pub connects_on_request: AtomicU64,
    /// Connections opened ahead of need (warm spares, replacements).
    pub preconnects: AtomicU64,
    pub reuses: AtomicU64,
    pub retired_max_requests: AtomicU64,
    pub retired_lifetime: AtomicU64,
    pub retired_idle: AtomicU64,
    /// The server closed it (`Connection: close`, FIN or reset).
    pub closed_by_server: AtomicU64,
    /// Requests sent again on a fresh connection after a pooled one failed.
    pub retries: AtomicU64,
    /// Connects that failed: refused, timed out, or a failed TLS handshake.
    pub connect_failures: AtomicU64,
    /// TLS handshakes that paid the full price (certificate chain, key exchange).
    pub tls_full_handshakes: AtomicU64,
    /// TLS handshakes that resumed an earlier session (a ticket or session id).
    pub tls_resumed_handshakes: AtomicU64,
    /// TLS handshakes that failed (certificate not trusted, wrong name, protocol error);
    /// also counted in `connect_failures`.
    pub tls_handshake_failures: AtomicU64,
    /// The server's requests-per-connection limit as learned from its closes (0: none seen).
    pub learned_limit: AtomicU32,
}

/// The pool of one endpoint on one worker.
pub struct EndpointPool {
    pub addr: SocketAddr,
    pub stats: PoolStats,
    /// Load and health, for the balancer and outlier detection.
    pub load: super::balance::EndpointLoad,
    // Held only for a push or pop, never across an await; one worker uses it.
    idle: Mutex<VecDeque<Idle>>,
    max_idle: usize,
    idle_timeout: Duration,
    connect_timeout: Duration,
    max_requests: u32,
    max_lifetime: Option<Duration>,
    min_warm: usize,
    /// `Some` for an `https://` endpoint.
    tls: Option<EndpointTls>,
    refill: Notify,
    /// Uses at the last server close, to learn its limit.
    last_close_uses: AtomicU32,
    /// Removed from its cluster (DNS): keeps no idle connections, opens no spares.
    retired: AtomicBool,
}

/// A connection checked out of the pool for one request.
pub struct Conn {
    pub sender: http1::SendRequest<ReqBody>,
    pub pool: Arc<EndpointPool>,
    /// It had served a request before (no connect was paid).
    pub reused: bool,
    created: Instant,
    uses: u32,
    /// The response said `Connection: close`: the server ends it after this exchange.
    pub closing: bool,
}

impl Conn {
    /// Gives the connection back after its response was read to the end, or retires it.
    pub fn release(self) {
        let pool = self.pool.clone();
        pool.give_back(self);
    }
}

impl EndpointPool {
    pub fn new(addr: SocketAddr, cluster: &Cluster) -> EndpointPool {
        EndpointPool {
            addr,
            stats: PoolStats::default(),
            load: super::balance::EndpointLoad::new(
                cluster.eject_after_failures,
                cluster.eject_duration,
            ),
            idle: Mutex::new(VecDeque::new()),
            max_idle: cluster.max_idle_per_endpoint,
            idle_timeout: cluster.idle_timeout,
            connect_timeout: cluster.connect_timeout,
            max_requests: cluster.max_requests_per_connection,
            max_lifetime: cluster.max_connection_lifetime,
            min_warm: cluster.min_warm_connections,
            tls: cluster.tls.as_ref().map(|t| EndpointTls::new(t, addr)),
            refill: Notify::new(),
            last_close_uses: AtomicU32::new(0),
            retired: AtomicBool::new(false),
        }
    }

    /// Drains the pool of an endpoint removed from its cluster: idle connections close, the
    /// warm keeper stops, and connections still serving requests close when they finish.
    pub fn retire(&self) {
        self.retired.store(true, Ordering::Relaxed);
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        self.refill.notify_one();
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

    fn give_back(&self, conn: Conn) {
        let uses = conn.uses + 1;
        if conn.closing || conn.sender.is_closed() {
            self.stats.closed_by_server.fetch_add(1, Ordering::Relaxed);
            // The same count twice in a row is the server's limit.
            if self.last_close_uses.swap(uses, Ordering::Relaxed) == uses {
                self.stats.learned_limit.store(uses, Ordering::Relaxed);
            }
            self.refill.notify_one();
            return;
        }
        let cap = self.request_cap();
        if cap > 0 && uses >= cap {
            self.stats
                .retired_max_requests
                .fetch_add(1, Ordering::Relaxed);
            self.refill.notify_one();
            return;
        }
        if self
            .max_lifetime
            .is_some_and(|l| conn.created.elapsed() >= l)
        {
            self.stats.retired_lifetime.fetch_add(1, Ordering::Relaxed);
            self.refill.notify_one();
            return;
        }
        self.put(Idle {
            sender: conn.sender,
            since: Instant::now(),
            created: conn.created,
            uses,
        });
    }

    fn put(&self, idle: Idle) {
        if self.max_idle == 0 || self.retired.load(Ordering::Relaxed) {
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
            list.pop_front();
        }
        list.push_back(idle);
    }

    /// The most recently used idle connection, and how many stay idle after it.
    fn pop(&self) -> Option<(Idle, usize)> {
        let mut list = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let idle = list.pop_back()?;
        Some((idle, list.len()))
    }

    /// A ready connection: the most recently used idle one that is still open, else a new one.
    pub async fn checkout(self: &Arc<Self>) -> Result<Conn, ProxyError> {
        while let Some((mut idle, left)) = self.pop() {
            if idle.since.elapsed() >= self.idle_timeout {
                self.stats.retired_idle.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if idle.sender.is_closed() {
                self.stats.closed_by_server.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            // Usually ready at once. If not, the connection task has not caught up with the
            // end of the last response, or (rarely) the last request's body is still being
            // written after an early answer: wait a bounded time, never indefinitely.
            let ready = idle.sender.is_ready()
                || matches!(
                    tokio::time::timeout(self.connect_timeout, idle.sender.ready()).await,
                    Ok(Ok(()))
                );
            if ready {
                self.stats.reuses.fetch_add(1, Ordering::Relaxed);
                // Wake the keeper only when the spares run low, not on every request.
                if left < self.min_warm {
                    self.refill.notify_one();
                }
                return Ok(Conn {
                    sender: idle.sender,
                    pool: self.clone(),
                    reused: true,
                    created: idle.created,
                    uses: idle.uses,
                    closing: false,
                });
            }
        }
        self.stats
            .connects_on_request
            .fetch_add(1, Ordering::Relaxed);
        self.refill.notify_one();
        self.connect().await
    }

    /// Counts a request sent again after a failure.
    pub fn count_retry(&self) {
        self.stats.retries.fetch_add(1, Ordering::Relaxed);
    }

    /// A new connection, bypassing the idle list.
    pub async fn connect(self: &Arc<Self>) -> Result<Conn, ProxyError> {
        let sender = self.open().await?;
        Ok(Conn {
            sender,
            pool: self.clone(),
            reused: false,
            created: Instant::now(),
            uses: 0,
            closing: false,
        })
    }

    async fn open(&self) -> Result<http1::SendRequest<ReqBody>, ProxyError> {
        // The connect timeout covers the TLS handshake too: a server that accepts and then
        // stalls must not hold a request (or the warm keeper) forever.
        let dialed = tokio::time::timeout(self.connect_timeout, self.dial()).await;
        let sender = match dialed {
            Ok(Ok(Stream::Plain(s))) => handshake_h1(s, self.addr).await?,
            Ok(Ok(Stream::Tls(s))) => handshake_h1(*s, self.addr).await?,
            Ok(Err(e)) => {
                self.stats.connect_failures.fetch_add(1, Ordering::Relaxed);
                return Err(e);
            }
            Err(_) => {
                self.stats.connect_failures.fetch_add(1, Ordering::Relaxed);
                return Err(ProxyError::ConnectTimeout);
            }
        };
        Ok(sender)
    }

    /// TCP connect, then the TLS handshake for an `https://` endpoint.
    async fn dial(&self) -> Result<Stream, ProxyError> {
        let tcp = TcpStream::connect(self.addr)
            .await
            .map_err(ProxyError::UpstreamConnect)?;
        let _ = tcp.set_nodelay(true);
        let Some(tls) = &self.tls else {
            return Ok(Stream::Plain(tcp));
        };
        match tls.handshake(tcp).await {
            Ok((s, kind)) => {
                let counter = match kind {
                    Handshake::Full => &self.stats.tls_full_handshakes,
                    Handshake::Resumed => &self.stats.tls_resumed_handshakes,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                Ok(Stream::Tls(Box::new(s)))
            }
            Err(e) => {
                self.stats
                    .tls_handshake_failures
                    .fetch_add(1, Ordering::Relaxed);
                tracing::debug!(upstream.addr = %self.addr, error = %e, "upstream TLS handshake failed");
                Err(ProxyError::UpstreamTls(e))
            }
        }
    }

    /// Keeps `min_warm` idle connections open, for as long as the worker runs: opens them at
    /// start, and replaces each one taken, retired or closed. Backs off while the endpoint
    /// refuses connections.
    pub async fn keep_warm(self: Arc<Self>) {
        if self.min_warm == 0 {
            return;
        }
        let mut backoff = Duration::from_millis(100);
        loop {
            if self.retired.load(Ordering::Relaxed) {
                return;
            }
            while self.idle_len() < self.min_warm && !self.retired.load(Ordering::Relaxed) {
                match self.open().await {
                    Ok(sender) => {
                        self.stats.preconnects.fetch_add(1, Ordering::Relaxed);
                        let now = Instant::now();
                        self.put(Idle {
                            sender,
                            since: now,
                            created: now,
                            uses: 0,
                        });
                        backoff = Duration::from_millis(100);
                    }
                    Err(e) => {
                        tracing::debug!(upstream.addr = %self.addr, error = %e, "warm connection failed");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(5));
                    }
                }
            }
            // Woken on every take, retirement and close; the tick catches idle expiry.
            let _ = tokio::time::timeout(
                self.idle_timeout.max(Duration::from_millis(100)),
                self.refill.notified(),
            )
            .await;
        }
    }

    /// Idle connections held now (still open).
    pub fn idle_len(&self) -> usize {
        let mut list = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let before = list.len();
        list.retain(|i| !i.sender.is_closed() && i.since.elapsed() < self.idle_timeout);
        if list.len() < before {
            self.stats
                .retired_idle
                .fetch_add((before - list.len()) as u64, Ordering::Relaxed);
        }
        list.len()
    }
}

/// A connected transport, before the HTTP handshake.
enum Stream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

/// The HTTP/1.1 handshake over any transport; the connection runs on its own task.
async fn handshake_h1<I>(io: I, addr: SocketAddr) -> Result<http1::SendRequest<ReqBody>, ProxyError>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) = http1::Builder::new()
        .handshake(TokioIo::new(io))
        .await
        .map_err(ProxyError::UpstreamReset)?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(upstream.addr = %addr, error = %e, "upstream connection ended with an error");
        }
    });
    Ok(sender)
}
