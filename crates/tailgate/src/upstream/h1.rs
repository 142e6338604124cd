//! HTTP/1.1 to upstreams, driven inline by the task of the request that uses the connection.
//!
//! Why by hand rather than `hyper::client::conn::http1`: hyper runs each client connection
//! on a task of its own. A request is handed to that task over a channel, its response head
//! comes back over a oneshot and its body over another channel, so every exchange wakes two
//! tasks and crosses three queues. Measured with callgrind on the hot path (`tailgate bench
//! run --closed`, one worker), that hand-off was about 11,000 instructions per request: a
//! third of the gateway's user-space CPU, and the reason its throughput trailed nginx's
//! (system time per request was the same; user time was twice nginx's). Here the task that
//! serves the client writes the request and reads the response on the upstream socket
//! itself: one task, no channel, no extra wake-up.
//!
//! What is hand-written is the framing only; httparse (as in hyper) parses the response
//! head. Request bodies go out with `Content-Length` when their length is known, chunked
//! otherwise; they stream while the response is read (an upstream may answer before the
//! body ends, or echo it as it arrives). Response bodies follow RFC 9112 §6.3: none (HEAD,
//! 1xx, 204, 304), `Transfer-Encoding: chunked` (decoded strictly; trailers are dropped;
//! any other coding, or Transfer-Encoding in HTTP/1.0, is refused as faulty framing, like
//! nginx), `Content-Length` (conflicting values are refused), or until the server closes.
//! Interim 1xx responses are skipped; after `101 Switching Protocols` the socket, with any
//! bytes already read, is handed to the tunnel ([`Upgraded`]). A connection goes back to
//! the pool only when both bodies ended cleanly and neither side asked to close; a server
//! that answered before the request body ended, and keeps the connection, still gets the
//! rest of the body first (see `Conn::release_at`).
//!
//! A response deadline is kept per connection as one `Sleep` (a timer per request cost a
//! registration in the runtime's timer wheel and a removal). It is moved only for an
//! earlier deadline than it has; for a later one it fires first and is moved on then.
//!
//! HTTP/2 upstreams stay on hyper (`conn.rs`): multiplexing needs a task per connection.

use super::limit::ConnPermit;
use std::collections::VecDeque;
use std::future::Future;
use std::io::{self, Write as _};
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker, ready};
use std::time::Instant;

