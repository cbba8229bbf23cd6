#!/usr/bin/env bash
# The GPU measurements on the lent NVIDIA H200: bench/h200.sh [ROUND [ARGS]], through the device
# tool, from the repo root there, with the Vulkan loader debs in .gl/ (libvulkan1, and libglvnd0:
# the NVIDIA ICD needs libGLdispatch) and stripped builds in .dev/: deltafin and the gpu test
# binary, both built with the kernel microbench (`cargo build --release --features gpu-bench`,
# `cargo test --release --features gpu-bench --test gpu --no-run`). Records go under $OUT.
# Rounds (bench/README.md says what each measured; records under bench/results/):
#   all (default)  bench kernels --backend gpu (MXFP4 and bf16 matvec vs a plain read of the same
#                  bytes; 512-row MXFP4 and bf16 matmul; the round trip of one tiny product) and
#                  the CPU kernels; every gpu test; bench run --backend gpu (with and without a
#                  device expert cache that holds every expert) and --backend cpu on a 9.5 GB
#                  synth in a 3 GiB cgroup, cold
#   kda            decode at K3's KDA width (96 heads of 128, every expert in the device cache),
#                  gpu and cpu; DELTAFIN_BIN_BASE=BIN adds that build's gpu run (A/B)
#   stream         streaming decode from disk on the 9.5 GB synth, no device cache (A/B as kda)
#   jobs           the batched experts' gpu tests, bench kernels, decode from the device cache
#                  alternating .dev/deltafin and .dev/deltafin-base, one run with GPU timestamps
#   final          every gpu test, the same A/B, bench kernels of both builds, --gpu-cache-gb 12
#   mend           two decode runs on one adapter at once (same ids); a cache larger than the device
#   clock          bench kernels at 20, 200 and 2,000 repetitions beside nvidia-smi's SM clock
#   variants [NAME...]  the one-row MXFP4 kernel variants of
#                  bench/data/gpu-variants/matvec/variants_r6.py, each timed in place of the shipped
#                  kernel between two plain reads with a check of its bits: all of them at 49152,
#                  196608 and 98304 rows; or the NAMEd ones (e.g. r6_t8 r12_spread r11_xs
#                  r11_lanes2) at 49152 and 98304 rows, each with the SASS the driver compiled
#                  (bench/sass_dump.py; needs .dev/zstd, a copy of the host's /usr/bin/zstd)
set -uo pipefail
round=${1:-all}
[ $# -gt 0 ] && shift
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig >/dev/null 2>&1
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
# The test binary has this checkout's path compiled in (fixtures).
mkdir -p /work && { [ -e /work/main ] || ln -s "$PWD" /work/main; }
B=${DELTAFIN_BIN:-$PWD/.dev/deltafin}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
big=/tmp/k3x     # 4 layers x 180 experts of 17.55 MB: 9.5 GB
kda=/tmp/k3kda   # 96 KDA heads of 128 (K3's 6.3 MB state per layer), 32 experts
synth_big() { [ -e "$big/config.json" ] || $B synth --preset k3-experts --layers 4 --experts 180 --out "$big" 2>&1 | tail -1; }
synth_kda() { [ -e "$kda/config.json" ] || $B synth --preset k3-experts --layers 4 --experts 32 --kda-heads 96 --out "$kda" 2>&1 | tail -1; }
cgroups() { echo +memory > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true; }
gpu_tests() { .dev/gpu-test --test-threads 1 --nocapture "$@" 2>&1 | grep -v XDG_RUNTIME > "$OUT/gpu-test.log"; grep -E "^test .*(ok|FAILED)$|test result|panicked" "$OUT/gpu-test.log"; }
# Decode from the device cache on the KDA synth: BUILD (a name in .dev/) DECODE OUTFILE [more options].
kda_run() {
  local b=$1 d=$2 o=$3; shift 3
  ".dev/$b" bench run --model "$kda" --prompt-tokens 64 --decode "$d" --backend gpu --gpu-cache-gb 4 "$@" --out "$OUT/$o" 2>&1 | grep -v XDG | tail -1 | cut -c1-200
}

case $round in
all)
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
  nproc >> "$OUT/gpu.txt"
  $B bench kernels --backend gpu --reps 20 2>&1 | grep -v XDG_RUNTIME | tee "$OUT/kernels.jsonl"
  $B bench kernels --rows 512 2>&1 | tee -a "$OUT/kernels.jsonl"
  # Every gpu test; the CLI ones run the binary where cargo put it.
  mkdir -p target/release && cp "$B" target/release/deltafin
  gpu_tests
  synth_big; cgroups
  # The GPU alone, the GPU with every expert fitting its device cache (prefill admits them, decode
  # then runs from device memory), and the CPU's 16 cores.
  for be in "gpu" "gpu --gpu-cache-gb 12" "cpu"; do
    # shellcheck disable=SC2086
    bench/in_cgroup.sh 3G "$B" bench run --model "$big" --prompt-tokens 512 --decode 16 --backend $be \
      --out "$OUT/run.jsonl" 2>&1 | grep -v XDG_RUNTIME | tail -3
  done ;;
