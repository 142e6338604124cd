//! The one way a connection task is started: through the tenant it was classified to at
//! accept. Today every tenant shares the worker's scheduler; per-tenant scheduling groups
//! and connection caps attach here without touching the accept loop or the pipeline.
//!
//! Open connections are also counted over every worker ([`ConnCount`]), against
//! `server.max_connections`: at the cap the accept loops stop accepting, so that new
//! connections wait in the kernel's listen queue (as nginx's `worker_connections` and
//! HAProxy's `maxconn` make them) instead of taking the file descriptors and memory the
//! open ones need. While an accept loop waits there, open connections that have been
//! doing nothing for a second (idle between requests, or silent since their accept) are
//! asked to close, a batch at a time (`Reclaim`), as nginx reuses its idle connections
//! when `worker_connections` run out: otherwise a client holding the cap's worth of idle
//! connections would keep every other client out for their whole idle timeout.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::pace::Every;

/// Open client connections over every worker, and the cap on them. On cache lines of its
/// own: every worker writes it at each accept and close.
#[derive(Debug)]
#[repr(align(128))]
pub struct ConnCount {
    open: AtomicUsize,
    /// `usize::MAX`: no cap.
    max: usize,
    /// Woken when a connection ends with the count at the cap.
    freed: tokio::sync::Notify,
    /// The call for idle connections to close while an accept loop waits at the cap.
    reclaim: Reclaim,
    /// Idle connections closed to make room under the cap.
    pub reclaimed: AtomicU64,
    /// Connections accepted since the start.
    pub accepted: AtomicU64,
    /// Times an accept loop stopped accepting because the cap was reached.
    pub pauses: AtomicU64,
    /// Failed accepts (out of file descriptors or memory, mostly).
    pub accept_errors: AtomicU64,
    /// TLS handshakes with clients, by [`TlsHandshake`].
    pub tls_handshakes: [AtomicU64; TlsHandshake::ALL.len()],
    /// Connections closed because a request head was not whole within
    /// `server.header_read_timeout`.
    pub header_timeouts: AtomicU64,
    /// At most one "clients refuse the certificate" warning per `WARN_EVERY` (10 s).
    pub cert_warning: Every,
    /// At most one "cap reached" warning per [`WARN_EVERY`].
    cap_warning: Every,
    /// At most one "accept failed" warning per [`WARN_EVERY`].
    error_warning: Every,
    /// Open connections per tenant, for those whose tenant the connection itself names
    /// (its listener's, or its TLS server name's), once it is known.
    per_tenant: Box<[AtomicUsize]>,
}

/// At most one warning of a kind this often: a gateway held at its cap, or out of file
/// descriptors, would otherwise log one per accept (every 50 ms per listener and worker).
const WARN_EVERY: Duration = Duration::from_secs(10);

/// While an accept loop waits at the cap: how often the open connections are asked for
/// idle ones to close, at first and again once one was; the most they are asked for at a
/// time; and how long a connection must have been doing nothing to be one. Each call wakes
/// every open connection once, on every worker (a busy one only looks and goes on; the cap
/// is one count over every worker, so the idle ones are looked for on every worker), so a
/// call that found none doing nothing is followed by the next one later and later (up to
/// [`RECLAIM_EVERY_MAX`]): a gateway held at its cap by busy connections is not woken
/// through and through for nothing. nginx frees at most 32 of its reusable
/// connections each time it runs out, and an eighth of them when it has fewer than 256.
const RECLAIM_EVERY: Duration = Duration::from_millis(100);
const RECLAIM_EVERY_MAX: Duration = Duration::from_secs(5);
const RECLAIM_BATCH: usize = 32;
/// A connection idle for less than this is not closed to make room: its client may be
/// about to send its next request (a close then races it, and a `POST` lost to the race is
/// one most clients do not send again).
pub const RECLAIM_MIN_IDLE: Duration = Duration::from_secs(1);

