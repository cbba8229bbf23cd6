#!/usr/bin/env python3
"""Assembles bench/peer_colibri.sh's one JSON record from the files of its run directory.

    peer_colibri_record.py --run DIR --modes default,exact --command CMD --colibri-source S
        --colibri-commit C --colibri-arch A --speed 0|1 [--model DIR --limit-bytes N
        --colibri-expert-gb G --synth ARGS] [--llama-record FILE]

RUN holds quality.json (bench/peer_quality.py), deltafin.out / deltafin.io.json / deltafin.rss
(`bench run`'s record, its /proc trace from bench/peer_iomon.py, /usr/bin/time's peak RSS) and per
colibri mode M colibri-M.out / .io.json / .rss (kimi_k3's stderr joined to its stdout, so its phase
lines are stamped). --llama-record: bench/peer_llama.sh's record of the same run (bench/peer_all.sh),
embedded whole and its llama.cpp figures set beside the others.

colibri's phases, from its own lines: the prompt starts at `[K3] prompt:` (printed after the model
is loaded, right before the prefill) and ends at `[K3] prefill done` (TTFT = the span between the
two stamps; the first token's logits exist then); decode is `TUNE decode: N tokens in T s` (N
tokens in T s; N - 1 forward passes when it stops at "context full", as with K3_MAXT unset;
its window ends at that line and lasts T). Bytes read per token:
/proc/PID/io read_bytes over those windows / tokens, as bench/peer_record.py does for deltafin and
llama.cpp. Bound: read = bytes read in the phase / the disk rate deltafin probed on the same drive in
the same run (`ceilings`), compute = colibri's own phase timers (`[K3] time: attn A moe M (eload E)
head H`: A + M - E + H, E being the I/O wait it could not hide), which cover prefill and decode
together; so its bound is given for the whole run: (TTFT + decode seconds) / max(read_s, compute_s).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_record import json_object, read_at, stamped_line, window  # noqa: E402


def line_at(trace: dict, pattern: str) -> tuple[float, re.Match]:
    """(time printed, match) of the last stamped line matching `pattern`."""
    rx = re.compile(pattern)
    for t, line in reversed(trace["lines"]):
        m = rx.search(line)
        if m:
            return t, m
    raise SystemExit(f"peer_colibri_record: no line matching {pattern!r} in {trace['cmd'][-6:]}")


def peak_rss(path: str) -> int | None:
    try:
        for line in open(path):
            if line.startswith("peak_rss_kb"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def deltafin_side(run: str) -> dict:
    tr = json.load(open(os.path.join(run, "deltafin.io.json")))
    _, rec = stamped_line(tr, "ttft_s")
    pre, dec = rec["prefill"], rec["decode"]
    steps = dec["steps"]
    t0u = tr["t0_unix"]
    (ps, pe), (ds, de) = rec["phase_unix_s"]["prefill"], rec["phase_unix_s"]["decode"]
    pw, dw = window(tr, pe - t0u, pe - ps), window(tr, de - t0u, de - ds)
    ceilings = rec.get("ceilings") or {}
    gbps = ceilings.get("prefill_gbps", rec.get("ceiling_gbps"))
    out = {
        "ttft_s": rec["ttft_s"],
        "prefill_tok_s": rec["prefill_tok_s"],
        "decode_tok_s": dec["decode_tok_s"],
        "decode_steps": steps,
        "prefill_bytes_read_per_token": pw["read_bytes"] / rec["prompt_tokens"],
        "decode_bytes_read_per_token": dw["read_bytes"] / steps if steps else None,
        "peak_rss_bytes": peak_rss(os.path.join(run, "deltafin.rss")),
        "expert_cache_bytes": rec.get("expert_cache_bytes"),
        "bound": {
            "disk_gbps": gbps,
            "prefill_read_s": pw["read_bytes"] / (gbps * 1e9) if gbps else None,
            "prefill_compute_s": pre.get("compute_s"),
            "ttft_over_max": rec.get("ttft_over_max"),
            "decode_bound_s_per_token": rec.get("decode_bound_s_per_token"),
            "decode_over_bound": rec.get("decode_bound_ratio"),
        },
        "proc_io": {"prefill_window": pw, "decode_window": dw, "wall_s": tr["wall_s"]},
        "bench_run": rec,
    }
    return out


def colibri_side(run: str, mode: str, prompt_tokens: int, gbps: float | None) -> dict:
    tr = json.load(open(os.path.join(run, f"colibri-{mode}.io.json")))
    if tr.get("rc"):
        return {"status": "failed", "rc": tr["rc"], "tail": [l for _, l in tr["lines"][-8:]]}
    t_start, m = line_at(tr, r"\[K3\] prompt: (\d+) tokens")
    if int(m.group(1)) != prompt_tokens:
        raise SystemExit(f"peer_colibri_record: colibri ({mode}) ran {m.group(1)} prompt ids, deltafin {prompt_tokens}")
    t_pre, m = line_at(tr, r"\[K3\] prefill done in ([0-9.]+)s")
    own_prefill_s = float(m.group(1))
    t_dec, m = line_at(tr, r"TUNE decode: (\d+) tokens in ([0-9.]+)s")
    ntok, dec_s = int(m.group(1)), float(m.group(2))
    # With K3_MAXT unset (prompt + ngen) the loop stops at "context full" before the last token's
    # forward pass: N tokens cost N - 1 passes in T, as deltafin's N decoded tokens are N - 1 steps.
    full = any("[K3] context full" in l for _, l in tr["lines"])
    steps = ntok - 1 if full else ntok
    _, m = line_at(tr, r"\[K3\] time: attn ([0-9.]+)s moe ([0-9.]+)s \(eload ([0-9.]+)s\) head ([0-9.]+)s")
    attn, moe, eload, head = (float(m.group(i)) for i in range(1, 5))
    _, m = line_at(tr, r"expert hit ([0-9.]+)% \((\d+)/(\d+)\) \| ([0-9.]+) GB streamed")
    hit_pct, hits, lookups, streamed_gb = float(m.group(1)), int(m.group(2)), int(m.group(3)), float(m.group(4))
    _, m = line_at(tr, r"\[K3\] init done in ([0-9.]+)s \| (\d+) layers \| expert cache (\d+)/layer \(([0-9.]+) MB/slot\)")
    init_s, slots_per_layer, slot_mb = float(m.group(1)), int(m.group(3)), float(m.group(4))
    ttft = t_pre - t_start
    pw = window(tr, t_pre, ttft)
    dw = window(tr, t_dec, dec_s)
    compute_s = attn + max(moe - eload, 0.0) + head
    total_read = pw["read_bytes"] + dw["read_bytes"]
    read_s = total_read / (gbps * 1e9) if gbps else None
    try:
        egb = float(open(os.path.join(run, f"colibri-{mode}.expert_gb")).read())
    except (OSError, ValueError):
        egb = None
    return {
        "status": "measured",
        "expert_cache_gb": egb,
        "ttft_s": ttft,
        "own_prefill_s": own_prefill_s,
        "prefill_tok_s": prompt_tokens / ttft if ttft > 0 else None,
        "decode_tok_s": steps / dec_s if dec_s > 0 else None,
        "decode_steps": steps,
        "prefill_bytes_read_per_token": pw["read_bytes"] / prompt_tokens,
        "decode_bytes_read_per_token": dw["read_bytes"] / steps if steps else None,
        "peak_rss_bytes": peak_rss(os.path.join(run, f"colibri-{mode}.rss")),
        "init_s": init_s,
        "expert_cache": {"slots_per_layer": slots_per_layer, "slot_mb": slot_mb, "hit_pct": hit_pct,
                         "hits": hits, "lookups": lookups, "streamed_gb": streamed_gb},
        "phase_timers_s": {"attn": attn, "moe": moe, "eload_unhidden": eload, "head": head},
        "bound": {
            "disk_gbps": gbps,
            "read_s": read_s,
            "compute_s": compute_s,
            "time_s": ttft + dec_s,
            "time_over_max": (ttft + dec_s) / max(read_s or 0.0, compute_s) if max(read_s or 0.0, compute_s) > 0 else None,
            "prefill_read_s": pw["read_bytes"] / (gbps * 1e9) if gbps else None,
            "decode_read_s_per_token": dw["read_bytes"] / steps / (gbps * 1e9) if gbps and steps else None,
        },
        "proc_io": {"prefill_window": pw, "decode_window": dw, "wall_s": tr["wall_s"],
                    "process_read_bytes": tr["samples"][-1][1] if tr["samples"] else None},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--modes", default="default,exact")
    ap.add_argument("--command", required=True)
    ap.add_argument("--colibri-source", required=True)
    ap.add_argument("--colibri-commit", required=True)
    ap.add_argument("--colibri-arch", default="native")
    ap.add_argument("--speed", default="1")
    ap.add_argument("--model")
    ap.add_argument("--limit-bytes", type=int)
    ap.add_argument("--synth", default="")
    ap.add_argument("--llama-record")
    a = ap.parse_args()
    run = a.run
    out: dict = {"bench": "peer_colibri", "status": "measured", "command": a.command,
                 "colibri": {"source": a.colibri_source, "commit": a.colibri_commit,
                             "build": f"gcc -O3 -march={a.colibri_arch} -fopenmp -pthread (c/Makefile's Linux flags), CPU only"},
                 "loadavg_at_end": open("/proc/loadavg").read().split()[:3]}
    qpath = os.path.join(run, "quality.json")
    if os.path.exists(qpath):
        out["quality"] = json.load(open(qpath))
    if a.speed == "1":
        d = deltafin_side(run)
        rec = d["bench_run"]
        out.update({"date": rec.get("date"), "machine": rec.get("machine"), "git": rec.get("git")})
        gbps = d["bound"]["disk_gbps"]
        modes = [m for m in a.modes.split(",") if m]
        col = {m: colibri_side(run, m, rec["prompt_tokens"], gbps) for m in modes}
        speed = {
            "model": {"dir": a.model, "synth": a.synth, "bytes_over_limit": None,
                      "moe_layers": rec.get("moe_layers"), "expert_bytes_total": rec.get("expert_bytes_total")},
            "cgroup_limit_bytes": a.limit_bytes,
            "prompt_tokens": rec["prompt_tokens"],
            "deltafin": {k: v for k, v in d.items() if k != "bench_run"},
            "colibri": col,
        }
        if a.model and a.limit_bytes:
            mb = sum(os.path.getsize(os.path.join(a.model, f)) for f in os.listdir(a.model)
                     if os.path.isfile(os.path.join(a.model, f)))
            speed["model"]["bytes_over_limit"] = mb / a.limit_bytes
        ratios = {}
        for m, c in col.items():
            if c.get("status") != "measured":
                continue
            ratios[m] = {"decode_deltafin_over_colibri": d["decode_tok_s"] / c["decode_tok_s"] if c["decode_tok_s"] else None,
                         "ttft_deltafin_over_colibri": d["ttft_s"] / c["ttft_s"] if c["ttft_s"] else None}
        speed["ratios"] = ratios
        if a.llama_record:
            lr = [json_object(l) for l in open(a.llama_record)]
            lr = [x for x in lr if x is not None][-1]
            out["peer_llama"] = lr
            if lr.get("status") == "measured":
                ll = lr["llama_cpp"]
                speed["llama_cpp"] = {k: ll.get(k) for k in ("prefill_tok_s", "decode_tok_s",
                                      "prefill_bytes_read_per_token", "decode_bytes_read_per_token")}
                speed["ratios"]["llama_cpp"] = {"decode_deltafin_over_llama": d["decode_tok_s"] / ll["decode_tok_s"],
                                                "prefill_deltafin_over_llama": d["prefill_tok_s"] / ll["prefill_tok_s"]}
        out["speed"] = speed
        out["deltafin_bench_run"] = rec
        out["notes"] = [
            "both engines cold (page cache dropped) in the same memory cgroup, same prompt ids, same threads",
            "colibri's expert cache (K3_EXPERT_GB) = the cgroup limit less its resident trunk (its init RSS) and its load working set (64 expert slots), at most deltafin's expert cache, unless COLIBRI_EXPERT_GB is set",
            "colibri's TTFT excludes its model load (init_s) as deltafin's excludes its own",
            "each engine learned its routing history from one short run on other ids first (colibri pins nothing below 5,000 selections)",
            "decode: both generate greedily after the prompt; colibri's N steps each run a forward pass",
        ]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
