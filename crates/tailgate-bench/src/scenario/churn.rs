//! `keepalive-churn`: the upstream closes its connection every N requests (seed 004: a spike
//! every 80th request). direct, tailgate, nginx and HAProxy against the closing upstream, and
//! tailgate (and direct) against a never-closing one — tailgate's own baseline: the goal is
//! p99 and p99.9 with the closing upstream ≤ 1.1 × the never-closing ones.
//! Latency by request index on the generator's connections is reported too (direct shows the
//! reconnect at index 1 after every N-th response).

use std::fmt::Write;
use std::path::Path;

use super::{
    Options, Outcome, ScenarioError, Target, check, measure_rounds, new_env, peers, start_proxies,
};
use crate::output::text::fmt_ms;
use crate::stats::ms_at;

pub fn run(opts: &Options, tailgate_exe: &Path) -> Result<Outcome, ScenarioError> {
    let mut notes = Vec::new();
    let mut env = new_env(opts, tailgate_exe, &mut notes)?;
    let closing = peers::upstream(&mut env, "upstream-closing", 110, Some(opts.close_every))?;
    let steady = peers::upstream(&mut env, "upstream-steady", 110, None)?;
    let closing_suffix: &'static str = "+closing-upstream";
    let steady_suffix: &'static str = "+never-closing-upstream";
    let mut targets = vec![Target {
        name: "direct".into(),
        variant_suffix: closing_suffix,
        addr: closing,
        upstream: None,
    }];
    start_proxies(
        &mut env,
        closing,
        closing_suffix,
        &opts.compare,
        &mut targets,
        &mut notes,
    );
    targets.push(Target {
        name: "direct".into(),
        variant_suffix: steady_suffix,
        addr: steady,
        upstream: None,
    });
    let mut steady_proxies = Vec::new();
    let mut steady_notes = Vec::new();
    start_proxies(
        &mut env,
        steady,
        steady_suffix,
        &[],
        &mut steady_proxies,
        &mut steady_notes,
    );
    // Only tailgate is measured against the never-closing upstream (its own baseline).
    targets.extend(steady_proxies.into_iter().filter(|t| t.name == "tailgate"));
    notes.extend(
        steady_notes
            .into_iter()
            .filter(|n| n.starts_with("tailgate")),
    );
    for n in &notes {
        eprintln!("note: {n}");
    }

    let rate = opts.rate;
    let c = opts.connections;
    let variant = format!("open-{rate}rps-{c}c");
    let measured = measure_rounds(&targets, &variant, c, Some(rate), opts)?;
    let mut outcome = Outcome {
        scenario: "keepalive-churn".into(),
        measured,
        checks: Vec::new(),
        notes,
        rounds: opts.rounds,
    };
    let closing_v = format!("{variant}{closing_suffix}");
    let steady_v = format!("{variant}{steady_suffix}");
    let tc = outcome.row("tailgate", &closing_v).cloned();
    let ts = outcome.row("tailgate", &steady_v).cloned();
    let nc = outcome.row("nginx", &closing_v).cloned();
    outcome.checks = vec![
        check(
            "tailgate p99 closing ÷ never-closing upstream ≤".into(),
            tc.as_ref().map(|r| r.latency_ms.p99),
            ts.as_ref().map(|r| r.latency_ms.p99),
            1.1,
            true,
        )
        .by_round(tc.as_ref(), ts.as_ref()),
        check(
            "tailgate p99.9 closing ÷ never-closing upstream ≤".into(),
            tc.as_ref().map(|r| r.latency_ms.p99_9),
            ts.as_ref().map(|r| r.latency_ms.p99_9),
            1.1,
            true,
        )
        .sides(tc.as_ref(), ts.as_ref()),
        check(
            "tailgate p99 ÷ nginx p99 (closing upstream) ≤".into(),
            tc.as_ref().map(|r| r.latency_ms.p99),
            nc.as_ref().map(|r| r.latency_ms.p99),
            1.0,
            true,
        )
        .by_round(tc.as_ref(), nc.as_ref()),
    ];
    Ok(outcome)
}

/// Latency by request index on the generator's connections, per target: index 1 (includes a
/// reconnect), index N (the response carrying `Connection: close`) and the worst other index.
pub fn by_index_table(o: &Outcome, close_every: u64) -> String {
    let mut out = String::new();
    let n = close_every as usize;
    let cap = crate::load::index_cap(close_every);
    let _ = writeln!(
        out,
        "latency by request index on a connection (p99 of the first {cap} requests of each, \
         counted from its open, as far as they fell after the warm-up: `–` where none did)\n"
    );
    let _ = writeln!(
        out,
        "| target | variant | index 1 | index {n} | worst other index | highest index recorded |"
    );
    let _ = writeln!(out, "|---|---|--:|--:|--:|--:|");
    for m in &o.measured {
        let bi = &m.report.recorder.by_index;
        let p99 = |i: usize| {
            bi.get(i - 1)
                .filter(|h| !h.is_empty())
                .map(|h| fmt_ms(ms_at(h, 99.0)))
        };
        let worst = bi
            .iter()
            .enumerate()
            .filter(|(i, h)| *i != 0 && *i + 1 != n && !h.is_empty())
            .map(|(i, h)| (ms_at(h, 99.0), i + 1))
            .fold(None, |acc: Option<(f64, usize)>, x| match acc {
                Some(a) if a.0 >= x.0 => Some(a),
                _ => Some(x),
            });
        let highest = bi.iter().rposition(|h| !h.is_empty()).map_or(0, |i| i + 1);
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            m.row.target,
            m.row.variant,
            p99(1).unwrap_or_else(|| "–".into()),
            p99(n).unwrap_or_else(|| "–".into()),
            worst.map_or("–".into(), |(v, i)| format!("{} (#{i})", fmt_ms(v))),
            highest
        );
    }
    out
}

/// p99 by request index (first `2 × close_every` indices) for every target, as an SVG.
pub fn by_index_chart(
    o: &Outcome,
    close_every: u64,
    dir: &Path,
) -> std::io::Result<std::path::PathBuf> {
    let upto = (2 * close_every as usize).max(10);
    let series: Vec<(String, Vec<f64>)> = o
        .measured
        .iter()
        .map(|m| {
            let mut v = crate::output::svg::p99_by_index(&m.report.recorder.by_index);
            v.truncate(upto);
            (format!("{} ({})", m.row.target, m.row.variant), v)
        })
        .collect();
    let p = dir.join("keepalive-churn-by-index.svg");
    crate::output::svg::lines(
        &p,
        "keepalive-churn: p99 by request index on a connection",
        "request index",
        1,
        &series,
    )?;
    Ok(p)
}
