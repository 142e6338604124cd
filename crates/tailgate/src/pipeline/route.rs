//! Step 2 of the pipeline: host + path + method → route. The table is compiled once per
//! config version; a lookup does no allocation when the Host is already lower case and the
//! path already in normal form (no `%`, `//`, `/.`: nearly every API request).
//!
//! Routes match the path in normal form ([`normal_path`]), as nginx matches its locations:
//! `/public/../internal/keys` must not reach the route of `/public/`. The request goes
//! upstream with its target as the client sent it, unless its route has a
//! `rewrite_prefix`, and with the client's Host, unless it has a `host_rewrite`
//! ([`Rewrite`]).

use std::borrow::Cow;
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
    /// A `rewrite_prefix` or `host_rewrite` (boxed: most routes have neither, and this
    /// entry is read on every request).
    pub rewrite: Option<Box<Rewrite>>,
}

/// A route's `rewrite_prefix` and `host_rewrite`, as a request is rewritten by them
/// ([`Rewrite::apply`]).
#[derive(Debug, Default)]
pub struct Rewrite {
    /// Sent upstream in place of the route's `path_prefix` (see [`rewrite_target`]).
    pub to: Option<String>,
    /// The `X-Forwarded-Prefix` sent with `to`: the `path_prefix` without its trailing `/`
    /// (none for `/`).
    pub forwarded_prefix: Option<http::HeaderValue>,
    /// The Host sent upstream in place of the client's (HTTP/2's `:authority`).
    pub host: Option<http::HeaderValue>,
}

impl Rewrite {
    /// Rewrites the target of a request `prefix` matched ([`rewrite_target`]), and sets
    /// `X-Forwarded-Prefix` in place of any the client sent (removing the client's when
    /// there is none to send), as Traefik's and Kong's prefix stripping do; sets the Host.
    /// In the header map, as only these routes pay for it; after `X-Forwarded-Host` took
    /// the client's Host. `None`: the target cannot be rewritten.
    pub fn apply(&self, parts: &mut http::request::Parts, prefix: &str) -> Option<()> {
        if let Some(to) = &self.to {
            parts.uri = rewrite_target(&parts.uri, prefix, to)?;
            let name = &super::headers::X_FORWARDED_PREFIX;
            super::spare::shrinking(&mut parts.headers, |h| {
                match &self.forwarded_prefix {
                    Some(p) => {
                        h.insert(name, p.clone());
                    }
                    None => {
                        h.remove(name);
                    }
                }
                // The client's spelled with `_` too, which CGI-style upstreams read as
                // the same variable.
                super::headers::remove_underscore_spellings(h, name);
            });
        }
        if let Some(h) = &self.host {
            parts.headers.insert(http::header::HOST, h.clone());
        }
        Some(())
    }
}

/// What a route without `methods` allows, for the `Allow` of a TRACE or CONNECT it
/// refuses.
const DEFAULT_METHODS: [http::Method; 7] = [
    http::Method::GET,
    http::Method::HEAD,
    http::Method::POST,
    http::Method::PUT,
    http::Method::DELETE,
    http::Method::PATCH,
    http::Method::OPTIONS,
];

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
                // A route without `methods` takes every method but TRACE, which would echo
                // the request's credentials and the gateway's headers back (nginx answers
                // it `405` too), and CONNECT, a tunnel request no route serves (`check`
                // refuses it in `methods`; nginx answers it `405`); a route that lists TRACE
                // takes it.
                if r.methods.is_empty()
                    && *method != http::Method::TRACE
                    && *method != http::Method::CONNECT
                    || r.methods.contains(method)
                {
                    return Some(r);
                }
                let methods = if r.methods.is_empty() {
                    &DEFAULT_METHODS[..]
                } else {
                    &r.methods[..]
                };
                for m in methods {
                    if !allowed.contains(m) {
                        allowed.push(m.clone());
                    }
                }
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
    /// `*.suffix` tenant hosts, by their suffix (`suffix`, without `*.`): a host looks up
    /// its suffixes of the patterns' lengths, longest first, so the most specific pattern
    /// that matches wins, as in nginx's `server_name`, in one look-up per length a pattern
    /// has, however many tenants there are (a scan of the patterns cost one comparison per
    /// tenant, for every Host no exact name matched, which a client picks freely; a look-up
    /// per dot of the host cost time in the square of its length, a client's to choose).
    tenant_wildcards: HashMap<String, usize>,
    /// The lengths of the `tenant_wildcards` suffixes, longest first, each once.
    wildcard_lens: Vec<usize>,
    /// Per tenant: its routes without a host.
    tenant_routes: Vec<RouteList>,
    /// Routes with neither tenant nor host.
    global: RouteList,
}

