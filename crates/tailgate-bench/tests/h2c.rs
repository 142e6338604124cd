//! HTTP/2 with prior knowledge (h2c) against a hyper server that speaks only HTTP/2, and
//! against the built-in upstream's h2c path.

#![allow(clippy::unwrap_used)]

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::server::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo};
mod common;

use common::serve_on_thread;
use tailgate_bench::load::target::Url;
use tailgate_bench::load::{self, Spec, Stop};

fn h2_only_server() -> (std::net::SocketAddr, Arc<AtomicU64>) {
    let hits = Arc::new(AtomicU64::new(0));
    let counter = hits.clone();
    let addr = serve_on_thread(move |l| async move {
        loop {
            let (s, _) = l.accept().await.unwrap();
            let counter = counter.clone();
            tokio::spawn(async move {
                let svc =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        assert_eq!(req.version(), http::Version::HTTP_2);
                        counter.fetch_add(1, Ordering::SeqCst);
                        async {
                            Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::from_static(
                                b"hello h2",
                            ))))
                        }
                    });
                let _ = http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    (addr, hits)
}

fn h2_spec(url: &str, stop: Stop, rate: Option<f64>) -> Spec {
    let mut s = Spec::get(vec![Url::parse(url).unwrap()], 3, rate, stop);
    s.h2 = true;
    s.warmup = Duration::ZERO;
    s
}

#[test]
fn h2c_against_an_http2_only_hyper_server() {
    let (addr, hits) = h2_only_server();
    let r = load::run(h2_spec(&format!("http://{addr}/"), Stop::Count(300), None)).unwrap();
    assert_eq!(r.recorder.errors.total(), 0, "{:?}", r.recorder.errors);
    assert_eq!(r.recorder.ok, 300);
    assert_eq!(hits.load(Ordering::SeqCst), 300);
    let r = load::run(h2_spec(
        &format!("http://{addr}/"),
        Stop::Duration(Duration::from_secs(1)),
        Some(100.0),
    ))
    .unwrap();
    assert!((98..=102).contains(&r.recorder.ok), "{}", r.recorder.ok);
}

#[test]
fn h1_client_fails_cleanly_against_an_http2_only_server() {
    let (addr, _) = h2_only_server();
    let mut s = h2_spec(&format!("http://{addr}/"), Stop::Count(5), None);
    s.h2 = false;
    let r = load::run(s).unwrap();
    assert_eq!(r.recorder.ok, 0);
    assert_eq!(r.recorder.errors.total(), 5);
}

#[test]
fn builtin_upstream_speaks_h1_and_h2c() {
    let addr = serve_on_thread(move |l| async move {
        let opts = tailgate_bench::upstream::Options {
            body_bytes: 110,
            close_every: Some(5),
            delay: Duration::ZERO,
        };
        tailgate_bench::upstream::serve(l, opts).await.unwrap();
    });
    let url = format!("http://{addr}/");
    let r = load::run(h2_spec(&url, Stop::Count(100), None)).unwrap();
    assert_eq!(r.recorder.ok, 100, "{:?}", r.recorder.errors);
    let mut s = h2_spec(&url, Stop::Count(100), None);
    s.h2 = false;
    let r = load::run(s).unwrap();
    assert_eq!(r.recorder.ok, 100, "{:?}", r.recorder.errors);
    // close_every 5 on HTTP/1.1: indices 1..=5 only.
    assert_eq!(r.recorder.by_index.len(), 5);
}
