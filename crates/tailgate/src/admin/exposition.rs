//! What `/metrics` says: every family, in a fixed order, summed over the workers from their
//! own atomics. Runs on the scrape thread (see `admin`) only; it reads the data plane's
//! counters and takes no lock a worker waits for: the consumer merge below is the admin
//! plane's own, and the lock of a cluster's drained pools (`GonePools`), held here only to
//! copy the lists of pools, is one a worker only tries, and tries again later.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::observe::metrics::consumers::{Consumers, OVERFLOW};
use crate::observe::metrics::histogram::Snapshot;
use crate::observe::metrics::render::{Closed, Kind, TextWriter};
use crate::observe::metrics::{CLASSES, ERROR_KINDS, METHODS, STAGES, escape_label};
use crate::upstream::{EndpointPool, GoneEndpoint, PoolStats};

use super::AdminState;

/// Every worker's consumers merged by name. Grows incrementally: each scrape reads only the
/// cells the workers appended since the last one (no re-sort, no rebuild).
///
/// The rows are shared with the scrapes that stream them (`Arc`), not copied for each: a
/// copy of 100k rows is about 10 MB and 200k allocations, and every admin connection could
/// hold one while its scraper reads slowly. They are copied only when new cells come while
/// an earlier scrape still streams the previous rows.
#[derive(Default)]
pub struct ConsumerMerge {
    /// Per worker: how many of its cells are already merged.
    seen: Vec<usize>,
    index: HashMap<Box<str>, usize>,
    rows: Arc<Vec<ConsumerRow>>,
}

/// One consumer's label and where its cells are: (worker, cell index) pairs.
type ConsumerRow = (Box<str>, Vec<(usize, usize)>);

/// The cell index that stands for a worker's overflow (`_other`) cell.
const OVERFLOW_CELL: usize = usize::MAX;

impl ConsumerMerge {
    /// Merges the cells the workers (their consumer tables, in worker order) appended since
    /// the last call; returns the rows to stream.
    fn update(&mut self, workers: &[Option<&Consumers>]) -> Arc<Vec<ConsumerRow>> {
        self.seen.resize(workers.len(), 0);
        for (w, c) in workers.iter().enumerate() {
            let Some(c) = c else {
                continue;
            };
            let count = c.cells.count();
            if self.seen[w] >= count {
                continue;
            }
            let rows = Arc::make_mut(&mut self.rows);
            while self.seen[w] < count {
                let i = self.seen[w];
                // A cell being appended right now: take it next time.
                let Some(cell) = c.cells.get(i) else { break };
                let row = *self.index.entry(cell.label.clone()).or_insert_with(|| {
                    rows.push((cell.label.clone(), Vec::new()));
                    rows.len() - 1
                });
                rows[row].1.push((w, i));
                self.seen[w] += 1;
            }
        }
        self.rows.clone()
    }
}

/// Writes the whole exposition.
pub async fn render(state: &AdminState, w: &mut TextWriter) -> Result<(), Closed> {
    requests(state, w).await?;
    consumers(state, w).await?;
    upstreams(state, w).await?;
    runtime(state, w);
    process(state, w);
    Ok(())
}

