# Writes the r4_* / r5_* one-row MXFP4 kernel variants (see README.md) into DIR (default: here),
# each the shipped kernel's MXFP4 path (with the decode it had then, wgsl_gen.PAIR16) with one change:
#   python3 bench/data/gpu-variants/matvec/variants_r4.py /tmp/r4
#   deltafin bench kernels --backend gpu --reps 200 --matvec-variants /tmp/r4
# They cover the bench matrix's case only (blocks a multiple of 8, no scale byte above 240); the
# ablations (nox, noscale, nocvt) change the output bits by design.
import os

from wgsl_gen import PAIR16, SHIPPED, guarded, shipped_fn

HDR = """// trusted
// rows_per_group: {rows}
@group(0) @binding(0) var<storage, read> wv: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
"""
# The decode these rounds ran with (wgsl_gen.PAIR16) and the shipped scale.
COMMON = "\n" + PAIR16 + shipped_fn(SHIPPED, "s14_at")
# alt decode: signs and magnitudes split once per word; each pair one shift each and a combine
LOP = """
fn pair_at(w: u32, a: u32, b: u32) -> vec2<f32> {
    return unpack2x16float(((w << a) & 0x0e000e00u) | ((w << b) & 0x80008000u));
}
fn mx_step(acc: vec4<f32>, word: u32, s14: f32, xlo: vec4<f32>, xhi: vec4<f32>) -> vec4<f32> {
    let l02 = pair_at(word, 9u, 12u);
    let l13 = pair_at(word, 1u, 4u);
    let h02 = pair_at(word, 5u, 8u);
    let h13 = unpack2x16float(((word >> 3u) & 0x0e000e00u) | (word & 0x80008000u));
    let lo = vec4<f32>(l02.x, l13.x, l02.y, l13.y) * s14;
    let hi = vec4<f32>(h02.x, h13.x, h02.y, h13.y) * s14;
    return fma(hi, xhi, fma(lo, xlo, acc));
}
"""
NOCVT = COMMON.replace("return unpack2x16float((t & 0x0e000e00u) | ((t & 0x10001000u) << 3u));", "let v = (t & 0x0e000e00u) | ((t & 0x10001000u) << 3u);\n    return vec2<f32>(bitcast<f32>(v), bitcast<f32>(v ^ 0x55u));")
F32 = """
fn el(w: u32, m: u32, sgn: u32, right: bool) -> f32 {
    return 0.0;
}
fn mx_step(acc: vec4<f32>, word: u32, s14: f32, xlo: vec4<f32>, xhi: vec4<f32>) -> vec4<f32> {
    let lo = vec4<f32>(
        bitcast<f32>(((word << 22u) & 0x01c00000u) | ((word << 28u) & 0x80000000u)),
        bitcast<f32>(((word << 14u) & 0x01c00000u) | ((word << 20u) & 0x80000000u)),
        bitcast<f32>(((word << 6u) & 0x01c00000u) | ((word << 12u) & 0x80000000u)),
        bitcast<f32>(((word >> 2u) & 0x01c00000u) | ((word << 4u) & 0x80000000u))) * s14;
    let hi = vec4<f32>(
        bitcast<f32>(((word << 18u) & 0x01c00000u) | ((word << 24u) & 0x80000000u)),
        bitcast<f32>(((word << 10u) & 0x01c00000u) | ((word << 16u) & 0x80000000u)),
        bitcast<f32>(((word << 2u) & 0x01c00000u) | ((word << 8u) & 0x80000000u)),
        bitcast<f32>(((word >> 6u) & 0x01c00000u) | (word & 0x80000000u))) * s14;
    return fma(hi, xhi, fma(lo, xlo, acc));
}
"""

