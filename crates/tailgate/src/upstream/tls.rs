//! TLS to upstreams (`https://` endpoints): rustls with aws-lc-rs, like the listeners.
//!
//! One [`rustls::ClientConfig`] per cluster is built at config load and shared (`Arc`) by
//! every worker's pools of that cluster, so they share its session cache: a replacement
//! connection (rotation, a warm spare, a retry) resumes the session of an earlier one
//! (TLS 1.3 tickets, TLS 1.2 session ids or tickets) instead of paying a full handshake —
//! seed 004's "cold connects cost" applies to TLS twice over. The cache takes a short lock
//! per *connect* (inside rustls), never per request.
//!
//! Default trust is the platform's store, read once at config load by
//! `rustls-native-certs`: it is what curl and the OS trust, includes private CAs an operator
//! installed with `update-ca-certificates`, and is updated by the OS rather than by
//! rebuilding tailgate (webpki-roots would compile in a fixed Mozilla list). There is no
//! "skip verification" switch: `tls_ca` names a private CA instead.

use std::sync::Arc;

use rustls::client::Resumption;
use rustls::{ClientConfig, RootCertStore};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

/// TLS sessions remembered per cluster (one entry per server name; each TLS 1.3 entry holds
/// a few single-use tickets).
const SESSION_CACHE_SIZE: usize = 256;

/// A cluster's TLS settings, resolved at config load.
#[derive(Debug, Clone)]
pub struct UpstreamTls {
    /// Shared by every worker's pools of the cluster, with its session cache.
    pub config: Arc<ClientConfig>,
    /// SNI and the name the certificate must match; `None`: each endpoint's own host (for
    /// an IP literal, its IP, checked against the certificate's IP SANs).
    pub server_name: Option<ServerName<'static>>,
}

/// Builds a cluster's client config. `alpn` is what the connections offer, in order.
pub fn client_config(
    roots: Arc<RootCertStore>,
    client_auth: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
    alpn: Vec<Vec<u8>>,
) -> Result<ClientConfig, rustls::Error> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    let mut config = match client_auth {
        Some((chain, key)) => builder.with_client_auth_cert(chain, key)?,
        None => builder.with_no_client_auth(),
    };
    config.resumption = Resumption::in_memory_sessions(SESSION_CACHE_SIZE);
    config.alpn_protocols = alpn;
    Ok(config)
}

/// The platform's trusted roots, and how many of its certificates could not be used.
pub fn system_roots() -> (RootCertStore, usize) {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    let (_, bad) = roots.add_parsable_certificates(found.certs);
    (roots, bad + found.errors.len())
}

/// How a TLS handshake went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handshake {
    Full,
    Resumed,
}

/// A connector for one endpoint: the cluster's shared config and the name to verify.
#[derive(Clone)]
pub struct EndpointTls {
    connector: TlsConnector,
    server_name: ServerName<'static>,
}

impl EndpointTls {
    pub fn new(tls: &UpstreamTls, addr: std::net::SocketAddr) -> EndpointTls {
        EndpointTls {
            connector: TlsConnector::from(tls.config.clone()),
            server_name: tls
                .server_name
                .clone()
                .unwrap_or_else(|| ServerName::IpAddress(addr.ip().into())),
        }
    }

    /// Runs the client handshake over `tcp`.
    pub async fn handshake(
        &self,
        tcp: TcpStream,
    ) -> std::io::Result<(TlsStream<TcpStream>, Handshake)> {
        let stream = self
            .connector
            .connect(self.server_name.clone(), tcp)
            .await?;
        let kind = match stream.get_ref().1.handshake_kind() {
            Some(rustls::HandshakeKind::Resumed) => Handshake::Resumed,
            _ => Handshake::Full,
        };
        Ok((stream, kind))
    }
}
