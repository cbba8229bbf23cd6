#!/usr/bin/env bash
# issue 30 (helper trunk) on the lent H200: bf16 vs coded trunk, interleaved, --backend gpu and the
# host's CPU, on the trained demo and a K3-shaped synth drawn from it. Files under $OUT.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
for f in "$D"/gl/*.deb; do dpkg -x "$f" /; done
ldconfig
icd=$(find /usr/local/nvidia /usr/share/vulkan /etc/vulkan /usr/lib -name 'nvidia_icd*.json' 2>/dev/null | head -1)
echo "icd: $icd"; ldconfig -p | grep -E "libvulkan|libGLdispatch|libnvidia-glcore|libGLX_nvidia" | head -5
[ -n "$icd" ] && export VK_DRIVER_FILES=$icd
export VK_LOADER_DEBUG=error
B=/tmp/deltafin
xz -dc "$D/deltafin.xz" > $B 2>/dev/null || python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" "$D/deltafin.xz" $B
chmod +x "$B"
out=${OUT:-/tmp/out}
mkdir -p "$out"
export DELTAFIN_CACHE=/tmp/dfcache
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; grep -m1 "model name" /proc/cpuinfo; grep -o 'avx512vbmi2' /proc/cpuinfo | head -1; } | tee "$out/machine.txt"
$B run --demo --prompt-ids 1 --max-new 1 >/dev/null 2>&1
DEMO=$DELTAFIN_CACHE/demo-v2
$B pack-trunk --model "$DEMO" --json > "$out/pack-demo.json" 2>&1
K=/tmp/k3t
[ -f $K/config.json ] || $B synth --out $K --preset k3-experts --layers 3 --experts 8 --top-k 2 --kda-heads 96 --mla-heads 96 --trunk-values-from demo 2>&1 | tail -1
$B pack-trunk --model $K --json > "$out/pack-k3t.json" 2>&1
$B bench run --model "$DEMO" --trunk bf16 --backend gpu --prompt-tokens 8 --decode 2 --ceiling-seconds 0 --expert-heat off 2>&1 | grep -v '^{' | head -20
cat "$out"/pack-*.json | cut -c1-600
t0=$(date +%s)
for r in 1 2 3; do for t in bf16 coded; do
  $B bench run --model $K --trunk $t --backend gpu --prompt-tokens 64 --decode 16 --ceiling-seconds 0 --expert-heat off --out "$out/run-k3t-gpu.jsonl" >/dev/null 2>>"$out/err.txt"
done; done
echo "k3t gpu $(( $(date +%s) - t0 )) s"
for r in 1 2 3; do for t in bf16 coded; do
  $B bench run --model "$DEMO" --trunk $t --backend gpu --prompt-tokens 256 --decode 32 --ceiling-seconds 0 --expert-heat off --out "$out/run-demo-gpu.jsonl" >/dev/null 2>>"$out/err.txt"
done; done
echo "demo gpu $(( $(date +%s) - t0 )) s"
echo "k3t cpu $(( $(date +%s) - t0 )) s"
tail -5 "$out/err.txt" 2>/dev/null
python3 - "$out"/run-*.jsonl <<'PY' | tee "$out/summary.txt"
import json, sys, statistics as st
for path in sys.argv[1:]:
    rows = [json.loads(l) for l in open(path) if l.strip()]
    pairs = [(a, b) for a, b in zip(rows, rows[1:]) if a["engine_config"]["trunk"] == "bf16" and b["engine_config"]["trunk"] == "coded"]
    if not pairs: continue
    d = lambda r: r["decode"]["seconds_per_token"]; p = lambda r: r["ttft_s"]
    print(path.split("/")[-1], len(pairs), "rounds; ids identical:", all(a["output_ids"] == b["output_ids"] for a, b in pairs), "backend", rows[0].get("backend_used"))
    print("  decode bf16 %.5f coded %.5f; ratios %s median %.3f" % (st.median(d(a) for a, _ in pairs), st.median(d(b) for _, b in pairs), [round(d(b)/d(a), 3) for a, b in pairs], st.median(d(b)/d(a) for a, b in pairs)))
    print("  ttft bf16 %.4f coded %.4f; ratios %s median %.3f" % (st.median(p(a) for a, _ in pairs), st.median(p(b) for _, b in pairs), [round(p(b)/p(a), 3) for a, b in pairs], st.median(p(b)/p(a) for a, b in pairs)))
PY
