//! Reproducible scenarios: each sets up everything on loopback by itself, measures tailgate
//! side by side with a direct connection and with nginx and HAProxy (when installed), and
//! reports ratios — never absolute times alone, since the machines are shared and noisy.
//!
//! Every (target, variant) is measured `rounds` times, interleaved: each round runs the targets
//! of a variant back to back, in an order rotated by one every two rounds and reversed in odd ones, with every process kept
//! running between rounds. Rows report the median across rounds of each statistic (errors are
//! summed), plus the p99 spread — one run on a noisy VM is not a measurement.
//!
//! Pinning (2 cores): proxies and upstreams run on core 0 (`taskset -c 0`), the generator on
//! core 1 (this process pins itself before starting any thread).

pub mod churn;
pub mod overhead;
pub mod peers;
pub mod procs;
pub mod report;
pub mod scrape;

use std::fmt::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;
use serde_json::{Value, json};

use crate::load::{self, Report, Spec, Stop, target::Url};
use crate::output::svg;
use crate::output::text::fmt_ms;
use crate::stats::{LatencySummary, ms_at};
use procs::{Env, SetupError};

/// Knobs shared by the scenarios.
#[derive(Clone, Debug)]
pub struct Options {
    /// Measured time per run.
    pub duration: Duration,
    /// Warm-up per run, excluded from results.
    pub warmup: Duration,
    /// The fixed open-loop rate.
    pub rate: f64,
    pub connections: usize,
    /// Connections for the many-connections variant.
    pub many_connections: usize,
    /// `keepalive-churn`: the upstream closes every N requests.
    pub close_every: u64,
    /// Pin children to core 0 (the generator pins itself separately).
    pub pin: bool,
    /// Interleaved measurements per (target, variant); rows report the medians.
    pub rounds: usize,
    /// The build measured as `tailgate`; `None`: the running binary. The running binary is
    /// always the load generator and the upstream, so those stay the same whichever build
    /// is measured.
    pub tailgate: Option<PathBuf>,
    /// Other tailgate builds measured beside it, as (target name, binary): e.g. a plain
    /// `cargo build --release` beside the profile-guided release build.
    pub compare: Vec<(String, PathBuf)>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            duration: Duration::from_secs(3),
            warmup: Duration::from_secs(1),
            rate: 5000.0,
            connections: 50,
            many_connections: 500,
            close_every: 80,
            pin: true,
            rounds: 5,
            tailgate: None,
            compare: Vec::new(),
        }
    }
}

/// The scenario names, as typed on the command line.
pub const NAMES: [&str; 3] = ["overhead", "keepalive-churn", "metrics-scrape"];

/// The scenarios that measure `--compare`'s builds beside their own targets; the others
/// (`metrics-scrape`: one build with and without a scraper) leave them out.
pub const COMPARING: [&str; 2] = ["overhead", "keepalive-churn"];

/// Why a scenario failed as a whole.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    #[error(transparent)]
    Setup(#[from] SetupError),
    #[error(transparent)]
    Load(#[from] load::LoadError),
    #[error("unknown scenario {0:?} (known: overhead, keepalive-churn, metrics-scrape)")]
    Unknown(String),
}

/// One measured (target, variant).
pub struct Measured {
    pub row: Row,
    pub report: Report,
}

/// One line of the `results` array.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct Row {
    pub target: String,
    pub variant: String,
    pub rps: f64,
    pub errors: u64,
    pub latency_ms: LatencySummary,
    /// Lowest and highest p99 across the rounds (the row's `p99` is their median).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p99_range_ms: Option<[f64; 2]>,
    /// Each round's p99, in round order: round `i` of every target of a variant was measured
    /// in the same pass, so two targets' p99s can be compared round by round.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p99_rounds_ms: Option<Vec<f64>>,
    /// Each round's errors, in round order (beside `p99_rounds_ms`): a round with any, on
    /// either side of a goal, does not count as meeting it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub errors_rounds: Option<Vec<u64>>,
    /// Open loop: the p99 without the generator's own lag (still corrected for coordinated
    /// omission); the median across rounds. How much of `p99` is the generator's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p99_excl_lag_ms: Option<f64>,
    /// CPU time (user and system) the target's processes used per request, in µs; the median
    /// across rounds. `None` for the upstream measured directly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_us_per_request: Option<f64>,
    /// The same for the upstream behind the target, in the same runs: a yardstick for how
    /// fast the machine was. The target's CPU ÷ this compares proxies measured minutes apart
    /// on a machine whose speed drifts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_cpu_us_per_request: Option<f64>,
    /// `cpu_us_per_request ÷ upstream_cpu_us_per_request` of each round; the median.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_per_upstream_cpu: Option<f64>,
}

/// The two-sided sign test's p-value of `k` rounds of `n` going one way, were each round
/// as likely to go either way: how often chance alone gives a count at least as far from
/// half.
fn sign_test_p(k: usize, n: usize) -> f64 {
    if n == 0 {
        return 1.0;
    }
    // P(X = i) for X ~ Binomial(n, 1/2), summed over the tail beyond k on its side.
    let pmf = |i: usize| -> f64 {
        let mut c = 1.0f64;
        for j in 0..i {
            c = c * (n - j) as f64 / (j + 1) as f64;
        }
        c * 0.5f64.powi(n as i32)
    };
    let tail: f64 = if 2 * k <= n {
        (0..=k).map(pmf).sum()
    } else {
        (k..=n).map(pmf).sum()
    };
    (2.0 * tail).min(1.0)
}

