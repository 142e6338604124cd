//! `metrics-scrape` (seed 001: rendering 100k Prometheus series on a request worker stalled
//! requests for up to 934 ms). tailgate is given 100k+ series (per-consumer series for 5000
//! consumers), then measured at a constant rate twice per round: with nobody scraping, and
//! with a scraper pulling the whole `/metrics` every second. The goal: max and p99.9 with
//! the scraper ≤ 1.2 × without. The time one scrape takes to read is reported too.
//!
//! The scraper runs in this process (on the generator's core); tailgate (workers and its
//! admin thread) and the upstream share core 0, so a scrape competes with requests for the
//! same CPU — the situation the seed describes.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::procs::{free_port, io_err};
use super::{
    Options, Outcome, ScenarioError, Target, check, combine, measure_with, median, new_env, peers,
    rotation,
};

/// Consumers seeded before measuring: 21 series each (a request counter, a bytes counter
/// and a 17-bucket histogram), so 5000 give 105k series.
const CONSUMERS: usize = 5000;
const CONSUMER_HEADER: &str = "x-consumer";
const SCRAPE_EVERY: Duration = Duration::from_secs(1);
/// The scraper's read buffer: room for the exposition of 105k series (8.8 MiB) and more.
const BODY_BYTES: usize = 16 << 20;

pub fn run(opts: &Options, tailgate_exe: &std::path::Path) -> Result<Outcome, ScenarioError> {
    let mut notes = Vec::new();
    let mut env = new_env(opts, tailgate_exe, &mut notes)?;
    let up = peers::upstream(&mut env, "upstream", 110, None)?;
    let admin = SocketAddr::from(([127, 0, 0, 1], free_port()?));
    let extra = format!(
        "[admin]\naddress = \"{admin}\"\n[metrics]\nconsumer_header = \"{CONSUMER_HEADER}\"\nmax_consumers = {}\n",
        CONSUMERS * 2
    );
    let addr = peers::tailgate_with(&mut env, "tailgate", up, &extra)?;
    seed_consumers(addr, CONSUMERS).map_err(io_err("seed consumers"))?;
    let first = scrape(admin).map_err(io_err("scrape /metrics"))?;
    notes.push(format!(
        "/metrics holds {} series ({:.1} MiB of text); one scrape read in {:.1} ms before the load",
        first.samples,
        first.bytes as f64 / (1024.0 * 1024.0),
        first.took.as_secs_f64() * 1000.0
    ));

    let variant = format!("open-{}rps-{}c", opts.rate, opts.connections);
    let targets = [
        Target {
            name: "tailgate".into(),
            variant_suffix: "+no-scraper",
            addr,
            upstream: Some(up),
        },
        Target {
            name: "tailgate".into(),
            variant_suffix: "+scraper-every-1s",
            addr,
            upstream: Some(up),
        },
    ];
    let rounds = opts.rounds.max(1);
    let mut per_target: Vec<Vec<super::Measured>> = vec![Vec::new(), Vec::new()];
    let mut scrapes: Vec<Scrape> = Vec::new();
    for round in 0..rounds {
        eprintln!("  round {}/{rounds} of {variant}", round + 1);
        for i in rotation(targets.len(), round) {
            let scraper = (i == 1).then(|| Scraper::start(admin));
            // The measured requests name a consumer too: the per-consumer path is timed.
            let m = measure_with(
                &targets[i],
                &variant,
                opts.connections,
                Some(opts.rate),
                opts,
                vec![(
                    http::HeaderName::from_static(CONSUMER_HEADER),
                    http::HeaderValue::from_static("consumer-00042"),
                )],
            );
            if let Some(s) = scraper {
                scrapes.extend(s.stop());
            }
            per_target[i].push(m?);
        }
    }
    let measured: Vec<super::Measured> = per_target.into_iter().filter_map(combine).collect();
    let times: Vec<f64> = scrapes
        .iter()
        .map(|s| s.took.as_secs_f64() * 1000.0)
        .collect();
    let worst = times.iter().copied().fold(0.0, f64::max);
    notes.push(format!(
        "{} scrapes during the measurements: median {:.1} ms, slowest {:.1} ms to read all {} series",
        scrapes.len(),
        median(&times),
        worst,
        scrapes.last().map_or(0, |s| s.samples)
    ));
    let mut outcome = Outcome {
        scenario: "metrics-scrape".into(),
        measured,
        checks: Vec::new(),
        notes,
        rounds: opts.rounds,
    };
    let with = outcome
        .row("tailgate", &format!("{variant}+scraper-every-1s"))
        .cloned();
    let without = outcome
        .row("tailgate", &format!("{variant}+no-scraper"))
        .cloned();
    outcome.checks = vec![
        check(
            "max with scraper ÷ without ≤".into(),
            with.as_ref().map(|r| r.latency_ms.max),
            without.as_ref().map(|r| r.latency_ms.max),
            1.2,
            true,
        )
        .sides(with.as_ref(), without.as_ref()),
        check(
            "p99.9 with scraper ÷ without ≤".into(),
            with.as_ref().map(|r| r.latency_ms.p99_9),
            without.as_ref().map(|r| r.latency_ms.p99_9),
            1.2,
            true,
        )
        .sides(with.as_ref(), without.as_ref()),
        check(
            "p99 with scraper ÷ without ≤".into(),
            with.as_ref().map(|r| r.latency_ms.p99),
            without.as_ref().map(|r| r.latency_ms.p99),
            1.2,
            true,
        )
        .by_round(with.as_ref(), without.as_ref()),
    ];
    Ok(outcome)
}

