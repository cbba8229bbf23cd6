//! `deltafin run`: one-shot generation (greedy, or sampled with `--temperature`). Text streams to
//! stdout (held back only inside a UTF-8 character); the startup line, progress, the summary and
//! `--stats` go to stderr, so stdout can be piped. With
//! `--chat` stdout gets the answer only (the template's response channel, never a tag token) and
//! the reasoning goes to stderr, dimmed on a terminal. Several prompts (`--prompt` repeated,
//! `--prompt-file` repeated, or `--prompt-lines FILE`) run together: see `run_many`.
//!
//! Ending early: Ctrl-C stops where it is and what was done is still printed (with `--format
//! json` marked `"interrupted": true`), exit 130. A reader that closes the pipe (`run | head`) ends
//! generation; stderr and files are still written, then a quiet end by SIGPIPE (`signals`).

use super::report;
pub use super::run_args::{Format, RunArgs};
use super::session::{self, SessionFile};
use super::signals::{self, is_broken_pipe};
use super::{load, progress};
use crate::draft::{DraftKind, Speculator, WidthPolicy};
use crate::engine::{Engine, GenerateOptions};
use crate::model::tokenizer::{StreamDecoder, Tokenizer};
use crate::sample::{Sampler, SamplingSpec};
use crate::service::answer::Answer;
use crate::stats::Stats;
use anyhow::{Context, Result, bail};
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

pub fn run(mut a: RunArgs) -> Result<()> {
    a.take_words();
    a.check_outputs()?;
    signals::catch_ctrl_c();
    progress::set_quiet(a.quiet);
    let dir = load::model_dir(&a.model, a.demo)?;
    load::demo_draft(a.demo, a.draft, &mut a.engine)?;
    let needs_tok = (a.prompt_ids.is_none() && !(a.session.is_some() && a.no_input())) || a.chat;
    let tok = if needs_tok || dir.join("tiktoken.model").exists() {
        Some(crate::engine::load_tokenizer(&dir)?)
    } else {
        None
    };
    let seed = a.seed.unwrap_or_else(crate::util::fresh_seed);
    let sampling = SamplingSpec { seed: Some(seed), ..a.sampling.spec(&dir, a.demo)? };
    let mut saved = a.session.as_deref().map(SessionFile::peek).transpose()?;
    let mut prompts = match &mut saved {
        Some(f) => vec![session::continuation(&a, &dir, tok.as_ref(), &a.prompt_texts()?, f)?],
        None if a.no_input() => super::help::usage_error(
            "give a prompt: --prompt, --prompt-file, --prompt-lines or --prompt-ids (or --session FILE to resume)",
        ),
        None => a.prompt_ids(&dir, tok.as_ref())?,
    };
    if prompts.len() > 1 {
        return super::run_many::run_many(&a, dir, tok, prompts, sampling);
    }
    let prompt = prompts.pop().context("no prompt given")?;
    let tok = tok.map(Arc::new);
    let held = saved.as_ref().map_or(0, |f| f.tokens);
    let (engine, spec) = open(&a, &dir, &prompt, held, tok.as_deref(), &sampling)?;
    let done = generate(&a, &dir, &engine, spec, tok.as_ref(), &prompt, saved.as_mut(), sampling.clone())?;
    finish(&a, &engine, &prompt, tok.is_some(), sampling, done)
}

