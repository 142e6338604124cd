//! Serving one client connection: TLS handshake when the listener has TLS, protocol choice
//! (ALPN, or the HTTP/2 preface for h2c prior knowledge), hyper's HTTP/1.1 or HTTP/2 server
//! with the pipeline as its service, the idle timeout, and graceful shutdown.

pub mod h1_guard;
pub mod h1_inline;
mod h2_head;
pub mod head;
mod linger;
pub mod send_timeout;
pub mod spawner;
pub mod stream_stall;

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use futures_util::future::Either;
use futures_util::task::AtomicWaker;
use http::Request;
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::watch;

use self::h1_guard::H1Guard;
use self::send_timeout::SendTimeout;
use crate::listener::BoundListener;
use crate::observe::ConnActivity;
use crate::pipeline::body::ReqBody;
use crate::pipeline::{ConnInfo, Worker, handle};

/// Held by everything that must finish before a worker exits (connections, tunnels).
/// The worker waits until every token is dropped, or the shutdown grace passes.
#[derive(Clone)]
pub struct DrainToken(#[allow(dead_code)] tokio::sync::mpsc::Sender<()>);

impl DrainToken {
    pub fn new() -> (DrainToken, tokio::sync::mpsc::Receiver<()>) {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        (DrainToken(tx), rx)
    }
}

/// Everything a connection task needs.
pub struct ConnCtx {
    pub worker: Arc<Worker>,
    pub listener: Arc<BoundListener>,
    pub shutdown: watch::Receiver<bool>,
    pub drain: DrainToken,
    /// The connection's place under `server.max_connections`; moved into its [`ConnInfo`]
    /// once it has one, which a tunnel the connection becomes holds too.
    pub slot: Option<spawner::ConnSlot>,
}

const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Serves one accepted TCP connection to its end.
///
/// The future of the path it picks, not an `async fn` awaiting it: that was one more state
/// machine around the connection's, polled on every wake-up with its state in another line
/// of the task (`scripts/footprint.py`: about 2.5 last-level-cache read and 3.5 write misses
/// and 50 instruction-cache misses per request less without it). The socket is prepared
/// (`Prepare`), and a TLS connection's future boxed, by the path's first poll on the
/// connection's task, not here in the accept loop.
pub fn serve_connection(
    ctx: ConnCtx,
    stream: TcpStream,
    peer: SocketAddr,
) -> impl Future<Output = ()> + Send + 'static {
    match ctx.listener.tls.clone() {
        None => Either::Left(serve_plain(ctx, stream, peer, None, None, true)),
        Some(acceptor) => Either::Right(serve_tls_boxed(ctx, acceptor, stream, peer)),
    }
}

/// [`serve_tls`] on the heap: the TLS session and the futures over it are twice the size of
/// the plain path's, and inline they would size every connection's task, plain or not.
async fn serve_tls_boxed(
    ctx: ConnCtx,
    acceptor: tokio_rustls::TlsAcceptor,
    stream: TcpStream,
    peer: SocketAddr,
) {
    Box::pin(serve_tls(ctx, acceptor, stream, peer)).await;
}

/// A connection's stream, prepared for serving when its task first runs. `activity` is
/// the connection's, told when a write to the client is blocked.
trait Prepare {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn prepare(self, idle_timeout: Duration, activity: &Arc<ConnActivity>) -> Self::Io;
}

impl Prepare for TcpStream {
    type Io = SendTimeout<TcpStream>;

    /// `TCP_NODELAY`, and under both HTTP versions (and TLS): a client that stops reading
    /// is cut off.
    fn prepare(self, idle_timeout: Duration, activity: &Arc<ConnActivity>) -> Self::Io {
        let _ = self.set_nodelay(true);
        SendTimeout::new(self, idle_timeout, activity.clone())
    }
}

/// Prepared as TCP before its handshake.
impl Prepare for tokio_rustls::server::TlsStream<SendTimeout<TcpStream>> {
    type Io = Self;

    fn prepare(self, _: Duration, _: &Arc<ConnActivity>) -> Self {
        self
    }
}

/// A handshake the client ended with an alert about the listener's certificate (its chain
/// missing an intermediate, expired, for another name): every client may be failing so,
/// and the failures alone are logged at debug only. One warning per 10 s says so.
fn refused_certificate(conns: &spawner::ConnCount, listener: &str, e: &std::io::Error) {
    use rustls::AlertDescription as A;
    let Some(rustls::Error::AlertReceived(alert)) =
        e.get_ref().and_then(|e| e.downcast_ref::<rustls::Error>())
    else {
        return;
    };
    if matches!(
        alert,
        A::BadCertificate
            | A::UnsupportedCertificate
            | A::CertificateRevoked
            | A::CertificateExpired
            | A::CertificateUnknown
            | A::UnknownCA
    ) && conns.cert_warning.due()
    {
        tracing::warn!(listener, alert = ?alert, "a client refused the listener's certificate (is its chain whole, current and for the names clients ask for?); counted in tailgate_downstream_tls_handshakes_total{{result=\"failed\"}}");
    }
}

