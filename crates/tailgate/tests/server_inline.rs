//! The inline HTTP/1.1 server (`server::h1_inline`) on real sockets: pipelining within it and
//! across the handover to hyper's server, heads in pieces, timeouts, shutdown, HTTP/1.0,
//! HEAD/204/304 and response framing, as clients and upstreams see them.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const WAIT: Duration = Duration::from_secs(10);

/// One response read off the wire.
#[derive(Debug)]
struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// The body ended where its framing said (false: cut short by the end of the bytes).
    complete: bool,
}

impl Resp {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn body(&self) -> &str {
        std::str::from_utf8(&self.body).unwrap()
    }
}

/// Splits `raw` into the responses it holds; `heads[i]` says whether the i-th answers a HEAD
/// request (its body is empty whatever its headers say). A body with neither length nor
/// chunked framing runs to the end of `raw`.
fn responses(mut raw: &[u8], heads: &[bool]) -> Vec<Resp> {
    let mut out = Vec::new();
    while !raw.is_empty() {
        let mut hs = [httparse::EMPTY_HEADER; 64];
        let mut r = httparse::Response::new(&mut hs);
        let n = match r.parse(raw) {
            Ok(httparse::Status::Complete(n)) => n,
            other => panic!(
                "not a response head ({other:?}): {:?}",
                String::from_utf8_lossy(raw)
            ),
        };
        let status = r.code.unwrap();
        let headers: Vec<(String, String)> = r
            .headers
            .iter()
            .map(|h| {
                (
                    h.name.to_ascii_lowercase(),
                    String::from_utf8_lossy(h.value).into_owned(),
                )
            })
            .collect();
        raw = &raw[n..];
        let get = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
        };
        let head_req = heads.get(out.len()).copied().unwrap_or(false);
        let mut resp = Resp {
            status,
            headers: headers.clone(),
            body: Vec::new(),
            complete: true,
        };
        if head_req || (100..200).contains(&status) || status == 204 || status == 304 {
        } else if get("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
            resp.complete = false;
            loop {
                let Some(eol) = raw.windows(2).position(|w| w == b"\r\n") else {
                    raw = &[];
                    break;
                };
                let size = usize::from_str_radix(
                    std::str::from_utf8(&raw[..eol])
                        .unwrap()
                        .split(';')
                        .next()
                        .unwrap(),
                    16,
                )
                .unwrap();
                raw = &raw[eol + 2..];
                if size == 0 {
                    assert!(raw.starts_with(b"\r\n"), "trailers are not expected");
                    raw = &raw[2..];
                    resp.complete = true;
                    break;
                }
                if raw.len() < size + 2 {
                    resp.body.extend_from_slice(&raw[..size.min(raw.len())]);
                    raw = &[];
                    break;
                }
                resp.body.extend_from_slice(&raw[..size]);
                assert_eq!(&raw[size..size + 2], b"\r\n");
                raw = &raw[size + 2..];
            }
        } else if let Some(len) = get("content-length") {
            let len: usize = len.parse().unwrap();
            let have = len.min(raw.len());
            resp.body.extend_from_slice(&raw[..have]);
            resp.complete = have == len;
            raw = &raw[have..];
        } else {
            resp.body.extend_from_slice(raw);
            raw = &[];
        }
        out.push(resp);
    }
    out
}

/// An upstream that answers with the request's method and path as its body, after the
/// delay in milliseconds the query `delay=` names; it counts the requests it sees.
async fn path_upstream() -> (SocketAddr, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    let addr = upstream(move |req: http::Request<Incoming>| {
        h.fetch_add(1, Ordering::SeqCst);
        async move {
            let delay = req
                .uri()
                .query()
                .and_then(|q| q.strip_prefix("delay="))
                .map_or(0, |d| d.parse().unwrap());
            if delay > 0 {
                tokio::time::sleep(Duration::from_millis(delay)).await;
            }
            let (parts, body) = req.into_parts();
            let got = body.collect().await.unwrap().to_bytes();
            let mut text = format!("{} {}", parts.method, parts.uri.path());
            if !got.is_empty() {
                text.push(' ');
                text.push_str(std::str::from_utf8(&got).unwrap());
            }
            http::Response::new(full(text))
        }
    })
    .await;
    (addr, hits)
}

/// An upstream body of unknown length (the upstream sends it chunked).
fn streamed(parts: &[&'static str]) -> TestBody {
    let frames: Vec<Result<Frame<Bytes>, Box<dyn std::error::Error + Send + Sync>>> = parts
        .iter()
        .map(|p| Ok(Frame::data(Bytes::from_static(p.as_bytes()))))
        .collect();
    StreamBody::new(futures_util::stream::iter(frames)).boxed()
}

async fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).await.unwrap();
    s.set_nodelay(true).unwrap();
    s
}

/// Reads until `n` responses (none to HEAD) are complete on `s`, or the peer closes.
async fn read_responses(s: &mut TcpStream, n: usize) -> Vec<Resp> {
    let mut raw = Vec::new();
    let mut buf = [0u8; 8192];
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if !raw.is_empty() {
            let got = responses(&raw, &[]);
            if got.len() >= n && got.iter().all(|r| r.complete) {
                return got;
            }
        }
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return responses(&raw, &[]),
            Ok(Ok(k)) => raw.extend_from_slice(&buf[..k]),
            Err(_) => panic!(
                "no {n} responses in time: {:?}",
                String::from_utf8_lossy(&raw)
            ),
        }
    }
}

fn get_req(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: a\r\n\r\n")
}

/// A client that sends pipelined requests and then closes its sending side (as
/// `printf ... | nc -N` or a script calling `shutdown(SHUT_WR)` does) still gets the answer
/// to the first: hyper's server only watched for the client's end of stream while it had
/// no pipelined bytes left to serve.
#[tokio::test]
async fn ri_pipelined_requests_then_half_close_get_the_first_answer() {
    let (up, _) = path_upstream().await;
    let gw = TestGateway::to(up, "");
    let mut s = connect(gw.addr).await;
    let req = format!("{}{}", get_req("/a?delay=300"), get_req("/b?delay=300"));
    s.write_all(req.as_bytes()).await.unwrap();
    s.shutdown().await.unwrap();
    let (text, closed) = read_until_close(&mut s, WAIT).await;
    assert!(closed, "{text:?}");
    let got = responses(text.as_bytes(), &[]);
    assert!(
        !got.is_empty(),
        "the first pipelined request was cancelled: no answer at all"
    );
    assert_eq!(got[0].status, 200, "{text:?}");
    assert_eq!(got[0].body(), "GET /a", "{text:?}");
}

/// Inline GETs, then a chunked POST (hyper's server takes the connection from there), then
/// more GETs, all in one write: every one answered, in order, and the connection closed
/// after the one that asked for it.
#[tokio::test]
async fn ri_pipelined_requests_across_the_handover_are_answered_in_order() {
    let (up, hits) = path_upstream().await;
    let gw = TestGateway::to(up, "");
    let mut s = connect(gw.addr).await;
    let req = [
        get_req("/1?delay=100"),
        get_req("/2"),
        "POST /3 HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n\r\nbody".to_owned(),
        "POST /4 HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
            .to_owned(),
        get_req("/5?delay=50"),
        "GET /6 HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n".to_owned(),
        get_req("/never"),
    ]
    .concat();
    s.write_all(req.as_bytes()).await.unwrap();
    let (text, closed) = read_until_close(&mut s, WAIT).await;
    assert!(closed, "closed after `Connection: close`: {text:?}");
    let got = responses(text.as_bytes(), &[]);
    let bodies: Vec<&str> = got.iter().map(Resp::body).collect();
    assert_eq!(
        bodies,
        [
            "GET /1",
            "GET /2",
            "POST /3 body",
            "POST /4 hello",
            "GET /5",
            "GET /6"
        ],
        "{text:?}"
    );
    assert!(got.iter().all(|r| r.status == 200 && r.complete));
    assert_eq!(got[5].header("connection"), Some("close"));
    assert_eq!(hits.load(Ordering::SeqCst), 6, "nothing after the close");
}

