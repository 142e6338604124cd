//! The request pipeline: what happens to every request, in the order of DESIGN.md.
//! [`handle`] is the one place that order is written down; each step says why it is there.
//!
//! 1. request id, start timestamps, size limits
//! 2. route: host + path + method → route → cluster
//! 3. authenticate            (a later stage plugs in here)
//! 4. rate limit              (a later stage plugs in here)
//! 5. upstream: pick an endpoint, check out a warm connection, send
//! 6. stream the response back (never buffered)
//! 7. observe: one Exchange record, emitted when the response ends

pub mod body;
pub mod error;
pub mod headers;
pub mod route;
pub mod spare;
pub mod tunnel;

use std::borrow::Cow;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::request::Parts;
use http::{HeaderValue, Request, Response, StatusCode, header};
use hyper_util::rt::TokioIo;

use self::body::{BytesIn, ReadWait, ReqBody, ReqBodyError, RespBody, UpstreamBody};
use self::error::ProxyError;
use self::headers::RequestIds;
use self::route::{Match, RouteEntry, RouteTable};
use crate::config::ServerSettings;
use crate::observe::metrics::WorkerMetrics;
use crate::observe::{ConnActivity, Exchange, ExchangeRecorder, Observers, StageTimings};
use crate::upstream::{NotSentBody, SendError, UpBody, Upstreams, hedge};

/// What every worker shares for one config version.
pub struct Shared {
    pub settings: ServerSettings,
    pub routes: RouteTable,
    /// Open client connections over every worker, against `server.max_connections`.
    pub connections: Arc<crate::server::spawner::ConnCount>,
    /// Set for `server.shutdown_delay` (see [`crate::Gateway::stop_ready`]): each
    /// keep-alive connection is asked to close at its next request, as Envoy's drain asks
    /// (HTTP/1.1: that answer says `Connection: close`; HTTP/2: GOAWAY), so that clients
    /// holding connections open move them to where a load balancer now sends new ones.
    pub leaving: std::sync::atomic::AtomicBool,
}

/// One data-plane worker: the shared config and this worker's own upstream pools.
pub struct Worker {
    pub shared: Arc<Shared>,
    pub upstreams: Upstreams,
    /// This worker's metrics (only it writes them; the admin thread renders them).
    pub metrics: Arc<WorkerMetrics>,
    /// The config version's observers, in an `Arc` of this worker's own: each request
    /// clones it (its recording holds it), and a count every worker wrote would move
    /// between their cores at each request.
    pub observers: Observers,
    /// Request ids, counted by this worker alone (for the same reason), under a prefix of
    /// its own.
    pub ids: RequestIds,
}

/// What the pipeline knows of the client connection a request came on.
pub struct ConnInfo {
    pub client: SocketAddr,
    /// The client's address as header text (`X-Forwarded-For`), rendered once per connection.
    pub client_addr: HeaderValue,
    pub tls: bool,
    /// The tenant the connection was classified to at accept (listener or SNI).
    pub tenant: Option<usize>,
    pub activity: Arc<ConnActivity>,
    /// Held while the connection (or a tunnel it became) lives; shutdown waits for it.
    pub drain: crate::server::DrainToken,
    /// Its place under `server.max_connections`, given back when the connection and any
    /// tunnel it became have ended.
    pub slot: Option<crate::server::spawner::ConnSlot>,
    /// Set when the HTTP/1 smuggling guard refused a head on a connection hyper's server
    /// reads (see [`crate::server::h1_guard`]).
    pub refused: std::sync::OnceLock<RefusedHead>,
    /// Requests taken on the connection so far, under `server.max_requests_per_connection`
    /// (not counted without one). Only the connection's task counts them.
    pub requests: std::sync::atomic::AtomicU64,
}

/// A head the HTTP/1 smuggling guard refused. In its place hyper's server is fed a
/// stand-in request, in order after the requests before it, carrying `token` (random, so
/// no client can send one) in the [`REFUSED_HEAD_HEADER`]; that request is answered with
/// `error` by [`refusal_response`].
pub struct RefusedHead {
    pub token: u64,
    pub error: ProxyError,
}

/// The header of the stand-in request that takes a refused head's place.
pub const REFUSED_HEAD_HEADER: &str = "tailgate-refused-head";

impl ConnInfo {
    /// Counts one more request taken on the connection: is it the last one allowed under
    /// `max`? With no cap (`max` 0) nothing is counted: no request pays for it.
    #[inline]
    pub fn count_request(&self, max: u64) -> bool {
        max != 0 && self.count_any_request(max)
    }

    /// [`count_request`](Self::count_request), counted whatever the cap: on hyper's
    /// servers (HTTP/2 above all), where the count also measures the share of a
    /// connection's requests its client gave up on before their answer (rapid reset, see
    /// `server::Drive`).
    #[inline]
    pub fn count_any_request(&self, max: u64) -> bool {
        let n = self.requests.load(std::sync::atomic::Ordering::Relaxed) + 1;
        self.requests.store(n, std::sync::atomic::Ordering::Relaxed);
        max != 0 && n >= max
    }

    /// The refusal this request stands in for, when it is the stand-in for a refused head.
    pub fn refused_head<B>(&self, req: &Request<B>) -> Option<&ProxyError> {
        let refused = self.refused.get()?;
        let token = req.headers().get(REFUSED_HEAD_HEADER)?.to_str().ok()?;
        (token.parse::<u64>().ok()? == refused.token).then_some(&refused.error)
    }
}

/// The answer to a request head refused before any server parsed it into a request (the
/// inline server's, or the smuggling guard's in front of hyper's): its JSON error, which
/// says `connection: close` as every malformed-request error does, recorded like a request (method `-`, target `*`, no route) for the
/// metrics and the access log before it is written, as every error is.
pub fn refusal_response(worker: &Worker, info: &ConnInfo, e: &ProxyError) -> Response<RespBody> {
    let shared = &worker.shared;
    let id = worker.ids.next();
    let mut rec = ExchangeRecorder::new(
        Exchange {
            request_id: id.clone(),
            client: info.client.ip(),
            tenant: info.tenant,
            route: None,
            method: http::Method::from_bytes(b"-").unwrap_or_default(),
            uri: http::Uri::from_static("*"),
            version: http::Version::HTTP_11,
            status: 0,
            bytes_out: 0,
            consumer: None,
            reused_connection: false,
            error: None,
            timings: StageTimings::default(),
        },
        Instant::now(),
        worker.observers.clone(),
        worker.metrics.clone(),
        info.activity.clone(),
    );
    error_answer(&mut rec, e, &id, &shared.settings.request_id_header, false)
}

