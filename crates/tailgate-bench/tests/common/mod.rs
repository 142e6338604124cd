//! In-test upstreams: real sockets on 127.0.0.1:0, each on its own thread and runtime
//! (the generator under test is blocking and starts its own threads).
#![allow(dead_code)]
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[path = "../../../tailgate/tests/common/dead_port.rs"]
mod dead_port;
#[allow(unused_imports)]
pub use dead_port::dead_port;
mod run_limited;
#[allow(unused_imports)]
pub use run_limited::run_limited;

/// How the test upstream misbehaves.
#[derive(Clone, Default)]
pub struct Behaviour {
    /// The n-th request overall (1-based) is answered after this delay.
    pub stall: Option<(u64, Duration)>,
    /// `Connection: close` on every n-th response of a connection.
    pub close_every: Option<u64>,
    /// Accept connections, read, never answer.
    pub silent: bool,
}

pub struct TestUpstream {
    pub addr: SocketAddr,
    /// Requests received so far.
    pub requests: Arc<AtomicU64>,
    /// Requests for path `/a`.
    pub hits_a: Arc<AtomicU64>,
}

impl TestUpstream {
    pub fn url(&self) -> String {
        format!("http://{}/", self.addr)
    }
    pub fn count(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }
}

/// Starts a minimal HTTP/1.1 server (GET only, no bodies) that counts requests.
pub fn start(b: Behaviour) -> TestUpstream {
    let requests = Arc::new(AtomicU64::new(0));
    let counter = requests.clone();
    let hits_a = Arc::new(AtomicU64::new(0));
    let a_counter = hits_a.clone();
    let addr = serve_on_thread(move |l| async move {
        loop {
            let (mut s, _) = l.accept().await.unwrap();
            let (b, counter, a_counter) = (b.clone(), counter.clone(), a_counter.clone());
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut on_conn = 0u64;
                let mut chunk = [0u8; 4096];
                loop {
                    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                        continue;
                    };
                    if buf.starts_with(b"GET /a ") {
                        a_counter.fetch_add(1, Ordering::SeqCst);
                    }
                    buf.drain(..end + 4);
                    let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
                    on_conn += 1;
                    if b.silent {
                        continue;
                    }
                    if let Some((at, d)) = b.stall
                        && at == n
                    {
                        tokio::time::sleep(d).await;
                    }
                    let close = b.close_every.is_some_and(|e| on_conn.is_multiple_of(e));
                    let resp: &[u8] = if close {
                        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
                    } else {
                        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
                    };
                    if s.write_all(resp).await.is_err() || close {
                        return;
                    }
                }
            });
        }
    });
    TestUpstream {
        addr,
        requests,
        hits_a,
    }
}

/// The `tailgate-bench` binary.
pub fn bench() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tailgate-bench"))
}

/// Runs a test server on its own thread with a current-thread runtime: `serve` gets a
/// listener bound to a free loopback port, whose address is returned.
pub fn serve_on_thread<F, Fut>(serve: F) -> std::net::SocketAddr
where
    F: FnOnce(tokio::net::TcpListener) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(l.local_addr().unwrap()).unwrap();
            serve(l).await;
        });
    });
    rx.recv().unwrap()
}
