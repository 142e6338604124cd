//! Choosing an endpoint: power of two choices over peak-EWMA latency with an in-flight
//! penalty (as linkerd2-proxy does), or round-robin; and passive outlier detection, which
//! ejects an endpoint after consecutive failures and lets it back after a backoff.
//!
//! All state is per endpoint and per worker, in atomics only this worker's thread touches.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long a latency sample weighs: the EWMA decays with this time constant.
const DECAY: Duration = Duration::from_secs(10);
/// The cost of an endpoint with no samples yet (so new endpoints are tried, not flooded).
const DEFAULT_RTT: Duration = Duration::from_millis(1);
/// The latency a failure counts as, at least (see [`InFlight::failed`]): against healthy
/// endpoints of a few milliseconds it decays back within about 40 s (τ = [`DECAY`]).
const FAILURE_SAMPLE: Duration = Duration::from_millis(100);
/// The most a failure adds to the estimate it started with.
const FAILURE_CAP: Duration = Duration::from_secs(1);
/// The longest an endpoint stays ejected, however often it failed (or its cluster's
/// `eject_duration`, when that is longer: the first ejection is never cut short).
const MAX_EJECTION: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Balance {
    P2c,
    RoundRobin,
}

/// Load and health of one endpoint.
#[derive(Debug)]
pub struct EndpointLoad {
    epoch: Instant,
    in_flight: AtomicU32,
    /// Peak-EWMA round-trip in nanoseconds (f64 bits).
    ewma_ns: AtomicU64,
    last_sample_ns: AtomicU64,
    consecutive_failures: AtomicU32,
    /// Ejections in a row without a success in between (drives the backoff).
    ejections_in_row: AtomicU32,
    ejected_until_ns: AtomicU64,
    /// Times this endpoint was ejected.
    pub ejections: AtomicU64,
    /// Ejected and not yet probed: once its ejection ends it gets the next request it is
    /// drawn for, whatever its score, so a recovered endpoint is found.
    probe_pending: std::sync::atomic::AtomicBool,
    /// A request succeeded since the last ejection ended. Until one does, the first failure
    /// of a request sent after the ejection ended (the probe, usually) ejects it again at
    /// once, not after `eject_after` more failures.
    recovered: std::sync::atomic::AtomicBool,
    eject_after: u32,
    eject_base: Duration,
}

impl EndpointLoad {
    pub fn new(eject_after: u32, eject_base: Duration) -> EndpointLoad {
        EndpointLoad {
            epoch: Instant::now(),
            in_flight: AtomicU32::new(0),
            ewma_ns: AtomicU64::new((DEFAULT_RTT.as_nanos() as f64).to_bits()),
            last_sample_ns: AtomicU64::new(0),
            consecutive_failures: AtomicU32::new(0),
            ejections_in_row: AtomicU32::new(0),
            ejected_until_ns: AtomicU64::new(0),
            ejections: AtomicU64::new(0),
            probe_pending: std::sync::atomic::AtomicBool::new(false),
            recovered: std::sync::atomic::AtomicBool::new(false),
            eject_after,
            eject_base,
        }
    }

    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// The latency estimate, in nanoseconds, as last sampled (not decayed).
    fn ewma_ns(&self) -> f64 {
        f64::from_bits(self.ewma_ns.load(Ordering::Relaxed))
    }

    /// Requests in flight to this endpoint now.
    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    pub fn is_ejected(&self) -> bool {
        self.ejected_until_ns.load(Ordering::Relaxed) > self.now_ns()
    }

    /// Expected cost of one more request here: latency × (requests in flight + 1). The
    /// latency estimate decays while no samples come in (as tower's PeakEwma does), so an
    /// endpoint that stopped getting traffic is tried again.
    pub fn cost(&self) -> f64 {
        let ewma = f64::from_bits(self.ewma_ns.load(Ordering::Relaxed));
        let idle = self
            .now_ns()
            .saturating_sub(self.last_sample_ns.load(Ordering::Relaxed));
        let decayed = ewma * (-(idle as f64) / DECAY.as_nanos() as f64).exp();
        decayed * f64::from(self.in_flight.load(Ordering::Relaxed) + 1)
    }

    /// Takes the pending probe, if the ejection is over and one is pending.
    fn take_probe(&self) -> bool {
        !self.is_ejected() && self.probe_pending.swap(false, Ordering::Relaxed)
    }

