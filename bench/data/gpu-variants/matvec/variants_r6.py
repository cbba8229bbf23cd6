# Writes the r6_* one-row MXFP4 kernel variants (see README.md, "Round 6") into DIR: the shipped
# kernel's MXFP4 path (with the decode of those rounds, wgsl_gen.PAIR16) with its tile width, its workgroup
# memory (to cap how many workgroups an SM holds) or its decode changed:
#   python3 bench/data/gpu-variants/matvec/variants_r6.py /tmp/r6
#   deltafin bench kernels --backend gpu --reps 200 --matvec-variants /tmp/r6 [--matvec-rows N]
# They cover the bench matrix's case only (blocks a multiple of the tile, no scale byte above 240);
# the `nodec` ablations change the output bits by design.
import os
import sys

from wgsl_gen import PAIR16, SHIPPED, guarded, shipped_fn

# The shipped kernel's end: the 16 lanes through workgroup memory and the fixed tree (its text
# from `part[lid.x] = acc;` to the close of `matvec`).
_at = SHIPPED.index("    part[lid.x] = acc;")
TREE = SHIPPED[_at:SHIPPED.index("\n}\n", _at) + 3]


def tree(guard=None):
    """TREE, with both the store and the write of the result under `guard` if given."""
    if guard is None:
        return TREE
    t = TREE.replace("    part[lid.x] = acc;\n", f"    if ({guard}) {{\n        part[lid.x] = acc;\n    }}\n")
    return t.replace("if (g == 0u && r < p.rows)", f"if ({guard} && g == 0u && r < p.rows)")


# The decode of rounds 6 to 11 (wgsl_gen.PAIR16), its f16 pairs alone, and the shipped scale.
DECODE = "\n" + PAIR16 + shipped_fn(SHIPPED, "s14_at")
F16_PAIR = PAIR16[PAIR16.index("fn f16_pair"):PAIR16.index("fn mx_step")]
# Ablation: one logic operation per word stands in for the decode (eight values, no scale).
NODEC = """
fn mx_step(acc: vec4<f32>, word: u32, s14: f32, xlo: vec4<f32>, xhi: vec4<f32>) -> vec4<f32> {
    let v = vec4<f32>(bitcast<f32>(word & 0x3f7fffffu));
    return fma(v, xhi, fma(v, xlo, acc));
}
""" + shipped_fn(SHIPPED, "s14_at")
# The shipped decode since round 12: the same f16 bits in 11 integer operations per word.
# f16_at and nibbles_f16 come with products.wgsl, which the harness prepends.
SPREAD = "\n" + "".join(shipped_fn(SHIPPED, f) for f in ("mx_step", "s14_at"))
DECODES = {"ship": DECODE, "nodec": NODEC, "spread": SPREAD}


