//! The connection the pipeline holds for one exchange, over either protocol: an HTTP/1.1
//! connection checked out of the idle list (driven inline, [`super::h1`]), or a stream slot
//! on a shared HTTP/2 connection (hyper). The request head is borrowed and written in the
//! connection's protocol here (origin-form + `Host` for HTTP/1.1; absolute-form, whose
//! authority becomes `:authority`, for HTTP/2), so the pipeline does not care which one it
//! got — even when a resend lands on the other kind.

use std::error::Error as _;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::task::AtomicWaker;
use http::request::Parts;
use http::uri::{PathAndQuery, Scheme};
use http::{Request, Response, Uri, Version, header};
use hyper::body::Incoming;
use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::h1::{H1Conn, H1Error, Upgraded};
use super::multiplex::StreamSlot;
use super::pool::EndpointPool;
use crate::pipeline::body::{ReqBody, ReqBodyError};
use crate::pipeline::error::ProxyError;
use crate::pipeline::headers::Added;

/// The HTTP version spoken to a cluster's endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// HTTP/1.1 keep-alive connections, one request at a time each.
    Http1,
    /// HTTP/2, multiplexed: prior knowledge (h2c) for plain endpoints, ALPN `h2` over TLS.
    Http2,
    /// TLS only: offer `h2` and `http/1.1` by ALPN and speak what the server picks.
    Auto,
}

impl Protocol {
    /// The ALPN protocols a TLS connection offers, in order of preference.
    pub fn alpn(self) -> Vec<Vec<u8>> {
        match self {
            Protocol::Http1 => vec![b"http/1.1".to_vec()],
            Protocol::Http2 => vec![b"h2".to_vec()],
            Protocol::Auto => vec![b"h2".to_vec(), b"http/1.1".to_vec()],
        }
    }
}

/// A connection's protocol engine.
pub(super) enum Sender {
    /// Driven inline by the request's task ([`super::h1`]).
    H1(Box<H1Conn>),
    H2(http2::SendRequest<ReqBody>),
}

/// A response body from an upstream: read by hyper's HTTP/2 connection task, or straight
/// off an HTTP/1.1 connection by [`Conn::poll_body`] (the marker then says so; the bytes
/// come through the [`Conn`]).
pub enum UpBody {
    Hyper(Incoming),
    H1,
}

/// Why sending a request failed.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// Nothing of the request was written: the connection had been closed. Sending it
    /// elsewhere is always safe, whatever the method; the body comes back for that.
    #[error("the connection was closed before the request was written")]
    NotSent(NotSentBody),
    #[error(transparent)]
    Hyper(hyper::Error),
    #[error(transparent)]
    H1(H1Error),
    /// The deadline given to [`Conn::send`] passed before the response head came.
    #[error("the upstream did not answer in time")]
    TimedOut,
    /// Reading the client's body failed while hyper's HTTP/2 connection waited for it.
    #[error(transparent)]
    ClientBody(ReqBodyError),
}

/// The body of a request that was not sent.
pub struct NotSentBody(pub ReqBody);

impl std::fmt::Debug for NotSentBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NotSentBody")
    }
}

impl SendError {
    /// The client-body error behind this, if reading the client's body is what failed.
    pub fn req_body_error(&self) -> Option<&ReqBodyError> {
        match self {
            SendError::H1(H1Error::Body(b)) | SendError::ClientBody(b) => Some(b),
            SendError::Hyper(e) => {
                let mut source = e.source();
                while let Some(s) = source {
                    if let Some(b) = s.downcast_ref::<ReqBodyError>() {
                        return Some(b);
                    }
                    source = s.source();
                }
                None
            }
            _ => None,
        }
    }

    /// Did the upstream answer with something that is not a valid response? It had the
    /// request and answered it, so the request is not sent again.
    pub fn malformed_response(&self) -> bool {
        match self {
            SendError::H1(H1Error::BadResponse(_)) => true,
            SendError::Hyper(e) => e.is_parse() || e.is_parse_status(),
            _ => false,
        }
    }

    /// Did the upstream refuse the request before processing any of it (HTTP/2)?
    pub fn refused_before_processing(&self) -> bool {
        matches!(self, SendError::Hyper(e) if refused_before_processing(e))
    }

