//! The admin plane: `/metrics`, `/healthz`, `/readyz` and `/stats`, served from a dedicated
//! OS thread with its own current-thread runtime and its own listener, never from a
//! data-plane worker (seed 001: a scrape rendered on a request worker stalled requests).
//!
//! The admin thread runs at a lower priority than the workers (nice 10), and `/metrics`
//! renders on a thread of its own under Linux's `SCHED_IDLE` policy: where it shares a core
//! with a worker, a worker that wakes up takes the core from it at once, so a large scrape
//! takes longer instead of delaying requests. Rendering at nice 10 was not enough: on a
//! quiet machine a 14 ms scrape of 105k series once a second moved the p99 at 5000
//! requests/s from 185 µs to 711 µs (`tailgate bench scenario metrics-scrape`). Health and
//! readiness stay on the nice-10 thread: a `SCHED_IDLE` thread on a saturated core gets
//! its turn about once a second (its weight is 3 against a worker's 1024), too late for a
//! liveness probe. The body of a scrape is still written to its socket by the admin
//! thread; the systemd watchdog has a thread of its own.
//!
//! - `/metrics`: Prometheus text 0.0.4, or OpenMetrics 1.0 when `Accept` asks for
//!   `application/openmetrics-text`; gzip when `Accept-Encoding` allows it; streamed in
//!   64 KiB chunks as it renders ([`exposition`]).
//! - `/healthz`: 200 while every worker runs its lag probe on time, else 503 naming the
//!   stalled workers.
//! - `/readyz`: 503 before every worker runs, before each cluster that asks for warm
//!   connections has some on every worker, while a worker is stalled, and while draining;
//!   200 otherwise.
//! - `/stats`: the same state as JSON, for people and scripts.

pub mod exposition;
pub mod watchdog;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body::{Body, Frame};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::{mpsc, watch};

use crate::config::Config;
use crate::observe::metrics::MetricsPlan;
use crate::observe::metrics::render::{Format, TextWriter};
use crate::pipeline::Worker;

/// Admin connections open at once; more are refused (DESIGN.md rule 4: bounded).
const MAX_CONNECTIONS: usize = 64;
/// How long an admin connection is kept before it is closed (after its current response).
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);
/// How long the response in flight at [`CONNECTION_LIFETIME`] may still take: a client
/// that stopped reading (a `/metrics` body it never takes) must not keep its slot forever.
const LIFETIME_DRAIN: Duration = Duration::from_secs(30);
/// Connections taken beyond [`MAX_CONNECTIONS`] to answer health probes only: when every
/// slot is held (clients that stopped reading, or that connect and send nothing), the
/// orchestrator's `/healthz` and `/readyz` must still be answered, or it restarts a healthy
/// gateway.
const PROBE_CONNECTIONS: usize = 8;
/// The whole life of such a probe connection: one request, then it is closed.
const PROBE_DEADLINE: Duration = Duration::from_secs(5);
/// How long a connection taken when every slot is held waits for the slot of the idle
/// connection it had closed (closing an idle connection takes one turn of the admin thread).
const EVICT_WAIT: Duration = Duration::from_secs(1);
/// How long a connection closed for a new one, with no response under way, may take to
/// end by itself before it is dropped.
const EVICT_GRACE: Duration = Duration::from_millis(100);
/// At the stop: the connections already queued for the admin socket taken and answered
/// (one request each), at most this many, rather than reset by its close.
const QUEUED_AT_STOP: usize = 64;
/// At the stop: how long the responses under way, and those to the queued connections, may
/// take before the admin thread ends (and drops whatever is left).
const STOP_WAIT: Duration = Duration::from_secs(1);

/// What the admin plane reads: the config, every worker (their metrics and pools), and
/// whether the gateway is draining. Built once per gateway.
pub struct AdminState {
    pub config: Arc<Config>,
    pub plan: Arc<MetricsPlan>,
    pub workers: Vec<Arc<Worker>>,
    /// The resolver's counters (all zero without host-name endpoints).
    pub dns: Arc<crate::upstream::dns::DnsStats>,
    /// Set when shutdown begins (an atomic, not the workers' shutdown channel, so the admin
    /// thread takes no lock the data plane takes).
    pub draining: AtomicBool,
    /// A worker whose lag probe has not run for this long is stalled.
    pub stall_threshold: Duration,
    pub started: Instant,
    /// Set once the warning that readiness came without some warm clusters is logged.
    warned_cold: AtomicBool,
    /// Set the first time [`readiness`](Self::readiness) said ready.
    was_ready: AtomicBool,
    /// Set the first time `/readyz` was asked ([`probe`](Self::probe)).
    probed: AtomicBool,
    /// Per cluster: it has been warm on every worker once ([`cold_clusters`](Self::cold_clusters)).
    warmed: Box<[AtomicBool]>,
    /// Per-consumer series merged over the workers (only scrapes take this lock).
    consumers: tokio::sync::Mutex<exposition::ConsumerMerge>,
    pub last_render_ns: AtomicU64,
    pub last_samples: AtomicU64,
    pub scrapes: AtomicU64,
    /// The runtime of the `SCHED_IDLE` thread scrapes render on (unset: the admin thread's).
    scrape_runtime: OnceLock<tokio::runtime::Handle>,
}

