//! Header rewriting a reverse proxy owes both sides: hop-by-hop headers removed (RFC 9110
//! §7.6.1), `Via`, `X-Forwarded-*`, and the request id.

use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use http::{HeaderMap, HeaderName, HeaderValue, header};

static KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
/// HTTP/2's upgrade settings (RFC 7540 §3.2.1): connection-specific, removed with the
/// other hop-by-hop headers. Not looked for on its own: without the `Upgrade` it goes with
/// (itself hop-by-hop) it asks nothing of anyone, and one more name to compare on every
/// header of every message cost about 80 instructions per request.
static HTTP2_SETTINGS: HeaderName = HeaderName::from_static("http2-settings");
static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
/// Set on routes with a `rewrite_prefix` ([`super::route::Rewrite`]).
pub static X_FORWARDED_PREFIX: HeaderName = HeaderName::from_static("x-forwarded-prefix");

/// A header name read off the wire, as [`HeaderName::from_bytes`] gives it, with the names
/// nearly every API request and response carries found by length and a case-insensitive
/// compare rather than by lower-casing into a buffer and matching every standard name
/// (about a hundred instructions less per header; both HTTP/1.1 codecs call it).
pub fn name_from_wire(raw: &[u8]) -> Result<HeaderName, http::header::InvalidHeaderName> {
    let known = match raw.len() {
        4 if lower_eq(raw, b"host") => header::HOST,
        4 if lower_eq(raw, b"date") => header::DATE,
        6 if lower_eq(raw, b"accept") => header::ACCEPT,
        6 if lower_eq(raw, b"server") => header::SERVER,
        6 if lower_eq(raw, b"cookie") => header::COOKIE,
        10 if lower_eq(raw, b"connection") => header::CONNECTION,
        10 if lower_eq(raw, b"user-agent") => header::USER_AGENT,
        12 if lower_eq(raw, b"content-type") => header::CONTENT_TYPE,
        13 if lower_eq(raw, b"authorization") => header::AUTHORIZATION,
        13 if lower_eq(raw, b"cache-control") => header::CACHE_CONTROL,
        14 if lower_eq(raw, b"content-length") => header::CONTENT_LENGTH,
        15 if lower_eq(raw, b"accept-encoding") => header::ACCEPT_ENCODING,
        17 if lower_eq(raw, b"transfer-encoding") => header::TRANSFER_ENCODING,
        _ => return HeaderName::from_bytes(raw),
    };
    Ok(known)
}

/// One header line on the wire, as both HTTP/1.1 codecs write it.
pub fn put_header(w: &mut Vec<u8>, name: &HeaderName, value: &HeaderValue) {
    w.reserve(name.as_str().len() + value.len() + 4);
    w.extend_from_slice(name.as_str().as_bytes());
    w.extend_from_slice(b": ");
    w.extend_from_slice(value.as_bytes());
    w.extend_from_slice(b"\r\n");
}

