//! The HTTP/1.1 upstream client, against a raw-socket upstream that writes scripted bytes:
//! what goes on the wire to the upstream, and every response framing the gateway must read
//! (interim 1xx, chunked with extensions and trailers, until close, HTTP/1.0, Transfer-
//! Encoding over Content-Length), malformed responses, bodies cut short, and an upstream that
//! answers before the request body ends. Connection reuse is asserted by counting the
//! upstream's accepted connections.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the upstream does with its `n`-th request (counted over all connections): the
/// bytes to answer, and whether to close the connection after them.
type Script = fn(usize) -> (Vec<u8>, bool);

struct Scripted {
    addr: std::net::SocketAddr,
    conns: Arc<AtomicUsize>,
    /// Every request as received: head and body, raw.
    requests: Arc<Mutex<Vec<String>>>,
}

/// An upstream that reads each request (head, then a Content-Length or chunked body) and
/// answers with `script`. With `head_only`, it answers as soon as the head is in.
async fn scripted(script: Script, head_only: bool) -> Scripted {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let conns = Arc::new(AtomicUsize::new(0));
    let requests = Arc::new(Mutex::new(Vec::new()));
    let count = Arc::new(AtomicUsize::new(0));
    let (c, r) = (conns.clone(), requests.clone());
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            c.fetch_add(1, Ordering::SeqCst);
            let (r, count) = (r.clone(), count.clone());
            tokio::spawn(async move {
                let mut buf = Vec::new();
                while let Some(req) = read_request(&mut s, &mut buf, head_only).await {
                    r.lock().unwrap().push(req);
                    let (answer, close) = script(count.fetch_add(1, Ordering::SeqCst));
                    if s.write_all(&answer).await.is_err() {
                        return;
                    }
                    if close {
                        let _ = s.shutdown().await;
                        return;
                    }
                }
            });
        }
    });
    Scripted {
        addr,
        conns,
        requests,
    }
}

/// An upstream that answers every request `200 ok`.
async fn ok_upstream() -> Scripted {
    scripted(
        |_| answer("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", false),
        false,
    )
    .await
}

/// One request off `s` (bytes past it stay in `buf`); `None` at end of stream.
async fn read_request(s: &mut TcpStream, buf: &mut Vec<u8>, head_only: bool) -> Option<String> {
    let mut chunk = [0u8; 16384];
    let head_end = read_head(s, buf).await?;
    let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
    let body_end = if head_only {
        head_end
    } else if head.contains("transfer-encoding: chunked") {
        loop {
            if let Some(i) = buf[head_end..].windows(5).position(|w| w == b"0\r\n\r\n") {
                break head_end + i + 5;
            }
            let n = s.read(&mut chunk).await.ok()?;
            if n == 0 {
                return None;
            }
            buf.extend_from_slice(&chunk[..n]);
        }
    } else {
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .map_or(0, |v| v.trim().parse().unwrap());
        while buf.len() < head_end + len {
            let n = s.read(&mut chunk).await.ok()?;
            if n == 0 {
                return None;
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        head_end + len
    };
    let req = String::from_utf8_lossy(&buf[..body_end]).into_owned();
    buf.drain(..body_end);
    Some(req)
}

/// Sends `method path` with no body on `c` and reads the whole answer.
async fn fetch(
    c: &mut hyper::client::conn::http1::SendRequest<TestBody>,
    method: &str,
    path: &str,
) -> Result<http::Response<bytes::Bytes>, String> {
    send(c, method, path, full("")).await
}

/// `n` GETs in a row on one client connection through a gateway in front of `up`.
async fn gets(up: &Scripted, n: usize) -> Vec<Result<http::Response<bytes::Bytes>, String>> {
    let gw = TestGateway::to(up.addr, "");
    let mut c = h1_client(gw.addr).await;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(fetch(&mut c, "GET", "/").await);
    }
    out
}

fn answer(bytes: &str, close: bool) -> (Vec<u8>, bool) {
    (bytes.as_bytes().to_vec(), close)
}

/// Content-Length the upstream repeats (`2, 2`, or two equal fields) reaches the client
/// once, and none on a 204 (RFC 9110 §8.6): here an HTTP/2 client, whose server passes the
/// header map on as it is (the inline HTTP/1.1 server writes its own length).
#[tokio::test]
async fn a_repeated_content_length_goes_on_once_and_a_204_has_none() {
    let up = scripted(
        |i| {
            answer(
                match i % 3 {
                    0 => "HTTP/1.1 200 OK\r\ncontent-length: 2, 2\r\n\r\nok",
                    1 => "HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 2\r\n\r\nok",
                    _ => "HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\n",
                },
                false,
            )
        },
        false,
    )
    .await;
    let gw = TestGateway::to(up.addr, "");
    let (mut c, _conn) = h2c_client(gw.addr).await;
    for i in 0..6 {
        let req = http::Request::get(format!("http://a.test/{i}"))
            .body(full(""))
            .unwrap();
        let resp = c
            .send_request(req)
            .await
            .unwrap_or_else(|e| panic!("answer {i}: {e}"));
        let lengths: Vec<_> = resp
            .headers()
            .get_all("content-length")
            .iter()
            .map(|v| v.to_str().unwrap().to_owned())
            .collect();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        if i % 3 == 2 {
            assert!(lengths.is_empty(), "answer {i}: {lengths:?}");
            assert!(body.is_empty());
        } else {
            assert_eq!(lengths, ["2"], "answer {i}");
            assert_eq!(body.as_ref(), b"ok");
        }
    }
}

/// A response head that comes a byte at a time, a 1xx with part of the final head and the
/// rest later, or empty lines before it, is read whole (the head is parsed only when a line
/// of it has ended): on one connection, each answer in turn.
#[tokio::test]
async fn a_head_that_trickles_in_is_read() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = l.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        // Each write its own segment.
        s.set_nodelay(true).unwrap();
        let mut buf = Vec::new();
        let answer: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nx-a: b\r\ncontent-length: 2\r\n\r\nok";
        // A byte at a time.
        if read_request(&mut s, &mut buf, false).await.is_none() {
            return;
        }
        for b in answer {
            s.write_all(&[*b]).await.unwrap();
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // The 1xx and part of the final head, then the rest.
        if read_request(&mut s, &mut buf, false).await.is_none() {
            return;
        }
        let cut = answer.len() - 25;
        s.write_all(&answer[..cut]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        s.write_all(&answer[cut..]).await.unwrap();
        // Empty lines first, a byte at a time (the parser skips them; they are dropped as
        // they come).
        if read_request(&mut s, &mut buf, false).await.is_none() {
            return;
        }
        for b in b"\r\n\n\r\n\n" {
            s.write_all(&[*b]).await.unwrap();
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        s.write_all(answer).await.unwrap();
        let _ = read_request(&mut s, &mut buf, false).await;
    });
    let gw = TestGateway::to(up, "");
    let mut c = h1_client(gw.addr).await;
    for i in 0..3 {
        let r = tokio::time::timeout(Duration::from_secs(5), fetch(&mut c, "GET", "/"))
            .await
            .unwrap_or_else(|_| panic!("answer {i} never read"))
            .unwrap();
        assert_eq!(r.status(), 200, "answer {i}");
        assert_eq!(r.headers()["x-a"], "b", "answer {i}");
        assert_eq!(r.body().as_ref(), b"ok", "answer {i}");
    }
}

#[tokio::test]
async fn interim_responses_are_skipped_and_the_connection_reused() {
    let up = scripted(
        |_| {
            answer(
                "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </s.css>\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
                false,
            )
        },
        false,
    )
    .await;
    for r in gets(&up, 3).await {
        let r = r.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.body().as_ref(), b"ok");
    }
    assert_eq!(
        up.conns.load(Ordering::SeqCst),
        1,
        "one upstream connection"
    );
}

