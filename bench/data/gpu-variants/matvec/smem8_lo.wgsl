// Ablation: the tiled pattern (vec4 copies through workgroup memory) without the decode.
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
// rows_per_group: 64
// smem pattern: 256 threads, 64 rows, tiles of 8 blocks per row through workgroup memory,
// decode lo, x loads False.
var<workgroup> tile: array<vec4<u32>, 1152>;
var<workgroup> part: array<vec4<f32>, 256>;

@compute @workgroup_size(256)
fn matvec(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nw: vec3<u32>,
) {
    let g = lid.x & 3u;
    let slot = lid.x >> 2u;
    let base = (wg.y * nw.x + wg.x) * 64u;
    let r = base + slot;
    let x0 = p.x_off / 4u;
    let blocks = p.cols >> 5u;
    let tiles = blocks / 8u;
    let er = select(0u, r, r < p.rows);
    let sw0 = p.s_off + ((er * blocks) >> 2u);
    let k0 = lid.x + 0u;
    let gr0 = base + k0 / 8u;
    let src0 = p.w_off / 4u + select(0u, gr0, gr0 < p.rows) * blocks + k0 % 8u;
    let dst0 = (k0 / 8u) * 9u + k0 % 8u;
    var v0 = wv[src0];
    tile[dst0] = v0;
    let k1 = lid.x + 256u;
    let gr1 = base + k1 / 8u;
    let src1 = p.w_off / 4u + select(0u, gr1, gr1 < p.rows) * blocks + k1 % 8u;
    let dst1 = (k1 / 8u) * 9u + k1 % 8u;
    var v1 = wv[src1];
    tile[dst1] = v1;
    workgroupBarrier();
    var acc = vec4<f32>(0.0);
    for (var t = 0u; t < tiles; t = t + 1u) {
        let cur = (t & 1u) * 576u;
        let nxt = 576u - cur;
        if (t + 1u < tiles) {
            v0 = wv[src0 + (t + 1u) * 8u];
            v1 = wv[src1 + (t + 1u) * 8u];
        }
        let sc0 = scales[sw0 + t * 2u + 0u];
        let sc1 = scales[sw0 + t * 2u + 1u];
        let row = cur + slot * 9u;
        let xi = x0 + t * 64u + g;
        acc = acc + vec4<f32>(bitcast<f32>((tile[row + 0u][g] & 0x3fffffffu) | 0x30000000u) * s14((sc0 >> 0u) & 0xffu));
        acc = acc + vec4<f32>(bitcast<f32>((tile[row + 1u][g] & 0x3fffffffu) | 0x30000000u) * s14((sc0 >> 8u) & 0xffu));
        acc = acc + vec4<f32>(bitcast<f32>((tile[row + 2u][g] & 0x3fffffffu) | 0x30000000u) * s14((sc0 >> 16u) & 0xffu));
        acc = acc + vec4<f32>(bitcast<f32>((tile[row + 3u][g] & 0x3fffffffu) | 0x30000000u) * s14(sc0 >> 24u));
        acc = acc + vec4<f32>(bitcast<f32>((tile[row + 4u][g] & 0x3fffffffu) | 0x30000000u) * s14((sc1 >> 0u) & 0xffu));
        acc = acc + vec4<f32>(bitcast<f32>((tile[row + 5u][g] & 0x3fffffffu) | 0x30000000u) * s14((sc1 >> 8u) & 0xffu));
        acc = acc + vec4<f32>(bitcast<f32>((tile[row + 6u][g] & 0x3fffffffu) | 0x30000000u) * s14((sc1 >> 16u) & 0xffu));
        acc = acc + vec4<f32>(bitcast<f32>((tile[row + 7u][g] & 0x3fffffffu) | 0x30000000u) * s14(sc1 >> 24u));
        if (t + 1u < tiles) {
            tile[nxt + dst0] = v0;
            tile[nxt + dst1] = v1;
        }
        workgroupBarrier();
    }
    part[lid.x] = acc;
    workgroupBarrier();
    if (g == 0u && r < p.rows) {
        let b = slot * 4u;
        let v8a = part[b] + part[b + 2u];
        let v8b = part[b + 1u] + part[b + 3u];
        let v4 = v8a + v8b;
        out[p.out_off + p.row0 + r] = (v4.x + v4.z) + (v4.y + v4.w);
    }
}
