#!/usr/bin/env bash
# The drive ladder on emulated drives (issue 32). Needs root; runs with no arguments.
#
# Creates up to four drives -- loop devices (--direct-io=on) over sparse image files, ext4, each
# read-throttled by the blkio cgroup (v1 blkio.throttle.read_bps_device, v2 io.max) in the
# published drives' ratio 13.6 : 7.1 : 7.1 : 5.7 GB/s, scaled to what this disk sustains (with
# margin), plus a per-read latency through dm-delay where the kernel has device-mapper. Synthesizes
# a K3-shaped model (real 17.55 MB experts, top-16) larger than the memory cgroup the runs are held
# to, places it with each policy (mirror: every drive a copy, reads split across them; hot: the
# most-routed experts on the fastest drive by a route trace recorded here with `run
# --trace-routes`, the rest spread by rate; spread by measured rate; and the naive baseline: spread
# with equal shares, i.e. experts striped round-robin with no regard to speed) and runs
# `deltafin bench run` (cold: no expert cache, page cache dropped) on 1, 2, 3 and 4 drives: the
# single drive and the mirror rungs after a 512-token prompt (LADDER_PROMPT), the other policies'
# after a short one (LADDER_SHORT_PROMPT: decode is what they are compared on). Then, on the
# 4-drive mirror: a straggler (one drive throttled to a tenth for part of the run) with hedged
# reads on and off, and a drive lost mid-run (its file system shut down so every read fails, then
# its loop device detached) -- with mirrors (ids must be identical) and without a copy (the naive
# stripe: the run must stop with an error naming the drive).
#
# Writes every `bench run` record, the ladder record, ladder.svg and ladder.txt under
# bench/results/DATE-ladder/ (LADDER_OUT). The last stdout line is the record:
#   rungs[] {drives, policy, decode_s_per_token, bound_s_per_token, bytes_per_token,
#            drive_ceilings_gbps[], ...}, straggler {p99_layer_s_hedged, p99_layer_s_unhedged,
#   ids_identical, hedged_reads, ...}, detached {policy, ids_identical, error, ...}.
# bound_s_per_token = bytes read per decode token / the sum of the rung's drives' ceilings, each
# measured through its throttle by `deltafin place` in this run.
#
# Everything it creates is named ladder-* and removed on exit, SIGINT and SIGTERM included (loop
# devices, mounts, dm devices, cgroups, image files); the synthesized model is kept in LADDER_DIR
# for the next run. Knobs (environment): DELTAFIN_BIN, LADDER_DIR (/var/tmp/ladder-work),
# LADDER_OUT, LADDER_TOTAL_MBPS (sum of the four throttles; default 40% of the disk, at most 340),
# LADDER_MEM (memory cgroup, 2G), LADDER_LAYERS (3: a dense layer and 2 MoE layers),
# LADDER_EXPERTS (32), LADDER_PROMPT (512), LADDER_SHORT_PROMPT (16), LADDER_DECODE (8),
# LADDER_POLICIES ("mirror hot"; any of mirror hot spread), LADDER_DELAY_MS (1, dm-delay's
# per-read latency), LADDER_ONLY (`straggler`: the mirror placement and the straggler runs only).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
say() { echo "drive_ladder: $*" >&2; }
[ "$(id -u)" = 0 ] || { say "needs root (loop devices, mounts, cgroups)"; exit 2; }
for t in losetup mkfs.ext4 mount umount python3 dd; do
  command -v "$t" >/dev/null || { say "needs $t"; exit 2; }
done

work=${LADDER_DIR:-/var/tmp/ladder-work}
out=${LADDER_OUT:-$repo/bench/results/$(date -u +%F)-ladder}
total_mbps=${LADDER_TOTAL_MBPS:-}
mem=${LADDER_MEM:-2G}
layers=${LADDER_LAYERS:-3}
experts=${LADDER_EXPERTS:-32}
prompt=${LADDER_PROMPT:-512}
short_prompt=${LADDER_SHORT_PROMPT:-16}
decode=${LADDER_DECODE:-8}
policies=${LADDER_POLICIES:-mirror hot}
delay_ms=${LADDER_DELAY_MS:-1}
only=${LADDER_ONLY:-}
[ "$only" = straggler ] && policies=mirror
ratios=(13.6 7.1 7.1 5.7)
tag=ladder-$$
mkdir -p "$work" "$out"
runs=$out/runs.jsonl
: > "$runs"