async fn requests(state: &AdminState, w: &mut TextWriter) -> Result<(), Closed> {
    let plan = &state.plan;
    let slots = plan.slot_labels.len();
    let workers = &state.workers;
    let sum = |f: &dyn Fn(&crate::observe::metrics::RouteSlot) -> u64, s: usize| -> u64 {
        workers.iter().map(|wk| f(&wk.metrics.slots()[s])).sum()
    };

    w.family(
        "tailgate_requests",
        Kind::Counter,
        "Requests finished, by tenant, route, method and status class.",
    );
    // Label texts made once per scrape, not once per series.
    let method_class: Vec<String> = METHODS
        .iter()
        .flat_map(|m| {
            CLASSES
                .iter()
                .map(move |c| format!("method=\"{m}\",status_class=\"{c}\""))
        })
        .collect();
    for s in 0..slots {
        for (i, labels) in method_class.iter().enumerate() {
            let n = sum(&|slot| slot.requests[i].load(Ordering::Relaxed), s);
            if n > 0 {
                w.counter("tailgate_requests", &[&plan.slot_labels[s], labels], n);
            }
        }
        w.maybe_flush().await?;
    }

    w.family(
        "tailgate_request_errors",
        Kind::Counter,
        "Requests that ended in an error, by kind.",
    );
    let kinds: Vec<String> = ERROR_KINDS
        .iter()
        .map(|k| format!("kind=\"{k}\""))
        .collect();
    for s in 0..slots {
        for (k, kind) in kinds.iter().enumerate() {
            let n = sum(&|slot| slot.errors[k].load(Ordering::Relaxed), s);
            if n > 0 {
                w.counter("tailgate_request_errors", &[&plan.slot_labels[s], kind], n);
            }
        }
        w.maybe_flush().await?;
    }

    type SlotGet = fn(&crate::observe::metrics::RouteSlot) -> &std::sync::atomic::AtomicU64;
    let bytes: [(&str, &str, SlotGet); 2] = [
        (
            "tailgate_request_body_bytes",
            "Request body bytes received from clients and sent upstream.",
            |slot| &slot.bytes_in,
        ),
        (
            "tailgate_response_body_bytes",
            "Response body bytes sent to clients.",
            |slot| &slot.bytes_out,
        ),
    ];
    for (name, help, get) in bytes {
        w.family(name, Kind::Counter, help);
        for s in 0..slots {
            let n = sum(&|slot| get(slot).load(Ordering::Relaxed), s);
            if n > 0 {
                w.counter(name, &[&plan.slot_labels[s]], n);
            }
            w.maybe_flush().await?;
        }
    }

    w.family(
        "tailgate_requests_in_flight",
        Kind::Gauge,
        "Requests being served now.",
    );
    let in_flight: i64 = workers
        .iter()
        .map(|wk| wk.metrics.in_flight.load(Ordering::Relaxed))
        .sum();
    w.gauge("tailgate_requests_in_flight", &[], in_flight.max(0));

    if let Some(conns) = workers.first().map(|wk| &wk.shared.connections) {
        w.family(
            "tailgate_downstream_connections",
            Kind::Gauge,
            "Client connections open now.",
        );
        w.gauge("tailgate_downstream_connections", &[], conns.open() as u64);
        w.family(
            "tailgate_tenant_connections",
            Kind::Gauge,
            "Client connections open now whose tenant the connection names (its listener's, or its TLS server name's); connections classified only by each request's Host are not counted here.",
        );
        for (t, open) in conns.per_tenant().enumerate() {
            if let Some(tenant) = state.config.tenants.get(t) {
                w.gauge(
                    "tailgate_tenant_connections",
                    &[&format!("tenant=\"{}\"", escape_label(&tenant.name))],
                    open as u64,
                );
            }
        }
        w.family(
            "tailgate_downstream_connections_accepted",
            Kind::Counter,
            "Client connections accepted (counted once let in under server.max_connections).",
        );
        w.counter(
            "tailgate_downstream_connections_accepted",
            &[],
            conns.accepted.load(Ordering::Relaxed),
        );
        w.family(
            "tailgate_downstream_accept_pauses",
            Kind::Counter,
            "Times a listener stopped accepting because server.max_connections were open.",
        );
        w.counter(
            "tailgate_downstream_accept_pauses",
            &[],
            conns.pauses.load(Ordering::Relaxed),
        );
        w.family(
            "tailgate_downstream_connections_reclaimed",
            Kind::Counter,
            "Idle or silent client connections closed to make room under server.max_connections.",
        );
        w.counter(
            "tailgate_downstream_connections_reclaimed",
            &[],
            conns.reclaimed.load(Ordering::Relaxed),
        );
        w.family(
            "tailgate_downstream_tls_handshakes",
            Kind::Counter,
            "TLS handshakes with clients: full, resumed (session ticket or id), failed (the error, or the client's alert), timed_out (the hello begun, not done within server.header_read_timeout); a connection closed before its first byte is none.",
        );
        for how in crate::server::spawner::TlsHandshake::ALL {
            w.counter(
                "tailgate_downstream_tls_handshakes",
                &[&format!("result=\"{}\"", how.label())],
                conns.tls_handshakes[how as usize].load(Ordering::Relaxed),
            );
        }
        w.family(
            "tailgate_downstream_header_timeouts",
            Kind::Counter,
            "Client connections closed because a request head was not whole within server.header_read_timeout (a slowloris, or a client too slow); nothing is answered.",
        );
        w.counter(
            "tailgate_downstream_header_timeouts",
            &[],
            conns.header_timeouts.load(Ordering::Relaxed),
        );
        w.family(
            "tailgate_downstream_accept_errors",
            Kind::Counter,
            "Failed accepts (out of file descriptors or memory, mostly).",
        );
        w.counter(
            "tailgate_downstream_accept_errors",
            &[],
            conns.accept_errors.load(Ordering::Relaxed),
        );
    }

    w.family(
        "tailgate_request_duration_seconds",
        Kind::Histogram,
        "Time from when a request's head was read to the end of its response.",
    );
    for s in 0..slots {
        let mut h = Snapshot::default();
        for wk in workers {
            wk.metrics.slots()[s].total.add_to(&mut h);
        }
        if h.count() > 0 {
            w.histogram(
                "tailgate_request_duration_seconds",
                &[&plan.slot_labels[s]],
                &h,
            );
        }
        w.maybe_flush().await?;
    }

    w.family(
        "tailgate_request_stage_duration_seconds",
        Kind::Histogram,
        "Time spent in each stage of the request pipeline.",
    );
    let stages: Vec<String> = STAGES
        .iter()
        .map(|stage| format!("stage=\"{stage}\""))
        .collect();
    for s in 0..slots {
        for (i, stage) in stages.iter().enumerate() {
            let mut h = Snapshot::default();
            for wk in workers {
                wk.metrics.slots()[s].stages[i].add_to(&mut h);
            }
            if h.count() > 0 {
                w.histogram(
                    "tailgate_request_stage_duration_seconds",
                    &[&plan.slot_labels[s], stage],
                    &h,
                );
            }
        }
        w.maybe_flush().await?;
    }
    Ok(())
}

