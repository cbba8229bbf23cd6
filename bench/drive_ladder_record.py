#!/usr/bin/env python3
"""The drive ladder's record and plots from the `bench run` records of bench/drive_ladder.sh.

  drive_ladder_record.py RUNS.jsonl OUTDIR DISK_MBPS TOTAL_MBPS LATENCY_MS MEM CEILINGS COMMAND

Writes OUTDIR/record.json, OUTDIR/ladder.svg (no dependencies beyond the standard library) and
OUTDIR/ladder.txt (a text plot, also on stderr); prints the record as its last stdout line.
bound_s_per_token = decode bytes per token / sum of the rung's drives' ceilings (GB/s, measured
through the throttles by `deltafin place` in the same run); bound_ratio = bound / measured
(1 = decode moved bytes at the drives' combined ceiling; the goal is >= 0.9).
"""

import datetime
import json
import os
import platform
import subprocess
import sys

PUBLISHED = {1: 52, 2: 73, 3: 90, 4: 100}
POLICIES = ["mirror", "hot", "spread", "naive"]


def load(path):
    runs = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                runs[r["ladder_run"]] = r
    return runs


def drives_of(rec):
    return ((rec.get("stats") or {}).get("drives")) or []


def rung(rec, run, policy, k, ceilings):
    dec = rec["decode"]
    s = dec["seconds_per_token"]
    b = dec["bytes_read_per_token"]
    ceil = ceilings[:k]
    bound = b / (sum(ceil) * 1e9) if b and sum(ceil) > 0 else None
    used = [d for d in drives_of(rec) if d["drive"] < k or rec.get("drives_used") is None]
    return {
        "drives": k,
        "policy": policy,
        "run": run,
        "decode_s_per_token": s,
        "bound_s_per_token": bound,
        "bytes_per_token": b,
        "drive_ceilings_gbps": ceil,
        "bound_ratio": bound / s if bound and s else None,
        "decode_tok_s": 1.0 / s if s else None,
        "ttft_s": rec["ttft_s"],
        "prefill_tok_s": rec["prefill_tok_s"],
        "prompt_tokens": rec["prompt_tokens"],
        "decode_steps": dec["steps"],
        "drive_bytes": [d["bytes_read"] for d in used],
        "read_ms_p50": [d["read_ms_p50"] for d in used],
        "read_ms_p99": [d["read_ms_p99"] for d in used],
        "lands_last": [d["lands_last"] for d in used],
        "output_ids": rec["output_ids"],
    }


def svg(rungs, path):
    w, h, pad = 640, 360, 50
    pols = sorted({r["policy"] for r in rungs}, key=POLICIES.index)
    colors = {"mirror": "#1f77b4", "hot": "#ff7f0e", "spread": "#2ca02c", "naive": "#d62728"}
    top = max((r["decode_tok_s"] or 0) for r in rungs) * 1.15 or 1.0
    x = lambda k: pad + (k - 0.5) * (w - 2 * pad) / 4
    y = lambda v: h - pad - v / top * (h - 2 * pad)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="14">Decode tok/s per rung (cold, throttled loop drives); dashed: published % of 4 drives</text>',
           f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
           f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>']
    for k in range(1, 5):
        out.append(f'<text x="{x(k)}" y="{h - pad + 18}" text-anchor="middle">{k} drive{"s" if k > 1 else ""}</text>')
    for i in range(5):
        v = top * i / 4
        out.append(f'<text x="{pad - 6}" y="{y(v) + 4}" text-anchor="end">{v:.2f}</text>')
    bw = (w - 2 * pad) / 4 / (len(pols) + 1)
    for j, p in enumerate(pols):
        for r in (r for r in rungs if r["policy"] == p and r["decode_tok_s"]):
            x0 = x(r["drives"]) - bw * len(pols) / 2 + j * bw
            out.append(f'<rect x="{x0:.1f}" y="{y(r["decode_tok_s"]):.1f}" width="{bw * 0.9:.1f}" '
                       f'height="{h - pad - y(r["decode_tok_s"]):.1f}" fill="{colors[p]}"/>')
            if r["bound_s_per_token"]:
                yb = y(1 / r["bound_s_per_token"])
                out.append(f'<line x1="{x0:.1f}" y1="{yb:.1f}" x2="{x0 + bw * 0.9:.1f}" y2="{yb:.1f}" stroke="black" stroke-width="2"/>')
        out.append(f'<rect x="{w - pad - 150}" y="{pad + 16 * j}" width="10" height="10" fill="{colors[p]}"/>'
                   f'<text x="{w - pad - 135}" y="{pad + 16 * j + 9}">{p}</text>')
    out.append(f'<text x="{w - pad - 150}" y="{pad + 16 * len(pols) + 9}">black bar: bandwidth bound</text>')
    four = next((r for r in rungs if r["drives"] == 4 and r["policy"] == pols[0]), None)
    if four and four["decode_tok_s"]:
        pts = " ".join(f"{x(k):.1f},{y(four['decode_tok_s'] * PUBLISHED[k] / 100):.1f}" for k in range(1, 5))
        out.append(f'<polyline points="{pts}" fill="none" stroke="gray" stroke-dasharray="5,4"/>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def text_plot(rungs):
    top = max((r["decode_tok_s"] or 0) for r in rungs) or 1.0
    lines = ["drives policy   prompt   tok/s   % of 4  published  bound ratio",]
    fours = {r["policy"]: r["decode_tok_s"] for r in rungs if r["drives"] == 4}
    for r in rungs:
        t = r["decode_tok_s"] or 0
        pct = 100 * t / fours[r["policy"]] if fours.get(r["policy"]) else float("nan")
        bar = "#" * round(40 * t / top)
        lines.append(f"{r['drives']:>6} {r['policy']:<7} {r['prompt_tokens']:>6} {t:7.3f}  {pct:6.1f}%  {PUBLISHED[r['drives']]:>8}%  "
                     f"{(r['bound_ratio'] or 0):10.3f}  {bar}")
    return "\n".join(lines)


def machine():
    cpu = ""
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(), "mem_bytes": mem}