/// The call for idle connections to close, while an accept loop waits at
/// `server.max_connections` (see the module's doc).
#[derive(Debug)]
struct Reclaim {
    /// Moved on at each call; `None`: no cap, nothing to watch.
    signal: Option<tokio::sync::watch::Sender<u64>>,
    /// How many of this call's connections may still close.
    left: AtomicUsize,
    /// How many the last call asked for.
    batch: AtomicUsize,
    epoch: Instant,
    /// When the next call may be made (ms from `epoch`; 0: at once), and the pause before
    /// the one after it.
    next_ms: AtomicU64,
    every_ms: AtomicU64,
}

impl Reclaim {
    /// `capped`: the config has a `server.max_connections` (else nothing is ever asked).
    fn new(capped: bool) -> Reclaim {
        Reclaim {
            signal: capped.then(|| tokio::sync::watch::Sender::new(0)),
            left: AtomicUsize::new(0),
            batch: AtomicUsize::new(0),
            epoch: Instant::now(),
            next_ms: AtomicU64::new(0),
            every_ms: AtomicU64::new(RECLAIM_EVERY.as_millis() as u64),
        }
    }

    /// What tells a connection that it is asked (its value moves on); `None` without a
    /// cap, so that connections then hold and watch nothing.
    fn signal(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.signal
            .as_ref()
            .map(tokio::sync::watch::Sender::subscribe)
    }

    /// Asks for idle connections to close, if a call is due: `open` connections are open.
    fn ask(&self, open: usize) {
        let now = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.ask_at(open, now);
    }

    fn ask_at(&self, open: usize, now_ms: u64) {
        let Some(signal) = &self.signal else {
            return;
        };
        let next = self.next_ms.load(Ordering::Relaxed);
        if now_ms < next {
            return;
        }
        // None of the last call's batch was taken: none was doing nothing then.
        let every = if next != 0
            && self.left.load(Ordering::Relaxed) >= self.batch.load(Ordering::Relaxed)
        {
            (self.every_ms.load(Ordering::Relaxed) * 2).min(RECLAIM_EVERY_MAX.as_millis() as u64)
        } else {
            RECLAIM_EVERY.as_millis() as u64
        };
        if self
            .next_ms
            .compare_exchange(next, now_ms + every, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            return;
        }
        self.every_ms.store(every, Ordering::Relaxed);
        let batch = (open / 8).clamp(1, RECLAIM_BATCH);
        self.batch.store(batch, Ordering::Relaxed);
        self.left.store(batch, Ordering::Relaxed);
        signal.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// One of this call's batch, if any is left. The first one taken brings the pace back:
    /// the next call may come `RECLAIM_EVERY` after this one, not after the pause a run of
    /// fruitless calls had grown to (new connections would wait that long in the listen
    /// queue with idle ones to close).
    fn take(&self) -> bool {
        let Ok(left) = self
            .left
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
        else {
            return false;
        };
        if left == self.batch.load(Ordering::Relaxed) {
            let every = RECLAIM_EVERY.as_millis() as u64;
            let call = self
                .next_ms
                .load(Ordering::Relaxed)
                .saturating_sub(self.every_ms.load(Ordering::Relaxed));
            self.every_ms.store(every, Ordering::Relaxed);
            self.next_ms.fetch_min(call + every, Ordering::Relaxed);
        }
        true
    }
}

/// A connection's place in the count over every worker (and, once known, in its tenant's),
/// given back when dropped.
#[derive(Debug)]
pub struct ConnSlot {
    count: Arc<ConnCount>,
    tenant: Option<usize>,
}

impl ConnSlot {
    /// A request head on this connection was not whole within `header_read_timeout`.
    pub fn count_header_timeout(&self) {
        self.count.header_timeouts.fetch_add(1, Ordering::Relaxed);
    }

    fn new(count: Arc<ConnCount>) -> ConnSlot {
        ConnSlot {
            count,
            tenant: None,
        }
    }

