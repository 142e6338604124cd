//! Proxy semantics: forwarding, streaming both ways, headers, HEAD, 100-continue, h1/h2.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[tokio::test]
async fn forwards_and_adds_proxy_headers() {
    let up = echo_upstream().await;
    let gw = TestGateway::to(up, "");
    let mut c = h1_client(gw.addr).await;
    let req = http::Request::get("/a/b?x=1")
        .header("host", "api.test:8080")
        .header("x-forwarded-for", "10.0.0.1")
        .header("connection", "x-private")
        .header("x-private", "secret")
        .header("keep-alive", "timeout=5")
        .header("proxy-authorization", "Basic Zm9v")
        .header("proxy", "http://evil.test:8080")
        .header("proxy-anything", "x")
        .header("proxyish", "kept")
        .header("proxy-status", "upstream-proxy; error=none")
        .header("te", "trailers")
        .header("trailer", "x-t")
        .header("x-forwarded-proto", "https")
        .body(full(""))
        .unwrap();
    let resp = c.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let h = resp.headers();
    assert_eq!(h["x-echo-uri"], "/a/b?x=1");
    // The client's X-Forwarded-Proto is replaced, not added to.
    let proto: Vec<_> = h.get_all("x-echo-x-forwarded-proto").iter().collect();
    assert_eq!(proto, ["http"]);
    assert_eq!(h["x-echo-host"], "api.test:8080");
    assert_eq!(h["x-echo-x-forwarded-for"], "10.0.0.1, 127.0.0.1");
    assert_eq!(h["x-echo-x-forwarded-proto"], "http");
    assert_eq!(h["x-echo-x-forwarded-host"], "api.test:8080");
    assert_eq!(h["x-echo-via"], "1.1 tailgate");
    for gone in [
        "x-echo-x-private",
        "x-echo-keep-alive",
        "x-echo-proxy-authorization",
        "x-echo-proxy",
        "x-echo-proxy-anything",
        "x-echo-te",
        "x-echo-trailer",
        "x-echo-connection",
    ] {
        assert!(!h.contains_key(gone), "{gone} must not reach the upstream");
    }
    assert_eq!(
        h["x-echo-proxyish"], "kept",
        "only `Proxy` and `Proxy-*` are removed"
    );
    assert_eq!(
        h["x-echo-proxy-status"], "upstream-proxy; error=none",
        "Proxy-Status (RFC 9209) is passed on"
    );
    let id = h["x-request-id"].to_str().unwrap().to_owned();
    assert_eq!(
        h["x-echo-x-request-id"],
        id.as_str(),
        "the upstream sees the same request id"
    );
    assert_eq!(id.len(), 24);
}