/// What tells a route's place apart, beside its prefix and methods: its host when it has
/// one (a route with a host is found by the host alone, whatever its tenant), else its
/// tenant (or none). `check` finds duplicates by it too.
pub fn scope(tenant: Option<usize>, host: Option<&str>) -> (Option<usize>, Option<&str>) {
    match host {
        Some(h) => (None, Some(h)),
        None => (tenant, None),
    }
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
                match h.strip_prefix("*.") {
                    // The first tenant to name a pattern keeps it.
                    Some(suffix) => {
                        t.tenant_wildcards.entry(suffix.to_owned()).or_insert(i);
                    }
                    None => {
                        t.tenant_hosts.insert(h.clone(), i);
                    }
                }
            }
        }
        let mut lens: Vec<usize> = t.tenant_wildcards.keys().map(String::len).collect();
        lens.sort_unstable_by(|a, b| b.cmp(a));
        lens.dedup();
        t.wildcard_lens = lens;
        // The scopes and prefixes with a route that names HEAD.
        let named_head: std::collections::HashSet<(Option<usize>, Option<&str>, &str)> = config
            .routes
            .iter()
            .filter(|r| r.methods.contains(&http::Method::HEAD))
            .map(|r| {
                let (tenant, host) = scope(r.tenant, r.host.as_deref());
                (tenant, host, &*r.path_prefix)
            })
            .collect();
        for (id, r) in config.routes.iter().enumerate() {
            // A route for GET answers HEAD too (RFC 9110 §9.3.2; nginx's `limit_except GET`
            // allows HEAD): health and link checkers send HEAD. Unless another route of the
            // same scope and prefix takes HEAD by name: that one is meant for it.
            let mut methods = r.methods.clone();
            let (tenant, host) = scope(r.tenant, r.host.as_deref());
            let head_elsewhere = named_head.contains(&(tenant, host, &*r.path_prefix));
            if methods.contains(&http::Method::GET) && !head_elsewhere {
                methods.push(http::Method::HEAD);
            }
            let entry = Arc::new(RouteEntry {
                id,
                tenant: r.tenant,
                path_prefix: r.path_prefix.clone(),
                methods,
                cluster: r.cluster,
                response_timeout: r.response_timeout,
                total_timeout: r.total_timeout,
                idempotent: r.idempotent,
                hedge_delay: r.hedge_delay,
                rewrite: (r.rewrite_prefix.is_some() || r.host_rewrite.is_some()).then(|| {
                    let p = r.path_prefix.strip_suffix('/').unwrap_or(&r.path_prefix);
                    Box::new(Rewrite {
                        to: r.rewrite_prefix.clone(),
                        forwarded_prefix: (r.rewrite_prefix.is_some() && !p.is_empty())
                            .then(|| http::HeaderValue::from_str(p).ok())
                            .flatten(),
                        // (`check` let only a valid Host value through.)
                        host: r
                            .host_rewrite
                            .as_ref()
                            .and_then(|h| http::HeaderValue::from_str(h).ok()),
                    })
                }),
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
        // `a.b.c` looks up `b.c`, then `c` (of the lengths patterns have): the label a `*.`
        // stands for is never empty.
        let b = host.as_bytes();
        self.wildcard_lens.iter().find_map(|&len| {
            let dot = b.len().checked_sub(len + 1).filter(|&at| at > 0)?;
            // (The dot is ASCII: the slices on either side start at character boundaries.)
            (b[dot] == b'.')
                .then(|| self.tenant_wildcards.get(&host[dot + 1..]).copied())
                .flatten()
        })
    }

    /// The tenant a TLS server name (SNI) belongs to: matched as a Host is, without case
    /// and without a trailing dot (rustls takes `api.example.com.` as sent).
    pub fn tenant_of_server_name(&self, name: &str) -> Option<usize> {
        let name = name.strip_suffix('.').unwrap_or(name);
        self.tenant_of_host(&name.to_ascii_lowercase())
    }

    /// [`Self::lookup_with`], finding the Host's tenant itself (the pipeline finds it once
    /// for more than the lookup).
    #[cfg(test)]
    pub fn lookup(
        &self,
        host: &str,
        path: &str,
        method: &http::Method,
        conn_tenant: Option<usize>,
    ) -> Match<'_> {
        self.lookup_with(host, self.tenant_of_host(host), path, method, conn_tenant)
    }

    /// Finds the route for a request whose Host `host` belongs to `host_tenant` (found by the
    /// caller, [`Self::tenant_of_host`]). `conn_tenant` is the tenant the connection was
    /// classified to (listener or SNI), used when the Host names no tenant.
    pub fn lookup_with(
        &self,
        host: &str,
        host_tenant: Option<usize>,
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
        if let Some(t) = host_tenant.or(conn_tenant)
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

/// The host of a request, without port or trailing dot, and whether it has upper-case
/// letters (the caller lowers it then): from the URI authority (HTTP/2, absolute-form) or
/// the Host header. `None` when the request names no host (or is HTTP/1.1 without a Host
/// header, absolute-form or not).
///
/// A Host header must be `host [":" port]` (RFC 9110 §7.2), with a host (§4.2.1: an `http`
/// URI's authority has one, so a Host that is empty or only a port names nothing; nginx
/// refuses it too): it is what routes the request and it is passed upstream as sent, so a
/// value the two sides could read differently (`acme.test:@evil.example`, `a.test/x`,
/// `a..test`) is refused; so is one beside an authority that routes the request in its
/// place, as nginx checks it whatever the target.
/// More than one Host header is refused too: which one names the request would be
/// ambiguous (RFC 9112 §3.2 asks for a 400).
pub fn request_host(parts: &http::request::Parts) -> Result<Option<(&str, bool)>, BadHost> {
    let mut hosts = parts.headers.get_all(http::header::HOST).iter();
    let first = hosts.next();
    if hosts.next().is_some() {
        return Err(BadHost::Several);
    }
    let (host, upper) = match (parts.uri.authority(), first) {
        // An HTTP/1.1 request in absolute-form needs a Host all the same (RFC 9112 §3.2: a
        // 400 without one), whose value its authority then stands in for.
        (Some(_), None) if parts.version == http::Version::HTTP_11 => return Ok(None),
        // The authority routes the request and goes upstream as its Host: held to a Host
        // header's shape, with a host (RFC 9110 §4.2.1) and no `user@` (§4.2.4).
        (Some(a), h) => {
            if h.is_some_and(|h| host_header(h.as_bytes()).is_none()) {
                return Err(BadHost::Invalid);
            }
            let a = a.as_str();
            if a.contains('@') {
                return Err(BadHost::InvalidTarget);
            }
            match host_part(a.as_bytes()) {
                Some((end, upper)) if end > 0 => (&a[..end], upper),
                _ => return Err(BadHost::InvalidTarget),
            }
        }
        (None, Some(h)) => {
            let h = h.as_bytes();
            let (end, upper) = host_header(h).ok_or(BadHost::Invalid)?;
            // Only ASCII passed `host_part`.
            let h = std::str::from_utf8(&h[..end]).map_err(|_| BadHost::Invalid)?;
            (h, upper)
        }
        (None, None) => return Ok(None),
    };
    // `api.example.com.` is the same name as `api.example.com` (nginx matches it so too).
    Ok(Some((host.strip_suffix('.').unwrap_or(host), upper)))
}

/// A Host header's [`host_part`], which must name a host: not empty, nor a port alone.
fn host_header(h: &[u8]) -> Option<(usize, bool)> {
    host_part(h).filter(|&(end, _)| end > 0)
}

/// Why a request's Host cannot route it.
#[derive(Debug, PartialEq, Eq)]
pub enum BadHost {
    /// More than one Host header.
    Several,
    /// A Host header that is not `host [":" port]`.
    Invalid,
    /// An absolute-form target (or HTTP/2 `:authority`) whose authority is not
    /// `host [":" port]` with a host, or has a `user@`.
    InvalidTarget,
}

/// Checks that `h` is a Host header's `uri-host [":" port]` (RFC 3986 §3.2.2–3): a reg-name
/// of unreserved, percent-encoded and sub-delim bytes without an empty label (`a..b`,
/// `.a`), or a bracketed IP literal; a port of digits. Empty is valid (a target without
/// authority). Returns where the host ends (the port, if any, starts there) and whether it
/// has upper-case letters; `None` when it is not valid.
///
/// One pass with a table look-up a byte: it runs on every request.
fn host_part(h: &[u8]) -> Option<(usize, bool)> {
    let (end, upper) = if h.first() == Some(&b'[') {
        let end = h.iter().position(|&b| b == b']')? + 1;
        let literal = &h[1..end - 1];
        // IPv6 (with a zone id, `%25eth0`) or IPvFuture: unreserved, sub-delims, `:`, `%`.
        if literal.is_empty()
            || !literal.iter().all(|&b| {
                b == b':'
                    || b == b'.'
                    || matches!(
                        HOST_BYTES[usize::from(b)],
                        HostByte::Plain | HostByte::Upper
                    )
            })
        {
            return None;
        }
        (end, literal.iter().any(u8::is_ascii_uppercase))
    } else {
        let mut upper = false;
        // Starts as if after a dot, so that a leading dot reads as an empty label.
        let mut after_dot = true;
        let mut end = h.len();
        for (i, &b) in h.iter().enumerate() {
            match HOST_BYTES[usize::from(b)] {
                HostByte::Plain => after_dot = false,
                HostByte::Upper => {
                    upper = true;
                    after_dot = false;
                }
                HostByte::Dot if !after_dot => after_dot = true,
                HostByte::Colon => {
                    end = i;
                    break;
                }
                HostByte::Dot | HostByte::Invalid => return None,
            }
        }
        (end, upper)
    };
    match h[end..].split_first() {
        None => {}
        Some((b':', digits)) if digits.len() <= 5 && digits.iter().all(u8::is_ascii_digit) => {}
        Some(_) => return None,
    }
    Some((end, upper))
}

/// Is `h` a Host header's `host [":" port]` with a host (as `host_part` reads it), a port that
/// fits 16 bits, and an authority HTTP/2's `:authority` can carry (no `%` outside
/// brackets)? For `check`.
pub fn is_host_value(h: &str) -> bool {
    // (`host_part` left only `""` or `:` and digits after the host.)
    let port_fits = |p: &str| p.is_empty() || p[1..].parse::<u16>().is_ok();
    matches!(host_part(h.as_bytes()), Some((end, _)) if end > 0 && port_fits(&h[end..]))
        && http::uri::Authority::try_from(h).is_ok()
}

/// What a byte is in a Host header's reg-name.
#[derive(Clone, Copy)]
enum HostByte {
    Invalid,
    /// Lower-case letters, digits, `-`, `_`, `~`, `%` and sub-delims (RFC 3986 §3.2.2).
    Plain,
    Upper,
    Dot,
    /// Where the port starts.
    Colon,
}

const HOST_BYTES: [HostByte; 256] = {
    let mut t = [HostByte::Invalid; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        t[b] = if c.is_ascii_uppercase() {
            HostByte::Upper
        } else if c == b'.' {
            HostByte::Dot
        } else if c == b':' {
            HostByte::Colon
        } else if c.is_ascii_alphanumeric()
            || matches!(
                c,
                b'-' | b'_'
                    | b'~'
                    | b'%'
                    | b'!'
                    | b'$'
                    | b'&'
                    | b'\''
                    | b'('
                    | b')'
                    | b'*'
                    | b'+'
                    | b','
                    | b';'
                    | b'='
            )
        {
            HostByte::Plain
        } else {
            HostByte::Invalid
        };
        b += 1;
    }
    t
};

/// The path as routes match it, read so that no server behind can read it otherwise:
/// each segment's `;` parameters dropped first, from the raw bytes, up to the next `/`
/// (`/admin;jsessionid=1/x` is `/admin/x`, as Tomcat and Jetty read it; nginx keeps them,
/// but a prefix without `;` matches alike); then percent-encoded bytes that may stand raw
/// in a path, but `;` and `%`, decoded (`%2e` is `.`, `%41` is `A`, `%3A` is `:`, as nginx
/// decodes them), an encoded slash or backslash (`%2F`, `%5C`) and a
/// backslash read as `/`, other escapes kept (their hex in upper case), and bytes above
/// 0x7F (raw UTF-8) written as escapes, as most clients send them; `.` and `..`
/// segments resolved (RFC 3986 §5.2.4), and repeated slashes merged. Whatever an upstream
/// may take for a dot segment or a parameter is resolved here, so that no request reaches a
/// route whose prefix its path leaves upstream, nor passes by the route its path takes
/// there.
///
/// Borrowed, with no allocation, when the path has no `%`, `\`, `;`, `//` or `/.` in it
/// (nearly every request); borrowed too when its normal form is the same, after the
/// allocations of working that out.
///
/// [`BadPath::AboveRoot`] for a `..` that would climb above `/` (nginx answers it `400`),
/// [`BadPath::DotsAfterEmpty`] for a `..` that takes off an empty segment (`/a//../b`,
/// `/a//x/../../b`), which servers resolve differently (`/b` once slashes are merged, `/a/b`
/// by RFC 3986 and in Jetty, which refuses it since version 10),
/// [`BadPath::DotsWithParams`] for a `.` or `..` segment with `;` parameters (`..;x` is
/// `..` to Tomcat, a segment of its own to nginx), [`BadPath::SlashInParams`] for a
/// parameter with an encoded slash or a backslash in it (`/public;%2F..%2Finternal/x` is
/// `/public/x` to Tomcat, `/internal/x` to nginx), [`BadPath::Nul`] for a `%00`. A target
/// that is not a path (`*` of
/// `OPTIONS *`) is returned as it is.
pub fn normal_path(path: &str) -> Result<Cow<'_, str>, BadPath> {
    path_as_read(path, Reading::NORMAL)
}

/// How a server behind may read a path: whether it resolves dot segments, and which of a
/// backslash, `%2F` and `%5C` it takes for a `/`. Otherwise a reading is [`normal_path`]'s
/// (`;` parameters dropped, escapes decoded, slashes merged).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reading {
    pub dots: bool,
    pub backslash: bool,
    pub encoded_slash: bool,
    pub encoded_backslash: bool,
}