/// The gateway's answer `e` to the exchange `rec` records: its JSON error carrying the
/// request id `id` (also in `header`), the body counted as bytes out as an upstream's would
/// be (none to HEAD, `head`), and the exchange ended with the error's code.
fn error_answer(
    rec: &mut ExchangeRecorder,
    e: &ProxyError,
    id: &HeaderValue,
    header: &http::HeaderName,
    head: bool,
) -> Response<RespBody> {
    if let Some(ex) = rec.exchange_mut() {
        ex.status = e.status().as_u16();
    }
    let (mut parts, body) = e.to_response(id, header).into_parts();
    let body = if head {
        parts
            .headers
            .insert(http::header::CONTENT_LENGTH, HeaderValue::from(body.len()));
        // No body to HEAD (its `Content-Length` says what a GET would get). The HTTP/1
        // servers would drop one, but over HTTP/2 neither hyper nor h2 knows the method:
        // a body would go out as DATA, which clients reset the stream for.
        RespBody::empty()
    } else {
        rec.add_bytes_out(body.len() as u64);
        RespBody::full(body)
    };
    rec.fail(e.code());
    Response::from_parts(parts, body)
}

/// The answer to a request whose head was read whole, refused with `e` before it is
/// forwarded (the inline server's small body that stopped coming), timed from `started`:
/// recorded with what its
/// head says (method, target, request id, consumer, route and tenant), as the same
/// refusal of a body hyper's server streams is. A request that no route takes gets the
/// routing's answer instead, as it would have before its body was read.
pub fn refuse_request(
    worker: &Worker,
    info: &ConnInfo,
    parts: Box<Parts>,
    e: ProxyError,
    started: Instant,
) -> Response<RespBody> {
    let shared = &worker.shared;
    let settings = &shared.settings;
    let id = worker
        .ids
        .keep_or_new(parts.headers.get(&settings.request_id_header));
    let (e, route, tenant) = match route_request(shared, info, &parts) {
        Ok((route, tenant)) => (e, Some(route.id), tenant),
        Err(NoRoute { error, tenant }) => (error, None, tenant),
    };
    let mut rec = ExchangeRecorder::new(
        Exchange {
            tenant,
            route,
            ..exchange_of(worker, info, &parts, &id)
        },
        started,
        worker.observers.clone(),
        worker.metrics.clone(),
        info.activity.clone(),
    );
    let head = parts.method == http::Method::HEAD;
    spare::give_head(parts);
    error_answer(&mut rec, &e, &id, &settings.request_id_header, head)
}

/// The record of the request `parts` on `conn`, before it is routed or answered.
#[inline(always)]
fn exchange_of(
    worker: &Worker,
    conn: &ConnInfo,
    parts: &Parts,
    request_id: &HeaderValue,
) -> Exchange {
    // The id and the target are for observers alone (the access log): not copied without.
    let observed = !worker.observers.is_empty();
    Exchange {
        request_id: if observed {
            request_id.clone()
        } else {
            HeaderValue::from_static("")
        },
        client: conn.client.ip(),
        tenant: conn.tenant,
        route: None,
        method: parts.method.clone(),
        uri: if observed {
            parts.uri.clone()
        } else {
            http::Uri::default()
        },
        version: parts.version,
        status: 0,
        bytes_out: 0,
        consumer: worker
            .metrics
            .plan
            .consumer_header
            .as_ref()
            .and_then(|h| parts.headers.get(h))
            // An empty name is none: Prometheus reads `consumer=""` as no label at all.
            .filter(|v| !v.is_empty())
            .cloned(),
        reused_connection: false,
        error: None,
        timings: StageTimings::default(),
    }
}

/// Why a request has no route: the error it is answered with, and the tenant it is
/// counted against.
struct NoRoute {
    error: ProxyError,
    tenant: Option<usize>,
}

/// The route a request takes, and the tenant it serves: the host decides the tenant, the
/// path and method the route. (A route without a tenant serves whichever tenant the Host,
/// or else the connection, names.)
#[inline(always)]
fn route_request<'a>(
    shared: &'a Shared,
    conn: &ConnInfo,
    parts: &Parts,
) -> Result<(&'a Arc<RouteEntry>, Option<usize>), NoRoute> {
    // A head that names no usable host or path counts against the connection's tenant.
    let refused = |error| NoRoute {
        error,
        tenant: conn.tenant,
    };
    let (host, upper) = match route::request_host(parts) {
        Ok(Some(host)) => host,
        // HTTP/1.0 did not require a Host (RFC 9112 §3.2 asks a 400 of HTTP/1.1 only):
        // routed as an empty one is, by the connection's tenant (nginx serves it from
        // the default server). `HAProxy`'s `option httpchk` sends such requests.
        Ok(None) if parts.version <= http::Version::HTTP_10 => ("", false),
        Ok(None) => return Err(refused(ProxyError::BadRequest("no Host header"))),
        Err(route::BadHost::Several) => {
            return Err(refused(ProxyError::BadRequest("more than one Host header")));
        }
        Err(route::BadHost::Invalid) => {
            return Err(refused(ProxyError::BadRequest("invalid Host header")));
        }
        Err(route::BadHost::InvalidTarget) => {
            return Err(refused(ProxyError::BadRequest(
                "invalid host in the request target (it must be host[:port], without user@)",
            )));
        }
    };
    let lower;
    let host = if upper {
        lower = host.to_ascii_lowercase();
        lower.as_str()
    } else {
        host
    };
    let path = match route::normal_path(parts.uri.path()) {
        Ok(path) => path,
        Err(bad) => return Err(refused(ProxyError::BadRequest(bad.message()))),
    };
    let host_tenant = shared.routes.tenant_of_host(host);
    // A connection classified to a tenant (its listener's, or its TLS SNI's) does not
    // serve another tenant's Host: that request is misdirected (RFC 9110 §15.5.20), and
    // a client that coalesced two names on one connection (HTTP/2) retries on a new one.
    // Routes of no tenant are still served.
    if let (Some(ct), Some(ht)) = (conn.tenant, host_tenant)
        && ct != ht
    {
        return Err(NoRoute {
            error: ProxyError::Misdirected,
            tenant: Some(ct),
        });
    }
    let found = shared
        .routes
        .lookup_with(host, host_tenant, &path, &parts.method, conn.tenant);
    // The path goes upstream as sent (unless the route rewrites it, in its normal form): a
    // server there that resolves no `..`, or takes no backslash or encoded slash for a `/`,
    // or neither, must find it under the route it took here, or the route's settings are
    // passed by (`/admin/x\..\..\public/y` is `/public/y` here and under `/admin/` to
    // nginx, Go or Node). Looked at only for a path whose normal form differs (rare).
    if let (Match::Found(r), Cow::Owned(normal)) = (&found, &path)
        && r.rewrite.as_ref().is_none_or(|w| w.to.is_none())
    {
        for reading in route::Reading::others_for(parts.uri.path()) {
            let same = match route::path_as_read(parts.uri.path(), reading) {
                Ok(read) if read.as_ref() == normal.as_str() => true,
                Ok(read) => matches!(
                    shared.routes.lookup_with(host, host_tenant, &read, &parts.method, conn.tenant),
                    Match::Found(f) if f.id == r.id
                ),
                // (A `..` above the root as that server reads it: it refuses the path, or
                // reads it as something else again.)
                Err(_) => false,
            };
            if !same {
                return Err(refused(ProxyError::BadRequest(
                    "the path is read under another route (or none) where its `..` segments, backslashes or encoded slashes are read otherwise, as servers behind may read them",
                )));
            }
        }
    }
    match found {
        Match::Found(r) => Ok((r, r.tenant.or(host_tenant).or(conn.tenant))),
        // Counted against the tenant the Host names, when it names one.
        Match::WrongMethod(allowed) => Err(NoRoute {
            error: ProxyError::MethodNotAllowed(allowed),
            tenant: host_tenant.or(conn.tenant),
        }),
        Match::NotFound => Err(NoRoute {
            error: ProxyError::NoRoute,
            tenant: host_tenant.or(conn.tenant),
        }),
    }
}

