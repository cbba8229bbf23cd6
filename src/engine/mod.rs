//! The engine: one opened model, shared by every front end (run, score, bench, the server, batch
//! runs, draft verification).
//!
//! Contract: [`Engine::open`] (`open.rs`, in named phases) turns an [`EngineConfig`] into a ready
//! engine — config, checkpoint (`Arc`, memory-mapped), checked roster, resident trunk (loaded once),
//! backend, expert source and memory plan — or a typed error naming the file and field; nothing is
//! allocated past the memory budget. An `Engine` is `Send + Sync` and is shared across threads behind an `Arc`; all
//! per-sequence state lives in [`Session`]s. Every path that feeds rows — a session's prefill,
//! score, generation with or without drafts, several sessions together, continuous batching —
//! runs the one step core (`scheduler/step.rs`): the rows of every active sequence through one layer loop
//! (one expert-union read per layer for all of them), then each picks or accepts and commits.

mod config;
mod facts;
mod kernel_rate;
mod open;
mod parts;
mod scheduler;
pub(crate) mod session;
pub mod state_file;
mod trunk;

pub use config::{EngineConfig, ExpertHeat, ExpertsFrom};
pub use scheduler::{BatchSeq, Lane, LaneError, LaneHost, prefill_passes};
pub use session::{GenerateOptions, Generation, PrefillProgress, PrefillWatcher, Session, StopReason};
pub use state_file::{SamplerPosition, SessionNotes, StateFileError};
// The settings and errors of the engine's API that are defined further down.
pub use crate::backend::BackendKind;
pub use crate::k3::weights::Trunk;
pub use crate::k3::{ForwardError, KdaMode};

