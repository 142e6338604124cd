//! Mutated HTTP/1.x responses from an upstream, against a live gateway with pooled
//! upstream connections.
//!
//! The upstream client is hand-written (`upstream/h1.rs`), so its framing is checked here
//! the way the request side is in `fuzz_h1.rs`. A raw upstream answers each request with a
//! response built for it (Content-Length, chunked with trailers, interim 100s, HTTP/1.0
//! until close, 204, 304, `Connection: close`) and then mutated: bit flips, hostile bytes,
//! framing headers, wrong lengths, spans deleted or duplicated, truncation, and a second
//! response appended after the first (response splitting). Every body carries the token
//! of the request it answers.
//!
//! What must hold for every request:
//! - **no client ever gets bytes meant for another request**: a token other than its own
//!   in its body means bytes left on a pooled connection were read as the next
//!   exchange's response (pool poisoning, one tenant's answer to another);
//! - the client gets an answer or a clean failure within a bound: nothing hangs;
//! - no task panics, and the gateway serves a plain request afterwards.
//!
//! Deterministic responses per request (seeded by the request's token); the interleaving
//! of requests over pooled connections is not. `TAILGATE_FUZZ_SEED` and
//! `TAILGATE_FUZZ_CASES` run other or more cases locally.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::fuzz::{Alphabet, Rng, count_panics, env_or};
use common::*;
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const BYTES: &[u8] = b"\0\r\n \t:;,\x7f\xff0-9aAzZ";

const TOKENS: &[&[u8]] = &[
    b"\r\n",
    b"\n",
    b" ",
    b"Content-Length: 3\r\n",
    b"Content-Length: 0\r\n",
    b"Content-Length: -1\r\n",
    b"Content-Length: 99999999999999999999\r\n",
    b"Transfer-Encoding: chunked\r\n",
    b"Transfer-Encoding: gzip\r\n",
    b"Transfer-Encoding: chunked, identity\r\n",
    b"Connection: close\r\n",
    b"Connection: keep-alive\r\n",
    b"0\r\n\r\n",
    b"ffffffffffffffffff\r\n",
    b"HTTP/1.1 200 OK\r\n",
];

/// A request's mark in a body: its token and a check value, `tok=<token>:<check>;`. A
/// mutation can turn one token's digits into another's, but not both numbers at once, so
/// an intact pair is always bytes written for that token's request.
fn mark(token: u64) -> String {
    format!("tok={token}:{};", check_of(token))
}

fn check_of(token: u64) -> u64 {
    token.wrapping_mul(2_654_435_761) % 1_000_000_007
}

/// The token of the response appended after the one for `token` (response splitting):
/// one of its own per request, so it is never mistaken for another request's copy.
fn injected(token: u64) -> u64 {
    token + 1_000_000
}

/// The response to the request with `token`, before mutation, and whether the upstream
/// closes after it.
fn response(rng: &mut Rng, token: u64) -> (Vec<u8>, bool) {
    let body = mark(token);
    let n = body.len();
    let (text, close) = match rng.below(8) {
        0 | 1 => (
            format!("HTTP/1.1 200 OK\r\nContent-Length: {n}\r\n\r\n{body}"),
            false,
        ),
        2 => (
            format!(
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n{n:x};x=1\r\n{body}\r\n0\r\nX-T: 1\r\n\r\n"
            ),
            false,
        ),
        3 => (
            format!(
                "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: {n}\r\n\r\n{body}"
            ),
            false,
        ),
        4 => (format!("HTTP/1.0 200 OK\r\n\r\n{body}"), true),
        5 => ("HTTP/1.1 204 No Content\r\n\r\n".to_string(), false),
        6 => (
            format!("HTTP/1.1 304 Not Modified\r\nContent-Length: {n}\r\n\r\n"),
            false,
        ),
        _ => (
            format!("HTTP/1.1 200 OK\r\nContent-Length: {n}\r\nConnection: close\r\n\r\n{body}"),
            true,
        ),
    };
    (text.into_bytes(), close)
}

/// `r` with 1 to 3 mutations (mostly 1), one of them a whole second response appended.
fn mutate(rng: &mut Rng, mut r: Vec<u8>, token: u64) -> Vec<u8> {
    let alphabet = Alphabet {
        bytes: BYTES,
        tokens: TOKENS,
        max_span: 6,
    };
    for _ in 0..*rng.pick(&[1, 1, 1, 2, 3]) {
        let at = rng.below(r.len() + 1);
        let op = rng.below(8);
        if !alphabet.mutate(rng, &mut r, op, at) {
            if op == 6 {
                let body = mark(injected(token));
                let extra = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
                r.extend_from_slice(extra.as_bytes());
            } else {
                // A header right after the status line.
                alphabet.token_after_first_line(rng, &mut r);
            }
        }
    }
    r
}

/// What the upstream writes for the request with `token` (the same each time it is
/// asked, retries included), and whether it closes after.
fn written(seed: u64, token: u64) -> (Vec<u8>, bool) {
    let mut rng = Rng(seed ^ token.wrapping_mul(0x100_0000_01b3));
    let (clean, close) = response(&mut rng, token);
    (mutate(&mut rng, clean, token), close)
}

/// The upstream: reads bodiless requests `GET /t/<token>`, answers each with its mutated
/// response, keeps the connection unless the response before mutation was one that closes
/// (HTTP/1.0, `Connection: close`), and closes a connection with no request for 800 ms.
async fn mutating_upstream(seed: u64, answered: Arc<AtomicUsize>) -> std::net::SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let answered = answered.clone();
            tokio::spawn(serve(s, seed, answered));
        }
    });
    addr
}

