//! HTTP/2 to upstreams (`protocol = "http2"`: h2c by prior knowledge, or ALPN h2 over TLS;
//! `"auto"`: ALPN decides): requests share connections up to the server's stream limit,
//! GOAWAY and REFUSED_STREAM move requests to a new connection without failing them,
//! rotation hands over to a successor. Asserted on counts on both sides, never on timings.
#![allow(clippy::unwrap_used)]

mod common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::tls;
use common::*;
use http_body_util::BodyExt;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};

fn gateway(up: SocketAddr, cluster_extra: &str) -> TestGateway {
    TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\nprotocol = \"http2\"\n{cluster_extra}\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
    ))
}

/// Holds requests at the upstream until `expect` of them are in flight at once (or 5 s
/// pass, so a gateway that does not multiplex fails the assertion instead of hanging).
#[derive(Clone)]
struct Gate {
    in_flight: Arc<AtomicUsize>,
    max_seen: Arc<AtomicUsize>,
    expect: Arc<AtomicUsize>,
    open: Arc<watch::Sender<bool>>,
}

impl Gate {
    /// `expect` 0: an open gate.
    fn new(expect: usize) -> Gate {
        Gate {
            in_flight: Arc::default(),
            max_seen: Arc::default(),
            expect: Arc::new(AtomicUsize::new(expect)),
            open: Arc::new(watch::channel(expect == 0).0),
        }
    }

    /// Closes the gate until `expect` requests are in flight; counts from zero again.
    fn arm(&self, expect: usize) {
        self.expect.store(expect, Ordering::SeqCst);
        self.max_seen.store(0, Ordering::SeqCst);
        self.open.send_replace(false);
    }

    async fn pass(&self) {
        let n = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_seen.fetch_max(n, Ordering::SeqCst);
        if n >= self.expect.load(Ordering::SeqCst) {
            self.open.send_replace(true);
        }
        let mut rx = self.open.subscribe();
        let _ = tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|o| *o)).await;
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What an h2c upstream saw.
#[derive(Clone, Default)]
struct Seen {
    conns: Arc<AtomicUsize>,
    /// Requests processed (answered), as `METHOD path`.
    processed: Arc<Mutex<Vec<String>>>,
    /// Paths refused once.
    refused: Arc<Mutex<std::collections::HashSet<String>>>,
}

/// An h2c (prior knowledge) upstream served by hyper. Every request passes `gate`; after
/// `goaway_after` requests on one connection (0: never) the server shuts that connection
/// down gracefully (GOAWAY, in-flight streams finish). `max_streams` is its
/// SETTINGS_MAX_CONCURRENT_STREAMS.
async fn h2c_upstream(gate: Gate, goaway_after: usize, max_streams: u32) -> (SocketAddr, Seen) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Seen::default();
    let s = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = l.accept().await else {
                return;
            };
            s.conns.fetch_add(1, Ordering::SeqCst);
            let (s, gate) = (s.clone(), gate.clone());
            tokio::spawn(async move {
                let count = Arc::new(AtomicUsize::new(0));
                let shutdown = Arc::new(Notify::new());
                let sd = shutdown.clone();
                let svc = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let (s, gate, count, sd) = (s.clone(), gate.clone(), count.clone(), sd.clone());
                    async move {
                        gate.pass().await;
                        s.processed.lock().unwrap().push(format!(
                            "{} {}",
                            req.method(),
                            req.uri().path()
                        ));
                        if count.fetch_add(1, Ordering::SeqCst) + 1 == goaway_after {
                            sd.notify_one();
                        }
                        Ok::<_, Infallible>(http::Response::new(full("ok")))
                    }
                });
                let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .max_concurrent_streams(max_streams)
                    .serve_connection(TokioIo::new(tcp), svc);
                let mut conn = std::pin::pin!(conn);
                tokio::select! {
                    _ = conn.as_mut() => return,
                    _ = shutdown.notified() => {}
                }
                conn.as_mut().graceful_shutdown();
                let _ = conn.await;
            });
        }
    });
    (addr, seen)
}

/// Sends `n` GETs at once, each on its own client connection; returns their statuses.
async fn concurrent_gets(gw: SocketAddr, n: usize) -> Vec<u16> {
    let tasks: Vec<_> = (0..n)
        .map(|i| tokio::spawn(async move { get(gw, &format!("/c{i}")).await.status().as_u16() }))
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// A cold endpoint and a burst of 10 requests: one connection is opened and all ten
/// streams share it, in flight at the upstream at the same time.
#[tokio::test]
async fn concurrent_requests_share_one_h2c_connection() {
    let gate = Gate::new(10);
    let (up, seen) = h2c_upstream(gate.clone(), 0, 100).await;
    let gw = gateway(up, "");
    assert_eq!(concurrent_gets(gw.addr, 10).await, vec![200; 10]);
    assert_eq!(
        seen.conns.load(Ordering::SeqCst),
        1,
        "one upstream connection"
    );
    assert_eq!(
        gate.max_seen.load(Ordering::SeqCst),
        10,
        "all ten multiplexed at once"
    );
    assert_eq!(stat(&gw, |s| s.h2_connections.load(Ordering::Relaxed)), 1);
    assert_eq!(
        stat(&gw, |s| s.connects_on_request.load(Ordering::Relaxed)),
        1
    );
    assert_eq!(stat(&gw, |s| s.reuses.load(Ordering::Relaxed)), 9);
}

/// The server allows 4 concurrent streams: 10 concurrent requests need 3 connections, and
/// the gateway opens them instead of queueing behind the limit.
#[tokio::test]
async fn the_servers_stream_limit_is_respected() {
    let gate = Gate::new(0);
    let (up, seen) = h2c_upstream(gate.clone(), 0, 4).await;
    let gw = gateway(up, "");
    // One request first: the server's SETTINGS (sent before its first response) are then
    // known to the endpoint.
    assert_eq!(get(gw.addr, "/warm").await.status(), 200);
    gate.arm(10);
    assert_eq!(concurrent_gets(gw.addr, 10).await, vec![200; 10]);
    assert_eq!(
        gate.max_seen.load(Ordering::SeqCst),
        10,
        "all ten in flight at once"
    );
    assert_eq!(seen.conns.load(Ordering::SeqCst), 3, "4 + 4 + 2 streams");
    assert_eq!(stat(&gw, |s| s.h2_connections.load(Ordering::Relaxed)), 3);
}

/// The server sends GOAWAY after every 5 requests on a connection: subsequent requests go on
/// a new connection and none fails, sequential or concurrent.
#[tokio::test]
async fn goaway_moves_requests_to_a_new_connection() {
    let (up, seen) = h2c_upstream(Gate::new(0), 5, 100).await;
    let gw = gateway(up, "");
    for i in 0..20 {
        assert_eq!(
            get(gw.addr, &format!("/s{i}")).await.status(),
            200,
            "request {i}"
        );
    }
    assert!(
        seen.conns.load(Ordering::SeqCst) >= 4,
        "a new connection after each GOAWAY"
    );
    assert!(stat(&gw, |s| s.closed_by_server.load(Ordering::Relaxed)) >= 3);
    for round in 0..5 {
        assert_eq!(
            concurrent_gets(gw.addr, 8).await,
            vec![200; 8],
            "round {round}"
        );
    }
    assert_eq!(
        seen.processed.lock().unwrap().len(),
        60,
        "each request processed once"
    );
}

/// An h2 upstream (the h2 crate, for control over resets) that refuses the first attempt at
/// any path starting with `/refuse` with REFUSED_STREAM (at once; `/laterefuse`, after 400
/// ms), resets the first at any starting
/// with `/reset` with INTERNAL_ERROR, and answers everything else. A first request to a path
/// starting with `/dying` is reset with INTERNAL_ERROR too, and its connection then refuses
/// every stream (REFUSED_STREAM), as a server going away would.
async fn refusing_upstream() -> (SocketAddr, Seen) {
    refusing_upstream_with(None).await
}

/// [`refusing_upstream`] with its SETTINGS_MAX_CONCURRENT_STREAMS.
async fn refusing_upstream_with(max_streams: Option<u32>) -> (SocketAddr, Seen) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Seen::default();
    let s = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = l.accept().await else {
                return;
            };
            s.conns.fetch_add(1, Ordering::SeqCst);
            let s = s.clone();
            tokio::spawn(async move {
                let mut builder = h2::server::Builder::new();
                if let Some(max) = max_streams {
                    builder.max_concurrent_streams(max);
                }
                let Ok(mut conn) = builder.handshake(tcp).await else {
                    return;
                };
                let mut dying = false;
                while let Some(Ok((req, mut respond))) = conn.accept().await {
                    let path = req.uri().path().to_owned();
                    if dying {
                        respond.send_reset(h2::Reason::REFUSED_STREAM);
                        continue;
                    }
                    if path.starts_with("/dying") && s.refused.lock().unwrap().insert(path.clone())
                    {
                        dying = true;
                        respond.send_reset(h2::Reason::INTERNAL_ERROR);
                        continue;
                    }
                    // Reset once after the whole body came: the request was processed,
                    // as far as the gateway can tell.
                    if path.starts_with("/readreset")
                        && s.refused.lock().unwrap().insert(path.clone())
                    {
                        tokio::spawn(async move {
                            let mut body = req.into_body();
                            while let Some(Ok(d)) = body.data().await {
                                let _ = body.flow_control().release_capacity(d.len());
                            }
                            respond.send_reset(h2::Reason::INTERNAL_ERROR);
                        });
                        continue;
                    }
                    // Refused once, after 400 ms of thought (after a hedge went out).
                    if path.starts_with("/laterefuse")
                        && s.refused.lock().unwrap().insert(path.clone())
                    {
                        tokio::spawn(async move {
                            tokio::time::sleep(Duration::from_millis(400)).await;
                            respond.send_reset(h2::Reason::REFUSED_STREAM);
                        });
                        continue;
                    }
                    let reset = if path.starts_with("/refuse") {
                        Some(h2::Reason::REFUSED_STREAM)
                    } else if path.starts_with("/reset") {
                        Some(h2::Reason::INTERNAL_ERROR)
                    } else {
                        None
                    };
                    if let Some(reason) = reset
                        && s.refused.lock().unwrap().insert(path)
                    {
                        respond.send_reset(reason);
                        continue;
                    }
                    let te = req
                        .headers()
                        .get("te")
                        .map(|v| format!(" te={}", v.to_str().unwrap_or("?")))
                        .unwrap_or_default();
                    s.processed.lock().unwrap().push(format!(
                        "{} {}{te}",
                        req.method(),
                        req.uri().path()
                    ));
                    let Ok(mut body) = respond.send_response(http::Response::new(()), false) else {
                        continue;
                    };
                    let _ = body.send_data(Bytes::from_static(b"ok"), true);
                }
            });
        }
    });
    (addr, seen)
}

