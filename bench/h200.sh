#!/usr/bin/env bash
# The GPU measurements on the lent NVIDIA H200 (through the device tool, from the repo root there,
# with the Vulkan loader debs in .gl/ (libvulkan1, and libglvnd0: the NVIDIA ICD needs
# libGLdispatch) and stripped builds in .dev/: deltafin and the gpu test binary). Writes every record under $OUT:
#   - bench kernels --backend gpu (MXFP4 and bf16 matvec vs a plain read of the same bytes with
#     the same u32 access width; one expert alone; 512-row MXFP4 and bf16 matmul; the round trip
#     of one tiny product), and the CPU kernels on the same machine;
#   - every gpu test (products and the other ops bit-identical to the CPU when the adapter's fma is
#     fused, tail shapes, the batched expert path equal to the per-expert one; fixtures vs fp64);
#   - bench run --backend gpu (with and without a device expert cache that holds every expert)
#     and --backend cpu on a synthetic model with real expert size, 3.7x the memory cgroup's
#     limit, cold.
set -uo pipefail
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
# The test binary has this checkout's path compiled in (fixtures).
mkdir -p /work && { [ -e /work/main ] || ln -s "$PWD" /work/main; }
B=$PWD/.dev/deltafin
out=${OUT:-/tmp/out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
nproc >> "$out/gpu.txt"
$B bench kernels --backend gpu --reps 20 2>&1 | grep -v XDG_RUNTIME | tee "$out/kernels.jsonl"
$B bench kernels --rows 512 2>&1 | tee -a "$out/kernels.jsonl"
# Every gpu test; the CLI ones run the binary where cargo put it.
mkdir -p target/release && cp "$B" target/release/deltafin
.dev/gpu-test --test-threads 1 --nocapture 2>&1 | grep -v XDG_RUNTIME > "$out/gpu-test.log"; grep -E "^test |test result" "$out/gpu-test.log"
model=/tmp/k3x
[ -e "$model/config.json" ] || $B synth --preset k3-experts --layers 4 --experts 180 --out "$model" 2>&1 | tail -1
echo +memory > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true
# The GPU alone, the GPU with every expert fitting its device cache (prefill admits them, decode
# then runs from device memory), and the CPU's 16 cores.
for be in "gpu" "gpu --gpu-cache-gb 12" "cpu"; do
  # shellcheck disable=SC2086
  bench/in_cgroup.sh 3G "$B" bench run --model "$model" --prompt-tokens 512 --decode 16 --backend $be \
    --out "$out/run.jsonl" 2>&1 | grep -v XDG_RUNTIME | tail -3
done
