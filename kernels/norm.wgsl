// Row operations for the GPU backend in the CPU kernels' exact operation order (with
// detmath.wgsl prepended): RMSNorm of rows (`cpu::ops::rms_norm_inplace`), SiTU
// (`cpu::ops::Situ::apply`), and the AttnRes mix of one row (`k3::attn_res::mix`). Dots follow
// `cpu::dot_f32`: lane l of 16 accumulates elements l, l + 16, ... by fma (the tail padded with
// fma(0, 0, acc)), then the tree (l, l+8), (l, l+4), (l, l+2), (l, l+1).

// P, a, b, wq, out, p, pu, pf and reduce16: ops_common.wgsl (prepended).
@group(0) @binding(4) var<storage, read_write> out2: array<u32>;

var<workgroup> lanes: array<f32, 256>;

// The tree over lanes[base .. base + 16].
fn reduce16_at(base: u32) -> f32 {
    var acc: array<f32, 16>;
    for (var t = 0u; t < 16u; t = t + 1u) {
        acc[t] = lanes[base + t];
    }
    return reduce16(acc);
}

var<workgroup> factor: array<f32, 16>;

// rms_norm_rows: params (cols, rows, eps). 16 rows per workgroup of 16 lanes each; out = the rows
// normalised: w * (x * inv), inv = rsqrt(div(x . x, cols) + eps). `a` = x, `b` = w.
@compute @workgroup_size(256)
fn rms_norm_rows(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wg: vec3<u32>) {
    let cols = pu(0u);
    let rows = pu(1u);
    let eps = pf(2u);
    let lane = lid.x & 15u;
    let slot = lid.x >> 4u;
    let r = (wg.y * 65535u + wg.x) * 16u + slot;
    let live = r < rows;
    var acc = 0.0;
    let chunks = (cols + 15u) / 16u;
    for (var c = 0u; c < chunks; c = c + 1u) {
        let k = c * 16u + lane;
        var v = 0.0;
        if (live && k < cols) {
            v = a[r * cols + k];
        }
        acc = fma(v, v, acc);
    }
    lanes[lid.x] = acc;
    workgroupBarrier();
    if (lane == 0u) {
        factor[slot] = dm_rsqrt(dm_div(reduce16_at(slot * 16u), f32(cols)) + eps);
    }
    workgroupBarrier();
    if (live) {
        let inv = factor[slot];
        for (var k = lane; k < cols; k = k + 16u) {
            out[r * cols + k] = b[k] * (a[r * cols + k] * inv);
        }
    }
}

// situ: params (n, beta, linear_beta); out[i] = situ(a[i], b[i]).
fn situ_of(i: u32) -> f32 {
    let beta = pf(1u);
    let lb = pf(2u);
    let g = a[i];
    // Word 3: where the up values start in `b` (the batched experts keep gate and up in one buffer).
    let u = b[i + pu(3u)];
    let x = beta * dm_tanh(dm_div(g, beta)) * dm_sigmoid(g);
    var y = u;
    if (lb > 0.0) {
        y = lb * dm_tanh(dm_div(u, lb));
    }
    return x * y;
}

@compute @workgroup_size(256)
fn situ(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = gid.y * nw.x * 256u + gid.x;
    if (i >= pu(0u)) {
        return;
    }
    out[i] = situ_of(i);
}

// situ_deinterleave: the same values written in the MXFP4 input order of the next product
// (`cpu::deinterleave_mxfp4_input`): in each block of 32, element 2j goes to j and 2j+1 to 16+j
// (n is a multiple of 32), so the expert's w2 reads them without a trip to the CPU.
@compute @workgroup_size(256)
fn situ_deinterleave(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = gid.y * nw.x * 256u + gid.x;
    if (i >= pu(0u)) {
        return;
    }
    let j = i & 31u;
    out[(i - j) + (j >> 1u) + 16u * (j & 1u)] = situ_of(i);
}

// attn_res_mix: params (h, sources, eps); `a` = the sources [sources, h] in order, `b` = score_w.
// One workgroup: 16 lanes per source (at most 16 sources) form v . w and v . v; one thread the
// softmax (`cpu::ops::softmax_of_products`); then every thread sums its elements in source order.
var<workgroup> lanes2: array<f32, 256>;
var<workgroup> probs: array<f32, 16>;

@compute @workgroup_size(256)
fn attn_res_mix(@builtin(local_invocation_id) lid: vec3<u32>) {
    let h = pu(0u);
    let ns = pu(1u);
    let eps = pf(2u);
    let lane = lid.x & 15u;
    let s = lid.x >> 4u;
    var dw = 0.0;
    var dv = 0.0;
    let chunks = (h + 15u) / 16u;
    for (var c = 0u; c < chunks; c = c + 1u) {
        let k = c * 16u + lane;
        var v = 0.0;
        var w = 0.0;
        if (s < ns && k < h) {
            v = a[s * h + k];
            w = b[k];
        }
        dw = fma(v, w, dw);
        dv = fma(v, v, dv);
    }
    lanes[lid.x] = dw;
    lanes2[lid.x] = dv;
    workgroupBarrier();
    if (lane == 0u && s < ns) {
        let score = reduce16_at(s * 16u);
        // The same tree over the v . v lanes.
        var v8: array<f32, 8>;
        for (var t = 0u; t < 8u; t = t + 1u) {
            v8[t] = lanes2[s * 16u + t] + lanes2[s * 16u + t + 8u];
        }
        var v4: array<f32, 4>;
        for (var t = 0u; t < 4u; t = t + 1u) {
            v4[t] = v8[t] + v8[t + 4u];
        }
        let vv = (v4[0] + v4[2]) + (v4[1] + v4[3]);
        probs[s] = score;
        factor[s] = dm_rsqrt(dm_div(vv, f32(h)) + eps);
    }
    workgroupBarrier();
    if (lid.x == 0u) {
        var m = bitcast<f32>(0xff800000u);
        for (var t = 0u; t < ns; t = t + 1u) {
            let v = probs[t] * factor[t];
            if (v > m) {
                m = v;
            }
        }
        var sum = 0.0;
        for (var t = 0u; t < ns; t = t + 1u) {
            let e = dm_exp(fma(probs[t], factor[t], -m));
            probs[t] = e;
            sum = sum + e;
        }
        let inv = dm_div(1.0, sum);
        for (var t = 0u; t < ns; t = t + 1u) {
            probs[t] = probs[t] * inv;
        }
    }
    workgroupBarrier();
    for (var k = lid.x; k < h; k = k + 256u) {
        var o = probs[0] * a[k];
        for (var t = 1u; t < ns; t = t + 1u) {
            o = fma(probs[t], a[t * h + k], o);
        }
        out[k] = o;
    }
}
