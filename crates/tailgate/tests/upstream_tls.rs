//! TLS to upstreams (`https://` endpoints): verification against a CA and a name, client
//! certificates, session resumption on replacement connections, warm spares and retries over
//! TLS, and the config errors. The upstreams are in-process rustls servers with an rcgen CA;
//! behaviour is asserted on counters on both sides, never on timings.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use rustls::HandshakeKind;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tailgate::Config;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Test certificates written to a fresh directory: a CA (`ca.pem`), a server certificate it
/// signed for `127.0.0.1` and `upstream.test` (`server.pem`, `server.key`), a second CA that
/// signed nothing the server has (`other-ca.pem`), a server certificate for a DNS name only
/// (`dns-only.pem`, `dns-only.key`), and a client CA with one client (`client-ca.pem`,
/// `client.pem`, `client.key`).
struct Pki {
    dir: PathBuf,
}

fn ca(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
}

fn leaf(issuer: &CertifiedIssuer<'static, KeyPair>, names: &[&str]) -> (String, String) {
    let params =
        CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

impl Pki {
    fn new() -> Pki {
        let dir = std::env::temp_dir().join(format!(
            "tailgate-uptls-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let w = |name: &str, text: &str| std::fs::write(dir.join(name), text).unwrap();
        let server_ca = ca("tailgate test server CA");
        w("ca.pem", &server_ca.pem());
        let (cert, key) = leaf(&server_ca, &["127.0.0.1", "::1", "upstream.test"]);
        w("server.pem", &cert);
        w("server.key", &key);
        let (cert, key) = leaf(&server_ca, &["upstream.test"]);
        w("dns-only.pem", &cert);
        w("dns-only.key", &key);
        w("other-ca.pem", &ca("some other CA").pem());
        let client_ca = ca("tailgate test client CA");
        w("client-ca.pem", &client_ca.pem());
        let (cert, key) = leaf(&client_ca, &["gateway.test"]);
        w("client.pem", &cert);
        w("client.key", &key);
        Pki { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    fn certs(&self, name: &str) -> Vec<CertificateDer<'static>> {
        CertificateDer::pem_file_iter(self.dir.join(name))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }

    fn key(&self, name: &str) -> PrivateKeyDer<'static> {
        PrivateKeyDer::from_pem_file(self.dir.join(name)).unwrap()
    }
}

/// One handshake a TLS upstream completed.
#[derive(Clone, Debug)]
struct Handshake {
    kind: HandshakeKind,
    sni: Option<String>,
    client_cert: bool,
    alpn: Option<Vec<u8>>,
}

/// What a TLS upstream saw.
#[derive(Clone, Default)]
struct Seen {
    /// TCP connections accepted.
    conns: Arc<AtomicUsize>,
    /// Handshakes completed, in order.
    handshakes: Arc<Mutex<Vec<Handshake>>>,
    failed_handshakes: Arc<AtomicUsize>,
    requests: Arc<AtomicUsize>,
}

impl Seen {
    fn kinds(&self) -> Vec<HandshakeKind> {
        self.handshakes
            .lock()
            .unwrap()
            .iter()
            .map(|h| h.kind)
            .collect()
    }
}

struct ServerOpts<'a> {
    cert: &'a str,
    key: &'a str,
    /// Require a client certificate signed by this CA file.
    client_ca: Option<&'a str>,
    alpn: &'a [&'a [u8]],
}

impl Default for ServerOpts<'_> {
    fn default() -> Self {
        ServerOpts {
            cert: "server.pem",
            key: "server.key",
            client_ca: None,
            alpn: &[b"http/1.1"],
        }
    }
}

fn server_config(pki: &Pki, opts: &ServerOpts<'_>) -> Arc<rustls::ServerConfig> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap();
    let builder = match opts.client_ca {
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in pki.certs(ca) {
                roots.add(c).unwrap();
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            )
            .build()
            .unwrap();
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut cfg = builder
        .with_single_cert(pki.certs(opts.cert), pki.key(opts.key))
        .unwrap();
    cfg.alpn_protocols = opts.alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(cfg)
}

/// Accepts TLS on `bind`, records each handshake, then hands the stream to `serve`.
async fn tls_server<F, Fut>(
    bind: &str,
    pki: &Pki,
    opts: ServerOpts<'_>,
    serve: F,
) -> (SocketAddr, Seen)
where
    F: Fn(tokio_rustls::server::TlsStream<tokio::net::TcpStream>, Seen) -> Fut
        + Send
        + Sync
        + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let acceptor = tokio_rustls::TlsAcceptor::from(server_config(pki, &opts));
    let listener = TcpListener::bind(bind).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Seen::default();
    let s = seen.clone();
    let serve = Arc::new(serve);
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            s.conns.fetch_add(1, Ordering::SeqCst);
            let (acceptor, s, serve) = (acceptor.clone(), s.clone(), serve.clone());
            tokio::spawn(async move {
                let tls = match acceptor.accept(tcp).await {
                    Ok(tls) => tls,
                    Err(_) => {
                        s.failed_handshakes.fetch_add(1, Ordering::SeqCst);
                        return;
                    }
                };
                let c = tls.get_ref().1;
                s.handshakes.lock().unwrap().push(Handshake {
                    kind: c.handshake_kind().unwrap(),
                    sni: c.server_name().map(str::to_owned),
                    client_cert: c.peer_certificates().is_some_and(|p| !p.is_empty()),
                    alpn: c.alpn_protocol().map(<[u8]>::to_vec),
                });
                serve(tls, s).await;
            });
        }
    });
    (addr, seen)
}

