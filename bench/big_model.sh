#!/usr/bin/env bash
# A 512-token prompt on a synthetic model larger than RAM (32.8 GB of real-size experts), cold,
# inside a memory cgroup, with prefetch off and on. One JSON record per run (bench run).
#   bench/big_model.sh [WORKDIR] [CGROUP_LIMIT]     (defaults: /tmp/deltafin-bench 8G; needs root, ~40 GB free)
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-/tmp/deltafin-bench}
limit=${2:-8G}
mkdir -p "$work"
cargo build --release --quiet
bin=$PWD/target/release/deltafin
model=$work/big
[ -f "$model/config.json" ] || $bin synth --out "$model" --preset k3-experts --layers 12 --experts 170
bench/in_cgroup.sh "$limit" "$bin" bench run --model "$model" --prompt-tokens 512 --decode 8 \
  --prefetch-runs both --plot "$work/plots" --out "$work/big_model.jsonl"
