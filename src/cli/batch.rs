//! `deltafin batch`: a JSONL file of requests in, a JSONL file of results out, the model loaded
//! once (through the server's generator, so conversation reuse and the memo apply here too).
//!
//! Contract: each input line is `{"id", "prompt" | "messages", ...}` with the server's option
//! names (`max_tokens`, `temperature`, `top_p`, `seed`, `stop`, `logprobs`, `reasoning_effort`,
//! ...). Each result is one line appended with a single write (and synced) as soon as it is done,
//! so a batch killed at any moment leaves only whole lines — at worst one torn last line, which the
//! next run cuts off. A rerun skips the ids that have a result in the output (resumable after kill
//! -9) and runs again the lines whose record is an error (the user may have fixed them): their
//! error records are taken out of the output first (rewritten atomically). The output is locked
//! while a run writes it, so a second run on it refuses instead of repeating. A bad line (not
//! JSON, not UTF-8, a bad field) gets an error record (`{"id", "line", "error": {...}}`) and the
//! batch goes on; the run then exits 1, naming the failed lines, so a script never takes a batch
//! with failures for a clean one. Ctrl-C stops it: no new request starts, the running ones are
//! cancelled and not recorded, and a line says how many are done and how to go on (the same
//! command again); exit 130. `-` is standard input / standard output. The files are checked first
//! (`batch_io`, `outputs`): the output is never the input, a device or FIFO, or a file that is not
//! a batch output (unless `--force`, which empties it). Progress (done, rate, ETA) goes to stderr.
//!
//! `--parallel N` runs up to N requests as a running batch (`service::batch::run_lanes`, the
//! engine's lane driver): each step reads each layer's experts once for all of them; when one
//! finishes its result is written and the next request joins at the next step, its prompt's
//! rows in the same forward as the running ones' decode rows (and, with `--draft`, their verify
//! rows). Every answer is the one it gets alone. Results come in the order requests finish; a kill
//! loses only the running requests (a rerun redoes them). A request whose sequence state cannot
//! fit the memory budget even alone stops the batch with a message naming the budget. Without
//! `--context`, each sequence's context is what the input's longest request needs
//! (`service::batch::longest_request`), so the rest of the budget goes to the expert cache.

use super::batch_io::{self, is_std};
use super::batch_results::Results;
use super::load;
use super::progress::{self, Progress};
use super::sampling_args::{BatchWords, SamplingArgs};
use super::signals::interrupted;
use crate::api::{ApiError, ParseContext};
use crate::draft::DraftKind;
use crate::engine::EngineConfig;
use crate::service::batch::{
    Line, Step, error_record, input_lines, longest_request, result_record, run_lanes, walk_line,
};
use crate::service::generator::{GenConfig, GenError, Generator, Totals, template_takes_tools};
use crate::stats::Stats;
use anyhow::{Context, Result};
use clap::Args;
use serde_json::Value;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Args)]
pub struct BatchArgs {
    /// Model directory (config.json, safetensors shards, tokenizer files).
    #[arg(long, short, required_unless_present = "demo", conflicts_with = "demo")]
    pub model: Option<PathBuf>,
    /// Use the built-in demo model (K3 layout, laid out on first use; its generation_config.json
    /// gives the sampling defaults).
    #[arg(long)]
    pub demo: bool,
    /// Input JSONL ("-" for standard input).
    #[arg(long = "in", value_name = "FILE")]
    pub input: PathBuf,
    /// Output JSONL, appended to; ids already in it are skipped ("-" for standard output).
    #[arg(long = "out", value_name = "FILE")]
    pub output: PathBuf,
    /// Replace an existing --out (or --expert-heat) file that is not deltafin's (without it such a
    /// file is refused, untouched).
    #[arg(long)]
    pub force: bool,
    /// Tokens per request when a line gives no max_tokens.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Draft tokens for K3 to verify in batches (output is identical; only speed changes).
    #[arg(long, value_enum, default_value_t = DraftKind::Off)]
    pub draft: DraftKind,
    #[command(flatten)]
    pub sampling: SamplingArgs<BatchWords>,
    /// Do not reuse sessions: neither the previous request's when a prompt extends it, nor a
    /// prompt prefix that the requests share (by default prefilled once and forked for each).
    #[arg(long)]
    pub no_reuse: bool,
    /// Requests run together as a running batch (one read of each layer's experts a step for all
    /// of them; the next request joins when one finishes; drafts work per request); answers are
    /// identical to 1's.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub parallel: u64,
    #[command(flatten)]
    pub engine: super::engine::EngineArgs,
    /// No startup line and no progress display.
    #[arg(long, short)]
    pub quiet: bool,
    #[command(flatten)]
    pub threads: super::Threads,
}

