#!/usr/bin/env bash
# The trunk encodings measured (issue 30): the coded trunk's size and what an entropy code would
# take (pack-trunk); decode and prefill time under bf16 and coded interleaved in one run (bench
# run: bf16, coded, bf16, coded, ... so the noise of a shared machine falls on both; the summary
# gives the median of the per-round ratios); int8's and coded's score --compare figures against
# bf16 on held-out text (bench/data/heldout-prompts.jsonl's texts; train/data/heldout.txt when
# train/corpus/build.py has produced it). On the trained demo model, and with K3SYNTH=DIR also on
# a K3-shaped synth (K3's trunk widths, 3 layers) whose trunk values are drawn from the trained
# model's (`synth --trunk-values-from demo`).
#   bash bench/trunk.sh [ROUNDS]                  (results in bench/results/<date>-trunk/)
#   K3SYNTH=/tmp/k3t bash bench/trunk.sh [ROUNDS]
#   BACKEND=gpu ... also passes --backend gpu to bench run (int8 is CPU only and is skipped)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-7}
BIN=${BIN:-target/release/deltafin}
OUT=${OUT:-bench/results/$(date -u +%F)-trunk}
BACKEND=${BACKEND:-cpu}
mkdir -p "$OUT"
export DELTAFIN_CACHE=${DELTAFIN_CACHE:-$(mktemp -d)}
"$BIN" run --demo --prompt-ids 1 --max-new 1 >/dev/null 2>&1
DEMO="$DELTAFIN_CACHE/demo-v2"
"$BIN" pack-trunk --model "$DEMO" --json | tee "$OUT/pack-demo.json"
if [ "$BACKEND" = cpu ]; then
  TEXT="$OUT/heldout.txt"
  if [ -f train/data/heldout.txt ]; then
    cp train/data/heldout.txt "$TEXT"
  else
    python3 -c 'import json,sys; print("\n\n".join(json.loads(l)["text"] for l in open("bench/data/heldout-prompts.jsonl") if l.strip()))' > "$TEXT"
  fi
  for t in coded int8; do
    "$BIN" score --model "$DEMO" --text "$TEXT" --trunk "$t" --compare bf16 --format json | tee "$OUT/compare-$t.json"
  done
fi
# bench MODEL TAG ARGS...: ROUNDS rounds of bf16 then coded.
bench() {
  local model=$1 tag=$2
  shift 2
  for r in $(seq "$ROUNDS"); do
    for t in bf16 coded; do
      "$BIN" bench run --model "$model" --trunk "$t" --backend "$BACKEND" --ceiling-seconds 0 --expert-heat off \
        "$@" --out "$OUT/bench-run-$tag-$BACKEND.jsonl" > /dev/null
    done
  done
}
bench "$DEMO" demo --prompt-tokens 256 --decode 32
if [ -n "${K3SYNTH:-}" ]; then
  [ -f "$K3SYNTH/config.json" ] || "$BIN" synth --out "$K3SYNTH" --preset k3-experts --layers 3 --experts 8 --top-k 2 \
    --kda-heads 96 --mla-heads 96 --trunk-values-from demo
  "$BIN" pack-trunk --model "$K3SYNTH" --json | tee "$OUT/pack-k3-synth.json"
  bench "$K3SYNTH" k3-synth --prompt-tokens 64 --decode 16
fi
python3 - "$OUT"/bench-run-*-"$BACKEND".jsonl <<'PY' | tee "$OUT/summary-$BACKEND.txt"
import json, sys, statistics as st
for path in sys.argv[1:]:
    rows = [json.loads(l) for l in open(path) if l.strip()]
    # Pair each bf16 run with the coded run after it (one round).
    pairs = [(a, b) for a, b in zip(rows, rows[1:])
             if a["engine_config"]["trunk"] == "bf16" and b["engine_config"]["trunk"] == "coded"]
    if not pairs:
        continue
    d = lambda r: r["decode"]["seconds_per_token"]
    p = lambda r: r["ttft_s"]
    same = all(a["output_ids"] == b["output_ids"] for a, b in pairs)
    print(f"{path}: {len(pairs)} rounds, output ids identical: {same}")
    print(f"  decode s/token bf16 median {st.median(d(a) for a, _ in pairs):.5f}, coded {st.median(d(b) for _, b in pairs):.5f}")
    print(f"  ttft s bf16 median {st.median(p(a) for a, _ in pairs):.4f}, coded {st.median(p(b) for _, b in pairs):.4f}")
    rd = [d(b) / d(a) for a, b in pairs]
    rp = [p(b) / p(a) for a, b in pairs]
    print(f"  decode coded/bf16 per round {', '.join(f'{x:.3f}' for x in rd)}: median {st.median(rd):.3f}")
    print(f"  prefill coded/bf16 per round {', '.join(f'{x:.3f}' for x in rp)}: median {st.median(rp):.3f}")
PY
