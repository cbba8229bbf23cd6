//! `deltafin score`: logits at every prompt position, written as the f32 tensor `logits` [T, vocab].

use super::KdaArg;
use super::load;
use crate::k3::{ForwardStats, Logits};
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
    let opened = load::open(&a.model)?;
    let trunk = crate::k3::weights::Weights::load(&opened.cfg, &opened.ck)?.resident_bytes() as u64;
    let rows = a.prompt_ids.0.len().min(a.engine.prefill_rows.max(1));
    let logits_bytes = (a.prompt_ids.0.len() * opened.cfg.vocab * 4) as u64;
    let (source, _plan) = a.engine.open(&opened, trunk, rows, logits_bytes)?;
    let mut model = opened.model(Some(source.as_dyn()))?;
    model.kda_mode = a.kda.into();
    model.prefetch = a.engine.prefetch == super::engine::OnOff::On;
    let mut st = model.new_state();
    let mut fs = ForwardStats::default();
    let mut logits = Vec::new();
    for chunk in a.prompt_ids.0.chunks(a.engine.prefill_rows.max(1)) {
        logits.extend(model.forward(&mut st, chunk, Logits::All, &mut fs).context("forward pass failed")?);
    }
    let shape = vec![a.prompt_ids.0.len(), model.cfg.vocab];
    crate::util::write_f32_safetensors(&a.logits_out, "logits", &shape, &logits)
        .with_context(|| format!("cannot write {}", a.logits_out.display()))?;
    eprintln!("wrote logits [{} x {}] to {}", shape[0], shape[1], a.logits_out.display());
    Ok(())
}
