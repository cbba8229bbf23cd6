#!/usr/bin/env bash
# What checking every expert byte costs in decode tok/s (issue 41: target <= 2%). Two binaries,
# interleaved A B A B ... so machine noise hits both alike: A = a build without read-path checks
# (main before issue 41), B = a build with them. On a synthetic model with real K3 expert sizes
# (17.55 MB experts), three cases:
#   store-nocache  `run --expert-cache-gb 0`: every routed expert is read and checked every step
#                  (the worst case for the store: nothing is verified once and kept)
#   store-cache    the default cache: experts checked when first read, then served from memory
#   mmap           `--experts-from mmap`: every use read through the page cache and checked
# One JSON record per run, then one summary line per case: the median over rounds of B/A decode
# tok/s (1.00 = free; 0.98 = 2% slower).
#   bench/verify_cost.sh BIN_A BIN_B [WORKDIR] [ROUNDS]     (defaults: /tmp/deltafin-verify-cost 5)
# Run it on a quiet machine; the model (~2 GB) is written once into WORKDIR by BIN_B's synth.
# LAYERS, EXPERTS (the model's, defaults 4 and 32) and TOKENS (decoded per run, default 24) may be
# set in the environment (a quick check of the script: LAYERS=3 EXPERTS=4 TOKENS=2).
set -euo pipefail
cd "$(dirname "$0")/.."
a=$1; b=$2; work=${3:-/tmp/deltafin-verify-cost}; rounds=${4:-5}
mkdir -p "$work"
layers=${LAYERS:-4}; experts=${EXPERTS:-32}; tokens=${TOKENS:-24}
model=$work/k3-experts-$layers-$experts
[ -f "$model/config.json" ] || "$b" synth --out "$model" --preset k3-experts --layers "$layers" --experts "$experts" --top-k "$((experts < 16 ? experts : 16))" --seed 41 >&2
prompt=$(seq -s, 1 16)
out=$work/records.jsonl
: > "$out"
# One warm-up of each (page cache, checksum records), not counted.
for bin in "$a" "$b"; do "$bin" run --model "$model" --prompt-ids "$prompt" --max-new 2 -q > /dev/null; done
for r in $(seq "$rounds"); do
  for case in store-nocache store-cache mmap; do
    case $case in
      store-nocache) extra=(--expert-cache-gb 0) ;;
      store-cache) extra=() ;;
      mmap) extra=(--experts-from mmap) ;;
    esac
    for side in A B; do
      bin=$a; [ "$side" = B ] && bin=$b
      j=$("$bin" run --model "$model" --prompt-ids "$prompt" --max-new "$tokens" --ignore-eos --format json -q "${extra[@]}")
      python3 - "$side" "$bin" "$r" "$case" "$j" <<'PY' | tee -a "$out"
import json, sys
side, binary, rnd, case, j = sys.argv[1:]
j = json.loads(j)
print(json.dumps({"bench": "verify_cost", "case": case, "side": side, "binary": binary, "round": int(rnd),
  "decode_tok_s": j["stats"]["decode_tok_s"], "prefill_tok_s": j["stats"]["prefill_tok_s"],
  "output_ids": j.get("output_ids")}))
PY
    done
  done
done
python3 - "$out" <<'PY'
import json, sys, statistics
rs = [json.loads(l) for l in open(sys.argv[1])]
for case in ("store-nocache", "store-cache", "mmap"):
    by = {}
    for r in rs:
        if r["case"] == case:
            by.setdefault(r["round"], {})[r["side"]] = r
    pairs = [v for v in by.values() if "A" in v and "B" in v]
    ratios = [v["B"]["decode_tok_s"] / v["A"]["decode_tok_s"] for v in pairs]
    same = all(v["A"]["output_ids"] == v["B"]["output_ids"] for v in pairs)
    print(json.dumps({"bench": "verify_cost_summary", "case": case, "rounds": len(ratios),
      "decode_ratio_b_over_a_median": statistics.median(ratios) if ratios else None,
      "decode_ratio_min": min(ratios, default=None), "decode_ratio_max": max(ratios, default=None),
      "a_decode_tok_s_median": statistics.median(v["A"]["decode_tok_s"] for v in pairs) if pairs else None,
      "b_decode_tok_s_median": statistics.median(v["B"]["decode_tok_s"] for v in pairs) if pairs else None,
      "same_output": same}))
PY