/// An upstream over TLS answering 200 "ok" (HTTP/1.1, or HTTP/2 when ALPN picks it).
async fn tls_ok_upstream(pki: &Pki, opts: ServerOpts<'_>) -> (SocketAddr, Seen) {
    tls_ok_upstream_on("127.0.0.1:0", pki, opts).await
}

async fn tls_ok_upstream_on(bind: &str, pki: &Pki, opts: ServerOpts<'_>) -> (SocketAddr, Seen) {
    tls_server(bind, pki, opts, |tls, seen| async move {
        let svc = service_fn(move |_req| {
            seen.requests.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, std::convert::Infallible>(http::Response::new(full("ok"))) }
        });
        let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
            .serve_connection(TokioIo::new(tls), svc)
            .await;
    })
    .await
}

fn gateway(endpoints: &str, cluster_extra: &str) -> TestGateway {
    TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [{endpoints}]\n{cluster_extra}\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
    ))
}

fn https_gateway(pki: &Pki, up: SocketAddr, cluster_extra: &str) -> TestGateway {
    gateway(
        &format!("\"https://{up}\""),
        &format!("tls_ca = \"{}\"\n{cluster_extra}", pki.path("ca.pem")),
    )
}

fn stat(gw: &TestGateway, f: impl Fn(&tailgate::upstream::PoolStats) -> u64) -> u64 {
    gw.gw.as_ref().unwrap().pool_stat(f)
}

fn json(resp: &http::Response<bytes::Bytes>) -> serde_json::Value {
    serde_json::from_slice(resp.body()).unwrap()
}

async fn wait_for(what: &str, f: impl Fn() -> bool) {
    for _ in 0..500 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}");
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
    let message = body["message"].as_str().unwrap();
    assert!(
        message.contains("certificate") && message.contains("UnknownIssuer"),
        "{message}"
    );
    assert_eq!(stat(&gw, |s| s.connect_failures.load(Ordering::Relaxed)), 1);
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

/// The certificate must match `tls_server_name` (which is also the SNI); without it, the
/// endpoint's IP must be one of the certificate's IP SANs.
#[tokio::test]
async fn upstream_certificate_must_match_the_server_name() {
    let pki = Pki::new();
    let (up, seen) = tls_ok_upstream(&pki, ServerOpts::default()).await;

    let wrong = https_gateway(&pki, up, "tls_server_name = \"elsewhere.test\"");
    let resp = get(wrong.addr, "/").await;
    assert_eq!(resp.status(), 502);
    let message = json(&resp)["message"].as_str().unwrap().to_owned();
    assert!(
        message.contains("not valid for name \"elsewhere.test\""),
        "{message}"
    );
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
    assert_eq!(
        seen.conns.load(Ordering::SeqCst),
        5,
        "one connection per request"
    );
    assert_eq!(
        stat(&gw, |s| s.retired_max_requests.load(Ordering::Relaxed)),
        5
    );
    assert_eq!(
        stat(&gw, |s| s.tls_full_handshakes.load(Ordering::Relaxed)),
        1
    );
    assert_eq!(
        stat(&gw, |s| s.tls_resumed_handshakes.load(Ordering::Relaxed)),
        4
    );
    assert_eq!(
        seen.kinds(),
        [
            HandshakeKind::Full,
            HandshakeKind::Resumed,
            HandshakeKind::Resumed,
            HandshakeKind::Resumed,
            HandshakeKind::Resumed
        ]
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
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
            let mut chunk = [0u8; 4096];
            match tls.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let end = buf.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
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

/// `protocol = "auto"`: ALPN offers h2 and http/1.1; an h2 server gets one multiplexed
/// HTTP/2 connection that concurrent requests share.
#[tokio::test]
async fn auto_speaks_h2_over_tls_when_alpn_picks_it() {
    let pki = Pki::new();
    let (up, seen) = tls_ok_upstream(
        &pki,
        ServerOpts {
            alpn: &[b"h2", b"http/1.1"],
            ..ServerOpts::default()
        },
    )
    .await;
    let gw = https_gateway(&pki, up, "protocol = \"auto\"");
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
    let pki = Pki::new();
    let (up, seen) = tls_ok_upstream(&pki, ServerOpts::default()).await;
    let gw = https_gateway(&pki, up, "protocol = \"auto\"");
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
    let pki = Pki::new();
    let (up, seen) = tls_ok_upstream(
        &pki,
        ServerOpts {
            alpn: &[b"h2", b"http/1.1"],
            ..ServerOpts::default()
        },
    )
    .await;
    let gw = https_gateway(
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
    assert_eq!(hs[0].kind, HandshakeKind::Full);
    assert_eq!(hs[1].kind, HandshakeKind::Resumed);
    assert_eq!(
        stat(&gw, |s| s.tls_resumed_handshakes.load(Ordering::Relaxed)),
        1
    );
    assert_eq!(seen.requests.load(Ordering::SeqCst), 4);
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
    let e = t("endpoints = [\"127.0.0.1:1\"]\nprotocol = \"h3\"");
    assert!(
        e.contains("cluster[0].protocol: `h3` is not an upstream protocol"),
        "{e}"
    );

    let e = t("endpoints = [\"ftp://127.0.0.1:1\"]");
    assert!(
        e.contains("cluster[0].endpoints[0]: `ftp://127.0.0.1:1` is not an endpoint address"),
        "{e}"
    );

    // Relative paths are relative to the config file; a good config has no errors.
    let ok = t(
        "endpoints = [\"https://127.0.0.1:1\", \"https://[::1]:2\"]\ntls_ca = \"ca.pem\"\ntls_client_cert = \"client.pem\"\ntls_client_key = \"client.key\"\ntls_server_name = \"upstream.test\"",
    );
    assert_eq!(ok, "");
}