/// An HTTP/1.0 request may name no host: the client's `X-Forwarded-Host` is dropped all the
/// same, never passed on as if the gateway had set it.
#[tokio::test]
async fn a_clients_forwarded_host_never_reaches_the_upstream() {
    let up = echo_upstream().await;
    let gw = TestGateway::to(up, "");
    let (resp, _) = raw(
        gw.addr,
        b"GET /x HTTP/1.0\r\nX-Forwarded-Host: evil.test\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(
        resp.starts_with("HTTP/1.0 200") || resp.starts_with("HTTP/1.1 200"),
        "{resp}"
    );
    assert!(
        !resp
            .to_ascii_lowercase()
            .contains("x-echo-x-forwarded-host"),
        "{resp}"
    );
    // With a host, the gateway's own value replaces the client's.
    let (resp, _) = raw(
        gw.addr,
        b"GET /x HTTP/1.0\r\nHost: api.test\r\nX-Forwarded-Host: evil.test\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    let lower = resp.to_ascii_lowercase();
    assert!(
        lower.contains("x-echo-x-forwarded-host: api.test\r\n"),
        "{resp}"
    );
    assert!(!lower.contains("evil"), "{resp}");
}

/// A gateway whose `/one` goes to an HTTP/1.1 upstream that echoes the request's headers
/// as `x-echo-*` response headers, and `/two` to an HTTP/2 one that lists them in its body.
async fn echo_gateway_both_protocols() -> TestGateway {
    let h1 = echo_upstream().await;
    let h2 = h2c_upstream_with(|req: http::Request<hyper::body::Incoming>| async move {
        let seen: Vec<String> = req
            .headers()
            .iter()
            .map(|(k, v)| format!("{k}={}", String::from_utf8_lossy(v.as_bytes())))
            .collect();
        http::Response::new(full(seen.join("\n")))
    })
    .await;
    TestGateway::start(&format!(
        "[[cluster]]\nname = \"h1\"\nendpoints = [\"{h1}\"]\n\
         [[cluster]]\nname = \"h2\"\nendpoints = [\"{h2}\"]\nprotocol = \"http2\"\n\
         [[route]]\npath_prefix = \"/two\"\ncluster = \"h2\"\n\
         [[route]]\npath_prefix = \"/\"\ncluster = \"h1\"\n"
    ))
}

/// A client's `Forwarded`, `X-Forwarded-Port` and other claims only a proxy may make
/// (`X-Forwarded-Ssl`, `X-Forwarded-Scheme`, `X-Real-IP`, `True-Client-IP`) never reach the
/// upstream, over either upstream protocol: frameworks take a host, scheme, port or client
/// address from them before (or beside) the `X-Forwarded-*` the gateway writes, so a
/// client's would pass for the gateway's word. Its `X-Forwarded-Prefix` goes on.
#[tokio::test]
async fn a_clients_forwarded_and_forwarded_port_never_reach_the_upstream() {
    claims_never_reach_the_upstream(
        "Forwarded: for=6.6.6.6;host=evil.test;proto=https\r\n\
         X-Forwarded-Port: 6666\r\nX-Forwarded-Ssl: on\r\nX-Forwarded-Scheme: https\r\n\
         X-Real-IP: 6.6.6.7\r\nTrue-Client-IP: 6.6.6.8\r\nX-Forwarded-Prefix: /kept\r\n",
        &[
            "evil.test",
            "6.6.6.",
            // (Not the port's value, `6666`: a random request id or port may hold it.)
            "forwarded: ",
            "forwarded=",
            "x-forwarded-port",
            "x-forwarded-ssl",
            "x-forwarded-scheme",
            "x-real-ip",
            "true-client-ip",
        ],
    )
    .await;
}

/// The same claims spelled with `_` for `-` (`X_Real_IP`, `X-Forwarded_Ssl`): a CGI-style
/// upstream (Rack, uWSGI, PHP) reads them as the `HTTP_X_REAL_IP` and `HTTP_X_FORWARDED_SSL`
/// the hyphenated ones make, so they never reach it either, over either upstream protocol;
/// nor does a second request id so spelled. Before, they went on as the client wrote them.
#[tokio::test]
async fn a_clients_claims_spelled_with_underscores_never_reach_the_upstream() {
    claims_never_reach_the_upstream(
        "X_Real_IP: 6.6.6.7\r\nTrue_Client_IP: 6.6.6.8\r\nX-Forwarded_Ssl: on\r\n\
         X_Forwarded_Port: 6666\r\nX-Forwarded_Host: evil.test\r\nX_FORWARDED_FOR: 6.6.6.9\r\n\
         X_Request_Id: spoofed-id\r\nX_Forwarded_Prefix: /kept\r\n",
        &[
            "evil.test",
            "6.6.6.",
            "spoofed-id",
            "real_ip",
            "client_ip",
            "forwarded_ssl",
            "forwarded_port",
        ],
    )
    .await;
}

/// A GET with `headers` (each line ended) to both upstream protocols: the gateway's own
/// `X-Forwarded-Host` reaches the upstream (the headers were seen at all), and so does the
/// client's `/kept` prefix, but nothing in `gone`.
async fn claims_never_reach_the_upstream(headers: &str, gone: &[&str]) {
    let gw = echo_gateway_both_protocols().await;
    for path in ["/one", "/two"] {
        let req =
            format!("GET {path} HTTP/1.1\r\nHost: api.test\r\n{headers}Connection: close\r\n\r\n");
        let (resp, _) = raw(gw.addr, req.as_bytes(), Duration::from_secs(5)).await;
        let lower = resp.to_ascii_lowercase();
        assert!(lower.starts_with("http/1.1 200"), "{resp}");
        assert!(
            lower.contains("x-forwarded-host") && lower.contains("api.test"),
            "{resp}"
        );
        assert!(lower.contains("/kept"), "{resp}");
        for gone in gone {
            assert!(
                !lower.contains(gone),
                "{path}: {gone:?} reached the upstream: {resp}"
            );
        }
    }
}

#[tokio::test]
async fn keeps_the_clients_request_id() {
    let up = echo_upstream().await;
    let gw = TestGateway::to(up, "");
    let mut c = h1_client(gw.addr).await;
    let req = http::Request::get("/")
        .header("host", "a")
        .header("x-request-id", "client-id-42")
        .body(full(""))
        .unwrap();
    let resp = c.send_request(req).await.unwrap();
    assert_eq!(resp.headers()["x-request-id"], "client-id-42");
    assert_eq!(resp.headers()["x-echo-x-request-id"], "client-id-42");
}

#[tokio::test]
async fn removes_hop_by_hop_headers_from_responses() {
    let up = upstream(|_| async {
        http::Response::builder()
            .header("connection", "x-internal, upgrade")
            .header("upgrade", "foo")
            .header("trailer", "x-t")
            .header("x-internal", "1")
            .header("keep-alive", "timeout=3")
            .header("proxy-authenticate", "Basic")
            .header("x-public", "1")
            .body(full("hi"))
            .unwrap()
    })
    .await;
    let gw = TestGateway::to(up, "");
    let resp = get(gw.addr, "/").await;
    assert_eq!(resp.status(), 200);
    let h = resp.headers();
    assert!(h.contains_key("x-public"));
    for gone in [
        "x-internal",
        "keep-alive",
        "proxy-authenticate",
        "connection",
        "upgrade",
        "trailer",
    ] {
        assert!(!h.contains_key(gone), "{gone} must not reach the client");
    }
}

#[tokio::test]
async fn chunked_and_content_length_bodies_pass_both_ways() {
    let up = echo_upstream().await;
    let gw = TestGateway::to(up, "");
    // Content-Length body.
    let (text, _) = raw(gw.addr, b"POST /cl HTTP/1.1\r\nHost: a\r\nContent-Length: 11\r\nConnection: close\r\n\r\nhello world", Duration::from_secs(5)).await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.ends_with("hello world"), "{text}");
    // Chunked body.
    let (text, _) = raw(
        gw.addr,
        b"POST /ch HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("hello") && text.contains(" world"), "{text}");
}

#[tokio::test]
async fn large_upload_and_download_stream() {
    const SIZE: usize = 32 * 1024 * 1024;
    let up = upstream(|req: http::Request<hyper::body::Incoming>| async move {
        if req.method() == http::Method::POST {
            // Count the upload without keeping it.
            let mut body = req.into_body();
            let mut n = 0usize;
            while let Some(f) = body.frame().await {
                if let Ok(d) = f.unwrap().into_data() {
                    n += d.len();
                }
            }
            return http::Response::new(full(n.to_string()));
        }
        let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
        let stream = futures_stream(chunk, SIZE / (64 * 1024));
        http::Response::new(stream)
    })
    .await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\nmax_body_bytes = 0\n");
    let mut c = h1_client(gw.addr).await;
    let body = Bytes::from(vec![b'y'; SIZE]);
    let resp = c
        .send_request(
            http::Request::post("/up")
                .header("host", "a")
                .body(full(body))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.into_body().collect().await.unwrap().to_bytes(),
        SIZE.to_string()
    );
    let resp = c
        .send_request(
            http::Request::get("/down")
                .header("host", "a")
                .body(full(""))
                .unwrap(),
        )
        .await
        .unwrap();
    let mut body = resp.into_body();
    let mut n = 0;
    while let Some(f) = body.frame().await {
        if let Ok(d) = f.unwrap().into_data() {
            n += d.len();
        }
    }
    assert_eq!(n, SIZE);
}

fn futures_stream(chunk: Bytes, count: usize) -> TestBody {
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(4).into_split_body();
    tokio::spawn(async move {
        for _ in 0..count {
            if tx.send(chunk.clone()).await.is_err() {
                return;
            }
        }
    });
    rx
}

/// A body of `first;` at once, then `second` once `release` turns true.
fn first_then_on_release(mut release: tokio::sync::watch::Receiver<bool>) -> TestBody {
    let (tx, body) = tokio::sync::mpsc::channel::<Bytes>(1).into_split_body();
    tokio::spawn(async move {
        tx.send(Bytes::from_static(b"first;")).await.ok();
        let _ = release.wait_for(|r| *r).await;
        tx.send(Bytes::from_static(b"second")).await.ok();
    });
    body
}

trait SplitBody {
    fn into_split_body(self) -> (tokio::sync::mpsc::Sender<Bytes>, TestBody);
}

impl SplitBody
    for (
        tokio::sync::mpsc::Sender<Bytes>,
        tokio::sync::mpsc::Receiver<Bytes>,
    )
{
    fn into_split_body(self) -> (tokio::sync::mpsc::Sender<Bytes>, TestBody) {
        let (tx, mut rx) = self;
        let body = http_body_util::StreamBody::new(futures_util::stream::poll_fn(move |cx| {
            rx.poll_recv(cx).map(|o| {
                o.map(|b| {
                    Ok::<_, Box<dyn std::error::Error + Send + Sync>>(hyper::body::Frame::data(b))
                })
            })
        }));
        (tx, body.boxed())
    }
}

/// The response is not buffered: the client sees the first chunk while the upstream is
/// still holding back the rest.
#[tokio::test]
async fn response_streams_before_upstream_finishes() {
    let (release_tx, release_rx) = tokio::sync::watch::channel(false);
    let up = upstream(move |_| {
        let release = release_rx.clone();
        async move { http::Response::new(first_then_on_release(release)) }
    })
    .await;
    let gw = TestGateway::to(up, "");
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 1024];
    while !String::from_utf8_lossy(&seen).contains("first;") {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .expect("first chunk arrives while upstream holds the rest")
            .unwrap();
        assert!(n > 0);
        seen.extend_from_slice(&buf[..n]);
    }
    assert!(!String::from_utf8_lossy(&seen).contains("second"));
    release_tx.send(true).unwrap();
    while !String::from_utf8_lossy(&seen).contains("second") {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0);
        seen.extend_from_slice(&buf[..n]);
    }
}

