//! TLS (ALPN h2 and http/1.1, SNI tenants), WebSocket pass-through, tenant classification
//! and graceful drain.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A self-signed certificate and its key in a directory removed on drop.
struct TestCert {
    dir: tempfile::TempDir,
    der: rustls::pki_types::CertificateDer<'static>,
}

fn test_cert(names: &[&str]) -> TestCert {
    let ck =
        rcgen::generate_simple_self_signed(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .unwrap();
    let dir = tempfile::Builder::new()
        .prefix("tailgate-tls-")
        .tempdir()
        .unwrap();
    std::fs::write(dir.path().join("cert.pem"), ck.cert.pem()).unwrap();
    std::fs::write(dir.path().join("key.pem"), ck.signing_key.serialize_pem()).unwrap();
    TestCert {
        dir,
        der: ck.cert.der().clone(),
    }
}

async fn tls_connect(
    addr: std::net::SocketAddr,
    cert: &TestCert,
    sni: &str,
    alpn: &[&[u8]],
) -> tokio_rustls::client::TlsStream<TcpStream> {
    tls_connect_over(TcpStream::connect(addr).await.unwrap(), cert, sni, alpn).await
}

/// A client that trusts `cert` and offers `alpn`; each has its own session store.
fn connector(cert: &TestCert, alpn: &[&[u8]]) -> tokio_rustls::TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.der.clone()).unwrap();
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    tokio_rustls::TlsConnector::from(Arc::new(cfg))
}

/// Writes `bytes` on `tls` and reads what comes back until the end of the stream (5 s at
/// most).
async fn tls_exchange(
    tls: &mut tokio_rustls::client::TlsStream<TcpStream>,
    bytes: &[u8],
) -> String {
    tls.write_all(bytes).await.unwrap();
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), tls.read_to_end(&mut got)).await;
    String::from_utf8_lossy(&got).into_owned()
}

/// [`tls_connect`] over a TCP connection already made.
async fn tls_connect_over(
    tcp: TcpStream,
    cert: &TestCert,
    sni: &str,
    alpn: &[&[u8]],
) -> tokio_rustls::client::TlsStream<TcpStream> {
    connector(cert, alpn)
        .connect(
            rustls::pki_types::ServerName::try_from(sni.to_owned()).unwrap(),
            tcp,
        )
        .await
        .unwrap()
}

/// One HTTP/1.1 GET over a TLS connection made with `sni`, carrying `host`.
async fn tls_h1_get(
    addr: std::net::SocketAddr,
    cert: &TestCert,
    sni: &str,
    path: &str,
    host: &str,
) -> http::Response<hyper::body::Incoming> {
    tls_h1_get_over(
        TcpStream::connect(addr).await.unwrap(),
        cert,
        sni,
        path,
        host,
    )
    .await
}

/// [`tls_h1_get`] over a connection already made.
async fn tls_h1_get_over(
    tcp: TcpStream,
    cert: &TestCert,
    sni: &str,
    path: &str,
    host: &str,
) -> http::Response<hyper::body::Incoming> {
    let tls = tls_connect_over(tcp, cert, sni, &[b"http/1.1"]).await;
    let (mut c, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(conn);
    c.send_request(
        http::Request::get(path)
            .header("host", host)
            .body(full(""))
            .unwrap(),
    )
    .await
    .unwrap()
}

fn tls_gateway(cert: &TestCert, up: std::net::SocketAddr) -> TestGateway {
    tls_gateway_with(cert, up, "")
}

/// [`tls_gateway`] with `extra` before its tables (e.g. a `[server]` table).
fn tls_gateway_with(cert: &TestCert, up: std::net::SocketAddr, extra: &str) -> TestGateway {
    TestGateway::start(&format!(
        r#"{extra}
[[listener]]
name = "tls"
address = "127.0.0.1:0"
[listener.tls]
cert = "{dir}/cert.pem"
key = "{dir}/key.pem"
[[tenant]]
name = "acme"
hosts = ["acme.test"]
[[tenant]]
name = "globex"
hosts = ["globex.test"]
[[cluster]]
name = "up"
endpoints = ["{up}"]
[[route]]
tenant = "acme"
path_prefix = "/"
cluster = "up"
"#,
        dir = cert.dir.path().display()
    ))
}

/// A TLS client that sends nothing, or half a ClientHello, is cut off after
/// `header_read_timeout` (the handshake is timed as a request head is: slowloris).
#[tokio::test]
async fn a_stalled_tls_handshake_is_cut_off() {
    let cert = test_cert(&["acme.test"]);
    let up = echo_upstream().await;
    let gw = tls_gateway_with(&cert, up, "[server]\nheader_read_timeout = \"400ms\"\n");
    for sent in [&b""[..], &[0x16, 0x03, 0x01, 0x00, 0xc8][..]] {
        let mut s = TcpStream::connect(gw.addr).await.unwrap();
        s.write_all(sent).await.unwrap();
        let (_, closed) = read_until_close(&mut s, Duration::from_secs(5)).await;
        assert!(closed, "a handshake stalled after {sent:?} is cut off");
    }
}

/// The accept loop only accepts: clients that stall before or in their TLS handshake (here
/// for up to 10 s) hold nobody else up; a client behind them is served.
#[tokio::test]
async fn stalled_handshakes_hold_up_no_other_client() {
    let cert = test_cert(&["acme.test"]);
    let up = echo_upstream().await;
    let gw = tls_gateway_with(
        &cert,
        up,
        "[server]\nworkers = 1\nheader_read_timeout = \"10s\"\n",
    );
    let mut stalled = Vec::new();
    for sent in [&b""[..], &[0x16, 0x03, 0x01, 0x00, 0xc8][..]] {
        let mut s = TcpStream::connect(gw.addr).await.unwrap();
        s.write_all(sent).await.unwrap();
        stalled.push(s);
    }
    let resp = tokio::time::timeout(
        Duration::from_secs(5),
        tls_h1_get(gw.addr, &cert, "acme.test", "/x", "acme.test"),
    )
    .await
    .expect("served while two handshakes stall");
    assert_eq!(resp.status(), 200);
    drop(stalled);
}

/// At `server.max_connections`, a TLS connection that has sent nothing yet (not even its
/// hello) makes room, as a plain silent one does: a client holding the cap's worth of
/// them keeps no one else out for the handshake timeout. One whose hello has begun is
/// spared.
#[tokio::test]
async fn at_max_connections_silent_tls_connections_make_room() {
    let cert = test_cert(&["acme.test"]);
    let up = echo_upstream().await;
    let gw = tls_gateway_with(
        &cert,
        up,
        "[server]\nworkers = 1\nmax_connections = 2\nheader_read_timeout = \"30s\"\n",
    );
    let silent = TcpStream::connect(gw.addr).await.unwrap();
    let mut begun = TcpStream::connect(gw.addr).await.unwrap();
    begun.write_all(&[0x16]).await.unwrap();
    // Accepted (the one worker takes its queue in order) before the next comes.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let resp = tokio::time::timeout(
        Duration::from_secs(10),
        tls_h1_get(gw.addr, &cert, "acme.test", "/x", "acme.test"),
    )
    .await
    .expect("served long before the 30 s handshake timeout");
    assert_eq!(resp.status(), 200);
    let closed = |mut s: TcpStream| async move {
        let mut buf = [0u8; 64];
        matches!(
            tokio::time::timeout(Duration::from_millis(500), s.read(&mut buf)).await,
            Ok(Ok(0) | Err(_))
        )
    };
    assert!(closed(silent).await, "the silent one made room");
    assert!(!closed(begun).await, "the one whose hello began is spared");
}