/// Does the comma-separated list `v` name `token` (ASCII case-insensitive)?
pub fn token_in(v: &[u8], token: &[u8]) -> bool {
    v.split(|&b| b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
}

/// `raw` equals the lower-case `lower` but for the case of its letters. Exact for header
/// names: setting bit 5 maps only `A`–`Z` onto `a`–`z`, and `lower` holds only letters and
/// `-` (which no other token byte maps onto).
fn lower_eq(raw: &[u8], lower: &[u8]) -> bool {
    raw.len() == lower.len() && raw.iter().zip(lower).all(|(&a, &b)| a | 0x20 == b)
}

/// Removes hop-by-hop headers: `Connection` and every header it names, `Keep-Alive`, `TE`,
/// `Trailer`, `Transfer-Encoding`, `Upgrade`, `Proxy-*`. When `keep_upgrade` is set (a
/// WebSocket handshake being passed through) `Connection: upgrade` and `Upgrade` stay.
///
/// Returns false when the message carried none of them (nothing was removed).
pub fn remove_hop_by_hop(headers: &mut HeaderMap, keep_upgrade: bool) -> bool {
    // Most messages carry none of these: one pass over the names (cheap comparisons for
    // standard headers, stopping at the first found) spares a dozen hashed removals per
    // message, as before. Many carry one or two (`Connection: keep-alive` from Python's
    // and Java's clients, and with `Keep-Alive` from Node's servers): a second pass then
    // finds which, and only those are removed.
    if !has_hop_by_hop(headers) {
        if keep_upgrade {
            headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        }
        return false;
    }
    let found = hop_by_hop_found(headers);
    if found & HOP_CONNECTION != 0 {
        // The headers it names, unless it names none but the `close` and `keep-alive`
        // options (the usual case: no copy). Then the values copied once (the map changes
        // below); each token looked up as it is, its name parsed on the stack: no
        // allocation per token, however many a client sends. A value with bytes past
        // ASCII in it still has its other tokens honoured.
        let names_headers = headers
            .get_all(header::CONNECTION)
            .iter()
            .flat_map(|v| v.as_bytes().split(|&b| b == b','))
            .map(<[u8]>::trim_ascii)
            .any(|t| !t.is_empty() && !lower_eq(t, b"close") && !lower_eq(t, b"keep-alive"));
        if names_headers {
            let mut named = Vec::new();
            for v in &headers.get_all(header::CONNECTION) {
                named.extend_from_slice(v.as_bytes());
                named.push(b',');
            }
            for token in named.split(|&b| b == b',') {
                let token = token.trim_ascii();
                if token.is_empty() || keep_upgrade && token.eq_ignore_ascii_case(b"upgrade") {
                    continue;
                }
                // Not UTF-8: no header name either.
                if let Ok(name) = std::str::from_utf8(token) {
                    headers.remove(name);
                }
            }
        }
        headers.remove(header::CONNECTION);
    }
    for (bit, name) in [
        (HOP_KEEP_ALIVE, &KEEP_ALIVE),
        (HOP_HTTP2_SETTINGS, &HTTP2_SETTINGS),
        (HOP_TE, &header::TE),
        (HOP_TRAILER, &header::TRAILER),
        (HOP_TRANSFER_ENCODING, &header::TRANSFER_ENCODING),
    ] {
        if found & bit != 0 {
            headers.remove(name);
        }
    }
    // `Proxy-Authenticate`, `Proxy-Authorization`, `Proxy-Connection`, and every other
    // `Proxy-*`; also `Proxy` itself, which CGI-style upstreams turn into `HTTP_PROXY`
    // (httpoxy, CVE-2016-5385).
    if found & HOP_PROXY != 0 {
        remove_where(headers, is_proxy);
    }
    if keep_upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    } else if found & HOP_UPGRADE != 0 {
        headers.remove(header::UPGRADE);
    }
    true
}

const HOP_CONNECTION: u8 = 1;
const HOP_KEEP_ALIVE: u8 = 2;
const HOP_TE: u8 = 4;
const HOP_TRAILER: u8 = 8;
const HOP_TRANSFER_ENCODING: u8 = 16;
const HOP_UPGRADE: u8 = 32;
const HOP_PROXY: u8 = 64;
/// `HTTP2-Settings`: removed with the others, though alone it is no reason to look (see
/// [`is_hop_by_hop`]).
const HOP_HTTP2_SETTINGS: u8 = 128;

/// Which hop-by-hop headers the message carries (`HOP_*` bits), once one is known to be
/// there ([`has_hop_by_hop`]). One pass over the names, no lookup.
fn hop_by_hop_found(headers: &HeaderMap) -> u8 {
    headers.keys().fold(0, |found, n| {
        found
            | if n == HTTP2_SETTINGS {
                HOP_HTTP2_SETTINGS
            } else {
                hop_bit(n)
            }
    })
}

/// Does the message carry any hop-by-hop header? One pass over the names, no lookup.
pub fn has_hop_by_hop(headers: &HeaderMap) -> bool {
    headers.keys().any(is_hop_by_hop)
}

/// Is `n` a hop-by-hop header, removed from every message the gateway passes on?
#[inline]
pub fn is_hop_by_hop(n: &HeaderName) -> bool {
    hop_bit(n) != 0
}

