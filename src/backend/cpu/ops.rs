//! Element-wise and per-row operations in f32: norms, activations, softmax, SiTU.
//! Each is a fixed sequential order of operations, so results never depend on threading.

use super::dot_f32;

/// out = w * x / sqrt(mean(x^2) + eps).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    debug_assert_eq!(x.len(), w.len());
    let inv = 1.0 / (dot_f32(x, x) / x.len() as f32 + eps).sqrt();
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = wi * (xi * inv);
    }
}

/// In-place RMSNorm.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    debug_assert_eq!(x.len(), w.len());
    let inv = 1.0 / (dot_f32(x, x) / x.len() as f32 + eps).sqrt();
    for (xi, &wi) in x.iter_mut().zip(w) {
        *xi = wi * (*xi * inv);
    }
}

/// In-place x / sqrt(sum(x^2) + eps) (the KDA query/key normalisation).
pub fn l2_norm_inplace(x: &mut [f32], eps: f32) {
    let inv = 1.0 / (dot_f32(x, x) + eps).sqrt();
    for xi in x.iter_mut() {
        *xi *= inv;
    }
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// In-place softmax (max-subtracted).
pub fn softmax_inplace(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for xi in x.iter_mut() {
        *xi = (*xi - m).exp();
        sum += *xi;
    }
    let inv = 1.0 / sum;
    for xi in x.iter_mut() {
        *xi *= inv;
    }
}

/// SiTU-GLU constants: gate `beta * tanh(g / beta) * sigmoid(g)`, up `linear_beta * tanh(u / linear_beta)`
/// (the up transform is off when `linear_beta <= 0`).
#[derive(Clone, Copy, Debug)]
pub struct Situ {
    pub beta: f32,
    pub linear_beta: f32,
}

impl Situ {
    #[inline]
    pub fn apply(self, g: f32, u: f32) -> f32 {
        let a = self.beta * (g / self.beta).tanh() * sigmoid(g);
        let b = if self.linear_beta > 0.0 { self.linear_beta * (u / self.linear_beta).tanh() } else { u };
        a * b
    }

    /// out[i] = situ(gate[i], up[i]).
    pub fn apply_rows(self, gate: &[f32], up: &[f32], out: &mut [f32]) {
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = self.apply(g, u);
        }
    }
}

/// acc += a * x, element-wise (multiply then add; no fusing, so the order is fixed).
#[inline]
pub fn axpy(acc: &mut [f32], a: f32, x: &[f32]) {
    for (y, &xi) in acc.iter_mut().zip(x) {
        *y += a * xi;
    }
}