/// A TLS connection: the handshake, then HTTP/2 by ALPN or HTTP/1.1.
async fn serve_tls(
    mut ctx: ConnCtx,
    acceptor: tokio_rustls::TlsAcceptor,
    stream: TcpStream,
    peer: SocketAddr,
) {
    let handshake_timeout = ctx.worker.shared.settings.header_read_timeout;
    let activity = Arc::new(ConnActivity::default());
    // Until the client's first bytes (its hello) come, it is silent as a plain connection
    // before its first request is: a call for idle connections to close (an accept loop
    // waits at `server.max_connections`) cuts it, as nginx reuses a TLS connection that has
    // sent no data. A handshake under way is not cut.
    let heard = AtomicBool::new(false);
    let handshake = async {
        let mut first = [0u8; 1];
        if stream.peek(&mut first).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        heard.store(true, Ordering::Relaxed);
        let stream = stream.prepare(ctx.worker.shared.settings.idle_timeout, &activity);
        acceptor.accept(stream).await
    };
    // At shutdown, a handshake gets a second at most (see `first_step`).
    let accepted = first_step(
        &ctx.shutdown,
        handshake_timeout,
        handshake_timeout.min(QUEUED_WAIT),
        ctx.slot.as_ref().map(|slot| (slot, &heard)),
        handshake,
    )
    .await;
    let conns = &ctx.worker.shared.connections;
    let tls = match accepted {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            // (A client that closed or reset before its first byte, a load balancer's TCP
            // check, was no handshake.)
            if heard.load(Ordering::Relaxed) {
                conns.tls_handshake(spawner::TlsHandshake::Failed);
                refused_certificate(conns, &ctx.listener.name, &e);
            }
            tracing::debug!(client.addr = %peer, listener = %ctx.listener.name, error = %e, "TLS handshake failed");
            return;
        }
        Err(Cut::Reclaimed) => {
            tracing::debug!(client.addr = %peer, "silent connection closed before its TLS hello to make room under server.max_connections");
            return;
        }
        Err(Cut::TimedOut) => {
            // (Silent throughout, it was no handshake either.)
            if heard.load(Ordering::Relaxed) {
                conns.tls_handshake(spawner::TlsHandshake::TimedOut);
            }
            tracing::debug!(client.addr = %peer, listener = %ctx.listener.name, "TLS handshake timed out");
            return;
        }
    };
    let (_, session) = tls.get_ref();
    conns.tls_handshake(match session.handshake_kind() {
        Some(rustls::HandshakeKind::Resumed) => spawner::TlsHandshake::Resumed,
        _ => spawner::TlsHandshake::Full,
    });
    let alpn = session.alpn_protocol();
    let h2 = alpn == Some(b"h2");
    // Agreed on HTTP/1 by ALPN: HTTP/2 is not spoken, preface or not (RFC 9113 §3.3).
    let prior_knowledge = alpn.is_none();
    // SNI classifies the connection's tenant when the listener does not.
    let sni_tenant = session
        .server_name()
        .and_then(|n| ctx.worker.shared.routes.tenant_of_server_name(n));
    if h2 {
        let slot = ctx.slot.take();
        let info = conn_info(&ctx, slot, peer, true, sni_tenant, activity);
        serve_h2(ctx, tls, info).await;
    } else {
        serve_plain(ctx, tls, peer, sni_tenant, Some(activity), prior_knowledge).await;
    }
}

fn conn_info(
    ctx: &ConnCtx,
    mut slot: Option<spawner::ConnSlot>,
    peer: SocketAddr,
    tls: bool,
    sni_tenant: Option<usize>,
    activity: Arc<ConnActivity>,
) -> Arc<ConnInfo> {
    let tenant = ctx.listener.tenant.or(sni_tenant);
    if let (Some(slot), Some(t)) = (slot.as_mut(), tenant) {
        slot.classify(t);
    }
    Arc::new(ConnInfo {
        client: peer,
        client_addr: crate::pipeline::headers::client_addr_value(peer.ip()),
        tls,
        tenant,
        activity,
        drain: ctx.drain.clone(),
        slot,
        refused: std::sync::OnceLock::new(),
        requests: std::sync::atomic::AtomicU64::new(0),
    })
}

/// How long a connection accepted at shutdown waits for its first bytes.
const QUEUED_WAIT: Duration = Duration::from_secs(1);

