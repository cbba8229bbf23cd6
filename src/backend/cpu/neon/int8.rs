//! The int8 trunk's matrix-vector product with NEON: each row's codes widened and scaled in
//! registers (`q as f32 * scale`, the one rounding of `Int8Mat::decode_row`) and fed to the FMAs,
//! instead of being expanded to an f32 row in a scratch first.

use super::{LANES, Q4, load16, pad_f32, reduce4q, zero4};
use std::arch::aarch64::*;

/// 16 int8 codes at `p` as `q * s` (exact widening, then one multiplication).
///
/// # Safety
/// 16 readable bytes at `p`.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn scaled(p: *const i8, s: float32x4_t) -> Q4 {
    // SAFETY: the caller's 16 bytes.
    let v = unsafe { vld1q_s8(p) };
    let (a, b) = (vmovl_s8(vget_low_s8(v)), vmovl_high_s8(v));
    [vmovl_s16(vget_low_s16(a)), vmovl_high_s16(a), vmovl_s16(vget_low_s16(b)), vmovl_high_s16(b)]
        .map(|w| vmulq_f32(vcvtq_f32_s32(w), s))
}

/// Dots of four int8 rows (codes `q[r]`, scale `s[r]`) with one f32 vector: the values
/// `Int8Mat::decode_row` gives, dotted in the reference order of `dot4_f32(x, rows)`; a partial
/// last chunk takes the decoded values zero-padded (a padded lane is 0.0, not `0 * scale`).
///
/// # Safety
/// Requires neon; every `q[r]` has `x.len()` codes.
#[target_feature(enable = "neon")]
#[inline(never)]
pub(in crate::backend::cpu) unsafe fn dot4_int8(q: [&[i8]; 4], s: [f32; 4], x: &[f32]) -> [f32; 4] {
    let n = x.len();
    let full = n / LANES;
    let sv = s.map(|v| vdupq_n_f32(v));
    let mut acc = [zero4(); 4];
    for c in 0..full {
        // SAFETY: c * 16 + 16 <= n elements of x and of every row.
        unsafe {
            let xv = load16(x.as_ptr().add(c * LANES));
            for r in 0..4 {
                let wv = scaled(q[r].as_ptr().add(c * LANES), sv[r]);
                for l in 0..4 {
                    acc[r][l] = vfmaq_f32(acc[r][l], xv[l], wv[l]);
                }
            }
        }
    }
    if !n.is_multiple_of(LANES) {
        let start = full * LANES;
        let xb = pad_f32(x, start);
        for r in 0..4 {
            let mut wb = [0f32; LANES];
            for (w, &c) in wb.iter_mut().zip(&q[r][start..]) {
                *w = f32::from(c) * s[r];
            }
            // SAFETY: the padded chunks hold 16 floats.
            unsafe {
                let (xv, wv) = (load16(xb.as_ptr()), load16(wb.as_ptr()));
                for l in 0..4 {
                    acc[r][l] = vfmaq_f32(acc[r][l], xv[l], wv[l]);
                }
            }
        }
    }
    acc.map(|a| reduce4q(a))
}
