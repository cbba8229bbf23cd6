//! `deltafin batch`: a JSONL file of requests in, a JSONL file of results out, the model loaded
//! once (through the server's generator, so conversation reuse and the memo apply here too).
//!
//! Contract: each input line is `{"id", "prompt" | "messages", ...}` with the server's option
//! names (`max_tokens`, `temperature`, `top_p`, `seed`, `stop`, `logprobs`, `reasoning_effort`,
//! ...). Each result is one line appended with a single write (and synced) as soon as it is done,
//! so a batch killed at any moment leaves only whole lines — at worst one torn last line, which the
//! next run cuts off. A rerun skips the ids already in the output (resumable after kill -9); the
//! output is locked while a run writes it, so a second run on it refuses instead of repeating. A bad
//! line gets an error record (`{"id", "line", "error": {...}}`) and the batch goes on. `-` is
//! standard input / standard output. Progress (done, rate, ETA) goes to stderr.
//!
//! `--parallel N` runs up to N requests as a running batch (`serve::records::run_lanes`, the
//! engine's lane driver): each step reads each layer's experts once for all of them; when one
//! finishes its result is written and the next request joins at the next step, its prompt's
//! rows in the same forward as the running ones' decode rows (and, with `--draft`, their verify
//! rows). Every answer is the one it gets alone. Results come in the order requests finish; a kill
//! loses only the running requests (a rerun redoes them). A request whose sequence state cannot
//! fit the memory budget even alone stops the batch with a message naming the budget. Without
//! `--context`, each sequence's context is what the input's longest request needs
//! (`serve::records::longest_request`), so the rest of the budget goes to the expert cache.

use super::load;
use crate::serve::api::{self, ApiError, ParseContext};
use crate::serve::generator::{GenConfig, GenError, Generator, template_takes_tools};
use crate::serve::records::{Line, Waiting, done_records, error_record, longest_request, result_record, run_lanes};
use crate::spec::DraftKind;
use anyhow::{Context, Result};
use clap::Args;
use serde_json::Value;
use std::collections::HashSet;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Args)]
pub struct BatchArgs {
    /// Model directory (config.json, safetensors shards, tokenizer files).
    #[arg(long, required_unless_present = "demo", conflicts_with = "demo")]
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
    /// Tokens per request when a line gives no max_tokens.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Draft tokens for K3 to verify in batches (output is identical; only speed changes).
    #[arg(long, value_enum, default_value_t = DraftKind::Off)]
    pub draft: DraftKind,
    /// Temperature of lines that set none (default 0: greedy; with --demo, the demo's
    /// generation_config.json).
    #[arg(long)]
    pub temperature: Option<f64>,
    /// top_p of lines that set none (default 1; with --demo, the demo's generation_config.json).
    #[arg(long)]
    pub top_p: Option<f64>,
    /// top_k of lines that set none (default 0: off; with --demo, the demo's generation_config.json).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// min_p of lines that set none (default 0: off; with --demo, the demo's generation_config.json).
    #[arg(long)]
    pub min_p: Option<f64>,
    /// Do not reuse the previous request's session when a prompt extends it.
    #[arg(long)]
    pub no_reuse: bool,
    /// Requests run together as a running batch (one read of each layer's experts a step for all
    /// of them; the next request joins when one finishes; drafts work per request); answers are
    /// identical to 1's.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub parallel: u64,
    #[command(flatten)]
    pub engine: super::engine::EngineArgs,
    /// No startup line and no progress bar.
    #[arg(long, short)]
    pub quiet: bool,
    #[command(flatten)]
    pub threads: super::Threads,
}

fn is_std(p: &Path) -> bool {
    p.as_os_str() == "-"
}