impl Reading {
    /// Routes match this one: [`normal_path`].
    pub const NORMAL: Reading = Reading {
        dots: true,
        backslash: true,
        encoded_slash: true,
        encoded_backslash: true,
    };

    /// Every other, as servers behind read paths: Express and Go's mux resolve no dot
    /// and keep `%2F`; the WHATWG URL parser resolves dots, takes a backslash for a `/` and
    /// keeps `%2F`; nginx decodes `%2F` before it resolves dots and keeps a backslash;
    /// uvicorn's `PATH_INFO` decodes `%2F` and resolves no dot. Where one of them takes
    /// another route than the normal form, which route the request is for depends on the
    /// server reading it: the pipeline refuses it.
    pub fn others() -> impl Iterator<Item = Reading> {
        (0..16u8)
            .map(|bits| Reading {
                dots: bits & 1 != 0,
                backslash: bits & 2 != 0,
                encoded_slash: bits & 4 != 0,
                encoded_backslash: bits & 8 != 0,
            })
            .filter(|r| *r != Reading::NORMAL)
    }

    /// The others that can read `path` otherwise than the normal form: only those that
    /// differ in what it holds (a dot segment, a backslash, `%2F`, `%5C`). None for most
    /// paths whose normal form differs for other reasons (escapes, raw UTF-8, `;`
    /// parameters, `//`): no reading is made for them.
    pub fn others_for(path: &str) -> impl Iterator<Item = Reading> {
        let b = path.as_bytes();
        let escape = |lo: &[u8]| {
            b.windows(3)
                .any(|w| w[0] == b'%' && w[1] == lo[0] && w[2].eq_ignore_ascii_case(&lo[1]))
        };
        // (Any `..`, a `.` after a separator, or an escaped dot: a dot segment perhaps.)
        let dots = b
            .windows(2)
            .any(|w| w == b".." || (w[0] == b'/' || w[0] == b'\\') && w[1] == b'.')
            || escape(b"2e")
            || escape(b"2F") && b.contains(&b'.')
            || escape(b"5C") && b.contains(&b'.');
        let (backslash, encoded_slash, encoded_backslash) =
            (b.contains(&b'\\'), escape(b"2F"), escape(b"5C"));
        Reading::others().filter(move |r| {
            (dots || r.dots)
                && (backslash || r.backslash)
                && (encoded_slash || r.encoded_slash)
                && (encoded_backslash || r.encoded_backslash)
        })
    }
}

