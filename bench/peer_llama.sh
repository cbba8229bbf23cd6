#!/usr/bin/env bash
# The peer benchmark: deltafin and llama.cpp on the same K3-shaped model (real 17.55 MB MXFP4 experts,
# several times the memory limit), in the same memory cgroup, cold, one JSON record with both sides'
# prefill and decode tok/s, bytes read per token (/proc/PID/io, sampled) and read amplification,
# deltafin's own `bench run` record, and the ratios deltafin / llama.cpp.
#
#   bench/peer_llama.sh [--limit 3G] [--prompt 512] [--decode 32] [--threads 2] [--out FILE]
#
# Needs root (memory cgroup, dropping the page cache), python3 with venv, a C/C++ compiler, and PyPI.
# Everything downloaded or built (the llama-cpp-python sdist with its vendored llama.cpp, cmake and
# ninja, the converter's Python deps, the synthetic model and its GGUF) is kept in
# $DELTAFIN_PEER_CACHE (default ~/.cache/deltafin-peer), so a rerun only runs the benchmarks.
# Env: DELTAFIN_PEER_JOBS (build jobs, default 2), LLAMA_CPP_PYTHON_VERSION (default 0.3.36),
# DELTAFIN_BIN (a deltafin binary to use instead of `cargo build --release`), DELTAFIN_PEER_FP64=0
# (skip checking deltafin's tokens against the fp64 reference, which takes minutes),
# DELTAFIN_PEER_PYTHON (a python with torch, transformers, numpy, safetensors to use instead of
# the venv: machines without PyPI; cmake and ninja then come from PATH), LLAMA_CPP_SRC (an
# unpacked llama.cpp source tree instead of the llama-cpp-python sdist's: its converter and the
# K3 check read it), LLAMA_BENCH_BIN (a llama-bench built from that source elsewhere),
# DELTAFIN_PEER_RUN (the run directory to write, instead of a new one under the cache: bench/peer_all.sh
# hands it to bench/peer_colibri.sh, which reuses deltafin's measured run from it).
# Both engines get the same prompt ids (bench/llama_bench_ids.py); deltafin's route heat is learned
# by a short run on other text first.
# Exit status: 0 measured, 3 blocked (the vendored llama.cpp has no kimi_k3 support; the record says so).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

limit=3G prompt=512 decode=32 threads=2 out=
while [ $# -gt 0 ]; do
  case $1 in
    --limit) limit=$2; shift 2 ;;
    --prompt) prompt=$2; shift 2 ;;
    --decode) decode=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/{/^#/p}' "$0"; exit 0 ;;
    *) echo "peer_llama: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo "peer_llama: $*" >&2; exit 1; }
step() { echo "peer_llama: $*" >&2; }

cache=${DELTAFIN_PEER_CACHE:-$HOME/.cache/deltafin-peer}
jobs=${DELTAFIN_PEER_JOBS:-2}
ver=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
# The model: the issue's shape. 6 layers (1 dense + 5 MoE) x 128 experts of 17.55 MB, top-16,
# hidden 2048 for a light trunk: 11.96 GB, 3.7x a 3 GiB limit.
synth_args=(--preset k3-experts --layers 6 --experts 128 --hidden 2048)
model_tag=k3-l6-e128-h2048

[ "$(id -u)" = 0 ] || die "needs root: the memory cgroup and dropping the page cache (bench/in_cgroup.sh)"
command -v python3 >/dev/null || die "python3 not found"
command -v cc >/dev/null && command -v c++ >/dev/null || die "a C and C++ compiler (cc, c++) are needed to build llama.cpp"
mkdir -p "$cache" || die "cannot create the cache directory $cache"
cache=$(cd "$cache" && pwd)

# --- deltafin ---------------------------------------------------------------------------------
if [ -n "${DELTAFIN_BIN:-}" ]; then
  bin=$(realpath "$DELTAFIN_BIN") && [ -x "$bin" ] || die "DELTAFIN_BIN=$DELTAFIN_BIN is not an executable"
else
  step "building deltafin (cargo build --release)"
  cargo build --release --quiet || die "cargo build --release failed"
  bin=$repo/target/release/deltafin
fi

# --- Python environment: cmake and ninja wheels, the converter's deps ---------------------------
if [ -n "${DELTAFIN_PEER_PYTHON:-}" ]; then
  # a machine without PyPI (the GPU host): a python that already has the converter's deps
  py=$(command -v "$DELTAFIN_PEER_PYTHON") || die "DELTAFIN_PEER_PYTHON=$DELTAFIN_PEER_PYTHON not found"
  "$py" -c "import torch, transformers, numpy, safetensors" || die "$py lacks torch, transformers, numpy or safetensors"
  command -v cmake >/dev/null && command -v ninja >/dev/null || die "cmake and ninja are needed on PATH"
