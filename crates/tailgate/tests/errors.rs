//! Errors in one place: status codes and JSON bodies for no route, wrong method, upstream
//! refused/reset, and every timeout.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn json(resp: &http::Response<bytes::Bytes>) -> serde_json::Value {
    assert_eq!(resp.headers()["content-type"], "application/json");
    serde_json::from_slice(resp.body()).unwrap()
}

#[tokio::test]
async fn no_route_is_404_with_request_id() {
    let up = ok_upstream().await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/api/\"\ncluster = \"up\"\n"
    ));
    let resp = get(gw.addr, "/other").await;
    assert_eq!(resp.status(), 404);
    let body = json(&resp);
    assert_eq!(body["error"], "no_route");
    assert_eq!(
        body["request_id"],
        resp.headers()["x-request-id"].to_str().unwrap()
    );
}

#[tokio::test]
async fn wrong_method_is_405_with_allow() {
    let up = ok_upstream().await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/\"\nmethods = [\"GET\", \"HEAD\"]\ncluster = \"up\"\n"
    ));
    let mut c = h1_client(gw.addr).await;
    let resp = c
        .send_request(
            http::Request::delete("/x")
                .header("host", "a")
                .body(full(""))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), 405);
    assert_eq!(resp.headers()["allow"], "GET, HEAD");
}

/// The gateway's own answers to HEAD carry no body over HTTP/2 either: no DATA frame, which
/// a client resets the stream for (RFC 9110 §9.3.2), only the length a GET would get.
#[tokio::test]
async fn an_h2_head_answered_by_the_gateway_has_no_body() {
    let up = ok_upstream().await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/api/\"\nmethods = [\"POST\"]\ncluster = \"up\"\n"
    ));
    let (mut c, _conn) = h2c_client(gw.addr).await;
    // No route (404), and a route that does not take HEAD (405): both on one connection,
    // which the first must leave usable.
    for (path, status) in [("http://a/nothing", 404), ("http://a/api/x", 405)] {
        let req = http::Request::head(path).body(full("")).unwrap();
        let resp = c.send_request(req).await.unwrap();
        assert_eq!(resp.status(), status, "{path}");
        assert_eq!(resp.version(), http::Version::HTTP_2);
        let length: usize = resp.headers()["content-length"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!(length > 0, "{path}: the length a GET would get");
        let body = resp
            .into_body()
            .collect()
            .await
            .unwrap_or_else(|e| panic!("{path}: the stream was reset: {e}"));
        assert!(body.to_bytes().is_empty(), "{path}");
    }
    // The same over GET still has its JSON body.
    let req = http::Request::get("http://a/nothing")
        .body(full(""))
        .unwrap();
    let resp = c.send_request(req).await.unwrap();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(body.starts_with(b"{"), "{body:?}");
}

#[tokio::test]
async fn upstream_refused_is_502() {
    let dead = dead_port();
    let gw = TestGateway::to(dead.addr(), "");
    let resp = get(gw.addr, "/").await;
    assert_eq!(resp.status(), 502);
    assert_eq!(json(&resp)["error"], "upstream_connect_failed");
}

/// How [`closing_upstream`] ends each connection after reading its request.
#[derive(Clone, Copy, PartialEq)]
enum Close {
    /// A clean close (`FIN`), no answer.
    Fin,
    /// A reset (`RST`), no answer.
    Rst,
    /// A chunked answer's head and first chunk, then a reset.
    RstAfterHead,
}

/// An upstream that reads each request, then ends its connection as `how` says; with
/// [`Close::RstAfterHead`], the reset waits for the returned signal (the client has its
/// first chunk: a reset that came first would throw the unread bytes away).
async fn closing_upstream(how: Close) -> (std::net::SocketAddr, Arc<tokio::sync::Notify>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = l.local_addr().unwrap();
    let reset = Arc::new(tokio::sync::Notify::new());
    let reset_now = reset.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf).await;
            if how == Close::RstAfterHead {
                let _ = s
                    .write_all(
                        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nstart\r\n",
                    )
                    .await;
                let _ = tokio::time::timeout(Duration::from_secs(10), reset_now.notified()).await;
            }
            if how != Close::Fin {
                socket2::SockRef::from(&s)
                    .set_linger(Some(Duration::ZERO))
                    .unwrap();
            }
            drop(s);
        }
    });
    (up, reset)
}

