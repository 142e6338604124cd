//! The processes a scenario starts, and how they are always stopped.
//!
//! Every child is registered in [`Env`], whose `Drop` stops it (SIGTERM through `kill(1)`, then
//! SIGKILL after a grace period) and removes the temp dir, on success, error or panic. A signal
//! thread does the same on SIGINT/SIGTERM before exiting, since `Drop` does not run then.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Pids of live children, for the signal thread.
static LIVE: Mutex<Vec<u32>> = Mutex::new(Vec::new());
/// Each child's pid by the address it listens on, for CPU accounting ([`pid_listening_on`]).
static LISTENING: Mutex<Vec<(SocketAddr, u32)>> = Mutex::new(Vec::new());
/// Temp dirs to remove on a signal.
static DIRS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
/// Each child's name and log file by pid, for [`exited`].
static LOGS: Mutex<Vec<(u32, String, PathBuf)>> = Mutex::new(Vec::new());

/// Why a scenario could not set something up.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    NotReady(String),
    #[error("{0}")]
    Stop(String),
    /// A child exited while the scenario measured.
    #[error("{0}")]
    Exited(String),
}

pub fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> SetupError {
    let what = what.into();
    move |source| SetupError::Io { what, source }
}

/// A free loopback port: bind port 0, read it, close. (Racy in theory; fine on a quiet box.)
pub fn free_port() -> Result<u16, SetupError> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(io_err("bind a free port"))?;
    Ok(l.local_addr().map_err(io_err("read a free port"))?.port())
}

/// Installs the SIGINT/SIGTERM/SIGHUP/SIGQUIT handler once (a thread with its own small runtime).
pub fn install_signal_handler() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = std::thread::Builder::new()
            .name("bench-signals".into())
            .spawn(|| {
                let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                else {
                    return;
                };
                rt.block_on(async {
                    use tokio::signal::unix::{SignalKind, signal};
                    // A hangup (the terminal or ssh session gone) too: the children would
                    // get it as well, and nginx takes it for a reload, HAProxy and tailgate
                    // ignore it, so they would stay up on the measured core.
                    let (Ok(mut term), Ok(mut hup), Ok(mut quit)) = (
                        signal(SignalKind::terminate()),
                        signal(SignalKind::hangup()),
                        signal(SignalKind::quit()),
                    ) else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::signal::ctrl_c() => {}
                        _ = term.recv() => {}
                        _ = hup.recv() => {}
                        _ = quit.recv() => {}
                    }
                });
                eprintln!("tailgate bench: interrupted, stopping children");
                let pids: Vec<u32> = LIVE.lock().map(|v| v.clone()).unwrap_or_default();
                signal(&pids, "-TERM");
                std::thread::sleep(Duration::from_millis(500));
                signal(&pids, "-KILL");
                for d in DIRS.lock().map(|v| v.clone()).unwrap_or_default() {
                    let _ = std::fs::remove_dir_all(d);
                }
                std::process::exit(130);
            });
    });
}

/// Sends `sig` to `pids` with `kill(1)`; whether it succeeded.
fn signal(pids: &[u32], sig: &str) -> bool {
    if pids.is_empty() {
        return true;
    }
    Command::new("kill")
        .arg(sig)
        .args(pids.iter().map(|p| p.to_string()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Waits for `child` to exit until `deadline`, then kills it; always reaps it. Returns its
/// status if it exited on its own, else why not.
fn end(child: &mut Child, deadline: Instant) -> Result<ExitStatus, String> {
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Ok(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err("still running at the deadline".into());
            }
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("waiting for it failed: {e}"));
            }
        }
    }
}

struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

/// A scenario's environment: a temp dir, the children, and where they are pinned.
pub struct Env {
    pub dir: PathBuf,
    /// The running `tailgate`: upstreams (`bench upstream`) are started from it.
    pub tailgate_exe: PathBuf,
    /// The gateway measured as `tailgate` (`serve`); the running binary unless a scenario
    /// was given another build.
    pub gateway_exe: PathBuf,
    /// Core for children (proxies, upstreams), if pinning.
    pub child_core: Option<usize>,
    procs: Vec<Proc>,
}

