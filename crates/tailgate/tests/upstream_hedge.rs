//! Hedged requests: two endpoints, one slow. With `hedge_delay` on the route, a request the
//! slow endpoint sits on gets a second copy on the other one, which answers first. Counts,
//! never timings: the response timeout (1 s) is shorter than the slow endpoint's delay, so
//! a request that was not hedged would fail.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::*;

/// Counts requests; sleeps `delay` before answering anything but `/warm`.
async fn counting(delay: Duration) -> (SocketAddr, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    let addr = upstream(move |req| {
        h.fetch_add(1, Ordering::SeqCst);
        let wait = req.uri().path() != "/warm";
        async move {
            if wait {
                tokio::time::sleep(delay).await;
            }
            http::Response::new(full("ok"))
        }
    })
    .await;
    (addr, hits)
}

struct Setup {
    gw: TestGateway,
    fast: Arc<AtomicUsize>,
    slow: Arc<AtomicUsize>,
}

/// Round-robin over [slow, fast], so half the first copies go to the slow one.
async fn setup(slow_delay: Duration, cluster_extra: &str, route_extra: &str) -> Setup {
    let (slow_addr, slow) = counting(slow_delay).await;
    let (fast_addr, fast) = counting(Duration::ZERO).await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{slow_addr}\", \"{fast_addr}\"]\nbalance = \"round_robin\"\n{cluster_extra}\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n{route_extra}\n"
    ));
    Setup { gw, fast, slow }
}

async fn send(addr: SocketAddr, method: http::Method, path: &str, body: &'static str) -> u16 {
    let mut c = h1_client(addr).await;
    let r = common::send(&mut c, method.as_str(), path, full(body))
        .await
        .unwrap();
    r.status().as_u16()
}

fn stat(
    s: &Setup,
    f: impl Fn(&tailgate::upstream::ClusterStats) -> &std::sync::atomic::AtomicU64,
) -> u64 {
    s.gw.gw
        .as_ref()
        .unwrap()
        .cluster_stat(|c| f(c).load(Ordering::Relaxed))
}

/// A gateway hedging after 20 ms, round robin over an endpoint that answers after `delay`
/// and one that answers 503 at once (never ejected).
async fn slow_and_failing(delay: Duration, response_timeout: &str) -> TestGateway {
    let (slow_addr, _) = counting(delay).await;
    let failing = upstream(|_| async {
        let mut r = http::Response::new(full("down"));
        *r.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
        r
    })
    .await;
    TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{slow_addr}\", \"{failing}\"]\nbalance = \"round_robin\"\nhedge_budget_percent = 100\neject_after_failures = 1000\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\nhedge_delay = \"20ms\"\nresponse_timeout = \"{response_timeout}\"\n"
    ))
}

/// Times the endpoint at `addr` was ejected, over every worker.
fn ejections_of(g: &tailgate::Gateway, addr: SocketAddr) -> u64 {
    g.endpoint_pools()
        .iter()
        .filter(|p| p.addr == addr)
        .map(|p| p.load.ejections.load(Ordering::Relaxed))
        .sum()
}

/// A hedge's fast 5xx does not beat the first copy's slower success: a request the slow,
/// healthy endpoint sits on is hedged to one that fails at once with 503, and still gets
/// the slow endpoint's 200.
#[tokio::test]
async fn a_fast_failure_does_not_beat_a_slow_success() {
    let gw = slow_and_failing(Duration::from_millis(150), "2s").await;
    let mut ok = 0;
    for _ in 0..8 {
        if send(gw.addr, http::Method::GET, "/", "").await == 200 {
            ok += 1;
        }
    }
    // Round robin: every other first copy goes to the slow endpoint and is hedged.
    assert!(ok >= 3, "{ok} of 8 got the slow endpoint's 200");
}

/// A copy's fast 503 is held while the first copy hangs, and answered when the response
/// deadline comes: never turned into a 504.
#[tokio::test]
async fn a_held_failure_is_answered_at_the_deadline() {
    let gw = slow_and_failing(Duration::from_secs(5), "400ms").await;
    for _ in 0..4 {
        assert_eq!(send(gw.addr, http::Method::GET, "/", "").await, 503);
    }
}

