//! SiTU ([`Situ::apply`]) sixteen elements at a time with AVX-512 (eight with AVX2): the scalar definition's
//! operations (`backend::detmath`'s `exp`, `tanh`, `sigmoid` and `div`, then the products), each
//! the same correctly rounded f32 operation in the same order, lane by lane; the scalar code's
//! branches become every path computed and the lane's own one selected by a mask. So every output
//! has the scalar function's bits (NaN inputs give NaN). A tail shorter than a vector runs the
//! scalar code itself.

use crate::backend::types::Situ;
use std::arch::x86_64::*;

type V = __m512;

/// Bits of the constants `detmath` uses (kept equal by the bit-identity tests).
const LOG2E: u32 = 0x3fb8_aa3b;
const LN2_HI: u32 = 0x3f31_8000;
const LN2_LO: u32 = 0xb95e_8083;
const C: [u32; 6] = [0x3f00_0000, 0x3e2a_aaab, 0x3d2a_aaab, 0x3c08_8889, 0x3ab6_0b61, 0x3950_0d01];
const C8: u32 = 0x37d0_0d01;
const EXP_MAX: u32 = 0x42b1_70a4;
const HALF_LN2: u32 = 0x3eb1_7218;
const RECIP_MAGIC: i32 = 0x7ef3_11c3;
const SIGN: i32 = i32::MIN;

#[target_feature(enable = "avx512f")]
#[inline]
fn k(bits: u32) -> V {
    _mm512_set1_ps(f32::from_bits(bits))
}

#[target_feature(enable = "avx512f")]
#[inline]
fn kf(v: f32) -> V {
    _mm512_set1_ps(v)
}

#[target_feature(enable = "avx512f")]
#[inline]
fn fma(a: V, b: V, c: V) -> V {
    _mm512_fmadd_ps(a, b, c)
}

/// -x (the sign bit flipped, as scalar negation).
#[target_feature(enable = "avx512f")]
#[inline]
fn neg(x: V) -> V {
    _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(SIGN)))
}

/// |v| with the sign of `s` (`f32::copysign`).
#[target_feature(enable = "avx512f")]
#[inline]
fn copysign(v: V, s: V) -> V {
    let sign = _mm512_set1_epi32(SIGN);
    let mag = _mm512_andnot_si512(sign, _mm512_castps_si512(v));
    _mm512_castsi512_ps(_mm512_or_si512(mag, _mm512_and_si512(sign, _mm512_castps_si512(s))))
}

#[target_feature(enable = "avx512f")]
#[inline]
fn is_nan(x: V) -> __mmask16 {
    _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x)
}

/// `detmath::exp_body`.
#[target_feature(enable = "avx512f")]
#[inline]
fn exp(x: V) -> V {
    let kr = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(fma(x, k(LOG2E), kf(0.5)));
    let r = fma(kr, kf(-f32::from_bits(LN2_HI)), x);
    let r = fma(kr, kf(-f32::from_bits(LN2_LO)), r);
    let mut p = k(C[5]);
    p = fma(p, r, k(C[4]));
    p = fma(p, r, k(C[3]));
    p = fma(p, r, k(C[2]));
    p = fma(p, r, k(C[1]));
    p = fma(p, r, k(C[0]));
    p = fma(p, r, kf(1.0));
    p = fma(p, r, kf(1.0));
    // kr is integral on every lane that keeps this value (|kf| <= 128).
    let ki = _mm512_cvtps_epi32(kr);
    let v = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32::<23>(ki)));
    let v = _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, k(EXP_MAX)), kf(f32::INFINITY));
    let v = _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, kf(-87.0)), kf(0.0));
    _mm512_mask_mov_ps(v, is_nan(x), x)
}

/// `detmath::recip`.
#[target_feature(enable = "avx512f")]
#[inline]
fn recip(b: V) -> V {
    let mut r = _mm512_castsi512_ps(_mm512_sub_epi32(_mm512_set1_epi32(RECIP_MAGIC), _mm512_castps_si512(b)));
    let nb = neg(b);
    for _ in 0..4 {
        let e = fma(nb, r, kf(1.0));
        r = fma(r, e, r);
    }
    r
}

