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

pub mod coded;
pub mod kda;
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

use crate::backend::types::{Bf16Mat, MXFP4_BLOCK, MatStore, Mxfp4Mat};
use rayon::prelude::*;
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
    assert_eq!(out.len(), packed.len() * 2);
    assert_eq!(out.len(), scales.len() * MXFP4_BLOCK);
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx512 {
        // SAFETY: avx512f detected; lengths checked above.
        return unsafe { x86::decode_mxfp4_row_avx512(packed, scales, out) };
    }
    decode_mxfp4_row_scalar(packed, scales, out)
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
    assert_eq!(row.len(), out.len() * 2);
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx512 {
        // SAFETY: avx512f detected; lengths checked above.
        return unsafe { x86::decode_bf16_row_avx512(row, out) };
    }
    decode_bf16_row_scalar(row, out)
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

// ---- public products ----------------------------------------------------------------------

/// Below this many multiply-adds a product runs on the calling thread.
const PAR_MIN_WORK: usize = 1 << 16;
/// Output rows per parallel task.
const ROWS_PER_TASK: usize = 16;

/// out[r] = W[r] . x for a bf16 matrix.
pub fn matvec_bf16(w: &Bf16Mat, x: &[f32], out: &mut [f32]) {
    matvec_bf16_isa(isa(), w, x, out)
}

pub fn matvec_bf16_isa(isa: Isa, w: &Bf16Mat, x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), w.cols);
    match &w.store {
        MatStore::Bf16(d) => {
            let row = |i: usize| &d[i * w.cols * 2..(i + 1) * w.cols * 2];
            matvec_quads(w.rows, w.cols, out, |r| dot4_bf16(isa, r.map(row), x))
        }
        MatStore::Coded(c) => coded::matvec_coded(isa, c, x, out),
        MatStore::Int8(q) => coded::matvec_int8(isa, q, x, out),
    }
}

/// out[r] = W[r] . x for an MXFP4 matrix; `xd` is the deinterleaved input.
pub fn matvec_mxfp4(w: &Mxfp4Mat, xd: &[f32], out: &mut [f32]) {
    matvec_mxfp4_isa(isa(), w, xd, out)
}

pub fn matvec_mxfp4_isa(isa: Isa, w: &Mxfp4Mat, xd: &[f32], out: &mut [f32]) {
    assert_eq!(xd.len(), w.cols);
    matvec_quads(w.rows, w.cols, out, |r| dot4_mxfp4(isa, r.map(|i| w.row(i)), xd));
}

/// Fills `out` (one value per weight row) four rows at a time with `dot4`, in parallel bands when
/// the product is large; a short last quad repeats its last row (the extra result is dropped).
fn matvec_quads(rows: usize, cols: usize, out: &mut [f32], dot4: impl Fn([usize; 4]) -> [f32; 4] + Sync) {
    assert_eq!(out.len(), rows);
    let task = |(t, chunk): (usize, &mut [f32])| {
        let base = t * ROWS_PER_TASK;
        for (q, quad) in chunk.chunks_mut(4).enumerate() {
            let r0 = base + 4 * q;
            let d = dot4(std::array::from_fn(|i| r0 + i.min(quad.len() - 1)));
            quad.copy_from_slice(&d[..quad.len()]);
        }
    };
    if rows * cols < PAR_MIN_WORK {
        out.chunks_mut(ROWS_PER_TASK).enumerate().for_each(task);
    } else {
        out.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each(task);
    }
}

/// A weight matrix whose rows can be decoded one at a time into f32.
trait RowDecode: Sync {
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    fn decode(&self, r: usize, out: &mut [f32]);
}

impl RowDecode for Bf16Mat {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn decode(&self, r: usize, out: &mut [f32]) {
        self.decode_row(r, out)
    }
}

impl RowDecode for Mxfp4Mat<'_> {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn decode(&self, r: usize, out: &mut [f32]) {
        let (p, s) = self.row(r);
        decode_mxfp4_row(p, s, out)
    }
}

/// Weight rows decoded per task in a matrix-matrix product (the band stays in L2 while every
/// input row passes over it).
const MM_WROWS: usize = 32;

