//! `tailgate bench ...` argument handling. Bad arguments exit 2 with a message.
use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use bytes::Bytes;
use clap::{Args, Parser, Subcommand};
use http::{HeaderName, HeaderValue, Method};

use crate::load::target::{RequestTemplate, Url};
use crate::load::{self, Spec, Stop};
use crate::output;
use crate::scenario::{self, Options, churn, report};

#[derive(Parser)]
#[command(
    name = "tailgate bench",
    bin_name = "tailgate bench",
    about = "Open-loop load generator and reproducible benchmark scenarios."
)]
struct Bench {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Load one or more URLs (round-robin) and print the latency distribution.
    Run(RunArgs),
    /// A fast fixed-answer upstream (HTTP/1.1 keep-alive, h2c by prior knowledge).
    Upstream(UpstreamArgs),
    /// Run a scenario: tailgate side by side with direct, nginx and HAProxy.
    Scenario(ScenarioArgs),
    /// Run every scenario and regenerate docs/bench/ and the README's benchmark section.
    Report(ReportArgs),
    /// The training workload of the profile-guided release build (scripts/pgo.sh): a
    /// gateway of this binary under the traffic it is optimized for; fails if any request
    /// fails.
    Train(TrainArgs),
}

#[derive(Args)]
struct TrainArgs {
    /// Load per phase (the first phase gets twice this).
    #[arg(long, value_parser = parse_duration, default_value = "2s")]
    phase: Duration,
    /// LLVM_PROFILE_FILE for the gateways started: where an instrumented build writes its
    /// profile (`%p` is the process id). The upstreams keep this process's environment.
    #[arg(long)]
    profile_file: Option<PathBuf>,
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("loop").required(true).args(["rate", "closed"])))]
struct RunArgs {
    /// URLs to load; connections are spread over their addresses, requests round-robin.
    #[arg(required = true)]
    urls: Vec<String>,
    /// Connections to keep open.
    #[arg(short = 'c', long, default_value_t = 10)]
    connections: usize,
    /// Open loop: total requests per second (constant arrival rate).
    #[arg(short = 'r', long)]
    rate: Option<f64>,
    /// Closed loop: each connection sends as fast as answers come back.
    #[arg(long)]
    closed: bool,
    /// Measured duration (after the warm-up), e.g. 10s, 1m.
    #[arg(short = 'd', long, value_parser = parse_duration, conflicts_with = "requests")]
    duration: Option<Duration>,
    /// Measured request count (after the warm-up) instead of a duration.
    #[arg(short = 'n', long)]
    requests: Option<u64>,
    /// Generator threads (each a current-thread runtime).
    #[arg(short = 't', long, default_value_t = 1)]
    threads: usize,
    /// HTTP/2: h2c with prior knowledge for http://, ALPN h2 for https://.
    #[arg(long)]
    h2: bool,
    /// Request method.
    #[arg(short = 'm', long, default_value = "GET")]
    method: String,
    /// Extra header, 'Name: value' (repeatable).
    #[arg(short = 'H', long = "header")]
    headers: Vec<String>,
    /// Request body.
    #[arg(long)]
    body: Option<String>,
    /// Warm-up before measuring (sent, not recorded).
    #[arg(long, value_parser = parse_duration, default_value = "1s")]
    warmup: Duration,
    /// Per-request timeout (connect + exchange).
    #[arg(long, value_parser = parse_duration, default_value = "2s")]
    timeout: Duration,
    /// Connect (and TLS handshake) timeout.
    #[arg(long, value_parser = parse_duration, default_value = "1s")]
    connect_timeout: Duration,
    /// Accept any TLS certificate.
    #[arg(long)]
    insecure: bool,
    /// Print one JSON document instead of the table.
    #[arg(long)]
    json: bool,
    /// Write SVG charts (percentile spectrum, p99 per second) into this directory.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Print latency by request index on a connection (its first 256 requests).
    #[arg(long)]
    by_index: bool,
    /// Pin the generator to this CPU core (via taskset).
    #[arg(long)]
    pin: Option<usize>,
}

#[derive(Args)]
struct UpstreamArgs {
    /// Address to listen on.
    #[arg(long)]
    listen: String,
    /// Response body size.
    #[arg(long, default_value_t = 110)]
    body_bytes: usize,
    /// Send `Connection: close` on every N-th response of a connection, then close it.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    close_every: Option<u64>,
    /// Delay before every response, in milliseconds.
    #[arg(long, default_value_t = 0)]
    delay_ms: u64,
}

