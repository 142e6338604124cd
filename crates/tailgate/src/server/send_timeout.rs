//! A client that stops reading: when the connection has bytes to send and the client takes
//! none for `timeout`, writing fails, so a reader that never reads cannot hold the
//! connection (and its upstream connection, and shutdown) forever. nginx's `send_timeout`.
//!
//! It wraps the TCP stream itself, under TLS and under both HTTP versions, because a stalled
//! write is a property of the socket, not of the protocol above it.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

pub struct SendTimeout<T> {
    inner: T,
    timeout: Duration,
    /// Armed at the first write that could not proceed; cleared by any write that does.
    deadline: Option<Pin<Box<Sleep>>>,
}

impl<T> SendTimeout<T> {
    pub fn new(inner: T, timeout: Duration) -> Self {
        SendTimeout {
            inner,
            timeout,
            deadline: None,
        }
    }

    fn on_write<R>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        if r.is_ready() {
            self.deadline = None;
            return r;
        }
        let timeout = self.timeout;
        let d = self
            .deadline
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match d.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "client took no bytes in time",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for SendTimeout<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for SendTimeout<T> {
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