use bytes::{Buf, Bytes, BytesMut};
use http::request::Parts;
use http::{HeaderValue, Method, Response, StatusCode, Version, header};
use http_body::{Body, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Sleep;

use super::conn::{NotSentBody, SendError, UpBody};
use crate::pipeline::body::{BodyProgress, ReqBody, ReqBodyError};
use crate::pipeline::headers::{Added, put_header, token_in};

/// The largest response head accepted (status line and headers).
pub(super) const MAX_HEAD: usize = 64 * 1024;
/// The most response headers accepted.
const MAX_HEADERS: usize = 100;
/// The largest request body written with its head (see [`H1Conn::send`]).
const JOIN_BODY_MAX: u64 = 16 * 1024;
/// Room made in the read buffer when it runs low.
const READ_RESERVE: usize = 8 * 1024;
/// The longest chunk-size line (size and extensions).
const MAX_CHUNK_LINE: usize = 4 * 1024;
/// Interim (1xx) responses skipped before one final response. A server sends one or two
/// (`100 Continue`, `103 Early Hints`); an endless stream of them is a broken server, which
/// would otherwise hold the request until its response timeout.
const MAX_INTERIM: u32 = 32;
/// Bytes of empty lines let before a status line (RFC 9112 §2.2 asks a client to ignore
/// at least one): an endless stream of them is a broken server too, which would hold the
/// request, and the worker's reading, until its response timeout.
const MAX_BLANK: usize = 1024;

/// An upstream connection's socket, plain or TLS: what a connect returns, under either
/// protocol's connection.
pub enum Transport {
    Tcp(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

/// Why an exchange on an HTTP/1.1 upstream connection failed.
#[derive(Debug, thiserror::Error)]
pub enum H1Error {
    #[error("the upstream closed the connection before responding")]
    ClosedBeforeResponse,
    #[error("the upstream closed the connection in the middle of the response body")]
    ClosedMidBody,
    #[error("upstream connection error: {0}")]
    Io(#[from] io::Error),
    #[error("malformed upstream response: {0}")]
    BadResponse(&'static str),
    /// Reading the client's body failed (too large, or the client went away).
    #[error(transparent)]
    Body(ReqBodyError),
    #[error("the upstream did not answer in time")]
    TimedOut,
}

/// How the rest of the response body is delimited.
enum Framing {
    /// No more body.
    Done,
    /// This many bytes more.
    Length(u64),
    Chunked(Chunk),
    /// Until the server closes the connection.
    UntilClose,
}

/// Where a chunked body's decoder is.
#[derive(Clone, Copy)]
enum Chunk {
    /// At a chunk-size line.
    Size,
    /// Inside a chunk, this many bytes left.
    Data(u64),
    /// At the CRLF after a chunk's data.
    DataEnd,
    /// After the last chunk: trailer lines up to an empty one; this many bytes of them
    /// read so far.
    Trailers(usize),
}

/// A request body still being written, frame by frame.
struct Sending {
    body: ReqBody,
    chunked: bool,
    /// Sent with a `Content-Length`: the bytes of it not yet taken from the body.
    left: Option<u64>,
    /// Bytes taken from the body (with their chunk framing) not yet written.
    out: VecDeque<Bytes>,
    /// The body has ended; what is in `out` is the last of it.
    ended: bool,
}

impl Sending {
    /// Has the server had the whole body as the head framed it? Its `Content-Length` all
    /// written can come before the client's body says it has ended (an HTTP/2 client may
    /// send its end of stream in a frame of its own, after the server's answer).
    fn framed_whole(&self) -> bool {
        self.out.is_empty() && (self.ended || self.left == Some(0))
    }

    /// The body has ended: its last chunk (when chunked) goes after what is queued.
    fn end(&mut self) {
        if self.chunked {
            self.out.push_back(Bytes::from_static(b"0\r\n\r\n"));
        }
        self.ended = true;
    }
}

/// Why an idle connection can no longer be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdleGone {
    /// The server closed it (end of stream, a reset, an error).
    Closed,
    /// The server wrote to it while no request was out: a protocol violation (bytes past
    /// the last response, or an answer to nothing), which the gateway ends it for.
    Stray,
}

/// An HTTP/1.1 connection to an upstream, used by one exchange at a time.
pub struct H1Conn {
    io: Transport,
    /// Bytes read and not yet consumed.
    rbuf: BytesMut,
    /// The request head being written (kept to reuse its allocation).
    wbuf: Vec<u8>,
    /// Where each response header's name and value sit in the head being parsed (kept to
    /// reuse its allocation).
    header_at: Vec<(usize, usize, usize, usize)>,
    framing: Framing,
    sending: Option<Sending>,
    /// Neither side asked to close, and nothing went wrong.
    keep_alive: bool,
    /// The server closes the connection after this response (it said so, or it is an
    /// HTTP/1.0 server, or it ended the body by closing). Save the last, what teaches the
    /// pool the server's requests-per-connection limit. Closes the gateway decides on do
    /// not.
    peer_closed: bool,
    /// The last response's body had no length and ended with the connection: the close
    /// ended a body, and says nothing of how many requests the server takes on one.
    until_close: bool,
    /// Writing this exchange's request body failed part-way: whatever the response head
    /// says, the server may still be waiting for the rest, so the connection is not reused.
    body_write_failed: bool,
    /// The response ended before the request body was all written (as its head framed it):
    /// the rest still goes out, but the connection is not reused. A server that answered without reading the
    /// body may take what follows for its next request (a body holding a request of its
    /// own would then reach it past every route, and its answer would go to the next
    /// client on the connection), as nginx keeps no such connection either.
    answered_early: bool,
    /// Interim responses skipped in this exchange.
    interim: u32,
    /// Bytes of empty lines dropped before a status line in this exchange.
    blank: usize,
    /// Bytes of `rbuf` already looked at for the response head's end; at most 1: the next
    /// look parses whatever is there (none yet in this exchange, or only empty lines).
    head_scanned: usize,
    /// The response deadline's timer: one per connection, where a new timer per request
    /// costs a registration in the runtime's timer wheel and a removal (about 1,400
    /// instructions). A later deadline does not move it (most requests' is later than the
    /// last one's): it fires at the earlier one and is moved on to [`due`](Self::due) then.
    timer: Option<Pin<Box<Sleep>>>,
    /// This exchange's response deadline, which `timer` may be armed before.
    due: Option<tokio::time::Instant>,
    /// This exchange's request body's progress, which moves the response deadline on while
    /// the body is being sent (none for a request without a body).
    progress: Option<Arc<BodyProgress>>,
    /// Its place under the cluster's `max_connections_per_endpoint`, freed when it closes.
    permit: Option<ConnPermit>,
}

impl H1Conn {
    /// See [`Conn::client_stalled_since`](super::Conn::client_stalled_since).
    pub(super) fn client_stalled_since(&self, at: std::time::Instant) -> bool {
        self.sending.is_some()
            && self
                .progress
                .as_ref()
                .is_some_and(|p| p.client_stalled() && p.last_progress() <= at)
    }

    pub fn new(io: Transport) -> H1Conn {
        H1Conn {
            io,
            rbuf: BytesMut::new(),
            wbuf: Vec::new(),
            header_at: Vec::new(),
            framing: Framing::Done,
            sending: None,
            keep_alive: true,
            peer_closed: false,
            until_close: false,
            body_write_failed: false,
            answered_early: false,
            interim: 0,
            blank: 0,
            head_scanned: 0,
            timer: None,
            due: None,
            progress: None,
            permit: None,
        }
    }

    /// Holds `permit` (its place under `max_connections_per_endpoint`) while it is open.
    pub(super) fn hold(&mut self, permit: Option<ConnPermit>) {
        self.permit = permit;
    }

    /// Gives up its place, for the connection that replaces it.
    pub(super) fn take_permit(&mut self) -> Option<ConnPermit> {
        self.permit.take()
    }

    /// Can the connection carry another request: both bodies ended, nothing left over, and
    /// no side asked to close?
    pub fn reusable(&self) -> bool {
        self.keep_alive
            && !self.answered_early
            && matches!(self.framing, Framing::Done)
            && self.sending.is_none()
            && self.rbuf.is_empty()
    }

    /// Has the server closed (or written to) this idle connection? Costs no system call
    /// unless the socket was reported readable: the readiness the runtime already holds is
    /// checked first.
    pub fn idle_gone(&mut self) -> Option<IdleGone> {
        if !self.reusable() {
            return Some(IdleGone::Closed);
        }
        let read = match &self.io {
            // `try_read` looks at the readiness first and returns at once when there is
            // none (no system call, no waker stored); anything read means the connection
            // is not usable: end of stream, an error, or bytes nobody asked for.
            Transport::Tcp(s) => match s.try_read(&mut [0u8; 1]) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return None,
                r => r,
            },
            // Through TLS: records such as session tickets may be waiting, which the TLS
            // layer must read itself (and does not pass on as data).
            Transport::Tls(_) => {
                let mut cx = Context::from_waker(Waker::noop());
                match self.poll_fill(&mut cx) {
                    Poll::Pending => return None,
                    Poll::Ready(r) => r,
                }
            }
        };
        Some(match read {
            Ok(n) if n > 0 => IdleGone::Stray,
            _ => IdleGone::Closed,
        })
    }

    /// The response ended with bytes after it that no request asked for (a server that
    /// framed its body wrong, or wrote something more): the connection is not reused.
    pub fn stray_bytes(&self) -> bool {
        matches!(self.framing, Framing::Done) && self.sending.is_none() && !self.rbuf.is_empty()
    }

    /// Writes the request and reads the response head (skipping 1xx interim responses),
    /// writing the body meanwhile; the body keeps streaming while the response is read.
    /// (An `async move` block, not an `async fn`: see [`crate::pipeline::handle`].)
    #[allow(
        clippy::manual_async_fn,
        reason = "an `async fn` copies its arguments once more"
    )]
    pub fn send(
        &mut self,
        parts: &Parts,
        added: &Added<'_>,
        body: ReqBody,
        addr: SocketAddr,
        deadline: Option<Instant>,
    ) -> impl Future<Output = Result<Response<UpBody>, SendError>> {
        async move {
            self.framing = Framing::Done;
            self.sending = None;
            // Not reusable until a response head says so: a send dropped half-way (a hedge
            // lost, a timeout) leaves a connection nobody may pool.
            self.keep_alive = false;
            self.peer_closed = false;
            self.until_close = false;
            self.body_write_failed = false;
            self.interim = 0;
            self.blank = 0;
            self.head_scanned = 0;
            self.progress = body.progress();
            self.due = deadline.map(Into::into);
            let timed = match (self.due, self.timer.as_mut()) {
                // Armed before this deadline and not fired: it is moved on when it fires.
                (Some(d), Some(t)) if t.deadline() <= d && !t.is_elapsed() => true,
                (Some(d), Some(t)) => {
                    t.as_mut().reset(d);
                    true
                }
                (Some(d), None) => {
                    self.timer = Some(Box::pin(tokio::time::sleep_until(d)));
                    true
                }
                (None, _) => false,
            };
            let mut body = body;
            let bodiless = body.is_end_stream();
            let chunked = self.encode_head(parts, added, &body, bodiless, addr);
            // A small body read whole with its head (or a replay's copy) goes out in the
            // head's write, as one segment the server reads at once, not in a second write
            // after it. Taken from the body as any frame is (counted, copied, timed), and
            // put back if none of the request went out. (A larger one is written as the
            // response is read: a server may answer before it takes all of it.)
            let small = body.size_hint().exact().is_some_and(|n| n <= JOIN_BODY_MAX);
            let joined = if !bodiless && !chunked && !body.streams() && small {
                match Pin::new(&mut body).poll_frame(&mut Context::from_waker(Waker::noop())) {
                    Poll::Ready(Some(Ok(frame))) => frame.into_data().ok(),
                    Poll::Ready(Some(Err(e))) => return Err(SendError::H1(H1Error::Body(e))),
                    Poll::Ready(None) | Poll::Pending => None,
                }
            } else {
                None
            };
            let bodiless = body.is_end_stream();
            let head_len = self.wbuf.len();
            let whole = head_len + joined.as_ref().map_or(0, Bytes::len);
            let mut written = 0;
            let wrote = std::future::poll_fn(|cx| {
                while written < whole {
                    let polled = match &joined {
                        Some(data) if written < head_len => Pin::new(&mut self.io)
                            .poll_write_vectored(
                                cx,
                                &[
                                    io::IoSlice::new(&self.wbuf[written..]),
                                    io::IoSlice::new(data),
                                ],
                            ),
                        Some(data) => {
                            Pin::new(&mut self.io).poll_write(cx, &data[written - head_len..])
                        }
                        None => Pin::new(&mut self.io).poll_write(cx, &self.wbuf[written..]),
                    };
                    match polled {
                        Poll::Ready(Ok(0)) => {
                            return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                        }
                        Poll::Ready(Ok(n)) => written += n,
                        Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                        Poll::Pending if timed && self.timer_fired(cx) => {
                            return Poll::Ready(Err(io::ErrorKind::TimedOut.into()));
                        }
                        Poll::Pending => return Poll::Pending,
                    }
                }
                // Over TLS the bytes leave in the flush: it waits under the deadline too.
                match Pin::new(&mut self.io).poll_flush(cx) {
                    Poll::Pending if timed && self.timer_fired(cx) => {
                        Poll::Ready(Err(io::ErrorKind::TimedOut.into()))
                    }
                    r => r,
                }
            })
            .await;
            // The head went out and the body's write failed: the response, read next, says
            // why (a server that refused the body and closed), as when the body goes in
            // writes of its own (`drive_sending`).
            let body_failed = joined.is_some()
                && written >= head_len
                && wrote
                    .as_ref()
                    .is_err_and(|e| e.kind() != io::ErrorKind::TimedOut);
            if body_failed {
                self.keep_alive = false;
                self.body_write_failed = true;
            } else if let Err(e) = wrote {
                self.keep_alive = false;
                return Err(if e.kind() == io::ErrorKind::TimedOut {
                    SendError::TimedOut
                } else if written == 0 {
                    if let Some(data) = joined {
                        body.unread(data);
                    }
                    SendError::NotSent(NotSentBody(body))
                } else {
                    SendError::H1(e.into())
                });
            }
            if !bodiless && !body_failed {
                self.sending = Some(Sending {
                    left: (!chunked).then(|| body.size_hint().exact()).flatten(),
                    body,
                    chunked,
                    out: VecDeque::new(),
                    ended: false,
                });
            } else {
                // Dropped now, while its lines are warm, not when the response comes.
                drop(body);
            }
            let head_request = parts.method == Method::HEAD;
            std::future::poll_fn(|cx| match self.poll_head(cx, head_request) {
                Poll::Pending if timed && self.timer_fired(cx) => {
                    // The client, not the upstream, is the one waited on: its body stalled.
                    if self.progress.as_ref().is_some_and(|p| p.client_stalled()) {
                        self.sending = None;
                        return Poll::Ready(Err(H1Error::Body(ReqBodyError::TimedOut)));
                    }
                    Poll::Ready(Err(H1Error::TimedOut))
                }
                r => r,
            })
            .await
            .map_err(|e| {
                self.keep_alive = false;
                match e {
                    H1Error::TimedOut => SendError::TimedOut,
                    e => SendError::H1(e),
                }
            })
        }
    }

    /// Has the response deadline passed (registering the task to be woken when it does)?
    ///
    /// Polled outside the task's cooperative budget, as `tokio::time::timeout` polls its
    /// timer: this is asked when a read or write returned `Pending`, which it also does when
    /// the budget ran out under a steady stream of bytes (a fast upload, a server that never
    /// stops sending), and a timer polled then would never be seen to fire.
    ///
    /// While a request body is being sent, the deadline is its last progress plus the
    /// response timeout ([`BodyProgress`]): a timer that fires before that is moved to it
    /// (the deadline is checked when the timer fires, not moved at each frame).
    fn timer_fired(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(t) = self.timer.as_mut() else {
            return false;
        };
        loop {
            let mut polled = tokio::task::coop::unconstrained(t.as_mut());
            if Pin::new(&mut polled).poll(cx).is_pending() {
                return false;
            }
            // Fired at a deadline earlier than this exchange's (the last one's): moved on.
            let later = match self.due {
                Some(due) if due > t.deadline() => Some(due),
                _ => None,
            };
            match later.or_else(|| {
                self.progress
                    .as_ref()
                    .and_then(|p| p.later())
                    .map(Into::into)
            }) {
                Some(due) => t.as_mut().reset(due),
                None => return true,
            }
        }
    }

    /// The request head into `wbuf`: request line, headers (without the framing ones, which
    /// are set here from the body), blank line. Returns whether the body goes chunked.
    fn encode_head(
        &mut self,
        parts: &Parts,
        added: &Added<'_>,
        body: &ReqBody,
        bodiless: bool,
        addr: SocketAddr,
    ) -> bool {
        let w = &mut self.wbuf;
        w.clear();
        w.extend_from_slice(parts.method.as_str().as_bytes());
        w.push(b' ');
        let target = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
        w.extend_from_slice(if target.is_empty() { "/" } else { target }.as_bytes());
        w.extend_from_slice(b" HTTP/1.1\r\n");
        let mut had_length = false;
        let mut cookie_done = false;
        let mut had_host = false;
        for (name, value) in &parts.headers {
            had_host |= name == header::HOST;
            if name == header::CONTENT_LENGTH {
                had_length = true;
                continue;
            }
            // TE is kept for HTTP/2 upstreams only (hop-by-hop here).
            if name == header::TRANSFER_ENCODING || name == header::TE || added.replaces(name) {
                continue;
            }
            if name == header::COOKIE {
                // An HTTP/2 client may split Cookie into fields; HTTP/1.1 gets one line,
                // joined with "; " (RFC 9113 §8.2.3).
                if !cookie_done {
                    cookie_done = true;
                    w.extend_from_slice(b"cookie: ");
                    for (i, v) in parts.headers.get_all(header::COOKIE).iter().enumerate() {
                        if i > 0 {
                            w.extend_from_slice(b"; ");
                        }
                        w.extend_from_slice(v.as_bytes());
                    }
                    w.extend_from_slice(b"\r\n");
                }
                continue;
            }
            put_header(w, name, value);
        }
        for (name, value) in added.iter() {
            put_header(w, name, value);
        }
        if !had_host {
            // Written straight into the buffer (`io::Write` for `Vec` cannot fail).
            let _ = write!(w, "host: {addr}\r\n");
        }
        let chunked = if bodiless {
            if had_length || matches!(parts.method, Method::POST | Method::PUT | Method::PATCH) {
                w.extend_from_slice(b"content-length: 0\r\n");
            }
            false
        } else if let Some(n) = body.size_hint().exact() {
            let _ = write!(w, "content-length: {n}\r\n");
            false
        } else {
            w.extend_from_slice(b"transfer-encoding: chunked\r\n");
            true
        };
        w.extend_from_slice(b"\r\n");
        chunked
    }

    fn poll_head(
        &mut self,
        cx: &mut Context<'_>,
        head_request: bool,
    ) -> Poll<Result<Response<UpBody>, H1Error>> {
        loop {
            self.drive_sending(cx)?;
            // Empty lines before a status line (which the parser skips) are dropped as they
            // come once a look found no head, so that a run of them is not walked again by
            // each parse below. (Not before the first look: a head read whole pays nothing.)
            while self.head_scanned > 1 {
                let blank = if self.rbuf.starts_with(b"\r\n") {
                    2
                } else if self.rbuf.first() == Some(&b'\n') {
                    1
                } else {
                    break;
                };
                self.rbuf.advance(blank);
                self.head_scanned = self.head_scanned.saturating_sub(blank);
                self.blank += blank;
                if self.blank > MAX_BLANK {
                    return Poll::Ready(Err(H1Error::BadResponse(
                        "more than 1 KiB of empty lines before the status line",
                    )));
                }
            }
            // Parsed while nothing (or a byte) was looked at before (a head read whole, the
            // usual case, is not scanned first), then only once a line of it has ended
            // since the last look, as the server side's `HeadScan` does: a head an
            // upstream trickles in a byte at a time is not parsed from its start again for
            // each byte (64 KiB of them would scan about 2 GB).
            let fresh = &self.rbuf[self.head_scanned.min(self.rbuf.len())..];
            if (self.head_scanned <= 1 || fresh.contains(&b'\n'))
                && let Some(resp) = self.parse_head(head_request)?
            {
                return Poll::Ready(Ok(resp));
            }
            // (After the parse: skipping 1xx answers moves the head's start.)
            self.head_scanned = self.rbuf.len().max(1);
            if self.rbuf.len() >= MAX_HEAD {
                return Poll::Ready(Err(H1Error::BadResponse(
                    "response head larger than 64 KiB",
                )));
            }
            match ready!(self.poll_fill(cx)) {
                Ok(0) if self.rbuf.is_empty() => {
                    return Poll::Ready(Err(H1Error::ClosedBeforeResponse));
                }
                Ok(0) => {
                    return Poll::Ready(Err(H1Error::BadResponse(
                        "connection closed inside the response head",
                    )));
                }
                Ok(_) => {}
                Err(e) => return Poll::Ready(Err(e.into())),
            }
        }
    }

    /// Reads more into `rbuf`; `Ok(0)` at end of stream.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.rbuf.capacity() - self.rbuf.len() < 1024 {
            self.rbuf.reserve(READ_RESERVE);
        }
        tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.rbuf)
    }

    /// Writes as much of the request body as can go without waiting. A write the server
    /// refuses ends the sending (its response, read next, says why) and the connection's
    /// reuse; a failed client body is an error.
    fn drive_sending(&mut self, cx: &mut Context<'_>) -> Result<(), H1Error> {
        let Some(s) = self.sending.as_mut() else {
            return Ok(());
        };
        let io = &mut self.io;
        loop {
            while !s.out.is_empty() {
                // In one write: a chunk's size line, data and CRLF, and whatever else is
                // queued.
                let mut slices = [io::IoSlice::new(&[]); 8];
                let mut n = 0;
                for (slot, b) in slices.iter_mut().zip(&s.out) {
                    *slot = io::IoSlice::new(b);
                    n += 1;
                }
                match Pin::new(&mut *io).poll_write_vectored(cx, &slices[..n]) {
                    Poll::Ready(Ok(mut n)) if n > 0 => {
                        while let Some(front) = s.out.front_mut() {
                            if n < front.len() {
                                front.advance(n);
                                break;
                            }
                            n -= front.len();
                            s.out.pop_front();
                        }
                    }
                    Poll::Ready(_) => {
                        self.sending = None;
                        self.keep_alive = false;
                        self.body_write_failed = true;
                        return Ok(());
                    }
                    Poll::Pending => return Ok(()),
                }
            }
            if s.ended {
                match Pin::new(&mut *io).poll_flush(cx) {
                    Poll::Ready(Ok(())) => self.sending = None,
                    Poll::Ready(Err(_)) => {
                        self.sending = None;
                        self.keep_alive = false;
                        self.body_write_failed = true;
                    }
                    Poll::Pending => {}
                }
                return Ok(());
            }
            match Pin::new(&mut s.body).poll_frame(cx) {
                Poll::Pending => {
                    // Nothing more for now: push out what a TLS layer holds.
                    let _ = Pin::new(&mut *io).poll_flush(cx);
                    return Ok(());
                }
                // A body that ends short of its length, or runs past it, would leave the
                // server reading the next request as its rest (or this one's rest as the next
                // request): the connection is given up, and the exchange ends as with a
                // client body that failed (the server, short of bytes, would wait for them
                // until the response timeout, and the endpoint be blamed). (Every body
                // source checks its length already; this keeps the connection's framing
                // from depending on that.)
                Poll::Ready(None) if s.left.is_some_and(|l| l > 0) => {
                    self.sending = None;
                    self.keep_alive = false;
                    return Err(H1Error::Body(ReqBodyError::LengthMismatch));
                }
                Poll::Ready(None) => s.end(),
                Poll::Ready(Some(Ok(frame))) => {
                    match frame.into_data() {
                        Ok(data) if data.is_empty() => {}
                        Ok(data) => {
                            if s.chunked {
                                s.out
                                    .push_back(Bytes::from(format!("{:x}\r\n", data.len())));
                                s.out.push_back(data);
                                s.out.push_back(Bytes::from_static(b"\r\n"));
                            } else {
                                if let Some(left) = s.left.as_mut() {
                                    match left.checked_sub(data.len() as u64) {
                                        Some(l) => *left = l,
                                        None => {
                                            self.sending = None;
                                            self.keep_alive = false;
                                            return Err(H1Error::Body(
                                                ReqBodyError::LengthMismatch,
                                            ));
                                        }
                                    }
                                }
                                s.out.push_back(data);
                            }
                        }
                        // Trailers are not forwarded to HTTP/1.1 upstreams.
                        Err(_) => {}
                    }
                    // A body that says it has ended (its Content-Length is in) is not
                    // polled again, as hyper's own client does: hyper's server ends such a
                    // body only when it reads the connection's next head once the answer
                    // went out first (an early answer), so a poll for its end would wait
                    // for the client's next request.
                    if s.body.is_end_stream() {
                        s.end();
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    self.sending = None;
                    self.keep_alive = false;
                    return Err(H1Error::Body(e));
                }
            }
        }
    }

    /// A complete response head from `rbuf`, if there is one (1xx interim responses other
    /// than 101 are consumed and skipped).
    fn parse_head(&mut self, head_request: bool) -> Result<Option<Response<UpBody>>, H1Error> {
        loop {
            if self.rbuf.is_empty() {
                return Ok(None);
            }
            // Uninitialised: zeroing 100 headers would cost more than parsing a few.
            let mut headers =
                [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
            let mut parsed = httparse::Response::new(&mut []);
            let parsing = httparse::ParserConfig::default().parse_response_with_uninit_headers(
                &mut parsed,
                &self.rbuf,
                &mut headers,
            );
            let len = match parsing {
                Ok(httparse::Status::Complete(n)) => n,
                Ok(httparse::Status::Partial) => return Ok(None),
                Err(httparse::Error::TooManyHeaders) => {
                    return Err(H1Error::BadResponse("more than 100 response headers"));
                }
                Err(_) => return Err(H1Error::BadResponse("invalid response head")),
            };
            let code = parsed.code.unwrap_or(0);
            let status = StatusCode::from_u16(code)
                .map_err(|_| H1Error::BadResponse("invalid status code"))?;
            if status.is_informational() && status != StatusCode::SWITCHING_PROTOCOLS {
                self.interim += 1;
                if self.interim > MAX_INTERIM {
                    return Err(H1Error::BadResponse("more than 32 interim (1xx) responses"));
                }
                self.rbuf.advance(len);
                continue;
            }
            let version = if parsed.version == Some(0) {
                Version::HTTP_10
            } else {
                Version::HTTP_11
            };
            // Where each name and value sits in the head, to slice them out of it once it
            // is frozen (the values share its memory; nothing is copied).
            let base = self.rbuf.as_ptr() as usize;
            let at = &mut self.header_at;
            at.clear();
            for h in parsed.headers.iter() {
                let n = h.name.as_ptr() as usize - base;
                let v = h.value.as_ptr() as usize - base;
                at.push((n, n + h.name.len(), v, v + h.value.len()));
            }
            let head = self.rbuf.split_to(len).freeze();
            // Room for one more: the request id the gateway adds to every response.
            let mut map = crate::pipeline::spare::take_headers(at.len() + 1);
            let mut length: Option<u64> = None;
            // Content-Length fields, a list (`2, 2`) counting as two: more than one is
            // written again as one below.
            let mut length_fields = 0u8;
            // Transfer-Encoding: absent, exactly `chunked`, or something else.
            let mut coding: Option<bool> = None;
            let (mut close_token, mut keep_alive_token) = (false, false);
            for &(ns, ne, vs, ve) in &self.header_at {
                let name = crate::pipeline::headers::name_from_wire(&head[ns..ne])
                    .map_err(|_| H1Error::BadResponse("invalid header name"))?;
                let value = HeaderValue::from_maybe_shared(head.slice(vs..ve))
                    .map_err(|_| H1Error::BadResponse("invalid header value"))?;
                if name == header::CONTENT_LENGTH {
                    let (n, values) = parse_length(value.as_bytes())
                        .ok_or(H1Error::BadResponse("invalid Content-Length"))?;
                    if length.is_some_and(|l| l != n) {
                        return Err(H1Error::BadResponse("conflicting Content-Length values"));
                    }
                    length = Some(n);
                    length_fields = length_fields.saturating_add(values);
                } else if name == header::TRANSFER_ENCODING {
                    // Only `chunked`, once, is understood; a second field or another coding
                    // (gzip, …) would reach the client as if it were the body itself.
                    coding = Some(
                        coding.is_none()
                            && value
                                .as_bytes()
                                .trim_ascii()
                                .eq_ignore_ascii_case(b"chunked"),
                    );
                } else if name == header::CONNECTION {
                    close_token |= token_in(value.as_bytes(), b"close");
                    keep_alive_token |= token_in(value.as_bytes(), b"keep-alive");
                }
                map.append(name, value);
            }
            // What goes on to the client says one length, once (RFC 9112 §6.3: repeated equal
            // values are replaced by one before forwarding), and none on a 204 (RFC 9110
            // §8.6); an HTTP/2 client's stack refuses either (the inline server's writer
            // mends them for HTTP/1.1, hyper's server passes them on).
            if let Some(n) = length {
                if status == StatusCode::NO_CONTENT {
                    map.remove(header::CONTENT_LENGTH);
                } else if length_fields > 1 {
                    map.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
                }
            }
            // Any `close` wins; an HTTP/1.0 server keeps the connection only when it says so.
            self.peer_closed = close_token || (version == Version::HTTP_10 && !keep_alive_token);
            self.keep_alive = !self.peer_closed && !self.body_write_failed;
            let no_body = head_request
                || status == StatusCode::NO_CONTENT
                || status == StatusCode::NOT_MODIFIED;
            self.framing = if no_body {
                Framing::Done
            } else if status == StatusCode::SWITCHING_PROTOCOLS {
                // The connection becomes the tunnel; it never returns to the pool.
                self.keep_alive = false;
                Framing::Done
            } else if let Some(chunked) = coding {
                // RFC 9112 §6.1: Transfer-Encoding in HTTP/1.0 is faulty framing.
                if version == Version::HTTP_10 {
                    return Err(H1Error::BadResponse(
                        "Transfer-Encoding in an HTTP/1.0 response",
                    ));
                }
                if !chunked {
                    return Err(H1Error::BadResponse("unsupported Transfer-Encoding"));
                }
                // Transfer-Encoding overrides Content-Length (RFC 9112 §6.3), which must
                // not reach the client beside the new framing; such a response may be an
                // attempt at splitting, so its connection is not used again.
                if map.remove(header::CONTENT_LENGTH).is_some() {
                    self.keep_alive = false;
                }
                Framing::Chunked(Chunk::Size)
            } else {
                match length {
                    Some(0) => Framing::Done,
                    Some(n) => Framing::Length(n),
                    None => {
                        self.keep_alive = false;
                        self.peer_closed = true;
                        self.until_close = true;
                        Framing::UntilClose
                    }
                }
            };
            if matches!(self.framing, Framing::Done) {
                self.body_ended();
            }
            // The version stays the default (HTTP/1.1): the gateway frames the response to
            // its client itself, and an HTTP/1.0 upstream must not close the client's
            // connection.
            let mut resp = Response::new(UpBody::H1);
            *resp.status_mut() = status;
            *resp.headers_mut() = map;
            return Ok(Some(resp));
        }
    }

    /// The response body has ended. A request body still being written keeps going when
    /// the server did not ask to close (RFC 9110 §9.3.3's early answer: a server reading on,
    /// as hyper's client did; see [`Self::upload_pending`]), and the connection is closed
    /// after it; with a close, it is abandoned.
    fn body_ended(&mut self) {
        self.framing = Framing::Done;
        if self.sending.as_ref().is_some_and(|s| !s.framed_whole()) {
            self.answered_early = true;
        }
        if !self.keep_alive {
            self.sending = None;
        }
    }

    /// The response ended while the request body is still being written to a server that
    /// keeps the connection: [`Self::poll_upload`] finishes it.
    pub fn upload_pending(&self) -> bool {
        self.sending.is_some() && self.keep_alive && matches!(self.framing, Framing::Done)
    }

    /// When the request body last moved, if its progress is kept (a body streaming from
    /// the client).
    pub fn upload_moved_at(&self) -> Option<Instant> {
        self.progress.as_ref().map(|p| p.last_progress())
    }

    /// Writes the rest of the request body after the response ended.
    pub fn poll_upload(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), H1Error>> {
        self.drive_sending(cx)?;
        if self.sending.is_none() {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    }

    /// Did the server close (or say it closes) the connection after the last response?
    pub fn peer_closed(&self) -> bool {
        self.peer_closed
    }

    /// Did the server close only to end a body that had no length?
    pub fn closed_to_end_a_body(&self) -> bool {
        self.until_close
    }

    /// The next piece of the response body (`None` at its end), writing the rest of the
    /// request body meanwhile.
    pub fn poll_body(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, H1Error>>> {
        loop {
            match self.drive_sending(cx) {
                Ok(()) => {}
                // The server answered and said it closes (a whole answer of its own, such as
                // a refusal): the rest of the request body is no longer its business, and
                // that body's failure (past the size limit, stalled) does not cut the
                // answer. Its write side is shut, so a server still reading the body sees
                // its end at once rather than wait for it. (A client gone is no one to
                // answer: cut, as before.) The connection is not kept (`peer_closed`).
                Err(H1Error::Body(e))
                    if self.peer_closed && !matches!(e, ReqBodyError::Client(_)) =>
                {
                    tracing::debug!(error = %e, "the request body failed after an answer that closes; the answer goes on");
                    let _ = Pin::new(&mut self.io).poll_shutdown(cx);
                }
                Err(e) => {
                    self.keep_alive = false;
                    return Poll::Ready(Some(Err(e)));
                }
            }
            let step = match self.framing {
                Framing::Done => return Poll::Ready(None),
                Framing::Length(left) => {
                    if !self.rbuf.is_empty() {
                        let n = usize::try_from(left)
                            .unwrap_or(usize::MAX)
                            .min(self.rbuf.len());
                        let data = self.rbuf.split_to(n).freeze();
                        let left = left - n as u64;
                        if left == 0 {
                            self.body_ended();
                        } else {
                            self.framing = Framing::Length(left);
                        }
                        return Poll::Ready(Some(Ok(data)));
                    }
                    Step::Fill
                }
                Framing::UntilClose => {
                    if !self.rbuf.is_empty() {
                        let data = self.rbuf.split().freeze();
                        return Poll::Ready(Some(Ok(data)));
                    }
                    Step::FillOrEnd
                }
                Framing::Chunked(state) => match self.decode_chunk(state) {
                    Ok(Some(data)) => return Poll::Ready(Some(Ok(data))),
                    Ok(None) if matches!(self.framing, Framing::Done) => {
                        return Poll::Ready(None);
                    }
                    Ok(None) => Step::Fill,
                    Err(e) => {
                        self.keep_alive = false;
                        return Poll::Ready(Some(Err(e)));
                    }
                },
            };
            match ready!(self.poll_fill(cx)) {
                // A body with no length ends with the connection. Over TLS a server that
                // closes without `close_notify` (many do) shows as `UnexpectedEof`; such a
                // body could be cut short over plain TCP just as well, so, as nginx does,
                // it ends there too. Bodies with a length or chunks still fail on it.
                Ok(0) if matches!(step, Step::FillOrEnd) => {
                    self.keep_alive = false;
                    self.body_ended();
                    return Poll::Ready(None);
                }
                Err(e)
                    if matches!(step, Step::FillOrEnd)
                        && e.kind() == io::ErrorKind::UnexpectedEof =>
                {
                    self.keep_alive = false;
                    self.body_ended();
                    return Poll::Ready(None);
                }
                Ok(0) => {
                    self.keep_alive = false;
                    return Poll::Ready(Some(Err(H1Error::ClosedMidBody)));
                }
                Ok(_) => {}
                Err(e) => {
                    self.keep_alive = false;
                    return Poll::Ready(Some(Err(e.into())));
                }
            }
        }
    }

    /// Advances the chunked decoder over `rbuf`: a piece of data, or `None` when it needs
    /// more bytes (or the body ended: `framing` is then `Done`).
    fn decode_chunk(&mut self, mut state: Chunk) -> Result<Option<Bytes>, H1Error> {
        loop {
            match state {
                Chunk::Size => {
                    let Some(eol) = self.rbuf.iter().position(|&b| b == b'\n') else {
                        if self.rbuf.len() > MAX_CHUNK_LINE {
                            return Err(H1Error::BadResponse("chunk-size line too long"));
                        }
                        self.framing = Framing::Chunked(state);
                        return Ok(None);
                    };
                    if eol > MAX_CHUNK_LINE {
                        return Err(H1Error::BadResponse("chunk-size line too long"));
                    }
                    let size = parse_chunk_size(&self.rbuf[..=eol])
                        .ok_or(H1Error::BadResponse("invalid chunk size"))?;
                    self.rbuf.advance(eol + 1);
                    state = if size == 0 {
                        Chunk::Trailers(0)
                    } else {
                        Chunk::Data(size)
                    };
                }
                Chunk::Data(left) => {
                    if self.rbuf.is_empty() {
                        self.framing = Framing::Chunked(state);
                        return Ok(None);
                    }
                    let n = usize::try_from(left)
                        .unwrap_or(usize::MAX)
                        .min(self.rbuf.len());
                    let data = self.rbuf.split_to(n).freeze();
                    let left = left - n as u64;
                    self.framing = Framing::Chunked(if left == 0 {
                        Chunk::DataEnd
                    } else {
                        Chunk::Data(left)
                    });
                    return Ok(Some(data));
                }
                Chunk::DataEnd => {
                    if self.rbuf.len() < 2 {
                        self.framing = Framing::Chunked(state);
                        return Ok(None);
                    }
                    if &self.rbuf[..2] != b"\r\n" {
                        return Err(H1Error::BadResponse("chunk data not followed by CRLF"));
                    }
                    self.rbuf.advance(2);
                    state = Chunk::Size;
                }
                // Dropped line by line. A line is at most `MAX_CHUNK_LINE` (each read looks
                // through the line so far again: a longer one trickled in a byte at a time
                // would cost the worker its square), and all of them `MAX_HEAD`.
                Chunk::Trailers(seen) => {
                    let Some(eol) = self.rbuf.iter().position(|&b| b == b'\n') else {
                        if self.rbuf.len() > MAX_CHUNK_LINE || seen + self.rbuf.len() > MAX_HEAD {
                            return Err(H1Error::BadResponse("trailers too large"));
                        }
                        self.framing = Framing::Chunked(state);
                        return Ok(None);
                    };
                    if eol > MAX_CHUNK_LINE || seen + eol + 1 > MAX_HEAD {
                        return Err(H1Error::BadResponse("trailers too large"));
                    }
                    let blank = eol == 0 || (eol == 1 && self.rbuf[0] == b'\r');
                    self.rbuf.advance(eol + 1);
                    if blank {
                        self.body_ended();
                        return Ok(None);
                    }
                    state = Chunk::Trailers(seen + eol + 1);
                }
            }
        }
    }

    /// The whole response body, when its declared length is already in the read buffer.
    pub fn take_whole_body(&mut self) -> Option<Bytes> {
        match self.framing {
            Framing::Length(n) if self.rbuf.len() as u64 >= n => {
                let body = self.rbuf.split_to(usize::try_from(n).ok()?).freeze();
                self.body_ended();
                Some(body)
            }
            _ => None,
        }
    }

    /// Has the response body ended?
    pub fn body_done(&self) -> bool {
        matches!(self.framing, Framing::Done)
    }

    /// What is known of the response body's length.
    pub fn body_size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Done => SizeHint::with_exact(0),
            Framing::Length(n) => SizeHint::with_exact(n),
            _ => SizeHint::default(),
        }
    }

    /// The socket after `101 Switching Protocols`, with the bytes already read from it.
    pub fn into_upgraded(self) -> Upgraded {
        Upgraded {
            pre: self.rbuf.freeze(),
            io: self.io,
            _permit: self.permit,
        }
    }
}

enum Step {
    Fill,
    FillOrEnd,
}

/// An upgraded upstream connection (a WebSocket): the bytes read past the `101` head come
/// first, then the socket.
pub struct Upgraded {
    pre: Bytes,
    io: Transport,
    /// The connection's place under `max_connections_per_endpoint`: a tunnel keeps it.
    _permit: Option<ConnPermit>,
}

impl AsyncRead for Upgraded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.pre.is_empty() {
            let n = self.pre.len().min(buf.remaining());
            buf.put_slice(&self.pre[..n]);
            self.pre.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Upgraded {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl AsyncRead for Transport {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Transport::Tls(s) => Pin::new(&mut **s).poll_read(cx, buf),
        }
    }
}

#[cfg(test)]
thread_local! {
    /// Writes asked of a transport on this thread (a test's own runtime is on it).
    static WRITES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl AsyncWrite for Transport {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        #[cfg(test)]
        WRITES.with(|w| w.set(w.get() + 1));
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Transport::Tls(s) => Pin::new(&mut **s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        #[cfg(test)]
        WRITES.with(|w| w.set(w.get() + 1));
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Transport::Tls(s) => Pin::new(&mut **s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Transport::Tcp(s) => s.is_write_vectored(),
            Transport::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_flush(cx),
            Transport::Tls(s) => Pin::new(&mut **s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Transport::Tls(s) => Pin::new(&mut **s).poll_shutdown(cx),
        }
    }
}

/// A Content-Length value: digits only (a list of equal values, as some servers send, is
/// accepted; differing ones are not), and how many values it had (a list is written again
/// as one).
fn parse_length(v: &[u8]) -> Option<(u64, u8)> {
    let mut result = None;
    let mut values = 0u8;
    for part in v.split(|&b| b == b',') {
        let part = part.trim_ascii();
        if part.is_empty() || part.len() > 19 || !part.iter().all(u8::is_ascii_digit) {
            return None;
        }
        let n = part.iter().fold(0u64, |n, &d| n * 10 + u64::from(d - b'0'));
        if result.is_some_and(|r| r != n) {
            return None;
        }
        result = Some(n);
        values = values.saturating_add(1);
    }
    result.map(|n| (n, values))
}

/// A chunk-size line (`1a;ext=1\r\n`): hex digits, then optional extensions.
fn parse_chunk_size(line: &[u8]) -> Option<u64> {
    let line = line.strip_suffix(b"\n")?;
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let digits = line
        .iter()
        .position(|&b| !b.is_ascii_hexdigit())
        .unwrap_or(line.len());
    if digits == 0 || digits > 16 {
        return None;
    }
    let rest = &line[digits..];
    if !(rest.is_empty() || rest.trim_ascii_start().starts_with(b";")) {
        return None;
    }
    line[..digits].iter().try_fold(0u64, |n, &d| {
        let v = (d as char).to_digit(16)?;
        Some(n << 4 | u64::from(v))
    })
}

#[cfg(test)]
mod tests {

    /// A connection to a listener of the test's own, and the listener's end of it.
    async fn connected() -> (H1Conn, tokio::net::TcpStream) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        let (client, server) = tokio::join!(tokio::net::TcpStream::connect(addr), l.accept());
        let conn = H1Conn::new(Transport::Tcp(client.expect("connect")));
        (conn, server.expect("accept").0)
    }

    /// Sends a POST of `body` on `conn` with a response deadline of 5 s.
    async fn post(conn: &mut H1Conn, body: ReqBody) -> Result<Response<UpBody>, SendError> {
        let (parts, ()) = http::Request::post("/p")
            .header(header::HOST, "up")
            .body(())
            .expect("request")
            .into_parts();
        let client = HeaderValue::from_static("192.0.2.1");
        let id = HeaderValue::from_static("id-1");
        let name = header::HeaderName::from_static("x-request-id");
        let added = Added::new(
            &parts.headers,
            Version::HTTP_11,
            &client,
            false,
            None,
            (&name, &id),
        );
        let addr = SocketAddr::from(([127, 0, 0, 1], 1));
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        conn.send(&parts, &added, body, addr, Some(deadline)).await
    }

    /// A body read whole with its head goes out in the head's write: the server has both
    /// from one read, before the gateway writes anything else.
    #[tokio::test]
    async fn a_whole_body_goes_out_with_its_head() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let (mut conn, mut server) = connected().await;
        let serve = async {
            let mut buf = vec![0; 64 * 1024];
            let n = server.read(&mut buf).await.expect("read");
            let got = String::from_utf8_lossy(&buf[..n]).into_owned();
            server
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                .await
                .expect("write");
            got
        };
        let body = "x".repeat(3000);
        let writes = WRITES.with(std::cell::Cell::get);
        let (sent, got) = tokio::join!(
            post(&mut conn, ReqBody::whole(Bytes::from(body.clone()), 0)),
            serve
        );
        assert_eq!(sent.map(|r| r.status()).ok(), Some(StatusCode::OK));
        assert_eq!(
            WRITES.with(std::cell::Cell::get) - writes,
            1,
            "head and body in one write"
        );
        assert!(got.starts_with("POST /p HTTP/1.1\r\n"), "{got}");
        assert!(got.contains("content-length: 3000\r\n"), "{got}");
        assert!(
            got.ends_with(&format!("\r\n\r\n{body}")),
            "the body came apart from its head: {got}"
        );
        assert!(conn.sending.is_none(), "nothing is left to send");
    }

    /// A request none of which went out (the server had reset the connection) gives its
    /// body back whole, for a resend on a new connection.
    #[tokio::test]
    async fn a_request_not_sent_keeps_its_body() {
        let (mut conn, server) = connected().await;
        // A reset, not a close: the next write fails at once.
        socket2::SockRef::from(&server)
            .set_linger(Some(std::time::Duration::ZERO))
            .expect("linger");
        drop(server);
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let Err(SendError::NotSent(NotSentBody(mut body))) = post(
            &mut conn,
            ReqBody::whole(Bytes::from_static(b"the body"), 0),
        )
        .await
        else {
            panic!("the request counts as not sent");
        };
        assert_eq!(body.size_hint().exact(), Some(8));
        let frame = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await;
        let data = frame.and_then(|f| f.ok()).and_then(|f| f.into_data().ok());
        assert_eq!(data.as_deref(), Some(&b"the body"[..]));
        assert!(body.is_end_stream());
    }

    /// Trailers are dropped, within a line length and a total: a line longer than
    /// `MAX_CHUNK_LINE`, whole or not yet ended, and lines past `MAX_HEAD` in all are a bad
    /// response.
    #[tokio::test]
    async fn trailers_are_bounded_by_line_and_in_all() {
        let (mut conn, _server) = connected().await;
        let mut decode = |input: Vec<u8>| {
            conn.rbuf.clear();
            conn.rbuf.extend_from_slice(&input);
            conn.framing = Framing::Chunked(Chunk::Trailers(0));
            let r = conn.decode_chunk(Chunk::Trailers(0));
            (
                r.map_err(|e| e.to_string()),
                matches!(conn.framing, Framing::Done),
            )
        };
        let line = |n: usize| [b"x: ".to_vec(), vec![b'v'; n], b"\r\n".to_vec()].concat();
        // Fine: a few lines, then the end.
        let (r, done) = decode([line(100), line(3000), b"\r\n".to_vec()].concat());
        assert!(matches!(r, Ok(None)) && done, "{r:?}");
        // A whole line too long.
        let (r, _) = decode([line(MAX_CHUNK_LINE), b"\r\n".to_vec()].concat());
        assert!(r.is_err_and(|e| e.contains("trailers too large")));
        // One too long and not ended yet.
        let (r, _) = decode(vec![b'v'; MAX_CHUNK_LINE + 1]);
        assert!(r.is_err_and(|e| e.contains("trailers too large")));
        // Lines of a fair length, too many of them.
        let many = line(3000).repeat(MAX_HEAD / 3000 + 1);
        let (r, _) = decode(many);
        assert!(r.is_err_and(|e| e.contains("trailers too large")));
    }

    /// The response deadline is seen even when the task's cooperative budget ran out (a
    /// steady stream of bytes makes every read end that way): a timer polled inside the
    /// budget then answers `Pending` forever.
    #[tokio::test]
    async fn the_deadline_is_seen_with_the_budget_spent() {
        use std::time::Duration;
        let (mut conn, _server) = connected().await;
        conn.timer = Some(Box::pin(tokio::time::sleep(Duration::ZERO)));
        tokio::time::sleep(Duration::from_millis(2)).await;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for i in 0..1000 {
            tx.send(i).expect("send");
        }
        let fired = std::future::poll_fn(|cx| {
            let mut spent = 0;
            while let Poll::Ready(Some(_)) = rx.poll_recv(cx) {
                spent += 1;
            }
            assert!(spent < 1000, "the budget ran out");
            Poll::Ready(conn.timer_fired(cx))
        })
        .await;
        assert!(fired);
    }
    use super::*;

    #[test]
    fn content_length_values() {
        assert_eq!(parse_length(b"110"), Some((110, 1)));
        assert_eq!(parse_length(b" 7 "), Some((7, 1)));
        assert_eq!(parse_length(b"5, 5"), Some((5, 2)));
        assert_eq!(parse_length(b"5, 6"), None);
        assert_eq!(parse_length(b"-1"), None);
        assert_eq!(parse_length(b"+5"), None);
        assert_eq!(parse_length(b""), None);
        assert_eq!(parse_length(b"99999999999999999999"), None);
    }

    #[test]
    fn chunk_size_lines() {
        assert_eq!(parse_chunk_size(b"1a\r\n"), Some(26));
        assert_eq!(parse_chunk_size(b"0\r\n"), Some(0));
        assert_eq!(parse_chunk_size(b"FF;name=v\r\n"), Some(255));
        assert_eq!(parse_chunk_size(b"10 ;x\r\n"), Some(16));
        assert_eq!(parse_chunk_size(b"\r\n"), None);
        assert_eq!(parse_chunk_size(b"1g\r\n"), None);
        assert_eq!(parse_chunk_size(b"-1\r\n"), None);
        assert_eq!(parse_chunk_size(b"11111111111111111\r\n"), None);
    }
}
