//! Routing as the client sends it: the path matched in normal form (no `..` past a route's
//! prefix), the Host checked before it routes anything, HTTP/1.0 without Host, HEAD on a GET
//! route, TRACE refused, and the total timeout over the connect.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;

/// An upstream that answers its own name and the target it got (and the
/// `X-Forwarded-Prefix` values it got, as `x-prefix`, joined by `,`).
async fn named(name: &'static str) -> SocketAddr {
    upstream(
        move |req: http::Request<hyper::body::Incoming>| async move {
            let mut resp = http::Response::new(full(name));
            resp.headers_mut()
                .insert("x-target", req.uri().to_string().parse().unwrap());
            let prefixes: Vec<_> = req
                .headers()
                .get_all("x-forwarded-prefix")
                .iter()
                .map(|v| v.to_str().unwrap().to_owned())
                .collect();
            if !prefixes.is_empty() {
                resp.headers_mut()
                    .insert("x-prefix", prefixes.join(",").parse().unwrap());
            }
            resp
        },
    )
    .await
}

/// `/public/` goes to `public`, `/` to `web`; `/api/` takes GET only and goes to `api`.
async fn gateway() -> TestGateway {
    let (public, web, api) = (
        named("public").await,
        named("web").await,
        named("the-api").await,
    );
    TestGateway::start(&format!(
        r#"
[[cluster]]
name = "public"
endpoints = ["{public}"]
[[cluster]]
name = "web"
endpoints = ["{web}"]
[[cluster]]
name = "api"
endpoints = ["{api}"]
[[route]]
path_prefix = "/public/"
cluster = "public"
[[route]]
path_prefix = "/"
cluster = "web"
[[route]]
path_prefix = "/api/"
methods = ["GET"]
cluster = "api"
"#
    ))
}

/// One request as raw bytes; the answer's status line and body.
async fn ask(gw: &TestGateway, head: &str) -> (String, String) {
    let (text, _) = raw(gw.addr, head.as_bytes(), Duration::from_secs(5)).await;
    let status = text.lines().next().unwrap_or_default().to_owned();
    let body = text.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    (status, body)
}

fn get(target: &str) -> String {
    format!("GET {target} HTTP/1.1\r\nHost: acme.test\r\nConnection: close\r\n\r\n")
}

/// A path whose `..` (or backslash, or encoded slash) takes it out of a route's prefix
/// is refused: routed here as its normal form, it goes upstream as sent, where a server
/// that resolves no `..` (Express, Go's mux) reads it under the other route. Within one
/// route's prefix the same dots are served.
#[tokio::test]
async fn a_dot_segment_cannot_leave_its_routes_prefix() {
    let gw = gateway().await;
    for target in [
        "/public/../internal/keys",
        "/public/%2e%2e/internal/keys",
        "/public/%2E./internal/keys",
        "/public/./../internal/keys",
        // What some upstreams resolve too: `..` with an encoded slash or backslash after
        // it, a backslash.
        "/public/..%2finternal/keys",
        "/public/..%5Cinternal/keys",
        "/public/..\\internal/keys",
        // Into a route's prefix, from outside it.
        "/x/../public/y",
        // As a server reads it that resolves dots but keeps `%2F` whole (the WHATWG URL
        // parser), or decodes `%2F` but resolves no dot (uvicorn).
        "/x%2Fy/../public/z",
        "/public%2F..%2Fx",
        // Mixed separators, as a server reads them that takes a backslash for a `/` but
        // not `%2F` (the WHATWG URL parser), or the other way (nginx).
        "/internal/a%2Fb\\..\\..\\public/y",
        "/internal/a\\b%2F..%2F..%2Fpublic/y",
        "/internal/x\\..\\..\\public/y",
        "/internal/x%2F..%2F..%2Fpublic/y",
    ] {
        let (status, body) = ask(&gw, &get(target)).await;
        assert!(status.contains(" 400 "), "{target}: {status}");
        assert!(body.contains("another route"), "{target}: {body}");
    }
    // Dots that stay within the route they are read under: served, and sent upstream as
    // the client wrote them.
    for (target, route) in [
        ("/public/a/../b", "public"),
        ("/internal/./a/../keys", "web"),
        ("/public/a%2F..%2Fb", "public"),
    ] {
        let (text, _) = raw(gw.addr, get(target).as_bytes(), Duration::from_secs(5)).await;
        assert!(text.starts_with("HTTP/1.1 200 "), "{target}: {text}");
        assert!(text.ends_with(route), "{target}: {text}");
        assert!(
            text.to_ascii_lowercase()
                .contains(&format!("x-target: {}", target.to_ascii_lowercase())),
            "{text}"
        );
    }
}

