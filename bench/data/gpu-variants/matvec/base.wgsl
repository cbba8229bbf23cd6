// The one-row kernel shipped until 2026-12-01: 4 threads per row each loading its own u32 words
// straight from memory, E2M1 through a 16-entry table in workgroup memory.
@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;

var<workgroup> part: array<vec4<f32>, 64>;

// Lanes 4g+i of one MXFP4 block: byte i of `word` (element 4g+i low nibble, 16+4g+i high nibble).
fn mx_step(acc: vec4<f32>, word: u32, s: f32, xlo: vec4<f32>, xhi: vec4<f32>) -> vec4<f32> {
    let lo = vec4<f32>(
        lut[word & 15u] * s,
        lut[(word >> 8u) & 15u] * s,
        lut[(word >> 16u) & 15u] * s,
        lut[(word >> 24u) & 15u] * s,
    );
    let hi = vec4<f32>(
        lut[(word >> 4u) & 15u] * s,
        lut[(word >> 12u) & 15u] * s,
        lut[(word >> 20u) & 15u] * s,
        lut[word >> 28u] * s,
    );
    return fma(hi, xhi, fma(lo, xlo, acc));
}

@compute @workgroup_size(64)
fn matvec(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nw: vec3<u32>,
) {
    if (lid.x < 16u) {
        lut[lid.x] = e2m1(lid.x);
    }
    workgroupBarrier();
    let g = lid.x & 3u;
    let slot = lid.x >> 2u;
    let r = (wg.y * nw.x + wg.x) * 16u + slot;
    let x0 = p.x_off / 4u;
    var acc = vec4<f32>(0.0);
    if (r < p.rows) {
        if (p.kind == 1u) {
            let blocks = p.cols >> 5u;
            // Word g of block b of row r: 4 words per block.
            let wb = p.w_off + r * (p.cols >> 3u) + g;
            let sb = r * blocks;
            var b = 0u;
            if ((sb & 3u) == 0u) {
                // The row's scales start on a word (every K3 width is a multiple of 128): the four
                // blocks of a step take their four scales from one load.
                let sw0 = p.s_off + (sb >> 2u);
                for (; b + 4u <= blocks; b = b + 4u) {
                    let w0 = w[wb + b * 4u];
                    let w1 = w[wb + b * 4u + 4u];
                    let w2 = w[wb + b * 4u + 8u];
                    let w3 = w[wb + b * 4u + 12u];
                    let sw = scales[sw0 + (b >> 2u)];
                    let xi = x0 + b * 8u + g;
                    acc = mx_step(acc, w0, e8m0(sw & 0xffu), x[xi], x[xi + 4u]);
                    acc = mx_step(acc, w1, e8m0((sw >> 8u) & 0xffu), x[xi + 8u], x[xi + 12u]);
                    acc = mx_step(acc, w2, e8m0((sw >> 16u) & 0xffu), x[xi + 16u], x[xi + 20u]);
                    acc = mx_step(acc, w3, e8m0(sw >> 24u), x[xi + 24u], x[xi + 28u]);
                }
            } else {
                for (; b + 4u <= blocks; b = b + 4u) {
                    let w0 = w[wb + b * 4u];
                    let w1 = w[wb + b * 4u + 4u];
                    let w2 = w[wb + b * 4u + 8u];
                    let w3 = w[wb + b * 4u + 12u];
                    let xi = x0 + b * 8u + g;
                    acc = mx_step(acc, w0, scale_at(sb + b), x[xi], x[xi + 4u]);
                    acc = mx_step(acc, w1, scale_at(sb + b + 1u), x[xi + 8u], x[xi + 12u]);
                    acc = mx_step(acc, w2, scale_at(sb + b + 2u), x[xi + 16u], x[xi + 20u]);
                    acc = mx_step(acc, w3, scale_at(sb + b + 3u), x[xi + 24u], x[xi + 28u]);
                }
            }
            for (; b < blocks; b = b + 1u) {
                let xi = x0 + b * 8u + g;
                acc = mx_step(acc, w[wb + b * 4u], scale_at(sb + b), x[xi], x[xi + 4u]);
            }
        } else {
            let chunks = p.stride >> 4u;
            // Words 2g, 2g+1 of chunk c of row r: 8 words per chunk.
            let wb = p.w_off + r * (p.stride >> 1u) + 2u * g;
            var c = 0u;
            for (; c + 4u <= chunks; c = c + 4u) {
                let o = wb + c * 8u;
                let a0 = w[o];
                let b0 = w[o + 1u];
                let a1 = w[o + 8u];
                let b1 = w[o + 9u];
                let a2 = w[o + 16u];
                let b2 = w[o + 17u];
                let a3 = w[o + 24u];
                let b3 = w[o + 25u];
                let xi = x0 + c * 4u + g;
                acc = fma(bf16x4(a0, b0), x[xi], acc);
                acc = fma(bf16x4(a1, b1), x[xi + 4u], acc);
                acc = fma(bf16x4(a2, b2), x[xi + 8u], acc);
                acc = fma(bf16x4(a3, b3), x[xi + 12u], acc);
            }
            for (; c < chunks; c = c + 1u) {
                let o = wb + c * 8u;
                acc = fma(bf16x4(w[o], w[o + 1u]), x[x0 + c * 4u + g], acc);
            }
        }
    }
    part[lid.x] = acc;
    workgroupBarrier();
    if (g == 0u && r < p.rows) {
        // part[4 slot + j] holds lanes 4j .. 4j+3: the tree (l, l+8), (l, l+4), (l, l+2), (l, l+1).
        let b = slot * 4u;
        let v8a = part[b] + part[b + 2u];
        let v8b = part[b + 1u] + part[b + 3u];
        let v4 = v8a + v8b;
        out[p.out_off + p.row0 + r] = (v4.x + v4.z) + (v4.y + v4.w);
    }
}