#[derive(Args, Clone)]
struct ScenarioOpts {
    /// Measured time per run, i.e. per (target, variant, round). Default 3s (was 5s) since
    /// every run is repeated --rounds times.
    #[arg(long, value_parser = parse_duration, default_value = "3s")]
    duration: Duration,
    /// Warm-up per run (per target, variant and round).
    #[arg(long, value_parser = parse_duration, default_value = "1s")]
    warmup: Duration,
    /// Interleaved measurements per (target, variant): each round measures all targets of a
    /// variant in an order rotated by one every two rounds and reversed in odd ones; rows report the medians and the p99 range.
    /// Default 5 (was 3): on the shared 2-core VMs one round's p99 ranged from 0.35 ms to
    /// 4.2 ms for the same target, and a median of three still swung by tens of percent.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100))]
    rounds: u32,
    /// Fixed open-loop rate (requests per second).
    #[arg(long, default_value_t = 5000.0)]
    rate: f64,
    /// Connections for the normal variants.
    #[arg(long, default_value_t = CONNECTIONS)]
    connections: usize,
    /// Connections for the many-connections variant.
    #[arg(long, default_value_t = MANY_CONNECTIONS)]
    many_connections: usize,
    /// keepalive-churn: the upstream closes every N requests.
    #[arg(long, default_value_t = CLOSE_EVERY, value_parser = clap::value_parser!(u64).range(1..))]
    close_every: u64,
    /// Do not pin processes to cores.
    #[arg(long)]
    no_pin: bool,
    /// The tailgate build measured as `tailgate` (default: this binary). This binary stays
    /// the load generator and the upstream, so they are the same whichever build is
    /// measured, e.g. `--tailgate target/pgo/tailgate`.
    #[arg(long, value_name = "PATH")]
    tailgate: Option<PathBuf>,
    /// Also measure another tailgate build, as target NAME (overhead and keepalive-churn;
    /// metrics-scrape measures one build against itself: refused there, left out of it in
    /// `report`), e.g. `--compare tailgate-plain=target/release/tailgate` beside the
    /// profile-guided build. Repeatable.
    #[arg(long, value_name = "NAME=PATH")]
    compare: Vec<String>,
}

#[derive(Args)]
struct ScenarioArgs {
    /// overhead | keepalive-churn | metrics-scrape
    #[arg(value_parser = clap::builder::PossibleValuesParser::new(scenario::NAMES))]
    name: String,
    #[command(flatten)]
    opts: ScenarioOpts,
    /// Print one JSON document on stdout (the table goes to stderr).
    #[arg(long)]
    json: bool,
    /// Write SVG charts into this directory.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Args)]
struct ReportArgs {
    #[command(flatten)]
    opts: ScenarioOpts,
    /// Where results.md and the charts go.
    #[arg(long, default_value = "docs/bench")]
    out: PathBuf,
    /// The README whose benchmark section is replaced.
    #[arg(long, default_value = "README.md")]
    readme: PathBuf,
    /// Check the options and exit (0 when they are valid), measuring and writing nothing:
    /// `scripts/bench-report.sh` runs it before its long build, so a mistyped option fails
    /// at once rather than after it.
    #[arg(long)]
    check: bool,
}

/// The longest duration any option takes: far past any run, and far from where adding it
/// to the clock would overflow (which panicked).
const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

fn parse_duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| format!("{e} (e.g. 10s, 500ms, 1m)"))?;
    if d > MAX_DURATION {
        return Err("at most 365days (e.g. 10s, 500ms, 1m)".into());
    }
    Ok(d)
}

/// A usage error: message on stderr, exit 2.
fn usage(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("tailgate bench: error: {msg}");
    ExitCode::from(2)
}

/// Entry point for `tailgate bench ARGS...`; `tailgate_exe` is the path of the running
/// `tailgate` binary, used by scenarios to start the gateway (`tailgate serve --config F`)
/// and the upstream (`tailgate bench upstream ...`).
pub fn main(args: Vec<OsString>, tailgate_exe: PathBuf) -> ExitCode {
    let argv = std::iter::once(OsString::from("tailgate bench")).chain(args);
    let bench = match Bench::try_parse_from(argv) {
        Ok(b) => b,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(e.exit_code().clamp(0, 255) as u8);
        }
    };
    crate::scenario::procs::raise_open_files_limit();
    match bench.command {
        Command::Run(a) => run(a),
        Command::Upstream(a) => upstream(a),
        Command::Scenario(a) => scenario_cmd(a, tailgate_exe),
        Command::Report(a) => report_cmd(a, tailgate_exe),
        Command::Train(a) => train_cmd(a, tailgate_exe),
    }
}

