#!/usr/bin/env python3
"""Static instruction mix of the CPU kernels' inner loops, NEON beside AVX2 and AVX-512.

Real Apple cores cannot be timed where deltafin is developed, so this reads the kernels' machine
code instead: for each kernel it disassembles the function from a release binary (objdump), finds
its hot inner loop (the innermost loop region -- the span of a backward branch, loops inside it
that do no vector work not counting -- with the most
fused multiply-adds, among equals or for a kernel without them the one densest in vector work), counts the loop's
instructions by class, and divides by the weight bytes one iteration consumes (from the lane
multiply-adds it performs and the format's multiply-adds per weight byte). Every path through the
loop body is counted once (a rarely taken branch -- an escape, a NaN scale -- counts too), so the
figures are static counts, not a trace.

    python3 bench/kernel_mix.py --arm target/aarch64-unknown-linux-gnu/release/deltafin \\
        --x86 target/release/deltafin --out bench/results/DATE-neon-kernels

writes mix.json (one record per kernel and instruction set) and mix.md (the table docs/kernels-neon.md
quotes). Needs binutils' objdump for both targets (Debian: binutils-aarch64-linux-gnu).
"""
import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

# (family, isa, symbol, lanes per FMA instruction, MACs per weight byte, fixed bytes per
# iteration when the loop does no FMA, note). MACs per weight byte: bf16 2 B a value; MXFP4 16
# code bytes + 1 scale per 32 values; coded 64 sign/mantissa bytes + 24 index bytes per 64 values
# (escapes, one byte each, are rare); int8 1 B a value; a decoded f32 band 4 B a value, each value
# meeting 4 input rows in a tile; dot4xn with 4 inputs meets each weight 4 times.
MXFP4 = 32 / 17
CODED = 64 / 88
KERNELS = [
    ("dot4_bf16", "neon", "deltafin::backend::cpu::neon::dot::dot4_bf16", 4, 0.5, None, ""),
    ("dot4_bf16", "avx2", "deltafin::backend::cpu::x86::dot::dot4_bf16_avx2", 8, 0.5, None, ""),
    ("dot4_bf16", "avx512", "deltafin::backend::cpu::x86::dot::dot4_bf16_avx512", 16, 0.5, None, ""),
    ("dot4_mxfp4", "neon", "deltafin::backend::cpu::neon::dot::dot2_mxfp4", 4, MXFP4, None, "two rows a pass, run twice"),
    ("dot4_mxfp4", "avx2", "deltafin::backend::cpu::x86::dot::dot4_mxfp4_avx2", 8, MXFP4, None, ""),
    ("dot4_mxfp4", "avx512", "deltafin::backend::cpu::x86::dot::dot4_mxfp4_avx512", 16, MXFP4, None, ""),
    ("dot4xn_mxfp4 (4 inputs)", "neon", "deltafin::backend::cpu::neon::tiled::dot4xn_mxfp4", 4, 4 * MXFP4, None, "largest instance (NX = 4)"),
    ("dot4xn_mxfp4 (4 inputs)", "avx512", "deltafin::backend::cpu::x86::tiled::dot4xn_mxfp4_avx512", 16, 4 * MXFP4, None, "largest instance (NX = 4)"),
    ("tile_f32 (f32 band)", "neon", "deltafin::backend::cpu::neon::tiled::dot4x4_tile", 4, 1.0, None, "one lane quarter a pass"),
    ("tile_f32 (f32 band)", "avx2", "deltafin::backend::cpu::x86::dot::dot4_f32_avx2", 8, 1.0, None, "composed: dot4_f32 per weight row, untiled"),
    ("tile_f32 (f32 band)", "avx512", "deltafin::backend::cpu::x86::tiled::dot4x4_tile_avx512", 16, 1.0, None, ""),
    ("dot4_coded", "neon", "deltafin::backend::cpu::neon::coded::dot4_coded", 4, CODED, None, ""),
    ("dot4_coded", "avx512", "deltafin::backend::cpu::x86::coded::dot4_coded_avx512", 16, CODED, None, "AVX2: decode_portable + dot4_bf16"),
    ("decode_coded (block)", "neon", "deltafin::backend::cpu::neon::coded::decode_blocks", 4, None, 88, "88 coded bytes a block"),
    ("decode_coded (block)", "avx512", "deltafin::backend::cpu::x86::coded::decode_blocks_avx512", 16, None, 88, "88 coded bytes a block"),
    ("dot4_int8", "neon", "deltafin::backend::cpu::neon::int8::dot4_int8", 4, 1.0, None, "AVX2/AVX-512: decode_row + dot4_f32"),
    ("decode_mxfp4_row", "neon", "deltafin::backend::cpu::neon::dot::decode_mxfp4_row", 4, None, 17, "17 bytes a block"),
    ("decode_mxfp4_row", "avx512", "deltafin::backend::cpu::x86::dot::decode_mxfp4_row_avx512", 16, None, 17, "17 bytes a block"),
    ("situ (per element)", "neon", "deltafin::backend::cpu::neon::situ::situ_rows", 4, None, 4 * 8, "4 elements a pass (8 B each: gate, up)"),
    ("situ (per element)", "avx2", "deltafin::backend::cpu::x86::situ::situ_rows_avx2", 8, None, 8 * 8, "8 elements a pass"),
    ("situ (per element)", "avx512", "deltafin::backend::cpu::x86::situ::situ_rows_avx512", 16, None, 16 * 8, "16 elements a pass"),
]

