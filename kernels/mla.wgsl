// The MLA attention core for the GPU backend (with detmath.wgsl prepended), in the order of
// `cpu::mla::attention_with`: one workgroup per (row t, head); q_abs = sum_i q_nope_i W_k[i] by
// fma (thread per latent channel); score_s = dot(q_abs, c_s) + dot(q_pe, pe_s) in the 16-lane
// order (thread per cached token); the softmax of score * scale by one thread in token order
// (`cpu::ops::softmax_of_products`); mixed = sum_s p_s c_s by fma in token order; out_j =
// dot(W_v[j], mixed) in the 16-lane order. kv_b is bf16, two per u32 word.

// a = q [n, heads, nope + rope]; b = cache [all, lora + rope]; wq = kv_b.
// P, a, b, wq, out, p, pu, pf and reduce16: ops_common.wgsl (prepended).
@group(0) @binding(4) var<storage, read_write> out2: array<f32>;

fn bf16_at(idx: u32) -> f32 {
    let word = wq[idx >> 1u];
    let bits = select(word & 0xffffu, word >> 16u, (idx & 1u) == 1u);
    return bitcast<f32>(bits << 16u);
}

const MAX_LORA: u32 = 1024u;
var<workgroup> qa: array<f32, 1024>;
var<workgroup> mixed: array<f32, 1024>;
var<workgroup> qpe: array<f32, 256>;

// params (heads, nope, rope, lora, v_head, past, all, causal, scale bits, n, max_len, kv_b's row
// stride: lora rounded up to 16, as resident bf16 rows are stored).
// out = [n, heads, v_head]; out2 = scratch scores [n * heads, max_len].
@compute @workgroup_size(256)
fn mla_attention(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wg: vec3<u32>) {
    let nh = pu(0u);
    let nope = pu(1u);
    let rope = pu(2u);
    let lora = pu(3u);
    let vd = pu(4u);
    let past = pu(5u);
    let all = pu(6u);
    let causal = pu(7u) != 0u;
    let scale = bitcast<f32>(pu(8u));
    let max_len = pu(10u);
    let stride = pu(11u);
    let idx = wg.y * 65535u + wg.x;
    if (idx >= pu(9u) * nh) {
        return;
    }
    let t = idx / nh;
    let hd = idx % nh;
    let qd = nope + rope;
    let lat = lora + rope;
    let qb = (t * nh + hd) * qd;
    let wrow0 = hd * (nope + vd);
    for (var l = lid.x; l < lora; l = l + 256u) {
        var acc = 0.0;
        for (var i = 0u; i < nope; i = i + 1u) {
            acc = fma(a[qb + i], bf16_at((wrow0 + i) * stride + l), acc);
        }
        qa[l] = acc;
    }
    for (var l = lid.x; l < rope; l = l + 256u) {
        qpe[l] = a[qb + nope + l];
    }
    workgroupBarrier();
    var len = all;
    if (causal) {
        len = past + t + 1u;
    }
    let pb = idx * max_len;
    for (var s = lid.x; s < len; s = s + 256u) {
        let cb = s * lat;
        var acc: array<f32, 16>;
        for (var c = 0u; c < (lora + 15u) / 16u; c = c + 1u) {
            for (var l = 0u; l < 16u; l = l + 1u) {
                let i = c * 16u + l;
                var x = 0.0;
                var y = 0.0;
                if (i < lora) {
                    x = qa[i];
                    y = b[cb + i];
                }
                acc[l] = fma(x, y, acc[l]);
            }
        }
        let d1 = reduce16(acc);
        var acc2: array<f32, 16>;
        for (var c = 0u; c < (rope + 15u) / 16u; c = c + 1u) {
            for (var l = 0u; l < 16u; l = l + 1u) {
                let i = c * 16u + l;
                var x = 0.0;
                var y = 0.0;
                if (i < rope) {
                    x = qpe[i];
                    y = b[cb + lora + i];
                }
                acc2[l] = fma(x, y, acc2[l]);
            }
        }
        out2[pb + s] = d1 + reduce16(acc2);
    }
    workgroupBarrier();
    if (lid.x == 0u) {
        var m = bitcast<f32>(0xff800000u);
        for (var s = 0u; s < len; s = s + 1u) {
            let v = out2[pb + s] * scale;
            if (v > m) {
                m = v;
            }
        }
        var sum = 0.0;
        for (var s = 0u; s < len; s = s + 1u) {
            let e = dm_exp(fma(out2[pb + s], scale, -m));
            out2[pb + s] = e;
            sum = sum + e;
        }
        let inv = dm_div(1.0, sum);
        for (var s = 0u; s < len; s = s + 1u) {
            out2[pb + s] = out2[pb + s] * inv;
        }
    }
    workgroupBarrier();
    for (var l = lid.x; l < lora; l = l + 256u) {
        var acc = 0.0;
        for (var s = 0u; s < len; s = s + 1u) {
            acc = fma(out2[pb + s], b[s * lat + l], acc);
        }
        mixed[l] = acc;
    }
    workgroupBarrier();
    for (var j = lid.x; j < vd; j = j + 256u) {
        let wb = (wrow0 + nope + j) * stride;
        var acc: array<f32, 16>;
        for (var c = 0u; c < (lora + 15u) / 16u; c = c + 1u) {
            for (var l = 0u; l < 16u; l = l + 1u) {
                let i = c * 16u + l;
                var x = 0.0;
                var y = 0.0;
                if (i < lora) {
                    x = bf16_at(wb + i);
                    y = mixed[i];
                }
                acc[l] = fma(x, y, acc[l]);
            }
        }
        out[(t * nh + hd) * vd + j] = reduce16(acc);
    }
}
