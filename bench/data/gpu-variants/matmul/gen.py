"""Writes variants of the shipped MXFP4 matmul (kernels/matmul.wgsl) for `deltafin bench kernels
--backend gpu --matmul-variants DIR`: the shipped text with its register tile (weight rows x input
rows per thread) and, in the `f16` ones, the matvec's f16-bit decode in place of the E2M1 table.
Every variant keeps the CPU's order per output, so its bits must equal the shipped kernel's.

    python3 bench/data/gpu-variants/matmul/gen.py /tmp/mm
"""
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[4]
# The matmul as shipped until the first round (2026-12-02): the variants are edits of it.
SHIPPED = (ROOT / "bench/data/gpu-variants/matmul/base_r1.wgsl").read_text()


def must_replace(text, old, new):
    assert old in text, old
    return text.replace(old, new)


# The first statement of the table decode in each weight row's step, and the end of its last.
LUT_DECODE_START = "                    let word = w[wb[j] + b * 4u];\n"
LUT_DECODE_END = "lut[word >> 28u] * s,\n                    );\n"

# The shipped decode (`mx_values` in products.wgsl, which the harness prepends): E2M1 as f16 bits
# times 2^(E - 113), exactly the table's value times 2^(E - 127).
F16_DECODE = """                    let v = mx_values(w[wb[j] + b * 4u], scale_byte(sb[j] + b));
                    lo[j] = v.lo;
                    hi[j] = v.hi;
"""

SCALE_BYTE = """
// Scale byte `idx` of the matrix (packed four to a word from word `s_off`).
fn scale_byte(idx: u32) -> u32 {
    let i = p.s_off * 4u + idx;
    return (scales[i >> 2u] >> ((i & 3u) * 8u)) & 0xffu;
}
"""

# The lanes' write-out indexed the accumulators by the round `q`, a loop the compiler does not
# unroll (it holds barriers), which put the whole array in local memory (LDL/STL in the SASS).
# `shift` writes accumulator 0 of each weight row and moves the others down instead, so every
# index is a constant once the short loops are unrolled.
WRITE_OUT = """            xt4[j * 256u + lid.x] = acc[j * MM_XR + q];
        }"""
WRITE_OUT_SHIFT = """            xt4[j * 256u + lid.x] = acc[j * MM_XR];
            for (var i = 0u; i + 1u < MM_XR; i = i + 1u) {
                acc[j * MM_XR + i] = acc[j * MM_XR + i + 1u];
            }
        }"""


def variant(rows, xr, f16, shift=False):
    t = SHIPPED
    t = must_replace(t, "const MM_ROWS: u32 = 1u;", f"const MM_ROWS: u32 = {rows}u;")
    t = must_replace(t, "const MM_XR: u32 = 8u;", f"const MM_XR: u32 = {xr}u;")
    t = must_replace(t, "var wb: array<u32, 2>;", f"var wb: array<u32, {rows}>;")
    t = must_replace(t, "var sb: array<u32, 2>;", f"var sb: array<u32, {rows}>;")
    t = must_replace(t, "var lo: array<vec4<f32>, 2>;", f"var lo: array<vec4<f32>, {rows}>;")
    t = must_replace(t, "var hi: array<vec4<f32>, 2>;", f"var hi: array<vec4<f32>, {rows}>;")
    t = must_replace(t, "var wv: array<vec4<f32>, 2>;", f"var wv: array<vec4<f32>, {rows}>;")
    t = must_replace(t, "var acc: array<vec4<f32>, 16>;", f"var acc: array<vec4<f32>, {rows * xr}>;")
    # Workgroup memory: the input tile, and one vec4 per thread and weight row for the lanes.
    size = max(xr * 64, rows * 256)
    t = must_replace(t, "var<workgroup> xt4: array<vec4<f32>, 512>;", f"var<workgroup> xt4: array<vec4<f32>, {size}>;")
    if shift:
        t = must_replace(t, WRITE_OUT, WRITE_OUT_SHIFT)
    if f16:
        start = t.index(LUT_DECODE_START)
        end = t.index(LUT_DECODE_END, start) + len(LUT_DECODE_END)
        t = t[:start] + F16_DECODE + t[end:] + SCALE_BYTE
    header = f"// rows_per_group: {64 * rows}\n// inputs_per_group: {xr}\n// trusted\n"
    return header + t


VARIANTS = {
    "mm_lut_1x8": (1, 8, False),  # the shipped kernel through the harness (control)
    "mm_f16_1x8": (1, 8, True),
    "mm_f16_2x8": (2, 8, True),
    "mm_f16_2x4": (2, 4, True),
    "mm_f16_4x4": (4, 4, True),
    "mm_lut_4x4": (4, 4, False),
    "mm_f16_4x2": (4, 2, True),
    "mm_f16_4x8": (4, 8, True),
    "mm_f16_8x2": (8, 2, True),
    "mm_f16_8x4": (8, 4, True),
    "mm_lut_1x8_shift": (1, 8, False, True),
    "mm_f16_1x8_shift": (1, 8, True, True),
    "mm_f16_2x8_shift": (2, 8, True, True),
    "mm_f16_2x4_shift": (2, 4, True, True),
    "mm_f16_4x4_shift": (4, 4, True, True),
    "mm_f16_4x8_shift": (4, 8, True, True),
    "mm_lut_4x4_shift": (4, 4, False, True),
}

if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/mm")
    out.mkdir(parents=True, exist_ok=True)
    names = sys.argv[2:] or list(VARIANTS)
    for name in names:
        (out / f"{name}.wgsl").write_text(variant(*VARIANTS[name]))
    print(" ".join(names))
