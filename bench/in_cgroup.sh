#!/usr/bin/env bash
# Runs a command inside a memory cgroup (v1 or v2) limited to LIMIT, so a model several times the
# limit must really stream from disk (page cache is charged to the cgroup). Needs root.
#   bench/in_cgroup.sh 8G deltafin bench run --model /data/big
set -euo pipefail
limit=$1
shift
name=deltafin-bench-$$
if [ -d /sys/fs/cgroup/memory ]; then
  cg=/sys/fs/cgroup/memory/$name
  mkdir -p "$cg"
  echo "$limit" > "$cg/memory.limit_in_bytes"
else
  cg=/sys/fs/cgroup/$name
  mkdir -p "$cg"
  echo "$limit" > "$cg/memory.max"
fi
cleanup() { rmdir "$cg" 2>/dev/null || true; }
trap cleanup EXIT
# Start with a cold page cache where permitted.
sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
sh -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' sh "$cg" "$@"