/// A connection's first step (`step`: its TLS handshake, or its first bytes) within `limit`.
/// At shutdown the step gets `queued_limit` at most (counted from the shutdown; never past
/// `limit`), then the connection its answer: one taken from the listen queue at shutdown
/// (`listener::take_queued`), or one taken just before whose client was still sending its
/// hello or its request, has a client waiting for an answer (a restart refuses no
/// connection); one that stays silent is closed then.
///
/// With `idle` (the connection's place under `server.max_connections`, and a flag the step
/// sets once the client's first bytes came), a step that begins with a wait for the
/// client's first bytes: until they come, a call for idle connections to close (an accept
/// loop waits at the cap, see [`spawner`]) cuts it, as nginx reuses a connection still
/// waiting for its first request.
async fn first_step<F: Future>(
    shutdown: &watch::Receiver<bool>,
    limit: Duration,
    queued_limit: Duration,
    idle: Option<(&spawner::ConnSlot, &AtomicBool)>,
    step: F,
) -> Result<F::Output, Cut> {
    let mut shutdown = shutdown.clone();
    if *shutdown.borrow() {
        return tokio::time::timeout(queued_limit, step)
            .await
            .map_err(|_| Cut::TimedOut);
    }
    let deadline = tokio::time::Instant::now() + limit;
    let mut step = std::pin::pin!(step);
    let mut reclaim = idle.and_then(|(slot, heard)| Some((slot, heard, slot.reclaim_signal()?)));
    // Silent for a second at least (see `spawner::RECLAIM_MIN_IDLE`): a client's first
    // bytes may be on their way.
    let silent_from = tokio::time::Instant::now() + spawner::RECLAIM_MIN_IDLE;
    let reclaimed = async {
        match reclaim.as_mut() {
            Some((slot, heard, rx)) => loop {
                if rx.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
                if tokio::time::Instant::now() >= silent_from
                    && !heard.load(Ordering::Relaxed)
                    && slot.take_reclaim()
                {
                    return;
                }
            },
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        // The step first: bytes that came together with a call to close are read, not cut.
        biased;
        r = tokio::time::timeout_at(deadline, &mut step) => return r.map_err(|_| Cut::TimedOut),
        _ = shutdown.wait_for(|stop| *stop) => {}
        () = reclaimed => return Err(Cut::Reclaimed),
    }
    let cut = deadline.min(tokio::time::Instant::now() + queued_limit);
    tokio::time::timeout_at(cut, step)
        .await
        .map_err(|_| Cut::TimedOut)
}

/// Why a connection's [`first_step`] was cut short.
#[derive(Debug)]
enum Cut {
    TimedOut,
    /// Closed, silent, to make room under `server.max_connections`.
    Reclaimed,
}

/// No ALPN decision for HTTP/2: HTTP/1.1, unless `prior_knowledge` allows it and the
/// client opens with the HTTP/2 preface.
async fn serve_plain<I: Prepare>(
    mut ctx: ConnCtx,
    io: I,
    peer: SocketAddr,
    sni_tenant: Option<usize>,
    activity: Option<Arc<ConnActivity>>,
    prior_knowledge: bool,
) {
    let slot = ctx.slot.take();
    let settings = &ctx.worker.shared.settings;
    // (A TLS connection's was made before its handshake, under which it was prepared.)
    let activity = activity.unwrap_or_default();
    let io = io.prepare(settings.idle_timeout, &activity);
    let tls = ctx.listener.tls.is_some();
    let mut guard = H1Guard::new(io, settings.max_header_bytes, settings.header_read_timeout);
    let info = conn_info(&ctx, slot, peer, tls, sni_tenant, activity);
    // A client that connects and says nothing is closed after the idle timeout, or a second
    // into a shutdown (see `first_step`).
    let heard = AtomicBool::new(false);
    let sniffed = first_step(
        &ctx.shutdown,
        settings.idle_timeout,
        settings.header_read_timeout.min(QUEUED_WAIT),
        info.slot.as_ref().map(|slot| (slot, &heard)),
        sniff_h2(&mut guard, prior_knowledge, &heard),
    )
    .await;
    let sniffed = match sniffed {
        Ok(r) => r,
        Err(Cut::Reclaimed) => {
            tracing::debug!(client.addr = %peer, "silent connection closed to make room under server.max_connections");
            return;
        }
        Err(Cut::TimedOut) => Err(std::io::ErrorKind::TimedOut.into()),
    };
    match sniffed {
        Ok(true) => {
            guard.passthrough();
            serve_h2(ctx, guard, info).await;
        }
        Ok(false) => {
            // The usual requests are served inline; the first that is not, and all after
            // it, by hyper's server behind the guard.
            let (mut io, sniffed, head_timer) = guard.into_parts();
            let limits = h1_inline::Limits {
                max_head: settings.max_header_bytes,
                max_body: settings.max_body_bytes,
                header_timeout: settings.header_read_timeout,
                max_requests: settings.max_requests_per_connection,
            };
            let closing = AtomicBool::new(false);
            let ended = {
                // Pinned here and lent to `drive` (which takes an `Unpin` connection):
                // the future (kilobytes) is stored once, in this one.
                let inline = std::pin::pin!(h1_inline::serve(
                    &mut io,
                    bytes::BytesMut::from(&sniffed[..]),
                    head_timer,
                    &ctx.worker,
                    &info,
                    &limits,
                    &closing,
                ));
                drive(inline, ctx.shutdown.clone(), &info, settings, |_| {
                    closing.store(true, Ordering::Relaxed)
                })
                .await
            };
            if let Some(h1_inline::Ended::Handover(rest)) = ended {
                let guard = H1Guard::resume(
                    io,
                    &rest,
                    settings.max_header_bytes,
                    settings.header_read_timeout,
                    info.clone(),
                );
                serve_h1(ctx, guard, info).await;
            }
        }
        Err(_) => {}
    }
}

/// Reads until the first bytes either are or cannot be the HTTP/2 preface (with
/// `prior_knowledge`; without, only the first bytes). Everything read stays in the guard's
/// buffer for whichever server comes next.
async fn sniff_h2<I: AsyncRead + Unpin>(
    guard: &mut H1Guard<I>,
    prior_knowledge: bool,
    heard: &AtomicBool,
) -> std::io::Result<bool> {
    let mut have = guard.fill_at_least(1).await?;
    // (A client part-way through the preface is not silent: a call to make room spares it.)
    heard.store(true, Ordering::Relaxed);
    if !prior_knowledge {
        return Ok(false);
    }
    loop {
        let b = guard.buffered();
        let k = b.len().min(H2_PREFACE.len());
        if k == 0 || !H2_PREFACE.starts_with(&b[..k]) {
            return Ok(false);
        }
        if k == H2_PREFACE.len() {
            return Ok(true);
        }
        let now = guard.fill_at_least(have + 1).await?;
        if now == have {
            return Ok(false);
        }
        have = now;
    }
}

/// The pipeline as a hyper service, for the connections hyper's servers drive.
fn pipeline_service(
    worker: &Arc<Worker>,
    info: &Arc<ConnInfo>,
) -> impl hyper::service::Service<
    Request<Incoming>,
    Response = http::Response<crate::pipeline::body::RespBody>,
    Error = std::convert::Infallible,
    Future: Send + 'static,
> + Clone
+ Send
+ 'static {
    let (worker, info) = (worker.clone(), info.clone());
    let limit = worker.shared.settings.max_body_bytes;
    let max_requests = worker.shared.settings.max_requests_per_connection;
    service_fn(move |req: Request<Incoming>| {
        // Called from the connection's task as each request is taken; past the cap,
        // [`Drive`] asks the connection to close once this poll of it is over. During
        // `server.shutdown_delay` each request is a connection's last, as at the cap (on
        // HTTP/2, [`Drive`] sends GOAWAY once this poll of it is over).
        let last =
            info.count_any_request(max_requests) | worker.shared.leaving.load(Ordering::Relaxed);
        // The stand-in for a head the smuggling guard refused: its JSON error.
        if let Some(e) = info.refused_head(&req) {
            let resp = crate::pipeline::refusal_response(&worker, &info, e);
            return Either::Right(std::future::ready(Ok(resp)));
        }
        let h1 = req.version() < http::Version::HTTP_2;
        // The head boxed, as the inline server's is: one allocation per request on this
        // path (bodies that stream, `Expect`, HTTP/2), so that the pipeline has one shape
        // and the inline path, nearly every request, passes its head by pointer.
        let (parts, body) = req.into_parts();
        let handled = handle(
            worker.clone(),
            info.clone(),
            Box::new(parts),
            ReqBody::new(body, limit),
        );
        if !(last && h1) {
            return Either::Left(Either::Left(handled));
        }
        // The last HTTP/1.1 request says so in its answer: an answer ready within the poll
        // that took its request is written before [`Drive`] turns keep-alive off, and
        // hyper's server honours the header (no request pipelined behind it is served).
        // (Not a `101`: its `Connection: upgrade` stays, and the connection becomes the
        // tunnel.)
        Either::Left(Either::Right(Box::pin(async move {
            let mut resp = handled.await?;
            if resp.status() != http::StatusCode::SWITCHING_PROTOCOLS {
                resp.headers_mut().insert(
                    http::header::CONNECTION,
                    http::HeaderValue::from_static("close"),
                );
            }
            Ok(resp)
        })))
    })
}

