#!/usr/bin/env python3
"""Expert overlap of consecutive tokens' routes, per MoE layer: the union of k = 1..8 consecutive
tokens' experts (what a verify of k rows reads) against k x top-k (no overlap) and against
independent uniformly random routes, measured with deltafin on a model, and projected to K3's
896 experts / top-16.

    python3 bench/route_overlap.py [--model demo/kimi-k3-demo] [--windows bench/data/heldout-windows.jsonl]
        [--decode 128] [--out DIR/overlap.json]

Routes come from `deltafin bench run --fetch-trace` (drafts off), which records every MoE fetch in
order: with `--prefill-rows 1` each prompt row is its own pass, so the prompt's fetches are the
routes of the held-out prose itself, token by token (teacher forced: "prose"); the decode fetches
are the routes of the model's greedy continuation ("continuation"; windows whose continuation
has >= 20% repeated 4-grams are kept apart as "loops", since a loop re-routes the same tokens).

Union of k tokens: for every run of k consecutive tokens of a window, |S_i u ... u S_(i+k-1)| per
layer (S the token's top-k set), averaged over runs and layers. Random baseline: E(1 - (1 -
t/E)^k) for E experts, top-t, independent uniform routes.

Projection to K3 (the method): split the union into the first token's t experts and the k - 1
tokens' "new" experts; the measured share of new experts relative to independent random routes,
r_k = (U_k - t) / (U_k,random - t), is the routes' redundancy beyond chance collisions (1: as
random; lower: consecutive tokens reuse experts more than chance). Assume r_k carries over to K3
(the same persistence of routes from token to token, relative to chance) and project
U_k,K3 = 16 + r_k (U_k,random(896, 16) - 16). Chance collisions are large on the demo (64 experts,
top-8: 8 random routes cover 42 experts, not 64) and small on K3 (8 random routes of 16 from 896
cover 120.5, not 128), which is why the ratio to random, not the raw union, is what is carried
over. Assumptions, stated in the record: route persistence relative to chance is a property of
text and router that does not depend on the expert count; per-layer differences average out; the
demo's router (bias-balanced, sigmoid, like K3's) is representative. Stdlib only.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K3_EXPERTS, K3_TOP_K = 896, 16


def sh(args, **kw):
    r = subprocess.run(args, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(args)}\n{r.stderr[-2000:]}")
    return r.stdout


def rep4(ids):
    seen, rep = set(), 0
    for i in range(3, len(ids)):
        g = tuple(ids[i - 3:i + 1])
        rep += g in seen
        seen.add(g)
    return rep / max(1, len(ids) - 3)


def random_union(E, t, k):
    return E * (1 - (1 - t / E) ** k)


def by_layer(fetches):
    out = {}
    for layer, experts in fetches:
        out.setdefault(layer, []).append(frozenset(experts))
    return out


def unions(seqs, kmax):
    """seqs: per window, {layer: [route set per token]}. Returns {k: (sum of unions, count)} and
    per layer {layer: {k: mean}}."""
    tot = {k: [0, 0] for k in range(1, kmax + 1)}
    per_layer = {}
    for s in seqs:
        for layer, routes in s.items():
            pl = per_layer.setdefault(layer, {k: [0, 0] for k in range(1, kmax + 1)})
            for k in range(1, kmax + 1):
                for i in range(0, len(routes) - k + 1):
                    u = len(frozenset().union(*routes[i:i + k]))
                    tot[k][0] += u
                    tot[k][1] += 1
                    pl[k][0] += u
                    pl[k][1] += 1
    mean = {k: v[0] / v[1] for k, v in tot.items() if v[1]}
    layers = {l: {k: round(v[0] / v[1], 3) for k, v in d.items() if v[1]} for l, d in sorted(per_layer.items())}
    return mean, layers, tot[1][1]


def table(mean, E, t, kmax):
    rows = []
    for k in range(1, kmax + 1):
        if k not in mean:
            continue
        u, rnd = mean[k], random_union(E, t, k)
        r = (u - t) / (rnd - t) if k > 1 else 1.0
        k3_rnd = random_union(K3_EXPERTS, K3_TOP_K, k)
        k3 = K3_TOP_K + r * (k3_rnd - K3_TOP_K)
        rows.append({"k": k, "union": round(u, 3), "k_times_top_k": k * t, "union_over_k_top_k": round(u / (k * t), 4),
                     "random_union": round(rnd, 3), "union_over_random": round(u / rnd, 4),
                     "new_expert_ratio_to_random": round(r, 4),
                     "k3_random_union": round(k3_rnd, 2), "k3_projected_union": round(k3, 2),
                     "k3_projected_over_k_top_k": round(k3 / (k * K3_TOP_K), 4),
                     "k3_expert_reads_per_token_vs_single": round(k3 / (k * K3_TOP_K), 4)})
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", default=os.environ.get("DELTAFIN_BIN", os.path.join(ROOT, "target/release/deltafin")))
    p.add_argument("--model", default=os.path.join(ROOT, "demo/kimi-k3-demo"))
    p.add_argument("--windows", default=os.path.join(ROOT, "bench/data/heldout-windows.jsonl"))
    p.add_argument("--decode", type=int, default=128)
    p.add_argument("--kmax", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--limit", type=int, default=0, help="use only the first N windows")
    p.add_argument("--out")
    a = p.parse_args()
    cfg = json.load(open(os.path.join(a.model, "config.json")))["text_config"]
    E, t = cfg["num_experts"], cfg["num_experts_per_token"]
    wins = [json.loads(x) for x in open(a.windows, encoding="utf-8") if x.strip()]
    if a.limit:
        wins = wins[: a.limit]
    prose, cont, loops = [], [], []
    reps = []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        for i, w in enumerate(wins):
            pf, idf, tr = (os.path.join(d, n) for n in ("p.txt", "ids.json", "trace.json"))
            with open(pf, "w", encoding="utf-8") as f:
                f.write(w["text"])
            ids = json.loads(sh([a.bin, "run", "--model", a.model, "--prompt-file", pf, "--max-new", "1", "--temperature",
                                 "0", "--format", "json", "-q"]))["prompt_ids"]
            with open(idf, "w") as f:
                json.dump(ids, f)
            rec = json.loads(sh([a.bin, "bench", "run", "--model", a.model, "--prompt-ids", "@" + idf, "--decode",
                                 str(a.decode), "--ceiling-seconds", "0", "--expert-heat", "off", "--threads",
                                 str(a.threads), "--prefill-rows", "1", "--draft", "off", "--fetch-trace", tr]).strip().splitlines()[-1])
            trace = json.load(open(tr))
            n_pre = trace["prefill_passes"]
            prose.append(by_layer(trace["trace"][:n_pre]))
            r = rep4(rec.get("output_ids") or [])
            reps.append(round(r, 3))
            (cont if r < 0.2 else loops).append(by_layer(trace["trace"][n_pre:]))
            print(f"[{time.time() - t0:4.0f} s] window {i + 1}/{len(wins)}: {len(ids)} prompt tokens, "
                  f"continuation repeated 4-grams {r:.2f}", file=sys.stderr)
    res = {}
    for name, seqs in (("prose", prose), ("continuation", cont), ("loops", loops)):
        if not seqs:
            continue
        mean, layers, n = unions(seqs, a.kmax)
        res[name] = {"windows": len(seqs), "tokens_x_layers": n, "table": table(mean, E, t, a.kmax),
                     "union_per_layer": layers}
    git = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rec = {"bench": "route_overlap", "date": time.strftime("%Y-%m-%d"), "git": git, "model": a.model,
           "experts": E, "top_k": t, "moe_layers": len(prose[0]) if prose else 0,
           "windows_file": os.path.relpath(a.windows, ROOT), "decode": a.decode,
           "continuation_repeated_4gram_share": reps, "command": " ".join(sys.argv),
           "projection": {"to": {"experts": K3_EXPERTS, "top_k": K3_TOP_K},
                          "method": "U_k,K3 = 16 + r_k (U_k,random(896,16) - 16), r_k = (U_k - t) / (U_k,random(E,t) - t) measured",
                          "assumptions": ["route persistence relative to chance collisions does not depend on the expert count",
                                          "layers averaged (per-layer unions in union_per_layer)",
                                          "the demo's router (sigmoid, bias-balanced noaux_tc) routes like K3's"]},
           "results": res}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rec, f, indent=1)
    for name, r in res.items():
        print(f"\n{name} ({r['windows']} windows): union of k consecutive tokens' experts, mean over layers")
        print("| k | union | k x top-k | union / (k x top-k) | random | r_k (new experts vs random) | K3 random | K3 projected | K3 projected / (k x 16) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for x in r["table"]:
            print(f"| {x['k']} | {x['union']:.2f} | {x['k_times_top_k']} | {x['union_over_k_top_k']:.3f} | {x['random_union']:.2f} "
                  f"| {x['new_expert_ratio_to_random']:.3f} | {x['k3_random_union']:.1f} | {x['k3_projected_union']:.1f} "
                  f"| {x['k3_projected_over_k_top_k']:.3f} |")


if __name__ == "__main__":
    main()
