//! The `[admin]` and `[metrics]` tables: where the admin plane listens, how the runtime lag
//! probe runs, and which per-consumer series exist.

use std::time::Duration;

use super::file::{RawAdmin, RawMetrics};
use super::validate::Checker;
use super::{AdminSettings, MetricsSettings};

/// Per-worker consumers tracked by default when `consumer_header` is set.
const DEFAULT_MAX_CONSUMERS: usize = 100_000;
/// The most a worker tracks: its index is allocated for all of them at start (about 40 MB).
const MAX_CONSUMERS: usize = 1_000_000;
/// Headers whose values are secrets, never to be published as label values.
const SECRET_HEADERS: [&str; 4] = [
    "authorization",
    "proxy-authorization",
    "cookie",
    "x-api-key",
];

pub(super) fn check(
    c: &mut Checker<'_>,
    admin: Option<&RawAdmin>,
    metrics: &RawMetrics,
) -> (Option<AdminSettings>, MetricsSettings) {
    let admin = admin.and_then(|a| {
        let address = c
            .address(&a.address, "admin.address".into())
            .filter(|ad| c.bindable(*ad, &a.address, "admin.address".into(), true));
        let found = c.errors_found();
        let lag_probe_interval = c.duration(
            &a.lag_probe_interval,
            "admin.lag_probe_interval".into(),
            Duration::from_millis(10),
        );
        if let Some(v) = &a.lag_probe_interval
            && !(Duration::from_millis(1)..=Duration::from_secs(10)).contains(&lag_probe_interval)
        {
            c.err(
                Some(v.span()),
                "admin.lag_probe_interval".into(),
                "must be between 1ms and 10s".into(),
                Some("\"10ms\" measures lag finely at negligible cost"),
            );
        }
        let stall_threshold = c.duration(
            &a.stall_threshold,
            "admin.stall_threshold".into(),
            Duration::from_secs(2),
        );
        // Checked on the effective values: a probe interval above the default threshold
        // would make every worker look stalled between two ticks.
        if stall_threshold < lag_probe_interval * 2 && c.errors_found() == found {
            let (span, field) = match (&a.stall_threshold, &a.lag_probe_interval) {
                (Some(v), _) => (Some(v.span()), "admin.stall_threshold"),
                (None, Some(v)) => (Some(v.span()), "admin.lag_probe_interval"),
                (None, None) => (None, "admin.stall_threshold"),
            };
            c.err(
                span,
                field.into(),
                format!(
                    "stall_threshold ({stall_threshold:?}) must be at least twice lag_probe_interval ({lag_probe_interval:?})"
                ),
                Some("keep the probe interval short (\"10ms\") and the threshold a few seconds (\"2s\")"),
            );
        }
        Some(AdminSettings {
            address: address?,
            lag_probe_interval,
            stall_threshold,
        })
    });

    let consumer_header = metrics.consumer_header.as_ref().and_then(|h| {
        match http::HeaderName::from_bytes(h.get_ref().as_bytes()) {
            Ok(n) if SECRET_HEADERS.contains(&n.as_str()) => {
                c.err(
                    Some(h.span()),
                    "metrics.consumer_header".into(),
                    format!("`{}` carries credentials; its values would be published in /metrics", h.get_ref()),
                    Some("name a header that identifies the consumer without being a secret, e.g. \"x-consumer-id\""),
                );
                None
            }
            Ok(n) => Some(n),
            Err(_) => {
                c.err(
                    Some(h.span()),
                    "metrics.consumer_header".into(),
                    format!("`{}` is not a header name", h.get_ref()),
                    Some("write a token such as \"x-consumer-id\""),
                );
                None
            }
        }
    });
    let max_consumers = match &metrics.max_consumers {
        Some(m) if *m.get_ref() == 0 || *m.get_ref() > MAX_CONSUMERS => {
            c.err(
                Some(m.span()),
                "metrics.max_consumers".into(),
                format!("must be between 1 and {MAX_CONSUMERS}"),
                Some("remove it for the default of 100000 per worker"),
            );
            DEFAULT_MAX_CONSUMERS
        }
        // Consumers are tracked only by `consumer_header`: a cap without it caps nothing,
        // and the file would say consumers are counted.
        Some(m) if metrics.consumer_header.is_none() => {
            c.err(
                Some(m.span()),
                "metrics.max_consumers".into(),
                "has no effect without metrics.consumer_header, which names the header consumers are counted by".into(),
                Some("set consumer_header = \"x-consumer-id\" (a header naming the consumer, not a secret: its values are published as labels), or remove max_consumers"),
            );
            DEFAULT_MAX_CONSUMERS
        }
        Some(m) => *m.get_ref(),
        None => DEFAULT_MAX_CONSUMERS,
    };
    (
        admin,
        MetricsSettings {
            consumer_header,
            max_consumers,
        },
    )
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::Config;

    const BASE: &str = "[[listener]]\naddress = \"127.0.0.1:0\"\n";

    /// `max_consumers` caps the consumers `consumer_header` tracks: without that header it
    /// would cap nothing, and is refused as a setting with no effect.
    #[test]
    fn max_consumers_without_a_consumer_header_is_refused() {
        let errs = Config::parse(
            Path::new("t.toml"),
            &format!("{BASE}[metrics]\nmax_consumers = 500\n"),
        )
        .expect_err("no effect")
        .to_string();
        assert!(
            errs.contains(
                "t.toml:4:17: metrics.max_consumers: has no effect without metrics.consumer_header"
            ),
            "{errs}"
        );
        let with =
            format!("{BASE}[metrics]\nconsumer_header = \"x-consumer\"\nmax_consumers = 500\n");
        let cfg = Config::parse(Path::new("t.toml"), &with).expect("with a header");
        assert_eq!(cfg.metrics.max_consumers, 500);
    }

    #[test]
    fn admin_and_metrics_errors_point_at_the_field() {
        let text = format!(
            "{BASE}[admin]\naddress = \"localhost:9901\"\nlag_probe_interval = \"20s\"\n[metrics]\nconsumer_header = \"x consumer\"\n"
        );
        let errs = Config::parse(Path::new("t.toml"), &text)
            .expect_err("invalid")
            .to_string();
        assert!(
            errs.contains("t.toml:4:11: admin.address: `localhost:9901` is not an address"),
            "{errs}"
        );
        assert!(
            errs.contains("t.toml:5:22: admin.lag_probe_interval: must be between 1ms and 10s"),
            "{errs}"
        );
        assert!(
            errs.contains(
                "t.toml:7:19: metrics.consumer_header: `x consumer` is not a header name"
            ),
            "{errs}"
        );
        assert!(errs.contains("help: "), "{errs}");
        // The refused interval is not judged again against the stall threshold.
        assert!(!errs.contains("stall_threshold"), "{errs}");
    }

    #[test]
    fn the_stall_threshold_is_checked_against_the_effective_interval() {
        let errs = Config::parse(
            Path::new("t.toml"),
            &format!("{BASE}[admin]\naddress = \"127.0.0.1:0\"\nlag_probe_interval = \"3s\"\n"),
        )
        .expect_err("3s probe with the 2s default threshold")
        .to_string();
        assert!(
            errs.contains(
                "t.toml:5:22: admin.lag_probe_interval: stall_threshold (2s) must be at least twice"
            ),
            "{errs}"
        );
        let errs = Config::parse(
            Path::new("t.toml"),
            &format!("{BASE}[metrics]\nconsumer_header = \"Authorization\"\n"),
        )
        .expect_err("a credential header")
        .to_string();
        assert!(
            errs.contains("metrics.consumer_header: `Authorization` carries credentials"),
            "{errs}"
        );
    }

    #[test]
    fn defaults() {
        let c = Config::parse(
            Path::new("t.toml"),
            &format!("{BASE}[admin]\naddress = \"127.0.0.1:9901\"\n"),
        )
        .expect("valid");
        let a = c.admin.expect("admin");
        assert_eq!(a.lag_probe_interval, std::time::Duration::from_millis(10));
        assert_eq!(a.stall_threshold, std::time::Duration::from_secs(2));
        assert!(c.metrics.consumer_header.is_none());
        assert_eq!(c.metrics.max_consumers, 100_000);
    }
}
