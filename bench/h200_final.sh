#!/usr/bin/env bash
# Last H200 run of 2026-12-02 (device tool, repo root, .gl/ and .dev/ as for bench/h200.sh, plus
# .dev/deltafin-base): every gpu test, decode from the device cache on the 96-KDA-head synth
# alternating the two builds (the readback's short spin before blocking against 014042a),
# bench kernels for both, and the 9.5 GB synth with --gpu-cache-gb 12 (several cache arenas).
# The CLI test needs target/release/deltafin, which is not carried: it fails there by design.
# Record: results-2026-12-02-h200-final*.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
mkdir -p /work && { [ -e /work/main ] || ln -s "$PWD" /work/main; }
.dev/gpu-test --test-threads 1 --nocapture 2>&1 | grep -v XDG_RUNTIME > $OUT/gpu-test.log
grep -E "^test .*(ok|FAILED)$|test result|panicked" $OUT/gpu-test.log | tail -16
M=/tmp/k3kda
.dev/deltafin synth --preset k3-experts --layers 4 --experts 32 --kda-heads 96 --out $M 2>&1 | tail -1
for b in deltafin deltafin-base deltafin deltafin-base; do
  .dev/$b bench run --model $M --prompt-tokens 64 --decode 32 --backend gpu --gpu-cache-gb 4 --out $OUT/run.jsonl 2>&1 | grep -v XDG | tail -1 | cut -c1-100
done
for b in deltafin deltafin-base; do .dev/$b bench kernels --backend gpu --reps 200 2>&1 | grep -v XDG >> $OUT/kernels.jsonl; done
X=/tmp/k3x
.dev/deltafin synth --preset k3-experts --layers 4 --experts 180 --out $X 2>&1 | tail -1
echo +memory > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true
bench/in_cgroup.sh 3G .dev/deltafin bench run --model $X --prompt-tokens 512 --decode 16 --backend gpu --gpu-cache-gb 12 --out $OUT/cache12.jsonl 2>&1 | grep -v XDG | grep -i "expert cache\|gpu" | head -3 | cut -c1-300
