//! `tailgate bench train`: the workload a profile-guided build is trained on
//! (`scripts/pgo.sh`).
//!
//! An instrumented `tailgate` counts every branch its gateway takes; the release build is
//! then compiled with those counts, so the request path's code is laid out hot and together
//! and the rest moved out of its way. What the gateway does here is what it is optimized
//! for, so the phases cover what a deployment serves: small HTTP/1.1 keep-alive GETs
//! (closed loop, then open loop over 50 and 500 connections; about half of all requests),
//! and also small and large request bodies, HTTP/2 from clients (h2c and over TLS), TLS
//! with HTTP/1.1, an HTTP/2 upstream, an upstream that closes its connections every 80
//! requests, per-consumer metrics, a `/metrics` scrape every second, and a second gateway
//! with the JSON access log on. A path left out is not broken by the profile, only laid out
//! as rarely run code. The gateways run without the caller's `RUST_LOG`, so what they log
//! is what their configs say.
//!
//! Every phase must be answered without an error: a phase that fails (a renamed config
//! field, a route that stopped matching) would leave its code out of the profile silently,
//! so it fails the training instead, and `scripts/pgo.sh` stops. So does a gateway that
//! does not exit cleanly on SIGTERM, or, with `--profile-file`, one that leaves no
//! profile behind.

use std::ffi::OsStr;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method};

use crate::load::{self, Spec, Stop, target::Url};
use crate::scenario::procs::{self, Env, SetupError, free_port};
use crate::scenario::{peers, scrape::Scraper};

/// How the training runs.
#[derive(Clone, Debug)]
pub struct Options {
    /// Load per phase (the first, the hottest path, gets twice this).
    pub phase: Duration,
    /// `LLVM_PROFILE_FILE` for the gateways: where an instrumented build writes its counts,
    /// a pattern with `%p` (the process id), since each gateway writes its own. The
    /// upstreams this starts inherit the caller's environment instead.
    pub profile_file: Option<PathBuf>,
}