/// A refused stream was not processed: a request of any method is sent again on a fresh
/// connection (without spending the retry budget) and succeeds, processed once — with its
/// body too, from the bounded copy every request to an HTTP/2 upstream keeps (seed 004's
/// per-connection limit must not fail a POST).
#[tokio::test]
async fn refused_streams_are_resent_on_a_new_connection() {
    let (up, seen) = refusing_upstream().await;
    let gw = gateway(up, "");
    let mut c = h1_client(gw.addr).await;
    let send = |method: &str, path: &str, body: &'static str| {
        http::Request::builder()
            .method(method)
            .uri(path)
            .header("host", "a")
            .body(full(body))
            .unwrap()
    };
    use http_body_util::BodyExt;
    for (i, (m, p)) in [
        ("GET", "/refuse-a"),
        ("GET", "/b"),
        ("POST", "/refuse-c"),
        ("DELETE", "/refuse-d"),
    ]
    .iter()
    .enumerate()
    {
        let resp = c.send_request(send(m, p, "")).await.unwrap();
        assert_eq!(resp.status(), 200, "request {i}");
        resp.into_body().collect().await.unwrap();
    }
    assert_eq!(
        *seen.processed.lock().unwrap(),
        [
            "GET /refuse-a",
            "GET /b",
            "POST /refuse-c",
            "DELETE /refuse-d"
        ],
        "each processed once"
    );
    assert_eq!(stat(&gw, |s| s.refused_resends.load(Ordering::Relaxed)), 3);
    assert_eq!(stat(&gw, |s| s.retries.load(Ordering::Relaxed)), 0);
    assert_eq!(
        seen.conns.load(Ordering::SeqCst),
        4,
        "each resend on a new connection"
    );

    let resp = c
        .send_request(send("POST", "/refuse-e", "hello"))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.into_body().collect().await.unwrap();
    assert_eq!(
        seen.processed
            .lock()
            .unwrap()
            .iter()
            .filter(|p| *p == "POST /refuse-e")
            .count(),
        1,
        "the POST with a body is processed exactly once"
    );
    assert_eq!(stat(&gw, |s| s.refused_resends.load(Ordering::Relaxed)), 4);
}

/// A stream the server resets alone (INTERNAL_ERROR, after the request was processed or
/// not) fails one exchange, not the connection: an idempotent request is retried once (from
/// the retry budget) on the same connection, and no new connection is opened. A
/// non-idempotent one is not retried (502), and the connection goes on serving.
#[tokio::test]
async fn a_reset_stream_is_retried_on_its_own_connection() {
    let (up, seen) = refusing_upstream().await;
    let gw = gateway(up, "");
    let mut c = h1_client(gw.addr).await;
    let send = |method: &str, path: &str| {
        http::Request::builder()
            .method(method)
            .uri(path)
            .header("host", "a")
            .body(full(""))
            .unwrap()
    };
    use http_body_util::BodyExt;
    for (i, (m, p, status)) in [
        ("GET", "/warm", 200),
        ("GET", "/reset-a", 200),
        ("PUT", "/reset-b", 200),
        ("POST", "/reset-c", 502),
        ("GET", "/after", 200),
    ]
    .iter()
    .enumerate()
    {
        let resp = c.send_request(send(m, p)).await.unwrap();
        assert_eq!(resp.status(), *status, "request {i}: {m} {p}");
        resp.into_body().collect().await.unwrap();
    }
    assert_eq!(
        *seen.processed.lock().unwrap(),
        ["GET /warm", "GET /reset-a", "PUT /reset-b", "GET /after"],
    );
    assert_eq!(stat(&gw, |s| s.retries.load(Ordering::Relaxed)), 2);
    assert_eq!(stat(&gw, |s| s.refused_resends.load(Ordering::Relaxed)), 0);
    assert_eq!(
        seen.conns.load(Ordering::SeqCst),
        1,
        "the resets cost no connection"
    );
}

/// The reset stream's place on its connection is free for the retry: on a connection whose
/// server allows one stream at a time, the retry goes on it, rather than on a new one.
#[tokio::test]
async fn a_reset_streams_place_is_free_for_its_retry() {
    let (up, seen) = refusing_upstream_with(Some(1)).await;
    let gw = gateway(up, "");
    let mut c = h1_client(gw.addr).await;
    use http_body_util::BodyExt;
    for p in ["/warm", "/reset-a"] {
        let req = http::Request::get(p)
            .header("host", "a")
            .body(full(""))
            .unwrap();
        let resp = c.send_request(req).await.unwrap();
        assert_eq!(resp.status(), 200, "{p}");
        resp.into_body().collect().await.unwrap();
    }
    assert_eq!(
        *seen.processed.lock().unwrap(),
        ["GET /warm", "GET /reset-a"]
    );
    assert_eq!(stat(&gw, |s| s.retries.load(Ordering::Relaxed)), 1);
    assert_eq!(
        seen.conns.load(Ordering::SeqCst),
        1,
        "the retry on the same connection"
    );
}

