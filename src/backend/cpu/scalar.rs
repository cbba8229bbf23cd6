//! Scalar reference kernels: the defining operation order that the SIMD kernels reproduce bit for
//! bit (16 lanes, fused multiply-add per lane, zero-padded tail, `reduce16`), the row decoders'
//! exact values, and the scalar FMA peak loop. Each is a family's portable form in
//! `dispatch.rs`'s tables (SiTU's is in `situ.rs`).

// Lane-indexed loops over several arrays in lockstep read clearer than zipped iterators here.
#![allow(clippy::needless_range_loop)]

use super::{E2M1, LANES, e8m0, reduce16};
use crate::backend::types::MXFP4_BLOCK;

#[inline(always)]
fn bf16_at(row: &[u8], i: usize) -> f32 {
    f32::from_bits((u16::from_le_bytes([row[2 * i], row[2 * i + 1]]) as u32) << 16)
}

pub(super) fn dot4_bf16(w: [&[u8]; 4], x: &[f32]) -> [f32; 4] {
    let n = x.len();
    let mut acc = [[0f32; LANES]; 4];
    for c in 0..n.div_ceil(LANES) {
        for l in 0..LANES {
            let i = c * LANES + l;
            let xi = if i < n { x[i] } else { 0.0 };
            for r in 0..4 {
                let wi = if i < n { bf16_at(w[r], i) } else { 0.0 };
                acc[r][l] = wi.mul_add(xi, acc[r][l]);
            }
        }
    }
    std::array::from_fn(|r| reduce16(&acc[r]))
}

pub(super) fn dot4_f32(a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
    let n = a.len();
    let mut acc = [[0f32; LANES]; 4];
    for c in 0..n.div_ceil(LANES) {
        for l in 0..LANES {
            let i = c * LANES + l;
            let ai = if i < n { a[i] } else { 0.0 };
            for r in 0..4 {
                let bi = if i < n { b[r][i] } else { 0.0 };
                acc[r][l] = ai.mul_add(bi, acc[r][l]);
            }
        }
    }
    std::array::from_fn(|r| reduce16(&acc[r]))
}

pub(super) fn dot1_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let mut acc = [0f32; LANES];
    for c in 0..n.div_ceil(LANES) {
        for l in 0..LANES {
            let i = c * LANES + l;
            let (ai, bi) = if i < n { (a[i], b[i]) } else { (0.0, 0.0) };
            acc[l] = ai.mul_add(bi, acc[l]);
        }
    }
    reduce16(&acc)
}

pub(super) fn dot4_mxfp4(w: [(&[u8], &[u8]); 4], xd: &[f32]) -> [f32; 4] {
    let mut acc = [[0f32; LANES]; 4];
    for (b, xb) in xd.chunks_exact(32).enumerate() {
        for r in 0..4 {
            let s = e8m0(w[r].1[b]);
            let p = &w[r].0[b * 16..b * 16 + 16];
            for j in 0..16 {
                let lo = E2M1[(p[j] & 0x0f) as usize] * s;
                acc[r][j] = lo.mul_add(xb[j], acc[r][j]);
            }
            for j in 0..16 {
                let hi = E2M1[(p[j] >> 4) as usize] * s;
                acc[r][j] = hi.mul_add(xb[16 + j], acc[r][j]);
            }
        }
    }
    std::array::from_fn(|r| reduce16(&acc[r]))
}

/// One MXFP4 row to f32 in the deinterleaved order (exact values).
pub(super) fn decode_mxfp4_row(packed: &[u8], scales: &[u8], out: &mut [f32]) {
    for (b, (pb, ob)) in packed.chunks_exact(16).zip(out.chunks_exact_mut(MXFP4_BLOCK)).enumerate() {
        let s = e8m0(scales[b]);
        for j in 0..16 {
            ob[j] = E2M1[(pb[j] & 0x0f) as usize] * s;
            ob[16 + j] = E2M1[(pb[j] >> 4) as usize] * s;
        }
    }
}

/// One bf16 row to f32 (exact).
pub(super) fn decode_bf16_row(row: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
        *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
    }
}

/// Independent accumulator chains of the scalar FMA peak loop.
pub(super) const PEAK_CHAINS: usize = 12;

/// The FMA peak loop on scalars: [`PEAK_CHAINS`] chains, `iters` FMAs each.
pub(super) fn fma_chains(iters: u64) -> f32 {
    let mut acc = [1.0f32; PEAK_CHAINS];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = x.mul_add(0.999_999, 1e-7);
        }
    }
    acc.iter().sum()
}
