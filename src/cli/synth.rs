//! `deltafin synth`: writes a random-weight checkpoint in the exact shipped layout, with a tokenizer
//! and chat template, so a rig can be tested without the 1.7 TB download. Ctrl-C stops it and
//! removes what it wrote (exit 130).

use super::progress::{self, Progress};
use crate::model::synth::{self, SynthSpec};
use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Preset {
    /// Small and fast (the built-in demo's shape).
    Demo,
    /// Real K3 expert dimensions (hidden 7168, latent 3584, FFN 3072: 17.55 MB experts), light trunk.
    K3Experts,
}

#[derive(Args)]
pub struct SynthArgs {
    /// Output directory (created; must not exist unless --force).
    #[arg(long)]
    out: PathBuf,
    /// Starting point; the options below override it.
    #[arg(long, value_enum, default_value_t = Preset::Demo)]
    preset: Preset,
    /// Replace --out if it exists.
    #[arg(long)]
    force: bool,
    /// Layers, all of them MoE but the first --dense-layers (demo 8, k3-experts 8; with --dspark:
    /// the drafter's layers).
    #[arg(long)]
    layers: Option<usize>,
    /// Routed experts per MoE layer (demo 32, k3-experts 64; K3 has 896).
    #[arg(long)]
    experts: Option<usize>,
    /// Routed experts each token uses (demo 4, k3-experts 16, as K3).
    #[arg(long)]
    top_k: Option<usize>,
    /// Hidden size (demo 256, k3-experts 7168, as K3).
    #[arg(long)]
    hidden: Option<usize>,
    /// Vocabulary including the 256 specials.
    #[arg(long)]
    vocab: Option<usize>,
    /// Shared experts per MoE layer, run for every token (2 in both presets).
    #[arg(long)]
    shared_experts: Option<usize>,
    /// Routed expert FFN width (multiple of 32).
    #[arg(long)]
    expert_inter: Option<usize>,
    /// Routed expert latent width (multiple of 32).
    #[arg(long)]
    expert_latent: Option<usize>,
    /// Leading layers with a dense MLP instead of experts (1 in both presets).
    #[arg(long)]
    dense_layers: Option<usize>,
    /// The dense MLP's width (demo 512, k3-experts 2048; with --dspark: the drafter's MLP width).
    #[arg(long)]
    dense_inter: Option<usize>,
    /// KDA (linear attention) heads (4 in both presets; K3 has 96).
    #[arg(long)]
    kda_heads: Option<usize>,
    /// KDA head dimension (demo 32, k3-experts 128, as K3).
    #[arg(long)]
    head_dim: Option<usize>,
    /// Every N-th layer (1-based) is MLA, and so is the last.
    #[arg(long)]
    mla_every: Option<usize>,
    /// MLA attention heads (4 in both presets; with --dspark: the drafter's attention heads).
    #[arg(long)]
    mla_heads: Option<usize>,
    /// AttnRes block size.
    #[arg(long)]
    block: Option<usize>,
    /// Seed of the random weights (default 1): the same seed and options give the same bytes.
    #[arg(long)]
    seed: Option<u64>,
    /// Target shard size in GB.
    #[arg(long)]
    shard_gb: Option<f64>,
    /// Scale the token embeddings (64 makes greedy output fall into short cycles: repetitive
    /// text for benchmarking drafters).
    #[arg(long)]
    embed_scale: Option<f32>,
    /// Draw the trunk's bf16 matrices from a trained model's values (per tensor role, scaled to
    /// the fan-in) instead of uniform random ones: a model directory, or `demo` for the built-in
    /// trained demo (what the coded trunk's size is measured on).
    #[arg(long, value_name = "MODEL|demo")]
    trunk_values_from: Option<PathBuf>,
    /// Write a random DSpark draft model for --target instead (config.json + model.safetensors);
    /// --layers, --mla-heads (attention heads), --dense-inter (MLP width) and --seed apply to it.
    #[arg(long, requires = "target")]
    dspark: bool,
    /// The K3 model the DSpark drafter is for (its hidden size, vocabulary and layers).
    #[arg(long, value_name = "MODEL", requires = "dspark")]
    target: Option<PathBuf>,
    /// Target layers the DSpark drafter taps (comma-separated; default: K3's five, scaled).
    #[arg(long, value_delimiter = ',', requires = "dspark")]
    taps: Option<Vec<usize>>,
    #[command(flatten)]
    pub threads: super::Threads,
}