#[tokio::test]
async fn tls_h2_by_alpn() {
    let cert = test_cert(&["acme.test"]);
    let up = echo_upstream().await;
    let gw = tls_gateway(&cert, up);
    let tls = tls_connect(gw.addr, &cert, "acme.test", &[b"h2", b"http/1.1"]).await;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (mut c, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        TokioIo::new(tls),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let resp = c
        .send_request(
            http::Request::get("https://acme.test/x")
                .body(full(""))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(resp.headers()["x-echo-x-forwarded-proto"], "https");
}

#[tokio::test]
async fn tls_http1_by_alpn() {
    let cert = test_cert(&["acme.test"]);
    let up = echo_upstream().await;
    let gw = tls_gateway(&cert, up);
    let resp = tls_h1_get(gw.addr, &cert, "acme.test", "/x", "acme.test").await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.version(), http::Version::HTTP_11);
    assert_eq!(resp.headers()["x-echo-x-forwarded-proto"], "https");
}

/// A client that offers only `http/1.0` by ALPN is served (as nginx serves it); it failed
/// the handshake, the server's list (`h2`, `http/1.1`) sharing nothing with it.
#[tokio::test]
async fn tls_http10_by_alpn() {
    let cert = test_cert(&["acme.test"]);
    let up = echo_upstream().await;
    let gw = tls_gateway(&cert, up);
    let mut tls = tls_connect(gw.addr, &cert, "acme.test", &[b"http/1.0"]).await;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.0"[..]));
    let text = tls_exchange(&mut tls, b"GET /x HTTP/1.0\r\nHost: acme.test\r\n\r\n").await;
    assert!(text.starts_with("HTTP/1.1 200 "), "{text}");
}

/// A connection that agreed on `http/1.1` by ALPN speaks HTTP/1 only (RFC 9113 §3.3): the
/// HTTP/2 preface on it is a malformed HTTP/1.1 request (`400`), not HTTP/2. It was
/// answered with HTTP/2's SETTINGS.
#[tokio::test]
async fn no_http2_after_alpn_agreed_on_http1() {
    let cert = test_cert(&["acme.test"]);
    let up = echo_upstream().await;
    let gw = tls_gateway(&cert, up);
    let mut tls = tls_connect(gw.addr, &cert, "acme.test", &[b"http/1.1"]).await;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    // The preface and an empty SETTINGS frame.
    let text = tls_exchange(
        &mut tls,
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0",
    )
    .await;
    assert!(text.starts_with("HTTP/1.1 4"), "{text:?}");
}

/// A certificate file with no certificate in it is named as such (rustls says "peer sent
/// no certificates" of an empty chain).
#[test]
fn a_certificate_file_without_a_certificate_is_named() {
    let cert = test_cert(&["acme.test"]);
    let der = cert.dir.path().join("cert.der");
    std::fs::write(&der, cert.der.as_ref()).unwrap();
    let text = format!(
        "[[listener]]\naddress = \"127.0.0.1:0\"\n[listener.tls]\ncert = \"{}\"\nkey = \"{}/key.pem\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"127.0.0.1:1\"]\n",
        der.display(),
        cert.dir.path().display()
    );
    let err = tailgate::config::Config::parse(std::path::Path::new("t.toml"), &text)
        .expect_err("no certificate")
        .to_string();
    assert!(err.contains("no certificate in "), "{err}");
    assert!(err.contains("t.toml:4:"), "{err}");
}

/// A returning client resumes its TLS session (no full handshake) however many clients
/// came between: sessions are stateless tickets. With rustls's default cache of 256
/// sessions, 2 stored per handshake, a client was forgotten after about 128 others.
#[tokio::test]
async fn a_returning_client_resumes_after_many_others() {
    let cert = test_cert(&["acme.test"]);
    let up = echo_upstream().await;
    let gw = tls_gateway(&cert, up);
    let config = |cert: &TestCert| connector(cert, &[b"http/1.1"]);
    // One request per connection: the tickets come after the handshake, and are read
    // with the answer.
    let visit = |connector: tokio_rustls::TlsConnector| async move {
        let tcp = TcpStream::connect(gw.addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("acme.test").unwrap();
        let mut tls = connector.connect(name, tcp).await.unwrap();
        let kind = tls.get_ref().1.handshake_kind();
        let text = tls_exchange(
            &mut tls,
            b"GET /x HTTP/1.1\r\nHost: acme.test\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(text.starts_with("HTTP/1.1 200 "), "{text}");
        kind
    };
    let first = config(&cert);
    assert_eq!(
        visit(first.clone()).await,
        Some(rustls::HandshakeKind::Full)
    );
    for _ in 0..300 {
        visit(config(&cert)).await;
    }
    assert_eq!(
        visit(first).await,
        Some(rustls::HandshakeKind::Resumed),
        "the first client had to make a full handshake again"
    );
}

/// Client handshakes are counted by how they ended: full, resumed by a ticket, failed
/// (a client that refuses the certificate, one that speaks plain HTTP) and timed out (a
/// hello that stops); a connection closed before any byte is no handshake.
#[tokio::test]
async fn tls_handshakes_are_counted_by_result() {
    let cert = test_cert(&["acme.test"]);
    let up = echo_upstream().await;
    let gw = tls_gateway_with(
        &cert,
        up,
        "[server]\nworkers = 1\nshutdown_grace = \"5s\"\nheader_read_timeout = \"300ms\"\n[admin]\naddress = \"127.0.0.1:0\"\n",
    );
    let addr = gw.addr;
    let visit = |connector: tokio_rustls::TlsConnector| async move {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("acme.test").unwrap();
        let mut tls = connector.connect(name, tcp).await.unwrap();
        let text = tls_exchange(
            &mut tls,
            b"GET /x HTTP/1.1\r\nHost: acme.test\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(text.starts_with("HTTP/1.1 200 "), "{text}");
    };
    let client = connector(&cert, &[b"http/1.1"]);
    visit(client.clone()).await;
    visit(client).await;
    // A client that trusts another certificate ends the handshake with an alert.
    let stranger = connector(&test_cert(&["acme.test"]), &[b"http/1.1"]);
    let tcp = TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("acme.test").unwrap();
    assert!(stranger.connect(name, tcp).await.is_err());
    let (text, _) = raw(
        addr,
        b"GET / HTTP/1.1\r\nHost: a\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(!text.starts_with("HTTP/1.1 200"), "{text}");
    let mut stalled = TcpStream::connect(addr).await.unwrap();
    stalled.write_all(&[0x16, 3, 1]).await.unwrap();
    // Closed, reset, or silent past the timeout before any byte: no handshake.
    drop(TcpStream::connect(addr).await.unwrap());
    let reset = TcpStream::connect(addr).await.unwrap();
    socket2::SockRef::from(&reset)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(reset);
    let _silent = TcpStream::connect(addr).await.unwrap();
    let admin = gw.gw.as_ref().unwrap().admin_addr().unwrap();
    let want = [
        ("full", 1.0),
        ("resumed", 1.0),
        ("failed", 2.0),
        ("timed_out", 1.0),
    ];
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let text = String::from_utf8(get(admin, "/metrics").await.body().to_vec()).unwrap();
        let ex = prom::parse(&text, false).unwrap();
        let got: Vec<(&str, f64)> = want
            .iter()
            .map(|(r, _)| {
                (
                    *r,
                    ex.value("tailgate_downstream_tls_handshakes_total", &[("result", r)]),
                )
            })
            .collect();
        if got == want {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{got:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Past the silent one's timeout too, the counts stay.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let text = String::from_utf8(get(admin, "/metrics").await.body().to_vec()).unwrap();
    let ex = prom::parse(&text, false).unwrap();
    for (r, n) in want {
        assert_eq!(
            ex.value("tailgate_downstream_tls_handshakes_total", &[("result", r)]),
            n,
            "{r}"
        );
    }
}

/// The SNI names the tenant even when the Host header names no tenant.
#[tokio::test]
async fn sni_classifies_the_tenant() {
    let cert = test_cert(&["acme.test", "globex.test"]);
    let up = echo_upstream().await;
    let gw = tls_gateway(&cert, up);
    // SNI acme.test, Host unknown: routed by the connection's tenant.
    let resp = tls_h1_get(gw.addr, &cert, "acme.test", "/", "10.1.2.3").await;
    assert_eq!(resp.status(), 200);
    // SNI globex.test: globex has no routes.
    let resp = tls_h1_get(gw.addr, &cert, "globex.test", "/", "10.1.2.3").await;
    assert_eq!(resp.status(), 404);
    // SNI globex.test, Host acme.test: the connection serves globex only.
    let resp = tls_h1_get(gw.addr, &cert, "globex.test", "/", "acme.test").await;
    assert_eq!(resp.status(), 421);
}

/// A TLS connection whose server name names a tenant counts as that tenant's open
/// connection (`tailgate_tenant_connections`), as one on a tenant's listener does.
#[tokio::test]
async fn a_connection_classified_by_sni_counts_as_its_tenants() {
    let cert = test_cert(&["acme.test", "globex.test"]);
    let up = echo_upstream().await;
    let gw = tls_gateway_with(&cert, up, "[admin]\naddress = \"127.0.0.1:0\"\n");
    let mut tls = tls_connect(gw.addr, &cert, "acme.test", &[b"http/1.1"]).await;
    tls.write_all(b"GET / HTTP/1.1\r\nHost: acme.test\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 512];
    let n = tokio::time::timeout(Duration::from_secs(5), tls.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);
    let admin = gw.gw.as_ref().unwrap().admin_addr().unwrap();
    let text = String::from_utf8(get(admin, "/metrics").await.body().to_vec()).unwrap();
    let ex = common::prom::parse(&text, false).unwrap();
    assert_eq!(
        ex.value("tailgate_tenant_connections", &[("tenant", "acme")]),
        1.0
    );
    assert_eq!(
        ex.value("tailgate_tenant_connections", &[("tenant", "globex")]),
        0.0
    );
    drop(tls);
}

#[tokio::test]
async fn listener_and_host_classify_the_tenant() {
    let a = upstream(|_| async { http::Response::new(full("acme")) }).await;
    let g = upstream(|_| async { http::Response::new(full("globex")) }).await;
    let gw = TestGateway::start(&format!(
        r#"
[[listener]]
name = "shared"
address = "127.0.0.1:0"
[[listener]]
name = "globex-only"
address = "127.0.0.1:0"
tenant = "globex"
[[tenant]]
name = "acme"
hosts = ["acme.test", "*.acme.test"]
[[tenant]]
name = "globex"
hosts = ["globex.test"]
[[cluster]]
name = "a"
endpoints = ["{a}"]
[[cluster]]
name = "g"
endpoints = ["{g}"]
[[route]]
tenant = "acme"
path_prefix = "/"
cluster = "a"
[[route]]
tenant = "globex"
path_prefix = "/"
cluster = "g"
"#
    ));
    let gwh = gw.gw.as_ref().unwrap();
    let shared = gwh.listener_addr("shared").unwrap();
    let globex_only = gwh.listener_addr("globex-only").unwrap();
    let body = |host: &'static str, addr| async move {
        let mut c = h1_client(addr).await;
        let r = c
            .send_request(
                http::Request::get("/")
                    .header("host", host)
                    .body(full(""))
                    .unwrap(),
            )
            .await
            .unwrap();
        (
            r.status(),
            r.into_body().collect().await.unwrap().to_bytes(),
        )
    };
    assert_eq!(body("eu.acme.test", shared).await.1, "acme");
    assert_eq!(body("globex.test:80", shared).await.1, "globex");
    assert_eq!(body("unknown.test", shared).await.0, 404);
    assert_eq!(body("unknown.test", globex_only).await.1, "globex");
    // A listener's tenant is the only one it serves: another tenant's Host is misdirected.
    assert_eq!(body("acme.test", globex_only).await.0, 421);
    assert_eq!(body("globex.test", globex_only).await.1, "globex");
}

#[tokio::test]
async fn websocket_upgrade_is_passed_through() {
    // An upstream that accepts the upgrade and echoes whatever comes after it.
    let up = upstream(|mut req: http::Request<hyper::body::Incoming>| async move {
        assert_eq!(req.headers()["upgrade"], "websocket");
        websocket_echo(&mut req)
    })
    .await;
    let gw = TestGateway::to(up, "");
    let (mut s, head) = ws_open(gw.addr).await;
    let head = head.to_ascii_lowercase();
    assert!(head.contains("upgrade: websocket"), "{head}");
    assert!(head.contains("sec-websocket-accept"), "{head}");
    // Frames pass both ways, byte for byte.
    assert_frame_echoed(&mut s).await;
}

/// An `Upgrade` in an HTTP/1.0 request is ignored (RFC 9110 §7.8: a server MUST): it goes
/// upstream as a plain request without `Upgrade`, and the client gets that answer, not a
/// `101` with no tunnel behind it.
#[tokio::test]
async fn an_upgrade_in_an_http10_request_is_ignored() {
    let up = ws_or_ok_upstream().await;
    let gw = TestGateway::to(up, "");
    let (text, closed) = common::raw(
        gw.addr,
        b"GET /ws HTTP/1.0\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(text.starts_with("HTTP/1.0 200"), "{text}");
    assert!(text.ends_with("\r\n\r\nok"), "{text}");
    assert!(!text.to_ascii_lowercase().contains("upgrade"), "{text}");
    assert!(closed, "{text}");
}

/// A WebSocket handshake that is the last request `max_requests_per_connection` allows is
/// still a handshake: its `101` keeps `Connection: upgrade`, and the tunnel works.
#[tokio::test]
async fn a_websocket_upgrade_as_the_last_request_of_a_connection_works() {
    let up = upstream(|mut req: http::Request<hyper::body::Incoming>| async move {
        websocket_echo(&mut req)
    })
    .await;
    let gw = TestGateway::to(up, "[server]\nmax_requests_per_connection = 1\n");
    let (mut s, head) = ws_open(gw.addr).await;
    let head = head.to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 101"), "{head}");
    assert!(head.contains("connection: upgrade"), "{head}");
    assert_frame_echoed(&mut s).await;
}

/// A WebSocket holds its connection's place under `server.max_connections` for as long as
/// the tunnel lives, not only until the upgrade: at a cap of one, another client waits until
/// it closes.
#[tokio::test]
async fn a_websocket_tunnel_counts_under_max_connections() {
    let up = ws_or_ok_upstream().await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\nmax_connections = 1\n");
    let (ws, _) = ws_open(gw.addr).await;
    // The upgrade is done and its connection's task has ended: the tunnel still counts.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let state = gw.gw.as_ref().unwrap().admin_state().clone();
    assert_eq!(
        state.workers[0].shared.connections.open(),
        1,
        "the tunnel counts"
    );
    let mut other = TcpStream::connect(gw.addr).await.unwrap();
    other
        .write_all(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 256];
    let early = tokio::time::timeout(Duration::from_millis(400), other.read(&mut buf)).await;
    assert!(early.is_err(), "served past the cap while a tunnel is open");
    // Still held in the listen queue: the count never passed the cap.
    assert_eq!(state.workers[0].shared.connections.open(), 1);
    drop(ws);
    let n = tokio::time::timeout(Duration::from_secs(5), other.read(&mut buf))
        .await
        .expect("served once the tunnel closed")
        .unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
}

/// A WebSocket tunnel keeps its upstream connection's place under the cluster's
/// `max_connections_per_endpoint` until it closes: at a cap of one, a request meanwhile
/// queues (and, past the connect timeout, gets 503), and one after it goes through.
#[tokio::test]
async fn a_websocket_tunnel_keeps_its_place_under_max_connections_per_endpoint() {
    let up = ws_or_ok_upstream().await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\nmax_connections_per_endpoint = 1\nconnect_timeout = \"300ms\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
    ));
    let (ws, _) = ws_open(gw.addr).await;
    let (text, _) = common::raw(
        gw.addr,
        b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(text.starts_with("HTTP/1.1 503"), "{text}");
    assert!(text.contains("upstream_queue_timeout"), "{text}");
    drop(ws);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (text, _) = common::raw(
            gw.addr,
            b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
            Duration::from_secs(5),
        )
        .await;
        if text.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the tunnel's place never came back: {text}"
        );
    }
}

/// An upstream that accepts WebSocket upgrades (and echoes) and answers other requests
/// `ok`.
async fn ws_or_ok_upstream() -> std::net::SocketAddr {
    upstream(|mut req: http::Request<hyper::body::Incoming>| async move {
        if req.headers().contains_key("upgrade") {
            websocket_echo(&mut req)
        } else {
            http::Response::new(full("ok"))
        }
    })
    .await
}

/// A masked text frame sent into the tunnel `s` comes back byte for byte.
async fn assert_frame_echoed(s: &mut TcpStream) {
    let frame = b"\x81\x85\x37\xfa\x21\x3d\x7f\x9f\x4d\x51\x58";
    s.write_all(frame).await.unwrap();
    let mut echoed = Vec::new();
    let mut buf = vec![0u8; 256];
    while echoed.len() < frame.len() {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "the tunnel closed");
        echoed.extend_from_slice(&buf[..n]);
    }
    assert_eq!(echoed, frame);
}

/// An upstream that ends its side of a tunnel first (a half-close) still gets every byte
/// the client sends after, in order. The end of stream passed on to the client used to
/// start the connection's lingering close, which read out and dropped the client's bytes
/// while the tunnel's other direction waited for the upstream to take them.
#[tokio::test]
async fn a_tunnel_half_closed_by_its_upstream_carries_the_clients_bytes_whole() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = listener.local_addr().unwrap();
    let (got_tx, got_rx) = tokio::sync::oneshot::channel::<Vec<u8>>();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut head = Vec::new();
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0);
            head.extend_from_slice(&buf[..n]);
        }
        s.write_all(
            b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: raw\r\n\r\n",
        )
        .await
        .unwrap();
        s.shutdown().await.unwrap();
        // Not reading a while: the gateway's writes of the client's bytes back up.
        tokio::time::sleep(Duration::from_millis(800)).await;
        let mut got = Vec::new();
        s.read_to_end(&mut got).await.unwrap();
        let _ = got_tx.send(got);
    });
    let gw = TestGateway::to(up, "");
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"GET /t HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: raw\r\n\r\n")
        .await
        .unwrap();
    let mut from_gw = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut from_gw))
        .await
        .expect("the upstream's end of stream is passed on")
        .unwrap();
    let text = String::from_utf8_lossy(&from_gw);
    assert!(text.starts_with("HTTP/1.1 101"), "{text}");
    assert!(text.ends_with("\r\n\r\n"), "{text}");
    let data: Vec<u8> = (0..16 * 1024 * 1024).map(|i| (i % 251) as u8).collect();
    s.write_all(&data).await.unwrap();
    s.shutdown().await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(20), got_rx)
        .await
        .expect("the upstream read to its end")
        .unwrap();
    assert_eq!(got.len(), data.len(), "bytes lost on the way up");
    assert!(got == data, "the bytes came up out of order");
}

