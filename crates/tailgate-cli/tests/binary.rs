//! The `tailgate` binary as a user runs it: `check` errors, the example config end to end,
//! SIGTERM drain, and the JSON access log.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_tailgate");

/// A fresh directory, removed when the returned guard is dropped (also when a test panics).
fn tmpdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("tailgate-cli-")
        .tempdir()
        .unwrap()
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn check(text: &str) -> (bool, String) {
    let dir = tmpdir();
    let path = dir.path().join("gw.toml");
    std::fs::write(&path, text).unwrap();
    let out = Command::new(BIN)
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

const BASE: &str = "[[listener]]\naddress = \"127.0.0.1:8080\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"127.0.0.1:9000\"]\n";

/// `--version` names the commit built (where the source is a git checkout), so that a
/// benchmark report says which code it measured.
#[test]
fn the_version_names_the_commit_built() {
    let out = Command::new(BIN).arg("--version").output().unwrap();
    assert!(out.status.success());
    let version = String::from_utf8_lossy(&out.stdout).into_owned();
    let head = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
    match head {
        // (Built from this checkout's HEAD: the build script runs again at each commit.)
        Some(head) => assert!(
            version.starts_with(&format!("tailgate {} ({head}", env!("CARGO_PKG_VERSION"))),
            "{version:?}, HEAD {head}"
        ),
        None => assert!(version.contains("(unknown commit"), "{version:?}"),
    }
}

/// `scripts/pgo.sh` refuses an optimized build whose `--version` does not say it is
/// profile-guided: its check must match what such a build prints (it stopped matching once
/// the commit was added to the version, and the README's benchmark run failed on it).
#[test]
fn the_pgo_scripts_check_matches_a_profile_guided_version() {
    let out = Command::new(BIN).arg("--version").output().unwrap();
    let plain = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    // As `main.rs` prints it for a build with a profile: its mark before the last `)`.
    let guided = format!(
        "{}, profile-guided build)",
        plain.strip_suffix(')').expect("ends with )")
    );
    let script =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/pgo.sh"))
            .unwrap();
    let mut lines = script.lines();
    lines
        .find(|l| l.trim() == "case $version in")
        .expect("the script's check");
    let pattern = lines.next().expect("its pattern").trim();
    let matches = |version: &str| {
        Command::new("bash")
            .args([
                "-c",
                &format!("case \"$1\" in {pattern} *) exit 1 ;; esac"),
                "pgo",
                version,
            ])
            .status()
            .unwrap()
            .success()
    };
    assert!(matches(&guided), "{pattern} does not match {guided:?}");
    assert!(!matches(&plain), "{pattern} matches {plain:?}");
}

#[test]
fn check_accepts_the_example_config() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/tailgate.toml");
    let out = Command::new(BIN)
        .args(["check", "--config"])
        .arg(&example)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("ok"));
}

#[test]
fn check_reports_unknown_fields_with_line_and_column() {
    let (ok, out) = check(&format!(
        "{BASE}[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\ntimeout = \"5s\"\n"
    ));
    assert!(!ok);
    // The field named is the unknown one, not the key of the line above it.
    assert!(
        out.contains("gw.toml:9:1: timeout: unknown field `timeout`"),
        "{out}"
    );
    assert!(
        out.contains("response_timeout"),
        "lists what to write instead: {out}"
    );
}

/// A config that is not UTF-8 text: where its first such byte is, and what to do.
#[test]
fn check_points_at_a_byte_that_is_not_utf8() {
    let dir = tmpdir();
    let path = dir.path().join("gw.toml");
    std::fs::write(&path, b"[server]\nworkers = \xff\n").unwrap();
    let out = Command::new(BIN)
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        err.contains("gw.toml:2:11: this byte is not UTF-8 text"),
        "{err}"
    );
    assert!(err.contains("help: save the file as UTF-8"), "{err}");
}

#[test]
fn check_reports_a_route_to_a_missing_cluster() {
    let (ok, out) = check(&format!(
        "{BASE}[[route]]\npath_prefix = \"/\"\ncluster = \"nope\"\n"
    ));
    assert!(!ok);
    assert!(out.contains("gw.toml:8:11"), "{out}");
    assert!(out.contains("route[0].cluster"), "{out}");
    assert!(
        out.contains("no cluster named `nope`") && out.contains("`up`"),
        "{out}"
    );
}

#[test]
fn check_reports_duplicate_routes() {
    let (ok, out) = check(&format!(
        "{BASE}[[route]]\npath_prefix = \"/a\"\ncluster = \"up\"\n[[route]]\npath_prefix = \"/a\"\ncluster = \"up\"\n"
    ));
    assert!(!ok);
    assert!(out.contains("gw.toml:10:15"), "{out}");
    assert!(
        out.contains("duplicate route") && out.contains("line 7"),
        "{out}"
    );
}

#[test]
fn check_reports_bad_addresses_and_every_error() {
    let (ok, out) = check(
        "[[listener]]\naddress = \"localhost:80\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"127.0.0.1\", \"[::1]:9000\"]\n[server]\nidle_timeout = \"soon\"\n",
    );
    assert!(!ok);
    assert!(
        out.contains("gw.toml:2:11") && out.contains("listener[0].address"),
        "{out}"
    );
    assert!(
        out.contains("gw.toml:5:14") && out.contains("cluster[0].endpoints[0]"),
        "{out}"
    );
    assert!(
        out.contains("gw.toml:7:16") && out.contains("server.idle_timeout"),
        "{out}"
    );
    assert!(out.contains("help:"), "{out}");
}

#[test]
fn check_reports_syntax_errors() {
    let (ok, out) = check("[[listener]\naddress = 1\n");
    assert!(!ok);
    assert!(out.contains("gw.toml:1:"), "{out}");
}

/// Kills the child on drop so a failing test leaves nothing running.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `tailgate serve --config CONFIG`, its standard error going to `stderr`.
fn serve(config: impl AsRef<Path>, stderr: Stdio) -> Proc {
    serve_command(Command::new(BIN), config, stderr)
}

/// [`serve`] under `prlimit --nofile=LIMITS` (`SOFT:HARD`).
fn serve_with_open_files(limits: &str, config: impl AsRef<Path>, stderr: Stdio) -> Proc {
    let mut prlimit = Command::new("prlimit");
    prlimit.arg(format!("--nofile={limits}")).arg(BIN);
    serve_command(prlimit, config, stderr)
}

