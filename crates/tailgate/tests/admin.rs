//! The admin plane (seed 001, seed 002): `/metrics` in both text formats parsed back
//! strictly, gzip, 100k series, scrapes answered while every worker is stalled, the lag
//! probe seeing a blocked worker, `/healthz`, `/readyz`, `/stats` and the systemd watchdog.
//! Behaviour and counts only; no timing is asserted.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::Read as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::prom::{self, Exposition};
use common::*;
use http_body_util::BodyExt;

const ADMIN: &str = "[admin]\naddress = \"127.0.0.1:0\"\nlag_probe_interval = \"5ms\"\nstall_threshold = \"300ms\"\n";

fn admin_addr(gw: &TestGateway) -> SocketAddr {
    gw.gw
        .as_ref()
        .unwrap()
        .admin_addr()
        .expect("admin listener")
}

/// GET on the admin listener with extra headers; the whole body (gunzipped if needed).
async fn admin_get(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> http::Response<Bytes> {
    let mut c = h1_client(addr).await;
    let mut req = http::Request::get(path).header("host", "admin");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = c.send_request(req.body(full("")).unwrap()).await.unwrap();
    let (parts, body) = resp.into_parts();
    let mut bytes = body.collect().await.unwrap().to_bytes();
    if parts.headers.get("content-encoding").map(|v| v.as_bytes()) == Some(b"gzip") {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&bytes[..])
            .read_to_end(&mut out)
            .unwrap();
        bytes = out.into();
    }
    http::Response::from_parts(parts, bytes)
}

async fn scrape(addr: SocketAddr) -> Exposition {
    let r = admin_get(addr, "/metrics", &[]).await;
    assert_eq!(r.status(), 200);
    let text = std::str::from_utf8(r.body()).unwrap();
    prom::parse(text, false).unwrap_or_else(|e| panic!("bad exposition: {e}"))
}

async fn send(addr: SocketAddr, method: &str, path: &str, host: &str, body: &'static str) -> u16 {
    let mut c = h1_client(addr).await;
    let req = http::Request::builder()
        .method(method)
        .uri(path)
        .header("host", host)
        .body(full(body))
        .unwrap();
    let resp = c.send_request(req).await.unwrap();
    let status = resp.status().as_u16();
    let _ = resp.into_body().collect().await;
    status
}