/// `detmath::div_body` with the divisor's reciprocal `r = recip(b)` given.
#[target_feature(enable = "avx512f")]
#[inline]
fn div_r(a: V, b: V, r: V) -> V {
    let q = _mm512_mul_ps(a, r);
    let rem = fma(neg(q), b, a);
    fma(rem, r, q)
}

/// `detmath::tanh_body`.
#[target_feature(enable = "avx512f")]
#[inline]
fn tanh(x: V) -> V {
    let a = _mm512_castsi512_ps(_mm512_andnot_si512(_mm512_set1_epi32(SIGN), _mm512_castps_si512(x)));
    let y = _mm512_mul_ps(kf(2.0), a);
    // expm1_small_over_x(y)
    let mut p = k(C8);
    for c in [C[5], C[4], C[3], C[2], C[1], C[0]] {
        p = fma(p, y, k(c));
    }
    let p = fma(p, y, kf(1.0));
    let e = exp(y);
    let small = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(y, k(HALF_LN2));
    let m = _mm512_mask_mov_ps(_mm512_sub_ps(e, kf(1.0)), small, _mm512_mul_ps(p, y));
    let d = _mm512_mask_mov_ps(_mm512_add_ps(e, kf(1.0)), small, fma(p, y, kf(2.0)));
    let v = copysign(div_r(m, d, recip(d)), x);
    let v = _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(m, kf(0.0)), x);
    let v = _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask::<_CMP_GT_OQ>(a, kf(9.0)), copysign(kf(1.0), x));
    _mm512_mask_mov_ps(v, is_nan(x), x)
}

/// `detmath::sigmoid_body`: one exp, of x where x < -80 (the result) and of -x elsewhere.
#[target_feature(enable = "avx512f")]
#[inline]
fn sigmoid(x: V) -> V {
    let low = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, kf(-80.0));
    let e = exp(_mm512_mask_mov_ps(neg(x), low, x));
    let d = _mm512_add_ps(kf(1.0), e);
    let v = _mm512_mask_mov_ps(div_r(kf(1.0), d, recip(d)), low, e);
    _mm512_mask_mov_ps(v, is_nan(x), x)
}

/// out[i] = s.apply(gate[i], up[i]) (see the module contract).
///
/// # Safety
/// Requires avx512f; the three slices have the same length.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn situ_rows_avx512(s: Situ, gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = out.len();
    let full = n / 16 * 16;
    let beta = kf(s.beta);
    let lbeta = kf(s.linear_beta);
    // div(x, b) computes recip(b) first; b is the same for every element.
    let rb = recip(beta);
    let rlb = recip(lbeta);
    for i in (0..full).step_by(16) {
        // SAFETY: i + 16 <= n for all three slices.
        let (g, u) = unsafe { (_mm512_loadu_ps(gate.as_ptr().add(i)), _mm512_loadu_ps(up.as_ptr().add(i))) };
        let a = _mm512_mul_ps(_mm512_mul_ps(beta, tanh(div_r(g, beta, rb))), sigmoid(g));
        let b = if s.linear_beta > 0.0 { _mm512_mul_ps(lbeta, tanh(div_r(u, lbeta, rlb))) } else { u };
        // SAFETY: as above.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(i), _mm512_mul_ps(a, b)) };
    }
    for i in full..n {
        out[i] = s.apply(gate[i], up[i]);
    }
}

/// The same with AVX2 and FMA, eight elements at a time (masks are compare results, selection is
/// `blendv`).
mod avx2 {
    use super::{C, C8, EXP_MAX, HALF_LN2, LN2_HI, LN2_LO, LOG2E, RECIP_MAGIC, SIGN, Situ};
    use std::arch::x86_64::*;