    /// Counts the connection under `tenant` too (the first tenant given, if several are).
    pub fn classify(&mut self, tenant: usize) {
        if self.tenant.is_none()
            && let Some(n) = self.count.per_tenant.get(tenant)
        {
            n.fetch_add(1, Ordering::Relaxed);
            self.tenant = Some(tenant);
        }
    }

    /// What tells the connection that idle connections are asked to close (see
    /// `Reclaim`); `None` without a cap, so that connections then hold and watch nothing.
    pub fn reclaim_signal(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.count.reclaim.signal()
    }

    /// The connection, doing nothing when asked, may close to make room: true while the
    /// call's batch lasts (and then it is counted as reclaimed).
    pub fn take_reclaim(&self) -> bool {
        let taken = self.count.reclaim.take();
        if taken {
            self.count.reclaimed.fetch_add(1, Ordering::Relaxed);
        }
        taken
    }
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        if let Some(n) = self.tenant.and_then(|t| self.count.per_tenant.get(t)) {
            n.fetch_sub(1, Ordering::Relaxed);
        }
        if self.count.open.fetch_sub(1, Ordering::Relaxed) >= self.count.max {
            self.count.freed.notify_waiters();
        }
    }
}

/// How a client's TLS handshake ended (`tailgate_downstream_tls_handshakes_total`'s
/// `result`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsHandshake {
    Full,
    /// By a session ticket (or a TLS 1.2 session id).
    Resumed,
    Failed,
    /// Its hello begun, cut at `server.header_read_timeout` (or a second into a shutdown).
    TimedOut,
}

impl TlsHandshake {
    pub const ALL: [TlsHandshake; 4] = [
        TlsHandshake::Full,
        TlsHandshake::Resumed,
        TlsHandshake::Failed,
        TlsHandshake::TimedOut,
    ];

    pub fn label(self) -> &'static str {
        match self {
            TlsHandshake::Full => "full",
            TlsHandshake::Resumed => "resumed",
            TlsHandshake::Failed => "failed",
            TlsHandshake::TimedOut => "timed_out",
        }
    }
}

impl ConnCount {
    /// Counts a client's TLS handshake (once per connection, not per request).
    pub fn tls_handshake(&self, how: TlsHandshake) {
        self.tls_handshakes[how as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// `max` 0: no cap; `tenants`: how many the config has.
    pub fn new(max: usize, tenants: usize) -> ConnCount {
        ConnCount {
            open: AtomicUsize::new(0),
            max: if max == 0 { usize::MAX } else { max },
            freed: tokio::sync::Notify::new(),
            reclaim: Reclaim::new(max != 0),
            reclaimed: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            pauses: AtomicU64::new(0),
            accept_errors: AtomicU64::new(0),
            tls_handshakes: Default::default(),
            header_timeouts: AtomicU64::new(0),
            cert_warning: Every::new(WARN_EVERY),
            cap_warning: Every::new(WARN_EVERY),
            error_warning: Every::new(WARN_EVERY),
            per_tenant: (0..tenants).map(|_| AtomicUsize::new(0)).collect(),
        }
    }

    /// Open connections of each tenant (by the config's index) that the connection itself
    /// names.
    pub fn per_tenant(&self) -> impl Iterator<Item = usize> + '_ {
        self.per_tenant.iter().map(|n| n.load(Ordering::Relaxed))
    }

    /// Client connections open now, over every worker.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Counts a failed accept, and says so at most every 10 s (with how many failed).
    pub fn accept_failed(&self, listener: &str, error: &std::io::Error) {
        let failed = self.accept_errors.fetch_add(1, Ordering::Relaxed) + 1;
        if self.error_warning.due() {
            tracing::warn!(listener.name = %listener, error = %error, failed_so_far = failed, "accept failed; retrying in 50 ms (at most one such warning every 10 s)");
        }
    }

    /// A place for a connection just accepted, if one is free under the cap.
    pub fn try_take(self: &Arc<Self>) -> Option<ConnSlot> {
        self.open
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < self.max).then_some(n + 1)
            })
            .ok()?;
        self.accepted.fetch_add(1, Ordering::Relaxed);
        Some(ConnSlot::new(self.clone()))
    }

    /// A place for a connection the cap does not apply to (one queued at shutdown).
    pub fn take_past_cap(self: &Arc<Self>) -> ConnSlot {
        self.open.fetch_add(1, Ordering::Relaxed);
        self.accepted.fetch_add(1, Ordering::Relaxed);
        ConnSlot::new(self.clone())
    }

    /// A place for a connection just accepted, waiting (counted as a pause, with a
    /// warning at most every 10 s) until one is free when the cap is reached. The accept
    /// loop that calls it accepts nothing more meanwhile: further connections wait in the
    /// kernel's listen queue. Meanwhile the open connections doing nothing are asked to
    /// close (`Reclaim`).
    pub async fn take(self: &Arc<Self>, listener: &str) -> ConnSlot {
        if let Some(slot) = self.try_take() {
            return slot;
        }
        self.pauses.fetch_add(1, Ordering::Relaxed);
        if self.cap_warning.due() {
            tracing::warn!(listener.name = %listener, max_connections = self.max, "server.max_connections reached: new connections wait in the listen queue until open ones close");
        }
        loop {
            let freed = self.freed.notified();
            let mut freed = std::pin::pin!(freed);
            // Registered before the count is tried again: a connection that ends after the
            // try wakes this wait.
            freed.as_mut().enable();
            if let Some(slot) = self.try_take() {
                return slot;
            }
            self.reclaim.ask(self.open());
            let _ = tokio::time::timeout(RECLAIM_EVERY, freed).await;
        }
    }
}