def kernel(tile=8, part_vec4=None, decode="ship", copy="late", sc="load", l2=0, rows=16, xsrc="load"):
    """`tile` blocks per row per step; `part_vec4`: size of the reduction array (padding caps the
    workgroups per SM through workgroup memory); `copy`: the next tile stored to workgroup memory
    after the compute ("late", as shipped) or right after its loads ("early"), or copied by a
    third warp of its own ("producer", workgroups of 96); `sc`: the block scales loaded in the
    step that uses them ("load", as shipped), one tile ahead into registers ("reg"), or copied
    into workgroup memory with the tile ("tile"); `l2`: if not 0, each thread also loads one word
    of each 32-byte sector of the tile `l2` steps ahead (rows lid / 4, sector lid % 4), so that the
    tile's own loads find it in L2 (the word is folded into a value that is never written);
    `rows` per workgroup of 4 * rows threads (the register budget the compiler must keep under is
    65536 / threads); `xsrc`: the inputs loaded from memory where used ("load", as shipped) or
    copied with the tile into workgroup memory ("smem", tiles of 8 blocks only)."""
    if copy == "producer":
        return producer(decode, sc)
    # The input copy and the L2 touch are written for tiles of 8 blocks (64 input vec4 and four
    # 32-byte sectors per row per tile); the input copy needs 64 threads.
    assert xsrc == "load" or (tile == 8 and rows >= 16), "xsrc='smem' needs tiles of 8 and 16+ rows"
    assert not l2 or tile == 8, "the L2 touch covers tiles of 8 blocks"
    T = tile
    per = T // 4  # vec4 of one word's blocks per tile row, and copies per thread
    R = rows
    W = 4 * R  # threads
    if part_vec4 is None:
        part_vec4 = W
    step = W // T  # rows between a thread's copies
    row_v = T + 1
    half = R * row_v
    s = f"""// trusted
// rows_per_group: {R}
@group(0) @binding(0) var<storage, read> wv: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
{DECODES[decode]}
var<workgroup> tile: array<vec4<u32>, {2 * half}>;
var<workgroup> part: array<vec4<f32>, {part_vec4}>;
var<workgroup> stile: array<u32, {2 * R * per}>;
var<workgroup> xs: array<vec4<f32>, 128>;

fn store_tile(at: u32, j: u32, v: vec4<u32>) {{
    let c = j & 3u;
    tile[at][c] = v.x;
    tile[at + {per}u][c] = v.y;
    tile[at + {2 * per}u][c] = v.z;
    tile[at + {3 * per}u][c] = v.w;
}}

@compute @workgroup_size({W})
fn matvec(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {{
    let g = lid.x & 3u;
    let slot = lid.x >> 2u;
    let base = (wg.y * nw.x + wg.x) * {R}u;
    let r = base + slot;
    let er = select(0u, r, r < p.rows);
    let x0 = p.x_off / 4u;
    let blocks = p.cols >> 5u;
    let tiles = blocks / {T}u;
    let j = lid.x & {T - 1}u;
    let lr = lid.x / {T}u;
    let sw = p.s_off + ((er * blocks) >> 2u);
    var acc = vec4<f32>(0.0);
    let sl = lid.x < {R * per}u;
    let sga = base + lid.x / {per}u;
    let ssrc = p.s_off + ((select(0u, sga, sga < p.rows) * blocks) >> 2u) + lid.x % {per}u;
"""
    if xsrc == "smem":
        s += "    let xm = lid.x & 63u;\n    let xcopy = lid.x < 64u;\n    if (xcopy && 0u < tiles) {\n        xs[xm] = x[x0 + xm];\n    }\n"
    if sc == "reg":
        for i in range(per):
            s += f"    var sn{i} = scales[sw + {i}u];\n"
    if sc == "tile":
        s += "    if (sl && 0u < tiles) {\n        stile[lid.x] = scales[ssrc];\n    }\n"
    if l2:
        s += "    let pga = base + slot;\n    let psrc = (p.w_off >> 2u) + select(0u, pga, pga < p.rows) * blocks + 2u * g;\n    var sink = 0u;\n    var pv = 0u;\n"
    for k in range(per):
        s += f"    let ga{k} = base + lr + {step * k}u;\n"
        s += f"    let src{k} = (p.w_off >> 2u) + select(0u, ga{k}, ga{k} < p.rows) * blocks + j;\n"
        s += f"    let dst{k} = (lr + {step * k}u) * {row_v}u + (j >> 2u);\n"
    s += guarded("0u < tiles", per, "store_tile(dst{k}, j, wv[src{k}]);", "    ")
    s += "    workgroupBarrier();\n"
    s += f"    for (var t = 0u; t < tiles; t = t + 1u) {{\n        let cur = (t & 1u) * {half}u;\n        let nxt = {half}u - cur;\n"
    for k in range(per):
        s += f"        var v{k} = vec4<u32>(0u);\n"
    if xsrc == "smem":
        s += "        let xcur = (t & 1u) * 64u;\n        var xn = vec4<f32>(0.0);\n        if (xcopy && t + 1u < tiles) {\n            xn = x[x0 + (t + 1u) * 64u + xm];\n        }\n"
    if l2:
        s += f"        let pnow = pv;\n        if (t + {l2}u < tiles) {{\n            pv = wv[psrc + (t + {l2}u) * {T}u].x;\n        }}\n"
    if sc == "reg":
        for i in range(per):
            s += f"        let s{i} = sn{i} + 0x0e0e0e0eu;\n"
    if sc == "tile":
        s += f"        let scur = (t & 1u) * {R * per}u;\n        var sv = 0u;\n"
        s += f"        if (sl && t + 1u < tiles) {{\n            sv = scales[ssrc + (t + 1u) * {per}u];\n        }}\n"
        for i in range(per):
            s += f"        let s{i} = stile[scur + slot * {per}u + {i}u] + 0x0e0e0e0eu;\n"
    s += "        if (t + 1u < tiles) {\n"
    for k in range(per):
        s += f"            v{k} = wv[src{k} + (t + 1u) * {T}u];\n"
    if sc == "reg":
        for i in range(per):
            s += f"            sn{i} = scales[sw + (t + 1u) * {per}u + {i}u];\n"
    if copy == "early":
        for k in range(per):
            s += f"            store_tile(nxt + dst{k}, j, v{k});\n"
    s += "        }\n"
    s += f"        let row = cur + slot * {row_v}u + g * {per}u;\n        let xi = x0 + t * {8 * T}u + g;\n"
    for i in range(per):
        s += f"        let q{i} = tile[row + {i}u];\n"
        if sc == "load":
            s += f"        let s{i} = scales[sw + t * {per}u + {i}u] + 0x0e0e0e0eu;\n"
        for c, comp in enumerate("xyzw"):
            b = 4 * i + c
            if xsrc == "smem":
                s += f"        acc = mx_step(acc, q{i}.{comp}, s14_at(s{i}, {c}u), xs[xcur + {8 * b}u + g], xs[xcur + {8 * b + 4}u + g]);\n"
            else:
                s += f"        acc = mx_step(acc, q{i}.{comp}, s14_at(s{i}, {c}u), x[xi + {8 * b}u], x[xi + {8 * b + 4}u]);\n"
    if copy == "late":
        s += guarded("t + 1u < tiles", per, "store_tile(nxt + dst{k}, j, v{k});", "        ")
    if sc == "tile":
        s += f"        if (sl && t + 1u < tiles) {{\n            stile[{R * per}u - scur + lid.x] = sv;\n        }}\n"
    if xsrc == "smem":
        s += "        if (xcopy && t + 1u < tiles) {\n            xs[64u - xcur + xm] = xn;\n        }\n"
    if l2:
        s += "        sink = sink ^ pnow;\n"
    s += "        workgroupBarrier();\n    }\n"
    if l2:
        s += "    if (sink == 0x5a5a5a5au && r == 0xffffffffu) {\n        acc.x = 1.0;\n    }\n"
    return s + tree()


