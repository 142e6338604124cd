//! A cluster's `max_connections_per_endpoint`: the HTTP/1.1 connections one worker keeps
//! open to one endpoint (busy and idle alike, warm spares included), as nginx's `max_conns`
//! and HAProxy's server `maxconn` bound them, so a burst cannot open a connection per
//! request to a server for which each one is dear (seed 004: MySQL pays 30–60 ms and
//! megabytes of memory per connection, which is why pooling proxies exist).
//!
//! A request that finds no idle connection and no room for a new one queues for the next
//! connection given back (handed to it directly, so a request that comes later cannot take
//! it first) or the next place a closed one frees, for up to the cluster's
//! `connect_timeout` (HAProxy's `timeout queue` defaults to its `timeout connect`). The
//! queue is a list of one-shot channels: written by hand because a semaphore (tokio's)
//! hands out places but not the connection given back with one, and a waiter woken to look
//! for it in the idle list would race the requests that come meanwhile.
//!
//! Each tenant queues in a lane of its own (requests of no tenant in one more), first come
//! first served within it, and the lanes take turns at what is handed out: a tenant that
//! floods a shared cluster's endpoint waits behind itself, and another tenant's request is
//! handed one of the next connections whatever the flood's length. One queue for all
//! (nginx's, HAProxy's, Envoy's) put it behind every request of the flood, to time out
//! with them.
//!
//! A lane holds at most [`QUEUE_MAX`] requests (as Envoy's `max_pending_requests`
//! defaults to 1024), and all lanes together four times that: past that a request is
//! refused at once (`503 upstream_queue_full`, counted), not queued behind thousands that
//! will time out before it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::oneshot;

use super::pool::Idle;

/// The most requests one tenant queues for one endpoint's connections on one worker.
pub(super) const QUEUE_MAX: usize = 1024;

/// The most requests every tenant together queues there.
const QUEUE_MAX_ALL: usize = 4 * QUEUE_MAX;

/// The requests queued, a lane per tenant; the lanes take turns.
#[derive(Default)]
struct Queue {
    /// The lanes with requests queued (an emptied lane is removed).
    lanes: Vec<Lane>,
    /// The lane the next hand-out goes to: below the lanes' count (0 when there are
    /// none), so a lane added at the end waits for its turn after those before it.
    turn: usize,
}

/// One tenant's requests queued.
struct Lane {
    tenant: Option<usize>,
    waiters: VecDeque<oneshot::Sender<Handed>>,
    /// The lane was found full of requests still waiting, and none has left its front
    /// since: refused at once, not looked through again.
    full_of_live: bool,
}

impl Queue {
    fn is_empty(&self) -> bool {
        self.lanes.is_empty()
    }

    fn remove_lane(&mut self, i: usize) {
        self.lanes.remove(i);
        if self.turn > i {
            self.turn -= 1;
        }
        if self.turn >= self.lanes.len() {
            self.turn = 0;
        }
    }

    /// Lets go of requests gone (their receivers dropped): those at each lane's front, or
    /// with `all`, wherever they are; a lane left empty is removed.
    fn prune(&mut self, all: bool) {
        let mut i = 0;
        while let Some(lane) = self.lanes.get_mut(i) {
            let before = lane.waiters.len();
            if all {
                lane.waiters.retain(|w| !w.is_closed());
            } else {
                while lane.waiters.front().is_some_and(oneshot::Sender::is_closed) {
                    lane.waiters.pop_front();
                }
            }
            if lane.waiters.len() < before {
                lane.full_of_live = false;
            }
            if lane.waiters.is_empty() {
                self.remove_lane(i);
            } else {
                i += 1;
            }
        }
    }

    /// Requests queued in every lane.
    fn len(&self) -> usize {
        self.lanes.iter().map(|l| l.waiters.len()).sum()
    }

    /// The first request of the lane whose turn it is; the turn passes to the next lane.
    fn pop_front(&mut self) -> Option<oneshot::Sender<Handed>> {
        let i = self.turn;
        let lane = self.lanes.get_mut(i)?;
        let w = lane.waiters.pop_front();
        lane.full_of_live = false;
        if lane.waiters.is_empty() {
            // The next lane slides into its place, and has the turn (the first, when it
            // was the last).
            self.remove_lane(i);
        } else {
            self.turn = (i + 1) % self.lanes.len();
        }
        w
    }
}

