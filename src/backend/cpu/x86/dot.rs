//! The primitive dot kernels with AVX-512 and AVX2 (bf16, f32 and MXFP4 rows against one input,
//! one f32 pair) and the AVX-512 row decoders that a band of a matrix-matrix product is decoded
//! with.
//!
//! Contract (the folder's, `x86/mod.rs`): each kernel gives the scalar reference's bits
//! (`cpu/scalar.rs`), reading only the slices it is given.

use super::{bf16x16_512, pad_bf16, pad_f32, reduce256, reduce512};
use crate::backend::cpu::{E2M1, LANES, e8m0};
use std::arch::x86_64::*;

// ---- AVX-512 ------------------------------------------------------------------------------

/// # Safety
/// Requires avx512f; each `w[r]` holds exactly `2 * x.len()` bytes.
#[target_feature(enable = "avx512f")]
pub(in crate::backend::cpu) unsafe fn dot4_bf16_avx512(w: [&[u8]; 4], x: &[f32]) -> [f32; 4] {
    let n = x.len();
    let full = n / LANES;
    let mut a0 = _mm512_setzero_ps();
    let mut a1 = _mm512_setzero_ps();
    let mut a2 = _mm512_setzero_ps();
    let mut a3 = _mm512_setzero_ps();
    let xp = x.as_ptr();
    let wp = w.map(|r| r.as_ptr());
    for c in 0..full {
        // SAFETY: c * 16 + 16 <= n elements for x and 2n bytes for each weight row.
        unsafe {
            let xv = _mm512_loadu_ps(xp.add(c * LANES));
            a0 = _mm512_fmadd_ps(bf16x16_512(wp[0].add(c * 32)), xv, a0);
            a1 = _mm512_fmadd_ps(bf16x16_512(wp[1].add(c * 32)), xv, a1);
            a2 = _mm512_fmadd_ps(bf16x16_512(wp[2].add(c * 32)), xv, a2);
            a3 = _mm512_fmadd_ps(bf16x16_512(wp[3].add(c * 32)), xv, a3);
        }
    }
    if !n.is_multiple_of(LANES) {
        let xb = pad_f32(x, full * LANES);
        let wb = w.map(|r| pad_bf16(r, full * LANES));
        // SAFETY: the padded buffers hold 16 elements each.
        unsafe {
            let xv = _mm512_loadu_ps(xb.as_ptr());
            a0 = _mm512_fmadd_ps(bf16x16_512(wb[0].as_ptr() as *const u8), xv, a0);
            a1 = _mm512_fmadd_ps(bf16x16_512(wb[1].as_ptr() as *const u8), xv, a1);
            a2 = _mm512_fmadd_ps(bf16x16_512(wb[2].as_ptr() as *const u8), xv, a2);
            a3 = _mm512_fmadd_ps(bf16x16_512(wb[3].as_ptr() as *const u8), xv, a3);
        }
    }
    // SAFETY: avx512f is enabled for this function.
    unsafe { [reduce512(a0), reduce512(a1), reduce512(a2), reduce512(a3)] }
}

/// # Safety
/// Requires avx512f; every `b[r]` has `a.len()` elements.
#[target_feature(enable = "avx512f")]
pub(in crate::backend::cpu) unsafe fn dot4_f32_avx512(a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
    let n = a.len();
    let full = n / LANES;
    let mut a0 = _mm512_setzero_ps();
    let mut a1 = _mm512_setzero_ps();
    let mut a2 = _mm512_setzero_ps();
    let mut a3 = _mm512_setzero_ps();
    let ap = a.as_ptr();
    let bp = b.map(|r| r.as_ptr());
    for c in 0..full {
        // SAFETY: c * 16 + 16 <= n for every operand.
        unsafe {
            let av = _mm512_loadu_ps(ap.add(c * LANES));
            a0 = _mm512_fmadd_ps(av, _mm512_loadu_ps(bp[0].add(c * LANES)), a0);
            a1 = _mm512_fmadd_ps(av, _mm512_loadu_ps(bp[1].add(c * LANES)), a1);
            a2 = _mm512_fmadd_ps(av, _mm512_loadu_ps(bp[2].add(c * LANES)), a2);
            a3 = _mm512_fmadd_ps(av, _mm512_loadu_ps(bp[3].add(c * LANES)), a3);
        }
    }
    if !n.is_multiple_of(LANES) {
        let ab = pad_f32(a, full * LANES);
        let bb = b.map(|r| pad_f32(r, full * LANES));
        // SAFETY: padded buffers hold 16 elements.
        unsafe {
            let av = _mm512_loadu_ps(ab.as_ptr());
            a0 = _mm512_fmadd_ps(av, _mm512_loadu_ps(bb[0].as_ptr()), a0);
            a1 = _mm512_fmadd_ps(av, _mm512_loadu_ps(bb[1].as_ptr()), a1);
            a2 = _mm512_fmadd_ps(av, _mm512_loadu_ps(bb[2].as_ptr()), a2);
            a3 = _mm512_fmadd_ps(av, _mm512_loadu_ps(bb[3].as_ptr()), a3);
        }
    }
    // SAFETY: avx512f is enabled for this function.
    unsafe { [reduce512(a0), reduce512(a1), reduce512(a2), reduce512(a3)] }
}