kda)
  synth_kda
  run() {
    local bin=$1; shift
    "$bin" bench run --model "$kda" --prompt-tokens 64 --decode 16 "$@" --out "$OUT/kda.jsonl" 2>&1 | grep -v XDG_RUNTIME | tail -2
  }
  run "$B" --backend gpu --gpu-cache-gb 4
  [ -n "${DELTAFIN_BIN_BASE:-}" ] && run "$DELTAFIN_BIN_BASE" --backend gpu --gpu-cache-gb 4
  run "$B" --backend cpu ;;
stream)
  synth_big; cgroups
  for bin in "$B" ${DELTAFIN_BIN_BASE:+"$DELTAFIN_BIN_BASE"}; do
    bench/in_cgroup.sh 3G "$bin" bench run --model "$big" --prompt-tokens 512 --decode 16 --backend gpu \
      --out "$OUT/stream.jsonl" 2>&1 | grep -v XDG_RUNTIME | tail -1 | cut -c1-300
  done ;;
jobs)
  gpu_tests gpu_products batched fixtures_on device_expert_cache
  $B bench kernels --backend gpu --reps 200 2>&1 | grep -v XDG >> "$OUT/kernels.jsonl"
  synth_kda
  for b in deltafin deltafin-base deltafin deltafin-base; do kda_run $b 32 run.jsonl; done
  DELTAFIN_GPU_TIMESTAMPS=1 kda_run deltafin 32 run-ts.jsonl
  $B bench run --model "$kda" --prompt-tokens 64 --decode 8 --backend cpu --out "$OUT/run-cpu.jsonl" 2>&1 | grep -v XDG | tail -1 ;;
final)
  # The CLI test needs target/release/deltafin, which is not carried: it fails here by design.
  gpu_tests
  synth_kda
  for b in deltafin deltafin-base deltafin deltafin-base; do kda_run $b 32 run.jsonl; done
  for b in deltafin deltafin-base; do ".dev/$b" bench kernels --backend gpu --reps 200 2>&1 | grep -v XDG >> "$OUT/kernels.jsonl"; done
  synth_big; cgroups
  bench/in_cgroup.sh 3G "$B" bench run --model "$big" --prompt-tokens 512 --decode 16 --backend gpu --gpu-cache-gb 12 \
    --out "$OUT/cache12.jsonl" 2>&1 | grep -v XDG | grep -i "expert cache\|gpu" | head -3 | cut -c1-300 ;;
mend)
  gpu_tests batched device_expert_cache fixtures_on gpu_products
  synth_kda
  kda_run deltafin 16 a.jsonl & kda_run deltafin 16 b.jsonl & wait
  python3 -c "
import json
a=json.loads(open('$OUT/a.jsonl').read()); b=json.loads(open('$OUT/b.jsonl').read())
print('two at once: same ids', a['output_ids']==b['output_ids'], a['decode']['seconds_per_token'], b['decode']['seconds_per_token'])"
  echo "== cache larger than the device:"
  $B run --model "$kda" --prompt-ids 1,2,3 --max-new 2 --backend gpu --gpu-cache-gb 400 2>&1 | grep -v XDG | tail -3 ;;
