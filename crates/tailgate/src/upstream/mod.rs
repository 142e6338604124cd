//! Step 5 of the pipeline: pick an endpoint of the route's cluster and get a connection to
//! it — a warm pooled one when there is one: an idle HTTP/1.1 connection (`pool.rs`) or a
//! stream on a shared HTTP/2 one (`multiplex.rs`), handed to the pipeline as a [`Conn`]
//! (`conn.rs`); `https://` endpoints add TLS (`tls.rs`).
//!
//! Pools are per data-plane worker (each worker is one thread with its own runtime), so a
//! checkout takes only an uncontended per-endpoint lock and never crosses threads. Workers
//! share only a cluster's TLS session cache, touched once per TLS connect, and the count of
//! its requests in flight under `max_requests` (clusters with one), touched twice a request.
//! `max_connections_per_endpoint` is per worker, as the pools are (`limit.rs`).
//!
//! A cluster's endpoint list can change while requests run (host-name endpoints, [`dns`]):
//! it sits behind an `ArcSwap`, so a request loads it without a lock, and an update keeps the
//! pools (connections, counters, balancer state) of addresses that stay.

mod balance;
mod conn;
pub mod dns;
mod h1;
pub mod hedge;
mod limit;
mod multiplex;
mod pool;
pub(crate) mod tls;

pub use balance::Balance;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use arc_swap::ArcSwap;

pub use conn::{Conn, NotSentBody, Protocol, SendError, UpBody};
pub use h1::{H1Error, Upgraded};
pub use pool::{EndpointPool, GoneEndpoint, GonePools, PoolStats};
pub use tls::UpstreamTls;

use crate::config::{Cluster, Config};
use crate::pipeline::error::ProxyError;

/// Events of one cluster on one worker.
#[derive(Debug, Default)]
pub struct ClusterStats {
    /// New endpoint lists applied (from DNS).
    pub endpoint_updates: AtomicU64,
    pub endpoints_added: AtomicU64,
    /// Endpoints removed; their pools are drained (idle connections closed, keeper stopped).
    pub endpoints_removed: AtomicU64,
    /// Second copies sent ([`hedge`]).
    pub hedges_fired: AtomicU64,
    /// Hedges whose answer was used, and was no `5xx`: it came first, or the first copy
    /// failed.
    pub hedges_won: AtomicU64,
    /// Hedges not sent because the hedge or retry budget was spent.
    pub hedges_refused: AtomicU64,
    /// Requests refused (503) because `max_requests` were in flight to the cluster.
    pub overflows: AtomicU64,
}

/// The retry budget's window, and the retries it always allows per second of it.
const BUDGET_WINDOW: std::time::Duration = std::time::Duration::from_secs(10);
const BUDGET_FLOOR_PER_SEC: u64 = 10;

/// One worker's view of a cluster: its endpoints' pools and the balancer's state.
pub struct ClusterPools {
    /// Swapped whole when the cluster's addresses change; loaded without a lock.
    pub endpoints: ArcSwap<Vec<Arc<EndpointPool>>>,
    pub stats: ClusterStats,
    /// The cluster's settings, for pools of new addresses.
    config: Cluster,
    /// Where its addresses come from when it has host-name endpoints.
    feed: Option<dns::ClusterFeed>,
    /// Pools of addresses left out of the latest DNS answer, by address, in case it comes
    /// back (see `Self::set_addrs_locked`). Held weakly: a parked pool's own task keeps it, and
    /// drains and lets it go after the cluster's `idle_timeout`. Swapped whole by the worker
    /// (the one writer) and read by scrapes without a lock, as `endpoints` is.
    parked: ArcSwap<Vec<(SocketAddr, Weak<EndpointPool>)>>,
    /// The counts of its drained pools, shared with the other workers' (see
    /// [`pool::GonePools`]).
    pub gone: Arc<pool::GonePools>,
    balance: Balance,
    next: AtomicU64,
    /// Requests sent to this cluster, and retries spent, for the retry budget.
    requests: AtomicU64,
    retries_spent: AtomicU64,
    budget_percent: u32,
    hedges_spent: AtomicU64,
    hedge_budget_percent: u32,
    epoch: Instant,
    window_start: AtomicU64,
    /// Retries refused by the budget.
    pub budget_exhausted: AtomicU64,
    /// The cluster's requests in flight over every worker, under its `max_requests`
    /// (`None`: no cap).
    cap: Option<Arc<RequestCap>>,
}