/// A tunnel with no bytes either way for the server's `idle_timeout` is closed (its client
/// may have vanished without a FIN); one with traffic stays up however long it lives.
#[tokio::test]
async fn a_silent_websocket_tunnel_is_closed_after_the_idle_timeout() {
    let up = upstream(|mut req: http::Request<hyper::body::Incoming>| async move {
        websocket_echo(&mut req)
    })
    .await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\nidle_timeout = \"2s\"\n");
    let (mut s, _) = ws_open(gw.addr).await;
    let mut buf = vec![0u8; 64];
    // A frame every 200 ms for 4.4 s: more than two idle timeouts, never idle for one (a
    // pause of the test's own of over 1.5 s would be needed to pass for one).
    for i in 0..22u8 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        s.write_all(&[0x81, 0x01, i]).await.unwrap();
        let mut echoed = Vec::new();
        while echoed.len() < 3 {
            let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
                .await
                .unwrap()
                .unwrap();
            assert!(n > 0, "the busy tunnel was closed");
            echoed.extend_from_slice(&buf[..n]);
        }
        assert_eq!(echoed, [0x81, 0x01, i]);
    }
    // Then silence: closed within a few idle timeouts.
    let started = std::time::Instant::now();
    let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
        .await
        .expect("the silent tunnel is closed")
        .unwrap_or(0);
    assert_eq!(n, 0);
    assert!(started.elapsed() >= Duration::from_secs(1));
}

