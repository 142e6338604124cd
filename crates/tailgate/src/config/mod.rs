//! The TOML config: the file's shape ([`file`]), its validation into a checked [`Config`]
//! with `file:line:col` errors (`validate`), and duration/size parsing.
//!
//! Loading never panics on input: every problem becomes a [`ConfigError`] that names the
//! place, the field, what is wrong and what to write instead.

mod admin;
mod file;
mod upstream_tls;
mod validate;

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use file::RawConfig;
pub use validate::host_matches;

/// A validated config, ready to build a gateway from.
#[derive(Debug, Clone)]
pub struct Config {
    pub source: PathBuf,
    pub server: ServerSettings,
    pub log: LogSettings,
    pub dns: DnsSettings,
    pub demos: Vec<SocketAddr>,
    pub listeners: Vec<Listener>,
    pub tenants: Vec<Tenant>,
    pub clusters: Vec<Cluster>,
    pub routes: Vec<Route>,
    /// The admin listener (`/metrics`, `/healthz`, `/readyz`, `/stats`), if configured.
    pub admin: Option<AdminSettings>,
    pub metrics: MetricsSettings,
}

#[derive(Debug, Clone)]
pub struct AdminSettings {
    pub address: SocketAddr,
    /// How often each worker's lag probe asks to be woken.
    pub lag_probe_interval: Duration,
    /// A worker that has not run its probe for this long is stalled: `/healthz` fails and
    /// the systemd watchdog is not fed.
    pub stall_threshold: Duration,
}

#[derive(Debug, Clone, Default)]
pub struct MetricsSettings {
    /// Count requests per consumer, named by this request header's value.
    pub consumer_header: Option<http::HeaderName>,
    /// Distinct consumers tracked per worker; later ones are counted as `_other`.
    pub max_consumers: usize,
}

#[derive(Debug, Clone)]
pub struct ServerSettings {
    /// Data-plane threads, each with its own current-thread runtime.
    pub workers: usize,
    pub shutdown_grace: Duration,
    /// After SIGTERM, how long `/readyz` says 503 while the listeners still accept, before
    /// the drain begins (for a load balancer to stop sending new connections first).
    pub shutdown_delay: Duration,
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_header_bytes: usize,
    /// 0 means no limit.
    pub max_body_bytes: u64,
    pub request_id_header: http::HeaderName,
    /// How long readiness waits, from when the workers start, for clusters' warm connections
    /// (`min_warm_connections`); past it, a cluster still cold no longer holds it back.
    pub warm_wait: Duration,
    /// Open client connections over every worker at which accepting stops; 0: no cap.
    pub max_connections: usize,
    /// The config does not set `max_connections`: `serve` derives it from the open files
    /// limit (it is 0 until then).
    pub max_connections_unset: bool,
    /// Requests one client connection may carry; the last is answered and the connection
    /// closed (HTTP/1.1 `Connection: close`, HTTP/2 GOAWAY). 0: no cap.
    pub max_requests_per_connection: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone)]
pub struct LogSettings {
    pub level: String,
    pub format: LogFormat,
    pub access_log: bool,
}

/// How host-name endpoints are resolved (`[dns]`).
#[derive(Debug, Clone)]
pub struct DnsSettings {
    /// Name servers to ask; empty: the system's (`/etc/resolv.conf`).
    pub nameservers: Vec<SocketAddr>,
    /// A name is re-resolved at most this often (short TTLs, early refreshes after connect
    /// failures, retries after resolver failures), and at least every `max_refresh`.
    pub min_refresh: Duration,
    pub max_refresh: Duration,
    pub query_timeout: Duration,
    /// How long start-up waits for the first resolution of every name.
    pub startup_timeout: Duration,
    /// Which address families a name is looked up for.
    pub family: DnsFamily,
}

/// The address families a host name is looked up for (`dns.family`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DnsFamily {
    /// A and AAAA: every address is an endpoint.
    Any,
    /// A only (nginx's resolver `ipv6=off`): for a host with no IPv6 route, where every
    /// connect to a name's IPv6 addresses fails.
    Ipv4,
    /// AAAA only.
    Ipv6,
}

