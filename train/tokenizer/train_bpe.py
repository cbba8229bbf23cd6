#!/usr/bin/env python3
"""Learns deltafin's small K3 tokenizer: byte-level BPE over K3's split pattern, from the train split
only, deterministic, written in K3's shipped form.

    /opt/trainenv/bin/python train/tokenizer/train_bpe.py [--merges 4096]

Reads train/data/train.jsonl (train/corpus/build.py); writes train/tokenizer/out/:
    tiktoken.model          base64(token bytes) rank, ranks 0..255 = bytes 0..255, then the merges
    tokenizer_config.json   k3_tokenizer_config(n_base) of src/model/tokenizer.rs (256 specials after n_base)
    chat_template.jinja     K3's published template (a copy of tests/chat/k3_chat_template.jinja)

The trainer learns in tiktoken's own terms, so that tiktoken's lowest-rank-first encoding of the
rank file is exactly the encoding the statistics were counted on: every word (a piece of the split,
counted over all train documents) is held in its tiktoken encoding under the ranks so far; each
step adds, at the next rank, the byte string that is the concatenation of the most frequent
adjacent token pair (summed over words; ties: the smallest byte string), then re-encodes the words
that contained it with tiktoken's merge loop (and a word that now is a token whole, as tiktoken
takes such a piece whole). Pure Python plus `regex`; about a minute or two here.
"""

import argparse
import heapq
import json
import shutil
import sys
import time
from collections import Counter

import bpe


def count_pieces(path):
    pieces = Counter()
    n_docs = n_bytes = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            pieces.update(bpe.SPLIT.findall(text))
            n_docs += 1
            n_bytes += len(text.encode("utf-8"))
    words = Counter()
    for p, c in pieces.items():
        words[p.encode("utf-8")] += c
    return words, n_docs, n_bytes


def pair_keys(parts):
    return [parts[i] + parts[i + 1] for i in range(len(parts) - 1)]


def learn(words, n_merges, log_every=256):
    ranks = {bytes([b]): b for b in range(256)}
    merges = []
    items = sorted(words.items())  # deterministic word order
    parts = [[bytes([b]) for b in w] for w, _ in items]
    freq = [c for _, c in items]
    whole = {w: i for i, (w, _) in enumerate(items)}
    counts, where = Counter(), {}
    for i, ps in enumerate(parts):
        for k in pair_keys(ps):
            counts[k] += freq[i]
            where.setdefault(k, set()).add(i)
    heap = [(-c, k) for k, c in counts.items()]
    heapq.heapify(heap)
    t0 = time.time()
    while len(merges) < n_merges:
        while heap:
            negc, key = heapq.heappop(heap)
            if counts.get(key, 0) == -negc and negc < 0:
                break
        else:
            raise SystemExit(f"error: the train text ran out of pairs after {len(merges)} merges")
        ranks[key] = 256 + len(merges)
        merges.append((key, -negc))
        affected = where.pop(key, set())
        if key in whole:
            affected.add(whole[key])
        changed = set()
        for i in affected:
            old = parts[i]
            new = [key] if items[i][0] == key else bpe.settle(list(old), ranks)
            parts[i] = new
            f = freq[i]
            ok, nk = pair_keys(old), pair_keys(new)
            for k in ok:
                counts[k] -= f
            for k in nk:
                counts[k] += f
            changed.update(ok)
            changed.update(nk)
            so, sn = set(ok), set(nk)
            for k in so - sn:
                s = where.get(k)
                if s is not None:
                    s.discard(i)
            for k in sn - so:
                where.setdefault(k, set()).add(i)
        counts.pop(key, None)
        for k in changed:
            c = counts.get(k, 0)
            if c > 0 and k != key:
                heapq.heappush(heap, (-c, k))
            elif c <= 0:
                counts.pop(k, None)
                where.pop(k, None)
        if len(merges) % log_every == 0 or len(merges) == n_merges:
            print(f"  merge {len(merges):5d}/{n_merges}: {key!r} x{-negc}  ({time.time() - t0:.0f} s)", flush=True)
    encoded = {items[i][0]: parts[i] for i in range(len(items))}
    return ranks, merges, encoded


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--merges", type=int, default=4096)
    ap.add_argument("--train", default=str(bpe.DATA / "train.jsonl"))
    ap.add_argument("--out", default=str(bpe.OUT))
    args = ap.parse_args()
    t0 = time.time()
    print(f"counting pieces of {args.train} (K3 split pattern)", flush=True)
    words, n_docs, n_bytes = count_pieces(args.train)
    print(f"  {n_docs} documents, {n_bytes:,} bytes, {sum(words.values()):,} pieces, {len(words):,} distinct "
          f"({time.time() - t0:.0f} s)", flush=True)
    print(f"learning {args.merges} merges", flush=True)
    ranks, merges, encoded = learn(words, args.merges)
    n_base = len(ranks)
    n_tokens = sum(len(encoded[w]) * c for w, c in words.items())
    print(f"  {n_base} base tokens; train split: {n_tokens:,} tokens, {n_bytes / n_tokens:.3f} bytes/token "
          "(documents without BOS/EOS)", flush=True)

    out = bpe.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import base64

    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    assert [r for _, r in by_rank] == list(range(n_base))
    assert all(by_rank[b][0] == bytes([b]) for b in range(256))
    (out / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in by_rank))
    # serde_json::to_string_pretty's layout (2-space indent, no final newline), as synth writes it.
    (out / "tokenizer_config.json").write_text(json.dumps(bpe.tokenizer_config(n_base), indent=2))
    shutil.copyfile(bpe.REPO / "tests" / "chat" / "k3_chat_template.jinja", out / "chat_template.jinja")
    print(f"wrote {out}/tiktoken.model ({n_base} ranks), tokenizer_config.json (vocab {n_base + bpe.NUM_SPECIALS}), "
          f"chat_template.jinja in {time.time() - t0:.0f} s")
    longest = sorted((t for t, _ in by_rank[256:]), key=len, reverse=True)[:12]
    print("  longest tokens:", [t.decode("utf-8", "replace") for t in longest])
    print("  first merges:", [m.decode("utf-8", "replace") for m, _ in merges[:24]])


if __name__ == "__main__":
    sys.exit(main())