fn run_dspark(a: &SynthArgs, target: &std::path::Path) -> Result<()> {
    use crate::k3::dspark::synth::{self as ds, DSparkSynthSpec};
    let tc =
        crate::model::K3Config::load(target).with_context(|| format!("cannot read the target {}", target.display()))?;
    let mut s = DSparkSynthSpec::for_target(&tc);
    if let Some(l) = a.layers {
        s.layers = l.max(1);
    }
    if let Some(seed) = a.seed {
        s.seed = seed;
    }
    if let Some(t) = &a.taps {
        s.taps = t.clone();
    }
    if let Some(i) = a.dense_inter {
        s.intermediate = i;
    }
    if let Some(h) = a.mla_heads {
        s.heads = h.max(1);
    }
    let total = s.total_bytes(&tc);
    eprintln!(
        "deltafin synth: DSpark drafter for {} ({} layers, taps {:?}, {}) -> {}",
        target.display(),
        s.layers,
        s.taps,
        crate::util::human_bytes(total),
        a.out.display()
    );
    let bar = std::sync::Mutex::new(Progress::new(progress::mode(false), "writing"));
    let wrote =
        ds::write(&s, &tc, &a.out, a.force, &|done, t| bar.lock().map(|mut b| b.bytes(done, t)).unwrap_or_default());
    drop(bar);
    wrote.with_context(|| format!("synth into {} failed", a.out.display()))?;
    eprintln!(
        "deltafin synth: wrote {} (random weights; use with --draft dspark --draft-model {})",
        a.out.display(),
        a.out.display()
    );
    Ok(())
}

pub fn run(a: SynthArgs) -> Result<()> {
    // Ctrl-C stops the writing and removes the temporary directory (exit 130).
    super::signals::catch_ctrl_c();
    if let (true, Some(t)) = (a.dspark, &a.target) {
        return run_dspark(&a, t);
    }
    let mut s = match a.preset {
        Preset::Demo => SynthSpec::demo(),
        Preset::K3Experts => SynthSpec::k3_experts(),
    };
    macro_rules! set {
        ($($f:ident => $g:ident),*) => { $(if let Some(v) = a.$f { s.$g = v; })* };
    }
    set!(layers => layers, experts => experts, top_k => top_k, hidden => hidden, vocab => vocab,
         shared_experts => shared_experts, expert_inter => expert_inter, expert_latent => expert_latent,
         dense_layers => dense_layers, dense_inter => dense_inter, kda_heads => kda_heads,
         head_dim => kda_head_dim, mla_every => mla_every, mla_heads => mla_heads, block => attn_res_block, seed => seed);
    if let Some(x) = a.embed_scale {
        s.embed_scale = x;
    }
    if let Some(p) = &a.trunk_values_from {
        s.trunk_values_from = Some(if p.as_os_str() == "demo" { super::load::demo_dir()? } else { p.clone() });
    }
    if let Some(g) = a.shard_gb {
        s.shard_bytes = (g * 1e9).max(1.0) as u64;
    }
    s.validate()?;
    let total = s.total_bytes();
    eprintln!(
        "deltafin synth: {} layers, {} experts/layer (top-{}), hidden {}, {} per expert, {} in all -> {}",
        s.layers,
        s.experts,
        s.top_k,
        s.hidden,
        crate::util::human_bytes(s.expert_bytes()),
        crate::util::human_bytes(total),
        a.out.display()
    );
    let bar = std::sync::Mutex::new(Progress::new(progress::mode(false), "writing"));
    let wrote =
        synth::write(&s, &a.out, a.force, &|done, t| bar.lock().map(|mut b| b.bytes(done, t)).unwrap_or_default());
    drop(bar);
    wrote.with_context(|| format!("synth into {} failed", a.out.display()))?;
    eprintln!("deltafin synth: wrote {} (random weights)", a.out.display());
    Ok(())
}
