// Matrix products for the GPU backend, in the CPU kernels' operation order so that a GPU whose
// `fma` is fused gives the CPU's bits: out[i * rows + r] = W[r] . x[i], where lane l (of 16)
// accumulates the elements k = l, l + 16, l + 32, ... with fused multiply-add (the tail past
// `cols` padded with 0 x 0), then the 16 lanes are summed by the fixed tree
// (l, l + 8), (l, l + 4), (l, l + 2), (l, l + 1) (`cpu::reduce16`).
//
// kind 0: W is bf16, row-major, two per u32 (little-endian).
// kind 1: W is MXFP4 as shipped (weight_packed: element 2i the low nibble, 2i+1 the high one;
//         weight_scale: E8M0, one per 32 inputs); `x` is deinterleaved per block of 32 (the 16
//         even-indexed inputs, then the 16 odd ones: `cpu::deinterleave_mxfp4_input`), so element
//         k of a block is the low nibble of byte k for k < 16 and the high nibble of byte k - 16.
// The bytes are decoded here, never re-encoded.
//
// Entry points: `matmul` (u32 loads, each decoded weight and each staged input used by several
// outputs; see there), `fma_probe` and `fma_peak` (the bench's f32 peak). One input row goes to
// matvec.wgsl.

// Params, scales, out, lut, e2m1, e8m0 and bf16x4: products.wgsl (prepended).
@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(4) var<uniform> p: Params;

// The E8M0 scale of block `idx` of the matrix (scales packed four to a word from word `s_off`).
fn scale_at(idx: u32) -> f32 {
    let i = p.s_off * 4u + idx;
    return e8m0((scales[i >> 2u] >> ((i & 3u) * 8u)) & 0xffu);
}


// Several input rows (`n > 1`), register-tiled so that each load serves several multiply-adds. A
// workgroup of 256 threads is 64 slots x 4; thread g of a slot owns lanes 4g..4g+3 (as in matvec.wgsl) of MM_ROWS weight rows
// (base + 64j + slot) for MM_XR input rows. Per 32-element MXFP4 block it loads one u32 word per
// weight row (bytes 4g..4g+3: its lanes' low and high nibbles) and one scale, decodes 8 values
// once and uses them for all MM_XR input rows, whose vec4 inputs (staged in workgroup memory, 256
// columns per tile) serve all MM_ROWS weight rows. bf16: words 2g, 2g+1 of each 16-element chunk.
// The 16 lanes of each output meet in workgroup memory (one input row per round) for the tree.
// Measured on the H200 (2026-12-01, 512 input rows): 1 x 8 ran MXFP4 at 1,997 GMAC/s, 2 x 8 at 1,563,
// 2 x 4 at 1,838, the earlier byte-loading kernel at 151.
const MM_ROWS: u32 = 1u;
const MM_XR: u32 = 8u;
const RTILE: u32 = 256u;
// MM_XR x RTILE floats at most (8 input rows); reused for the lanes at the end.
var<workgroup> xt4: array<vec4<f32>, 512>;

