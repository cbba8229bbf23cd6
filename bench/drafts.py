#!/usr/bin/env python3
"""Draft acceptance that loops cannot fool: the demo model (or any model and DSpark drafter) on
held-out prose windows, greedy and sampled, drafts off / n-gram / DSpark, and beside every figure
the share of repeated 4-grams in the output, so a number made on looping text shows as such.

    python3 bench/drafts.py [--windows bench/data/heldout-windows.jsonl] [--decode 128]
        [--temperatures 0,0.7] [--cache resident,streamed] [--limit N] [--drafts off,auto,ngram,dspark]
        [--wrap "bench/in_cgroup.sh 1G"] [--run-args "--memory-gb 1"] [--out DIR/drafts.jsonl]

For every window, temperature and cache setting, `deltafin run --format json --stats-json` runs
with each `--draft` of `--drafts` (default off, auto, ngram, dspark; the same `--seed`, `--top-p` 1
unless given, `--ignore-eos`; output ids must be identical to drafts off), back to back per window
and in turn reversed every other window (paired, interleaved: drift and load hit all alike), each
inside `--wrap` when given (a memory cgroup that drops the page cache first: cold runs of a model
larger than memory). A window line holds `text`, or `ids` (prompt token ids, for a model without a
tokenizer). A window counts as prose ("no_loops") when its drafts-off
output has fewer than 20% repeated 4-grams (positions whose 4-gram ending there occurred earlier in
the output). Per temperature, cache and drafter, over all windows and over the no-loop windows:
drafts accepted / proposed overall and by draft position, accepted per verify, forward passes and
expert bytes (handed to the MoE, cache hits included) per committed token, decode tok/s and its
ratio to drafts off, the mean repeated-4-gram share of the outputs, and whether every id matched.
`--cache resident` lets every expert stay cached (the demo's experts fit); `streamed` runs with
`--expert-cache-gb 0`, every expert read from the drive each time.

Caveats: `run` drafts under the live cost model, which pauses drafting when it does not pay by
measured time, so the proposal counts (not the accept rule) depend on timing; timings on a shared
machine are noisy, acceptance figures much less so. Stdlib only; one JSON record per run of this
script (appended to --out) and a Markdown table on stdout.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRAFTS = ("off", "auto", "ngram", "dspark")


def rep4(ids):
    seen, rep = set(), 0
    for i in range(3, len(ids)):
        g = tuple(ids[i - 3:i + 1])
        rep += g in seen
        seen.add(g)
    return rep / max(1, len(ids) - 3)


def run(a, w, draft, temp, cache):
    with tempfile.TemporaryDirectory() as d:
        pf, sf = os.path.join(d, "prompt.txt"), os.path.join(d, "stats.json")
        if "ids" in w:
            prompt = ["--prompt-ids", ",".join(str(i) for i in w["ids"])]
        else:
            with open(pf, "w", encoding="utf-8") as f:
                f.write(w["text"])
            prompt = ["--prompt-file", pf]
        args = a.wrap.split() + [a.bin, "run", "--model", a.model, *prompt, "--max-new", str(a.decode), "--ignore-eos",
                "--temperature", repr(temp), "--top-p", repr(a.top_p), "--seed", str(a.seed), "--threads", str(a.threads),
                "--expert-heat", "off", "--format", "json", "--stats-json", sf, "-q", "--draft", draft] + a.run_args.split()
        if draft in ("dspark", "auto") and a.draft_model:
            args += ["--draft-model", a.draft_model]
        if cache == "streamed":
            args += ["--expert-cache-gb", "0"]
        r = subprocess.run(args, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"failed ({r.returncode}): {' '.join(args)}\n{r.stderr[-2000:]}")
        out = json.loads(r.stdout.strip().splitlines()[-1])
        stats = json.load(open(sf))
    return {"output_ids": out["output_ids"], "stats": stats}


def median(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


def tok_s(r):
    s = r["stats"]
    return s["generated_tokens"] / s["decode_s"] if s.get("decode_s") else None


def aggregate(runs, offs):
    """runs, offs: the drafter's and drafts-off's records of the same windows."""
    tok = sum(r["stats"]["generated_tokens"] for r in runs)
    dec_s = sum(r["stats"]["decode_s"] for r in runs)
    off_tok = sum(r["stats"]["generated_tokens"] for r in offs)
    off_s = sum(r["stats"]["decode_s"] for r in offs)
    prop = sum(r["stats"].get("drafts_proposed", 0) for r in runs)
    acc = sum(r["stats"].get("drafts_accepted", 0) for r in runs)
    ver = sum(r["stats"].get("verify_calls", 0) for r in runs)
    pos = {}
    for r in runs:
        for p in r["stats"].get("draft_acceptance_by_position") or []:
            q = pos.setdefault(p["position"], [0, 0])
            q[0] += p["proposed"]
            q[1] += p["accepted"]
    # Forward passes of decode: all but the prompt's (one per prefill chunk; one chunk here).
    fwd = sum(r["stats"].get("forward_calls", 0) - 1 for r in runs)
    byt = sum(r["stats"].get("decode_expert_bytes", 0) for r in runs)
    rate = tok / dec_s if dec_s else None
    off_rate = off_tok / off_s if off_s else None
    widths = []
    for r in runs:
        for i, c in enumerate(r["stats"].get("draft_widths") or []):
            widths += [0] * (i + 1 - len(widths))
            widths[i] += c
    ratios = [tok_s(r) / tok_s(o) if tok_s(r) and tok_s(o) else None for r, o in zip(runs, offs)]
    by_drafter = {}
    for r in runs:
        for k, v in (r["stats"].get("drafts_by_drafter") or {}).items():
            q = by_drafter.setdefault(k, {"verifies": 0, "proposed": 0, "accepted": 0})
            for f in q:
                q[f] += v[f]
    return {
        "windows": len(runs), "tokens": tok, "draft_widths": widths,
        "tok_s_per_window": [round(tok_s(r), 3) if tok_s(r) else None for r in runs],
        "tok_s_ratio_per_window": [round(x, 4) if x else None for x in ratios],
        "tok_s_ratio_median": round(median(ratios), 4) if median(ratios) else None,
        "decode_tok_s_median": round(median([tok_s(r) for r in runs]), 3) if runs and median([tok_s(r) for r in runs]) else None,
        "drafts_by_drafter": by_drafter,
        "drafter_forwards": sum(r["stats"].get("drafter_forwards") or 0 for r in runs),
        "drafter_context_rows": sum(r["stats"].get("drafter_context_rows") or 0 for r in runs),
        "drafts_proposed": prop, "drafts_accepted": acc, "acceptance": round(acc / prop, 4) if prop else None,
        "acceptance_by_position": [round(pos[k][1] / pos[k][0], 4) if pos[k][0] else None for k in sorted(pos)],
        "proposed_by_position": [pos[k][0] for k in sorted(pos)],
        "verify_calls": ver, "accepted_per_verify": round(acc / ver, 4) if ver else None,
        "forward_passes_per_token": round(fwd / tok, 4) if tok else None,
        "expert_bytes_per_token": round(byt / tok) if tok else None,
        "decode_tok_s": round(rate, 2) if rate else None,
        "tok_s_ratio_to_off": round(rate / off_rate, 4) if rate and off_rate else None,
        "repeated_4gram_share_mean": round(sum(rep4(r["output_ids"]) for r in runs) / max(1, len(runs)), 4),
        "ids_identical_to_off": all(r["output_ids"] == o["output_ids"] for r, o in zip(runs, offs)),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", default=os.environ.get("DELTAFIN_BIN", os.path.join(ROOT, "target/release/deltafin")))
    p.add_argument("--model", default=os.path.join(ROOT, "demo/kimi-k3-demo"))
    p.add_argument("--draft-model", default=os.path.join(ROOT, "demo/kimi-k3-demo-dspark"))
    p.add_argument("--windows", default=os.path.join(ROOT, "bench/data/heldout-windows.jsonl"))
    p.add_argument("--decode", type=int, default=128)
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--cache", default="resident", help="comma-separated: resident, streamed")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus for the sampled runs (1: plain temperature sampling)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--limit", type=int, default=0, help="the first N windows of every source")
    p.add_argument("--drafts", default=",".join(DRAFTS), help="comma-separated --draft values; off first")
    p.add_argument("--wrap", default="", help="command prefix for every run (e.g. 'bench/in_cgroup.sh 1G')")
    p.add_argument("--run-args", default="", help="extra arguments for every run")
    p.add_argument("--label", default="", help="a name for this record")
    p.add_argument("--out", help="append the record to this file")
    p.add_argument("--sequences-out", metavar="FILE",
                   help="only write each window's drafts-off ids (prompt and --decode + 7 new tokens, so every one of "
                        "the --decode positions anchors a full block) per temperature, for `train.py dspark-eval "
                        "--sequences FILE`, and stop")
    a = p.parse_args()
    wins = [json.loads(x) for x in open(a.windows, encoding="utf-8") if x.strip()]
    if a.limit:
        seen = {}
        wins = [w for w in wins if seen.setdefault(w["source"], []).append(w) or len(seen[w["source"]]) <= a.limit]
    temps = [float(t) for t in a.temperatures.split(",")]
    caches = a.cache.split(",")
    if a.sequences_out:
        n = a.decode
        a.decode = n + 7
        with open(a.sequences_out, "w") as f:
            for t in temps:
                for w in wins:
                    with tempfile.TemporaryDirectory() as d:
                        pf = os.path.join(d, "p.txt")
                        with open(pf, "w", encoding="utf-8") as g:
                            g.write(w["text"])
                        r = subprocess.run([a.bin, "run", "--model", a.model, "--prompt-file", pf, "--max-new", str(a.decode),
                                            "--ignore-eos", "--temperature", repr(t), "--top-p", repr(a.top_p), "--seed",
                                            str(a.seed), "--threads", str(a.threads), "--expert-heat", "off", "--format",
                                            "json", "-q"], capture_output=True, text=True, check=True)
                    o = json.loads(r.stdout.strip().splitlines()[-1])
                    f.write(json.dumps({"source": w["source"], "doc": w.get("doc"), "temperature": t, "top_p": a.top_p,
                                        "seed": a.seed, "decode": n, "prompt_ids": o["prompt_ids"],
                                        "output_ids": o["output_ids"]}) + "\n")
        print(f"wrote {a.sequences_out}: {len(wins) * len(temps)} sequences", file=sys.stderr)
        return
    drafts = a.drafts.split(",")
    assert drafts[0] == "off", "--drafts starts with off"
    up0 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    t0 = time.time()
    results = {}
    for cache in caches:
        for t in temps:
            per = {d: [] for d in drafts}
            for i, w in enumerate(wins):
                for d in (drafts if i % 2 == 0 else drafts[::-1]):
                    per[d].append(run(a, w, d, t, cache))
                    if a.out:
                        with open(a.out + ".runs", "a") as f:
                            f.write(json.dumps({"label": a.label, "cache": cache, "temperature": t, "window": i,
                                                "source": w["source"], "draft": d, **per[d][-1]}) + "\n")
                line = " ".join(f"{d} {tok_s(per[d][-1]) / tok_s(per['off'][-1]):.2f}x "
                                f"{per[d][-1]['stats'].get('drafts_accepted', 0)}/{per[d][-1]['stats'].get('drafts_proposed', 0)}"
                                for d in drafts[1:])
                print(f"[{time.time() - t0:5.0f} s] {cache} T={t} window {i + 1}/{len(wins)} ({w['source']}): "
                      f"repeated 4-grams {rep4(per['off'][-1]['output_ids']):.2f}, off {tok_s(per['off'][-1]):.2f} tok/s; {line}",
                      file=sys.stderr)
            clean = [rep4(r["output_ids"]) < 0.2 for r in per["off"]]
            key = f"{cache}/T{t:g}"
            results[key] = {"windows": len(wins), "no_loop_windows": sum(clean),
                            "repeated_4gram_share_per_window": [round(rep4(r["output_ids"]), 3) for r in per["off"]]}
            results[key]["loops"] = {}
            for d in drafts:
                pick = lambda rs, c: [r for r, k in zip(rs, c) if k]
                looped = [not c for c in clean]
                if d != "off":
                    results[key]["loops"][d] = aggregate(pick(per[d], looped), pick(per["off"], looped)) if any(looped) else None
                results[key][d] = {"all": aggregate(per[d], per["off"]),
                                   "no_loops": aggregate(pick(per[d], clean), pick(per["off"], clean))}
                by_src = {}
                for w, r, o, c in zip(wins, per[d], per["off"], clean):
                    if c:
                        by_src.setdefault(w["source"], ([], []))
                        by_src[w["source"]][0].append(r)
                        by_src[w["source"]][1].append(o)
                results[key][d]["no_loops_by_source"] = {s: aggregate(*v) for s, v in sorted(by_src.items())}
    git = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rec = {"bench": "drafts", "date": time.strftime("%Y-%m-%d"), "git": git,
           "draft_policy": os.environ.get("DELTAFIN_DRAFT_POLICY", "union"), "model": a.model, "draft_model": a.draft_model,
           "windows_file": os.path.relpath(a.windows, ROOT), "decode": a.decode, "seed": a.seed, "top_p": a.top_p, "threads": a.threads,
           "machine": os.uname().nodename, "cpus": os.cpu_count(), "seconds": round(time.time() - t0),
           "label": a.label, "drafts": drafts, "wrap": a.wrap, "run_args": a.run_args,
           "uptime_start": up0, "uptime_end": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
           "command": " ".join(sys.argv), "results": results}
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
    print("| setting | windows (no loops) | drafter | acceptance all | acceptance no-loops | by position (no loops) "
          "| accepted/verify | fwd/token | expert MB/token | tok/s ratio | median ratio all / no loops / loops | repeated 4-grams |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for key, r in results.items():
        for d in drafts[1:]:
            x, y = r[d]["all"], r[d]["no_loops"]
            pos = " ".join(f"{v:.2f}" if v is not None else "-" for v in (y.get("acceptance_by_position") or []))
            f = lambda v, fmt="{:.2f}": fmt.format(v) if v is not None else "-"
            print(f"| {key} | {r['windows']} ({r['no_loop_windows']}) | {d} | {f(x['acceptance'])} ({x['drafts_accepted']}/{x['drafts_proposed']}) "
                  f"| {f(y.get('acceptance'))} ({y.get('drafts_accepted', 0)}/{y.get('drafts_proposed', 0)}) | {pos} "
                  f"| {f(y.get('accepted_per_verify'))} | {f(y.get('forward_passes_per_token'))} "
                  f"| {f((y.get('expert_bytes_per_token') or 0) / 1e6, '{:.3f}')} | {f(y.get('tok_s_ratio_to_off'))} "
                  f"| {f(x.get('tok_s_ratio_median'))} / {f(y.get('tok_s_ratio_median'))} / "
                  f"{f((r['loops'].get(d) or {}).get('tok_s_ratio_median'))} | {f(x['repeated_4gram_share_mean'])} |")


if __name__ == "__main__":
    main()
