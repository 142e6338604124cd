//! `tailgate bench upstream`: a fast, fixed-answer upstream for benchmarks.
//!
//! HTTP/1.1 keep-alive, written by hand for the same reason as the generator's client (it must
//! not be what is measured): one pre-serialized response, httparse for request heads, pipelined
//! requests answered in one write. `close_every = N` sends `Connection: close` on every N-th
//! response of a connection and closes it (seed 004's every-80th-request spike).
//! A connection that starts with the HTTP/2 preface is served by hyper's HTTP/2 server (h2c,
//! prior knowledge) with the same body; `close_every` does not apply to it.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http_body_util::Full;
use hyper::server::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// How the upstream answers.
#[derive(Clone, Debug)]
pub struct Options {
    pub body_bytes: usize,
    /// Close the connection after every N-th response on it.
    pub close_every: Option<u64>,
    /// Wait this long before each response.
    pub delay: Duration,
}

struct Responses {
    keep: Bytes,
    close: Bytes,
    head_keep: Bytes,
    head_close: Bytes,
    body: Bytes,
}

impl Responses {
    fn new(body_bytes: usize) -> Self {
        let body = Bytes::from(vec![b'x'; body_bytes]);
        let head = |close: bool| {
            let c = if close { "Connection: close\r\n" } else { "" };
            format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {body_bytes}\r\n{c}\r\n"
            )
        };
        let full = |close: bool| {
            let mut v = head(close).into_bytes();
            v.extend_from_slice(&body);
            Bytes::from(v)
        };
        Responses {
            keep: full(false),
            close: full(true),
            head_keep: Bytes::from(head(false)),
            head_close: Bytes::from(head(true)),
            body,
        }
    }
}

/// Binds `listen` and serves forever on a current-thread runtime (the caller's thread).
pub fn serve_blocking(listen: &str, opts: Options) -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let listener = bind(listen).await?;
        serve(listener, opts).await
    })
}

/// The listen backlog: tailgate's own listeners' and the kernel's default `somaxconn`.
/// `TcpListener::bind` asks for 128, and a burst of new connections from a proxy (its pool
/// growing on a cold start) then overflows the accept queue while the upstream waits for the
/// CPU: the kernel drops those SYNs and each such request waits a second for the resend,
/// which would measure this fixture's queue instead of the proxy.
pub const LISTEN_BACKLOG: i32 = 4096;

/// Binds `listen` (an address, or a name that resolves to one) with [`LISTEN_BACKLOG`].
pub async fn bind(listen: &str) -> std::io::Result<TcpListener> {
    let addr = tokio::net::lookup_host(listen)
        .await?
        .next()
        .ok_or_else(|| std::io::Error::other(format!("{listen} resolves to no address")))?;
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    TcpListener::from_std(socket.into())
}

/// Serves on an already bound listener until the task is dropped.
pub async fn serve(listener: TcpListener, opts: Options) -> std::io::Result<()> {
    let responses = Arc::new(Responses::new(opts.body_bytes));
    let opts = Arc::new(opts);
    loop {
        let (stream, _peer): (TcpStream, SocketAddr) = match listener.accept().await {
            Ok(x) => x,
            Err(_) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let (responses, opts) = (responses.clone(), opts.clone());
        tokio::spawn(async move {
            if is_h2(&stream).await {
                serve_h2(stream, responses.body.clone(), opts.delay).await;
            } else {
                let _ = serve_h1(stream, &responses, &opts).await;
            }
        });
    }
}

async fn is_h2(stream: &TcpStream) -> bool {
    let mut buf = [0u8; 24];
    loop {
        match stream.peek(&mut buf).await {
            Ok(0) | Err(_) => return false,
            Ok(n) if !H2_PREFACE.starts_with(&buf[..n]) => return false,
            Ok(n) if n == H2_PREFACE.len() => return true,
            // A prefix of the preface so far: wait for more bytes.
            Ok(_) => {
                if stream.readable().await.is_err() {
                    return false;
                }
                tokio::task::yield_now().await;
            }
        }
    }
}

async fn serve_h2(stream: TcpStream, body: Bytes, delay: Duration) {
    let service = hyper::service::service_fn(move |_req| {
        let body = body.clone();
        async move {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            Ok::<_, Infallible>(http::Response::new(Full::new(body)))
        }
    });
    let _ = http2::Builder::new(TokioExecutor::new())
        .serve_connection(TokioIo::new(stream), service)
        .await;
}

async fn serve_h1(mut stream: TcpStream, r: &Responses, opts: &Options) -> std::io::Result<()> {
    let mut buf = BytesMut::with_capacity(8192);
    let mut out = BytesMut::with_capacity(8192);
    let mut served = 0u64;
    // Bytes of a request body still to skip.
    let mut skip = 0usize;
    let mut need_read = true;
    loop {
        if need_read && stream.read_buf(&mut buf).await? == 0 {
            return Ok(());
        }
        let mut close = false;
        need_read = false;
        loop {
            if skip > 0 {
                let n = skip.min(buf.len());
                buf.advance(n);
                skip -= n;
                if skip > 0 {
                    need_read = true;
                    break;
                }
            }
            let mut headers = [httparse::EMPTY_HEADER; 64];
            let mut req = httparse::Request::new(&mut headers);
            let (head_len, body_len, client_close, head) = match req.parse(&buf) {
                Ok(httparse::Status::Complete(n)) => {
                    let mut len = 0usize;
                    let mut client_close = req.version == Some(0);
                    for h in req.headers.iter() {
                        if h.name.eq_ignore_ascii_case("content-length") {
                            len = std::str::from_utf8(h.value)
                                .ok()
                                .and_then(|v| v.trim().parse().ok())
                                .unwrap_or(0);
                        } else if h.name.eq_ignore_ascii_case("connection") {
                            client_close = h.value.eq_ignore_ascii_case(b"close");
                        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                            // Chunked request bodies are not supported: answer and close.
                            client_close = true;
                        }
                    }
                    (n, len, client_close, req.method == Some("HEAD"))
                }
                Ok(httparse::Status::Partial) => {
                    need_read = true;
                    break;
                }
                Err(_) => {
                    stream
                        .write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                        .await?;
                    return Ok(());
                }
            };
            buf.advance(head_len);
            skip = body_len;
            served += 1;
            close = client_close
                || opts
                    .close_every
                    .is_some_and(|n| n > 0 && served.is_multiple_of(n));
            out.extend_from_slice(match (head, close) {
                (false, false) => &r.keep,
                (false, true) => &r.close,
                (true, false) => &r.head_keep,
                (true, true) => &r.head_close,
            });
            if close || !opts.delay.is_zero() {
                break;
            }
        }
        if !out.is_empty() {
            if !opts.delay.is_zero() {
                tokio::time::sleep(opts.delay).await;
            }
            stream.write_all(&out).await?;
            out.clear();
        }
        if close {
            let _ = stream.shutdown().await;
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// More connections than `TcpListener::bind`'s backlog of 128 wait in the accept queue
    /// of a listener that is not accepting yet, instead of having their SYNs dropped.
    #[tokio::test]
    async fn a_burst_of_connects_fits_in_the_accept_queue() {
        let listener = bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let connects = (0..400)
            .map(|_| tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(addr)));
        let done = futures_util::future::join_all(connects).await;
        let established = done.iter().filter(|r| matches!(r, Ok(Ok(_)))).count();
        assert_eq!(established, 400, "connects dropped by a full accept queue");
        drop(listener);
    }
}
