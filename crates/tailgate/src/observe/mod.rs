//! Step 7 of the pipeline: one [`Exchange`] record per request, handed to every observer
//! when the response ends (or is abandoned): the worker's [`metrics`] always, and the
//! configured observers (the access log; analytics later).

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use http::HeaderValue;

pub mod access_log;
pub mod lag;
pub mod metrics;
pub mod process;

use self::metrics::WorkerMetrics;

/// Per-stage timings of one request, so a slow request can be explained stage by stage.
#[derive(Debug, Clone, Copy, Default)]
pub struct StageTimings {
    /// Matching the route (and what comes before the upstream stage): `None` for a
    /// request refused before that ended (an early `413`, a small body that stalled).
    pub route: Option<Duration>,
    /// Authentication, when the route has it.
    pub auth: Option<Duration>,
    /// The rate limit check, when the route has one.
    pub rate_limit: Option<Duration>,
    /// Getting an upstream connection: a pool checkout, or a new connect.
    pub upstream_connect: Duration,
    /// From sending the request upstream to its response head.
    pub upstream_ttfb: Duration,
    /// From the start of the request to the end of the response body (of an upgrade: to
    /// the end of its tunnel).
    pub total: Duration,
    /// An upgrade's time to its `101` (its handshake), set before its tunnel starts. The
    /// latency histograms take it in place of `total`, which runs to the tunnel's end: a
    /// WebSocket's hours would swamp a route's request latencies. (Set first, it holds
    /// however the tunnel ends: a shutdown's end of the runtime finishes the exchange
    /// on drop.)
    pub handshake: Option<Duration>,
}

/// Everything known about one request/response exchange.
#[derive(Debug, Clone)]
pub struct Exchange {
    /// Empty when no observer takes exchanges (only observers read it, and it would be a
    /// reference taken and dropped per request for nothing).
    pub request_id: HeaderValue,
    pub client: IpAddr,
    pub tenant: Option<usize>,
    pub route: Option<usize>,
    pub method: http::Method,
    /// `/` when no observer takes exchanges, as [`request_id`](Self::request_id).
    pub uri: http::Uri,
    pub version: http::Version,
    pub status: u16,
    pub bytes_out: u64,
    /// Who sent it, for per-consumer series (the configured consumer header's value).
    pub consumer: Option<HeaderValue>,
    /// A pooled connection was reused (no connect paid).
    pub reused_connection: bool,
    /// Why it went wrong, if it did (a stable code).
    pub error: Option<&'static str>,
    pub timings: StageTimings,
}

/// Consumes finished exchanges. Called on the data-plane worker: must not block or wait.
pub trait Observer: Send + Sync {
    fn observe(&self, exchange: &Exchange);
}

/// The observers of one config version.
#[derive(Clone, Default)]
pub struct Observers(Arc<[Arc<dyn Observer>]>);

impl Observers {
    pub fn new(list: Vec<Arc<dyn Observer>>) -> Observers {
        Observers(list.into())
    }

    /// None configured (no access log): exchanges need not carry what only observers read.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn emit(&self, ex: &Exchange) {
        for o in self.0.iter() {
            o.observe(ex);
        }
    }
}

/// Per-connection state the server and the pipeline share: in-flight requests (so an idle
/// timeout never cuts an active exchange) and when the connection was last active.
#[derive(Debug)]
pub struct ConnActivity {
    in_flight: AtomicU32,
    /// Exchanges the client gave up on within a second of their start, before their
    /// response head (an HTTP/2 stream it reset): the measure of a rapid-reset attack
    /// ([`cancelled_early`](Self::cancelled_early)).
    cancelled_early: AtomicU32,
    epoch: Instant,
    last_active_ms: std::sync::atomic::AtomicU64,
    /// Response bodies that handed the client a piece and have not been asked for the next
    /// since: over HTTP/2, a stream whose client stopped taking data (its flow-control
    /// window shut) is not asked, and no write of the connection blocks to show it.
    waiting_on_client: AtomicU32,
    /// When the client last took a piece, or one started waiting, in ms from `epoch`.
    last_taken_ms: std::sync::atomic::AtomicU64,
    /// [`WRITE_BLOCKED`]: a write to the client is blocked (its bytes wait for the client
    /// to take them), as the connection's
    /// [`SendTimeout`](crate::server::send_timeout::SendTimeout) saw last. [`LINGERING`]:
    /// the connection is in its lingering close (its answers are written; what the client
    /// still sends is read out, so that the close is no reset). [`UNFRAMED`]: an answer
    /// whose body the connection's close ends is on its way, and a close before its whole
    /// is written must be a reset. [`SEND_TIMED_OUT`]: the client was cut off for taking no
    /// bytes. [`TUNNELLED`]: the connection was switched to another protocol, and its bytes
    /// are copied both ways (see [`set_tunnelled`](Self::set_tunnelled)). One byte beside a
    /// 32-bit count: the whole, with its `Arc`, stays in one 64-byte line.
    sending: AtomicU8,
}