impl DnsFamily {
    /// Is a lookup of records of this kind made (`v6`: AAAA, else A)?
    pub fn looks_up(self, v6: bool) -> bool {
        match self {
            DnsFamily::Any => true,
            DnsFamily::Ipv4 => !v6,
            DnsFamily::Ipv6 => v6,
        }
    }
}

/// A host-name endpoint: resolved in the background, never on a request's path.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HostPort {
    /// Lower case, without a trailing dot.
    pub host: String,
    pub port: u16,
    /// Written with a trailing dot (`api.example.com.:443`): a fully qualified name, looked
    /// up as it is, without the resolver's search domains.
    pub fqdn: bool,
}

impl HostPort {
    /// The name to look up: with its trailing dot when it was written with one.
    pub fn lookup_name(&self) -> String {
        if self.fqdn {
            format!("{}.", self.host)
        } else {
            self.host.clone()
        }
    }
}

#[derive(Debug, Clone)]
pub struct Listener {
    pub name: String,
    pub address: SocketAddr,
    /// Index into [`Config::tenants`]: every connection here belongs to this tenant.
    pub tenant: Option<usize>,
    pub tls: Option<TlsFiles>,
}

#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

#[derive(Debug, Clone)]
pub struct Tenant {
    pub name: String,
    /// Lower-case host names; a leading `*.` matches any subdomain.
    pub hosts: Vec<String>,
}

#[derive(Debug, Clone)]
pub struct Cluster {
    pub name: String,
    /// Endpoints written as IP literals.
    pub endpoints: Vec<SocketAddr>,
    /// Endpoints written as host names: every address they resolve to is an endpoint.
    pub hostnames: Vec<HostPort>,
    pub connect_timeout: Duration,
    pub max_idle_per_endpoint: usize,
    /// HTTP/1.1 connections open to one endpoint from one worker, busy and idle (0: no
    /// cap); past it requests queue for one, up to `connect_timeout`.
    pub max_connections_per_endpoint: usize,
    pub idle_timeout: Duration,
    /// Retire a connection after this many requests (0: no cap).
    pub max_requests_per_connection: u32,
    pub max_connection_lifetime: Option<Duration>,
    /// Idle connections kept open ahead of need, per endpoint and worker.
    pub min_warm_connections: usize,
    pub balance: crate::upstream::Balance,
    /// Consecutive failures (connect errors, 5xx) that eject an endpoint (0: never).
    pub eject_after_failures: u32,
    /// First ejection period; it doubles with each ejection in a row, up to 30 s.
    pub eject_duration: Duration,
    /// Retries may be at most this percentage of requests.
    pub retry_budget_percent: u32,
    /// Hedged requests may be at most this percentage of requests (they also spend retries).
    pub hedge_budget_percent: u32,
    /// Requests in flight to this cluster at once, over every worker (0: no cap).
    pub max_requests: usize,
    /// Set when the endpoints are `https://` (a cluster's endpoints share one scheme).
    pub tls: Option<crate::upstream::UpstreamTls>,
    /// HTTP/1.1, HTTP/2 (multiplexed), or chosen by ALPN.
    pub protocol: crate::upstream::Protocol,
    /// HTTP/2: ping a connection after this long without a frame from the server, and close
    /// it when the ping is not answered within `connect_timeout` (`None`: never).
    pub http2_keepalive_interval: Option<Duration>,
}

