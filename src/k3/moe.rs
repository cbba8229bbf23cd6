//! Routed "latent" mixture of experts with shared experts, and the dense SiTU MLP.
//!
//! Router: s = sigmoid(x W_gate^T); the top-k of (s + correction bias) are selected (ties: lower
//! expert id first) — this selection order is the *router order*; weights are the unbiased s of the
//! selected experts, renormalised (sum + 1e-20) and scaled. Routed path: z = down_proj(x); each
//! expert computes w2(situ(w1 z, w3 z)) from its raw MXFP4 bytes; outputs are summed per row in
//! router order (never arrival order); then up_proj(RMSNorm(sum)). Shared experts see x itself.
//!
//! Batch schedule: the union of all rows' experts is fetched once for the layer and each expert
//! runs on all of its rows as soon as it lands.

use super::weights::{MlpWeights, MoeWeights};
use crate::cpu::ops::{Situ, rms_norm_inplace, sigmoid};
use crate::cpu::{Mxfp4Mat, deinterleave_mxfp4_input, matmul_bf16, matmul_mxfp4};
use crate::model::K3Config;
use crate::model::roster::ExpertLayout;
use crate::stats::Stats;
use crate::store::{ExpertSource, StoreError};
use std::time::Instant;

/// Dense SiTU-GLU MLP on rows `xn` [n, hidden].
pub fn mlp(w: &MlpWeights, situ: Situ, xn: &[f32]) -> Vec<f32> {
    let (inter, h) = (w.gate.rows, w.down.rows);
    let n = xn.len() / w.gate.cols;
    let mut g = vec![0f32; n * inter];
    let mut u = vec![0f32; n * inter];
    matmul_bf16(&w.gate, xn, &mut g);
    matmul_bf16(&w.up, xn, &mut u);
    let mut a = vec![0f32; n * inter];
    situ.apply_rows(&g, &u, &mut a);
    let mut out = vec![0f32; n * h];
    matmul_bf16(&w.down, &a, &mut out);
    out
}

/// Each row's selected experts and weights, in router order: [n, k].
pub struct Routes {
    pub k: usize,
    pub experts: Vec<u32>,
    pub weights: Vec<f32>,
}

impl Routes {
    /// Distinct experts over all rows, ascending.
    pub fn union(&self) -> Vec<u32> {
        let mut u = self.experts.clone();
        u.sort_unstable();
        u.dedup();
        u
    }
}

/// Routes every row of `xn`.
pub fn route(c: &K3Config, w: &MoeWeights, xn: &[f32]) -> Routes {
    let n = xn.len() / c.hidden;
    let e = c.experts;
    let k = c.top_k;
    let mut logits = vec![0f32; n * e];
    matmul_bf16(&w.router, xn, &mut logits);
    let mut experts = Vec::with_capacity(n * k);
    let mut weights = Vec::with_capacity(n * k);
    let mut order: Vec<u32> = Vec::with_capacity(e);
    for row in logits.chunks_exact(e) {
        let s: Vec<f32> = row.iter().map(|&x| sigmoid(x)).collect();
        let choice: Vec<f32> = s.iter().zip(&w.bias).map(|(a, b)| a + b).collect();
        order.clear();
        order.extend(0..e as u32);
        // Descending biased score, lower id first on ties; NaN sorts last.
        order.sort_by(|&a, &b| {
            let (x, y) = (choice[a as usize], choice[b as usize]);
            y.partial_cmp(&x).unwrap_or_else(|| x.is_nan().cmp(&y.is_nan())).then(a.cmp(&b))
        });
        let sel = &order[..k];
        let mut sum = 0f32;
        for &i in sel {
            sum += s[i as usize];
        }
        let denom = if c.renormalize { sum + 1e-20 } else { 1.0 };
        for &i in sel {
            experts.push(i);
            weights.push(s[i as usize] / denom * c.routed_scaling);
        }
    }
    Routes { k, experts, weights }
}

/// The three MXFP4 matrices of one expert, borrowed from its raw bytes.
fn expert_mats<'b>(l: &ExpertLayout, bytes: &'b [u8]) -> [Mxfp4Mat<'b>; 3] {
    let part = |i: usize| {
        let (o, n) = l.parts[i];
        &bytes[o..o + n]
    };
    [
        Mxfp4Mat::new(part(0), part(1), l.inter, l.latent),
        Mxfp4Mat::new(part(2), part(3), l.inter, l.latent),
        Mxfp4Mat::new(part(4), part(5), l.latent, l.inter),
    ]
}

/// One expert on `m` deinterleaved latent rows `zd` [m, latent]; returns [m, latent].
pub fn run_expert(layout: &ExpertLayout, bytes: &[u8], situ: Situ, zd: &[f32]) -> Vec<f32> {
    let [w1, w3, w2] = expert_mats(layout, bytes);
    let m = zd.len() / layout.latent;
    let mut g = vec![0f32; m * layout.inter];
    let mut u = vec![0f32; m * layout.inter];
    matmul_mxfp4(&w1, zd, &mut g);
    matmul_mxfp4(&w3, zd, &mut u);
    let mut a = vec![0f32; m * layout.inter];
    situ.apply_rows(&g, &u, &mut a);
    let mut ad = vec![0f32; m * layout.inter];
    for (src, dst) in a.chunks_exact(layout.inter).zip(ad.chunks_exact_mut(layout.inter)) {
        deinterleave_mxfp4_input(src, dst);
    }
    let mut out = vec![0f32; m * layout.latent];
    matmul_mxfp4(&w2, &ad, &mut out);
    out
}