/// The path as read by `reading` (see [`Reading`]): [`normal_path`] for
/// [`Reading::NORMAL`].
pub fn path_as_read(path: &str, reading: Reading) -> Result<Cow<'_, str>, BadPath> {
    let b = path.as_bytes();
    if b.first() != Some(&b'/') {
        return Ok(Cow::Borrowed(path));
    }
    // One pass (this runs on every request): only `%`, `\`, `;`, a byte above 0x7F, and a
    // `/` before `/` or `.`, can make the normal form differ.
    let mut after_slash = false;
    let plain = b.iter().all(|&c| {
        let odd = c == b'%'
            || c == b'\\'
            || c == b';'
            || c > 0x7f
            || after_slash && (c == b'/' || c == b'.');
        after_slash = c == b'/';
        !odd
    });
    if plain {
        return Ok(Cow::Borrowed(path));
    }
    let mut decoded = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        // A parameter runs to the next `/` as sent: an encoded or backslash one inside it is
        // part of the parameter, as an application server that drops it reads it.
        if c == b';' {
            // `..;x` is `..` to Tomcat and Jetty and a segment of its own to nginx, Go or
            // Node: no one reading can be taken for the upstream's.
            let seg = decoded.rsplit(|&c| c == b'/').next().unwrap_or_default();
            if seg == b"." || seg == b".." {
                return Err(BadPath::DotsWithParams);
            }
            let param = &b[i..];
            let param = &param[..param.iter().position(|&c| c == b'/').unwrap_or(param.len())];
            // A slash inside a parameter (`/public;%2F..%2Finternal/x`) is part of it to
            // Tomcat and Jetty, and a slash to nginx, Envoy or Node, which decode it before
            // the `..`: `/public/x` to one, `/internal/x` to the other.
            if param.contains(&b'\\')
                || param
                    .windows(3)
                    .any(|w| w[0] == b'%' && matches!(&w[1..], b"2F" | b"2f" | b"5C" | b"5c"))
            {
                return Err(BadPath::SlashInParams);
            }
            if param.windows(3).any(|w| w == b"%00") {
                return Err(BadPath::Nul);
            }
            i += param.len();
            continue;
        }
        if c == b'%'
            && let (Some(hi), Some(lo)) = (
                b.get(i + 1).and_then(|&c| hex_value(c)),
                b.get(i + 2).and_then(|&c| hex_value(c)),
            )
        {
            let v = hi << 4 | lo;
            // A NUL ends a path where a server behind reads it as a C string (nginx refuses
            // it with 400 too).
            if v == 0 {
                return Err(BadPath::Nul);
            }
            // Every byte that may stand raw in a path (as `http` takes it), as nginx, Tomcat,
            // Go or Node decode it: `%41` is `A`, `%3A` is `:`, `%7C` is `|`. Not `;` or
            // `%`, which would change the path's structure (nor `?`, `#`, a space or a
            // control byte, which cannot stand raw).
            if v != b'%' && v != b'/' && v != b'\\' && raw_in_path(v) {
                decoded.push(v);
            } else if v == b'/' && reading.encoded_slash || v == b'\\' && reading.encoded_backslash
            {
                decoded.push(b'/');
            } else {
                decoded.extend_from_slice(&[b'%', HEX[usize::from(hi)], HEX[usize::from(lo)]]);
            }
            i += 3;
            continue;
        }
        // A `%` that starts no escape: kept, what follows could be decoded into one
        // (`/%%36%31dmin` would be `/%61dmin`, `/admin` to a server that decodes twice);
        // nginx and Go refuse it too.
        if c == b'%' {
            return Err(BadPath::BadEscape);
        }
        if c > 0x7f {
            // Raw UTF-8 is matched as its escapes, as most clients send it: `/é/` and
            // `/%C3%A9/` are one path, and take one route.
            decoded.extend_from_slice(&[b'%', HEX[usize::from(c >> 4)], HEX[usize::from(c & 15)]]);
        } else {
            decoded.push(if c == b'\\' && reading.backslash {
                b'/'
            } else {
                c
            });
        }
        i += 1;
    }
    // Segments are copied into `out`, empty ones left out (merged slashes); `levels` has
    // one entry per segment RFC 3986 keeps, empty ones included (`true`). A `..` takes the
    // last level off and cuts `out` back to the `/` before its last segment; a `..` that
    // would take off an empty level is refused, since merged first it takes off the
    // segment before (`/a//x/../../b`: `/b` once slashes are merged, `/a/b` by RFC 3986).
    let mut out = Vec::with_capacity(decoded.len());
    let mut levels: Vec<bool> = Vec::new();
    let mut trailing_slash = false;
    for seg in decoded[1..].split(|&c| c == b'/') {
        trailing_slash = false;
        match seg {
            b"" => {
                trailing_slash = true;
                levels.push(true);
            }
            b"." if reading.dots => trailing_slash = true,
            b".." if reading.dots => match levels.pop() {
                None => return Err(BadPath::AboveRoot),
                Some(true) => return Err(BadPath::DotsAfterEmpty),
                Some(false) => {
                    let last = out.iter().rposition(|&c| c == b'/').unwrap_or(0);
                    out.truncate(last);
                    trailing_slash = true;
                }
            },
            _ => {
                levels.push(false);
                out.push(b'/');
                out.extend_from_slice(seg);
            }
        }
    }
    if trailing_slash || out.is_empty() {
        out.push(b'/');
    }
    if out == b {
        return Ok(Cow::Borrowed(path));
    }
    // ASCII: bytes above 0x7F were escaped (lossy would change nothing).
    Ok(Cow::Owned(String::from_utf8(out).unwrap_or_else(|e| {
        String::from_utf8_lossy(e.as_bytes()).into_owned()
    })))
}

