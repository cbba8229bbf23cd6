"""Checks an engine's greedy continuation against the fp64 reference in one teacher-forced pass:
the reference runs once over prompt + generated tokens (all but the last) and, at every position
where the engine chose a token, that token must be the reference's argmax. Shards are memory-mapped
and experts dequantised one at a time, so checkpoints far larger than memory work (slowly).
    python3 tests/reference/check_greedy.py MODEL --prompt-ids IDS.json --generated GEN.json
IDS.json / GEN.json: JSON arrays of token ids (GEN may also be a `deltafin bench run` record, whose
`output_ids` are taken). Prints one JSON record; exit status 1 when a token differs."""

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from k3_reference import Reference  # noqa: E402


def ids_from(path):
    with open(path) as f:
        v = json.load(f)
    if isinstance(v, dict):
        v = v["output_ids"]
    if not isinstance(v, list) or not all(isinstance(x, int) and x >= 0 for x in v):
        raise SystemExit(f"{path}: expected a JSON array of token ids (or a record with output_ids)")
    return v


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompt-ids", required=True)
    ap.add_argument("--generated", required=True)
    a = ap.parse_args()
    prompt, gen = ids_from(a.prompt_ids), ids_from(a.generated)
    if not prompt or not gen:
        raise SystemExit("need a non-empty prompt and at least one generated token")
    t0 = time.time()
    ref = Reference(a.model, lazy=True)
    logits = ref.logits(prompt + gen[:-1])
    mismatches, margins = [], []
    for j, tok in enumerate(gen):
        row = logits[len(prompt) - 1 + j]
        order = np.argsort(-row, kind="stable")
        margins.append(float(row[order[0]] - row[order[1]]))
        if int(order[0]) != tok:
            mismatches.append({"position": j, "engine": tok, "reference": int(order[0]),
                               "gap": float(row[order[0]] - row[tok])})
    out = {"check": "greedy_vs_fp64", "model": a.model, "prompt_tokens": len(prompt),
           "generated_tokens": len(gen), "identical": not mismatches, "mismatches": mismatches,
           "min_top2_margin": min(margins), "seconds": time.time() - t0}
    print(json.dumps(out))
    sys.exit(0 if not mismatches else 1)


if __name__ == "__main__":
    main()
