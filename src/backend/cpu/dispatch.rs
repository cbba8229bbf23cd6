//! The instruction sets and the kernel tables: which instruction sets this machine runs, the one
//! chosen at startup, and for every kernel family one [`Table`] from instruction set to kernel.
//! This is the one file that names the kernels of an instruction set's folder (`x86/`, `neon/`)
//! outside it, and the one that asks the CPU which instruction sets it has (a kernel that needs
//! more, as the AVX-512 coded kernels do, says so in its table entry).
//!
//! Contract: a table hands out a kernel ([`Kernel`]) only for an instruction set this CPU runs (it
//! panics when asked for another) and only where the further features the kernel needs, if any,
//! were detected; a `Kernel`'s `call` checks the lengths its kernel relies on, so calling it is
//! safe. Callers look a family's kernel up once per product and call it in their loops. The
//! families' forms by file are listed in `families.rs`, whose tests hold the two lists equal.

#[cfg(target_arch = "aarch64")]
use super::neon;
#[cfg(target_arch = "x86_64")]
use super::x86;
use super::{LANES, scalar, situ};
use crate::backend::coded::{BLOCK, BLOCK_BYTES, CodedMat};
use crate::backend::types::{MXFP4_BLOCK, Situ};
use std::sync::OnceLock;

/// Instruction set used by the kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    Avx2,
    Avx512,
    Neon,
}

impl Isa {
    /// Every instruction set, each architecture's best last.
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Neon];

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Neon => "neon",
        }
    }

    /// The architecture whose CPUs may have it (`std::env::consts::ARCH`; `None`: every one).
    pub fn arch(self) -> Option<&'static str> {
        match self {
            Isa::Scalar => None,
            Isa::Avx2 | Isa::Avx512 => Some("x86_64"),
            Isa::Neon => Some("aarch64"),
        }
    }

    /// Whether this CPU has the instruction set (asked once).
    pub fn runs_here(self) -> bool {
        static RUNS: OnceLock<[bool; Isa::ALL.len()]> = OnceLock::new();
        RUNS.get_or_init(|| Isa::ALL.map(Isa::detect))[self as usize]
    }

    fn detect(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => std::is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            _ => false,
        }
    }

    /// The instruction sets this machine can run, best last.
    pub fn available() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.runs_here()).collect()
    }

    /// The best instruction set this machine runs, whatever `DELTAFIN_ISA` asks.
    pub fn best() -> Isa {
        Isa::ALL.into_iter().rev().find(|i| i.runs_here()).unwrap_or(Isa::Scalar)
    }
}

/// `DELTAFIN_ISA` names an instruction set this machine cannot run (or none at all).
#[derive(Debug, thiserror::Error)]
#[error("DELTAFIN_ISA={want:?} is not an instruction set this machine can run (available: {available})")]
pub struct IsaError {
    pub want: String,
    pub available: String,
}

/// The instruction set `DELTAFIN_ISA` asks for (scalar|avx2|avx512|neon), or the best available.
pub fn requested_isa() -> Result<Isa, IsaError> {
    let avail = Isa::available();
    match std::env::var("DELTAFIN_ISA") {
        Ok(want) => avail
            .iter()
            .copied()
            .find(|i| i.name() == want)
            .ok_or_else(|| IsaError { want, available: avail.iter().map(|i| i.name()).collect::<Vec<_>>().join(", ") }),
        Err(_) => Ok(Isa::best()),
    }
}

/// The instruction set chosen at startup. Front ends call [`requested_isa`] first so that a bad
/// `DELTAFIN_ISA` is an error; here it falls back to the best available. Results do not depend on
/// the choice.
pub fn isa() -> Isa {
    static CHOSEN: OnceLock<Isa> = OnceLock::new();
    *CHOSEN.get_or_init(|| requested_isa().unwrap_or_else(|_| Isa::best()))
}

/// One kernel family's table: the form that runs where no native kernel does, and the native
/// kernel of each instruction set that has one (only those of this build's architecture).
pub(crate) struct Table<F: 'static> {
    /// The family's name in `families.rs`.
    pub name: &'static str,
    /// `None`: the family's callers compose it from other families' kernels there.
    portable: Option<F>,
    native: &'static [Native<F>],
    /// The kernel of the instruction set chosen at startup, once looked up.
    chosen: OnceLock<F>,
}

