//! What a run records: latency histograms (HdrHistogram, microseconds), errors by kind,
//! latency by request index on a connection, and latency per second of the run.
//!
//! One [`Recorder`] lives on each generator thread (the thread's connections share it without
//! locks: each thread is one current-thread runtime); the thread recorders are merged once at
//! the end of a run.

use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

/// Largest latency a histogram tracks exactly, in microseconds (one hour); larger values are
/// clamped to it (they only occur with absurd timeouts).
const MAX_MICROS: u64 = 3_600_000_000;

/// The percentiles printed in a latency distribution, wrk2's list.
pub const PERCENTILES: [f64; 8] = [50.0, 75.0, 90.0, 99.0, 99.9, 99.99, 99.999, 100.0];

/// Why a request failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The TCP connection (or, over TLS, the handshake) could not be set up in time, or was
    /// refused.
    Connect,
    /// The TLS handshake failed: the certificate was rejected (unknown issuer, wrong name,
    /// expired; see `--insecure`) or the peer's TLS was unusable.
    Tls,
    /// No full response within the per-request timeout.
    Timeout,
    /// A response arrived with a status outside 2xx/3xx.
    Status,
    /// A read or write failed, or the peer closed the connection mid-exchange.
    Io,
    /// The response was not valid HTTP.
    Protocol,
}

/// Error counts by kind.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub struct Errors {
    pub connect: u64,
    pub tls: u64,
    pub timeout: u64,
    pub status: u64,
    pub io: u64,
    pub protocol: u64,
}

impl Errors {
    pub fn total(&self) -> u64 {
        self.connect + self.tls + self.timeout + self.status + self.io + self.protocol
    }

    pub fn count(&mut self, kind: ErrorKind) {
        match kind {
            ErrorKind::Connect => self.connect += 1,
            ErrorKind::Tls => self.tls += 1,
            ErrorKind::Timeout => self.timeout += 1,
            ErrorKind::Status => self.status += 1,
            ErrorKind::Io => self.io += 1,
            ErrorKind::Protocol => self.protocol += 1,
        }
    }

    fn add(&mut self, o: &Errors) {
        self.connect += o.connect;
        self.tls += o.tls;
        self.timeout += o.timeout;
        self.status += o.status;
        self.io += o.io;
        self.protocol += o.protocol;
    }
}

/// A latency histogram in microseconds.
pub fn new_histogram(sigfig: u8) -> Histogram<u64> {
    // 1 µs .. 1 h at 2 or 3 significant figures are valid bounds, so this cannot fail.
    Histogram::new_with_bounds(1, MAX_MICROS, sigfig).unwrap_or_else(|_| {
        Histogram::new(sigfig.min(5)).unwrap_or_else(|_| unreachable!("valid sigfig"))
    })
}

fn micros(d: Duration) -> u64 {
    (d.as_micros() as u64).clamp(1, MAX_MICROS)
}

/// Everything one generator thread (or, merged, one run) records.
#[derive(Debug)]
pub struct Recorder {
    /// Latency from each request's intended start (open loop; wrk2 semantics, every request)
    /// — the number that matters.
    pub corrected: Histogram<u64>,
    /// Latency from the moment the request was actually written (hides coordinated omission).
    pub uncorrected: Histogram<u64>,
    /// Open loop: the corrected latency without the generator's lag in sending (see `lag`):
    /// the uncorrected latency plus the time the request waited behind the previous exchange
    /// on its connection — still charged for coordinated omission, not for the generator
    /// sending late. A generator late in *reading* a response still counts, there and in the
    /// next request's wait. Closed loop: the same as `corrected`.
    pub excl_lag: Histogram<u64>,
    /// `by_index[i]`: corrected latency of the (i+1)-th request on a connection; requests past
    /// the last tracked index are not recorded here.
    pub by_index: Vec<Histogram<u64>>,
    /// `per_second[s]`: corrected latency of requests intended to start in second `s` of the
    /// measurement.
    pub per_second: Vec<Histogram<u64>>,
    /// Open loop: how long after it could have started (its intended start, or the end of the
    /// previous exchange on its connection if later) each request actually started — the
    /// generator's own delay (scheduling precision, or an overloaded generator). Part of the
    /// corrected latency; kept separately so an overloaded generator is visible.
    pub lag: Histogram<u64>,
    pub errors: Errors,
    /// Responses received (any status).
    pub responses: u64,
    /// Responses with a 2xx or 3xx status.
    pub ok: u64,
    max_index: usize,
}

