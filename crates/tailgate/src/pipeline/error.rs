//! Every error a request can meet, classified by source, mapped to a status code and a
//! JSON body in this one place before it reaches hyper.

use bytes::Bytes;
use http::{HeaderValue, StatusCode, header};

/// Why a request did not get an upstream response.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("no route matches this request")]
    NoRoute,
    #[error("method not allowed on this route")]
    MethodNotAllowed(Vec<http::Method>),
    #[error(
        "the Host names another tenant than the one this connection serves (its listener's or its TLS server name's)"
    )]
    Misdirected,
    #[error("malformed request: {0}")]
    BadRequest(&'static str),
    /// The client's body ended before its length, or its HTTP/2 stream was reset: a `400`
    /// (`bad_request`) like any malformed request, kept apart so that the exchange is
    /// recorded as given up by the client.
    #[error("malformed request: the client's body ended early")]
    ClientBodyEnded,
    #[error("request head too large: {0}")]
    HeadTooLarge(&'static str),
    #[error("{0}")]
    UriTooLong(&'static str),
    #[error("{0}")]
    NotImplemented(&'static str),
    #[error("request body larger than {0} bytes")]
    BodyTooLarge(u64),
    #[error("the client sent no more of its body within the response timeout")]
    ClientBodyTimeout,
    #[error("upstream connect failed: {0}")]
    UpstreamConnect(std::io::Error),
    #[error("upstream TLS handshake failed: {0}")]
    UpstreamTls(std::io::Error),
    #[error("upstream connect timed out")]
    ConnectTimeout,
    #[error("upstream closed or reset the connection: {0}")]
    UpstreamReset(Box<dyn std::error::Error + Send + Sync>),
    #[error("upstream did not answer in time")]
    UpstreamTimeout,
    #[error("cluster has no endpoints")]
    NoEndpoints,
    #[error("the cluster's max_requests are in flight; try again shortly")]
    UpstreamOverflow,
    #[error(
        "no connection to the upstream came free within the connect timeout (its max_connections_per_endpoint are busy); try again shortly"
    )]
    UpstreamQueueTimeout,
    #[error(
        "too many requests are queued for a connection to the upstream (its max_connections_per_endpoint are busy); try again shortly"
    )]
    UpstreamQueueFull,
    #[error(
        "the endpoint this request was queued for left its cluster (DNS) before a connection came free; try again shortly"
    )]
    EndpointRemoved,
    #[error(
        "a protocol upgrade (WebSocket) needs an HTTP/1.1 upstream; this cluster speaks HTTP/2"
    )]
    UpgradeNeedsHttp1,
}