/// Requests in flight to one cluster over every worker, and its `max_requests`. One count
/// for the whole gateway, as Envoy's circuit breakers keep one per cluster: a count split
/// over the workers would refuse on one worker while another had room. Workers touch it
/// only on clusters with a cap, twice a request (take, give back), on a cache line of its
/// own.
#[repr(align(128))]
pub struct RequestCap {
    count: AtomicUsize,
    max: usize,
}

/// What the workers' [`Upstreams`] share per cluster, made once: its [`RequestCap`] count,
/// and its drained pools' counts.
pub struct ClusterShared {
    caps: Vec<Option<Arc<RequestCap>>>,
    /// Each cluster's drained pools' counts, over every worker (see [`pool::GonePools`]).
    gone: Vec<Arc<pool::GonePools>>,
}

impl ClusterShared {
    /// A count for each cluster with a `max_requests`, and each cluster's drained pools'
    /// counts, indexed like the config's clusters.
    pub fn new(config: &Config) -> ClusterShared {
        ClusterShared {
            caps: config
                .clusters
                .iter()
                .map(|c| {
                    (c.max_requests > 0).then(|| {
                        Arc::new(RequestCap {
                            count: AtomicUsize::new(0),
                            max: c.max_requests,
                        })
                    })
                })
                .collect(),
            gone: config.clusters.iter().map(|_| Arc::default()).collect(),
        }
    }
}

/// A request's place among those in flight to its cluster; given back when dropped: when
/// its response has ended (or its tunnel has), or it failed or went away. It holds the
/// worker's own [`ClusterPools`] (its reference count is this worker's alone), not the
/// shared count, whose line every worker writes already twice a request.
pub struct Admitted(Arc<ClusterPools>);

impl Drop for Admitted {
    fn drop(&mut self) {
        if let Some(cap) = &self.0.cap {
            cap.count.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl ClusterPools {
    /// A place among the requests in flight to this cluster, or `UpstreamOverflow`
    /// (counted) when its `max_requests` are taken, over every worker. Without a cap
    /// nothing is counted (`None`).
    #[inline]
    pub fn admit(self: &Arc<Self>) -> Result<Option<Admitted>, ProxyError> {
        let Some(cap) = &self.cap else {
            return Ok(None);
        };
        // Taken only below the cap, so the count never passes it, even for a moment.
        match cap
            .count
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < cap.max).then_some(n + 1)
            }) {
            Ok(_) => Ok(Some(Admitted(self.clone()))),
            Err(_) => {
                self.stats.overflows.fetch_add(1, Ordering::Relaxed);
                Err(ProxyError::UpstreamOverflow)
            }
        }
    }