/// Opens `out` for appending, locked against a second run appending the same results.
fn open_locked(out: &Path) -> Result<std::fs::File> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .append(true)
        .create(true)
        .open(out)
        .with_context(|| format!("cannot open {} for appending", out.display()))?;
    match f.try_lock() {
        Ok(()) => Ok(f),
        Err(std::fs::TryLockError::WouldBlock) => anyhow::bail!(
            "{} is being written by another `deltafin batch` run: wait for it to finish (this run would repeat its \
             requests), or choose another --out",
            out.display()
        ),
        Err(std::fs::TryLockError::Error(e)) => Err(e).with_context(|| format!("cannot lock {}", out.display())),
    }
}

/// Ids (and id-less line numbers) already in `f` (the output `out`); cuts a torn last line first.
fn already_done(f: &mut std::fs::File, out: &Path) -> Result<(HashSet<String>, HashSet<u64>)> {
    let mut bytes = Vec::new();
    f.read_to_end(&mut bytes).with_context(|| format!("cannot read {}", out.display()))?;
    let whole = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    if whole < bytes.len() {
        // A run killed mid-write left part of a line: drop it, its request is redone.
        f.set_len(whole as u64).with_context(|| format!("cannot repair {}", out.display()))?;
        f.seek(std::io::SeekFrom::End(0))?;
        eprintln!("deltafin: batch: cut a torn last line ({} bytes) from {}", bytes.len() - whole, out.display());
    }
    Ok(done_records(&bytes[..whole]))
}

/// Where result records go: the output file (one synced write each) or standard output.
struct Results {
    file: Option<std::fs::File>,
    ok: u64,
    errors: u64,
}

impl Results {
    fn write(&mut self, record: &Value) -> std::io::Result<()> {
        if record.get("error").is_some() {
            self.errors += 1;
        } else {
            self.ok += 1;
        }
        // One write per record: a kill leaves whole lines (and at worst one torn last line).
        let mut text = record.to_string();
        text.push('\n');
        match &mut self.file {
            Some(f) => f.write_all(text.as_bytes()).and_then(|_| f.sync_data()),
            None => {
                let mut o = std::io::stdout().lock();
                o.write_all(text.as_bytes()).and_then(|_| o.flush())
            }
        }
    }
}