/// Runs one request through the pipeline. Never fails: every error becomes a response here.
///
/// The body comes as a [`ReqBody`] already limited to `max_body_bytes` by the server that
/// read the head (hyper's, or the inline HTTP/1.1 one). The head comes apart from it, in a
/// box: passed on by pointer, not copied into each level's part of the connection's future
/// (the inline server's box is memory from the allocator that a request freed a moment
/// ago, warm; callgrind counted 18 fewer last-level-cache write misses per request over 50
/// connections than with the whole request passed by value).
///
/// One future, not a wrapper around another: each level of nesting stores the inner
/// future beside its own state, which doubled the future's size (and what every request
/// moves and touches) per level.
///
/// A function returning an `async move` block rather than an `async fn`, as are the other
/// futures a request passes through (`forward`, the upstream connection's `send`, the
/// inline server's `write_response`): an `async fn` moves each argument it owns into a
/// local of its body on the first poll and keeps room for both in its future, where a
/// block uses what it captured in place. For the request (360 bytes) that was one more copy
/// into another part of the connection's future per level: callgrind counted 16 fewer
/// last-level-cache write misses per request over 50 connections without them (94 to 78).
#[allow(
    clippy::manual_async_fn,
    reason = "an `async fn` copies its arguments once more"
)]
pub fn handle(
    worker: Arc<Worker>,
    conn: Arc<ConnInfo>,
    parts: Box<Parts>,
    body: ReqBody,
) -> impl Future<Output = Result<Response<RespBody>, Infallible>> {
    async move {
        let started = Instant::now();
        let mut parts = parts;
        let sticky = sticky_upgrade(&parts);
        // Such a request's side of the switch: a `101`'s tunnel takes it, else the close
        // that follows the answer does ([`close_after_refused_upgrade`]).
        let upgrade_slot: UpgradeSlot =
            sticky.then(|| Arc::new(std::sync::Mutex::new(Some(upgrade_of(&mut parts)))));
        let shared = &worker.shared;
        let settings = &shared.settings;

        // 1. Request id first, so every response and log line from here on can carry it.
        let request_id = worker
            .ids
            .keep_or_new(parts.headers.get(&settings.request_id_header));
        let exchange = exchange_of(&worker, &conn, &parts, &request_id);
        let mut rec = ExchangeRecorder::new(
            exchange,
            started,
            worker.observers.clone(),
            worker.metrics.clone(),
            conn.activity.clone(),
        );
        // An answer to HEAD carries no body: its error body is not sent, nor counted.
        let head_request = parts.method == http::Method::HEAD;
        let fail = |rec: &mut ExchangeRecorder,
                    e: ProxyError|
         -> Result<Response<RespBody>, Infallible> {
            let header = &settings.request_id_header;
            // A body the client stopped sending (an HTTP/2 stream it reset) before any
            // answer: given up on, as a request dropped before its answer is.
            if matches!(e, ProxyError::ClientBodyEnded) {
                rec.client_gave_up();
            }
            let resp = error_answer(rec, &e, &request_id, header, head_request);
            if e.is_upstream() {
                tracing::debug!(request.id = request_id.to_str().unwrap_or("-"), error = %e, "upstream error");
            }
            Ok(close_after_refused_upgrade(resp, &conn, &upgrade_slot))
        };

        if parts.version == http::Version::HTTP_2
            && let Some(why) = h2_head_too_large(&parts, settings.max_header_bytes)
        {
            return fail(&mut rec, ProxyError::HeadTooLarge(why));
        }

        // 2. Route: the host decides the tenant, the path and method the route.
        let (route, tenant) = match route_request(shared, &conn, &parts) {
            // Borrowed from the worker this request holds: no count of the route's `Arc`,
            // which every worker's requests would write.
            Ok((route, tenant)) => (route, tenant),
            Err(NoRoute { error, tenant }) => {
                if let Some(ex) = rec.exchange_mut() {
                    ex.tenant = tenant;
                }
                return fail(&mut rec, error);
            }
        };
        if let Some(ex) = rec.exchange_mut() {
            ex.route = Some(route.id);
            ex.tenant = tenant;
        }

        // Size limit on the declared body: refuse before reading a byte of it (413),
        // recorded under its route, as a chunked body found too large on its way is.
        if settings.max_body_bytes > 0
            && let Some(len) = declared_length(&body)
            && len > settings.max_body_bytes
        {
            return fail(&mut rec, ProxyError::BodyTooLarge(settings.max_body_bytes));
        }

        // 3. Authenticate and 4. rate limit: not configured in this version.

        // 5.–6. Upstream, and the response streamed back.
        match forward(
            &worker,
            &conn,
            route,
            parts,
            body,
            &request_id,
            &mut rec,
            &upgrade_slot,
        )
        .await
        {
            Ok(resp) => Ok(close_after_refused_upgrade(resp, &conn, &upgrade_slot)),
            Err(e) => fail(&mut rec, e),
        }
    }
}

/// An HTTP/1 request that asks to switch protocols (any `Upgrade`, or `CONNECT`). The
/// smuggling guard stops reading framing after such a request, so unless the answer is
/// `101` the connection must close after it.
fn sticky_upgrade(parts: &Parts) -> bool {
    parts.version <= http::Version::HTTP_11
        && (parts.method == http::Method::CONNECT
            || headers::has_hop_by_hop(&parts.headers)
                && parts.headers.contains_key(header::UPGRADE))
}

/// The answer to a request that asked to switch protocols ([`sticky_upgrade`]), unless it is
/// `101`, says `Connection: close`: the smuggling guard stops following its framing.
///
/// hyper's server then hands such a connection over as if switched, unshut: a task takes it
/// and closes it with a lingering close, as any other (`server::linger`), so that a client
/// still sending (a body behind its upgrade request) reads the answer, not a reset.
fn close_after_refused_upgrade(
    mut resp: Response<RespBody>,
    conn: &Arc<ConnInfo>,
    slot: &UpgradeSlot,
) -> Response<RespBody> {
    if let Some(slot) = slot
        && resp.status() != StatusCode::SWITCHING_PROTOCOLS
    {
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        if let Some(on) = take_upgrade(slot) {
            let hold = conn.clone();
            tokio::spawn(async move {
                let _hold = hold;
                // The shut is the guard's lingering close (the connection asked for an
                // upgrade and is no tunnel): no second linger after it.
                if let Ok(io) = on.await {
                    let mut io = TokioIo::new(io);
                    let _ = tokio::io::AsyncWriteExt::shutdown(&mut io).await;
                }
            });
        }
    }
    resp
}

