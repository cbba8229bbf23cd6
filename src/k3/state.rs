//! Per-sequence state that makes decode incremental: for each KDA layer the recurrent state
//! S [heads, dk, dv] and the causal-conv tail (the last width-1 projected rows of q, k, v); for each
//! MLA layer the latent cache [RMSNorm(c), k_pe] per token. AttnRes block snapshots are per-token
//! activations of one pass (a token mixes only its own snapshots), so they are not kept here.

use crate::model::K3Config;
use crate::model::config::AttnKind;

pub struct KdaState {
    /// [heads][dk][dv], row i of a head = key channel i.
    pub s: Vec<f32>,
    /// Conv tails for q, k, v: each [width-1][P], oldest row first (zeros before the sequence).
    pub tail: [Vec<f32>; 3],
}

pub struct MlaState {
    /// [tokens][kv_lora + rope]: the normalised latent then the shared key part.
    pub latent: Vec<f32>,
}

pub enum LayerState {
    Kda(KdaState),
    Mla(MlaState),
}

pub struct SeqState {
    /// Tokens consumed so far.
    pub pos: usize,
    pub layers: Vec<LayerState>,
}

impl SeqState {
    pub fn new(c: &K3Config) -> Self {
        let layers = c
            .attn
            .iter()
            .map(|a| match a {
                AttnKind::Kda => LayerState::Kda(KdaState {
                    s: vec![0.0; c.kda_heads * c.kda_head_dim * c.kda_head_dim],
                    tail: std::array::from_fn(|_| vec![0.0; (c.conv_width - 1) * c.kda_dim()]),
                }),
                AttnKind::Mla => LayerState::Mla(MlaState { latent: Vec::new() }),
            })
            .collect();
        SeqState { pos: 0, layers }
    }

    /// Bytes of fixed state (KDA) plus bytes per cached token (MLA latents).
    pub fn footprint(c: &K3Config) -> (usize, usize) {
        let kda = c.attn.iter().filter(|a| **a == AttnKind::Kda).count();
        let mla = c.layers - kda;
        let fixed = kda * 4 * (c.kda_heads * c.kda_head_dim * c.kda_head_dim + 3 * (c.conv_width - 1) * c.kda_dim());
        let per_token = mla * 4 * (c.kv_lora + c.qk_rope);
        (fixed, per_token)
    }
}
