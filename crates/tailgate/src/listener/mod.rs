//! Listeners: sockets bound once per worker with SO_REUSEPORT (the kernel spreads new
//! connections over the workers, and several tailgate processes can share an address),
//! and the accept loop, which does nothing but accept and hand the connection off.

pub mod tls;

use std::net::SocketAddr;
use std::sync::Arc;

use socket2::{Domain, Protocol, Socket, Type};
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;

use crate::pipeline::Worker;
use crate::server::spawner::{ConnCount, ConnSlot, TenantSpawner};
use crate::server::{ConnCtx, DrainToken, serve_connection};

/// A listener's settings, shared by the workers.
pub struct BoundListener {
    pub name: String,
    pub addr: SocketAddr,
    pub tenant: Option<usize>,
    pub tls: Option<TlsAcceptor>,
}

/// Does another socket (another process: call this before this gateway binds `addr`)
/// already listen on `addr`? Bound with SO_REUSEPORT, this gateway would share its new
/// connections with it, which is what a restart that starts the new gateway before it
/// stops the old one wants, and what a forgotten old instance must not do unseen.
///
/// `dual_stack` as the socket will be bound ([`bind_unlistened`]): a dual-stack `[::]:P`
/// is taken by an IPv4 holder of P too, and an IPv4-mapped address binds only so.
pub fn taken_by_another(addr: SocketAddr, dual_stack: bool) -> bool {
    if addr.port() == 0 {
        return false;
    }
    let Ok(socket) = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))
    else {
        return false;
    };
    // SO_REUSEADDR but not SO_REUSEPORT: the bind fails only if something listens there.
    let _ = socket.set_reuse_address(true);
    if addr.is_ipv6() {
        let _ = socket.set_only_v6(!dual_stack);
    }
    matches!(socket.bind(&addr.into()), Err(e) if e.kind() == std::io::ErrorKind::AddrInUse)
}

/// Does the kernel move a closing listener's pending connections to another socket of its
/// SO_REUSEPORT group (`net.ipv4.tcp_migrate_req`, Linux 5.14 and later)? `None` when it
/// cannot tell (an older kernel, no `/proc`). When not, a gateway that stops while another
/// shares its address resets the connections whose handshake was not yet complete (their
/// client's last ACK still on its way) and those past what it takes from its queue at
/// shutdown: a restart refuses some connections after all.
pub fn migrates_pending_connections() -> Option<bool> {
    let v = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_migrate_req").ok()?;
    Some(v.trim() != "0")
}

/// Binds `addr` with SO_REUSEPORT (so that each worker can bind its own socket to it),
/// without listening yet: until it listens, the socket
/// takes no connection (the kernel leaves it out of the port's SO_REUSEPORT group), so a
/// start that fails later (another listener's certificate, a port taken) closes it without
/// resetting any connection, where a gateway it was to replace keeps serving.
///
/// An IPv6 address is bound IPv6-only, as listeners are, unless `dual_stack` (the admin
/// socket: `[::]` takes IPv4 too, and an IPv4-mapped address binds).
pub fn bind_unlistened(addr: SocketAddr, dual_stack: bool) -> std::io::Result<Socket> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    if addr.is_ipv6() {
        socket.set_only_v6(!dual_stack)?;
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    Ok(socket)
}

/// Listens on a socket of [`bind_unlistened`].
pub fn listen(socket: Socket) -> std::io::Result<std::net::TcpListener> {
    socket.listen(4096)?;
    Ok(socket.into())
}