/// An upstream that answers with nothing but empty lines, on and on, gets a `502` soon
/// (past 1 KiB of them), not the response timeout: the empty lines were dropped as they
/// came, so the head's 64 KiB limit never tripped, and the worker read them for the whole
/// response timeout. The request is not sent again (the server had it).
#[tokio::test]
async fn an_endless_run_of_empty_lines_is_a_bad_response() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = l.local_addr().unwrap();
    let conns = Arc::new(AtomicUsize::new(0));
    let c = conns.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            c.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                if read_request(&mut s, &mut buf, false).await.is_none() {
                    return;
                }
                let blank = b"\r\n".repeat(64);
                while s.write_all(&blank).await.is_ok() {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            });
        }
    });
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\nresponse_timeout = \"60s\"\n"
    ));
    let mut c = h1_client(gw.addr).await;
    let r = tokio::time::timeout(Duration::from_secs(20), fetch(&mut c, "GET", "/"))
        .await
        .expect("answered before the response timeout")
        .unwrap();
    assert_eq!(r.status(), 502);
    assert_eq!(conns.load(Ordering::SeqCst), 1, "sent again");
}

#[tokio::test]
async fn chunked_responses_are_decoded_and_trailers_dropped() {
    let up = scripted(
        |_| {
            answer(
                "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nx-trailer: 1\r\n\r\n",
                false,
            )
        },
        false,
    )
    .await;
    for r in gets(&up, 3).await {
        let r = r.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.body().as_ref(), b"hello world");
    }
    assert_eq!(
        up.conns.load(Ordering::SeqCst),
        1,
        "one upstream connection"
    );
}

#[tokio::test]
async fn a_body_until_close_is_passed_whole_and_its_connection_not_reused() {
    let up = scripted(
        |_| answer("HTTP/1.1 200 OK\r\n\r\nuntil the end", true),
        false,
    )
    .await;
    for r in gets(&up, 3).await {
        let r = r.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.body().as_ref(), b"until the end");
    }
    assert_eq!(
        up.conns.load(Ordering::SeqCst),
        3,
        "a connection per response"
    );
}

#[tokio::test]
async fn http10_responses_are_not_kept_alive_unless_they_say_so() {
    // The upstream keeps every connection open; only the gateway can decide not to reuse.
    let up = scripted(
        |n| {
            if n < 2 {
                answer("HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok", false)
            } else {
                answer(
                    "HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 2\r\n\r\nok",
                    false,
                )
            }
        },
        false,
    )
    .await;
    for r in gets(&up, 4).await {
        let r = r.unwrap();
        assert_eq!(r.body().as_ref(), b"ok");
    }
    // Requests 0 and 1 closed their connections; 2 kept its, and 3 reused it.
    assert_eq!(up.conns.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn transfer_encoding_overrides_content_length() {
    let up = scripted(
        |_| {
            answer(
                "HTTP/1.1 200 OK\r\ncontent-length: 100\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
                false,
            )
        },
        false,
    )
    .await;
    let gw = TestGateway::to(up.addr, "");
    let mut c = h1_client(gw.addr).await;
    let r = fetch(&mut c, "GET", "/").await.unwrap();
    assert_eq!(r.body().as_ref(), b"ok");
    assert!(
        r.headers().get("content-length").is_none_or(|v| v == "2"),
        "{:?}",
        r.headers()
    );
}

#[tokio::test]
async fn malformed_response_heads_are_502() {
    let up = scripted(
        |n| {
            let head = match n {
                0 => {
                    "HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nok".to_owned()
                }
                1 => "SSH-2.0-OpenSSH_9.2\r\n\r\n".to_owned(),
                2 => format!(
                    "HTTP/1.1 200 OK\r\nx-big: {}\r\ncontent-length: 2\r\n\r\nok",
                    "a".repeat(70 * 1024)
                ),
                3 => "HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n".to_owned(),
                _ => "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok".to_owned(),
            };
            (head.into_bytes(), true)
        },
        false,
    )
    .await;
    let gw = TestGateway::to(up.addr, "");
    for case in 0..4 {
        let mut c = h1_client(gw.addr).await;
        // POST: never replayed, so each case meets exactly one scripted answer.
        let r = fetch(&mut c, "POST", "/").await.unwrap();
        assert_eq!(r.status(), 502, "case {case}");
        let body: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
        assert_eq!(body["error"], "upstream_reset", "case {case}");
    }
    let mut c = h1_client(gw.addr).await;
    let r = fetch(&mut c, "POST", "/").await.unwrap();
    assert_eq!(r.status(), 200, "a good answer after the bad ones");
}

#[tokio::test]
async fn a_body_cut_short_fails_the_client_response() {
    let up = scripted(
        |n| match n {
            // Content-Length promises 10 bytes; 3 come, then the close.
            0 => answer("HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc", true),
            // A chunk size that is not hex.
            1 => answer(
                "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\nzz\r\n",
                true,
            ),
            // Chunked, closed before the last chunk.
            _ => answer(
                "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n",
                true,
            ),
        },
        false,
    )
    .await;
    let gw = TestGateway::to(up.addr, "");
    for case in 0..3 {
        let mut c = h1_client(gw.addr).await;
        let r = fetch(&mut c, "POST", "/").await;
        assert!(
            r.is_err(),
            "case {case}: the client must see the body fail: {r:?}"
        );
    }
    assert_eq!(
        gw.gw
            .as_ref()
            .unwrap()
            .pool_stat(|s| s.reuses.load(Ordering::Relaxed)),
        0,
        "no broken connection is reused"
    );
}

#[tokio::test]
async fn an_answer_before_the_body_ends_reaches_the_client() {
    // The upstream answers as soon as it has the head, and closes.
    let up = scripted(
        |_| {
            answer(
                "HTTP/1.1 413 Payload Too Large\r\ncontent-length: 8\r\nconnection: close\r\n\r\ntoo much",
                true,
            )
        },
        true,
    )
    .await;
    let gw = TestGateway::to(up.addr, "");
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    // Declares a megabyte, sends a kilobyte, and waits for the answer.
    s.write_all(b"POST /upload HTTP/1.1\r\nhost: a\r\ncontent-length: 1048576\r\n\r\n")
        .await
        .unwrap();
    s.write_all(&[b'x'; 1024]).await.unwrap();
    let (text, _) = read_until_close(&mut s, Duration::from_secs(5)).await;
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(text.ends_with("too much"), "{text}");
}

/// An upstream that answers early and says it closes (a whole answer of its own, such as a
/// refusal) is not cut short when the rest of the client's body then fails (here, past
/// `max_body_bytes`): that body is no longer the server's business, so the gateway stops
/// sending it, and the client gets the whole answer.
#[tokio::test]
async fn an_early_answer_that_closes_is_not_cut_by_the_rest_of_the_clients_body() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut buf = Vec::new();
        read_head(&mut s, &mut buf).await.unwrap();
        s.write_all(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 200000\r\n\r\n")
            .await
            .unwrap();
        for _ in 0..10 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if s.write_all(&[b'y'; 20000]).await.is_err() {
                return;
            }
        }
        // Reads what comes until the gateway is done, then closes.
        let mut sink = [0u8; 4096];
        while matches!(
            tokio::time::timeout(Duration::from_millis(200), s.read(&mut sink)).await,
            Ok(Ok(n)) if n > 0
        ) {}
    });
    let gw = TestGateway::to(addr, "[server]\nworkers = 1\nmax_body_bytes = 1000");
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"POST /up HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n")
        .await
        .unwrap();
    let chunk = [b"100\r\n".to_vec(), vec![b'x'; 256], b"\r\n".to_vec()].concat();
    s.write_all(&chunk).await.unwrap();
    let mut got = Vec::new();
    let head_end = read_head(&mut s, &mut got).await.unwrap();
    assert!(got.starts_with(b"HTTP/1.1 200"), "{got:?}");
    // Past the limit, while the answer comes.
    for _ in 0..4 {
        if s.write_all(&chunk).await.is_err() {
            break;
        }
    }
    let (rest, closed) = read_until_close(&mut s, Duration::from_secs(10)).await;
    assert!(closed);
    let body = got.len() - head_end + rest.len();
    assert_eq!(body, 200000, "the answer was cut");
}

