#!/usr/bin/env bash
# The colibri peer benchmark: deltafin and colibri's Kimi K3 engine (github JustVugg/colibri,
# c/kimi_k3.c, pure C) on the same K3-layout checkpoints deltafin runs, one JSON record:
#  - quality, on the trained demo (demo/kimi-k3-demo): teacher-forced logits over held-out text
#    (tests/fixtures/trained) against the fp64 reference and against deltafin, top-1 agreement and
#    greedy continuations, for deltafin and for colibri in its default (lossy) mode and its most
#    exact settings (bench/peer_quality.py);
#  - speed, on a K3-shaped synth several times the memory limit (the model of bench/peer_llama.sh):
#    both engines in the same memory cgroup, cold page cache, same drive, same prompt ids, same
#    threads, the same expert-cache budget: TTFT of the prompt, decode tok/s, expert bytes read
#    per token (/proc/PID/io), peak RSS, and each run's bound (read bytes / the disk rate deltafin
#    probed, and compute at the engine's own measured compute time) (bench/peer_colibri_record.py).
#
#   bench/peer_colibri.sh [--limit 3G] [--prompt 512] [--decode 32] [--threads 2] [--out FILE]
#                         [--modes default,exact] [--quality-only | --speed-only]
#                         [--synth "ARGS"] [--prompt-ids FILE] [--deltafin-run DIR] [--llama-record FILE]
#
# colibri at the pinned commit below: `COLIBRI_SRC=DIR` builds from a local copy of its source (a
# checkout, or the bench copy described in bench/results/2026-12-05-peer-colibri-prep/README.md);
# otherwise it is cloned from GitHub into the cache. It is built for the CPU only (no Vulkan, no
# CUDA) with the flags of its c/Makefile for Linux x86-64: gcc -O3 -march=$COLIBRI_ARCH -fopenmp
# -pthread (OpenMP is needed: libgomp ships with gcc). `COLIBRI_BIN=FILE` uses a built kimi_k3
# instead (machines without a compiler or network). Never committed here: a bench-time peer.
# Env: DELTAFIN_BIN (else cargo build --release), DELTAFIN_PEER_CACHE (default
# ~/.cache/deltafin-peer, shared with peer_llama.sh: the same synth model), COLIBRI_ARCH (default
# native), COLIBRI_EXPERT_GB (colibri's expert cache, K3_EXPERT_GB; default: the bytes of deltafin's
# own expert cache in that run), COLIBRI_LOAD_THREADS (K3_LOAD_THREADS, default its 4),
# DELTAFIN_PEER_PYTHON (a python with numpy for the quality side instead of a venv from PyPI).
# --prompt-ids FILE: a JSON array of ids (bench/peer_all.sh passes llama-bench's); default:
# bench/llama_bench_ids.py --vocab V --bos B, the rand() stream llama-bench itself would feed.
# --deltafin-run DIR: reuse deltafin's measured run in DIR (deltafin.io.json, deltafin.out,
# prompt-ids.json from bench/peer_llama.sh with DELTAFIN_PEER_RUN=DIR) instead of running it again.
# --llama-record FILE: bench/peer_llama.sh's record of that same run, embedded in this record.
# Needs root for the speed side (memory cgroup, dropping the page cache). Exit 0 measured.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

# colibri's commit: every file the bench copy holds was read at (or, for the support headers,
# before) this commit; see the prep README.
COLIBRI_COMMIT=61cd171cc72e641f8d8eb6c31656c56e078b2e12
COLIBRI_REPO=https://github.com/JustVugg/colibri

limit=3G prompt=512 decode=32 threads=2 out= modes=default,exact quality=1 speed=1
synth="--preset k3-experts --layers 6 --experts 128 --hidden 2048" prompt_ids= dfrun= llama_record=
while [ $# -gt 0 ]; do
  case $1 in
    --limit) limit=$2; shift 2 ;;
    --prompt) prompt=$2; shift 2 ;;
    --decode) decode=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --modes) modes=$2; shift 2 ;;
    --quality-only) speed=0; shift ;;
    --speed-only) quality=0; shift ;;
    --synth) synth=$2; shift 2 ;;
    --prompt-ids) prompt_ids=$(realpath "$2"); shift 2 ;;
    --deltafin-run) dfrun=$(realpath "$2"); shift 2 ;;
    --llama-record) llama_record=$(realpath "$2"); shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/{/^#/p}' "$0"; exit 0 ;;
    *) echo "peer_colibri: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo "peer_colibri: $*" >&2; exit 1; }
step() { echo "peer_colibri: $*" >&2; }

