//! `deltafin run`: one-shot generation (greedy, or sampled with `--temperature`). Text streams to stdout as tokens are produced
//! (held back only inside a UTF-8 character); diagnostics, the startup line and `--stats` go to
//! stderr, so stdout can be piped.

use super::load;
use super::{KdaArg, TokenIds};
use crate::engine::GenerateOptions;
use crate::model::chat::{ChatOptions, ChatTemplate, Thinking};
use crate::model::tokenizer::{StreamDecoder, Tokenizer};
use crate::sample::{Sampler, SamplingParams};
use crate::spec::{DraftKind, Speculator, WidthPolicy};
use anyhow::{Context, Result, bail};
use clap::{ArgGroup, Args, ValueEnum};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Generated text streamed as it is produced (token ids if the model has no tokenizer).
    Text,
    /// One JSON object at the end: prompt_ids, output_ids, text, stats.
    Json,
}

#[derive(Args)]
#[command(group(ArgGroup::new("input").required(true).args(["prompt", "prompt_file", "prompt_ids"])))]
pub struct RunArgs {
    /// Model directory (config.json, safetensors shards, tokenizer files).
    #[arg(long, required_unless_present = "demo", conflicts_with = "demo")]
    pub model: Option<PathBuf>,
    /// Use the built-in demo model (K3's architecture and layout, laid out under deltafin's cache
    /// directory on first use, no download; its generation_config.json gives the sampling defaults).
    #[arg(long)]
    pub demo: bool,
    /// Prompt text ("-" reads standard input).
    #[arg(long)]
    pub prompt: Option<String>,
    /// Read the prompt text from a file ("-" for standard input).
    #[arg(long)]
    pub prompt_file: Option<PathBuf>,
    /// Prompt as comma-separated token ids, e.g. 1,2,3 (no tokenizer needed).
    #[arg(long, value_parser = super::parse_ids)]
    pub prompt_ids: Option<TokenIds>,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// System message for --chat.
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// Thinking effort for --chat (the template's default is max; off answers directly).
    #[arg(long, value_enum, default_value_t = Thinking::Max)]
    pub thinking: Thinking,
    /// Maximum number of tokens to generate.
    #[arg(long, default_value_t = 256)]
    pub max_new: usize,
    /// Keep generating past the end-of-message token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Print the counters (bytes read, read amplification, cache hits, phase timers, tokens/s) to
    /// stderr at the end; --stats-json writes them as JSON.
    #[arg(long)]
    pub stats: bool,
    /// Write the counters as JSON to this file.
    #[arg(long)]
    pub stats_json: Option<PathBuf>,
    /// Record how often each expert is routed (input for `place --policy hot`).
    #[arg(long)]
    pub trace_routes: Option<PathBuf>,
    #[command(flatten)]
    pub engine: super::engine::EngineArgs,
    /// Sampling temperature (0 is greedy: K3's argmax). Default 0, or with --demo the demo's
    /// generation_config.json.
    #[arg(long)]
    pub temperature: Option<f64>,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass. Default 1, or
    /// with --demo the demo's generation_config.json.
    #[arg(long)]
    pub top_p: Option<f64>,
    /// Seed of the sampler (default: a fresh one, printed; the same seed gives the same output).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Draft tokens for K3 to verify in batches (output is identical; only speed changes).
    #[arg(long, value_enum, default_value_t = DraftKind::Off)]
    pub draft: DraftKind,
    /// No startup line.
    #[arg(long, short)]
    pub quiet: bool,
    /// How KDA processes the prompt.
    #[arg(long, value_enum, default_value_t = KdaArg::Auto, hide = true)]
    pub kda: KdaArg,
    #[command(flatten)]
    pub threads: super::Threads,
}

fn read_text(arg: &str, from_file: bool) -> Result<String> {
    if arg == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).context("cannot read the prompt from standard input")?;
        return Ok(s);
    }
    if from_file {
        return std::fs::read_to_string(arg).with_context(|| format!("cannot read the prompt file {arg}"));
    }
    Ok(arg.to_string())
}

/// Prompt ids from the arguments (and the tokenizer / chat template when text is given).
fn prompt_ids(a: &RunArgs, dir: &Path, tok: Option<&Tokenizer>) -> Result<Vec<u32>> {
    if let Some(ids) = &a.prompt_ids {
        if a.chat {
            bail!("--chat needs a text prompt (--prompt or --prompt-file), not --prompt-ids");
        }
        return Ok(ids.0.clone());
    }
    let text = match (&a.prompt, &a.prompt_file) {
        (Some(p), _) => read_text(p, false)?,
        (None, Some(f)) => read_text(&f.to_string_lossy(), true)?,
        (None, None) => bail!("no prompt given"),
    };
    let tok = tok.context("text prompts need a tokenizer")?;
    let ids = if a.chat {
        let chat = ChatTemplate::load(dir, tok).context("cannot load the chat template")?;
        let mut messages = Vec::new();
        if let Some(s) = &a.system {
            messages.push(serde_json::json!({"role": "system", "content": s}));
        }
        messages.push(serde_json::json!({"role": "user", "content": text}));
        let opts = ChatOptions { thinking: a.thinking, ..ChatOptions::default() };
        chat.encode(tok, &serde_json::Value::Array(messages), &opts)?
    } else {
        tok.encode(&text)
    };
    if ids.is_empty() {
        bail!("the prompt is empty");
    }
    Ok(ids)
}