async fn serve_h1<I>(ctx: ConnCtx, io: H1Guard<I>, info: Arc<ConnInfo>)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let settings = &ctx.worker.shared.settings;
    let service = pipeline_service(&ctx.worker, &info);
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(None)
        .max_header_size(settings.max_header_bytes)
        // Its read buffer must hold a whole head of that size (by default it holds about
        // 408 KiB: a larger head allowed by the config would get hyper's bare 431).
        .max_buf_size(settings.max_header_bytes.max(400 * 1024) + 8 * 1024)
        .keep_alive(true)
        .writev(false)
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades();
    let conn = std::pin::pin!(conn);
    let ended = drive(conn, ctx.shutdown, &info, settings, |c| {
        c.as_mut().graceful_shutdown()
    })
    .await;
    log_failed_end(&info, ended);
}

async fn serve_h2<I>(ctx: ConnCtx, io: I, info: Arc<ConnInfo>)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let settings = &ctx.worker.shared.settings;
    let service = pipeline_service(&ctx.worker, &info);
    // Each stream's task is watched for a client that stopped taking its data.
    let exec = stream_stall::StreamExec {
        idle: settings.idle_timeout,
    };
    let conn = http2::Builder::new(exec)
        .timer(TokioTimer::new())
        // h2 counts 32 bytes more per field than the field holds, so a head of many short
        // fields (a browser's cookie crumbs) that HTTP/1.1 takes would be refused here
        // with h2's own bare `431`, unrecorded. The limit itself is the pipeline's
        // (`pipeline::h2_head_too_large`), counted as HTTP/1.1 would count the head, and
        // answered and recorded as there; h2 holds at most twice it.
        .max_header_list_size(
            settings
                .max_header_bytes
                .saturating_mul(2)
                .min(u32::MAX as usize) as u32,
        )
        // HTTP/2 Rapid Reset (CVE-2023-44487): more than this many streams the client
        // resets before they are taken end the connection with GOAWAY ENHANCE_YOUR_CALM.
        // h2's default, set here so that it cannot go with a dependency update. (Streams
        // reset once taken are counted by `Drive`.)
        .max_pending_accept_reset_streams(20)
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
        .initial_stream_window_size(H2_STREAM_WINDOW)
        .initial_connection_window_size(H2_CONN_WINDOW)
        // What each stream may hold of its answer that the client's socket has not taken:
        // hyper's 400 KiB made 80 MiB per connection, held by a client that opens every
        // stream it may with the largest windows and reads nothing.
        .max_send_buf_size(H2_SEND_BUF)
        .serve_connection(
            TokioIo::new(
                h2_head::H2HeadTimer::new(io, settings.header_read_timeout).with_info(info.clone()),
            ),
            service,
        );
    let conn = std::pin::pin!(conn);
    let mut driven = drive(conn, ctx.shutdown, &info, settings, |c| {
        c.as_mut().graceful_shutdown()
    });
    driven.leaving = Some(&ctx.worker.shared.leaving);
    driven.stall_margin = H2_CONN_STALL_MARGIN;
    let ended = driven.await;
    log_failed_end(&info, ended);
}

/// A connection hyper's server ended with an error: worth a debug line, no more (the client
/// left, sent garbage, or timed out).
fn log_failed_end(info: &ConnInfo, ended: Option<Result<(), hyper::Error>>) {
    match ended {
        Some(Err(e)) => {
            tracing::debug!(client.addr = %info.client, error = %e, "client connection ended with an error");
        }
        None => {
            tracing::debug!(client.addr = %info.client, "client connection dropped: it did not close when asked to");
        }
        Some(Ok(())) => {}
    }
}