clock)
  nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,clocks.mem,power.draw,utilization.gpu --format=csv -lms 100 > "$OUT/clk.txt" &
  M=$!
  for reps in 20 200 2000; do
    echo "== reps $reps $(date +%s.%N)" >> "$OUT/marks.txt"
    $B bench kernels --backend gpu --reps $reps 2>&1 | grep -v XDG_RUNTIME >> "$OUT/kernels.jsonl"
  done
  echo "== end $(date +%s.%N)" >> "$OUT/marks.txt"
  kill $M ;;
variants)
  export PATH=/usr/local/cuda/bin:$PATH ZSTD=$PWD/.dev/zstd
  python3 bench/data/gpu-variants/matvec/variants_r6.py /tmp/r6 > /dev/null
  if [ $# -eq 0 ]; then
    # Every variant together, at the bench's 49152 rows, 4x and 2x that (round 6).
    for rows in 49152 196608 49152 98304; do
      if ! timeout 120 $B bench kernels --backend gpu --reps 200 --matvec-rows $rows --matvec-variants /tmp/r6 2>/dev/null > /tmp/rec.json; then
        echo "rows $rows: no record (exit $?)"; continue
      fi
      cat /tmp/rec.json >> "$OUT/variants.jsonl"
      python3 -c "
import json
d=json.load(open('/tmp/rec.json')); print('rows', d['mxfp4_matvec_shape'], 'read', round(d['mxfp4_plain_read_gb_s']), 'matvec', round(d['mxfp4_matvec_weight_gb_s']), round(d['mxfp4_matvec_vs_read'],3))
for k,v in d.items():
  if k.endswith('_vs_read') and k.startswith('variant_'):
    n=k[8:-8]; print('  %-20s %5.0f GB/s %.3f %s' % (n, d['variant_'+n+'_gb_s'], v, d['variant_'+n+'_bits_equal']))
  elif k.endswith('_error'): print(k, v[:200])"
    done
    exit 0
  fi
  # Named variants one at a time (rounds 11 and 12), each with its SASS. A baseline run with no
  # variant gives the shipped pipelines' SASS; each variant's dump leaves them out.
  rm -rf ~/.cache/nvidia /tmp/none; mkdir -p /tmp/none
  timeout 60 $B bench kernels --backend gpu --reps 2 --matvec-variants /tmp/none > /dev/null 2>&1
  timeout 90 python3 bench/sass_dump.py ~/.cache/nvidia --out "$OUT/shipped.sass.txt" --min-hadd2 8 --hashes-out /tmp/base.hashes
  for v in "$@"; do
    rm -rf ~/.cache/nvidia /tmp/one; mkdir -p /tmp/one; cp "/tmp/r6/$v.wgsl" /tmp/one/
    for rows in 49152 98304; do
      if timeout 60 $B bench kernels --backend gpu --reps 200 --matvec-rows $rows --matvec-variants /tmp/one 2>/dev/null > /tmp/rec.json; then
        cat /tmp/rec.json >> "$OUT/variants.jsonl"
        python3 -c "
import json; d=json.load(open('/tmp/rec.json')); n='$v'
print('$rows shipped %.0f GB/s %.3f; %s %.0f GB/s %.3f bits %s' % (d['variant_shipped_gb_s'], d['variant_shipped_vs_read'], n, d.get('variant_'+n+'_gb_s', 0), d.get('variant_'+n+'_vs_read', 0), d.get('variant_'+n+'_bits_equal')))"
      else
        echo "$v $rows: no record (exit $?)"
      fi
    done
    echo "== $v"
    timeout 90 python3 bench/sass_dump.py ~/.cache/nvidia --out "$OUT/$v.sass.txt" --exclude /tmp/base.hashes
  done ;;
*) echo "bench/h200.sh: unknown round '$round' (all, kda, stream, jobs, final, mend, clock, variants)" >&2; exit 2 ;;
esac
