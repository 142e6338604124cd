//! Structured logs through `tracing`: text or JSON, level from the config unless RUST_LOG
//! says otherwise. Disabled events cost a level check.
//!
//! Lines are written by a background thread (`tracing-appender`'s non-blocking writer), so a
//! worker never blocks on stderr (DESIGN.md rule 1): each event goes into a bounded queue
//! and, when the queue is full, is dropped and counted (`tailgate_queue_dropped_total{queue="log"}`).

use std::sync::OnceLock;

use tracing_appender::non_blocking::{ErrorCounter, NonBlockingBuilder, WorkerGuard};
use tracing_subscriber::EnvFilter;

use crate::config::{LogFormat, LogSettings};

/// Lines the log queue holds before it drops. Each is a copy of a formatted line: an
/// access log line is at most a few KiB (its client-chosen fields are cut, see
/// [`crate::observe::access_log`]), so the queue holds some tens of MiB at worst, and a few
/// MiB of ordinary lines.
const QUEUE_LINES: usize = 16 * 1024;

static DROPPED: OnceLock<ErrorCounter> = OnceLock::new();

/// Installs the global subscriber (once; later calls are no-ops). Keep the guard until
/// exit: dropping it flushes the queued lines.
pub fn init(settings: &LogSettings) -> Option<WorkerGuard> {
    // The access log is asked for on its own (`access_log`), as nginx's `access_log` is
    // apart from its `error_log` level: a `level` of `warn` must not silence it. `RUST_LOG`,
    // when set, decides everything.
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        let filter = EnvFilter::new(&settings.level);
        match settings.access_log.then(|| "tailgate::access=info".parse()) {
            Some(Ok(access)) => filter.add_directive(access),
            _ => filter,
        }
    });
    let (writer, guard) = NonBlockingBuilder::default()
        .buffered_lines_limit(QUEUE_LINES)
        .lossy(true)
        .thread_name("tailgate-log")
        .finish(std::io::stderr());
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
    let _ = DROPPED.set(counter);
    Some(guard)
}

/// Log lines dropped because the queue was full.
pub fn dropped_lines() -> u64 {
    DROPPED.get().map_or(0, |c| c.dropped_lines() as u64)
}