impl AdminState {
    pub fn new(
        config: Arc<Config>,
        plan: Arc<MetricsPlan>,
        workers: Vec<Arc<Worker>>,
        dns: Arc<crate::upstream::dns::DnsStats>,
    ) -> AdminState {
        let stall_threshold = config
            .admin
            .as_ref()
            .map_or(Duration::from_secs(2), |a| a.stall_threshold);
        let warmed: Box<[AtomicBool]> = config
            .clusters
            .iter()
            .map(|_| AtomicBool::new(false))
            .collect();
        AdminState {
            config,
            plan,
            workers,
            dns,
            draining: AtomicBool::new(false),
            stall_threshold,
            started: Instant::now(),
            warned_cold: AtomicBool::new(false),
            was_ready: AtomicBool::new(false),
            probed: AtomicBool::new(false),
            warmed,
            consumers: Default::default(),
            last_render_ns: AtomicU64::new(0),
            last_samples: AtomicU64::new(0),
            scrapes: AtomicU64::new(0),
            scrape_runtime: OnceLock::new(),
        }
    }

    /// Milliseconds since each worker's lag probe last ran (`None`: it never ran).
    pub fn tick_ages(&self) -> Vec<Option<u64>> {
        let now = self.plan.now_ms();
        self.workers
            .iter()
            .map(|w| match w.metrics.last_tick_ms.load(Ordering::Relaxed) {
                0 => None,
                t => Some(now.saturating_sub(t)),
            })
            .collect()
    }

    /// Workers that have not run their lag probe within the stall threshold (one that has
    /// finished its drain and stopped, while others still drain, is not stalled).
    pub fn stalled_workers(&self) -> Vec<usize> {
        let limit = self.stall_threshold.as_millis() as u64;
        self.tick_ages()
            .iter()
            .enumerate()
            .filter(|&(i, age)| {
                age.is_none_or(|a| a > limit)
                    && !self.workers[i].metrics.exited.load(Ordering::Relaxed)
            })
            .map(|(i, _)| i)
            .collect()
    }

    /// Why the gateway should not get traffic yet (or any more), if it should not.
    ///
    /// Clusters with `min_warm_connections` hold readiness back only for
    /// `server.warm_wait` from when the workers start: a cluster whose upstream is down at boot must not
    /// keep every other tenant's routes out of rotation (nor keep `READY=1` from systemd
    /// until its start timeout kills the gateway). Past the wait, a cold cluster is named in
    /// `/readyz`'s answer and in one warning instead.
    pub fn not_ready(&self) -> Option<String> {
        self.readiness().err()
    }

    /// Ready, with the clusters still cold (named in `/readyz` and `/stats`), or the reason
    /// it is not (see [`not_ready`](Self::not_ready)).
    pub fn readiness(&self) -> Result<Vec<&str>, String> {
        let judged = self.judge_readiness();
        if judged.is_ok() && !self.was_ready.load(Ordering::Relaxed) {
            self.was_ready.store(true, Ordering::Relaxed);
        }
        judged
    }

    /// [`readiness`](Self::readiness), asked by `/readyz`: remembered for
    /// [`never_ready`](Self::never_ready). (systemd's `READY=1` is no load balancer's
    /// rotation: the watchdog asks `readiness` itself.)
    pub fn probe(&self) -> Result<Vec<&str>, String> {
        if !self.probed.load(Ordering::Relaxed) {
            self.probed.store(true, Ordering::Relaxed);
        }
        self.readiness()
    }

    /// Was `/readyz` asked, and readiness never said ready (to it, `/stats` or the
    /// watchdog)? Then no load balancer that probes it
    /// has it in rotation, and its shutdown needs no `server.shutdown_delay`. (Never
    /// probed, it may be in one that does not ask, a Kubernetes pod without a
    /// `readinessProbe`: the delay is kept.)
    pub fn never_ready(&self) -> bool {
        self.probed.load(Ordering::Relaxed) && !self.was_ready.load(Ordering::Relaxed)
    }

    fn judge_readiness(&self) -> Result<Vec<&str>, String> {
        if self.draining.load(Ordering::Relaxed) {
            return Err("draining".into());
        }
        if self.tick_ages().iter().any(Option::is_none) {
            return Err("workers starting".into());
        }
        // New connections hashed to a stalled worker's socket would wait there: no new
        // traffic until it runs again (`/healthz` says the same, for a restart).
        let stalled = self.stalled_workers();
        if !stalled.is_empty() {
            return Err(format!("workers stalled: {stalled:?}"));
        }
        let cold = self.cold_clusters();
        let Some(first) = cold.first() else {
            return Ok(cold);
        };
        if self.started.elapsed() < self.config.server.warm_wait {
            return Err(format!("cluster `{first}` has no warm connections yet"));
        }
        if !self.warned_cold.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                clusters = ?cold,
                warm_wait = ?self.config.server.warm_wait,
                "ready without warm connections to these clusters: none opened within warm_wait (is their upstream down?)"
            );
        }
        Ok(cold)
    }

    /// Clusters with `min_warm_connections` that some worker has not warmed yet (no
    /// endpoint of it has opened its warm spares there). A cluster warm once stays warm:
    /// readiness gates the start only, and a DNS answer that moves a cluster to new
    /// addresses (new pools, their counts at zero) must not take every replica out of
    /// rotation at once.
    pub fn cold_clusters(&self) -> Vec<&str> {
        let mut cold = Vec::new();
        for (ci, cluster) in self.config.clusters.iter().enumerate() {
            if cluster.min_warm_connections == 0
                || self
                    .warmed
                    .get(ci)
                    .is_some_and(|w| w.load(Ordering::Relaxed))
            {
                continue;
            }
            let is_cold = self.workers.iter().any(|w| {
                w.upstreams.clusters.get(ci).is_some_and(|c| {
                    !c.endpoints.load().iter().any(|e| {
                        e.stats.preconnects.load(Ordering::Relaxed)
                            >= cluster.min_warm_connections as u64
                    })
                })
            });
            if is_cold {
                cold.push(cluster.name.as_str());
            } else if let Some(w) = self.warmed.get(ci) {
                w.store(true, Ordering::Relaxed);
            }
        }
        cold
    }
}

