//! The lossless coded trunk (`--trunk coded`): a bf16 matrix in 11 bits per value plus one byte
//! per escape, decoded back to the **same bf16 bits** a few rows at a time inside the kernels.
//!
//! A bf16 value is sign (1 bit), exponent (8) and mantissa (7). Trained weights use few distinct
//! exponents, so each matrix keeps a table of its 7 most frequent exponents and stores per value:
//! - `sm`: one byte, sign << 7 | mantissa;
//! - `idx`: a 3-bit index into the table as three bit planes: per row, blocks of 64 values in three
//!   little-endian u64 (plane `p`'s bit `j` is bit `p` of value `j`'s index; a row's last block is
//!   zero-padded) — AVX-512 reads each plane as a mask register, a portable decoder spreads it
//!   eight values at a time;
//! - index 7 is an escape: the value's exponent is the next byte of the row's escape list (`esc`,
//!   in column order; `esc_start[r]..esc_start[r + 1]` are row `r`'s bytes).
//!
//! Why this code and not an entropy code (Huffman / ANS over the exponent, DFloat11's ~10.6-11
//! bits) or the 4-bit index it replaced (12 bits, 76% of bf16): it decodes with no bit-serial
//! dependency — 64 values per step from three mask loads, one byte permute and one expand-load of
//! the escapes — and it is at most 72% of bf16 on trained weights (measured in docs/trunk.md).
//! The decoders: [`portable`] here (the reference) and each instruction set's block decoder with
//! its kernels (`cpu/x86/coded.rs`, `cpu/neon/coded.rs`); `CodedMat::decode_row_bf16` (in
//! `cpu::coded`) runs a row through the best one the CPU has.
//!
//! Contract: [`CodedMat::decode_row_bf16`] returns exactly the bf16 bits that
//! [`CodedMat::encode`] was given, for every row (tested on every exponent and on escapes), and
//! [`CodedMat::check`] accepts only parts the decoders can read without going out of bounds.

use super::SharedBytes;
use rayon::prelude::*;

pub mod portable;

/// The escape index.
pub const ESCAPE: u8 = 7;
/// Values per bit-plane block.
pub const BLOCK: usize = 64;
/// Bytes of one block's three planes.
pub const BLOCK_BYTES: usize = 24;

/// A coded bf16 matrix, [rows, cols] row-major.
#[derive(Clone, Debug)]
pub struct CodedMat {
    pub rows: usize,
    pub cols: usize,
    /// Exponents of indices 0..7 (entry 7, the escape, is unused: 0).
    pub table: [u8; 8],
    /// rows * cols bytes: sign << 7 | mantissa.
    pub sm: SharedBytes,
    /// rows * idx_row(cols) bytes of index bit planes.
    pub idx: SharedBytes,
    /// rows + 1 little-endian u32: each row's first escape.
    pub esc_start: SharedBytes,
    /// One exponent byte per escape.
    pub esc: SharedBytes,
}

/// Bytes of index planes per row of `cols` values.
pub fn idx_row(cols: usize) -> usize {
    cols.div_ceil(BLOCK) * BLOCK_BYTES
}

#[inline]
fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
}

#[inline]
pub(crate) fn u64_at(b: &[u8], i: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[8 * i..8 * i + 8]);
    u64::from_le_bytes(w)
}

/// The coded form's parts as plain vectors (what [`CodedMat::encode`] builds and a pack file stores).
pub struct CodedParts {
    pub table: [u8; 8],
    pub sm: Vec<u8>,
    pub idx: Vec<u8>,
    pub esc_start: Vec<u8>,
    pub esc: Vec<u8>,
}

/// The 7 most frequent exponents of a histogram (ties: the lower exponent), ascending.
pub fn exponent_table(hist: &[u64; 256]) -> [u8; 8] {
    let mut order: Vec<usize> = (0..256).filter(|&e| hist[e] > 0).collect();
    order.sort_by(|&a, &b| hist[b].cmp(&hist[a]).then(a.cmp(&b)));
    order.truncate(7);
    order.sort_unstable();
    let mut t = [0u8; 8];
    for (i, &e) in order.iter().enumerate() {
        t[i] = e as u8;
    }
    // Unused indices repeat the first exponent (never produced by the encoder).
    for i in order.len()..7 {
        t[i] = t[0];
    }
    t
}

/// Histogram of the exponents of bf16 bytes.
pub fn exponent_histogram(bf16: &[u8]) -> [u64; 256] {
    bf16.par_chunks(1 << 16)
        .map(|c| {
            let mut h = [0u64; 256];
            for v in c.chunks_exact(2) {
                h[(((v[1] as usize) << 1) | ((v[0] as usize) >> 7)) & 0xff] += 1;
            }
            h
        })
        .reduce(
            || [0u64; 256],
            |mut a, b| {
                for (x, y) in a.iter_mut().zip(b) {
                    *x += y;
                }
                a
            },
        )
}