/// An upstream that closes (`FIN`) before it answers: `502 upstream_reset` (a reset, `RST`,
/// is the next test's).
#[tokio::test]
async fn an_upstream_closing_before_its_answer_is_502() {
    let gw = TestGateway::to(closing_upstream(Close::Fin).await.0, "");
    let resp = get(gw.addr, "/").await;
    assert_eq!(resp.status(), 502);
    assert_eq!(json(&resp)["error"], "upstream_reset");
}

/// An upstream that resets the connection (`RST`, not a clean close), before its answer's
/// head or in the middle of its body: `502 upstream_reset` before the head; after it, the
/// answer is cut (no last chunk).
#[tokio::test]
async fn an_upstream_reset_is_502_before_the_head_and_a_cut_after() {
    for head_first in [false, true] {
        let how = if head_first {
            Close::RstAfterHead
        } else {
            Close::Rst
        };
        let (up, reset) = closing_upstream(how).await;
        let gw = TestGateway::to(up, "");
        // (The 502 leaves the connection open for the next request: closed at the client's
        // asking.)
        let req: &[u8] = if head_first {
            b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"
        } else {
            b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
        };
        let mut s = TcpStream::connect(gw.addr).await.unwrap();
        s.write_all(req).await.unwrap();
        let mut text = String::new();
        if head_first {
            // The head and the first chunk, then the upstream's reset.
            let mut buf = [0u8; 4096];
            while !text.contains("start") {
                let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
                    .await
                    .unwrap()
                    .unwrap();
                assert!(n > 0, "closed before the first chunk: {text:?}");
                text.push_str(&String::from_utf8_lossy(&buf[..n]));
            }
            reset.notify_one();
        }
        let (rest, closed) = read_until_close(&mut s, Duration::from_secs(10)).await;
        text.push_str(&rest);
        if head_first {
            assert!(
                text.starts_with("HTTP/1.1 200") && text.contains("start"),
                "{text}"
            );
            assert!(closed && !text.ends_with("0\r\n\r\n"), "{text:?}");
        } else {
            assert!(text.starts_with("HTTP/1.1 502"), "{text}");
            assert!(text.contains("\"upstream_reset\""), "{text}");
        }
    }
}

#[tokio::test]
async fn upstream_response_timeout_is_504() {
    let up = upstream(|_| async {
        tokio::time::sleep(Duration::from_secs(30)).await;
        http::Response::new(full("late"))
    })
    .await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\nresponse_timeout = \"300ms\"\n"
    ));
    let resp = get(gw.addr, "/").await;
    assert_eq!(resp.status(), 504);
    assert_eq!(json(&resp)["error"], "upstream_timeout");
}

#[tokio::test]
async fn upstream_connect_timeout_is_504() {
    let (sock, up, _fillers) = unanswering_listener().await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\nconnect_timeout = \"200ms\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\ntotal_timeout = \"1500ms\"\n"
    ));
    let resp = get(gw.addr, "/").await;
    // The cluster's 200 ms, not the default 2 s: that would meet the route's 1.5 s total
    // timeout first, which answers `upstream_timeout`.
    assert_eq!(resp.status(), 504, "{:?}", resp.body());
    assert_eq!(json(&resp)["error"], "upstream_connect_timeout");
    drop(sock);
}

#[tokio::test]
async fn total_timeout_cuts_a_stalled_body() {
    let up = upstream(|_| async {
        let (tx, rx) = tokio::sync::mpsc::channel::<
            Result<hyper::body::Frame<bytes::Bytes>, Box<dyn std::error::Error + Send + Sync>>,
        >(1);
        tokio::spawn(async move {
            tx.send(Ok(hyper::body::Frame::data(bytes::Bytes::from_static(
                b"start",
            ))))
            .await
            .ok();
            tokio::time::sleep(Duration::from_secs(30)).await;
            drop(tx);
        });
        use http_body_util::BodyExt;
        let body = http_body_util::StreamBody::new(tokio_stream(rx)).boxed();
        http::Response::new(body)
    })
    .await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\ntotal_timeout = \"400ms\"\n"
    ));
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    let (text, closed) = read_until_close(&mut s, Duration::from_secs(10)).await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("start"));
    assert!(
        closed,
        "the stalled response is cut off by the total timeout"
    );
    // Cut, not ended: no last chunk that would pass it off as whole.
    assert!(!text.ends_with("0\r\n\r\n"), "{text:?}");
}

