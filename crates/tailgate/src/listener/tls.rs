//! TLS for listeners: rustls with aws-lc-rs, certificate chain and key from PEM files,
//! ALPN offering h2 and http/1.1.

use std::sync::Arc;

use rustls::ServerConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;

use crate::config::TlsFiles;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read certificates from {path}: {source}")]
    Cert {
        path: String,
        source: rustls_pki_types::pem::Error,
    },
    #[error("cannot read the private key from {path}: {source}")]
    Key {
        path: String,
        source: rustls_pki_types::pem::Error,
    },
    #[error("no certificate in {path} (a PEM file with a `BEGIN CERTIFICATE` block)")]
    NoCert { path: String },
    #[error("invalid certificate or key: {0}")]
    Rustls(#[from] rustls::Error),
}

pub fn acceptor(files: &TlsFiles) -> Result<TlsAcceptor, TlsError> {
    let certs = CertificateDer::pem_file_iter(&files.cert)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|source| TlsError::Cert {
            path: files.cert.display().to_string(),
            source,
        })?;
    // (rustls would call an empty chain "peer sent no certificates".)
    if certs.is_empty() {
        return Err(TlsError::NoCert {
            path: files.cert.display().to_string(),
        });
    }
    let key = PrivateKeyDer::from_pem_file(&files.key).map_err(|source| TlsError::Key {
        path: files.key.display().to_string(),
        source,
    })?;
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    // HTTP/1.0 too (as nginx offers it): a client that offers only `http/1.0` (`curl
    // --http1.0` in some versions) would otherwise fail the handshake.
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec(), b"http/1.0".to_vec()];
    // Stateless session tickets (keys rotated every 6 hours), as nginx issues by default: a
    // returning client resumes without a full handshake however many clients came between.
    // rustls's default, a cache of 256 sessions two of which each handshake stores, forgot
    // a client after about 128 others.
    config.ticketer = rustls::crypto::aws_lc_rs::Ticketer::new()?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}
