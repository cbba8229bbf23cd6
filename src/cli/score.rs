//! `deltafin score`: logits at every prompt position, written as the f32 tensor `logits` [T, vocab]
//! (`--prompt-ids`), or the perplexity of a text (`--text`; the definition is in
//! `crate::engine::perplexity`), as a short summary or one JSON object (`ppl`, `bits_per_byte`,
//! `tokens`, ...) on stdout, with a progress bar on stderr while windows run.

use super::KdaArg;
use super::load;
use crate::engine::perplexity;
use anyhow::{Context, Result};
use clap::{ArgGroup, Args, ValueEnum};
use std::io::Read;
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// A short summary.
    Text,
    /// One JSON object.
    Json,
}

#[derive(Args)]
#[command(group(ArgGroup::new("what").required(true).args(["prompt_ids", "text"])))]
pub struct ScoreArgs {
    /// Model directory (config.json + safetensors shards).
    #[arg(long, required_unless_present = "demo", conflicts_with = "demo")]
    model: Option<PathBuf>,
    /// Use the built-in demo model.
    #[arg(long)]
    demo: bool,
    /// Prompt as comma-separated token ids, e.g. 1,2,3 (with --logits-out).
    #[arg(long, value_parser = super::parse_ids, requires = "logits_out")]
    prompt_ids: Option<super::TokenIds>,
    /// Output safetensors file of --prompt-ids' logits (written atomically).
    #[arg(long, requires = "prompt_ids")]
    logits_out: Option<PathBuf>,
    /// Report the perplexity of this text file ("-" reads standard input): [BOS] + its tokens, in
    /// windows of --window tokens, each a fresh sequence.
    #[arg(long, value_name = "FILE", conflicts_with = "prompt_ids")]
    text: Option<PathBuf>,
    /// Tokens per window for --text.
    #[arg(long, default_value_t = 512, value_parser = parse_window)]
    window: usize,
    /// Output of --text.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
    /// How KDA processes the prompt: auto (chunked form), chunked, or recurrent (token by token).
    #[arg(long, value_enum, default_value_t = KdaArg::Auto, hide = true)]
    kda: KdaArg,
    #[command(flatten)]
    engine: super::engine::EngineArgs,
}

fn parse_window(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("`{s}` is not a window size (expected a whole number of tokens >= 1)")),
    }
}

pub fn run(a: ScoreArgs) -> Result<()> {
    let dir = load::model_dir(&a.model, a.demo)?;
    match (&a.prompt_ids, &a.logits_out, &a.text) {
        (Some(ids), Some(out), _) => logits(&a, dir, &ids.0, out),
        (_, _, Some(text)) => text_perplexity(&a, dir, text),
        _ => anyhow::bail!("give --prompt-ids with --logits-out, or --text FILE"),
    }
}

fn logits(a: &ScoreArgs, dir: PathBuf, ids: &[u32], out: &std::path::Path) -> Result<()> {
    super::check_outputs([("--logits-out", Some(out))])?;
    let n = ids.len();
    // Every position's logits are kept until written: they count in the memory budget.
    let vocab = crate::model::K3Config::load(&dir).map(|c| c.vocab).unwrap_or(0);
    let logits_bytes = (n * vocab * 4) as u64;
    let engine = load::open_engine(a.engine.config(dir, a.kda.into(), n, logits_bytes))?;
    let mut session = engine.new_session();
    let logits = session.score(ids).context("forward pass failed")?;
    let shape = vec![n, engine.cfg.vocab];
    crate::util::write_f32_safetensors(out, "logits", &shape, &logits)
        .with_context(|| format!("cannot write {}", out.display()))?;
    eprintln!("wrote logits [{} x {}] to {}", shape[0], shape[1], out.display());
    Ok(())
}

fn text_perplexity(a: &ScoreArgs, dir: PathBuf, path: &std::path::Path) -> Result<()> {
    let text = if path.as_os_str() == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).context("cannot read the text from standard input")?;
        s
    } else {
        std::fs::read_to_string(path).with_context(|| format!("cannot read the text file {}", path.display()))?
    };
    let tok = crate::engine::load_tokenizer(&dir)?;
    let cfg = crate::model::K3Config::load(&dir)
        .with_context(|| format!("cannot load the model config in {}", dir.display()))?;
    let ids = perplexity::text_ids(&tok, &cfg, &text)?;
    let predicted = ids.len().saturating_sub(1);
    let window = a.window.min(predicted).max(1);
    // One window's logits are held at a time.
    let logits_bytes = (window * cfg.vocab * 4) as u64;
    let engine = load::open_engine(a.engine.config(dir.clone(), a.kda.into(), window, logits_bytes))?;
    engine.check_tokenizer(&tok)?;
    // A bar only when there are several windows (it draws only on a terminal).
    let bar = if predicted > a.window {
        indicatif::ProgressBar::new(predicted as u64)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} tokens {per_sec} eta {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let p = perplexity::score_ids(&engine, &ids, text.len(), a.window, &mut |done| bar.set_position(done as u64))
        .context("scoring failed")?;
    bar.finish_and_clear();
    match a.format {
        Format::Json => println!(
            "{}",
            serde_json::json!({
                "ppl": p.ppl(),
                "bits_per_byte": p.bits_per_byte(),
                "tokens": p.tokens,
                "nll": p.nll,
                "bytes": p.bytes,
                "window": a.window,
                "windows": p.windows,
                "model": dir,
            })
        ),
        Format::Text => println!(
            "perplexity {:.4}, {:.4} bits per byte: {} tokens predicted from {} bytes of text, in {} window{} of up to {} tokens ({})",
            p.ppl(),
            p.bits_per_byte(),
            p.tokens,
            p.bytes,
            p.windows,
            if p.windows == 1 { "" } else { "s" },
            a.window,
            dir.display()
        ),
    }
    Ok(())
}