fn serve_command(mut command: Command, config: impl AsRef<Path>, stderr: Stdio) -> Proc {
    Proc(
        command
            .args(["serve", "--config"])
            .arg(config.as_ref())
            .env_remove("RUST_LOG")
            .stderr(stderr)
            .spawn()
            .unwrap(),
    )
}

fn wait_listening(addr: SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(addr).is_err() {
        assert!(Instant::now() < deadline, "nothing listens on {addr}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn http_get(addr: SocketAddr, path: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

/// The README's first command: the example config runs on its own and answers through
/// the gateway (ports moved to free ones).
#[test]
fn example_config_serves_through_the_demo_upstream() {
    let (gw_port, demo_port, admin_port) = (free_port(), free_port(), free_port());
    let example = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/tailgate.toml"),
    )
    .unwrap();
    let text = example
        .replace("127.0.0.1:8080", &format!("127.0.0.1:{gw_port}"))
        .replace("127.0.0.1:8081", &format!("127.0.0.1:{demo_port}"))
        .replace("127.0.0.1:9901", &format!("127.0.0.1:{admin_port}"));
    let dir = tmpdir();
    std::fs::write(dir.path().join("gw.toml"), text).unwrap();
    let _p = serve(dir.path().join("gw.toml"), Stdio::null());
    let addr: SocketAddr = format!("127.0.0.1:{gw_port}").parse().unwrap();
    let admin: SocketAddr = format!("127.0.0.1:{admin_port}").parse().unwrap();
    // The gateway, the demo upstream and the admin plane each open their listener on a
    // thread of their own: all three are waited for.
    for port in [gw_port, demo_port, admin_port] {
        wait_listening(format!("127.0.0.1:{port}").parse().unwrap());
    }
    let resp = http_get(addr, "/hello");
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.contains("tailgate demo upstream"), "{resp}");
    assert!(resp.contains("\"x-forwarded-for\":\"127.0.0.1\""), "{resp}");
    let metrics = http_get(admin, "/metrics");
    assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
    assert!(
        metrics.contains("tailgate_requests_total{tenant=\"demo\",route=\"route0\",method=\"GET\",status_class=\"2xx\"} 1"),
        "{metrics}"
    );
}

/// A slow upstream on its own thread: answers after `delay`.
fn slow_upstream(delay: Duration) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                let mut head = Vec::new();
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                std::thread::sleep(delay);
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\ndone");
            });
        }
    });
    addr
}

fn serve_config(dir: &Path, port: u16, upstream: SocketAddr, log: &str) -> PathBuf {
    let path = dir.join("gw.toml");
    std::fs::write(
        &path,
        format!(
            "[server]\nworkers = 1\nshutdown_grace = \"10s\"\n{log}\n[[listener]]\naddress = \"127.0.0.1:{port}\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"{upstream}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
        ),
    )
    .unwrap();
    path
}

/// A gateway (one worker, `shutdown_grace` 10 s) in front of an upstream that answers after
/// `delay`, with a request to it in flight: the process, its pid, and the request's answer
/// to come.
fn gateway_with_a_request_in_flight(
    dir: &Path,
    delay: Duration,
    log: &str,
) -> (Proc, String, std::thread::JoinHandle<String>) {
    let up = slow_upstream(delay);
    let port = free_port();
    let cfg = serve_config(dir, port, up, log);
    let p = serve(&cfg, Stdio::null());
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    wait_listening(addr);
    let req = std::thread::spawn(move || http_get(addr, "/slow"));
    std::thread::sleep(Duration::from_millis(400));
    let pid = p.0.id().to_string();
    (p, pid, req)
}

fn kill(sig: &str, pid: &str) {
    assert!(
        Command::new("kill")
            .args([sig, pid])
            .status()
            .unwrap()
            .success()
    );
}

/// The process's exit status, which must come `within`.
fn exit_within(p: &mut Proc, within: Duration, what: &str) -> std::process::ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(s) = p.0.try_wait().unwrap() {
            return s;
        }
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// SIGINT during the drain stops the gateway at once (exit 1), without waiting
/// `shutdown_grace` for a request that is still in flight; another SIGTERM does not (a
/// service manager sends one after its own stop command's).
#[test]
fn sigint_during_the_drain_stops_it() {
    let dir = tmpdir();
    let (mut p, pid, _req) =
        gateway_with_a_request_in_flight(dir.path(), Duration::from_secs(20), "");
    kill("-TERM", &pid);
    std::thread::sleep(Duration::from_millis(300));
    kill("-TERM", &pid);
    std::thread::sleep(Duration::from_millis(300));
    assert!(p.0.try_wait().unwrap().is_none(), "still draining");
    kill("-INT", &pid);
    let status = exit_within(
        &mut p,
        Duration::from_secs(5),
        "the second signal did not stop the drain",
    );
    assert_eq!(status.code(), Some(1), "{status:?}");
}

/// A terminal's SIGINT and a wrapper's SIGTERM arriving together start one drain, in
/// either order, and with a SIGINT up to 250 ms after the SIGTERM: the second is not taken
/// for a request to stop at once. (A SIGINT after a SIGTERM is the order that tells: a
/// SIGINT during a drain stops it, where a SIGTERM is ignored. The later one used to be
/// taken with the first only when it had reached the process by then: the SIGINT
/// microseconds after a SIGTERM was not, and cut the request in flight.)
#[test]
fn signals_that_come_together_drain_once() {
    for order in [
        "kill -INT \"$0\"; kill -TERM \"$0\"",
        "kill -TERM \"$0\"; kill -INT \"$0\"",
        "kill -TERM \"$0\"; sleep 0.1; kill -INT \"$0\"",
    ] {
        signals_together_drain_once(order);
    }
}

fn signals_together_drain_once(order: &str) {
    let dir = tmpdir();
    let (mut p, pid, req) =
        gateway_with_a_request_in_flight(dir.path(), Duration::from_millis(1500), "");
    assert!(
        Command::new("sh")
            .args(["-c", order, &pid])
            .status()
            .unwrap()
            .success()
    );
    let resp = req.join().unwrap();
    assert!(
        resp.ends_with("done"),
        "{order}: the in-flight request completes: {resp}"
    );
    let status = exit_within(
        &mut p,
        Duration::from_secs(15),
        "did not exit after the drain",
    );
    assert!(status.success(), "{order}: exit status {status:?}");
}