/// Why the training failed.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Setup(#[from] SetupError),
    #[error("phase {phase}: {source}")]
    Load {
        phase: &'static str,
        #[source]
        source: load::LoadError,
    },
    #[error(
        "phase {phase}: {errors} of {sent} requests failed ({detail}); its code would be missing from the profile"
    )]
    Failed {
        phase: &'static str,
        errors: u64,
        sent: u64,
        detail: String,
    },
    #[error("no /metrics scrape succeeded during the training")]
    NoScrape,
    #[error(
        "{0} exited with {1} after SIGTERM (an instrumented build writes its profile at a clean exit)"
    )]
    Exit(&'static str, std::process::ExitStatus),
    #[error("{0} exited without writing its profile to {1} (see LLVM Profile Error in its log)")]
    NoProfile(&'static str, String),
    #[error("certificate: {0}")]
    Cert(String),
}

/// One phase: what is sent, to which listener, how hard.
struct Phase {
    name: &'static str,
    tls: bool,
    path: &'static str,
    h2: bool,
    connections: usize,
    /// `None`: closed loop.
    rate: Option<f64>,
    method: Method,
    body: usize,
    consumer: bool,
    /// Multiples of `Options::phase`.
    weight: u32,
}

impl Phase {
    const fn get(name: &'static str, connections: usize, rate: Option<f64>) -> Phase {
        Phase {
            name,
            tls: false,
            path: "/",
            h2: false,
            connections,
            rate,
            method: Method::GET,
            body: 0,
            consumer: false,
            weight: 1,
        }
    }
}

/// The phases against the main gateway, in order.
fn phases() -> Vec<Phase> {
    vec![
        Phase {
            weight: 2,
            ..Phase::get("h1 keep-alive, closed loop", 50, None)
        },
        Phase::get(
            "h1 keep-alive, 5000 req/s over 50 connections",
            50,
            Some(5000.0),
        ),
        Phase::get(
            "h1 keep-alive, 2000 req/s over 500 connections",
            500,
            Some(2000.0),
        ),
        Phase {
            method: Method::POST,
            body: 1024,
            ..Phase::get("h1 POST, 1 KiB body", 10, None)
        },
        Phase {
            method: Method::POST,
            body: 64 * 1024,
            ..Phase::get("h1 POST, 64 KiB body", 4, None)
        },
        Phase {
            consumer: true,
            ..Phase::get("h1 with a consumer header", 10, None)
        },
        Phase {
            h2: true,
            ..Phase::get("h2c from the client", 10, None)
        },
        Phase {
            tls: true,
            ..Phase::get("TLS, http/1.1", 10, None)
        },
        Phase {
            tls: true,
            h2: true,
            ..Phase::get("TLS, h2", 10, None)
        },
        Phase {
            path: "/h2/",
            ..Phase::get("HTTP/2 upstream", 10, None)
        },
        Phase {
            path: "/closing/",
            ..Phase::get("upstream closing every 80 requests", 50, Some(2000.0))
        },
    ]
}

const CONSUMER_HEADER: &str = "x-consumer";

/// Runs the training; `tailgate_exe` is the binary whose gateway is trained (and which
/// serves as the upstream).
pub fn run(opts: &Options, tailgate_exe: &Path) -> Result<(), TrainError> {
    let mut env = Env::new(tailgate_exe.to_path_buf(), None)?;
    let up = peers::upstream(&mut env, "upstream", 110, None)?;
    let closing = peers::upstream(&mut env, "upstream-closing", 110, Some(80))?;
    let (cert, key) = certificate(&env)?;
    let loopback = |port| SocketAddr::from(([127, 0, 0, 1], port));
    let (plain, tls, admin) = (
        loopback(free_port()?),
        loopback(free_port()?),
        loopback(free_port()?),
    );
    let config = format!(
        r#"[server]
workers = 1
shutdown_grace = "2s"
[log]
level = "warn"
access_log = false
[admin]
address = "{admin}"
[metrics]
consumer_header = "{CONSUMER_HEADER}"
[[listener]]
name = "plain"
address = "{plain}"
[[listener]]
name = "tls"
address = "{tls}"
[listener.tls]
cert = "{cert}"
key = "{key}"
[[cluster]]
name = "up"
endpoints = ["{up}"]
min_warm_connections = 4
[[cluster]]
name = "closing"
endpoints = ["{closing}"]
min_warm_connections = 4
[[cluster]]
name = "h2"
endpoints = ["{up}"]
protocol = "http2"
[[route]]
path_prefix = "/"
cluster = "up"
[[route]]
path_prefix = "/closing/"
cluster = "closing"
[[route]]
path_prefix = "/h2/"
cluster = "h2"
"#,
        cert = cert.display(),
        key = key.display(),
    );
    let pid = start_gateway(&mut env, opts, "gateway", &config, plain)?;
    let scraper = Scraper::start(admin);
    let mut result = Ok(());
    for phase in phases() {
        let addr = if phase.tls { tls } else { plain };
        result = load_phase(&phase, addr, opts.phase);
        if result.is_err() {
            break;
        }
    }
    let scrapes = scraper.stop();
    result?;
    eprintln!("  /metrics scraped {} times", scrapes.len());
    if scrapes.is_empty() {
        return Err(TrainError::NoScrape);
    }
    stop_gateway(&mut env, opts, "gateway", pid)?;

    // The access log, on a gateway of its own (it is off in the first one, as in the
    // benchmarks; a deployment has it on).
    let logged = loopback(free_port()?);
    let config = format!(
        r#"[server]
workers = 1
shutdown_grace = "2s"
[log]
level = "info"
format = "json"
access_log = true
[[listener]]
address = "{logged}"
[[cluster]]
name = "up"
endpoints = ["{up}"]
[[route]]
path_prefix = "/"
cluster = "up"
"#
    );
    let pid = start_gateway(&mut env, opts, "gateway-access-log", &config, logged)?;
    load_phase(
        &Phase::get("h1 with the JSON access log", 10, None),
        logged,
        opts.phase,
    )?;
    stop_gateway(&mut env, opts, "gateway-access-log", pid)
}

/// Starts a gateway of the trained binary with `config`; returns its pid.
fn start_gateway(
    env: &mut Env,
    opts: &Options,
    name: &'static str,
    config: &str,
    ready: SocketAddr,
) -> Result<u32, TrainError> {
    let path = env.write(&format!("{name}.toml"), config)?;
    let exe = env.gateway_exe.clone();
    let path = path.to_string_lossy().into_owned();
    let mut vars: Vec<(&str, Option<&OsStr>)> = vec![("RUST_LOG", None)];
    if let Some(p) = &opts.profile_file {
        vars.push(("LLVM_PROFILE_FILE", Some(p.as_os_str())));
    }
    env.spawn_with_env(name, &exe, &["serve", "--config", &path], &vars, ready)?;
    procs::pid_listening_on(ready)
        .ok_or_else(|| SetupError::NotReady(format!("{name}: no pid for {ready}")).into())
}

/// Stops a gateway and requires a clean exit, and its profile when one was asked for.
fn stop_gateway(
    env: &mut Env,
    opts: &Options,
    name: &'static str,
    pid: u32,
) -> Result<(), TrainError> {
    let status = env.stop(name, Duration::from_secs(15))?;
    if !status.success() {
        return Err(TrainError::Exit(name, status));
    }
    if let Some(pattern) = &opts.profile_file {
        let file = pattern.to_string_lossy().replace("%p", &pid.to_string());
        let written = std::fs::metadata(&file).is_ok_and(|m| m.len() > 0);
        if !written {
            return Err(TrainError::NoProfile(name, file));
        }
    }
    Ok(())
}

/// Runs one phase and requires every request to be answered with a 2xx/3xx.
fn load_phase(phase: &Phase, addr: SocketAddr, unit: Duration) -> Result<(), TrainError> {
    let scheme = if phase.tls { "https" } else { "http" };
    let url = Url::parse(&format!("{scheme}://{addr}{}", phase.path)).map_err(|source| {
        TrainError::Load {
            phase: phase.name,
            source,
        }
    })?;
    let stop = Stop::Duration(unit * phase.weight);
    let mut spec = Spec::get(vec![url], phase.connections, phase.rate, stop);
    spec.warmup = Duration::ZERO;
    spec.h2 = phase.h2;
    spec.insecure = phase.tls;
    spec.request.method = phase.method.clone();
    spec.request.body = Bytes::from(vec![b'x'; phase.body]);
    if phase.consumer {
        spec.request.headers.push((
            HeaderName::from_static(CONSUMER_HEADER),
            HeaderValue::from_static("training"),
        ));
    }
    let report = load::run(spec).map_err(|source| TrainError::Load {
        phase: phase.name,
        source,
    })?;
    let rec = &report.recorder;
    eprintln!(
        "  {:<48} {:>8} answered, {:>6.0} req/s",
        phase.name,
        rec.ok,
        report.rps()
    );
    let errors = rec.errors.total();
    if errors > 0 || rec.ok == 0 {
        return Err(TrainError::Failed {
            phase: phase.name,
            errors,
            sent: report.sent,
            detail: report
                .tls_error
                .clone()
                .unwrap_or_else(|| format!("{:?}", rec.errors)),
        });
    }
    Ok(())
}

/// A self-signed certificate for `localhost` and `127.0.0.1`, written as PEM files into the
/// environment's temp dir.
fn certificate(env: &Env) -> Result<(PathBuf, PathBuf), TrainError> {
    let names = vec!["localhost".to_string(), "127.0.0.1".to_string()];
    let ck =
        rcgen::generate_simple_self_signed(names).map_err(|e| TrainError::Cert(e.to_string()))?;
    let cert = env.write("cert.pem", &ck.cert.pem())?;
    let key = env.write("key.pem", &ck.signing_key.serialize_pem())?;
    Ok((cert, key))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A phase whose requests fail is an error naming the phase, not a short profile.
    #[test]
    fn a_failing_phase_fails_the_training() {
        // Bound, never listening: every connect is refused. (The integration tests'
        // `dead_port` helper cannot be included by path from a module inside `src/`.)
        let socket =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        socket.bind(&any.into()).unwrap();
        let dead = socket.local_addr().unwrap().as_socket().unwrap();
        let phase = Phase::get("refused", 2, Some(50.0));
        let err = load_phase(&phase, dead, Duration::from_millis(200)).unwrap_err();
        match &err {
            TrainError::Failed { phase, errors, .. } => {
                assert_eq!(*phase, "refused");
                assert!(*errors > 0, "{err}");
            }
            other => panic!("expected Failed, got {other}"),
        }
        assert!(
            err.to_string().contains("missing from the profile"),
            "{err}"
        );
    }
}
