#!/usr/bin/env python3
"""Quality side of the colibri peer benchmark (bench/peer_colibri.sh): teacher-forced logits of
deltafin and of colibri's Kimi K3 engine (`kimi_k3`, its K3_LOGITS dump) on held-out text of a
K3-layout model, each against the fp64 reference, plus greedy continuations. Prints one JSON object.

    peer_quality.py --colibri BIN --deltafin BIN [--model DIR] [--fixture DIR]
                    [--text FILE --window N] [--greedy N] [--threads T] [--keep DIR]

The held-out text and its fp64 logits come from --fixture (default tests/fixtures/trained: 128
ids of text the demo never trained on, `reference_logits` written by the independent fp64
reference tests/reference/k3_reference.py, and its 24 greedy tokens), or with --text from that
file (ids = [BOS] + tiktoken encoding, the first --window ids) with the fp64 reference computed
here by tests/reference/k3_reference.py (numpy; minutes for 512 ids of the demo).

colibri runs in each of its modes (MODES below: its default, which quantizes the trunk at load and
the expert activations to int8, and its most exact settings) on raw ids (`--ids`, `--ngen 0`,
K3_LOGITS=FILE: f32 [T, vocab], one row per prefill position), with COLI_USAGE pointing at a
file in a scratch directory and USAGE_SAVE=0, so it never writes its `.coli_usage` history into
the model directory. deltafin runs `score --prompt-ids --logits-out` and `run --prompt-ids
--max-new N --format json`.

Figures per engine: rel L2 per position = ||got - ref|| / ||ref|| over the vocab (the definition
of tests/common/mod.rs, tolerance 1e-4 in tests/trained.rs): its max and mean; top-1 agreement =
share of positions whose argmax equals the reference's; greedy = the first N tokens generated
from the whole prompt, and how many leading tokens equal the reference's greedy continuation.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# colibri's settings (docs/kimi_k3.md; the env block at the top of c/kimi_k3.c)
MODES = {
    # as shipped: KDA/latent/shared/dense trunk int4-g64, MLA and lm_head int8 per row,
    # int8 activations in the routed-expert MXFP4 products (K3_IDOT=1), prefill chunks of 32
    "default": {},
    # only the expert activations made exact: shows how much of the default's error is the trunk
    "idot0": {"K3_IDOT": "0"},
    # the default with the KDA/latent/shared/dense trunk at int8 per row instead of int4-g64
    "trunk8": {"K3_BITS": "8"},
    # its most exact settings: every trunk matrix f32 (bf16 widened), float expert products
    "exact": {"K3_BITS": "32", "K3_MLA_BITS": "32", "K3_HEAD_BITS": "32", "K3_IDOT": "0"},
    # the same, token at a time (its chunked prefill claims bit-identical results to C=1)
    "exact_chunk1": {"K3_BITS": "32", "K3_MLA_BITS": "32", "K3_HEAD_BITS": "32", "K3_IDOT": "0",
                     "K3_CHUNK": "1"},
}


def read_safetensors_f32(path: str, name: str) -> np.ndarray:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        info = header[name]
        if info["dtype"] != "F32":
            raise SystemExit(f"{path}: {name} is {info['dtype']}, expected F32")
        a, b = info["data_offsets"]
        f.seek(8 + n + a)
        return np.frombuffer(f.read(b - a), dtype="<f4").reshape(info["shape"])


def rel_l2_rows(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    g, r = got.astype(np.float64), ref.astype(np.float64)
    return np.sqrt(((g - r) ** 2).sum(axis=1) / (r ** 2).sum(axis=1))


def compare(got: np.ndarray, ref: np.ndarray) -> dict:
    e = rel_l2_rows(got, ref)
    top = (got.argmax(axis=1) == ref.argmax(axis=1))
    return {
        "max_rel_l2": float(e.max()),
        "max_rel_l2_position": int(e.argmax()),
        "mean_rel_l2": float(e.mean()),
        "top1_agreement": float(top.mean()),
        "top1_disagreements": int((~top).sum()),
    }


def leading_equal(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run(cmd: list, env: dict | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"peer_quality: {' '.join(cmd[:3])} ... failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return p


def colibri(binary: str, model: str, ids: list, vocab: int, mode_env: dict, threads: int,
            scratch: str, greedy: int) -> dict:
    env = dict(os.environ)
    for k in [k for k in env if k.startswith("K3_") or k.startswith("COLI_")]:
        del env[k]
    env.update(mode_env)
    env.update({"OMP_NUM_THREADS": str(threads), "USAGE_SAVE": "0", "AUTOPIN": "0",
                "COLI_USAGE": os.path.join(scratch, "absent.coli_usage")})
    dump = os.path.join(scratch, "logits.f32")
    idstr = " ".join(map(str, ids))
    t0 = time.time()
    run([binary, model, "--ids", idstr, "--ngen", "0"], env={**env, "K3_LOGITS": dump})
    secs = time.time() - t0
    logits = np.fromfile(dump, dtype="<f4")
    if logits.size != len(ids) * vocab:
        raise SystemExit(f"peer_quality: colibri dumped {logits.size} floats, expected {len(ids)} x {vocab}")
    os.remove(dump)
    out = {"logits": logits.reshape(len(ids), vocab), "seconds": secs}
    if greedy:
        # no tokenizer.json in the model directory: kimi_k3 prints each generated id and a space
        p = run([binary, model, "--ids", idstr, "--ngen", str(greedy)], env=env)
        text = p.stdout.split("TUNE")[0]
        out["greedy"] = [int(t) for t in text.split()]
    return out


def deltafin(binary: str, model: str, ids: list, threads: int, scratch: str, greedy: int) -> dict:
    dump = os.path.join(scratch, "deltafin.safetensors")
    csv = ",".join(map(str, ids))
    t0 = time.time()
    run([binary, "score", "--model", model, "--prompt-ids", csv, "--logits-out", dump,
         "--threads", str(threads)])
    out = {"logits": read_safetensors_f32(dump, "logits"), "seconds": time.time() - t0}
    os.remove(dump)
    if greedy:
        p = run([binary, "run", "--model", model, "--prompt-ids", csv, "--max-new", str(greedy),
                 "--format", "json", "--threads", str(threads)])
        lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
        out["greedy"] = json.loads(lines[-1])["output_ids"]
    return out


def held_out(a) -> tuple[list, np.ndarray, list | None, dict]:
    """(ids, fp64 reference logits, reference greedy ids or None, provenance)."""
    if a.text:
        sys.path.insert(0, os.path.join(REPO, "tests", "reference"))
        from k3_reference import Reference  # noqa: E402
        from perplexity import encoding  # noqa: E402
        with open(a.text, encoding="utf-8") as f:
            text = f.read()
        enc = encoding(a.model)
        with open(os.path.join(a.model, "config.json")) as f:
            bos = json.load(f)["text_config"].get("bos_token_id")
        ids = ([bos] + enc.encode_ordinary(text))[: a.window]
        t0 = time.time()
        ref = np.asarray(Reference(a.model).logits(ids), dtype=np.float64)
        src = {"text": os.path.relpath(a.text, REPO), "window": a.window,
               "reference": "tests/reference/k3_reference.py (fp64, computed here)",
               "reference_seconds": round(time.time() - t0, 1)}
        return ids, ref, None, src
    with open(os.path.join(a.fixture, "fixture.json")) as f:
        fx = json.load(f)
    ref = read_safetensors_f32(os.path.join(a.fixture, "logits.safetensors"), "reference_logits")
    src = {"fixture": os.path.relpath(a.fixture, REPO), "prompt_source": fx.get("prompt_source"),
           "reference": "reference_logits of the fixture (tests/reference/k3_reference.py, fp64, stored f32)"}
    return fx["prompt_ids"], ref, fx.get("reference_greedy"), src


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--colibri", required=True, help="colibri's kimi_k3 binary")
    ap.add_argument("--deltafin", required=True, help="deltafin binary")
    ap.add_argument("--model", default=os.path.join(REPO, "demo", "kimi-k3-demo"))
    ap.add_argument("--fixture", default=os.path.join(REPO, "tests", "fixtures", "trained"))
    ap.add_argument("--text", help="held-out text instead of the fixture (fp64 reference computed here)")
    ap.add_argument("--window", type=int, default=512, help="ids of --text to use (with BOS)")
    ap.add_argument("--greedy", type=int, default=24, help="greedy tokens generated by each engine (0: none)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES), help="colibri modes, comma-separated")
    a = ap.parse_args()
    a.model = os.path.abspath(a.model)
    for m in a.modes.split(","):
        if m not in MODES:
            raise SystemExit(f"peer_quality: unknown colibri mode {m!r} (known: {', '.join(MODES)})")
    if os.path.exists(os.path.join(a.model, "tokenizer.json")):
        raise SystemExit(f"peer_quality: {a.model} has a tokenizer.json; this harness feeds ids and parses "
                         "colibri's id output, which it prints only without one")

    ids, ref, ref_greedy, src = held_out(a)
    vocab = ref.shape[1]
    scratch = tempfile.mkdtemp(prefix="peer-quality-")
    try:
        d = deltafin(a.deltafin, a.model, ids, a.threads, scratch, a.greedy)
        rec = {"deltafin": {**compare(d["logits"], ref), "seconds": round(d["seconds"], 2)}}
        greedy_ref = ref_greedy if ref_greedy is not None else d.get("greedy")
        if a.greedy:
            rec["deltafin"]["greedy"] = d["greedy"]
            if ref_greedy is not None:
                rec["deltafin"]["greedy_leading_equal"] = leading_equal(d["greedy"], ref_greedy)
        colibri_rec = {}
        for m in a.modes.split(","):
            c = colibri(a.colibri, a.model, ids, vocab, MODES[m], a.threads, scratch, a.greedy)
            r = {"env": MODES[m], **compare(c["logits"], ref),
                 "vs_deltafin": compare(c["logits"], d["logits"]), "seconds": round(c["seconds"], 2)}
            if a.greedy:
                r["greedy"] = c["greedy"]
                if greedy_ref is not None:
                    r["greedy_leading_equal"] = leading_equal(c["greedy"], greedy_ref)
            colibri_rec[m] = r
        rec["colibri"] = colibri_rec
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out = {
        "bench": "peer_quality",
        "model": os.path.relpath(a.model, REPO) if a.model.startswith(REPO) else a.model,
        "held_out": src,
        "positions": len(ids),
        "vocab": vocab,
        "threads": a.threads,
        "tolerance_rel_l2": 1e-4,
        "reference_greedy": ref_greedy,
        "greedy_leading_equal_is_against": "reference_greedy" if ref_greedy is not None else "deltafin's greedy",
        **rec,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
