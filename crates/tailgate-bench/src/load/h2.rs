//! HTTP/2 (h2c with prior knowledge, or TLS with ALPN `h2`) through hyper's
//! `client::conn::http2`: one HTTP/2 connection per generator connection, one request in
//! flight on it at a time (the same model as HTTP/1.1, so the two compare).

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http2::{self, SendRequest};
use hyper_util::rt::{TokioExecutor, TokioIo};

use super::stream::Stream;
use super::target::Prepared;
use crate::stats::ErrorKind;

pub struct Conn {
    send: SendRequest<Full<Bytes>>,
}

impl Conn {
    /// Performs the HTTP/2 handshake and spawns the connection driver on the current
    /// (current-thread) runtime.
    pub async fn handshake(io: Stream) -> Result<Conn, ErrorKind> {
        let (send, conn) = http2::handshake(TokioExecutor::new(), TokioIo::new(io))
            .await
            .map_err(|_| ErrorKind::Connect)?;
        tokio::spawn(async move {
            // The driver ends when the connection closes; errors show up on requests.
            let _ = conn.await;
        });
        Ok(Conn { send })
    }

    /// Sends one request and reads its whole body. Returns the status and whether the
    /// connection is still usable.
    pub async fn exchange(&mut self, req: &Prepared) -> Result<(u16, bool), ErrorKind> {
        self.send.ready().await.map_err(|_| ErrorKind::Io)?;
        let mut r = http::Request::builder()
            .method(req.method.clone())
            .uri(req.h2_uri.clone())
            .body(Full::new(req.body.clone()))
            .map_err(|_| ErrorKind::Protocol)?;
        *r.headers_mut() = req.h2_headers.clone();
        let res = self.send.send_request(r).await.map_err(classify)?;
        let status = res.status().as_u16();
        let mut body = res.into_body();
        while let Some(frame) = body.frame().await {
            frame.map_err(classify)?;
        }
        Ok((status, !self.send.is_closed()))
    }
}

fn classify(e: hyper::Error) -> ErrorKind {
    if e.is_parse() || e.is_user() {
        ErrorKind::Protocol
    } else if e.is_timeout() {
        ErrorKind::Timeout
    } else {
        ErrorKind::Io
    }
}
