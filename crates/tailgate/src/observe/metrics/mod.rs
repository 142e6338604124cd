//! Request metrics, recorded by the data plane without a lock and rendered by the admin
//! thread (seed 001: rendering 100k series on a request worker stalled requests for up to
//! a second).
//!
//! - Every series a request touches is resolved when the config loads: a [`RouteSlot`] per
//!   route (and one per tenant for requests no route matched), indexed by the route id the
//!   router already returns. Recording is a few relaxed atomic adds; there is no registry
//!   lookup and no hashing per request (except the consumer lookup below, when configured).
//! - Each worker owns its own [`WorkerMetrics`], so even the atomics are uncontended; the
//!   renderer sums the workers.
//! - Per-consumer series ([`consumers`]) are the one dynamic set: each worker indexes its
//!   consumers in a map only that worker's thread touches, and publishes new cells in an
//!   append-only lock-free list the renderer reads.
//! - Label text is escaped once, at config load (routes, tenants) or when a consumer is
//!   first seen; a scrape writes fixed-order series and never sorts.

pub mod consumers;
pub mod histogram;
pub mod render;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use self::consumers::Consumers;
use self::histogram::Histogram;
use super::Exchange;
use crate::config::Config;

/// Methods with their own label value; others count as `OTHER`.
pub const METHODS: [&str; 8] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "OTHER",
];
/// Status classes; `none` is an exchange that ended before any status (client gone).
pub const CLASSES: [&str; 6] = ["1xx", "2xx", "3xx", "4xx", "5xx", "none"];
/// Error kinds with their own label value (the codes of `ProxyError` and of the bodies).
pub const ERROR_KINDS: [&str; 28] = [
    "no_route",
    "method_not_allowed",
    "misdirected_request",
    "bad_request",
    "header_too_large",
    "uri_too_long",
    "not_implemented",
    "body_too_large",
    "client_body_timeout",
    "upstream_connect_failed",
    "upstream_connect_timeout",
    "upstream_reset",
    "upstream_timeout",
    "no_endpoints",
    "upstream_tls_failed",
    "upgrade_needs_http1",
    "upstream_overflow",
    "upstream_queue_timeout",
    "upstream_queue_full",
    "endpoint_removed",
    "total_timeout",
    "upstream_body",
    "upstream_body_timeout",
    "client_gone",
    "send_timeout",
    "tunnel_idle_timeout",
    "shutdown",
    "other",
];
/// Stages with their own latency histogram (DESIGN.md rule 5: every stage is timed).
pub const STAGES: [&str; 5] = [
    "route",
    "auth",
    "rate_limit",
    "upstream_connect",
    "upstream_ttfb",
];

pub fn method_index(m: &http::Method) -> usize {
    match *m {
        http::Method::GET => 0,
        http::Method::HEAD => 1,
        http::Method::POST => 2,
        http::Method::PUT => 3,
        http::Method::DELETE => 4,
        http::Method::PATCH => 5,
        http::Method::OPTIONS => 6,
        _ => 7,
    }
}

pub fn class_index(status: u16) -> usize {
    match status {
        100..=599 => usize::from(status / 100 - 1),
        _ => 5,
    }
}

fn error_index(code: &str) -> usize {
    ERROR_KINDS
        .iter()
        .position(|k| *k == code)
        .unwrap_or(ERROR_KINDS.len() - 1)
}

/// The series of one route (or of the unrouted requests of one tenant) on one worker.
#[derive(Debug)]
pub struct RouteSlot {
    /// Indexed `method * CLASSES.len() + class`.
    pub requests: [AtomicU64; METHODS.len() * CLASSES.len()],
    pub errors: [AtomicU64; ERROR_KINDS.len()],
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    pub total: Histogram,
    /// Indexed like [`STAGES`].
    pub stages: [Histogram; STAGES.len()],
}

impl Default for RouteSlot {
    fn default() -> Self {
        RouteSlot {
            requests: std::array::from_fn(|_| AtomicU64::new(0)),
            errors: Default::default(),
            bytes_in: AtomicU64::new(0),
            bytes_out: AtomicU64::new(0),
            total: Histogram::default(),
            stages: Default::default(),
        }
    }
}

impl RouteSlot {
    pub fn add_bytes_in(&self, n: u64) {
        self.bytes_in.fetch_add(n, Ordering::Relaxed);
    }
}

/// What a config version's metrics look like: the label text of every slot, escaped once.
#[derive(Debug)]
pub struct MetricsPlan {
    /// `tenant="…",route="…"` per slot: the routes' slots first (one for a route with a
    /// tenant; one per tenant plus one for none for a route without), then one per tenant
    /// for unrouted requests, then one for requests with neither.
    pub slot_labels: Vec<String>,
    /// Per route: its first slot, and whether it has one slot per tenant.
    route_slots: Vec<(usize, bool)>,
    /// Where the unrouted slots start.
    unrouted: usize,
    pub routes: usize,
    pub tenants: usize,
    pub consumer_header: Option<http::HeaderName>,
    pub max_consumers: usize,
    /// The clock of [`WorkerMetrics::last_tick_ms`].
    pub epoch: Instant,
}