fn tokio_stream<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures_util::Stream<Item = T> {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

#[tokio::test]
async fn slow_header_is_cut_off() {
    let up = ok_upstream().await;
    let gw = TestGateway::to(
        up,
        "[server]\nworkers = 1\nheader_read_timeout = \"300ms\"\nidle_timeout = \"60s\"\n",
    );
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: a\r\nX-Slow: ")
        .await
        .unwrap();
    // Within 3 s: the configured 300 ms, not the default 10 s.
    let (text, closed) = read_until_close(&mut s, Duration::from_secs(3)).await;
    assert!(
        closed,
        "a head that never completes is cut off by header_read_timeout"
    );
    assert!(!text.contains("200"));
}

/// A small body is read with its head, so a client that stops in the middle of it is cut
/// off by the same timeout.
#[tokio::test]
async fn a_small_body_that_stops_is_cut_off_with_the_head() {
    let up = ok_upstream().await;
    let gw = TestGateway::to(
        up,
        "[server]\nworkers = 1\nheader_read_timeout = \"300ms\"\nidle_timeout = \"60s\"\n",
    );
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\nabc")
        .await
        .unwrap();
    // Within 3 s: the configured 300 ms, not the default 10 s.
    let (text, closed) = read_until_close(&mut s, Duration::from_secs(3)).await;
    assert!(closed, "a body that never completes is cut off: {text}");
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
}

#[tokio::test]
async fn idle_connection_is_closed_but_a_slow_response_is_not() {
    let up = upstream(|req: http::Request<hyper::body::Incoming>| async move {
        if req.uri().path() == "/slow" {
            tokio::time::sleep(Duration::from_millis(800)).await;
        }
        http::Response::new(full("ok"))
    })
    .await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\nidle_timeout = \"300ms\"\n");
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    // A request longer than the idle timeout is in flight, not idle.
    s.write_all(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    // Then nothing: the connection is closed for idleness.
    let (_, closed) = read_until_close(&mut s, Duration::from_secs(5)).await;
    assert!(closed, "idle connection closed");
}

/// Review finding 3c: a client that sends a request and never reads the response used to
/// hold the client connection, the upstream connection and shutdown forever. Now the
/// connection fails once the client has taken no bytes for `idle_timeout`.
#[tokio::test]
async fn r_a_client_that_never_reads_is_cut_off() {
    const CHUNK: usize = 64 * 1024;
    const CHUNKS: usize = 4096; // 256 MiB: far more than socket buffers hold
    let (upstream_done_tx, mut upstream_done) = tokio::sync::mpsc::channel::<usize>(1);
    let up = upstream(move |_| {
        let done = upstream_done_tx.clone();
        async move {
            let (tx, rx) = tokio::sync::mpsc::channel::<
                Result<hyper::body::Frame<bytes::Bytes>, Box<dyn std::error::Error + Send + Sync>>,
            >(1);
            tokio::spawn(async move {
                let chunk = bytes::Bytes::from(vec![b'z'; CHUNK]);
                let mut sent = 0;
                for _ in 0..CHUNKS {
                    if tx
                        .send(Ok(hyper::body::Frame::data(chunk.clone())))
                        .await
                        .is_err()
                    {
                        break;
                    }
                    sent += 1;
                }
                let _ = done.send(sent).await;
            });
            use http_body_util::BodyExt;
            http::Response::new(http_body_util::StreamBody::new(tokio_stream(rx)).boxed())
        }
    })
    .await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\nidle_timeout = \"300ms\"\n");
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"GET /big HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    // Never read. The gateway gives up on this client, so the upstream's body is dropped
    // long before all of it was sent.
    let sent = tokio::time::timeout(Duration::from_secs(20), upstream_done.recv())
        .await
        .expect("the stalled exchange is abandoned")
        .unwrap();
    assert!(
        sent < CHUNKS,
        "the upstream body was cut off, not sent whole ({sent} chunks)"
    );
}