/// The same across several writes: inline requests, the handover in the middle of a chunked
/// body arriving in pieces, then requests hyper's server reads.
#[tokio::test]
async fn ri_handover_in_the_middle_of_a_chunked_body_loses_no_bytes() {
    let (up, _) = path_upstream().await;
    let gw = TestGateway::to(up, "");
    let mut s = connect(gw.addr).await;
    s.write_all(get_req("/1").as_bytes()).await.unwrap();
    assert_eq!(read_responses(&mut s, 1).await[0].body(), "GET /1");
    s.write_all(b"POST /2 HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nab")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    s.write_all(b"c\r\n0\r\n\r\nGET /3 HTTP/1.1\r\nHost: a\r\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    s.write_all(b"\r\n").await.unwrap();
    let got = read_responses(&mut s, 2).await;
    let bodies: Vec<&str> = got.iter().map(Resp::body).collect();
    assert_eq!(bodies, ["POST /2 abc", "GET /3"]);
    // A POST whose Content-Length body comes in a later write goes the same way.
    s.write_all(b"POST /4 HTTP/1.1\r\nHost: a\r\nContent-Length: 6\r\n\r\nab")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    s.write_all(b"cdef").await.unwrap();
    assert_eq!(read_responses(&mut s, 1).await[0].body(), "POST /4 abcdef");
}

/// A head sent one byte per write is served, and so is the next request on the connection.
#[tokio::test]
async fn ri_head_split_byte_by_byte_is_served() {
    let (up, _) = path_upstream().await;
    let gw = TestGateway::to(up, "");
    let mut s = connect(gw.addr).await;
    let req = b"POST /split HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nxyz";
    for b in req {
        s.write_all(&[*b]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(read_responses(&mut s, 1).await[0].body(), "POST /split xyz");
    s.write_all(get_req("/next").as_bytes()).await.unwrap();
    assert_eq!(read_responses(&mut s, 1).await[0].body(), "GET /next");
}

/// Pipelined requests, one with a small body, sent two bytes at a time: each is served, in
/// order (the heads are parsed as their lines end, the body once it is all here; a head
/// still unparsed at the header timeout would be cut off unanswered).
#[tokio::test]
async fn ri_pipelined_requests_in_small_pieces_are_served_in_order() {
    let (up, hits) = path_upstream().await;
    let gw = TestGateway::to(
        up,
        "[server]\nworkers = 1\nheader_read_timeout = \"5s\"\nidle_timeout = \"60s\"\n",
    );
    let mut s = connect(gw.addr).await;
    let mut wire = b"\r\nPOST /one HTTP/1.1\r\nHost: a\r\nX-Pad: ".to_vec();
    wire.extend_from_slice(&[b'p'; 300]);
    wire.extend_from_slice(b"\r\nContent-Length: 5\r\n\r\nhello");
    // Empty lines before a request line are skipped (RFC 9112 §2.2).
    wire.extend_from_slice(b"\r\n\r\n");
    wire.extend_from_slice(get_req("/two").as_bytes());
    for piece in wire.chunks(2) {
        s.write_all(piece).await.unwrap();
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let got = read_responses(&mut s, 2).await;
    assert_eq!(got[0].body(), "POST /one hello");
    assert_eq!(got[1].body(), "GET /two");
    assert_eq!(hits.load(Ordering::SeqCst), 2);
}

/// A head already wrong whose bytes stop in the middle of a line is refused with the
/// gateway's answer when it is given up on, at the header timeout or the end of the
/// stream, not closed in silence; on the inline server and behind the smuggling guard
/// (after a chunked request handed the connection to hyper's server).
#[tokio::test]
async fn ri_a_wrong_head_cut_off_mid_line_gets_its_refusal() {
    let (up, hits) = path_upstream().await;
    let gw = TestGateway::to(
        up,
        "[server]\nworkers = 1\nheader_read_timeout = \"300ms\"\nidle_timeout = \"60s\"\n",
    );
    // The wrong bytes come after the head's last line was parsed, with no line end after
    // them: no read gives a reason to parse them again.
    let (good, wrong) = ("GET /w HTTP/1.1\r\nHost: a\r\n", "Bad\x01name: v");
    let chunked =
        "POST /c HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n";
    let send = |s: TcpStream, before: &'static str| async move {
        let mut s = s;
        s.write_all(format!("{before}{good}").as_bytes())
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        s.write_all(wrong.as_bytes()).await.unwrap();
        s
    };
    for before in ["", chunked] {
        // Left waiting: refused at the header timeout.
        let mut s = send(connect(gw.addr).await, before).await;
        let (text, closed) = read_until_close(&mut s, WAIT).await;
        assert!(closed, "{text:?}");
        let got = responses(text.as_bytes(), &[]);
        let last = got.last().unwrap_or_else(|| panic!("no answer: {text:?}"));
        assert_eq!(last.status, 400, "{text:?}");
        assert!(last.body().contains("\"request_id\""), "{text:?}");
        assert_eq!(got.len(), if before.is_empty() { 1 } else { 2 }, "{text:?}");

        // Cut off by the end of the stream: refused too.
        let mut s = send(connect(gw.addr).await, before).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        s.shutdown().await.unwrap();
        let (text, closed) = read_until_close(&mut s, WAIT).await;
        assert!(closed, "{text:?}");
        let got = responses(text.as_bytes(), &[]);
        let last = got.last().unwrap_or_else(|| panic!("no answer: {text:?}"));
        assert_eq!(last.status, 400, "{text:?}");
        assert!(last.body().contains("\"request_id\""), "{text:?}");
        assert_eq!(got.len(), if before.is_empty() { 1 } else { 2 }, "{text:?}");
    }
    // Only the chunked requests reached the upstream.
    assert_eq!(hits.load(Ordering::SeqCst), 2);
}

/// A head that never completes is cut off after `header_read_timeout`, without an answer
/// and without reaching the upstream; so is a pipelined head left incomplete after a
/// request served inline.
#[tokio::test]
async fn ri_partial_head_is_closed_after_the_header_timeout() {
    let (up, hits) = path_upstream().await;
    let gw = TestGateway::to(
        up,
        "[server]\nworkers = 1\nheader_read_timeout = \"300ms\"\nidle_timeout = \"60s\"\n",
    );
    let (text, closed) = raw(gw.addr, b"GET / HTTP/1.1\r\nHost: a\r\n", WAIT).await;
    assert!(closed && text.is_empty(), "{text:?}");
    // So is one that could still be HTTP/2's preface, as every POST, PUT and PATCH begins:
    // it used to be left to the idle timeout.
    for start in [&b"P"[..], b"PRI * HTTP/2.0\r\n"] {
        let (text, closed) = raw(gw.addr, start, WAIT).await;
        assert!(closed && text.is_empty(), "{start:?}: {text:?}");
    }

    let mut s = connect(gw.addr).await;
    let req = format!("{}GET /b HTTP/1.1\r\nHo", get_req("/a"));
    s.write_all(req.as_bytes()).await.unwrap();
    let (text, closed) = read_until_close(&mut s, WAIT).await;
    assert!(closed, "{text:?}");
    let got = responses(text.as_bytes(), &[]);
    assert_eq!(got.len(), 1, "{text:?}");
    assert_eq!(got[0].body(), "GET /a");
    assert_eq!(hits.load(Ordering::SeqCst), 1);
}

/// A small body's wait is timed on its own: a head that took most of `header_read_timeout`
/// to arrive, followed by a body that comes within that timeout of the head, is served
/// (the head's timer, left running, cut it off with no answer).
#[tokio::test]
async fn ri_small_body_gets_its_own_timer_after_a_slow_head() {
    let (up, _) = path_upstream().await;
    let gw = TestGateway::to(
        up,
        "[server]\nworkers = 1\nheader_read_timeout = \"2s\"\nidle_timeout = \"60s\"\n",
    );
    let mut s = connect(gw.addr).await;
    s.write_all(b"POST /slow HTTP/1.1\r\nHost: a\r\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    s.write_all(b"Content-Length: 3\r\n\r\nx").await.unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    s.write_all(b"yz").await.unwrap();
    assert_eq!(read_responses(&mut s, 1).await[0].body(), "POST /slow xyz");
}

/// A small body (served inline) that stops coming gets `408 client_body_timeout` once the
/// socket has been dry for `header_read_timeout`, as a larger one (read by hyper's server)
/// does, and the connection closes; the upstream never sees it.
#[tokio::test]
async fn ri_a_small_body_that_stops_gets_408() {
    let (up, hits) = path_upstream().await;
    let gw = TestGateway::to(
        up,
        "[server]\nworkers = 1\nheader_read_timeout = \"300ms\"\nidle_timeout = \"60s\"\n",
    );
    let (text, closed) = raw(
        gw.addr,
        b"POST /stalled HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n0123456789",
        WAIT,
    )
    .await;
    assert!(closed, "{text:?}");
    let got = responses(text.as_bytes(), &[]);
    assert_eq!(got.len(), 1, "{text:?}");
    assert_eq!(got[0].status, 408, "{text:?}");
    assert_eq!(got[0].header("connection"), Some("close"), "{text:?}");
    assert!(got[0].body().contains("client_body_timeout"), "{text:?}");
    assert!(got[0].body().contains("\"request_id\""), "{text:?}");
    assert_eq!(hits.load(Ordering::SeqCst), 0);
}

/// A gateway with a 300 ms header timeout (and a 60 s idle timeout), and a connection on
/// which a chunked request (handing the connection to hyper's server) that the upstream
/// answers after 900 ms is followed by the start of a pipelined head; returns once that
/// request's answer has arrived.
async fn partial_head_behind_a_slow_request() -> (TestGateway, TcpStream, Arc<AtomicUsize>) {
    let (up, hits) = path_upstream().await;
    let gw = TestGateway::to(
        up,
        "[server]\nworkers = 1\nheader_read_timeout = \"300ms\"\nidle_timeout = \"60s\"\n",
    );
    let mut s = connect(gw.addr).await;
    s.write_all(
        b"POST /a?delay=900 HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\nGET /b HTTP/1.1\r\nHo",
    )
    .await
    .unwrap();
    let got = read_responses(&mut s, 1).await;
    assert_eq!(
        got[0].body(),
        "POST /a ok",
        "the request in flight is answered"
    );
    (gw, s, hits)
}

/// On a connection hyper's server took, a pipelined head left incomplete while the request
/// before it waits for a slow upstream does not start its header timer until that request
/// is answered: the answer arrives, then the incomplete head still gets its full
/// `header_read_timeout`, as nginx times a head only once it starts reading it.
#[tokio::test]
async fn ri_pipelined_partial_head_waits_for_the_request_in_flight() {
    let (_gw, mut s, hits) = partial_head_behind_a_slow_request().await;
    // The head's timer started with the answer: the rest of it, sent at once, is in time.
    s.write_all(b"st: a\r\n\r\n").await.unwrap();
    let got = read_responses(&mut s, 1).await;
    assert_eq!(got[0].body(), "GET /b");
    assert_eq!(hits.load(Ordering::SeqCst), 2);
    // And a head left incomplete after that is still cut off by the timer.
    s.write_all(b"GET /c HTTP/1.1\r\nHo").await.unwrap();
    let (text, closed) = read_until_close(&mut s, WAIT).await;
    assert!(closed && text.is_empty(), "{text:?}");
    assert_eq!(hits.load(Ordering::SeqCst), 2);
}

/// The same pipelined head, with nothing more sent after it: cut off `header_read_timeout`
/// after the answer before it, not left for the idle timeout (60 s here).
#[tokio::test]
async fn ri_pipelined_partial_head_left_silent_is_cut_off_after_the_answer() {
    let (_gw, mut s, hits) = partial_head_behind_a_slow_request().await;
    let (text, closed) = read_until_close(&mut s, WAIT).await;
    assert!(closed && text.is_empty(), "{text:?}");
    assert_eq!(hits.load(Ordering::SeqCst), 1);
}

/// A connection with nothing in flight is closed after `idle_timeout`; one with a slow
/// request in flight is not cut off by it.
#[tokio::test]
async fn ri_idle_timeout_closes_an_idle_connection_not_a_busy_one() {
    let (up, _) = path_upstream().await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\nidle_timeout = \"300ms\"\n");
    let mut s = connect(gw.addr).await;
    s.write_all(get_req("/slow?delay=800").as_bytes())
        .await
        .unwrap();
    let got = read_responses(&mut s, 1).await;
    assert_eq!(got[0].body(), "GET /slow");
    assert_eq!(got[0].header("connection"), None, "kept alive");
    let (text, closed) = read_until_close(&mut s, WAIT).await;
    assert!(closed && text.is_empty(), "{text:?}");
}

/// HEAD: the headers a GET would have (the length included), no body, and the connection
/// goes on with the next request.
#[tokio::test]
async fn ri_head_response_has_no_body_and_the_connection_goes_on() {
    let up = upstream(|_| async { http::Response::new(full("hello")) }).await;
    let gw = TestGateway::to(up, "");
    let mut s = connect(gw.addr).await;
    let req = format!(
        "HEAD /h HTTP/1.1\r\nHost: a\r\n\r\n{}",
        "GET /g HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let (text, closed) = read_until_close(&mut s, WAIT).await;
    assert!(closed, "{text:?}");
    let got = responses(text.as_bytes(), &[true, false]);
    assert_eq!(got.len(), 2, "{text:?}");
    assert_eq!(got[0].status, 200);
    assert_eq!(got[0].header("content-length"), Some("5"), "{text:?}");
    assert!(got[0].body.is_empty());
    assert_eq!(got[1].body(), "hello", "no stray body bytes before it");
}

/// 204 and 304 have no body (nor chunked framing), and the connection goes on.
#[tokio::test]
async fn ri_no_content_and_not_modified_have_no_body() {
    let up = upstream(|req: http::Request<Incoming>| async move {
        let status = match req.uri().path() {
            "/204" => 204,
            "/304" => 304,
            _ => 200,
        };
        let mut r = http::Response::new(if status == 200 {
            full("after")
        } else {
            full("")
        });
        *r.status_mut() = http::StatusCode::from_u16(status).unwrap();
        r
    })
    .await;
    let gw = TestGateway::to(up, "");
    let mut s = connect(gw.addr).await;
    let req = [get_req("/204"), get_req("/304"), get_req("/200")].concat();
    s.write_all(req.as_bytes()).await.unwrap();
    let got = read_responses(&mut s, 3).await;
    let statuses: Vec<u16> = got.iter().map(|r| r.status).collect();
    assert_eq!(statuses, [204, 304, 200]);
    for r in &got[..2] {
        assert_eq!(r.header("transfer-encoding"), None);
        assert!(r.body.is_empty());
    }
    assert_eq!(got[2].body(), "after");
}

/// An HTTP/1.0 request without keep-alive is answered, with `connection: close`, and the
/// connection closes; with keep-alive and a known length it stays open and says so.
#[tokio::test]
async fn ri_http10_close_and_keep_alive() {
    let (up, _) = path_upstream().await;
    let gw = TestGateway::to(up, "");
    let (text, closed) = raw(gw.addr, b"GET /a HTTP/1.0\r\nHost: a\r\n\r\n", WAIT).await;
    assert!(closed, "{text:?}");
    let got = responses(text.as_bytes(), &[]);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].body(), "GET /a");
    assert_eq!(got[0].header("content-length"), Some("6"));
    assert_eq!(got[0].header("connection"), Some("close"));

    let mut s = connect(gw.addr).await;
    for path in ["/b", "/c"] {
        let req = format!("GET {path} HTTP/1.0\r\nHost: a\r\nConnection: keep-alive\r\n\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        let got = read_responses(&mut s, 1).await;
        assert_eq!(got[0].body(), format!("GET {path}"));
        assert_eq!(got[0].header("connection"), Some("keep-alive"));
    }
}

/// A body of unknown length: chunked to an HTTP/1.1 client (connection reusable), delimited
/// by the close to an HTTP/1.0 one (never chunked, which it does not know).
#[tokio::test]
async fn ri_unknown_length_is_chunked_to_11_and_close_delimited_to_10() {
    let up = upstream(|_| async { http::Response::new(streamed(&["str", "eam", "ed"])) }).await;
    let gw = TestGateway::to(up, "");

    let mut s = connect(gw.addr).await;
    s.write_all(get_req("/a").as_bytes()).await.unwrap();
    let got = read_responses(&mut s, 1).await;
    assert_eq!(got[0].header("transfer-encoding"), Some("chunked"));
    assert_eq!(got[0].body(), "streamed");
    s.write_all(get_req("/b").as_bytes()).await.unwrap();
    assert_eq!(read_responses(&mut s, 1).await[0].body(), "streamed");

    let req = b"GET /c HTTP/1.0\r\nHost: a\r\nConnection: keep-alive\r\n\r\n";
    let (text, closed) = raw(gw.addr, req, WAIT).await;
    assert!(closed, "{text:?}");
    let got = responses(text.as_bytes(), &[]);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].header("transfer-encoding"), None, "{text:?}");
    assert_eq!(got[0].header("content-length"), None, "{text:?}");
    assert_eq!(got[0].header("connection"), Some("close"));
    assert_eq!(got[0].body(), "streamed");
}

/// An upstream that answers one request on each connection with `head` then `body`, and
/// closes. It reads the request's head and the body its `content-length` says first.
async fn raw_upstream(head: &'static str, body: &'static [u8]) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut c, _)) = l.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = vec![0u8; 1 << 20];
                let mut have = 0;
                let whole = |b: &[u8]| {
                    let end = b.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
                    let head = String::from_utf8_lossy(&b[..end]).to_ascii_lowercase();
                    let len = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .map_or(0, |v| v.trim().parse::<usize>().unwrap());
                    (b.len() >= end + len).then_some(())
                };
                while whole(&buf[..have]).is_none() {
                    match c.read(&mut buf[have..]).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => have += n,
                    }
                }
                let _ = c.write_all(head.as_bytes()).await;
                let _ = c.write_all(body).await;
                let _ = c.shutdown().await;
            });
        }
    });
    addr
}