impl MetricsPlan {
    pub fn new(config: &Config) -> MetricsPlan {
        let tenant_name = |t: Option<usize>| {
            t.and_then(|t| config.tenants.get(t))
                .map_or(String::new(), |t| escape_label(&t.name))
        };
        let mut slot_labels = Vec::new();
        let mut route_slots = Vec::new();
        for r in &config.routes {
            let name = escape_label(&r.name);
            match r.tenant {
                Some(t) => {
                    route_slots.push((slot_labels.len(), false));
                    slot_labels.push(format!(
                        "tenant=\"{}\",route=\"{name}\"",
                        tenant_name(Some(t))
                    ));
                }
                None => {
                    route_slots.push((slot_labels.len(), true));
                    for t in (0..config.tenants.len()).map(Some).chain([None]) {
                        slot_labels.push(format!("tenant=\"{}\",route=\"{name}\"", tenant_name(t)));
                    }
                }
            }
        }
        let unrouted = slot_labels.len();
        for t in 0..config.tenants.len() {
            slot_labels.push(format!("tenant=\"{}\",route=\"\"", tenant_name(Some(t))));
        }
        slot_labels.push("tenant=\"\",route=\"\"".to_owned());
        MetricsPlan {
            slot_labels,
            route_slots,
            unrouted,
            routes: config.routes.len(),
            tenants: config.tenants.len(),
            consumer_header: config.metrics.consumer_header.clone(),
            max_consumers: config.metrics.max_consumers,
            epoch: Instant::now(),
        }
    }

    fn slot_index(&self, route: Option<usize>, tenant: Option<usize>) -> usize {
        let tenant = tenant.filter(|&t| t < self.tenants);
        match (route.and_then(|r| self.route_slots.get(r)), tenant) {
            (Some(&(start, false)), _) => start,
            (Some(&(start, true)), t) => start + t.unwrap_or(self.tenants),
            (None, Some(t)) => self.unrouted + t,
            (None, None) => self.unrouted + self.tenants,
        }
    }

    /// The slots of route `r` (one, or one per tenant for a route without a tenant).
    pub fn route_slot_range(&self, r: usize) -> std::ops::Range<usize> {
        match self.route_slots.get(r) {
            Some(&(start, false)) => start..start + 1,
            Some(&(start, true)) => start..start + self.tenants + 1,
            None => 0..0,
        }
    }

    /// Milliseconds since the plan was made (the clock of the lag probe's last tick).
    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }
}

/// One worker's metrics. Only that worker writes them; the admin thread reads them.
#[derive(Debug)]
pub struct WorkerMetrics {
    pub plan: Arc<MetricsPlan>,
    slots: Box<[RouteSlot]>,
    pub in_flight: AtomicI64,
    pub consumers: Option<Consumers>,
    /// How late the worker ran its scheduled lag-probe ticks.
    pub lag: Histogram,
    /// When the lag probe last ran ([`MetricsPlan::now_ms`]); 0 before the first tick.
    pub last_tick_ms: AtomicU64,
    /// The worker's drain is over and it has stopped (its lag probe with it): not stalled.
    pub exited: std::sync::atomic::AtomicBool,
}

impl WorkerMetrics {
    pub fn new(plan: Arc<MetricsPlan>) -> WorkerMetrics {
        let slots = (0..plan.slot_labels.len())
            .map(|_| RouteSlot::default())
            .collect();
        let consumers = plan
            .consumer_header
            .is_some()
            .then(|| Consumers::new(plan.max_consumers));
        WorkerMetrics {
            plan,
            slots,
            in_flight: AtomicI64::new(0),
            consumers,
            lag: Histogram::default(),
            last_tick_ms: AtomicU64::new(0),
            exited: std::sync::atomic::AtomicBool::new(false),
        }
    }

    pub fn slot(&self, route: Option<usize>, tenant: Option<usize>) -> &RouteSlot {
        &self.slots[self.plan.slot_index(route, tenant)]
    }

    pub fn slots(&self) -> &[RouteSlot] {
        &self.slots
    }

