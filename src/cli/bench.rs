//! `deltafin bench`: measurements that print one JSON record per run (machine, command, git
//! revision, counters); the measuring is `crate::bench`'s. `bench io` reads one expert set through
//! the expert store and through fio replaying exactly the same reads in the same run;
//! `bench kernels` times the compute kernels at K3's shapes; `bench run` is `cli/bench_run.rs`.

use super::load;
use crate::bench::kernels_gpu::{self, GpuKernelOptions};
use crate::bench::{io, kernels};
use crate::engine::BackendKind;
use crate::store::io::reader::ReaderKind;
use anyhow::{Result, bail};
use clap::{Args, Subcommand};
use std::io::Write;
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum BenchCmd {
    /// Expert reads through the store vs fio on the same reads.
    Io(IoArgs),
    /// Compute kernels at K3's real shapes: MXFP4 experts, bf16 projections, KDA state update.
    Kernels(KernelArgs),
    /// An exact prompt, cold, then decode steps: counters, timers, bound ratios; ladders and plots.
    Run(Box<super::bench_run::RunBenchArgs>),
}

#[derive(Args)]
pub struct KernelArgs {
    /// Prompt rows for the matrix-matrix and KDA measurements.
    #[arg(long, default_value_t = 512)]
    rows: usize,
    /// KDA heads (K3: 96).
    #[arg(long, default_value_t = 96)]
    heads: usize,
    /// Which kernels: the CPU's, or the GPU's (wgpu; any adapter, lavapipe included; only in a
    /// build with --features gpu-bench, a development tool).
    #[arg(long, value_enum, ignore_case = true, default_value_t = BackendKind::Cpu)]
    backend: BackendKind,
    /// Dispatches averaged per GPU measurement.
    #[arg(long, default_value_t = 20)]
    reps: usize,
    /// Development: also time every `*.wgsl` in DIR as the one-row MXFP4 kernel (entry `matvec`)
    /// on the `--matvec-rows` x 3584 matrix, with whether its output bits equal the shipped
    /// kernel's (GPU only).
    #[arg(long, value_name = "DIR", hide = true)]
    matvec_variants: Option<PathBuf>,
    /// Development: rows of the GPU's MXFP4 matvec matrix and of the variants' (a multiple of 16;
    /// default 49152, one layer's 16 routed w1; 98304 is their w1 and w3 as one decode dispatch;
    /// GPU only).
    #[arg(long, value_name = "N", hide = true)]
    matvec_rows: Option<usize>,
    /// Development: also time every `*.wgsl` in DIR as the MXFP4 matmul (entry `matmul`) on one
    /// expert's w1 times `--rows` input rows, with whether its output bits equal the shipped
    /// kernel's (GPU only).
    #[arg(long, value_name = "DIR", hide = true)]
    matmul_variants: Option<PathBuf>,
    #[command(flatten)]
    pub threads: super::Threads,
}

#[derive(Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    cmd: BenchCmd,
}

#[derive(Args)]
pub struct IoArgs {
    /// Model directory (uses MODEL/placement.json when present, else the shards).
    #[arg(long, required_unless_present = "demo", conflicts_with = "demo")]
    model: Option<PathBuf>,
    /// Use the built-in demo model (laid out under deltafin's cache directory on first use).
    #[arg(long)]
    demo: bool,
    /// Placement manifest (default: MODEL/placement.json if present).
    #[arg(long)]
    placement: Option<PathBuf>,
    /// Bytes of distinct experts to read, in GB (capped by the model's experts).
    #[arg(long, default_value_t = 2.0, value_parser = super::parse_gb_positive)]
    gb: f64,
    /// Reads in flight per drive when there is no placement.
    #[arg(long, default_value_t = 4, value_parser = super::parse_qd)]
    qd: usize,
    /// How the store reads (as for `run --reader`).
    #[arg(long, value_enum, default_value_t = ReaderKind::Auto)]
    reader: ReaderKind,
    /// The fio binary that replays the same reads (Debian/Ubuntu: apt-get install fio).
    #[arg(long, default_value = "fio")]
    fio: String,
    /// Runs of each side (alternating); the best rate of each is reported.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Label added to the record (e.g. "3 dirs").
    #[arg(long)]
    label: Option<String>,
    #[command(flatten)]
    cold: super::bench_run::ColdArgs,
}

impl BenchArgs {
    /// `--threads` of `bench kernels` and `bench run` (reads alone need none).
    pub fn threads(&self) -> Option<usize> {
        match &self.cmd {
            BenchCmd::Kernels(k) => k.threads.threads,
            BenchCmd::Run(r) => r.threads.threads,
            BenchCmd::Io(_) => None,
        }
    }
}

pub fn run(a: BenchArgs) -> Result<()> {
    match a.cmd {
        BenchCmd::Io(io) => bench_io(io),
        BenchCmd::Kernels(k) => bench_kernels(k),
        BenchCmd::Run(r) => super::bench_run::run(*r),
    }
}

fn bench_io(a: IoArgs) -> Result<()> {
    let files = load::open(&load::model_dir(&a.model, a.demo)?)?;
    let o = io::IoOptions {
        placement: a.placement,
        gb: a.gb,
        qd: a.qd,
        reader: a.reader,
        fio: a.fio,
        repeat: a.repeat,
        label: a.label,
        assume_purged: a.cold.assume_purged,
    };
    let out = io::io(&files, &o)?;
    if let Some(e) = &out.fio_error {
        eprintln!("deltafin bench io: fio comparison unavailable: {e}");
    }
    super::bench_run::note_warm("bench io", &out.record);
    writeln!(std::io::stdout(), "{}", out.record)?;
    Ok(())
}

fn bench_kernels(a: KernelArgs) -> Result<()> {
    if a.rows == 0 || a.heads == 0 || a.reps == 0 {
        bail!("--rows, --heads and --reps must be at least 1 (got {}, {} and {})", a.rows, a.heads, a.reps);
    }
    // The prompt-sized products hold `rows` x 7168 f32 inputs: 470 MB at the limit.
    if a.rows > kernels::MAX_ROWS {
        bail!("--rows {}: at most {} (a prompt of that many tokens)", a.rows, kernels::MAX_ROWS);
    }
    for (flag, dir) in [("--matvec-variants", &a.matvec_variants), ("--matmul-variants", &a.matmul_variants)] {
        if let Some(dir) = dir
            && !dir.is_dir()
        {
            bail!("{flag} {}: not a directory of .wgsl files", dir.display());
        }
    }
    let mr = a.matvec_rows.unwrap_or(16 * 3072);
    if mr == 0 || !mr.is_multiple_of(16) {
        bail!("--matvec-rows must be a positive multiple of 16, got {mr}");
    }
    if let Some(g) = kernels_gpu::open(a.backend)? {
        let o = GpuKernelOptions {
            rows: a.rows,
            reps: a.reps,
            matvec_rows: mr,
            matvec_variants: a.matvec_variants,
            matmul_variants: a.matmul_variants,
        };
        writeln!(std::io::stdout(), "{}", kernels_gpu::run(&g, &o)?)?;
        return Ok(());
    }
    if a.matvec_variants.is_some() || a.matvec_rows.is_some() || a.matmul_variants.is_some() {
        bail!("--matvec-variants, --matvec-rows and --matmul-variants are for the GPU's kernels: add --backend gpu");
    }
    writeln!(std::io::stdout(), "{}", kernels::cpu(a.rows, a.heads))?;
    Ok(())
}
