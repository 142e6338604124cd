//! Test harness: a gateway started in-process from a TOML snippet, upstreams the test
//! controls (hyper servers with a handler closure, or raw TCP), and raw-byte clients.
#![allow(dead_code, clippy::unwrap_used)]

mod dead_port;
pub mod fuzz;
pub mod prom;
pub mod tls;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tailgate::{Config, Gateway};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub type TestBody = BoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

pub fn full(b: impl Into<Bytes>) -> TestBody {
    Full::new(b.into()).map_err(|e| match e {}).boxed()
}

/// A body of `chunks` pieces of `size` bytes, one every `every` (no length: an HTTP/1.1
/// client sends it chunked). With `stall_after`, it sends that many pieces and then
/// nothing more, without ending.
pub fn trickle(
    chunks: usize,
    size: usize,
    every: Duration,
    stall_after: Option<usize>,
) -> TestBody {
    let pieces = futures_util::stream::unfold(0usize, move |i| async move {
        if i == chunks {
            return None;
        }
        if stall_after == Some(i) {
            std::future::pending::<()>().await;
        }
        if i > 0 {
            tokio::time::sleep(every).await;
        }
        let piece = hyper::body::Frame::data(Bytes::from(vec![b'x'; size]));
        Some((Ok(piece), i + 1))
    });
    http_body_util::StreamBody::new(pieces).boxed()
}

/// Sends `body` as a POST to `/upload` on `c` and reads the whole answer.
pub async fn post(
    c: &mut hyper::client::conn::http1::SendRequest<TestBody>,
    body: TestBody,
) -> Result<http::Response<Bytes>, String> {
    send(c, "POST", "/upload", body).await
}

/// Sends `method path` with `body` (Host `a`) on `c` and reads the whole answer: status,
/// headers, body; an error as text.
pub async fn send(
    c: &mut hyper::client::conn::http1::SendRequest<TestBody>,
    method: &str,
    path: &str,
    body: TestBody,
) -> Result<http::Response<Bytes>, String> {
    let r = c
        .send_request(
            http::Request::builder()
                .method(method)
                .uri(path)
                .header("host", "a")
                .body(body)
                .unwrap(),
        )
        .await
        .map_err(|e| e.to_string())?;
    let (parts, body) = r.into_parts();
    let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok(http::Response::from_parts(parts, body))
}

/// An upstream that reads each request's body whole and answers `got N` (its length).
pub async fn body_counting_upstream() -> SocketAddr {
    upstream(|req: http::Request<Incoming>| async move {
        let got = req.into_body().collect().await.map(|b| b.to_bytes().len());
        http::Response::new(full(match got {
            Ok(n) => format!("got {n}"),
            Err(e) => format!("body failed: {e}"),
        }))
    })
    .await
}

/// Starts a gateway from `toml` (listener addresses may use port 0). The default listener
/// snippet `[[listener]] name = "main" address = "127.0.0.1:0"` is added unless the toml has
/// its own listener.
pub struct TestGateway {
    pub gw: Option<Gateway>,
    pub addr: SocketAddr,
}

impl TestGateway {
    pub fn start(toml: &str) -> TestGateway {
        let mut text = String::from("[server]\nworkers = 1\nshutdown_grace = \"5s\"\n");
        if !toml.contains("[server]") {
            text.push('\n');
        } else {
            text.clear();
        }
        text.push_str(toml);
        if !toml.contains("[[listener]]") {
            text.push_str("\n[[listener]]\nname = \"main\"\naddress = \"127.0.0.1:0\"\n");
        }
        if !toml.contains("[log]") {
            text.push_str("\n[log]\nlevel = \"warn\"\naccess_log = false\n");
        }
        let cfg = Config::parse(Path::new("test.toml"), &text)
            .unwrap_or_else(|e| panic!("bad test config:\n{e}\n---\n{text}"));
        let gw = Gateway::start(cfg).expect("gateway starts");
        let addr = gw.listener_addrs()[0];
        TestGateway { gw: Some(gw), addr }
    }

    /// Starts a gateway with one catch-all route to `upstream`.
    pub fn to(upstream: SocketAddr, extra: &str) -> TestGateway {
        Self::start(&format!(
            "{extra}\n[[cluster]]\nname = \"up\"\nendpoints = [\"{upstream}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
        ))
    }

    pub fn shutdown(&mut self) {
        if let Some(gw) = self.gw.take() {
            gw.shutdown();
            gw.join();
        }
    }
}

impl Drop for TestGateway {
    fn drop(&mut self) {
        if let Some(gw) = self.gw.take() {
            gw.shutdown();
            // Do not wait for the grace period in tests that leave requests hanging.
            std::thread::spawn(move || gw.join());
        }
    }
}

