//! Step 5 of the pipeline: pick an endpoint of the route's cluster and get a connection to
//! it — a warm pooled one when there is one.
//!
//! Pools are per data-plane worker (each worker is one thread with its own runtime), so a
//! checkout takes only an uncontended per-endpoint lock and never crosses threads.

mod pool;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

pub use pool::{Conn, EndpointPool, PoolStats};

use crate::config::Config;
use crate::pipeline::error::ProxyError;

/// One worker's view of a cluster: its endpoints' pools and the balancer's state.
pub struct ClusterPools {
    pub endpoints: Vec<Arc<EndpointPool>>,
    next: AtomicUsize,
}

impl ClusterPools {
    /// Round-robin over the endpoints.
    pub fn pick(&self) -> Result<&Arc<EndpointPool>, ProxyError> {
        if self.endpoints.is_empty() {
            return Err(ProxyError::NoEndpoints);
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.endpoints.len();
        Ok(&self.endpoints[i])
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
                    next: AtomicUsize::new(0),
                })
                .collect(),
        }
    }
}
