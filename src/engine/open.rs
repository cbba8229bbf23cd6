//! The engine's composition root: [`Engine::open`] in named phases, each a function, run in this
//! order (the order its checks and messages have always come in):
//!
//! 1. [`resolve`]: the model directory, its settings' checks, the stream install (if any), the
//!    config, the context per sequence, the checked checkpoint and roster;
//! 2. [`open_backend`]: the trunk encoding, the backend and the model on it (the trunk loaded
//!    once), the backend's plans for experts and sequence state;
//! 3. [`open_drafter`]: the DSpark draft model, when one is named;
//! 4. [`locate_experts`]: where the store reads experts — a stream install's packs, a placement's
//!    holders or the shards — and the read slots its reads ahead take;
//! 5. [`plan_memory`]: the memory budget split once (`memory::Split`: trunk, draft, read slots,
//!    states, activations, and the expert cache the rest leaves) into the engine's `MemoryPlan`;
//! 6. [`open_source`]: the expert source — a caller's, the mapped shards, or the expert store
//!    (wrapped in a stream install's source).
//!
//! Contract: nothing is allocated past the memory budget, and a failed phase is a typed error
//! naming the file and field; the phases share nothing but what they return.

use super::{Engine, EngineConfig, EngineError, ExpertHeat, ExpertsFrom, Trunk, trunk};
use crate::backend::{Device, SequenceState};
use crate::hub::stream::StreamInstall;
use crate::k3::K3;
use crate::k3::dspark::DSparkModel;
use crate::memory::{MemoryPlan, Split, activation_bytes, machine_available, state_reserve};
use crate::model::config::AttnKind;
use crate::model::{Checkpoint, K3Config, Roster};
use crate::setting::{Action, Setting};
use crate::store::expert_store::{self, ExpertStore, StoreOptions, StoreSpec};
use crate::store::placement::{Manifest, manifest_path, manifest_spec, restrict_drives, shard_spec};
use crate::store::stream::Held;
use crate::store::{ExpertSource, ShardExperts};
use std::path::{Path, PathBuf};
use std::sync::Arc;

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
        let found = resolve(&config, given.is_some())?;
        let (device, model, trunk) = open_backend(&config, &found)?;
        let draft = open_drafter(&config, &found.cfg, &model)?;
        let experts = locate_experts(&config, &found, given.is_some())?;
        let plan = plan_memory(&config, &found, &model, draft.as_deref(), &experts, &*device)?;
        let (source, store) = open_source(&config, &found, experts, plan.expert_cache, given)?;
        // A large directory never seen: its checksums are recorded while the engine runs.
        found.ck.record_in_background();
        let Found { dir, cfg, ck, roster, .. } = found;
        Ok(Arc::new(Engine { config, dir, cfg, ck, roster, model, trunk, device, draft, source, store, plan }))
    }
}

/// What a model directory resolves to before anything is loaded.
struct Found {
    dir: PathBuf,
    cfg: K3Config,
    /// Tokens of context reserved per sequence (checked against the model's maximum).
    context: usize,
    ck: Arc<Checkpoint>,
    roster: Roster,
    /// A stream install's record (`setup --stream`; never with a caller's source).
    stream: Option<StreamInstall>,
}

/// Phase 1: the model directory and its settings, the stream install, the config and context, the
/// checked checkpoint and roster.
fn resolve(config: &EngineConfig, given: bool) -> Result<Found, EngineError> {
    let dir = config.model.clone();
    if !dir.is_dir() {
        return Err(EngineError::NoModelDir(dir));
    }
    config.check()?;
    // A stream install (`setup --stream`) has holes where the experts are: only its stream
    // source may deliver them. An unfinished one is refused before its files are read.
    let stream = if given { None } else { StreamInstall::load(&dir)? };
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
    Ok(Found { dir, cfg, context, ck, roster, stream })
}