/// out[i, r] = W[r] . xs[i] for `n = xs.len() / cols` input rows; each element bit-identical to the
/// matrix-vector product of that row alone.
fn matmul_decoded<M: RowDecode>(isa: Isa, w: &M, xs: &[f32], out: &mut [f32]) {
    let cols = w.cols();
    let rows = w.rows();
    assert_eq!(xs.len() % cols, 0);
    let n = xs.len() / cols;
    assert_eq!(out.len(), n * rows);
    if n == 0 || rows == 0 {
        return;
    }
    // Each task owns a band of weight rows and writes that column band of `out` itself (no
    // serial scatter after the tasks: it ran on one thread while the other cores idled).
    let dst = OutColumns(out.as_mut_ptr());
    (0..rows.div_ceil(MM_WROWS))
        .into_par_iter()
        .with_min_len(if rows * cols * n < PAR_MIN_WORK { usize::MAX } else { 1 })
        // The decoded band and its results are reused across a worker's bands (no fresh large
        // allocation each time).
        .for_each_init(
            || (Vec::new(), Vec::new()),
            |(wdec, res): &mut (Vec<f32>, Vec<f32>), band| {
                let r0 = band * MM_WROWS;
                let nr = MM_WROWS.min(rows - r0);
                wdec.resize(nr * cols, 0.0);
                for (i, dst) in wdec.chunks_exact_mut(cols).enumerate() {
                    w.decode(r0 + i, dst);
                }
                res.resize(nr * n, 0.0);
                band_product(isa, &wdec[..nr * cols], nr, cols, xs, n, &mut res[..nr * n]);
                dst.put_band(&res[..nr * n], r0, rows, n);
            },
        );
}

/// `out`'s start, shared by the band tasks of [`matmul_decoded`] and `matmul_mxfp4_regs`, each of
/// which writes its own columns.
#[derive(Clone, Copy)]
struct OutColumns(*mut f32);
// SAFETY: the tasks write disjoint elements of one live buffer (see `put_band`).
unsafe impl Send for OutColumns {}
// SAFETY: as above; no task reads through it.
unsafe impl Sync for OutColumns {}

impl OutColumns {
    /// Writes a band's results `res` [nr, n] (weight row r0 + rr, input row i) to columns
    /// r0..r0 + nr of the [n, rows] output. A method, so closures capture the whole wrapper.
    fn put_band(self, res: &[f32], r0: usize, rows: usize, n: usize) {
        let nr = res.len() / n.max(1);
        assert!(r0 + nr <= rows);
        for i in 0..n {
            for rr in 0..nr {
                // SAFETY: the output holds n * rows elements (the callers assert it) and outlives
                // the tasks; one task alone writes columns r0..r0 + nr of each output row (bands
                // do not overlap), so no element is written twice or read.
                unsafe { self.0.add(i * rows + r0 + rr).write(res[rr * n + i]) };
            }
        }
    }
}

/// One band of `nr` decoded weight rows `wdec` against all `n` input rows `xs`, into `res`
/// [nr, n]; every element in the reference order.
fn band_product(isa: Isa, wdec: &[f32], nr: usize, cols: usize, xs: &[f32], n: usize, res: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && n >= TILED_MIN_ROWS {
        tiled_band_avx512(wdec, nr, cols, xs, n, res);
        return;
    }
    // 4 input rows x 4 weight rows per step; missing rows repeat the last one (their results are
    // discarded), so every computed element follows the reference order.
    for i in (0..n).step_by(4) {
        let nx = 4.min(n - i);
        let xrows: [&[f32]; 4] = std::array::from_fn(|k| &xs[(i + k.min(nx - 1)) * cols..][..cols]);
        for r in (0..nr).step_by(4) {
            let nw = 4.min(nr - r);
            let wrows: [&[f32]; 4] = std::array::from_fn(|k| &wdec[(r + k.min(nw - 1)) * cols..][..cols]);
            let d = dot4x4_f32(isa, wrows, xrows);
            for a in 0..nw {
                for k in 0..nx {
                    res[(r + a) * n + i + k] = d[a][k];
                }
            }
        }
    }
}

