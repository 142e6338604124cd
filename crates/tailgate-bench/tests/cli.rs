//! The `tailgate-bench` binary (= `tailgate bench`): usage errors, dead targets, JSON shapes.

#![allow(clippy::unwrap_used)]

mod common;

use common::{bench, run_limited};
use std::time::Duration;

use serde_json::Value;

#[test]
fn bad_arguments_exit_2_with_a_message() {
    let cases: &[&[&str]] = &[
        &["run", "http://127.0.0.1:1/"], // neither --rate nor --closed
        &["run", "http://127.0.0.1:1/", "-r", "10", "--closed"], // both
        &["run", "http://127.0.0.1:1/", "--closed", "-c", "0"],
        &["run", "ftp://127.0.0.1:1/", "--closed"],
        &["run", "http://127.0.0.1:1/", "-r", "-5"],
        &["run", "http://127.0.0.1:1/", "-r", "0"],
        // An interval past what the clock holds, and a duration past it (both panicked).
        &["run", "http://127.0.0.1:1/", "-r", "1e-20"],
        &[
            "run",
            "http://127.0.0.1:1/",
            "--closed",
            "-d",
            "300000000000y",
        ],
        &[
            "run",
            "http://127.0.0.1:1/",
            "-r",
            "10",
            "--timeout",
            "300000000000y",
        ],
        &["run", "http://127.0.0.1:1/", "--closed", "-d", "soon"],
        &["run", "http://127.0.0.1:1/", "--closed", "-H", "no-colon"],
        &["run", "http://127.0.0.1:1/", "--closed", "-n", "0"],
        &[
            "run",
            "http://127.0.0.1:1/",
            "--closed",
            "-c",
            "2",
            "-t",
            "3",
        ],
        &["scenario", "nope"],
        &["upstream"],
        &["frobnicate"],
    ];
    for args in cases {
        let out = bench().args(*args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("error"), "{args:?}: no message: {stderr}");
    }
}

/// Bad `--compare`, `--tailgate` and `train` arguments are refused before anything starts,
/// each saying what is wrong.
#[test]
fn bad_build_arguments_say_what_is_wrong() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["scenario", "overhead", "--compare", "no-equals-sign"],
            "expected NAME=PATH",
        ),
        (
            &["scenario", "overhead", "--compare", "nginx=/bin/sh"],
            "is a target of the scenarios already",
        ),
        (
            &["scenario", "overhead", "--compare", "two words=/bin/sh"],
            "the name must be letters",
        ),
        (
            &[
                "scenario",
                "overhead",
                "--compare",
                "b=/nonexistent/tailgate",
            ],
            "is not a file",
        ),
        (
            &[
                "scenario",
                "overhead",
                "--compare",
                "b=/bin/sh",
                "--compare",
                "b=/bin/sh",
            ],
            "is named twice",
        ),
        (
            &["scenario", "metrics-scrape", "--compare", "b=/bin/sh"],
            "--compare does not apply to metrics-scrape",
        ),
        (
            &["report", "--tailgate", "/nonexistent/tailgate"],
            "--tailgate: /nonexistent/tailgate is not a file",
        ),
        (&["train", "--phase", "0s"], "--phase must be more than 0"),
        (
            &["train", "--profile-file", "/tmp/gateway.profraw"],
            "needs %p",
        ),
    ];
    for (args, why) in cases {
        let mut cmd = bench();
        cmd.args(*args);
        assert_refused(cmd, args, why);
    }
}

/// Runs `cmd` (made with `args`) and asserts it exits 2 saying `why` on stderr.
fn assert_refused(cmd: std::process::Command, args: &[&str], why: &str) {
    let out = run_limited(cmd, Duration::from_secs(20));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
    assert!(
        stderr.contains(why),
        "{args:?}: expected {why:?} in: {stderr}"
    );
}

