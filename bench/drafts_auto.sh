#!/usr/bin/env bash
# Issue 52's measurements: drafts off against auto / ngram / dspark, paired per window (bench/drafts.py),
# in three cases, each a record appended to OUT (JSON lines):
#   read-bound: a K3-shaped synth (real 17.55 MB experts, 3 MoE layers x 64, 3.4 GB) in a 1 GiB memory
#               cgroup, cold (page cache dropped before every run), random prompt ids, greedy and T=0.7,
#               a random-weight synth DSpark drafter;
#   resident:   the demo model and its DSpark drafter on the held-out prose windows, greedy and T=0.7;
#   repetitive: the demo on bench/data/repetitive-windows.jsonl (a paragraph repeated, a quoted
#               passage copied out again, code, a numbered list), greedy and T=0.7.
#   bench/drafts_auto.sh OUT [CASES]   (CASES: comma-separated read-bound,resident,repetitive; needs root
#   for the cgroup; WORK=/tmp/deltafin-drafts-auto holds the synth)
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1
cases=${2:-read-bound,resident,repetitive}
work=${WORK:-/tmp/deltafin-drafts-auto}
bin=${DELTAFIN_BIN:-$PWD/target/release/deltafin}
mkdir -p "$work"
uptime | tee -a "${out%.jsonl}-uptime.txt"
if [[ $cases == *read-bound* ]]; then
  model=$work/k3syn draft=$work/k3syn-dspark
  [ -f "$model/config.json" ] || "$bin" synth --out "$model" --preset k3-experts --layers 4 --experts 64 --hidden 2048
  [ -f "$draft/config.json" ] || "$bin" synth --dspark --target "$model" --out "$draft" --layers 1 --dense-inter 1024 --taps 1,3
  DELTAFIN_BIN=$bin python3 bench/drafts.py --model "$model" --draft-model "$draft" --windows bench/data/synth-windows.jsonl \
    --limit "${SYNTH_WINDOWS:-4}" --decode "${SYNTH_DECODE:-24}" --threads 2 --wrap "bench/in_cgroup.sh 1G" \
    --label read-bound --out "$out"
fi
if [[ $cases == *resident* ]]; then
  DELTAFIN_BIN=$bin python3 bench/drafts.py --threads 1 ${RESIDENT_LIMIT:+--limit $RESIDENT_LIMIT} --label resident --out "$out"
fi
if [[ $cases == *repetitive* ]]; then
  DELTAFIN_BIN=$bin python3 bench/drafts.py --threads 1 --windows bench/data/repetitive-windows.jsonl --label repetitive --out "$out"
fi
uptime | tee -a "${out%.jsonl}-uptime.txt"
