//! The built-in demo upstream, so the example config works with nothing else installed:
//! it answers every request itself. A request with a body gets the body echoed back
//! (streamed); one without gets a small JSON document describing what arrived, including
//! the headers the gateway added.

use std::convert::Infallible;
use std::sync::Arc;

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

/// How long a connection taken from the queue at the stop has to send its first bytes.
const QUEUED_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Serves the demo on `socket` until `shutdown` turns true; then stops as the gateway's
/// listeners do: the connections already queued for it are taken and served (a second
/// gateway sharing its address, SO_REUSEPORT, sent them here), idle connections are closed,
/// and the requests being answered finish (for up to 3 s) rather than being cut.
pub async fn serve(socket: tokio::net::TcpListener, mut shutdown: watch::Receiver<bool>) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // A client that sends no (whole) head for this long is cut off, the next head on a
    // kept-alive connection included: the demo's descriptors are the gateway's too.
    builder
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT);
    let mut conns = tokio::task::JoinSet::new();
    let stop = shutdown.clone();
    loop {
        tokio::select! {
            // (Its guard not held in the select's output: the future stays `Send`.)
            _ = async { drop(shutdown.wait_for(|s| *s).await) } => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            accepted = socket.accept() => {
                let Ok((stream, _)) = accepted else {
                    // Out of file descriptors (shared with the gateway) and the like: back
                    // off rather than spin on the error.
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                };
                conns.spawn(connection(builder.clone(), stream, stop.clone()));
            }
        }
    }
    if let Ok(socket) = socket.into_std() {
        while let Ok((stream, _)) = socket.accept() {
            if stream.set_nonblocking(true).is_err() {
                continue;
            }
            if let Ok(stream) = tokio::net::TcpStream::from_std(stream) {
                conns.spawn(connection(builder.clone(), stream, stop.clone()));
            }
        }
    }
    let _ = tokio::time::timeout(DRAIN, async { while conns.join_next().await.is_some() {} }).await;
}

/// Serves one connection until the demo's stop (`stop` true); then closes it gracefully:
/// at once when it is idle, once its requests are answered (HTTP/2: GOAWAY, its streams
/// finish), and only after its first request when it has sent bytes but no whole request
/// yet (one taken from the queue at the stop, say), which a close would drop unread.
async fn connection(
    builder: auto::Builder<TokioExecutor>,
    stream: tokio::net::TcpStream,
    mut stop: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    // Its first bytes (which pick HTTP/1 or HTTP/2) within the head timeout too: the
    // protocol's own timer starts only once one is picked. At the stop, one that has sent
    // none is closed; one taken from the queue then has a moment to send them.
    let mut first = [0u8; 1];
    let stopped = *stop.borrow();
    let wait = if stopped { QUEUED_WAIT } else { HEAD_TIMEOUT };
    let peeked = tokio::select! {
        biased;
        r = tokio::time::timeout(wait, stream.peek(&mut first)) => matches!(r, Ok(Ok(n)) if n > 0),
        _ = stop.wait_for(|s| *s), if !stopped => false,
    };
    if !peeked {
        return;
    }
    // Its first request leaves a permit here, which the stop takes at once.
    let asked = Arc::new(tokio::sync::Notify::new());
    let seen = asked.clone();
    let service = service_fn(move |req| {
        seen.notify_one();
        answer(req)
    });
    let conn = builder
        .serve_connection(TokioIo::new(stream), service)
        .into_owned();
    tokio::pin!(conn);
    if !stopped {
        tokio::select! {
            _ = conn.as_mut() => return,
            _ = stop.wait_for(|s| *s) => {}
        }
    }
    tokio::select! {
        _ = conn.as_mut() => return,
        _ = asked.notified() => {}
    }
    conn.as_mut().graceful_shutdown();
    let _ = conn.await;
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    /// What comes until the peer closes; panics if it does not within 5 s.
    async fn read_all(s: &mut TcpStream) -> String {
        let mut out = Vec::new();
        let read = tokio::time::timeout(std::time::Duration::from_secs(5), s.read_to_end(&mut out));
        assert!(read.await.is_ok(), "not closed");
        String::from_utf8_lossy(&out).into_owned()
    }

    /// At the stop: a connection that has sent nothing and an idle kept-alive one are closed
    /// at once (they held the stop for its whole bound), and an upload being echoed is
    /// finished first.
    #[tokio::test]
    async fn a_stop_closes_idle_connections_and_finishes_answers() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, rx) = watch::channel(false);
        let demo = tokio::spawn(serve(listener, rx));
        let mut silent = TcpStream::connect(addr).await.expect("connect");
        let mut idle = TcpStream::connect(addr).await.expect("connect");
        idle.write_all(b"GET /a HTTP/1.1\r\nhost: d\r\n\r\n")
            .await
            .expect("write");
        let mut buf = [0u8; 4096];
        let n = idle.read(&mut buf).await.expect("read");
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        let mut upload = TcpStream::connect(addr).await.expect("connect");
        upload
            .write_all(
                b"POST /e HTTP/1.1\r\nhost: d\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n",
            )
            .await
            .expect("write");
        let n = upload.read(&mut buf).await.expect("read");
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        let stopped = std::time::Instant::now();
        stop.send_replace(true);
        assert_eq!(read_all(&mut silent).await, "");
        assert_eq!(read_all(&mut idle).await, "");
        upload
            .write_all(b"2\r\ncd\r\n0\r\n\r\n")
            .await
            .expect("write");
        let rest = read_all(&mut upload).await;
        assert!(rest.contains("cd"), "{rest}");
        assert!(rest.ends_with("0\r\n\r\n"), "{rest}");
        tokio::time::timeout(std::time::Duration::from_secs(5), demo)
            .await
            .expect("the demo stopped")
            .expect("no panic");
        // Well within its bound (3 s), which only a request still answered may take.
        assert!(
            stopped.elapsed() < std::time::Duration::from_secs(2),
            "{:?}",
            stopped.elapsed()
        );
    }
}
