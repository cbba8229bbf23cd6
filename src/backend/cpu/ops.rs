//! Element-wise and per-row operations in f32: norms, activations, softmax, SiTU's rows (SiTU
//! itself is `situ.rs`), the AttnRes mix and routing.
//! Each is a fixed sequential order of operations, so results never depend on threading.
//! Transcendentals, reciprocals and square roots come from [`crate::backend::detmath`] (not libm),
//! and every product that feeds an addition is a `mul_add`, so that the GPU kernels
//! (`kernels/norm.wgsl` and the others) can repeat each operation exactly.

use super::dispatch::SITU;
use super::{Isa, dot_f32};
use crate::backend::detmath;
use crate::backend::types::{RouteRule, Situ};

/// 1 / sqrt(mean(x^2) + eps), the RMSNorm factor.
#[inline]
pub fn rms_factor(x: &[f32], eps: f32) -> f32 {
    detmath::rsqrt(detmath::div(dot_f32(x, x), x.len() as f32) + eps)
}

/// out = w * x / sqrt(mean(x^2) + eps).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    debug_assert_eq!(x.len(), w.len());
    let inv = rms_factor(x, eps);
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = wi * (xi * inv);
    }
}

/// In-place RMSNorm.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    debug_assert_eq!(x.len(), w.len());
    let inv = rms_factor(x, eps);
    for (xi, &wi) in x.iter_mut().zip(w) {
        *xi = wi * (*xi * inv);
    }
}

/// In-place x / sqrt(sum(x^2) + eps) (the KDA query/key normalisation).
pub fn l2_norm_inplace(x: &mut [f32], eps: f32) {
    let inv = detmath::rsqrt(dot_f32(x, x) + eps);
    for xi in x.iter_mut() {
        *xi *= inv;
    }
}

#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    detmath::sigmoid(x)
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// The larger of m and v; NaN never wins (the same compare as the GPU kernels).
#[inline]
pub fn max_f32(m: f32, v: f32) -> f32 {
    if v > m { v } else { m }
}

/// In-place softmax (max-subtracted).
pub fn softmax_inplace(x: &mut [f32]) {
    softmax_of_products(x, &[1.0])
}

detmath::fma_fn! {
    /// In-place softmax of the scores x_i * scale_i (`scale` of length 1: the same for all): the
    /// max m of the products, then e_i = exp(fma(x_i, scale_i, -m)) (one rounding, so a GPU cannot
    /// contract it differently), summed in order, each times 1 / sum.
    pub fn softmax_of_products(x: &mut [f32], scale: &[f32]) {
        let s = |i: usize| if scale.len() == 1 { scale[0] } else { scale[i] };
        let m = x.iter().enumerate().fold(f32::NEG_INFINITY, |m, (i, &v)| max_f32(m, v * s(i)));
        let mut sum = 0f32;
        for (i, xi) in x.iter_mut().enumerate() {
            *xi = detmath::exp(xi.mul_add(s(i), -m));
            sum += *xi;
        }
        let inv = detmath::div(1.0, sum);
        for xi in x.iter_mut() {
            *xi *= inv;
        }
    }
}

impl Situ {
    /// out[i] = situ(gate[i], up[i]).
    pub fn apply_rows(self, gate: &[f32], up: &[f32], out: &mut [f32]) {
        SITU.chosen().call(self, gate, up, out)
    }
}

/// out[i] = s.apply(gate[i], up[i]) with the kernel of `isa`: the same bits on every one (the
/// loop of `cpu/situ.rs` on one lane is the definition; AVX-512, AVX2 and NEON run it on 16, 8 or
/// 4 lanes).
pub fn situ_rows_isa(isa: Isa, s: Situ, gate: &[f32], up: &[f32], out: &mut [f32]) {
    SITU.get(isa).call(s, gate, up, out)
}

detmath::fma_fn! {
    /// acc = fma(a, x, acc), element-wise (fused, so that a GPU kernel gives the same bits).
    pub fn axpy(acc: &mut [f32], a: f32, x: &[f32]) {
        for (y, &xi) in acc.iter_mut().zip(x) {
            *y = a.mul_add(xi, *y);
        }
    }
}

/// out = sum_s p_s * v_s, p = softmax_s( (v_s . score_w) / sqrt(mean(v_s^2) + eps) ): a mix of
/// `sources` weighted by the softmax of their RMS-normalised scores, summed in the order given.
pub fn attn_res_mix(sources: &[&[f32]], score_w: &[f32], eps: f32, out: &mut [f32]) {
    debug_assert!(sources.iter().all(|s| s.len() == score_w.len()));
    // score_s = (v_s . w) * rms_factor(v_s); the product is formed inside the softmax's fma.
    let mut scores: Vec<f32> = sources.iter().map(|v| dot_f32(v, score_w)).collect();
    let factors: Vec<f32> = sources.iter().map(|v| rms_factor(v, eps)).collect();
    softmax_of_products(&mut scores, &factors);
    for (o, &v0) in out.iter_mut().zip(sources[0]) {
        *o = scores[0] * v0;
    }
    for (v, &p) in sources.iter().zip(&scores).skip(1) {
        axpy(out, p, v);
    }
}

pub use crate::backend::detmath::argmax;

/// Routing of rows of router logits [n, e] (e = `bias.len()`) by `rule` (see [`RouteRule`]):
/// s = sigmoid(logit); the k largest of s + bias, descending, lower id first on ties, NaN last;
/// weights s / (sum of the selected s in that order + 1e-20) * scaling. Writes [n, k] of each.
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
            *w = detmath::div(s[i as usize], denom) * rule.scaling;
        }
    }
}