/// Accepts until shutdown. Classifies the connection's tenant by listener (SNI and Host
/// come later, inside the connection task) and spawns it through the tenant spawner.
pub async fn accept_loop(
    socket: std::net::TcpListener,
    listener: Arc<BoundListener>,
    worker: Arc<Worker>,
    spawner: Arc<TenantSpawner>,
    mut shutdown: watch::Receiver<bool>,
    drain: DrainToken,
) {
    let socket = match tokio::net::TcpListener::from_std(socket) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(listener.name = %listener.name, error = %e, "cannot register listener");
            return;
        }
    };
    let conn_shutdown = shutdown.clone();
    let count = worker.shared.connections.clone();
    let spawn = |stream: tokio::net::TcpStream, peer: SocketAddr, slot: ConnSlot| {
        let ctx = ConnCtx {
            worker: worker.clone(),
            listener: listener.clone(),
            shutdown: conn_shutdown.clone(),
            drain: drain.clone(),
            slot: Some(slot),
        };
        spawner.spawn(listener.tenant, serve_connection(ctx, stream, peer));
    };
    loop {
        tokio::select! {
            biased;
            _ = async { let _ = shutdown.wait_for(|stop| *stop).await; } => break,
            accepted = socket.accept() => match accepted {
                Ok((stream, peer)) => {
                    // At `server.max_connections` this connection waits for a place, and
                    // the ones after it in the listen queue, as nothing more is accepted.
                    let slot = match count.try_take() {
                        Some(slot) => slot,
                        None => tokio::select! {
                            biased;
                            _ = async { let _ = shutdown.wait_for(|stop| *stop).await; } => {
                                // Served as the queued ones are at shutdown.
                                spawn(stream, peer, count.take_past_cap());
                                break;
                            }
                            slot = count.take(&listener.name) => slot,
                        },
                    };
                    spawn(stream, peer, slot);
                }
                // A connection that failed while it waited in the queue: the next one is
                // taken at once, as accept(2) asks, and nothing is wrong with this socket.
                Err(e) if failed_in_the_queue(&e) => {
                    tracing::debug!(listener.name = %listener.name, error = %e, "a queued connection failed before it was accepted");
                }
                Err(e) => {
                    // Out of file descriptors and the like: count it, say so now and then,
                    // and back off briefly instead of spinning on the error.
                    count.accept_failed(&listener.name, &e);
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    }
    // A TLS connection costs a handshake on this thread while the drain runs: fewer are
    // taken, so that the requests in flight are not held up behind them.
    let most = if listener.tls.is_some() {
        QUEUED_TLS_MAX
    } else {
        QUEUED_MAX
    };
    take_queued(socket, &listener.name, most, &count, spawn);
}

/// The most connections taken from one listen queue at shutdown: a backlog's worth (a
/// flood cannot hold the shutdown here), and for TLS listeners fewer, as each costs a
/// handshake (about a millisecond of this worker's time) while requests in flight finish.
const QUEUED_MAX: usize = 4096;
const QUEUED_TLS_MAX: usize = 256;

/// At shutdown, before the socket closes: the connections the kernel already queued for it
/// are taken and served (their request gets its answer, then they close), not reset by the
/// close. Another gateway sharing the address (SO_REUSEPORT) takes the ones that come after.
/// Bounded by what is queued now; past `server.max_connections` if need be (an accept that
/// fails, out of descriptors, ends it: the rest are reset as the socket closes).
fn take_queued(
    socket: tokio::net::TcpListener,
    name: &str,
    most: usize,
    count: &Arc<ConnCount>,
    spawn: impl Fn(tokio::net::TcpStream, SocketAddr, ConnSlot),
) {
    let Ok(socket) = socket.into_std() else {
        return;
    };
    for _ in 0..most {
        match socket.accept() {
            Ok((stream, peer)) => {
                // Past `server.max_connections` if need be: this is the last chance to answer
                // it rather than have it reset, and the open ones are closing.
                let slot = count.take_past_cap();
                let stream = stream
                    .set_nonblocking(true)
                    .and_then(|()| tokio::net::TcpStream::from_std(stream));
                match stream {
                    Ok(stream) => spawn(stream, peer, slot),
                    Err(e) => {
                        tracing::debug!(listener.name = %name, error = %e, "cannot serve a connection queued at shutdown")
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
            // One queued connection that failed: the ones behind it are still taken, as the
            // accept loop takes them (they would be reset when the socket closes).
            Err(e) if failed_in_the_queue(&e) => {
                tracing::debug!(listener.name = %name, error = %e, "a connection queued at shutdown failed before it was accepted");
            }
            Err(e) => {
                count.accept_failed(name, &e);
                return;
            }
        }
    }
}

/// Is an accept error one of the connection taken, not of the listening socket? Linux
/// passes a queued connection's pending network error on as `accept`'s own, and accept(2)
/// asks for these to be retried as `EAGAIN` is (nginx, too, takes the next connection at
/// once on `ECONNABORTED`). Anything else (out of descriptors or memory, above all) backs
/// off instead: retried at once, it would spin. (`EPERM` too: a security module that
/// refuses the accept leaves the connection queued, and each retry would meet it again.)
fn failed_in_the_queue(e: &std::io::Error) -> bool {
    use rustix::io::Errno;
    Errno::from_io_error(e).is_some_and(|n| {
        [
            Errno::CONNABORTED,
            Errno::PROTO,
            Errno::NETDOWN,
            Errno::NOPROTOOPT,
            Errno::HOSTDOWN,
            Errno::NONET,
            Errno::HOSTUNREACH,
            Errno::OPNOTSUPP,
            Errno::NETUNREACH,
        ]
        .contains(&n)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A queued connection's error is retried at once; the socket's own (out of file
    /// descriptors, of memory) and anything unknown back off.
    #[test]
    fn only_a_queued_connections_errors_are_retried_at_once() {
        use rustix::io::Errno;
        let err = |n: Errno| std::io::Error::from_raw_os_error(n.raw_os_error());
        for n in [Errno::CONNABORTED, Errno::PROTO, Errno::NETUNREACH] {
            assert!(failed_in_the_queue(&err(n)), "{n:?}");
        }
        for n in [
            Errno::MFILE,
            Errno::NFILE,
            Errno::NOBUFS,
            Errno::NOMEM,
            Errno::INVAL,
            Errno::PERM,
        ] {
            assert!(!failed_in_the_queue(&err(n)), "{n:?}");
        }
        assert!(!failed_in_the_queue(&std::io::Error::other("x")));
    }

    /// A socket bound but not listening takes no connection: a connect to its address is
    /// refused (nothing queued, so nothing reset when it closes); once it listens, one is
    /// taken.
    #[test]
    fn a_bound_socket_takes_connections_only_once_it_listens() {
        let s = bind_unlistened("127.0.0.1:0".parse().expect("address"), false).expect("bind");
        let addr = s
            .local_addr()
            .ok()
            .and_then(|a| a.as_socket())
            .expect("bound address");
        let refused = std::net::TcpStream::connect(addr).expect_err("not listening yet");
        assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);
        let l = listen(s).expect("listen");
        let _c = std::net::TcpStream::connect(addr).expect("listening");
        drop(l);
    }
}
