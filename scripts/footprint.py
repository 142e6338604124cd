#!/usr/bin/env python3
"""What one proxied request costs a proxy's worker, counted by valgrind's callgrind rather
than timed: instructions, reads and writes, simulated cache misses, and the distinct
64-byte lines of the proxy's own code it runs. The counts are the same from run to run,
so they can tell two builds apart on a shared machine whose timings drift by more than
the difference (docs/tail-latency.md).

The last-level cache is simulated at 256 KiB (`--LL`), about what survives of a core's
caches between two requests at low load: a miss there stands for a line that is cold
when a request comes (per-connection state, for one), where the default (the host's LL)
would hide it.

    scripts/footprint.py                         # target/release/tailgate
    scripts/footprint.py --tailgate OTHER_BINARY --nginx
    scripts/footprint.py --nginx --rate 200 --requests 4000   # one request per wake-up

Needs valgrind, objdump and addr2line (binutils); nginx for --nginx.
"""

import argparse
import bisect
import collections
import glob
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

EVENTS = ["Ir", "Dr", "Dw", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(port, proc, what):
    for _ in range(240):
        if proc.poll() is not None:
            sys.exit(f"{what} exited early; see its log")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if s.recv(12).startswith(b"HTTP/1.1"):
                    return
        except OSError:
            pass
        time.sleep(0.5)
    sys.exit(f"{what} did not answer on port {port}")


def load(tailgate, port, n, conns, rate=None):
    pace = ["--rate", str(rate)] if rate else ["--closed"]
    subprocess.run(
        [tailgate, "bench", "run", "-c", str(conns), *pace, "-n", str(n),
         "--warmup", "0s", f"http://127.0.0.1:{port}/"],
        check=True, stdout=subprocess.DEVNULL)


def measure(label, cmd, port, out, args, env=None):
    """Runs `cmd` under callgrind, loads it, and returns the dump of the measured window."""
    vg = ["valgrind", "--tool=callgrind", "--cache-sim=yes", "--LL=262144,8,64",
          "--dump-instr=yes", f"--callgrind-out-file={out}"]
    log = open(out + ".log", "w")
    proc = subprocess.Popen(vg + cmd, stdout=log, stderr=log, env=env, start_new_session=True)
    try:
        wait_http(port, proc, label)
        load(args.tailgate, port, 1000, args.connections, args.rate)
        subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        load(args.tailgate, port, args.requests, args.connections, args.rate)
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1)
    finally:
        os.killpg(proc.pid, 15)
        proc.wait()
    dumps = [f for f in glob.glob(out + "*") if not f.endswith(".log")
             and "Trigger: dump" in open(f, errors="replace").read(4096)]
    if not dumps:
        sys.exit(f"{label}: no callgrind dump in {out}*")
    return dumps[0]


def parse(dump, binary):
    """Totals of the dump, and the instruction counts of `binary`'s own code by address."""
    names = {"fn": {}, "ob": {}}
    totals, by_addr = None, collections.Counter()
    ob, addr, skip, npos = None, 0, False, 1

    def name(kind, s):
        m = re.match(r"\((\d+)\)(?: (.*))?", s)
        if not m:
            return s
        if m.group(2):
            names[kind][m.group(1)] = m.group(2)
        return names[kind].get(m.group(1), s)

    def pos(tok, prev):
        if tok == "*":
            return prev
        if tok[0] in "+-":
            return prev + int(tok)
        return int(tok, 16) if tok.startswith("0x") else int(tok)

    for line in open(dump, errors="replace"):
        line = line.rstrip("\n")
        if line.startswith("positions:"):
            npos = len(line.split()) - 1
        elif line.startswith("summary:"):
            totals = [int(x) for x in line.split()[1:]]
        elif line.startswith("ob="):
            ob = name("ob", line[3:])
        elif line.startswith("cob="):
            name("ob", line[4:])
        elif line.startswith(("fn=", "cfn=")):
            name("fn", line.split("=", 1)[1])
        elif line.startswith("calls="):
            skip = True
        elif line and (line[0].isdigit() or line[0] in "+-*"):
            toks = line.split()
            addr = pos(toks[0], addr)
            if skip:
                skip = False
                continue
            if ob and os.path.realpath(ob) == os.path.realpath(binary) and len(toks) > npos:
                by_addr[addr] += int(toks[npos])
    return totals, by_addr