/// A sticky request's upgrade handle ([`sticky_upgrade`]), shared between the answer's path
/// (`forward`, for a `101`) and its close (`handle`'s error path too), both borrowing it
/// while the other may still; `None` for any other request. Behind an `Arc` so that every
/// request's future carries one pointer, not the lock and the handle: only requests that
/// ask to switch protocols allocate it.
type UpgradeSlot = Option<Arc<std::sync::Mutex<Option<hyper::upgrade::OnUpgrade>>>>;

/// The upgrade handle in `slot`, taken (once).
fn take_upgrade(
    slot: &std::sync::Mutex<Option<hyper::upgrade::OnUpgrade>>,
) -> Option<hyper::upgrade::OnUpgrade> {
    slot.lock().ok().and_then(|mut s| s.take())
}

/// The client's side of a protocol upgrade, which hyper's server keeps in the request's
/// extensions: taken through a request made around them, the rest put back.
fn upgrade_of(parts: &mut Parts) -> hyper::upgrade::OnUpgrade {
    let mut req = Request::new(());
    *req.extensions_mut() = std::mem::take(&mut parts.extensions);
    let on = hyper::upgrade::on(&mut req);
    parts.extensions = std::mem::take(req.extensions_mut());
    on
}

/// The body length the request declared (`Content-Length`), as its body already knows it
/// (the server framed the body by it, so no header lookup and parse again).
fn declared_length(body: &ReqBody) -> Option<u64> {
    http_body::Body::size_hint(body).exact()
}

