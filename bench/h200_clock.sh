set -u
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
