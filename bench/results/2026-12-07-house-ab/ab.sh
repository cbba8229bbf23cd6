#!/usr/bin/env bash
# Paired A/B of the house's second pass (issue 55): A = main before it (ce906ed), B = after (37f6004).
set -euo pipefail
cd /work/main
A=/tmp/deltafin-pre55; B=/tmp/deltafin-post55; out=bench/results/2026-12-07-house-ab/record.jsonl
: > $out
echo "start $(date -u +%FT%TZ) $(uptime)" > bench/results/2026-12-07-house-ab/uptime.txt
fx=tests/fixtures/k3-tiny-b
fxp=$(python3 -c "import json;print(','.join(map(str,json.load(open('$fx/reference.json'))['prompt_ids'])))")
wide=/tmp/deltafin-finite-ab/wide-7168
widep=$(python3 -c "print(','.join(str(1 + i % 1000) for i in range(512)))")
demop=$(python3 -c "print(','.join(str(100 + (i * 37) % 4000) for i in range(64)))")
one() { # side bin what args...
  local side=$1 bin=$2 what=$3; shift 3
  local j; j=$("$bin" run "$@" --ignore-eos --format json -q 2>/dev/null)
  python3 -c "
import json,sys
j=json.loads(sys.argv[4]); s=j['stats']
print(json.dumps({'bench':'house_ab','side':sys.argv[1],'binary':sys.argv[2],'workload':sys.argv[3],'decode_tok_s':s['decode_tok_s'],'prefill_tok_s':s['prefill_tok_s'],'ids':j.get('ids') or j.get('output_ids') or j.get('tokens')}))" "$side" "$bin" "$what" "$j" >> $out
}
for r in $(seq 1 15); do
  for side in A B; do
    bin=$A; [ $side = B ] && bin=$B
    one $side $bin fixture_decode --model $fx --prompt-ids "$fxp" --max-new 256
    one $side $bin demo_decode --model demo/kimi-k3-demo --prompt-ids "$demop" --max-new 256 --temperature 0
    one $side $bin wide_decode --model $wide --prompt-ids "$widep" --max-new 32
  done
done
echo "end $(date -u +%FT%TZ) $(uptime)" >> bench/results/2026-12-07-house-ab/uptime.txt
python3 - $out <<'PY'
import json,sys,statistics
rs=[json.loads(l) for l in open(sys.argv[1])]
for w in sorted(set(r['workload'] for r in rs)):
    for m in ('decode_tok_s','prefill_tok_s'):
        a=[r[m] for r in rs if r['workload']==w and r['side']=='A']; b=[r[m] for r in rs if r['workload']==w and r['side']=='B']
        pairs=[y/x for x,y in zip(a,b)]
        ida=[r['ids'] for r in rs if r['workload']==w and r['side']=='A']; idb=[r['ids'] for r in rs if r['workload']==w and r['side']=='B']
        print(json.dumps({'bench':'house_ab_summary','workload':w,'metric':m,'A_median':statistics.median(a),'B_median':statistics.median(b),'B_over_A_median_of_pairs':statistics.median(pairs),'min':min(pairs),'max':max(pairs),'same_ids':ida==idb}))
PY