/// # Safety
/// Requires avx512f; `a` and `b` have the same length.
#[target_feature(enable = "avx512f")]
pub(in crate::backend::cpu) unsafe fn dot1_f32_avx512(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let full = n / LANES;
    let mut acc = _mm512_setzero_ps();
    for c in 0..full {
        // SAFETY: c * 16 + 16 <= n for both operands.
        unsafe {
            acc = _mm512_fmadd_ps(
                _mm512_loadu_ps(a.as_ptr().add(c * LANES)),
                _mm512_loadu_ps(b.as_ptr().add(c * LANES)),
                acc,
            );
        }
    }
    if !n.is_multiple_of(LANES) {
        let ab = pad_f32(a, full * LANES);
        let bb = pad_f32(b, full * LANES);
        // SAFETY: padded buffers hold 16 elements.
        unsafe {
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(ab.as_ptr()), _mm512_loadu_ps(bb.as_ptr()), acc);
        }
    }
    // SAFETY: avx512f is enabled for this function.
    unsafe { reduce512(acc) }
}

/// # Safety
/// Requires avx2 and fma; `a` and `b` have the same length.
#[target_feature(enable = "avx2,fma")]
pub(in crate::backend::cpu) unsafe fn dot1_f32_avx2(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let full = n / LANES;
    let mut lo = _mm256_setzero_ps();
    let mut hi = _mm256_setzero_ps();
    let mut step = |ap: *const f32, bp: *const f32| {
        // SAFETY: callers pass 16 readable floats at both pointers.
        unsafe {
            lo = _mm256_fmadd_ps(_mm256_loadu_ps(ap), _mm256_loadu_ps(bp), lo);
            hi = _mm256_fmadd_ps(_mm256_loadu_ps(ap.add(8)), _mm256_loadu_ps(bp.add(8)), hi);
        }
    };
    for c in 0..full {
        // SAFETY: c * 16 + 16 <= n for both operands.
        unsafe { step(a.as_ptr().add(c * LANES), b.as_ptr().add(c * LANES)) };
    }
    if !n.is_multiple_of(LANES) {
        let ab = pad_f32(a, full * LANES);
        let bb = pad_f32(b, full * LANES);
        step(ab.as_ptr(), bb.as_ptr());
    }
    // SAFETY: avx is implied by avx2.
    unsafe { reduce256(_mm256_add_ps(lo, hi)) }
}

/// One 32-input MXFP4 block of one row: acc += lo * xe; acc += hi * xo (dequantised in-register).
#[target_feature(enable = "avx512f")]
unsafe fn mxfp4_block_512(p: *const u8, scale: u8, lut: __m512, xe: __m512, xo: __m512, acc: __m512) -> __m512 {
    // SAFETY: caller guarantees 16 readable bytes at p.
    let codes = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(p as *const __m128i) });
    let s = _mm512_set1_ps(e8m0(scale));
    let lo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(codes, _mm512_set1_epi32(15)), lut), s);
    let hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), lut), s);
    _mm512_fmadd_ps(hi, xo, _mm512_fmadd_ps(lo, xe, acc))
}

/// # Safety
/// Requires avx512f; `xd.len()` is a multiple of 32 and matches every row (2 codes a byte, one
/// scale per 32 inputs).
#[target_feature(enable = "avx512f")]
pub(in crate::backend::cpu) unsafe fn dot4_mxfp4_avx512(w: [(&[u8], &[u8]); 4], xd: &[f32]) -> [f32; 4] {
    // SAFETY: E2M1 holds 16 f32.
    let lut = unsafe { _mm512_loadu_ps(E2M1.as_ptr()) };
    let mut acc = [_mm512_setzero_ps(); 4];
    for b in 0..xd.len() / 32 {
        // SAFETY: block b lies inside xd (32 floats) and inside each row (16 bytes, 1 scale).
        unsafe {
            let xe = _mm512_loadu_ps(xd.as_ptr().add(b * 32));
            let xo = _mm512_loadu_ps(xd.as_ptr().add(b * 32 + 16));
            for r in 0..4 {
                acc[r] = mxfp4_block_512(w[r].0.as_ptr().add(b * 16), w[r].1[b], lut, xe, xo, acc[r]);
            }
        }
    }
    // SAFETY: avx512f is enabled for this function.
    unsafe { acc.map(|a| reduce512(a)) }
}

