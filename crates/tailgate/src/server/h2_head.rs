//! The header read timeout over HTTP/2 (slowloris): a request head, or any frame but DATA,
//! that has begun must be whole within `header_read_timeout`.
//!
//! hyper's HTTP/2 server keeps no such timer, and h2 buffers a header block (HEADERS and
//! its CONTINUATIONs) until it ends, unseen: a client that sent part of a head and stopped,
//! or trickled a head's bytes (h2 takes at most a few CONTINUATION frames per block), held
//! its connection until the idle timeout, and as long again if it ignored the close's
//! PING. So this reader, between the connection and hyper, follows the framing of what the
//! client sends (RFC 9113 §4.1: the preface, then 9-byte frame headers and their payloads;
//! no crate exposes that outside h2's own decoder). It reads only the frame headers, never
//! copies, reads the clock only when a read ends part-way into a head, and makes its timer
//! only when a read waits then.
//!
//! Timed, from its first byte: the connection preface, a frame header, the payload of any
//! frame but DATA, and a header block from its HEADERS to the frame that carries
//! END_HEADERS, however many bytes come meanwhile (trickling does not move the deadline,
//! as it does not for an HTTP/1 head). A DATA frame's payload is a body's, not a head's:
//! a slow upload is not cut here (the body's own timeouts apply), and a header block never
//! has DATA inside it (a protocol error h2 answers). Time with nothing begun (before the
//! preface, between requests) is the idle timeout's business. When the time is up, a read
//! fails with `TimedOut`, and hyper's server ends the connection. (h2 reads only while it
//! can write: with the client taking no answers, the send timeout bounds the connection
//! instead.)
//!
//! It also gives HTTP/2 the lingering close the HTTP/1 servers have ([`super::linger`]):
//! h2 ends a connection by sending GOAWAY, shutting the write side and stopping, and the
//! socket would be closed with whatever the client sent since (a WINDOW_UPDATE as it takes
//! the last answer, its own GOAWAY, a request that crossed the GOAWAY) unread. The kernel
//! then answers with a reset, and drops the answers' bytes still in its send buffer: the
//! last answers of a connection closed at `max_requests_per_connection` or at a drain
//! would be cut short. So the shutdown reads and drops what still comes, within the
//! linger's bounds, before it is done.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

use super::linger::Linger;
use crate::pipeline::ConnInfo;

/// The client connection preface's length (RFC 9113 §3.4).
const PREFACE_LEN: u32 = 24;
const FRAME_HEADER_LEN: usize = 9;
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_HEADERS: u8 = 0x4;

/// Where the client's bytes are in HTTP/2's framing.
#[derive(Debug, Default)]
struct Framing {
    /// Bytes of the preface still to come.
    preface_left: u32,
    /// The frame header read so far.
    header: [u8; FRAME_HEADER_LEN],
    header_have: usize,
    /// Bytes of the current frame's payload still to come, and whether it is DATA's.
    payload_left: u32,
    payload_is_data: bool,
    /// A HEADERS frame came without END_HEADERS: its CONTINUATIONs are still to come.
    block_open: bool,
}

impl Framing {
    fn new() -> Self {
        Framing {
            preface_left: PREFACE_LEN,
            ..Framing::default()
        }
    }

    /// Follows `bytes`, the next the client sent; true if no head was part-way in at some
    /// point in them (before, between or after their frames).
    fn advance(&mut self, mut bytes: &[u8]) -> bool {
        let mut clear = !self.mid_head();
        while !bytes.is_empty() {
            if self.preface_left > 0 {
                let n = bytes.len().min(self.preface_left as usize);
                self.preface_left -= n as u32;
                bytes = &bytes[n..];
            } else if self.payload_left > 0 {
                let n = bytes.len().min(self.payload_left as usize);
                self.payload_left -= n as u32;
                bytes = &bytes[n..];
            } else {
                let n = bytes.len().min(FRAME_HEADER_LEN - self.header_have);
                self.header[self.header_have..self.header_have + n].copy_from_slice(&bytes[..n]);
                self.header_have += n;
                bytes = &bytes[n..];
                if self.header_have == FRAME_HEADER_LEN {
                    self.header_have = 0;
                    let h = &self.header;
                    let (kind, flags) = (h[3], h[4]);
                    self.payload_left = u32::from_be_bytes([0, h[0], h[1], h[2]]);
                    self.payload_is_data = kind == DATA;
                    if kind == HEADERS || kind == CONTINUATION {
                        self.block_open = flags & END_HEADERS == 0;
                    }
                }
            }
            clear |= !self.mid_head();
        }
        clear
    }

