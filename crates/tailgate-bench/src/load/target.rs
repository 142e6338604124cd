//! Turning URLs into what connections use: the socket address to connect to, the TLS server
//! name, and each request pre-built once (HTTP/1.1 bytes, HTTP/2 parts), never per request.

use std::net::{SocketAddr, ToSocketAddrs};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method, Uri};

use super::LoadError;

/// One URL to load, already parsed.
#[derive(Clone, Debug)]
pub struct Url {
    pub tls: bool,
    pub host: String,
    pub port: u16,
    /// `host[:port]` as it goes in the Host header / `:authority`.
    pub authority: String,
    pub path_and_query: String,
}

impl Url {
    pub fn parse(s: &str) -> Result<Url, LoadError> {
        let bad = |why: &str| LoadError::Url(format!("{s}: {why}"));
        let uri: Uri = s.parse().map_err(|e| bad(&format!("{e}")))?;
        let tls = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            Some(other) => return Err(bad(&format!("unsupported scheme {other:?}"))),
            None => return Err(bad("needs a scheme (http:// or https://)")),
        };
        let authority = uri.authority().ok_or_else(|| bad("needs a host"))?;
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        if host.is_empty() {
            return Err(bad("needs a host"));
        }
        let port = authority.port_u16().unwrap_or(if tls { 443 } else { 80 });
        let path_and_query = uri
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| "/".to_string());
        Ok(Url {
            tls,
            host: host.to_string(),
            port,
            authority: authority.as_str().to_string(),
            path_and_query,
        })
    }

    fn resolve(&self) -> Result<SocketAddr, LoadError> {
        (self.host.as_str(), self.port)
            .to_socket_addrs()
            .map_err(|e| LoadError::Url(format!("cannot resolve {}: {e}", self.host)))?
            .next()
            .ok_or_else(|| LoadError::Url(format!("{} resolves to no address", self.host)))
    }
}

/// What is sent, the same for every URL: method, extra headers and body.
#[derive(Clone, Debug)]
pub struct RequestTemplate {
    pub method: Method,
    pub headers: Vec<(HeaderName, HeaderValue)>,
    pub body: Bytes,
}

/// One request, built once.
#[derive(Clone, Debug)]
pub struct Prepared {
    /// The complete HTTP/1.1 request: head and body.
    pub h1: Bytes,
    /// The HTTP/2 request parts (the body is [`RequestTemplate::body`]).
    pub h2_uri: Uri,
    pub h2_headers: http::HeaderMap,
    pub method: Method,
    pub body: Bytes,
}

/// URLs that share a socket address and scheme: a connection belongs to one group and
/// round-robins over its requests.
#[derive(Clone, Debug)]
pub struct Group {
    pub addr: SocketAddr,
    pub tls: bool,
    /// The TLS server name (SNI) for the group's connections.
    pub server_name: String,
    pub requests: Vec<Prepared>,
}

/// Groups URLs by (address, scheme), keeping the URLs' order within a group.
pub fn group(urls: &[Url], tpl: &RequestTemplate) -> Result<Vec<Group>, LoadError> {
    let mut groups: Vec<Group> = Vec::new();
    for u in urls {
        let addr = u.resolve()?;
        let prepared = prepare(u, tpl)?;
        match groups.iter_mut().find(|g| g.addr == addr && g.tls == u.tls) {
            Some(g) => g.requests.push(prepared),
            None => groups.push(Group {
                addr,
                tls: u.tls,
                server_name: u.host.clone(),
                requests: vec![prepared],
            }),
        }
    }
    Ok(groups)
}

fn prepare(u: &Url, tpl: &RequestTemplate) -> Result<Prepared, LoadError> {
    let has = |name: &str| tpl.headers.iter().any(|(k, _)| k.as_str() == name);
    let mut h1 = Vec::with_capacity(128 + tpl.body.len());
    h1.extend_from_slice(tpl.method.as_str().as_bytes());
    h1.push(b' ');
    h1.extend_from_slice(u.path_and_query.as_bytes());
    h1.extend_from_slice(b" HTTP/1.1\r\n");
    if !has("host") {
        h1.extend_from_slice(b"Host: ");
        h1.extend_from_slice(u.authority.as_bytes());
        h1.extend_from_slice(b"\r\n");
    }
    for (k, v) in &tpl.headers {
        h1.extend_from_slice(k.as_str().as_bytes());
        h1.extend_from_slice(b": ");
        h1.extend_from_slice(v.as_bytes());
        h1.extend_from_slice(b"\r\n");
    }
    let body_allowed =
        !tpl.body.is_empty() || matches!(tpl.method, Method::POST | Method::PUT | Method::PATCH);
    if body_allowed && !has("content-length") && !has("transfer-encoding") {
        h1.extend_from_slice(format!("Content-Length: {}\r\n", tpl.body.len()).as_bytes());
    }
    h1.extend_from_slice(b"\r\n");
    h1.extend_from_slice(&tpl.body);

    let scheme = if u.tls { "https" } else { "http" };
    let h2_uri: Uri = format!("{scheme}://{}{}", u.authority, u.path_and_query)
        .parse()
        .map_err(|e| LoadError::Url(format!("{}: {e}", u.authority)))?;
    let mut h2_headers = http::HeaderMap::new();
    for (k, v) in &tpl.headers {
        // HTTP/2 forbids connection-specific headers; Host becomes :authority via the URI.
        if !matches!(
            k.as_str(),
            "connection" | "keep-alive" | "transfer-encoding" | "upgrade" | "proxy-connection"
        ) {
            h2_headers.append(k.clone(), v.clone());
        }
    }
    Ok(Prepared {
        h1: Bytes::from(h1),
        h2_uri,
        h2_headers,
        method: tpl.method.clone(),
        body: tpl.body.clone(),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls() {
        let u = Url::parse("http://127.0.0.1:8080/a?b=1").unwrap();
        assert_eq!(
            (u.tls, u.port, u.path_and_query.as_str()),
            (false, 8080, "/a?b=1")
        );
        let u = Url::parse("https://localhost").unwrap();
        assert_eq!((u.tls, u.port, u.path_and_query.as_str()), (true, 443, "/"));
        assert!(Url::parse("ftp://x/").is_err());
        assert!(Url::parse("127.0.0.1:80/").is_err());
    }

    #[test]
    fn serializes_h1_once() {
        let u = Url::parse("http://127.0.0.1:1/x").unwrap();
        let tpl = RequestTemplate {
            method: Method::POST,
            headers: vec![(
                HeaderName::from_static("x-a"),
                HeaderValue::from_static("b"),
            )],
            body: Bytes::from_static(b"hi"),
        };
        let g = group(&[u.clone(), u], &tpl).unwrap();
        assert_eq!(g.len(), 1);
        assert_eq!(g[0].requests.len(), 2);
        assert_eq!(
            &g[0].requests[0].h1[..],
            b"POST /x HTTP/1.1\r\nHost: 127.0.0.1:1\r\nx-a: b\r\nContent-Length: 2\r\n\r\nhi"
        );
    }
}
