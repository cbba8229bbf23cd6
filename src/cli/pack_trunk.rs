//! `deltafin pack-trunk`: codes the model's trunk losslessly into `MODEL/trunk-coded/`
//! (`crate::model::trunk_pack`; atomic per file, resumable, bound to the model's fingerprint) and
//! reports its size beside bf16's and what an entropy-coded exponent would take.

use super::load;
use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use std::io::Write as _;
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Encoding {
    /// Lossless: 11 bits per value plus a byte per escape, decoded inside the kernels (`--trunk coded`).
    Coded,
}

#[derive(Args)]
pub struct PackTrunkArgs {
    /// Model directory (config.json + safetensors shards); the coded trunk goes in DIR/trunk-coded/.
    #[arg(long, required_unless_present = "demo", conflicts_with = "demo")]
    model: Option<PathBuf>,
    /// Use the built-in demo model.
    #[arg(long)]
    demo: bool,
    /// The encoding to write (int8 is made at load time by `--trunk int8`, never stored).
    #[arg(long, value_enum, default_value_t = Encoding::Coded)]
    encoding: Encoding,
    /// One JSON object on stdout instead of the summary.
    #[arg(long)]
    json: bool,
    /// Then time products with the largest trunk matrix, bf16 and coded interleaved for this many
    /// rounds (per-round ratios and their median: what the code costs the kernels here).
    #[arg(long, value_name = "ROUNDS")]
    time_products: Option<usize>,
}

pub fn run(a: PackTrunkArgs) -> Result<()> {
    let dir = load::model_dir(&a.model, a.demo)?;
    let mut bar = super::progress::Progress::new(super::progress::mode(false), "coding the trunk");
    let sum = crate::tools::pack_trunk::pack(&dir, &mut |done, all| {
        bar.update(done as u64, all as u64, |d, t, _| format!("{d}/{t} files"))
    })
    .with_context(|| format!("cannot write the coded trunk of {}", dir.display()))?;
    bar.finish();
    let report = &sum.report;
    let mf = &report.manifest;
    let bits = 8.0 * mf.coded_bytes as f64 / mf.values.max(1) as f64;
    let mut v = serde_json::json!({
        "model": dir,
        "encoding": "coded",
        "tensors": sum.tensors,
        "values": mf.values,
        "bf16_bytes": mf.bf16_bytes,
        "coded_bytes": mf.coded_bytes,
        "ratio": mf.coded_bytes as f64 / mf.bf16_bytes.max(1) as f64,
        "bits_per_value": bits,
        "escapes": mf.escapes,
        "escape_fraction": mf.escapes as f64 / mf.values.max(1) as f64,
        "distinct_exponents": sum.distinct_exponents,
        "huffman_bits_per_value": sum.huffman_bits_per_value,
        "entropy_bits_per_value": sum.entropy_bits_per_value,
        "files_written": report.files_written,
        "files_kept": report.files_kept,
    });
    if let Some(r) = a.time_products {
        let t = crate::tools::pack_trunk::time_products(&dir, r).context("timing the coded products")?;
        v["products"] = serde_json::to_value(&t)?;
        if !a.json {
            writeln!(
                std::io::stdout(),
                "products with `{}` ({} x {}), coded / bf16, median of {r} interleaved rounds: matvec {:.3} ({:.2} vs {:.2} ms), 64-row matmul {:.3}",
                t.tensor,
                t.rows,
                t.cols,
                t.matvec_ratio_median,
                1e3 * t.matvec_coded_s,
                1e3 * t.matvec_bf16_s,
                t.matmul64_ratio_median
            )?;
        }
    }
    if a.json {
        writeln!(std::io::stdout(), "{v}")?;
    } else {
        writeln!(
            std::io::stdout(),
            "coded trunk of {}: {} tensors, {} -> {} ({:.1}% of bf16, {:.2} bits per value, {} escapes); an entropy-coded exponent would take {:.2} bits per value ({:.1}%); {} file(s) written, {} kept",
            dir.display(),
            sum.tensors,
            crate::util::human_bytes(mf.bf16_bytes),
            crate::util::human_bytes(mf.coded_bytes),
            100.0 * v["ratio"].as_f64().unwrap_or(0.0),
            bits,
            mf.escapes,
            v["huffman_bits_per_value"].as_f64().unwrap_or(0.0),
            100.0 * v["huffman_bits_per_value"].as_f64().unwrap_or(0.0) / 16.0,
            report.files_written,
            report.files_kept,
        )?;
    }
    Ok(())
}