/// (An `async move` block, not an `async fn`: see [`handle`].)
#[allow(
    clippy::manual_async_fn,
    reason = "an `async fn` copies its arguments once more"
)]
#[allow(
    clippy::too_many_arguments,
    reason = "the request's parts, borrowed from `handle`; a struct of them would be one more copy per request"
)]
fn forward(
    worker: &Worker,
    conn: &Arc<ConnInfo>,
    route: &Arc<RouteEntry>,
    mut parts: Box<Parts>,
    mut body: ReqBody,
    request_id: &HeaderValue,
    rec: &mut ExchangeRecorder,
    upgrade_slot: &UpgradeSlot,
) -> impl Future<Output = Result<Response<RespBody>, ProxyError>> {
    async move {
        let settings = &worker.shared.settings;
        let started = rec.started();
        // Upgrade, Connection and TE are hop-by-hop headers: most requests carry none, which
        // one pass over the names tells, sparing the lookups below.
        let hop = headers::has_hop_by_hop(&parts.headers);
        // Not in HTTP/1.0, where a server MUST ignore `Upgrade` (RFC 9110 §7.8; hyper
        // sets no upgrade up for one): it goes as a hop-by-hop header.
        let upgrade = hop
            && parts.version == http::Version::HTTP_11
            && headers::wants_upgrade(&parts.headers);
        let total_deadline = route.total_timeout.map(|t| started + t);

        // The upstream request: origin-form URI, the client's Host, hop-by-hop headers gone.
        // The Host to send, and whether the headers do not carry it: an absolute-form target
        // (or HTTP/2's `:authority`) routed the request, so its authority replaces any Host
        // the client sent (RFC 9112 §3.2.2).
        let (host_value, host_missing) = match parts.uri.authority() {
            // (`request_host` refused one with a `user@`.)
            Some(a) => (HeaderValue::from_str(a.as_str()).ok(), true),
            None => (parts.headers.get(header::HOST).cloned(), false),
        };
        // `TE: trailers` is kept for HTTP/2 upstreams (gRPC servers require it); the
        // connection drops it for HTTP/1.1 ones, where TE is hop-by-hop.
        let te_trailers = hop && headers::te_has_trailers(&parts.headers);
        // A `Connection` header may name `Host`: then it is put back below.
        let removed = hop && spare::remove_hop_by_hop(&mut parts.headers, upgrade);
        if te_trailers {
            parts
                .headers
                .insert(header::TE, HeaderValue::from_static("trailers"));
        }
        // Via, X-Forwarded-*, the request id; `Expect` is dropped (100-continue is answered to
        // the client here, when the body is first read). Written by the connection, not put in
        // the map (see `Added`).
        let added = headers::Added::new(
            &parts.headers,
            parts.version,
            &conn.client_addr,
            conn.tls,
            host_value.as_ref(),
            (&settings.request_id_header, request_id),
        );
        if (host_missing || removed && !parts.headers.contains_key(header::HOST))
            && let Some(h) = &host_value
        {
            parts.headers.insert(header::HOST, h.clone());
        }
        // Origin-form, as most requests already are (absolute-form and h2's scheme and
        // authority are dropped; the authority went to Host above).
        if parts.uri.scheme().is_some() || parts.uri.authority().is_some() {
            parts.uri = origin_form(&parts.uri);
        }
        if let Some(rw) = &route.rewrite {
            rw.apply(&mut parts, &route.path_prefix)
                .ok_or(ProxyError::BadRequest(
                    "the path cannot be rewritten into a valid target",
                ))?;
        }
        parts.version = http::Version::HTTP_11;
        // One clock read ends the route stage and starts the upstream one (the endpoint's
        // pick included); the retry budget's window and the pool's checkout take it too.
        let t_connect = Instant::now();
        // The tenant the request serves: its lane in an endpoint's connection queue.
        let mut tenant = None;
        if let Some(ex) = rec.exchange_mut() {
            ex.timings.route = Some(t_connect - started);
            tenant = ex.tenant;
        }
        let cluster = &worker.upstreams.clusters[route.cluster];
        // Held until the response ends (with its body, or its tunnel): past the cluster's
        // `max_requests` a request is refused at once, not queued behind a slow upstream.
        let mut admitted = cluster.admit()?;
        cluster.count_request_at(t_connect);
        let mut pool = cluster.pick(None)?;
        // A checkout that gave no connection: its time is the connect stage's, so that the
        // stage shows the connects that failed or timed out, not only those that worked.
        let connect_failed = |rec: &mut ExchangeRecorder| {
            if let Some(ex) = rec.exchange_mut() {
                ex.timings.upstream_connect = t_connect.elapsed();
            }
        };
        let mut in_flight = pool.load.start_at(t_connect);
        let mut retried = false;
        // Without a total deadline (most routes) the checkout is awaited as it is: wrapped,
        // it would be moved once more, and the request's future grow by a timer.
        let first = match total_deadline {
            None => cluster.checkout_at(&pool, t_connect, tenant).await,
            Some(d) => within(d, cluster.checkout_at(&pool, t_connect, tenant)).await,
        };
        let mut up = match first {
            Ok(up) => up,
            // Nothing was sent: trying another endpoint is always safe. One that left the
            // cluster while the request queued for it costs no retry budget (it is not a
            // failure, and its queue is let go once).
            Err(e)
                if (matches!(e, ProxyError::EndpointRemoved) && cluster.endpoint_count() > 0)
                    || (e.is_no_connection()
                        && cluster.has_other_address(pool.addr)
                        && cluster.try_spend_retry()) =>
            {
                in_flight.ended_by(&e);
                tracing::debug!(upstream.addr = %pool.addr, error = %e, "no connection to this endpoint; trying another");
                pool.count_retry();
                retried = true;
                pool = cluster.pick(Some(pool.addr))?;
                in_flight = pool.load.start();
                let second = match total_deadline {
                    None => cluster.checkout(&pool, tenant).await,
                    Some(d) => within(d, cluster.checkout(&pool, tenant)).await,
                };
                match second {
                    Ok(up) => up,
                    Err(e) => {
                        in_flight.ended_by(&e);
                        connect_failed(rec);
                        return Err(e);
                    }
                }
            }
            Err(e) => {
                in_flight.ended_by(&e);
                connect_failed(rec);
                return Err(e);
            }
        };
        // An upgrade (WebSocket) cannot cross an HTTP/2 connection: refuse it clearly rather
        // than send a plain request the client did not ask for.
        if upgrade && up.is_h2() {
            in_flight.abandoned();
            return Err(ProxyError::UpgradeNeedsHttp1);
        }
        // An idle HTTP/1.1 connection taken at the first try is taken without waiting: its
        // connect stage is nil (as nginx's `$upstream_connect_time` is for a kept-alive
        // connection), and the clock is not read again for it. After a failed connect, or
        // from a pool that may have waited (for an HTTP/2 connection, or in the queue of
        // `max_connections_per_endpoint`), it is read: the response deadline counts from
        // the send, not from before the wait.
        let (mut t_send, connect_time) = if up.reused && !retried && pool.reuse_never_waits() {
            (t_connect, Duration::ZERO)
        } else {
            let t = Instant::now();
            // The balancer's sample counts from the send, not from before the connect.
            in_flight.sent_at(t);
            (t, t - t_connect)
        };
        if let Some(ex) = rec.exchange_mut() {
            ex.timings.upstream_connect = connect_time;
            ex.reused_connection = up.reused;
        }

        // A reused connection may have been closed by the server just as the request was
        // written to it (Envoy #1979, hyper #2136): a bodiless idempotent request can then be
        // replayed on a fresh connection. On a route marked `idempotent`, a request with a body
        // can be too: a bounded copy is kept as it streams. An HTTP/2 upstream may refuse a
        // stream unprocessed (REFUSED_STREAM, GOAWAY): the request is sent again whatever its
        // method. The head is only borrowed by the sends, so it is at hand for that.
        let may_replay = up.reused && (route.idempotent || is_idempotent(&parts.method));
        let bodiless = http_body::Body::is_end_stream(&body);
        // On HTTP/2 every request with a body keeps a copy: a stream the server refused was
        // never processed, so even a POST with a body is sent again (from the bounded copy).
        let keep_copy = !bodiless && ((may_replay && route.idempotent) || up.is_h2());
        // Opt-in per route: a second copy to another endpoint if the head is slow to come.
        let hedge = hedge::Hedge::plan(
            route.hedge_delay,
            worker.upstreams.latency(route.id),
            cluster,
            pool.addr,
            &parts,
            &added,
            !upgrade && bodiless && (route.idempotent || is_idempotent(&parts.method)),
        )
        .map(|h| h.for_tenant(tenant));
        // The body is changed in place: a bodiless request (most) is not moved at all.
        let replay_copy = if keep_copy {
            let (kept, copy) = body.keep_copy(REPLAY_COPY_BYTES);
            body = kept;
            Some(copy)
        } else {
            None
        };
        if !bodiless {
            body = body.counting(BytesIn {
                metrics: worker.metrics.clone(),
                route: Some(route.id),
                tenant: rec.exchange_mut().and_then(|ex| ex.tenant),
            });
        }
        // The body to send again: none, or the whole copy (a body only partly kept is not).
        let replay_body = || match &replay_copy {
            Some(copy) => copy.body(),
            None => bodiless.then(ReqBody::empty),
        };

        let response_timeout = remaining(route.response_timeout, total_deadline);
        // The connect took what was left of the total: nothing is sent that the client
        // will be told timed out (a POST must not run upstream behind a 504).
        if response_timeout.is_zero() {
            in_flight.abandoned();
            return Err(ProxyError::UpstreamTimeout);
        }
        // Set when a hedge's answer won: what the first copy had come to.
        let mut hedged = None;
        let deadline = t_send + response_timeout;
        // A body still streaming from the client moves the response deadline on as it goes
        // (`BodyProgress`), never past the total deadline. One read whole with its head
        // (the inline server's, at most 8 KiB) goes out at once and needs no such care.
        if !bodiless && body.streams() {
            body = body.timed(t_send, route.response_timeout, total_deadline);
        }
        // The response is taken from the send's result where it lands, not wrapped and
        // unwrapped on its way (each step a copy of it, into another line of this future).
        let sent = match hedge {
            // The connection keeps the deadline itself: an HTTP/1.1 one re-arms a timer it
            // keeps from request to request, which costs no timer registration per request.
            None => up.send(&parts, &added, body, Some(deadline)).await,
            hedge => match tokio::time::timeout_at(
                deadline.into(),
                hedge::race(hedge, up.send(&parts, &added, body, None), deadline),
            )
            .await
            {
                Ok(hedge::Raced::Primary(r)) => r,
                Ok(hedge::Raced::Hedge(won, first)) => {
                    let (resp, conn) = *won;
                    // Silent for a whole response timeout (see the timeout below).
                    if first == hedge::First::TimedOut && response_timeout >= route.response_timeout
                    {
                        up.timed_out();
                    }
                    hedged = Some(first);
                    up = conn;
                    Ok(resp)
                }
                Err(_) => Err(SendError::TimedOut),
            },
        };
        let resp = match sent {
            Ok(resp) => resp,
            Err(SendError::TimedOut) => {
                in_flight.failed();
                // Silent for a whole response timeout, not for what the total deadline
                // left of one (a few milliseconds of a healthy server's thinking).
                if response_timeout >= route.response_timeout {
                    up.timed_out();
                }
                return Err(ProxyError::UpstreamTimeout);
            }
            Err(e) => {
                // A resend (connect included) gets a response timeout of its own from now,
                // as nginx gives the next upstream its own, cut short by the total deadline
                // when that comes first. What was left of the first send's would be
                // nothing after an upload that moved its deadline on as it went (a slow
                // one that kept moving), and the resend would end at once in a `504`.
                let left = || remaining(route.response_timeout, total_deadline);
                let (resent, moved, timing) = match e {
                    // The connection closed before the request was written: sending it
                    // again on a fresh connection is always safe, whatever the method.
                    SendError::NotSent(NotSentBody(body)) if up.reused => {
                        tracing::debug!(upstream.addr = %pool.addr, "pooled connection closed before the request was sent; resending on a new one");
                        send_on_new(cluster, &mut up, &parts, &added, body, left(), None).await
                    }
                    // Refused unprocessed by an HTTP/2 upstream: sending it again is safe
                    // whatever the method, and costs no retry budget (with its body only when
                    // the copy holds it whole).
                    e if e.refused_before_processing()
                        && let Some(body) = replay_body() =>
                    {
                        tracing::debug!(upstream.addr = %pool.addr, error = %e, "upstream refused the request unprocessed; resending on a new connection");
                        pool.count_refused_resend();
                        send_on_new(cluster, &mut up, &parts, &added, body, left(), None).await
                    }
                    // Written, then the connection failed before a response: replay it once
                    // on a fresh connection (idempotent and bodiless only; never a POST
                    // unless the route says its requests are idempotent, then with its body
                    // if it was read whole within the copy's limit). A malformed answer is an
                    // answer: the server had the request.
                    // (An HTTP/2 request keeps a copy of its body whatever its route, for
                    // a refused stream above; that copy is not for this.)
                    e if may_replay
                        && e.req_body_error().is_none()
                        && !e.malformed_response()
                        && (bodiless || route.idempotent)
                        && let Some(body) = replay_body()
                        && cluster.try_spend_retry() =>
                    {
                        // A stream the HTTP/2 server reset alone leaves its connection
                        // in use (the retry may go on it); any other failure retires it.
                        // A second copy of the body can be had then (made only if needed),
                        // in case that connection turns the retry away unsent.
                        let again: Option<&(dyn Fn() -> Option<ReqBody> + Sync)> =
                            e.stream_reset_only().then_some(&replay_body);
                        tracing::debug!(upstream.addr = %pool.addr, error = %e, same_connection_allowed = again.is_some(), "upstream connection failed under a request; retrying it");
                        pool.count_retry();
                        send_on_new(cluster, &mut up, &parts, &added, body, left(), again).await
                    }
                    e => (Ok(Err(e)), None, None),
                };
                // The resend went to another endpoint, since no connection to this one
                // could be had: this one's part ends with that failure, and the other's
                // begins.
                if let Some((first, to)) = moved {
                    in_flight.ended_by(&first);
                    pool = to;
                    in_flight = pool.load.start();
                }
                // No answer from the resend either: its connect failed, or its time ran
                // out. That counts against the endpoint, as on a first try (the first
                // failure, on a connection the server may just have closed, does not).
                let resent = match resent {
                    Ok(resent) => resent,
                    Err(e) => {
                        if matches!(e, ProxyError::UpstreamTimeout) {
                            in_flight.failed();
                        } else {
                            in_flight.ended_by(&e);
                        }
                        return Err(e);
                    }
                };
                // A stream refused unprocessed that could not be sent again (its body
                // streamed past what a copy holds) says the server is busy or closing, not
                // broken: not counted against the endpoint.
                let refused = matches!(&resent, Err(e) if e.refused_before_processing());
                // Its time ran out on its connection, as a first send's does.
                if matches!(resent, Err(SendError::TimedOut)) {
                    in_flight.failed();
                    // (A whole response timeout only without a total deadline, which may
                    // have cut the resend's short.)
                    if total_deadline.is_none() {
                        up.timed_out();
                    }
                    return Err(ProxyError::UpstreamTimeout);
                }
                // The exchange's connect and time to first byte are the resend's.
                if let Some(t) = timing {
                    t_send = t.sent_at;
                    if let Some(ex) = rec.exchange_mut() {
                        ex.timings.upstream_connect += t.connect;
                        ex.reused_connection = up.reused;
                    }
                }
                match resent.map_err(classify_send_error) {
                    Ok(resp) => resp,
                    Err(e) => {
                        if refused {
                            in_flight.abandoned();
                        } else if e.is_upstream() {
                            in_flight.failed();
                        } else {
                            in_flight.no_verdict();
                        }
                        return Err(e);
                    }
                }
            }
        };
        let t_head = Instant::now();
        // The request's head is done with (no retry or hedge sends it again from here): it
        // goes back to the worker for the next request to fill.
        spare::give_head(parts);
        match hedged {
            None => in_flight.responded_at(resp.status(), t_head),
            Some(hedge::First::Pending) => in_flight.abandoned(),
            Some(hedge::First::Answered(status)) => in_flight.responded_at(status, t_head),
            Some(hedge::First::Failed | hedge::First::TimedOut) => in_flight.failed(),
            Some(hedge::First::NoVerdict) => in_flight.no_verdict(),
        }
        // (Whether the server closes the connection after this response, the connection knows
        // from the head it parsed.)
        up.response_ok = resp.status().is_success() || resp.status().is_redirection();
        let ttfb = t_head - t_send;
        if let Some(l) = worker.upstreams.latency(route.id) {
            l.record(ttfb);
        }
        if let Some(ex) = rec.exchange_mut() {
            ex.timings.upstream_ttfb = ttfb;
            ex.status = resp.status().as_u16();
        }

        if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
            // A switch the client did not ask for cannot be passed on: the client would be
            // told the connection now speaks another protocol, with no tunnel behind it.
            let client_upgrade = match upgrade_slot {
                Some(slot) if upgrade => take_upgrade(slot),
                _ => None,
            };
            let Some(client_upgrade) = client_upgrade else {
                return Err(ProxyError::UpstreamReset(
                    "101 Switching Protocols to a request that did not ask to upgrade".into(),
                ));
            };
            let (mut parts, _) = resp.into_parts();
            if let Some(mut upstream) = up.into_upgraded() {
                conn.activity.set_tunnelled();
                let tunnel_conn = conn.clone();
                let idle = settings.idle_timeout;
                let admitted = admitted.take();
                // The exchange is the tunnel's to finish, when it ends (as nginx logs a
                // WebSocket when it closes): its bytes both ways are counted, and its
                // lifetime is its total (not its latency, see `StageTimings::handshake`).
                let handshake = rec.started().elapsed();
                if let Some(ex) = rec.exchange_mut() {
                    ex.timings.handshake = Some(handshake);
                }
                let rec = rec.take();
                tokio::spawn(async move {
                    let _hold = (tunnel_conn, admitted);
                    // Its bytes reach the exchange however the tunnel ends, this task
                    // dropped at the end of the grace period included.
                    let mut ex = tunnel::Exchange::new(rec);
                    match client_upgrade.await {
                        Ok(c) => {
                            let mut c = TokioIo::new(c);
                            let ended = tunnel::run(&mut c, &mut upstream, idle, &ex.counts).await;
                            ex.take_bytes();
                            // How it ended is the exchange's outcome, as a response cut
                            // short is: the `101` stays its status.
                            match ended {
                                None => ex.rec.finish(),
                                Some((side, e)) => {
                                    tracing::debug!(error = %e, ?side, "upgraded tunnel ended with an error");
                                    match side {
                                        tunnel::Side::Idle => ex.rec.fail("tunnel_idle_timeout"),
                                        tunnel::Side::Upstream => ex.rec.fail("upstream_reset"),
                                        // Dropped unfinished: `send_timeout` when the gateway
                                        // cut off a client that took no bytes, else
                                        // `client_gone`.
                                        tunnel::Side::Client => drop(ex),
                                    }
                                }
                            }
                        }
                        Err(e) => {
                            tracing::debug!(error = %e, "protocol upgrade failed");
                            drop(ex);
                        }
                    }
                });
            }
            spare::shrinking(&mut parts.headers, |h| {
                headers::remove_hop_by_hop(h, true);
                h.insert(settings.request_id_header.clone(), request_id.clone());
            });
            rec.finish();
            return Ok(Response::from_parts(parts, RespBody::empty()));
        }

        let (mut parts, body) = resp.into_parts();
        // (The map goes back to the worker once the head is written.)
        spare::shrinking(&mut parts.headers, |h| {
            headers::remove_hop_by_hop(h, false);
            h.insert(settings.request_id_header.clone(), request_id.clone());
        });
        let ended = match &body {
            UpBody::Hyper(b) => http_body::Body::is_end_stream(b),
            UpBody::H1 => up.body_done(),
        };
        if ended {
            // HEAD, 204, 304, `Content-Length: 0`: the connection goes back to the pool and
            // the exchange ends here.
            up.release(admitted.take());
            rec.finish();
            return Ok(Response::from_parts(parts, RespBody::empty()));
        }
        // A body that came whole with the head (a typical API answer): the connection goes
        // back to the pool now and the body is handed over as one piece, with no streaming
        // state (nor its allocation and polls) around it.
        if let UpBody::H1 = body
            && let Some(whole) = up.take_whole_body()
        {
            rec.add_bytes_out(whole.len() as u64);
            // The body came with the head: the head's reading ends the exchange too (no
            // clock read more for it).
            up.release_at(t_head, admitted.take());
            rec.finish_at(t_head);
            return Ok(Response::from_parts(parts, RespBody::full(whole)));
        }
        let deadline = total_deadline.map(|d| Box::pin(tokio::time::sleep_until(d.into())));
        // An answer with a body to an HTTP/1.0 client (none to HEAD, 1xx, 204 or 304).
        let bodied_http10 = rec.exchange_mut().is_some_and(|ex| {
            ex.version <= http::Version::HTTP_10 && ex.method != http::Method::HEAD
        }) && !parts.status.is_informational()
            && parts.status != StatusCode::NO_CONTENT
            && parts.status != StatusCode::NOT_MODIFIED;
        let recorder = rec.take();
        let body = Box::new(UpstreamBody {
            inner: body,
            conn: Some(up),
            deadline,
            read_wait: ReadWait::new(route.response_timeout),
            recorder,
            handed: false,
            admitted,
        });
        // To an HTTP/1.0 client a body of unknown length is ended by the connection's close
        // (either HTTP/1 server): a close before the whole of it went out must be a reset.
        // (Exactly when both servers frame it so: never on a connection kept alive after.)
        if bodied_http10 && body.size_hint().exact().is_none() {
            conn.activity.set_unframed();
        }
        Ok(Response::from_parts(parts, RespBody::Upstream(body)))
    }
}

