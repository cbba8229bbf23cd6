//! Opening a model for subcommands (an engine, or just its files), with the CLI's error context,
//! and the built-in demo model.

use crate::engine::{Engine, EngineConfig};
use crate::model::synth::{self, SynthSpec};
use crate::model::{Checkpoint, K3Config, Roster};
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A model's files without an engine (config, mapped checkpoint, checked roster): what `place`
/// and the I/O benchmarks need.
pub struct Opened {
    pub dir: PathBuf,
    pub cfg: K3Config,
    pub ck: Checkpoint,
    pub roster: Roster,
}

/// Opens config, checkpoint and roster in that order, so the first error is the most fundamental.
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
    /// Bytes of all routed experts on disk.
    pub fn expert_bytes_total(&self) -> u64 {
        (self.cfg.moe_layers() * self.cfg.experts * self.cfg.expert_bytes()) as u64
    }
}

/// Opens an engine; the error names the model directory, except for options that conflict with
/// each other (those say which options, and the model is not at fault).
pub fn open_engine(cfg: EngineConfig) -> Result<Arc<Engine>> {
    let dir = cfg.model.clone();
    match Engine::open(cfg) {
        Ok(e) => Ok(e),
        Err(e @ crate::engine::EngineError::Options(_)) => Err(e.into()),
        Err(e) => Err(anyhow::Error::new(e).context(format!("cannot open the model in {}", dir.display()))),
    }
}

/// Version of the built-in demo checkpoint; bump when `SynthSpec::demo` changes.
const DEMO_NAME: &str = "demo-v1";

/// The built-in demo model, created on first use in the cache directory.
/// The model directory of `--model DIR` or `--demo` (created on first use), checked to exist.
pub fn model_dir(model: &Option<PathBuf>, demo: bool) -> Result<PathBuf> {
    let dir = match (model, demo) {
        (Some(m), _) => m.clone(),
        (None, true) => demo_dir()?,
        (None, false) => anyhow::bail!("give --model DIR or --demo"),
    };
    if !dir.is_dir() {
        anyhow::bail!("model directory {} does not exist", dir.display());
    }
    Ok(dir)
}

pub fn demo_dir() -> Result<PathBuf> {
    let dir = crate::util::cache_dir().join(DEMO_NAME);
    if !dir.join("config.json").exists() {
        eprintln!("deltafin: creating the demo checkpoint (random weights, K3 layout) in {} ...", dir.display());
        synth::write(&SynthSpec::demo(), &dir, true, &|_, _| {})
            .with_context(|| format!("cannot create the demo model in {}", dir.display()))?;
    }
    Ok(dir)
}