/// The request body is not buffered: the upstream sees the first part while the client
/// still holds back the rest.
#[tokio::test]
async fn request_body_streams_before_client_finishes() {
    let (got_tx, mut got_rx) = tokio::sync::mpsc::channel::<Bytes>(8);
    let up = upstream(move |req: http::Request<hyper::body::Incoming>| {
        let got = got_tx.clone();
        async move {
            let mut body = req.into_body();
            while let Some(Ok(f)) = body.frame().await {
                if let Ok(d) = f.into_data() {
                    got.send(d).await.ok();
                }
            }
            http::Response::new(full("done"))
        }
    })
    .await;
    let gw = TestGateway::to(up, "");
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        .await
        .unwrap();
    let first = tokio::time::timeout(Duration::from_secs(5), got_rx.recv())
        .await
        .expect("upstream gets the first chunk before the body ends")
        .unwrap();
    assert_eq!(first, "first");
    s.write_all(b"4\r\nlast\r\n0\r\n\r\n").await.unwrap();
    let (text, _) = read_until_close_or(&mut s, "done").await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
}

/// Over HTTP/2 on both sides (an h2c client, an `http2` cluster), neither body is
/// buffered either: the upstream sees the request body's first part while the client holds
/// back the rest, and the client sees the response's first part while the upstream holds
/// back the rest.
#[tokio::test]
async fn bodies_stream_both_ways_over_http2() {
    let (got_tx, mut got_rx) = tokio::sync::mpsc::channel::<Bytes>(8);
    let (release_tx, release_rx) = tokio::sync::watch::channel(false);
    let up = h2c_upstream_with(move |req: http::Request<hyper::body::Incoming>| {
        let got = got_tx.clone();
        let release = release_rx.clone();
        async move {
            tokio::spawn(async move {
                let mut body = req.into_body();
                while let Some(Ok(f)) = body.frame().await {
                    if let Ok(d) = f.into_data() {
                        got.send(d).await.ok();
                    }
                }
            });
            http::Response::new(first_then_on_release(release))
        }
    })
    .await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\nprotocol = \"http2\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
    ));
    let (mut c, _conn) = h2c_client(gw.addr).await;
    let (req_tx, req_body) = tokio::sync::mpsc::channel::<Bytes>(1).into_split_body();
    req_tx.send(Bytes::from_static(b"first")).await.unwrap();
    let resp = tokio::time::timeout(
        Duration::from_secs(5),
        c.send_request(http::Request::post("http://a/").body(req_body).unwrap()),
    )
    .await
    .expect("the answer's head comes while both bodies are open")
    .unwrap();
    assert_eq!(resp.status(), 200);
    let first = tokio::time::timeout(Duration::from_secs(5), got_rx.recv())
        .await
        .expect("the upstream gets the first part before the body ends")
        .unwrap();
    assert_eq!(first, "first");
    let mut body = resp.into_body();
    let piece = tokio::time::timeout(Duration::from_secs(5), body.frame())
        .await
        .expect("the client gets the first part while the upstream holds the rest")
        .unwrap()
        .unwrap()
        .into_data()
        .unwrap();
    assert_eq!(piece, "first;");
    req_tx.send(Bytes::from_static(b"last")).await.unwrap();
    drop(req_tx);
    let last = tokio::time::timeout(Duration::from_secs(5), got_rx.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(last, "last");
    release_tx.send(true).unwrap();
    let rest = tokio::time::timeout(Duration::from_secs(5), body.collect())
        .await
        .unwrap()
        .unwrap()
        .to_bytes();
    assert_eq!(rest, "second");
}