/// The `HOP_*` bit of a hop-by-hop header, 0 for any other (`HTTP2-Settings` too: it is
/// removed only beside one of these).
#[inline]
fn hop_bit(n: &HeaderName) -> u8 {
    if n == header::CONNECTION {
        HOP_CONNECTION
    } else if n == header::TE {
        HOP_TE
    } else if n == header::TRAILER {
        HOP_TRAILER
    } else if n == header::TRANSFER_ENCODING {
        HOP_TRANSFER_ENCODING
    } else if n == header::UPGRADE {
        HOP_UPGRADE
    } else if n == KEEP_ALIVE {
        HOP_KEEP_ALIVE
    } else if is_proxy(n) {
        HOP_PROXY
    } else {
        0
    }
}

/// `Proxy` or `Proxy-*`: meant for a proxy, never passed on. Not `Proxy-Status` (RFC 9209),
/// which each proxy on the way adds to and passes on.
#[inline]
fn is_proxy(n: &HeaderName) -> bool {
    let n = n.as_str().as_bytes();
    n.starts_with(b"proxy") && (n.len() == 5 || n[5] == b'-' && n != b"proxy-status")
}

/// The client's address as header text, rendered once per connection (see [`Added`]).
pub fn client_addr_value(client: IpAddr) -> HeaderValue {
    // An address's text is always a valid header value.
    HeaderValue::try_from(client.to_string()).unwrap_or_else(|_| HeaderValue::from_static(""))
}

static VIA: HeaderName = header::VIA;

/// The headers the gateway sets on an upstream request, the way nginx and Envoy do: `Via`
/// (added beside the client's), `X-Forwarded-For` (the client address, from
/// [`client_addr_value`], appended to the client's list), `X-Forwarded-Proto`,
/// `X-Forwarded-Host` and the request id (replacing the client's).
///
/// They are kept apart from the request's header map rather than inserted into it: an
/// HTTP/1.1 upstream gets them written after the client's headers, with the ones they
/// replace skipped (inserting them grew and rehashed the map on every request, about
/// 2,000 instructions); an HTTP/2 upstream gets them put into its copy of the map.
pub struct Added<'a> {
    via: HeaderValue,
    xff: std::borrow::Cow<'a, HeaderValue>,
    proto: HeaderValue,
    host: Option<&'a HeaderValue>,
    request_id: (&'a HeaderName, &'a HeaderValue),
}