#[test]
fn sigterm_drains_in_flight_requests_and_exits_zero() {
    let dir = tmpdir();
    let (mut p, pid, req) = gateway_with_a_request_in_flight(
        dir.path(),
        Duration::from_millis(1500),
        "[log]\nlevel = \"info\"\n",
    );
    kill("-TERM", &pid);
    let resp = req.join().unwrap();
    assert!(
        resp.starts_with("HTTP/1.1 200"),
        "the in-flight request completes: {resp}"
    );
    assert!(resp.ends_with("done"), "{resp}");
    let status = exit_within(
        &mut p,
        Duration::from_secs(15),
        "gateway did not exit after the drain",
    );
    assert!(status.success(), "exit status {status:?}");
}

/// When `shutdown_grace` runs out with a request still in flight, the gateway cuts it and
/// exits 0 (a drain that ended on time), without waiting for the request.
#[test]
fn a_drain_whose_grace_runs_out_exits_zero() {
    let dir = tmpdir();
    let up = slow_upstream(Duration::from_secs(20));
    let port = free_port();
    let cfg = dir.path().join("gw.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nworkers = 1\nshutdown_grace = \"1s\"\n[[listener]]\naddress = \"127.0.0.1:{port}\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
        ),
    )
    .unwrap();
    let mut p = serve(&cfg, Stdio::null());
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    wait_listening(addr);
    let req = std::thread::spawn(move || http_get(addr, "/slow"));
    std::thread::sleep(Duration::from_millis(400));
    kill("-TERM", &p.0.id().to_string());
    let status = exit_within(
        &mut p,
        Duration::from_secs(6),
        "did not exit when the grace ran out",
    );
    assert!(status.success(), "exit status {status:?}");
    let resp = req.join().unwrap();
    assert!(!resp.ends_with("done"), "the request was cut: {resp}");
}