/// Mean bits per value of a Huffman code over the exponent histogram plus the 8 bits of sign and
/// mantissa: what an entropy-coded exponent (DFloat11's kind of code) would take, for comparison
/// with this code's 12 bits and escapes.
pub fn huffman_bits(hist: &[u64; 256]) -> f64 {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let total: u64 = hist.iter().sum();
    if total == 0 {
        return 0.0;
    }
    // Each merge adds its weight once to the total code length (one more bit for every value below).
    let mut heap: BinaryHeap<Reverse<u64>> = hist.iter().filter(|&&n| n > 0).map(|&n| Reverse(n)).collect();
    let mut bits = 0u64;
    while heap.len() > 1 {
        let (Some(Reverse(a)), Some(Reverse(b))) = (heap.pop(), heap.pop()) else { break };
        bits += a + b;
        heap.push(Reverse(a + b));
    }
    8.0 + bits as f64 / total as f64
}

/// The Shannon entropy of the exponent histogram in bits, plus 8 (the bound no exponent code beats).
pub fn entropy_bits(hist: &[u64; 256]) -> f64 {
    let total: u64 = hist.iter().sum();
    let t = total as f64;
    8.0 + hist.iter().filter(|&&n| n > 0).map(|&n| -(n as f64 / t) * (n as f64 / t).log2()).sum::<f64>()
}

impl CodedParts {
    /// Codes a row-major bf16 matrix (`bf16.len() == rows * cols * 2`).
    pub fn encode(bf16: &[u8], rows: usize, cols: usize) -> CodedParts {
        assert_eq!(bf16.len(), rows * cols * 2, "bf16 matrix size");
        let table = exponent_table(&exponent_histogram(bf16));
        let mut index = [ESCAPE; 256];
        for (i, &e) in table[..7].iter().enumerate().rev() {
            index[e as usize] = i as u8;
        }
        let ir = idx_row(cols);
        let mut sm = vec![0u8; rows * cols];
        let mut idx = vec![0u8; rows * ir];
        let mut escs: Vec<Vec<u8>> = vec![Vec::new(); rows];
        if cols > 0 {
            sm.par_chunks_mut(cols).zip(idx.par_chunks_mut(ir)).zip(escs.par_iter_mut()).enumerate().for_each(
                |(r, ((smr, idxr), esc))| {
                    let row = &bf16[r * cols * 2..(r + 1) * cols * 2];
                    let mut planes = vec![[0u64; 3]; cols.div_ceil(BLOCK)];
                    for c in 0..cols {
                        let bits = u16::from_le_bytes([row[2 * c], row[2 * c + 1]]);
                        let e = ((bits >> 7) & 0xff) as u8;
                        smr[c] = ((bits >> 8) as u8 & 0x80) | (bits as u8 & 0x7f);
                        let i = index[e as usize];
                        if i == ESCAPE {
                            esc.push(e);
                        }
                        for (p, w) in planes[c / BLOCK].iter_mut().enumerate() {
                            *w |= (((i >> p) & 1) as u64) << (c % BLOCK);
                        }
                    }
                    for (dst, p) in idxr.chunks_exact_mut(BLOCK_BYTES).zip(&planes) {
                        for (d, w) in dst.chunks_exact_mut(8).zip(p) {
                            d.copy_from_slice(&w.to_le_bytes());
                        }
                    }
                },
            );
        }
        let mut esc_start = Vec::with_capacity(4 * (rows + 1));
        let mut esc = Vec::new();
        let mut n = 0u32;
        for e in &escs {
            esc_start.extend(n.to_le_bytes());
            esc.extend_from_slice(e);
            n += e.len() as u32;
        }
        esc_start.extend(n.to_le_bytes());
        CodedParts { table, sm, idx, esc_start, esc }
    }
}

/// Escapes (index 7) among the first `cols` values of one row's index planes.
pub fn row_escapes(idx: &[u8], cols: usize) -> usize {
    (0..cols.div_ceil(BLOCK))
        .map(|b| {
            let m = u64_at(idx, 3 * b) & u64_at(idx, 3 * b + 1) & u64_at(idx, 3 * b + 2);
            let valid = cols - b * BLOCK;
            let m = if valid < BLOCK { m & ((1u64 << valid) - 1) } else { m };
            m.count_ones() as usize
        })
        .sum()
}

impl CodedMat {
    /// Codes a row-major bf16 matrix into owned buffers.
    pub fn encode(bf16: &[u8], rows: usize, cols: usize) -> CodedMat {
        let p = CodedParts::encode(bf16, rows, cols);
        CodedMat {
            rows,
            cols,
            table: p.table,
            sm: SharedBytes::from_vec(p.sm),
            idx: SharedBytes::from_vec(p.idx),
            esc_start: SharedBytes::from_vec(p.esc_start),
            esc: SharedBytes::from_vec(p.esc),
        }
    }

