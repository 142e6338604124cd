//! The access log: one `tracing` event per request (target `tailgate::access`) with the
//! stage timings; the log format (text or JSON) is the subscriber's.

use super::{Exchange, Observer};

/// Writes one access log line per exchange. Tenant and route are written by name.
pub struct AccessLog {
    pub tenant_names: Vec<String>,
    pub route_names: Vec<String>,
}

impl Observer for AccessLog {
    fn observe(&self, ex: &Exchange) {
        let tenant = ex
            .tenant
            .and_then(|t| self.tenant_names.get(t))
            .map_or("-", String::as_str);
        tracing::event!(
            target: "tailgate::access",
            tracing::Level::INFO,
            request.id = ex.request_id.to_str().unwrap_or("-"),
            client.ip = %ex.client,
            tenant.name = tenant,
            route.name = ex
                .route
                .and_then(|r| self.route_names.get(r))
                .map_or("-", String::as_str),
            http.method = %ex.method,
            http.path = ex.uri.path(),
            http.version = ?ex.version,
            http.status = ex.status,
            bytes.out = ex.bytes_out,
            upstream.reused = ex.reused_connection,
            error = ex.error.unwrap_or("-"),
            time.route_us = ex.timings.route.as_micros() as u64,
            time.upstream_connect_us = ex.timings.upstream_connect.as_micros() as u64,
            time.ttfb_us = ex.timings.upstream_ttfb.as_micros() as u64,
            time.total_us = ex.timings.total.as_micros() as u64,
            "access"
        );
    }
}