async fn consumers(state: &AdminState, w: &mut TextWriter) -> Result<(), Closed> {
    if state.plan.consumer_header.is_none() {
        return Ok(());
    }
    // The admin plane's own lock, held only to merge new cells into the index (never while
    // streaming, so a scraper that stops reading cannot hold up the next one).
    let tables: Vec<Option<&Consumers>> = state
        .workers
        .iter()
        .map(|wk| wk.metrics.consumers.as_ref())
        .collect();
    let merged = state.consumers.lock().await.update(&tables);
    // The `_other` row: every worker's overflow cell (index OVERFLOW_CELL), when used.
    let overflow_used = state
        .workers
        .iter()
        .filter_map(|wk| wk.metrics.consumers.as_ref())
        .any(|c| {
            c.overflow
                .requests
                .iter()
                .any(|n| n.load(Ordering::Relaxed) > 0)
        });
    let other: Option<ConsumerRow> = overflow_used.then(|| {
        (
            OVERFLOW.into(),
            (0..state.workers.len())
                .map(|w| (w, OVERFLOW_CELL))
                .collect(),
        )
    });
    let rows = || merged.iter().chain(other.iter());
    let cell = |wk: usize, i: usize| {
        let c = state.workers[wk].metrics.consumers.as_ref()?;
        if i == OVERFLOW_CELL {
            Some(&c.overflow)
        } else {
            c.cells.get(i)
        }
    };

    w.family(
        "tailgate_consumer_requests",
        Kind::Counter,
        "Requests finished, by consumer and status class.",
    );
    let mut label = String::new();
    for (name, parts) in rows() {
        for (c, class) in CLASSES.iter().enumerate() {
            let n: u64 = parts
                .iter()
                .filter_map(|&(wk, i)| cell(wk, i))
                .map(|cell| cell.requests[c].load(Ordering::Relaxed))
                .sum();
            if n > 0 {
                label.clear();
                let _ = write!(label, "consumer=\"{name}\",status_class=\"{class}\"");
                w.counter("tailgate_consumer_requests", &[&label], n);
            }
        }
        w.maybe_flush().await?;
    }
    w.family(
        "tailgate_consumer_response_body_bytes",
        Kind::Counter,
        "Response body bytes sent, by consumer.",
    );
    for (name, parts) in rows() {
        let n: u64 = parts
            .iter()
            .filter_map(|&(wk, i)| cell(wk, i))
            .map(|cell| cell.bytes_out.load(Ordering::Relaxed))
            .sum();
        label.clear();
        let _ = write!(label, "consumer=\"{name}\"");
        w.counter("tailgate_consumer_response_body_bytes", &[&label], n);
        w.maybe_flush().await?;
    }
    w.family(
        "tailgate_consumer_request_duration_seconds",
        Kind::Histogram,
        "Request latency by consumer.",
    );
    for (name, parts) in rows() {
        let mut h = Snapshot::default();
        for cell in parts.iter().filter_map(|&(wk, i)| cell(wk, i)) {
            cell.latency.add_to(&mut h);
        }
        label.clear();
        let _ = write!(label, "consumer=\"{name}\"");
        w.histogram("tailgate_consumer_request_duration_seconds", &[&label], &h);
        w.maybe_flush().await?;
    }
    let overflow: u64 = state
        .workers
        .iter()
        .filter_map(|wk| wk.metrics.consumers.as_ref())
        .map(|c| c.overflowed.load(Ordering::Relaxed))
        .sum();
    w.family(
        "tailgate_metrics_consumers",
        Kind::Gauge,
        "Distinct consumers with their own series.",
    );
    w.gauge("tailgate_metrics_consumers", &[], merged.len());
    w.family(
        "tailgate_metrics_consumers_overflow",
        Kind::Counter,
        "Requests counted under the consumer _other because a worker's consumer table was full.",
    );
    w.counter("tailgate_metrics_consumers_overflow", &[], overflow);
    Ok(())
}

