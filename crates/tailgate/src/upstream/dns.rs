//! Host-name endpoints (seeds 003 and 004): names are resolved on a dedicated `tailgate-dns`
//! thread with its own current-thread runtime, never on a request's path, and each cluster's
//! resulting address list is published on a `watch` channel that every worker follows (see
//! `ClusterPools::set_addrs_locked`).
//!
//! hickory-resolver is here for its async, TTL-aware resolver (it reads `/etc/resolv.conf`
//! or takes explicit name servers); tailgate schedules the refreshes itself:
//! - a name is re-resolved when its answer's TTL runs out, clamped to
//!   `[dns.min_refresh, dns.max_refresh]`;
//! - a failed lookup (the name servers fail, refuse or do not answer) keeps the last
//!   addresses (serve stale), is logged and counted, and is retried with a backoff starting
//!   at `min_refresh`;
//! - an answer that the name has no address (NXDOMAIN, or no A and no AAAA record) is an
//!   answer: the name's addresses go (as Envoy's strict DNS drops a cluster's hosts then),
//!   rather than keep sending requests to addresses the name no longer has, which may by
//!   now be another service's; it is looked up again after `min_refresh`;
//! - a connect failure to an endpoint of a cluster asks for an early re-resolution of that
//!   cluster's names (at most once per `min_refresh`), so a failover that moved the name to
//!   a new address is followed quickly (seed 004).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use hickory_resolver::TokioResolver;
use hickory_resolver::config::{NameServerConfig, ResolverConfig, ResolverOpts};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::rr::Name;
use hickory_resolver::proto::rr::RecordType;
use hickory_resolver::system_conf::read_system_conf;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use crate::config::{Config, DnsSettings};

/// A cluster's current endpoint addresses (IP literals and resolved names), sorted.
pub type Addrs = Arc<Vec<SocketAddr>>;

/// Resolver events, over all names.
#[derive(Debug, Default)]
pub struct DnsStats {
    /// Lookups that returned addresses.
    pub lookups: AtomicU64,
    /// Lookups that failed (timeout, no answer, no records); the last addresses were kept.
    pub failures: AtomicU64,
    /// Times a cluster's address list changed and was published to the workers.
    pub changes: AtomicU64,
    /// Re-resolutions asked for by connect failures.
    pub early_refreshes: AtomicU64,
    /// Addresses in answers that were left out, counted at each lookup: ones no connect
    /// can use (link-local IPv6 from DNS, unspecified, multicast, broadcast).
    pub unusable: AtomicU64,
}

/// Early re-resolution requests, by cluster index.
struct Early {
    notify: Notify,
    requested: Vec<AtomicBool>,
    /// Per cluster: it asks at most once per `min_refresh`, however many requests fail
    /// meanwhile (a 502 for want of an address comes back in microseconds, thousands of
    /// times a second).
    asked: Vec<crate::pace::Every>,
}

/// What a worker needs to follow one cluster's addresses.
#[derive(Clone)]
pub struct ClusterFeed {
    pub addrs: watch::Receiver<Addrs>,
    early: Arc<Early>,
    cluster: usize,
}

impl ClusterFeed {
    /// Asks the resolver thread to re-resolve this cluster's names soon (after a connect
    /// failure). Cheap and non-blocking: a flag and a wake-up.
    pub fn request_refresh(&self) {
        let early = &*self.early;
        if early.asked.get(self.cluster).is_some_and(|a| !a.due()) {
            return;
        }
        if let Some(flag) = early.requested.get(self.cluster)
            && !flag.swap(true, Ordering::Relaxed)
        {
            early.notify.notify_one();
        }
    }
}

/// The resolver thread and one feed per cluster that has host-name endpoints.
pub struct Dns {
    pub stats: Arc<DnsStats>,
    feeds: Vec<Option<ClusterFeed>>,
    thread: Option<JoinHandle<()>>,
}

impl Dns {
    /// No resolver: every endpoint is an IP literal.
    pub fn none() -> Dns {
        Dns {
            stats: Arc::default(),
            feeds: Vec::new(),
            thread: None,
        }
    }

