#!/usr/bin/env python3
"""Writes bench/data/heldout-windows.jsonl: prose windows from the corpus's held-out split
(train/data/heldout.jsonl, built by train/corpus/build.py), for bench/drafts.py.

    python3 bench/data/make_heldout_windows.py [--per-source 6] [--chars 320]

Per source, `--per-source` windows: the held-out documents taken in turn, each window starting
at the first sentence start after an evenly spaced offset inside its document (never the
document's opening, which bench/data/heldout-prompts.jsonl already covers), about `--chars`
characters cut at a word boundary. Deterministic; stdlib only. One JSON object a line:
{"source", "doc", "offset", "text"}.
"""

import argparse
import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heldout", default=os.path.join(ROOT, "train/data/heldout.jsonl"))
    p.add_argument("--out", default=os.path.join(ROOT, "bench/data/heldout-windows.jsonl"))
    p.add_argument("--per-source", type=int, default=6)
    p.add_argument("--chars", type=int, default=320)
    a = p.parse_args()
    docs = {}
    for line in open(a.heldout, encoding="utf-8"):
        d = json.loads(line)
        docs.setdefault(d["source"], []).append(d)
    out = []
    for src in sorted(docs):
        ds = docs[src]
        for w in range(a.per_source):
            d = ds[w % len(ds)]
            text = d["text"]
            # The (w // len(ds) + 1)-th of evenly spaced offsets of this document.
            k = w // len(ds) + 1
            n = -(-a.per_source // len(ds)) + 1
            off = len(text) * k // (n + 1)
            m = re.compile(r"(?<=[.!?;:])[\"')\]]*\s+(?=[A-Z\"'(])|\n+").search(text, off)
            start = m.end() if m else off
            piece = text[start:start + a.chars + 40]
            cut = piece.rfind(" ", 0, a.chars) if len(piece) > a.chars else len(piece)
            out.append({"source": src, "doc": d["id"], "offset": start, "text": piece[:cut].strip()})
    with open(a.out, "w", encoding="utf-8") as f:
        for o in out:
            f.write(json.dumps(o, ensure_ascii=False) + "\n")
    print(f"wrote {a.out}: {len(out)} windows from {len(docs)} sources")


if __name__ == "__main__":
    main()
