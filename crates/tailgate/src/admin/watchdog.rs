//! The systemd watchdog (`tailgate serve --watchdog`): a dedicated thread sends `READY=1`
//! once the gateway is ready (as `/readyz` decides), `WATCHDOG=1` every half `WatchdogSec`
//! but only while every data-plane worker is running its lag probe on time, and
//! `STOPPING=1` when the gateway starts to stop (at the signal, before `shutdown_delay`).
//! A stalled worker stops the pings, so systemd restarts a gateway that is alive but not
//! serving (seed 002) — and does not restart one that is merely busy on another thread.
//!
//! The notify protocol is one datagram to `$NOTIFY_SOCKET`, written here with std's Unix
//! sockets: the `sd-notify` crate reads the socket only from the environment, which a test
//! cannot set in-process without `unsafe`.

use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use super::AdminState;

/// The shortest ping interval, whatever `WATCHDOG_USEC` says.
const MIN_INTERVAL: Duration = Duration::from_millis(10);
/// How often readiness and the drain are looked at between pings.
const STEP: Duration = Duration::from_millis(50);

/// Where notifications go: a socket path, or a Linux abstract socket name.
#[derive(Debug, Clone)]
pub enum NotifySocket {
    Path(PathBuf),
    Abstract(Vec<u8>),
}

#[derive(Debug, thiserror::Error)]
pub enum WatchdogError {
    #[error(
        "--watchdog needs NOTIFY_SOCKET in the environment (systemd sets it for a unit with Type=notify; WatchdogSec= adds WATCHDOG_USEC)"
    )]
    NotUnderSystemd,
    #[error("WATCHDOG_USEC=`{0}` is not a positive number of microseconds")]
    BadInterval(String),
    #[error(
        "NOTIFY_SOCKET=`{0}` is no socket address: systemd sets an absolute path (`/run/systemd/notify`) or an abstract name (`@…`)"
    )]
    BadSocket(String),
}

impl NotifySocket {
    /// `$NOTIFY_SOCKET`, and half of `$WATCHDOG_USEC` when the watchdog is ours (as
    /// `sd_watchdog_enabled` decides: no `WATCHDOG_PID`, or our pid). Without a watchdog
    /// only `READY=1` and `STOPPING=1` are sent.
    pub fn from_env() -> Result<(NotifySocket, Option<Duration>), WatchdogError> {
        let socket = std::env::var_os("NOTIFY_SOCKET").ok_or(WatchdogError::NotUnderSystemd)?;
        let ours = std::env::var("WATCHDOG_PID")
            .map_or(true, |p| p.trim() == std::process::id().to_string());
        let interval = match std::env::var("WATCHDOG_USEC") {
            Ok(usec) if ours => {
                let us: u64 = usec
                    .parse()
                    .ok()
                    .filter(|&u| u > 0)
                    .ok_or(WatchdogError::BadInterval(usec))?;
                // Half the timeout, as systemd asks; never a busy loop.
                Some(Duration::from_micros(us / 2).max(MIN_INTERVAL))
            }
            _ => None,
        };
        let bytes = socket.as_encoded_bytes();
        let target = match bytes.strip_prefix(b"@") {
            Some(name) if !name.is_empty() => NotifySocket::Abstract(name.to_vec()),
            // As `sd_notify` takes it: an absolute path or an abstract name, nothing else.
            None if bytes.starts_with(b"/") => NotifySocket::Path(PathBuf::from(socket)),
            _ => {
                return Err(WatchdogError::BadSocket(
                    socket.to_string_lossy().into_owned(),
                ));
            }
        };
        Ok((target, interval))
    }

    /// Sends one notification (`READY=1`, `WATCHDOG=1`, `STOPPING=1`, …).
    pub fn notify(&self, msg: &str) -> std::io::Result<()> {
        let sock = UnixDatagram::unbound()?;
        match self {
            NotifySocket::Path(p) => sock.send_to(msg.as_bytes(), p).map(drop),
            NotifySocket::Abstract(name) => {
                use std::os::linux::net::SocketAddrExt;
                let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
                sock.send_to_addr(msg.as_bytes(), &addr).map(drop)
            }
        }
    }
}

/// The running watchdog thread.
pub struct Watchdog {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl Watchdog {
    /// Sends `READY=1` once ready, `WATCHDOG=1` every `interval` (when there is a watchdog)
    /// while no worker is stalled, and `STOPPING=1` when the gateway starts to stop (at the
    /// signal, before `shutdown_delay`).
    pub fn start(
        state: Arc<AdminState>,
        target: NotifySocket,
        interval: Option<Duration>,
    ) -> std::io::Result<Watchdog> {
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let notify = move |msg: &str| {
            if let Err(e) = target.notify(msg) {
                tracing::warn!(error = %e, msg, "cannot notify systemd");
            }
        };
        let thread = std::thread::Builder::new()
            .name("tailgate-watchdog".into())
            .spawn(move || {
                let (mut ready, mut draining, mut was_stalled) = (false, false, false);
                let every = interval.unwrap_or(MIN_INTERVAL * 10);
                let mut next_ping = std::time::Instant::now();
                while !stopping.load(Ordering::Relaxed) {
                    // Readiness and the drain are looked at every step, not every ping
                    // interval: with `WatchdogSec=180s`, READY=1 would otherwise come up to
                    // 90 s late, past systemd's start timeout.
                    if !ready && state.not_ready().is_none() {
                        notify("READY=1");
                        ready = true;
                    }
                    if !draining && state.draining.load(Ordering::Relaxed) {
                        notify("STOPPING=1");
                        draining = true;
                    }
                    let now = std::time::Instant::now();
                    if now < next_ping {
                        sleep_unless_stopped((next_ping - now).min(STEP), &stopping);
                        continue;
                    }
                    next_ping = now + every;
                    let stalled = state.stalled_workers();
                    if stalled.is_empty() {
                        if was_stalled {
                            tracing::info!("every worker is responsive again; feeding the watchdog");
                        }
                        if interval.is_some() {
                            notify("WATCHDOG=1");
                        }
                    } else {
                        if !was_stalled && ready {
                            tracing::error!(workers = ?stalled, "workers stalled; not feeding the systemd watchdog");
                        }
                        // Looked at again each step, and fed as soon as the workers are
                        // back: a whole interval on, the next ping would reach systemd a
                        // whole `WatchdogSec` after the last (two halves), at its deadline,
                        // and a short stall would restart the gateway or not by when this
                        // check fell.
                        next_ping = now + STEP.min(every);
                    }
                    was_stalled = ready && !stalled.is_empty();
                }
                if !draining {
                    notify("STOPPING=1");
                }
            })?;
        Ok(Watchdog { stop, thread })
    }

    pub fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.thread.join();
    }
}

/// Sleeps `d` in short steps so a stop is seen quickly.
fn sleep_unless_stopped(d: Duration, stop: &AtomicBool) {
    let step = Duration::from_millis(20);
    let mut left = d;
    while !left.is_zero() && !stop.load(Ordering::Relaxed) {
        let s = left.min(step);
        std::thread::sleep(s);
        left -= s;
    }
}
