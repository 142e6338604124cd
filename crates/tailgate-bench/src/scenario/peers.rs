//! Starting what is measured: the built-in upstream, tailgate, and nginx / HAProxy as peers,
//! each with a generated config and the same CPU budget (one worker / one thread).

use std::net::SocketAddr;
use std::path::Path;

use super::procs::{Env, SetupError, free_port};

pub const NGINX: &str = "/usr/sbin/nginx";
pub const HAPROXY: &str = "/usr/sbin/haproxy";

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// `tailgate bench upstream` as a child; returns its address.
pub fn upstream(
    env: &mut Env,
    name: &str,
    body_bytes: usize,
    close_every: Option<u64>,
) -> Result<SocketAddr, SetupError> {
    let addr = loopback(free_port()?);
    let listen = addr.to_string();
    let body = body_bytes.to_string();
    let mut args = vec![
        "bench",
        "upstream",
        "--listen",
        &listen,
        "--body-bytes",
        &body,
    ];
    let n;
    if let Some(every) = close_every {
        n = every.to_string();
        args.extend(["--close-every", &n]);
    }
    let exe = env.tailgate_exe.clone();
    env.spawn(name, &exe, &args, addr)?;
    Ok(addr)
}

/// `tailgate serve` (the build measured as `tailgate`, [`Env::gateway_exe`]) with one
/// worker in front of `upstream`, with warm spare connections
/// (the setting a deployment that cares about the tail uses).
pub fn tailgate(env: &mut Env, name: &str, upstream: SocketAddr) -> Result<SocketAddr, SetupError> {
    tailgate_with(env, name, upstream, "")
}

/// [`tailgate`] with `extra` appended to its config (e.g. an `[admin]` table).
pub fn tailgate_with(
    env: &mut Env,
    name: &str,
    upstream: SocketAddr,
    extra: &str,
) -> Result<SocketAddr, SetupError> {
    let exe = env.gateway_exe.clone();
    tailgate_build(env, name, &exe, upstream, extra)
}

/// [`tailgate_with`], running the gateway of another binary `exe` (another build of
/// tailgate, measured beside this one).
pub fn tailgate_build(
    env: &mut Env,
    name: &str,
    exe: &Path,
    upstream: SocketAddr,
    extra: &str,
) -> Result<SocketAddr, SetupError> {
    let addr = loopback(free_port()?);
    let config = format!(
        r#"{extra}
[server]
workers = 1
max_connections = 8000
[log]
level = "warn"
access_log = false
[[listener]]
name = "bench"
address = "{addr}"
[[cluster]]
name = "up"
endpoints = ["{upstream}"]
min_warm_connections = 4
[[route]]
path_prefix = "/"
cluster = "up"
"#
    );
    let path = env.write(&format!("{name}.toml"), &config)?;
    let path = path.to_string_lossy().into_owned();
    // The config's log level, not the caller's RUST_LOG (which would override it, and
    // make the gateway measured log what nginx and HAProxy do not).
    env.spawn_with_env(
        name,
        exe,
        &["serve", "--config", &path],
        &[("RUST_LOG", None)],
        addr,
    )?;
    Ok(addr)
}

/// nginx, one worker process, upstream keep-alive, no access log.
pub fn nginx(env: &mut Env, name: &str, upstream: SocketAddr) -> Result<SocketAddr, SetupError> {
    nginx_with(env, name, upstream, "")
}

/// [`nginx`] doing the header work tailgate always does: the client's Host passed on,
/// `X-Forwarded-For/-Proto/-Host`, `Via` and a request id sent upstream, and the request id
/// returned to the client. The usual reverse-proxy configuration; with it both proxies do
/// the same job.
pub fn nginx_forwarding(
    env: &mut Env,
    name: &str,
    upstream: SocketAddr,
) -> Result<SocketAddr, SetupError> {
    nginx_with(
        env,
        name,
        upstream,
        r#"
            proxy_set_header Host $http_host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto $scheme;
            proxy_set_header X-Forwarded-Host $http_host;
            proxy_set_header Via "1.1 nginx";
            proxy_set_header X-Request-Id $request_id;
            add_header X-Request-Id $request_id always;"#,
    )
}

fn nginx_with(
    env: &mut Env,
    name: &str,
    upstream: SocketAddr,
    location_extra: &str,
) -> Result<SocketAddr, SetupError> {
    let addr = loopback(free_port()?);
    let dir = env.dir.join(name);
    std::fs::create_dir_all(dir.join("tmp"))
        .map_err(super::procs::io_err(format!("create {}", dir.display())))?;
    let d = dir.display();
    let config = format!(
        r#"worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {d}/tmp/body;
    proxy_temp_path {d}/tmp/proxy;
    fastcgi_temp_path {d}/tmp/fastcgi;
    uwsgi_temp_path {d}/tmp/uwsgi;
    scgi_temp_path {d}/tmp/scgi;
    keepalive_requests 1000000;
    upstream up {{
        server {upstream};
        keepalive 256;
        keepalive_requests 1000000;
        keepalive_time 1h;
    }}
    server {{
        listen {addr};
        location / {{
            proxy_pass http://up;
            proxy_http_version 1.1;
            proxy_set_header Connection "";{location_extra}
        }}
    }}
}}
"#
    );
    let conf = dir.join("nginx.conf");
    std::fs::write(&conf, config)
        .map_err(super::procs::io_err(format!("write {}", conf.display())))?;
    let (p, c, e) = (
        dir.to_string_lossy().into_owned(),
        conf.to_string_lossy().into_owned(),
        dir.join("error.log").to_string_lossy().into_owned(),
    );
    env.spawn(
        name,
        Path::new(NGINX),
        &["-p", &p, "-c", &c, "-e", &e, "-g", "daemon off;"],
        addr,
    )?;
    Ok(addr)
}

/// HAProxy, one thread, `http-reuse always`, no logging.
pub fn haproxy(env: &mut Env, name: &str, upstream: SocketAddr) -> Result<SocketAddr, SetupError> {
    let addr = loopback(free_port()?);
    let config = format!(
        r#"global
    nbthread 1
    maxconn 8000
defaults
    mode http
    timeout connect 2s
    timeout client 30s
    timeout server 30s
    http-reuse always
frontend bench
    bind {addr}
    default_backend up
backend up
    server up1 {upstream}
"#
    );
    let path = env.write(&format!("{name}.cfg"), &config)?;
    let path = path.to_string_lossy().into_owned();
    env.spawn(name, Path::new(HAPROXY), &["-f", &path, "-db"], addr)?;
    Ok(addr)
}

/// Whether a peer binary is installed.
pub fn installed(path: &str) -> bool {
    Path::new(path).exists()
}