/// Phase 2: the trunk encoding, the backend and the model on it; the backend plans its expert
/// slots and every sequence's state.
fn open_backend(config: &EngineConfig, found: &Found) -> Result<(Arc<dyn Device>, K3, Trunk), EngineError> {
    let (cfg, dir) = (&found.cfg, &found.dir);
    let trunk = trunk::resolve(config, dir)?;
    let device_cache_bytes = config.gpu_cache_gb.map_or(0, |g| (g * 1e9) as u64);
    let backend = crate::backend::open(config.backend, crate::backend::BackendOptions { device_cache_bytes })?;
    let model = trunk::load(trunk, cfg, dir, &found.ck, &backend)?;
    if let Some(l) = &found.roster.expert_layout {
        backend.plan_experts(l, cfg.moe_layers() * cfg.experts)?;
        if device_cache_bytes > 0 && backend.device_expert_bytes() == 0 {
            tracing::warn!("{}: {} has no device memory for experts; ignored", Setting::GpuCacheGb, backend.describe());
        }
    }
    let kda_layers = cfg.attn.iter().filter(|a| **a == AttnKind::Kda).count();
    backend.plan_sequence_state(SequenceState {
        kda_layers,
        kda_state_floats: cfg.kda_heads * cfg.kda_head_dim * cfg.kda_head_dim,
        kda_head_dim: cfg.kda_head_dim,
        mla_layers: cfg.layers - kda_layers,
        mla_token_floats: cfg.kv_lora + cfg.qk_rope,
    });
    Ok((backend, model, trunk))
}

/// Phase 3: the DSpark draft model (`EngineConfig::draft_model`), over the model's trunk.
fn open_drafter(config: &EngineConfig, cfg: &K3Config, model: &K3) -> Result<Option<Arc<DSparkModel>>, EngineError> {
    let Some(d) = &config.draft_model else { return Ok(None) };
    let draft = DSparkModel::open(d, cfg, &model.w, Arc::clone(&model.be)).map_err(EngineError::Draft)?;
    Ok(Some(Arc::new(draft)))
}

/// Where the store reads experts (None: the mapped shards, a caller's source, or no routed
/// experts), the experts a stream install holds locally, and the read slots its reads ahead take.
struct Experts {
    spec: Option<StoreSpec>,
    held: Held,
    read_ahead_slots: usize,
}