/// The most of a request body kept for a replay (routes marked `idempotent`); a longer body
/// streams as usual but is not replayed.
const REPLAY_COPY_BYTES: usize = 64 * 1024;

/// Methods that may be sent twice without changing the outcome (RFC 9110 §9.2.2).
pub(crate) fn is_idempotent(m: &http::Method) -> bool {
    matches!(
        *m,
        http::Method::GET
            | http::Method::HEAD
            | http::Method::OPTIONS
            | http::Method::PUT
            | http::Method::DELETE
            | http::Method::TRACE
    )
}

/// What a resend on a new connection gives: the upstream's answer, or why none came.
type Resent = Result<Result<Response<UpBody>, SendError>, ProxyError>;

/// A resend's outcome, and, when it went to another endpoint, why the first endpoint gave
/// no connection and the endpoint it went to.
type ResentOn = (
    Resent,
    Option<(ProxyError, Arc<crate::upstream::EndpointPool>)>,
    Option<ResendTiming>,
);

/// When a resend was sent, and what getting its connection took (its replacement's
/// connect, or two): the exchange's connect stage and time to first byte are the resend's,
/// not a failed send's time taken for the upstream's.
#[derive(Clone, Copy)]
struct ResendTiming {
    connect: Duration,
    sent_at: Instant,
}

