//! `deltafin run`: greedy generation from token ids, streaming ids to stdout as they are produced.

use super::load;
use crate::k3::{ForwardStats, Logits, argmax};
use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    Text,
    Json,
}

#[derive(Args)]
pub struct RunArgs {
    /// Model directory (config.json + safetensors shards).
    #[arg(long)]
    model: PathBuf,
    /// Prompt as comma-separated token ids, e.g. 1,2,3.
    #[arg(long, value_parser = super::parse_ids)]
    prompt_ids: super::TokenIds,
    /// Maximum number of tokens to generate.
    #[arg(long, default_value_t = 64)]
    max_new: usize,
    /// Keep generating past the end-of-message token.
    #[arg(long)]
    ignore_eos: bool,
    /// text: ids streamed as produced; json: one object with prompt_ids, output_ids and stats.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
}

pub fn run(a: RunArgs) -> Result<()> {
    let opened = load::open(&a.model)?;
    let experts = opened.experts();
    let model = opened.model(experts.as_ref())?;
    let eos = if a.ignore_eos {
        None
    } else {
        model.cfg.eos_token
    };
    let mut st = model.new_state();
    let mut fs = ForwardStats::default();
    let t0 = Instant::now();
    let mut stdout = std::io::stdout().lock();

    let logits = model
        .forward(&mut st, &a.prompt_ids.0, Logits::Last, &mut fs)
        .context("prefill failed")?;
    let ttft = t0.elapsed().as_secs_f64();
    let mut out_ids = Vec::with_capacity(a.max_new);
    let mut next = argmax(&logits);
    let t_dec = Instant::now();
    while out_ids.len() < a.max_new {
        out_ids.push(next);
        if a.format == Format::Text {
            write!(stdout, "{}{next}", if out_ids.len() > 1 { "," } else { "" })?;
            stdout.flush()?;
        }
        if Some(next) == eos || out_ids.len() == a.max_new {
            break;
        }
        let logits = model
            .forward(&mut st, &[next], Logits::Last, &mut fs)
            .context("decode failed")?;
        next = argmax(&logits);
    }
    let decode_s = t_dec.elapsed().as_secs_f64();
    let decoded = out_ids.len().saturating_sub(1);
    let stats = serde_json::json!({
        "prompt_tokens": a.prompt_ids.0.len(),
        "generated_tokens": out_ids.len(),
        "ttft_s": ttft,
        "prefill_tok_s": a.prompt_ids.0.len() as f64 / ttft.max(1e-9),
        "decode_s": decode_s,
        "decode_tok_s": if decoded > 0 { decoded as f64 / decode_s.max(1e-9) } else { 0.0 },
        "layer_passes": fs.layer_passes,
        "experts_run": fs.experts_run,
        "expert_bytes_requested": experts.as_ref().map_or(0, crate::store::ExpertSource::bytes_requested),
        "attention_s": fs.attention_s,
        "moe_s": fs.moe_s,
        "other_s": fs.other_s,
        "threads": rayon::current_num_threads(),
        "isa": crate::cpu::isa().name(),
    });
    match a.format {
        Format::Text => writeln!(stdout)?,
        Format::Json => {
            let obj = serde_json::json!({ "prompt_ids": a.prompt_ids.0, "output_ids": out_ids, "stats": stats });
            writeln!(stdout, "{obj}")?;
        }
    }
    Ok(())
}