/// An upstream that answers `finished` 700 ms after each request comes, and tells when one
/// came.
async fn slow_upstream_telling_its_start() -> (std::net::SocketAddr, tokio::sync::mpsc::Receiver<()>)
{
    let (started_tx, started_rx) = tokio::sync::mpsc::channel::<()>(1);
    let up = upstream(move |_| {
        let started = started_tx.clone();
        async move {
            started.send(()).await.ok();
            tokio::time::sleep(Duration::from_millis(700)).await;
            http::Response::new(full("finished"))
        }
    })
    .await;
    (up, started_rx)
}

/// A request in flight when shutdown starts completes; new connections are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_drain_finishes_in_flight_requests() {
    // The upstream answers only when the test says: the request stays in flight for as
    // long as the checks take, however slow the machine.
    let mut up = held_upstream().await;
    let mut gw = TestGateway::to(up.addr, "");
    let addr = gw.addr;
    let in_flight = tokio::spawn(async move { get(addr, "/slow").await });
    up.arrived.recv().await.unwrap();
    let drained = drain(&mut gw);
    // While that request is still on its way, a new connection is not served (once the
    // listener has closed, which the drain does at once).
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while TcpStream::connect(addr).await.is_ok() {
        assert!(std::time::Instant::now() < deadline, "still accepting");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!in_flight.is_finished());
    assert!(
        !served(addr).await,
        "a new connection served during the drain"
    );
    up.open.send_replace(true);
    let resp = in_flight.await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.body(), "ok");
    drained
        .within(Duration::from_secs(10), "workers exit after the drain")
        .await;
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "no longer accepting"
    );
}

