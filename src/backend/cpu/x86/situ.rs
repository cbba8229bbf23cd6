//! SiTU with AVX-512 (sixteen elements at a time) and AVX2 with FMA (eight): the lanes of
//! `backend::detmath::Lanes` for both, and the two kernels, each the one SiTU loop
//! (`cpu::situ::situ_rows_with`) compiled inside a target-feature function. The math is
//! `detmath`'s, written once: every lane gets the scalar function's bits (NaN inputs give NaN), a
//! tail shorter than a vector runs the scalar code itself.
//!
//! Contract: `F32x16` and `F32x8` are private to this file, which makes and uses their values
//! only inside [`situ_rows_avx512`] (avx512f) and [`situ_rows_avx2`] (avx2, fma), into which every
//! lane operation is inlined; each operation is the correctly rounded f32 operation (or the exact
//! bit operation) the one-lane form does.

use crate::backend::cpu::situ::situ_rows_with;
use crate::backend::detmath::Lanes;
use crate::backend::types::Situ;
use std::arch::x86_64::*;

/// The sign bit of an f32, as an integer lane.
const SIGN: i32 = i32::MIN;

/// An AVX-512 intrinsic on `F32x16` values (see the module contract).
macro_rules! avx512 {
    ($e:expr) => {
        // SAFETY: F32x16 values exist only inside situ_rows_avx512 (avx512f), into which this
        // operation is inlined (the module contract).
        unsafe { $e }
    };
}

/// Sixteen f32 lanes in one AVX-512 register.
#[derive(Clone, Copy)]
struct F32x16(__m512);

impl Lanes for F32x16 {
    type Mask = __mmask16;
    const N: usize = 16;
    #[inline(always)]
    fn splat(v: f32) -> Self {
        F32x16(avx512!(_mm512_set1_ps(v)))
    }
    #[inline(always)]
    fn load(src: &[f32]) -> Self {
        assert!(src.len() >= 16);
        F32x16(avx512!(_mm512_loadu_ps(src.as_ptr())))
    }
    #[inline(always)]
    fn store(self, dst: &mut [f32]) {
        assert!(dst.len() >= 16);
        avx512!(_mm512_storeu_ps(dst.as_mut_ptr(), self.0))
    }
    #[inline(always)]
    fn add(self, b: Self) -> Self {
        F32x16(avx512!(_mm512_add_ps(self.0, b.0)))
    }
    #[inline(always)]
    fn sub(self, b: Self) -> Self {
        F32x16(avx512!(_mm512_sub_ps(self.0, b.0)))
    }
    #[inline(always)]
    fn mul(self, b: Self) -> Self {
        F32x16(avx512!(_mm512_mul_ps(self.0, b.0)))
    }
    #[inline(always)]
    fn fma(self, b: Self, c: Self) -> Self {
        F32x16(avx512!(_mm512_fmadd_ps(self.0, b.0, c.0)))
    }
    #[inline(always)]
    fn neg(self) -> Self {
        F32x16(avx512!(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(self.0), _mm512_set1_epi32(SIGN)))))
    }
    #[inline(always)]
    fn abs(self) -> Self {
        F32x16(avx512!(_mm512_castsi512_ps(_mm512_andnot_si512(_mm512_set1_epi32(SIGN), _mm512_castps_si512(self.0)))))
    }
    #[inline(always)]
    fn copysign(self, s: Self) -> Self {
        F32x16(avx512!({
            let sign = _mm512_set1_epi32(SIGN);
            let mag = _mm512_andnot_si512(sign, _mm512_castps_si512(self.0));
            _mm512_castsi512_ps(_mm512_or_si512(mag, _mm512_and_si512(sign, _mm512_castps_si512(s.0))))
        }))
    }
    #[inline(always)]
    fn floor(self) -> Self {
        F32x16(avx512!(_mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(self.0)))
    }
    #[inline(always)]
    fn lt(self, b: Self) -> __mmask16 {
        avx512!(_mm512_cmp_ps_mask::<_CMP_LT_OQ>(self.0, b.0))
    }
    #[inline(always)]
    fn gt(self, b: Self) -> __mmask16 {
        avx512!(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(self.0, b.0))
    }
    #[inline(always)]
    fn le(self, b: Self) -> __mmask16 {
        avx512!(_mm512_cmp_ps_mask::<_CMP_LE_OQ>(self.0, b.0))
    }
    #[inline(always)]
    fn eq(self, b: Self) -> __mmask16 {
        avx512!(_mm512_cmp_ps_mask::<_CMP_EQ_OQ>(self.0, b.0))
    }
    #[inline(always)]
    fn is_nan(self) -> __mmask16 {
        avx512!(_mm512_cmp_ps_mask::<_CMP_UNORD_Q>(self.0, self.0))
    }
    #[inline(always)]
    fn select(self, m: __mmask16, t: Self) -> Self {
        F32x16(avx512!(_mm512_mask_mov_ps(self.0, m, t.0)))
    }
    #[inline(always)]
    fn bits_minus(self, bits: u32) -> Self {
        F32x16(avx512!(_mm512_castsi512_ps(_mm512_sub_epi32(
            _mm512_set1_epi32(bits as i32),
            _mm512_castps_si512(self.0)
        ))))
    }
    #[inline(always)]
    fn add_exponent(self, kf: Self) -> Self {
        // kf is integral where the result is kept (|kf| <= 128): the conversion is exact.
        F32x16(avx512!(_mm512_castsi512_ps(_mm512_add_epi32(
            _mm512_castps_si512(self.0),
            _mm512_slli_epi32::<23>(_mm512_cvtps_epi32(kf.0))
        ))))
    }
}

