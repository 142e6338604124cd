//! The HTTP/1.1 server for the usual request, run inline on the connection's task: a head
//! with no body or a small `Content-Length` body, and no `Transfer-Encoding`, `Expect`,
//! `Upgrade` or `CONNECT`. That is nearly every API request.
//!
//! Why not hyper's server for these too: it drove each request through its dispatcher, a
//! body channel and its own encoder, and the smuggling guard in front of it parsed every
//! head a second time; together about 8,000 instructions per request, 40 % of the
//! gateway's user-space CPU, and the reason its throughput trailed nginx's. Here the head is
//! parsed once with `httparse` (the parser hyper and the guard use), the request runs
//! through the pipeline on this task, and the response is written from one buffer, usually
//! in one write: 19.9k instructions per proxied request became 17.9k (callgrind, one
//! worker), and closed-loop throughput went from below nginx's to above it (CHANGELOG).
//!
//! A head hyper's server would refuse is refused here, with the gateway's JSON error
//! (`ProxyError`, where every error is made) and a close, by the rules in [`super::head`]
//! that the smuggling guard in front of hyper's server applies too: one `httparse` refused
//! (400; 431 for too many lines), one over the head limit (431), `Content-Length` with
//! `Transfer-Encoding`, an invalid or conflicting `Content-Length`, a `Transfer-Encoding`
//! that does not end in `chunked` or comes in HTTP/1.0, a target `Uri` refuses (400).
//! `tests/fuzz_h1.rs` holds the two servers to the same answers.
//!
//! Anything else is not served here: the connection, with every byte not yet served, is
//! handed to hyper's server behind the smuggling guard for the rest of its life. A head is
//! handed over only before any of it was acted on, so hyper sees the exact bytes the client
//! sent. A body of up to 8 KiB that comes after its head is waited for here, as the rest
//! of a head would be (under the header read timeout, counted again from each piece of the
//! body that comes, so a body that stops is cut off and one that keeps coming is not); a
//! larger one streams through hyper's server.
//!
//! The connection's read side is watched while a request is in flight, as hyper's server
//! watches it: the client's end of stream cancels the request, unless bytes of a pipelined
//! next request came first (they are kept, and the socket is not read again until they are
//! served).

use std::io::Write as _;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, Method, Response, Uri, Version, header};
use http_body::{Body, Frame};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::time::Sleep;

use super::head::{self, BodyHeaders, MAX_HEADERS, MAX_URI_LEN, content_length};
use crate::pipeline::body::{ReqBody, RespBody};
use crate::pipeline::error::ProxyError;
use crate::pipeline::headers::{name_from_wire, put_header, token_in};
use crate::pipeline::spare as spare_heads;
use crate::pipeline::{ConnInfo, Worker, handle};

/// How the inline server left the connection.
pub enum Ended {
    /// Closed, or to be closed: nothing more is served on it.
    Closed,
    /// The next request is not one served here; it starts at the first of these bytes, and
    /// hyper's server takes the connection from there.
    Handover(BytesMut),
}

/// The request-head limits, from the server settings.
pub struct Limits {
    pub max_head: usize,
    pub max_body: u64,
    pub header_timeout: Duration,
    /// `server.max_requests_per_connection` (0: no cap).
    pub max_requests: u64,
}

/// The largest request body waited for and read whole here when it comes after its head.
const INLINE_BODY_MAX: u64 = 8 * 1024;
/// Reads go into at least this much free buffer; a read that fills less than what was free
/// tells the runtime the socket is drained, which spares the next read's system call.
const READ_MIN: usize = 1024;
const READ_RESERVE: usize = 8 * 1024;
/// Response bytes gathered before they are written (a body frame larger than what is left
/// is written straight from its own buffer).
const WRITE_GATHER: usize = 64 * 1024;
/// The largest gather buffer kept for the next response (one a large response grew is let
/// go).
const OUT_KEEP: usize = 4 * 1024;