    /// Did the HTTP/2 server reset this request's stream alone (`RST_STREAM` with a reason
    /// other than `REFUSED_STREAM`), its connection going on? A stream sent again after
    /// this may go on the same connection: one failed exchange says nothing against the
    /// connection (RFC 9113 §5.4.2), as Go's and Envoy's clients treat it too.
    /// (`REFUSED_STREAM` is left out: a server refuses streams when a connection has
    /// served its share, and the request goes to a new one. So is `ENHANCE_YOUR_CALM`: the
    /// server asks this connection to back off.)
    pub fn stream_reset_only(&self) -> bool {
        matches!(self, SendError::Hyper(e) if h2_error(e).is_some_and(|h2| {
            h2.is_reset()
                && h2.is_remote()
                && !matches!(
                    h2.reason(),
                    Some(h2::Reason::REFUSED_STREAM | h2::Reason::ENHANCE_YOUR_CALM)
                )
        }))
    }
}

/// A connection checked out of the pool for one exchange.
pub struct Conn {
    pub(super) sender: Sender,
    pub pool: Arc<EndpointPool>,
    /// It existed before this request (no connect was paid for it).
    pub reused: bool,
    pub(super) created: Instant,
    pub(super) uses: u32,
    /// The response was a success (2xx/3xx): a close after it can teach the server's
    /// requests-per-connection limit (a close after an error cannot).
    pub response_ok: bool,
    /// HTTP/2: this exchange's stream on the shared connection, freed when it ends.
    pub(super) _slot: Option<StreamSlot>,
    /// HTTP/2: the progress of this exchange's request body, which hyper's connection task
    /// sends unseen here (see [`Self::client_stalled_since`]).
    pub(super) h2_progress: Option<Arc<crate::pipeline::body::BodyProgress>>,
}

impl Conn {
    /// Is this a stream on a multiplexed HTTP/2 connection?
    pub fn is_h2(&self) -> bool {
        matches!(self.sender, Sender::H2(_))
    }

    /// A connection for a request this one could not carry (closed before the request was
    /// written, refused, failed): a fresh HTTP/1.1 connection; for HTTP/2, the shared
    /// connection this one was on is forgotten first, and the request takes a stream on
    /// another open one, or waits for the one being opened, or opens it. One connect is
    /// then shared by every request a closing connection turned away (after a GOAWAY, hyper
    /// keeps the connection looking open until its task runs again, and each request sent
    /// on it meanwhile comes back unsent).
    ///
    /// With `keep_h2`, the shared HTTP/2 connection is not forgotten (the server reset one
    /// stream on it, [`SendError::stream_reset_only`]): the request takes a stream wherever
    /// there is room, this connection included.
    ///
    /// An HTTP/1.1 replacement takes this connection's place under
    /// `max_connections_per_endpoint`: it does not queue behind others for a place while it
    /// holds one.
    pub async fn replacement(&mut self, keep_h2: bool) -> Result<Conn, ProxyError> {
        match (&self._slot, &mut self.sender) {
            (Some(slot), _) => {
                if keep_h2 {
                    // The failed stream's place is free: a connection at the server's
                    // stream limit can take the request again.
                    self._slot = None;
                } else {
                    self.pool.forget_h2(slot);
                }
                self.pool.checkout().await
            }
            (None, Sender::H1(c)) => {
                let permit = c.take_permit();
                self.pool.connect_on_request(permit).await
            }
            (None, Sender::H2(_)) => self.pool.connect_on_request(None).await,
        }
    }

