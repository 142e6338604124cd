//! Mutated HTTP/1.x requests against a live gateway, over real sockets.
//!
//! Valid requests (keep-alive, pipelined, Content-Length and chunked bodies, trailers,
//! `Expect: 100-continue`, HTTP/1.0, HEAD, hop-by-hop headers) are mutated with bit flips,
//! hostile bytes, inserted framing headers, deleted, duplicated and spliced spans, and
//! truncation, and sent in random pieces. For every case:
//!
//! - the gateway answers with well-formed HTTP statuses it can give (never a 500), or
//!   closes, and closes within a bound (no hang);
//! - **the upstream answers exactly the requests the client gets answers for**: each request
//!   the upstream reads in full is counted under the client's address (every case connects
//!   from its own `127.0.0.x`, which the gateway forwards in `X-Forwarded-For`), and the count
//!   must equal the `200`s the client reads. A request smuggled past the gateway's framing
//!   shows up as an upstream request with no answer to the client;
//! - every refusal of malformed input (400, 413, 431, 501, 505) is the gateway's JSON error,
//!   whichever HTTP/1 server read the head (the inline one, or hyper's behind the smuggling
//!   guard); after it the connection is closed and nothing more is served on it.
//!
//! No task may panic anywhere in the process (a panic hook counts them), and the gateway
//! must serve a plain request at the end.
//!
//! Deterministic: a fixed seed. `TAILGATE_FUZZ_SEED` and `TAILGATE_FUZZ_CASES` run other or
//! more cases locally, `TAILGATE_FUZZ_SHOW=<status>` prints the cases answered with it; a
//! failure prints the seed, the case number and the bytes sent.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::fuzz::{Alphabet, Rng, after_first_line, count_panics, env_or};
use common::*;
use http_body_util::BodyExt;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpSocket;

const CORPUS: &[&[u8]] = &[
    b"GET /a HTTP/1.1\r\nHost: t\r\n\r\n",
    b"POST /b HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello",
    b"POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    b"POST /c2 HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n3\r\nabc\r\n0\r\nX-Trailer: 1\r\n\r\n",
    b"GET /d HTTP/1.0\r\n\r\n",
    b"GET /d2 HTTP/1.0\r\nConnection: keep-alive\r\nHost: t\r\n\r\n",
    b"POST /e HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\nabc",
    b"GET /f?x=1 HTTP/1.1\r\nHost: t\r\nConnection: keep-alive, x-a\r\nX-A: 1\r\nTE: trailers\r\nKeep-Alive: timeout=5\r\n\r\n",
    b"HEAD /g HTTP/1.1\r\nHost: t\r\n\r\n",
    b"GET /h HTTP/1.1\r\nHost: t\r\n\r\nPOST /i HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nhiGET /j HTTP/1.1\r\nHost: t\r\n\r\n",
    b"PUT /k HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nX-Request-Id: abc\r\nContent-Length: 9\r\n\r\n{\"a\": 1}\n",
    b"OPTIONS * HTTP/1.1\r\nHost: t\r\n\r\n",
    b"GET http://t/l HTTP/1.1\r\nHost: t\r\n\r\n",
];

const BYTES: &[u8] = b"\0\r\n \t:;,\x7f\xff\x800-9aAzZ/?%\"";

const TOKENS: &[&[u8]] = &[
    b"\r\n",
    b"\n",
    b"\r",
    b" ",
    b"\r\n\r\n",
    b"Content-Length: 7\r\n",
    b"Content-Length: 0\r\n",
    b"Content-Length: -1\r\n",
    b"Content-Length: +5\r\n",
    b"Content-Length: 5, 5\r\n",
    b"Content-Length: 99999999999999999999\r\n",
    b"Transfer-Encoding: chunked\r\n",
    b"Transfer-Encoding: gzip, chunked\r\n",
    b"Transfer-Encoding: chunked, gzip\r\n",
    b"Transfer-Encoding : chunked\r\n",
    b" Transfer-Encoding: chunked\r\n",
    b"Transfer-Encoding:\tchunked\r\n",
    b"Transfer-Encoding: xchunked\r\n",
    b"0\r\n\r\n",
    b"ffffffffffffffffff\r\n",
    b"GET /smuggled HTTP/1.1\r\nHost: t\r\n\r\n",
    b"Upgrade: websocket\r\nConnection: upgrade\r\n",
    b"Expect: 100-continue\r\n",
    b"Connection: close\r\n",
    b"Host: u\r\n",
    b"X-Forwarded-For: 10.0.0.1\r\n",
    b"Content-Length: 200000\r\n",
    b"Transfer-Encoding: gzip\r\n",
    b"Transfer-Encoding: identity\r\n",
    b"HTTP/1.1",
    b"HTTP/2.0",
];

