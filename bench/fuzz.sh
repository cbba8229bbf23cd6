#!/usr/bin/env bash
# Runs each cargo-fuzz target (fuzz/) for SECONDS, one at a time (libFuzzer, one job), and prints
# one JSON record per target: executions, crashes (inputs that panicked, aborted, ran out of
# memory or timed out) with their saved inputs and distinct sites (panic locations), corpus size.
# After a crash the target is restarted until its time is used (at most 20 restarts).
#   bench/fuzz.sh [SECONDS] [TARGET...]          (default 60 s each, every target)
# Needs the nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`). Corpora are kept (not
# committed) in $DELTAFIN_FUZZ_DIR (default ~/.cache/deltafin/fuzz)/corpus/TARGET, seeded from the
# small committed fuzz/seeds/TARGET (and fuzz/dicts/TARGET.dict); crash inputs go to .../artifacts/TARGET. Reproduce one with
# `cargo +nightly fuzz run TARGET FILE`.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
shift || true
work=${DELTAFIN_FUZZ_DIR:-$HOME/.cache/deltafin/fuzz}
targets=("$@")
[ ${#targets[@]} -gt 0 ] || mapfile -t targets < <(sed -n 's/^name = "\(.*\)"$/\1/p' fuzz/Cargo.toml | grep -v '^deltafin-fuzz$')
command -v cargo-fuzz >/dev/null || { echo "cargo-fuzz is missing: cargo install cargo-fuzz" >&2; exit 1; }
cargo +nightly fuzz build >&2
triple=$(rustc +nightly -vV | sed -n 's/^host: //p')
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
rev=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
for t in "${targets[@]}"; do
  bin=fuzz/target/$triple/release/$t
  corpus=$work/corpus/$t
  arts=$work/artifacts/$t
  mkdir -p "$corpus" "$arts"
  seeds=()
  [ -d "fuzz/seeds/$t" ] && seeds=("fuzz/seeds/$t")
  dict=()
  [ -f "fuzz/dicts/$t.dict" ] && dict=(-dict="fuzz/dicts/$t.dict")
  log=$(mktemp)
  sites=$(mktemp)
  before=$(ls "$arts" | wc -l)
  execs=0
  start=$(date +%s)
  restarts=0
  while :; do
    left=$((secs - ($(date +%s) - start)))
    [ "$left" -gt 0 ] || break
    rc=0
    "$bin" "$corpus" "${seeds[@]}" "${dict[@]}" -max_total_time="$left" -timeout=60 -rss_limit_mb=2048 \
      -print_final_stats=1 -artifact_prefix="$arts/" >"$log" 2>&1 || rc=$?
    n=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    [ -n "$n" ] || n=$(grep -o '^#[0-9]*' "$log" | tail -1 | tr -d '#')
    execs=$((execs + ${n:-0}))
    [ "$rc" -ne 0 ] || break
    grep -o "panicked at [^ ]*" "$log" >>"$sites" || grep -m1 -o "ERROR: libFuzzer: [a-z-]*" "$log" >>"$sites" || true
    tail -40 "$log" >&2
    restarts=$((restarts + 1))
    [ "$restarts" -lt 20 ] || break
  done
  ran=$(($(date +%s) - start))
  crashes=$(($(ls "$arts" | wc -l) - before))
  saved=
  # (no pipeline into head when there is nothing to list: pipefail would see ls's SIGPIPE)
  [ "$crashes" -le 0 ] || saved=$(ls -t "$arts" | sed -n "1,${crashes}p" | sed "s|^|$arts/|" | paste -sd, -)
  python3 - "$t" "$secs" "$ran" "$execs" "$crashes" "$saved" "$(ls "$corpus" | wc -l)" "$cpu" "$(nproc)" "$rev" "$(sort -u "$sites" | paste -sd'|' -)" <<'PY'
import json, sys, datetime
t, secs, ran, execs, crashes, saved, corpus, cpu, cores, rev, sites = sys.argv[1:]
print(json.dumps({"bench": "fuzz", "date": datetime.date.today().isoformat(), "target": t,
                  "seconds": int(ran), "execs": int(execs), "crashes": int(crashes),
                  "crash_sites": [s for s in sites.split("|") if s],
                  "crash_inputs": [s for s in saved.split(",") if s], "corpus_files": int(corpus),
                  "machine": {"cpu": cpu, "cores": int(cores)}, "git": rev,
                  "command": f"bench/fuzz.sh {secs} {t}"}))
PY
  rm -f "$log" "$sites"
done
