//! The coded trunk with NEON: one whole 64-value block of a row decoded to the bf16 low and high
//! bytes of its values in registers ([`block`]: what the AVX-512 block decoder does with mask
//! registers and byte expands, here with the portable decoder's bit-spreading table on the general
//! registers, one table lookup for the exponents and shift-inserts), written out as bf16 bytes
//! ([`decode_blocks`], the row decoder `cpu::coded` runs on every aarch64 CPU) or fed straight to
//! the FMAs of the matrix-vector product ([`dot4_coded`], the NEON form of
//! `x86::dot4_coded_avx512`).
//!
//! Contract: given a row's parts that `CodedMat::check` accepted, the decoder gives the portable
//! decoder's bytes exactly (`backend::coded::portable`; the unit test in `cpu/coded.rs` holds them
//! equal), and the product the bits of `dot4_bf16` on the decoded rows; neither reads outside the
//! parts.

use super::{LANES, bf16_bytes, load_bf16x16, load16, pad_f32, reduce4q, zero4};
use crate::backend::coded::portable::{SPREAD, decode_portable};
use crate::backend::coded::{BLOCK, BLOCK_BYTES, CodedMat};
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
    let whole = n / BLOCK;
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
                let xp = x.as_ptr().add(BLOCK * b);
                let (lo, hi) =
                    block(tab, sm.as_ptr().add(BLOCK * b), idx.as_ptr().add(24 * b), esc.as_ptr(), &mut used);
                for k in 0..4 {
                    let wv = bf16_bytes(lo[k], hi[k]);
                    let xv = load16(xp.add(LANES * k));
                    for q in 0..4 {
                        a[q] = vfmaq_f32(a[q], wv[q], xv[q]);
                    }
                }
            }
        }
        let done = whole * BLOCK;
        if done < n {
            let mut tail = [0u8; 2 * BLOCK];
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

/// The exponent table in the register form [`block`] takes (indices 0..8 read its first bytes).
///
/// # Safety
/// Callable only where neon is present (it is a target-feature function).
#[target_feature(enable = "neon")]
#[inline]
pub(in crate::backend::cpu) fn table(table: &[u8; 8]) -> uint8x16_t {
    // SAFETY: the table holds 8 bytes.
    unsafe { vcombine_u8(vld1_u8(table.as_ptr()), vdup_n_u8(0)) }
}

/// One whole block of a row in registers: the bf16 low bytes and high bytes of its 64 values,
/// quarter `k` holding values 16k..16k+16. The index bytes of eight values come from their three
/// plane bytes as the portable decoder makes them (`SPREAD`: three table loads, shifts and ors on
/// the general registers, which run beside the vector pipes); a lookup in the table gives the
/// exponents. A block with escapes (index 7: rare on trained weights) has its exponent bytes
/// replaced in column order from the row's escape list, `*used` advancing past them. Sign,
/// exponent and mantissa are placed by one shift-insert each.
///
/// # Safety
/// `idx` has 24 readable bytes, `sm` 64, and `esc.add(*used)` as many as the block has escape
/// indices (the row's parts are consistent: `CodedMat::check`). Always inlined (so not a
/// target-feature function: NEON is part of every aarch64 target): returned through the stack,
/// its eight registers cost more than the block's work.
#[inline(always)]
pub(in crate::backend::cpu) unsafe fn block(
    tab: uint8x16_t,
    sm: *const u8,
    idx: *const u8,
    esc: *const u8,
    used: &mut usize,
) -> ([uint8x16_t; 4], [uint8x16_t; 4]) {
    // SAFETY: the reads are the ones the caller vouches for.
    unsafe {
        let pp = idx as *const u64;
        let p = [pp.read_unaligned(), pp.add(1).read_unaligned(), pp.add(2).read_unaligned()];
        // The index bytes of values 8g..8g+8.
        let ids = |g: usize| {
            let byte = |w: u64| SPREAD[(w >> (8 * g)) as u8 as usize];
            byte(p[0]) | byte(p[1]) << 1 | byte(p[2]) << 2
        };
        let mut e: [uint8x16_t; 4] =
            std::array::from_fn(|k| vqtbl1q_u8(tab, vcombine_u8(vcreate_u8(ids(2 * k)), vcreate_u8(ids(2 * k + 1)))));
        let mut kesc = p[0] & p[1] & p[2];
        if kesc != 0 {
            let mut bytes = [0u8; BLOCK];
            for (k, v) in e.iter().enumerate() {
                vst1q_u8(bytes.as_mut_ptr().add(16 * k), *v);
            }
            while kesc != 0 {
                bytes[kesc.trailing_zeros() as usize] = *esc.add(*used);
                *used += 1;
                kesc &= kesc - 1;
            }
            e = std::array::from_fn(|k| vld1q_u8(bytes.as_ptr().add(16 * k)));
        }
        let s: [uint8x16_t; 4] = std::array::from_fn(|k| vld1q_u8(sm.add(16 * k)));
        // Low byte: mantissa from s, exponent bit 0 into bit 7; high byte: sign from s, exponent
        // bits 1..8 into bits 0..6.
        (std::array::from_fn(|k| vsliq_n_u8::<7>(s[k], e[k])), std::array::from_fn(|k| vsriq_n_u8::<1>(s[k], e[k])))
    }
}

/// The first `blocks` whole blocks to bf16 bytes ([`block`], the low and high bytes interleaved
/// by two zips a quarter). Returns the escape bytes consumed.
///
/// # Safety
/// Requires neon; the parts are consistent (`CodedMat::check`) and hold `blocks` whole blocks.
#[target_feature(enable = "neon")]
#[inline(never)]
pub(in crate::backend::cpu) unsafe fn decode_blocks(
    table_bytes: &[u8; 8],
    sm: &[u8],
    idx: &[u8],
    esc: &[u8],
    out: &mut [u8],
    blocks: usize,
) -> usize {
    assert!(sm.len() >= blocks * BLOCK && idx.len() >= blocks * BLOCK_BYTES && out.len() >= 2 * blocks * BLOCK);
    let mut used = 0usize;
    let tab = table(table_bytes);
    // SAFETY (whole block): block b reads idx[24b..24b+24], sm[64b..64b+64] and writes
    // out[128b..128b+128], all in bounds by the assert above; the escape bytes it reads are the
    // caller's (consistent parts: every escape index of these blocks has its byte, in order).
    unsafe {
        for b in 0..blocks {
            let (lo, hi) =
                block(tab, sm.as_ptr().add(BLOCK * b), idx.as_ptr().add(BLOCK_BYTES * b), esc.as_ptr(), &mut used);
            let dst = out.as_mut_ptr().add(2 * BLOCK * b);
            for k in 0..4 {
                vst1q_u8(dst.add(32 * k), vzip1q_u8(lo[k], hi[k]));
                vst1q_u8(dst.add(32 * k + 16), vzip2q_u8(lo[k], hi[k]));
            }
        }
    }
    used
}