const HEX: &[u8; 16] = b"0123456789ABCDEF";

/// Can `v` stand raw in a request's path? What `http` takes in one, but `;`: parameters are
/// dropped from the raw bytes, so an escaped one is not one.
fn raw_in_path(v: u8) -> bool {
    matches!(v, 0x21 | 0x24..=0x3A | 0x3D | 0x40..=0x5F | 0x61..=0x7A | 0x7C | 0x7E | b'"' | b'{' | b'}')
}

/// The target sent upstream on a route with a `rewrite_prefix`: the path in normal form,
/// as the route matched it, with the route's `path_prefix` replaced by `to`, and the query
/// as the client sent it. The normal form, not the client's bytes, as nginx sends a path
/// through a `proxy_pass` with a URI: the prefix replaced is the one that was matched
/// (`/api/./users` and `/api;v=1/users` go up as `/v2/users`, and `%2F` as `/`). A `/` that
/// ends `to` and starts the rest is written once (`/api` → `/`: `/api/users` is `/users`).
/// `None` when the path does not match `prefix` (it did when routed), when the joined
/// path is not in normal form itself, or the result is not a valid target. The joined path
/// must be: `/api../x` matches a `/api` prefix (`api..` is no dot segment), and through
/// `/v2/` would go up as `/v2/../x`, which the upstream reads as `/x`.
pub fn rewrite_target(uri: &http::Uri, prefix: &str, to: &str) -> Option<http::Uri> {
    let path = normal_path(uri.path()).ok()?;
    let rest = path.strip_prefix(prefix)?;
    let rest = match rest.strip_prefix('/') {
        Some(r) if to.ends_with('/') => r,
        _ => rest,
    };
    let query = uri.query();
    let mut out = String::with_capacity(to.len() + rest.len() + query.map_or(0, |q| q.len() + 1));
    out.push_str(to);
    out.push_str(rest);
    if normal_path(&out).ok()? != out.as_str() {
        return None;
    }
    // What the normal form decoded that RFC 3986 allows in no path (`"`, `[`, `]`, `^`,
    // `{`, `|`, `}`) goes up escaped again: servers that hold to it (Tomcat) refuse them
    // raw.
    if out.bytes().any(not_pchar) {
        let mut escaped = String::with_capacity(out.len() + 8);
        for ch in out.chars() {
            match u8::try_from(ch) {
                Ok(b) if not_pchar(b) => {
                    escaped.push('%');
                    escaped.push(char::from(HEX[usize::from(b >> 4)]));
                    escaped.push(char::from(HEX[usize::from(b & 15)]));
                }
                _ => escaped.push(ch),
            }
        }
        out = escaped;
    }
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    http::Uri::try_from(out).ok()
}

/// A byte the normal form may hold raw that RFC 3986 allows in no path.
fn not_pchar(b: u8) -> bool {
    matches!(b, b'"' | b'[' | b']' | b'^' | b'{' | b'|' | b'}')
}