/// Polls a connection to its end, closing it gracefully at shutdown or after `idle` with no
/// request in flight. One closed for idleness that has not ended one more `idle` later,
/// and has no request in flight then, is dropped (`None`): an HTTP/2 client that never
/// sends its preface, or never answers the PING of HTTP/2's graceful close, would otherwise
/// hold it for good. A request that started meanwhile (a stream opened before the client
/// saw the GOAWAY, a head that was already coming) is served, and the deadline moves on.
/// (At shutdown the worker's grace period bounds it.)
///
/// The connection is what wakes this task on nearly every wake-up (a request arrives, the
/// upstream answers), so the shutdown signal and the idle timer are not polled on each one:
/// they are polled with their own waker, and only after it fired. Polling them each time
/// cost a lock of the shutdown signal's waiter list and a timer poll, twice per request.
fn drive<'a, C, G>(
    conn: C,
    mut shutdown: watch::Receiver<bool>,
    info: &'a ConnInfo,
    settings: &crate::config::ServerSettings,
    graceful: G,
) -> Drive<'a, C, G>
where
    C: Future + Unpin,
    G: FnMut(&mut C) + Unpin,
{
    let close_at_first_poll = *shutdown.borrow();
    let idle = settings.idle_timeout;
    let side = Arc::new(SideWake::default());
    Drive {
        close_at_first_poll,
        conn,
        side_waker: Waker::from(side.clone()),
        side,
        closing: false,
        graceful_due: false,
        close_deadline: false,
        shut: false,
        info,
        idle,
        max_requests: match settings.max_requests_per_connection {
            0 => u64::MAX,
            max => max,
        },
        leaving: None,
        graceful,
        // Any change of the shutdown value (or its sender going away) means: close.
        stop: Box::pin(async move {
            let _ = shutdown.changed().await;
        }),
        reclaim: info
            .slot
            .as_ref()
            .and_then(|s| s.reclaim_signal())
            .map(reclaim_wait),
        idle_timer: Box::pin(tokio::time::sleep(idle)),
        stall_margin: Duration::ZERO,
    }
}

/// [`drive`]'s future: a struct polled directly, not a state machine of its own around the
/// connection's, whose state every wake-up would read from another line of the task. What
/// is polled only after the side waker fired (the shutdown signal, the idle timer) is on
/// the heap, out of the lines each wake-up reads.
#[must_use = "a connection is served only while its Drive is polled"]
struct Drive<'a, C, G> {
    /// Shutdown had begun when the connection was handed here: it is asked to close once
    /// it has been polled, not before. A head handed over by the inline server (shutdown
    /// began while it was coming) is then in hyper's buffer, and hyper's graceful close
    /// serves it; asked before, hyper saw a connection with nothing read and closed it,
    /// and the client's request went unanswered.
    close_at_first_poll: bool,
    conn: C,
    side: Arc<SideWake>,
    side_waker: Waker,
    closing: bool,
    /// Asked to close for a shutdown while part of a request head was in, and not yet told
    /// (see [`Drive::close_for_shutdown`]): it is, once the head is whole.
    graceful_due: bool,
    /// The connection was asked to close for idleness or a shutdown: from then on the idle
    /// timer runs to when it must have ended (unless a request is in flight then).
    close_deadline: bool,
    /// The shutdown was seen (`stop` is not polled again).
    shut: bool,
    info: &'a ConnInfo,
    idle: Duration,
    /// `server.max_requests_per_connection` (`u64::MAX`: no cap). Once the connection has
    /// taken that many, it is asked to close, with `idle` to end: those in flight are
    /// answered (the last HTTP/1.1 one with `Connection: close`; HTTP/2 sends GOAWAY).
    max_requests: u64,
    /// `server.shutdown_delay` has begun ([`crate::pipeline::Shared::leaving`]): looked at
    /// by HTTP/2 connections, asked to close (GOAWAY) as at the request cap, at the first
    /// wake-up then after a request (a request in the delay, or one before it and any
    /// frame in the delay). HTTP/1.1's servers say `Connection: close` in the next answer
    /// themselves; closing an idle one here would race its client's next request. An
    /// HTTP/2 connection that wakes for nothing through the delay is told at the drain.
    leaving: Option<&'a AtomicBool>,
    graceful: G,
    stop: Pin<Box<dyn Future<Output = ()> + Send>>,
    /// Under `server.max_connections`: ready when an accept loop waits at the cap and asks
    /// for connections doing nothing to close (see [`spawner`]). `None` without a cap.
    reclaim: Option<Reclaim>,
    idle_timer: Pin<Box<tokio::time::Sleep>>,
    /// Added to `idle` before a client that took no response data is cut off
    /// ([`Drive::client_stalled`]): [`H2_CONN_STALL_MARGIN`] over HTTP/2, nothing over
    /// HTTP/1.1.
    stall_margin: Duration,
}

/// How much later than a stalled HTTP/2 stream (reset on its own after `idle_timeout`,
/// [`stream_stall`]) its connection is cut off for taking no response data. Both clocks
/// start at the same piece: cut at the same moment, the connection's check could run
/// first and end the connection, and with it the client's other streams (one waiting on
/// a slow upstream, a long poll) that took nothing only because nothing was sent to them.
/// Later, the stream's reset has run and taken its piece off the count (and a piece still
/// waiting on another stream started the clock again: `ConnActivity::piece_dropped`);
/// what still cuts the connection then is a client that takes nothing on any stream, its
/// streams' own resets having come first where they could.
const H2_CONN_STALL_MARGIN: Duration = Duration::from_secs(1);

/// A wait for the next call for idle connections to close: the signal's receiver back
/// when it comes (`None`: the signal is gone, and no call will come).
type Reclaim = Pin<Box<dyn Future<Output = Option<watch::Receiver<u64>>> + Send>>;

fn reclaim_wait(mut rx: watch::Receiver<u64>) -> Reclaim {
    Box::pin(async move { rx.changed().await.ok().map(|()| rx) })
}

/// Did a call for idle connections to close come (see [`spawner`])? The wait for the next
/// is registered before this returns.
fn reclaim_asked(reclaim: &mut Option<Reclaim>, cx: &mut Context<'_>) -> bool {
    let mut asked = false;
    while let Some(wait) = reclaim.as_mut() {
        match wait.as_mut().poll(cx) {
            Poll::Pending => break,
            Poll::Ready(rx) => {
                asked = true;
                *reclaim = rx.map(reclaim_wait);
            }
        }
    }
    asked
}

