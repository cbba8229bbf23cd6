#!/usr/bin/env bash
# decode helper's A/B: new (read-ahead) vs base, N=8 and N=32, interleaved.
cd /work/wt-decode
for n in 8 32; do
  for v in new base; do
    echo "$(date -u +%T) $v N=$n" >> /work/big-decode/out/ab.log
    nice -n 5 bash bench/in_cgroup.sh 1536M /work/big-decode/deltafin-$v bench run --model /work/big-decode/k3b --batch $n --prompt-tokens 32 --decode 9 --out /work/big-decode/out/ab-$v.jsonl > /dev/null 2>>/work/big-decode/out/ab.err
  done
done
echo "$(date -u +%T) done" >> /work/big-decode/out/ab.log