/// Versions written over a request line's.
const VERSIONS: &[&[u8]] = &[
    b"HTTP/1.2",
    b"HTTP/2.0",
    b"HTTP/0.9",
    b"HTTP/1.",
    b"http/1.1",
    b"HTTP/11",
];

/// One mutated input: a corpus entry with 1 to 3 mutations, mostly 1.
fn mutate(rng: &mut Rng) -> Vec<u8> {
    let mut b = rng.pick(CORPUS).to_vec();
    let alphabet = Alphabet {
        bytes: BYTES,
        tokens: TOKENS,
        max_span: 8,
    };
    for _ in 0..*rng.pick(&[1, 1, 1, 2, 3]) {
        let at = rng.below(b.len() + 1);
        let op = rng.below(10);
        if !alphabet.mutate(rng, &mut b, op, at) {
            match op {
                6 => {
                    let other = rng.pick(CORPUS);
                    let from = rng.below(other.len());
                    b.splice(at..at, other[from..].iter().copied());
                }
                7 => {
                    if let Some(p) = b
                        .windows(8)
                        .position(|w| w == b"HTTP/1.1" || w == b"HTTP/1.0")
                    {
                        b.splice(p..p + 8, rng.pick(VERSIONS).iter().copied());
                    }
                }
                8 => {
                    // A header line too long for the limit (431).
                    let line = after_first_line(&b);
                    let big = format!("X-Big: {}\r\n", "a".repeat(3000 + rng.below(3000)));
                    b.splice(line..line, big.into_bytes());
                }
                _ => alphabet.token_after_first_line(rng, &mut b),
            }
        }
        if b.is_empty() {
            b.push(b'G');
        }
    }
    b
}

/// The statuses in a response stream (`HTTP/1.x NNN `), in order, with where each starts.
fn statuses(text: &[u8]) -> Vec<(u16, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(p) = text[i..]
        .windows(9)
        .position(|w| w == b"HTTP/1.1 " || w == b"HTTP/1.0 ")
    {
        let at = i + p + 9;
        if let Some(code) = text
            .get(at..at + 3)
            .and_then(|c| std::str::from_utf8(c).ok())
            .and_then(|c| c.parse::<u16>().ok())
        {
            out.push((code, at - 9));
        }
        i = at;
    }
    out
}

/// Statuses the gateway gives when it refuses input and closes the connection.
const REFUSALS: &[u16] = &[400, 413, 431, 501, 505];

/// Every status a case may see: the upstream's 200, `100 Continue`, the gateway's refusals
/// and its timeouts (a body that never ends: 408 while it is read here, 504 when the
/// upstream waits for it), and what the upstream's own parser says about a request the
/// gateway passed on (400). A 500 would mean a bug; a 502 an upstream connection lost.
/// A path no route takes (`*`, or one without its leading `/`) gets the gateway's 404.
const ALLOWED: &[u16] = &[100, 200, 400, 404, 408, 413, 414, 417, 431, 501, 504, 505];

