//! The CPU backend's kernel families and the form each takes on each instruction set: the list
//! that makes a missing form a failing test on any machine, and the probes that run every family
//! on every instruction set a machine has.
//!
//! Contract: [`FAMILIES`] names every kernel family of the tables in `dispatch.rs` and, for every
//! instruction set ([`Isa::ALL`]), the kernel that runs: [`Form::Native`] names a function by its
//! path under `src/backend/`; [`Form::Composed`] says which other kernels build the family there;
//! [`Form::Reference`] is the scalar definition. The tests (`families/tests.rs`) hold the list to
//! the code: every family lists a form for every instruction set, every family with a native x86
//! form has a native NEON form, every named kernel is defined in its file and called from another,
//! every `#[target_feature]` kernel of the SIMD files is on the list, and the instruction sets
//! with a native form are the ones with a kernel in the family's table.
//! [`Family::probe`] runs the family through its public entry point with a given instruction set
//! on fixed inputs (shapes with tails) and returns the result's bits, which must equal the scalar
//! ones (tests/kernels.rs runs every family on every instruction set the machine has).

use super::{Isa, ops};
use crate::backend::coded::CodedMat;
use crate::backend::int8::Int8Mat;
use crate::backend::types::{Bf16Mat, Mxfp4Mat, Situ};
use std::sync::Arc;

