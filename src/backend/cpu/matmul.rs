//! The public products over whole matrices: matrix-vector (four weight rows at a time through the
//! primitive `dot4` kernels), and matrix-matrix for prompts and batched passes — a band of weight
//! rows decoded once to f32 and multiplied by every input row (tiled over the columns where the
//! instruction set has a tile kernel: AVX-512 and NEON), or, for an MXFP4 product of a few rows,
//! the weights decoded in registers once per quad of inputs (AVX-512 and NEON).
//!
//! Contract: every element is bit-identical to the matrix-vector product of its input row alone
//! on any instruction set (the kernels share the reference operation order of `cpu/mod.rs`);
//! parallel tasks split output columns, never a reduction.

use super::dispatch::{DOT4_BF16, DOT4_MXFP4, DOT4XN_MXFP4, Dot4xnMxfp4, Kernel, TILE_F32, TileF32};
use super::{Isa, LANES, dot4x4_f32, isa, reduce16};
use crate::backend::types::{Bf16Mat, MXFP4_BLOCK, MatStore, Mxfp4Mat};
use rayon::prelude::*;

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
            let dot4 = DOT4_BF16.get(isa);
            matvec_quads(w.rows, w.cols, out, |r| dot4.call(r.map(row), x))
        }
        MatStore::Coded(c) => super::coded::matvec_coded(isa, c, x, out),
        MatStore::Int8(q) => super::coded::matvec_int8(isa, q, x, out),
    }
}

/// out[r] = W[r] . x for an MXFP4 matrix; `xd` is the deinterleaved input.
pub fn matvec_mxfp4(w: &Mxfp4Mat, xd: &[f32], out: &mut [f32]) {
    matvec_mxfp4_isa(isa(), w, xd, out)
}

pub fn matvec_mxfp4_isa(isa: Isa, w: &Mxfp4Mat, xd: &[f32], out: &mut [f32]) {
    assert_eq!(xd.len(), w.cols);
    let dot4 = DOT4_MXFP4.get(isa);
    matvec_quads(w.rows, w.cols, out, |r| dot4.call(r.map(|i| w.row(i)), xd));
}

/// Fills `out` (one value per weight row) four rows at a time with `dot4`, in parallel bands when
/// the product is large; a short last quad repeats its last row (the extra result is dropped).
pub(crate) fn matvec_quads(rows: usize, cols: usize, out: &mut [f32], dot4: impl Fn([usize; 4]) -> [f32; 4] + Sync) {
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
        super::decode_mxfp4_row(p, s, out)
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
    if n >= TILED_MIN_ROWS
        && let Some(tile) = TILE_F32.native(isa)
    {
        tiled_band(tile, wdec, nr, cols, xs, n, res);
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
/// Input quads per block of [`tiled_band`]: a block's inputs over one column tile (64 KiB),
/// its accumulators against the band (64 KiB) and the band's tile (64 KiB) stay in L2 while the
/// block runs; a band against all of a batched pass's rows at once (hundreds to thousands) spilled
/// both to L3 and ran 1.2-1.6x slower (this 2-core VM, loaded).
const X_BLOCK_QUADS: usize = 8;

/// One band of `nr` decoded weight rows against all `n` input rows, [`X_BLOCK_QUADS`] input quads
/// at a time, tiled over the columns (the lane accumulators carried from tile to tile), into `res`
/// [nr, n]: bit-identical to the untiled 4x4 kernel, which computes every element in the same order.
fn tiled_band(tile: Kernel<TileF32>, wdec: &[f32], nr: usize, cols: usize, xs: &[f32], n: usize, res: &mut [f32]) {
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
                    tile.call(wrows, xrows, &mut acc[wq * bq + xq - xq0]);
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
    if let Some(kernel) = DOT4XN_MXFP4.native(isa)
        && xds.len() <= REG_MAX_ROWS * w.cols
    {
        return matmul_mxfp4_regs(kernel, w, xds, out);
    }
    matmul_decoded(isa, w, xds, out)
}

/// Input rows up to which an MXFP4 product decodes its weights in registers
/// ([`matmul_mxfp4_regs`]); above, a band decoded once into f32 serves the rows
/// ([`matmul_decoded`]): a decode step's few rows of an expert. Each quad of inputs decodes the
/// weights again, so past a few quads the band decoded once wins.
const REG_MAX_ROWS: usize = 8;
/// Weight rows per task of [`matmul_mxfp4_regs`].
const REG_WROWS: usize = 64;

/// out[i, r] = W[r] . xds[i] for a few input rows (a decode step's rows of one expert): each
/// quad of weight rows is decoded in registers once per quad of input rows and applied to all
/// of them (the `dot4xn_mxfp4` kernel), so the weights are neither decoded per input row nor
/// written out as f32; each element bit-identical to the one-row product.
fn matmul_mxfp4_regs(kernel: Kernel<Dot4xnMxfp4>, w: &Mxfp4Mat, xds: &[f32], out: &mut [f32]) {
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
                let nx = 4.min(n - i);
                let x: [&[f32]; 4] = std::array::from_fn(|k| &xds[(i + k.min(nx - 1)) * cols..][..cols]);
                let d = kernel.call(wr, &x[..nx]);
                for (a, da) in d.iter().enumerate().take(nw) {
                    res[(q + a) * n + i..][..nx].copy_from_slice(&da[..nx]);
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