    /// Sends the request `parts` with `body` and waits for the response head. The head is
    /// borrowed, so a resend needs no copy of it kept aside; an HTTP/2 request is built
    /// from a copy fitted to that protocol (absolute-form, `:authority`).
    ///
    /// With a `deadline`, the response head must come before it ([`SendError::TimedOut`]).
    ///
    /// (An `async move` block, not an `async fn`, so `body` is not copied once more on the
    /// first poll: see [`crate::pipeline::handle`].)
    #[allow(
        clippy::manual_async_fn,
        reason = "an `async fn` copies its arguments once more"
    )]
    pub fn send(
        &mut self,
        parts: &Parts,
        added: &Added<'_>,
        body: ReqBody,
        deadline: Option<Instant>,
    ) -> impl Future<Output = Result<Response<UpBody>, SendError>> {
        async move {
            let addr = self.pool.addr;
            match &mut self.sender {
                Sender::H1(c) => c.send(parts, added, body, addr, deadline).await,
                Sender::H2(s) => {
                    let progress = body.progress();
                    self.h2_progress.clone_from(&progress);
                    let mut req = Request::new(body);
                    *req.method_mut() = parts.method.clone();
                    *req.uri_mut() = parts.uri.clone();
                    *req.headers_mut() = parts.headers.clone();
                    added.apply(req.headers_mut());
                    let req = adapt_h2(req, self.pool.tls_enabled(), addr);
                    // On the heap: inline, hyper's future and the request would make every
                    // request's future (HTTP/1.1 ones too) larger, and each move of it dearer.
                    let mut sending = Box::pin(s.try_send_request(req));
                    let sent = match deadline {
                        Some(mut d) => loop {
                            match tokio::time::timeout_at(d.into(), &mut sending).await {
                                Ok(sent) => break sent,
                                // While the body is being sent the deadline moves on with
                                // it (`BodyProgress`).
                                Err(_) => match progress.as_ref().and_then(|p| p.later()) {
                                    Some(due) => d = due,
                                    None if progress
                                        .as_ref()
                                        .is_some_and(|p| p.client_stalled()) =>
                                    {
                                        return Err(SendError::ClientBody(ReqBodyError::TimedOut));
                                    }
                                    None => return Err(SendError::TimedOut),
                                },
                            }
                        },
                        None => sending.await,
                    };
                    match sent {
                        Ok(resp) => Ok(resp.map(UpBody::Hyper)),
                        Err(mut e) => match e.take_message() {
                            Some(req) => Err(SendError::NotSent(NotSentBody(req.into_body()))),
                            // hyper resets the stream when the client's body fails, and the
                            // send fails with that reset: the body's own error says whose
                            // doing it was.
                            None => match progress.as_ref().and_then(|p| p.failure()) {
                                Some(b) => Err(SendError::ClientBody(b.clone())),
                                None => Err(SendError::Hyper(e.into_error())),
                            },
                        },
                    }
                }
            }
        }
    }

    /// The next piece of an HTTP/1.1 response body (see [`UpBody::H1`]).
    pub fn poll_body(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, H1Error>>> {
        match &mut self.sender {
            Sender::H1(c) => c.poll_body(cx),
            Sender::H2(_) => Poll::Ready(None),
        }
    }

    /// An HTTP/1.1 response body that is already read whole (its `Content-Length` worth
    /// of bytes came with the head), taken out at once; `None` otherwise.
    pub fn take_whole_body(&mut self) -> Option<Bytes> {
        match &mut self.sender {
            Sender::H1(c) => c.take_whole_body(),
            Sender::H2(_) => None,
        }
    }

    /// Is the request body still being sent, waiting on the client for its next piece,
    /// and has it not moved since `at`? (HTTP/1.1: the request's task sends it while it
    /// reads the response. Over HTTP/2 hyper's connection task sends it, and the body's
    /// progress, kept from the send, says: without it, an upload that stalled after the
    /// upstream's head was recorded as the upstream's timeout.)
    pub fn client_stalled_since(&self, at: std::time::Instant) -> bool {
        match &self.sender {
            Sender::H1(c) => c.client_stalled_since(at),
            Sender::H2(_) => self
                .h2_progress
                .as_ref()
                .is_some_and(|p| p.client_stalled() && p.last_progress() <= at),
        }
    }

    /// The response to this exchange did not come in time. Over HTTP/2, if nothing at all
    /// came on the connection since the exchange's stream started (no frame of any stream,
    /// no PING), the connection itself has gone silent (its server's host gone without a
    /// FIN, a NAT or load balancer that dropped it while idle): it takes no new streams,
    /// which would time out in turn until the kernel gave up on it (a quarter of an hour),
    /// and the next request opens a fresh one. (HTTP/1.1: a connection that timed out is
    /// never reused.)
    pub fn timed_out(&self) {
        if let Some(slot) = &self._slot
            && slot.silent_since_start()
        {
            tracing::debug!(upstream.addr = %self.pool.addr, "HTTP/2 connection silent for a whole response timeout; no new streams on it");
            self.pool.forget_h2(slot);
        }
    }

    /// Has an HTTP/1.1 response body ended?
    pub fn body_done(&self) -> bool {
        match &self.sender {
            Sender::H1(c) => c.body_done(),
            Sender::H2(_) => true,
        }
    }

    /// What is known of an HTTP/1.1 response body's length.
    pub fn body_size_hint(&self) -> http_body::SizeHint {
        match &self.sender {
            Sender::H1(c) => c.body_size_hint(),
            Sender::H2(_) => http_body::SizeHint::with_exact(0),
        }
    }

    /// The upstream socket after `101 Switching Protocols` (HTTP/1.1 only).
    pub fn into_upgraded(self) -> Option<Upgraded> {
        match self.sender {
            Sender::H1(c) => Some(c.into_upgraded()),
            Sender::H2(_) => None,
        }
    }

    /// Ends the exchange after its response was read to the end: an HTTP/1.1 connection
    /// goes back to the idle list (or is retired); an HTTP/2 stream slot is freed.
    pub fn release(self, admitted: Option<super::Admitted>) {
        self.release_at(Instant::now(), admitted);
    }

    /// [`release`](Self::release) at a time the caller already read.
    ///
    /// An HTTP/1.1 server that answered before the request body ended, and keeps the
    /// connection, still gets the rest of the body (it may be reading it): a task of its
    /// own writes it while it moves (cut after the pool's idle timeout without progress:
    /// a limit on the whole rest cut a large upload to a server that answered `202` at
    /// once and read on, after the client was told it succeeded), then gives the
    /// connection back. The
    /// pool keeps it only when the server had the whole body as framed before it answered
    /// (a client's end of stream may come later than its last byte); one answered early is
    /// closed. The request's place under the cluster's `max_requests` (`admitted`) is held
    /// until then too: the client is still sending its body.
    pub fn release_at(mut self, now: Instant, admitted: Option<super::Admitted>) {
        // HTTP/2, answered before the whole upload: hyper's connection task sends the rest
        // on the stream, which stays open on the server's count of concurrent streams.
        // Its slot and the request's place under `max_requests` stay taken until hyper
        // lets the body go (freed, they let a request onto a connection with no room, to
        // wait there behind the uploads).
        if let Some(progress) = self.h2_progress.take()
            && progress.sending()
        {
            progress.hold_until_sent(Box::new((self, admitted)));
            return;
        }
        let pool = self.pool.clone();
        if let Sender::H1(c) = &mut self.sender
            && c.upload_pending()
        {
            let limit = pool.idle_timeout();
            tokio::spawn(async move {
                let _admitted = admitted;
                // Whether the upload ends, fails or stops moving, the connection goes back
                // through the pool, which closes it (unless the body went out whole) and
                // owes the warm keeper a new one.
                let mut quiet = std::pin::pin!(tokio::time::sleep(limit));
                std::future::poll_fn(|cx| {
                    let Sender::H1(c) = &mut self.sender else {
                        return Poll::Ready(());
                    };
                    if c.poll_upload(cx).is_ready() {
                        return Poll::Ready(());
                    }
                    while quiet.as_mut().poll(cx).is_ready() {
                        // Moved since the timer was set: a timer from that move on.
                        match c.upload_moved_at().map(|at| at + limit) {
                            Some(due) if due > Instant::now() => {
                                quiet.as_mut().reset(due.into());
                            }
                            _ => return Poll::Ready(()),
                        }
                    }
                    Poll::Pending
                })
                .await;
                let pool = self.pool.clone();
                pool.give_back(self, Instant::now());
            });
            return;
        }
        pool.give_back(self, now);
    }
}