/// The first copy that hangs to the deadline while the copy's 503 is held has timed out:
/// its endpoint counts a failure (here, one ejects), as without a hedge, and the hedge
/// won nothing (its 503 saved no request). It was taken as abandoned for a faster copy,
/// so a hung endpoint escaped ejection while hedges kept firing, and counted as won.
#[tokio::test]
async fn a_first_copy_hung_past_a_held_failure_counts_as_failed_and_no_hedge_won() {
    let (slow_addr, _) = counting(Duration::from_secs(5)).await;
    let failing = upstream(|_| async {
        let mut r = http::Response::new(full("down"));
        *r.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
        r
    })
    .await;
    // Round robin's first pick is the slow endpoint: the copy goes to the failing one,
    // whose 503 ejects it (for a minute), and is held until the deadline.
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{slow_addr}\", \"{failing}\"]\nbalance = \"round_robin\"\nhedge_budget_percent = 100\neject_after_failures = 1\neject_duration = \"60s\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\nhedge_delay = \"20ms\"\nresponse_timeout = \"300ms\"\n"
    ));
    assert_eq!(send(gw.addr, http::Method::GET, "/", "").await, 503);
    let g = gw.gw.as_ref().unwrap();
    assert_eq!(
        g.cluster_stat(|c| c.hedges_fired.load(Ordering::Relaxed)),
        1
    );
    assert_eq!(g.cluster_stat(|c| c.hedges_won.load(Ordering::Relaxed)), 0);
    let ejections = |addr| ejections_of(g, addr);
    assert_eq!(
        ejections(failing),
        1,
        "the copy's 503 counts against its endpoint"
    );
    assert_eq!(
        ejections(slow_addr),
        1,
        "the hung first copy counts as a failure"
    );
}

/// The other way round: the first copy's 5xx held while the copy hangs to the deadline.
/// The copy timed out, and its endpoint counts a failure; it was only let go, so a hung
/// endpoint that took hedges escaped ejection.
#[tokio::test]
async fn a_copy_hung_past_a_held_failure_counts_as_failed() {
    let failing = upstream(|_| async {
        tokio::time::sleep(Duration::from_millis(60)).await;
        let mut r = http::Response::new(full("down"));
        *r.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
        r
    })
    .await;
    let (hung, _) = counting(Duration::from_secs(5)).await;
    // Round robin's first pick is the failing endpoint; the copy, 20 ms on, the hung one.
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{failing}\", \"{hung}\"]\nbalance = \"round_robin\"\nhedge_budget_percent = 100\neject_after_failures = 1\neject_duration = \"60s\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\nhedge_delay = \"20ms\"\nresponse_timeout = \"300ms\"\n"
    ));
    assert_eq!(send(gw.addr, http::Method::GET, "/", "").await, 503);
    let g = gw.gw.as_ref().unwrap();
    assert_eq!(
        g.cluster_stat(|c| c.hedges_fired.load(Ordering::Relaxed)),
        1
    );
    let ejections = |addr| ejections_of(g, addr);
    assert_eq!(ejections(hung), 1, "the hung copy counts as a failure");
}

