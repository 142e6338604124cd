//! The HTTP/1.1 fast path: a hand-written client connection.
//!
//! Why not hyper's client here: the generator must not be the bottleneck (it has to match wrk
//! on one core). Per request this path does one `write` of bytes serialized once per run, reads
//! into one reused buffer, parses the head with httparse and skips the body (content-length,
//! chunked, or until close) without allocating. hyper's client builds a `Request`, a header map
//! and a body stream per request and goes through a dispatcher task; that costs more than the
//! whole exchange here. HTTP/2 uses hyper (see `h2.rs`), where framing is too much to own.
//!
//! Measured 2026-11-21 (closed loop, 50 connections, 5 s, 3 alternating rounds, medians; each
//! tool on core 1 with `taskset -c 1`, `tailgate bench upstream` on core 0 with `taskset -c 0`;
//! shared 2-core VM, load average ~3 from other work): `tailgate bench run URL --closed -c 50
//! -d 5s --warmup 0s` vs `wrk -t1 -c50 -d5s URL` vs oha 1.16.0 `oha -z 5s -c 50 --no-tui URL`:
//! requests/s 1.08× wrk and 1.23× oha (the upstream, not the tools, was the limit); CPU time
//! per request 0.94× wrk and 0.62× oha (14.1 µs, 15.0 µs, 22.6 µs).

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::stats::ErrorKind;

const MAX_HEADERS: usize = 64;
/// A response head larger than this is a protocol error.
const MAX_HEAD: usize = 64 * 1024;

/// What the caller needs from a response.
#[derive(Debug, Clone, Copy)]
pub struct Response {
    pub status: u16,
    /// The server will close (or has closed) the connection after this response.
    pub close: bool,
}

/// One HTTP/1.1 client connection; requests are sent one at a time.
pub struct Conn<S> {
    io: S,
    buf: BytesMut,
}

enum BodyLen {
    None,
    Length(u64),
    Chunked,
    UntilClose,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Conn<S> {
    pub fn new(io: S) -> Self {
        Self {
            io,
            buf: BytesMut::with_capacity(16 * 1024),
        }
    }

    /// Writes `request` (a complete, pre-serialized request) and reads the whole response.
    pub async fn exchange(
        &mut self,
        request: &[u8],
        head_only: bool,
    ) -> Result<Response, ErrorKind> {
        // Bytes the last answer did not account for: what follows would be timed against
        // the wrong request (each answer then taken for the one after it).
        if !self.buf.is_empty() {
            return Err(ErrorKind::Protocol);
        }
        self.io
            .write_all(request)
            .await
            .map_err(|_| ErrorKind::Io)?;
        let (status, body, close, head_len) = loop {
            match parse_head(&self.buf, head_only)? {
                // An interim answer (`100 Continue`, `103 Early Hints`): the final one
                // follows; taken for it, it would leave that one to be taken for the next
                // request's, and every request after would look answered at once.
                Some((status, _, _, head_len)) if status / 100 == 1 && status != 101 => {
                    self.buf.advance(head_len);
                    continue;
                }
                Some(parsed) => break parsed,
                None => {}
            }
            if self.buf.len() > MAX_HEAD {
                return Err(ErrorKind::Protocol);
            }
            self.fill().await?;
        };
        self.buf.advance(head_len);
        let close = match body {
            BodyLen::None => close,
            BodyLen::Length(n) => {
                self.skip(n).await?;
                close
            }
            BodyLen::Chunked => {
                self.skip_chunked().await?;
                close
            }
            BodyLen::UntilClose => {
                // No stack scratch array here: it would make every exchange future (moved
                // into its timeout per request) 8 KiB larger.
                loop {
                    self.buf.clear();
                    if self.buf.capacity() < 4096 {
                        self.buf.reserve(16 * 1024);
                    }
                    if self
                        .io
                        .read_buf(&mut self.buf)
                        .await
                        .map_err(|_| ErrorKind::Io)?
                        == 0
                    {
                        break;
                    }
                }
                true
            }
        };
        Ok(Response { status, close })
    }

    /// Reads more bytes into the buffer; a clean EOF here is an I/O error (the peer closed
    /// mid-exchange, e.g. a keep-alive connection it had already given up on).
    async fn fill(&mut self) -> Result<(), ErrorKind> {
        if self.buf.capacity() - self.buf.len() < 4096 {
            self.buf.reserve(16 * 1024);
        }
        match self.io.read_buf(&mut self.buf).await {
            Ok(0) | Err(_) => Err(ErrorKind::Io),
            Ok(_) => Ok(()),
        }
    }

    async fn skip(&mut self, mut n: u64) -> Result<(), ErrorKind> {
        loop {
            let have = self.buf.len() as u64;
            if have >= n {
                self.buf.advance(n as usize);
                return Ok(());
            }
            n -= have;
            self.buf.clear();
            self.fill().await?;
        }
    }

    async fn skip_chunked(&mut self) -> Result<(), ErrorKind> {
        loop {
            let (consumed, size) = loop {
                match httparse::parse_chunk_size(&self.buf) {
                    Ok(httparse::Status::Complete(x)) => break x,
                    Ok(httparse::Status::Partial) => self.fill().await?,
                    Err(_) => return Err(ErrorKind::Protocol),
                }
            };
            self.buf.advance(consumed);
            if size == 0 {
                // Trailers, then an empty line.
                loop {
                    match find_crlf(&self.buf) {
                        Some(0) => {
                            self.buf.advance(2);
                            return Ok(());
                        }
                        Some(i) => self.buf.advance(i + 2),
                        None => self.fill().await?,
                    }
                }
            }
            self.skip(size + 2).await?;
        }
    }
}

fn find_crlf(b: &[u8]) -> Option<usize> {
    b.windows(2).position(|w| w == b"\r\n")
}

type Head = (u16, BodyLen, bool, usize);

fn parse_head(buf: &[u8], head_only: bool) -> Result<Option<Head>, ErrorKind> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut res = httparse::Response::new(&mut headers);
    let head_len = match res.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(_) => return Err(ErrorKind::Protocol),
    };
    let status = res.code.ok_or(ErrorKind::Protocol)?;
    let mut close = res.version == Some(0);
    let mut length = None;
    let mut chunked = false;
    for h in res.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            let v = std::str::from_utf8(h.value).map_err(|_| ErrorKind::Protocol)?;
            length = Some(v.trim().parse::<u64>().map_err(|_| ErrorKind::Protocol)?);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            // The last coding, in any case (RFC 9112 §6.1: coding names are
            // case-insensitive).
            chunked = h
                .value
                .rsplit(|&b| b == b',')
                .next()
                .is_some_and(|t| t.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        } else if h.name.eq_ignore_ascii_case("connection") {
            if contains_token(h.value, b"close") {
                close = true;
            } else if contains_token(h.value, b"keep-alive") {
                close = false;
            }
        }
    }
    let body = if head_only || status / 100 == 1 || status == 204 || status == 304 {
        BodyLen::None
    } else if chunked {
        BodyLen::Chunked
    } else if let Some(n) = length {
        BodyLen::Length(n)
    } else {
        BodyLen::UntilClose
    };
    Ok(Some((status, body, close, head_len)))
}