@compute @workgroup_size(256)
fn matmul(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wg: vec3<u32>) {
    if (lid.x < 16u) {
        lut[lid.x] = e2m1(lid.x);
    }
    let g = lid.x & 3u;
    let slot = lid.x >> 2u;
    let base = wg.x * 64u * MM_ROWS;
    let i0 = wg.y * MM_XR;
    var wb: array<u32, 2>;
    var sb: array<u32, 2>;
    for (var j = 0u; j < MM_ROWS; j = j + 1u) {
        // Rows past `rows` read the last row (in bounds) and are not written.
        let r = min(base + 64u * j + slot, p.rows - 1u);
        if (p.kind == 1u) {
            wb[j] = p.w_off + r * (p.cols >> 3u) + g;
            sb[j] = r * (p.cols >> 5u);
        } else {
            wb[j] = p.w_off + r * (p.stride >> 1u) + 2u * g;
        }
    }
    var acc: array<vec4<f32>, 16>;
    for (var a = 0u; a < MM_ROWS * MM_XR; a = a + 1u) {
        acc[a] = vec4<f32>(0.0);
    }
    // Lane order as on the CPU: up to the columns rounded up to 16, the padding fma(0, 0, acc).
    let padded = ((p.cols + 15u) / 16u) * 16u;
    for (var t0 = 0u; t0 < padded; t0 = t0 + RTILE) {
        for (var v = lid.x; v < MM_XR * (RTILE / 4u); v = v + 256u) {
            let q = v / (RTILE / 4u);
            let k = t0 + (v % (RTILE / 4u)) * 4u;
            var e = vec4<f32>(0.0);
            if (i0 + q < p.n) {
                let o = p.x_off + (i0 + q) * p.cols + k;
                if (k < p.cols) {
                    e.x = x[o];
                }
                if (k + 1u < p.cols) {
                    e.y = x[o + 1u];
                }
                if (k + 2u < p.cols) {
                    e.z = x[o + 2u];
                }
                if (k + 3u < p.cols) {
                    e.w = x[o + 3u];
                }
            }
            xt4[v] = e;
        }
        workgroupBarrier();
        let end = min(RTILE, padded - t0);
        if (p.kind == 1u) {
            for (var jb = 0u; jb < end / 32u; jb = jb + 1u) {
                let b = t0 / 32u + jb;
                var lo: array<vec4<f32>, 2>;
                var hi: array<vec4<f32>, 2>;
                for (var j = 0u; j < MM_ROWS; j = j + 1u) {
                    let word = w[wb[j] + b * 4u];
                    let s = scale_at(sb[j] + b);
                    lo[j] = vec4<f32>(
                        lut[word & 15u] * s,
                        lut[(word >> 8u) & 15u] * s,
                        lut[(word >> 16u) & 15u] * s,
                        lut[(word >> 24u) & 15u] * s,
                    );
                    hi[j] = vec4<f32>(
                        lut[(word >> 4u) & 15u] * s,
                        lut[(word >> 12u) & 15u] * s,
                        lut[(word >> 20u) & 15u] * s,
                        lut[word >> 28u] * s,
                    );
                }
                for (var q = 0u; q < MM_XR; q = q + 1u) {
                    let xlo = xt4[q * (RTILE / 4u) + jb * 8u + g];
                    let xhi = xt4[q * (RTILE / 4u) + jb * 8u + 4u + g];
                    for (var j = 0u; j < MM_ROWS; j = j + 1u) {
                        let a = j * MM_XR + q;
                        acc[a] = fma(hi[j], xhi, fma(lo[j], xlo, acc[a]));
                    }
                }
            }
        } else {
            for (var jc = 0u; jc < end / 16u; jc = jc + 1u) {
                let c = t0 / 16u + jc;
                var wv: array<vec4<f32>, 2>;
                for (var j = 0u; j < MM_ROWS; j = j + 1u) {
                    let o = wb[j] + c * 8u;
                    wv[j] = bf16x4(w[o], w[o + 1u]);
                }
                for (var q = 0u; q < MM_XR; q = q + 1u) {
                    let xv = xt4[q * (RTILE / 4u) + jc * 4u + g];
                    for (var j = 0u; j < MM_ROWS; j = j + 1u) {
                        let a = j * MM_XR + q;
                        acc[a] = fma(wv[j], xv, acc[a]);
                    }
                }
            }
        }
        workgroupBarrier();
    }
    for (var q = 0u; q < MM_XR; q = q + 1u) {
        for (var j = 0u; j < MM_ROWS; j = j + 1u) {
            xt4[j * 256u + lid.x] = acc[j * MM_XR + q];
        }
        workgroupBarrier();
        if (g == 0u && i0 + q < p.n) {
            for (var j = 0u; j < MM_ROWS; j = j + 1u) {
                let r = base + 64u * j + slot;
                if (r < p.rows) {
                    // xt4[j 256 + 4 slot + m] holds lanes 4m..4m+3: the tree (l, l+8), (l, l+4), ...
                    let o = j * 256u + slot * 4u;
                    let v8a = xt4[o] + xt4[o + 2u];
                    let v8b = xt4[o + 1u] + xt4[o + 3u];
                    let v4 = v8a + v8b;
                    out[p.out_off + (i0 + q) * p.out_rows + p.row0 + r] = (v4.x + v4.z) + (v4.y + v4.w);
                }
            }
        }
        workgroupBarrier();
    }
}

// fma(a[i], b[i], c[i]) for the fused-multiply-add probe.
@compute @workgroup_size(1)
fn fma_probe(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x * 3u;
    out[gid.x] = fma(x[i], x[i + 1u], x[i + 2u]);
}

// The adapter's f32 fused-multiply-add rate, what `bench kernels` divides the matmul's by: each
// thread runs 8 independent vec4 chains a = fma(a, m, c) (32 FMAs per step, no loads), with m and
// c from x[0..8] so that nothing folds, and writes one sum.
const PEAK_STEPS: u32 = 1024u;
@compute @workgroup_size(256)
fn fma_peak(@builtin(global_invocation_id) gid: vec3<u32>) {
    let m = vec4<f32>(x[0], x[1], x[2], x[3]);
    let c = vec4<f32>(x[4], x[5], x[6], x[7]);
    var a0 = vec4<f32>(f32(gid.x & 1023u) * 0.0009765625);
    var a1 = a0 + c;
    var a2 = a1 + c;
    var a3 = a2 + c;
    var a4 = a3 + c;
    var a5 = a4 + c;
    var a6 = a5 + c;
    var a7 = a6 + c;
    for (var i = 0u; i < PEAK_STEPS; i = i + 1u) {
        a0 = fma(a0, m, c);
        a1 = fma(a1, m, c);
        a2 = fma(a2, m, c);
        a3 = fma(a3, m, c);
        a4 = fma(a4, m, c);
        a5 = fma(a5, m, c);
        a6 = fma(a6, m, c);
        a7 = fma(a7, m, c);
    }
    out[gid.x] = dot((a0 + a1) + (a2 + a3) + ((a4 + a5) + (a6 + a7)), vec4<f32>(1.0));
}