/// One request per consumer on a keep-alive connection, each with its own consumer header.
fn seed_consumers(addr: SocketAddr, n: usize) -> std::io::Result<()> {
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut buf = Vec::with_capacity(4096);
    for i in 0..n {
        write!(
            s,
            "GET / HTTP/1.1\r\nHost: bench\r\n{CONSUMER_HEADER}: consumer-{i:05}\r\n\r\n"
        )?;
        read_response(&mut s, &mut buf)?;
    }
    Ok(())
}

/// Reads one response with a `Content-Length` body.
fn read_response(s: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<()> {
    buf.clear();
    let mut chunk = [0u8; 4096];
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string());
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            if !head.starts_with("http/1.1 200") {
                return Err(bad(&format!(
                    "seeding got: {}",
                    head.lines().next().unwrap_or("")
                )));
            }
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .ok_or_else(|| bad("no content-length"))?;
            if buf.len() >= end + 4 + len {
                return Ok(());
            }
        }
        let n = s.read(&mut chunk)?;
        if n == 0 {
            return Err(bad("connection closed mid-response"));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// One whole `/metrics` read.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scrape {
    took: Duration,
    bytes: usize,
    samples: usize,
}

pub(crate) fn scrape(admin: SocketAddr) -> std::io::Result<Scrape> {
    scrape_into(admin, &mut Vec::new())
}

/// [`scrape`] into `body`, which keeps its memory from one scrape to the next.
fn scrape_into(admin: SocketAddr, body: &mut Vec<u8>) -> std::io::Result<Scrape> {
    let t = Instant::now();
    let mut s = TcpStream::connect(admin)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    // HTTP/1.0: the body ends at close, with no chunk framing to strip.
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: admin\r\n\r\n")?;
    body.clear();
    s.read_to_end(body)?;
    let took = t.elapsed();
    if !body.starts_with(b"HTTP/1.0 200") && !body.starts_with(b"HTTP/1.1 200") {
        return Err(std::io::Error::other("/metrics did not answer 200"));
    }
    Ok(Scrape {
        took,
        bytes: body.len(),
        samples: count_samples(body),
    })
}

/// Sample lines of an exposition (after the response head): not empty, not a `#` comment,
/// with a value after a space.
fn count_samples(response: &[u8]) -> usize {
    response
        .split(|&b| b == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l))
        .skip_while(|l| !l.is_empty())
        .filter(|l| !l.is_empty() && !l.starts_with(b"#") && l.contains(&b' '))
        .count()
}

/// `SCHED_IDLE` for this thread, else nice 19: on the generator's core, the generator
/// runs whenever it has anything to do.
fn idle_priority() {
    use thread_priority::unix::{
        NormalThreadSchedulePolicy, ThreadSchedulePolicy, set_thread_priority_and_policy,
        thread_native_id, thread_schedule_policy,
    };
    const IDLE: ThreadSchedulePolicy =
        ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Idle);
    let _ = set_thread_priority_and_policy(
        thread_native_id(),
        thread_priority::ThreadPriority::Min,
        IDLE,
    );
    if thread_schedule_policy().is_ok_and(|p| p == IDLE) {
        return;
    }
    let _ = rustix::process::setpriority_process(Some(rustix::thread::gettid()), 19);
}

/// Scrapes `/metrics` every second on its own thread until stopped.
pub(crate) struct Scraper {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Vec<Scrape>>,
}

impl Scraper {
    pub(crate) fn start(admin: SocketAddr) -> Scraper {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            // The scraper shares the generator's core: under `SCHED_IDLE` it cannot delay
            // the generator's sends (which would be blamed on the gateway); at nice 19 it
            // still could, by a few milliseconds a scrape. Its buffer is made and touched
            // once, not taken fresh (16 MiB of page faults) every second.
            idle_priority();
            // Not zeros: written, so its pages are faulted in here, not mid-measurement.
            let mut body = vec![1u8; BODY_BYTES];
            let mut done = Vec::new();
            let mut next = Instant::now();
            while !flag.load(Ordering::Relaxed) {
                if Instant::now() >= next {
                    next += SCRAPE_EVERY;
                    match scrape_into(admin, &mut body) {
                        Ok(s) => done.push(s),
                        Err(e) => eprintln!("  scrape failed: {e}"),
                    }
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            done
        });
        Scraper { stop, thread }
    }

    pub(crate) fn stop(self) -> Vec<Scrape> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_counted_after_the_head_without_comments() {
        let r = b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n\
# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"1\"} 3\na_total{x=\"2\"} 4\n\nb 1\n";
        assert_eq!(count_samples(r), 3);
        assert_eq!(count_samples(b"HTTP/1.0 200 OK\r\nX: y z\r\n\r\n"), 0);
    }

    /// The scraper thread runs under `SCHED_IDLE` where the kernel allows it (here it does:
    /// the policy needs no privilege), so it never delays the generator on their shared core.
    #[test]
    fn the_scraper_thread_is_idle_priority() {
        let policy = std::thread::spawn(|| {
            idle_priority();
            thread_priority::unix::thread_schedule_policy()
        })
        .join()
        .expect("thread");
        assert_eq!(
            policy.ok(),
            Some(thread_priority::unix::ThreadSchedulePolicy::Normal(
                thread_priority::unix::NormalThreadSchedulePolicy::Idle
            ))
        );
    }
}
