// The shipped kernel's prototype: 16 rows per workgroup, tiles of 8 blocks through workgroup
// memory, f16 decode, scales unpacked four at a time.
// trusted
// standalone
struct Params {
    rows: u32,
    cols: u32,
    n: u32,
    kind: u32,
    row0: u32,
    out_rows: u32,
    w_off: u32,
    s_off: u32,
    stride: u32,
    x_off: u32,
    out_off: u32,
    _pad: u32,
}

@group(0) @binding(0) var<storage, read> wv: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> scales: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<uniform> p: Params;

fn s14(e: u32) -> f32 {
    return bitcast<f32>((e + 14u) << 23u);
}

fn pair(v: u32) -> vec2<f32> {
    return unpack2x16float(((v & 0x00070007u) << 9u) | ((v & 0x00080008u) << 12u));
}

fn mx_step16(acc: vec4<f32>, word: u32, s: f32, xlo: vec4<f32>, xhi: vec4<f32>) -> vec4<f32> {
    let l02 = pair(word);
    let l13 = pair(word >> 8u);
    let h02 = pair(word >> 4u);
    let h13 = pair(word >> 12u);
    let lo = vec4<f32>(l02.x, l13.x, l02.y, l13.y) * s;
    let hi = vec4<f32>(h02.x, h13.x, h02.y, h13.y) * s;
    return fma(hi, xhi, fma(lo, xlo, acc));
}

var<workgroup> lut: array<f32, 16>;

fn e2m1(code: u32) -> f32 {
    let m = code & 7u;
    let e = m >> 1u;
    var bits = 0u;
    if (m == 1u) {
        bits = 0x3f000000u;
    } else if (m >= 2u) {
        bits = ((e + 126u) << 23u) | ((m & 1u) << 22u);
    }
    return bitcast<f32>(bits | ((code & 8u) << 28u));
}

fn e8m0(s: u32) -> f32 {
    return bitcast<f32>(s << 23u);
}

fn mx_step(acc: vec4<f32>, word: u32, s: f32, xlo: vec4<f32>, xhi: vec4<f32>) -> vec4<f32> {
    let lo = vec4<f32>(lut[word & 15u] * s, lut[(word >> 8u) & 15u] * s, lut[(word >> 16u) & 15u] * s, lut[(word >> 24u) & 15u] * s);
    let hi = vec4<f32>(lut[(word >> 4u) & 15u] * s, lut[(word >> 12u) & 15u] * s, lut[(word >> 20u) & 15u] * s, lut[word >> 28u] * s);
    return fma(hi, xhi, fma(lo, xlo, acc));
}

fn mx_step16b(acc: vec4<f32>, word: u32, s: f32, xlo: vec4<f32>, xhi: vec4<f32>) -> vec4<f32> {
    let l02 = unpack2x16float(((word & 0x00070007u) << 9u) | ((word & 0x00080008u) << 12u));
    let l13 = unpack2x16float(((word & 0x07000700u) << 1u) | ((word & 0x08000800u) << 4u));
    let h02 = unpack2x16float(((word & 0x00700070u) << 5u) | ((word & 0x00800080u) << 8u));
    let h13 = unpack2x16float(((word & 0x70007000u) >> 3u) | (word & 0x80008000u));
    let lo = vec4<f32>(l02.x, l13.x, l02.y, l13.y) * s;
    let hi = vec4<f32>(h02.x, h13.x, h02.y, h13.y) * s;
    return fma(hi, xhi, fma(lo, xlo, acc));
}

// E2M1 * 2^-14 (the f16 path's scale) in workgroup memory.
var<workgroup> lut14: array<f32, 16>;

fn mx_mix(acc: vec4<f32>, word: u32, s: f32, xlo: vec4<f32>, xhi: vec4<f32>) -> vec4<f32> {
    let h02 = unpack2x16float(((word & 0x00700070u) << 5u) | ((word & 0x00800080u) << 8u));
    let h13 = unpack2x16float(((word & 0x70007000u) >> 3u) | (word & 0x80008000u));
    let lo = vec4<f32>(lut14[word & 15u], lut14[(word >> 8u) & 15u], lut14[(word >> 16u) & 15u], lut14[(word >> 24u) & 15u]) * s;
    let hi = vec4<f32>(h02.x, h13.x, h02.y, h13.y) * s;
    return fma(hi, xhi, fma(lo, xlo, acc));
}

fn mx_lut(acc: vec4<f32>, word: u32, s: f32, xlo: vec4<f32>, xhi: vec4<f32>) -> vec4<f32> {
    let lo = vec4<f32>(lut14[word & 15u], lut14[(word >> 8u) & 15u], lut14[(word >> 16u) & 15u], lut14[(word >> 24u) & 15u]) * s;
    let hi = vec4<f32>(lut14[(word >> 4u) & 15u], lut14[(word >> 12u) & 15u], lut14[(word >> 20u) & 15u], lut14[word >> 28u]) * s;
    return fma(hi, xhi, fma(lo, xlo, acc));
}
// rows_per_group: 16
// smem t-layout v3: 64 threads, 16 rows (1 per thread), tiles of 8 blocks, decode f16b, packed scales True.
var<workgroup> tile: array<vec4<u32>, 288>;
var<workgroup> part: array<vec4<f32>, 64>;