/// With one of two endpoints ejected, nothing is hedged to it: requests the healthy,
/// slow endpoint sits on wait for it, no copy is sent and no hedge budget is spent.
#[tokio::test]
async fn nothing_is_hedged_to_an_ejected_endpoint() {
    let (slow_addr, _) = counting(Duration::from_millis(150)).await;
    let failing_hits = Arc::new(AtomicUsize::new(0));
    let h = failing_hits.clone();
    let failing = upstream(move |_| {
        h.fetch_add(1, Ordering::SeqCst);
        async {
            let mut r = http::Response::new(full("down"));
            *r.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
            r
        }
    })
    .await;
    let s = Setup {
        gw: TestGateway::start(&format!(
            "[[cluster]]\nname = \"up\"\nendpoints = [\"{slow_addr}\", \"{failing}\"]\nbalance = \"round_robin\"\nhedge_budget_percent = 100\neject_after_failures = 1\neject_duration = \"60s\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\nhedge_delay = \"20ms\"\nresponse_timeout = \"2s\"\n"
        )),
        fast: Arc::new(AtomicUsize::new(0)),
        slow: Arc::new(AtomicUsize::new(0)),
    };
    // The first request (or its hedge) meets the failing endpoint's 503, which ejects it.
    for _ in 0..4 {
        if failing_hits.load(Ordering::SeqCst) > 0 {
            break;
        }
        send(s.gw.addr, http::Method::GET, "/", "").await;
    }
    let hits = failing_hits.load(Ordering::SeqCst);
    assert!(hits > 0, "the failing endpoint was never tried");
    let fired = stat(&s, |c| &c.hedges_fired);
    let refused = stat(&s, |c| &c.hedges_refused);
    for i in 0..6 {
        assert_eq!(
            send(s.gw.addr, http::Method::GET, "/", "").await,
            200,
            "request {i}"
        );
    }
    assert_eq!(
        failing_hits.load(Ordering::SeqCst),
        hits,
        "a copy went to the ejected endpoint"
    );
    assert_eq!(stat(&s, |c| &c.hedges_fired), fired, "hedges fired");
    assert_eq!(
        stat(&s, |c| &c.hedges_refused),
        refused,
        "hedge budget asked for"
    );
}

/// Every request the slow endpoint sits on is hedged to the fast one, which wins; all
/// requests succeed although the slow endpoint answers after the response timeout.
#[tokio::test]
async fn slow_endpoint_is_hedged_to_the_other_one() {
    let s = setup(
        Duration::from_secs(2),
        "hedge_budget_percent = 100",
        "hedge_delay = \"50ms\"\nresponse_timeout = \"1s\"",
    )
    .await;
    for i in 0..20 {
        assert_eq!(
            send(s.gw.addr, http::Method::GET, "/x", "").await,
            200,
            "request {i}"
        );
    }
    let fired = stat(&s, |c| &c.hedges_fired);
    assert!(fired >= 5, "hedges fired: {fired}");
    assert_eq!(
        stat(&s, |c| &c.hedges_won),
        fired,
        "the fast copy always wins"
    );
    assert_eq!(
        s.slow.load(Ordering::SeqCst) as u64,
        fired,
        "every first copy on the slow endpoint was hedged"
    );
    assert_eq!(s.fast.load(Ordering::SeqCst) as u64 + fired, 20 + fired);
    assert_eq!(stat(&s, |c| &c.hedges_refused), 0);
}

/// `hedge_delay = "p95"`: once the route has enough samples, slow requests are hedged after
/// its observed p95.
#[tokio::test]
async fn percentile_delay_hedges_once_it_has_samples() {
    let s = setup(
        Duration::from_secs(2),
        "hedge_budget_percent = 100",
        "hedge_delay = \"p95\"\nresponse_timeout = \"1s\"",
    )
    .await;
    // Fewer than 20 samples: no percentile yet, so no hedge, however slow a request is.
    for _ in 0..19 {
        assert_eq!(send(s.gw.addr, http::Method::GET, "/warm", "").await, 200);
    }
    assert_eq!(
        stat(&s, |c| &c.hedges_fired),
        0,
        "no hedge before the percentile has its samples"
    );
    // Fast requests from here may be hedged now and then (about one in twenty is slower
    // than the p95 by definition, more on a loaded machine): counted from after them.
    for _ in 0..21 {
        assert_eq!(send(s.gw.addr, http::Method::GET, "/warm", "").await, 200);
    }
    let (fired_before, won_before) = (stat(&s, |c| &c.hedges_fired), stat(&s, |c| &c.hedges_won));
    for i in 0..10 {
        assert_eq!(
            send(s.gw.addr, http::Method::GET, "/x", "").await,
            200,
            "request {i}"
        );
    }
    // Half the first copies sit on the slow endpoint (2 s, past the 1 s response
    // timeout): each is hedged and the fast copy wins, or the request would have failed.
    let fired = stat(&s, |c| &c.hedges_fired) - fired_before;
    let won = stat(&s, |c| &c.hedges_won) - won_before;
    assert!(fired >= 3, "hedges fired: {fired}");
    assert!(won >= 3, "hedges won: {won} of {fired}");
}

