//! TLS to upstreams (`https://` endpoints): verification against a CA and a name, client
//! certificates, session resumption on replacement connections, warm spares and retries over
//! TLS, and the config errors. The upstreams are in-process rustls servers with an rcgen CA;
//! behaviour is asserted on counters on both sides, never on timings.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::atomic::Ordering;

use common::tls::*;
use common::*;
use rustls::HandshakeKind;
use tailgate::Config;
use tokio::io::AsyncWriteExt;

fn gateway(endpoints: &str, cluster_extra: &str) -> TestGateway {
    TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [{endpoints}]\n{cluster_extra}\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
    ))
}

fn json(resp: &http::Response<bytes::Bytes>) -> serde_json::Value {
    serde_json::from_slice(resp.body()).unwrap()
}

#[tokio::test]
async fn get_through_an_https_cluster() {
    let pki = Pki::new();
    let (up, seen) = tls_ok_upstream(&pki, ServerOpts::default()).await;
    let gw = https_gateway(&pki, up, "");
    for _ in 0..3 {
        let resp = get(gw.addr, "/").await;
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.body().as_ref(), b"ok");
    }
    assert_eq!(seen.requests.load(Ordering::SeqCst), 3);
    assert_eq!(
        seen.conns.load(Ordering::SeqCst),
        1,
        "one pooled TLS connection"
    );
    assert_eq!(
        stat(&gw, |s| s.tls_full_handshakes.load(Ordering::Relaxed)),
        1
    );
    assert_eq!(stat(&gw, |s| s.reuses.load(Ordering::Relaxed)), 2);
    let hs = seen.handshakes.lock().unwrap().clone();
    assert_eq!(hs.len(), 1);
    assert_eq!(
        hs[0].sni, None,
        "no SNI for an IP literal: its IP SAN is verified"
    );
    assert_eq!(
        hs[0].alpn.as_deref(),
        Some(&b"http/1.1"[..]),
        "http/1.1 offered by ALPN"
    );
}

#[tokio::test]
async fn ipv6_https_endpoint_verifies_its_ip_san() {
    let pki = Pki::new();
    let Ok(probe) = std::net::TcpListener::bind("[::1]:0") else {
        eprintln!("no IPv6 loopback here; skipping");
        return;
    };
    drop(probe);
    let (up, seen) = tls_ok_upstream_on("[::1]:0", &pki, ServerOpts::default()).await;
    let gw = https_gateway(&pki, up, "");
    assert_eq!(get(gw.addr, "/").await.status(), 200);
    assert_eq!(seen.requests.load(Ordering::SeqCst), 1);
}

/// The upstream's certificate is signed by a CA the cluster does not trust: 502 with a clear
/// error, counted as a connect failure and a TLS failure, nothing sent.
#[tokio::test]
async fn untrusted_upstream_certificate_is_a_502_and_a_connect_failure() {
    let pki = Pki::new();
    let (up, seen) = tls_ok_upstream(&pki, ServerOpts::default()).await;
    let gw = gateway(
        &format!("\"https://{up}\""),
        &format!("tls_ca = \"{}\"", pki.path("other-ca.pem")),
    );
    let resp = get(gw.addr, "/").await;
    assert_eq!(resp.status(), 502);
    let body = json(&resp);
    assert_eq!(body["error"], "upstream_tls_failed");
    // The reason is the operator's, in the log, not the client's.
    assert_eq!(
        body["message"],
        "upstream TLS handshake failed (the gateway's log says why)"
    );
    assert_eq!(stat(&gw, |s| s.connect_failures.load(Ordering::Relaxed)), 1);
    // A connect that failed opened no connection (`connects_total{when="on_request"}`
    // counted attempts, and climbed at the request rate through an outage).
    assert_eq!(
        stat(&gw, |s| s.connects_on_request.load(Ordering::Relaxed)),
        0
    );
    assert_eq!(
        stat(&gw, |s| s.tls_handshake_failures.load(Ordering::Relaxed)),
        1
    );
    assert_eq!(
        stat(&gw, |s| s.tls_full_handshakes.load(Ordering::Relaxed)),
        0
    );
    assert_eq!(seen.requests.load(Ordering::SeqCst), 0, "nothing was sent");
}

