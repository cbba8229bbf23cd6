#!/usr/bin/env bash
# After the mend of 2026-12-02 (lent H200, device tool, repo root, .gl/ and .dev/ as for bench/h200.sh):
# the gpu tests of the batched experts and products, two decode runs on one adapter at once (same
# ids), and a device cache larger than the device (a clear error before any work).
set -u
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
mkdir -p /work && { [ -e /work/main ] || ln -s "$PWD" /work/main; }
.dev/gpu-test --test-threads 1 --nocapture batched device_expert_cache fixtures_on gpu_products 2>&1 | grep -v XDG_RUNTIME > $OUT/gpu-test.log
grep -E "^test .*(ok|FAILED)$|test result|batched experts" $OUT/gpu-test.log
M=/tmp/k3kda
.dev/deltafin synth --preset k3-experts --layers 4 --experts 32 --kda-heads 96 --out $M 2>&1 | tail -1
( .dev/deltafin bench run --model $M --prompt-tokens 64 --decode 16 --backend gpu --gpu-cache-gb 4 --out $OUT/a.jsonl 2>&1 | grep -v XDG | tail -1 | cut -c1-80 ) &
( .dev/deltafin bench run --model $M --prompt-tokens 64 --decode 16 --backend gpu --gpu-cache-gb 4 --out $OUT/b.jsonl 2>&1 | grep -v XDG | tail -1 | cut -c1-80 ) &
wait
python3 -c "
import json
a=json.loads(open('$OUT/a.jsonl').read()); b=json.loads(open('$OUT/b.jsonl').read())
print('two at once: same ids', a['output_ids']==b['output_ids'], a['decode']['seconds_per_token'], b['decode']['seconds_per_token'], a['output_ids'][:4])"
echo "== cache larger than the device:"
.dev/deltafin run --model $M --prompt-ids 1,2,3 --max-new 2 --backend gpu --gpu-cache-gb 400 2>&1 | grep -v XDG | tail -3; echo "exit $?"
