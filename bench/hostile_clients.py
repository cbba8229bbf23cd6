#!/usr/bin/env python3
"""The server under the two hostile clients of issue 31, measured (not a test: tests/serve.rs checks them).

  python3 bench/hostile_clients.py [BIN] [--port 8765] [--read-timeout 10]

Starts `BIN serve --demo`, then (1) posts a ~50 MB chat message and prints the answer's status, its
time and the server's resident set after it (before the size check it was tokenized in full: 20.9 s,
RSS up to 843 MB); (2) opens 13 connections that send half a request head and stall, waits the read
timeout plus 3 s, and prints how many the server still holds open (before read timeouts: all 13
after 90 s). One JSON record on stdout.
"""
import argparse, http.client, json, socket, subprocess, time

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
    print(json.dumps(rec))
finally:
    srv.terminate()
    srv.wait()