struct Case {
    n: usize,
    bytes: Vec<u8>,
    pieces: Vec<usize>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutated_requests_never_panic_hang_or_desync() {
    let panics = count_panics();

    // Requests the upstream read in full, by the client address the gateway forwarded.
    let seen: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let s = seen.clone();
    let up = upstream(move |req| {
        let s = s.clone();
        async move {
            let client = req
                .headers()
                .get_all("x-forwarded-for")
                .iter()
                .filter_map(|v| v.to_str().ok())
                .flat_map(|v| v.split(','))
                .last()
                .unwrap_or("")
                .trim()
                .to_string();
            if req.into_body().collect().await.is_ok() {
                *s.lock().unwrap().entry(client).or_default() += 1;
            }
            http::Response::new(full("ok"))
        }
    })
    .await;
    // Short client timeouts, so every case ends with the gateway closing, yet far above an
    // exchange with the upstream even on a loaded machine: the head timer of a pipelined
    // head cut short can run while the request before it is in flight (on a connection
    // hyper's server took), and the request would be lost after the upstream counted it.
    // The upstream response timeout likewise: a body that did arrive is never cut off by
    // it (a body that stops never arrives, and gets its 504 after it).
    let gw = TestGateway::start(&format!(
        "[server]\nworkers = 1\nheader_read_timeout = \"1s\"\nidle_timeout = \"300ms\"\n\
         max_header_bytes = 4096\nmax_body_bytes = 100000\n\
         [[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n\
         [[route]]\npath_prefix = \"/\"\ncluster = \"up\"\nresponse_timeout = \"5s\"\n"
    ));
    let gw_addr = gw.addr;

    let seed: u64 = env_or("TAILGATE_FUZZ_SEED", 0x7a11_6a7e);
    let cases: usize = env_or("TAILGATE_FUZZ_CASES", 2000);
    let mut rng = Rng(seed);
    let all: Vec<Case> = (0..cases)
        .map(|n| {
            let bytes = mutate(&mut rng);
            let mut pieces: Vec<usize> = (0..rng.below(3))
                .map(|_| rng.below(bytes.len() + 1))
                .collect();
            pieces.sort_unstable();
            Case { n, bytes, pieces }
        })
        .collect();

    // TAILGATE_FUZZ_SHOW=<status> prints the cases answered first with it (0: none).
    let show: Option<u16> = std::env::var("TAILGATE_FUZZ_SHOW")
        .ok()
        .and_then(|v| v.parse().ok());

    // 48 lanes, each with its own client address, run their cases one after another.
    const LANES: usize = 48;
    let all = Arc::new(all);
    let mut lanes = Vec::new();
    for lane in 0..LANES {
        let all = all.clone();
        let seen = seen.clone();
        lanes.push(tokio::spawn(async move {
            let ip = Ipv4Addr::new(127, 0, 0, 10 + lane as u8);
            let mut failures = Vec::new();
            let mut tally: HashMap<u16, usize> = HashMap::new();
            for case in all.iter().skip(lane).step_by(LANES) {
                let (text, closed) = run_case(ip, gw_addr, case).await;
                let got: Vec<u16> = statuses(&text).iter().map(|&(s, _)| s).collect();
                let upstream_answered = seen.lock().unwrap().remove(&ip.to_string()).unwrap_or(0);
                for &s in &got {
                    *tally.entry(s).or_default() += 1;
                }
                if show == Some(got.first().copied().unwrap_or(0)) {
                    eprintln!(
                        "case {}: {:?}\n  -> {:?}",
                        case.n,
                        String::from_utf8_lossy(&case.bytes),
                        String::from_utf8_lossy(&text)
                    );
                }
                if got.is_empty() {
                    // Closed without an answer: input that ended before a whole head (a
                    // header read timeout), or one hyper drops without a response.
                    *tally.entry(0).or_default() += 1;
                }
                let problems = check(case, &text, closed, upstream_answered);
                if !problems.is_empty() {
                    failures.push(format!(
                        "case {}: {}\n  sent ({:?} in pieces at {:?}): {:?}\n  got: {:?}",
                        case.n,
                        problems.join("; "),
                        case.bytes.len(),
                        case.pieces,
                        String::from_utf8_lossy(&case.bytes),
                        String::from_utf8_lossy(&text),
                    ));
                }
            }
            (failures, tally)
        }));
    }
    let mut failures = Vec::new();
    let mut tally: HashMap<u16, usize> = HashMap::new();
    for l in lanes {
        let (f, t) = l.await.unwrap();
        failures.extend(f);
        for (k, v) in t {
            *tally.entry(k).or_default() += v;
        }
    }
    let mut counts: Vec<_> = tally.into_iter().collect();
    counts.sort_unstable();
    eprintln!("seed {seed:#x}, {cases} cases, statuses seen (0: closed without one): {counts:?}");
    assert!(
        failures.is_empty(),
        "seed {seed:#x}: {} of {cases} cases failed:\n{}",
        failures.len(),
        failures[..failures.len().min(10)].join("\n")
    );
    // The mutations must reach both sides of the parser, or the test proves little.
    let seen_of = |s: u16| counts.iter().find(|(k, _)| *k == s).map_or(0, |(_, v)| *v);
    assert!(
        seen_of(200) > cases / 10,
        "too few cases served: {counts:?}"
    );
    assert!(
        seen_of(400) > cases / 10,
        "too few cases refused: {counts:?}"
    );

    let resp = get(gw_addr, "/after").await;
    assert_eq!(resp.status(), 200);
    assert_eq!(panics.load(Ordering::SeqCst), 0, "a task panicked");
}

/// What is wrong with one case's outcome: `text` as read, whether the gateway closed, and
/// how many of its requests the upstream read in full.
fn check(case: &Case, text: &[u8], closed: bool, upstream_answered: usize) -> Vec<String> {
    let at = statuses(text);
    let got: Vec<u16> = at.iter().map(|&(s, _)| s).collect();
    let answered_200 = got.iter().filter(|&&s| s == 200).count();
    let mut problems = Vec::new();
    if !closed {
        problems.push("the gateway did not close the connection within 10 s".to_string());
    }
    if let Some(bad) = got.iter().find(|s| !ALLOWED.contains(s)) {
        problems.push(format!("unexpected status {bad}"));
    }
    if upstream_answered != answered_200 {
        problems.push(format!(
            "the upstream answered {upstream_answered} requests, the client got {answered_200} answers"
        ));
    }
    // A response to HEAD declares a length and has no body, rightly.
    let head_sent = case.bytes.windows(4).any(|w| w == b"HEAD");
    for (i, &(status, start)) in at.iter().enumerate().filter(|_| !head_sent) {
        let end = at.get(i + 1).map_or(text.len(), |&(_, p)| p);
        if let Some(short) = cut_short(&text[start..end]) {
            problems.push(format!("the gateway's {status} arrived cut short: {short}"));
        }
    }
    // Every refusal is the gateway's JSON error, from either HTTP/1 server (an answer to
    // HEAD has no body, rightly).
    for (i, &(status, start)) in at.iter().enumerate().filter(|_| !head_sent) {
        let end = at.get(i + 1).map_or(text.len(), |&(_, p)| p);
        if REFUSALS.contains(&status) && !is_gateway_answer(&text[start..end]) {
            problems.push(format!("a {status} without the gateway's JSON error"));
        }
    }
    if let Some(i) = got.iter().position(|s| REFUSALS.contains(s)) {
        let end = at.get(i + 1).map_or(text.len(), |&(_, p)| p);
        if i + 1 != got.len() && is_gateway_answer(&text[at[i].1..end]) {
            problems.push(format!("served more after refusing: {got:?}"));
        }
    }
    problems
}

/// For one of the gateway's JSON answers, whether fewer body bytes arrived than its
/// `content-length` says (as when a close with unread input resets the connection).
fn cut_short(response: &[u8]) -> Option<String> {
    if !is_gateway_answer(response) && !response.windows(16).any(|w| w == b"application/json") {
        return None;
    }
    let head_end = response.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = String::from_utf8_lossy(&response[..head_end]).to_ascii_lowercase();
    let declared: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))?
        .trim()
        .parse()
        .ok()?;
    let body = response.len() - head_end;
    (body != declared).then(|| format!("{body} of {declared} body bytes"))
}