    pub fn request_started(&self) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
    }

    /// Records a finished exchange: counts, bytes, errors, latencies, its consumer's series.
    pub fn record(&self, ex: &Exchange) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        let slot = self.slot(ex.route, ex.tenant);
        let class = class_index(ex.status);
        slot.requests[method_index(&ex.method) * CLASSES.len() + class]
            .fetch_add(1, Ordering::Relaxed);
        if let Some(code) = ex.error {
            slot.errors[error_index(code)].fetch_add(1, Ordering::Relaxed);
        }
        slot.bytes_out.fetch_add(ex.bytes_out, Ordering::Relaxed);
        let t = &ex.timings;
        // An upgrade's latency is its handshake's (see `StageTimings::handshake`).
        let total = t.handshake.unwrap_or(t.total);
        slot.total.record(total);
        // Routing ran to its end (no route, or a refusal before it ended, an early 413 or
        // a stalled small body, has no route time: it was recorded as a zero).
        if let Some(d) = t.route {
            slot.stages[0].record(d);
        }
        if let Some(d) = t.auth {
            slot.stages[1].record(d);
        }
        if let Some(d) = t.rate_limit {
            slot.stages[2].record(d);
        }
        // Zero: the request never got as far as the upstream.
        if ex.reused_connection || !t.upstream_connect.is_zero() {
            slot.stages[3].record(t.upstream_connect);
        }
        if !t.upstream_ttfb.is_zero() {
            slot.stages[4].record(t.upstream_ttfb);
        }
        // Only routed requests: a stream of 404s with made-up names cannot fill the table.
        if let (Some(c), Some(name), Some(_)) = (&self.consumers, &ex.consumer, ex.route) {
            c.record(name.as_bytes(), class, ex.bytes_out, total);
        }
    }

    /// Records one lag-probe tick that ran `late` after it was due.
    pub fn record_lag(&self, late: Duration) {
        self.lag.record(late);
        self.last_tick_ms
            .store(self.plan.now_ms().max(1), Ordering::Relaxed);
    }
}

/// Escapes a label value for the text formats (`\`, `"` and newlines).
pub fn escape_label(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for ch in v.chars() {
        match ch {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_and_methods_have_fixed_indexes() {
        assert_eq!(CLASSES[class_index(204)], "2xx");
        assert_eq!(CLASSES[class_index(599)], "5xx");
        assert_eq!(CLASSES[class_index(0)], "none");
        assert_eq!(METHODS[method_index(&http::Method::CONNECT)], "OTHER");
        assert_eq!(ERROR_KINDS[error_index("no_such_code")], "other");
        assert_eq!(escape_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
    /// Every code an exchange can fail with has its own `kind` label value: those of
    /// `ProxyError` (the match below stops compiling when a variant is added) and the
    /// literal ones the response body and the recorder fail with.
    #[test]
    fn every_error_code_has_its_own_kind() {
        use crate::pipeline::error::ProxyError as E;
        let io = || std::io::Error::other("x");
        let all = [
            E::NoRoute,
            E::MethodNotAllowed(Vec::new()),
            E::Misdirected,
            E::BadRequest("x"),
            E::HeadTooLarge("x"),
            E::UriTooLong("x"),
            E::NotImplemented("x"),
            E::BodyTooLarge(1),
            E::ClientBodyTimeout,
            E::UpstreamConnect(io()),
            E::UpstreamTls(io()),
            E::ConnectTimeout,
            E::UpstreamReset("x".into()),
            E::UpstreamTimeout,
            E::NoEndpoints,
            E::UpstreamOverflow,
            E::UpstreamQueueTimeout,
            E::UpstreamQueueFull,
            E::EndpointRemoved,
            E::UpgradeNeedsHttp1,
            E::ClientBodyEnded,
        ];
        for e in &all {
            match e {
                E::NoRoute
                | E::MethodNotAllowed(_)
                | E::Misdirected
                | E::BadRequest(_)
                | E::ClientBodyEnded
                | E::HeadTooLarge(_)
                | E::UriTooLong(_)
                | E::NotImplemented(_)
                | E::BodyTooLarge(_)
                | E::ClientBodyTimeout
                | E::UpstreamConnect(_)
                | E::UpstreamTls(_)
                | E::ConnectTimeout
                | E::UpstreamReset(_)
                | E::UpstreamTimeout
                | E::NoEndpoints
                | E::UpstreamOverflow
                | E::UpstreamQueueTimeout
                | E::UpstreamQueueFull
                | E::EndpointRemoved
                | E::UpgradeNeedsHttp1 => {}
            }
            assert_ne!(error_index(e.code()), ERROR_KINDS.len() - 1, "{}", e.code());
        }
        let sources = [
            include_str!("../../pipeline/body.rs"),
            include_str!("../mod.rs"),
        ];
        let mut literal = 0;
        // Codes given to `fail`, and to the response body's `cut`.
        for src in sources {
            for call in [".fail(\"", ".cut(\""] {
                for piece in src.split(call).skip(1) {
                    let code = piece.split('"').next().unwrap_or_default();
                    assert_ne!(error_index(code), ERROR_KINDS.len() - 1, "{code}");
                    literal += 1;
                }
            }
        }
        assert!(literal >= 3, "the literal codes were found ({literal})");
        // The codes an exchange nobody finished is recorded with (`ExchangeRecorder`'s
        // drop, `ending_as` in `server::stream_stall`).
        for code in ["client_gone", "send_timeout", "total_timeout"] {
            assert_ne!(error_index(code), ERROR_KINDS.len() - 1, "{code}");
        }
        // And those a response cut short by the client's own body is recorded with.
        use crate::pipeline::body::ReqBodyError;
        for b in [ReqBodyError::TooLarge(1), ReqBodyError::TimedOut] {
            let code = crate::pipeline::client_body_error(&b).code();
            assert_ne!(error_index(code), ERROR_KINDS.len() - 1, "{code}");
        }
    }
}
