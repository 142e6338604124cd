//! The access log: one `tracing` event per request (target `tailgate::access`) with the
//! stage timings; the log format (text or JSON) is the subscriber's.
//!
//! What the client chose that may be long (its path, an extension method) is logged cut
//! ([`PATH_BYTES`], [`METHOD_BYTES`]): a line waits in the log queue as a copy, and a queue
//! of lines each carrying a path of up to `max_header_bytes` (1 MiB at most) could take
//! gigabytes while stderr is slow to take them.

use super::{Exchange, Observer};

/// The target of the access log's events (the log's writer batches them on workers).
pub const TARGET: &str = "tailgate::access";

/// The most of a request's path an access log line carries; a longer one is cut there
/// and ends in `…`.
pub const PATH_BYTES: usize = 1024;
/// The same for its method (an extension method is a token of any length).
pub const METHOD_BYTES: usize = 32;

/// `s`, or its first `max` bytes (at most; on a character's boundary) and `…`.
fn cut(s: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if s.len() <= max {
        return s.into();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end]).into()
}

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
            target: TARGET,
            tracing::Level::INFO,
            request.id = ex.request_id.to_str().unwrap_or("-"),
            client.ip = %ex.client,
            tenant.name = tenant,
            route.name = ex
                .route
                .and_then(|r| self.route_names.get(r))
                .map_or("-", String::as_str),
            http.method = &*cut(ex.method.as_str(), METHOD_BYTES),
            http.path = &*cut(ex.uri.path(), PATH_BYTES),
            http.version = ?ex.version,
            http.status = ex.status,
            bytes.out = ex.bytes_out,
            upstream.reused = ex.reused_connection,
            error = ex.error.unwrap_or("-"),
            time.route_us = ex.timings.route.map_or(0, |d| d.as_micros() as u64),
            time.upstream_connect_us = ex.timings.upstream_connect.as_micros() as u64,
            time.ttfb_us = ex.timings.upstream_ttfb.as_micros() as u64,
            time.total_us = ex.timings.total.as_micros() as u64,
            "access"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_fields_are_cut_on_a_boundary() {
        assert_eq!(cut("/short", PATH_BYTES), "/short");
        let exact = "a".repeat(PATH_BYTES);
        assert_eq!(cut(&exact, PATH_BYTES), exact);
        let long = format!("/{}", "b".repeat(5000));
        let got = cut(&long, PATH_BYTES);
        assert_eq!(got.len(), PATH_BYTES + "…".len());
        assert!(got.starts_with("/bbb") && got.ends_with('…'));
        // A cut never splits a character.
        assert_eq!(cut("aé", 2), "a…");
    }
}