impl Env {
    pub fn new(tailgate_exe: PathBuf, child_core: Option<usize>) -> Result<Env, SetupError> {
        install_signal_handler();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let dir =
            std::env::temp_dir().join(format!("tailgate-bench-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(io_err(format!("create {}", dir.display())))?;
        if let Ok(mut d) = DIRS.lock() {
            d.push(dir.clone());
        }
        Ok(Env {
            dir,
            gateway_exe: tailgate_exe.clone(),
            tailgate_exe,
            child_core,
            procs: Vec::new(),
        })
    }

    /// Writes `contents` to `name` in the temp dir and returns its path.
    pub fn write(&self, name: &str, contents: &str) -> Result<PathBuf, SetupError> {
        let p = self.dir.join(name);
        std::fs::write(&p, contents).map_err(io_err(format!("write {}", p.display())))?;
        Ok(p)
    }

    /// Starts `program args` pinned to the child core, output to a log file in the temp dir,
    /// and waits until `ready_addr` answers `GET /` with a 200.
    pub fn spawn(
        &mut self,
        name: &str,
        program: &Path,
        args: &[&str],
        ready_addr: SocketAddr,
    ) -> Result<(), SetupError> {
        self.spawn_with_env(name, program, args, &[], ready_addr)
    }

    /// [`Env::spawn`] with the child's environment changed: each variable set to its value,
    /// or removed when that is `None`.
    pub fn spawn_with_env(
        &mut self,
        name: &str,
        program: &Path,
        args: &[&str],
        vars: &[(&str, Option<&std::ffi::OsStr>)],
        ready_addr: SocketAddr,
    ) -> Result<(), SetupError> {
        let log = self.dir.join(format!("{name}.log"));
        let out =
            std::fs::File::create(&log).map_err(io_err(format!("create {}", log.display())))?;
        let err = out.try_clone().map_err(io_err("clone log file"))?;
        let mut command = crate::pin::command(program, self.child_core);
        for (var, value) in vars {
            match value {
                Some(v) => command.env(var, v),
                None => command.env_remove(var),
            };
        }
        let child = command
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(io_err(format!("start {}", program.display())))?;
        if let Ok(mut live) = LIVE.lock() {
            live.push(child.id());
        }
        if let Ok(mut l) = LISTENING.lock() {
            l.push((ready_addr, child.id()));
        }
        if let Ok(mut l) = LOGS.lock() {
            l.push((child.id(), name.to_string(), log.clone()));
        }
        self.procs.push(Proc {
            name: name.to_string(),
            child,
            log,
        });
        let ready = self.wait_ready(ready_addr);
        if ready.is_err() {
            self.forget_last();
        }
        ready
    }

    /// The child started last did not become ready: it is stopped (one that hangs would
    /// take the measured core from every target after it; SIGTERM first, so that nginx's
    /// master takes its worker with it) and reaped, and forgotten, so that no signal goes
    /// later to its pid, which the system may have given to another process by then.
    fn forget_last(&mut self) {
        let Some(mut p) = self.procs.pop() else {
            return;
        };
        let pid = p.child.id();
        if matches!(p.child.try_wait(), Ok(None)) {
            signal(&[pid], "-TERM");
        }
        let _ = end(&mut p.child, Instant::now() + Duration::from_secs(3));
        if let Ok(mut live) = LIVE.lock() {
            live.retain(|&live| live != pid);
        }
        if let Ok(mut l) = LISTENING.lock() {
            l.retain(|&(_, p)| p != pid);
        }
    }

    /// Stops the child started as `name` with SIGTERM and waits for it to exit (SIGKILL
    /// after `grace`); returns how it exited on its own, or why it did not.
    pub fn stop(&mut self, name: &str, grace: Duration) -> Result<ExitStatus, SetupError> {
        let i = self
            .procs
            .iter()
            .position(|p| p.name == name)
            .ok_or_else(|| SetupError::Stop(format!("no process named {name}")))?;
        let mut p = self.procs.remove(i);
        let pid = p.child.id();
        let sent = signal(&[pid], "-TERM");
        let ended = end(&mut p.child, Instant::now() + grace);
        if let Ok(mut live) = LIVE.lock() {
            live.retain(|&live| live != pid);
        }
        match ended {
            Ok(status) => Ok(status),
            Err(why) if sent => Err(SetupError::Stop(format!(
                "{name} did not exit within {grace:?} of SIGTERM ({why}); killed"
            ))),
            Err(why) => Err(SetupError::Stop(format!(
                "{name}: SIGTERM could not be sent (kill(1) failed), and it did not exit ({why}); killed"
            ))),
        }
    }

    fn wait_ready(&mut self, addr: SocketAddr) -> Result<(), SetupError> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut last = String::from("no answer");
        while Instant::now() < deadline {
            if let Some(p) = self.procs.last_mut()
                && let Ok(Some(status)) = p.child.try_wait()
            {
                let tail = log_tail(&p.log);
                return Err(SetupError::NotReady(format!(
                    "{} exited ({status}) before answering on {addr}:\n    {tail}",
                    p.name
                )));
            }
            match probe(addr) {
                Ok(200) => return Ok(()),
                Ok(code) => last = format!("status {code}"),
                Err(e) => last = e.to_string(),
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let name = self
            .procs
            .last()
            .map(|p| p.name.clone())
            .unwrap_or_default();
        Err(SetupError::NotReady(format!(
            "{name} did not answer 200 on {addr} within 10s ({last})"
        )))
    }
}

/// `GET /` over a fresh connection; returns the status code.
pub fn probe(addr: SocketAddr) -> std::io::Result<u16> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(500))?;
    s.set_read_timeout(Some(Duration::from_secs(1)))?;
    s.write_all(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")?;
    let mut buf = [0u8; 64];
    let mut n = 0;
    while n < 12 {
        let k = s.read(&mut buf[n..])?;
        if k == 0 {
            break;
        }
        n += k;
    }
    let line = std::str::from_utf8(&buf[..n]).unwrap_or("");
    line.get(9..12)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP response: {line:?}")))
}

impl Drop for Env {
    fn drop(&mut self) {
        let pids: Vec<u32> = self.procs.iter().map(|p| p.child.id()).collect();
        signal(&pids, "-TERM");
        let deadline = Instant::now() + Duration::from_secs(3);
        for p in &mut self.procs {
            let _ = end(&mut p.child, deadline);
        }
        if let Ok(mut live) = LIVE.lock() {
            live.retain(|pid| !pids.contains(pid));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        if let Ok(mut d) = DIRS.lock() {
            d.retain(|x| x != &self.dir);
        }
    }
}

/// The last five lines of a child's log, indented for an error message.
fn log_tail(log: &Path) -> String {
    let log = std::fs::read_to_string(log).unwrap_or_default();
    log.lines()
        .rev()
        .take(5)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect::<Vec<_>>()
        .join("\n    ")
}

/// Has the child with this pid (one this scenario started) exited? Its name and the tail
/// of its log, then. A child not reaped yet is a zombie (state `Z`), one reaped has no
/// `/proc` entry.
pub fn exited(pid: u32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok();
    // The state follows the command's closing parenthesis.
    let state = stat
        .as_deref()
        .and_then(|s| s.rsplit_once(')'))
        .and_then(|(_, rest)| rest.split_whitespace().next());
    if !matches!(state, None | Some("Z" | "X")) {
        return None;
    }
    let logs = LOGS.lock().ok()?;
    let (_, name, log) = logs.iter().rev().find(|(p, _, _)| *p == pid)?;
    Some(format!(
        "{name} (pid {pid}) exited while measured; the last lines of its log:\n    {}",
        log_tail(log)
    ))
}

/// The pid of the child this scenario started listening on `addr` (started through
/// `taskset`, which execs the program: the same pid).
pub fn pid_listening_on(addr: SocketAddr) -> Option<u32> {
    let l = LISTENING.lock().ok()?;
    l.iter()
        .rev()
        .find(|(a, _)| *a == addr)
        .map(|&(_, pid)| pid)
}

/// CPU time used so far by process `pid`, all its threads and all its descendants (nginx's
/// workers are children of its master), in nanoseconds: the first field of each thread's
/// `/proc/PID/task/TID/schedstat`, which counts nanoseconds (`/proc/PID/stat` counts 10 ms
/// ticks, too coarse for a 3 s run). `None` when the process is gone or there is no `/proc`.
pub fn cpu_ns(pid: u32) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut total = 0u64;
    for task in tasks.flatten() {
        let dir = task.path();
        if let Some(ns) = std::fs::read_to_string(dir.join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        {
            total += ns;
        }
        let children = std::fs::read_to_string(dir.join("children")).unwrap_or_default();
        for child in children
            .split_whitespace()
            .filter_map(|c| c.parse::<u32>().ok())
        {
            total += cpu_ns(child).unwrap_or(0);
        }
    }
    Some(total)
}

/// Raises this process's soft limit on open files to its hard one, before anything is
/// started: the generator's sockets count against it, and every target it starts (nginx,
/// HAProxy, the upstream, tailgate) inherits it. tailgate raises its own, and HAProxy sizes
/// its own, but nginx keeps the soft limit it is given (1024 on many hosts): with more
/// connections than that it stops accepting, and its latency would be the limit's, not its
/// own. The same for every target.
pub fn raise_open_files_limit() {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        let _ = setrlimit(
            Resource::Nofile,
            Rlimit {
                current: limit.maximum,
                maximum: limit.maximum,
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The soft limit is raised to the hard one, and a target started after sees it (here
    /// a shell's `ulimit -n`, as nginx would be started).
    #[test]
    fn the_open_files_limit_is_raised_for_the_targets_too() {
        use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
        let limit = getrlimit(Resource::Nofile);
        let hard = limit.maximum.expect("a finite hard limit");
        setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(hard - 1),
                maximum: limit.maximum,
            },
        )
        .expect("lowered");
        raise_open_files_limit();
        assert_eq!(getrlimit(Resource::Nofile).current, Some(hard));
        let out = Command::new("sh")
            .args(["-c", "ulimit -n"])
            .output()
            .expect("sh");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            hard.to_string()
        );
    }

    /// A child that exits before it answers is an error that names it, and is forgotten:
    /// no signal goes later to its pid (which the system may hand to another process), and
    /// no CPU is read from it.
    #[test]
    fn a_child_that_does_not_become_ready_is_forgotten() {
        let mut env = Env::new(PathBuf::from("/bin/sh"), None).expect("env");
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port().expect("port"))
            .parse()
            .expect("addr");
        let err = env
            .spawn("quitter", Path::new("/bin/sh"), &["-c", "exit 3"], addr)
            .expect_err("it never answers");
        assert!(err.to_string().contains("quitter exited"), "{err}");
        assert!(env.procs.is_empty());
        assert_eq!(pid_listening_on(addr), None);
    }

    /// A child that exited is seen (a zombie not reaped yet, or reaped), with its log's
    /// tail; a live one is not.
    #[test]
    fn a_child_that_exited_is_named_with_its_log() {
        let dir =
            std::env::temp_dir().join(format!("tailgate-bench-exited-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let log = dir.join("peer.log");
        let out = std::fs::File::create(&log).expect("log file");
        let mut child = Command::new("sh")
            .args(["-c", "read line; echo \"bad config on line 3\"; exit 3"])
            .stdin(Stdio::piped())
            .stdout(out)
            .spawn()
            .expect("start sh");
        let pid = child.id();
        LOGS.lock()
            .expect("logs")
            .push((pid, "peer".into(), log.clone()));
        assert_eq!(exited(pid), None, "running");
        drop(child.stdin.take());
        let mut why = None;
        for _ in 0..500 {
            why = exited(pid);
            if why.is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let why = why.expect("the exit is seen before the child is reaped");
        assert!(why.starts_with("peer (pid "), "{why}");
        assert!(why.contains("bad config on line 3"), "{why}");
        let _ = child.wait();
        assert!(exited(pid).is_some(), "reaped, still exited");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A descendant's CPU counts toward its ancestor's: a shell whose grandchild spins
    /// (under `timeout`, which ends it whatever happens to the test).
    #[test]
    fn cpu_of_a_process_includes_its_descendants() {
        let mut sh = Command::new("sh")
            .args(["-c", "timeout 2 sh -c 'while :; do :; done' & wait"])
            .spawn()
            .expect("start sh");
        let pid = sh.id();
        std::thread::sleep(Duration::from_millis(300));
        let busy = cpu_ns(pid).expect("a live process has a CPU time");
        let own = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/schedstat"))
            .expect("schedstat")
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .expect("a number");
        let _ = sh.kill();
        let _ = sh.wait();
        assert!(
            busy > own + 50_000_000,
            "the spinning child's CPU is counted: {busy} ns in all, {own} ns the parent's"
        );
        assert_eq!(cpu_ns(pid), None, "a reaped process has none");
    }
}