/// A retry kept on the connection whose stream was reset, but which that connection turns
/// away (it refuses every stream from then on, as a server going away does), goes once more
/// on a new connection, and succeeds: keeping the connection costs no request.
#[tokio::test]
async fn a_retry_the_kept_connection_turns_away_goes_on_a_new_one() {
    let (up, seen) = refusing_upstream().await;
    let gw = gateway(up, "");
    let mut c = h1_client(gw.addr).await;
    use http_body_util::BodyExt;
    for (i, p) in ["/warm", "/dying-a", "/after"].iter().enumerate() {
        let req = http::Request::get(*p)
            .header("host", "a")
            .body(full(""))
            .unwrap();
        let resp = c.send_request(req).await.unwrap();
        assert_eq!(resp.status(), 200, "request {i}: {p}");
        resp.into_body().collect().await.unwrap();
    }
    assert_eq!(
        *seen.processed.lock().unwrap(),
        ["GET /warm", "GET /dying-a", "GET /after"],
    );
    assert_eq!(stat(&gw, |s| s.retries.load(Ordering::Relaxed)), 1);
    assert_eq!(
        stat(&gw, |s| s.refused_resends.load(Ordering::Relaxed)),
        1,
        "the refused retry is counted as one"
    );
    assert_eq!(
        seen.conns.load(Ordering::SeqCst),
        2,
        "the turned-away retry, and what came after it, on a second connection"
    );
}

/// `TE: trailers` (required by gRPC servers) reaches an HTTP/2 upstream; other TE values
/// do not (TE is hop-by-hop).
#[tokio::test]
async fn te_trailers_reaches_an_http2_upstream() {
    let (up, seen) = refusing_upstream().await;
    let gw = gateway(up, "");
    let mut c = h1_client(gw.addr).await;
    use http_body_util::BodyExt;
    for (path, te) in [("/t1", "trailers"), ("/t2", "gzip")] {
        let req = http::Request::get(path)
            .header("host", "a")
            .header("te", te)
            .body(full(""))
            .unwrap();
        let resp = c.send_request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        resp.into_body().collect().await.unwrap();
    }
    assert_eq!(
        *seen.processed.lock().unwrap(),
        ["GET /t1 te=trailers", "GET /t2"]
    );
}

/// `max_requests_per_connection` counts streams: a connection that reached it keeps serving
/// until its successor (opened by the keeper, not by a request) is there, then is retired.
#[tokio::test]
async fn h2_rotation_hands_over_to_a_preopened_successor() {
    let (up, seen) = h2c_upstream(Gate::new(0), 0, 100).await;
    let gw = gateway(up, "max_requests_per_connection = 3");
    let preconnects = || stat(&gw, |s| s.preconnects.load(Ordering::Relaxed));
    for i in 0..3 {
        assert_eq!(get(gw.addr, &format!("/r{i}")).await.status(), 200);
    }
    // The fourth finds the connection due: it still uses it and the keeper opens the next.
    assert_eq!(get(gw.addr, "/r3").await.status(), 200);
    wait_for("the first successor", || preconnects() >= 1).await;
    // The fifth retires the first connection and starts on its successor.
    for i in 4..7 {
        assert_eq!(get(gw.addr, &format!("/r{i}")).await.status(), 200);
    }
    assert_eq!(
        stat(&gw, |s| s.retired_max_requests.load(Ordering::Relaxed)),
        1
    );
    assert_eq!(get(gw.addr, "/r7").await.status(), 200);
    wait_for("the second successor", || preconnects() >= 2).await;
    assert_eq!(get(gw.addr, "/r8").await.status(), 200);
    assert_eq!(
        stat(&gw, |s| s.retired_max_requests.load(Ordering::Relaxed)),
        2
    );
    assert_eq!(
        stat(&gw, |s| s.connects_on_request.load(Ordering::Relaxed)),
        1,
        "only the first connection was opened on a request's path"
    );
    assert_eq!(seen.conns.load(Ordering::SeqCst), 3);
    assert_eq!(seen.processed.lock().unwrap().len(), 9);
}

/// `max_connection_lifetime` on HTTP/2: an expired connection gets a successor in the
/// background, and requests move to it without any of them paying for a connect.
#[tokio::test]
async fn h2_lifetime_rotation_moves_requests_to_the_successor() {
    let (up, seen) = h2c_upstream(Gate::new(0), 0, 100).await;
    let gw = gateway(up, "max_connection_lifetime = \"500ms\"");
    assert_eq!(get(gw.addr, "/1").await.status(), 200);
    // The keeper's tick finds it expired and opens the successor.
    wait_for("the successor", || {
        stat(&gw, |s| s.preconnects.load(Ordering::Relaxed)) >= 1
    })
    .await;
    assert_eq!(get(gw.addr, "/2").await.status(), 200);
    assert_eq!(stat(&gw, |s| s.retired_lifetime.load(Ordering::Relaxed)), 1);
    assert_eq!(
        stat(&gw, |s| s.connects_on_request.load(Ordering::Relaxed)),
        1
    );
    assert_eq!(stat(&gw, |s| s.preconnects.load(Ordering::Relaxed)), 1);
    assert_eq!(seen.conns.load(Ordering::SeqCst), 2);
}

/// Warm HTTP/2 connections are opened at start; the first requests share one of them.
#[tokio::test]
async fn warm_h2_connections_are_open_before_the_first_request() {
    let (up, seen) = h2c_upstream(Gate::new(0), 0, 100).await;
    let gw = gateway(up, "min_warm_connections = 2");
    wait_for("2 warm connections", || {
        seen.conns.load(Ordering::SeqCst) >= 2
    })
    .await;
    assert_eq!(concurrent_gets(gw.addr, 4).await, vec![200; 4]);
    assert_eq!(
        stat(&gw, |s| s.connects_on_request.load(Ordering::Relaxed)),
        0
    );
    assert_eq!(stat(&gw, |s| s.preconnects.load(Ordering::Relaxed)), 2);
    assert_eq!(seen.conns.load(Ordering::SeqCst), 2);
}

/// An HTTP/2 server that takes no stream (`SETTINGS_MAX_CONCURRENT_STREAMS` 0) is not sent a
/// new connection per request: while one is open and says so, requests fail at once as
/// with no connection to be had (`502 upstream_connect_failed`, another endpoint tried
/// first when there is one).
#[tokio::test]
async fn a_server_that_takes_no_stream_gets_no_connection_per_request() {
    let (up, seen) = h2c_upstream(Gate::new(0), 0, 0).await;
    let gw = TestGateway::start(&format!(
        "[server]\nworkers = 1\n[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\nprotocol = \"http2\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\nresponse_timeout = \"2s\"\n"
    ));
    let mut statuses = Vec::new();
    for i in 0..10 {
        statuses.push(get(gw.addr, &format!("/n{i}")).await.status().as_u16());
    }
    assert!(statuses.iter().all(|&s| s >= 500), "{statuses:?}");
    assert!(
        statuses[2..].iter().all(|&s| s == 502),
        "once it said so, at once: {statuses:?}"
    );
    let conns = seen.conns.load(Ordering::SeqCst);
    assert!(conns <= 3, "{conns} connections for 10 requests");
    assert!(seen.processed.lock().unwrap().is_empty());
}