/// Sends `req` on `s` and reads its answer from the `ok` upstream (body `ok`, its head
/// through the blank line): the head, lower-cased.
async fn exchange_ok(s: &mut TcpStream, req: &[u8]) -> String {
    s.write_all(req).await.unwrap();
    let mut buf = Vec::new();
    let read = async {
        let end = read_head(s, &mut buf).await.expect("an answer");
        while buf.len() < end + 2 {
            let mut chunk = [0u8; 64];
            let n = s.read(&mut chunk).await.unwrap();
            assert!(n > 0, "closed before the body");
            buf.extend_from_slice(&chunk[..n]);
        }
        assert_eq!(&buf[end..], b"ok");
        String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase()
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("answered within 10 s")
}

/// A GET of `path` on the HTTP/2 connection `h2` is answered `200`, and the connection
/// (driven by `conn`) then ends, told to leave by GOAWAY.
async fn h2_get_then_goaway(
    h2: &mut hyper::client::conn::http2::SendRequest<TestBody>,
    conn: tokio::task::JoinHandle<Result<(), hyper::Error>>,
    addr: std::net::SocketAddr,
    path: &str,
) {
    let req = http::Request::get(format!("http://{addr}{path}"))
        .body(full(""))
        .unwrap();
    assert_eq!(h2.send_request(req).await.unwrap().status(), 200, "{path}");
    tokio::time::timeout(Duration::from_secs(5), conn)
        .await
        .unwrap_or_else(|_| panic!("{path}: the connection did not end after its GOAWAY"))
        .unwrap()
        .unwrap();
}

/// During `server.shutdown_delay` (`stop_ready`) keep-alive connections are still served,
/// and each is asked to close at its next request, as Envoy's drain asks: on HTTP/1.1 that
/// answer says `Connection: close` and the connection then closes (inline server and
/// hyper's alike; an HTTP/1.0 keep-alive answer no longer says keep-alive; a request
/// pipelined behind the told one is not served), and an HTTP/2 connection gets GOAWAY and
/// ends once its stream is answered (one opened during the delay, after its first
/// request). A connection idle meanwhile is left open (closing it could race its client's
/// next request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn during_shutdown_delay_connections_are_asked_to_close_at_their_next_request() {
    let up = ok_upstream().await;
    let gw = TestGateway::to(up, "");
    let addr = gw.addr;
    let get = b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n";
    // Served inline; and one handed to hyper's server (a chunked body) for good.
    let mut inline = TcpStream::connect(addr).await.unwrap();
    let head = exchange_ok(&mut inline, get).await;
    assert!(!head.contains("connection: close"), "{head}");
    let mut hyper_served = TcpStream::connect(addr).await.unwrap();
    let head = exchange_ok(
        &mut hyper_served,
        b"POST /b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    )
    .await;
    assert!(!head.contains("connection: close"), "{head}");
    let mut idle = TcpStream::connect(addr).await.unwrap();
    exchange_ok(&mut idle, get).await;
    let get10 = b"GET /a HTTP/1.0\r\nHost: x\r\nConnection: keep-alive\r\n\r\n";
    let mut http10 = TcpStream::connect(addr).await.unwrap();
    let head = exchange_ok(&mut http10, get10).await;
    assert!(head.contains("connection: keep-alive"), "{head}");
    let mut pipelined = TcpStream::connect(addr).await.unwrap();
    exchange_ok(&mut pipelined, get).await;
    let (mut h2, h2_conn) = h2c_client(addr).await;
    let resp = h2
        .send_request(
            http::Request::get(format!("http://{addr}/c"))
                .body(full(""))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    // Its stream ended (the body read), and a moment for the server's side of it to go
    // quiet: a wake-up of the connection after the delay began (its last frame written
    // then) tells it to leave before `/d` below, which is right, and not what this checks.
    resp.into_body().collect().await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;

    gw.gw.as_ref().unwrap().stop_ready();

    for (what, s) in [("inline", &mut inline), ("hyper's", &mut hyper_served)] {
        let head = exchange_ok(s, get).await;
        assert!(head.starts_with("http/1.1 200"), "{what}: {head}");
        assert!(head.contains("connection: close"), "{what}: {head}");
        let (rest, closed) = read_until_close(s, Duration::from_secs(5)).await;
        assert!(
            closed && rest.is_empty(),
            "{what}: not closed after it: {rest:?}"
        );
    }
    // HTTP/1.0 keep-alive: the answer no longer says keep-alive, and the connection closes.
    let head = exchange_ok(&mut http10, get10).await;
    assert!(!head.contains("keep-alive"), "{head}");
    let (rest, closed) = read_until_close(&mut http10, Duration::from_secs(5)).await;
    assert!(closed && rest.is_empty(), "HTTP/1.0: {rest:?}");
    // Two requests pipelined: the first is answered, with `Connection: close`; the second
    // is not served (its client sends it again elsewhere, as at the request cap).
    let head = exchange_ok(&mut pipelined, &[&get[..], &get[..]].concat()).await;
    assert!(head.contains("connection: close"), "{head}");
    let (rest, closed) = read_until_close(&mut pipelined, Duration::from_secs(5)).await;
    assert!(closed && rest.is_empty(), "pipelined: {rest:?}");
    h2_get_then_goaway(&mut h2, h2_conn, addr, "/d").await;
    // An HTTP/2 connection opened during the delay is not told at its preface: its first
    // request is served (then it is told).
    let (mut h2_new, h2_new_conn) = h2c_client(addr).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !h2_new_conn.is_finished(),
        "closed before its first request"
    );
    h2_get_then_goaway(&mut h2_new, h2_new_conn, addr, "/e").await;
    // New connections are still taken; the idle one stays open until it asks.
    let mut fresh = TcpStream::connect(addr).await.unwrap();
    let head = exchange_ok(&mut fresh, get).await;
    assert!(head.contains("connection: close"), "{head}");
    let (rest, closed) = read_until_close(&mut idle, Duration::from_millis(300)).await;
    assert!(
        !closed && rest.is_empty(),
        "an idle connection was closed: {rest:?}"
    );
    let head = exchange_ok(&mut idle, get).await;
    assert!(head.contains("connection: close"), "{head}");
}

/// Does a new connection to `addr` get a request answered (within 2 s)?
async fn served(addr: std::net::SocketAddr) -> bool {
    let Ok(mut s) = TcpStream::connect(addr).await else {
        return false;
    };
    if s.write_all(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .is_err()
    {
        return false;
    }
    let (text, _) = read_until_close(&mut s, Duration::from_secs(2)).await;
    text.starts_with("HTTP/1.1 ")
}

/// The same over HTTP/2: a stream in flight when shutdown starts is answered whole (the
/// GOAWAY leaves it be), and the connection then ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_drain_finishes_an_h2_stream_in_flight() {
    let (up, mut started_rx) = slow_upstream_telling_its_start().await;
    let mut gw = TestGateway::to(up, "");
    let (mut c, conn) = h2c_client(gw.addr).await;
    let in_flight = tokio::spawn(async move {
        let resp = c
            .send_request(http::Request::get("http://a/slow").body(full("")).unwrap())
            .await
            .unwrap();
        let status = resp.status();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, body)
    });
    started_rx.recv().await.unwrap();
    let drained = drain(&mut gw);
    let (status, body) = in_flight.await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(body, "finished");
    drained
        .within(Duration::from_secs(10), "workers exit after the drain")
        .await;
    tokio::time::timeout(Duration::from_secs(5), conn)
        .await
        .expect("the connection ends after the drain")
        .unwrap()
        .ok();
}

