//! The types that cross the backend seam: weights as the forward pass hands them to a backend
//! ([`Bf16Mat`] over [`SharedBytes`], [`Mxfp4Mat`] borrowed from an expert's shipped bytes laid out
//! as [`ExpertLayout`] says) and the small descriptions of an operation's shape ([`HeadIn`],
//! [`MlaDims`], [`Visible`], [`Situ`], [`RouteRule`]).
//!
//! Contract: these are plain data — every backend reads them the same way, and none holds device
//! state. They describe tensors and operations, never the model that uses them; the CPU kernels'
//! math on them lives in `cpu/` (e.g. `impl Situ` in `cpu::situ` and `cpu::ops`).

use super::coded::CodedMat;
use super::int8::Int8Mat;
use std::sync::Arc;

/// MXFP4 block: 32 inputs share one E8M0 scale byte.
pub const MXFP4_BLOCK: usize = 32;

/// Bytes kept alive by a shared owner (a mapped shard, or an owned buffer), sliced without a copy.
#[derive(Clone)]
pub struct SharedBytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    start: usize,
    len: usize,
}

impl SharedBytes {
    /// `owner[start..start+len]`; panics when the range is outside the owner.
    pub fn new(owner: Arc<dyn AsRef<[u8]> + Send + Sync>, start: usize, len: usize) -> Self {
        assert!(start + len <= (*owner).as_ref().len(), "byte range outside its owner");
        SharedBytes { owner, start, len }
    }

    pub fn from_vec(v: Vec<u8>) -> Self {
        let len = v.len();
        SharedBytes { owner: Arc::new(v), start: 0, len }
    }

    /// A sub-range `[a, b)` of these bytes.
    pub fn slice(&self, a: usize, b: usize) -> Self {
        assert!(a <= b && b <= self.len);
        SharedBytes { owner: Arc::clone(&self.owner), start: self.start + a, len: b - a }
    }
}

impl std::ops::Deref for SharedBytes {
    type Target = [u8];
    #[inline]
    fn deref(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.start..self.start + self.len]
    }
}

impl std::fmt::Debug for SharedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedBytes({} bytes)", self.len)
    }
}

/// How a trunk matrix's values are held (`--trunk`).
#[derive(Clone, Debug)]
pub enum MatStore {
    /// bf16 as shipped (little-endian, any alignment), usually a zero-copy view into a mapped
    /// shard that keeps the mapping alive.
    Bf16(SharedBytes),
    /// Losslessly coded bf16 (`backend::coded`): every row decodes to the original bits.
    Coded(Arc<CodedMat>),
    /// int8 with a scale per row (`backend::int8`): **not exact**, opt-in only.
    Int8(Arc<Int8Mat>),
}

/// A row-major trunk matrix of bf16 values as shipped — held as bf16, losslessly coded, or (opt-in,
/// not exact) as int8 — that the kernels read row by row.
#[derive(Clone, Debug)]
pub struct Bf16Mat {
    pub store: MatStore,
    pub rows: usize,
    pub cols: usize,
}

impl Bf16Mat {
    /// Panics if `data` does not hold exactly `rows * cols` bf16 values (checked by the roster).
    pub fn new(data: SharedBytes, rows: usize, cols: usize) -> Self {
        assert_eq!(data.len(), rows * cols * 2, "bf16 matrix size");
        Bf16Mat { store: MatStore::Bf16(data), rows, cols }
    }

    /// A matrix over an owned buffer (tests, benchmarks, converted tensors).
    pub fn from_vec(data: Vec<u8>, rows: usize, cols: usize) -> Self {
        Bf16Mat::new(SharedBytes::from_vec(data), rows, cols)
    }

    /// A coded matrix (its parts checked by whoever built it).
    pub fn coded(m: Arc<CodedMat>) -> Self {
        let (rows, cols) = (m.rows, m.cols);
        Bf16Mat { store: MatStore::Coded(m), rows, cols }
    }

    /// An int8 matrix.
    pub fn int8(m: Arc<Int8Mat>) -> Self {
        let (rows, cols) = (m.rows, m.cols);
        Bf16Mat { store: MatStore::Int8(m), rows, cols }
    }

    /// The bf16 bytes of the whole matrix when it is held as bf16.
    pub fn bf16_bytes(&self) -> Option<&[u8]> {
        match &self.store {
            MatStore::Bf16(d) => Some(d),
            _ => None,
        }
    }

    /// Writes row `r`'s bf16 bytes into `dst` (`2 * cols` bytes): copied, or decoded when coded.
    /// Panics for an int8 matrix, whose values are not bf16 (the engine refuses `--trunk int8` on
    /// a backend that would ask).
    pub fn copy_bf16_row(&self, r: usize, dst: &mut [u8]) {
        match &self.store {
            MatStore::Bf16(d) => dst.copy_from_slice(&d[r * self.cols * 2..(r + 1) * self.cols * 2]),
            MatStore::Coded(c) => c.decode_row_bf16(r, dst),
            MatStore::Int8(_) => panic!("an int8 trunk matrix has no bf16 rows"),
        }
    }

