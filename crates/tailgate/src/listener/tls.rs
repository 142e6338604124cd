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
    #[error("cannot read the private key from {path}: {source}{why}")]
    Key {
        path: String,
        source: rustls_pki_types::pem::Error,
        /// What the file holds instead, when that is known (an encrypted key, DER).
        why: &'static str,
    },
    #[error("the private key in {path} cannot sign: {source}")]
    UnusableKey { path: String, source: rustls::Error },
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
        why: std::fs::read(&files.key).map_or("", |b| unread_key(&b)),
    })?;
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    // A key read but of a kind rustls cannot sign with (Ed448, a curve it has not): named
    // here, at the key, not as the pair's fault.
    provider
        .key_provider
        .load_private_key(key.clone_key())
        .map_err(|source| TlsError::UnusableKey {
            path: files.key.display().to_string(),
            source,
        })?;
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

/// Why a key file that was read holds no key `rustls` reads, where its bytes tell.
fn unread_key(file: &[u8]) -> &'static str {
    let has = |what: &[u8]| file.windows(what.len()).any(|w| w == what);
    if has(b"ENCRYPTED PRIVATE KEY") || has(b"Proc-Type: 4,ENCRYPTED") {
        " (the key is encrypted: write it out without a passphrase, e.g. `openssl pkey -in KEY -out key.pem`, and keep that file readable only by the gateway's user)"
    } else if !file.is_empty() && !has(b"-----BEGIN") {
        " (not PEM; if it is DER, convert it: `openssl pkey -inform DER -in KEY -out key.pem`)"
    } else {
        ""
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key file of each kind rustls cannot take: the error names the key file and why.
    #[test]
    fn a_key_that_cannot_be_used_is_named_with_why() {
        let ck = rcgen::generate_simple_self_signed(vec!["a.test".to_string()]).expect("cert");
        let dir = tempfile::tempdir().expect("tempdir");
        let cert = dir.path().join("cert.pem");
        std::fs::write(&cert, ck.cert.pem()).expect("write");
        let cases: [(&str, &[u8], &str); 3] = [
            (
                "encrypted.pem",
                b"-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIHsMFcGCSqGSIb3DQEFDTBK\n-----END ENCRYPTED PRIVATE KEY-----\n",
                "the key is encrypted",
            ),
            ("key.der", &[0x30, 0x82, 0x01, 0x22, 0x02, 0x01], "not PEM"),
            (
                // Ed448 (PKCS#8): read, but no key rustls signs with.
                "ed448.pem",
                b"-----BEGIN PRIVATE KEY-----\nMEcCAQAwBQYDK2VxBDsEORKGS7YT3kajUCO4I56cuASYEoAyWfolmj+hWs22Unx8\npdR3GKmdyT9HY0dLZVtN1rvKaR3o1Dm/8A==\n-----END PRIVATE KEY-----\n",
                "cannot sign",
            ),
        ];
        for (name, bytes, want) in cases {
            let key = dir.path().join(name);
            std::fs::write(&key, bytes).expect("write");
            let files = TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
            };
            let Err(e) = acceptor(&files) else {
                panic!("{name} taken");
            };
            let text = e.to_string();
            assert!(text.contains(want), "{name}: {text}");
            assert!(text.contains(&key.display().to_string()), "{name}: {text}");
            assert!(
                matches!(e, TlsError::Key { .. } | TlsError::UnusableKey { .. }),
                "{name}: {e:?}"
            );
        }
    }
}
