"""`batch --parallel 8` (continuous lanes) vs one by one on the demo model, drafts off and on.

    python3 bench/batch_lanes.py [--bin target/release/deltafin] [--rounds 2] [--max-tokens 96] --out FILE

The 32 prompts are the held-out prompts of bench/data/heldout-prompts.jsonl cut at word boundaries
into windows of about 110 characters, taken round-robin (every text's first window, then every
text's second, ...). Each round runs `deltafin batch --demo` (greedy) four ways, interleaved:
`--parallel 1` and `--parallel 8`, each with drafts off and `--draft dspark`; tok/s is completion
tokens over the batch's own time (its summary line: the model load excluded). Every way must give
the same text, finish reason and token count for every id. Output ids: `run --prompt-lines` with
`--parallel 8` (drafts off and on) against each prompt run alone (`run --prompt`, drafts off).
Writes one JSON record per run, then a summary record (medians, ratios vs one by one with drafts
off, texts_identical, ids_identical) as the last line.
"""

import argparse
import hashlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def prompts(n=32, width=110):
    texts = [json.loads(l)["text"] for l in open(os.path.join(ROOT, "bench/data/heldout-prompts.jsonl")) if l.strip()]
    windows = []
    for t in texts:
        words, cur, w = t.split(), [], []
        for x in words:
            cur.append(x)
            if len(" ".join(cur)) >= width:
                w.append(" ".join(cur))
                cur = []
        if cur and w and len(" ".join(cur)) < width // 2:
            # A short tail belongs to the window before it.
            w[-1] += " " + " ".join(cur)
        elif cur:
            w.append(" ".join(cur))
        windows.append(w)
    out, k = [], 0
    while len(out) < n:
        for w in windows:
            if k < len(w) and len(out) < n:
                out.append(w[k])
        k += 1
    return out


def machine():
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    mem = next((int(l.split()[1]) // 1024 // 1024 for l in open("/proc/meminfo") if l.startswith("MemTotal")), 0)
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gib": mem, "kernel": platform.release(),
            "load_avg": os.getloadavg()}


def batch(a, env, tmp, inp, parallel, draft, tag):
    out = os.path.join(tmp, f"{tag}.jsonl")
    cmd = [a.bin, "batch", "--demo", "--temperature", "0", "-q", "--in", inp, "--out", out, "--parallel", str(parallel)]
    if draft:
        cmd += ["--draft", "dspark"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    m = re.search(r"(\d+) done, (\d+) errors.* in ([0-9.]+) s", p.stderr)
    recs = {r["id"]: r for r in map(json.loads, open(out))}
    toks = sum(r["usage"]["completion_tokens"] for r in recs.values())
    secs = float(m.group(3))
    return {"bench": "batch-lanes", "parallel": parallel, "draft": "dspark" if draft else "off",
            "done": int(m.group(1)), "errors": int(m.group(2)), "completion_tokens": toks, "batch_s": secs,
            "tok_s": toks / secs, "drafts_accepted": sum(r["deltafin"]["drafts_accepted"] for r in recs.values()),
            "answers": {k: [r["text"], r["finish_reason"], r["usage"]["completion_tokens"]] for k, r in recs.items()},
            "cmd": " ".join(cmd[1:])}


def run_ids(a, env, args):
    cmd = [a.bin, "run", "--demo", "--temperature", "0", "-q", "--format", "json", "--max-new", str(a.max_tokens)] + args
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return [json.loads(l)["output_ids"] for l in p.stdout.splitlines() if '"output_ids"' in l]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", default=os.path.join(ROOT, "target/release/deltafin"))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    ps = prompts()
    tmp = tempfile.mkdtemp(prefix="batch-lanes-")
    env = dict(os.environ, DELTAFIN_CACHE=os.path.join(tmp, "cache"), HOME=os.path.join(tmp, "home"))
    inp = os.path.join(tmp, "in.jsonl")
    with open(inp, "w") as f:
        for i, t in enumerate(ps):
            f.write(json.dumps({"id": f"h{i}", "prompt": t, "max_tokens": a.max_tokens}) + "\n")
    lines = os.path.join(tmp, "prompts.txt")
    with open(lines, "w") as f:
        f.write("\n".join(ps) + "\n")
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    head = {"commit": commit, "machine": machine(), "prompts": len(ps), "max_tokens": a.max_tokens}
    recs = []
    ways = [(1, False), (8, False), (1, True), (8, True)]
    with open(a.out, "w") as out:
        for r in range(a.rounds):
            for par, draft in ways:
                rec = batch(a, env, tmp, inp, par, draft, f"r{r}-p{par}-{int(draft)}")
                rec.update(head, round=r)
                recs.append(rec)
                slim = {k: v for k, v in rec.items() if k != "answers"}
                slim["answers_sha256"] = hashlib.sha256(json.dumps(rec["answers"], sort_keys=True).encode()).hexdigest()
                out.write(json.dumps(slim) + "\n")
                out.flush()
                print(f"round {r} parallel {par} draft {slim['draft']}: {rec['tok_s']:.1f} tok/s", file=sys.stderr)
        texts_identical = all(x["answers"] == recs[0]["answers"] for x in recs)
        alone = [run_ids(a, env, ["--prompt", t])[0] for t in ps]
        many = {d: run_ids(a, env, ["--prompt-lines", lines, "--parallel", "8"] + (["--draft", "dspark"] if d else []))
                for d in (False, True)}
        ids_identical = all(many[d] == alone for d in many)
        med = {f"p{par}_{'dspark' if d else 'off'}": statistics.median(x["tok_s"] for x in recs
                                                                       if x["parallel"] == par and (x["draft"] != "off") == d)
               for par, d in ways}
        base = med["p1_off"]
        summary = dict(head, bench="batch-lanes-summary", rounds=a.rounds, tok_s_median=med,
                       ratio_vs_one_by_one={k: v / base for k, v in med.items()},
                       texts_identical=texts_identical, ids_identical=ids_identical,
                       ids_checked=f"run --prompt-lines --parallel 8 (drafts off, dspark) vs run --prompt alone, {len(ps)} prompts",
                       command=" ".join(["python3", "bench/batch_lanes.py"] + sys.argv[1:]))
        out.write(json.dumps(summary) + "\n")
    print(json.dumps(summary))
    if not (texts_identical and ids_identical):
        sys.exit(1)


if __name__ == "__main__":
    main()