/// A path routes cannot match.
#[derive(Debug, PartialEq, Eq)]
pub enum BadPath {
    /// A `..` climbs above the root.
    AboveRoot,
    /// A `..` that takes off an empty segment, which servers resolve differently.
    DotsAfterEmpty,
    /// A `.` or `..` segment with `;` parameters, which servers read differently.
    DotsWithParams,
    /// A `;` parameter with an encoded slash or a backslash in it, which servers read
    /// differently.
    SlashInParams,
    /// An encoded NUL (`%00`).
    Nul,
    /// A `%` not followed by two hex digits.
    BadEscape,
}

impl BadPath {
    /// What a `400` says of it.
    pub fn message(&self) -> &'static str {
        match self {
            BadPath::AboveRoot => "the path climbs above the root (`..`)",
            BadPath::DotsAfterEmpty => {
                "the path has a `..` that takes off an empty segment (`//..`), which servers resolve differently"
            }
            BadPath::DotsWithParams => {
                "the path has a `.` or `..` segment with `;` parameters (`..;x`), which servers read differently"
            }
            BadPath::Nul => "the path has an encoded NUL (`%00`)",
            BadPath::BadEscape => "the path has a `%` that is not followed by two hex digits",
            BadPath::SlashInParams => {
                "the path has a `;` parameter with an encoded slash or a backslash in it (`;%2F..`), which servers read differently"
            }
        }
    }
}