/// Phase 4: where the store reads experts. A stream install's come from its packs (its source
/// streams the rest), else a placement's holders (restricted to `use_drives`) or the shards.
fn locate_experts(config: &EngineConfig, found: &Found, given: bool) -> Result<Experts, EngineError> {
    let mut held = Vec::new();
    // A source given by the caller replaces the store: no placement, no holder map.
    let spec = match (&found.stream, &found.roster.expert_layout) {
        _ if given => None,
        (Some(_), _) if config.experts_from == ExpertsFrom::Mmap || config.placement.is_some() => {
            let (setting, value) = match &config.placement {
                Some(p) => (Setting::Placement, p.display().to_string()),
                None => (Setting::ExpertsFrom, "mmap".into()),
            };
            return Err(EngineError::StreamInstall { dir: found.dir.clone(), setting, value });
        }
        (Some(st), Some(l)) => {
            let (spec, h) = crate::hub::stream::local_spec(st, &found.ck, &found.roster, l)?;
            held = h;
            Some(spec)
        }
        _ => store_spec(config, &found.dir, &found.ck, &found.roster)?,
    };
    let read_ahead_slots =
        spec.as_ref().map_or(0, |sp| crate::forward::moe::read_ahead_slots(&sp.drives, config.sequences));
    Ok(Experts { spec, held, read_ahead_slots })
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

/// Phase 5: the memory budget split once into the engine's plan: the trunk, the draft model, the
/// read slots (staging and reads ahead), every sequence's state at its full context, the
/// activations, and the expert cache (as asked, else what the rest leaves; none without a store).
/// On a Mac, warns when the GPU's share passes the wired limit.
fn plan_memory(
    config: &EngineConfig,
    found: &Found,
    model: &K3,
    draft: Option<&DSparkModel>,
    experts: &Experts,
    device: &dyn Device,
) -> Result<MemoryPlan, EngineError> {
    let c = &found.cfg;
    let spec = experts.spec.as_ref();
    let rows = config.batch_rows.unwrap_or(config.prefill_rows).max(1);
    let slot = match (spec, &found.roster.expert_layout) {
        (Some(sp), _) => expert_store::slot_size_for(sp) as u64,
        (None, Some(l)) => expert_store::slot_size(l.len) as u64,
        (None, None) => 0,
    };
    let prefetch_depth = usize::from(config.prefetch);
    let staging = spec.map_or(0, |sp| expert_store::staging_slots(&sp.drives, prefetch_depth) as u64);
    let split = Split {
        budget: config.memory_gb.map_or_else(machine_available, |g| (g * 1e9) as u64),
        trunk: model.w.resident_bytes() as u64,
        draft: draft.map_or(0, |d| d.weight_bytes() + d.cache_bytes()),
        staging: (staging + experts.read_ahead_slots as u64) * slot,
        states: state_reserve(c, found.context, config.sequences),
        activations: activation_bytes(c, rows) + config.output_bytes,
        slot,
        experts: (c.moe_layers() * c.experts) as u64,
    };
    let cache = match (spec, config.expert_cache_gb) {
        (None, _) => 0,
        (Some(_), Some(g)) => split.with_cache((g * 1e9) as u64),
        (Some(_), None) => split.expert_cache(),
    };
    let plan = MemoryPlan::new(c, &split, cache)?.with_context(found.context, config.sequences);
    // On a Mac the GPU's memory (what it holds now, and at most every sequence's state and the
    // activations) must stay wired: say so when the plan passes the limit.
    let on_gpu = device.device_memory_bytes();
    if on_gpu > 0 {
        let per_seq = plan.state_fixed + plan.state_per_token * plan.context as u64;
        let gpu = on_gpu + plan.sequences as u64 * per_seq + plan.activations;
        if let Some(msg) = crate::memory::wired_limit_warning(gpu) {
            tracing::warn!("{msg}");
        }
    }
    Ok(plan)
}

/// The engine's expert source, and the store when experts are read through one.
type Sources = (Option<Arc<dyn ExpertSource>>, Option<Arc<ExpertStore>>);

/// Phase 6: the expert source. A caller's as given; without a store the mapped shards (None for a
/// model without routed experts); else the expert store with `cache` bytes of cache, wrapped in a
/// stream install's source when the experts stream.
fn open_source(
    config: &EngineConfig,
    found: &Found,
    experts: Experts,
    cache: u64,
    given: Option<Arc<dyn ExpertSource>>,
) -> Result<Sources, EngineError> {
    let Experts { spec, held, read_ahead_slots } = experts;
    let Some(spec) = spec else {
        if given.is_some() {
            return Ok((given, None));
        }
        return Ok(match ShardExperts::new(Arc::clone(&found.ck), &found.roster) {
            Some(m) => (Some(Arc::new(m)), None),
            None => (None, None),
        });
    };
    let heat = match &config.expert_heat {
        ExpertHeat::Off => None,
        ExpertHeat::At(p) => Some(p.clone()),
        ExpertHeat::Auto => {
            let manifest = manifest_path(config.placement.as_deref(), &found.dir);
            Some(crate::store::heat::default_path(&found.dir, manifest.as_deref()))
        }
    };
    let opts = StoreOptions {
        cache_bytes: cache,
        reader: config.reader,
        prefetch_depth: usize::from(config.prefetch),
        record_reads: false,
        heat,
        hedge: config.hedge,
        split_min: config.split_reads.then_some(expert_store::SPLIT_MIN),
        read_ahead_slots,
    };
    let store = Arc::new(ExpertStore::open(spec, opts)?);
    let source: Arc<dyn ExpertSource> = match &found.stream {
        Some(st) => Arc::new(crate::hub::stream::source(
            st.clone(),
            Arc::clone(&store),
            held,
            Arc::clone(&found.ck),
            &found.roster,
        )?),
        None => store.clone(),
    };
    Ok((Some(source), Some(store)))
}
