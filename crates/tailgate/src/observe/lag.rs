//! The runtime lag probe (seed 002: a starved scheduler got fly-proxy killed by its systemd
//! watchdog). Each worker runs one task that asks to be woken every `interval` and records
//! how late it actually ran: a worker blocked or overloaded for 300 ms shows up as a 300 ms
//! observation, and its last tick time goes stale (what `/healthz` and the watchdog check).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::metrics::WorkerMetrics;

/// Runs on the worker's runtime for as long as the worker runs.
pub async fn probe(metrics: Arc<WorkerMetrics>, interval: Duration) {
    metrics.record_lag(Duration::ZERO);
    let mut due = Instant::now() + interval;
    loop {
        tokio::time::sleep_until(due).await;
        let now = Instant::now();
        metrics.record_lag(now.saturating_duration_since(due));
        due = now + interval;
    }
}
