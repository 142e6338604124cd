//! An HTTP/2 stream whose client stopped taking its response data is reset on its own, as
//! nginx's `send_timeout` resets an HTTP/2 request: hyper's server waits for the stream's
//! flow-control window without polling the response body, so neither the body nor any
//! write of the connection sees the stall. Each stream hyper spawns runs inside
//! `Watched`, which learns from the response body ([`handed`], [`taken`]) when a piece is
//! waiting for the client, and drops the stream (h2 resets it with `CANCEL`, and its
//! upstream exchange ends) once a piece has waited `idle_timeout`. The connection's other
//! streams go on: one stream the client keeps reading no longer hides another it stopped
//! reading (the connection-wide check in [`crate::server`] only sees the connection as a
//! whole taking data).
//!
//! Written here, not found in a crate: it hooks hyper's executor, the one place a stream's
//! task can be observed and ended from outside hyper.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

tokio::task_local! {
    /// The stream whose task is being polled (set only around the poll of an HTTP/2
    /// stream's task).
    static STREAM: Arc<Waiting>;
}

/// When the stream's response body last handed the client a piece that it has not taken
/// since, and the route's total deadline then: ms from `epoch`, plus 1 (0: none).
struct Waiting {
    epoch: Instant,
    since_ms: AtomicU64,
    total_ms: AtomicU64,
}

impl Waiting {
    fn at(&self, ms: u64) -> Option<Instant> {
        (ms > 0).then(|| self.epoch + Duration::from_millis(ms - 1))
    }

    fn since(&self) -> Option<Instant> {
        self.at(self.since_ms.load(Ordering::Relaxed))
    }

    fn total(&self) -> Option<Instant> {
        self.at(self.total_ms.load(Ordering::Relaxed))
    }

    fn ms(&self, at: Instant) -> u64 {
        let ms = at.saturating_duration_since(self.epoch).as_millis();
        u64::try_from(ms).unwrap_or(u64::MAX - 1) + 1
    }
}

/// The response body being polled handed the client a piece, and waits to be asked for
/// the next; `total` is the route's total deadline, if any (a stream whose client keeps
/// its window shut is not polled, so the body cannot cut itself off at it). Outside an
/// HTTP/2 stream's task (HTTP/1), nothing but a thread-local check, paid per piece (one
/// for a one-piece answer).
pub fn handed(total: Option<Instant>) {
    let _ = STREAM.try_with(|w| {
        w.since_ms.store(w.ms(Instant::now()), Ordering::Relaxed);
        w.total_ms
            .store(total.map_or(0, |t| w.ms(t)), Ordering::Relaxed);
    });
}

/// The client took the piece (the body is asked for the next).
pub fn taken() {
    let _ = STREAM.try_with(|w| w.since_ms.store(0, Ordering::Relaxed));
}

/// The executor of hyper's HTTP/2 server: each stream's task runs in a `Watched`.
#[derive(Clone, Copy)]
pub struct StreamExec {
    /// How long a piece may wait for the client to take it (`server.idle_timeout`).
    pub idle: Duration,
}

impl<F> hyper::rt::Executor<F> for StreamExec
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, fut: F) {
        tokio::spawn(Watched {
            inner: Some(Box::pin(fut)),
            waiting: Arc::new(Waiting {
                epoch: Instant::now(),
                since_ms: AtomicU64::new(0),
                total_ms: AtomicU64::new(0),
            }),
            idle: self.idle,
            timer: None,
        });
    }
}

/// A stream's task, ended when a piece of its response has waited for the client for
/// `idle`.
struct Watched<F: Future> {
    /// The stream's task; `None` once it is ended here.
    inner: Option<Pin<Box<F>>>,
    waiting: Arc<Waiting>,
    idle: Duration,
    timer: Option<Pin<Box<Sleep>>>,
}

impl<F: Future> Future for Watched<F> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(());
        };
        if STREAM
            .sync_scope(this.waiting.clone(), || inner.as_mut().poll(cx))
            .is_ready()
        {
            return Poll::Ready(());
        }
        let Some(since) = this.waiting.since() else {
            return Poll::Pending;
        };
        // The idle time for the piece, or the route's total deadline if it comes first.
        let due = match this.waiting.total() {
            Some(total) => total.min(since + this.idle),
            None => since + this.idle,
        };
        let timer = match &mut this.timer {
            Some(t) => {
                if t.deadline() != due {
                    t.as_mut().reset(due);
                }
                t
            }
            None => this.timer.insert(Box::pin(tokio::time::sleep_until(due))),
        };
        if timer.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        tracing::debug!(
            "client took none of a stream's response data for the idle timeout (or until the route's total deadline); stream reset"
        );
        // Dropping the stream's task resets the stream; its upstream exchange ends with it,
        // recorded as the gateway's cut, not as a client that went away.
        let kind = if this.waiting.total() == Some(due) {
            "total_timeout"
        } else {
            "send_timeout"
        };
        crate::observe::ending_as(kind, || drop(this.inner.take()));
        Poll::Ready(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A task whose piece waits past `idle` is ended (and what it holds dropped); one that
    /// took its piece in time runs on; outside a stream's task the calls do nothing.
    #[tokio::test(start_paused = true)]
    async fn a_piece_left_waiting_ends_the_stream_alone() {
        handed(None);
        taken();
        let exec = StreamExec {
            idle: Duration::from_secs(1),
        };
        let (stalled_tx, stalled_rx) = tokio::sync::oneshot::channel::<()>();
        let (kept_tx, kept_rx) = tokio::sync::oneshot::channel::<()>();
        hyper::rt::Executor::execute(&exec, async move {
            let _held = stalled_tx;
            handed(None);
            std::future::pending::<()>().await;
        });
        hyper::rt::Executor::execute(&exec, async move {
            let _held = kept_tx;
            for _ in 0..10 {
                handed(None);
                tokio::time::sleep(Duration::from_millis(500)).await;
                taken();
            }
            handed(None);
            std::future::pending::<()>().await;
        });
        // The stalled task ends (its sender dropped) after the idle time.
        let t0 = tokio::time::Instant::now();
        assert!(stalled_rx.await.is_err());
        assert!(t0.elapsed() >= Duration::from_secs(1));
        // The other, taking each piece within the idle time, runs on.
        let mut kept_rx = kept_rx;
        assert!(
            tokio::time::timeout(Duration::from_secs(4), &mut kept_rx)
                .await
                .is_err(),
            "a stream that took its pieces was ended"
        );
        // Left waiting at last, it is ended too.
        assert!(kept_rx.await.is_err());
    }

    /// A piece waiting past the route's total deadline ends the stream then, before its
    /// idle time.
    #[tokio::test(start_paused = true)]
    async fn a_total_deadline_before_the_idle_time_ends_the_stream_then() {
        let exec = StreamExec {
            idle: Duration::from_secs(60),
        };
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let total = Instant::now() + Duration::from_secs(2);
        hyper::rt::Executor::execute(&exec, async move {
            let _held = tx;
            handed(Some(total));
            std::future::pending::<()>().await;
        });
        let t0 = Instant::now();
        assert!(rx.await.is_err());
        let took = t0.elapsed();
        assert!(
            took >= Duration::from_secs(2) && took < Duration::from_secs(60),
            "{took:?}"
        );
    }
}
