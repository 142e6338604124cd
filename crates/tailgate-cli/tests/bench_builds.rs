//! The `tailgate bench` commands that need the whole binary (they start its gateway): the
//! training workload of the profile-guided build, and a second build measured beside the
//! first (`--compare`).
#![allow(clippy::unwrap_used)]

use std::process::Command;
use std::time::Duration;

#[path = "../../tailgate-bench/tests/common/run_limited.rs"]
mod run_limited;
use run_limited::run_limited;

const BIN: &str = env!("CARGO_BIN_EXE_tailgate");

/// Every phase of the training is served without an error, the scraper got `/metrics`, and
/// both gateways stopped cleanly on SIGTERM (an instrumented build writes its profile then).
/// A phase that breaks (a config field renamed, a route that no longer matches) fails this.
#[test]
fn the_training_workload_is_served_without_errors() {
    let mut cmd = Command::new(BIN);
    cmd.args(["bench", "train", "--phase", "300ms"]);
    let out = run_limited(cmd, Duration::from_secs(180));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let phases = [
        "h1 keep-alive, closed loop",
        "h1 keep-alive, 5000 req/s over 50 connections",
        "h1 keep-alive, 2000 req/s over 500 connections",
        "h1 POST, 1 KiB body",
        "h1 POST, 64 KiB body",
        "h1 with a consumer header",
        "h2c from the client",
        "TLS, http/1.1",
        "TLS, h2",
        "HTTP/2 upstream",
        "upstream closing every 80 requests",
        "h1 with the JSON access log",
    ];
    for phase in phases {
        let line = stderr
            .lines()
            .find(|l| l.trim_start().starts_with(phase))
            .unwrap_or_else(|| panic!("no line for {phase:?}:\n{stderr}"));
        let answered: u64 = line[phase.len() + 2..]
            .split_whitespace()
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no count in {line:?}"));
        assert!(answered > 0, "{line}");
    }
    let scraped = stderr
        .lines()
        .find_map(|l| l.trim().strip_prefix("/metrics scraped "))
        .and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no scrape count:\n{stderr}"));
    assert!(scraped >= 1, "{stderr}");
    assert!(stderr.contains("training done"), "{stderr}");
}

/// A build that notes each command it is started with in `log`, then runs this binary:
/// which build a scenario started is read back from the log.
fn noting_build(dir: &std::path::Path, name: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let log = dir.join(format!("{name}.log"));
    let exe = dir.join(name);
    let script = format!(
        "#!/bin/sh\necho \"$*\" >> '{}'\nexec '{BIN}' \"$@\"\n",
        log.display()
    );
    std::fs::write(&exe, script).unwrap();
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    (exe, log)
}

/// `--tailgate PATH` is the build measured as `tailgate`, and `--compare NAME=PATH` another
/// build measured as its own target, through the same scenario; this binary stays the
/// upstream. Each build here is a script that notes how it was started, then runs this
/// binary.
#[test]
fn the_measured_and_compared_builds_are_the_ones_named() {
    let dir = tempfile::Builder::new()
        .prefix("tailgate-builds-")
        .tempdir()
        .unwrap();
    let (measured, measured_log) = noting_build(dir.path(), "measured");
    let (second, second_log) = noting_build(dir.path(), "second");
    let mut cmd = Command::new(BIN);
    cmd.args([
        "bench",
        "scenario",
        "keepalive-churn",
        "--duration",
        "1s",
        "--warmup",
        "0s",
        "--rate",
        "200",
        "--connections",
        "4",
        "--rounds",
        "1",
        "--no-pin",
        "--json",
        "--tailgate",
    ])
    .arg(&measured)
    .arg("--compare")
    .arg(format!("second-build={}", second.display()));
    let out = run_limited(cmd, Duration::from_secs(180));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = v["results"].as_array().unwrap();
    let row = |target: &str| {
        rows.iter()
            .find(|r| r["target"] == target)
            .unwrap_or_else(|| panic!("no {target} row in {v}"))
    };
    for target in ["tailgate", "second-build"] {
        let r = row(target);
        assert_eq!(
            r["variant"], "open-200rps-4c+closing-upstream",
            "{target}: {r}"
        );
        assert_eq!(r["errors"], 0, "{target}: {r}");
        assert!(r["rps"].as_f64().unwrap() > 100.0, "{target}: {r}");
        assert!(r["cpu_us_per_request"].as_f64().unwrap() > 0.0, "{r}");
    }
    // Only tailgate itself is measured against the never-closing upstream (its baseline).
    let second_rows = rows
        .iter()
        .filter(|r| r["target"] == "second-build")
        .count();
    assert_eq!(second_rows, 1, "{v}");
    // The measured build served both of tailgate's gateways (closing and never-closing
    // upstream), the compared one its own; neither was an upstream.
    let started = |log: &std::path::Path| std::fs::read_to_string(log).unwrap_or_default();
    let (m, s) = (started(&measured_log), started(&second_log));
    assert_eq!(m.matches("serve --config").count(), 2, "{m}");
    assert_eq!(s.matches("serve --config").count(), 1, "{s}");
    let bench_runs = |log: &str| log.lines().filter(|l| l.starts_with("bench ")).count();
    assert_eq!(bench_runs(&m) + bench_runs(&s), 0, "{m}{s}");
}
