//! Structured logs through `tracing`: text or JSON, level from the config unless RUST_LOG
//! says otherwise. Disabled events cost a level check.
//!
//! Lines are written by a background thread (`tracing-appender`'s non-blocking writer), so a
//! worker never blocks on stderr (DESIGN.md rule 1): each line, or a worker's batch of
//! access lines, goes into a bounded queue and, when the queue is full, is dropped and
//! counted, each of its lines (`tailgate_queue_dropped_total{queue="log"}`). The lines
//! stderr refuses (a full disk, a closed pipe) are counted there too: the writer thread
//! would drop them silently.
//!
//! A worker does not hand each access log line over on its own: handing one over takes
//! the queue's lock, which the log thread shares, and wakes that thread (a futex call, a
//! context switch, a `write` of one line), per request: a third more CPU per request than
//! with the access log off, measured (a tenth with batches; docs/tail-latency.md). A
//! worker's access lines wait in its own buffer ([`batch_this_thread`]) and go over
//! together at its lag probe's tick ([`flush_batch`], every 10 ms by default) or once
//! [`BATCH_BYTES`] wait, whichever comes first. Every other line (a warning, an error)
//! goes over at once, as other threads' lines do: a worker that stalls, or a process the
//! watchdog kills, loses no more than its last access lines.

use std::cell::RefCell;
use std::io::Write;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use tracing_appender::non_blocking::{ErrorCounter, NonBlocking, NonBlockingBuilder, WorkerGuard};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;

use crate::config::{LogFormat, LogSettings};

/// Hand-overs the log queue holds before it drops: a line, or a worker's batch of them (at
/// most [`BATCH_BYTES`] and one more line). An access log line is at most a few KiB (its
/// client-chosen fields are cut, see [`crate::observe::access_log`]), so the queue holds
/// some tens of MiB at worst.
const QUEUE_LINES: usize = 4 * 1024;

/// What a worker's lines may add up to before they are handed over without waiting for
/// the next [`flush_batch`].
pub const BATCH_BYTES: usize = 8 * 1024;

static DROPPED: OnceLock<ErrorCounter> = OnceLock::new();

/// Lines lost with a batch the queue dropped, beyond the one the queue counts for it.
static BATCH_DROPPED: AtomicU64 = AtomicU64::new(0);

/// The queue's end the workers' batches go into.
static SINK: OnceLock<NonBlocking> = OnceLock::new();

thread_local! {
    /// A worker's lines not yet handed over (`None`: this thread hands each over at once).
    static BATCH: RefCell<Option<Batch>> = const { RefCell::new(None) };
}

#[derive(Default)]
struct Batch {
    buf: Vec<u8>,
    lines: u64,
}

/// From now on, lines logged on this thread wait in its own buffer for [`flush_batch`]
/// (or until [`BATCH_BYTES`] wait). For the workers' threads; the buffer is handed over
/// when the thread ends.
pub fn batch_this_thread() {
    BATCH.with(|b| *b.borrow_mut() = Some(Batch::default()));
}

/// Hands this thread's waiting lines over to the log thread, if any wait.
pub fn flush_batch() {
    if let Some(sink) = SINK.get() {
        flush_batch_into(sink, DROPPED.get());
    }
}

fn flush_batch_into(sink: &NonBlocking, counter: Option<&ErrorCounter>) {
    // (The buffer keeps its room: the queue takes a copy of what is handed over.)
    let _ = BATCH.try_with(|b| {
        let Ok(mut b) = b.try_borrow_mut() else {
            return;
        };
        if let Some(batch) = b.as_mut() {
            batch.hand_over(sink, counter);
        }
    });
}

/// The subscriber's writer: an access log line, on a thread that batches, goes into its
/// buffer; any other line, straight to the queue.
struct Batching(NonBlocking);

/// One event's line, written once by the subscriber; `batch`: it may wait in a buffer.
struct LineOut<'a> {
    sink: &'a NonBlocking,
    batch: bool,
}

impl<'a> MakeWriter<'a> for Batching {
    type Writer = LineOut<'a>;

