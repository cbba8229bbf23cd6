//! NEON versions of the three primitive dot kernels (aarch64). The 16 lanes live in four q
//! registers per row; the operation order is the scalar reference's, so results are bit-identical.

use super::{E2M1, LANES, e8m0};
use std::arch::aarch64::*;

#[target_feature(enable = "neon")]
unsafe fn reduce4q(q: [float32x4_t; 4]) -> f32 {
    // lanes (i, i+8) then (i, i+4) then (i, i+2) then (i, i+1): q0..q3 hold lanes 0..16.
    let v8a = vaddq_f32(q[0], q[2]);
    let v8b = vaddq_f32(q[1], q[3]);
    let v4 = vaddq_f32(v8a, v8b);
    let v2 = vadd_f32(vget_low_f32(v4), vget_high_f32(v4));
    vget_lane_f32::<0>(v2) + vget_lane_f32::<1>(v2)
}

#[target_feature(enable = "neon")]
unsafe fn bf16x4(p: *const u16) -> float32x4_t {
    // SAFETY: caller guarantees 4 readable u16 at p (unaligned reads are allowed on aarch64).
    let raw = unsafe { vld1_u16(p) };
    vreinterpretq_f32_u32(vshll_n_u16::<16>(raw))
}

/// Lane chunk `c` of `src`, zero-padded past the end.
fn pad_f32(src: &[f32], c: usize) -> [f32; LANES] {
    let mut b = [0f32; LANES];
    let part = &src[c * LANES..src.len().min(c * LANES + LANES)];
    b[..part.len()].copy_from_slice(part);
    b
}

/// Lane chunk `c` of a bf16 row, zero-padded past the end.
fn load_bf16(src: &[u8], c: usize) -> [u16; LANES] {
    let mut b = [0u16; LANES];
    for (i, c) in src[2 * c * LANES..].chunks_exact(2).take(LANES).enumerate() {
        b[i] = u16::from_le_bytes([c[0], c[1]]);
    }
    b
}

/// # Safety
/// Requires neon; each `w[r]` holds exactly `2 * x.len()` bytes.
#[target_feature(enable = "neon")]
pub(super) unsafe fn dot4_bf16(w: [&[u8]; 4], x: &[f32]) -> [f32; 4] {
    let n = x.len();
    let mut acc = [[vdupq_n_f32(0.0); 4]; 4];
    for c in 0..n.div_ceil(LANES) {
        let xb = pad_f32(x, c);
        for r in 0..4 {
            let wb = load_bf16(w[r], c);
            for q in 0..4 {
                // SAFETY: the lane buffers hold 16 elements; q * 4 + 4 <= 16.
                unsafe {
                    let xv = vld1q_f32(xb.as_ptr().add(4 * q));
                    acc[r][q] = vfmaq_f32(acc[r][q], bf16x4(wb.as_ptr().add(4 * q)), xv);
                }
            }
        }
    }
    // SAFETY: neon is enabled for this function.
    acc.map(|a| unsafe { reduce4q(a) })
}

/// # Safety
/// Requires neon; every `b[r]` has `a.len()` elements.
#[target_feature(enable = "neon")]
pub(super) unsafe fn dot4_f32(a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
    let n = a.len();
    let mut acc = [[vdupq_n_f32(0.0); 4]; 4];
    for c in 0..n.div_ceil(LANES) {
        let ab = pad_f32(a, c);
        for r in 0..4 {
            let bb = pad_f32(b[r], c);
            for q in 0..4 {
                // SAFETY: the lane buffers hold 16 elements.
                unsafe {
                    let av = vld1q_f32(ab.as_ptr().add(4 * q));
                    acc[r][q] = vfmaq_f32(acc[r][q], av, vld1q_f32(bb.as_ptr().add(4 * q)));
                }
            }
        }
    }
    // SAFETY: neon is enabled for this function.
    acc.map(|a| unsafe { reduce4q(a) })
}

/// # Safety
/// Requires neon; `xd.len()` is a multiple of 32 and matches every row.
#[target_feature(enable = "neon")]
pub(super) unsafe fn dot4_mxfp4(w: [(&[u8], &[u8]); 4], xd: &[f32]) -> [f32; 4] {
    let mut acc = [[vdupq_n_f32(0.0); 4]; 4];
    for (b, xb) in xd.chunks_exact(32).enumerate() {
        for r in 0..4 {
            let s = e8m0(w[r].1[b]);
            let p = &w[r].0[b * 16..b * 16 + 16];
            let mut lo = [0f32; 16];
            let mut hi = [0f32; 16];
            for j in 0..16 {
                lo[j] = E2M1[(p[j] & 0x0f) as usize] * s;
                hi[j] = E2M1[(p[j] >> 4) as usize] * s;
            }
            for q in 0..4 {
                // SAFETY: every buffer holds 16 (xb: 32) elements; q * 4 + 4 <= 16.
                unsafe {
                    let t = vfmaq_f32(acc[r][q], vld1q_f32(lo.as_ptr().add(4 * q)), vld1q_f32(xb.as_ptr().add(4 * q)));
                    acc[r][q] = vfmaq_f32(t, vld1q_f32(hi.as_ptr().add(4 * q)), vld1q_f32(xb.as_ptr().add(16 + 4 * q)));
                }
            }
        }
    }
    // SAFETY: neon is enabled for this function.
    acc.map(|a| unsafe { reduce4q(a) })
}
