//! The DSpark checkpoint's `config.json` (`model_type: k3_dspark`), validated against its target.
//!
//! Contract: [`DSparkConfig::load`] accepts the published field names (extra fields are ignored,
//! as Hugging Face configs carry many), checks every size the drafter relies on and that the
//! drafter fits the target it drafts for (hidden size, vocabulary, tapped layers); any problem is a
//! [`ModelError::Config`] naming the file and the field.

use crate::model::{K3Config, ModelError};
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// Where the target's hidden rows are taken for the drafter's context.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum TapPoint {
    /// The AttnRes running `prefix` after the layer's FFN was added (the published runtimes).
    #[default]
    Prefix,
}

/// YaRN RoPE scaling (DeepSeek's form: the inverse frequencies blend interpolated and
/// extrapolated ones over a ramp between the correction dimensions).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub mscale: f64,
    pub mscale_all_dim: f64,
}

impl Yarn {
    /// yarn_get_mscale: 0.1 * m * ln(factor) + 1 (1 when factor <= 1).
    pub fn get_mscale(factor: f64, m: f64) -> f64 {
        if factor <= 1.0 { 1.0 } else { 0.1 * m * factor.ln() + 1.0 }
    }
}

#[derive(Clone, Debug)]
pub struct DSparkConfig {
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub q_lora: usize,
    pub kv_lora: usize,
    pub nope: usize,
    pub rope: usize,
    pub v_head: usize,
    pub rms_eps: f32,
    /// Target layers (0-based) whose rows form the context, in concatenation order.
    pub target_layers: Vec<usize>,
    pub target_hidden: usize,
    pub mask_token: u32,
    pub markov_rank: usize,
    pub vocab: usize,
    /// Rows of one draft block: the anchor and `block - 1` mask tokens (drafts at most `block`).
    pub block: usize,
    pub rope_theta: f64,
    pub yarn: Option<Yarn>,
    pub logit_scale: f32,
    pub tap: TapPoint,
}

#[derive(Deserialize)]
struct RawScaling {
    #[serde(rename = "type", alias = "rope_type")]
    kind: Option<String>,
    factor: Option<f64>,
    original_max_position_embeddings: Option<f64>,
    beta_fast: Option<f64>,
    beta_slow: Option<f64>,
    mscale: Option<f64>,
    mscale_all_dim: Option<f64>,
}

#[derive(Deserialize)]
struct Raw {
    model_type: Option<String>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    q_lora_rank: Option<usize>,
    kv_lora_rank: Option<usize>,
    qk_nope_head_dim: Option<usize>,
    qk_rope_head_dim: Option<usize>,
    v_head_dim: Option<usize>,
    mla_use_nope: Option<bool>,
    rms_norm_eps: Option<f64>,
    target_layer_ids: Option<Vec<usize>>,
    target_hidden_size: Option<usize>,
    num_target_layers: Option<usize>,
    mask_token_id: Option<u32>,
    markov_rank: Option<usize>,
    vocab_size: Option<usize>,
    draft_vocab_size: Option<usize>,
    block_size: Option<usize>,
    rope_theta: Option<f64>,
    rope_scaling: Option<RawScaling>,
    hidden_act: Option<String>,
    logit_scale: Option<f64>,
    /// deltafin's own key for the open question of where to tap (K3.md); default `prefix`.
    deltafin_tap: Option<TapPoint>,
}

/// Largest block a drafter may use (the published width maximum is 7).
pub const MAX_BLOCK: usize = 16;