def kernel(rows_per_thread=1, depth=1, xmode="load", scale=True, decode="ship"):
    R = 16 * rows_per_thread
    bufs = 2
    half = R * 9
    src = HDR.format(rows=R)
    if decode == "nocvt":
        src += NOCVT
    elif decode == "f32":
        src += F32 + "fn s14_at" + COMMON.split("fn s14_at")[1]
    else:
        src += COMMON if decode == "ship" else COMMON.split("fn s14_at")[0].split("fn f16_pair")[0] + LOP + "fn s14_at" + COMMON.split("fn s14_at")[1]
    if not scale:
        src = src.replace(" * s14;", ";")
    src += f"""
const ROWS: u32 = {R}u;
const TILE_HALF: u32 = {half}u;
var<workgroup> tile: array<vec4<u32>, {half * bufs}>;
var<workgroup> part: array<vec4<f32>, {64 * rows_per_thread}>;
{shipped_fn(SHIPPED, "store_tile")}@compute @workgroup_size(64)
fn matvec(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {{
    let g = lid.x & 3u;
    let slot = lid.x >> 2u;
    let base = (wg.y * nw.x + wg.x) * ROWS;
    let x0 = p.x_off / 4u;
    let blocks = p.cols >> 5u;
    let tiles = blocks / 8u;
    let j = lid.x & 7u;
    let lr = lid.x >> 3u;
"""
    # copy assignments: each thread copies block j of tile rows lr + 8k, k < 2*rpt
    ncopy = 2 * rows_per_thread
    for k in range(ncopy):
        src += f"    let ga{k} = base + lr + {8*k}u;\n"
        src += f"    let src{k} = (p.w_off >> 2u) + select(0u, ga{k}, ga{k} < p.rows) * blocks + j;\n"
        src += f"    let dst{k} = (lr + {8*k}u) * 9u + (j >> 2u);\n"
    for q in range(rows_per_thread):
        src += f"    let r{q} = base + slot + {16*q}u;\n"
        src += f"    let er{q} = select(0u, r{q}, r{q} < p.rows);\n"
        src += f"    let sw{q} = p.s_off + ((er{q} * blocks) >> 2u);\n"
        src += f"    var acc{q} = vec4<f32>(0.0);\n"
    # prologue: tile 0 into buffer 0; with register distance 2, tile 1 into registers
    src += guarded("0u < tiles", ncopy, "store_tile(dst{k}, j, wv[src{k}]);", "    ")
    if depth == 2:
        for k in range(ncopy):
            src += f"    var a{k} = vec4<u32>(0u);\n"
        src += guarded("1u < tiles", ncopy, "a{k} = wv[src{k} + 8u];", "    ")
    src += "    workgroupBarrier();\n"
    src += "    for (var t = 0u; t < tiles; t = t + 1u) {\n"
    src += "        let cur = (t & 1u) * TILE_HALF;\n"
    src += "        let nxt = TILE_HALF - cur;\n"
    for k in range(ncopy):
        src += f"        var v{k} = vec4<u32>(0u);\n"
    src += guarded(f"t + {depth}u < tiles", ncopy, f"v{{k}} = wv[src{{k}} + (t + {depth}u) * 8u];", "        ")
    src += "        let xi = x0 + t * 64u + g;\n"
    if xmode == "load":
        for i in range(16):
            src += f"        let xv{i} = x[xi + {4*i}u];\n"
        xs = [f"xv{i}" for i in range(16)]
    else:
        src += "        let xc = vec4<f32>(f32(t), f32(g), 0.5, 0.25);\n"
        xs = ["xc"] * 16
    for q in range(rows_per_thread):
        src += f"        {{\n        let sa = scales[sw{q} + t * 2u];\n        let sb = scales[sw{q} + t * 2u + 1u];\n"
        src += f"        let row = cur + (slot + {16*q}u) * 9u + g * 2u;\n        let qa = tile[row];\n        let qb = tile[row + 1u];\n"
        if decode == "f32":
            src += "        let pa = sa + 0x7e7e7e7eu;\n        let pb = sb + 0x7e7e7e7eu;\n"
        else:
            src += "        let pa = sa + 0x0e0e0e0eu;\n        let pb = sb + 0x0e0e0e0eu;\n"
        words = ["qa.x", "qa.y", "qa.z", "qa.w", "qb.x", "qb.y", "qb.z", "qb.w"]
        for i, w in enumerate(words):
            pk = "pa" if i < 4 else "pb"
            src += f"        acc{q} = mx_step(acc{q}, {w}, s14_at({pk}, {i % 4}u), {xs[2*i]}, {xs[2*i+1]});\n"
        src += "        }\n"
    src += guarded("t + 1u < tiles", ncopy, "store_tile(nxt + dst{k}, j, " + ("a" if depth == 2 else "v") + "{k});", "        ")
    if depth == 2:
        for k in range(ncopy):
            src += f"        a{k} = v{k};\n"
    src += "        workgroupBarrier();\n    }\n"
    for q in range(rows_per_thread):
        src += f"""    part[lid.x + {64*q}u] = acc{q};
"""
    src += "    workgroupBarrier();\n"
    for q in range(rows_per_thread):
        src += f"""    if (g == 0u && r{q} < p.rows) {{
        let b = (slot + {16*q}u) * 4u;
        let v8a = part[b] + part[b + 2u];
        let v8b = part[b + 1u] + part[b + 3u];
        let v4 = v8a + v8b;
        out[p.out_off + p.row0 + r{q}] = (v4.x + v4.z) + (v4.y + v4.w);
    }}
"""
    src += "}\n"
    return src

import sys
out = sys.argv[1] if len(sys.argv) > 1 else "."
os.makedirs(out, exist_ok=True)
V = {
  "r4_pf2": kernel(depth=2),
  "r4_rows2": kernel(rows_per_thread=2),
  "r4_lop": kernel(decode="lop"),
  "r4_nox": kernel(xmode="const"),
  "r5_noscale": kernel(scale=False),
  "r5_nocvt": kernel(decode="nocvt"),
  "r5_f32": kernel(decode="f32"),
}
for n, s in V.items():
    open(os.path.join(out, f"{n}.wgsl"), "w").write(f"// Generated by variants_r4.py ({n}).\n" + s)
