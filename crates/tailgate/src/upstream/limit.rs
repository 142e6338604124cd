//! A cluster's `max_connections_per_endpoint`: the HTTP/1.1 connections one worker keeps
//! open to one endpoint (busy and idle alike, warm spares included), as nginx's `max_conns`
//! and HAProxy's server `maxconn` bound them, so a burst cannot open a connection per
//! request to a server for which each one is dear (seed 004: MySQL pays 30–60 ms and
//! megabytes of memory per connection, which is why pooling proxies exist).
//!
//! A request that finds no idle connection and no room for a new one queues, first come
//! first served, for the next connection given back (handed to it directly, so a request
//! that comes later cannot take it first) or the next place a closed one frees, for up to
//! the cluster's `connect_timeout` (HAProxy's `timeout queue` defaults to its
//! `timeout connect`). The queue is a list of one-shot channels: written by hand because a
//! semaphore (tokio's) hands out places but not the connection given back with one, and a
//! waiter woken to look for it in the idle list would race the requests that come meanwhile.
//!
//! The queue holds at most [`QUEUE_MAX`] requests (as Envoy's `max_pending_requests`
//! defaults to 1024): past that a request is refused at once (`503 upstream_queue_full`,
//! counted), not queued behind thousands that will time out before it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::oneshot;

use super::pool::Idle;

/// The most requests queued for one endpoint's connections on one worker.
pub(super) const QUEUE_MAX: usize = 1024;

/// The open connections of one endpoint on one worker, their cap, and the requests queued
/// for one.
pub(super) struct ConnLimit {
    open: AtomicUsize,
    max: usize,
    /// The endpoint is out of its cluster (parked or drained): no request queues, and those
    /// queued were let go (see [`Self::close`]).
    closed: AtomicBool,
    // Held only for a push, a pop or a send, never across an await; one worker uses it.
    waiters: Mutex<VecDeque<oneshot::Sender<Handed>>>,
    /// The queue was found full of requests still waiting, and none has left its front
    /// since: refused at once, not looked through again (only written under `waiters`).
    full_of_live: AtomicBool,
}

/// What a queued request is handed.
pub(super) enum Handed {
    /// A connection a request just gave back.
    Idle(Idle),
    /// A place a closed connection freed: open one.
    Room(ConnPermit),
}

/// A place among the open connections, held by the connection (its [`H1Conn`], or the
/// tunnel it became); freed when it closes, and handed to the first request queued, if any.
///
/// [`H1Conn`]: super::h1::H1Conn
pub(crate) struct ConnPermit(Option<Arc<ConnLimit>>);

impl Drop for ConnPermit {
    fn drop(&mut self) {
        if let Some(limit) = self.0.take() {
            limit.release();
        }
    }
}

/// [`ConnLimit::take_or_queue`]'s answer.
pub(super) enum Turn {
    Now(ConnPermit),
    Queued(oneshot::Receiver<Handed>),
    /// [`QUEUE_MAX`] requests are queued already.
    Full,
    /// The endpoint is out of its cluster (its pool parked or drained): nothing will be
    /// handed here.
    Closed,
}

impl ConnLimit {
    pub(super) fn new(max: usize) -> Arc<ConnLimit> {
        Arc::new(ConnLimit {
            open: AtomicUsize::new(0),
            max,
            closed: AtomicBool::new(false),
            waiters: Mutex::new(VecDeque::new()),
            full_of_live: AtomicBool::new(false),
        })
    }

    /// Connections open now.
    pub(super) fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// No room for another connection.
    pub(super) fn is_full(&self) -> bool {
        self.open() >= self.max
    }

