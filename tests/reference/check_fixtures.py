"""Recomputes every committed fixture's reference logits and greedy continuation from its
committed checkpoint with k3_reference.py and compares them with the committed outputs.
Guards against the reference code and the fixtures drifting apart. Exit code 1 on mismatch."""

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dspark_reference import DSparkReference  # noqa: E402
from k3_reference import Reference, read_safetensors  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures")

bad = 0
for name in sorted(os.listdir(FIXTURES)):
    d = os.path.join(FIXTURES, name)
    if not os.path.exists(os.path.join(d, "reference.json")):
        continue
    with open(os.path.join(d, "reference.json")) as f:
        ref = json.load(f)
    want = read_safetensors(os.path.join(d, "reference.safetensors"))["logits"]
    if ref.get("kind") == "dspark":
        dspark = DSparkReference(d, Reference(os.path.join(FIXTURES, ref["target"])))
        taps = dspark.target_taps(ref["prompt_ids"])
        got, same = [], True
        for case in ref["cases"]:
            L = case["context_len"]
            logits, drafts, _ = dspark.block(dspark.context(taps, 0, L), case["anchor"], L)
            got.append(logits)
            same = same and drafts == case["drafts"]
        got = np.concatenate(got, axis=0)
        err = np.max(np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1))
        ok = err < 1e-6 and same
        bad += not ok
        print(f"{name}: max relative error vs committed drafter logits {err:.2e}, drafts {'ok' if same else 'DIFFER'}")
        continue
    model = Reference(d)
    got = model.logits(ref["prompt_ids"])
    err = np.max(np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1))
    # The memory-mapped path (check_greedy.py, for checkpoints larger than memory) gives the same bits.
    lazy_same = np.array_equal(Reference(d, lazy=True).logits(ref["prompt_ids"]), got)
    if not lazy_same:
        bad += 1
        print(f"{name}: the lazy (memory-mapped) reference DIFFERS from the in-memory one")
    greedy, _ = model.greedy(ref["prompt_ids"], 4)
    ok = err < 1e-6 and greedy == ref["greedy_ids"][:4]
    bad += not ok
    print(f"{name}: max relative error vs committed logits {err:.2e}, greedy prefix {'ok' if greedy == ref['greedy_ids'][:4] else 'DIFFERS'}")
sys.exit(1 if bad else 0)
