//! The tunnel of an upgraded connection (WebSocket and the like): bytes copied both ways
//! until either side ends, or until none moved either way for the idle timeout.
//!
//! Without that bound, a tunnel whose client vanished without a FIN (a NAT entry expired, a
//! laptop closed) held its task and both sockets until shutdown. nginx closes a tunnel that
//! is silent for `proxy_read_timeout` and Envoy for its idle timeout; here it is the
//! server's `idle_timeout`, the bound on a client connection with nothing to do. Applications
//! that keep a WebSocket open through quiet periods send pings well within it.
//!
//! tokio's `copy_bidirectional` does the copying (its buffers, its half-close handling);
//! the sockets are wrapped only to note when bytes last moved, which the timer reads when
//! it fires, so a busy tunnel pays no timer update per read or write, and how many bytes
//! each side's reads took, counted as they move so that they reach the exchange however
//! the tunnel ends ([`Exchange`]).

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::observe::ExchangeRecorder;
// tokio's clock, which the timer runs on (and tests can pause).
use tokio::time::Instant;

/// When bytes last moved, in milliseconds from `since`, and which side failed first.
struct Moved {
    since: Instant,
    last_ms: AtomicU64,
    /// 0: neither; else the [`Side`] (as `u8`) whose read or write failed first.
    failed: AtomicU8,
}

impl Moved {
    fn now(&self) {
        let ms = u64::try_from(self.since.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    fn idle_until(&self, idle: Duration) -> Instant {
        self.since + Duration::from_millis(self.last_ms.load(Ordering::Relaxed)) + idle
    }

    /// Notes `side` as the one that failed, unless one did before it.
    fn failed<T>(&self, side: Side, r: &Poll<io::Result<T>>) {
        if matches!(r, Poll::Ready(Err(_))) {
            let _ =
                self.failed
                    .compare_exchange(0, side as u8, Ordering::Relaxed, Ordering::Relaxed);
        }
    }
}

/// Where a tunnel's ending came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The client's socket failed (reset, or cut off by the send timeout).
    Client = 1,
    /// The upstream's socket failed.
    Upstream = 2,
    /// No bytes either way for the idle timeout.
    Idle = 3,
}

/// One side of the tunnel, noting each read or write that moved bytes, and counting the
/// bytes read from it.
struct Watched<'a, T> {
    io: &'a mut T,
    moved: &'a Moved,
    side: Side,
    read: &'a AtomicU64,
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<'_, T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut *this.io).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.moved.now();
            this.read
                .fetch_add((buf.filled().len() - before) as u64, Ordering::Relaxed);
        }
        this.moved.failed(this.side, &r);
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<'_, T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut *this.io).poll_write(cx, data);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            this.moved.now();
        }
        this.moved.failed(this.side, &r);
        r
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut *this.io).poll_flush(cx);
        this.moved.failed(this.side, &r);
        r
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut *this.io).poll_shutdown(cx);
        this.moved.failed(this.side, &r);
        r
    }
}

/// The bytes read from each side of a tunnel so far (the client's, passed up, and the
/// upstream's, passed down; a last read's bytes may not all have been written when it
/// failed), counted as they move.
#[derive(Debug, Default)]
pub struct Counts {
    pub from_client: AtomicU64,
    pub from_upstream: AtomicU64,
}

/// A tunnel's exchange: the bytes it carried reach its recorder however the tunnel ends,
/// its task dropped at the end of the grace period included (the recorder then says
/// `shutdown`, with what the tunnel carried, not none of it).
pub struct Exchange {
    pub rec: ExchangeRecorder,
    pub counts: Counts,
}

impl Exchange {
    pub fn new(rec: ExchangeRecorder) -> Exchange {
        Exchange {
            rec,
            counts: Counts::default(),
        }
    }

    /// Adds the bytes counted so far to the recorder (once: the counts start again).
    pub fn take_bytes(&mut self) {
        self.rec
            .add_bytes_out(self.counts.from_upstream.swap(0, Ordering::Relaxed));
        self.rec
            .add_bytes_in(self.counts.from_client.swap(0, Ordering::Relaxed));
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        self.take_bytes();
    }
}

