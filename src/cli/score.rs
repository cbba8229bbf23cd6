//! `deltafin score`: logits at every prompt position, written as the f32 tensor `logits` [T, vocab].

use super::KdaArg;
use super::load;
use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;

#[derive(Args)]
pub struct ScoreArgs {
    /// Model directory (config.json + safetensors shards).
    #[arg(long)]
    model: PathBuf,
    /// Prompt as comma-separated token ids, e.g. 1,2,3.
    #[arg(long, value_parser = super::parse_ids)]
    prompt_ids: super::TokenIds,
    /// How KDA processes the prompt: auto (chunked form), chunked, or recurrent (token by token).
    #[arg(long, value_enum, default_value_t = KdaArg::Auto, hide = true)]
    kda: KdaArg,
    #[command(flatten)]
    engine: super::engine::EngineArgs,
    /// Output safetensors file (written atomically).
    #[arg(long)]
    logits_out: PathBuf,
}

pub fn run(a: ScoreArgs) -> Result<()> {
    super::check_outputs([("--logits-out", Some(a.logits_out.as_path()))])?;
    let n = a.prompt_ids.0.len();
    // Every position's logits are kept until written: they count in the memory budget.
    let vocab = crate::model::K3Config::load(&a.model).map(|c| c.vocab).unwrap_or(0);
    let logits_bytes = (n * vocab * 4) as u64;
    let engine = load::open_engine(a.engine.config(a.model.clone(), a.kda.into(), n, logits_bytes))?;
    let mut session = engine.new_session();
    let logits = session.score(&a.prompt_ids.0).context("forward pass failed")?;
    let shape = vec![n, engine.cfg.vocab];
    crate::util::write_f32_safetensors(&a.logits_out, "logits", &shape, &logits)
        .with_context(|| format!("cannot write {}", a.logits_out.display()))?;
    eprintln!("wrote logits [{} x {}] to {}", shape[0], shape[1], a.logits_out.display());
    Ok(())
}