    /// Checks that the parts have the sizes `rows` x `cols` needs and that every row's escape
    /// bytes are exactly as many as its escape indices (what a pack file's reader calls before any
    /// kernel sees the matrix: the decoders read a row's escapes without further bounds checks).
    pub fn check(&self) -> Result<(), String> {
        let (r, c) = (self.rows, self.cols);
        if self.sm.len() != r * c || self.idx.len() != r * idx_row(c) || self.esc_start.len() != 4 * (r + 1) {
            return Err(format!("coded parts do not fit a {r} x {c} matrix"));
        }
        let n = self.esc.len();
        if u32_at(&self.esc_start, 0) != 0 || u32_at(&self.esc_start, r) as usize != n {
            return Err("escape starts do not cover the escape list".into());
        }
        let ir = idx_row(c);
        let bad = (0..r).into_par_iter().find_first(|&i| {
            let (a, b) = (u32_at(&self.esc_start, i), u32_at(&self.esc_start, i + 1));
            b < a || (b - a) as usize != row_escapes(&self.idx[i * ir..(i + 1) * ir], c)
        });
        match bad {
            Some(i) => Err(format!("row {i}'s escape list does not match its escape indices")),
            None => Ok(()),
        }
    }

    /// Row `r`'s sign/mantissa bytes, index planes and escape bytes.
    #[inline]
    pub fn row_parts(&self, r: usize) -> (&[u8], &[u8], &[u8]) {
        let ir = idx_row(self.cols);
        let (a, b) = (u32_at(&self.esc_start, r) as usize, u32_at(&self.esc_start, r + 1) as usize);
        (&self.sm[r * self.cols..(r + 1) * self.cols], &self.idx[r * ir..(r + 1) * ir], &self.esc[a..b])
    }

    /// Bytes held by the coded form.
    pub fn byte_len(&self) -> usize {
        8 + self.sm.len() + self.idx.len() + self.esc_start.len() + self.esc.len()
    }

    /// Escapes in the whole matrix.
    pub fn escape_count(&self) -> usize {
        self.esc.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_bf16_value_round_trips_with_escapes() {
        // Every one of the 65536 bf16 bit patterns (NaNs, infinities, subnormals, both zeros),
        // in rows of several widths (whole blocks, a padded last block, narrower than a block):
        // far more than 7 exponents, so most values escape.
        let all: Vec<u8> = (0..=u16::MAX).flat_map(|b| b.to_le_bytes()).collect();
        for cols in [1024, 37, 200, 64 * 3 + 63] {
            let rows = 65536 / cols;
            let m = CodedMat::encode(&all[..2 * rows * cols], rows, cols);
            m.check().unwrap();
            assert!(m.escape_count() > rows * cols / 2);
            let mut row = vec![0u8; 2 * cols];
            for r in 0..rows {
                m.decode_row_bf16(r, &mut row);
                assert_eq!(row, &all[r * cols * 2..(r + 1) * cols * 2], "cols {cols} row {r}");
            }
        }
    }

    #[test]
    fn check_refuses_escape_lists_that_do_not_match() {
        let all: Vec<u8> = (0..4096u16).flat_map(|b| (b.wrapping_mul(40503)).to_le_bytes()).collect();
        let p = CodedParts::encode(&all, 32, 128);
        let mk = |esc: Vec<u8>, esc_start: Vec<u8>| CodedMat {
            rows: 32,
            cols: 128,
            table: p.table,
            sm: SharedBytes::from_vec(p.sm.clone()),
            idx: SharedBytes::from_vec(p.idx.clone()),
            esc_start: SharedBytes::from_vec(esc_start),
            esc: SharedBytes::from_vec(esc),
        };
        mk(p.esc.clone(), p.esc_start.clone()).check().unwrap();
        let mut short = p.esc.clone();
        short.pop();
        assert!(mk(short, p.esc_start.clone()).check().is_err());
        let mut shifted = p.esc_start.clone();
        shifted[4..8].copy_from_slice(&(u32_at(&p.esc_start, 1) + 1).to_le_bytes());
        assert!(mk(p.esc.clone(), shifted).check().is_err());
    }

    #[test]
    fn huffman_and_entropy_of_a_histogram() {
        let mut h = [0u64; 256];
        (h[120], h[121], h[122], h[123]) = (4, 2, 1, 1);
        // Code lengths 1, 2, 3, 3: (4 + 4 + 3 + 3) / 8 = 1.75 bits, which is also the entropy.
        assert!((huffman_bits(&h) - 9.75).abs() < 1e-12);
        assert!((entropy_bits(&h) - 9.75).abs() < 1e-12);
    }

    #[test]
    fn few_exponents_need_no_escape() {
        let v: Vec<u8> =
            (0..4096u32).flat_map(|i| half::bf16::from_f32(((i % 7) as f32 - 3.0) * 0.3).to_le_bytes()).collect();
        let m = CodedMat::encode(&v, 64, 64);
        assert_eq!(m.escape_count(), 0);
        assert!(m.byte_len() <= v.len() * 11 / 16 + 64 * 4 + 64);
    }
}