const WRITE_BLOCKED: u8 = 1;
const LINGERING: u8 = 2;
const UNFRAMED: u8 = 4;
const SEND_TIMED_OUT: u8 = 8;
const READING_HEAD: u8 = 16;
const TUNNELLED: u8 = 32;

impl Default for ConnActivity {
    fn default() -> Self {
        ConnActivity {
            in_flight: AtomicU32::new(0),
            cancelled_early: AtomicU32::new(0),
            epoch: Instant::now(),
            last_active_ms: Default::default(),
            waiting_on_client: AtomicU32::new(0),
            last_taken_ms: Default::default(),
            sending: AtomicU8::new(0),
        }
    }
}

impl ConnActivity {
    pub fn begin(&self) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
    }

    pub fn end(&self) {
        self.end_at(Instant::now());
    }

    /// [`end`](Self::end) at a time the caller already read.
    pub fn end_at(&self, now: Instant) {
        self.last_active_ms.store(
            now.saturating_duration_since(self.epoch).as_millis() as u64,
            Ordering::Relaxed,
        );
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }

    /// Bytes of a request came, before any exchange began (a head or small body read in
    /// pieces): the idle timeout counts from now.
    pub fn touch(&self) {
        self.last_active_ms.store(self.ms_now(), Ordering::Relaxed);
    }

    /// How many exchanges the client gave up on before their response head.
    pub fn cancelled_early(&self) -> u32 {
        self.cancelled_early.load(Ordering::Relaxed)
    }

    fn ms_now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// A response body handed the client a piece, and waits to be asked for the next.
    pub fn piece_handed(&self) {
        if self.waiting_on_client.fetch_add(1, Ordering::Relaxed) == 0 {
            self.last_taken_ms.store(self.ms_now(), Ordering::Relaxed);
        }
    }

    /// The client took the piece a body handed it (the body is asked for the next).
    pub fn piece_taken(&self) {
        self.last_taken_ms.store(self.ms_now(), Ordering::Relaxed);
        self.waiting_on_client.fetch_sub(1, Ordering::Relaxed);
    }

    /// A write to the client that had been blocked went through: the client took bytes.
    /// A piece handed whole (a large one, or one behind hyper's write buffer) may take
    /// many such writes to go out to a slow reader that keeps reading; each moves the
    /// stall check's clock, as each would restart nginx's `send_timeout`, and the idle
    /// timeout's, which counts from when an answer has gone out (hyper's server ends an
    /// exchange once it holds the whole body, however much of it is still to be written),
    /// as nginx's `keepalive_timeout` does. (Only after a blocked write, so a client that
    /// keeps up costs no clock read per write.) Not after a write that failed.
    pub fn took_bytes(&self) {
        let now = self.ms_now();
        self.last_taken_ms.store(now, Ordering::Relaxed);
        self.last_active_ms.store(now, Ordering::Relaxed);
    }

    /// A body that was waiting for the client to take its piece ended. When others still
    /// wait (HTTP/2 streams), the stall clock starts again from now: it counted from the
    /// first of them, and a stream stalled a while after the one just ended (reset for
    /// its stall, say) would otherwise see its connection cut before its own reset came,
    /// and with it the client's other streams.
    pub fn piece_dropped(&self) {
        if self.waiting_on_client.fetch_sub(1, Ordering::Relaxed) > 1 {
            self.last_taken_ms.store(self.ms_now(), Ordering::Relaxed);
        }
    }

    /// A write to the client became blocked (`true`) or went through again (`false`).
    pub fn set_write_blocked(&self, blocked: bool) {
        if blocked {
            self.sending.fetch_or(WRITE_BLOCKED, Ordering::Relaxed);
        } else {
            self.sending.fetch_and(!WRITE_BLOCKED, Ordering::Relaxed);
        }
    }

    /// Part of a request head is in, held by the smuggling guard in front of hyper's
    /// server (`true`), or no longer (`false`). hyper's server sees none of a head until
    /// it is whole, so it would take the connection for idle meanwhile; the idle close
    /// waits while this is set (the header read timeout bounds such a head).
    pub fn set_reading_head(&self, on: bool) {
        if on {
            self.sending.fetch_or(READING_HEAD, Ordering::Relaxed);
        } else {
            self.sending.fetch_and(!READING_HEAD, Ordering::Relaxed);
        }
    }

    /// Is part of a request head in ([`set_reading_head`](Self::set_reading_head))?
    pub fn reading_head(&self) -> bool {
        self.sending.load(Ordering::Relaxed) & READING_HEAD != 0
    }

    /// The connection was switched to another protocol (`101 Switching Protocols`): from
    /// now on its bytes are a tunnel's, copied both ways, and shutting its write side (the
    /// upstream's end of stream passed on) is a half-close, not its close. It must not
    /// linger then: the lingering close reads out and drops what the client sends, while
    /// the tunnel's other direction still carries the client's bytes upstream.
    pub fn set_tunnelled(&self) {
        self.sending.fetch_or(TUNNELLED, Ordering::Relaxed);
    }

    /// Was the connection switched to another protocol
    /// ([`set_tunnelled`](Self::set_tunnelled))?
    pub fn tunnelled(&self) -> bool {
        self.sending.load(Ordering::Relaxed) & TUNNELLED != 0
    }

    /// The connection began its lingering close.
    pub fn set_lingering(&self) {
        self.sending.fetch_or(LINGERING, Ordering::Relaxed);
    }

    /// Is the connection still handing the client what it was answered (a write blocked
    /// on it, or a lingering close under way), with no request in flight? Answers whose
    /// last piece was produced may still be on their way: a close must not cut them.
    /// (Each is bounded: a write by the send timeout, a lingering close by its own limits.)
    pub fn still_sending(&self) -> bool {
        self.sending.load(Ordering::Relaxed) & (WRITE_BLOCKED | LINGERING) != 0
    }

    /// An answer goes out whose body the connection's close ends (HTTP/1.0, no length):
    /// until the connection's write side is shut after the whole of it
    /// ([`framed_by_close`](Self::framed_by_close)), any close is a reset, not a clean close
    /// that would make a cut body look whole to the client. However it is cut (the upstream
    /// fails, a timeout, the client stops reading, a shutdown's end).
    pub fn set_unframed(&self) {
        self.sending.fetch_or(UNFRAMED, Ordering::Relaxed);
    }

    /// The connection's write side was shut after its last answer: its close now ends that
    /// answer's body, whole.
    pub fn framed_by_close(&self) {
        self.sending.fetch_and(!UNFRAMED, Ordering::Relaxed);
    }

    /// Must the connection's close be a reset ([`set_unframed`](Self::set_unframed))?
    pub fn close_must_reset(&self) -> bool {
        self.sending.load(Ordering::Relaxed) & UNFRAMED != 0
    }

    /// The client was cut off for taking no response bytes for the send timeout: an
    /// exchange it ends is recorded as `send_timeout`, not `client_gone`.
    pub fn set_send_timed_out(&self) {
        self.sending.fetch_or(SEND_TIMED_OUT, Ordering::Relaxed);
    }

    fn send_timed_out(&self) -> bool {
        self.sending.load(Ordering::Relaxed) & SEND_TIMED_OUT != 0
    }

    /// When a client that took no response data while some waited for it is cut off:
    /// `idle` after it last took a piece; `None` while no body waits for it.
    pub fn stalled_deadline(&self, idle: Duration) -> Option<Instant> {
        if self.waiting_on_client.load(Ordering::Relaxed) == 0 {
            return None;
        }
        Some(self.epoch + Duration::from_millis(self.last_taken_ms.load(Ordering::Relaxed)) + idle)
    }

    /// When the connection may be closed for idleness, or `None` while a request is in flight.
    pub fn idle_deadline(&self, idle: Duration) -> Option<Instant> {
        if self.in_flight.load(Ordering::Relaxed) > 0 {
            return None;
        }
        Some(self.epoch + Duration::from_millis(self.last_active_ms.load(Ordering::Relaxed)) + idle)
    }
}

