//! Open-loop scheduling: when each request is intended to start, and waking the connection
//! that sends it at that moment — precisely, because every request is charged from its
//! intended start (wrk2 semantics), so any lateness of the generator is charged to the
//! target.
//!
//! Each generator thread runs [`ring`] beside its connections: a loop over the thread's share
//! of the schedule that sleeps on a one-shot `timerfd` (nanosecond resolution, registered with
//! the thread's tokio reactor) until the next intended start, then rings that connection's
//! bell (a [`Notify`]). The thread's timer slack is lowered to 1 µs so the kernel does not
//! defer the wake-up by its default 50 µs. When the loop falls behind (sends closer together
//! than a wake-up) it rings every due bell without sleeping, so the schedule never drifts;
//! the residual lateness is recorded as generator lag.
//!
//! Why not the alternatives (measured at 5000 requests/s, 50 connections, generator pinned to
//! one core of a shared, noisy 2-core VM, against `tailgate bench upstream` on the other core;
//! CPU is the generator's user+sys time over the run):
//! - tokio's `sleep_until`: its timer wheel has 1 ms granularity (deadlines round up to the
//!   next millisecond, and the runtime parks in `epoll_wait` with a millisecond timeout), so
//!   sends start 0–2 ms late: median generator lag 1.0–1.2 ms, which charging from the
//!   intended start adds to every request. 16–18 % CPU.
//! - tokio sleep to 2 ms before, then spin (`yield_now` until `Instant::now()` passes): lag
//!   ~1 µs, but 73–96 % CPU — at 5000 requests/s some connection is almost always inside its
//!   spin window, so it is a whole core.
//! - a separate metronome thread sleeping with `nanosleep` and waking connections across
//!   threads: median lag 0.11–0.28 ms, 41–49 % CPU, and a second thread competing for the
//!   generator's pinned core.
//! - this (`timerfd` on the generator thread): median lag 0.06–0.15 ms, 39–48 % CPU. The cost
//!   over tokio timers is one timer wake-up per request instead of one per millisecond.
//!
//! Evenly spaced sends are also harder on the target than tokio's 1 ms bursts (one wake-up
//! per request there too), which is what a constant arrival rate means.

use std::num::NonZeroU64;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::thread::set_current_timer_slack;
use rustix::time::{
    Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags, Timespec, timerfd_create,
    timerfd_settime,
};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;

/// Timer slack for generator threads, in nanoseconds.
const TIMER_SLACK_NS: u64 = 1_000;

/// The intended start of every open-loop request: request `j` of the run (all connections
/// together) at `start + j/R`. Connection `k` of `C` sends requests `k, k+C, k+2C, ...`, so
/// each connection alone runs at `R/C` and together they arrive at a constant rate `R`.
/// Computed from `j` (never accumulated), so the schedule does not drift.
#[derive(Clone, Copy, Debug)]
pub struct Schedule {
    pub start: Instant,
    pub rate: f64,
}

impl Schedule {
    pub fn at(&self, j: u64) -> Instant {
        self.start + Duration::from_secs_f64(j as f64 / self.rate)
    }
}

/// One bell per connection, rung by [`ring`] at each of that connection's intended starts. A ring while the connection is busy is kept (one permit), so it is never lost.
pub type Bells = Arc<[Notify]>;

pub fn bells(connections: usize) -> Bells {
    (0..connections).map(|_| Notify::new()).collect()
}

/// Waits until `intended`, woken by [`ring`]; returns at once when it has passed (the
/// connection was busy with the previous request, or the generator is behind).
pub async fn wait_until(bell: &Notify, intended: Instant) {
    while Instant::now() < intended {
        bell.notified().await;
    }
}