/// Serves requests on `io` until the connection ends, or a request comes that is not served
/// here. `buf` holds bytes already read, and `head_deadline` the header read timer started
/// at the first of them (while the connection was looked at for HTTP/2's preface), which
/// the head they begin keeps. `closing` is set to end the connection at the next point
/// where no request is in flight (shutdown, idle).
pub async fn serve<I>(
    io: &mut I,
    mut buf: BytesMut,
    mut head_deadline: Option<Pin<Box<Sleep>>>,
    worker: &Arc<Worker>,
    info: &Arc<ConnInfo>,
    limits: &Limits,
    closing: &AtomicBool,
) -> Ended
where
    I: AsyncRead + AsyncWrite + Unpin,
{
    // The gather buffer, like the read buffer once it is empty, is the worker's between
    // requests (`spare`).
    let mut out = Vec::new();
    let mut idx = Vec::with_capacity(16);
    let mut gate = ParseGate::default();
    loop {
        // 1. A whole head, or the reason there is none.
        let mut body_on_its_way = false;
        let Served {
            parts,
            body,
            mut meta,
        } = loop {
            if !buf.is_empty() && gate.worth_parsing(&buf, limits.max_head) {
                match parse::<false>(&mut buf, limits, &mut idx) {
                    Ok(served) => {
                        gate = ParseGate::default();
                        break served;
                    }
                    Err(Unserved::Other) => return Ended::Handover(buf),
                    Err(Unserved::Refused(e)) => {
                        refuse(io, &mut buf, &mut out, worker, info, e, closing).await;
                        return Ended::Closed;
                    }
                    Err(Unserved::Partial) => {}
                    // The head is whole: the wait for its body is timed on its own, from
                    // the next time the socket runs dry, not from the head's first pause.
                    Err(Unserved::Body(whole)) if !body_on_its_way => {
                        gate.whole = whole;
                        body_on_its_way = true;
                        head_deadline = None;
                    }
                    Err(Unserved::Body(_)) => {}
                }
            }
            let waited = std::future::poll_fn(|cx| {
                if buf.is_empty() && closing.load(Ordering::Relaxed) {
                    // A request already in the socket still gets its answer (a connection
                    // accepted at shutdown, from the listen queue); with none, it closes.
                    return Poll::Ready(match poll_fill(io, &mut buf, cx, true) {
                        Poll::Ready(Ok(n)) if n > 0 => Wait::More,
                        _ => Wait::Close,
                    });
                }
                match poll_fill(io, &mut buf, cx, true) {
                    Poll::Ready(Ok(0)) => Poll::Ready(Wait::End),
                    Poll::Ready(Ok(_)) => Poll::Ready(Wait::More),
                    Poll::Ready(Err(_)) => Poll::Ready(Wait::Close),
                    Poll::Pending => {
                        // A head in pieces: the header read timeout runs from when the
                        // socket first ran dry in the middle of it (as in the guard). Empty
                        // lines before a request line are ignored (RFC 9112 §2.2): a CRLF
                        // left after a body does not start it, and is let go, so that the
                        // connection is idle (the idle timeout, a shutdown close it; its
                        // read buffer goes back to the worker) and a client sending nothing
                        // but CRLFs never has them looked at twice. Every byte in `buf` was
                        // looked at by the gate before this read came back empty.
                        if !gate.head.started() {
                            if !buf.is_empty() {
                                buf.clear();
                                gate = ParseGate::default();
                                spare::give_read(&mut buf);
                            }
                            // No head has begun: nothing to time (the sniff's timer
                            // started at a CRLF).
                            head_deadline = None;
                        } else {
                            // A head's bytes are activity: the idle timeout counts from
                            // when it first ran dry (once per head, with its timer).
                            // While it comes, the connection is not idle, nor closed at
                            // a shutdown as one with no exchange under way is: its own
                            // timer bounds it. (Set here and not with the timer: a first
                            // head's timer is the one the sniff for HTTP/2 started.)
                            info.activity.set_reading_head(true);
                            let d = head_deadline.get_or_insert_with(|| {
                                info.activity.touch();
                                Box::pin(tokio::time::sleep(limits.header_timeout))
                            });
                            if d.as_mut().poll(cx).is_ready() {
                                return Poll::Ready(Wait::HeadTimeout);
                            }
                        }
                        Poll::Pending
                    }
                }
            })
            .await;
            match waited {
                // A body still coming is not cut off: the timeout starts again from the
                // next time the socket runs dry (hyper's server streamed such a body with
                // no time limit). Nor is the connection idle while a request's bytes come:
                // no exchange is in flight yet, so the idle timeout counts from each time
                // the socket runs dry part-way into it, when its timer starts again (a
                // body trickling in over longer than `idle_timeout` is served, as hyper's
                // server serves a larger one).
                Wait::More if body_on_its_way => head_deadline = None,
                Wait::More => {}
                Wait::Close => return Ended::Closed,
                Wait::End if buf.is_empty() => return Ended::Closed,
                // Given up on: the bytes since the head's last line were not parsed (see
                // `ParseGate`); one last look (at a copy: these bytes are not served), so a
                // head already wrong gets its refusal rather than a silent close or
                // hyper's plain answer.
                Wait::End | Wait::HeadTimeout => {
                    let last = parse::<false>(&mut buf.clone(), limits, &mut idx);
                    // A whole head ends with a line, and a line's end is always parsed.
                    debug_assert!(!matches!(last, Ok(_) | Err(Unserved::Other)));
                    if let Err(Unserved::Refused(e)) = last {
                        refuse(io, &mut buf, &mut out, worker, info, e, closing).await;
                        return Ended::Closed;
                    }
                    // A whole head whose small body stopped coming: `408`, as hyper's
                    // server answers a larger body that stops (never a silent close), and
                    // recorded with what its head says, as that one is. One the client's
                    // end of stream cut short: `400`, and the upstream never sees the
                    // request (handed to hyper's server, its head would have gone up with
                    // part of its body).
                    if matches!(last, Err(Unserved::Body(_))) {
                        let e = match waited {
                            Wait::HeadTimeout => ProxyError::ClientBodyTimeout,
                            _ => ProxyError::ClientBodyEnded,
                        };
                        let stalled = Stalled {
                            limits,
                            idx: &mut idx,
                            error: e,
                        };
                        stalled
                            .refuse(io, &mut buf, &mut out, worker, info, closing)
                            .await;
                        return Ended::Closed;
                    }
                    // A head cut off by the end of the stream: hyper's server says what
                    // it says to that. One not whole in time: closed, and counted.
                    return match waited {
                        Wait::End => Ended::Handover(buf),
                        _ => {
                            if let Some(slot) = &info.slot {
                                slot.count_header_timeout();
                            }
                            Ended::Closed
                        }
                    };
                }
            }
        };
        head_deadline = None;
        info.activity.set_reading_head(false);
        // The last request `server.max_requests_per_connection` allows, or one that came
        // during `server.shutdown_delay`: answered with `Connection: close`, and the
        // connection closed after it.
        if info.count_request(limits.max_requests) || worker.shared.leaving.load(Ordering::Relaxed)
        {
            meta.keep_alive = false;
            meta.capped = true;
        }

        // 2. The pipeline, while the client is watched for its end. Its state (about 3 KB)
        // is boxed per request rather than kept in the connection's future: a request that
        // comes alone (open loop, one per wake-up) then writes it into memory the allocator
        // just had back from the last request, warm, where the connection's own copy had
        // gone cold since its last request (`scripts/footprint.py --rate 200`: last-level
        // misses per request 65-71 -> 34, for 300-700 more instructions; closed loop, where
        // everything is cold in turn, +560 instructions; docs/tail-latency.md).
        //
        // The box is allocated first and the future written into it: `Box::pin(handle(..))`
        // built the future on the stack and copied all of its 3 KB into the box, though a
        // future not yet polled holds only its arguments (a few pointers and the body's
        // handle). Written in place, only those bytes are: 145-250 fewer instructions per
        // request (callgrind, both loops, plain and profile-guided builds), no 3 KB copy.
        let mut pending = Box::pin(None);
        pending
            .as_mut()
            .set(Some(handle(worker.clone(), info.clone(), parts, body)));
        let resp = std::future::poll_fn(|cx| {
            if let Some(fut) = pending.as_mut().as_pin_mut()
                && let Poll::Ready(Ok(resp)) = fut.poll(cx)
            {
                return Poll::Ready(Some(resp));
            }
            match poll_client_end(io, &mut buf, cx) {
                Poll::Ready(()) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            }
        })
        .await;
        // The client went away: dropping the request cancels it upstream.
        let Some(resp) = resp else {
            return Ended::Closed;
        };

        // 3. The response (its gather buffer lent by the worker, given back after it).
        let keep = match write_response(io, &mut buf, &mut out, resp, &meta, closing).await {
            Ok(keep) => keep,
            Err(_) => return Ended::Closed,
        };
        spare::give_out(&mut out);
        if !keep {
            let _ = io.shutdown().await;
            // Bytes of the client's still unread (pipelined behind a request that closes
            // the connection): read out, not reset over. Those already read are in `buf`.
            // A client that did not ask for the close (its last request under
            // `max_requests_per_connection`, a shutdown, an answer that cannot be framed
            // otherwise) may be sending more: a close with them unread in the socket, or
            // their coming to a closed socket, would be a reset, which throws away what of
            // the answer the client has not yet read. nginx lingers on a close past
            // `keepalive_requests` for the same reason.
            if !buf.is_empty() || meta.keep_alive || meta.capped {
                info.activity.set_lingering();
                Box::pin(super::linger::linger(io)).await;
            }
            return Ended::Closed;
        }
    }
}

