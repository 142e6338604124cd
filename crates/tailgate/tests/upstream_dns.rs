//! Host-name endpoints (seeds 003 and 004): a real DNS server on a free UDP port answers
//! `svc.test.` with an A record the test controls; test upstreams listen on distinct loopback
//! addresses (127.0.0.x, same port), so a changed record means a different endpoint.
//! Behaviour is asserted on request outcomes and counters, never on timings.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use common::{prom, tls};
use hickory_proto::op::Message;
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{RData, Record, RecordType};
use tokio::net::UdpSocket;
use tokio::sync::watch;

/// A minimal authoritative DNS server: `svc.test.` → the current A record (TTL `ttl`, 1 s
/// unless set) while `answering`, an empty answer otherwise; AAAA and other names get empty
/// answers. It runs on its own thread: the gateway's start-up waits for the first answer
/// while the test's runtime is blocked.
struct DnsServer {
    addr: SocketAddr,
    a: Arc<Mutex<Ipv4Addr>>,
    ttl: Arc<AtomicU32>,
    answering: Arc<AtomicBool>,
    /// Reads queries and answers none (a name server that went quiet).
    silent: Arc<AtomicBool>,
    /// Queries left unanswered while `silent`.
    ignored: Arc<AtomicUsize>,
    /// `svc.test.`'s AAAA records (none unless set), answered whatever `answering` says.
    aaaa: Arc<Mutex<Vec<std::net::Ipv6Addr>>>,
    /// AAAA queries get `SERVFAIL` (a name server failing one family).
    aaaa_fails: Arc<AtomicBool>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl DnsServer {
    async fn start(ip: Ipv4Addr) -> DnsServer {
        let std_sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        std_sock.set_nonblocking(true).unwrap();
        let addr = std_sock.local_addr().unwrap();
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let a = Arc::new(Mutex::new(ip));
        let answering = Arc::new(AtomicBool::new(true));
        let ttl = Arc::new(AtomicU32::new(1));
        let silent = Arc::new(AtomicBool::new(false));
        let ignored = Arc::new(AtomicUsize::new(0));
        let (a2, on, ttl2) = (a.clone(), answering.clone(), ttl.clone());
        let (quiet, unanswered) = (silent.clone(), ignored.clone());
        let aaaa = Arc::new(Mutex::new(Vec::new()));
        let aaaa2 = aaaa.clone();
        let aaaa_fails = Arc::new(AtomicBool::new(false));
        let aaaa_fails2 = aaaa_fails.clone();
        let serve = async move {
            let sock = UdpSocket::from_std(std_sock).unwrap();
            let mut buf = [0u8; 2048];
            loop {
                let got = tokio::select! {
                    r = sock.recv_from(&mut buf) => r,
                    _ = &mut stopped => return,
                };
                let Ok((n, peer)) = got else {
                    return;
                };
                let Ok(q) = Message::from_vec(&buf[..n]) else {
                    continue;
                };
                if quiet.load(Ordering::SeqCst) {
                    unanswered.fetch_add(1, Ordering::SeqCst);
                    continue;
                }
                let mut resp = Message::response(q.metadata.id, q.metadata.op_code);
                resp.metadata.authoritative = true;
                resp.metadata.recursion_desired = q.metadata.recursion_desired;
                resp.metadata.recursion_available = true;
                for query in &q.queries {
                    resp.add_query(query.clone());
                    let name = query.name().to_string().to_ascii_lowercase();
                    if query.query_type() == RecordType::A
                        && name == "svc.test."
                        && on.load(Ordering::SeqCst)
                    {
                        let ip = *a2.lock().unwrap();
                        resp.add_answer(Record::from_rdata(
                            query.name().clone(),
                            ttl2.load(Ordering::SeqCst),
                            RData::A(A(ip)),
                        ));
                    }
                    if query.query_type() == RecordType::AAAA && aaaa_fails2.load(Ordering::SeqCst)
                    {
                        resp.metadata.response_code = hickory_proto::op::ResponseCode::ServFail;
                        continue;
                    }
                    if query.query_type() == RecordType::AAAA && name == "svc.test." {
                        for &ip in aaaa2.lock().unwrap().iter() {
                            resp.add_answer(Record::from_rdata(
                                query.name().clone(),
                                ttl2.load(Ordering::SeqCst),
                                RData::AAAA(hickory_proto::rr::rdata::AAAA(ip)),
                            ));
                        }
                    }
                }
                if let Ok(bytes) = resp.to_vec() {
                    let _ = sock.send_to(&bytes, peer).await;
                }
            }
        };
        std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(serve)
        });
        DnsServer {
            addr,
            a,
            ttl,
            answering,
            silent,
            ignored,
            aaaa,
            aaaa_fails,
            stop: Some(stop),
        }
    }

    /// Stops answering: the port is closed.
    fn stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }

    fn set(&self, ip: Ipv4Addr) {
        *self.a.lock().unwrap() = ip;
    }
}

/// An upstream on `ip:port` (port 0: any) that counts its requests.
async fn counting_on(ip: Ipv4Addr, port: u16) -> Option<(SocketAddr, Arc<AtomicUsize>)> {
    counting_gated_on(ip, port, watch::channel(true).1).await
}

/// [`counting_on`], answering each request only once `gate` is true.
async fn counting_gated_on(
    ip: Ipv4Addr,
    port: u16,
    gate: watch::Receiver<bool>,
) -> Option<(SocketAddr, Arc<AtomicUsize>)> {
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    // Binding may fail when the port is taken on this address: the caller picks another.
    let probe = std::net::TcpListener::bind((ip, port)).ok()?;
    let bind = probe.local_addr().unwrap();
    drop(probe);
    let addr = upstream_on(&bind.to_string(), move |_| {
        h.fetch_add(1, Ordering::SeqCst);
        let mut gate = gate.clone();
        async move {
            let _ = gate.wait_for(|open| *open).await;
            http::Response::new(full("ok"))
        }
    })
    .await;
    Some((addr, hits))
}

/// Two counting upstreams on 127.0.0.2 and 127.0.0.3, same port.
async fn twin_upstreams() -> (u16, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    twin_upstreams_a_gated(watch::channel(true).1).await
}

