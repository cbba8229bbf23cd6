#!/usr/bin/env python3
"""The server under the two hostile clients of issue 31, measured (not a test: tests/serve.rs checks them).

  python3 bench/hostile_clients.py [BIN] [--port 8765] [--read-timeout 10]

Starts `BIN serve --demo`, then (1) posts a ~50 MB chat message and prints the answer's status, its
time and the server's resident set after it (before the size check it was tokenized in full: 20.9 s,
RSS up to 843 MB); (2) opens 13 connections that send half a request head and stall, waits the read
timeout plus 3 s, and prints how many the server still holds open (before read timeouts: all 13
after 90 s); then issue 41's: (3) a 64 MiB body of small JSON values in an unknown field, its
status, time and the server's peak RSS growth (before the value budget: 0.33 -> 4.9 GB); (4) two
such 24 MiB bodies at once while /health is asked every 10 ms, the slowest /health (before parsing
moved off the async threads: 2.8 s); (5) a 200 MiB body (over the default 128 MiB limit) sent whole
by http.client, what it reads (before draining: a broken pipe); (6) a request whose client shuts
down its write side after sending, what it gets (before: nothing). One JSON record on stdout.
"""
import argparse, http.client, json, socket, subprocess, threading, time

ap = argparse.ArgumentParser()
ap.add_argument("bin", nargs="?", default="target/release/deltafin")
ap.add_argument("--port", type=int, default=8765)
ap.add_argument("--read-timeout", type=int, default=10)
a = ap.parse_args()
srv = subprocess.Popen([a.bin, "serve", "--demo", "--port", str(a.port), "--read-timeout", str(a.read_timeout)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    for _ in range(300):
        try:
            c = http.client.HTTPConnection("127.0.0.1", a.port, timeout=2)
            c.request("GET", "/health")
            c.getresponse().read()
            break
        except OSError:
            time.sleep(0.2)

    def rss_kb():
        with open(f"/proc/{srv.pid}/status") as f:
            return int(next(l for l in f if l.startswith("VmRSS")).split()[1])

    rec = {"bench": "hostile_clients", "rss_start_bytes": rss_kb() * 1024}
    body = json.dumps({"model": "demo-v2", "messages": [{"role": "user", "content": "word " * 10_000_000}]}).encode()
    t = time.time()
    c = http.client.HTTPConnection("127.0.0.1", a.port, timeout=300)
    c.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    answer = json.loads(r.read())
    rec["big_message"] = {"body_bytes": len(body), "status": r.status, "seconds": round(time.time() - t, 3),
                          "code": answer.get("error", {}).get("code"), "rss_after_bytes": rss_kb() * 1024}
    socks = []
    for _ in range(13):
        s = socket.create_connection(("127.0.0.1", a.port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    time.sleep(a.read_timeout + 3)
    still_open = 0
    for s in socks:
        s.settimeout(0.5)
        try:
            if s.recv(100) == b"":
                continue  # closed by the server
        except socket.timeout:
            still_open += 1
        except OSError:
            pass
    rec["stalled_connections"] = {"opened": 13, "read_timeout_s": a.read_timeout,
                                  "waited_s": a.read_timeout + 3, "still_open": still_open}

    def hwm_kb():
        with open(f"/proc/{srv.pid}/status") as f:
            return int(next(l for l in f if l.startswith("VmHWM")).split()[1])

    def junk(mib):
        return b'{"model":"demo-v2","prompt":"Hi","junk":[' + b"0," * (mib << 19) + b"0]}"

    def post(body, out=None):
        try:
            c = http.client.HTTPConnection("127.0.0.1", a.port, timeout=300)
            c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            r = c.getresponse()
            got = (r.status, json.loads(r.read()).get("error", {}).get("code"))
        except OSError as e:
            got = (None, repr(e))
        if out is not None:
            out.append(got)
        return got

    hwm0, t = hwm_kb(), time.time()
    status, code = post(junk(64))
    rec["small_values_64mib"] = {"status": status, "code": code, "seconds": round(time.time() - t, 3),
                                 "peak_rss_before_bytes": hwm0 * 1024,
                                 "peak_rss_growth_bytes": (hwm_kb() - hwm0) * 1024}
    results, bodies = [], [junk(24), junk(24)]
    posts = [threading.Thread(target=post, args=(b, results)) for b in bodies]
    for p in posts:
        p.start()
    worst, asked = 0.0, 0
    while any(p.is_alive() for p in posts):
        t = time.time()
        c = http.client.HTTPConnection("127.0.0.1", a.port, timeout=60)
        c.request("GET", "/health")
        c.getresponse().read()
        worst, asked = max(worst, time.time() - t), asked + 1
        time.sleep(0.01)
    rec["two_24mib_bodies"] = {"answers": results, "health_asked": asked, "health_slowest_s": round(worst, 4)}
    status, code = post(b'{"model":"demo-v2","prompt":"' + b"x" * (200 << 20) + b'"}')
    rec["oversized_200mib"] = {"status": status, "code": code}
    body = json.dumps({"model": "demo-v2", "prompt": "Once upon a time", "max_tokens": 8}).encode()
    s = socket.create_connection(("127.0.0.1", a.port), timeout=60)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    s.shutdown(socket.SHUT_WR)
    answer = b""
    while chunk := s.recv(65536):
        answer += chunk
    final = answer
    while final.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"):
        final = final[len(b"HTTP/1.1 100 Continue\r\n\r\n"):]
    rec["half_close"] = {"answer_bytes": len(answer), "status_line": final.split(b"\r\n")[0].decode(errors="replace")}
    print(json.dumps(rec))
finally:
    srv.terminate()
    srv.wait()