CLASSES = ["fma", "fp", "load", "store", "permute", "int", "scalar"]

ARM_FMA = {"fmla", "fmadd", "fmls", "fmsub"}
ARM_FP = {"fmul", "fadd", "fsub", "fneg", "fabs", "frintm", "fcvtzs", "scvtf", "fcmgt", "fcmge", "fcmeq", "fcmlt", "fcmle", "faddp", "fmov", "fdiv"}
ARM_PERMUTE = {"tbl", "tbx", "zip1", "zip2", "uzp1", "uzp2", "trn1", "trn2", "shll", "shll2", "sxtl", "sxtl2", "uxtl", "uxtl2", "ushll", "ushll2", "sshll", "sshll2", "ext", "dup", "ins", "mov", "umov", "xtn", "xtn2", "rev16", "rev32", "rev64", "addv", "umaxv"}
ARM_INT = {"and", "orr", "eor", "bic", "bif", "bit", "bsl", "not", "mvn", "ushr", "sshr", "shl", "ushl", "sshl", "sli", "sri", "add", "sub", "cmeq", "cmtst", "cmhi", "cmgt", "movi", "mvni", "cnt"}


def classify_arm(mn, ops):
    vec = bool(re.search(r"\bv\d+\.", ops)) or bool(re.search(r"\bq\d+\b", ops))
    if mn.startswith(("ld", "ldr", "ldp", "ldur")):
        return "load"
    if mn.startswith(("st", "str", "stp", "stur")):
        return "store"
    if mn in ARM_FMA and vec:
        return "fma"
    if not vec:
        return "scalar"
    if mn in ARM_FP:
        return "fp"
    if mn in ARM_PERMUTE:
        return "permute"
    if mn in ARM_INT:
        return "int"
    return "scalar"


def classify_x86(mn, ops):
    vec = bool(re.search(r"\b[xyz]mm\d+\b", ops))
    mem = "PTR [" in ops or "[" in ops
    if not vec:
        return "scalar"
    if "fmadd" in mn or "fmsub" in mn or "fnmadd" in mn:
        return "fma"
    if mem and mn.startswith(("vmov", "vbroadcast", "vpbroadcast", "vpmovzx", "vpmovsx", "vpexpand", "vlddqu")):
        # A store writes its memory operand first.
        return "store" if ops.split(",")[0].find("[") >= 0 else "load"
    if mn.startswith(("vmul", "vadd", "vsub", "vround", "vrndscale", "vcmp", "vcvt", "vdiv", "vmax", "vmin")):
        return "fp"
    if mn.startswith(("vperm", "vpshuf", "vpmovzx", "vpmovsx", "vextract", "vinsert", "vpunpck", "vunpck", "vshuf", "vbroadcast", "vpbroadcast", "vmovhl", "vmovshdup", "vpexpand", "vpcompress", "vmovd", "vmovq")):
        return "permute"
    if mn.startswith(("vp", "vand", "vor", "vxor", "vblend", "vptern", "kmov", "kand", "kor")):
        return "int"
    if mn.startswith("vmov"):
        return "permute"
    return "scalar"


def symbols(binary, nm):
    out = subprocess.run([nm, "-C", "-S", "--size-sort", binary], capture_output=True, text=True, check=True).stdout
    syms = {}
    for line in out.splitlines():
        parts = line.split(" ", 3)
        if len(parts) == 4 and parts[2] in ("t", "T"):
            addr, size, name = int(parts[0], 16), int(parts[1], 16), parts[3]
            syms.setdefault(name, []).append((addr, size))
    return syms


INSN = re.compile(r"^\s*([0-9a-f]+):\s+(\S+)\s*(.*)$")