/// A native kernel: its instruction set and whether the CPU has the further features it needs.
struct Native<F> {
    isa: Isa,
    kernel: F,
    needs: fn() -> bool,
}

/// A native kernel that needs nothing beyond its instruction set.
const fn native<F>(isa: Isa, kernel: F) -> Native<F> {
    Native { isa, kernel, needs: nothing_more }
}

fn nothing_more() -> bool {
    true
}

impl<F: Copy> Table<F> {
    const fn new(name: &'static str, portable: Option<F>, native: &'static [Native<F>]) -> Self {
        Table { name, portable, native, chosen: OnceLock::new() }
    }

    /// The kernel of the instruction set chosen at startup ([`isa`]), looked up once: what the
    /// entry points without an `isa` argument run, call after call.
    pub fn chosen(&self) -> Kernel<F> {
        Kernel(*self.chosen.get_or_init(|| self.get(isa()).0))
    }

    /// The native kernel of `isa`, if the family has one that runs on this CPU.
    pub fn native(&self, isa: Isa) -> Option<Kernel<F>> {
        assert!(isa.runs_here(), "{} kernels asked for on a CPU without {0}", isa.name());
        self.native.iter().find(|n| n.isa == isa && (n.needs)()).map(|n| Kernel(n.kernel))
    }

    /// The kernel `isa` runs: its native one, else the portable form.
    pub fn get(&self, isa: Isa) -> Kernel<F> {
        let kernel = self.native(isa).or(self.portable.map(Kernel));
        kernel.unwrap_or_else(|| panic!("{} has no portable form: its callers compose it", self.name))
    }

    /// The instruction sets with a native kernel in this build.
    #[cfg(test)]
    pub fn native_isas(&self) -> Vec<Isa> {
        self.native.iter().map(|n| n.isa).collect()
    }
}

/// A kernel a [`Table`] handed out: one that runs on this CPU. Its `call` checks what the kernel's
/// safety needs besides the CPU.
#[derive(Clone, Copy)]
pub(crate) struct Kernel<F>(F);

pub(crate) type Dot4Bf16 = unsafe fn([&[u8]; 4], &[f32]) -> [f32; 4];

/// Dots of four bf16 weight rows with one f32 vector.
pub(crate) static DOT4_BF16: Table<Dot4Bf16> = Table::new(
    "dot4_bf16",
    Some(scalar::dot4_bf16),
    &[
        #[cfg(target_arch = "x86_64")]
        native(Isa::Avx2, x86::dot4_bf16_avx2),
        #[cfg(target_arch = "x86_64")]
        native(Isa::Avx512, x86::dot4_bf16_avx512),
        #[cfg(target_arch = "aarch64")]
        native(Isa::Neon, neon::dot4_bf16),
    ],
);

impl Kernel<Dot4Bf16> {
    #[inline]
    pub fn call(self, w: [&[u8]; 4], x: &[f32]) -> [f32; 4] {
        assert!(w.iter().all(|r| r.len() == 2 * x.len()), "bf16 rows of another length");
        // SAFETY: the table gave this kernel for an instruction set this CPU runs; lengths checked.
        unsafe { (self.0)(w, x) }
    }
}

pub(crate) type Dot4F32 = unsafe fn(&[f32], [&[f32]; 4]) -> [f32; 4];

/// Dots of one f32 row with four f32 vectors.
pub(crate) static DOT4_F32: Table<Dot4F32> = Table::new(
    "dot4_f32",
    Some(scalar::dot4_f32),
    &[
        #[cfg(target_arch = "x86_64")]
        native(Isa::Avx2, x86::dot4_f32_avx2),
        #[cfg(target_arch = "x86_64")]
        native(Isa::Avx512, x86::dot4_f32_avx512),
        #[cfg(target_arch = "aarch64")]
        native(Isa::Neon, neon::dot4_f32),
    ],
);

impl Kernel<Dot4F32> {
    #[inline]
    pub fn call(self, a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
        assert!(b.iter().all(|r| r.len() == a.len()), "f32 rows of another length");
        // SAFETY: the table gave this kernel for an instruction set this CPU runs; lengths checked.
        unsafe { (self.0)(a, b) }
    }
}