/// A segment's `;` parameters do not take a path past the route its path takes in a Java
/// application server, which drops them: `/public;jsessionid=1/x` is `/public/x` there.
#[tokio::test]
async fn a_path_parameter_does_not_pass_by_its_route() {
    let gw = gateway().await;
    for target in [
        "/public;jsessionid=1/x",
        "/public;/x",
        "/;x/public/x",
        "/public/;y/x",
        // The parameter runs to the next `/` as sent, encoded dots inside it included.
        "/public;%2E%2E/x",
    ] {
        let (status, body) = ask(&gw, &get(target)).await;
        assert!(status.contains(" 200 "), "{target}: {status}");
        assert_eq!(body, "public", "{target} is /public/x upstream");
    }
    // Still sent upstream as the client wrote it.
    let (text, _) = raw(
        gw.addr,
        get("/public;jsessionid=1/x").as_bytes(),
        Duration::from_secs(5),
    )
    .await;
    assert!(
        text.to_ascii_lowercase()
            .contains("x-target: /public;jsessionid=1/x"),
        "{text}"
    );
}

#[tokio::test]
async fn encoded_and_doubled_slashes_route_as_their_normal_form() {
    let gw = gateway().await;
    for target in [
        "/%70ublic/x",
        "//public/x",
        "/public//x",
        // An encoded slash inside a segment under the prefix (an id such as GitLab's).
        "/public/group%2Fproject/issues",
        // A `%` in the query or a parameter is no escape of the path.
        "/public/x?q=100%",
        "/public;p=100%/x",
    ] {
        let (status, body) = ask(&gw, &get(target)).await;
        assert!(status.contains(" 200 "), "{target}: {status}");
        assert_eq!(body, "public", "{target}");
    }
    // An encoded slash is a slash, as nginx reads it; one that makes the route's prefix
    // (where a server that keeps it whole reads another path) is refused.
    let (status, _) = ask(&gw, &get("/public%2Fx")).await;
    assert!(status.contains(" 400 "), "{status}");
    // A `%` that starts no escape.
    let (status, body) = ask(&gw, &get("/public/50%off")).await;
    assert!(status.contains(" 400 "), "{status}");
    assert!(body.contains("two hex digits"), "{body}");
}

