//! SVG charts through plotters' SVG backend (no font or system-library features: SVG text is
//! rendered by the viewer).
//!
//! - percentile spectrum: latency against `1/(1-p)` on a log axis (the HdrHistogram plot),
//! - latency over time: p99 per second of the measurement,
//! - latency by request index: p99 per index on a connection.

use std::path::Path;

use hdrhistogram::Histogram;
use plotters::prelude::*;

use crate::stats::ms_at;

/// One line on a chart.
pub struct Series<'a> {
    pub name: String,
    pub hist: &'a Histogram<u64>,
}

/// One colour a series, as many as the largest scenario has targets (keepalive-churn has
/// seven rows, overhead six): two series of one chart never share one.
const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// Percentiles sampled for the spectrum: 0 .. 99.999 %.
fn spectrum_points(h: &Histogram<u64>) -> Vec<(f64, f64)> {
    let mut pts = Vec::new();
    // x = 1/(1-p), from 1 (p0) to 100_000 (p99.999), 20 points per decade.
    for i in 0..=100 {
        let x = 10f64.powf(i as f64 / 20.0);
        let p = (1.0 - 1.0 / x) * 100.0;
        pts.push((x, ms_at(h, p)));
    }
    pts
}

fn err(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

/// Draws the percentile spectrum of several histograms into `path`.
pub fn spectrum(path: &Path, title: &str, series: &[Series<'_>]) -> std::io::Result<()> {
    let data: Vec<Vec<(f64, f64)>> = series.iter().map(|s| spectrum_points(s.hist)).collect();
    let ymax = data
        .iter()
        .flatten()
        .map(|p| p.1)
        .fold(0.0, f64::max)
        .max(0.01)
        * 1.1;
    let root = SVGBackend::new(path, (900, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((1f64..100_000f64).log_scale(), 0f64..ymax)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("percentile")
        .y_desc("latency (ms)")
        .x_label_formatter(&|x| {
            let p = (1.0 - 1.0 / x) * 100.0;
            format!("{}%", trim(p))
        })
        .draw()
        .map_err(err)?;
    for (i, (s, pts)) in series.iter().zip(&data).enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
            .map_err(err)?
            .label(s.name.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    legend(&mut chart)?;
    root.present().map_err(err)
}

/// A line per series: `y` of each point (index = x value, starting at `first_x`).
pub fn lines(
    path: &Path,
    title: &str,
    x_desc: &str,
    first_x: usize,
    series: &[(String, Vec<f64>)],
) -> std::io::Result<()> {
    let xmax = series.iter().map(|s| s.1.len()).max().unwrap_or(1).max(2) + first_x;
    let ymax = series
        .iter()
        .flat_map(|s| s.1.iter().copied())
        .fold(0.0, f64::max)
        .max(0.01)
        * 1.1;
    let root = SVGBackend::new(path, (900, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(first_x as f64..xmax as f64, 0f64..ymax)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc("p99 latency (ms)")
        .draw()
        .map_err(err)?;
    for (i, (name, ys)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        // A point with no value (NaN: nothing was recorded there) is a gap in the line,
        // not a fall to zero: each run of values between gaps is a line of its own.
        let mut runs: Vec<Vec<(f64, f64)>> = vec![Vec::new()];
        for (x, &y) in ys.iter().enumerate() {
            if y.is_nan() {
                if runs.last().is_some_and(|r| !r.is_empty()) {
                    runs.push(Vec::new());
                }
            } else if let Some(run) = runs.last_mut() {
                run.push(((x + first_x) as f64, y));
            }
        }
        for (k, run) in runs.into_iter().filter(|r| !r.is_empty()).enumerate() {
            let drawn = chart
                .draw_series(LineSeries::new(run, color.stroke_width(2)))
                .map_err(err)?;
            if k == 0 {
                drawn.label(name.clone()).legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
            }
        }
    }
    legend(&mut chart)?;
    root.present().map_err(err)
}

fn legend<'a, X, Y>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>,
) -> std::io::Result<()>
where
    X: plotters::coord::ranged1d::Ranged,
    Y: plotters::coord::ranged1d::Ranged,
{
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)
}

fn trim(p: f64) -> String {
    let s = format!("{p:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// p99 per second of a run.
pub fn p99_per_second(per_second: &[Histogram<u64>]) -> Vec<f64> {
    per_second.iter().map(|h| ms_at(h, 99.0)).collect()
}

/// p99 per request index (1-based; NaN for an index with nothing recorded, drawn as a
/// gap: one that fell in the warm-up, say).
pub fn p99_by_index(by_index: &[Histogram<u64>]) -> Vec<f64> {
    by_index
        .iter()
        .map(|h| {
            if h.is_empty() {
                f64::NAN
            } else {
                ms_at(h, 99.0)
            }
        })
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::stats::new_histogram;

    #[test]
    fn writes_svg_files() {
        let tmp = tempfile::Builder::new()
            .prefix("tg-bench-svg-")
            .tempdir()
            .unwrap();
        let dir = tmp.path();
        let mut h = new_histogram(3);
        for v in 1..1000u64 {
            h.record(v * 10).unwrap();
        }
        let p = dir.join("spectrum.svg");
        spectrum(
            &p,
            "test",
            &[Series {
                name: "a".into(),
                hist: &h,
            }],
        )
        .unwrap();
        let s = std::fs::read_to_string(&p).unwrap();
        assert!(s.starts_with("<svg") && s.contains("polyline"), "{s}");
        let p = dir.join("lines.svg");
        lines(&p, "t", "second", 0, &[("a".into(), vec![1.0, 2.0, 3.0])]).unwrap();
        assert!(std::fs::read_to_string(&p).unwrap().contains("polyline"));
    }

    /// An index with nothing recorded is a gap in its line, not a point at zero.
    #[test]
    fn indices_with_nothing_recorded_are_gaps() {
        let mut hs = vec![new_histogram(3), new_histogram(3), new_histogram(3)];
        hs[1].record(2_000).unwrap();
        hs[2].record(3_000).unwrap();
        let v = p99_by_index(&hs);
        assert!(v[0].is_nan());
        assert!((v[1] - 2.0).abs() < 0.01, "{v:?}");
        let tmp = tempfile::Builder::new()
            .prefix("tg-bench-svg-")
            .tempdir()
            .unwrap();
        let p = tmp.path().join("gaps.svg");
        lines(&p, "t", "request index", 1, &[("a".into(), v)]).unwrap();
        let svg = std::fs::read_to_string(&p).unwrap();
        let line = svg
            .split("<polyline")
            .skip(1)
            .find(|l| l.contains("#1F77B4"))
            .expect("the series' line");
        let points = line.split("points=\"").nth(1).unwrap();
        let points = points.split('"').next().unwrap();
        assert_eq!(points.split_whitespace().count(), 2, "{points}");
        assert!(!svg.contains("NaN"), "no NaN coordinates");
    }

    /// Seven series (keepalive-churn's rows) get seven colours.
    #[test]
    fn series_of_one_chart_never_share_a_colour() {
        let tmp = tempfile::Builder::new()
            .prefix("tg-bench-svg-")
            .tempdir()
            .unwrap();
        let p = tmp.path().join("seven.svg");
        let series: Vec<_> = (0..7)
            .map(|i| (format!("s{i}"), vec![1.0 + f64::from(i), 2.0]))
            .collect();
        lines(&p, "t", "second", 0, &series).unwrap();
        let svg = std::fs::read_to_string(&p).unwrap();
        let strokes: std::collections::HashSet<_> = svg
            .split("<polyline")
            .skip(1)
            .filter_map(|l| l.split("stroke=\"").nth(1))
            .filter_map(|l| l.split('"').next())
            // The legend's frame.
            .filter(|&c| c != "#000000")
            .collect();
        assert_eq!(strokes.len(), 7, "{strokes:?}");
    }
}
