//! The text exposition formats: Prometheus 0.0.4 and OpenMetrics 1.0, written in chunks
//! that are handed on as soon as they fill (so a 100k-series scrape streams instead of
//! being built whole), optionally gzip-compressed chunk by chunk.
//!
//! Written by hand because the output is a simple line format and the series come from our
//! own atomics in a fixed order; prometheus-client would need every series registered in
//! its own (locked) families first.

use std::io::Write as _;

use bytes::Bytes;
use flate2::Compression;
use flate2::write::GzEncoder;
use tokio::sync::mpsc;

use super::histogram::{BUCKETS, Snapshot};

/// Bytes written before a chunk is sent on.
const CHUNK: usize = 64 * 1024;
/// A reader that takes no chunk for this long is dropped (it would hold a render open).
const SEND_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// `le` label values of the latency buckets, in seconds.
pub const LE: [&str; BUCKETS] = [
    "0.0001", "0.00025", "0.0005", "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1",
    "0.25", "0.5", "1.0", "2.5", "5.0", "10.0", "+Inf",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// `text/plain; version=0.0.4`
    Prometheus,
    /// `application/openmetrics-text; version=1.0.0`
    OpenMetrics,
}

impl Format {
    /// The format asked for by an `Accept` header: OpenMetrics when it is listed with a
    /// `q` above zero and not below that of `text/plain` (or `text/*`, `*/*`): a client
    /// that lists both at one weight, as Prometheus did before it weighted them, gets
    /// OpenMetrics.
    pub fn from_accept(accept: Option<&str>) -> Format {
        let (mut openmetrics, mut plain) = (0.0f32, 0.0f32);
        for item in accept.unwrap_or("").split(',') {
            let mut parts = item.split(';').map(str::trim);
            let media = parts.next().unwrap_or("");
            let q = parts
                .find_map(|p| p.strip_prefix("q=").or_else(|| p.strip_prefix("Q=")))
                .map_or(Some(1.0), |q| q.parse::<f32>().ok())
                .unwrap_or(0.0);
            if media.eq_ignore_ascii_case("application/openmetrics-text") {
                openmetrics = openmetrics.max(q);
            } else if ["text/plain", "text/*", "*/*"]
                .iter()
                .any(|m| media.eq_ignore_ascii_case(m))
            {
                plain = plain.max(q);
            }
        }
        if openmetrics > 0.0 && openmetrics >= plain {
            Format::OpenMetrics
        } else {
            Format::Prometheus
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Format::Prometheus => "text/plain; version=0.0.4; charset=utf-8",
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// The reader went away; rendering stops.
#[derive(Debug)]
pub struct Closed;

/// Writes series into chunks and sends each full chunk to the response body.
pub struct TextWriter {
    format: Format,
    buf: Vec<u8>,
    gz: Option<GzEncoder<Vec<u8>>>,
    tx: mpsc::Sender<Bytes>,
    /// Samples written so far.
    pub samples: u64,
    /// Bytes written so far (before compression).
    pub bytes: u64,
}

impl TextWriter {
    pub fn new(format: Format, gzip: bool, tx: mpsc::Sender<Bytes>) -> TextWriter {
        TextWriter {
            format,
            buf: Vec::with_capacity(CHUNK + 4096),
            gz: gzip.then(|| GzEncoder::new(Vec::with_capacity(CHUNK), Compression::fast())),
            tx,
            samples: 0,
            bytes: 0,
        }
    }

    /// `# HELP` and `# TYPE` for a family. `name` is the family name; for a counter it is
    /// the name without `_total` (samples get `_total` appended).
    pub fn family(&mut self, name: &str, kind: Kind, help: &str) {
        let (shown, ty) = match (kind, self.format) {
            (Kind::Counter, Format::Prometheus) => (Shown::Total(name), "counter"),
            (Kind::Counter, Format::OpenMetrics) => (Shown::Plain(name), "counter"),
            (Kind::Gauge, _) => (Shown::Plain(name), "gauge"),
            (Kind::Histogram, _) => (Shown::Plain(name), "histogram"),
        };
        let _ = writeln!(self.buf, "# HELP {shown} {help}");
        let _ = writeln!(self.buf, "# TYPE {shown} {ty}");
    }

    /// One counter sample: `name_total{labels} value`.
    pub fn counter(&mut self, name: &str, labels: &[&str], value: impl Value) {
        self.sample_start(name, "_total", labels, true);
        self.value_line(value);
    }

    /// One gauge sample.
    pub fn gauge(&mut self, name: &str, labels: &[&str], value: impl Value) {
        self.sample_start(name, "", labels, true);
        self.value_line(value);
    }

    /// ` value` and the line's end.
    fn value_line(&mut self, value: impl Value) {
        self.buf.push(b' ');
        value.write_to(&mut self.buf);
        self.buf.push(b'\n');
    }

    /// A histogram's cumulative buckets, `_sum` (seconds) and `_count`.
    pub fn histogram(&mut self, name: &str, labels: &[&str], h: &Snapshot) {
        // Every bucket line starts `name_bucket{labels,` (or `name_bucket{`): written once,
        // then copied for the next lines.
        let start = self.buf.len();
        let open = self.sample_start(name, "_bucket", labels, false);
        self.buf.push(if open { b',' } else { b'{' });
        let prefix = start..self.buf.len();
        let mut cumulative = 0;
        for (i, n) in h.buckets.iter().enumerate() {
            cumulative += n;
            if i > 0 {
                self.samples += 1;
                self.buf.extend_from_within(prefix.clone());
            }
            // The `le` label goes last, after the series' own labels.
            self.buf.extend_from_slice(b"le=\"");
            self.buf.extend_from_slice(LE[i].as_bytes());
            self.buf.extend_from_slice(b"\"}");
            self.value_line(cumulative);
        }
        self.sample_start(name, "_sum", labels, true);
        self.value_line(h.sum_ns as f64 / 1e9);
        self.sample_start(name, "_count", labels, true);
        self.value_line(cumulative);
    }

    /// `name{a,b}` with the label parts (each `k="v"`, or several joined by commas; empty
    /// parts skipped). Without `close` the brace is left open for `le`; returns whether a
    /// brace was opened.
    fn sample_start(&mut self, name: &str, suffix: &str, labels: &[&str], close: bool) -> bool {
        self.samples += 1;
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.extend_from_slice(suffix.as_bytes());
        let mut open = false;
        for l in labels.iter().filter(|l| !l.is_empty()) {
            self.buf.push(if open { b',' } else { b'{' });
            open = true;
            self.buf.extend_from_slice(l.as_bytes());
        }
        if open && close {
            self.buf.push(b'}');
        }
        open
    }

    /// Sends the chunk on if it is full (the await is where a slow reader holds us back).
    pub async fn maybe_flush(&mut self) -> Result<(), Closed> {
        if self.buf.len() >= CHUNK {
            self.flush().await?;
        }
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), Closed> {
        self.bytes += self.buf.len() as u64;
        let chunk = match &mut self.gz {
            Some(gz) => {
                let _ = gz.write_all(&self.buf);
                self.buf.clear();
                let _ = gz.flush();
                Bytes::from(std::mem::take(gz.get_mut()))
            }
            None => Bytes::from(std::mem::replace(
                &mut self.buf,
                Vec::with_capacity(CHUNK + 4096),
            )),
        };
        if chunk.is_empty() {
            return Ok(());
        }
        self.send(chunk).await
    }

    async fn send(&self, chunk: Bytes) -> Result<(), Closed> {
        match tokio::time::timeout(SEND_TIMEOUT, self.tx.send(chunk)).await {
            Ok(Ok(())) => Ok(()),
            _ => Err(Closed),
        }
    }

    /// Ends the exposition (`# EOF` for OpenMetrics), sends what is left, then the end
    /// marker: an empty chunk. A stream that closes without it was cut short, and the body
    /// reports an error instead of ending cleanly.
    pub async fn finish(mut self) -> Result<(u64, u64), Closed> {
        if self.format == Format::OpenMetrics {
            self.buf.extend_from_slice(b"# EOF\n");
        }
        self.flush().await?;
        if let Some(gz) = self.gz.take() {
            let tail = gz.finish().unwrap_or_default();
            if !tail.is_empty() {
                self.send(Bytes::from(tail)).await?;
            }
        }
        self.send(Bytes::new()).await?;
        Ok((self.samples, self.bytes))
    }
}

/// A sample's value, written as its text. Integers skip `core::fmt` (through which a
/// 100k-series scrape spent a third of its time); floats keep `Display`, whose shortest
/// round-trip form is what the formats expect.
pub trait Value {
    fn write_to(self, buf: &mut Vec<u8>);
}

macro_rules! integer_value {
    ($($t:ty),*) => {$(
        impl Value for $t {
            fn write_to(self, buf: &mut Vec<u8>) {
                buf.extend_from_slice(itoa::Buffer::new().format(self).as_bytes());
            }
        }
    )*};
}
integer_value!(u64, i64, u32, u8, usize);

impl Value for f64 {
    fn write_to(self, buf: &mut Vec<u8>) {
        let _ = write!(buf, "{self}");
    }
}

enum Shown<'a> {
    Plain(&'a str),
    Total(&'a str),
}

impl std::fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Shown::Plain(n) => f.write_str(n),
            Shown::Total(n) => write!(f, "{n}_total"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Format, Kind, Snapshot, TextWriter};

    /// The exact lines of each kind of sample, as written without `core::fmt`.
    #[tokio::test]
    #[allow(clippy::unwrap_used)]
    async fn samples_are_written_as_the_format_says() {
        let (tx, mut rx) = tokio::sync::mpsc::channel(4);
        let mut w = TextWriter::new(Format::Prometheus, false, tx);
        w.family("t_requests", Kind::Counter, "Requests.");
        w.counter(
            "t_requests",
            &["route=\"a\"", "", "code=\"2xx\""],
            18_446_744_073_709_551_615u64,
        );
        w.gauge("t_in_flight", &[], -3i64);
        let mut h = Snapshot::default();
        h.buckets[0] = 2;
        h.buckets[16] = 1;
        h.sum_ns = 1_500_000_000;
        w.histogram("t_seconds", &["route=\"a\""], &h);
        w.histogram("t_bare", &[], &h);
        let (samples, _) = w.finish().await.unwrap();
        let text = String::from_utf8(rx.recv().await.unwrap().to_vec()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[2],
            "t_requests_total{route=\"a\",code=\"2xx\"} 18446744073709551615"
        );
        assert_eq!(lines[3], "t_in_flight -3");
        assert_eq!(lines[4], "t_seconds_bucket{route=\"a\",le=\"0.0001\"} 2");
        assert_eq!(lines[5], "t_seconds_bucket{route=\"a\",le=\"0.00025\"} 2");
        assert_eq!(lines[20], "t_seconds_bucket{route=\"a\",le=\"+Inf\"} 3");
        assert_eq!(lines[21], "t_seconds_sum{route=\"a\"} 1.5");
        assert_eq!(lines[22], "t_seconds_count{route=\"a\"} 3");
        assert_eq!(lines[23], "t_bare_bucket{le=\"0.0001\"} 2");
        assert_eq!(lines[39], "t_bare_bucket{le=\"+Inf\"} 3");
        assert_eq!(lines[41], "t_bare_count 3");
        assert_eq!(lines.len(), 42);
        // Two samples, then 17 buckets, the sum and the count twice.
        assert_eq!(samples, 2 + 2 * 19);
    }

    #[test]
    fn openmetrics_when_listed_and_weighted_no_lower_than_text() {
        let f = |a: &str| Format::from_accept(Some(a));
        assert_eq!(
            f("application/openmetrics-text; version=1.0.0"),
            Format::OpenMetrics
        );
        assert_eq!(
            f("text/plain;q=0.5, application/openmetrics-text;q=0.9"),
            Format::OpenMetrics
        );
        assert_eq!(
            f("application/openmetrics-text;q=0, text/plain"),
            Format::Prometheus
        );
        assert_eq!(
            f("text/plain;version=0.0.4;q=0.9, application/openmetrics-text;q=0.1"),
            Format::Prometheus,
            "the higher weight wins"
        );
        // What Prometheus 3 sends by default.
        assert_eq!(
            f(
                "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
            ),
            Format::OpenMetrics
        );
        assert_eq!(f("application/openmetrics-text;q=x"), Format::Prometheus);
        assert_eq!(
            f("application/openmetrics-text;q=0.1, */*;q=0.9"),
            Format::Prometheus,
            "*/* weighs for the text format"
        );
        assert_eq!(f("*/*"), Format::Prometheus);
        assert_eq!(Format::from_accept(None), Format::Prometheus);
    }
}
