// The base layout (own u32 loads) with the f16 decode, compiled without wgpu's checks.
// trusted
// Base layout (4 threads per row, 16 rows per workgroup), E2M1 decoded through f16 bits
// (unpack2x16float) instead of the workgroup table; scales carry the 2^14.
@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;

var<workgroup> part: array<vec4<f32>, 64>;

// 2^(e - 127) * 2^14 for E8M0 bytes 1..240.
fn s14(e: u32) -> f32 {
    return bitcast<f32>((e + 14u) << 23u);
}

// Low nibbles of bytes 0 and 2 of v as f32 (E2M1 value * 2^-14, exact via f16).
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

fn mx_exact(acc: vec4<f32>, word: u32, s: f32, xlo: vec4<f32>, xhi: vec4<f32>) -> vec4<f32> {
    let lo = vec4<f32>(e2m1(word & 15u) * s, e2m1((word >> 8u) & 15u) * s, e2m1((word >> 16u) & 15u) * s, e2m1((word >> 24u) & 15u) * s);
    let hi = vec4<f32>(e2m1((word >> 4u) & 15u) * s, e2m1((word >> 12u) & 15u) * s, e2m1((word >> 20u) & 15u) * s, e2m1(word >> 28u) * s);
    return fma(hi, xhi, fma(lo, xlo, acc));
}

@compute @workgroup_size(64)
fn matvec(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nw: vec3<u32>,
) {
    let g = lid.x & 3u;
    let slot = lid.x >> 2u;
    let r = (wg.y * nw.x + wg.x) * 16u + slot;
    let x0 = p.x_off / 4u;
    var acc = vec4<f32>(0.0);
    if (r < p.rows) {
        let blocks = p.cols >> 5u;
        let wb = p.w_off + r * (p.cols >> 3u) + g;
        let sb = r * blocks;
        let sw0 = p.s_off + (sb >> 2u);
        for (var b = 0u; b < blocks; b = b + 4u) {
            let w0 = w[wb + b * 4u];
            let w1 = w[wb + b * 4u + 4u];
            let w2 = w[wb + b * 4u + 8u];
            let w3 = w[wb + b * 4u + 12u];
            let sw = scales[sw0 + (b >> 2u)];
            let xi = x0 + b * 8u + g;
            if (any(unpack4xU8(sw) > vec4<u32>(240u))) {
                acc = mx_exact(acc, w0, e8m0(sw & 0xffu), x[xi], x[xi + 4u]);
                acc = mx_exact(acc, w1, e8m0((sw >> 8u) & 0xffu), x[xi + 8u], x[xi + 12u]);
                acc = mx_exact(acc, w2, e8m0((sw >> 16u) & 0xffu), x[xi + 16u], x[xi + 20u]);
                acc = mx_exact(acc, w3, e8m0(sw >> 24u), x[xi + 24u], x[xi + 28u]);
            } else {
                acc = mx_step16(acc, w0, s14(sw & 0xffu), x[xi], x[xi + 4u]);
                acc = mx_step16(acc, w1, s14((sw >> 8u) & 0xffu), x[xi + 8u], x[xi + 12u]);
                acc = mx_step16(acc, w2, s14((sw >> 16u) & 0xffu), x[xi + 16u], x[xi + 20u]);
                acc = mx_step16(acc, w3, s14(sw >> 24u), x[xi + 24u], x[xi + 28u]);
            }
        }
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
