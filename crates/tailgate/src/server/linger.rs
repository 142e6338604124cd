//! The lingering close both HTTP/1 servers end a connection with, as nginx's
//! `lingering_close` does (RFC 9112 §9.6): after the last answer and a half-close, what the
//! client still sends (a refused request's body, an upload answered before it came, requests
//! pipelined behind a close) is read and dropped until it closes too, for a bounded time and
//! amount. Closing a socket with unread bytes in it sends a reset, and a client still
//! sending would see the reset instead of the answer.
//!
//! Written as a poll state so that hyper's path can run it inside its io's `poll_shutdown`
//! ([`super::h1_guard`]); the inline server awaits it ([`linger`]).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

use crate::pipeline::ConnInfo;

/// The longest a closing connection is read for what the client still sends.
const LINGER_TIME: Duration = Duration::from_secs(5);
/// The longest a read of it waits for more.
const LINGER_READ: Duration = Duration::from_secs(1);
/// The most it is read of.
const LINGER_BYTES: usize = 1 << 20;

/// What bounds a lingering close: its whole length, each read's wait, and the bytes read.
/// Made only when a connection closes (its timers are on the heap).
pub struct Linger {
    total: Pin<Box<Sleep>>,
    read: Pin<Box<Sleep>>,
    left: usize,
}

impl Linger {
    pub fn new() -> Linger {
        Linger {
            total: Box::pin(tokio::time::sleep(LINGER_TIME)),
            read: Box::pin(tokio::time::sleep(LINGER_READ)),
            left: LINGER_BYTES,
        }
    }

    /// Reads and drops what `io` still sends until it ends, fails, or a bound is reached.
    pub fn poll_drain<T: AsyncRead + Unpin>(
        &mut self,
        io: &mut T,
        cx: &mut Context<'_>,
    ) -> Poll<()> {
        let mut scratch = [0u8; 4096];
        loop {
            // Both timers are polled before each read, so a read left pending is woken by
            // either of them.
            if self.total.as_mut().poll(cx).is_ready() || self.read.as_mut().poll(cx).is_ready() {
                return Poll::Ready(());
            }
            let mut rb = ReadBuf::new(&mut scratch);
            match Pin::new(&mut *io).poll_read(cx, &mut rb) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(())) if !rb.filled().is_empty() && rb.filled().len() < self.left => {
                    self.left -= rb.filled().len();
                    let next = tokio::time::Instant::now() + LINGER_READ;
                    self.read.as_mut().reset(next);
                }
                Poll::Ready(_) => return Poll::Ready(()),
            }
        }
    }
}

/// The close of a connection whose server hands its io a `poll_shutdown` (hyper's, h2's):
/// the write side is shut, `info` is told the lingering close began, then the connection
/// lingers, its state kept in `linger` between polls.
pub fn poll_shutdown_lingering<T: AsyncRead + AsyncWrite + Unpin>(
    io: &mut T,
    linger: &mut Option<Linger>,
    info: Option<&ConnInfo>,
    cx: &mut Context<'_>,
) -> Poll<io::Result<()>> {
    if linger.is_none() {
        std::task::ready!(Pin::new(&mut *io).poll_shutdown(cx))?;
        *linger = Some(Linger::new());
        if let Some(info) = info {
            info.activity.set_lingering();
        }
    }
    if let Some(l) = linger {
        std::task::ready!(l.poll_drain(io, cx));
    }
    Poll::Ready(Ok(()))
}

/// Lingers on `io`, whose write side the caller has shut.
pub async fn linger<I: AsyncRead + Unpin>(io: &mut I) {
    let mut l = Linger::new();
    std::future::poll_fn(|cx| l.poll_drain(io, cx)).await;
}