#[tokio::test]
async fn the_request_goes_out_in_origin_form_with_its_framing() {
    let up = ok_upstream().await;
    let gw = TestGateway::to(up.addr, "");
    // A GET with a query, a hop-by-hop header and TE.
    let (text, _) = raw(
        gw.addr,
        b"GET /p/q?x=1&y=2 HTTP/1.1\r\nhost: api.test\r\nconnection: x-hop\r\nx-hop: 1\r\nte: trailers\r\nx-forwarded-for: 10.9.9.9\r\nx-request-id: rid-1\r\nvia: 1.1 edge\r\n\r\n",
        Duration::from_millis(500),
    )
    .await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    // A POST with a Content-Length body, and one with a chunked body.
    let (text, _) = raw(
        gw.addr,
        b"POST /c HTTP/1.1\r\nhost: api.test\r\ncontent-length: 5\r\n\r\nhello",
        Duration::from_millis(500),
    )
    .await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let (text, _) = raw(
        gw.addr,
        b"POST /t HTTP/1.1\r\nhost: api.test\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
        Duration::from_millis(500),
    )
    .await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");

    let seen = up.requests.lock().unwrap().clone();
    assert_eq!(seen.len(), 3, "{seen:?}");
    let get = seen[0].to_lowercase();
    assert!(get.starts_with("get /p/q?x=1&y=2 http/1.1\r\n"), "{get}");
    assert!(get.contains("\r\nhost: api.test\r\n"), "{get}");
    // The client's X-Forwarded-For, request id and Via are kept, once each, with the
    // gateway's additions.
    assert!(
        get.contains("\r\nx-forwarded-for: 10.9.9.9, 127.0.0.1\r\n"),
        "{get}"
    );
    assert_eq!(get.matches("x-forwarded-for:").count(), 1, "{get}");
    assert!(get.contains("\r\nx-request-id: rid-1\r\n"), "{get}");
    assert_eq!(get.matches("x-request-id:").count(), 1, "{get}");
    assert!(get.contains("\r\nvia: 1.1 edge\r\n"), "{get}");
    assert!(get.contains("\r\nvia: 1.1 tailgate\r\n"), "{get}");
    assert!(get.contains("\r\nx-forwarded-proto: http\r\n"), "{get}");
    assert!(get.contains("\r\nx-forwarded-host: api.test\r\n"), "{get}");
    for gone in [
        "\r\nte:",
        "\r\nx-hop:",
        "\r\nconnection:",
        "content-length",
        "transfer-encoding",
    ] {
        assert!(!get.contains(gone), "{gone} in {get}");
    }
    let post = seen[1].to_lowercase();
    assert!(post.starts_with("post /c http/1.1\r\n"), "{post}");
    assert!(post.contains("\r\ncontent-length: 5\r\n"), "{post}");
    assert!(post.ends_with("\r\n\r\nhello"), "{post}");
    let chunked = seen[2].to_lowercase();
    assert!(
        chunked.contains("\r\ntransfer-encoding: chunked\r\n"),
        "{chunked}"
    );
    assert!(!chunked.contains("content-length"), "{chunked}");
    assert!(
        chunked.ends_with("\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"),
        "{chunked}"
    );
}

/// Upstream connections the gateway's pools reused.
fn reuses(gw: &TestGateway) -> u64 {
    gw.gw
        .as_ref()
        .unwrap()
        .pool_stat(|s| s.reuses.load(Ordering::Relaxed))
}

/// One worker in front of an upstream that answers `/slow` after 200 ms, `/mid` after
/// 700 ms, `/hang` after 5 s and anything else at once, with `response_timeout`.
async fn deadline_gateway(response_timeout: &str) -> TestGateway {
    let up = upstream(|req: http::Request<hyper::body::Incoming>| async move {
        let wait = match req.uri().path() {
            "/slow" => 200,
            "/mid" => 700,
            "/hang" => 5_000,
            _ => 0,
        };
        tokio::time::sleep(Duration::from_millis(wait)).await;
        http::Response::new(full("ok"))
    })
    .await;
    TestGateway::start(&format!(
        "[server]\nworkers = 1\n[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\nresponse_timeout = \"{response_timeout}\"\n"
    ))
}