    fn make_writer(&'a self) -> LineOut<'a> {
        LineOut {
            sink: &self.0,
            batch: false,
        }
    }

    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> LineOut<'a> {
        LineOut {
            sink: &self.0,
            batch: meta.target() == crate::observe::access_log::TARGET,
        }
    }
}

impl Write for LineOut<'_> {
    fn write(&mut self, line: &[u8]) -> std::io::Result<usize> {
        // (A line logged while the buffer is being handed over goes straight to the queue.)
        let full = self.batch.then(|| {
            BATCH.try_with(|b| {
                b.try_borrow_mut().ok()?.as_mut().map(|batch| {
                    batch.buf.extend_from_slice(line);
                    batch.lines += 1;
                    batch.buf.len() >= BATCH_BYTES
                })
            })
        });
        match full {
            Some(Ok(Some(full))) => {
                if full {
                    flush_batch_into(self.sink, DROPPED.get());
                }
                Ok(line.len())
            }
            _ => self.sink.clone().write(line),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Batch {
    /// Hands the waiting lines over to `sink`, if any wait.
    fn hand_over(&mut self, sink: &NonBlocking, counter: Option<&ErrorCounter>) {
        if self.buf.is_empty() {
            return;
        }
        let before = counter.map(ErrorCounter::dropped_lines);
        let _ = sink.clone().write_all(&self.buf);
        // The queue counts a dropped batch as one line. (Another thread's line dropped at
        // the same moment would be taken for this batch: the count stays about right.)
        if let (Some(before), Some(c)) = (before, counter)
            && c.dropped_lines() > before
        {
            BATCH_DROPPED.fetch_add(self.lines.saturating_sub(1), Ordering::Relaxed);
        }
        self.buf.clear();
        self.lines = 0;
    }
}

impl Drop for Batch {
    /// The thread ends: its waiting lines go over (a worker's last ones, at shutdown).
    fn drop(&mut self) {
        if let Some(sink) = SINK.get() {
            self.hand_over(sink, DROPPED.get());
        }
    }
}

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

    /// Writes `lines` (one line, or a worker's batch of them) whole, or counts the lines
    /// it could not: each one not written in full.
    fn write_all(&mut self, lines: &[u8]) -> std::io::Result<()> {
        let mut written = 0;
        while written < lines.len() {
            match self.0.write(&lines[written..]) {
                Ok(0) => {
                    return Err(self.failed(lines, written, std::io::ErrorKind::WriteZero.into()));
                }
                Ok(n) => written += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.failed(lines, written, e)),
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

impl<W: Write> Counted<W> {
    /// `lines` were written up to `written`: the lines left (the one cut short among them)
    /// are counted, and one cut short is ended.
    fn failed(&mut self, lines: &[u8], written: usize, e: std::io::Error) -> std::io::Error {
        let left = &lines[written..];
        let lost = left.iter().filter(|&&b| b == b'\n').count().max(1);
        WRITE_FAILED.fetch_add(lost as u64, Ordering::Relaxed);
        if written > 0 && lines[written - 1] != b'\n' {
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
    let _ = SINK.set(writer.clone());
    // Colours only for a terminal: files and journald get plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(Batching(writer));
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
    DROPPED.get().map_or(0, |c| c.dropped_lines() as u64)
        + BATCH_DROPPED.load(Ordering::Relaxed)
        + WRITE_FAILED.load(Ordering::Relaxed)
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

    /// A batch the full queue drops counts each of its lines: the queue counts it as one
    /// line, and the rest are added.
    #[test]
    fn a_dropped_batch_counts_each_of_its_lines() {
        /// Waits in each write until the sender is dropped: the log thread holds the
        /// first line, and the queue fills behind it.
        struct Held(std::sync::Mutex<std::sync::mpsc::Receiver<()>>);
        impl Write for Held {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                let _ = self.0.lock().expect("held").recv();
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let (release, held) = std::sync::mpsc::channel::<()>();
        let (writer, guard) = NonBlockingBuilder::default()
            .buffered_lines_limit(1)
            .lossy(true)
            .finish(Held(std::sync::Mutex::new(held)));
        let counter = writer.error_counter();
        let batch = |lines: u64| Batch {
            buf: b"x\n".repeat(lines as usize),
            lines,
        };
        // Single lines until one is dropped: the log thread holds one, the queue is full.
        for _ in 0..1000 {
            if counter.dropped_lines() > 0 {
                break;
            }
            batch(1).hand_over(&writer, Some(&counter));
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(counter.dropped_lines() > 0, "the queue never filled");
        let before = (
            counter.dropped_lines(),
            BATCH_DROPPED.load(Ordering::Relaxed),
        );
        batch(5).hand_over(&writer, Some(&counter));
        assert_eq!(
            counter.dropped_lines() - before.0,
            1,
            "the queue counts one"
        );
        assert_eq!(BATCH_DROPPED.load(Ordering::Relaxed) - before.1, 4);
        drop(release);
        drop(guard);
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
        // A batch refused after its first line: the two lines left are counted, and no
        // empty line is added (the cut fell between lines).
        let mut w = Counted(Full {
            got: Vec::new(),
            room: 8,
        });
        let before = WRITE_FAILED.load(Ordering::Relaxed);
        assert!(w.write_all(b"{\"a\":1}\n{\"b\":2}\n{\"c\":3}\n").is_err());
        assert_eq!(WRITE_FAILED.load(Ordering::Relaxed) - before, 2);
        assert_eq!(w.0.got, b"{\"a\":1}\n");
    }

    /// Collects what the log thread writes, and how many writes it took.
    #[derive(Clone, Default)]
    struct Collect(std::sync::Arc<std::sync::Mutex<(usize, Vec<u8>)>>);

    impl Write for Collect {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.write_all(buf)?;
            Ok(buf.len())
        }

        fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
            let mut c = self.0.lock().expect("collect");
            c.0 += 1;
            c.1.extend_from_slice(buf);
            Ok(())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// On a thread that batches (a worker), access lines go over to the log thread
    /// together, at a flush or once `BATCH_BYTES` wait; other lines, and any line on
    /// another thread, each at once. Each line cost a hand-over (the queue's lock, a
    /// wake-up of the log thread) per request.
    #[test]
    fn a_workers_lines_go_over_in_batches() {
        let got = Collect::default();
        let (writer, guard) = NonBlockingBuilder::default().finish(got.clone());
        let batching = Batching(writer.clone());
        let access = || LineOut {
            sink: &batching.0,
            batch: true,
        };
        std::thread::scope(|scope| {
            scope.spawn(|| {
                batch_this_thread();
                for i in 0..3 {
                    let line = format!("line {i}\n");
                    access().write_all(line.as_bytes()).expect("line");
                }
                // Any other line (a warning) goes over at once, batching thread or not.
                batching.make_writer().write_all(b"alone\n").expect("line");
                flush_batch_into(&writer, None);
                // 100 lines of 100 bytes: over `BATCH_BYTES` once, then the rest at the flush.
                let line = format!("{}\n", "x".repeat(99));
                for _ in 0..100 {
                    access().write_all(line.as_bytes()).expect("line");
                }
                flush_batch_into(&writer, None);
                flush_batch_into(&writer, None);
            });
            // A thread that does not batch: an access line goes over at once.
            scope.spawn(|| {
                access().write_all(b"alone\n").expect("line");
            });
        });
        drop(batching);
        drop(writer);
        drop(guard);
        let (writes, bytes) = got.0.lock().expect("collect").clone();
        assert_eq!(writes, 1 + 1 + 2 + 1, "hand-overs");
        let text = String::from_utf8(bytes).expect("utf-8");
        assert!(text.contains("line 0\nline 1\nline 2\n"), "{text}");
        assert_eq!(text.lines().filter(|l| l.starts_with('x')).count(), 100);
        assert_eq!(text.lines().filter(|l| *l == "alone").count(), 2);
    }
}