/// Answers a refused head with the gateway's JSON error (a new request id) and closes. The
/// refusal is recorded like any request (metrics, access log) as method `-` and target `*`:
/// what the head said cannot be trusted, if it said anything.
async fn refuse<I>(
    io: &mut I,
    buf: &mut BytesMut,
    out: &mut Vec<u8>,
    worker: &Arc<Worker>,
    info: &ConnInfo,
    e: ProxyError,
    closing: &AtomicBool,
) where
    I: AsyncRead + AsyncWrite + Unpin,
{
    let resp = crate::pipeline::refusal_response(worker, info, &e);
    let meta = Meta {
        keep_alive: false,
        http10: false,
        head: head::asks_head(buf),
        capped: false,
    };
    answer_and_close(io, buf, out, resp, &meta, info, closing).await;
}

/// A whole head whose small body stopped coming, or was cut short, still in the read
/// buffer; and what to answer it.
struct Stalled<'a> {
    limits: &'a Limits,
    idx: &'a mut Vec<HeaderAt>,
    error: ProxyError,
}

impl Stalled<'_> {
    /// Answers its error (`408` for a body that stopped coming, `400` for one the client's
    /// end of stream cut short) and closes: recorded with what the head says
    /// ([`crate::pipeline::refuse_request`]), timed from when the body was last seen moving
    /// (the least the request took; when its head came is not kept). A head refused for
    /// more than its body's wait (a target `http` cannot read) gets that refusal, as with
    /// its body.
    async fn refuse<I>(
        self,
        io: &mut I,
        buf: &mut BytesMut,
        out: &mut Vec<u8>,
        worker: &Arc<Worker>,
        info: &ConnInfo,
        closing: &AtomicBool,
    ) where
        I: AsyncRead + AsyncWrite + Unpin,
    {
        let e = self.error;
        let stalled = match parse::<true>(buf, self.limits, self.idx) {
            Ok(stalled) => stalled,
            Err(unserved) => {
                let e = match unserved {
                    Unserved::Refused(refused) => refused,
                    _ => e,
                };
                return refuse(io, buf, out, worker, info, e, closing).await;
            }
        };
        // A body that stopped coming was last seen a header timeout ago; one cut short
        // ended now.
        let now = std::time::Instant::now();
        let started = match e {
            ProxyError::ClientBodyTimeout => now.checked_sub(self.limits.header_timeout),
            _ => None,
        }
        .unwrap_or(now);
        let resp = crate::pipeline::refuse_request(worker, info, stalled.parts, e, started);
        let meta = Meta {
            keep_alive: false,
            ..stalled.meta
        };
        answer_and_close(io, buf, out, resp, &meta, info, closing).await;
    }
}

/// Writes an answer that ends the connection, then closes it with a lingering close.
async fn answer_and_close<I>(
    io: &mut I,
    buf: &mut BytesMut,
    out: &mut Vec<u8>,
    resp: Response<RespBody>,
    meta: &Meta,
    info: &ConnInfo,
    closing: &AtomicBool,
) where
    I: AsyncRead + AsyncWrite + Unpin,
{
    if write_response(io, buf, out, resp, meta, closing)
        .await
        .is_ok()
    {
        let _ = io.shutdown().await;
        // On the heap, and only here: the connection's future does not grow by it.
        info.activity.set_lingering();
        Box::pin(super::linger::linger(io)).await;
    }
}

enum Wait {
    More,
    End,
    /// The header read timeout passed with a head (or its small body) incomplete.
    HeadTimeout,
    Close,
}

/// What the request asked of the connection.
struct Meta {
    keep_alive: bool,
    http10: bool,
    head: bool,
    /// The last request `max_requests_per_connection` allows (`keep_alive` was cleared
    /// for it, not by the client).
    capped: bool,
}

/// A request served here: its head, its body, and what it asks of the connection.
struct Served {
    parts: Box<http::request::Parts>,
    body: ReqBody,
    meta: Meta,
}

type Parsed = Result<Served, Unserved>;

/// When buffered bytes are worth parsing again: a head as [`head::HeadScan`] says; a whole
/// head whose small body is awaited, not until the body is all here.
#[derive(Default)]
struct ParseGate {
    head: head::HeadScan,
    /// A whole head was parsed and its body is awaited: the bytes the two need.
    whole: usize,
}

impl ParseGate {
    fn worth_parsing(&mut self, buf: &[u8], max_head: usize) -> bool {
        if self.whole > 0 {
            return buf.len() >= self.whole;
        }
        self.head.worth_parsing(buf, max_head)
    }
}

/// Why the buffered bytes are not (yet) a request served here.
#[derive(Debug)]
enum Unserved {
    /// A head not complete yet, within the limit.
    Partial,
    /// A whole head, its small body still on its way: the head and body are this many
    /// bytes.
    Body(usize),
    /// Not served here: hyper's server reads it from the start.
    Other,
    /// A head hyper's parser would refuse too (the same `httparse` call): answered here,
    /// with the gateway's JSON error, and the connection closed.
    Refused(ProxyError),
}

/// Where a header's name and value lie in the head.
struct HeaderAt {
    name: (usize, usize),
    value: (usize, usize),
}

