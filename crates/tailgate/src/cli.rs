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
    #[error("error: SIGINT during the drain: stopped without waiting for the requests in flight")]
    Interrupted,
    #[error(
        "error: the workers had not stopped {0:?} after shutdown_grace ended (one is stuck); stopped without them"
    )]
    DrainStuck(std::time::Duration),
}

impl CliError {
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Config(_) | CliError::BadAddress(_) | CliError::Watchdog(_) => 2,
            CliError::Start(_)
            | CliError::Io(_)
            | CliError::Interrupted
            | CliError::DrainStuck(_) => 1,
        }
    }
}

/// `tailgate serve`: run until SIGTERM or SIGINT, then drain and return; a SIGINT during
/// the drain (Ctrl-C again) stops at once ([`CliError::Interrupted`]). Another SIGTERM does
/// not: service managers send one after their own stop command's.
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
    // Listened for from before the start: a signal while it waits (for DNS, say) stops the
    // gateway cleanly once it is up, instead of killing the process half-started.
    let mut signals = Signals::new()?;
    raise_open_files_limit();
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
    signals.wait();
    tracing::info!(grace = ?grace, "shutting down: no new connections; finishing requests in flight");
    let (done_tx, done) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("tailgate-drain".into())
        .spawn(move || {
            gateway.shutdown();
            gateway.join();
            let _ = done_tx.send(());
        })?;
    // Each worker ends its own drain when the grace period is over; one that is stuck (the
    // watchdog's case) never does, so the wait has an end of its own.
    match signals.wait_for(done, grace + DRAIN_MARGIN) {
        Drained::Done => {}
        Drained::Interrupted => {
            tracing::warn!(
                "SIGINT during the drain: stopping without waiting for the requests in flight"
            );
            return Err(CliError::Interrupted);
        }
        Drained::TimedOut => {
            tracing::error!(margin = ?DRAIN_MARGIN, "the workers had not stopped after shutdown_grace; stopping without them");
            return Err(CliError::DrainStuck(DRAIN_MARGIN));
        }
    }
    tracing::info!("stopped");
    Ok(())
}

/// `tailgate check`: validate and summarize, or list every error. Host-name endpoints
/// need a name server to ask, as `serve` does.
pub fn check(path: &Path) -> Result<(), CliError> {
    let c = Config::load(path)?;
    crate::upstream::dns::check_resolver(&c)?;
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
    // Signals are caught before it says it listens: a script that waits for that line and
    // then stops it gets a clean stop, not the signal's default action.
    let mut signals = Signals::new()?;
    let socket = std::net::TcpListener::bind(addr).map_err(|source| StartError::Bind {
        name: "demo-upstream".into(),
        addr,
        source,
    })?;
    socket.set_nonblocking(true)?;
    eprintln!("demo upstream listening on {}", socket.local_addr()?);
    let (tx, rx) = watch::channel(false);
    let thread = std::thread::spawn(move || crate::demo::run_blocking(socket, rx));
    signals.wait();
    let _ = tx.send(true);
    let _ = thread.join();
    Ok(())
}

/// Raises the soft limit on open files to the hard one, as nginx's `worker_rlimit_nofile`
/// and Go's runtime do: every client and upstream connection is a descriptor, and the usual
/// soft limit of 1024 would refuse connections (and upstream connects, and DNS sockets) long
/// before the hard limit a service manager grants. Logged either way.
fn raise_open_files_limit() {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    if limit.current == limit.maximum {
        tracing::debug!(open_files = ?limit.current, "open files limit");
        return;
    }
    let raised = Rlimit {
        current: limit.maximum,
        maximum: limit.maximum,
    };
    match setrlimit(Resource::Nofile, raised) {
        Ok(()) => {
            tracing::info!(from = ?limit.current, to = ?limit.maximum, "raised the open files limit to its hard limit");
        }
        Err(e) => {
            tracing::warn!(error = %e, open_files = ?limit.current, "cannot raise the open files limit; connections past it will be refused");
        }
    }
}

/// How long past `shutdown_grace` the process waits for its workers to stop.
const DRAIN_MARGIN: std::time::Duration = std::time::Duration::from_secs(5);

/// How a drain ended.
enum Drained {
    Done,
    /// SIGINT came first.
    Interrupted,
    /// The time allowed passed first.
    TimedOut,
}

/// SIGTERM and SIGINT, caught from when this is made; and SIGHUP, caught so that it does not
/// end the process (its default action). The configuration is not reloaded in place: a
/// SIGHUP, which an nginx operator or a unit's `ExecReload=kill -HUP` sends to reload, is
/// logged as ignored, and the gateway goes on with the configuration it has.
struct Signals {
    rt: tokio::runtime::Runtime,
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> std::io::Result<Signals> {
        use tokio::signal::unix::{SignalKind, signal};
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (term, int, hup) = {
            let _in = rt.enter();
            (
                signal(SignalKind::terminate())?,
                signal(SignalKind::interrupt())?,
                signal(SignalKind::hangup())?,
            )
        };
        Ok(Signals { rt, term, int, hup })
    }

    /// Until a signal comes (at once if one came since the last wait). Signals that came
    /// with it (a terminal's SIGINT and a wrapper's SIGTERM) are taken too: only one that
    /// comes later counts in [`Self::wait_for`].
    fn wait(&mut self) {
        let Signals { rt, term, int, hup } = self;
        rt.block_on(async {
            loop {
                tokio::select! {
                    _ = term.recv() => break,
                    _ = int.recv() => break,
                    _ = hup.recv() => tracing::warn!(
                        "SIGHUP ignored: the configuration is not reloaded in place; restart tailgate to apply a changed one"
                    ),
                }
            }
            // Whatever the signal driver has delivered by now, taken without waiting.
            tokio::task::yield_now().await;
            std::future::poll_fn(|cx| {
                while let std::task::Poll::Ready(Some(())) = term.poll_recv(cx) {}
                while let std::task::Poll::Ready(Some(())) = int.poll_recv(cx) {}
                std::task::Poll::Ready(())
            })
            .await;
        });
    }

    /// Until `done`, a SIGINT, or `limit`, whichever comes first; SIGTERMs meanwhile are
    /// taken and ignored.
    fn wait_for(
        &mut self,
        done: tokio::sync::oneshot::Receiver<()>,
        limit: std::time::Duration,
    ) -> Drained {
        let Signals { rt, term, int, .. } = self;
        rt.block_on(async {
            let mut done = std::pin::pin!(done);
            let mut limit = std::pin::pin!(tokio::time::sleep(limit));
            loop {
                tokio::select! {
                    _ = &mut done => return Drained::Done,
                    _ = int.recv() => return Drained::Interrupted,
                    _ = &mut limit => return Drained::TimedOut,
                    _ = term.recv() => {}
                }
            }
        })
    }
}
