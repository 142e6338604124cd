//! Structured logs through `tracing`: text or JSON, level from the config unless RUST_LOG
//! says otherwise. Disabled events cost a level check.
//!
//! Lines are written by a background thread (`tracing-appender`'s non-blocking writer), so a
//! worker never blocks on stderr (DESIGN.md rule 1): each event goes into a bounded queue
//! and, when the queue is full, is dropped and counted (`tailgate_queue_dropped_total{queue="log"}`).
//! A line stderr refuses (a full disk, a closed pipe) is counted there too: the writer
//! thread would drop it silently.

use std::io::Write;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use tracing_appender::non_blocking::{ErrorCounter, NonBlockingBuilder, WorkerGuard};
use tracing_subscriber::EnvFilter;

use crate::config::{LogFormat, LogSettings};

/// Lines the log queue holds before it drops. Each is a copy of a formatted line: an
/// access log line is at most a few KiB (its client-chosen fields are cut, see
/// [`crate::observe::access_log`]), so the queue holds some tens of MiB at worst, and a few
/// MiB of ordinary lines.
const QUEUE_LINES: usize = 16 * 1024;

static DROPPED: OnceLock<ErrorCounter> = OnceLock::new();

/// Lines stderr refused.
static WRITE_FAILED: AtomicU64 = AtomicU64::new(0);

/// Panics seen by the hook [`count_panics`] installs.
static PANICS: AtomicU64 = AtomicU64::new(0);

/// The log thread's writer: counts each line the one below refuses, and ends a line cut
/// short by the refusal with a newline if it can, so the next line is not joined to half
/// of it (a JSON reader would lose both).
struct Counted<W>(W);

impl<W: Write> Write for Counted<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.write(buf)
    }

    fn write_all(&mut self, mut line: &[u8]) -> std::io::Result<()> {
        let mut written = 0;
        while !line.is_empty() {
            match self.0.write(line) {
                Ok(0) => return Err(self.failed(written, std::io::ErrorKind::WriteZero.into())),
                Ok(n) => {
                    written += n;
                    line = &line[n..];
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.failed(written, e)),
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

impl<W: Write> Counted<W> {
    fn failed(&mut self, written: usize, e: std::io::Error) -> std::io::Error {
        WRITE_FAILED.fetch_add(1, Ordering::Relaxed);
        if written > 0 {
            let _ = self.0.write(b"\n");
        }
        e
    }
}

/// Installs the global subscriber (once; later calls are no-ops). Keep the guard until
/// exit: dropping it flushes the queued lines.
pub fn init(settings: &LogSettings) -> Option<WorkerGuard> {
    let (filter, refused) = filter(std::env::var("RUST_LOG").ok(), settings);
    let (writer, guard) = NonBlockingBuilder::default()
        .buffered_lines_limit(QUEUE_LINES)
        .lossy(true)
        .thread_name("tailgate-log")
        .finish(Counted(std::io::stderr()));
    let counter = writer.error_counter();
    // Colours only for a terminal: files and journald get plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(writer);
    let installed = match settings.format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .try_init(),
        LogFormat::Text => builder.try_init(),
    };
    if installed.is_err() {
        return None;
    }
    // On stderr whatever the filter: `log.level = "error"` would hide the warning.
    if let Some(why) = refused {
        eprintln!("warning: {why}");
    }
    let _ = DROPPED.set(counter);
    Some(guard)
}

/// Counts every panic (`tailgate_panics_total`) and logs it through `tracing` (once a
/// subscriber is installed), with its thread, place and message. tokio catches a
/// connection task's panic and the worker goes on, so without this one showed only as a
/// line on stderr outside the structured log, and a client's connection closed with no
/// answer and no count. Installed once; the hook it replaces still runs after it (its line
/// on stderr, written at once: the log's queue drops lines when full, and is not flushed
/// if the panic ends the process).
pub fn count_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let before = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::Relaxed);
            if DROPPED.get().is_some() {
                let message = info
                    .payload()
                    .downcast_ref::<&str>()
                    .copied()
                    .or_else(|| info.payload().downcast_ref::<String>().map(String::as_str))
                    .unwrap_or("(not a string)");
                let location = info.location().map(ToString::to_string);
                let thread = std::thread::current();
                tracing::error!(
                    thread = thread.name().unwrap_or("unnamed"),
                    location = location.as_deref().unwrap_or("unknown"),
                    "panic: {message}"
                );
            }
            before(info);
        }));
    });
}

