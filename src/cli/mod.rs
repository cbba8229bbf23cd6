//! Command-line interface: clap definitions and one file per subcommand. Errors are `anyhow` with
//! context here at the edge; exit codes: 0 success, 1 runtime error, 2 usage error.

mod batch;
mod bench;
mod bench_run;
mod engine;
mod help;
mod load;
mod names;
mod pack_trunk;
mod place;
mod plan;
mod plot;
mod run;
mod run_args;
mod run_many;
mod score;
mod serve;
mod setup;
mod synth;
mod verify;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "deltafin",
    version,
    about = "Runs Kimi K3 exactly on one machine by streaming its MXFP4 experts from SSDs"
)]
pub struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

/// The subcommands' names (for the tip on a mistyped one).
const SUBCOMMANDS: &[&str] = &["run", "score", "synth", "place", "bench", "setup", "batch", "serve", "verify"];

/// `--threads`, on the subcommands whose kernels run on the thread pool.
#[derive(clap::Args, Clone, Copy, Debug, Default)]
pub struct Threads {
    /// Worker threads for the kernels (default: all cores, or RAYON_NUM_THREADS). Results do not
    /// depend on it.
    #[arg(long = "threads", value_parser = parse_threads)]
    pub threads: Option<usize>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate from a prompt (greedy, or sampled with --temperature).
    #[command(after_help = help::RUN)]
    Run(run::RunArgs),
    /// Compute logits at every position of a prompt and write them to a safetensors file.
    #[command(after_help = help::SCORE)]
    Score(score::ScoreArgs),
    /// Write a random-weight checkpoint in the exact shipped layout (any size).
    #[command(after_help = help::SYNTH)]
    Synth(synth::SynthArgs),
    /// Place experts on drives: pack files + placement.json (or --verify an existing placement).
    #[command(after_help = help::PLACE)]
    Place(place::PlaceArgs),
    /// Code the trunk losslessly into MODEL/trunk-coded/ (used by --trunk coded, the default when present).
    #[command(after_help = help::PACK_TRUNK)]
    PackTrunk(pack_trunk::PackTrunkArgs),
    /// Kimi K3's memory plan on a machine of --memory-gb: trunk per encoding, expert cache, decode bound.
    #[command(after_help = help::PLAN)]
    Plan(plan::PlanArgs),
    /// Benchmarks printing one JSON record per run.
    #[command(after_help = help::BENCH)]
    Bench(bench::BenchArgs),
    /// Install a model from a Hugging Face-compatible hub (--full, or --stream experts on demand).
    #[command(after_help = help::SETUP)]
    Setup(setup::SetupArgs),
    /// Run a JSONL file of requests (resumable: ids already in the output are skipped).
    #[command(after_help = help::BATCH)]
    Batch(batch::BatchArgs),
    /// OpenAI-compatible HTTP server (chat, completions, streaming, metrics, a chat page at /).
    #[command(after_help = help::SERVE)]
    Serve(serve::ServeArgs),
    /// Check every byte of a model's files against their recorded checksums (records them first if none).
    Verify(verify::VerifyArgs),
}

impl Cmd {
    /// `--threads` of the subcommands that take it.
    fn threads(&self) -> Option<usize> {
        match self {
            Cmd::Run(a) => a.threads.threads,
            Cmd::Score(a) => a.threads.threads,
            Cmd::Synth(a) => a.threads.threads,
            Cmd::Bench(a) => a.threads(),
            Cmd::Batch(a) => a.threads.threads,
            Cmd::Serve(a) => a.threads.threads,
            Cmd::Place(_) | Cmd::Setup(_) | Cmd::PackTrunk(_) | Cmd::Plan(_) | Cmd::Verify(_) => None,
        }
    }
}

/// How KDA evaluates a prompt (hidden option for tests and comparisons).
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum KdaArg {
    /// The recurrence (the engine's choice).
    Auto,
    Chunked,
    Recurrent,
}

impl From<KdaArg> for crate::engine::KdaMode {
    fn from(k: KdaArg) -> Self {
        match k {
            KdaArg::Auto | KdaArg::Recurrent => crate::engine::KdaMode::Recurrent,
            KdaArg::Chunked => crate::engine::KdaMode::Chunked,
        }
    }
}

/// Diagnostics as "deltafin: warning: ..." lines on stderr.
struct Prefixed;

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for Prefixed
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut w: tracing_subscriber::fmt::format::Writer<'_>,
        ev: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let level = match *ev.metadata().level() {
            tracing::Level::ERROR => "error",
            tracing::Level::WARN => "warning",
            tracing::Level::INFO => "info",
            tracing::Level::DEBUG => "debug",
            tracing::Level::TRACE => "trace",
        };
        write!(w, "deltafin: {level}: ")?;
        ctx.field_format().format_fields(w.by_ref(), ev)?;
        writeln!(w)
    }
}