/// The response deadline is re-armed for each request on a reused connection: a request
/// later on the same connection gets its own full timeout (not what was left of the
/// first one's), and one that overruns it gets a 504.
#[tokio::test]
async fn each_request_on_a_reused_connection_gets_its_own_deadline() {
    let gw = deadline_gateway("400ms").await;
    let mut c = h1_client(gw.addr).await;
    assert_eq!(fetch(&mut c, "GET", "/fast").await.unwrap().status(), 200);
    // Past the first request's deadline: the next one must not inherit it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(fetch(&mut c, "GET", "/slow").await.unwrap().status(), 200);
    assert_eq!(fetch(&mut c, "GET", "/slow").await.unwrap().status(), 200);
    assert_eq!(fetch(&mut c, "GET", "/hang").await.unwrap().status(), 504);
    assert_eq!(fetch(&mut c, "GET", "/fast").await.unwrap().status(), 200);
    assert!(
        reuses(&gw) >= 2,
        "the slow requests went on the first request's connection"
    );
}

/// A request sent on a reused connection before the last one's deadline passed is not cut
/// at that deadline: the connection's timer, armed for the earlier one, is moved on to
/// this request's own when it fires.
#[tokio::test]
async fn a_deadline_left_from_the_last_request_does_not_cut_the_next() {
    let gw = deadline_gateway("1s").await;
    let mut c = h1_client(gw.addr).await;
    assert_eq!(fetch(&mut c, "GET", "/fast").await.unwrap().status(), 200);
    // Half-way to the first request's deadline; answered 200 ms past it, 300 ms before
    // its own.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(fetch(&mut c, "GET", "/mid").await.unwrap().status(), 200);
    assert_eq!(fetch(&mut c, "GET", "/hang").await.unwrap().status(), 504);
    assert!(
        reuses(&gw) >= 2,
        "the requests went on the first request's connection"
    );
}

// ---- review-h1: regression tests for defects found in review ----

/// Sends raw `request` through a gateway to an upstream that answers `200 ok`; returns the
/// request as the upstream received it, lower-cased.
async fn as_received(request: &[u8]) -> String {
    let up = ok_upstream().await;
    let gw = TestGateway::to(up.addr, "");
    let (text, _) = raw(gw.addr, request, Duration::from_millis(500)).await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    up.requests.lock().unwrap()[0].to_lowercase()
}

/// RFC 9112 §3.2.2: a request in absolute-form is routed by its target's authority, so the
/// Host sent upstream must be that authority, not the client's (different) Host header.
#[tokio::test]
async fn r_absolute_form_target_replaces_the_host_header() {
    let req = as_received(b"GET http://routed.test/x HTTP/1.1\r\nhost: other.test\r\n\r\n").await;
    assert!(req.contains("\r\nhost: routed.test\r\n"), "{req}");
    assert!(!req.contains("other.test"), "{req}");
}

/// An absolute-form target with a query and no path (`http://host?q`, found by the request
/// fuzzer) goes upstream as `/?q` (RFC 9112 §3.2.1: an empty path is `/`), not as `?q`, a
/// request line the upstream refuses with a 400 the client could not tell from its own.
#[tokio::test]
async fn r_absolute_form_without_a_path_goes_upstream_as_slash() {
    let req =
        as_received(b"GET http://routed.test?l=1 HTTP/1.1\r\nhost: routed.test\r\n\r\n").await;
    assert!(req.starts_with("get /?l=1 http/1.1\r\n"), "{req}");
    let req = as_received(b"GET http://routed.test HTTP/1.1\r\nhost: routed.test\r\n\r\n").await;
    assert!(req.starts_with("get / http/1.1\r\n"), "{req}");
}

/// Login info in an absolute-form target (`user@`) is an error (RFC 9110 §4.2.4): `400`,
/// and nothing reaches the upstream (its Host or X-Forwarded-Host least of all).
#[tokio::test]
async fn r_absolute_form_userinfo_is_refused() {
    let up = ok_upstream().await;
    let gw = TestGateway::to(up.addr, "");
    let (text, _) = raw(
        gw.addr,
        b"GET http://evil:pw@routed.test:8080/x HTTP/1.1\r\nhost: routed.test:8080\r\n\r\n",
        Duration::from_millis(500),
    )
    .await;
    assert!(text.starts_with("HTTP/1.1 400"), "{text}");
    assert!(
        text.contains("invalid host in the request target"),
        "{text}"
    );
    assert!(up.requests.lock().unwrap().is_empty());
}

/// `101 Switching Protocols` to a request that asked for no upgrade is a bad answer (502):
/// passed on, it would tell the client its connection now speaks another protocol.
#[tokio::test]
async fn r_unsolicited_switching_protocols_is_a_502() {
    let up = scripted(
        |_| {
            answer(
                "HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n",
                false,
            )
        },
        false,
    )
    .await;
    let r = gets(&up, 1).await.remove(0).expect("an answer");
    assert_eq!(r.status(), 502, "{:?}", r.headers());
    assert!(
        String::from_utf8_lossy(r.body()).contains("upstream_reset"),
        "{:?}",
        r.body()
    );
}

/// More than 32 interim (1xx) responses before the final one end the exchange with a 502;
/// a server streaming them would otherwise hold the request until its response timeout.
#[tokio::test]
async fn r_endless_interim_responses_are_a_502() {
    fn flood(_: usize) -> (Vec<u8>, bool) {
        let mut a = "HTTP/1.1 100 Continue\r\n\r\n".repeat(33);
        a.push_str("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok");
        (a.into_bytes(), false)
    }
    let up = scripted(flood, false).await;
    let r = gets(&up, 1).await.remove(0).expect("an answer");
    assert_eq!(r.status(), 502, "{:?}", r.body());
}

/// A malformed answer on a reused connection is an answer: the server had the request, so
/// it is not sent again (only a connection that failed before answering is retried).
#[tokio::test]
async fn r_a_malformed_answer_is_not_replayed() {
    fn script(n: usize) -> (Vec<u8>, bool) {
        match n {
            0 => answer("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", false),
            1 => answer("HTTP/1.1 2x0 Nope\r\n\r\n", true),
            _ => answer("HTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\nreplayd", false),
        }
    }
    let up = scripted(script, false).await;
    let got = gets(&up, 2).await;
    assert_eq!(got[0].as_ref().expect("first").status(), 200);
    let second = got[1].as_ref().expect("an answer");
    assert_eq!(second.status(), 502, "{:?}", second.body());
    assert_eq!(up.requests.lock().unwrap().len(), 2, "sent once each");
}

