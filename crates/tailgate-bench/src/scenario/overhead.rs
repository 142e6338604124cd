//! `overhead`: what a proxy costs over a direct connection to a fast upstream.
//!
//! direct, tailgate, nginx and HAProxy in front of one `tailgate bench upstream` (110-byte
//! responses): closed-loop maximum throughput, open-loop latency at a fixed rate every target
//! sustains, and the same rate over many (500+) connections. nginx runs twice: as a bare
//! reverse proxy (`nginx`), and doing the header work tailgate always does (`nginx-fwd`:
//! forwarding headers, request id).

use std::path::Path;

use super::{
    Options, Outcome, ScenarioError, Target, check, measure_rounds, new_env, peers, start_proxies,
};

pub fn run(opts: &Options, tailgate_exe: &Path) -> Result<Outcome, ScenarioError> {
    let mut notes = Vec::new();
    let mut env = new_env(opts, tailgate_exe, &mut notes)?;
    let up = peers::upstream(&mut env, "upstream", 110, None)?;
    let mut targets = vec![Target {
        name: "direct".into(),
        variant_suffix: "",
        addr: up,
        upstream: None,
    }];
    start_proxies(&mut env, up, "", &opts.compare, &mut targets, &mut notes);
    // nginx again, doing the same header work as tailgate (forwarding headers, request id).
    if peers::installed(peers::NGINX) {
        match peers::nginx_forwarding(&mut env, "nginx-fwd", up) {
            Ok(addr) => targets.push(Target {
                name: "nginx-fwd".into(),
                variant_suffix: "",
                addr,
                upstream: Some(up),
            }),
            Err(e) => notes.push(format!("nginx-fwd: not measured: {e}")),
        }
    }
    for n in &notes {
        eprintln!("note: {n}");
    }

    let c = opts.connections;
    let many = opts.many_connections;
    let rate = opts.rate;
    let closed = format!("closed-{c}c");
    let open = format!("open-{rate}rps-{c}c");
    let open_many = format!("open-{rate}rps-{many}c");
    let runs: [(&str, usize, Option<f64>); 3] = [
        (&closed, c, None),
        (&open, c, Some(rate)),
        (&open_many, many, Some(rate)),
    ];
    let mut measured = Vec::new();
    // Variant by variant, all targets back to back and interleaved over the rounds, so drift
    // on the machine hits all alike.
    for (variant, conns, rate) in runs {
        measured.extend(measure_rounds(&targets, variant, conns, rate, opts)?);
    }
    let mut outcome = Outcome {
        scenario: "overhead".into(),
        measured,
        checks: Vec::new(),
        notes,
        rounds: opts.rounds,
    };
    let get = |o: &Outcome, t: &str, v: &str| o.row(t, v).cloned();
    let (tc, nc) = (
        get(&outcome, "tailgate", &closed),
        get(&outcome, "nginx", &closed),
    );
    let (to, no) = (
        get(&outcome, "tailgate", &open),
        get(&outcome, "nginx", &open),
    );
    let (tm, nm) = (
        get(&outcome, "tailgate", &open_many),
        get(&outcome, "nginx", &open_many),
    );
    let (fc, fo, fm) = (
        get(&outcome, "nginx-fwd", &closed),
        get(&outcome, "nginx-fwd", &open),
        get(&outcome, "nginx-fwd", &open_many),
    );
    outcome.checks = vec![
        check(
            format!("tailgate rps ÷ nginx rps ({closed}) ≥"),
            tc.as_ref().map(|r| r.rps),
            nc.as_ref().map(|r| r.rps),
            1.0,
            false,
        )
        .sides(tc.as_ref(), nc.as_ref()),
        check(
            format!("tailgate p99 ÷ nginx p99 ({open}) ≤"),
            to.as_ref().map(|r| r.latency_ms.p99),
            no.as_ref().map(|r| r.latency_ms.p99),
            1.0,
            true,
        )
        .by_round(to.as_ref(), no.as_ref()),
        check(
            format!("tailgate p99 ÷ nginx p99 ({open_many}) ≤"),
            tm.as_ref().map(|r| r.latency_ms.p99),
            nm.as_ref().map(|r| r.latency_ms.p99),
            1.0,
            true,
        )
        .by_round(tm.as_ref(), nm.as_ref()),
        check(
            format!("tailgate rps ÷ nginx-fwd rps, same header work ({closed}) ≥"),
            tc.as_ref().map(|r| r.rps),
            fc.as_ref().map(|r| r.rps),
            1.0,
            false,
        )
        .sides(tc.as_ref(), fc.as_ref()),
        check(
            format!("tailgate p99 ÷ nginx-fwd p99, same header work ({open}) ≤"),
            to.as_ref().map(|r| r.latency_ms.p99),
            fo.as_ref().map(|r| r.latency_ms.p99),
            1.0,
            true,
        )
        .by_round(to.as_ref(), fo.as_ref()),
        check(
            format!("tailgate p99 ÷ nginx-fwd p99, same header work ({open_many}) ≤"),
            tm.as_ref().map(|r| r.latency_ms.p99),
            fm.as_ref().map(|r| r.latency_ms.p99),
            1.0,
            true,
        )
        .by_round(tm.as_ref(), fm.as_ref()),
    ];
    Ok(outcome)
}