/// The engine for one prompt (its context what the prompt, the `held` tokens of a saved session
/// and `--max-new` need) and its drafter, checked against the prompt; the startup lines.
fn open(
    a: &RunArgs,
    dir: &Path,
    prompt: &[u32],
    held: usize,
    tok: Option<&Tokenizer>,
    sampling: &SamplingSpec,
) -> Result<(Arc<Engine>, Option<Speculator>)> {
    if a.draft == DraftKind::Dspark && a.engine.draft_model.is_none() {
        bail!(
            "--draft dspark needs --draft-model DIR (a DSpark checkpoint; `deltafin synth --dspark` writes a random one)"
        );
    }
    // A verify batch holds the pending token and up to `max` drafts.
    let rows = prompt.len().max(if a.draft == DraftKind::Off { 1 } else { WidthPolicy::default().max + 1 });
    let mut config = a.engine.config(dir.to_path_buf(), a.kda.into(), rows, 0);
    config.context = load::run_context(dir, config.context, (held + prompt.len()).saturating_add(a.max_new));
    let engine = load::open_engine(config)?;
    let spec = engine.speculator(a.draft)?;
    if let Some(t) = tok {
        engine.check_tokenizer(t)?;
    }
    let bound = engine.context_bound();
    if (held + prompt.len()).checked_add(a.max_new).is_none_or(|n| n > bound) {
        bail!(
            "the prompt ({} tokens) plus --max-new {} exceeds the usable context of {} tokens ({})",
            held + prompt.len(),
            a.max_new,
            bound,
            engine.context_limit()
        );
    }
    if !a.quiet {
        eprintln!("{}", report::startup(&engine, report::verbose(a.verbose)));
        if let Some(s) = &spec {
            let memory = match engine.draft_model_description() {
                Some(d) if s.uses_draft_model() => d,
                _ => "drafter memory: none".into(),
            };
            eprintln!("deltafin: drafting: {} | {memory}", s.describe());
        }
        if let Some(line) = super::sampling_args::sampling_line(sampling, false) {
            eprintln!("{line}");
        }
    }
    if let Some(note) = load::random_weights_note(dir) {
        eprintln!("{note}");
    }
    Ok((engine, spec))
}

/// What a generation left: its tokens, text and reasoning (`--chat`), whether the reader closed
/// the pipe, and its counters.
struct Done {
    ids: Vec<u32>,
    text: String,
    reasoning: Option<String>,
    pipe_closed: bool,
    stats: Stats,
    /// `--max-new` ended the answer.
    cut: bool,
}

/// Prefills the prompt and generates, streaming the text to stdout (`--format text`); saves the
/// session (`--session`).
#[allow(clippy::too_many_arguments)]
fn generate(
    a: &RunArgs,
    dir: &Path,
    engine: &Arc<Engine>,
    mut spec: Option<Speculator>,
    tok: Option<&Arc<Tokenizer>>,
    prompt: &[u32],
    saved: Option<&mut SessionFile>,
    sampling: SamplingSpec,
) -> Result<Done> {
    // Stop at the chat format's end-of-message token or the config's eos, whichever comes.
    let stops: Vec<u32> = if a.ignore_eos { Vec::new() } else { engine.stop_tokens(tok.map(|t| &**t)) };
    // A chat answer goes through the template's channels: the answer, the reasoning, no tags.
    let mut chat = match (tok, a.chat) {
        (Some(t), true) => Some(Answer::chat(Arc::clone(t), stops.clone(), a.thinking(dir)?)),
        _ => None,
    };
    let mut printer = super::chat::Printer::new(!a.hide_reasoning);
    let mut session = match &saved {
        Some(f) => f.open(engine)?,
        None => engine.new_session(),
    };
    let mut out = std::io::stdout().lock();
    let mut decoder = StreamDecoder::default();
    let mut text = String::new();
    let t0 = Instant::now();
    session.watch_prefill(Some(report::prefill_watcher(progress::mode(a.quiet))));
    let prefilled = match &mut spec {
        // A resumed session with nothing new generates from its saved logits.
        _ if prompt.is_empty() => Ok(()),
        Some(sp) => session.prefill_with(prompt, sp).map(|_| ()),
        None => session.prefill(prompt).map(|_| ()),
    };
    // Ctrl-C stops the prefill: nothing generated, what was measured still reported.
    if !signals::interrupted() {
        prefilled.context("prefill failed")?;
    }
    session.stats.ttft_s = t0.elapsed().as_secs_f64();
    let mut ids: Vec<u32> = Vec::with_capacity(a.max_new);
    let mut write_error: Option<anyhow::Error> = None;
    let opts = GenerateOptions { max_new: a.max_new, stop: stops.clone() };
    let mut on_token = |next: u32| {
        ids.push(next);
        if let Some(c) = &mut chat {
            let shown = c.token(next, &mut |d| {
                let shown = if a.format == Format::Text { printer.delta(&mut out, d) } else { Ok(()) };
                shown.map_err(|e| write_error = Some(e.into())).is_ok()
            });
            // Ctrl-C: this token is the last.
            return shown && !signals::interrupted();
        }
        let stop = stops.contains(&next);
        let piece = match tok {
            // Special tokens carry no text (skip_special_tokens).
            Some(t) if !stop && !t.is_special(next) => match t.token_bytes(next) {
                Ok(b) => decoder.push(b),
                Err(e) => {
                    write_error = Some(e.into());
                    return false;
                }
            },
            Some(_) => String::new(),
            None => format!("{}{next}", if ids.len() > 1 { "," } else { "" }),
        };
        text.push_str(&piece);
        if a.format == Format::Text
            && !piece.is_empty()
            && let Err(e) = out.write_all(piece.as_bytes()).and_then(|_| out.flush())
        {
            write_error = Some(e.into());
            return false;
        }
        // Ctrl-C: this token is the last.
        !signals::interrupted()
    };
    let mut sampler = saved.as_ref().map_or_else(|| Sampler::new(sampling.clone()), |f| f.sampler(a, sampling.clone()));
    let mut cut = false;
    if !signals::interrupted() {
        let g = match &mut spec {
            Some(sp) => session.generate_speculative_sampled(&opts, sp, &mut sampler, &mut on_token),
            None => session.generate_sampled(&opts, &mut sampler, &mut on_token),
        }
        .context("decode failed")?;
        cut = g.reason == crate::engine::StopReason::Length;
    }
    // A closed pipe ends the output, not the rest (stats, files); any other write error is one.
    let pipe_closed = match write_error {
        Some(e) if is_broken_pipe(&e) => true,
        Some(e) => return Err(e),
        None => false,
    };
    // An unfinished UTF-8 character at the end is dropped (it would print as U+FFFD).
    decoder.finish();
    let mut reasoning = None;
    if let Some(mut c) = chat {
        c.finish(&mut |d| a.format != Format::Text || printer.delta(&mut out, d).is_ok());
        printer.end();
        text = c.content;
        reasoning = Some(c.reasoning);
    }
    if let Some(f) = saved {
        f.save_after(&session, &sampler, &ids, reasoning.as_deref().map(|r| (text.as_str(), r)), a.quiet)?;
    }
    let mut stats = session.stats.clone();
    stats.source = Some(engine.source_report());
    Ok(Done { ids, text, reasoning, pipe_closed, stats, cut })
}

