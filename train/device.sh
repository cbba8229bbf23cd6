#!/usr/bin/env bash
# One training stage on a CUDA machine, for the device tool: outputs and logs go to $OUT (the
# checkpoint as a tar split into 15 MB parts, which the tool brings back). From the repo root:
#   bash train/device.sh target [train.py options]   # trains, exports and scores the K3 model
#   bash train/device.sh chat [train.py options]     # chat tuning of the target (in $WORK, train/out or demo/)
#   bash train/device.sh dspark [train.py options]   # the drafter; needs the target in $WORK, train/out or demo/
# The token streams are not in git (train/data/ is built here: train/README.md); the device tool
# carries them as ignored paths: carry train/data/train.bin, train/data/heldout.bin,
# train/data/heldout.txt and train/data/heldout.jsonl (14 MB), and for `dspark` also
# train/out/kimi-k3-demo (the target, 21 MB; not needed when the machine still has $WORK from the
# target stage).
set -euo pipefail
stage=$1
shift
export PYTHONUNBUFFERED=1
W=${WORK:-/tmp/deltafin-train}
OUT=${OUT:-/tmp/deltafin-out}
mkdir -p "$W" "$OUT"
for f in train.bin heldout.bin heldout.txt; do
    [ -f "train/data/$f" ] || { echo "train/data/$f is missing: carry it (see the top of train/device.sh)" >&2; exit 2; }
done
if [ "$stage" != target ] && [ ! -f train/data/train.jsonl ] && [ ! -f train/data/train.jsonl.gz ]; then
    echo "train/data/train.jsonl(.gz) is missing: carry it (chat data and chat prompts are built from it)" >&2; exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c 'import torch, tiktoken, safetensors; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
# The target to tune or distil from: $WORK's (a warm machine), else train/out's (carried), else
# demo/'s (the working tree's, when the carry limit leaves no room for a second copy).
if [ "$stage" != target ] && [ ! -d "$W/kimi-k3-demo" ]; then
    for src in train/out/kimi-k3-demo demo/kimi-k3-demo; do
        [ -d "$src" ] && { cp -r "$src" "$W/"; echo "target from $src"; break; }
    done
fi
case $stage in
target)
    python3 train/train.py target --out "$W" "$@" 2>&1 | grep -v UserWarning | tee "$OUT/target.log"
    python3 train/train.py eval --out "$W" 2>&1 | grep -v UserWarning | tee "$OUT/eval.log"
    files="kimi-k3-demo train_target.json report.json" ;;
chat)
    [ -d "$W/kimi-k3-demo" ] || { echo "no target: carry train/out/kimi-k3-demo or run the target stage first" >&2; exit 2; }
    python3 train/train.py chat --out "$W" "$@" 2>&1 | grep -v UserWarning | tee "$OUT/chat.log"
    files="kimi-k3-demo train_chat.json report.json" ;;
dspark)
    [ -d "$W/kimi-k3-demo" ] || { echo "no target: carry train/out/kimi-k3-demo or run the target stage first" >&2; exit 2; }
    python3 train/train.py dspark --out "$W" "$@" 2>&1 | grep -v UserWarning | tee "$OUT/dspark.log"
    files="kimi-k3-demo-dspark train_dspark.json" ;;
*) echo "unknown stage $stage" >&2; exit 2 ;;
esac
(cd "$W" && tar cf - $files) | split -b 15M - "$OUT/$stage.tar.part-"
ls -la "$OUT"
