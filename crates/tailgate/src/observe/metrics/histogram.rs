//! A latency histogram the data plane records into with two relaxed atomic adds and no lock.
//!
//! prometheus-client's `Histogram::observe` takes a lock per observation (see CRATES.md), so
//! this one is ours: fixed bucket bounds, one counter per bucket (not cumulative; the
//! renderer accumulates), a sum in nanoseconds and nothing else. Each worker owns its own
//! histograms, so the counters are not even contended between threads.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the latency buckets, in microseconds (the `+Inf` bucket follows them).
pub const LATENCY_BOUNDS_US: [u64; 16] = [
    100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000,
    1_000_000, 2_500_000, 5_000_000, 10_000_000,
];

const LATENCY_BOUNDS_NS: [u64; 16] = {
    let mut ns = [0; 16];
    let mut i = 0;
    while i < 16 {
        ns[i] = LATENCY_BOUNDS_US[i] * 1000;
        i += 1;
    }
    ns
};

/// Buckets: one per bound plus `+Inf`.
pub const BUCKETS: usize = LATENCY_BOUNDS_US.len() + 1;

#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; BUCKETS],
    sum_ns: AtomicU64,
}

/// A copy of a histogram's counters, for rendering (sums of several histograms add up).
#[derive(Debug, Clone, Copy, Default)]
pub struct Snapshot {
    pub buckets: [u64; BUCKETS],
    pub sum_ns: u64,
}

impl Snapshot {
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    pub fn add(&mut self, other: &Snapshot) {
        for (a, b) in self.buckets.iter_mut().zip(other.buckets.iter()) {
            *a += b;
        }
        // Wraps like the per-worker counter it adds up (a reader sees a counter reset).
        self.sum_ns = self.sum_ns.wrapping_add(other.sum_ns);
    }
}

impl Histogram {
    pub fn record(&self, d: Duration) {
        let ns = d.as_nanos().min(u128::from(u64::MAX)) as u64;
        // 16 bounds: a binary search is as fast as anything cleverer.
        let i = LATENCY_BOUNDS_NS.partition_point(|&b| b < ns);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> Snapshot {
        let mut s = Snapshot::default();
        for (o, b) in s.buckets.iter_mut().zip(self.buckets.iter()) {
            *o = b.load(Ordering::Relaxed);
        }
        s.sum_ns = self.sum_ns.load(Ordering::Relaxed);
        s
    }

    pub fn add_to(&self, s: &mut Snapshot) {
        for (o, b) in s.buckets.iter_mut().zip(self.buckets.iter()) {
            *o += b.load(Ordering::Relaxed);
        }
        s.sum_ns = s.sum_ns.wrapping_add(self.sum_ns.load(Ordering::Relaxed));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_land_in_the_first_bucket_at_or_above_them() {
        let h = Histogram::default();
        h.record(Duration::from_micros(100)); // le=0.0001
        h.record(Duration::from_nanos(100_001)); // le=0.00025 (not rounded down into 0.0001)
        h.record(Duration::from_secs(11)); // +Inf
        let s = h.snapshot();
        assert_eq!(s.buckets[0], 1);
        assert_eq!(s.buckets[1], 1);
        assert_eq!(s.buckets[BUCKETS - 1], 1);
        assert_eq!(s.count(), 3);
        assert_eq!(s.sum_ns, 11_000_200_001);
    }

    /// The sum of nanoseconds wraps (about 584 years of request time in all, reachable by
    /// long-lived streams summed over workers) without a panic when workers are added up.
    #[test]
    fn sums_wrap_when_added_up() {
        let (a, b) = (Histogram::default(), Histogram::default());
        a.record(Duration::from_nanos(u64::MAX / 2 + 1));
        b.record(Duration::from_nanos(u64::MAX / 2 + 2));
        let mut s = a.snapshot();
        b.add_to(&mut s);
        assert_eq!(s.sum_ns, 1);
        let mut t = a.snapshot();
        t.add(&b.snapshot());
        assert_eq!(t.sum_ns, 1);
        assert_eq!(t.count(), 2);
    }
}
