//! Step 5 of the pipeline: pick an endpoint of the route's cluster and get a connection to
//! it — a warm pooled one when there is one.
//!
//! Pools are per data-plane worker (each worker is one thread with its own runtime), so a
//! checkout takes only an uncontended per-endpoint lock and never crosses threads.

mod balance;
mod pool;

pub use balance::Balance;

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

pub use pool::{Conn, EndpointPool, PoolStats};

use crate::config::Config;
use crate::pipeline::error::ProxyError;

/// One worker's view of a cluster: its endpoints' pools and the balancer's state.
pub struct ClusterPools {
    pub endpoints: Vec<Arc<EndpointPool>>,
    balance: Balance,
    next: AtomicU64,
}

impl ClusterPools {
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
                })
                .collect(),
        }
    }
}