/// The running admin thread, and the thread scrapes render on.
pub struct Admin {
    pub addr: SocketAddr,
    stop: watch::Sender<bool>,
    scrape_stop: watch::Sender<bool>,
    thread: JoinHandle<()>,
    scrape_thread: JoinHandle<()>,
}

/// The admin listener and the runtimes of the admin and scrape threads, made before the
/// data plane starts (see `runtime::build`).
pub struct Bound {
    /// Bound, listening only from [`Admin::start`], the start's last step: a start that
    /// fails before resets no probe on an address a running gateway shares.
    listener: socket2::Socket,
    runtime: tokio::runtime::Runtime,
    /// `None` when it could not be built: scrapes render on the admin thread.
    scrape_runtime: Option<tokio::runtime::Runtime>,
}

/// Binds the admin listener, and builds the runtimes its threads will run. With
/// SO_REUSEPORT, as the data listeners are: a second gateway started on a running one's
/// addresses (a restart that refuses no connection) shares it rather than failing to start.
pub fn bind(addr: SocketAddr) -> std::io::Result<Bound> {
    // Dual-stack, as the config's checks take it (README): `[::]` is every address.
    let listener = crate::listener::bind_unlistened(addr, true)?;
    let runtime = crate::runtime::build()?;
    let scrape_runtime = crate::runtime::build()
        .inspect_err(|e| {
            tracing::error!(error = %e, "cannot build the scrape runtime; scrapes render on the admin thread");
        })
        .ok();
    Ok(Bound {
        listener,
        runtime,
        scrape_runtime,
    })
}

impl Admin {
    /// Starts the admin thread on what [`bind`] made, and the scrape thread.
    pub fn start(bound: Bound, state: Arc<AdminState>) -> std::io::Result<Admin> {
        let Bound {
            listener,
            runtime,
            scrape_runtime,
        } = bound;
        let listener = crate::listener::listen(listener)?;
        let addr = listener.local_addr()?;
        let (stop, stop_rx) = watch::channel(false);
        let (scrape_stop, scrape_stop_rx) = watch::channel(false);
        // Without it, scrapes render on the admin thread.
        if let Some(rt) = &scrape_runtime {
            let _ = state.scrape_runtime.set(rt.handle().clone());
        }
        let scrape_thread = std::thread::Builder::new()
            .name("tailgate-scrape".into())
            .spawn(move || run_scrapes(scrape_runtime, scrape_stop_rx))?;
        let thread = std::thread::Builder::new()
            .name("tailgate-admin".into())
            .spawn(move || run(listener, runtime, state, stop_rx))?;
        tracing::info!(admin.addr = %addr, "admin listening");
        Ok(Admin {
            addr,
            stop,
            scrape_stop,
            thread,
            scrape_thread,
        })
    }

    /// Stops the admin thread, then the scrape thread (after the data plane has stopped):
    /// the scrapes the admin thread answers at its stop render on the other.
    pub fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.thread.join();
        let _ = self.scrape_stop.send(true);
        let _ = self.scrape_thread.join();
    }
}

/// The scrape thread: a runtime that only renders expositions, under `SCHED_IDLE`, until
/// the admin plane stops.
fn run_scrapes(rt: Option<tokio::runtime::Runtime>, mut stop: watch::Receiver<bool>) {
    let Some(rt) = rt else {
        return;
    };
    idle_priority();
    rt.block_on(async move {
        let _ = stop.wait_for(|s| *s).await;
    });
}

fn run(
    listener: std::net::TcpListener,
    rt: tokio::runtime::Runtime,
    state: Arc<AdminState>,
    mut stop: watch::Receiver<bool>,
) {
    lower_priority();
    rt.block_on(async move {
        let listener = match tokio::net::TcpListener::from_std(listener) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "admin listener failed");
                return;
            }
        };
        let permits = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
        let probe_permits = Arc::new(tokio::sync::Semaphore::new(PROBE_CONNECTIONS));
        let open = Arc::new(Open::new());
        // The notes on a full plane, each at most every 10 s: a connect flood on the admin
        // port must not fill the log queue the access log shares.
        let noted = Arc::new(Notes::default());
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, peer)) => match permits.clone().try_acquire_owned() {
                        Ok(permit) => {
                            tokio::spawn(serve(stream, state.clone(), permit, Slot::Full(open.clone())));
                        }
                        // Every slot is held: an idle keep-alive connection (between
                        // responses, or one that never sent a request) is closed for this
                        // one, as nginx reuses idle connections when it runs out of them.
                        // One that still holds response bytes it has not written closes
                        // only once those are done; one holding part of a request head
                        // gets `EVICT_GRACE` to finish it. Past `EVICT_WAIT` the new one
                        // gets a probe slot.
                        Err(_) if open.close_idlest() => {
                            if noted.slot_taken.due() {
                                tracing::info!(client = %peer, limit = MAX_CONNECTIONS, "admin connections all taken; the longest idle one is closed for this one (noted at most every 10 s)");
                            }
                            let (permits, probe_permits) = (permits.clone(), probe_permits.clone());
                            let (state, open, noted) = (state.clone(), open.clone(), noted.clone());
                            tokio::spawn(async move {
                                match tokio::time::timeout(EVICT_WAIT, permits.acquire_owned()).await {
                                    Ok(Ok(permit)) => serve(stream, state, permit, Slot::Full(open)).await,
                                    _ => serve_probe(stream, peer, state, &probe_permits, &noted),
                                }
                            });
                        }
                        Err(_) => serve_probe(stream, peer, state.clone(), &probe_permits, &noted),
                    },
                    Err(e) => {
                        tracing::debug!(error = %e, "admin accept failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                },
                _ = stop.wait_for(|s| *s) => break,
            }
        }
        stop_serving(listener, &state, &open, &permits, &probe_permits).await;
    });
}