/// The sums of one endpoint's counters over the workers.
#[derive(Default)]
struct EndpointSums {
    addr: Option<SocketAddr>,
    connects_on_request: u64,
    preconnects: u64,
    reuses: u64,
    retired: [u64; 6],
    retries: u64,
    refused_resends: u64,
    connect_failures: u64,
    tls: [u64; 3],
    h2_connections: u64,
    h2_waits: u64,
    learned_limit: u64,
    ejections: u64,
    ejected: bool,
    in_flight: u64,
    queued: u64,
    queue_timeouts: u64,
    queue_overflows: u64,
    /// Connections open under `max_connections_per_endpoint` (summed over the workers).
    capped_open: Option<u64>,
}

impl EndpointSums {
    fn add(&mut self, e: &EndpointPool) {
        self.addr = Some(e.addr);
        self.add_counts(&e.stats);
        self.learned_limit = self
            .learned_limit
            .max(u64::from(e.stats.learned_limit.load(Ordering::Relaxed)));
        self.ejections += e.load.ejections.load(Ordering::Relaxed);
        self.ejected |= e.load.is_ejected();
        self.in_flight += u64::from(e.load.in_flight());
        if let Some(open) = e.capped_open() {
            *self.capped_open.get_or_insert(0) += open as u64;
        }
    }

    /// The counters of pools drained on a worker.
    fn add_gone(&mut self, g: &GoneEndpoint) {
        self.add_counts(&g.stats);
        self.ejections += g.ejections;
    }

    fn add_counts(&mut self, s: &PoolStats) {
        let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        self.connects_on_request += l(&s.connects_on_request);
        self.preconnects += l(&s.preconnects);
        self.reuses += l(&s.reuses);
        self.retired[0] += l(&s.retired_max_requests);
        self.retired[1] += l(&s.retired_lifetime);
        self.retired[2] += l(&s.retired_idle);
        self.retired[3] += l(&s.closed_by_server);
        self.retired[4] += l(&s.retired_idle_cap);
        self.retired[5] += l(&s.retired_unusable);
        self.retries += l(&s.retries);
        self.refused_resends += l(&s.refused_resends);
        self.connect_failures += l(&s.connect_failures);
        self.tls[0] += l(&s.tls_full_handshakes);
        self.tls[1] += l(&s.tls_resumed_handshakes);
        self.tls[2] += l(&s.tls_handshake_failures);
        self.h2_connections += l(&s.h2_connections);
        self.h2_waits += l(&s.h2_waits_for_connect);
        self.queued += l(&s.queued);
        self.queue_timeouts += l(&s.queue_timeouts);
        self.queue_overflows += l(&s.queue_overflows);
    }
}

/// The sums of the endpoint at `addr` in `eps` (found through `at`, its index there),
/// added when it is not there yet.
fn sums_of<'a>(
    eps: &'a mut Vec<EndpointSums>,
    at: &mut HashMap<SocketAddr, usize>,
    addr: SocketAddr,
) -> &'a mut EndpointSums {
    let i = *at.entry(addr).or_insert_with(|| {
        eps.push(EndpointSums {
            addr: Some(addr),
            ..EndpointSums::default()
        });
        eps.len() - 1
    });
    &mut eps[i]
}