#[tokio::test]
async fn a_path_above_the_root_is_400() {
    let gw = gateway().await;
    for target in ["/..", "/../etc/passwd", "/a/../../b", "/%2e%2e/x"] {
        let (status, body) = ask(&gw, &get(target)).await;
        assert!(status.contains(" 400 "), "{target}: {status}");
        assert!(body.contains("bad_request"), "{target}: {body}");
    }
    // A `..` that takes off an empty segment: `/b` where slashes are merged, `/public/b`
    // by RFC 3986 and in Jetty; also further back, past a `.` or another segment.
    for target in [
        "/public//../b",
        "/public/;x/../b",
        "/public%2F%2F../b",
        "/public//./../b",
        "/public//x/../../b",
        "/internal//x/../../public/y",
    ] {
        let (status, body) = ask(&gw, &get(target)).await;
        assert!(status.contains(" 400 "), "{target}: {status}");
        assert!(body.contains("empty segment"), "{target}: {body}");
    }
    // A dot segment with `;` parameters: `..` to Tomcat, a segment of its own to nginx.
    for target in [
        "/public/..;/internal/keys",
        "/internal/..;/public/x",
        "/public/.;x/y",
        "/public/%2e%2e;/internal/keys",
    ] {
        let (status, body) = ask(&gw, &get(target)).await;
        assert!(status.contains(" 400 "), "{target}: {status}");
        assert!(body.contains("parameters"), "{target}: {body}");
    }
    // A parameter with a slash in it: `/public/x` to Tomcat, which drops the parameter
    // whole, and `/internal/x` to nginx, which decodes the slash before the `..`.
    for target in [
        "/public;%2F..%2Finternal/x",
        "/public;%2f..%2finternal/x",
        "/public;\\..\\internal/x",
        "/public;x%5C..%5Cinternal/x",
    ] {
        let (status, body) = ask(&gw, &get(target)).await;
        assert!(status.contains(" 400 "), "{target}: {status}");
        assert!(body.contains("encoded slash"), "{target}: {body}");
    }
    // An encoded NUL, which ends a path a server behind reads as a C string.
    for target in ["/public/a%00.txt", "/%00"] {
        let (status, body) = ask(&gw, &get(target)).await;
        assert!(status.contains(" 400 "), "{target}: {status}");
        assert!(body.contains("NUL"), "{target}: {body}");
    }
}

/// A reserved character's escape is matched as the character, as nginx and the
/// frameworks behind it decode it: `%3A` is `:`.
#[tokio::test]
async fn an_escaped_reserved_character_routes_as_itself() {
    let (web, purge) = (named("web").await, named("purge").await);
    let gw = TestGateway::start(&format!(
        r#"
[[cluster]]
name = "web"
endpoints = ["{web}"]
[[cluster]]
name = "purge"
endpoints = ["{purge}"]
[[route]]
path_prefix = "/"
cluster = "web"
[[route]]
path_prefix = "/v1/items:purge"
cluster = "purge"
"#
    ));
    for target in [
        "/v1/items:purge",
        "/v1/items%3Apurge",
        "/v1/items%3apurge",
        "/v1/items%3Apurge;x",
    ] {
        let (status, body) = ask(&gw, &get(target)).await;
        assert!(status.contains(" 200 "), "{target}: {status}");
        assert_eq!(body, "purge", "{target}");
    }
    // An escaped `;`, `?` or `#` stays one: it would change the path's structure.
    for target in ["/v1/items%3Bpurge", "/v1/items%3Fpurge"] {
        let (_, body) = ask(&gw, &get(target)).await;
        assert_eq!(body, "web", "{target}");
    }
}

