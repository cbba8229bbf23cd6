#!/usr/bin/env bash
# Whether the SM clock explains the matvec's ratio to the plain read (lent H200, device tool, repo
# root, .gl/ and .dev/ as for bench/h200.sh): bench kernels --backend gpu at 20, 200 and 2,000
# repetitions with nvidia-smi sampling the clocks every 100 ms beside it. Writes $OUT/kernels.jsonl,
# $OUT/clk.txt and $OUT/marks.txt (when each run started). Record: results-2026-12-02-h200-kernels-clock.*
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
B=.dev/deltafin
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,clocks.mem,power.draw,utilization.gpu --format=csv -lms 100 > $OUT/clk.txt &
M=$!
for reps in 20 200 2000; do
  echo "== reps $reps $(date +%s.%N)" >> $OUT/marks.txt
  $B bench kernels --backend gpu --reps $reps 2>&1 | grep -v XDG_RUNTIME >> $OUT/kernels.jsonl
done
echo "== end $(date +%s.%N)" >> $OUT/marks.txt
kill $M