/// Whether a response came from the gateway (its JSON error body) rather than from the
/// upstream's parser, whose answer the gateway relays like any other.
fn is_gateway_answer(response: &[u8]) -> bool {
    response.windows(12).any(|w| w == b"\"request_id\"")
}

/// Sends the case from `ip` in its pieces, then reads until the gateway closes (10 s at
/// most). The write side stays open: the client's end of stream would cancel a request in
/// flight, and every answer the upstream gave must reach the client.
async fn run_case(ip: Ipv4Addr, gw: SocketAddr, case: &Case) -> (Vec<u8>, bool) {
    let sock = TcpSocket::new_v4().unwrap();
    sock.set_reuseaddr(true).unwrap();
    sock.bind(SocketAddr::new(IpAddr::V4(ip), 0)).unwrap();
    let mut s = sock.connect(gw).await.unwrap();
    let mut from = 0;
    for &to in case.pieces.iter().chain(std::iter::once(&case.bytes.len())) {
        if to > from {
            // The gateway may close after refusing an earlier piece.
            if s.write_all(&case.bytes[from..to]).await.is_err() {
                break;
            }
            s.flush().await.ok();
            tokio::task::yield_now().await;
            from = to;
        }
    }
    let (text, closed) = read_until_close(&mut s, Duration::from_secs(10)).await;
    (text.into_bytes(), closed)
}