/// An upstream body shorter than its Content-Length: the client gets the length, the bytes
/// that came, and a closed connection (never a next response parsed out of the gap).
#[tokio::test]
async fn ri_upstream_body_shorter_than_its_length_closes_the_connection() {
    let up = raw_upstream("HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n", b"hello").await;
    let gw = TestGateway::to(up, "");
    let req = [get_req("/a"), get_req("/b")].concat();
    let (text, closed) = raw(gw.addr, req.as_bytes(), WAIT).await;
    assert!(closed, "{text:?}");
    let got = responses(text.as_bytes(), &[]);
    assert_eq!(got.len(), 1, "{text:?}");
    assert_eq!(got[0].header("content-length"), Some("10"));
    assert!(!got[0].complete, "{text:?}");
}

/// An upstream answer of unknown length (delimited by the upstream's close) is chunked to
/// the client, whole.
#[tokio::test]
async fn ri_close_delimited_upstream_answer_is_chunked_to_the_client() {
    let up = raw_upstream(
        "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n",
        b"until close",
    )
    .await;
    let gw = TestGateway::to(up, "");
    let mut s = connect(gw.addr).await;
    s.write_all(get_req("/a").as_bytes()).await.unwrap();
    let got = read_responses(&mut s, 1).await;
    assert_eq!(got[0].header("transfer-encoding"), Some("chunked"));
    assert_eq!(got[0].header("connection"), None);
    assert_eq!(got[0].body(), "until close");
    s.write_all(get_req("/b").as_bytes()).await.unwrap();
    assert_eq!(read_responses(&mut s, 1).await[0].body(), "until close");
}

/// Every response carries one `Date`, in the IMF-fixdate format; an upstream's own is kept.
#[tokio::test]
async fn ri_responses_carry_one_date() {
    let up = upstream(|req: http::Request<Incoming>| async move {
        let mut r = http::Response::new(full("x"));
        if req.uri().path() == "/dated" {
            r.headers_mut().insert(
                "date",
                http::HeaderValue::from_static("Sun, 06 Nov 1994 08:49:37 GMT"),
            );
        }
        r
    })
    .await;
    let gw = TestGateway::to(up, "");
    let mut s = connect(gw.addr).await;
    s.write_all([get_req("/a"), get_req("/dated")].concat().as_bytes())
        .await
        .unwrap();
    let got = read_responses(&mut s, 2).await;
    for r in &got {
        assert_eq!(r.headers.iter().filter(|(n, _)| n == "date").count(), 1);
    }
    let date = got[0].header("date").unwrap();
    assert!(
        httpdate::parse_http_date(date).is_ok() && date.ends_with(" GMT"),
        "{date}"
    );
    assert_eq!(got[1].header("date"), Some("Sun, 06 Nov 1994 08:49:37 GMT"));
}

/// More pipelined bytes than the head limit while a request is in flight: every request is
/// answered, in order.
#[tokio::test]
async fn ri_more_pipelined_bytes_than_the_head_limit_are_all_answered() {
    let (up, _) = path_upstream().await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\nmax_header_bytes = 1024\n");
    let mut s = connect(gw.addr).await;
    let mut req = get_req("/0?delay=200");
    let n = 200;
    for i in 1..n {
        req.push_str(&get_req(&format!("/{i}")));
    }
    assert!(req.len() > 4 * 1024);
    s.write_all(req.as_bytes()).await.unwrap();
    let got = read_responses(&mut s, n).await;
    assert_eq!(got.len(), n);
    for (i, r) in got.iter().enumerate() {
        assert_eq!(r.body(), format!("GET /{i}"));
    }
}

