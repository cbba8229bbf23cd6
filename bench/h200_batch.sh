#!/usr/bin/env bash
# Batched prefill on the lent NVIDIA H200 (issue 31): `bench run --batch 1` and `--batch 16` with
# --backend gpu, 512-token prompts, on the synthetic model of bench/h200.sh (real K3 expert size,
# 4 layers x 180 experts, 9.5 GB), page cache dropped before each run (cold). Through the device
# tool from the repo root, with the Vulkan loader debs in .gl/ and a stripped deltafin in .dev/.
# Writes every record to $OUT/batch.jsonl.
set -uo pipefail
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
# On 2026-12-03 the NVIDIA ICD also needed libegl1, libopengl0, libgl1, libglx0, libgles2 in .gl/
# and the EGL vendor file (else: no adapter, vkCreateInstance not found in libGLX_nvidia).
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
[ -e .dev/deltafin ] || gunzip -k .dev/deltafin.gz
chmod +x .dev/deltafin
B=$PWD/.dev/deltafin
out=${OUT:-/tmp/out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
nproc >> "$out/gpu.txt"
model=/tmp/k3x
t0=$(date +%s)
[ -e "$model/config.json" ] || $B synth --preset k3-experts --layers 4 --experts 180 --out "$model" 2>&1 | tail -1
echo "synth $(( $(date +%s) - t0 )) s"
# One pass per layer for all 16 prompts (8192 rows).
for n in 1 16; do
  $B bench run --model "$model" --batch $n --prompt-tokens 512 --decode 2 --backend gpu --prefill-rows 8192 \
    --out "$out/batch.jsonl" 2>&1 | grep -v XDG_RUNTIME | tail -2 | cut -c1-600
  echo "batch $n done at $(( $(date +%s) - t0 )) s"
done