/// SIGHUP, which an nginx operator sends to reload, neither ends the gateway (its default
/// action) nor drops anything: the gateway logs that it ignored it and keeps serving; so do
/// SIGUSR1 (logrotate's, to reopen logs) and SIGUSR2. A SIGQUIT after them (nginx's graceful
/// stop, whose default action dumps core) drains and exits 0, as SIGTERM does.
#[test]
fn sighup_and_sigusr_are_logged_and_ignored_and_sigquit_drains() {
    let dir = tmpdir();
    let up = slow_upstream(Duration::ZERO);
    let port = free_port();
    let cfg = serve_config(dir.path(), port, up, "[log]\nlevel = \"info\"\n");
    let log = std::fs::File::create(dir.path().join("stderr.log")).unwrap();
    let mut p = serve(&cfg, Stdio::from(log));
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    wait_listening(addr);
    let pid = p.0.id().to_string();
    for (sig, said) in [
        ("-HUP", "SIGHUP ignored"),
        ("-USR1", "SIGUSR1 ignored"),
        ("-USR2", "SIGUSR2 ignored"),
    ] {
        kill(sig, &pid);
        // Each taken (its line logged) before the next is sent: two pending at once are
        // taken in either order.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !std::fs::read_to_string(dir.path().join("stderr.log"))
            .unwrap()
            .contains(said)
        {
            assert!(Instant::now() < deadline, "{sig} not logged");
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(p.0.try_wait().unwrap().is_none(), "{sig} ended the gateway");
        let resp = http_get(addr, "/after-signal");
        assert!(resp.starts_with("HTTP/1.1 200"), "{sig}: {resp}");
    }
    kill("-QUIT", &pid);
    let status = exit_within(&mut p, Duration::from_secs(15), "no exit after SIGQUIT");
    assert!(status.success(), "exit status {status:?}");
    let text = std::fs::read_to_string(dir.path().join("stderr.log")).unwrap();
    for said in ["SIGHUP ignored", "SIGUSR1 ignored", "SIGUSR2 ignored"] {
        assert!(text.contains(said), "{said}: {text}");
    }
}

/// With `shutdown_delay`, a SIGTERM makes `/readyz` say draining at once while the listener
/// goes on accepting and serving new connections (a load balancer still sending to it
/// meanwhile gets answers, not refusals); the drain follows, and the process exits 0.
#[test]
fn shutdown_delay_serves_new_connections_while_readyz_says_draining() {
    let dir = tmpdir();
    let up = slow_upstream(Duration::ZERO);
    let (port, admin_port) = (free_port(), free_port());
    let cfg = dir.path().join("gw.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nworkers = 1\nshutdown_delay = \"4s\"\n[admin]\naddress = \"127.0.0.1:{admin_port}\"\n[[listener]]\naddress = \"127.0.0.1:{port}\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
        ),
    )
    .unwrap();
    let mut p = serve(&cfg, Stdio::null());
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let admin: SocketAddr = format!("127.0.0.1:{admin_port}").parse().unwrap();
    wait_listening(addr);
    wait_listening(admin);
    let ready = http_get(admin, "/readyz");
    assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");
    let stopped_at = Instant::now();
    kill("-TERM", &p.0.id().to_string());
    let deadline = Instant::now() + Duration::from_secs(3);
    let ready = loop {
        let ready = http_get(admin, "/readyz");
        if ready.starts_with("HTTP/1.1 503") || Instant::now() > deadline {
            break ready;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(ready.starts_with("HTTP/1.1 503"), "{ready}");
    assert!(ready.contains("draining"), "{ready}");
    // New connections are still taken and served during the delay.
    let resp = http_get(addr, "/during-the-delay");
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    let status = exit_within(
        &mut p,
        Duration::from_secs(20),
        "no exit after the delay and the drain",
    );
    assert!(status.success(), "exit status {status:?}");
    assert!(
        stopped_at.elapsed() >= Duration::from_secs(4),
        "exited before shutdown_delay was over"
    );
}

/// A gateway whose readiness was probed and never said ready (a cluster still cold within
/// `warm_wait`) is in no probing load balancer's rotation: a SIGTERM drains it at once,
/// without `shutdown_delay`, and says why.
#[test]
fn shutdown_delay_is_skipped_when_readyz_never_said_ready() {
    let dir = tmpdir();
    let up = slow_upstream(Duration::ZERO);
    let (port, admin_port, dead) = (free_port(), free_port(), free_port());
    let cfg = dir.path().join("gw.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nworkers = 1\nshutdown_delay = \"60s\"\nwarm_wait = \"60s\"\n[admin]\naddress = \"127.0.0.1:{admin_port}\"\n[[listener]]\naddress = \"127.0.0.1:{port}\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[cluster]]\nname = \"cold\"\nendpoints = [\"127.0.0.1:{dead}\"]\nmin_warm_connections = 1\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n[[route]]\npath_prefix = \"/cold\"\ncluster = \"cold\"\n"
        ),
    )
    .unwrap();
    let mut p = serve(&cfg, Stdio::piped());
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let admin: SocketAddr = format!("127.0.0.1:{admin_port}").parse().unwrap();
    wait_listening(addr);
    wait_listening(admin);
    let ready = http_get(admin, "/readyz");
    assert!(ready.starts_with("HTTP/1.1 503"), "{ready}");
    assert!(ready.contains("cold"), "{ready}");
    let resp = http_get(addr, "/served");
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    kill("-TERM", &p.0.id().to_string());
    let status = exit_within(
        &mut p,
        Duration::from_secs(20),
        "shutdown_delay was waited out though the gateway was never ready",
    );
    assert!(status.success(), "exit status {status:?}");
    let mut text = String::new();
    std::io::Read::read_to_string(&mut p.0.stderr.take().unwrap(), &mut text).unwrap();
    assert!(
        text.contains("stopping before /readyz ever said ready"),
        "{text}"
    );
}

/// A TLS record holding a ClientHello whose SNI extension names `name` (no handshake can
/// follow: the test only needs it read).
fn client_hello(name: &[u8]) -> Vec<u8> {
    let len16 = |n: usize| u16::try_from(n).unwrap().to_be_bytes();
    let mut sni = vec![0];
    sni.extend(len16(name.len()));
    sni.extend(name);
    let mut ext = vec![0, 0];
    ext.extend(len16(sni.len() + 2));
    ext.extend(len16(sni.len()));
    ext.extend(sni);
    let mut hello = vec![3, 3];
    hello.extend([7u8; 32]);
    hello.extend([0, 0, 2, 0x13, 0x01, 1, 0]);
    hello.extend(len16(ext.len()));
    hello.extend(ext);
    let mut hs = vec![1, 0];
    hs.extend(len16(hello.len()));
    hs.extend(hello);
    let mut record = vec![0x16, 3, 1];
    record.extend(len16(hs.len()));
    record.extend(hs);
    record
}

/// A client's hello is not the log's to quote: a ClientHello naming an SNI host name
/// rustls refuses (a long one, of bytes no name holds) makes no log line of rustls's at
/// the default level, where rustls warned with the whole name quoted, for every hello.
#[test]
fn a_clients_hello_writes_no_rustls_warning_into_the_log() {
    let dir = tmpdir();
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    std::fs::write(dir.path().join("cert.pem"), ck.cert.pem()).unwrap();
    std::fs::write(dir.path().join("key.pem"), ck.signing_key.serialize_pem()).unwrap();
    let up = slow_upstream(Duration::ZERO);
    let port = free_port();
    let cfg = dir.path().join("gw.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nworkers = 1\n[[listener]]\naddress = \"127.0.0.1:{port}\"\n[listener.tls]\ncert = \"{}\"\nkey = \"{}\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"{up}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n",
            dir.path().join("cert.pem").display(),
            dir.path().join("key.pem").display(),
        ),
    )
    .unwrap();
    let mut p = serve(&cfg, Stdio::piped());
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    wait_listening(addr);
    let name = [b"bad!name_".repeat(100), b"\x01".repeat(100)].concat();
    for _ in 0..3 {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(&client_hello(&name)).unwrap();
        // The gateway's answer (an alert) or its close: the hello was read.
        let mut buf = [0u8; 64];
        let _ = std::io::Read::read(&mut s, &mut buf);
    }
    kill("-TERM", &p.0.id().to_string());
    let status = exit_within(&mut p, Duration::from_secs(15), "no exit after SIGTERM");
    assert!(status.success(), "exit status {status:?}");
    let mut text = String::new();
    std::io::Read::read_to_string(&mut p.0.stderr.take().unwrap(), &mut text).unwrap();
    assert!(
        !text.contains("bad!name"),
        "the hello's name was logged: {text}"
    );
    assert!(!text.contains(" rustls::"), "a line of rustls's: {text}");
}

