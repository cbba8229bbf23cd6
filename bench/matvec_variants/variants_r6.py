# Writes the r6_* one-row MXFP4 kernel variants (see README.md, "Round 6") into DIR: the shipped
# kernel's MXFP4 path (decode read from kernels/matvec.wgsl) with its tile width, its workgroup
# memory (to cap how many workgroups an SM holds) or its decode changed:
#   python3 bench/matvec_variants/variants_r6.py /tmp/r6
#   deltafin bench kernels --backend gpu --reps 200 --matvec-variants /tmp/r6 [--matvec-rows N]
# They cover the bench matrix's case only (blocks a multiple of the tile, no scale byte above 240);
# the `nodec` ablations change the output bits by design.
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SHIPPED = open(os.path.join(HERE, "..", "..", "kernels", "matvec.wgsl")).read()


def shipped_fn(src, name):
    """The text of WGSL function `name` in `src` (up to its closing brace at column 0)."""
    start = src.index("fn " + name + "(")
    return src[start:src.index("\n}\n", start) + 3]


DECODE = "\n" + "".join(shipped_fn(SHIPPED, f) for f in ("f16_pair", "mx_step", "s14_at"))
# Ablation: one logic operation per word stands in for the decode (eight values, no scale).
NODEC = """
fn mx_step(acc: vec4<f32>, word: u32, s14: f32, xlo: vec4<f32>, xhi: vec4<f32>) -> vec4<f32> {
    let v = vec4<f32>(bitcast<f32>(word & 0x3f7fffffu));
    return fma(v, xhi, fma(v, xlo, acc));
}
""" + shipped_fn(SHIPPED, "s14_at")


def kernel(tile=8, part_vec4=64, decode="ship", copy="late"):
    """`tile` blocks per row per step; `part_vec4`: size of the reduction array (padding caps the
    workgroups per SM through workgroup memory); `copy`: the next tile stored to workgroup memory
    after the compute ("late", as shipped) or right after its loads ("early"), or copied by a
    third warp of its own ("producer", workgroups of 96)."""
    if copy == "producer":
        return producer(decode)
    T = tile
    per = T // 4  # vec4 of one word's blocks per tile row, and copies per thread
    step = 64 // T  # rows between a thread's copies
    row_v = T + 1
    half = 16 * row_v
    s = f"""// trusted
// rows_per_group: 16
@group(0) @binding(0) var<storage, read> wv: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
{DECODE if decode == "ship" else NODEC}
var<workgroup> tile: array<vec4<u32>, {2 * half}>;
var<workgroup> part: array<vec4<f32>, {part_vec4}>;

fn store_tile(at: u32, j: u32, v: vec4<u32>) {{
    let c = j & 3u;
    tile[at][c] = v.x;
    tile[at + {per}u][c] = v.y;
    tile[at + {2 * per}u][c] = v.z;
    tile[at + {3 * per}u][c] = v.w;
}}

@compute @workgroup_size(64)
fn matvec(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {{
    let g = lid.x & 3u;
    let slot = lid.x >> 2u;
    let base = (wg.y * nw.x + wg.x) * 16u;
    let r = base + slot;
    let er = select(0u, r, r < p.rows);
    let x0 = p.x_off / 4u;
    let blocks = p.cols >> 5u;
    let tiles = blocks / {T}u;
    let j = lid.x & {T - 1}u;
    let lr = lid.x / {T}u;
    let sw = p.s_off + ((er * blocks) >> 2u);
    var acc = vec4<f32>(0.0);
"""
    for k in range(per):
        s += f"    let ga{k} = base + lr + {step * k}u;\n"
        s += f"    let src{k} = (p.w_off >> 2u) + select(0u, ga{k}, ga{k} < p.rows) * blocks + j;\n"
        s += f"    let dst{k} = (lr + {step * k}u) * {row_v}u + (j >> 2u);\n"
    s += "    if (0u < tiles) {\n"
    for k in range(per):
        s += f"        store_tile(dst{k}, j, wv[src{k}]);\n"
    s += "    }\n    workgroupBarrier();\n"
    s += f"    for (var t = 0u; t < tiles; t = t + 1u) {{\n        let cur = (t & 1u) * {half}u;\n        let nxt = {half}u - cur;\n"
    for k in range(per):
        s += f"        var v{k} = vec4<u32>(0u);\n"
    s += "        if (t + 1u < tiles) {\n"
    for k in range(per):
        s += f"            v{k} = wv[src{k} + (t + 1u) * {T}u];\n"
    if copy == "early":
        for k in range(per):
            s += f"            store_tile(nxt + dst{k}, j, v{k});\n"
    s += "        }\n"
    s += f"        let row = cur + slot * {row_v}u + g * {per}u;\n        let xi = x0 + t * {8 * T}u + g;\n"
    for i in range(per):
        s += f"        let q{i} = tile[row + {i}u];\n        let s{i} = scales[sw + t * {per}u + {i}u] + 0x0e0e0e0eu;\n"
        for c, comp in enumerate("xyzw"):
            b = 4 * i + c
            s += f"        acc = mx_step(acc, q{i}.{comp}, s14_at(s{i}, {c}u), x[xi + {8 * b}u], x[xi + {8 * b + 4}u]);\n"
    if copy == "late":
        s += "        if (t + 1u < tiles) {\n"
        for k in range(per):
            s += f"            store_tile(nxt + dst{k}, j, v{k});\n"
        s += "        }\n"
    s += "        workgroupBarrier();\n    }\n"
    s += """    part[lid.x] = acc;
    workgroupBarrier();
    if (g == 0u && r < p.rows) {
        let b = slot * 4u;
        let v8a = part[b] + part[b + 2u];
        let v8b = part[b + 1u] + part[b + 3u];
        let v4 = v8a + v8b;
        out[p.out_off + p.row0 + r] = (v4.x + v4.z) + (v4.y + v4.w);
    }
}
"""
    return s


