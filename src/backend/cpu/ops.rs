//! Element-wise and per-row operations in f32: norms, activations, softmax, SiTU.
//! Each is a fixed sequential order of operations, so results never depend on threading.
//! Transcendentals, reciprocals and square roots come from [`crate::backend::detmath`] (not libm),
//! and every product that feeds an addition is a `mul_add`, so that the GPU kernels
//! (`kernels/norm.wgsl` and the others) can repeat each operation exactly.

use super::dot_f32;
use crate::backend::detmath;

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

/// SiTU-GLU constants: gate `beta * tanh(g / beta) * sigmoid(g)`, up `linear_beta * tanh(u / linear_beta)`
/// (the up transform is off when `linear_beta <= 0`). Both betas must be normal and positive (the
/// config check makes them so; K3 ships 4 and 25).
#[derive(Clone, Copy, Debug)]
pub struct Situ {
    pub beta: f32,
    pub linear_beta: f32,
}

impl Situ {
    #[inline(always)]
    pub fn apply(self, g: f32, u: f32) -> f32 {
        let a = self.beta * detmath::tanh(detmath::div(g, self.beta)) * sigmoid(g);
        let b = if self.linear_beta > 0.0 {
            self.linear_beta * detmath::tanh(detmath::div(u, self.linear_beta))
        } else {
            u
        };
        a * b
    }

    /// out[i] = situ(gate[i], up[i]).
    pub fn apply_rows(self, gate: &[f32], up: &[f32], out: &mut [f32]) {
        situ_rows(self, gate, up, out)
    }
}

detmath::fma_fn! {
    fn situ_rows(s: Situ, gate: &[f32], up: &[f32], out: &mut [f32]) {
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = s.apply(g, u);
        }
    }
}

detmath::fma_fn! {
    /// acc = fma(a, x, acc), element-wise (fused, so that a GPU kernel gives the same bits).
    pub fn axpy(acc: &mut [f32], a: f32, x: &[f32]) {
        for (y, &xi) in acc.iter_mut().zip(x) {
            *y = a.mul_add(xi, *y);
        }
    }
}