pub fn run(mut a: BatchArgs) -> Result<()> {
    let dir = load::model_dir(&a.model, a.demo)?;
    load::demo_draft(a.demo, a.draft, &mut a.engine)?;
    let flags = load::SamplingFlags { temperature: a.temperature, top_p: a.top_p, top_k: a.top_k, min_p: a.min_p };
    let sampling = load::sampling(&dir, a.demo, flags)?;
    let input = if is_std(&a.input) {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).context("cannot read the batch from standard input")?;
        s
    } else {
        std::fs::read_to_string(&a.input).with_context(|| format!("cannot read {}", a.input.display()))?
    };
    let mut file = if is_std(&a.output) { None } else { Some(open_locked(&a.output)?) };
    let (done_ids, done_lines) = match &mut file {
        Some(f) => already_done(f, &a.output)?,
        None => Default::default(),
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
    let ctx = ParseContext { model_id: &model_id, template_takes_tools: template_takes_tools(&dir), sampling };
    if config.context.is_none()
        && let Some(longest) = longest_request(&dir, &input, &ctx, a.max_tokens)
    {
        config.context = load::run_context(&dir, None, longest);
    }
    let engine = load::open_engine(config)?;
    // A drafter that cannot be built is a startup error, not a silent fallback.
    crate::spec::drafter_for(a.draft, &engine)?;
    if !a.quiet {
        eprintln!("{}", engine.startup_line());
    }
    if let Some(note) = load::random_weights_note(&dir) {
        eprintln!("{note}");
    }
    let mut generator = Generator::new(engine, GenConfig { draft: a.draft, reuse: !a.no_reuse, memo_entries: 64 })?;
    let todo: Vec<(u64, &str)> =
        input.lines().enumerate().map(|(i, l)| (i as u64 + 1, l)).filter(|(_, l)| !l.trim().is_empty()).collect();
    let bar = if a.quiet { indicatif::ProgressBar::hidden() } else { indicatif::ProgressBar::new(todo.len() as u64) };
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} lines, {per_sec}, ETA {eta} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let t0 = Instant::now();
    let mut out = Results { file, ok: 0, errors: 0 };
    let mut skipped = 0u64;
    let parallel = a.parallel as usize;
    let mut seen: HashSet<String> = HashSet::new();
    let enc = generator.encoder();
    let mut todo = todo.into_iter();
    // The walk over the input: each line's record or checked request, skipping what is done.
    let mut walk = || -> Option<Line> {
        loop {
            let (n, line) = todo.next()?;
            bar.inc(1);
            let v = match serde_json::from_str::<Value>(line) {
                Err(_) if done_lines.contains(&n) => {
                    skipped += 1;
                    continue;
                }
                Err(e) => {
                    let e = ApiError::new(
                        400,
                        "invalid_request_error",
                        "invalid_json",
                        format!("line {n} is not JSON: {e}"),
                    );
                    return Some(Line::Record(error_record(&Value::Null, n, &e)));
                }
                Ok(v) => v,
            };
            let (id, req) = api::parse_batch_line(&v, &ctx);
            // Records carry the id as given (a string or a number).
            let id_val = v.get("id").filter(|_| id.is_some()).cloned().unwrap_or(Value::Null);
            let record = match (&id, req) {
                (Some(id), _) if done_ids.contains(id) => {
                    skipped += 1;
                    continue;
                }
                (None, _) if done_lines.contains(&n) => {
                    skipped += 1;
                    continue;
                }
                (_, Err(e)) => error_record(&id_val, n, &e),
                (Some(id), Ok(_)) if !seen.insert(id.clone()) => {
                    error_record(&id_val, n, &ApiError::invalid("id", format!("id {id} appears twice in the input")))
                }
                (Some(_), Ok(mut req)) => {
                    req.max_tokens = req.max_tokens.or(Some(a.max_tokens));
                    match enc.prepare(&req) {
                        Ok(p) => return Some(Line::Job(Box::new(Waiting { id: id_val, line: n, req, prepared: p }))),
                        Err(e) => error_record(&id_val, n, &e),
                    }
                }
                (None, Ok(_)) => error_record(&Value::Null, n, &ApiError::invalid("id", "the line has no id")),
            };
            return Some(Line::Record(record));
        }
    };
    let stats = if parallel > 1 {
        let mut write = |r: &Value| {
            out.write(r)?;
            bar.set_message(format!("{} errors", out.errors));
            Ok(())
        };
        Some(run_lanes(&mut generator, parallel, &mut walk, &mut write)?)
    } else {
        while let Some(l) = walk() {
            let record = match l {
                Line::Record(r) => r,
                Line::Job(w) => match generator.generate_prepared(&w.req, w.prepared, 0.0, &mut |_| true) {
                    Ok(o) => result_record(&w.id, w.line, &o, w.req.logprobs.is_some(), &|t| generator.token_text(t)),
                    Err(GenError::Request(e)) => error_record(&w.id, w.line, &e),
                    Err(e) => error_record(
                        &w.id,
                        w.line,
                        &ApiError::new(500, "server_error", "generation_failed", e.to_string()),
                    ),
                },
            };
            out.write(&record).context("cannot write a result")?;
            bar.set_message(format!("{} errors", out.errors));
        }
        None
    };
    bar.finish_and_clear();
    let (ok, errors) = (out.ok, out.errors);
    // A running batch's reads are shared by its requests: their total, once.
    let reads = stats
        .and_then(|s| s.expert_bytes_read)
        .map_or(String::new(), |b| format!(", expert reads {:.1} MB for the whole batch", b as f64 / 1e6));
    eprintln!(
        "deltafin: batch: {ok} done, {errors} errors, {skipped} already in the output, in {:.1} s{reads}",
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