# ---- cleanup, on any exit ----
loops=() mnts=() dms=() cgs=() imgs=() pids=()
# A child that has exited (a zombie until waited for) counts as gone.
alive() { [ -e "/proc/$1" ] && ! grep -q '^[0-9]* (.*) Z' "/proc/$1/stat" 2>/dev/null; }
cleanup() {
  trap - EXIT INT TERM
  for p in "${pids[@]}"; do pkill -TERM -P "$p" 2>/dev/null || true; kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do
    for _ in $(seq 50); do alive "$p" || break; sleep 0.2; done
    kill -KILL "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
  for m in "${mnts[@]}"; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true; rmdir "$m" 2>/dev/null || true; done
  for d in "${dms[@]}"; do dmsetup remove --retry "$d" 2>/dev/null || true; done
  for l in "${loops[@]}"; do losetup -d "$l" 2>/dev/null || true; done
  for c in "${cgs[@]}"; do rmdir "$c" 2>/dev/null || true; done
  for i in "${imgs[@]}"; do rm -f "$i"; done
  rm -f "$work"/model/placement.json
}
trap cleanup EXIT
trap 'say "interrupted; cleaning up"; exit 130' INT TERM

# Children are started in the background and waited for, so that a signal is handled at once.
forget() { local q keep=(); for q in "${pids[@]}"; do [ "$q" = "$1" ] || keep+=("$q"); done; pids=("${keep[@]}"); }
waitfor() { local rc=0; wait "$1" || rc=$?; forget "$1"; return $rc; }
bg() { "$@" & pids+=("$!"); waitfor "$!"; }

# ---- binary and model ----
bin=${DELTAFIN_BIN:-}
if [ -z "$bin" ]; then
  say "building deltafin (set DELTAFIN_BIN to skip)"
  bg nice -n 10 cargo build --release --quiet --bin deltafin
  bin=$repo/target/release/deltafin
fi
model=$work/model
if [ ! -f "$model/config.json" ]; then
  say "synthesizing the model in $model"
  bg "$bin" synth --out "$model" --preset k3-experts --layers "$layers" --experts "$experts" >&2
fi
rm -f "$model/placement.json"
model_bytes=$(du -sb "$model" | cut -f1)