impl Recorder {
    pub fn new(max_index: usize) -> Self {
        Self {
            corrected: new_histogram(3),
            uncorrected: new_histogram(3),
            excl_lag: new_histogram(3),
            by_index: Vec::new(),
            per_second: Vec::new(),
            lag: new_histogram(2),
            errors: Errors::default(),
            responses: 0,
            ok: 0,
            max_index,
        }
    }

    /// A recorder whose memory is all in place before the run: the by-index histograms for
    /// indices `1..=max_index` and the per-second ones for the first `seconds` seconds, every
    /// count written once so its pages are the process's. Allocating them as the indices and
    /// seconds first occur put page faults (on this kind of host, zeroing a fresh 2 MiB
    /// transparent huge page: 5–7 ms) on the generator thread in the middle of the
    /// measurement, about once a second, with requests queued behind them; and how many
    /// depended on how much memory the run before had left to reuse.
    pub fn ready(max_index: usize, seconds: usize) -> Self {
        let mut r = Self::new(max_index);
        let touched = |n| {
            (0..n)
                .map(|_| {
                    // black_box: the counts are not known to be zero, so the writes stay.
                    let mut h = std::hint::black_box(new_histogram(2));
                    h.reset();
                    h
                })
                .collect::<Vec<_>>()
        };
        r.by_index = touched(max_index);
        r.per_second = touched(seconds);
        for h in [
            &mut r.corrected,
            &mut r.uncorrected,
            &mut r.excl_lag,
            &mut r.lag,
        ] {
            std::hint::black_box(&mut *h).reset();
        }
        r
    }

    /// Drops the empty histograms at the end of `by_index` and `per_second` (those
    /// [`Recorder::ready`] made for indices and seconds the run never reached).
    pub fn trim(&mut self) {
        for v in [&mut self.by_index, &mut self.per_second] {
            while v.last().is_some_and(Histogram::is_empty) {
                v.pop();
            }
        }
    }

    /// Records one completed response. `excl_lag` is `corrected` less the generator's lag;
    /// `index` is 1-based on its connection; `second` is the second of the measurement the
    /// request was intended to start in.
    pub fn response(
        &mut self,
        ok: bool,
        corrected: Duration,
        uncorrected: Duration,
        excl_lag: Duration,
        index: u64,
        second: usize,
    ) {
        self.responses += 1;
        if ok {
            self.ok += 1;
        } else {
            self.errors.count(ErrorKind::Status);
        }
        let c = micros(corrected);
        self.corrected.saturating_record(c);
        self.uncorrected.saturating_record(micros(uncorrected));
        self.excl_lag.saturating_record(micros(excl_lag));
        if index >= 1 && (index as usize) <= self.max_index {
            let i = index as usize - 1;
            while self.by_index.len() <= i {
                self.by_index.push(new_histogram(2));
            }
            self.by_index[i].saturating_record(c);
        }
        while self.per_second.len() <= second {
            self.per_second.push(new_histogram(2));
        }
        self.per_second[second].saturating_record(c);
    }

    pub fn lag(&mut self, lag: Duration) {
        self.lag.saturating_record(micros(lag));
    }

    pub fn error(&mut self, kind: ErrorKind) {
        self.errors.count(kind);
    }

    /// Adds another recorder's data to this one.
    pub fn merge(&mut self, other: &Recorder) {
        // Histograms with identical bounds never fail to add; auto-resize covers the rest.
        let _ = self.corrected.add(&other.corrected);
        let _ = self.uncorrected.add(&other.uncorrected);
        let _ = self.excl_lag.add(&other.excl_lag);
        let _ = self.lag.add(&other.lag);
        merge_vec(&mut self.by_index, &other.by_index);
        merge_vec(&mut self.per_second, &other.per_second);
        self.errors.add(&other.errors);
        self.responses += other.responses;
        self.ok += other.ok;
    }
}

fn merge_vec(into: &mut Vec<Histogram<u64>>, from: &[Histogram<u64>]) {
    for (i, h) in from.iter().enumerate() {
        if into.len() <= i {
            into.push(new_histogram(2));
        }
        let _ = into[i].add(h);
    }
}

