"""Perplexity of a text under a K3-layout model, independently of deltafin: token ids from the
Python `tiktoken` library (Kimi's split pattern, ordinary-text encoding) and logits from the fp64
reference (k3_reference.py), with the definition `deltafin score --text` documents
(src/tools/perplexity.rs) and the demo's training code uses:

    ids = [BOS] + encode(text); windows s = 0, W, 2W, ... while s < N - 1, each a fresh sequence
    feeding ids[s:e], e = min(s + W, N - 1), predicting ids[s + 1:e + 1];
    nll = -sum log_softmax(logits)[target]; ppl = exp(nll / tokens);
    bits_per_byte = nll / ln 2 / len(text.encode("utf-8"))

    python3 perplexity.py MODEL_DIR TEXT_FILE WINDOW > JSON
"""

import base64
import json
import math
import os
import sys

import numpy as np
import tiktoken

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tokenizer"))
from k3_reference import Reference  # noqa: E402
from kimi_tiktoken_ids import PAT_STR  # noqa: E402


def encoding(model_dir):
    ranks = {}
    with open(os.path.join(model_dir, "tiktoken.model"), "rb") as f:
        for line in f:
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    n = len(ranks)
    with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
        named = {int(k): v["content"] for k, v in json.load(f).get("added_tokens_decoder", {}).items()}
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + 256)}
    return tiktoken.Encoding(name="k3-ppl", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=specials)


def main():
    model_dir, text_path, window = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(text_path, encoding="utf-8") as f:
        text = f.read()
    enc = encoding(model_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        bos = json.load(f)["text_config"].get("bos_token_id")
    if bos is None:
        bos = enc.encode_single_token("[BOS]")
    ids = [bos] + enc.encode_ordinary(text)
    n = len(ids)
    ref = Reference(model_dir)
    nll, tokens, windows = 0.0, 0, 0
    s = 0
    while s < n - 1:
        e = min(s + window, n - 1)
        logits = ref.logits(ids[s:e])
        for row, target in enumerate(ids[s + 1:e + 1]):
            x = logits[row]
            m = np.max(x)
            nll += float(m + math.log(np.sum(np.exp(x - m))) - x[target])
        tokens += e - s
        windows += 1
        s += window
    json.dump({"ppl": math.exp(nll / tokens), "bits_per_byte": nll / math.log(2) / len(text.encode("utf-8")),
               "tokens": tokens, "nll": nll, "windows": windows, "ids": ids}, sys.stdout)


if __name__ == "__main__":
    main()
