//! Opening a model for subcommands (an engine, or just its files), with the CLI's error context,
//! the built-in demo model and what `--demo` changes (its drafter, its sampling defaults).

use super::engine::EngineArgs;
use crate::engine::{Engine, EngineConfig};
use crate::model::generation::GenerationDefaults;
use crate::model::{Checkpoint, K3Config, Roster};
use crate::serve::api::SamplingDefaults;
use crate::spec::DraftKind;
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A model's files without an engine (config, mapped checkpoint, checked roster): what `place`
/// and the I/O benchmarks need.
pub use crate::model::ModelFiles as Opened;

/// Opens config, checkpoint and roster in that order, so the first error is the most fundamental.
pub fn open(dir: &Path) -> Result<Opened> {
    if !dir.is_dir() {
        bail!("model directory {} does not exist", dir.display());
    }
    let cfg = K3Config::load(dir).with_context(|| format!("cannot load the model config in {}", dir.display()))?;
    let ck = Checkpoint::open(dir).with_context(|| format!("cannot open the checkpoint in {}", dir.display()))?;
    let roster = Roster::build(&cfg, &ck)?;
    Ok(Opened { dir: dir.to_path_buf(), cfg, ck: Arc::new(ck), roster })
}

/// Opens an engine; the error names the model directory, except for options that conflict with
/// each other (those say which options, and the model is not at fault).
pub fn open_engine(cfg: EngineConfig) -> Result<Arc<Engine>> {
    let dir = cfg.model.clone();
    match Engine::open(cfg) {
        Ok(e) => Ok(e),
        Err(e @ crate::engine::EngineError::Setting { .. }) => Err(e.into()),
        Err(e) => Err(anyhow::Error::new(e).context(format!("cannot open the model in {}", dir.display()))),
    }
}

/// The context to reserve per sequence for a run whose longest sequence holds `longest` tokens
/// (prompt + new tokens): `asked` (`--context`) when given, else `longest` in whole 64s, capped
/// by the model's maximum. Reserving only what the run can use leaves the rest of the memory
/// budget to the expert cache (the default, 32k tokens, is K3's ~1.7 GB of MLA cache a sequence).
/// None (the engine's default) when the model's config cannot be read: opening names why.
pub fn run_context(dir: &Path, asked: Option<usize>, longest: usize) -> Option<usize> {
    if asked.is_some() {
        return asked;
    }
    let cfg = crate::model::K3Config::load(dir).ok()?;
    Some(longest.max(1).div_ceil(64).saturating_mul(64).min(cfg.max_context.max(1)))
}

/// The model directory of `--model DIR` or `--demo` (laid out on first use), checked to exist.
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

fn say(m: &str) {
    eprintln!("deltafin: {m}");
}

/// The built-in demo model under deltafin's cache directory (see `crate::demo`).
pub fn demo_dir() -> Result<PathBuf> {
    let cache = crate::util::cache_dir();
    crate::demo::model_dir(&cache, &say)
        .with_context(|| format!("cannot lay out the demo model in {}", cache.display()))
}

/// With `--demo`, `--draft dspark` and `--draft auto` use the demo's DSpark drafter (beside the
/// demo model) unless `--draft-model` names one.
pub fn demo_draft(demo: bool, draft: DraftKind, engine: &mut EngineArgs) -> Result<()> {
    if demo && engine.draft_model.is_none() && matches!(draft, DraftKind::Dspark | DraftKind::Auto) {
        let cache = crate::util::cache_dir();
        engine.draft_model = crate::demo::dspark_dir(&cache, &say)
            .with_context(|| format!("cannot lay out the demo's drafter in {}", cache.display()))?;
    }
    Ok(())
}

/// Sampling defaults: `--temperature` / `--top-p` when given; else, with `--demo`, the demo's
/// `generation_config.json`; else greedy (temperature 0, top-p 1). Checked like a request's.
pub fn sampling(dir: &Path, demo: bool, temperature: Option<f64>, top_p: Option<f64>) -> Result<SamplingDefaults> {
    let g = if demo { GenerationDefaults::load(dir)?.unwrap_or_default() } else { GenerationDefaults::default() };
    let s = SamplingDefaults {
        temperature: temperature.or(g.temperature).unwrap_or(0.0),
        top_p: top_p.or(g.top_p).unwrap_or(1.0),
    };
    crate::sample::SamplingParams::new(s.temperature, s.top_p, 0).map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(s)
}

/// The "sampling: ..." startup line (`each`: one line for several prompts), None when greedy.
pub fn sampling_line(s: &crate::sample::SamplingParams, each: bool) -> Option<String> {
    (!s.is_greedy()).then(|| {
        let each = if each { " (each prompt)" } else { "" };
        format!("deltafin: sampling: temperature {} top-p {} seed {}{each}", s.temperature, s.top_p, s.seed)
    })
}

/// The "RANDOM weights" note for a model `synth` wrote (its config.json says so), whatever the
/// model directory; None for any other model.
pub fn random_weights_note(dir: &Path) -> Option<String> {
    crate::model::synth::is_synthetic(dir).then(|| {
        format!(
            "deltafin: note: {} has RANDOM weights, so its text is meaningless; it runs the real K3 code path.",
            dir.display()
        )
    })
}