async fn read_until_close_or(s: &mut TcpStream, needle: &str) -> (String, bool) {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => {
                return (String::from_utf8_lossy(&out).into_owned(), true);
            }
            Ok(Ok(n)) => {
                out.extend_from_slice(&buf[..n]);
                if String::from_utf8_lossy(&out).contains(needle) {
                    return (String::from_utf8_lossy(&out).into_owned(), false);
                }
            }
        }
    }
}

#[tokio::test]
async fn head_gets_headers_without_body() {
    let up = upstream(|req: http::Request<hyper::body::Incoming>| async move {
        assert_eq!(req.method(), http::Method::HEAD);
        http::Response::builder()
            .header("content-length", "1234")
            .body(full(""))
            .unwrap()
    })
    .await;
    let gw = TestGateway::to(up, "");
    let (text, _) = raw(
        gw.addr,
        b"HEAD / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(
        text.to_ascii_lowercase().contains("content-length: 1234"),
        "{text}"
    );
    assert!(
        text.ends_with("\r\n\r\n"),
        "no body after a HEAD response: {text:?}"
    );
}

#[tokio::test]
async fn expect_100_continue_is_answered_before_the_body() {
    let up = echo_upstream().await;
    let gw = TestGateway::to(up, "");
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"PUT / HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 256];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .expect("100 Continue arrives")
        .unwrap();
    let interim = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(interim.starts_with("HTTP/1.1 100 Continue"), "{interim}");
    s.write_all(b"data").await.unwrap();
    let (rest, cut) = read_until_close_or(&mut s, "data").await;
    // The upstream may answer its head before the body arrives, so the 200 can come in the
    // same read as the 100.
    let text = format!("{interim}{rest}");
    assert!(text.contains("HTTP/1.1 200"), "{text}");
    // The body sent after the 100 reached the upstream: it came back echoed.
    assert!(!cut, "the body never came back: {text}");
    assert!(
        !text.to_ascii_lowercase().contains("x-echo-expect"),
        "Expect is not forwarded: {text}"
    );
}