/// Copies between `client` and `upstream` until both ends are done, or either fails, or no
/// byte moved either way for `idle` (`TimedOut`), counting the bytes read from each side
/// in `counts`. Returns the error that ended it, if one did, with where it came from.
pub async fn run<A, B>(
    client: &mut A,
    upstream: &mut B,
    idle: Duration,
    counts: &Counts,
) -> Option<(Side, io::Error)>
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let moved = Moved {
        since: Instant::now(),
        last_ms: AtomicU64::new(0),
        failed: AtomicU8::new(0),
    };
    let mut a = Watched {
        io: client,
        moved: &moved,
        side: Side::Client,
        read: &counts.from_client,
    };
    let mut b = Watched {
        io: upstream,
        moved: &moved,
        side: Side::Upstream,
        read: &counts.from_upstream,
    };
    {
        let copy = tokio::io::copy_bidirectional(&mut a, &mut b);
        let mut copy = std::pin::pin!(copy);
        let timer = tokio::time::sleep_until(moved.idle_until(idle));
        let mut timer = std::pin::pin!(timer);
        loop {
            tokio::select! {
                done = &mut copy => break done.err().map(|e| {
                    // (An error reaches `copy_bidirectional` only through one of the two.)
                    let side = match moved.failed.load(Ordering::Relaxed) {
                        2 => Side::Upstream,
                        _ => Side::Client,
                    };
                    (side, e)
                }),
                () = &mut timer => {
                    let until = moved.idle_until(idle);
                    if until <= Instant::now() {
                        break Some((Side::Idle, io::Error::new(
                            io::ErrorKind::TimedOut,
                            "no bytes either way for the idle timeout",
                        )));
                    }
                    timer.as_mut().reset(until);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A tunnel with traffic stays up past the idle timeout; one silent for it ends.
    #[tokio::test(start_paused = true)]
    async fn a_silent_tunnel_ends_after_the_idle_timeout_and_a_busy_one_does_not() {
        let (mut client, mut client_far) = tokio::io::duplex(64);
        let (mut upstream, mut upstream_far) = tokio::io::duplex(64);
        let idle = Duration::from_secs(10);
        let tunnel = tokio::spawn(async move {
            let counts = Counts::default();
            let error = run(&mut client, &mut upstream, idle, &counts).await;
            (error, counts)
        });
        // Traffic every 4 s for 20 s, past two idle timeouts.
        for i in 0..5u8 {
            tokio::time::sleep(Duration::from_secs(4)).await;
            client_far.write_all(&[i]).await.expect("write");
            let mut got = [0u8; 1];
            upstream_far.read_exact(&mut got).await.expect("read");
            assert_eq!(got[0], i);
        }
        assert!(!tunnel.is_finished(), "a tunnel with traffic stays up");
        tokio::time::sleep(Duration::from_secs(11)).await;
        let (error, counts) = tunnel.await.expect("task");
        let (side, e) = error.expect("a silent tunnel ends");
        assert_eq!((side, e.kind()), (Side::Idle, io::ErrorKind::TimedOut));
        // What moved is counted however it ended.
        let read = |c: &AtomicU64| c.load(Ordering::Relaxed);
        assert_eq!(
            (read(&counts.from_client), read(&counts.from_upstream)),
            (5, 0)
        );
    }
}

#[cfg(test)]
mod sides {
    use tokio::io::AsyncWriteExt;

    use super::*;

    /// A side whose write fails.
    struct Broken;

    impl AsyncRead for Broken {
        fn poll_read(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            _: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Poll::Pending
        }
    }

    impl AsyncWrite for Broken {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            _: &[u8],
        ) -> Poll<io::Result<usize>> {
            Poll::Ready(Err(io::ErrorKind::ConnectionReset.into()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    /// The side whose socket failed is the one named, whichever side's bytes were moving.
    #[tokio::test]
    async fn the_failing_side_is_named() {
        let idle = Duration::from_secs(60);
        // The client sends; writing it up to the upstream fails.
        let (mut client, mut client_far) = tokio::io::duplex(64);
        client_far.write_all(b"up").await.expect("write");
        let ended = run(&mut client, &mut Broken, idle, &Counts::default()).await;
        assert_eq!(ended.map(|(s, _)| s), Some(Side::Upstream));
        // The upstream sends; writing it down to the client fails.
        let (mut upstream, mut upstream_far) = tokio::io::duplex(64);
        upstream_far.write_all(b"down").await.expect("write");
        let ended = run(&mut Broken, &mut upstream, idle, &Counts::default()).await;
        assert_eq!(ended.map(|(s, _)| s), Some(Side::Client));
    }
}
