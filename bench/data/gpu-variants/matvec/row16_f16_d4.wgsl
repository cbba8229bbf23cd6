// One thread per row owning all 16 lanes (vec4 loads, 4 blocks per step), f16 decode.
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
// One thread per row owning all 16 lanes: one vec4<u32> load per block, 4 blocks per step.

@compute @workgroup_size(64)
fn matvec(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nw: vec3<u32>,
) {
    let r = (wg.y * nw.x + wg.x) * 64u + lid.x;
    if (r >= p.rows) {
        return;
    }
    let x0 = p.x_off / 4u;
    let blocks = p.cols >> 5u;
    let wb = p.w_off / 4u + r * blocks;
    let sw0 = p.s_off + ((r * blocks) >> 2u);
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    for (var b = 0u; b < blocks; b = b + 4u) {
        let q0 = wv[wb + b + 0u];
        let q1 = wv[wb + b + 1u];
        let q2 = wv[wb + b + 2u];
        let q3 = wv[wb + b + 3u];
        let sc0 = scales[sw0 + (b >> 2u) + 0u];
        {
            let s = s14((sc0 >> 0u) & 0xffu);
            let xi = x0 + (b + 0u) * 8u;
            a0 = mx_step16(a0, q0.x, s, x[xi], x[xi + 4u]);
            a1 = mx_step16(a1, q0.y, s, x[xi + 1u], x[xi + 5u]);
            a2 = mx_step16(a2, q0.z, s, x[xi + 2u], x[xi + 6u]);
            a3 = mx_step16(a3, q0.w, s, x[xi + 3u], x[xi + 7u]);
        }
        {
            let s = s14((sc0 >> 8u) & 0xffu);
            let xi = x0 + (b + 1u) * 8u;
            a0 = mx_step16(a0, q1.x, s, x[xi], x[xi + 4u]);
            a1 = mx_step16(a1, q1.y, s, x[xi + 1u], x[xi + 5u]);
            a2 = mx_step16(a2, q1.z, s, x[xi + 2u], x[xi + 6u]);
            a3 = mx_step16(a3, q1.w, s, x[xi + 3u], x[xi + 7u]);
        }
        {
            let s = s14((sc0 >> 16u) & 0xffu);
            let xi = x0 + (b + 2u) * 8u;
            a0 = mx_step16(a0, q2.x, s, x[xi], x[xi + 4u]);
            a1 = mx_step16(a1, q2.y, s, x[xi + 1u], x[xi + 5u]);
            a2 = mx_step16(a2, q2.z, s, x[xi + 2u], x[xi + 6u]);
            a3 = mx_step16(a3, q2.w, s, x[xi + 3u], x[xi + 7u]);
        }
        {
            let s = s14(sc0 >> 24u);
            let xi = x0 + (b + 3u) * 8u;
            a0 = mx_step16(a0, q3.x, s, x[xi], x[xi + 4u]);
            a1 = mx_step16(a1, q3.y, s, x[xi + 1u], x[xi + 5u]);
            a2 = mx_step16(a2, q3.z, s, x[xi + 2u], x[xi + 6u]);
            a3 = mx_step16(a3, q3.w, s, x[xi + 3u], x[xi + 7u]);
        }
    }
    let v8a = a0 + a2;
    let v8b = a1 + a3;
    let v4 = v8a + v8b;
    out[p.out_off + p.row0 + r] = (v4.x + v4.z) + (v4.y + v4.w);
}