/// How soon after its start an exchange the client gives up on counts as given up on early
/// ([`ExchangeRecorder::client_gave_up`]): Envoy's `premature_reset_min_stream_lifetime`
/// default.
const EARLY: Duration = Duration::from_secs(1);

/// Builds the [`Exchange`] while the request runs; emits it exactly once, at `finish`,
/// `fail`, or drop (a client that went away mid-response).
pub struct ExchangeRecorder {
    ex: Option<Box<Exchange>>,
    started: Instant,
    observers: Observers,
    metrics: Option<Arc<WorkerMetrics>>,
    activity: Option<Arc<ConnActivity>>,
}

impl ExchangeRecorder {
    pub fn new(
        ex: Exchange,
        started: Instant,
        observers: Observers,
        metrics: Arc<WorkerMetrics>,
        activity: Arc<ConnActivity>,
    ) -> Self {
        activity.begin();
        metrics.request_started();
        ExchangeRecorder {
            ex: Some(Box::new(ex)),
            started,
            observers,
            metrics: Some(metrics),
            activity: Some(activity),
        }
    }

    /// Moves the recording out (to the response body, which ends it), leaving one here
    /// that records nothing.
    pub fn take(&mut self) -> Self {
        ExchangeRecorder {
            ex: self.ex.take(),
            started: self.started,
            observers: self.observers.clone(),
            metrics: self.metrics.take(),
            activity: self.activity.take(),
        }
    }

