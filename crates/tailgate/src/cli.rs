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
    #[error("error: the drain failed (its thread panicked); stopped without it")]
    DrainFailed,
    #[error("error: the demo upstream's thread panicked")]
    DemoFailed,
}

impl CliError {
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Config(_) | CliError::BadAddress(_) | CliError::Watchdog(_) => 2,
            CliError::Start(_)
            | CliError::Io(_)
            | CliError::Interrupted
            | CliError::DrainStuck(_)
            | CliError::DrainFailed
            | CliError::DemoFailed => 1,
        }
    }
}

/// `tailgate serve`: run until SIGTERM, SIGQUIT or SIGINT, then drain and return; a SIGINT
/// during the drain (Ctrl-C again) stops at once ([`CliError::Interrupted`]). Another
/// SIGTERM does not: service managers send one after their own stop command's. After a
/// SIGTERM or SIGQUIT, `server.shutdown_delay` comes first: `/readyz` says draining while
/// the listeners still accept.
/// With `watchdog`, systemd's watchdog is fed while every worker is responsive.
pub fn serve(path: &Path, watchdog: bool) -> Result<(), CliError> {
    let mut config = Config::load(path)?;
    let _log = crate::logging::init(&config.log);
    crate::logging::count_panics();
    let grace = config.server.shutdown_grace;
    let delay = config.server.shutdown_delay;
    let watchdog = if watchdog {
        Some(NotifySocket::from_env()?)
    } else {
        None
    };
    // Listened for from before the start: a signal while it waits (for DNS, say) stops the
    // gateway cleanly once it is up, instead of killing the process half-started.
    let mut signals = Signals::new()?;
    let open_files = raise_open_files_limit();
    if config.server.max_connections_unset {
        match connections_for(open_files) {
            Some(n) => {
                config.server.max_connections = n;
                tracing::info!(
                    max_connections = n,
                    open_files = open_files.unwrap_or_default(),
                    "server.max_connections not set: half of the open files limit (less {RESERVED_FILES} kept for the gateway's own)"
                );
            }
            None if open_files.is_some() => {
                tracing::warn!(
                    open_files = open_files.unwrap_or_default(),
                    "server.max_connections not set, and the open files limit is too low to derive one: no cap; connections past the limit will be refused"
                );
            }
            None => {}
        }
    }
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
    let delayed = signals.wait() == Stop::Term && !delay.is_zero();
    if delayed && gateway.never_ready() {
        // Probed and never ready (workers starting, clusters not warm within `warm_wait`):
        // no load balancer that probes it has it in rotation, nothing to wait out.
        tracing::info!(delay = ?delay, "stopping before /readyz ever said ready: no shutdown_delay");
    } else if delayed {
        gateway.stop_ready();
        tracing::info!(delay = ?delay, "stopping: /readyz says draining; still accepting for shutdown_delay before the drain");
        // Nothing ends this wait but the delay or a SIGINT: the sender is kept meanwhile.
        let (_keep, never) = tokio::sync::oneshot::channel();
        if let Drained::Interrupted = signals.wait_for(never, delay, false) {
            tracing::info!("SIGINT during shutdown_delay: draining now");
        }
    }
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
    match signals.wait_for(done, grace + DRAIN_MARGIN, true) {
        Drained::Done => {}
        Drained::Failed => {
            tracing::error!("the drain's thread panicked; stopping without it");
            return Err(CliError::DrainFailed);
        }
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
    let local = socket.local_addr()?;
    // Its runtime and listener are made before it says it listens: one that cannot be
    // made (out of descriptors) is an error and exit 1, not a line saying it listens and
    // a process that answers nothing.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let listener = {
        let _in = rt.enter();
        tokio::net::TcpListener::from_std(socket)?
    };
    eprintln!("demo upstream listening on {local}");
    let (tx, rx) = watch::channel(false);
    let thread = std::thread::Builder::new()
        .name("demo-upstream".into())
        .spawn(move || rt.block_on(crate::demo::serve(listener, rx)))?;
    signals.wait();
    let _ = tx.send(true);
    thread.join().map_err(|_| CliError::DemoFailed)
}

