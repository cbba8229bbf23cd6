#!/usr/bin/env bash
# The cost of the forward's check for NaN and infinity (issue 41: every layer's outputs and the
# logits, k3/finite.rs) in paired runs of two deltafin binaries, interleaved A B A B ... so machine
# noise hits both alike. Run it on a quiet machine:
#   bench/finite_ab.sh BIN_A BIN_B [ROUNDS]      (A: without the check, e.g. main e08e404; B: with it)
# Workloads, all warm (experts cached after the first pass): the fixture k3-tiny-b decoding 256
# tokens; the demo model (hidden 256, 9 layers) decoding 256 tokens and prefilling ~1,000; a
# synth of K3's width (hidden 7168, vocab 16384, 6 layers, 16 experts; ~0.6 GB, written once under
# $TMPDIR) decoding 32 tokens and prefilling 512, where the check's share of a step is largest.
# Prints one JSON record per run, then per workload the median tok/s of each side and B/A.
set -euo pipefail
cd "$(dirname "$0")/.."
a=$1; b=$2; rounds=${3:-5}
tmp=${TMPDIR:-/tmp}/deltafin-finite-ab
mkdir -p "$tmp"
wide=$tmp/wide-7168
[ -f "$wide/config.json" ] || "$b" synth --out "$wide" --hidden 7168 --vocab 16384 --layers 6 --experts 16 \
  --top-k 4 --seed 3 >&2
fixture=tests/fixtures/k3-tiny-b
fx_prompt=$(python3 -c "import json;print(','.join(map(str,json.load(open('$fixture/reference.json'))['prompt_ids'])))")
python3 -c "print(' '.join(['The drives read the experts and the trunk stays in memory.'] * 90))" > "$tmp/long.txt"
wide_prompt=$(python3 -c "print(','.join(str(1 + i % 1000) for i in range(512)))")
out=$tmp/records.jsonl
: > "$out"
one() { # side binary workload args...
  local side=$1 bin=$2 what=$3; shift 3
  local json
  json=$("$bin" run "$@" --ignore-eos --format json -q 2>/dev/null)
  python3 - "$side" "$bin" "$what" "$json" <<'PY' | tee -a "$out"
import json, sys
side, binary, what, j = sys.argv[1:]
s = json.loads(j)["stats"]
print(json.dumps({"bench": "finite_ab", "side": side, "binary": binary, "workload": what,
  "decode_tok_s": s["decode_tok_s"], "prefill_tok_s": s["prefill_tok_s"]}))
PY
}
for r in $(seq "$rounds"); do
  for side in A B; do
    bin=$a; [ "$side" = B ] && bin=$b
    one "$side" "$bin" fixture_decode --model "$fixture" --prompt-ids "$fx_prompt" --max-new 256
    one "$side" "$bin" demo_decode --demo --prompt "Once upon a time" --max-new 256
    one "$side" "$bin" demo_prefill --demo --prompt-file "$tmp/long.txt" --max-new 1
    one "$side" "$bin" wide_decode --model "$wide" --prompt-ids 1,2,3,4 --max-new 32
    one "$side" "$bin" wide_prefill --model "$wide" --prompt-ids "$wide_prompt" --max-new 1
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
for w in dict.fromkeys(r["workload"] for r in recs):
    key = "prefill_tok_s" if w.endswith("prefill") else "decode_tok_s"
    med = {s: statistics.median(r[key] for r in recs if r["workload"] == w and r["side"] == s) for s in "AB"}
    print(json.dumps({"bench": "finite_ab_summary", "workload": w, "metric": key, "A": round(med["A"], 3),
                      "B": round(med["B"], 3), "B_over_A": round(med["B"] / med["A"], 4)}))
PY
