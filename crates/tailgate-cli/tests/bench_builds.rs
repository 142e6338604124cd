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

/// `--compare NAME=PATH` measures another build as its own target, through the same
/// scenario as `tailgate`: here the same binary under a second name.
#[test]
fn a_compared_build_is_measured_as_its_own_target() {
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
        "--compare",
    ])
    .arg(format!("second-build={BIN}"));
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
    let second = rows
        .iter()
        .filter(|r| r["target"] == "second-build")
        .count();
    assert_eq!(second, 1, "{v}");
}

/// The binary says how it was built, for the benchmark report's "Builds" line.
#[test]
fn version_says_which_build() {
    let out = Command::new(BIN).arg("--version").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    let pgo = option_env!("TAILGATE_PGO").is_some();
    assert_eq!(
        text.trim(),
        if pgo {
            concat!(
                "tailgate ",
                env!("CARGO_PKG_VERSION"),
                " (profile-guided build)"
            )
        } else {
            concat!("tailgate ", env!("CARGO_PKG_VERSION"))
        }
    );
}