@compute @workgroup_size(64)
fn matvec(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nw: vec3<u32>,
) {
    let g = lid.x & 3u;
    let slot = lid.x >> 2u;
    let base = (wg.y * nw.x + wg.x) * 16u;
    let x0 = p.x_off / 4u;
    let blocks = p.cols >> 5u;
    let tiles = blocks / 8u;
    let j = lid.x & 7u;
    let r0 = base + slot + 0u;
    let sw0 = p.s_off + ((select(0u, r0, r0 < p.rows) * blocks) >> 2u);
    var acc0 = vec4<f32>(0.0);
    let lr0 = (lid.x >> 3u) + 0u;
    let gr0 = base + lr0;
    let src0 = p.w_off / 4u + select(0u, gr0, gr0 < p.rows) * blocks + j;
    let lr1 = (lid.x >> 3u) + 8u;
    let gr1 = base + lr1;
    let src1 = p.w_off / 4u + select(0u, gr1, gr1 < p.rows) * blocks + j;
    var v0 = wv[src0];
    tile[lr0 * 9u + 0u + (j >> 2u)][j & 3u] = v0.x;
    tile[lr0 * 9u + 2u + (j >> 2u)][j & 3u] = v0.y;
    tile[lr0 * 9u + 4u + (j >> 2u)][j & 3u] = v0.z;
    tile[lr0 * 9u + 6u + (j >> 2u)][j & 3u] = v0.w;
    var v1 = wv[src1];
    tile[lr1 * 9u + 0u + (j >> 2u)][j & 3u] = v1.x;
    tile[lr1 * 9u + 2u + (j >> 2u)][j & 3u] = v1.y;
    tile[lr1 * 9u + 4u + (j >> 2u)][j & 3u] = v1.z;
    tile[lr1 * 9u + 6u + (j >> 2u)][j & 3u] = v1.w;
    workgroupBarrier();
    for (var t = 0u; t < tiles; t = t + 1u) {
        let cur = (t & 1u) * 144u;
        let nxt = 144u - cur;
        if (t + 1u < tiles) {
            v0 = wv[src0 + (t + 1u) * 8u];
            v1 = wv[src1 + (t + 1u) * 8u];
        }
        let xi = x0 + t * 64u + g;
        let sa0 = scales[sw0 + t * 2u];
        let sb0 = scales[sw0 + t * 2u + 1u];
        let row0 = cur + (slot + 0u) * 9u + g * 2u;
        let qa0 = tile[row0];
        let qb0 = tile[row0 + 1u];
        let pa0 = sa0 + 0x0e0e0e0eu;
        let pb0 = sb0 + 0x0e0e0e0eu;
        acc0 = mx_step16b(acc0, qa0.x, bitcast<f32>((pa0 << 23u) & 0x7f800000u), x[xi + 0u], x[xi + 4u]);
        acc0 = mx_step16b(acc0, qa0.y, bitcast<f32>((pa0 << 15u) & 0x7f800000u), x[xi + 8u], x[xi + 12u]);
        acc0 = mx_step16b(acc0, qa0.z, bitcast<f32>((pa0 << 7u) & 0x7f800000u), x[xi + 16u], x[xi + 20u]);
        acc0 = mx_step16b(acc0, qa0.w, bitcast<f32>((pa0 >> 1u) & 0x7f800000u), x[xi + 24u], x[xi + 28u]);
        acc0 = mx_step16b(acc0, qb0.x, bitcast<f32>((pb0 << 23u) & 0x7f800000u), x[xi + 32u], x[xi + 36u]);
        acc0 = mx_step16b(acc0, qb0.y, bitcast<f32>((pb0 << 15u) & 0x7f800000u), x[xi + 40u], x[xi + 44u]);
        acc0 = mx_step16b(acc0, qb0.z, bitcast<f32>((pb0 << 7u) & 0x7f800000u), x[xi + 48u], x[xi + 52u]);
        acc0 = mx_step16b(acc0, qb0.w, bitcast<f32>((pb0 >> 1u) & 0x7f800000u), x[xi + 56u], x[xi + 60u]);
        if (t + 1u < tiles) {
            tile[nxt + lr0 * 9u + 0u + (j >> 2u)][j & 3u] = v0.x;
            tile[nxt + lr0 * 9u + 2u + (j >> 2u)][j & 3u] = v0.y;
            tile[nxt + lr0 * 9u + 4u + (j >> 2u)][j & 3u] = v0.z;
            tile[nxt + lr0 * 9u + 6u + (j >> 2u)][j & 3u] = v0.w;
            tile[nxt + lr1 * 9u + 0u + (j >> 2u)][j & 3u] = v1.x;
            tile[nxt + lr1 * 9u + 2u + (j >> 2u)][j & 3u] = v1.y;
            tile[nxt + lr1 * 9u + 4u + (j >> 2u)][j & 3u] = v1.z;
            tile[nxt + lr1 * 9u + 6u + (j >> 2u)][j & 3u] = v1.w;
        }
        workgroupBarrier();
    }
    part[0u + lid.x] = acc0;
    workgroupBarrier();
    if (g == 0u) {
        if (r0 < p.rows) {
            let b = 0u + slot * 4u;
            let v8a = part[b] + part[b + 2u];
            let v8b = part[b + 1u] + part[b + 3u];
            let v4 = v8a + v8b;
            out[p.out_off + p.row0 + r0] = (v4.x + v4.z) + (v4.y + v4.w);
        }
    }
}
