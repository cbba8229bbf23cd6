//! `deltafin bench run`: an exact prompt, cold, then a few decode steps; one JSON record per run
//! (printed, and appended to `--out`), measured by `crate::bench::run`: every counter and timer,
//! the disk ceiling measured in the same run (before the prompt, between prompt and decode, after
//! decode) and the bound ratios of TTFT and of a decode token.
//!
//! `--batch N` runs N prompts together instead (shared prefill passes, lockstep decode; the
//! record and its bounds: `crate::bench::batch`).
//!
//! `--ladder` repeats over drive subsets of the placement; `--plot DIR` draws the ladder and the
//! per-layer read wait as SVG.

use super::engine::EngineArgs;
use super::load;
use crate::bench::prompt;
use crate::bench::run::{BenchDraft, PrefetchRuns, RunOptions};
use crate::engine::KdaMode;
use anyhow::{Context, Result, bail};
use clap::Args;
use std::io::Write;
use std::path::PathBuf;

#[derive(Args)]
pub struct RunBenchArgs {
    /// Model directory.
    #[arg(long, required_unless_present = "demo", conflicts_with = "demo")]
    model: Option<PathBuf>,
    /// Use the built-in demo model (laid out under deltafin's cache directory on first use).
    #[arg(long)]
    demo: bool,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 512, conflicts_with = "prompt_ids")]
    prompt_tokens: usize,
    /// Prompt token ids instead of the built-in text: comma-separated (1,2,3, as `run` takes them),
    /// or @FILE holding a JSON array or ids separated by spaces, commas or newlines (e.g. the ids
    /// another engine's benchmark used).
    #[arg(long, value_name = "IDS|@FILE")]
    prompt_ids: Option<String>,
    /// Decode steps after the prompt.
    #[arg(long, default_value_t = 8)]
    decode: usize,
    /// Repeat the prompt over drive subsets of the placement: drives {0}, {0,1}, ...
    #[arg(long)]
    ladder: bool,
    /// Write ladder.svg and read_wait.svg here.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Prefetch setting(s) to run.
    #[arg(long, value_enum, default_value_t = PrefetchRuns::Off)]
    prefetch_runs: PrefetchRuns,
    /// Seconds of reads (at least) for each of the three disk ceiling probes (0 skips them).
    #[arg(long, default_value_t = 3.0)]
    ceiling_seconds: f64,
    /// Drafting during the decode steps (output is identical; the record shows acceptance).
    #[arg(long, value_enum, default_value_t = BenchDraft::Off)]
    draft: BenchDraft,
    /// Run this many prompts together (each --prompt-tokens long, from different places of the
    /// text): shared expert-major prefill passes and lockstep decode, each checked against its run
    /// alone.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=4096), conflicts_with_all = ["ladder", "draft", "prompt_ids"])]
    batch: Option<u64>,
    /// Also write every record (one JSON per line) to this file.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write the run's expert fetch trace (one [layer, [experts...]] per MoE layer pass, prefill
    /// then decode, and beside each pass of several rows the rows routed to each expert) as JSON,
    /// for studying cache policies offline (the repository's cache simulator replays it).
    #[arg(long, value_name = "FILE")]
    fetch_trace: Option<PathBuf>,
    /// Write over an existing --out, --fetch-trace, --plot or --expert-heat file that deltafin
    /// did not write.
    #[arg(long)]
    force: bool,
    #[command(flatten)]
    cold: ColdArgs,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    pub threads: super::Threads,
}

