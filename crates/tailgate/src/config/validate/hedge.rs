//! Checks for a route's `hedge_delay`.

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
        let d = self.duration(&Some(v.clone()), field.clone(), std::time::Duration::ZERO);
        if d.is_zero() {
            if humantime::parse_duration(text).is_ok() {
                self.err(
                    Some(v.span()),
                    field,
                    "must be longer than 0 (a hedge with no delay doubles every request)".into(),
                    Some("write a delay near the route's usual p95, e.g. \"50ms\", or \"p95\""),
                );
            }
            return None;
        }
        Some(HedgeDelay::Fixed(d))
    }
}
