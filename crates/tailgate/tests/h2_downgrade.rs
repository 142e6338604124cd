//! HTTP/2 requests that would smuggle or inject when a gateway turns them into HTTP/1.1
//! for the upstream ("h2 downgrade" attacks): framing headers, a `content-length` that
//! disagrees with the DATA, CR/LF in names, values and the path, upper-case names,
//! connection-specific headers. The frames are written by hand (the h2 crate refuses to
//! send such requests), over h2c with prior knowledge.
//!
//! Each must be refused on its stream (RST_STREAM or GOAWAY) or answered with a 4xx. A
//! malformed head must never reach the upstream (RFC 9113 §8.1.1); a `content-length` the
//! DATA disagrees with may show only after the head went on, and then the upstream sees
//! that one request and none of the extra bytes. No smuggled request or header ever
//! arrives. A well-formed request on a new connection is served afterwards, and nothing
//! panics. (The answer's status is read only when HPACK sends it plainly: 200, 204, 206,
//! 304, 400, 404, 500; any other counts as not refused, so such a change fails loudly.)
//!
//! Also here, with the same hand-written framing: an idle client that never answers the
//! graceful close is dropped.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::fuzz::count_panics;
use common::*;
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const ACK: u8 = 0x1;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// An HPACK integer with an `n`-bit prefix (RFC 7541 §5.1).
fn hpack_int(out: &mut Vec<u8>, first: u8, n: u32, mut v: usize) {
    let max = (1usize << n) - 1;
    if v < max {
        out.push(first | v as u8);
        return;
    }
    out.push(first | max as u8);
    v -= max;
    while v >= 128 {
        out.push((v % 128 + 128) as u8);
        v /= 128;
    }
    out.push(v as u8);
}