/// An HTTP/2 client that stops taking response data (it never reads the body, so its
/// flow-control window stays shut) is cut off after the server's `idle_timeout`, as an
/// HTTP/1.1 one that stops reading is: no write of the connection blocks to show it, and
/// the stalled stream would hold its upstream connection for as long as the client liked.
/// A request still waiting for its upstream's answer longer than that is not cut off.
#[tokio::test]
async fn an_h2_client_that_takes_no_response_data_is_cut_off() {
    let up = upstream(|req: http::Request<hyper::body::Incoming>| async move {
        if req.uri().path() == "/slow" {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            return http::Response::new(full("ok"));
        }
        http::Response::new(full(vec![b'x'; 4 << 20]))
    })
    .await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\nidle_timeout = \"600ms\"\n");
    let (mut c, conn) = h2c_client(gw.addr).await;
    // Waiting 1.5 s for the upstream's answer, past the idle timeout: served.
    let resp = c
        .send_request(http::Request::get("http://a/slow").body(full("")).unwrap())
        .await
        .unwrap();
    assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "ok");
    // 4 MiB asked for and never read: the connection is closed.
    let resp = c
        .send_request(http::Request::get("http://a/big").body(full("")).unwrap())
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let _unread = resp;
    let ended = tokio::time::timeout(Duration::from_secs(10), conn).await;
    assert!(
        ended.is_ok(),
        "the stalled client's connection was not closed"
    );
}

/// The same for the last stream `max_requests_per_connection` allows: the connection asked
/// to close after it still cuts off a client that stops taking its response data.
#[tokio::test]
async fn an_h2_client_that_stalls_its_last_stream_is_cut_off() {
    let up = upstream(|_| async { http::Response::new(full(vec![b'x'; 4 << 20])) }).await;
    let gw = TestGateway::to(
        up,
        "[server]\nworkers = 1\nidle_timeout = \"600ms\"\nmax_requests_per_connection = 1\n",
    );
    let (mut c, conn) = h2c_client(gw.addr).await;
    let resp = c
        .send_request(http::Request::get("http://a/big").body(full("")).unwrap())
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let _unread = resp;
    let ended = tokio::time::timeout(Duration::from_secs(10), conn).await;
    assert!(
        ended.is_ok(),
        "the stalled client's connection was not closed"
    );
}

/// An h2c client (the h2 crate, for control over each stream's window) whose connection
/// window is wide enough that a stalled stream (64 KiB of stream window) does not shut the
/// others out.
async fn h2_client_wide_window(addr: std::net::SocketAddr) -> h2::client::SendRequest<Bytes> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (client, conn) = h2::client::Builder::new()
        .initial_connection_window_size(16 << 20)
        .handshake::<_, Bytes>(tcp)
        .await
        .unwrap();
    tokio::spawn(conn);
    client.ready().await.unwrap()
}

/// Reads a stream's frames without giving its window back, until it ends: its error, if
/// it was reset.
async fn read_unreleased(mut body: h2::RecvStream) -> Option<h2::Error> {
    loop {
        match body.data().await {
            Some(Ok(_)) => {}
            Some(Err(e)) => return Some(e),
            None => return None,
        }
    }
}

/// Reads a stream whole, giving its window back as each piece comes: how much came, and
/// whether `stalled` ended meanwhile.
async fn read_released(
    mut body: h2::RecvStream,
    stalled: &tokio::task::JoinHandle<Option<h2::Error>>,
) -> (usize, bool) {
    let mut got = 0;
    let mut ended_meanwhile = false;
    while let Some(piece) = body.data().await {
        let piece = piece.expect("the read stream ends well");
        got += piece.len();
        let _ = body.flow_control().release_capacity(piece.len());
        ended_meanwhile |= stalled.is_finished();
    }
    (got, ended_meanwhile)
}

/// Two GETs on one h2c connection whose streams' windows are `window` bytes (its own
/// window wide): their responses to come.
async fn two_streams(
    addr: std::net::SocketAddr,
    window: u32,
    paths: [&str; 2],
) -> [h2::client::ResponseFuture; 2] {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (client, conn) = h2::client::Builder::new()
        .initial_connection_window_size(16 << 20)
        .initial_window_size(window)
        .handshake::<_, Bytes>(tcp)
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut client = client.ready().await.unwrap();
    let get = |path: &str| {
        http::Request::get(format!("http://a{path}"))
            .body(())
            .unwrap()
    };
    let (first, _) = client.send_request(get(paths[0]), true).unwrap();
    let mut client = client.ready().await.unwrap();
    let (second, _) = client.send_request(get(paths[1]), true).unwrap();
    [first, second]
}

/// The stalled stream's reset, asserting it came while the other stream was being read.
async fn reset_while_the_other_was_read(
    reset_while_reading: bool,
    stalled: tokio::task::JoinHandle<Option<h2::Error>>,
) -> h2::Error {
    assert!(
        reset_while_reading,
        "the stalled stream was not ended while the other was read"
    );
    stalled
        .await
        .unwrap()
        .expect("the stalled stream was reset")
}

/// One HTTP/2 stream whose client stopped taking its data (its window left shut) is reset
/// after `idle_timeout`, while another stream on the same connection, which the client
/// keeps reading, goes on to its end: the one read does not hide the one stalled, and the
/// connection is not dropped for it.
#[tokio::test]
async fn an_h2_stream_the_client_stopped_reading_is_reset_alone() {
    let up = upstream(|req: http::Request<hyper::body::Incoming>| async move {
        if req.uri().path() == "/big" {
            http::Response::new(full(vec![b'x'; 4 << 20]))
        } else {
            http::Response::new(trickle(15, 1024, Duration::from_millis(200), None))
        }
    })
    .await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\nidle_timeout = \"1s\"\n");
    let mut client = h2_client_wide_window(gw.addr).await;
    let get = |path: &str| {
        http::Request::get(format!("http://a{path}"))
            .body(())
            .unwrap()
    };
    let (big, _) = client.send_request(get("/big"), true).unwrap();
    let mut client = client.ready().await.unwrap();
    let (drip, _) = client.send_request(get("/drip"), true).unwrap();
    let (big, drip) = (big.await.unwrap(), drip.await.unwrap());
    assert_eq!((big.status().as_u16(), drip.status().as_u16()), (200, 200));
    // The stalled stream: its frames read, its window never given back.
    let stalled = tokio::spawn(read_unreleased(big.into_body()));
    // The read one: every piece taken (its window given back) as it comes.
    let (got, reset_while_reading) = read_released(drip.into_body(), &stalled).await;
    assert_eq!(got, 15 * 1024, "the read stream came whole");
    let e = reset_while_the_other_was_read(reset_while_reading, stalled).await;
    assert_eq!(e.reason(), Some(h2::Reason::CANCEL), "{e}");
}

