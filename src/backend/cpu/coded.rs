//! CPU kernels over the coded and int8 trunk matrices (`backend::coded`, `backend::int8`).
//!
//! Contract: with AVX-512 (VBMI2) or NEON a matrix-vector product decodes coded rows in registers
//! straight into the FMAs (`x86::dot4_coded_avx512`, `neon::dot4_coded`); otherwise a coded row is
//! decoded
//! (`backend::coded::decode`) to its bf16 bits in a small per-task scratch (four rows at a time,
//! in cache) and the bf16 kernels run on it unchanged — the same operations in the same
//! order on the same bits, so every product is bit-identical to the bf16 trunk's on every
//! instruction set. There is never a bf16 copy of a matrix, only of the rows in flight. An int8
//! row is expanded to f32 (`q * scale`) the same way and dotted with the fixed 16-lane order (with
//! NEON, expanded in registers: `neon::dot4_int8`, the same values and order).

use super::{Isa, dot4_bf16, dot4_f32};
use crate::backend::coded::CodedMat;
use crate::backend::int8::Int8Mat;
use crate::backend::types::{Bf16Mat, MatStore};
use rayon::prelude::*;

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
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && crate::backend::coded::decode::has_avx512_decode() {
        // Rows decoded in registers straight into the FMAs: no scratch (the same bits as below).
        // SAFETY: the features were detected; the matrix passed `CodedMat::check` when it was
        // built or read, matvec_quads passes row indices below `w.rows`, and x has `w.cols`.
        return super::matvec_quads(w.rows, w.cols, out, |r| unsafe { super::x86::dot4_coded_avx512(w, r, x) });
    }
    #[cfg(target_arch = "aarch64")]
    if isa == Isa::Neon {
        // SAFETY: Isa::Neon is only chosen when neon was detected; the matrix passed
        // `CodedMat::check`, matvec_quads passes row indices below `w.rows`, and x has `w.cols`.
        return super::matvec_quads(w.rows, w.cols, out, |r| unsafe { super::neon::dot4_coded(w, r, x) });
    }
    quads(
        w.rows,
        w.cols,
        2 * w.cols,
        out,
        |r, dst: &mut [u8]| w.decode_row_bf16(r, dst),
        |rows| dot4_bf16(isa, rows, x),
    );
}

/// out[r] = W[r] . x for an int8 matrix (`q * scale` per value, then the 16-lane f32 dot).
pub fn matvec_int8(isa: Isa, w: &Int8Mat, x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), w.cols);
    #[cfg(target_arch = "aarch64")]
    if isa == Isa::Neon {
        let row = |r: usize| &w.q[r * w.cols..(r + 1) * w.cols];
        // SAFETY: Isa::Neon is only chosen when neon was detected; every row has `w.cols` codes,
        // x has `w.cols` values, and matvec_quads passes row indices below `w.rows`.
        return super::matvec_quads(w.rows, w.cols, out, |r| unsafe {
            super::neon::dot4_int8(r.map(row), r.map(|i| w.scales[i]), x)
        });
    }
    quads(w.rows, w.cols, w.cols, out, |r, dst: &mut [f32]| w.decode_row(r, dst), |rows| dot4_f32(isa, x, rows))
}