/// Input rows from which a band's product is tiled over the columns (below, the inputs fit in
/// cache anyway).
const TILED_MIN_ROWS: usize = 8;
/// Columns per tile: 4 weight rows and 4 input rows of a tile (16 KB) stay in L1 while every
/// input quad passes over the weight quad, instead of streaming whole rows from L2.
const COL_TILE: usize = 512;
/// Input quads per block of [`tiled_band_avx512`]: a block's inputs over one column tile (64 KiB),
/// its accumulators against the band (64 KiB) and the band's tile (64 KiB) stay in L2 while the
/// block runs; a band against all of a batched pass's rows at once (hundreds to thousands) spilled
/// both to L3 and ran 1.2-1.6x slower (this 2-core VM, loaded).
const X_BLOCK_QUADS: usize = 8;

/// One band of `nr` decoded weight rows against all `n` input rows, [`X_BLOCK_QUADS`] input quads
/// at a time, tiled over the columns (the lane accumulators carried from tile to tile), into `res`
/// [nr, n]: bit-identical to the untiled 4x4 kernel, which computes every element in the same order.
#[cfg(target_arch = "x86_64")]
fn tiled_band_avx512(wdec: &[f32], nr: usize, cols: usize, xs: &[f32], n: usize, res: &mut [f32]) {
    let (nwq, nxq) = (nr.div_ceil(4), n.div_ceil(4));
    let xqb = X_BLOCK_QUADS;
    let mut acc = vec![[[0f32; LANES]; 16]; nwq * xqb.min(nxq)];
    // Input rows a block at a time, so that the block's tiles and accumulators stay in L2 while
    // every weight quad passes over them (all of the inputs would not fit beside the band).
    for xq0 in (0..nxq).step_by(xqb) {
        let xq1 = (xq0 + xqb).min(nxq);
        let bq = xq1 - xq0;
        acc[..nwq * bq].fill([[0f32; LANES]; 16]);
        for k0 in (0..cols).step_by(COL_TILE) {
            let k1 = (k0 + COL_TILE).min(cols);
            for wq in 0..nwq {
                let wrows: [&[f32]; 4] =
                    std::array::from_fn(|a| &wdec[(4 * wq + a).min(nr - 1) * cols..][..cols][k0..k1]);
                for xq in xq0..xq1 {
                    let xrows: [&[f32]; 4] =
                        std::array::from_fn(|k| &xs[(4 * xq + k).min(n - 1) * cols..][..cols][k0..k1]);
                    // SAFETY: Isa::Avx512 is only chosen when avx512f was detected; equal lengths.
                    unsafe { x86::dot4x4_tile_avx512(wrows, xrows, &mut acc[wq * bq + xq - xq0]) };
                }
            }
        }
        for wq in 0..nwq {
            for xq in xq0..xq1 {
                let blk = &acc[wq * bq + xq - xq0];
                for a in 0..4.min(nr - 4 * wq) {
                    for k in 0..4.min(n - 4 * xq) {
                        res[(4 * wq + a) * n + 4 * xq + k] = reduce16(&blk[a * 4 + k]);
                    }
                }
            }
        }
    }
}

/// Matrix-matrix product for bf16 weights: `xs` is [n, cols] row-major, `out` is [n, rows].
pub fn matmul_bf16(w: &Bf16Mat, xs: &[f32], out: &mut [f32]) {
    matmul_bf16_isa(isa(), w, xs, out)
}

pub fn matmul_bf16_isa(isa: Isa, w: &Bf16Mat, xs: &[f32], out: &mut [f32]) {
    if xs.len() == w.cols {
        return matvec_bf16_isa(isa, w, xs, out);
    }
    matmul_decoded(isa, w, xs, out)
}

/// Matrix-matrix product for MXFP4 weights: `xds` holds n deinterleaved inputs, `out` is [n, rows].
pub fn matmul_mxfp4(w: &Mxfp4Mat, xds: &[f32], out: &mut [f32]) {
    matmul_mxfp4_isa(isa(), w, xds, out)
}