/// Parses the head at the start of `buf`; with `STALLED`, a whole head whose small body
/// stopped coming is taken with no body, for its refusal to be recorded with what it says.
fn parse<const STALLED: bool>(
    buf: &mut BytesMut,
    limits: &Limits,
    idx: &mut Vec<HeaderAt>,
) -> Parsed {
    let mut headers = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut []);
    let head_len = match httparse::ParserConfig::default().parse_request_with_uninit_headers(
        &mut req,
        buf,
        &mut headers,
    ) {
        Ok(httparse::Status::Complete(n)) if n <= limits.max_head => n,
        Ok(httparse::Status::Partial) if buf.len() <= limits.max_head => {
            return Err(Unserved::Partial);
        }
        Err(e) => return Err(Unserved::Refused(head::parse_fault(e).into())),
        Ok(_) => {
            return Err(Unserved::Refused(
                head::over_limit(buf, limits.max_head).into(),
            ));
        }
    };
    let (Some(method), Some(path), Some(version)) = (req.method, req.path, req.version) else {
        return Err(Unserved::Other);
    };
    let Ok(method) = Method::from_bytes(method.as_bytes()) else {
        return Err(Unserved::Other);
    };
    if method == Method::CONNECT {
        return Err(Unserved::Other);
    }
    let http10 = version == 0;
    let base = buf.as_ptr() as usize;
    let at = |s: &[u8]| (s.as_ptr() as usize - base, s.len());
    let path_at = at(path.as_bytes());
    let mut body = BodyHeaders::default();
    // Expect or an upgrade: hyper's server serves it.
    let mut elsewhere = false;
    let (mut close, mut keep_alive) = (false, false);
    idx.clear();
    for h in req.headers.iter() {
        let name = h.name.as_bytes();
        match name.len() {
            14 if name.eq_ignore_ascii_case(b"content-length") => body.content_length(h.value),
            17 if name.eq_ignore_ascii_case(b"transfer-encoding") => {
                body.transfer_encoding(h.value);
            }
            6 if name.eq_ignore_ascii_case(b"expect") => elsewhere = true,
            7 if name.eq_ignore_ascii_case(b"upgrade") => elsewhere = true,
            10 if name.eq_ignore_ascii_case(b"connection") => {
                elsewhere |= token_in(h.value, b"upgrade");
                close |= token_in(h.value, b"close");
                keep_alive |= token_in(h.value, b"keep-alive");
            }
            _ => {}
        }
        idx.push(HeaderAt {
            name: at(name),
            value: at(h.value),
        });
    }
    // The target's length before the body headers, as hyper's server (and the guard) check
    // them; the rest of the target is parsed in `build`.
    if path.len() > MAX_URI_LEN {
        return Err(Unserved::Refused(head::TARGET_TOO_LONG.into()));
    }
    if let Err(f) = head::long_name(head_len, req.headers) {
        return Err(Unserved::Refused(f.into()));
    }
    if let Err(f) = body.check(http10) {
        // A target `http` refuses first, as hyper's server (and the guard) judge them: its
        // 400, not the body's 501.
        target_valid(path)?;
        return Err(Unserved::Refused(f.into()));
    }
    if body.te || elsewhere || !body.plain {
        return Err(Unserved::Other);
    }
    // A small body not all here yet (many clients write the head and the body apart) is
    // waited for like the rest of a head, under the header read timeout (counted again from
    // each piece of it that comes); a larger one is streamed by hyper's server.
    let body_len = if STALLED { 0 } else { body.length.unwrap_or(0) };
    if ((buf.len() - head_len) as u64) < body_len {
        // A target `http` refuses is answered now, as hyper's server answers it, not once
        // the body has come (or the header read timeout, when it never does).
        target_valid(path)?;
        // One over the limit is refused (413) without waiting for it, by hyper's server.
        let within = limits.max_body == 0 || body_len <= limits.max_body;
        return Err(if body_len <= INLINE_BODY_MAX && within {
            Unserved::Body(head_len + body_len as usize)
        } else {
            Unserved::Other
        });
    }
    // From here the bytes are taken from the buffer; a failure puts them back.
    let head = buf.split_to(head_len).freeze();
    // The head on the heap, one the worker kept from an earlier request (its memory warm,
    // `pipeline::spare`), passed on by pointer instead of copied into the connection's
    // future at each level.
    let mut parts = spare_heads::take_head(idx.len());
    let uri = match build(&head, path_at, idx, &mut parts.headers) {
        Ok(uri) => uri,
        Err(e) => {
            spare_heads::give_head(parts);
            let mut back = BytesMut::with_capacity(head.len() + buf.len());
            back.extend_from_slice(&head);
            back.extend_from_slice(buf);
            *buf = back;
            return Err(e);
        }
    };
    // `body_len` is at most what is buffered (checked above), so it fits a usize.
    let body = if body_len == 0 {
        // (A split of nothing would still take a reference to the buffer, and drop it.)
        Bytes::new()
    } else {
        buf.split_to(body_len as usize).freeze()
    };
    let head_request = method == Method::HEAD;
    parts.method = method;
    parts.uri = uri;
    parts.version = if http10 {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    let served = Served {
        parts,
        body: ReqBody::whole(body, limits.max_body),
        meta: Meta {
            keep_alive: !close && (!http10 || keep_alive),
            http10,
            head: head_request,
            capped: false,
        },
    };
    Ok(served)
}

/// Refuses a target `http` cannot take (see [`build`], where it is parsed for use): checked
/// ahead only where the answer would otherwise differ from hyper's or wait for a body.
fn target_valid(path: &str) -> Result<(), Unserved> {
    match path.parse::<Uri>() {
        Ok(_) => Ok(()),
        Err(_) => Err(Unserved::Refused(head::target_fault(path.len()).into())),
    }
}

/// The request's target, and its headers into `headers` (empty), their values sharing the
/// head's bytes.
fn build(
    head: &Bytes,
    path: (usize, usize),
    idx: &[HeaderAt],
    headers: &mut HeaderMap,
) -> Result<Uri, Unserved> {
    let Ok(uri) = Uri::from_maybe_shared(head.slice(path.0..path.0 + path.1)) else {
        return Err(Unserved::Refused(head::target_fault(path.1).into()));
    };
    for h in idx {
        // (httparse took only what a name and a value may hold, and `parse` refused a name
        // too long for `http`: never refused here.)
        let (Ok(name), Ok(value)) = (
            name_from_wire(&head[h.name.0..h.name.0 + h.name.1]),
            HeaderValue::from_maybe_shared(head.slice(h.value.0..h.value.0 + h.value.1)),
        ) else {
            return Err(Unserved::Refused(
                head::HeadFault::Bad("invalid header").into(),
            ));
        };
        headers.append(name, value);
    }
    Ok(uri)
}

/// Watches the client while its request is in flight, as hyper's server does: while no
/// byte of a next request is buffered, a read tells whether the client is gone (`Ready`: end
/// of stream or an error), which cancels the request. Once bytes of a next request are
/// kept, the socket is left alone: a client that sent pipelined requests and then closed
/// its sending side still has the one in flight answered. Empty lines are no next request
/// (RFC 9112 §2.2: a CRLF a client sent after a body): the socket is still read past a
/// few of them, so that the client is still watched. They are kept, for the next head's
/// parse to see as it would have (past `CRLF_AHEAD` of them the socket is left alone, and
/// a flood of them meets the head's limit there, as between requests).
fn poll_client_end<I: AsyncRead + Unpin>(
    io: &mut I,
    buf: &mut BytesMut,
    cx: &mut Context<'_>,
) -> Poll<()> {
    loop {
        if !buf.is_empty()
            && (buf.len() > CRLF_AHEAD || !buf.iter().all(|&b| b == b'\r' || b == b'\n'))
        {
            return Poll::Pending;
        }
        // Read until the socket is dry (its waker then registered), bytes of a request are
        // kept, or it ends.
        match poll_fill(io, buf, cx, false) {
            Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => return Poll::Ready(()),
            Poll::Ready(Ok(_)) => {}
            Poll::Pending => return Poll::Pending,
        }
    }
}

