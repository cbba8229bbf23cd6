//! `deltafin score`: logits at every prompt position, written as the f32 tensor `logits` [T, vocab]
//! (`--prompt-ids`), or the perplexity of a text (`--text`; the definition is in
//! `crate::tools::perplexity`), as a short summary or one JSON object (`ppl`, `bits_per_byte`,
//! `tokens`, ...) on stdout, with a progress bar on stderr while windows run; with `--compare
//! BASE`, how far its distributions are from BASE's on that text (`crate::tools::compare`).

use super::KdaArg;
use super::load;
use super::progress::{self, Progress};
use crate::engine::Trunk;
use crate::model::tokenizer::Tokenizer;
use crate::tools::perplexity;
use anyhow::{Context, Result};
use clap::{ArgGroup, Args, ValueEnum};
use std::io::Read;
use std::io::Write as _;
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
    #[arg(long, short, required_unless_present = "demo", conflicts_with = "demo")]
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
    /// With --text: compare this model's next-token distributions with BASE's (KL divergence,
    /// top-1 agreement, both perplexities, llama.cpp's --kl-divergence definitions). BASE is a
    /// trunk encoding of this model (`bf16`, `coded`, `int8`) or another model directory (`./bf16`
    /// for a directory of that name).
    #[arg(long, value_name = "BASE", requires = "text")]
    compare: Option<PathBuf>,
    /// Output of --text.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
    /// Replace an existing --logits-out (or --expert-heat) file that deltafin did not write.
    #[arg(long)]
    force: bool,
    /// How KDA processes the prompt: auto (chunked form), chunked, or recurrent (token by token).
    #[arg(long, value_enum, default_value_t = KdaArg::Auto, hide = true)]
    kda: KdaArg,
    #[command(flatten)]
    engine: super::engine::EngineArgs,
    #[command(flatten)]
    pub threads: super::Threads,
}

fn parse_window(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("`{s}` is not a window size (expected a whole number of tokens >= 1)")),
    }
}

pub fn run(a: ScoreArgs) -> Result<()> {
    use super::outputs::{Kind, Outputs};
    let base = a.compare.as_deref().filter(|p| p.is_file());
    Outputs::new(a.force)
        .write("--logits-out", a.logits_out.as_deref(), Kind::Logits)
        .engine(&a.engine)
        .read("--text", a.text.as_deref())
        .read("--compare", base)
        .check()?;
    let dir = load::model_dir(&a.model, a.demo)?;
    match (&a.prompt_ids, &a.logits_out, &a.text) {
        (Some(ids), Some(out), _) => logits(&a, dir, &ids.0, out),
        (_, _, Some(text)) if a.compare.is_some() => compare(&a, dir, text),
        (_, _, Some(text)) => text_perplexity(&a, dir, text),
        _ => anyhow::bail!("give --prompt-ids with --logits-out, or --text FILE"),
    }
}

fn logits(a: &ScoreArgs, dir: PathBuf, ids: &[u32], out: &std::path::Path) -> Result<()> {
    let n = ids.len();
    // Every position's logits are kept until written: they count in the memory budget.
    let vocab = crate::model::K3Config::load(&dir).map(|c| c.vocab).unwrap_or(0);
    let logits_bytes = (n * vocab * 4) as u64;
    let engine = load::open_engine(a.engine.config(dir, a.kda.into(), n, logits_bytes))?;
    let mut session = engine.new_session();
    let logits = session.score(ids).context("forward pass failed")?;
    let shape = vec![n, engine.vocab()];
    crate::util::write_f32_safetensors(out, "logits", &shape, &logits)
        .with_context(|| format!("cannot write {}", out.display()))?;
    eprintln!("wrote logits [{} x {}] to {}", shape[0], shape[1], out.display());
    Ok(())
}

fn read_text(path: &std::path::Path) -> Result<String> {
    if path.as_os_str() == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).context("cannot read the text from standard input")?;
        Ok(s)
    } else {
        std::fs::read_to_string(path).with_context(|| format!("cannot read the text file {}", path.display()))
    }
}

/// `[BOS] + encode(text)` with the tokenizer and config of the model in `dir`.
fn ids_of(dir: &std::path::Path, text: &str) -> Result<(Vec<u32>, crate::model::K3Config, Tokenizer)> {
    let tok = crate::engine::load_tokenizer(dir)?;
    let cfg = crate::model::K3Config::load(dir)
        .with_context(|| format!("cannot load the model config in {}", dir.display()))?;
    let ids = perplexity::text_ids(&tok, &cfg, text)?;
    Ok((ids, cfg, tok))
}

/// Scored tokens of `total`, with the rate (the ETA is the progress display's).
fn tokens_done(bar: &mut Progress, phase: &str, done: usize, total: usize) {
    bar.update(done as u64, total as u64, |d, t, r| {
        let rate = r.map(|r| format!(", {r:.1} tok/s")).unwrap_or_default();
        format!("{phase}: {d}/{t} tokens{rate}")
    });
}