fn contains_token(value: &[u8], token: &[u8]) -> bool {
    value
        .split(|&b| b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    async fn roundtrip(response: &'static [u8]) -> (Result<Response, ErrorKind>, Vec<u8>) {
        let (client, mut server) = tokio::io::duplex(64);
        let task = tokio::spawn(async move {
            let mut req = [0u8; 4];
            server.read_exact(&mut req).await.unwrap();
            // Dribble the response in small pieces to exercise partial parsing.
            for piece in response.chunks(7) {
                server.write_all(piece).await.unwrap();
            }
            server.write_all(b"NEXT").await.unwrap();
        });
        let mut c = Conn::new(client);
        let r = c.exchange(b"GET ", false).await;
        task.await.unwrap();
        if r.is_ok() && !r.unwrap().close {
            while c.buf.len() < 4 {
                c.fill().await.unwrap();
            }
        }
        (r, c.buf.to_vec())
    }

    #[tokio::test]
    async fn content_length_body_is_skipped_exactly() {
        let (r, rest) = roundtrip(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello").await;
        let r = r.unwrap();
        assert_eq!((r.status, r.close), (200, false));
        assert_eq!(rest, b"NEXT");
    }

    #[tokio::test]
    async fn chunked_body_with_trailer_is_skipped_exactly() {
        let (r, rest) = roundtrip(
            b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n3;x=y\r\nabc\r\n0\r\nX-T: 1\r\n\r\n",
        )
        .await;
        assert_eq!(r.unwrap().status, 404);
        assert_eq!(rest, b"NEXT");
    }

    #[tokio::test]
    async fn connection_close_is_reported() {
        let (r, _) =
            roundtrip(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n").await;
        assert!(r.unwrap().close);
    }

    /// An interim answer is passed over: the final one is the request's, and the next
    /// request's answer is not taken from it.
    #[tokio::test]
    async fn an_interim_answer_is_not_taken_for_the_final_one() {
        let (r, rest) = roundtrip(
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok",
        )
        .await;
        assert_eq!(r.unwrap().status, 201);
        assert_eq!(rest, b"NEXT");
    }

    #[tokio::test]
    async fn chunked_is_a_coding_name_in_any_case() {
        let (r, rest) = roundtrip(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, Chunked \r\n\r\n2\r\nok\r\n0\r\n\r\n",
        )
        .await;
        assert_eq!(r.unwrap().status, 200);
        assert_eq!(rest, b"NEXT");
    }

    /// Bytes left over from the last answer make the next exchange fail, not time the
    /// next request against them.
    #[tokio::test]
    async fn bytes_left_over_fail_the_next_exchange() {
        let (client, mut server) = tokio::io::duplex(256);
        let mut c = Conn::new(client);
        server
            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n")
            .await
            .unwrap();
        assert_eq!(c.exchange(b"GET ", false).await.unwrap().status, 200);
        assert_eq!(
            c.exchange(b"GET ", false).await.unwrap_err(),
            ErrorKind::Protocol
        );
    }

    #[tokio::test]
    async fn garbage_is_a_protocol_error() {
        let (r, _) = roundtrip(b"SMTP ready\r\n\r\n").await;
        assert_eq!(r.unwrap_err(), ErrorKind::Protocol);
    }
}
