//! The coded trunk's matrix-vector product with NEON: each 64-value block of a row decoded into
//! registers (`backend::coded::neon::block`) and fed to the FMAs as it comes — the NEON form of
//! `x86::dot4_coded_avx512`.

use super::{LANES, bf16_bytes, load_bf16x16, load16, pad_f32, reduce4q, zero4};
use crate::backend::coded::CodedMat;
use crate::backend::coded::decode::{BLOCK_VALUES, decode_portable};
use crate::backend::coded::neon::{block, table};
use std::arch::aarch64::*;

/// Dots of four coded rows with one f32 vector: the same lanes, values, order and reduction as
/// `dot4_bf16` on the decoded rows, so the same bits, without the rows ever being written out.
/// A row's last partial block is decoded by the portable decoder into a zero-padded buffer, as
/// `dot4_bf16` pads its tail.
///
/// # Safety
/// Requires neon; `m` passed `CodedMat::check`; every row index is below `m.rows` and
/// `x.len() == m.cols`.
#[target_feature(enable = "neon")]
#[inline(never)]
pub(in crate::backend::cpu) unsafe fn dot4_coded(m: &CodedMat, rows: [usize; 4], x: &[f32]) -> [f32; 4] {
    let n = x.len();
    let whole = n / BLOCK_VALUES;
    let tab = table(&m.table);
    let mut out = [0f32; 4];
    // Row by row: each row's lanes see its values in the same order either way, and one row's
    // accumulator and escape position stay in registers through its blocks.
    for (r, o) in rows.into_iter().zip(out.iter_mut()) {
        let (sm, idx, esc) = m.row_parts(r);
        let (mut a, mut used) = (zero4(), 0usize);
        for b in 0..whole {
            // SAFETY: block b's 64 values are inside the row and x; the row's parts are consistent.
            unsafe {
                let xp = x.as_ptr().add(BLOCK_VALUES * b);
                let (lo, hi) =
                    block(tab, sm.as_ptr().add(BLOCK_VALUES * b), idx.as_ptr().add(24 * b), esc.as_ptr(), &mut used);
                for k in 0..4 {
                    let wv = bf16_bytes(lo[k], hi[k]);
                    let xv = load16(xp.add(LANES * k));
                    for q in 0..4 {
                        a[q] = vfmaq_f32(a[q], wv[q], xv[q]);
                    }
                }
            }
        }
        let done = whole * BLOCK_VALUES;
        if done < n {
            let mut tail = [0u8; 2 * BLOCK_VALUES];
            decode_portable(&m.table, &sm[done..], &idx[whole * 24..], &esc[used..], &mut tail[..2 * (n - done)], 0);
            for k in 0..(n - done).div_ceil(LANES) {
                let start = done + LANES * k;
                let xb = pad_f32(&x[..n.min(start + LANES)], start);
                // SAFETY: the tail holds 64 values (chunk k < 4); the padded chunk 16 floats.
                unsafe {
                    let (wv, xv) = (load_bf16x16(tail.as_ptr().add(2 * LANES * k)), load16(xb.as_ptr()));
                    for q in 0..4 {
                        a[q] = vfmaq_f32(a[q], wv[q], xv[q]);
                    }
                }
            }
        }
        *o = reduce4q(a);
    }
    out
}
