//! What an HTTP/2 connection holds for a client that reads nothing. On its own in this
//! binary: it measures the process's resident memory, which another test running beside it
//! would move.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http_body_util::BodyExt;
use tokio::net::TcpStream;

/// Reads nothing once `stop` is set: a client that stops reading its socket.
struct StopReading {
    inner: TcpStream,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl tokio::io::AsyncRead for StopReading {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.stop.load(std::sync::atomic::Ordering::SeqCst) {
            return std::task::Poll::Pending;
        }
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for StopReading {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The process's resident memory, in bytes.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    statm
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 4096
}

/// An HTTP/2 client that opens every stream it may, with the largest flow-control windows,
/// and then reads nothing, makes the gateway hold little of their answers: each stream's
/// send buffer is 64 KiB. hyper's default, 400 KiB a stream, held 80 MiB for one such
/// connection until the send timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_client_that_reads_nothing_makes_the_gateway_hold_little() {
    let up = upstream(|_| async {
        let chunks = futures_util::stream::iter((0..256).map(|_| {
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(hyper::body::Frame::data(
                Bytes::from(vec![b'x'; 16 << 10]),
            ))
        }));
        http::Response::new(http_body_util::StreamBody::new(chunks).boxed())
    })
    .await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\n");
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let tcp = sock.connect(gw.addr).await.unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let io = StopReading {
        inner: tcp,
        stop: stop.clone(),
    };
    let (client, conn) = h2::client::Builder::new()
        .initial_window_size(i32::MAX as u32)
        .initial_connection_window_size(i32::MAX as u32)
        .handshake::<_, Bytes>(io)
        .await
        .unwrap();
    tokio::spawn(conn);
    let before = rss();
    // From here the client reads nothing: it only sends its requests.
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut answers = Vec::new();
    let mut client = client;
    for _ in 0..200 {
        client = client.ready().await.unwrap();
        let req = http::Request::get("http://a/big").body(()).unwrap();
        // (Kept: a dropped one would reset its stream.)
        answers.push(client.send_request(req, true).unwrap());
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let grown = rss().saturating_sub(before);
    // (The process's memory: the gateway's and this test's upstream's, behind 200
    // connections. It grew by 93 MiB with hyper's default, by 43 MiB with 64 KiB.)
    assert!(
        grown < 68 << 20,
        "the gateway holds {} MiB for a client that reads nothing",
        grown >> 20
    );
    drop(answers);
}
