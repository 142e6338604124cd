//! How a cluster talks to its endpoints: their scheme, the `protocol`, and the `tls_*` fields
//! checked and turned into one shared [`UpstreamTls`] at load, so that a missing file, bad
//! PEM or a certificate without its key is a `file:line:col` error rather than a failing
//! connect at runtime.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls::RootCertStore;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use toml::Spanned;

use super::HostPort;
use super::file::RawCluster;
use super::validate::Checker;
use crate::upstream::tls::{client_config, system_roots};
use crate::upstream::{Protocol, UpstreamTls};

/// Splits an endpoint's scheme off: `https://…` is TLS; `http://…` and a bare address are
/// plain HTTP. The rest keeps the endpoint's span, for errors about the address.
pub(super) fn strip_scheme(e: &Spanned<String>) -> (bool, Spanned<String>) {
    let text = e.get_ref();
    let (https, rest) = if let Some(r) = text.strip_prefix("https://") {
        (true, r)
    } else if let Some(r) = text.strip_prefix("http://") {
        (false, r)
    } else {
        (false, text.as_str())
    };
    (
        https,
        Spanned::new(e.span(), rest.trim_end_matches('/').to_owned()),
    )
}

/// The cluster's `protocol`: `"http1"` (default), `"http2"` (h2c by prior knowledge, or
/// ALPN `h2` over TLS), or `"auto"` (TLS only: ALPN offers both, the server picks).
pub(super) fn protocol(
    c: &mut Checker<'_>,
    cl: &RawCluster,
    i: usize,
    schemes: &[(bool, Range<usize>)],
) -> Protocol {
    let Some(v) = &cl.protocol else {
        return Protocol::Http1;
    };
    match v.get_ref().as_str() {
        "http1" => Protocol::Http1,
        "http2" => Protocol::Http2,
        "auto" if schemes.iter().all(|(https, _)| *https) => Protocol::Auto,
        "auto" => {
            c.err(
                Some(v.span()),
                format!("cluster[{i}].protocol"),
                "\"auto\" chooses by TLS ALPN, and these endpoints are plain HTTP".into(),
                Some("use \"http2\" for h2c by prior knowledge, \"http1\", or https:// endpoints"),
            );
            Protocol::Http1
        }
        other => {
            c.err(
                Some(v.span()),
                format!("cluster[{i}].protocol"),
                format!("`{other}` is not an upstream protocol"),
                Some("write \"http1\", \"http2\" or (for https:// endpoints) \"auto\""),
            );
            Protocol::Http1
        }
    }
}

/// The cluster's `http2_keepalive_interval` (default off, as Envoy's: gRPC servers, by
/// their default policy, answer a client that pings more than once in five minutes, or
/// while no call is open, with GOAWAY `too_many_pings`), refused on an HTTP/1.1 cluster
/// where it would do nothing.
pub(super) fn http2_keepalive(
    c: &mut Checker<'_>,
    cl: &RawCluster,
    i: usize,
    protocol: Protocol,
) -> Option<Duration> {
    let field = format!("cluster[{i}].http2_keepalive_interval");
    match &cl.http2_keepalive_interval {
        // (Not after a `protocol` refused: it was the field at fault, not this one.)
        Some(v)
            if protocol == Protocol::Http1
                && cl.protocol.as_ref().is_none_or(|p| p.get_ref() == "http1") =>
        {
            c.err(
                Some(v.span()),
                field,
                "has no effect: this cluster speaks HTTP/1.1".into(),
                Some("remove it, or set protocol = \"http2\" (or \"auto\" for https:// endpoints)"),
            );
            None
        }
        v => {
            let d = c.duration(v, field.clone(), Duration::ZERO);
            // A ping is sent this long after the last frame read, the answer to the last
            // one included: under a second, pings follow each other at the round trip's
            // pace, which servers answer by closing the connection.
            if !d.is_zero()
                && d < Duration::from_secs(1)
                && let Some(v) = v
            {
                c.err(
                    Some(v.span()),
                    field,
                    format!(
                        "`{}` would ping the server about as fast as it answers; servers close such a connection (GOAWAY `too_many_pings`)",
                        v.get_ref()
                    ),
                    Some("write \"1s\" or more (gRPC clients wait at least \"10s\"), or \"0s\" for no pings"),
                );
            }
            Some(d).filter(|d| !d.is_zero())
        }
    }
}

