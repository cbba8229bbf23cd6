#!/usr/bin/env bash
# One training stage on a CUDA machine, for the device tool: outputs and logs go to $OUT (the
# checkpoint as a tar split into 15 MB parts, which the tool brings back). Usage:
#   bash train/device.sh target [train.py options]   # trains, exports and scores the K3 model
#   bash train/device.sh dspark [train.py options]   # needs the target in $WORK (or untarred in train/out)
set -euo pipefail
stage=$1
shift
export PYTHONUNBUFFERED=1
W=${WORK:-/tmp/deltafin-train}
OUT=${OUT:-/tmp/deltafin-out}
mkdir -p "$W" "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c 'import torch, tiktoken, safetensors; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
if [ ! -d "$W/kimi-k3-demo" ] && [ -d train/out/kimi-k3-demo ]; then cp -r train/out/kimi-k3-demo "$W/"; fi
case $stage in
target)
    python3 train/train.py target --out "$W" "$@" 2>&1 | grep -v UserWarning | tee "$OUT/target.log"
    python3 train/train.py eval --out "$W" 2>&1 | grep -v UserWarning | tee "$OUT/eval.log"
    # A short drafter run in a scratch directory: proves the next stage runs here.
    mkdir -p "$W/smoke" && cp -r "$W/kimi-k3-demo" "$W/smoke/"
    python3 train/train.py dspark --out "$W/smoke" --draft-seqs 64 --gen-batch 64 --draft-steps 20 \
        --log-every 10 --eval-every 10 2>&1 | grep -v UserWarning | tail -5 | tee "$OUT/dspark-smoke.log"
    files="kimi-k3-demo train_target.json report.json" ;;
dspark)
    python3 train/train.py dspark --out "$W" "$@" 2>&1 | grep -v UserWarning | tee "$OUT/dspark.log"
    files="kimi-k3-demo-dspark train_dspark.json" ;;
*) echo "unknown stage $stage" >&2; exit 2 ;;
esac
(cd "$W" && tar cf - $files) | split -b 15M - "$OUT/$stage.tar.part-"
ls -la "$OUT"
