//! The config file's shape, as serde reads it. Fields that validation must point at keep
//! their byte span (`Spanned`), so an error can say `file:line:col`.

use serde::Deserialize;
use toml::Spanned;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    #[serde(default)]
    pub server: RawServer,
    #[serde(default)]
    pub log: RawLog,
    #[serde(default)]
    pub dns: RawDns,
    #[serde(default)]
    pub demo: Vec<RawDemo>,
    #[serde(default)]
    pub listener: Vec<RawListener>,
    #[serde(default)]
    pub tenant: Vec<RawTenant>,
    #[serde(default)]
    pub cluster: Vec<RawCluster>,
    #[serde(default)]
    pub route: Vec<RawRoute>,
    pub admin: Option<RawAdmin>,
    #[serde(default)]
    pub metrics: RawMetrics,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAdmin {
    pub address: Spanned<String>,
    pub lag_probe_interval: Option<Spanned<String>>,
    pub stall_threshold: Option<Spanned<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMetrics {
    pub consumer_header: Option<Spanned<String>>,
    pub max_consumers: Option<Spanned<usize>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    pub workers: Option<Spanned<usize>>,
    pub shutdown_grace: Option<Spanned<String>>,
    pub shutdown_delay: Option<Spanned<String>>,
    pub header_read_timeout: Option<Spanned<String>>,
    pub idle_timeout: Option<Spanned<String>>,
    pub max_header_bytes: Option<Spanned<usize>>,
    pub max_body_bytes: Option<u64>,
    pub request_id_header: Option<Spanned<String>>,
    pub warm_wait: Option<Spanned<String>>,
    pub max_connections: Option<usize>,
    pub max_requests_per_connection: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLog {
    pub level: Option<Spanned<String>>,
    pub format: Option<Spanned<String>>,
    pub access_log: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDns {
    #[serde(default)]
    pub nameservers: Vec<Spanned<String>>,
    pub min_refresh: Option<Spanned<String>>,
    pub max_refresh: Option<Spanned<String>>,
    pub query_timeout: Option<Spanned<String>>,
    pub startup_timeout: Option<Spanned<String>>,
    pub family: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDemo {
    pub address: Spanned<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawListener {
    pub name: Option<Spanned<String>>,
    pub address: Spanned<String>,
    pub tenant: Option<Spanned<String>>,
    pub tls: Option<RawTls>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTls {
    pub cert: Spanned<String>,
    pub key: Spanned<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTenant {
    pub name: Spanned<String>,
    #[serde(default)]
    pub hosts: Vec<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCluster {
    pub name: Spanned<String>,
    pub endpoints: Spanned<Vec<Spanned<String>>>,
    pub connect_timeout: Option<Spanned<String>>,
    pub max_idle_per_endpoint: Option<usize>,
    pub max_connections_per_endpoint: Option<Spanned<usize>>,
    pub idle_timeout: Option<Spanned<String>>,
    pub max_requests_per_connection: Option<u32>,
    pub max_connection_lifetime: Option<Spanned<String>>,
    pub min_warm_connections: Option<Spanned<usize>>,
    pub balance: Option<Spanned<String>>,
    pub eject_after_failures: Option<u32>,
    pub eject_duration: Option<Spanned<String>>,
    pub retry_budget_percent: Option<Spanned<u32>>,
    pub hedge_budget_percent: Option<Spanned<u32>>,
    pub max_requests: Option<usize>,
    pub protocol: Option<Spanned<String>>,
    pub http2_keepalive_interval: Option<Spanned<String>>,
    pub tls_server_name: Option<Spanned<String>>,
    pub tls_ca: Option<Spanned<String>>,
    pub tls_client_cert: Option<Spanned<String>>,
    pub tls_client_key: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRoute {
    pub name: Option<Spanned<String>>,
    pub tenant: Option<Spanned<String>>,
    pub host: Option<Spanned<String>>,
    pub path_prefix: Spanned<String>,
    pub methods: Option<Spanned<Vec<Spanned<String>>>>,
    pub cluster: Spanned<String>,
    pub response_timeout: Option<Spanned<String>>,
    pub total_timeout: Option<Spanned<String>>,
    pub idempotent: Option<bool>,
    pub hedge_delay: Option<Spanned<String>>,
    pub rewrite_prefix: Option<Spanned<String>>,
    pub host_rewrite: Option<Spanned<String>>,
}