pub fn matmul_mxfp4_isa(isa: Isa, w: &Mxfp4Mat, xds: &[f32], out: &mut [f32]) {
    if xds.len() == w.cols {
        return matvec_mxfp4_isa(isa, w, xds, out);
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && xds.len() <= REG_MAX_ROWS * w.cols {
        return matmul_mxfp4_regs(w, xds, out);
    }
    matmul_decoded(isa, w, xds, out)
}

/// Input rows up to which an MXFP4 product decodes its weights in registers
/// ([`matmul_mxfp4_regs`]); above, a band decoded once into f32 serves the rows
/// ([`matmul_decoded`]): a decode step's few rows of an expert. Each quad of inputs decodes the
/// weights again, so past a few quads the band decoded once wins.
#[cfg(target_arch = "x86_64")]
const REG_MAX_ROWS: usize = 8;
/// Weight rows per task of [`matmul_mxfp4_regs`].
#[cfg(target_arch = "x86_64")]
const REG_WROWS: usize = 64;

/// out[i, r] = W[r] . xds[i] for a few input rows (a decode step's rows of one expert): each
/// quad of weight rows is decoded in registers once per quad of input rows and applied to all
/// of them ([`x86::dot4xn_mxfp4_avx512`]), so the weights are neither decoded per input row nor
/// written out as f32; each element bit-identical to the one-row product.
#[cfg(target_arch = "x86_64")]
fn matmul_mxfp4_regs(w: &Mxfp4Mat, xds: &[f32], out: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    assert_eq!(xds.len() % cols, 0);
    assert_eq!(cols % MXFP4_BLOCK, 0);
    let n = xds.len() / cols;
    assert_eq!(out.len(), n * rows);
    if n == 0 || rows == 0 {
        return;
    }
    let dst = OutColumns(out.as_mut_ptr());
    let band = |b: usize| {
        let r0 = b * REG_WROWS;
        let nr = REG_WROWS.min(rows - r0);
        // [nr, n]: this band's outputs, written to its columns of `out` below.
        let mut res = vec![0f32; nr * n];
        for q in (0..nr).step_by(4) {
            let nw = 4.min(nr - q);
            // A short quad repeats its last row (the extra results are dropped).
            let wr: [(&[u8], &[u8]); 4] = std::array::from_fn(|k| w.row(r0 + q + k.min(nw - 1)));
            for i in (0..n).step_by(4) {
                let x = |k: usize| &xds[(i + k) * cols..][..cols];
                let mut put = |d: &[[f32; 4]; 4], nx: usize| {
                    for (a, da) in d.iter().enumerate().take(nw) {
                        res[(q + a) * n + i..][..nx].copy_from_slice(&da[..nx]);
                    }
                };
                // SAFETY: Isa::Avx512 is only chosen when avx512f was detected; every input is
                // `cols` long, a multiple of 32, as is every weight row.
                unsafe {
                    match n - i {
                        1 => put(&x86::dot4xn_mxfp4_avx512::<1>(wr, [x(0)]).map(|r| [r[0], 0.0, 0.0, 0.0]), 1),
                        2 => put(&x86::dot4xn_mxfp4_avx512::<2>(wr, [x(0), x(1)]).map(|r| [r[0], r[1], 0.0, 0.0]), 2),
                        3 => put(
                            &x86::dot4xn_mxfp4_avx512::<3>(wr, [x(0), x(1), x(2)]).map(|r| [r[0], r[1], r[2], 0.0]),
                            3,
                        ),
                        _ => put(&x86::dot4xn_mxfp4_avx512::<4>(wr, [x(0), x(1), x(2), x(3)]), 4),
                    }
                }
            }
        }
        dst.put_band(&res, r0, rows, n);
    };
    let nb = rows.div_ceil(REG_WROWS);
    if rows * cols * n < PAR_MIN_WORK {
        (0..nb).for_each(band);
    } else {
        (0..nb).into_par_iter().for_each(band);
    }
}

/// Plain f32 dot product with the kernels' fixed operation order (used for attention scores).
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: feature detected for this Isa; lengths checked above.
        Isa::Avx512 => unsafe { x86::dot1_f32_avx512(a, b) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: feature detected for this Isa; lengths checked above.
        Isa::Avx2 => unsafe { x86::dot1_f32_avx2(a, b) },
        // NEON and scalar: one row of the four-row kernel is the same order.
        #[cfg(target_arch = "aarch64")]
        // SAFETY: feature detected for this Isa; lengths checked above.
        Isa::Neon => unsafe { neon::dot4_f32(a, [b, b, b, b])[0] },
        _ => scalar::dot1_f32(a, b),
    }
}

#[cfg(test)]
mod tests;