/// A body larger than `max_body_bytes` that arrived whole with its head: 413, the
/// connection closed, the upstream never asked.
#[tokio::test]
async fn ri_whole_body_over_the_limit_is_refused() {
    let (up, hits) = path_upstream().await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\nmax_body_bytes = 10\n");
    let req = format!(
        "POST /big HTTP/1.1\r\nHost: a\r\nContent-Length: 20\r\n\r\n{}{}",
        "x".repeat(20),
        get_req("/after")
    );
    let (text, closed) = raw(gw.addr, req.as_bytes(), WAIT).await;
    assert!(closed, "{text:?}");
    let got = responses(text.as_bytes(), &[]);
    assert_eq!(got.len(), 1, "{text:?}");
    assert_eq!(got[0].status, 413);
    assert_eq!(got[0].header("connection"), Some("close"));
    assert_eq!(hits.load(Ordering::SeqCst), 0);

    // At the limit it goes through.
    let req = format!(
        "POST /ok HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\nConnection: close\r\n\r\n{}",
        "y".repeat(10)
    );
    let (text, _) = raw(gw.addr, req.as_bytes(), WAIT).await;
    assert_eq!(
        responses(text.as_bytes(), &[])[0].body(),
        "POST /ok yyyyyyyyyy"
    );
}

/// Content-Length values: one too large for any integer is a 400, one larger than
/// `max_body_bytes` a 413, before the body is waited for; neither reaches the upstream.
#[tokio::test]
async fn ri_huge_content_lengths_are_refused() {
    let (up, hits) = path_upstream().await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\nmax_body_bytes = 1000\n");
    for (len, status) in [("99999999999999999999999", 400), ("1000000000000", 413)] {
        let req = format!("POST / HTTP/1.1\r\nHost: a\r\nContent-Length: {len}\r\n\r\nab");
        let (text, closed) = raw(gw.addr, req.as_bytes(), WAIT).await;
        assert!(closed, "{text:?}");
        assert!(
            text.starts_with(&format!("HTTP/1.1 {status} ")),
            "{len}: {text:?}"
        );
    }
    assert_eq!(hits.load(Ordering::SeqCst), 0);
}

/// A target `http` refuses is judged before the body's framing, as hyper's server judges
/// it: a 400 (not the 501 of an unknown coding), and at once (not once a body that never
/// comes has timed out), whether the inline server or hyper's answers.
#[tokio::test]
async fn ri_a_bad_target_is_refused_before_its_body() {
    let (up, hits) = path_upstream().await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\nheader_read_timeout = \"30s\"\n");
    let coded = "POST /a<b> HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n";
    let waiting = "POST /a<b> HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\n";
    // First on the connection (the inline server), and behind a chunked request (which
    // hands the connection to hyper's server).
    let chunked =
        "POST /c HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n";
    for before in ["", chunked] {
        for bad in [coded, waiting] {
            // (Closed within `WAIT`, long before the 30 s a body is waited for.)
            let (text, closed) = raw(gw.addr, format!("{before}{bad}").as_bytes(), WAIT).await;
            assert!(closed, "{text:?}");
            let got = responses(text.as_bytes(), &[]);
            let last = got.last().expect("an answer");
            assert_eq!(last.status, 400, "{before:?} {bad:?}: {text:?}");
        }
    }
    assert_eq!(hits.load(Ordering::SeqCst), 2, "only the chunked requests");
}

/// A request target httparse takes and `http` does not (and a header httparse refuses):
/// 400 from hyper's server, as before, after the requests served inline before it.
#[tokio::test]
async fn ri_heads_the_http_crate_rejects_are_answered_400_in_order() {
    let (up, hits) = path_upstream().await;
    let gw = TestGateway::to(up, "");
    for bad in [
        &b"GET /a<b>{c} HTTP/1.1\r\nHost: a\r\n\r\n"[..],
        b"GET / HTTP/1.1\r\nHost: a\r\nX: a\x7fb\r\n\r\n",
    ] {
        let mut req = get_req("/ok").into_bytes();
        req.extend_from_slice(bad);
        req.extend_from_slice(get_req("/never").as_bytes());
        let (text, closed) = raw(gw.addr, &req, WAIT).await;
        assert!(closed, "{text:?}");
        let got = responses(text.as_bytes(), &[]);
        assert_eq!(got.len(), 2, "{text:?}");
        assert_eq!(got[0].body(), "GET /ok");
        assert_eq!(got[1].status, 400, "{text:?}");
    }
    assert_eq!(hits.load(Ordering::SeqCst), 2);
}

/// Shutdown with a request in flight: it completes, with `connection: close`, the pipelined
/// request behind it is not served, and the gateway then exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ri_shutdown_with_a_request_in_flight_completes_it_with_close() {
    let (started_tx, mut started_rx) = tokio::sync::mpsc::channel::<()>(1);
    let release = Arc::new(tokio::sync::Notify::new());
    let r = release.clone();
    let up = upstream(move |req: http::Request<Incoming>| {
        let started = started_tx.clone();
        let release = r.clone();
        async move {
            if req.uri().path() == "/slow" {
                started.send(()).await.ok();
                release.notified().await;
            }
            http::Response::new(full(format!("done {}", req.uri().path())))
        }
    })
    .await;
    let mut gw = TestGateway::to(up, "");
    let mut s = connect(gw.addr).await;
    s.write_all([get_req("/slow"), get_req("/next")].concat().as_bytes())
        .await
        .unwrap();
    started_rx.recv().await.unwrap();
    let g = gw.gw.take().unwrap();
    g.shutdown();
    let joined = tokio::task::spawn_blocking(move || g.join());
    // Time for the connection to see the shutdown before the answer comes.
    tokio::time::sleep(Duration::from_millis(300)).await;
    release.notify_one();
    let (text, closed) = read_until_close(&mut s, WAIT).await;
    assert!(closed, "{text:?}");
    let got = responses(text.as_bytes(), &[]);
    assert_eq!(got.len(), 1, "{text:?}");
    assert_eq!(got[0].body(), "done /slow");
    assert_eq!(got[0].header("connection"), Some("close"));
    tokio::time::timeout(WAIT, joined)
        .await
        .expect("the gateway exits once the request is answered")
        .unwrap();
}

/// A connection idle between requests is closed at shutdown, without waiting for the grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ri_shutdown_closes_an_idle_keep_alive_connection() {
    let (up, _) = path_upstream().await;
    let mut gw = TestGateway::to(up, "[server]\nworkers = 1\nshutdown_grace = \"30s\"\n");
    let mut s = connect(gw.addr).await;
    s.write_all(get_req("/a").as_bytes()).await.unwrap();
    assert_eq!(read_responses(&mut s, 1).await[0].body(), "GET /a");
    let g = gw.gw.take().unwrap();
    g.shutdown();
    let joined = tokio::task::spawn_blocking(move || g.join());
    let (text, closed) = read_until_close(&mut s, WAIT).await;
    assert!(closed && text.is_empty(), "{text:?}");
    tokio::time::timeout(WAIT, joined).await.unwrap().unwrap();
}

/// A head still coming when shutdown begins is answered, with `connection: close`, whichever
/// server it ends up with: the inline one (a small `Content-Length` body) or hyper's, which
/// the inline server hands it to once its head shows it is chunked. nginx too finishes a
/// request it has begun to read. The handed-over one used to be closed unanswered: hyper's
/// server was asked to close before it had read the bytes handed to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ri_shutdown_answers_a_head_still_coming_for_either_server() {
    for (shape, first, rest) in [
        (
            "length",
            "POST /c HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n",
            "\r\nabc",
        ),
        (
            "chunked",
            "POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n",
            "\r\n3\r\nabc\r\n0\r\n\r\n",
        ),
        // A whole head, its small body still coming.
        (
            "body",
            "POST /c HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\na",
            "bc",
        ),
    ] {
        let (up, hits) = path_upstream().await;
        let mut gw = TestGateway::to(up, "[server]\nshutdown_grace = \"30s\"\n");
        let mut s = connect(gw.addr).await;
        s.write_all(first.as_bytes()).await.unwrap();
        // Time for the gateway to read the first part.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let g = gw.gw.take().unwrap();
        g.shutdown();
        let joined = tokio::task::spawn_blocking(move || g.join());
        // The rest comes past the second a connection with no exchange under way has to
        // close at shutdown: a head (or small body) already coming is an exchange under way
        // (the header read timeout bounds it, and the grace period).
        tokio::time::sleep(Duration::from_millis(1500)).await;
        s.write_all(rest.as_bytes()).await.unwrap();
        let (text, closed) = read_until_close(&mut s, WAIT).await;
        assert!(closed, "{shape}: {text:?}");
        let got = responses(text.as_bytes(), &[]);
        assert_eq!(got.len(), 1, "{shape}: {text:?}");
        assert_eq!(got[0].status, 200, "{shape}: {text:?}");
        assert_eq!(got[0].body(), "POST /c abc", "{shape}");
        assert_eq!(got[0].header("connection"), Some("close"), "{shape}");
        assert_eq!(hits.load(Ordering::SeqCst), 1, "{shape}");
        tokio::time::timeout(WAIT, joined)
            .await
            .expect("the gateway exits once the request is answered")
            .unwrap();
    }
}

