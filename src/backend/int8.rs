//! The opt-in int8 trunk (`--trunk int8`): each bf16 matrix row as int8 codes and one f32 scale,
//! per-row absmax as the published system converts its trunk. It is **not exact**: the model it
//! runs is not the shipped model, and every front end labels it so; `score --compare` measures
//! what it costs.
//!
//! Contract: `scale = absmax(row) / 127` (0 for an all-zero row), `q = round(w / scale)` (half away
//! from zero) in -127..=127, and the value a kernel uses is `q as f32 * scale` (one f32 rounding).
//! Quantising is a pure function of the bf16 bytes, so every run and thread count gets the same
//! matrix, and the products over it are as deterministic as the bf16 ones.

use rayon::prelude::*;

/// An int8 matrix with one scale per row, [rows, cols] row-major.
#[derive(Debug)]
pub struct Int8Mat {
    pub q: Vec<i8>,
    pub scales: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
}

impl Int8Mat {
    /// Quantises a row-major bf16 matrix (`bf16.len() == rows * cols * 2`).
    pub fn quantize(bf16: &[u8], rows: usize, cols: usize) -> Int8Mat {
        assert_eq!(bf16.len(), rows * cols * 2, "bf16 matrix size");
        let mut q = vec![0i8; rows * cols];
        let mut scales = vec![0f32; rows];
        if cols > 0 {
            q.par_chunks_mut(cols).zip(scales.par_iter_mut()).enumerate().for_each(|(r, (qr, s))| {
                let row = &bf16[r * cols * 2..(r + 1) * cols * 2];
                let v = |i: usize| f32::from_bits((u16::from_le_bytes([row[2 * i], row[2 * i + 1]]) as u32) << 16);
                let absmax = (0..cols).map(|i| v(i).abs()).fold(0f32, f32::max);
                *s = absmax / 127.0;
                if *s > 0.0 && s.is_finite() {
                    for (i, qi) in qr.iter_mut().enumerate() {
                        *qi = (v(i) / *s).round().clamp(-127.0, 127.0) as i8;
                    }
                }
            });
        }
        Int8Mat { q, scales, rows, cols }
    }

    /// Row `r` as the f32 values the kernels use (`q * scale`).
    #[inline]
    pub fn decode_row(&self, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols);
        let s = self.scales[r];
        for (o, &q) in out.iter_mut().zip(&self.q[r * self.cols..(r + 1) * self.cols]) {
            *o = f32::from(q) * s;
        }
    }

    /// Bytes held (codes and scales).
    pub fn byte_len(&self) -> usize {
        self.q.len() + 4 * self.scales.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf16(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect()
    }

    #[test]
    fn per_row_absmax() {
        let m = Int8Mat::quantize(&bf16(&[1.0, -0.5, 0.25, 0.0, 0.0, 0.0, -2.0, 1.0]), 2, 4);
        assert_eq!(m.scales, vec![1.0 / 127.0, 2.0 / 127.0]);
        assert_eq!(&m.q[..4], &[127, -64, 32, 0]);
        assert_eq!(&m.q[4..], &[0, 0, -127, 64]);
        let mut row = [0f32; 4];
        m.decode_row(1, &mut row);
        assert_eq!(row, [0.0, 0.0, -127.0 * (2.0 / 127.0), 64.0 * (2.0 / 127.0)]);
        // An all-zero row stays zero.
        let z = Int8Mat::quantize(&bf16(&[0.0; 3]), 1, 3);
        assert_eq!((z.q.as_slice(), z.scales[0]), (&[0i8, 0, 0][..], 0.0));
    }
}