/// One line of the `targets` array: a goal and whether this run met it.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct Check {
    pub name: String,
    /// `None` (JSON null) when a side was not measured (e.g. nginx missing).
    pub value: Option<f64>,
    pub goal: f64,
    pub met: bool,
    /// For a p99 goal between targets measured in the same rounds: in how many rounds the
    /// two sides' own p99s met the goal, and of how many (ties, a round exactly at the goal,
    /// left out; see [`Check::by_round`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rounds_met: Option<[usize; 2]>,
    /// Requests that failed (or, open loop, were due and never sent) in the rows the goal
    /// compares, over all rounds: a goal with any is not met, whatever its value (a side
    /// that drops or fails requests loses its worst samples, so it looks faster).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub errors: Option<u64>,
    /// The goal is an upper bound (`≤`), not a lower one.
    #[serde(skip)]
    at_most: bool,
}

impl Check {
    /// Adds [`rounds_met`](Check::rounds_met) from the two rows' p99s round by round: the
    /// ratio of medians can be swung by one side's worst rounds, so how often each round's
    /// pair met the goal is shown beside it (the goal's verdict stays the medians').
    pub fn by_round(self, num: Option<&Row>, den: Option<&Row>) -> Check {
        let mut this = self.sides(num, den);
        let (Some(n), Some(d)) = (
            num.and_then(|r| r.p99_rounds_ms.as_ref()),
            den.and_then(|r| r.p99_rounds_ms.as_ref()),
        ) else {
            return this;
        };
        // Each round's ratio is judged exactly as the medians' is (`check`); a round
        // whose ratio is the goal itself (both p99s the same microsecond) goes neither
        // way, and is left out, as the sign test leaves out ties. A round in which either
        // side had errors (or answered nothing: a p99 of 0) counts, as not met: the
        // latencies of its failed requests are not in its p99, which would flatter it.
        let goal = this.goal;
        let failed = |r: Option<&Row>, i: usize| {
            r.and_then(|r| r.errors_rounds.as_ref())
                .is_some_and(|e| e.get(i).is_some_and(|&e| e > 0))
        };
        // Each round judged: met or not (ties left out).
        let judged: Vec<bool> = n
            .iter()
            .zip(d)
            .enumerate()
            .filter_map(|(i, (&n, &d))| {
                if failed(num, i) || failed(den, i) || n <= 0.0 || d <= 0.0 {
                    return Some(false);
                }
                goal_ratio(n, d)
                    .filter(|&r| r != goal)
                    .map(|r| this.holds(r))
            })
            .collect();
        if !judged.is_empty() {
            let met = judged.iter().filter(|&&met| met).count();
            this.rounds_met = Some([met, judged.len()]);
        }
        this
    }

    /// Takes the errors of the two rows the goal compares ([`errors`](Check::errors)): with
    /// any, the goal is not met.
    pub fn sides(mut self, num: Option<&Row>, den: Option<&Row>) -> Check {
        let errors: u64 = [num, den].iter().flatten().map(|r| r.errors).sum();
        if errors > 0 {
            self.errors = Some(errors);
            self.met = false;
        }
        self
    }

    /// The value as the goal table prints it: three decimals, or as many more as it takes
    /// for the printed figure to agree with the verdict, so a ratio of 1.0004 against a goal
    /// of at most 1 reads `1.0004 | **no**`, not `1.000 | **no**`.
    fn shown(&self, value: f64) -> String {
        let agrees = |text: &str| {
            text.parse()
                .is_ok_and(|p: f64| self.holds(p) == self.holds(value))
        };
        (3..=6)
            .map(|digits| format!("{value:.digits$}"))
            .find(|text| agrees(text))
            // The shortest text that reads back as the value itself.
            .unwrap_or_else(|| value.to_string())
    }

    /// Does a ratio meet this goal?
    fn holds(&self, ratio: f64) -> bool {
        if self.at_most {
            ratio <= self.goal
        } else {
            ratio >= self.goal
        }
    }
}

/// `num / den`, as goals are judged (unrounded: 1.0004 does not meet `≤ 1`); `None` without
/// a positive `den`.
fn goal_ratio(num: f64, den: f64) -> Option<f64> {
    (den > 0.0).then(|| num / den)
}

/// A finished scenario.
pub struct Outcome {
    pub scenario: String,
    pub measured: Vec<Measured>,
    pub checks: Vec<Check>,
    /// Setup notes (a peer skipped, running unpinned).
    pub notes: Vec<String>,
    /// Rounds each row is the median of.
    pub rounds: usize,
}

/// Runs scenario `name`.
pub fn run(name: &str, opts: &Options, tailgate_exe: &Path) -> Result<Outcome, ScenarioError> {
    match name {
        "overhead" => overhead::run(opts, tailgate_exe),
        "keepalive-churn" => churn::run(opts, tailgate_exe),
        "metrics-scrape" => scrape::run(opts, tailgate_exe),
        other => Err(ScenarioError::Unknown(other.to_string())),
    }
}

