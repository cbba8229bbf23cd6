#!/usr/bin/env bash
# Expert-read throughput: deltafin's store vs fio replaying the same reads (same files, offsets,
# lengths and total queue depth, uncached: O_DIRECT and io_uring on Linux, F_NOCACHE and posixaio on
# macOS), over 1, 2 and 3 directory "drives". Prints one JSON record per configuration (bench io);
# on macOS the page cache is purged before each (bench/cold.sh), or the records say "cold": false.
#   bench/io.sh [WORKDIR]        (default /tmp/deltafin-bench; needs ~8 GB free)
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-/tmp/deltafin-bench}
mkdir -p "$work"
. bench/cold.sh
if ! command -v fio >/dev/null; then
  if [ "$(uname -s)" = Darwin ]; then
    echo "installing fio from Homebrew" >&2; brew install fio >/dev/null
  else
    echo "installing fio from Debian's packages" >&2
    apt-get install -y fio >/dev/null || { apt-get update >/dev/null && apt-get install -y fio >/dev/null; }
  fi
fi
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
  # shellcheck disable=SC2046 # cold_flags prints zero or one flag
  $bin bench io --model "$model" --gb 1.5 --label "$n dir(s), spread" $(cold_flags)
done
rm -rf "$work"/drive* "$model/placement.json"
# shellcheck disable=SC2046
$bin bench io --model "$model" --gb 1.5 --label "shards, no placement" $(cold_flags)