/// The admin plane's stop: the connections queued for the socket are answered (one request
/// each: a restart's probes and scrapes that came just before get an answer, not a reset),
/// the open ones are asked to close (at once when idle, after their response otherwise),
/// and all of them get up to [`STOP_WAIT`] in all.
async fn stop_serving(
    listener: tokio::net::TcpListener,
    state: &Arc<AdminState>,
    open: &Arc<Open>,
    permits: &Arc<tokio::sync::Semaphore>,
    probe_permits: &Arc<tokio::sync::Semaphore>,
) {
    let last = Arc::new(tokio::sync::Semaphore::new(QUEUED_AT_STOP));
    if let Ok(listener) = listener.into_std() {
        for _ in 0..QUEUED_AT_STOP {
            let stream = match listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    tracing::debug!(error = %e, "admin accept at the stop failed");
                    break;
                }
            };
            let stream = stream
                .set_nonblocking(true)
                .and_then(|()| tokio::net::TcpStream::from_std(stream));
            if let (Ok(stream), Ok(permit)) = (stream, last.clone().try_acquire_owned()) {
                tokio::spawn(serve(stream, state.clone(), permit, Slot::Last));
            }
        }
        // Closed here: what comes after goes to another gateway sharing the address.
        drop(listener);
    }
    open.close_all();
    let all_ended = async {
        let _ = permits.acquire_many(MAX_CONNECTIONS as u32).await;
        let _ = probe_permits.acquire_many(PROBE_CONNECTIONS as u32).await;
        let _ = last.acquire_many(QUEUED_AT_STOP as u32).await;
    };
    if tokio::time::timeout(STOP_WAIT, all_ended).await.is_err() {
        tracing::debug!("admin connections still open at the stop are dropped");
    }
}

/// The admin plane's notes on a full plane, each at most every 10 s.
struct Notes {
    slot_taken: crate::pace::Every,
    probe_only: crate::pace::Every,
    refused: crate::pace::Every,
}

impl Default for Notes {
    fn default() -> Notes {
        let every = || crate::pace::Every::new(Duration::from_secs(10));
        Notes {
            slot_taken: every(),
            probe_only: every(),
            refused: every(),
        }
    }
}

/// Serves `stream` on a probe slot (health probes only, one request), or drops it when
/// those are all taken too.
fn serve_probe(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    state: Arc<AdminState>,
    probe_permits: &Arc<tokio::sync::Semaphore>,
    noted: &Notes,
) {
    match probe_permits.clone().try_acquire_owned() {
        Ok(permit) => {
            if noted.probe_only.due() {
                tracing::warn!(client = %peer, limit = MAX_CONNECTIONS, "admin connections all busy; this one may ask for /healthz or /readyz only (noted at most every 10 s)");
            }
            tokio::spawn(serve(stream, state, permit, Slot::Probe));
        }
        Err(_) => {
            if noted.refused.due() {
                tracing::warn!(client = %peer, limit = MAX_CONNECTIONS, "admin connection refused: too many open (noted at most every 10 s)");
            }
        }
    }
}

/// The admin connections on full slots, so that when every slot is held the one idle the
/// longest can be closed for a new one. At most [`MAX_CONNECTIONS`] entries. Its lock is
/// taken on the admin thread only (a connection opens or ends, an accept finds every slot
/// held), never by a worker: a `Mutex` because its tasks are spawned, which needs `Send`.
struct Open {
    conns: std::sync::Mutex<Vec<Arc<OpenConn>>>,
    epoch: Instant,
    /// The admin plane is stopping: a connection that starts now is asked to close at once
    /// (it answers the request it may already have sent).
    stopping: AtomicBool,
}

/// One admin connection on a full slot.
struct OpenConn {
    /// Responses begun and not yet finished (their bodies not yet dropped).
    busy: AtomicU32,
    /// When it last became idle (accepted, or a response finished), in ns since
    /// [`Open::epoch`].
    idle_since: AtomicU64,
    /// Asks the connection to close (it does once idle).
    close: tokio::sync::Notify,
    /// Its last write found the socket full: hyper still holds response bytes to write,
    /// though the response's body is done (hyper lets the body go once it is in its write
    /// buffer, up to some hundreds of KiB). Not idle until they are written.
    unsent: AtomicBool,
    /// [`Open::epoch`], for the write watch to set `idle_since` when the last bytes go.
    epoch: Instant,
}

impl OpenConn {
    /// A response under way, or its bytes not all written yet.
    fn in_use(&self) -> bool {
        self.busy.load(Ordering::Relaxed) > 0 || self.unsent.load(Ordering::Relaxed)
    }
}

/// An admin connection's socket, noting in its [`OpenConn`] (on a full slot) whether the
/// last write found the socket full.
struct WriteWatch {
    inner: tokio::net::TcpStream,
    conn: Option<Arc<OpenConn>>,
}

