#!/usr/bin/env bash
# Round 6 of the one-row MXFP4 kernel (lent H200, device tool, repo root, .gl/ and .dev/ as for
# bench/h200.sh): the r6 variants (bench/matvec_variants/variants_r6.py: tile width, workgroups per
# SM, when the next tile is stored, a copying warp) at the bench's 49152 rows and at 4x that.
set -u
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
python3 bench/matvec_variants/variants_r6.py /tmp/r6
for rows in 49152 196608 49152 98304; do
  if ! timeout 120 .dev/deltafin bench kernels --backend gpu --reps 200 --matvec-rows $rows --matvec-variants /tmp/r6 2>/dev/null > /tmp/rec.json; then
    echo "rows $rows: no record (exit $?)"; continue
  fi
  cat /tmp/rec.json >> $OUT/r6.jsonl
  python3 -c "
import json,sys
d=json.load(open('/tmp/rec.json')); print('rows', d['mxfp4_matvec_shape'], 'read', round(d['mxfp4_plain_read_gb_s']), 'matvec', round(d['mxfp4_matvec_weight_gb_s']), round(d['mxfp4_matvec_vs_read'],3))
for k,v in d.items():
  if k.endswith('_vs_read') and k.startswith('variant_'):
    n=k[8:-8]; print('  %-20s %5.0f GB/s %.3f %s' % (n, d['variant_'+n+'_gb_s'], v, d['variant_'+n+'_bits_equal']))
  elif k.endswith('_error'): print(k, v[:200])"
done