/// A connection whose server allows no stream carries none, so it is idle from its start:
/// with a short `idle_timeout` it is still kept until it is replaced (after a second), not
/// let go first, which had the next request open a connection of its own and wait in it.
#[tokio::test]
async fn a_connection_whose_server_allows_no_stream_outlives_a_short_idle_timeout() {
    let (up, seen) = h2c_upstream(Gate::new(0), 0, 0).await;
    let gw = TestGateway::start(&format!(
        "[server]\nworkers = 1\n[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\nprotocol = \"http2\"\nidle_timeout = \"200ms\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\nresponse_timeout = \"1s\"\n"
    ));
    let mut statuses = Vec::new();
    for i in 0..8 {
        statuses.push(get(gw.addr, &format!("/n{i}")).await.status().as_u16());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(
        statuses[2..].iter().all(|&s| s == 502),
        "refused at once, none waiting out its response timeout: {statuses:?}"
    );
    let conns = seen.conns.load(Ordering::SeqCst);
    assert!(conns <= 6, "{conns} connections: {statuses:?}");
}

/// Behind a load balancer the next connection may reach a server that takes streams: one
/// whose server has allowed none for a second is replaced, and requests are served again.
#[tokio::test]
async fn a_connection_whose_server_allows_no_stream_is_replaced() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = l.local_addr().unwrap();
    let conns = Arc::new(AtomicUsize::new(0));
    let seen = conns.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = l.accept().await {
            // The first connection allows no stream; the later ones do.
            let first = seen.fetch_add(1, Ordering::SeqCst) == 0;
            tokio::spawn(async move {
                let svc = service_fn(|_req: http::Request<hyper::body::Incoming>| async {
                    Ok::<_, Infallible>(http::Response::new(full("ok")))
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .max_concurrent_streams(if first { 0 } else { 100 })
                    .serve_connection(TokioIo::new(tcp), svc)
                    .await;
            });
        }
    });
    let gw = TestGateway::start(&format!(
        "[server]\nworkers = 1\n[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\nprotocol = \"http2\"\nmin_warm_connections = 1\nidle_timeout = \"60s\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\nresponse_timeout = \"1s\"\n"
    ));
    // The warm connection open, and its server's SETTINGS read.
    wait_for("the warm connection", || conns.load(Ordering::SeqCst) >= 1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut statuses = Vec::new();
    loop {
        let status = get(gw.addr, "/x").await.status().as_u16();
        statuses.push(status);
        if status == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never served: {statuses:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let n = conns.load(Ordering::SeqCst);
    assert_eq!(
        statuses[0], 502,
        "refused at once while it allows none: {statuses:?}"
    );
    assert!((2..=4).contains(&n), "{n} connections: {statuses:?}");
}

/// A warm HTTP/2 connection the server closes (GOAWAY after its one request) is replaced
/// at once, not at the keeper's next tick (`idle_timeout`, a minute here): the next
/// request finds a warm one.
#[tokio::test]
async fn a_warm_h2_connection_the_server_closes_is_replaced_at_once() {
    let (up, seen) = h2c_upstream(Gate::new(0), 1, 100).await;
    let gw = TestGateway::start(&format!(
        "[server]\nworkers = 1\n[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\nprotocol = \"http2\"\nmin_warm_connections = 1\nidle_timeout = \"60s\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
    ));
    wait_for("the warm connection", || {
        seen.conns.load(Ordering::SeqCst) >= 1
    })
    .await;
    assert_eq!(get(gw.addr, "/a").await.status(), 200);
    // Its server sent GOAWAY after that request and closed it: a successor is opened.
    wait_for("a successor", || seen.conns.load(Ordering::SeqCst) >= 2).await;
    assert_eq!(get(gw.addr, "/b").await.status(), 200);
    assert_eq!(
        stat(&gw, |s| s.connects_on_request.load(Ordering::Relaxed)),
        0
    );
}

/// An h2 upstream whose first connection goes silent (no frame read or answered, socket
/// left open) when `silence` is notified; later connections serve normally.
async fn silencing_upstream() -> (SocketAddr, Seen, Arc<Notify>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Seen::default();
    let silence = Arc::new(Notify::new());
    let (s, quiet) = (seen.clone(), silence.clone());
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = l.accept().await else {
                return;
            };
            let n = s.conns.fetch_add(1, Ordering::SeqCst) + 1;
            let (s, quiet) = (s.clone(), quiet.clone());
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(tcp).await else {
                    return;
                };
                loop {
                    tokio::select! {
                        r = conn.accept() => {
                            let Some(Ok((req, mut respond))) = r else { return };
                            s.processed.lock().unwrap().push(req.uri().path().to_owned());
                            if let Ok(mut body) = respond.send_response(http::Response::new(()), false) {
                                let _ = body.send_data(Bytes::from_static(b"ok"), true);
                            }
                        }
                        _ = quiet.notified(), if n == 1 => {
                            // Hold the connection without polling it.
                            std::future::pending::<()>().await;
                        }
                    }
                }
            });
        }
    });
    (addr, seen, silence)
}

/// A connection whose server went silent is found by an unanswered PING and replaced, so the
/// next request does not hang on it.
#[tokio::test]
async fn silent_connection_is_found_by_ping_and_replaced() {
    let (up, seen, silence) = silencing_upstream().await;
    let gw = gateway(
        up,
        "http2_keepalive_interval = \"1s\"\nconnect_timeout = \"300ms\"",
    );
    assert_eq!(get(gw.addr, "/1").await.status(), 200);
    silence.notify_one();
    wait_for("the silent connection to be closed", || {
        stat(&gw, |s| s.closed_by_server.load(Ordering::Relaxed)) >= 1
    })
    .await;
    assert_eq!(get(gw.addr, "/2").await.status(), 200);
    assert_eq!(seen.conns.load(Ordering::SeqCst), 2);
    assert_eq!(*seen.processed.lock().unwrap(), ["/1", "/2"]);
}

/// Without PINGs (the default), a connection gone silent is found by a response that timed
/// out with nothing at all read on it since its stream started: it takes no new streams,
/// and the next request opens a fresh connection. It stayed the shared connection, and
/// every request timed out on it, until the kernel gave up on it.
#[tokio::test]
async fn a_connection_silent_for_a_whole_response_timeout_takes_no_new_streams() {
    let (up, seen, silence) = silencing_upstream().await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\nprotocol = \"http2\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\nresponse_timeout = \"300ms\"\n"
    ));
    assert_eq!(get(gw.addr, "/1").await.status(), 200);
    silence.notify_one();
    // (Time for the server to take the notice and stop reading.)
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(get(gw.addr, "/2").await.status(), 504);
    assert_eq!(get(gw.addr, "/3").await.status(), 200);
    assert_eq!(get(gw.addr, "/4").await.status(), 200);
    assert_eq!(seen.conns.load(Ordering::SeqCst), 2);
    assert_eq!(*seen.processed.lock().unwrap(), ["/1", "/3", "/4"]);
}

/// A response cut off by what the route's total deadline left of its response timeout (a
/// few milliseconds of a healthy server's thinking) does not take its connection out of
/// use: only silence for a whole response timeout does.
#[tokio::test]
async fn a_response_cut_by_the_total_deadline_keeps_its_connection() {
    let (up, conns) = h2_server(None, |req, mut respond| async move {
        // `/slow` thinks for 300 ms; anything else answers at once.
        if req.uri().path() == "/slow" {
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        if let Ok(mut body) = respond.send_response(http::Response::new(()), false) {
            let _ = body.send_data(Bytes::from_static(b"ok"), true);
        }
    })
    .await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\nprotocol = \"http2\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\nresponse_timeout = \"5s\"\ntotal_timeout = \"100ms\"\n"
    ));
    assert_eq!(get(gw.addr, "/1").await.status(), 200);
    assert_eq!(get(gw.addr, "/slow").await.status(), 504);
    assert_eq!(get(gw.addr, "/2").await.status(), 200);
    assert_eq!(
        conns.load(Ordering::SeqCst),
        1,
        "the connection was taken out of use"
    );
}

// ---- over TLS ----------------------------------------------------------------------

