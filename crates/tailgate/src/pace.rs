//! [`Every`]: something done at most once per interval, whichever thread asks (a warning
//! that would otherwise repeat on every retry, a re-resolution every failed request asks
//! for). Lock-free: one atomic, taken by compare-and-swap.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// At most once per `interval`.
#[derive(Debug)]
pub struct Every {
    epoch: Instant,
    interval_ms: u64,
    /// When it was last done (ms since `epoch`, +1; 0: never).
    last_ms: AtomicU64,
}

impl Every {
    pub fn new(interval: Duration) -> Every {
        Every {
            epoch: Instant::now(),
            interval_ms: u64::try_from(interval.as_millis()).unwrap_or(u64::MAX),
            last_ms: AtomicU64::new(0),
        }
    }

    /// Whether it may be done now (and then it counts as done): the first time, and then
    /// once `interval` has passed since the last. Of callers at the same moment, one wins.
    pub fn due(&self) -> bool {
        let now = u64::try_from(self.epoch.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .saturating_add(1);
        let last = self.last_ms.load(Ordering::Relaxed);
        (last == 0 || now.saturating_sub(last) >= self.interval_ms)
            && self
                .last_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (No assertion depends on how fast the thread runs: "not due" is checked against an
    /// hour, "due again" after sleeping past the interval.)
    #[test]
    fn due_once_per_interval() {
        let hour = Every::new(Duration::from_secs(3600));
        assert!(hour.due());
        assert!(!hour.due());
        assert!(!hour.due());
        let short = Every::new(Duration::from_millis(20));
        assert!(short.due());
        std::thread::sleep(Duration::from_millis(30));
        assert!(short.due());
        std::thread::sleep(Duration::from_millis(30));
        assert!(short.due());
    }
}
