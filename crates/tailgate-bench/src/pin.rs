//! CPU pinning through `taskset` (util-linux), so no unsafe `sched_setaffinity` call lives here.
//!
//! The generator pins its own process before it starts any thread (threads inherit the
//! affinity); children are started as `taskset -c CORE PROGRAM ARGS...`.

use std::process::{Command, Stdio};

/// The `taskset` binary, if installed.
pub fn taskset() -> Option<&'static str> {
    ["/usr/bin/taskset", "/bin/taskset"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
}

/// Pins the calling process's main thread (and so every thread it starts later) to `core`.
/// Must run before any thread is spawned. Returns false if it could not.
pub fn pin_self(core: usize) -> bool {
    let Some(ts) = taskset() else { return false };
    Command::new(ts)
        .args([
            "-p",
            "-c",
            &core.to_string(),
            &std::process::id().to_string(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A command for `program`, pinned to `core` when taskset is installed and `core` is set.
pub fn command(program: &std::path::Path, core: Option<usize>) -> Command {
    match (core, taskset()) {
        (Some(core), Some(ts)) => {
            let mut c = Command::new(ts);
            c.arg("-c").arg(core.to_string()).arg(program);
            c
        }
        _ => Command::new(program),
    }
}
