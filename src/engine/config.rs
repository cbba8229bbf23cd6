//! What an engine is opened from: [`EngineConfig`] (the CLI's engine flags, one field each) and
//! the choices it names ([`ExpertsFrom`], [`ExpertHeat`]).
//!
//! Contract: plain data, serialisable (a bench record's `engine_config` is this struct); the
//! defaults are the CLI's. Nothing here opens a file.

use super::{BackendKind, EngineError, KdaMode, Trunk};
use crate::setting::Setting;
use crate::store::io::reader::ReaderKind;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Where routed experts come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum, Default)]
#[serde(rename_all = "lowercase")]
pub enum ExpertsFrom {
    /// The expert store: O_DIRECT reads from the placement's drives (or the shards), with cache.
    #[default]
    Store,
    /// The memory-mapped shards through the page cache (reference path; no counters of reads).
    Mmap,
}

/// Where the route heat kept across runs lives (`--expert-heat`; see [`crate::store::heat`]).
#[derive(Clone, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(into = "String", from = "String")]
pub enum ExpertHeat {
    /// No heat: the cache learns from this run only.
    #[default]
    Off,
    /// Beside the placement manifest when there is one, else in the user's cache directory.
    Auto,
    /// This file.
    At(PathBuf),
}

impl From<ExpertHeat> for String {
    fn from(h: ExpertHeat) -> String {
        match h {
            ExpertHeat::Off => "off".into(),
            ExpertHeat::Auto => "auto".into(),
            ExpertHeat::At(p) => p.display().to_string(),
        }
    }
}

impl From<String> for ExpertHeat {
    fn from(s: String) -> ExpertHeat {
        match s.as_str() {
            "off" => ExpertHeat::Off,
            "auto" => ExpertHeat::Auto,
            _ => ExpertHeat::At(PathBuf::from(s)),
        }
    }
}

/// Everything an engine is opened from. The CLI flags map onto these fields one to one.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    /// Model directory (config.json, safetensors shards, tokenizer files).
    pub model: PathBuf,
    /// Placement manifest (default: MODEL/placement.json if present, else read the shards).
    pub placement: Option<PathBuf>,
    /// Expert cache in GB (default: what the memory budget leaves, up to all experts).
    pub expert_cache_gb: Option<f64>,
    pub reader: ReaderKind,
    /// Reads in flight per drive when reading the shards without a placement.
    pub qd: usize,
    pub experts_from: ExpertsFrom,
    /// Memory budget in GB (default: what the machine, or its memory cgroup, has available).
    pub memory_gb: Option<f64>,
    /// Prompt rows processed together (expert-major); longer prompts are chunked.
    pub prefill_rows: usize,
    /// Rows the engine must hold activations for at once (default: `prefill_rows`).
    pub batch_rows: Option<usize>,
    /// Bytes of outputs kept besides activations (e.g. every position's logits for `score`).
    pub output_bytes: u64,
    /// Predict the next MoE layer's experts and read them into idle drive capacity.
    pub prefetch: bool,
    /// Use only these drives of the placement.
    pub use_drives: Option<Vec<usize>>,
    pub kda: KdaMode,
    /// DSpark draft model directory (`--draft-model`); its weights count in the memory budget.
    pub draft_model: Option<PathBuf>,
    /// Which backend runs the forward pass.
    pub backend: BackendKind,
    /// Device memory in GB for the GPU backend's expert cache (`--gpu-cache-gb`; None or 0: none).
    pub gpu_cache_gb: Option<f64>,
    /// Route heat kept across runs, seeding the expert cache.
    pub expert_heat: ExpertHeat,
    /// Hedged reads: a read late on its drive is issued again where the expert has another copy.
    pub hedge: bool,
    /// Split reads: a demanded expert held on several drives is read as byte ranges across them.
    pub split_reads: bool,
    /// Sequences run together (`--parallel`, `bench run --batch`): the default expert cache
    /// leaves room for this many sequence states.
    #[serde(default)]
    pub sequences: usize,
    /// Tokens of context reserved for each sequence (what llama.cpp calls `-c`; default
    /// min(the model's maximum, 32768)): the memory plan holds `sequences` x this many tokens of
    /// state and gives the rest to the expert cache, and no sequence grows past it.
    pub context: Option<usize>,
    /// How the trunk's bf16 matrices are held (`--trunk`; default coded when packed, else bf16).
    pub trunk: Trunk,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            model: PathBuf::new(),
            placement: None,
            expert_cache_gb: None,
            reader: ReaderKind::Auto,
            qd: 4,
            experts_from: ExpertsFrom::Store,
            memory_gb: None,
            prefill_rows: 4096,
            batch_rows: None,
            output_bytes: 0,
            prefetch: false,
            use_drives: None,
            kda: KdaMode::Recurrent,
            draft_model: None,
            backend: BackendKind::Cpu,
            gpu_cache_gb: None,
            expert_heat: ExpertHeat::Off,
            hedge: true,
            split_reads: true,
            sequences: 1,
            context: None,
            trunk: Trunk::Auto,
        }
    }
}

impl EngineConfig {
    /// Checks the settings that need no file: sizes are positive numbers, a GPU cache has a GPU,
    /// drives of the store are not asked for with mapped experts.
    pub(super) fn check(&self) -> Result<(), EngineError> {
        if let Some(g) = self.memory_gb
            && !(g.is_finite() && g > 0.0)
        {
            return Err(EngineError::Setting {
                setting: Setting::MemoryGb,
                value: g.to_string(),
                problem: "give a positive number of GB".into(),
            });
        }
        if let Some(g) = self.expert_cache_gb
            && !(g.is_finite() && g >= 0.0)
        {
            return Err(EngineError::Setting {
                setting: Setting::ExpertCacheGb,
                value: g.to_string(),
                problem: "give a number of GB >= 0".into(),
            });
        }
        if let Some(g) = self.gpu_cache_gb {
            if !(g.is_finite() && g >= 0.0) {
                return Err(EngineError::Setting {
                    setting: Setting::GpuCacheGb,
                    value: g.to_string(),
                    problem: "give a number of GB >= 0".into(),
                });
            }
            if g > 0.0 && self.backend == BackendKind::Cpu {
                return Err(EngineError::Setting {
                    setting: Setting::GpuCacheGb,
                    value: g.to_string(),
                    problem: format!("keeps experts in GPU memory: it needs {} gpu or auto", Setting::Backend),
                });
            }
        }
        if self.experts_from == ExpertsFrom::Mmap && (self.placement.is_some() || self.use_drives.is_some()) {
            return Err(EngineError::Setting {
                setting: Setting::ExpertsFrom,
                value: "mmap".into(),
                problem: format!(
                    "{} and {} choose drives of the expert store; they cannot be used with it",
                    Setting::Placement,
                    Setting::UseDrives
                ),
            });
        }
        Ok(())
    }
}
