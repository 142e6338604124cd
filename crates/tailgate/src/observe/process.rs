//! Process metrics (`process_*`, as the Prometheus client libraries name them), read from
//! `/proc/self` by the admin plane at scrape time. Nothing here runs on the data plane.
//!
//! A field that cannot be read is `None` and its series left out, never `0`: out of file
//! descriptors (when `process_open_fds` matters most), reading `/proc` fails, and a `0`
//! would look like a value (a CPU counter at `0` like a restart). CPU time, the open-files
//! limit and the start time need no file descriptor: a clock, a system call, and a value
//! read once.

use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

#[derive(Debug, Default, Clone, Copy)]
pub struct ProcessStats {
    pub cpu_seconds: f64,
    pub resident_bytes: Option<u64>,
    pub virtual_bytes: Option<u64>,
    pub open_fds: Option<u64>,
    pub max_fds: Option<u64>,
    pub threads: Option<u64>,
    pub start_time_seconds: Option<f64>,
}

/// Reads the current process's stats; fields that cannot be read are `None`.
pub fn read() -> ProcessStats {
    let mut p = ProcessStats::default();
    let cpu = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    p.cpu_seconds = cpu.tv_sec as f64 + cpu.tv_nsec as f64 / 1e9;
    p.max_fds = rustix::process::getrlimit(rustix::process::Resource::Nofile).current;
    let page = rustix::param::page_size() as u64;
    if let Ok(stat) = std::fs::read_to_string("/proc/self/stat") {
        // Fields after the command name, which is in parentheses and may contain spaces.
        if let Some(rest) = stat.rfind(')').and_then(|i| stat.get(i + 2..)) {
            let f: Vec<&str> = rest.split_ascii_whitespace().collect();
            // `rest` starts at field 3 (state): field n is f[n - 3].
            let num = |n: usize| f.get(n - 3).and_then(|v| v.parse::<u64>().ok());
            p.threads = num(20);
            p.virtual_bytes = num(23);
            p.resident_bytes = num(24).map(|pages| pages * page);
            if let Some(started) = num(22) {
                start_time(started);
            }
        }
    }
    p.start_time_seconds = START.get().copied();
    if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
        // (Less the one reading the directory.)
        p.open_fds = Some((dir.count() as u64).saturating_sub(1));
    }
    p
}

/// The process's start time, set at the first read that could compute it.
static START: OnceLock<f64> = OnceLock::new();

/// Sets [`START`] from the start time in clock ticks after boot (`/proc/self/stat` field
/// 22), once the boot time can be read.
fn start_time(ticks_after_boot: u64) {
    if START.get().is_some() {
        return;
    }
    let ticks = rustix::param::clock_ticks_per_second().max(1) as f64;
    if let Some(boot) = boot_time() {
        let _ = START.set(boot + ticks_after_boot as f64 / ticks);
    }
}

fn boot_time() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let btime = stat.lines().find_map(|l| l.strip_prefix("btime "))?;
    btime.trim().parse::<f64>().ok()
}

/// Seconds since the Unix epoch, now.
pub fn now_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_this_process() {
        let p = super::read();
        assert!(p.cpu_seconds > 0.0);
        assert!(p.resident_bytes.expect("resident") > 0);
        let open = p.open_fds.expect("open fds");
        assert!(open > 0);
        assert!(p.max_fds.expect("limit") >= open);
        assert!(p.threads.expect("threads") >= 1);
        assert!(p.start_time_seconds.expect("start") > 1.0e9);
    }
}