pub fn run(mut a: BatchArgs) -> Result<()> {
    if batch_io::names_stdout(&a.output) {
        a.output = std::path::PathBuf::from("-");
    }
    batch_io::check_paths(&a.input, &a.output)?;
    use super::outputs::{Kind, Outputs};
    let input = Some(a.input.as_path());
    Outputs::new(a.force)
        .write("--out", Some(a.output.as_path()), Kind::Batch)
        .engine(&a.engine)
        .read("--in", input)
        .check()?;
    super::signals::catch_ctrl_c();
    let dir = load::model_dir(&a.model, a.demo)?;
    load::demo_draft(a.demo, a.draft, &mut a.engine)?;
    let sampling = a.sampling.spec(&dir, a.demo)?;
    let input = batch_io::read_input(&a.input)?;
    let lines = input_lines(&input);
    let (file, done) = match is_std(&a.output) {
        true => (None, Default::default()),
        false => {
            let (f, d) = batch_io::open_output(&a.output, a.force, &batch_io::Keys::of(&lines))?;
            (Some(f), d)
        }
    };
    if a.parallel as usize > a.engine.prefill_rows.max(1) {
        anyhow::bail!(
            "--parallel {} decodes {} rows a step, more than --prefill-rows {}: raise --prefill-rows",
            a.parallel,
            a.parallel,
            a.engine.prefill_rows
        );
    }
    let rows = a.engine.prefill_rows.max(8);
    let mut config = a.engine.config(dir.clone(), crate::engine::KdaMode::Recurrent, rows, 0);
    config.sequences = a.parallel as usize;
    let model_id = dir.file_name().map_or("deltafin".into(), |n| n.to_string_lossy().into_owned());
    let takes_tools = template_takes_tools(&dir);
    let ctx = ParseContext { model_id: &model_id, template_takes_tools: takes_tools, sampling, max_tokens: None };
    if config.context.is_none()
        && let Some(longest) =
            longest_request(&dir, &lines.iter().filter_map(|l| l.1.ok()).collect::<Vec<_>>(), &ctx, a.max_tokens)
    {
        config.context = load::run_context(&dir, None, longest);
    }
    // The prompt prefix the requests still to run share: prefilled once, its state kept beside them.
    let prefix = match a.no_reuse {
        true => Vec::new(),
        false => {
            let todo: Vec<&str> =
                lines.iter().filter(|l| !done.lines.contains_key(&l.0)).filter_map(|l| l.1.ok()).collect();
            crate::service::prefix::shared_prefix(&dir, &todo, &ctx, &|id| done.ids.contains_key(id))
        }
    };
    config.sequences += usize::from(!prefix.is_empty());
    let (mut generator, shared, prefix) = open(&a, &dir, config, prefix)?;
    let todo: Vec<_> = lines.into_iter().filter(|(_, l)| l.is_err() || l.is_ok_and(|l| !l.trim().is_empty())).collect();
    let t0 = Instant::now();
    let progress = Progress::new(progress::mode(a.quiet), "batch");
    let mut out = Results { file, ok: 0, failed: Vec::new(), progress, lines: todo.len() as u64 };
    let skipped = std::cell::Cell::new(0u64);
    // Lines an earlier run recorded as failed (skipped now, still failed).
    let mut failed_before: Vec<u64> = Vec::new();
    let mut seen: HashSet<String> = HashSet::new();
    let enc = generator.encoder();
    let mut todo = todo.into_iter();
    // The walk over the input: each line's record or checked request, skipping what is done.
    let mut walk = || -> Option<Line> {
        loop {
            // Ctrl-C: no new request starts.
            if interrupted() {
                return None;
            }
            let (n, line) = todo.next()?;
            match walk_line(n, line, &done, &mut seen, &ctx, &enc, a.max_tokens) {
                Step::Take(l) => return Some(l),
                Step::Skip(error) => {
                    skipped.set(skipped.get() + 1);
                    if error {
                        failed_before.push(n);
                    }
                }
            }
        }
    };
    let stats = if a.parallel > 1 {
        let mut write = |r: &Value| {
            out.write(r)?;
            out.tick(skipped.get());
            Ok(())
        };
        Some(run_lanes(&mut generator, a.parallel as usize, &mut walk, &mut write)?)
    } else {
        while let Some(l) = walk() {
            out.write(&one(&mut generator, l)).context("cannot write a result")?;
            out.tick(skipped.get());
        }
        None
    };
    out.progress.finish();
    let summary = counters(&generator.totals, stats.as_ref(), shared.as_ref(), prefix);
    out.finish(&a.output, skipped.get(), failed_before, &summary, t0)
}

