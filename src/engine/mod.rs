//! The engine: one opened model, shared by every front end (run, score, bench, the server, batch
//! runs, draft verification).
//!
//! Contract: [`Engine::open`] turns an [`EngineConfig`] into a ready engine — config, checkpoint
//! (`Arc`, memory-mapped), checked roster, resident trunk (loaded once), backend, expert source and
//! memory plan — or a typed error naming the file and field; nothing is allocated past the memory
//! budget. An `Engine` is `Send + Sync` and is shared across threads behind an `Arc`; all
//! per-sequence state lives in [`Session`]s. Every path that feeds rows — a session's prefill,
//! score, generation with or without drafts, several sessions together, continuous batching —
//! runs the one step core (`scheduler/step.rs`): the rows of every active sequence through one layer loop
//! (one expert-union read per layer for all of them), then each picks or accepts and commits.

mod config;
mod facts;
mod kernel_rate;
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

use crate::backend::{DeviceTraffic, OpTime, SequenceState};
use crate::draft::{DraftError, DraftKind, Drafter, Speculator};
use crate::forward;
use crate::k3::dspark::DSparkModel;
use crate::k3::{K3, LoadError};
use crate::memory::{BudgetError, MemoryPlan, Split, activation_bytes, machine_available, state_reserve};
use crate::model::config::{AttnKind, FfnKind};
use crate::model::tokenizer::Tokenizer;
use crate::model::{Checkpoint, K3Config, ModelError, Roster};
use crate::setting::{Action, Setting};
use crate::store::expert_store::{self, ExpertStore, StoreOptions, StoreSpec};
use crate::store::placement::{Manifest, PlacementError, manifest_path, manifest_spec, restrict_drives, shard_spec};
use crate::store::{ExpertSource, ShardExperts, SourceReport, StoreError};
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

/// Where the store reads experts: the placement's holders (restricted to `--use-drives`) or the
/// shards; None when experts come from the mapped shards or the model has none.
fn store_spec(
    config: &EngineConfig,
    dir: &Path,
    ck: &Arc<Checkpoint>,
    roster: &Roster,
) -> Result<Option<StoreSpec>, EngineError> {
    let manifest_path = manifest_path(config.placement.as_deref(), dir);
    let manifest = match &manifest_path {
        Some(p) if config.experts_from == ExpertsFrom::Store => {
            Some(Manifest::load(p).map_err(|source| EngineError::Placement { path: p.clone(), source })?)
        }
        _ => None,
    };
    if config.use_drives.is_some() && manifest.is_none() {
        let list = config.use_drives.iter().flatten().map(|d| d.to_string()).collect::<Vec<_>>().join(",");
        return Err(EngineError::Setting {
            setting: Setting::UseDrives,
            value: list,
            problem: format!(
                "selects drives of a placement, but there is none (run {}, or drop {})",
                Action::Place,
                Setting::UseDrives
            ),
        });
    }
    let (Some(layout), ExpertsFrom::Store) = (&roster.expert_layout, config.experts_from) else { return Ok(None) };
    Ok(Some(match (&manifest, &manifest_path) {
        (Some(m), Some(mp)) => {
            let mut spec = manifest_spec(m, ck, roster, layout.clone())
                .map_err(|source| EngineError::Placement { path: mp.clone(), source })?;
            if let Some(keep) = &config.use_drives {
                restrict_drives(&mut spec, keep, m.drives.len()).map_err(|e| EngineError::Setting {
                    setting: Setting::UseDrives,
                    value: e.value,
                    problem: e.problem,
                })?;
            }
            spec
        }
        _ => shard_spec(ck, roster, dir, config.qd, 1.0)
            .ok_or_else(|| EngineError::NoRoutedExperts(dir.to_path_buf()))?,
    }))
}

impl Engine {
    /// Opens the model and builds the backend, expert source and memory plan.
    pub fn open(config: EngineConfig) -> Result<Arc<Engine>, EngineError> {
        Self::open_inner(config, None)
    }

