"""Server overhead vs `deltafin run`, and a chat's second-turn TTFT with and without reuse.

    python3 bench/serve_bench.py BIN MODEL_DIR|--demo TOKENS ROUNDS

Prints one JSON record (machine, command, git revision, every round, medians). Standard library
only. Rounds alternate run / server so drift hits both; ratios are computed within this run.

- overhead: the same raw prompt, greedy, TOKENS new tokens. `run` is timed from its own counters
  (ttft_s + decode_s: prefill and decode inside the process, no startup); the server is timed by
  the client, request sent to last byte received (HTTP, JSON, tokenisation, queue included), for
  a plain and a streamed request. ratio = server wall / run's generation time.
- reuse: a chat with a long system message; turn 1, then turn 2 (history + a new question)
  streamed; TTFT = request sent to first content chunk, on a server that keeps sessions and on
  one started with --no-reuse --memo 0. Each round uses a new system message (no memo hits).
"""

import http.client
import json
import os
import platform
import statistics
import subprocess
import sys
import time

BIN, MODEL, TOKENS, ROUNDS = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
# Greedy, as the comparisons of texts below need (the demo's own defaults may sample).
MODEL_ARGS = (["--demo"] if MODEL == "--demo" else ["--model", MODEL]) + ["--temperature", "0"]
PROMPT = ("The drives hum while the experts stream in, layer after layer, and the model answers. " * 6).strip()


def start_server(extra):
    p = subprocess.Popen([BIN, "serve", *MODEL_ARGS, "--port", "0", "-q", *extra],
                         stderr=subprocess.PIPE, text=True)
    for line in p.stderr:
        if " on http://" in line:
            addr = line.split(" on http://")[1].split()[0]
            host, port = addr.rsplit(":", 1)
            return p, host, int(port)
    raise SystemExit("the server did not start")


def post(host, port, path, body, stream=False):
    """Returns (seconds to first content, seconds to the end, parsed body or chunks)."""
    c = http.client.HTTPConnection(host, port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    if not stream:
        data = json.loads(r.read())
        return None, time.perf_counter() - t0, data
    first, chunks, buf = None, [], b""
    while True:
        b = r.read1(65536)
        if not b:
            break
        buf += b
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            d = ev[len(b"data: "):]
            if d == b"[DONE]":
                continue
            ch = json.loads(d)
            chunks.append(ch)
            if first is None and any((c.get("delta") or {}).get("content") or c.get("text") for c in ch.get("choices", [])):
                first = time.perf_counter() - t0
    return first, time.perf_counter() - t0, chunks


def model_id(host, port):
    c = http.client.HTTPConnection(host, port)
    c.request("GET", "/v1/models")
    return json.loads(c.getresponse().read())["data"][0]["id"]


def machine():
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
    mem = next((int(l.split()[1]) * 1024 for l in open("/proc/meminfo") if l.startswith("MemTotal")), None)
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(), "memory_bytes": mem}


def main():
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    srv, host, port = start_server(["--no-reuse", "--memo", "0"])
    mid = model_id(host, port)
    overhead = []
    try:
        for rnd in range(ROUNDS):
            out = subprocess.run([BIN, "run", *MODEL_ARGS, "--prompt", PROMPT, "--max-new", str(TOKENS), "--format", "json", "-q"],
                                 capture_output=True, text=True, check=True).stdout
            run = json.loads(out)
            run_s = run["stats"]["ttft_s"] + run["stats"]["decode_s"]
            body = {"model": mid, "prompt": PROMPT, "max_tokens": TOKENS}
            _, plain_s, plain = post(host, port, "/v1/completions", body)
            _, stream_s, _ = post(host, port, "/v1/completions", dict(body, stream=True), stream=True)
            assert plain["choices"][0]["text"] == run["text"], "server and run disagree"
            overhead.append({"round": rnd, "tokens": len(run["output_ids"]), "run_generation_s": run_s,
                             "server_plain_s": plain_s, "server_stream_s": stream_s,
                             "server_generation_s": plain["deltafin"]["prefill_s"] + plain["deltafin"]["decode_s"],
                             "ratio_plain": plain_s / run_s, "ratio_stream": stream_s / run_s})
    finally:
        srv.terminate()
        srv.wait()
    reuse = []
    servers = {"reuse": start_server([]), "fresh": start_server(["--no-reuse", "--memo", "0"])}
    try:
        for rnd in range(ROUNDS):
            system = f"Round {rnd}. " + ("You are a careful assistant who reads every drive log twice. " * 40)
            row = {"round": rnd}
            for name, (_, h, p) in servers.items():
                msgs = [{"role": "system", "content": system}, {"role": "user", "content": "What is in the log?"}]
                _, _, t1 = post(h, p, "/v1/chat/completions", {"model": mid, "messages": msgs, "max_tokens": 16, "reasoning_effort": "none"})
                msgs += [{"role": "assistant", "content": t1["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "And the second drive?"}]
                first, _, chunks = post(h, p, "/v1/chat/completions", {"model": mid, "messages": msgs, "max_tokens": 16,
                                        "reasoning_effort": "none", "stream": True, "stream_options": {"include_usage": True}}, stream=True)
                usage = chunks[-1]
                row[name] = {"ttft_s": first, "server_ttft_s": usage["deltafin"]["ttft_s"],
                             "prompt_tokens": usage["usage"]["prompt_tokens"],
                             "cached_tokens": usage["usage"]["prompt_tokens_details"]["cached_tokens"],
                             "text": "".join((c["delta"].get("content") or "") for ch in chunks for c in ch.get("choices", []))}
            assert row["reuse"]["text"] == row["fresh"]["text"], "reuse changed the answer"
            row["ttft_ratio_fresh_over_reuse"] = row["fresh"]["ttft_s"] / row["reuse"]["ttft_s"]
            reuse.append(row)
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
            proc.wait()
    med = lambda xs: statistics.median(xs)
    print(json.dumps({
        "bench": "serve", "date": time.strftime("%Y-%m-%d"), "machine": machine(), "git": rev,
        "command": " ".join(["bench/serve.sh", MODEL, str(TOKENS), str(ROUNDS)]), "model": mid,
        "overhead": overhead, "reuse": reuse,
        "median": {
            "run_generation_s": med([o["run_generation_s"] for o in overhead]),
            "server_plain_s": med([o["server_plain_s"] for o in overhead]),
            "server_stream_s": med([o["server_stream_s"] for o in overhead]),
            "ratio_plain": med([o["ratio_plain"] for o in overhead]),
            "ratio_stream": med([o["ratio_stream"] for o in overhead]),
            "turn2_ttft_reuse_s": med([r["reuse"]["ttft_s"] for r in reuse]),
            "turn2_ttft_fresh_s": med([r["fresh"]["ttft_s"] for r in reuse]),
            "turn2_ttft_ratio_fresh_over_reuse": med([r["ttft_ratio_fresh_over_reuse"] for r in reuse]),
            "turn2_prompt_tokens": reuse[0]["reuse"]["prompt_tokens"] if reuse else None,
            "turn2_cached_tokens": reuse[0]["reuse"]["cached_tokens"] if reuse else None,
        },
    }))


if __name__ == "__main__":
    main()