/// A failed handshake sent nothing: the request is tried on another endpoint and succeeds.
#[tokio::test]
async fn tls_failure_is_tried_on_another_endpoint() {
    let pki = Pki::new();
    let (good, seen) = tls_ok_upstream(&pki, ServerOpts::default()).await;
    // Its certificate has no IP SAN: verification of the endpoint's IP fails.
    let (bad, bad_seen) = tls_ok_upstream(
        &pki,
        ServerOpts {
            cert: "dns-only.pem",
            key: "dns-only.key",
            ..ServerOpts::default()
        },
    )
    .await;
    let gw = gateway(
        &format!("\"https://{bad}\", \"https://{good}\""),
        &format!(
            "tls_ca = \"{}\"\nbalance = \"round_robin\"",
            pki.path("ca.pem")
        ),
    );
    for i in 0..4 {
        assert_eq!(get(gw.addr, "/").await.status(), 200, "request {i}");
    }
    assert_eq!(seen.requests.load(Ordering::SeqCst), 4);
    assert_eq!(bad_seen.requests.load(Ordering::SeqCst), 0);
    assert!(stat(&gw, |s| s.tls_handshake_failures.load(Ordering::Relaxed)) >= 1);
    assert_eq!(
        stat(&gw, |s| s.tls_handshake_failures.load(Ordering::Relaxed)),
        stat(&gw, |s| s.retries.load(Ordering::Relaxed)),
        "each failed handshake was retried elsewhere"
    );
}

/// The certificate must match `tls_server_name` (which is also the SNI); without it, the
/// endpoint's IP must be one of the certificate's IP SANs. A mismatch's 502 tells the
/// client nothing of either.
#[tokio::test]
async fn upstream_certificate_must_match_the_server_name() {
    let pki = Pki::new();
    let (up, seen) = tls_ok_upstream(&pki, ServerOpts::default()).await;

    let wrong = https_gateway(&pki, up, "tls_server_name = \"elsewhere.test\"");
    let resp = get(wrong.addr, "/").await;
    assert_eq!(resp.status(), 502);
    // Neither the server name asked for nor the certificate's names and addresses reach
    // the client.
    let text = String::from_utf8_lossy(resp.body()).into_owned();
    assert_eq!(json(&resp)["error"], "upstream_tls_failed");
    for hidden in [
        "elsewhere.test",
        "upstream.test",
        "127.0.0.1",
        "certificate",
    ] {
        assert!(!text.contains(hidden), "{hidden:?} in {text}");
    }
    assert_eq!(
        stat(&wrong, |s| s.connect_failures.load(Ordering::Relaxed)),
        1
    );

    let right = https_gateway(&pki, up, "tls_server_name = \"upstream.test\"");
    assert_eq!(get(right.addr, "/").await.status(), 200);
    let hs = seen.handshakes.lock().unwrap().clone();
    assert_eq!(
        hs.last().unwrap().sni.as_deref(),
        Some("upstream.test"),
        "sent as SNI"
    );
    assert_eq!(seen.requests.load(Ordering::SeqCst), 1);

    // A certificate with only a DNS name does not cover the endpoint's IP.
    let (dns_only, _) = tls_ok_upstream(
        &pki,
        ServerOpts {
            cert: "dns-only.pem",
            key: "dns-only.key",
            ..ServerOpts::default()
        },
    )
    .await;
    let by_ip = https_gateway(&pki, dns_only, "");
    assert_eq!(get(by_ip.addr, "/").await.status(), 502);
    assert_eq!(
        stat(&by_ip, |s| s.tls_handshake_failures.load(Ordering::Relaxed)),
        1
    );
}

