//! The multi-row products with AVX-512: the 4 x 4 f32 tile of a decoded band against four input
//! rows (prefill's matrix-matrix product, `cpu::matmul`'s tiled band), and four MXFP4 rows decoded
//! in registers once for up to four inputs (a decode step's few rows of an expert). AVX2 has no
//! form of these (16 ymm registers cannot hold a 4 x 4 tile): `cpu::matmul` composes them from
//! `dot4_f32` there.
//!
//! Contract (the folder's, `x86/mod.rs`): every output is the bits of the one-row product of its
//! weight row and input row, however the columns are tiled.

use super::{pad_f32, reduce512};
use crate::backend::cpu::{E2M1, LANES, e8m0, reduce16};
use std::arch::x86_64::*;

/// Dots of four MXFP4 weight rows with `NX` deinterleaved input rows: out[r][i] = w[r] . x[i].
/// Each 32-input block of a weight row is decoded into registers once and applied to every input
/// row (no f32 copy of the weights, no decode per input row); each output is the same lanes,
/// values, operations and reduction as `dot4_mxfp4_avx512` on that input alone.
///
/// # Safety
/// Requires avx512f; every `x[i].len()` is the same multiple of 32 and matches every row (2 codes
/// a byte, one scale per 32 inputs).
#[target_feature(enable = "avx512f")]
pub(in crate::backend::cpu) unsafe fn dot4xn_mxfp4_avx512<const NX: usize>(
    w: [(&[u8], &[u8]); 4],
    x: [&[f32]; NX],
) -> [[f32; NX]; 4] {
    // SAFETY: E2M1 holds 16 f32.
    let lut = unsafe { _mm512_loadu_ps(E2M1.as_ptr()) };
    let low = _mm512_set1_epi32(15);
    let mut acc = [[_mm512_setzero_ps(); NX]; 4];
    let xp = x.map(|r| r.as_ptr());
    for b in 0..x[0].len() / 32 {
        // SAFETY: block b lies inside every input (32 floats) and every row (16 bytes, 1 scale).
        unsafe {
            let xe: [__m512; NX] = std::array::from_fn(|i| _mm512_loadu_ps(xp[i].add(b * 32)));
            let xo: [__m512; NX] = std::array::from_fn(|i| _mm512_loadu_ps(xp[i].add(b * 32 + 16)));
            for r in 0..4 {
                let codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(w[r].0.as_ptr().add(b * 16) as *const __m128i));
                let s = _mm512_set1_ps(e8m0(w[r].1[b]));
                let lo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(codes, low), lut), s);
                let hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), lut), s);
                for i in 0..NX {
                    acc[r][i] = _mm512_fmadd_ps(hi, xo[i], _mm512_fmadd_ps(lo, xe[i], acc[r][i]));
                }
            }
        }
    }
    // SAFETY: avx512f is enabled for this function.
    std::array::from_fn(|r| std::array::from_fn(|i| unsafe { reduce512(acc[r][i]) }))
}

/// out[r][i] = dot(w[r], x[i]) for 4 weight rows x 4 input rows: 16 independent accumulators, each
/// in the reference operation order (so every element equals the single-row result).
///
/// # Safety
/// Requires avx512f; all 8 slices have the same length.
#[target_feature(enable = "avx512f")]
pub(in crate::backend::cpu) unsafe fn dot4x4_f32_avx512(w: [&[f32]; 4], x: [&[f32]; 4]) -> [[f32; 4]; 4] {
    // One tile over all columns, from zero accumulators; the lane sums go through the same tree.
    let mut acc = [[0f32; LANES]; 16];
    // SAFETY: avx512f is enabled for this function; the caller checked the lengths.
    unsafe { dot4x4_tile_avx512(w, x, &mut acc) };
    std::array::from_fn(|r| std::array::from_fn(|i| reduce16(&acc[r * 4 + i])))
}

/// [`dot4x4_f32_avx512`] over one tile of the columns, continuing from the lane accumulators in
/// `acc` ([w][x] blocks of 16 lanes) and leaving them there: the same fused multiply-adds in the
/// same order per lane, so cutting the columns into tiles changes no bit. Every tile but the last
/// is a multiple of 16 long; the last one's partial chunk is zero-padded as in the untiled kernel.
///
/// # Safety
/// Requires avx512f; all eight slices have the same length.
#[target_feature(enable = "avx512f")]
pub(in crate::backend::cpu) unsafe fn dot4x4_tile_avx512(w: [&[f32]; 4], x: [&[f32]; 4], acc: &mut [[f32; LANES]; 16]) {
    let n = w[0].len();
    let full = n / LANES;
    // SAFETY: each accumulator block holds 16 floats.
    let mut a: [[__m512; 4]; 4] =
        std::array::from_fn(|r| std::array::from_fn(|i| unsafe { _mm512_loadu_ps(acc[r * 4 + i].as_ptr()) }));
    let wp = w.map(|r| r.as_ptr());
    let xp = x.map(|r| r.as_ptr());
    for c in 0..full {
        let o = c * LANES;
        // SAFETY: o + 16 <= n for every row.
        unsafe {
            let xv = [
                _mm512_loadu_ps(xp[0].add(o)),
                _mm512_loadu_ps(xp[1].add(o)),
                _mm512_loadu_ps(xp[2].add(o)),
                _mm512_loadu_ps(xp[3].add(o)),
            ];
            for r in 0..4 {
                let wv = _mm512_loadu_ps(wp[r].add(o));
                a[r][0] = _mm512_fmadd_ps(wv, xv[0], a[r][0]);
                a[r][1] = _mm512_fmadd_ps(wv, xv[1], a[r][1]);
                a[r][2] = _mm512_fmadd_ps(wv, xv[2], a[r][2]);
                a[r][3] = _mm512_fmadd_ps(wv, xv[3], a[r][3]);
            }
        }
    }
    if !n.is_multiple_of(LANES) {
        let wb = w.map(|r| pad_f32(r, full * LANES));
        let xb = x.map(|r| pad_f32(r, full * LANES));
        // SAFETY: padded buffers hold 16 elements.
        unsafe {
            for r in 0..4 {
                let wv = _mm512_loadu_ps(wb[r].as_ptr());
                for i in 0..4 {
                    a[r][i] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xb[i].as_ptr()), a[r][i]);
                }
            }
        }
    }
    for r in 0..4 {
        for i in 0..4 {
            // SAFETY: each accumulator block holds 16 floats.
            unsafe { _mm512_storeu_ps(acc[r * 4 + i].as_mut_ptr(), a[r][i]) };
        }
    }
}
