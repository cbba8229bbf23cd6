//! CPU kernels: bf16 and MXFP4 matrix-vector / matrix-matrix products, norms and activations.
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
//! Every kernel family (the products here and in `matmul.rs` / `coded.rs`, SiTU in `ops.rs`) has
//! its forms per instruction set listed in `families.rs`, whose tests fail when an x86 family
//! lacks its NEON form or a listed kernel is missing from the code.

pub mod coded;
pub mod families;
pub mod kda;
mod matmul;
pub mod mla;
#[cfg(target_arch = "aarch64")]
mod neon;
pub mod ops;
pub mod peak;
mod scalar;
#[cfg(target_arch = "x86_64")]
mod situ_x86;
#[cfg(target_arch = "x86_64")]
mod x86;

pub(crate) use matmul::matvec_quads;
pub use matmul::{
    matmul_bf16, matmul_bf16_isa, matmul_mxfp4, matmul_mxfp4_isa, matvec_bf16, matvec_bf16_isa, matvec_mxfp4,
    matvec_mxfp4_isa,
};

use crate::backend::types::MXFP4_BLOCK;
use std::sync::OnceLock;

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

/// Instruction set used by the product kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    Avx2,
    Avx512,
    Neon,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Neon => "neon",
        }
    }

    /// The instruction sets this machine can run, best last.
    pub fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                v.push(Isa::Avx2);
            }
            if std::is_x86_feature_detected!("avx512f") {
                v.push(Isa::Avx512);
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            if std::arch::is_aarch64_feature_detected!("neon") {
                v.push(Isa::Neon);
            }
        }
        v
    }
}

/// `DELTAFIN_ISA` names an instruction set this machine cannot run (or none at all).
#[derive(Debug, thiserror::Error)]
#[error("DELTAFIN_ISA={want:?} is not an instruction set this machine can run (available: {available})")]
pub struct IsaError {
    pub want: String,
    pub available: String,
}

/// The instruction set `DELTAFIN_ISA` asks for (scalar|avx2|avx512|neon), or the best available.
pub fn requested_isa() -> Result<Isa, IsaError> {
    let avail = Isa::available();
    let best = *avail.last().unwrap_or(&Isa::Scalar);
    match std::env::var("DELTAFIN_ISA") {
        Ok(want) => avail
            .iter()
            .copied()
            .find(|i| i.name() == want)
            .ok_or_else(|| IsaError { want, available: avail.iter().map(|i| i.name()).collect::<Vec<_>>().join(", ") }),
        Err(_) => Ok(best),
    }
}

/// The instruction set chosen at startup. Front ends call [`requested_isa`] first so that a bad
/// `DELTAFIN_ISA` is an error; here it falls back to the best available. Results do not depend on
/// the choice.
pub fn isa() -> Isa {
    static CHOSEN: OnceLock<Isa> = OnceLock::new();
    *CHOSEN.get_or_init(|| requested_isa().unwrap_or_else(|_| *Isa::available().last().unwrap_or(&Isa::Scalar)))
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
    decode_mxfp4_row_isa(isa(), packed, scales, out)
}

