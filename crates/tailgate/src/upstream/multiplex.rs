//! HTTP/2 connections shared by every request of one endpoint on one worker. A request
//! takes a stream slot on the first connection with room under the server's
//! `SETTINGS_MAX_CONCURRENT_STREAMS`; a connection never goes back to an idle list.
//!
//! Rotation (`max_requests_per_connection` counts streams, `max_connection_lifetime`) hands
//! over gracefully: a connection that is due keeps taking streams until a successor is open
//! (the keeper opens it), then takes no new ones and closes once its streams end. A
//! connection the server closed or sent GOAWAY on is dropped from the set at once. One with
//! no stream for `idle_timeout` is dropped (closed once unused) beyond the warm ones.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use hyper::client::conn::http2;

use super::pool::{DIED_YOUNG, PoolStats};
use crate::pipeline::body::ReqBody;

/// What an HTTP/2 connection's transport and task publish for the requests sharing it.
#[derive(Debug)]
pub(super) struct H2Live {
    /// The server's concurrent-stream limit, as the connection's task last saw it.
    pub(super) max_streams: AtomicUsize,
    /// Reads that brought bytes from the server: a stream whose response timed out with
    /// none since it started was on a connection gone silent (see
    /// [`StreamSlot::silent_since_start`]).
    pub(super) reads: AtomicU64,
    /// The server's first bytes (its SETTINGS) have been read: `max_streams` is its word,
    /// not the value assumed until then.
    settled: std::sync::atomic::AtomicBool,
    /// Since when the server has allowed no stream (`SETTINGS_MAX_CONCURRENT_STREAMS` 0),
    /// in ms after `born`, plus 1 (0: it allows some).
    zero_since_ms: AtomicU64,
    born: Instant,
}

/// How long a connection whose server allows no stream is kept before the keeper replaces
/// it (behind a load balancer, a new connection may reach a server that takes streams):
/// a connect a second at most per endpoint and worker while the server refuses.
const REFUSING_FOR: Duration = Duration::from_secs(1);

impl H2Live {
    pub(super) fn new(max_streams: usize) -> H2Live {
        H2Live {
            max_streams: AtomicUsize::new(max_streams),
            reads: AtomicU64::new(0),
            settled: std::sync::atomic::AtomicBool::new(false),
            zero_since_ms: AtomicU64::new(0),
            born: Instant::now(),
        }
    }

    /// Publishes the limit the connection's task sees after a poll; whether it is the
    /// server's word (its SETTINGS read), not the limit assumed until then.
    pub(super) fn publish(&self, limit: usize) -> bool {
        self.max_streams.store(limit, Ordering::Relaxed);
        if self.reads.load(Ordering::Relaxed) == 0 {
            return false;
        }
        self.settled.store(true, Ordering::Relaxed);
        if limit > 0 {
            self.zero_since_ms.store(0, Ordering::Relaxed);
        } else if self.zero_since_ms.load(Ordering::Relaxed) == 0 {
            let now = self.born.elapsed().as_millis() as u64;
            self.zero_since_ms.store(now + 1, Ordering::Relaxed);
        }
        true
    }

    /// Has the server's word (its SETTINGS) been read?
    fn settled(&self) -> bool {
        self.settled.load(Ordering::Relaxed)
    }

    /// Has the server said it allows no stream now?
    fn refusing(&self) -> bool {
        self.settled.load(Ordering::Relaxed) && self.max_streams.load(Ordering::Relaxed) == 0
    }

    /// Has it said so for [`REFUSING_FOR`]?
    fn refusing_long(&self) -> bool {
        let since = self.zero_since_ms.load(Ordering::Relaxed);
        self.refusing()
            && since > 0
            && self.born.elapsed() >= Duration::from_millis(since - 1) + REFUSING_FOR
    }
}

/// One shared HTTP/2 connection.
pub(super) struct H2Conn {
    pub(super) sender: http2::SendRequest<ReqBody>,
    pub(super) created: Instant,
    live: Arc<H2Live>,
    /// Streams started on it, for rotation.
    streams: AtomicU32,
    /// Streams in flight now.
    active: AtomicU32,
    /// When a stream last started or ended, in ms since `created` (for idle expiry).
    last_used_ms: AtomicU64,
}

