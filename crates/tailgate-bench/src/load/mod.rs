//! The load generator.
//!
//! - Open loop (wrk2 semantics): request `j` of the run is intended to start at
//!   `start + j/R`, on connection `j mod C` (so connection `k` sends at `start + k/R + i·C/R`
//!   and all connections together arrive at a constant rate `R`). Every request's latency is
//!   measured from its intended start (the "corrected" histogram), whatever delayed it: a
//!   request that waits behind a stalled one on its connection is charged for the wait, so a
//!   stall is not hidden (coordinated omission), and so is any lateness of the generator.
//!   The "uncorrected" histogram measures from the moment the attempt actually started,
//!   which is what a closed-loop tool reports.
//!   Because the generator's lateness is charged, sends are scheduled precisely: each
//!   generator thread wakes its connections at their intended starts on a `timerfd`, with
//!   ~0.1 ms precision and without spinning (see [`schedule`] for why not tokio timers, whose
//!   1 ms granularity added ~1 ms to every request, and not spinning, which costs a whole core
//!   at 5000 requests/s).
//!   Generator lag — how long after a request could have started (its intended start, or
//!   the end of the previous exchange on its connection if that was later) it actually
//!   started — is recorded and printed separately, so an overloaded generator is visible;
//!   it is part of the corrected latency, not subtracted from it.
//! - Closed loop: each connection sends its next request as soon as the previous one is done
//!   (maximum throughput); both histograms are then the same.
//!
//! Each generator thread runs one current-thread tokio runtime with its share of the
//! connections; they record into one per-thread [`Recorder`] (no locks, no atomics on the
//! request path, except one shared counter in request-count mode and one bell per open-loop
//! request).
//!
//! A request's latency includes connecting when its connection had to be (re)opened, so the
//! cost of a server closing connections shows up at request index 1.

mod h1;
mod h2;
pub mod schedule;
pub mod stream;
pub mod target;

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use http::Method;
use rustls::ClientConfig;

use crate::stats::{ErrorKind, Recorder};
use schedule::{Bells, Schedule};
use stream::Stream;
use target::{Group, Prepared, RequestTemplate, Url};

/// Latency by request index is kept for the first this many requests on a connection (a
/// generator thread's share of it, 26 KiB a histogram, is allocated and touched before the
/// run starts): past where a server that closes connections every N requests shows its
/// pattern twice, for the N of 80 the scenarios use (they ask for more when given a larger
/// N: [`index_cap`]).
pub const MAX_INDEX: usize = 256;

/// The lowest open-loop rate (requests per second) taken: one far lower made each
/// connection's interval a time past what the clock holds (a panic).
pub const MIN_RATE: f64 = 0.001;

/// The by-index record for a server closing every `close_every` requests: two of its
/// cycles, at least [`MAX_INDEX`], at most 2048 (53 MiB per generator thread).
pub fn index_cap(close_every: u64) -> usize {
    let two = usize::try_from(close_every.saturating_mul(2)).unwrap_or(usize::MAX);
    two.clamp(MAX_INDEX, 2048)
}

/// How many seconds of per-second record [`Recorder::ready`] makes before a run: every
/// second a measured request can be intended to start in, up to ten minutes (a longer run
/// makes the rest as it reaches them). A closed loop stopping after a count has no known
/// length: none, all made as reached.
fn seconds_of(stop: Stop, rate: Option<f64>) -> usize {
    const MOST: usize = 600;
    let secs = match (stop, rate) {
        (Stop::Duration(d), _) => d.as_secs_f64(),
        (Stop::Count(n), Some(r)) if r > 0.0 => n as f64 / r,
        (Stop::Count(_), _) => return 0,
    };
    // `as` saturates: a huge or non-finite length is capped below.
    (secs.ceil() as usize).saturating_add(1).min(MOST)
}