fn hex_value(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rewrite sets `X-Forwarded-Prefix` in place of the client's, and under a `/` prefix
    /// (nothing to say) drops the client's all the same.
    #[test]
    fn a_rewrite_replaces_the_clients_forwarded_prefix() {
        let request = || {
            http::Request::get("/billing/a?q=1")
                .header("x-forwarded-prefix", "/evil")
                .header("x_forwarded_prefix", "/evil")
                .header("x-forwarded_prefix", "/evil")
                .body(())
                .expect("request")
                .into_parts()
                .0
        };
        let billing = Rewrite {
            to: Some("/".to_owned()),
            forwarded_prefix: Some(http::HeaderValue::from_static("/billing")),
            host: None,
        };
        let mut parts = request();
        billing.apply(&mut parts, "/billing/").expect("rewritten");
        assert_eq!(parts.uri, "/a?q=1");
        let sent: Vec<_> = parts.headers.get_all("x-forwarded-prefix").iter().collect();
        assert_eq!(sent, ["/billing"]);
        assert_eq!(parts.headers.len(), 1, "{:?}", parts.headers);
        let root = Rewrite {
            to: Some("/app/".to_owned()),
            ..Rewrite::default()
        };
        let mut parts = request();
        root.apply(&mut parts, "/").expect("rewritten");
        assert_eq!(parts.uri, "/app/billing/a?q=1");
        assert!(parts.headers.is_empty(), "{:?}", parts.headers);
    }

    /// A `host_rewrite` alone sets the Host and leaves the target and the client's
    /// `X-Forwarded-Prefix` as they were.
    #[test]
    fn a_host_rewrite_sets_only_the_host() {
        let mut parts = http::Request::get("/billing/a?q=1")
            .header("host", "client.example")
            .header("x-forwarded-prefix", "/p")
            .body(())
            .expect("request")
            .into_parts()
            .0;
        let host = Rewrite {
            host: Some(http::HeaderValue::from_static("api.internal:8443")),
            ..Rewrite::default()
        };
        host.apply(&mut parts, "/billing/").expect("rewritten");
        assert_eq!(parts.uri, "/billing/a?q=1");
        let hosts: Vec<_> = parts.headers.get_all("host").iter().collect();
        assert_eq!(hosts, ["api.internal:8443"]);
        assert_eq!(parts.headers["x-forwarded-prefix"], "/p");
    }

    /// What `check` takes as a `host_rewrite`: a Host header's shape, with a host.
    #[test]
    fn a_host_value_is_host_and_optional_port() {
        for ok in [
            "api.internal",
            "api.internal:8443",
            "10.0.0.1:80",
            "[::1]:8080",
            "A.b",
        ] {
            assert!(is_host_value(ok), "{ok}");
        }
        for bad in [
            "", ":80", "http://a", "a/b", "a b", "u@a", "a..b", "a:port", "a:123456", "a:99999",
            "a%41b", "[::1",
        ] {
            assert!(!is_host_value(bad), "{bad}");
        }
    }
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
            request_host(&parts)
                .ok()
                .flatten()
                .map(|(h, _)| h.to_owned())
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
        assert_eq!(
            host("http://a.test./x", Some("b.test")).as_deref(),
            Some("a.test")
        );
        // HTTP/1.1 without a Host header, absolute-form or not.
        assert_eq!(host("http://a.test./x", None), None);
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

    /// Routes of one prefix are tried in the config's order: GET to one cluster, every
    /// other method to the one a route without `methods` after it names.
    #[test]
    fn a_route_without_methods_after_one_with_takes_the_rest() {
        let t = table(
            "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"replica\"\nendpoints = [\"127.0.0.1:1\"]\n[[cluster]]\nname = \"primary\"\nendpoints = [\"127.0.0.1:2\"]\n[[route]]\npath_prefix = \"/x/\"\nmethods = [\"GET\"]\ncluster = \"replica\"\n[[route]]\npath_prefix = \"/x/\"\ncluster = \"primary\"\n",
        );
        for (method, cluster) in [
            (http::Method::GET, 0),
            (http::Method::HEAD, 0),
            (http::Method::POST, 1),
            (http::Method::DELETE, 1),
        ] {
            let Match::Found(r) = t.lookup("a.test", "/x/1", &method, None) else {
                panic!("no match for {method}")
            };
            assert_eq!(r.cluster, cluster, "{method}");
        }
    }

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
        // Deeper names, and a suffix that is not at a label's start.
        assert_eq!(t.tenant_of_host("a.b.eu.acme.test"), Some(1));
        assert_eq!(t.tenant_of_host("a.b.acme.test"), Some(0));
        assert_eq!(t.tenant_of_host("xacme.test"), None);
        assert_eq!(t.tenant_of_host("acme.test"), None);
        assert_eq!(t.tenant_of_host("test"), None);
        // A TLS server name as rustls hands it over: any case, perhaps a trailing dot.
        for sni in ["X.EU.acme.test", "x.eu.acme.test.", "X.Eu.Acme.Test."] {
            assert_eq!(t.tenant_of_server_name(sni), Some(1), "{sni}");
        }
        assert_eq!(t.tenant_of_server_name("x.acme.test."), Some(0));
        assert_eq!(t.tenant_of_server_name("acme.test."), None);
        // A host of many labels is looked up once per pattern length, not once per dot.
        let long = format!("{}acme.test", "a.".repeat(8000));
        assert_eq!(t.tenant_of_host(&long), Some(0));
        assert_eq!(t.wildcard_lens, [12, 9]);
    }

    /// A rewritten target holds no byte RFC 3986 allows in no path: what the normal form
    /// decoded goes up escaped again; the query is left as sent.
    #[test]
    fn a_rewritten_target_escapes_what_no_path_may_hold() {
        let uri: http::Uri = "/api/%7B%22k%22%7D/a%7Cb%5E?q={x}".parse().expect("uri");
        let out = rewrite_target(&uri, "/api/", "/v2/").expect("rewritten");
        assert_eq!(out, "/v2/%7B%22k%22%7D/a%7Cb%5E?q={x}");
        let uri: http::Uri = "/api/%41%3Ab".parse().expect("uri");
        let out = rewrite_target(&uri, "/api/", "/v2/").expect("rewritten");
        assert_eq!(out, "/v2/A:b");
    }

    /// The other readings resolve no dot segment, or keep backslashes and encoded slashes,
    /// or both, and are otherwise the normal form.
    #[test]
    fn the_other_readings_keep_the_paths_structure_as_they_say() {
        let reading = |dots, seps| Reading {
            dots,
            backslash: seps,
            encoded_slash: seps,
            encoded_backslash: seps,
        };
        let (flat, dots, slashes) = (
            reading(false, false),
            reading(true, false),
            reading(false, true),
        );
        assert_eq!(Reading::others().count(), 15);
        assert!(Reading::others().all(|r| r != Reading::NORMAL));
        // Only the readings that can differ for a path: none for one with nothing they
        // read otherwise.
        for (path, n) in [
            ("/caf%c3%a9/x;jsessionid=1//y.json", 0),
            ("/a/../b", 1),
            ("/a%2Fb", 1),
            ("/a%2fb/../c", 3),
            ("/a\\b%5Cc%2F..", 15),
        ] {
            assert_eq!(Reading::others_for(path).count(), n, "{path}");
        }
        for (raw, as_flat, as_dots, as_slashes) in [
            (
                "/public/../internal",
                "/public/../internal",
                "/internal",
                "/public/../internal",
            ),
            ("/a/./b", "/a/./b", "/a/b", "/a/./b"),
            ("/a\\..\\b", "/a\\..\\b", "/a\\..\\b", "/a/../b"),
            ("/a%2f..%5cb", "/a%2F..%5Cb", "/a%2F..%5Cb", "/a/../b"),
            (
                "/x%2Fy/../admin/z",
                "/x%2Fy/../admin/z",
                "/admin/z",
                "/x/y/../admin/z",
            ),
            (
                "/%70ublic//x;p=1/y",
                "/public/x/y",
                "/public/x/y",
                "/public/x/y",
            ),
            ("/caf\u{e9}/", "/caf%C3%A9/", "/caf%C3%A9/", "/caf%C3%A9/"),
        ] {
            assert_eq!(path_as_read(raw, flat).as_deref(), Ok(as_flat), "{raw}");
            assert_eq!(path_as_read(raw, dots).as_deref(), Ok(as_dots), "{raw}");
            assert_eq!(
                path_as_read(raw, slashes).as_deref(),
                Ok(as_slashes),
                "{raw}"
            );
        }
        assert_eq!(normal_path("/a\\..\\b").as_deref(), Ok("/b"));
        // A `%` that starts no escape is refused, not kept to be decoded into one.
        for bad in ["/%%36%31dmin/keys", "/a%", "/a%4", "/a%zz"] {
            assert_eq!(normal_path(bad), Err(BadPath::BadEscape), "{bad}");
        }
    }

    #[test]
    fn paths_in_normal_form_are_borrowed_and_others_normalised() {
        for plain in ["/", "/api/v1/items", "/a.b/c-d_e~f", "*", "/a?b"] {
            assert!(
                matches!(normal_path(plain), Ok(Cow::Borrowed(p)) if p == plain),
                "{plain}"
            );
        }
        for (raw, normal) in [
            ("/a/../b", "/b"),
            ("/a/./b", "/a/b"),
            ("/a//b", "/a/b"),
            ("//a", "/a"),
            ("/a/b/..", "/a/"),
            ("/a/.", "/a/"),
            ("/a/", "/a/"),
            ("/a/..", "/"),
            ("/a//x/../b", "/a/b"),
            ("/.", "/"),
            ("/a/%2e%2E/", "/"),
            ("/x/%2e%2e/y", "/y"),
            ("/%70ublic/%7e", "/public/~"),
            ("/a%2Fb", "/a/b"),
            ("/a%5cb", "/a/b"),
            ("/a\\b", "/a/b"),
            ("/a%3ab", "/a:b"),
            ("/v1/items%3Apurge", "/v1/items:purge"),
            ("/%40me/%21%24%26%27%28%29%2A%2B%2C%3D", "/@me/!$&'()*+,="),
            ("/a%7Cb/%5B1%5D/%7B%22k%22%7D/%5e", "/a|b/[1]/{\"k\"}/^"),
            // Escapes that would change the path's structure, or of bytes that cannot
            // stand raw, stay escaped.
            ("/a%3fb%23c%25d", "/a%3Fb%23c%25d"),
            ("/a%20b%3C%3e%60%7f%0A", "/a%20b%3C%3E%60%7F%0A"),
            ("/x/..%2fz", "/z"),
            ("/x/;y", "/x/"),
            ("/admin;jsessionid=1/keys", "/admin/keys"),
            ("/a;x=1;y=2/b;c", "/a/b"),
            ("/a/;x/b", "/a/b"),
            ("/a%3Bb", "/a%3Bb"),
            // A parameter runs to the next `/` as sent, encoded dots included.
            ("/admin;%2E%2E/x", "/admin/x"),
            ("/;", "/"),
            ("/a;", "/a"),
            ("/.well-known/x", "/.well-known/x"),
            // Raw UTF-8 is matched as its escapes (upper case), however it was sent.
            ("/é/../ü", "/%C3%BC"),
            ("/é/x", "/%C3%A9/x"),
            ("/%c3%a9/x", "/%C3%A9/x"),
            ("/%C3%A9/x;p", "/%C3%A9/x"),
        ] {
            assert_eq!(normal_path(raw).as_deref(), Ok(normal), "{raw}");
        }
        // Already normal, with `%` or `/.` in it: no allocation.
        for same in ["/a%3Bb", "/.well-known/x", "/a.b/.c"] {
            assert!(
                matches!(normal_path(same), Ok(Cow::Borrowed(p)) if p == same),
                "{same}"
            );
        }
        for above in ["/..", "/../a", "/a/../..", "/%2e%2e", "/a/..%2F.."] {
            assert_eq!(normal_path(above), Err(BadPath::AboveRoot), "{above}");
        }
        // `..` after an empty segment: `/b` once slashes are merged, `/a/b` in Jetty.
        // Also a `..` that takes off an empty segment further back.
        for ambiguous in [
            "/a//../b",
            "/a/;x/../b",
            "/a%2F%2F..",
            "//..",
            "/a//..",
            "/a//./../b",
            "/internal//x/../../api/y",
            "/a//x/y/../../../b",
        ] {
            assert_eq!(
                normal_path(ambiguous),
                Err(BadPath::DotsAfterEmpty),
                "{ambiguous}"
            );
        }
        // `..;x` is `..` to Tomcat and a segment of its own to nginx.
        for params in [
            "/x/..;y/z",
            "/x/.;y/z",
            "/x/%2e%2e;y/z",
            "/..;x/a",
            "/a%2F..;x",
            "/x/..;",
        ] {
            assert_eq!(
                normal_path(params),
                Err(BadPath::DotsWithParams),
                "{params}"
            );
        }
        // A slash inside a parameter: part of it to Tomcat, a slash to nginx.
        for slash in [
            "/admin;%2F..%2Fpublic/x",
            "/admin;%2f..%2fpublic/x",
            "/admin;x%5C..%5cpublic/x",
            "/admin;\\..\\public/x",
            "/a/b;p=%2F",
        ] {
            assert_eq!(normal_path(slash), Err(BadPath::SlashInParams), "{slash}");
        }
        for nul in ["/a%00", "/a%00/../b", "/%00.txt", "/a;%00/b"] {
            assert_eq!(normal_path(nul), Err(BadPath::Nul), "{nul}");
        }
    }

    #[test]
    fn a_host_is_a_name_or_literal_with_an_optional_port() {
        for ok in [
            "",
            "a",
            "acme.test",
            "acme.test:8080",
            "acme.test:",
            "acme.test.",
            "a_b-c.test",
            "[::1]",
            "[::1]:443",
            "[fe80::1]:80",
            "xn--bcher-kva.test",
            "[fe80::1%25eth0]:80",
            "[v1.fe-80]",
        ] {
            assert!(host_part(ok.as_bytes()).is_some(), "{ok:?}");
        }
        for bad in [
            "acme.test:@evil.example",
            "user@acme.test",
            "acme.test/x",
            "acme.test\\x",
            "acme..test",
            ".acme.test",
            "acme.test:80x",
            "acme.test:123456",
            "acme.test:80:80",
            "[::1",
            "[]",
            "[::1]x",
            "[::1]:8o",
            "a b",
            "a\tb",
        ] {
            assert!(host_part(bad.as_bytes()).is_none(), "{bad:?}");
        }
    }

    /// A route that names HEAD keeps it: the GET route of the same prefix does not take it.
    #[test]
    fn an_explicit_head_route_is_not_shadowed_by_a_get_route() {
        for (first, second) in [("GET", "HEAD"), ("HEAD", "GET")] {
            let t = table(&format!(
                "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"a\"\nendpoints = [\"127.0.0.1:1\"]\n[[cluster]]\nname = \"b\"\nendpoints = [\"127.0.0.1:2\"]\n[[route]]\npath_prefix = \"/x/\"\nmethods = [\"{first}\"]\ncluster = \"a\"\n[[route]]\npath_prefix = \"/x/\"\nmethods = [\"{second}\"]\ncluster = \"b\"\n"
            ));
            let Match::Found(r) = t.lookup("h", "/x/1", &http::Method::HEAD, None) else {
                panic!("no match")
            };
            let head_cluster = if first == "HEAD" { 0 } else { 1 };
            assert_eq!(r.cluster, head_cluster, "{first} then {second}");
        }
    }

    #[test]
    fn a_get_route_takes_head_and_no_route_takes_trace_unasked() {
        let t = table(CFG);
        let Match::Found(r) = t.lookup("acme.test", "/api/x", &http::Method::HEAD, None) else {
            panic!("no match")
        };
        assert_eq!(r.cluster, 1, "HEAD goes where GET goes");
        match t.lookup("other.test", "/public/a", &http::Method::TRACE, None) {
            Match::WrongMethod(allowed) => {
                assert_eq!(allowed.len(), DEFAULT_METHODS.len());
                assert!(!allowed.contains(&http::Method::TRACE));
            }
            _ => panic!("TRACE must not match a route without methods"),
        }
    }

    #[test]
    fn the_host_part_ends_at_the_port_and_knows_its_case() {
        assert_eq!(host_part(b"a.test:8080"), Some((6, false)));
        assert_eq!(host_part(b"A.test"), Some((6, true)));
        assert_eq!(host_part(b"[::1]:80"), Some((5, false)));
        assert_eq!(host_part(b"[FE80::1]"), Some((9, true)));
        assert_eq!(host_part(b""), Some((0, false)));
    }
}