impl DSparkConfig {
    /// Reads `dir/config.json` and checks it against the target's config.
    pub fn load(dir: &Path, target: &K3Config) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io { path: path.clone(), source })?;
        let raw: Raw = serde_json::from_str(&text).map_err(|source| ModelError::Json { path: path.clone(), source })?;
        Self::from_raw(raw, &path, target)
    }

    /// Parses a config text (for tests and fuzzing) as if read from `path`.
    pub fn parse(path: &Path, text: &str, target: &K3Config) -> Result<Self, ModelError> {
        let raw: Raw =
            serde_json::from_str(text).map_err(|source| ModelError::Json { path: path.to_path_buf(), source })?;
        Self::from_raw(raw, path, target)
    }

    fn from_raw(r: Raw, path: &Path, t: &K3Config) -> Result<Self, ModelError> {
        let err = |field: &str, msg: String| ModelError::Config { path: PathBuf::from(path), field: field.into(), msg };
        let need = |v: Option<usize>, field: &str| -> Result<usize, ModelError> {
            match v {
                Some(0) => Err(err(field, "must be positive".into())),
                Some(x) if x > 1 << 24 => Err(err(field, format!("{x} is implausibly large"))),
                Some(x) => Ok(x),
                None => Err(err(field, "missing".into())),
            }
        };
        match r.model_type.as_deref() {
            Some("k3_dspark") => {}
            other => return Err(err("model_type", format!("expected \"k3_dspark\", found {other:?}"))),
        }
        if let Some(act) = r.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(err("hidden_act", format!("\"{act}\" is not supported (the DSpark MLP is SiLU-gated)")));
        }
        if r.mla_use_nope == Some(true) {
            return Err(err("mla_use_nope", "true is not supported: DSpark's MLA rotates its rope dims".into()));
        }
        let hidden = need(r.hidden_size, "hidden_size")?;
        let c = DSparkConfig {
            hidden,
            intermediate: need(r.intermediate_size, "intermediate_size")?,
            layers: need(r.num_hidden_layers, "num_hidden_layers")?,
            heads: need(r.num_attention_heads, "num_attention_heads")?,
            q_lora: need(r.q_lora_rank, "q_lora_rank")?,
            kv_lora: need(r.kv_lora_rank, "kv_lora_rank")?,
            nope: need(r.qk_nope_head_dim, "qk_nope_head_dim")?,
            rope: need(r.qk_rope_head_dim, "qk_rope_head_dim")?,
            v_head: need(r.v_head_dim, "v_head_dim")?,
            rms_eps: r.rms_norm_eps.unwrap_or(1e-5) as f32,
            target_layers: r.target_layer_ids.clone().ok_or_else(|| err("target_layer_ids", "missing".into()))?,
            target_hidden: r.target_hidden_size.unwrap_or(t.hidden),
            mask_token: r.mask_token_id.ok_or_else(|| err("mask_token_id", "missing".into()))?,
            markov_rank: need(r.markov_rank, "markov_rank")?,
            vocab: r.vocab_size.unwrap_or(t.vocab),
            block: r.block_size.unwrap_or(7),
            rope_theta: r.rope_theta.unwrap_or(10_000.0),
            yarn: None,
            logit_scale: r.logit_scale.unwrap_or(1.0) as f32,
            tap: r.deltafin_tap.unwrap_or_default(),
        };
        let c = DSparkConfig { yarn: yarn(r.rope_scaling.as_ref(), &err)?, ..c };
        if !(c.rms_eps.is_finite() && c.rms_eps > 0.0) {
            return Err(err("rms_norm_eps", "must be a positive number".into()));
        }
        if !(c.rope_theta.is_finite() && c.rope_theta > 1.0) {
            return Err(err("rope_theta", "must be a number > 1".into()));
        }
        if !c.rope.is_multiple_of(2) {
            return Err(err("qk_rope_head_dim", format!("{} is odd: RoPE rotates pairs", c.rope)));
        }
        if !(2..=MAX_BLOCK).contains(&c.block) {
            return Err(err("block_size", format!("{} is outside 2..={MAX_BLOCK}", c.block)));
        }
        // The drafter uses the target's embeddings and lm_head.
        if c.hidden != t.hidden {
            return Err(err(
                "hidden_size",
                format!("{} differs from the target's hidden size {}: DSpark uses K3's embeddings", c.hidden, t.hidden),
            ));
        }
        if c.target_hidden != t.hidden {
            return Err(err(
                "target_hidden_size",
                format!("{} differs from the target's hidden size {}", c.target_hidden, t.hidden),
            ));
        }
        if c.vocab != t.vocab {
            return Err(err("vocab_size", format!("{} differs from the target's vocabulary {}", c.vocab, t.vocab)));
        }
        if let Some(d) = r.draft_vocab_size.filter(|d| *d != c.vocab) {
            return Err(err("draft_vocab_size", format!("{d}: a reduced draft vocabulary is not supported")));
        }
        if c.mask_token as usize >= c.vocab {
            return Err(err("mask_token_id", format!("{} is outside the vocabulary of {}", c.mask_token, c.vocab)));
        }
        if c.target_layers.is_empty() {
            return Err(err("target_layer_ids", "is empty".into()));
        }
        if let Some(&l) = c.target_layers.iter().find(|&&l| l >= t.layers) {
            return Err(err(
                "target_layer_ids",
                format!("layer {l} does not exist: the target has {} layers", t.layers),
            ));
        }
        if let Some(n) = r.num_target_layers.filter(|n| *n != c.target_layers.len()) {
            return Err(err(
                "num_target_layers",
                format!("{n} differs from the {} entries of target_layer_ids", c.target_layers.len()),
            ));
        }
        Ok(c)
    }

    /// Softmax scale: (nope + rope)^-1/2, times mscale^2 under YaRN.
    pub fn softmax_scale(&self) -> f64 {
        let base = 1.0 / ((self.nope + self.rope) as f64).sqrt();
        match &self.yarn {
            Some(y) => {
                let m = Yarn::get_mscale(y.factor, y.mscale_all_dim);
                base * m * m
            }
            None => base,
        }
    }

    /// Inverse frequency of each rotated pair (`rope / 2` of them).
    pub fn inv_freq(&self) -> Vec<f64> {
        let d = self.rope as f64;
        let half = self.rope / 2;
        let extra: Vec<f64> = (0..half).map(|i| 1.0 / self.rope_theta.powf(2.0 * i as f64 / d)).collect();
        let Some(y) = &self.yarn else { return extra };
        let correction_dim = |rot: f64| {
            d * (y.original_max_position / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * self.rope_theta.ln())
        };
        let low = correction_dim(y.beta_fast).floor().max(0.0);
        let high = correction_dim(y.beta_slow).ceil().min(d - 1.0);
        let high = if low == high { high + 0.001 } else { high };
        (0..half)
            .map(|i| {
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                let extrapolate = 1.0 - ramp;
                extra[i] / y.factor * (1.0 - extrapolate) + extra[i] * extrapolate
            })
            .collect()
    }

    /// Multiplier of cos/sin (1 when mscale equals mscale_all_dim, as published).
    pub fn rope_mscale(&self) -> f64 {
        self.yarn.map_or(1.0, |y| Yarn::get_mscale(y.factor, y.mscale) / Yarn::get_mscale(y.factor, y.mscale_all_dim))
    }

    /// Width of the context rows (the tapped layers' rows concatenated).
    pub fn context_width(&self) -> usize {
        self.target_layers.len() * self.target_hidden
    }

    /// Floats of the latent cache per context row and layer.
    pub fn latent_width(&self) -> usize {
        self.kv_lora + self.rope
    }
}