/// Parses arguments, runs the subcommand and maps errors to exit codes.
pub fn main() -> ExitCode {
    // Library messages name settings by the flags that set them.
    names::install();
    let args: Vec<String> = std::env::args().collect();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(mut e) => {
            help::add_tips(&mut e, &args);
            let _ = e.print();
            return if e.use_stderr() { ExitCode::from(2) } else { ExitCode::SUCCESS };
        }
    };
    // Library diagnostics go through `tracing`; DELTAFIN_LOG (e.g. "debug", "deltafin::store=trace")
    // picks what is shown, warnings by default.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .event_format(Prefixed)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("DELTAFIN_LOG").unwrap_or_else(|_| "warn".into()))
        .init();
    // rayon reads RAYON_NUM_THREADS itself when --threads is absent; hold it to the same bound so a
    // stray value is a clear usage error, not a panic when the pool first starts.
    let threads = match (cli.cmd.threads(), std::env::var("RAYON_NUM_THREADS")) {
        (Some(n), _) => Some(n),
        (None, Ok(v)) if !v.trim().is_empty() => match parse_threads(v.trim()) {
            Ok(n) => Some(n),
            Err(e) => {
                eprintln!("error: RAYON_NUM_THREADS={v}: {e}");
                return ExitCode::from(2);
            }
        },
        _ => None,
    };
    if let Some(n) = threads
        && let Err(e) = rayon::ThreadPoolBuilder::new().num_threads(n).build_global()
    {
        eprintln!("error: cannot set up {n} threads: {e}");
        return ExitCode::from(1);
    }
    let result = match cli.cmd {
        Cmd::Run(a) => run::run(a),
        Cmd::Score(a) => score::run(a),
        Cmd::Synth(a) => synth::run(a),
        Cmd::Place(a) => place::run(a),
        Cmd::PackTrunk(a) => pack_trunk::run(a),
        Cmd::Plan(a) => plan::run(a),
        Cmd::Bench(a) => bench::run(a),
        Cmd::Setup(a) => setup::run(a),
        Cmd::Serve(a) => serve::run(a),
        Cmd::Batch(a) => batch::run(a),
        Cmd::Verify(a) => verify::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_text(&e));
            ExitCode::from(1)
        }
    }
}

/// The error and its causes, each once: library errors embed their source in their own message
/// (so they read well alone), and anyhow's chain would print that source a second time.
pub(crate) fn error_text(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let t = cause.to_string();
        if !out.contains(&t) {
            let sep = if out.is_empty() { "" } else { ": " };
            out = format!("{out}{sep}{t}");
        }
    }
    out
}

/// Most kernel threads accepted: far past any core count, short of exhausting the process's threads.
pub(crate) const MAX_THREADS: usize = 1024;

/// `--threads N`: 1..=MAX_THREADS.
pub(crate) fn parse_threads(s: &str) -> Result<usize, String> {
    let n: usize = s.parse().map_err(|_| format!("`{s}` is not a thread count (expected 1..={MAX_THREADS})"))?;
    if !(1..=MAX_THREADS).contains(&n) {
        return Err(format!("{n} threads is outside 1..={MAX_THREADS}"));
    }
    Ok(n)
}

/// `--qd N` (reads in flight per drive): 1..=MAX_QD.
pub(crate) fn parse_qd(s: &str) -> Result<usize, String> {
    use crate::store::reader::MAX_QD;
    let n: usize = s.parse().map_err(|_| format!("`{s}` is not a queue depth (expected 1..={MAX_QD})"))?;
    if !(1..=MAX_QD).contains(&n) {
        return Err(format!("queue depth {n} is outside 1..={MAX_QD}"));
    }
    Ok(n)
}

/// A size in GB that must be a finite number > 0 (`--memory-gb`).
pub(crate) fn parse_gb_positive(s: &str) -> Result<f64, String> {
    let g = parse_gb(s)?;
    if g == 0.0 {
        return Err("must be > 0".into());
    }
    Ok(g)
}

/// A size in GB that must be a finite number >= 0 (`--expert-cache-gb`).
pub(crate) fn parse_gb(s: &str) -> Result<f64, String> {
    let g: f64 = s.parse().map_err(|_| format!("`{s}` is not a number of GB"))?;
    // Far above any machine (1 EB), so that g * 1e9 stays exact enough and fits u64.
    if !g.is_finite() || !(0.0..=1e9).contains(&g) {
        return Err(format!("`{s}` is not a size in GB (expected a finite number from 0 to 1e9)"));
    }
    Ok(g)
}

/// A duration in seconds: a finite number > 0 and at most a day (`serve --read-timeout`).
pub(crate) fn parse_seconds(s: &str) -> Result<f64, String> {
    let t: f64 = s.parse().map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if !t.is_finite() || t <= 0.0 || t > 86_400.0 {
        return Err(format!("`{s}` is not a duration (expected seconds above 0, at most 86400)"));
    }
    Ok(t)
}

/// Refuses, before any compute, an output path that `util::write_atomic` would refuse at the end.
pub(crate) fn check_outputs<'a>(
    paths: impl IntoIterator<Item = (&'a str, Option<&'a std::path::Path>)>,
) -> anyhow::Result<()> {
    use anyhow::Context;
    for (flag, p) in paths {
        if let Some(p) = p {
            crate::util::check_output_path(p).with_context(|| format!("{flag} {}", p.display()))?;
        }
    }
    Ok(())
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