impl H2Conn {
    fn touch(&self) {
        self.last_used_ms
            .store(self.created.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// Has it had no stream for `timeout`? Never while one is in flight, even with a
    /// timeout of zero.
    fn idle_past(&self, timeout: Duration) -> bool {
        self.active.load(Ordering::Relaxed) == 0
            && self.created.elapsed().saturating_sub(Duration::from_millis(
                self.last_used_ms.load(Ordering::Relaxed),
            )) >= timeout
    }
}

/// A stream taken on a shared connection; frees its place when the exchange ends (the
/// response read to the end, or dropped).
pub(super) struct StreamSlot {
    conn: Arc<H2Conn>,
    /// The connection's reads when the stream started.
    reads_at_start: u64,
}

impl StreamSlot {
    /// Has nothing come from the server on this stream's connection since the stream
    /// started (no frame of any stream, no PING, no SETTINGS)?
    pub(super) fn silent_since_start(&self) -> bool {
        self.conn.live.reads.load(Ordering::Relaxed) == self.reads_at_start
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.conn.active.fetch_sub(1, Ordering::Relaxed);
        self.conn.touch();
    }
}

/// Why a connection is due for rotation.
#[derive(Clone, Copy)]
enum Due {
    Requests,
    Lifetime,
    /// Its server has allowed no stream for [`REFUSING_FOR`].
    Refusing,
}

/// The shared connections of one endpoint on one worker.
pub(super) struct H2Set {
    // Held only for a scan, never across an await; one worker uses it.
    conns: Mutex<Vec<Arc<H2Conn>>>,
    max_streams: u32,
    max_lifetime: Option<Duration>,
}

impl H2Set {
    pub(super) fn new(max_streams: u32, max_lifetime: Option<Duration>) -> H2Set {
        H2Set {
            conns: Mutex::new(Vec::new()),
            max_streams,
            max_lifetime,
        }
    }

    fn due(&self, c: &H2Conn) -> Option<Due> {
        if self.max_streams > 0 && c.streams.load(Ordering::Relaxed) >= self.max_streams {
            Some(Due::Requests)
        } else if self.max_lifetime.is_some_and(|l| c.created.elapsed() >= l) {
            Some(Due::Lifetime)
        } else if c.live.refusing_long() {
            Some(Due::Refusing)
        } else {
            None
        }
    }

    /// Drops closed connections, connections with no stream for `idle_timeout` beyond the
    /// `keep` warm ones, and, once a successor is open, the ones due for rotation. Returns
    /// (connections not due, connections due): the keeper opens a successor when the first
    /// is 0 and the second is not.
    pub(super) fn tidy(
        &self,
        stats: &PoolStats,
        idle_timeout: Duration,
        keep: usize,
        died_young: &AtomicU32,
    ) -> (usize, usize) {
        let mut list = self.conns.lock().unwrap_or_else(PoisonError::into_inner);
        let before = list.len();
        list.retain(|c| {
            if !c.sender.is_closed() {
                return true;
            }
            // Closed before it carried a stream, soon after its connect (a server that
            // takes the preface and closes, or sends GOAWAY to every new connection): the
            // keeper backs off, as for an HTTP/1.1 spare that died so, instead of opening
            // the next at once, and the next, as fast as connects go.
            if c.streams.load(Ordering::Relaxed) == 0 && c.created.elapsed() < DIED_YOUNG {
                died_young.fetch_add(1, Ordering::Relaxed);
            }
            false
        });
        stats
            .closed_by_server
            .fetch_add((before - list.len()) as u64, Ordering::Relaxed);
        // Idle expiry beyond the warm ones. Requests take the first connection with room,
        // so the idle ones are those traffic no longer needs; the first of them are kept.
        // (One whose server allows no stream carries none, and is idle from its start: it
        // is replaced by rotation, after `REFUSING_FOR`, not let go first, when no other
        // would tell the next request that the server refuses.)
        let idle = |c: &H2Conn| c.idle_past(idle_timeout) && !c.live.refusing();
        let busy = list.iter().filter(|c| !idle(c)).count();
        let mut idle_kept = keep.saturating_sub(busy);
        let mut expired = 0;
        list.retain(|c| {
            if !idle(c) {
                return true;
            }
            if idle_kept > 0 {
                idle_kept -= 1;
                return true;
            }
            expired += 1;
            false
        });
        stats.retired_idle.fetch_add(expired, Ordering::Relaxed);
        let fresh = list.iter().filter(|c| self.due(c).is_none()).count();
        if fresh == 0 {
            return (0, list.len());
        }
        list.retain(|c| match self.due(c) {
            None => true,
            Some(Due::Requests) => {
                stats.retired_max_requests.fetch_add(1, Ordering::Relaxed);
                false
            }
            Some(Due::Lifetime) => {
                stats.retired_lifetime.fetch_add(1, Ordering::Relaxed);
                false
            }
            Some(Due::Refusing) => false,
        });
        (fresh, 0)
    }

    /// Does the server allow no stream on any connection open to it: one has said so (its
    /// word, not the limit assumed before its SETTINGS), and every other has said so too,
    /// or has not said anything yet (a successor whose SETTINGS are on their way, which
    /// [`take`](Self::take) passes over meanwhile)?
    ///
    /// `said_zero`: the endpoint's server said 0 on the last connection to give its word
    /// (one since closed or replaced, perhaps).
    pub(super) fn all_refuse(&self, said_zero: bool) -> bool {
        let list = self.conns.lock().unwrap_or_else(PoisonError::into_inner);
        let open = || list.iter().filter(|c| !c.sender.is_closed());
        open().next().is_some()
            && (said_zero || open().any(|c| c.live.refusing()))
            && open().all(|c| c.live.refusing() || !c.live.settled())
    }

    /// A stream on the first open connection with room for one more, if any. While the
    /// endpoint's server allows no stream (`said_zero`, or on a connection open now), a
    /// connection whose SETTINGS have not been read yet is passed over: the server is
    /// likely to say the same on it, and a stream put on it before would wait there for
    /// its response timeout.
    pub(super) fn take(
        &self,
        said_zero: bool,
    ) -> Option<(http2::SendRequest<ReqBody>, StreamSlot, Instant)> {
        let list = self.conns.lock().unwrap_or_else(PoisonError::into_inner);
        let wary = said_zero || list.iter().any(|c| c.live.refusing());
        let c = list.iter().find(|c| {
            (!wary || c.live.settled())
                && (c.active.load(Ordering::Relaxed) as usize)
                    < c.live.max_streams.load(Ordering::Relaxed)
        })?;
        Some(Self::slot(c))
    }

    /// Adds a new connection; returns when it was opened.
    pub(super) fn add(&self, sender: http2::SendRequest<ReqBody>, live: Arc<H2Live>) -> Instant {
        let c = Self::new_conn(sender, live);
        let created = c.created;
        self.push(c);
        created
    }

    /// Adds a new connection with a stream taken on it for the request that opened it
    /// (others share it from now on).
    pub(super) fn add_and_take(
        &self,
        sender: http2::SendRequest<ReqBody>,
        live: Arc<H2Live>,
    ) -> (http2::SendRequest<ReqBody>, StreamSlot, Instant) {
        let c = Self::new_conn(sender, live);
        let taken = Self::slot(&c);
        self.push(c);
        taken
    }

    fn new_conn(sender: http2::SendRequest<ReqBody>, live: Arc<H2Live>) -> Arc<H2Conn> {
        Arc::new(H2Conn {
            sender,
            created: Instant::now(),
            live,
            streams: AtomicU32::new(0),
            active: AtomicU32::new(0),
            last_used_ms: AtomicU64::new(0),
        })
    }

    /// Forgets one connection (the one `slot` is on): no new streams go on it, and it closes
    /// when its last stream ends.
    pub(super) fn forget(&self, slot: &StreamSlot) {
        self.conns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|c| !Arc::ptr_eq(c, &slot.conn));
    }

    /// Forgets every connection: no new streams go on them, and each closes when its last
    /// stream ends.
    pub(super) fn clear(&self) {
        self.conns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }

    fn push(&self, c: Arc<H2Conn>) {
        self.conns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(c);
    }

    fn slot(c: &Arc<H2Conn>) -> (http2::SendRequest<ReqBody>, StreamSlot, Instant) {
        c.active.fetch_add(1, Ordering::Relaxed);
        c.touch();
        c.streams.fetch_add(1, Ordering::Relaxed);
        let slot = StreamSlot {
            conn: c.clone(),
            reads_at_start: c.live.reads.load(Ordering::Relaxed),
        };
        (c.sender.clone(), slot, c.created)
    }
}
