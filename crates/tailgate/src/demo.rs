//! The built-in demo upstream, so the example config works with nothing else installed:
//! it answers every request itself. A request with a body gets the body echoed back
//! (streamed); one without gets a small JSON document describing what arrived, including
//! the headers the gateway added.

use std::convert::Infallible;

use bytes::Bytes;
use http::{Request, Response, header};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::sync::watch;

type DemoBody = Either<Full<Bytes>, Incoming>;

async fn answer(req: Request<Incoming>) -> Result<Response<DemoBody>, Infallible> {
    let has_body = req.headers().contains_key(header::CONTENT_LENGTH)
        || req.headers().contains_key(header::TRANSFER_ENCODING);
    if has_body && !http_body::Body::is_end_stream(req.body()) {
        let ct = req.headers().get(header::CONTENT_TYPE).cloned();
        let mut resp = Response::new(Either::Right(req.into_body()));
        if let Some(ct) = ct {
            resp.headers_mut().insert(header::CONTENT_TYPE, ct);
        }
        return Ok(resp);
    }
    let headers: serde_json::Map<String, serde_json::Value> = req
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_owned(),
                serde_json::Value::from(String::from_utf8_lossy(v.as_bytes()).into_owned()),
            )
        })
        .collect();
    let doc = serde_json::json!({
        "service": "tailgate demo upstream",
        "method": req.method().as_str(),
        "path": req.uri().path(),
        "query": req.uri().query(),
        "headers": headers,
    });
    let mut body = doc.to_string();
    body.push('\n');
    let mut resp = Response::new(Either::Left(Full::new(Bytes::from(body))));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    Ok(resp)
}

/// How long the demo waits for a request head.
const HEAD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// How long the demo's stop waits for the requests it is answering: within the margin the
/// gateway's stop allows past `shutdown_grace` (the demo stops after the workers drained).
const DRAIN: std::time::Duration = std::time::Duration::from_secs(3);

/// Serves the demo on `socket` until `shutdown` turns true; then stops as the gateway's
/// listeners do: the connections already queued for it are taken and served (a second
/// gateway sharing its address, SO_REUSEPORT, sent them here), idle connections are closed,
/// and the requests being answered finish (for up to 3 s) rather than being cut.
pub async fn serve(socket: tokio::net::TcpListener, mut shutdown: watch::Receiver<bool>) {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // A client that sends no (whole) head for this long is cut off, the next head on a
    // kept-alive connection included: the demo's descriptors are the gateway's too.
    builder
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT);
    loop {
        tokio::select! {
            _ = shutdown.wait_for(|s| *s) => break,
            accepted = socket.accept() => {
                let Ok((stream, _)) = accepted else {
                    // Out of file descriptors (shared with the gateway) and the like: back
                    // off rather than spin on the error.
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                };
                tokio::spawn(connection(builder.clone(), stream, Some(graceful.watcher())));
            }
        }
    }
    // Those queued: each answers its first request and closes (a graceful stop's signal
    // would close them before they read it).
    let mut queued = tokio::task::JoinSet::new();
    let mut last = builder.clone();
    last.http1().keep_alive(false);
    if let Ok(socket) = socket.into_std() {
        while let Ok((stream, _)) = socket.accept() {
            if stream.set_nonblocking(true).is_err() {
                continue;
            }
            if let Ok(stream) = tokio::net::TcpStream::from_std(stream) {
                queued.spawn(connection(last.clone(), stream, None));
            }
        }
    }
    let _ = tokio::time::timeout(DRAIN, async {
        graceful.shutdown().await;
        while queued.join_next().await.is_some() {}
    })
    .await;
}

/// Serves one connection; `watcher`, if any, closes it gracefully at the demo's stop.
async fn connection(
    builder: auto::Builder<TokioExecutor>,
    stream: tokio::net::TcpStream,
    watcher: Option<hyper_util::server::graceful::Watcher>,
) {
    let _ = stream.set_nodelay(true);
    // Its first bytes (which pick HTTP/1 or HTTP/2) within the head timeout too: the
    // protocol's own timer starts only once one is picked.
    let mut first = [0u8; 1];
    let peeked = tokio::time::timeout(HEAD_TIMEOUT, stream.peek(&mut first));
    if !matches!(peeked.await, Ok(Ok(n)) if n > 0) {
        return;
    }
    let conn = builder
        .serve_connection(TokioIo::new(stream), service_fn(answer))
        .into_owned();
    let _ = match watcher {
        Some(w) => w.watch(conn).await,
        None => conn.await,
    };
}

/// Runs the demo on the current thread with its own runtime.
pub fn run_blocking(socket: std::net::TcpListener, shutdown: watch::Receiver<bool>) {
    let Some(rt) = crate::runtime::for_thread("demo upstream", "") else {
        return;
    };
    rt.block_on(async move {
        if let Ok(socket) = tokio::net::TcpListener::from_std(socket) {
            serve(socket, shutdown).await;
        }
    });
}
