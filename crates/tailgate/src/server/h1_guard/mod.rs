//! A guard in front of hyper's HTTP/1 parser that refuses request-smuggling shapes hyper
//! would accept, and times the reading of each request head.
//!
//! hyper accepts a request carrying both `Content-Length` and `Transfer-Encoding` (it drops
//! the length and closes the connection afterwards, as RFC 9112 §6.3 permits); tailgate
//! refuses such a request outright, as nginx and HAProxy do. No crate offers that check on
//! the bytes before hyper sees them, so this module follows HTTP/1 framing itself: it holds
//! each request head until it is complete, inspects it with `httparse` (the parser hyper
//! uses), then passes bytes through, counting `Content-Length` bodies and walking chunked
//! framing to find where the next head starts.
//!
//! It refuses what hyper's parser would refuse too, by the rules the inline server applies
//! ([`crate::server::head`]): a head `httparse` refuses, one over the head limit, an
//! invalid or conflicting `Content-Length`, a `Transfer-Encoding` hyper does not take.
//! A refused head is never shown to hyper. In its place hyper reads a stand-in request
//! carrying a per-connection random token, which the pipeline answers with the gateway's
//! JSON error for that head ([`crate::pipeline::refusal_response`]): in order after the
//! requests before it, as hyper orders its answers, and then the connection closes. Chunked
//! framing that cannot be followed is refused inside a body that is already in flight:
//! hyper is fed bytes its chunked decoder rejects, which fails that request. An upgrade is
//! passed through untouched.
//!
//! When hyper's server closes the connection, the guard's shutdown lingers as the inline
//! server's close does (`server::linger`): the write side is shut, then what the client
//! still sends is read and dropped until it closes too. A client still
//! sending a body hyper did not read (a refused head's, one over `max_body_bytes` answered
//! 413 before it came, a request behind a `Connection: close`) gets the answer, not a
//! reset. A client that has closed already ends it at once.
//!
//! The guard also enforces the header read timeout (slowloris): from the first byte of a
//! head to its end. Idle time between requests is the idle timeout's business, not this.
//! A pipelined head that arrives while the request before it is still being answered is
//! timed from that answer's end, not from its first byte: hyper reads ahead while a
//! request is in flight, and nginx likewise starts timing a head only when it reads it.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

pub use self::framing::Refusal;
use self::framing::{Framing, State};
use super::linger::Linger;
use crate::pipeline::{ConnInfo, REFUSED_HEAD_HEADER, RefusedHead};

mod framing;

/// What hyper is fed when chunked framing is refused inside a body (hyper's chunked decoder
/// rejects it), or a head is refused where there is no connection to answer for (tests): a
/// header line with a control byte, which hyper's parser rejects with 400.
const POISON: &[u8] = b"GET / HTTP/1.1\r\nx\x01: refused\r\n\r\n";
/// Most request heads fit in 2 KiB; the buffer grows (to the head limit) when one does not.
const INITIAL_BUF: usize = 2 * 1024;

pub struct H1Guard<T> {
    inner: T,
    /// Bytes held back: a head not complete yet (and the sniffed first bytes). Empty, and
    /// without an allocation, between requests.
    buf: Vec<u8>,
    /// `buf[start..release]` is checked and may go to hyper; `buf[release..end]` is not yet.
    start: usize,
    release: usize,
    end: usize,
    framing: Framing,
    header_timeout: Duration,
    deadline: Option<Pin<Box<Sleep>>>,
    /// The connection: its requests in flight (a head is not timed while one is
    /// answered), and where a refused head's error is left for the pipeline.
    info: Option<Arc<ConnInfo>>,
    /// The request hyper is fed in place of a refused head, which the pipeline answers
    /// (`None`: [`POISON`], which hyper rejects itself).
    stand_in: Option<Vec<u8>>,
    /// The lingering close, once the write side is shut.
    linger: Option<Linger>,
}

