//! JSON output of a `tailgate bench run`.

use serde_json::{Value, json};

use crate::load::Report;
use crate::stats::{LatencySummary, PERCENTILES, ms_at};
use hdrhistogram::Histogram;

fn distribution(h: &Histogram<u64>) -> Value {
    let pairs: serde_json::Map<String, Value> = PERCENTILES
        .iter()
        .map(|&p| (format!("{p}"), json!(ms_at(h, p))))
        .collect();
    Value::Object(pairs)
}

/// One JSON document describing a run. Latencies are in milliseconds.
pub fn report(r: &Report, urls: &[String]) -> Value {
    let rec = &r.recorder;
    let by_index: Vec<Value> = rec
        .by_index
        .iter()
        .enumerate()
        .filter(|(_, h)| !h.is_empty())
        .map(|(i, h)| json!({"index": i + 1, "count": h.len(), "p50": ms_at(h, 50.0), "p99": ms_at(h, 99.0), "max": ms_at(h, 100.0)}))
        .collect();
    let per_second: Vec<Value> = rec
        .per_second
        .iter()
        .enumerate()
        .map(|(s, h)| json!({"second": s, "count": h.len(), "p50": ms_at(h, 50.0), "p99": ms_at(h, 99.0), "max": ms_at(h, 100.0)}))
        .collect();
    json!({
        "urls": urls,
        "mode": if r.rate.is_some() { "open" } else { "closed" },
        "rate": r.rate,
        "connections": r.connections,
        "threads": r.threads,
        "measured_s": r.measured.as_secs_f64(),
        "sent": r.sent,
        "responses": rec.responses,
        "ok": rec.ok,
        "rps": r.rps(),
        "errors": rec.errors,
        "error_total": rec.errors.total(),
        "tls_error": r.tls_error,
        "latency_ms": LatencySummary::of(&rec.corrected),
        "corrected_ms": distribution(&rec.corrected),
        "uncorrected_ms": distribution(&rec.uncorrected),
        "excl_lag_ms": distribution(&rec.excl_lag),
        "generator_lag_ms": {"p50": ms_at(&rec.lag, 50.0), "p99": ms_at(&rec.lag, 99.0), "max": ms_at(&rec.lag, 100.0)},
        "by_index": by_index,
        "per_second": per_second,
    })
}