# ---- what this disk sustains: O_DIRECT reads of the model's largest shard ----
shard=$(ls -S "$model"/*.safetensors | head -1)
disk_mbps=$(timeout 20 dd if="$shard" of=/dev/null bs=16M count=64 iflag=direct 2>&1 |
  awk '/copied/ { for (i = 1; i <= NF; i++) if ($i == "copied,") { b = $1; s = $(i + 1) } } END { if (s > 0) printf "%.0f", b / s / 1e6; else print 0 }')
if [ -z "$total_mbps" ]; then
  total_mbps=$(python3 -c "print(max(40, min(340, round(0.4 * $disk_mbps))))")
fi
say "disk reads ${disk_mbps} MB/s with O_DIRECT; the four throttles sum to ${total_mbps} MB/s"
bps=()
for r in "${ratios[@]}"; do bps+=("$(python3 -c "print(int($total_mbps * 1e6 * $r / 33.5))")"); done

# ---- cgroups ----
if [ -d /sys/fs/cgroup/blkio ]; then
  blk=/sys/fs/cgroup/blkio/$tag
  memcg=/sys/fs/cgroup/memory/$tag
  mkdir "$blk" && cgs+=("$blk")
  mkdir "$memcg" && cgs+=("$memcg")
  echo "$mem" > "$memcg/memory.limit_in_bytes"
  throttle() { echo "$1 $2" > "$blk/blkio.throttle.read_bps_device"; }
  into_cgroups() { echo "$1" > "$blk/cgroup.procs"; [ "$2" = mem ] && echo "$1" > "$memcg/cgroup.procs"; true; }
else
  # cgroup v2: one group with io and memory.
  echo "+io +memory" > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true
  blk=/sys/fs/cgroup/$tag
  mkdir "$blk" && cgs+=("$blk")
  memcg=$blk
  throttle() { echo "$1 rbps=$2" > "$blk/io.max"; }
  into_cgroups() { echo "$1" > "$blk/cgroup.procs"; }
  echo "$mem" > "$blk/memory.max"
fi
# deltafin under the throttles (and, for `mem`, the memory cgroup).
dfin() {
  local m=$1
  shift
  ( into_cgroups "$BASHPID" "$m"; exec "$bin" "$@" ) &
  pids+=("$!")
  waitfor "$!"
}

# ---- the drives ----
latency=null
if command -v dmsetup >/dev/null && dmsetup targets 2>/dev/null | grep -q '^delay'; then
  latency=$delay_ms
  say "dm-delay: ${delay_ms} ms per read"
else
  say "dm-delay unavailable here (no device-mapper); no added per-read latency"
fi
img_gb=$(python3 -c "import math; print(math.ceil($model_bytes * 4 / 1e9) + 2)")
devs=() roots=()
for i in 0 1 2 3; do
  img=$work/$tag-img$i
  truncate -s "${img_gb}G" "$img" && imgs+=("$img")
  loop=$(losetup --find --show --direct-io=on "$img") && loops+=("$loop")
  dev=$loop
  if [ "$latency" != null ]; then
    sectors=$(blockdev --getsz "$loop")
    dmsetup create "$tag-d$i" --table "0 $sectors delay $loop 0 $delay_ms" && dms+=("$tag-d$i")
    dev=/dev/mapper/$tag-d$i
  fi
  mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$dev"
  mnt=$work/$tag-d$i
  mkdir -p "$mnt" && mount -o noatime "$dev" "$mnt" && mnts+=("$mnt")
  devs+=("$dev") roots+=("$mnt")
  throttle "$(lsblk -dno MAJ:MIN "$dev" | tr -d ' ')" "${bps[$i]}"
done
majmin() { lsblk -dno MAJ:MIN "${devs[$1]}" | tr -d ' '; }

# ---- placements ----
# place NAME POLICY K [RATES...]: the model on drives 0..K-1 (in subdirectories NAME), its
# manifest kept as $work/NAME.json.
place() {
  local name=$1 policy=$2 k=$3
  shift 3
  local args=() i
  [ "$policy" = hot ] && args+=(--trace "$work/routes.json")
  for ((i = 0; i < k; i++)); do
    mkdir -p "${roots[$i]}/$name"
    if [ $# -gt 0 ]; then args+=(--drive "${roots[$i]}/$name=$1"); shift; else args+=(--drive "${roots[$i]}/$name"); fi
  done
  say "placing $name ($policy on $k drives)"
  dfin nomem place --model "$model" --policy "$policy" --shards off --probe-mb 256 --probe-seconds 2 "${args[@]}" >&2
  mv "$model/placement.json" "$work/$name.json"
}
place mirror4 mirror 4
mapfile -t ceil < <(python3 -c "import json,sys; [print(d['gbps']) for d in json.load(open(sys.argv[1]))['drives']]" "$work/mirror4.json")
say "drive ceilings through the throttles (GB/s): ${ceil[*]}"
case " $policies " in *" hot "*)
  # The route trace `hot` places by: a short greedy decode of this model, read from its shards.
  say "recording a route trace"
  dfin nomem run --model "$model" --prompt-ids "$(seq -s, 1 16)" --max-new 24 --ignore-eos --format json \
    --trace-routes "$work/routes.json" > /dev/null
  ;;
esac
[ "$only" = straggler ] || for k in 2 3 4; do
  case " $policies " in *" spread "*) place "spread$k" spread "$k" "${ceil[@]:0:$k}" ;; esac
  case " $policies " in *" hot "*) place "hot$k" hot "$k" "${ceil[@]:0:$k}" ;; esac
  place "naive$k" spread "$k" 1 1 1 1
done

# ---- the ladder ----
# bench NAME PLACEMENT DRIVES [extra bench run args]: one `bench run`, its record kept as NAME.
bench() {
  local name=$1 placement=$2 drives=$3
  shift 3
  say "run $name (drives $drives)"
  dfin mem bench run --model "$model" --placement "$work/$placement.json" --use-drives "$drives" \
    --expert-cache-gb 0 --expert-heat off "$@" > "$work/$name.out" || return
  tail -1 "$work/$name.out" | python3 -c "import json,sys; r=json.load(sys.stdin); r['ladder_run']='$name'; print(json.dumps(r))" >> "$runs"
}
ladder_args=(--prompt-tokens "$prompt" --decode "$decode" --ceiling-seconds 1)
short_args=(--prompt-tokens "$short_prompt" --decode "$decode" --ceiling-seconds 0)
[ "$only" = straggler ] || bench rung1 mirror4 0 "${ladder_args[@]}"
[ "$only" = straggler ] || for k in 2 3 4; do
  drives=$(seq -s, 0 $((k - 1)))
  for p in $policies; do
    if [ "$p" = mirror ]; then bench "rung$k-mirror" mirror4 "$drives" "${ladder_args[@]}"; else bench "rung$k-$p" "$p$k" "$drives" "${short_args[@]}"; fi
  done
  bench "rung$k-naive" "naive$k" "$drives" "${short_args[@]}"
done

# ---- the straggler: drive 0 (the fastest) at a tenth from FROM to TO seconds into the run ----
fault_args=(--prompt-tokens 16 --decode 16 --ceiling-seconds 0)
slow=0 from=${LADDER_STRAGGLE_FROM:-12} to=${LADDER_STRAGGLE_TO:-40}
straggle() {
  sleep "$from"
  throttle "$(majmin $slow)" $((bps[slow] / 10))
  sleep $((to - from))
  throttle "$(majmin $slow)" "${bps[$slow]}"
}
# Hedging on and off with split reads (the store as it runs), and `whole`: neither hedged nor split
# reads (each expert read whole from one copy, the store before 18fa516): what reading the other
# copies buys against a straggler.
for h in on off whole; do
  straggle &
  timer=$!
  pids+=("$timer")
  if [ "$h" = whole ]; then copies=(--hedge off --split-reads off); else copies=(--hedge "$h"); fi
  bench "straggler-hedge-$h" mirror4 0,1,2,3 "${fault_args[@]}" "${copies[@]}"
  kill "$timer" 2>/dev/null || true
  waitfor "$timer" || true
  throttle "$(majmin $slow)" "${bps[$slow]}"
done

# ---- a lost drive: its file system shut down mid-run (every read fails), then detached ----
writes() { # sectors written to the drives other than $1
  local s=0 i
  for i in 0 1 2 3; do [ "$i" = "$1" ] || s=$((s + $(awk '{print $7}' "/sys/block/$(basename "$(readlink -f "${devs[$i]}")")/stat"))); done
  echo $s
}
lose() { # lose DRIVE AFTER_S
  sleep "$2"
  say "drive $1 (${roots[$1]}) lost: file system shut down, loop device detached"
  python3 -c "
import fcntl, os, struct, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.ioctl(fd, 0x8004587D, struct.pack('I', 2))  # EXT4_IOC_SHUTDOWN, NOLOGFLUSH
" "${roots[$1]}"
  umount -l "${roots[$1]}" || true
  losetup -d "${loops[$1]}" 2>/dev/null || true
}
lost_run() { # lost_run NAME PLACEMENT DRIVES LOST
  local name=$1 before rc=0
  before=$(writes "$4")
  lose "$4" 6 &
  local t=$!
  pids+=("$t")
  bench "$name" "$2" "$3" "${fault_args[@]}" 2> "$work/$name.err" || rc=$?
  waitfor "$t" || true
  echo "{\"ladder_run\": \"$name-status\", \"placement\": \"$2\", \"rc\": $rc, \"lost_drive\": $4, \"other_drives_sectors_written\": $(($(writes "$4") - before)), \"stderr_tail\": $(tail -3 "$work/$name.err" | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read()))')}" >> "$runs"
  cat "$work/$name.err" >&2
}
# Without a copy (the naive stripe), then on the mirror (the drive lost first stays lost).
if [ "$only" != straggler ]; then
  lost_run lost-single naive4 0,1,2,3 2
  lost_run lost-mirror mirror4 0,1,3 3
fi

# ---- the record and the plots ----
python3 "$repo/bench/drive_ladder_record.py" "$runs" "$out" "$disk_mbps" "$total_mbps" "$latency" "$mem" \
  "$(printf '%s,' "${ceil[@]}")" "$0 (LADDER_* = $(env | grep '^LADDER_' | tr '\n' ' '))"
exit 0