/// Why a run could not start.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("bad URL {0}")]
    Url(String),
    #[error("{0}")]
    Invalid(String),
    #[error("cannot start a generator thread: {0}")]
    Thread(std::io::Error),
}

/// When a run ends.
#[derive(Clone, Copy, Debug)]
pub enum Stop {
    /// Measure for this long (after the warm-up).
    Duration(Duration),
    /// Send exactly this many measured requests (after the warm-up).
    Count(u64),
}

/// A complete description of one run.
#[derive(Clone, Debug)]
pub struct Spec {
    pub urls: Vec<Url>,
    pub request: RequestTemplate,
    pub connections: usize,
    pub threads: usize,
    /// Requests per second for the open loop; `None` is the closed loop.
    pub rate: Option<f64>,
    pub stop: Stop,
    /// Requests intended to start during the warm-up are sent but not recorded.
    pub warmup: Duration,
    pub h2: bool,
    pub insecure: bool,
    pub connect_timeout: Duration,
    /// The whole exchange (connect, write, full response) must finish within this.
    pub timeout: Duration,
    /// Latency by request index is kept for indices `1..=max_index`.
    pub max_index: usize,
}

impl Spec {
    /// A closed-loop GET run with defaults suitable for scenarios.
    pub fn get(urls: Vec<Url>, connections: usize, rate: Option<f64>, stop: Stop) -> Spec {
        Spec {
            urls,
            request: RequestTemplate {
                method: Method::GET,
                headers: Vec::new(),
                body: bytes::Bytes::new(),
            },
            connections,
            threads: 1,
            rate,
            stop,
            warmup: Duration::from_secs(1),
            h2: false,
            insecure: false,
            connect_timeout: Duration::from_secs(1),
            timeout: Duration::from_secs(2),
            max_index: MAX_INDEX,
        }
    }

    /// Checks the numbers make sense (bad ones are usage errors): a rate of at least
    /// [`MIN_RATE`] among them.
    pub fn validate(&self) -> Result<(), LoadError> {
        let bad = |m: &str| Err(LoadError::Invalid(m.to_string()));
        if self.urls.is_empty() {
            return bad("at least one URL is needed");
        }
        if self.connections == 0 {
            return bad("--connections must be at least 1");
        }
        if self.threads == 0 || self.threads > self.connections {
            return bad("--threads must be between 1 and the number of connections");
        }
        if let Some(r) = self.rate
            && !(r.is_finite() && r >= MIN_RATE)
        {
            return Err(LoadError::Invalid(format!(
                "--rate must be a number of requests per second, at least {MIN_RATE}"
            )));
        }
        match self.stop {
            Stop::Duration(d) if d.is_zero() => return bad("--duration must be more than 0"),
            Stop::Count(0) => return bad("--requests must be at least 1"),
            _ => {}
        }
        if self.timeout.is_zero() || self.connect_timeout.is_zero() {
            return bad("timeouts must be more than 0");
        }
        Ok(())
    }
}

/// The outcome of a run.
#[derive(Debug)]
pub struct Report {
    pub recorder: Recorder,
    /// The measured period: the duration, or (request-count mode) from the end of the
    /// warm-up to the last completion.
    pub measured: Duration,
    /// Measured requests attempted (responses + errors other than status).
    pub sent: u64,
    pub connections: usize,
    pub threads: usize,
    pub rate: Option<f64>,
    /// The first TLS handshake failure of the run, e.g. why the certificate was rejected
    /// (the failures themselves are counted as [`ErrorKind::Tls`]).
    pub tls_error: Option<String>,
}

impl Report {
    /// Successful (2xx/3xx) responses per second of the measured period.
    pub fn rps(&self) -> f64 {
        let s = self.measured.as_secs_f64();
        if s > 0.0 {
            self.recorder.ok as f64 / s
        } else {
            0.0
        }
    }
}