pub fn run(a: RunBenchArgs) -> Result<()> {
    use super::outputs::{Kind, Outputs};
    let plot = |name: &str| a.plot.as_ref().map(|d| d.join(name));
    let (ladder, wait) = (plot("ladder.svg"), plot("read_wait.svg"));
    Outputs::new(a.force)
        .write("--out", a.out.as_deref(), Kind::BenchRecords)
        .write("--fetch-trace", a.fetch_trace.as_deref(), Kind::FetchTrace)
        .write("--plot", ladder.as_deref(), Kind::Plot)
        .write("--plot", wait.as_deref(), Kind::Plot)
        .engine(&a.engine)
        .read("--prompt-ids", a.prompt_ids.as_deref().and_then(|p| p.strip_prefix('@')).map(std::path::Path::new))
        .check()?;
    if a.prompt_tokens == 0 {
        bail!("--prompt-tokens must be > 0");
    }
    if a.draft == BenchDraft::Dspark && a.engine.draft_model.is_none() {
        bail!("--draft dspark needs --draft-model DIR");
    }
    let model = load::model_dir(&a.model, a.demo)?;
    let files = load::open(&model)?;
    let prompt = match a.prompt_ids.as_deref() {
        Some(arg) => {
            let ids = match arg.strip_prefix('@') {
                Some(file) => prompt::ids_from(std::path::Path::new(file))?,
                None => super::parse_ids(arg).map_err(|e| anyhow::anyhow!("--prompt-ids: {e}"))?.0,
            };
            // Checked here too (the forward pass refuses them) so a bad id fails before the
            // engine opens and the disk is probed.
            let vocab = files.cfg.vocab;
            if let Some((i, id)) = ids.iter().enumerate().find(|(_, id)| **id as usize >= vocab) {
                bail!("--prompt-ids: id {id} at position {i} is outside the vocabulary (size {vocab})");
            }
            ids
        }
        None => prompt::tokens(&files, a.prompt_tokens)?,
    };
    if let Some(n) = a.batch {
        let n = n as usize;
        let mut config = a.engine.config(model.clone(), KdaMode::Recurrent, a.prompt_tokens * n, 0);
        config.sequences = n;
        // Each sequence holds its prompt and its decode tokens (in whole 64s, as `run`): the rest
        // of the budget is the expert cache's. An explicit --context stands.
        config.context = super::load::run_context(&model, config.context, a.prompt_tokens + a.decode.max(1));
        let rec = crate::bench::batch::runs(
            &files,
            config,
            a.prompt_tokens,
            n,
            a.decode,
            a.ceiling_seconds,
            a.cold.assume_purged,
        )?;
        note_warm("bench run", &rec);
        writeln!(std::io::stdout(), "{rec}")?;
        if let Some(p) = &a.out {
            writeln!(open_out(p, a.force)?, "{rec}")?;
        }
        return Ok(());
    }
    // The rows the engine holds at once are the run's to choose (the prompt, or a verify batch).
    let config = a.engine.config(model.clone(), KdaMode::Recurrent, prompt.len(), 0);
    let o = RunOptions {
        decode: a.decode,
        draft: a.draft,
        ladder: a.ladder,
        prefetch_runs: a.prefetch_runs,
        ceiling_seconds: a.ceiling_seconds,
        fetch_trace: a.fetch_trace.clone(),
        assume_purged: a.cold.assume_purged,
    };
    let mut out = a.out.as_deref().map(|p| open_out(p, a.force)).transpose()?;
    let records = crate::bench::run::runs(&files, &config, &prompt, &o, &mut |rec| {
        note_warm("bench run", rec);
        writeln!(std::io::stdout(), "{rec}")?;
        match &mut out {
            Some(f) => writeln!(f, "{rec}"),
            None => Ok(()),
        }
    })?;
    if let Some(dir) = &a.plot {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        super::plot::ladder(&dir.join("ladder.svg"), &records)?;
        super::plot::read_wait(&dir.join("read_wait.svg"), &records)?;
        eprintln!("deltafin bench: wrote {}/ladder.svg and {}/read_wait.svg", dir.display(), dir.display());
    }
    Ok(())
}

/// `--out`, opened to append records; with `--force` a file that holds no records of ours is
/// emptied first (`outputs` refused it without).
fn open_out(p: &std::path::Path, force: bool) -> Result<std::fs::File> {
    let f = std::fs::OpenOptions::new().create(true).append(true).open(p);
    let f = f.with_context(|| format!("cannot open {}", p.display()))?;
    if force && super::outputs::foreign(p, super::outputs::Kind::BenchRecords) {
        f.set_len(0).with_context(|| format!("cannot empty {}", p.display()))?;
    }
    Ok(f)
}

/// How a benchmark that reads cold knows the page cache was emptied.
#[derive(Args)]
pub struct ColdArgs {
    /// The page cache was purged just before this command (macOS: `sudo purge`). macOS has no
    /// O_DIRECT: its uncached reads (F_NOCACHE) still serve pages already cached, so without this
    /// (or root, which purges itself) a Mac's record says "cold": false. Linux needs none: its
    /// reads are O_DIRECT.
    #[arg(long)]
    pub assume_purged: bool,
}

/// Says on stderr why a record is not cold (its `cold_note`).
pub fn note_warm(command: &str, record: &serde_json::Value) {
    if let Some(note) = record.get("cold_note").and_then(|n| n.as_str()) {
        eprintln!("deltafin {command}: not a cold figure: {note}");
    }
}