/// `protocol = "auto"`: ALPN offers h2 and http/1.1; an h2 server gets one multiplexed
/// HTTP/2 connection that concurrent requests share.
#[tokio::test]
async fn auto_speaks_h2_over_tls_when_alpn_picks_it() {
    let pki = tls::Pki::new();
    let (up, seen) = tls::tls_ok_upstream(
        &pki,
        tls::ServerOpts {
            alpn: &[b"h2", b"http/1.1"],
            ..tls::ServerOpts::default()
        },
    )
    .await;
    let gw = tls::https_gateway(&pki, up, "protocol = \"auto\"");
    assert_eq!(get(gw.addr, "/").await.status(), 200);
    let tasks: Vec<_> = (0..6)
        .map(|_| {
            let addr = gw.addr;
            tokio::spawn(async move { get(addr, "/").await.status().as_u16() })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    assert_eq!(seen.requests.load(Ordering::SeqCst), 7);
    assert_eq!(
        seen.conns.load(Ordering::SeqCst),
        1,
        "one shared connection"
    );
    let hs = seen.handshakes.lock().unwrap().clone();
    assert_eq!(hs[0].alpn.as_deref(), Some(&b"h2"[..]));
    assert_eq!(stat(&gw, |s| s.h2_connections.load(Ordering::Relaxed)), 1);
    assert_eq!(stat(&gw, |s| s.reuses.load(Ordering::Relaxed)), 6);
}

/// `protocol = "auto"` against a server that only speaks http/1.1: ALPN picks it and the
/// pool works as an HTTP/1.1 pool.
#[tokio::test]
async fn auto_falls_back_to_http1_when_alpn_picks_it() {
    let pki = tls::Pki::new();
    let (up, seen) = tls::tls_ok_upstream(&pki, tls::ServerOpts::default()).await;
    let gw = tls::https_gateway(&pki, up, "protocol = \"auto\"");
    for _ in 0..3 {
        assert_eq!(get(gw.addr, "/").await.status(), 200);
    }
    let hs = seen.handshakes.lock().unwrap().clone();
    assert_eq!(hs.len(), 1);
    assert_eq!(hs[0].alpn.as_deref(), Some(&b"http/1.1"[..]));
    assert_eq!(stat(&gw, |s| s.h2_connections.load(Ordering::Relaxed)), 0);
    assert_eq!(stat(&gw, |s| s.reuses.load(Ordering::Relaxed)), 2);
}

/// `protocol = "http2"` over TLS offers only h2; rotation of HTTP/2 connections resumes the
/// TLS session too.
#[tokio::test]
async fn http2_over_tls_offers_only_h2_and_resumes_on_rotation() {
    let pki = tls::Pki::new();
    let (up, seen) = tls::tls_ok_upstream(
        &pki,
        tls::ServerOpts {
            alpn: &[b"h2", b"http/1.1"],
            ..tls::ServerOpts::default()
        },
    )
    .await;
    let gw = tls::https_gateway(
        &pki,
        up,
        "protocol = \"http2\"\nmax_requests_per_connection = 2",
    );
    for i in 0..2 {
        assert_eq!(get(gw.addr, &format!("/{i}")).await.status(), 200);
    }
    // The third finds the connection due; the keeper opens the successor.
    assert_eq!(get(gw.addr, "/2").await.status(), 200);
    wait_for("the successor", || {
        seen.handshakes.lock().unwrap().len() >= 2
    })
    .await;
    assert_eq!(get(gw.addr, "/3").await.status(), 200);
    let hs = seen.handshakes.lock().unwrap().clone();
    assert!(hs.iter().all(|h| h.alpn.as_deref() == Some(&b"h2"[..])));
    assert_eq!(hs[0].kind, rustls::HandshakeKind::Full);
    assert_eq!(hs[1].kind, rustls::HandshakeKind::Resumed);
    assert_eq!(
        stat(&gw, |s| s.tls_resumed_handshakes.load(Ordering::Relaxed)),
        1
    );
    assert_eq!(seen.requests.load(Ordering::SeqCst), 4);
}

/// A WebSocket upgrade cannot cross an HTTP/2 connection: 502 with a clear code, and
/// nothing is sent upstream as a plain request.
#[tokio::test]
async fn an_upgrade_to_an_http2_cluster_is_refused_clearly() {
    let (up, seen) = refusing_upstream().await;
    let gw = gateway(up, "");
    let (text, _) = raw(
        gw.addr,
        b"GET /ws HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(text.starts_with("HTTP/1.1 502"), "{text}");
    assert!(text.contains("upgrade_needs_http1"), "{text}");
    assert!(seen.processed.lock().unwrap().is_empty());
}

/// `idle_timeout` applies to HTTP/2 connections too: connections a burst opened are closed
/// once no stream has used them for that long (beyond `min_warm_connections`).
#[tokio::test]
async fn idle_h2_connections_expire() {
    let gate = Gate::new(0);
    let (up, seen) = h2c_upstream(gate.clone(), 0, 4).await;
    let gw = gateway(up, "idle_timeout = \"300ms\"");
    assert_eq!(get(gw.addr, "/warm").await.status(), 200);
    gate.arm(10);
    assert_eq!(concurrent_gets(gw.addr, 10).await, vec![200; 10]);
    assert_eq!(seen.conns.load(Ordering::SeqCst), 3);
    wait_for("idle HTTP/2 connections to expire", || {
        stat(&gw, |s| s.retired_idle.load(Ordering::Relaxed)) >= 3
    })
    .await;
    // A new request opens a fresh connection.
    assert_eq!(get(gw.addr, "/after").await.status(), 200);
    assert_eq!(seen.conns.load(Ordering::SeqCst), 4);
}

/// An HTTP/2 server that closes every connection as soon as it takes it (an HTTP/1.1-only
/// server, or one draining): the keeper backs off as for HTTP/1.1 spares that die so,
/// rather than opening its spares again as fast as connects go.
#[tokio::test]
async fn h2_spares_closed_as_soon_as_opened_make_the_keeper_back_off() {
    let (addr, accepted) = closing_listener().await;
    let _gw = gateway(addr, "min_warm_connections = 2\neject_after_failures = 0");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let n = accepted.load(Ordering::SeqCst);
    // Two at a time, backing off from 100 ms and doubling (100 + 200 + 400 + 800 + 1600
    // ms): about a dozen in 3 s. Without a backoff, thousands; with one that starts over
    // after each open, some 20 to 40.
    assert!(n <= 16, "{n} connects in 3 s: the keeper did not back off");
}

/// A client's request trailers reach an HTTP/2 upstream without the fields no trailer may
/// carry: a connection-specific one (which the HTTP/2 layer refuses to send, so the stream
/// was never ended and the request timed out as the endpoint's failure) or one the gateway
/// vouches for in the head.
#[tokio::test]
async fn request_trailers_reach_an_http2_upstream_without_forbidden_fields() {
    use http_body_util::BodyExt;
    let up = h2c_upstream_with(|req| async move {
        let body = req.into_body().collect().await.unwrap();
        let mut names: Vec<String> = body
            .trailers()
            .map(|t| t.keys().map(|k| k.to_string()).collect())
            .unwrap_or_default();
        names.sort();
        http::Response::new(full(names.join(",")))
    })
    .await;
    let gw = gateway(up, "");
    let (out, closed) = raw(
        gw.addr,
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n5\r\nhello\r\n0\r\nConnection: x\r\nX-Forwarded-For: 6.6.6.6\r\nX-Real-IP: 6.6.6.7\r\nProxy-Connection: x\r\nX-Sum: 1\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(closed, "{out}");
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert!(out.ends_with("\r\n\r\nx-sum"), "{out}");
}

/// With `idle_timeout = "0s"` an HTTP/2 connection a stream is on is not idle: the keeper
/// leaves it open, and the next request shares it instead of opening another.
#[tokio::test]
async fn a_zero_idle_timeout_never_closes_an_h2_connection_a_stream_is_on() {
    let gate = Gate::new(2);
    let (up, seen) = h2c_upstream(gate.clone(), 0, 100).await;
    let gw = gateway(up, "idle_timeout = \"0s\"");
    let addr = gw.addr;
    let first = tokio::spawn(async move { get(addr, "/held").await.status() });
    wait_for("the first request to reach the upstream", || {
        gate.in_flight.load(Ordering::SeqCst) == 1
    })
    .await;
    // The keeper's ticks meanwhile (every 100 ms), while the stream is on it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(stat(&gw, |s| s.retired_idle.load(Ordering::Relaxed)), 0);
    assert_eq!(get(gw.addr, "/second").await.status(), 200);
    assert_eq!(first.await.unwrap(), 200);
    assert_eq!(seen.conns.load(Ordering::SeqCst), 1);
}

/// The headers the gateway sets reach an HTTP/2 upstream too (put into its copy of the
/// client's headers): X-Forwarded-For appended, Via, the client's request id, and no
/// `Expect`.
#[tokio::test]
async fn forwarding_headers_reach_an_http2_upstream() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = l.accept().await {
            let s = s.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let s = s.clone();
                    async move {
                        let all = |n: &str| {
                            req.headers()
                                .get_all(n)
                                .iter()
                                .map(|v| v.to_str().unwrap().to_owned())
                                .collect::<Vec<_>>()
                                .join("|")
                        };
                        s.lock().unwrap().push(format!(
                            "xff={} via={} id={} proto={} expect={}",
                            all("x-forwarded-for"),
                            all("via"),
                            all("x-request-id"),
                            all("x-forwarded-proto"),
                            all("expect"),
                        ));
                        Ok::<_, Infallible>(http::Response::new(full("ok")))
                    }
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tcp), svc)
                    .await;
            });
        }
    });
    let gw = gateway(addr, "");
    let mut c = h1_client(gw.addr).await;
    use http_body_util::BodyExt;
    let req = http::Request::post("/f")
        .header("host", "a")
        .header("x-forwarded-for", "10.0.0.1")
        .header("x-request-id", "rid-7")
        .header("expect", "100-continue")
        .body(full("hello"))
        .unwrap();
    let resp = c.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    resp.into_body().collect().await.unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        ["xff=10.0.0.1, 127.0.0.1 via=1.1 tailgate id=rid-7 proto=http expect="]
    );
}