/// The same for a response whose last piece waits for the client's window: it is reset
/// too. It was not watched, and held its stream for as long as the client kept the
/// connection busy. (A piece hyper finds the window open for, at least a byte of it, is
/// given to h2 whole and waits in h2's buffer, where no stream task is left to end.)
#[tokio::test]
async fn an_h2_stream_stalled_on_its_last_piece_is_reset() {
    // `/last`: 1 KiB, then, once the client has it, its last 1 KiB (with a length, so
    // that the gateway knows it for the last). The first fills the client's window.
    let next = Arc::new(tokio::sync::Notify::new());
    let go = next.clone();
    let up = upstream(move |req: http::Request<hyper::body::Incoming>| {
        let go = go.clone();
        async move {
            if req.uri().path() == "/last" {
                let pieces = futures_util::stream::unfold(0, move |i| {
                    let go = go.clone();
                    async move {
                        match i {
                            0 => {}
                            1 => go.notified().await,
                            _ => return None,
                        }
                        let piece = hyper::body::Frame::data(Bytes::from(vec![b'x'; 1024]));
                        Some((Ok(piece), i + 1))
                    }
                });
                http::Response::builder()
                    .header("content-length", "2048")
                    .body(http_body_util::BodyExt::boxed(
                        http_body_util::StreamBody::new(pieces),
                    ))
                    .unwrap()
            } else {
                http::Response::new(trickle(15, 512, Duration::from_millis(200), None))
            }
        }
    })
    .await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\nidle_timeout = \"1s\"\n");
    // Streams' windows of 1 KiB.
    let [last, drip] = two_streams(gw.addr, 1024, ["/last", "/drip"]).await;
    let (last, drip) = (last.await.unwrap(), drip.await.unwrap());
    assert_eq!((last.status().as_u16(), drip.status().as_u16()), (200, 200));
    let stalled = tokio::spawn(async move {
        let mut body = last.into_body();
        let mut got = 0;
        loop {
            match body.data().await {
                Some(Ok(piece)) => {
                    got += piece.len();
                    // The first piece is here (its window never given back): the last
                    // may come.
                    if got == 1024 {
                        next.notify_one();
                    }
                }
                Some(Err(e)) => return Some(e),
                None => return None,
            }
        }
    });
    let (got, reset_while_reading) = read_released(drip.into_body(), &stalled).await;
    assert_eq!(got, 15 * 512, "the read stream came whole");
    let e = reset_while_the_other_was_read(reset_while_reading, stalled).await;
    assert!(e.is_reset(), "{e}");
    assert_eq!(e.reason(), Some(h2::Reason::CANCEL), "{e}");
}

/// A response whose one piece (a body read whole with its head) waits for a client whose
/// windows are all shut is reset after `idle_timeout`, while another stream keeps the
/// connection busy (its upstream still thinking).
#[tokio::test]
async fn an_h2_stream_stalled_on_its_only_piece_is_reset() {
    let up = upstream(|req: http::Request<hyper::body::Incoming>| async move {
        if req.uri().path() == "/slow" {
            tokio::time::sleep(Duration::from_secs(4)).await;
        }
        http::Response::new(full(vec![b'x'; 4 << 10]))
    })
    .await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\nidle_timeout = \"1s\"\n");
    let [whole, slow] = two_streams(gw.addr, 0, ["/whole", "/slow"]).await;
    let whole = whole.await.unwrap();
    assert_eq!(whole.status().as_u16(), 200);
    let e = tokio::time::timeout(Duration::from_secs(3), whole.into_body().data())
        .await
        .expect("the stalled stream was not reset while the other was in flight")
        .expect("an end")
        .expect_err("no data can come through a shut window");
    assert!(e.is_reset(), "{e}");
    assert_eq!(e.reason(), Some(h2::Reason::CANCEL), "{e}");
    drop(slow);
}

/// A route's `total_timeout` cuts an HTTP/2 stream whose client keeps its window shut
/// (hyper does not poll its body then, so the body cannot cut itself off): the stream is
/// reset at the deadline, well before the connection's `idle_timeout`.
#[tokio::test]
async fn an_h2_stream_stalled_past_its_total_timeout_is_reset() {
    let up = upstream(|_| async { http::Response::new(full(vec![b'x'; 4 << 20])) }).await;
    let gw = TestGateway::start(&format!(
        "[server]\nworkers = 1\nidle_timeout = \"30s\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\ntotal_timeout = \"1s\"\n"
    ));
    let mut client = h2_client_wide_window(gw.addr).await;
    let (big, _) = client
        .send_request(http::Request::get("http://a/big").body(()).unwrap(), true)
        .unwrap();
    let big = big.await.unwrap();
    assert_eq!(big.status().as_u16(), 200);
    // Its frames read, its window never given back.
    let ended = tokio::time::timeout(Duration::from_secs(10), read_unreleased(big.into_body()))
        .await
        .expect("the stalled stream was not cut by its total timeout within 10 s");
    let e = ended.expect("the stalled stream was reset, not ended");
    assert_eq!(e.reason(), Some(h2::Reason::CANCEL), "{e}");
}

/// Holds worker 0's thread for `d` (from when this returns), so that connections wait in
/// its listen queue.
fn hold_worker(gw: &TestGateway, d: Duration) {
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    gw.gw
        .as_ref()
        .unwrap()
        .worker_handle(0)
        .unwrap()
        .spawn(async move {
            let _ = held_tx.send(());
            std::thread::sleep(d);
        });
    held_rx.recv().unwrap();
}

/// A connection the kernel queued for the worker before shutdown (its request already
/// sent) is taken and answered at shutdown, not reset when the listening socket closes.
#[tokio::test]
async fn a_connection_queued_at_shutdown_is_answered() {
    let up = ok_upstream().await;
    let mut gw = TestGateway::to(up, "");
    let addr = gw.addr;
    // The worker is held, so the connection waits in the listen queue with its request.
    hold_worker(&gw, Duration::from_millis(500));
    let mut client = TcpStream::connect(addr).await.unwrap();
    client
        .write_all(b"GET /queued HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    let drained = drain(&mut gw);
    let (text, closed) = read_until_close(&mut client, Duration::from_secs(5)).await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text:?}");
    assert!(closed, "closed after its answer");
    drained
        .within(Duration::from_secs(10), "workers exit after the drain")
        .await;
}

/// The same over TLS: a client whose hello waits in the listen queue at shutdown gets its
/// handshake, and its request answered.
#[tokio::test]
async fn a_tls_connection_queued_at_shutdown_is_answered() {
    let cert = test_cert(&["acme.test"]);
    let up = ok_upstream().await;
    let mut gw = tls_gateway(&cert, up);
    let addr = gw.addr;
    hold_worker(&gw, Duration::from_millis(500));
    // Connected (the kernel completed the TCP handshake, and the connection waits in the
    // listen queue) before the drain starts; its hello follows.
    let tcp = TcpStream::connect(addr).await.unwrap();
    let client = tokio::spawn(async move {
        tls_h1_get_over(tcp, &cert, "acme.test", "/queued", "acme.test")
            .await
            .status()
    });
    let drained = drain(&mut gw);
    let status = tokio::time::timeout(Duration::from_secs(5), client)
        .await
        .expect("answered")
        .unwrap();
    assert_eq!(status, 200);
    drained
        .within(Duration::from_secs(10), "workers exit after the drain")
        .await;
}

