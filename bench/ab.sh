#!/usr/bin/env bash
# Before/after comparison of two deltafin binaries in one run, interleaved (A B A B ...) so that
# machine noise hits both alike. Prints one JSON record per measurement:
#   bench/ab.sh BIN_A BIN_B SYNTH_MODEL_DIR [ROUNDS]
# Measures: fixture decode (run on k3-tiny-b, 256 tokens), `bench kernels`, and a cold
# `bench run --prompt-tokens 128 --decode 8 --expert-cache-gb 0` on SYNTH_MODEL_DIR (root drops
# the page cache before each cold run; on macOS bench/cold.sh purges it, or the record says
# "cold": false).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/cold.sh
a=$1; b=$2; model=$3; rounds=${4:-2}
dir=tests/fixtures/k3-tiny-b
prompt=$(python3 -c "import json;print(','.join(map(str,json.load(open('$dir/reference.json'))['prompt_ids'])))")
for r in $(seq "$rounds"); do
  for side in A B; do
    bin=$a; [ "$side" = B ] && bin=$b
    fx=$("$bin" run --model "$dir" --prompt-ids "$prompt" --max-new 256 --ignore-eos --format json -q)
    kern=$("$bin" bench kernels 2>/dev/null | tail -n 1)
    # shellcheck disable=SC2046 # cold_flags prints zero or one flag
    cold=$("$bin" bench run --model "$model" --prompt-tokens 128 --decode 8 --expert-cache-gb 0 $(cold_flags) 2>/dev/null | tail -n 1)
    python3 - "$side" "$bin" "$r" "$fx" "$kern" "$cold" <<'PY'
import json, sys
side, binary, rnd, fx, kern, cold = sys.argv[1:]
fx, kern, cold = json.loads(fx), json.loads(kern), json.loads(cold)
print(json.dumps({"bench": "ab", "side": side, "binary": binary, "round": int(rnd),
  "fixture_decode_tok_s": fx["stats"]["decode_tok_s"], "fixture_prefill_tok_s": fx["stats"]["prefill_tok_s"],
  "kernels": {k: v for k, v in kern.items() if k not in ("machine", "command", "date", "git", "bench")},
  "cold": cold.get("cold"), "cold_ttft_s": cold["ttft_s"], "cold_decode_tok_s": cold["decode"]["decode_tok_s"],
  "cold_read_amplification": cold["prefill"]["read_amplification"], "git": cold.get("git")}))
PY
  done
done