/// Fits a request to HTTP/2: absolute-form, the client's Host as `:authority`.
fn adapt_h2(mut req: Request<ReqBody>, https: bool, addr: SocketAddr) -> Request<ReqBody> {
    *req.version_mut() = Version::HTTP_2;
    if req.uri().authority().is_none() {
        // The client's Host becomes `:authority` (RFC 9113 §8.3.1); without one (or an
        // unusable one), the endpoint's address.
        let host = req
            .headers_mut()
            .remove(header::HOST)
            .and_then(|h| http::uri::Authority::try_from(h.as_bytes()).ok());
        let authority = host.or_else(|| addr.to_string().parse().ok());
        let pq = req
            .uri()
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        let mut b = Uri::builder().scheme(if https { Scheme::HTTPS } else { Scheme::HTTP });
        if let Some(a) = authority {
            b = b.authority(a);
        }
        if let Ok(uri) = b.path_and_query(pq).build() {
            *req.uri_mut() = uri;
        }
    }
    req
}

/// Did the upstream refuse this request before processing any of it? HTTP/2 says so with
/// `REFUSED_STREAM`, or with a GOAWAY whose last stream id is below the request's stream
/// (h2 fails exactly those streams with the peer's GOAWAY) — RFC 9113 §8.7. Such a request
/// may be sent again whatever its method.
fn refused_before_processing(e: &hyper::Error) -> bool {
    h2_error(e).is_some_and(|h2| {
        h2.reason() == Some(h2::Reason::REFUSED_STREAM) && h2.is_remote()
            || h2.is_go_away() && h2.is_remote()
    })
}