    /// A place for one more connection, if there is room (the warm keeper's way: it does not
    /// wait).
    pub(super) fn try_take(self: &Arc<Self>) -> Option<ConnPermit> {
        self.open
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < self.max).then_some(n + 1)
            })
            .ok()
            .map(|_| ConnPermit(Some(self.clone())))
    }

    /// A place now, or a place in the queue. Behind requests already queued, a request
    /// queues even if a place has just freed (that place is on its way to the first of them).
    pub(super) fn take_or_queue(self: &Arc<Self>) -> Turn {
        let mut waiters = self.waiters.lock().unwrap_or_else(PoisonError::into_inner);
        if self.closed.load(Ordering::Relaxed) {
            return Turn::Closed;
        }
        // Requests gone from the queue's front (timed out first: they all wait the same
        // time) are let go here; one gone from its middle is passed over when a connection
        // is handed out. The whole queue is looked through only when it seems full, and not
        // again until its front moves: a look per request cost a pass over thousands of
        // waiters at each request while an endpoint stalled.
        while waiters.front().is_some_and(oneshot::Sender::is_closed) {
            waiters.pop_front();
            self.full_of_live.store(false, Ordering::Relaxed);
        }
        if waiters.len() >= QUEUE_MAX {
            if self.full_of_live.load(Ordering::Relaxed) {
                return Turn::Full;
            }
            waiters.retain(|w| !w.is_closed());
            if waiters.len() >= QUEUE_MAX {
                self.full_of_live.store(true, Ordering::Relaxed);
                return Turn::Full;
            }
        }
        if waiters.is_empty()
            && let Some(p) = self.try_take()
        {
            return Turn::Now(p);
        }
        let (tx, rx) = oneshot::channel();
        waiters.push_back(tx);
        Turn::Queued(rx)
    }

    /// The endpoint left its cluster (its address is out of the DNS answer: parked, or
    /// drained): every request queued is let go (its receiver sees the sender dropped, and
    /// it tries another endpoint), and none queues until [`Self::reopen`]. Without this, a
    /// place freed or a connection given back meanwhile would send it to the removed
    /// address.
    pub(super) fn close(&self) {
        let mut waiters = self.waiters.lock().unwrap_or_else(PoisonError::into_inner);
        self.closed.store(true, Ordering::Relaxed);
        self.full_of_live.store(false, Ordering::Relaxed);
        let gone = std::mem::take(&mut *waiters);
        // Dropped once the lock is let go, as everything handed here is.
        drop(waiters);
        drop(gone);
    }

    /// The endpoint is back in its cluster (its address in a later answer): requests queue
    /// again.
    pub(super) fn reopen(&self) {
        let _waiters = self.waiters.lock().unwrap_or_else(PoisonError::into_inner);
        self.closed.store(false, Ordering::Relaxed);
    }

    /// Hands `idle` to the first request still queued; gives it back when none is.
    pub(super) fn hand_idle(&self, mut idle: Idle) -> Option<Idle> {
        let mut waiters = self.waiters.lock().unwrap_or_else(PoisonError::into_inner);
        while let Some(w) = waiters.pop_front() {
            self.full_of_live.store(false, Ordering::Relaxed);
            match w.send(Handed::Idle(idle)) {
                Ok(()) => return None,
                Err(Handed::Idle(back)) => idle = back,
                // Not what was sent. Dropped once the lock is let go (its drop takes it).
                Err(room @ Handed::Room(_)) => {
                    drop(waiters);
                    drop(room);
                    return None;
                }
            }
        }
        Some(idle)
    }

    /// A connection closed: its place goes to the first request still queued, or back to
    /// the count.
    fn release(self: &Arc<Self>) {
        let mut waiters = self.waiters.lock().unwrap_or_else(PoisonError::into_inner);
        while let Some(w) = waiters.pop_front() {
            self.full_of_live.store(false, Ordering::Relaxed);
            match w.send(Handed::Room(ConnPermit(Some(self.clone())))) {
                Ok(()) => return,
                // That request is gone: the place is not freed twice.
                Err(Handed::Room(mut p)) => p.0 = None,
                // Not what was sent. Dropped once the lock is let go (its drop may take it).
                Err(idle @ Handed::Idle(_)) => {
                    drop(waiters);
                    drop(idle);
                    self.open.fetch_sub(1, Ordering::Relaxed);
                    return;
                }
            }
        }
        self.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A queued request's receiver. Dropped with something handed to it but not taken (the
/// request timed out or went away just then), it passes that on: a connection to the pool,
/// a place to the next request queued.
pub(super) struct Waiting<'a> {
    pub(super) rx: oneshot::Receiver<Handed>,
    pub(super) pool: &'a super::EndpointPool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.rx.close();
        if let Ok(Handed::Idle(idle)) = self.rx.try_recv() {
            self.pool.put(idle);
        }
        // A place handed and not taken is dropped here: freed, handed on.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The queue is bounded: past [`QUEUE_MAX`] requests a request is refused at once, and
    /// places left by requests gone (timed out, their clients away) are taken again.
    #[test]
    fn the_queue_is_bounded_and_frees_the_places_of_requests_gone() {
        let limit = ConnLimit::new(1);
        let Turn::Now(_permit) = limit.take_or_queue() else {
            panic!("the first request takes the only place");
        };
        let mut queued = Vec::new();
        for _ in 0..QUEUE_MAX {
            match limit.take_or_queue() {
                Turn::Queued(rx) => queued.push(rx),
                _ => panic!("queued while there is room in the queue"),
            }
        }
        assert!(matches!(limit.take_or_queue(), Turn::Full));
        // Found full of live ones: refused without a look, until the front moves.
        drop(queued.remove(QUEUE_MAX / 2));
        assert!(matches!(limit.take_or_queue(), Turn::Full));
        // The front moves (its request timed out): both places are found again.
        drop(queued.remove(0));
        for _ in 0..2 {
            match limit.take_or_queue() {
                Turn::Queued(rx) => queued.push(rx),
                _ => panic!("a place left by a request gone is taken again"),
            }
        }
        assert!(matches!(limit.take_or_queue(), Turn::Full));
        // The connection closes: its place goes to the first one still queued.
        drop(_permit);
        assert!(matches!(
            queued[0].try_recv(),
            Ok(Handed::Room(ConnPermit(Some(_))))
        ));
    }
}