async fn upstreams(state: &AdminState, w: &mut TextWriter) -> Result<(), Closed> {
    // Per cluster: endpoints summed over workers, matched by address.
    let mut clusters: Vec<(String, Vec<EndpointSums>, u64)> = Vec::new();
    for (ci, cluster) in state.config.clusters.iter().enumerate() {
        let mut eps: Vec<EndpointSums> = Vec::new();
        let mut at: HashMap<SocketAddr, usize> = HashMap::new();
        let mut exhausted = 0;
        // The cluster's drained pools' counts (one for every worker) and every worker's
        // list of pools, read under the lock the lists change under (see `GonePools`); the
        // pools' own counters after it is let go. Held for no more than that: this thread
        // is `SCHED_IDLE`, and a busy core may leave it waiting while it holds the lock
        // (workers never wait for it, but a DNS change or a drain waits its turn).
        let gone = state
            .workers
            .first()
            .and_then(|wk| wk.upstreams.clusters.get(ci))
            .map(|pools| pools.gone.clone());
        let mut pools: Vec<Arc<EndpointPool>> = Vec::new();
        {
            let gone = gone.as_ref().map(|g| g.lock());
            for wk in &state.workers {
                let Some(cl) = wk.upstreams.clusters.get(ci) else {
                    continue;
                };
                exhausted += cl.budget_exhausted.load(Ordering::Relaxed);
                // Parked pools (addresses out of the latest DNS answer, not drained yet)
                // count too: their counters go on if the address comes back, and their
                // connections are still open.
                pools.extend(cl.endpoints.load().iter().cloned());
                pools.extend(cl.parked_pools());
            }
            for p in &pools {
                sums_of(&mut eps, &mut at, p.addr);
            }
            // A drained pool's counts stay with its address while any worker still has a
            // pool for it, so that its series never goes back; those of addresses no
            // worker has any more are summed under `endpoint="_removed"`, which only grows.
            if let Some(gone) = &gone {
                for g in &gone.by_addr {
                    sums_of(&mut eps, &mut at, g.addr).add_gone(g);
                }
                if let Some(r) = &gone.removed {
                    let mut s = EndpointSums::default();
                    s.add_gone(r);
                    eps.push(s);
                }
            }
        }
        for p in &pools {
            sums_of(&mut eps, &mut at, p.addr).add(p);
        }
        clusters.push((escape_label(&cluster.name), eps, exhausted));
    }
    let label = |c: &str, e: &EndpointSums| {
        format!(
            "cluster=\"{c}\",endpoint=\"{}\"",
            e.addr
                .map_or_else(|| "_removed".to_owned(), |a| a.to_string())
        )
    };
    type Get = fn(&EndpointSums) -> u64;
    let families: [(&str, Kind, &str, Get); 12] = [
        (
            "tailgate_upstream_queued",
            Kind::Counter,
            "Requests that found max_connections_per_endpoint connections open and none idle, and queued for one.",
            |e| e.queued,
        ),
        (
            "tailgate_upstream_queue_timeouts",
            Kind::Counter,
            "Queued requests that got no connection within the connect timeout (503 upstream_queue_timeout).",
            |e| e.queue_timeouts,
        ),
        (
            "tailgate_upstream_queue_overflows",
            Kind::Counter,
            "Requests refused at once because 1024 were queued already for the endpoint on one worker (503 upstream_queue_full).",
            |e| e.queue_overflows,
        ),
        (
            "tailgate_upstream_refused_resends",
            Kind::Counter,
            "Requests the server refused before processing them (HTTP/2 REFUSED_STREAM or past a GOAWAY), sent again on a new connection.",
            |e| e.refused_resends,
        ),
        (
            "tailgate_upstream_h2_connections",
            Kind::Counter,
            "HTTP/2 connections opened.",
            |e| e.h2_connections,
        ),
        (
            "tailgate_upstream_h2_waits_for_connect",
            Kind::Counter,
            "Requests that waited for an HTTP/2 connection another request was opening instead of opening one more.",
            |e| e.h2_waits,
        ),
        (
            "tailgate_upstream_connection_reuses",
            Kind::Counter,
            "Requests sent on a pooled connection (no connect paid).",
            |e| e.reuses,
        ),
        (
            "tailgate_upstream_retries",
            Kind::Counter,
            "Requests sent again on a new connection after a pooled one failed, or to another endpoint after a connect failure.",
            |e| e.retries,
        ),
        (
            "tailgate_upstream_connect_failures",
            Kind::Counter,
            "Connection attempts that failed or timed out.",
            |e| e.connect_failures,
        ),
        (
            "tailgate_upstream_ejections",
            Kind::Counter,
            "Times the endpoint was ejected by outlier detection.",
            |e| e.ejections,
        ),
        (
            "tailgate_upstream_learned_max_requests",
            Kind::Gauge,
            "The server's requests-per-connection limit learned from its closes (0: none seen); connections rotate one request earlier.",
            |e| e.learned_limit,
        ),
        (
            "tailgate_upstream_requests_in_flight",
            Kind::Gauge,
            "Requests to the endpoint waiting for their response head (the balancer's load; a streaming response body or a tunnel no longer counts).",
            |e| e.in_flight,
        ),
    ];

    w.family(
        "tailgate_upstream_connects",
        Kind::Counter,
        "Connections opened: on a request's path (the request waited for it) or ahead of need (warm spares, replacements).",
    );
    for (c, eps, _) in &clusters {
        for e in eps {
            let l = label(c, e);
            w.counter(
                "tailgate_upstream_connects",
                &[&l, "when=\"on_request\""],
                e.connects_on_request,
            );
            w.counter(
                "tailgate_upstream_connects",
                &[&l, "when=\"ahead\""],
                e.preconnects,
            );
            w.maybe_flush().await?;
        }
    }
    w.family(
        "tailgate_upstream_connections_retired",
        Kind::Counter,
        "Pooled connections ended, by reason.",
    );
    for (c, eps, _) in &clusters {
        for e in eps {
            let l = label(c, e);
            for (i, reason) in [
                "max_requests",
                "lifetime",
                "idle",
                "closed_by_server",
                "idle_cap",
                "unusable",
            ]
            .iter()
            .enumerate()
            {
                let r = format!("reason=\"{reason}\"");
                w.counter(
                    "tailgate_upstream_connections_retired",
                    &[&l, &r],
                    e.retired[i],
                );
            }
            w.maybe_flush().await?;
        }
    }
    w.family(
        "tailgate_upstream_connections_open",
        Kind::Gauge,
        "HTTP/1.1 connections open to the endpoint (busy and idle), for clusters with max_connections_per_endpoint.",
    );
    for (c, eps, _) in &clusters {
        for e in eps {
            if let Some(open) = e.capped_open {
                w.gauge("tailgate_upstream_connections_open", &[&label(c, e)], open);
            }
            w.maybe_flush().await?;
        }
    }
    for (name, kind, help, get) in families {
        w.family(name, kind, help);
        for (c, eps, _) in &clusters {
            for e in eps {
                let l = label(c, e);
                match kind {
                    Kind::Counter => w.counter(name, &[&l], get(e)),
                    _ => w.gauge(name, &[&l], get(e)),
                }
                w.maybe_flush().await?;
            }
        }
    }
    w.family(
        "tailgate_upstream_tls_handshakes",
        Kind::Counter,
        "TLS handshakes to upstreams: full, resumed (session ticket or id), failed.",
    );
    for (c, eps, _) in &clusters {
        for e in eps {
            let l = label(c, e);
            for (i, kind) in ["full", "resumed", "failed"].iter().enumerate() {
                let k = format!("kind=\"{kind}\"");
                w.counter("tailgate_upstream_tls_handshakes", &[&l, &k], e.tls[i]);
            }
            w.maybe_flush().await?;
        }
    }
    w.family(
        "tailgate_upstream_ejected",
        Kind::Gauge,
        "1 while the endpoint is ejected (on any worker).",
    );
    for (c, eps, _) in &clusters {
        for e in eps {
            w.gauge(
                "tailgate_upstream_ejected",
                &[&label(c, e)],
                u8::from(e.ejected),
            );
            w.maybe_flush().await?;
        }
    }
    // Per cluster: hedging, summed over workers, and endpoint-list changes. Every worker
    // follows each DNS change and counts it, so those are the most any worker counted
    // (each count only grows), not their sum (`true` below).
    type ClusterGet = fn(&crate::upstream::ClusterStats) -> &std::sync::atomic::AtomicU64;
    let cluster_families: [(&str, &str, ClusterGet, bool); 6] = [
        (
            "tailgate_upstream_overflows",
            "Requests refused (503 upstream_overflow) because the cluster's max_requests were in flight.",
            |c| &c.overflows,
            false,
        ),
        (
            "tailgate_upstream_hedges_fired",
            "Second copies of a request sent to another endpoint after the hedge delay.",
            |c| &c.hedges_fired,
            false,
        ),
        (
            "tailgate_upstream_hedges_won",
            "Hedges whose response came first.",
            |c| &c.hedges_won,
            false,
        ),
        (
            "tailgate_upstream_hedges_refused",
            "Hedges not sent because the hedge or retry budget was spent.",
            |c| &c.hedges_refused,
            false,
        ),
        (
            "tailgate_upstream_endpoints_added",
            "Endpoints added to the cluster by DNS.",
            |c| &c.endpoints_added,
            true,
        ),
        (
            "tailgate_upstream_endpoints_removed",
            "Endpoints removed from the cluster by DNS (their pools drained).",
            |c| &c.endpoints_removed,
            true,
        ),
    ];
    for (name, help, get, each_worker_counts) in cluster_families {
        w.family(name, Kind::Counter, help);
        for (ci, (c, _, _)) in clusters.iter().enumerate() {
            let counts = state
                .workers
                .iter()
                .filter_map(|wk| wk.upstreams.clusters.get(ci))
                .map(|p| get(&p.stats).load(Ordering::Relaxed));
            let n: u64 = if each_worker_counts {
                counts.max().unwrap_or(0)
            } else {
                counts.sum()
            };
            w.counter(name, &[&format!("cluster=\"{c}\"")], n);
        }
    }
    // What the cluster has now: a host name with no address (none yet, or none any more)
    // shows as 0 before any request gets its `502 no_endpoints`. (Every worker follows
    // the same DNS answers; the fewest any worker has, so a worker still behind shows.)
    w.family(
        "tailgate_upstream_endpoints",
        Kind::Gauge,
        "Endpoints the cluster has now (its addresses, and those its host names resolve to).",
    );
    for (ci, (c, _, _)) in clusters.iter().enumerate() {
        let n = state
            .workers
            .iter()
            .filter_map(|wk| wk.upstreams.clusters.get(ci))
            .map(|p| p.endpoint_count())
            .min()
            .unwrap_or(0);
        w.gauge(
            "tailgate_upstream_endpoints",
            &[&format!("cluster=\"{c}\"")],
            n as u64,
        );
    }
    let d = &state.dns;
    let dns: [(&str, &str, u64); 5] = [
        (
            "tailgate_dns_lookups",
            "Host-name lookups answered (with addresses, or that the name has none).",
            d.lookups.load(Ordering::Relaxed),
        ),
        (
            "tailgate_dns_failures",
            "Lookups that failed; the last addresses were kept (served stale).",
            d.failures.load(Ordering::Relaxed),
        ),
        (
            "tailgate_dns_changes",
            "Times a cluster's address list changed and was published to the workers.",
            d.changes.load(Ordering::Relaxed),
        ),
        (
            "tailgate_dns_early_refreshes",
            "Re-resolutions asked for early: by connect or TLS failures to a resolved address, or by requests that found the cluster without endpoints.",
            d.early_refreshes.load(Ordering::Relaxed),
        ),
        (
            "tailgate_dns_unusable_addresses",
            "Addresses in answers left out at each lookup: link-local IPv6 (no interface), unspecified, multicast or broadcast.",
            d.unusable.load(Ordering::Relaxed),
        ),
    ];
    for (name, help, v) in dns {
        w.family(name, Kind::Counter, help);
        w.counter(name, &[], v);
    }
    w.family(
        "tailgate_upstream_retry_budget_exhausted",
        Kind::Counter,
        "Retries refused because the cluster's retry budget was spent.",
    );
    for (c, _, exhausted) in &clusters {
        w.counter(
            "tailgate_upstream_retry_budget_exhausted",
            &[&format!("cluster=\"{c}\"")],
            *exhausted,
        );
    }
    Ok(())
}