/// The HTTP/2 error behind a hyper error, if any.
fn h2_error(e: &hyper::Error) -> Option<&h2::Error> {
    let mut source = e.source();
    while let Some(s) = source {
        if let Some(h2) = s.downcast_ref::<h2::Error>() {
            return Some(h2);
        }
        source = s.source();
    }
    None
}

/// The flow-control window of each stream on an HTTP/2 connection to an upstream: what a
/// client that stops reading holds back of its answer, in the gateway's memory. (hyper's
/// default is 2 MiB; 1 MiB still passes a gigabyte a second at a millisecond's round trip.)
const H2_STREAM_WINDOW: u32 = 1 << 20;

/// The most streams put on one HTTP/2 connection to an upstream, whatever its server
/// allows: the connection's window holds every one's whole window, so clients that stop
/// reading hold back their own streams only, never the others' on the connection.
const H2_MAX_STREAMS: usize = 256;

/// The flow-control window of an HTTP/2 connection to an upstream: [`H2_MAX_STREAMS`]
/// streams' whole windows. What it holds is only what slow clients have not taken yet
/// (each stream at most its own window), so it costs nothing while clients read. With
/// 32 streams' worth (64 MiB) and no cap on the streams, clients that stopped reading
/// large answers (33 holding their whole windows) stopped every other stream on the
/// connection, other tenants' too.
const H2_CONNECTION_WINDOW: u32 = H2_STREAM_WINDOW * H2_MAX_STREAMS as u32;
// A window is below 2^31 (RFC 9113 §6.9.1).
const _: () = assert!(H2_CONNECTION_WINDOW < (1 << 31));