/// A second gateway started on the addresses of a running one shares them (SO_REUSEPORT,
/// for a restart that starts the new process before it stops the old one), and says so:
/// a forgotten old instance taking part of the traffic is not left unseen.
#[test]
fn a_second_gateway_on_the_same_address_warns_that_it_shares_it() {
    let dir = tmpdir();
    let up = slow_upstream(Duration::ZERO);
    let port = free_port();
    // The admin listener and a built-in demo upstream too are shared, not a reason for the
    // second gateway to stop.
    let (admin_port, demo_port) = (free_port(), free_port());
    let cfg = serve_config(
        dir.path(),
        port,
        up,
        &format!(
            "[admin]\naddress = \"127.0.0.1:{admin_port}\"\n[[demo]]\naddress = \"127.0.0.1:{demo_port}\"\n"
        ),
    );
    let first_log = std::fs::File::create(dir.path().join("first.log")).unwrap();
    let _first = serve(&cfg, Stdio::from(first_log));
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    wait_listening(addr);
    let second_log = std::fs::File::create(dir.path().join("second.log")).unwrap();
    let second = serve(&cfg, Stdio::from(second_log));
    let pid = second.0.id().to_string();
    let deadline = Instant::now() + Duration::from_secs(10);
    let text = loop {
        let text = std::fs::read_to_string(dir.path().join("second.log")).unwrap();
        if text.contains("already listens") || Instant::now() > deadline {
            break text;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        text.contains("another process already listens on this address"),
        "{text}"
    );
    // And, where the kernel would reset the old one's pending connections when it stops,
    // what to set for a restart that refuses none.
    let migrates = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_migrate_req")
        .ok()
        .map(|v| v.trim() != "0");
    assert_eq!(
        text.contains("net.ipv4.tcp_migrate_req is 0"),
        migrates == Some(false),
        "{text}"
    );
    let first = std::fs::read_to_string(dir.path().join("first.log")).unwrap();
    assert!(!first.contains("already listens"), "{first}");
    let mut second = second;
    let ready = Instant::now() + Duration::from_secs(10);
    while !std::fs::read_to_string(dir.path().join("second.log"))
        .unwrap()
        .contains("admin listening")
        && Instant::now() < ready
    {
        assert!(
            second.0.try_wait().unwrap().is_none(),
            "the second gateway stopped: {}",
            std::fs::read_to_string(dir.path().join("second.log")).unwrap()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        std::fs::read_to_string(dir.path().join("second.log"))
            .unwrap()
            .contains("admin listening"),
        "the second gateway's admin listener started"
    );
    assert!(
        second.0.try_wait().unwrap().is_none(),
        "the second gateway stopped"
    );
    kill("-TERM", &pid);
    let status = exit_within(
        &mut second,
        Duration::from_secs(15),
        "no exit after SIGTERM",
    );
    assert!(status.success(), "exit status {status:?}");
}

/// Two gateways share a demo address (a restart on the example config: the new one started,
/// then the old one stopped): the old one's demo, stopping, finishes what it is answering
/// for the new one (its upstream connections land on either demo, SO_REUSEPORT) instead of
/// cutting it.
#[test]
fn a_stopping_gateways_demo_finishes_what_it_answers_for_the_next_one() {
    let dir = tmpdir();
    let demo_port = free_port();
    let config = |name: &str, port: u16| {
        let path = dir.path().join(name);
        std::fs::write(
            &path,
            format!(
                "[server]\nworkers = 1\n[log]\naccess_log = false\n[[demo]]\naddress = \"127.0.0.1:{demo_port}\"\n[[listener]]\naddress = \"127.0.0.1:{port}\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"127.0.0.1:{demo_port}\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
            ),
        )
        .unwrap();
        path
    };
    let (old_port, new_port) = (free_port(), free_port());
    let mut old = serve(config("old.toml", old_port), Stdio::null());
    wait_listening(format!("127.0.0.1:{old_port}").parse().unwrap());
    let _new = serve(config("new.toml", new_port), Stdio::null());
    let new: SocketAddr = format!("127.0.0.1:{new_port}").parse().unwrap();
    wait_listening(new);
    // Uploads through the new gateway that take 2 s to send, echoed by a demo: about half
    // of them by the old one's.
    let uploads: Vec<_> = (0..8)
        .map(|_| {
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(new).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
                // Chunked: a small body with a length would be read whole before the
                // request goes upstream.
                write!(
                    s,
                    "POST /up HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                )
                .unwrap();
                for b in b"0123456789" {
                    std::thread::sleep(Duration::from_millis(200));
                    s.write_all(&[b'1', b'\r', b'\n', *b, b'\r', b'\n'])
                        .unwrap();
                }
                s.write_all(b"0\r\n\r\n").unwrap();
                let mut out = String::new();
                let _ = s.read_to_string(&mut out);
                out
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(700));
    kill("-TERM", &old.0.id().to_string());
    for u in uploads {
        let out = u.join().unwrap();
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        // The echo, chunk by chunk.
        let body = out.split("\r\n\r\n").nth(1).unwrap_or("");
        let echoed: String = body.split("\r\n").skip(1).step_by(2).collect();
        assert_eq!(echoed, "0123456789", "{out}");
    }
    let status = exit_within(
        &mut old,
        Duration::from_secs(15),
        "the old one did not stop",
    );
    assert!(status.success(), "{status:?}");
}

/// An address held by a socket that does not share it (another program's, without
/// SO_REUSEPORT): the start fails saying it cannot listen there, exit 1, and says nothing of
/// sharing it (that warning is for a gateway that binds beside another one).
#[test]
fn an_address_another_program_holds_stops_the_start_without_talk_of_sharing() {
    let dir = tmpdir();
    let up = slow_upstream(Duration::ZERO);
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port();
    // Its log, once it has exited 1.
    let refused = |cfg: PathBuf| {
        let log = std::fs::File::create(dir.path().join("gw.log")).unwrap();
        let mut p = serve(&cfg, Stdio::from(log));
        let status = exit_within(&mut p, Duration::from_secs(15), "no exit");
        assert_eq!(status.code(), Some(1));
        std::fs::read_to_string(dir.path().join("gw.log")).unwrap()
    };
    let text = refused(serve_config(dir.path(), port, up, ""));
    assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
    assert!(text.contains("in use"), "{text}");
    assert!(!text.contains("shared with it"), "{text}");
    // The same for the admin address.
    let text = refused(serve_config(
        dir.path(),
        free_port(),
        up,
        &format!("[admin]\naddress = \"127.0.0.1:{port}\"\n"),
    ));
    assert!(text.contains("in use"), "{text}");
    assert!(!text.contains("shared with it"), "{text}");
    drop(held);
}

/// The soft limit on open files is raised to the hard one at start (1024 would refuse
/// connections long before a service's hard limit).
#[test]
fn the_open_files_limit_is_raised_to_the_hard_limit() {
    let dir = tmpdir();
    let up = slow_upstream(Duration::ZERO);
    let port = free_port();
    let cfg = serve_config(dir.path(), port, up, "");
    // This process's hard limit (a child may not be given more), the soft one far below it.
    let own = std::fs::read_to_string("/proc/self/limits").unwrap();
    let hard: u64 = own
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(4))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!(hard > 256, "a hard limit on open files above 256: {own}");
    let mut p = serve_with_open_files(&format!("256:{hard}"), &cfg, Stdio::null());
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    wait_listening(addr);
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", p.0.id())).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let numbers: Vec<&str> = line.split_whitespace().skip(3).take(2).collect();
    let hard = hard.to_string();
    assert_eq!(numbers, [hard.as_str(), hard.as_str()], "{line}");
    kill("-TERM", &p.0.id().to_string());
    exit_within(&mut p, Duration::from_secs(15), "no exit after SIGTERM");
}

/// Without `max_connections` in the config, `serve` caps the client connections at half of
/// what the open files limit leaves (here (300 − 100) ÷ 2 = 100): past it, new connections
/// wait in the listen queue and the pause is counted, rather than taking the descriptors
/// the upstream connects need.
#[test]
fn max_connections_defaults_to_half_the_open_files_left() {
    let dir = tmpdir();
    let up = slow_upstream(Duration::ZERO);
    let (port, admin_port) = (free_port(), free_port());
    let cfg = serve_config(
        dir.path(),
        port,
        up,
        &format!("[admin]\naddress = \"127.0.0.1:{admin_port}\"\n[log]\nlevel = \"info\"\n"),
    );
    let log = std::fs::File::create(dir.path().join("stderr.log")).unwrap();
    let mut p = serve_with_open_files("300:300", &cfg, Stdio::from(log));
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let admin: SocketAddr = format!("127.0.0.1:{admin_port}").parse().unwrap();
    wait_listening(addr);
    wait_listening(admin);
    let held: Vec<TcpStream> = (0..130)
        .map(|_| TcpStream::connect(addr).unwrap())
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let metrics = http_get(admin, "/metrics");
        let paused = metrics
            .lines()
            .find(|l| l.starts_with("tailgate_downstream_accept_pauses_total"))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0);
        if paused >= 1.0 {
            break;
        }
        assert!(Instant::now() < deadline, "no pause at the cap: {metrics}");
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(held);
    assert!(http_get(addr, "/after").starts_with("HTTP/1.1 200"));
    kill("-TERM", &p.0.id().to_string());
    exit_within(&mut p, Duration::from_secs(15), "no exit after SIGTERM");
    let text = std::fs::read_to_string(dir.path().join("stderr.log")).unwrap();
    assert!(text.contains("max_connections=100"), "{text}");
}

/// Each thread of process `pid`: its name, nice value and scheduling policy (fields 19 and
/// 41 of `/proc/PID/task/TID/stat`; policy 0 is `SCHED_OTHER`, 5 `SCHED_IDLE`). A thread
/// that ends while it is read is left out.
fn thread_priorities(pid: u32) -> Vec<(String, i64, u32)> {
    let mut out = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let dir = t.unwrap().path();
        let (Ok(comm), Ok(stat)) = (
            std::fs::read_to_string(dir.join("comm")),
            std::fs::read_to_string(dir.join("stat")),
        ) else {
            continue;
        };
        // The name in brackets may hold spaces; the fields after it start at field 3.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .unwrap()
            .1
            .split_whitespace()
            .collect();
        out.push((
            comm.trim().to_owned(),
            fields[19 - 3].parse().unwrap(),
            fields[41 - 3].parse().unwrap(),
        ));
    }
    out
}

/// Scrapes render on a thread under `SCHED_IDLE`, so a large one never takes the core from
/// a worker that has a request to serve; the admin thread (health, readiness) runs at nice
/// 10, so a saturated machine still answers its probes; the workers keep the normal
/// policy and nice 0.
#[test]
fn scrapes_yield_the_core_to_the_workers() {
    let up = slow_upstream(Duration::from_millis(0));
    let (port, admin_port) = (free_port(), free_port());
    let dir = tmpdir();
    let cfg = serve_config(
        dir.path(),
        port,
        up,
        &format!("[admin]\naddress = \"127.0.0.1:{admin_port}\"\n"),
    );
    let p = serve(&cfg, Stdio::null());
    let admin: SocketAddr = format!("127.0.0.1:{admin_port}").parse().unwrap();
    wait_listening(admin);
    // Rendered by the scrape thread and answered by the admin thread: both have set their
    // priority by now.
    let metrics = http_get(admin, "/metrics");
    assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
    assert!(
        metrics.contains("# TYPE tailgate_requests_total counter"),
        "{metrics}"
    );
    let threads = thread_priorities(p.0.id());
    let of = |name: &str| -> Vec<(i64, u32)> {
        threads
            .iter()
            .filter(|(n, _, _)| n == name)
            .map(|(_, nice, policy)| (*nice, *policy))
            .collect()
    };
    // The process's own nice value (a test run under `nice` starts it niced): the workers
    // keep it; the admin thread asks for nice 10, which a process niced beyond it cannot
    // get back to without privilege.
    let base = of("tailgate")[0].0;
    assert_eq!(of("tailgate-scrape").len(), 1, "{threads:?}");
    assert_eq!(of("tailgate-scrape")[0].1, 5, "{threads:?}");
    let admin = of("tailgate-admin");
    assert_eq!(admin.len(), 1, "{threads:?}");
    assert_eq!(admin[0].1, 0, "{threads:?}");
    assert!(
        admin[0].0 == 10 || (base > 10 && admin[0].0 == base),
        "{threads:?}"
    );
    assert_eq!(of("tailgate-worker"), [(base, 0)], "{threads:?}");
}

#[test]
fn json_access_log_has_stage_timings() {
    let up = slow_upstream(Duration::from_millis(200));
    let port = free_port();
    let dir = tmpdir();
    let cfg = serve_config(
        dir.path(),
        port,
        up,
        // `warn`: the access log is asked for on its own and is written at any level.
        "[log]\nlevel = \"warn\"\nformat = \"json\"\naccess_log = true\n",
    );
    let mut p = serve(&cfg, Stdio::piped());
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    wait_listening(addr);
    let resp = http_get(addr, "/logged?q=1");
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    let first = resp.clone();
    // A long path is logged cut (a log line waits in the queue as a copy).
    let long = format!("/{}", "p".repeat(3000));
    let resp = http_get(addr, &long);
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    let stderr = p.0.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { return };
            if line.contains("tailgate::access") && tx.send(line).is_err() {
                return;
            }
        }
    });
    let line = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("an access log line");
    let cut = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the long path's access log line");
    let c: serde_json::Value =
        serde_json::from_str(&cut).unwrap_or_else(|e| panic!("not JSON ({e}): {cut}"));
    assert_eq!(c["http.path"], format!("{}…", &long[..1024]));
    let v: serde_json::Value =
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
    assert_eq!(v["http.path"], "/logged");
    assert_eq!(v["http.status"], 200);
    assert_eq!(v["http.method"], "GET");
    assert_eq!(
        v["route.name"], "route0",
        "routes are logged by name: {line}"
    );
    for k in [
        "time.route_us",
        "time.upstream_connect_us",
        "time.ttfb_us",
        "time.total_us",
        "request.id",
    ] {
        assert!(v.get(k).is_some(), "missing {k}: {line}");
    }
    assert!(v["time.total_us"].as_u64().unwrap() >= v["time.ttfb_us"].as_u64().unwrap());
    // The stages hold what they name: the upstream's 200 ms before its answer in the time
    // to first byte, the first request's connect (nothing kept warm) in its connect stage,
    // and the request id the client got.
    assert!(v["time.ttfb_us"].as_u64().unwrap() >= 200_000, "{line}");
    assert!(
        v["time.upstream_connect_us"].as_u64().unwrap() > 0,
        "{line}"
    );
    assert_eq!(v["upstream.reused"], false, "{line}");
    let id = first
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("x-request-id: ")
                .map(str::to_owned)
        })
        .expect("a request id");
    assert_eq!(v["request.id"], id.trim(), "{line}");
}