use crate::backend::{DeviceTraffic, OpTime};
use crate::draft::{DraftError, DraftKind, Drafter, Speculator};
use crate::forward;
use crate::k3::dspark::DSparkModel;
use crate::k3::{K3, LoadError};
use crate::memory::{BudgetError, MemoryPlan};
use crate::model::config::{AttnKind, FfnKind};
use crate::model::tokenizer::Tokenizer;
use crate::model::{Checkpoint, K3Config, ModelError, Roster};
use crate::setting::Setting;
use crate::store::expert_store::ExpertStore;
use crate::store::placement::PlacementError;
use crate::store::{ExpertSource, SourceReport, StoreError};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("model directory {} does not exist", .0.display())]
    NoModelDir(PathBuf),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("cannot use the placement {}: {source}", path.display())]
    Placement { path: PathBuf, source: PlacementError },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Budget(#[from] BudgetError),
    #[error(transparent)]
    Isa(#[from] crate::cpu::IsaError),
    /// The model has no routed experts where the expert store needs some.
    #[error("{}: the model has no routed experts", .0.display())]
    NoRoutedExperts(PathBuf),
    /// A stream install's experts come only from its stream source, and `setting` asked for another.
    #[error("{} is a stream install (its shards hold no routed experts): experts come from its stream source, not {setting} {value}", dir.display())]
    StreamInstall { dir: PathBuf, setting: Setting, value: String },
    /// A setting with a value it cannot have, or one that conflicts with another setting (named in
    /// `problem`).
    #[error("{setting} {value}: {problem}")]
    Setting { setting: Setting, value: String, problem: String },
    #[error("{}: {msg}", dir.display())]
    Tokenizer { dir: PathBuf, msg: String },
    #[error("{} has no tiktoken.model: text prompts need the model's tokenizer (use {} for token ids)", .0.display(), Setting::PromptIds)]
    NoTokenizer(PathBuf),
    #[error(transparent)]
    Forward(#[from] ForwardError),
    #[error("draft model: {0}")]
    Draft(ModelError),
    #[error(transparent)]
    Backend(#[from] crate::backend::BackendError),
    #[error(transparent)]
    Hub(#[from] crate::hub::HubError),
    #[error(transparent)]
    TrunkPack(#[from] crate::model::trunk_pack::TrunkPackError),
}

impl From<LoadError> for EngineError {
    fn from(e: LoadError) -> Self {
        match e {
            LoadError::Model(e) => EngineError::Model(e),
            LoadError::Backend(e) => EngineError::Backend(e),
        }
    }
}

/// An opened model; see the module contract.
pub struct Engine {
    config: EngineConfig,
    dir: PathBuf,
    cfg: K3Config,
    ck: Arc<Checkpoint>,
    roster: Roster,
    model: K3,
    /// The trunk encoding in use (`EngineConfig::trunk` resolved: never `Auto`).
    trunk: Trunk,
    /// The backend the model computes on, as the engine manages it (description, device expert
    /// cache, counters); the model itself sees only its operations.
    device: Arc<dyn crate::backend::Device>,
    /// The DSpark draft model (`EngineConfig::draft_model`), shared by every session's drafter.
    draft: Option<Arc<DSparkModel>>,
    source: Option<Arc<dyn ExpertSource>>,
    store: Option<Arc<ExpertStore>>,
    plan: MemoryPlan,
}

impl Engine {
    /// The drafter `kind` names (None for `Off`); DSpark drafts with this engine's draft model.
    pub fn drafter(&self, kind: DraftKind) -> Result<Option<Box<dyn Drafter>>, DraftError> {
        crate::draft::drafter_for(kind, self.draft.as_ref())
    }

    /// A sequence's drafter for `kind` with its width policy (`Speculator::new`: union-aware by
    /// default) (None for `Off`).
    pub fn speculator(&self, kind: DraftKind) -> Result<Option<Speculator>, DraftError> {
        Ok(self.drafter(kind)?.map(|d| Speculator::new(d, self.cfg.experts)))
    }

    /// A new, empty sequence on this engine.
    pub fn new_session(self: &Arc<Self>) -> Session {
        Session::new(Arc::clone(self))
    }

    /// The expert source (None for a model without routed experts).
    pub fn source(&self) -> Option<&dyn ExpertSource> {
        self.source.as_deref()
    }

    /// The expert store, when experts are read through it.
    pub fn store(&self) -> Option<&ExpertStore> {
        self.store.as_deref()
    }

    /// The source's counters now.
    pub fn source_report(&self) -> SourceReport {
        self.source.as_ref().map(|s| s.report()).unwrap_or_default()
    }

    /// The source's read counters now (no drive figures: cheap, taken around forwards).
    pub fn read_counters(&self) -> SourceReport {
        self.source.as_ref().map(|s| s.read_counters()).unwrap_or_default()
    }

    pub(crate) fn forward_options(&self) -> forward::Options {
        let queue_depth = self.store.as_ref().map_or(self.config.qd, |s| s.queue_depth());
        forward::Options { kda_mode: self.config.kda, prefetch: self.config.prefetch, queue_depth }
    }

    /// Checks that a tokenizer fits this model's vocabulary.
    pub fn check_tokenizer(&self, tok: &Tokenizer) -> Result<(), EngineError> {
        if tok.vocab_size() != self.cfg.vocab {
            return Err(EngineError::Tokenizer {
                dir: self.dir.clone(),
                msg: format!(
                    "the tokenizer has {} tokens ({} ranks + 256 specials) but config.json says vocab_size {}",
                    tok.vocab_size(),
                    tok.n_base(),
                    self.cfg.vocab
                ),
            });
        }
        Ok(())
    }

    /// This model's tokenizer, checked against its vocabulary.
    pub fn tokenizer(&self) -> Result<Tokenizer, EngineError> {
        let tok = load_tokenizer(&self.dir)?;
        self.check_tokenizer(&tok)?;
        Ok(tok)
    }

    /// Bytes of all routed experts on disk.
    pub fn expert_bytes_total(&self) -> u64 {
        (self.cfg.moe_layers() * self.cfg.experts * self.cfg.expert_bytes()) as u64
    }

    /// One line: model, layers, experts, expert source, memory split, usable context, backend.
    pub fn startup_line(&self) -> String {
        let c = &self.cfg;
        let kda = c.attn.iter().filter(|a| **a == AttnKind::Kda).count();
        let dense = c.ffn.iter().filter(|f| **f == FfnKind::Dense).count();
        let random = if crate::model::synth::is_synthetic(&self.dir) { " [RANDOM WEIGHTS]" } else { "" };
        let source = self.source.as_ref().map_or_else(|| "no routed experts".to_string(), |s| s.describe());
        format!(
            "deltafin: {}{random} | {} layers ({kda} KDA + {} MLA, {dense} dense + {} MoE), {} experts/layer top-{} + {} shared, hidden {}, vocab {} | experts {} on disk, {source} | {} | memory: {} | context <= {} tokens{} | prefill rows {} | {}{}",
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
            self.trunk_label(),
            self.plan.summary(),
            self.plan.context_bound,
            match self.plan.sequences {
                1 => String::new(),
                n => format!(" x {n} sequences"),
            },
            self.config.prefill_rows,
            self.device.describe(),
            if self.config.prefetch { " | prefetch on" } else { "" },
        )
    }

    /// The backend that runs the forward pass as it describes itself ("cpu avx512 x2", "gpu NVIDIA
    /// H200 ..."): what `--backend auto` resolved to.
    pub fn backend_used(&self) -> String {
        self.device.describe()
    }

    /// The backend's device traffic so far (zero for the CPU).
    pub fn device_traffic(&self) -> DeviceTraffic {
        self.device.device_traffic()
    }

    /// Calls and wall time per backend operation since the engine opened (a device backend's
    /// profile; empty for the CPU).
    pub fn op_times(&self) -> Vec<OpTime> {
        self.device.op_times()
    }

    /// Experts the backend's device cache has room for (0 without one).
    pub fn device_expert_slots(&self) -> usize {
        self.device.device_expert_slots()
    }

    /// Bytes of device memory the backend uses for routed experts (0 for the CPU).
    pub fn device_expert_bytes(&self) -> u64 {
        self.device.device_expert_bytes()
    }

    /// The model directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// The tokenizer of the model in `dir` (`tiktoken.model` + `tokenizer_config.json`), converted once
/// and cached; usable before an engine is opened (a prompt's length sizes the engine's activations).
pub fn load_tokenizer(dir: &Path) -> Result<Tokenizer, EngineError> {
    if !dir.join("tiktoken.model").exists() {
        return Err(EngineError::NoTokenizer(dir.to_path_buf()));
    }
    let cache = crate::util::cache_dir().join("tokenizers");
    Tokenizer::load(dir, Some(&cache))
        .map_err(|e| EngineError::Tokenizer { dir: dir.to_path_buf(), msg: format!("cannot load the tokenizer: {e}") })
}