impl<'a> Added<'a> {
    /// Borrows what it can (the values live as long as the request's handling).
    pub fn new(
        headers: &HeaderMap,
        version: http::Version,
        client: &'a HeaderValue,
        tls: bool,
        host: Option<&'a HeaderValue>,
        request_id: (&'a HeaderName, &'a HeaderValue),
    ) -> Added<'a> {
        // Constants: `from_static` outside a const checks every byte at run time.
        const VIA_2: HeaderValue = HeaderValue::from_static("2 tailgate");
        const VIA_10: HeaderValue = HeaderValue::from_static("1.0 tailgate");
        const VIA_11: HeaderValue = HeaderValue::from_static("1.1 tailgate");
        const HTTPS: HeaderValue = HeaderValue::from_static("https");
        const HTTP: HeaderValue = HeaderValue::from_static("http");
        let via = match version {
            http::Version::HTTP_2 => VIA_2,
            http::Version::HTTP_10 => VIA_10,
            _ => VIA_11,
        };
        // Without an earlier X-Forwarded-For (the usual case) the connection's rendered
        // address is shared, not formatted again.
        let earlier = headers.get_all(&X_FORWARDED_FOR);
        let xff = if earlier.iter().next().is_none() {
            std::borrow::Cow::Borrowed(client)
        } else {
            // As bytes: an earlier hop with bytes past ASCII in it is passed on, not lost
            // (nginx and Envoy append to the bytes as sent, too).
            let mut xff = Vec::new();
            for prev in &earlier {
                xff.extend_from_slice(prev.as_bytes());
                xff.extend_from_slice(b", ");
            }
            xff.extend_from_slice(client.as_bytes());
            std::borrow::Cow::Owned(
                HeaderValue::from_maybe_shared(bytes::Bytes::from(xff))
                    .unwrap_or_else(|_| client.clone()),
            )
        };
        Added {
            via,
            xff,
            proto: if tls { HTTPS } else { HTTP },
            host,
            request_id,
        }
    }

    /// Is the client's header of this name left out: set by the gateway itself, or
    /// `Expect` (100-continue is answered to the client by the gateway)? A client's
    /// `X-Forwarded-Host` is left out even when the request names no host (HTTP/1.0), so
    /// none is sent then: the upstream must never take a host from the client for one the
    /// gateway vouches for (links built from it, such as a password reset's).
    ///
    /// For the same reason a client's `Forwarded` (RFC 7239) and its other claims of what
    /// only a proxy may say (every `X-Forwarded-*` but `-Prefix`, `X-Real-IP`,
    /// `True-Client-IP`) are left out, and none is written:
    /// frameworks read them before, or beside, the `X-Forwarded-*` the gateway writes, so
    /// a client's would pass for the gateway's word.
    ///
    /// A name spelled with `_` for `-` (`X_Real_IP`, `X-Forwarded_Host`) is the same name
    /// here: CGI-style upstreams (Rack, uWSGI, PHP) read both as one `HTTP_*` variable
    /// (RFC 3875 §4.1.18), so the client's would stand in for the one the gateway removed
    /// or wrote (nginx drops every name with `_` by default).
    pub fn replaces(&self, name: &HeaderName) -> bool {
        *name == header::EXPECT
            || *name == header::FORWARDED
            || self.is_request_id(name)
            || proxys_word(name)
    }

    /// The request id's header, in either spelling (see [`Self::replaces`]).
    fn is_request_id(&self, name: &HeaderName) -> bool {
        same_name(name.as_str(), self.request_id.0.as_str())
    }

    /// The headers to add, in order.
    pub fn iter(&self) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
        [
            (&VIA, &self.via),
            (&X_FORWARDED_FOR, &*self.xff),
            (&X_FORWARDED_PROTO, &self.proto),
        ]
        .into_iter()
        .chain(self.host.map(|h| (&X_FORWARDED_HOST, h)))
        .chain(std::iter::once(self.request_id))
    }

    /// Puts them into `headers` (an HTTP/2 request's copy of the client's).
    pub fn apply(&self, headers: &mut HeaderMap) {
        headers.remove(header::EXPECT);
        headers.remove(header::FORWARDED);
        // (The request id's own spelling is replaced by the insert below: matched here, a
        // client's id, which most requests carry, cost a pass and a copy of the names.)
        remove_where(headers, |n| {
            proxys_word(n) || other_spelling(n, self.request_id.0)
        });
        for (name, value) in self.iter() {
            if *name == VIA {
                headers.append(name, value.clone());
            } else {
                headers.insert(name, value.clone());
            }
        }
    }
}

/// Removes every header whose name `pred` picks: one pass over the names when none is
/// there (most messages), the names copied only when some are.
fn remove_where(headers: &mut HeaderMap, pred: impl Fn(&HeaderName) -> bool) {
    if headers.keys().any(&pred) {
        let names: Vec<HeaderName> = headers.keys().filter(|n| pred(n)).cloned().collect();
        for n in names {
            headers.remove(n);
        }
    }
}

/// Leaves out of a request's trailers (sent on to HTTP/2 upstreams only; an HTTP/1.1
/// upstream gets none) the fields no trailer may carry, as nginx's and Envoy's HTTP/2
/// codecs refuse them: the hop-by-hop ones ([`is_hop_by_hop`], and `HTTP2-Settings`),
/// which the HTTP/2 layer refuses to send (it then neither ends nor resets the stream, so
/// the upstream waited for the body's end until the response timeout, and the endpoint
/// was blamed for it); framing, routing and credentials (RFC 9110 §6.5.1); and those the
/// gateway vouches for in the head (those a client's head loses, `Forwarded`, `Via`,
/// `X-Forwarded-Prefix`), which a trailer would pass on unchecked.
pub fn strip_trailers(trailers: &mut HeaderMap) {
    remove_where(trailers, |n| {
        is_hop_by_hop(n)
            || *n == HTTP2_SETTINGS
            || proxys_word(n)
            || matches!(
                n.as_str(),
                "content-length"
                    | "content-type"
                    | "content-encoding"
                    | "content-range"
                    | "host"
                    | "expect"
                    | "authorization"
                    | "cookie"
                    | "forwarded"
                    | "via"
                    | "x-forwarded-prefix"
            )
    });
}