/// Sends the request again on `up`'s replacement (see `Conn::replacement`: a fresh
/// HTTP/1.1 connection, or a shared HTTP/2 one), its response due within `left` from now,
/// as a first send's is: the connection keeps the deadline, which a request body still
/// streaming moves on as it goes (and a client that stalls it is told so), where a fixed
/// timeout around it all cut a slow upload short with a `504` blamed on the upstream.
///
/// With `again` (a second copy of the body), `up`'s HTTP/2 connection may carry it (the
/// server reset only the request's stream); if that connection turns it away unsent (it
/// was closing after all: the server reset the stream, then went away) or refuses it
/// unprocessed, it goes once more, on a connection of its own.
///
/// When no connection to `up`'s endpoint can be had (the connect is refused or times out:
/// the server restarting, say), the request goes to another endpoint of `cluster`, as a
/// first try whose connect failed does: within the retry budget, and with the cluster's
/// names re-resolved early ([`replace_or_move`]).
///
/// A rare path: its state lives on the heap, so that it does not make every request's
/// future larger (and every move of it dearer).
fn send_on_new<'a>(
    cluster: &'a crate::upstream::ClusterPools,
    up: &'a mut crate::upstream::Conn,
    parts: &'a http::request::Parts,
    added: &'a headers::Added<'a>,
    body: ReqBody,
    left: Duration,
    again: Option<&'a (dyn Fn() -> Option<ReqBody> + Sync)>,
) -> std::pin::Pin<Box<impl std::future::Future<Output = ResentOn> + 'a>> {
    Box::pin(async move {
        let mut moved = None;
        let mut timing: Option<ResendTiming> = None;
        let deadline = Instant::now() + left;
        // The connection, within what is left of the time (a connect that would outlast it
        // is cut short there).
        let connect =
            async |up: &mut crate::upstream::Conn,
                   keep_h2: bool,
                   moved: &mut Option<(ProxyError, Arc<crate::upstream::EndpointPool>)>,
                   timing: &mut Option<ResendTiming>|
                   -> Result<(), ProxyError> {
                let t0 = Instant::now();
                let replaced = tokio::time::timeout_at(
                    deadline.into(),
                    replace_or_move(cluster, up, keep_h2, moved),
                )
                .await
                .unwrap_or(Err(ProxyError::UpstreamTimeout))?;
                *up = replaced;
                let t1 = Instant::now();
                let before = timing.map_or(Duration::ZERO, |t| t.connect);
                *timing = Some(ResendTiming {
                    connect: before + (t1 - t0),
                    sent_at: t1,
                });
                Ok(())
            };
        let resent = async {
            connect(up, again.is_some(), &mut moved, &mut timing).await?;
            let sent = up.send(parts, added, body, Some(deadline)).await;
            match sent {
                Err(e) if matches!(e, SendError::NotSent(_)) || e.refused_before_processing() => {
                    // (The copy is made only now.)
                    let Some(body) = again.and_then(|again| again()) else {
                        return Ok(Err(e));
                    };
                    tracing::debug!(upstream.addr = %up.pool.addr, error = %e, "the connection kept after a stream's reset turned the retry away; sending it on another");
                    if e.refused_before_processing() {
                        up.pool.count_refused_resend();
                    }
                    connect(up, false, &mut moved, &mut timing).await?;
                    Ok(up.send(parts, added, body, Some(deadline)).await)
                }
                sent => Ok(sent),
            }
        }
        .await;
        (resent, moved, timing)
    })
}

