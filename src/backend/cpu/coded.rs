//! CPU kernels over the coded and int8 trunk matrices (`backend::coded`, `backend::int8`), and the
//! coded row decoder ([`CodedMat::decode_row_bf16`]).
//!
//! Contract: with AVX-512 (VBMI2) or NEON a matrix-vector product decodes coded rows in registers
//! straight into the FMAs (the `dot4_coded` family: `x86::dot4_coded_avx512`, `neon::dot4_coded`);
//! otherwise a coded row is decoded ([`CodedMat::decode_row_bf16`]) to its bf16 bits in a small
//! per-task scratch (four rows at a time, in cache) and the bf16 kernels run on it unchanged — the
//! same operations in the same order on the same bits, so every product is bit-identical to the
//! bf16 trunk's on every instruction set. There is never a bf16 copy of a matrix, only of the rows
//! in flight. A row decodes through the best block decoder the CPU has (the `decode_coded`
//! family, whatever instruction set was chosen: they all give the portable decoder's bytes), its
//! last partial block through the portable decoder. An int8 row is expanded to f32 (`q * scale`)
//! the same way and dotted with the fixed 16-lane order (with NEON, expanded in registers:
//! `neon::dot4_int8`, the same values and order).

use super::dispatch::{DECODE_CODED, DOT4_BF16, DOT4_CODED, DOT4_F32, DOT4_INT8};
use super::{Isa, matvec_quads};
use crate::backend::coded::portable::decode_portable;
use crate::backend::coded::{BLOCK, BLOCK_BYTES, CodedMat};
use crate::backend::int8::Int8Mat;
use crate::backend::types::{Bf16Mat, MatStore};
use rayon::prelude::*;

// Here rather than in `coded` (which the CPU kernels import): the block decoders are CPU kernels.
impl CodedMat {
    /// Row `r` as bf16 bytes (little endian) into `out` (`2 * cols` bytes): the original bits.
    pub fn decode_row_bf16(&self, r: usize, out: &mut [u8]) {
        assert_eq!(out.len(), 2 * self.cols);
        let (sm, idx, esc) = self.row_parts(r);
        assert_eq!(idx.len(), self.cols.div_ceil(BLOCK) * BLOCK_BYTES);
        let whole = self.cols / BLOCK;
        if whole > 0
            && let Some(blocks) = DECODE_CODED.native(Isa::best())
        {
            // The whole blocks in registers, the last partial one by the portable decoder from
            // the escapes the blocks left.
            let used = blocks.call(&self.table, sm, idx, esc, out, whole);
            return decode_portable(&self.table, sm, idx, &esc[used..], out, whole * BLOCK);
        }
        decode_portable(&self.table, sm, idx, esc, out, 0)
    }
}

// Here rather than in `types` (which the CPU kernels import): the f32 decode is CPU math.
impl Bf16Mat {
    /// Row `r` as the f32 values the kernels multiply by (exact for bf16 and coded).
    pub fn decode_row(&self, r: usize, out: &mut [f32]) {
        match &self.store {
            MatStore::Bf16(d) => super::decode_bf16_row(&d[r * self.cols * 2..(r + 1) * self.cols * 2], out),
            MatStore::Coded(c) => {
                thread_local! {
                    // One row's bf16 bits between the two decodes (no allocation per row).
                    static ROW: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
                }
                ROW.with_borrow_mut(|b| {
                    b.resize(2 * self.cols, 0);
                    c.decode_row_bf16(r, b);
                    super::decode_bf16_row(b, out)
                })
            }
            MatStore::Int8(q) => q.decode_row(r, out),
        }
    }
}

/// Below this many multiply-adds a product runs on the calling thread.
const PAR_MIN_WORK: usize = 1 << 16;
/// Output rows per parallel task.
const ROWS_PER_TASK: usize = 16;

