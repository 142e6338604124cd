//! A client that stops reading: when the connection has bytes to send and the client takes
//! none for `timeout`, writing fails, so a reader that never reads cannot hold the
//! connection (and its upstream connection, and shutdown) forever. nginx's `send_timeout`.
//!
//! It wraps the TCP stream itself, under TLS and under both HTTP versions, because a stalled
//! write is a property of the socket, not of the protocol above it.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

use crate::observe::ConnActivity;

pub struct SendTimeout<T: ResetOnClose> {
    inner: T,
    timeout: Duration,
    /// Armed at the first write that could not proceed; cleared by any write that does.
    deadline: Option<Pin<Box<Sleep>>>,
    /// Told whether a write is blocked, so that a close (shutdown, idle) waits for bytes
    /// on their way to the client ([`ConnActivity::still_sending`]).
    activity: Arc<ConnActivity>,
}

impl<T: ResetOnClose> SendTimeout<T> {
    pub fn new(inner: T, timeout: Duration, activity: Arc<ConnActivity>) -> Self {
        SendTimeout {
            inner,
            timeout,
            deadline: None,
            activity,
        }
    }

    fn on_write<R>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        if r.is_ready() {
            if self.deadline.take().is_some() {
                self.activity.set_write_blocked(false);
                if matches!(r, Poll::Ready(Ok(_))) {
                    self.activity.took_bytes();
                }
            }
            return r;
        }
        let timeout = self.timeout;
        let d = self.deadline.get_or_insert_with(|| {
            self.activity.set_write_blocked(true);
            Box::pin(tokio::time::sleep(timeout))
        });
        if d.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        // The connection fails with this: nothing more is on its way, and what it had in
        // flight is recorded as cut off for it.
        self.activity.set_write_blocked(false);
        self.activity.set_send_timed_out();
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "client took no bytes in time",
        )))
    }
}

impl<T: AsyncRead + ResetOnClose + Unpin> AsyncRead for SendTimeout<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + ResetOnClose + Unpin> AsyncWrite for SendTimeout<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let r = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.on_write(cx, r)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let r = Pin::new(&mut this.inner).poll_flush(cx);
        this.on_write(cx, r)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let r = Pin::new(&mut this.inner).poll_shutdown(cx);
        if let Poll::Ready(Ok(())) = r {
            // Shut after the last answer was written whole (over TLS, after `close_notify`).
            this.activity.framed_by_close();
        }
        this.on_write(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let r = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.on_write(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// A socket whose close can be made a reset.
pub trait ResetOnClose {
    /// Makes closing it send `RST` instead of `FIN` (`SO_LINGER` of zero).
    fn reset_on_close(&self);
}

impl ResetOnClose for tokio::net::TcpStream {
    fn reset_on_close(&self) {
        let _ = socket2::SockRef::from(self).set_linger(Some(Duration::ZERO));
    }
}

/// A connection closed in the middle of an answer its close would end
/// ([`ConnActivity::set_unframed`]) is reset, so that the client does not take the cut body
/// for a whole one. Here, in the stream every client connection's protocols sit on, so
/// that it holds whichever server (and TLS or not) was serving, and whatever cut it.
impl<T: ResetOnClose> Drop for SendTimeout<T> {
    fn drop(&mut self) {
        if self.activity.close_must_reset() {
            self.inner.reset_on_close();
        }
    }
}

#[cfg(test)]
impl ResetOnClose for tokio::io::DuplexStream {
    fn reset_on_close(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A write the peer does not take marks the connection as still sending; once the
    /// peer reads and the write goes through, it no longer is.
    #[tokio::test]
    async fn a_blocked_write_is_told_to_the_connection() {
        let (near, mut far) = tokio::io::duplex(64);
        let activity = Arc::new(ConnActivity::default());
        let mut io = SendTimeout::new(near, Duration::from_secs(30), activity.clone());
        io.write_all(&[1; 64]).await.expect("first write");
        assert!(!activity.still_sending());
        let writing = tokio::spawn(async move {
            io.write_all(&[2; 64]).await.expect("second write");
            io
        });
        // The duplex buffer is full: the second write waits.
        tokio::time::timeout(Duration::from_secs(10), async {
            while !activity.still_sending() {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the blocked write was not told");
        let mut got = [0u8; 128];
        far.read_exact(&mut got).await.expect("read");
        let _io = writing.await.expect("writer");
        assert!(!activity.still_sending());
    }

    /// A blocked write that goes through later is the client taking bytes: the stall check's
    /// clock (counted from when a piece was handed) and the idle clock move to it. A piece
    /// that takes many writes to go out to a slow reader that keeps reading (a large one,
    /// or one behind hyper's write buffer) was cut off `idle` after it was handed, however
    /// steadily the client read.
    #[tokio::test]
    async fn a_blocked_write_that_goes_through_moves_the_stall_clock() {
        let (near, mut far) = tokio::io::duplex(64);
        let activity = Arc::new(ConnActivity::default());
        let idle = Duration::from_secs(60);
        activity.piece_handed();
        let handed_due = activity.stalled_deadline(idle).expect("a piece waits");
        let mut io = SendTimeout::new(near, Duration::from_secs(30), activity.clone());
        io.write_all(&[1; 64]).await.expect("first write");
        let writing = tokio::spawn(async move {
            io.write_all(&[2; 64]).await.expect("second write");
            io
        });
        tokio::time::timeout(Duration::from_secs(10), async {
            while !activity.still_sending() {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the write did not block");
        // Some milliseconds on (the clocks count whole milliseconds), the client reads.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let mut got = [0u8; 128];
        far.read_exact(&mut got).await.expect("read");
        let _io = writing.await.expect("writer");
        let due = activity
            .stalled_deadline(idle)
            .expect("the piece still waits");
        assert!(
            due >= handed_due + Duration::from_millis(15),
            "the stall deadline did not move: {:?} after the piece's",
            due.saturating_duration_since(handed_due)
        );
        // (No exchange in flight here: the idle clock runs.)
        let idle_due = activity.idle_deadline(idle).expect("nothing in flight");
        assert!(idle_due >= handed_due + Duration::from_millis(15));
    }

    /// A client that takes nothing for the timeout fails the write, and the connection is
    /// no longer held as sending.
    #[tokio::test(start_paused = true)]
    async fn a_write_that_times_out_is_no_longer_sending() {
        let (near, _far) = tokio::io::duplex(8);
        let activity = Arc::new(ConnActivity::default());
        let mut io = SendTimeout::new(near, Duration::from_secs(1), activity.clone());
        let e = io.write_all(&[0; 64]).await.expect_err("timed out");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(!activity.still_sending());
    }
}
