//! Hedged requests (seed 004; Dean and Barroso, "The Tail at Scale"): when a route opts in
//! and no response head has come back after the hedge delay, a second copy of the request
//! goes to another endpoint of the cluster; the first response wins and the other exchange
//! is dropped (its connection closed, so the upstream sees the cancel).
//!
//! Only requests that may be sent twice (idempotent methods, or routes marked
//! `idempotent`) and have no body are hedged. Hedges are bounded per worker by the cluster's
//! `hedge_budget_percent` and also spend from its retry budget, so retries plus hedges stay
//! a fraction of the traffic and cannot multiply an overload.
//!
//! The delay is fixed (`hedge_delay = "50ms"`) or a percentile of the route's observed
//! time to response head (`hedge_delay = "p95"`), from [`LatencyHistogram`]: per route and per
//! worker, atomics written by that worker's thread only, no lock.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use futures_util::FutureExt as _;
use futures_util::future::Either;

use super::{ClusterPools, Conn, EndpointPool, SendError, UpBody};
use crate::config::HedgeDelay;
use crate::pipeline::body::ReqBody;
use crate::pipeline::error::ProxyError;
use crate::pipeline::headers::Added;

/// Samples a percentile delay needs before hedging starts.
const MIN_SAMPLES: u32 = 20;
/// Past this many samples, all counts are halved, so the histogram follows recent latency.
const DECAY_AT: u32 = 2048;
/// Sub-buckets per power of two (relative error ≤ 25 %).
const SUB: u32 = 4;
/// Values below 2^FLOOR_EXP ns (~16 µs) share bucket 0.
const FLOOR_EXP: u32 = 14;
const BUCKETS: usize = (SUB * (40 - FLOOR_EXP)) as usize + 1;

/// A small log-scale histogram of one route's time to response head on one worker.
pub struct LatencyHistogram {
    buckets: [AtomicU32; BUCKETS],
    count: AtomicU32,
    /// The percentile to report, in tenths of a percent.
    permille: u32,
    /// Its current value in ns (0: not enough samples yet); recomputed every 16 samples.
    cached_ns: AtomicU64,
}

fn bucket_of(ns: u64) -> usize {
    if ns < 1 << FLOOR_EXP {
        return 0;
    }
    let exp = 63 - ns.leading_zeros();
    let sub = ((ns >> (exp - 2)) & u64::from(SUB - 1)) as u32;
    (((exp - FLOOR_EXP) * SUB + sub + 1) as usize).min(BUCKETS - 1)
}

/// The upper bound of a bucket, in ns.
fn bucket_top(i: usize) -> u64 {
    if i == 0 {
        return 1 << FLOOR_EXP;
    }
    let i = (i - 1) as u32;
    let exp = i / SUB + FLOOR_EXP;
    u64::from(SUB + i % SUB + 1) << (exp - 2)
}

impl LatencyHistogram {
    pub fn new(permille: u32) -> LatencyHistogram {
        LatencyHistogram {
            buckets: std::array::from_fn(|_| AtomicU32::new(0)),
            count: AtomicU32::new(0),
            permille: permille.min(1000),
            cached_ns: AtomicU64::new(0),
        }
    }

    /// Records one time to response head. One worker thread writes; readers are the same
    /// thread, so relaxed loads and stores are enough.
    pub fn record(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.buckets[bucket_of(ns)].fetch_add(1, Ordering::Relaxed);
        let n = self.count.fetch_add(1, Ordering::Relaxed) + 1;
        if n >= DECAY_AT {
            let mut total = 0;
            for b in &self.buckets {
                let v = b.load(Ordering::Relaxed) / 2;
                b.store(v, Ordering::Relaxed);
                total += v;
            }
            self.count.store(total, Ordering::Relaxed);
        }
        if n.is_multiple_of(16) || n == MIN_SAMPLES {
            self.cached_ns.store(self.compute(), Ordering::Relaxed);
        }
    }

