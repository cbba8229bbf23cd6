// The KDA token recurrence for the GPU backend (with detmath.wgsl prepended), thread by thread the
// CPU's `cpu::kda::recurrent_head`: thread (head h, column j) owns column j of that head's state
// S [dk][dv] and runs, per token t: s_ij = s_ij * exp(g_ti); u = fma(k_ti, s_ij, u) over i;
// u = beta_t (v_tj - u); then s_ij = fma(k_ti, u, s_ij) and o = fma(q_ti, s_ij, o) over i.
// The start state comes from `b`; the state after the last token goes to `out`.

// a = [q | k | g], each [heads, n, dk]; wq = [v [heads, n, dv] | beta [heads, n]] as f32 bits.
// P, a, b, wq, out, p, pu and pf: ops_common.wgsl (prepended).
@group(0) @binding(4) var<storage, read_write> out2: array<f32>;

// Column j of the state, while the tokens run: in workgroup memory, not in `out` (a load right
// after a store to the same global address waits for it; here each step is a shared access).
// Element i of the thread's column is at i * 32 + its local index (every access conflict-free).
// dk is at most `Limits::KDA_DK` = 128 (larger calls stay on the CPU). 32 columns per workgroup
// keep the workgroup's memory at 17.5 KiB (Metal and many Vulkan GPUs allow 32 KiB).
const KDA_DK: u32 = 128u;
const COLS: u32 = 32u;
var<workgroup> col: array<f32, 4096>;
// Token t's row, shared by the workgroup's 32 columns: exp(g_ti) (each element computed once, by
// one thread, instead of by every column), k_ti and q_ti.
var<workgroup> decay: array<f32, 128>;
var<workgroup> krow: array<f32, 128>;
var<workgroup> qrow: array<f32, 128>;

// params (heads, n, dk, dv, with_output). out = the state after the last row [heads, dk, dv];
// out2 = o [heads, n, dv] when with_output. One workgroup: 32 columns of one head (y).
@compute @workgroup_size(32)
fn kda_recurrent(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let heads = pu(0u);
    let n = pu(1u);
    let dk = min(pu(2u), KDA_DK);
    let dv = pu(3u);
    let with_o = pu(4u) != 0u;
    let c = lid.x;
    let j = wg.x * COLS + c;
    let h = wg.y;
    // The dispatch covers heads exactly; columns past dv idle but join the barriers.
    let live = j < dv && h < heads;
    // a holds [q (only with outputs), k, g] planes of [heads, n, dk].
    let plane = heads * n * dk;
    let planes_before_k = select(0u, 1u, with_o);
    let qb = h * n * dk;
    let kb = planes_before_k * plane + h * n * dk;
    let gb = (planes_before_k + 1u) * plane + h * n * dk;
    let vb = h * n * dv;
    let betab = heads * n * dv + h * n;
    let sb = h * dk * dv;
    if (live) {
        for (var i = 0u; i < dk; i = i + 1u) {
            col[i * COLS + c] = b[sb + i * dv + j];
        }
    }
    for (var t = 0u; t < n; t = t + 1u) {
        // The previous token's readers are done with the row before it is replaced.
        workgroupBarrier();
        if (h < heads) {
            for (var i = c; i < dk; i = i + COLS) {
                decay[i] = dm_exp(a[gb + t * dk + i]);
                krow[i] = a[kb + t * dk + i];
                if (with_o) {
                    qrow[i] = a[qb + t * dk + i];
                }
            }
        }
        workgroupBarrier();
        if (live) {
            var u = 0.0;
            for (var i = 0u; i < dk; i = i + 1u) {
                let s = col[i * COLS + c] * decay[i];
                col[i * COLS + c] = s;
                u = fma(krow[i], s, u);
            }
            let beta = bitcast<f32>(wq[betab + t]);
            u = beta * (bitcast<f32>(wq[vb + t * dv + j]) - u);
            var o = 0.0;
            for (var i = 0u; i < dk; i = i + 1u) {
                let s = fma(krow[i], u, col[i * COLS + c]);
                col[i * COLS + c] = s;
                if (with_o) {
                    o = fma(qrow[i], s, o);
                }
            }
            if (with_o) {
                out2[(h * n + t) * dv + j] = o;
            }
        }
    }
    if (live) {
        for (var i = 0u; i < dk; i = i + 1u) {
            out[sb + i * dv + j] = col[i * COLS + c];
        }
    }
}
