#!/usr/bin/env bash
# Tokens/s of `deltafin run` on a committed tiny fixture (release build). Prints one JSON record
# per run: machine, command, git revision and the run's own stats.
#   bench/fixture_speed.sh [FIXTURE] [MAX_NEW] [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
fixture=${1:-k3-tiny-b}
max_new=${2:-256}
runs=${3:-3}
cargo build --release --quiet
dir=tests/fixtures/$fixture
prompt=$(python3 -c "import json,sys;print(','.join(map(str,json.load(open('$dir/reference.json'))['prompt_ids'])))")
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
rev=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
for i in $(seq "$runs"); do
  cmd="deltafin run --model $dir --prompt-ids <${fixture} prompt> --max-new $max_new --ignore-eos --format json"
  out=$(./target/release/deltafin run --model "$dir" --prompt-ids "$prompt" --max-new "$max_new" --ignore-eos --format json)
  python3 - "$out" "$cpu" "$(nproc)" "$rev" "$cmd" "$i" <<'PY'
import json, sys, datetime
out, cpu, cores, rev, cmd, run = sys.argv[1:]
stats = json.loads(out)["stats"]
print(json.dumps({"bench": "fixture_speed", "date": datetime.date.today().isoformat(), "run": int(run),
                  "machine": {"cpu": cpu, "cores": int(cores)}, "git": rev, "command": cmd, "stats": stats}))
PY
done