fn yarn(s: Option<&RawScaling>, err: &dyn Fn(&str, String) -> ModelError) -> Result<Option<Yarn>, ModelError> {
    let Some(s) = s else { return Ok(None) };
    match s.kind.as_deref() {
        Some("yarn") => {}
        other => return Err(err("rope_scaling.type", format!("expected \"yarn\", found {other:?}"))),
    }
    let pos = |v: Option<f64>, f: &str, default: Option<f64>| -> Result<f64, ModelError> {
        match v.or(default) {
            Some(x) if x.is_finite() && x > 0.0 => Ok(x),
            Some(x) => Err(err(&format!("rope_scaling.{f}"), format!("{x} must be a positive number"))),
            None => Err(err(&format!("rope_scaling.{f}"), "missing".into())),
        }
    };
    Ok(Some(Yarn {
        factor: pos(s.factor, "factor", None)?,
        original_max_position: pos(s.original_max_position_embeddings, "original_max_position_embeddings", None)?,
        beta_fast: pos(s.beta_fast, "beta_fast", Some(32.0))?,
        beta_slow: pos(s.beta_slow, "beta_slow", Some(1.0))?,
        mscale: pos(s.mscale, "mscale", Some(1.0))?,
        mscale_all_dim: pos(s.mscale_all_dim, "mscale_all_dim", Some(1.0))?,
    }))
}