def producer(decode, sc):
    """Tiles of 8 blocks copied by warp 2 (four vec4 per thread per tile) while warps 0 and 1
    compute the tile before: the copy's loads wait on memory in a warp that has nothing else to do."""
    s = f"""// trusted
// rows_per_group: 16
@group(0) @binding(0) var<storage, read> wv: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
{DECODES[decode]}
var<workgroup> tile: array<vec4<u32>, 288>;
var<workgroup> part: array<vec4<f32>, 64>;
var<workgroup> stile: array<u32, 64>;
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
    let sga = base + (l >> 1u);
    let ssrc = p.s_off + ((select(0u, sga, sga < p.rows) * blocks) >> 2u) + (l & 1u);
"""
    for k in range(4):
        s += f"    let ga{k} = base + lr + {4 * k}u;\n"
        s += f"    let src{k} = (p.w_off >> 2u) + select(0u, ga{k}, ga{k} < p.rows) * blocks + j;\n"
        s += f"    let dst{k} = (lr + {4 * k}u) * 9u + (j >> 2u);\n"
    s += "    if (loader && 0u < tiles) {\n"
    if sc == "tile":
        s += "        stile[l] = scales[ssrc];\n"
    for k in range(4):
        s += f"        store_tile(dst{k}, j, wv[src{k}]);\n"
    s += "    }\n    workgroupBarrier();\n"
    s += "    for (var t = 0u; t < tiles; t = t + 1u) {\n        let cur = (t & 1u) * 144u;\n        let nxt = 144u - cur;\n"
    s += "        if (loader) {\n            if (t + 1u < tiles) {\n"
    for k in range(4):
        s += f"                let v{k} = wv[src{k} + (t + 1u) * 8u];\n"
    if sc == "tile":
        s += "                stile[32u - (t & 1u) * 32u + l] = scales[ssrc + (t + 1u) * 2u];\n"
    for k in range(4):
        s += f"                store_tile(nxt + dst{k}, j, v{k});\n"
    s += "            }\n        } else {\n"
    s += "            let row = cur + slot * 9u + g * 2u;\n            let xi = x0 + t * 64u + g;\n"
    for i in range(2):
        s += f"            let q{i} = tile[row + {i}u];\n"
        if sc == "tile":
            s += f"            let s{i} = stile[(t & 1u) * 32u + slot * 2u + {i}u] + 0x0e0e0e0eu;\n"
        else:
            s += f"            let s{i} = scales[sw + t * 2u + {i}u] + 0x0e0e0e0eu;\n"
        for c, comp in enumerate("xyzw"):
            b = 4 * i + c
            s += f"            acc = mx_step(acc, q{i}.{comp}, s14_at(s{i}, {c}u), x[xi + {8 * b}u], x[xi + {8 * b + 4}u]);\n"
    s += "        }\n        workgroupBarrier();\n    }\n"
    return s + tree("!loader")


