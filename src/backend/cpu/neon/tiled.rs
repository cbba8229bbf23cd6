//! The multi-row products with NEON: the 4 x 4 f32 tile of a decoded band against four input rows
//! (prefill's matrix-matrix product, `cpu::matmul`'s tiled band), and four MXFP4 rows decoded in
//! registers once for up to four inputs (a decode step's few rows of an expert).
//!
//! A 4 x 4 tile's 16 accumulators of 16 lanes would need 64 q registers (NEON has 32), so the tile
//! kernel runs one lane quarter at a time: lanes 4q..4q+4 of all 16 accumulators over every chunk
//! of the tile, then the next quarter. Lanes never interact before the reduction, so each lane
//! sees the same fused multiply-adds in the same order as in the reference.

use super::{E2m1Lut, LANES, Q4, load16, mxfp4_codes, pad_f32, reduce4q, zero4};
use crate::backend::cpu::e8m0;
use std::arch::aarch64::*;

/// [`dot4x4_f32`] over one tile of the columns, continuing from the lane accumulators in `acc`
/// ([w][x] blocks of 16 lanes) and leaving them there. Every tile but the last is a multiple of 16
/// long; the last one's partial chunk is zero-padded as in the untiled kernel.
///
/// # Safety
/// Requires neon; all eight slices have the same length.
#[target_feature(enable = "neon")]
#[inline(never)]
pub(in crate::backend::cpu) unsafe fn dot4x4_tile(w: [&[f32]; 4], x: [&[f32]; 4], acc: &mut [[f32; LANES]; 16]) {
    let n = w[0].len();
    let full = n / LANES;
    let tail = !n.is_multiple_of(LANES);
    let wb = w.map(|r| if tail { pad_f32(r, full * LANES) } else { [0.0; LANES] });
    let xb = x.map(|r| if tail { pad_f32(r, full * LANES) } else { [0.0; LANES] });
    let wp = w.map(|r| r.as_ptr());
    let xp = x.map(|r| r.as_ptr());
    for q in 0..4 {
        // SAFETY: every accumulator block holds 16 floats; 4q + 4 <= 16.
        let mut a: [[float32x4_t; 4]; 4] =
            std::array::from_fn(|r| std::array::from_fn(|i| unsafe { vld1q_f32(acc[4 * r + i].as_ptr().add(4 * q)) }));
        let step = |wq: [*const f32; 4], xq: [*const f32; 4], a: &mut [[float32x4_t; 4]; 4]| {
            // SAFETY: callers pass 4 readable floats at every pointer.
            unsafe {
                let xv = xq.map(|p| vld1q_f32(p));
                for r in 0..4 {
                    let wv = vld1q_f32(wq[r]);
                    for i in 0..4 {
                        a[r][i] = vfmaq_f32(a[r][i], wv, xv[i]);
                    }
                }
            }
        };
        for c in 0..full {
            let o = c * LANES + 4 * q;
            // SAFETY: o + 4 <= full * 16 <= n for every row.
            let (wq, xq) = unsafe { (wp.map(|p| p.add(o)), xp.map(|p| p.add(o))) };
            step(wq, xq, &mut a);
        }
        if tail {
            // SAFETY: the padded chunks hold 16 floats; 4q + 4 <= 16.
            let (wq, xq) =
                unsafe { (wb.each_ref().map(|b| b.as_ptr().add(4 * q)), xb.each_ref().map(|b| b.as_ptr().add(4 * q))) };
            step(wq, xq, &mut a);
        }
        for r in 0..4 {
            for i in 0..4 {
                // SAFETY: as for the loads above.
                unsafe { vst1q_f32(acc[4 * r + i].as_mut_ptr().add(4 * q), a[r][i]) };
            }
        }
    }
}

/// out[r][i] = dot(w[r], x[i]) for 4 weight rows x 4 input rows, each in the reference order.
///
/// # Safety
/// Requires neon; all eight slices have the same length.
#[target_feature(enable = "neon")]
#[inline(never)]
pub(in crate::backend::cpu) unsafe fn dot4x4_f32(w: [&[f32]; 4], x: [&[f32]; 4]) -> [[f32; 4]; 4] {
    // One tile over all columns from zero accumulators; the lane sums go through the same tree.
    let mut acc = [[0f32; LANES]; 16];
    // SAFETY: neon is enabled here; the caller checked the lengths.
    unsafe { dot4x4_tile(w, x, &mut acc) };
    std::array::from_fn(|r| std::array::from_fn(|i| crate::backend::cpu::reduce16(&acc[4 * r + i])))
}

/// Dots of four MXFP4 weight rows with `NX` deinterleaved input rows: out[r][i] = w[r] . x[i].
/// Row by row, each 32-value block is decoded into registers once and applied to every input (the
/// row's `4 * NX` accumulator registers stay live through its blocks); each output is the same
/// lanes, values, operations and reduction as `dot4_mxfp4` on that input alone.
///
/// # Safety
/// Requires neon; every `x[i].len()` is the same multiple of 32 and matches every row (2 codes a
/// byte, one scale per 32 inputs).
#[target_feature(enable = "neon")]
#[inline(never)]
pub(in crate::backend::cpu) unsafe fn dot4xn_mxfp4<const NX: usize>(
    w: [(&[u8], &[u8]); 4],
    x: [&[f32]; NX],
) -> [[f32; NX]; 4] {
    let lut = E2m1Lut::new();
    let xp = x.map(|r| r.as_ptr());
    let mut out = [[0f32; NX]; 4];
    for r in 0..4 {
        let (packed, scales) = w[r];
        let mut acc: [Q4; NX] = [zero4(); NX];
        for (b, &scale) in scales.iter().enumerate() {
            // SAFETY: block b lies inside every input (32 floats) and the row (16 bytes).
            unsafe {
                let (lo, hi) = mxfp4_codes(packed.as_ptr().add(16 * b));
                let s = vdupq_n_f32(e8m0(scale));
                let v = lut.values(lo, s);
                for i in 0..NX {
                    let xe = load16(xp[i].add(32 * b));
                    for q in 0..4 {
                        acc[i][q] = vfmaq_f32(acc[i][q], v[q], xe[q]);
                    }
                }
                let v = lut.values(hi, s);
                for i in 0..NX {
                    let xo = load16(xp[i].add(32 * b + 16));
                    for q in 0..4 {
                        acc[i][q] = vfmaq_f32(acc[i][q], v[q], xo[q]);
                    }
                }
            }
        }
        out[r] = acc.map(|a| reduce4q(a));
    }
    out
}
