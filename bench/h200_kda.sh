#!/usr/bin/env bash
# Decode at K3's KDA width on the lent H200 (through the device tool, from the repo root there,
# with .gl/ and .dev/ as for bench/h200.sh): a synth with 96 KDA heads of 128 (K3's 6.3 MB state
# per layer), every expert held in the device cache, so decode's cost is the trunk, the KDA
# recurrence and the state's movement. Runs bench run --backend gpu and --backend cpu; with
# DELTAFIN_BIN_BASE set, that binary's gpu run too (an A/B of two builds on the same model).
# Records go to $OUT/kda.jsonl; stats.attention_s and device_traffic.decode_per_token are the
# numbers to read.
set -uo pipefail
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
B=${DELTAFIN_BIN:-$PWD/.dev/deltafin}
out=${OUT:-/tmp/out}
mkdir -p "$out"
model=/tmp/k3kda
[ -e "$model/config.json" ] || $B synth --preset k3-experts --layers 4 --experts 32 --kda-heads 96 --out "$model" 2>&1 | tail -1
run() {
  local bin=$1; shift
  "$bin" bench run --model "$model" --prompt-tokens 64 --decode 16 "$@" --out "$out/kda.jsonl" 2>&1 \
    | grep -v XDG_RUNTIME | tail -2
}
run "$B" --backend gpu --gpu-cache-gb 4
[ -n "${DELTAFIN_BIN_BASE:-}" ] && run "$DELTAFIN_BIN_BASE" --backend gpu --gpu-cache-gb 4
run "$B" --backend cpu
