//! `deltafin synth --dspark`: a random-weight DSpark checkpoint for a given target, in the
//! published layout (config.json + one model.safetensors), for tests and benchmarks.
//!
//! Contract: the output is a pure function of (target config, spec); it appears only when
//! complete (written to a temporary sibling, fsynced, renamed); `force` replaces only a directory
//! this command wrote.

use crate::model::K3Config;
use crate::model::synth::{Fill, SynthError, TensorPlan, is_synthetic, write_safetensors};
use serde_json::json;
use std::path::Path;

/// Shape of a synthetic drafter (the published one: 5 layers, 64 heads, hidden = K3's).
#[derive(Clone, Debug, serde::Serialize)]
pub struct DSparkSynthSpec {
    pub layers: usize,
    pub heads: usize,
    pub q_lora: usize,
    pub kv_lora: usize,
    pub nope: usize,
    pub rope: usize,
    pub v_head: usize,
    pub intermediate: usize,
    pub markov_rank: usize,
    pub block: usize,
    /// Target layers tapped (default: K3's [2, 23, 47, 71, 89] of 93 scaled to the target).
    pub taps: Vec<usize>,
    pub seed: u64,
}

impl DSparkSynthSpec {
    /// A small drafter for `target`.
    pub fn for_target(target: &K3Config) -> Self {
        let last = target.layers.saturating_sub(1);
        let mut taps: Vec<usize> = [2usize, 23, 47, 71, 89].iter().map(|l| (l * last + 46) / 92).collect();
        taps.dedup();
        DSparkSynthSpec {
            layers: 2,
            heads: 4,
            q_lora: 64,
            kv_lora: 64,
            nope: 32,
            rope: 16,
            v_head: 32,
            intermediate: 2 * target.hidden,
            markov_rank: 32,
            block: 7,
            taps,
            seed: 7,
        }
    }

    /// config.json as published (`model_type: k3_dspark`), plus deltafin's random-weights marker.
    pub fn config_json(&self, target: &K3Config) -> serde_json::Value {
        json!({
            "model_type": "k3_dspark",
            "architectures": ["K3DSparkModel"],
            "hidden_size": target.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "q_lora_rank": self.q_lora,
            "kv_lora_rank": self.kv_lora,
            "qk_nope_head_dim": self.nope,
            "qk_rope_head_dim": self.rope,
            "v_head_dim": self.v_head,
            "mla_use_nope": false,
            "mla_use_output_gate": false,
            "rms_norm_eps": 1e-5,
            "vocab_size": target.vocab,
            "target_hidden_size": target.hidden,
            "target_layer_ids": self.taps,
            "num_target_layers": self.taps.len(),
            "mask_token_id": target.vocab - 3,
            "markov_rank": self.markov_rank,
            "enable_confidence_head": true,
            "block_size": self.block,
            "rope_theta": 50000.0,
            "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 32768,
                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
            "deltafin_synth": {"random_weights": true, "spec": self},
        })
    }

    fn tensors(&self, h: usize, vocab: usize) -> Vec<TensorPlan> {
        let lin = |name: String, o: usize, i: usize| {
            TensorPlan::bf16(name, vec![o, i], Fill::Uniform(1.0 / (i as f32).sqrt()))
        };
        let norm = |name: String, n: usize| TensorPlan::bf16(name, vec![n], Fill::Norm);
        let mut t = vec![
            lin("context_proj.weight".into(), h, h * self.taps.len()),
            norm("context_norm.weight".into(), h),
            norm("final_norm.weight".into(), h),
            TensorPlan::bf16("markov_head.markov_w1.weight".into(), vec![vocab, self.markov_rank], Fill::Uniform(1.0)),
            lin("markov_head.markov_w2.weight".into(), vocab, self.markov_rank),
            lin("confidence_head.proj.weight".into(), 1, h + self.markov_rank),
            TensorPlan::bf16("confidence_head.proj.bias".into(), vec![1], Fill::Uniform(0.1)),
        ];
        let nh = self.heads;
        for l in 0..self.layers {
            let n = |s: &str| format!("layers.{l}.{s}");
            t.extend([
                norm(n("input_layernorm.weight"), h),
                norm(n("post_attention_layernorm.weight"), h),
                lin(n("self_attn.q_a_proj.weight"), self.q_lora, h),
                norm(n("self_attn.q_a_layernorm.weight"), self.q_lora),
                lin(n("self_attn.q_b_proj.weight"), nh * (self.nope + self.rope), self.q_lora),
                lin(n("self_attn.kv_a_proj_with_mqa.weight"), self.kv_lora + self.rope, h),
                norm(n("self_attn.kv_a_layernorm.weight"), self.kv_lora),
                lin(n("self_attn.kv_b_proj.weight"), nh * (self.nope + self.v_head), self.kv_lora),
                lin(n("self_attn.o_proj.weight"), h, nh * self.v_head),
                lin(n("mlp.gate_proj.weight"), self.intermediate, h),
                lin(n("mlp.up_proj.weight"), self.intermediate, h),
                lin(n("mlp.down_proj.weight"), h, self.intermediate),
            ]);
        }
        t
    }

    /// Bytes of all tensors.
    pub fn total_bytes(&self, target: &K3Config) -> u64 {
        self.tensors(target.hidden, target.vocab).iter().map(|t| t.bytes()).sum()
    }

    fn validate(&self, target: &K3Config) -> Result<(), SynthError> {
        let bad = |m: String| Err(SynthError::Spec(m));
        if self.taps.is_empty() {
            return bad("a DSpark drafter taps at least one target layer".into());
        }
        if let Some(l) = self.taps.iter().find(|&&l| l >= target.layers) {
            return bad(format!("tap layer {l} does not exist: the target has {} layers", target.layers));
        }
        if !self.rope.is_multiple_of(2) {
            return bad(format!("rope dims {} must be even", self.rope));
        }
        if target.vocab < 4 {
            return bad("the target's vocabulary is too small for a mask token".into());
        }
        Ok(())
    }
}

/// Writes the drafter for `target` into `out`.
pub fn write(
    spec: &DSparkSynthSpec,
    target: &K3Config,
    out: &Path,
    force: bool,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<(), SynthError> {
    spec.validate(target)?;
    let exists = std::fs::symlink_metadata(out).is_ok();
    if exists && !force {
        return Err(SynthError::Exists(out.to_path_buf()));
    }
    if exists && !is_synthetic(out) {
        return Err(SynthError::NotReplaceable {
            path: out.to_path_buf(),
            why: "its config.json is not a synthetic model's; delete it yourself if it should go".into(),
        });
    }
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| SynthError::Io { path: path.clone(), source }
    };
    let name = out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "dspark".into());
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(io(parent))?;
    let tmp = parent.join(format!(".{name}.synth-tmp-{}", std::process::id()));
    let result = (|| {
        std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
        let cfg = tmp.join("config.json");
        let body = serde_json::to_string_pretty(&spec.config_json(target)).unwrap_or_default();
        std::fs::write(&cfg, body).map_err(io(&cfg))?;
        let mut tensors = spec.tensors(target.hidden, target.vocab);
        let total = tensors.iter().map(|t| t.bytes()).sum();
        let mut done = 0;
        write_safetensors(&tmp.join("model.safetensors"), &mut tensors, spec.seed, &mut done, total, progress)?;
        if exists {
            std::fs::remove_dir_all(out).map_err(io(out))?;
        }
        std::fs::rename(&tmp, out).map_err(io(out))
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}