    /// Opens the model with an expert source built elsewhere (a test's fault-injecting source, a
    /// remote holder); the config's store options are not used.
    pub fn open_with_source(config: EngineConfig, source: Arc<dyn ExpertSource>) -> Result<Arc<Engine>, EngineError> {
        Self::open_inner(config, Some(source))
    }

    fn open_inner(config: EngineConfig, given: Option<Arc<dyn ExpertSource>>) -> Result<Arc<Engine>, EngineError> {
        crate::cpu::requested_isa()?;
        tracing::info!("engine config {}", serde_json::to_string(&config).unwrap_or_default());
        let dir = config.model.clone();
        if !dir.is_dir() {
            return Err(EngineError::NoModelDir(dir));
        }
        config.check()?;
        // A stream install (`setup --stream`) has holes where the experts are: only its stream
        // source may deliver them. An unfinished one is refused before its files are read.
        let stream = if given.is_some() { None } else { crate::hub::stream::StreamInstall::load(&dir)? };
        if let Some(st) = &stream {
            st.check_complete()?;
        }
        let cfg = K3Config::load(&dir)?;
        let context = crate::memory::reserved_context(&cfg, config.context).map_err(|problem| {
            let value = config.context.unwrap_or_default().to_string();
            EngineError::Setting { setting: Setting::Context, value, problem }
        })?;
        let ck = Arc::new(Checkpoint::open(&dir)?);
        if let Some(e) = ck.damaged_error() {
            return Err(e.into());
        }
        let roster = Roster::build(&cfg, &ck)?;
        let trunk = trunk::resolve(&config, &dir)?;
        let device_cache_bytes = config.gpu_cache_gb.map_or(0, |g| (g * 1e9) as u64);
        let backend = crate::backend::open(config.backend, crate::backend::BackendOptions { device_cache_bytes })?;
        let model = trunk::load(trunk, &cfg, &dir, &ck, &backend)?;
        if let Some(l) = &roster.expert_layout {
            backend.plan_experts(l, cfg.moe_layers() * cfg.experts)?;
            if device_cache_bytes > 0 && backend.device_expert_bytes() == 0 {
                tracing::warn!(
                    "{}: {} has no device memory for experts; ignored",
                    Setting::GpuCacheGb,
                    backend.describe()
                );
            }
        }
        {
            let kda_layers = cfg.attn.iter().filter(|a| **a == AttnKind::Kda).count();
            let state = cfg.kda_heads * cfg.kda_head_dim * cfg.kda_head_dim;
            backend.plan_sequence_state(SequenceState {
                kda_layers,
                kda_state_floats: state,
                kda_head_dim: cfg.kda_head_dim,
                mla_layers: cfg.layers - kda_layers,
                mla_token_floats: cfg.kv_lora + cfg.qk_rope,
            });
        }
        let trunk_bytes = model.w.resident_bytes() as u64;
        let draft = match &config.draft_model {
            Some(d) => {
                Some(Arc::new(DSparkModel::open(d, &cfg, &model.w, Arc::clone(&model.be)).map_err(EngineError::Draft)?))
            }
            None => None,
        };
        let draft_bytes = draft.as_ref().map_or(0, |d| d.weight_bytes() + d.cache_bytes());
        let c = &cfg;
        let budget = config.memory_gb.map_or_else(machine_available, |g| (g * 1e9) as u64);
        let layout = roster.expert_layout.clone();
        let prefetch_depth = usize::from(config.prefetch);
        let mut held = Vec::new();
        // A source given by the caller replaces the store: no placement, no holder map.
        let spec = match (&stream, &layout) {
            _ if given.is_some() => None,
            (Some(_), _) if config.experts_from == ExpertsFrom::Mmap || config.placement.is_some() => {
                let (setting, value) = match &config.placement {
                    Some(p) => (Setting::Placement, p.display().to_string()),
                    None => (Setting::ExpertsFrom, "mmap".into()),
                };
                return Err(EngineError::StreamInstall { dir: dir.clone(), setting, value });
            }
            (Some(st), Some(l)) => {
                let (spec, h) = crate::hub::stream::local_spec(st, &ck, &roster, l)?;
                held = h;
                Some(spec)
            }
            _ => store_spec(&config, &dir, &ck, &roster)?,
        };
        let rows = config.batch_rows.unwrap_or(config.prefill_rows).max(1);
        let slot = match (&spec, &layout) {
            (Some(sp), _) => expert_store::slot_size_for(sp) as u64,
            (None, Some(l)) => expert_store::slot_size(l.len) as u64,
            (None, None) => 0,
        };
        let read_ahead_slots =
            spec.as_ref().map_or(0, |sp| forward::moe::read_ahead_slots(&sp.drives, config.sequences));
        let staging = spec.as_ref().map_or(0, |sp| expert_store::staging_slots(&sp.drives, prefetch_depth) as u64);
        let staging = (staging + read_ahead_slots as u64) * slot;
        let split = Split {
            budget,
            trunk: trunk_bytes,
            draft: draft_bytes,
            staging,
            states: state_reserve(c, context, config.sequences),
            activations: activation_bytes(c, rows) + config.output_bytes,
            slot,
            experts: (c.moe_layers() * c.experts) as u64,
        };
        let cache = match (&spec, config.expert_cache_gb) {
            (None, _) => 0,
            (Some(_), Some(g)) => split.with_cache((g * 1e9) as u64),
            (Some(_), None) => split.expert_cache(),
        };
        let plan = MemoryPlan::new(c, budget, trunk_bytes, draft_bytes, cache, staging, rows, config.output_bytes)?
            .with_context(context, config.sequences);
        // On a Mac the GPU's memory (what it holds now, and at most every sequence's state and the
        // activations) must stay wired: say so when the plan passes the limit.
        let on_gpu = backend.device_memory_bytes();
        if on_gpu > 0 {
            let per_seq = plan.state_fixed + plan.state_per_token * plan.context as u64;
            let gpu = on_gpu + plan.sequences as u64 * per_seq + plan.activations;
            if let Some(msg) = crate::memory::wired_limit_warning(gpu) {
                tracing::warn!("{msg}");
            }
        }
        let (source, store): (Option<Arc<dyn ExpertSource>>, Option<Arc<ExpertStore>>) = match spec {
            None if given.is_some() => (given, None),
            None => match ShardExperts::new(Arc::clone(&ck), &roster) {
                Some(m) => (Some(Arc::new(m)), None),
                None => (None, None),
            },
            Some(spec) => {
                let heat = match &config.expert_heat {
                    ExpertHeat::Off => None,
                    ExpertHeat::At(p) => Some(p.clone()),
                    ExpertHeat::Auto => {
                        let manifest = manifest_path(config.placement.as_deref(), &dir);
                        Some(crate::store::heat::default_path(&dir, manifest.as_deref()))
                    }
                };
                let opts = StoreOptions {
                    cache_bytes: cache,
                    reader: config.reader,
                    prefetch_depth,
                    record_reads: false,
                    heat,
                    hedge: config.hedge,
                    split_min: config.split_reads.then_some(crate::store::expert_store::SPLIT_MIN),
                    read_ahead_slots,
                };
                let store = Arc::new(ExpertStore::open(spec, opts)?);
                let source: Arc<dyn ExpertSource> = match stream {
                    Some(st) => {
                        Arc::new(crate::hub::stream::source(st, Arc::clone(&store), held, Arc::clone(&ck), &roster)?)
                    }
                    None => store.clone(),
                };
                (Some(source), Some(store))
            }
        };
        // A large directory never seen: its checksums are recorded while the engine runs.
        ck.record_in_background();
        Ok(Arc::new(Engine { config, dir, cfg, ck, roster, model, trunk, device: backend, draft, source, store, plan }))
    }

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
