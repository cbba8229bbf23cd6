#!/usr/bin/env bash
# Swaps newly trained checkpoints into the repository in one step, and regenerates everything
# that derives from them. From the repository root:
#
#   bash train/install.sh OUTDIR RUN_NAME        # e.g. bash train/install.sh /tmp/k3-run 2026-12-05-h100
#   bash train/install.sh --dry-run OUTDIR RUN_NAME   # only the load checks; says what it would do
#
# OUTDIR holds what train/device.sh brought back, untarred (`cat target.tar.part-* | tar x -C
# OUTDIR`, the same for dspark.tar.part-*), plus the stage logs: kimi-k3-demo/,
# kimi-k3-demo-dspark/, train_target.json, train_dspark.json, report.json and, when present,
# target.log, eval.log, dspark.log. Either checkpoint may be missing (then only the other is
# installed and the old one stays).
#
# What derives from the checkpoints, and what this script does about each:
#   demo/kimi-k3-demo/, demo/kimi-k3-demo-dspark/   replaced (embedded in the binary by build.rs;
#                                                   users' laid-out copies are replaced on first use
#                                                   through the demo manifest check, src/demo.rs)
#   train/runs/RUN_NAME/                           the run's record (json, logs)
#   tests/fixtures/trained/                        rewritten by train/make_fixture.py (the training
#                                                   forward and the fp64 reference on held-out text,
#                                                   greedy tokens, the score excerpt's perplexity)
#   target/release/deltafin                        rebuilt (cargo build --release)
#   tests that read the demo                       run: trained (fixture, drafter acceptance >= 0.3,
#                                                   score), trunk (coded trunk ratio < 0.72), demo,
#                                                   lanes, score_compare, text_cli, context
# Not touched (say so in the commit): tests/fixtures/routes/ (the old model's route traces; still
# valid inputs of tests/cache_policy.rs, which takes only the layout from demo/), the numbers in
# docs/demo-model.md, train/README.md and README.md (written by hand from the run's record), and
# bench/results/ (rerun bench/drafts.py and bench/route_overlap.py for the new records).
#
# Needs /opt/trainenv (train/requirements.txt; CPU torch is enough) or PYTHON=..., and train/data
# (train/README.md) for the fixture. Nothing is committed; `git status` shows the changes.
set -euo pipefail
dry=0
if [ "${1:-}" = --dry-run ]; then dry=1; shift; fi
[ $# -eq 2 ] || { sed -n 2,32p "$0" >&2; exit 2; }
src=$(cd "$1" && pwd)
run=$2
PY=${PYTHON:-/opt/trainenv/bin/python}
cd "$(dirname "$0")/.."
[ -d "$src/kimi-k3-demo" ] || [ -d "$src/kimi-k3-demo-dspark" ] || { echo "$src has neither kimi-k3-demo/ nor kimi-k3-demo-dspark/" >&2; exit 2; }
[ -f train/data/heldout.jsonl ] || { echo "train/data/heldout.jsonl is missing: build the corpus first (train/README.md)" >&2; exit 2; }
"$PY" -c 'import torch, safetensors, tiktoken, numpy' || { echo "set PYTHON to a Python with train/requirements.txt" >&2; exit 2; }

# 1. Check before replacing anything: the checkpoints load in the training code and in a fresh
#    deltafin (the binary as built now reads any K3-layout model directory).
if [ -d "$src/kimi-k3-demo" ]; then
    "$PY" -c "import sys; sys.path.insert(0, 'train'); from k3 import export; export.load_model('$src/kimi-k3-demo')"
    target/release/deltafin run --model "$src/kimi-k3-demo" --prompt "The" --max-new 4 --temperature 0 -q >/dev/null
fi
if [ -d "$src/kimi-k3-demo-dspark" ]; then
    m=$src/kimi-k3-demo; [ -d "$m" ] || m=demo/kimi-k3-demo
    target/release/deltafin run --model "$m" --draft dspark --draft-model "$src/kimi-k3-demo-dspark" \
        --prompt "The" --max-new 8 --temperature 0 -q >/dev/null
fi

if [ $dry = 1 ]; then
    echo "checks passed; would replace:$( [ -d "$src/kimi-k3-demo" ] && echo " demo/kimi-k3-demo")$( [ -d "$src/kimi-k3-demo-dspark" ] && echo " demo/kimi-k3-demo-dspark"),"
    echo "write train/runs/$run/, regenerate tests/fixtures/trained/, rebuild, run the tests that read the demo"
    exit 0
fi

# 2. Swap the files (whole directories: a different shard count leaves no stale shard behind).
for d in kimi-k3-demo kimi-k3-demo-dspark; do
    if [ -d "$src/$d" ]; then
        rm -rf "demo/$d.new" && cp -r "$src/$d" "demo/$d.new"
        rm -rf "demo/$d" && mv "demo/$d.new" "demo/$d"
        echo "installed demo/$d ($(du -sh "demo/$d" | cut -f1))"
    fi
done

# 3. The run's record.
mkdir -p "train/runs/$run"
for f in train_target.json train_chat.json train_dspark.json report.json target.log eval.log chat.log dspark.log; do
    [ -f "$src/$f" ] && cp "$src/$f" "train/runs/$run/"
done
echo "record: train/runs/$run/ ($(ls "train/runs/$run" | tr '\n' ' '))"

# 4. The exactness fixture from the installed model.
"$PY" train/make_fixture.py --model demo/kimi-k3-demo --out tests/fixtures/trained

# 5. Rebuild (build.rs embeds demo/) and run the tests that read the demo model.
touch build.rs
cargo build --release
failed=""
for t in trained trunk demo lanes score_compare text_cli context; do
    if cargo test --release --test "$t" -- --nocapture >"target/install-test-$t.log" 2>&1; then
        grep -E "accepted|relative|score --text|test result" "target/install-test-$t.log" || true
    else
        failed="$failed $t"
        echo "FAILED: cargo test --release --test $t (log: target/install-test-$t.log)" >&2
    fi
done
[ -z "$failed" ] || { echo "tests failed:$failed" >&2; exit 1; }
echo "done: review git status, update docs/demo-model.md and train/README.md from train/runs/$run/, rerun bench/drafts.py"
