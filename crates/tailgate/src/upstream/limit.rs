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

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::oneshot;

use super::pool::Idle;

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
        waiters.retain(|w| !w.is_closed());
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