/// Bursts of 30 requests, each connection sent GOAWAY after its first answer: the requests
/// a closing connection turns away share one new connection instead of opening one each
/// (after a GOAWAY, hyper keeps the connection looking open until its task runs, and every
/// request sent on it meanwhile comes back unsent). 5 to 6 connections in all; each
/// turned-away request opening its own made 21 to 100.
#[tokio::test]
async fn requests_turned_away_by_a_closing_connection_share_its_successor() {
    let (up, seen) = h2c_upstream(Gate::new(0), 1, 100).await;
    let gw = gateway(up, "");
    for round in 0..5 {
        assert_eq!(
            concurrent_gets(gw.addr, 30).await,
            vec![200; 30],
            "round {round}"
        );
    }
    let conns = seen.conns.load(Ordering::SeqCst);
    assert!(conns <= 15, "{conns} connections for 5 bursts");
    assert_eq!(
        seen.processed.lock().unwrap().len(),
        150,
        "each request processed once"
    );
}

/// An h2c upstream that reads each request's body whole and answers `got N`.
async fn h2c_body_counting_upstream() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = l.accept().await {
            tokio::spawn(async move {
                let svc = service_fn(|req: http::Request<hyper::body::Incoming>| async move {
                    let got = req.into_body().collect().await.map(|b| b.to_bytes().len());
                    let text = match got {
                        Ok(n) => format!("got {n}"),
                        Err(e) => format!("body failed: {e}"),
                    };
                    Ok::<_, Infallible>(http::Response::new(full(text)))
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tcp), svc)
                    .await;
            });
        }
    });
    addr
}

/// Over HTTP/2 too, the response timeout counts from the request body's last progress: a
/// slow upload that keeps moving is answered, and one that stops is a 408 that does not
/// count against the endpoint.
#[tokio::test]
async fn h2_slow_upload_is_not_cut_off_and_a_stalled_one_is_the_clients_fault() {
    let up = h2c_body_counting_upstream().await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\nprotocol = \"http2\"\neject_after_failures = 1\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\nresponse_timeout = \"300ms\"\n"
    ));
    let slow = trickle(13, 1000, Duration::from_millis(100), None);
    let r = post(&mut h1_client(gw.addr).await, slow).await.unwrap();
    assert_eq!(
        (r.status().as_u16(), &r.body()[..]),
        (200, &b"got 13000"[..])
    );

    let stalled = trickle(10, 1000, Duration::from_millis(20), Some(2));
    let r = post(&mut h1_client(gw.addr).await, stalled).await.unwrap();
    assert_eq!(r.status(), 408, "{:?}", r.body());
    assert!(String::from_utf8_lossy(r.body()).contains("client_body_timeout"));
    let pools = gw.gw.as_ref().unwrap().endpoint_pools();
    assert_eq!(pools[0].load.ejections.load(Ordering::Relaxed), 0);
}

/// A request body that fails on its way to an HTTP/2 upstream (over `max_body_bytes`, or
/// its chunked framing broken) is the client's fault, as it is to an HTTP/1.1 one: `413`
/// and `400`, not a `502 upstream_reset`, and no failure counted against the endpoint.
/// hyper's connection task polls the body and only resets the stream when it fails, so the
/// send failed with that reset, and five such requests ejected a healthy endpoint.
#[tokio::test]
async fn h2_a_body_over_the_limit_or_broken_is_the_clients_fault() {
    let up = h2c_body_counting_upstream().await;
    let gw = TestGateway::start(&format!(
        "[server]\nworkers = 1\nmax_body_bytes = 1024\n[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\nprotocol = \"http2\"\neject_after_failures = 1\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
    ));
    let over = format!(
        "POST /over HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n800\r\n{}\r\n0\r\n\r\n",
        "x".repeat(0x800)
    );
    let broken = "POST /broken HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n";
    for _ in 0..3 {
        for (req, status, error) in [
            (over.as_str(), " 413 ", "body_too_large"),
            (broken, " 400 ", "bad_request"),
        ] {
            let (text, _) = raw(gw.addr, req.as_bytes(), Duration::from_secs(5)).await;
            let line = text.lines().next().unwrap_or_default();
            assert!(line.contains(status), "{line}: {text}");
            assert!(text.contains(error), "{text}");
        }
    }
    let pools = gw.gw.as_ref().unwrap().endpoint_pools();
    assert_eq!(pools[0].load.ejections.load(Ordering::Relaxed), 0);
    // The endpoint still answers.
    let r = post(&mut h1_client(gw.addr).await, full("abc"))
        .await
        .unwrap();
    assert_eq!((r.status().as_u16(), &r.body()[..]), (200, &b"got 3"[..]));
}

/// A request with a body, on a reused HTTP/2 connection that fails after the body was
/// sent, is sent again only on a route marked `idempotent`, as over HTTP/1.1 (a `PUT`
/// included, whose method is idempotent): every HTTP/2 request keeps a copy of its body
/// for a stream refused unprocessed, and that copy was replayed for any idempotent method.
#[tokio::test]
async fn a_body_is_replayed_after_a_reset_only_on_an_idempotent_route() {
    let (up, seen) = refusing_upstream().await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\nprotocol = \"http2\"\nretry_budget_percent = 100\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n[[route]]\npath_prefix = \"/readreset-idem\"\ncluster = \"up\"\nidempotent = true\n"
    ));
    let mut c = h1_client(gw.addr).await;
    for (m, p, status) in [
        ("GET", "/warm", 200),
        ("PUT", "/readreset-put", 502),
        ("POST", "/readreset-idem-post", 200),
    ] {
        let body = if m == "GET" { "" } else { "0123456789" };
        let r = send(&mut c, m, p, full(body)).await.unwrap();
        assert_eq!(r.status(), status, "{m} {p}: {:?}", r.body());
        if status == 502 {
            c = h1_client(gw.addr).await;
        }
    }
    assert_eq!(
        *seen.processed.lock().unwrap(),
        ["GET /warm", "POST /readreset-idem-post"],
        "the PUT was sent once, the POST on the idempotent route twice"
    );
}