pub fn decode_mxfp4_row_isa(isa: Isa, packed: &[u8], scales: &[u8], out: &mut [f32]) {
    assert_eq!(out.len(), packed.len() * 2);
    assert_eq!(out.len(), scales.len() * MXFP4_BLOCK);
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: avx512f detected; lengths checked above.
        Isa::Avx512 => unsafe { x86::decode_mxfp4_row_avx512(packed, scales, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: neon detected; lengths checked above.
        Isa::Neon => unsafe { neon::decode_mxfp4_row(packed, scales, out) },
        _ => decode_mxfp4_row_scalar(packed, scales, out),
    }
}

fn decode_mxfp4_row_scalar(packed: &[u8], scales: &[u8], out: &mut [f32]) {
    for (b, (pb, ob)) in packed.chunks_exact(16).zip(out.chunks_exact_mut(MXFP4_BLOCK)).enumerate() {
        let s = e8m0(scales[b]);
        for j in 0..16 {
            ob[j] = E2M1[(pb[j] & 0x0f) as usize] * s;
            ob[16 + j] = E2M1[(pb[j] >> 4) as usize] * s;
        }
    }
}

/// Converts one bf16 row to f32 (exact).
pub fn decode_bf16_row(row: &[u8], out: &mut [f32]) {
    decode_bf16_row_isa(isa(), row, out)
}

pub fn decode_bf16_row_isa(isa: Isa, row: &[u8], out: &mut [f32]) {
    assert_eq!(row.len(), out.len() * 2);
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: avx512f detected; lengths checked above.
        Isa::Avx512 => unsafe { x86::decode_bf16_row_avx512(row, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: neon detected; lengths checked above.
        Isa::Neon => unsafe { neon::decode_bf16_row(row, out) },
        _ => decode_bf16_row_scalar(row, out),
    }
}

fn decode_bf16_row_scalar(row: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
        *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
    }
}

// ---- per-ISA dispatch of the three primitive kernels -------------------------------------

/// Dots of four bf16 weight rows with one f32 vector.
#[inline]
pub(crate) fn dot4_bf16(isa: Isa, w: [&[u8]; 4], x: &[f32]) -> [f32; 4] {
    for r in &w {
        assert_eq!(r.len(), x.len() * 2);
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Isa::Avx512 is only chosen when avx512f was detected; lengths checked above.
        Isa::Avx512 => unsafe { x86::dot4_bf16_avx512(w, x) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Isa::Avx2 is only chosen when avx2 and fma were detected; lengths checked above.
        Isa::Avx2 => unsafe { x86::dot4_bf16_avx2(w, x) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: Isa::Neon is only chosen when neon was detected; lengths checked above.
        Isa::Neon => unsafe { neon::dot4_bf16(w, x) },
        _ => scalar::dot4_bf16(w, x),
    }
}

/// Dots of one f32 row with four f32 vectors.
#[inline]
pub(crate) fn dot4_f32(isa: Isa, a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
    for r in &b {
        assert_eq!(r.len(), a.len());
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: feature detected for this Isa; lengths checked above.
        Isa::Avx512 => unsafe { x86::dot4_f32_avx512(a, b) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: feature detected for this Isa; lengths checked above.
        Isa::Avx2 => unsafe { x86::dot4_f32_avx2(a, b) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: feature detected for this Isa; lengths checked above.
        Isa::Neon => unsafe { neon::dot4_f32(a, b) },
        _ => scalar::dot4_f32(a, b),
    }
}

/// Dots of four f32 rows with four f32 vectors: out[r][i] = w[r] . x[i].
#[inline]
pub(crate) fn dot4x4_f32(isa: Isa, w: [&[f32]; 4], x: [&[f32]; 4]) -> [[f32; 4]; 4] {
    let n = w[0].len();
    assert!(w.iter().all(|r| r.len() == n) && x.iter().all(|r| r.len() == n));
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: feature detected for this Isa; lengths checked above.
        Isa::Avx512 => unsafe { x86::dot4x4_f32_avx512(w, x) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: feature detected for this Isa; lengths checked above.
        Isa::Neon => unsafe { neon::dot4x4_f32(w, x) },
        _ => std::array::from_fn(|r| dot4_f32(isa, w[r], x)),
    }
}

/// Dots of four MXFP4 rows (packed, scales) with one deinterleaved input vector.
#[inline]
pub(crate) fn dot4_mxfp4(isa: Isa, w: [(&[u8], &[u8]); 4], xd: &[f32]) -> [f32; 4] {
    for (p, s) in &w {
        assert_eq!(p.len() * 2, xd.len());
        assert_eq!(s.len() * MXFP4_BLOCK, xd.len());
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: feature detected for this Isa; lengths checked above.
        Isa::Avx512 => unsafe { x86::dot4_mxfp4_avx512(w, xd) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: feature detected for this Isa; lengths checked above.
        Isa::Avx2 => unsafe { x86::dot4_mxfp4_avx2(w, xd) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: feature detected for this Isa; lengths checked above.
        Isa::Neon => unsafe { neon::dot4_mxfp4(w, xd) },
        _ => scalar::dot4_mxfp4(w, xd),
    }
}

/// Plain f32 dot product with the kernels' fixed operation order (used for attention scores).
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    dot_f32_isa(isa(), a, b)
}

pub fn dot_f32_isa(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: feature detected for this Isa; lengths checked above.
        Isa::Avx512 => unsafe { x86::dot1_f32_avx512(a, b) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: feature detected for this Isa; lengths checked above.
        Isa::Avx2 => unsafe { x86::dot1_f32_avx2(a, b) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: feature detected for this Isa; lengths checked above.
        Isa::Neon => unsafe { neon::dot1_f32(a, b) },
        _ => scalar::dot1_f32(a, b),
    }
}

#[cfg(test)]
mod tests;