/// A cluster's endpoints as written: (is https, span) of each that parsed, and the host names
/// among them.
#[derive(Clone, Copy)]
pub(super) struct Written<'a> {
    pub schemes: &'a [(bool, Range<usize>)],
    pub hostnames: &'a [HostPort],
}

/// The cluster's TLS settings: `Some` when its endpoints are `https://`. `schemes` holds
/// (is https, span) of each endpoint that parsed.
pub(super) fn cluster_tls(
    c: &mut Checker<'_>,
    cl: &RawCluster,
    i: usize,
    base_dir: &Path,
    written: Written<'_>,
    protocol: Protocol,
    system: &mut Option<Arc<RootCertStore>>,
) -> Option<UpstreamTls> {
    let Written { schemes, hostnames } = written;
    let https = schemes.first().is_some_and(|(t, _)| *t);
    if let Some((_, span)) = schemes.iter().find(|(t, _)| *t != https) {
        c.err(
            Some(span.clone()),
            format!("cluster[{i}].endpoints"),
            "mixes https:// and plain HTTP endpoints".into(),
            Some("a cluster's endpoints share one scheme and one TLS setting; put the others in their own [[cluster]]"),
        );
        return None;
    }
    let fields = [
        ("tls_server_name", &cl.tls_server_name),
        ("tls_ca", &cl.tls_ca),
        ("tls_client_cert", &cl.tls_client_cert),
        ("tls_client_key", &cl.tls_client_key),
    ];
    if !https {
        for (name, v) in fields {
            if let Some(v) = v {
                c.err(
                    Some(v.span()),
                    format!("cluster[{i}].{name}"),
                    "is set but no endpoint uses TLS".into(),
                    Some("write the endpoints as \"https://IP:port\", or remove this field"),
                );
            }
        }
        return None;
    }

    let server_name = match &cl.tls_server_name {
        Some(_) => configured_name(c, cl, i),
        None => default_name(c, cl, i, schemes, hostnames)?,
    };

    let roots = match &cl.tls_ca {
        Some(v) => {
            let ca = roots_from_file(c, v, format!("cluster[{i}].tls_ca"), base_dir)?;
            Arc::new(ca)
        }
        None => match system {
            Some(r) => r.clone(),
            None => {
                let (roots, bad) = system_roots();
                if bad > 0 {
                    tracing::debug!(unusable = bad, "some system root certificates were skipped");
                }
                if roots.is_empty() {
                    let span = schemes.first().map(|(_, s)| s.clone());
                    c.err(
                        span,
                        format!("cluster[{i}].endpoints"),
                        "https endpoints need trusted roots, and none were found in the system store".into(),
                        Some("set tls_ca = \"path/to/ca.pem\", or install the system's CA certificates (SSL_CERT_FILE/SSL_CERT_DIR are honoured)"),
                    );
                    return None;
                }
                let roots = Arc::new(roots);
                *system = Some(roots.clone());
                roots
            }
        },
    };

    let client_auth = match (&cl.tls_client_cert, &cl.tls_client_key) {
        (None, None) => None,
        (Some(cert), None) => {
            c.err(
                Some(cert.span()),
                format!("cluster[{i}].tls_client_cert"),
                "a client certificate needs its private key".into(),
                Some("add tls_client_key = \"path/to/key.pem\""),
            );
            return None;
        }
        (None, Some(key)) => {
            c.err(
                Some(key.span()),
                format!("cluster[{i}].tls_client_key"),
                "a private key without a client certificate".into(),
                Some("add tls_client_cert = \"path/to/cert.pem\" (the chain, leaf first)"),
            );
            return None;
        }
        (Some(cert), Some(key)) => {
            let chain = certs_from_file(c, cert, format!("cluster[{i}].tls_client_cert"), base_dir);
            let key = key_from_file(c, key, format!("cluster[{i}].tls_client_key"), base_dir);
            Some((chain?, key?))
        }
    };

    match client_config(roots, client_auth, protocol.alpn()) {
        Ok(config) => Some(UpstreamTls {
            config: Arc::new(config),
            server_name,
        }),
        Err(e) => {
            // The roots were checked above: what remains is the client certificate and key.
            let span = cl.tls_client_key.as_ref().map(Spanned::span);
            c.err(
                span,
                format!("cluster[{i}].tls_client_key"),
                format!("the client certificate and key cannot be used together: {e}"),
                Some("check that the key is the private key of the first certificate in tls_client_cert"),
            );
            None
        }
    }
}

