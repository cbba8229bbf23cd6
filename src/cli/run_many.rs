//! `deltafin run` with several prompts: a running batch (the engine's lane driver,
//! `Engine::run_continuous`) of up to `--parallel` prompts (default: all of them), each layer's
//! experts read once per step for all running prompts; when one finishes the next joins at the
//! next step, its prompt's rows in the same forward as the others' decode rows.
//!
//! Contract: each prompt's tokens and text are the ones `run` gives it alone with the same
//! options (and `--seed`), drafts (`--draft`) on or off; the answers are printed when all are
//! done, in prompt order — as text, each under a `--- N/M: prompt ---` line and ended by a
//! newline, or with `--format json` one JSON object a line (`prompt_ids`, `output_ids`, `text`)
//! and the counters of the whole batch in a last line (`{"stats": ...}`: each shared forward
//! counted once; prefill and decode overlap, so `prefill_s` is the time to the first token and
//! `decode_s` the rest). `--stats`, `--stats-json` and `--trace-routes` cover the whole batch.
//! Ctrl-C stops the batch (exit 130); a closed pipe ends the
//! output quietly (`signals`).

use super::load;
use super::run_args::{Format, RunArgs};
use crate::draft::DraftKind;
use crate::engine::{Engine, GenerateOptions, Generation, Lane, LaneError, LaneHost};
use crate::model::tokenizer::{StreamDecoder, Tokenizer};
use crate::sample::{Sampler, SamplingSpec};
use anyhow::{Context, Result, bail};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// The prompts as the lane driver's host: each prompt a lane, its generation kept by index.
struct Prompts<'a> {
    engine: &'a Arc<Engine>,
    prompts: &'a [Vec<u32>],
    opts: GenerateOptions,
    sampling: SamplingSpec,
    draft: DraftKind,
    next: usize,
    gens: Vec<Option<Generation>>,
    first_token: Option<Instant>,
    failed: Option<String>,
}

impl LaneHost for Prompts<'_> {
    type Tag = usize;

    fn next(&mut self, _idle: bool) -> Option<(usize, Lane)> {
        let i = self.next;
        let p = self.prompts.get(i).filter(|_| self.failed.is_none())?;
        self.next += 1;
        let lane = match Lane::new(
            self.engine.new_session(),
            p.clone(),
            self.opts.clone(),
            Sampler::new(self.sampling.clone()),
        ) {
            Ok(l) => l,
            Err(e) => {
                self.failed = Some(format!("prompt {}: {e}", i + 1));
                return None;
            }
        };
        // The drafter was built once at startup: here it cannot fail.
        let lane = match self.engine.speculator(self.draft).ok().flatten() {
            Some(d) => lane.with_drafts(d),
            None => lane,
        };
        Some((i, lane))
    }

    fn token(&mut self, _: &mut usize, _: u32) -> bool {
        self.first_token.get_or_insert_with(Instant::now);
        if super::signals::interrupted() {
            self.failed.get_or_insert_with(|| "interrupted (Ctrl-C)".into());
        }
        self.failed.is_none()
    }

    fn finished(&mut self, i: usize, lane: Lane) {
        self.gens[i] = Some(lane.generation());
    }

    fn failed(&mut self, i: usize, _lane: Lane, e: &LaneError) {
        self.failed.get_or_insert_with(|| format!("prompt {}: {e}", i + 1));
    }
}