def disassemble(binary, objdump, addr, size, intel):
    cmd = [objdump, "-d", "--no-show-raw-insn", f"--start-address={addr:#x}", f"--stop-address={addr + size:#x}", binary]
    if intel:
        cmd[2:2] = ["-M", "intel"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    insns = []
    for line in out.splitlines():
        m = INSN.match(line)
        if m:
            ops = re.sub(r"\s*//.*$", "", m.group(3))
            ops = re.sub(r"\s*<.*>$", "", ops).strip()
            insns.append((int(m.group(1), 16), m.group(2), ops))
    return insns


def is_branch(mn, intel):
    if intel:
        return mn.startswith("j")
    return mn in ("b", "cbz", "cbnz", "tbz", "tbnz") or mn.startswith("b.")


def branch_target(ops, intel):
    toks = re.findall(r"(?:0x)?([0-9a-f]+)", ops.split(",")[-1].strip())
    if not toks:
        return None
    try:
        return int(toks[-1], 16)
    except ValueError:
        return None


def hot_loop(insns, intel, classify):
    regions = []
    for i, (a, mn, ops) in enumerate(insns):
        if is_branch(mn, intel):
            t = branch_target(ops, intel)
            if t is not None and insns[0][0] <= t < a:
                regions.append((t, a))
    def work(lo, hi):
        return sum(1 for (a, mn, ops) in insns if lo <= a <= hi and classify(mn, ops) in ("fma", "fp", "permute", "int"))

    # Innermost: containing no other loop that does vector work (a scalar loop nested inside, such
    # as the coded decoder's rare escape patch, does not make its host an outer loop).
    working = [r for r in regions if work(*r)]
    innermost = [r for r in regions if not any(o != r and r[0] <= o[0] and o[1] <= r[1] for o in working)]
    best = None
    for lo, hi in innermost:
        body = [(mn, ops) for (a, mn, ops) in insns if lo <= a <= hi]
        kinds = [classify(mn, ops) for mn, ops in body]
        fmas = kinds.count("fma")
        # The most multiply-adds; among equals (a main loop and its padded tail), or for a kernel
        # without them, the densest in vector work.
        key = (fmas, (len(kinds) - kinds.count("scalar")) / len(kinds))
        if best is None or key > best[0]:
            best = (key, body, (lo, hi))
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arm", required=True, help="aarch64 release binary")
    ap.add_argument("--x86", required=True, help="x86-64 release binary")
    ap.add_argument("--out", required=True, help="directory for mix.json and mix.md")
    ap.add_argument("--arm-objdump", default="aarch64-linux-gnu-objdump")
    ap.add_argument("--arm-nm", default="aarch64-linux-gnu-nm")
    args = ap.parse_args()
    tools = {
        "neon": (args.arm, args.arm_objdump, args.arm_nm, False, classify_arm),
        "avx2": (args.x86, "objdump", "nm", True, classify_x86),
        "avx512": (args.x86, "objdump", "nm", True, classify_x86),
    }
    symtabs = {}
    records = []
    for family, isa, sym, lanes, macs_per_byte, bytes_fixed, note in KERNELS:
        binary, objdump, nm, intel, classify = tools[isa]
        if binary not in symtabs:
            symtabs[binary] = symbols(binary, nm)
        found = symtabs[binary].get(sym)
        if not found:
            print(f"{sym}: not in {binary} (inlined?)", file=sys.stderr)
            continue
        addr, size = max(found, key=lambda s: s[1])
        insns = disassemble(binary, objdump, addr, size, intel)
        loop = hot_loop(insns, intel, classify)
        if loop is None:
            print(f"{sym}: no loop found", file=sys.stderr)
            continue
        _, body, (lo, hi) = loop
        mix = {c: 0 for c in CLASSES}
        for mn, ops in body:
            mix[classify(mn, ops)] += 1
        macs = mix["fma"] * lanes
        weight_bytes = macs / macs_per_byte if macs_per_byte else bytes_fixed
        n = len(body)
        vector = n - mix["scalar"]
        records.append({
            "family": family,
            "isa": isa,
            "symbol": sym,
            "loop": [hex(lo), hex(hi)],
            "instructions": n,
            "mix": mix,
            "lane_macs": macs,
            "weight_bytes": round(weight_bytes, 3),
            "instructions_per_weight_byte": round(n / weight_bytes, 3),
            "vector_instructions_per_weight_byte": round(vector / weight_bytes, 3),
            "lane_macs_per_weight_byte": round(macs / weight_bytes, 3) if macs_per_byte else None,
            "note": note,
        })
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mix.json").write_text(json.dumps(records, indent=1) + "\n")
    rows = ["| family | ISA | loop instrs | fma | fp | load | store | permute | int | scalar | bytes/iter | instr/B | vector instr/B | MAC/B |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        m = r["mix"]
        rows.append(f"| {r['family']} | {r['isa']} | {r['instructions']} | {m['fma']} | {m['fp']} | {m['load']} | {m['store']} | "
                    f"{m['permute']} | {m['int']} | {m['scalar']} | {r['weight_bytes']:g} | {r['instructions_per_weight_byte']:.2f} | "
                    f"{r['vector_instructions_per_weight_byte']:.2f} | {r['lane_macs_per_weight_byte'] or '-'} |")
    (out / "mix.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