pub(crate) type Dot1F32 = unsafe fn(&[f32], &[f32]) -> f32;

/// One f32 dot product.
pub(crate) static DOT1_F32: Table<Dot1F32> = Table::new(
    "dot1_f32",
    Some(scalar::dot1_f32),
    &[
        #[cfg(target_arch = "x86_64")]
        native(Isa::Avx2, x86::dot1_f32_avx2),
        #[cfg(target_arch = "x86_64")]
        native(Isa::Avx512, x86::dot1_f32_avx512),
        #[cfg(target_arch = "aarch64")]
        native(Isa::Neon, neon::dot1_f32),
    ],
);

impl Kernel<Dot1F32> {
    #[inline]
    pub fn call(self, a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        // SAFETY: the table gave this kernel for an instruction set this CPU runs; lengths checked.
        unsafe { (self.0)(a, b) }
    }
}

/// Four MXFP4 weight rows: (packed codes, scales) each.
pub(crate) type Mxfp4Rows<'a> = [(&'a [u8], &'a [u8]); 4];

/// Whether every row holds `cols` MXFP4 values (2 codes a byte, one scale per 32).
fn mxfp4_rows_fit(w: &Mxfp4Rows, cols: usize) -> bool {
    cols.is_multiple_of(MXFP4_BLOCK) && w.iter().all(|(p, s)| p.len() * 2 == cols && s.len() * MXFP4_BLOCK == cols)
}

pub(crate) type Dot4Mxfp4 = unsafe fn(Mxfp4Rows, &[f32]) -> [f32; 4];

/// Dots of four MXFP4 rows with one deinterleaved input vector.
pub(crate) static DOT4_MXFP4: Table<Dot4Mxfp4> = Table::new(
    "dot4_mxfp4",
    Some(scalar::dot4_mxfp4),
    &[
        #[cfg(target_arch = "x86_64")]
        native(Isa::Avx2, x86::dot4_mxfp4_avx2),
        #[cfg(target_arch = "x86_64")]
        native(Isa::Avx512, x86::dot4_mxfp4_avx512),
        #[cfg(target_arch = "aarch64")]
        native(Isa::Neon, neon::dot4_mxfp4),
    ],
);

impl Kernel<Dot4Mxfp4> {
    #[inline]
    pub fn call(self, w: Mxfp4Rows, xd: &[f32]) -> [f32; 4] {
        assert!(mxfp4_rows_fit(&w, xd.len()), "MXFP4 rows of another length");
        // SAFETY: the table gave this kernel for an instruction set this CPU runs; lengths checked.
        unsafe { (self.0)(w, xd) }
    }
}

/// The register-decoded MXFP4 kernel for `NX` input rows.
type Dot4xn<const NX: usize> = unsafe fn(Mxfp4Rows, [&[f32]; NX]) -> [[f32; NX]; 4];

/// The register-decoded MXFP4 kernel for 1, 2, 3 and 4 input rows.
#[derive(Clone, Copy)]
pub(crate) struct Dot4xnMxfp4 {
    x1: Dot4xn<1>,
    x2: Dot4xn<2>,
    x3: Dot4xn<3>,
    x4: Dot4xn<4>,
}

/// Four MXFP4 weight rows against a few deinterleaved inputs, each weight block decoded in
/// registers once for all of them.
pub(crate) static DOT4XN_MXFP4: Table<Dot4xnMxfp4> = Table::new(
    "dot4xn_mxfp4",
    None,
    &[
        #[cfg(target_arch = "x86_64")]
        native(
            Isa::Avx512,
            Dot4xnMxfp4 {
                x1: x86::dot4xn_mxfp4_avx512::<1>,
                x2: x86::dot4xn_mxfp4_avx512::<2>,
                x3: x86::dot4xn_mxfp4_avx512::<3>,
                x4: x86::dot4xn_mxfp4_avx512::<4>,
            },
        ),
        #[cfg(target_arch = "aarch64")]
        native(
            Isa::Neon,
            Dot4xnMxfp4 {
                x1: neon::dot4xn_mxfp4::<1>,
                x2: neon::dot4xn_mxfp4::<2>,
                x3: neon::dot4xn_mxfp4::<3>,
                x4: neon::dot4xn_mxfp4::<4>,
            },
        ),
    ],
);

