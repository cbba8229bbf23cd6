#!/usr/bin/env python3
"""Writes the trained model's exactness fixture: what the training code's own forward pass (fp32,
on the shipped bytes) and the independent fp64 reference (tests/reference) compute on held-out
text, for deltafin's tests to match.

    python3 train/make_fixture.py --model demo/kimi-k3-demo --data train/data --out tests/fixtures/trained

Writes into --out:
  logits.safetensors  `ids` [T] (I64), `torch_logits` [T, vocab] (F32, the training code's forward),
                      `reference_logits` [T, vocab] (F32 of the fp64 reference);
  fixture.json        the prompt text, greedy continuations of both, the agreement between them,
                      and the perplexity of score_excerpt.txt as `deltafin score --text` defines it;
  score_excerpt.txt   a held-out excerpt (a piece of every held-out source).
Needs torch (CPU is fine), numpy, safetensors, tiktoken.
"""

import argparse
import json
import math
import os
import sys

import numpy as np
import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "reference"))
import train as T  # noqa: E402
from k3 import export  # noqa: E402
from k3_reference import Reference  # noqa: E402


def rel_l2(a, b):
    return float(np.max(np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--data", default="train/data")
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=128, help="prompt tokens for the logits fixture")
    p.add_argument("--greedy", type=int, default=24)
    p.add_argument("--excerpt-chars", type=int, default=1500, help="characters taken from each held-out document group")
    p.add_argument("--window", type=int, default=128)
    a = p.parse_args()
    torch.manual_seed(0)
    os.makedirs(a.out, exist_ok=True)
    model = export.load_model(a.model).eval()
    enc = T.tokenizer(a.model)
    docs = [json.loads(l) for l in open(os.path.join(a.data, "heldout.jsonl"), encoding="utf-8")]
    # The logits prompt: the start of the first held-out document of one source (no BOS, as a raw prompt).
    first = {}
    for d in docs:
        first.setdefault(d["source"], d)
    src = sorted(first)[0]
    ids = enc.encode_ordinary(first[src]["text"])[: a.tokens]
    prompt = enc.decode(ids)
    x = torch.tensor([ids])
    with torch.no_grad():
        tl = model(x, dtype=torch.float32)[0].double().numpy()
    ref = Reference(a.model)
    rl = ref.logits(ids)
    agree = rel_l2(tl, rl)
    print(f"training forward vs fp64 reference: max relative L2 over {len(ids)} positions {agree:.2e}")
    # Greedy continuations: the training forward (full recomputation) and the reference.
    g = list(ids)
    with torch.no_grad():
        for _ in range(a.greedy):
            g.append(int(model(torch.tensor([g]), dtype=torch.float32)[0, -1].argmax()))
    torch_greedy = g[len(ids):]
    ref_greedy, margins = ref.greedy(ids, a.greedy)
    print("greedy torch", torch_greedy, "\ngreedy ref  ", ref_greedy, "\nmin margin", min(margins))
    save_file({"ids": torch.tensor(ids, dtype=torch.int64),
               "torch_logits": torch.from_numpy(tl.astype(np.float32)),
               "reference_logits": torch.from_numpy(rl.astype(np.float32))},
              os.path.join(a.out, "logits.safetensors"))
    # The score excerpt: the start of every held-out source's first document.
    excerpt = "\n\n".join(first[s]["text"][: a.excerpt_chars] for s in sorted(first))
    with open(os.path.join(a.out, "score_excerpt.txt"), "w", encoding="utf-8") as f:
        f.write(excerpt)
    nll, n = T.score_text(model, enc, excerpt, a.window, "cpu")
    nbytes = len(excerpt.encode("utf-8"))
    score = {"file": "score_excerpt.txt", "window": a.window, "tokens": n, "nll": nll,
             "ppl": math.exp(nll / n), "bits_per_byte": nll / math.log(2) / nbytes}
    print("score", score)
    fixture = {
        "model": os.path.basename(os.path.normpath(a.model)),
        "prompt_source": src, "prompt": prompt, "prompt_ids": ids,
        "torch_greedy": torch_greedy, "reference_greedy": ref_greedy, "reference_min_margin": min(margins),
        "torch_vs_reference_max_rel_l2": agree, "score": score,
        "made_by": "train/make_fixture.py (torch " + torch.__version__ + ", fp32 on CPU)",
    }
    with open(os.path.join(a.out, "fixture.json"), "w") as f:
        json.dump(fixture, f, indent=1)


if __name__ == "__main__":
    main()
