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

// Params, w, scales, out, p, lut, e2m1 and e8m0: products.wgsl (prepended).
@group(0) @binding(2) var<storage, read> x: array<f32>;

// A workgroup: 16 weight rows x 16 lanes, for XR input rows at once (each weight decoded once,
// used XR times); the input rows are staged in workgroup memory TILE elements at a time.
const ROWS_PER_GROUP: u32 = 16u;
const XR: u32 = 4u;
const TILE: u32 = 512u;
var<workgroup> lanes: array<f32, 1024>;
var<workgroup> xt: array<f32, 2048>;

fn byte_at(idx: u32) -> u32 {
    let i = p.w_off * 4u + idx;
    return (w[i >> 2u] >> ((i & 3u) * 8u)) & 0xffu;
}

// MXFP4 element k of row r: its E2M1 code and its block's E8M0 scale byte.
fn mx_code_scale(r: u32, k: u32) -> vec2<u32> {
    let b = k >> 5u;
    let j = k & 31u;
    let byte = byte_at(r * (p.cols >> 1u) + b * 16u + (j & 15u));
    let si = p.s_off * 4u + r * (p.cols >> 5u) + b;
    return vec2<u32>(select(byte & 15u, byte >> 4u, j >= 16u), (scales[si >> 2u] >> ((si & 3u) * 8u)) & 0xffu);
}

fn weight(r: u32, k: u32) -> f32 {
    if (p.kind == 0u) {
        let idx = r * p.stride + k;
        let word = w[p.w_off + (idx >> 1u)];
        let bits = select(word & 0xffffu, word >> 16u, (idx & 1u) == 1u);
        return bitcast<f32>(bits << 16u);
    }
    let cs = mx_code_scale(r, k);
    return e2m1(cs.x) * e8m0(cs.y);
}

// `weight` with the E2M1 value from the workgroup table (same value, same product).
fn weight_lut(r: u32, k: u32) -> f32 {
    if (p.kind == 0u) {
        return weight(r, k);
    }
    let cs = mx_code_scale(r, k);
    return lut[cs.x] * e8m0(cs.y);
}

@compute @workgroup_size(256)
fn matmul(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wg: vec3<u32>) {
    if (lid.x < 16u) {
        lut[lid.x] = e2m1(lid.x);
    }
    let lane = lid.x & 15u;
    let slot = lid.x >> 4u;
    let r = wg.x * ROWS_PER_GROUP + slot;
    let i0 = wg.y * XR;
    let live = r < p.rows;
    var acc = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
    // Lane order as on the CPU: elements lane, lane + 16, ... up to the columns rounded up to 16
    // (the padding contributes fma(0, 0, acc)).
    let padded = ((p.cols + 15u) / 16u) * 16u;
    for (var t0 = 0u; t0 < padded; t0 = t0 + TILE) {
        for (var j = lid.x; j < XR * TILE; j = j + 256u) {
            let q = j / TILE;
            let k = t0 + (j % TILE);
            var v = 0.0;
            if (k < p.cols && i0 + q < p.n) {
                v = x[p.x_off + (i0 + q) * p.cols + k];
            }
            xt[j] = v;
        }
        workgroupBarrier();
        let end = min(TILE, padded - t0);
        for (var c = lane; c < end; c = c + 16u) {
            let k = t0 + c;
            var wv = 0.0;
            if (live && k < p.cols) {
                wv = weight_lut(r, k);
            }
            for (var q = 0u; q < XR; q = q + 1u) {
                acc[q] = fma(wv, xt[q * TILE + c], acc[q]);
            }
        }
        workgroupBarrier();
    }
    for (var q = 0u; q < XR; q = q + 1u) {
        lanes[q * 256u + lid.x] = acc[q];
    }
    workgroupBarrier();
    // The fixed tree per (input row, weight row): lanes (l, l+8), (l, l+4), (l, l+2), (l, l+1).
    if (lane < XR && live && i0 + lane < p.n) {
        let q = lane;
        let b = q * 256u + slot * 16u;
        var v8: array<f32, 8>;
        for (var t = 0u; t < 8u; t = t + 1u) {
            v8[t] = lanes[b + t] + lanes[b + t + 8u];
        }
        var v4: array<f32, 4>;
        for (var t = 0u; t < 4u; t = t + 1u) {
            v4[t] = v8[t] + v8[t + 4u];
        }
        let v2a = v4[0] + v4[2];
        let v2b = v4[1] + v4[3];
        out[p.out_off + (i0 + q) * p.out_rows + p.row0 + r] = v2a + v2b;
    }
}

// The first matvec (one input row): 4 weight rows x 16 lanes per workgroup, a thread per (row,
// lane) reading single bytes. Kept for comparison (`DELTAFIN_GPU_MATVEC=legacy`, `bench kernels`)
// until the H200 shows matvec.wgsl faster everywhere.
var<workgroup> vlanes: array<f32, 64>;

@compute @workgroup_size(64)
fn matvec_legacy(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wg: vec3<u32>) {
    let lane = lid.x & 15u;
    let slot = lid.x >> 4u;
    let r = wg.x * 4u + slot;
    let live = r < p.rows;
    var acc = 0.0;
    let chunks = (p.cols + 15u) / 16u;
    for (var c = 0u; c < chunks; c = c + 1u) {
        let k = c * 16u + lane;
        var wv = 0.0;
        var xv = 0.0;
        if (live && k < p.cols) {
            wv = weight(r, k);
            xv = x[p.x_off + k];
        }
        acc = fma(wv, xv, acc);
    }
    vlanes[lid.x] = acc;
    workgroupBarrier();
    if (lane == 0u && live) {
        let b = slot * 16u;
        var v8: array<f32, 8>;
        for (var t = 0u; t < 8u; t = t + 1u) {
            v8[t] = vlanes[b + t] + vlanes[b + t + 8u];
        }
        var v4: array<f32, 4>;
        for (var t = 0u; t < 4u; t = t + 1u) {
            v4[t] = v8[t] + v8[t + 4u];
        }
        out[p.out_off + p.row0 + r] = (v4[0] + v4[2]) + (v4[1] + v4[3]);
    }
}

// fma(a[i], b[i], c[i]) for the fused-multiply-add probe.
@compute @workgroup_size(1)
fn fma_probe(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x * 3u;
    out[gid.x] = fma(x[i], x[i + 1u], x[i + 2u]);
}
