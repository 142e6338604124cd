//! The two body types of a proxied exchange, both streamed frame by frame (never buffered):
//! [`ReqBody`] carries the client's body upstream under the size limit (keeping a bounded
//! [`ReplayCopy`] on routes whose requests may be replayed); [`RespBody`] carries
//! the upstream's body back, enforces the route's total deadline, returns the upstream
//! connection to its pool at end of stream, and finishes the [`Exchange`](crate::observe::Exchange) record.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::time::Sleep;

use crate::observe::ExchangeRecorder;
use crate::observe::metrics::WorkerMetrics;
use crate::upstream::{Conn, UpBody};

/// Why a request body could not be read to the end.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ReqBodyError {
    #[error("request body exceeds the limit of {0} bytes")]
    TooLarge(u64),
    /// (Shared: the error is kept for the answer as well as given to the connection that
    /// polled the body, [`BodyProgress::failure`].)
    #[error("reading the client's body failed: {0}")]
    Client(#[source] Arc<hyper::Error>),
    /// The client sent no more of its body for the response timeout, while the upstream
    /// waited for it.
    #[error("the client's body stalled")]
    TimedOut,
    /// The body ended short of the length its head declared, or ran past it.
    #[error("the request body's length differs from its Content-Length")]
    LengthMismatch,
}

/// How far a request body has got on its way upstream, for the response timeout: that runs
/// from the request's send, or from the body's last progress while it is still being sent
/// (a frame read from the client and taken by the upstream connection, or its end). A slow
/// upload that keeps moving is not cut off, and the upstream has the whole timeout for its
/// answer once the body is in, as nginx's `proxy_read_timeout` and Envoy's route timeout
/// count. Shared with HTTP/2's connection task, which polls the body.
#[derive(Debug)]
pub struct BodyProgress {
    since: Instant,
    timeout: Duration,
    /// The route's total deadline, which the response deadline never passes.
    cap: Option<Instant>,
    /// Nanoseconds from `since` to the last progress.
    last: AtomicU64,
    /// The last poll of the client's body found nothing (the client is the one waited on).
    on_client: AtomicBool,
    ended: AtomicBool,
    /// The error reading the client's body failed with, kept for [`failure`](Self::failure).
    failed: OnceLock<ReqBodyError>,
    /// What stays taken until the body is let go ([`hold_until_sent`](Self::hold_until_sent)).
    held: Held,
}

/// What a [`BodyProgress`] holds for its exchange, dropped with it.
#[derive(Default)]
struct Held(std::sync::Mutex<Option<Box<dyn Send>>>);

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Held")
    }
}

impl From<hyper::Error> for ReqBodyError {
    fn from(e: hyper::Error) -> ReqBodyError {
        ReqBodyError::Client(Arc::new(e))
    }
}

impl BodyProgress {
    /// Why reading the client's body failed, if it did. Over HTTP/2, hyper's connection
    /// task polls the body and, when it fails, only resets the stream: the send then fails
    /// with the reset, which would read as the upstream's fault (a `502`, counted against
    /// the endpoint) where the client's body was the cause (`413`, `400`).
    pub fn failure(&self) -> Option<&ReqBodyError> {
        self.failed.get()
    }

    /// The response deadline as the body's progress has moved it, if that is still ahead
    /// (checked when the timer set for an earlier one fires).
    pub fn later(&self) -> Option<Instant> {
        let due =
            self.since + Duration::from_nanos(self.last.load(Ordering::Relaxed)) + self.timeout;
        let due = self.cap.map_or(due, |cap| due.min(cap));
        (due > Instant::now()).then_some(due)
    }

    /// The deadline passed with the body still waited for from the client (a 408, not the
    /// upstream's fault).
    pub fn client_stalled(&self) -> bool {
        !self.ended.load(Ordering::Relaxed) && self.on_client.load(Ordering::Relaxed)
    }