/// Rings, at each intended start of the given connections' requests, that connection's bell;
/// ends (returns) at `end`. Run on the generator thread beside its connections.
pub async fn ring(schedule: Schedule, bells: &[Notify], mine: &[usize], end: Option<Instant>) {
    let mut timer = match Timer::new() {
        Ok(t) => Some(t),
        Err(e) => {
            eprintln!(
                "tailgate bench: no precise timer ({e}); scheduling on tokio's 1 ms timer, \
                 which adds up to ~1 ms of generator lag to every request"
            );
            None
        }
    };
    let c = bells.len() as u64;
    for round in 0u64.. {
        for &k in mine {
            let due = schedule.at(round * c + k as u64);
            if end.is_some_and(|e| due >= e) {
                return;
            }
            if let Some(t) = &timer
                && let Err(e) = t.sleep_until(due).await
            {
                eprintln!("tailgate bench: precise timer failed ({e}); using tokio's timer");
                timer = None;
            }
            if timer.is_none() {
                tokio::time::sleep_until(due.into()).await;
            }
            bells[k].notify_one();
        }
    }
}

/// A one-shot `timerfd` (nanosecond resolution) registered with the runtime's reactor.
struct Timer {
    fd: AsyncFd<OwnedFd>,
}

impl Timer {
    fn new() -> std::io::Result<Timer> {
        // Let the kernel wake this thread within a few µs of a deadline instead of the default
        // 50 µs slack (it coalesces wake-ups to save power, which costs precision here).
        let _ = set_current_timer_slack(NonZeroU64::new(TIMER_SLACK_NS));
        let fd = timerfd_create(
            TimerfdClockId::Monotonic,
            TimerfdFlags::NONBLOCK | TimerfdFlags::CLOEXEC,
        )?;
        // `with_interest` is deprecated (tokio#8587) because an arbitrary `AsRawFd` could hand
        // the reactor a different or closed descriptor later; an `OwnedFd` owned by the
        // `AsyncFd` is the same open descriptor for the `AsyncFd`'s whole life, which is the
        // contract of its `unsafe` replacement (and `unsafe_code` is forbidden here).
        #[allow(deprecated)]
        let fd = AsyncFd::with_interest(fd, Interest::READABLE)?;
        Ok(Timer { fd })
    }

    async fn sleep_until(&self, due: Instant) -> std::io::Result<()> {
        loop {
            let now = Instant::now();
            if now >= due {
                return Ok(());
            }
            let d = due - now;
            let value = Itimerspec {
                it_interval: Timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                },
                it_value: Timespec {
                    tv_sec: d.as_secs() as i64,
                    tv_nsec: i64::from(d.subsec_nanos()),
                },
            };
            timerfd_settime(self.fd.get_ref(), TimerfdTimerFlags::empty(), &value)?;
            let mut ready = self.fd.readable().await?;
            let mut expirations = [0u8; 8];
            match rustix::io::read(self.fd.get_ref(), &mut expirations) {
                Ok(_) | Err(rustix::io::Errno::AGAIN) => ready.clear_ready(),
                Err(e) => return Err(e.into()),
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn schedule_is_computed_not_accumulated() {
        let start = Instant::now();
        let s = Schedule { start, rate: 3.0 };
        assert_eq!(s.at(0), start);
        assert_eq!(s.at(3), start + Duration::from_secs(1));
        assert_eq!(s.at(3_000_000), start + Duration::from_secs(1_000_000));
    }

    /// A generator thread with connections 0 and 2 of 3: each of its bells is rung for that
    /// connection's share of the schedule, never before its time (checked by the waiter), and
    /// the ringing ends by itself at `end`.
    #[test]
    fn rings_each_of_its_connections_in_turn_and_ends() {
        let start = Instant::now() + Duration::from_millis(5);
        let schedule = Schedule {
            start,
            rate: 1000.0,
        };
        let b = bells(3);
        let end = schedule.at(30);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let waiters = futures_util::future::join_all([0u64, 2].map(|k| {
            let b = b.clone();
            async move {
                let mut n = 0;
                for i in 0..10 {
                    let intended = schedule.at(k + 3 * i);
                    wait_until(&b[k as usize], intended).await;
                    assert!(Instant::now() >= intended);
                    n += 1;
                }
                n
            }
        }));
        let ((), woke) = rt.block_on(async {
            futures_util::future::join(ring(schedule, &b, &[0, 2], Some(end)), waiters).await
        });
        assert_eq!(woke, vec![10, 10]);
    }
}
