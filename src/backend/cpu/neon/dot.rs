//! The primitive dot kernels with NEON (bf16, f32 and MXFP4 rows against one input, one f32 pair)
//! and the row decoders that a band of a matrix-matrix product is decoded with.

use super::{E2m1Lut, LANES, Q4, load_bf16x16, load16, mxfp4_codes, pad_bf16, pad_f32, reduce4q, zero4};
use crate::backend::cpu::e8m0;
use std::arch::aarch64::*;

/// acc[q] = fma(w[q], x[q], acc[q]) for the four lane quarters.
#[target_feature(enable = "neon")]
#[inline]
fn fma4(acc: &mut Q4, w: Q4, x: Q4) {
    for q in 0..4 {
        acc[q] = vfmaq_f32(acc[q], w[q], x[q]);
    }
}

/// # Safety
/// Requires neon; each `w[r]` holds exactly `2 * x.len()` bytes.
#[target_feature(enable = "neon")]
#[inline(never)]
pub(in crate::backend::cpu) unsafe fn dot4_bf16(w: [&[u8]; 4], x: &[f32]) -> [f32; 4] {
    let n = x.len();
    let full = n / LANES;
    let mut acc = [zero4(); 4];
    let step = |wp: [*const u8; 4], xp: *const f32, acc: &mut [Q4; 4]| {
        // SAFETY: callers pass 16 readable floats at xp and 32 readable bytes at each wp.
        unsafe {
            let xv = load16(xp);
            for r in 0..4 {
                fma4(&mut acc[r], load_bf16x16(wp[r]), xv);
            }
        }
    };
    for c in 0..full {
        // SAFETY: c * 16 + 16 <= n elements of x and of every row (2 bytes each).
        let (wp, xp) = unsafe { (w.map(|r| r.as_ptr().add(c * 2 * LANES)), x.as_ptr().add(c * LANES)) };
        step(wp, xp, &mut acc);
    }
    if !n.is_multiple_of(LANES) {
        let xb = pad_f32(x, full * LANES);
        let wb = w.map(|r| pad_bf16(r, full * LANES));
        step(wb.each_ref().map(|b| b.as_ptr()), xb.as_ptr(), &mut acc);
    }
    acc.map(|a| reduce4q(a))
}

/// # Safety
/// Requires neon; every `b[r]` has `a.len()` elements.
#[target_feature(enable = "neon")]
#[inline(never)]
pub(in crate::backend::cpu) unsafe fn dot4_f32(a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
    let n = a.len();
    let full = n / LANES;
    let mut acc = [zero4(); 4];
    let step = |ap: *const f32, bp: [*const f32; 4], acc: &mut [Q4; 4]| {
        // SAFETY: callers pass 16 readable floats at every pointer.
        unsafe {
            let av = load16(ap);
            for r in 0..4 {
                fma4(&mut acc[r], av, load16(bp[r]));
            }
        }
    };
    for c in 0..full {
        // SAFETY: c * 16 + 16 <= n for every operand.
        let (ap, bp) = unsafe { (a.as_ptr().add(c * LANES), b.map(|r| r.as_ptr().add(c * LANES))) };
        step(ap, bp, &mut acc);
    }
    if !n.is_multiple_of(LANES) {
        let ab = pad_f32(a, full * LANES);
        let bb = b.map(|r| pad_f32(r, full * LANES));
        step(ab.as_ptr(), bb.each_ref().map(|x| x.as_ptr()), &mut acc);
    }
    acc.map(|a| reduce4q(a))
}

/// # Safety
/// Requires neon; `a` and `b` have the same length.
#[target_feature(enable = "neon")]
#[inline(never)]
pub(in crate::backend::cpu) unsafe fn dot1_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let full = n / LANES;
    let mut acc = zero4();
    for c in 0..full {
        // SAFETY: c * 16 + 16 <= n for both operands.
        unsafe { fma4(&mut acc, load16(a.as_ptr().add(c * LANES)), load16(b.as_ptr().add(c * LANES))) };
    }
    if !n.is_multiple_of(LANES) {
        let (ab, bb) = (pad_f32(a, full * LANES), pad_f32(b, full * LANES));
        // SAFETY: the padded buffers hold 16 floats.
        unsafe { fma4(&mut acc, load16(ab.as_ptr()), load16(bb.as_ptr())) };
    }
    reduce4q(acc)
}