impl<C, G> Future for Drive<'_, C, G>
where
    C: Future + Unpin,
    G: FnMut(&mut C) + Unpin,
{
    type Output = Option<C::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        loop {
            if let Poll::Ready(res) = Pin::new(&mut this.conn).poll(cx) {
                return Poll::Ready(Some(res));
            }
            if this.close_at_first_poll {
                this.close_at_first_poll = false;
                this.close_for_shutdown();
                continue;
            }
            let requests = this.info.requests.load(Ordering::Relaxed);
            // Rapid reset (CVE-2023-44487): a client that opens streams and resets them at
            // once makes each one a request routed and sent upstream, and frees its place
            // under the stream limit as it goes. Past `CANCELLED_EARLY_MIN` streams, more
            // than half of them given up on within a second and before their answer, it is
            // no client: dropped (Envoy's premature-reset rule is alike). A client that
            // mixes in as many requests answered at once (a `404`) stays under the share,
            // and reaches the upstream with half its streams: a limit of this rule, as of
            // Envoy's. (Envoy sends a GOAWAY first; this drops the connection.)
            if requests >= CANCELLED_EARLY_MIN
                && u64::from(this.info.activity.cancelled_early()) * 2 > requests
            {
                tracing::warn!(client.addr = %this.info.client, requests, cancelled = this.info.activity.cancelled_early(), "client gave up on most of its requests before their answers (rapid reset); connection dropped");
                return Poll::Ready(None);
            }
            // (After a request: a connection that has carried none yet, a new one during
            // the delay, is not told at its preface, which a client may answer by
            // reconnecting at once, to this gateway again.)
            let leaving = requests > 0 && this.leaving.is_some_and(|l| l.load(Ordering::Relaxed));
            if (requests >= this.max_requests || leaving) && this.side.capped_at.get().is_none() {
                let _ = this.side.capped_at.set(std::time::Instant::now());
                // (Already closing, for idleness or a shutdown: the cap still holds below.
                // A client that answers no PING went on past it for as long as a request
                // of its own was in flight.)
                if !this.closing {
                    let idle = this.idle;
                    this.close_as_idle_within(idle);
                    this.side.woken.store(true, Ordering::Release);
                    continue;
                }
            }
            // HTTP/2's graceful close sends its final GOAWAY only once the client answers a
            // PING: a client that never does could go on opening streams, each served. One
            // that answers stops within a round trip of it, however fast it sends; past the
            // cap by more than a stream limit's worth, still opening streams a while after
            // the close began, it is not answering, and the connection is dropped.
            if requests > this.max_requests.saturating_add(STREAMS_PAST_CAP)
                && this
                    .side
                    .capped_at
                    .get()
                    .is_some_and(|at| at.elapsed() >= CAP_CLOSE_PATIENCE)
            {
                tracing::debug!(client.addr = %this.info.client, "client went on opening streams past max_requests_per_connection; connection dropped");
                return Poll::Ready(None);
            }
            if this.closing {
                if this.graceful_due && !this.info.activity.reading_head() {
                    this.graceful_due = false;
                    (this.graceful)(&mut this.conn);
                    continue;
                }
                if !this.close_deadline {
                    return Poll::Pending;
                }
                // Only the close deadline is left to watch (the idle timer, set to it), on
                // the timer's own waker.
                this.side.task.register(cx.waker());
                if !this.side.woken.swap(false, Ordering::AcqRel) {
                    return Poll::Pending;
                }
                let mut side_cx = Context::from_waker(&this.side_waker);
                // A shutdown while a close for idleness or the request cap runs (its
                // deadline a second or `idle` away): the close has what a shutdown's has,
                // at most. An HTTP/2 client that never answers the close's PING held the
                // drain for the whole grace period.
                if !this.shut && this.stop.as_mut().poll(&mut side_cx).is_ready() {
                    this.shut = true;
                    let cut = tokio::time::Instant::now() + SHUTDOWN_CLOSE_WAIT;
                    if this.idle_timer.deadline() > cut {
                        this.idle_timer.as_mut().reset(cut);
                    }
                }
                if this.idle_timer.as_mut().poll(&mut side_cx).is_pending() {
                    return Poll::Pending;
                }
                if this.info.activity.idle_deadline(this.idle).is_some() {
                    if !this.info.activity.still_sending() && !this.info.activity.reading_head() {
                        return Poll::Ready(None);
                    }
                    // No request in flight, but answers still on their way to the client
                    // (a blocked write, which the send timeout bounds, or the lingering
                    // close), or a head (or a small body) still coming, which its header
                    // read timeout bounds, and the grace period at a shutdown: looked at
                    // again a moment later, not cut.
                    this.idle_timer
                        .as_mut()
                        .reset(tokio::time::Instant::now() + SHUTDOWN_CLOSE_WAIT);
                    this.side.woken.store(true, Ordering::Release);
                    continue;
                }
                // Requests in flight: served, unless the client stopped taking their
                // response data (as below), which a connection asked to close (its last
                // request under `max_requests_per_connection`, a shutdown) must not
                // escape.
                if this.client_stalled() {
                    return Poll::Ready(None);
                }
                // Looked at again within a second, not an idle timeout (what
                // `client_stalled` set with no answer waiting): nothing else wakes this
                // timer when the last request ends, and an HTTP/2 client that never
                // answers the close's PING held the drain for the whole grace period.
                let soon = tokio::time::Instant::now() + SHUTDOWN_CLOSE_WAIT;
                if this.idle_timer.deadline() > soon {
                    this.idle_timer.as_mut().reset(soon);
                }
                this.side.woken.store(true, Ordering::Release);
                continue;
            }
            // Registered before the flag is read: a wake-up in between is not lost.
            this.side.task.register(cx.waker());
            if !this.side.woken.swap(false, Ordering::AcqRel) {
                return Poll::Pending;
            }
            let mut side_cx = Context::from_waker(&this.side_waker);
            if this.stop.as_mut().poll(&mut side_cx).is_ready() {
                this.close_for_shutdown();
                continue;
            }
            // (Taken from the batch only by one doing nothing.)
            if reclaim_asked(&mut this.reclaim, &mut side_cx)
                && this.doing_nothing()
                && this.info.slot.as_ref().is_some_and(|s| s.take_reclaim())
            {
                tracing::debug!(client.addr = %this.info.client, "idle connection closed to make room under server.max_connections");
                // Not a whole idle timeout to end: an HTTP/2 client that never answers the
                // close's PING (or never sent its preface) would keep the room it makes
                // for that long.
                this.close_as_idle_within(SHUTDOWN_CLOSE_WAIT);
                continue;
            }
            if this.idle_timer.as_mut().poll(&mut side_cx).is_pending() {
                return Poll::Pending;
            }
            match this.info.activity.idle_deadline(this.idle) {
                // Part of a head held by the guard in front of hyper's server: not idle
                // (its own timer, `header_read_timeout`, bounds it).
                Some(_) if this.info.activity.reading_head() => this
                    .idle_timer
                    .as_mut()
                    .reset(tokio::time::Instant::now() + this.idle),
                Some(at) if at <= std::time::Instant::now() => this.close_as_idle(),
                Some(at) => this.idle_timer.as_mut().reset(at.into()),
                // Requests in flight: unless the client stopped taking their response data.
                None => {
                    if this.client_stalled() {
                        return Poll::Ready(None);
                    }
                }
            }
            // The timer was reset (or the connection is closing): poll again.
            this.side.woken.store(true, Ordering::Release);
        }
    }
}

