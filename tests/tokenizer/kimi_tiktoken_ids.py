"""Reference token ids from the Python `tiktoken` library (PyPI), encoding the way Kimi's published
`tokenization_kimi.py` does: its split pattern, 400,000-character chunks, runs of more than 25,000
whitespace / non-whitespace characters cut, special-token strings treated as plain text.

    python3 kimi_tiktoken_ids.py TIKTOKEN_MODEL TOKENIZER_CONFIG CORPUS_JSON > IDS_JSON
"""

import base64
import json
import sys

import tiktoken

# Kimi's pat_str, alternatives in the published order.
PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
MAX_CHARS = 400_000
MAX_RUN = 25_000


def cut_runs(s, limit):
    """Slices of s, cut whenever a run of whitespace or non-whitespace grows past `limit`."""
    pieces, start, run, kind = [], 0, 0, (s[0].isspace() if s else False)
    for i, ch in enumerate(s):
        sp = ch.isspace()
        if sp != kind:
            kind, run = sp, 1
        else:
            run += 1
            if run > limit:
                pieces.append(s[start:i])
                start, run = i, 1
    pieces.append(s[start:])
    return pieces


def main():
    rank_path, config_path, corpus_path = sys.argv[1:4]
    ranks = {}
    with open(rank_path, "rb") as f:
        for line in f:
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    n = len(ranks)
    with open(config_path) as f:
        named = {int(k): v["content"] for k, v in json.load(f).get("added_tokens_decoder", {}).items()}
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + 256)}
    enc = tiktoken.Encoding(name="k3-test", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=specials)
    with open(corpus_path, encoding="utf-8") as f:
        corpus = json.load(f)
    out = []
    for text in corpus:
        ids = []
        for i in range(0, len(text), MAX_CHARS):
            for piece in cut_runs(text[i:i + MAX_CHARS], MAX_RUN):
                ids.extend(enc.encode(piece, disallowed_special=()))
        out.append(ids)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