impl Kernel<Dot4xnMxfp4> {
    /// out[r][i] = w[r] . x[i] for 1..=4 inputs `x` (the columns past `x.len()` are 0).
    #[inline]
    pub fn call(self, w: Mxfp4Rows, x: &[&[f32]]) -> [[f32; 4]; 4] {
        let cols = x.first().map_or(0, |r| r.len());
        assert!(x.iter().all(|r| r.len() == cols) && mxfp4_rows_fit(&w, cols), "MXFP4 rows of another length");
        fn widen<const N: usize>(d: [[f32; N]; 4]) -> [[f32; 4]; 4] {
            d.map(|r| std::array::from_fn(|i| if i < N { r[i] } else { 0.0 }))
        }
        let k = self.0;
        // SAFETY: the table gave this kernel for an instruction set this CPU runs; lengths checked.
        unsafe {
            match *x {
                [a] => widen((k.x1)(w, [a])),
                [a, b] => widen((k.x2)(w, [a, b])),
                [a, b, c] => widen((k.x3)(w, [a, b, c])),
                [a, b, c, d] => (k.x4)(w, [a, b, c, d]),
                _ => panic!("{} inputs: the register-decoded MXFP4 kernel takes 1 to 4", x.len()),
            }
        }
    }
}

pub(crate) type Dot4x4F32 = unsafe fn([&[f32]; 4], [&[f32]; 4]) -> [[f32; 4]; 4];

/// Four f32 weight rows against four f32 input rows.
pub(crate) static DOT4X4_F32: Table<Dot4x4F32> = Table::new(
    "dot4x4_f32",
    None,
    &[
        #[cfg(target_arch = "x86_64")]
        native(Isa::Avx512, x86::dot4x4_f32_avx512),
        #[cfg(target_arch = "aarch64")]
        native(Isa::Neon, neon::dot4x4_f32),
    ],
);

impl Kernel<Dot4x4F32> {
    #[inline]
    pub fn call(self, w: [&[f32]; 4], x: [&[f32]; 4]) -> [[f32; 4]; 4] {
        let n = w[0].len();
        assert!(w.iter().chain(&x).all(|r| r.len() == n), "f32 rows of another length");
        // SAFETY: the table gave this kernel for an instruction set this CPU runs; lengths checked.
        unsafe { (self.0)(w, x) }
    }
}

pub(crate) type TileF32 = unsafe fn([&[f32]; 4], [&[f32]; 4], &mut [[f32; LANES]; 16]);

/// [`DOT4X4_F32`] over one tile of the columns, continuing from lane accumulators ([w][x] blocks
/// of 16 lanes) and leaving them there, every lane in the reference order.
pub(crate) static TILE_F32: Table<TileF32> = Table::new(
    "tile_f32",
    None,
    &[
        #[cfg(target_arch = "x86_64")]
        native(Isa::Avx512, x86::dot4x4_tile_avx512),
        #[cfg(target_arch = "aarch64")]
        native(Isa::Neon, neon::dot4x4_tile),
    ],
);

impl Kernel<TileF32> {
    #[inline]
    pub fn call(self, w: [&[f32]; 4], x: [&[f32]; 4], acc: &mut [[f32; LANES]; 16]) {
        let n = w[0].len();
        assert!(w.iter().chain(&x).all(|r| r.len() == n), "f32 rows of another length");
        // SAFETY: the table gave this kernel for an instruction set this CPU runs; lengths checked.
        unsafe { (self.0)(w, x, acc) }
    }
}

pub(crate) type DecodeMxfp4Row = unsafe fn(&[u8], &[u8], &mut [f32]);

/// One MXFP4 row to f32 in the deinterleaved order.
pub(crate) static DECODE_MXFP4_ROW: Table<DecodeMxfp4Row> = Table::new(
    "decode_mxfp4_row",
    Some(scalar::decode_mxfp4_row),
    &[
        #[cfg(target_arch = "x86_64")]
        native(Isa::Avx512, x86::decode_mxfp4_row_avx512),
        #[cfg(target_arch = "aarch64")]
        native(Isa::Neon, neon::decode_mxfp4_row),
    ],
);