/// How an instruction set runs a kernel family.
#[derive(Clone, Copy, Debug)]
pub enum Form {
    /// Its own kernel: `file.rs::function`, the file relative to `src/backend/`.
    Native(&'static str),
    /// Built from other families' kernels on that instruction set (said how).
    Composed(&'static str),
    /// The scalar definition.
    Reference(&'static str),
}

/// One kernel family: what it computes and its form per instruction set.
pub struct Family {
    pub name: &'static str,
    pub what: &'static str,
    /// The form on each instruction set, every one of [`Isa::ALL`] listed once.
    pub forms: &'static [(Isa, Form)],
    /// The family's output bits on fixed inputs with `isa` (`None`: nothing bit-comparable).
    pub probe: fn(Isa) -> Option<Vec<u32>>,
}

impl Family {
    /// The form on `isa` (a family that lists none fails `every_family_has_a_form_on_every_isa`).
    pub fn form(&self, isa: Isa) -> Form {
        self.forms
            .iter()
            .find(|(i, _)| *i == isa)
            .map(|&(_, f)| f)
            .unwrap_or_else(|| panic!("{} lists no form on {isa:?}", self.name))
    }
}

use Form::{Composed, Native, Reference};

/// Every kernel family (see the module contract).
pub const FAMILIES: &[Family] = &[
    Family {
        name: "dot4_bf16",
        what: "bf16 matrix-vector product (trunk projections, decode)",
        forms: &[
            (Isa::Scalar, Reference("cpu/scalar.rs::dot4_bf16")),
            (Isa::Avx2, Native("cpu/x86/dot.rs::dot4_bf16_avx2")),
            (Isa::Avx512, Native("cpu/x86/dot.rs::dot4_bf16_avx512")),
            (Isa::Neon, Native("cpu/neon/dot.rs::dot4_bf16")),
        ],
        probe: probes::bf16_matvec,
    },
    Family {
        name: "dot4_f32",
        what: "one f32 row against four (a band's rows below the tile size)",
        forms: &[
            (Isa::Scalar, Reference("cpu/scalar.rs::dot4_f32")),
            (Isa::Avx2, Native("cpu/x86/dot.rs::dot4_f32_avx2")),
            (Isa::Avx512, Native("cpu/x86/dot.rs::dot4_f32_avx512")),
            (Isa::Neon, Native("cpu/neon/dot.rs::dot4_f32")),
        ],
        probe: probes::dot4_f32,
    },
    Family {
        name: "dot1_f32",
        what: "one f32 dot product (attention scores, norms)",
        forms: &[
            (Isa::Scalar, Reference("cpu/scalar.rs::dot1_f32")),
            (Isa::Avx2, Native("cpu/x86/dot.rs::dot1_f32_avx2")),
            (Isa::Avx512, Native("cpu/x86/dot.rs::dot1_f32_avx512")),
            (Isa::Neon, Native("cpu/neon/dot.rs::dot1_f32")),
        ],
        probe: probes::dot1,
    },
    Family {
        name: "dot4_mxfp4",
        what: "MXFP4 matrix-vector product, dequantised in registers (an expert, one row)",
        forms: &[
            (Isa::Scalar, Reference("cpu/scalar.rs::dot4_mxfp4")),
            (Isa::Avx2, Native("cpu/x86/dot.rs::dot4_mxfp4_avx2")),
            (Isa::Avx512, Native("cpu/x86/dot.rs::dot4_mxfp4_avx512")),
            (Isa::Neon, Native("cpu/neon/dot.rs::dot4_mxfp4")),
        ],
        probe: probes::mxfp4_matvec,
    },
    Family {
        name: "dot4xn_mxfp4",
        what: "MXFP4 product of 2..=8 rows, weights decoded in registers once per input quad",
        forms: &[
            (Isa::Scalar, Composed("decode_mxfp4_row into a band, then dot4x4_f32")),
            (Isa::Avx2, Composed("decode_mxfp4_row into a band, then dot4x4_f32")),
            (Isa::Avx512, Native("cpu/x86/tiled.rs::dot4xn_mxfp4_avx512")),
            (Isa::Neon, Native("cpu/neon/tiled.rs::dot4xn_mxfp4")),
        ],
        probe: probes::mxfp4_matmul_few,
    },
    Family {
        name: "dot4x4_f32",
        what: "4 weight rows x 4 input rows of a decoded band (matmul, under 8 rows)",
        forms: &[
            (Isa::Scalar, Composed("dot4_f32 per weight row")),
            (Isa::Avx2, Composed("dot4_f32 per weight row")),
            (Isa::Avx512, Native("cpu/x86/tiled.rs::dot4x4_f32_avx512")),
            (Isa::Neon, Native("cpu/neon/tiled.rs::dot4x4_f32")),
        ],
        probe: probes::bf16_matmul_few,
    },
    Family {
        name: "tile_f32",
        what: "tiled multi-row product of a decoded band (prefill, 8 rows and more)",
        forms: &[
            (Isa::Scalar, Composed("dot4x4_f32 over whole rows, untiled")),
            (Isa::Avx2, Composed("dot4x4_f32 over whole rows, untiled (16 ymm registers cannot hold a 4x4 tile)")),
            (Isa::Avx512, Native("cpu/x86/tiled.rs::dot4x4_tile_avx512")),
            (Isa::Neon, Native("cpu/neon/tiled.rs::dot4x4_tile")),
        ],
        probe: probes::tiled_matmuls,
    },
    Family {
        name: "decode_mxfp4_row",
        what: "an MXFP4 row to f32 (the band a prefill matmul decodes once)",
        forms: &[
            (Isa::Scalar, Reference("cpu/scalar.rs::decode_mxfp4_row")),
            (Isa::Avx2, Reference("cpu/scalar.rs::decode_mxfp4_row")),
            (Isa::Avx512, Native("cpu/x86/dot.rs::decode_mxfp4_row_avx512")),
            (Isa::Neon, Native("cpu/neon/dot.rs::decode_mxfp4_row")),
        ],
        probe: probes::mxfp4_decode,
    },
    Family {
        name: "decode_bf16_row",
        what: "a bf16 row to f32 (the band a prefill matmul decodes once)",
        forms: &[
            (Isa::Scalar, Reference("cpu/scalar.rs::decode_bf16_row")),
            (Isa::Avx2, Reference("cpu/scalar.rs::decode_bf16_row")),
            (Isa::Avx512, Native("cpu/x86/dot.rs::decode_bf16_row_avx512")),
            (Isa::Neon, Native("cpu/neon/dot.rs::decode_bf16_row")),
        ],
        probe: probes::bf16_decode,
    },
    Family {
        name: "situ",
        what: "SiTU activation (dense and expert MLPs)",
        forms: &[
            (Isa::Scalar, Reference("cpu/situ.rs::situ_rows")),
            (Isa::Avx2, Native("cpu/x86/situ.rs::situ_rows_avx2")),
            (Isa::Avx512, Native("cpu/x86/situ.rs::situ_rows_avx512")),
            (Isa::Neon, Native("cpu/neon/situ.rs::situ_rows")),
        ],
        probe: probes::situ,
    },
    Family {
        name: "dot4_coded",
        what: "coded trunk matrix-vector product, rows decoded in registers into the FMAs",
        forms: &[
            (Isa::Scalar, Composed("decode_portable rows into a scratch, then dot4_bf16")),
            (Isa::Avx2, Composed("decode_portable rows into a scratch, then dot4_bf16")),
            (Isa::Avx512, Native("cpu/x86/coded.rs::dot4_coded_avx512")),
            (Isa::Neon, Native("cpu/neon/coded.rs::dot4_coded")),
        ],
        probe: probes::coded_matvec,
    },
    Family {
        name: "decode_coded",
        what: "a coded row to its bf16 bits (coded matmul bands, GPU upload)",
        forms: &[
            (Isa::Scalar, Reference("coded/portable.rs::decode_portable")),
            (Isa::Avx2, Reference("coded/portable.rs::decode_portable")),
            (Isa::Avx512, Native("cpu/x86/coded.rs::decode_blocks_avx512")),
            (Isa::Neon, Native("cpu/neon/coded.rs::decode_blocks")),
        ],
        probe: probes::coded_matmul,
    },
    Family {
        name: "dot4_int8",
        what: "int8 trunk matrix-vector product",
        forms: &[
            (Isa::Scalar, Composed("Int8Mat::decode_row into a scratch, then dot4_f32")),
            (Isa::Avx2, Composed("Int8Mat::decode_row into a scratch, then dot4_f32")),
            (Isa::Avx512, Composed("Int8Mat::decode_row into a scratch, then dot4_f32")),
            (Isa::Neon, Native("cpu/neon/int8.rs::dot4_int8")),
        ],
        probe: probes::int8_matvec,
    },
    Family {
        name: "fma_peak",
        what: "the measured FMA peak `bench kernels` reports fractions of",
        forms: &[
            (Isa::Scalar, Reference("cpu/scalar.rs::fma_chains")),
            (Isa::Avx2, Native("cpu/x86/mod.rs::fma_chains_avx2")),
            (Isa::Avx512, Native("cpu/x86/mod.rs::fma_chains_avx512")),
            (Isa::Neon, Native("cpu/neon/mod.rs::fma_chains")),
        ],
        probe: probes::none,
    },
];

/// The probes: each family through its public entry point on small fixed inputs whose lengths
/// leave tails (not multiples of 16 or 64), with the given instruction set.
mod probes {
    use super::*;
    use crate::backend::cpu::{
        decode_bf16_row_isa, decode_mxfp4_row_isa, deinterleave_mxfp4_input, dot_f32_isa, matmul_bf16_isa,
        matmul_mxfp4_isa, matvec_bf16_isa, matvec_mxfp4_isa,
    };

    fn rng(seed: u64) -> crate::util::XorShift {
        crate::util::XorShift(0x9E37_79B9_7F4A_7C15 ^ seed)
    }

    /// `n` values in [-1, 1).
    fn vals(seed: u64, n: usize) -> Vec<f32> {
        let mut r = rng(seed);
        (0..n).map(|_| (r.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0).collect()
    }

    /// bf16 bytes of trained-like weights: a spread of exponents, some zeros, some far out.
    fn bf16(seed: u64, n: usize) -> Vec<u8> {
        let mut r = rng(seed);
        (0..n)
            .flat_map(|_| {
                let u = r.next_u64();
                let x = ((u >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1;
                let x = match u % 97 {
                    0 => 0.0,
                    1 => x * 1e-6,
                    2 => x * 300.0,
                    _ => x,
                };
                half::bf16::from_f32(x).to_le_bytes()
            })
            .collect()
    }

    /// MXFP4 codes and scales (the extremes 0 and 254 now and then).
    fn mxfp4(seed: u64, rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>) {
        let mut r = rng(seed);
        let packed = (0..rows * cols / 2).map(|_| r.next_u64() as u8).collect();
        let scales = (0..rows * cols / 32)
            .map(|_| match r.next_u64() % 40 {
                0 => 0,
                1 => 254,
                k => 118 + (k % 10) as u8,
            })
            .collect();
        (packed, scales)
    }

    fn bits(v: &[f32]) -> Option<Vec<u32>> {
        Some(v.iter().map(|x| x.to_bits()).collect())
    }

    const ROWS: usize = 13;
    const COLS: usize = 7 * 16 + 9;
    const MX_COLS: usize = 5 * 32;

    fn bf16_mat(seed: u64) -> Bf16Mat {
        Bf16Mat::from_vec(bf16(seed, ROWS * COLS), ROWS, COLS)
    }

    /// out = W x for a product over `n` input rows.
    fn matmul(isa: Isa, w: &Bf16Mat, n: usize, seed: u64) -> Vec<f32> {
        let x = vals(seed, n * w.cols);
        let mut out = vec![0f32; n * w.rows];
        matmul_bf16_isa(isa, w, &x, &mut out);
        out
    }

    fn mx_matmul(isa: Isa, n: usize) -> Vec<f32> {
        let (p, s) = mxfp4(3, ROWS, MX_COLS);
        let w = Mxfp4Mat::new(&p, &s, ROWS, MX_COLS);
        let mut xd = vec![0f32; n * MX_COLS];
        for (i, row) in xd.chunks_exact_mut(MX_COLS).enumerate() {
            deinterleave_mxfp4_input(&vals(40 + i as u64, MX_COLS), row);
        }
        let mut out = vec![0f32; n * ROWS];
        if n == 1 {
            matvec_mxfp4_isa(isa, &w, &xd, &mut out);
        } else {
            matmul_mxfp4_isa(isa, &w, &xd, &mut out);
        }
        out
    }

    pub fn bf16_matvec(isa: Isa) -> Option<Vec<u32>> {
        let w = bf16_mat(1);
        let x = vals(2, COLS);
        let mut out = vec![0f32; ROWS];
        matvec_bf16_isa(isa, &w, &x, &mut out);
        bits(&out)
    }

    pub fn dot4_f32(isa: Isa) -> Option<Vec<u32>> {
        let mut out = Vec::new();
        for n in [1usize, 16, 17, 100] {
            let b: Vec<Vec<f32>> = (0..4).map(|r| vals(30 + r, n)).collect();
            out.extend(crate::backend::cpu::dot4_f32(isa, &vals(5, n), std::array::from_fn(|r| &b[r][..])));
        }
        bits(&out)
    }

    pub fn dot1(isa: Isa) -> Option<Vec<u32>> {
        let out: Vec<f32> =
            [0usize, 1, 15, 16, 17, 100].iter().map(|&n| dot_f32_isa(isa, &vals(8, n), &vals(9, n))).collect();
        bits(&out)
    }

    pub fn mxfp4_matvec(isa: Isa) -> Option<Vec<u32>> {
        bits(&mx_matmul(isa, 1))
    }

    pub fn mxfp4_matmul_few(isa: Isa) -> Option<Vec<u32>> {
        let mut out = Vec::new();
        for n in [2, 3, 4, 5, 8] {
            out.extend(mx_matmul(isa, n));
        }
        bits(&out)
    }

    pub fn bf16_matmul_few(isa: Isa) -> Option<Vec<u32>> {
        let mut out = Vec::new();
        for n in [1usize, 16, 33, 100] {
            let w: Vec<Vec<f32>> = (0..4).map(|r| vals(10 + r, n)).collect();
            let x: Vec<Vec<f32>> = (0..4).map(|r| vals(20 + r, n)).collect();
            let d = crate::backend::cpu::dot4x4_f32(
                isa,
                std::array::from_fn(|r| &w[r][..]),
                std::array::from_fn(|i| &x[i][..]),
            );
            out.extend(d.into_iter().flatten());
        }
        // Through the product: under 8 input rows, the untiled band.
        out.extend(matmul(isa, &bf16_mat(12), 7, 13));
        bits(&out)
    }

    pub fn tiled_matmuls(isa: Isa) -> Option<Vec<u32>> {
        // 8 rows and more: tiled; 41 rows: more than one block of input quads; a 1100-column
        // matrix: more than one column tile, the last one partial.
        let wide = Bf16Mat::from_vec(bf16(14, 9 * 1100), 9, 1100);
        bits(
            &[
                matmul(isa, &bf16_mat(15), 8, 16),
                matmul(isa, &bf16_mat(17), 41, 18),
                matmul(isa, &wide, 9, 19),
                mx_matmul(isa, 9),
            ]
            .concat(),
        )
    }

    pub fn mxfp4_decode(isa: Isa) -> Option<Vec<u32>> {
        let (p, s) = mxfp4(20, 1, MX_COLS);
        let mut out = vec![0f32; MX_COLS];
        decode_mxfp4_row_isa(isa, &p, &s, &mut out);
        bits(&out)
    }

    pub fn bf16_decode(isa: Isa) -> Option<Vec<u32>> {
        let row = bf16(21, COLS);
        let mut out = vec![0f32; COLS];
        decode_bf16_row_isa(isa, &row, &mut out);
        bits(&out)
    }

    pub fn situ(isa: Isa) -> Option<Vec<u32>> {
        let g: Vec<f32> = vals(22, 203).iter().map(|v| v * 30.0).collect();
        let u: Vec<f32> = vals(23, 203).iter().map(|v| v * 30.0).collect();
        let mut out = vec![0f32; 2 * g.len()];
        let (a, b) = out.split_at_mut(g.len());
        ops::situ_rows_isa(isa, Situ { beta: 4.0, linear_beta: 25.0 }, &g, &u, a);
        ops::situ_rows_isa(isa, Situ { beta: 0.75, linear_beta: 0.0 }, &g, &u, b);
        bits(&out)
    }

    /// A coded matrix with escapes: every 53rd value's exponent is one of the rare ones.
    fn coded_mat() -> (Bf16Mat, Bf16Mat) {
        let (rows, cols) = (ROWS, 3 * 64 + 37);
        let mut w = bf16(24, rows * cols);
        for (i, v) in w.chunks_exact_mut(2).enumerate().filter(|(i, _)| i % 53 == 0) {
            v.copy_from_slice(&half::bf16::from_f32((i as f32 + 1.0) * 1e8).to_le_bytes());
        }
        let c = CodedMat::encode(&w, rows, cols);
        assert!(c.escape_count() > 0);
        (Bf16Mat::coded(Arc::new(c)), Bf16Mat::from_vec(w, rows, cols))
    }

    pub fn coded_matvec(isa: Isa) -> Option<Vec<u32>> {
        let (c, b) = coded_mat();
        // The coded product must give the bf16 product's bits on the same instruction set.
        let (got, want) = (matmul(isa, &c, 1, 25), matmul(isa, &b, 1, 25));
        assert_eq!(bits(&got), bits(&want), "coded vs bf16 matvec on {isa:?}");
        bits(&got)
    }

    /// The row decoder is chosen by what the CPU has, whatever `isa` (it cannot change a bit; its
    /// own test holds it to the portable decoder), so this probes it through the products.
    pub fn coded_matmul(isa: Isa) -> Option<Vec<u32>> {
        let (c, b) = coded_mat();
        let (got, want) = (matmul(isa, &c, 3, 26), matmul(isa, &b, 3, 26));
        assert_eq!(bits(&got), bits(&want), "coded vs bf16 matmul on {isa:?}");
        let mut row = vec![0u8; 2 * c.cols];
        let mut out = bits(&got)?;
        for r in 0..c.rows {
            c.copy_bf16_row(r, &mut row);
            out.extend(row.chunks_exact(2).map(|v| u16::from_le_bytes([v[0], v[1]]) as u32));
        }
        Some(out)
    }

    pub fn int8_matvec(isa: Isa) -> Option<Vec<u32>> {
        let q = Bf16Mat::int8(Arc::new(Int8Mat::quantize(&bf16(27, ROWS * COLS), ROWS, COLS)));
        bits(&[matmul(isa, &q, 1, 28), matmul(isa, &q, 5, 29)].concat())
    }

    pub fn none(_: Isa) -> Option<Vec<u32>> {
        None
    }
}

#[cfg(test)]
mod tests;