    /// When the body last moved (or the exchange started).
    pub fn last_progress(&self) -> Instant {
        self.since + Duration::from_nanos(self.last.load(Ordering::Relaxed))
    }

    /// Is the body still on its way (neither ended nor failed)?
    pub fn sending(&self) -> bool {
        !self.ended.load(Ordering::Relaxed) && self.failed.get().is_none()
    }

    /// Keeps `what` until the body is let go: HTTP/2's connection task sends a body after
    /// its response has ended (an upstream that answered early), and drops it once it is
    /// sent or its stream reset. What was taken for the exchange (its stream's place
    /// under the server's concurrent-stream limit, its place under `max_requests`) stays
    /// taken until then: the stream is still open on the server's count.
    pub fn hold_until_sent(&self, what: Box<dyn Send>) {
        *self
            .held
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(what);
    }

    fn moved(&self) {
        let at = self.since.elapsed().as_nanos();
        self.last
            .store(u64::try_from(at).unwrap_or(u64::MAX), Ordering::Relaxed);
        self.on_client.store(false, Ordering::Relaxed);
    }
}

/// The client's request body on its way upstream, cut off with [`ReqBodyError::TooLarge`]
/// once it passes the configured limit.
#[derive(Debug)]
pub struct ReqBody {
    inner: Option<ClientBody>,
    limit: u64,
    seen: u64,
    /// Where the bytes read are counted (the route's `received bytes` series).
    counter: Option<BytesIn>,
    /// A whole body to send (a replay), before `inner`.
    buffered: Option<Bytes>,
    /// Where a copy of the bytes sent is kept, for a replay.
    copy: Option<ReplayCopy>,
    /// Its progress, when the response timeout counts from it ([`ReqBody::timed`]).
    progress: Option<Arc<BodyProgress>>,
}

/// Where a request body comes from.
#[derive(Debug)]
enum ClientBody {
    /// Read by hyper's server as it streams.
    Hyper(Incoming),
    /// Read whole with its head by the inline HTTP/1.1 server (`server::h1_inline`); taken
    /// by the first poll.
    Whole(Option<Bytes>),
}

impl Body for ClientBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            ClientBody::Hyper(b) => Pin::new(b).poll_frame(cx),
            ClientBody::Whole(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ClientBody::Hyper(b) => b.is_end_stream(),
            ClientBody::Whole(b) => b.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ClientBody::Hyper(b) => b.size_hint(),
            ClientBody::Whole(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
        }
    }
}

/// A bounded copy of a request body as it streams upstream, so that a request on a route
/// marked `idempotent` can be replayed after a stale pooled connection failed under it.
/// Only a body that was read to its end within the limit can be replayed; the copy holds
/// refcounted slices of the frames already read (no extra copy of the bytes).
#[derive(Debug, Clone)]
pub struct ReplayCopy(Arc<Mutex<CopyState>>);

#[derive(Debug, Default)]
struct CopyState {
    chunks: Vec<Bytes>,
    len: usize,
    limit: usize,
    complete: bool,
    /// Past the limit, or trailers: not replayable.
    given_up: bool,
}

impl ReplayCopy {
    fn with<R>(&self, f: impl FnOnce(&mut CopyState) -> R) -> R {
        // One request's body: only this exchange's tasks touch it, never another request.
        f(&mut self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }

    fn push(&self, data: &Bytes) {
        self.with(|s| {
            if s.given_up {
                return;
            }
            if s.len + data.len() > s.limit {
                s.given_up = true;
                s.chunks = Vec::new();
            } else {
                s.len += data.len();
                s.chunks.push(data.clone());
            }
        });
    }

    /// The whole body, if it was read to its end within the limit.
    pub fn body(&self) -> Option<ReqBody> {
        self.with(|s| {
            if !s.complete || s.given_up {
                return None;
            }
            let mut all = bytes::BytesMut::with_capacity(s.len);
            for c in &s.chunks {
                all.extend_from_slice(c);
            }
            let mut body = ReqBody::empty();
            body.buffered = Some(all.freeze());
            Some(body)
        })
    }
}

/// A route's received-bytes counter on one worker, counted as the body streams.
#[derive(Debug)]
pub struct BytesIn {
    pub metrics: Arc<WorkerMetrics>,
    pub route: Option<usize>,
    pub tenant: Option<usize>,
}

impl ReqBody {
    /// `limit` 0 means no limit.
    pub fn new(inner: Incoming, limit: u64) -> ReqBody {
        ReqBody::from_client(ClientBody::Hyper(inner), limit)
    }