    /// Counts a request against the retry budget, at `now`: the pipeline's reading that ends
    /// the route stage (no clock read of its own per request).
    pub fn count_request_at(&self, now: Instant) {
        self.roll_window_at(now);
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    /// May one more retry be spent? Within a 10 s window, retries stay within
    /// `retry_budget_percent` of requests plus a floor of 10 per second (as linkerd's and
    /// Finagle's budgets do), so a quiet cluster can still retry but retries cannot multiply
    /// an outage's load.
    pub fn try_spend_retry(&self) -> bool {
        let spent = self.spend_retry();
        if !spent {
            self.budget_exhausted.fetch_add(1, Ordering::Relaxed);
        }
        spent
    }

    /// [`try_spend_retry`](Self::try_spend_retry) without counting a refusal: a hedge the
    /// budget refuses is counted once, as a refused hedge, not also as a refused retry.
    fn spend_retry(&self) -> bool {
        self.roll_window();
        let allowed = BUDGET_FLOOR_PER_SEC * BUDGET_WINDOW.as_secs()
            + self.requests.load(Ordering::Relaxed) * u64::from(self.budget_percent) / 100;
        if self.retries_spent.load(Ordering::Relaxed) < allowed {
            self.retries_spent.fetch_add(1, Ordering::Relaxed);
            true
        } else {
            false
        }
    }

    /// May a hedge be sent? Hedges stay within `hedge_budget_percent` of the requests in the
    /// window (no floor), and each one also spends a retry, so retries and hedges together
    /// stay within the retry budget.
    pub fn try_spend_hedge(&self) -> bool {
        self.roll_window();
        let allowed =
            self.requests.load(Ordering::Relaxed) * u64::from(self.hedge_budget_percent) / 100;
        if self.hedges_spent.load(Ordering::Relaxed) < allowed && self.spend_retry() {
            self.hedges_spent.fetch_add(1, Ordering::Relaxed);
            true
        } else {
            self.stats.hedges_refused.fetch_add(1, Ordering::Relaxed);
            false
        }
    }

    fn roll_window(&self) {
        self.roll_window_at(Instant::now());
    }

    fn roll_window_at(&self, now: Instant) {
        let now = now.saturating_duration_since(self.epoch).as_secs();
        let start = self.window_start.load(Ordering::Relaxed);
        if now >= start + BUDGET_WINDOW.as_secs() {
            // One worker thread uses this state: no other writer races the reset.
            self.window_start.store(now, Ordering::Relaxed);
            self.requests.store(0, Ordering::Relaxed);
            self.retries_spent.store(0, Ordering::Relaxed);
            self.hedges_spent.store(0, Ordering::Relaxed);
        }
    }

    /// Picks an endpoint's pool (never the one at `exclude` when there is another). The
    /// endpoint to avoid is named by its address, not its place in the list: the list may
    /// have been swapped since it was picked (a new DNS answer: an address added or gone,
    /// and the places after it shift).
    pub fn pick(&self, exclude: Option<SocketAddr>) -> Result<Arc<EndpointPool>, ProxyError> {
        let endpoints = self.endpoints.load();
        if endpoints.is_empty() {
            // Its names have no address (yet): ask the resolver to try again now, as a
            // failed connect does, rather than after its backoff (up to `max_refresh`).
            if let Some(feed) = &self.feed {
                feed.request_refresh();
            }
            return Err(ProxyError::NoEndpoints);
        }
        let i = self.choose(&endpoints, |i| exclude == Some(endpoints[i].addr));
        Ok(endpoints[i].clone())
    }

    /// The balancer's pick among `endpoints` (never an `excluded` one when there is
    /// another), unless it is at its `max_connections_per_endpoint` with none idle (a
    /// request sent there would queue) and another has room: then that one, as HAProxy's
    /// balancer passes over a server at its `maxconn`. Never an `excluded` one, nor an
    /// ejected one unless the pick was too. A request queues only where every endpoint is
    /// full.
    fn choose(&self, endpoints: &[Arc<EndpointPool>], excluded: impl Fn(usize) -> bool) -> usize {
        let i = balance::pick(
            self.balance,
            endpoints.len(),
            |i| &endpoints[i].load,
            &self.next,
            &excluded,
        );
        // Without the setting (most clusters), one compare on the cluster, not a look at
        // the endpoint's pool.
        if self.config.max_connections_per_endpoint == 0
            || endpoints.len() < 2
            || !endpoints[i].is_full()
        {
            return i;
        }
        let j = balance::pick(
            self.balance,
            endpoints.len(),
            |i| &endpoints[i].load,
            &self.next,
            |j| excluded(j) || endpoints[j].is_full(),
        );
        let (a, b) = (&endpoints[i], &endpoints[j]);
        if !excluded(j) && !b.is_full() && (!b.load.is_ejected() || a.load.is_ejected()) {
            j
        } else {
            i
        }
    }

    /// Whether an endpoint other than `avoid` is not ejected (a hedge has somewhere to go),
    /// asked without drawing from the balancer.
    pub fn has_other_usable(&self, avoid: SocketAddr) -> bool {
        self.endpoints
            .load()
            .iter()
            .any(|p| p.addr != avoid && !p.load.is_ejected())
    }

    /// An endpoint other than `avoid` that is not ejected, by the balancer (a hedge's
    /// target); `None` when there is none. Unlike [`pick`](Self::pick), it does not fall
    /// back to an ejected endpoint: a second copy is worth sending only where a first would
    /// be.
    pub fn pick_other(&self, avoid: SocketAddr) -> Option<Arc<EndpointPool>> {
        let endpoints = self.endpoints.load();
        // A list of one may still be another endpoint: `avoid` may be an address a new DNS
        // answer replaced (the balancer then picks that one, and it is checked below).
        if endpoints.is_empty() {
            return None;
        }
        let pool = &endpoints[self.choose(&endpoints, |i| endpoints[i].addr == avoid)];
        (pool.addr != avoid && !pool.load.is_ejected()).then(|| pool.clone())
    }

    /// How many endpoints the cluster has now.
    pub fn endpoint_count(&self) -> usize {
        self.endpoints.load().len()
    }

    /// Does the cluster have an endpoint at an address other than `avoid` (ejected or not)?
    /// An address listed twice (a crude weight) is one endpoint to a retry.
    pub fn has_other_address(&self, avoid: SocketAddr) -> bool {
        self.endpoints.load().iter().any(|p| p.addr != avoid)
    }

    /// A connection to `pool`; a failed connect to a resolved address asks for an early
    /// re-resolution of the cluster's names (the name may have moved: failover).
    /// A wait under `max_connections_per_endpoint` is in `tenant`'s lane of the queue.
    pub async fn checkout(
        &self,
        pool: &Arc<EndpointPool>,
        tenant: Option<usize>,
    ) -> Result<Conn, ProxyError> {
        self.checkout_at(pool, Instant::now(), tenant).await
    }

    /// [`Self::checkout`] at `now`, a clock reading the caller already took.
    pub async fn checkout_at(
        &self,
        pool: &Arc<EndpointPool>,
        now: Instant,
        tenant: Option<usize>,
    ) -> Result<Conn, ProxyError> {
        let r = pool.checkout_at(now, tenant).await;
        if let Err(e) = &r {
            self.connect_failed(pool.addr, e);
        }
        r
    }

    /// A connect to `addr`, one of the cluster's endpoints, ended in `e`: a refused or
    /// timed-out one asks for an early re-resolution of the cluster's names (the name may
    /// have moved: failover), and so does a failed TLS handshake (the address may be
    /// another service's by now, whose certificate is not the name's). Not for an endpoint
    /// written as an address (a cluster may have both kinds): no name's answer would move
    /// it, and a dead one asked the name servers again at every `min_refresh` for as long
    /// as it stayed down.
    pub fn connect_failed(&self, addr: SocketAddr, e: &ProxyError) {
        if let (
            ProxyError::UpstreamConnect(_)
            | ProxyError::ConnectTimeout
            | ProxyError::UpstreamTls(_),
            Some(feed),
        ) = (e, &self.feed)
            && !self.config.endpoints.contains(&addr)
        {
            feed.request_refresh();
        }
    }

    /// [`Self::set_addrs_locked`], the lock waited for.
    #[cfg(test)]
    pub fn set_addrs(&self, addrs: &[SocketAddr]) {
        self.set_addrs_locked(addrs, &mut self.gone.lock());
    }

    /// Applies a new address list on this worker: pools of addresses that stay are kept
    /// (with their connections and counters), new addresses get new pools whose warm keepers
    /// start. Runs on the worker's runtime.
    ///
    /// A removed address's pool is set aside (parked) for the cluster's `idle_timeout`
    /// rather than drained at once (by its own keeper or sweeper task, on its next tick past
    /// that time): a name whose servers answer a changing subset of its
    /// addresses (Consul answers three healthy nodes at random, Route 53's multivalue
    /// answers up to eight) would otherwise close and reopen connections at every lookup,
    /// and each request on a reopened one pays a connect (seed 004). A parked pool takes no
    /// request; its idle connections expire as they would have; if the address comes back
    /// meanwhile, so does the pool, connections, latency estimate and all. Past that time it
    /// is drained.
    ///
    /// Called under the lock of the cluster's drained pools, `gone`: every change to the
    /// lists a scrape reads (pools added, parked, brought back, drained) is made under the
    /// lock it reads them under (see `pool::GonePools`).
    fn set_addrs_locked(&self, addrs: &[SocketAddr], gone: &mut pool::Gone) {
        let old = self.endpoints.load_full();
        let park = !self.config.idle_timeout.is_zero();
        // Those drained meanwhile are gone for good.
        let mut parked: Vec<_> = self
            .parked
            .load()
            .iter()
            .filter(|(_, w)| w.upgrade().is_some_and(|p| p.is_parked_live()))
            .cloned()
            .collect();
        let mut next = Vec::with_capacity(addrs.len());
        let (mut added, mut removed) = (0, 0);
        for &a in addrs {
            if let Some(p) = old.iter().find(|p| p.addr == a) {
                next.push(p.clone());
                continue;
            }
            added += 1;
            let back = parked
                .iter()
                .position(|(addr, _)| *addr == a)
                .and_then(|i| parked.swap_remove(i).1.upgrade())
                .filter(|p| p.unpark());
            if let Some(p) = back {
                next.push(p);
                continue;
            }
            let p = Arc::new(EndpointPool::new(a, &self.config, &self.gone, gone));
            tokio::spawn(p.clone().keep_warm());
            next.push(p);
        }
        for p in old.iter().filter(|p| !addrs.contains(&p.addr)) {
            removed += 1;
            if park {
                p.park();
                parked.push((p.addr, Arc::downgrade(p)));
            } else {
                p.retire_into(gone);
            }
        }
        self.parked.store(Arc::new(parked));
        if added == 0 && removed == 0 {
            return;
        }
        self.endpoints.store(Arc::new(next));
        self.stats.endpoint_updates.fetch_add(1, Ordering::Relaxed);
        self.stats
            .endpoints_added
            .fetch_add(added, Ordering::Relaxed);
        self.stats
            .endpoints_removed
            .fetch_add(removed, Ordering::Relaxed);
    }

    /// Pools of addresses out of the latest DNS answer and not drained yet (their counters
    /// and connections still count in `/metrics`).
    pub fn parked_pools(&self) -> Vec<Arc<EndpointPool>> {
        self.parked
            .load()
            .iter()
            .filter_map(|(_, w)| w.upgrade())
            .filter(|p| p.is_parked_live())
            .collect()
    }
}

/// Follows a cluster's address list for the life of the worker.
async fn follow(cluster: Arc<ClusterPools>, mut rx: tokio::sync::watch::Receiver<dns::Addrs>) {
    while rx.changed().await.is_ok() {
        let addrs = rx.borrow_and_update().clone();
        // Not waited for on the worker's thread (see `pool::GonePools`).
        let mut gone = cluster.gone.acquire().await;
        cluster.set_addrs_locked(&addrs, &mut gone);
    }
}

/// All clusters' pools for one worker, indexed like the config's clusters.
pub struct Upstreams {
    pub clusters: Vec<Arc<ClusterPools>>,
    /// Per route (by id): its time to response head, for routes that hedge at a percentile.
    latency: Vec<Option<hedge::LatencyHistogram>>,
}

impl Upstreams {
    /// Starts each endpoint's warm-connection keeper, and each host-name cluster's follower
    /// of its address list, on the current (worker) runtime.
    pub fn start_background(&self) {
        for c in &self.clusters {
            for e in c.endpoints.load().iter() {
                tokio::spawn(e.clone().keep_warm());
            }
            if let Some(feed) = &c.feed {
                tokio::spawn(follow(c.clone(), feed.addrs.clone()));
            }
        }
    }