cache=${DELTAFIN_PEER_CACHE:-$HOME/.cache/deltafin-peer}
mkdir -p "$cache" || die "cannot create the cache directory $cache"
cache=$(cd "$cache" && pwd)
arch=${COLIBRI_ARCH:-native}
for m in ${modes//,/ }; do
  case $m in default|idot0|exact) ;; *) die "unknown colibri mode $m (default, idot0, exact)" ;; esac
done
[ "$speed" = 0 ] || [ "$(id -u)" = 0 ] || die "the speed side needs root (memory cgroup, dropping the page cache); --quality-only runs without"
command -v python3 >/dev/null || die "python3 not found"

# --- deltafin ---------------------------------------------------------------------------------
if [ -n "${DELTAFIN_BIN:-}" ]; then
  bin=$(realpath "$DELTAFIN_BIN") && [ -x "$bin" ] || die "DELTAFIN_BIN=$DELTAFIN_BIN is not an executable"
else
  step "building deltafin (cargo build --release)"
  cargo build --release --quiet || die "cargo build --release failed"
  bin=$repo/target/release/deltafin
fi

# --- colibri: source at the pinned commit, kimi_k3 built for the CPU ---------------------------
if [ -n "${COLIBRI_BIN:-}" ]; then
  kimi=$(realpath "$COLIBRI_BIN") && [ -x "$kimi" ] || die "COLIBRI_BIN=$COLIBRI_BIN is not an executable"
  colibri_source="prebuilt $kimi"