#[tokio::test]
async fn h2c_prior_knowledge_to_h1_upstream() {
    let up = echo_upstream().await;
    let gw = TestGateway::to(up, "");
    let (mut c, _conn) = h2c_client(gw.addr).await;
    for i in 0..3 {
        let req = http::Request::post(format!("http://api.test/h2/{i}"))
            .body(full(format!("body{i}")))
            .unwrap();
        let resp = c.send_request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.version(), http::Version::HTTP_2);
        assert_eq!(resp.headers()["x-echo-via"], "2 tailgate");
        assert_eq!(resp.headers()["x-echo-host"], "api.test");
        assert_eq!(resp.headers()["x-echo-uri"], format!("/h2/{i}").as_str());
        assert_eq!(
            resp.into_body().collect().await.unwrap().to_bytes(),
            format!("body{i}")
        );
    }
}

#[tokio::test]
async fn ipv6_endpoints() {
    let Ok(probe) = std::net::TcpListener::bind("[::1]:0") else {
        eprintln!("no IPv6 loopback here; skipping");
        return;
    };
    drop(probe);
    let up = upstream_on("[::1]:0", |_| async { http::Response::new(full("v6")) }).await;
    let gw = TestGateway::start(&format!(
        "[[listener]]\nname = \"v6\"\naddress = \"[::1]:0\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
    ));
    assert!(gw.addr.is_ipv6());
    let resp = get(gw.addr, "/").await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.body(), "v6");
}

