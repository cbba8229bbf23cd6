//! The K3 forward pass over a batch of rows of one sequence, layer by layer.
//!
//! Contract: `forward` consumes `tokens` after the `SeqState`'s current position and returns
//! logits for the requested rows. Every row passes layer L (attention, then the MoE with one
//! fetch of the layer's expert union) before any row enters layer L+1. Results are independent of
//! how the tokens are split into calls (prefill + decode == full recompute, to rounding of the
//! KDA chunked form), of thread count and of expert arrival order.

pub mod attn_res;
pub mod kda;
pub mod mla;
pub mod moe;
pub mod state;
pub mod weights;

use crate::cpu::matmul_bf16;
use crate::cpu::ops::{Situ, rms_norm_inplace};
use crate::model::{Checkpoint, K3Config, ModelError, Roster};
use crate::store::{ExpertSource, StoreError};
use attn_res::Residual;
pub use kda::KdaMode;
pub use state::SeqState;
use std::time::Instant;
use weights::{Attn, Ffn, Weights};

#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("token id {id} at position {pos} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange { id: u32, pos: usize, vocab: usize },
    #[error("context is full: {have} + {new} tokens exceeds the model's {max}")]
    ContextFull { have: usize, new: usize, max: usize },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Which rows get logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last row (generation).
    Last,
    /// Every row (scoring).
    All,
}

pub use crate::stats::Stats as ForwardStats;

pub struct K3<'a> {
    pub cfg: K3Config,
    pub w: Weights<'a>,
    pub experts: Option<&'a dyn ExpertSource>,
    pub kda_mode: KdaMode,
    /// Predict and prefetch the next MoE layer's experts (see `moe::Lookahead`).
    pub prefetch: bool,
}

impl<'a> K3<'a> {
    /// Builds the model from a checked checkpoint; `experts` must be given when there are MoE layers.
    pub fn new(
        cfg: K3Config,
        ck: &'a Checkpoint,
        _roster: &Roster,
        experts: Option<&'a dyn ExpertSource>,
    ) -> Result<Self, ModelError> {
        let w = Weights::load(&cfg, ck)?;
        Ok(K3 { cfg, w, experts, kda_mode: KdaMode::Auto, prefetch: false })
    }

    /// The next MoE layer after `l` and its weights.
    fn next_moe(&self, l: usize) -> Option<(usize, &weights::MoeWeights<'a>)> {
        self.w.layers.iter().enumerate().skip(l + 1).find_map(|(i, lw)| match &lw.ffn {
            Ffn::Moe(w) => Some((i, w)),
            Ffn::Dense(_) => None,
        })
    }

    pub fn new_state(&self) -> SeqState {
        SeqState::new(&self.cfg)
    }

    /// Runs `tokens` through the model after `st`'s position; returns logits [rows, vocab].
    pub fn forward(
        &self,
        st: &mut SeqState,
        tokens: &[u32],
        which: Logits,
        stats: &mut ForwardStats,
    ) -> Result<Vec<f32>, ForwardError> {
        let c = &self.cfg;
        let h = c.hidden;
        let n = tokens.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        if st.pos + n > c.max_context {
            return Err(ForwardError::ContextFull { have: st.pos, new: n, max: c.max_context });
        }
        let t_start = Instant::now();
        let moe_before = stats.router_s + stats.expert_kernel_s + stats.read_wait_s;
        let mut embeds = vec![0f32; n * h];
        for (i, &id) in tokens.iter().enumerate() {
            if id as usize >= c.vocab {
                return Err(ForwardError::TokenOutOfRange { id, pos: st.pos + i, vocab: c.vocab });
            }
            crate::cpu::decode_bf16_row(self.w.embed.row(id as usize), &mut embeds[i * h..(i + 1) * h]);
        }
        let situ = Situ { beta: c.situ_beta, linear_beta: c.situ_linear_beta };
        let mut res = Residual::new(embeds, h);
        let mut attn_s = 0f64;
        let mut predicted: Option<Vec<u32>> = None;
        for (l, lw) in self.w.layers.iter().enumerate() {
            let t0 = Instant::now();
            let mut x = res.mixed(&lw.attn_res_score, c.rms_eps);
            if l % c.attn_res_block == 0 {
                res.push_block();
            }
            for r in x.chunks_exact_mut(h) {
                rms_norm_inplace(r, &lw.input_norm, c.rms_eps);
            }
            let a = match (&lw.attn, &mut st.layers[l]) {
                (Attn::Kda(w), state::LayerState::Kda(s)) => kda::forward(c, w, s, &x, self.kda_mode),
                (Attn::Mla(w), state::LayerState::Mla(s)) => mla::forward(c, w, s, &x),
                _ => unreachable!("state layout follows the config"),
            };
            res.add(a);
            let mut x = res.mixed(&lw.mlp_res_score, c.rms_eps);
            for r in x.chunks_exact_mut(h) {
                rms_norm_inplace(r, &lw.post_attn_norm, c.rms_eps);
            }
            attn_s += t0.elapsed().as_secs_f64();
            let f = match &lw.ffn {
                Ffn::Dense(w) => {
                    let t1 = Instant::now();
                    let out = moe::mlp(w, situ, &x);
                    attn_s += t1.elapsed().as_secs_f64();
                    out
                }
                Ffn::Moe(w) => {
                    let src = self.experts.ok_or(StoreError::NoHolder { layer: l, expert: 0 })?;
                    let next = if self.prefetch { self.next_moe(l) } else { None };
                    let look = moe::Lookahead { predicted_here: predicted.as_deref(), next };
                    let (out, pred) = moe::forward(c, w, l, src, &x, stats, look)?;
                    predicted = pred;
                    out
                }
            };
            res.add(f);
        }
        let out = res.mixed(&self.w.output_res_score, c.rms_eps);
        let rows: Vec<usize> = match which {
            Logits::Last => vec![n - 1],
            Logits::All => (0..n).collect(),
        };
        let mut xs = Vec::with_capacity(rows.len() * h);
        for &r in &rows {
            let mut row = out[r * h..(r + 1) * h].to_vec();
            rms_norm_inplace(&mut row, &self.w.final_norm, c.rms_eps);
            xs.extend_from_slice(&row);
        }
        let mut logits = vec![0f32; rows.len() * c.vocab];
        matmul_bf16(&self.w.lm_head, &xs, &mut logits);
        if c.logit_scale != 1.0 {
            logits.iter_mut().for_each(|x| *x *= c.logit_scale);
        }
        st.pos += n;
        stats.forward_calls += 1;
        stats.rows += n as u64;
        stats.attention_s += attn_s;
        let moe_s = stats.router_s + stats.expert_kernel_s + stats.read_wait_s - moe_before;
        stats.other_s += (t_start.elapsed().as_secs_f64() - attn_s - moe_s).max(0.0);
        Ok(logits)
    }
}

impl K3<'_> {
    /// Runs a prompt expert-major in chunks of at most `rows` rows: each chunk passes every layer
    /// (attention for all its rows, then one read of the layer's expert union) before the next
    /// chunk starts. Returns the last row's logits. With `rows` >= the prompt, `layer_passes`
    /// grows by exactly the number of MoE layers.
    pub fn prefill(
        &self,
        st: &mut SeqState,
        tokens: &[u32],
        rows: usize,
        stats: &mut ForwardStats,
    ) -> Result<Vec<f32>, ForwardError> {
        let mut logits = Vec::new();
        for chunk in tokens.chunks(rows.max(1)) {
            logits = self.forward(st, chunk, Logits::Last, stats)?;
        }
        Ok(logits)
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