/// `up`'s replacement ([`crate::upstream::Conn::replacement`]); when its connect fails, a
/// connection to another endpoint of `cluster` (once, within the retry budget, only while
/// there is another), which `moved` then names with the first failure.
async fn replace_or_move(
    cluster: &crate::upstream::ClusterPools,
    up: &mut crate::upstream::Conn,
    keep_h2: bool,
    moved: &mut Option<(ProxyError, Arc<crate::upstream::EndpointPool>)>,
) -> Result<crate::upstream::Conn, ProxyError> {
    let e = match up.replacement(keep_h2).await {
        Ok(conn) => return Ok(conn),
        Err(e) if e.is_no_connection() => e,
        Err(e) => return Err(e),
    };
    let from = up.pool.addr;
    cluster.connect_failed(from, &e);
    if moved.is_some() || cluster.endpoint_count() < 2 || !cluster.try_spend_retry() {
        return Err(e);
    }
    let to = cluster.pick(Some(from))?;
    if to.addr == from {
        return Err(e);
    }
    tracing::debug!(upstream.addr = %from, error = %e, to = %to.addr, "no connection to this endpoint for a resend; sending it to another");
    up.pool.count_retry();
    // (In the lane of no tenant, under `max_connections_per_endpoint`: a rare path, after
    // a send that failed, which does not carry the request's tenant.)
    let conn = cluster.checkout(&to, None).await;
    *moved = Some((e, to));
    conn
}

/// A checkout (a connect, or a wait for an HTTP/2 connection's room) bounded by the route's
/// total deadline too, not only by the cluster's `connect_timeout`: a total of 500 ms gives
/// a `504` after 500 ms whatever the connect does.
async fn within<T>(
    total_deadline: Instant,
    checkout: impl Future<Output = Result<T, ProxyError>>,
) -> Result<T, ProxyError> {
    tokio::time::timeout_at(total_deadline.into(), checkout)
        .await
        .unwrap_or(Err(ProxyError::UpstreamTimeout))
}

/// The response timeout, cut short by the total deadline when that comes first.
fn remaining(timeout: Duration, total_deadline: Option<Instant>) -> Duration {
    match total_deadline {
        Some(d) => timeout.min(d.saturating_duration_since(Instant::now())),
        None => timeout,
    }
}

/// The most fields an HTTP/2 request's head may have (HTTP/1.1's parser takes 100 lines;
/// Envoy's `max_headers_count` is 100 for both). Past some 24,000 distinct names the
/// header map is full, and the gateway's own `Host` put into it panicked: a head of many
/// empty fields fits in a large `max_header_bytes`.
const H2_MAX_FIELDS: usize = 10_000;

/// Is an HTTP/2 request's head larger than `limit`, counted as the same head would be over
/// HTTP/1.1: its request line, then `name: value` and a line end for each field, the
/// cookie crumbs joined into one line (as they are sent upstream)? Or has it more than
/// [`H2_MAX_FIELDS`] fields? Why, if so.
fn h2_head_too_large(parts: &Parts, limit: usize) -> Option<&'static str> {
    if parts.headers.len() > H2_MAX_FIELDS {
        return Some("more than 10000 header fields");
    }
    let larger = Some("larger than max_header_bytes");
    let target = parts.uri.path_and_query().map_or(1, |p| p.as_str().len());
    let mut len = parts.method.as_str().len() + 1 + target + " HTTP/1.1\r\n".len();
    // `:authority`, which HTTP/1.1 sends as `Host`.
    if let Some(a) = parts.uri.authority() {
        len += "host: \r\n".len() + a.as_str().len();
    }
    let mut cookies = false;
    for (name, value) in &parts.headers {
        len += if name == http::header::COOKIE && cookies {
            // Another crumb: `; ` and its value, on the first's line.
            2 + value.len()
        } else {
            cookies |= name == http::header::COOKIE;
            name.as_str().len() + 2 + value.len() + 2
        };
        if len > limit {
            return larger;
        }
    }
    if len + 2 > limit { larger } else { None }
}

/// An error from sending upstream: a body too large or a client that went away is the
/// client's doing; anything else is the upstream's.
fn classify_send_error(e: SendError) -> ProxyError {
    match e.req_body_error() {
        Some(b) => client_body_error(b),
        None => ProxyError::UpstreamReset(e.into()),
    }
}

/// What reading the client's body failing is: the client's doing (too large, ended early,
/// stalled), before a response or cutting one short.
pub(crate) fn client_body_error(b: &ReqBodyError) -> ProxyError {
    match b {
        ReqBodyError::TooLarge(limit) => ProxyError::BodyTooLarge(*limit),
        ReqBodyError::Client(_) | ReqBodyError::LengthMismatch => ProxyError::ClientBodyEnded,
        ReqBodyError::TimedOut => ProxyError::ClientBodyTimeout,
    }
}

/// The origin-form of an absolute-form target: its path and query, with the path `/` when
/// the client gave none (`http://host?q` is `/?q`, RFC 9112 section 3.2.1; `http::Uri` keeps
/// such a target as `?q`, which no server takes as a request line or an HTTP/2 `:path`).
fn origin_form(uri: &http::Uri) -> http::Uri {
    match uri.path_and_query() {
        Some(pq) if pq.as_str().starts_with('?') => format!("/{}", pq.as_str())
            .parse()
            .unwrap_or_else(|_| http::Uri::from_static("/")),
        Some(pq) => http::Uri::from(pq.clone()),
        None => http::Uri::from_static("/"),
    }
}