def hot_lines(by_addr, binary, requests):
    """Cache lines of code run at least once per two requests, and the bytes run in them."""
    hot = sorted(a for a, c in by_addr.items() if c >= requests // 2)
    if not hot:
        return 0, 0
    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", f"--start-address={hot[0]}",
                          f"--stop-address={hot[-1] + 16}", binary],
                         capture_output=True, text=True, check=True).stdout
    starts = sorted(int(m.group(1), 16) for m in re.finditer(r"^\s+([0-9a-f]+):\s", dis, re.M))
    size = 0
    for a in hot:
        i = bisect.bisect_right(starts, a)
        size += (starts[i] - a) if i < len(starts) else 4
    return len({a // 64 for a in hot}), size


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tailgate", default="target/release/tailgate")
    ap.add_argument("--nginx", action="store_true", help="measure nginx (one worker) too")
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--connections", type=int, default=50)
    ap.add_argument("--rate", type=float,
                    help="open loop at this many requests/s instead of closed loop: at a rate "
                         "the proxy keeps up with under callgrind, each request comes alone, "
                         "as at 5000 requests/s natively, so wake-ups are counted per request")
    args = ap.parse_args()
    args.tailgate = os.path.abspath(args.tailgate)
    for tool in ["valgrind", "callgrind_control", "objdump"]:
        if not shutil.which(tool):
            sys.exit(f"{tool} is missing (apt-get install valgrind binutils)")
    work = tempfile.mkdtemp(prefix="footprint-")
    up_port = free_port()
    upstream = subprocess.Popen([args.tailgate, "bench", "upstream", "--listen",
                                 f"127.0.0.1:{up_port}"], stdout=subprocess.DEVNULL,
                                start_new_session=True)
    rows = []
    try:
        wait_http(up_port, upstream, "upstream")
        port = free_port()
        conf = os.path.join(work, "tailgate.toml")
        with open(conf, "w") as f:
            f.write(f"""[server]
workers = 1
[log]
level = "warn"
access_log = false
[[listener]]
name = "bench"
address = "127.0.0.1:{port}"
[[cluster]]
name = "up"
endpoints = ["127.0.0.1:{up_port}"]
min_warm_connections = 4
[[route]]
path_prefix = "/"
cluster = "up"
""")
        targets = [("tailgate", args.tailgate, [args.tailgate, "serve", "--config", conf], port)]
        if args.nginx:
            nginx = shutil.which("nginx") or "/usr/sbin/nginx"
            nport = free_port()
            d = os.path.join(work, "nginx")
            os.makedirs(os.path.join(d, "tmp"))
            with open(os.path.join(d, "nginx.conf"), "w") as f:
                f.write(f"""worker_processes 1;
daemon off;
master_process off;
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
    upstream up {{ server 127.0.0.1:{up_port}; keepalive 256; keepalive_requests 1000000; keepalive_time 1h; }}
    server {{
        listen 127.0.0.1:{nport};
        location / {{
            proxy_pass http://up;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
}}
""")
            targets.append(("nginx", nginx, [nginx, "-c", f"{d}/nginx.conf", "-p", d], nport))
        for label, binary, cmd, p in targets:
            dump = measure(label, cmd, p, os.path.join(work, f"cg.{label}"), args)
            totals, by_addr = parse(dump, binary)
            lines, code = hot_lines(by_addr, binary, args.requests)
            rows.append((label, [t / args.requests for t in totals], lines, code))
    finally:
        os.killpg(upstream.pid, 15)
        upstream.wait()
    pace = f"at {args.rate:g} requests/s" if args.rate else "closed loop"
    print(f"per request, {args.requests} requests over {args.connections} connections, {pace} "
          f"(callgrind, LL 256 KiB; files in {work})")
    print(f"{'target':10}" + "".join(f"{e:>8}" for e in EVENTS) + "  hot code lines (bytes run)")
    for label, per, lines, code in rows:
        print(f"{label:10}" + "".join(f"{v:8.0f}" for v in per) + f"  {lines} ({code} B)")


if __name__ == "__main__":
    main()