async fn serve(mut s: TcpStream, seed: u64, answered: Arc<AtomicUsize>) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            match tokio::time::timeout(Duration::from_millis(800), s.read(&mut chunk)).await {
                Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
                _ => return,
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
        buf.drain(..head_end);
        let token: u64 = head
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.strip_prefix("/t/"))
            .and_then(|t| t.parse().ok())
            .unwrap_or(0);
        let (bytes, close) = written(seed, token);
        answered.fetch_add(1, Ordering::SeqCst);
        if s.write_all(&bytes).await.is_err() || close {
            let _ = s.shutdown().await;
            return;
        }
    }
}

#[derive(Debug)]
enum Got {
    /// Status and body as the client read them.
    Answer(u16, Vec<u8>),
    /// The exchange failed (the gateway cut the response short or closed).
    Failed,
}

async fn fetch(gw: std::net::SocketAddr, token: u64) -> Got {
    let mut c = h1_client(gw).await;
    let req = http::Request::get(format!("/t/{token}"))
        .header("host", "fuzz.test")
        .body(full(""))
        .unwrap();
    let resp = match c.send_request(req).await {
        Ok(r) => r,
        Err(_) => return Got::Failed,
    };
    let status = resp.status().as_u16();
    match resp.into_body().collect().await {
        Ok(b) => Got::Answer(status, b.to_bytes().to_vec()),
        Err(_) => Got::Failed,
    }
}

/// The intact marks in a body: tokens whose check value is right.
fn marks(body: &[u8]) -> Vec<u64> {
    let text = String::from_utf8_lossy(body);
    text.split("tok=")
        .skip(1)
        .filter_map(|rest| {
            let (t, rest) = rest.split_once(':')?;
            let (c, _) = rest.split_once(';')?;
            let (t, c) = (t.parse::<u64>().ok()?, c.parse::<u64>().ok()?);
            (check_of(t) == c).then_some(t)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutated_responses_never_reach_another_request() {
    let panics = count_panics();
    let seed: u64 = env_or("TAILGATE_FUZZ_SEED", 0x5ee_d00d);
    let cases: u64 = env_or("TAILGATE_FUZZ_CASES", 1500);

    let answered = Arc::new(AtomicUsize::new(0));
    let up = mutating_upstream(seed, answered.clone()).await;
    // Pooled connections (kept up to 4 s idle), so one exchange's leftovers would meet
    // the next request; deadlines short enough that a response which never ends fails
    // quickly.
    // A second route to a well-behaved upstream, to show the same worker still serves.
    let plain = upstream(|_| async { http::Response::new(full("fine")) }).await;
    let gw = TestGateway::start(&format!(
        "[server]\nworkers = 1\n\
         [[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n\
         [[cluster]]\nname = \"plain\"\nendpoints = [\"{plain}\"]\n\
         [[route]]\npath_prefix = \"/plain/\"\ncluster = \"plain\"\n\
         [[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n\
         response_timeout = \"1s\"\ntotal_timeout = \"2s\"\n"
    ));
    let gw_addr = gw.addr;

    const LANES: u64 = 24;
    let mut lanes = Vec::new();
    for lane in 0..LANES {
        lanes.push(tokio::spawn(async move {
            let mut failures = Vec::new();
            let (mut ok, mut failed) = (0usize, 0usize);
            for token in (lane..cases).step_by(LANES as usize) {
                // Tokens start at 1000 so none is a prefix of another's digits by chance.
                let token = 1000 + token;
                let got = tokio::time::timeout(Duration::from_secs(10), fetch(gw_addr, token)).await;
                match got {
                    Err(_) => failures.push(format!("token {token}: no answer within 10 s")),
                    Ok(Got::Failed) => failed += 1,
                    Ok(Got::Answer(status, body)) => {
                        ok += 1;
                        // Any mark but this request's own and the copy appended to its
                        // response (which may rightly be its answer or part of its body:
                        // after a truncated interim 100, or with a body until close).
                        let foreign: Vec<u64> = marks(&body)
                            .into_iter()
                            .filter(|&t| t != token && t != injected(token))
                            .collect();
                        if !foreign.is_empty() {
                            failures.push(format!(
                                "token {token}: got {status} carrying bytes written for {foreign:?} (over 1000000: a copy appended to that token's answer): {:?}\n  the upstream wrote for it: {:?}",
                                String::from_utf8_lossy(&body),
                                String::from_utf8_lossy(&written(seed, token).0)
                            ));
                        }
                    }
                }
            }
            (failures, ok, failed)
        }));
    }
    let (mut failures, mut ok, mut failed) = (Vec::new(), 0, 0);
    for l in lanes {
        let (f, o, x) = l.await.unwrap();
        failures.extend(f);
        ok += o;
        failed += x;
    }
    eprintln!(
        "seed {seed:#x}: {cases} requests, {ok} answered, {failed} failed cleanly, upstream answered {}",
        answered.load(Ordering::SeqCst)
    );
    assert!(
        failures.is_empty(),
        "seed {seed:#x}: {} failures:\n{}",
        failures.len(),
        failures[..failures.len().min(10)].join("\n")
    );
    // Both sides of the client's framing must have been reached.
    assert!(ok > cases as usize / 4, "too few answered: {ok}");
    assert!(failed + ok == cases as usize);

    let after = get(gw_addr, "/plain/after").await;
    assert_eq!(
        (after.status().as_u16(), &after.body()[..]),
        (200, &b"fine"[..])
    );
    assert_eq!(panics.load(Ordering::SeqCst), 0, "a task panicked");
}