/// The names the scenarios give their own targets (`start_proxies`, `overhead`, `churn`);
/// a compared build may not take one.
pub const OWN_TARGETS: [&str; 5] = ["direct", "tailgate", "nginx", "haproxy", "nginx-fwd"];

/// A target to measure: who, and where it listens.
pub struct Target {
    pub name: String,
    pub variant_suffix: &'static str,
    pub addr: SocketAddr,
    /// The upstream a proxy forwards to (`None`: the target is the upstream itself). The CPU
    /// both use per request is measured from their processes.
    pub upstream: Option<SocketAddr>,
}

/// The environment plus the targets that came up; peers that could not start become notes.
pub fn new_env(
    opts: &Options,
    tailgate_exe: &Path,
    notes: &mut Vec<String>,
) -> Result<Env, SetupError> {
    let core = if opts.pin && crate::pin::taskset().is_some() {
        Some(0)
    } else {
        if opts.pin {
            notes.push("taskset not found: running unpinned".into());
        }
        None
    };
    let mut env = Env::new(tailgate_exe.to_path_buf(), core)?;
    if let Some(gateway) = &opts.tailgate {
        env.gateway_exe = gateway.clone();
    }
    Ok(env)
}

/// Starts tailgate, nginx and HAProxy in front of `upstream`, then the tailgate builds of
/// `compare`, adding whichever came up to `targets` (named `name`, with a variant suffix)
/// and a note for each that did not.
pub fn start_proxies(
    env: &mut Env,
    upstream: SocketAddr,
    suffix: &'static str,
    compare: &[(String, PathBuf)],
    targets: &mut Vec<Target>,
    notes: &mut Vec<String>,
) {
    type Starter = fn(&mut Env, &str, SocketAddr) -> Result<SocketAddr, SetupError>;
    let all: [(&'static str, Option<&str>, Starter); 3] = [
        ("tailgate", None, peers::tailgate),
        ("nginx", Some(peers::NGINX), peers::nginx),
        ("haproxy", Some(peers::HAPROXY), peers::haproxy),
    ];
    for (name, binary, start) in all {
        if let Some(b) = binary
            && !peers::installed(b)
        {
            notes.push(format!("{name}: {b} not installed, skipped"));
            continue;
        }
        match start(env, &format!("{name}{suffix}"), upstream) {
            Ok(addr) => targets.push(Target {
                name: name.to_string(),
                variant_suffix: suffix,
                addr,
                upstream: Some(upstream),
            }),
            Err(e) => notes.push(format!("{name}: not measured: {e}")),
        }
    }
    for (name, exe) in compare {
        // Its processes and files are named apart from the scenarios' own ("upstream", ...).
        let process = format!("compare-{name}{suffix}");
        match peers::tailgate_build(env, &process, exe, upstream, "") {
            Ok(addr) => targets.push(Target {
                name: name.clone(),
                variant_suffix: suffix,
                addr,
                upstream: Some(upstream),
            }),
            Err(e) => notes.push(format!("{name}: not measured: {e}")),
        }
    }
}

/// One run of the generator against `addr`.
pub fn measure(
    target: &Target,
    variant: &str,
    connections: usize,
    rate: Option<f64>,
    opts: &Options,
) -> Result<Measured, ScenarioError> {
    measure_with(target, variant, connections, rate, opts, Vec::new())
}

/// [`measure`] with extra request headers.
pub fn measure_with(
    target: &Target,
    variant: &str,
    connections: usize,
    rate: Option<f64>,
    opts: &Options,
    headers: Vec<(http::HeaderName, http::HeaderValue)>,
) -> Result<Measured, ScenarioError> {
    let url = Url::parse(&format!("http://{}/", target.addr))?;
    let mut spec = Spec::get(vec![url], connections, rate, Stop::Duration(opts.duration));
    spec.warmup = opts.warmup;
    spec.max_index = crate::load::index_cap(opts.close_every);
    spec.request.headers = headers;
    eprintln!(
        "  measuring {:<9} {:<32} ({} s + {} s warm-up)",
        target.name,
        format!("{variant}{}", target.variant_suffix),
        opts.duration.as_secs_f64(),
        opts.warmup.as_secs_f64()
    );
    // The CPU time the target's processes (and its upstream's) use over the run, warm-up
    // included: per request, it is what the throughput on a shared core is made of.
    let proxy_pid = target
        .upstream
        .and_then(|_| procs::pid_listening_on(target.addr));
    let upstream_pid = procs::pid_listening_on(target.upstream.unwrap_or(target.addr));
    let cpu = || {
        (
            proxy_pid.and_then(procs::cpu_ns),
            upstream_pid.and_then(procs::cpu_ns),
        )
    };
    let cpu_before = cpu();
    let report = load::run(spec)?;
    let cpu_after = cpu();
    // A target (or its upstream) that died mid-run: the rest of the scenario would measure
    // a dead port, every goal a "no" for its errors, with nothing said of why.
    if let Some(why) = [proxy_pid, upstream_pid]
        .into_iter()
        .flatten()
        .find_map(procs::exited)
    {
        return Err(SetupError::Exited(why).into());
    }
    let requests = report.rps() * (opts.duration + opts.warmup).as_secs_f64();
    let per_request = |used: Option<u64>| -> Option<f64> {
        let used = used?;
        (requests >= 1.0).then(|| round2(used as f64 / 1000.0 / requests))
    };
    let used = |before: Option<u64>, after: Option<u64>| after?.checked_sub(before?);
    let cpu_ns = used(cpu_before.0, cpu_after.0);
    let upstream_cpu_ns = used(cpu_before.1, cpu_after.1);
    let cpu_us_per_request = per_request(cpu_ns);
    let upstream_cpu_us_per_request = per_request(upstream_cpu_ns);
    // From the nanoseconds, not the rounded microseconds shown beside it.
    let cpu_per_upstream_cpu = cpu_ratio(cpu_ns, upstream_cpu_ns);
    let row = Row {
        target: target.name.clone(),
        variant: format!("{variant}{}", target.variant_suffix),
        rps: round2(report.rps()),
        errors: report.recorder.errors.total(),
        latency_ms: LatencySummary::of(&report.recorder.corrected),
        p99_range_ms: None,
        p99_rounds_ms: None,
        errors_rounds: None,
        p99_excl_lag_ms: rate.map(|_| ms_at(&report.recorder.excl_lag, 99.0)),
        cpu_us_per_request,
        upstream_cpu_us_per_request,
        cpu_per_upstream_cpu,
    };
    Ok(Measured { row, report })
}

/// Target order in round `round` (0-based) of `n` targets: rotated left by one every two
/// rounds, and reversed in odd rounds. Over `2n` rounds every target takes every position
/// twice, and follows each of its two neighbours in turn (a rotation alone would always
/// put it after the same one, whose after-effects it would always carry).
pub fn rotation(n: usize, round: usize) -> Vec<usize> {
    let shift = round / 2;
    let mut order: Vec<usize> = (0..n).map(|i| (i + shift) % n.max(1)).collect();
    if round % 2 == 1 {
        order.reverse();
    }
    order
}

/// The median of `xs` (mean of the middle two for an even count); 0 when empty.
pub fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// One row from the rounds of one (target, variant): the median of each statistic, errors
/// summed, the p99 range; the report (for charts) of the round whose p99 is nearest the median.
pub fn combine(rounds: Vec<Measured>) -> Option<Measured> {
    let med = |f: fn(&Row) -> f64| median(&rounds.iter().map(|m| f(&m.row)).collect::<Vec<_>>());
    let p99s: Vec<f64> = rounds.iter().map(|m| m.row.latency_ms.p99).collect();
    let lo = p99s.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = p99s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let latency_ms = LatencySummary {
        p50: med(|r| r.latency_ms.p50),
        p90: med(|r| r.latency_ms.p90),
        p99: med(|r| r.latency_ms.p99),
        p99_9: med(|r| r.latency_ms.p99_9),
        p99_99: med(|r| r.latency_ms.p99_99),
        max: med(|r| r.latency_ms.max),
    };
    let rps = round2(med(|r| r.rps));
    let med_opt = |f: fn(&Row) -> Option<f64>| {
        let v: Option<Vec<f64>> = rounds.iter().map(|m| f(&m.row)).collect();
        v.map(|v| median(&v))
    };
    let p99_excl_lag_ms = med_opt(|r| r.p99_excl_lag_ms);
    let cpu_us_per_request = med_opt(|r| r.cpu_us_per_request);
    let upstream_cpu_us_per_request = med_opt(|r| r.upstream_cpu_us_per_request);
    // Each round's own ratio, then the median: both sides of a ratio from the same run.
    let cpu_per_upstream_cpu = med_opt(|r| r.cpu_per_upstream_cpu);
    let errors_rounds: Vec<u64> = rounds.iter().map(|m| m.row.errors).collect();
    let errors = errors_rounds.iter().sum();
    let pick = rounds.into_iter().min_by(|a, b| {
        let d = |m: &Measured| (m.row.latency_ms.p99 - latency_ms.p99).abs();
        d(a).total_cmp(&d(b))
    })?;
    let row = Row {
        rps,
        errors,
        latency_ms,
        p99_range_ms: Some([lo, hi]),
        p99_rounds_ms: Some(p99s),
        errors_rounds: Some(errors_rounds),
        p99_excl_lag_ms,
        cpu_us_per_request,
        upstream_cpu_us_per_request,
        cpu_per_upstream_cpu,
        ..pick.row
    };
    Some(Measured {
        row,
        report: pick.report,
    })
}

/// Measures every target in `targets` for one variant, `opts.rounds` times, interleaved and
/// rotated; returns one combined row per target, in `targets` order.
pub fn measure_rounds(
    targets: &[Target],
    variant: &str,
    connections: usize,
    rate: Option<f64>,
    opts: &Options,
) -> Result<Vec<Measured>, ScenarioError> {
    let rounds = opts.rounds.max(1);
    let mut per_target: Vec<Vec<Measured>> = targets.iter().map(|_| Vec::new()).collect();
    for round in 0..rounds {
        eprintln!("  round {}/{rounds} of {variant}", round + 1);
        for i in rotation(targets.len(), round) {
            per_target[i].push(measure(&targets[i], variant, connections, rate, opts)?);
        }
    }
    Ok(per_target.into_iter().filter_map(combine).collect())
}

/// The CPU/req column: `11.6us (2.41×)`, or the upstream's own when measured directly.
fn fmt_cpu(r: &Row) -> String {
    match (r.cpu_us_per_request, r.cpu_per_upstream_cpu) {
        (Some(c), Some(k)) => format!("{c:.1}us ({k:.2}×)"),
        (Some(c), None) => format!("{c:.1}us"),
        (None, _) => r
            .upstream_cpu_us_per_request
            .map_or("–".into(), |u| format!("{u:.1}us (upstream)")),
    }
}

/// A target's CPU time over its upstream's in the same run, to three decimals.
fn cpu_ratio(target_ns: Option<u64>, upstream_ns: Option<u64>) -> Option<f64> {
    match (target_ns, upstream_ns) {
        (Some(t), Some(u)) if u > 0 => Some((t as f64 / u as f64 * 1000.0).round() / 1000.0),
        _ => None,
    }
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

impl Outcome {
    pub fn row(&self, target: &str, variant: &str) -> Option<&Row> {
        self.measured
            .iter()
            .map(|m| &m.row)
            .find(|r| r.target == target && r.variant == variant)
    }

    /// The documented JSON document.
    pub fn json(&self) -> Value {
        let results: Vec<&Row> = self.measured.iter().map(|m| &m.row).collect();
        json!({
            "scenario": self.scenario,
            "rounds": self.rounds,
            "results": results,
            "targets": self.checks,
        })
    }

    /// The human tables: results with ratios to `direct`, then the goals.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "scenario {}", self.scenario);
        for n in &self.notes {
            let _ = writeln!(out, "  note: {n}");
        }
        // A paragraph of their own (in results.md, where this table goes too).
        if !self.notes.is_empty() {
            out.push('\n');
        }
        let _ = writeln!(
            out,
            "{} interleaved round(s) per row: medians across rounds (errors summed); p99 range = lowest–highest p99 of the rounds; \
             p99 excl. lag (open loop) = p99 without the generator's lag in sending, still corrected for coordinated omission; \
             CPU/req = CPU time (user + system) the target's processes used per request, and in brackets ÷ its upstream's in the same runs \
             (a yardstick of the machine's speed in the same runs, so this ratio compares targets measured while it drifted; only roughly: the upstream's own work per request differs by up to about 15 % between targets, which send it different headers and batch their writes to it differently, so raw CPU/req of two targets in one run is the closer comparison); \
             rounds met (p99 goals) = in how many rounds the goal's two sides, measured in the same pass, met it on their own (rounds exactly at the goal left out; a round with errors on either side counts as not met); \
             inconclusive = a count chance would give as often (two-sided sign test, p > 0.05): the verdict is the medians', and the rounds do not settle it.\n",
            self.rounds
        );
        let _ = writeln!(
            out,
            "| target | variant | rps | errors | p50 | p90 | p99 | p99 range | p99 excl. lag | p99.9 | p99.99 | max | CPU/req (÷ upstream's) | rps ÷ direct | p99 ÷ direct |"
        );
        let _ = writeln!(
            out,
            "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"
        );
        for m in &self.measured {
            let r = &m.row;
            let l = &r.latency_ms;
            let direct = self
                .measured
                .iter()
                .map(|m| &m.row)
                .find(|d| d.target == "direct" && d.variant == r.variant);
            let (rr, pr) = match direct {
                Some(d) => (ratio(r.rps, d.rps), ratio(l.p99, d.latency_ms.p99)),
                None => ("–".into(), "–".into()),
            };
            let _ = writeln!(
                out,
                "| {} | {} | {:.0} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {rr} | {pr} |",
                r.target,
                r.variant,
                r.rps,
                r.errors,
                fmt_ms(l.p50),
                fmt_ms(l.p90),
                fmt_ms(l.p99),
                r.p99_range_ms.map_or("–".into(), |[lo, hi]| format!(
                    "{}–{}",
                    fmt_ms(lo),
                    fmt_ms(hi)
                )),
                r.p99_excl_lag_ms.map_or("–".into(), fmt_ms),
                fmt_ms(l.p99_9),
                fmt_ms(l.p99_99),
                fmt_ms(l.max),
                fmt_cpu(r)
            );
        }
        let _ = writeln!(out);
        let _ = writeln!(out, "| goal | value | goal | met | rounds met |");
        let _ = writeln!(out, "|---|--:|--:|:-:|--:|");
        for c in &self.checks {
            let v = c.value.map_or("n/a".to_string(), |v| c.shown(v));
            let met = match (c.met, c.errors) {
                (true, _) => "yes".to_string(),
                (false, Some(e)) => format!("**no** ({e} errors)"),
                (false, None) => "**no**".to_string(),
            };
            let rounds = c.rounds_met.map_or("–".to_string(), |[k, n]| {
                if sign_test_p(k, n) > 0.05 {
                    format!("{k} of {n} (inconclusive)")
                } else {
                    format!("{k} of {n}")
                }
            });
            let _ = writeln!(out, "| {} | {v} | {} | {met} | {rounds} |", c.name, c.goal);
        }
        out
    }

    /// Writes the scenario's SVG charts into `dir`; returns the file names.
    pub fn charts(&self, dir: &Path) -> std::io::Result<Vec<PathBuf>> {
        std::fs::create_dir_all(dir)?;
        let mut files = Vec::new();
        let mut variants: Vec<String> = Vec::new();
        for m in &self.measured {
            let base = base_variant(&m.row.variant);
            if !variants.contains(&base) {
                variants.push(base);
            }
        }
        for v in &variants {
            let ms: Vec<&Measured> = self
                .measured
                .iter()
                .filter(|m| &base_variant(&m.row.variant) == v)
                .collect();
            let label = |m: &Measured| {
                if m.row.variant == *v {
                    m.row.target.clone()
                } else {
                    format!("{} ({})", m.row.target, m.row.variant)
                }
            };
            let series: Vec<svg::Series<'_>> = ms
                .iter()
                .map(|m| svg::Series {
                    name: label(m),
                    hist: &m.report.recorder.corrected,
                })
                .collect();
            let p = dir.join(format!("{}-{v}-spectrum.svg", self.scenario));
            svg::spectrum(
                &p,
                &format!("{} {v}: latency by percentile", self.scenario),
                &series,
            )?;
            files.push(p);
            let over: Vec<(String, Vec<f64>)> = ms
                .iter()
                .map(|m| (label(m), svg::p99_per_second(&m.report.recorder.per_second)))
                .collect();
            let p = dir.join(format!("{}-{v}-over-time.svg", self.scenario));
            svg::lines(
                &p,
                &format!("{} {v}: p99 per second", self.scenario),
                "second",
                0,
                &over,
            )?;
            files.push(p);
        }
        Ok(files)
    }
}

/// Variants share a chart when they differ only by the `+...` suffix of a target setup.
fn base_variant(v: &str) -> String {
    v.split('+').next().unwrap_or(v).to_string()
}

fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 {
        format!("{:.2}×", a / b)
    } else {
        "–".into()
    }
}