/// Dots of four MXFP4 rows with one deinterleaved input: two rows at a time ([`dot2_mxfp4`]).
///
/// # Safety
/// Requires neon; `xd.len()` is a multiple of 32 and matches every row (2 codes a byte, one scale
/// per 32 inputs).
#[target_feature(enable = "neon")]
#[inline(never)]
pub(in crate::backend::cpu) unsafe fn dot4_mxfp4(w: [(&[u8], &[u8]); 4], xd: &[f32]) -> [f32; 4] {
    // SAFETY: the caller's promise, passed on.
    let ([a, b], [c, d]) = unsafe { (dot2_mxfp4([w[0], w[1]], xd), dot2_mxfp4([w[2], w[3]], xd)) };
    [a, b, c, d]
}

/// Dots of two MXFP4 rows with one deinterleaved input. Per block each row's low-nibble values
/// meet the even inputs, then its high-nibble values the odd ones: every lane takes its low value
/// before its high one, block after block, as the reference does. Two rows (8 accumulator
/// registers, the block's inputs loaded once for both) keep every value in a register; four
/// spilled accumulators to the stack.
///
/// # Safety
/// As [`dot4_mxfp4`].
#[target_feature(enable = "neon")]
#[inline]
unsafe fn dot2_mxfp4(w: [(&[u8], &[u8]); 2], xd: &[f32]) -> [f32; 2] {
    let lut = E2m1Lut::new();
    let mut acc = [zero4(); 2];
    for b in 0..xd.len() / 32 {
        // SAFETY: block b lies inside xd (32 floats) and inside each row (16 bytes, 1 scale).
        unsafe {
            let xp = xd.as_ptr().add(32 * b);
            let (xe, xo) = (load16(xp), load16(xp.add(16)));
            for r in 0..2 {
                let (lo, hi) = mxfp4_codes(w[r].0.as_ptr().add(16 * b));
                let s = vdupq_n_f32(e8m0(w[r].1[b]));
                fma4(&mut acc[r], lut.values(lo, s), xe);
                fma4(&mut acc[r], lut.values(hi, s), xo);
            }
        }
    }
    acc.map(|a| reduce4q(a))
}

/// Dequantises one MXFP4 row into the deinterleaved order (the scalar decoder's values).
///
/// # Safety
/// Requires neon; `out.len() == 2 * packed.len() == 32 * scales.len()`.
#[target_feature(enable = "neon")]
#[inline(never)]
pub(in crate::backend::cpu) unsafe fn decode_mxfp4_row(packed: &[u8], scales: &[u8], out: &mut [f32]) {
    let lut = E2m1Lut::new();
    for (b, &scale) in scales.iter().enumerate() {
        // SAFETY: block b lies inside packed (16 bytes) and out (32 floats).
        unsafe {
            let (lo, hi) = mxfp4_codes(packed.as_ptr().add(16 * b));
            let s = vdupq_n_f32(e8m0(scale));
            let o = out.as_mut_ptr().add(32 * b);
            let (l, h) = (lut.values(lo, s), lut.values(hi, s));
            for k in 0..4 {
                vst1q_f32(o.add(4 * k), l[k]);
                vst1q_f32(o.add(16 + 4 * k), h[k]);
            }
        }
    }
}

/// Converts one bf16 row to f32.
///
/// # Safety
/// Requires neon; `row.len() == 2 * out.len()`.
#[target_feature(enable = "neon")]
#[inline(never)]
pub(in crate::backend::cpu) unsafe fn decode_bf16_row(row: &[u8], out: &mut [f32]) {
    let n = out.len();
    let full = n / LANES;
    for c in 0..full {
        // SAFETY: c * 16 + 16 <= n values of the row and of out.
        unsafe {
            let o = out.as_mut_ptr().add(c * LANES);
            for (k, &v) in load_bf16x16(row.as_ptr().add(c * 2 * LANES)).iter().enumerate() {
                vst1q_f32(o.add(4 * k), v);
            }
        }
    }
    for i in full * LANES..n {
        out[i] = f32::from_bits((u16::from_le_bytes([row[2 * i], row[2 * i + 1]]) as u32) << 16);
    }
}