else
  venv=$cache/venv
  py=$venv/bin/python
  if [ ! -f "$cache/.venv-ok" ]; then
    step "creating $venv (cmake, ninja, scikit-build-core, torch, transformers, numpy, safetensors from PyPI)"
    python3 -m venv "$venv" || die "python3 -m venv failed (Debian: apt-get install python3-venv)"
    # The converter imports torch and transformers (AutoConfig) at module level; the pins follow its
    # requirements file where PyPI has them. torch comes from PyPI (the CPU index is not reachable).
    "$venv/bin/pip" install -q cmake ninja scikit-build-core torch "transformers==4.57.6" numpy safetensors \
      sentencepiece "protobuf>=4.21,<5" tqdm pyyaml requests || die "pip install of the build and converter deps failed"
    "$py" -c "import torch, transformers, numpy, safetensors" || die "the converter's deps do not import in $venv"
    touch "$cache/.venv-ok"
  fi
  export PATH=$venv/bin:$PATH
fi

# --- llama.cpp source: the llama-cpp-python sdist on PyPI, its vendored llama.cpp ---------------
if [ -n "${LLAMA_CPP_SRC:-}" ]; then
  # an unpacked llama.cpp source (the sdist's vendor/llama.cpp, carried to a machine without PyPI)
  llama=$(realpath "$LLAMA_CPP_SRC")
  [ -f "$llama/CMakeLists.txt" ] || die "LLAMA_CPP_SRC=$LLAMA_CPP_SRC has no CMakeLists.txt"
else
  sdist=$cache/dl/llama_cpp_python-$ver.tar.gz
  if [ ! -f "$sdist" ]; then
    step "downloading the llama-cpp-python $ver source distribution"
    mkdir -p "$cache/dl"
    # --no-build-isolation with scikit-build-core installed: pip only reads the metadata, instead of
    # building cmake from source in an isolated environment.
    "$venv/bin/pip" download -q --no-deps --no-binary :all: --no-build-isolation \
      "llama-cpp-python==$ver" -d "$cache/dl" || die "pip download llama-cpp-python==$ver failed"
    [ -f "$sdist" ] || die "pip download did not leave $sdist"
  fi
  src=$cache/src/llama_cpp_python-$ver
  llama=$src/vendor/llama.cpp
  if [ ! -f "$llama/CMakeLists.txt" ]; then
    step "unpacking $sdist"
    mkdir -p "$cache/src"
    tar -xzf "$sdist" -C "$cache/src" || die "cannot unpack $sdist"
    [ -f "$llama/CMakeLists.txt" ] || die "$sdist has no vendor/llama.cpp"
  fi
fi

# Blocked unless this llama.cpp knows K3: its converter class and its runtime architecture.
if [ ! -f "$llama/conversion/kimi_k3.py" ] || ! grep -q '"kimi-k3"' "$llama/src/llama-arch.cpp"; then
  python3 - "$ver" <<'EOF'
import json, sys
print(json.dumps({"bench": "peer_llama", "status": "blocked",
                  "reason": f"the llama.cpp vendored in llama-cpp-python {sys.argv[1]} has no kimi_k3 support "
                            "(conversion/kimi_k3.py or the kimi-k3 architecture is missing)"}))
EOF
  exit 3
fi

# --- build llama-bench (only that tool and the libraries it links) -----------------------------
if [ -n "${LLAMA_BENCH_BIN:-}" ]; then
  # a llama-bench built elsewhere from this same source (a machine without a C++ toolchain)
  lbench=$(realpath "$LLAMA_BENCH_BIN") && [ -x "$lbench" ] || die "LLAMA_BENCH_BIN=$LLAMA_BENCH_BIN is not an executable"
else
  build=$cache/build
  lbench=$build/bin/llama-bench
  if [ ! -x "$lbench" ] || [ ! -f "$cache/.build-$ver" ]; then
    step "building llama-bench from $llama with $jobs jobs (slow on 2 cores; log: $cache/build.log)"
    cmake -S "$llama" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
      -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
      -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >"$cache/build-configure.log" 2>&1 \
      || die "cmake configure failed: see $cache/build-configure.log"
    cmake --build "$build" --target llama-bench -j "$jobs" >"$cache/build.log" 2>&1 \
      || die "llama-bench build failed: see $cache/build.log"
    [ -x "$lbench" ] || die "the build left no $lbench"
    touch "$cache/.build-$ver"
  fi
fi

# --- the model, and its GGUF from llama.cpp's own converter ------------------------------------
work=$cache/work
mkdir -p "$work"
model=$work/$model_tag
if [ ! -f "$model/.synth-ok" ]; then
  step "writing the model: deltafin synth ${synth_args[*]} (about 12 GB)"
  rm -rf "$model"
  "$bin" synth --out "$model" "${synth_args[@]}" >&2 || die "deltafin synth failed"
  touch "$model/.synth-ok"