impl<C, G> Drive<'_, C, G>
where
    C: Future + Unpin,
    G: FnMut(&mut C) + Unpin,
{
    /// No request in flight, no head coming, nothing on its way to the client, for
    /// [`spawner::RECLAIM_MIN_IDLE`] at least.
    fn doing_nothing(&self) -> bool {
        let a = &self.info.activity;
        a.idle_deadline(spawner::RECLAIM_MIN_IDLE)
            .is_some_and(|at| at <= std::time::Instant::now())
            && !a.reading_head()
            && !a.still_sending()
    }

    /// Asks the connection to close after its idle timeout: it has
    /// [`SHUTDOWN_CLOSE_WAIT`] to end (then, with no request in flight, it is dropped), not
    /// one more idle timeout: an HTTP/2 client that never answers the close's PING (or
    /// never sent its preface) would be held twice as long as `idle_timeout` says. A
    /// client that does answer, or an HTTP/1.1 one, is closed at once.
    fn close_as_idle(&mut self) {
        self.close_as_idle_within(SHUTDOWN_CLOSE_WAIT);
    }

    /// Asks the connection to close, with `within` to end (then, with no request in
    /// flight, it is dropped).
    fn close_as_idle_within(&mut self, within: Duration) {
        self.closing = true;
        self.close_deadline = true;
        self.idle_timer
            .as_mut()
            .reset(tokio::time::Instant::now() + within);
        (self.graceful)(&mut self.conn);
    }

    /// With requests in flight: has the client taken none of their response data for
    /// `idle`? Over HTTP/2 such a client leaves no write blocked (its flow-control window
    /// holds the data back), so the send timeout never sees it, and each stalled stream
    /// would hold its upstream connection for as long as the client liked: the connection is
    /// dropped, and its streams with it. If not, the timer is set to when it would be.
    fn client_stalled(&mut self) -> bool {
        match self
            .info
            .activity
            .stalled_deadline(self.idle + self.stall_margin)
        {
            Some(at) if at <= std::time::Instant::now() => {
                tracing::debug!(client.addr = %self.info.client, "client took no response data for the idle timeout; connection dropped");
                self.info.activity.set_send_timed_out();
                true
            }
            Some(at) => {
                self.idle_timer.as_mut().reset(at.into());
                false
            }
            None => {
                self.idle_timer
                    .as_mut()
                    .reset(tokio::time::Instant::now() + self.idle);
                false
            }
        }
    }

    /// Asks the connection to close for a shutdown, and gives it [`SHUTDOWN_CLOSE_WAIT`] to
    /// do so while no request is in flight (then, as after an idle close, it is dropped). An
    /// HTTP/2 client that does not answer the PING of the graceful close (gone without a
    /// FIN) would otherwise hold the worker's drain for the whole grace period, as nginx
    /// does not (it closes idle HTTP/2 connections at once).
    ///
    /// A connection with part of a request head in is told once the head is whole (the
    /// header read timeout bounds that): hyper's server, behind the guard that holds a head
    /// back until it is whole, looks idle until then, and its graceful close would close
    /// it, leaving the client's request unanswered. Told after, it answers the request with
    /// `Connection: close`, as a restart must (it refuses no connection).
    fn close_for_shutdown(&mut self) {
        self.shut = true;
        self.closing = true;
        self.close_deadline = true;
        self.idle_timer
            .as_mut()
            .reset(tokio::time::Instant::now() + SHUTDOWN_CLOSE_WAIT);
        self.side.woken.store(true, Ordering::Release);
        if self.info.activity.reading_head() {
            self.graceful_due = true;
        } else {
            (self.graceful)(&mut self.conn);
        }
    }
}

/// How many requests past `max_requests_per_connection` a connection closing for it may
/// take at any pace ([`MAX_CONCURRENT_STREAMS`]'s worth), and for how long after the close
/// began it may go on taking more: an HTTP/2 client answers the close's PING within a round
/// trip, and its final GOAWAY stops it.
const STREAMS_PAST_CAP: u64 = MAX_CONCURRENT_STREAMS as u64;
const CAP_CLOSE_PATIENCE: Duration = Duration::from_secs(2);

