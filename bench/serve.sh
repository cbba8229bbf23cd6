#!/usr/bin/env bash
# Server overhead vs `deltafin run` on the same prompt, and a chat's second-turn TTFT with and
# without conversation reuse; prints one JSON record (see bench/serve_bench.py).
#   bench/serve.sh [MODEL_DIR|--demo] [TOKENS] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${DELTAFIN_BIN:-target/release/deltafin}
[ -x "$BIN" ] || cargo build --release --quiet
exec python3 bench/serve_bench.py "$BIN" "${1:---demo}" "${2:-128}" "${3:-3}"