struct Shared {
    groups: Vec<Group>,
    tls: Option<Arc<ClientConfig>>,
    spec: Spec,
    start: Instant,
    /// Open loop: the intended starts, and one bell per connection rung at them.
    schedule: Option<(Schedule, Bells)>,
    measure_start: Instant,
    end: Option<Instant>,
    tickets: AtomicU64,
    sent: AtomicU64,
    /// The first TLS handshake failure's message (set once, only on failures).
    tls_error: OnceLock<String>,
}

/// Runs the load described by `spec` on `spec.threads` new threads and waits for the end.
/// Blocking; call from a plain thread (not inside a runtime).
pub fn run(spec: Spec) -> Result<Report, LoadError> {
    spec.validate()?;
    let groups = target::group(&spec.urls, &spec.request)?;
    let tls = groups
        .iter()
        .any(|g| g.tls)
        .then(|| stream::tls_config(spec.h2, spec.insecure));
    // Every thread's recorder is made (and its memory touched) before the clock starts.
    let seconds = seconds_of(spec.stop, spec.rate);
    let recorders: Vec<Recorder> = (0..spec.threads)
        .map(|_| Recorder::ready(spec.max_index, seconds))
        .collect();
    // A little slack so every thread is up before the first intended start.
    let start = Instant::now() + Duration::from_millis(20);
    let measure_start = start + spec.warmup;
    let (end, tickets) = match spec.stop {
        Stop::Duration(d) => (Some(measure_start + d), 0),
        Stop::Count(n) => (None, n),
    };
    let schedule = spec
        .rate
        .map(|rate| (Schedule { start, rate }, schedule::bells(spec.connections)));
    let shared = Arc::new(Shared {
        groups,
        tls,
        start,
        schedule,
        measure_start,
        end,
        tickets: AtomicU64::new(tickets),
        sent: AtomicU64::new(0),
        tls_error: OnceLock::new(),
        spec: spec.clone(),
    });
    let mut handles = Vec::with_capacity(spec.threads);
    for (t, recorder) in recorders.into_iter().enumerate() {
        let shared = shared.clone();
        let h = std::thread::Builder::new()
            .name(format!("bench-gen-{t}"))
            .spawn(move || thread_main(t, shared, recorder))
            .map_err(LoadError::Thread)?;
        handles.push(h);
    }
    let mut recorder = Recorder::new(spec.max_index);
    let mut last_done = measure_start;
    for h in handles {
        let (r, done) = h
            .join()
            .map_err(|_| LoadError::Invalid("a generator thread panicked".into()))?;
        recorder.merge(&r);
        last_done = last_done.max(done);
    }
    recorder.trim();
    let measured = match spec.stop {
        Stop::Duration(d) => d,
        Stop::Count(_) => last_done.saturating_duration_since(measure_start),
    };
    Ok(Report {
        recorder,
        measured,
        sent: shared.sent.load(Ordering::Relaxed),
        connections: spec.connections,
        threads: spec.threads,
        rate: spec.rate,
        tls_error: shared.tls_error.get().cloned(),
    })
}

fn thread_main(t: usize, shared: Arc<Shared>, recorder: Recorder) -> (Recorder, Instant) {
    let recorder = Rc::new(RefCell::new(recorder));
    let last_done = Rc::new(RefCell::new(shared.measure_start));
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tailgate bench: cannot build a runtime: {e}");
            return (Recorder::new(0), shared.measure_start);
        }
    };
    // All of the thread's connections are one future (join_all polls only the woken ones):
    // no task spawn or LocalSet queue per wake-up.
    let mine: Vec<usize> = (t..shared.spec.connections)
        .step_by(shared.spec.threads)
        .collect();
    let conns: Vec<_> = mine
        .iter()
        .map(|&k| connection(k, shared.clone(), recorder.clone(), last_done.clone()))
        .collect();
    rt.block_on(async {
        let conns = futures_util::future::join_all(conns);
        match &shared.schedule {
            // Open loop: this thread's connections are woken at their intended starts by a
            // precise timer on this thread; the run ends when the connections do.
            Some((s, bells)) => {
                let ring = async {
                    schedule::ring(*s, bells, &mine, shared.end).await;
                    std::future::pending::<()>().await
                };
                tokio::select! {
                    _ = conns => {}
                    _ = ring => {}
                }
            }
            None => {
                conns.await;
            }
        }
    });
    drop(rt);
    let last = *last_done.borrow();
    let r = Rc::try_unwrap(recorder)
        .map(RefCell::into_inner)
        .unwrap_or_else(|rc| std::mem::replace(&mut rc.borrow_mut(), Recorder::new(0)));
    (r, last)
}