/// A connection the worker had taken when the shutdown came, whose client had not sent its
/// request yet (nor, over TLS, finished its handshake), is answered when it comes within a
/// second: a restart refuses no connection, whatever moment it falls on.
#[tokio::test]
async fn a_connection_taken_just_before_shutdown_is_answered() {
    let cert = test_cert(&["acme.test"]);
    let up = ok_upstream().await;
    for tls in [false, true] {
        let mut gw = if tls {
            tls_gateway(&cert, up)
        } else {
            TestGateway::to(up, "")
        };
        let tcp = TcpStream::connect(gw.addr).await.unwrap();
        let state = gw.gw.as_ref().unwrap().admin_state().clone();
        wait_for("the worker took the connection", || {
            state.workers[0].shared.connections.open() > 0
        })
        .await;
        let drained = drain(&mut gw);
        tokio::time::sleep(Duration::from_millis(300)).await;
        if tls {
            let tls = tls_connect_over(tcp, &cert, "acme.test", &[b"http/1.1"]).await;
            let (mut c, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
                .await
                .unwrap();
            tokio::spawn(conn);
            let req = http::Request::get("/late")
                .header("host", "acme.test")
                .body(full(""))
                .unwrap();
            assert_eq!(c.send_request(req).await.unwrap().status(), 200, "tls");
        } else {
            let mut tcp = tcp;
            tcp.write_all(b"GET /late HTTP/1.1\r\nHost: a\r\n\r\n")
                .await
                .unwrap();
            let (text, closed) = read_until_close(&mut tcp, Duration::from_secs(5)).await;
            assert!(text.starts_with("HTTP/1.1 200"), "{text:?}");
            assert!(closed, "closed after its answer");
        }
        drained
            .within(Duration::from_secs(10), "workers exit after the drain")
            .await;
    }
}

/// The built-in demo upstream keeps answering while the workers drain: requests in flight
/// at a shutdown may be waiting on it. It stops once they are done.
#[tokio::test]
async fn the_demo_upstream_outlives_the_drain() {
    let demo = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let (started_tx, mut started_rx) = tokio::sync::mpsc::channel::<()>(1);
    let slow = upstream(move |_| {
        let started = started_tx.clone();
        async move {
            started.send(()).await.ok();
            tokio::time::sleep(Duration::from_millis(1500)).await;
            http::Response::new(full("finished"))
        }
    })
    .await;
    let mut gw = TestGateway::start(&format!(
        "[[demo]]\naddress = \"{demo}\"\n[[listener]]\nname = \"main\"\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"slow\"\nendpoints = [\"{slow}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"slow\"\n"
    ));
    let addr = gw.gw.as_ref().unwrap().listener_addr("main").unwrap();
    let in_flight = tokio::spawn(async move { get(addr, "/slow").await });
    started_rx.recv().await.unwrap();
    let drained = drain(&mut gw);
    // The drain is on (a request in flight): the demo still answers.
    let resp = get(demo, "/hello").await;
    assert_eq!(resp.status(), 200);
    assert_eq!(in_flight.await.unwrap().status(), 200);
    drained
        .within(Duration::from_secs(10), "workers exit after the drain")
        .await;
    assert!(
        TcpStream::connect(demo).await.is_err(),
        "the demo stopped after the drain"
    );
}

/// An HTTP/2 client gone silent (it never answers the PING of the graceful close) does not
/// hold the worker's drain for the whole grace period: with no request in flight, its
/// connection is dropped a moment after the shutdown began.
#[tokio::test]
async fn a_silent_h2_client_does_not_hold_the_drain() {
    let up = ok_upstream().await;
    let mut gw = TestGateway::start(&format!(
        "[server]\nworkers = 1\nshutdown_grace = \"60s\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
    ));
    let mut silent = TcpStream::connect(gw.addr).await.unwrap();
    // The preface and an empty SETTINGS; then nothing, not even the SETTINGS ack.
    silent
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await
        .unwrap();
    let mut settings = [0u8; 9];
    silent.read_exact(&mut settings).await.unwrap();
    assert_eq!(settings[3], 4, "the server's SETTINGS");
    let drained = drain(&mut gw);
    drained
        .within(
            Duration::from_secs(15),
            "the worker exits long before the 60 s grace",
        )
        .await;
    drop(silent);
}

/// Begins the gateway's graceful shutdown; its workers are joined off the test's runtime.
fn drain(gw: &mut TestGateway) -> Drained {
    let gw = gw.gw.take().unwrap();
    gw.shutdown();
    Drained(tokio::task::spawn_blocking(move || gw.join()))
}

/// A drain under way (see [`drain`]).
struct Drained(tokio::task::JoinHandle<()>);

impl Drained {
    /// Waits for every worker to exit, failing with `what` after `limit`.
    async fn within(self, limit: Duration, what: &str) {
        tokio::time::timeout(limit, self.0)
            .await
            .expect(what)
            .unwrap();
    }
}

/// An HTTP/2 connection already closing when the shutdown comes (here for
/// `max_requests_per_connection`; an idle one is the same), whose client answers nothing
/// (not the close's PING either: a phone gone from the network), is dropped a second into
/// the drain, as one asked to close by the shutdown itself is. Its close kept the
/// deadline it began with (`idle_timeout`), and held the drain for the whole grace period.
#[tokio::test]
async fn a_shutdown_cuts_short_an_h2_close_its_client_does_not_answer() {
    let up = ok_upstream().await;
    let gw = TestGateway::to(
        up,
        "[server]\nworkers = 1\nidle_timeout = \"60s\"\nmax_requests_per_connection = 1\nshutdown_grace = \"20s\"\n",
    );
    // By hand, so that nothing answers the server's PING: the preface, an empty SETTINGS,
    // and `GET http://a/` (HPACK: `:method GET`, `:scheme http`, `:path /` from the static
    // table, `:authority a` literal) on stream 1, ending it.
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
    out.extend_from_slice(&[0, 0, 6, 1, 5, 0, 0, 0, 1, 0x82, 0x86, 0x84, 0x41, 1, b'a']);
    s.write_all(&out).await.unwrap();
    // The answer (and the server's SETTINGS, GOAWAY and PING) come; none is answered.
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(500), s.read(&mut buf)).await {
        if n == 0 {
            panic!("the connection closed: {got:?}");
        }
        got.extend_from_slice(&buf[..n]);
    }
    // A HEADERS frame (type 1) on stream 1 came back.
    assert!(
        got.windows(5)
            .any(|w| w == [1, 4, 0, 0, 0] || w == [1, 5, 0, 0, 0]),
        "no answer: {got:?}"
    );
    let mut gw = gw;
    let started = std::time::Instant::now();
    tokio::task::spawn_blocking(move || gw.shutdown())
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "the drain took {:?}",
        started.elapsed()
    );
    drop(s);
}