/// With a budget of 10 %, hedges stay within 10 % of the cluster's requests; the rest are
/// refused (and those requests wait for the slow endpoint).
#[tokio::test]
async fn hedges_stay_within_the_budget() {
    let s = setup(
        Duration::from_millis(1500),
        "hedge_budget_percent = 10",
        "hedge_delay = \"50ms\"",
    )
    .await;
    // 100 fast requests: the budget allows 10 hedges.
    for _ in 0..100 {
        assert_eq!(send(s.gw.addr, http::Method::GET, "/warm", "").await, 200);
    }
    let addr = s.gw.addr;
    let all: Vec<_> = (0..40)
        .map(|_| tokio::spawn(async move { send(addr, http::Method::GET, "/x", "").await }))
        .collect();
    for t in all {
        assert_eq!(t.await.unwrap(), 200);
    }
    let (fired, refused) = (
        stat(&s, |c| &c.hedges_fired),
        stat(&s, |c| &c.hedges_refused),
    );
    assert!(fired >= 1, "some hedges fired");
    assert!(fired <= 14, "at most 10 % of 140 requests: {fired}");
    assert!(
        refused >= 1,
        "the rest were refused: fired {fired}, refused {refused}"
    );
    assert_eq!(stat(&s, |c| &c.hedges_won), fired);
}

/// A POST is never hedged, with or without a body: each reaches one endpoint once.
#[tokio::test]
async fn post_is_never_hedged() {
    let s = setup(
        Duration::from_millis(300),
        "hedge_budget_percent = 100",
        "hedge_delay = \"20ms\"",
    )
    .await;
    for body in ["", "data", "", "data"] {
        assert_eq!(send(s.gw.addr, http::Method::POST, "/x", body).await, 200);
    }
    assert_eq!(stat(&s, |c| &c.hedges_fired), 0);
    assert_eq!(
        s.slow.load(Ordering::SeqCst) + s.fast.load(Ordering::SeqCst),
        4,
        "each POST sent once"
    );
    assert_eq!(
        s.slow.load(Ordering::SeqCst),
        2,
        "half went to the slow endpoint and waited"
    );
}

/// A first copy that fails (here a `503` after 150 ms) while its hedge is out counts
/// against its endpoint, though the hedge's answer wins: an endpoint that fails slowly is
/// ejected as it would be without hedging, not hidden behind the hedges that rescue its
/// requests. (The other endpoint answers after 180 ms, so a copy sent to the failing one
/// as a hedge is always dropped before its 503: only first copies can mark it.)
#[tokio::test]
async fn a_first_copy_that_fails_while_hedged_counts_against_its_endpoint() {
    let failing = upstream(|_| async {
        tokio::time::sleep(Duration::from_millis(150)).await;
        let mut r = http::Response::new(full("down"));
        *r.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
        r
    })
    .await;
    let (ok, _) = counting(Duration::from_millis(180)).await;
    let gw = TestGateway::start(&format!(
        "[[cluster]]\nname = \"up\"\nendpoints = [\"{failing}\", \"{ok}\"]\nbalance = \"round_robin\"\nhedge_budget_percent = 100\neject_after_failures = 2\neject_duration = \"60s\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\nhedge_delay = \"100ms\"\nresponse_timeout = \"5s\"\n"
    ));
    for i in 0..6 {
        assert_eq!(
            send(gw.addr, http::Method::GET, "/", "").await,
            200,
            "request {i}"
        );
    }
    let g = gw.gw.as_ref().unwrap();
    let ejections: u64 = g
        .endpoint_pools()
        .iter()
        .filter(|p| p.addr == failing)
        .map(|p| p.load.ejections.load(std::sync::atomic::Ordering::Relaxed))
        .sum();
    assert!(ejections >= 1, "the failing endpoint was never ejected");
}