pub fn run(mut a: RunArgs) -> Result<()> {
    super::check_outputs([("--stats-json", a.stats_json.as_deref()), ("--trace-routes", a.trace_routes.as_deref())])?;
    let dir = load::model_dir(&a.model, a.demo)?;
    load::demo_draft(a.demo, a.draft, &mut a.engine)?;
    let needs_tok = a.prompt_ids.is_none() || a.chat;
    let tok = if needs_tok || dir.join("tiktoken.model").exists() {
        Some(crate::engine::load_tokenizer(&dir)?)
    } else {
        None
    };
    let seed = a.seed.unwrap_or_else(crate::util::fresh_seed);
    let defaults = load::sampling(&dir, a.demo, a.temperature, a.top_p)?;
    let sampling =
        SamplingParams::new(defaults.temperature, defaults.top_p, seed).map_err(|e| anyhow::anyhow!("{e}"))?;
    let prompt = prompt_ids(&a, &dir, tok.as_ref())?;
    if a.draft == DraftKind::Dspark && a.engine.draft_model.is_none() {
        bail!(
            "--draft dspark needs --draft-model DIR (a DSpark checkpoint; `deltafin synth --dspark` writes a random one)"
        );
    }
    // A verify batch holds the pending token and up to `max` drafts.
    let rows = prompt.len().max(if a.draft == DraftKind::Off { 1 } else { WidthPolicy::default().max + 1 });
    let engine = load::open_engine(a.engine.config(dir.clone(), a.kda.into(), rows, 0))?;
    let mut spec = crate::spec::drafter_for(a.draft, &engine)?.map(Speculator::new);
    if let Some(t) = &tok {
        engine.check_tokenizer(t)?;
    }
    let bound = engine.context_bound();
    if prompt.len().checked_add(a.max_new).is_none_or(|n| n > bound) {
        bail!(
            "the prompt ({} tokens) plus --max-new {} exceeds the usable context of {} tokens",
            prompt.len(),
            a.max_new,
            bound
        );
    }
    if !a.quiet {
        eprintln!("{}", engine.startup_line());
        if let Some(s) = &spec {
            let memory = match (engine.draft_model_description(), s.drafter.name()) {
                (Some(d), "dspark") => d,
                _ => "drafter memory: none".into(),
            };
            eprintln!("deltafin: drafting: {} | {memory}", s.describe());
        }
        if !sampling.is_greedy() {
            eprintln!(
                "deltafin: sampling: temperature {} top-p {} seed {}",
                sampling.temperature, sampling.top_p, sampling.seed
            );
        }
    }
    if let Some(note) = load::random_weights_note(&dir) {
        eprintln!("{note}");
    }

    // Stop at the chat format's end-of-message token or the config's eos, whichever comes.
    let stops: Vec<u32> = if a.ignore_eos { Vec::new() } else { engine.stop_tokens(tok.as_ref()) };
    let mut session = engine.new_session();
    let mut out = std::io::stdout().lock();
    let mut decoder = StreamDecoder::default();
    let mut text = String::new();
    let t0 = Instant::now();
    match &mut spec {
        Some(sp) => sp.prefill(&mut session, &prompt),
        None => session.prefill(&prompt),
    }
    .context("prefill failed")?;
    session.stats.ttft_s = t0.elapsed().as_secs_f64();
    let mut ids: Vec<u32> = Vec::with_capacity(a.max_new);
    let mut write_error: Option<anyhow::Error> = None;
    let opts = GenerateOptions { max_new: a.max_new, stop: stops.clone() };
    let mut on_token = |next: u32| {
        ids.push(next);
        let stop = stops.contains(&next);
        let piece = match &tok {
            // Reserved (unnamed) specials carry no text.
            Some(t) if !stop && !t.is_reserved(next) => match t.token_bytes(next) {
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
        true
    };
    let mut sampler = Sampler::new(sampling);
    match &mut spec {
        Some(sp) => session.generate_speculative_sampled(&opts, sp, &mut sampler, &mut on_token),
        None => session.generate_sampled(&opts, &mut sampler, &mut on_token),
    }
    .context("decode failed")?;
    if let Some(e) = write_error {
        return Err(e);
    }
    // An unfinished UTF-8 character at the end is dropped (it would print as U+FFFD).
    decoder.finish();
    let mut stats = session.stats.clone();
    stats.source = Some(engine.source_report());

    match a.format {
        Format::Text => writeln!(out)?,
        Format::Json => {
            let mut obj = serde_json::json!({"prompt_ids": prompt, "output_ids": ids, "stats": stats.to_json(), "engine_config": engine.config, "backend_used": engine.backend_used(), "sampling": sampling});
            if tok.is_some() {
                obj["text"] = serde_json::Value::String(text);
            }
            writeln!(out, "{obj}")?;
        }
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
