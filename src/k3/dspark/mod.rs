//! DSpark: a small block drafter that reads K3's hidden rows (Inferact/Kimi-K3-DSpark layout).
//!
//! Contract: [`DSparkModel::open`] loads `config.json` + `model.safetensors` as published (names
//! and shapes in docs/dspark.md), checks every tensor's dtype and shape against the config and the
//! target, and borrows K3's own embeddings and `lm_head` (the checkpoint's `embed_tokens` copy is
//! never read). The model is shared by all sessions; each drafter (`draft::DSparkDrafter`, the
//! draft-verify policy's side) keeps its own latent cache of context rows. Drafts are proposals only: K3 verifies every one, so nothing here can
//! change the output — only how many drafts are accepted.
//!
//! Context: after each tapped K3 layer the completed row (the AttnRes `prefix` after the FFN) is
//! taken; the taps are concatenated in config order, `ctx = RMSNorm(context_proj(x))`, and every
//! draft layer caches `[kv_a_layernorm(kv_a(ctx)[..lora]), RoPE(kv_a(ctx)[lora..], pos)]`.
//! A draft: one block `[anchor, mask x (block - 1)]` at positions L.. (L = the anchor's position),
//! pre-norm layers (absorbed MLA with YaRN RoPE over the cache plus the block's own rows, no mask;
//! SiLU-gated MLP), `final_norm`, K3's `lm_head`, and the Markov head row by row
//! (`logits[r] += markov_w2 . markov_w1[prev]`, prev = anchor, then the previous row's draft).

pub mod config;
mod forward;
pub mod synth;

pub use config::DSparkConfig;

use crate::backend::{Backend, Bf16Mat};
use crate::k3::weights::{MlpWeights, Weights};
use crate::model::{Checkpoint, K3Config, ModelError};
use safetensors::tensor::Dtype;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Drafting stops past this many tokens of context (the published runtime's limit).
pub const MAX_DRAFT_CONTEXT: usize = 8192;
/// Committed rows whose taps a drafter keeps before it folds them into its latents unasked (it
/// folds them when it drafts; `draft::DSparkDrafter`).
pub const MAX_BACKLOG: usize = 256;

pub struct DSparkLayer {
    pub input_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    pub q_a: Bf16Mat,
    pub q_a_norm: Vec<f32>,
    pub q_b: Bf16Mat,
    pub kv_a: Bf16Mat,
    pub kv_a_norm: Vec<f32>,
    pub kv_b: Bf16Mat,
    pub o_proj: Bf16Mat,
    /// gate/up/down of the SiLU-gated MLP.
    pub mlp: MlpWeights,
}

/// An opened DSpark checkpoint bound to its target.
pub struct DSparkModel {
    pub dir: PathBuf,
    pub cfg: DSparkConfig,
    pub context_proj: Bf16Mat,
    pub context_norm: Vec<f32>,
    pub final_norm: Vec<f32>,
    pub markov_w1: Bf16Mat,
    pub markov_w2: Bf16Mat,
    pub layers: Vec<DSparkLayer>,
    /// K3's, shared.
    pub embed: Bf16Mat,
    pub lm_head: Bf16Mat,
    pub be: Arc<dyn Backend>,
    inv_freq: Vec<f64>,
    rope_mscale: f64,
    _ck: Arc<Checkpoint>,
}

struct Loader<'a> {
    ck: &'a Checkpoint,
    problems: Vec<String>,
}

