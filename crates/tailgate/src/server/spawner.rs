//! The one way a connection task is started: through the tenant it was classified to at
//! accept. Today every tenant shares the worker's scheduler; per-tenant scheduling groups
//! and connection caps attach here without touching the accept loop or the pipeline.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Spawns connection tasks and counts open connections per tenant (index = tenant,
/// last slot = connections not yet classified).
pub struct TenantSpawner {
    open: Arc<[AtomicUsize]>,
}

impl TenantSpawner {
    pub fn new(tenants: usize) -> TenantSpawner {
        TenantSpawner {
            open: (0..=tenants).map(|_| AtomicUsize::new(0)).collect(),
        }
    }

    fn slot(&self, tenant: Option<usize>) -> usize {
        tenant
            .unwrap_or(self.open.len() - 1)
            .min(self.open.len() - 1)
    }

    /// Starts `fut` on this worker on behalf of `tenant`.
    pub fn spawn<F>(&self, tenant: Option<usize>, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let slot = self.slot(tenant);
        self.open[slot].fetch_add(1, Ordering::Relaxed);
        let open = self.open.clone();
        tokio::spawn(async move {
            fut.await;
            open[slot].fetch_sub(1, Ordering::Relaxed);
        });
    }

    /// Open connections of a tenant (`None`: not classified at accept).
    pub fn open_connections(&self, tenant: Option<usize>) -> usize {
        self.open[self.slot(tenant)].load(Ordering::Relaxed)
    }
}