    /// A stable identity of the matrix's storage (its address), for backends that keep copies.
    pub fn id(&self) -> usize {
        match &self.store {
            MatStore::Bf16(d) => d.as_ptr() as usize,
            MatStore::Coded(c) => Arc::as_ptr(c) as usize,
            MatStore::Int8(q) => Arc::as_ptr(q) as usize,
        }
    }

    /// Bytes the matrix holds in memory (its coded size when coded).
    pub fn byte_len(&self) -> usize {
        match &self.store {
            MatStore::Bf16(d) => d.len(),
            MatStore::Coded(c) => c.byte_len(),
            MatStore::Int8(q) => q.byte_len(),
        }
    }
}

/// One MXFP4 matrix as shipped: packed nibbles [rows, cols/2] and E8M0 scales [rows, cols/32].
#[derive(Clone, Copy, Debug)]
pub struct Mxfp4Mat<'a> {
    pub packed: &'a [u8],
    pub scales: &'a [u8],
    pub rows: usize,
    pub cols: usize,
}

impl<'a> Mxfp4Mat<'a> {
    /// Panics on inconsistent sizes (checked before compute by the roster).
    pub fn new(packed: &'a [u8], scales: &'a [u8], rows: usize, cols: usize) -> Self {
        assert_eq!(cols % MXFP4_BLOCK, 0, "mxfp4 cols must be a multiple of 32");
        assert_eq!(packed.len(), rows * cols / 2, "mxfp4 packed size");
        assert_eq!(scales.len(), rows * cols / MXFP4_BLOCK, "mxfp4 scale size");
        Mxfp4Mat { packed, scales, rows, cols }
    }
    /// Row `r`'s packed bytes and scales.
    #[inline]
    pub fn row(&self, r: usize) -> (&'a [u8], &'a [u8]) {
        let pb = self.cols / 2;
        let sb = self.cols / MXFP4_BLOCK;
        (&self.packed[r * pb..(r + 1) * pb], &self.scales[r * sb..(r + 1) * sb])
    }
}

/// Per-head inputs of a KDA state update, each [n, d] for one head (q may be empty where no
/// outputs are wanted: a replay).
#[derive(Clone, Debug, Default)]
pub struct HeadIn {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub g: Vec<f32>,
    pub beta: Vec<f32>,
}

/// Head dimensions of an MLA attention core.
#[derive(Clone, Copy, Debug)]
pub struct MlaDims {
    pub heads: usize,
    pub nope: usize,
    pub rope: usize,
    pub lora: usize,
    pub v_head: usize,
}

/// Which cached tokens a row of an MLA attention core sees.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Visible {
    /// Row t sees the `past` cached tokens and the new rows up to itself (causal).
    Causal,
    /// Every row sees every cached token (no mask).
    All,
}

/// SiTU-GLU constants: gate `beta * tanh(g / beta) * sigmoid(g)`, up `linear_beta * tanh(u / linear_beta)`
/// (the up transform is off when `linear_beta <= 0`). Both betas must be normal and positive (the
/// config check makes them so; K3 ships 4 and 25).
#[derive(Clone, Copy, Debug)]
pub struct Situ {
    pub beta: f32,
    pub linear_beta: f32,
}

/// How rows of router logits become each row's experts and weights (`Backend::route_top_k`):
/// s = sigmoid(logit); the `k` largest of s + bias, descending, lower id first on ties, NaN last;
/// weights s / (sum of the selected s + 1e-20 when `renormalize`) * `scaling`.
#[derive(Clone, Copy, Debug)]
pub struct RouteRule {
    pub k: usize,
    /// Divide the selected scores by their sum (+ 1e-20).
    pub renormalize: bool,
    pub scaling: f32,
}

/// Where the six records of one MXFP4 gated expert lie in its byte image (the same for every
/// expert of a model): w1 (gate) packed and scales, w3 (up) packed and scales, w2 (down) packed
/// and scales, in that order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertLayout {
    /// (offset, length) of each record, in the order above.
    pub parts: [(usize, usize); 6],
    pub len: usize,
    /// Expert FFN width (rows of w1/w3) and latent width (rows of w2).
    pub inter: usize,
    pub latent: usize,
}

impl ExpertLayout {
    /// The three matrices of one expert (w1, w3, w2), borrowed from its bytes.
    pub fn mats<'b>(&self, bytes: &'b [u8]) -> [Mxfp4Mat<'b>; 3] {
        let part = |i: usize| {
            let (o, n) = self.parts[i];
            &bytes[o..o + n]
        };
        [
            Mxfp4Mat::new(part(0), part(1), self.inter, self.latent),
            Mxfp4Mat::new(part(2), part(3), self.inter, self.latent),
            Mxfp4Mat::new(part(4), part(5), self.latent, self.inter),
        ]
    }
}
