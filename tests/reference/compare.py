"""`deltafin score --compare` independently of deltafin: token ids from Python's `tiktoken`
(perplexity.py's encoding), logits of both models from the fp64 reference (k3_reference.py), and
llama.cpp's `llama-perplexity --kl-divergence` statistics as src/tools/compare.rs defines them:

    per predicted token (the windows of `score --text`): lp_b, lp = log_softmax of the base's and
    the judged model's logits; kl = sum exp(lp_b) * (lp_b - lp); same top = argmax equal (first max);
    kl_mean, kl_median, kl_p99 (numpy's linear percentiles), kl_max, top1_agreement,
    ppl = exp(mean -lp[target]), ppl_base likewise, nll_delta = mean(nll - nll_base)

    python3 compare.py JUDGED_DIR BASE_DIR TEXT_FILE WINDOW > JSON
"""

import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from k3_reference import Reference  # noqa: E402
from perplexity import encoding  # noqa: E402


def log_softmax(x):
    m = np.max(x)
    return x - (m + np.log(np.sum(np.exp(x - m))))


def main():
    judged_dir, base_dir, text_path, window = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    with open(text_path, encoding="utf-8") as f:
        text = f.read()
    enc = encoding(judged_dir)
    with open(os.path.join(judged_dir, "config.json")) as f:
        bos = json.load(f)["text_config"].get("bos_token_id")
    if bos is None:
        bos = enc.encode_single_token("[BOS]")
    ids = [bos] + enc.encode_ordinary(text)
    n = len(ids)
    judged, base = Reference(judged_dir), Reference(base_dir)
    kl, nll, nll_base, same = [], [], [], []
    s = 0
    while s < n - 1:
        e = min(s + window, n - 1)
        lj, lb = judged.logits(ids[s:e]), base.logits(ids[s:e])
        for row, target in enumerate(ids[s + 1:e + 1]):
            pj, pb = log_softmax(np.asarray(lj[row], np.float64)), log_softmax(np.asarray(lb[row], np.float64))
            kl.append(float(np.sum(np.exp(pb) * (pb - pj))))
            nll.append(-float(pj[target]))
            nll_base.append(-float(pb[target]))
            same.append(int(np.argmax(pj)) == int(np.argmax(pb)))
        s += window
    kl = np.array(kl)
    json.dump({
        "kl_mean": float(np.mean(kl)),
        "kl_median": float(np.percentile(kl, 50)),
        "kl_p99": float(np.percentile(kl, 99)),
        "kl_max": float(np.max(kl)),
        "top1_agreement": sum(same) / len(same),
        "ppl": float(np.exp(np.mean(nll))),
        "ppl_base": float(np.exp(np.mean(nll_base))),
        "nll_delta": float(np.mean(np.array(nll) - np.array(nll_base))),
        "tokens": len(kl),
    }, sys.stdout)


if __name__ == "__main__":
    main()