/// A stream refused unprocessed while its body still streams from the client (past what a
/// copy can send again) is answered `502`, but not counted against the endpoint: a server
/// refuses streams when it is busy or closing, not broken. Three such refusals ejected an
/// endpoint that fails after one.
#[tokio::test]
async fn a_refused_stream_that_cannot_be_resent_is_not_the_endpoints_failure() {
    use tokio::io::AsyncWriteExt;
    let (up, seen) = refusing_upstream().await;
    let gw = gateway(up, "eject_after_failures = 1\n");
    for i in 0..3 {
        let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
        let head = format!("POST /refuse-{i} HTTP/1.1\r\nHost: a\r\nContent-Length: 20000\r\n\r\n");
        s.write_all(head.as_bytes()).await.unwrap();
        s.write_all(&[b'x'; 1000]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let _ = s.write_all(&[b'x'; 19000]).await;
        let (text, _) = read_until_close(&mut s, Duration::from_secs(5)).await;
        assert!(text.starts_with("HTTP/1.1 502 "), "{text}");
    }
    assert!(seen.processed.lock().unwrap().is_empty());
    let pools = gw.gw.as_ref().unwrap().endpoint_pools();
    assert_eq!(pools[0].load.ejections.load(Ordering::Relaxed), 0);
}

/// An HTTP/2 upstream's answer with a head of 20 KiB (more than hyper's default 16 KiB
/// list, less than the 64 KiB an HTTP/1.1 upstream may send) is passed on, once: not reset
/// by the gateway's own HTTP/2 layer, retried, and answered 502.
#[tokio::test]
async fn a_large_response_head_from_an_h2_upstream_is_served() {
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    let up = h2c_upstream_with(move |_| {
        h.fetch_add(1, Ordering::SeqCst);
        async {
            http::Response::builder()
                .header("x-big", "b".repeat(20 * 1024))
                .body(full("ok"))
                .unwrap()
        }
    })
    .await;
    let gw = gateway(up, "");
    let resp = get(gw.addr, "/big").await;
    assert_eq!(resp.status(), 200, "{:?}", resp.body());
    assert_eq!(resp.headers()["x-big"].len(), 20 * 1024);
    assert_eq!(hits.load(Ordering::SeqCst), 1);
}

/// Clients that stop reading large HTTP/2 answers hold back only their own streams: a
/// small answer on the same upstream connection still comes whole (with hyper's 5 MiB
/// connection window, three stalled 2 MiB stream windows stopped every stream on it; with
/// 64 MiB, a hundred did, each holding what its client's socket did not take).
#[tokio::test]
async fn slow_readers_do_not_stall_other_streams_on_an_h2_connection() {
    // Pieces of the large answers made: hyper's server makes one only when the stream has
    // window for it, so this stops growing once every stalled stream's window is full.
    let made = Arc::new(AtomicUsize::new(0));
    let counted = made.clone();
    let up = h2c_upstream_with(move |req: http::Request<hyper::body::Incoming>| {
        let made = counted.clone();
        async move {
            let big = req.uri().path() == "/big";
            let (size, chunk) = if big {
                (64 << 20, 64 << 10)
            } else {
                (256 << 10, 16 << 10)
            };
            let chunks = futures_util::stream::iter((0..size / chunk).map(move |_| {
                if big {
                    made.fetch_add(1, Ordering::SeqCst);
                }
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(hyper::body::Frame::data(
                    Bytes::from(vec![b'x'; chunk]),
                ))
            }));
            http::Response::new(http_body_util::StreamBody::new(chunks).boxed())
        }
    })
    .await;
    let gw = gateway(up, "");
    let mut stalled = Vec::new();
    for _ in 0..100 {
        let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
        use tokio::io::AsyncWriteExt;
        s.write_all(b"GET /big HTTP/1.1\r\nHost: a\r\n\r\n")
            .await
            .unwrap();
        stalled.push(s);
    }
    // Until the stalled answers stop moving (their clients' sockets and their streams'
    // windows full), however long the machine takes to fill them.
    let mut last = usize::MAX;
    for _ in 0..150 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = made.load(Ordering::SeqCst);
        if now == last {
            break;
        }
        last = now;
    }
    let resp = tokio::time::timeout(Duration::from_secs(10), get(gw.addr, "/small"))
        .await
        .expect("a small answer beside a hundred stalled large ones");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.body().len(), 256 << 10);
    drop(stalled);
}

/// An upstream that restarts tells every connection to go away at once (GOAWAY, its
/// streams in flight finishing). A request then turned away unsent by one of them, and by
/// the next, goes on a new connection: answered, processed once, not a `502`.
#[tokio::test]
async fn a_request_turned_away_by_every_closing_connection_gets_a_new_one() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = l.local_addr().unwrap();
    // Every connection shuts down gracefully when told; `/hold1` and `/hold3` wait for
    // `hold`, `/hold2` for `hold2`.
    let restart = Arc::new(Notify::new());
    let (hold_tx, hold) = watch::channel(false);
    let (hold2_tx, hold2) = watch::channel(false);
    let conns = Arc::new(AtomicUsize::new(0));
    let in_flight = Arc::new(AtomicUsize::new(0));
    let processed = Arc::new(Mutex::new(Vec::<String>::new()));
    {
        let (restart, conns, in_flight, processed) = (
            restart.clone(),
            conns.clone(),
            in_flight.clone(),
            processed.clone(),
        );
        tokio::spawn(async move {
            while let Ok((tcp, _)) = l.accept().await {
                conns.fetch_add(1, Ordering::SeqCst);
                let (restart, in_flight, processed) =
                    (restart.clone(), in_flight.clone(), processed.clone());
                let (hold, hold2) = (hold.clone(), hold2.clone());
                tokio::spawn(async move {
                    let svc = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let path = req.uri().path().to_owned();
                        let (in_flight, processed) = (in_flight.clone(), processed.clone());
                        let mut gate = match path.as_str() {
                            "/hold2" => Some(hold2.clone()),
                            p if p.starts_with("/hold") => Some(hold.clone()),
                            _ => None,
                        };
                        async move {
                            processed.lock().unwrap().push(path);
                            in_flight.fetch_add(1, Ordering::SeqCst);
                            if let Some(g) = gate.as_mut() {
                                let _ = g.wait_for(|open| *open).await;
                            }
                            in_flight.fetch_sub(1, Ordering::SeqCst);
                            Ok::<_, Infallible>(http::Response::new(full("ok")))
                        }
                    });
                    let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .max_concurrent_streams(2)
                        .serve_connection(TokioIo::new(tcp), svc);
                    let mut conn = std::pin::pin!(conn);
                    let told = restart.notified();
                    tokio::select! {
                        _ = conn.as_mut() => return,
                        _ = told => {}
                    }
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                });
            }
        });
    }
    let gw = gateway(up, "");
    let addr = gw.addr;
    // Connection A takes `/hold1` and `/hold2` (its two streams), B `/hold3`.
    let h1 = tokio::spawn(async move { get(addr, "/hold1").await.status() });
    let h2 = tokio::spawn(async move { get(addr, "/hold2").await.status() });
    wait_for("two held on A", || in_flight.load(Ordering::SeqCst) == 2).await;
    let h3 = tokio::spawn(async move { get(addr, "/hold3").await.status() });
    wait_for("B opened", || {
        in_flight.load(Ordering::SeqCst) == 3 && conns.load(Ordering::SeqCst) == 2
    })
    .await;
    // `/hold2` answered: A and B each have a stream free.
    hold2_tx.send_replace(true);
    assert_eq!(h2.await.unwrap(), 200);
    // The upstream restarts: both are told to go away.
    restart.notify_waiters();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let resp = get(addr, "/x").await;
    assert_eq!(resp.status(), 200, "{:?}", resp.body());
    assert!(conns.load(Ordering::SeqCst) >= 3, "a new connection for it");
    hold_tx.send_replace(true);
    assert_eq!(h1.await.unwrap(), 200);
    assert_eq!(h3.await.unwrap(), 200);
    let seen = processed.lock().unwrap().clone();
    assert_eq!(
        seen.iter().filter(|p| *p == "/x").count(),
        1,
        "processed once: {seen:?}"
    );
}

/// An HTTP/2 upstream answering every request `503` at once.
async fn failing_h2c() -> SocketAddr {
    h2c_upstream_with(|_| async {
        let mut r = http::Response::new(full("down"));
        *r.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
        r
    })
    .await
}

