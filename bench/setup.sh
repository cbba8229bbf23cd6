#!/usr/bin/env bash
# `deltafin setup` against a local hub (bench/hub_server.py) on a synthetic K3-shaped model with
# real 17.55 MB experts. Prints one JSON record:
#  - download: `setup --full --workers N` rate vs the server's raw rate in the same run (N parallel
#    curl downloads of the same files, to /dev/null and to files on the same file system), and the
#    ratios (setup also hashes every byte and fsyncs every file);
#  - stream: `setup --stream` (trunk bytes, seconds), then TTFT of the first run (every routed
#    expert the prompt needs streams over HTTP) and of the second (all local), beside the full
#    install's TTFT on the same prompt.
#   bench/setup.sh [WORKDIR] [WORKERS] [LAYERS] [EXPERTS]
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-/tmp/deltafin-bench-setup}
workers=${2:-4}
layers=${3:-4}
experts=${4:-24}
bin=$PWD/target/release/deltafin
cargo build --release --quiet
rm -rf "$work" && mkdir -p "$work"
"$bin" synth --out "$work/src" --preset k3-experts --layers "$layers" --experts "$experts" --top-k 8 --shard-gb 0.3 >/dev/null 2>&1
commit=0123456789abcdef0123456789abcdef01234567
port=$((20000 + RANDOM % 20000))
python3 bench/hub_server.py "$work/src" bench/k3x "$commit" "$port" > "$work/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 100); do grep -q ready "$work/server.log" 2>/dev/null && break; sleep 0.1; done
export HF_ENDPOINT=http://127.0.0.1:$port HF_HUB_CACHE=$work/no-hf-cache
files=$(cd "$work/src" && ls)
total=$(cd "$work/src" && cat $files | wc -c)
# Raw: the same files, N at a time, to /dev/null.
t0=$(date +%s.%N)
printf '%s\n' $files | xargs -P "$workers" -I{} curl -s -o /dev/null "$HF_ENDPOINT/bench/k3x/resolve/$commit/{}"
t1=$(date +%s.%N)
# Raw to disk: the same, written to files on the file system setup writes to (no fsync, no hash).
mkdir -p "$work/curl"
t2=$(date +%s.%N)
printf '%s\n' $files | xargs -P "$workers" -I{} curl -s -o "$work/curl/{}" "$HF_ENDPOINT/bench/k3x/resolve/$commit/{}"
t3=$(date +%s.%N)
rm -rf "$work/curl"
sync
full=$("$bin" setup --full --repo bench/k3x --dir "$work/full" --workers "$workers" --json 2>/dev/null)
stream=$("$bin" setup --stream --repo bench/k3x --dir "$work/stream" --workers "$workers" --json 2>/dev/null)
prompt=$(python3 -c "print(','.join(str(3 + 7 * i % 900) for i in range(64)))")
ttft() { "$bin" run --model "$1" --prompt-ids "$prompt" --max-new 1 --format json --memory-gb 4 2>/dev/null; }
f=$(ttft "$work/full"); s1=$(ttft "$work/stream"); s2=$(ttft "$work/stream")
python3 - "$total" "$t0" "$t1" "$workers" "$full" "$stream" "$f" "$s1" "$s2" "$(git rev-parse --short HEAD)" "$t2" "$t3" <<'PY'
import json, sys, datetime, platform, os
total, t0, t1, workers = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
full, stream, f, s1, s2 = (json.loads(x) for x in sys.argv[5:10])
raw = total / (t1 - t0)
raw_disk = total / (float(sys.argv[12]) - float(sys.argv[11]))
d = full["download"]
ours = d["bytes_downloaded"] / d["seconds"]
st = lambda r: r["stats"]
rec = {
  "bench": "setup", "date": datetime.date.today().isoformat(), "git": sys.argv[10],
  "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
  "command": f"bench/setup.sh WORK {workers}",
  "model_bytes": total, "workers": workers,
  "download": {"raw_bytes_per_s": raw, "raw_to_disk_bytes_per_s": raw_disk, "setup_bytes_per_s": ours,
               "ratio": ours / raw, "ratio_to_disk": ours / raw_disk,
               "setup_seconds": d["seconds"], "raw_seconds": t1 - t0},
  "stream": {"setup": stream["stream"],
             "ttft_full_s": st(f)["ttft_s"], "ttft_stream_first_s": st(s1)["ttft_s"],
             "ttft_stream_second_s": st(s2)["ttft_s"],
             "first_run_http_bytes": next((x["bytes_read"] for x in st(s1).get("drives", []) if x.get("reader") == "http"), None),
             "second_run_http_bytes": next((x["bytes_read"] for x in st(s2).get("drives", []) if x.get("reader") == "http"), None)},
}
print(json.dumps(rec))
PY