/// Spawns connection tasks on behalf of the tenant each was classified to at accept (its
/// listener's; `None`: not classified then). Per-tenant scheduling groups attach here. Open
/// connections are counted by their [`ConnSlot`]s (per tenant once known, which for TLS is
/// after the handshake's server name), not here.
pub struct TenantSpawner {
    _tenants: usize,
}

impl TenantSpawner {
    pub fn new(tenants: usize) -> TenantSpawner {
        TenantSpawner { _tenants: tenants }
    }

    /// Starts `fut` on this worker on behalf of `tenant`.
    pub fn spawn<F>(&self, tenant: Option<usize>, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        // Every tenant shares the worker's scheduler for now.
        let _ = tenant;
        tokio::spawn(fut);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A connection counts over every worker from accept, and under its tenant once
    /// classified (once, to the first tenant given), until its slot is dropped.
    #[test]
    fn a_slot_counts_under_its_tenant_once_classified() {
        let total = Arc::new(ConnCount::new(0, 2));
        let mut slot = total.try_take().unwrap();
        assert_eq!(total.open(), 1);
        assert_eq!(total.per_tenant().collect::<Vec<_>>(), [0, 0]);
        slot.classify(1);
        slot.classify(0);
        assert_eq!(total.per_tenant().collect::<Vec<_>>(), [0, 1]);
        drop(slot);
        assert_eq!(total.open(), 0);
        assert_eq!(total.per_tenant().collect::<Vec<_>>(), [0, 0]);
    }

    #[test]
    fn a_task_dropped_with_its_runtime_is_no_longer_counted() {
        let spawner = TenantSpawner::new(1);
        let total = Arc::new(ConnCount::new(0, 0));
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            let slot = total.take_past_cap();
            spawner.spawn(None, async move {
                let _slot = slot;
                std::future::pending::<()>().await
            });
            tokio::task::yield_now().await;
        });
        assert_eq!(total.open(), 1);
        drop(rt);
        assert_eq!(total.open(), 0);
    }

    /// At the cap, `take` waits until a connection ends, and counts the pause; the count
    /// never passes the cap.
    #[tokio::test]
    async fn take_waits_at_the_cap_until_a_connection_ends() {
        let total = Arc::new(ConnCount::new(2, 0));
        let spawner = TenantSpawner::new(0);
        let mut ends = Vec::new();
        for _ in 0..2 {
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            let slot = total.try_take().unwrap();
            spawner.spawn(None, async move {
                let _slot = slot;
                let _ = rx.await;
            });
            ends.push(tx);
        }
        assert_eq!(total.open(), 2);
        assert!(total.try_take().is_none());
        let waiting = tokio::time::timeout(Duration::from_millis(100), total.take("t")).await;
        assert!(waiting.is_err(), "a place was given at the cap");
        assert_eq!(total.pauses.load(Ordering::Relaxed), 1);
        let taking = tokio::spawn({
            let total = total.clone();
            async move { total.take("t").await }
        });
        tokio::task::yield_now().await;
        assert!(!taking.is_finished());
        drop(ends.pop());
        let slot = tokio::time::timeout(Duration::from_secs(5), taking)
            .await
            .expect("a place once a connection ended")
            .unwrap();
        assert_eq!(total.open(), 2);
        assert_eq!(total.accepted.load(Ordering::Relaxed), 3);
        drop(slot);
        assert_eq!(total.open(), 1);
        // No cap: never waits.
        let free = Arc::new(ConnCount::new(0, 0));
        let _slot = free.take("t").await;
        assert_eq!(free.pauses.load(Ordering::Relaxed), 0);
    }

    /// A wait at the cap asks the open connections for idle ones to close: the signal moves
    /// on, and a batch of them may (an eighth of those open, one at least);
    /// not more. Without a cap there is no signal to watch.
    #[tokio::test]
    async fn a_wait_at_the_cap_asks_for_a_batch_of_idle_connections() {
        let total = Arc::new(ConnCount::new(1, 0));
        let open = total.try_take().unwrap();
        let mut signal = open.reclaim_signal().unwrap();
        assert!(!open.take_reclaim(), "nothing asked yet");
        let waiting = tokio::spawn({
            let total = total.clone();
            async move { total.take("t").await }
        });
        tokio::time::timeout(Duration::from_secs(5), signal.changed())
            .await
            .expect("asked")
            .unwrap();
        let taken = (0..4).filter(|_| open.take_reclaim()).count();
        assert_eq!(taken, 1);
        assert_eq!(total.reclaimed.load(Ordering::Relaxed), 1);
        drop(open);
        let slot = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(total.open(), 1);
        drop(slot);
        let free = Arc::new(ConnCount::new(0, 0));
        assert!(free.try_take().unwrap().reclaim_signal().is_none());
    }

    /// Calls that find no connection doing nothing come later and later, up to
    /// `RECLAIM_EVERY_MAX`; one that finds one brings the pace back.
    #[test]
    fn calls_that_find_no_idle_connection_slow_down() {
        let r = Reclaim::new(true);
        let rx = r.signal().unwrap();
        let asked = |r: &Reclaim, at: u64| {
            let before = *rx.borrow();
            r.ask_at(800, at);
            *rx.borrow() != before
        };
        assert!(asked(&r, 0));
        assert_eq!(r.left.load(Ordering::Relaxed), RECLAIM_BATCH.min(100));
        assert!(!asked(&r, 50), "paced");
        // Nothing taken: 200 ms, then 400 ms, ...
        assert!(asked(&r, 100));
        assert!(!asked(&r, 250));
        assert!(asked(&r, 300));
        assert!(!asked(&r, 650));
        assert!(asked(&r, 700));
        let mut at = 700;
        for _ in 0..10 {
            at += RECLAIM_EVERY_MAX.as_millis() as u64;
            assert!(asked(&r, at));
        }
        // One taken: the next call 100 ms after this one, not the 5 s the pace had come to
        // (the listen queue waited that long with idle connections to close); and 100 ms
        // after that one.
        assert!(r.take());
        assert!(!asked(&r, at + 50), "paced");
        assert!(asked(&r, at + 100));
        assert!(!asked(&r, at + 150), "paced");
        assert!(asked(&r, at + 200));
    }
}