/// `report --check` validates the options and stops there: bad ones exit 2 saying why,
/// good ones exit 0 at once, with no README or results written.
#[test]
fn report_check_validates_the_options_and_writes_nothing() {
    let tmp = tempfile::Builder::new()
        .prefix("tg-bench-report-check-")
        .tempdir()
        .unwrap();
    let readme = tmp.path().join("README.md");
    let out_dir = tmp.path().join("bench");
    let paths = [
        "--readme",
        readme.to_str().unwrap(),
        "--out",
        out_dir.to_str().unwrap(),
    ];
    let bad: &[(&[&str], &str)] = &[
        (&["--duration", "0s"], "--duration must be more than 0"),
        (&["--rounds", "0"], "--rounds"),
        (&["--rate", "-1"], "error"),
        (&["--rate", "1e-20"], "at least 0.001"),
        (&["--duration", "300000000000y"], "at most 365days"),
        (&["--tailgate", "/nonexistent/tailgate"], "is not a file"),
    ];
    for (args, why) in bad {
        let mut cmd = bench();
        cmd.arg("report").arg("--check").args(paths).args(*args);
        assert_refused(cmd, args, why);
    }
    let mut cmd = bench();
    cmd.args(["report", "--check", "--rounds", "9", "--duration", "4s"])
        .args(paths);
    let out = run_limited(cmd, Duration::from_secs(20));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!readme.exists(), "--check wrote the README");
    assert!(!out_dir.exists(), "--check wrote results");
}

#[test]
fn dead_target_ends_on_time_with_connect_errors_and_exits_1() {
    let dead = common::dead_port();
    let url = format!("http://127.0.0.1:{}/", dead.port());
    let mut cmd = bench();
    cmd.args([
        "run", &url, "-r", "100", "-d", "1s", "--warmup", "0s", "--json",
    ]);
    let out = run_limited(cmd, Duration::from_secs(30));
    // Nothing succeeded: exit 1, saying so, with the report still printed.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("no request succeeded"), "{stderr}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["errors"]["connect"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(v["responses"], 0);
}

#[test]
fn run_json_has_the_documented_fields() {
    let up = common::start(common::Behaviour::default());
    let mut cmd = bench();
    cmd.args([
        "run",
        &up.url(),
        "--closed",
        "-c",
        "2",
        "-n",
        "100",
        "--warmup",
        "0s",
        "--json",
    ]);
    let out = run_limited(cmd, Duration::from_secs(30));
    assert!(out.status.success());
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["sent"], 100);
    assert_eq!(v["ok"], 100);
    for k in ["p50", "p90", "p99", "p99.9", "p99.99", "max"] {
        assert!(v["latency_ms"][k].is_number(), "{k} in {v}");
    }
    for k in ["50", "75", "90", "99", "99.9", "99.99", "99.999", "100"] {
        assert!(v["corrected_ms"][k].is_number(), "{k} in {v}");
        assert!(v["uncorrected_ms"][k].is_number(), "{k} in {v}");
        assert!(v["excl_lag_ms"][k].is_number(), "{k} in {v}");
    }
    for k in ["connect", "timeout", "status", "io", "protocol"] {
        assert_eq!(v["errors"][k], 0, "{k} in {v}");
    }
}

#[test]
fn run_writes_svg_charts_and_the_human_table() {
    let up = common::start(common::Behaviour::default());
    let tmp = tempfile::Builder::new()
        .prefix("tg-bench-cli-svg-")
        .tempdir()
        .unwrap();
    // A directory the binary creates itself.
    let dir = tmp.path().join("svg");
    let mut cmd = bench();
    cmd.args([
        "run",
        &up.url(),
        "-r",
        "200",
        "-d",
        "1s",
        "--warmup",
        "0s",
        "--by-index",
        "--svg",
    ])
    .arg(&dir);
    let out = run_limited(cmd, Duration::from_secs(30));
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("Latency Distribution"), "{text}");
    assert!(text.contains(" 99.999%"), "{text}");
    assert!(text.contains("Requests/sec"), "{text}");
    for f in ["spectrum.svg", "over-time.svg", "by-index.svg"] {
        let s = std::fs::read_to_string(dir.join(f)).unwrap();
        assert!(s.starts_with("<svg"), "{f}");
    }
}

