//! Starting and stopping a gateway: one OS thread per data-plane worker, each with its own
//! current-thread runtime, its own listener sockets (SO_REUSEPORT) and its own upstream
//! pools, so no request ever crosses a thread or takes a lock another worker holds.
//!
//! Shutdown is one signal threaded through every accept loop and connection: stop
//! accepting, let in-flight requests finish for up to `shutdown_grace`, then exit.

use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;

use tokio::runtime::Handle;
use tokio::sync::watch;

use crate::admin::watchdog::{NotifySocket, Watchdog};
use crate::admin::{Admin, AdminState};
use crate::observe::metrics::{MetricsPlan, WorkerMetrics};

use crate::config::Config;
use crate::listener::{self, BoundListener};
use crate::observe::access_log::AccessLog;
use crate::observe::{Observer, Observers};
use crate::pipeline::headers::RequestIds;
use crate::pipeline::route::RouteTable;
use crate::pipeline::{Shared, Worker};
use crate::server::DrainToken;
use crate::server::spawner::{ConnCount, TenantSpawner};
use crate::upstream::{ClusterShared, Upstreams};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr} (listener `{name}`): {source}")]
    Bind {
        name: String,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("listener `{name}`: {source}")]
    Tls {
        name: String,
        source: crate::listener::tls::TlsError,
    },
    #[error("cannot start a worker thread: {0}")]
    Thread(std::io::Error),
    #[error(
        "cannot resolve host-name endpoints: {0}; name the servers to ask in [dns] nameservers, or fix /etc/resolv.conf"
    )]
    Dns(String),
    #[error("cannot start the admin listener on {addr}: {source}")]
    Admin {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// A running gateway.
pub struct Gateway {
    shutdown: watch::Sender<bool>,
    threads: Vec<JoinHandle<()>>,
    /// Stops the demo upstreams, once the workers have drained.
    demo_stop: watch::Sender<bool>,
    demos: Vec<JoinHandle<()>>,
    listeners: Vec<(String, SocketAddr)>,
    workers: Vec<Arc<Worker>>,
    handles: Vec<Handle>,
    state: Arc<AdminState>,
    admin: Option<Admin>,
    watchdog: Option<Watchdog>,
    dns: crate::upstream::dns::Dns,
}

impl Gateway {
    /// Binds every listener and starts the workers; returns once the sockets are bound
    /// (connections are queued by the kernel from then on).
    pub fn start(config: Config) -> Result<Gateway, StartError> {
        let (shutdown, shutdown_rx) = watch::channel(false);
        let mut threads = Vec::new();

        // The demo upstream stops after the workers, not with them: requests still draining
        // at a shutdown may be waiting on it.
        let (demo_stop, demo_stop_rx) = watch::channel(false);
        let mut demos = Vec::new();
        // Bound here, listening only once the listeners do (below).
        let mut demo_sockets = Vec::new();
        for (i, &addr) in config.demos.iter().enumerate() {
            // Shared with SO_REUSEPORT as the listeners are, dual-stack as the admin socket
            // is: a second gateway started on a running one's config (a restart that refuses
            // no connection) serves its demo beside the first one's.
            let socket = crate::listener::bind_unlistened(addr, true).map_err(|source| {
                StartError::Bind {
                    name: format!("demo[{i}]"),
                    addr,
                    source,
                }
            })?;
            demo_sockets.push((i, addr, socket));
        }

        // Host-name endpoints: resolved once here (bounded wait), then refreshed on the
        // resolver's own thread. Before any listener listens: a connection the kernel queues
        // for this gateway must not wait out the resolution (a second gateway started on a
        // running one's addresses takes its share of connections from its first `listen`).
        let dns = crate::upstream::dns::Dns::start(&config, shutdown_rx.clone())?;
        // And the admin socket bound before them too, so that a bad admin address stops the
        // start before any client connection is taken (and then reset).
        let admin_bound = match &config.admin {
            Some(settings) => {
                let addr = settings.address;
                let shared = listener::taken_by_another(addr, true);
                let bound = crate::admin::bind(addr)
                    .map_err(|source| StartError::Admin { addr, source })?;
                // Only once bound beside it: one that does not share its address (without
                // SO_REUSEPORT, or another user's) fails the bind instead, and that error
                // is the one to read.
                if shared {
                    tracing::warn!(admin.addr = %addr, "another process already listens on the admin address: scrapes and probes are shared with it (SO_REUSEPORT) until it stops; stop it, unless this gateway is starting to replace it");
                }
                Some((addr, bound))
            }
            None => None,
        };

        // The workers' runtimes, before any listener listens (`runtime::build`).
        let workers = config.server.workers;
        let runtimes = (0..workers)
            .map(|_| crate::runtime::build())
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(StartError::Thread)?;
        // Every listener bound once per worker; the first bind fixes port 0 to a real port.
        // None listens before every one is bound and every certificate loaded: a start that
        // fails on a later listener must not take (and then reset) connections on an
        // earlier one, whose address a running gateway may share (SO_REUSEPORT).
        let mut unlistened: Vec<Vec<(socket2::Socket, Arc<BoundListener>)>> =
            (0..workers).map(|_| Vec::new()).collect();
        let mut listeners = Vec::new();
        for l in &config.listeners {
            let tls = match &l.tls {
                Some(files) => {
                    Some(
                        listener::tls::acceptor(files).map_err(|source| StartError::Tls {
                            name: l.name.clone(),
                            source,
                        })?,
                    )
                }
                None => None,
            };
            let mut addr = l.address;
            let shared = listener::taken_by_another(addr, false);
            let mut sockets = Vec::new();
            for _ in 0..workers {
                let s =
                    listener::bind_unlistened(addr, false).map_err(|source| StartError::Bind {
                        name: l.name.clone(),
                        addr,
                        source,
                    })?;
                if addr.port() == 0 {
                    addr = s
                        .local_addr()
                        .and_then(|a| {
                            a.as_socket()
                                .ok_or_else(|| std::io::Error::other("not an IP address"))
                        })
                        .map_err(|source| StartError::Bind {
                            name: l.name.clone(),
                            addr,
                            source,
                        })?;
                }
                sockets.push(s);
            }
            // Only once bound beside it (as for the admin address above).
            if shared {
                tracing::warn!(
                    listener.name = %l.name,
                    listener.addr = %addr,
                    "another process already listens on this address: new connections are shared with it (SO_REUSEPORT) until it stops; stop it, unless this gateway is starting to replace it"
                );
                if listener::migrates_pending_connections() == Some(false) {
                    tracing::warn!(
                        listener.name = %l.name,
                        "net.ipv4.tcp_migrate_req is 0: when the other process stops, the kernel resets the connections still in its handshake queue (and any it leaves in its accept queue) rather than handing them to this one; set it to 1 for restarts that refuse no connection"
                    );
                }
            }
            let bound = Arc::new(BoundListener {
                name: l.name.clone(),
                addr,
                tenant: l.tenant,
                tls,
            });
            for (w, s) in sockets.into_iter().enumerate() {
                unlistened[w].push((s, bound.clone()));
            }
            listeners.push((l.name.clone(), addr));
        }
        let mut per_worker: Vec<Vec<(std::net::TcpListener, Arc<BoundListener>)>> =
            (0..workers).map(|_| Vec::new()).collect();
        for (w, sockets) in unlistened.into_iter().enumerate() {
            for (s, bound) in sockets {
                let l = listener::listen(s).map_err(|source| StartError::Bind {
                    name: bound.name.clone(),
                    addr: bound.addr,
                    source,
                })?;
                per_worker[w].push((l, bound));
            }
        }
        // The demos last of all the sockets: a start that fails on one before takes no
        // connection on a demo address a running gateway shares. (The workers, whose warm
        // connections and first requests go to them, start after this.)
        for (i, addr, socket) in demo_sockets {
            let socket = crate::listener::listen(socket).map_err(|source| StartError::Bind {
                name: format!("demo[{i}]"),
                addr,
                source,
            })?;
            let rx = demo_stop_rx.clone();
            demos.push(
                std::thread::Builder::new()
                    .name("tailgate-demo".into())
                    .spawn(move || crate::demo::run_blocking(socket, rx))
                    .map_err(StartError::Thread)?,
            );
        }
        for (_, b) in per_worker.first().into_iter().flatten() {
            tracing::info!(listener.name = %b.name, listener.addr = %b.addr, tls = b.tls.is_some(), "listening");
        }

        let mut observers: Vec<Arc<dyn Observer>> = Vec::new();
        if config.log.access_log {
            observers.push(Arc::new(AccessLog {
                tenant_names: config.tenants.iter().map(|t| t.name.clone()).collect(),
                route_names: config.routes.iter().map(|r| r.name.clone()).collect(),
            }));
        }
        let shared = Arc::new(Shared {
            settings: config.server.clone(),
            routes: RouteTable::new(&config),
            connections: Arc::new(ConnCount::new(
                config.server.max_connections,
                config.tenants.len(),
            )),
            leaving: std::sync::atomic::AtomicBool::new(false),
        });
        let config = Arc::new(config);
        let plan = Arc::new(MetricsPlan::new(&config));

        let mut workers = Vec::new();
        let mut handles = Vec::new();
        let shared_clusters = ClusterShared::new(&config);
        for (i, (sockets, rt)) in per_worker.into_iter().zip(runtimes).enumerate() {
            let worker = Arc::new(Worker {
                upstreams: Upstreams::new(&config, &dns, &shared_clusters),
                shared: shared.clone(),
                metrics: Arc::new(WorkerMetrics::new(plan.clone())),
                observers: Observers::new(observers.clone()),
                ids: RequestIds::default(),
            });
            workers.push(worker.clone());
            let config = config.clone();
            let rx = shutdown_rx.clone();
            let (handle_tx, handle_rx) = std::sync::mpsc::sync_channel(1);
            threads.push(
                std::thread::Builder::new()
                    .name(format!("tailgate-worker-{i}"))
                    .spawn(move || run_worker(rt, worker, &config, sockets, rx, handle_tx))
                    .map_err(StartError::Thread)?,
            );
            if let Ok(h) = handle_rx.recv() {
                handles.push(h);
            }
        }
        let state = Arc::new(AdminState::new(
            config.clone(),
            plan,
            workers.clone(),
            dns.stats.clone(),
        ));
        let admin = match admin_bound {
            Some((addr, bound)) => Some(
                Admin::start(bound, state.clone())
                    .map_err(|source| StartError::Admin { addr, source })?,
            ),
            None => None,
        };
        Ok(Gateway {
            shutdown,
            threads,
            demo_stop,
            demos,
            listeners,
            workers,
            handles,
            state,
            admin,
            watchdog: None,
            dns,
        })
    }

    /// The admin listener's bound address, when one is configured.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin.as_ref().map(|a| a.addr)
    }

    /// What the admin plane reads (metrics, pools, readiness).
    pub fn admin_state(&self) -> &Arc<AdminState> {
        &self.state
    }

    /// Worker `i`'s runtime, to run a task on that worker (tests use it to stall one).
    pub fn worker_handle(&self, i: usize) -> Option<&Handle> {
        self.handles.get(i)
    }

    /// Starts notifying systemd: ready, stopping, and (with an `interval`) feeding its
    /// watchdog while no worker is stalled.
    pub fn start_watchdog(
        &mut self,
        target: NotifySocket,
        interval: Option<std::time::Duration>,
    ) -> std::io::Result<()> {
        self.watchdog = Some(Watchdog::start(self.state.clone(), target, interval)?);
        Ok(())
    }

    /// The bound address of a listener, by name (port 0 in the config resolved).
    pub fn listener_addr(&self, name: &str) -> Option<SocketAddr> {
        self.listeners
            .iter()
            .find(|(n, _)| n == name)
            .map(|&(_, a)| a)
    }

    /// Bound addresses of all listeners, in config order.
    pub fn listener_addrs(&self) -> Vec<SocketAddr> {
        self.listeners.iter().map(|&(_, a)| a).collect()
    }

    /// Sums one upstream pool statistic over every endpoint of every worker.
    pub fn pool_stat(&self, f: impl Fn(&crate::upstream::PoolStats) -> u64) -> u64 {
        self.workers.iter().map(|w| w.upstreams.sum(&f)).sum()
    }

    /// Sums one cluster statistic over every cluster of every worker.
    pub fn cluster_stat(&self, f: impl Fn(&crate::upstream::ClusterStats) -> u64) -> u64 {
        self.workers
            .iter()
            .map(|w| w.upstreams.sum_clusters(&f))
            .sum()
    }

    /// The resolver's counters (all zero when no endpoint is a host name).
    pub fn dns_stats(&self) -> &crate::upstream::dns::DnsStats {
        &self.dns.stats
    }

    /// Every endpoint pool of every worker (for stats and tests).
    pub fn endpoint_pools(&self) -> Vec<Arc<crate::upstream::EndpointPool>> {
        self.workers
            .iter()
            .flat_map(|w| {
                w.upstreams
                    .clusters
                    .iter()
                    .flat_map(|c| c.endpoints.load().iter().cloned().collect::<Vec<_>>())
            })
            .collect()
    }

    /// Was readiness probed and never said ready? (See [`AdminState::never_ready`].)
    pub fn never_ready(&self) -> bool {
        self.state.never_ready()
    }

    /// `/readyz` says the gateway is draining (503) from now, while it still accepts and
    /// serves: the first step of a shutdown with `server.shutdown_delay`.
    pub fn stop_ready(&self) {
        self.state
            .draining
            .store(true, std::sync::atomic::Ordering::Relaxed);
        // Every worker shares one `Shared`.
        if let Some(w) = self.workers.first() {
            w.shared
                .leaving
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Starts a graceful shutdown: stop accepting, let in-flight requests finish.
    pub fn shutdown(&self) {
        self.stop_ready();
        let _ = self.shutdown.send(true);
    }

    /// Waits until every worker has exited (after [`Gateway::shutdown`] and the drain).
    pub fn join(mut self) {
        for t in self.threads {
            let _ = t.join();
        }
        let _ = self.demo_stop.send(true);
        for t in self.demos {
            let _ = t.join();
        }
        if let Some(w) = self.watchdog {
            w.stop();
        }
        if let Some(a) = self.admin {
            a.stop();
        }
        self.dns.join();
    }
}

fn run_worker(
    rt: tokio::runtime::Runtime,
    worker: Arc<Worker>,
    config: &Config,
    sockets: Vec<(std::net::TcpListener, Arc<BoundListener>)>,
    mut shutdown: watch::Receiver<bool>,
    handle_tx: std::sync::mpsc::SyncSender<Handle>,
) {
    // This worker's log lines go over to the log thread in batches, at each tick of its
    // lag probe (see `logging`).
    crate::logging::batch_this_thread();
    let grace = worker.shared.settings.shutdown_grace;
    let spawner = Arc::new(TenantSpawner::new(config.tenants.len()));
    let metrics = worker.metrics.clone();
    rt.block_on(async move {
        let (drain, mut drained) = DrainToken::new();
        worker.upstreams.start_background();
        let probe_interval = config
            .admin
            .as_ref()
            .map_or(std::time::Duration::from_millis(10), |a| a.lag_probe_interval);
        tokio::spawn(crate::observe::lag::probe(worker.metrics.clone(), probe_interval));
        for (socket, listener) in sockets {
            tokio::spawn(listener::accept_loop(socket, listener, worker.clone(), spawner.clone(), shutdown.clone(), drain.clone()));
        }
        // Handed out only now: whatever is spawned through it queues behind the probe and
        // the accept loops (a task spawned first would run before the probe even started,
        // and a stall in it would go unmeasured).
        let _ = handle_tx.send(tokio::runtime::Handle::current());
        drop(drain);
        let _ = shutdown.wait_for(|stop| *stop).await;
        // Every token dropped (accept loops gone, connections closed) ends the wait.
        if tokio::time::timeout(grace, drained.recv()).await.is_err() {
            tracing::warn!(grace = ?grace, "shutdown grace passed with requests still in flight; closing them");
        }
    });
    metrics
        .exited
        .store(true, std::sync::atomic::Ordering::Relaxed);
    // Requests still in flight when the grace ran out end with the runtime's tasks: the
    // gateway cut them, no client went away.
    crate::observe::ending_as("shutdown", move || drop(rt));
    // The access log lines of the exchanges just ended, with the worker's last ones.
    crate::logging::flush_batch();
}