fn runtime(state: &AdminState, w: &mut TextWriter) {
    w.family(
        "tailgate_runtime_lag_seconds",
        Kind::Histogram,
        "How late each data-plane worker ran its scheduled lag-probe tick.",
    );
    for (i, wk) in state.workers.iter().enumerate() {
        let h = wk.metrics.lag.snapshot();
        w.histogram(
            "tailgate_runtime_lag_seconds",
            &[&format!("worker=\"{i}\"")],
            &h,
        );
    }
    w.family(
        "tailgate_runtime_last_tick_age_seconds",
        Kind::Gauge,
        "Time since each worker last ran its lag probe (grows while a worker is stalled).",
    );
    let now = state.plan.now_ms();
    for (i, wk) in state.workers.iter().enumerate() {
        let last = wk.metrics.last_tick_ms.load(Ordering::Relaxed);
        let age = if last == 0 {
            now
        } else {
            now.saturating_sub(last)
        };
        w.gauge(
            "tailgate_runtime_last_tick_age_seconds",
            &[&format!("worker=\"{i}\"")],
            age as f64 / 1000.0,
        );
    }
    w.family(
        "tailgate_panics",
        Kind::Counter,
        "Panics on any thread (a connection task's: tokio closes that connection and the worker goes on), each logged with its thread and place.",
    );
    w.counter("tailgate_panics", &[], crate::logging::panics());
    w.family(
        "tailgate_queue_dropped",
        Kind::Counter,
        "Items dropped because a bounded queue was full.",
    );
    w.counter(
        "tailgate_queue_dropped",
        &["queue=\"log\""],
        crate::logging::dropped_lines(),
    );
    w.family(
        "tailgate_metrics_last_render_seconds",
        Kind::Gauge,
        "How long the previous /metrics scrape took to render and send.",
    );
    w.gauge(
        "tailgate_metrics_last_render_seconds",
        &[],
        state.last_render_ns.load(Ordering::Relaxed) as f64 / 1e9,
    );
    w.family(
        "tailgate_metrics_last_series",
        Kind::Gauge,
        "Samples in the previous /metrics scrape.",
    );
    w.gauge(
        "tailgate_metrics_last_series",
        &[],
        state.last_samples.load(Ordering::Relaxed),
    );
}

