//! In-process TLS upstreams for tests: an rcgen PKI written to a temp directory, and rustls
//! servers that record every handshake (kind, SNI, client certificate, ALPN).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use rustls::HandshakeKind;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;

use super::full;

/// Test certificates written to a fresh directory: a CA (`ca.pem`), a server certificate it
/// signed for `127.0.0.1`, `::1`, `upstream.test` and `svc.test` (`server.pem`, `server.key`), a second CA that
/// signed nothing the server has (`other-ca.pem`), a server certificate for a DNS name only
/// (`dns-only.pem`, `dns-only.key`), and a client CA with one client (`client-ca.pem`,
/// `client.pem`, `client.key`). The directory is removed when the `Pki` is dropped.
pub struct Pki {
    pub dir: PathBuf,
    _tmp: tempfile::TempDir,
}

pub fn ca(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
}

pub fn leaf(issuer: &CertifiedIssuer<'static, KeyPair>, names: &[&str]) -> (String, String) {
    let params =
        CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

impl Pki {
    pub fn new() -> Pki {
        let tmp = tempfile::Builder::new()
            .prefix("tailgate-uptls-")
            .tempdir()
            .unwrap();
        let dir = tmp.path().to_path_buf();
        let w = |name: &str, text: &str| std::fs::write(dir.join(name), text).unwrap();
        let server_ca = ca("tailgate test server CA");
        w("ca.pem", &server_ca.pem());
        let (cert, key) = leaf(
            &server_ca,
            &["127.0.0.1", "::1", "upstream.test", "svc.test"],
        );
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
        Pki { dir, _tmp: tmp }
    }

    pub fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    pub fn certs(&self, name: &str) -> Vec<CertificateDer<'static>> {
        CertificateDer::pem_file_iter(self.dir.join(name))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }

    pub fn key(&self, name: &str) -> PrivateKeyDer<'static> {
        PrivateKeyDer::from_pem_file(self.dir.join(name)).unwrap()
    }
}

/// One handshake a TLS upstream completed.
#[derive(Clone, Debug)]
pub struct Handshake {
    pub kind: HandshakeKind,
    pub sni: Option<String>,
    pub client_cert: bool,
    pub alpn: Option<Vec<u8>>,
}

/// What a TLS upstream saw.
#[derive(Clone, Default)]
pub struct Seen {
    /// TCP connections accepted.
    pub conns: Arc<AtomicUsize>,
    /// Handshakes completed, in order.
    pub handshakes: Arc<Mutex<Vec<Handshake>>>,
    pub failed_handshakes: Arc<AtomicUsize>,
    pub requests: Arc<AtomicUsize>,
}

impl Seen {
    pub fn kinds(&self) -> Vec<HandshakeKind> {
        self.handshakes
            .lock()
            .unwrap()
            .iter()
            .map(|h| h.kind)
            .collect()
    }
}

pub struct ServerOpts<'a> {
    pub cert: &'a str,
    pub key: &'a str,
    /// Require a client certificate signed by this CA file.
    pub client_ca: Option<&'a str>,
    pub alpn: &'a [&'a [u8]],
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

pub fn server_config(pki: &Pki, opts: &ServerOpts<'_>) -> Arc<rustls::ServerConfig> {
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
pub async fn tls_server<F, Fut>(
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
pub async fn tls_ok_upstream(pki: &Pki, opts: ServerOpts<'_>) -> (SocketAddr, Seen) {
    tls_ok_upstream_on("127.0.0.1:0", pki, opts).await
}

pub async fn tls_ok_upstream_on(bind: &str, pki: &Pki, opts: ServerOpts<'_>) -> (SocketAddr, Seen) {
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

/// A gateway with one catch-all route to the `https://` endpoint `up`, trusting the PKI's CA.
pub fn https_gateway(pki: &Pki, up: SocketAddr, cluster_extra: &str) -> super::TestGateway {
    super::TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"https://{up}\"]\ntls_ca = \"{}\"\n{cluster_extra}\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n",
        pki.path("ca.pem")
    ))
}