impl WriteWatch {
    fn note<T>(&self, r: &Poll<std::io::Result<T>>) {
        if let Some(c) = &self.conn {
            let pending = r.is_pending();
            // Its last bytes written: idle from now, not from when its body was done.
            if c.unsent.swap(pending, Ordering::Relaxed) && !pending {
                c.idle_since
                    .store(c.epoch.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
        }
    }
}

impl tokio::io::AsyncRead for WriteWatch {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for WriteWatch {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.note(&r);
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.note(&r);
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl Open {
    fn new() -> Open {
        Open {
            conns: std::sync::Mutex::new(Vec::with_capacity(MAX_CONNECTIONS)),
            epoch: Instant::now(),
            stopping: AtomicBool::new(false),
        }
    }

    fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    fn add(&self) -> Arc<OpenConn> {
        let conn = Arc::new(OpenConn {
            busy: AtomicU32::new(0),
            idle_since: AtomicU64::new(self.now()),
            close: tokio::sync::Notify::new(),
            unsent: AtomicBool::new(false),
            epoch: self.epoch,
        });
        let mut conns = self.lock();
        if self.stopping.load(Ordering::Relaxed) {
            conn.close.notify_one();
        } else {
            conns.push(conn.clone());
        }
        conn
    }

    fn remove(&self, conn: &Arc<OpenConn>) {
        self.lock().retain(|c| !Arc::ptr_eq(c, conn));
    }

    /// Asks the connection idle the longest to close, and takes it off the list; false when
    /// every connection is in the middle of a response (or of writing its last bytes).
    fn close_idlest(&self) -> bool {
        let mut conns = self.lock();
        let idlest = conns
            .iter()
            .enumerate()
            .filter(|(_, c)| !c.in_use())
            .min_by_key(|(_, c)| c.idle_since.load(Ordering::Relaxed))
            .map(|(i, _)| i);
        match idlest {
            Some(i) => {
                conns.swap_remove(i).close.notify_one();
                true
            }
            None => false,
        }
    }

    /// Asks every connection to close (each does once its response is done), and takes them
    /// off the list.
    fn close_all(&self) {
        let mut conns = self.lock();
        self.stopping.store(true, Ordering::Relaxed);
        for c in conns.drain(..) {
            c.close.notify_one();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Arc<OpenConn>>> {
        // The list holds no invariant a panic could break half-way.
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Takes a connection off the list of open ones when it ends.
struct Listed {
    conn: Arc<OpenConn>,
    open: Arc<Open>,
}

impl Drop for Listed {
    fn drop(&mut self) {
        self.open.remove(&self.conn);
    }
}

/// Held by a response body on a full slot: the connection is busy until it is dropped.
struct Busy {
    conn: Arc<OpenConn>,
    open: Arc<Open>,
}

impl Busy {
    fn new(conn: &Arc<OpenConn>, open: &Arc<Open>) -> Busy {
        conn.busy.fetch_add(1, Ordering::Relaxed);
        Busy {
            conn: conn.clone(),
            open: open.clone(),
        }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.conn
            .idle_since
            .store(self.open.now(), Ordering::Relaxed);
        self.conn.busy.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Nice 10 for this thread only (Linux applies `setpriority` to a thread id).
fn lower_priority() {
    let tid = rustix::thread::gettid();
    if let Err(e) = rustix::process::setpriority_process(Some(tid), 10) {
        let thread = std::thread::current();
        tracing::debug!(error = %e, thread = thread.name().unwrap_or("-"), "cannot lower the thread's priority");
    }
}

/// `SCHED_IDLE` for this thread only; nice 10 where that is refused (a seccomp filter, a
/// kernel without it).
fn idle_priority() {
    use thread_priority::unix::{
        NormalThreadSchedulePolicy, ThreadSchedulePolicy, set_thread_priority_and_policy,
        thread_native_id, thread_schedule_policy,
    };
    const IDLE: ThreadSchedulePolicy =
        ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Idle);
    let set = set_thread_priority_and_policy(
        thread_native_id(),
        thread_priority::ThreadPriority::Min,
        IDLE,
    );
    // After the policy, the call also sets the thread's nice value (to 0), which fails in a
    // process started niced; the policy is what counts.
    if thread_schedule_policy().is_ok_and(|p| p == IDLE) {
        return;
    }
    tracing::debug!(error = ?set.err(), "SCHED_IDLE refused for the scrape thread; nice 10 instead");
    lower_priority();
}

/// Which kind of slot an admin connection holds.
enum Slot {
    /// One of [`MAX_CONNECTIONS`]: every endpoint, kept alive up to its lifetime, or until
    /// a new connection needs its slot while it is idle.
    Full(Arc<Open>),
    /// One of [`PROBE_CONNECTIONS`]: one health probe within [`PROBE_DEADLINE`].
    Probe,
    /// Queued for the socket at the stop: one request, any endpoint, within [`STOP_WAIT`].
    Last,
}

async fn serve(
    stream: tokio::net::TcpStream,
    state: Arc<AdminState>,
    _permit: tokio::sync::OwnedSemaphorePermit,
    slot: Slot,
) {
    let _ = stream.set_nodelay(true);
    // On a full slot: this connection in the list of open ones, taken off when it ends.
    let tracked = match &slot {
        Slot::Full(open) => Some((open.add(), open.clone())),
        Slot::Probe | Slot::Last => None,
    };
    let probes_only = matches!(slot, Slot::Probe);
    let _listed = tracked.as_ref().map(|(conn, open)| Listed {
        conn: conn.clone(),
        open: open.clone(),
    });
    let keep_alive = tracked.is_some();
    let close = tracked.as_ref().map(|(conn, _)| conn.clone());
    let svc = hyper::service::service_fn(move |req| {
        let state = state.clone();
        let busy = tracked.as_ref().map(|(conn, open)| Busy::new(conn, open));
        async move {
            let resp = match busy {
                None if probes_only && !matches!(req.uri().path(), "/healthz" | "/readyz") => json(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &serde_json::json!({"error": "too_many_connections", "message": "every admin connection is busy; only /healthz and /readyz are answered"}),
                ),
                _ => handle(state, req),
            };
            Ok::<_, Infallible>(resp.map(|body| Tracked { body, _busy: busy }))
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(10))
        .keep_alive(keep_alive)
        .serve_connection(
            TokioIo::new(WriteWatch {
                inner: stream,
                conn: close.clone(),
            }),
            svc,
        );
    let mut conn = std::pin::pin!(conn);
    let (lifetime, drain) = match slot {
        Slot::Full(_) => (CONNECTION_LIFETIME, LIFETIME_DRAIN),
        Slot::Probe => (PROBE_DEADLINE, Duration::ZERO),
        Slot::Last => (STOP_WAIT, Duration::ZERO),
    };
    let closed = async {
        match &close {
            Some(c) => c.close.notified().await,
            None => std::future::pending().await,
        }
    };
    // Connections are recycled after a while so idle ones cannot hold every slot, and an
    // idle one is closed at once when a new connection needs its slot; the response in
    // flight may finish first, within `drain`, then the connection is dropped whatever its
    // state.
    let result = tokio::select! {
        // The connection first: a request already in its socket is read (and marked busy)
        // before a close asked for meanwhile, which then lets it be answered.
        biased;
        r = conn.as_mut() => r,
        _ = closed => {
            conn.as_mut().graceful_shutdown();
            // Closed for a new connection while no response was under way: it is gone in
            // a moment. hyper's close waits for a head part-way in (its 10 s), and slots
            // held so by half-sent heads would keep every new connection, a health probe
            // too, out meanwhile.
            let busy = || close.as_ref().is_some_and(|c| c.in_use());
            let grace = if busy() { LIFETIME_DRAIN } else { EVICT_GRACE };
            match tokio::time::timeout(grace, conn.as_mut()).await {
                Ok(r) => r,
                // A response begun within the grace may still finish within the drain.
                Err(_) if grace == EVICT_GRACE && busy() => {
                    match tokio::time::timeout(LIFETIME_DRAIN, conn).await {
                        Ok(r) => r,
                        Err(_) => return,
                    }
                }
                Err(_) => return,
            }
        }
        _ = tokio::time::sleep(lifetime) => {
            conn.as_mut().graceful_shutdown();
            match tokio::time::timeout(drain, conn).await {
                Ok(r) => r,
                Err(_) => {
                    tracing::debug!("admin connection dropped: its last response was not taken in time");
                    return;
                }
            }
        }
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, "admin connection ended with an error");
    }
}

fn handle(state: Arc<AdminState>, req: Request<Incoming>) -> Response<AdminBody> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = json(
            StatusCode::METHOD_NOT_ALLOWED,
            &serde_json::json!({"error": "method_not_allowed", "message": "the admin endpoints answer GET and HEAD"}),
        );
        r.headers_mut()
            .insert(header::ALLOW, http::HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    match req.uri().path() {
        "/metrics" => metrics(state, &req),
        "/healthz" => {
            let stalled = state.stalled_workers();
            if stalled.is_empty() {
                json(StatusCode::OK, &serde_json::json!({"status": "ok"}))
            } else {
                json(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &serde_json::json!({"status": "stalled", "stalled_workers": stalled}),
                )
            }
        }
        "/readyz" => match state.probe() {
            Ok(cold) => {
                let body = if cold.is_empty() {
                    serde_json::json!({"status": "ready"})
                } else {
                    serde_json::json!({"status": "ready", "cold_clusters": cold})
                };
                json(StatusCode::OK, &body)
            }
            Err(reason) => json(
                StatusCode::SERVICE_UNAVAILABLE,
                &serde_json::json!({"status": "not_ready", "reason": reason}),
            ),
        },
        "/stats" => json(StatusCode::OK, &stats(&state)),
        _ => json(
            StatusCode::NOT_FOUND,
            &serde_json::json!({"error": "not_found", "message": "admin endpoints: /metrics, /healthz, /readyz, /stats"}),
        ),
    }
}

/// Starts rendering on the scrape thread and answers with the stream of its chunks.
fn metrics(state: Arc<AdminState>, req: &Request<Incoming>) -> Response<AdminBody> {
    // Repeated `Accept` lines are one list (RFC 9110 §5.3), as `Accept-Encoding`'s are.
    let accept = req
        .headers()
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect::<Vec<_>>()
        .join(",");
    let format = Format::from_accept((!accept.is_empty()).then_some(accept.as_str()));
    let gzip = accepts_gzip(req.headers());
    let (tx, rx) = mpsc::channel(4);
    if req.method() == Method::GET {
        let runtime = state.scrape_runtime.get().cloned();
        let render = async move {
            let t = Instant::now();
            let mut w = TextWriter::new(format, gzip, tx);
            let done = match exposition::render(&state, &mut w).await {
                Ok(()) => w.finish().await.ok(),
                Err(_) => None,
            };
            state.scrapes.fetch_add(1, Ordering::Relaxed);
            if let Some((samples, _)) = done {
                state
                    .last_render_ns
                    .store(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                state.last_samples.store(samples, Ordering::Relaxed);
            }
        };
        match runtime {
            Some(rt) => drop(rt.spawn(render)),
            None => drop(tokio::spawn(render)),
        }
    }
    let body = if req.method() == Method::GET {
        AdminBody::Stream(rx)
    } else {
        AdminBody::Full(None)
    };
    let mut resp = Response::new(body);
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static(format.content_type()),
    );
    if gzip {
        resp.headers_mut().insert(
            header::CONTENT_ENCODING,
            http::HeaderValue::from_static("gzip"),
        );
    }
    resp.headers_mut().insert(
        header::VARY,
        http::HeaderValue::from_static("Accept, Accept-Encoding"),
    );
    resp
}

/// Does `Accept-Encoding` allow gzip (listed without `q=0`)?
fn accepts_gzip(h: &http::HeaderMap) -> bool {
    h.get_all(header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|item| {
            let mut parts = item.split(';').map(str::trim);
            let coding = parts.next().unwrap_or("");
            // (The parameter's name is case-insensitive: `Q=0` refuses too.)
            let zero_q = parts.any(|p| {
                p.split_once('=')
                    .filter(|(name, _)| name.trim().eq_ignore_ascii_case("q"))
                    .and_then(|(_, q)| q.trim().parse::<f32>().ok())
                    .is_some_and(|q| q == 0.0)
            });
            coding.eq_ignore_ascii_case("gzip") && !zero_q
        })
}

fn stats(state: &AdminState) -> serde_json::Value {
    use serde_json::json;
    let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let workers: Vec<_> = state
        .workers
        .iter()
        .zip(state.tick_ages())
        .enumerate()
        .map(|(i, (w, age))| {
            let lag = w.metrics.lag.snapshot();
            json!({
                "worker": i,
                "last_tick_age_ms": age,
                "requests_in_flight": w.metrics.in_flight.load(Ordering::Relaxed),
                "lag_ticks": lag.count(),
                "lag_mean_ms": if lag.count() > 0 { lag.sum_ns as f64 / lag.count() as f64 / 1e6 } else { 0.0 },
            })
        })
        .collect();
    let routes: Vec<_> = state
        .config
        .routes
        .iter()
        .enumerate()
        .map(|(ri, r)| {
            let (mut requests, mut errors, mut bytes_in, mut bytes_out) = (0, 0, 0, 0);
            for w in &state.workers {
                for s in &w.metrics.slots()[state.plan.route_slot_range(ri)] {
                    requests += s.requests.iter().map(l).sum::<u64>();
                    errors += s.errors.iter().map(l).sum::<u64>();
                    bytes_in += l(&s.bytes_in);
                    bytes_out += l(&s.bytes_out);
                }
            }
            json!({
                "name": r.name,
                "tenant": r.tenant.and_then(|t| state.config.tenants.get(t)).map(|t| &t.name),
                "path_prefix": r.path_prefix,
                "requests": requests,
                "errors": errors,
                "request_body_bytes": bytes_in,
                "response_body_bytes": bytes_out,
            })
        })
        .collect();
    let clusters: Vec<_> = state
        .config
        .clusters
        .iter()
        .enumerate()
        .map(|(ci, c)| {
            let endpoints: Vec<_> = state
                .workers
                .iter()
                .enumerate()
                .filter_map(|(wi, w)| w.upstreams.clusters.get(ci).map(|p| (wi, p)))
                .flat_map(|(wi, p)| {
                    // Then the parked ones (out of the latest DNS answer, not drained).
                    let live = p.endpoints.load_full();
                    let pools: Vec<_> = live
                        .iter()
                        .map(|e| (e.clone(), false))
                        .chain(p.parked_pools().into_iter().map(|e| (e, true)))
                        .collect();
                    pools.into_iter().map(move |(e, parked)| {
                        let s = &e.stats;
                        json!({
                            "worker": wi,
                            "address": e.addr.to_string(),
                            "parked": parked,
                            "connects_on_request": l(&s.connects_on_request),
                            "preconnects": l(&s.preconnects),
                            "reuses": l(&s.reuses),
                            "retired_max_requests": l(&s.retired_max_requests),
                            "retired_lifetime": l(&s.retired_lifetime),
                            "retired_idle": l(&s.retired_idle),
                            "retired_idle_cap": l(&s.retired_idle_cap),
                            "closed_by_server": l(&s.closed_by_server),
                            "retired_unusable": l(&s.retired_unusable),
                            "retries": l(&s.retries),
                            "refused_resends": l(&s.refused_resends),
                            "tls_full_handshakes": l(&s.tls_full_handshakes),
                            "tls_resumed_handshakes": l(&s.tls_resumed_handshakes),
                            "tls_handshake_failures": l(&s.tls_handshake_failures),
                            "h2_connections": l(&s.h2_connections),
                            "h2_waits_for_connect": l(&s.h2_waits_for_connect),
                            "connect_failures": l(&s.connect_failures),
                            "learned_limit": s.learned_limit.load(Ordering::Relaxed),
                            "ejections": l(&e.load.ejections),
                            "ejected": e.load.is_ejected(),
                            "requests_in_flight": e.load.in_flight(),
                            "queued": l(&s.queued),
                            "queue_timeouts": l(&s.queue_timeouts),
                            "queue_overflows": l(&s.queue_overflows),
                            "connections_open": e.capped_open(),
                        })
                    })
                })
                .collect();
            // The cluster's own events (DNS changes, hedges, overflows), per worker.
            let per_worker: Vec<_> = state
                .workers
                .iter()
                .enumerate()
                .filter_map(|(wi, w)| w.upstreams.clusters.get(ci).map(|p| (wi, &p.stats)))
                .map(|(wi, s)| {
                    json!({
                        "worker": wi,
                        "endpoint_updates": l(&s.endpoint_updates),
                        "endpoints_added": l(&s.endpoints_added),
                        "endpoints_removed": l(&s.endpoints_removed),
                        "hedges_fired": l(&s.hedges_fired),
                        "hedges_won": l(&s.hedges_won),
                        "hedges_refused": l(&s.hedges_refused),
                        "overflows": l(&s.overflows),
                    })
                })
                .collect();
            json!({"name": c.name, "workers": per_worker, "endpoints": endpoints})
        })
        .collect();
    let p = crate::observe::process::read();
    json!({
        "uptime_seconds": state.started.elapsed().as_secs_f64(),
        "draining": state.draining.load(Ordering::Relaxed),
        "ready": state.not_ready().is_none(),
        "cold_clusters": state.cold_clusters(),
        "stalled_workers": state.stalled_workers(),
        "workers": workers,
        "routes": routes,
        "clusters": clusters,
        "metrics": {
            "scrapes": l(&state.scrapes),
            "last_render_seconds": l(&state.last_render_ns) as f64 / 1e9,
            "last_samples": l(&state.last_samples),
        },
        "process": {
            "cpu_seconds": p.cpu_seconds,
            "resident_bytes": p.resident_bytes,
            "open_fds": p.open_fds,
            "threads": p.threads,
        },
    })
}

fn json(status: StatusCode, v: &serde_json::Value) -> Response<AdminBody> {
    let mut body = serde_json::to_vec_pretty(v).unwrap_or_default();
    body.push(b'\n');
    let mut r = Response::new(AdminBody::Full(Some(Bytes::from(body))));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

/// An admin response body: a whole JSON document, or `/metrics` chunks as they render.
/// The stream ends at an empty chunk; if the renderer goes away without sending it, the body
/// fails, so hyper aborts the response instead of ending a truncated exposition cleanly.
pub enum AdminBody {
    Full(Option<Bytes>),
    Stream(mpsc::Receiver<Bytes>),
}

/// An admin response body and, on a full slot, what marks its connection busy until the
/// body is done.
struct Tracked {
    body: AdminBody,
    _busy: Option<Busy>,
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = Truncated;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Truncated>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }
}

/// `/metrics` rendering stopped before the end.
#[derive(Debug, thiserror::Error)]
#[error("the metrics rendering ended before the exposition was complete")]
pub struct Truncated;

impl Body for AdminBody {
    type Data = Bytes;
    type Error = Truncated;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Truncated>>> {
        match self.get_mut() {
            AdminBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            AdminBody::Stream(rx) => match rx.poll_recv(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(Some(b)) if b.is_empty() => {
                    rx.close();
                    Poll::Ready(None)
                }
                Poll::Ready(Some(b)) => Poll::Ready(Some(Ok(Frame::data(b)))),
                Poll::Ready(None) => Poll::Ready(Some(Err(Truncated))),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Connections queued for the admin socket when it stops (a restart's probes and
    /// scrapes that came just before) get their request answered, not a reset; so does one
    /// the admin thread took just before the stop.
    #[test]
    fn connections_queued_at_the_stop_are_answered() {
        use std::io::{Read as _, Write as _};
        let config = Arc::new(
            Config::parse(
                std::path::Path::new("t.toml"),
                "[[listener]]\naddress = \"127.0.0.1:0\"\n",
            )
            .expect("config"),
        );
        let plan = Arc::new(MetricsPlan::new(&config));
        let state = Arc::new(AdminState::new(
            config,
            plan,
            Vec::new(),
            Arc::new(crate::upstream::dns::DnsStats::default()),
        ));
        let bound = bind(SocketAddr::from(([127, 0, 0, 1], 0))).expect("bind");
        let listener = crate::listener::listen(bound.listener).expect("listen");
        let addr = listener.local_addr().expect("addr");
        // Connected, and their requests sent, before the admin thread runs: queued.
        let clients: Vec<std::net::TcpStream> = (0..5)
            .map(|_| {
                let mut c = std::net::TcpStream::connect(addr).expect("connect");
                c.write_all(b"GET /healthz HTTP/1.1\r\nhost: admin\r\n\r\n")
                    .expect("write");
                c
            })
            .collect();
        let (_stop, stop_rx) = watch::channel(true);
        // Stopped from the start: it takes what is queued, answers, and returns.
        run(listener, bound.runtime, state, stop_rx);
        for mut c in clients {
            c.set_read_timeout(Some(Duration::from_secs(5)))
                .expect("timeout");
            let mut got = Vec::new();
            let read = c.read_to_end(&mut got);
            let got = String::from_utf8_lossy(&got);
            assert!(read.is_ok(), "{read:?} after {got:?}");
            assert!(got.starts_with("HTTP/1.1 200 OK\r\n"), "{got}");
            assert!(got.contains("\"ok\""), "{got}");
        }
    }

    #[test]
    fn gzip_is_accepted_unless_refused() {
        let h = |v: &'static str| {
            let mut m = http::HeaderMap::new();
            m.insert(header::ACCEPT_ENCODING, http::HeaderValue::from_static(v));
            accepts_gzip(&m)
        };
        assert!(h("gzip"));
        assert!(h("br, GZIP;q=0.5"));
        assert!(!h("gzip;q=0"));
        assert!(!h("gzip; Q=0"));
        assert!(!h("gzip;q = 0.000"));
        assert!(!h("identity"));
        assert!(!accepts_gzip(&http::HeaderMap::new()));
    }

    /// A connection whose last write found its socket full is in use, and not closed for a
    /// new one, until its bytes are written: then it is idle again.
    #[tokio::test]
    async fn a_connection_still_writing_is_not_taken_for_a_new_one() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let mut client = tokio::net::TcpStream::connect(l.local_addr().expect("addr"))
            .await
            .expect("connect");
        let (server, _) = l.accept().await.expect("accept");
        let open = Open::new();
        let conn = open.add();
        let mut w = WriteWatch {
            inner: server,
            conn: Some(conn.clone()),
        };
        // Written until the socket is full (the client reads nothing).
        let piece = vec![b'x'; 64 * 1024];
        let mut sent = 0usize;
        while let Ok(n) = tokio::time::timeout(Duration::from_millis(200), w.write(&piece)).await {
            sent += n.expect("write");
        }
        assert!(conn.in_use(), "{sent} bytes sent, the socket full");
        assert!(!open.close_idlest(), "a connection still writing was taken");
        // The client reads; the rest goes, and the connection is idle.
        let reader = tokio::spawn(async move {
            let mut buf = vec![0u8; 64 * 1024];
            let mut got = 0;
            while got < sent + 10 {
                got += client.read(&mut buf).await.expect("read");
            }
        });
        let before = conn.idle_since.load(Ordering::Relaxed);
        w.write_all(b"0123456789").await.expect("the last bytes");
        reader.await.expect("read all");
        assert!(!conn.in_use());
        // Idle from when its last bytes went, not from before.
        assert!(conn.idle_since.load(Ordering::Relaxed) > before);
        assert!(open.close_idlest());
    }
}