/// An HTTP/1.1 upstream served by hyper, answering with `handler`.
pub async fn upstream<F, Fut>(handler: F) -> SocketAddr
where
    F: Fn(http::Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = http::Response<TestBody>> + Send + 'static,
{
    upstream_on("127.0.0.1:0", handler).await
}

pub async fn upstream_on<F, Fut>(bind: &str, handler: F) -> SocketAddr
where
    F: Fn(http::Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = http::Response<TestBody>> + Send + 'static,
{
    serve_with(bind, false, handler).await
}

/// [`upstream`] speaking HTTP/2 by prior knowledge (h2c).
pub async fn h2c_upstream_with<F, Fut>(handler: F) -> SocketAddr
where
    F: Fn(http::Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = http::Response<TestBody>> + Send + 'static,
{
    serve_with("127.0.0.1:0", true, handler).await
}

/// An upstream on `bind` answering with `handler`: HTTP/1.1 (upgrades allowed), or h2c.
async fn serve_with<F, Fut>(bind: &str, h2c: bool, handler: F) -> SocketAddr
where
    F: Fn(http::Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = http::Response<TestBody>> + Send + 'static,
{
    let listener = TcpListener::bind(bind).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let handler = Arc::new(handler);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let handler = handler.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req| {
                    let handler = handler.clone();
                    async move { Ok::<_, Infallible>(handler(req).await) }
                });
                let io = TokioIo::new(stream);
                let _ = if h2c {
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .serve_connection(io, svc)
                        .await
                } else {
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(io, svc)
                        .with_upgrades()
                        .await
                };
            });
        }
    });
    addr
}

/// Accepts a WebSocket upgrade (101) and echoes whatever comes through the tunnel after it.
pub fn websocket_echo(req: &mut http::Request<Incoming>) -> http::Response<TestBody> {
    let on_upgrade = hyper::upgrade::on(req);
    tokio::spawn(async move {
        let Ok(upgraded) = on_upgrade.await else {
            return;
        };
        let mut io = TokioIo::new(upgraded);
        let mut buf = [0u8; 1024];
        loop {
            match io.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if io.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            }
        }
    });
    http::Response::builder()
        .status(101)
        .header("connection", "upgrade")
        .header("upgrade", "websocket")
        .header("sec-websocket-accept", "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=")
        .body(full(""))
        .unwrap()
}

/// An upstream that answers 200 "ok" to everything.
pub async fn ok_upstream() -> SocketAddr {
    upstream(|_req| async { http::Response::new(full("ok")) }).await
}

/// An upstream that echoes the request: body streamed back, request headers as `x-echo-*`.
pub async fn echo_upstream() -> SocketAddr {
    upstream(|req: http::Request<Incoming>| async move {
        let (parts, body) = req.into_parts();
        let mut resp = http::Response::new(
            body.map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
                .boxed(),
        );
        for (k, v) in parts.headers.iter() {
            if let Ok(name) =
                http::HeaderName::from_bytes(format!("x-echo-{}", k.as_str()).as_bytes())
            {
                resp.headers_mut().append(name, v.clone());
            }
        }
        resp.headers_mut()
            .insert("x-echo-uri", parts.uri.to_string().parse().unwrap());
        resp.headers_mut()
            .insert("x-echo-method", parts.method.as_str().parse().unwrap());
        resp
    })
    .await
}

/// A listener that closes every connection as soon as it accepts it (a server at its own
/// connection limit, say); counts them.
pub async fn closing_listener() -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = accepted.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            drop(s);
        }
    });
    (addr, accepted)
}

/// Sends raw bytes and reads everything until the server closes (or `wait` passes).
pub async fn raw(addr: SocketAddr, bytes: &[u8], wait: Duration) -> (String, bool) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    read_until_close(&mut s, wait).await
}

/// Reads until EOF; returns the text and whether the peer closed within `wait`.
pub async fn read_until_close(s: &mut TcpStream, wait: Duration) -> (String, bool) {
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (String::from_utf8_lossy(&out).into_owned(), true),
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Err(_) => return (String::from_utf8_lossy(&out).into_owned(), false),
        }
    }
}

/// Reads off `s` into `buf` until `buf` holds a whole head (through its blank line); returns
/// where the head ends (bytes past it stay in `buf`), or `None` when the peer closes or the
/// read fails first. The request reader of the tests' hand-written upstreams.
pub async fn read_head<S>(s: &mut S, buf: &mut Vec<u8>) -> Option<usize>
where
    S: tokio::io::AsyncRead + Unpin,
{
    let mut chunk = [0u8; 16384];
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            return Some(i + 4);
        }
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// A plain hyper HTTP/1.1 client connection.
pub async fn h1_client(addr: SocketAddr) -> hyper::client::conn::http1::SendRequest<TestBody> {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(async move {
        let _ = conn.with_upgrades().await;
    });
    sender
}