/// A cluster's `max_requests`: with that many requests awaiting its answer, the next one
/// is refused at once with `503 upstream_overflow` (counted), not queued behind them; once
/// they are answered, requests go through again.
#[tokio::test]
async fn past_max_requests_a_request_gets_503_upstream_overflow() {
    let HeldUpstream {
        addr: up,
        mut arrived,
        open: open_tx,
    } = held_upstream().await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"held\"\nendpoints = [\"{up}\"]\nmax_requests = 2\n[[route]]\npath_prefix = \"/\"\ncluster = \"held\"\n"
    ));
    let addr = gw.addr;
    let waiting: Vec<_> = (0..2)
        .map(|_| tokio::spawn(async move { get(addr, "/").await.status() }))
        .collect();
    for _ in 0..2 {
        arrived.recv().await.unwrap();
    }
    let resp = tokio::time::timeout(Duration::from_secs(10), get(addr, "/"))
        .await
        .expect("the third request was queued, not refused");
    assert_eq!(resp.status(), 503);
    assert_eq!(json(&resp)["error"], "upstream_overflow");
    assert_eq!(resp.headers()["retry-after"], "1");
    open_tx.send(true).unwrap();
    for w in waiting {
        assert_eq!(w.await.unwrap(), 200);
    }
    // Their places are given back with their answers.
    assert_eq!(get(addr, "/").await.status(), 200);
    let state = gw.gw.as_ref().unwrap().admin_state().clone();
    let overflows: u64 = state
        .workers
        .iter()
        .map(|w| {
            w.upstreams.clusters[0]
                .stats
                .overflows
                .load(std::sync::atomic::Ordering::Relaxed)
        })
        .sum();
    assert_eq!(overflows, 1);
}

/// A response whose head came but whose body still streams holds its place under
/// `max_requests` until its body ends.
#[tokio::test]
async fn a_streaming_response_holds_its_place_under_max_requests() {
    let (piece_tx, piece_rx) = tokio::sync::mpsc::channel::<Bytes>(4);
    let piece_rx = Arc::new(std::sync::Mutex::new(Some(piece_rx)));
    let up = upstream(move |_| {
        let rx = piece_rx.lock().unwrap().take();
        async move {
            match rx {
                // The first request: its head now, its body when the test sends it.
                Some(rx) => {
                    type E = Box<dyn std::error::Error + Send + Sync>;
                    let frames = futures_util::StreamExt::map(tokio_stream(rx), |b| {
                        Ok::<_, E>(hyper::body::Frame::data(b))
                    });
                    http::Response::new(http_body_util::StreamBody::new(frames).boxed())
                }
                None => http::Response::new(full("ok")),
            }
        }
    })
    .await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"one\"\nendpoints = [\"{up}\"]\nmax_requests = 1\n[[route]]\npath_prefix = \"/\"\ncluster = \"one\"\n"
    ));
    let mut c = h1_client(gw.addr).await;
    let req = http::Request::get("/stream")
        .header("host", "a")
        .body(full(""))
        .unwrap();
    let resp = c.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    // Its head is here, its body is not over: the cluster's one place is taken.
    let other = tokio::time::timeout(Duration::from_secs(10), get(gw.addr, "/"))
        .await
        .unwrap();
    assert_eq!(other.status(), 503);
    assert_eq!(json(&other)["error"], "upstream_overflow");
    piece_tx.send(Bytes::from_static(b"end")).await.unwrap();
    drop(piece_tx);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"end");
    // Given back with the body's end.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let r = get(gw.addr, "/").await;
        if r.status() == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the place was never given back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// An upstream that answers before the request's body is all sent, and keeps reading it:
