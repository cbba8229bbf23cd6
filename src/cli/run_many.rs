//! `deltafin run` with several prompts: all of them prefilled in shared expert-major passes and
//! decoded in lockstep (`Engine::prefill_sessions`, `Engine::generate_sessions`), each layer's
//! experts read once per pass for all of them.
//!
//! Contract: each prompt's tokens and text are the ones `run` gives it alone with the same
//! options (and `--seed`); the answers are printed when all are done, in prompt order — as text,
//! one answer after another, each ended by a newline, or with `--format json` one JSON object a
//! line (`prompt_ids`, `output_ids`, `text`) and the counters of the shared run in a last line
//! (`{"stats": ...}`). No drafts here; `--stats`, `--stats-json` and `--trace-routes` cover the
//! whole batch.

use super::load;
use super::run_args::{Format, RunArgs};
use crate::engine::{BatchSeq, GenerateOptions, Session};
use crate::model::tokenizer::{StreamDecoder, Tokenizer};
use crate::sample::{Sampler, SamplingParams};
use crate::spec::DraftKind;
use anyhow::{Context, Result, bail};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

/// Runs several prompts together (see the module contract).
pub(super) fn run_many(
    a: &RunArgs,
    dir: PathBuf,
    tok: Option<Tokenizer>,
    prompts: Vec<Vec<u32>>,
    sampling: SamplingParams,
) -> Result<()> {
    if a.draft != DraftKind::Off {
        bail!(
            "several prompts run without drafts (drafts per sequence in a batch are not built yet): leave out --draft"
        );
    }
    // Rows in flight: a prefill pass packs up to --prefill-rows, a decode step one per prompt.
    let total: usize = prompts.iter().map(Vec::len).sum();
    let rows = total.max(prompts.len());
    if prompts.len() > a.engine.prefill_rows.max(1) {
        bail!(
            "{} prompts decode {} rows a step, more than --prefill-rows {}: raise --prefill-rows",
            prompts.len(),
            prompts.len(),
            a.engine.prefill_rows
        );
    }
    let mut config = a.engine.config(dir.clone(), a.kda.into(), rows, 0);
    config.sequences = prompts.len();
    let engine = load::open_engine(config)?;
    if let Some(t) = &tok {
        engine.check_tokenizer(t)?;
    }
    let bound = engine.context_bound();
    for (i, p) in prompts.iter().enumerate() {
        if p.len().checked_add(a.max_new).is_none_or(|n| n > bound) {
            bail!(
                "prompt {} ({} tokens) plus --max-new {} exceeds the usable context of {bound} tokens",
                i + 1,
                p.len(),
                a.max_new
            );
        }
    }
    let lens: Vec<usize> = prompts.iter().map(|p| p.len() + a.max_new).collect();
    engine.sequences_fit(&lens)?;
    if !a.quiet {
        eprintln!("{}", engine.startup_line());
        eprintln!("deltafin: {} prompts ({total} tokens) run together", prompts.len());
        if !sampling.is_greedy() {
            eprintln!(
                "deltafin: sampling: temperature {} top-p {} seed {} (each prompt)",
                sampling.temperature, sampling.top_p, sampling.seed
            );
        }
    }
    if let Some(note) = load::random_weights_note(&dir) {
        eprintln!("{note}");
    }
    let stops: Vec<u32> = if a.ignore_eos { Vec::new() } else { engine.stop_tokens(tok.as_ref()) };
    let t0 = Instant::now();
    let mut sessions: Vec<Session> = prompts.iter().map(|_| engine.new_session()).collect();
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let mut stats = {
        let mut s: Vec<&mut Session> = sessions.iter_mut().collect();
        engine.prefill_sessions(&mut s, &refs).context("prefill failed")?
    };
    stats.ttft_s = t0.elapsed().as_secs_f64();
    let mut samplers: Vec<Sampler> = prompts.iter().map(|_| Sampler::new(sampling)).collect();
    let mut on_token: Vec<_> = prompts.iter().map(|_| |_: u32| true).collect();
    let gens = {
        let mut seqs: Vec<BatchSeq> = sessions
            .iter_mut()
            .zip(samplers.iter_mut())
            .zip(on_token.iter_mut())
            .map(|((session, sampler), on_token)| BatchSeq {
                session,
                opts: GenerateOptions { max_new: a.max_new, stop: stops.clone() },
                sampler,
                on_token,
            })
            .collect();
        let (gens, decode) = engine.generate_sessions(&mut seqs).context("decode failed")?;
        stats.merge(&decode);
        gens
    };
    stats.source = Some(engine.source_report());
    let mut out = std::io::stdout().lock();
    for (p, g) in prompts.iter().zip(&gens) {
        let text = tok.as_ref().map(|t| answer_text(t, &g.tokens, &stops)).transpose()?;
        match a.format {
            Format::Text => {
                let ids = || g.tokens.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
                writeln!(out, "{}", text.unwrap_or_else(ids))?;
            }
            Format::Json => {
                let mut obj = serde_json::json!({"prompt_ids": p, "output_ids": g.tokens});
                if let Some(t) = text {
                    obj["text"] = serde_json::Value::String(t);
                }
                writeln!(out, "{obj}")?;
            }
        }
    }
    if a.format == Format::Json {
        writeln!(
            out,
            "{}",
            serde_json::json!({"stats": stats.to_json(), "engine_config": engine.config, "backend_used": engine.backend_used(), "sampling": sampling})
        )?;
    }
    if a.stats {
        eprint!("{}", stats.to_text());
    }
    if let Some(p) = &a.trace_routes {
        let body = serde_json::to_vec(&engine.route_trace(&stats))?;
        crate::util::write_atomic(p, &body).with_context(|| format!("cannot write {}", p.display()))?;
    }
    if let Some(p) = &a.stats_json {
        let body = serde_json::to_vec_pretty(&stats.to_json())?;
        crate::util::write_atomic(p, &body).with_context(|| format!("cannot write {}", p.display()))?;
    }
    Ok(())
}

/// An answer's text as `run` streams it alone: stop tokens and reserved specials carry no text,
/// an unfinished UTF-8 character at the end is dropped.
fn answer_text(t: &Tokenizer, ids: &[u32], stops: &[u32]) -> Result<String> {
    let mut d = StreamDecoder::default();
    let mut text = String::new();
    for &id in ids {
        if !stops.contains(&id) && !t.is_reserved(id) {
            text.push_str(&d.push(t.token_bytes(id)?));
        }
    }
    d.finish();
    Ok(text)
}