    /// The client gave the exchange up before its answer (an HTTP/2 stream it reset):
    /// counted on its connection ([`ConnActivity::cancelled_early`]) when that came within
    /// a second of its start (`EARLY`). One given up on later (a client's deadline passing
    /// while a slow upstream works) is a client's right, not an attack's mark.
    pub fn client_gave_up(&self) {
        if let Some(a) = &self.activity
            && self.started.elapsed() < EARLY
        {
            a.cancelled_early.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// When the exchange started.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// The client connection's activity, while the recording has it.
    pub fn activity(&self) -> Option<&ConnActivity> {
        self.activity.as_deref()
    }

    pub fn exchange_mut(&mut self) -> Option<&mut Exchange> {
        self.ex.as_deref_mut()
    }

    pub fn add_bytes_out(&mut self, n: u64) {
        if let Some(ex) = self.ex.as_mut() {
            ex.bytes_out += n;
        }
    }

    /// Counts `n` bytes from the client passed upstream outside a request body (a
    /// tunnel's) on the exchange's route, as a body's bytes are counted.
    pub fn add_bytes_in(&self, n: u64) {
        if let (Some(ex), Some(m)) = (&self.ex, &self.metrics) {
            m.slot(ex.route, ex.tenant).add_bytes_in(n);
        }
    }

    pub fn fail(&mut self, code: &'static str) {
        if let Some(ex) = self.ex.as_mut() {
            ex.error.get_or_insert(code);
        }
        self.finish();
    }

    pub fn finish(&mut self) {
        self.finish_at(Instant::now());
    }

    /// [`finish`](Self::finish) with the time already read by the caller.
    pub fn finish_at(&mut self, now: Instant) {
        if let Some(mut ex) = self.ex.take() {
            ex.timings.total = now.saturating_duration_since(self.started);
            if let Some(m) = &self.metrics {
                m.record(&ex);
            }
            self.observers.emit(&ex);
            if let Some(a) = &self.activity {
                a.end_at(now);
            }
        }
    }
}

thread_local! {
    /// Why the exchanges dropped now end, when the gateway itself ends them (an HTTP/2
    /// stream reset for its stalled client): see [`ending_as`].
    static ENDING_AS: std::cell::Cell<Option<&'static str>> = const { std::cell::Cell::new(None) };
}

/// Runs `end` (which drops what holds exchanges' recorders) with the exchanges it ends
/// recorded as `kind` rather than `client_gone`.
pub fn ending_as<R>(kind: &'static str, end: impl FnOnce() -> R) -> R {
    /// Puts the earlier reason back, even if `end` panics (the worker goes on).
    struct Restore(Option<&'static str>);
    impl Drop for Restore {
        fn drop(&mut self) {
            ENDING_AS.set(self.0);
        }
    }
    let _restore = Restore(ENDING_AS.replace(Some(kind)));
    end()
}

impl Drop for ExchangeRecorder {
    /// An exchange nobody finished: the client went away (`client_gone`), unless the
    /// gateway cut it off: for taking no response bytes for the send timeout
    /// (`send_timeout`), or as [`ending_as`] says.
    fn drop(&mut self) {
        if self.ex.is_some() {
            let kind = ENDING_AS.get().unwrap_or_else(|| {
                if self.activity.as_ref().is_some_and(|a| a.send_timed_out()) {
                    "send_timeout"
                } else {
                    "client_gone"
                }
            });
            if kind == "client_gone" && self.ex.as_ref().is_some_and(|ex| ex.status == 0) {
                self.client_gave_up();
            }
            self.fail(kind);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two HTTP/2 streams stalled a while apart: when the first one's piece is dropped (its
    /// reset), the connection's stall clock starts again for the one still waiting, so
    /// that stream's own reset comes before its connection is cut. It counted from the
    /// first stream's piece, and the connection was dropped with every other stream.
    #[test]
    fn a_dropped_piece_restarts_the_stall_clock_for_those_still_waiting() {
        let a = ConnActivity::default();
        let idle = Duration::from_secs(60);
        a.piece_handed();
        let first = a.stalled_deadline(idle).expect("a piece waits");
        a.piece_handed();
        std::thread::sleep(Duration::from_millis(20));
        a.piece_dropped();
        let after = a.stalled_deadline(idle).expect("one still waits");
        assert!(
            after >= first + Duration::from_millis(15),
            "the clock did not move: {:?}",
            after.saturating_duration_since(first)
        );
        a.piece_dropped();
        assert_eq!(a.stalled_deadline(idle), None);
    }

    /// A connection's activity, read and written on every request, stays with its `Arc`'s
    /// two counts in one 64-byte line (and one allocation size class).
    #[test]
    fn conn_activity_fits_one_line_with_its_arc() {
        assert!(std::mem::size_of::<ConnActivity>() + 16 <= 64);
    }

    /// A blocked write and a lingering close each keep the connection sending; the write's
    /// end clears only its own part.
    #[test]
    fn still_sending_follows_writes_and_linger() {
        let a = ConnActivity::default();
        assert!(!a.still_sending());
        a.set_write_blocked(true);
        assert!(a.still_sending());
        a.set_lingering();
        a.set_write_blocked(false);
        assert!(a.still_sending());
        let b = ConnActivity::default();
        b.set_write_blocked(true);
        b.set_write_blocked(false);
        assert!(!b.still_sending());
    }

    /// `ending_as` names the ending only while its closure runs: a nested one gives the
    /// outer name back, and a closure that panics leaves no name behind, so a later
    /// client's leaving is not recorded as a timeout on a worker that went on.
    #[test]
    fn ending_as_restores_the_earlier_reason_even_on_panic() {
        assert_eq!(ENDING_AS.get(), None);
        ending_as("total_timeout", || {
            assert_eq!(ENDING_AS.get(), Some("total_timeout"));
            ending_as("send_timeout", || {
                assert_eq!(ENDING_AS.get(), Some("send_timeout"));
            });
            assert_eq!(ENDING_AS.get(), Some("total_timeout"));
        });
        assert_eq!(ENDING_AS.get(), None);
        let panicked = std::panic::catch_unwind(|| {
            ending_as("send_timeout", || panic!("a drop that panics"));
        });
        assert!(panicked.is_err());
        assert_eq!(ENDING_AS.get(), None);
    }
}