/// A latency value of a histogram in milliseconds.
pub fn ms_at(h: &Histogram<u64>, percentile: f64) -> f64 {
    if h.is_empty() {
        return 0.0;
    }
    let v = if percentile >= 100.0 {
        h.max()
    } else {
        h.value_at_percentile(percentile)
    };
    v as f64 / 1000.0
}

/// The summary used in scenario tables and JSON: p50, p90, p99, p99.9, p99.99, max (ms).
#[derive(Clone, Copy, Debug, Default, Serialize, serde::Deserialize, PartialEq)]
pub struct LatencySummary {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    #[serde(rename = "p99.9")]
    pub p99_9: f64,
    #[serde(rename = "p99.99")]
    pub p99_99: f64,
    pub max: f64,
}

impl LatencySummary {
    pub fn of(h: &Histogram<u64>) -> Self {
        Self {
            p50: ms_at(h, 50.0),
            p90: ms_at(h, 90.0),
            p99: ms_at(h, 99.0),
            p99_9: ms_at(h, 99.9),
            p99_99: ms_at(h, 99.99),
            max: ms_at(h, 100.0),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn merge_adds_everything() {
        let mut a = Recorder::new(4);
        let mut b = Recorder::new(4);
        a.response(
            true,
            Duration::from_millis(1),
            Duration::from_millis(1),
            Duration::from_millis(1),
            1,
            0,
        );
        b.response(
            false,
            Duration::from_millis(9),
            Duration::from_millis(2),
            Duration::from_millis(7),
            3,
            2,
        );
        b.response(
            true,
            Duration::from_millis(5),
            Duration::from_millis(5),
            Duration::from_millis(5),
            9,
            0,
        );
        b.error(ErrorKind::Connect);
        a.merge(&b);
        assert_eq!(a.responses, 3);
        assert_eq!(a.ok, 2);
        assert_eq!(a.errors.status, 1);
        assert_eq!(a.errors.connect, 1);
        assert_eq!(a.corrected.len(), 3);
        assert_eq!(a.excl_lag.len(), 3);
        let max = a.excl_lag.max();
        assert!(a.excl_lag.equivalent(max, 7_000), "7 ms in µs: {max}");
        assert_eq!(a.by_index.len(), 3);
        assert_eq!(a.by_index[0].len(), 1);
        assert_eq!(a.by_index[1].len(), 0);
        assert_eq!(a.by_index[2].len(), 1);
        assert_eq!(a.per_second.len(), 3);
        assert_eq!(a.per_second[0].len(), 2);
    }

    /// Recording allocates nothing once the recorder is ready: the histograms of the last
    /// index and the last second are already there, in the same memory.
    #[test]
    fn a_ready_recorder_records_without_allocating() {
        let mut r = Recorder::ready(8, 3);
        assert_eq!((r.by_index.len(), r.per_second.len()), (8, 3));
        let (bi, ps) = (r.by_index.as_ptr(), r.per_second.as_ptr());
        let ms = Duration::from_millis(1);
        r.response(true, ms, ms, ms, 8, 2);
        r.response(true, ms, ms, ms, 9, 2);
        assert_eq!((r.by_index.len(), r.per_second.len()), (8, 3));
        assert_eq!((r.by_index.as_ptr(), r.per_second.as_ptr()), (bi, ps));
        assert_eq!((r.by_index[7].len(), r.per_second[2].len()), (1, 2));
    }

    /// What `ready` made for indices and seconds the run never reached is dropped from the
    /// end, so reports see only what happened (empty ones in between stay).
    #[test]
    fn trim_drops_only_the_unreached_end() {
        let mut r = Recorder::ready(8, 5);
        let ms = Duration::from_millis(1);
        r.response(true, ms, ms, ms, 1, 0);
        r.response(true, ms, ms, ms, 3, 2);
        r.trim();
        assert_eq!(r.by_index.len(), 3);
        assert!(r.by_index[1].is_empty());
        assert_eq!(r.per_second.len(), 3);
        assert!(r.per_second[1].is_empty());
        let mut none = Recorder::ready(4, 2);
        none.trim();
        assert!(none.by_index.is_empty() && none.per_second.is_empty());
    }
}
