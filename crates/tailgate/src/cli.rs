//! What the `tailgate` subcommands do, as library functions the binary calls.

use std::net::SocketAddr;
use std::path::Path;

use tokio::sync::watch;

use crate::admin::watchdog::{NotifySocket, WatchdogError};
use crate::config::{Config, ConfigErrors};
use crate::gateway::{Gateway, StartError};

/// A subcommand failed; `Display` is the message for the terminal.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("{0}")]
    Config(#[from] ConfigErrors),
    #[error("error: {0}")]
    Start(#[from] StartError),
    #[error("error: {0}")]
    Io(#[from] std::io::Error),
    #[error("error: `{0}` is not an address; write e.g. 127.0.0.1:8081")]
    BadAddress(String),
    #[error("error: {0}")]
    Watchdog(#[from] WatchdogError),
}

impl CliError {
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Config(_) | CliError::BadAddress(_) | CliError::Watchdog(_) => 2,
            CliError::Start(_) | CliError::Io(_) => 1,
        }
    }
}

/// `tailgate serve`: run until SIGTERM or SIGINT, then drain and return.
/// With `watchdog`, systemd's watchdog is fed while every worker is responsive.
pub fn serve(path: &Path, watchdog: bool) -> Result<(), CliError> {
    let config = Config::load(path)?;
    let _log = crate::logging::init(&config.log);
    let grace = config.server.shutdown_grace;
    let watchdog = if watchdog {
        Some(NotifySocket::from_env()?)
    } else {
        None
    };
    let mut gateway = Gateway::start(config)?;
    if let Some((target, interval)) = watchdog {
        gateway.start_watchdog(target, interval)?;
        match interval {
            Some(i) => {
                tracing::info!(interval = ?i, "feeding the systemd watchdog while the workers are responsive")
            }
            None => {
                tracing::info!("notifying systemd (no WatchdogSec: readiness and stopping only)")
            }
        }
    }
    wait_for_signal()?;
    tracing::info!(grace = ?grace, "shutting down: no new connections; finishing requests in flight");
    gateway.shutdown();
    gateway.join();
    tracing::info!("stopped");
    Ok(())
}

/// `tailgate check`: validate and summarize, or list every error.
pub fn check(path: &Path) -> Result<(), CliError> {
    let c = Config::load(path)?;
    println!(
        "{}: ok ({} listeners, {} tenants, {} clusters, {} routes)",
        path.display(),
        c.listeners.len(),
        c.tenants.len(),
        c.clusters.len(),
        c.routes.len()
    );
    Ok(())
}

/// `tailgate demo-upstream`: the demo upstream on its own.
pub fn demo_upstream(listen: &str) -> Result<(), CliError> {
    let addr: SocketAddr = listen
        .parse()
        .map_err(|_| CliError::BadAddress(listen.to_owned()))?;
    let socket = std::net::TcpListener::bind(addr)?;
    socket.set_nonblocking(true)?;
    eprintln!("demo upstream listening on {}", socket.local_addr()?);
    let (tx, rx) = watch::channel(false);
    let thread = std::thread::spawn(move || crate::demo::run_blocking(socket, rx));
    wait_for_signal()?;
    let _ = tx.send(true);
    let _ = thread.join();
    Ok(())
}

fn wait_for_signal() -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        Ok(())
    })
}
