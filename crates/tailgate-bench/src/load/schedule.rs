//! Open-loop scheduling: when each request is intended to start, and waking the connection
//! that sends it at that moment — precisely, because every request is charged from its
//! intended start (wrk2 semantics) and any lateness of the generator would be charged to the
//! target.
//!
//! Why a metronome thread and not tokio timers: tokio's timer wheel has 1 ms granularity
//! (deadlines are rounded up to the next millisecond and the runtime parks in `epoll_wait`
//! with a millisecond timeout), so a send scheduled with `sleep_until` starts 0–1 ms late,
//! which would add ~0.5 ms to every corrected latency. Spinning to close that gap (sleep with
//! tokio until ~1 ms before, then poll `Instant::now()`) costs a whole core as soon as sends
//! are less than ~1 ms apart, i.e. from ~1000 requests/s on. Instead one plain OS thread per
//! run sleeps with `std::thread::sleep` (`nanosleep`, microsecond precision; Linux's default
//! timer slack makes it ~50–100 µs late) until the next intended start, rings that
//! connection's bell (a [`tokio::sync::Notify`]: an atomic, plus an eventfd write when the
//! generator thread is parked), and sleeps again. Nothing spins: at 5000 requests/s it is
//! 5000 short sleeps and wake-ups a second. When the metronome falls behind (sends closer
//! together than a `nanosleep` round trip) it rings every due bell without sleeping, so it
//! never drifts; the residual lateness is recorded as generator lag.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// Longest single sleep, so a stopped run ends its metronome promptly even at tiny rates.
const MAX_NAP: Duration = Duration::from_millis(50);

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

/// One bell per connection, rung by the metronome at each of that connection's intended
/// starts. A ring while the connection is busy is kept (one permit), so it is never lost.
pub type Bells = Arc<[Notify]>;

pub fn bells(connections: usize) -> Bells {
    (0..connections).map(|_| Notify::new()).collect()
}

/// Waits until `intended`, woken by the metronome; returns at once when it has passed (the
/// connection was busy with the previous request, or the generator is behind).
pub async fn wait_until(bell: &Notify, intended: Instant) {
    while Instant::now() < intended {
        bell.notified().await;
    }
}

/// The metronome thread; stopped and joined on drop.
pub struct Metronome {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Metronome {
    /// Rings `bells[j % C]` at `schedule.at(j)` for `j = 0, 1, ...` until `end` (exclusive)
    /// or until dropped.
    pub fn start(
        schedule: Schedule,
        bells: Bells,
        end: Option<Instant>,
    ) -> std::io::Result<Metronome> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("bench-metronome".into())
            .spawn(move || ring(schedule, &bells, end, &flag))?;
        Ok(Metronome {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Metronome {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn ring(schedule: Schedule, bells: &[Notify], end: Option<Instant>, stop: &AtomicBool) {
    let c = bells.len() as u64;
    if c == 0 {
        return;
    }
    let mut j = 0u64;
    loop {
        let due = schedule.at(j);
        if end.is_some_and(|e| due >= e) {
            return;
        }
        loop {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            let now = Instant::now();
            if now >= due {
                break;
            }
            std::thread::sleep((due - now).min(MAX_NAP));
        }
        bells[(j % c) as usize].notify_one();
        j += 1;
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

    /// Every bell is rung for its share of the schedule, never before its time, and the
    /// metronome ends by itself at `end`.
    #[test]
    fn metronome_rings_each_connection_in_turn_and_never_early() {
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
        let _m = Metronome::start(schedule, b.clone(), Some(end)).unwrap();
        let woke = rt.block_on(futures_util::future::join_all((0..3u64).map(|k| {
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
        })));
        assert_eq!(woke, vec![10, 10, 10]);
    }
}