def lanes2(rows=8):
    """Eight threads per row, two lanes each (thread (g, b) owns lanes 4g + b and 4g + b + 2, bytes
    b and b + 2 of word g), `rows` rows per workgroup of 8 * rows threads; tiles of 8 blocks as
    shipped, and the tile's inputs copied into workgroup memory in the order each thread reads
    them (one vec4 per word: its two lanes' low then high elements), so that a thread holds 5
    registers per word in flight instead of 9. Needs 64 threads or more (the input copy)."""
    assert 8 <= rows <= 32, "8 to 32 rows: the input copy needs 64 threads, wgpu allows 256"
    R = rows
    W = 8 * R
    s = f"""// trusted
// rows_per_group: {R}
@group(0) @binding(0) var<storage, read> wv: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
{F16_PAIR}{shipped_fn(SHIPPED, "s14_at")}{shipped_fn(SHIPPED, "store_tile")}
var<workgroup> tile: array<vec4<u32>, {2 * R * 9}>;
var<workgroup> xs: array<vec4<f32>, 128>;
var<workgroup> part: array<vec2<f32>, {W}>;

// Word `wb` (the thread's word shifted right by 8 b) for lanes (4g + b, 4g + b + 2).
fn mx2(acc: vec2<f32>, wb: u32, s14: f32, xv: vec4<f32>) -> vec2<f32> {{
    let lo = f16_pair(wb << 9u) * s14;
    let hi = f16_pair(wb << 5u) * s14;
    return fma(hi, xv.zw, fma(lo, xv.xy, acc));
}}

@compute @workgroup_size({W})
fn matvec(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {{
    let b = lid.x & 1u;
    let g = (lid.x >> 1u) & 3u;
    let slot = lid.x >> 3u;
    let base = (wg.y * nw.x + wg.x) * {R}u;
    let r = base + slot;
    let er = select(0u, r, r < p.rows);
    let x0 = p.x_off / 4u;
    let blocks = p.cols >> 5u;
    let tiles = blocks / 8u;
    let sw = p.s_off + ((er * blocks) >> 2u);
    // This thread copies block j of tile row lr, and (the first 64) input vec4 m of the tile.
    let j = lid.x & 7u;
    let lr = lid.x >> 3u;
    let ga = base + lr;
    let src = (p.w_off >> 2u) + select(0u, ga, ga < p.rows) * blocks + j;
    let dst = lr * 9u + (j >> 2u);
    let m = lid.x & 63u;
    let xcopy = lid.x < 64u;
    // Input vec4 m is block m / 8, half (m / 4) % 2 (low or high elements), lanes 4 (m % 4) + c.
    let xd = (m >> 3u) * 8u + (m & 3u) * 2u;
    let xc = ((m >> 2u) & 1u) * 2u;
    var acc = vec2<f32>(0.0);
    if (0u < tiles) {{
        store_tile(dst, j, wv[src]);
        if (xcopy) {{
            let v = x[x0 + m];
            xs[xd][xc] = v.x;
            xs[xd + 1u][xc] = v.y;
            xs[xd][xc + 1u] = v.z;
            xs[xd + 1u][xc + 1u] = v.w;
        }}
    }}
    workgroupBarrier();
    for (var t = 0u; t < tiles; t = t + 1u) {{
        let cur = (t & 1u) * {R * 9}u;
        let xcur = (t & 1u) * 64u;
        var v = vec4<u32>(0u);
        var xn = vec4<f32>(0.0);
        if (t + 1u < tiles) {{
            v = wv[src + (t + 1u) * 8u];
            if (xcopy) {{
                xn = x[x0 + (t + 1u) * 64u + m];
            }}
        }}
        let sa = scales[sw + t * 2u] + 0x0e0e0e0eu;
        let sb = scales[sw + t * 2u + 1u] + 0x0e0e0e0eu;
        let row = cur + slot * 9u + g * 2u;
        let qa = tile[row] >> vec4<u32>(8u * b);
        let qb = tile[row + 1u] >> vec4<u32>(8u * b);
        let xi = xcur + g * 2u + b;
        acc = mx2(acc, qa.x, s14_at(sa, 0u), xs[xi]);
        acc = mx2(acc, qa.y, s14_at(sa, 1u), xs[xi + 8u]);
        acc = mx2(acc, qa.z, s14_at(sa, 2u), xs[xi + 16u]);
        acc = mx2(acc, qa.w, s14_at(sa, 3u), xs[xi + 24u]);
        acc = mx2(acc, qb.x, s14_at(sb, 0u), xs[xi + 32u]);
        acc = mx2(acc, qb.y, s14_at(sb, 1u), xs[xi + 40u]);
        acc = mx2(acc, qb.z, s14_at(sb, 2u), xs[xi + 48u]);
        acc = mx2(acc, qb.w, s14_at(sb, 3u), xs[xi + 56u]);
        if (t + 1u < tiles) {{
            store_tile({R * 9}u - cur + dst, j, v);
            if (xcopy) {{
                let d = 64u - xcur + xd;
                xs[d][xc] = xn.x;
                xs[d + 1u][xc] = xn.y;
                xs[d][xc + 1u] = xn.z;
                xs[d + 1u][xc + 1u] = xn.w;
            }}
        }}
        workgroupBarrier();
    }}
    part[lid.x] = acc;
    workgroupBarrier();
    if ((lid.x & 7u) == 0u && r < p.rows) {{
        // part[8 slot + 2g + b] holds lanes 4g + b and 4g + b + 2: the CPU's tree over 16 lanes.
        let o = slot * 8u;
        var l: array<f32, 16>;
        for (var k = 0u; k < 8u; k = k + 1u) {{
            let q = part[o + k];
            let lane = (k >> 1u) * 4u + (k & 1u);
            l[lane] = q.x;
            l[lane + 2u] = q.y;
        }}
        let v0 = (l[0] + l[8]) + (l[4] + l[12]);
        let v1 = (l[1] + l[9]) + (l[5] + l[13]);
        let v2 = (l[2] + l[10]) + (l[6] + l[14]);
        let v3 = (l[3] + l[11]) + (l[7] + l[15]);
        out[p.out_off + p.row0 + r] = (v0 + v2) + (v1 + v3);
    }}
}}
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
    "r11_xs": kernel(xsrc="smem"),
    "r12_spread": kernel(decode="spread"),
    "r12_spread_xs": kernel(decode="spread", xsrc="smem"),
    "r11_lanes2": lanes2(),
    "r11_lanes2_r16": lanes2(rows=16),
    "r11_lanes2_r32": lanes2(rows=32),
    "r10_t4": kernel(tile=4),
    "r10_t4_r32": kernel(tile=4, rows=32),
    "r10_t4_r64": kernel(tile=4, rows=64),
    "r9_rows64": kernel(rows=64),
    "r9_rows128": kernel(rows=128),
    "r8_l2_2": kernel(l2=2),
    "r8_l2_3": kernel(l2=3),
    "r8_l2_4": kernel(l2=4),
    "r8_l2_6": kernel(l2=6),
    "r7_sreg": kernel(sc="reg"),
    "r7_stile": kernel(sc="tile"),
    "r7_stile_t16": kernel(tile=16, sc="tile"),
    "r7_sreg_early": kernel(sc="reg", copy="early"),
    "r7_producer_stile": kernel(copy="producer", sc="tile"),
    # Workgroup memory for at most about 24, 16, 12 and 8 workgroups per SM (228 KiB, 1 KiB each reserved).
    "r6_occ24": kernel(part_vec4=padded(9)),
    "r6_occ16": kernel(part_vec4=padded(14)),
    "r6_occ12": kernel(part_vec4=padded(18)),
    "r6_occ8": kernel(part_vec4=padded(28)),
}
for n, src in V.items():
    with open(os.path.join(out, f"{n}.wgsl"), "w") as f:
        f.write(f"// Generated by variants_r6.py ({n}).\n" + src)