impl Kernel<DecodeMxfp4Row> {
    #[inline]
    pub fn call(self, packed: &[u8], scales: &[u8], out: &mut [f32]) {
        assert_eq!(out.len(), packed.len() * 2);
        assert_eq!(out.len(), scales.len() * MXFP4_BLOCK);
        // SAFETY: the table gave this kernel for an instruction set this CPU runs; lengths checked.
        unsafe { (self.0)(packed, scales, out) }
    }
}

pub(crate) type DecodeBf16Row = unsafe fn(&[u8], &mut [f32]);

/// One bf16 row to f32.
pub(crate) static DECODE_BF16_ROW: Table<DecodeBf16Row> = Table::new(
    "decode_bf16_row",
    Some(scalar::decode_bf16_row),
    &[
        #[cfg(target_arch = "x86_64")]
        native(Isa::Avx512, x86::decode_bf16_row_avx512),
        #[cfg(target_arch = "aarch64")]
        native(Isa::Neon, neon::decode_bf16_row),
    ],
);

impl Kernel<DecodeBf16Row> {
    #[inline]
    pub fn call(self, row: &[u8], out: &mut [f32]) {
        assert_eq!(row.len(), out.len() * 2);
        // SAFETY: the table gave this kernel for an instruction set this CPU runs; lengths checked.
        unsafe { (self.0)(row, out) }
    }
}

pub(crate) type SituRows = unsafe fn(Situ, &[f32], &[f32], &mut [f32]);

/// SiTU over rows of gate and up values.
pub(crate) static SITU: Table<SituRows> = Table::new(
    "situ",
    Some(situ::situ_rows),
    &[
        #[cfg(target_arch = "x86_64")]
        native(Isa::Avx2, x86::situ_rows_avx2),
        #[cfg(target_arch = "x86_64")]
        native(Isa::Avx512, x86::situ_rows_avx512),
        #[cfg(target_arch = "aarch64")]
        native(Isa::Neon, neon::situ_rows),
    ],
);

impl Kernel<SituRows> {
    #[inline]
    pub fn call(self, s: Situ, gate: &[f32], up: &[f32], out: &mut [f32]) {
        assert!(gate.len() == out.len() && up.len() == out.len(), "situ operands of different lengths");
        // SAFETY: the table gave this kernel for an instruction set this CPU runs; lengths checked.
        unsafe { (self.0)(s, gate, up, out) }
    }
}

pub(crate) type Dot4Coded = unsafe fn(&CodedMat, [usize; 4], &[f32]) -> [f32; 4];

/// The AVX-512 coded kernels' features beyond avx512f (bw, vbmi, vbmi2, bmi2, popcnt).
#[cfg(target_arch = "x86_64")]
const AVX512_DECODE: fn() -> bool = x86::has_avx512_decode;

/// Dots of four coded rows with one f32 vector, each row decoded in registers into the FMAs.
pub(crate) static DOT4_CODED: Table<Dot4Coded> = Table::new(
    "dot4_coded",
    None,
    &[
        #[cfg(target_arch = "x86_64")]
        Native { isa: Isa::Avx512, kernel: x86::dot4_coded_avx512, needs: AVX512_DECODE },
        #[cfg(target_arch = "aarch64")]
        native(Isa::Neon, neon::dot4_coded),
    ],
);

impl Kernel<Dot4Coded> {
    /// `m` passed `CodedMat::check` when it was built or read (its escape lists fit its indices).
    #[inline]
    pub fn call(self, m: &CodedMat, rows: [usize; 4], x: &[f32]) -> [f32; 4] {
        assert!(x.len() == m.cols && rows.iter().all(|&r| r < m.rows), "coded rows out of the matrix");
        // SAFETY: the table gave this kernel for a CPU that runs it; the rows are in the matrix and
        // x has its width; the matrix's parts are consistent (checked when it was made or read).
        unsafe { (self.0)(m, rows, x) }
    }
}

pub(crate) type DecodeCodedBlocks = unsafe fn(&[u8; 8], &[u8], &[u8], &[u8], &mut [u8], usize) -> usize;

/// The first whole blocks of a coded row to bf16 bytes; returns the escape bytes consumed.
pub(crate) static DECODE_CODED: Table<DecodeCodedBlocks> = Table::new(
    "decode_coded",
    None,
    &[
        #[cfg(target_arch = "x86_64")]
        Native { isa: Isa::Avx512, kernel: x86::decode_blocks_avx512, needs: AVX512_DECODE },
        #[cfg(target_arch = "aarch64")]
        native(Isa::Neon, neon::decode_blocks),
    ],
);