/// Fills `out` four rows at a time with `dot4` over rows decoded by `fill` into a per-task
/// scratch of `4 * row_len` elements (a short last quad repeats its last row, as the bf16 kernel).
fn quads<T: Copy + Default + Send>(
    rows: usize,
    cols: usize,
    row_len: usize,
    out: &mut [f32],
    fill: impl Fn(usize, &mut [T]) + Sync,
    dot4: impl Fn([&[T]; 4]) -> [f32; 4] + Sync,
) {
    assert_eq!(out.len(), rows);
    let task = |buf: &mut Vec<T>, (t, chunk): (usize, &mut [f32])| {
        buf.resize(4 * row_len, T::default());
        let base = t * ROWS_PER_TASK;
        for (q, quad) in chunk.chunks_mut(4).enumerate() {
            let r0 = base + 4 * q;
            for (i, dst) in buf.chunks_exact_mut(row_len).enumerate() {
                fill(r0 + i.min(quad.len() - 1), dst);
            }
            let rows: [&[T]; 4] = std::array::from_fn(|i| &buf[i * row_len..(i + 1) * row_len]);
            let d = dot4(rows);
            quad.copy_from_slice(&d[..quad.len()]);
        }
    };
    if rows * cols < PAR_MIN_WORK {
        let mut buf = Vec::new();
        out.chunks_mut(ROWS_PER_TASK).enumerate().for_each(|x| task(&mut buf, x));
    } else {
        out.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each_init(Vec::new, task);
    }
}

/// out[r] = W[r] . x for a coded matrix: bit-identical to `matvec_bf16` on the original bf16.
pub fn matvec_coded(isa: Isa, w: &CodedMat, x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), w.cols);
    if let Some(dot4) = DOT4_CODED.native(isa) {
        // Rows decoded in registers straight into the FMAs: no scratch (the same bits as below).
        // The matrix passed `CodedMat::check` when it was built or read.
        return matvec_quads(w.rows, w.cols, out, |r| dot4.call(w, r, x));
    }
    let dot4 = DOT4_BF16.get(isa);
    quads(w.rows, w.cols, 2 * w.cols, out, |r, dst: &mut [u8]| w.decode_row_bf16(r, dst), |rows| dot4.call(rows, x));
}

/// out[r] = W[r] . x for an int8 matrix (`q * scale` per value, then the 16-lane f32 dot).
pub fn matvec_int8(isa: Isa, w: &Int8Mat, x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), w.cols);
    if let Some(dot4) = DOT4_INT8.native(isa) {
        let row = |r: usize| &w.q[r * w.cols..(r + 1) * w.cols];
        return matvec_quads(w.rows, w.cols, out, |r| dot4.call(r.map(row), r.map(|i| w.scales[i]), x));
    }
    let dot4 = DOT4_F32.get(isa);
    quads(w.rows, w.cols, w.cols, out, |r, dst: &mut [f32]| w.decode_row(r, dst), |rows| dot4.call(x, rows))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simd_and_portable_decoders_agree() {
        // Trained-like values (a few common exponents) with every 97th value anything at all, in
        // rows of whole blocks plus a tail.
        let cols: usize = 64 * 5 + 7;
        let rows = 9;
        let v: Vec<u8> = (0..rows * cols)
            .flat_map(|i| {
                let b = if i % 97 == 0 {
                    (i as u16).wrapping_mul(40503)
                } else {
                    half::bf16::from_f32(((i * 7919 % 2001) as f32 - 1000.0) * 1e-4).to_bits()
                };
                b.to_le_bytes()
            })
            .collect();
        let m = CodedMat::encode(&v, rows, cols);
        m.check().unwrap();
        assert!(m.escape_count() > 0);
        for r in 0..rows {
            let (sm, idx, esc) = m.row_parts(r);
            let mut a = vec![0u8; 2 * cols];
            let mut b = vec![0u8; 2 * cols];
            m.decode_row_bf16(r, &mut a);
            decode_portable(&m.table, sm, idx, esc, &mut b, 0);
            assert_eq!(a, b, "row {r}");
            assert_eq!(a, &v[2 * r * cols..2 * (r + 1) * cols], "row {r}");
        }
    }
}
