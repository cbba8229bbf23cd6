#!/usr/bin/env bash
# Expert-read throughput: deltafin's store vs fio replaying the same reads (same files, offsets,
# lengths and total queue depth, O_DIRECT, io_uring), over 1, 2 and 3 directory "drives".
# Prints one JSON record per configuration (bench io).
#   bench/io.sh [WORKDIR]        (default /tmp/deltafin-bench; needs ~8 GB free)
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-/tmp/deltafin-bench}
mkdir -p "$work"
command -v fio >/dev/null || { echo "installing fio from Debian's packages" >&2; apt-get install -y fio >/dev/null || { apt-get update >/dev/null && apt-get install -y fio >/dev/null; }; }
cargo build --release --quiet
bin=target/release/deltafin
model=$work/k3x
# Real K3 expert dimensions (17.55 MB experts), 3 MoE layers x 32 experts, light trunk.
[ -f "$model/config.json" ] || $bin synth --out "$model" --preset k3-experts --layers 4 --experts 32
for n in 1 2 3; do
  rm -rf "$work"/drive* "$model/placement.json"
  drives=()
  for i in $(seq 1 "$n"); do mkdir -p "$work/drive$i"; drives+=(--drive "$work/drive$i"); done
  $bin place --model "$model" "${drives[@]}" --policy spread --probe-mb 512 >&2
  $bin bench io --model "$model" --gb 1.5 --label "$n dir(s), spread"
done
rm -rf "$work"/drive* "$model/placement.json"
$bin bench io --model "$model" --gb 1.5 --label "shards, no placement"