    /// Is a head (or a frame other than DATA) part-way in? (Not before the preface's first
    /// byte.)
    fn mid_head(&self) -> bool {
        (self.preface_left > 0 && self.preface_left < PREFACE_LEN)
            || self.header_have > 0
            || self.block_open
            || (self.payload_left > 0 && !self.payload_is_data)
    }
}

/// The client's side of an HTTP/2 connection, with its heads timed (see the module).
pub struct H2HeadTimer<T> {
    inner: T,
    framing: Framing,
    timeout: Duration,
    /// When the head part-way in must be whole (`None`: none is).
    due: Option<tokio::time::Instant>,
    /// The timer for `due`, made when a read first waits with a head part-way in.
    timer: Option<Pin<Box<Sleep>>>,
    /// The lingering close, once the write side is shut.
    linger: Option<Linger>,
    /// The connection's, told when the lingering close begins (so that a close's deadline
    /// waits for it, as for an HTTP/1 one's).
    info: Option<Arc<ConnInfo>>,
}

impl<T> H2HeadTimer<T> {
    pub fn new(inner: T, timeout: Duration) -> Self {
        H2HeadTimer {
            inner,
            framing: Framing::new(),
            timeout,
            due: None,
            timer: None,
            linger: None,
            info: None,
        }
    }

    /// Tells `info` when the connection's lingering close begins.
    pub fn with_info(mut self, info: Arc<ConnInfo>) -> Self {
        self.info = Some(info);
        self
    }

