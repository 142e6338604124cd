//! Checks for a route's `hedge_delay`.

use std::time::Duration;

use toml::Spanned;

use super::super::HedgeDelay;
use super::Checker;

impl Checker<'_> {
    /// `"50ms"` (fixed) or `"p95"` (a percentile of the route's observed latency, `p50` to
    /// `p99.9`).
    pub(super) fn hedge_delay(&mut self, v: &Spanned<String>, field: String) -> Option<HedgeDelay> {
        let text = v.get_ref().trim();
        if let Some(p) = text.strip_prefix('p') {
            let permille = p
                .parse::<f64>()
                .ok()
                .filter(|p| (50.0..=99.9).contains(p))
                .map(|p| (p * 10.0).round() as u32);
            return match permille {
                Some(pm) => Some(HedgeDelay::Percentile(pm)),
                None => {
                    self.err(
                        Some(v.span()),
                        field,
                        format!("`{text}` is not a percentile between p50 and p99.9"),
                        Some("write a percentile such as \"p95\", or a duration such as \"50ms\""),
                    );
                    None
                }
            };
        }
        let d = self.duration(&Some(v.clone()), field.clone(), Duration::ZERO);
        if d.is_zero() {
            // Only a delay written as 0: one that was refused already has its error.
            if humantime::parse_duration(text).is_ok_and(|z| z.is_zero()) {
                self.err(
                    Some(v.span()),
                    field,
                    "must be longer than 0 (a hedge with no delay doubles every request)".into(),
                    Some("write a delay near the route's usual p95, e.g. \"50ms\", or \"p95\""),
                );
            }
            return None;
        }
        if d < Duration::from_millis(1) {
            // Timers fire on the millisecond: a shorter delay is no delay.
            self.err(
                Some(v.span()),
                field,
                format!(
                    "a delay of {} is shorter than the timers' 1ms tick: every request would be sent twice at once",
                    humantime::format_duration(d)
                ),
                Some("write at least \"1ms\", e.g. a delay near the route's usual p95 such as \"50ms\", or \"p95\""),
            );
            return None;
        }
        Some(HedgeDelay::Fixed(d))
    }

    /// A fixed delay that route `i`'s own timeout reaches first would never hedge anything.
    pub(super) fn hedge_reachable(
        &mut self,
        delay: &HedgeDelay,
        v: &Spanned<String>,
        i: usize,
        response_timeout: Duration,
        total_timeout: Option<Duration>,
    ) {
        let HedgeDelay::Fixed(d) = delay else { return };
        let (limit, which) = match total_timeout {
            Some(t) if t < response_timeout => (t, "total_timeout"),
            _ => (response_timeout, "response_timeout"),
        };
        if *d >= limit {
            self.err(
                Some(v.span()),
                format!("route[{i}].hedge_delay"),
                format!(
                    "a hedge after {} never goes: the route's {which} of {} answers first",
                    humantime::format_duration(*d),
                    humantime::format_duration(limit)
                ),
                Some("write a delay well under it, near the route's usual p95, e.g. \"50ms\", or \"p95\""),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::time::Duration;

    use crate::Config;
    use crate::config::HedgeDelay;

    const BASE: &str = "[[listener]]\naddress = \"127.0.0.1:0\"\n[[cluster]]\nname = \"c\"\nendpoints = [\"127.0.0.1:1\", \"127.0.0.1:2\"]\n";

    fn parse(extra: &str) -> Result<Config, String> {
        Config::parse(Path::new("t.toml"), &format!("{BASE}{extra}")).map_err(|e| e.to_string())
    }

    fn route(delay: &str) -> String {
        format!("[[route]]\npath_prefix = \"/\"\ncluster = \"c\"\nhedge_delay = \"{delay}\"\n")
    }

    #[test]
    fn a_refused_delay_gets_one_error() {
        let errs = parse(&route("31d")).expect_err("too long").to_string();
        assert!(errs.contains("longer than 30 days"), "{errs}");
        assert!(!errs.contains("longer than 0"), "{errs}");
    }

    /// Under the timers' 1 ms tick a delay is none: refused, as timeouts are.
    #[test]
    fn a_delay_under_a_millisecond_is_refused() {
        let errs = parse(&route("500us")).expect_err("too short").to_string();
        assert!(errs.contains("shorter than the timers' 1ms tick"), "{errs}");
        assert!(errs.contains("t.toml:"), "{errs}");
        parse(&route("1ms")).expect("valid");
    }

    #[test]
    fn hedge_delay_is_a_duration_or_a_percentile() {
        let cfg = parse(&route("50ms")).expect("valid");
        assert_eq!(
            cfg.routes[0].hedge_delay,
            Some(HedgeDelay::Fixed(Duration::from_millis(50)))
        );
        let cfg = parse(&route("p95")).expect("valid");
        assert_eq!(cfg.routes[0].hedge_delay, Some(HedgeDelay::Percentile(950)));
        let cfg = parse(&route("p99.9")).expect("valid");
        assert_eq!(cfg.routes[0].hedge_delay, Some(HedgeDelay::Percentile(999)));
        assert_eq!(
            parse("").expect("valid").clusters[0].hedge_budget_percent,
            10
        );
    }

    #[test]
    fn bad_hedge_settings_point_at_the_place() {
        for bad in ["p10", "p100", "0ms", "soon"] {
            let e = parse(&route(bad)).expect_err(bad);
            assert!(
                e.contains("t.toml:9:15: route[0].hedge_delay"),
                "{bad}: {e}"
            );
            assert!(e.contains("help:"), "{e}");
        }
        // A delay the route's own timeout reaches first: no hedge would ever go.
        let e = parse(&route("30s")).expect_err("at the response timeout");
        assert!(
            e.contains("t.toml:9:15: route[0].hedge_delay: a hedge after 30s never goes: the route's response_timeout of 30s answers first"),
            "{e}"
        );
        let e =
            parse(&format!("{}total_timeout = \"2s\"\n", route("5s"))).expect_err("past the total");
        assert!(e.contains("the route's total_timeout of 2s"), "{e}");
        parse(&format!("{}response_timeout = \"2s\"\n", route("1999ms"))).expect("just under");
        // A refused response_timeout is not judged, as its default, against the delay.
        let e = parse(&format!("{}response_timeout = \"0s\"\n", route("40s")))
            .expect_err("a zero timeout");
        assert!(
            e.contains("route[0].response_timeout: a timeout of 0"),
            "{e}"
        );
        assert!(!e.contains("never goes"), "{e}");
        // A refused total_timeout leaves the response_timeout judged.
        let e = parse(&format!(
            "{}response_timeout = \"2s\"\ntotal_timeout = \"31d\"\n",
            route("5s")
        ))
        .expect_err("two mistakes");
        assert!(e.contains("route[0].total_timeout"), "{e}");
        assert!(e.contains("the route's response_timeout of 2s"), "{e}");
        let e = parse("hedge_budget_percent = 150\n").expect_err("over 100");
        assert!(
            e.contains("t.toml:6:24: cluster[0].hedge_budget_percent"),
            "{e}"
        );
    }
}
