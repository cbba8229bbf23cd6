#!/usr/bin/env bash
# Speculative decoding on a model larger than the memory limit: `bench run --draft off|ngram|dspark|
# oracle`, each cold in its own memory cgroup, same prompt; then one summary JSON record with each
# drafter's decode tok/s, expert bytes read per emitted token and acceptance, and the ratios to
# drafting off. The model is a K3-shaped synth with real expert size whose token embeddings are
# scaled x64 and vocabulary is small, so its greedy output falls into short cycles (repetitive
# text, where n-gram drafts pay); the DSpark drafter is a random-weight one (`synth --dspark`).
#   bench/spec.sh [WORKDIR] [CGROUP_LIMIT] [DECODE]   (defaults: /tmp/deltafin-spec 2G 64; needs root)
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-/tmp/deltafin-spec}
limit=${2:-2G}
decode=${3:-64}
mkdir -p "$work"
cargo build --release --quiet
bin=$PWD/target/release/deltafin
model=$work/rep
draft=$work/rep-dspark
[ -f "$model/config.json" ] || $bin synth --out "$model" --preset k3-experts --layers 4 --experts 96 --vocab 512 --embed-scale 64
[ -f "$draft/config.json" ] || $bin synth --dspark --target "$model" --out "$draft" --layers 1 --dense-inter 1024 --taps 1,3
out=$work/spec-$(date +%Y%m%d-%H%M%S).jsonl
for d in off ngram dspark oracle; do
  bench/in_cgroup.sh "$limit" "$bin" bench run --model "$model" --prompt-tokens 64 --decode "$decode" \
    --ceiling-seconds 0 --draft "$d" --draft-model "$draft" --out "$out" >/dev/null
done
python3 - "$out" "$limit" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
by = {r["decode"]["draft"] if r["decode"]["draft"] != "scripted" else "oracle": r for r in recs}
off = by["off"]
def row(r):
    d = r["decode"]
    return {"decode_tok_s": d["decode_tok_s"], "bytes_read_per_token": d["bytes_read_per_token"],
            "expert_bytes_requested_per_token": d["expert_bytes_requested_per_token"],
            "drafts_proposed": d["drafts_proposed"], "drafts_accepted": d["drafts_accepted"],
            "acceptance": d["draft_acceptance"], "cost_model_pauses": d["cost_model_pauses"],
            "tok_s_ratio_to_off": d["decode_tok_s"] / off["decode"]["decode_tok_s"],
            "bytes_per_token_ratio_to_off": (d["bytes_read_per_token"] / off["decode"]["bytes_read_per_token"])
                if off["decode"]["bytes_read_per_token"] else None,
            "same_output_as_off": r["output_ids"] == off["output_ids"]}
summary = {"bench": "spec", "records": sys.argv[1], "cgroup_limit": sys.argv[2],
           "expert_bytes_total": off.get("expert_bytes_total"), "date": off.get("date"), "git": off.get("git"), "machine": off.get("machine"),
           "decode_steps": off["decode"]["steps"], "drafters": {k: row(v) for k, v in by.items()}}
print(json.dumps(summary))
PY