/// Runs one MoE layer on rows `xn` [n, hidden]; returns [n, hidden].
/// Lookahead prefetch around one MoE layer: the experts predicted for this layer earlier (to score
/// and cancel), and the next MoE layer's router (to predict and prefetch its experts).
#[derive(Default)]
pub struct Lookahead<'a, 'w> {
    pub predicted_here: Option<&'a [u32]>,
    pub next: Option<(usize, &'a MoeWeights<'w>)>,
}

/// Runs one MoE layer on rows `xn` [n, hidden]; returns [n, hidden] and the experts predicted for
/// the next MoE layer (when `look.next` is given).
pub fn forward(
    c: &K3Config,
    w: &MoeWeights,
    layer: usize,
    src: &dyn ExpertSource,
    xn: &[f32],
    stats: &mut Stats,
    look: Lookahead,
) -> Result<(Vec<f32>, Option<Vec<u32>>), StoreError> {
    let t_start = Instant::now();
    let h = c.hidden;
    let n = xn.len() / h;
    let lat = c.expert_latent;
    let situ = Situ { beta: c.situ_beta, linear_beta: c.situ_linear_beta };
    let routes = route(c, w, xn);
    let k = routes.k;
    stats.record_routes(layer, &routes.experts, c.experts);
    let union = routes.union();
    if let Some(pred) = look.predicted_here {
        // Score the prediction and drop queued prefetches the real route does not need.
        let hit = pred.iter().filter(|e| union.binary_search(e).is_ok()).count();
        stats.record_prediction(layer, pred.len(), union.len(), hit);
        src.cancel_prefetch(layer, &union);
    }
    // The next MoE layer's router applied to this layer's input predicts its experts.
    let predicted_next = look.next.map(|(nl, nw)| (nl, route(c, nw, xn).union()));
    let t_routed = Instant::now();
    stats.router_s += (t_routed - t_start).as_secs_f64();

    let mut z = vec![0f32; n * lat];
    matmul_bf16(&w.down_proj, xn, &mut z);
    let mut zd = vec![0f32; n * lat];
    for (src_row, dst) in z.chunks_exact(lat).zip(zd.chunks_exact_mut(lat)) {
        deinterleave_mxfp4_input(src_row, dst);
    }

    // Expert outputs land in slots [row][k] so the sum can follow router order.
    let mut slots = vec![0f32; n * k * lat];
    let layout = src.layout().clone();
    let mut prefetch_pending = predicted_next.as_ref();
    // (row, router slot) pairs of each expert of the union, built once for the layer.
    let mut targets_of: Vec<Vec<(usize, usize)>> = vec![Vec::new(); union.len()];
    for (i, e) in routes.experts.iter().enumerate() {
        if let Ok(u) = union.binary_search(e) {
            targets_of[u].push((i / k, i % k));
        }
    }
    let mut kernel_s = 0f64;
    let mut expert_rows = 0usize;
    let t_fetch = Instant::now();
    src.fetch(layer, &union, &mut |e, bytes| {
        // Every demanded read of this layer is queued by now; predictions fill idle capacity.
        if let Some((nl, pred)) = prefetch_pending.take() {
            src.prefetch(*nl, pred);
        }
        let t = Instant::now();
        let targets: &[(usize, usize)] = union.binary_search(&e).map_or(&[], |u| &targets_of[u]);
        let mut rows_in = Vec::with_capacity(targets.len() * lat);
        for &(r, _) in targets {
            rows_in.extend_from_slice(&zd[r * lat..(r + 1) * lat]);
        }
        let y = run_expert(&layout, bytes, situ, &rows_in);
        for (i, &(r, j)) in targets.iter().enumerate() {
            slots[(r * k + j) * lat..][..lat].copy_from_slice(&y[i * lat..(i + 1) * lat]);
        }
        expert_rows += targets.len();
        kernel_s += t.elapsed().as_secs_f64();
    })?;
    let fetch_s = t_fetch.elapsed().as_secs_f64();
    stats.layer_passes += 1;
    stats.experts_fetched += union.len() as u64;
    stats.expert_rows += expert_rows as u64;
    stats.expert_bytes_requested += (union.len() * layout.len) as u64;
    stats.expert_bytes = layout.len as u64;
    stats.distinct_experts.extend(union.iter().map(|&e| (layer as u32, e)));
    stats.read_wait_s += (fetch_s - kernel_s).max(0.0);
    *stats.layer_read_wait_s.entry(layer as u32).or_insert(0.0) += (fetch_s - kernel_s).max(0.0);
    let t_tail = Instant::now();

    let mut routed = vec![0f32; n * lat];
    for r in 0..n {
        let acc = &mut routed[r * lat..(r + 1) * lat];
        for j in 0..k {
            crate::cpu::ops::axpy(acc, routes.weights[r * k + j], &slots[(r * k + j) * lat..][..lat]);
        }
        if let Some(norm) = &w.routed_norm {
            rms_norm_inplace(acc, norm, c.rms_eps);
        }
    }
    let mut out = vec![0f32; n * h];
    matmul_bf16(&w.up_proj, &routed, &mut out);
    if let Some(sh) = &w.shared {
        let s = mlp(sh, situ, xn);
        for (o, v) in out.iter_mut().zip(&s) {
            *o += v;
        }
    }
    // z, the weighted sum, the latent norm/up-projection and shared experts count as expert work.
    stats.expert_kernel_s += kernel_s + t_tail.elapsed().as_secs_f64() + (t_fetch - t_routed).as_secs_f64();
    Ok((out, predicted_next.map(|(_, p)| p)))
}