impl Loader<'_> {
    fn tensor(&mut self, name: &str, shape: &[usize]) -> Option<&crate::model::checkpoint::TensorEntry> {
        let Some(e) = self.ck.get(name) else {
            self.problems.push(format!("missing tensor `{name}`"));
            return None;
        };
        if e.dtype != Dtype::BF16 && e.dtype != Dtype::F32 {
            self.problems.push(format!("tensor `{name}` has dtype {:?}, expected BF16", e.dtype));
            return None;
        }
        let numel: usize = e.shape.iter().product();
        let want: usize = shape.iter().product();
        if e.shape != shape && !(shape.len() == 1 && numel == want) {
            self.problems.push(format!("tensor `{name}` has shape {:?}, expected {shape:?}", e.shape));
            return None;
        }
        Some(e)
    }

    fn mat(&mut self, name: &str, rows: usize, cols: usize) -> Bf16Mat {
        let ck = self.ck;
        match self.tensor(name, &[rows, cols]) {
            Some(e) if e.dtype == Dtype::BF16 => match ck.shared_bytes(e) {
                Ok(b) => Bf16Mat::new(b, rows, cols),
                Err(err) => {
                    self.problems.push(err.to_string());
                    Bf16Mat::from_vec(vec![0; rows * cols * 2], rows, cols)
                }
            },
            Some(_) => {
                self.problems.push(format!("tensor `{name}` is F32, expected BF16 (a matrix)"));
                Bf16Mat::from_vec(vec![0; rows * cols * 2], rows, cols)
            }
            None => Bf16Mat::from_vec(vec![0; rows * cols * 2], rows, cols),
        }
    }

    fn vec(&mut self, name: &str, n: usize) -> Vec<f32> {
        let ck = self.ck;
        match self.tensor(name, &[n]) {
            Some(e) => {
                let b = match ck.shared_bytes(e) {
                    Ok(b) => b,
                    Err(err) => {
                        self.problems.push(err.to_string());
                        return vec![0.0; n];
                    }
                };
                match e.dtype {
                    Dtype::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
                    _ => b.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
                }
            }
            None => vec![0.0; n],
        }
    }
}

impl DSparkModel {
    /// Opens the DSpark checkpoint in `dir` for the target described by `target` / `trunk`.
    pub fn open(dir: &Path, target: &K3Config, trunk: &Weights, be: Arc<dyn Backend>) -> Result<Self, ModelError> {
        if !dir.is_dir() {
            return Err(ModelError::NoCheckpoint { dir: dir.to_path_buf() });
        }
        let cfg = DSparkConfig::load(dir, target)?;
        let ck = Arc::new(Checkpoint::open(dir)?);
        let c = &cfg;
        let (h, nh) = (c.hidden, c.heads);
        let mut ld = Loader { ck: &ck, problems: Vec::new() };
        let context_proj = ld.mat("context_proj.weight", h, c.context_width());
        let context_norm = ld.vec("context_norm.weight", h);
        let final_norm = ld.vec("final_norm.weight", h);
        let markov_w1 = ld.mat("markov_head.markov_w1.weight", c.vocab, c.markov_rank);
        let markov_w2 = ld.mat("markov_head.markov_w2.weight", c.vocab, c.markov_rank);
        let mut layers = Vec::with_capacity(c.layers);
        for l in 0..c.layers {
            let n = |s: &str| format!("layers.{l}.{s}");
            layers.push(DSparkLayer {
                input_norm: ld.vec(&n("input_layernorm.weight"), h),
                post_norm: ld.vec(&n("post_attention_layernorm.weight"), h),
                q_a: ld.mat(&n("self_attn.q_a_proj.weight"), c.q_lora, h),
                q_a_norm: ld.vec(&n("self_attn.q_a_layernorm.weight"), c.q_lora),
                q_b: ld.mat(&n("self_attn.q_b_proj.weight"), nh * (c.nope + c.rope), c.q_lora),
                kv_a: ld.mat(&n("self_attn.kv_a_proj_with_mqa.weight"), c.kv_lora + c.rope, h),
                kv_a_norm: ld.vec(&n("self_attn.kv_a_layernorm.weight"), c.kv_lora),
                kv_b: ld.mat(&n("self_attn.kv_b_proj.weight"), nh * (c.nope + c.v_head), c.kv_lora),
                o_proj: ld.mat(&n("self_attn.o_proj.weight"), h, nh * c.v_head),
                mlp: MlpWeights {
                    gate: ld.mat(&n("mlp.gate_proj.weight"), c.intermediate, h),
                    up: ld.mat(&n("mlp.up_proj.weight"), c.intermediate, h),
                    down: ld.mat(&n("mlp.down_proj.weight"), h, c.intermediate),
                },
            });
        }
        // Tensors the runtime does not use but the published layout has: shape-checked only when
        // present (a checkpoint without them still drafts).
        for (name, shape) in
            [("confidence_head.proj.weight", vec![1, h + c.markov_rank]), ("embed_tokens.weight", vec![c.vocab, h])]
        {
            if ck.get(name).is_some() {
                ld.tensor(name, &shape);
            }
        }
        let known = |name: &str| {
            name.starts_with("layers.")
                || name.starts_with("markov_head.")
                || name.starts_with("confidence_head.")
                || matches!(
                    name,
                    "context_proj.weight" | "context_norm.weight" | "final_norm.weight" | "embed_tokens.weight"
                )
        };
        let mut unknown: Vec<&str> = ck.tensor_names().filter(|n| !known(n)).collect();
        unknown.sort_unstable();
        if let Some(u) = unknown.first() {
            ld.problems.push(format!("unexpected tensor `{u}` (and {} more)", unknown.len() - 1));
        }
        if let Some(bad) = ck.tensor_names().find(|n| {
            n.strip_prefix("layers.")
                .and_then(|r| r.split('.').next())
                .and_then(|i| i.parse::<usize>().ok())
                .is_some_and(|i| i >= c.layers)
        }) {
            ld.problems.push(format!("tensor `{bad}` is past num_hidden_layers {}", c.layers));
        }
        if !ld.problems.is_empty() {
            return Err(ModelError::Roster { dir: dir.to_path_buf(), problems: ld.problems });
        }
        Ok(DSparkModel {
            dir: dir.to_path_buf(),
            inv_freq: cfg.inv_freq(),
            rope_mscale: cfg.rope_mscale(),
            context_proj,
            context_norm,
            final_norm,
            markov_w1,
            markov_w2,
            layers,
            embed: trunk.embed.clone(),
            lm_head: trunk.lm_head.clone(),
            be,
            _ck: Arc::clone(&ck),
            cfg,
        })
    }