/// Review finding 3b: bodiless answers (HEAD, 204) used to drop their upstream connection
/// instead of pooling it, so every one paid a new connect.
#[tokio::test]
async fn r_bodiless_answers_keep_the_upstream_connection() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let conns = Arc::new(AtomicUsize::new(0));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = l.local_addr().unwrap();
    let counter = conns.clone();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            counter.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(
                    |req: http::Request<hyper::body::Incoming>| async move {
                        let status = if req.method() == http::Method::HEAD {
                            200
                        } else {
                            204
                        };
                        Ok::<_, std::convert::Infallible>(
                            http::Response::builder()
                                .status(status)
                                .body(full(""))
                                .unwrap(),
                        )
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    let gw = TestGateway::to(up, "");
    let mut c = h1_client(gw.addr).await;
    for i in 0..6 {
        let method = if i % 2 == 0 {
            http::Method::HEAD
        } else {
            http::Method::DELETE
        };
        let resp = c
            .send_request(
                http::Request::builder()
                    .method(method)
                    .uri("/")
                    .header("host", "a")
                    .body(full(""))
                    .unwrap(),
            )
            .await
            .unwrap();
        assert!(resp.status().is_success());
        resp.into_body().collect().await.unwrap();
    }
    assert_eq!(
        conns.load(Ordering::SeqCst),
        1,
        "one upstream connection serves every request"
    );
}

/// Many clients write a request's head and its body apart: a small body that comes a moment
/// after its head is forwarded whole, and the connection goes on to the next request.
#[tokio::test]
async fn a_small_body_after_its_head_is_forwarded_and_the_connection_goes_on() {
    let gw = TestGateway::to(echo_upstream().await, "[server]\nworkers = 1\n");
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"POST /one HTTP/1.1\r\nHost: a\r\nContent-Length: 11\r\n\r\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    s.write_all(b"hello world").await.unwrap();
    let (text, closed) = read_until_close_or(&mut s, "hello world").await;
    assert!(!closed, "{text}");
    assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
    assert!(text.contains("x-echo-content-length: 11\r\n"), "{text}");
    assert!(text.contains("x-echo-uri: /one\r\n"), "{text}");

    s.write_all(b"GET /two HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let (text, closed) = read_until_close(&mut s, Duration::from_secs(5)).await;
    assert!(closed, "closed after the answer it asked for: {text}");
    assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
    assert!(text.contains("x-echo-uri: /two\r\n"), "{text}");
    assert!(text.contains("connection: close\r\n"), "{text}");
}

/// `server.max_requests_per_connection` over HTTP/2: once the connection has taken that
/// many streams it sends GOAWAY; the streams taken are answered, and the connection ends.
#[tokio::test]
async fn h2_connection_ends_after_max_requests_per_connection() {
    let up = echo_upstream().await;
    let gw = TestGateway::to(up, "[server]\nmax_requests_per_connection = 2\n");
    let (mut c, conn) = h2c_client(gw.addr).await;
    for i in 0..2 {
        let req = http::Request::get(format!("http://api.test/h2/{i}"))
            .body(full(""))
            .unwrap();
        let resp = c.send_request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["x-echo-uri"], format!("/h2/{i}").as_str());
        resp.into_body().collect().await.unwrap();
    }
    // The server's GOAWAY ends the connection (the client's driver returns).
    tokio::time::timeout(Duration::from_secs(10), conn)
        .await
        .expect("the connection ended after its second stream")
        .unwrap()
        .unwrap();
    let req = http::Request::get("http://api.test/h2/late")
        .body(full(""))
        .unwrap();
    assert!(c.send_request(req).await.is_err());
}

/// An upload to an upstream that stops reading is held by the gateway to a bounded
/// buffer: the client's writes stall once the sockets' buffers and the gateway's own are
/// full, long before the whole body went (it is never read whole into memory ahead of a
/// slow upstream).
#[tokio::test]
async fn an_upload_to_an_upstream_that_stops_reading_stalls_the_client() {
    // Reads the head, then nothing (the connection held open).
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = l.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut buf = [0u8; 1024];
        let _ = s.read(&mut buf).await;
        tokio::time::sleep(Duration::from_secs(60)).await;
        drop(s);
    });
    let gw = TestGateway::to(up, "[server]\nmax_body_bytes = 0\n");
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    const TOTAL: usize = 256 << 20;
    s.write_all(
        format!("POST / HTTP/1.1\r\nHost: a\r\nContent-Length: {TOTAL}\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let chunk = vec![b'x'; 64 << 10];
    let mut sent = 0usize;
    while sent < TOTAL {
        match tokio::time::timeout(Duration::from_secs(1), s.write(&chunk)).await {
            Ok(Ok(n)) => sent += n,
            Ok(Err(e)) => panic!("write failed after {sent} bytes: {e}"),
            Err(_) => break,
        }
    }
    // (About 9.5 MB here: the loopback sockets' buffers on both sides.)
    assert!(
        sent < 64 << 20,
        "{sent} bytes taken from a client whose upstream reads none"
    );
}

/// Over HTTP/2 an upload whose body is not read yet (its request waits for an upstream
/// connection) holds no more than its stream's flow-control window: the connection's is
/// larger, so another stream's upload on the same connection still goes through.
#[tokio::test]
async fn an_h2_upload_waiting_for_its_upstream_does_not_hold_up_another_stream() {
    let held = held_upstream().await;
    let fast = echo_upstream().await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"held\"\nendpoints = [\"{}\"]\nmax_connections_per_endpoint = 1\nconnect_timeout = \"30s\"\n\
         [[cluster]]\nname = \"fast\"\nendpoints = [\"{fast}\"]\n\
         [[route]]\npath_prefix = \"/held/\"\ncluster = \"held\"\n\
         [[route]]\npath_prefix = \"/fast/\"\ncluster = \"fast\"\n",
        held.addr
    ));
    let mut held = held;
    // The held cluster's one connection is busy with this request, whose answer waits.
    let mut h1 = h1_client(gw.addr).await;
    let busy = tokio::spawn(async move {
        let req = http::Request::get("/held/first")
            .header("host", "a")
            .body(full(""))
            .unwrap();
        h1.send_request(req).await.map(|r| r.status())
    });
    held.arrived.recv().await.unwrap();
    let (c, _conn) = h2c_client(gw.addr).await;
    // A 1 MiB upload that queues for that connection: its body is not read meanwhile.
    // Its pieces are counted as the client takes them (only as its window allows).
    let pulled = Arc::new(AtomicUsize::new(0));
    let counted = pulled.clone();
    let pieces = futures_util::stream::iter((0..16).map(move |_| {
        counted.fetch_add(64 << 10, Ordering::SeqCst);
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(hyper::body::Frame::data(Bytes::from(
            vec![b'x'; 64 << 10],
        )))
    }));
    let mut big = c.clone();
    let queued = tokio::spawn(async move {
        let req = http::Request::post("http://a/held/upload")
            .body(http_body_util::StreamBody::new(pieces).boxed())
            .unwrap();
        big.send_request(req).await.map(|r| r.status())
    });
    // Until the big upload has sent what its window lets it (64 KiB at least) and stopped:
    // the small one then meets a connection whose big stream holds its window.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut last = 0;
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = pulled.load(Ordering::SeqCst);
        if now >= 64 << 10 && now == last {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the upload never stopped"
        );
        last = now;
    }
    let mut small = c.clone();
    let req = http::Request::post("http://a/fast/small")
        .body(full("ten bytes!"))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(5), small.send_request(req))
        .await
        .expect("the small upload waited for the big one's window")
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body = tokio::time::timeout(Duration::from_secs(5), resp.into_body().collect())
        .await
        .expect("the small upload's echo came")
        .unwrap()
        .to_bytes();
    assert_eq!(&body[..], b"ten bytes!");
    held.open.send(true).unwrap();
    assert_eq!(busy.await.unwrap().unwrap(), 200);
    assert_eq!(queued.await.unwrap().unwrap(), 200);
}

