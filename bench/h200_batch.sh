#!/usr/bin/env bash
# Batched prefill on the lent NVIDIA H200 (issue 31): `bench run --batch N` with --backend gpu,
# 512-token prompts, on the synthetic model of bench/h200.sh (real K3 expert size, 4 layers x 180
# experts, 9.5 GB), page cache dropped before each run (cold). Through the device tool from the
# repo root, with the Vulkan loader debs in $GL (default .gl/) and a stripped deltafin at $BIN
# (default .dev/deltafin; BIN.gz or BIN.xz is unpacked first). NS: the batch sizes (default
# "1 16"); TS=1 adds a batch-16 run with DELTAFIN_GPU_TIMESTAMPS=1 (each backend operation's
# device seconds in the record's prefill.ops). Records go to $OUT/batch.jsonl (timestamps:
# $OUT/batch-timestamps.jsonl).
set -uo pipefail
GL=${GL:-.gl}
BIN=${BIN:-.dev/deltafin}
for f in "$GL"/*.deb; do dpkg -x "$f" /; done
ldconfig
# On 2026-12-03 the NVIDIA ICD also needed libegl1, libopengl0, libgl1, libglx0, libgles2 in .gl/
# and the EGL vendor file (else: no adapter, vkCreateInstance not found in libGLX_nvidia).
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
B=/tmp/deltafin
if [ -e "$BIN.xz" ]; then xz -dc "$BIN.xz" > $B; elif [ -e "$BIN.gz" ]; then gunzip -c "$BIN.gz" > $B; else cp "$BIN" $B; fi
chmod +x $B
out=${OUT:-/tmp/out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
nproc >> "$out/gpu.txt"
model=/tmp/k3x
t0=$(date +%s)
[ -e "$model/config.json" ] || $B synth --preset k3-experts --layers 4 --experts 180 --out "$model" 2>&1 | tail -1
echo "synth $(( $(date +%s) - t0 )) s"
run() { # N OUTFILE: one pass per layer for all N prompts (N x 512 rows)
  $B bench run --model "$model" --batch "$1" --prompt-tokens 512 --decode 2 --backend gpu --prefill-rows 8192 \
    --out "$2" 2>&1 | grep -v XDG_RUNTIME | tail -2 | cut -c1-600
  echo "batch $1 done at $(( $(date +%s) - t0 )) s"
}
for n in ${NS:-1 16}; do run "$n" "$out/batch.jsonl"; done
if [ "${TS:-0}" = 1 ]; then DELTAFIN_GPU_TIMESTAMPS=1 run 16 "$out/batch-timestamps.jsonl"; fi
