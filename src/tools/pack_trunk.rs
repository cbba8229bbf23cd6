//! Coding a model's trunk (`deltafin pack-trunk`): the matrices the engine loads, in its order,
//! written by `model::trunk_pack` into `MODEL/trunk-coded/`, with what an entropy-coded exponent
//! would take on the same values for comparison (`backend::coded::huffman_bits`). The engine reads
//! what this writes (`engine/trunk.rs`, `--trunk coded`).
//!
//! Contract: packing is pure file work over the checked checkpoint (config, roster); the files it writes are
//! what `Engine::open` reads with `--trunk coded`. [`time_products`] measures the code's cost on
//! the model's own largest trunk matrix: bf16 and coded products interleaved round by round (so a
//! shared machine's load falls on both), each round's ratio kept, checked bit-identical.

use crate::backend::coded::{entropy_bits, exponent_histogram, huffman_bits};
use crate::k3::weights::{TrunkSource, Weights};
use crate::model::trunk_pack::{self, PackReport};
use crate::model::{Checkpoint, K3Config, ModelError, Roster};
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum PackTrunkError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Pack(#[from] trunk_pack::TrunkPackError),
}

/// What `pack-trunk` did and measured.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PackSummary {
    pub tensors: usize,
    pub report: PackReport,
    /// Distinct exponents over every coded value.
    pub distinct_exponents: usize,
    /// Mean bits per value of a Huffman-coded exponent plus sign and mantissa, and the entropy bound.
    pub huffman_bits_per_value: f64,
    pub entropy_bits_per_value: f64,
}

/// Codes the trunk of the model in `dir` (resumable); `progress` gets (files done, files).
pub fn pack(dir: &Path, progress: &mut dyn FnMut(usize, usize)) -> Result<PackSummary, PackTrunkError> {
    let cfg = K3Config::load(dir)?;
    let ck = Checkpoint::open(dir)?;
    Roster::build(&cfg, &ck)?;
    let names = std::cell::RefCell::new(Vec::new());
    Weights::load_from(&cfg, &ck, &TrunkSource::Names(&names))?;
    let names = names.into_inner();
    let fp = crate::model::fingerprint::fingerprint(&ck);
    let report = trunk_pack::write(&ck, &fp, &names, progress)?;
    let mut hist = [0u64; 256];
    for n in &names {
        if let Some(e) = ck.get(n) {
            for (h, x) in hist.iter_mut().zip(exponent_histogram(ck.bytes(e))) {
                *h += x;
            }
        }
    }
    Ok(PackSummary {
        tensors: names.len(),
        report,
        distinct_exponents: hist.iter().filter(|&&n| n > 0).count(),
        huffman_bits_per_value: huffman_bits(&hist),
        entropy_bits_per_value: entropy_bits(&hist),
    })
}

/// What [`time_products`] measured: the matrix, per-round coded / bf16 time ratios and their
/// medians, for a matrix-vector product (decode) and a 64-row product (prefill).
#[derive(Clone, Debug, serde::Serialize)]
pub struct ProductTiming {
    pub tensor: String,
    pub rows: usize,
    pub cols: usize,
    pub matvec_bf16_s: f64,
    pub matvec_coded_s: f64,
    pub matvec_ratios: Vec<f64>,
    pub matvec_ratio_median: f64,
    pub matmul64_ratios: Vec<f64>,
    pub matmul64_ratio_median: f64,
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() { f64::NAN } else { (s[(s.len() - 1) / 2] + s[s.len() / 2]) / 2.0 }
}

/// Times products with the largest coded trunk matrix of the model in `dir` against the same
/// matrix in bf16: `rounds` rounds of (bf16, coded), each side the best of a few repetitions.
pub fn time_products(dir: &Path, rounds: usize) -> Result<ProductTiming, PackTrunkError> {
    use crate::backend::Bf16Mat;
    use std::time::Instant;
    let ck = Checkpoint::open(dir)?;
    let fp = crate::model::fingerprint::fingerprint(&ck);
    let coded = trunk_pack::open(dir, &fp)?;
    let Some((name, c)) = coded.iter().max_by_key(|(n, m)| (m.rows * m.cols, n.as_str())) else {
        return Err(trunk_pack::TrunkPackError::Bad { path: dir.to_path_buf(), msg: "no coded matrices".into() }.into());
    };
    let e = ck.get(name).ok_or_else(|| trunk_pack::TrunkPackError::Bad {
        path: dir.to_path_buf(),
        msg: format!("the coded trunk names `{name}`, which the checkpoint lacks"),
    })?;
    let (rows, cols) = (c.rows, c.cols);
    let b = Bf16Mat::new(ck.shared_bytes(e).map_err(PackTrunkError::Model)?, rows, cols);
    let cm = Bf16Mat::coded(c.clone());
    let n = 64;
    let x: Vec<f32> = (0..cols * n).map(|i| ((i * 7919 % 2001) as f32 - 1000.0) / 1000.0).collect();
    let (mut ob, mut oc) = (vec![0f32; rows * n], vec![0f32; rows * n]);
    // Repetitions so one timing takes a few milliseconds at least.
    let reps = (20_000_000 / (rows * cols).max(1)).clamp(1, 200);
    let best = |f: &mut dyn FnMut()| {
        (0..3)
            .map(|_| {
                let t = Instant::now();
                for _ in 0..reps {
                    f();
                }
                t.elapsed().as_secs_f64() / reps as f64
            })
            .fold(f64::INFINITY, f64::min)
    };
    let (mut mv, mut mm, mut tb, mut tc) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds.max(1) {
        let a = best(&mut || crate::cpu::matvec_bf16(&b, &x[..cols], &mut ob[..rows]));
        let z = best(&mut || crate::cpu::matvec_bf16(&cm, &x[..cols], &mut oc[..rows]));
        tb.push(a);
        tc.push(z);
        mv.push(z / a);
        let a = best(&mut || crate::cpu::matmul_bf16(&b, &x, &mut ob));
        let z = best(&mut || crate::cpu::matmul_bf16(&cm, &x, &mut oc));
        mm.push(z / a);
    }
    if ob.iter().zip(&oc).any(|(p, q)| p.to_bits() != q.to_bits()) {
        return Err(trunk_pack::TrunkPackError::Bad {
            path: dir.to_path_buf(),
            msg: format!("`{name}`: coded products differ from bf16 (a decoder bug)"),
        }
        .into());
    }
    Ok(ProductTiming {
        tensor: name.clone(),
        rows,
        cols,
        matvec_bf16_s: median(&tb),
        matvec_coded_s: median(&tc),
        matvec_ratio_median: median(&mv),
        matvec_ratios: mv,
        matmul64_ratio_median: median(&mm),
        matmul64_ratios: mm,
    })
}