fn compare(a: &ScoreArgs, dir: PathBuf, path: &std::path::Path) -> Result<()> {
    use crate::tools::compare;
    let base_arg = a.compare.clone().unwrap_or_default();
    // BASE is an encoding of this model's trunk, or another model directory.
    let base_trunk = match base_arg.to_str() {
        Some("bf16") => Some(Trunk::Bf16),
        Some("coded") => Some(Trunk::Coded),
        Some("int8") => Some(Trunk::Int8),
        _ => None,
    };
    let (base_dir, base_label) = match base_trunk {
        Some(t) => (dir.clone(), t.name().to_string()),
        None => (base_arg.clone(), base_arg.display().to_string()),
    };
    let text = read_text(path)?;
    let (ids, cfg, tok) = ids_of(&dir, &text)?;
    let (base_ids, _, base_tok) = ids_of(&base_dir, &text)?;
    if base_ids != ids {
        anyhow::bail!(
            "{} and {} tokenize the text differently: their scores cannot be compared",
            dir.display(),
            base_dir.display()
        );
    }
    let predicted = ids.len().saturating_sub(1);
    let window = a.window.min(predicted).max(1);
    let logits_bytes = (window * cfg.vocab * 4) as u64;
    let mut bar = Progress::new(progress::mode(false), "score");
    let mut scratch = compare::scratch_file().context("cannot create a scratch file for the base's logits")?;
    // One engine at a time: the base's, then the judged one's.
    let base_vocab = {
        let mut config = a.engine.config(base_dir.clone(), a.kda.into(), window, logits_bytes);
        config.trunk = base_trunk.unwrap_or(config.trunk);
        let engine = load::open_engine(config)?;
        engine.check_tokenizer(&base_tok)?;
        compare::base_pass(&engine, &ids, a.window, &mut scratch, &mut |d| {
            tokens_done(&mut bar, "base", d, 2 * predicted)
        })
        .context("scoring the base failed")?
    };
    let engine = load::open_engine(a.engine.config(dir.clone(), a.kda.into(), window, logits_bytes))?;
    engine.check_tokenizer(&tok)?;
    let judged_trunk = engine.trunk();
    let per_token = compare::judged_pass(&engine, &ids, a.window, &mut scratch, base_vocab, &mut |d| {
        tokens_done(&mut bar, "judged", predicted + d, 2 * predicted)
    })
    .context("scoring failed")?;
    bar.finish();
    let s = compare::summarize(&per_token);
    match a.format {
        Format::Json => {
            let mut v = serde_json::to_value(&s)?;
            v["model"] = serde_json::json!(dir);
            v["base"] = serde_json::json!(base_label);
            v["trunk"] = serde_json::json!(judged_trunk.name());
            v["exact"] = serde_json::json!(judged_trunk.exact());
            v["window"] = serde_json::json!(a.window);
            v["windows"] = serde_json::json!(perplexity::windows(ids.len(), a.window).len());
            writeln!(std::io::stdout(), "{v}")?;
        }
        Format::Text => write!(
            std::io::stdout(),
            "{}",
            s.table(&format!("{} (trunk {})", dir.display(), judged_trunk.name()), &base_label)
        )?,
    }
    Ok(())
}

fn text_perplexity(a: &ScoreArgs, dir: PathBuf, path: &std::path::Path) -> Result<()> {
    let text = read_text(path)?;
    let (ids, cfg, tok) = ids_of(&dir, &text)?;
    let predicted = ids.len().saturating_sub(1);
    let window = a.window.min(predicted).max(1);
    // One window's logits are held at a time.
    let logits_bytes = (window * cfg.vocab * 4) as u64;
    let engine = load::open_engine(a.engine.config(dir.clone(), a.kda.into(), window, logits_bytes))?;
    engine.check_tokenizer(&tok)?;
    // Progress only when there are several windows (and where it is shown at all).
    let mode = if predicted > a.window { progress::mode(false) } else { progress::Mode::Off };
    let mut bar = Progress::new(mode, "score");
    let p = perplexity::score_ids(&engine, &ids, text.len(), a.window, &mut |done| {
        tokens_done(&mut bar, "scoring", done, predicted)
    })
    .context("scoring failed")?;
    bar.finish();
    match a.format {
        Format::Json => writeln!(
            std::io::stdout(),
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
        )?,
        Format::Text => writeln!(
            std::io::stdout(),
            "perplexity {:.4}, {:.4} bits per byte: {} tokens predicted from {} bytes of text, in {} window{} of up to {} tokens ({})",
            p.ppl(),
            p.bits_per_byte(),
            p.tokens,
            p.bytes,
            p.windows,
            if p.windows == 1 { "" } else { "s" },
            a.window,
            dir.display()
        )?,
    }
    Ok(())
}