#[derive(Debug, Clone)]
pub struct Route {
    /// The route's label in metrics and logs (`route<index>` unless named).
    pub name: String,
    /// Index into [`Config::tenants`].
    pub tenant: Option<usize>,
    pub host: Option<String>,
    pub path_prefix: String,
    /// Empty means every method.
    pub methods: Vec<http::Method>,
    /// Index into [`Config::clusters`].
    pub cluster: usize,
    pub response_timeout: Duration,
    /// `None`: no limit on the whole exchange.
    pub total_timeout: Option<Duration>,
    /// Every request on this route may be sent twice (the upstream deduplicates, or its
    /// POSTs are safe to repeat): replayed after a stale pooled connection like a GET.
    pub idempotent: bool,
    /// Send a second copy to another endpoint when no response head came by then.
    pub hedge_delay: Option<HedgeDelay>,
    /// Sent upstream in place of the matched `path_prefix` (Envoy's `prefix_rewrite`,
    /// nginx's `proxy_pass` with a URI): `None` sends the target as the client did.
    pub rewrite_prefix: Option<String>,
    /// The Host sent upstream in place of the client's (Envoy's `host_rewrite_literal`,
    /// nginx's `proxy_set_header Host`): `None` sends the client's.
    pub host_rewrite: Option<String>,
}

/// When a hedged request's second copy is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HedgeDelay {
    Fixed(Duration),
    /// This percentile (in tenths of a percent) of the route's observed time to response
    /// head, per worker.
    Percentile(u32),
}

impl Config {
    /// Reads, parses and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigErrors> {
        let bytes = std::fs::read(path).map_err(|e| {
            ConfigErrors(vec![ConfigError {
                file: path.to_path_buf(),
                line: 0,
                col: 0,
                field: String::new(),
                message: format!("cannot read the config file: {e}"),
                hint: None,
            }])
        })?;
        let text = String::from_utf8(bytes).map_err(|e| {
            // Where the first byte that is not UTF-8 is: the text before it is.
            let good = &e.as_bytes()[..e.utf8_error().valid_up_to()];
            let good = std::str::from_utf8(good).unwrap_or_default();
            let (line, col) = validate::line_col(good, good.len());
            ConfigErrors(vec![ConfigError {
                file: path.to_path_buf(),
                line,
                col,
                field: String::new(),
                message: "this byte is not UTF-8 text".into(),
                hint: Some("save the file as UTF-8 (TOML files are UTF-8)".into()),
            }])
        })?;
        Self::parse(path, &text)
    }

    /// Parses and validates config text; `path` is used in messages and to resolve
    /// relative paths (TLS files).
    pub fn parse(path: &Path, text: &str) -> Result<Config, ConfigErrors> {
        validate::parse_and_validate(path, text)
    }
}

/// One problem in a config file.
#[derive(Debug, Clone)]
pub struct ConfigError {
    pub file: PathBuf,
    /// 1-based; 0 when the problem has no place in the file.
    pub line: usize,
    pub col: usize,
    /// Dotted path of the field, e.g. `route[2].cluster`.
    pub field: String,
    pub message: String,
    /// What to write instead.
    pub hint: Option<String>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line > 0 {
            write!(f, "{}:{}:{}: ", self.file.display(), self.line, self.col)?;
        } else {
            write!(f, "{}: ", self.file.display())?;
        }
        if !self.field.is_empty() {
            write!(f, "{}: ", self.field)?;
        }
        write!(f, "{}", self.message)?;
        if let Some(hint) = &self.hint {
            write!(f, "\n  help: {hint}")?;
        }
        Ok(())
    }
}

/// Every problem found in a config file (validation does not stop at the first).
#[derive(Debug, Clone)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "error: {e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// Why no connect reaches one server at `ip`, if none does: an unspecified address is for
/// listening (a connect to it reaches this host), and a multicast or broadcast one is not
/// one server. An IPv4-mapped address is judged as its IPv4 one, as a dual-stack connect
/// takes it (`::ffff:0.0.0.0` reaches this host too). A config's endpoint is refused for
/// it, and a DNS answer's address is left out for it (`upstream::dns`).
pub fn unconnectable(ip: IpAddr) -> Option<&'static str> {
    let ip = ip.to_canonical();
    if ip.is_unspecified() {
        Some("an unspecified address (0.0.0.0, ::) is for listening, not connecting")
    } else if ip.is_multicast() || ip == IpAddr::from([255, 255, 255, 255]) {
        Some("a broadcast or multicast address is not one server")
    } else {
        None
    }
}
