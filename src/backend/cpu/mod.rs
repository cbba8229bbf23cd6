//! CPU kernels: bf16 and MXFP4 matrix-vector / matrix-matrix products, norms and activations, and
//! the CPU backend that runs the forward pass on them ([`CpuBackend`], `backend.rs`).
//!
//! Contract: every output element of a product is computed by one fixed sequence of f32 operations —
//! 16 lanes, lane `l` accumulating elements `16c + l` with fused multiply-add, zero-padded tail,
//! then the fixed reduction tree of [`reduce16`]. The scalar reference, AVX2, AVX-512 and NEON
//! kernels all follow that sequence, so results are bit-identical across instruction sets, thread
//! counts and the number of rows processed together (one row or a whole prompt). MXFP4 rows are
//! dequantised inside the kernel (`code value * 2^(scale-127)`, exact in f32), in the blocked
//! "deinterleaved" element order produced by [`deinterleave_mxfp4_input`]; there is never an f32
//! copy of an expert, only of one weight row at a time in a small scratch buffer.
//!
//! Layout: the portable code here (`matmul.rs`, `coded.rs`, `ops.rs`, `situ.rs`, `kda.rs`,
//! `mla.rs`, `peak.rs`; the scalar reference `scalar.rs`) calls kernel families through one table
//! each (`dispatch.rs`, which also says which instruction sets the CPU runs); every instruction
//! set's kernels are one folder with the same file names (`x86/`, `neon/`: `mod.rs`, `dot.rs`,
//! `tiled.rs`, `situ.rs`, `coded.rs`, `int8.rs` where the set has that form). `families.rs` lists
//! every family's form per instruction set, and its tests fail when an x86 family lacks its NEON
//! form, a listed kernel is missing from the code, or the list and the tables disagree.

mod backend;
pub mod coded;
mod dispatch;
pub mod families;
pub mod kda;
mod matmul;
pub mod mla;
#[cfg(target_arch = "aarch64")]
mod neon;
pub mod ops;
pub mod peak;
mod scalar;
mod situ;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use backend::CpuBackend;
pub use dispatch::{Isa, IsaError, isa, requested_isa};
pub(crate) use matmul::matvec_quads;
pub use matmul::{
    matmul_bf16, matmul_bf16_isa, matmul_mxfp4, matmul_mxfp4_isa, matvec_bf16, matvec_bf16_isa, matvec_mxfp4,
    matvec_mxfp4_isa,
};

use crate::backend::types::MXFP4_BLOCK;
use dispatch::{DECODE_BF16_ROW, DECODE_MXFP4_ROW, DOT1_F32, DOT4_F32, DOT4X4_F32};

/// Number of accumulation lanes every dot product uses, whatever the instruction set.
pub const LANES: usize = 16;
/// E2M1 code -> value (codes 8..15 are the negated 0..7; code 8 is -0.0).
pub const E2M1: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// E8M0 scale byte -> 2^(s-127); 255 is NaN by the OCP MX definition.
pub fn e8m0(s: u8) -> f32 {
    match s {
        255 => f32::NAN,
        // 2^-127 is subnormal: bit 22 of the mantissa.
        0 => f32::from_bits(0x0040_0000),
        s => f32::from_bits((s as u32) << 23),
    }
}

/// The fixed reduction tree of the 16 lanes: (i, i+8), then (i, i+4), (i, i+2), (i, i+1).
#[inline(always)]
pub fn reduce16(acc: &[f32; LANES]) -> f32 {
    let mut v8 = [0f32; 8];
    for i in 0..8 {
        v8[i] = acc[i] + acc[i + 8];
    }
    let mut v4 = [0f32; 4];
    for i in 0..4 {
        v4[i] = v8[i] + v8[i + 4];
    }
    let v2 = [v4[0] + v4[2], v4[1] + v4[3]];
    v2[0] + v2[1]
}

/// Reorders an MXFP4 input vector into the kernels' element order: for each block of 32, the 16
/// even-indexed inputs (low nibbles) then the 16 odd-indexed ones (high nibbles).
pub fn deinterleave_mxfp4_input(x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len() % MXFP4_BLOCK, 0);
    assert_eq!(x.len(), out.len());
    for (xb, ob) in x.chunks_exact(MXFP4_BLOCK).zip(out.chunks_exact_mut(MXFP4_BLOCK)) {
        for j in 0..16 {
            ob[j] = xb[2 * j];
            ob[16 + j] = xb[2 * j + 1];
        }
    }
}

/// Dequantises one MXFP4 row into `out` in the deinterleaved order (exact values).
pub fn decode_mxfp4_row(packed: &[u8], scales: &[u8], out: &mut [f32]) {
    DECODE_MXFP4_ROW.chosen().call(packed, scales, out)
}

pub fn decode_mxfp4_row_isa(isa: Isa, packed: &[u8], scales: &[u8], out: &mut [f32]) {
    DECODE_MXFP4_ROW.get(isa).call(packed, scales, out)
}

/// Converts one bf16 row to f32 (exact).
pub fn decode_bf16_row(row: &[u8], out: &mut [f32]) {
    DECODE_BF16_ROW.chosen().call(row, out)
}

pub fn decode_bf16_row_isa(isa: Isa, row: &[u8], out: &mut [f32]) {
    DECODE_BF16_ROW.get(isa).call(row, out)
}

/// Dots of one f32 row with four f32 vectors.
#[inline]
pub(crate) fn dot4_f32(isa: Isa, a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
    DOT4_F32.get(isa).call(a, b)
}

/// Dots of four f32 rows with four f32 vectors: out[r][i] = w[r] . x[i] (with `dot4_f32` per
/// weight row where `isa` has no 4 x 4 kernel).
#[inline]
pub(crate) fn dot4x4_f32(isa: Isa, w: [&[f32]; 4], x: [&[f32]; 4]) -> [[f32; 4]; 4] {
    match DOT4X4_F32.native(isa) {
        Some(k) => k.call(w, x),
        None => {
            let dot4 = DOT4_F32.get(isa);
            std::array::from_fn(|r| dot4.call(w[r], x))
        }
    }
}

/// Plain f32 dot product with the kernels' fixed operation order (used for attention scores).
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    DOT1_F32.chosen().call(a, b)
}

pub fn dot_f32_isa(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    DOT1_F32.get(isa).call(a, b)
}

#[cfg(test)]
mod tests;