/// An upstream that requires a client certificate gets the cluster's; without one
/// configured, the upstream refuses the handshake and the request is a 502.
#[tokio::test]
async fn client_certificate_is_presented_when_the_upstream_requires_one() {
    let pki = Pki::new();
    let opts = || ServerOpts {
        client_ca: Some("client-ca.pem"),
        ..ServerOpts::default()
    };
    let (up, seen) = tls_ok_upstream(&pki, opts()).await;
    let gw = https_gateway(
        &pki,
        up,
        &format!(
            "tls_client_cert = \"{}\"\ntls_client_key = \"{}\"",
            pki.path("client.pem"),
            pki.path("client.key")
        ),
    );
    assert_eq!(get(gw.addr, "/").await.status(), 200);
    let hs = seen.handshakes.lock().unwrap().clone();
    assert_eq!(hs.len(), 1);
    assert!(hs[0].client_cert, "the client certificate was presented");

    let (up2, seen2) = tls_ok_upstream(&pki, opts()).await;
    let anonymous = https_gateway(&pki, up2, "");
    assert_eq!(get(anonymous.addr, "/").await.status(), 502);
    assert_eq!(seen2.failed_handshakes.load(Ordering::SeqCst), 1);
    assert_eq!(seen2.requests.load(Ordering::SeqCst), 0);
}

/// Rotation after every request: each replacement connection resumes the TLS session of an
/// earlier one instead of paying a full handshake (seen by the gateway and by the server).
#[tokio::test]
async fn rotated_connections_resume_the_tls_session() {
    let pki = Pki::new();
    let (up, seen) = tls_ok_upstream(&pki, ServerOpts::default()).await;
    let gw = https_gateway(&pki, up, "max_requests_per_connection = 1");
    for i in 0..5 {
        assert_eq!(get(gw.addr, "/").await.status(), 200, "request {i}");
    }
    // One connection per request, and each one's successor opened as it is retired (the
    // last may still be under way, and a request may have opened its own meanwhile).
    let conns = seen.conns.load(Ordering::SeqCst);
    assert!((5..=10).contains(&conns), "{conns} connections");
    assert_eq!(
        stat(&gw, |s| s.retired_max_requests.load(Ordering::Relaxed)),
        5
    );
    assert_eq!(
        stat(&gw, |s| s.tls_full_handshakes.load(Ordering::Relaxed)),
        1
    );
    let resumed = stat(&gw, |s| s.tls_resumed_handshakes.load(Ordering::Relaxed));
    assert!((4..=9).contains(&resumed), "{resumed}");
    let kinds = seen.kinds();
    assert_eq!(kinds[0], HandshakeKind::Full);
    assert!(
        kinds[1..].iter().all(|k| *k == HandshakeKind::Resumed),
        "{kinds:?}"
    );
}

/// Warm spares are opened (and handshaken) over TLS before any request, and the first
/// request uses one.
#[tokio::test]
async fn warm_spares_are_tls_connections_ready_before_the_first_request() {
    let pki = Pki::new();
    let (up, seen) = tls_ok_upstream(&pki, ServerOpts::default()).await;
    let gw = https_gateway(&pki, up, "min_warm_connections = 2");
    wait_for("2 warm TLS connections", || {
        stat(&gw, |s| s.preconnects.load(Ordering::Relaxed)) >= 2
    })
    .await;
    assert_eq!(seen.handshakes.lock().unwrap().len(), 2);
    assert_eq!(
        stat(&gw, |s| s.tls_full_handshakes.load(Ordering::Relaxed)
            + s.tls_resumed_handshakes.load(Ordering::Relaxed)),
        2
    );
    assert_eq!(get(gw.addr, "/").await.status(), 200);
    assert_eq!(
        stat(&gw, |s| s.connects_on_request.load(Ordering::Relaxed)),
        0
    );
    assert_eq!(stat(&gw, |s| s.reuses.load(Ordering::Relaxed)), 1);
}

