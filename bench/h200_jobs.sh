#!/usr/bin/env bash
# The batched experts' three-dispatch path on the lent H200 (device tool, repo root, .gl/ and .dev/
# as for bench/h200.sh, plus .dev/deltafin-base: the build to compare with): the gpu tests that
# check its bits, bench kernels, then decode from the device cache on the 96-KDA-head synth of
# bench/h200_kda.sh, alternating the two builds, one timed run (GPU timestamps) and the CPU's ids.
# Writes $OUT/gpu-test.log, kernels.jsonl, run.jsonl, run-ts.jsonl, run-cpu.jsonl.
# Record: results-2026-12-02-h200-jobs*.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
mkdir -p /work && { [ -e /work/main ] || ln -s "$PWD" /work/main; }
.dev/gpu-test --test-threads 1 --nocapture gpu_products batched fixtures_on device_expert_cache 2>&1 | grep -v XDG_RUNTIME > $OUT/gpu-test.log
grep -E "^test |result|batched experts|bit" $OUT/gpu-test.log | head -30
.dev/deltafin bench kernels --backend gpu --reps 200 2>&1 | grep -v XDG >> $OUT/kernels.jsonl
M=/tmp/k3kda
.dev/deltafin synth --preset k3-experts --layers 4 --experts 32 --kda-heads 96 --out $M 2>&1 | tail -1
for b in deltafin deltafin-base deltafin deltafin-base; do
  .dev/$b bench run --model $M --prompt-tokens 64 --decode 32 --backend gpu --gpu-cache-gb 4 --out $OUT/run.jsonl 2>&1 | grep -v XDG | tail -1
done
DELTAFIN_GPU_TIMESTAMPS=1 .dev/deltafin bench run --model $M --prompt-tokens 64 --decode 32 --backend gpu --gpu-cache-gb 4 --out $OUT/run-ts.jsonl 2>&1 | grep -v XDG | tail -1
.dev/deltafin bench run --model $M --prompt-tokens 64 --decode 8 --backend cpu --out $OUT/run-cpu.jsonl 2>&1 | grep -v XDG | tail -1