/// Raises the soft limit on open files to the hard one, as nginx's `worker_rlimit_nofile`
/// and Go's runtime do: every client and upstream connection is a descriptor, and the usual
/// soft limit of 1024 would refuse connections (and upstream connects, and DNS sockets) long
/// before the hard limit a service manager grants. Logged either way.
///
/// Returns the soft limit it leaves (`None`: no limit).
fn raise_open_files_limit() -> Option<u64> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    if limit.current == limit.maximum {
        tracing::debug!(open_files = ?limit.current, "open files limit");
        return limit.current;
    }
    let raised = Rlimit {
        current: limit.maximum,
        maximum: limit.maximum,
    };
    match setrlimit(Resource::Nofile, raised) {
        Ok(()) => {
            tracing::info!(from = ?limit.current, to = ?limit.maximum, "raised the open files limit to its hard limit");
            limit.maximum
        }
        Err(e) => {
            tracing::warn!(error = %e, open_files = ?limit.current, "cannot raise the open files limit; connections past it will be refused");
            limit.current
        }
    }
}

/// Descriptors kept out of the connections' share of the open files limit: listener
/// sockets, the runtimes' own, DNS sockets, the log, the admin plane's.
const RESERVED_FILES: u64 = 100;

/// `server.max_connections` when the config does not set it: half of what the open files
/// limit leaves after [`RESERVED_FILES`], as HAProxy derives its `maxconn` from `ulimit -n`
/// (each client connection may need an upstream one). Without a cap, clients could take
/// every descriptor: then upstream connects, DNS and TLS failed too, and every connection
/// open got a `502`, where at the cap new connections wait in the listen queue. `None`
/// under no limit, and under one too small to leave the connections a share worth a cap
/// (below twice [`RESERVED_FILES`]: a cap of a handful would refuse more than the limit).
fn connections_for(open_files: Option<u64>) -> Option<usize> {
    let open_files = open_files?;
    if open_files < 2 * RESERVED_FILES {
        return None;
    }
    let n = (open_files - RESERVED_FILES) / 2;
    Some(usize::try_from(n).unwrap_or(usize::MAX))
}

/// How long past `shutdown_grace` the process waits for its workers to stop.
const DRAIN_MARGIN: std::time::Duration = std::time::Duration::from_secs(5);

/// How a drain ended.
enum Drained {
    Done,
    /// What was waited for ended without saying it was done (the drain's thread panicked).
    Failed,
    /// SIGINT came first.
    Interrupted,
    /// The time allowed passed first.
    TimedOut,
}

/// What a stop was asked with.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// SIGTERM, or SIGQUIT (nginx's graceful stop): `shutdown_delay` first.
    Term,
    /// SIGINT (Ctrl-C): the drain at once.
    Int,
}

/// SIGTERM, SIGQUIT and SIGINT, caught from when this is made; and SIGHUP, SIGUSR1 and
/// SIGUSR2, caught so that they do not end the process (their default action). The
/// configuration is not reloaded in place: a SIGHUP, which an nginx operator or a unit's
/// `ExecReload=kill -HUP` sends to reload, is logged as ignored, and the gateway goes on
/// with the configuration it has. SIGUSR1 (nginx's log reopening, which a logrotate
/// `postrotate` sends) and SIGUSR2 are logged as ignored too: the logs go to standard error,
/// there is no file to reopen. SIGQUIT, which nginx takes for a graceful stop, is one here
/// too (its default action dumps core and cuts every request in flight).
struct Signals {
    rt: tokio::runtime::Runtime,
    term: tokio::signal::unix::Signal,
    quit: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
    usr1: tokio::signal::unix::Signal,
    usr2: tokio::signal::unix::Signal,
    /// When [`Self::wait`] saw the stop asked.
    asked_at: Option<std::time::Instant>,
}

/// A SIGINT this soon after the signal that asked the stop came with it (a terminal's
/// SIGINT and a wrapper's SIGTERM, sent together): it does not stop the drain. What
/// [`Signals::wait`] takes without waiting is not enough: the second of two signals sent
/// microseconds apart may reach the process after the first was taken, and cut every
/// request in flight.
const SIGNALS_TOGETHER: std::time::Duration = std::time::Duration::from_millis(250);

