#!/usr/bin/env bash
# Streaming decode on the lent H200 (device tool, repo root, .gl/ and .dev/ as for bench/h200.sh):
# the 9.5 GB synth of bench/h200.sh in a 3 GiB cgroup, no device expert cache, so every expert a
# token needs is read from disk into the batch path's staging arena. Runs .dev/deltafin and, with
# DELTAFIN_BIN_BASE set, that binary too (an A/B of two builds). Records: $OUT/stream.jsonl.
set -uo pipefail
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
B=$PWD/.dev/deltafin
out=${OUT:-/tmp/out}
mkdir -p "$out"
model=/tmp/k3x
[ -e "$model/config.json" ] || $B synth --preset k3-experts --layers 4 --experts 180 --out "$model" 2>&1 | tail -1
echo +memory > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true
for bin in "$B" ${DELTAFIN_BIN_BASE:+"$DELTAFIN_BIN_BASE"}; do
  bench/in_cgroup.sh 3G "$bin" bench run --model "$model" --prompt-tokens 512 --decode 16 --backend gpu \
    --out "$out/stream.jsonl" 2>&1 | grep -v XDG_RUNTIME | tail -1 | cut -c1-300
done