/// out[i] = s.apply(gate[i], up[i]), sixteen elements at a time (see the module contract).
///
/// # Safety
/// Requires avx512f; the three slices have the same length.
#[target_feature(enable = "avx512f")]
pub(in crate::backend::cpu) unsafe fn situ_rows_avx512(s: Situ, gate: &[f32], up: &[f32], out: &mut [f32]) {
    situ_rows_with::<F32x16>(s, gate, up, out)
}

/// An AVX2 intrinsic on `F32x8` values (see the module contract).
macro_rules! avx2 {
    ($e:expr) => {
        // SAFETY: F32x8 values exist only inside situ_rows_avx2 (avx2, fma), into which this
        // operation is inlined (the module contract).
        unsafe { $e }
    };
}

/// Eight f32 lanes in one AVX register; a mask is a compare result (all bits of a lane set).
#[derive(Clone, Copy)]
struct F32x8(__m256);

impl F32x8 {
    #[inline(always)]
    fn sign() -> __m256 {
        avx2!(_mm256_castsi256_ps(_mm256_set1_epi32(SIGN)))
    }
}

impl Lanes for F32x8 {
    type Mask = __m256;
    const N: usize = 8;
    #[inline(always)]
    fn splat(v: f32) -> Self {
        F32x8(avx2!(_mm256_set1_ps(v)))
    }
    #[inline(always)]
    fn load(src: &[f32]) -> Self {
        assert!(src.len() >= 8);
        F32x8(avx2!(_mm256_loadu_ps(src.as_ptr())))
    }
    #[inline(always)]
    fn store(self, dst: &mut [f32]) {
        assert!(dst.len() >= 8);
        avx2!(_mm256_storeu_ps(dst.as_mut_ptr(), self.0))
    }
    #[inline(always)]
    fn add(self, b: Self) -> Self {
        F32x8(avx2!(_mm256_add_ps(self.0, b.0)))
    }
    #[inline(always)]
    fn sub(self, b: Self) -> Self {
        F32x8(avx2!(_mm256_sub_ps(self.0, b.0)))
    }
    #[inline(always)]
    fn mul(self, b: Self) -> Self {
        F32x8(avx2!(_mm256_mul_ps(self.0, b.0)))
    }
    #[inline(always)]
    fn fma(self, b: Self, c: Self) -> Self {
        F32x8(avx2!(_mm256_fmadd_ps(self.0, b.0, c.0)))
    }
    #[inline(always)]
    fn neg(self) -> Self {
        F32x8(avx2!(_mm256_xor_ps(self.0, Self::sign())))
    }
    #[inline(always)]
    fn abs(self) -> Self {
        F32x8(avx2!(_mm256_andnot_ps(Self::sign(), self.0)))
    }
    #[inline(always)]
    fn copysign(self, s: Self) -> Self {
        F32x8(avx2!(_mm256_or_ps(_mm256_andnot_ps(Self::sign(), self.0), _mm256_and_ps(Self::sign(), s.0))))
    }
    #[inline(always)]
    fn floor(self) -> Self {
        F32x8(avx2!(_mm256_round_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(self.0)))
    }
    #[inline(always)]
    fn lt(self, b: Self) -> __m256 {
        avx2!(_mm256_cmp_ps::<_CMP_LT_OQ>(self.0, b.0))
    }
    #[inline(always)]
    fn gt(self, b: Self) -> __m256 {
        avx2!(_mm256_cmp_ps::<_CMP_GT_OQ>(self.0, b.0))
    }
    #[inline(always)]
    fn le(self, b: Self) -> __m256 {
        avx2!(_mm256_cmp_ps::<_CMP_LE_OQ>(self.0, b.0))
    }
    #[inline(always)]
    fn eq(self, b: Self) -> __m256 {
        avx2!(_mm256_cmp_ps::<_CMP_EQ_OQ>(self.0, b.0))
    }
    #[inline(always)]
    fn is_nan(self) -> __m256 {
        avx2!(_mm256_cmp_ps::<_CMP_UNORD_Q>(self.0, self.0))
    }
    #[inline(always)]
    fn select(self, m: __m256, t: Self) -> Self {
        F32x8(avx2!(_mm256_blendv_ps(self.0, t.0, m)))
    }
    #[inline(always)]
    fn bits_minus(self, bits: u32) -> Self {
        F32x8(avx2!(_mm256_castsi256_ps(_mm256_sub_epi32(_mm256_set1_epi32(bits as i32), _mm256_castps_si256(self.0)))))
    }
    #[inline(always)]
    fn add_exponent(self, kf: Self) -> Self {
        // kf is integral where the result is kept (|kf| <= 128): the conversion is exact.
        F32x8(avx2!(_mm256_castsi256_ps(_mm256_add_epi32(
            _mm256_castps_si256(self.0),
            _mm256_slli_epi32::<23>(_mm256_cvtps_epi32(kf.0))
        ))))
    }
}

/// out[i] = s.apply(gate[i], up[i]), eight elements at a time (see the module contract).
///
/// # Safety
/// Requires avx2 and fma; the three slices have the same length.
#[target_feature(enable = "avx2,fma")]
pub(in crate::backend::cpu) unsafe fn situ_rows_avx2(s: Situ, gate: &[f32], up: &[f32], out: &mut [f32]) {
    situ_rows_with::<F32x8>(s, gate, up, out)
}
