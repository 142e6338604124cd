//! Human output of a run, laid out like wrk2's `--latency` report.

use std::fmt::Write;

use hdrhistogram::Histogram;

use crate::load::Report;
use crate::stats::{PERCENTILES, ms_at};

/// Formats milliseconds with a unit that keeps 2 decimals readable. The unit is chosen
/// after rounding: 0.9996 ms is `1.00ms`, not `1000us`, and 999.996 ms is `1.00s`.
pub fn fmt_ms(ms: f64) -> String {
    if (ms * 100.0).round() >= 100_000.0 {
        format!("{:.2}s", ms / 1000.0)
    } else if (ms * 1000.0).round() >= 1000.0 {
        format!("{ms:.2}ms")
    } else {
        format!("{:.0}us", ms * 1000.0)
    }
}

fn distribution(out: &mut String, title: &str, h: &Histogram<u64>) {
    let _ = writeln!(out, "  Latency Distribution (HdrHistogram - {title})");
    for p in PERCENTILES {
        let _ = writeln!(out, "  {p:>7.3}%  {:>10}", fmt_ms(ms_at(h, p)));
    }
    let _ = writeln!(
        out,
        "  #[Mean = {:.3} ms, StdDeviation = {:.3} ms, Max = {:.3} ms, Count = {}]",
        h.mean() / 1000.0,
        h.stdev() / 1000.0,
        ms_at(h, 100.0),
        h.len()
    );
}

/// The full human report of a run.
pub fn report(r: &Report, urls: &[String], by_index: bool) -> String {
    let mut out = String::new();
    let mode = match r.rate {
        Some(rate) => format!("open loop at {rate} requests/s"),
        None => "closed loop".to_string(),
    };
    let _ = writeln!(
        out,
        "Measured {:.2}s @ {}\n  {} thread(s) and {} connection(s), {mode}",
        r.measured.as_secs_f64(),
        urls.join(" "),
        r.threads,
        r.connections
    );
    let rec = &r.recorder;
    if r.rate.is_some() {
        distribution(
            &mut out,
            "Recorded Latency, corrected for coordinated omission",
            &rec.corrected,
        );
        distribution(
            &mut out,
            "Uncorrected Latency, from the actual send",
            &rec.uncorrected,
        );
        distribution(
            &mut out,
            "Corrected Latency without the generator's lag",
            &rec.excl_lag,
        );
    } else {
        distribution(&mut out, "Recorded Latency", &rec.corrected);
    }
    if r.rate.is_some() && !rec.lag.is_empty() {
        let _ = writeln!(
            out,
            "  Generator lag (actual send after it could start, included above): p50 {}, p99 {}, max {}",
            fmt_ms(ms_at(&rec.lag, 50.0)),
            fmt_ms(ms_at(&rec.lag, 99.0)),
            fmt_ms(ms_at(&rec.lag, 100.0))
        );
    }
    if by_index && !rec.by_index.is_empty() {
        let _ = writeln!(
            out,
            "  Latency by request index on a connection (corrected)"
        );
        let _ = writeln!(
            out,
            "  {:>6} {:>10} {:>10} {:>10} {:>10}",
            "index", "count", "p50", "p99", "max"
        );
        for (i, h) in rec
            .by_index
            .iter()
            .enumerate()
            .filter(|(_, h)| !h.is_empty())
        {
            let _ = writeln!(
                out,
                "  {:>6} {:>10} {:>10} {:>10} {:>10}",
                i + 1,
                h.len(),
                fmt_ms(ms_at(h, 50.0)),
                fmt_ms(ms_at(h, 99.0)),
                fmt_ms(ms_at(h, 100.0))
            );
        }
    }
    if !rec.per_second.is_empty() {
        let p99s: Vec<String> = rec
            .per_second
            .iter()
            .map(|h| fmt_ms(ms_at(h, 99.0)))
            .collect();
        let _ = writeln!(out, "  p99 per second: {}", p99s.join(" "));
    }
    let e = &rec.errors;
    let _ = writeln!(
        out,
        "  {} requests sent, {} responses, {} ok",
        r.sent, rec.responses, rec.ok
    );
    if e.total() > 0 {
        let _ = writeln!(
            out,
            "  Errors: connect {}, tls {}, timeout {}, status {}, io {}, protocol {}",
            e.connect, e.tls, e.timeout, e.status, e.io, e.protocol
        );
    }
    if let Some(why) = &r.tls_error {
        let _ = writeln!(out, "  TLS handshake failed: {why}");
    }
    let _ = writeln!(out, "Requests/sec: {:>10.2}", r.rps());
    out
}

#[cfg(test)]
mod tests {
    use super::fmt_ms;

    /// The unit is chosen after rounding: no `1000us`, no `1000.00ms`.
    #[test]
    fn the_unit_follows_the_rounded_value() {
        assert_eq!(fmt_ms(0.0421), "42us");
        assert_eq!(fmt_ms(0.9994), "999us");
        assert_eq!(fmt_ms(0.9996), "1.00ms");
        assert_eq!(fmt_ms(1.234), "1.23ms");
        assert_eq!(fmt_ms(999.994), "999.99ms");
        assert_eq!(fmt_ms(999.996), "1.00s");
        assert_eq!(fmt_ms(1500.0), "1.50s");
    }
}
