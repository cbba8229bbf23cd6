//! Kernels against the scalar reference: every instruction set must give bit-identical results
//! (the operation order is part of the kernels' contract), on random shapes including sizes that
//! are not multiples of the SIMD width; matrix-matrix products must equal matrix-vector products
//! bit for bit; and the scalar kernels must agree with a plain f64 computation. Every kernel family
//! of `cpu/families.rs` runs on every instruction set the machine has (under qemu-aarch64 in CI:
//! the NEON forms).

mod common;
use common::Rng;
use deltafin::backend::{Bf16Mat, Mxfp4Mat};
use deltafin::cpu::*;

fn bf16_bytes(rng: &mut Rng, n: usize) -> (Vec<u8>, Vec<f64>) {
    let mut bytes = Vec::with_capacity(2 * n);
    let mut vals = Vec::with_capacity(n);
    for _ in 0..n {
        let bits = (rng.f32().to_bits() >> 16) as u16;
        bytes.extend_from_slice(&bits.to_le_bytes());
        vals.push(f32::from_bits((bits as u32) << 16) as f64);
    }
    (bytes, vals)
}

/// Random MXFP4 matrix with scales near 2^-3 (plus the extremes 0 and 254 now and then).
fn mxfp4(rng: &mut Rng, rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>) {
    let packed = rng.bytes(rows * cols / 2);
    let scales = (0..rows * cols / 32)
        .map(|_| match rng.below(50) {
            0 => 0u8,
            1 => 140,
            _ => 120 + rng.below(8) as u8,
        })
        .collect();
    (packed, scales)
}

const SHAPES: [(usize, usize); 10] =
    [(1, 1), (3, 7), (4, 16), (5, 17), (9, 33), (16, 64), (13, 100), (33, 257), (64, 1000), (7, 1300)];

