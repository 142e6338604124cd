//! Raw-byte tests: every malformed or hostile request shape gets a 4xx and a closed
//! connection, and never reaches the upstream.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// An upstream that counts the requests it receives.
async fn counting_upstream() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    let addr = upstream(move |_| {
        h.fetch_add(1, Ordering::SeqCst);
        async { http::Response::new(full("ok")) }
    })
    .await;
    (addr, hits)
}

/// Upstream connections the gateway took for requests (pooled or new): counted by the
/// gateway before it forwards anything, so unlike the upstream's own count it cannot be
/// read before a request that was let through lands.
fn checkouts(gw: &TestGateway) -> u64 {
    stat(gw, |s| {
        s.connects_on_request.load(Ordering::SeqCst) + s.reuses.load(Ordering::SeqCst)
    })
}

async fn refused(bytes: &[u8], status: &str) {
    let (up, hits) = counting_upstream().await;
    let gw = TestGateway::to(
        up,
        "[server]\nworkers = 1\nmax_header_bytes = 8192\nmax_body_bytes = 1000\n",
    );
    let (text, closed) = raw(gw.addr, bytes, Duration::from_secs(5)).await;
    assert!(
        text.starts_with(&format!("HTTP/1.1 {status}")),
        "expected {status}, got: {text:?}"
    );
    assert!(
        closed,
        "the connection must be closed after refusing: {text:?}"
    );
    assert_eq!(checkouts(&gw), 0, "a refused request must not be forwarded");
    assert_eq!(
        hits.load(Ordering::SeqCst),
        0,
        "a refused request must not reach the upstream"
    );
}