/// A relay from `local` to `to` that passes what `to` sends back slowly (16 KiB every
/// 5 ms, read through a small receive buffer), as a slow network would, and the other way
/// at once: what the far side sends waits in its own socket buffer.
async fn slow_relay(to: std::net::SocketAddr) -> std::net::SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let local = l.local_addr().unwrap();
    tokio::spawn(async move {
        let (client, _) = l.accept().await.unwrap();
        let sock =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        sock.set_recv_buffer_size(4096).unwrap();
        sock.connect(&to.into()).unwrap();
        sock.set_nonblocking(true).unwrap();
        let server = TcpStream::from_std(std::net::TcpStream::from(sock)).unwrap();
        let (mut cr, mut cw) = client.into_split();
        let (mut sr, mut sw) = server.into_split();
        tokio::spawn(async move {
            let _ = tokio::io::copy(&mut cr, &mut sw).await;
        });
        let mut buf = vec![0u8; 16 << 10];
        loop {
            match sr.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if cw.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    local
}

/// An HTTP/2 connection closed at `max_requests_per_connection` lingers as an HTTP/1 one
/// does. Over a slow network, the end of its one stream's answer is still in the gateway's
/// socket buffer when the stream ends and h2 closes the connection, and the client,
/// reading on, goes on sending WINDOW_UPDATEs. Without the lingering close those meet a
/// closed socket, the kernel answers with a reset, and the rest of the answer is lost.
#[tokio::test]
async fn an_h2_answer_at_the_request_cap_is_not_cut_by_what_the_client_sends_after() {
    const LEN: usize = 2 << 20;
    let up = upstream(|_| async { http::Response::new(full(vec![b'x'; LEN])) }).await;
    let gw = TestGateway::to(up, "[server]\nmax_requests_per_connection = 1\n");
    let relay = slow_relay(gw.addr).await;
    let stream = TcpStream::connect(relay).await.unwrap();
    let (mut c, conn) =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            // Windows smaller than the answer: the client gives them back as it reads.
            .initial_stream_window_size(512 << 10)
            .initial_connection_window_size(512 << 10)
            .handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = http::Request::get("http://api.test/big")
        .body(full(""))
        .unwrap();
    let resp = c.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut got = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while let Some(frame) = tokio::time::timeout_at(deadline, body.frame())
        .await
        .expect("the answer came")
    {
        let frame = frame.unwrap_or_else(|e| panic!("cut short after {got} of {LEN} bytes: {e}"));
        if let Some(d) = frame.data_ref() {
            got += d.len();
        }
    }
    assert_eq!(got, LEN);
}

/// A client's `Connection` naming `Host` removes the hop-by-hop headers it names, but the
/// Host is put back: the upstream gets the client's Host, not its own address.
#[tokio::test]
async fn a_connection_header_naming_host_keeps_the_host() {
    let up = echo_upstream().await;
    let gw = TestGateway::to(up, "");
    let (resp, _) = raw(
        gw.addr,
        b"GET / HTTP/1.1\r\nHost: api.test\r\nConnection: host, x-drop, close\r\nX-Drop: 1\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    let lower = resp.to_ascii_lowercase();
    assert!(lower.starts_with("http/1.1 200"), "{resp}");
    assert!(lower.contains("x-echo-host: api.test\r\n"), "{resp}");
    assert!(!lower.contains("x-echo-x-drop"), "{resp}");
}