/// Dequantises one MXFP4 row into the deinterleaved order (same values as the scalar decoder).
///
/// # Safety
/// Requires avx512f; `out.len() == 2 * packed.len() == 32 * scales.len()`.
#[target_feature(enable = "avx512f")]
pub(in crate::backend::cpu) unsafe fn decode_mxfp4_row_avx512(packed: &[u8], scales: &[u8], out: &mut [f32]) {
    // SAFETY: E2M1 holds 16 f32.
    let lut = unsafe { _mm512_loadu_ps(E2M1.as_ptr()) };
    for (b, &scale) in scales.iter().enumerate() {
        // SAFETY: block b lies inside packed (16 bytes) and out (32 floats).
        unsafe {
            let codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(packed.as_ptr().add(b * 16) as *const __m128i));
            let s = _mm512_set1_ps(e8m0(scale));
            let lo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(codes, _mm512_set1_epi32(15)), lut), s);
            let hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), lut), s);
            _mm512_storeu_ps(out.as_mut_ptr().add(b * 32), lo);
            _mm512_storeu_ps(out.as_mut_ptr().add(b * 32 + 16), hi);
        }
    }
}

/// Converts one bf16 row to f32.
///
/// # Safety
/// Requires avx512f; `row.len() == 2 * out.len()`.
#[target_feature(enable = "avx512f")]
pub(in crate::backend::cpu) unsafe fn decode_bf16_row_avx512(row: &[u8], out: &mut [f32]) {
    let n = out.len();
    let full = n / LANES;
    for c in 0..full {
        // SAFETY: c * 16 + 16 <= n.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(c * LANES), bf16x16_512(row.as_ptr().add(c * 32))) };
    }
    for i in full * LANES..n {
        out[i] = f32::from_bits((u16::from_le_bytes([row[2 * i], row[2 * i + 1]]) as u32) << 16);
    }
}

// ---- AVX2 ---------------------------------------------------------------------------------

#[target_feature(enable = "avx2")]
unsafe fn bf16x8_256(p: *const u8) -> __m256 {
    // SAFETY: caller guarantees 16 readable bytes at p.
    let raw = unsafe { _mm_loadu_si128(p as *const __m128i) };
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))
}

/// # Safety
/// Requires avx2 and fma; each `w[r]` holds exactly `2 * x.len()` bytes.
#[target_feature(enable = "avx2,fma")]
pub(in crate::backend::cpu) unsafe fn dot4_bf16_avx2(w: [&[u8]; 4], x: &[f32]) -> [f32; 4] {
    let n = x.len();
    let full = n / LANES;
    let mut lo = [_mm256_setzero_ps(); 4];
    let mut hi = [_mm256_setzero_ps(); 4];
    let step = |wp: [*const u8; 4], xp: *const f32, lo: &mut [__m256; 4], hi: &mut [__m256; 4]| {
        // SAFETY: callers pass 16 readable floats at xp and 32 readable bytes at each wp.
        unsafe {
            let x0 = _mm256_loadu_ps(xp);
            let x1 = _mm256_loadu_ps(xp.add(8));
            for r in 0..4 {
                lo[r] = _mm256_fmadd_ps(bf16x8_256(wp[r]), x0, lo[r]);
                hi[r] = _mm256_fmadd_ps(bf16x8_256(wp[r].add(16)), x1, hi[r]);
            }
        }
    };
    for c in 0..full {
        // SAFETY: pointers stay inside the rows: c * 16 + 16 <= n.
        let wp = w.map(|r| unsafe { r.as_ptr().add(c * 32) });
        // SAFETY: as above for x.
        step(wp, unsafe { x.as_ptr().add(c * LANES) }, &mut lo, &mut hi);
    }
    if !n.is_multiple_of(LANES) {
        let xb = pad_f32(x, full * LANES);
        let wb = w.map(|r| pad_bf16(r, full * LANES));
        step(wb.each_ref().map(|b| b.as_ptr() as *const u8), xb.as_ptr(), &mut lo, &mut hi);
    }
    // SAFETY: avx is implied by avx2.
    std::array::from_fn(|r| unsafe { reduce256(_mm256_add_ps(lo[r], hi[r])) })
}

