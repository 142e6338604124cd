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

/// One request off `s` (bytes past it stay in `buf`); `None` at end of stream.
async fn read_request(s: &mut TcpStream, buf: &mut Vec<u8>, head_only: bool) -> Option<String> {
    let mut chunk = [0u8; 16384];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
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

/// Sends `GET path` on `c` and reads the whole answer: status, headers, body.
async fn fetch(
    c: &mut hyper::client::conn::http1::SendRequest<TestBody>,
    method: &str,
    path: &str,
) -> Result<http::Response<bytes::Bytes>, String> {
    let r = c
        .send_request(
            http::Request::builder()
                .method(method)
                .uri(path)
                .header("host", "a")
                .body(full(""))
                .unwrap(),
        )
        .await
        .map_err(|e| e.to_string())?;
    let (parts, body) = r.into_parts();
    let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok(http::Response::from_parts(parts, body))
}

fn answer(bytes: &str, close: bool) -> (Vec<u8>, bool) {
    (bytes.as_bytes().to_vec(), close)
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
    let gw = TestGateway::to(up.addr, "");
    let mut c = h1_client(gw.addr).await;
    for _ in 0..3 {
        let r = fetch(&mut c, "GET", "/").await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.body().as_ref(), b"ok");
    }
    assert_eq!(
        up.conns.load(Ordering::SeqCst),
        1,
        "one upstream connection"
    );
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
    let gw = TestGateway::to(up.addr, "");
    let mut c = h1_client(gw.addr).await;
    for _ in 0..3 {
        let r = fetch(&mut c, "GET", "/").await.unwrap();
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
    let gw = TestGateway::to(up.addr, "");
    let mut c = h1_client(gw.addr).await;
    for _ in 0..3 {
        let r = fetch(&mut c, "GET", "/").await.unwrap();
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
    let gw = TestGateway::to(up.addr, "");
    let mut c = h1_client(gw.addr).await;
    for _ in 0..4 {
        let r = fetch(&mut c, "GET", "/").await.unwrap();
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

#[tokio::test]
async fn the_request_goes_out_in_origin_form_with_its_framing() {
    let up = scripted(
        |_| answer("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", false),
        false,
    )
    .await;
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

/// The response deadline is re-armed for each request on a reused connection: a request
/// later on the same connection gets its own full timeout (not what was left of the
/// first one's), and one that overruns it gets a 504.
#[tokio::test]
async fn each_request_on_a_reused_connection_gets_its_own_deadline() {
    let up = upstream(|req: http::Request<hyper::body::Incoming>| async move {
        let wait = match req.uri().path() {
            "/slow" => 200,
            "/hang" => 5_000,
            _ => 0,
        };
        tokio::time::sleep(Duration::from_millis(wait)).await;
        http::Response::new(full("ok"))
    })
    .await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\nresponse_timeout = \"400ms\"\n"
    ));
    let mut c = h1_client(gw.addr).await;
    assert_eq!(fetch(&mut c, "GET", "/fast").await.unwrap().status(), 200);
    // Past the first request's deadline: the next one must not inherit it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(fetch(&mut c, "GET", "/slow").await.unwrap().status(), 200);
    assert_eq!(fetch(&mut c, "GET", "/slow").await.unwrap().status(), 200);
    assert_eq!(fetch(&mut c, "GET", "/hang").await.unwrap().status(), 504);
    assert_eq!(fetch(&mut c, "GET", "/fast").await.unwrap().status(), 200);
    assert!(
        gw.gw
            .as_ref()
            .unwrap()
            .pool_stat(|s| s.reuses.load(Ordering::Relaxed))
            >= 2,
        "the slow requests went on the first request's connection"
    );
}
