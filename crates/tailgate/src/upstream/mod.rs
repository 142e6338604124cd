//! Step 5 of the pipeline: pick an endpoint of the route's cluster and get a connection to
//! it — a warm pooled one when there is one.
//!
//! Pools are per data-plane worker (each worker is one thread with its own runtime), so a
//! checkout takes only an uncontended per-endpoint lock and never crosses threads.

mod balance;
mod pool;

pub use balance::Balance;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub use pool::{Conn, EndpointPool, PoolStats};

use crate::config::Config;
use crate::pipeline::error::ProxyError;

/// The retry budget's window, and the retries it always allows per second of it.
const BUDGET_WINDOW: std::time::Duration = std::time::Duration::from_secs(10);
const BUDGET_FLOOR_PER_SEC: u64 = 10;

/// One worker's view of a cluster: its endpoints' pools and the balancer's state.
pub struct ClusterPools {
    pub endpoints: Vec<Arc<EndpointPool>>,
    balance: Balance,
    next: AtomicU64,
    /// Requests sent to this cluster, and retries spent, for the retry budget.
    requests: AtomicU64,
    retries_spent: AtomicU64,
    budget_percent: u32,
    epoch: std::time::Instant,
    window_start: AtomicU64,
    /// Retries refused by the budget.
    pub budget_exhausted: AtomicU64,
}

impl ClusterPools {
    /// Counts a request against the retry budget.
    pub fn count_request(&self) {
        self.roll_window();
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    /// May one more retry be spent? Within a 10 s window, retries stay within
    /// `retry_budget_percent` of requests plus a floor of 10 per second (as linkerd's and
    /// Finagle's budgets do), so a quiet cluster can still retry but retries cannot multiply
    /// an outage's load.
    pub fn try_spend_retry(&self) -> bool {
        self.roll_window();
        let allowed = BUDGET_FLOOR_PER_SEC * BUDGET_WINDOW.as_secs()
            + self.requests.load(Ordering::Relaxed) * u64::from(self.budget_percent) / 100;
        if self.retries_spent.load(Ordering::Relaxed) < allowed {
            self.retries_spent.fetch_add(1, Ordering::Relaxed);
            true
        } else {
            self.budget_exhausted.fetch_add(1, Ordering::Relaxed);
            false
        }
    }

    fn roll_window(&self) {
        let now = self.epoch.elapsed().as_secs();
        let start = self.window_start.load(Ordering::Relaxed);
        if now >= start + BUDGET_WINDOW.as_secs() {
            // One worker thread uses this state: no other writer races the reset.
            self.window_start.store(now, Ordering::Relaxed);
            self.requests.store(0, Ordering::Relaxed);
            self.retries_spent.store(0, Ordering::Relaxed);
        }
    }

    /// Picks an endpoint (never `exclude` when there is another): its index and pool.
    pub fn pick(&self, exclude: Option<usize>) -> Result<(usize, &Arc<EndpointPool>), ProxyError> {
        if self.endpoints.is_empty() {
            return Err(ProxyError::NoEndpoints);
        }
        let i = balance::pick(
            self.balance,
            self.endpoints.len(),
            |i| &self.endpoints[i].load,
            &self.next,
            exclude,
        );
        Ok((i, &self.endpoints[i]))
    }
}

/// All clusters' pools for one worker, indexed like the config's clusters.
pub struct Upstreams {
    pub clusters: Vec<ClusterPools>,
}

impl Upstreams {
    /// Starts each endpoint's warm-connection keeper on the current (worker) runtime.
    pub fn start_background(&self) {
        for c in &self.clusters {
            for e in &c.endpoints {
                tokio::spawn(e.clone().keep_warm());
            }
        }
    }

    /// Sums one statistic over every endpoint of every cluster.
    pub fn sum(&self, f: impl Fn(&pool::PoolStats) -> u64) -> u64 {
        self.clusters
            .iter()
            .flat_map(|c| c.endpoints.iter())
            .map(|e| f(&e.stats))
            .sum()
    }

    pub fn new(config: &Config) -> Upstreams {
        Upstreams {
            clusters: config
                .clusters
                .iter()
                .map(|c| ClusterPools {
                    endpoints: c
                        .endpoints
                        .iter()
                        .map(|&a| Arc::new(EndpointPool::new(a, c)))
                        .collect(),
                    balance: c.balance,
                    next: AtomicU64::new(0),
                    requests: AtomicU64::new(0),
                    retries_spent: AtomicU64::new(0),
                    budget_percent: c.retry_budget_percent,
                    epoch: std::time::Instant::now(),
                    window_start: AtomicU64::new(0),
                    budget_exhausted: AtomicU64::new(0),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn retry_budget_has_a_floor_and_a_ratio() {
        let cfg = Config::parse(
            Path::new("t.toml"),
            "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"127.0.0.1:1\"]\nretry_budget_percent = 20\n",
        )
        .expect("valid");
        let ups = Upstreams::new(&cfg);
        let c = &ups.clusters[0];
        // With no requests yet, the floor (10/s over a 10 s window) allows 100 retries.
        for _ in 0..100 {
            assert!(c.try_spend_retry());
        }
        assert!(!c.try_spend_retry());
        // Each request adds 20 % of a retry.
        for _ in 0..50 {
            c.count_request();
        }
        for _ in 0..10 {
            assert!(c.try_spend_retry());
        }
        assert!(!c.try_spend_retry());
        assert_eq!(c.budget_exhausted.load(Ordering::Relaxed), 2);
    }
}