def main():
    runs_path, out, disk_mbps, total_mbps, latency, mem, ceil_arg, command = sys.argv[1:9]
    runs = load(runs_path)
    ceilings = [float(c) for c in ceil_arg.split(",") if c]
    rungs = []
    policies = POLICIES
    for p in policies:
        if any(n.endswith("-" + p) for n in runs) and "rung1" in runs:
            rungs.append(rung(runs["rung1"], "rung1", p, 1, ceilings))
        for k in (2, 3, 4):
            n = f"rung{k}-{p}"
            if n in runs:
                rungs.append(rung(runs[n], n, p, k, ceilings))
    for p in policies:
        four = next((r for r in rungs if r["policy"] == p and r["drives"] == 4), None)
        for r in (r for r in rungs if r["policy"] == p):
            r["pct_of_four"] = 100 * r["decode_tok_s"] / four["decode_tok_s"] if four and r["decode_tok_s"] else None
            r["published_pct_of_four"] = PUBLISHED[r["drives"]]
    # Runs after the same prompt must give the same ids (the rungs' prompts differ in length).
    ids = {}
    for r in rungs:
        ids.setdefault(r["prompt_tokens"], []).append(r["output_ids"])
    straggler = None
    son, soff = runs.get("straggler-hedge-on"), runs.get("straggler-hedge-off")
    if son and soff:
        a, b = son["decode"]["layer_s_p99"], soff["decode"]["layer_s_p99"]
        straggler = {
            "p99_layer_s_hedged": a,
            "p99_layer_s_unhedged": b,
            "p99_cut": 1 - a / b if a is not None and b else None,
            "ids_identical": son["output_ids"] == soff["output_ids"],
            "hedged_reads": son["stats"].get("hedged_reads"),
            "hedge_wins": son["stats"].get("hedge_wins"),
            "hedged_reads_when_off": soff["stats"].get("hedged_reads"),
            "decode_s_per_token_hedged": son["decode"]["seconds_per_token"],
            "decode_s_per_token_unhedged": soff["decode"]["seconds_per_token"],
            "layer_s_max_hedged": son["decode"]["layer_s_max"],
            "layer_s_max_unhedged": soff["decode"]["layer_s_max"],
        }
        whole = runs.get("straggler-hedge-whole")
        if whole:
            # Neither hedged nor split reads: what reading the other copies (split, steal, hedge) buys.
            w = whole["decode"]["layer_s_p99"]
            straggler["p99_layer_s_whole_reads"] = w
            straggler["p99_cut_vs_whole_reads"] = 1 - a / w if a is not None and w else None
            straggler["ids_identical_whole_reads"] = son["output_ids"] == whole["output_ids"]
            straggler["decode_s_per_token_whole_reads"] = whole["decode"]["seconds_per_token"]

    def lost(name, reference):
        st = runs.get(name + "-status")
        if st is None:
            return None
        rec = runs.get(name)
        ok = st["rc"] == 0 and rec is not None
        policy = st.get("placement", "").rstrip("0123456789") or None
        return {
            "policy": policy,
            "ids_identical": bool(ok and reference and rec["output_ids"] == reference["output_ids"]),
            "error": None if ok else st["stderr_tail"].strip(),
            "lost_drive": st["lost_drive"],
            "exit_code": st["rc"],
            "other_drives_sectors_written": st["other_drives_sectors_written"],
            "failed_drives": [d["drive"] for d in drives_of(rec) if d.get("failed")] if rec else None,
            "hedged_reads": rec["stats"].get("hedged_reads") if rec else None,
        }

    record = {
        "bench": "drive_ladder",
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "command": command,
        "disk_mbps": float(disk_mbps),
        "throttle_total_mbps": float(total_mbps),
        "per_read_latency_ms": None if latency == "null" else float(latency),
        "memory_cgroup": mem,
        "rungs": rungs,
        "ladder_ids_identical": all(all(i == g[0] for i in g) for g in ids.values()) if ids else None,
        "straggler": straggler,
        "detached": lost("lost-mirror", soff),
        "detached_no_copy": lost("lost-single", soff) or lost("lost-spread", soff),
    }
    for r in rungs:
        del r["output_ids"]
    with open(os.path.join(out, "record.json"), "w") as f:
        json.dump(record, f, indent=1)
    if rungs:  # LADDER_ONLY=straggler runs no rungs
        svg(rungs, os.path.join(out, "ladder.svg"))
        plot = text_plot(rungs)
        with open(os.path.join(out, "ladder.txt"), "w") as f:
            f.write(plot + "\n")
        print(plot, file=sys.stderr)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