    type V = __m256;

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn k(bits: u32) -> V {
        _mm256_set1_ps(f32::from_bits(bits))
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn kf(v: f32) -> V {
        _mm256_set1_ps(v)
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn fma(a: V, b: V, c: V) -> V {
        _mm256_fmadd_ps(a, b, c)
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn sign() -> V {
        _mm256_castsi256_ps(_mm256_set1_epi32(SIGN))
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn neg(x: V) -> V {
        _mm256_xor_ps(x, sign())
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn copysign(v: V, s: V) -> V {
        _mm256_or_ps(_mm256_andnot_ps(sign(), v), _mm256_and_ps(sign(), s))
    }

    /// `b` where `m` is set, else `a`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn sel(a: V, m: V, b: V) -> V {
        _mm256_blendv_ps(a, b, m)
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn is_nan(x: V) -> V {
        _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x)
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn exp(x: V) -> V {
        let kr = _mm256_round_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(fma(x, k(LOG2E), kf(0.5)));
        let r = fma(kr, kf(-f32::from_bits(LN2_HI)), x);
        let r = fma(kr, kf(-f32::from_bits(LN2_LO)), r);
        let mut p = k(C[5]);
        for c in [C[4], C[3], C[2], C[1], C[0]] {
            p = fma(p, r, k(c));
        }
        p = fma(p, r, kf(1.0));
        p = fma(p, r, kf(1.0));
        let ki = _mm256_cvtps_epi32(kr);
        let v = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32::<23>(ki)));
        let v = sel(v, _mm256_cmp_ps::<_CMP_GT_OQ>(x, k(EXP_MAX)), kf(f32::INFINITY));
        let v = sel(v, _mm256_cmp_ps::<_CMP_LT_OQ>(x, kf(-87.0)), kf(0.0));
        sel(v, is_nan(x), x)
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn recip(b: V) -> V {
        let mut r = _mm256_castsi256_ps(_mm256_sub_epi32(_mm256_set1_epi32(RECIP_MAGIC), _mm256_castps_si256(b)));
        let nb = neg(b);
        for _ in 0..4 {
            let e = fma(nb, r, kf(1.0));
            r = fma(r, e, r);
        }
        r
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn div_r(a: V, b: V, r: V) -> V {
        let q = _mm256_mul_ps(a, r);
        let rem = fma(neg(q), b, a);
        fma(rem, r, q)
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn tanh(x: V) -> V {
        let a = _mm256_andnot_ps(sign(), x);
        let y = _mm256_mul_ps(kf(2.0), a);
        let mut p = k(C8);
        for c in [C[5], C[4], C[3], C[2], C[1], C[0]] {
            p = fma(p, y, k(c));
        }
        let p = fma(p, y, kf(1.0));
        let e = exp(y);
        let small = _mm256_cmp_ps::<_CMP_LE_OQ>(y, k(HALF_LN2));
        let m = sel(_mm256_sub_ps(e, kf(1.0)), small, _mm256_mul_ps(p, y));
        let d = sel(_mm256_add_ps(e, kf(1.0)), small, fma(p, y, kf(2.0)));
        let v = copysign(div_r(m, d, recip(d)), x);
        let v = sel(v, _mm256_cmp_ps::<_CMP_EQ_OQ>(m, kf(0.0)), x);
        let v = sel(v, _mm256_cmp_ps::<_CMP_GT_OQ>(a, kf(9.0)), copysign(kf(1.0), x));
        sel(v, is_nan(x), x)
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn sigmoid(x: V) -> V {
        let low = _mm256_cmp_ps::<_CMP_LT_OQ>(x, kf(-80.0));
        let e = exp(sel(neg(x), low, x));
        let d = _mm256_add_ps(kf(1.0), e);
        let v = sel(div_r(kf(1.0), d, recip(d)), low, e);
        sel(v, is_nan(x), x)
    }

    /// # Safety
    /// Requires avx2 and fma; the three slices have the same length.
    #[target_feature(enable = "avx2,fma")]
    pub(in super::super) unsafe fn situ_rows_avx2(s: Situ, gate: &[f32], up: &[f32], out: &mut [f32]) {
        let n = out.len();
        let full = n / 8 * 8;
        let beta = kf(s.beta);
        let lbeta = kf(s.linear_beta);
        let rb = recip(beta);
        let rlb = recip(lbeta);
        for i in (0..full).step_by(8) {
            // SAFETY: i + 8 <= n for all three slices.
            let (g, u) = unsafe { (_mm256_loadu_ps(gate.as_ptr().add(i)), _mm256_loadu_ps(up.as_ptr().add(i))) };
            let a = _mm256_mul_ps(_mm256_mul_ps(beta, tanh(div_r(g, beta, rb))), sigmoid(g));
            let b = if s.linear_beta > 0.0 { _mm256_mul_ps(lbeta, tanh(div_r(u, lbeta, rlb))) } else { u };
            // SAFETY: as above.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(a, b)) };
        }
        for i in full..n {
            out[i] = s.apply(gate[i], up[i]);
        }
    }
}
pub(super) use avx2::situ_rows_avx2;
