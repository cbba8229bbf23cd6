//! The coded block decoder with NEON (aarch64): one whole 64-value block of a row to the bf16 low
//! and high bytes of its values, in registers — what `decode.rs`'s AVX-512 block decoder does with
//! mask registers and byte expands, here with table lookups and shift-inserts. Used by
//! [`super::decode::decode_bf16`] and by the matrix-vector product that decodes straight into its
//! FMAs (`backend/cpu/neon/coded.rs`). Gives the portable decoder's bytes exactly (unit test in
//! `decode.rs`).

use super::{BLOCK, BLOCK_BYTES};
use std::arch::aarch64::*;

/// Per lane of a quarter (16 values: two bytes of each plane), the plane byte it reads.
const DUP: [[u8; 16]; 4] = {
    let mut t = [[0u8; 16]; 4];
    let mut k = 0;
    while k < 4 {
        let mut l = 0;
        while l < 16 {
            t[k][l] = (2 * k + l / 8) as u8;
            l += 1;
        }
        k += 1;
    }
    t
};
/// Per lane, the left shift that brings its value's plane bit (bit `l % 8` of its byte) to bit 7.
const TO_TOP: [i8; 16] = [7, 6, 5, 4, 3, 2, 1, 0, 7, 6, 5, 4, 3, 2, 1, 0];

/// The exponent table in the register form [`block`] takes (indices 0..8 read its first bytes).
///
/// # Safety
/// Callable only where neon is present (it is a target-feature function).
#[target_feature(enable = "neon")]
#[inline]
pub fn table(table: &[u8; 8]) -> uint8x16_t {
    // SAFETY: the table holds 8 bytes.
    unsafe { vcombine_u8(vld1_u8(table.as_ptr()), vdup_n_u8(0)) }
}

/// One whole block of a row in registers: the bf16 low bytes and high bytes of its 64 values,
/// quarter `k` holding values 16k..16k+16. Each quarter's three plane bits per value come from a
/// byte lookup (the plane byte to every lane of its value) and a per-lane shift (the value's bit to
/// the top), stacked by two shift-inserts into the 3-bit index; a lookup in the table gives the
/// exponents. A block with escapes (index 7: rare on trained weights) has its exponent bytes
/// replaced in column order from the row's escape list, `*used` advancing past them. Sign,
/// exponent and mantissa are placed by one shift-insert each.
///
/// # Safety
/// `idx` has 24 readable bytes, `sm` 64, and `esc.add(*used)` as many as the block has escape
/// indices (the row's parts are consistent: `CodedMat::check`).
#[target_feature(enable = "neon")]
#[inline]
pub unsafe fn block(
    tab: uint8x16_t,
    sm: *const u8,
    idx: *const u8,
    esc: *const u8,
    used: &mut usize,
) -> ([uint8x16_t; 4], [uint8x16_t; 4]) {
    // SAFETY: the reads are the ones the caller vouches for.
    unsafe {
        let p01 = vld1q_u8(idx);
        let p2 = vcombine_u8(vld1_u8(idx.add(16)), vdup_n_u8(0));
        let to_top = vld1q_s8(TO_TOP.as_ptr());
        let mut e: [uint8x16_t; 4] = std::array::from_fn(|k| {
            let d = vld1q_u8(DUP[k].as_ptr());
            let b0 = vshlq_u8(vqtbl1q_u8(p01, d), to_top);
            let b1 = vshlq_u8(vqtbl1q_u8(p01, vaddq_u8(d, vdupq_n_u8(8))), to_top);
            let b2 = vshlq_u8(vqtbl1q_u8(p2, d), to_top);
            // Bits 7, 6, 5 = index bits 2, 1, 0; the bits below are dropped by the shift.
            let ix = vshrq_n_u8::<5>(vsriq_n_u8::<2>(vsriq_n_u8::<1>(b2, b1), b0));
            vqtbl1q_u8(tab, ix)
        });
        let pp = idx as *const u64;
        let mut kesc = pp.read_unaligned() & pp.add(1).read_unaligned() & pp.add(2).read_unaligned();
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
pub(super) unsafe fn decode_blocks(
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
