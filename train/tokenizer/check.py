#!/usr/bin/env python3
"""Checks train/tokenizer/out/ against tiktoken.

    /opt/trainenv/bin/python train/tokenizer/check.py

(a) the trainer's own encoding (bpe.encode: K3's split + tiktoken's merge loop, in Python) equals
    tiktoken's encode_ordinary on the whole held-out text and on every train document;
(b) decode(encode(x)) == x on both;
(c) the files have K3's shipped form: ranks 0..n_base-1 without gaps, ranks 0..255 the bytes in
    order, no duplicate tokens, every merged token reachable by tiktoken's own merges, the config
    equal to k3_tokenizer_config(n_base), the chat template K3's, specials only when allowed;
and reports bytes per token on train and held-out. Exit status 1 on any failure.
"""

import base64
import json
import sys
import time

import bpe


def main():
    t0 = time.time()
    enc, ranks = bpe.tiktoken_encoding()
    n_base = len(ranks)
    fails = []

    def check(ok, what):
        print(f"  {'ok  ' if ok else 'FAIL'} {what}", flush=True)
        if not ok:
            fails.append(what)

    print(f"tokenizer: {bpe.OUT} (n_base {n_base}, vocab {enc.n_vocab})")
    lines = (bpe.OUT / "tiktoken.model").read_text().splitlines()
    check([int(l.split()[1]) for l in lines] == list(range(n_base)), "rank file: ranks 0..n_base-1 in order")
    check(all(base64.b64decode(lines[b].split()[0]) == bytes([b]) for b in range(256)), "ranks 0..255 are bytes 0..255")
    check(len(ranks) == len(lines), "no duplicate token bytes")
    # Every multi-byte token must be what tiktoken makes of its own bytes with the lower ranks plus itself.
    lower = {}
    unreachable = 0
    for t, r in sorted(ranks.items(), key=lambda kv: kv[1]):
        if r >= 256 and len(bpe.settle([bytes([b]) for b in t], lower)) != 2:
            unreachable += 1
        lower[t] = r
    check(unreachable == 0, f"every merged token is the merge of two lower-ranked tokens ({unreachable} are not)")
    cfg = json.loads((bpe.OUT / "tokenizer_config.json").read_text())
    check(cfg == bpe.tokenizer_config(n_base), "tokenizer_config.json == k3_tokenizer_config(n_base)")
    check(list(cfg) == list(bpe.tokenizer_config(n_base)), "tokenizer_config.json keys in K3's order")
    tmpl = bpe.REPO / "tests" / "chat" / "k3_chat_template.jinja"
    check((bpe.OUT / "chat_template.jinja").read_bytes() == tmpl.read_bytes(), "chat_template.jinja is K3's")
    check(enc.encode("[BOS]x[EOS]", allowed_special="all") == [n_base, ranks[b"x"], n_base + 1],
          "[BOS] = n_base, [EOS] = n_base + 1 when specials are allowed")
    check(n_base not in enc.encode_ordinary("[BOS]<|end_of_msg|>[EOS]"), "encode_ordinary never makes specials")
    check(enc.encode_single_token("[MASK]") == n_base + 253 and enc.encode_single_token("[PAD]") == n_base + 255,
          "[MASK] = n_base + 253, [PAD] = n_base + 255")

    held = (bpe.DATA / "heldout.txt").read_text(encoding="utf-8")
    cache = {}
    mine = bpe.encode(held, ranks, cache)
    theirs = enc.encode_ordinary(held)
    first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
    check(mine == theirs, f"held-out text: trainer's encoding == tiktoken's ({len(theirs):,} tokens"
          + (f"; first difference at token {first}" if first is not None else "") + ")")
    check(enc.decode_bytes(theirs) == held.encode("utf-8") and enc.decode(theirs) == held,
          "held-out text: decode(encode(x)) == x")
    held_bytes = len(held.encode("utf-8"))

    n_docs = train_tokens = train_bytes = mismatched = not_round = 0
    with open(bpe.DATA / "train.jsonl", encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            ids = enc.encode_ordinary(text)
            if bpe.encode(text, ranks, cache) != ids:
                mismatched += 1
            if enc.decode(ids) != text:
                not_round += 1
            n_docs += 1
            train_tokens += len(ids)
            train_bytes += len(text.encode("utf-8"))
    check(mismatched == 0, f"train documents: trainer's encoding == tiktoken's ({n_docs - mismatched}/{n_docs})")
    check(not_round == 0, f"train documents: decode(encode(x)) == x ({n_docs - not_round}/{n_docs})")

    used = len(set(theirs))
    print(f"bytes per token: held-out {held_bytes / len(theirs):.3f} ({held_bytes:,} bytes, {len(theirs):,} tokens), "
          f"train {train_bytes / train_tokens:.3f} ({train_bytes:,} bytes, {train_tokens:,} tokens; "
          f"documents without BOS/EOS); {used} of {n_base} base tokens occur in the held-out text")
    print(f"{'FAILED: ' + '; '.join(fails) if fails else 'all checks passed'} ({time.time() - t0:.0f} s)")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