def producer(decode):
    """Tiles of 8 blocks copied by warp 2 (four vec4 per thread per tile) while warps 0 and 1
    compute the tile before: the copy's loads wait on memory in a warp that has nothing else to do."""
    s = f"""// trusted
// rows_per_group: 16
@group(0) @binding(0) var<storage, read> wv: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
{DECODE if decode == "ship" else NODEC}
var<workgroup> tile: array<vec4<u32>, 288>;
var<workgroup> part: array<vec4<f32>, 64>;
{shipped_fn(SHIPPED, "store_tile")}
@compute @workgroup_size(96)
fn matvec(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {{
    let base = (wg.y * nw.x + wg.x) * 16u;
    let blocks = p.cols >> 5u;
    let tiles = blocks / 8u;
    let loader = lid.x >= 64u;
    let l = lid.x - 64u;
    let j = l & 7u;
    let lr = l >> 3u;
    let g = lid.x & 3u;
    let slot = (lid.x >> 2u) & 15u;
    let r = base + slot;
    let er = select(0u, r, r < p.rows);
    let x0 = p.x_off / 4u;
    let sw = p.s_off + ((er * blocks) >> 2u);
    var acc = vec4<f32>(0.0);
"""
    for k in range(4):
        s += f"    let ga{k} = base + lr + {4 * k}u;\n"
        s += f"    let src{k} = (p.w_off >> 2u) + select(0u, ga{k}, ga{k} < p.rows) * blocks + j;\n"
        s += f"    let dst{k} = (lr + {4 * k}u) * 9u + (j >> 2u);\n"
    s += "    if (loader && 0u < tiles) {\n"
    for k in range(4):
        s += f"        store_tile(dst{k}, j, wv[src{k}]);\n"
    s += "    }\n    workgroupBarrier();\n"
    s += "    for (var t = 0u; t < tiles; t = t + 1u) {\n        let cur = (t & 1u) * 144u;\n        let nxt = 144u - cur;\n"
    s += "        if (loader) {\n            if (t + 1u < tiles) {\n"
    for k in range(4):
        s += f"                let v{k} = wv[src{k} + (t + 1u) * 8u];\n"
    for k in range(4):
        s += f"                store_tile(nxt + dst{k}, j, v{k});\n"
    s += "            }\n        } else {\n"
    s += "            let row = cur + slot * 9u + g * 2u;\n            let xi = x0 + t * 64u + g;\n"
    for i in range(2):
        s += f"            let q{i} = tile[row + {i}u];\n            let s{i} = scales[sw + t * 2u + {i}u] + 0x0e0e0e0eu;\n"
        for c, comp in enumerate("xyzw"):
            b = 4 * i + c
            s += f"            acc = mx_step(acc, q{i}.{comp}, s14_at(s{i}, {c}u), x[xi + {8 * b}u], x[xi + {8 * b + 4}u]);\n"
    s += "        }\n        workgroupBarrier();\n    }\n"
    s += """    if (!loader) {
        part[lid.x] = acc;
    }
    workgroupBarrier();
    if (!loader && g == 0u && r < p.rows) {
        let b = slot * 4u;
        let v8a = part[b] + part[b + 2u];
        let v8b = part[b + 1u] + part[b + 3u];
        let v4 = v8a + v8b;
        out[p.out_off + p.row0 + r] = (v4.x + v4.z) + (v4.y + v4.w);
    }
}
"""
    return s


def padded(kb):
    """The reduction array grown until the workgroup holds `kb` KiB of workgroup memory."""
    return (kb * 1024 - 2 * 16 * 9 * 16) // 16


out = sys.argv[1] if len(sys.argv) > 1 else "."
os.makedirs(out, exist_ok=True)
V = {
    "r6_t8": kernel(),
    "r6_t8_nodec": kernel(decode="nodec"),
    "r6_t16": kernel(tile=16),
    "r6_t16_nodec": kernel(tile=16, decode="nodec"),
    "r6_early": kernel(copy="early"),
    "r6_early_t16": kernel(tile=16, copy="early"),
    "r6_producer": kernel(copy="producer"),
    "r6_producer_nodec": kernel(copy="producer", decode="nodec"),
    # Workgroup memory for at most about 24, 16, 12 and 8 workgroups per SM (228 KiB, 1 KiB each reserved).
    "r6_occ24": kernel(part_vec4=padded(9)),
    "r6_occ16": kernel(part_vec4=padded(14)),
    "r6_occ12": kernel(part_vec4=padded(18)),
    "r6_occ8": kernel(part_vec4=padded(28)),
}
for n, src in V.items():
    with open(os.path.join(out, f"{n}.wgsl"), "w") as f:
        f.write(f"// Generated by variants_r6.py ({n}).\n" + src)