/// The same on a connection hyper's server took over (after a chunked request): a head
/// still coming at shutdown is answered, with `Connection: close`, not closed on. hyper's
/// server sees no byte of a head until it is whole, so its graceful close, made at once,
/// closed the connection under the client's request.
#[tokio::test]
async fn shutdown_answers_a_head_still_coming_after_hyper_took_the_connection() {
    let (up, hits) = path_upstream().await;
    let mut gw = TestGateway::to(up, "[server]\nshutdown_grace = \"30s\"\n");
    let mut s = connect(gw.addr).await;
    s.write_all(
        b"POST /a HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n0\r\n\r\n",
    )
    .await
    .unwrap();
    let first = read_responses(&mut s, 1).await;
    assert_eq!(first[0].body(), "POST /a ab");
    s.write_all(b"GET /b HTTP/1.1\r\nHost: t\r\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let g = gw.gw.take().unwrap();
    g.shutdown();
    let joined = tokio::task::spawn_blocking(move || g.join());
    tokio::time::sleep(Duration::from_millis(300)).await;
    s.write_all(b"\r\n").await.unwrap();
    let (text, closed) = read_until_close(&mut s, WAIT).await;
    assert!(closed, "{text:?}");
    let got = responses(text.as_bytes(), &[]);
    assert_eq!(got.len(), 1, "{text:?}");
    assert_eq!(got[0].status, 200, "{text:?}");
    assert_eq!(got[0].body(), "GET /b");
    assert_eq!(got[0].header("connection"), Some("close"));
    assert_eq!(hits.load(Ordering::SeqCst), 2);
    tokio::time::timeout(WAIT, joined)
        .await
        .expect("the gateway exits once the request is answered")
        .unwrap();
}

/// An upstream that answers only after 30 s; counts the requests it started and those
/// dropped before their answer (the gateway cancelled them).
async fn hanging_upstream() -> (SocketAddr, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    struct Guard(Arc<AtomicUsize>);
    impl Drop for Guard {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let started = Arc::new(AtomicUsize::new(0));
    let dropped = Arc::new(AtomicUsize::new(0));
    let (s, d) = (started.clone(), dropped.clone());
    let up = upstream(move |_| {
        s.fetch_add(1, Ordering::SeqCst);
        let g = Guard(d.clone());
        async move {
            tokio::time::sleep(Duration::from_secs(30)).await;
            drop(g);
            http::Response::new(full("late"))
        }
    })
    .await;
    (up, started, dropped)
}

/// A client that goes away while its request waits on the upstream: the request is cancelled
/// (the upstream sees its connection reset or closed) rather than run to its end.
#[tokio::test]
async fn ri_client_gone_cancels_the_request() {
    let (up, _started, dropped) = hanging_upstream().await;
    let gw = TestGateway::to(up, "");
    let mut s = connect(gw.addr).await;
    s.write_all(get_req("/a").as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(s);
    wait_for("the upstream request to be dropped", || {
        dropped.load(Ordering::SeqCst) == 1
    })
    .await;
}

/// The same with a CRLF after the body (RFC 9112 §2.2 lets a client send one; older
/// clients do), in the request's own segment or in one of its own once the request reached
/// the upstream: it is no pipelined request, so the client's end of stream is still
/// watched for, and still cancels the request upstream.
#[tokio::test]
async fn ri_client_gone_after_a_trailing_crlf_cancels_the_request() {
    let post = "POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi";
    for (first, later) in [(format!("{post}\r\n"), ""), (post.to_owned(), "\r\n")] {
        let (up, started, dropped) = hanging_upstream().await;
        let gw = TestGateway::to(up, "");
        let mut s = connect(gw.addr).await;
        s.write_all(first.as_bytes()).await.unwrap();
        wait_for("the request to reach the upstream", || {
            started.load(Ordering::SeqCst) == 1
        })
        .await;
        if !later.is_empty() {
            s.write_all(later.as_bytes()).await.unwrap();
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        drop(s);
        wait_for("the upstream request to be dropped", || {
            dropped.load(Ordering::SeqCst) == 1
        })
        .await;
    }
}

/// The test PKI's server certificate for a TLS listener.
fn tls_gateway(pki: &common::tls::Pki, up: SocketAddr) -> TestGateway {
    TestGateway::start(&format!(
        "[[listener]]\nname = \"tls\"\naddress = \"127.0.0.1:0\"\n[listener.tls]\ncert = \"{}\"\nkey = \"{}\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n",
        pki.path("server.pem"),
        pki.path("server.key"),
    ))
}

/// HTTP/1.1 over TLS takes the same path: pipelined requests across the handover, answered
/// in order, and the connection closed after the one that asks.
#[tokio::test]
async fn ri_tls_pipelining_across_the_handover() {
    let (up, _) = path_upstream().await;
    let pki = common::tls::Pki::new();
    let gw = tls_gateway(&pki, up);
    let mut roots = rustls::RootCertStore::empty();
    for c in pki.certs("ca.pem") {
        roots.add(c).unwrap();
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    let tcp = connect(gw.addr).await;
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(
            rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap(),
            tcp,
        )
        .await
        .unwrap();
    let req = [
        get_req("/1?delay=50"),
        "POST /2 HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"
            .to_owned(),
        "GET /3 HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n".to_owned(),
    ]
    .concat();
    tls.write_all(req.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    let read = tokio::time::timeout(WAIT, async {
        let mut buf = [0u8; 4096];
        loop {
            match tls.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => raw.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(read.is_ok(), "closed after `Connection: close`");
    let got = responses(&raw, &[]);
    let bodies: Vec<&str> = got.iter().map(Resp::body).collect();
    assert_eq!(bodies, ["GET /1", "POST /2 ok", "GET /3"]);
}

/// A pipelined head longer than `max_header_bytes`, buffered while the request before it
/// was in flight: that one is answered, then 431, and nothing of the long one reaches the
/// upstream.
#[tokio::test]
async fn ri_oversized_pipelined_head_gets_431_after_the_first_answer() {
    let (up, hits) = path_upstream().await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\nmax_header_bytes = 1024\n");
    let req = format!(
        "{}GET /long HTTP/1.1\r\nHost: a\r\nX-Long: {}\r\n\r\n",
        get_req("/a?delay=200"),
        "l".repeat(3000)
    );
    let (text, closed) = raw(gw.addr, req.as_bytes(), WAIT).await;
    assert!(closed, "{text:?}");
    let got = responses(text.as_bytes(), &[]);
    assert_eq!(got.len(), 2, "{text:?}");
    assert_eq!(got[0].body(), "GET /a");
    assert_eq!(got[1].status, 431);
    assert_eq!(hits.load(Ordering::SeqCst), 1);
}

/// RFC 9110 §8.6: no `Content-Length` in a 204, even when the upstream sent one (hyper's
/// server and nginx drop it).
#[tokio::test]
async fn ri_no_content_response_carries_no_content_length() {
    let up = raw_upstream("HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n", b"").await;
    let gw = TestGateway::to(up, "");
    let mut s = connect(gw.addr).await;
    s.write_all(get_req("/a").as_bytes()).await.unwrap();
    let got = read_responses(&mut s, 1).await;
    assert_eq!(got[0].status, 204);
    assert_eq!(got[0].header("content-length"), None, "{:?}", got[0]);
}

/// A HEAD answered by the gateway itself (no route: 404) says the length its GET answer
/// would have, as hyper's server did, and the connection goes on.
#[tokio::test]
async fn ri_head_answered_by_the_gateway_has_its_length() {
    let gw = TestGateway::start("");
    let mut s = connect(gw.addr).await;
    let req = "HEAD /nowhere HTTP/1.1\r\nHost: a\r\n\r\nGET /nowhere HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n";
    s.write_all(req.as_bytes()).await.unwrap();
    let (text, closed) = read_until_close(&mut s, WAIT).await;
    assert!(closed, "{text:?}");
    let got = responses(text.as_bytes(), &[true, false]);
    assert_eq!(got.len(), 2, "{text:?}");
    assert_eq!(got[0].status, 404);
    assert_eq!(
        got[0].header("content-length"),
        Some(got[1].body.len().to_string().as_str()),
        "{text:?}"
    );
}

/// Large and odd-sized frames of unknown length, empty ones among them: chunked to the
/// client with every byte in order; the same body with a known length is sent as is.
#[tokio::test]
async fn ri_large_frames_are_framed_exactly() {
    fn frames() -> Vec<Bytes> {
        [10usize, 70_000, 0, 5, 200_000, 1]
            .iter()
            .enumerate()
            .map(|(i, &n)| Bytes::from(vec![b'a' + i as u8; n]))
            .collect()
    }
    let up = upstream(|req: http::Request<Incoming>| async move {
        let parts: Vec<Result<Frame<Bytes>, Box<dyn std::error::Error + Send + Sync>>> =
            frames().into_iter().map(|b| Ok(Frame::data(b))).collect();
        if req.uri().path() == "/known" {
            let all: Vec<u8> = frames().concat();
            return http::Response::new(full(all));
        }
        http::Response::new(StreamBody::new(futures_util::stream::iter(parts)).boxed())
    })
    .await;
    let gw = TestGateway::to(up, "");
    let want: Vec<u8> = frames().concat();
    let mut s = connect(gw.addr).await;
    s.write_all(
        [get_req("/streamed"), get_req("/known")]
            .concat()
            .as_bytes(),
    )
    .await
    .unwrap();
    let got = read_responses(&mut s, 2).await;
    assert_eq!(got[0].header("transfer-encoding"), Some("chunked"));
    assert!(got[0].body == want, "chunked body differs");
    assert_eq!(
        got[1].header("content-length"),
        Some(want.len().to_string().as_str())
    );
    assert!(got[1].body == want, "sized body differs");
}

/// An upstream whose chunked body is cut off: the client gets what came, never the
/// terminating chunk, and the connection closes.
#[tokio::test]
async fn ri_upstream_chunked_body_cut_off_is_not_terminated() {
    let up = raw_upstream(
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"5\r\nhello\r\n3\r\nwo",
    )
    .await;
    let gw = TestGateway::to(up, "");
    let req = [get_req("/a"), get_req("/b")].concat();
    let (text, closed) = raw(gw.addr, req.as_bytes(), WAIT).await;
    assert!(closed, "{text:?}");
    let got = responses(text.as_bytes(), &[]);
    assert_eq!(got.len(), 1, "{text:?}");
    assert!(!got[0].complete, "{text:?}");
    assert!(got[0].body().starts_with("hello"), "{text:?}");
}

/// A lone request followed by the client's half-close is cancelled, not answered: the end
/// of stream with nothing more buffered means the client is gone, as in hyper's server
/// (`half_close` off; it dropped such a request before sending it) and nginx (499). No
/// request is left running upstream.
#[tokio::test]
async fn ri_half_close_after_a_lone_request_cancels_it() {
    let (up, started, dropped) = hanging_upstream().await;
    let gw = TestGateway::to(up, "");
    let mut s = connect(gw.addr).await;
    s.write_all(get_req("/a").as_bytes()).await.unwrap();
    s.shutdown().await.unwrap();
    let (text, closed) = read_until_close(&mut s, WAIT).await;
    assert!(closed && text.is_empty(), "{text:?}");
    wait_for("no request left running upstream", || {
        dropped.load(Ordering::SeqCst) == started.load(Ordering::SeqCst)
    })
    .await;
}

/// A small declared body over `max_body_bytes` is refused with 413 as soon as the head is
/// read, whether or not the body follows (hyper's server answered before reading it).
#[tokio::test]
async fn ri_small_declared_body_over_the_limit_is_refused_before_it_comes() {
    let (up, hits) = path_upstream().await;
    let gw = TestGateway::to(
        up,
        "[server]\nworkers = 1\nmax_body_bytes = 10\nheader_read_timeout = \"30s\"\n",
    );
    let mut s = connect(gw.addr).await;
    s.write_all(b"POST /big HTTP/1.1\r\nHost: a\r\nContent-Length: 20\r\n\r\nabc")
        .await
        .unwrap();
    let got = read_responses(&mut s, 1).await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].status, 413);
    assert_eq!(hits.load(Ordering::SeqCst), 0);
}

/// A small body that trickles in after its head, for longer in all than
/// `header_read_timeout` but never stalling, is read and forwarded, as hyper's server
/// streamed it: the header read timeout bounds the head, not the body.
#[tokio::test]
async fn ri_small_body_arriving_slowly_is_not_cut_off_by_the_header_timeout() {
    let (up, _) = path_upstream().await;
    let gw = TestGateway::to(
        up,
        "[server]\nworkers = 1\nheader_read_timeout = \"300ms\"\nidle_timeout = \"60s\"\n",
    );
    let mut s = connect(gw.addr).await;
    s.write_all(b"POST /slow HTTP/1.1\r\nHost: a\r\nContent-Length: 20\r\n\r\n")
        .await
        .unwrap();
    for b in b"abcdefghijklmnopqrst" {
        tokio::time::sleep(Duration::from_millis(60)).await;
        if s.write_all(&[*b]).await.is_err() {
            break;
        }
    }
    let got = read_responses(&mut s, 1).await;
    assert_eq!(got.len(), 1, "cut off without an answer");
    assert_eq!(got[0].body(), "POST /slow abcdefghijklmnopqrst");
}

/// A WebSocket upgrade after a request served inline, with the first frame sent in the same
/// write as the upgrade head: the handover carries the frame's bytes, and the tunnel passes
/// them through to the upstream and back.
#[tokio::test]
async fn ri_upgrade_after_an_inline_request_tunnels_the_bytes_sent_with_it() {
    let up = upstream(|mut req: http::Request<Incoming>| async move {
        if req.uri().path() != "/ws" {
            return http::Response::new(full("plain"));
        }
        websocket_echo(&mut req)
    })
    .await;
    let gw = TestGateway::to(up, "");
    let mut s = connect(gw.addr).await;
    s.write_all(get_req("/").as_bytes()).await.unwrap();
    assert_eq!(read_responses(&mut s, 1).await[0].body(), "plain");
    let frame = b"\x81\x85\x37\xfa\x21\x3d\x7f\x9f\x4d\x51\x58";
    let mut req = b"GET /ws HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n".to_vec();
    req.extend_from_slice(frame);
    s.write_all(&req).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let want_head_end = |g: &[u8]| g.windows(4).position(|w| w == b"\r\n\r\n");
    let read = tokio::time::timeout(WAIT, async {
        loop {
            if let Some(i) = want_head_end(&got)
                && got.len() >= i + 4 + frame.len()
            {
                return;
            }
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed: {:?}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        }
    })
    .await;
    assert!(read.is_ok(), "{:?}", String::from_utf8_lossy(&got));
    let i = want_head_end(&got).unwrap();
    let head = String::from_utf8_lossy(&got[..i]).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 101"), "{head}");
    assert_eq!(
        &got[i + 4..],
        frame,
        "the frame sent with the head comes back"
    );
}

/// An upstream body longer than its Content-Length: the client gets exactly the length's
/// bytes, never the excess (which would read as the start of the next response), and the
/// connection goes on.
#[tokio::test]
async fn ri_upstream_body_longer_than_its_length_is_cut_to_it() {
    let up = raw_upstream(
        "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n",
        b"helloHTTP/1.1 200 OK\r\n\r\n",
    )
    .await;
    let gw = TestGateway::to(up, "");
    let mut s = connect(gw.addr).await;
    s.write_all([get_req("/a"), get_req("/b")].concat().as_bytes())
        .await
        .unwrap();
    let got = read_responses(&mut s, 2).await;
    assert_eq!(got.len(), 2);
    for r in &got {
        assert_eq!((r.status, r.body()), (200, "hello"));
    }
}

/// An empty line left after a request (a client that ends its body with an extra CRLF) is
/// no head in progress (RFC 9112 §2.2): the connection stays under the idle timeout, not the
/// header read timeout, and serves the next request; on the inline server and behind the
/// smuggling guard.
#[tokio::test]
async fn ri_a_crlf_after_a_request_does_not_start_the_header_timeout() {
    let (up, _) = path_upstream().await;
    let gw = TestGateway::to(
        up,
        "[server]\nworkers = 1\nheader_read_timeout = \"300ms\"\nidle_timeout = \"60s\"\n",
    );
    let plain = "POST /p HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi\r\n";
    let chunked =
        "POST /c HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n\r\n";
    for first in [plain, chunked] {
        let mut s = connect(gw.addr).await;
        s.write_all(first.as_bytes()).await.unwrap();
        let got = read_responses(&mut s, 1).await;
        assert_eq!(got[0].status, 200, "{first:?}");
        // Past the header read timeout, with only the CRLF read.
        tokio::time::sleep(Duration::from_millis(800)).await;
        s.write_all(b"GET /next HTTP/1.1\r\nHost: a\r\n\r\n")
            .await
            .unwrap();
        let got = read_responses(&mut s, 1).await;
        assert_eq!(got.len(), 1, "{first:?}: the connection still serves");
        assert_eq!(got[0].status, 200, "{first:?}");
    }
}

/// A request line longer than `max_header_bytes` is `414 uri_too_long` (its target is what
/// is too long, as nginx answers it); header lines past the limit are `431`. On the inline
/// server and behind the guard (after a chunked request).
#[tokio::test]
async fn ri_a_request_line_over_the_limit_is_414_and_headers_over_it_431() {
    let (up, hits) = path_upstream().await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\nmax_header_bytes = 4096\n");
    let long_target = format!("GET /{} HTTP/1.1\r\nHost: a\r\n\r\n", "a".repeat(8000));
    let long_header = format!(
        "GET / HTTP/1.1\r\nHost: a\r\nX-Big: {}\r\n\r\n",
        "b".repeat(8000)
    );
    let chunked =
        "POST /c HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n";
    for before in ["", chunked] {
        for (head, status) in [(&long_target, 414), (&long_header, 431)] {
            let mut s = connect(gw.addr).await;
            s.write_all(format!("{before}{head}").as_bytes())
                .await
                .unwrap();
            let (text, _) = read_until_close(&mut s, WAIT).await;
            let got = responses(text.as_bytes(), &[]);
            let last = got.last().unwrap_or_else(|| panic!("no answer: {text:?}"));
            assert_eq!(last.status, status, "{:?}", &text[..text.len().min(300)]);
            if status == 414 {
                // Its reason is the head limit, not the target limit it is far below.
                assert!(
                    text.contains("request line longer than max_header_bytes"),
                    "{text:?}"
                );
            }
        }
    }
    assert_eq!(
        hits.load(Ordering::SeqCst),
        2,
        "only the chunked requests went upstream"
    );
}

/// `server.max_requests_per_connection`: the last request a connection may carry is
/// answered with `Connection: close` and the connection closed after it, as nginx's
/// `keepalive_requests` does; the ones before it are kept alive. Served inline, across the
/// handover to hyper's server (the count goes on there), and pipelined (what comes after
/// the last one is not served).
#[tokio::test]
async fn ri_the_last_request_a_connection_may_carry_closes_it() {
    let (up, hits) = path_upstream().await;
    let gw = TestGateway::to(up, "[server]\nmax_requests_per_connection = 3\n");

    // One at a time, inline.
    let mut s = connect(gw.addr).await;
    for i in 1..=3 {
        s.write_all(get_req(&format!("/{i}")).as_bytes())
            .await
            .unwrap();
        let got = read_responses(&mut s, 1).await;
        assert_eq!(got[0].body(), format!("GET /{i}"));
        let close = got[0].header("connection");
        if i < 3 {
            assert_eq!(close, None, "request {i} is kept alive");
        } else {
            assert_eq!(close, Some("close"), "the third is the last");
        }
    }
    let (text, closed) = read_until_close(&mut s, WAIT).await;
    assert!(closed && text.is_empty(), "{text:?}");

    // Two inline, the third a chunked POST that hyper's server takes, then two more there:
    // the count goes on across the handover, each request counted once.
    let gw4 = TestGateway::to(up, "[server]\nmax_requests_per_connection = 4\n");
    let mut s = connect(gw4.addr).await;
    let req = [
        get_req("/a"),
        get_req("/b"),
        "POST /c HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n"
            .to_owned(),
        get_req("/d"),
        get_req("/never"),
    ]
    .concat();
    let before = hits.load(Ordering::SeqCst);
    s.write_all(req.as_bytes()).await.unwrap();
    let (text, closed) = read_until_close(&mut s, WAIT).await;
    assert!(closed, "{text:?}");
    let got = responses(text.as_bytes(), &[]);
    let bodies: Vec<&str> = got.iter().map(Resp::body).collect();
    assert_eq!(
        bodies,
        ["GET /a", "GET /b", "POST /c hi", "GET /d"],
        "{text:?}"
    );
    assert_ne!(got[2].header("connection"), Some("close"), "{text:?}");
    assert_eq!(got[3].header("connection"), Some("close"), "{text:?}");
    assert_eq!(
        hits.load(Ordering::SeqCst) - before,
        4,
        "/never was not sent"
    );

    // Over hyper's server, the last request answered at once by the gateway (a TRACE gets
    // 405 within the poll that took it) still says `Connection: close`.
    let gw2 = TestGateway::to(up, "[server]\nmax_requests_per_connection = 2\n");
    let mut s = connect(gw2.addr).await;
    let req = [
        "POST /p HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n",
        "TRACE /t HTTP/1.1\r\nHost: a\r\n\r\n",
        "GET /never HTTP/1.1\r\nHost: a\r\n\r\n",
    ]
    .concat();
    let before = hits.load(Ordering::SeqCst);
    s.write_all(req.as_bytes()).await.unwrap();
    let (text, closed) = read_until_close(&mut s, WAIT).await;
    assert!(closed, "{text:?}");
    let got = responses(text.as_bytes(), &[]);
    assert_eq!(got.len(), 2, "{text:?}");
    assert_eq!(got[1].status, 405, "{text:?}");
    assert_eq!(got[1].header("connection"), Some("close"), "{text:?}");
    assert_eq!(
        hits.load(Ordering::SeqCst) - before,
        1,
        "/never was not sent"
    );

    // Every request over hyper's server (each a chunked POST).
    let mut s = connect(gw.addr).await;
    for i in 1..=3 {
        let req = format!(
            "POST /p{i} HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n"
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let got = read_responses(&mut s, 1).await;
        assert_eq!(got[0].body(), format!("POST /p{i} x"));
        let close = got[0].header("connection");
        if i < 3 {
            assert_ne!(close, Some("close"), "request {i} is kept alive");
        } else {
            assert_eq!(close, Some("close"), "the third is the last");
        }
    }
    let (text, closed) = read_until_close(&mut s, WAIT).await;
    assert!(closed && text.is_empty(), "{text:?}");
}

/// Reads `s` to its end: what came, and how it ended (`Ok` for a clean end of stream).
async fn read_to_end<S: tokio::io::AsyncRead + Unpin>(s: &mut S) -> (Vec<u8>, std::io::Result<()>) {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let end = tokio::time::timeout(WAIT, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) => return Ok(()),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => return Err(e),
            }
        }
    })
    .await
    .expect("the connection ended");
    (got, end)
}

/// An upstream answer cut short, to an HTTP/1.0 client whose body is delimited by the
/// close: the connection is reset, not closed, so the client cannot take the cut body for
/// a whole one. The same answer whole ends with a clean close.
#[tokio::test]
async fn ri_a_cut_answer_to_http10_ends_in_a_reset_and_a_whole_one_in_a_close() {
    let cut = raw_upstream(
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"5\r\nhello\r\n3\r\nwo",
    )
    .await;
    let whole = raw_upstream(
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"5\r\nhello\r\n0\r\n\r\n",
    )
    .await;
    // A GET, served inline, and a POST whose body is too large to be read with its head,
    // served by hyper's server.
    let post = format!(
        "POST /a HTTP/1.0\r\nHost: a\r\nContent-Length: 65536\r\n\r\n{}",
        "b".repeat(65536)
    );
    let get = "GET /a HTTP/1.0\r\nHost: a\r\n\r\n".to_owned();
    for (up, want_reset, req) in [
        (cut, true, &get),
        (whole, false, &get),
        (cut, true, &post),
        (whole, false, &post),
    ] {
        let gw = TestGateway::to(up, "");
        let mut s = connect(gw.addr).await;
        s.write_all(req.as_bytes()).await.unwrap();
        let (got, end) = read_to_end(&mut s).await;
        let text = String::from_utf8_lossy(&got);
        if want_reset {
            let e = end.expect_err("a cut answer ended like a whole one");
            assert_eq!(
                e.kind(),
                std::io::ErrorKind::ConnectionReset,
                "{e} {text:?}"
            );
        } else {
            assert!(end.is_ok(), "{end:?} {text:?}");
            let got = responses(&got, &[]);
            assert_eq!(got[0].body(), "hello", "{text:?}");
            assert_eq!(got[0].header("content-length"), None, "{text:?}");
        }
    }
}

/// An answer with no body to an HTTP/1.0 client that asked to keep its connection (to
/// HEAD, a 204, a 304) keeps it, however the upstream framed the answer (chunked, which an
/// HTTP/1.0 client cannot take, says nothing here); its close, later, is a clean one.
#[tokio::test]
async fn ri_a_bodiless_answer_to_http10_leaves_a_clean_close() {
    let chunked = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n";
    for (head, req) in [
        (
            chunked,
            "HEAD /a HTTP/1.0\r\nHost: a\r\nConnection: keep-alive\r\n\r\n",
        ),
        (
            "HTTP/1.1 204 No Content\r\n\r\n",
            "GET /a HTTP/1.0\r\nHost: a\r\nConnection: keep-alive\r\n\r\n",
        ),
        (
            "HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n",
            "GET /a HTTP/1.0\r\nHost: a\r\nConnection: keep-alive\r\n\r\n",
        ),
    ] {
        let up = raw_upstream(head, b"").await;
        let gw = TestGateway::to(up, "");
        let mut s = connect(gw.addr).await;
        s.write_all(req.as_bytes()).await.unwrap();
        let mut raw = Vec::new();
        let n = tokio::time::timeout(WAIT, common::read_head(&mut s, &mut raw))
            .await
            .expect("an answer in time")
            .expect("an answer's head");
        let text = String::from_utf8_lossy(&raw[..n]).to_ascii_lowercase();
        assert!(text.contains("connection: keep-alive"), "{req:?}: {text:?}");
        s.shutdown().await.unwrap();
        let (rest, end) = read_to_end(&mut s).await;
        assert!(end.is_ok(), "{req:?}: {end:?} {text:?}");
        assert!(rest.is_empty() && raw.len() == n, "{req:?}: {rest:?}");
    }
}

/// The same over TLS: the cut answer's connection ends without `close_notify`, which the
/// client's TLS reports as an error; the whole one's with it.
#[tokio::test]
async fn ri_a_cut_answer_to_http10_over_tls_ends_without_close_notify() {
    let cut = raw_upstream(
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"5\r\nhello\r\n3\r\nwo",
    )
    .await;
    let whole = raw_upstream(
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"5\r\nhello\r\n0\r\n\r\n",
    )
    .await;
    let pki = common::tls::Pki::new();
    let mut roots = rustls::RootCertStore::empty();
    for c in pki.certs("ca.pem") {
        roots.add(c).unwrap();
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    // Inline (a GET) and by hyper's server (a POST whose body comes after its head).
    let post = format!(
        "POST /a HTTP/1.0\r\nHost: a\r\nContent-Length: 65536\r\n\r\n{}",
        "b".repeat(65536)
    );
    let get = "GET /a HTTP/1.0\r\nHost: a\r\n\r\n".to_owned();
    for (up, want_error, req) in [
        (cut, true, &get),
        (whole, false, &get),
        (cut, true, &post),
        (whole, false, &post),
    ] {
        let gw = tls_gateway(&pki, up);
        let tcp = connect(gw.addr).await;
        let mut tls = connector
            .connect(
                rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap(),
                tcp,
            )
            .await
            .unwrap();
        tls.write_all(req.as_bytes()).await.unwrap();
        let (got, end) = read_to_end(&mut tls).await;
        let text = String::from_utf8_lossy(&got);
        match end {
            // Reset, not merely closed without `close_notify` (which hyper's server did
            // already on a body's error).
            Err(e) if want_error => {
                assert_eq!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionReset,
                    "{e} {text:?}"
                );
            }
            end => assert_eq!(end.is_err(), want_error, "{end:?} {text:?}"),
        }
    }
}

/// A client that shuts its sending side while an HTTP/1.0 answer of unknown length is
/// still coming has its request cancelled, and the cut answer still ends in a reset, as
/// hyper's server ends it: never in the clean close that would make it look whole.
#[tokio::test]
async fn ri_a_close_delimited_answer_cut_by_the_clients_half_close_ends_in_a_reset() {
    let up = upstream(|_| async {
        http::Response::new(trickle(100, 16, Duration::from_millis(100), Some(1)))
    })
    .await;
    let gw = TestGateway::to(up, "");
    let mut s = connect(gw.addr).await;
    s.write_all(b"GET /a HTTP/1.0\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    // The head and the first piece (the rest never comes).
    while !got.windows(4).any(|w| w == b"\r\n\r\n") || got.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(WAIT, s.read(&mut buf))
            .await
            .expect("the head came")
            .unwrap();
        assert!(n > 0, "{:?}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    s.shutdown().await.unwrap();
    let (rest, end) = read_to_end(&mut s).await;
    got.extend_from_slice(&rest);
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 200 "), "{text:?}");
    let e = end.expect_err("the cut answer ended like a whole one");
    assert_eq!(
        e.kind(),
        std::io::ErrorKind::ConnectionReset,
        "{e} {text:?}"
    );
}

/// A small body that stops coming behind a head whose target cannot be read gets that
/// refusal (`400`), as the same head with its whole body does, never a silent close.
#[tokio::test]
async fn ri_a_stalled_body_behind_an_unreadable_target_gets_its_400() {
    let (up, hits) = path_upstream().await;
    let gw = TestGateway::to(
        up,
        "[server]\nworkers = 1\nheader_read_timeout = \"300ms\"\n",
    );
    let (text, closed) = raw(
        gw.addr,
        b"POST http://[::1/ HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n0123456789",
        WAIT,
    )
    .await;
    assert!(closed, "{text:?}");
    assert!(text.starts_with("HTTP/1.1 400 "), "{text:?}");
    assert_eq!(hits.load(Ordering::SeqCst), 0);
}

/// A small body that keeps coming for longer than `idle_timeout` (each piece within the
/// header timeout) is served: the connection is not idle while a request's bytes come. It
/// was taken for idle, since no exchange had begun, and dropped with no answer after twice
/// the idle timeout.
#[tokio::test]
async fn ri_a_small_body_trickling_past_the_idle_timeout_is_served() {
    let (up, _) = path_upstream().await;
    let gw = TestGateway::to(
        up,
        "[server]\nworkers = 1\nheader_read_timeout = \"300ms\"\nidle_timeout = \"400ms\"\n",
    );
    let mut s = connect(gw.addr).await;
    s.write_all(b"POST /trickle HTTP/1.1\r\nHost: a\r\nContent-Length: 30\r\n\r\n")
        .await
        .unwrap();
    // 30 pieces 50 ms apart: 1.5 s, more than twice the idle timeout.
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        s.write_all(b"x").await.unwrap();
    }
    let got = read_responses(&mut s, 1).await;
    assert_eq!(got.len(), 1, "no answer");
    assert_eq!(got[0].body(), format!("POST /trickle {}", "x".repeat(30)));
}

/// An empty line after a request (RFC 9112 §2.2: ignored before the next request line)
/// leaves the connection idle: the idle timeout closes it on time. The CRLF used to be
/// kept as the start of a head, which held the close off until the connection was dropped
/// at twice the idle timeout.
#[tokio::test]
async fn ri_a_crlf_after_a_request_leaves_the_connection_idle() {
    let (up, _) = path_upstream().await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\nidle_timeout = \"1s\"\n");
    let mut s = connect(gw.addr).await;
    s.write_all(b"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi")
        .await
        .unwrap();
    assert_eq!(read_responses(&mut s, 1).await[0].body(), "POST /a hi");
    s.write_all(b"\r\n").await.unwrap();
    let since = std::time::Instant::now();
    let (text, closed) = read_until_close(&mut s, WAIT).await;
    assert!(closed && text.is_empty(), "{text:?}");
    // Closed at the idle timeout (1 s after the answer), not at twice it, nor at once.
    assert!(
        since.elapsed() >= Duration::from_millis(800)
            && since.elapsed() < Duration::from_millis(1700),
        "closed after {:?}",
        since.elapsed()
    );
    // And a request after empty lines is served as usual.
    let mut s = connect(gw.addr).await;
    s.write_all(b"\r\n\r\n").await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    s.write_all(get_req("/after").as_bytes()).await.unwrap();
    assert_eq!(read_responses(&mut s, 1).await[0].body(), "GET /after");
}

/// A request pipelined behind the last one `max_requests_per_connection` allows, sent
/// after the gateway has written that one's answer (with `Connection: close`) but before
/// the client has read it all, is read out, not reset over: the whole answer arrives, then
/// a clean end of stream. The client did not ask for the close and may well have sent
/// more; the socket was closed at once, so the next request's arrival at it was answered
/// with a reset, which threw away the part of the answer not yet read.
#[tokio::test]
async fn ri_a_request_behind_the_last_one_allowed_does_not_cut_its_answer() {
    const BIG: usize = 1 << 20;
    let up = upstream(|_| async { http::Response::new(full(vec![b'x'; BIG])) }).await;
    let gw = TestGateway::to(
        up,
        "[server]\nworkers = 1\nmax_requests_per_connection = 1\n",
    );
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let mut s = sock.connect(gw.addr).await.unwrap();
    s.write_all(get_req("/big").as_bytes()).await.unwrap();
    // The gateway has written the whole answer into its socket by now; the client has
    // read none of it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    s.write_all(get_req("/next").as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    let ended = loop {
        match tokio::time::timeout(WAIT, s.read(&mut buf)).await {
            Ok(Ok(0)) => break "clean end of stream".to_owned(),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Ok(Err(e)) => break format!("{e}"),
            Err(_) => break "no end of stream".to_owned(),
        }
    };
    let head_end = got
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a head")
        + 4;
    let head = String::from_utf8_lossy(&got[..head_end]).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("connection: close"), "{head}");
    assert_eq!(
        (got.len() - head_end, ended.as_str()),
        (BIG, "clean end of stream"),
        "the answer was cut"
    );
}

/// A head that begins with `P` (the connection is first looked at for HTTP/2's preface) is
/// timed from its first byte, as any head is. The look's timer was dropped when it ended,
/// and the inline server started another: such a head had up to twice the header timeout.
#[tokio::test]
async fn ri_a_head_that_starts_like_the_h2_preface_is_timed_from_its_first_byte() {
    let (up, hits) = path_upstream().await;
    let gw = TestGateway::to(
        up,
        "[server]\nworkers = 1\nheader_read_timeout = \"2s\"\nidle_timeout = \"60s\"\n",
    );
    let mut s = connect(gw.addr).await;
    s.write_all(b"P").await.unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    s.write_all(b"OST /p HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    // 2.4 s after the head's first byte: too late.
    let _ = s.write_all(b"\r\n").await;
    let (text, closed) = read_until_close(&mut s, WAIT).await;
    assert!(closed, "{text:?}");
    assert!(!text.contains(" 200 "), "served after its time: {text:?}");
    assert_eq!(hits.load(Ordering::SeqCst), 0);
}

/// On a connection hyper's server took, a head that starts just before the idle timeout
/// and ends after it is served: the connection is not idle while a head comes. hyper's server,
/// which sees none of them until the head is whole, was idle meanwhile, and the idle
/// close cut the head off (the client read the end of the stream, no answer).
#[tokio::test]
async fn ri_a_head_across_the_idle_timeout_after_the_handover_is_served() {
    let (up, _) = path_upstream().await;
    let gw = TestGateway::to(
        up,
        "[server]\nworkers = 1\nheader_read_timeout = \"10s\"\nidle_timeout = \"2s\"\n",
    );
    let mut s = connect(gw.addr).await;
    s.write_all(
        b"POST /a HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    )
    .await
    .unwrap();
    assert_eq!(read_responses(&mut s, 1).await[0].body(), "POST /a ok");
    tokio::time::sleep(Duration::from_millis(1600)).await;
    s.write_all(b"GET /b HTTP/1.1\r\nHo").await.unwrap();
    // Past the idle timeout since the answer.
    tokio::time::sleep(Duration::from_millis(800)).await;
    s.write_all(b"st: a\r\n\r\n").await.unwrap();
    let got = read_responses(&mut s, 1).await;
    assert_eq!(got.len(), 1, "no answer");
    assert_eq!(got[0].body(), "GET /b");
}

/// The same on a connection the inline server keeps: a head in pieces is not idle, however
/// long its header read timeout lets it take, and past twice the idle timeout (when a
/// connection closing for idleness is dropped) it is still served, and the connection kept.
#[tokio::test]
async fn ri_an_inline_head_across_twice_the_idle_timeout_is_served() {
    let (up, _) = path_upstream().await;
    let gw = TestGateway::to(
        up,
        "[server]\nworkers = 1\nheader_read_timeout = \"10s\"\nidle_timeout = \"1s\"\n",
    );
    let mut s = connect(gw.addr).await;
    s.write_all(get_req("/a").as_bytes()).await.unwrap();
    assert_eq!(read_responses(&mut s, 1).await[0].body(), "GET /a");
    s.write_all(b"GET /b HTTP/1.1\r\nHo").await.unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    s.write_all(b"st: a\r\n\r\n").await.unwrap();
    let got = read_responses(&mut s, 1).await;
    assert_eq!(got.len(), 1, "no answer");
    assert_eq!(got[0].body(), "GET /b");
    assert_eq!(got[0].header("connection"), None, "kept alive");
    s.write_all(get_req("/c").as_bytes()).await.unwrap();
    assert_eq!(read_responses(&mut s, 1).await[0].body(), "GET /c");
}

/// Reads `s` to its end, `chunk` bytes at a time with `pause` between reads (a slow client
/// that keeps reading), for at most `limit`; the bytes, and how it ended.
async fn read_slowly(
    s: &mut TcpStream,
    chunk: usize,
    pause: Duration,
    limit: Duration,
) -> (Vec<u8>, String) {
    let mut got = Vec::new();
    let mut buf = vec![0u8; chunk];
    let until = tokio::time::Instant::now() + limit;
    let ended = loop {
        match tokio::time::timeout_at(until, s.read(&mut buf)).await {
            Ok(Ok(0)) => break "end of stream".to_owned(),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Ok(Err(e)) => break format!("{e}"),
            Err(_) => break "time limit".to_owned(),
        }
        // The whole answer (its head, then `BIG_ANSWER` bytes of body) is in.
        if let Some(p) = got.windows(4).position(|w| w == b"\r\n\r\n")
            && got.len() >= p + 4 + BIG_ANSWER
        {
            break "answer in".to_owned();
        }
        tokio::time::sleep(pause).await;
    };
    (got, ended)
}

/// An answer far larger than the sockets' buffers hold.
const BIG_ANSWER: usize = 8 << 20;

/// A client that reads a large answer slowly but steadily (a read every 15 ms, the whole
/// answer about twice `idle_timeout`) gets all of it, on both HTTP/1.1 servers (the inline
/// one; hyper's, after a request with a chunked body): neither the idle timeout, nor the
/// send timeout, nor the check for a client that takes no response data cuts it.
/// (Coverage: the pieces read from the upstream are small here, each taken well within
/// the idle timeout; a piece outlasting it is `send_timeout`'s unit test.)
#[tokio::test]
async fn ri_a_slow_reader_that_keeps_reading_gets_the_whole_answer() {
    // (The request's body is read first: a server that answers without reading it closes
    // its connection with the body's last bytes unread, and that close is a reset, which
    // can throw away the end of its answer.)
    let up = upstream(|req| async {
        let _ = req.into_body().collect().await;
        http::Response::new(full(vec![b'x'; BIG_ANSWER]))
    })
    .await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\nidle_timeout = \"1s\"\n");
    for (path, req) in [
        ("inline", get_req("/big")),
        (
            "hyper's",
            "POST /big HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
                .to_owned(),
        ),
    ] {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        // A window the reads below keep up with, far smaller than the answer (the
        // gateway's send buffer, once the kernel has grown it, signals room at a third
        // free: with a small one those signals come well within the idle timeout).
        sock.set_recv_buffer_size(64 * 1024).unwrap();
        let mut s = sock.connect(gw.addr).await.unwrap();
        s.write_all(req.as_bytes()).await.unwrap();
        // At most 64 KiB per 15 ms, about 4 MiB/s: the answer takes some 2 s.
        let started = std::time::Instant::now();
        let (got, ended) =
            read_slowly(&mut s, 64 * 1024, Duration::from_millis(15), WAIT * 2).await;
        let head_end = got
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .map_or(0, |p| p + 4);
        let body = got.len().saturating_sub(head_end);
        eprintln!("{path} server: {body} bytes in {:?}", started.elapsed());
        assert!(
            body >= BIG_ANSWER,
            "{path} server: {body} bytes of the body, then {ended}, after {:?}",
            started.elapsed()
        );
    }
}