/// A header only a proxy may send, which a client's request loses: every `X-Forwarded-*`
/// but `X-Forwarded-Prefix` (the gateway writes its own `-For`, `-Proto` and `-Host`;
/// Spring and Django read `-Port`, Rack `-Ssl` and `-Scheme` before `-Proto`), and the
/// client address headers `X-Real-IP` and `True-Client-IP` (chi's and Gin's client IP).
/// A client's `X-Forwarded-Prefix` goes on, as nginx and Envoy pass it (a rewrite route
/// writes its own in its place).
///
/// Spelled with `_` for `-` too (see [`Added::replaces`]).
fn proxys_word(name: &HeaderName) -> bool {
    let n = name.as_str();
    // Most names start otherwise: one look.
    if !n.starts_with(['x', 't']) {
        return false;
    }
    match n.split_at_checked("x-forwarded-".len()) {
        Some((head, rest)) if same_name(head, "x-forwarded-") => !same_name(rest, "prefix"),
        _ => same_name(n, "x-real-ip") || same_name(n, "true-client-ip"),
    }
}

/// Removes the headers named `name` spelled with `_` for some of its `-` (not `name`
/// itself; see [`Added::replaces`]).
pub(super) fn remove_underscore_spellings(headers: &mut HeaderMap, name: &HeaderName) {
    remove_where(headers, |n| other_spelling(n, name));
}

/// Is `n` `name` spelled with `_` for some of its `-`, and not `name` itself?
fn other_spelling(n: &HeaderName, name: &HeaderName) -> bool {
    n != name && same_name(n.as_str(), name.as_str())
}

/// Is `name` (lower case, as header names are kept) `canonical`, or `canonical` with `_`
/// for some of its `-`?
fn same_name(name: &str, canonical: &str) -> bool {
    name.len() == canonical.len()
        && name
            .bytes()
            .zip(canonical.bytes())
            .all(|(a, b)| a == b || (a == b'_' && b == b'-'))
}

/// Does this request ask for a protocol upgrade (WebSocket) the gateway passes on?
///
/// Never `h2c`: an upgrade to cleartext HTTP/2 would make the tunnel an HTTP/2 connection
/// to the upstream, whose later requests no route, method or limit of the gateway sees
/// (h2c smuggling). Such a request goes on as a plain HTTP/1.1 one, its `Upgrade` removed
/// with the other hop-by-hop headers, as nginx (which passes no `Upgrade` unless told to)
/// and Envoy (which refuses `h2c` unless configured) do.
///
/// An `Upgrade` value that is not plain text (bytes past ASCII) is no upgrade either: it
/// could hide an `h2c` from the look for one (failing closed).
pub fn wants_upgrade(headers: &HeaderMap) -> bool {
    let upgrade = headers.get_all(header::UPGRADE);
    upgrade.iter().next().is_some()
        && upgrade.iter().all(|v| v.to_str().is_ok())
        && connection_has(headers, "upgrade")
        && !lists_token(headers, &header::UPGRADE, "h2c")
}

/// Does a `Connection` header list `token` (case-insensitive)?
pub fn connection_has(headers: &HeaderMap, token: &str) -> bool {
    lists_token(headers, &header::CONNECTION, token)
}

/// Does a comma-separated header list `token` (parameters after `;` ignored)?
fn lists_token(headers: &HeaderMap, name: &header::HeaderName, token: &str) -> bool {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| {
            t.split(';')
                .next()
                .is_some_and(|t| t.trim().eq_ignore_ascii_case(token))
        })
}

/// Request ids: a random prefix (one per worker) and a counter, 24 hex digits; unique
/// without coordination between workers or processes.
pub struct RequestIds {
    prefix: u64,
    counter: AtomicU64,
}

impl Default for RequestIds {
    fn default() -> Self {
        RequestIds {
            prefix: fastrand::u64(..),
            counter: AtomicU64::new(0),
        }
    }
}

impl RequestIds {
    pub fn next(&self) -> HeaderValue {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let mut buf = [0u8; 24];
        hex(&mut buf[..16], self.prefix ^ (n >> 32).rotate_left(17));
        hex(&mut buf[16..], n & 0xffff_ffff);
        // Only hex digits: always a valid header value. The id is cloned into the exchange
        // record and both messages: bytes that own a shared buffer from the start are
        // cloned by a reference count (one allocation per id, not one more at first clone).
        HeaderValue::from_maybe_shared(bytes::Bytes::from_owner(buf))
            .unwrap_or_else(|_| HeaderValue::from_static("0"))
    }

