#!/usr/bin/env python3
"""A minimal Hugging Face-compatible hub for benchmarks: serves DIR as repo ORG/NAME at COMMIT.

  bench/hub_server.py DIR ORG/NAME COMMIT PORT

Routes: GET /api/models/{repo}/revision/{rev}?blobs=true (model API JSON with sizes, blob ids and
LFS sha256), GET /{repo}/resolve/{rev}/{file} with ETag and Range (206 + Content-Range). Threaded;
bodies are sent from a memory map in 4 MiB writes. The tests use the Rust server in
tests/common/hub.rs (with fault injection); this one only needs to be fast.
"""
import hashlib, http.server, json, mmap, os, socketserver, sys, urllib.parse

root, repo, commit, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
files = {}
for dp, _, fns in os.walk(root):
    for fn in fns:
        p = os.path.join(dp, fn)
        rel = os.path.relpath(p, root)
        size = os.path.getsize(p)
        h, g = hashlib.sha256(), hashlib.sha1()
        g.update(b"blob %d\0" % size)
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk); g.update(chunk)
        files[rel] = (p, size, h.hexdigest(), g.hexdigest())

def sibling(rel, v):
    d = {"rfilename": rel, "size": v[1], "blobId": v[3]}
    if v[1] >= 1 << 20:
        d["lfs"] = {"sha256": v[2], "size": v[1], "pointerSize": 134}
    return d

api = json.dumps({"id": repo, "sha": commit, "siblings": [sibling(k, v) for k, v in sorted(files.items())]}).encode()

class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def do_GET(self):
        path = urllib.parse.unquote(self.path.split("?")[0])
        if path.startswith(f"/api/models/{repo}/revision/"):
            return self.send(200, api, {"Content-Type": "application/json"})
        pre = f"/{repo}/resolve/"
        if not path.startswith(pre):
            return self.send(404, b"")
        rev, _, rel = path[len(pre):].partition("/")
        if rev not in (commit, "main") or rel not in files:
            return self.send(404, b"")
        p, size, sha, blob = files[rel]
        start, end, status = 0, size, 200
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            start = int(a); end = min(int(b) + 1, size) if b else size
            if start >= size:
                return self.send(416, b"", {"Content-Range": f"bytes */{size}"})
            status = 206
        self.send_response(status)
        self.send_header("Content-Length", str(end - start))
        self.send_header("ETag", f'"{sha if size >= 1 << 20 else blob}"')
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if size == 0:
            return
        with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            at = start
            while at < end:
                n = min(4 << 20, end - at)
                self.wfile.write(m[at:at + n]); at += n
    def send(self, status, body, headers={}):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True

print("ready", flush=True)
S(("127.0.0.1", port), H).serve_forever()