fn train_cmd(a: TrainArgs, exe: PathBuf) -> ExitCode {
    if a.phase.is_zero() {
        return usage("--phase must be more than 0");
    }
    if let Some(p) = &a.profile_file
        && !p.to_string_lossy().contains("%p")
    {
        return usage(format!(
            "--profile-file {}: needs %p (the process id): each gateway writes its own profile",
            p.display()
        ));
    }
    let opts = crate::train::Options {
        phase: a.phase,
        profile_file: a.profile_file,
    };
    eprintln!("training {} on its own gateway", exe.display());
    match crate::train::run(&opts, &exe) {
        Ok(()) => {
            eprintln!("training done");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tailgate bench train: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(a: RunArgs) -> ExitCode {
    let spec = match build_spec(&a) {
        Ok(s) => s,
        Err(m) => return usage(m),
    };
    if let Some(core) = a.pin
        && !crate::pin::pin_self(core)
    {
        eprintln!(
            "tailgate bench: note: could not pin to core {core} (taskset missing?), running unpinned"
        );
    }
    let report = match load::run(spec) {
        Ok(r) => r,
        Err(load::LoadError::Thread(e)) => {
            eprintln!("tailgate bench: {e}");
            return ExitCode::FAILURE;
        }
        Err(e) => return usage(e),
    };
    if a.json {
        println!("{}", output::json::report(&report, &a.urls));
    } else {
        print!("{}", output::text::report(&report, &a.urls, a.by_index));
    }
    if let Some(dir) = &a.svg {
        let rec = &report.recorder;
        let res = std::fs::create_dir_all(dir)
            .and_then(|_| {
                let mut series = vec![output::svg::Series {
                    name: "corrected".into(),
                    hist: &rec.corrected,
                }];
                if report.rate.is_some() {
                    series.push(output::svg::Series {
                        name: "uncorrected".into(),
                        hist: &rec.uncorrected,
                    });
                }
                output::svg::spectrum(&dir.join("spectrum.svg"), "latency by percentile", &series)
            })
            .and_then(|_| {
                output::svg::lines(
                    &dir.join("over-time.svg"),
                    "p99 per second",
                    "second",
                    0,
                    &[("p99".into(), output::svg::p99_per_second(&rec.per_second))],
                )
            })
            .and_then(|_| {
                output::svg::lines(
                    &dir.join("by-index.svg"),
                    "p99 by request index on a connection",
                    "request index",
                    1,
                    &[("p99".into(), output::svg::p99_by_index(&rec.by_index))],
                )
            });
        if let Err(e) = res {
            eprintln!("tailgate bench: writing charts to {}: {e}", dir.display());
            return ExitCode::FAILURE;
        }
    }
    // A run in which nothing succeeded measured nothing: a script must not take its
    // numbers (the report is printed all the same, with its errors by kind).
    if report.recorder.ok == 0 {
        eprintln!(
            "tailgate bench: no request succeeded ({} failed; errors by kind in the report)",
            report.recorder.errors.total()
        );
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

fn build_spec(a: &RunArgs) -> Result<Spec, String> {
    let urls = a
        .urls
        .iter()
        .map(|u| Url::parse(u).map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    let method = Method::from_bytes(a.method.as_bytes())
        .map_err(|_| format!("bad method {:?}", a.method))?;
    let mut headers = Vec::new();
    for h in &a.headers {
        let (k, v) = h
            .split_once(':')
            .ok_or_else(|| format!("bad header {h:?}: expected 'Name: value'"))?;
        let k = HeaderName::from_bytes(k.trim().as_bytes())
            .map_err(|_| format!("bad header name in {h:?}"))?;
        let v =
            HeaderValue::from_str(v.trim()).map_err(|_| format!("bad header value in {h:?}"))?;
        headers.push((k, v));
    }
    let stop = match (a.duration, a.requests) {
        (_, Some(n)) => Stop::Count(n),
        (Some(d), None) => Stop::Duration(d),
        (None, None) => Stop::Duration(Duration::from_secs(10)),
    };
    let spec = Spec {
        urls,
        request: RequestTemplate {
            method,
            headers,
            body: Bytes::from(a.body.clone().unwrap_or_default()),
        },
        connections: a.connections,
        threads: a.threads,
        rate: if a.closed { None } else { a.rate },
        stop,
        warmup: a.warmup,
        h2: a.h2,
        insecure: a.insecure,
        connect_timeout: a.connect_timeout,
        timeout: a.timeout,
        max_index: crate::load::MAX_INDEX,
    };
    spec.validate().map_err(|e| e.to_string())?;
    Ok(spec)
}

fn upstream(a: UpstreamArgs) -> ExitCode {
    let opts = crate::upstream::Options {
        body_bytes: a.body_bytes,
        close_every: a.close_every,
        delay: Duration::from_millis(a.delay_ms),
    };
    match crate::upstream::serve_blocking(&a.listen, opts) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tailgate bench upstream: {}: {e}", a.listen);
            ExitCode::FAILURE
        }
    }
}

fn options(o: &ScenarioOpts) -> Result<Options, String> {
    if o.duration.is_zero() {
        return Err("--duration must be more than 0".into());
    }
    if !(o.rate.is_finite() && o.rate >= crate::load::MIN_RATE) {
        return Err(format!(
            "--rate must be a number of requests per second, at least {}",
            crate::load::MIN_RATE
        ));
    }
    if o.connections == 0 || o.many_connections == 0 {
        return Err("connection counts must be at least 1".into());
    }
    let tailgate = match &o.tailgate {
        Some(p) => Some(existing_file(p).map_err(|e| format!("--tailgate: {e}"))?),
        None => None,
    };
    let mut compare: Vec<(String, PathBuf)> = Vec::new();
    for c in &o.compare {
        let (name, path) = parse_compare(c)?;
        if compare.iter().any(|(n, _)| *n == name) {
            return Err(format!("--compare {c:?}: {name:?} is named twice"));
        }
        compare.push((name, path));
    }
    Ok(Options {
        duration: o.duration,
        warmup: o.warmup,
        rate: o.rate,
        connections: o.connections,
        many_connections: o.many_connections,
        close_every: o.close_every,
        pin: !o.no_pin,
        rounds: o.rounds as usize,
        tailgate,
        compare,
    })
}

/// `path` made absolute (so the report names the file whichever directory it was run
/// from), or why it is not a file.
fn existing_file(path: &std::path::Path) -> Result<PathBuf, String> {
    if !path.is_file() {
        return Err(format!("{} is not a file (build it first)", path.display()));
    }
    std::path::absolute(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// `NAME=PATH` of `--compare`: a name of letters, digits, `-`, `_` and `.` that no other
/// target has, and a file that exists.
fn parse_compare(arg: &str) -> Result<(String, PathBuf), String> {
    let Some((name, path)) = arg.split_once('=') else {
        return Err(format!(
            "--compare {arg:?}: expected NAME=PATH, e.g. tailgate-plain=target/release/tailgate"
        ));
    };
    let name_ok = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if !name_ok {
        return Err(format!(
            "--compare {arg:?}: the name must be letters, digits, '-', '_' or '.'"
        ));
    }
    if scenario::OWN_TARGETS.contains(&name) {
        return Err(format!(
            "--compare {arg:?}: {name:?} is a target of the scenarios already; choose another name"
        ));
    }
    let path =
        existing_file(std::path::Path::new(path)).map_err(|e| format!("--compare {arg:?}: {e}"))?;
    Ok((name.to_string(), path))
}

/// Pins this process (and so the generator threads it starts) to core 1.
fn pin_generator(opts: &Options) {
    if opts.pin && !crate::pin::pin_self(1) {
        eprintln!(
            "note: could not pin the generator to core 1 (taskset missing?), running unpinned"
        );
    }
}

fn scenario_cmd(a: ScenarioArgs, exe: PathBuf) -> ExitCode {
    let opts = match options(&a.opts) {
        Ok(o) => o,
        Err(m) => return usage(m),
    };
    // `report` passes its `--compare` to every scenario, and those not comparing leave it
    // out there; asked for one alone, it would measure nothing of what was asked.
    if !opts.compare.is_empty() && !scenario::COMPARING.contains(&a.name.as_str()) {
        return usage(format!(
            "--compare does not apply to {}, which measures one build against itself; \
             measure another build with --tailgate PATH",
            a.name
        ));
    }
    pin_generator(&opts);
    let outcome = match scenario::run(&a.name, &opts, &exe) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("tailgate bench scenario {}: {e}", a.name);
            return ExitCode::FAILURE;
        }
    };
    let mut table = outcome.table();
    if a.name == "keepalive-churn" {
        table.push('\n');
        table.push_str(&churn::by_index_table(&outcome, opts.close_every));
    }
    if a.json {
        eprint!("{table}");
        println!("{}", outcome.json());
    } else {
        print!("{table}");
    }
    let _ = std::io::stdout().flush();
    if let Some(dir) = &a.out {
        let res = outcome.charts(dir).and_then(|mut files| {
            if a.name == "keepalive-churn" {
                files.push(churn::by_index_chart(&outcome, opts.close_every, dir)?);
            }
            Ok(files)
        });
        match res {
            Ok(files) => {
                for f in files {
                    eprintln!("wrote {}", f.display());
                }
            }
            Err(e) => {
                eprintln!("tailgate bench: writing charts to {}: {e}", dir.display());
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}

/// The scenarios' defaults, which the report's command leaves out.
const CONNECTIONS: usize = 50;
const MANY_CONNECTIONS: usize = 500;
const CLOSE_EVERY: u64 = 80;

/// The command a report says made it: every option that shapes the run, the ones left at
/// their defaults included where they set the scale of the run (duration, warm-up, rounds,
/// rate), the others only when changed.
fn report_command(o: &ScenarioOpts) -> String {
    let mut command = format!(
        "tailgate bench report --duration {} --warmup {} --rounds {} --rate {}",
        humantime::format_duration(o.duration),
        humantime::format_duration(o.warmup),
        o.rounds,
        o.rate
    );
    if o.connections != CONNECTIONS {
        command.push_str(&format!(" --connections {}", o.connections));
    }
    if o.many_connections != MANY_CONNECTIONS {
        command.push_str(&format!(" --many-connections {}", o.many_connections));
    }
    if o.close_every != CLOSE_EVERY {
        command.push_str(&format!(" --close-every {}", o.close_every));
    }
    if o.no_pin {
        command.push_str(" --no-pin");
    }
    if let Some(t) = &o.tailgate {
        command.push_str(&format!(" --tailgate {}", t.display()));
    }
    for c in &o.compare {
        command.push_str(&format!(" --compare {c}"));
    }
    command
}

fn report_cmd(a: ReportArgs, exe: PathBuf) -> ExitCode {
    let opts = match options(&a.opts) {
        Ok(o) => o,
        Err(m) => return usage(m),
    };
    if a.check {
        return ExitCode::SUCCESS;
    }
    let nproc = std::thread::available_parallelism().map_or(1, |n| n.get());
    pin_generator(&opts);
    let command = report_command(&a.opts);
    let target = report::Target {
        out_dir: &a.out,
        readme: &a.readme,
        command: &command,
        nproc,
    };
    match report::generate(&opts, &exe, &target) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tailgate bench report: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report_args(args: &[&str]) -> ReportArgs {
        let argv = ["tailgate bench", "report"].iter().chain(args);
        match Bench::try_parse_from(argv)
            .expect("valid arguments")
            .command
        {
            Command::Report(a) => a,
            _ => panic!("not report"),
        }
    }

    /// The command a report prints makes the same run again: options changed from their
    /// defaults are in it, those left alone only where they set its scale.
    #[test]
    fn the_report_command_names_every_changed_option() {
        let a = report_args(&[]);
        assert_eq!(
            report_command(&a.opts),
            "tailgate bench report --duration 3s --warmup 1s --rounds 5 --rate 5000"
        );
        let a = report_args(&[
            "--rounds",
            "12",
            "--connections",
            "20",
            "--many-connections",
            "800",
            "--close-every",
            "40",
            "--no-pin",
            "--tailgate",
            "target/pgo/tailgate",
            "--compare",
            "plain=target/release/tailgate",
        ]);
        assert_eq!(
            report_command(&a.opts),
            "tailgate bench report --duration 3s --warmup 1s --rounds 12 --rate 5000 \
             --connections 20 --many-connections 800 --close-every 40 --no-pin \
             --tailgate target/pgo/tailgate --compare plain=target/release/tailgate"
        );
    }
}