/// Panics since the start (see [`count_panics`]).
pub fn panics() -> u64 {
    PANICS.load(Ordering::Relaxed)
}

/// The filter: `RUST_LOG` when it is set to a valid filter (it then decides everything),
/// else `log.level` with the access log asked for on its own (`access_log`), as nginx's
/// `access_log` is apart from its `error_log` level: a `level` of `warn` must not silence
/// it. An empty `RUST_LOG` (`RUST_LOG=` in an environment file) counts as unset, not as a
/// filter that lets nothing through; an invalid one is said why, in the second value.
fn filter(rust_log: Option<String>, settings: &LogSettings) -> (EnvFilter, Option<String>) {
    let mut refused = None;
    if let Some(v) = rust_log.filter(|v| !v.trim().is_empty()) {
        match EnvFilter::try_new(&v) {
            Ok(f) => return (f, None),
            Err(e) => {
                refused = Some(format!(
                    "RUST_LOG `{v}` is not a valid filter ({e}); logging as log.level says"
                ));
            }
        }
    }
    let mut filter = EnvFilter::new(&settings.level);
    // rustls warns about what a client's hello holds (an SNI name it refuses, quoted whole:
    // up to 64 KiB a line, at a client's will, before any handshake), in lines no pacing
    // bounds: only its errors, unless the level is `debug` or `trace` (or `RUST_LOG` is
    // set, `RUST_LOG=rustls=debug`, say). The gateway logs a failed handshake itself,
    // with its error, and counts it.
    if !["debug", "trace"].contains(&settings.level.as_str())
        && let Ok(quiet) = "rustls=error".parse()
    {
        filter = filter.add_directive(quiet);
    }
    let filter = match settings.access_log.then(|| "tailgate::access=info".parse()) {
        Some(Ok(access)) => filter.add_directive(access),
        _ => filter,
    };
    (filter, refused)
}

/// Log lines dropped because the queue was full, or because stderr refused them.
pub fn dropped_lines() -> u64 {
    DROPPED.get().map_or(0, |c| c.dropped_lines() as u64) + WRITE_FAILED.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rust_log_empty_is_unset_and_invalid_is_said() {
        let settings = LogSettings {
            level: "info".into(),
            format: LogFormat::Text,
            access_log: true,
        };
        let from_config = filter(None, &settings).0.to_string();
        assert!(
            from_config.contains("tailgate::access=info"),
            "{from_config}"
        );
        let (f, refused) = filter(Some(" ".into()), &settings);
        assert_eq!(f.to_string(), from_config);
        assert!(refused.is_none());
        let (f, refused) = filter(Some("tailgate=dbug".into()), &settings);
        assert_eq!(f.to_string(), from_config);
        assert!(refused.is_some_and(|r| r.contains("RUST_LOG `tailgate=dbug`")));
        let (f, refused) = filter(Some("tailgate=debug".into()), &settings);
        assert_eq!(f.to_string(), "tailgate=debug");
        assert!(refused.is_none());
    }

    /// Takes `room` bytes, then refuses all but a newline.
    struct Full {
        got: Vec<u8>,
        room: usize,
    }

    impl Write for Full {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if buf == b"\n" {
                self.got.push(b'\n');
                return Ok(1);
            }
            let n = buf.len().min(self.room);
            if n == 0 {
                return Err(std::io::Error::other("no space left on device"));
            }
            self.room -= n;
            self.got.extend_from_slice(&buf[..n]);
            Ok(n)
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// A panic on any thread is counted once the hook is in.
    #[test]
    fn panics_are_counted() {
        count_panics();
        let before = panics();
        let joined = std::thread::spawn(|| panic!("on purpose")).join();
        assert!(joined.is_err());
        assert!(panics() > before, "{} then {}", before, panics());
    }

    #[test]
    fn a_refused_line_is_counted_and_a_cut_one_ended() {
        let before = WRITE_FAILED.load(Ordering::Relaxed);
        let mut w = Counted(Full {
            got: Vec::new(),
            room: 14,
        });
        w.write_all(b"{\"a\":1}\n").expect("fits");
        assert!(w.write_all(b"{\"b\":22}\n").is_err());
        assert!(w.write_all(b"{\"c\":3}\n").is_err());
        assert_eq!(WRITE_FAILED.load(Ordering::Relaxed) - before, 2);
        // The cut line is ended, and the next refused whole adds nothing.
        assert_eq!(w.0.got, b"{\"a\":1}\n{\"b\":2\n");
    }
}
