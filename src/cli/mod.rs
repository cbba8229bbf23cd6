//! Command-line interface: clap definitions and one file per subcommand. Errors are `anyhow` with
//! context here at the edge; exit codes: 0 success, 1 runtime error, 2 usage error.

mod bench;
mod bench_run;
mod engine;
mod load;
mod place;
mod plot;
mod run;
mod score;
mod synth;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "deltafin",
    version,
    about = "Runs Kimi K3 exactly on one machine by streaming its MXFP4 experts from SSDs"
)]
pub struct Cli {
    /// Worker threads for the kernels (default: all cores). Results do not depend on it.
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate greedily from a prompt.
    Run(run::RunArgs),
    /// Compute logits at every position of a prompt and write them to a safetensors file.
    Score(score::ScoreArgs),
    /// Write a random-weight checkpoint in the exact shipped layout (any size).
    Synth(synth::SynthArgs),
    /// Place experts on drives: pack files + placement.json (or --verify an existing placement).
    Place(place::PlaceArgs),
    /// Benchmarks printing one JSON record per run.
    Bench(bench::BenchArgs),
}

/// How KDA evaluates a prompt (hidden option for tests and comparisons).
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum KdaArg {
    Auto,
    Chunked,
    Recurrent,
}

impl From<KdaArg> for crate::k3::KdaMode {
    fn from(k: KdaArg) -> Self {
        match k {
            KdaArg::Auto => crate::k3::KdaMode::Auto,
            KdaArg::Chunked => crate::k3::KdaMode::Chunked,
            KdaArg::Recurrent => crate::k3::KdaMode::Recurrent,
        }
    }
}

/// Parses arguments, runs the subcommand and maps errors to exit codes.
pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { ExitCode::from(2) } else { ExitCode::SUCCESS };
        }
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("DELTAFIN_LOG").unwrap_or_else(|_| "warn".into()))
        .init();
    if let Some(n) = cli.threads
        && let Err(e) = rayon::ThreadPoolBuilder::new().num_threads(n.max(1)).build_global()
    {
        eprintln!("error: cannot set up {n} threads: {e}");
        return ExitCode::from(1);
    }
    let result = match cli.cmd {
        Cmd::Run(a) => run::run(a),
        Cmd::Score(a) => score::run(a),
        Cmd::Synth(a) => synth::run(a),
        Cmd::Place(a) => place::run(a),
        Cmd::Bench(a) => bench::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// Token ids given on the command line as "1,2,3".
#[derive(Clone, Debug)]
pub struct TokenIds(pub Vec<u32>);

/// Parses "1,2,3" (spaces allowed) into token ids (public for the fuzz targets).
pub fn parse_ids(s: &str) -> Result<TokenIds, String> {
    s.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<u32>()
                .map_err(|_| format!("`{t}` is not a token id (expected comma-separated non-negative integers)"))
        })
        .collect::<Result<Vec<_>, _>>()
        .and_then(|v| if v.is_empty() { Err("the prompt is empty".to_string()) } else { Ok(TokenIds(v)) })
}