impl<T> H1Guard<T> {
    pub fn new(inner: T, max_head: usize, header_timeout: Duration) -> Self {
        H1Guard {
            inner,
            buf: Vec::new(),
            start: 0,
            release: 0,
            end: 0,
            framing: Framing {
                state: State::Head,
                max_head,
                refused: None,
                head_done: false,
                head_scan: Default::default(),
                refused_asks_head: false,
                upgrade_asked: false,
            },
            header_timeout,
            deadline: None,
            info: None,
            stand_in: None,
            linger: None,
        }
    }

    /// A guard that goes on from bytes already read off `inner` (by the inline server), in
    /// front of hyper's server on the connection `info` describes.
    pub fn resume(
        inner: T,
        read: &[u8],
        max_head: usize,
        header_timeout: Duration,
        info: Arc<ConnInfo>,
    ) -> Self {
        let mut g = H1Guard::new(inner, max_head, header_timeout);
        g.buf = read.to_vec();
        g.end = read.len();
        g.info = Some(info);
        g
    }

    /// The connection, the bytes read but not handed on, before any was inspected, and the
    /// header read timer that [`fill_at_least`](Self::fill_at_least) started at their first
    /// byte: a head that began then is timed from then by whichever server comes next.
    pub fn into_parts(self) -> (T, Vec<u8>, Option<Pin<Box<Sleep>>>) {
        let mut buf = self.buf;
        buf.truncate(self.end);
        buf.drain(..self.start);
        (self.inner, buf, self.deadline)
    }

    /// Stop inspecting (the connection speaks HTTP/2).
    pub fn passthrough(&mut self) {
        self.framing.state = State::Passthrough;
        self.release = self.end;
        self.deadline = None;
        if let Some(info) = &self.info {
            info.activity.set_reading_head(false);
        }
    }

    pub fn refusal(&self) -> Option<Refusal> {
        self.framing.refused
    }