/// A request replayed after its reused connection failed gets what is left of its deadline:
/// with a 3 s total timeout and the failure 2 s in, the resend has about 1 s (the time
/// already spent was counted twice, which left it none: a 504 at once).
#[tokio::test]
async fn r_a_replay_gets_the_rest_of_the_total_deadline() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let mut first = true;
        while let Ok((mut s, _)) = l.accept().await {
            let stall = std::mem::replace(&mut first, false);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let ok = |body: &str| {
                    format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    )
                };
                if stall {
                    read_request(&mut s, &mut buf, false).await;
                    s.write_all(ok("first").as_bytes()).await.unwrap();
                    read_request(&mut s, &mut buf, false).await;
                    // Fails under the second request, without an answer.
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    return;
                }
                while read_request(&mut s, &mut buf, false).await.is_some() {
                    // Well within what is left of the deadline.
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    if s.write_all(ok("resent").as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{addr}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\nresponse_timeout = \"30s\"\ntotal_timeout = \"3s\"\n"
    ));
    let mut c = h1_client(gw.addr).await;
    let a = fetch(&mut c, "GET", "/").await.expect("first");
    assert_eq!(a.body(), "first");
    let b = fetch(&mut c, "GET", "/").await.expect("second");
    assert_eq!(b.status(), 200, "{:?}", b.body());
    assert_eq!(b.body(), "resent");
}

/// A response whose last transfer coding is not chunked (here gzip) is read until close;
/// its Transfer-Encoding header is hop-by-hop and removed, so the client must not get the
/// still-gzip-coded bytes as if they were the identity body (nginx answers 502).
#[tokio::test]
async fn r_unknown_transfer_coding_is_not_passed_off_as_identity() {
    let up = scripted(
        |_| {
            answer(
                "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n\x1f\x08GZIPPED",
                true,
            )
        },
        false,
    )
    .await;
    let gw = TestGateway::to(up.addr, "");
    let mut c = h1_client(gw.addr).await;
    let r = fetch(&mut c, "GET", "/").await.unwrap();
    // (The client's own framing is hyper's re-chunking: only a gzip coding named to the
    // client would keep the bytes meaningful.)
    let coded = r
        .headers()
        .get_all("transfer-encoding")
        .iter()
        .chain(r.headers().get_all("content-encoding").iter())
        .any(|v| v.to_str().unwrap().contains("gzip"));
    assert!(
        r.status() == 502 || coded,
        "client got a transfer-coded body labelled as identity: {:?} {:?} {:?}",
        r.status(),
        r.headers(),
        r.body()
    );
}

/// RFC 9112 §6.3 (3): a response with both Transfer-Encoding and Content-Length "ought to
/// be handled as an error" (response splitting); at the least its connection must not be
/// reused (nginx answers 502: "upstream sent Content-Length and Transfer-Encoding").
#[tokio::test]
async fn r_te_with_content_length_does_not_keep_the_connection() {
    let up = scripted(
        |_| {
            answer(
                "HTTP/1.1 200 OK\r\ncontent-length: 7\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
                false,
            )
        },
        false,
    )
    .await;
    gets(&up, 2).await;
    assert_eq!(up.conns.load(Ordering::SeqCst), 2, "connection reused");
}

/// RFC 9112 §6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing and its
/// connection must be closed after it (hyper's client refuses it outright).
#[tokio::test]
async fn r_http10_with_transfer_encoding_does_not_keep_the_connection() {
    let up = scripted(
        |_| {
            answer(
                "HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
                false,
            )
        },
        false,
    )
    .await;
    gets(&up, 2).await;
    assert_eq!(up.conns.load(Ordering::SeqCst), 2, "connection reused");
}

/// RFC 9112 §3.2: more than one Host header is a 400; the gateway routes by the first and
/// forwards both, so the upstream may pick the other one.
#[tokio::test]
async fn r_two_host_headers_are_refused() {
    let up = ok_upstream().await;
    let gw = TestGateway::to(up.addr, "");
    let (text, _) = raw(
        gw.addr,
        b"GET /x HTTP/1.1\r\nhost: a.test\r\nhost: b.test\r\n\r\n",
        Duration::from_millis(500),
    )
    .await;
    let seen = up.requests.lock().unwrap().clone();
    assert!(
        text.starts_with("HTTP/1.1 400"),
        "{text} / upstream saw {seen:?}"
    );
}

/// RFC 9113 §8.2.3: an HTTP/2 client may split Cookie into several fields; before the
/// request goes into HTTP/1.1 they MUST be joined into one with "; " (nginx does). Many
/// HTTP/1.1 servers read only the first Cookie line.
#[tokio::test]
async fn r_h2_cookie_fields_are_joined_for_http1_upstreams() {
    let up = ok_upstream().await;
    let gw = TestGateway::to(up.addr, "");
    let (mut c, _conn) = h2c_client(gw.addr).await;
    let req = http::Request::get("http://api.test/c")
        .header("cookie", "a=1")
        .header("cookie", "b=2")
        .body(full(""))
        .unwrap();
    let resp = c.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let seen = up.requests.lock().unwrap().clone();
    let req = seen[0].to_lowercase();
    assert_eq!(req.matches("\r\ncookie:").count(), 1, "{req}");
    assert!(req.contains("\r\ncookie: a=1; b=2\r\n"), "{req}");
}