    /// A request starts here; the guard ends it.
    pub fn start(&self) -> InFlight<'_> {
        self.start_at(Instant::now())
    }

    /// [`start`](Self::start) with the time already read by the caller.
    pub fn start_at(&self, now: Instant) -> InFlight<'_> {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight {
            load: self,
            started: now,
            estimate: self.ewma_ns(),
        }
    }

    fn sample(&self, rtt: Duration) {
        self.sample_at(rtt, Instant::now());
    }

    /// A latency sample taken at `at`.
    fn sample_at(&self, rtt: Duration, at: Instant) {
        let now = at.saturating_duration_since(self.epoch).as_nanos() as u64;
        // Not `as_nanos() as f64`: a `u128` to float conversion is a library call.
        let rtt = rtt.as_secs() as f64 * 1e9 + f64::from(rtt.subsec_nanos());
        let prev = f64::from_bits(self.ewma_ns.load(Ordering::Relaxed));
        let last = self.last_sample_ns.swap(now, Ordering::Relaxed);
        // Peak: a slower sample is taken at once; faster ones decay in.
        let next = if rtt > prev {
            rtt
        } else {
            let w = (-((now.saturating_sub(last)) as f64) / DECAY.as_nanos() as f64).exp();
            prev * w + rtt * (1.0 - w)
        };
        self.ewma_ns.store(next.to_bits(), Ordering::Relaxed);
    }

    fn success(&self) {
        self.recovered.store(true, Ordering::Relaxed);
        self.consecutive_failures.store(0, Ordering::Relaxed);
        self.ejections_in_row.store(0, Ordering::Relaxed);
    }

    /// A connect failure or a 5xx of a request sent now (see [`failure_of`](Self::failure_of)).
    #[cfg(test)]
    fn failure(&self) -> bool {
        self.failure_of(Instant::now())
    }

    /// A connect failure or a 5xx of a request sent at `started`. Returns true when this
    /// failure ejected the endpoint.
    ///
    /// Failures of requests sent before the last ejection ended do not count, nor any while
    /// it is ejected: they are no news (a restart fails every request in flight at once), and
    /// counting them would eject it again and again, doubling the period each time. After an
    /// ejection, until a request succeeds, the first failure ejects it again at once.
    fn failure_of(&self, started: Instant) -> bool {
        if self.eject_after == 0 || self.is_ejected() {
            return false;
        }
        let until = self.ejected_until_ns.load(Ordering::Relaxed);
        let started_ns = started.saturating_duration_since(self.epoch).as_nanos() as u64;
        if until != 0 && started_ns < until {
            return false;
        }
        let unrecovered = until != 0 && !self.recovered.load(Ordering::Relaxed);
        let n = self.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1;
        if n < self.eject_after && !unrecovered {
            return false;
        }
        self.recovered.store(false, Ordering::Relaxed);
        self.consecutive_failures.store(0, Ordering::Relaxed);
        let k = self.ejections_in_row.fetch_add(1, Ordering::Relaxed).min(5);
        let period = (self.eject_base * 2u32.pow(k)).min(MAX_EJECTION.max(self.eject_base));
        self.ejected_until_ns
            .store(self.now_ns() + period.as_nanos() as u64, Ordering::Relaxed);
        self.ejections.fetch_add(1, Ordering::Relaxed);
        self.probe_pending.store(true, Ordering::Relaxed);
        true
    }
}

/// A request in flight on an endpoint; records its outcome when told, and always ends it.
pub struct InFlight<'a> {
    load: &'a EndpointLoad,
    started: Instant,
    /// The latency estimate when it started (ns), for a failure's sample.
    estimate: f64,
}