    /// A body that arrived whole with its head; `limit` 0 means no limit.
    pub fn whole(body: Bytes, limit: u64) -> ReqBody {
        let body = (!body.is_empty()).then_some(body);
        ReqBody::from_client(ClientBody::Whole(body), limit)
    }

    fn from_client(inner: ClientBody, limit: u64) -> ReqBody {
        ReqBody {
            inner: Some(inner),
            limit: if limit == 0 { u64::MAX } else { limit },
            seen: 0,
            counter: None,
            buffered: None,
            copy: None,
            progress: None,
        }
    }

    /// Has the response timeout of a request sent at `sent` count from this body's last
    /// progress while it is being sent ([`BodyProgress`]), up to the total deadline `cap`.
    pub fn timed(mut self, sent: Instant, timeout: Duration, cap: Option<Instant>) -> ReqBody {
        self.progress = Some(Arc::new(BodyProgress {
            since: sent,
            timeout,
            cap,
            last: AtomicU64::new(0),
            on_client: AtomicBool::new(false),
            ended: AtomicBool::new(false),
            failed: OnceLock::new(),
            held: Held::default(),
        }));
        self
    }

    /// Does the body still stream from the client (not read whole with its head)?
    pub fn streams(&self) -> bool {
        matches!(self.inner, Some(ClientBody::Hyper(_)))
    }

    /// The body's progress, if its response timeout counts from it.
    pub fn progress(&self) -> Option<Arc<BodyProgress>> {
        self.progress.clone()
    }

    /// Keeps a copy of up to `limit` bytes of the body as it streams, for a replay.
    pub fn keep_copy(mut self, limit: usize) -> (ReqBody, ReplayCopy) {
        let copy = ReplayCopy(Arc::new(Mutex::new(CopyState {
            limit,
            ..CopyState::default()
        })));
        self.copy = Some(copy.clone());
        (self, copy)
    }

    /// Puts back `data`, the frame last taken (which no byte of was sent): the next poll
    /// returns it again, not counted, copied or checked against the limit a second time.
    pub fn unread(&mut self, data: Bytes) {
        debug_assert!(
            self.buffered.is_none(),
            "only the frame last taken is put back"
        );
        self.buffered = Some(data);
    }

    /// Counts the body's bytes into `counter` as they pass.
    pub fn counting(mut self, counter: BytesIn) -> ReqBody {
        self.counter = Some(counter);
        self
    }

