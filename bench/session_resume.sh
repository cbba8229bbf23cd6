#!/usr/bin/env bash
# Time to first token of a follow-up turn resumed from a session file vs a cold prefill of the
# whole conversation (issue 44), in a memory cgroup (v1, root) smaller than the model, page cache
# dropped before each run: turn 1 (N1 prompt ids, 4 new tokens) saves the session; turn 2 (N2 new
# ids) resumes it; the cold run prefills turn 1 + its answer + turn 2 in one process. Prints one
# JSON record: both TTFTs, their ratio, whether turn 2's ids equal the cold run's, bytes read.
#   BIN=target/release/deltafin M=MODEL LIM=450M N1=512 N2=16 OUT=DIR bench/session_resume.sh
# The model used: deltafin synth --out M --layers 4 --experts 896 --top-k 16 --hidden 2048
#   --expert-inter 1024 --seed 44  (K3's 896 experts and top-16; 658 MB)
set -euo pipefail
BIN=${BIN:-target/release/deltafin}; M=${M:?set M to the model directory}; LIM=${LIM:-256M}; OUT=${OUT:-/tmp/deltafin-session-resume}
N1=${N1:-512}; N2=${N2:-16}
mkdir -p "$OUT"; rm -f "$OUT"/s.dfstate
cg=/sys/fs/cgroup/memory/deltafin-sess; mkdir -p $cg; echo $LIM > $cg/memory.limit_in_bytes
P1=$(python3 -c "import random;r=random.Random(1);print(','.join(str(r.randrange(10,2000)) for _ in range($N1)))")
P2=$(python3 -c "import random;r=random.Random(2);print(','.join(str(r.randrange(10,2000)) for _ in range($N2)))")
run() { sync; echo 3 > /proc/sys/vm/drop_caches; sh -c "echo \$\$ > $cg/tasks; exec nice -n 10 $BIN run --model $M --threads 2 $*"; }
run --prompt-ids "$P1" --max-new 4 --ignore-eos --format json --session "$OUT/s.dfstate" --stats-json "$OUT/t1.json" -q > "$OUT/t1.out"
O1=$(python3 -c "import json;print(','.join(map(str,json.load(open('$OUT/t1.out'))['output_ids'])))")
run --prompt-ids "$P2" --max-new 4 --ignore-eos --format json --session "$OUT/s.dfstate" --stats-json "$OUT/t2.json" -q > "$OUT/t2.out"
run --prompt-ids "$P1,$O1,$P2" --max-new 4 --ignore-eos --format json --stats-json "$OUT/cold.json" -q > "$OUT/cold.out"
ls -la "$OUT/s.dfstate"
python3 - "$OUT" <<'PY'
import json,sys
o=sys.argv[1]
t2=json.load(open(o+'/t2.json')); c=json.load(open(o+'/cold.json'))
a=json.load(open(o+'/t2.out')); b=json.load(open(o+'/cold.out'))
def ttft(s):
    for k in ('ttft_s','time_to_first_token_s'):
        if k in s: return s[k]
    return s.get('stats',s).get('ttft_s')
print(json.dumps({"bench":"session_resume","resumed_ttft_s":ttft(t2),"cold_ttft_s":ttft(c),"ratio":ttft(t2)/ttft(c),"same_ids":a['output_ids']==b['output_ids'],"resumed_bytes_read":t2.get('expert_bytes_read'),"cold_bytes_read":c.get('expert_bytes_read')}))
PY