impl Signals {
    fn new() -> std::io::Result<Signals> {
        use tokio::signal::unix::{SignalKind, signal};
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (term, quit, int, hup, usr1, usr2) = {
            let _in = rt.enter();
            (
                signal(SignalKind::terminate())?,
                signal(SignalKind::quit())?,
                signal(SignalKind::interrupt())?,
                signal(SignalKind::hangup())?,
                signal(SignalKind::user_defined1())?,
                signal(SignalKind::user_defined2())?,
            )
        };
        Ok(Signals {
            rt,
            term,
            quit,
            int,
            hup,
            usr1,
            usr2,
            asked_at: None,
        })
    }

    /// Until a stop is asked (at once if one was since the last wait). Signals that came
    /// with it (a terminal's SIGINT and a wrapper's SIGTERM) are taken too: only one that
    /// comes later counts in [`Self::wait_for`]. A SIGINT among them says [`Stop::Int`].
    fn wait(&mut self) -> Stop {
        let Signals {
            rt,
            term,
            quit,
            int,
            hup,
            usr1,
            usr2,
            asked_at,
        } = self;
        let stop = rt.block_on(async {
            let mut stop = loop {
                tokio::select! {
                    _ = term.recv() => break Stop::Term,
                    _ = quit.recv() => break Stop::Term,
                    _ = int.recv() => break Stop::Int,
                    _ = hup.recv() => tracing::warn!(
                        "SIGHUP ignored: the configuration is not reloaded in place; restart tailgate to apply a changed one"
                    ),
                    _ = usr1.recv() => tracing::warn!(
                        "SIGUSR1 ignored: the logs go to standard error; there is no log file to reopen"
                    ),
                    _ = usr2.recv() => tracing::warn!("SIGUSR2 ignored"),
                }
            };
            // Whatever the signal driver has delivered by now, taken without waiting.
            tokio::task::yield_now().await;
            std::future::poll_fn(|cx| {
                while let std::task::Poll::Ready(Some(())) = term.poll_recv(cx) {}
                while let std::task::Poll::Ready(Some(())) = quit.poll_recv(cx) {}
                while let std::task::Poll::Ready(Some(())) = int.poll_recv(cx) {
                    stop = Stop::Int;
                }
                std::task::Poll::Ready(())
            })
            .await;
            stop
        });
        *asked_at = Some(std::time::Instant::now());
        stop
    }

    /// Until `done`, a SIGINT, or `limit`, whichever comes first; SIGTERMs and SIGQUITs
    /// meanwhile are taken and ignored, and so, with `drain`, is a SIGINT that came with the
    /// signal that asked the stop ([`SIGNALS_TOGETHER`]).
    fn wait_for(
        &mut self,
        done: tokio::sync::oneshot::Receiver<()>,
        limit: std::time::Duration,
        drain: bool,
    ) -> Drained {
        let Signals {
            rt,
            term,
            quit,
            int,
            asked_at,
            ..
        } = self;
        let together = |at: &Option<std::time::Instant>| {
            drain && at.is_some_and(|at| at.elapsed() < SIGNALS_TOGETHER)
        };
        rt.block_on(async {
            let mut done = std::pin::pin!(done);
            let mut limit = std::pin::pin!(tokio::time::sleep(limit));
            loop {
                tokio::select! {
                    r = &mut done => return if r.is_ok() { Drained::Done } else { Drained::Failed },
                    _ = int.recv() => {
                        if !together(asked_at) {
                            return Drained::Interrupted;
                        }
                        tracing::debug!("SIGINT with the signal that asked the stop: the drain goes on");
                    }
                    _ = &mut limit => return Drained::TimedOut,
                    _ = term.recv() => {}
                    _ = quit.recv() => {}
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cap left to connections by the open files limit: half of what is left after the
    /// gateway's own; none under no limit, or one too low for a cap to be worth it.
    #[test]
    fn the_default_connection_cap_is_half_the_open_files_left() {
        assert_eq!(connections_for(Some(1_048_576)), Some(524_238));
        assert_eq!(connections_for(Some(1024)), Some(462));
        assert_eq!(connections_for(Some(200)), Some(50));
        // Too few to leave the connections a share worth a cap.
        assert_eq!(connections_for(Some(199)), None);
        assert_eq!(connections_for(Some(96)), None);
        assert_eq!(connections_for(None), None);
    }
}
