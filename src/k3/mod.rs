//! The K3 model's math, layer by layer: AttnRes mixing, KDA and MLA attention, the router and the
//! per-expert math of the latent MoE, the dense SiTU MLP, and the per-sequence state.
//!
//! Contract: [`K3`] owns the resident trunk and the backend that computes with it; it holds no
//! sequence state and no expert source. The schedules that drive it over rows of one or several
//! sequences (layer loop, expert-union fetch, prefetch, timers) live in `sched`.

pub mod attn_res;
pub mod kda;
pub mod mla;
pub mod moe;
pub mod state;
pub mod weights;

use crate::backend::Backend;
use crate::model::{Checkpoint, K3Config, ModelError};
use crate::store::StoreError;
pub use kda::KdaMode;
pub use state::SeqState;
use std::sync::Arc;
use weights::{Ffn, MoeWeights, Weights};

#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("token id {id} at position {pos} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange { id: u32, pos: usize, vocab: usize },
    #[error("context is full: {have} + {new} tokens exceeds the usable {max}")]
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
    #[error(transparent)]
    Store(#[from] StoreError),
}

pub use crate::stats::Stats as ForwardStats;

/// The model: config, resident trunk and the backend that computes with it.
pub struct K3 {
    pub cfg: K3Config,
    pub w: Weights,
    pub be: Arc<dyn Backend>,
}

impl K3 {
    /// Loads the trunk of a roster-checked checkpoint (zero-copy views that keep it mapped) and
    /// hands it to the backend once.
    pub fn load(cfg: K3Config, ck: &Checkpoint, be: Arc<dyn Backend>) -> Result<Self, ModelError> {
        let w = Weights::load(&cfg, ck)?;
        be.prepare(&w);
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

/// Index of the largest logit (lowest index on ties; NaN never wins).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] || (logits[best].is_nan() && !v.is_nan()) {
            best = i;
        }
    }
    best as u32
}