    fn compute(&self) -> u64 {
        let total: u64 = self
            .buckets
            .iter()
            .map(|b| u64::from(b.load(Ordering::Relaxed)))
            .sum();
        if total < u64::from(MIN_SAMPLES) {
            return 0;
        }
        let target = (total * u64::from(self.permille)).div_ceil(1000).max(1);
        let mut seen = 0;
        for (i, b) in self.buckets.iter().enumerate() {
            seen += u64::from(b.load(Ordering::Relaxed));
            if seen >= target {
                return bucket_top(i);
            }
        }
        bucket_top(BUCKETS - 1)
    }

    /// The percentile, once enough samples came in.
    pub fn value(&self) -> Option<Duration> {
        match self.cached_ns.load(Ordering::Relaxed) {
            0 => None,
            ns => Some(Duration::from_nanos(ns)),
        }
    }
}

/// A hedge ready to fire: what is needed to send the request again elsewhere.
pub struct Hedge<'a> {
    cluster: &'a ClusterPools,
    /// The endpoint the first copy went to; the hedge goes anywhere else.
    avoid: SocketAddr,
    delay: Duration,
    /// The request's head, borrowed: the hedge sends the same one.
    parts: &'a http::request::Parts,
    added: &'a Added<'a>,
    /// The request's tenant: the copy's lane in an endpoint's connection queue.
    tenant: Option<usize>,
}

/// Which copy answered first.
pub enum Raced<T> {
    Primary(T),
    /// The hedge: its response head and the connection it came on (boxed: rare and large),
    /// and what the first copy had come to by then.
    Hedge(Box<(http::Response<UpBody>, Conn)>, First),
}

/// What the first copy of a request whose hedge won had come to: still waiting (given up
/// on, no mark against its endpoint), or answered `5xx`, or failed. The last two count
/// against its endpoint, as they would have without the hedge: an endpoint that fails
/// slowly must not hide its failures behind the hedges that rescue its requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum First {
    Pending,
    Answered(http::StatusCode),
    Failed,
    /// Still without an answer when the response deadline came, while the copy's `5xx`
    /// was held: a failure, as [`First::Failed`], and a timeout of its connection (an
    /// HTTP/2 one silent all along takes no new streams, as without the hedge).
    TimedOut,
    /// Failed in a way that says nothing of its endpoint (a pooled connection closed
    /// before the request went out, a stream refused unprocessed): no sample, no mark.
    NoVerdict,
}

impl<'a> Hedge<'a> {
    /// A hedge for this request if its route asks for one and it may be sent twice: the
    /// caller has checked that (`may_repeat`: idempotent method or route, no body, no
    /// upgrade). `None` too while a percentile delay has too few samples, or the cluster has
    /// a single endpoint.
    pub fn plan(
        delay: Option<HedgeDelay>,
        latency: Option<&LatencyHistogram>,
        cluster: &'a ClusterPools,
        avoid: SocketAddr,
        parts: &'a http::request::Parts,
        added: &'a Added<'a>,
        may_repeat: bool,
    ) -> Option<Hedge<'a>> {
        let delay = match delay? {
            HedgeDelay::Fixed(d) => d,
            HedgeDelay::Percentile(_) => latency?.value()?,
        };
        if !may_repeat || cluster.endpoint_count() < 2 {
            return None;
        }
        Some(Hedge {
            cluster,
            avoid,
            delay,
            parts,
            added,
            tenant: None,
        })
    }

    /// The copy waits in `tenant`'s lane of an endpoint's connection queue, as the request
    /// did (see `upstream::limit`).
    pub fn for_tenant(mut self, tenant: Option<usize>) -> Hedge<'a> {
        self.tenant = tenant;
        self
    }

    /// Sends the copy to `pool`; records the outcome on that endpoint's load. A copy with no
    /// answer at `deadline` (the response deadline) timed out: a failure of its endpoint,
    /// as the first copy's is, not a copy let go.
    async fn send(
        self,
        pool: Arc<EndpointPool>,
        deadline: tokio::time::Instant,
    ) -> Result<(http::Response<UpBody>, Conn), ProxyError> {
        let in_flight = pool.load.start();
        let mut conn = match self.cluster.checkout(&pool, self.tenant).await {
            Ok(c) => c,
            Err(e) => {
                // A wait in a full endpoint's queue is no failure of it.
                in_flight.ended_by(&e);
                return Err(e);
            }
        };
        let sent = tokio::time::timeout_at(
            deadline,
            conn.send(self.parts, self.added, ReqBody::empty(), None),
        )
        .await;
        match sent {
            Ok(Ok(resp)) => {
                in_flight.responded(resp.status());
                Ok((resp, conn))
            }
            Ok(Err(e)) => {
                // As for the first copy: a stale pooled connection or a refused stream is
                // no failure of the endpoint.
                if not_its_failure(&e) {
                    in_flight.no_verdict();
                } else {
                    in_flight.failed();
                }
                Err(ProxyError::UpstreamReset(e.into()))
            }
            Err(_) => {
                in_flight.failed();
                Err(ProxyError::UpstreamTimeout)
            }
        }
    }
}