/// the request holds its place under `max_requests` until its body has gone up (the client
/// is still sending it), not only until the answer ended.
#[tokio::test]
async fn a_place_is_held_while_an_early_answered_body_still_goes_up() {
    // Answers each request as soon as its head is in, then reads its body.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = Vec::new();
                while let Some(end) = read_head(&mut s, &mut buf).await {
                    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                    let len: usize = head
                        .lines()
                        .find_map(|l| {
                            l.strip_prefix("content-length:")
                                .map(|v| v.trim().parse().unwrap())
                        })
                        .unwrap_or(0);
                    buf.drain(..end);
                    s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                        .await
                        .unwrap();
                    while buf.len() < len {
                        let mut chunk = [0u8; 16384];
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    buf.drain(..len);
                }
            });
        }
    });
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"one\"\nendpoints = [\"{up}\"]\nmax_requests = 1\nidle_timeout = \"30s\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"one\"\n"
    ));
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"POST /up HTTP/1.1\r\nHost: a\r\nContent-Length: 100000\r\n\r\n")
        .await
        .unwrap();
    s.write_all(&[b'x'; 20000]).await.unwrap();
    let mut raw_head = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(10), read_head(&mut s, &mut raw_head))
        .await
        .unwrap()
        .unwrap();
    assert!(
        raw_head[..n].starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&raw_head)
    );
    // Answered; 80,000 bytes of its body still to come: the one place is still taken.
    let other = get(gw.addr, "/").await;
    assert_eq!(other.status(), 503, "{:?}", other.body());
    assert_eq!(json(&other)["error"], "upstream_overflow");
    s.write_all(&[b'x'; 80000]).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while get(gw.addr, "/").await.status() != 200 {
        assert!(
            std::time::Instant::now() < deadline,
            "the place was never given back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Over HTTP/2 a head is limited as over HTTP/1.1: by `max_header_bytes`, counted as the
/// same head would be there (cookie crumbs joined), not with h2's 32 bytes more per field;
/// and one over it gets the gateway's `431`, with its JSON error and request id, recorded.
#[tokio::test]
async fn h2_heads_are_limited_as_http1_heads_are() {
    let up = ok_upstream().await;
    let gw = TestGateway::to(up, "");
    let (mut c, _conn) = h2c_client(gw.addr).await;
    // 150 crumbs of 80 bytes: about 12 KiB as one Cookie line, under the 16 KiB default
    // (h2 itself would count 18 KiB).
    let mut req = http::Request::get("http://a/crumbs")
        .body(full(""))
        .unwrap();
    for i in 0..150 {
        let crumb = format!("c{i:03}={}", "v".repeat(75));
        req.headers_mut()
            .append("cookie", http::HeaderValue::from_str(&crumb).unwrap());
    }
    let resp = c.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    resp.into_body().collect().await.unwrap();
    // One header of 20 KiB: over the limit.
    let req = http::Request::get("http://a/big")
        .header("x-big", "b".repeat(20 << 10))
        .body(full(""))
        .unwrap();
    let resp = c.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 431);
    let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["error"], "header_too_large");
    assert_eq!(body["request_id"], id.as_str());
}

/// An HTTP/2 head of more than 10,000 fields gets `431`, however small: with a large
/// `max_header_bytes`, some 24,000 empty fields filled the header map, and the `Host` the
/// gateway puts into it panicked the request's task. Up to 10,000 pass (here to a path no
/// route takes, answered `404` by the gateway: an upstream would refuse 10,000 fields).
#[tokio::test]
async fn h2_heads_of_too_many_fields_are_refused() {
    let up = ok_upstream().await;
    let gw = TestGateway::start(&format!(
        "[server]\nmax_header_bytes = 1048576\n[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/routed\"\ncluster = \"up\"\n"
    ));
    let (mut c, _conn) = h2c_client(gw.addr).await;
    let with_fields = |n: usize| {
        let mut req = http::Request::get("http://a/many").body(full("")).unwrap();
        for i in 0..n {
            req.headers_mut().append(
                http::HeaderName::from_bytes(format!("h{i}").as_bytes()).unwrap(),
                http::HeaderValue::from_static(""),
            );
        }
        req
    };
    let resp = c.send_request(with_fields(10_000)).await.unwrap();
    assert_eq!(resp.status(), 404);
    resp.into_body().collect().await.unwrap();
    let resp = c.send_request(with_fields(10_001)).await.unwrap();
    assert_eq!(resp.status(), 431);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["error"], "header_too_large");
}
