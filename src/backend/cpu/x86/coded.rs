//! The coded trunk with AVX-512 (F, BW, VBMI, VBMI2; BMI2 and POPCNT): one whole 64-value block of
//! a row decoded in registers — the three index planes as mask registers, one byte permute for the
//! exponents, the block's escapes by a masked load and a byte expand, sign, exponent and mantissa
//! placed by two ternary-logic ops — written out as bf16 bytes ([`decode_blocks_avx512`], the row
//! decoder `cpu::coded` runs wherever the CPU has these features, whatever instruction set was
//! chosen) or fed straight to the FMAs of the matrix-vector product ([`dot4_coded_avx512`]).
//!
//! Contract: given a row's parts that `CodedMat::check` accepted, the decoder gives the portable
//! decoder's bytes exactly (`backend::coded::portable`; the unit test in `cpu/coded.rs` holds them
//! equal), and the product the bits of `dot4_bf16_avx512` on the decoded rows; neither reads
//! outside the parts.

use super::{LANES, bf16x16_512, reduce512};
use crate::backend::coded::portable::decode_portable;
use crate::backend::coded::{BLOCK, BLOCK_BYTES, CodedMat};
use std::arch::x86_64::*;
use std::sync::OnceLock;

/// Whether this CPU has the AVX-512 parts the block decoder uses (mask registers, byte permutes,
/// byte expands; BMI2 for the escape load's mask).
pub(in crate::backend::cpu) fn has_avx512_decode() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vbmi")
            && is_x86_feature_detected!("avx512vbmi2")
            && is_x86_feature_detected!("bmi2")
            && is_x86_feature_detected!("popcnt")
    })
}

/// Two-source byte permutes that interleave 64 low bytes (indices 0..64) and 64 high bytes
/// (64..128) into the bf16 bytes of values 0..32 and 32..64.
const INTERLEAVE: [[u8; 64]; 2] = {
    let mut t = [[0u8; 64]; 2];
    let mut h = 0;
    while h < 2 {
        let mut k = 0;
        while k < 64 {
            t[h][k] = (32 * h + k / 2 + if k % 2 == 1 { 64 } else { 0 }) as u8;
            k += 1;
        }
        h += 1;
    }
    t
};

/// One whole block of a row in registers: the bf16 low bytes and high bytes of its 64 values.
/// The three planes are mask registers that build the index bytes, one byte permute looks up the
/// exponents, the block's escape bytes (a masked load of exactly as many as it has escapes, then a
/// byte expand into the escape lanes) replace theirs, and two ternary-logic ops place sign,
/// exponent and mantissa. `*used` (the row's escapes consumed so far) advances past the block's.
///
/// # Safety
/// The features are present; `idx` has 24 readable bytes, `sm` 64, and `esc.add(*used)` as many
/// as the block has escape indices (the row's parts are consistent: `CodedMat::check`).
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vbmi2,bmi2,popcnt")]
#[inline]
pub(in crate::backend::cpu) unsafe fn block_avx512(
    tab: __m512i,
    sm: *const u8,
    idx: *const u8,
    esc: *const u8,
    used: &mut usize,
) -> (__m512i, __m512i) {
    // SAFETY: the reads are the ones the caller vouches for; the escape load is masked to the
    // block's escape count, so nothing past them is touched.
    unsafe {
        let pp = idx as *const u64;
        let (k0, k1, k2) = (pp.read_unaligned(), pp.add(1).read_unaligned(), pp.add(2).read_unaligned());
        let ix = _mm512_maskz_mov_epi8(k0, _mm512_set1_epi8(1));
        let ix = _mm512_mask_add_epi8(ix, k1, ix, _mm512_set1_epi8(2));
        let ix = _mm512_mask_add_epi8(ix, k2, ix, _mm512_set1_epi8(4));
        let kesc = k0 & k1 & k2;
        let n = kesc.count_ones();
        let e = _mm512_permutexvar_epi8(ix, tab);
        let loaded = _mm512_maskz_loadu_epi8(_bzhi_u64(u64::MAX, n), esc.add(*used) as *const i8);
        let e = _mm512_mask_expand_epi8(e, kesc, loaded);
        *used += n as usize;
        let s = _mm512_loadu_si512(sm as *const _);
        let m7f = _mm512_set1_epi8(0x7f);
        // 0xCA: a ? b : c, bitwise. Low byte: mantissa from s, exponent bit 0 into bit 7; high
        // byte: sign from s, exponent bits 1..8 into bits 0..6.
        let lo = _mm512_ternarylogic_epi32::<0xCA>(m7f, s, _mm512_slli_epi16::<7>(e));
        let hi = _mm512_ternarylogic_epi32::<0xCA>(m7f, _mm512_srli_epi16::<1>(e), s);
        (lo, hi)
    }
}

/// The exponent table in the register form [`block_avx512`] takes (every qword holds it; the
/// byte permute reads indices 0..7 of the first).
///
/// # Safety
/// Callable only where avx512f is present (it is a target-feature function).
#[target_feature(enable = "avx512f")]
pub(in crate::backend::cpu) fn table_avx512(table: &[u8; 8]) -> __m512i {
    _mm512_set1_epi64(i64::from_le_bytes(*table))
}

