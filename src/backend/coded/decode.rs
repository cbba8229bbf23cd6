//! Decoding a coded row back to its bf16 bits (`super` has the format): 64 values per step with
//! AVX-512 (BW, VBMI, VBMI2: mask registers, byte permutes, expand-loads) where the CPU has it or
//! with NEON (`super::neon`, every aarch64 CPU), else eight at a time by the portable reference
//! decoder. Both give the original bits exactly, so
//! which one runs never changes a result (no `--isa` choice is needed; the unit test holds them
//! equal).
//!
//! Contract: given a row's parts that `CodedMat::check` accepted (one escape byte per escape
//! index, in order), [`decode_bf16`] writes the row's original bf16 bytes and reads nothing
//! outside the parts.

use super::{BLOCK, BLOCK_BYTES, u64_at};

/// Values per block (for the fused kernels, which name it from here).
pub const BLOCK_VALUES: usize = BLOCK;

/// Decodes one row — sign/mantissa bytes, index planes and the row's escape bytes — to bf16
/// bytes. The row's parts must be consistent (`CodedMat::check`): `esc` holds exactly one byte per
/// escape index among the row's values.
pub fn decode_bf16(table: &[u8; 8], sm: &[u8], idx: &[u8], esc: &[u8], out: &mut [u8]) {
    let cols = sm.len();
    assert_eq!(out.len(), 2 * cols);
    assert_eq!(idx.len(), cols.div_ceil(BLOCK) * BLOCK_BYTES);
    #[cfg(target_arch = "x86_64")]
    if cols >= BLOCK && has_avx512_decode() {
        let whole = cols / BLOCK;
        // SAFETY: the features were detected; the kernel reads and writes whole blocks only
        // (`whole` of them), and their escape bytes are a prefix of `esc`, which it reads through
        // expand-loads of exactly as many bytes as each block has escape indices.
        let used = unsafe { decode_blocks_avx512(table, sm, idx, esc, out, whole) };
        return decode_portable(table, sm, idx, &esc[used..], out, whole * BLOCK);
    }
    #[cfg(target_arch = "aarch64")]
    if cols >= BLOCK && std::arch::is_aarch64_feature_detected!("neon") {
        let whole = cols / BLOCK;
        // SAFETY: neon was detected; the parts are consistent (the caller's contract) and hold
        // `whole` whole blocks, whose escape bytes are a prefix of `esc`.
        let used = unsafe { super::neon::decode_blocks(table, sm, idx, esc, out, whole) };
        return decode_portable(table, sm, idx, &esc[used..], out, whole * BLOCK);
    }
    decode_portable(table, sm, idx, esc, out, 0)
}

/// Byte `j` of `SPREAD[b]` is bit `j` of `b`: eight plane bits to eight index bytes at once.
pub(super) const SPREAD: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut b = 0;
    while b < 256 {
        let mut j = 0;
        while j < 8 {
            t[b] |= (((b >> j) & 1) as u64) << (8 * j);
            j += 1;
        }
        b += 1;
    }
    t
};

/// The reference decoder, from value `from` (a block boundary) to the end of the row; `esc` starts
/// at the first escape at or after `from`.
pub fn decode_portable(table: &[u8; 8], sm: &[u8], idx: &[u8], esc: &[u8], out: &mut [u8], from: usize) {
    let cols = sm.len();
    let mut k = 0;
    for b in from / BLOCK..cols.div_ceil(BLOCK) {
        let p = [u64_at(idx, 3 * b), u64_at(idx, 3 * b + 1), u64_at(idx, 3 * b + 2)];
        for g in 0..8 {
            let c0 = b * BLOCK + 8 * g;
            if c0 >= cols {
                break;
            }
            let bytes = p.map(|w| (w >> (8 * g)) as u8);
            let ids = SPREAD[bytes[0] as usize] | SPREAD[bytes[1] as usize] << 1 | SPREAD[bytes[2] as usize] << 2;
            for j in 0..8.min(cols - c0) {
                let i = (ids >> (8 * j)) as u8 & 7;
                let e = if i == 7 {
                    k += 1;
                    esc[k - 1]
                } else {
                    table[i as usize]
                };
                let (c, s) = (c0 + j, sm[c0 + j]);
                out[2 * c] = (s & 0x7f) | ((e & 1) << 7);
                out[2 * c + 1] = (s & 0x80) | (e >> 1);
            }
        }
    }
}

/// Whether this CPU has the AVX-512 parts the block decoder uses (mask registers, byte permutes,
/// byte expands; BMI2 for the escape load's mask).
#[cfg(target_arch = "x86_64")]
pub fn has_avx512_decode() -> bool {
    use std::sync::OnceLock;
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
#[cfg(target_arch = "x86_64")]
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
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vbmi2,bmi2,popcnt")]
#[inline]
pub unsafe fn block_avx512(
    tab: std::arch::x86_64::__m512i,
    sm: *const u8,
    idx: *const u8,
    esc: *const u8,
    used: &mut usize,
) -> (std::arch::x86_64::__m512i, std::arch::x86_64::__m512i) {
    use std::arch::x86_64::*;
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
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub fn table_avx512(table: &[u8; 8]) -> std::arch::x86_64::__m512i {
    std::arch::x86_64::_mm512_set1_epi64(i64::from_le_bytes(*table))
}

/// The first `blocks` whole blocks to bf16 bytes ([`block_avx512`], then two two-source permutes
/// interleave the low and high bytes). Returns the escape bytes consumed.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vbmi2,bmi2,popcnt")]
unsafe fn decode_blocks_avx512(
    table: &[u8; 8],
    sm: &[u8],
    idx: &[u8],
    esc: &[u8],
    out: &mut [u8],
    blocks: usize,
) -> usize {
    use std::arch::x86_64::*;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::coded::CodedMat;

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
            decode_bf16(&m.table, sm, idx, esc, &mut a);
            decode_portable(&m.table, sm, idx, esc, &mut b, 0);
            assert_eq!(a, b, "row {r}");
            assert_eq!(a, &v[2 * r * cols..2 * (r + 1) * cols], "row {r}");
        }
    }
}