/// Runs `primary`; with a hedge, fires it after the delay (budget permitting) and returns
/// whichever response head comes first. A copy that failed, or answered 5xx, waits for the
/// other one (as Envoy discards a retriable answer while another attempt is out): an
/// endpoint that fails fast must not beat one that succeeds slowly. The wait ends at
/// `deadline` (the response deadline the caller enforces), with the 5xx held: a copy that
/// hangs must not turn a fast 503 into a late 504. A first copy that failed without its
/// endpoint's fault (its pooled connection closed before the request went out, its stream
/// refused unprocessed) is returned over the copy's 5xx: the caller sends it again, free.
/// The loser is dropped: its request is cancelled and its connection closed.
///
/// Without a hedge this is `primary` itself (no state around it, no copy of it): the
/// request's future stays as small as the send, and every move of it as cheap.
pub fn race<'a>(
    hedge: Option<Hedge<'a>>,
    primary: impl Future<Output = Result<http::Response<UpBody>, SendError>> + 'a,
    deadline: std::time::Instant,
) -> impl Future<Output = Raced<Result<http::Response<UpBody>, SendError>>> + 'a {
    match hedge {
        None => Either::Left(primary.map(Raced::Primary)),
        // The race's state (two sends, a timer, the copy's request) is kilobytes: on the
        // heap, and only for requests that may be hedged.
        Some(hedge) => Either::Right(Box::pin(race_hedged(hedge, primary, deadline.into()))),
    }
}

