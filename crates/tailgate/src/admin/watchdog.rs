//! The systemd watchdog (`tailgate serve --watchdog`): a dedicated thread sends
//! `WATCHDOG=1` every half `WatchdogSec`, but only while every data-plane worker is running
//! its lag probe on time. A stalled worker stops the pings, so systemd restarts a gateway
//! that is alive but not serving (seed 002) — and does not restart one that is merely busy
//! on another thread.
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

/// Where notifications go: a socket path, or a Linux abstract socket name.
#[derive(Debug, Clone)]
pub enum NotifySocket {
    Path(PathBuf),
    Abstract(Vec<u8>),
}

#[derive(Debug, thiserror::Error)]
pub enum WatchdogError {
    #[error(
        "--watchdog needs NOTIFY_SOCKET and WATCHDOG_USEC in the environment (systemd sets them for a unit with Type=notify and WatchdogSec=)"
    )]
    NotUnderSystemd,
    #[error("WATCHDOG_USEC=`{0}` is not a positive number of microseconds")]
    BadInterval(String),
}

impl NotifySocket {
    /// `$NOTIFY_SOCKET` and half of `$WATCHDOG_USEC`, as systemd documents.
    pub fn from_env() -> Result<(NotifySocket, Duration), WatchdogError> {
        let socket = std::env::var_os("NOTIFY_SOCKET").ok_or(WatchdogError::NotUnderSystemd)?;
        let usec = std::env::var("WATCHDOG_USEC").map_err(|_| WatchdogError::NotUnderSystemd)?;
        let us: u64 = usec
            .parse()
            .ok()
            .filter(|&u| u > 0)
            .ok_or(WatchdogError::BadInterval(usec))?;
        let bytes = socket.as_encoded_bytes();
        let target = match bytes.strip_prefix(b"@") {
            Some(name) => NotifySocket::Abstract(name.to_vec()),
            None => NotifySocket::Path(PathBuf::from(socket)),
        };
        Ok((target, Duration::from_micros(us / 2)))
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
    /// Sends `READY=1`, then `WATCHDOG=1` every `interval` while no worker is stalled.
    pub fn start(
        state: Arc<AdminState>,
        target: NotifySocket,
        interval: Duration,
    ) -> std::io::Result<Watchdog> {
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::Builder::new()
            .name("tailgate-watchdog".into())
            .spawn(move || {
                if let Err(e) = target.notify("READY=1") {
                    tracing::warn!(error = %e, "cannot notify systemd");
                }
                let mut was_stalled = false;
                while !stopping.load(Ordering::Relaxed) {
                    let stalled = state.stalled_workers();
                    if stalled.is_empty() {
                        if was_stalled {
                            tracing::info!("every worker is responsive again; feeding the watchdog");
                        }
                        if let Err(e) = target.notify("WATCHDOG=1") {
                            tracing::warn!(error = %e, "cannot notify systemd");
                        }
                    } else if !was_stalled {
                        tracing::error!(workers = ?stalled, "workers stalled; not feeding the systemd watchdog");
                    }
                    was_stalled = !stalled.is_empty();
                    sleep_unless_stopped(interval, &stopping);
                }
                let _ = target.notify("STOPPING=1");
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
