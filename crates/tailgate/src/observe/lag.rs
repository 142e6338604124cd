//! The runtime lag probe (seed 002: a starved scheduler got fly-proxy killed by its systemd
//! watchdog). Each worker runs one task that asks to be woken every `interval` and records
//! how late it actually ran: a worker blocked or overloaded for 300 ms shows up as a 300 ms
//! observation, and its last tick time goes stale (what `/healthz` and the watchdog check).
//!
//! Two timers, one interval apart, take turns. tokio wakes its own event loop through its
//! eventfd (a `write`, then an `epoll_wait` that returns at once) whenever a timer is armed
//! earlier than the loop's next planned wake-up. One timer re-armed after it fires is always
//! that earliest timer, so every tick cost those two extra system calls, on an idle worker
//! too. With two, the other one is still armed, earlier than the re-armed one, and nothing
//! is woken. An idle worker, 10 ms interval, `strace -c` over 5 s: 1,436 system calls with
//! one timer, 605 with two; and 100 ticks a second instead of 90, since a tick is no longer
//! re-armed from the moment it ran.

use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::{Instant, sleep_until};

use super::metrics::WorkerMetrics;

/// Runs on the worker's runtime for as long as the worker runs.
pub async fn probe(metrics: Arc<WorkerMetrics>, interval: Duration) {
    metrics.record_lag(Duration::ZERO);
    ticks(interval, |late| {
        metrics.record_lag(late);
        // The worker's log lines of the last tick go over to the log thread together.
        crate::logging::flush_batch();
    })
    .await;
}

/// Wakes every `interval` and reports how late each wake-up ran, forever.
async fn ticks(interval: Duration, mut record: impl FnMut(Duration)) {
    let start = Instant::now();
    let mut due = [start + interval, start + interval * 2];
    let mut timers = [pin!(sleep_until(due[0])), pin!(sleep_until(due[1]))];
    let mut last = start;
    for i in [0, 1].into_iter().cycle() {
        timers[i].as_mut().await;
        let now = Instant::now();
        // After a stall both are overdue: the first to run has recorded it, once.
        if due[i] > last {
            record(now.saturating_duration_since(due[i]));
        }
        last = now;
        // The other timer is due about one interval from now: this one goes one after it.
        due[i] = due[1 - i].max(now) + interval;
        timers[i].as_mut().reset(due[i]);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// On a paused clock: ticks at the interval with no lag; a 200 ms jump while the probe
    /// cannot run (a blocked worker) is one observation of about 195 ms, not one per timer;
    /// then ticks go on at the interval.
    #[tokio::test(start_paused = true)]
    async fn a_stall_is_recorded_once_and_ticks_go_on() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        let task = tokio::spawn(ticks(Duration::from_millis(10), move |late| {
            s.lock().unwrap().push(late);
        }));
        tokio::time::sleep(Duration::from_millis(55)).await;
        let before = seen.lock().unwrap().clone();
        tokio::time::advance(Duration::from_millis(200)).await;
        tokio::time::sleep(Duration::from_millis(55)).await;
        task.abort();
        let seen = seen.lock().unwrap().clone();
        let ms = Duration::from_millis;
        // Ticks at 10–50 ms; timers fire on whole milliseconds of the runtime's clock.
        assert_eq!(before.len(), 5, "{before:?}");
        assert!(before.iter().all(|d| *d < ms(2)), "{before:?}");
        let after = &seen[before.len()..];
        // The tick due at 60 ms ran at 255 ms; the one due at 70 ms is the same stall.
        assert!(after[0] >= ms(193) && after[0] <= ms(197), "{after:?}");
        assert!(after[1..].len() >= 4, "ticks after the stall: {after:?}");
        assert!(after[1..].iter().all(|d| *d < ms(2)), "{after:?}");
    }
}
