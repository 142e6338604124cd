//! `tailgate bench run https://...` against an in-test TLS server (self-signed certificate from
//! rcgen) that speaks HTTP/1.1 or HTTP/2 as ALPN decides.

#![allow(clippy::unwrap_used)]

mod common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::{bench, run_limited, serve_on_thread};
use http_body_util::Full;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
use serde_json::Value;

#[derive(Default)]
struct Seen {
    h1: AtomicU64,
    h2: AtomicU64,
    /// TLS handshakes the server saw fail (e.g. the client rejected the certificate).
    failed_handshakes: AtomicU64,
}

/// A TLS server with a self-signed certificate for `localhost`, offering ALPN `h2` and
/// `http/1.1`; it counts requests by HTTP version.
fn tls_server() -> (SocketAddr, Arc<Seen>) {
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der()));
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![ck.cert.der().clone()], key)
        .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let seen = Arc::new(Seen::default());
    let counters = seen.clone();
    let addr = serve_on_thread(move |l| async move {
        loop {
            let (tcp, _) = l.accept().await.unwrap();
            let (acceptor, seen) = (acceptor.clone(), counters.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    seen.failed_handshakes.fetch_add(1, Ordering::SeqCst);
                    return;
                };
                let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
                let svc =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let c = match req.version() {
                            http::Version::HTTP_2 => &seen.h2,
                            _ => &seen.h1,
                        };
                        c.fetch_add(1, Ordering::SeqCst);
                        async {
                            Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::from_static(
                                b"hello tls",
                            ))))
                        }
                    });
                let io = TokioIo::new(tls);
                if h2 {
                    let _ = http2::Builder::new(TokioExecutor::new())
                        .serve_connection(io, svc)
                        .await;
                } else {
                    let _ = http1::Builder::new().serve_connection(io, svc).await;
                }
            });
        }
    });
    (addr, seen)
}

fn run_json(url: &str, extra: &[&str]) -> Value {
    let mut cmd = bench();
    cmd.args([
        "run", url, "--closed", "-c", "2", "-n", "50", "--warmup", "0s", "--json",
    ])
    .args(extra);
    let out = run_limited(cmd, Duration::from_secs(30));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    // A run in which nothing succeeded exits 1.
    let code = if v["ok"] == 0 { 1 } else { 0 };
    assert_eq!(
        out.status.code(),
        Some(code),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    v
}

#[test]
fn https_over_http1_with_insecure() {
    let (addr, seen) = tls_server();
    let v = run_json(&format!("https://{addr}/"), &["--insecure"]);
    assert_eq!(v["ok"], 50, "{v}");
    assert_eq!(v["error_total"], 0, "{v}");
    assert_eq!(seen.h1.load(Ordering::SeqCst), 50);
    assert_eq!(seen.h2.load(Ordering::SeqCst), 0);
}

#[test]
fn https_over_h2_by_alpn_with_insecure() {
    let (addr, seen) = tls_server();
    let v = run_json(&format!("https://{addr}/"), &["--insecure", "--h2"]);
    assert_eq!(v["ok"], 50, "{v}");
    assert_eq!(v["error_total"], 0, "{v}");
    assert_eq!(seen.h2.load(Ordering::SeqCst), 50);
    assert_eq!(seen.h1.load(Ordering::SeqCst), 0);
}

/// Without `--insecure` a self-signed certificate is rejected: every attempt is a TLS error
/// (its own kind, not a generic connect error), the reason is reported, and the run ends.
#[test]
fn untrusted_certificate_is_a_tls_error_with_the_reason() {
    let (addr, seen) = tls_server();
    let url = format!("https://{addr}/");
    for extra in [&[][..], &["--h2"][..]] {
        let v = run_json(&url, extra);
        assert_eq!(v["ok"], 0, "{v}");
        assert_eq!(v["errors"]["tls"], 50, "{v}");
        assert_eq!(v["error_total"], 50, "{v}");
        let why = v["tls_error"].as_str().unwrap();
        assert!(why.contains("certificate"), "{why}");
    }
    assert_eq!(seen.h1.load(Ordering::SeqCst), 0);
    assert_eq!(seen.h2.load(Ordering::SeqCst), 0);
    assert!(seen.failed_handshakes.load(Ordering::SeqCst) > 0);

    // The human report says why too.
    let mut cmd = bench();
    cmd.args(["run", &url, "--closed", "-n", "5", "--warmup", "0s"]);
    let out = run_limited(cmd, Duration::from_secs(30));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("tls 5"), "{text}");
    assert!(
        text.contains("TLS handshake failed: invalid peer certificate"),
        "{text}"
    );
}