#[tokio::test]
async fn content_length_and_transfer_encoding_is_refused() {
    refused(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", "400").await;
    refused(b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n", "400").await;
}

/// Smuggling attempt after a legitimate request on the same connection: the first is
/// answered, the second refused, and only the first reaches the upstream.
#[tokio::test]
async fn cl_te_on_a_keepalive_connection_is_refused_after_the_valid_one() {
    let (up, hits) = counting_upstream().await;
    let gw = TestGateway::to(up, "");
    let (text, closed) = raw(
        gw.addr,
        b"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabcPOST /b HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("HTTP/1.1 400"), "{text}");
    assert!(closed);
    assert_eq!(checkouts(&gw), 1, "only the first was forwarded");
    assert_eq!(hits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn conflicting_content_lengths_are_refused() {
    refused(
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
        "400",
    )
    .await;
}

#[tokio::test]
async fn invalid_header_bytes_are_refused() {
    refused(
        b"GET / HTTP/1.1\r\nHost: a\r\nX-Bad\x01Name: v\r\n\r\n",
        "400",
    )
    .await;
    refused(b"GET / HTTP/1.1\r\nHost: a\r\nX-Bad: v\x00v\r\n\r\n", "400").await;
    refused(b"GET / HTTP/1.1\r\nHost: a\r\nBad Header: v\r\n\r\n", "400").await;
}

#[tokio::test]
async fn garbage_request_line_is_refused() {
    refused(
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n",
        "400",
    )
    .await;
}

#[tokio::test]
async fn non_chunked_transfer_encoding_is_refused() {
    refused(
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\nxxxx",
        "400",
    )
    .await;
    // Framed (chunked last), but with a coding the gateway does not decode: 501, as nginx
    // answers it, and closed.
    refused(
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        "501",
    )
    .await;
}

#[tokio::test]
async fn oversized_headers_get_431() {
    let mut req = b"GET / HTTP/1.1\r\nHost: a\r\n".to_vec();
    for i in 0..200 {
        req.extend_from_slice(format!("X-Filler-{i}: {}\r\n", "v".repeat(60)).as_bytes());
    }
    req.extend_from_slice(b"\r\n");
    refused(&req, "431").await;
}

#[tokio::test]
async fn declared_body_over_the_limit_gets_413() {
    let (up, hits) = counting_upstream().await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\nmax_body_bytes = 1000\n");
    let (text, closed) = raw(
        gw.addr,
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5000\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(text.contains("\"error\":\"body_too_large\""), "{text}");
    assert!(closed);
    assert_eq!(hits.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn chunked_body_over_the_limit_gets_413() {
    let up = upstream(|req: http::Request<hyper::body::Incoming>| async move {
        use http_body_util::BodyExt;
        // Read the whole body: the gateway cuts it off, so this fails.
        match req.into_body().collect().await {
            Ok(_) => http::Response::new(full("read it all")),
            Err(_) => http::Response::new(full("cut")),
        }
    })
    .await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\nmax_body_bytes = 1000\n");
    let mut req = b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..3 {
        req.extend_from_slice(b"1f4\r\n");
        req.extend_from_slice(&[b'z'; 500]);
        req.extend_from_slice(b"\r\n");
    }
    req.extend_from_slice(b"0\r\n\r\n");
    let (text, closed) = raw(gw.addr, &req, Duration::from_secs(5)).await;
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(!text.contains("read it all"));
    assert!(closed);
}

#[tokio::test]
async fn missing_or_invalid_host_is_refused() {
    let (up, hits) = counting_upstream().await;
    let gw = TestGateway::to(up, "");
    // HTTP/1.1 must name a host (an HTTP/1.0 request need not: see tests/routing.rs).
    for req in [
        &b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n"[..],
        b"GET / HTTP/1.1\r\nHost: a.test:@evil.test\r\nConnection: close\r\n\r\n",
    ] {
        let (text, _) = raw(gw.addr, req, Duration::from_secs(5)).await;
        assert!(text.starts_with("HTTP/1.1 400"), "{text}");
    }
    assert_eq!(hits.load(Ordering::SeqCst), 0);
}

/// Random bytes never crash the gateway: after a storm of junk, it still serves.
#[tokio::test]
async fn random_bytes_never_break_the_gateway() {
    let (up, _) = counting_upstream().await;
    let gw = TestGateway::to(up, "");
    let mut rng = fastrand::Rng::with_seed(7);
    for i in 0..200 {
        let len = rng.usize(1..600);
        let mut junk: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
        if i % 2 == 0 {
            // Half of them start like a real request.
            let mut head = b"POST / HTTP/1.1\r\nHost: a\r\n".to_vec();
            head.append(&mut junk);
            junk = head;
        }
        let _ = raw(gw.addr, &junk, Duration::from_millis(300)).await;
    }
    let resp = get(gw.addr, "/").await;
    assert_eq!(resp.status(), 200);
}

/// An upstream that records the path of every request it receives.
async fn path_recording_upstream() -> (std::net::SocketAddr, Arc<std::sync::Mutex<Vec<String>>>) {
    let paths = Arc::new(std::sync::Mutex::new(Vec::new()));
    let p = paths.clone();
    let addr = upstream(move |req| {
        p.lock().unwrap().push(req.uri().path().to_owned());
        async { http::Response::new(full("ok")) }
    })
    .await;
    (addr, paths)
}

/// Review finding 1a: a bare LF after the last chunk made the guard and hyper disagree on
/// where the next head starts; the smuggled `/smuggled` request must never reach upstream.
#[tokio::test]
async fn r_bare_lf_trailer_cannot_smuggle() {
    let (up, paths) = path_recording_upstream().await;
    let gw = TestGateway::to(up, "");
    let inner = b"POST /smuggled HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
    let mut attack = b"POST /first HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\nPOST /second HTTP/1.1\r\nHost: a\r\n".to_vec();
    attack.extend_from_slice(format!("Content-Length: {}\r\n\r\n", inner.len()).as_bytes());
    attack.extend_from_slice(inner);
    let (_, closed) = raw(gw.addr, &attack, Duration::from_secs(5)).await;
    assert!(closed);
    // At most `/first` was forwarded (counted by the gateway, so nothing let through can
    // land after the look).
    assert!(checkouts(&gw) <= 1, "{} forwarded", checkouts(&gw));
    let seen = paths.lock().unwrap().clone();
    assert!(
        !seen.iter().any(|p| p == "/smuggled" || p == "/second"),
        "{seen:?}"
    );
}

/// Review finding 1b: after an upgrade request answered without 101 the guard no longer
/// follows framing, so the connection must close rather than read another request.
#[tokio::test]
async fn r_upgrade_answered_without_101_closes_the_connection() {
    let (up, paths) = path_recording_upstream().await;
    let gw = TestGateway::to(up, "");
    let (text, closed) = raw(
        gw.addr,
        b"GET /ws HTTP/1.1\r\nHost: a\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\nPOST /after HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(
        text.to_ascii_lowercase().contains("connection: close"),
        "{text}"
    );
    assert!(closed);
    assert_eq!(paths.lock().unwrap().clone(), vec!["/ws".to_owned()]);
}

/// Review finding 1b for CONNECT: a gateway-made error answer also closes.
#[tokio::test]
async fn r_connect_gets_an_answer_and_a_close() {
    let (up, paths) = path_recording_upstream().await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/api/\"\ncluster = \"up\"\n"
    ));
    let (text, closed) = raw(gw.addr, b"CONNECT example.test:443 HTTP/1.1\r\nHost: example.test:443\r\n\r\nGET /api/x HTTP/1.1\r\nHost: a\r\n\r\n", Duration::from_secs(5)).await;
    assert!(text.starts_with("HTTP/1.1 4"), "{text}");
    assert!(closed, "{text}");
    assert!(paths.lock().unwrap().is_empty());
}

/// CONNECT with an origin-form target (`CONNECT /api/x`, not the authority-form RFC 9110
/// §9.3.6 asks for) matches no route, even one without `methods`: `405` with the route's
/// `Allow`, and a close; nothing reaches the upstream (which would take a 2xx to it for a
/// tunnel). `check` refuses CONNECT in a route's `methods`.
#[tokio::test]
async fn connect_with_a_path_is_405_and_never_proxied() {
    let (up, paths) = path_recording_upstream().await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/api/\"\ncluster = \"up\"\n"
    ));
    let (text, closed) = raw(
        gw.addr,
        b"CONNECT /api/x HTTP/1.1\r\nHost: a\r\n\r\nGET /api/y HTTP/1.1\r\nHost: a\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(text.starts_with("HTTP/1.1 405"), "{text}");
    let allow = text
        .lines()
        .find(|l| l.to_ascii_lowercase().starts_with("allow:"))
        .unwrap_or_default();
    assert!(
        allow.contains("GET") && !allow.contains("CONNECT"),
        "{text}"
    );
    assert!(closed, "{text}");
    assert!(paths.lock().unwrap().is_empty());
    let e = tailgate::Config::parse(
        std::path::Path::new("t.toml"),
        &format!("[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/\"\nmethods = [\"GET\", \"connect\"]\ncluster = \"up\"\n"),
    )
    .expect_err("CONNECT in methods")
    .to_string();
    assert!(e.contains("t.toml:8:19: route[0].methods[1]"), "{e}");
    assert!(e.contains("not proxied"), "{e}");
}

/// A head the HTTP parser refuses gets the gateway's JSON error with a request id (the same
/// as the `x-request-id` header), like every other error the gateway makes; the connection
/// is closed, and a keep-alive request before it is answered first. The same from both
/// HTTP/1 servers: the inline one, and hyper's behind the smuggling guard (which takes the
/// connection from a chunked request on).
#[tokio::test]
async fn parser_refusals_carry_the_json_error() {
    let (up, hits) = counting_upstream().await;
    let gw = TestGateway::to(up, "[server]\nmax_header_bytes = 8192\n");
    let many: Vec<u8> = [
        &b"GET / HTTP/1.1\r\nHost: a\r\n"[..],
        &b"X: y\r\n".repeat(101),
        b"\r\n",
    ]
    .concat();
    let long = format!(
        "GET / HTTP/1.1\r\nHost: a\r\nX: {}\r\n\r\n",
        "v".repeat(9000)
    );
    // Nothing but empty lines, past the limit.
    let blank = b"\r\n".repeat(4097);
    let cases: [(&[u8], &str, &str); 13] = [
        (&blank, "431", "header_too_large"),
        (b"GET / HTTP/1.1\r\nHost: a\r\nX-Bad: a\x01b\r\n\r\n", "400", "bad_request"),
        (b"GET / HTTP/9.9\r\nHost: a\r\n\r\n", "400", "bad_request"),
        (b"GET /\x7f HTTP/1.1\r\nHost: a\r\n\r\n", "400", "bad_request"),
        (b"GET http://[::1 HTTP/1.1\r\nHost: a\r\n\r\n", "400", "bad_request"),
        (&many, "431", "header_too_large"),
        (long.as_bytes(), "431", "header_too_large"),
        (
            b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            "400",
            "bad_request",
        ),
        (
            b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nabc",
            "400",
            "bad_request",
        ),
        (
            b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3, 3\r\n\r\nabc",
            "400",
            "bad_request",
        ),
        (
            b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2, 3\r\n\r\nabc",
            "400",
            "bad_request",
        ),
        (
            b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\nabc",
            "400",
            "bad_request",
        ),
        (
            b"POST / HTTP/1.0\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            "400",
            "bad_request",
        ),
    ];
    let prefixes: [&[u8]; 3] = [
        b"",
        // Served inline first.
        b"GET /ok HTTP/1.1\r\nHost: a\r\n\r\n",
        // Hands the connection to hyper's server.
        b"POST /h HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    ];
    for (bad, status, code) in cases {
        for prefix in prefixes {
            let before = usize::from(!prefix.is_empty());
            let bytes = [prefix, bad].concat();
            let hits_before = hits.load(Ordering::SeqCst);
            let (text, closed) = raw(gw.addr, &bytes, Duration::from_secs(5)).await;
            let text = format!(
                "{}\n--- sent:\n{}",
                text.replace("HTTP/1.1 200 OK", "HTTP/1.1 200"),
                String::from_utf8_lossy(&bytes[..bytes.len().min(300)])
            );
            assert!(closed, "{text}");
            // The refusal is the last answer on the connection.
            let at = text.rfind("HTTP/1.1 ").unwrap();
            assert_eq!(text.matches("HTTP/1.1 ").count(), before + 1, "{text}");
            if before == 1 {
                assert!(text.starts_with("HTTP/1.1 200"), "{text}");
            }
            let refusal = &text[at..];
            assert!(
                refusal.starts_with(&format!("HTTP/1.1 {status} ")),
                "{text}"
            );
            let refusal = &refusal[..refusal.find("\n--- sent:").unwrap()];
            let (head, body) = refusal.split_once("\r\n\r\n").unwrap();
            let v: serde_json::Value =
                serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {text:?}"));
            assert_eq!(v["error"], code, "{text}");
            let id = v["request_id"].as_str().unwrap();
            assert_eq!(id.len(), 24, "{text}");
            let head = head.to_ascii_lowercase();
            assert!(head.contains(&format!("x-request-id: {id}\r\n")), "{text}");
            assert!(head.contains("content-type: application/json"), "{text}");
            assert!(head.contains("connection: close"), "{text}");
            assert_eq!(hits.load(Ordering::SeqCst) - hits_before, before, "{text}");
        }
    }
}

/// Sends `prefix` then `head` on a new connection, which must be closed after; the last
/// answer on it.
async fn last_answer(gw: &TestGateway, prefix: &[u8], head: &str) -> String {
    let (text, closed) = raw(
        gw.addr,
        &[prefix, head.as_bytes()].concat(),
        Duration::from_secs(5),
    )
    .await;
    assert!(closed, "{text}");
    text[text.rfind("HTTP/1.1 ").unwrap()..].to_owned()
}

/// A target longer than hyper's server takes (65,534 bytes) gets the gateway's JSON `414`
/// from both HTTP/1 servers, when `max_header_bytes` lets such a head in at all.
#[tokio::test]
async fn a_target_too_long_gets_the_json_414() {
    let (up, hits) = counting_upstream().await;
    let gw = TestGateway::to(up, "[server]\nmax_header_bytes = 131072\n");
    let long = format!("GET /{} HTTP/1.1\r\nHost: a\r\n\r\n", "a".repeat(70_000));
    // The target is checked before the body headers, on both servers.
    let long_and_bad_length = format!(
        "POST /{} HTTP/1.1\r\nHost: a\r\nContent-Length: 1, 2\r\n\r\nx",
        "a".repeat(70_000)
    );
    let hand_over: &[u8] =
        b"POST /h HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
    for (prefix, head) in [&b""[..], hand_over]
        .into_iter()
        .flat_map(|p| [(p, &long), (p, &long_and_bad_length)])
    {
        let last = last_answer(&gw, prefix, head).await;
        assert!(last.starts_with("HTTP/1.1 414 "), "{last}");
        assert!(last.contains("{\"error\":\"uri_too_long\""), "{last}");
    }
    assert_eq!(
        hits.load(Ordering::SeqCst),
        2,
        "only the chunked requests went upstream"
    );
}

/// With `max_header_bytes` over 64 KiB, a head may hold a header name longer than any the
/// gateway can carry: the JSON `431`, from both HTTP/1 servers (hyper's server failed the
/// connection without an answer). A head larger than hyper's default read buffer, within
/// the limit, is served.
#[tokio::test]
async fn a_header_name_too_long_to_carry_gets_the_json_431() {
    let (up, hits) = counting_upstream().await;
    let gw = TestGateway::to(up, "[server]\nmax_header_bytes = 1048576\n");
    let named = |len: usize, target: &str| {
        format!(
            "GET {target} HTTP/1.1\r\nHost: a\r\n{}: v\r\nConnection: close\r\n\r\n",
            "n".repeat(len)
        )
    };
    let long_target = format!("/{}", "t".repeat(70_000));
    let hand_over: &[u8] =
        b"POST /h HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
    for prefix in [&b""[..], hand_over] {
        // The longest name is served; one byte more is refused; a target too long as well
        // is refused for the target first, by both servers.
        for (head, want) in [
            (named(65_535, "/"), "HTTP/1.1 200 "),
            (named(65_536, "/"), "HTTP/1.1 431 "),
            (named(70_000, "/"), "HTTP/1.1 431 "),
            (named(70_000, &long_target), "HTTP/1.1 414 "),
        ] {
            let last = last_answer(&gw, prefix, &head).await;
            assert!(last.starts_with(want), "{want}: {last}");
            if want != "HTTP/1.1 200 " {
                assert!(last.contains("{\"error\":\""), "{last}");
            }
        }
    }
    assert_eq!(
        hits.load(Ordering::SeqCst),
        6,
        "only the four chunked requests and the two with the longest name went upstream"
    );
    drop(gw);
    // An upstream that takes heads of any size (hyper's server, as the counting one is,
    // stops at about 408 KiB).
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                while let Some(end) = read_head(&mut s, &mut buf).await {
                    // (The one chunked request here has an empty body.)
                    let chunked = buf[..end].windows(7).any(|w| w == b"chunked");
                    buf.drain(..end);
                    while chunked && !buf.starts_with(b"0\r\n\r\n") {
                        let mut more = [0u8; 64];
                        match s.read(&mut more).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&more[..n]),
                        }
                    }
                    if chunked {
                        buf.drain(..5);
                    }
                    let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                    if s.write_all(ok).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    let gw = TestGateway::to(up, "[server]\nmax_header_bytes = 1048576\n");
    // 600 KiB of headers (in fewer than 100 lines), after a chunked request handed the
    // connection to hyper's server.
    let mut big = b"GET /big HTTP/1.1\r\nHost: a\r\nConnection: close\r\n".to_vec();
    for i in 0..90 {
        big.extend_from_slice(format!("x-{i}: {}\r\n", "v".repeat(7000)).as_bytes());
    }
    big.extend_from_slice(b"\r\n");
    let (text, closed) = raw(gw.addr, &[hand_over, &big].concat(), Duration::from_secs(5)).await;
    assert!(closed, "{text}");
    let last = &text[text.rfind("HTTP/1.1 ").unwrap()..];
    assert!(last.starts_with("HTTP/1.1 200"), "{text}");
    assert_eq!(text.matches("HTTP/1.1 200").count(), 2, "{text}");
}

/// The header that marks the stand-in for a refused head means nothing when a client sends
/// it: the request is proxied, on either server.
#[tokio::test]
async fn a_client_sent_refusal_marker_is_an_ordinary_header() {
    let gw = TestGateway::to(echo_upstream().await, "");
    let chunked: &[u8] =
        b"POST /h HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n";
    for prefix in [&b""[..], chunked] {
        let bytes = [
            prefix,
            b"GET /m HTTP/1.1\r\nHost: a\r\ntailgate-refused-head: 1\r\nConnection: close\r\n\r\n",
        ]
        .concat();
        let (text, closed) = raw(gw.addr, &bytes, Duration::from_secs(5)).await;
        assert!(closed, "{text}");
        let last = &text[text.rfind("HTTP/1.1 ").unwrap()..];
        assert!(last.starts_with("HTTP/1.1 200"), "{text}");
        assert!(
            last.to_ascii_lowercase().contains("x-echo-uri: /m"),
            "{text}"
        );
    }
}

/// The same `Content-Length` twice, which hyper's server takes, frames the body on both
/// HTTP/1 servers: the request is served, and so is the next one on the connection.
#[tokio::test]
async fn a_repeated_content_length_frames_the_body() {
    let gw = TestGateway::to(echo_upstream().await, "");
    let hand_over: &[u8] =
        b"POST /h HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n";
    for prefix in [&b""[..], hand_over] {
        {
            let list = b"Content-Length: 3\r\nContent-Length: 3\r\n";
            let bytes = [
                prefix,
                b"POST /l HTTP/1.1\r\nHost: a\r\n",
                list,
                b"\r\nabcGET /n HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
            ]
            .concat();
            let (text, closed) = raw(gw.addr, &bytes, Duration::from_secs(5)).await;
            assert!(closed, "{text}");
            let want = if prefix.is_empty() { 2 } else { 3 };
            assert_eq!(text.matches("HTTP/1.1 200 OK").count(), want, "{text}");
            assert!(text.contains("abc"), "the body was forwarded: {text}");
            assert!(
                text.to_ascii_lowercase().contains("x-echo-uri: /n"),
                "{text}"
            );
        }
    }
}

/// On a connection that first sends `before` (a request answered with `ok`, or nothing),
/// `head` with bytes behind it, and more sent after the answer: the client gets `status`
/// and can finish sending, and the connection closes cleanly, not with a reset from a close
/// over unread bytes (which would fail its writes). Returns the requests the upstream got.
async fn refused_while_the_client_still_sends(before: &[u8], head: &[u8], status: &[u8]) -> usize {
    let (up, hits) = counting_upstream().await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\nmax_body_bytes = 100000\n");
    let s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let (mut rd, mut wr) = s.into_split();
    if !before.is_empty() {
        wr.write_all(before).await.unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        while !got.ends_with(b"ok") {
            let n = rd.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed before the first answer");
            got.extend_from_slice(&buf[..n]);
        }
        assert!(got.starts_with(b"HTTP/1.1 200"));
    }
    // The head, with bytes behind it already.
    let mut refused = head.to_vec();
    refused.extend_from_slice(&[b'x'; 16 * 1024]);
    wr.write_all(&refused).await.unwrap();
    let mut answer = [0u8; 12];
    rd.read_exact(&mut answer).await.unwrap();
    assert_eq!(&answer[..], status);
    // The client goes on sending for a while after the answer (within the gateway's
    // lingering bounds): every write goes through.
    for i in 0..20 {
        tokio::time::sleep(Duration::from_millis(15)).await;
        let sent = wr.write_all(&[b'y'; 16 * 1024]).await;
        assert!(sent.is_ok(), "write {i} after the answer: {sent:?}");
    }
    wr.shutdown().await.unwrap();
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), rd.read_to_end(&mut rest)).await;
    assert!(matches!(read, Ok(Ok(_))), "a clean close: {read:?}");
    hits.load(Ordering::SeqCst)
}

/// A refused head answered by the inline server while the client is still sending (the
/// rest of its body, more requests behind it): the gateway reads and drops what comes until
/// the client is done.
#[tokio::test]
async fn a_refused_head_is_answered_while_the_client_still_sends() {
    assert_eq!(
        refused_while_the_client_still_sends(b"", CL_AND_TE, b"HTTP/1.1 400").await,
        0
    );
}

/// A refused head: `Content-Length` with `Transfer-Encoding`.
const CL_AND_TE: &[u8] =
    b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n";

/// A body declared over `max_body_bytes` is answered 413 (by hyper's server, before any of
/// it is read) while the client is still uploading it: the client gets the 413, not a reset.
#[tokio::test]
async fn a_body_over_the_limit_is_answered_413_while_the_client_still_uploads() {
    let head = b"POST /up HTTP/1.1\r\nHost: a\r\nContent-Length: 10000000\r\n\r\n";
    assert_eq!(
        refused_while_the_client_still_sends(b"", head, b"HTTP/1.1 413").await,
        0
    );
}

/// A request that asks to switch protocols and is answered otherwise (here its body is over
/// the limit: `413`; a `CONNECT`, which no route takes: `404`) while the client still sends: the client gets the
/// answer and a clean close, not a reset. hyper's server hands such a connection over as if
/// it had switched, unshut; the gateway closes it with its lingering close all the same,
/// over HTTP/1.1 as over HTTP/1.0 (where no switch is set up at all).
#[tokio::test]
async fn a_refused_upgrade_is_answered_while_the_client_still_sends() {
    for (head, status) in [
        (
            &b"POST /up HTTP/1.1\r\nHost: a\r\nConnection: upgrade\r\nUpgrade: websocket\r\nContent-Length: 10000000\r\n\r\n"[..],
            &b"HTTP/1.1 413"[..],
        ),
        (
            b"CONNECT a:443 HTTP/1.1\r\nHost: a:443\r\nContent-Length: 10000000\r\n\r\n",
            b"HTTP/1.1 404",
        ),
        (
            b"POST /up HTTP/1.0\r\nHost: a\r\nUpgrade: x\r\nContent-Length: 10000000\r\n\r\n",
            b"HTTP/1.0 413",
        ),
    ] {
        assert_eq!(
            refused_while_the_client_still_sends(b"", head, status).await,
            0,
            "{}",
            String::from_utf8_lossy(head)
        );
    }
}

/// A client that never stops sending after a refused upgrade is read for the lingering
/// close's bounds once (5 s), not twice: the connection's shut lingered already, and a
/// second linger after it kept the connection for 10 s.
#[tokio::test]
async fn a_refused_upgrade_lingers_once() {
    let (up, _) = counting_upstream().await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\nmax_body_bytes = 100000\n");
    let s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let (mut rd, mut wr) = s.into_split();
    wr.write_all(b"POST /up HTTP/1.1\r\nHost: a\r\nConnection: upgrade\r\nUpgrade: websocket\r\nContent-Length: 10000000\r\n\r\n")
        .await
        .unwrap();
    let mut answer = [0u8; 12];
    rd.read_exact(&mut answer).await.unwrap();
    assert_eq!(&answer[..], b"HTTP/1.1 413");
    let answered = std::time::Instant::now();
    // The gateway shuts its side at once and reads what comes; once it closes the socket,
    // a write gets a reset, and the next one fails. A byte every 100 ms until then.
    let mut failed = false;
    for _ in 0..150 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if wr.write_all(b"y").await.is_err() {
            failed = true;
            break;
        }
    }
    let took = answered.elapsed();
    assert!(failed, "never closed");
    // One linger is 5 s at most; two were 10 s. (No lower bound: a test task held up for
    // a second ends the linger early, by its wait for each read.)
    assert!(
        took < Duration::from_secs(9),
        "closed {took:?} after the answer"
    );
}

/// The same behind the smuggling guard, on a connection hyper's server took over (its first
/// request was chunked).
#[tokio::test]
async fn a_refused_head_behind_the_guard_is_answered_while_the_client_still_sends() {
    let chunked =
        b"POST /c HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n";
    assert_eq!(
        refused_while_the_client_still_sends(chunked, CL_AND_TE, b"HTTP/1.1 400").await,
        1,
        "only the chunked request went upstream"
    );
}

/// An HTTP/2 client that sends its preface and SETTINGS, then nothing (it answers neither
/// requests nor the close's PING): closed a second after its idle timeout, not after two.
#[tokio::test]
async fn a_silent_http2_client_is_closed_a_second_after_its_idle_timeout() {
    let (up, _hits) = counting_upstream().await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\nidle_timeout = \"5s\"");
    let mut c = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    c.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .unwrap();
    let start = tokio::time::Instant::now();
    // When the server's GOAWAY came (its graceful close), and when it closed.
    let closed = tokio::time::timeout(Duration::from_secs(15), async {
        let mut goaway = None;
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match c.read(&mut buf).await {
                Ok(0) | Err(_) => return (goaway, tokio::time::Instant::now()),
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
            while got.len() >= 9 {
                let len = (got[0] as usize) << 16 | (got[1] as usize) << 8 | got[2] as usize;
                if got.len() < 9 + len {
                    break;
                }
                if got[3] == 0x7 && goaway.is_none() {
                    goaway = Some(tokio::time::Instant::now());
                }
                got.drain(..9 + len);
            }
        }
    })
    .await;
    let (goaway, closed_at) = closed.expect("never closed");
    let goaway = goaway.expect("closed without a GOAWAY");
    // 5 s idle, then a second for the close, counted from the GOAWAY the client saw
    // (before: a second idle timeout, 5 s more).
    assert!(
        goaway - start >= Duration::from_millis(4900),
        "closed for idleness after {:?}",
        goaway - start
    );
    assert!(
        closed_at - goaway < Duration::from_millis(3500),
        "closed {:?} after the GOAWAY",
        closed_at - goaway
    );
}

/// HTTP/2 Rapid Reset (CVE-2023-44487): a client that opens streams and cancels them at
/// once, as fast as it can write, gets a GOAWAY `ENHANCE_YOUR_CALM` and a closed
/// connection. (It guards the limit on streams reset before they are taken, whoever sets
/// it; a client that spaces its resets out meets the concurrent-stream limit instead, and
/// each reset cancels its request's work.)
#[tokio::test]
async fn http2_rapid_reset_gets_a_goaway_and_a_close() {
    fn frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
        out.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
        out.extend_from_slice(&[kind, flags]);
        out.extend_from_slice(&stream.to_be_bytes());
        out.extend_from_slice(payload);
    }
    let (up, _hits) = counting_upstream().await;
    let gw = TestGateway::to(up, "");
    let mut c = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    frame(&mut out, 0x4, 0, 0, &[]); // SETTINGS
    // GET http://x/ in HPACK: indexed :method GET, :scheme http, :path /, and :authority
    // as a literal without indexing.
    let block = [0x82, 0x86, 0x84, 0x01, 0x01, b'x'];
    for i in 0..500u32 {
        let stream = 1 + 2 * i;
        frame(&mut out, 0x1, 0x5, stream, &block); // HEADERS, END_STREAM | END_HEADERS
        frame(&mut out, 0x3, 0, stream, &8u32.to_be_bytes()); // RST_STREAM CANCEL
    }
    // The server may close before it has read all of it.
    let _ = c.write_all(&out).await;
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), async {
        let mut buf = [0u8; 16384];
        loop {
            match c.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(read.is_ok(), "the connection was not closed");
    // Walk the server's frames to its GOAWAY.
    let mut at = 0;
    let mut goaway = None;
    while at + 9 <= got.len() {
        let len = u32::from_be_bytes([0, got[at], got[at + 1], got[at + 2]]) as usize;
        let kind = got[at + 3];
        let payload = &got[at + 9..(at + 9 + len).min(got.len())];
        if kind == 0x7 && payload.len() >= 8 {
            goaway = Some(u32::from_be_bytes(payload[4..8].try_into().unwrap()));
        }
        at += 9 + len;
    }
    assert_eq!(
        goaway,
        Some(0xb),
        "expected GOAWAY ENHANCE_YOUR_CALM among the server's frames ({} bytes)",
        got.len()
    );
}

/// A refused HEAD gets its 400 without a body, whichever server read it: the inline one (a
/// connection's first request) or hyper's behind the smuggling guard (after a chunked
/// request handed the connection over). A body after it would be read by the client as the
/// start of a next answer.
#[tokio::test]
async fn a_refused_head_request_gets_no_body() {
    let (up, hits) = counting_upstream().await;
    let gw = TestGateway::to(up, "");
    let bad =
        "HEAD / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n";
    for (server, before) in [
        ("inline", ""),
        (
            "guarded",
            "POST /a HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        ),
    ] {
        let (text, closed) = raw(
            gw.addr,
            format!("{before}{bad}").as_bytes(),
            Duration::from_secs(5),
        )
        .await;
        assert!(closed, "{server}: {text:?}");
        let at = text
            .find("HTTP/1.1 400")
            .unwrap_or_else(|| panic!("{server}: {text:?}"));
        let refusal = &text[at..];
        let head_end = refusal.find("\r\n\r\n").unwrap() + 4;
        assert!(
            refusal
                .to_ascii_lowercase()
                .contains("content-type: application/json"),
            "{server}: {refusal:?}"
        );
        assert_eq!(&refusal[head_end..], "", "{server}: no body after the head");
    }
    assert_eq!(hits.load(Ordering::SeqCst), 1, "only the chunked POST");
    // The HEAD in a write of its own, after the first answer was read: the guard, its
    // buffer drained, reads it straight into hyper's.
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(
        b"POST /a HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    )
    .await
    .unwrap();
    let mut first = Vec::new();
    let mut buf = [0u8; 1024];
    while !String::from_utf8_lossy(&first).contains("\r\n\r\nok") {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "{:?}", String::from_utf8_lossy(&first));
        first.extend_from_slice(&buf[..n]);
    }
    s.write_all(bad.as_bytes()).await.unwrap();
    let (text, closed) = read_until_close(&mut s, Duration::from_secs(5)).await;
    assert!(closed && text.starts_with("HTTP/1.1 400"), "{text:?}");
    let head_end = text.find("\r\n\r\n").unwrap() + 4;
    assert_eq!(&text[head_end..], "", "no body after the head: {text:?}");
}

/// A small body the client's end of stream cuts short (it half-closes with the body still
/// owed): `400`, and the upstream never sees the request, neither its head nor the part of
/// its body that came.
#[tokio::test]
async fn a_small_body_cut_short_by_the_end_of_stream_is_400_and_never_sent_up() {
    let (up, hits) = counting_upstream().await;
    let gw = TestGateway::to(up, "");
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\nabc")
        .await
        .unwrap();
    s.shutdown().await.unwrap();
    let (text, closed) = read_until_close(&mut s, Duration::from_secs(5)).await;
    assert!(text.starts_with("HTTP/1.1 400"), "{text:?}");
    assert!(text.contains("bad_request"), "{text:?}");
    assert!(closed);
    assert_eq!(checkouts(&gw), 0, "never forwarded");
    assert_eq!(hits.load(Ordering::SeqCst), 0, "never sent up");
}

/// Requests whose framing two parsers could read apart (RFC 9112 §5.1, §5.2, §6.1,
/// §7.1.1) get `400` and a close on both HTTP/1.1 paths: the inline server's (a
/// connection's first request) and hyper's behind the guard (a request after a chunked
/// one), and never reach the upstream whole. (A head is refused before anything is sent;
/// a chunked body's bad size line is found as it streams, so the upstream may have had
/// the head, and then its connection is cut.) Unit tests held these rules for each
/// parser; none went over real sockets.
#[tokio::test]
async fn framing_ambiguities_are_refused_on_both_http1_paths() {
    let cases: [&[u8]; 5] = [
        // obs-fold: a line continued by whitespace.
        b"GET / HTTP/1.1\r\nHost: a\r\nX-Long: a\r\n b\r\n\r\n",
        // Whitespace between a name and its colon.
        b"GET / HTTP/1.1\r\nHost : a\r\n\r\n",
        // A bare CR in a value.
        b"GET / HTTP/1.1\r\nHost: a\r\nX-Cr: a\rb\r\n\r\n",
        // Chunked not the last coding: the length is the connection's end, which a
        // server that reads the chunks would not take.
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n",
        // A chunk extension ended by a bare LF.
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3;x\nabc\r\n0\r\n\r\n",
    ];
    let chunked_first: &[u8] =
        b"POST /first HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n";
    // Counts the requests whose body came whole.
    let whole = Arc::new(AtomicUsize::new(0));
    let w = whole.clone();
    let up = upstream(move |req: http::Request<hyper::body::Incoming>| {
        let w = w.clone();
        async move {
            if http_body_util::BodyExt::collect(req.into_body())
                .await
                .is_ok()
            {
                w.fetch_add(1, Ordering::SeqCst);
            }
            http::Response::new(full("ok"))
        }
    })
    .await;
    for case in cases {
        let shown = String::from_utf8_lossy(case).into_owned();
        whole.store(0, Ordering::SeqCst);
        let hits = &whole;
        // The inline server's path: the connection's first request.
        let gw = TestGateway::to(up, "[server]\nworkers = 1\n");
        let (text, closed) = raw(gw.addr, case, Duration::from_secs(5)).await;
        assert!(text.starts_with("HTTP/1.1 400"), "{shown:?}: {text:?}");
        assert!(closed, "{shown:?}: not closed");
        assert_eq!(
            hits.load(Ordering::SeqCst),
            0,
            "{shown:?} reached the upstream"
        );
        // Behind the guard: after a chunked request on the same connection.
        let bytes = [chunked_first, case].concat();
        let (text, closed) = raw(gw.addr, &bytes, Duration::from_secs(5)).await;
        assert!(text.starts_with("HTTP/1.1 200"), "{shown:?}: {text:?}");
        let second = text.get(12..).unwrap_or("");
        assert!(second.contains("HTTP/1.1 400"), "{shown:?}: {text:?}");
        assert!(closed, "{shown:?}: not closed after the chunked one");
        assert_eq!(
            hits.load(Ordering::SeqCst),
            1,
            "{shown:?} reached the upstream"
        );
    }
}
