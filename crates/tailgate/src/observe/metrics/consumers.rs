//! Per-consumer series: the one set of series that grows while the gateway runs (100k+
//! consumers in a real deployment), so it is built to cost the data plane nothing more
//! than a map lookup on its own thread.
//!
//! - The worker finds a consumer's cell in a map that only its own thread ever locks (the
//!   lock is uncontended; the renderer never takes it). The map is sized for
//!   `max_consumers` when the config loads, so it never rehashes under a request, and it
//!   hashes with foldhash (seeded, several times cheaper than SipHash on short keys).
//! - A new consumer's cell is pushed to an append-only, lock-free list (`boxcar`, chosen
//!   because a reader on another thread can walk it while the worker appends, with no lock
//!   and no copy); cells are never moved or removed, so the renderer reads them in place.
//! - Past `max_consumers` (per worker), requests count under one `_other` consumer and
//!   `tailgate_metrics_consumers_overflow_total`, so cardinality stays bounded.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use super::histogram::Histogram;
use super::{CLASSES, escape_label};

/// The consumer that requests past the table's limit are counted as.
pub const OVERFLOW: &str = "_other";

/// Longest consumer name kept; longer values are cut (at a character boundary).
const MAX_NAME: usize = 128;

/// The counters of one consumer on one worker.
#[derive(Debug)]
pub struct ConsumerCell {
    /// The escaped label value.
    pub label: Box<str>,
    pub requests: [AtomicU64; CLASSES.len()],
    pub bytes_out: AtomicU64,
    pub latency: Histogram,
}

impl ConsumerCell {
    fn new(label: Box<str>) -> ConsumerCell {
        ConsumerCell {
            label,
            requests: Default::default(),
            bytes_out: AtomicU64::new(0),
            latency: Histogram::default(),
        }
    }

    fn record(&self, class: usize, bytes_out: u64, total: Duration) {
        self.requests[class].fetch_add(1, Ordering::Relaxed);
        self.bytes_out.fetch_add(bytes_out, Ordering::Relaxed);
        self.latency.record(total);
    }
}

#[derive(Debug)]
pub struct Consumers {
    max: usize,
    /// Locked only by the owning worker's thread.
    index: Mutex<HashMap<Box<[u8]>, usize, foldhash::fast::RandomState>>,
    pub cells: boxcar::Vec<ConsumerCell>,
    pub overflow: ConsumerCell,
    /// Requests counted under `_other` because the table was full.
    pub overflowed: AtomicU64,
}

impl Consumers {
    pub fn new(max: usize) -> Consumers {
        Consumers {
            max,
            index: Mutex::new(HashMap::with_capacity_and_hasher(
                max,
                foldhash::fast::RandomState::default(),
            )),
            cells: boxcar::Vec::new(),
            overflow: ConsumerCell::new(OVERFLOW.into()),
            overflowed: AtomicU64::new(0),
        }
    }

    pub fn record(&self, name: &[u8], class: usize, bytes_out: u64, total: Duration) {
        // A client cannot take the overflow row's name for a consumer of its own.
        if name == OVERFLOW.as_bytes() {
            self.overflow.record(class, bytes_out, total);
            return;
        }
        // Keyed by the name as its label shows it (lossy UTF-8, cut to `MAX_NAME`): what the
        // table keeps per consumer is bounded whatever a client sends (a 16 KiB header value
        // is not kept whole), and two values with one label are one consumer, one series.
        // No allocation for a valid UTF-8 name.
        let text = shown(name);
        let key = cut(&text).as_bytes();
        let mut index = self.index.lock().unwrap_or_else(PoisonError::into_inner);
        let cell = match index.get(key) {
            Some(&i) => self.cells.get(i),
            None if index.len() < self.max => {
                let i = self
                    .cells
                    .push(ConsumerCell::new(escape_label(cut(&text)).into()));
                index.insert(key.into(), i);
                self.cells.get(i)
            }
            None => None,
        };
        drop(index);
        match cell {
            Some(c) => c.record(class, bytes_out, total),
            None => {
                self.overflowed.fetch_add(1, Ordering::Relaxed);
                self.overflow.record(class, bytes_out, total);
            }
        }
    }
}

/// A header value as text: lossy UTF-8 of its first bytes (a few past the cut are enough to
/// cut at a character boundary).
fn shown(name: &[u8]) -> std::borrow::Cow<'_, str> {
    String::from_utf8_lossy(&name[..name.len().min(MAX_NAME + 4)])
}

/// A header value as a label value: lossy UTF-8, cut to [`MAX_NAME`] bytes, escaped.
#[cfg(test)]
fn label_of(name: &[u8]) -> String {
    escape_label(cut(&shown(name)))
}

/// `s` cut to at most [`MAX_NAME`] bytes, at a character boundary.
fn cut(s: &str) -> &str {
    let mut end = s.len().min(MAX_NAME);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_bounded_and_overflow_is_counted() {
        let c = Consumers::new(2);
        for name in [&b"a"[..], b"b", b"a", b"c", b"d"] {
            c.record(name, 1, 10, Duration::from_millis(1));
        }
        assert_eq!(c.cells.count(), 2);
        assert_eq!(c.overflowed.load(Ordering::Relaxed), 2);
        let a = c.cells.get(0).expect("a");
        assert_eq!(&*a.label, "a");
        assert_eq!(a.requests[1].load(Ordering::Relaxed), 2);
        assert_eq!(label_of(b"x\"y"), "x\\\"y");
        assert_eq!(label_of(&[b'z'; 300]).len(), MAX_NAME);
    }

    /// Names that show as one label are one consumer: long values that differ only past
    /// the cut, and invalid UTF-8 that reads the same. The table keeps the cut key only.
    #[test]
    fn one_label_is_one_consumer() {
        let c = Consumers::new(10);
        let mut long_a = vec![b'k'; MAX_NAME];
        long_a.extend_from_slice(&[b'a'; 15_000]);
        let mut long_b = vec![b'k'; MAX_NAME];
        long_b.extend_from_slice(b"b");
        for name in [&long_a[..], &long_b[..], b"x\xff", b"x\xfe"] {
            c.record(name, 1, 10, Duration::from_millis(1));
        }
        assert_eq!(c.cells.count(), 2);
        let index = c.index.lock().unwrap_or_else(PoisonError::into_inner);
        assert!(index.keys().all(|k| k.len() <= MAX_NAME));
        let labels: Vec<&str> = c.cells.iter().map(|(_, cell)| &*cell.label).collect();
        assert_eq!(labels, [&"k".repeat(MAX_NAME)[..], "x\u{fffd}"]);
        assert_eq!(
            c.cells
                .get(0)
                .map(|a| a.requests[1].load(Ordering::Relaxed)),
            Some(2)
        );
    }
}
