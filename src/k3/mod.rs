//! The model: K3's forward pass and its parts. `forward` reads as the model, top to bottom
//! (embedding, the layer loop with AttnRes mixing, KDA / MLA / MoE, final mix, lm_head); beside
//! it the per-layer math (`attn_res`, `kda`, `mla`, `moe`: the router, the routed experts as they
//! run and the dense SiTU MLP), the per-sequence state (`state`), the resident trunk (`weights`)
//! and the DSpark draft model (`dspark`).
//!
//! Contract: [`K3`] owns the resident trunk and the backend operations that compute with it; it
//! holds no sequence state, reads no bytes and keeps no clock. The schedules that drive it over
//! rows of one or several sequences (which rows run together, which experts to fetch and when,
//! prefetch, timers) live in `crate::forward`, behind `forward::Schedule`.

pub mod attn_res;
pub mod dspark;
pub mod finite;
pub mod forward;
pub mod kda;
pub mod mla;
pub mod moe;
pub mod state;
pub mod weights;

pub use crate::backend::detmath::argmax;
use crate::backend::{Backend, BackendError, Device, Situ};
use crate::model::{Checkpoint, K3Config, ModelError};
use crate::store::StoreError;
pub use kda::KdaMode;
pub use state::SeqState;
use std::sync::Arc;

/// Rows of a pass from which the model's element-wise and gather work runs across threads (a
/// prompt's; a decode step's few rows stay on the calling thread, where handing them to the pool
/// costs more than the work). Rows are independent there: the bits are the same either way.
const PAR_MIN_ROWS: usize = 64;
use weights::{Ffn, MoeWeights, Weights};

#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("token id {id} at position {pos} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange { id: u32, pos: usize, vocab: usize },
    #[error(
        "context is full: {have} + {new} tokens exceed the {max} a sequence may hold (its context: {}, at most the model's maximum)",
        crate::setting::Setting::Context
    )]
    ContextFull { have: usize, new: usize, max: usize },
    #[error("the model has MoE layers but no expert source was configured")]
    NoExpertSource,
    #[error("nothing to run: a forward needs at least one token")]
    Empty,
    #[error("a shared forward needs one token list per session: {sessions} sessions, {lists} lists")]
    BatchMismatch { sessions: usize, lists: usize },
    #[error("a session of another engine cannot join this engine's forward")]
    ForeignSession,
    #[error("cannot commit {want} rows: only {have} are pending")]
    NothingPending { want: usize, have: usize },
    #[error(
        "{site} gave a non-finite value ({value}) at position {pos}: a weight it reads is NaN or infinite, or its \
         values overflow (a damaged model file, or a model that cannot run this input); nothing of this step was kept"
    )]
    NonFinite { site: finite::Site, value: f32, pos: usize, seq: usize },
    /// The caller's watcher stopped the forward (e.g. Ctrl-C during a long prefill).
    #[error("stopped at the caller's request")]
    Cancelled,
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// The model: config, resident trunk and the backend operations that compute with it.
pub struct K3 {
    pub cfg: K3Config,
    pub w: Weights,
    pub be: Arc<dyn Backend>,
}

/// Why a model could not be loaded onto its backend.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("cannot prepare the trunk on the backend: {0}")]
    Backend(#[from] BackendError),
}

impl K3 {
    /// Loads the trunk of a roster-checked checkpoint (zero-copy views that keep it mapped) and
    /// hands its matrices to the backend once.
    pub fn load(cfg: K3Config, ck: &Checkpoint, device: &Arc<dyn Device>) -> Result<Self, LoadError> {
        Self::load_from(cfg, ck, device, &weights::TrunkSource::Bf16)
    }

    /// [`K3::load`] with the trunk's matrices from `src` (`--trunk`).
    pub fn load_from(
        cfg: K3Config,
        ck: &Checkpoint,
        device: &Arc<dyn Device>,
        src: &weights::TrunkSource,
    ) -> Result<Self, LoadError> {
        let w = Weights::load_from(&cfg, ck, src)?;
        device.prepare(&w.device_matrices())?;
        let be: Arc<dyn Backend> = device.clone();
        Ok(K3 { cfg, w, be })
    }

    /// The next MoE layer after `l` and its weights.
    pub fn next_moe(&self, l: usize) -> Option<(usize, &MoeWeights)> {
        self.w.layers.iter().enumerate().skip(l + 1).find_map(|(i, lw)| match &lw.ffn {
            Ffn::Moe(w) => Some((i, w)),
            Ffn::Dense(_) => None,
        })
    }

    pub fn new_state(&self) -> SeqState {
        SeqState::new(&self.cfg)
    }
}

/// The SiTU-GLU constants of `c`'s MLPs and experts.
pub fn situ(c: &K3Config) -> Situ {
    Situ { beta: c.situ_beta, linear_beta: c.situ_linear_beta }
}
