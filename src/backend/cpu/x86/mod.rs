//! AVX-512 and AVX2 (x86-64) forms of the CPU kernel families: the dot products and the row
//! decoders (`dot.rs`), the tiled multi-row f32 and register-decoded MXFP4 products (`tiled.rs`),
//! SiTU's lanes (`situ.rs`), the coded trunk's block decoder and the matrix-vector product that
//! decodes into its FMAs (`coded.rs`), and the FMA peak loops (here). The int8 trunk has no x86
//! form of its own (`cpu::coded` expands its rows for `dot4_f32`). `cpu/dispatch.rs` puts them in
//! the families' tables; `cpu/families.rs` lists them beside the NEON forms (`cpu/neon/`, the same
//! file names).
//!
//! Contract: each kernel repeats the scalar reference's operations exactly. AVX-512 holds the 16
//! lanes of an accumulator in one register, AVX2 in two (lanes 0..8 and 8..16); a lane only ever
//! meets the values of its own elements, in element order, through a fused multiply-add (the
//! scalar `mul_add`); tails are zero-padded through a stack buffer as the reference pads them; the
//! horizontal sum is the tree of `reduce16`. A kernel is a `target_feature` function that runs only
//! where its features were detected: the tables hand it out for an instruction set this CPU runs.

mod coded;
mod dot;
mod situ;
mod tiled;

pub(super) use coded::{decode_blocks_avx512, dot4_coded_avx512, has_avx512_decode};
pub(super) use dot::{
    decode_bf16_row_avx512, decode_mxfp4_row_avx512, dot1_f32_avx2, dot1_f32_avx512, dot4_bf16_avx2, dot4_bf16_avx512,
    dot4_f32_avx2, dot4_f32_avx512, dot4_mxfp4_avx2, dot4_mxfp4_avx512,
};
pub(super) use situ::{situ_rows_avx2, situ_rows_avx512};
pub(super) use tiled::{dot4x4_f32_avx512, dot4x4_tile_avx512, dot4xn_mxfp4_avx512};

use super::LANES;
use std::arch::x86_64::*;

/// `reduce16`'s tree on the 8 lanes (i, i+8) already summed: (i, i+4), (i, i+2), (i, i+1).
#[target_feature(enable = "avx")]
unsafe fn reduce256(v8: __m256) -> f32 {
    let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
    let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
    let v1 = _mm_add_ss(v2, _mm_shuffle_ps(v2, v2, 1));
    _mm_cvtss_f32(v1)
}

/// `reduce16`'s tree on the 16 lanes of one register.
#[target_feature(enable = "avx512f")]
unsafe fn reduce512(v: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    // SAFETY: avx512f implies avx.
    unsafe { reduce256(_mm256_add_ps(lo, hi)) }
}

/// Copies the tail `src[start..]` (fewer than 16 elements) into a zero-padded lane buffer.
#[inline(always)]
fn pad_f32(src: &[f32], start: usize) -> [f32; LANES] {
    let mut b = [0f32; LANES];
    b[..src.len() - start].copy_from_slice(&src[start..]);
    b
}

/// The bf16 values of a row from element `start_elem` (fewer than 16 left), zero-padded to 16.
#[inline(always)]
fn pad_bf16(src: &[u8], start_elem: usize) -> [u16; LANES] {
    let mut b = [0u16; LANES];
    for (i, c) in src[2 * start_elem..].chunks_exact(2).enumerate() {
        b[i] = u16::from_le_bytes([c[0], c[1]]);
    }
    b
}

/// 16 bf16 values (32 bytes, any alignment) at `p` as f32 lanes (exact: bits << 16).
///
/// # Safety
/// 32 readable bytes at `p`.
#[target_feature(enable = "avx512f")]
unsafe fn bf16x16_512(p: *const u8) -> __m512 {
    // SAFETY: caller guarantees 32 readable bytes at p.
    let raw = unsafe { _mm256_loadu_si256(p as *const __m256i) };
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))
}

/// Independent accumulator chains of the FMA peak loops (latency 4 x 2 ports, with room to spare).
pub(super) const PEAK_CHAINS: usize = 12;

/// The FMA peak loop with AVX-512: [`PEAK_CHAINS`] register-resident chains, `iters` FMAs each.
///
/// # Safety
/// Requires avx512f.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn fma_chains_avx512(iters: u64) -> f32 {
    let a = _mm512_set1_ps(0.999_999);
    let b = _mm512_set1_ps(1e-7);
    let mut acc = [_mm512_set1_ps(1.0); PEAK_CHAINS];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm512_fmadd_ps(*x, a, b);
        }
    }
    let mut s = _mm512_setzero_ps();
    for x in acc {
        s = _mm512_add_ps(s, x);
    }
    _mm512_reduce_add_ps(s)
}

/// The FMA peak loop with AVX2 and FMA.
///
/// # Safety
/// Requires avx2 and fma.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn fma_chains_avx2(iters: u64) -> f32 {
    let a = _mm256_set1_ps(0.999_999);
    let b = _mm256_set1_ps(1e-7);
    let mut acc = [_mm256_set1_ps(1.0); PEAK_CHAINS];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm256_fmadd_ps(*x, a, b);
        }
    }
    let mut out = [0f32; 8];
    let mut s = _mm256_setzero_ps();
    for x in acc {
        s = _mm256_add_ps(s, x);
    }
    // SAFETY: `out` holds 8 f32s, what one 256-bit store writes.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), s) };
    out.iter().sum()
}