    /// Bytes of the drafter's own weights that a draft touches (K3's embeddings and lm_head are
    /// the target's; the checkpoint's embedding copy is never read).
    pub fn weight_bytes(&self) -> u64 {
        let m = |m: &Bf16Mat| m.byte_len() as u64;
        let v = |v: &Vec<f32>| (v.len() * 4) as u64;
        let mut total = m(&self.context_proj)
            + v(&self.context_norm)
            + v(&self.final_norm)
            + m(&self.markov_w1)
            + m(&self.markov_w2);
        for l in &self.layers {
            total += [&l.q_a, &l.q_b, &l.kv_a, &l.kv_b, &l.o_proj, &l.mlp.gate, &l.mlp.up, &l.mlp.down]
                .iter()
                .map(|x| m(x))
                .sum::<u64>()
                + v(&l.input_norm)
                + v(&l.post_norm)
                + v(&l.q_a_norm)
                + v(&l.kv_a_norm);
        }
        total
    }

    /// Bytes of one session's latent cache at the drafting limit, with its backlog of taps not
    /// folded yet.
    pub fn cache_bytes(&self) -> u64 {
        (MAX_DRAFT_CONTEXT * self.cfg.layers * self.cfg.latent_width() * 4 + MAX_BACKLOG * self.cfg.context_width() * 4)
            as u64
    }

    /// "dspark 2 layers, 3 taps [0, 2, 4], block 7, 1.2 MiB weights + 0.5 MiB cache per session"
    pub fn describe(&self) -> String {
        format!(
            "dspark {} ({} layers, taps {:?}, block {}), {} weights + {} cache per session",
            self.dir.display(),
            self.cfg.layers,
            self.cfg.target_layers,
            self.cfg.block,
            crate::util::human_bytes(self.weight_bytes()),
            crate::util::human_bytes(self.cache_bytes())
        )
    }
}
