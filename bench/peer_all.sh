#!/usr/bin/env bash
# The three engines on one machine in one run, one JSON record: bench/peer_llama.sh (deltafin and
# llama.cpp on the K3-shaped synth, same cgroup, cold) and then bench/peer_colibri.sh (colibri's
# Kimi K3 engine, default and exact, on the same model, the same prompt ids and the same cgroup,
# beside that very deltafin run; and the quality comparison on the trained demo). The record is
# bench/peer_colibri.sh's with llama.cpp's figures beside the others and peer_llama.sh's record
# embedded (`peer_llama`); if the vendored llama.cpp cannot run K3 (peer_llama.sh exit 3) the
# record says so and deltafin is measured by bench/peer_colibri.sh itself.
#
#   bench/peer_all.sh [--limit 3G] [--prompt 512] [--decode 32] [--threads 2] [--out FILE]
#
# Needs what both scripts need (root, python3, a C/C++ compiler, PyPI for llama.cpp's converter,
# colibri's source: COLIBRI_SRC=DIR or network; or COLIBRI_BIN=FILE). Env as theirs
# (DELTAFIN_BIN, DELTAFIN_PEER_CACHE, COLIBRI_*, LLAMA_CPP_PYTHON_VERSION, DELTAFIN_PEER_FP64).
set -euo pipefail
cd "$(dirname "$0")/.."
limit=3G prompt=512 decode=32 threads=2 out=
while [ $# -gt 0 ]; do
  case $1 in
    --limit) limit=$2; shift 2 ;;
    --prompt) prompt=$2; shift 2 ;;
    --decode) decode=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/{/^#/p}' "$0"; exit 0 ;;
    *) echo "peer_all: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
cache=${DELTAFIN_PEER_CACHE:-$HOME/.cache/deltafin-peer}
mkdir -p "$cache/work"
all=$(mktemp -d "$cache/work/all.XXXXXX")
echo "peer_all: run directory $all" >&2
common=(--limit "$limit" --prompt "$prompt" --decode "$decode" --threads "$threads")
rc=0
# its record (measured, or blocked) is its last stdout line
DELTAFIN_PEER_RUN=$all/llama bench/peer_llama.sh "${common[@]}" >"$all/llama.jsonl" || rc=$?
if [ "$rc" = 0 ]; then
  bench/peer_colibri.sh "${common[@]}" --prompt-ids "$all/llama/prompt-ids.json" \
    --deltafin-run "$all/llama" --llama-record "$all/llama.jsonl" ${out:+--out "$out"}
elif [ "$rc" = 3 ]; then
  bench/peer_colibri.sh "${common[@]}" --llama-record "$all/llama.jsonl" ${out:+--out "$out"}
else
  echo "peer_all: bench/peer_llama.sh failed ($rc); see above" >&2
  exit "$rc"
fi