/// The open connections of one endpoint on one worker, their cap, and the requests queued
/// for one.
pub(super) struct ConnLimit {
    open: AtomicUsize,
    max: usize,
    /// The endpoint is out of its cluster (parked or drained): no request queues, and those
    /// queued were let go (see [`Self::close`]).
    closed: AtomicBool,
    // Held only for a push, a pop or a send, never across an await; one worker uses it.
    waiters: Mutex<Queue>,
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
    /// [`QUEUE_MAX`] requests of the tenant are queued already.
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
            waiters: Mutex::new(Queue::default()),
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

    /// A place now, or a place in `tenant`'s lane of the queue. Behind requests already
    /// queued (any tenant's), a request queues even if a place has just freed (that place
    /// is on its way to one of them).
    pub(super) fn take_or_queue(self: &Arc<Self>, tenant: Option<usize>) -> Turn {
        let mut queue = self.waiters.lock().unwrap_or_else(PoisonError::into_inner);
        if self.closed.load(Ordering::Relaxed) {
            return Turn::Closed;
        }
        // Requests gone from a lane's front (timed out first: they all wait the same time)
        // are let go here, and a lane left empty; one gone from its middle is passed over
        // when a connection is handed out.
        queue.prune(false);
        // The whole lane is looked through only when it seems full, and not again until
        // its front moves: a look per request cost a pass over thousands of waiters at
        // each request while an endpoint stalled.
        if let Some(lane) = queue.lanes.iter_mut().find(|l| l.tenant == tenant)
            && lane.waiters.len() >= QUEUE_MAX
        {
            if lane.full_of_live {
                return Turn::Full;
            }
            lane.waiters.retain(|w| !w.is_closed());
            if lane.waiters.len() >= QUEUE_MAX {
                lane.full_of_live = true;
                return Turn::Full;
            }
        }
        // However many tenants, the queue is bounded (its requests still waiting counted
        // only when it seems full).
        if queue.len() >= QUEUE_MAX_ALL {
            queue.prune(true);
            if queue.len() >= QUEUE_MAX_ALL {
                return Turn::Full;
            }
        }
        if queue.is_empty()
            && let Some(p) = self.try_take()
        {
            return Turn::Now(p);
        }
        let (tx, rx) = oneshot::channel();
        match queue.lanes.iter_mut().find(|l| l.tenant == tenant) {
            Some(lane) => lane.waiters.push_back(tx),
            None => queue.lanes.push(Lane {
                tenant,
                waiters: VecDeque::from([tx]),
                full_of_live: false,
            }),
        }
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

    /// Hands `idle` to the first request still queued in the lane whose turn it is; gives
    /// it back when none is queued.
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

    /// A connection closed: its place goes to the first request still queued in the lane
    /// whose turn it is, or back to the count.
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The queue is bounded: past [`QUEUE_MAX`] requests a request is refused at once, and
    /// places left by requests gone (timed out, their clients away) are taken again.
    #[test]
    fn the_queue_is_bounded_and_frees_the_places_of_requests_gone() {
        let limit = ConnLimit::new(1);
        let Turn::Now(_permit) = limit.take_or_queue(None) else {
            panic!("the first request takes the only place");
        };
        let mut queued = Vec::new();
        for _ in 0..QUEUE_MAX {
            match limit.take_or_queue(None) {
                Turn::Queued(rx) => queued.push(rx),
                _ => panic!("queued while there is room in the queue"),
            }
        }
        assert!(matches!(limit.take_or_queue(None), Turn::Full));
        // Found full of live ones: refused without a look, until the front moves.
        drop(queued.remove(QUEUE_MAX / 2));
        assert!(matches!(limit.take_or_queue(None), Turn::Full));
        // The front moves (its request timed out): both places are found again.
        drop(queued.remove(0));
        for _ in 0..2 {
            match limit.take_or_queue(None) {
                Turn::Queued(rx) => queued.push(rx),
                _ => panic!("a place left by a request gone is taken again"),
            }
        }
        assert!(matches!(limit.take_or_queue(None), Turn::Full));
        // The connection closes: its place goes to the first one still queued.
        drop(_permit);
        assert!(matches!(
            queued[0].try_recv(),
            Ok(Handed::Room(ConnPermit(Some(_))))
        ));
    }

    /// The tenants' lanes take turns: a request of tenant 1 queued behind a hundred of
    /// tenant 0 is handed the second place freed, not the hundred-and-first; a lane is
    /// bounded on its own, so a tenant whose lane is full does not keep another out.
    #[test]
    fn the_lanes_take_turns_and_are_bounded_apart() {
        let limit = ConnLimit::new(1);
        let Turn::Now(permit) = limit.take_or_queue(Some(0)) else {
            panic!("the first request takes the only place");
        };
        let mut flood: Vec<_> = (0..QUEUE_MAX)
            .map(|_| match limit.take_or_queue(Some(0)) {
                Turn::Queued(rx) => rx,
                _ => panic!("queued while there is room in the lane"),
            })
            .collect();
        assert!(matches!(limit.take_or_queue(Some(0)), Turn::Full));
        let Turn::Queued(mut other) = limit.take_or_queue(Some(1)) else {
            panic!("another tenant's lane has room");
        };
        let Turn::Queued(mut none) = limit.take_or_queue(None) else {
            panic!("the lane of no tenant has room");
        };
        // Three places freed: one per lane, in the order the lanes came (the flood's
        // requests all still waiting).
        drop(permit);
        let Ok(Handed::Room(p)) = flood[0].try_recv() else {
            panic!("the flood's first is handed the first place");
        };
        assert!(other.try_recv().is_err(), "not yet");
        drop(p);
        let Ok(Handed::Room(p)) = other.try_recv() else {
            panic!("the other tenant is handed the second place");
        };
        drop(p);
        let Ok(Handed::Room(_held)) = none.try_recv() else {
            panic!("the lane of no tenant is handed the third place");
        };
        assert!(
            flood[1].try_recv().is_err(),
            "the flood's second waits its turn"
        );
    }

    /// A lane that comes after the turn went round to the first lane waits for its own
    /// turn: it is not handed the first lane's.
    #[test]
    fn a_lane_added_after_the_turn_went_round_waits_its_turn() {
        let limit = ConnLimit::new(1);
        let Turn::Now(permit) = limit.take_or_queue(Some(0)) else {
            panic!("the first request takes the only place");
        };
        let queue = |t| match limit.take_or_queue(Some(t)) {
            Turn::Queued(rx) => rx,
            _ => panic!("queued"),
        };
        let mut a = [queue(0), queue(0)];
        let mut b = [queue(1), queue(1)];
        // a, then b: the turn is back at a.
        drop(permit);
        let Ok(Handed::Room(p)) = a[0].try_recv() else {
            panic!("a first");
        };
        drop(p);
        let Ok(Handed::Room(p)) = b[0].try_recv() else {
            panic!("then b");
        };
        let mut c = queue(2);
        drop(p);
        assert!(c.try_recv().is_err(), "c came last: a's turn, not c's");
        let Ok(Handed::Room(p)) = a[1].try_recv() else {
            panic!("a's turn");
        };
        drop(p);
        let Ok(Handed::Room(p)) = b[1].try_recv() else {
            panic!("b's turn");
        };
        drop(p);
        assert!(matches!(c.try_recv(), Ok(Handed::Room(_))));
    }

    /// However many tenants queue, the queue is bounded.
    #[test]
    fn all_lanes_together_are_bounded() {
        let limit = ConnLimit::new(1);
        let Turn::Now(_permit) = limit.take_or_queue(None) else {
            panic!("the first request takes the only place");
        };
        let mut queued = Vec::new();
        for t in 0..4 {
            for _ in 0..QUEUE_MAX {
                match limit.take_or_queue(Some(t)) {
                    Turn::Queued(rx) => queued.push(rx),
                    _ => panic!("queued while there is room"),
                }
            }
        }
        assert!(matches!(limit.take_or_queue(Some(9)), Turn::Full));
        // Room again once requests leave.
        queued.truncate(QUEUE_MAX);
        assert!(matches!(limit.take_or_queue(Some(9)), Turn::Queued(_)));
    }

    /// A place freed while the request at the lane's front has gone (its receiver
    /// dropped) goes to the next one, or back to the count: not freed twice (a place freed
    /// twice would let one connection more than the cap open), nor lost.
    #[test]
    fn a_place_freed_for_a_request_gone_goes_to_the_next_or_back() {
        let limit = ConnLimit::new(1);
        let Turn::Now(permit) = limit.take_or_queue(None) else {
            panic!("the first request takes the only place");
        };
        let Turn::Queued(gone) = limit.take_or_queue(None) else {
            panic!("queued");
        };
        drop(gone);
        drop(permit);
        assert_eq!(limit.open(), 0, "the place is back, once");
        let Turn::Now(_p) = limit.take_or_queue(None) else {
            panic!("the place is taken again");
        };
        assert_eq!(limit.open(), 1);
        assert!(limit.try_take().is_none(), "no second place");
    }
}