/// A goal on `num / den`: at least `goal` (`at_most = false`) or at most `goal`.
pub fn check(name: String, num: Option<f64>, den: Option<f64>, goal: f64, at_most: bool) -> Check {
    let raw = num.zip(den).and_then(|(n, d)| goal_ratio(n, d));
    let mut c = Check {
        name,
        // Judged and kept unrounded; shown to three decimals unless more are needed to agree
        // with the verdict (`shown`).
        value: raw,
        goal,
        met: false,
        rounds_met: None,
        errors: None,
        at_most,
    };
    c.met = raw.is_some_and(|v| c.holds(v));
    c
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn rotation_balances_positions_and_neighbours() {
        assert_eq!(rotation(4, 0), [0, 1, 2, 3]);
        assert_eq!(rotation(4, 1), [3, 2, 1, 0]);
        assert_eq!(rotation(4, 2), [1, 2, 3, 0]);
        assert_eq!(rotation(4, 3), [0, 3, 2, 1]);
        assert_eq!(rotation(4, 9), [3, 2, 1, 0]);
        assert!(rotation(0, 3).is_empty());
        for n in 1..=7 {
            // Over 2n rounds every target takes every position twice.
            for pos in 0..n {
                let mut seen: Vec<usize> = (0..2 * n).map(|r| rotation(n, r)[pos]).collect();
                seen.sort_unstable();
                let twice: Vec<usize> = (0..n).flat_map(|t| [t, t]).collect();
                assert_eq!(seen, twice, "n = {n}, position {pos}");
            }
            // And no target always follows the same one.
            for t in 0..n {
                let before: std::collections::BTreeSet<usize> = (0..2 * n)
                    .filter_map(|r| {
                        let o = rotation(n, r);
                        let p = o.iter().position(|&x| x == t)?;
                        p.checked_sub(1).map(|q| o[q])
                    })
                    .collect();
                assert!(
                    n < 3 || before.len() == 2,
                    "n = {n}, target {t}: {before:?}"
                );
            }
        }
    }

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(&[24.0, 1.7, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[7.0]), 7.0);
        assert_eq!(median(&[]), 0.0);
    }

    fn measured(rps: f64, errors: u64, p99: f64) -> Measured {
        let report = Report {
            recorder: crate::stats::Recorder::new(0),
            measured: Duration::from_secs(1),
            sent: 0,
            connections: 1,
            threads: 1,
            rate: None,
            tls_error: None,
        };
        Measured {
            row: Row {
                target: "direct".into(),
                variant: "closed-50c".into(),
                rps,
                errors,
                latency_ms: LatencySummary {
                    p50: p99 / 10.0,
                    p90: p99 / 2.0,
                    p99,
                    p99_9: p99 * 2.0,
                    p99_99: p99 * 3.0,
                    max: p99 * 4.0,
                },
                p99_range_ms: None,
                p99_rounds_ms: None,
                errors_rounds: None,
                p99_excl_lag_ms: Some(p99 / 2.0),
                cpu_us_per_request: Some(rps / 100.0),
                upstream_cpu_us_per_request: Some(p99),
                cpu_per_upstream_cpu: Some(rps / 100.0 / p99),
            },
            report,
        }
    }

    #[test]
    fn combine_takes_medians_sums_errors_and_keeps_the_p99_range() {
        let rounds = vec![
            measured(1000.0, 1, 1.7),
            measured(900.0, 0, 24.0),
            measured(1100.0, 2, 2.0),
        ];
        let m = combine(rounds).unwrap();
        let r = &m.row;
        assert_eq!(
            (r.target.as_str(), r.variant.as_str()),
            ("direct", "closed-50c")
        );
        assert_eq!(r.rps, 1000.0);
        assert_eq!(r.errors, 3);
        assert_eq!(r.latency_ms.p99, 2.0);
        assert_eq!(r.latency_ms.p99_9, 4.0);
        assert_eq!(r.latency_ms.max, 8.0);
        assert_eq!(r.p99_range_ms, Some([1.7, 24.0]));
        assert_eq!(
            r.p99_rounds_ms,
            Some(vec![1.7, 24.0, 2.0]),
            "in round order"
        );
        // The median of 0.85, 12.0 and 1.0.
        assert_eq!(r.p99_excl_lag_ms, Some(1.0));
        assert_eq!(r.cpu_us_per_request, Some(10.0));
        assert_eq!(r.upstream_cpu_us_per_request, Some(2.0));
        // The median of each round's own ratio (10/1.7, 9/24, 11/2), not 10 ÷ 2.
        assert_eq!(r.cpu_per_upstream_cpu, Some(5.5));
        assert!(combine(Vec::new()).is_none());
        let v = serde_json::to_value(r).unwrap();
        assert_eq!(v["p99_range_ms"], json!([1.7, 24.0]));
        assert_eq!(v["p99_excl_lag_ms"], json!(1.0));
        assert_eq!(v["p99_rounds_ms"], json!([1.7, 24.0, 2.0]));
    }

    fn rounds_row(p99s: &[f64]) -> Row {
        let mut r = combine(p99s.iter().map(|&p| measured(1000.0, 0, p)).collect())
            .unwrap()
            .row;
        r.target = "t".into();
        r
    }

    #[test]
    fn a_goal_counts_the_rounds_whose_own_pair_met_it() {
        let tailgate = rounds_row(&[1.0, 3.0, 2.0, 0.5]);
        let nginx = rounds_row(&[2.0, 2.0, 2.0, 9.0]);
        // Round by round: 0.5, 1.5, 1.0 and 0.06 of nginx's; two are under 1, and the
        // tie (1.0) goes neither way.
        let c = check("p99 ≤".into(), Some(2.0), Some(2.0), 1.0, true)
            .by_round(Some(&tailgate), Some(&nginx));
        assert_eq!(c.rounds_met, Some([2, 3]));
        assert!(c.met, "the verdict stays the medians' (1.0)");
        // A lower bound counts the other way: 1.5 is over 1.
        let c = check("≥".into(), Some(2.0), Some(2.0), 1.0, false)
            .by_round(Some(&tailgate), Some(&nginx));
        assert_eq!(c.rounds_met, Some([1, 3]));
        // A side not measured, or measured without rounds: nothing to count.
        let c = check("p99 ≤".into(), Some(2.0), None, 1.0, true).by_round(Some(&tailgate), None);
        assert_eq!(c.rounds_met, None);
        let mut single = nginx.clone();
        single.p99_rounds_ms = None;
        let c = check("p99 ≤".into(), Some(2.0), Some(2.0), 1.0, true)
            .by_round(Some(&tailgate), Some(&single));
        assert_eq!(c.rounds_met, None);
    }

    /// A round in which either side had errors, or answered nothing (a p99 of 0 from an
    /// empty histogram), counts as not met: before, a tailgate round that answered nothing
    /// had a ratio of 0 and met a "p99 ≤" goal, and an nginx one was left out.
    #[test]
    fn a_round_with_errors_does_not_meet_a_goal() {
        let rows = |p99s: &[f64], errors: &[u64]| {
            let mut r = combine(
                p99s.iter()
                    .zip(errors)
                    .map(|(&p, &e)| measured(1000.0, e, p))
                    .collect(),
            )
            .unwrap()
            .row;
            r.target = "t".into();
            r
        };
        // Round 1: tailgate answered nothing; round 2: nginx had errors; round 3: met.
        let tailgate = rows(&[0.0, 1.0, 1.0], &[5, 0, 0]);
        let nginx = rows(&[2.0, 2.0, 2.0], &[0, 3, 0]);
        let c = check("p99 ≤".into(), Some(1.0), Some(2.0), 1.0, true)
            .by_round(Some(&tailgate), Some(&nginx));
        assert_eq!(c.rounds_met, Some([1, 3]));
        assert_eq!(tailgate.errors_rounds, Some(vec![5, 0, 0]));
        // A p99 of 0 without errors counted (a round nothing was measured in) is no win
        // either.
        let empty = rows(&[0.0, 1.0], &[0, 0]);
        let nginx = rows(&[2.0, 2.0], &[0, 0]);
        let c = check("p99 ≤".into(), Some(1.0), Some(2.0), 1.0, true)
            .by_round(Some(&empty), Some(&nginx));
        assert_eq!(c.rounds_met, Some([1, 2]));
    }

    /// A ratio is judged unrounded (1.0004 is not at most 1), and shown to three decimals
    /// unless those would read as the other verdict.
    #[test]
    fn a_goal_is_judged_on_the_unrounded_ratio() {
        let shown = |c: Check| {
            let o = Outcome {
                scenario: "s".into(),
                measured: Vec::new(),
                checks: vec![c],
                notes: Vec::new(),
                rounds: 1,
            };
            let t = o.table();
            t.lines().last().unwrap_or_default().to_string()
        };
        let c = check("p99 ≤".into(), Some(1.0004), Some(1.0), 1.0, true);
        assert_eq!(c.value, Some(1.0004));
        assert!(!c.met);
        assert_eq!(shown(c), "| p99 ≤ | 1.0004 | 1 | **no** | – |");
        let c = check("rps ≥".into(), Some(0.9996), Some(1.0), 1.0, false);
        assert!(!c.met);
        assert_eq!(shown(c), "| rps ≥ | 0.9996 | 1 | **no** | – |");
        let c = check("p99 ≤".into(), Some(1.0000004), Some(1.0), 1.0, true);
        assert!(!c.met);
        assert_eq!(shown(c), "| p99 ≤ | 1.0000004 | 1 | **no** | – |");
        let c = check("p99 ≤".into(), Some(1.0), Some(1.0), 1.0, true);
        assert!(c.met);
        assert_eq!(shown(c), "| p99 ≤ | 1.000 | 1 | yes | – |");
        let c = check("p99 ≤".into(), Some(0.98765), Some(1.0), 1.0, true);
        assert_eq!(shown(c), "| p99 ≤ | 0.988 | 1 | yes | – |");
    }

    /// The CPU ratio is taken from the CPU times, not from the rounded microseconds.
    #[test]
    fn the_cpu_ratio_is_taken_unrounded() {
        // 1.004 µs over 0.996 µs per request: 1.008, where the shown 1.00 and 1.00 give 1.
        assert_eq!(cpu_ratio(Some(1_004_000), Some(996_000)), Some(1.008));
        assert_eq!(cpu_ratio(Some(1), Some(0)), None);
        assert_eq!(cpu_ratio(None, Some(1)), None);
    }

    /// A failed (or unsent) request in either row the goal compares: not met, whatever the
    /// ratio, and the table says why.
    #[test]
    fn a_goal_with_errors_in_its_rows_is_not_met() {
        let ok = combine(vec![measured(1000.0, 0, 1.0)]).unwrap().row;
        let failing = combine(vec![measured(1000.0, 3, 1.0), measured(1000.0, 2, 1.0)])
            .unwrap()
            .row;
        let c = check("p99 ≤".into(), Some(0.0), Some(1.0), 1.0, true)
            .by_round(Some(&failing), Some(&ok));
        assert!(!c.met);
        assert_eq!(c.errors, Some(5));
        let c = check("rps ≥".into(), Some(2.0), Some(1.0), 1.0, false)
            .sides(Some(&ok), Some(&failing));
        assert!(!c.met);
        let c = check("rps ≥".into(), Some(2.0), Some(1.0), 1.0, false).sides(Some(&ok), Some(&ok));
        assert!(c.met);
        assert_eq!(c.errors, None);
        let o = Outcome {
            scenario: "s".into(),
            measured: Vec::new(),
            checks: vec![
                check("rps ≥".into(), Some(2.0), Some(1.0), 1.0, false).sides(Some(&failing), None),
            ],
            notes: Vec::new(),
            rounds: 2,
        };
        let t = o.table();
        assert!(
            t.contains("| rps ≥ | 2.000 | 1 | **no** (5 errors) | – |"),
            "{t}"
        );
        assert_eq!(o.json()["targets"][0]["errors"], json!(5));
    }

    /// The sign test's p-values, against the binomial tables.
    #[test]
    fn the_sign_test_says_how_often_chance_gives_a_count() {
        let near = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(near(sign_test_p(5, 5), 0.0625));
        assert!(near(sign_test_p(0, 5), 0.0625));
        assert!(near(sign_test_p(10, 12), 0.03857421875));
        assert!(near(sign_test_p(9, 12), 0.14599609375));
        assert!(near(sign_test_p(6, 12), 1.0));
        assert!(near(sign_test_p(0, 0), 1.0));
        // So 5 rounds never settle a goal; 12 do at 10 of them.
        assert!(sign_test_p(10, 12) <= 0.05 && sign_test_p(2, 12) <= 0.05);
    }

    #[test]
    fn the_goal_table_shows_the_rounds_met() {
        let tailgate = rounds_row(&[1.0, 3.0, 1.5]);
        let nginx = rounds_row(&[2.0, 2.0, 2.0]);
        let o = Outcome {
            scenario: "s".into(),
            measured: Vec::new(),
            checks: vec![
                check("p99 ≤".into(), Some(2.0), Some(2.0), 1.0, true)
                    .by_round(Some(&tailgate), Some(&nginx)),
                check("rps ≥".into(), Some(2.0), Some(1.0), 1.0, false),
            ],
            notes: Vec::new(),
            rounds: 3,
        };
        let t = o.table();
        assert!(
            t.contains("| goal | value | goal | met | rounds met |"),
            "{t}"
        );
        assert!(
            t.contains("| p99 ≤ | 1.000 | 1 | yes | 2 of 3 (inconclusive) |"),
            "{t}"
        );
        assert!(t.contains("| rps ≥ | 2.000 | 1 | yes | – |"), "{t}");
        let v = o.json();
        assert_eq!(v["targets"][0]["rounds_met"], json!([2, 3]));
        assert!(v["targets"][1].get("rounds_met").is_none(), "{v}");
        assert!(v["targets"][0].get("at_most").is_none(), "{v}");
    }
}
