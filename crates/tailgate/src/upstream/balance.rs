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

/// What is left of a sample's weight after `idle_ns` nanoseconds without another
/// (τ = [`DECAY`]).
fn decay(idle_ns: u64) -> f64 {
    const DECAY_NS: f64 = DECAY.as_nanos() as f64;
    let x = idle_ns as f64 / DECAY_NS;
    // Samples come microseconds to milliseconds apart against a τ of seconds: there the
    // series' first terms are within 2e-10 of it, and spare the call into libm.
    if x < 1e-3 {
        1.0 - x + x * x * 0.5
    } else {
        (-x).exp()
    }
}

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

    /// The latency estimate the balancer weighs this endpoint by, as last sampled.
    pub fn latency_estimate(&self) -> Duration {
        Duration::from_nanos(self.ewma_ns() as u64)
    }

    /// Requests in flight to this endpoint now.
    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    pub fn is_ejected(&self) -> bool {
        // Never ejected (most endpoints): no clock read. `pick` asks it of every endpoint.
        let until = self.ejected_until_ns.load(Ordering::Relaxed);
        until != 0 && until > self.now_ns()
    }

    /// Expected cost of one more request here: latency × (requests in flight + 1). The
    /// latency estimate decays while no samples come in (as tower's PeakEwma does), so an
    /// endpoint that stopped getting traffic is tried again.
    pub fn cost(&self) -> f64 {
        let ewma = f64::from_bits(self.ewma_ns.load(Ordering::Relaxed));
        let idle = self
            .now_ns()
            .saturating_sub(self.last_sample_ns.load(Ordering::Relaxed));
        let decayed = ewma * decay(idle);
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
            told: false,
            estimate: self.ewma_ns(),
            sampled_at: self.last_sample_ns.load(Ordering::Relaxed),
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
            let w = decay(now.saturating_sub(last));
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

    /// Does a success of a request sent at `started` change anything? Not when it was sent
    /// before the last ejection ended. Recovered since that ejection, with no backoff left,
    /// a success resets only the count of failures in a row: the clock is not looked at.
    fn success_is_news(&self, started: Instant) -> bool {
        (self.recovered.load(Ordering::Relaxed)
            && self.ejections_in_row.load(Ordering::Relaxed) == 0)
            || self.sent_after_ejection(started)
    }

    /// Was a request sent at `started` sent after the last ejection ended (or with none
    /// so far)?
    fn sent_after_ejection(&self, started: Instant) -> bool {
        let until = self.ejected_until_ns.load(Ordering::Relaxed);
        until == 0 || started.saturating_duration_since(self.epoch).as_nanos() as u64 >= until
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
        if !self.sent_after_ejection(started) {
            return false;
        }
        let until = self.ejected_until_ns.load(Ordering::Relaxed);
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
///
/// Dropped untold (the client went away, or a hedge's other copy won), it counts as
/// [`abandoned`](Self::abandoned): the time waited is a lower bound of the endpoint's
/// latency, a sample when it is above the estimate. Without that sample an endpoint that
/// never answers, whose clients all give up before the response timeout, got no sample at
/// all: its estimate decayed toward nothing and, once its requests in flight were let go,
/// it drew the traffic back to itself.
pub struct InFlight<'a> {
    load: &'a EndpointLoad,
    started: Instant,
    /// Set by every outcome: dropped without one, the request was let go.
    told: bool,
    /// The latency estimate when it started (ns), as last sampled, and when that was (ns
    /// from the endpoint's epoch): for a failure's sample, the estimate decayed to the
    /// request's start (see [`penalty`](Self::penalty)).
    estimate: f64,
    sampled_at: u64,
}

impl InFlight<'_> {
    /// The request went out at `at`, after a wait for its connection (a connect, a TLS
    /// handshake, a queue under `max_connections_per_endpoint`): its latency sample and
    /// what its outcome says of the endpoint count from then. One connect's 60 ms in a
    /// sample made an endpoint answering in 2 ms look costly for as long as the estimate
    /// took to decay (tens of seconds), and the balancer steered its traffic away.
    pub fn sent_at(&mut self, at: Instant) {
        self.started = at;
    }

    /// The response head arrived with `status`.
    pub fn responded(self, status: http::StatusCode) {
        self.responded_at(status, Instant::now());
    }

    /// [`responded`](Self::responded) with the time already read by the caller.
    ///
    /// A `5xx` counts as [`FAILURE_SAMPLE`] at least, and as the estimate the request
    /// started with at least: an endpoint whose database is gone answers `500` in a
    /// fraction of a millisecond, and that time as a sample made it the cheapest choice,
    /// drawing the traffic to itself (all of it, over two endpoints) where outlier
    /// detection is off; and where healthy answers take longer than that floor (300 ms),
    /// an endpoint shedding half its load as quick `503`s went down to the floor and drew
    /// the cluster's traffic in turn. Not doubled as a failure with no answer is
    /// ([`failed`](Self::failed)): an endpoint that sheds load with a `503` between
    /// successes is never ejected, and doubling at each would grow its estimate to minutes.
    pub fn responded_at(mut self, status: http::StatusCode, now: Instant) {
        self.told = true;
        let rtt = now.saturating_duration_since(self.started);
        if status.is_server_error() {
            let floor = self.estimate_at_start().max(FAILURE_SAMPLE);
            self.load.sample_at(rtt.max(floor), now);
            self.load.failure_of(self.started);
        } else {
            self.load.sample_at(rtt, now);
            // A success of a request sent before the last ejection ended is no news either
            // (as a failure is not, `failure_of`): a slow request of before answering
            // during the ejection cancelled its backoff and the probe's re-ejection, and an
            // endpoint failing its new requests fast while old ones finished cycled at the
            // base period.
            if self.load.success_is_news(self.started) {
                self.load.success();
            }
        }
    }

    /// Given up on because another copy answered first (a hedge): the time waited is a
    /// lower bound of this endpoint's latency; its health is unchanged.
    pub fn abandoned(mut self) {
        self.told = true;
        self.waited(self.started.elapsed());
    }

    /// A lower bound of the endpoint's latency, `waited`: a sample only when it is above
    /// the estimate the request started with. Below it, it says nothing (the answer may
    /// have been about to come), and as a sample it pulled the estimate down: a hedge let
    /// go a moment after it was sent, or a client gone after 2 ms from a 300 ms endpoint,
    /// made that endpoint look cheap.
    fn waited(&self, waited: Duration) {
        if waited > self.estimate_at_start() {
            self.load.sample(waited);
        }
    }

    /// Ended by something that says nothing of the endpoint (the client's own body failed):
    /// no sample, and its health is unchanged.
    pub fn no_verdict(mut self) {
        self.told = true;
    }

    /// A checkout that ended in `e`: the route's total deadline cutting a connect short
    /// (`UpstreamTimeout` there), or a wait for one of its connections past the connect
    /// timeout, says the endpoint is slow or busy, not broken, so these count as
    /// [`abandoned`](Self::abandoned); a request refused at once by a full queue, or one
    /// whose endpoint left its cluster while it waited, says nothing of it
    /// ([`no_verdict`](Self::no_verdict): a refusal's microseconds as a sample made the
    /// busiest endpoint look the cheapest); any other error counts as
    /// [`failed`](Self::failed).
    pub fn ended_by(self, e: &crate::pipeline::error::ProxyError) {
        use crate::pipeline::error::ProxyError;
        match e {
            ProxyError::UpstreamTimeout | ProxyError::UpstreamQueueTimeout => self.abandoned(),
            ProxyError::UpstreamQueueFull | ProxyError::EndpointRemoved => self.no_verdict(),
            _ => self.failed(),
        }
    }

    /// No response (connect failure, reset, timeout). A dead endpoint refuses in
    /// microseconds, and that time as a sample would make it the cheapest choice: a failure
    /// counts as [`penalty`](Self::penalty) at least.
    pub fn failed(mut self) {
        self.told = true;
        let penalty = self.penalty();
        self.load.sample(self.started.elapsed().max(penalty));
        self.load.failure_of(self.started);
    }

    /// The latency a failure counts as, at least: twice the estimate the request started
    /// with (at most a second more), and at least [`FAILURE_SAMPLE`]. From the estimate at
    /// its start, not the current one: a burst of failures (every request in flight when
    /// the server restarts) costs what one does, not a doubling each. And that estimate
    /// decayed for the time without samples before the start, as the balancer saw it
    /// ([`EndpointLoad::cost`]): the stored peak, doubled again at each try of an endpoint
    /// that stays down (once every ejection), grew past a minute within an hour, and kept
    /// it unused that long after it came back.
    fn penalty(&self) -> Duration {
        let at_start = self.estimate_at_start();
        (at_start * 2)
            .min(at_start + FAILURE_CAP)
            .max(FAILURE_SAMPLE)
    }

    /// The latency estimate at the request's start, decayed for the time without samples
    /// before it, as the balancer saw it ([`EndpointLoad::cost`]).
    fn estimate_at_start(&self) -> Duration {
        let started_ns = self
            .started
            .saturating_duration_since(self.load.epoch)
            .as_nanos() as u64;
        let at_start = self.estimate * decay(started_ns.saturating_sub(self.sampled_at));
        Duration::from_nanos(at_start as u64)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if !self.told {
            self.waited(self.started.elapsed());
        }
        self.load.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Picks an endpoint index among `n` (n ≥ 1), never one `excluded` says when another
/// exists (a predicate, not an index: the endpoint to avoid is named by its address, which
/// may stand in the list more than once). Ejected endpoints are skipped while at least half
/// of the cluster's endpoints are not ejected (counted over all of them, the excluded one
/// too, as Envoy counts: a retry that avoids one healthy endpoint of two healthy and two
/// ejected must not take the ejected ones), and one not excluded is left. Under that,
/// ejection is ignored, as Envoy's panic threshold (50 % by default) ignores health: the
/// few left would take every other one's traffic and fail in turn, where spread over all
/// the failing ones' share fails (and a dead one's requests are sent again elsewhere).
///
/// The threshold is counted only when a drawn endpoint is ejected: the usual pick looks
/// at its two (or one) endpoints, not at every one.
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
    let heed = std::cell::OnceCell::new();
    let heed_ejection = || {
        *heed.get_or_init(|| {
            let healthy = (0..n).filter(|&i| !load(i).is_ejected()).count();
            healthy * 2 >= n && (0..n).any(usable)
        })
    };
    let ok = |i: usize| !excluded(i) && (!load(i).is_ejected() || !heed_ejection());
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

    /// The series taken for short idle times agrees with the exponential it stands for.
    #[test]
    fn decay_agrees_with_the_exponential() {
        let tau = DECAY.as_nanos() as f64;
        for idle_ns in [
            0u64,
            1,
            1_000,
            200_000,
            9_999_999,
            10_000_000,
            10_000_001,
            1 << 40,
        ] {
            let exact = (-(idle_ns as f64) / tau).exp();
            assert!((decay(idle_ns) - exact).abs() < 1e-9, "{idle_ns}");
        }
    }

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

    /// The latency sample counts from the send, not from before the wait for a connection.
    #[test]
    fn a_sample_counts_from_the_send() {
        let l = EndpointLoad::new(0, Duration::from_secs(1));
        let t0 = Instant::now();
        let mut f = l.start_at(t0);
        f.sent_at(t0 + Duration::from_millis(60));
        f.responded_at(http::StatusCode::OK, t0 + Duration::from_millis(62));
        let estimate = Duration::from_nanos(l.ewma_ns() as u64);
        assert!(estimate < Duration::from_millis(10), "{estimate:?}");
    }

    /// A request sent before an ejection that succeeds during it is no news: the next
    /// failure after the ejection (its probe's) still ejects at once, for twice as long.
    /// The success reset the backoff, and such an endpoint cycled at the base period.
    #[test]
    fn a_success_of_a_request_sent_before_the_ejection_resets_nothing() {
        let l = EndpointLoad::new(3, Duration::from_secs(1));
        let old = l.start();
        for _ in 0..3 {
            l.failure();
        }
        assert!(l.is_ejected());
        old.responded(http::StatusCode::OK);
        // The ejection ends (now).
        l.ejected_until_ns
            .store(l.now_ns().max(2) - 1, Ordering::Relaxed);
        assert!(l.take_probe());
        assert!(l.failure(), "the probe's failure ejects at once");
        assert!(
            ejected_for(&l) >= Duration::from_millis(1900),
            "the second ejection lasts twice as long: {:?}",
            ejected_for(&l)
        );
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
    /// of them in the list. Half ejected is still heeded.
    #[test]
    fn with_half_ejected_the_usable_ones_share_the_traffic() {
        let loads: Vec<EndpointLoad> = (0..10)
            .map(|_| EndpointLoad::new(1, Duration::from_secs(60)))
            .collect();
        // One latency, sampled at one time: equal costs (ties drawn at random).
        let at = Instant::now();
        for l in &loads {
            l.sample_at(Duration::from_millis(1), at);
        }
        for l in &loads[..5] {
            l.failure();
        }
        let rr = AtomicU64::new(0);
        let mut hits = [0u32; 10];
        for _ in 0..4000 {
            hits[super::pick(Balance::P2c, 10, |i| &loads[i], &rr, |_| false)] += 1;
        }
        assert_eq!(hits[..5].iter().sum::<u32>(), 0, "{hits:?}");
        // Even shares are 800 each; the first-usable rule gave the first about twice that.
        let (lo, hi) = (hits[5..].iter().min(), hits[5..].iter().max());
        let spread = hi.expect("five") - lo.expect("five");
        assert!(spread < 300, "{hits:?}");
    }

    /// Past half ejected, ejection is ignored (Envoy's panic threshold): the two left would
    /// take all the traffic of ten, and fail in turn. An excluded endpoint does not count.
    #[test]
    fn with_most_ejected_the_traffic_spreads_over_all_again() {
        let loads: Vec<EndpointLoad> = (0..10)
            .map(|_| EndpointLoad::new(1, Duration::from_secs(60)))
            .collect();
        // One latency, sampled at one time: equal costs (ties drawn at random).
        let at = Instant::now();
        for l in &loads {
            l.sample_at(Duration::from_millis(1), at);
        }
        for l in &loads[..6] {
            l.failure();
        }
        let rr = AtomicU64::new(0);
        for balance in [Balance::P2c, Balance::RoundRobin] {
            let mut hits = [0u32; 10];
            for _ in 0..4000 {
                hits[super::pick(balance, 10, |i| &loads[i], &rr, |_| false)] += 1;
            }
            assert!(hits.iter().all(|&h| h > 100), "{balance:?}: {hits:?}");
        }
        // Counted over all ten, the excluded ones too: with two of the ejected ones
        // excluded, four of ten are healthy still, and ejection is still ignored.
        let mut hits = [0u32; 10];
        for _ in 0..4000 {
            hits[super::pick(Balance::P2c, 10, |i| &loads[i], &rr, |i| i < 2)] += 1;
        }
        assert_eq!(hits[..2].iter().sum::<u32>(), 0, "{hits:?}");
        assert!(hits[2..6].iter().all(|&h| h > 100), "{hits:?}");
        // Half ejected, a retry avoiding a healthy one: never to an ejected one (the
        // excluded one counts among the healthy half); nor when the only one not
        // excluded is ejected, unless it is the only one left.
        let half: Vec<EndpointLoad> = (0..4)
            .map(|_| EndpointLoad::new(1, Duration::from_secs(60)))
            .collect();
        half[2].failure();
        half[3].failure();
        for balance in [Balance::P2c, Balance::RoundRobin] {
            for _ in 0..200 {
                assert_eq!(super::pick(balance, 4, |i| &half[i], &rr, |i| i == 0), 1);
            }
            assert_eq!(super::pick(balance, 4, |i| &half[i], &rr, |i| i != 3), 3);
        }
    }

    /// A `5xx` that comes back at once does not make its endpoint look cheap: with ejection
    /// off, an endpoint answering `500` in 300 µs drew every request from one answering
    /// `200` in 20 ms.
    #[test]
    fn a_fast_5xx_does_not_draw_the_traffic() {
        let good = EndpointLoad::new(0, Duration::from_secs(1));
        let bad = EndpointLoad::new(0, Duration::from_secs(1));
        good.sample(Duration::from_millis(20));
        bad.sample(Duration::from_millis(20));
        let t0 = Instant::now();
        for k in 0..100u32 {
            let at = t0 + Duration::from_millis(100) * k;
            bad.start_at(at).responded_at(
                http::StatusCode::INTERNAL_SERVER_ERROR,
                at + Duration::from_micros(300),
            );
        }
        let loads = [&good, &bad];
        let rr = AtomicU64::new(0);
        let to_good = (0..1000)
            .filter(|_| super::pick(Balance::P2c, 2, |i| loads[i], &rr, |_| false) == 0)
            .count();
        assert!(to_good > 500, "{to_good} of 1000 to the healthy endpoint");
        // And a hundred of them one after another do not compound: the estimate is a
        // failure's, not minutes.
        assert!(
            bad.ewma_ns() <= 1.01 * FAILURE_SAMPLE.as_nanos() as f64,
            "{}",
            bad.ewma_ns()
        );
    }

    /// Where healthy answers take longer than [`FAILURE_SAMPLE`], a `5xx` that comes back
    /// at once still does not make its endpoint cheaper than it was: one answering every
    /// other request with a quick `503` drew the traffic of endpoints answering in 300 ms.
    #[test]
    fn a_fast_5xx_on_a_slow_cluster_does_not_draw_the_traffic() {
        let good = EndpointLoad::new(0, Duration::from_secs(1));
        let shedding = EndpointLoad::new(0, Duration::from_secs(1));
        let t0 = Instant::now();
        let slow = Duration::from_millis(300);
        good.start_at(t0)
            .responded_at(http::StatusCode::OK, t0 + slow);
        shedding
            .start_at(t0)
            .responded_at(http::StatusCode::OK, t0 + slow);
        // Ten seconds (one decay constant) of quick `503`s, 50 ms apart.
        for k in 1..=200u32 {
            let at = t0 + slow + Duration::from_millis(50) * k;
            good.start_at(at)
                .responded_at(http::StatusCode::OK, at + slow);
            shedding.start_at(at).responded_at(
                http::StatusCode::SERVICE_UNAVAILABLE,
                at + Duration::from_millis(1),
            );
        }
        assert!(
            shedding.ewma_ns() >= 0.9 * good.ewma_ns(),
            "shedding {} against healthy {}",
            shedding.ewma_ns(),
            good.ewma_ns()
        );
    }

    /// Dropped untold (its client went away, or a hedge's other copy won), a request counts
    /// the time it waited: an endpoint that never answers, whose clients give up before
    /// the response timeout, got no sample at all and looked as cheap as ever.
    #[test]
    fn a_request_let_go_counts_the_time_it_waited() {
        let l = EndpointLoad::new(0, Duration::from_secs(1));
        l.sample(Duration::from_millis(5));
        let before = l.ewma_ns();
        let long_ago = Instant::now()
            .checked_sub(Duration::from_secs(2))
            .expect("uptime");
        drop(l.start_at(long_ago));
        assert!(l.ewma_ns() >= 1.9e9, "{} after {before}", l.ewma_ns());
        assert_eq!(l.in_flight.load(Ordering::Relaxed), 0);
        // One let go sooner than the estimate says nothing, and does not pull it down (a
        // while after the last sample, when a sample weighs something: a 2 % pull then).
        let before = l.ewma_ns();
        std::thread::sleep(Duration::from_millis(200));
        drop(l.start());
        assert!(
            l.ewma_ns() >= 0.999 * before,
            "{} after {before}",
            l.ewma_ns()
        );
        std::thread::sleep(Duration::from_millis(200));
        l.start().abandoned();
        assert!(
            l.ewma_ns() >= 0.999 * before,
            "{} after {before}",
            l.ewma_ns()
        );
        // One ended with no verdict (the client's own body failed) counts nothing.
        let m = EndpointLoad::new(0, Duration::from_secs(1));
        m.sample(Duration::from_millis(5));
        let before = m.ewma_ns();
        m.start_at(long_ago).no_verdict();
        assert!(m.ewma_ns() <= before, "{} after {before}", m.ewma_ns());
        assert_eq!(m.in_flight.load(Ordering::Relaxed), 0);
    }

    /// A failure's penalty starts from the estimate as the balancer saw it at the request's
    /// start (decayed for the time without samples), not the stored peak: an endpoint that
    /// stays down, tried once per ejection, doubled its estimate at each try.
    #[test]
    fn a_failure_after_a_quiet_while_does_not_double_a_stale_peak() {
        let l = EndpointLoad::new(0, Duration::from_secs(1));
        l.sample(Duration::from_millis(5));
        l.start().failed();
        let peak = l.ewma_ns();
        assert!(peak >= FAILURE_SAMPLE.as_nanos() as f64, "{peak}");
        // A minute later (six decay constants), the next try fails too.
        l.start_at(Instant::now() + Duration::from_secs(60))
            .failed();
        assert!(l.ewma_ns() <= 1.01 * peak, "{} after {peak}", l.ewma_ns());
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
