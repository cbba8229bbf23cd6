#!/usr/bin/env bash
# Round 11 of the one-row MXFP4 kernel (lent H200, device tool, repo root, .gl/ and .dev/ as for
# bench/h200.sh, plus .dev/zstd for bench/sass/dump.py): the r11 variants (inputs through
# workgroup memory; two lanes per thread) at 49152 and 98304 rows, each with its SASS summary
# from the driver's cache (registers decide how many warps an SM holds). A baseline run with no
# variant gives the shipped pipelines' SASS first; each variant's dump then leaves them out.
# Other variants of variants_r6.py by name: bench/h200_r11.sh r12_spread r12_spread_xs
set -u
variants=${*:-r6_t8 r11_xs r11_lanes2 r11_lanes2_r16 r11_lanes2_r32}
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig >/dev/null 2>&1
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json PATH=/usr/local/cuda/bin:$PATH ZSTD=$PWD/.dev/zstd
python3 bench/matvec_variants/variants_r6.py /tmp/r6 > /dev/null
rm -rf ~/.cache/nvidia /tmp/none; mkdir -p /tmp/none
timeout 60 .dev/deltafin bench kernels --backend gpu --reps 2 --matvec-variants /tmp/none > /dev/null 2>&1
echo "== shipped pipelines"
timeout 90 python3 bench/sass/dump.py ~/.cache/nvidia --out $OUT/shipped.sass.txt --min-hadd2 8 --hashes-out /tmp/base.hashes
for v in $variants; do
  rm -rf ~/.cache/nvidia /tmp/one; mkdir -p /tmp/one; cp /tmp/r6/$v.wgsl /tmp/one/
  for rows in 49152 98304; do
    if timeout 60 .dev/deltafin bench kernels --backend gpu --reps 200 --matvec-rows $rows --matvec-variants /tmp/one 2>/dev/null > /tmp/rec.json; then
      cat /tmp/rec.json >> $OUT/r11.jsonl
      python3 -c "
import json; d=json.load(open('/tmp/rec.json')); n='$v'
print('$rows shipped %.0f GB/s %.3f; %s %.0f GB/s %.3f bits %s' % (d['variant_shipped_gb_s'], d['variant_shipped_vs_read'], n, d.get('variant_'+n+'_gb_s', 0), d.get('variant_'+n+'_vs_read', 0), d.get('variant_'+n+'_bits_equal')))"
    else
      echo "$v $rows: no record (exit $?)"
    fi
  done
  echo "== $v"
  timeout 90 python3 bench/sass/dump.py ~/.cache/nvidia --out $OUT/$v.sass.txt --exclude /tmp/base.hashes
done
