#!/usr/bin/env python3
"""Measures what only a trained model can show, on the demo model and held-out prompts, and prints
one JSON record (also appended to --out):

- drafts: `bench run --draft off|dspark|oracle` on every prompt, experts streamed (no expert cache) and
  with the cache: acceptance, accepted drafts per verify, forward passes and expert bytes read per
  committed token, decode tok/s on vs off, and whether every output id is the same;
- routes (from the drafts-off fetch traces, one fetch per token and MoE layer): the share of routes
  taken by the hottest 30% of each layer's experts, the overlap of consecutive tokens' experts, and
  the distinct experts in the union of 8 consecutive tokens (a draft block: pending + 7 drafts),
  each beside what uniformly random routes would give; the verify passes' own union sizes;
- the expert cache against the optimal (Belady) cache on these routes (`cache_misses_vs_opt`),
  the cache sized to a quarter and to a half of each layer's experts;
- placement: `place --policy hot` vs `spread` over a fast and a slow directory (declared 1.0 and
  0.5 GB/s, so the fast one holds two thirds of the experts either way), the route trace recorded on
  training text (bench/data/train-sample.txt: the start of 4 training documents of each source): share
  of expert bytes served by the fast one.

    python3 bench/trained.py [--bin target/release/deltafin] [--decode 64] [--out bench/results/...]

Stdlib only. Needs the demo model files (demo/kimi-k3-demo, demo/kimi-k3-demo-dspark).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sh(args, **kw):
    r = subprocess.run(args, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"command failed ({r.returncode}): {' '.join(args)}\n{r.stderr[-3000:]}")
    return r.stdout


def prompt_ids(a, text):
    out = sh([a.bin, "run", "--model", a.model, "--prompt-file", "-", "--max-new", "1", "--temperature", "0",
              "--format", "json"], input=text)
    return json.loads(out)["prompt_ids"]


def bench_run(a, ids, draft, cache_gb, trace=None, extra=()):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ids, f)
        idfile = f.name
    args = [a.bin, "bench", "run", "--model", a.model, "--prompt-ids", "@" + idfile, "--decode", str(a.decode),
            "--ceiling-seconds", "0", "--expert-heat", "off", "--threads", str(a.threads), "--draft", draft]
    if draft == "dspark":
        args += ["--draft-model", a.draft_model]
    if cache_gb is not None:
        args += ["--expert-cache-gb", repr(cache_gb)]
    if trace:
        args += ["--fetch-trace", trace]
    args += list(extra)
    out = sh(args)
    os.unlink(idfile)
    return json.loads(out.strip().splitlines()[-1])


def decode_trace(path, prompt_len_passes):
    t = json.load(open(path))
    return t["trace"][t["prefill_passes"]:], t["cache_slots"]


def route_stats(traces, experts, top_k):
    """traces: per prompt, the decode fetches [(layer, [experts])] of a drafts-off run."""
    counts = {}
    overlap, n_overlap = 0.0, 0
    unions, n_unions = 0.0, 0
    for tr in traces:
        by_layer = {}
        for layer, ex in tr:
            by_layer.setdefault(layer, []).append(set(ex))
        for layer, seq in by_layer.items():
            c = counts.setdefault(layer, [0] * experts)
            for s in seq:
                for e in s:
                    c[e] += 1
            for x, y in zip(seq, seq[1:]):
                overlap += len(x & y) / top_k
                n_overlap += 1
            for i in range(0, len(seq) - 7, 8):
                unions += len(set().union(*seq[i:i + 8]))
                n_unions += 1
    hot = int(round(0.3 * experts))
    shares = []
    for layer, c in sorted(counts.items()):
        s = sorted(c, reverse=True)
        shares.append(sum(s[:hot]) / max(1, sum(s)))
    rnd_union = experts * (1 - (1 - top_k / experts) ** 8)
    return {
        "hottest_30pct_share_mean": sum(shares) / len(shares),
        "hottest_30pct_share_per_layer": [round(x, 4) for x in shares],
        "hottest_30pct_share_if_uniform": hot / experts,
        "consecutive_overlap": overlap / max(1, n_overlap),
        "consecutive_overlap_if_random": top_k / experts,
        "block8_union_mean": unions / max(1, n_unions),
        "block8_union_if_random": rnd_union,
        "tokens_per_layer": n_overlap // max(1, len(counts)) + len(traces),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", default=os.environ.get("DELTAFIN_BIN", os.path.join(ROOT, "target/release/deltafin")))
    p.add_argument("--model", default=os.path.join(ROOT, "demo/kimi-k3-demo"))
    p.add_argument("--draft-model", default=os.path.join(ROOT, "demo/kimi-k3-demo-dspark"))
    p.add_argument("--prompts", default=os.path.join(ROOT, "bench/data/heldout-prompts.jsonl"))
    p.add_argument("--decode", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--limit", type=int, default=0, help="use only the first N prompts (smoke tests)")
    p.add_argument("--parts", default="drafts,cache,placement",
                   help="what to measure (comma-separated): drafts (with routes), cache, placement")
    p.add_argument("--out")
    a = p.parse_args()
    parts = set(a.parts.split(","))
    cfg = json.load(open(os.path.join(a.model, "config.json")))["text_config"]
    experts, top_k = cfg["num_experts"], cfg["num_experts_per_token"]
    moe_layers = cfg["num_hidden_layers"] - cfg.get("first_k_dense_replace", 0)
    work = tempfile.mkdtemp(prefix="deltafin-trained-")
    # The model is copied: place writes placement.json beside it.
    model_copy = os.path.join(work, "model")
    shutil.copytree(a.model, model_copy)
    a.model = model_copy
    prompts = [json.loads(l) for l in open(a.prompts, encoding="utf-8") if l.strip()]
    if a.limit:
        prompts = prompts[: a.limit]
    ids = [prompt_ids(a, p["text"]) for p in prompts]
    print(f"{len(ids)} held-out prompts, {sum(map(len, ids))} tokens", file=sys.stderr)

    runs = {}
    traces = []
    # `oracle` drafts K3's own greedy continuation (acceptance 1, no drafter cost): what verifying
    # rows together gives at best, beside what the trained drafter gives.
    settings = [("off_streamed", "off", 0.0), ("dspark_streamed", "dspark", 0.0), ("oracle_streamed", "oracle", 0.0),
                ("off_cached", "off", None), ("dspark_cached", "dspark", None)]
    for name, draft, cache in settings if "drafts" in parts else settings[:1]:
        recs = []
        for i, x in enumerate(ids):
            tr = os.path.join(work, f"{name}-{i}.json")
            recs.append(bench_run(a, x, draft, cache, trace=tr))
            if name == "off_streamed":
                traces.append(decode_trace(tr, None)[0])
            if name == "dspark_streamed":
                recs[-1]["_verify_unions"] = [len(e) for _, e in decode_trace(tr, None)[0] if len(e) > top_k]
        runs[name] = recs
        print(f"{name}: done", file=sys.stderr)

    def agg(recs):
        steps = sum(r["decode"]["steps"] for r in recs)
        secs = sum(r["decode"]["steps"] * r["decode"]["seconds_per_token"] for r in recs)
        prop = sum(r["decode"]["drafts_proposed"] for r in recs)
        acc = sum(r["decode"]["drafts_accepted"] for r in recs)
        ver = sum(r["decode"]["verify_calls"] for r in recs)
        fwd = sum(r["stats"].get("forward_calls", 0) - 1 for r in recs)   # minus the prefill's one
        byt = sum(r["decode"]["bytes_read_per_token"] * r["decode"]["steps"] for r in recs)
        return {"decode_tokens": steps, "decode_tok_s": steps / secs, "drafts_proposed": prop,
                "drafts_accepted": acc, "acceptance": acc / prop if prop else None,
                "verify_calls": ver, "accepted_per_verify": acc / ver if ver else None,
                "forward_passes_per_token": fwd / steps, "expert_bytes_read_per_token": byt / steps}

    drafts = {k: agg(v) for k, v in runs.items()}
    for name in drafts:
        if name.startswith("off_"):
            continue
        mode = name.split("_", 1)[1]
        off, on = runs[f"off_{mode}"], runs[name]
        drafts[name]["tok_s_ratio_to_off"] = drafts[name]["decode_tok_s"] / drafts[f"off_{mode}"]["decode_tok_s"]
        drafts[name]["ids_identical_to_off"] = all(x["output_ids"] == y["output_ids"] for x, y in zip(off, on))
    vu = [u for r in runs.get("dspark_streamed", []) for u in r["_verify_unions"]]
    routes = route_stats(traces, experts, top_k)
    routes["verify_union_mean"] = sum(vu) / len(vu) if vu else None

    # Cache quality: a quarter and a half of each layer's experts.
    expert_bytes = 3 * cfg["moe_intermediate_size"] * cfg["routed_expert_hidden_size"] * 17 // 32
    slot = -(-expert_bytes // 4096) * 4096
    cache = {}
    for label, frac in (("quarter", 0.25), ("half", 0.5)) if "cache" in parts else ():
        want = int(frac * experts) * moe_layers
        misses, opt, slots = 0, 0, None
        for x in ids:
            for attempt in range(3):
                r = bench_run(a, x, "off", want * slot / 1e9)
                slots = r["cache_slots"]
                if slots == want:
                    break
                # The store's slot is bigger than one expert (alignment and piece slack): size by it.
                slot = (want * slot) // slots + 1 if slots else slot * 2
            misses += r["cache_misses"] or 0
            opt += r["cache_misses_opt"] or 0
        cache[label] = {"slots": slots, "slots_wanted": want, "cache_misses": misses, "cache_misses_opt": opt,
                        "cache_misses_vs_opt": misses / opt if opt else None}

    if "cache" in parts:
        # The same routes replayed through textbook policies and route oracles (bench/cache_sim.py):
        # what a policy could get from knowing the next tokens' routes exactly.
        sim = sh([sys.executable, os.path.join(ROOT, "bench/cache_sim.py"), "--fractions", "0.25,0.5",
                  "--experts", str(experts), "--top-k", str(top_k)]
                 + [os.path.join(work, f"off_streamed-{i}.json") for i in range(len(ids))])
        cache["simulated"] = json.loads(sim)["sizes"]

    # Placement: hot vs spread on a fast and a slow directory; the trace from training-text prompts.
    place = {}
    if "placement" in parts:
        routes_file = os.path.join(work, "routes.json")
        sh([a.bin, "run", "--model", a.model, "--prompt-file", os.path.join(ROOT, "bench/data/train-sample.txt"),
            "--max-new", "1", "--temperature", "0", "--trace-routes", routes_file])
        for policy in ("spread", "hot"):
            fast, slow = os.path.join(work, f"{policy}-fast"), os.path.join(work, f"{policy}-slow")
            for d in (fast, slow):
                os.makedirs(d, exist_ok=True)  # place never creates a drive directory
            # place writes MODEL/placement.json, which bench run then reads.
            args = [a.bin, "place", "--model", a.model, "--drive", f"{fast}=1.0", "--drive", f"{slow}=0.5",
                    "--policy", policy]
            if policy == "hot":
                args += ["--trace", routes_file]
            sh(args)
            fb, tb = 0, 0
            for x in ids:
                r = bench_run(a, x, "off", 0.0)
                drives = r["stats"].get("drives") or []
                for d in drives:
                    tb += d.get("bytes_read", 0)
                    if os.path.realpath(d.get("root", "")).startswith(os.path.realpath(fast)):
                        fb += d.get("bytes_read", 0)
            place[policy] = {"fast_drive_share_of_bytes": fb / tb if tb else None, "bytes_read": tb}

    rec = {"bench": "trained", "model": os.path.basename(os.path.normpath(cfg.get("_name", "kimi-k3-demo"))),
           "prompts": len(ids), "prompt_tokens": sum(map(len, ids)), "decode_steps_per_prompt": a.decode,
           "experts": experts, "top_k": top_k, "moe_layers": moe_layers,
           "machine": runs["off_streamed"][0].get("machine"), "git": runs["off_streamed"][0].get("git"),
           "date": runs["off_streamed"][0].get("date"), "command": " ".join(sys.argv),
           "drafts": drafts, "routes": routes, "cache": cache, "placement": place}
    line = json.dumps(rec)
    print(line)
    if a.out:
        with open(a.out, "a") as f:
            f.write(line + "\n")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