/// The engine and its generator, the startup lines, and the shared `prefix` prefilled (its
/// counters and length; none when its drafter reads K3's hidden rows, or it cannot be prefilled).
fn open(
    a: &BatchArgs,
    dir: &Path,
    config: EngineConfig,
    mut prefix: Vec<u32>,
) -> Result<(Generator, Option<Stats>, usize)> {
    let engine = load::open_engine(config)?;
    // A drafter that cannot be built is a startup error, not a silent fallback.
    // One that drafts only from K3's hidden rows sees every prompt row: no shared prefix
    // (`service::prefix`); beside n-gram lookup (`auto`), a request on the prefix drafts by lookup.
    engine.drafter(a.draft)?;
    if engine.speculator(a.draft)?.is_some_and(|s| s.needs_whole_prompt()) {
        prefix.clear();
    }
    if !a.quiet {
        eprintln!("{}", super::report::startup(&engine, super::report::verbose(false)));
    }
    if let Some(note) = load::random_weights_note(dir) {
        eprintln!("{note}");
    }
    let mut generator =
        Generator::new(engine, GenConfig { draft: a.draft, reuse: !a.no_reuse, memo_entries: 64, state_dir: None })?;
    let shared = match prefix.is_empty() {
        true => None,
        false => {
            if !a.quiet {
                eprintln!("deltafin: batch: the requests share a {}-token prompt prefix: prefilled once", prefix.len());
            }
            let watcher = super::report::prefill_watcher(progress::mode(a.quiet));
            // A prefix that cannot be prefilled costs the sharing, never the batch: each request
            // then prefills (or fails) on its own.
            generator
                .share_prefix(&prefix, Some(watcher))
                .inspect_err(|e| eprintln!("deltafin: batch: the shared prefix is not used ({e})"))
                .ok()
        }
    };
    Ok((generator, shared, prefix.len()))
}

/// A line's record, its request run alone.
fn one(generator: &mut Generator, l: Line) -> Value {
    match l {
        Line::Record(r) => r,
        // Ctrl-C cancels the request: its record is not written (`Results::write`).
        Line::Job(w) => match generator.generate_prepared(&w.req, w.prepared, 0.0, &mut |_| !interrupted()) {
            Ok(o) => result_record(&w.id, w.line, &o, w.req.logprobs.is_some(), &|t| generator.token_text(t)),
            Err(GenError::Request(e)) => error_record(&w.id, w.line, &e),
            Err(e) => {
                error_record(&w.id, w.line, &ApiError::new(500, "server_error", "generation_failed", e.to_string()))
            }
        },
    }
}

/// The summary's counters: prompt rows prefilled, routed expert bytes asked for and read (a
/// shared prefix's counted once; a running batch's shared forwards once).
fn counters(t: &Totals, batch: Option<&Stats>, shared: Option<&Stats>, prefix: usize) -> String {
    let mb = |b: u64| b as f64 / 1e6;
    let asked = batch.map_or(t.expert_bytes_requested, |s| s.reads.expert_bytes_requested);
    let read = batch.map_or(Some(t.expert_bytes_read), |s| s.reads.expert_bytes_read);
    let (p_asked, p_read) =
        shared.map_or((0, 0), |p| (p.reads.expert_bytes_requested, p.reads.expert_bytes_read.unwrap_or(0)));
    let rows = match shared {
        Some(_) => format!("{} ({prefix} of them the shared prefix, once)", t.prefill_rows + prefix as u64),
        None => t.prefill_rows.to_string(),
    };
    let read = read.map_or(String::new(), |r| format!(", read {:.1} MB", mb(r + p_read)));
    format!(", prefill rows {rows}, expert bytes requested {:.1} MB{read}", mb(asked + p_asked))
}