/// A raw HTTP/1.1 server over TLS: the first request on each connection is answered, the
/// second is read and the connection dropped without an answer.
async fn answer_once_then_drop(
    mut tls: tokio_rustls::server::TlsStream<tokio::net::TcpStream>,
    seen: Seen,
) {
    let mut buf = Vec::new();
    let mut index = 0;
    loop {
        let Some(end) = read_head(&mut tls, &mut buf).await else {
            return;
        };
        buf.drain(..end);
        index += 1;
        seen.requests.fetch_add(1, Ordering::SeqCst);
        if index > 1 {
            return;
        }
        if tls
            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            .await
            .is_err()
        {
            return;
        }
        let _ = tls.flush().await;
    }
}

/// A pooled TLS connection dropped under a GET: the GET is replayed on a fresh (resumed)
/// connection and succeeds.
#[tokio::test]
async fn get_is_retried_on_a_fresh_tls_connection() {
    let pki = Pki::new();
    let (up, seen) = tls_server(
        "127.0.0.1:0",
        &pki,
        ServerOpts::default(),
        answer_once_then_drop,
    )
    .await;
    let gw = https_gateway(&pki, up, "");
    let mut c = h1_client(gw.addr).await;
    for i in 0..2 {
        let req = http::Request::get("/")
            .header("host", "a")
            .body(full(""))
            .unwrap();
        let resp = c.send_request(req).await.unwrap();
        assert_eq!(resp.status(), 200, "request {i}");
        http_body_util::BodyExt::collect(resp.into_body())
            .await
            .unwrap();
    }
    assert_eq!(stat(&gw, |s| s.retries.load(Ordering::Relaxed)), 1);
    assert_eq!(seen.conns.load(Ordering::SeqCst), 2);
    assert_eq!(seen.kinds(), [HandshakeKind::Full, HandshakeKind::Resumed]);
}

/// A raw HTTP/1.1 server over TLS that answers with a body of no length and ends it by
/// closing the TCP connection without TLS's `close_notify` (as many servers do).
async fn answer_until_close_without_notify(
    mut tls: tokio_rustls::server::TlsStream<tokio::net::TcpStream>,
    seen: Seen,
) {
    let mut buf = Vec::new();
    if read_head(&mut tls, &mut buf).await.is_none() {
        return;
    }
    seen.requests.fetch_add(1, Ordering::SeqCst);
    if tls
        .write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nhello, until close")
        .await
        .is_err()
    {
        return;
    }
    let _ = tls.flush().await;
    let (mut tcp, _) = tls.into_inner();
    let _ = tcp.shutdown().await;
}

/// A body that ends with the connection ends there over TLS too when the server sends no
/// `close_notify` (as nginx takes it): the client gets it whole, not cut short.
#[tokio::test]
async fn a_body_ended_by_a_close_without_close_notify_is_whole() {
    let pki = Pki::new();
    let (up, seen) = tls_server(
        "127.0.0.1:0",
        &pki,
        ServerOpts::default(),
        answer_until_close_without_notify,
    )
    .await;
    let gw = https_gateway(&pki, up, "");
    for _ in 0..2 {
        let resp = get(gw.addr, "/").await;
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.body().as_ref(), b"hello, until close");
    }
    assert_eq!(seen.requests.load(Ordering::SeqCst), 2);
    assert_eq!(seen.conns.load(Ordering::SeqCst), 2, "never reused");
}

// ---- config ----------------------------------------------------------------------------

fn check(pki: &Pki, cluster: &str) -> String {
    let text =
        format!("[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"up\"\n{cluster}\n");
    match Config::parse(&pki.dir.join("t.toml"), &text) {
        Ok(_) => String::new(),
        Err(e) => e.to_string(),
    }
}

