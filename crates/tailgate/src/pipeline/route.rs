//! Step 2 of the pipeline: host + path + method → route. The table is compiled once per
//! config version; a lookup does no allocation when the Host is already lower case.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crate::config::{self, Config};

/// A route, resolved: what the pipeline needs after matching.
#[derive(Debug)]
pub struct RouteEntry {
    /// Position in the config's `[[route]]` list (a stable label for logs and metrics).
    pub id: usize,
    pub tenant: Option<usize>,
    pub path_prefix: String,
    pub methods: Vec<http::Method>,
    pub cluster: usize,
    pub response_timeout: Duration,
    pub total_timeout: Option<Duration>,
    /// Requests of every method may be sent twice (see [`config::Route::idempotent`]).
    pub idempotent: bool,
    pub hedge_delay: Option<config::HedgeDelay>,
}

/// Routes that share a scope, longest path prefix first.
#[derive(Debug, Default)]
struct RouteList(Vec<Arc<RouteEntry>>);

pub enum Match<'a> {
    Found(&'a Arc<RouteEntry>),
    /// A route matched the path but not the method; these methods would have.
    WrongMethod(Vec<http::Method>),
    NotFound,
}

impl RouteList {
    fn push(&mut self, r: Arc<RouteEntry>) {
        self.0.push(r);
        self.0
            .sort_by_key(|r| std::cmp::Reverse(r.path_prefix.len()));
    }

    fn find<'a>(
        &'a self,
        path: &str,
        method: &http::Method,
        allowed: &mut Vec<http::Method>,
    ) -> Option<&'a Arc<RouteEntry>> {
        for r in &self.0 {
            if path.starts_with(r.path_prefix.as_str()) {
                if r.methods.is_empty() || r.methods.contains(method) {
                    return Some(r);
                }
                allowed.extend(r.methods.iter().cloned());
            }
        }
        None
    }
}

/// The compiled routing table of one config version.
#[derive(Debug, Default)]
pub struct RouteTable {
    /// Routes with an explicit host.
    by_host: HashMap<String, RouteList>,
    /// Exact tenant host → tenant.
    tenant_hosts: HashMap<String, usize>,
    /// `*.suffix` tenant hosts, as (suffix pattern, tenant), longest first: the most
    /// specific pattern that matches wins, as in nginx's `server_name`.
    tenant_wildcards: Vec<(String, usize)>,
    /// Per tenant: its routes without a host.
    tenant_routes: Vec<RouteList>,
    /// Routes with neither tenant nor host.
    global: RouteList,
}

impl RouteTable {
    pub fn new(config: &Config) -> RouteTable {
        let mut t = RouteTable {
            tenant_routes: config
                .tenants
                .iter()
                .map(|_| RouteList::default())
                .collect(),
            ..Default::default()
        };
        for (i, tenant) in config.tenants.iter().enumerate() {
            for h in &tenant.hosts {
                if h.starts_with("*.") {
                    t.tenant_wildcards.push((h.clone(), i));
                } else {
                    t.tenant_hosts.insert(h.clone(), i);
                }
            }
        }
        // Stable: equally long patterns keep the config's order.
        t.tenant_wildcards
            .sort_by_key(|(p, _)| std::cmp::Reverse(p.len()));
        for (id, r) in config.routes.iter().enumerate() {
            let entry = Arc::new(RouteEntry {
                id,
                tenant: r.tenant,
                path_prefix: r.path_prefix.clone(),
                methods: r.methods.clone(),
                cluster: r.cluster,
                response_timeout: r.response_timeout,
                total_timeout: r.total_timeout,
                idempotent: r.idempotent,
                hedge_delay: r.hedge_delay,
            });
            match (&r.host, r.tenant) {
                (Some(h), _) => t.by_host.entry(h.clone()).or_default().push(entry),
                (None, Some(tenant)) => t.tenant_routes[tenant].push(entry),
                (None, None) => t.global.push(entry),
            }
        }
        t
    }

    /// The tenant a host name belongs to (`host` lower case, without port).
    pub fn tenant_of_host(&self, host: &str) -> Option<usize> {
        if let Some(&t) = self.tenant_hosts.get(host) {
            return Some(t);
        }
        self.tenant_wildcards
            .iter()
            .find(|(p, _)| config::host_matches(p, host))
            .map(|&(_, t)| t)
    }

    /// Finds the route for a request. `conn_tenant` is the tenant the connection was
    /// classified to (listener or SNI), used when the Host names no tenant.
    pub fn lookup(
        &self,
        host: &str,
        path: &str,
        method: &http::Method,
        conn_tenant: Option<usize>,
    ) -> Match<'_> {
        let mut allowed = Vec::new();
        if let Some(list) = self.by_host.get(host)
            && let Some(r) = list.find(path, method, &mut allowed)
        {
            return Match::Found(r);
        }
        if let Some(t) = self.tenant_of_host(host).or(conn_tenant)
            && let Some(r) = self
                .tenant_routes
                .get(t)
                .and_then(|l| l.find(path, method, &mut allowed))
        {
            return Match::Found(r);
        }
        if let Some(r) = self.global.find(path, method, &mut allowed) {
            return Match::Found(r);
        }
        if allowed.is_empty() {
            Match::NotFound
        } else {
            Match::WrongMethod(allowed)
        }
    }
}

