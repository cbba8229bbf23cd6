//! Routed "latent" mixture of experts with shared experts, and the dense SiTU MLP.
//!
//! Router: s = sigmoid(x W_gate^T); the top-k of (s + correction bias) are selected (ties: lower
//! expert id first) — this selection order is the *router order*; weights are the unbiased s of the
//! selected experts, renormalised (sum + 1e-20) and scaled. Routed path: z = down_proj(x); each
//! expert computes w2(situ(w1 z, w3 z)) from its raw MXFP4 bytes; outputs are summed per row in
//! router order (never arrival order); then up_proj(RMSNorm(sum)). Shared experts see x itself.
//!
//! The schedule around this math (one fetch of the layer's expert union for every row in flight,
//! experts run as they land) lives in `sched::moe`.

use super::weights::{MlpWeights, MoeWeights};
use crate::backend::Backend;
use crate::cpu::ops::{Situ, sigmoid};
use crate::cpu::{Mxfp4Mat, deinterleave_mxfp4_input};
use crate::model::K3Config;
use crate::model::roster::ExpertLayout;

/// Dense SiTU-GLU MLP on rows `xn` [n, hidden].
pub fn mlp(be: &dyn Backend, w: &MlpWeights, situ: Situ, xn: &[f32]) -> Vec<f32> {
    let (inter, h) = (w.gate.rows, w.down.rows);
    let n = xn.len() / w.gate.cols;
    let mut g = vec![0f32; n * inter];
    let mut u = vec![0f32; n * inter];
    be.matmul_bf16_many(&[&w.gate, &w.up], xn, &mut [&mut g, &mut u]);
    let mut a = vec![0f32; n * inter];
    be.situ(situ, &g, &u, &mut a);
    let mut out = vec![0f32; n * h];
    be.matmul_bf16(&w.down, &a, &mut out);
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
pub fn route(be: &dyn Backend, c: &K3Config, w: &MoeWeights, xn: &[f32]) -> Routes {
    let n = xn.len() / c.hidden;
    let e = c.experts;
    let k = c.top_k;
    let mut logits = vec![0f32; n * e];
    be.matmul_bf16(&w.router, xn, &mut logits);
    let mut experts = vec![0u32; n * k];
    let mut weights = vec![0f32; n * k];
    let rule = RouteRule { k, renormalize: c.renormalize, scaling: c.routed_scaling };
    be.route_top_k(&logits, &w.bias, rule, &mut experts, &mut weights);
    Routes { k, experts, weights }
}

/// How router logits become a row's experts and weights.
#[derive(Clone, Copy, Debug)]
pub struct RouteRule {
    pub k: usize,
    /// Divide the selected scores by their sum (+ 1e-20).
    pub renormalize: bool,
    pub scaling: f32,
}

/// The CPU's routing of rows of router logits [n, e] (e = `bias.len()`): s = sigmoid(logit); the
/// k largest of s + bias, descending, lower id first on ties, NaN last (router order); weights
/// s / (sum of the selected s in router order + 1e-20) * scaling. Writes [n, k] of each.
pub fn route_rows(logits: &[f32], bias: &[f32], rule: RouteRule, experts: &mut [u32], weights: &mut [f32]) {
    let (e, k) = (bias.len(), rule.k);
    let mut order: Vec<u32> = Vec::with_capacity(e);
    for ((row, ex), wt) in logits.chunks_exact(e).zip(experts.chunks_exact_mut(k)).zip(weights.chunks_exact_mut(k)) {
        let s: Vec<f32> = row.iter().map(|&x| sigmoid(x)).collect();
        let choice: Vec<f32> = s.iter().zip(bias).map(|(a, b)| a + b).collect();
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
        let denom = if rule.renormalize { sum + 1e-20 } else { 1.0 };
        for ((&i, x), w) in sel.iter().zip(ex.iter_mut()).zip(wt.iter_mut()) {
            *x = i;
            *w = crate::backend::detmath::div(s[i as usize], denom) * rule.scaling;
        }
    }
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
pub fn run_expert<B: Backend + ?Sized>(
    be: &B,
    layout: &ExpertLayout,
    bytes: &[u8],
    situ: Situ,
    zd: &[f32],
) -> Vec<f32> {
    let [w1, w3, w2] = expert_mats(layout, bytes);
    let m = zd.len() / layout.latent;
    let mut g = vec![0f32; m * layout.inter];
    let mut u = vec![0f32; m * layout.inter];
    be.matmul_mxfp4(&w1, zd, &mut g);
    be.matmul_mxfp4(&w3, zd, &mut u);
    let mut a = vec![0f32; m * layout.inter];
    be.situ(situ, &g, &u, &mut a);
    let mut ad = vec![0f32; m * layout.inter];
    for (src, dst) in a.chunks_exact(layout.inter).zip(ad.chunks_exact_mut(layout.inter)) {
        deinterleave_mxfp4_input(src, dst);
    }
    let mut out = vec![0f32; m * layout.latent];
    be.matmul_mxfp4(&w2, &ad, &mut out);
    out
}

/// What the MoE layer computes from its input before the experts: the routed input z =
/// down_proj(x), deinterleaved for the MXFP4 kernels ([n, latent]), and the shared experts'
/// gate and up projections (one backend call for the three: one submission on the GPU).
pub struct ExpertInput {
    pub zd: Vec<f32>,
    shared_gate_up: Option<(Vec<f32>, Vec<f32>)>,
}

/// [`ExpertInput`] of rows `xn`.
pub fn expert_input(be: &dyn Backend, c: &K3Config, w: &MoeWeights, xn: &[f32]) -> ExpertInput {
    let lat = c.expert_latent;
    let n = xn.len() / c.hidden;
    let mut z = vec![0f32; n * lat];
    let shared_gate_up = match &w.shared {
        Some(sh) => {
            let mut g = vec![0f32; n * sh.gate.rows];
            let mut u = vec![0f32; n * sh.up.rows];
            be.matmul_bf16_many(&[&w.down_proj, &sh.gate, &sh.up], xn, &mut [&mut z, &mut g, &mut u]);
            Some((g, u))
        }
        None => {
            be.matmul_bf16(&w.down_proj, xn, &mut z);
            None
        }
    };
    let mut zd = vec![0f32; n * lat];
    for (src_row, dst) in z.chunks_exact(lat).zip(zd.chunks_exact_mut(lat)) {
        deinterleave_mxfp4_input(src_row, dst);
    }
    ExpertInput { zd, shared_gate_up }
}

/// The layer's output from the expert slots [n][k][latent]: per row the weighted sum in router
/// order, the latent norm, the up-projection, plus the shared experts (from `input`'s gate and
/// up projections; their down projection goes with the up-projection: one call).
pub fn combine(
    be: &dyn Backend,
    c: &K3Config,
    w: &MoeWeights,
    routes: &Routes,
    slots: &[f32],
    input: ExpertInput,
) -> Vec<f32> {
    let (k, lat) = (routes.k, c.expert_latent);
    let n = input.zd.len() / lat.max(1);
    let situ = Situ { beta: c.situ_beta, linear_beta: c.situ_linear_beta };
    let mut routed = vec![0f32; n * lat];
    for r in 0..n {
        let acc = &mut routed[r * lat..(r + 1) * lat];
        for j in 0..k {
            crate::cpu::ops::axpy(acc, routes.weights[r * k + j], &slots[(r * k + j) * lat..][..lat]);
        }
        if let Some(norm) = &w.routed_norm {
            be.rms_norm_rows(acc, norm, c.rms_eps);
        }
    }
    let mut out = vec![0f32; n * c.hidden];
    match (&w.shared, input.shared_gate_up) {
        (Some(sh), Some((g, u))) => {
            let mut a = vec![0f32; g.len()];
            be.situ(situ, &g, &u, &mut a);
            let mut s = vec![0f32; n * sh.down.rows];
            be.matmul_bf16_each(&[&w.up_proj, &sh.down], &[&routed, &a], &mut [&mut out, &mut s]);
            for (o, v) in out.iter_mut().zip(&s) {
                *o += v;
            }
        }
        (None, _) => be.matmul_bf16(&w.up_proj, &routed, &mut out),
        (Some(_), None) => unreachable!("the shared experts' gate and up come with the expert input"),
    }
    out
}