enum Client {
    H1(h1::Conn<Stream>),
    H2(h2::Conn),
}

async fn open(shared: &Shared, group: &Group) -> Result<Client, ErrorKind> {
    let tls = if group.tls {
        shared.tls.as_ref().map(|c| (c, group.server_name.as_str()))
    } else {
        None
    };
    let io = stream::connect(group.addr, tls, shared.spec.connect_timeout)
        .await
        .map_err(|e| match e {
            stream::ConnectError::Tcp(_) => ErrorKind::Connect,
            stream::ConnectError::Tls(e) => {
                let _ = shared.tls_error.set(e.to_string());
                ErrorKind::Tls
            }
        })?;
    if shared.spec.h2 {
        let c = tokio::time::timeout(shared.spec.connect_timeout, h2::Conn::handshake(io))
            .await
            .map_err(|_| ErrorKind::Connect)??;
        Ok(Client::H2(c))
    } else {
        Ok(Client::H1(h1::Conn::new(io)))
    }
}

async fn exchange(client: &mut Client, req: &Prepared) -> Result<(u16, bool), ErrorKind> {
    match client {
        Client::H1(c) => {
            let r = c.exchange(&req.h1, req.method == Method::HEAD).await?;
            Ok((r.status, !r.close))
        }
        Client::H2(c) => c.exchange(req).await,
    }
}