/// # Safety
/// Requires avx2 and fma; every `b[r]` has `a.len()` elements.
#[target_feature(enable = "avx2,fma")]
pub(in crate::backend::cpu) unsafe fn dot4_f32_avx2(a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
    let n = a.len();
    let full = n / LANES;
    let mut lo = [_mm256_setzero_ps(); 4];
    let mut hi = [_mm256_setzero_ps(); 4];
    let step = |ap: *const f32, bp: [*const f32; 4], lo: &mut [__m256; 4], hi: &mut [__m256; 4]| {
        // SAFETY: callers pass 16 readable floats at every pointer.
        unsafe {
            let a0 = _mm256_loadu_ps(ap);
            let a1 = _mm256_loadu_ps(ap.add(8));
            for r in 0..4 {
                lo[r] = _mm256_fmadd_ps(a0, _mm256_loadu_ps(bp[r]), lo[r]);
                hi[r] = _mm256_fmadd_ps(a1, _mm256_loadu_ps(bp[r].add(8)), hi[r]);
            }
        }
    };
    for c in 0..full {
        // SAFETY: c * 16 + 16 <= n for every operand.
        let bp = b.map(|r| unsafe { r.as_ptr().add(c * LANES) });
        // SAFETY: as above.
        step(unsafe { a.as_ptr().add(c * LANES) }, bp, &mut lo, &mut hi);
    }
    if !n.is_multiple_of(LANES) {
        let ab = pad_f32(a, full * LANES);
        let bb = b.map(|r| pad_f32(r, full * LANES));
        step(ab.as_ptr(), bb.each_ref().map(|x| x.as_ptr()), &mut lo, &mut hi);
    }
    // SAFETY: avx is implied by avx2.
    std::array::from_fn(|r| unsafe { reduce256(_mm256_add_ps(lo[r], hi[r])) })
}

/// E2M1 lookup for eight 32-bit codes: magnitude from an 8-entry table, sign from bit 3.
#[target_feature(enable = "avx2")]
unsafe fn e2m1x8(codes: __m256i, mag: __m256) -> __m256 {
    let m = _mm256_permutevar8x32_ps(mag, _mm256_and_si256(codes, _mm256_set1_epi32(7)));
    let sign = _mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(8)), 28);
    _mm256_xor_ps(m, _mm256_castsi256_ps(sign))
}

/// # Safety
/// Requires avx2 and fma; `xd.len()` is a multiple of 32 and matches every row.
#[target_feature(enable = "avx2,fma")]
pub(in crate::backend::cpu) unsafe fn dot4_mxfp4_avx2(w: [(&[u8], &[u8]); 4], xd: &[f32]) -> [f32; 4] {
    // SAFETY: E2M1 holds 16 f32; the first 8 are the magnitudes.
    let mag = unsafe { _mm256_loadu_ps(E2M1.as_ptr()) };
    let mut lo = [_mm256_setzero_ps(); 4];
    let mut hi = [_mm256_setzero_ps(); 4];
    for b in 0..xd.len() / 32 {
        // SAFETY: block b lies inside xd (32 floats) and inside each row (16 bytes, 1 scale).
        unsafe {
            let xp = xd.as_ptr().add(b * 32);
            let xe0 = _mm256_loadu_ps(xp);
            let xe1 = _mm256_loadu_ps(xp.add(8));
            let xo0 = _mm256_loadu_ps(xp.add(16));
            let xo1 = _mm256_loadu_ps(xp.add(24));
            for r in 0..4 {
                let bytes = _mm_loadu_si128(w[r].0.as_ptr().add(b * 16) as *const __m128i);
                let c0 = _mm256_cvtepu8_epi32(bytes);
                let c1 = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
                let s = _mm256_set1_ps(e8m0(w[r].1[b]));
                let lo0 = _mm256_mul_ps(e2m1x8(_mm256_and_si256(c0, _mm256_set1_epi32(15)), mag), s);
                let lo1 = _mm256_mul_ps(e2m1x8(_mm256_and_si256(c1, _mm256_set1_epi32(15)), mag), s);
                let hi0 = _mm256_mul_ps(e2m1x8(_mm256_srli_epi32(c0, 4), mag), s);
                let hi1 = _mm256_mul_ps(e2m1x8(_mm256_srli_epi32(c1, 4), mag), s);
                lo[r] = _mm256_fmadd_ps(hi0, xo0, _mm256_fmadd_ps(lo0, xe0, lo[r]));
                hi[r] = _mm256_fmadd_ps(hi1, xo1, _mm256_fmadd_ps(lo1, xe1, hi[r]));
            }
        }
    }
    // SAFETY: avx is implied by avx2.
    std::array::from_fn(|r| unsafe { reduce256(_mm256_add_ps(lo[r], hi[r])) })
}
