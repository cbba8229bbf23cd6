//! Opening a model directory for a subcommand: config, checkpoint, roster, trunk, expert source —
//! in that order, so the first error reported is the most fundamental one — plus the tokenizer,
//! the built-in demo model, the memory plan and the one-line startup summary.

use crate::k3::K3;
use crate::memory::MemoryPlan;
use crate::model::config::{AttnKind, FfnKind};
use crate::model::synth::{self, SynthSpec};
use crate::model::tokenizer::Tokenizer;
use crate::model::{Checkpoint, K3Config, Roster};
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};

pub struct Opened {
    pub dir: PathBuf,
    pub cfg: K3Config,
    pub ck: Checkpoint,
    pub roster: Roster,
}

pub fn open(dir: &Path) -> Result<Opened> {
    if !dir.is_dir() {
        bail!("model directory {} does not exist", dir.display());
    }
    let cfg = K3Config::load(dir).with_context(|| format!("cannot load the model config in {}", dir.display()))?;
    let ck = Checkpoint::open(dir).with_context(|| format!("cannot open the checkpoint in {}", dir.display()))?;
    let roster = Roster::build(&cfg, &ck)?;
    Ok(Opened { dir: dir.to_path_buf(), cfg, ck, roster })
}

impl Opened {
    pub fn model<'a>(&'a self, experts: Option<&'a dyn crate::store::ExpertSource>) -> Result<K3<'a>> {
        Ok(K3::new(self.cfg.clone(), &self.ck, &self.roster, experts)?)
    }

    /// The tokenizer (`tiktoken.model` + `tokenizer_config.json`), converted once and cached.
    pub fn tokenizer(&self) -> Result<Tokenizer> {
        if !self.dir.join("tiktoken.model").exists() {
            bail!(
                "{} has no tiktoken.model: text prompts need the model's tokenizer (use --prompt-ids for token ids)",
                self.dir.display()
            );
        }
        let cache = crate::util::cache_dir().join("tokenizers");
        let tok = Tokenizer::load(&self.dir, Some(&cache))
            .with_context(|| format!("cannot load the tokenizer in {}", self.dir.display()))?;
        if tok.vocab_size() != self.cfg.vocab {
            bail!(
                "{}: the tokenizer has {} tokens ({} ranks + 256 specials) but config.json says vocab_size {}",
                self.dir.display(),
                tok.vocab_size(),
                tok.n_base(),
                self.cfg.vocab
            );
        }
        Ok(tok)
    }

    /// Bytes of all routed experts on disk.
    pub fn expert_bytes_total(&self) -> u64 {
        (self.cfg.moe_layers() * self.cfg.experts * self.cfg.expert_bytes()) as u64
    }

    /// One line: model, layers, experts, memory split, usable context bound.
    pub fn startup_line(&self, source: &str, plan: &MemoryPlan) -> String {
        let c = &self.cfg;
        let kda = c.attn.iter().filter(|a| **a == AttnKind::Kda).count();
        let dense = c.ffn.iter().filter(|f| **f == FfnKind::Dense).count();
        let random = if synth::is_synthetic(&self.dir) { " [RANDOM WEIGHTS]" } else { "" };
        format!(
            "deltafin: {}{random} | {} layers ({kda} KDA + {} MLA, {dense} dense + {} MoE), {} experts/layer top-{} + {} shared, hidden {}, vocab {} | experts {} on disk, {source} | memory: {} | context <= {} tokens | {} x{}",
            self.dir.display(),
            c.layers,
            c.layers - kda,
            c.moe_layers(),
            c.experts,
            c.top_k,
            c.shared_experts,
            c.hidden,
            c.vocab,
            crate::util::human_bytes(self.expert_bytes_total()),
            plan.summary(),
            plan.context_bound,
            crate::cpu::isa().name(),
            rayon::current_num_threads(),
        )
    }
}

/// Version of the built-in demo checkpoint; bump when `SynthSpec::demo` changes.
const DEMO_NAME: &str = "demo-v1";

/// The built-in demo model, created on first use in the cache directory.
pub fn demo_dir() -> Result<PathBuf> {
    let dir = crate::util::cache_dir().join(DEMO_NAME);
    if !dir.join("config.json").exists() {
        eprintln!("deltafin: creating the demo checkpoint (random weights, K3 layout) in {} ...", dir.display());
        synth::write(&SynthSpec::demo(), &dir, true, &|_, _| {})
            .with_context(|| format!("cannot create the demo model in {}", dir.display()))?;
    }
    Ok(dir)
}
