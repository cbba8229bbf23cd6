//! NEON (aarch64) forms of the CPU kernel families: the dot products and the row decoders
//! (`dot.rs`), the tiled multi-row f32 and register-decoded MXFP4 products (`tiled.rs`), SiTU's
//! lanes (`situ.rs`), the coded trunk's block decoder and the matrix-vector product that decodes
//! into its FMAs (`coded.rs`), the int8 trunk product (`int8.rs`) and the FMA peak loop (here).
//! `cpu/dispatch.rs` puts them in the families' tables; `cpu/families.rs` lists them beside the
//! x86 forms (`cpu/x86/`, the same file names).
//!
//! Contract: each kernel repeats the scalar reference's operations exactly. The 16 lanes of an
//! accumulator are four q registers (lanes 4q..4q+4 in register q); a lane only ever meets the
//! values of its own elements, in element order, through `vfmaq_f32` — the same fused
//! multiply-add as the scalar `mul_add` — until [`reduce4q`] repeats `reduce16`'s tree; tails are
//! zero-padded as the reference pads them. NEON is part of every aarch64 target, so the helpers
//! here are plain inline functions; the kernels carry `target_feature(enable = "neon")` like their
//! x86 peers, and `cpu::Isa::Neon` is chosen only where it was detected.

mod coded;
mod dot;
mod int8;
mod situ;
mod tiled;

pub(super) use coded::{decode_blocks, dot4_coded};
pub(super) use dot::{decode_bf16_row, decode_mxfp4_row, dot1_f32, dot4_bf16, dot4_f32, dot4_mxfp4};
pub(super) use int8::dot4_int8;
pub(super) use situ::situ_rows;
pub(super) use tiled::{dot4x4_f32, dot4x4_tile, dot4xn_mxfp4};

use super::{E2M1, LANES};
use std::arch::aarch64::*;

/// The 16 lanes of one accumulator: register q holds lanes 4q..4q+4.
type Q4 = [float32x4_t; 4];

#[target_feature(enable = "neon")]
#[inline]
fn zero4() -> Q4 {
    [vdupq_n_f32(0.0); 4]
}

/// `reduce16`'s tree on lanes held as four q registers: (i, i+8) is q0+q2 and q1+q3, (i, i+4)
/// their sum, then (i, i+2) and (i, i+1).
#[target_feature(enable = "neon")]
#[inline]
fn reduce4q(q: Q4) -> f32 {
    let v4 = vaddq_f32(vaddq_f32(q[0], q[2]), vaddq_f32(q[1], q[3]));
    let v2 = vadd_f32(vget_low_f32(v4), vget_high_f32(v4));
    vget_lane_f32::<0>(v2) + vget_lane_f32::<1>(v2)
}

/// 16 f32 at `p`.
///
/// # Safety
/// 16 readable f32 at `p`.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn load16(p: *const f32) -> Q4 {
    // SAFETY: the caller's 16 floats.
    unsafe { [vld1q_f32(p), vld1q_f32(p.add(4)), vld1q_f32(p.add(8)), vld1q_f32(p.add(12))] }
}

/// Eight bf16 values (as u16) to f32: the low four and the high four (exact: bits << 16).
#[target_feature(enable = "neon")]
#[inline]
fn bf16x8(v: uint16x8_t) -> [float32x4_t; 2] {
    [vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(v))), vreinterpretq_f32_u32(vshll_high_n_u16::<16>(v))]
}

/// 16 bf16 values from their low bytes and high bytes (one byte vector each), as f32 lanes.
#[target_feature(enable = "neon")]
#[inline]
fn bf16_bytes(lo: uint8x16_t, hi: uint8x16_t) -> Q4 {
    let [a, b] = bf16x8(vreinterpretq_u16_u8(vzip1q_u8(lo, hi)));
    let [c, d] = bf16x8(vreinterpretq_u16_u8(vzip2q_u8(lo, hi)));
    [a, b, c, d]
}