fn certs_from_file(
    c: &mut Checker<'_>,
    v: &Spanned<String>,
    field: String,
    base_dir: &Path,
) -> Option<Vec<CertificateDer<'static>>> {
    let path = c.existing_file(v, field.clone(), base_dir, "file")?;
    match CertificateDer::pem_file_iter(&path).and_then(|it| it.collect::<Result<Vec<_>, _>>()) {
        Ok(certs) if certs.is_empty() => {
            c.err(
                Some(v.span()),
                field,
                format!("no certificate in {}", path.display()),
                Some("the file must hold PEM blocks starting with `-----BEGIN CERTIFICATE-----`"),
            );
            None
        }
        Ok(certs) => Some(certs),
        Err(e) => {
            c.err(
                Some(v.span()),
                field,
                format!("cannot read certificates from {}: {e}", path.display()),
                Some("the file must hold PEM blocks starting with `-----BEGIN CERTIFICATE-----`"),
            );
            None
        }
    }
}

fn roots_from_file(
    c: &mut Checker<'_>,
    v: &Spanned<String>,
    field: String,
    base_dir: &Path,
) -> Option<RootCertStore> {
    let certs = certs_from_file(c, v, field.clone(), base_dir)?;
    let mut roots = RootCertStore::empty();
    for (n, cert) in certs.into_iter().enumerate() {
        if let Err(e) = roots.add(cert) {
            c.err(
                Some(v.span()),
                field,
                format!("certificate #{} is not a usable CA certificate: {e}", n + 1),
                Some("list only CA certificates (PEM) that sign the upstream's certificate"),
            );
            return None;
        }
    }
    Some(roots)
}

fn key_from_file(
    c: &mut Checker<'_>,
    v: &Spanned<String>,
    field: String,
    base_dir: &Path,
) -> Option<PrivateKeyDer<'static>> {
    let path = c.existing_file(v, field.clone(), base_dir, "private key")?;
    match PrivateKeyDer::from_pem_file(&path) {
        Ok(k) => Some(k),
        Err(e) => {
            c.err(
                Some(v.span()),
                field,
                format!("cannot read a private key from {}: {e}", path.display()),
                Some("the file must hold one PEM private key (`-----BEGIN PRIVATE KEY-----`, PKCS#8, PKCS#1 or SEC1)"),
            );
            None
        }
    }
}

/// `tls_server_name` as written, checked.
fn configured_name(c: &mut Checker<'_>, cl: &RawCluster, i: usize) -> Option<ServerName<'static>> {
    let v = cl.tls_server_name.as_ref()?;
    match ServerName::try_from(v.get_ref().as_str()) {
        Ok(n) => Some(n.to_owned()),
        Err(_) => {
            c.err(
                Some(v.span()),
                format!("cluster[{i}].tls_server_name"),
                format!("`{}` is not a DNS name or IP address", v.get_ref()),
                Some("write the name the upstream's certificate is issued for, e.g. \"api.internal.example\""),
            );
            None
        }
    }
}

/// The name to verify when `tls_server_name` is not set: each endpoint's own IP for IP
/// literals (`Some(None)`), or the host name when every endpoint is that one name (its
/// resolved addresses cannot say which name they came from, so several names, or names and
/// IPs together, need `tls_server_name`; `None` after an error).
fn default_name(
    c: &mut Checker<'_>,
    cl: &RawCluster,
    i: usize,
    schemes: &[(bool, Range<usize>)],
    hostnames: &[HostPort],
) -> Option<Option<ServerName<'static>>> {
    let Some(first) = hostnames.first() else {
        return Some(None);
    };
    let one_name =
        hostnames.iter().all(|h| h.host == first.host) && schemes.len() == hostnames.len();
    if !one_name {
        c.err(
            Some(cl.endpoints.span()),
            format!("cluster[{i}].endpoints"),
            "https:// endpoints of different host names (or names and IPs together) need one name to verify".into(),
            Some("set tls_server_name = \"…\" to the name the upstreams' certificates are issued for, or split the endpoints into clusters"),
        );
        return None;
    }
    match ServerName::try_from(first.host.clone()) {
        Ok(n) => Some(Some(n)),
        Err(_) => {
            c.err(
                Some(cl.endpoints.span()),
                format!("cluster[{i}].endpoints"),
                format!("`{}` cannot be verified as a TLS server name", first.host),
                Some("set tls_server_name to the name the upstream's certificate is issued for"),
            );
            None
        }
    }
}