    /// The bytes read so far and not yet handed on.
    pub fn buffered(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// Reads from the connection until at least `want` bytes are buffered (or end of stream)
    /// without handing any on; returns how many are buffered. Once a byte has come, the
    /// header read timeout runs (a head has begun): a client that sends the first bytes of
    /// one and stops is cut off with `TimedOut` after it, not after the idle timeout.
    pub async fn fill_at_least(&mut self, want: usize) -> io::Result<usize>
    where
        T: AsyncRead + Unpin,
    {
        while self.end - self.start < want {
            if self.end == self.buf.len() {
                self.buf.resize((self.buf.len() * 2).max(INITIAL_BUF), 0);
            }
            let end = self.end;
            let n = {
                let mut rb = ReadBuf::new(&mut self.buf[end..]);
                let (inner, deadline) = (&mut self.inner, &mut self.deadline);
                std::future::poll_fn(|cx| match Pin::new(&mut *inner).poll_read(cx, &mut rb) {
                    Poll::Pending
                        if deadline
                            .as_mut()
                            .is_some_and(|d| d.as_mut().poll(cx).is_ready()) =>
                    {
                        Poll::Ready(Err(io::ErrorKind::TimedOut.into()))
                    }
                    r => r,
                })
                .await?;
                rb.filled().len()
            };
            if n == 0 {
                break;
            }
            if self.deadline.is_none() {
                self.deadline = Some(Box::pin(tokio::time::sleep(self.header_timeout)));
            }
            self.end += n;
        }
        Ok(self.end - self.start)
    }

    /// Checks the held-back bytes as far as the framing allows. Returns true when it
    /// released bytes or the state changed (so the caller loops), false when more input is
    /// needed.
    fn advance(&mut self) -> bool {
        let step = self.framing.advance(&self.buf[self.release..self.end]);
        self.settle_head();
        match step {
            Some(n) => {
                self.release += n;
                true
            }
            None => false,
        }
    }

    /// After the framing looked at bytes: a head done needs no timer; a head refused gets
    /// its stand-in.
    fn settle_head(&mut self) {
        if std::mem::take(&mut self.framing.head_done) {
            self.deadline = None;
            if let Some(info) = &self.info {
                info.activity.set_reading_head(false);
            }
            if let (Some(Refusal::Head(fault)), Some(info)) = (self.framing.refused, &self.info)
                && info.refused.get().is_none()
            {
                let token = fastrand::u64(..);
                let _ = info.refused.set(RefusedHead {
                    token,
                    error: fault.into(),
                });
                // A HEAD's refusal has no body: the stand-in asks as it did.
                let method = if self.framing.refused_asks_head {
                    "HEAD"
                } else {
                    "GET"
                };
                self.stand_in = Some(
                    format!(
                        "{method} / HTTP/1.1\r\nhost: refused.invalid\r\nconnection: close\r\n\
                         {REFUSED_HEAD_HEADER}: {token}\r\n\r\n"
                    )
                    .into_bytes(),
                );
            }
        }
    }

    /// A head is incomplete and the socket ran dry: starts its timer. Empty lines before a
    /// request line do not start one (RFC 9112 §2.2 has them ignored): a CRLF left after a
    /// body keeps the connection under the idle timeout, as the inline server does. (What
    /// the framing's scan of the head saw, not a scan of the bytes held back at each
    /// wake-up: a client sending nothing but CRLFs, a few at a time, would make that
    /// quadratic in the head limit.)
    fn arm_head_timer(&mut self) {
        if self.framing.state == State::Head
            && self.deadline.is_none()
            && self.release < self.end
            && self.framing.head_scan.started()
        {
            self.deadline = Some(Box::pin(tokio::time::sleep(self.header_timeout)));
            if let Some(info) = &self.info {
                info.activity.set_reading_head(true);
            }
        }
    }

    /// Ready with the error when the head's time is up: `header_timeout` from the later of
    /// its first byte and the end of the answer before it. A timer that fires while a
    /// request before the head is in flight is set `header_timeout` further (hyper does not
    /// read again after that answer unless the socket wakes it, so the timer must stay
    /// registered); one that fires sooner than `header_timeout` after the last answer ended
    /// is moved to that time.
    fn poll_head_timer(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        loop {
            let Some(d) = self.deadline.as_mut() else {
                return Poll::Pending;
            };
            if d.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            let Some(info) = self.info.as_ref() else {
                return Poll::Ready(head_timed_out());
            };
            let now = std::time::Instant::now();
            match info.activity.idle_deadline(self.header_timeout) {
                None => d.as_mut().reset((now + self.header_timeout).into()),
                Some(at) if at > now => d.as_mut().reset(at.into()),
                Some(_) => {
                    if let Some(slot) = &info.slot {
                        slot.count_header_timeout();
                    }
                    return Poll::Ready(head_timed_out());
                }
            }
        }
    }
}

impl<T: AsyncRead + Unpin> H1Guard<T> {
    /// Nothing held back: reads straight into hyper's buffer and checks the bytes there,
    /// keeping back only what cannot be released yet (the start of a head still
    /// incomplete). The usual request, whose head arrives whole, is never copied.
    fn poll_read_direct(
        &mut self,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<bool>> {
        debug_assert!(self.start == self.end);
        let before = out.filled().len();
        match Pin::new(&mut self.inner).poll_read(cx, out) {
            Poll::Ready(Ok(())) => {}
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending => return self.poll_head_timer(cx).map(Err),
        }
        let read = &out.filled()[before..];
        if read.is_empty() {
            // End of stream, nothing held back.
            return Poll::Ready(Ok(true));
        }
        let mut released = 0;
        while let Some(n) = self.framing.advance(&read[released..]) {
            released += n;
        }
        self.settle_head();
        let kept = &read[released..];
        // After a refusal the rest is never handed on: not kept either.
        if !kept.is_empty() && !matches!(self.framing.state, State::Refused { .. }) {
            if self.buf.len() < kept.len() {
                self.buf.resize(kept.len().max(INITIAL_BUF), 0);
            }
            self.buf[..kept.len()].copy_from_slice(kept);
            self.start = 0;
            self.release = 0;
            self.end = kept.len();
        }
        out.set_filled(before + released);
        Poll::Ready(Ok(released > 0))
    }
}

fn head_timed_out() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "request head not received in time")
}