/// A hedged request whose first copy is refused unprocessed is sent again on a new
/// connection, as without the hedge: the copy's `503` does not stand in for that free
/// resend. It was the answer, and the request was never processed.
#[tokio::test]
async fn a_hedged_request_refused_unprocessed_is_resent_not_answered_by_the_copys_5xx() {
    let (refusing, seen) = refusing_upstream().await;
    let failing = failing_h2c().await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{refusing}\", \"{failing}\"]\nprotocol = \"http2\"\nbalance = \"round_robin\"\nhedge_budget_percent = 100\neject_after_failures = 1000\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\nhedge_delay = \"200ms\"\nresponse_timeout = \"5s\"\n"
    ));
    // Round robin: the first copies alternate between the two endpoints; those sent to the
    // failing one are answered 503 before any hedge.
    let mut refused = 0;
    for i in 0..4 {
        let path = format!("/laterefuse-{i}");
        let status = get(gw.addr, &path).await.status();
        if seen.refused.lock().unwrap().contains(&path) {
            refused += 1;
            assert_eq!(
                status, 200,
                "{path}: the copy's 503 answered a refused request"
            );
            assert!(
                seen.processed
                    .lock()
                    .unwrap()
                    .contains(&format!("GET {path}")),
                "{path} was never processed"
            );
        }
    }
    assert!(refused >= 1, "no first copy went to the refusing endpoint");
    assert!(stat(&gw, |s| s.refused_resends.load(Ordering::Relaxed)) >= 1);
}

/// A hedged request's first copy that stays silent to the response deadline, while the
/// copy's `503` is held, times out its HTTP/2 connection as it does without the hedge:
/// that connection takes no new streams, and the endpoint's next request opens a fresh
/// one. The silent connection stayed in use, each of the endpoint's requests hedged and
/// answered by the other endpoint's 503 until the kernel gave up on it.
#[tokio::test]
async fn a_hedged_first_copy_silent_to_the_deadline_retires_its_connection() {
    let (silent, seen, silence) = silencing_upstream().await;
    let failing = failing_h2c().await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{silent}\", \"{failing}\"]\nprotocol = \"http2\"\nbalance = \"round_robin\"\nhedge_budget_percent = 100\neject_after_failures = 1000\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\nhedge_delay = \"150ms\"\nresponse_timeout = \"600ms\"\n"
    ));
    // Both connections open, then where round robin stands: the request after one the
    // silencing endpoint answered goes to the failing one.
    get(gw.addr, "/a").await;
    get(gw.addr, "/b").await;
    let answered_by_silent = |path: &str| seen.processed.lock().unwrap().iter().any(|p| p == path);
    let mut i = 0;
    loop {
        let path = format!("/probe-{i}");
        if get(gw.addr, &path).await.status() == 200 && answered_by_silent(&path) {
            break;
        }
        i += 1;
        assert!(i < 4, "the silencing endpoint never answered");
    }
    assert_eq!(get(gw.addr, "/other").await.status(), 503);
    silence.notify_one();
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Silent: hedged to the failing endpoint, whose 503 is held to the deadline.
    assert_eq!(get(gw.addr, "/hung").await.status(), 503);
    assert!(!answered_by_silent("/hung"));
    // The silencing endpoint's next request goes on a fresh connection, and is answered.
    let mut i = 0;
    loop {
        let path = format!("/after-{i}");
        let status = get(gw.addr, &path).await.status();
        if answered_by_silent(&path) {
            assert_eq!(status, 200);
            break;
        }
        i += 1;
        assert!(
            i < 3,
            "the silencing endpoint's requests stayed on its silent connection"
        );
    }
    assert_eq!(seen.conns.load(Ordering::SeqCst), 2);
}

/// An upstream that answers `202` at once to every request, the stream ended on its head,
/// and reads each request's body to its end as it comes (no reset): a stream with an
/// upload still coming stays open on its side. Allows `max_streams` at once.
async fn early_answering_upstream(max_streams: u32) -> (SocketAddr, Arc<AtomicUsize>) {
    h2_server(Some(max_streams), |req, mut respond| async move {
        let mut r = http::Response::new(());
        *r.status_mut() = http::StatusCode::ACCEPTED;
        let _ = respond.send_response(r, true);
        let mut body = req.into_body();
        while let Some(Ok(d)) = body.data().await {
            let _ = body.flow_control().release_capacity(d.len());
        }
    })
    .await
}

/// An HTTP/2 server (the h2 crate, for control over each stream) that counts its
/// connections and hands each stream to `stream` on a task of its own; `max_streams` is
/// its SETTINGS_MAX_CONCURRENT_STREAMS.
async fn h2_server<F, Fut>(max_streams: Option<u32>, stream: F) -> (SocketAddr, Arc<AtomicUsize>)
where
    F: Fn(http::Request<h2::RecvStream>, h2::server::SendResponse<Bytes>) -> Fut
        + Clone
        + Send
        + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let conns = Arc::new(AtomicUsize::new(0));
    let counted = conns.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = l.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            let stream = stream.clone();
            tokio::spawn(async move {
                let mut builder = h2::server::Builder::new();
                if let Some(max) = max_streams {
                    builder.max_concurrent_streams(max);
                }
                let Ok(mut conn) = builder.handshake::<_, Bytes>(tcp).await else {
                    return;
                };
                while let Some(Ok((req, respond))) = conn.accept().await {
                    tokio::spawn(stream(req, respond));
                }
            });
        }
    });
    (addr, conns)
}

/// Streams answered before their uploads ended still count against the server's
/// concurrent-stream limit while the uploads go on: a request after two such, on a server
/// that allows two streams, goes on a new connection. Their slots were freed at the
/// answer, and the request went onto the full connection, to wait there behind the
/// uploads until its response timeout (a `504`).
#[tokio::test]
async fn streams_still_uploading_after_an_early_answer_keep_their_places() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (up, conns) = early_answering_upstream(2).await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\nprotocol = \"http2\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\nresponse_timeout = \"1s\"\n"
    ));
    // Settle the server's limit (its SETTINGS) on the first connection.
    assert_eq!(get(gw.addr, "/first").await.status(), 202);
    let mut uploads = Vec::new();
    for i in 0..2 {
        let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
        s.write_all(
            format!(
                "POST /up-{i} HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        let mut head = Vec::new();
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
                .await
                .unwrap()
                .unwrap();
            assert!(n > 0);
            head.extend_from_slice(&buf[..n]);
        }
        assert!(head.starts_with(b"HTTP/1.1 202"), "{head:?}");
        // The upload goes on, a byte every 100 ms, for the rest of the test.
        uploads.push(tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                if s.write_all(b"1\r\nx\r\n").await.is_err() {
                    return;
                }
            }
        }));
    }
    assert_eq!(get(gw.addr, "/after").await.status(), 202);
    assert_eq!(conns.load(Ordering::SeqCst), 2);
    for u in uploads {
        u.abort();
    }
}

/// A hedged request whose first copy is refused unprocessed while the copy is out, and
/// whose copy then answers `200`, is answered by the copy; the refusal says nothing against
/// the first endpoint (no failure counted, so with `eject_after_failures = 1` it is never
/// ejected), as a refused stream sent again without a hedge does not.
#[tokio::test]
async fn a_hedged_first_copy_refused_unprocessed_counts_no_failure() {
    let (refusing, seen) = refusing_upstream().await;
    let slow_ok = h2c_upstream_with(|_| async {
        tokio::time::sleep(Duration::from_millis(600)).await;
        http::Response::new(full("ok"))
    })
    .await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{refusing}\", \"{slow_ok}\"]\nprotocol = \"http2\"\nbalance = \"round_robin\"\nhedge_budget_percent = 100\neject_after_failures = 1\neject_duration = \"60s\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\nhedge_delay = \"200ms\"\nresponse_timeout = \"5s\"\n"
    ));
    let mut refused = 0;
    for i in 0..4 {
        let path = format!("/laterefuse-{i}");
        assert_eq!(get(gw.addr, &path).await.status(), 200, "{path}");
        if seen.refused.lock().unwrap().contains(&path) {
            refused += 1;
        }
    }
    assert!(refused >= 1, "no first copy went to the refusing endpoint");
    let ejections: u64 = gw
        .gw
        .as_ref()
        .unwrap()
        .endpoint_pools()
        .iter()
        .filter(|p| p.addr == refusing)
        .map(|p| p.load.ejections.load(Ordering::Relaxed))
        .sum();
    assert_eq!(ejections, 0, "a refusal was counted against its endpoint");
}