/// The end of a run: the answer's end (`--format json`: the whole record), the summary, the
/// counters and the files asked for; a closed pipe ends the process here.
fn finish(a: &RunArgs, engine: &Engine, prompt: &[u32], has_tok: bool, sampling: SamplingSpec, d: Done) -> Result<()> {
    let Done { ids, text, reasoning, pipe_closed, stats, cut } = d;
    let interrupted = signals::interrupted();
    if let (true, false, Some(r)) = (cut, interrupted, &reasoning) {
        eprintln!("{}", report::cut_note(a.max_new, &text, r));
    }
    let mut out = std::io::stdout().lock();
    let written = match (a.format, pipe_closed) {
        (_, true) => Ok(()),
        (Format::Text, false) => writeln!(out).and_then(|_| out.flush()),
        (Format::Json, false) => {
            let mut obj = serde_json::json!({"prompt_ids": prompt, "output_ids": ids, "stats": stats.to_json(), "engine_config": engine.config(), "backend_used": engine.backend_used(), "sampling": sampling});
            if has_tok {
                obj["text"] = serde_json::Value::String(text);
            }
            if let Some(r) = reasoning {
                obj["reasoning"] = serde_json::Value::String(r);
            }
            if interrupted {
                obj["interrupted"] = serde_json::Value::Bool(true);
            }
            writeln!(out, "{obj}").and_then(|_| out.flush())
        }
    };
    if interrupted {
        match stats.prompt_tokens {
            0 => eprintln!("deltafin: interrupted (Ctrl-C) during the prompt; nothing generated"),
            _ => eprintln!("deltafin: interrupted (Ctrl-C) after {} generated tokens", ids.len()),
        }
    }
    if !a.quiet {
        eprintln!("{}", report::summary(&stats));
    }
    if a.stats {
        eprint!("{}", report::stats_text(&stats, engine.config().prefetch));
    }
    if let Some(p) = &a.trace_routes {
        let body = serde_json::to_vec(&engine.route_trace(&stats))?;
        crate::util::write_atomic(p, &body).with_context(|| format!("cannot write {}", p.display()))?;
    }
    if let Some(p) = &a.stats_json {
        let body = serde_json::to_vec_pretty(&stats.to_json())?;
        crate::util::write_atomic(p, &body).with_context(|| format!("cannot write {}", p.display()))?;
    }
    if pipe_closed {
        signals::die_of_sigpipe();
    }
    Ok(written?)
}
