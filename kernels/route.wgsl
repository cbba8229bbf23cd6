// Routing and the greedy pick for the GPU backend (with detmath.wgsl prepended), choosing exactly
// as the CPU does: `k3::moe::route_rows` (top-k of sigmoid(logit) + bias, descending, lower id
// first on ties, NaN last; weights s / (sum + 1e-20) * scaling, summed in router order) and
// `k3::argmax` (the first index of the largest value; NaN never wins). A selection is a total
// order, so any reduction tree picks the same element as the CPU's sequential code.

// P, a, b, wq, out, p, pu and pf: ops_common.wgsl (prepended).
@group(0) @binding(4) var<storage, read_write> out2: array<u32>;

// Whether expert i sorts before expert j by biased score x (value) / y.
fn before(x: f32, i: u32, y: f32, j: u32) -> bool {
    let nx = dm_is_nan(x);
    let ny = dm_is_nan(y);
    if (!nx && !ny) {
        return x > y || (x == y && i < j);
    }
    if (nx != ny) {
        return !nx;
    }
    return i < j;
}

const MAX_E: u32 = 1024u;
var<workgroup> sc: array<f32, 1024>;
var<workgroup> ch: array<f32, 1024>;
var<workgroup> sel: array<u32, 64>;

// route_top_k: params (e, k, renormalize, scaling); one workgroup per row of logits `a` [n, e];
// `b` = bias. Writes out2 = experts [n, k], out = weights [n, k].
@compute @workgroup_size(256)
fn route_top_k(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wg: vec3<u32>) {
    let e = pu(0u);
    let k = pu(1u);
    let row = wg.y * 65535u + wg.x;
    for (var j = lid.x; j < e; j = j + 256u) {
        let s = dm_sigmoid(a[row * e + j]);
        sc[j] = s;
        ch[j] = s + b[j];
    }
    workgroupBarrier();
    for (var j = lid.x; j < e; j = j + 256u) {
        var rank = 0u;
        let cj = ch[j];
        for (var i = 0u; i < e; i = i + 1u) {
            if (before(ch[i], i, cj, j)) {
                rank = rank + 1u;
            }
        }
        if (rank < k) {
            sel[rank] = j;
        }
    }
    workgroupBarrier();
    if (lid.x == 0u) {
        var sum = 0.0;
        for (var t = 0u; t < k; t = t + 1u) {
            sum = sum + sc[sel[t]];
        }
        var denom = 1.0;
        if (pu(2u) != 0u) {
            denom = sum + bitcast<f32>(0x1e3ce508u);
        }
        for (var t = 0u; t < k; t = t + 1u) {
            out2[row * k + t] = sel[t];
            out[row * k + t] = dm_div(sc[sel[t]], denom) * pf(3u);
        }
    }
}

var<workgroup> bv: array<f32, 256>;
var<workgroup> bi: array<u32, 256>;

// Whether candidate (x, i) beats (y, j): larger value, lower index on ties, NaN never wins.
fn better(x: f32, i: u32, y: f32, j: u32) -> bool {
    let nx = dm_is_nan(x);
    let ny = dm_is_nan(y);
    if (nx || ny) {
        if (nx && ny) {
            return i < j;
        }
        return ny;
    }
    return x > y || (x == y && i < j);
}

// argmax: params (n); one workgroup over `a`; writes out2[0].
@compute @workgroup_size(256)
fn argmax(@builtin(local_invocation_id) lid: vec3<u32>) {
    let n = pu(0u);
    var best = min(lid.x, n - 1u);
    var v = a[best];
    for (var i = lid.x; i < n; i = i + 256u) {
        let x = a[i];
        if (better(x, i, v, best)) {
            best = i;
            v = x;
        }
    }
    bv[lid.x] = v;
    bi[lid.x] = best;
    workgroupBarrier();
    for (var w = 128u; w > 0u; w = w >> 1u) {
        if (lid.x < w) {
            let o = lid.x + w;
            if (better(bv[o], bi[o], bv[lid.x], bi[lid.x])) {
                bv[lid.x] = bv[o];
                bi[lid.x] = bi[o];
            }
        }
        workgroupBarrier();
    }
    if (lid.x == 0u) {
        out2[0] = bi[0];
    }
}