#[test]
fn config_errors_name_the_place_and_the_fix() {
    let pki = Pki::new();
    let ca = pki.path("ca.pem");
    let t = |s: &str| check(&pki, s);
    let place = pki.dir.join("t.toml").display().to_string();

    let e = t("endpoints = [\"https://127.0.0.1:1\"]\ntls_ca = \"missing.pem\"");
    assert!(
        e.contains(&format!("{place}:6:10: cluster[0].tls_ca: no such file")),
        "{e}"
    );

    std::fs::write(pki.dir.join("junk.pem"), "not a certificate\n").unwrap();
    let e = t("endpoints = [\"https://127.0.0.1:1\"]\ntls_ca = \"junk.pem\"");
    assert!(e.contains("cluster[0].tls_ca: no certificate in"), "{e}");
    assert!(e.contains("help: the file must hold PEM blocks"), "{e}");

    let e = t(&format!(
        "endpoints = [\"https://127.0.0.1:1\"]\ntls_ca = \"{ca}\"\ntls_client_cert = \"client.pem\""
    ));
    assert!(
        e.contains(":7:19: cluster[0].tls_client_cert: a client certificate needs its private key"),
        "{e}"
    );
    assert!(e.contains("help: add tls_client_key"), "{e}");

    let e = t(&format!(
        "endpoints = [\"https://127.0.0.1:1\"]\ntls_ca = \"{ca}\"\ntls_client_cert = \"client.pem\"\ntls_client_key = \"server.key\""
    ));
    assert!(
        e.contains(
            "cluster[0].tls_client_key: the client certificate and key cannot be used together"
        ),
        "{e}"
    );

    let e = t(&format!(
        "endpoints = [\"https://127.0.0.1:1\"]\ntls_ca = \"{ca}\"\ntls_client_cert = \"client.pem\"\ntls_client_key = \"junk.pem\""
    ));
    assert!(
        e.contains("cluster[0].tls_client_key: cannot read a private key"),
        "{e}"
    );

    let e = t("endpoints = [\"https://127.0.0.1:1\", \"127.0.0.1:2\"]");
    assert!(
        e.contains(":5:37: cluster[0].endpoints: mixes https:// and plain HTTP endpoints"),
        "{e}"
    );

    let e = t(&format!("endpoints = [\"127.0.0.1:1\"]\ntls_ca = \"{ca}\""));
    assert!(
        e.contains(":6:10: cluster[0].tls_ca: is set but no endpoint uses TLS"),
        "{e}"
    );

    let e = t(&format!(
        "endpoints = [\"https://127.0.0.1:1\"]\ntls_ca = \"{ca}\"\ntls_server_name = \"not a name\""
    ));
    assert!(
        e.contains("cluster[0].tls_server_name: `not a name` is not a DNS name or IP address"),
        "{e}"
    );

    let e = t("endpoints = [\"127.0.0.1:1\"]\nprotocol = \"auto\"");
    assert!(
        e.contains(":6:12: cluster[0].protocol: \"auto\" chooses by TLS ALPN"),
        "{e}"
    );
    let e = t("endpoints = [\"127.0.0.1:1\"]\nhttp2_keepalive_interval = \"5s\"");
    assert!(
        e.contains(":6:28: cluster[0].http2_keepalive_interval: has no effect"),
        "{e}"
    );
    let e = t("endpoints = [\"127.0.0.1:1\"]\nprotocol = \"h3\"");
    assert!(
        e.contains("cluster[0].protocol: `h3` is not an upstream protocol"),
        "{e}"
    );
    // A refused protocol is the field at fault: the pings that go with HTTP/2 are not
    // said to have no effect.
    let e =
        t("endpoints = [\"127.0.0.1:1\"]\nprotocol = \"HTTP2\"\nhttp2_keepalive_interval = \"5s\"");
    assert!(
        e.contains("cluster[0].protocol: `HTTP2` is not an upstream protocol"),
        "{e}"
    );
    assert!(!e.contains("http2_keepalive_interval"), "{e}");

    let e = t("endpoints = [\"ftp://127.0.0.1:1\"]");
    assert!(
        e.contains("cluster[0].endpoints[0]: `ftp://127.0.0.1:1` is not an address"),
        "{e}"
    );

    // Resolved addresses cannot say which name they came from: one name to verify.
    let e = t(&format!(
        "endpoints = [\"https://a.test:1\", \"https://b.test:1\"]\ntls_ca = \"{ca}\""
    ));
    assert!(
        e.contains(":5:13: cluster[0].endpoints: https:// endpoints of different host names"),
        "{e}"
    );
    assert!(e.contains("help: set tls_server_name"), "{e}");
    let ok = t(&format!(
        "endpoints = [\"https://a.test:1\", \"https://b.test:1\"]\ntls_ca = \"{ca}\"\ntls_server_name = \"api.test\""
    ));
    assert_eq!(ok, "");

    // Relative paths are relative to the config file; a good config has no errors.
    let ok = t(
        "endpoints = [\"https://127.0.0.1:1\", \"https://[::1]:2\"]\ntls_ca = \"ca.pem\"\ntls_client_cert = \"client.pem\"\ntls_client_key = \"client.key\"\ntls_server_name = \"upstream.test\"",
    );
    assert_eq!(ok, "");
}