#[tokio::test]
async fn a_host_that_is_not_host_and_port_is_400() {
    let gw = gateway().await;
    for host in [
        "acme.test:@evil.example",
        "acme.test/x",
        "acme..test",
        "acme.test:80x",
        "acme.test:80:80",
        "[::1",
        "a b",
        // No host: empty, or a port alone.
        "",
        ":8080",
    ] {
        let head = format!("GET /x HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
        let (status, body) = ask(&gw, &head).await;
        assert!(status.contains(" 400 "), "Host {host:?}: {status}");
        assert!(body.contains("invalid Host header"), "{body}");
    }
    for host in [
        "acme.test",
        "acme.test:8080",
        "[::1]:80",
        "ACME.test.",
        "a_b.test",
    ] {
        let head = format!("GET /x HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
        let (status, _) = ask(&gw, &head).await;
        assert!(status.contains(" 200 "), "Host {host:?}: {status}");
    }
}

/// An absolute-form target's authority routes the request and goes upstream as its Host, so
/// it is held to the Host header's rules: a host:port shape, a host, no `user@`; and an
/// HTTP/1.1 request needs a Host header all the same (RFC 9112 §3.2), HTTP/1.0 does not.
#[tokio::test]
async fn an_absolute_form_authority_is_held_to_the_host_rules() {
    let gw = gateway().await;
    let target = "invalid host in the request target";
    for (head, says) in [
        (
            "GET http://acme.test/public/a HTTP/1.1\r\nConnection: close\r\n\r\n",
            "no Host header",
        ),
        (
            "GET http://x..acme.test/public/a HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            target,
        ),
        (
            "GET http://:80/public/a HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
            target,
        ),
        (
            "GET http://u@acme.test/public/a HTTP/1.1\r\nHost: acme.test\r\nConnection: close\r\n\r\n",
            target,
        ),
        // The Host header beside it is held to its own rules all the same.
        (
            "GET http://acme.test/public/a HTTP/1.1\r\nHost: a b\r\nConnection: close\r\n\r\n",
            "invalid Host header",
        ),
        (
            "GET http://acme.test/public/a HTTP/1.1\r\nHost: :80\r\nConnection: close\r\n\r\n",
            "invalid Host header",
        ),
    ] {
        let (status, body) = ask(&gw, head).await;
        assert!(status.contains(" 400 "), "{head:?}: {status}");
        assert!(body.contains(says), "{head:?}: {body}");
    }
    for head in [
        "GET http://acme.test/public/a HTTP/1.1\r\nHost: other.test\r\nConnection: close\r\n\r\n",
        "GET http://ACME.test:8080/public/a HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "GET http://[::1]:80/public/a HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "GET http://acme.test/public/a HTTP/1.0\r\n\r\n",
    ] {
        let (status, body) = ask(&gw, head).await;
        assert!(status.contains(" 200 "), "{head:?}: {status}");
        assert_eq!(body, "public", "{head:?}");
    }
}

#[tokio::test]
async fn http10_without_host_is_routed() {
    let gw = gateway().await;
    let (status, body) = ask(&gw, "OPTIONS /public/ping HTTP/1.0\r\n\r\n").await;
    assert!(status.contains(" 200 "), "{status}");
    assert_eq!(body, "public");
    let (status, _) = ask(&gw, "GET / HTTP/1.1\r\nConnection: close\r\n\r\n").await;
    assert!(
        status.contains(" 400 "),
        "HTTP/1.1 still needs a Host: {status}"
    );
}

#[tokio::test]
async fn head_takes_the_route_of_get() {
    let gw = gateway().await;
    let (text, _) = raw(
        gw.addr,
        b"HEAD /api/items HTTP/1.1\r\nHost: acme.test\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(text.starts_with("HTTP/1.1 200 "), "{text}");
    // The `api` upstream's answer to HEAD: its length (7, "the-api"), no body; `web`'s
    // would say 3.
    assert!(
        text.to_ascii_lowercase().contains("content-length: 7\r\n"),
        "{text}"
    );
    let (status, body) = ask(
        &gw,
        "POST /api/items HTTP/1.1\r\nHost: acme.test\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(status.contains(" 200 "), "{status}");
    assert_eq!(body, "web", "POST falls through to `/`");
}

/// A route with a host is found by its host whatever its tenant: a route naming HEAD for
/// that host and prefix takes HEAD from a tenant's GET route there too (it was never
/// reached).
#[tokio::test]
async fn a_head_route_for_a_host_takes_head_from_a_tenants_get_route() {
    let (get_up, head_up) = (named("get").await, named("head-route").await);
    let gw = TestGateway::start(&format!(
        r#"
[[tenant]]
name = "t"
hosts = ["a.test"]
[[cluster]]
name = "get"
endpoints = ["{get_up}"]
[[cluster]]
name = "head"
endpoints = ["{head_up}"]
[[route]]
tenant = "t"
host = "a.test"
path_prefix = "/"
methods = ["GET"]
cluster = "get"
[[route]]
host = "a.test"
path_prefix = "/"
methods = ["HEAD"]
cluster = "head"
"#
    ));
    let (text, _) = raw(
        gw.addr,
        b"HEAD /x HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    // `head-route`'s length (10), not `get`'s (3).
    assert!(
        text.to_ascii_lowercase().contains("content-length: 10\r\n"),
        "{text}"
    );
    let (status, body) = ask(
        &gw,
        "GET /x HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(status.contains(" 200 "), "{status}");
    assert_eq!(body, "get");
}

#[tokio::test]
async fn trace_is_405_unless_a_route_lists_it() {
    let gw = gateway().await;
    let (text, _) = raw(
        gw.addr,
        b"TRACE /x HTTP/1.1\r\nHost: acme.test\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(text.starts_with("HTTP/1.1 405 "), "{text}");
    assert!(
        text.to_ascii_lowercase()
            .contains("allow: delete, get, head, options, patch, post, put\r\n"),
        "{text}"
    );
    let up = named("tracer").await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/\"\nmethods = [\"TRACE\"]\ncluster = \"up\"\n"
    ));
    let (status, body) = ask(
        &gw,
        "TRACE /x HTTP/1.1\r\nHost: acme.test\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(status.contains(" 200 "), "{status}");
    assert_eq!(body, "tracer");
}

/// The total timeout bounds the connect too: a connect that hangs (the upstream's backlog
/// full) gets the route's `504 upstream_timeout` at the total deadline, not the cluster's
/// `upstream_connect_timeout` ten seconds later.
#[tokio::test]
async fn the_total_timeout_bounds_the_connect() {
    let (sock, up, _fillers) = unanswering_listener().await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\nconnect_timeout = \"10s\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\ntotal_timeout = \"300ms\"\n"
    ));
    let (status, body) = ask(&gw, &get("/")).await;
    assert!(status.contains(" 504 "), "{status}");
    assert!(body.contains("\"upstream_timeout\""), "{body}");
    drop(sock);
}

/// `rewrite_prefix`: the matched prefix is replaced in the path sent upstream (in normal
/// form, as it was matched), the query kept as sent, and `X-Forwarded-Prefix` says what it
/// was; HTTP/1.1 and HTTP/2 alike. A route without it sends the target as the client did.
#[tokio::test]
async fn a_rewrite_prefix_replaces_the_matched_prefix() {
    let (billing, api, web) = (
        named("billing").await,
        named("the-api").await,
        named("web").await,
    );
    let gw = TestGateway::start(&format!(
        r#"
[[cluster]]
name = "billing"
endpoints = ["{billing}"]
[[cluster]]
name = "api"
endpoints = ["{api}"]
[[cluster]]
name = "web"
endpoints = ["{web}"]
[[route]]
path_prefix = "/billing/"
rewrite_prefix = "/"
cluster = "billing"
[[route]]
path_prefix = "/v1"
rewrite_prefix = "/api/v1"
cluster = "api"
[[route]]
path_prefix = "/old"
rewrite_prefix = "/new/"
cluster = "api"
[[route]]
path_prefix = "/"
cluster = "web"
"#
    ));
    for (target, to, upstream, prefix) in [
        (
            "/billing/invoices?x=1&y=%20",
            "/invoices?x=1&y=%20",
            "billing",
            Some("/billing"),
        ),
        ("/billing/", "/", "billing", Some("/billing")),
        (
            "/billing/./a;v=2/b%2Fc/../d",
            "/a/b/d",
            "billing",
            Some("/billing"),
        ),
        ("/v1", "/api/v1", "the-api", Some("/v1")),
        ("/v1/users/7", "/api/v1/users/7", "the-api", Some("/v1")),
        ("/old", "/new/", "the-api", Some("/old")),
        ("/old/x", "/new/x", "the-api", Some("/old")),
        // The path goes up in its normal form: escapes of what may stand raw decoded, as
        // nginx's `proxy_pass` with a URI sends them, but what RFC 3986 allows in no path
        // (`|`); others kept.
        (
            "/old/a%2Bb%3D%7C/%20%25",
            "/new/a+b=%7C/%20%25",
            "the-api",
            Some("/old"),
        ),
        ("/x/./y?q", "/x/./y?q", "web", None),
        // Without a rewrite, the target as the client sent it.
        ("/x/a%2Bb", "/x/a%2Bb", "web", None),
    ] {
        let resp = common::get(gw.addr, target).await;
        assert_eq!(resp.status(), 200, "{target}");
        assert_eq!(resp.body().as_ref(), upstream.as_bytes(), "{target}");
        assert_eq!(resp.headers()["x-target"], to, "{target}");
        assert_eq!(
            resp.headers().get("x-prefix").map(|v| v.to_str().unwrap()),
            prefix,
            "{target}"
        );
    }
    // The client's own X-Forwarded-Prefix is replaced where the gateway sets one, and
    // passed on where it does not.
    let (text, _) = raw(
        gw.addr,
        b"GET /billing/a HTTP/1.1\r\nHost: a\r\nX-Forwarded-Prefix: /evil\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(text.contains("x-prefix: /billing\r\n"), "{text}");
    let (text, _) = raw(
        gw.addr,
        b"GET /web HTTP/1.1\r\nHost: a\r\nX-Forwarded-Prefix: /edge\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(text.contains("x-prefix: /edge\r\n"), "{text}");
    // `old..` is no dot segment, so `/old../x` matches `/old`; joined to `/new/` it would
    // climb out of it upstream (`/new/../x`): refused.
    for target in [
        "/old../secret",
        "/old%2E%2E/secret",
        "/old..;x/secret",
        "/old.",
    ] {
        let resp = common::get(gw.addr, target).await;
        assert_eq!(resp.status(), 400, "{target}");
    }
    let (mut c, _conn) = h2c_client(gw.addr).await;
    let req = http::Request::get("http://acme.test/billing/h2?z=1")
        .body(full(""))
        .unwrap();
    let resp = c.send_request(req).await.unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(resp.headers()["x-target"], "/h2?z=1");
    assert_eq!(resp.headers()["x-prefix"], "/billing");
}

/// An upstream that answers the Host (HTTP/1.1) or `:authority` (HTTP/2) it got as `x-host`,
/// its `X-Forwarded-Host` as `x-fwd-host` and its target's path as `x-path`; h2c by prior
/// knowledge with `h2`.
async fn host_echo(h2: bool) -> SocketAddr {
    let answer = |req: http::Request<hyper::body::Incoming>| {
        let host = req
            .uri()
            .authority()
            .map(|a| a.as_str().to_owned())
            .or_else(|| {
                req.headers()
                    .get("host")
                    .map(|h| h.to_str().unwrap().to_owned())
            })
            .unwrap_or_default();
        let hosts = req.headers().get_all("host").iter().count();
        let mut resp = http::Response::new(full(format!("hosts={hosts}")));
        resp.headers_mut().insert("x-host", host.parse().unwrap());
        if let Some(f) = req.headers().get("x-forwarded-host") {
            resp.headers_mut().insert("x-fwd-host", f.clone());
        }
        resp.headers_mut()
            .insert("x-path", req.uri().path().parse().unwrap());
        resp
    };
    if !h2 {
        return upstream(move |req| async move { answer(req) }).await;
    }
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = l.accept().await {
            let svc = hyper::service::service_fn(move |req| async move {
                Ok::<_, std::convert::Infallible>(answer(req))
            });
            tokio::spawn(
                hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .serve_connection(hyper_util::rt::TokioIo::new(tcp), svc),
            );
        }
    });
    addr
}

/// `host_rewrite`: the upstream gets that Host (HTTP/2: `:authority`) in place of the
/// client's, once, and `X-Forwarded-Host` still says what the client asked for; with a
/// `rewrite_prefix` too, both apply. A route without it sends the client's Host.
#[tokio::test]
async fn a_host_rewrite_replaces_the_host_sent_upstream() {
    let (h1, h2) = (host_echo(false).await, host_echo(true).await);
    let gw = TestGateway::start(&format!(
        r#"
[[cluster]]
name = "h1"
endpoints = ["{h1}"]
[[cluster]]
name = "h2"
endpoints = ["{h2}"]
protocol = "http2"
[[route]]
path_prefix = "/svc/"
host_rewrite = "api.internal:8443"
cluster = "h1"
[[route]]
path_prefix = "/both/"
rewrite_prefix = "/"
host_rewrite = "[::1]:9000"
cluster = "h1"
[[route]]
path_prefix = "/two/"
host_rewrite = "svc.internal"
cluster = "h2"
[[route]]
path_prefix = "/"
cluster = "h1"
"#
    ));
    for (target, host, path) in [
        ("/svc/a", "api.internal:8443", "/svc/a"),
        ("/both/x/y", "[::1]:9000", "/x/y"),
        ("/two/z", "svc.internal", "/two/z"),
        ("/plain", "client.example", "/plain"),
    ] {
        // The client's Host, sent in capitals and named by a `Connection` header too (so
        // the gateway puts it back after the hop-by-hop headers go).
        let req = format!(
            "GET {target} HTTP/1.1\r\nHost: client.example\r\nConnection: close, host\r\n\r\n"
        );
        let (text, _) = raw(gw.addr, req.as_bytes(), Duration::from_secs(5)).await;
        assert!(text.starts_with("HTTP/1.1 200 "), "{target}: {text}");
        assert!(
            text.contains(&format!("x-host: {host}\r\n")),
            "{target}: {text}"
        );
        assert!(
            text.contains(&format!("x-path: {path}\r\n")),
            "{target}: {text}"
        );
        assert!(
            text.contains("x-fwd-host: client.example\r\n"),
            "{target}: {text}"
        );
        // HTTP/2 carries it as `:authority` alone, with no Host header beside it.
        let hosts = if target.starts_with("/two/") { 0 } else { 1 };
        assert!(
            text.ends_with(&format!("hosts={hosts}")),
            "{target}: {text}"
        );
    }
    // From an HTTP/2 client (its `:authority`, no Host header) to both upstreams.
    let (mut c, _conn) = h2c_client(gw.addr).await;
    for (uri, host) in [
        ("http://acme.test/svc/h2", "api.internal:8443"),
        ("http://acme.test/two/h2", "svc.internal"),
        ("http://acme.test/h2", "acme.test"),
    ] {
        let resp = c
            .send_request(http::Request::get(uri).body(full("")).unwrap())
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{uri}");
        assert_eq!(resp.headers()["x-host"], host, "{uri}");
        assert_eq!(resp.headers()["x-fwd-host"], "acme.test", "{uri}");
    }
}

/// A path with non-ASCII characters takes one route however the client spells them: raw
/// UTF-8 (`/é/`) or escaped (`/%C3%A9/`, `/%c3%a9/`), against a prefix written escaped (as
/// `check` asks). It goes upstream as it was sent.
#[tokio::test]
async fn raw_and_escaped_utf8_take_the_same_route() {
    let (accents, web) = (named("accents").await, named("web").await);
    let gw = TestGateway::start(&format!(
        r#"
[[cluster]]
name = "accents"
endpoints = ["{accents}"]
[[cluster]]
name = "web"
endpoints = ["{web}"]
[[route]]
path_prefix = "/%C3%A9/"
cluster = "accents"
[[route]]
path_prefix = "/"
cluster = "web"
"#
    ));
    for target in ["/é/x", "/%C3%A9/x", "/%c3%a9/x", "/%C3%A9/./x"] {
        let (status, body) = ask(&gw, &get(target)).await;
        assert!(status.contains("200"), "{target}: {status}");
        assert_eq!(body, "accents", "{target}");
    }
    // A `.` before the prefix: under `/` to a server that resolves no dot segment.
    let (status, _) = ask(&gw, &get("/./é/x")).await;
    assert!(status.contains(" 400 "), "{status}");
    let (text, _) = raw(gw.addr, get("/é/x").as_bytes(), Duration::from_secs(5)).await;
    assert!(
        text.contains("x-target: /é/x\r\n"),
        "sent as it came: {text}"
    );
    assert_eq!(ask(&gw, &get("/ü/x")).await.1, "web");
}