    /// After new bytes: a head part-way in at their end is due `timeout` after its first
    /// byte; one that began within them, after the bytes came.
    fn follow(&mut self, bytes: &[u8]) {
        let cleared = self.framing.advance(bytes);
        if !self.framing.mid_head() {
            self.due = None;
        } else if cleared || self.due.is_none() {
            self.due = Some(tokio::time::Instant::now() + self.timeout);
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for H2HeadTimer<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let filled = buf.filled();
                if filled.len() > before {
                    this.follow(&filled[before..]);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                if let Some(due) = this.due {
                    let timer = this
                        .timer
                        .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(due)));
                    if timer.deadline() != due {
                        timer.as_mut().reset(due);
                    }
                    if timer.as_mut().poll(cx).is_ready() {
                        return Poll::Ready(Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "HTTP/2 request head not received in time",
                        )));
                    }
                }
                Poll::Pending
            }
            r => r,
        }
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncWrite for H2HeadTimer<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    /// The write side is shut, then the connection lingers (see the module's doc).
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        super::linger::poll_shutdown_lingering(
            &mut this.inner,
            &mut this.linger,
            this.info.as_deref(),
            cx,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, len: u32) -> Vec<u8> {
        let l = len.to_be_bytes();
        let mut f = vec![l[1], l[2], l[3], kind, flags, 0, 0, 0, 1];
        f.resize(FRAME_HEADER_LEN + len as usize, 0);
        f
    }

    /// The framing is followed a byte at a time as well as whole: a head is part-way in
    /// from its first byte to the end of the frame with END_HEADERS; a DATA payload is not
    /// a head.
    #[test]
    fn heads_are_followed_through_continuations_and_split_reads() {
        let mut stream = vec![b'P'; PREFACE_LEN as usize];
        let mut marks = Vec::new();
        marks.push((stream.len(), false));
        stream.extend(frame(0x4, 0, 6)); // SETTINGS
        marks.push((stream.len(), false));
        stream.extend(frame(HEADERS, 0, 10));
        marks.push((stream.len(), true));
        stream.extend(frame(CONTINUATION, 0, 3));
        marks.push((stream.len(), true));
        stream.extend(frame(CONTINUATION, END_HEADERS, 2));
        marks.push((stream.len(), false));
        let data_start = stream.len() + FRAME_HEADER_LEN;
        stream.extend(frame(DATA, 0, 100));
        marks.push((stream.len(), false));
        stream.extend(frame(HEADERS, END_HEADERS, 4));
        marks.push((stream.len(), false));

        let mut whole = Framing::new();
        let mut last = 0;
        for &(at, mid) in &marks {
            whole.advance(&stream[last..at]);
            assert_eq!(whole.mid_head(), mid, "at {at}");
            last = at;
        }
        let mut bytewise = Framing::new();
        for (i, b) in stream.iter().enumerate() {
            if let Some(&(_, mid)) = marks.iter().find(|(at, _)| *at == i) {
                assert_eq!(bytewise.mid_head(), mid, "at {i}");
            }
            if i > data_start && i < data_start + 100 {
                assert!(!bytewise.mid_head(), "inside DATA at {i}");
            }
            bytewise.advance(std::slice::from_ref(b));
        }
        assert!(!bytewise.mid_head());
        assert!(
            !Framing::new().mid_head(),
            "nothing begun before the preface"
        );
        let mut part = Framing::new();
        part.advance(b"PRI");
        assert!(part.mid_head(), "a preface part-way in");
    }

    /// A head begun and left part-way fails the read once the timeout is up; a connection
    /// whose heads came whole waits for more as long as it likes.
    #[tokio::test(start_paused = true)]
    async fn a_head_left_part_way_times_out_and_a_quiet_connection_does_not() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (near, mut far) = tokio::io::duplex(1 << 16);
        let mut io = H2HeadTimer::new(near, Duration::from_secs(1));
        let mut hello = vec![b'P'; PREFACE_LEN as usize];
        hello.extend(frame(HEADERS, END_HEADERS, 5));
        far.write_all(&hello).await.expect("write");
        let mut got = vec![0u8; hello.len()];
        io.read_exact(&mut got).await.expect("read");
        // Nothing begun: a minute of silence is no timeout.
        let mut one = [0u8; 1];
        assert!(
            tokio::time::timeout(Duration::from_secs(60), io.read(&mut one))
                .await
                .is_err()
        );
        // Half a frame header, then nothing.
        far.write_all(&[0, 0]).await.expect("write");
        let mut two = [0u8; 2];
        io.read_exact(&mut two).await.expect("read");
        let e = tokio::time::timeout(Duration::from_secs(2), io.read(&mut one))
            .await
            .expect("the head's time ran out")
            .expect_err("a timeout");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
    }

    /// A read that ends one head and begins the next times the next from its own start,
    /// not from the first one's.
    #[tokio::test(start_paused = true)]
    async fn the_next_head_in_the_same_read_gets_its_own_time() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (near, mut far) = tokio::io::duplex(1 << 16);
        let mut io = H2HeadTimer::new(near, Duration::from_secs(1));
        let first = frame(HEADERS, END_HEADERS, 5);
        let mut sent = vec![b'P'; PREFACE_LEN as usize];
        sent.extend_from_slice(&first[..4]);
        far.write_all(&sent).await.expect("write");
        let mut got = vec![0u8; sent.len()];
        io.read_exact(&mut got).await.expect("read");
        tokio::time::sleep(Duration::from_millis(800)).await;
        // The rest of the first head, and half of the next frame's header.
        let mut rest = first[4..].to_vec();
        rest.extend_from_slice(&[0, 0, 5]);
        far.write_all(&rest).await.expect("write");
        let mut got = vec![0u8; rest.len()];
        io.read_exact(&mut got).await.expect("read");
        let mut one = [0u8; 1];
        // Past the first head's deadline (1 s from its first byte), within the next one's.
        assert!(
            tokio::time::timeout(Duration::from_millis(700), io.read(&mut one))
                .await
                .is_err(),
            "the next head was timed from the first one's start"
        );
        let e = tokio::time::timeout(Duration::from_millis(600), io.read(&mut one))
            .await
            .expect("the next head's time ran out")
            .expect_err("a timeout");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
    }
}