/// The balancer's latency sample of a request that opened its connection counts from the
/// send: an upstream whose TLS handshake takes 300 ms and whose answers are at once is not
/// estimated at 300 ms (which steered traffic off it for as long as the estimate took to
/// decay, tens of seconds).
#[tokio::test]
async fn a_slow_handshake_is_not_in_the_balancers_latency_sample() {
    let pki = Pki::new();
    let acceptor = tokio_rustls::TlsAcceptor::from(server_config(&pki, &ServerOpts::default()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                tokio::time::sleep(std::time::Duration::from_millis(300)).await;
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let svc = hyper::service::service_fn(|_req| async {
                    Ok::<_, std::convert::Infallible>(http::Response::new(full("ok")))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), svc)
                    .await;
            });
        }
    });
    let gw = https_gateway(&pki, up, "");
    assert_eq!(get(gw.addr, "/").await.status(), 200);
    let pools = gw.gw.as_ref().unwrap().endpoint_pools();
    let estimate = pools
        .iter()
        .filter(|p| p.addr == up)
        .map(|p| p.load.latency_estimate())
        .max()
        .unwrap();
    assert!(
        estimate < std::time::Duration::from_millis(150),
        "estimated at {estimate:?}"
    );
}

/// `protocol = "http2"` over TLS to a server that chooses no protocol by ALPN (an
/// HTTP/1.1-only one): a `502` saying the TLS setup failed, counted as a failed handshake
/// and a connect failure, and no HTTP/2 preface sent. It got the preface, and every request
/// failed as an `upstream_reset`.
#[tokio::test]
async fn http2_over_tls_needs_the_server_to_choose_h2() {
    let pki = Pki::new();
    let (up, seen) = tls_ok_upstream(
        &pki,
        ServerOpts {
            alpn: &[],
            ..ServerOpts::default()
        },
    )
    .await;
    let gw = https_gateway(&pki, up, "protocol = \"http2\"");
    let resp = get(gw.addr, "/").await;
    assert_eq!(resp.status(), 502);
    assert_eq!(json(&resp)["error"], "upstream_tls_failed");
    assert_eq!(
        stat(&gw, |s| s.tls_handshake_failures.load(Ordering::Relaxed)),
        1
    );
    assert_eq!(stat(&gw, |s| s.connect_failures.load(Ordering::Relaxed)), 1);
    assert_eq!(stat(&gw, |s| s.h2_connections.load(Ordering::Relaxed)), 0);
    assert_eq!(seen.requests.load(Ordering::SeqCst), 0);
}