async fn race_hedged(
    hedge: Hedge<'_>,
    primary: impl Future<Output = Result<http::Response<UpBody>, SendError>>,
    deadline: tokio::time::Instant,
) -> Raced<Result<http::Response<UpBody>, SendError>> {
    let mut primary = std::pin::pin!(primary);
    tokio::select! {
        biased;
        r = &mut primary => return Raced::Primary(r),
        _ = tokio::time::sleep(hedge.delay) => {}
    }
    let cluster = hedge.cluster;
    // No other endpoint that is not ejected (one of two failed): no copy, and no budget
    // spent on one. Asked before the budget, picked after it: a pick may take a recovered
    // endpoint's probe, which only a copy that is sent may use.
    if !cluster.has_other_usable(hedge.avoid) || !cluster.try_spend_hedge() {
        return Raced::Primary(primary.await);
    }
    let Some(target) = cluster.pick_other(hedge.avoid) else {
        return Raced::Primary(primary.await);
    };
    cluster.stats.hedges_fired.fetch_add(1, Ordering::Relaxed);
    let mut second = std::pin::pin!(hedge.send(target, deadline));
    let failed = |r: &http::Response<UpBody>| r.status().is_server_error();
    // The copy's answer is the one used; it won only if it is no failure (a 5xx used
    // because the first copy had nothing better saved no request).
    let won = |h: (http::Response<UpBody>, Conn), first| {
        if !failed(&h.0) {
            cluster.stats.hedges_won.fetch_add(1, Ordering::Relaxed);
        }
        Raced::Hedge(Box::new(h), first)
    };
    tokio::select! {
        biased;
        r = &mut primary => match r {
            Ok(ref resp) if !failed(resp) => Raced::Primary(r),
            // An error or a 5xx: the copy's answer wins unless it is no better (a 5xx
            // after a 5xx: the first's).
            // A first copy that is no failure of its endpoint (sent on a connection the
            // server had closed, refused unprocessed) is sent again for free by the caller,
            // which a copy's `5xx` must not stand in for.
            _ => match tokio::time::timeout_at(deadline, &mut second).await {
                Ok(Ok(h)) if !failed(&h.0) || matches!(&r, Err(e) if !not_its_failure(e)) => {
                    let first = match &r {
                        Ok(resp) => First::Answered(resp.status()),
                        // A pooled connection the server had closed before the request
                        // went out, or a stream it refused unprocessed, says nothing
                        // against the endpoint: without the hedge the request is sent
                        // again and the endpoint not blamed.
                        Err(e) if not_its_failure(e) => First::NoVerdict,
                        Err(_) => First::Failed,
                    };
                    won(h, first)
                }
                _ => Raced::Primary(r),
            },
        },
        h = &mut second => match h {
            Ok(h) if !failed(&h.0) => won(h, First::Pending),
            // The copy's 5xx: the first's answer, if it has any.
            // A first copy still without an answer at the deadline timed out: a failure of
            // its endpoint, as it is without a hedge, not one abandoned for a faster copy
            // (its endpoint hung, and must not escape ejection behind the copies).
            // The first's failure that says nothing of its endpoint goes back to the caller,
            // which sends it again (see above).
            Ok(h) => match tokio::time::timeout_at(deadline, primary).await {
                Ok(Err(e)) if !not_its_failure(&e) => won(h, First::Failed),
                Err(_) => won(h, First::TimedOut),
                Ok(r) => Raced::Primary(r),
            },
            Err(e) => {
                tracing::debug!(error = %e, "hedged request failed; waiting for the first");
                Raced::Primary(primary.await)
            }
        },
    }
}

/// A first copy's failure that is no failure of its endpoint: its pooled connection was
/// closed before the request was written, or its server refused the stream unprocessed.
fn not_its_failure(e: &SendError) -> bool {
    matches!(e, SendError::NotSent(_)) || e.refused_before_processing()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_ordered_and_cover_their_values() {
        let mut last = 0;
        for ns in [
            0u64,
            20_000,
            100_000,
            1_000_000,
            7_500_000,
            50_000_000,
            2_000_000_000,
        ] {
            let b = bucket_of(ns);
            assert!(b >= last);
            last = b;
            assert!(
                bucket_top(b) >= ns,
                "{ns} ns in bucket {b} (top {})",
                bucket_top(b)
            );
            assert!(
                bucket_top(b) <= ns.max(1 << FLOOR_EXP) * 5 / 4 + 1,
                "{ns}: {}",
                bucket_top(b)
            );
        }
    }

    #[test]
    fn percentile_follows_the_samples() {
        let h = LatencyHistogram::new(950);
        for _ in 0..(MIN_SAMPLES - 1) {
            h.record(Duration::from_millis(1));
        }
        assert_eq!(h.value(), None, "too few samples");
        for _ in 0..(100 - MIN_SAMPLES + 1) {
            h.record(Duration::from_millis(1));
        }
        let p = h.value().expect("enough samples");
        assert!(
            p >= Duration::from_millis(1) && p <= Duration::from_micros(1250),
            "{p:?}"
        );
        // A third of the samples slow: the p95 is one of them.
        for i in 0..200 {
            h.record(if i % 2 == 0 {
                Duration::from_millis(40)
            } else {
                Duration::from_millis(1)
            });
        }
        let p = h.value().expect("enough samples");
        assert!(
            p >= Duration::from_millis(40) && p <= Duration::from_millis(50),
            "{p:?}"
        );
    }
}