impl<T: AsyncRead + Unpin> AsyncRead for H1Guard<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.release > this.start {
                let n = (this.release - this.start).min(out.remaining());
                out.put_slice(&this.buf[this.start..this.start + n]);
                this.start += n;
                if this.start == this.end {
                    // Drained: the buffer goes back to the allocator, as nginx frees header
                    // buffers on idle keep-alive connections: a few hot buffers serve many
                    // connections instead of one cold one each. Reads go straight to hyper's
                    // buffer until a head arrives in pieces again.
                    this.start = 0;
                    this.release = 0;
                    this.end = 0;
                    this.buf = Vec::new();
                }
                return Poll::Ready(Ok(()));
            }
            if let State::Refused { fed } = this.framing.state
                && this.release == this.start
            {
                let answered = this.stand_in.is_some();
                let stand_in = this.stand_in.as_deref().unwrap_or(POISON);
                let n = (stand_in.len() - fed).min(out.remaining());
                if n == 0 && answered {
                    // Not the end of the stream: hyper's server drops a connection whose
                    // stream ends while a request is in flight, before answering it. The
                    // stand-in asks for `connection: close`; hyper closes after its answer.
                    return Poll::Pending;
                }
                out.put_slice(&stand_in[fed..fed + n]);
                this.framing.state = State::Refused { fed: fed + n };
                return Poll::Ready(Ok(()));
            }
            if this.framing.state == State::Passthrough && this.start == this.end {
                return Pin::new(&mut this.inner).poll_read(cx, out);
            }
            if this.release < this.end && this.advance() {
                continue;
            }
            if this.start == this.end && out.remaining() > 0 {
                match this.poll_read_direct(cx, out) {
                    // Bytes released, or the end of the stream.
                    Poll::Ready(Ok(true)) => return Poll::Ready(Ok(())),
                    // All held back (a head in pieces), or refused: go on from the buffer.
                    Poll::Ready(Ok(false)) => continue,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => return Poll::Pending,
                }
            }
            // Need more input. Make room: compact, then grow up to the head limit.
            if this.start > 0 {
                this.buf.copy_within(this.start..this.end, 0);
                this.release -= this.start;
                this.end -= this.start;
                this.start = 0;
            }
            if this.end == this.buf.len() {
                let grown = (this.buf.len() * 2)
                    .max(INITIAL_BUF)
                    .min(this.framing.max_head + 8 * 1024);
                if grown <= this.buf.len() {
                    // A head longer than the limit (the framing refuses one before the
                    // buffer is this full; never hand hyper bytes no one checked).
                    this.framing.refuse_head(
                        crate::server::head::OVER_LIMIT,
                        &this.buf[this.release..this.end],
                    );
                    this.settle_head();
                    continue;
                }
                this.buf.resize(grown, 0);
            }
            let mut rb = ReadBuf::new(&mut this.buf[this.end..]);
            match Pin::new(&mut this.inner).poll_read(cx, &mut rb) {
                Poll::Ready(Ok(())) => {
                    let n = rb.filled().len();
                    if n == 0 {
                        // End of stream: hand over what is left, then the EOF. A head held
                        // back gets one last look first (its bytes since its last line were
                        // not parsed): one already wrong is refused, with the gateway's
                        // answer.
                        if this.end > this.release {
                            if this.framing.state == State::Head {
                                this.framing.head_scan.force();
                                if this.advance() {
                                    continue;
                                }
                            }
                            this.release = this.end;
                            this.framing.state = State::Passthrough;
                            continue;
                        }
                        return Poll::Ready(Ok(()));
                    }
                    this.end += n;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {
                    // The head timer is armed only for a head still incomplete when the
                    // socket runs dry, not for the usual head that arrives whole in one
                    // read: from its first bytes (read in this same call, or earlier) on.
                    this.arm_head_timer();
                    let Poll::Ready(timed_out) = this.poll_head_timer(cx) else {
                        return Poll::Pending;
                    };
                    // Before the head is given up on, one last look, as at the end of the
                    // stream: one already wrong gets its refusal, not a silent close.
                    if this.framing.state == State::Head && this.end > this.release {
                        this.framing.head_scan.force();
                        if this.advance() {
                            continue;
                        }
                    }
                    return Poll::Ready(Err(timed_out));
                }
            }
        }
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncWrite for H1Guard<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    /// The write side is shut, then the connection lingers (see the module's doc) before
    /// hyper drops it. Not once the connection speaks HTTP/2 (it has its own close), nor
    /// once it is a tunnel: there the upstream's end of stream is passed on as a
    /// half-close, and the client's bytes that follow are the tunnel's to carry upstream.
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if matches!(this.framing.state, State::Passthrough)
            && (!this.framing.upgrade_asked
                || this.info.as_ref().is_some_and(|i| i.activity.tunnelled()))
        {
            return Pin::new(&mut this.inner).poll_shutdown(cx);
        }
        super::linger::poll_shutdown_lingering(
            &mut this.inner,
            &mut this.linger,
            this.info.as_deref(),
            cx,
        )
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::head::{self, HeadFault};
    use tokio::io::AsyncReadExt;

    const CL_TE: Refusal = Refusal::Head(HeadFault::Bad(
        "Content-Length together with Transfer-Encoding",
    ));

    async fn pass(input: &[u8]) -> (Vec<u8>, Option<Refusal>) {
        let mut g = H1Guard::new(input, 16 * 1024, Duration::from_secs(5));
        let mut out = Vec::new();
        g.read_to_end(&mut out).await.expect("read");
        (out, g.refusal())
    }

    #[tokio::test]
    async fn passes_keepalive_sequences_unchanged() {
        let input: &[u8] = b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhelloPOST /b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n0\r\nX-T: 1\r\n\r\nGET /c HTTP/1.1\r\nHost: x\r\n\r\n";
        let (out, refused) = pass(input).await;
        assert_eq!(out, input);
        assert_eq!(refused, None);
    }

    #[tokio::test]
    async fn refuses_cl_and_te_on_a_later_request() {
        let input: &[u8] = b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\nPOST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
        let (out, refused) = pass(input).await;
        assert_eq!(refused, Some(CL_TE));
        // The first request whole (its chunked body to the last chunk), then the poison in
        // place of the second.
        let second = input
            .windows(7)
            .position(|w| w == b"POST /b")
            .expect("a second request");
        assert_eq!(out, [&input[..second], POISON].concat());
    }

    /// Review finding: a bare LF ending the trailers was read by hyper as the start of a
    /// trailer section, so the guard and hyper disagreed on where the next head began.
    #[tokio::test]
    async fn bare_lf_in_chunked_framing_is_refused() {
        for input in [
            &b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\nPOST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc"[..],
            &b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\nabc\r\n0\r\n\r\n"[..],
            &b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\n0\r\n\r\n"[..],
        ] {
            let (out, refused) = pass(input).await;
            assert_eq!(refused, Some(Refusal::Chunked), "{}", String::from_utf8_lossy(input));
            assert!(out.ends_with(POISON));
        }
    }

    /// The heads hyper's server refuses are refused by the same rules as in the inline
    /// server, and nothing of them reaches hyper; the same `Content-Length` twice, which
    /// hyper takes, frames its body.
    #[tokio::test]
    async fn refuses_what_hyper_refuses_and_frames_what_it_takes() {
        let first: &[u8] = b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n";
        let many = format!("GET / HTTP/1.1\r\n{}\r\n", "a: b\r\n".repeat(101));
        let long = format!("GET / HTTP/1.1\r\nx: {}\r\n\r\n", "v".repeat(16 * 1024));
        let cases: [(&[u8], HeadFault); 8] = [
            (
                b"GET / HTTP/1.1\r\nx\x01: y\r\n\r\n",
                HeadFault::Bad("invalid header name"),
            ),
            (
                b"POST / HTTP/1.1\r\nContent-Length: 3, 3\r\n\r\nabc",
                HeadFault::Bad("invalid or conflicting Content-Length"),
            ),
            (
                b"POST / HTTP/1.1\r\nContent-Length: 5, 6\r\n\r\n",
                HeadFault::Bad("invalid or conflicting Content-Length"),
            ),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\n\r\n",
                HeadFault::Bad("a Transfer-Encoding other than chunked alone"),
            ),
            (
                b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
                HeadFault::Bad("Transfer-Encoding in an HTTP/1.0 request"),
            ),
            (
                b"GET http://[::1 HTTP/1.1\r\n\r\n",
                HeadFault::Bad("invalid request target"),
            ),
            (
                many.as_bytes(),
                HeadFault::TooLarge("more than 100 header lines"),
            ),
            (long.as_bytes(), head::OVER_LIMIT),
        ];
        for (refused_head, fault) in cases {
            let input = [first, refused_head].concat();
            let (out, refused) = pass(&input).await;
            assert_eq!(
                refused,
                Some(Refusal::Head(fault)),
                "{}",
                String::from_utf8_lossy(refused_head)
            );
            assert_eq!(out, [first, POISON].concat());
        }
        let list: &[u8] = b"POST /a HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabcGET /b HTTP/1.1\r\n\r\n";
        let (out, refused) = pass(list).await;
        assert_eq!((out.as_slice(), refused), (list, None));
    }

    #[tokio::test]
    async fn poison_is_fed_whole_through_small_reads() {
        let input: &[u8] =
            b"POST / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n";
        let mut g = H1Guard::new(input, 16 * 1024, Duration::from_secs(5));
        let mut out = Vec::new();
        let mut small = [0u8; 3];
        loop {
            let n = g.read(&mut small).await.expect("read");
            if n == 0 {
                break;
            }
            out.extend_from_slice(&small[..n]);
        }
        assert_eq!(out, POISON);
    }

    /// Yields its bytes `piece` at a time, as a socket might.
    struct Pieces {
        data: &'static [u8],
        piece: usize,
    }

    impl AsyncRead for Pieces {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            let n = self.piece.min(self.data.len()).min(buf.remaining());
            buf.put_slice(&self.data[..n]);
            self.data = &self.data[n..];
            Poll::Ready(Ok(()))
        }
    }

    async fn pass_in_pieces(
        input: &'static [u8],
        piece: usize,
        out_len: usize,
    ) -> (Vec<u8>, Option<Refusal>) {
        let mut g = H1Guard::new(
            Pieces { data: input, piece },
            16 * 1024,
            Duration::from_secs(5),
        );
        let mut out = Vec::new();
        let mut chunk = vec![0u8; out_len];
        loop {
            let n = g.read(&mut chunk).await.expect("read");
            if n == 0 {
                break;
            }
            out.extend_from_slice(&chunk[..n]);
        }
        (out, g.refusal())
    }

    /// Heads and bodies split at every point, read into buffers large and small, whether the
    /// guard reads into its own buffer or straight into the reader's: the same bytes come out,
    /// and the same heads are refused.
    #[tokio::test]
    async fn any_split_of_the_input_gives_the_same_answer() {
        let valid: &'static [u8] = b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhelloPOST /b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n0\r\nX-T: 1\r\n\r\nGET /c HTTP/1.1\r\nHost: x\r\n\r\n";
        let smuggling: &'static [u8] = b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nPOST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /c HTTP/1.1\r\nHost: x\r\n\r\n";
        for piece in 1..=valid.len() {
            for out_len in [1, 7, 64, 8192] {
                let (out, refused) = pass_in_pieces(valid, piece, out_len).await;
                assert_eq!(out, valid, "piece {piece}, out {out_len}");
                assert_eq!(refused, None);
            }
        }
        for piece in 1..=smuggling.len() {
            for out_len in [1, 7, 64, 8192] {
                let (out, refused) = pass_in_pieces(smuggling, piece, out_len).await;
                assert_eq!(refused, Some(CL_TE), "piece {piece}, out {out_len}");
                assert_eq!(
                    out,
                    [&b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"[..], POISON].concat()
                );
            }
        }
    }

    #[tokio::test]
    async fn h2_preface_passes_through() {
        let input: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00";
        let mut g = H1Guard::new(input, 16 * 1024, Duration::from_secs(5));
        g.fill_at_least(24).await.expect("fill");
        g.passthrough();
        let mut out = Vec::new();
        g.read_to_end(&mut out).await.expect("read");
        let refused = g.refusal();
        assert_eq!(out, input);
        assert_eq!(refused, None);
    }
}
