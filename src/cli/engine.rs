//! Engine options shared by `run`, `score` and `bench`, mapped one to one onto
//! [`EngineConfig`] (the library builds the memory plan and the expert source from it). In help
//! they come after each subcommand's own options: the common ones under "Engine", the tuning
//! knobs under "Engine tuning", shown by `--help` only (not `-h`).

use crate::engine::{BackendKind, EngineConfig, ExpertHeat, ExpertsFrom, KdaMode, Trunk};
use crate::store::io::reader::ReaderKind;
use clap::{Args, ValueEnum};
use std::path::PathBuf;

#[derive(Args, Clone, Debug)]
pub struct EngineArgs {
    /// Memory budget in GB (default: what the machine, or its memory cgroup, has available).
    #[arg(long, value_parser = super::parse_gb_positive, help_heading = "Engine")]
    pub memory_gb: Option<f64>,
    /// Tokens of context reserved for each sequence (prompt + generated).
    ///
    /// Default: for `run`, `batch` and `bench run` what the longest prompt and its new tokens
    /// need, else the model's maximum, up to 32768. The memory budget holds this much state for every sequence run together and gives the
    /// rest to the expert cache: a small context leaves a bigger cache.
    ///
    /// `-c` and `--ctx-size` as llama.cpp spells it.
    #[arg(long, short = 'c', visible_alias = "ctx-size", value_name = "TOKENS", help_heading = "Engine")]
    pub context: Option<usize>,
    /// Backend: cpu, gpu (any Vulkan/Metal adapter, lavapipe included), or auto (a real GPU if present).
    #[arg(long, value_enum, ignore_case = true, default_value_t = BackendKind::Cpu, help_heading = "Engine")]
    pub backend: BackendKind,
    /// How the trunk (everything but the routed experts) is held.
    ///
    /// auto (coded when `deltafin pack-trunk` has coded it, else bf16), bf16 (as shipped), coded
    /// (lossless, bit-identical output in about 3/4 of the memory), or int8 (per-row absmax: NOT
    /// exact, labelled so).
    #[arg(long, value_enum, default_value_t = Trunk::Auto, help_heading = "Engine")]
    pub trunk: Trunk,
    /// Expert cache size in GB (default: what the memory budget leaves, up to all experts).
    #[arg(long, value_parser = super::parse_gb, help_heading = "Engine")]
    pub expert_cache_gb: Option<f64>,
    /// Device memory in GB for routed experts kept on the GPU (0: none).
    ///
    /// Kept across layers and tokens, in front of the RAM expert cache: experts it holds are
    /// neither read nor uploaded again. Worth it on a discrete GPU; on unified memory (Apple) it
    /// would hold a second copy.
    #[arg(long, value_parser = super::parse_gb, value_name = "GB", help_heading = "Engine")]
    pub gpu_cache_gb: Option<f64>,
    /// Placement manifest (default: MODEL/placement.json if present, else read the shards).
    #[arg(long, help_heading = "Engine")]
    pub placement: Option<PathBuf>,
    /// DSpark draft model directory (for --draft dspark|auto); its weights count in the memory budget.
    #[arg(long, value_name = "DIR", help_heading = "Engine")]
    pub draft_model: Option<PathBuf>,
    /// I/O reader.
    #[arg(long, value_enum, default_value_t = ReaderKind::Auto, help_heading = "Engine tuning", hide_short_help = true)]
    pub reader: ReaderKind,
    /// Reads in flight per drive when reading the shards without a placement.
    #[arg(long, default_value_t = 4, value_parser = super::parse_qd, help_heading = "Engine tuning", hide_short_help = true)]
    pub qd: usize,
    /// Where experts come from.
    #[arg(long, value_enum, default_value_t = ExpertsFrom::Store, help_heading = "Engine tuning", hide_short_help = true)]
    pub experts_from: ExpertsFrom,
    /// Prompt rows processed together (expert-major); longer prompts are chunked.
    #[arg(long, default_value_t = 4096, help_heading = "Engine tuning", hide_short_help = true)]
    pub prefill_rows: usize,
    /// Predict the next MoE layer's experts and read them into idle drive capacity.
    #[arg(long, value_enum, default_value_t = OnOff::Off, help_heading = "Engine tuning", hide_short_help = true)]
    pub prefetch: OnOff,
    /// Use only these drives of the placement (comma-separated indices), e.g. for a ladder.
    #[arg(long, value_delimiter = ',', help_heading = "Engine tuning", hide_short_help = true)]
    pub use_drives: Option<Vec<usize>>,
    /// Route heat kept across runs, which seeds the expert cache with the experts this model is
    /// routed to most: `auto` (beside the placement manifest, else under deltafin's cache directory, ~/.cache/deltafin/heat by default),
    /// `off`, or a file. Changes only what is cached, never the output.
    #[arg(long, value_name = "auto|off|FILE", default_value = "auto", value_parser = parse_heat, help_heading = "Engine tuning", hide_short_help = true)]
    pub expert_heat: ExpertHeat,
    /// Hedged reads: a read still in flight past its drive's learned p95 read time is issued again
    /// on another drive holding a copy of the expert (mirror, hot replica); the first to land is
    /// used. Changes only timing, never the output.
    #[arg(long, value_enum, default_value_t = OnOff::On, help_heading = "Engine tuning", hide_short_help = true)]
    pub hedge: OnOff,
    /// Split reads: an expert with copies on several drives (mirror) is read as byte ranges
    /// across them, sized by each drive's measured rate, so a layer's reads end together.
    /// Changes only timing, never the output.
    #[arg(long, value_enum, default_value_t = OnOff::On, help_heading = "Engine tuning", hide_short_help = true)]
    pub split_reads: OnOff,
}

fn parse_heat(s: &str) -> Result<ExpertHeat, String> {
    if s.is_empty() {
        return Err("expected auto, off or a file path".into());
    }
    Ok(ExpertHeat::from(s.to_string()))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OnOff {
    On,
    Off,
}

impl EngineArgs {
    /// The engine configuration for `model`, holding activations for `batch_rows` rows at once and
    /// `output_bytes` of results.
    pub fn config(&self, model: PathBuf, kda: KdaMode, batch_rows: usize, output_bytes: u64) -> EngineConfig {
        EngineConfig {
            model,
            placement: self.placement.clone(),
            expert_cache_gb: self.expert_cache_gb,
            reader: self.reader,
            qd: self.qd,
            experts_from: self.experts_from,
            memory_gb: self.memory_gb,
            prefill_rows: self.prefill_rows.max(1),
            batch_rows: Some(batch_rows.clamp(1, self.prefill_rows.max(1))),
            output_bytes,
            prefetch: self.prefetch == OnOff::On,
            use_drives: self.use_drives.clone(),
            kda,
            draft_model: self.draft_model.clone(),
            backend: self.backend,
            gpu_cache_gb: self.gpu_cache_gb,
            expert_heat: self.expert_heat.clone(),
            hedge: self.hedge == OnOff::On,
            split_reads: self.split_reads == OnOff::On,
            sequences: 1,
            context: self.context,
            trunk: self.trunk,
        }
    }
}