/// 16 bf16 values (32 bytes, any alignment) at `p` as f32 lanes.
///
/// # Safety
/// 32 readable bytes at `p`.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn load_bf16x16(p: *const u8) -> Q4 {
    // SAFETY: the caller's 32 bytes; byte loads need no alignment.
    let (a, b) = unsafe { (vld1q_u8(p), vld1q_u8(p.add(16))) };
    let [w0, w1] = bf16x8(vreinterpretq_u16_u8(a));
    let [w2, w3] = bf16x8(vreinterpretq_u16_u8(b));
    [w0, w1, w2, w3]
}

/// Chunk of `src` from element `start` (fewer than 16 left), zero-padded to 16 lanes.
#[inline(always)]
fn pad_f32(src: &[f32], start: usize) -> [f32; LANES] {
    let mut b = [0f32; LANES];
    b[..src.len() - start].copy_from_slice(&src[start..]);
    b
}

/// Bytes of a bf16 row from element `start` (fewer than 16 left), zero-padded to 16 values.
#[inline(always)]
fn pad_bf16(src: &[u8], start: usize) -> [u8; 2 * LANES] {
    let mut b = [0u8; 2 * LANES];
    b[..src.len() - 2 * start].copy_from_slice(&src[2 * start..]);
    b
}

/// One byte of the bf16 bits of every E2M1 value (`hi`: the high byte), by code: every E2M1 value
/// is a bf16 value (its low 16 f32 bits are zero), so two table lookups give a code's f32.
const fn e2m1_bytes(hi: bool) -> [u8; 16] {
    let mut t = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        let bits = E2M1[i].to_bits();
        assert!(bits & 0xffff == 0);
        t[i] = if hi { (bits >> 24) as u8 } else { (bits >> 16) as u8 };
        i += 1;
    }
    t
}
const E2M1_LO: [u8; 16] = e2m1_bytes(false);
const E2M1_HI: [u8; 16] = e2m1_bytes(true);

/// The E2M1 lookup tables in registers (low bytes, high bytes).
#[derive(Clone, Copy)]
struct E2m1Lut(uint8x16_t, uint8x16_t);

impl E2m1Lut {
    #[target_feature(enable = "neon")]
    #[inline]
    fn new() -> Self {
        // SAFETY: both tables hold 16 bytes.
        unsafe { E2m1Lut(vld1q_u8(E2M1_LO.as_ptr()), vld1q_u8(E2M1_HI.as_ptr())) }
    }

    /// 16 codes (one per byte, 0..16) to `E2M1[code] * s`, lanes in code order: the scalar
    /// decoder's values and its one multiplication.
    #[target_feature(enable = "neon")]
    #[inline]
    fn values(self, codes: uint8x16_t, s: float32x4_t) -> Q4 {
        bf16_bytes(vqtbl1q_u8(self.0, codes), vqtbl1q_u8(self.1, codes)).map(|v| vmulq_f32(v, s))
    }
}

/// The codes of one 32-value MXFP4 block (its 16 bytes): low nibbles (values 0..16 of the
/// deinterleaved block) and high nibbles (16..32).
///
/// # Safety
/// 16 readable bytes at `p`.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn mxfp4_codes(p: *const u8) -> (uint8x16_t, uint8x16_t) {
    // SAFETY: the caller's 16 bytes.
    let bytes = unsafe { vld1q_u8(p) };
    (vandq_u8(bytes, vdupq_n_u8(15)), vshrq_n_u8::<4>(bytes))
}

/// Independent accumulator chains of the FMA peak loop: Apple's performance cores have four FMA
/// pipes of latency 4 (and 32 vector registers to hold the chains).
pub(super) const PEAK_CHAINS: usize = 16;

/// The FMA peak loop with NEON: [`PEAK_CHAINS`] register-resident chains, `iters` FMAs each.
///
/// # Safety
/// Requires neon.
#[target_feature(enable = "neon")]
pub(super) unsafe fn fma_chains(iters: u64) -> f32 {
    let a = vdupq_n_f32(0.999_999);
    let b = vdupq_n_f32(1e-7);
    let mut acc = [vdupq_n_f32(1.0); PEAK_CHAINS];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = vfmaq_f32(b, *x, a);
        }
    }
    let mut s = vdupq_n_f32(0.0);
    for x in acc {
        s = vaddq_f32(s, x);
    }
    vaddvq_f32(s)
}