    /// The client's id when it sent a usable one (printable, at most 128 bytes), else a new one.
    pub fn keep_or_new(&self, sent: Option<&HeaderValue>) -> HeaderValue {
        match sent {
            Some(v)
                if !v.is_empty()
                    && v.len() <= 128
                    && v.as_bytes().iter().all(|b| b.is_ascii_graphic()) =>
            {
                v.clone()
            }
            _ => self.next(),
        }
    }
}

fn hex(out: &mut [u8], mut v: u64) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for slot in out.iter_mut().rev() {
        *slot = DIGITS[(v & 0xf) as usize];
        v >>= 4;
    }
}

/// Does a `TE` header list `trailers`?
pub fn te_has_trailers(h: &HeaderMap) -> bool {
    lists_token(h, &header::TE, "trailers")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_tokens() {
        assert!(token_in(b"keep-alive, Close", b"close"));
        assert!(!token_in(b"closed", b"close"));
    }

    #[test]
    fn names_from_the_wire_match_the_standard_parse() {
        for raw in [
            &b"Host"[..],
            b"HOST",
            b"date",
            b"Accept",
            b"server",
            b"Cookie",
            b"Connection",
            b"User-Agent",
            b"content-TYPE",
            b"Authorization",
            b"Cache-Control",
            b"Content-Length",
            b"Accept-Encoding",
            b"Transfer-Encoding",
            b"X-Request-Id",
            b"hosts",
            b"hos",
        ] {
            assert_eq!(
                name_from_wire(raw).expect("a valid name"),
                HeaderName::from_bytes(raw).expect("a valid name"),
                "{}",
                String::from_utf8_lossy(raw)
            );
        }
        assert!(name_from_wire(b"bad name").is_err());
        assert!(name_from_wire(b"").is_err());
    }

    #[test]
    fn removes_connection_named_headers() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("close, x-secret"),
        );
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        h.insert("proxy-connection", HeaderValue::from_static("keep-alive"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        remove_hop_by_hop(&mut h, false);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-kept"));

        // Several values, odd spacing, upper case, a token with a byte past ASCII beside
        // them, a token that is no header name: each named header is gone all the same.
        let mut h = HeaderMap::new();
        h.append(
            header::CONNECTION,
            HeaderValue::from_bytes(b"X-A ,\tx-\xff, ").expect("value"),
        );
        h.append(
            header::CONNECTION,
            HeaderValue::from_static("x-b,a b,,upgrade"),
        );
        for n in ["x-a", "x-b", "upgrade", "x-kept"] {
            h.insert(n, HeaderValue::from_static("1"));
        }
        remove_hop_by_hop(&mut h, true);
        let left: Vec<_> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(left, ["upgrade", "x-kept", "connection"], "{h:?}");
    }

    /// The usual shapes: `Connection: keep-alive` (with or without `Keep-Alive`), `close`,
    /// `HTTP2-Settings` alone (not looked for) or beside another; what names nothing more
    /// removes only what is there.
    #[test]
    fn the_usual_connection_options_remove_what_is_there() {
        let kept =
            |h: &HeaderMap| -> Vec<String> { h.keys().map(|k| k.as_str().to_owned()).collect() };
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("Keep-Alive"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        assert!(remove_hop_by_hop(&mut h, false));
        assert_eq!(kept(&h), ["x-kept"]);

        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("close"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        assert!(remove_hop_by_hop(&mut h, false));
        assert!(h.is_empty(), "{h:?}");

        let mut h = HeaderMap::new();
        h.insert(
            "http2-settings",
            HeaderValue::from_static("AAMAAABkAAQAAP__"),
        );
        assert!(!remove_hop_by_hop(&mut h, false), "alone it is passed on");
        assert_eq!(kept(&h), ["http2-settings"]);
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        assert!(remove_hop_by_hop(&mut h, false));
        assert!(h.is_empty(), "{h:?}");

        // Upgrade kept, `Connection` made `upgrade` alone.
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, Upgrade"),
        );
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        assert!(remove_hop_by_hop(&mut h, true));
        assert_eq!(h[header::CONNECTION], "upgrade");
        assert_eq!(h[header::UPGRADE], "websocket");
    }

    #[test]
    fn forwarded_for_is_set_or_appended() {
        let client = client_addr_value(IpAddr::from([192, 0, 2, 7]));
        let id = (
            HeaderName::from_static("x-request-id"),
            HeaderValue::from_static("r1"),
        );
        let mut h = HeaderMap::new();
        Added::new(
            &h,
            http::Version::HTTP_11,
            &client,
            false,
            None,
            (&id.0, &id.1),
        )
        .apply(&mut h);
        assert_eq!(h["x-forwarded-for"], "192.0.2.7");
        assert_eq!(h["x-request-id"], "r1");
        assert_eq!(h["x-forwarded-proto"], "http");
        assert_eq!(h["via"], "1.1 tailgate");
        assert!(!h.contains_key("x-forwarded-host"));

        let mut h = HeaderMap::new();
        h.append("x-forwarded-for", HeaderValue::from_static("10.0.0.1"));
        h.append("x-forwarded-for", HeaderValue::from_static("10.0.0.2"));
        h.append("x-request-id", HeaderValue::from_static("from-client"));
        h.append("via", HeaderValue::from_static("1.1 edge"));
        let host = HeaderValue::from_static("api.test");
        let added = Added::new(
            &h,
            http::Version::HTTP_2,
            &client,
            true,
            Some(&host),
            (&id.0, &id.1),
        );
        for replaced in [
            "x-forwarded-for",
            "x-request-id",
            "x-forwarded-host",
            "forwarded",
            "x-forwarded-port",
            "x-forwarded-ssl",
            "x-forwarded-scheme",
            "x-real-ip",
            "true-client-ip",
        ] {
            assert!(
                added.replaces(&HeaderName::from_static(replaced)),
                "{replaced}"
            );
        }
        assert!(!added.replaces(&HeaderName::from_static("via")));
        assert!(!added.replaces(&HeaderName::from_static("x-forwarded-prefix")));
        added.apply(&mut h);
        let xff: Vec<_> = h.get_all("x-forwarded-for").iter().collect();
        assert_eq!(xff, ["10.0.0.1, 10.0.0.2, 192.0.2.7"]);
        // An earlier hop with a byte past ASCII is passed on with the rest.
        let mut odd = HeaderMap::new();
        odd.append("x-forwarded-for", HeaderValue::from_static("10.0.0.1"));
        odd.append(
            "x-forwarded-for",
            HeaderValue::from_bytes(b"10.0.0.2\x80").expect("value"),
        );
        Added::new(
            &odd,
            http::Version::HTTP_11,
            &client,
            false,
            None,
            (&id.0, &id.1),
        )
        .apply(&mut odd);
        assert_eq!(
            odd["x-forwarded-for"].as_bytes(),
            b"10.0.0.1, 10.0.0.2\x80, 192.0.2.7"
        );
        let via: Vec<_> = h.get_all("via").iter().collect();
        assert_eq!(via, ["1.1 edge", "2 tailgate"]);
        assert_eq!(h["x-request-id"], "r1");
        assert_eq!(h["x-forwarded-proto"], "https");
        assert_eq!(h["x-forwarded-host"], "api.test");

        let v6 = client_addr_value("2001:db8::1".parse().expect("address"));
        assert_eq!(v6, "2001:db8::1");
    }

    #[test]
    fn request_ids_are_unique_and_kept() {
        let ids = RequestIds::default();
        let a = ids.next();
        let b = ids.next();
        assert_ne!(a, b);
        assert_eq!(a.len(), 24);
        let sent = HeaderValue::from_static("abc-123");
        assert_eq!(ids.keep_or_new(Some(&sent)), sent);
        let bad = HeaderValue::from_static("has space");
        assert_ne!(ids.keep_or_new(Some(&bad)), bad);
    }

    #[test]
    fn te_trailers_is_found_among_other_codings() {
        let mut h = http::HeaderMap::new();
        h.insert(
            http::header::TE,
            HeaderValue::from_static("gzip, Trailers;q=1"),
        );
        assert!(te_has_trailers(&h));
        h.insert(http::header::TE, HeaderValue::from_static("gzip"));
        assert!(!te_has_trailers(&h));
    }
}
