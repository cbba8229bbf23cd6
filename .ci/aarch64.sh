#!/usr/bin/env bash
# The aarch64 checks without an Arm machine (issue 40); `.ci/run` runs them, a developer may too:
#   .ci/aarch64.sh [clippy|test|all]          (default: all)
#
# clippy: `cargo clippy --release --all-targets -- -D warnings` for aarch64-apple-darwin and for
#   aarch64-unknown-linux-gnu. The C in the dependencies (ring) is compiled by zig's clang for
#   Apple (PyPI's `ziglang`, pinned below, in a venv under the target dir) and by Debian's
#   gcc-aarch64-linux-gnu for Linux; nothing is linked for Apple (clippy only checks).
# test: cross-builds the tests below for aarch64-unknown-linux-gnu and runs them under qemu-user
#   (qemu-aarch64-static, no binfmt_misc needed; the tests start the deltafin binary through the
#   same emulator: DELTAFIN_TEST_RUNNER, tests/common). Each compares against the bits x86
#   gives: tests/isa_bits.rs against the logits hashes and greedy ids pinned on x86-64, the
#   kernel tests NEON against scalar bit for bit, the others against the committed references.
#
# Installs what a fresh Debian machine lacks (rustup targets; apt: gcc-aarch64-linux-gnu,
# libc6-dev-arm64-cross, qemu-user-static, python3-venv; pip: ziglang). Prints the seconds each
# step took. ZIGLANG (default the pinned version) and CARGO_TARGET_DIR are honoured.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
case "$what" in clippy | test | all) ;; *) echo "usage: $0 [clippy|test|all]" >&2; exit 2 ;; esac

ZIGLANG=${ZIGLANG:-0.17.1}
LINUX=aarch64-unknown-linux-gnu
APPLE=aarch64-apple-darwin
SYSROOT=/usr/aarch64-linux-gnu
target_dir=$(realpath -m "${CARGO_TARGET_DIR:-target}")
tools=$target_dir/ci-cross
t0=$SECONDS
step() { echo "aarch64.sh: $* ($((SECONDS - t0)) s so far)" >&2; }

# --- what the checks need -------------------------------------------------------------------------
rustup -q target add "$LINUX" "$APPLE"
missing=()
command -v aarch64-linux-gnu-gcc >/dev/null || missing+=(gcc-aarch64-linux-gnu)
[ -e "$SYSROOT/include/stdio.h" ] || missing+=(libc6-dev-arm64-cross)
command -v qemu-aarch64-static >/dev/null || missing+=(qemu-user-static)
python3 -c "import ensurepip, venv" 2>/dev/null || missing+=(python3-venv)
if [ ${#missing[@]} -gt 0 ]; then
  step "installing ${missing[*]} from Debian's packages"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# zig from PyPI, pinned, in a venv of its own; wrappers cargo's C builds call as the Apple compiler.
zig_py=$tools/zig-venv/bin/python
if ! "$zig_py" -m ziglang version 2>/dev/null | grep -qx "$ZIGLANG"; then
  step "installing ziglang==$ZIGLANG from PyPI into $tools/zig-venv"
  rm -rf "$tools/zig-venv"
  python3 -m venv "$tools/zig-venv"
  "$zig_py" -m pip install --quiet --disable-pip-version-check "ziglang==$ZIGLANG"
fi
mkdir -p "$tools/bin"
# cc-rs passes `--target=arm64-apple-macosx...`, which zig does not parse: its own -target instead.
cat >"$tools/bin/cc-$APPLE" <<EOF
#!/bin/sh
for a do
  shift
  case "\$a" in --target=*) ;; *) set -- "\$@" "\$a" ;; esac
done
exec "$zig_py" -m ziglang cc -target aarch64-macos "\$@"
EOF
printf '#!/bin/sh\nexec "%s" -m ziglang ar "$@"\n' "$zig_py" >"$tools/bin/ar-$APPLE"
chmod +x "$tools/bin/cc-$APPLE" "$tools/bin/ar-$APPLE"

export CC_aarch64_apple_darwin=$tools/bin/cc-$APPLE
export AR_aarch64_apple_darwin=$tools/bin/ar-$APPLE
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export AR_aarch64_unknown_linux_gnu=aarch64-linux-gnu-ar
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
runner="qemu-aarch64-static -L $SYSROOT"
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER=$runner
export DELTAFIN_TEST_RUNNER=$runner
step "tools ready"

# --- clippy for both aarch64 targets ---------------------------------------------------------------
if [ "$what" != test ]; then
  for t in "$APPLE" "$LINUX"; do
    cargo clippy --release --all-targets --target "$t" --quiet -- -D warnings
    step "clippy -D warnings clean for $t"
  done
fi

# --- the aarch64 tests under qemu-user ------------------------------------------------------------
# Chosen for what only an aarch64 run can show, the NEON kernels and the bits they give, at a cost
# qemu can bear (each is seconds natively; see docs/macos.md for the times):
#   --lib backend::cpu    the CPU backend's unit tests (kernels against scalar and f64)
#   kernels               every kernel family on every ISA this CPU has, bit for bit against scalar
#   isa_bits              logits hashes and greedy ids pinned on x86-64: 3 fixtures x 2 KDA forms,
#                         the trained demo and its int8 trunk
#   exactness             the fixtures against the fp64 reference; thread count and arrival order
#   trained               the trained demo against its training forward, fp64 reference, drafter
#   trunk                 coded trunk = bf16 bits on every ISA, int8 products, the trunk pack
tests=(--lib --test kernels --test isa_bits --test exactness --test trained --test trunk)
if [ "$what" != clippy ]; then
  cargo test --release --target "$LINUX" --no-run --quiet "${tests[@]}"
  step "aarch64 tests built"
  # No aarch64 Vulkan driver under qemu: the GPU tests among these skip, saying so.
  cargo test --release --target "$LINUX" --quiet --lib -- backend::cpu
  for t in "${tests[@]:1}"; do
    [ "$t" = --test ] && continue
    cargo test --release --target "$LINUX" --quiet --test "$t"
    step "aarch64 $t passed under qemu"
  done
fi
step "done"