/// The response deadline must hold while the request head is being flushed. Over TLS,
/// `poll_write` only buffers into rustls; the bytes go out in `poll_flush`, and `send()`
/// returns `Pending` from there without polling the deadline timer (h1.rs, the write
/// loop's `poll_flush`). An upstream that stops reading (frozen, or a path that went dark)
/// then holds the request until TCP gives up, far past `response_timeout`.
///
/// The upstream clamps its MSS and receive buffer so that loopback behaves like a real
/// path (a send buffer of tens of KB, not megabytes); the request head is ~48 KB, under
/// rustls's 64 KiB output buffer, so the write "completes" and the flush is what waits.
#[tokio::test]
async fn r_tls_head_flush_is_bounded_by_the_response_deadline() {
    use common::tls::{Pki, ServerOpts, server_config};
    let pki = Pki::new();
    let acceptor = tokio_rustls::TlsAcceptor::from(server_config(&pki, &ServerOpts::default()));
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    sock.set_recv_buffer_size(2048).unwrap();
    sock.set_tcp_mss(536).unwrap();
    sock.bind(
        &"127.0.0.1:0"
            .parse::<std::net::SocketAddr>()
            .unwrap()
            .into(),
    )
    .unwrap();
    sock.listen(16).unwrap();
    sock.set_nonblocking(true).unwrap();
    let l = TcpListener::from_std(std::net::TcpListener::from(sock)).unwrap();
    let up = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = l.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                // Handshake, then never read again (the server is stuck).
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                tokio::time::sleep(Duration::from_secs(30)).await;
                drop(tls);
            });
        }
    });
    let gw = TestGateway::start(&format!(
        "[server]\nworkers = 1\nshutdown_grace = \"1s\"\nmax_header_bytes = 262144\n[[cluster]]\nname = \"up\"\nendpoints = [\"https://{up}\"]\ntls_ca = \"{}\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\nresponse_timeout = \"300ms\"\n",
        pki.path("ca.pem")
    ));
    // Control: a small head goes out whole; the deadline answers 504.
    let (text, _) = raw(
        gw.addr,
        b"GET /small HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n",
        Duration::from_secs(3),
    )
    .await;
    assert!(text.starts_with("HTTP/1.1 504"), "small head: {text:?}");
    // A ~48 KB head: the flush waits on a full socket; the deadline must still answer.
    let mut head = String::from("GET /big HTTP/1.1\r\nhost: a\r\nconnection: close\r\n");
    for i in 0..12 {
        head.push_str(&format!("x-big-{i}: {}\r\n", "a".repeat(4000)));
    }
    head.push_str("\r\n");
    let started = std::time::Instant::now();
    let (text, _) = raw(gw.addr, head.as_bytes(), Duration::from_secs(5)).await;
    assert!(
        text.starts_with("HTTP/1.1 504"),
        "no answer {:?} after the 300 ms deadline: {text:?}",
        started.elapsed()
    );
}

/// Sanity (not a bug claim): an upstream that echoes the body as it arrives, with a client
/// that sends its next piece only after it saw the previous one echoed.
#[tokio::test]
async fn r_interactive_echo_is_full_duplex() {
    let up = echo_upstream().await;
    let gw = TestGateway::to(up, "");
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"POST /e HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let until = |got: &Vec<u8>, w: &str| String::from_utf8_lossy(got).contains(w);
    while !until(&got, "hello") {
        let n = tokio::time::timeout(Duration::from_secs(3), s.read(&mut buf))
            .await
            .expect("first piece echoed")
            .unwrap();
        assert!(n > 0);
        got.extend_from_slice(&buf[..n]);
    }
    s.write_all(b"5\r\nworld\r\n0\r\n\r\n").await.unwrap();
    while !until(&got, "world") {
        let n = tokio::time::timeout(Duration::from_secs(3), s.read(&mut buf))
            .await
            .expect("second piece echoed")
            .unwrap();
        assert!(n > 0);
        got.extend_from_slice(&buf[..n]);
    }
}

/// Sanity (not a bug claim): POSTs with Content-Length bodies keep their upstream
/// connection.
#[tokio::test]
async fn r_posts_with_bodies_reuse_the_connection() {
    let up = scripted(
        |_| answer("HTTP/1.1 201 Created\r\ncontent-length: 0\r\n\r\n", false),
        false,
    )
    .await;
    let gw = TestGateway::to(up.addr, "");
    let mut c = h1_client(gw.addr).await;
    for i in 0..5 {
        let r = c
            .send_request(
                http::Request::post("/p")
                    .header("host", "a")
                    .body(full(format!("body-{i}")))
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
        r.into_body().collect().await.unwrap();
    }
    assert_eq!(up.conns.load(Ordering::SeqCst), 1);
}

/// An upstream that answers its one request with a whole `202` as soon as the head comes
/// (an ingest endpoint answering "202 Accepted" up front), then reads the rest of the body:
/// how many of the body's bytes it has had, and when its connection closed.
async fn early_answering_upstream() -> (
    std::net::SocketAddr,
    Arc<AtomicUsize>,
    tokio::sync::oneshot::Receiver<std::time::Instant>,
) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = l.local_addr().unwrap();
    let received = Arc::new(AtomicUsize::new(0));
    let r = received.clone();
    let (closed_tx, closed) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut buf = Vec::new();
        let mut chunk = [0u8; 16384];
        let head_end = read_head(&mut s, &mut buf).await.unwrap();
        s.write_all(b"HTTP/1.1 202 Accepted\r\ncontent-length: 2\r\n\r\nok")
            .await
            .unwrap();
        r.store(buf.len() - head_end, Ordering::SeqCst);
        while let Ok(n) = s.read(&mut chunk).await {
            if n == 0 {
                break;
            }
            r.fetch_add(n, Ordering::SeqCst);
        }
        let _ = closed_tx.send(std::time::Instant::now());
    });
    (up, received, closed)
}

/// A `POST` of 20,000 bytes to `addr` of which the first 1,000 go with its head; returns
/// once the early answer (`ok`) has come, with the rest of the body still owed.
async fn post_answered_early(addr: std::net::SocketAddr) -> TcpStream {
    let mut c = TcpStream::connect(addr).await.unwrap();
    c.write_all(b"POST /ingest HTTP/1.1\r\nhost: a\r\ncontent-length: 20000\r\n\r\n")
        .await
        .unwrap();
    c.write_all(&[b'x'; 1000]).await.unwrap();
    let mut resp = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&resp).ends_with("ok") {
        let n = tokio::time::timeout(Duration::from_secs(3), c.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0);
        resp.extend_from_slice(&buf[..n]);
    }
    c
}

/// Until `received` reaches `want` (within 2 s).
async fn received_all(received: &AtomicUsize, want: usize) {
    let t = std::time::Instant::now();
    while received.load(Ordering::SeqCst) < want {
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "upload cut short: {} bytes received",
            received.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// An upstream that answers a complete 2xx before the upload ends and keeps reading the
/// body gets the whole body, as hyper's client, which this code replaced, wrote it; then
/// the connection is closed, not pooled: a server that answered without reading the body
/// might take it for its next request (nginx keeps no such connection either).
#[tokio::test]
async fn r_early_complete_answer_keeps_the_upload_going_then_closes() {
    let (up, received, closed) = early_answering_upstream().await;
    let gw = TestGateway::to(up, "");
    let mut c = post_answered_early(gw.addr).await;
    let _ = c.write_all(&[b'x'; 19_000]).await;
    // The whole body reached the upstream, then the connection was closed at once (hyper's
    // server ends such a body only at the client's next head).
    received_all(&received, 20_000).await;
    tokio::time::timeout(Duration::from_secs(2), closed)
        .await
        .expect("the connection was kept")
        .unwrap();
    let pool = gw.gw.as_ref().unwrap().endpoint_pools()[0].clone();
    assert_eq!(pool.idle_len(), 0);
}

/// The rest of an upload after an early answer goes on while it moves, however long it
/// takes in all: only a stop for the cluster's `idle_timeout` cuts it (a limit on the
/// whole rest cut a slow upload after that long, the client told it succeeded and the
/// upstream left with part of the body).
#[tokio::test]
async fn r_early_answer_upload_is_cut_only_when_it_stops_moving() {
    let (up, received, _closed) = early_answering_upstream().await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\nidle_timeout = \"1s\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
    ));
    let mut c = post_answered_early(gw.addr).await;
    // 2.4 s more of upload, a piece every 125 ms: well past the 1 s idle timeout in all.
    for _ in 0..19 {
        tokio::time::sleep(Duration::from_millis(125)).await;
        c.write_all(&[b'x'; 1000]).await.unwrap();
    }
    received_all(&received, 20_000).await;
}

