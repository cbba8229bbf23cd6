//! The coded trunk's portable decoder (`super` has the format): a row's values eight at a time,
//! their three index bits spread to index bytes by one table ([`SPREAD`]), the reference every
//! instruction set's block decoder gives the bytes of (`cpu/x86/coded.rs`, `cpu/neon/coded.rs`;
//! `cpu::coded` chooses the decoder a row runs through and holds them equal in its tests).
//!
//! Contract: given a row's parts that `CodedMat::check` accepted (one escape byte per escape
//! index, in order), [`decode_portable`] writes the row's original bf16 bytes from the given
//! block on and reads nothing outside the parts.

use super::{BLOCK, u64_at};

/// Byte `j` of `SPREAD[b]` is bit `j` of `b`: eight plane bits to eight index bytes at once.
pub const SPREAD: [u64; 256] = {
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
