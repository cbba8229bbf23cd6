#!/usr/bin/env bash
# The README table of issue 31: `bench run --batch N` on an over-RAM K3-shaped synthetic model in a
# memory cgroup (v1 or v2, one per run via bench/in_cgroup.sh): prefill of N = 1, 4, 16 prompts of
# 512 tokens, decode of N = 1, 8, 32 sequences (32-token prompts, 8 steps). Cold: each run drops
# the page cache. Needs root. One JSON record per run appended to OUT.
#   bench/batch_table.sh BIN MODEL OUT [LIMIT] [all|prefill|decode|short16]   (model: synth --preset k3-experts --layers 8
#   --experts 128 --hidden 1024 --expert-latent 1024 --expert-inter 2048, 3.1 GiB; limit 1536M)
set -euo pipefail
bin=$1 model=$2 out=$3 limit=${4:-1536M}
# Each run in its own memory cgroup of LIMIT, through bench/in_cgroup.sh.
here=$(dirname "$0")
run() {
  bash "$here/in_cgroup.sh" "$limit" "$bin" bench run --model "$model" "$@" --out "$out" | cut -c1-300
}
what=${5:-all}
if [ "$what" = all ] || [ "$what" = prefill ]; then
  for n in 1 4; do run --batch "$n" --prompt-tokens 512 --decode 2 --prefill-rows 4096; done
  # 16 x 512 rows: the bench cuts the passes' rows (here to 2048: 4 passes) until 16 states fit
  # beside the activations in the limit.
  run --batch 16 --prompt-tokens 512 --decode 2 --prefill-rows 4096
fi
if [ "$what" = all ] || [ "$what" = decode ]; then
  for n in 1 8 32; do run --batch "$n" --prompt-tokens 32 --decode 9; done
fi
if [ "$what" = short16 ]; then
  # What the 2 shared cores allowed in the session of 2026-12-03: 16 prompts of 128 tokens, one pass.
  run --batch 16 --prompt-tokens 128 --decode 2 --prefill-rows 2048
fi
