//! Per-sequence state that makes decode incremental: for each KDA layer the recurrent state
//! S [heads, dk, dv] and the causal-conv tail (the last width-1 projected rows of q, k, v); for each
//! MLA layer the latent cache [RMSNorm(c), k_pe] per token. AttnRes block snapshots are per-token
//! activations of one pass (a token mixes only its own snapshots), so they are not kept here.
//!
//! Contract: a forward leaves its results *pending* (KDA: the state after its rows in a second
//! buffer; MLA: rows appended past the committed length). [`SeqState::commit`] keeps the first j
//! rows, [`SeqState::rollback`] drops them all; until one of them runs, the committed state is
//! exactly what it was before the forward.

use super::kda::{self, KdaPending, KdaState};
use super::mla::MlaState;
use crate::backend::{Backend, BackendError, StateBuf};
use crate::model::K3Config;
use crate::model::config::AttnKind;

pub enum LayerState {
    Kda(KdaState),
    Mla(MlaState),
}

impl LayerState {
    /// A host copy (a KDA state read back from a device that holds it).
    pub fn try_clone(&self) -> Result<Self, BackendError> {
        Ok(match self {
            LayerState::Kda(k) => LayerState::Kda(k.try_clone()?),
            LayerState::Mla(m) => LayerState::Mla(m.clone()),
        })
    }
}

/// An uncommitted forward's result for one layer.
pub enum LayerPending {
    Kda(KdaPending),
    /// Committed cache length (values) before the forward's rows were appended.
    Mla {
        committed: usize,
    },
}

pub struct SeqState {
    /// Tokens committed so far.
    pub pos: usize,
    /// Tokens this sequence may hold (its reserved context; the model's maximum by default): a
    /// forward past it is refused.
    pub cap: usize,
    pub layers: Vec<LayerState>,
    /// Pending results of the last forward (empty when none), per layer.
    pub pending: Vec<Option<LayerPending>>,
    pending_rows: usize,
    /// Spare KDA state buffers, reused by the next forward.
    spare: Vec<Option<StateBuf>>,
}

impl SeqState {
    pub fn new(c: &K3Config) -> Self {
        let layers: Vec<LayerState> = c
            .attn
            .iter()
            .map(|a| match a {
                AttnKind::Kda => LayerState::Kda(KdaState::new(c)),
                AttnKind::Mla => LayerState::Mla(MlaState { latent: Default::default() }),
            })
            .collect();
        Self::of(0, c.max_context, layers)
    }

    /// A committed state of `pos` tokens made of `layers` (read back from a state file).
    pub fn from_layers(pos: usize, cap: usize, layers: Vec<LayerState>) -> Self {
        Self::of(pos, cap, layers)
    }

    fn of(pos: usize, cap: usize, layers: Vec<LayerState>) -> Self {
        let n = layers.len();
        SeqState {
            pos,
            cap,
            layers,
            pending: (0..n).map(|_| None).collect(),
            pending_rows: 0,
            spare: (0..n).map(|_| None).collect(),
        }
    }

    /// A copy of the committed state (pending rows are not copied; KDA states are read back
    /// from a device that holds them, which can fail).
    pub fn try_clone(&self) -> Result<Self, BackendError> {
        let mut layers = Vec::with_capacity(self.layers.len());
        for (l, p) in self.layers.iter().zip(&self.pending) {
            let mut l = l.try_clone()?;
            if let (LayerState::Mla(m), Some(LayerPending::Mla { committed })) = (&mut l, p) {
                m.latent.truncate(*committed);
            }
            layers.push(l);
        }
        Ok(Self::of(self.pos, self.cap, layers))
    }

    /// Bytes of fixed state (KDA, twice: committed and pending) plus bytes per cached token (MLA).
    pub fn footprint(c: &K3Config) -> (usize, usize) {
        let kda = c.attn.iter().filter(|a| **a == AttnKind::Kda).count();
        let mla = c.layers - kda;
        let s = c.kda_heads * c.kda_head_dim * c.kda_head_dim;
        let fixed = kda * 4 * (2 * s + 3 * (c.conv_width - 1) * c.kda_dim());
        let per_token = mla * 4 * (c.kv_lora + c.qk_rope);
        (fixed, per_token)
    }

    /// Rows of the pending forward (0 when nothing is pending).
    pub fn pending_rows(&self) -> usize {
        self.pending_rows
    }

    /// Starts a forward of `rows` rows: drops anything still pending.
    pub(crate) fn begin(&mut self, rows: usize) {
        self.rollback();
        self.pending_rows = rows;
    }

    pub(crate) fn take_spare(&mut self, l: usize) -> Option<StateBuf> {
        self.spare[l].take()
    }

    pub(crate) fn set_pending(&mut self, l: usize, p: LayerPending) {
        self.pending[l] = Some(p);
    }

    /// Keeps the first `j` pending rows (all of them when `j` >= the pending rows). All or
    /// nothing: on an error (a replay the backend could not run) every pending row is dropped and
    /// the state is as before the forward.
    pub fn commit(&mut self, be: &dyn Backend, c: &K3Config, j: usize) -> Result<(), BackendError> {
        let j = j.min(self.pending_rows);
        // The part that can fail first, for every layer: nothing committed changes until it is done.
        for (p, st) in self.pending.iter_mut().zip(&self.layers) {
            if let (Some(LayerPending::Kda(p)), LayerState::Kda(s)) = (p, st)
                && let Err(e) = p.keep_first(be, c, s, j)
            {
                self.rollback();
                return Err(e);
            }
        }
        for l in 0..self.layers.len() {
            match (self.pending[l].take(), &mut self.layers[l]) {
                (Some(LayerPending::Kda(p)), LayerState::Kda(s)) => {
                    self.spare[l] = Some(kda::commit(c, s, p, j));
                }
                (Some(LayerPending::Mla { committed }), LayerState::Mla(m)) => {
                    m.latent.truncate(committed + j * (c.kv_lora + c.qk_rope));
                }
                _ => {}
            }
        }
        self.pos += j;
        self.pending_rows = 0;
        Ok(())
    }

    /// Drops every pending row: the state is as before the forward.
    pub fn rollback(&mut self) {
        for l in 0..self.layers.len() {
            match (self.pending[l].take(), &mut self.layers[l]) {
                (Some(LayerPending::Kda(p)), _) => self.spare[l] = Some(p.into_spare()),
                (Some(LayerPending::Mla { committed }), LayerState::Mla(m)) => m.latent.truncate(committed),
                _ => {}
            }
        }
        self.pending_rows = 0;
    }
}
