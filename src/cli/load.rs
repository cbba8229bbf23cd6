//! Opening a model for subcommands (an engine, or just its files), with the CLI's error context
//! (a path that is not a model directory is named as what it is: missing, a file, a directory
//! without config.json), a spinner while it loads, the built-in demo model and what `--demo`
//! changes (its drafter; its sampling defaults are `sampling_args`').

use super::engine::EngineArgs;
use super::progress::{self, Progress};
use crate::draft::DraftKind;
use crate::engine::{Engine, EngineConfig};
use crate::model::{Checkpoint, K3Config, Roster};
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A model's files without an engine (config, mapped checkpoint, checked roster): what `place`
/// and the I/O benchmarks need.
pub use crate::model::ModelFiles as Opened;

/// Opens config, checkpoint and roster in that order, so the first error is the most fundamental.
pub fn open(dir: &Path) -> Result<Opened> {
    check_model_dir(dir)?;
    let cfg = K3Config::load(dir).with_context(|| format!("cannot load the model config in {}", dir.display()))?;
    let ck = Checkpoint::open(dir).with_context(|| format!("cannot open the checkpoint in {}", dir.display()))?;
    let roster = Roster::build(&cfg, &ck)?;
    Ok(Opened { dir: dir.to_path_buf(), cfg, ck: Arc::new(ck), roster })
}

/// Opens an engine; the error names the model directory, except for options that conflict with
/// each other (those say which options, and the model is not at fault).
pub fn open_engine(cfg: EngineConfig) -> Result<Arc<Engine>> {
    let dir = cfg.model.clone();
    let name = dir.file_name().map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned());
    let _wait = Progress::spinner(progress::mode(false), &format!("loading {name}"));
    let draft = cfg.draft_model.clone().unwrap_or_default();
    match Engine::open(cfg) {
        Ok(e) => Ok(e),
        Err(e @ crate::engine::EngineError::Setting { .. }) => Err(e.into()),
        // The draft model is at fault, not the model it drafts for: named as the flag gave it.
        Err(crate::engine::EngineError::Draft(e)) => {
            Err(anyhow::anyhow!("--draft-model {}: not a DSpark draft model this model can use: {e}", draft.display()))
        }
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
    check_model_dir(&dir)?;
    Ok(dir)
}

/// What a model directory holds, for messages.
const HOLDS: &str = "config.json, the safetensors shards and tiktoken.model";

/// Checks that `dir` is a K3 model directory, saying what was found instead and what to do: no
/// such path, a file (a model's own file: its directory is meant), a directory without
/// `config.json` (a model one level down is named), a `config.json` that is not K3's.
pub fn check_model_dir(dir: &Path) -> Result<()> {
    let has_config = |d: &Path| d.join("config.json").is_file();
    let m = match std::fs::metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!(
            "--model {}: no such directory (a model directory holds {HOLDS}; `deltafin setup --dir DIR` installs \
             Kimi K3, --demo runs the built-in demo model)",
            dir.display()
        ),
        Err(e) => bail!("--model {}: {e}", dir.display()),
    };
    if !m.is_dir() {
        let parent = dir.parent().filter(|p| has_config(p));
        let hint = parent.map(|p| format!("; its directory is one: --model {}", p.display())).unwrap_or_default();
        bail!("--model {}: is a file, not a model directory (one holding {HOLDS}){hint}", dir.display());
    }
    if !has_config(dir) {
        let mut below: Vec<PathBuf> = std::fs::read_dir(dir)
            .map(|rd| rd.flatten().map(|e| e.path()).filter(|p| p.is_dir() && has_config(p)).collect())
            .unwrap_or_default();
        below.sort();
        let hint = match below.as_slice() {
            [] => "; `deltafin setup --dir DIR` installs Kimi K3, --demo runs the built-in demo model".to_string(),
            [one] => format!("; the model seems to be in {}", one.display()),
            more => format!(
                "; these directories in it hold one: {}",
                more.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
            ),
        };
        bail!("--model {}: not a model directory: it has no config.json (expected {HOLDS}){hint}", dir.display());
    }
    K3Config::load(dir).with_context(|| format!("--model {}: not a Kimi K3 model", dir.display()))?;
    Ok(())
}

fn say(m: &str) {
    eprintln!("deltafin: {m}");
}

/// The built-in demo model under deltafin's cache directory (see `crate::demo`).
pub fn demo_dir() -> Result<PathBuf> {
    let cache = crate::util::cache_dir();
    // The first use writes (or synthesises) the model: a spinner while it does, where shown.
    let _wait = Progress::spinner(progress::mode(false), "preparing the demo model");
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
