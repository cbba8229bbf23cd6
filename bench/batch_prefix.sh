#!/usr/bin/env bash
# Issue 44's batch measurement: 32 chat requests sharing a long system prompt (the first CHARS
# characters of docs/architecture.md: 1,810 give a ~1,024-token shared prefix with the demo's
# tokenizer and chat template; the input is kept as OUTDIR/in.jsonl), each with its own question,
# greedy, 32 new tokens; run serially and with --parallel 8, each with the shared prefix (default)
# and without (--no-reuse), with the default expert cache and with none (--expert-cache-gb 0:
# every forward reads its expert union from the drive). Prints the batch summary lines (prefill
# rows, expert bytes requested and read: the stats counters) and writes OUTDIR/records-*.jsonl,
# OUTDIR/summary.txt and OUTDIR/counters.json; fails if any answer differs from the serial run's
# without sharing. Counters only: wall-clock times in the summary lines are not the measurement.
#   bench/batch_prefix.sh BIN OUTDIR [CHARS] [MODEL-ARGS...]   (default model: --demo)
set -euo pipefail
bin=$1 out=$2 chars=${3:-1810}
shift $(( $# < 3 ? $# : 3 ))
model=("$@")
[ ${#model[@]} -gt 0 ] || model=(--demo)
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
python3 - "$here/docs/architecture.md" "$chars" > "$out/in.jsonl" <<'PY'
import json, sys
system = open(sys.argv[1]).read()[: int(sys.argv[2])]
for i in range(32):
    q = f"Question {i}: which module would you read first to change feature number {i}, and why?"
    print(json.dumps({"id": f"q{i}", "messages": [{"role": "system", "content": system},
                                                  {"role": "user", "content": q}],
                      "max_tokens": 32, "temperature": 0}))
PY
: > "$out/summary.txt"
for cache in default 0; do
  for par in 1 8; do
    for mode in shared unshared; do
      extra=(); [ "$mode" = unshared ] && extra=(--no-reuse)
      [ "$cache" = 0 ] && extra+=(--expert-cache-gb 0)
      rec="$out/records-c$cache-p$par-$mode.jsonl"; rm -f "$rec"
      line=$("$bin" batch "${model[@]}" --in "$out/in.jsonl" --out "$rec" --parallel "$par" \
               --prefill-rows 2048 -q "${extra[@]}" 2>&1 | grep 'deltafin: batch:' | tail -1)
      echo "cache $cache parallel $par $mode: $line" | tee -a "$out/summary.txt"
    done
  done
done
python3 - "$out" <<'PY'
import json, re, sys
out = sys.argv[1]
def texts(p):
    return {r["id"]: (r["text"], r["finish_reason"], r["usage"]["completion_tokens"]) for r in map(json.loads, open(p))}
rows = []
for line in open(f"{out}/summary.txt"):
    cache, par, mode = re.match(r"cache (\w+) parallel (\d+) (\w+)", line).groups()
    num = lambda pat: (m := re.search(pat, line)) and float(m.group(1))
    rows.append({"expert_cache": cache, "parallel": int(par), "mode": mode,
                 "prefill_rows": num(r"prefill rows (\d+)"),
                 "shared_prefix_tokens": num(r"\((\d+) of them the shared prefix"),
                 "expert_mb_requested": num(r"expert bytes requested ([\d.]+) MB"),
                 "expert_mb_read": num(r"read ([\d.]+) MB")})
    same = texts(f"{out}/records-c{cache}-p{par}-{mode}.jsonl") == texts(f"{out}/records-cdefault-p1-unshared.jsonl")
    rows[-1]["answers_equal_unshared_serial"] = same
json.dump(rows, open(f"{out}/counters.json", "w"), indent=1)
for r in rows:
    print(r)
assert all(r["answers_equal_unshared_serial"] for r in rows), "answers differ"
PY