/// An upstream that holds every request until `open` is sent `true`, then answers `ok`;
/// `arrived` gets one message per request that reached it.
pub struct HeldUpstream {
    pub addr: SocketAddr,
    pub arrived: tokio::sync::mpsc::UnboundedReceiver<()>,
    pub open: tokio::sync::watch::Sender<bool>,
}

pub async fn held_upstream() -> HeldUpstream {
    let (arrived_tx, arrived) = tokio::sync::mpsc::unbounded_channel::<()>();
    let (open, open_rx) = tokio::sync::watch::channel(false);
    let addr = upstream(move |_| {
        let arrived = arrived_tx.clone();
        let mut open = open_rx.clone();
        async move {
            let _ = arrived.send(());
            let _ = open.wait_for(|o| *o).await;
            http::Response::new(full("ok"))
        }
    })
    .await;
    HeldUpstream {
        addr,
        arrived,
        open,
    }
}

/// An HTTP/2 client by prior knowledge (h2c) on a new connection to `addr`, and the task
/// driving its connection (it ends with the connection).
pub async fn h2c_client(
    addr: SocketAddr,
) -> (
    hyper::client::conn::http2::SendRequest<TestBody>,
    tokio::task::JoinHandle<Result<(), hyper::Error>>,
) {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        TokioIo::new(stream),
    )
    .await
    .unwrap();
    (sender, tokio::spawn(conn))
}

/// `GET path` (Host `test.local`) on a new connection to `addr`: the whole answer. Fails
/// after 30 s without it: a gateway that hangs fails the test, not the suite's time limit.
pub async fn get(addr: SocketAddr, path: &str) -> http::Response<Bytes> {
    tokio::time::timeout(Duration::from_secs(30), async {
        let mut c = h1_client(addr).await;
        let req = http::Request::get(path)
            .header("host", "test.local")
            .body(full(""))
            .unwrap();
        let resp = c.send_request(req).await.unwrap();
        let (parts, body) = resp.into_parts();
        http::Response::from_parts(parts, body.collect().await.unwrap().to_bytes())
    })
    .await
    .unwrap_or_else(|_| panic!("no whole answer to GET {path} within 30 s"))
}

/// Sends `GET path` (Host `a`) on `c` and reads the whole answer; returns the status.
pub async fn get_on(
    c: &mut hyper::client::conn::http1::SendRequest<TestBody>,
    path: &str,
) -> http::StatusCode {
    let r = c
        .send_request(
            http::Request::get(path)
                .header("host", "a")
                .body(full(""))
                .unwrap(),
        )
        .await
        .unwrap();
    let status = r.status();
    r.into_body().collect().await.unwrap();
    status
}

/// Polls `f` every 10 ms until it holds; panics after 10 s.
pub async fn wait_for(what: &str, f: impl Fn() -> bool) {
    for _ in 0..1000 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}");
}

/// One upstream pool statistic summed over every endpoint and worker.
pub fn stat(gw: &TestGateway, f: impl Fn(&tailgate::upstream::PoolStats) -> u64) -> u64 {
    gw.gw.as_ref().unwrap().pool_stat(f)
}

#[allow(unused_imports)]
pub use dead_port::dead_port;

/// A listener that never accepts, with its tiny backlog filled: further SYNs go unanswered,
/// so a connect to it hangs until the connecting side gives up. Keep all three alive.
pub async fn unanswering_listener() -> (socket2::Socket, SocketAddr, Vec<TcpStream>) {
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    sock.bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
        .unwrap();
    sock.listen(0).unwrap();
    let addr = sock.local_addr().unwrap().as_socket().unwrap();
    let mut fillers = Vec::new();
    for _ in 0..8 {
        if let Ok(Ok(s)) =
            tokio::time::timeout(Duration::from_millis(200), TcpStream::connect(addr)).await
        {
            fillers.push(s);
        }
    }
    // At least one filler's connect hung: the backlog is full, and so will a test's be.
    assert!(fillers.len() < 8, "the listener's backlog never filled");
    (sock, addr, fillers)
}

/// Opens a WebSocket through the gateway at `addr` to an echoing upstream; returns the
/// client's socket once the 101 is in, and the response head (and any bytes after it).
pub async fn ws_open(addr: std::net::SocketAddr) -> (tokio::net::TcpStream, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /ws HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n").await.unwrap();
    let mut buf = vec![0u8; 4096];
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0);
        got.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&got).into_owned();
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    (s, head)
}
