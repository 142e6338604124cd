//! A port nothing listens on, for the tests of both crates (`tailgate-bench`'s include this
//! file by its path).
#![allow(dead_code)]
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;

/// A port nothing listens on, held while this lives: a socket bound to it that never
/// listens, so a connection to it is refused and no other test's server can take the port
/// meanwhile (a port only looked up and let go could be bound again before it is dialed).
pub struct DeadPort(#[allow(dead_code)] socket2::Socket, SocketAddr);

impl DeadPort {
    #[allow(dead_code)]
    pub fn addr(&self) -> SocketAddr {
        self.1
    }

    #[allow(dead_code)]
    pub fn port(&self) -> u16 {
        self.1.port()
    }
}

impl std::fmt::Display for DeadPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.1.fmt(f)
    }
}

pub fn dead_port() -> DeadPort {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    s.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .unwrap();
    let addr = s.local_addr().unwrap().as_socket().unwrap();
    DeadPort(s, addr)
}