#[test]
fn watchdog_outside_systemd_is_a_clear_error() {
    let up = slow_upstream(Duration::from_millis(0));
    let dir = tmpdir();
    let cfg = serve_config(dir.path(), free_port(), up, "");
    let out = Command::new(BIN)
        .args(["serve", "--watchdog", "--config"])
        .arg(&cfg)
        .env_remove("NOTIFY_SOCKET")
        .env_remove("WATCHDOG_USEC")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--watchdog needs NOTIFY_SOCKET"), "{err}");
    // A value systemd never sets (empty, relative, a bare `@`): the same clear exit, not a
    // gateway whose every notification fails.
    for bad in ["", "notify.sock", "@"] {
        let out = Command::new(BIN)
            .args(["serve", "--watchdog", "--config"])
            .arg(&cfg)
            .env("NOTIFY_SOCKET", bad)
            .env_remove("WATCHDOG_USEC")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "NOTIFY_SOCKET={bad:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("is no socket address"), "{bad:?}: {err}");
    }
}

/// Under systemd (`Type=notify`, `WatchdogSec=`): READY=1, WATCHDOG=1 at half the
/// interval, STOPPING=1 at SIGTERM; the admin listener answers /healthz meanwhile.
#[test]
fn watchdog_notifies_systemd() {
    use std::os::unix::net::UnixDatagram;
    let up = slow_upstream(Duration::from_millis(0));
    let dir = tmpdir();
    let (port, admin_port) = (free_port(), free_port());
    let cfg = serve_config(
        dir.path(),
        port,
        up,
        &format!("[admin]\naddress = \"127.0.0.1:{admin_port}\"\n"),
    );
    let sock_path = dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&sock_path).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut p = Proc(
        Command::new(BIN)
            .args(["serve", "--watchdog", "--config"])
            .arg(&cfg)
            .env("NOTIFY_SOCKET", &sock_path)
            .env("WATCHDOG_USEC", "200000")
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let recv = || {
        let mut buf = [0u8; 128];
        let n = sock.recv(&mut buf).expect("a notification");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    assert_eq!(recv(), "READY=1");
    assert_eq!(recv(), "WATCHDOG=1");
    assert_eq!(recv(), "WATCHDOG=1");
    let admin: SocketAddr = format!("127.0.0.1:{admin_port}").parse().unwrap();
    assert!(http_get(admin, "/healthz").starts_with("HTTP/1.1 200"));
    kill("-TERM", &p.0.id().to_string());
    while recv() != "STOPPING=1" {}
    exit_within(&mut p, Duration::from_secs(15), "did not exit");
}

/// READY=1 comes as soon as the gateway is ready, not at the next watchdog ping: here the
/// warm connections open about 1.5 s after the start (the upstream comes up 1 s late), and
/// the pings are 10 s apart.
#[test]
fn ready_is_sent_when_ready_not_at_the_next_ping() {
    use std::os::unix::net::UnixDatagram;
    let dir = tmpdir();
    let (port, up_port) = (free_port(), free_port());
    let cfg = dir.path().join("gw.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nworkers = 1\n[[listener]]\naddress = \"127.0.0.1:{port}\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"127.0.0.1:{up_port}\"]\nmin_warm_connections = 1\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
        ),
    )
    .unwrap();
    let sock_path = dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&sock_path).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(6))).unwrap();
    let started = Instant::now();
    let _p = Proc(
        Command::new(BIN)
            .args(["serve", "--watchdog", "--config"])
            .arg(&cfg)
            .env("NOTIFY_SOCKET", &sock_path)
            .env("WATCHDOG_USEC", "20000000")
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    std::thread::sleep(Duration::from_secs(1));
    let _up = TcpListener::bind(("127.0.0.1", up_port)).unwrap();
    let mut buf = [0u8; 128];
    loop {
        let n = sock.recv(&mut buf).expect("READY=1 within 6 s");
        if &buf[..n] == b"READY=1" {
            break;
        }
    }
    assert!(started.elapsed() < Duration::from_secs(7));
}

