//! Header rewriting a reverse proxy owes both sides: hop-by-hop headers removed (RFC 9110
//! §7.6.1), `Via`, `X-Forwarded-*`, and the request id.

use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use http::header::Entry;
use http::{HeaderMap, HeaderName, HeaderValue, header};

static KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
static PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");
static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Removes hop-by-hop headers: `Connection` and every header it names, `Keep-Alive`, `TE`,
/// `Trailer`, `Transfer-Encoding`, `Upgrade`, `Proxy-*`. When `keep_upgrade` is set (a
/// WebSocket handshake being passed through) `Connection: upgrade` and `Upgrade` stay.
///
/// Returns false when the message carried none of them (nothing was removed).
pub fn remove_hop_by_hop(headers: &mut HeaderMap, keep_upgrade: bool) -> bool {
    // Most messages carry none of these: one pass over the names (cheap comparisons for
    // standard headers) spares a dozen hashed removals per message.
    if !headers.keys().any(is_hop_by_hop) {
        if keep_upgrade {
            headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        }
        return false;
    }
    if headers.contains_key(header::CONNECTION) {
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
            .collect();
        for n in named {
            if keep_upgrade && n == header::UPGRADE {
                continue;
            }
            headers.remove(n);
        }
        headers.remove(header::CONNECTION);
    }
    headers.remove(&KEEP_ALIVE);
    headers.remove(header::TE);
    headers.remove(header::TRAILER);
    headers.remove(header::TRANSFER_ENCODING);
    headers.remove(header::PROXY_AUTHENTICATE);
    headers.remove(header::PROXY_AUTHORIZATION);
    headers.remove(&PROXY_CONNECTION);
    if keep_upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    } else {
        headers.remove(header::UPGRADE);
    }
    true
}

fn is_hop_by_hop(n: &HeaderName) -> bool {
    n == header::CONNECTION
        || n == header::TE
        || n == header::TRAILER
        || n == header::TRANSFER_ENCODING
        || n == header::UPGRADE
        || n == header::PROXY_AUTHENTICATE
        || n == header::PROXY_AUTHORIZATION
        || n == KEEP_ALIVE
        || n == PROXY_CONNECTION
}

/// The client's address as header text, rendered once per connection (see [`add_forwarded`]).
pub fn client_addr_value(client: IpAddr) -> HeaderValue {
    // An address's text is always a valid header value.
    HeaderValue::try_from(client.to_string()).unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// Adds `Via`, and `X-Forwarded-For/-Proto/-Host` the way nginx and Envoy do: the client
/// address (`client`, from [`client_addr_value`]) appended to any existing X-Forwarded-For.
pub fn add_forwarded(
    headers: &mut HeaderMap,
    version: http::Version,
    client: &HeaderValue,
    tls: bool,
    host: Option<&HeaderValue>,
) {
    let via = match version {
        http::Version::HTTP_2 => "2 tailgate",
        http::Version::HTTP_10 => "1.0 tailgate",
        _ => "1.1 tailgate",
    };
    headers.append(header::VIA, HeaderValue::from_static(via));

    // One lookup; without an earlier X-Forwarded-For (the usual case) the connection's
    // rendered address is shared, not formatted again.
    match headers.entry(&X_FORWARDED_FOR) {
        Entry::Vacant(e) => {
            e.insert(client.clone());
        }
        Entry::Occupied(mut e) => {
            let v = match e.get().to_str() {
                Ok(prev) => {
                    // One allocation, handed to the header value without a copy.
                    let mut xff = String::with_capacity(prev.len() + 2 + client.len());
                    xff.push_str(prev);
                    xff.push_str(", ");
                    xff.push_str(client.to_str().unwrap_or_default());
                    HeaderValue::from_maybe_shared(bytes::Bytes::from(xff))
                        .unwrap_or_else(|_| client.clone())
                }
                Err(_) => client.clone(),
            };
            e.insert(v);
        }
    }
    headers.insert(
        &X_FORWARDED_PROTO,
        HeaderValue::from_static(if tls { "https" } else { "http" }),
    );
    if let Some(h) = host {
        headers.insert(&X_FORWARDED_HOST, h.clone());
    }
}

/// Does this request ask for a protocol upgrade (WebSocket)?
pub fn wants_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE) && connection_has(headers, "upgrade")
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

/// Request ids: a random per-process prefix and a counter, 24 hex digits; unique without
/// coordination between workers or processes.
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
    }

    #[test]
    fn forwarded_for_is_set_or_appended() {
        let client = client_addr_value(IpAddr::from([192, 0, 2, 7]));
        let mut h = HeaderMap::new();
        add_forwarded(&mut h, http::Version::HTTP_11, &client, false, None);
        assert_eq!(h["x-forwarded-for"], "192.0.2.7");
        assert_eq!(h["x-forwarded-proto"], "http");
        assert_eq!(h["via"], "1.1 tailgate");
        assert!(!h.contains_key("x-forwarded-host"));

        let mut h = HeaderMap::new();
        h.append("x-forwarded-for", HeaderValue::from_static("10.0.0.1"));
        h.append("x-forwarded-for", HeaderValue::from_static("10.0.0.2"));
        let host = HeaderValue::from_static("api.test");
        add_forwarded(&mut h, http::Version::HTTP_2, &client, true, Some(&host));
        let xff: Vec<_> = h.get_all("x-forwarded-for").iter().collect();
        assert_eq!(xff, ["10.0.0.1, 192.0.2.7"]);
        assert_eq!(h["x-forwarded-proto"], "https");
        assert_eq!(h["x-forwarded-host"], "api.test");
        assert_eq!(h["via"], "2 tailgate");

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