    pub fn empty() -> ReqBody {
        ReqBody {
            inner: None,
            limit: u64::MAX,
            seen: 0,
            counter: None,
            buffered: None,
            copy: None,
            progress: None,
        }
    }
}

impl Body for ReqBody {
    type Data = Bytes;
    type Error = ReqBodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ReqBodyError>>> {
        let this = &mut *self;
        let polled = this.poll_client(cx);
        if let Some(p) = &this.progress {
            match &polled {
                Poll::Pending => p.on_client.store(true, Ordering::Relaxed),
                Poll::Ready(Some(Ok(_))) => p.moved(),
                Poll::Ready(None) => {
                    p.moved();
                    p.ended.store(true, Ordering::Relaxed);
                }
                Poll::Ready(Some(Err(e))) => {
                    let _ = p.failed.set(e.clone());
                }
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.buffered.is_none() && self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        if let Some(b) = &self.buffered {
            return SizeHint::with_exact(b.len() as u64);
        }
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}

impl ReqBody {
    /// The next frame, under the size limit, counted and copied as asked.
    fn poll_client(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ReqBodyError>>> {
        let this = self;
        if let Some(b) = this.buffered.take() {
            return Poll::Ready(Some(Ok(Frame::data(b))));
        }
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        match ready!(Pin::new(inner).poll_frame(cx)) {
            Some(Ok(frame)) => {
                if let Some(copy) = &this.copy {
                    match frame.data_ref() {
                        Some(data) => copy.push(data),
                        None => copy.with(|s| s.given_up = true),
                    }
                    // hyper stops polling once the body says it has ended (Content-Length).
                    if this.inner.as_ref().is_some_and(Body::is_end_stream) {
                        copy.with(|s| s.complete = true);
                    }
                }
                if let Some(data) = frame.data_ref() {
                    this.seen += data.len() as u64;
                    if this.seen > this.limit {
                        this.inner = None;
                        return Poll::Ready(Some(Err(ReqBodyError::TooLarge(this.limit))));
                    }
                    // Counted once it is passed on (an over-limit frame never is).
                    if let Some(c) = &this.counter {
                        c.metrics
                            .slot(c.route, c.tenant)
                            .add_bytes_in(data.len() as u64);
                    }
                }
                let frame = match frame.into_trailers() {
                    Ok(mut trailers) => {
                        super::headers::strip_trailers(&mut trailers);
                        Frame::trailers(trailers)
                    }
                    Err(frame) => frame,
                };
                Poll::Ready(Some(Ok(frame)))
            }
            Some(Err(e)) => Poll::Ready(Some(Err(e.into()))),
            None => {
                if let Some(copy) = &this.copy {
                    copy.with(|s| s.complete = true);
                }
                Poll::Ready(None)
            }
        }
    }
}

/// The response body sent to the client.
pub enum RespBody {
    /// A response made here (errors, the demo upstream).
    Full(Option<Bytes>),
    Upstream(Box<UpstreamBody>),
}

/// An upstream's response body in flight, with what must happen when it ends.
pub struct UpstreamBody {
    /// Read by hyper (HTTP/2), or straight off `conn` (HTTP/1.1).
    pub inner: UpBody,
    /// Returned to the pool at end of stream; dropped (and so closed) if the body is not
    /// read to the end.
    pub conn: Option<Conn>,
    pub deadline: Option<Pin<Box<Sleep>>>,
    /// The wait for each next piece of the body, bounded by the response timeout.
    pub read_wait: ReadWait,
    pub recorder: ExchangeRecorder,
    /// A piece was handed to the client and the next not asked for since (counted in the
    /// connection's [`ConnActivity`](crate::observe::ConnActivity), which the connection's
    /// idle check reads).
    pub handed: bool,
    /// The request's place under its cluster's `max_requests`, held while the body streams.
    pub admitted: Option<crate::upstream::Admitted>,
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        if self.handed
            && let Some(a) = self.recorder.activity()
        {
            a.piece_dropped();
        }
    }
}

/// How long the upstream may leave the client waiting for the next piece of a response
/// body: the route's response timeout, counted from when a read first found nothing (as
/// nginx's `proxy_read_timeout` counts between two reads). A body that keeps coming, however
/// slowly, or a client slow to take it, is not cut off; an upstream that sent part of a
/// body and went silent is, where nothing else would end the exchange without a
/// `total_timeout`. The timer is made the first time a read waits: a body read straight
/// through has none.
pub struct ReadWait {
    timeout: Duration,
    since: Option<Instant>,
    timer: Option<Pin<Box<Sleep>>>,
}

impl ReadWait {
    pub fn new(timeout: Duration) -> ReadWait {
        ReadWait {
            timeout,
            since: None,
            timer: None,
        }
    }

    /// When the wait under way began (`None` between waits).
    fn began(&self) -> Option<Instant> {
        self.since
    }

    /// A piece came: the next wait is counted afresh.
    fn got(&mut self) {
        self.since = None;
    }

    /// A read found nothing: has the wait lasted the timeout (registering the task to be
    /// woken when it will)?
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        let due = tokio::time::Instant::from_std(
            *self.since.get_or_insert_with(Instant::now) + self.timeout,
        );
        let timer = match &mut self.timer {
            Some(t) => {
                if t.deadline() != due {
                    t.as_mut().reset(due);
                }
                t
            }
            None => self.timer.insert(Box::pin(tokio::time::sleep_until(due))),
        };
        timer.as_mut().poll(cx).is_ready()
    }
}

impl RespBody {
    pub fn full(b: impl Into<Bytes>) -> RespBody {
        RespBody::Full(Some(b.into()))
    }

    pub fn empty() -> RespBody {
        RespBody::Full(None)
    }

    /// Has the route's total deadline passed while the body is still streaming? Then the
    /// body is cut as it is when the deadline passes between pieces (`total_timeout`), and
    /// every later poll of it for a frame gives [`TotalTimeout`]. For a server whose write
    /// of what came already is blocked by a slow client: the deadline bounds that too.
    /// (The same timer as the pieces' wait: no registration of its own.)
    pub fn poll_total_deadline(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        match self {
            RespBody::Upstream(up) => {
                if up.total_deadline_passed(cx) {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            }
            RespBody::Full(_) => Poll::Pending,
        }
    }
}

/// The upstream sent no more of the response body within the response timeout.
#[derive(Debug, thiserror::Error)]
#[error("the upstream sent no more of the response body within the response timeout")]
pub struct BodyReadTimeout;

/// The route's total deadline passed while the body was streaming.
#[derive(Debug, thiserror::Error)]
#[error("the route's total timeout passed while streaming the response")]
pub struct TotalTimeout;

impl Body for RespBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            RespBody::Full(b) => {
                let piece = b.take();
                // Its one piece may wait for an HTTP/2 client's window as any other:
                // watched, so that the stream is reset if the client never takes it.
                if piece.is_some() {
                    crate::server::stream_stall::handed(None);
                }
                Poll::Ready(piece.map(|b| Ok(Frame::data(b))))
            }
            RespBody::Upstream(up) => {
                let up = &mut **up;
                if std::mem::take(&mut up.handed)
                    && let Some(a) = up.recorder.activity()
                {
                    a.piece_taken();
                    crate::server::stream_stall::taken();
                }
                if up.total_deadline_passed(cx) {
                    return Poll::Ready(Some(Err(Box::new(TotalTimeout))));
                }
                let polled: Poll<Option<Result<Frame<Bytes>, Self::Error>>> = match &mut up.inner {
                    UpBody::Hyper(b) => Pin::new(b)
                        .poll_frame(cx)
                        .map(|f| f.map(|r| r.map_err(Into::into))),
                    UpBody::H1 => match up.conn.as_mut() {
                        Some(c) => c
                            .poll_body(cx)
                            .map(|f| f.map(|r| r.map(Frame::data).map_err(Into::into))),
                        None => Poll::Ready(None),
                    },
                };
                let Poll::Ready(polled) = polled else {
                    if up.read_wait.expired(cx) {
                        // An upstream that answered before the whole upload came may be
                        // waiting for the rest of it: then the client stalled (its upload
                        // stopped, and moved no more in all the wait), not the upstream.
                        // (One that went on sending while the upstream said nothing is
                        // waiting for the upstream, as a duplex stream's client does.)
                        let began = up.read_wait.began();
                        let client = up
                            .conn
                            .as_ref()
                            .zip(began)
                            .is_some_and(|(c, at)| c.client_stalled_since(at));
                        // (Each code written at its `cut`, where a test of the kinds
                        // finds it.)
                        if client {
                            up.cut("client_body_timeout");
                        } else {
                            up.cut("upstream_body_timeout");
                        }
                        return Poll::Ready(Some(Err(Box::new(BodyReadTimeout))));
                    }
                    return Poll::Pending;
                };
                up.read_wait.got();
                match polled {
                    Some(Ok(frame)) => {
                        if let Some(data) = frame.data_ref() {
                            up.recorder.add_bytes_out(data.len() as u64);
                        }
                        if up.ended() {
                            // The last piece may wait for an HTTP/2 client's window too
                            // (the exchange is over: not counted as the connection's);
                            // the deadline read before `finish` lets it go.
                            crate::server::stream_stall::handed(
                                up.deadline.as_ref().map(|d| d.deadline()),
                            );
                            up.finish();
                        } else if let Some(a) = up.recorder.activity() {
                            up.handed = true;
                            a.piece_handed();
                            crate::server::stream_stall::handed(
                                up.deadline.as_ref().map(|d| d.deadline()),
                            );
                        }
                        Poll::Ready(Some(Ok(frame)))
                    }
                    Some(Err(e)) => {
                        match client_body_fault(&*e) {
                            Some(code) => up.cut(code),
                            None => up.cut("upstream_body"),
                        }
                        Poll::Ready(Some(Err(e)))
                    }
                    None => {
                        up.finish();
                        Poll::Ready(None)
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RespBody::Full(b) => b.is_none(),
            RespBody::Upstream(up) => up.ended(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RespBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            RespBody::Full(None) => SizeHint::with_exact(0),
            RespBody::Upstream(up) => up.size_hint(),
        }
    }
}

impl UpstreamBody {
    pub fn size_hint(&self) -> SizeHint {
        match &self.inner {
            UpBody::Hyper(b) => b.size_hint(),
            UpBody::H1 => self
                .conn
                .as_ref()
                .map_or_else(SizeHint::default, Conn::body_size_hint),
        }
    }

    /// Has the route's total deadline passed? Then the exchange is cut (`total_timeout`;
    /// again at each later poll, which changes nothing once it is).
    fn total_deadline_passed(&mut self, cx: &mut Context<'_>) -> bool {
        let passed = self
            .deadline
            .as_mut()
            .is_some_and(|d| d.as_mut().poll(cx).is_ready());
        if passed {
            self.cut("total_timeout");
        }
        passed
    }

    /// The body is cut short (`code` says why): the upstream connection is closed, and
    /// the exchange recorded.
    #[cold]
    #[inline(never)]
    fn cut(&mut self, code: &'static str) {
        self.conn = None;
        self.recorder.fail(code);
    }

    /// Has the upstream's body ended?
    fn ended(&self) -> bool {
        match &self.inner {
            UpBody::Hyper(b) => b.is_end_stream(),
            UpBody::H1 => self.conn.as_ref().is_none_or(Conn::body_done),
        }
    }

    fn finish(&mut self) {
        // One clock read for both: when the connection went idle, and the exchange's end.
        let now = std::time::Instant::now();
        if let Some(conn) = self.conn.take() {
            conn.release_at(now, self.admitted.take());
        }
        self.deadline = None;
        self.recorder.finish_at(now);
    }
}

/// What to record when a response body was cut short by the client's own request body,
/// still being sent meanwhile (too large, stalled, or ended early: the code
/// [`client_body_error`](super::client_body_error) gives it before a response), rather
/// than by the upstream.
#[cold]
#[inline(never)]
fn client_body_fault(e: &(dyn std::error::Error + Send + Sync + 'static)) -> Option<&'static str> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        // (`H1Error::Body` is transparent: its source is the body error's source.)
        let body = match err.downcast_ref::<crate::upstream::H1Error>() {
            Some(crate::upstream::H1Error::Body(b)) => Some(b),
            _ => err.downcast_ref::<ReqBodyError>(),
        };
        if let Some(b) = body {
            return Some(super::client_body_error(b).code());
        }
        cur = err.source();
    }
    None
}