/// And one that stops moving is cut after the cluster's `idle_timeout` (1 s here): the
/// upstream connection is closed, not held open for a client that sends no more.
#[tokio::test]
async fn r_early_answer_upload_that_stops_is_cut() {
    let (up, _received, closed) = early_answering_upstream().await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\nidle_timeout = \"1s\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
    ));
    // (Read before the body's last bytes go: its last progress is after this.)
    let sent = std::time::Instant::now();
    let c = post_answered_early(gw.addr).await;
    let at = tokio::time::timeout(Duration::from_secs(5), closed)
        .await
        .expect("the upstream connection was held open")
        .unwrap();
    assert!(
        at - sent >= Duration::from_secs(1),
        "cut before the idle timeout"
    );
    drop(c);
}

/// An HTTP/2 client may end its body with an empty end-of-stream frame after the last
/// data. Sent on with its `Content-Length` to an HTTP/1.1 upstream that answers once it has
/// every byte, the answer ends before the client's body does: no early answer, and the
/// connection is pooled once that end comes (one connection for both requests).
#[tokio::test]
async fn r_an_answer_after_the_whole_length_keeps_the_connection_for_a_late_end_of_stream() {
    let up = echo_upstream().await;
    let gw = TestGateway::to(up, "");
    let (mut c, _conn) = h2c_client(gw.addr).await;
    for _ in 0..2 {
        let pieces = futures_util::stream::unfold(0, |i| async move {
            match i {
                0 => Some((
                    Ok(hyper::body::Frame::data(bytes::Bytes::from_static(
                        b"hello",
                    ))),
                    1,
                )),
                // The end, on its own, well after the answer.
                _ => {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    None
                }
            }
        });
        let req = http::Request::post("http://a/up")
            .header("content-length", "5")
            .body(http_body_util::StreamBody::new(pieces).boxed())
            .unwrap();
        let resp = c.send_request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"hello");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let pool = gw.gw.as_ref().unwrap().endpoint_pools()[0].clone();
    assert_eq!(
        pool.stats.connects_on_request.load(Ordering::SeqCst),
        1,
        "the second request had to connect again"
    );
}

/// The response timeout counts from the request body's last progress while it is being
/// sent: an upload slower than the timeout that keeps moving reaches the upstream whole and
/// gets its answer (it used to be cut off with a 504 mid-upload). One that stops is a 408,
/// the client's fault: it does not count against the endpoint (here, one failure would eject
/// it).
#[tokio::test]
async fn a_slow_upload_is_not_cut_off_and_a_stalled_one_is_the_clients_fault() {
    let up = body_counting_upstream().await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\neject_after_failures = 1\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\nresponse_timeout = \"300ms\"\n"
    ));
    let mut c = h1_client(gw.addr).await;
    // 1.2 s of upload, a piece every 100 ms, against a 300 ms response timeout.
    let slow = trickle(13, 1000, Duration::from_millis(100), None);
    let r = post(&mut c, slow).await.unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.body());
    assert_eq!(r.body(), "got 13000");

    let mut c = h1_client(gw.addr).await;
    let started = std::time::Instant::now();
    let stalled = trickle(10, 1000, Duration::from_millis(20), Some(2));
    let r = post(&mut c, stalled).await.unwrap();
    assert_eq!(r.status(), 408, "{:?}", r.body());
    assert_eq!(r.headers()["connection"], "close", "{:?}", r.headers());
    assert!(
        String::from_utf8_lossy(r.body()).contains("client_body_timeout"),
        "{:?}",
        r.body()
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    let pools = gw.gw.as_ref().unwrap().endpoint_pools();
    assert_eq!(pools[0].load.ejections.load(Ordering::Relaxed), 0);

    // The endpoint still serves.
    let mut c = h1_client(gw.addr).await;
    assert_eq!(fetch(&mut c, "GET", "/").await.unwrap().status(), 200);
}

/// An upload with a Content-Length that streams in and ends, to an upstream that takes it
/// all and never answers: `504`, the upstream's fault, not the client's `408` (the body's
/// end is seen from its length, not from a poll for it after the last piece).
#[tokio::test]
async fn a_whole_upload_unanswered_is_the_upstreams_timeout() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                if read_request(&mut s, &mut buf, false).await.is_some() {
                    tokio::time::sleep(Duration::from_secs(60)).await;
                }
            });
        }
    });
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\nresponse_timeout = \"1s\"\n"
    ));
    let mut c = TcpStream::connect(gw.addr).await.unwrap();
    c.write_all(b"POST /in HTTP/1.1\r\nhost: a\r\ncontent-length: 20000\r\n\r\n")
        .await
        .unwrap();
    for _ in 0..4 {
        c.write_all(&[b'x'; 5000]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut resp = Vec::new();
    let mut chunk = [0u8; 4096];
    while !resp.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(5), c.read(&mut chunk))
            .await
            .expect("an answer")
            .unwrap();
        assert!(n > 0);
        resp.extend_from_slice(&chunk[..n]);
    }
    let text = String::from_utf8_lossy(&resp);
    assert!(text.starts_with("HTTP/1.1 504"), "{text}");
}

/// An upstream that sends a head and part of its body: all of it at once and then nothing
/// (`trickle` 0), or the rest a few bytes every `trickle` ms. It holds the connection open.
async fn part_body_upstream(trickle_ms: u64) -> std::net::SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                if read_request(&mut s, &mut buf, true).await.is_none() {
                    return;
                }
                s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789")
                    .await
                    .unwrap();
                if trickle_ms > 0 {
                    for _ in 0..9 {
                        tokio::time::sleep(Duration::from_millis(trickle_ms)).await;
                        if s.write_all(b"abcdefghij").await.is_err() {
                            return;
                        }
                    }
                }
                tokio::time::sleep(Duration::from_secs(60)).await;
            });
        }
    });
    addr
}