    /// Starts the resolver thread if any cluster has a host-name endpoint, and waits (at most
    /// `dns.startup_timeout`) for the first resolution of every name. A name that does not
    /// resolve is logged; its cluster has only its other endpoints until it does. A
    /// resolver that cannot be built (no `/etc/resolv.conf`, or one that names no server,
    /// without `[dns] nameservers`) stops the start: no name would ever resolve.
    pub fn start(
        config: &Config,
        shutdown: watch::Receiver<bool>,
    ) -> Result<Dns, crate::gateway::StartError> {
        if config.clusters.iter().all(|c| c.hostnames.is_empty()) {
            return Ok(Dns::none());
        }
        let stats = Arc::new(DnsStats::default());
        let early = Arc::new(Early {
            notify: Notify::new(),
            requested: config
                .clusters
                .iter()
                .map(|_| AtomicBool::new(false))
                .collect(),
            asked: config
                .clusters
                .iter()
                .map(|_| crate::pace::Every::new(config.dns.min_refresh))
                .collect(),
        });
        let mut feeds = Vec::new();
        let mut targets = Vec::new();
        for (i, c) in config.clusters.iter().enumerate() {
            if c.hostnames.is_empty() {
                feeds.push(None);
                continue;
            }
            let mut initial = c.endpoints.clone();
            initial.sort();
            initial.dedup();
            let (tx, rx) = watch::channel(Arc::new(initial.clone()));
            feeds.push(Some(ClusterFeed {
                addrs: rx,
                early: early.clone(),
                cluster: i,
            }));
            targets.push(Target {
                cluster: i,
                name: c.name.clone(),
                fixed: initial,
                names: c
                    .hostnames
                    .iter()
                    .map(|h| (h.lookup_name(), h.port))
                    .collect(),
                tx,
            });
        }
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let settings = config.dns.clone();
        let wait = settings.startup_timeout + Duration::from_secs(1);
        let (st, ea) = (stats.clone(), early.clone());
        let thread = std::thread::Builder::new()
            .name("tailgate-dns".into())
            .spawn(move || run(settings, targets, st, ea, shutdown, ready_tx))
            .map_err(crate::gateway::StartError::Thread)?;
        match ready_rx.recv_timeout(wait) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(crate::gateway::StartError::Dns(e));
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                let _ = thread.join();
                return Err(crate::gateway::StartError::Dns(
                    "the resolver's thread could not start its runtime".into(),
                ));
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => tracing::warn!(
                "the first DNS resolution did not finish in time; starting with what is resolved"
            ),
        }
        Ok(Dns {
            stats,
            feeds,
            thread: Some(thread),
        })
    }

    /// The feed of cluster `i`, if it has host-name endpoints.
    pub fn feed(&self, i: usize) -> Option<&ClusterFeed> {
        self.feeds.get(i).and_then(Option::as_ref)
    }

    /// Waits for the resolver thread to exit (after the gateway's shutdown signal).
    pub fn join(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One cluster the resolver publishes to.
struct Target {
    cluster: usize,
    name: String,
    /// Its IP-literal endpoints.
    fixed: Vec<SocketAddr>,
    names: Vec<(String, u16)>,
    tx: watch::Sender<Addrs>,
}

/// One name's resolution state.
struct NameState {
    /// The names its lookups try, in order ([`Search`]); an error if the name does not
    /// parse as a DNS name (every lookup fails with it).
    candidates: Result<Candidates, String>,
    addrs: Vec<IpAddr>,
    /// What the last answer had that no connect can use ([`unusable`]).
    unusable: Vec<IpAddr>,
    resolved: bool,
    due: Instant,
    last: Option<Instant>,
    failures_in_row: u32,
}

/// Have host-name endpoints a name server to ask? Builds the resolver [`Dns::start`] would
/// (and drops it): `tailgate check` asks, so that it does not pass a config that `serve`
/// refuses to start with. `Ok` when no endpoint is a host name.
pub fn check_resolver(config: &Config) -> Result<(), crate::gateway::StartError> {
    if config.clusters.iter().all(|c| c.hostnames.is_empty()) {
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(crate::gateway::StartError::Thread)?;
    let _in = rt.enter();
    build_resolver(&config.dns)
        .map(drop)
        .map_err(crate::gateway::StartError::Dns)
}

/// The names a lookup of one host name tries, in order, built as the resolver builds them
/// from `/etc/resolv.conf`'s `search`, `domain` and `ndots`; a fully qualified name (written
/// with its trailing dot) is tried alone. tailgate walks this list itself rather than let
/// the resolver do it: the resolver answers with the last name's result, so a name server
/// failing the real name (`SERVFAIL`) while the next candidate does not exist (`NXDOMAIN`)
/// would read as "the name has no address" and remove the name's endpoints in the very
/// outage that keeping them is for. The outcome is decided as glibc's `res_nsearch` decides
/// it ([`lookup_family`]).
#[derive(Debug, Clone, Default)]
struct Search {
    domain: Option<Name>,
    search: Vec<Name>,
    ndots: usize,
}

/// A host name's candidates ([`Search`]).
#[derive(Debug, Clone, PartialEq)]
struct Candidates {
    names: Vec<Name>,
    /// The first is the name as written (it has more labels than `ndots`): its outcome is
    /// the lookup's when no name answers.
    as_is_first: bool,
}

impl Search {
    /// As hickory's `build_names`: built last first (it pops them), each name once at the
    /// place it took first in that order; a name too long with a domain is no candidate.
    fn candidates(&self, host: &str) -> Result<Candidates, String> {
        let name = Name::from_str(host).map_err(|e| format!("{host}: {e}"))?;
        if name.is_fqdn() {
            return Ok(Candidates {
                names: vec![name],
                as_is_first: true,
            });
        }
        let mut fqdn = name.clone();
        fqdn.set_fqdn(true);
        let as_is_first = usize::from(name.num_labels()) > self.ndots || name.is_localhost();
        let mut names = Vec::with_capacity(self.search.len() + 2);
        if !as_is_first {
            names.push(fqdn.clone());
        }
        for d in self.search.iter().rev().chain(&self.domain) {
            if let Ok(n) = name.clone().append_domain(d)
                && !names.contains(&n)
            {
                names.push(n);
            }
        }
        if as_is_first {
            names.push(fqdn);
        }
        names.reverse();
        Ok(Candidates { names, as_is_first })
    }
}

/// The resolver, with no search list of its own ([`Search`] has it).
fn build_resolver(s: &DnsSettings) -> Result<(TokioResolver, Search), String> {
    let (config, mut opts, search) = if s.nameservers.is_empty() {
        let (config, opts) = read_system_conf().map_err(|e| e.to_string())?;
        let (domain, list, servers) = config.into_parts();
        let search = Search {
            domain,
            search: list,
            ndots: opts.ndots,
        };
        (ResolverConfig::from_name_servers(servers), opts, search)
    } else {
        let servers = s
            .nameservers
            .iter()
            .map(|a| {
                let mut ns = NameServerConfig::udp_and_tcp(a.ip());
                for c in &mut ns.connections {
                    c.port = a.port();
                }
                ns
            })
            .collect();
        (
            ResolverConfig::from_name_servers(servers),
            ResolverOpts::default(),
            Search::default(),
        )
    };
    opts.timeout = s.query_timeout;
    opts.attempts = 1;
    // Our refresh schedule is the cache that matters; the resolver's must not outlive it.
    opts.positive_max_ttl = Some(s.max_refresh);
    opts.negative_max_ttl = Some(s.min_refresh);
    let mut builder = TokioResolver::builder_with_config(config, TokioRuntimeProvider::default());
    *builder.options_mut() = opts;
    let resolver = builder.build().map_err(|e| e.to_string())?;
    Ok((resolver, search))
}

fn run(
    settings: DnsSettings,
    targets: Vec<Target>,
    stats: Arc<DnsStats>,
    early: Arc<Early>,
    mut shutdown: watch::Receiver<bool>,
    ready: std::sync::mpsc::Sender<Result<(), String>>,
) {
    let Some(rt) = crate::runtime::for_thread("DNS", "; host-name endpoints will not resolve")
    else {
        return;
    };
    rt.block_on(async move {
        let (resolver, search) = match build_resolver(&settings) {
            Ok(r) => r,
            Err(e) => {
                let _ = ready.send(Err(e));
                return;
            }
        };
        let now = Instant::now();
        let mut names: HashMap<String, NameState> = HashMap::new();
        for t in &targets {
            for (host, _) in &t.names {
                names.entry(host.clone()).or_insert_with(|| NameState {
                    candidates: search.candidates(host),
                    addrs: Vec::new(),
                    unusable: Vec::new(),
                    resolved: false,
                    due: now,
                    last: None,
                    failures_in_row: 0,
                });
            }
        }
        // Start-up asks again for a name whose lookup failed (a local resolver not up yet,
        // a lost packet) until `startup_timeout`, every `STARTUP_RETRY` at most: one
        // failed query at start left its cluster empty, the gateway started, and each
        // failure after that put the next look further off.
        let deadline = Instant::now() + settings.startup_timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            refresh_due(
                &resolver,
                &settings,
                &mut names,
                &stats,
                settings.query_timeout.min(left),
            )
            .await;
            let now = Instant::now();
            let mut next: Option<Instant> = None;
            for n in names.values_mut().filter(|n| !n.resolved) {
                // Start-up's failures count as one for the backoff afterwards.
                n.failures_in_row = n.failures_in_row.min(1);
                n.due = n.due.min(now + settings.min_refresh.min(STARTUP_RETRY));
                next = Some(next.map_or(n.due, |t| t.min(n.due)));
            }
            match next {
                Some(at) if at < deadline => {
                    tokio::select! {
                        _ = tokio::time::sleep_until(at) => {}
                        _ = shutdown.wait_for(|stop| *stop) => {
                            let _ = ready.send(Ok(()));
                            return;
                        }
                    }
                }
                _ => break,
            }
        }
        for (host, n) in &names {
            if !n.resolved || n.addrs.is_empty() {
                tracing::warn!(dns.name = %host, "host name did not resolve at start; its cluster has no endpoints from it until it does");
            }
        }
        publish(&targets, &names, &stats);
        let _ = ready.send(Ok(()));
        loop {
            let next = names
                .values()
                .map(|n| n.due)
                .min()
                .unwrap_or_else(|| Instant::now() + settings.max_refresh);
            tokio::select! {
                _ = tokio::time::sleep_until(next) => {}
                _ = early.notify.notified() => {
                    let now = Instant::now();
                    for t in &targets {
                        let asked = early
                            .requested
                            .get(t.cluster)
                            .is_some_and(|f| f.swap(false, Ordering::Relaxed));
                        if !asked {
                            continue;
                        }
                        stats.early_refreshes.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(cluster = %t.name, "connect failure; re-resolving the cluster's names early");
                        for (host, _) in &t.names {
                            if let Some(n) = names.get_mut(host) {
                                // Ask the name servers again, not the resolver's cache.
                                let names = n.candidates.iter().flat_map(|c| &c.names);
                                for name in names {
                                    for rt in [RecordType::A, RecordType::AAAA] {
                                        resolver.clear_lookup_cache(name.clone(), rt);
                                    }
                                }
                                // While lookups fail (one family's or all), their backoff
                                // holds: connect failures to the addresses kept meanwhile
                                // (a dead family's) would undo it. Not for a name with no
                                // address to keep: its cluster answers `502` to every
                                // request meanwhile, so the name is asked again at once
                                // (requests ask at most once per `min_refresh`); held to
                                // its backoff, it stayed unasked for up to `max_refresh`
                                // after the name servers came back.
                                let wait = match n.failures_in_row {
                                    k if k > 0 && !n.addrs.is_empty() => backoff(&settings, k - 1),
                                    _ => settings.min_refresh,
                                };
                                let earliest = n.last.map_or(now, |l| l + wait);
                                n.due = n.due.min(earliest.max(now));
                            }
                        }
                    }
                    continue;
                }
                _ = shutdown.wait_for(|stop| *stop) => return,
            }
            // Shutdown does not wait for the name servers (`query_timeout` may be long).
            tokio::select! {
                _ = refresh_due(&resolver, &settings, &mut names, &stats, settings.query_timeout) => {}
                _ = shutdown.wait_for(|stop| *stop) => return,
            }
            publish(&targets, &names, &stats);
        }
    });
}

/// Resolves every name that is due, concurrently; keeps the last addresses on failure.
async fn refresh_due(
    resolver: &TokioResolver,
    s: &DnsSettings,
    names: &mut HashMap<String, NameState>,
    stats: &DnsStats,
    timeout: Duration,
) {
    let now = Instant::now();
    let due: Vec<String> = names
        .iter()
        .filter(|(_, n)| n.due <= now)
        .map(|(h, _)| h.clone())
        .collect();
    let known = &*names;
    let lookups = due.iter().map(|host| async move {
        let candidates = known.get(host).map(|n| &n.candidates);
        // A and AAAA apart, so that one family's failure is seen as one: the resolver's
        // dual lookup answers with the other family alone, and the failed family's
        // endpoints would be dropped as if the name no longer had them.
        let family = |rt| async move {
            // A family not looked up (`dns.family`) answers none.
            if !s.family.looks_up(rt == RecordType::AAAA) {
                return Family::None;
            }
            let candidates = match candidates {
                Some(Ok(c)) => c,
                Some(Err(e)) => return Family::Failed(e.clone()),
                None => return Family::None,
            };
            tokio::time::timeout(timeout, lookup_family(resolver, candidates, rt))
                .await
                .unwrap_or_else(|_| Family::Failed(format!("no answer within {timeout:?}")))
        };
        let (v4, v6) =
            futures_util::future::join(family(RecordType::A), family(RecordType::AAAA)).await;
        (host, v4, v6)
    });
    let results = futures_util::future::join_all(lookups).await;
    let now = Instant::now();
    for (host, v4, v6) in results {
        let Some(n) = names.get_mut(host) else {
            continue;
        };
        n.last = Some(now);
        let r = answer_of(v4, v6, &n.addrs, stats);
        match r {
            Ok(Answer {
                ips,
                valid_until,
                unusable,
                failed,
            }) => {
                stats.lookups.fetch_add(1, Ordering::Relaxed);
                let ttl = valid_until
                    .map_or(Duration::ZERO, |v| v.saturating_duration_since(now))
                    .clamp(s.min_refresh, s.max_refresh);
                // One family failed, the other answered: counted and retried as a failure,
                // with the same backoff (from `min_refresh`, doubling) but never later than
                // the other family's answer is good for; warned about once in a row.
                // Retried at every `min_refresh`, a name server that never answers AAAA
                // was asked twice a second for good, each time waiting out the query
                // timeout, and the failures count climbed without end.
                let wait = match failed {
                    Some(e) => {
                        stats.failures.fetch_add(1, Ordering::Relaxed);
                        if n.failures_in_row == 0 {
                            tracing::warn!(dns.name = %host, error = %e, "a DNS lookup of one address family failed; keeping that family's last addresses");
                        }
                        let wait = backoff(s, n.failures_in_row);
                        n.failures_in_row += 1;
                        match valid_until {
                            Some(_) => wait.min(ttl),
                            None => wait,
                        }
                    }
                    None => {
                        if n.failures_in_row > 0 {
                            tracing::info!(dns.name = %host, failures = n.failures_in_row, "DNS lookups answer again");
                        }
                        n.failures_in_row = 0;
                        ttl
                    }
                };
                if ips.is_empty() && !n.addrs.is_empty() {
                    tracing::warn!(dns.name = %host, gone = ?n.addrs, "the name servers say this name has no address now; its endpoints are removed until it has one again");
                }
                // Once per change, not at every refresh.
                if !unusable.is_empty() && unusable != n.unusable {
                    tracing::warn!(dns.name = %host, left_out = ?unusable, "addresses in a DNS answer no connect can use (link-local with no interface, unspecified, multicast or broadcast); left out");
                }
                n.unusable = unusable;
                n.due = now + wait;
                n.addrs = ips;
                n.resolved = true;
            }
            Err(e) => {
                stats.failures.fetch_add(1, Ordering::Relaxed);
                let wait = backoff(s, n.failures_in_row);
                n.failures_in_row += 1;
                n.due = now + wait;
                if n.failures_in_row == 1 && n.addrs.is_empty() {
                    tracing::warn!(dns.name = %host, error = %e, "DNS lookup failed; the name has no addresses to keep, so its cluster has no endpoints from it until a lookup answers");
                } else if n.failures_in_row == 1 {
                    tracing::warn!(dns.name = %host, error = %e, stale = ?n.addrs, "DNS lookup failed; keeping the last addresses");
                } else {
                    tracing::debug!(dns.name = %host, error = %e, "DNS lookup failed again");
                }
            }
        }
    }
}

/// The most start-up waits before asking again for a name whose lookup failed.
const STARTUP_RETRY: Duration = Duration::from_millis(250);

/// How long after the `failures_in_row + 1`th failure in a row a name is asked again:
/// `min_refresh`, doubled at each failure, up to `max_refresh`.
fn backoff(s: &DnsSettings, failures_in_row: u32) -> Duration {
    s.min_refresh
        .saturating_mul(1 << failures_in_row.min(10))
        .min(s.max_refresh)
}

/// One family's lookup (A or AAAA) of a name: its candidates in turn ([`Search`]) until one
/// has an address. If none has, the outcome is decided as glibc's `res_nsearch` decides it:
/// the name as written, when it was tried first, says (a name server failing it is a
/// failure, however the search list's names answered; its not existing is an answer of
/// none, however they failed); else one that exists without this family's records (NODATA)
/// says none; else one the name servers failed on (`SERVFAIL`, `REFUSED`, no answer) makes it
/// a failure; else none exists: an answer of none.
async fn lookup_family(
    resolver: &TokioResolver,
    candidates: &Candidates,
    rt: RecordType,
) -> Family {
    let mut first: Option<Family> = None;
    let mut nodata = false;
    let mut failed: Option<String> = None;
    for (i, name) in candidates.names.iter().enumerate() {
        let outcome = match resolver.lookup(name.clone(), rt).await {
            Ok(l) => {
                let ips: Vec<IpAddr> = l
                    .answers()
                    .iter()
                    .filter_map(|r| r.data.ip_addr())
                    .collect();
                if !ips.is_empty() {
                    return Family::Answered(ips, Instant::from_std(l.valid_until()));
                }
                nodata = true;
                Family::None
            }
            // No such name (NXDOMAIN), or no record of this family (NODATA).
            Err(e) if e.is_no_records_found() => {
                nodata |= !e.is_nx_domain();
                Family::None
            }
            Err(e) => {
                let e = format!("{name}: {e}");
                failed.get_or_insert_with(|| e.clone());
                Family::Failed(e)
            }
        };
        if i == 0 && candidates.as_is_first {
            first = Some(outcome);
        }
    }
    match (first, nodata, failed) {
        (Some(first), _, _) => first,
        (None, true, _) => Family::None,
        (None, false, Some(e)) => Family::Failed(e),
        (None, false, None) => Family::None,
    }
}

/// What one family's lookup (A or AAAA) of a name gave.
enum Family {
    /// Its addresses, and until when they may be kept.
    Answered(Vec<IpAddr>, Instant),
    /// The name has none (or does not exist).
    None,
    /// No answer: the name servers failed, refused or did not answer in time.
    Failed(String),
}

/// A name's lookup: its usable addresses, until when, those left out, and, when one family
/// failed while the other answered, why (its last addresses are among `ips`).
struct Answer {
    ips: Vec<IpAddr>,
    /// Until when the families that answered with addresses may be kept (the soonest);
    /// `None` when none did.
    valid_until: Option<Instant>,
    unusable: Vec<IpAddr>,
    failed: Option<String>,
}

/// Both families' lookups as one: an error when both failed, or when no usable address is
/// left (every one unusable, or one family failed and the other answered none); none at all
/// (both families answered with no record) is an answer. A family that failed while the
/// other answered keeps its addresses from `last`, and says so in `failed` (the caller
/// retries it with a backoff). The unusable addresses are counted in `stats`.
fn answer_of(v4: Family, v6: Family, last: &[IpAddr], stats: &DnsStats) -> Result<Answer, String> {
    let mut all = Vec::new();
    let mut valid_until: Option<Instant> = None;
    let mut failed = None;
    for (family, v6) in [(v4, false), (v6, true)] {
        match family {
            Family::Answered(ips, until) => {
                all.extend(ips);
                valid_until = Some(valid_until.map_or(until, |v| v.min(until)));
            }
            Family::None => {}
            Family::Failed(e) => {
                if let Some(first) = failed.take() {
                    return Err(format!("{first}; {e}"));
                }
                let family = if v6 { "AAAA" } else { "A" };
                failed = Some(format!("the {family} lookup: {e}"));
                all.extend(last.iter().filter(|ip| ip.is_ipv6() == v6));
            }
        }
    }
    let (mut unusable, mut ips): (Vec<IpAddr>, Vec<IpAddr>) = all.into_iter().partition(unusable);
    ips.sort();
    ips.dedup();
    unusable.sort();
    unusable.dedup();
    stats
        .unusable
        .fetch_add(unusable.len() as u64, Ordering::Relaxed);
    if let (true, Some(e)) = (ips.is_empty(), &failed) {
        return Err(format!("{e}; the other family has no address"));
    }
    if ips.is_empty() && !unusable.is_empty() {
        return Err(format!(
            "the answer has only addresses no connect can use ({unusable:?}: link-local with no interface, unspecified, multicast or broadcast)"
        ));
    }
    Ok(Answer {
        ips,
        // A family with no record gives no time: the refresh bounds apply.
        valid_until,
        unusable,
        failed,
    })
}

/// An address no connect can use: one the config refuses as a literal too
/// ([`crate::config::unconnectable`]), and any link-local IPv6 one, which from DNS has no
/// zone (an interface): without one the kernel refuses the connect (`EINVAL`).
fn unusable(ip: &IpAddr) -> bool {
    crate::config::unconnectable(*ip).is_some()
        || matches!(ip, IpAddr::V6(v6) if v6.is_unicast_link_local())
}

/// Sends each cluster's address list to the workers when it changed.
fn publish(targets: &[Target], names: &HashMap<String, NameState>, stats: &DnsStats) {
    for t in targets {
        let mut addrs = t.fixed.clone();
        for (host, port) in &t.names {
            if let Some(n) = names.get(host) {
                addrs.extend(n.addrs.iter().map(|&ip| SocketAddr::new(ip, *port)));
            }
        }
        addrs.sort();
        addrs.dedup();
        let changed = t.tx.send_if_modified(|cur| {
            if **cur == addrs {
                false
            } else {
                *cur = Arc::new(addrs.clone());
                true
            }
        });
        if changed {
            stats.changes.fetch_add(1, Ordering::Relaxed);
            tracing::info!(cluster = %t.name, endpoints = ?addrs, "cluster endpoints changed (DNS)");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_resolver::proto::op::{Message, ResponseCode};
    use hickory_resolver::proto::rr::rdata::A;
    use hickory_resolver::proto::rr::{RData, Record};

    fn name(s: &str) -> Name {
        Name::from_str(s).expect("a DNS name")
    }

    #[test]
    fn candidates_are_tried_in_the_resolvers_order() {
        let search = Search {
            domain: None,
            search: vec![name("a.test."), name("b.test.")],
            ndots: 1,
        };
        let got = |h: &str| search.candidates(h).expect("candidates");
        // More dots than `ndots`: the name itself first.
        let c = got("svc.example");
        assert!(c.as_is_first);
        assert_eq!(
            c.names,
            [
                name("svc.example."),
                name("svc.example.a.test."),
                name("svc.example.b.test.")
            ]
        );
        // No more than `ndots`: the search list first.
        let c = got("svc");
        assert!(!c.as_is_first);
        assert_eq!(
            c.names,
            [name("svc.a.test."), name("svc.b.test."), name("svc.")]
        );
        // Fully qualified: alone.
        assert_eq!(got("svc.example.").names, [name("svc.example.")]);
        assert_eq!(
            Search::default()
                .candidates("svc")
                .expect("candidates")
                .names,
            [name("svc.")]
        );
        // The domain (the host's, without a `domain` line) is tried before the search list,
        // but where the search list has it, in its place there, as glibc tries them.
        let search = Search {
            domain: Some(name("corp.example.")),
            search: vec![name("eng.corp.example."), name("corp.example.")],
            ndots: 1,
        };
        assert_eq!(
            search.candidates("api").expect("candidates").names,
            [
                name("api.eng.corp.example."),
                name("api.corp.example."),
                name("api.")
            ]
        );
        let search = Search {
            domain: Some(name("corp.example.")),
            search: vec![name("eng.corp.example.")],
            ndots: 1,
        };
        assert_eq!(
            search.candidates("api").expect("candidates").names,
            [
                name("api.corp.example."),
                name("api.eng.corp.example."),
                name("api.")
            ]
        );
    }

    /// A name server on its own thread: `SERVFAIL` for `broken.example.` and every name
    /// under `fail.test.`, an A record (10.0.0.2) for `svc.a.test.`, no A record (NODATA)
    /// for `bare.a.test.`, `NXDOMAIN` for every other name.
    fn name_server() -> SocketAddr {
        let sock = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let addr = sock.local_addr().expect("addr");
        std::thread::spawn(move || {
            let mut buf = [0u8; 2048];
            while let Ok((n, peer)) = sock.recv_from(&mut buf) {
                let Ok(q) = Message::from_vec(&buf[..n]) else {
                    continue;
                };
                let mut resp = Message::response(q.metadata.id, q.metadata.op_code);
                resp.metadata.recursion_desired = q.metadata.recursion_desired;
                resp.metadata.recursion_available = true;
                resp.metadata.response_code = ResponseCode::NXDomain;
                for query in &q.queries {
                    resp.add_query(query.clone());
                    let asked = query.name().to_string();
                    if asked == "broken.example." || asked.ends_with(".fail.test.") {
                        resp.metadata.response_code = ResponseCode::ServFail;
                    } else if asked == "bare.a.test." {
                        resp.metadata.response_code = ResponseCode::NoError;
                    } else if asked == "svc.a.test." {
                        resp.metadata.response_code = ResponseCode::NoError;
                        if query.query_type() == RecordType::A {
                            resp.add_answer(Record::from_rdata(
                                query.name().clone(),
                                60,
                                RData::A(A::new(10, 0, 0, 2)),
                            ));
                        }
                    }
                }
                if let Ok(bytes) = resp.to_vec() {
                    let _ = sock.send_to(&bytes, peer);
                }
            }
        });
        addr
    }

    fn state(candidates: Candidates, addr: IpAddr) -> NameState {
        NameState {
            candidates: Ok(candidates),
            addrs: vec![addr],
            unusable: Vec::new(),
            resolved: true,
            due: Instant::now(),
            last: None,
            failures_in_row: 0,
        }
    }

    /// With no address from any candidate, the outcome is glibc's: the name as written
    /// says, when it was tried first; else NODATA says none; else a failure is one (the last
    /// addresses stay); else none exists.
    #[tokio::test]
    async fn the_outcome_of_a_search_is_glibcs() {
        let settings = DnsSettings {
            nameservers: vec![name_server()],
            min_refresh: Duration::from_secs(1),
            max_refresh: Duration::from_secs(60),
            query_timeout: Duration::from_secs(5),
            startup_timeout: Duration::from_secs(5),
            family: crate::config::DnsFamily::Any,
        };
        let (resolver, _) = build_resolver(&settings).expect("resolver");
        let old: IpAddr = [10, 0, 0, 1].into();
        let mut names = HashMap::new();
        for (host, list) in [
            // SERVFAIL, then NXDOMAIN for `broken.example.a.test.`: a failure.
            ("broken.example", ["a.test.", "b.test."]),
            // NXDOMAIN, then SERVFAIL for `gone.example.fail.test.`: none.
            ("gone.example", ["a.test.", "fail.test."]),
            // The search list's answer.
            ("svc", ["a.test.", "b.test."]),
            // SERVFAIL for `nope.fail.test.`, then NXDOMAIN: a failure.
            ("nope", ["fail.test.", "a.test."]),
            // SERVFAIL for `bare.fail.test.`, NODATA for `bare.a.test.`: none.
            ("bare", ["fail.test.", "a.test."]),
        ] {
            let search = Search {
                domain: None,
                search: list.map(name).to_vec(),
                ndots: 1,
            };
            let candidates = search.candidates(host).expect("candidates");
            names.insert(host.to_string(), state(candidates, old));
        }
        let stats = DnsStats::default();
        refresh_due(
            &resolver,
            &settings,
            &mut names,
            &stats,
            settings.query_timeout,
        )
        .await;
        assert_eq!(names["broken.example"].addrs, [old]);
        assert_eq!(names["broken.example"].failures_in_row, 1);
        assert!(names["gone.example"].addrs.is_empty());
        assert_eq!(names["gone.example"].failures_in_row, 0);
        assert_eq!(names["svc"].addrs, [IpAddr::from([10, 0, 0, 2])]);
        assert_eq!(names["nope"].addrs, [old]);
        assert!(names["bare"].addrs.is_empty());
        assert_eq!(stats.failures.load(Ordering::Relaxed), 2);
    }
}