/// Runs several prompts together (see the module contract).
pub(super) fn run_many(
    a: &RunArgs,
    dir: PathBuf,
    tok: Option<Tokenizer>,
    prompts: Vec<Vec<u32>>,
    sampling: SamplingSpec,
) -> Result<()> {
    let parallel = a.parallel.map_or(prompts.len(), |p| p as usize).max(1);
    // Rows in flight: prompt chunks up to --prefill-rows, and a decode step's rows (a verify
    // block of up to 8 per prompt with drafts).
    let total: usize = prompts.iter().map(Vec::len).sum();
    let per = if a.draft == DraftKind::Off { 1 } else { 8 };
    let rows = total.max(parallel * per);
    if parallel > a.engine.prefill_rows.max(1) {
        bail!(
            "{parallel} prompts together decode {parallel} rows a step, more than --prefill-rows {}: raise --prefill-rows or lower --parallel",
            a.engine.prefill_rows
        );
    }
    let mut config = a.engine.config(dir.clone(), a.kda.into(), rows, 0);
    config.sequences = parallel;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0).saturating_add(a.max_new);
    config.context = load::run_context(&dir, config.context, longest);
    let engine = load::open_engine(config)?;
    if let Some(t) = &tok {
        engine.check_tokenizer(t)?;
    }
    // A drafter that cannot be built is a startup error.
    engine.drafter(a.draft)?;
    let bound = engine.context_bound();
    for (i, p) in prompts.iter().enumerate() {
        if p.len().checked_add(a.max_new).is_none_or(|n| n > bound) {
            bail!(
                "prompt {} ({} tokens) plus --max-new {} exceeds the usable context of {bound} tokens ({})",
                i + 1,
                p.len(),
                a.max_new,
                engine.context_limit()
            );
        }
    }
    let mut lens: Vec<usize> = prompts.iter().map(|p| p.len() + a.max_new).collect();
    lens.sort_unstable_by(|x, y| y.cmp(x));
    lens.truncate(parallel);
    if let Err(e) = engine.sequences_fit(&lens) {
        // Name the widest batch that fits, when one does: the longest prompts were checked.
        match (1..lens.len()).rev().find(|&k| engine.sequences_fit(&lens[..k]).is_ok()) {
            Some(k) => bail!("{e}; --parallel {k} fits"),
            None => return Err(e.into()),
        }
    }
    if !a.quiet {
        eprintln!("{}", super::report::startup(&engine, super::report::verbose(a.verbose)));
        eprintln!("deltafin: {} prompts ({total} tokens), {parallel} at a time", prompts.len());
        if let Some(line) = super::sampling_args::sampling_line(&sampling, true) {
            eprintln!("{line}");
        }
    }
    if let Some(note) = load::random_weights_note(&dir) {
        eprintln!("{note}");
    }
    let stops: Vec<u32> = if a.ignore_eos { Vec::new() } else { engine.stop_tokens(tok.as_ref()) };
    let t0 = Instant::now();
    let mut host = Prompts {
        engine: &engine,
        prompts: &prompts,
        opts: GenerateOptions { max_new: a.max_new, stop: stops.clone() },
        sampling: sampling.clone(),
        draft: a.draft,
        next: 0,
        gens: vec![None; prompts.len()],
        first_token: None,
        failed: None,
    };
    let mut stats = engine.run_continuous(parallel, &mut host);
    if let Some(e) = host.failed {
        bail!("{e}");
    }
    let wall = t0.elapsed().as_secs_f64();
    stats.ttft_s = host.first_token.map_or(wall, |t| (t - t0).as_secs_f64());
    stats.prefill_s = stats.ttft_s;
    stats.decode_s = wall - stats.ttft_s;
    let gens: Vec<Generation> =
        host.gens.into_iter().map(|g| g.context("a prompt did not finish")).collect::<Result<_>>()?;
    stats.source = Some(engine.source_report());
    let thinking = if a.chat { Some(a.thinking(engine.dir())?) } else { None };
    let tok = tok.map(Arc::new);
    let written = print_answers(a, &prompts, &gens, (tok.as_ref(), thinking), &stops, &stats, &engine, sampling);
    if !a.quiet {
        eprintln!("{}", super::report::summary(&stats));
    }
    if a.stats {
        eprint!("{}", super::report::stats_text(&stats, engine.config().prefetch));
    }
    if let Some(p) = &a.trace_routes {
        let body = serde_json::to_vec(&engine.route_trace(&stats))?;
        crate::util::write_atomic(p, &body).with_context(|| format!("cannot write {}", p.display()))?;
    }
    if let Some(p) = &a.stats_json {
        let body = serde_json::to_vec_pretty(&stats.to_json())?;
        crate::util::write_atomic(p, &body).with_context(|| format!("cannot write {}", p.display()))?;
    }
    written
}

/// The answers on stdout in prompt order (see the module contract).
#[allow(clippy::too_many_arguments)]
fn print_answers(
    a: &RunArgs,
    prompts: &[Vec<u32>],
    gens: &[Generation],
    (tok, thinking): (Option<&Arc<Tokenizer>>, Option<crate::model::chat::Thinking>),
    stops: &[u32],
    stats: &crate::stats::Stats,
    engine: &Engine,
    sampling: SamplingSpec,
) -> Result<()> {
    let mut out = std::io::stdout().lock();
    let n = prompts.len();
    for (i, (p, g)) in prompts.iter().zip(gens).enumerate() {
        // A chat answer: its response channel, its reasoning apart, no tag (as `run` alone).
        let (text, reasoning) = match (tok, thinking) {
            (Some(t), Some(th)) => {
                let (c, r) = crate::service::answer::Answer::chat_text(Arc::clone(t), &g.tokens, stops, th);
                (Some(c), Some(r))
            }
            _ => (tok.map(|t| answer_text(t, &g.tokens, stops)).transpose()?, None),
        };
        if let (Some(c), Some(r), crate::engine::StopReason::Length) = (&text, &reasoning, g.reason) {
            eprintln!("{} (prompt {})", super::report::cut_note(a.max_new, c, r), i + 1);
        }
        match a.format {
            Format::Text => {
                // Which prompt: its first line, shortened (not with --chat: the template's text).
                let head = match tok.filter(|_| !a.chat).map(|t| answer_text(t, p, stops)).transpose()? {
                    Some(t) => {
                        let line = t.lines().find(|l| !l.trim().is_empty()).unwrap_or("").trim();
                        let short: String = line.chars().take(60).collect();
                        let more = if short.len() < line.len() { "..." } else { "" };
                        format!(": {short}{more}")
                    }
                    None => String::new(),
                };
                let ids = || g.tokens.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
                let gap = if i > 0 { "\n" } else { "" };
                writeln!(out, "{gap}--- {}/{n}{head} ---\n{}", i + 1, text.unwrap_or_else(ids))?;
            }
            Format::Json => {
                let mut obj = serde_json::json!({"prompt_ids": p, "output_ids": g.tokens});
                if let Some(t) = text {
                    obj["text"] = serde_json::Value::String(t);
                }
                if let Some(r) = reasoning {
                    obj["reasoning"] = serde_json::Value::String(r);
                }
                writeln!(out, "{obj}")?;
            }
        }
    }
    if a.format == Format::Json {
        writeln!(
            out,
            "{}",
            serde_json::json!({"stats": stats.to_json(), "engine_config": engine.config(), "backend_used": engine.backend_used(), "sampling": sampling})
        )?;
    }
    out.flush()?;
    Ok(())
}

/// An answer's text as `run` streams it alone: stop tokens and special tokens carry no text,
/// an unfinished UTF-8 character at the end is dropped.
fn answer_text(t: &Tokenizer, ids: &[u32], stops: &[u32]) -> Result<String> {
    let mut d = StreamDecoder::default();
    let mut text = String::new();
    for &id in ids {
        if !stops.contains(&id) && !t.is_special(id) {
            text.push_str(&d.push(t.token_bytes(id)?));
        }
    }
    d.finish();
    Ok(text)
}