impl Kernel<DecodeCodedBlocks> {
    /// `blocks` whole blocks of one row's parts (`sm`, `idx`, the row's escapes `esc`: consistent,
    /// as `CodedMat::check` accepts them) into `out`.
    #[inline]
    pub fn call(self, table: &[u8; 8], sm: &[u8], idx: &[u8], esc: &[u8], out: &mut [u8], blocks: usize) -> usize {
        assert!(sm.len() >= blocks * BLOCK && idx.len() >= blocks * BLOCK_BYTES && out.len() >= 2 * blocks * BLOCK);
        // SAFETY: the table gave this kernel for a CPU that runs it; the blocks are inside the
        // parts, whose escape bytes match their indices (the caller's contract).
        unsafe { (self.0)(table, sm, idx, esc, out, blocks) }
    }
}

pub(crate) type Dot4Int8 = unsafe fn([&[i8]; 4], [f32; 4], &[f32]) -> [f32; 4];

/// Dots of four int8 rows (codes, scale) with one f32 vector.
pub(crate) static DOT4_INT8: Table<Dot4Int8> = Table::new(
    "dot4_int8",
    None,
    &[
        #[cfg(target_arch = "aarch64")]
        native(Isa::Neon, neon::dot4_int8),
    ],
);

impl Kernel<Dot4Int8> {
    #[inline]
    pub fn call(self, q: [&[i8]; 4], s: [f32; 4], x: &[f32]) -> [f32; 4] {
        assert!(q.iter().all(|r| r.len() == x.len()), "int8 rows of another length");
        // SAFETY: the table gave this kernel for an instruction set this CPU runs; lengths checked.
        unsafe { (self.0)(q, s, x) }
    }
}

/// An FMA peak loop: `iters` FMAs on each of `chains` register-resident chains of `lanes` lanes.
#[derive(Clone, Copy)]
pub(crate) struct Peak {
    run: unsafe fn(u64) -> f32,
    pub lanes: usize,
    pub chains: usize,
}

/// The FMA peak loops.
pub(crate) static FMA_PEAK: Table<Peak> = Table::new(
    "fma_peak",
    Some(Peak { run: scalar::fma_chains, lanes: 1, chains: scalar::PEAK_CHAINS }),
    &[
        #[cfg(target_arch = "x86_64")]
        native(Isa::Avx2, Peak { run: x86::fma_chains_avx2, lanes: 8, chains: x86::PEAK_CHAINS }),
        #[cfg(target_arch = "x86_64")]
        native(Isa::Avx512, Peak { run: x86::fma_chains_avx512, lanes: 16, chains: x86::PEAK_CHAINS }),
        #[cfg(target_arch = "aarch64")]
        native(Isa::Neon, Peak { run: neon::fma_chains, lanes: 4, chains: neon::PEAK_CHAINS }),
    ],
);

impl Kernel<Peak> {
    pub fn lanes(self) -> usize {
        self.0.lanes
    }

    pub fn chains(self) -> usize {
        self.0.chains
    }

    /// Runs the loop; returns the chains' sum (for the caller to keep).
    pub fn call(self, iters: u64) -> f32 {
        // SAFETY: the table gave this loop for an instruction set this CPU runs.
        unsafe { (self.0.run)(iters) }
    }
}

/// Every table's family name and the instruction sets it has a native kernel for in this build.
#[cfg(test)]
pub(crate) fn native_kernels() -> Vec<(&'static str, Vec<Isa>)> {
    fn of<F: Copy>(t: &Table<F>) -> (&'static str, Vec<Isa>) {
        (t.name, t.native_isas())
    }
    vec![
        of(&DOT4_BF16),
        of(&DOT4_F32),
        of(&DOT1_F32),
        of(&DOT4_MXFP4),
        of(&DOT4XN_MXFP4),
        of(&DOT4X4_F32),
        of(&TILE_F32),
        of(&DECODE_MXFP4_ROW),
        of(&DECODE_BF16_ROW),
        of(&SITU),
        of(&DOT4_CODED),
        of(&DECODE_CODED),
        of(&DOT4_INT8),
        of(&FMA_PEAK),
    ]
}
