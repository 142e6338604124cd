//! A per-endpoint pool of HTTP/1.1 keep-alive connections, built on `hyper::client::conn`
//! (hyper-util's legacy pool cannot cap requests per connection or lifetime, nor pre-connect,
//! which the pool must grow into).
//!
//! Idle connections are kept most-recently-used first: the hottest connection is reused, the
//! coldest expire after `idle_timeout` (kept below common server keep-alive timeouts, so the
//! server rarely closes one under us).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::config::Cluster;
use crate::pipeline::body::ReqBody;
use crate::pipeline::error::ProxyError;

struct Idle {
    sender: http1::SendRequest<ReqBody>,
    since: Instant,
}

/// The pool of one endpoint on one worker.
pub struct EndpointPool {
    pub addr: SocketAddr,
    // Held only for a push or pop, never across an await; one worker uses it.
    idle: Mutex<VecDeque<Idle>>,
    max_idle: usize,
    idle_timeout: Duration,
    connect_timeout: Duration,
}

/// A connection checked out of the pool for one request.
pub struct Conn {
    pub sender: http1::SendRequest<ReqBody>,
    pub pool: Arc<EndpointPool>,
    /// It had served a request before (no connect was paid).
    pub reused: bool,
}

impl Conn {
    /// Gives the connection back after its response was read to the end.
    pub fn release(self) {
        if !self.sender.is_closed() {
            self.pool.put(self.sender);
        }
    }
}

impl EndpointPool {
    pub fn new(addr: SocketAddr, cluster: &Cluster) -> EndpointPool {
        EndpointPool {
            addr,
            idle: Mutex::new(VecDeque::new()),
            max_idle: cluster.max_idle_per_endpoint,
            idle_timeout: cluster.idle_timeout,
            connect_timeout: cluster.connect_timeout,
        }
    }

    fn put(&self, sender: http1::SendRequest<ReqBody>) {
        if self.max_idle == 0 {
            return;
        }
        let now = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        while idle
            .front()
            .is_some_and(|i| now.duration_since(i.since) >= self.idle_timeout)
        {
            idle.pop_front();
        }
        if idle.len() >= self.max_idle {
            idle.pop_front();
        }
        idle.push_back(Idle { sender, since: now });
    }

    fn pop(&self) -> Option<Idle> {
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop_back()
    }

    /// A ready connection: the most recently used idle one that is still open, else a new one.
    pub async fn checkout(self: &Arc<Self>) -> Result<Conn, ProxyError> {
        while let Some(mut idle) = self.pop() {
            if idle.since.elapsed() >= self.idle_timeout || idle.sender.is_closed() {
                continue;
            }
            let conn = |sender| Conn {
                sender,
                pool: self.clone(),
                reused: true,
            };
            if idle.sender.is_ready() {
                return Ok(conn(idle.sender));
            }
            // Not ready yet: the connection task has not caught up with the end of the last
            // response, or (rarely) the last request's body is still being written after an
            // early answer. Wait a bounded time, never indefinitely; an error means the
            // server closed it while idle.
            if let Ok(Ok(())) =
                tokio::time::timeout(self.connect_timeout, idle.sender.ready()).await
            {
                return Ok(conn(idle.sender));
            }
        }
        self.connect().await
    }

    /// A new connection, bypassing the idle list.
    pub async fn connect(self: &Arc<Self>) -> Result<Conn, ProxyError> {
        let stream =
            match tokio::time::timeout(self.connect_timeout, TcpStream::connect(self.addr)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => return Err(ProxyError::UpstreamConnect(e)),
                Err(_) => return Err(ProxyError::ConnectTimeout),
            };
        let _ = stream.set_nodelay(true);
        let (sender, conn) = http1::Builder::new()
            .handshake(TokioIo::new(stream))
            .await
            .map_err(ProxyError::UpstreamReset)?;
        let addr = self.addr;
        tokio::spawn(async move {
            if let Err(e) = conn.with_upgrades().await {
                tracing::debug!(upstream.addr = %addr, error = %e, "upstream connection ended with an error");
            }
        });
        Ok(Conn {
            sender,
            pool: self.clone(),
            reused: false,
        })
    }

    /// Idle connections held now (for tests and stats).
    pub fn idle_len(&self) -> usize {
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}