else
  if [ -n "${COLIBRI_SRC:-}" ]; then
    src=$(realpath "$COLIBRI_SRC")
    [ -f "$src/c/kimi_k3.c" ] || die "COLIBRI_SRC=$COLIBRI_SRC has no c/kimi_k3.c"
    colibri_source="local copy $src"
  else
    src=$cache/colibri-$COLIBRI_COMMIT
    if [ ! -f "$src/c/kimi_k3.c" ]; then
      command -v git >/dev/null || die "git not found (or give COLIBRI_SRC=DIR / COLIBRI_BIN=FILE)"
      step "cloning $COLIBRI_REPO at $COLIBRI_COMMIT into $src"
      rm -rf "$src.part"
      git clone -q --filter=blob:none "$COLIBRI_REPO" "$src.part" \
        || die "git clone $COLIBRI_REPO failed (no network? give COLIBRI_SRC=DIR or COLIBRI_BIN=FILE)"
      git -C "$src.part" checkout -q "$COLIBRI_COMMIT" || die "commit $COLIBRI_COMMIT not found in $COLIBRI_REPO"
      mv "$src.part" "$src"
    fi
    colibri_source="$COLIBRI_REPO@$COLIBRI_COMMIT"
  fi
  command -v gcc >/dev/null || die "gcc not found (colibri's Linux build uses gcc with OpenMP)"
  kimi=$cache/colibri-build/kimi_k3-$arch
  stamp=$(cat "$src/c/kimi_k3.c" "$src"/c/*.h | sha256sum | cut -c1-16)
  if [ ! -x "$kimi" ] || [ "$(cat "$kimi.stamp" 2>/dev/null)" != "$stamp" ]; then
    step "building colibri's kimi_k3 (gcc -O3 -march=$arch -fopenmp, CPU only; log $cache/colibri-build/build.log)"
    mkdir -p "$cache/colibri-build"
    # c/Makefile, Linux x86-64 branch: CFLAGS = -O3 -march=$(ARCH) -fopenmp -pthread -Wall ...,
    # LDFLAGS = -lm -fopenmp -pthread; VK=1 / CUDA=1 left off.
    gcc -O3 -march="$arch" -fopenmp -pthread -Wall -Wextra -Wno-unused-parameter \
      -Wno-misleading-indentation -Wno-unused-function "$src/c/kimi_k3.c" -o "$kimi.part" \
      -lm -fopenmp -pthread >"$cache/colibri-build/build.log" 2>&1 \
      || die "building kimi_k3 failed: see $cache/colibri-build/build.log"
    mv "$kimi.part" "$kimi"
    echo "$stamp" >"$kimi.stamp"
  fi
fi

run=$(mktemp -d "${TMPDIR:-/tmp}/peer-colibri.XXXXXX")
step "run directory $run"

# --- quality on the trained demo ---------------------------------------------------------------
if [ "$quality" = 1 ]; then
  qpy=${DELTAFIN_PEER_PYTHON:+$(command -v "$DELTAFIN_PEER_PYTHON")}
  qpy=${qpy:-$cache/qvenv/bin/python}
  if ! "$qpy" -c "import numpy" 2>/dev/null; then
    step "creating $cache/qvenv (numpy, tiktoken from PyPI) for the quality comparison"
    python3 -m venv "$cache/qvenv" || die "python3 -m venv failed (Debian: apt-get install python3-venv)"
    "$cache/qvenv/bin/pip" install -q numpy tiktoken || die "pip install numpy tiktoken failed"
  fi
  # one thread: the figures do not depend on it (each output row is one thread's sum in both
  # engines) and OpenMP teams crawl on a shared machine
  step "quality: deltafin and colibri in each of its modes vs the fp64 reference on the demo's held-out text (bench/peer_quality.py)"
  "$qpy" "$repo/bench/peer_quality.py" --colibri "$kimi" --deltafin "$bin" --threads 1 \
    >"$run/quality.json" || die "peer_quality.py failed"
fi

# --- speed on the K3-shaped synth ---------------------------------------------------------------
if [ "$speed" = 1 ]; then
  read -r -a synth_args <<<"$synth"
  model_tag=synth-$(echo "$synth" | tr -c 'a-z0-9' '-' | tr -s '-' | sed 's/-$//')
  [ "$synth" = "--preset k3-experts --layers 6 --experts 128 --hidden 2048" ] && model_tag=k3-l6-e128-h2048
  model=$cache/work/$model_tag
  mkdir -p "$cache/work"
  if [ ! -f "$model/.synth-ok" ]; then
    step "writing the model: deltafin synth $synth"
    rm -rf "$model"
    "$bin" synth --out "$model" "${synth_args[@]}" >&2 || die "deltafin synth failed"
    touch "$model/.synth-ok"
  fi
  [ ! -e "$model/tokenizer.json" ] || die "$model has a tokenizer.json: colibri would load it (this harness feeds ids)"
  limit_bytes=$(numfmt --from=iec "$limit") || die "cannot parse --limit $limit (e.g. 3G)"
  model_bytes=$(du -sb --exclude=.synth-ok "$model" | cut -f1)
  python3 -c "import sys; sys.exit(0 if int(sys.argv[1]) >= 3.5*int(sys.argv[2]) else 1)" "$model_bytes" "$limit_bytes" \
    || step "WARNING: the model ($model_bytes bytes) is not 3.5x the limit $limit: the figures measure a cache, not streaming"
  vocab=$(python3 -c "import json,sys; c=json.load(open(sys.argv[1])); print(c.get('text_config',c)['vocab_size'])" "$model/config.json")
  bos=$(python3 -c "import json,sys; c=json.load(open(sys.argv[1])); t=c.get('text_config',c); print(t.get('bos_token_id', c.get('bos_token_id','')) or '')" "$model/config.json")
  mon=$repo/bench/peer_iomon.py
  if [ -n "$dfrun" ]; then
    for f in deltafin.io.json deltafin.out prompt-ids.json; do
      [ -f "$dfrun/$f" ] || die "--deltafin-run $dfrun has no $f"
      cp "$dfrun/$f" "$run/"
    done
    [ -f "$dfrun/deltafin.rss" ] && cp "$dfrun/deltafin.rss" "$run/"
  else
    if [ -n "$prompt_ids" ]; then
      cp "$prompt_ids" "$run/prompt-ids.json"
    else
      python3 "$repo/bench/llama_bench_ids.py" --vocab "$vocab" --n "$prompt" ${bos:+--bos "$bos"} \
        >"$run/prompt-ids.json" || die "bench/llama_bench_ids.py failed"
    fi
    step "deltafin: a short run on other text to learn the route heat"
    "$repo/bench/in_cgroup.sh" "$limit" "$bin" bench run --model "$model" --prompt-tokens 64 --decode 32 \
      --threads "$threads" --ceiling-seconds 0 --expert-heat "$run/expert-heat.json" >"$run/deltafin-heat.out" \
      || die "deltafin's heat run failed (output: $run/deltafin-heat.out)"
    step "deltafin bench run --prompt-ids ($prompt ids) --decode $decode in a $limit cgroup"
    "$mon" "$run/deltafin.io.json" "$run/deltafin.out" "$bin" -- \
      "$repo/bench/in_cgroup.sh" "$limit" python3 "$repo/bench/peer_rss.py" "$run/deltafin.rss" \
      "$bin" bench run --model "$model" --prompt-ids "@$run/prompt-ids.json" --decode "$decode" \
      --threads "$threads" --expert-heat "$run/expert-heat.json" \
      || die "deltafin bench run failed (output: $run/deltafin.out)"
  fi
  # deltafin's expert cache in this run: colibri's expert-cache budget is at most that much
  df_cache=$(python3 - "$run/deltafin.out" <<'EOF2'
import json, sys
rec = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{") and '"ttft_s"' in l][-1]
print(rec["expert_cache_bytes"])
EOF2
)
  ids=$(python3 -c "import json,sys; print(' '.join(map(str, json.load(open(sys.argv[1])))))" "$run/prompt-ids.json")
  # colibri's history file lives in the run directory (never <model>/.coli_usage); its short run
  # on other ids writes it as deltafin's heat run does, the measured run only reads it (it pins
  # nothing below 5,000 recorded selections: kimi_k3.c pin_seed).
  heat_ids=$(python3 -c "import random,sys; r=random.Random(1); print(' '.join(str(r.randrange(int(sys.argv[1]))) for _ in range(64)))" "$vocab")
  for m in ${modes//,/ }; do
    case $m in
      default) menv=() ;;
      idot0) menv=(K3_IDOT=0) ;;
      exact) menv=(K3_BITS=32 K3_MLA_BITS=32 K3_HEAD_BITS=32 K3_IDOT=0) ;;
    esac
    cenv=(env -u K3_LOGITS -u K3_TRACE -u K3_DIRS -u K3_EXPERT_GB OMP_NUM_THREADS="$threads"
          K3_LOAD_THREADS="${COLIBRI_LOAD_THREADS:-4}" AUTOPIN=1 COLI_USAGE="$run/colibri-$m.coli_usage"
          "${menv[@]}")
    step "colibri ($m): a short run on other ids to write its history ($run/colibri-$m.coli_usage)"
    "$repo/bench/in_cgroup.sh" "$limit" "${cenv[@]}" K3_EXPERT_GB=0.001 USAGE_SAVE=1 "$kimi" "$model" \
      --ids "$heat_ids" --ngen 32 >"$run/colibri-$m-heat.out" 2>&1 \
      || die "colibri ($m) heat run failed (output: $run/colibri-$m-heat.out)"
    # Its expert cache: what the cgroup leaves after its resident trunk (the RSS it reports once
    # loaded) and its load working set (kimi_k3.c: up to LP_MAX=64 expert slots, one per expert
    # missed in a layer pass of a 32-row prefill chunk), at most deltafin's cache; one slot per
    # layer at least (its floor).
    egb=${COLIBRI_EXPERT_GB:-$(python3 - "$run/colibri-$m-heat.out" "$limit_bytes" "$df_cache" "$model/config.json" <<'EOF2'
import json, re, sys
log, limit, df_cache, cfg = open(sys.argv[1]).read(), int(sys.argv[2]), int(sys.argv[3]), json.load(open(sys.argv[4]))
m = re.search(r"expert cache \d+/layer \(([0-9.]+) MB/slot\) \| RSS ([0-9.]+) GB", log)
if not m:
    sys.exit("no [K3] init line in the heat run's output")
slot, rss = float(m.group(1)) * 1e6 + 8192, float(m.group(2)) * 1e9
tc = cfg.get("text_config", cfg)
nmoe = tc["num_hidden_layers"] - tc.get("first_k_dense_replace", 0)
ws = min(64, tc["num_experts"], 32 * tc["num_experts_per_token"]) * slot
budget = min(df_cache, limit - rss - ws - 128e6)
print(round(max(budget, slot * nmoe) / 1e9, 4))
EOF2
)}
    echo "$egb" >"$run/colibri-$m.expert_gb"
    step "colibri ($m) --ids ($prompt ids) --ngen $decode, K3_EXPERT_GB=$egb, in a $limit cgroup"
    # stderr joins stdout so peer_iomon stamps its phase lines ([K3] prompt:, prefill done, tok N)
    "$mon" "$run/colibri-$m.io.json" "$run/colibri-$m.out" "$kimi" -- \
      "$repo/bench/in_cgroup.sh" "$limit" python3 "$repo/bench/peer_rss.py" "$run/colibri-$m.rss" \
      sh -c 'exec "$@" 2>&1' sh "${cenv[@]}" K3_EXPERT_GB="$egb" USAGE_SAVE=0 "$kimi" "$model" --ids "$ids" --ngen "$decode" \
      || die "colibri ($m) failed (output: $run/colibri-$m.out)"
  done
fi

# --- the record ---------------------------------------------------------------------------------
cmdline="bench/peer_colibri.sh --limit $limit --prompt $prompt --decode $decode --threads $threads --modes $modes"
record=$(python3 "$repo/bench/peer_colibri_record.py" --run "$run" --modes "$modes" --command "$cmdline" \
  --colibri-source "$colibri_source" --colibri-commit "$COLIBRI_COMMIT" --colibri-arch "$arch" \
  --speed "$speed" ${model:+--model "$model"} ${limit_bytes:+--limit-bytes "$limit_bytes"} \
  --synth "$synth" ${llama_record:+--llama-record "$llama_record"}) || die "could not assemble the record from $run"
echo "$record"
[ -z "$out" ] || echo "$record" >>"$out"