/// The empty lines after a request the client may be watched past (see
/// [`poll_client_end`]).
const CRLF_AHEAD: usize = 64;

/// Reads what the socket has into `buf`; `Ok(0)` at its end. `between` says no request is
/// in flight: then a buffer the socket left empty goes back to the worker (`spare`), and a
/// connection without one reads into one of the worker's.
fn poll_fill<I: AsyncRead + Unpin>(
    io: &mut I,
    buf: &mut BytesMut,
    cx: &mut Context<'_>,
    between: bool,
) -> Poll<std::io::Result<usize>> {
    if between && buf.capacity() == 0 {
        *buf = spare::take_read();
    } else if buf.capacity() - buf.len() < READ_MIN {
        buf.reserve(READ_RESERVE);
    }
    let read = tokio_util::io::poll_read_buf(Pin::new(io), cx, buf);
    if between && buf.is_empty() {
        spare::give_read(buf);
    }
    read
}

/// How the response body is delimited on the wire.
#[derive(PartialEq)]
enum Framing {
    /// HEAD, 1xx, 204, 304.
    NoBody,
    Length(u64),
    Chunked,
    /// An HTTP/1.0 client, length unknown: the body ends with the connection.
    UntilClose,
}

enum Step {
    Frame(Option<Result<Frame<Bytes>, Box<dyn std::error::Error + Send + Sync>>>),
    /// No frame ready now: what is gathered goes out.
    Write,
    /// The client went away while the body was awaited.
    ClientGone,
}

/// Runs `io` (a write, or a flush: over TLS the write only fills the TLS buffer, and the
/// wait is the flush's), unless the route's total deadline passes first while the body is
/// still streaming: then the body is cut (`total_timeout`) and the connection ends, so a
/// client that takes a response slowly does not hold it, and its upstream connection,
/// past the deadline (the send timeout alone restarts at each byte taken). The deadline's
/// timer is polled only while `io` waits for the client.
async fn by_deadline(
    io: impl Future<Output = std::io::Result<()>>,
    body: &mut RespBody,
) -> std::io::Result<()> {
    let mut io = std::pin::pin!(io);
    std::future::poll_fn(|cx| match io.as_mut().poll(cx) {
        Poll::Ready(r) => Poll::Ready(r),
        Poll::Pending => match body.poll_total_deadline(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the route's total timeout passed while the client took the response",
            ))),
            Poll::Pending => Poll::Pending,
        },
    })
    .await
}

