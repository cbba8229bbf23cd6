//! SiTU (`Situ::apply`) four elements at a time with NEON: the scalar definition's operations
//! (`backend::detmath`'s `exp`, `tanh`, `sigmoid` and `div`, then the products), each the same
//! correctly rounded f32 operation in the same order, lane by lane; the scalar code's branches
//! become every path computed and the lane's own one selected by a compare mask (`vbslq`). So every
//! output has the scalar function's bits (NaN inputs give NaN). A tail shorter than a vector runs
//! the scalar code itself. The same construction as `situ_x86.rs`, line for line.

use crate::backend::types::Situ;
use std::arch::aarch64::*;

type V = float32x4_t;
type M = uint32x4_t;

/// Bits of the constants `detmath` uses (kept equal by the bit-identity tests).
const LOG2E: u32 = 0x3fb8_aa3b;
const LN2_HI: u32 = 0x3f31_8000;
const LN2_LO: u32 = 0xb95e_8083;
const C: [u32; 6] = [0x3f00_0000, 0x3e2a_aaab, 0x3d2a_aaab, 0x3c08_8889, 0x3ab6_0b61, 0x3950_0d01];
const C8: u32 = 0x37d0_0d01;
const EXP_MAX: u32 = 0x42b1_70a4;
const HALF_LN2: u32 = 0x3eb1_7218;
const RECIP_MAGIC: u32 = 0x7ef3_11c3;
const SIGN: u32 = 0x8000_0000;

#[target_feature(enable = "neon")]
#[inline]
fn k(bits: u32) -> V {
    vreinterpretq_f32_u32(vdupq_n_u32(bits))
}

#[target_feature(enable = "neon")]
#[inline]
fn kf(v: f32) -> V {
    vdupq_n_f32(v)
}

/// fma(a, b, c) = a * b + c, one rounding (the scalar `a.mul_add(b, c)`).
#[target_feature(enable = "neon")]
#[inline]
fn fma(a: V, b: V, c: V) -> V {
    vfmaq_f32(c, a, b)
}

/// `b` where `m` is set, else `a`.
#[target_feature(enable = "neon")]
#[inline]
fn sel(a: V, m: M, b: V) -> V {
    vbslq_f32(m, b, a)
}

/// |v| with the sign of `s` (`f32::copysign`).
#[target_feature(enable = "neon")]
#[inline]
fn copysign(v: V, s: V) -> V {
    vbslq_f32(vdupq_n_u32(SIGN), s, v)
}

#[target_feature(enable = "neon")]
#[inline]
fn is_nan(x: V) -> M {
    vmvnq_u32(vceqq_f32(x, x))
}

/// `detmath::exp_body`.
#[target_feature(enable = "neon")]
#[inline]
fn exp(x: V) -> V {
    let kr = vrndmq_f32(fma(x, k(LOG2E), kf(0.5)));
    let r = fma(kr, kf(-f32::from_bits(LN2_HI)), x);
    let r = fma(kr, kf(-f32::from_bits(LN2_LO)), r);
    let mut p = k(C[5]);
    for c in [C[4], C[3], C[2], C[1], C[0]] {
        p = fma(p, r, k(c));
    }
    p = fma(p, r, kf(1.0));
    p = fma(p, r, kf(1.0));
    // kr is integral on every lane that keeps this value (|kr| <= 128): truncation is exact.
    let ki = vreinterpretq_u32_s32(vcvtq_s32_f32(kr));
    let v = vreinterpretq_f32_u32(vaddq_u32(vreinterpretq_u32_f32(p), vshlq_n_u32::<23>(ki)));
    let v = sel(v, vcgtq_f32(x, k(EXP_MAX)), kf(f32::INFINITY));
    let v = sel(v, vcltq_f32(x, kf(-87.0)), kf(0.0));
    sel(v, is_nan(x), x)
}

/// `detmath::recip`.
#[target_feature(enable = "neon")]
#[inline]
fn recip(b: V) -> V {
    let mut r = vreinterpretq_f32_u32(vsubq_u32(vdupq_n_u32(RECIP_MAGIC), vreinterpretq_u32_f32(b)));
    let nb = vnegq_f32(b);
    for _ in 0..4 {
        let e = fma(nb, r, kf(1.0));
        r = fma(r, e, r);
    }
    r
}

/// `detmath::div_body` with the divisor's reciprocal `r = recip(b)` given.
#[target_feature(enable = "neon")]
#[inline]
fn div_r(a: V, b: V, r: V) -> V {
    let q = vmulq_f32(a, r);
    let rem = fma(vnegq_f32(q), b, a);
    fma(rem, r, q)
}

/// `detmath::tanh_body`.
#[target_feature(enable = "neon")]
#[inline]
fn tanh(x: V) -> V {
    let a = vabsq_f32(x);
    let y = vmulq_f32(kf(2.0), a);
    // expm1_small_over_x(y)
    let mut p = k(C8);
    for c in [C[5], C[4], C[3], C[2], C[1], C[0]] {
        p = fma(p, y, k(c));
    }
    let p = fma(p, y, kf(1.0));
    let e = exp(y);
    let small = vcleq_f32(y, k(HALF_LN2));
    let m = sel(vsubq_f32(e, kf(1.0)), small, vmulq_f32(p, y));
    let d = sel(vaddq_f32(e, kf(1.0)), small, fma(p, y, kf(2.0)));
    let v = copysign(div_r(m, d, recip(d)), x);
    let v = sel(v, vceqq_f32(m, kf(0.0)), x);
    let v = sel(v, vcgtq_f32(a, kf(9.0)), copysign(kf(1.0), x));
    sel(v, is_nan(x), x)
}

/// `detmath::sigmoid_body`: one exp, of x where x < -80 (the result) and of -x elsewhere.
#[target_feature(enable = "neon")]
#[inline]
fn sigmoid(x: V) -> V {
    let low = vcltq_f32(x, kf(-80.0));
    let e = exp(sel(vnegq_f32(x), low, x));
    let d = vaddq_f32(kf(1.0), e);
    let v = sel(div_r(kf(1.0), d, recip(d)), low, e);
    sel(v, is_nan(x), x)
}

/// out[i] = s.apply(gate[i], up[i]) (see the module contract).
///
/// # Safety
/// Requires neon; the three slices have the same length.
#[target_feature(enable = "neon")]
#[inline(never)]
pub(in crate::backend::cpu) unsafe fn situ_rows(s: Situ, gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = out.len();
    let full = n / 4 * 4;
    let beta = kf(s.beta);
    let lbeta = kf(s.linear_beta);
    // div(x, b) computes recip(b) first; b is the same for every element.
    let rb = recip(beta);
    let rlb = recip(lbeta);
    for i in (0..full).step_by(4) {
        // SAFETY: i + 4 <= n for all three slices.
        let (g, u) = unsafe { (vld1q_f32(gate.as_ptr().add(i)), vld1q_f32(up.as_ptr().add(i))) };
        let a = vmulq_f32(vmulq_f32(beta, tanh(div_r(g, beta, rb))), sigmoid(g));
        let b = if s.linear_beta > 0.0 { vmulq_f32(lbeta, tanh(div_r(u, lbeta, rlb))) } else { u };
        // SAFETY: as above.
        unsafe { vst1q_f32(out.as_mut_ptr().add(i), vmulq_f32(a, b)) };
    }
    for i in full..n {
        out[i] = s.apply(gate[i], up[i]);
    }
}
