#!/usr/bin/env python3
"""Encodes the corpus splits into token streams for training.

    /opt/trainenv/bin/python train/tokenizer/encode_corpus.py

Reads train/data/{train,heldout}.jsonl and train/tokenizer/out/; writes train/data/train.bin and
train/data/heldout.bin: little-endian uint16 token ids, each document as [BOS] + ids + [EOS]
(BOS = n_base, EOS = n_base + 1; the text through tiktoken's encode_ordinary with K3's pattern, so
text never makes special tokens), documents concatenated in file order; and train/data/tokens.json
with the counts and sha256 of both files. Two tokenizer threads at most.
"""

import hashlib
import json
import sys
import time
from collections import defaultdict

import numpy as np

import bpe


def main():
    t0 = time.time()
    enc, ranks = bpe.tiktoken_encoding()
    n_base = len(ranks)
    bos, eos = n_base, n_base + 1
    assert enc.n_vocab <= 1 << 16
    report = {"tokenizer": {"n_base": n_base, "vocab": enc.n_vocab, "bos": bos, "eos": eos,
                            "tiktoken_model_sha256": hashlib.sha256((bpe.OUT / "tiktoken.model").read_bytes()).hexdigest()},
              "format": "little-endian uint16; each document [BOS] + encode_ordinary(text) + [EOS], in file order",
              "splits": {}}
    for split in ("train", "heldout"):
        with open(bpe.DATA / f"{split}.jsonl", encoding="utf-8") as f:
            docs = [json.loads(line) for line in f]
        ids = enc.encode_ordinary_batch([d["text"] for d in docs], num_threads=2)
        per_source = defaultdict(lambda: {"documents": 0, "bytes": 0, "tokens": 0})
        stream = []
        for d, toks in zip(docs, ids):
            stream.append(np.array([bos] + toks + [eos], dtype="<u2"))
            s = per_source[d["source"]]
            s["documents"] += 1
            s["bytes"] += len(d["text"].encode("utf-8"))
            s["tokens"] += len(toks)
        arr = np.concatenate(stream)
        path = bpe.DATA / f"{split}.bin"
        tmp = path.with_suffix(".bin.tmp")
        arr.tofile(tmp)
        tmp.replace(path)
        text_tokens = sum(s["tokens"] for s in per_source.values())
        text_bytes = sum(s["bytes"] for s in per_source.values())
        for s in per_source.values():
            s["bytes_per_token"] = round(s["bytes"] / s["tokens"], 4)
        report["splits"][split] = {
            "file": f"train/data/{split}.bin",
            "documents": len(docs),
            "tokens": int(arr.size),
            "text_tokens": text_tokens,
            "text_bytes": text_bytes,
            "bytes_per_token": round(text_bytes / text_tokens, 4),
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "per_source": dict(per_source),
        }
        print(f"{split}: {len(docs)} documents, {arr.size:,} tokens with BOS/EOS ({text_tokens:,} text tokens, "
              f"{text_bytes / text_tokens:.3f} bytes/token) -> {path} ({path.stat().st_size:,} bytes)", flush=True)
    (bpe.DATA / "tokens.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {bpe.DATA / 'tokens.json'} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
