//! The one way a connection task is started: through the tenant it was classified to at
//! accept. Today every tenant shares the worker's scheduler; per-tenant scheduling groups
//! and connection caps attach here without touching the accept loop or the pipeline.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

/// A connection's place in the count of open connections, given up when its task's
/// future is dropped: when the connection ends, or with the runtime.
struct OpenSlot {
    open: Arc<[AtomicUsize]>,
    slot: usize,
}

impl Drop for OpenSlot {
    fn drop(&mut self) {
        self.open[self.slot].fetch_sub(1, Ordering::Relaxed);
    }
}

pin_project_lite::pin_project! {
    /// A connection's future with its [`OpenSlot`]. Not an `async` block around the
    /// future: that stored the connection's future twice (once captured, once awaited),
    /// which doubled every connection task's memory (13.5 KB against 6.7 KB) and put the
    /// block's state, read at every poll, a cache line away from the rest.
    struct Counted<F> {
        #[pin]
        fut: F,
        _open: OpenSlot,
    }
}

impl<F: Future> Future for Counted<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        self.project().fut.poll(cx)
    }
}

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
        tokio::spawn(Counted {
            fut,
            _open: OpenSlot {
                open: self.open.clone(),
                slot,
            },
        });
    }

    /// Open connections of a tenant (`None`: not classified at accept).
    pub fn open_connections(&self, tenant: Option<usize>) -> usize {
        self.open[self.slot(tenant)].load(Ordering::Relaxed)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_connection_counts_while_its_task_lives() {
        let spawner = TenantSpawner::new(2);
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
        let (ended_tx, ended_rx) = tokio::sync::oneshot::channel::<()>();
        spawner.spawn(Some(1), async move {
            let _ = done_rx.await;
            let _ = ended_tx.send(());
        });
        assert_eq!(spawner.open_connections(Some(1)), 1);
        assert_eq!(spawner.open_connections(Some(0)), 0);
        assert_eq!(spawner.open_connections(None), 0);
        done_tx.send(()).unwrap();
        ended_rx.await.unwrap();
        // The task's future is dropped right after it ends; give the runtime that turn.
        for _ in 0..100 {
            if spawner.open_connections(Some(1)) == 0 {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(spawner.open_connections(Some(1)), 0);
    }

    #[test]
    fn a_task_dropped_with_its_runtime_is_no_longer_counted() {
        let spawner = TenantSpawner::new(1);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            spawner.spawn(None, std::future::pending::<()>());
            tokio::task::yield_now().await;
        });
        assert_eq!(spawner.open_connections(None), 1);
        drop(rt);
        assert_eq!(spawner.open_connections(None), 0);
    }
}