/// The host of a request, lower case and without port: from the URI authority (HTTP/2,
/// absolute-form) or the Host header.
///
/// [`SeveralHosts`] for more than one Host header: which one names the request would be
/// ambiguous (RFC 9112 §3.2 asks for a 400).
pub fn request_host(parts: &http::request::Parts) -> Result<Option<&str>, SeveralHosts> {
    let mut hosts = parts.headers.get_all(http::header::HOST).iter();
    let first = hosts.next();
    if hosts.next().is_some() {
        return Err(SeveralHosts);
    }
    let raw = match parts.uri.authority() {
        Some(a) => Some(a.host()),
        None => first.and_then(|h| h.to_str().ok()),
    };
    // `api.example.com.` is the same name as `api.example.com` (nginx matches it so too).
    Ok(raw.map(|h| {
        let h = strip_port(h);
        h.strip_suffix('.').unwrap_or(h)
    }))
}

/// A request with more than one Host header.
#[derive(Debug)]
pub struct SeveralHosts;

fn strip_port(h: &str) -> &str {
    if h.starts_with('[') {
        // IPv6 literal: keep the brackets, drop the port.
        return h.find(']').map_or(h, |i| &h[..=i]);
    }
    match h.rfind(':') {
        Some(i) => &h[..i],
        None => h,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn table(toml: &str) -> RouteTable {
        let cfg = Config::parse(Path::new("t.toml"), toml).expect("valid config");
        RouteTable::new(&cfg)
    }

    /// The host a request names: from the target's authority, else its one Host header,
    /// without port or trailing dot (`acme.test.` is `acme.test`, as nginx matches it).
    #[test]
    fn the_request_host_has_no_port_and_no_trailing_dot() {
        let host = |target: &str, header: Option<&str>| {
            let mut b = http::Request::builder().uri(target);
            if let Some(h) = header {
                b = b.header(http::header::HOST, h);
            }
            let (parts, ()) = b.body(()).expect("request").into_parts();
            request_host(&parts).ok().flatten().map(str::to_owned)
        };
        assert_eq!(host("/", Some("acme.test.")).as_deref(), Some("acme.test"));
        assert_eq!(
            host("/", Some("acme.test.:8080")).as_deref(),
            Some("acme.test")
        );
        assert_eq!(
            host("/", Some("acme.test:8080")).as_deref(),
            Some("acme.test")
        );
        assert_eq!(host("/", Some("[::1]:8080")).as_deref(), Some("[::1]"));
        assert_eq!(host("http://a.test./x", None).as_deref(), Some("a.test"));
        assert_eq!(host("/", None), None);
    }

    const CFG: &str = r#"
[[listener]]
address = "127.0.0.1:0"
[[tenant]]
name = "acme"
hosts = ["acme.test", "*.acme.test"]
[[cluster]]
name = "a"
endpoints = ["127.0.0.1:1"]
[[cluster]]
name = "b"
endpoints = ["127.0.0.1:2"]
[[route]]
tenant = "acme"
path_prefix = "/"
cluster = "a"
[[route]]
tenant = "acme"
path_prefix = "/api/"
methods = ["GET"]
cluster = "b"
[[route]]
path_prefix = "/public/"
cluster = "b"
"#;

    #[test]
    fn longest_prefix_and_method_win() {
        let t = table(CFG);
        let Match::Found(r) = t.lookup("acme.test", "/api/x", &http::Method::GET, None) else {
            panic!("no match")
        };
        assert_eq!(r.cluster, 1);
        let Match::Found(r) = t.lookup("x.acme.test", "/api/x", &http::Method::POST, None) else {
            panic!("no match")
        };
        assert_eq!(r.cluster, 0, "POST falls through to the tenant's / route");
        let Match::Found(r) = t.lookup("other.test", "/public/a", &http::Method::GET, None) else {
            panic!("no match")
        };
        assert_eq!(r.cluster, 1);
        assert!(matches!(
            t.lookup("other.test", "/", &http::Method::GET, None),
            Match::NotFound
        ));
        assert!(matches!(
            t.lookup("other.test", "/", &http::Method::GET, Some(0)),
            Match::Found(_)
        ));
    }

    /// `*.eu.acme.test` belongs to its own tenant although `*.acme.test` comes first.
    #[test]
    fn the_most_specific_wildcard_names_the_tenant() {
        let t = table(
            r#"
[[listener]]
address = "127.0.0.1:0"
[[tenant]]
name = "acme"
hosts = ["*.acme.test"]
[[tenant]]
name = "acme-eu"
hosts = ["*.eu.acme.test"]
[[cluster]]
name = "a"
endpoints = ["127.0.0.1:1"]
"#,
        );
        assert_eq!(t.tenant_of_host("x.eu.acme.test"), Some(1));
        assert_eq!(t.tenant_of_host("x.acme.test"), Some(0));
        assert_eq!(t.tenant_of_host("eu.acme.test"), Some(0));
    }

    #[test]
    fn strips_ports() {
        assert_eq!(strip_port("a.test:8080"), "a.test");
        assert_eq!(strip_port("[::1]:80"), "[::1]");
        assert_eq!(strip_port("a.test"), "a.test");
    }
}