/// The HTTP/2 handshake (client preface and SETTINGS) over any transport; the connection
/// runs on its own task, and keeps running for the streams in flight after the last sender
/// is dropped. Also returns the server's `SETTINGS_MAX_CONCURRENT_STREAMS` as last seen by
/// that task (it is known only to the connection, so the task publishes it on every poll;
/// the first reads from the server wake it, so the limit in the server's first SETTINGS is
/// published when it arrives rather than at the next request).
///
/// `endpoint_limit` is the limit the endpoint's other connections last saw (`usize::MAX`:
/// none yet): a new connection assumes it until the server's SETTINGS arrive, rather than
/// hyper's default of 100 — and the task keeps it up to date.
///
/// `keepalive`: (interval, timeout) of PINGs, sent also while no stream is open, so a dead
/// peer or path is found before a request is put on it.
///
/// `ended` is woken when the connection ends (the pool's warm keeper: a warm connection
/// the server closed is replaced at once, not at the keeper's next tick).
pub(super) async fn handshake_h2<I>(
    io: I,
    addr: SocketAddr,
    endpoint_limit: Arc<AtomicUsize>,
    keepalive: Option<(Duration, Duration)>,
    ended: Arc<tokio::sync::Notify>,
) -> Result<(http2::SendRequest<ReqBody>, Arc<super::multiplex::H2Live>), ProxyError>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut builder = http2::Builder::new(TokioExecutor::new());
    // (Not a server's 0: a request taken on the new connection before its SETTINGS would
    // find no room, and open another.)
    let assumed = match endpoint_limit.load(Ordering::Relaxed) {
        0 | usize::MAX => 100,
        n => n.min(H2_MAX_STREAMS),
    };
    builder.initial_max_send_streams(assumed);
    // Response heads as large as an HTTP/1.1 upstream may send (hyper's default is 16 KiB:
    // a larger head was a reset stream, retried, then a 502, where HTTP/1.1 served it).
    builder.max_header_list_size(super::h1::MAX_HEAD as u32);
    // Room on the connection for every stream's whole window: a stream's window is given
    // back only as its client takes the data, so with hyper's 5 MiB for the whole
    // connection three slow readers stopped every other stream on it.
    builder.initial_stream_window_size(H2_STREAM_WINDOW);
    builder.initial_connection_window_size(H2_CONNECTION_WINDOW);
    if let Some((interval, timeout)) = keepalive {
        builder
            .timer(TokioTimer::new())
            .keep_alive_interval(interval)
            .keep_alive_timeout(timeout)
            .keep_alive_while_idle(true);
    }
    let kick = Arc::new(AtomicWaker::new());
    let live = Arc::new(super::multiplex::H2Live::new(assumed));
    let io = KickOnRead {
        io,
        kick: kick.clone(),
        left: KICKED_READS,
        live: live.clone(),
    };
    let (sender, conn) = builder
        .handshake(TokioIo::new(io))
        .await
        .map_err(|e| ProxyError::UpstreamReset(e.into()))?;
    let published = live.clone();
    let mut conn = Box::pin(conn);
    tokio::spawn(async move {
        let result = std::future::poll_fn(|cx| {
            kick.register(cx.waker());
            let r = conn.as_mut().poll(cx);
            let limit = conn.current_max_send_streams().min(H2_MAX_STREAMS);
            // The endpoint remembers its server's word only, not a limit assumed before it.
            if published.publish(limit) {
                endpoint_limit.store(limit, Ordering::Relaxed);
            }
            r
        })
        .await;
        if let Err(e) = result {
            tracing::debug!(upstream.addr = %addr, error = %e, "upstream HTTP/2 connection ended with an error");
        }
        // Gone before the keeper looks: its sender reads as closed then.
        drop(conn);
        ended.notify_one();
    });
    Ok((sender, live))
}

/// Reads from an HTTP/2 server that wake the connection's dispatch task: enough to cover the
/// server's first SETTINGS, few enough to cost nothing per request afterwards.
const KICKED_READS: u8 = 4;

/// A transport that wakes `kick` on its first `left` reads, and counts the reads that
/// bring bytes in `live`.
struct KickOnRead<I> {
    io: I,
    kick: Arc<AtomicWaker>,
    left: u8,
    live: Arc<super::multiplex::H2Live>,
}

impl<I: AsyncRead + Unpin> AsyncRead for KickOnRead<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        let r = Pin::new(&mut this.io).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) {
            if buf.filled().len() > before {
                this.live.reads.fetch_add(1, Ordering::Relaxed);
            }
            if this.left > 0 {
                this.left -= 1;
                this.kick.wake();
            }
        }
        r
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for KickOnRead<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(uri: &str, host: Option<&str>) -> Request<ReqBody> {
        let mut b = Request::get(uri);
        if let Some(h) = host {
            b = b.header(header::HOST, h);
        }
        b.body(ReqBody::empty()).expect("valid request")
    }

    fn addr() -> SocketAddr {
        SocketAddr::from(([10, 0, 0, 5], 8443))
    }

    #[test]
    fn h2_requests_carry_the_host_as_authority() {
        let r = adapt_h2(req("/a?b=1", Some("api.example")), true, addr());
        assert_eq!(r.version(), Version::HTTP_2);
        assert_eq!(r.uri(), "https://api.example/a?b=1");
        assert!(r.headers().get(header::HOST).is_none());

        let r = adapt_h2(req("/", None), false, addr());
        assert_eq!(r.uri(), "http://10.0.0.5:8443/");
    }
}
