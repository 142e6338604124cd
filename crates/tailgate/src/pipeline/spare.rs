//! Request heads and header maps kept by the worker (this thread) between requests, for the
//! next request to fill rather than allocate.
//!
//! A proxied request used to allocate five blocks for its heads alone: the request's boxed
//! `Parts`, and two for each `HeaderMap` (its index and its entries), the request's and the
//! response's. With one request in flight at a time per size class, as an open loop over
//! hundreds of connections has, mimalloc serves each of those from a page whose free list is
//! empty (its generic path) and retires the page again when the block comes back: callgrind
//! counted 1.5 generic allocations and 3.9 page retirements per request, about 480
//! instructions. Kept here, a head and a map are taken back cleared, their memory the lines
//! the last request used.
//!
//! The same shape as the inline server's buffers (`server::h1_inline`'s `spare`): a short
//! per-thread stack, no locking, no `unsafe`. Written here rather than taken from a pool
//! crate for that reason; what is kept has to be emptied in a way only the `http` types
//! know (a cleared map keeps its capacity), which a generic pool would not do.
//!
//! Giving back is never required: a head or map dropped anywhere else is only freed.

use std::cell::RefCell;
use std::thread::LocalKey;

use http::request::Parts;
use http::{HeaderMap, Method, Request, Uri, Version};

/// Kept per worker at most, of each kind: more are in use only while that many requests
/// are in flight on one worker at once.
pub const KEEP: usize = 64;
/// A map grown past this many entries (a request with many headers) is let go, so one such
/// request does not make every later one clear a large index. Its values count too: extra
/// values of one name (an HTTP/2 request's `cookie` crumbs) grow a store of their own,
/// which `clear` keeps and its capacity does not show.
const MAP_KEEP: usize = 64;

/// Is a map too large to keep ([`MAP_KEEP`]), by its index or by its values?
fn too_large(map: &HeaderMap) -> bool {
    map.capacity() > MAP_KEEP || map.len() > MAP_KEEP
}

thread_local! {
    // The boxes are the point: a head is passed on by pointer, and the box itself is what
    // is kept for the next request.
    #[allow(clippy::vec_box)]
    static HEADS: RefCell<Vec<Box<Parts>>> = const { RefCell::new(Vec::new()) };
    static MAPS: RefCell<Vec<HeaderMap>> = const { RefCell::new(Vec::new()) };
}

/// A request head to fill: `GET /` HTTP/1.1, no headers, no extensions; its map has room
/// for `headers` entries.
pub fn take_head(headers: usize) -> Box<Parts> {
    match HEADS.with_borrow_mut(Vec::pop) {
        Some(mut head) => {
            reserve(&mut head.headers, headers);
            head
        }
        None => {
            let mut head = Box::new(Request::new(()).into_parts().0);
            head.headers.reserve(headers);
            head
        }
    }
}

/// Takes back a request head no longer needed. What it holds is dropped now (its target and
/// header values, which share the memory the request was read into, are let go), and the
/// emptied head kept for the next request.
pub fn give_head(mut head: Box<Parts>) {
    if too_large(&head.headers) {
        return;
    }
    head.headers.clear();
    head.extensions.clear();
    head.method = Method::GET;
    // `Uri::default()` is `/` without parsing it (`from_static` parses).
    head.uri = Uri::default();
    head.version = Version::HTTP_11;
    keep(&HEADS, head);
}

/// Runs `f` on a map that may be given back ([`give_head`], [`give_headers`]), which may
/// remove or replace values. A map too large to keep before keeps the store of the values
/// `remove` or `insert` dropped, which its `len` and `capacity` no longer show (a client's
/// `proxy-x` sent hundreds of times, a byte each once HPACK has it; an upstream's repeated
/// request id header): its index is grown past what is kept, so that it is let go.
pub fn shrinking<R>(map: &mut HeaderMap, f: impl FnOnce(&mut HeaderMap) -> R) -> R {
    let large = too_large(map);
    let r = f(map);
    if large && !too_large(map) {
        map.reserve(MAP_KEEP + 1);
    }
    r
}

/// Removes a request head's hop-by-hop headers ([`super::headers::remove_hop_by_hop`]),
/// [`shrinking`] its map.
pub fn remove_hop_by_hop(map: &mut HeaderMap, keep_upgrade: bool) -> bool {
    shrinking(map, |m| super::headers::remove_hop_by_hop(m, keep_upgrade))
}

/// Keeps `item` on the worker's `stack` if it has room ([`KEEP`]); otherwise it is let go.
/// The one way the worker's stacks (these, and the inline server's buffers) grow.
pub fn keep<T>(stack: &'static LocalKey<RefCell<Vec<T>>>, item: T) {
    stack.with_borrow_mut(|kept| {
        if kept.len() < KEEP {
            kept.push(item);
        }
    });
}

/// An empty header map with room for `entries`.
pub fn take_headers(entries: usize) -> HeaderMap {
    let mut map = MAPS.with_borrow_mut(Vec::pop).unwrap_or_default();
    reserve(&mut map, entries);
    map
}