#[test]
fn bf16_products_are_bit_identical_across_isas_and_match_f64() {
    let mut rng = Rng(1);
    for &(rows, cols) in &SHAPES {
        let (w, wv) = bf16_bytes(&mut rng, rows * cols);
        let m = Bf16Mat::from_vec(w.clone(), rows, cols);
        let x = rng.vec(cols);
        let mut want = vec![0f32; rows];
        matvec_bf16_isa(Isa::Scalar, &m, &x, &mut want);
        for r in 0..rows {
            let exact: f64 = (0..cols).map(|c| wv[r * cols + c] * x[c] as f64).sum();
            let tol = 1e-5 * (0..cols).map(|c| (wv[r * cols + c] * x[c] as f64).abs()).sum::<f64>() + 1e-30;
            assert!(
                (want[r] as f64 - exact).abs() <= tol,
                "scalar bf16 row {r} of {rows}x{cols}: {} vs {exact}",
                want[r]
            );
        }
        for isa in Isa::available() {
            let mut got = vec![0f32; rows];
            matvec_bf16_isa(isa, &m, &x, &mut got);
            assert_eq!(bits(&got), bits(&want), "matvec bf16 {rows}x{cols} on {isa:?}");
            // Several input rows at once must give each row's matvec result.
            for n in [2usize, 3, 5, 9, 17] {
                let xs = rng.vec(n * cols);
                let mut mm = vec![0f32; n * rows];
                matmul_bf16_isa(isa, &m, &xs, &mut mm);
                for i in 0..n {
                    let mut one = vec![0f32; rows];
                    matvec_bf16_isa(Isa::Scalar, &m, &xs[i * cols..(i + 1) * cols], &mut one);
                    assert_eq!(
                        bits(&mm[i * rows..(i + 1) * rows]),
                        bits(&one),
                        "matmul bf16 n={n} {rows}x{cols} on {isa:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn mxfp4_products_are_bit_identical_across_isas_and_match_f64() {
    let mut rng = Rng(2);
    for &(rows, cols) in &[(1usize, 32usize), (3, 64), (4, 96), (7, 128), (16, 32), (17, 288), (40, 512), (9, 1056)] {
        let (p, s) = mxfp4(&mut rng, rows, cols);
        let m = Mxfp4Mat::new(&p, &s, rows, cols);
        let x = rng.vec(cols);
        let mut xd = vec![0f32; cols];
        deinterleave_mxfp4_input(&x, &mut xd);
        let mut want = vec![0f32; rows];
        matvec_mxfp4_isa(Isa::Scalar, &m, &xd, &mut want);
        // Plain f64 dequantise-and-dot in the natural element order.
        for r in 0..rows {
            let mut exact = 0f64;
            let mut mag = 0f64;
            for c in 0..cols {
                let byte = p[r * cols / 2 + c / 2];
                let code = if c % 2 == 0 { byte & 15 } else { byte >> 4 };
                let w = E2M1[code as usize] as f64 * 2f64.powi(s[r * cols / 32 + c / 32] as i32 - 127);
                exact += w * x[c] as f64;
                mag += (w * x[c] as f64).abs();
            }
            assert!(
                (want[r] as f64 - exact).abs() <= 1e-5 * mag + 1e-35,
                "scalar mxfp4 row {r}: {} vs {exact}",
                want[r]
            );
        }
        for isa in Isa::available() {
            let mut got = vec![0f32; rows];
            matvec_mxfp4_isa(isa, &m, &xd, &mut got);
            assert_eq!(bits(&got), bits(&want), "matvec mxfp4 {rows}x{cols} on {isa:?}");
            // 2..=8 rows: weights decoded in registers (AVX-512); more: a band decoded to f32,
            // its inputs a block of 32 rows at a time (67: three blocks, the last short).
            for n in [2usize, 3, 4, 5, 7, 8, 9, 13, 32, 33, 67] {
                let mut xs = vec![0f32; n * cols];
                for i in 0..n {
                    deinterleave_mxfp4_input(&rng.vec(cols), &mut xs[i * cols..(i + 1) * cols]);
                }
                let mut mm = vec![0f32; n * rows];
                matmul_mxfp4_isa(isa, &m, &xs, &mut mm);
                for i in 0..n {
                    let mut one = vec![0f32; rows];
                    matvec_mxfp4_isa(Isa::Scalar, &m, &xs[i * cols..(i + 1) * cols], &mut one);
                    assert_eq!(
                        bits(&mm[i * rows..(i + 1) * rows]),
                        bits(&one),
                        "matmul mxfp4 n={n} {rows}x{cols} on {isa:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn mxfp4_row_decode_is_exact() {
    let mut rng = Rng(3);
    let (p, s) = mxfp4(&mut rng, 1, 64);
    let mut out = vec![0f32; 64];
    decode_mxfp4_row(&p, &s, &mut out);
    for c in 0..64 {
        let code = if c % 2 == 0 { p[c / 2] & 15 } else { p[c / 2] >> 4 };
        let want = E2M1[code as usize] as f64 * 2f64.powi(s[c / 32] as i32 - 127);
        // Deinterleaved position of natural element c.
        let pos = (c / 32) * 32 + if c % 2 == 0 { (c % 32) / 2 } else { 16 + (c % 32) / 2 };
        assert_eq!(out[pos] as f64, want, "element {c}");
    }
}

#[test]
fn f32_dot_matches_f64() {
    let mut rng = Rng(4);
    for n in [0usize, 1, 15, 16, 17, 31, 100, 1023] {
        let a = rng.vec(n);
        let b = rng.vec(n);
        let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
        let mag: f64 = a.iter().zip(&b).map(|(x, y)| (*x as f64 * *y as f64).abs()).sum();
        assert!((dot_f32(&a, &b) as f64 - exact).abs() <= 1e-5 * mag + 1e-30, "n={n}");
    }
}

/// SiTU's vector kernels against the scalar loop: a fine grid over every branch of its `tanh`,
/// `sigmoid` and `exp` (the thresholds at ln2/2, 9, -80, -87 and 88.7 included), the values next to
/// each threshold, zeros, subnormals, infinities, NaNs and random bit patterns, at lengths that
/// leave every tail; with and without the linear beta. NaN must stay NaN (payloads may differ).
#[test]
fn situ_is_bit_identical_across_isas() {
    use deltafin::backend::Situ;
    let mut rng = Rng(5);
    let mut vals: Vec<f32> = (0..=40_000).map(|i| -200.0 + i as f32 * 0.01).collect();
    // tanh's series / exp switch at g = beta ln2 / 4 (betas 4 and 0.75), exp's overflow at 88.72.
    let ln2 = std::f32::consts::LN_2;
    for t in [0.0f32, ln2, ln2 * 0.1875, 9.0, 36.0, 80.0, 87.0, f32::from_bits(0x42b1_70a4), 225.0, 1e-30, 1e-3] {
        for v in [t, -t] {
            let b = v.to_bits();
            vals.extend((b.saturating_sub(4)..=b.saturating_add(4)).map(f32::from_bits));
        }
    }
    vals.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN, f32::MIN_POSITIVE, 1e-40, -1e-40, f32::MAX]);
    vals.extend((0..20_000).map(|_| f32::from_bits(rng.next_u64() as u32)));
    vals.extend((0..20_000).map(|_| rng.f32() * 120.0));
    // The up values: the gate values in another order (every pair of kinds meets).
    let ups: Vec<f32> = (0..vals.len()).map(|i| vals[(i * 7919) % vals.len()]).collect();
    for situ in [
        Situ { beta: 4.0, linear_beta: 25.0 },
        Situ { beta: 4.0, linear_beta: 0.0 },
        Situ { beta: 0.75, linear_beta: 3.0 },
    ] {
        for len in [vals.len(), 1, 15, 16, 17, 33, 1000] {
            let (g, u) = (&vals[vals.len() - len..], &ups[..len]);
            let mut want = vec![0f32; len];
            ops::situ_rows_isa(Isa::Scalar, situ, g, u, &mut want);
            for isa in Isa::available() {
                let mut got = vec![0f32; len];
                ops::situ_rows_isa(isa, situ, g, u, &mut got);
                for i in 0..len {
                    let same = got[i].to_bits() == want[i].to_bits() || (got[i].is_nan() && want[i].is_nan());
                    assert!(same, "situ {situ:?} on {isa:?}: ({}, {}) -> {} vs {}", g[i], u[i], got[i], want[i]);
                }
            }
        }
    }
}

/// Every kernel family, through its public entry point, on every instruction set this machine has:
/// the scalar bits (an x86 machine runs AVX2 and AVX-512, an aarch64 one NEON).
#[test]
fn every_kernel_family_gives_the_scalar_bits_on_every_isa() {
    let isas = Isa::available();
    eprintln!("instruction sets: {isas:?}");
    for f in families::FAMILIES {
        let want = (f.probe)(Isa::Scalar);
        for &isa in &isas {
            let got = (f.probe)(isa);
            assert_eq!(got.is_some(), want.is_some(), "{}", f.name);
            if let (Some(got), Some(want)) = (&got, &want) {
                assert!(!want.is_empty(), "{}: an empty probe", f.name);
                let first = got.iter().zip(want).position(|(a, b)| a != b);
                assert!(
                    got.len() == want.len() && first.is_none(),
                    "{} on {isa:?} ({:?}): element {first:?} differs from the scalar bits",
                    f.name,
                    f.form(isa)
                );
            }
        }
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}