/// Writes the response; returns whether the connection may serve another request. While
/// the body is awaited the client is watched as in [`poll_client_end`], with `buf`.
/// (An `async move` block, not an `async fn`, so the response is not copied once more on
/// the first poll: see [`crate::pipeline::handle`].)
#[allow(
    clippy::manual_async_fn,
    reason = "an `async fn` copies its arguments once more"
)]
fn write_response<I>(
    io: &mut I,
    buf: &mut BytesMut,
    out: &mut Vec<u8>,
    resp: Response<RespBody>,
    meta: &Meta,
    closing: &AtomicBool,
) -> impl Future<Output = std::io::Result<bool>>
where
    I: AsyncRead + AsyncWrite + Unpin,
{
    async move {
        let (parts, mut body) = resp.into_parts();
        let status = parts.status;
        let mut keep = meta.keep_alive && !closing.load(Ordering::Relaxed);
        spare::take_out(out);
        out.clear();
        if status == http::StatusCode::OK {
            // Most answers: one copy of a constant line.
            out.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
        } else {
            out.extend_from_slice(b"HTTP/1.1 ");
            out.extend_from_slice(status.as_str().as_bytes());
            out.push(b' ');
            out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        // RFC 9110 §8.6: no Content-Length in a 1xx or 204 answer (hyper's server and nginx
        // drop one an upstream sent).
        let length_allowed = !status.is_informational() && status != http::StatusCode::NO_CONTENT;
        let (mut declared, mut has_date, mut has_connection) = (None, false, false);
        for (name, value) in &parts.headers {
            if name == header::CONTENT_LENGTH {
                if !length_allowed {
                    continue;
                }
                // The first valid one frames the body; another is not sent.
                match (declared, content_length(value.as_bytes())) {
                    (None, Some(n)) => declared = Some(n),
                    _ => continue,
                }
            } else if name == header::TRANSFER_ENCODING {
                // Framing is this connection's to choose.
                continue;
            } else if name == header::DATE {
                has_date = true;
            } else if name == header::CONNECTION {
                has_connection = true;
                if token_in(value.as_bytes(), b"close") {
                    keep = false;
                }
            }
            put_header(out, name, value);
        }
        let no_body = meta.head
            || status.is_informational()
            || status == http::StatusCode::NO_CONTENT
            || status == http::StatusCode::NOT_MODIFIED;
        let framing = if no_body {
            // A HEAD answer made here (an error) says the length its GET answer has, as hyper's
            // server wrote it; an upstream's says its own.
            if meta.head
                && declared.is_none()
                && let Some(n) = body.size_hint().exact()
                && n > 0
            {
                // Written straight into the buffer (`io::Write` for `Vec` cannot fail).
                let _ = write!(out, "content-length: {n}\r\n");
            }
            Framing::NoBody
        } else if let Some(n) = declared {
            Framing::Length(n)
        } else if let Some(n) = body.size_hint().exact() {
            let _ = write!(out, "content-length: {n}\r\n");
            Framing::Length(n)
        } else if meta.http10 {
            keep = false;
            Framing::UntilClose
        } else {
            out.extend_from_slice(b"transfer-encoding: chunked\r\n");
            Framing::Chunked
        };
        if status == http::StatusCode::SWITCHING_PROTOCOLS {
            // No upgrade was asked for on this path; the connection cannot go on as HTTP.
            keep = false;
        }
        if !has_date {
            date::append(out);
        }
        if !has_connection {
            if !keep {
                out.extend_from_slice(b"connection: close\r\n");
            } else if meta.http10 {
                out.extend_from_slice(b"connection: keep-alive\r\n");
            }
        }
        out.extend_from_slice(b"\r\n");
        // The head is written: its map goes back to the worker for the next response.
        spare_heads::give_headers(parts.headers);
        if framing == Framing::NoBody {
            // A HEAD answer's body (none, normally) is not read: dropping it ends the exchange.
            drop(body);
            io.write_all(out).await?;
            io.flush().await?;
            return Ok(keep);
        }

        let mut sent: u64 = 0;
        loop {
            let step = std::future::poll_fn(|cx| match Pin::new(&mut body).poll_frame(cx) {
                Poll::Ready(f) => Poll::Ready(Step::Frame(f)),
                Poll::Pending if !out.is_empty() => Poll::Ready(Step::Write),
                Poll::Pending => match poll_client_end(io, buf, cx) {
                    Poll::Ready(()) => Poll::Ready(Step::ClientGone),
                    Poll::Pending => Poll::Pending,
                },
            })
            .await;
            match step {
                Step::Write => {
                    by_deadline(io.write_all(out), &mut body).await?;
                    out.clear();
                    by_deadline(io.flush(), &mut body).await?;
                }
                Step::Frame(Some(Ok(frame))) => {
                    // Trailers are not sent to HTTP/1.1 clients.
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    if data.is_empty() {
                        continue;
                    }
                    sent += data.len() as u64;
                    if let Framing::Length(n) = framing
                        && sent > n
                    {
                        // More than the length said: the rest cannot be framed.
                        io.write_all(out).await?;
                        return Ok(false);
                    }
                    if framing == Framing::Chunked {
                        let _ = write!(out, "{:x}\r\n", data.len());
                    }
                    if out.len() + data.len() <= WRITE_GATHER {
                        out.extend_from_slice(&data);
                    } else {
                        by_deadline(io.write_all(out), &mut body).await?;
                        out.clear();
                        by_deadline(io.write_all(&data), &mut body).await?;
                    }
                    if framing == Framing::Chunked {
                        out.extend_from_slice(b"\r\n");
                    }
                }
                // (A body the close would end is cut: the error skips the shutdown, and the
                // close is a reset, as hyper's server ends it.)
                Step::ClientGone if framing == Framing::UntilClose => {
                    return Err(std::io::ErrorKind::ConnectionAborted.into());
                }
                Step::ClientGone => return Ok(false),
                Step::Frame(Some(Err(e))) => {
                    // The upstream's body failed: what came is sent, and the connection closes
                    // so the client sees the body cut short: by its length or its missing
                    // last chunk; where the close itself would end the body (HTTP/1.0,
                    // length unknown), the close is a reset (`ConnActivity::set_unframed`),
                    // and the error skips the shutdown (and TLS's `close_notify`) that would
                    // make it a clean one.
                    tracing::debug!(error = %e, "response body failed while streaming");
                    io.write_all(out).await?;
                    io.flush().await?;
                    if framing == Framing::UntilClose {
                        return Err(std::io::Error::other("response body cut short"));
                    }
                    return Ok(false);
                }
                Step::Frame(None) => {
                    match framing {
                        Framing::Chunked => out.extend_from_slice(b"0\r\n\r\n"),
                        Framing::Length(n) if sent != n => keep = false,
                        _ => {}
                    }
                    io.write_all(out).await?;
                    io.flush().await?;
                    return Ok(keep);
                }
            }
        }
    }
}

/// The buffers a connection uses only while a request is in it: the read buffer and the
/// gather buffer its response is written from. An idle connection holds neither; they are
/// the worker's (this thread's) between requests, lent to whichever connection has one.
///
/// Two reasons. Memory: an idle keep-alive connection held its 8 KiB read buffer and its
/// 1 KiB gather buffer; with 5,000 idle connections RSS per connection went from 16.5 KB
/// to 7.7 KB (most of what is left is the connection's task). Warmth: with hundreds of
/// connections, each one's own buffers had gone cold since its last request, and each
/// request wrote its head and its response into lines that missed the cache; lent from
/// here they are the lines the last request used. `scripts/footprint.py`, per request:
/// last-level misses 48-53 -> 42 over 500 connections and 26-27 -> 24 over 50 (open
/// loop), for 80-320 more instructions (the lending, and code laid out anew; the most in
/// the closed loop, +1.9 %). nginx frees a keep-alive connection's buffers the same way
/// and takes them warm from its allocator; taking them from the allocator here cost more
/// (+650 instructions, docs/tail-latency.md).
///
/// Written here rather than taken from a pool crate: a few buffers on a per-thread stack,
/// with no locking and no `unsafe`; `bytes` says when a read buffer is free to lend again
/// (no head of a request still shares its memory).
mod spare {
    use std::cell::RefCell;

    use bytes::BytesMut;

    use super::{OUT_KEEP, READ_RESERVE};
    use crate::pipeline::spare::keep;

    /// A read buffer grown past this (a large head) is let go rather than kept.
    const READ_KEEP: usize = 2 * READ_RESERVE;

    thread_local! {
        static READ: RefCell<Vec<BytesMut>> = const { RefCell::new(Vec::new()) };
        static OUT: RefCell<Vec<Vec<u8>>> = const { RefCell::new(Vec::new()) };
    }

    /// A read buffer with room for a read.
    pub fn take_read() -> BytesMut {
        READ.with_borrow_mut(Vec::pop)
            .unwrap_or_else(|| BytesMut::with_capacity(READ_RESERVE))
    }

    /// Takes `buf` (empty) from the connection, which is left with no buffer. It is kept
    /// if no request's head still shares its memory (its whole length is free again).
    pub fn give_read(buf: &mut BytesMut) {
        debug_assert!(buf.is_empty());
        let mut b = std::mem::take(buf);
        if b.capacity() <= READ_KEEP && b.try_reclaim(READ_RESERVE) {
            keep(&READ, b);
        }
    }

    /// Gives the connection a gather buffer, if it has none (a response's first step).
    pub fn take_out(out: &mut Vec<u8>) {
        if out.capacity() == 0 {
            *out = OUT
                .with_borrow_mut(Vec::pop)
                .unwrap_or_else(|| Vec::with_capacity(1024));
        }
    }

    /// Takes the connection's gather buffer back after a response.
    pub fn give_out(out: &mut Vec<u8>) {
        let mut o = std::mem::take(out);
        if o.capacity() <= OUT_KEEP {
            o.clear();
            keep(&OUT, o);
        }
    }
}

/// The `Date` header, formatted once a second per thread.
mod date {
    use std::cell::RefCell;
    use std::time::{SystemTime, UNIX_EPOCH};

    thread_local! {
        /// The second last written, and its whole header line.
        static NOW: RefCell<(u64, Vec<u8>)> = const { RefCell::new((u64::MAX, Vec::new())) };
    }

    /// Appends the `date` header line, made once a second. (Not from the coarse real-time
    /// clock, which would spare the time-stamp counter's read: rustix's first call probes
    /// the vDSO's memory in a way valgrind cannot follow, and `scripts/footprint.py` counts
    /// under valgrind.)
    pub fn append(out: &mut Vec<u8>) {
        let now = SystemTime::now();
        let secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        NOW.with(|cell| {
            let mut c = cell.borrow_mut();
            if c.0 != secs {
                let mut line = b"date: ".to_vec();
                line.extend_from_slice(httpdate::fmt_http_date(now).as_bytes());
                line.extend_from_slice(b"\r\n");
                *c = (secs, line);
            }
            out.extend_from_slice(&c.1);
        });
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            max_head: 1024,
            max_body: 0,
            header_timeout: Duration::from_secs(1),
            max_requests: 0,
        }
    }

    fn parsed(input: &[u8]) -> (Parsed, BytesMut) {
        let mut buf = BytesMut::from(input);
        let p = parse::<false>(&mut buf, &limits(), &mut Vec::new());
        (p, buf)
    }

    /// The `date` line is the time now (to the second), as HTTP
    /// writes it.
    #[test]
    fn the_date_line_is_now() {
        let mut out = Vec::new();
        date::append(&mut out);
        let line = String::from_utf8(out).unwrap();
        let value = line
            .strip_prefix("date: ")
            .and_then(|l| l.strip_suffix("\r\n"))
            .unwrap();
        let at = httpdate::parse_http_date(value).unwrap();
        let now = std::time::SystemTime::now();
        let off = now.duration_since(at).unwrap_or_else(|e| e.duration());
        assert!(off < Duration::from_secs(3), "{line:?} is {off:?} from now");
    }

    #[test]
    fn a_request_in_small_pieces_is_parsed_once_per_line_and_once_for_its_body() {
        let mut wire = b"POST /up HTTP/1.1\r\nHost: x\r\n".to_vec();
        for i in 0..30 {
            wire.extend_from_slice(format!("x-filler-{i}: {}\r\n", "v".repeat(200)).as_bytes());
        }
        wire.extend_from_slice(b"Content-Length: 500\r\n\r\n");
        let lines = wire.iter().filter(|&&b| b == b'\n').count();
        wire.extend(std::iter::repeat_n(b'b', 500));
        wire.extend_from_slice(b"GET /next");
        let limits = Limits {
            max_head: 16 * 1024,
            ..limits()
        };
        let (mut gate, mut buf, mut idx) = (ParseGate::default(), BytesMut::new(), Vec::new());
        let mut parses = 0;
        let mut served = None;
        // Two bytes at a time, as a slow client sends them.
        for piece in wire.chunks(2) {
            buf.extend_from_slice(piece);
            if served.is_some() || !gate.worth_parsing(&buf, limits.max_head) {
                continue;
            }
            parses += 1;
            match parse::<false>(&mut buf, &limits, &mut idx) {
                Ok(s) => served = Some(s),
                Err(Unserved::Partial) => {}
                Err(Unserved::Body(whole)) => gate.whole = whole,
                Err(e) => panic!("{e:?}"),
            }
        }
        let Some(Served { parts, body, .. }) = served else {
            panic!("not served")
        };
        assert_eq!(parts.uri, "/up");
        assert_eq!(body.size_hint().exact(), Some(500));
        assert_eq!(&buf[..], b"GET /next");
        // The first bytes, each line's end, and the body once whole.
        assert_eq!(parses, lines + 2);
    }

    #[test]
    fn usual_requests_are_served_here() {
        let (p, rest) =
            parsed(b"GET /a?b=1 HTTP/1.1\r\nHost: x\r\nX-Two: 1\r\nx-two: 2\r\n\r\nGET /next");
        let Ok(Served { parts, meta, .. }) = p else {
            panic!("not served inline")
        };
        assert_eq!(parts.uri, "/a?b=1");
        assert_eq!(parts.headers["host"], "x");
        assert_eq!(parts.headers.get_all("x-two").iter().count(), 2);
        assert!(meta.keep_alive && !meta.http10 && !meta.head);
        assert_eq!(&rest[..], b"GET /next", "the next request's bytes stay");

        let (p, rest) = parsed(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhelloGET");
        let Ok(Served { body, .. }) = p else {
            panic!("not served inline")
        };
        assert_eq!(body.size_hint().exact(), Some(5));
        assert_eq!(&rest[..], b"GET");
    }

    #[test]
    fn keep_alive_follows_the_version_and_connection() {
        for (input, keep) in [
            (
                &b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"[..],
                false,
            ),
            (b"GET / HTTP/1.0\r\nHost: x\r\n\r\n", false),
            (
                b"GET / HTTP/1.0\r\nHost: x\r\nConnection: Keep-Alive\r\n\r\n",
                true,
            ),
            (
                b"GET / HTTP/1.1\r\nHost: x\r\nConnection: keep-alive, close\r\n\r\n",
                false,
            ),
        ] {
            let Ok(Served { meta, .. }) = parsed(input).0 else {
                panic!("not served inline")
            };
            assert_eq!(meta.keep_alive, keep, "{}", String::from_utf8_lossy(input));
        }
    }

    /// A head hyper's parser would refuse (the same `httparse` call) is refused here, with
    /// the status hyper's server gives it.
    #[test]
    fn heads_httparse_refuses_are_refused_here() {
        for (input, status) in [
            (&b"GET / HTTP/1.1\r\nHost: x\r\nX-Bad: a\x01b\r\n\r\n"[..], 400),
            (b"GARBAGE\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\n Host: x\r\n\r\n", 400),
            (b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", 400),
            // Bad bytes are refused before the head is whole.
            (b"GET / HTTP/1.1\r\nHo\x00st", 400),
            (
                b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
                400,
            ),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n",
                400,
            ),
            (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 400),
            (b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
            (b"GET http:/x/y HTTP/1.1\r\n\r\n", 400),
            (b"GET \"d HTTP/1.1\r\n\r\n", 400),
            (b"POST / HTTP/1.1\r\nContent-Length: +5\r\n\r\nhello", 400),
            (b"POST / HTTP/1.1\r\nContent-Length: 5, 6\r\n\r\nhello", 400),
            (b"POST / HTTP/1.1\r\nContent-Length: 5, 5\r\n\r\nhello", 400),
            (b"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello", 400),
            (b"POST / HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n", 400),
            (
                b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: x\r\n\r\n",
                400,
            ),
            (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\n\r\n", 400),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: gzip\r\n\r\n",
                400,
            ),
            (b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
        ] {
            match parsed(input).0 {
                Err(Unserved::Refused(e)) => assert_eq!(e.status().as_u16(), status),
                other => panic!("{}: {:?}", String::from_utf8_lossy(input), other.err()),
            }
        }
        let many: Vec<u8> = [
            &b"GET / HTTP/1.1\r\n"[..],
            &b"X: y\r\n".repeat(MAX_HEADERS + 1),
            b"\r\n",
        ]
        .concat();
        match parsed(&many).0 {
            Err(Unserved::Refused(e)) => assert_eq!(e.code(), "header_too_large"),
            other => panic!("{:?}", other.err()),
        }
    }

    /// Every shape served elsewhere is handed over with its bytes untouched.
    #[test]
    fn other_shapes_are_handed_over_whole() {
        for input in [
            &b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"[..],
            b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding:  Chunked \r\n\r\n0\r\n\r\n",
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc",
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 8193\r\n\r\nabc",
            b"POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
            b"CONNECT x:443 HTTP/1.1\r\nHost: x:443\r\n\r\n",
        ] {
            let (p, rest) = parsed(input);
            assert!(
                matches!(p, Err(Unserved::Other)),
                "{}",
                String::from_utf8_lossy(input)
            );
            assert_eq!(&rest[..], input, "handed over untouched");
        }
        let long = [
            &b"GET / HTTP/1.1\r\nHost: x\r\nX-Long: "[..],
            &[b'a'; 2048],
            b"\r\n\r\n",
        ]
        .concat();
        assert!(
            matches!(
                parsed(&long).0,
                Err(Unserved::Refused(ProxyError::HeadTooLarge(_)))
            ),
            "over the head limit"
        );
        assert!(matches!(
            parsed(&long[..1500]).0,
            Err(Unserved::Refused(ProxyError::HeadTooLarge(_)))
        ));
        assert!(matches!(parsed(&long[..100]).0, Err(Unserved::Partial)));
        // A small body still on its way is waited for; its bytes stay where they are.
        let small = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 8192\r\n\r\nabc";
        let (p, rest) = parsed(small);
        assert!(matches!(p, Err(Unserved::Body(n)) if n == small.len() - 3 + 8192));
        assert_eq!(&rest[..], small);
        // ... unless it is over the body limit: that is refused without waiting for it.
        let mut buf = BytesMut::from(&small[..]);
        let strict = Limits {
            max_body: 1000,
            ..limits()
        };
        assert!(matches!(
            parse::<false>(&mut buf, &strict, &mut Vec::new()),
            Err(Unserved::Other)
        ));
    }

    /// Both ends of a real loopback connection.
    async fn socket_pair() -> (tokio::net::TcpStream, tokio::net::TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = tokio::net::TcpStream::connect(listener.local_addr().unwrap());
        let (client, accepted) = tokio::join!(client, listener.accept());
        (client.unwrap(), accepted.unwrap().0)
    }

    fn fill_now(
        io: &mut tokio::net::TcpStream,
        buf: &mut BytesMut,
        between: bool,
    ) -> Poll<std::io::Result<usize>> {
        let waker = std::task::Waker::noop();
        poll_fill(io, buf, &mut Context::from_waker(waker), between)
    }

    #[tokio::test]
    async fn an_idle_connection_holds_no_read_buffer_and_reads_into_the_workers() {
        let (mut client, mut server) = socket_pair().await;
        // Nothing to read between requests: the buffer goes back to the worker.
        let mut buf = BytesMut::with_capacity(READ_RESERVE);
        let own = buf.as_ptr();
        assert!(fill_now(&mut server, &mut buf, true).is_pending());
        assert_eq!(buf.capacity(), 0, "an idle connection kept its read buffer");
        // The next request is read into the worker's buffer: the same memory, warm.
        client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        let n = loop {
            match fill_now(&mut server, &mut buf, true) {
                Poll::Ready(n) => break n.unwrap(),
                Poll::Pending => tokio::task::yield_now().await,
            }
        };
        assert_eq!(n, 18);
        assert_eq!(buf.as_ptr(), own);
        // While a request is in flight, the buffer stays with the connection.
        buf.clear();
        assert!(fill_now(&mut server, &mut buf, false).is_pending());
        assert!(buf.capacity() >= READ_MIN);
    }

    #[test]
    fn a_read_buffer_still_shared_with_a_head_is_not_lent_again() {
        let mut buf = spare::take_read();
        buf.extend_from_slice(b"GET / HTTP/1.1\r\n\r\n");
        let head = buf.split_to(buf.len()).freeze();
        spare::give_read(&mut buf);
        // The head still uses that memory: another connection gets other memory.
        let other = spare::take_read();
        let range = head.as_ptr() as usize..head.as_ptr() as usize + READ_RESERVE;
        assert!(!range.contains(&(other.as_ptr() as usize)));
        drop(other);
        // Once the head is gone, its buffer is reclaimed whole and lent again.
        let mut buf = spare::take_read();
        buf.extend_from_slice(b"GET / HTTP/1.1\r\n\r\n");
        let start = buf.as_ptr();
        drop(buf.split_to(buf.len()).freeze());
        spare::give_read(&mut buf);
        let again = spare::take_read();
        assert_eq!(again.as_ptr(), start);
        assert!(again.capacity() >= READ_RESERVE);
    }

    #[test]
    fn the_gather_buffer_is_the_workers_between_responses() {
        let mut out = Vec::new();
        spare::take_out(&mut out);
        out.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
        let used = out.as_ptr();
        spare::give_out(&mut out);
        assert_eq!(out.capacity(), 0);
        // The next response, on any connection of this worker, is gathered in it, empty.
        let mut next = Vec::new();
        spare::take_out(&mut next);
        assert_eq!((next.as_ptr(), next.len()), (used, 0));
        // One grown past the limit by a large response is let go.
        next.reserve(OUT_KEEP * 2);
        spare::give_out(&mut next);
        let mut after = Vec::new();
        spare::take_out(&mut after);
        assert!(after.capacity() <= OUT_KEEP);
    }

    #[test]
    fn content_lengths_are_digits_only() {
        assert_eq!(content_length(b"0012"), Some(12));
        assert_eq!(content_length(b"99999999999999999999"), None);
        assert_eq!(content_length(b""), None);
        assert_eq!(content_length(b"1 2"), None);
    }
}