impl InFlight<'_> {
    /// The response head arrived with `status`.
    pub fn responded(self, status: http::StatusCode) {
        self.responded_at(status, Instant::now());
    }

    /// [`responded`](Self::responded) with the time already read by the caller.
    pub fn responded_at(self, status: http::StatusCode, now: Instant) {
        self.load
            .sample_at(now.saturating_duration_since(self.started), now);
        if status.is_server_error() {
            self.load.failure_of(self.started);
        } else {
            self.load.success();
        }
    }

    /// Given up on because another copy answered first (a hedge): the time waited is a
    /// lower bound of this endpoint's latency; its health is unchanged.
    pub fn abandoned(self) {
        self.load.sample(self.started.elapsed());
    }

    /// A checkout that ended in `e`: the route's total deadline cutting a connect short
    /// (`UpstreamTimeout` there), or a wait for one of its connections past the connect
    /// timeout, says the endpoint is slow or busy, not broken, and one removed from its
    /// cluster while a request waited says nothing of it, so these count as
    /// [`abandoned`](Self::abandoned); any other error as [`failed`](Self::failed).
    pub fn ended_by(self, e: &crate::pipeline::error::ProxyError) {
        use crate::pipeline::error::ProxyError;
        if matches!(
            e,
            ProxyError::UpstreamTimeout
                | ProxyError::UpstreamQueueTimeout
                | ProxyError::EndpointRemoved
        ) {
            self.abandoned();
        } else {
            self.failed();
        }
    }

    /// No response (connect failure, reset, timeout). A dead endpoint refuses in
    /// microseconds, and that time as a sample would make it the cheapest choice: a failure
    /// counts as twice the estimate the request started with (at most a second more), and
    /// at least [`FAILURE_SAMPLE`]. From the estimate at its start, not the current one: a
    /// burst of failures (every request in flight when the server restarts) costs what one
    /// does, not a doubling each.
    pub fn failed(self) {
        let at_start = Duration::from_nanos(self.estimate as u64);
        let penalty = (at_start * 2)
            .min(at_start + FAILURE_CAP)
            .max(FAILURE_SAMPLE);
        self.load.sample(self.started.elapsed().max(penalty));
        self.load.failure_of(self.started);
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.load.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Picks an endpoint index among `n` (n ≥ 1), never one `excluded` says when another
/// exists (a predicate, not an index: the endpoint to avoid is named by its address, which
/// may stand in the list more than once). Ejected endpoints are skipped unless all are
/// ejected (then ejection is ignored, as Envoy's panic threshold does, rather than failing
/// every request).
pub fn pick<'a>(
    balance: Balance,
    n: usize,
    load: impl Fn(usize) -> &'a EndpointLoad,
    rr: &AtomicU64,
    excluded: impl Fn(usize) -> bool,
) -> usize {
    if n == 1 {
        return 0;
    }
    let usable = |i: usize| !excluded(i) && !load(i).is_ejected();
    let any_usable = (0..n).any(usable);
    let ok = |i: usize| {
        if any_usable { usable(i) } else { !excluded(i) }
    };
    match balance {
        Balance::RoundRobin => {
            for _ in 0..n {
                let i = (rr.fetch_add(1, Ordering::Relaxed) % n as u64) as usize;
                if ok(i) {
                    return i;
                }
            }
            0
        }
        Balance::P2c => {
            let candidates: [usize; 2] = {
                let a = fastrand::usize(..n);
                let mut b = fastrand::usize(..n - 1);
                if b >= a {
                    b += 1;
                }
                [a, b]
            };
            for c in candidates {
                if ok(c) && load(c).take_probe() {
                    return c;
                }
            }
            match (ok(candidates[0]), ok(candidates[1])) {
                (true, true) => {
                    if load(candidates[0]).cost() <= load(candidates[1]).cost() {
                        candidates[0]
                    } else {
                        candidates[1]
                    }
                }
                (true, false) => candidates[0],
                (false, true) => candidates[1],
                // Both drawn ones ejected: any usable endpoint, drawn evenly (the first
                // usable one in the list would take all of this traffic).
                (false, false) => {
                    let usable = (0..n).filter(|&i| ok(i)).count();
                    if usable == 0 {
                        return 0;
                    }
                    let k = fastrand::usize(..usable);
                    (0..n).filter(|&i| ok(i)).nth(k).unwrap_or(0)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How long the endpoint stays ejected from now.
    fn ejected_for(l: &EndpointLoad) -> Duration {
        Duration::from_nanos(
            l.ejected_until_ns
                .load(Ordering::Relaxed)
                .saturating_sub(l.now_ns()),
        )
    }

    #[test]
    fn ejects_after_consecutive_failures_and_backs_off() {
        let l = EndpointLoad::new(3, Duration::from_secs(1));
        assert!(!l.failure());
        assert!(!l.failure());
        assert!(l.failure(), "the third failure in a row ejects");
        assert!(l.is_ejected());
        let until = l.ejected_until_ns.load(Ordering::Relaxed);
        // Requests that were in flight fail too: that is no new evidence.
        for _ in 0..10 {
            assert!(!l.failure());
        }
        assert_eq!(l.ejections.load(Ordering::Relaxed), 1);
        assert_eq!(l.ejected_until_ns.load(Ordering::Relaxed), until);
        // The ejection ends; failing again ejects it for twice as long.
        l.ejected_until_ns.store(0, Ordering::Relaxed);
        assert!(!l.failure());
        assert!(!l.failure());
        assert!(l.failure());
        assert!(
            ejected_for(&l) >= Duration::from_millis(1900),
            "the second ejection lasts twice as long: {:?}",
            ejected_for(&l)
        );
    }

    /// When its ejection ends the endpoint gets one probe; a failed probe ejects it again at
    /// once, for twice as long. A request sent before the ejection ended is no probe.
    #[test]
    fn a_failed_probe_ejects_again_at_once() {
        let l = EndpointLoad::new(5, Duration::from_secs(1));
        let before = Instant::now();
        for _ in 0..5 {
            l.failure();
        }
        assert!(l.is_ejected());
        // The ejection ends (now).
        l.ejected_until_ns
            .store(l.now_ns().max(2) - 1, Ordering::Relaxed);
        assert!(!l.failure_of(before), "sent before it ended: no news");
        assert!(l.take_probe(), "the probe is due");
        assert!(l.failure(), "the probe's failure ejects");
        assert!(
            ejected_for(&l) >= Duration::from_millis(1900),
            "{:?}",
            ejected_for(&l)
        );
        // After a success, one failure is one of five again.
        l.ejected_until_ns
            .store(l.now_ns().max(2) - 1, Ordering::Relaxed);
        assert!(l.take_probe());
        l.success();
        assert!(!l.failure());
    }

    /// An `eject_duration` longer than the 30 s cap is the first ejection's length, not cut
    /// to 30 s; the doubling stops there.
    #[test]
    fn a_long_first_ejection_is_not_cut_to_the_cap() {
        let l = EndpointLoad::new(1, Duration::from_secs(600));
        assert!(l.failure());
        assert!(
            ejected_for(&l) >= Duration::from_secs(599),
            "{:?}",
            ejected_for(&l)
        );
        l.ejected_until_ns.store(0, Ordering::Relaxed);
        assert!(l.failure());
        assert!(
            ejected_for(&l) <= Duration::from_secs(600),
            "not doubled past it: {:?}",
            ejected_for(&l)
        );
    }

    /// Both drawn endpoints ejected: the usable ones share the traffic evenly, not the first
    /// of them in the list.
    #[test]
    fn with_most_ejected_the_usable_ones_share_the_traffic() {
        let loads: Vec<EndpointLoad> = (0..10)
            .map(|_| EndpointLoad::new(1, Duration::from_secs(60)))
            .collect();
        for l in &loads[..8] {
            l.failure();
        }
        let rr = AtomicU64::new(0);
        let mut hits = [0u32; 10];
        for _ in 0..4000 {
            hits[super::pick(Balance::P2c, 10, |i| &loads[i], &rr, |_| false)] += 1;
        }
        assert_eq!(hits[..8].iter().sum::<u32>(), 0, "{hits:?}");
        // Even shares are 2000 each; the first-usable rule gave the first about 3250.
        assert!(hits[8].abs_diff(hits[9]) < 600, "{hits:?}");
    }

    /// A failure that came back at once does not make the endpoint look cheap, and a burst
    /// of them costs what one does (no compounding).
    #[test]
    fn a_fast_failure_makes_the_endpoint_dearer_once() {
        let l = EndpointLoad::new(0, Duration::from_secs(1));
        l.sample(Duration::from_millis(5));
        let before = l.cost();
        l.start().failed();
        let after_one = l.cost();
        assert!(after_one >= 19.0 * before, "{before} then {after_one}");
        // Thirty requests in flight fail at once: they cost what one does.
        let burst: Vec<InFlight<'_>> = (0..30).map(|_| l.start()).collect();
        for f in burst {
            f.failed();
        }
        assert!(
            l.ewma_ns() <= 2.01 * FAILURE_SAMPLE.as_nanos() as f64,
            "{} after a burst",
            l.ewma_ns()
        );
        // A slow endpoint's fast failure makes it dearer too.
        let slow = EndpointLoad::new(0, Duration::from_secs(1));
        slow.sample(Duration::from_millis(400));
        slow.start().failed();
        assert!(slow.ewma_ns() >= 1.99 * 400e6, "{}", slow.ewma_ns());
    }

    #[test]
    fn p2c_prefers_the_cheaper_endpoint_and_skips_ejected_ones() {
        let fast = EndpointLoad::new(1, Duration::from_secs(60));
        let slow = EndpointLoad::new(1, Duration::from_secs(60));
        slow.sample(Duration::from_millis(50));
        let rr = AtomicU64::new(0);
        let loads = [&fast, &slow];
        let pick = |b, rr: &AtomicU64, ex: Option<usize>| {
            super::pick(b, 2, |i| loads[i], rr, |i| Some(i) == ex)
        };
        for _ in 0..50 {
            assert_eq!(pick(Balance::P2c, &rr, None), 0);
        }
        fast.failure();
        assert!(fast.is_ejected());
        for _ in 0..20 {
            assert_eq!(pick(Balance::P2c, &rr, None), 1);
            assert_eq!(pick(Balance::RoundRobin, &rr, None), 1);
        }
        // All ejected: traffic still flows.
        slow.failure();
        let _ = pick(Balance::P2c, &rr, None);
        assert_eq!(pick(Balance::P2c, &rr, Some(0)), 1);
    }
}