impl ProxyError {
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::NoRoute => StatusCode::NOT_FOUND,
            ProxyError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            ProxyError::Misdirected => StatusCode::MISDIRECTED_REQUEST,
            ProxyError::BadRequest(_) | ProxyError::ClientBodyEnded => StatusCode::BAD_REQUEST,
            ProxyError::HeadTooLarge(_) => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ProxyError::UriTooLong(_) => StatusCode::URI_TOO_LONG,
            ProxyError::NotImplemented(_) => StatusCode::NOT_IMPLEMENTED,
            ProxyError::BodyTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::ClientBodyTimeout => StatusCode::REQUEST_TIMEOUT,
            ProxyError::UpstreamConnect(_)
            | ProxyError::UpstreamTls(_)
            | ProxyError::UpstreamReset(_)
            | ProxyError::NoEndpoints
            | ProxyError::UpgradeNeedsHttp1 => StatusCode::BAD_GATEWAY,
            ProxyError::ConnectTimeout | ProxyError::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::UpstreamOverflow
            | ProxyError::UpstreamQueueTimeout
            | ProxyError::UpstreamQueueFull
            | ProxyError::EndpointRemoved => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// A short, stable code for the JSON body, logs and metric labels.
    pub fn code(&self) -> &'static str {
        match self {
            ProxyError::NoRoute => "no_route",
            ProxyError::MethodNotAllowed(_) => "method_not_allowed",
            ProxyError::Misdirected => "misdirected_request",
            ProxyError::BadRequest(_) | ProxyError::ClientBodyEnded => "bad_request",
            ProxyError::HeadTooLarge(_) => "header_too_large",
            ProxyError::UriTooLong(_) => "uri_too_long",
            ProxyError::NotImplemented(_) => "not_implemented",
            ProxyError::BodyTooLarge(_) => "body_too_large",
            ProxyError::ClientBodyTimeout => "client_body_timeout",
            ProxyError::UpstreamConnect(_) => "upstream_connect_failed",
            ProxyError::UpstreamTls(_) => "upstream_tls_failed",
            ProxyError::ConnectTimeout => "upstream_connect_timeout",
            ProxyError::UpstreamReset(_) => "upstream_reset",
            ProxyError::UpstreamTimeout => "upstream_timeout",
            ProxyError::NoEndpoints => "no_endpoints",
            ProxyError::UpstreamOverflow => "upstream_overflow",
            ProxyError::UpstreamQueueTimeout => "upstream_queue_timeout",
            ProxyError::UpstreamQueueFull => "upstream_queue_full",
            ProxyError::EndpointRemoved => "endpoint_removed",
            ProxyError::UpgradeNeedsHttp1 => "upgrade_needs_http1",
        }
    }

    /// No connection to the endpoint could be had (refused, TLS failed, timed out):
    /// nothing was sent, so another endpoint may be tried.
    pub fn is_no_connection(&self) -> bool {
        matches!(
            self,
            ProxyError::UpstreamConnect(_)
                | ProxyError::UpstreamTls(_)
                | ProxyError::ConnectTimeout
        )
    }

    /// Is the fault the upstream's (vs. the client's or ours)?
    pub fn is_upstream(&self) -> bool {
        matches!(
            self,
            ProxyError::UpstreamConnect(_)
                | ProxyError::UpstreamTls(_)
                | ProxyError::ConnectTimeout
                | ProxyError::UpstreamReset(_)
                | ProxyError::UpstreamTimeout
                | ProxyError::NoEndpoints
        )
    }

    /// What the client is told: the error's text, but for a failed TLS handshake with an
    /// upstream, whose reason names the upstream certificate's names and addresses (and
    /// the cluster's `tls_server_name`), which are the operator's to read, in the log.
    fn client_message(&self) -> std::borrow::Cow<'static, str> {
        match self {
            ProxyError::UpstreamTls(_) => {
                "upstream TLS handshake failed (the gateway's log says why)".into()
            }
            e => e.to_string().into(),
        }
    }

    /// The response for this error: status, JSON body with the request id.
    pub fn to_response(
        &self,
        request_id: &HeaderValue,
        request_id_header: &http::HeaderName,
    ) -> http::Response<Bytes> {
        let body = serde_json::json!({
            "error": self.code(),
            "message": self.client_message(),
            "request_id": request_id.to_str().unwrap_or(""),
        });
        let mut resp = http::Response::new(Bytes::from(body.to_string()));
        *resp.status_mut() = self.status();
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        h.insert(request_id_header.clone(), request_id.clone());
        if matches!(
            self,
            ProxyError::UpstreamOverflow
                | ProxyError::UpstreamQueueTimeout
                | ProxyError::UpstreamQueueFull
                | ProxyError::EndpointRemoved
        ) {
            h.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if let ProxyError::MethodNotAllowed(methods) = self {
            let mut allow: Vec<&str> = methods.iter().map(http::Method::as_str).collect();
            allow.sort_unstable();
            allow.dedup();
            if let Ok(v) = HeaderValue::from_str(&allow.join(", ")) {
                h.insert(header::ALLOW, v);
            }
        }
        if matches!(
            self,
            ProxyError::BadRequest(_)
                | ProxyError::ClientBodyEnded
                | ProxyError::HeadTooLarge(_)
                | ProxyError::UriTooLong(_)
                | ProxyError::NotImplemented(_)
                | ProxyError::BodyTooLarge(_)
                // A body that stopped coming is left half read: the connection cannot
                // carry another request, and the client is told so.
                | ProxyError::ClientBodyTimeout
        ) {
            h.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}