    /// Sums one statistic over every endpoint of every cluster.
    pub fn sum(&self, f: impl Fn(&pool::PoolStats) -> u64) -> u64 {
        self.clusters
            .iter()
            .map(|c| c.endpoints.load().iter().map(|e| f(&e.stats)).sum::<u64>())
            .sum()
    }

    /// The latency histogram of a route that hedges at a percentile.
    pub fn latency(&self, route: usize) -> Option<&hedge::LatencyHistogram> {
        self.latency.get(route).and_then(Option::as_ref)
    }

    /// Sums one statistic over every cluster.
    pub fn sum_clusters(&self, f: impl Fn(&ClusterStats) -> u64) -> u64 {
        self.clusters.iter().map(|c| f(&c.stats)).sum()
    }

    /// Pools for every cluster; host-name clusters start from the resolver's current list,
    /// and each cluster shares with the other workers what `shared` holds for it.
    pub fn new(config: &Config, dns: &dns::Dns, shared: &ClusterShared) -> Upstreams {
        Upstreams {
            clusters: config
                .clusters
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    let feed = dns.feed(i).cloned();
                    let addrs = match &feed {
                        Some(f) => f.addrs.borrow().to_vec(),
                        None => c.endpoints.clone(),
                    };
                    let gone = shared.gone[i].clone();
                    let pools = {
                        let mut locked = gone.lock();
                        addrs
                            .iter()
                            .map(|&a| Arc::new(EndpointPool::new(a, c, &gone, &mut locked)))
                            .collect()
                    };
                    Arc::new(ClusterPools {
                        endpoints: ArcSwap::from_pointee(pools),
                        gone,
                        stats: ClusterStats::default(),
                        config: c.clone(),
                        feed,
                        parked: ArcSwap::from_pointee(Vec::new()),
                        balance: c.balance,
                        next: AtomicU64::new(0),
                        requests: AtomicU64::new(0),
                        retries_spent: AtomicU64::new(0),
                        budget_percent: c.retry_budget_percent,
                        hedges_spent: AtomicU64::new(0),
                        hedge_budget_percent: c.hedge_budget_percent,
                        epoch: Instant::now(),
                        window_start: AtomicU64::new(0),
                        cap: shared.caps.get(i).cloned().flatten(),
                        budget_exhausted: AtomicU64::new(0),
                    })
                })
                .collect(),
            latency: config
                .routes
                .iter()
                .map(|r| match r.hedge_delay {
                    Some(crate::config::HedgeDelay::Percentile(p)) => {
                        Some(hedge::LatencyHistogram::new(p))
                    }
                    _ => None,
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// One worker's upstreams for a config of one cluster `c` with these settings.
    fn one_cluster(settings: &str) -> Upstreams {
        let cfg = Config::parse(
            Path::new("t.toml"),
            &format!(
                "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\n{settings}\n"
            ),
        )
        .expect("valid");
        Upstreams::new(&cfg, &dns::Dns::none(), &ClusterShared::new(&cfg))
    }

    /// `max_requests` is one count over every worker: one worker may take all the places,
    /// and the next request on any worker is refused until one is given back.
    #[test]
    fn max_requests_is_one_count_over_the_workers() {
        let cfg = Config::parse(
            Path::new("t.toml"),
            "[server]\nworkers = 2\n[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"127.0.0.1:1\"]\nmax_requests = 3\n",
        )
        .expect("valid");
        let caps = ClusterShared::new(&cfg);
        let dns = dns::Dns::none();
        let (a, b) = (
            Upstreams::new(&cfg, &dns, &caps),
            Upstreams::new(&cfg, &dns, &caps),
        );
        let (a, b) = (&a.clusters[0], &b.clusters[0]);
        let held: Vec<_> = (0..3)
            .map(|_| a.admit().expect("below the cap").expect("counted"))
            .collect();
        assert!(matches!(b.admit(), Err(ProxyError::UpstreamOverflow)));
        assert!(matches!(a.admit(), Err(ProxyError::UpstreamOverflow)));
        assert_eq!(a.stats.overflows.load(Ordering::Relaxed), 1);
        assert_eq!(b.stats.overflows.load(Ordering::Relaxed), 1);
        drop(held);
        let again: Vec<_> = (0..3)
            .map(|i| {
                let w = if i % 2 == 0 { a } else { b };
                w.admit().expect("places given back").expect("counted")
            })
            .collect();
        assert!(b.admit().is_err());
        drop(again);
        // A cluster without a cap counts nothing.
        let free = one_cluster("endpoints = [\"127.0.0.1:1\"]");
        assert!(free.clusters[0].admit().expect("no cap").is_none());
    }

    /// A pool left out of one address list is parked, not drained, and comes back with its
    /// address; one out for longer than the idle timeout is drained by its own task, even
    /// with no other answer coming, and its address then gets a new pool.
    #[tokio::test]
    async fn a_parked_pool_comes_back_with_its_address() {
        let ups =
            one_cluster("endpoints = [\"127.0.0.1:1\", \"127.0.0.1:2\"]\nidle_timeout = \"300ms\"");
        ups.start_background();
        let c = &ups.clusters[0];
        let (a, b): (SocketAddr, SocketAddr) = (
            "127.0.0.1:1".parse().expect("address"),
            "127.0.0.1:2".parse().expect("address"),
        );
        let pool_b = c.endpoints.load()[1].clone();
        c.set_addrs(&[a]);
        assert_eq!(c.endpoint_count(), 1);
        assert!(pool_b.is_parked() && !pool_b.is_retired());
        assert_eq!(c.parked_pools().len(), 1);
        c.set_addrs(&[a, b]);
        assert!(Arc::ptr_eq(&c.endpoints.load()[1], &pool_b));
        assert!(!pool_b.is_parked());
        assert!(c.parked_pools().is_empty());
        assert_eq!(c.stats.endpoints_added.load(Ordering::Relaxed), 1);
        assert_eq!(c.stats.endpoints_removed.load(Ordering::Relaxed), 1);
        // Out past the idle timeout: drained by its task, with no answer after this one.
        c.set_addrs(&[a]);
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        while !pool_b.is_retired() {
            assert!(
                Instant::now() < deadline,
                "the parked pool was never drained"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert!(c.parked_pools().is_empty());
        c.set_addrs(&[a, b]);
        assert!(!Arc::ptr_eq(&c.endpoints.load()[1], &pool_b));
    }

    /// A worker never waits for the lock a scrape holds (on a thread a busy core may not
    /// run for a while): a parked pool's drain waits its turn while the worker's runtime
    /// goes on, and so does a new address list; both happen once the lock is let go.
    #[tokio::test]
    async fn a_held_scrape_lock_stalls_no_worker() {
        let ups =
            one_cluster("endpoints = [\"127.0.0.1:1\", \"127.0.0.1:2\"]\nidle_timeout = \"100ms\"");
        ups.start_background();
        let c = ups.clusters[0].clone();
        let a: SocketAddr = "127.0.0.1:1".parse().expect("address");
        let pool_b = c.endpoints.load()[1].clone();
        c.set_addrs(&[a]);
        assert!(pool_b.is_parked());
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let gone = c.gone.clone();
        let holder = std::thread::spawn(move || {
            let _held = gone.lock();
            held_tx.send(()).expect("test waits");
            let _ = release_rx.recv_timeout(std::time::Duration::from_secs(10));
        });
        held_rx.recv().expect("held");
        // Past the idle timeout, on this (one) thread: had the drain waited for the lock,
        // this sleep would not end until the holder gave up, and the pool would be drained.
        tokio::time::sleep(std::time::Duration::from_millis(400)).await;
        assert!(!pool_b.is_retired(), "drained under a lock it waited for");
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(50), c.gone.acquire())
                .await
                .is_err(),
            "the lock is held"
        );
        release_tx.send(()).expect("holder waits");
        holder.join().expect("holder");
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        while !pool_b.is_retired() {
            assert!(Instant::now() < deadline, "never drained once free");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        drop(c.gone.acquire().await);
    }

    /// A parked pool takes no queue under `max_connections_per_endpoint` (a request there
    /// is sent elsewhere at once); back in the answer, it queues requests again.
    #[tokio::test]
    async fn a_parked_pool_takes_no_queue_until_it_is_back() {
        let ups = one_cluster(
            "endpoints = [\"127.0.0.1:1\", \"127.0.0.1:2\"]\nmax_connections_per_endpoint = 1\nidle_timeout = \"60s\"",
        );
        let c = &ups.clusters[0];
        let (a, b): (SocketAddr, SocketAddr) = (
            "127.0.0.1:1".parse().expect("address"),
            "127.0.0.1:2".parse().expect("address"),
        );
        let pool_b = c.endpoints.load()[1].clone();
        let _held = pool_b.take_place().expect("room");
        let queued = |p: Arc<EndpointPool>| async move {
            tokio::time::timeout(std::time::Duration::from_millis(50), p.checkout())
                .await
                .map(|r| r.err().map(|e| e.code()))
        };
        let queued_count = || pool_b.stats.queued.load(Ordering::Relaxed);
        assert!(queued(pool_b.clone()).await.is_err(), "queued while in");
        assert_eq!(queued_count(), 1);
        c.set_addrs(&[a]);
        assert_eq!(
            queued(pool_b.clone()).await,
            Ok(Some("endpoint_removed")),
            "let go at once while parked"
        );
        assert_eq!(queued_count(), 1, "not queued while parked");
        c.set_addrs(&[a, b]);
        assert!(Arc::ptr_eq(&c.endpoints.load()[1], &pool_b));
        assert!(
            queued(pool_b.clone()).await.is_err(),
            "queued again once back"
        );
        assert_eq!(queued_count(), 2);
    }

    /// An endpoint at its `max_connections_per_endpoint` with none idle is passed over for
    /// one with room, by a request's pick and a hedge's; where all are full, the pick stays
    /// the balancer's (and still never the excluded one).
    #[test]
    fn a_full_endpoint_is_passed_over_by_picks_and_hedges() {
        let ups = one_cluster(
            "endpoints = [\"127.0.0.1:1\", \"127.0.0.1:2\", \"127.0.0.1:3\"]\nbalance = \"round_robin\"\nmax_connections_per_endpoint = 1",
        );
        let c = &ups.clusters[0];
        let list: Vec<_> = c.endpoints.load().iter().cloned().collect();
        let full = list[0].take_place().expect("room");
        assert!(list[0].is_full() && !list[1].is_full());
        for _ in 0..30 {
            assert_ne!(c.pick(None).expect("an endpoint").addr, list[0].addr);
        }
        for _ in 0..30 {
            assert_eq!(
                c.pick_other(list[1].addr).map(|p| p.addr),
                Some(list[2].addr)
            );
        }
        let others = [list[1].take_place(), list[2].take_place()];
        let mut seen = std::collections::HashSet::new();
        for _ in 0..30 {
            let p = c.pick(Some(list[0].addr)).expect("an endpoint");
            assert_ne!(p.addr, list[0].addr);
            seen.insert(p.addr);
        }
        assert_eq!(seen.len(), 2, "the balancer's own turns");
        drop((full, others));
        assert!(!list[0].is_full());
    }

    #[test]
    fn a_retry_avoids_the_failed_endpoint_after_the_list_was_swapped() {
        let ups = one_cluster(
            "endpoints = [\"127.0.0.1:1\", \"127.0.0.1:2\", \"127.0.0.1:3\"]\nbalance = \"round_robin\"",
        );
        let c = &ups.clusters[0];
        let failed = c.pick(None).expect("an endpoint").addr;
        // A new answer for the cluster's names, its places shifted, while the first try ran.
        let mut swapped: Vec<_> = c.endpoints.load().iter().cloned().collect();
        swapped.rotate_left(1);
        c.endpoints.store(Arc::new(swapped));
        for _ in 0..30 {
            assert_ne!(c.pick(Some(failed)).expect("an endpoint").addr, failed);
        }
    }

    #[test]
    fn a_retry_avoids_every_entry_of_the_failed_address() {
        // The same address twice in a static list (a crude weight): a retry after it
        // failed goes to the other one.
        let ups = one_cluster(
            "endpoints = [\"127.0.0.1:1\", \"127.0.0.1:1\", \"127.0.0.1:2\"]\nbalance = \"round_robin\"",
        );
        let c = &ups.clusters[0];
        let twice: SocketAddr = "127.0.0.1:1".parse().expect("an address");
        for _ in 0..30 {
            assert_ne!(c.pick(Some(twice)).expect("an endpoint").addr, twice);
            assert_ne!(c.pick_other(twice).map(|p| p.addr), Some(twice));
        }
    }

    #[test]
    fn a_hedge_goes_to_the_one_address_a_new_answer_left() {
        let ups = one_cluster("endpoints = [\"127.0.0.1:1\", \"127.0.0.1:2\"]");
        let c = &ups.clusters[0];
        let list: Vec<_> = c.endpoints.load().iter().cloned().collect();
        let (primary, other) = (list[0].addr, list[1].clone());
        // The primary's address is gone from the answer; one other is left.
        c.endpoints.store(Arc::new(vec![other.clone()]));
        assert!(c.has_other_usable(primary));
        assert_eq!(c.pick_other(primary).map(|p| p.addr), Some(other.addr));
        // The one left is the primary's own: nowhere else to go.
        assert_eq!(c.pick_other(other.addr).map(|p| p.addr), None);
    }

    #[test]
    fn retry_budget_has_a_floor_and_a_ratio() {
        let ups = one_cluster("endpoints = [\"127.0.0.1:1\"]\nretry_budget_percent = 20");
        let c = &ups.clusters[0];
        // With no requests yet, the floor (10/s over a 10 s window) allows 100 retries.
        for _ in 0..100 {
            assert!(c.try_spend_retry());
        }
        assert!(!c.try_spend_retry());
        // Each request adds 20 % of a retry.
        for _ in 0..50 {
            c.count_request_at(Instant::now());
        }
        for _ in 0..10 {
            assert!(c.try_spend_retry());
        }
        assert!(!c.try_spend_retry());
        assert_eq!(c.budget_exhausted.load(Ordering::Relaxed), 2);
        // A hedge the exhausted budget refuses is a refused hedge, not a refused retry too.
        // (More requests: room for hedges, and for retries spent at once.)
        for _ in 0..100 {
            c.count_request_at(Instant::now());
        }
        while c.try_spend_retry() {}
        let exhausted = c.budget_exhausted.load(Ordering::Relaxed);
        assert!(!c.try_spend_hedge());
        assert_eq!(c.stats.hedges_refused.load(Ordering::Relaxed), 1);
        assert_eq!(c.budget_exhausted.load(Ordering::Relaxed), exhausted);
    }
}