fn process(state: &AdminState, w: &mut TextWriter) {
    let p = crate::observe::process::read();
    let _ = state;
    w.family(
        "process_cpu_seconds",
        Kind::Counter,
        "User and system CPU time spent.",
    );
    w.counter("process_cpu_seconds", &[], p.cpu_seconds);
    // A field that could not be read (out of file descriptors) is left out, not `0`.
    let u = |v: Option<u64>| v.map(|v| v as f64);
    let gauges: [(&str, &str, Option<f64>); 6] = [
        (
            "process_resident_memory_bytes",
            "Resident memory size.",
            u(p.resident_bytes),
        ),
        (
            "process_virtual_memory_bytes",
            "Virtual memory size.",
            u(p.virtual_bytes),
        ),
        ("process_open_fds", "Open file descriptors.", u(p.open_fds)),
        (
            "process_max_fds",
            "The limit on open file descriptors.",
            u(p.max_fds),
        ),
        ("process_threads", "OS threads.", u(p.threads)),
        (
            "process_start_time_seconds",
            "Start time of the process since the Unix epoch.",
            p.start_time_seconds,
        ),
    ];
    for (name, help, v) in gauges {
        if let Some(v) = v {
            w.family(name, Kind::Gauge, help);
            w.gauge(name, &[], v);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Scrapes with no new consumer in between share the merged rows; new cells while a
    /// scrape still holds them go to a copy, and that scrape's rows stay as they were.
    #[test]
    fn merged_rows_are_shared_until_new_cells_come() {
        let (a, b) = (Consumers::new(100), Consumers::new(100));
        a.record(b"x", 1, 10, Duration::from_millis(1));
        b.record(b"x", 1, 10, Duration::from_millis(1));
        b.record(b"y", 1, 10, Duration::from_millis(1));
        let mut merge = ConsumerMerge::default();
        let first = merge.update(&[Some(&a), Some(&b)]);
        let names: Vec<&str> = first.iter().map(|(n, _)| &**n).collect();
        assert_eq!(names, ["x", "y"]);
        assert_eq!(first[0].1, [(0, 0), (1, 0)]);
        let second = merge.update(&[Some(&a), Some(&b)]);
        assert!(Arc::ptr_eq(&first, &second), "copied with nothing new");
        a.record(b"z", 1, 10, Duration::from_millis(1));
        let third = merge.update(&[Some(&a), Some(&b)]);
        assert!(!Arc::ptr_eq(&first, &third));
        assert_eq!(first.len(), 2, "an earlier scrape's rows changed under it");
        assert_eq!(third.len(), 3);
        assert_eq!(&*third[2].0, "z");
        // Once nobody else holds them, new cells are merged in place.
        drop((first, second));
        let ptr = Arc::as_ptr(&third);
        drop(third);
        b.record(b"w", 1, 10, Duration::from_millis(1));
        let fourth = merge.update(&[Some(&a), Some(&b)]);
        assert_eq!(Arc::as_ptr(&fourth), ptr);
        assert_eq!(fourth.len(), 4);
    }
}