/// The first `blocks` whole blocks to bf16 bytes ([`block_avx512`], then two two-source permutes
/// interleave the low and high bytes). Returns the escape bytes consumed.
///
/// # Safety
/// The features are present; the parts are consistent (`CodedMat::check`) and hold `blocks` whole
/// blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vbmi2,bmi2,popcnt")]
pub(in crate::backend::cpu) unsafe fn decode_blocks_avx512(
    table: &[u8; 8],
    sm: &[u8],
    idx: &[u8],
    esc: &[u8],
    out: &mut [u8],
    blocks: usize,
) -> usize {
    assert!(sm.len() >= blocks * BLOCK && idx.len() >= blocks * BLOCK_BYTES && out.len() >= 2 * blocks * BLOCK);
    let mut used = 0usize;
    let tab = table_avx512(table);
    // SAFETY (whole block): block b reads idx[24b..24b+24], sm[64b..64b+64] and writes
    // out[128b..128b+128], all in bounds by the assert above; the escape bytes it reads are the
    // caller's (consistent parts: every escape index of these blocks has its byte, in order).
    unsafe {
        let perm0 = _mm512_loadu_si512(INTERLEAVE[0].as_ptr() as *const _);
        let perm1 = _mm512_loadu_si512(INTERLEAVE[1].as_ptr() as *const _);
        for b in 0..blocks {
            let (lo, hi) = block_avx512(
                tab,
                sm.as_ptr().add(BLOCK * b),
                idx.as_ptr().add(BLOCK_BYTES * b),
                esc.as_ptr(),
                &mut used,
            );
            let dst = out.as_mut_ptr().add(2 * BLOCK * b);
            _mm512_storeu_si512(dst as *mut _, _mm512_permutex2var_epi8(lo, perm0, hi));
            _mm512_storeu_si512(dst.add(64) as *mut _, _mm512_permutex2var_epi8(lo, perm1, hi));
        }
    }
    used
}

/// Dots of four coded rows with one f32 vector, each 64-value block decoded into registers
/// ([`block_avx512`]) and fed to the FMAs as it comes: the same lanes, values, order
/// and reduction as `dot4_bf16_avx512` on the decoded rows, so the same bits, without the rows
/// ever being written out. A row's last partial block is decoded by the portable decoder into a
/// zero-padded buffer, as `dot4_bf16_avx512` pads its tail.
///
/// # Safety
/// Requires avx512f/bw/vbmi/vbmi2, bmi2 and popcnt (`has_avx512_decode`); `m` passed `CodedMat::check`;
/// every row index is below `m.rows` and `x.len() == m.cols`.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vbmi2,bmi2,popcnt")]
pub(in crate::backend::cpu) unsafe fn dot4_coded_avx512(m: &CodedMat, rows: [usize; 4], x: &[f32]) -> [f32; 4] {
    let n = x.len();
    let whole = n / BLOCK;
    let parts = rows.map(|r| m.row_parts(r));
    let tab = table_avx512(&m.table);
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut used = [0usize; 4];
    // Row by row: each row's lanes see its values in the same order either way, and one row's
    // accumulator and escape position stay in registers through its blocks.
    for r in 0..4 {
        let (sm, idx, esc) = parts[r];
        let (mut a, mut u) = (acc[r], 0usize);
        for b in 0..whole {
            // SAFETY: block b's 64 values are inside the row and x; the row's parts are consistent.
            unsafe {
                let xp = x.as_ptr().add(BLOCK * b);
                let (lo, hi) =
                    block_avx512(tab, sm.as_ptr().add(64 * b), idx.as_ptr().add(24 * b), esc.as_ptr(), &mut u);
                // Values 16k..16k+16 of the block are byte quarter k: f32 bits = hi << 24 | lo << 16.
                let w0 = _mm512_or_si512(
                    _mm512_slli_epi32::<16>(_mm512_cvtepu8_epi32(_mm512_castsi512_si128(lo))),
                    _mm512_slli_epi32::<24>(_mm512_cvtepu8_epi32(_mm512_castsi512_si128(hi))),
                );
                let w1 = _mm512_or_si512(
                    _mm512_slli_epi32::<16>(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32::<1>(lo))),
                    _mm512_slli_epi32::<24>(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32::<1>(hi))),
                );
                let w2 = _mm512_or_si512(
                    _mm512_slli_epi32::<16>(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32::<2>(lo))),
                    _mm512_slli_epi32::<24>(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32::<2>(hi))),
                );
                let w3 = _mm512_or_si512(
                    _mm512_slli_epi32::<16>(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32::<3>(lo))),
                    _mm512_slli_epi32::<24>(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32::<3>(hi))),
                );
                a = _mm512_fmadd_ps(_mm512_castsi512_ps(w0), _mm512_loadu_ps(xp), a);
                a = _mm512_fmadd_ps(_mm512_castsi512_ps(w1), _mm512_loadu_ps(xp.add(16)), a);
                a = _mm512_fmadd_ps(_mm512_castsi512_ps(w2), _mm512_loadu_ps(xp.add(32)), a);
                a = _mm512_fmadd_ps(_mm512_castsi512_ps(w3), _mm512_loadu_ps(xp.add(48)), a);
            }
        }
        (acc[r], used[r]) = (a, u);
    }
    let done = whole * BLOCK;
    if done < n {
        let xb: Vec<f32> = (done..done + BLOCK).map(|i| if i < n { x[i] } else { 0.0 }).collect();
        for r in 0..4 {
            let (sm, idx, esc) = parts[r];
            let mut tail = [0u8; 2 * 64];
            decode_portable(&m.table, &sm[done..], &idx[whole * 24..], &esc[used[r]..], &mut tail[..2 * (n - done)], 0);
            for k in 0..(n - done).div_ceil(LANES) {
                // SAFETY: the buffers hold 64 values; chunk k < 4.
                unsafe {
                    let xv = _mm512_loadu_ps(xb.as_ptr().add(LANES * k));
                    acc[r] = _mm512_fmadd_ps(bf16x16_512(tail.as_ptr().add(32 * k)), xv, acc[r]);
                }
            }
        }
    }
    // SAFETY: avx512f is enabled for this function.
    unsafe { acc.map(|a| reduce512(a)) }
}