/// The most of a stream's answer an HTTP/2 connection holds for a client that has not
/// taken it: 64 KiB, h2's default window, so that a client reading at the pace its window
/// allows never waits on it; times [`MAX_CONCURRENT_STREAMS`], 12.5 MiB per connection at
/// most.
const H2_SEND_BUF: usize = 64 * 1024;

/// What one HTTP/2 stream's upload may send ahead of the gateway reading it
/// (`SETTINGS_INITIAL_WINDOW_SIZE`), and what all of a connection's may
/// ([`H2_CONN_WINDOW`], the most of a client's data a connection holds unread). hyper's
/// defaults give both 1 MiB, so one upload whose body is not read yet (its request queued
/// for an upstream connection, or its upstream slow to read) took the whole connection's
/// window, and every other stream's upload stopped behind it, to end as a client body
/// timeout. With a quarter of it per stream, four such uploads hold a connection up, not
/// one; 256 KiB per round trip still lets one upload move at about 5 MB/s over 50 ms.
/// (Envoy's edge advice is 64 KiB per stream and 1 MiB per connection; nginx reads 64 KiB
/// per stream ahead.)
const H2_STREAM_WINDOW: u32 = 256 * 1024;
const H2_CONN_WINDOW: u32 = 1024 * 1024;

/// How many requests a connection must have carried before the share of them its client
/// gave up on before their answer may end it: Envoy's
/// `overload.premature_reset_total_stream_count` default. (With 100, gRPC clients whose
/// sub-second deadlines expired while an upstream was slow were cut off, their healthy
/// streams with them, after a hundred calls.)
const CANCELLED_EARLY_MIN: u64 = 500;

/// The HTTP/2 server's `SETTINGS_MAX_CONCURRENT_STREAMS` (hyper's default, set here so that
/// it cannot change with a dependency update).
const MAX_CONCURRENT_STREAMS: u32 = 200;

/// How long a connection asked to close at shutdown may take to, with no request in flight.
const SHUTDOWN_CLOSE_WAIT: Duration = Duration::from_secs(1);

/// The waker given to the shutdown signal and the idle timer of [`drive`]: marks that one of
/// them has something to say, and wakes the connection task.
struct SideWake {
    woken: AtomicBool,
    task: AtomicWaker,
    /// When the connection was asked to close for reaching `max_requests_per_connection`
    /// (here, on the heap, rather than in the `Drive` every wake-up reads).
    capped_at: std::sync::OnceLock<std::time::Instant>,
}

impl Default for SideWake {
    fn default() -> Self {
        // Woken at first, so that both are polled once and register.
        SideWake {
            woken: AtomicBool::new(true),
            task: AtomicWaker::new(),
            capped_at: std::sync::OnceLock::new(),
        }
    }
}

impl Wake for SideWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.task.wake();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> ConnInfo {
        let peer: SocketAddr = "127.0.0.1:9".parse().expect("address");
        ConnInfo {
            client: peer,
            client_addr: crate::pipeline::headers::client_addr_value(peer.ip()),
            tls: false,
            tenant: None,
            activity: Arc::default(),
            drain: DrainToken::new().0,
            slot: None,
            refused: std::sync::OnceLock::new(),
            requests: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// At a shutdown, a connection with no request in flight whose last answer is still on
    /// its way (a write to the client blocked) is not dropped at the close's deadline, which
    /// would cut the answer; once the write went through, it is.
    #[tokio::test(start_paused = true)]
    async fn a_close_waits_for_an_answer_on_its_way() {
        let cfg = crate::Config::parse(
            std::path::Path::new("t.toml"),
            "[[listener]]\naddress = \"127.0.0.1:0\"\n",
        )
        .expect("config");
        let info = info();
        let (stop, shutdown) = watch::channel(false);
        let conn = std::future::pending::<()>();
        let mut d = std::pin::pin!(drive(conn, shutdown, &info, &cfg.server, |_| {}));
        info.activity.set_write_blocked(true);
        stop.send_replace(true);
        let waited = tokio::time::timeout(SHUTDOWN_CLOSE_WAIT * 10, d.as_mut()).await;
        assert!(waited.is_err(), "dropped with an answer on its way");
        info.activity.set_write_blocked(false);
        let ended = tokio::time::timeout(SHUTDOWN_CLOSE_WAIT * 3, d.as_mut()).await;
        assert!(
            matches!(ended, Ok(None)),
            "still open once the answer was out"
        );
    }

    /// At a shutdown, a connection with a request in flight past the close's deadline (its
    /// client never answers the close, as an HTTP/2 one gone without a FIN) is dropped soon
    /// after that request ends. It was looked at again only after a whole idle timeout,
    /// and held the worker's drain for the grace period.
    #[tokio::test(start_paused = true)]
    async fn a_close_ends_soon_after_the_last_request_in_flight() {
        let cfg = crate::Config::parse(
            std::path::Path::new("t.toml"),
            "[server]\nidle_timeout = \"60s\"\n[[listener]]\naddress = \"127.0.0.1:0\"\n",
        )
        .expect("config");
        let info = info();
        let (stop, shutdown) = watch::channel(false);
        let conn = std::future::pending::<()>();
        let mut d = std::pin::pin!(drive(conn, shutdown, &info, &cfg.server, |_| {}));
        info.activity.begin();
        stop.send_replace(true);
        let waited = tokio::time::timeout(SHUTDOWN_CLOSE_WAIT * 3 / 2, d.as_mut()).await;
        assert!(waited.is_err(), "dropped with a request in flight");
        info.activity.end();
        let ended = tokio::time::timeout(SHUTDOWN_CLOSE_WAIT * 3, d.as_mut()).await;
        assert!(
            matches!(ended, Ok(None)),
            "still open after its last request ended"
        );
    }
}