/// The response timeout also bounds each wait for the next piece of a response body, as
/// nginx's `proxy_read_timeout` does: an upstream that sent part of its body and went
/// silent is cut off (the client sees the body cut short) instead of holding the client
/// for as long as it keeps the socket open; one that keeps sending, however slowly, is not.
#[tokio::test]
async fn a_response_body_that_stops_coming_is_cut_off_after_the_response_timeout() {
    let route = |up| {
        format!(
            "[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\nresponse_timeout = \"300ms\"\n"
        )
    };
    let gw = TestGateway::start(&route(part_body_upstream(0).await));
    let mut c = h1_client(gw.addr).await;
    let started = std::time::Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(10), fetch(&mut c, "GET", "/"))
        .await
        .expect("the gateway ends the response");
    assert!(r.is_err(), "the body is cut short: {r:?}");
    assert!(started.elapsed() < Duration::from_secs(5));

    let gw = TestGateway::start(&route(part_body_upstream(100).await));
    let mut c = h1_client(gw.addr).await;
    let r = fetch(&mut c, "GET", "/").await.unwrap();
    assert_eq!(r.body().len(), 100, "{:?}", r.body());
}

/// An upgrade to cleartext HTTP/2 (`Upgrade: h2c`) is not passed on: the tunnel would be an
/// HTTP/2 connection to the upstream whose requests no route or method of the gateway sees
/// (h2c smuggling). The request goes on as a plain one, without `Upgrade` or
/// `HTTP2-Settings` (connection-specific even when `Connection` does not name it), and an
/// upstream that answers `101` anyway gets no tunnel: a `502`.
#[tokio::test]
async fn r_an_h2c_upgrade_is_not_passed_on() {
    let h2c = b"GET /public HTTP/1.1\r\nHost: a\r\nUpgrade: h2c\r\nConnection: Upgrade\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n";
    let got = as_received(h2c).await;
    assert!(got.starts_with("get /public http/1.1"), "{got}");
    assert!(!got.contains("upgrade"), "{got}");
    assert!(!got.contains("http2-settings"), "{got}");
    // Nor when a byte past ASCII in the value could hide it from the look for `h2c`.
    let hidden =
        b"GET /public HTTP/1.1\r\nHost: a\r\nUpgrade: h2c, \xff\r\nConnection: Upgrade\r\n\r\n";
    let got = as_received(hidden).await;
    assert!(got.starts_with("get /public http/1.1"), "{got}");
    assert!(!got.contains("upgrade"), "{got}");

    let up = scripted(
        |_| {
            answer(
                "HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: h2c\r\n\r\n",
                false,
            )
        },
        false,
    )
    .await;
    let gw = TestGateway::to(up.addr, "");
    let (text, closed) = raw(gw.addr, h2c, Duration::from_secs(5)).await;
    assert!(text.starts_with("HTTP/1.1 502"), "{text}");
    assert!(
        closed,
        "the connection closes after a refused upgrade: {text}"
    );
}

/// Connections the gateway closed because the exchange left them unusable.
fn unusable(gw: &TestGateway) -> u64 {
    stat(gw, |s| s.retired_unusable.load(Ordering::Relaxed))
}

/// The gateway's `/metrics` text (the gateway started with an admin listener).
async fn metrics_text(gw: &TestGateway) -> String {
    let admin = gw.gw.as_ref().unwrap().admin_addr().unwrap();
    let mut c = h1_client(admin).await;
    let req = http::Request::get("/metrics")
        .header("host", "admin")
        .body(full(""))
        .unwrap();
    let resp = c.send_request(req).await.unwrap();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(body.to_vec()).unwrap()
}

/// Bytes past a response's end (a body longer than its `Content-Length`) end the
/// connection, and are counted as the gateway's close (`reason="unusable"` in
/// `tailgate_upstream_connections_retired_total`), not the server's: before, the
/// connection went unseen under no reason at all.
#[tokio::test]
async fn bytes_past_a_response_are_counted_as_an_unusable_connection() {
    let up = scripted(
        |n| {
            if n == 0 {
                answer("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokSTRAY", false)
            } else {
                answer("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", false)
            }
        },
        false,
    )
    .await;
    let gw = TestGateway::to(
        up.addr,
        "[server]\nworkers = 1\n[admin]\naddress = \"127.0.0.1:0\"",
    );
    let mut c = h1_client(gw.addr).await;
    for _ in 0..3 {
        let r = fetch(&mut c, "GET", "/").await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.body().as_ref(), b"ok");
    }
    assert_eq!(
        up.conns.load(Ordering::SeqCst),
        2,
        "the stray bytes' connection reused"
    );
    assert_eq!(unusable(&gw), 1);
    assert_eq!(stat(&gw, |s| s.closed_by_server.load(Ordering::Relaxed)), 0);
    let text = metrics_text(&gw).await;
    assert!(
        text.lines().any(
            |l| l.starts_with("tailgate_upstream_connections_retired_total{")
                && l.contains("reason=\"unusable\"")
                && l.ends_with(" 1")
        ),
        "{text}"
    );
}

/// A server that writes to an idle connection (no request out) has it closed by the
/// gateway at the next checkout, counted as `unusable`, not as closed by the server.
#[tokio::test]
async fn bytes_on_an_idle_connection_are_counted_as_an_unusable_connection() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let conns = Arc::new(AtomicUsize::new(0));
    let c2 = conns.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let first = c2.fetch_add(1, Ordering::SeqCst) == 0;
            tokio::spawn(async move {
                let mut buf = Vec::new();
                while read_request(&mut s, &mut buf, false).await.is_some() {
                    let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                    if s.write_all(ok).await.is_err() {
                        return;
                    }
                    if first {
                        // Then, with no request out, more.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        let _ = s.write_all(b"HTTP/1.1 200 OK\r\n").await;
                    }
                }
            });
        }
    });
    let gw = TestGateway::to(addr, "[server]\nworkers = 1");
    let mut c = h1_client(gw.addr).await;
    let r = fetch(&mut c, "GET", "/").await.unwrap();
    assert_eq!(r.status(), 200);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = fetch(&mut c, "GET", "/").await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.body().as_ref(), b"ok");
    assert_eq!(
        conns.load(Ordering::SeqCst),
        2,
        "the written-to connection reused"
    );
    assert_eq!(unusable(&gw), 1);
    assert_eq!(stat(&gw, |s| s.closed_by_server.load(Ordering::Relaxed)), 0);
}