/// The scenario JSON document, through this binary: it has no `serve`, so tailgate is skipped
/// with a note and its goals are unmet with a null value; direct, nginx and HAProxy (when
/// installed) are measured.
#[test]
fn scenario_json_has_the_documented_shape() {
    let mut cmd = bench();
    cmd.args([
        "scenario",
        "overhead",
        "--duration",
        "1s",
        "--warmup",
        "0s",
        "--rate",
        "200",
        "--connections",
        "4",
        "--many-connections",
        "20",
        "--rounds",
        "2",
        "--no-pin",
        "--json",
    ]);
    let out = run_limited(cmd, Duration::from_secs(120));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("tailgate: not measured"), "{stderr}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let obj = v.as_object().unwrap();
    assert_eq!(obj.len(), 4, "{v}");
    assert_eq!(v["scenario"], "overhead");
    assert_eq!(v["rounds"], 2);
    assert!(stderr.contains("round 2/2"), "{stderr}");
    let results = v["results"].as_array().unwrap();
    assert!(results.iter().any(|r| r["target"] == "direct"));
    for r in results {
        let open = r["variant"].as_str().unwrap().starts_with("open-");
        let direct = r["target"] == "direct";
        // Open-loop rows also carry the p99 without the generator's lag; every row the
        // upstream's CPU per request, proxies their own and its ratio to the upstream's.
        let fields = 8 + usize::from(open) + if direct { 1 } else { 3 };
        assert_eq!(r.as_object().unwrap().len(), fields, "{r}");
        let up_cpu = r["upstream_cpu_us_per_request"].as_f64().unwrap();
        assert!(up_cpu > 0.0, "{r}");
        if !direct {
            let cpu = r["cpu_us_per_request"].as_f64().unwrap();
            let ratio = r["cpu_per_upstream_cpu"].as_f64().unwrap();
            assert!(cpu > 0.0 && ratio > 0.0, "{r}");
        }
        let range = r["p99_range_ms"].as_array().unwrap();
        let (lo, hi) = (range[0].as_f64().unwrap(), range[1].as_f64().unwrap());
        let p99 = r["latency_ms"]["p99"].as_f64().unwrap();
        assert!(range.len() == 2 && lo <= p99 && p99 <= hi, "{r}");
        // Each of the 2 rounds' own p99, the range's ends among them.
        let rounds: Vec<f64> = r["p99_rounds_ms"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(rounds.len(), 2, "{r}");
        assert!(rounds.contains(&lo) && rounds.contains(&hi), "{r}");
        // And each round's errors beside them, summing to the row's.
        let errors: Vec<u64> = r["errors_rounds"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        assert_eq!(errors.len(), 2, "{r}");
        assert_eq!(
            errors.iter().sum::<u64>(),
            r["errors"].as_u64().unwrap(),
            "{r}"
        );
        if open {
            // Round by round it is at most the p99 with the lag, so their medians are too.
            let excl = r["p99_excl_lag_ms"].as_f64().unwrap();
            assert!(0.0 < excl && excl <= p99, "{r}");
        }
        assert!(
            ["tailgate", "direct", "nginx", "haproxy", "nginx-fwd"]
                .contains(&r["target"].as_str().unwrap())
        );
        assert!(r["variant"].is_string() && r["rps"].is_number() && r["errors"].is_u64());
        let l = r["latency_ms"].as_object().unwrap();
        let keys: Vec<&str> = l.keys().map(String::as_str).collect();
        assert_eq!(keys.len(), 6);
        for k in ["p50", "p90", "p99", "p99.9", "p99.99", "max"] {
            assert!(l[k].is_number(), "{k} in {r}");
        }
        assert_eq!(r["errors"], 0, "{r}");
    }
    // 3 variants per measured target.
    assert_eq!(results.len() % 3, 0);
    let targets = v["targets"].as_array().unwrap();
    assert!(!targets.is_empty());
    for t in targets {
        assert_eq!(t.as_object().unwrap().len(), 4, "{t}");
        assert!(t["name"].is_string() && t["goal"].is_number() && t["met"].is_boolean());
        assert!(t["value"].is_null(), "tailgate was not measured: {t}");
        assert_eq!(t["met"], false);
    }
}