/// [`twin_upstreams`], the one on 127.0.0.2 answering only once `gate` is true.
async fn twin_upstreams_a_gated(
    gate: watch::Receiver<bool>,
) -> (u16, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    for _ in 0..20 {
        let (a, a_hits) = counting_gated_on(Ipv4Addr::new(127, 0, 0, 2), 0, gate.clone())
            .await
            .unwrap();
        if let Some((_, b_hits)) = counting_on(Ipv4Addr::new(127, 0, 0, 3), a.port()).await {
            return (a.port(), a_hits, b_hits);
        }
    }
    panic!("no port free on both 127.0.0.2 and 127.0.0.3");
}

fn gateway(dns: SocketAddr, port: u16, extra: &str) -> TestGateway {
    TestGateway::start(&format!(
        "[dns]\nnameservers = [\"{dns}\"]\nmin_refresh = \"50ms\"\nmax_refresh = \"1s\"\nquery_timeout = \"2s\"\nstartup_timeout = \"3s\"\n{extra}\n[[cluster]]\nname = \"up\"\nendpoints = [\"svc.test:{port}\"]\nmin_warm_connections = 1\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
    ))
}

/// With two workers, one DNS change is one added and one removed endpoint in `/metrics`:
/// every worker follows the change (each counts it in `/stats`), and the scrape does not
/// add their counts up.
#[tokio::test]
async fn a_dns_change_is_counted_once_whatever_the_workers() {
    let (port, _a_hits, b_hits) = twin_upstreams().await;
    let dns = DnsServer::start(Ipv4Addr::new(127, 0, 0, 2)).await;
    let gw = gateway(
        dns.addr,
        port,
        "[server]\nworkers = 2\nshutdown_grace = \"5s\"\n[admin]\naddress = \"127.0.0.1:0\"\n[log]\nlevel = \"warn\"\naccess_log = false\n[[listener]]\nname = \"main\"\naddress = \"127.0.0.1:0\"\n",
    );
    let g = gw.gw.as_ref().unwrap();
    dns.set(Ipv4Addr::new(127, 0, 0, 3));
    // Each worker follows the change (requests on new connections land on both).
    let mut sent = 0;
    while g.cluster_stat(|s| s.endpoints_removed.load(Ordering::Relaxed)) < 2 {
        assert_eq!(get(gw.addr, "/").await.status(), 200);
        sent += 1;
        assert!(sent < 2000, "the workers did not both follow the change");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(get(gw.addr, "/").await.status(), 200);
    assert!(
        b_hits.load(Ordering::SeqCst) > 0,
        "B serves after the change"
    );
    let admin = g.admin_addr().unwrap();
    let text = String::from_utf8(get(admin, "/metrics").await.body().to_vec()).unwrap();
    let ex = prom::parse(&text, false).unwrap();
    for name in [
        "tailgate_upstream_endpoints_added_total",
        "tailgate_upstream_endpoints_removed_total",
    ] {
        assert_eq!(ex.value(name, &[("cluster", "up")]), 1.0, "{name}");
    }
}

/// The A record moves from upstream A to upstream B under steady traffic: B starts getting
/// requests, A stops, no request fails, and the counters show the refresh.
#[tokio::test]
async fn hostname_endpoint_whose_address_changes_is_followed_without_a_failed_request() {
    let (port, a_hits, b_hits) = twin_upstreams().await;
    let dns = DnsServer::start(Ipv4Addr::new(127, 0, 0, 2)).await;
    let gw = gateway(dns.addr, port, "");
    let g = gw.gw.as_ref().unwrap();
    let mut c = h1_client(gw.addr).await;
    for i in 0..20 {
        assert_eq!(get_on(&mut c, "/").await, 200, "request {i}");
    }
    assert_eq!(a_hits.load(Ordering::SeqCst), 20, "resolved at start, to A");
    assert_eq!(b_hits.load(Ordering::SeqCst), 0);

    dns.set(Ipv4Addr::new(127, 0, 0, 3));
    let mut sent = 0;
    while b_hits.load(Ordering::SeqCst) < 20 {
        assert_eq!(
            get_on(&mut c, "/").await,
            200,
            "request {sent} after the change"
        );
        sent += 1;
        assert!(sent < 2000, "B never got traffic after the record changed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // A was removed: no more requests reach it.
    let a_before = a_hits.load(Ordering::SeqCst);
    for _ in 0..20 {
        assert_eq!(get_on(&mut c, "/").await, 200);
    }
    assert_eq!(
        a_hits.load(Ordering::SeqCst),
        a_before,
        "A gets nothing after the change"
    );

    let stats = g.dns_stats();
    assert!(
        stats.lookups.load(Ordering::Relaxed) >= 2,
        "refreshed by TTL"
    );
    assert_eq!(stats.failures.load(Ordering::Relaxed), 0);
    assert_eq!(
        stats.changes.load(Ordering::Relaxed),
        2,
        "published at start, then once for the change"
    );
    assert_eq!(
        g.cluster_stat(|s| s.endpoint_updates.load(Ordering::Relaxed)),
        1
    );
    assert_eq!(
        g.cluster_stat(|s| s.endpoints_added.load(Ordering::Relaxed)),
        1
    );
    assert_eq!(
        g.cluster_stat(|s| s.endpoints_removed.load(Ordering::Relaxed)),
        1
    );
    let pools = g.endpoint_pools();
    assert_eq!(pools.len(), 1);
    assert_eq!(pools[0].addr, SocketAddr::from(([127, 0, 0, 3], port)));
}

/// An address left out of one answer and back in a later one (a name whose servers answer
/// a changing subset of its addresses) gets its pool back, warm connections and counters
/// and all, instead of a new one that connects again.
#[tokio::test]
async fn an_address_back_in_a_later_answer_gets_its_pool_back() {
    let (port, a_hits, b_hits) = twin_upstreams().await;
    let dns = DnsServer::start(Ipv4Addr::new(127, 0, 0, 2)).await;
    let gw = gateway(dns.addr, port, "");
    let g = gw.gw.as_ref().unwrap();
    let mut c = h1_client(gw.addr).await;
    for _ in 0..10 {
        assert_eq!(get_on(&mut c, "/").await, 200);
    }
    let a = SocketAddr::from(([127, 0, 0, 2], port));
    let pool_of_a = || g.endpoint_pools().into_iter().find(|p| p.addr == a);
    let first = pool_of_a().expect("A's pool");
    let reuses = first.stats.reuses.load(Ordering::SeqCst);
    assert!(reuses >= 9, "{reuses}");
    // Out of the answer for a moment (well within the idle timeout of 4 s).
    dns.set(Ipv4Addr::new(127, 0, 0, 3));
    while b_hits.load(Ordering::SeqCst) < 5 {
        assert_eq!(get_on(&mut c, "/").await, 200);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(pool_of_a().is_none(), "A takes no request while out");
    dns.set(Ipv4Addr::new(127, 0, 0, 2));
    let a_before = a_hits.load(Ordering::SeqCst);
    while a_hits.load(Ordering::SeqCst) < a_before + 5 {
        assert_eq!(get_on(&mut c, "/").await, 200);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let back = pool_of_a().expect("A's pool again");
    assert!(Arc::ptr_eq(&first, &back), "the same pool came back");
    assert!(back.stats.reuses.load(Ordering::SeqCst) >= reuses + 5);
    assert_eq!(
        back.stats.connects_on_request.load(Ordering::SeqCst),
        first.stats.connects_on_request.load(Ordering::SeqCst)
    );
}

/// Under `max_connections_per_endpoint`, a request queued for A's one connection when A
/// leaves the answer is let go then (not when A's parked pool is drained, an idle timeout
/// later), and B answers it, whatever the retry budget says. (It waited on for A before, and a connection given back or a
/// place freed there later would have sent it to the removed address.)
#[tokio::test]
async fn a_request_queued_for_a_removed_address_goes_to_another() {
    let (open_a, gate) = watch::channel(false);
    let (port, a_hits, b_hits) = twin_upstreams_a_gated(gate).await;
    let dns = DnsServer::start(Ipv4Addr::new(127, 0, 0, 2)).await;
    let gw = TestGateway::start(&format!(
        "[dns]\nnameservers = [\"{}\"]\nmin_refresh = \"50ms\"\nmax_refresh = \"1s\"\nquery_timeout = \"2s\"\nstartup_timeout = \"3s\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"svc.test:{port}\"]\nmax_connections_per_endpoint = 1\nidle_timeout = \"60s\"\nconnect_timeout = \"20s\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n",
        dns.addr
    ));
    let g = gw.gw.as_ref().unwrap();
    let a = SocketAddr::from(([127, 0, 0, 2], port));
    let pool_a = g
        .endpoint_pools()
        .into_iter()
        .find(|p| p.addr == a)
        .expect("A's pool");
    // The first request holds A's one connection; the second queues for it.
    let mut c1 = h1_client(gw.addr).await;
    let first = tokio::spawn(async move { get_on(&mut c1, "/").await });
    wait_for("the first request at A", || {
        a_hits.load(Ordering::SeqCst) == 1
    })
    .await;
    let mut c2 = h1_client(gw.addr).await;
    let second = tokio::spawn(async move { get_on(&mut c2, "/").await });
    wait_for("the second request queued", || {
        pool_a.stats.queued.load(Ordering::SeqCst) == 1
    })
    .await;
    // With the retry budget spent: sending it elsewhere costs none.
    let cluster = &g.admin_state().workers[0].upstreams.clusters[0];
    while cluster.try_spend_retry() {}
    dns.set(Ipv4Addr::new(127, 0, 0, 3));
    let status = tokio::time::timeout(Duration::from_secs(10), second)
        .await
        .expect("the queued request was let go when A left the answer")
        .unwrap();
    assert_eq!(status, 200);
    assert!(!cluster.try_spend_retry(), "the budget was still spent");
    assert_eq!(b_hits.load(Ordering::SeqCst), 1, "B answered it");
    assert_eq!(a_hits.load(Ordering::SeqCst), 1, "A got only the first");
    assert!(!first.is_finished(), "A's connection was still busy");
    assert_eq!(pool_a.stats.queue_timeouts.load(Ordering::SeqCst), 0);
    // The first request's connection serves it to the end, removed address or not.
    open_a.send_replace(true);
    assert_eq!(first.await.unwrap(), 200);
}

/// The DNS server goes away: lookups fail and are counted, and requests keep going to the
/// last resolved address.
#[tokio::test]
async fn resolver_failure_serves_the_last_addresses() {
    let (port, a_hits, _) = twin_upstreams().await;
    let mut dns = DnsServer::start(Ipv4Addr::new(127, 0, 0, 2)).await;
    let gw = gateway(dns.addr, port, "");
    let g = gw.gw.as_ref().unwrap();
    let mut c = h1_client(gw.addr).await;
    assert_eq!(get_on(&mut c, "/").await, 200);
    dns.stop();
    wait_for("failed lookups", || {
        g.dns_stats().failures.load(Ordering::Relaxed) >= 2
    })
    .await;
    for i in 0..20 {
        assert_eq!(
            get_on(&mut c, "/").await,
            200,
            "request {i} while DNS is down"
        );
    }
    assert_eq!(a_hits.load(Ordering::SeqCst), 21);
    assert_eq!(
        g.cluster_stat(|s| s.endpoints_removed.load(Ordering::Relaxed)),
        0
    );
    assert_eq!(g.endpoint_pools().len(), 1, "the stale address is kept");
}

/// A 502 for want of an address (`no_endpoints`).
fn assert_no_endpoints(resp: http::Response<bytes::Bytes>) {
    assert_eq!(resp.status(), 502);
    assert!(
        String::from_utf8_lossy(resp.body()).contains("no_endpoints"),
        "{:?}",
        resp.body()
    );
}

/// A name that has no address at start: the gateway starts, the cluster answers 502
/// (no endpoints) without crashing, asks the resolver to look again at once, and serves
/// once the name resolves.
#[tokio::test]
async fn unresolved_name_at_start_is_502_until_it_resolves() {
    let (port, a_hits, _) = twin_upstreams().await;
    let dns = DnsServer::start(Ipv4Addr::new(127, 0, 0, 2)).await;
    dns.answering.store(false, Ordering::SeqCst);
    let gw = gateway(dns.addr, port, "");
    let g = gw.gw.as_ref().unwrap();
    assert_no_endpoints(get(gw.addr, "/").await);
    // An answer of no address is an answer, not a failed lookup.
    assert!(g.dns_stats().lookups.load(Ordering::Relaxed) >= 1);
    assert_eq!(g.dns_stats().failures.load(Ordering::Relaxed), 0);
    // A request that found no address asks for a lookup now, not after the backoff.
    wait_for("an early refresh", || {
        g.dns_stats().early_refreshes.load(Ordering::Relaxed) >= 1
    })
    .await;
    dns.answering.store(true, Ordering::SeqCst);
    wait_for("the name to resolve", || g.endpoint_pools().len() == 1).await;
    assert_eq!(get(gw.addr, "/").await.status(), 200);
    assert_eq!(a_hits.load(Ordering::SeqCst), 1);
}

/// Addresses in an answer no connect can use (link-local IPv6, which names no interface;
/// unspecified, also IPv4-mapped; multicast) are left out (counted, logged), never made endpoints whose
/// every connect fails or reaches the wrong server; an answer of nothing else is a failed
/// lookup (502 `no_endpoints` until a usable one comes).
#[tokio::test]
async fn addresses_no_connect_can_use_are_left_out_of_an_answer() {
    let (port, a_hits, _) = twin_upstreams().await;
    let dns = DnsServer::start(Ipv4Addr::new(127, 0, 0, 2)).await;
    dns.answering.store(false, Ordering::SeqCst);
    *dns.aaaa.lock().unwrap() = ["fe80::1", "::", "ff02::1", "::ffff:0.0.0.0"]
        .iter()
        .map(|a| a.parse().unwrap())
        .collect();
    let gw = gateway(dns.addr, port, "[admin]\naddress = \"127.0.0.1:0\"");
    let g = gw.gw.as_ref().unwrap();
    assert_no_endpoints(get(gw.addr, "/").await);
    assert!(g.dns_stats().failures.load(Ordering::Relaxed) >= 1);
    assert!(g.dns_stats().unusable.load(Ordering::Relaxed) >= 4);
    assert!(g.endpoint_pools().is_empty());
    dns.answering.store(true, Ordering::SeqCst);
    wait_for("the name to resolve", || g.endpoint_pools().len() == 1).await;
    for _ in 0..5 {
        assert_eq!(get(gw.addr, "/").await.status(), 200);
    }
    assert_eq!(a_hits.load(Ordering::SeqCst), 5);
    assert_eq!(g.endpoint_pools().len(), 1, "only the IPv4 address");
    let admin = g.admin_addr().unwrap();
    let text = String::from_utf8(get(admin, "/metrics").await.body().to_vec()).unwrap();
    let left_out = prom::parse(&text, false)
        .unwrap()
        .value("tailgate_dns_unusable_addresses_total", &[]);
    assert!(left_out >= 8.0, "{left_out}");
}

/// Requests that find no address ask for a lookup at most once per `min_refresh`, however
/// many come: a fast 502 must not wake the resolver thousands of times a second.
#[tokio::test]
async fn requests_without_an_address_ask_for_a_lookup_once_per_min_refresh() {
    let (port, _, _) = twin_upstreams().await;
    let dns = DnsServer::start(Ipv4Addr::new(127, 0, 0, 2)).await;
    dns.answering.store(false, Ordering::SeqCst);
    let gw = TestGateway::start(&format!(
        "[dns]\nnameservers = [\"{}\"]\nmin_refresh = \"10s\"\nmax_refresh = \"60s\"\nquery_timeout = \"2s\"\nstartup_timeout = \"3s\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"svc.test:{port}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n",
        dns.addr
    ));
    let g = gw.gw.as_ref().unwrap();
    let mut c = h1_client(gw.addr).await;
    // Spaced, so that the resolver thread runs between them: each would wake it.
    for _ in 0..30 {
        assert_eq!(get_on(&mut c, "/").await, 502);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    wait_for("an early refresh", || {
        g.dns_stats().early_refreshes.load(Ordering::Relaxed) >= 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(g.dns_stats().early_refreshes.load(Ordering::Relaxed), 1);
}

/// Failover (seed 004): the name moved to a new address while the cached answer is still
/// valid for a long time. A connect failure to the old address asks for an early
/// re-resolution, so traffic follows the name long before `max_refresh` (60 s here).
#[tokio::test]
async fn connect_failure_re_resolves_early() {
    // Only B listens; the name first points at 127.0.0.2, where nothing does.
    let (b, b_hits) = counting_on(Ipv4Addr::new(127, 0, 0, 3), 0).await.unwrap();
    let dns = DnsServer::start(Ipv4Addr::new(127, 0, 0, 2)).await;
    // A long TTL: the next refresh by TTL is due only after max_refresh (60 s).
    dns.ttl.store(3600, Ordering::SeqCst);
    let gw = TestGateway::start(&format!(
        "[dns]\nnameservers = [\"{}\"]\nmin_refresh = \"50ms\"\nmax_refresh = \"60s\"\nquery_timeout = \"2s\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"svc.test:{}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n",
        dns.addr,
        b.port()
    ));
    let g = gw.gw.as_ref().unwrap();
    assert_eq!(g.dns_stats().lookups.load(Ordering::Relaxed), 1);
    // Failover: the name moves. Only a re-resolution before the TTL runs out finds it.
    dns.set(Ipv4Addr::new(127, 0, 0, 3));
    let status = get(gw.addr, "/").await.status();
    assert_eq!(status, 502, "the old address refuses connections");
    wait_for("an early refresh", || {
        g.dns_stats().early_refreshes.load(Ordering::Relaxed) >= 1
    })
    .await;
    wait_for("the new address", || {
        g.endpoint_pools()
            .iter()
            .any(|p| p.addr.ip() == Ipv4Addr::new(127, 0, 0, 3))
    })
    .await;
    assert_eq!(get(gw.addr, "/").await.status(), 200);
    assert_eq!(b_hits.load(Ordering::SeqCst), 1);
}

/// A connect failure to an endpoint written as an address (beside a host name in the same
/// cluster) asks for no re-resolution: no name's answer would move it, and a dead one had
/// the name servers asked again at every `min_refresh` for as long as it stayed down.
#[tokio::test]
async fn a_dead_address_endpoint_does_not_re_resolve_the_names() {
    let (b, b_hits) = counting_on(Ipv4Addr::new(127, 0, 0, 3), 0).await.unwrap();
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_addr = dead.local_addr().unwrap();
    drop(dead);
    let dns = DnsServer::start(Ipv4Addr::new(127, 0, 0, 3)).await;
    dns.ttl.store(3600, Ordering::SeqCst);
    let gw = TestGateway::start(&format!(
        "[dns]\nnameservers = [\"{}\"]\nmin_refresh = \"50ms\"\nmax_refresh = \"60s\"\nquery_timeout = \"2s\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"{dead_addr}\", \"svc.test:{}\"]\nbalance = \"round_robin\"\neject_after_failures = 0\nretry_budget_percent = 100\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n",
        dns.addr,
        b.port()
    ));
    let g = gw.gw.as_ref().unwrap();
    for _ in 0..6 {
        assert_eq!(get(gw.addr, "/").await.status(), 200);
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    assert_eq!(b_hits.load(Ordering::SeqCst), 6);
    let failed: u64 = g
        .endpoint_pools()
        .iter()
        .filter(|p| p.addr == dead_addr)
        .map(|p| p.stats.connect_failures.load(Ordering::Relaxed))
        .sum();
    assert!(failed >= 2, "the address endpoint was tried: {failed}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(g.dns_stats().early_refreshes.load(Ordering::Relaxed), 0);
}

/// An `https://` host-name endpoint: the name is the SNI and what the certificate is verified
/// against (the resolved address is not).
#[tokio::test]
async fn https_host_name_endpoint_is_verified_against_its_name() {
    let pki = tls::Pki::new();
    let (up, seen) = tls::tls_ok_upstream(&pki, tls::ServerOpts::default()).await;
    let dns = DnsServer::start(Ipv4Addr::LOCALHOST).await;
    let gw = TestGateway::start(&format!(
        "[dns]\nnameservers = [\"{}\"]\nquery_timeout = \"2s\"\nstartup_timeout = \"3s\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"https://svc.test:{}\"]\ntls_ca = \"{}\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n",
        dns.addr,
        up.port(),
        pki.path("ca.pem")
    ));
    let resp = get(gw.addr, "/").await;
    assert_eq!(resp.status(), 200);
    let hs = seen.handshakes.lock().unwrap().clone();
    assert_eq!(hs.len(), 1);
    assert_eq!(hs[0].sni.as_deref(), Some("svc.test"));
}

/// A shutdown does not wait for a name server that stopped answering: the refresh under way
/// (up to `query_timeout`, a minute here) is dropped, and the gateway stops as soon as its
/// drain is done.
#[tokio::test]
async fn shutdown_does_not_wait_for_a_quiet_name_server() {
    let (port, _a, _b) = twin_upstreams().await;
    let dns = DnsServer::start(Ipv4Addr::new(127, 0, 0, 2)).await;
    let mut gw = TestGateway::start(&format!(
        "[dns]\nnameservers = [\"{}\"]\nmin_refresh = \"50ms\"\nmax_refresh = \"1s\"\nquery_timeout = \"60s\"\nstartup_timeout = \"3s\"\n[server]\nshutdown_grace = \"1s\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"svc.test:{port}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n",
        dns.addr
    ));
    assert_eq!(get(gw.addr, "/").await.status(), 200);
    dns.silent.store(true, Ordering::SeqCst);
    // Past the record's TTL (1 s): a refresh is waiting on the quiet server.
    wait_for("a refresh waiting on the quiet server", || {
        dns.ignored.load(Ordering::SeqCst) > 0
    })
    .await;
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        gw.shutdown();
        let _ = done_tx.send(());
    });
    // The drain (nothing in flight) is immediate; a minute's query must not be waited out.
    assert!(
        tokio::task::spawn_blocking(move || done_rx.recv_timeout(Duration::from_secs(15)))
            .await
            .unwrap()
            .is_ok(),
        "the gateway was still stopping 15 s after the shutdown"
    );
}

/// A pool's requests, as `/metrics` sums them for the endpoint `ep` (`None`: the
/// `_removed` series); `None` when there is no such series.
async fn requests_to(admin: SocketAddr, ep: Option<SocketAddr>) -> Option<f64> {
    let resp = get(admin, "/metrics").await;
    let text = std::str::from_utf8(resp.body()).unwrap().to_owned();
    let ex = prom::parse(&text, false).unwrap();
    let ep = ep.map_or_else(|| "_removed".to_owned(), |a| a.to_string());
    let with = [("cluster", "up"), ("endpoint", ep.as_str())];
    let reuses = ex.find("tailgate_upstream_connection_reuses_total", &with);
    let connects = ex.find(
        "tailgate_upstream_connects_total",
        &[with[0], with[1], ("when", "on_request")],
    );
    Some(reuses.first()?.value + connects.first()?.value)
}

/// Waits (up to 4 s) until `/metrics` has a series for `ep`, or (`shown` false) has none;
/// fails with `what` if it does not come to that.
async fn series_shown(admin: SocketAddr, ep: SocketAddr, shown: bool, what: &str) {
    for _ in 0..400 {
        if requests_to(admin, Some(ep)).await.is_some() == shown {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{what}");
}

/// An address dropped from the DNS answer: its per-endpoint counters in `/metrics` never
/// go back while the workers drain its pools, each on its own time (here the second worker
/// is held while the first drains), and once no worker has it any more its counts go on
/// under `endpoint="_removed"`.
#[tokio::test]
async fn a_removed_address_counters_never_go_back() {
    let (port, _a, _b) = twin_upstreams().await;
    let dns = DnsServer::start(Ipv4Addr::new(127, 0, 0, 2)).await;
    let gw = TestGateway::start(&format!(
        "[server]\nworkers = 2\n[admin]\naddress = \"127.0.0.1:0\"\n[dns]\nnameservers = [\"{}\"]\nmin_refresh = \"50ms\"\nmax_refresh = \"1s\"\nquery_timeout = \"2s\"\nstartup_timeout = \"3s\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"svc.test:{port}\"]\nidle_timeout = \"0s\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n",
        dns.addr
    ));
    let admin = gw.gw.as_ref().unwrap().admin_addr().unwrap();
    let state = gw.gw.as_ref().unwrap().admin_state().clone();
    let a: SocketAddr = format!("127.0.0.2:{port}").parse().unwrap();
    let b: SocketAddr = format!("127.0.0.3:{port}").parse().unwrap();
    // Requests on new connections until the first worker has sent some to A.
    let served = |w: usize| -> u64 {
        state.workers[w].upstreams.clusters[0]
            .endpoints
            .load()
            .iter()
            .map(|e| {
                e.stats.reuses.load(Ordering::Relaxed)
                    + e.stats.connects_on_request.load(Ordering::Relaxed)
            })
            .sum()
    };
    for _ in 0..200 {
        assert_eq!(get(gw.addr, "/").await.status(), 200);
        if served(0) > 0 {
            break;
        }
    }
    assert!(served(0) > 0, "no request reached the first worker");
    let before = requests_to(admin, Some(a)).await.unwrap();
    assert_eq!(before as u64, served(0) + served(1));
    // The second worker is held: only the first applies the new answer (and drains A's
    // pool at once, with no idle_timeout to park it for).
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    gw.gw
        .as_ref()
        .unwrap()
        .worker_handle(1)
        .unwrap()
        .spawn(async move {
            let _ = held_tx.send(());
            let _ = release_rx.recv_timeout(Duration::from_secs(20));
        });
    held_rx.recv().unwrap();
    dns.set(Ipv4Addr::new(127, 0, 0, 3));
    // B's series appears once the first worker has the new answer.
    series_shown(
        admin,
        b,
        true,
        "the first worker did not take the new answer",
    )
    .await;
    assert_eq!(
        requests_to(admin, Some(a)).await,
        Some(before),
        "A's counters went back while the second worker still had its pool"
    );
    assert_eq!(requests_to(admin, None).await, None);
    release_tx.send(()).unwrap();
    // Once the second worker drops A too, its counts are under `_removed`.
    series_shown(admin, a, false, "the second worker did not drop A").await;
    assert_eq!(requests_to(admin, None).await, Some(before));
    // A comes back: its series starts afresh (a reset, as after a restart), and what was
    // summed under `_removed` stays there.
    dns.set(Ipv4Addr::new(127, 0, 0, 2));
    series_shown(admin, a, true, "A did not come back").await;
    assert_eq!(get(gw.addr, "/").await.status(), 200);
    assert_eq!(requests_to(admin, None).await, Some(before));
}

/// A parked pool drained on its own tick (the address left out of the answer for the
/// cluster's `idle_timeout`) hands its counts on too: nothing is lost or counted twice
/// on the way to `_removed`, on either worker.
#[tokio::test]
async fn a_parked_pools_counts_reach_removed_when_it_is_drained() {
    let (port, _a, _b) = twin_upstreams().await;
    let dns = DnsServer::start(Ipv4Addr::new(127, 0, 0, 2)).await;
    let gw = TestGateway::start(&format!(
        "[server]\nworkers = 2\n[admin]\naddress = \"127.0.0.1:0\"\n[dns]\nnameservers = [\"{}\"]\nmin_refresh = \"50ms\"\nmax_refresh = \"1s\"\nquery_timeout = \"2s\"\nstartup_timeout = \"3s\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"svc.test:{port}\"]\nidle_timeout = \"200ms\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n",
        dns.addr
    ));
    let admin = gw.gw.as_ref().unwrap().admin_addr().unwrap();
    let a: SocketAddr = format!("127.0.0.2:{port}").parse().unwrap();
    for _ in 0..20 {
        assert_eq!(get(gw.addr, "/").await.status(), 200);
    }
    let before = requests_to(admin, Some(a)).await.unwrap();
    assert!(before >= 20.0, "{before}");
    dns.set(Ipv4Addr::new(127, 0, 0, 3));
    // Scraped all along: A's series never goes below what it had, and once it is gone
    // `_removed` has exactly that.
    let mut last = before;
    for _ in 0..600 {
        match requests_to(admin, Some(a)).await {
            Some(now) => {
                assert!(now >= last, "A went back from {last} to {now}");
                last = now;
            }
            None => break,
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        requests_to(admin, Some(a)).await.is_none(),
        "A was not drained"
    );
    assert_eq!(requests_to(admin, None).await, Some(before));
}

/// A cluster warm once stays warm for readiness: a DNS answer that moves it to an address
/// where nothing answers (a new pool, its counts at zero) leaves `/readyz` at 200. It went
/// back to 503, for good while the new address stayed dead: every replica would leave
/// rotation together at the same DNS change.
#[tokio::test]
async fn readiness_stays_once_a_cluster_was_warm() {
    let Some((up, _)) = counting_on(Ipv4Addr::new(127, 0, 0, 2), 0).await else {
        panic!("no port on 127.0.0.2");
    };
    let dns = DnsServer::start(Ipv4Addr::new(127, 0, 0, 2)).await;
    let gw = gateway(
        dns.addr,
        up.port(),
        "[server]\nworkers = 1\nwarm_wait = \"30days\"\n[admin]\naddress = \"127.0.0.1:0\"\n",
    );
    let admin = gw.gw.as_ref().unwrap().admin_addr().expect("admin");
    let readyz = || async move {
        let mut c = h1_client(admin).await;
        get_on(&mut c, "/readyz").await
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while readyz().await != 200 {
        assert!(std::time::Instant::now() < deadline, "never ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Nothing listens on 127.0.0.9 at that port: once the cluster has moved there, its
    // requests fail.
    dns.set(Ipv4Addr::new(127, 0, 0, 9));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let mut c = h1_client(gw.addr).await;
        if get_on(&mut c, "/").await == 502 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the cluster never moved"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        readyz().await,
        200,
        "readiness went back once the cluster moved"
    );
}

/// A name server that fails the AAAA lookups while it answers the A ones: the name's IPv6
/// endpoint is kept (as a whole failed lookup keeps every address), not dropped as if the
/// name no longer had it, and the failure is counted. The name is asked again with a
/// backoff, as after a whole lookup's failure: it was asked at every `min_refresh` (50 ms
/// here) for as long as the AAAA lookups failed.
#[tokio::test]
async fn a_failed_aaaa_lookup_keeps_the_ipv6_endpoints() {
    let (v4, v4_hits) = counting_on(Ipv4Addr::new(127, 0, 0, 2), 0).await.unwrap();
    let v6_hits = Arc::new(AtomicUsize::new(0));
    let h = v6_hits.clone();
    upstream_on(&format!("[::1]:{}", v4.port()), move |_| {
        h.fetch_add(1, Ordering::SeqCst);
        async { http::Response::new(full("ok")) }
    })
    .await;
    let dns = DnsServer::start(Ipv4Addr::new(127, 0, 0, 2)).await;
    *dns.aaaa.lock().unwrap() = vec![std::net::Ipv6Addr::LOCALHOST];
    let gw = gateway(dns.addr, v4.port(), "");
    let g = gw.gw.as_ref().unwrap();
    fail_aaaa(g, &dns).await;
    assert_eq!(
        g.cluster_stat(|s| s.endpoints_removed.load(Ordering::Relaxed)),
        0
    );
    assert_eq!(g.endpoint_pools().len(), 2, "the IPv6 address is kept");
    for _ in 0..6 {
        assert_eq!(get(gw.addr, "/").await.status(), 200);
    }
    assert!(
        v6_hits.load(Ordering::SeqCst) > 0,
        "requests still reach [::1]"
    );
    assert!(v4_hits.load(Ordering::SeqCst) > 0);
    // Backing off (50 ms doubling, up to `max_refresh`, 1 s): a handful of lookups in 1.5 s,
    // not thirty.
    let before = g.dns_stats().failures.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let more = g.dns_stats().failures.load(Ordering::Relaxed) - before;
    assert!(more <= 8, "{more} failed lookups in 1.5 s");
}

/// Once the name has both families' endpoints, the name server fails its AAAA lookups;
/// returns once two have failed.
async fn fail_aaaa(g: &tailgate::Gateway, dns: &DnsServer) {
    wait_for("both families", || g.endpoint_pools().len() == 2).await;
    let failures = g.dns_stats().failures.load(Ordering::Relaxed);
    dns.aaaa_fails.store(true, Ordering::SeqCst);
    wait_for("failed AAAA lookups", || {
        g.dns_stats().failures.load(Ordering::Relaxed) >= failures + 2
    })
    .await;
}

/// While a name's AAAA lookups fail, the IPv6 addresses kept meanwhile may be dead:
/// connect failures to them ask for early lookups, which must not undo the backoff (it
/// was undone at every connect failure, and the failing family asked for every
/// `min_refresh` again).
#[tokio::test]
async fn connect_failures_to_kept_addresses_do_not_undo_the_backoff() {
    let (v4, _) = counting_on(Ipv4Addr::new(127, 0, 0, 2), 0).await.unwrap();
    let dns = DnsServer::start(Ipv4Addr::new(127, 0, 0, 2)).await;
    // [::1] at the same port: nothing listens there.
    *dns.aaaa.lock().unwrap() = vec![std::net::Ipv6Addr::LOCALHOST];
    let gw = TestGateway::start(&format!(
        "[dns]\nnameservers = [\"{}\"]\nmin_refresh = \"50ms\"\nmax_refresh = \"1s\"\nquery_timeout = \"2s\"\nstartup_timeout = \"3s\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"svc.test:{}\"]\nbalance = \"round_robin\"\neject_after_failures = 0\nretry_budget_percent = 100\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n",
        dns.addr,
        v4.port()
    ));
    let g = gw.gw.as_ref().unwrap();
    fail_aaaa(g, &dns).await;
    // Requests for 1.5 s, half of them first to the dead [::1] (then to the other).
    let before = g.dns_stats().failures.load(Ordering::Relaxed);
    let early_before = g.dns_stats().early_refreshes.load(Ordering::Relaxed);
    let until = std::time::Instant::now() + Duration::from_millis(1500);
    while std::time::Instant::now() < until {
        assert_eq!(get(gw.addr, "/").await.status(), 200);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        g.dns_stats().early_refreshes.load(Ordering::Relaxed) > early_before,
        "the dead address asked for early lookups"
    );
    let more = g.dns_stats().failures.load(Ordering::Relaxed) - before;
    assert!(more <= 8, "{more} failed lookups in 1.5 s");
}

/// `dns.family = "ipv4"` (nginx's resolver `ipv6=off`): a name's AAAA records are not
/// looked up, so on a host with no IPv6 route its IPv6 addresses are no endpoints whose
/// every connect fails; `"ipv6"` keeps those alone.
#[tokio::test]
async fn the_address_family_setting_leaves_the_other_out() {
    let (v4, _) = counting_on(Ipv4Addr::new(127, 0, 0, 2), 0).await.unwrap();
    let dns = DnsServer::start(Ipv4Addr::new(127, 0, 0, 2)).await;
    *dns.aaaa.lock().unwrap() = vec![std::net::Ipv6Addr::LOCALHOST];
    for (family, v6) in [("ipv4", false), ("ipv6", true)] {
        let gw = gateway(dns.addr, v4.port(), &format!("family = \"{family}\""));
        let g = gw.gw.as_ref().unwrap();
        wait_for("resolved", || !g.endpoint_pools().is_empty()).await;
        // Refreshed a few times (every 50 ms to 1 s): still the one family only.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let pools = g.endpoint_pools();
        assert!(
            pools.iter().all(|p| p.addr.is_ipv6() == v6),
            "{family}: {:?}",
            pools.iter().map(|p| p.addr).collect::<Vec<_>>()
        );
    }
}

/// The name servers say the name has no address any more (its service scaled to nothing, its
/// record deleted): its endpoints go, and requests get `502 no_endpoints`, rather than keep
/// going to addresses the name no longer has (which may by now be another service's); once
/// it has an address again, it is served. A name server that stops answering keeps them
/// (`resolver_failure_serves_the_last_addresses`).
#[tokio::test]
async fn a_name_with_no_address_any_more_loses_its_endpoints() {
    let (port, a_hits, _) = twin_upstreams().await;
    let dns = DnsServer::start(Ipv4Addr::new(127, 0, 0, 2)).await;
    let gw = gateway(dns.addr, port, "[admin]\naddress = \"127.0.0.1:0\"");
    let g = gw.gw.as_ref().unwrap();
    let admin = g.admin_addr().unwrap();
    // `tailgate_upstream_endpoints` says what the cluster has now.
    let endpoints = async || {
        let resp = get(admin, "/metrics").await;
        let text = std::str::from_utf8(resp.body()).unwrap().to_owned();
        let ex = prom::parse(&text, false).unwrap();
        ex.find("tailgate_upstream_endpoints", &[("cluster", "up")])
            .first()
            .map(|s| s.value)
    };
    assert_eq!(endpoints().await, Some(1.0));
    assert_eq!(get(gw.addr, "/").await.status(), 200);
    dns.answering.store(false, Ordering::SeqCst);
    wait_for("the endpoint to go", || {
        g.cluster_stat(|s| s.endpoints_removed.load(Ordering::Relaxed)) >= 1
    })
    .await;
    assert!(g.endpoint_pools().is_empty());
    assert_eq!(endpoints().await, Some(0.0));
    assert_no_endpoints(get(gw.addr, "/").await);
    assert_eq!(a_hits.load(Ordering::SeqCst), 1);
    dns.answering.store(true, Ordering::SeqCst);
    wait_for("the name to resolve again", || {
        g.endpoint_pools().len() == 1
    })
    .await;
    assert_eq!(get(gw.addr, "/").await.status(), 200);
    assert_eq!(a_hits.load(Ordering::SeqCst), 2);
}

/// A name with no address (none yet: its name server was quiet at start and has been
/// since, each failure doubling the wait for the next look) is looked up again as soon as
/// a request finds its cluster empty, not at the end of its backoff: before, every request
/// got `502` for up to `max_refresh` after the name server came back (here, the backoff
/// is past 2.5 s when it does).
#[tokio::test]
async fn a_name_with_no_address_is_asked_again_at_once_when_requests_need_it() {
    let (port, a_hits, _) = twin_upstreams().await;
    let dns = DnsServer::start(Ipv4Addr::new(127, 0, 0, 2)).await;
    dns.silent.store(true, Ordering::SeqCst);
    let gw = TestGateway::start(&format!(
        "[dns]\nnameservers = [\"{}\"]\nmin_refresh = \"10ms\"\nmax_refresh = \"60s\"\nquery_timeout = \"50ms\"\nstartup_timeout = \"100ms\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"svc.test:{port}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n",
        dns.addr
    ));
    let g = gw.gw.as_ref().unwrap();
    let at_start = g.dns_stats().failures.load(Ordering::Relaxed);
    assert!(
        at_start >= 1,
        "the quiet name server failed no lookup at start"
    );
    // Eight failures in a row after the start: the next look is 2.56 s after the last.
    wait_for("eight more failed lookups", || {
        g.dns_stats().failures.load(Ordering::Relaxed) >= at_start + 8
    })
    .await;
    dns.silent.store(false, Ordering::SeqCst);
    let mut statuses = Vec::new();
    for _ in 0..50 {
        let status = get(gw.addr, "/").await.status().as_u16();
        statuses.push(status);
        if status == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        statuses.last(),
        Some(&200),
        "the name was not asked again while requests found no endpoint: {statuses:?}"
    );
    assert!(statuses[..statuses.len() - 1].iter().all(|&s| s == 502));
    assert_eq!(a_hits.load(Ordering::SeqCst), 1);
}

/// A name whose first lookup fails at start (a name server that drops the first queries,
/// as a local resolver still starting would) is asked again until `startup_timeout`, so
/// the gateway starts with its address: before, one failed query at start left its
/// cluster empty, and the first requests got `502 no_endpoints`.
#[tokio::test]
async fn a_lookup_failed_at_start_is_tried_again_within_the_startup_timeout() {
    let (port, a_hits, _) = twin_upstreams().await;
    let dns = DnsServer::start(Ipv4Addr::new(127, 0, 0, 2)).await;
    dns.silent.store(true, Ordering::SeqCst);
    let silent = dns.silent.clone();
    let ignored = dns.ignored.clone();
    // Answers once the first query has been dropped (and 100 ms have passed).
    let waker = std::thread::spawn(move || {
        while ignored.load(Ordering::SeqCst) == 0 {
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(100));
        silent.store(false, Ordering::SeqCst);
    });
    let gw = TestGateway::start(&format!(
        "[dns]\nnameservers = [\"{}\"]\nmin_refresh = \"10s\"\nmax_refresh = \"60s\"\nquery_timeout = \"100ms\"\nstartup_timeout = \"10s\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"svc.test:{port}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n",
        dns.addr
    ));
    waker.join().unwrap();
    let g = gw.gw.as_ref().unwrap();
    assert!(g.dns_stats().failures.load(Ordering::Relaxed) >= 1);
    assert_eq!(get(gw.addr, "/").await.status(), 200);
    assert_eq!(a_hits.load(Ordering::SeqCst), 1);
}

/// A TLS handshake that fails on a resolved address (its certificate is not the name's:
/// the address may be another service's by now) asks for an early re-resolution, as a
/// refused connect does; before, the address was kept until its TTL ran out.
#[tokio::test]
async fn a_failed_tls_handshake_re_resolves_early() {
    let pki = tls::Pki::new();
    let (up, _seen) = tls::tls_ok_upstream(
        &pki,
        tls::ServerOpts {
            cert: "dns-only.pem",
            key: "dns-only.key",
            ..Default::default()
        },
    )
    .await;
    let dns = DnsServer::start(Ipv4Addr::LOCALHOST).await;
    dns.ttl.store(3600, Ordering::SeqCst);
    let gw = TestGateway::start(&format!(
        "[dns]\nnameservers = [\"{}\"]\nmin_refresh = \"50ms\"\nmax_refresh = \"1h\"\nquery_timeout = \"2s\"\nstartup_timeout = \"3s\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"https://svc.test:{}\"]\ntls_ca = \"{}\"\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n",
        dns.addr,
        up.port(),
        pki.path("ca.pem")
    ));
    let g = gw.gw.as_ref().unwrap();
    assert_eq!(get(gw.addr, "/").await.status(), 502);
    wait_for("an early re-resolution", || {
        g.dns_stats().early_refreshes.load(Ordering::Relaxed) >= 1
    })
    .await;
}
