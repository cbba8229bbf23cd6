//! SiTU with NEON, four elements at a time: the lanes of `backend::detmath::Lanes` and the kernel,
//! the one SiTU loop (`cpu::situ::situ_rows_with`) compiled inside a target-feature function. The
//! math is `detmath`'s, written once: every lane gets the scalar function's bits (NaN inputs give
//! NaN), a tail shorter than a vector runs the scalar code itself. The same construction as
//! `cpu/x86/situ.rs`.
//!
//! Contract: `F32x4` is private to this file, which makes and uses its values only inside
//! [`situ_rows`] (neon), into which every lane operation is inlined; each operation is the
//! correctly rounded f32 operation (or the exact bit operation) the one-lane form does.

use crate::backend::cpu::situ::situ_rows_with;
use crate::backend::detmath::Lanes;
use crate::backend::types::Situ;
use std::arch::aarch64::*;

/// The sign bit of an f32.
const SIGN: u32 = 0x8000_0000;

/// A NEON intrinsic on `F32x4` values (see the module contract).
macro_rules! neon {
    ($e:expr) => {
        // SAFETY: F32x4 values exist only inside situ_rows (neon), into which this operation is
        // inlined (the module contract).
        unsafe { $e }
    };
}

/// Four f32 lanes in one q register; a mask is a compare result (all bits of a lane set).
#[derive(Clone, Copy)]
struct F32x4(float32x4_t);

impl Lanes for F32x4 {
    type Mask = uint32x4_t;
    const N: usize = 4;
    #[inline(always)]
    fn splat(v: f32) -> Self {
        F32x4(neon!(vdupq_n_f32(v)))
    }
    #[inline(always)]
    fn load(src: &[f32]) -> Self {
        assert!(src.len() >= 4);
        F32x4(neon!(vld1q_f32(src.as_ptr())))
    }
    #[inline(always)]
    fn store(self, dst: &mut [f32]) {
        assert!(dst.len() >= 4);
        neon!(vst1q_f32(dst.as_mut_ptr(), self.0))
    }
    #[inline(always)]
    fn add(self, b: Self) -> Self {
        F32x4(neon!(vaddq_f32(self.0, b.0)))
    }
    #[inline(always)]
    fn sub(self, b: Self) -> Self {
        F32x4(neon!(vsubq_f32(self.0, b.0)))
    }
    #[inline(always)]
    fn mul(self, b: Self) -> Self {
        F32x4(neon!(vmulq_f32(self.0, b.0)))
    }
    #[inline(always)]
    fn fma(self, b: Self, c: Self) -> Self {
        // vfmaq_f32(c, a, b) = a * b + c, one rounding.
        F32x4(neon!(vfmaq_f32(c.0, self.0, b.0)))
    }
    #[inline(always)]
    fn neg(self) -> Self {
        F32x4(neon!(vnegq_f32(self.0)))
    }
    #[inline(always)]
    fn abs(self) -> Self {
        F32x4(neon!(vabsq_f32(self.0)))
    }
    #[inline(always)]
    fn copysign(self, s: Self) -> Self {
        F32x4(neon!(vbslq_f32(vdupq_n_u32(SIGN), s.0, self.0)))
    }
    #[inline(always)]
    fn floor(self) -> Self {
        F32x4(neon!(vrndmq_f32(self.0)))
    }
    #[inline(always)]
    fn lt(self, b: Self) -> uint32x4_t {
        neon!(vcltq_f32(self.0, b.0))
    }
    #[inline(always)]
    fn gt(self, b: Self) -> uint32x4_t {
        neon!(vcgtq_f32(self.0, b.0))
    }
    #[inline(always)]
    fn le(self, b: Self) -> uint32x4_t {
        neon!(vcleq_f32(self.0, b.0))
    }
    #[inline(always)]
    fn eq(self, b: Self) -> uint32x4_t {
        neon!(vceqq_f32(self.0, b.0))
    }
    #[inline(always)]
    fn is_nan(self) -> uint32x4_t {
        neon!(vmvnq_u32(vceqq_f32(self.0, self.0)))
    }
    #[inline(always)]
    fn select(self, m: uint32x4_t, t: Self) -> Self {
        F32x4(neon!(vbslq_f32(m, t.0, self.0)))
    }
    #[inline(always)]
    fn bits_minus(self, bits: u32) -> Self {
        F32x4(neon!(vreinterpretq_f32_u32(vsubq_u32(vdupq_n_u32(bits), vreinterpretq_u32_f32(self.0)))))
    }
    #[inline(always)]
    fn add_exponent(self, kf: Self) -> Self {
        // kf is integral where the result is kept (|kf| <= 128): truncation is exact.
        F32x4(neon!({
            let k = vreinterpretq_u32_s32(vcvtq_s32_f32(kf.0));
            vreinterpretq_f32_u32(vaddq_u32(vreinterpretq_u32_f32(self.0), vshlq_n_u32::<23>(k)))
        }))
    }
}

/// out[i] = s.apply(gate[i], up[i]), four elements at a time (see the module contract).
///
/// # Safety
/// Requires neon; the three slices have the same length.
#[target_feature(enable = "neon")]
#[inline(never)]
pub(in crate::backend::cpu) unsafe fn situ_rows(s: Situ, gate: &[f32], up: &[f32], out: &mut [f32]) {
    situ_rows_with::<F32x4>(s, gate, up, out)
}
