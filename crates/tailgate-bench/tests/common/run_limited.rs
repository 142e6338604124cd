//! Running a command under a time limit (shared by path with `tailgate-cli`'s tests).

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Runs `cmd` with its output captured; if it has not ended within `limit`, kills it and
/// panics with what it wrote to stderr so far.
pub fn run_limited(mut cmd: Command, limit: Duration) -> Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "still running after {limit:?}; stderr so far:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}