/// `Type=notify` without `WatchdogSec=`: readiness and stopping, no pings.
#[test]
fn notify_without_a_watchdog_sends_ready_and_no_pings() {
    use std::os::unix::net::UnixDatagram;
    let up = slow_upstream(Duration::from_millis(0));
    let dir = tmpdir();
    let cfg = serve_config(dir.path(), free_port(), up, "");
    let sock_path = dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&sock_path).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let p = Proc(
        Command::new(BIN)
            .args(["serve", "--watchdog", "--config"])
            .arg(&cfg)
            .env("NOTIFY_SOCKET", &sock_path)
            .env_remove("WATCHDOG_USEC")
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut buf = [0u8; 128];
    let n = sock.recv(&mut buf).expect("READY=1");
    assert_eq!(&buf[..n], b"READY=1");
    sock.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    assert!(
        sock.recv(&mut buf).is_err(),
        "no watchdog ping without WATCHDOG_USEC"
    );
    drop(p);
}

/// Out of file descriptors, the accept loop counts each failed accept, warns once (not
/// every 50 ms it retries), and serves again once descriptors are free.
#[test]
fn failed_accepts_are_counted_and_warned_about_once() {
    /// `GET /metrics` on a kept-alive connection: the (chunked) body.
    fn scrape_on(s: &mut TcpStream) -> String {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(s, "GET /metrics HTTP/1.1\r\nHost: admin\r\n\r\n").unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 65536];
        while !got.ends_with(b"\r\n0\r\n\r\n") {
            let n = s.read(&mut buf).unwrap();
            assert!(n > 0, "closed: {}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&got).into_owned()
    }
    fn process_cpu(text: &str) -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix("process_cpu_seconds_total "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no CPU counter: {text}"))
    }

    let dir = tmpdir();
    let up = slow_upstream(Duration::ZERO);
    let (port, admin_port) = (free_port(), free_port());
    let cfg = serve_config(
        dir.path(),
        port,
        up,
        &format!(
            "[admin]\naddress = \"127.0.0.1:{admin_port}\"\n[log]\nlevel = \"warn\"\naccess_log = false\n"
        ),
    );
    let log_path = dir.path().join("stderr.log");
    let log = std::fs::File::create(&log_path).unwrap();
    // A hard limit the gateway cannot raise: a few dozen descriptors past its own.
    let _p = serve_with_open_files("96:96", &cfg, Stdio::from(log));
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let admin: SocketAddr = format!("127.0.0.1:{admin_port}").parse().unwrap();
    wait_listening(addr);
    wait_listening(admin);
    // A scraper's kept-alive connection, open before the descriptors run out.
    let mut scraper = TcpStream::connect(admin).unwrap();
    let cpu_before = process_cpu(&scrape_on(&mut scraper));
    // More connections than descriptors: the kernel queues them, the gateway cannot take
    // them all.
    let held: Vec<TcpStream> = (0..150)
        .map(|_| TcpStream::connect(addr).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(1500));
    // Out of descriptors, `/proc` cannot be read: what cannot be is left out, never `0`
    // (a CPU counter at 0 would read as a restart).
    let during = scrape_on(&mut scraper);
    assert!(process_cpu(&during) >= cpu_before, "{during}");
    assert!(!during.contains("\nprocess_open_fds 0\n"), "{during}");
    assert!(
        !during.contains("\nprocess_start_time_seconds 0\n"),
        "{during}"
    );
    drop(held);
    // Serving again once they are closed.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = http_get(addr, "/");
        if r.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(Instant::now() < deadline, "not serving again: {r:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let metrics = http_get(admin, "/metrics");
    let errors: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("tailgate_downstream_accept_errors_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no accept error count: {metrics}"));
    assert!(errors >= 2.0, "accept errors counted: {errors}");
    let text = std::fs::read_to_string(&log_path).unwrap();
    assert_eq!(
        text.matches("accept failed").count(),
        1,
        "one warning for {errors} failed accepts:\n{text}"
    );
}

/// Host-name endpoints with no name server to ask (an `/etc/resolv.conf` that names none,
/// and no `[dns] nameservers`): the gateway does not start, and says why and what to write,
/// rather than run for good with clusters that can never resolve. Needs a mount namespace
/// to hide the machine's `/etc/resolv.conf` (`unshare -m`, as root); said and skipped
/// without one.
#[test]
fn no_name_server_to_ask_stops_the_start() {
    let can = Command::new("unshare")
        .args(["-m", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !can {
        eprintln!("skipped: `unshare -m` is not allowed here");
        return;
    }
    let dir = tmpdir();
    let port = free_port();
    let cfg = dir.path().join("gw.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[listener]]\naddress = \"127.0.0.1:{port}\"\n[[cluster]]\nname = \"up\"\nendpoints = [\"svc.internal:8081\"]\n[[route]]\npath_prefix = \"/\"\ncluster = \"up\"\n"
        ),
    )
    .unwrap();
    // `check` refuses it too, for the same reason: it must not pass what `serve` refuses.
    for command in ["serve", "check"] {
        let script = format!(
            "mount --bind /dev/null /etc/resolv.conf && exec {BIN} {command} --config {}",
            cfg.display()
        );
        let out = Command::new("timeout")
            .args(["20", "unshare", "-m", "sh", "-c", &script])
            .env_remove("RUST_LOG")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{command}: {err}");
        assert!(
            err.contains("cannot resolve host-name endpoints"),
            "{command}: {err}"
        );
        assert!(err.contains("[dns] nameservers"), "{command}: {err}");
    }
    // With a name server named, `check` passes without asking it anything.
    let named = dir.path().join("named.toml");
    std::fs::write(
        &named,
        format!(
            "[dns]\nnameservers = [\"127.0.0.1:1\"]\n{}",
            std::fs::read_to_string(&cfg).unwrap()
        ),
    )
    .unwrap();
    let script = format!(
        "mount --bind /dev/null /etc/resolv.conf && exec {BIN} check --config {}",
        named.display()
    );
    let out = Command::new("timeout")
        .args(["20", "unshare", "-m", "sh", "-c", &script])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `tailgate demo-upstream` on a port already taken says which address it could not listen
/// on; one that runs cuts off a client that sends no request head (10 s), and stops
/// cleanly (exit 0) at a SIGTERM sent as soon as it says it listens.
#[test]
fn demo_upstream_names_its_address_cuts_silent_clients_and_stops_cleanly() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let out = Command::new(BIN)
        .args(["demo-upstream", "--listen", &addr.to_string()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&addr.to_string()), "{err}");
    drop(taken);

    let port = free_port();
    let mut p = Proc(
        Command::new(BIN)
            .args(["demo-upstream", "--listen", &format!("127.0.0.1:{port}")])
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut lines = BufReader::new(p.0.stderr.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    assert!(first.contains("listening"), "{first}");
    let demo: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut silent = TcpStream::connect(demo).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let t = Instant::now();
    let mut buf = [0u8; 64];
    let n = silent.read(&mut buf).unwrap_or(0);
    assert_eq!(n, 0, "closed, not answered");
    assert!(
        t.elapsed() < Duration::from_secs(15),
        "cut off after {:?}",
        t.elapsed()
    );
    kill("-TERM", &p.0.id().to_string());
    let status = exit_within(&mut p, Duration::from_secs(5), "the demo did not stop");
    assert!(status.success(), "{status:?}");
}