fi
gguf=$work/$model_tag.gguf
if [ ! -f "$gguf" ] || [ "$gguf" -ot "$model/.synth-ok" ]; then
  step "converting with llama.cpp's convert_hf_to_gguf.py (kimi_k3 path; log: $cache/convert.log)"
  # bench/peer_convert.py stands a builtin vocabulary in for the published Python tokenizer.
  "$py" "$repo/bench/peer_convert.py" "$llama" "$model" --outfile "$gguf.part" >"$cache/convert.log" 2>&1 \
    || die "conversion failed: see $cache/convert.log"
  mv "$gguf.part" "$gguf"
fi

model_bytes=$(du -sb --exclude=.synth-ok "$model" | cut -f1)
limit_bytes=$(numfmt --from=iec "$limit") || die "cannot parse --limit $limit (e.g. 3G)"
python3 -c "import sys; m,l=int(sys.argv[1]),int(sys.argv[2]); sys.exit(0 if m >= 3.5*l else 1)" \
  "$model_bytes" "$limit_bytes" || die "the model ($model_bytes bytes) is not 3.5x the limit $limit: lower --limit"

# --- the runs: same cgroup limit, cold page cache each time ------------------------------------
if [ -n "${DELTAFIN_PEER_RUN:-}" ]; then
  run=$DELTAFIN_PEER_RUN
  mkdir -p "$run" || die "cannot create DELTAFIN_PEER_RUN=$run"
else
  run=$(mktemp -d "$work/run.XXXXXX")
fi
mon=$repo/bench/peer_iomon.py
# The prompt: the very ids llama-bench's prompt test feeds (it never seeds rand()).
"$py" "$repo/bench/llama_bench_ids.py" --gguf "$gguf" --n "$prompt" >"$run/prompt-ids.json" \
  || die "could not derive llama-bench's prompt ids from $gguf"
# Route heat learned across runs: one short run on other text (the built-in prompt) teaches it, the
# measured run starts from it, as a second run of a user's install does.
step "deltafin: a short run on other text to learn the route heat ($run/expert-heat.json)"
"$repo/bench/in_cgroup.sh" "$limit" "$bin" bench run --model "$model" --prompt-tokens 64 --decode 32 \
  --threads "$threads" --ceiling-seconds 0 --expert-heat "$run/expert-heat.json" >"$run/deltafin-heat.out" \
  || die "deltafin's heat run failed (output: $run/deltafin-heat.out)"
step "deltafin bench run --prompt-ids (llama-bench's $prompt ids) --decode $decode in a $limit cgroup"
"$py" "$mon" "$run/deltafin.io.json" "$run/deltafin.out" "$bin" -- \
  "$repo/bench/in_cgroup.sh" "$limit" python3 "$repo/bench/peer_rss.py" "$run/deltafin.rss" \
  "$bin" bench run --model "$model" --prompt-ids "@$run/prompt-ids.json" --decode "$decode" --threads "$threads" --expert-heat "$run/expert-heat.json" \
  --fetch-trace "$run/fetch-trace.json" || die "deltafin bench run failed (output: $run/deltafin.out)"
# llama-bench: one process per phase, one repetition, no warmup (cold like deltafin's run), the
# expert tensors read in place from the mmap (--repack 0: no repacked copy in RAM). Each jsonl line
# appears right after its test, which marks the end of the timed window in the /proc trace.
for phase in pp tg; do
  if [ $phase = pp ]; then pn=(-p "$prompt" -n 0); else pn=(-p 0 -n "$decode"); fi
  step "llama-bench ${pn[*]} -t $threads in a $limit cgroup"
  "$py" "$mon" "$run/llama-$phase.io.json" "$run/llama-$phase.out" "$lbench" -- \
    "$repo/bench/in_cgroup.sh" "$limit" python3 "$repo/bench/peer_rss.py" "$run/llama-$phase.rss" \
    "$lbench" -m "$gguf" "${pn[@]}" -t "$threads" --repack 0 \
    -r 1 --no-warmup -o jsonl || die "llama-bench ${pn[*]} failed (output: $run/llama-$phase.out)"
done

# deltafin's tokens against the fp64 reference: one teacher-forced pass over prompt + output
if [ "${DELTAFIN_PEER_FP64:-1}" = 1 ]; then
  step "checking deltafin's tokens against the fp64 reference (tests/reference/check_greedy.py; minutes)"
  "$py" "$repo/tests/reference/check_greedy.py" "$model" --prompt-ids "$run/prompt-ids.json" \
    --generated <(grep '^{' "$run/deltafin.out" | tail -1) >"$run/fp64-check.json" || true
fi
python3 "$repo/bench/cache_sim.py" "$run/fetch-trace.json" >"$run/cache-sim.json" || true

# --- the record ---------------------------------------------------------------------------------
cmdline="bench/peer_llama.sh --limit $limit --prompt $prompt --decode $decode --threads $threads"
record=$(python3 "$repo/bench/peer_record.py" "$run" "$model" "$gguf" "$limit_bytes" "$cmdline" \
  "llama-cpp-python $ver (vendored llama.cpp)" "${synth_args[*]}") || die "could not assemble the record from $run"
echo "$record"
[ -z "$out" ] || echo "$record" >>"$out"