/// A header block of literal fields, never indexed, no Huffman coding: the bytes go on
/// the wire exactly as given, whatever they contain.
fn block(fields: &[(&[u8], &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in fields {
        out.push(0x10);
        hpack_int(&mut out, 0, 7, name.len());
        out.extend_from_slice(name);
        hpack_int(&mut out, 0, 7, value.len());
        out.extend_from_slice(value);
    }
    out
}

/// What the gateway did with stream 1.
#[derive(Debug, PartialEq)]
enum Outcome {
    /// A response HEADERS frame; `status` when its first field is a literal or indexed
    /// `:status` the test can read without a full HPACK decoder.
    Answered(Option<u16>),
    Reset,
    GoAway,
    Closed,
}

/// Sends the preface, SETTINGS, then `frames`, and reads until stream 1 is answered,
/// reset, or the connection ends.
async fn exchange(gw: std::net::SocketAddr, frames: &[Vec<u8>]) -> Outcome {
    let mut s = TcpStream::connect(gw).await.unwrap();
    let mut out = PREFACE.to_vec();
    out.extend(frame(SETTINGS, 0, 0, &[]));
    for f in frames {
        out.extend_from_slice(f);
    }
    s.write_all(&out).await.unwrap();
    outcome(&mut s).await
}

/// Reads until stream 1 is answered, reset, or the connection ends (10 s at most).
async fn outcome(s: &mut TcpStream) -> Outcome {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut buf = Vec::new();
    loop {
        while buf.len() >= 9 {
            let len = (buf[0] as usize) << 16 | (buf[1] as usize) << 8 | buf[2] as usize;
            if buf.len() < 9 + len {
                break;
            }
            let (kind, flags) = (buf[3], buf[4]);
            let stream = u32::from_be_bytes([buf[5], buf[6], buf[7], buf[8]]) & 0x7fff_ffff;
            let payload = buf[9..9 + len].to_vec();
            buf.drain(..9 + len);
            match kind {
                SETTINGS if flags & ACK == 0 => {
                    s.write_all(&frame(SETTINGS, ACK, 0, &[])).await.ok();
                }
                HEADERS if stream == 1 => return Outcome::Answered(status(&payload)),
                RST_STREAM if stream == 1 => return Outcome::Reset,
                GOAWAY => return Outcome::GoAway,
                _ => {}
            }
        }
        let mut chunk = [0u8; 16384];
        match tokio::time::timeout_at(deadline, s.read(&mut chunk)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return Outcome::Closed,
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
            Err(_) => panic!("no answer on stream 1 within 10 s"),
        }
    }
}

/// `:status` from the first field of a response block: an indexed static entry (8–14) or
/// a literal with the indexed name `:status` (index 8) and a plain value.
fn status(block: &[u8]) -> Option<u16> {
    let first = *block.first()?;
    let code = |i: u8| match i {
        8 => Some(200),
        9 => Some(204),
        10 => Some(206),
        11 => Some(304),
        12 => Some(400),
        13 => Some(404),
        14 => Some(500),
        _ => None,
    };
    if first & 0x80 != 0 {
        return code(first & 0x7f);
    }
    // Literal with incremental indexing (6-bit name index) or without / never (4-bit).
    let name = if first & 0x40 != 0 {
        first & 0x3f
    } else {
        first & 0x0f
    };
    if !(8..=14).contains(&name) {
        return None;
    }
    let len = *block.get(1)?;
    if len & 0x80 != 0 {
        return None; // Huffman-coded value
    }
    std::str::from_utf8(block.get(2..2 + len as usize)?)
        .ok()?
        .parse()
        .ok()
}

fn request(extra: &[(&[u8], &[u8])], path: &[u8]) -> Vec<u8> {
    let mut fields: Vec<(&[u8], &[u8])> = vec![
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":authority", b"api.test"),
        (b":path", path),
    ];
    fields.extend_from_slice(extra);
    block(&fields)
}

/// Stream 1: a POST head with `extra` fields, ending the stream.
fn head_only(extra: &[(&[u8], &[u8])], path: &[u8]) -> Vec<Vec<u8>> {
    vec![frame(
        HEADERS,
        END_HEADERS | END_STREAM,
        1,
        &request(extra, path),
    )]
}

/// Stream 1: a POST head with `extra` fields, then `body` in one DATA frame that ends it.
fn with_body(extra: &[(&[u8], &[u8])], path: &[u8], body: &[u8]) -> Vec<Vec<u8>> {
    vec![
        frame(HEADERS, END_HEADERS, 1, &request(extra, path)),
        frame(DATA, END_STREAM, 1, body),
    ]
}

const SMUGGLED: &[u8] = b"GET /smuggled HTTP/1.1\r\nHost: api.test\r\n\r\n";

#[tokio::test]
async fn h2_requests_that_would_smuggle_when_downgraded_are_refused() {
    let panics = count_panics();
    // What reached the upstream: each head as soon as it arrives (a body that never ends
    // must not hide its request), then its body.
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let s = seen.clone();
    let up = upstream(move |req| {
        let s = s.clone();
        async move {
            let head = format!("head: {} {} {:?}", req.method(), req.uri(), req.headers());
            s.lock().unwrap().push(head);
            let body = req.into_body().collect().await.map(|b| b.to_bytes());
            s.lock().unwrap().push(format!("body: {body:?}"));
            http::Response::new(full("ok"))
        }
    })
    .await;
    let gw = TestGateway::to(up, "");

    let chunked_body = [b"5\r\nhello\r\n0\r\n\r\n".as_slice(), SMUGGLED].concat();
    let cases: Vec<(&str, Vec<Vec<u8>>)> = vec![
        (
            "transfer-encoding: chunked",
            with_body(&[(b"transfer-encoding", b"chunked")], b"/te", &chunked_body),
        ),
        (
            "content-length: 0 with a body",
            with_body(&[(b"content-length", b"0")], b"/cl0", SMUGGLED),
        ),
        (
            "content-length shorter than the body",
            with_body(
                &[(b"content-length", b"5")],
                b"/cl5",
                &[b"hello".as_slice(), SMUGGLED].concat(),
            ),
        ),
        (
            "CR LF in a header value",
            head_only(&[(b"x-a", b"1\r\nx-injected: 1")], b"/crlf-value"),
        ),
        (
            "CR LF in a header name",
            head_only(&[(b"x-a\r\nx-injected", b"1")], b"/crlf-name"),
        ),
        (
            "a request line in the path",
            head_only(&[], b"/p HTTP/1.1\r\nHost: api.test\r\n\r\nGET /smuggled"),
        ),
        ("a space in the path", head_only(&[], b"/a b")),
        (
            "an upper-case header name",
            head_only(&[(b"X-Injected", b"1")], b"/upper"),
        ),
        (
            "connection: keep-alive",
            head_only(&[(b"connection", b"keep-alive")], b"/conn"),
        ),
        (
            "upgrade: websocket",
            head_only(&[(b"upgrade", b"websocket")], b"/upgrade"),
        ),
        (
            "te: chunked",
            head_only(&[(b"te", b"chunked")], b"/te-chunked"),
        ),
        (
            "a NUL in a header value",
            head_only(&[(b"x-a", b"1\0x")], b"/nul"),
        ),
    ];

    let mut failures = Vec::new();
    for (name, frames) in &cases {
        // The log is never cleared: bytes smuggled by one case that land late show in the
        // next case's part, or in the whole log's check below, not nowhere.
        let start = seen.lock().unwrap().len();
        let outcome = exchange(gw.addr, frames).await;
        // Give a forwarded request time to land before looking at what the upstream saw.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let upstream_saw = seen.lock().unwrap()[start..].to_vec();
        let heads = upstream_saw
            .iter()
            .filter(|r| r.starts_with("head:"))
            .count();
        // A malformed head is never forwarded (RFC 9113 §8.1.1). A length the DATA
        // disagrees with may show only once the head went on; then that one request, and
        // none of the extra bytes, may have reached the upstream.
        let most = usize::from(name.starts_with("content-length"));
        let refused = match &outcome {
            Outcome::Reset | Outcome::GoAway | Outcome::Closed => true,
            Outcome::Answered(Some(s)) => (400..500).contains(s),
            Outcome::Answered(None) => false,
        };
        let leaked = upstream_saw.iter().any(|r| {
            let r = r.to_ascii_lowercase();
            r.contains("smuggled") || r.contains("x-injected")
        });
        if !refused || leaked || heads > most {
            failures.push(format!(
                "{name}: gateway {outcome:?}; upstream saw {upstream_saw:#?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));

    // A well-formed request over the same hand-made framing is served: the cases above
    // were refused for what they carry, not for how the test writes frames.
    let start = seen.lock().unwrap().len();
    let ok = exchange(
        gw.addr,
        &with_body(&[(b"content-length", b"5")], b"/fine", b"hello"),
    )
    .await;
    assert_eq!(
        ok,
        Outcome::Answered(Some(200)),
        "{:?}",
        seen.lock().unwrap()
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    let all = seen.lock().unwrap().clone();
    // Nothing any case smuggled reached the upstream, however late it came.
    let leaked: Vec<&String> = all
        .iter()
        .filter(|r| {
            let r = r.to_ascii_lowercase();
            r.contains("smuggled") || r.contains("x-injected")
        })
        .collect();
    assert!(leaked.is_empty(), "{leaked:#?}");
    let saw = all[start..].to_vec();
    assert_eq!(saw.len(), 2, "{saw:?}");
    assert!(
        saw[0].contains("/fine") && saw[1].contains("hello"),
        "{saw:?}"
    );
    assert_eq!(
        panics.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "a task panicked"
    );
}

/// A gateway with a 300 ms idle timeout in front of `up`, and an h2c connection to it that
/// has sent its preface and SETTINGS, and nothing more.
async fn idle_h2c_client(up: std::net::SocketAddr) -> (TestGateway, TcpStream) {
    let gw = TestGateway::to(
        up,
        "[server]\nworkers = 1\nidle_timeout = \"300ms\"\nshutdown_grace = \"5s\"\n",
    );
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    let mut hello = PREFACE.to_vec();
    hello.extend(frame(SETTINGS, 0, 0, &[]));
    s.write_all(&hello).await.unwrap();
    (gw, s)
}

/// An h2c client that never answers the PING of HTTP/2's graceful close is not left holding
/// its connection: once closed for idleness, the connection is dropped one idle timeout
/// later (hyper waits for the PING's answer before it closes).
#[tokio::test]
async fn an_idle_h2_client_that_never_answers_is_dropped() {
    let up = upstream(|_| async { http::Response::new(full("ok")) }).await;
    let (_gw, mut s) = idle_h2c_client(up).await;
    // Reads (and ignores) whatever comes, answering nothing, until the server closes.
    assert!(
        closes_within(&mut s, Duration::from_secs(5)).await,
        "the connection is still open after 5 s"
    );
}

/// Reads (and ignores) what comes on `s`, answering nothing: did the server close it
/// within `limit`?
async fn closes_within(s: &mut TcpStream, limit: Duration) -> bool {
    let mut chunk = [0u8; 4096];
    tokio::time::timeout(limit, async {
        loop {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok()
}

/// HTTP/2 heads are timed as HTTP/1 ones are (`header_read_timeout`, here 300 ms, with
/// an idle timeout of 30 s): a client that stops part-way into a header block is cut off
/// at the head's timeout, not held until the idle one, and so is one whose block comes in
/// CONTINUATION frames slower than that in all; a client that is quiet between whole heads
/// is not.
#[tokio::test]
async fn an_h2_head_that_does_not_come_whole_is_cut_off_at_the_header_read_timeout() {
    let up = upstream(|_| async { http::Response::new(full("ok")) }).await;
    let gw = TestGateway::to(
        up,
        "[server]\nworkers = 1\nidle_timeout = \"30s\"\nheader_read_timeout = \"300ms\"\n",
    );
    let mut hello = PREFACE.to_vec();
    hello.extend(frame(SETTINGS, 0, 0, &[]));
    let pad = vec![b'p'; 400];
    let head = request(&[(b"x-pad", &pad)], b"/slow");

    // Stops after a HEADERS frame without END_HEADERS.
    let stops = async {
        let mut s = TcpStream::connect(gw.addr).await.unwrap();
        let mut out = hello.clone();
        out.extend(frame(HEADERS, END_STREAM, 1, &head[..20]));
        // (Before the write: the gateway's clock cannot start before it.)
        let started = tokio::time::Instant::now();
        s.write_all(&out).await.unwrap();
        assert!(
            closes_within(&mut s, Duration::from_secs(5)).await,
            "a head left part-way held its connection 5 s"
        );
        started.elapsed()
    };
    // Sends its block in a HEADERS frame and five CONTINUATION frames, 150 ms apart (h2
    // itself takes at most five per block): the head would be whole 750 ms after its first
    // byte, each gap well under the timeout.
    let trickles = async {
        let mut s = TcpStream::connect(gw.addr).await.unwrap();
        let mut out = hello.clone();
        let parts: Vec<&[u8]> = head.chunks(head.len().div_ceil(6)).collect();
        assert_eq!(parts.len(), 6);
        out.extend(frame(HEADERS, END_STREAM, 1, parts[0]));
        s.write_all(&out).await.unwrap();
        for (i, p) in parts[1..].iter().enumerate() {
            tokio::time::sleep(Duration::from_millis(150)).await;
            let flags = if i == parts.len() - 2 { END_HEADERS } else { 0 };
            if s.write_all(&frame(0x9, flags, 1, p)).await.is_err() {
                break;
            }
        }
        outcome(&mut s).await
    };
    // Quiet for a second between its SETTINGS and a whole head: answered.
    let quiet = async {
        let mut s = TcpStream::connect(gw.addr).await.unwrap();
        s.write_all(&hello).await.unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
        s.write_all(&frame(HEADERS, END_HEADERS | END_STREAM, 1, &head))
            .await
            .unwrap();
        outcome(&mut s).await
    };
    let (took, trickled, answered) = tokio::join!(stops, trickles, quiet);
    assert!(took >= Duration::from_millis(250), "cut off after {took:?}");
    assert!(
        matches!(trickled, Outcome::Closed | Outcome::GoAway),
        "a head trickled over 750 ms: {trickled:?}"
    );
    assert_eq!(answered, Outcome::Answered(Some(200)));
}

/// Reads frames off `s` (`buf` holds what was read before) until `done` says a frame
/// (its kind, stream and payload) ends the wait; panics, saying `what`, if the server
/// closes first or after `within`. Returns the bytes read past that frame.
async fn read_frames_until(
    s: &mut TcpStream,
    mut buf: Vec<u8>,
    within: Duration,
    what: &str,
    mut done: impl FnMut(u8, u32, &[u8]) -> bool,
) -> Vec<u8> {
    let deadline = tokio::time::Instant::now() + within;
    let mut chunk = [0u8; 16384];
    loop {
        while buf.len() >= 9 {
            let len = (buf[0] as usize) << 16 | (buf[1] as usize) << 8 | buf[2] as usize;
            if buf.len() < 9 + len {
                break;
            }
            let kind = buf[3];
            let stream = u32::from_be_bytes([buf[5], buf[6], buf[7], buf[8]]) & 0x7fff_ffff;
            let ends = done(kind, stream, &buf[9..9 + len]);
            buf.drain(..9 + len);
            if ends {
                return buf;
            }
        }
        match tokio::time::timeout_at(deadline, s.read(&mut chunk)).await {
            Ok(Ok(0)) | Ok(Err(_)) => panic!("closed before {what}"),
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
            Err(_) => panic!("no {what} within {within:?}"),
        }
    }
}

/// Reads frames off `s` until the server's GOAWAY (its graceful close has begun); the bytes
/// read past that frame.
async fn until_goaway(s: &mut TcpStream) -> Vec<u8> {
    read_frames_until(
        s,
        Vec::new(),
        Duration::from_secs(10),
        "a GOAWAY",
        |kind, _, _| kind == GOAWAY,
    )
    .await
}

/// A stream the client opens after the idle close began (after the first GOAWAY, which
/// still allows every stream, before the final one) is served, although it is still in
/// flight when the close's deadline passes.
#[tokio::test]
async fn a_stream_opened_during_the_idle_close_is_served() {
    let up = upstream(|_| async {
        tokio::time::sleep(Duration::from_millis(600)).await;
        http::Response::new(full("ok"))
    })
    .await;
    let (_gw, mut s) = idle_h2c_client(up).await;
    // Past the idle timeout: the graceful close (GOAWAY, PING) is under way.
    let buf = until_goaway(&mut s).await;
    for f in head_only(&[], b"/slow") {
        s.write_all(&f).await.unwrap();
    }
    read_frames_until(
        &mut s,
        buf,
        Duration::from_secs(5),
        "the stream's answer",
        |kind, stream, payload| {
            assert!(!(kind == RST_STREAM && stream == 1), "the stream was reset");
            let answered = kind == HEADERS && stream == 1;
            if answered {
                assert_eq!(status(payload), Some(200));
            }
            answered
        },
    )
    .await;
}

/// `max_requests_per_connection` over HTTP/2 holds against a client that never answers
/// the PING of the graceful close (so never gets the final GOAWAY) and goes on opening
/// streams: past the cap by more than a stream limit's worth, and still opening them two
/// seconds into the close (a client that answers stops within a round trip), the
/// connection is dropped, not served for ever.
#[tokio::test]
async fn an_h2_client_ignoring_the_goaway_is_not_served_for_ever() {
    let up = upstream(|_| async { http::Response::new(full("ok")) }).await;
    let gw = TestGateway::to(
        up,
        "[server]\nworkers = 1\nidle_timeout = \"30s\"\nmax_requests_per_connection = 2\n",
    );
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    let mut hello = PREFACE.to_vec();
    hello.extend(frame(SETTINGS, 0, 0, &[]));
    // A connection window that thousands of answers do not shut (WINDOW_UPDATE, stream 0).
    hello.extend(frame(0x8, 0, 0, &(i32::MAX as u32 - 65_535).to_be_bytes()));
    s.write_all(&hello).await.unwrap();
    // Batches of 20 streams (under the server's concurrent-stream limit), each answered
    // before the next is sent; the PING and the SETTINGS are never answered.
    let per = 20u32;
    let mut answered = 0u32;
    let mut closed = false;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    let started = tokio::time::Instant::now();
    let deadline = started + Duration::from_secs(20);
    'batches: for b in 0.. {
        if tokio::time::Instant::now() >= deadline {
            break;
        }
        let mut out = Vec::new();
        for i in 0..per {
            let stream = 2 * (b * per + i) + 1;
            out.extend(frame(
                HEADERS,
                END_HEADERS | END_STREAM,
                stream,
                &request(&[], b"/x"),
            ));
        }
        if s.write_all(&out).await.is_err() {
            closed = true;
            break;
        }
        let mut got = 0;
        while got < per {
            while buf.len() >= 9 {
                let len = (buf[0] as usize) << 16 | (buf[1] as usize) << 8 | buf[2] as usize;
                if buf.len() < 9 + len {
                    break;
                }
                if buf[3] == HEADERS {
                    assert_eq!(status(&buf[9..9 + len]), Some(200));
                    answered += 1;
                    got += 1;
                } else if buf[3] == RST_STREAM {
                    got += 1;
                }
                buf.drain(..9 + len);
            }
            if got >= per {
                break;
            }
            match tokio::time::timeout_at(deadline, s.read(&mut chunk)).await {
                Ok(Ok(0)) | Ok(Err(_)) => {
                    closed = true;
                    break 'batches;
                }
                Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
                Err(_) => break 'batches,
            }
        }
    }
    assert!(
        closed,
        "{answered} streams served in 20 s; the connection is still open"
    );
    // Not before two seconds of it, nor before 200 streams past the cap.
    assert!(started.elapsed() >= Duration::from_secs(2));
    assert!(answered >= 2 + 200, "{answered} streams answered");
}

/// Rapid reset (CVE-2023-44487): a client that opens streams and resets each at once,
/// before its answer, has its connection dropped once it has opened 500 and given up on
/// most of them. Each reset stream was a request routed and sent upstream, and freed its
/// place under the stream limit at once: the upstream got a request per 40 bytes the
/// client sent, for as long as it liked.
#[tokio::test]
async fn a_client_that_resets_most_of_its_streams_at_once_is_dropped() {
    let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let s = seen.clone();
    let up = upstream(move |_| {
        s.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            http::Response::new(full("ok"))
        }
    })
    .await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\n");
    // Bodiless requests (HEADERS with END_STREAM), and ones whose body is still to come.
    for ended in [true, false] {
        seen.store(0, std::sync::atomic::Ordering::SeqCst);
        let tcp = TcpStream::connect(gw.addr).await.unwrap();
        let (mut client, conn) = h2::client::handshake(tcp).await.unwrap();
        let conn = tokio::spawn(conn);
        // In rounds of 50: opened, taken by the gateway (their requests on their way
        // upstream), then reset. (Reset before the server takes them, h2 itself refuses
        // more than a few.)
        let mut sent = 0;
        'rounds: for _ in 0..40 {
            let mut streams = Vec::new();
            for _ in 0..50 {
                match client.clone().ready().await {
                    Ok(c) => client = c,
                    Err(_) => break 'rounds,
                }
                let req = http::Request::get("http://a/x").body(()).unwrap();
                let Ok((resp, stream)) = client.send_request(req, ended) else {
                    break 'rounds;
                };
                streams.push((resp, stream));
            }
            // Taken by the gateway (their requests reached the upstream) before the resets,
            // however long that takes on a loaded machine: reset first, the h2 crate's own
            // guard would drop the connection, and the gateway's go untested.
            let taken = sent + streams.len();
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while seen.load(std::sync::atomic::Ordering::SeqCst) < taken
                && !conn.is_finished()
                && std::time::Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            for (_, mut stream) in streams {
                stream.send_reset(h2::Reason::CANCEL);
                sent += 1;
            }
        }
        let closed = tokio::time::timeout(Duration::from_secs(10), conn).await;
        assert!(
            closed.is_ok(),
            "end_of_stream {ended}: the connection was not dropped ({sent} streams reset)"
        );
        assert!(sent < 2000, "end_of_stream {ended}: every stream was taken");
        let seen = seen.load(std::sync::atomic::Ordering::SeqCst);
        assert!(
            seen < 1000,
            "end_of_stream {ended}: the upstream got {seen} requests"
        );
    }
}

/// Below Envoy's count of 500 requests, a client that gives up on most of its requests
/// early keeps its connection: 200 streams taken and reset at once, then a request is
/// answered on it. It was dropped after 100 (a gRPC client whose short deadlines expire
/// during a slow spell, cut off with its healthy streams).
#[tokio::test]
async fn a_client_resetting_fewer_than_500_streams_keeps_its_connection() {
    let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let s = seen.clone();
    let up = upstream(move |req: http::Request<hyper::body::Incoming>| {
        s.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let slow = req.uri().path() == "/x";
        async move {
            if slow {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            http::Response::new(full("ok"))
        }
    })
    .await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\n");
    let tcp = TcpStream::connect(gw.addr).await.unwrap();
    let (mut client, conn) = h2::client::handshake(tcp).await.unwrap();
    let conn = tokio::spawn(conn);
    let mut sent = 0;
    for _ in 0..4 {
        let mut streams = Vec::new();
        for _ in 0..50 {
            client = client.ready().await.unwrap();
            let req = http::Request::get("http://a/x").body(()).unwrap();
            streams.push(client.send_request(req, true).unwrap());
        }
        let taken = sent + streams.len();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while seen.load(std::sync::atomic::Ordering::SeqCst) < taken
            && std::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for (_, mut stream) in streams {
            stream.send_reset(h2::Reason::CANCEL);
            sent += 1;
        }
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!conn.is_finished(), "the connection was dropped");
    still_answers(client).await;
}

/// A client whose deadline passes while a slow upstream works (a gRPC client with a short
/// deadline, say) gives up on its requests before their answers, but not within a second
/// of their start: it is no rapid reset, and its connection is kept.
#[tokio::test]
async fn a_client_giving_up_on_slow_requests_is_not_taken_for_rapid_reset() {
    let up = upstream(|req: http::Request<hyper::body::Incoming>| async move {
        if req.uri().path() == "/slow" {
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
        http::Response::new(full("ok"))
    })
    .await;
    let gw = TestGateway::to(up, "[server]\nworkers = 1\n");
    let tcp = TcpStream::connect(gw.addr).await.unwrap();
    let (mut client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let mut streams = Vec::new();
    for _ in 0..150 {
        client = client.ready().await.unwrap();
        let req = http::Request::get("http://a/slow").body(()).unwrap();
        streams.push(client.send_request(req, true).unwrap());
    }
    // Given up on after 2 s (twice the second within which a reset counts as rapid, from
    // when the test sent them: the gateway may have taken them later on a loaded machine).
    tokio::time::sleep(Duration::from_secs(2)).await;
    for (_, mut stream) in streams {
        stream.send_reset(h2::Reason::CANCEL);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    still_answers(client).await;
}

/// `max_requests_per_connection` holds on a connection already closing for idleness: a
/// client that answers no PING (so the graceful close never ends) and keeps a request of
/// its own in flight has its connection dropped once it goes on opening streams well past
/// the cap. The cap was counted only from a close it began itself, so such a client was
/// served any number of requests.
#[tokio::test]
async fn the_request_cap_holds_on_a_connection_already_closing() {
    let up = upstream(|req: http::Request<hyper::body::Incoming>| async move {
        if req.uri().path() == "/slow" {
            tokio::time::sleep(Duration::from_secs(10)).await;
        }
        http::Response::new(full("ok"))
    })
    .await;
    let gw = TestGateway::to(
        up,
        "[server]\nworkers = 1\nidle_timeout = \"1s\"\nmax_requests_per_connection = 10\n",
    );
    let get = |path: &[u8]| {
        block(&[
            (b":method", b"GET"),
            (b":scheme", b"http"),
            (b":authority", b"a"),
            (b":path", path),
        ])
    };
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    let mut out = PREFACE.to_vec();
    out.extend(frame(SETTINGS, 0, 0, &[]));
    s.write_all(&out).await.unwrap();
    // The idle close begins (GOAWAY, PING); nothing answers its PING.
    until_goaway(&mut s).await;
    let mut out = frame(HEADERS, END_HEADERS | END_STREAM, 1, &get(b"/slow"));
    for i in 0..10u32 {
        out.extend(frame(
            HEADERS,
            END_HEADERS | END_STREAM,
            3 + 2 * i,
            &get(b"/q"),
        ));
    }
    s.write_all(&out).await.unwrap();
    // Past the cap's patience (2 s), 300 more while `/slow` is in flight, in rounds of 150
    // (the answers read between them: at most 200 streams may be open at once).
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let mut next = 23u32;
    let mut last_round = std::time::Instant::now();
    for _ in 0..2 {
        let (_, closed) = read_all_until_close(&mut s, Duration::from_millis(100)).await;
        assert!(
            !closed,
            "the connection closed before the requests past the cap"
        );
        let mut out = Vec::new();
        for _ in 0..150 {
            out.extend(frame(HEADERS, END_HEADERS | END_STREAM, next, &get(b"/q")));
            next += 2;
        }
        last_round = std::time::Instant::now();
        let _ = s.write_all(&out).await;
        let (_, closed) = read_all_until_close(&mut s, Duration::from_millis(1500)).await;
        if closed {
            break;
        }
    }
    let (_, closed) = read_all_until_close(&mut s, Duration::from_secs(10)).await;
    assert!(closed, "the connection stayed open");
    assert!(
        last_round.elapsed() < Duration::from_secs(3),
        "closed {:?} after the last requests: not for the cap (the slow request ends after 10 s)",
        last_round.elapsed()
    );
    assert!(next > 23 + 2 * 150, "dropped before the second round");
}

/// Reads (and drops) until the peer closes or `wait` passes; how much, and whether it
/// closed.
async fn read_all_until_close(s: &mut TcpStream, wait: Duration) -> (usize, bool) {
    let deadline = tokio::time::Instant::now() + wait;
    let mut n = 0;
    let mut chunk = [0u8; 16384];
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut chunk)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (n, true),
            Ok(Ok(k)) => n += k,
            Err(_) => return (n, false),
        }
    }
}

/// The connection of `client` is kept: a request on it is answered `200`.
async fn still_answers(client: h2::client::SendRequest<bytes::Bytes>) {
    let mut client = client.ready().await.expect("the connection is kept");
    let req = http::Request::get("http://a/q").body(()).unwrap();
    let (resp, _) = client
        .send_request(req, true)
        .expect("the connection is kept");
    let resp = tokio::time::timeout(Duration::from_secs(5), resp)
        .await
        .expect("an answer in time")
        .expect("an answer");
    assert_eq!(resp.status(), 200);
}
