//! Process metrics (`process_*`, as the Prometheus client libraries name them), read from
//! `/proc/self` by the admin plane at scrape time. Nothing here runs on the data plane.

use std::time::{SystemTime, UNIX_EPOCH};

#[derive(Debug, Default, Clone, Copy)]
pub struct ProcessStats {
    pub cpu_seconds: f64,
    pub resident_bytes: u64,
    pub virtual_bytes: u64,
    pub open_fds: u64,
    pub max_fds: u64,
    pub threads: u64,
    pub start_time_seconds: f64,
}

/// Reads the current process's stats; fields that cannot be read stay 0.
pub fn read() -> ProcessStats {
    let mut p = ProcessStats::default();
    let ticks = rustix::param::clock_ticks_per_second().max(1) as f64;
    let page = rustix::param::page_size() as u64;
    if let Ok(stat) = std::fs::read_to_string("/proc/self/stat") {
        // Fields after the command name, which is in parentheses and may contain spaces.
        if let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) {
            let f: Vec<&str> = rest.split_ascii_whitespace().collect();
            // `rest` starts at field 3 (state): field n is f[n - 3].
            let num = |n: usize| {
                f.get(n - 3)
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0)
            };
            p.cpu_seconds = (num(14) + num(15)) as f64 / ticks;
            p.threads = num(20);
            p.virtual_bytes = num(23);
            p.resident_bytes = num(24) * page;
            if let Some(boot) = boot_time() {
                p.start_time_seconds = boot + num(22) as f64 / ticks;
            }
        }
    }
    if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
        p.open_fds = dir.count() as u64;
    }
    if let Ok(limits) = std::fs::read_to_string("/proc/self/limits") {
        p.max_fds = limits
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .and_then(|l| l.split_ascii_whitespace().nth(3))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
    }
    p
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
        assert!(p.resident_bytes > 0);
        assert!(p.open_fds > 0);
        assert!(p.max_fds >= p.open_fds);
        assert!(p.threads >= 1);
        assert!(p.start_time_seconds > 1.0e9);
    }
}