fn two_tenants(up: SocketAddr, extra: &str) -> TestGateway {
    TestGateway::start(&format!(
        "{ADMIN}{extra}
[[tenant]]
name = \"acme\"
hosts = [\"acme.test\"]
[[tenant]]
name = \"beta\"
hosts = [\"beta.test\"]
[[cluster]]
name = \"up\"
endpoints = [\"{up}\"]
[[route]]
name = \"acme-api\"
tenant = \"acme\"
path_prefix = \"/api/\"
cluster = \"up\"
[[route]]
tenant = \"beta\"
path_prefix = \"/\"
methods = [\"GET\"]
cluster = \"up\"
"
    ))
}

#[tokio::test]
async fn metrics_parse_back_with_the_requests_counted() {
    let up = echo_upstream().await;
    let gw = two_tenants(up, "");
    for _ in 0..3 {
        assert_eq!(send(gw.addr, "GET", "/api/x", "acme.test", "").await, 200);
    }
    assert_eq!(
        send(gw.addr, "POST", "/api/x", "acme.test", "hello").await,
        200
    );
    assert_eq!(send(gw.addr, "GET", "/nothing", "acme.test", "").await, 404);
    assert_eq!(send(gw.addr, "POST", "/b", "beta.test", "").await, 405);
    let ex = scrape(admin_addr(&gw)).await;

    let acme = [("tenant", "acme"), ("route", "acme-api")];
    let req = |m: &str, c: &str| {
        let mut l = acme.to_vec();
        l.extend([("method", m), ("status_class", c)]);
        ex.value("tailgate_requests_total", &l)
    };
    assert_eq!(req("GET", "2xx"), 3.0);
    assert_eq!(req("POST", "2xx"), 1.0);
    assert_eq!(
        ex.value("tailgate_request_body_bytes_total", &acme),
        5.0,
        "the POST body"
    );
    // The 404 and the 405 matched no route: they count for the tenant the Host names.
    assert_eq!(
        ex.value(
            "tailgate_request_errors_total",
            &[("tenant", "acme"), ("route", ""), ("kind", "no_route")]
        ),
        1.0
    );
    assert_eq!(
        ex.value(
            "tailgate_requests_total",
            &[
                ("tenant", "beta"),
                ("route", ""),
                ("method", "POST"),
                ("status_class", "4xx")
            ]
        ),
        1.0
    );
    // Latency histograms: total and per stage, with every request counted.
    assert_eq!(
        ex.value("tailgate_request_duration_seconds_count", &acme),
        4.0
    );
    let mut ttfb = acme.to_vec();
    ttfb.push(("stage", "upstream_ttfb"));
    assert_eq!(
        ex.value("tailgate_request_stage_duration_seconds_count", &ttfb),
        4.0
    );
    assert_eq!(ex.types["tailgate_request_duration_seconds"], "histogram");
    assert_eq!(ex.types["tailgate_requests_in_flight"], "gauge");
    assert_eq!(ex.value("tailgate_requests_in_flight", &[]), 0.0);
    // Upstream pool events, per cluster and endpoint.
    let ep = up.to_string();
    let on_request = ex.value(
        "tailgate_upstream_connects_total",
        &[("cluster", "up"), ("endpoint", &ep), ("when", "on_request")],
    );
    let reuses = ex.value(
        "tailgate_upstream_connection_reuses_total",
        &[("cluster", "up"), ("endpoint", &ep)],
    );
    assert!(on_request >= 1.0);
    assert_eq!(
        on_request + reuses,
        4.0,
        "every upstream request connected or reused"
    );
    // Runtime and process.
    assert!(ex.value("tailgate_runtime_lag_seconds_count", &[("worker", "0")]) >= 1.0);
    assert!(ex.value("process_resident_memory_bytes", &[]) > 0.0);
    assert!(ex.value("process_open_fds", &[]) > 0.0);
    assert!(ex.value("process_cpu_seconds_total", &[]) >= 0.0);
    assert_eq!(
        ex.value("tailgate_queue_dropped_total", &[("queue", "log")]),
        0.0
    );
}

#[tokio::test]
async fn openmetrics_when_asked_and_gzip_when_allowed() {
    let up = ok_upstream().await;
    let gw = two_tenants(up, "");
    assert_eq!(send(gw.addr, "GET", "/api/", "acme.test", "").await, 200);
    let admin = admin_addr(&gw);

    let r = admin_get(
        admin,
        "/metrics",
        &[(
            "accept",
            "application/openmetrics-text; version=1.0.0,text/plain;q=0.5",
        )],
    )
    .await;
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/openmetrics-text")
    );
    let text = std::str::from_utf8(r.body()).unwrap();
    assert!(text.ends_with("# EOF\n"));
    assert!(text.contains("# TYPE tailgate_requests counter\n"));
    let ex = prom::parse(text, true).unwrap_or_else(|e| panic!("bad OpenMetrics: {e}"));
    assert_eq!(
        ex.value(
            "tailgate_requests_total",
            &[("route", "acme-api"), ("status_class", "2xx")]
        ),
        1.0
    );

    assert_eq!(
        ex.value(
            "tailgate_response_body_bytes_total",
            &[("route", "acme-api")]
        ),
        2.0,
        "the upstream's \"ok\""
    );

    // Repeated `Accept` lines are one list: the second one's OpenMetrics wins over the
    // first one's plain text at a lower weight.
    let r = admin_get(
        admin,
        "/metrics",
        &[
            ("accept", "text/plain;q=0.1"),
            ("accept", "application/openmetrics-text;version=1.0.0"),
        ],
    )
    .await;
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/openmetrics-text"),
        "{:?}",
        r.headers()
    );

    let r = admin_get(admin, "/metrics", &[("accept-encoding", "gzip")]).await;
    assert_eq!(r.headers()["content-encoding"], "gzip");
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain; version=0.0.4")
    );
    let text = std::str::from_utf8(r.body()).unwrap();
    assert!(prom::parse(text, false).is_ok());
    assert!(text.contains("tailgate_requests_total{tenant=\"acme\",route=\"acme-api\""));
}

/// One request to `/api/` on `acme.test` from each of `n` consumers (`x-consumer`), over 8
/// connections.
async fn requests_from_consumers(addr: SocketAddr, n: usize) {
    let mut tasks = Vec::new();
    for t in 0..8 {
        tasks.push(tokio::spawn(async move {
            let mut c = h1_client(addr).await;
            for i in (t..n).step_by(8) {
                let req = http::Request::get("/api/")
                    .header("host", "acme.test")
                    .header("x-consumer", format!("consumer-{i}\"q\""))
                    .body(full(""))
                    .unwrap();
                let resp = c.send_request(req).await.unwrap();
                assert_eq!(resp.status(), 200);
                let _ = resp.into_body().collect().await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

#[tokio::test]
async fn consumer_series_reach_100k_without_errors() {
    let up = ok_upstream().await;
    let gw = two_tenants(
        up,
        "[metrics]\nconsumer_header = \"x-consumer\"\nmax_consumers = 200000\n",
    );
    // Each consumer has 1 request-count series, 1 bytes series and a 19-sample histogram.
    const CONSUMERS: usize = 4800;
    requests_from_consumers(gw.addr, CONSUMERS).await;
    let ex = scrape(admin_addr(&gw)).await;
    assert!(
        ex.samples.len() >= 100_000,
        "only {} samples",
        ex.samples.len()
    );
    assert_eq!(
        ex.value("tailgate_metrics_consumers", &[]),
        CONSUMERS as f64
    );
    assert_eq!(
        ex.value("tailgate_metrics_consumers_overflow_total", &[]),
        0.0
    );
    // Label values are escaped and read back intact.
    assert_eq!(
        ex.value(
            "tailgate_consumer_requests_total",
            &[("consumer", "consumer-17\"q\""), ("status_class", "2xx")]
        ),
        1.0
    );
    assert_eq!(
        ex.find("tailgate_consumer_request_duration_seconds_count", &[])
            .len(),
        CONSUMERS
    );
    // A scraper that asks and never reads (the output is far larger than the socket
    // buffers) does not hold up the next scrape, which reads the same series: the merge is
    // incremental and nothing is lost.
    let mut stuck = tokio::net::TcpStream::connect(admin_addr(&gw))
        .await
        .unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut stuck, b"GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let again = tokio::time::timeout(Duration::from_secs(20), scrape(admin_addr(&gw)))
        .await
        .expect("a scrape behind a stuck one completes");
    assert!(again.samples.len() >= ex.samples.len());
    drop(stuck);
}

#[tokio::test]
async fn consumers_past_the_limit_count_as_other() {
    let up = ok_upstream().await;
    let gw = two_tenants(
        up,
        "[metrics]\nconsumer_header = \"x-consumer\"\nmax_consumers = 3\n",
    );
    for i in 0..5 {
        let mut c = h1_client(gw.addr).await;
        let req = http::Request::get("/api/")
            .header("host", "acme.test")
            .header("x-consumer", format!("c{i}"))
            .body(full(""))
            .unwrap();
        assert_eq!(c.send_request(req).await.unwrap().status(), 200);
    }
    // A client naming itself `_other` is counted with the overflow, not as a consumer.
    let mut c = h1_client(gw.addr).await;
    let req = http::Request::get("/api/")
        .header("host", "acme.test")
        .header("x-consumer", "_other")
        .body(full(""))
        .unwrap();
    assert_eq!(c.send_request(req).await.unwrap().status(), 200);
    let ex = scrape(admin_addr(&gw)).await;
    assert_eq!(ex.value("tailgate_metrics_consumers", &[]), 3.0);
    assert_eq!(
        ex.value("tailgate_metrics_consumers_overflow_total", &[]),
        2.0
    );
    assert!(
        ex.find("tailgate_consumer_requests_total", &[("consumer", "c4")])
            .is_empty()
    );
    assert_eq!(
        ex.value(
            "tailgate_consumer_requests_total",
            &[("consumer", "_other"), ("status_class", "2xx")]
        ),
        3.0
    );
    assert_eq!(
        ex.value(
            "tailgate_consumer_request_duration_seconds_count",
            &[("consumer", "_other")]
        ),
        3.0
    );
}

/// An empty consumer header names no consumer: no series with `consumer=""` (which
/// Prometheus reads as no label) and no place in the table.
#[tokio::test]
async fn an_empty_consumer_header_is_no_consumer() {
    let up = ok_upstream().await;
    let gw = two_tenants(up, "[metrics]\nconsumer_header = \"x-consumer\"\n");
    for name in ["", "c0"] {
        let mut c = h1_client(gw.addr).await;
        let req = http::Request::get("/api/")
            .header("host", "acme.test")
            .header("x-consumer", name)
            .body(full(""))
            .unwrap();
        assert_eq!(c.send_request(req).await.unwrap().status(), 200);
    }
    let ex = scrape(admin_addr(&gw)).await;
    assert_eq!(ex.value("tailgate_metrics_consumers", &[]), 1.0);
    assert!(
        ex.find("tailgate_consumer_requests_total", &[("consumer", "")])
            .is_empty()
    );
    assert_eq!(
        ex.value(
            "tailgate_consumer_requests_total",
            &[("consumer", "c0"), ("status_class", "2xx")]
        ),
        1.0
    );
}

/// Blocks worker `i`'s thread for `d`; returns once the block has begun.
fn stall_worker(gw: &TestGateway, i: usize, d: Duration) -> Instant {
    occupy_worker(gw, i, d, false)
}

/// Occupies worker `i`'s thread for `d`, sleeping (a stuck worker) or spinning on the CPU
/// (a saturated one); returns once it has begun.
fn occupy_worker(gw: &TestGateway, i: usize, d: Duration, spin: bool) -> Instant {
    let (tx, rx) = std::sync::mpsc::channel();
    gw.gw
        .as_ref()
        .unwrap()
        .worker_handle(i)
        .unwrap()
        .spawn(async move {
            let start = Instant::now();
            let _ = tx.send(start);
            // Deliberately never yields to the worker's runtime.
            if spin {
                while start.elapsed() < d {
                    std::hint::spin_loop();
                }
            } else {
                std::thread::sleep(d);
            }
        });
    rx.recv().unwrap()
}

#[tokio::test]
async fn scrapes_and_health_answer_while_every_worker_is_saturated() {
    let up = ok_upstream().await;
    let gw = TestGateway::start(&format!(
        "[server]\nworkers = 2\n{ADMIN}[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
    ));
    let admin = admin_addr(&gw);
    // Healthy first: both workers have run their lag probe (a just-started worker has not,
    // and a loaded machine can delay it past the threshold for a moment).
    let deadline = Instant::now() + Duration::from_secs(10);
    while admin_get(admin, "/healthz", &[]).await.status() != 200 {
        assert!(Instant::now() < deadline, "never healthy before the test");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Both workers spin on the CPU: on this 2-core machine, every core is busy.
    // Long enough that the admin answers arrive within it even on a loaded machine.
    const SPIN: Duration = Duration::from_secs(6);
    let started = occupy_worker(&gw, 0, SPIN, true);
    occupy_worker(&gw, 1, SPIN, true);
    // Give the stall time to exceed the 300 ms threshold.
    tokio::time::sleep(Duration::from_millis(600)).await;

    let health = admin_get(admin, "/healthz", &[]).await;
    let metrics = admin_get(admin, "/metrics", &[]).await;
    let answered_during_stall = started.elapsed() < SPIN;
    assert_eq!(health.status(), 503);
    let body: serde_json::Value = serde_json::from_slice(health.body()).unwrap();
    assert_eq!(body["stalled_workers"], serde_json::json!([0, 1]));
    assert_eq!(metrics.status(), 200);
    let ex = prom::parse(std::str::from_utf8(metrics.body()).unwrap(), false).unwrap();
    assert!(ex.value("tailgate_runtime_last_tick_age_seconds", &[("worker", "1")]) >= 0.3);
    assert!(
        answered_during_stall,
        "the admin answers came only after the workers were free again"
    );

    // Once the workers run again, health recovers.
    let deadline = Instant::now() + Duration::from_secs(10);
    while admin_get(admin, "/healthz", &[]).await.status() != 200 {
        assert!(Instant::now() < deadline, "health never recovered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A stalled worker takes the gateway out of rotation (`/readyz` 503, naming it) while it
/// is stalled: the connections hashed to its socket would wait there. Back once it runs.
#[tokio::test]
async fn readiness_fails_while_a_worker_is_stalled() {
    let up = ok_upstream().await;
    let gw = TestGateway::start(&format!(
        "[server]\nworkers = 2\n{ADMIN}[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
    ));
    let admin = admin_addr(&gw);
    let deadline = Instant::now() + Duration::from_secs(10);
    while admin_get(admin, "/readyz", &[]).await.status() != 200 {
        assert!(Instant::now() < deadline, "never ready before the test");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    const STALL: Duration = Duration::from_secs(4);
    let started = stall_worker(&gw, 1, STALL);
    let mut seen = None;
    while started.elapsed() < STALL {
        let r = admin_get(admin, "/readyz", &[]).await;
        if r.status() == 503 {
            seen = Some(serde_json::from_slice::<serde_json::Value>(r.body()).unwrap());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let body = seen.expect("ready all through the stall");
    assert_eq!(body["reason"], "workers stalled: [1]", "{body}");
    let deadline = Instant::now() + Duration::from_secs(15);
    while admin_get(admin, "/readyz", &[]).await.status() != 200 {
        assert!(Instant::now() < deadline, "never ready again");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn the_lag_probe_sees_a_blocked_worker() {
    let up = ok_upstream().await;
    let gw = TestGateway::to(up, ADMIN);
    let admin = admin_addr(&gw);
    let over = |ex: &Exposition| {
        let w = [("worker", "0")];
        ex.value("tailgate_runtime_lag_seconds_count", &w)
            - ex.value(
                "tailgate_runtime_lag_seconds_bucket",
                &[("worker", "0"), ("le", "0.25")],
            )
    };
    // Counted from here (a loaded machine may already have delayed a tick that much).
    let before = over(&scrape(admin).await);
    stall_worker(&gw, 0, Duration::from_millis(400));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let ex = scrape(admin).await;
        if over(&ex) > before {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the blocked worker's lag was never recorded"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn readiness_waits_for_warm_connections_and_ends_at_drain() {
    let up = ok_upstream().await;
    let dead = dead_port();
    // A cluster whose only endpoint is down never warms: not ready, for `warm_wait`.
    let cold = TestGateway::start(&format!(
        "[server]\nworkers = 1\nwarm_wait = \"1500ms\"\n{ADMIN}[[cluster]]\nname = \"down\"\nendpoints = [\"{dead}\"]\nmin_warm_connections = 2\n[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/down/\"\ncluster = \"down\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
    ));
    let started = Instant::now();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = admin_get(admin_addr(&cold), "/readyz", &[]).await;
    assert_eq!(r.status(), 503);
    assert!(
        std::str::from_utf8(r.body())
            .unwrap()
            .contains("cluster `down` has no warm connections")
    );
    // Past `warm_wait`, the dead upstream no longer keeps the other cluster's routes out of
    // rotation: ready, with the cold cluster named.
    let deadline = Instant::now() + Duration::from_secs(10);
    let r = loop {
        let r = admin_get(admin_addr(&cold), "/readyz", &[]).await;
        if r.status() == 200 {
            break r;
        }
        assert!(Instant::now() < deadline, "never ready past warm_wait");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // Not before `warm_wait` (measured from a little after the gateway's own start).
    assert!(started.elapsed() >= Duration::from_millis(1000));
    let v: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
    assert_eq!(v["status"], "ready");
    assert_eq!(v["cold_clusters"], serde_json::json!(["down"]));
    let r = admin_get(admin_addr(&cold), "/stats", &[]).await;
    let v: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
    assert_eq!(v["ready"], true);
    assert_eq!(v["cold_clusters"], serde_json::json!(["down"]));
    assert_eq!(send(cold.addr, "GET", "/a", "x", "").await, 200);

    // The same with a live endpoint and warm spares: ready once they are open.
    let gw = TestGateway::start(&format!(
        "{ADMIN}[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\nmin_warm_connections = 2\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
    ));
    let admin = admin_addr(&gw);
    let deadline = Instant::now() + Duration::from_secs(10);
    while admin_get(admin, "/readyz", &[]).await.status() != 200 {
        assert!(Instant::now() < deadline, "never ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Draining: a request in flight keeps the gateway alive; readiness is gone.
    let slow = upstream(|_req| async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        http::Response::new(full("late"))
    })
    .await;
    let gw2 = TestGateway::start(&format!(
        "{ADMIN}[[cluster]]\nname = \"slow\"\nendpoints = [\"{slow}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"slow\"\n"
    ));
    let admin2 = admin_addr(&gw2);
    let addr2 = gw2.addr;
    let in_flight = tokio::spawn(async move { get(addr2, "/").await.status() });
    tokio::time::sleep(Duration::from_millis(300)).await;
    gw2.gw.as_ref().unwrap().shutdown();
    let r = admin_get(admin2, "/readyz", &[]).await;
    assert_eq!(r.status(), 503);
    assert!(std::str::from_utf8(r.body()).unwrap().contains("draining"));
    assert_eq!(in_flight.await.unwrap(), 200);
}

#[tokio::test]
async fn stats_and_unknown_paths() {
    let up = ok_upstream().await;
    let gw = two_tenants(up, "");
    assert_eq!(send(gw.addr, "GET", "/api/", "acme.test", "").await, 200);
    let admin = admin_addr(&gw);
    let r = admin_get(admin, "/stats", &[]).await;
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
    assert_eq!(v["routes"][0]["name"], "acme-api");
    assert_eq!(v["routes"][0]["requests"], 1);
    assert_eq!(v["clusters"][0]["name"], "up");
    assert_eq!(v["clusters"][0]["endpoints"][0]["address"], up.to_string());
    assert_eq!(v["clusters"][0]["endpoints"][0]["h2_waits_for_connect"], 0);
    assert_eq!(v["clusters"][0]["workers"][0]["worker"], 0);
    assert_eq!(v["clusters"][0]["workers"][0]["overflows"], 0);
    assert_eq!(v["ready"], true);
    assert_eq!(admin_get(admin, "/nope", &[]).await.status(), 404);
    let mut c = h1_client(admin).await;
    let req = http::Request::post("/metrics")
        .header("host", "admin")
        .body(full(""))
        .unwrap();
    assert_eq!(c.send_request(req).await.unwrap().status(), 405);
}

/// Every admin slot held by clients idle between requests: a new connection gets the slot
/// of the one idle the longest, which is closed, and every endpoint is answered on it.
#[tokio::test]
async fn an_idle_admin_connection_gives_its_slot_to_a_new_one() {
    let up = ok_upstream().await;
    let gw = two_tenants(up, "");
    let admin = admin_addr(&gw);
    let mut held = Vec::new();
    for _ in 0..64 {
        held.push(h1_client(admin).await);
    }
    // One answer on each, in turn: the first one has been idle the longest.
    for c in &mut held {
        let req = http::Request::get("/healthz")
            .header("host", "admin")
            .body(full(""))
            .unwrap();
        let resp = c.send_request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        let _ = resp.into_body().collect().await.unwrap();
    }

    let r = admin_get(admin, "/metrics", &[]).await;
    assert_eq!(r.status(), 200, "{:?}", r.body());
    assert!(std::str::from_utf8(r.body()).unwrap().contains("tailgate_"));
    // The first one was closed for it; the others are still open.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !held[0].is_closed() {
        assert!(
            Instant::now() < deadline,
            "the idlest admin connection was never closed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let closed: Vec<usize> = (1..64).filter(|&i| held[i].is_closed()).collect();
    assert!(
        closed.is_empty(),
        "admin connections {closed:?} were closed too"
    );
}

/// Admin slots held by `/metrics` responses their clients do not read are never taken back:
/// a new connection gets the slot of an idle one, and when every slot is busy, health probes
/// are answered on a probe slot while other paths get a clear 503.
#[tokio::test]
async fn health_probes_are_answered_when_every_admin_connection_is_busy() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = ok_upstream().await;
    let gw = two_tenants(
        up,
        "[metrics]\nconsumer_header = \"x-consumer\"\nmax_consumers = 10000\n",
    );
    // About 10 MB of exposition: several times what hyper's write buffer, the render
    // channel and a loopback socket's buffers hold before a scrape stalls.
    requests_from_consumers(gw.addr, 5000).await;
    let admin = admin_addr(&gw);
    let stuck_scrape = || async {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.set_recv_buffer_size(4096).unwrap();
        let mut c = sock.connect(admin).await.unwrap();
        c.write_all(b"GET /metrics HTTP/1.1\r\nHost: admin\r\n\r\n")
            .await
            .unwrap();
        c
    };
    let mut held = Vec::new();
    for _ in 0..63 {
        held.push(stuck_scrape().await);
    }
    // The last slot: a connection idle after one answer, more recently than the busy ones
    // were opened. It is the one closed for a new connection.
    let mut idle = tokio::net::TcpStream::connect(admin).await.unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: admin\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    read_head(&mut idle, &mut got).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = admin_get(admin, "/metrics", &[]).await;
    assert_eq!(r.status(), 200, "{:?}", r.body());
    let mut buf = [0u8; 1024];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(5), idle.read(&mut buf))
            .await
            .expect("the idle admin connection is closed")
            .unwrap_or(0);
        if n == 0 {
            break;
        }
    }

    // Every slot busy: probes only.
    held.push(stuck_scrape().await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = admin_get(admin, "/healthz", &[]).await;
    assert_eq!(r.status(), 200, "{:?}", r.body());
    assert_eq!(admin_get(admin, "/readyz", &[]).await.status(), 200);
    let r = admin_get(admin, "/metrics", &[]).await;
    assert_eq!(r.status(), 503);
    assert!(
        std::str::from_utf8(r.body())
            .unwrap()
            .contains("too_many_connections"),
        "{:?}",
        r.body()
    );
    drop(held);
    // Their slots come back once they are gone.
    let deadline = Instant::now() + Duration::from_secs(10);
    while admin_get(admin, "/stats", &[]).await.status() != 200 {
        assert!(Instant::now() < deadline, "the admin slots never came back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A response cut short because the client's own body, still being sent, went over
/// `max_body_bytes` is counted as the client's error, not as the upstream's body failing.
#[tokio::test]
async fn a_response_cut_by_the_clients_body_is_the_clients_error() {
    use tokio::io::AsyncWriteExt;
    let up = echo_upstream().await;
    let gw = two_tenants(up, "[server]\nmax_body_bytes = 1000\n");
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(
        b"POST /api/echo HTTP/1.1\r\nHost: acme.test\r\nTransfer-Encoding: chunked\r\n\r\n",
    )
    .await
    .unwrap();
    let chunk = [b"100\r\n".to_vec(), vec![b'x'; 256], b"\r\n".to_vec()].concat();
    s.write_all(&chunk).await.unwrap();
    // The echo's head comes back before the body crosses the limit.
    let mut got = Vec::new();
    read_head(&mut s, &mut got).await.unwrap();
    assert!(got.starts_with(b"HTTP/1.1 200"), "{got:?}");
    for _ in 0..4 {
        if s.write_all(&chunk).await.is_err() {
            break;
        }
    }
    let (text, closed) = read_until_close(&mut s, Duration::from_secs(5)).await;
    assert!(closed, "{text}");
    // The answer is cut short, not complete.
    let all = [String::from_utf8_lossy(&got).into_owned(), text].concat();
    assert!(!all.ends_with("0\r\n\r\n"), "{all}");
    let sum = |ex: &Exposition, kind: &str| -> f64 {
        ex.find("tailgate_request_errors_total", &[("kind", kind)])
            .iter()
            .map(|s| s.value)
            .sum()
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let ex = scrape(admin_addr(&gw)).await;
        if sum(&ex, "body_too_large") + sum(&ex, "upstream_body") > 0.0 {
            assert_eq!(sum(&ex, "body_too_large"), 1.0);
            assert_eq!(sum(&ex, "upstream_body"), 0.0);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the cut exchange was never recorded"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn the_watchdog_is_fed_only_while_workers_respond() {
    use std::os::unix::net::UnixDatagram;
    let dir = tempfile::Builder::new()
        .prefix("tailgate-wd-")
        .tempdir()
        .unwrap();
    let path = dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&path).unwrap();
    sock.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();

    let up = ok_upstream().await;
    let mut gw = TestGateway::to(up, ADMIN);
    gw.gw
        .as_mut()
        .unwrap()
        .start_watchdog(
            tailgate::admin::watchdog::NotifySocket::Path(path.clone()),
            Some(Duration::from_millis(50)),
        )
        .unwrap();
    let recv_until = |until: Instant| {
        let mut got = Vec::new();
        let mut buf = [0u8; 256];
        while Instant::now() < until {
            if let Ok(n) = sock.recv(&mut buf) {
                got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
            }
        }
        got
    };
    let first = recv_until(Instant::now() + Duration::from_secs(2));
    assert_eq!(first.first().map(String::as_str), Some("READY=1"));
    assert!(first.iter().filter(|m| *m == "WATCHDOG=1").count() >= 2);

    // Stalled for 2 s; after the 300 ms threshold (with margin) no ping may come.
    let t0 = stall_worker(&gw, 0, Duration::from_secs(2));
    let _ = recv_until(t0 + Duration::from_millis(800));
    let during = recv_until(t0 + Duration::from_millis(1900));
    assert!(
        during.is_empty(),
        "the watchdog was fed while the worker was stalled: {during:?}"
    );
    let after = recv_until(t0 + Duration::from_secs(4));
    assert!(
        after.iter().any(|m| m == "WATCHDOG=1"),
        "pings never resumed"
    );
}

/// A stall that the watchdog's check happens to find costs one ping, not a whole interval:
/// the pings resume as soon as the worker is back. After a check that found a stall, the
/// next came a whole interval later, so that the next ping reached systemd about a whole
/// `WatchdogSec` after the last one (two intervals, each half of it): at its deadline, and
/// a stall of a second restarted the gateway or not by when the check fell.
#[tokio::test]
async fn the_watchdog_pings_again_as_soon_as_a_stall_ends() {
    use std::os::unix::net::UnixDatagram;
    let dir = tempfile::Builder::new()
        .prefix("tailgate-wd-")
        .tempdir()
        .unwrap();
    let path = dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&path).unwrap();
    sock.set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let up = ok_upstream().await;
    let mut gw = TestGateway::to(up, ADMIN);
    const EVERY: Duration = Duration::from_secs(4);
    gw.gw
        .as_mut()
        .unwrap()
        .start_watchdog(
            tailgate::admin::watchdog::NotifySocket::Path(path.clone()),
            Some(EVERY),
        )
        .unwrap();
    // The first ping after READY=1: when the next check falls.
    let mut buf = [0u8; 256];
    let (mut ready, deadline) = (false, Instant::now() + Duration::from_secs(10));
    let pinged_at = loop {
        assert!(Instant::now() < deadline, "no ping after READY=1");
        if let Ok(n) = sock.recv(&mut buf) {
            match &buf[..n] {
                b"READY=1" => ready = true,
                b"WATCHDOG=1" if ready => break Instant::now(),
                _ => {}
            }
        }
    };
    // Stalled from 0.7 s before the next check to 0.5 s after it (past the 300 ms
    // threshold when the check runs).
    let stall_from = pinged_at + EVERY - Duration::from_millis(700);
    std::thread::sleep(stall_from.saturating_duration_since(Instant::now()));
    let t0 = stall_worker(&gw, 0, Duration::from_millis(1200));
    let stall_end = t0 + Duration::from_millis(1200);
    // The next ping: soon after the stall ends, not a whole interval after the check
    // that found it (at `pinged_at + 2 * EVERY`); two seconds of margin either side.
    let until = stall_end + Duration::from_secs(2);
    let mut next = None;
    while Instant::now() < until {
        if let Ok(n) = sock.recv(&mut buf)
            && &buf[..n] == b"WATCHDOG=1"
        {
            next = Some(Instant::now());
            break;
        }
    }
    let next = next.unwrap_or_else(|| {
        panic!("no ping within 2 s of the stall's end (the check found it stalled)")
    });
    assert!(
        next >= stall_end - Duration::from_millis(100),
        "a ping came during the stall"
    );
}

#[tokio::test]
async fn two_workers_are_summed_and_their_consumers_merged() {
    let up = ok_upstream().await;
    let gw = TestGateway::start(&format!(
        "[server]\nworkers = 2\n{ADMIN}[metrics]\nconsumer_header = \"x-consumer\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\nname = \"all\"\npath_prefix = \"/\"\ncluster = \"up\"\n"
    ));
    // One request on each of 24 connections: the kernel spreads them over both workers.
    for _ in 0..24 {
        let mut c = h1_client(gw.addr).await;
        let req = http::Request::get("/")
            .header("host", "a")
            .header("x-consumer", "shared")
            .body(full(""))
            .unwrap();
        let resp = c.send_request(req).await.unwrap();
        let _ = resp.into_body().collect().await;
    }
    let admin = admin_addr(&gw);
    let stats: serde_json::Value =
        serde_json::from_slice(admin_get(admin, "/stats", &[]).await.body()).unwrap();
    let served: Vec<u64> = stats["clusters"][0]["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["reuses"].as_u64().unwrap() + e["connects_on_request"].as_u64().unwrap())
        .collect();
    assert_eq!(served.len(), 2, "one pool per worker");
    assert!(
        served.iter().all(|&n| n > 0),
        "both workers served: {served:?}"
    );
    let ex = scrape(admin).await;
    assert_eq!(
        ex.value(
            "tailgate_requests_total",
            &[("route", "all"), ("status_class", "2xx")]
        ),
        24.0
    );
    assert_eq!(
        ex.value("tailgate_metrics_consumers", &[]),
        1.0,
        "merged by name"
    );
    assert_eq!(
        ex.value(
            "tailgate_consumer_requests_total",
            &[("consumer", "shared"), ("status_class", "2xx")]
        ),
        24.0
    );
    assert_eq!(ex.value("tailgate_requests_in_flight", &[]), 0.0);
}

#[tokio::test]
async fn a_client_gone_mid_response_leaves_nothing_in_flight() {
    // The upstream sends a head and one chunk, then holds the body open.
    let up = upstream(|_req| async {
        let (tx, mut rx) =
            tokio::sync::mpsc::channel::<Result<http_body::Frame<Bytes>, std::io::Error>>(1);
        tokio::spawn(async move {
            let _ = tx
                .send(Ok(http_body::Frame::data(Bytes::from_static(b"first"))))
                .await;
            tokio::time::sleep(Duration::from_secs(30)).await;
            drop(tx);
        });
        let stream = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
        let body = http_body_util::StreamBody::new(stream)
            .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
            .boxed();
        http::Response::new(body)
    })
    .await;
    let gw = TestGateway::to(up, ADMIN);
    let admin = admin_addr(&gw);
    let mut c = h1_client(gw.addr).await;
    let resp = c
        .send_request(
            http::Request::get("/")
                .header("host", "a")
                .body(full(""))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let ex = scrape(admin).await;
    assert_eq!(ex.value("tailgate_requests_in_flight", &[]), 1.0);
    drop(resp);
    drop(c);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let ex = scrape(admin).await;
        // (The gauge and the error count are two atomics: a scrape may come between them.)
        let gone: Vec<f64> = ex
            .find("tailgate_request_errors_total", &[("kind", "client_gone")])
            .iter()
            .map(|s| s.value)
            .collect();
        let gone = gone == [1.0];
        if ex.value("tailgate_requests_in_flight", &[]) == 0.0 && gone {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the abandoned exchange stayed in flight, or was not counted as client_gone"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn hedge_and_dns_counters_are_exported() {
    let slow = upstream(|_req| async {
        tokio::time::sleep(Duration::from_millis(800)).await;
        http::Response::new(full("slow"))
    })
    .await;
    let fast = ok_upstream().await;
    let gw = TestGateway::start(&format!(
        "{ADMIN}[[cluster]]\nname = \"up\"\nendpoints = [\"{slow}\", \"{fast}\"]\nbalance = \"round_robin\"\nhedge_budget_percent = 100\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\nhedge_delay = \"50ms\"\n"
    ));
    for _ in 0..4 {
        assert_eq!(get(gw.addr, "/").await.status(), 200);
    }
    let g = gw.gw.as_ref().unwrap();
    let fired = g.cluster_stat(|c| c.hedges_fired.load(Ordering::Relaxed));
    let won = g.cluster_stat(|c| c.hedges_won.load(Ordering::Relaxed));
    assert!(fired >= 1);
    let ex = scrape(admin_addr(&gw)).await;
    assert_eq!(
        ex.value("tailgate_upstream_hedges_fired_total", &[("cluster", "up")]),
        fired as f64
    );
    assert_eq!(
        ex.value("tailgate_upstream_hedges_won_total", &[("cluster", "up")]),
        won as f64
    );
    assert_eq!(ex.value("tailgate_dns_lookups_total", &[]), 0.0);
    assert_eq!(ex.types["tailgate_dns_failures_total"], "counter");
    // `/stats` has them per worker.
    let r = admin_get(admin_addr(&gw), "/stats", &[]).await;
    let v: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
    let per_worker = v["clusters"][0]["workers"].as_array().unwrap();
    let sum = |k: &str| {
        per_worker
            .iter()
            .map(|w| w[k].as_u64().unwrap())
            .sum::<u64>()
    };
    assert_eq!(sum("hedges_fired"), fired);
    assert_eq!(sum("hedges_won"), won);
}

/// `max_connections_per_endpoint`'s queue is exported: requests queued, those that timed
/// out, and the connections open, in `/metrics` and `/stats`.
#[tokio::test]
async fn the_connection_queue_is_exported() {
    let HeldUpstream {
        addr: up,
        mut arrived,
        open: open_tx,
    } = held_upstream().await;
    let gw = TestGateway::start(&format!(
        "{ADMIN}[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\nmax_connections_per_endpoint = 1\nconnect_timeout = \"200ms\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
    ));
    let addr = gw.addr;
    let held = tokio::spawn(async move { get(addr, "/held").await.status() });
    arrived.recv().await.unwrap();
    // Queued behind it until the connect timeout.
    let late = get(addr, "/late").await;
    assert_eq!(late.status(), 503);
    let ex = scrape(admin_addr(&gw)).await;
    let ep = up.to_string();
    let labels = [("cluster", "up"), ("endpoint", ep.as_str())];
    assert_eq!(ex.value("tailgate_upstream_queued_total", &labels), 1.0);
    assert_eq!(
        ex.value("tailgate_upstream_queue_timeouts_total", &labels),
        1.0
    );
    assert_eq!(ex.value("tailgate_upstream_connections_open", &labels), 1.0);
    assert_eq!(ex.types["tailgate_upstream_connections_open"], "gauge");
    assert_eq!(
        ex.value(
            "tailgate_request_errors_total",
            &[("kind", "upstream_queue_timeout")]
        ),
        1.0
    );
    let stats: serde_json::Value =
        serde_json::from_slice(admin_get(admin_addr(&gw), "/stats", &[]).await.body()).unwrap();
    let e = &stats["clusters"][0]["endpoints"][0];
    assert_eq!(e["queued"], 1, "{stats}");
    assert_eq!(e["queue_timeouts"], 1, "{stats}");
    assert_eq!(e["connections_open"], 1, "{stats}");
    open_tx.send(true).unwrap();
    assert_eq!(held.await.unwrap(), 200);
}

#[tokio::test]
async fn tls_handshakes_to_upstreams_are_exported() {
    use common::tls::{Pki, ServerOpts, https_gateway, tls_ok_upstream};
    let pki = Pki::new();
    let (up, _seen) = tls_ok_upstream(&pki, ServerOpts::default()).await;
    // `[admin]` after the cluster's own fields ends the cluster table.
    let gw = https_gateway(
        &pki,
        up,
        "max_requests_per_connection = 1\n[admin]\naddress = \"127.0.0.1:0\"\n",
    );
    for _ in 0..3 {
        assert_eq!(get(gw.addr, "/").await.status(), 200);
    }
    let ex = scrape(admin_addr(&gw)).await;
    let ep = up.to_string();
    let tls = |kind: &str| {
        ex.value(
            "tailgate_upstream_tls_handshakes_total",
            &[("cluster", "up"), ("endpoint", &ep), ("kind", kind)],
        )
    };
    assert_eq!(tls("full"), 1.0);
    // Each connection carries one request, and its successor is opened as it is retired
    // (one may still be under way, and a request may have opened its own meanwhile).
    assert!((2.0..=5.0).contains(&tls("resumed")), "{}", tls("resumed"));
    assert_eq!(tls("failed"), 0.0);
    assert_eq!(
        ex.value(
            "tailgate_upstream_connections_retired_total",
            &[("endpoint", &ep), ("reason", "max_requests")]
        ),
        3.0
    );
}

#[tokio::test]
async fn a_route_without_a_tenant_counts_each_tenant_apart() {
    let up = ok_upstream().await;
    let gw = TestGateway::start(&format!(
        "{ADMIN}[[tenant]]\nname = \"acme\"\nhosts = [\"acme.test\"]\n[[tenant]]\nname = \"beta\"\nhosts = [\"*.beta.test\"]\n[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\nname = \"shared\"\npath_prefix = \"/\"\ncluster = \"up\"\n"
    ));
    for (host, n) in [("acme.test", 2), ("api.beta.test", 3), ("nobody.test", 1)] {
        for _ in 0..n {
            assert_eq!(send(gw.addr, "GET", "/x", host, "").await, 200);
        }
    }
    let ex = scrape(admin_addr(&gw)).await;
    let count = |tenant: &str| {
        ex.value(
            "tailgate_requests_total",
            &[
                ("tenant", tenant),
                ("route", "shared"),
                ("status_class", "2xx"),
            ],
        )
    };
    assert_eq!(count("acme"), 2.0);
    assert_eq!(count("beta"), 3.0);
    assert_eq!(count(""), 1.0);
    let stats: serde_json::Value =
        serde_json::from_slice(admin_get(admin_addr(&gw), "/stats", &[]).await.body()).unwrap();
    assert_eq!(stats["routes"][0]["requests"], 6);
}

/// A head refused before it could be routed counts like any request: under no tenant and
/// no route, method `OTHER`, its error kind; from either HTTP/1 server (the inline one, or
/// hyper's behind the smuggling guard after a chunked request).
#[tokio::test]
async fn refused_heads_are_counted() {
    let up = echo_upstream().await;
    let gw = two_tenants(up, "[server]\nworkers = 1\nmax_header_bytes = 1024\n");
    let chunked: &[u8] =
        b"POST /h HTTP/1.1\r\nHost: nowhere.test\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
    // The JSON bodies of every answer (refusals, and the chunked request's 404).
    let mut body_bytes = 0usize;
    for prefix in [&b""[..], chunked] {
        for bytes in [
            &b"GET / HTTP/1.1\r\nHost: acme.test\r\nX-Bad: a\x01b\r\n\r\n"[..],
            b"POST / HTTP/1.1\r\nHost: acme.test\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
            &[&b"GET / HTTP/1.1\r\nX-Big: "[..], &[b'a'; 2000], b"\r\n\r\n"].concat(),
        ] {
            let (text, closed) = raw(gw.addr, &[prefix, bytes].concat(), Duration::from_secs(5)).await;
            assert!(closed, "{text}");
            body_bytes += text
                .split("HTTP/1.1 ")
                .filter_map(|r| r.split_once("\r\n\r\n"))
                .map(|(_, body)| body.len())
                .sum::<usize>();
            let last = &text[text.rfind("HTTP/1.1 ").unwrap()..];
            assert!(last.starts_with("HTTP/1.1 4") && last.contains("\"request_id\""), "{text}");
        }
    }
    let ex = scrape(admin_addr(&gw)).await;
    let none = |kind: &str| {
        ex.value(
            "tailgate_request_errors_total",
            &[("tenant", ""), ("route", ""), ("kind", kind)],
        )
    };
    assert_eq!(none("bad_request"), 4.0);
    // Error bodies count as body bytes out, refusals' and the pipeline's alike.
    assert_eq!(
        ex.value(
            "tailgate_response_body_bytes_total",
            &[("tenant", ""), ("route", "")]
        ),
        body_bytes as f64
    );
    assert_eq!(none("header_too_large"), 2.0);
    assert_eq!(
        ex.value(
            "tailgate_requests_total",
            &[
                ("tenant", ""),
                ("route", ""),
                ("method", "OTHER"),
                ("status_class", "4xx")
            ]
        ),
        6.0
    );
}

/// A connection taken from the idle list has a connect stage of zero; a request that first
/// paid for a failed connect to another endpoint has that time in its connect stage, even
/// when the connection it then got was an idle one.
#[tokio::test]
async fn the_connect_stage_is_zero_for_an_idle_connection_unless_a_connect_failed_first() {
    let live = ok_upstream().await;
    let held = dead_port();
    let dead = held.addr();
    for (endpoints, zero) in [
        (format!("\"{live}\""), true),
        (format!("\"{live}\", \"{dead}\""), false),
    ] {
        let gw = TestGateway::start(&format!(
            "{ADMIN}[[cluster]]\nname = \"up\"\nendpoints = [{endpoints}]\nbalance = \"round_robin\"\nmin_warm_connections = 1\neject_after_failures = 0\nretry_budget_percent = 100\n[[route]]\nname = \"r\"\npath_prefix = \"/\"\ncluster = \"up\"\n"
        ));
        let g = gw.gw.as_ref().unwrap();
        let warm = || g.pool_stat(|s| s.preconnects.load(Ordering::Relaxed)) >= 1;
        wait_for("a warm connection", warm).await;
        for _ in 0..6 {
            assert_eq!(get(gw.addr, "/").await.status(), 200);
        }
        let retries = g.pool_stat(|s| s.retries.load(Ordering::Relaxed));
        let reuses = g.pool_stat(|s| s.reuses.load(Ordering::Relaxed));
        // Each request was answered on an idle connection (the dead endpoint's dials failed).
        assert_eq!(reuses, 6, "every request found an idle connection");
        assert_eq!(retries > 0, !zero, "retries: {retries}");
        let ex = scrape(admin_addr(&gw)).await;
        let sum = ex.value(
            "tailgate_request_stage_duration_seconds_sum",
            &[
                ("tenant", ""),
                ("route", "r"),
                ("stage", "upstream_connect"),
            ],
        );
        if zero {
            assert_eq!(sum, 0.0, "reused connections only");
        } else {
            assert!(sum > 0.0, "the failed connects' time: {sum}");
        }
    }
}

/// `server.max_connections`: at the cap the gateway stops accepting, so a new connection
/// waits in the listen queue (its request unanswered) while the open ones are busy, until
/// one closes; the open count, the accepts and the pause are exported.
#[tokio::test]
async fn at_max_connections_new_connections_wait_until_one_closes() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    async fn ask(c: &mut tokio::net::TcpStream, path: &str) {
        c.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
    }
    async fn answered(c: &mut tokio::net::TcpStream) -> String {
        let mut buf = [0u8; 512];
        let n = c.read(&mut buf).await.unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }
    // `/hold` is answered only after a minute: its connection is busy, not idle.
    let held = Arc::new(AtomicUsize::new(0));
    let h = held.clone();
    let up = upstream(move |req: http::Request<hyper::body::Incoming>| {
        let hold = req.uri().path() == "/hold";
        if hold {
            h.fetch_add(1, Ordering::SeqCst);
        }
        async move {
            if hold {
                tokio::time::sleep(Duration::from_secs(60)).await;
            }
            http::Response::new(full("ok"))
        }
    })
    .await;
    let gw = TestGateway::to(
        up,
        &format!("[server]\nworkers = 2\nmax_connections = 2\n{ADMIN}"),
    );
    let admin = admin_addr(&gw);
    let mut open = Vec::new();
    for _ in 0..2 {
        let mut c = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
        ask(&mut c, "/hold").await;
        open.push(c);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while held.load(Ordering::SeqCst) < 2 {
        assert!(
            Instant::now() < deadline,
            "the held requests never reached the upstream"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The kernel completes the handshake (listen queue), but no worker accepts it.
    let mut third = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    ask(&mut third, "/").await;
    let early = tokio::time::timeout(Duration::from_millis(400), answered(&mut third)).await;
    assert!(early.is_err(), "answered past the cap: {early:?}");
    let ex = scrape(admin).await;
    assert_eq!(ex.value("tailgate_downstream_connections", &[]), 2.0);
    assert_eq!(
        ex.value("tailgate_downstream_connections_accepted_total", &[]),
        2.0
    );
    assert!(ex.value("tailgate_downstream_accept_pauses_total", &[]) >= 1.0);
    // Busy connections are not asked to make room.
    assert_eq!(
        ex.value("tailgate_downstream_connections_reclaimed_total", &[]),
        0.0
    );

    drop(open.pop());
    let late = tokio::time::timeout(Duration::from_secs(5), answered(&mut third))
        .await
        .expect("the queued connection is served once one closes");
    assert!(late.starts_with("HTTP/1.1 200"), "{late}");
    let ex = scrape(admin).await;
    assert_eq!(
        ex.value("tailgate_downstream_connections_accepted_total", &[]),
        3.0
    );
    assert_eq!(ex.value("tailgate_downstream_connections", &[]), 2.0);
}

/// At `server.max_connections`, a connection part-way through its HTTP/2 preface is not
/// silent: the silent one beside them makes room, and they are spared.
#[tokio::test]
async fn at_max_connections_a_preface_under_way_is_spared() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = ok_upstream().await;
    let gw = TestGateway::to(
        up,
        "[server]\nworkers = 1\nmax_connections = 4\nidle_timeout = \"60s\"\n",
    );
    let mut begun = Vec::new();
    for _ in 0..3 {
        let mut c = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
        c.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
        begun.push(c);
    }
    let silent = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    // Accepted (the one worker takes its queue in order) before the next comes.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut next = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    next.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let (text, closed) = read_until_close(&mut next, Duration::from_secs(10)).await;
    assert!(closed && text.starts_with("HTTP/1.1 200"), "{text:?}");
    let closed = |mut s: tokio::net::TcpStream| async move {
        let mut buf = [0u8; 64];
        matches!(
            tokio::time::timeout(Duration::from_millis(500), s.read(&mut buf)).await,
            Ok(Ok(0) | Err(_))
        )
    };
    assert!(closed(silent).await, "the silent one made room");
    for c in begun {
        assert!(
            !closed(c).await,
            "one part-way through its preface is spared"
        );
    }
}

/// At `server.max_connections`, connections doing nothing make room: idle keep-alive ones
/// (between requests) and silent ones (nothing sent since their accept) are closed, so a
/// client holding the cap's worth of them keeps no one else out for its idle timeout.
#[tokio::test]
async fn at_max_connections_idle_and_silent_connections_make_room() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = ok_upstream().await;
    let gw = TestGateway::to(
        up,
        &format!("[server]\nworkers = 2\nmax_connections = 2\nidle_timeout = \"60s\"\n{ADMIN}"),
    );
    let admin = admin_addr(&gw);
    let mut reclaimed_before = 0.0;
    // Idle after a request, silent since the accept, and HTTP/2 (by prior knowledge) with
    // its preface sent and nothing answered after it, the close's PING included.
    for (idle, h2) in [(true, false), (false, false), (false, true)] {
        let mut open = Vec::new();
        for _ in 0..2 {
            let mut c = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
            if h2 {
                c.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
                    .await
                    .unwrap();
            }
            if idle {
                c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                    .await
                    .unwrap();
                let mut buf = [0u8; 512];
                let n = c.read(&mut buf).await.unwrap();
                assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
            }
            open.push(c);
        }
        // Both are accepted (and counted) before the next comes.
        let deadline = Instant::now() + Duration::from_secs(10);
        while scrape(admin)
            .await
            .value("tailgate_downstream_connections", &[])
            < 2.0
        {
            assert!(Instant::now() < deadline, "the two were never accepted");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut next = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
        next.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        // Far sooner than the idle timeout (a minute).
        let (text, closed) = read_until_close(&mut next, Duration::from_secs(10)).await;
        assert!(
            closed && text.starts_with("HTTP/1.1 200"),
            "idle={idle} h2={h2}: {text:?}"
        );
        // The one that made room was closed by the gateway (a call asks for an eighth of
        // those open, one at least: one here).
        let mut closed = 0;
        for mut c in open {
            let mut buf = [0u8; 512];
            // (Over HTTP/2, the server's frames come first: its SETTINGS, the close's
            // GOAWAY and PING.)
            let end = tokio::time::Instant::now() + Duration::from_secs(3);
            while let Ok(n) = tokio::time::timeout_at(end, c.read(&mut buf)).await {
                let n = n.unwrap_or(0);
                assert!(h2 || n == 0, "idle={idle}: {n} bytes");
                if n == 0 {
                    closed += 1;
                    break;
                }
            }
        }
        assert!(closed >= 1, "idle={idle} h2={h2}: none made room");
        let reclaimed = scrape(admin)
            .await
            .value("tailgate_downstream_connections_reclaimed_total", &[]);
        assert!(
            reclaimed >= reclaimed_before + 1.0,
            "idle={idle}: {reclaimed}"
        );
        reclaimed_before = reclaimed;
    }
}

/// A connection that has just been answered is not closed to make room: its client may be
/// about to send its next request. It is once it has been idle for a second. (A lower
/// bound only: a slow host makes the close later, never sooner.)
#[tokio::test]
async fn at_max_connections_a_connection_just_answered_is_not_taken() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = ok_upstream().await;
    let gw = TestGateway::to(
        up,
        &format!("[server]\nworkers = 1\nmax_connections = 1\nidle_timeout = \"60s\"\n{ADMIN}"),
    );
    let mut first = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    first
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 512];
    let n = first.read(&mut buf).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
    let answered = Instant::now();
    let mut next = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    next.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    // Still open 700 ms after its answer, with another client waiting at the cap.
    let early = tokio::time::timeout(Duration::from_millis(700), first.read(&mut buf)).await;
    assert!(
        early.is_err(),
        "closed {:?} after its answer",
        answered.elapsed()
    );
    let (text, closed) = read_until_close(&mut next, Duration::from_secs(10)).await;
    assert!(closed && text.starts_with("HTTP/1.1 200"), "{text:?}");
    assert!(answered.elapsed() >= Duration::from_secs(1));
    let n = tokio::time::timeout(Duration::from_secs(5), first.read(&mut buf))
        .await
        .expect("closed once idle for a second")
        .unwrap_or(0);
    assert_eq!(n, 0);
}

/// Open connections per tenant, for connections whose listener names their tenant; a
/// connection on a listener without one counts in the total only.
#[tokio::test]
async fn open_connections_are_exported_per_tenant() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = ok_upstream().await;
    let gw = TestGateway::start(&format!(
        "{ADMIN}[[listener]]\nname = \"acme\"\naddress = \"127.0.0.1:0\"\ntenant = \"acme\"\n[[listener]]\nname = \"any\"\naddress = \"127.0.0.1:0\"\n[[tenant]]\nname = \"acme\"\nhosts = [\"acme.test\"]\n[[tenant]]\nname = \"globex\"\nhosts = [\"globex.test\"]\n[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
    ));
    let g = gw.gw.as_ref().unwrap();
    let (acme, any) = (
        g.listener_addr("acme").unwrap(),
        g.listener_addr("any").unwrap(),
    );
    let admin = admin_addr(&gw);
    let mut open = Vec::new();
    for (addr, host) in [
        (acme, "acme.test"),
        (acme, "acme.test"),
        (any, "globex.test"),
    ] {
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut buf = [0u8; 512];
        let n = c.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        open.push(c);
    }
    let ex = scrape(admin).await;
    assert_eq!(ex.value("tailgate_downstream_connections", &[]), 3.0);
    assert_eq!(
        ex.value("tailgate_tenant_connections", &[("tenant", "acme")]),
        2.0
    );
    assert_eq!(
        ex.value("tailgate_tenant_connections", &[("tenant", "globex")]),
        0.0
    );
    drop(open);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let ex = scrape(admin).await;
        if ex.value("tailgate_tenant_connections", &[("tenant", "acme")]) == 0.0
            && ex.value("tailgate_downstream_connections", &[]) == 0.0
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "closed connections still counted"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Request errors of `kind` counted, in all (no series: none).
fn errors_of(ex: &Exposition, kind: &str) -> f64 {
    ex.find("tailgate_request_errors_total", &[("kind", kind)])
        .iter()
        .map(|s| s.value)
        .sum()
}

/// Waits until `kind` has been counted once among the request errors (nothing left in
/// flight), and returns the exposition then.
async fn errors_once(admin: SocketAddr, kind: &str) -> Exposition {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let ex = scrape(admin).await;
        if ex.value("tailgate_requests_in_flight", &[]) == 0.0 && errors_of(&ex, kind) >= 1.0 {
            return ex;
        }
        assert!(
            Instant::now() < deadline,
            "no `{kind}` error was counted: {:?}",
            ex.find("tailgate_request_errors_total", &[])
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An upstream whose answer is 4 MiB, more than any client's windows and buffers hold.
async fn big_upstream() -> SocketAddr {
    upstream(|_| async { http::Response::new(full(vec![b'x'; 4 << 20])) }).await
}

/// Asks `addr` over HTTP/2 for the 4 MiB answer and never reads its body (hyper's client
/// opens 2 MiB of window per stream, half of it); what must stay alive meanwhile.
async fn h2_big_unread(addr: SocketAddr) -> impl Sized {
    let (mut c, conn) = h2c_client(addr).await;
    let resp = c
        .send_request(http::Request::get("http://a/big").body(full("")).unwrap())
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    (c, conn, resp)
}

/// An HTTP/1.1 client that stops reading is cut off by the send timeout, and its exchange
/// is counted as `send_timeout`: the gateway ended it, the client did not go away.
#[tokio::test]
async fn a_client_cut_off_for_not_reading_is_a_send_timeout_not_client_gone() {
    let up = big_upstream().await;
    let gw = TestGateway::to(
        up,
        &format!("{ADMIN}[server]\nworkers = 1\nidle_timeout = \"400ms\"\n"),
    );
    let admin = admin_addr(&gw);
    // A small receive buffer, so that the 4 MiB cannot all wait in the sockets' buffers.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut s = socket.connect(gw.addr).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut s, b"GET /big HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    // Never read.
    let ex = errors_once(admin, "send_timeout").await;
    assert_eq!(errors_of(&ex, "client_gone"), 0.0);
    drop(s);
}

/// The same over HTTP/2, where the client's shut flow-control window, not a blocked write,
/// shows the stall: the stream (or the connection) is ended as a `send_timeout`.
#[tokio::test]
async fn an_h2_client_cut_off_for_not_reading_is_a_send_timeout() {
    let up = big_upstream().await;
    let gw = TestGateway::to(
        up,
        &format!("{ADMIN}[server]\nworkers = 1\nidle_timeout = \"400ms\"\n"),
    );
    let admin = admin_addr(&gw);
    let _unread = h2_big_unread(gw.addr).await;
    let ex = errors_once(admin, "send_timeout").await;
    assert_eq!(errors_of(&ex, "client_gone"), 0.0);
}

/// An answer whose end still waits in hyper's write buffer when the gateway is asked to
/// stop reaches its client whole. hyper's HTTP/1.1 server ends an exchange once it holds
/// the whole body, and its connection is idle to it from then on: its graceful close, asked
/// for at once, must write out what its buffer holds (up to some hundreds of KiB) before it
/// shuts the socket, and the drain must not drop the connection meanwhile (its write is
/// blocked on the client).
#[tokio::test]
async fn an_answer_still_in_hypers_write_buffer_is_not_cut_by_a_shutdown() {
    const BODY: usize = 4 << 20;
    let up = upstream(|req| async {
        let _ = req.into_body().collect().await;
        http::Response::new(full(vec![b'x'; BODY]))
    })
    .await;
    let mut gw = TestGateway::to(
        up,
        &format!("{ADMIN}[server]\nworkers = 1\nshutdown_grace = \"20s\"\n"),
    );
    let admin = admin_addr(&gw);
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(64 * 1024).unwrap();
    let mut s = socket.connect(gw.addr).await.unwrap();
    // A chunked body: served by hyper's server, not the inline one.
    tokio::io::AsyncWriteExt::write_all(
        &mut s,
        b"POST /big HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    )
    .await
    .unwrap();
    // Read slowly until the exchange has ended (hyper has taken the whole body), then stop
    // reading: its last part is in hyper's buffer, its write blocked.
    let mut got = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let ex = scrape(admin).await;
        if ex.value("tailgate_requests_in_flight", &[]) == 0.0
            && ex
                .find("tailgate_requests_total", &[])
                .iter()
                .map(|s| s.value)
                .sum::<f64>()
                >= 1.0
        {
            break;
        }
        assert!(Instant::now() < deadline, "the exchange did not end");
        let n = tokio::io::AsyncReadExt::read(&mut s, &mut buf)
            .await
            .unwrap();
        got.extend_from_slice(&buf[..n]);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let read_before = got.len();
    let gw = gw.gw.take().unwrap();
    let stopping = std::thread::spawn(move || {
        gw.shutdown();
        gw.join();
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (rest, ended) = loop {
        match tokio::time::timeout(Duration::from_secs(10), async {
            tokio::io::AsyncReadExt::read(&mut s, &mut buf).await
        })
        .await
        {
            Ok(Ok(0)) => break (got.len() - read_before, "end of stream".to_owned()),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Ok(Err(e)) => break (got.len() - read_before, format!("{e}")),
            Err(_) => break (got.len() - read_before, "no end of stream".to_owned()),
        }
    };
    stopping.join().unwrap();
    let head_end = got
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(0, |p| p + 4);
    assert_eq!(
        (got.len() - head_end, ended.as_str()),
        (BODY, "end of stream"),
        "{read_before} bytes read before the shutdown, {rest} after"
    );
}

/// An HTTP/2 stream whose client keeps its window shut is reset on its own after the idle
/// timeout; another stream of the same connection, waiting on a slow upstream meanwhile
/// (nothing was sent to it, so it took nothing), is answered. The connection's own check
/// for a client that takes nothing fell due at the same moment as the stream's (both
/// counted from the same piece), and when it ran first it dropped the connection and the
/// waiting stream with it (in 1 of 6 runs here); it now falls due a second later, by
/// when the stream's reset has taken its piece off the count.
#[tokio::test]
async fn an_h2_stream_left_unread_does_not_take_the_other_streams_down() {
    let up = upstream(|req| async move {
        if req.uri().path() == "/slow" {
            tokio::time::sleep(Duration::from_millis(900)).await;
            http::Response::new(full("slow answer"))
        } else {
            http::Response::new(full(vec![b'x'; 4 << 20]))
        }
    })
    .await;
    let gw = TestGateway::to(
        up,
        &format!("{ADMIN}[server]\nworkers = 1\nidle_timeout = \"400ms\"\n"),
    );
    let admin = admin_addr(&gw);
    let (mut c, _conn) = h2c_client(gw.addr).await;
    // Its body is never read: the stream's window (2 MiB) shuts, the connection's (5 MiB)
    // stays open.
    let _unread = c
        .send_request(http::Request::get("http://a/big").body(full("")).unwrap())
        .await
        .unwrap();
    let slow = tokio::time::timeout(Duration::from_secs(10), async {
        let resp = c
            .send_request(http::Request::get("http://a/slow").body(full("")).unwrap())
            .await?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        Ok::<_, hyper::Error>((status, body))
    })
    .await
    .expect("the slow stream was answered in time");
    let (status, body) = slow.expect("the slow stream was answered, not cut with its connection");
    assert_eq!(
        (status, &body[..]),
        (http::StatusCode::OK, &b"slow answer"[..])
    );
    let ex = errors_once(admin, "send_timeout").await;
    assert_eq!(
        errors_of(&ex, "send_timeout"),
        1.0,
        "the unread stream was reset"
    );
}

/// An HTTP/2 stream whose client keeps its window shut past the route's `total_timeout`
/// is reset at that deadline and counted as `total_timeout`.
#[tokio::test]
async fn an_h2_stream_stalled_past_its_total_timeout_is_counted_as_one() {
    let up = big_upstream().await;
    let gw = TestGateway::start(&format!(
        "{ADMIN}[server]\nworkers = 1\nidle_timeout = \"30s\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\ntotal_timeout = \"500ms\"\n"
    ));
    let admin = admin_addr(&gw);
    let _unread = h2_big_unread(gw.addr).await;
    let ex = errors_once(admin, "total_timeout").await;
    for other in ["client_gone", "send_timeout"] {
        assert_eq!(errors_of(&ex, other), 0.0, "{other}");
    }
}

/// An HTTP/1.1 client that takes its response slowly, a KiB at a time (never stalled for
/// the send timeout), is cut off at the route's `total_timeout`, counted as one. While
/// the gateway's write of what it had read waited for the client, nothing looked at the
/// deadline: the response went on until the client had drained a gather buffer (64 KiB,
/// half a minute at this pace), holding its upstream connection all along.
#[tokio::test]
async fn an_h1_client_reading_slowly_is_cut_off_at_the_total_timeout() {
    let up = big_upstream().await;
    let gw = TestGateway::start(&format!(
        "{ADMIN}[server]\nworkers = 1\nidle_timeout = \"30s\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\ntotal_timeout = \"500ms\"\n"
    ));
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let s = socket.connect(gw.addr).await.unwrap();
    read_slowly_until_the_total_timeout(s, admin_addr(&gw)).await;
}

/// Asks for `/big` on `s` and takes the answer a KiB every 500 ms, until the gateway
/// counts the exchange as cut at its `total_timeout` (and as nothing else).
async fn read_slowly_until_the_total_timeout<S>(mut s: S, admin: SocketAddr)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(b"GET /big HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    let reader = tokio::spawn(async move {
        let mut buf = [0u8; 1024];
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    });
    let ex = errors_once(admin, "total_timeout").await;
    for other in ["client_gone", "send_timeout"] {
        assert_eq!(errors_of(&ex, other), 0.0, "{other}");
    }
    reader.abort();
}

/// The same over TLS, where a write only fills the TLS layer's buffer and the wait for the
/// client is the flush's: the total timeout bounds that wait too. (Only the write was
/// bounded: over TLS the response went on for half a minute past the deadline.)
#[tokio::test]
async fn an_h1_client_reading_slowly_over_tls_is_cut_off_at_the_total_timeout() {
    let pki = common::tls::Pki::new();
    let up = big_upstream().await;
    let gw = TestGateway::start(&format!(
        "{ADMIN}[server]\nworkers = 1\nidle_timeout = \"30s\"\n[[listener]]\nname = \"tls\"\naddress = \"127.0.0.1:0\"\n[listener.tls]\ncert = \"{}\"\nkey = \"{}\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\ntotal_timeout = \"500ms\"\n",
        pki.path("server.pem"),
        pki.path("server.key")
    ));
    let admin = admin_addr(&gw);
    let mut roots = rustls::RootCertStore::empty();
    for c in pki.certs("ca.pem") {
        roots.add(c).unwrap();
    }
    let cfg = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::aws_lc_rs::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let tcp = socket.connect(gw.addr).await.unwrap();
    let s = tokio_rustls::TlsConnector::from(std::sync::Arc::new(cfg))
        .connect(
            rustls::pki_types::ServerName::try_from("upstream.test").unwrap(),
            tcp,
        )
        .await
        .unwrap();
    read_slowly_until_the_total_timeout(s, admin).await;
}

/// A small body (read with its head, by the inline server) that stops coming gets `408`,
/// recorded with what its head says, as a streamed one is: its route, tenant, method and
/// the client's request id. One that no route takes gets the routing's answer (`404`), as
/// it would have before its body was read; neither reaches the upstream.
#[tokio::test]
async fn a_stalled_small_body_is_recorded_under_its_route() {
    let up = echo_upstream().await;
    let gw = two_tenants(
        up,
        "[server]\nworkers = 1\nheader_read_timeout = \"300ms\"\nrequest_id_header = \"x-request-id\"\n",
    );
    let stalled = |path: &str| {
        format!(
            "POST {path} HTTP/1.1\r\nHost: acme.test\r\nX-Request-Id: stall-1\r\nContent-Length: 100\r\n\r\n0123456789"
        )
    };
    let (text, closed) = raw(
        gw.addr,
        stalled("/api/x").as_bytes(),
        Duration::from_secs(10),
    )
    .await;
    assert!(closed, "{text:?}");
    assert!(text.starts_with("HTTP/1.1 408 "), "{text:?}");
    assert!(text.contains("\r\nx-request-id: stall-1\r\n"), "{text:?}");
    let (text, _) = raw(
        gw.addr,
        stalled("/elsewhere").as_bytes(),
        Duration::from_secs(10),
    )
    .await;
    assert!(text.starts_with("HTTP/1.1 404 "), "{text:?}");

    let ex = scrape(admin_addr(&gw)).await;
    let acme = [("tenant", "acme"), ("route", "acme-api")];
    let mut timed_out = acme.to_vec();
    timed_out.push(("kind", "client_body_timeout"));
    assert_eq!(ex.value("tailgate_request_errors_total", &timed_out), 1.0);
    let mut posted = acme.to_vec();
    posted.extend([("method", "POST"), ("status_class", "4xx")]);
    assert_eq!(ex.value("tailgate_requests_total", &posted), 1.0);
    assert_eq!(
        ex.value(
            "tailgate_request_errors_total",
            &[("tenant", "acme"), ("route", ""), ("kind", "no_route")]
        ),
        1.0
    );
    assert_eq!(errors_of(&ex, "client_body_timeout"), 1.0);
}

/// The admin socket is dual-stack, as `check` takes it (README): an IPv4-mapped address
/// binds, and answers on its IPv4 form. It was bound IPv6-only, so `check` passed a config
/// that `serve` then failed to start with (`Invalid argument`).
#[tokio::test]
async fn the_admin_socket_is_dual_stack() {
    let gw = TestGateway::start(
        "[admin]\naddress = \"[::ffff:127.0.0.1]:0\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"127.0.0.1:1\"]\n",
    );
    let addr = admin_addr(&gw);
    let v4 = SocketAddr::from(([127, 0, 0, 1], addr.port()));
    // Answered on the IPv4 form (a refused connect fails in `admin_get`); `503` until the
    // worker's lag probe has first run, which a busy machine can hold back a moment.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = admin_get(v4, "/healthz", &[]).await.status();
        if status == 200 || Instant::now() > deadline {
            assert_eq!(status, 200);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// During a drain, a worker that has finished its own (no connection left) and stopped is
/// not stalled: `/healthz` stays 200 while another worker still serves a slow request. Its
/// lag probe stops with it, and it was reported stalled once the stall threshold passed,
/// which could get a gateway killed in the middle of a normal drain.
#[tokio::test]
async fn a_worker_done_draining_is_not_stalled() {
    let up = upstream(|_| async {
        tokio::time::sleep(Duration::from_secs(3)).await;
        http::Response::new(full("slow"))
    })
    .await;
    let gw = TestGateway::start(&format!(
        "[server]\nworkers = 2\nshutdown_grace = \"10s\"\n{ADMIN}[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
    ));
    let admin = admin_addr(&gw);
    let addr = gw.addr;
    let slow = tokio::spawn(async move { send(addr, "GET", "/slow", "a", "").await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    gw.gw.as_ref().unwrap().shutdown();
    // Past the stall threshold (300 ms): the idle worker has long stopped.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let health = admin_get(admin, "/healthz", &[]).await;
    assert_eq!(
        health.status(),
        200,
        "{}",
        String::from_utf8_lossy(health.body())
    );
    assert_eq!(slow.await.unwrap(), 200, "the slow request is served");
}

/// A request still in flight when `shutdown_grace` runs out is cut by the gateway: counted
/// as `shutdown`, not as a client that went away (`client_gone`).
#[tokio::test]
async fn a_request_cut_at_the_end_of_the_grace_is_counted_as_shutdown() {
    let up = upstream(|_| async {
        tokio::time::sleep(Duration::from_secs(10)).await;
        http::Response::new(full("slow"))
    })
    .await;
    let gw = TestGateway::start(&format!(
        "[server]\nworkers = 1\nshutdown_grace = \"500ms\"\n{ADMIN}[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
    ));
    let admin = admin_addr(&gw);
    use tokio::io::AsyncWriteExt;
    let mut slow = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    slow.write_all(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    gw.gw.as_ref().unwrap().shutdown();
    // The grace runs out; the worker stops (the admin plane answers until the gateway is
    // joined).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let ex = scrape(admin).await;
    let sum = |kind: &str| -> f64 {
        ex.find("tailgate_request_errors_total", &[("kind", kind)])
            .iter()
            .map(|s| s.value)
            .sum()
    };
    assert_eq!((sum("shutdown"), sum("client_gone")), (1.0, 0.0));
    drop(slow);
}

/// A tunnel still open when `shutdown_grace` runs out is recorded as `shutdown` with the
/// bytes it carried both ways. They were counted only when the tunnel ended of itself, and
/// a tunnel cut with its task at the end of the grace was recorded with none.
#[tokio::test]
async fn a_tunnel_cut_at_the_end_of_the_grace_keeps_its_bytes() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let echo = upstream(|mut req: http::Request<hyper::body::Incoming>| async move {
        websocket_echo(&mut req)
    })
    .await;
    let gw = TestGateway::to(
        echo,
        &format!("{ADMIN}[server]\nworkers = 1\nshutdown_grace = \"500ms\"\n"),
    );
    let admin = admin_addr(&gw);
    let mut s = ws_open(gw.addr).await.0;
    let data = vec![7u8; 64 * 1024];
    s.write_all(&data).await.unwrap();
    let mut buf = vec![0u8; 64 * 1024];
    let mut echoed = 0;
    while echoed < data.len() {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0);
        echoed += n;
    }
    gw.gw.as_ref().unwrap().shutdown();
    // The grace runs out; the worker stops (the admin plane answers until the gateway is
    // joined).
    let deadline = Instant::now() + Duration::from_secs(15);
    let ex = loop {
        let ex = scrape(admin).await;
        if errors_of(&ex, "shutdown") >= 1.0 {
            break ex;
        }
        assert!(Instant::now() < deadline, "the tunnel was never cut");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let sum = |name: &str| -> f64 { ex.find(name, &[]).iter().map(|s| s.value).sum() };
    assert_eq!(errors_of(&ex, "shutdown"), 1.0);
    assert_eq!(sum("tailgate_request_body_bytes_total"), data.len() as f64);
    assert_eq!(sum("tailgate_response_body_bytes_total"), data.len() as f64);
    drop(s);
}

/// A small body (served inline) that stops coming is answered `408`, and the request is
/// recorded as having taken at least the wait that ended it: its start is set back by the
/// header timeout (when its head came is not kept), not taken when the `408` goes out.
#[tokio::test]
async fn a_stalled_small_body_is_timed_from_before_its_wait() {
    let up = ok_upstream().await;
    let gw = TestGateway::start(&format!(
        "{ADMIN}[server]\nworkers = 1\nheader_read_timeout = \"700ms\"\nidle_timeout = \"60s\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\nname = \"r\"\npath_prefix = \"/\"\ncluster = \"up\"\n"
    ));
    let (text, closed) = raw(
        gw.addr,
        b"POST /stalled HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n0123456789",
        Duration::from_secs(10),
    )
    .await;
    assert!(closed && text.starts_with("HTTP/1.1 408 "), "{text:?}");
    let ex = scrape(admin_addr(&gw)).await;
    let with = [("route", "r")];
    assert_eq!(
        ex.value("tailgate_request_duration_seconds_count", &with),
        1.0
    );
    let sum = ex.value("tailgate_request_duration_seconds_sum", &with);
    assert!(sum >= 0.7, "recorded as taking {sum} s");
}

/// `/metrics` is streamed in chunks of about 64 KiB, within a family too: with 2,000 routes
/// that each had an error, the error family alone is some 170 KB, and no chunk of the
/// answer is much over 64 KiB (it is not rendered whole first).
#[tokio::test]
async fn a_large_family_is_streamed_in_chunks() {
    let dead = dead_port();
    let addr = dead.addr();
    let mut toml = format!("{ADMIN}[[cluster]]\nname = \"up\"\nendpoints = [\"{addr}\"]\n");
    for i in 0..2000 {
        toml.push_str(&format!(
            "[[route]]\nname = \"r{i}\"\npath_prefix = \"/r{i}/\"\ncluster = \"up\"\n"
        ));
    }
    let gw = TestGateway::start(&toml);
    let mut c = h1_client(gw.addr).await;
    for i in 0..2000 {
        let req = http::Request::get(format!("/r{i}/"))
            .header("host", "a")
            .body(full(""))
            .unwrap();
        assert_eq!(c.send_request(req).await.unwrap().status(), 502);
    }
    let mut s = tokio::net::TcpStream::connect(admin_addr(&gw))
        .await
        .unwrap();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut raw))
        .await
        .unwrap()
        .unwrap();
    let at = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
    let head = String::from_utf8_lossy(&raw[..at]).to_ascii_lowercase();
    assert!(head.contains("transfer-encoding: chunked"), "{head}");
    // The chunks' sizes, and the body they make.
    let (mut rest, mut sizes, mut body) = (&raw[at..], Vec::new(), Vec::new());
    loop {
        let eol = rest.windows(2).position(|w| w == b"\r\n").unwrap();
        let size = usize::from_str_radix(std::str::from_utf8(&rest[..eol]).unwrap(), 16).unwrap();
        if size == 0 {
            break;
        }
        body.extend_from_slice(&rest[eol + 2..eol + 2 + size]);
        sizes.push(size);
        rest = &rest[eol + 2 + size + 2..];
    }
    let text = String::from_utf8(body).unwrap();
    let errors = text
        .lines()
        .filter(|l| l.starts_with("tailgate_request_errors_total{"))
        .count();
    assert_eq!(errors, 2000);
    let largest = sizes.iter().max().copied().unwrap_or(0);
    assert!(
        largest <= 68 * 1024,
        "a chunk of {largest} bytes ({} chunks, {} bytes in all)",
        sizes.len(),
        text.len()
    );
}

/// A request whose connect failed has that connect in its connect stage (the stage shows
/// the failed connects, not only those that worked), and its route stage recorded.
#[tokio::test]
async fn a_failed_connect_is_in_the_connect_stage() {
    let dead = dead_port();
    let addr = dead.addr();
    let gw = TestGateway::start(&format!(
        "{ADMIN}[[cluster]]\nname = \"up\"\nendpoints = [\"{addr}\"]\n[[route]]\nname = \"r\"\npath_prefix = \"/\"\ncluster = \"up\"\n"
    ));
    let resp = get(gw.addr, "/").await;
    assert_eq!(resp.status(), 502, "{:?}", resp.body());
    let ex = scrape(admin_addr(&gw)).await;
    for stage in ["route", "upstream_connect"] {
        assert_eq!(
            ex.value(
                "tailgate_request_stage_duration_seconds_count",
                &[("route", "r"), ("stage", stage)],
            ),
            1.0,
            "{stage}"
        );
    }
}

/// A body refused as too large is counted under its route whether its length was declared
/// (refused before a byte of it is read) or found on its way (chunked).
#[tokio::test]
async fn a_body_too_large_is_counted_under_its_route_however_framed() {
    let up = echo_upstream().await;
    let gw = two_tenants(up, "[server]\nworkers = 1\nmax_body_bytes = 100\n");
    let big = "x".repeat(1000);
    let declared =
        format!("POST /api/x HTTP/1.1\r\nHost: acme.test\r\nContent-Length: 1000\r\n\r\n{big}");
    let chunked = format!(
        "POST /api/x HTTP/1.1\r\nHost: acme.test\r\nTransfer-Encoding: chunked\r\n\r\n3e8\r\n{big}\r\n0\r\n\r\n"
    );
    for req in [declared, chunked] {
        let (text, _) = raw(gw.addr, req.as_bytes(), Duration::from_secs(5)).await;
        assert!(text.starts_with("HTTP/1.1 413 "), "{text}");
    }
    let ex = scrape(admin_addr(&gw)).await;
    assert_eq!(
        ex.value(
            "tailgate_request_errors_total",
            &[
                ("tenant", "acme"),
                ("route", "acme-api"),
                ("kind", "body_too_large")
            ]
        ),
        2.0
    );
    // The one refused before it reached the upstream stage has no route time (it was
    // recorded as a zero); the chunked one, refused on its way, has one.
    assert_eq!(
        ex.value(
            "tailgate_request_stage_duration_seconds_count",
            &[("route", "acme-api"), ("stage", "route")]
        ),
        1.0
    );
}

/// Connections holding every admin slot with part of a request head each (and the probe
/// slots with nothing) do not keep a health probe out: the one idle the longest is closed
/// for it at once, not when its head's 10 s are up.
#[tokio::test]
async fn half_sent_heads_on_every_admin_slot_do_not_keep_a_probe_out() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = ok_upstream().await;
    let gw = TestGateway::to(up, ADMIN);
    let admin = admin_addr(&gw);
    let mut held = Vec::new();
    for _ in 0..64 {
        let mut s = tokio::net::TcpStream::connect(admin).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\n").await.unwrap();
        held.push(s);
    }
    // Time for the admin thread to take them all.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for _ in 0..8 {
        held.push(tokio::net::TcpStream::connect(admin).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut s = tokio::net::TcpStream::connect(admin).await.unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(3), s.read(&mut buf))
        .await
        .expect("no answer within 3 s")
        .unwrap();
    let text = String::from_utf8_lossy(&buf[..n]);
    assert!(text.starts_with("HTTP/1.1 200"), "{text:?}");
    drop(held);
}

/// A WebSocket's exchange is recorded when its tunnel ends, with the bytes it carried both
/// ways in the route's byte counters; its latency (the request duration histogram) is its
/// handshake's, not its lifetime. It was recorded at the `101`, with none of its bytes.
#[tokio::test]
async fn a_tunnels_bytes_are_counted_when_it_ends_and_its_latency_is_the_handshake() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = upstream(|mut req: http::Request<hyper::body::Incoming>| async move {
        websocket_echo(&mut req)
    })
    .await;
    let gw = TestGateway::start(&format!(
        "{ADMIN}[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\nname = \"ws\"\npath_prefix = \"/\"\ncluster = \"up\"\n"
    ));
    let admin = admin_addr(&gw);
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"GET /ws HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 64 * 1024];
    let mut head = Vec::new();
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0);
        head.extend_from_slice(&buf[..n]);
    }
    assert!(head.starts_with(b"HTTP/1.1 101"));
    // 100 KiB echoed back, over more than the time a handshake takes.
    let data = vec![7u8; 100 * 1024];
    s.write_all(&data).await.unwrap();
    let mut echoed = 0;
    while echoed < data.len() {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0);
        echoed += n;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let route = [("route", "ws")];
    let ex = scrape(admin).await;
    assert!(
        ex.find("tailgate_request_duration_seconds_count", &route)
            .iter()
            .all(|s| s.value == 0.0),
        "recorded before the tunnel ended"
    );
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(10);
    let ex = loop {
        let ex = scrape(admin).await;
        // (No series until the first exchange is recorded; a scrape may fall between the
        // series one recording writes, so each is waited for.)
        let sum = |name: &str, labels: &[(&str, &str)]| -> f64 {
            ex.find(name, labels).iter().map(|s| s.value).sum()
        };
        if sum("tailgate_request_duration_seconds_count", &route) == 1.0
            && sum(
                "tailgate_requests_total",
                &[("route", "ws"), ("status_class", "1xx")],
            ) == 1.0
        {
            break ex;
        }
        assert!(
            Instant::now() < deadline,
            "the tunnel's exchange was never recorded"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(
        ex.value("tailgate_request_body_bytes_total", &route),
        data.len() as f64
    );
    assert_eq!(
        ex.value("tailgate_response_body_bytes_total", &route),
        data.len() as f64
    );
    assert_eq!(
        ex.value(
            "tailgate_requests_total",
            &[("route", "ws"), ("status_class", "1xx")]
        ),
        1.0
    );
    // The handshake's time, not the tunnel's 2 s and more.
    let sum = ex.value("tailgate_request_duration_seconds_sum", &route);
    assert!(sum < 1.5, "{sum} s");
}

/// An upload that stops after the upstream has answered (an upstream echoing it back as it
/// comes) is the client's stall, and recorded as `client_body_timeout`: it was blamed on
/// the upstream (`upstream_body_timeout`), whose answer the gateway waited for.
#[tokio::test]
async fn an_upload_stalled_after_the_answer_began_is_the_clients_timeout() {
    let up = echo_upstream().await;
    assert_eq!(stalled_echo_upload(up, "").await, (1.0, 0.0));
}

/// The same over an HTTP/2 upstream, whose request body hyper's connection task sends
/// unseen by the exchange: the body's own progress says the client stalled (it was
/// recorded as `upstream_body_timeout`).
#[tokio::test]
async fn an_upload_stalled_after_an_h2_answer_began_is_the_clients_timeout() {
    let up = h2c_upstream_with(|req: http::Request<hyper::body::Incoming>| async move {
        http::Response::new(
            req.into_body()
                .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
                .boxed(),
        )
    })
    .await;
    assert_eq!(
        stalled_echo_upload(up, "protocol = \"http2\"\n").await,
        (1.0, 0.0)
    );
}

/// Half an upload to a gateway in front of `up` (an echoing upstream; `cluster_extra` in
/// its cluster, a 500 ms response timeout), then nothing: the answer's head and the
/// echoed half come, then the cut. The route's `client_body_timeout` and
/// `upstream_body_timeout` counts.
async fn stalled_echo_upload(up: SocketAddr, cluster_extra: &str) -> (f64, f64) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let gw = TestGateway::start(&format!(
        "{ADMIN}[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n{cluster_extra}[[route]]\nname = \"echo\"\npath_prefix = \"/\"\ncluster = \"up\"\nresponse_timeout = \"500ms\"\n"
    ));
    let admin = admin_addr(&gw);
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"POST /e HTTP/1.1\r\nHost: a\r\nContent-Length: 100000\r\n\r\n")
        .await
        .unwrap();
    s.write_all(&[b'x'; 50_000]).await.unwrap();
    let mut got = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => panic!("never cut off"),
        }
    }
    assert!(
        got.starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&got[..got.len().min(200)])
    );
    body_timeouts(admin, "echo").await
}

/// Once a route's exchange is recorded with one of them: its `client_body_timeout` and
/// `upstream_body_timeout` counts.
async fn body_timeouts(admin: SocketAddr, route: &str) -> (f64, f64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let ex = scrape(admin).await;
        // (A kind never counted has no series.)
        let count = |k| -> f64 {
            ex.find(
                "tailgate_request_errors_total",
                &[("route", route), ("kind", k)],
            )
            .iter()
            .map(|s| s.value)
            .sum()
        };
        let counts = (count("client_body_timeout"), count("upstream_body_timeout"));
        if counts.0 + counts.1 > 0.0 {
            return counts;
        }
        assert!(Instant::now() < deadline, "the exchange was never recorded");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The other way: a client that goes on sending while the upstream, which answered at
/// once, sends nothing of its body (a duplex exchange the upstream stalled) is waiting
/// for the upstream, and the cut is `upstream_body_timeout`.
#[tokio::test]
async fn an_upstream_silent_while_the_upload_moves_is_the_upstreams_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = upstream(|req: http::Request<hyper::body::Incoming>| async move {
        // The upload is read to its end meanwhile; the answer's body never comes.
        tokio::spawn(async move {
            let mut body = req.into_body();
            while let Some(Ok(_)) = body.frame().await {}
        });
        type Piece = Result<hyper::body::Frame<Bytes>, Box<dyn std::error::Error + Send + Sync>>;
        let never = http_body_util::StreamBody::new(futures_util::stream::pending::<Piece>());
        http::Response::new(never.boxed())
    })
    .await;
    let gw = TestGateway::start(&format!(
        "{ADMIN}[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\nname = \"duplex\"\npath_prefix = \"/\"\ncluster = \"up\"\nresponse_timeout = \"500ms\"\n"
    ));
    let admin = admin_addr(&gw);
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"POST /d HTTP/1.1\r\nHost: a\r\nContent-Length: 1000000\r\n\r\n")
        .await
        .unwrap();
    // A piece every 50 ms, well past the response timeout, until the gateway cuts it.
    let writer = tokio::spawn(async move {
        let (mut r, mut w) = s.into_split();
        let sending = async {
            for _ in 0..60 {
                if w.write_all(&[b'x'; 1000]).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        let mut sink = Vec::new();
        let reading = r.read_to_end(&mut sink);
        tokio::select! {
            () = sending => {}
            _ = reading => {}
        }
    });
    assert_eq!(body_timeouts(admin, "duplex").await, (0.0, 1.0));
    writer.abort();
}

/// How a tunnel ends is its exchange's outcome: one closed for silence is counted as
/// `tunnel_idle_timeout`, one whose client reset it as `client_gone`, one whose upstream
/// reset it as `upstream_reset`. Every tunnel was recorded as a clean `101` however it ended.
#[tokio::test]
async fn a_tunnels_ending_is_counted_by_its_cause() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let echo = upstream(|mut req: http::Request<hyper::body::Incoming>| async move {
        websocket_echo(&mut req)
    })
    .await;
    let gw = TestGateway::to(
        echo,
        &format!("{ADMIN}[server]\nworkers = 1\nidle_timeout = \"1s\"\n"),
    );
    let admin = admin_addr(&gw);
    // Silent: closed after the idle timeout.
    let mut silent = ws_open(gw.addr).await.0;
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(10), silent.read(&mut buf))
        .await
        .expect("the silent tunnel is closed")
        .unwrap_or(0);
    assert_eq!(n, 0);
    let ex = errors_once(admin, "tunnel_idle_timeout").await;
    assert_eq!(errors_of(&ex, "client_gone"), 0.0);
    // Reset by its client.
    let reset = ws_open(gw.addr).await.0;
    socket2::SockRef::from(&reset)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(reset);
    let ex = errors_once(admin, "client_gone").await;
    assert_eq!(errors_of(&ex, "upstream_reset"), 0.0);
    assert_eq!(errors_of(&ex, "tunnel_idle_timeout"), 1.0);

    // Reset by its upstream: a raw one that switches, then resets once bytes come.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let resetting = l.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut head = Vec::new();
        let mut buf = [0u8; 4096];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0);
            head.extend_from_slice(&buf[..n]);
        }
        s.write_all(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n")
            .await
            .unwrap();
        let _ = s.read(&mut buf).await;
        socket2::SockRef::from(&s)
            .set_linger(Some(Duration::ZERO))
            .unwrap();
        drop(s);
    });
    let gw = TestGateway::to(
        resetting,
        &format!("{ADMIN}[server]\nworkers = 1\nidle_timeout = \"30s\"\n"),
    );
    let admin = admin_addr(&gw);
    let mut s = ws_open(gw.addr).await.0;
    s.write_all(&[0x81, 0x01, b'x']).await.unwrap();
    let ex = errors_once(admin, "upstream_reset").await;
    assert_eq!(errors_of(&ex, "client_gone"), 0.0);
    assert_eq!(errors_of(&ex, "tunnel_idle_timeout"), 0.0);
    drop(s);
}

/// A request head not whole within `header_read_timeout` is counted
/// (`tailgate_downstream_header_timeouts_total`), on a connection's first request (the
/// inline server) and on one handed to hyper's server (after a chunked request). Such a
/// connection was closed with no trace, no line and no count.
#[tokio::test]
async fn a_head_that_does_not_come_whole_in_time_is_counted() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = echo_upstream().await;
    let gw = TestGateway::to(
        up,
        &format!(
            "{ADMIN}[server]\nworkers = 1\nheader_read_timeout = \"300ms\"\nidle_timeout = \"60s\"\n"
        ),
    );
    let admin = admin_addr(&gw);
    let timeouts = |ex: &Exposition| ex.value("tailgate_downstream_header_timeouts_total", &[]);
    assert_eq!(timeouts(&scrape(admin).await), 0.0);
    // The inline server: a first head that stops.
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: a\r\nX-Slow: ")
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .expect("closed in time")
        .unwrap_or(0);
    assert_eq!(n, 0);
    assert_eq!(timeouts(&scrape(admin).await), 1.0);
    // hyper's server, behind the guard: a chunked request hands the connection over, then
    // the next head stops.
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
    )
    .await
    .unwrap();
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("hi") {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "closed before the answer");
        got.extend_from_slice(&buf[..n]);
    }
    s.write_all(b"GET / HTTP/1.1\r\nHost: a\r\nX-Slow: ")
        .await
        .unwrap();
    loop {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .expect("closed in time")
            .unwrap_or(0);
        if n == 0 {
            break;
        }
    }
    assert_eq!(timeouts(&scrape(admin).await), 2.0);
}