/// One generator connection: schedules, sends, reconnects, records.
async fn connection(
    k: usize,
    shared: Arc<Shared>,
    recorder: Rc<RefCell<Recorder>>,
    last_done: Rc<RefCell<Instant>>,
) {
    let spec = &shared.spec;
    let group = &shared.groups[k % shared.groups.len()];
    let mut rr = (k / shared.groups.len()) % group.requests.len();
    // Open loop: this connection sends requests `k, k+C, k+2C, ...` of the run's schedule.
    let mut j = k as u64;
    let stride = spec.connections as u64;
    // In-flight work may finish up to one timeout after the end, never later.
    let hard_end = shared.end.map(|e| e + spec.timeout);
    let count_mode = matches!(spec.stop, Stop::Count(_));
    let mut client: Option<Client> = None;
    let mut index = 0u64;
    // When this connection's previous attempt ended: a request cannot start before that.
    let mut prev_done = shared.start;
    if spec.rate.is_none() {
        tokio::time::sleep_until(shared.start.into()).await;
    }
    loop {
        let intended = match &shared.schedule {
            Some((s, _)) => s.at(j),
            None => Instant::now(),
        };
        if shared.end.is_some_and(|end| intended >= end) {
            break;
        }
        if hard_end.is_some_and(|h| Instant::now() >= h) {
            // Open loop, out of time with requests still due before the end (this
            // connection stuck behind a target that stopped answering): each is counted as
            // sent and timed out, not left out, so a target that falls behind does not lose
            // its worst samples.
            if let (Some((s, _)), Some(end)) = (&shared.schedule, shared.end) {
                let mut rec = recorder.borrow_mut();
                let (mut at, mut i) = (intended, j);
                while at < end {
                    if at >= shared.measure_start {
                        shared.sent.fetch_add(1, Ordering::Relaxed);
                        rec.error(ErrorKind::Timeout);
                    }
                    i += stride;
                    at = s.at(i);
                }
            }
            break;
        }
        let measured = intended >= shared.measure_start;
        if measured && count_mode && !claim(&shared.tickets) {
            break;
        }
        if let Some((_, bells)) = &shared.schedule {
            schedule::wait_until(&bells[k], intended).await;
            j += stride;
        }
        if measured {
            shared.sent.fetch_add(1, Ordering::Relaxed);
        }
        let began = Instant::now();
        let result = tokio::time::timeout(spec.timeout, async {
            if client.is_none() {
                client = Some(open(&shared, group).await?);
                index = 0;
            }
            index += 1;
            match client.as_mut() {
                Some(c) => exchange(c, &group.requests[rr]).await,
                None => Err(ErrorKind::Connect),
            }
        })
        .await
        .unwrap_or(Err(ErrorKind::Timeout));
        let done = Instant::now();
        // wrk2 semantics: every open-loop request is charged from its intended start, whether
        // it waited behind the previous request on its connection (coordinated omission) or
        // on the generator. Lag is the generator's share: from when the request could have
        // started to when it did. The latency without it is kept beside, since on a busy
        // machine the generator's lag can be as large as the target's own tail.
        let open_loop = shared.schedule.is_some();
        let from = if open_loop { intended } else { began };
        let lag = began.saturating_duration_since(intended.max(prev_done));
        // The corrected latency less `lag`: the time on the wire plus the wait behind the
        // previous exchange on this connection.
        let excl_lag = if open_loop {
            (done - began) + prev_done.saturating_duration_since(intended)
        } else {
            done - began
        };
        prev_done = done;
        rr = (rr + 1) % group.requests.len();
        if measured && open_loop {
            recorder.borrow_mut().lag(lag);
        }
        match result {
            Ok((status, keep)) => {
                if !keep {
                    client = None;
                }
                if measured {
                    let second = (intended - shared.measure_start).as_secs() as usize;
                    let mut rec = recorder.borrow_mut();
                    rec.response(
                        (200..400).contains(&status),
                        done - from,
                        done - began,
                        excl_lag,
                        index,
                        second,
                    );
                }
            }
            Err(kind) => {
                client = None;
                if measured {
                    recorder.borrow_mut().error(kind);
                }
                if matches!(kind, ErrorKind::Connect | ErrorKind::Tls) && !open_loop {
                    // Closed loop against a dead target: don't spin.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
        if measured {
            let mut l = last_done.borrow_mut();
            if done > *l {
                *l = done;
            }
        }
    }
}

fn claim(tickets: &AtomicU64) -> bool {
    tickets
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every second a measured request can be intended in is made before the run, and one
    /// more: a 4 s run's requests fall in seconds 0 to 3, so 5 are made; a count at a rate
    /// lasts count ÷ rate seconds.
    #[test]
    fn the_seconds_made_before_a_run_cover_it() {
        let secs = |d: f64| seconds_of(Stop::Duration(Duration::from_secs_f64(d)), None);
        assert_eq!(secs(4.0), 5);
        assert_eq!(secs(2.5), 4);
        assert_eq!(secs(0.2), 2);
        assert_eq!(seconds_of(Stop::Count(10_000), Some(5000.0)), 3);
        assert_eq!(seconds_of(Stop::Count(10_001), Some(5000.0)), 4);
        assert_eq!(
            seconds_of(Stop::Count(10_000), None),
            0,
            "closed loop: unknown"
        );
        assert_eq!(
            seconds_of(Stop::Duration(Duration::from_secs(86_400)), None),
            600
        );
        assert_eq!(seconds_of(Stop::Count(u64::MAX), Some(1e-9)), 600);
    }

    #[test]
    fn the_index_record_covers_two_cycles_of_the_close() {
        assert_eq!(index_cap(80), MAX_INDEX);
        assert_eq!(index_cap(500), 1000);
        assert_eq!(index_cap(u64::MAX), 2048);
    }
}