/// Room for `entries` in an empty map; what a kept map has is usually enough, and asking
/// the map itself costs a call.
fn reserve(map: &mut HeaderMap, entries: usize) {
    if map.capacity() < entries {
        map.reserve(entries);
    }
}

/// Takes back a header map no longer needed; its entries are dropped now.
pub fn give_headers(mut map: HeaderMap) {
    if map.capacity() == 0 || too_large(&map) {
        return;
    }
    map.clear();
    keep(&MAPS, map);
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    #[test]
    fn a_head_comes_back_empty_with_its_memory() {
        let mut head = take_head(4);
        head.method = Method::POST;
        head.uri = Uri::from_static("/a/b?c");
        head.version = Version::HTTP_10;
        head.headers.insert("x-a", HeaderValue::from_static("1"));
        head.extensions.insert(7u32);
        let at = &*head as *const Parts as usize;
        give_head(head);
        let again = take_head(1);
        assert_eq!(
            &*again as *const Parts as usize, at,
            "the same head, not a new one"
        );
        assert_eq!(again.method, Method::GET);
        assert_eq!(again.uri, "/");
        assert_eq!(again.version, Version::HTTP_11);
        assert!(again.headers.is_empty());
        assert!(again.extensions.get::<u32>().is_none());
        assert!(again.headers.capacity() >= 4);
    }

    #[test]
    fn a_map_comes_back_empty_and_a_large_one_is_let_go() {
        let mut map = take_headers(8);
        map.insert("x-b", HeaderValue::from_static("2"));
        let cap = map.capacity();
        give_headers(map);
        let again = take_headers(2);
        assert!(again.is_empty());
        assert_eq!(again.capacity(), cap, "the kept map, with its capacity");

        let mut large = HeaderMap::with_capacity(MAP_KEEP * 2);
        large.insert("x-c", HeaderValue::from_static("3"));
        give_headers(large);
        // Nothing was kept: the next map is new (no capacity until asked).
        assert_eq!(take_headers(0).capacity(), 0);

        // A small index with many values of one name (cookie crumbs): let go as well.
        let mut crumbs = take_headers(2);
        for i in 0..=MAP_KEEP {
            crumbs.append("cookie", HeaderValue::from(i));
        }
        assert!(crumbs.capacity() <= MAP_KEEP, "the index stayed small");
        give_headers(crumbs);
        assert_eq!(take_headers(0).capacity(), 0);
    }

    /// A head whose map holds many values of one name is let go, not kept.
    #[test]
    fn a_head_with_many_values_is_let_go() {
        let mut head = take_head(2);
        for i in 0..=MAP_KEEP {
            head.headers.append("cookie", HeaderValue::from(i));
        }
        let kept = HEADS.with_borrow(Vec::len);
        give_head(head);
        assert_eq!(HEADS.with_borrow(Vec::len), kept, "not kept");
        give_head(take_head(2));
        assert_eq!(HEADS.with_borrow(Vec::len), kept + 1, "a small one is");
    }

    /// A head whose many values were hop-by-hop headers, removed before it is given back,
    /// is let go too: the store of its values stayed as large.
    #[test]
    fn a_head_whose_many_values_were_removed_is_let_go() {
        let mut head = take_head(2);
        head.headers.insert("host", HeaderValue::from_static("a"));
        for i in 0..=MAP_KEEP * 4 {
            head.headers.append("proxy-x", HeaderValue::from(i));
        }
        assert!(remove_hop_by_hop(&mut head.headers, false));
        assert_eq!(head.headers.len(), 1);
        let kept = HEADS.with_borrow(Vec::len);
        give_head(head);
        assert_eq!(HEADS.with_borrow(Vec::len), kept, "not kept");
        // A small one, with one to remove, is kept.
        let mut head = take_head(2);
        head.headers.insert("te", HeaderValue::from_static("x"));
        assert!(remove_hop_by_hop(&mut head.headers, false));
        give_head(head);
        assert_eq!(HEADS.with_borrow(Vec::len), kept + 1, "a small one is");
        // Many values of one name replaced by one (`insert`): a map let go as well.
        let mut map = take_headers(2);
        for i in 0..=MAP_KEEP * 4 {
            map.append("x-request-id", HeaderValue::from(i));
        }
        shrinking(&mut map, |m| {
            m.insert("x-request-id", HeaderValue::from_static("1"));
        });
        assert_eq!(map.len(), 1);
        give_headers(map);
        assert_eq!(take_headers(0).capacity(), 0, "not kept");
    }

    #[test]
    fn what_a_head_held_is_let_go_when_it_is_given_back() {
        let shared = bytes::Bytes::from(b"GET /x HTTP/1.1".to_vec());
        let mut head = take_head(1);
        head.uri = Uri::from_maybe_shared(shared.slice(4..6)).expect("a path");
        head.headers.insert(
            "x-d",
            HeaderValue::from_maybe_shared(shared.slice(0..3)).expect("a value"),
        );
        assert!(!shared.is_unique());
        give_head(head);
        // The only reference left is ours: the buffer the request was read into is free.
        assert!(shared.is_unique());
    }
}
