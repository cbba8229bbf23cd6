//! Synthetic checkpoints in the exact shipped layout: random weights of any size (up to real K3
//! expert dimensions), nested config.json with a compressed-tensors MXFP4 quantization_config,
//! `language_model.`-prefixed safetensors shards + index, MXFP4 experts as
//! weight_packed/weight_scale, and a working tokenizer (tiktoken.model, tokenizer_config.json,
//! chat_template.jinja). Used by the demo and by benchmarks that must exceed RAM.
//!
//! Contract: the output directory appears only when complete (written to a temporary sibling and
//! renamed); content is a pure function of the spec (seeded per tensor and chunk, independent of
//! thread count); writing streams in chunks, so memory use does not grow with the model. A cancel
//! request (`util::request_cancel`, the CLI's Ctrl-C) stops the writing at its next chunk and the
//! temporary directory is removed ([`SynthError::Interrupted`]).

//!
//! Here: the spec (presets, validation, config.json) and writing a model directory; the tensors
//! and the safetensors writer are in `tensors.rs`.

use super::bpe_train::{TRAINING_TEXT, rank_file, train_ranks};
use super::tokenizer::{NUM_SPECIALS, k3_tokenizer_config};
use crate::setting::Setting;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

mod tensors;

pub(crate) use tensors::{Fill, TensorPlan, write_safetensors};

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("invalid synth settings: {0}")]
    Spec(String),
    /// A setting outside the range the spec allows (`expected` says what it allows).
    #[error("invalid synth settings: {setting} {value}: {expected}")]
    Setting { setting: Setting, value: usize, expected: String },
    #[error("{} already exists (use {} to replace it)", .0.display(), Setting::Force)]
    Exists(PathBuf),
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{} replaces only a model synth wrote, and {}: {why}", Setting::Force, path.display())]
    NotReplaceable { path: PathBuf, why: String },
    #[error("drawing trunk values from {}: {msg}", path.display())]
    Trained { path: PathBuf, msg: String },
    #[error("{} has {} free but the model needs {}", dir.display(), crate::util::human_bytes(*have), crate::util::human_bytes(*need))]
    NoSpace { dir: PathBuf, have: u64, need: u64 },
    /// Stopped at the user's request (`util::request_cancel`, Ctrl-C); nothing is left behind.
    #[error("interrupted: the partly written model was removed")]
    Interrupted,
}

/// Marker synth writes last into every model: the names of the files it wrote, so that `--force`
/// can tell its own output (safe to replace) from a directory holding anything else.
pub const MARKER: &str = ".deltafin-synth.json";
/// Files deltafin itself adds to a model directory later (placement); replacing them is fine.
const ADDED_LATER: [&str; 4] =
    ["placement.json", ".placement-plan.json", ".place.lock", crate::model::checksums::SIDECAR];
/// The files of a synth output from before the marker existed.
const LEGACY_FILES: [&str; 5] =
    ["config.json", "tiktoken.model", "tokenizer_config.json", "chat_template.jinja", "model.safetensors.index.json"];
/// Name stems of temporaries an interrupted synth leaves beside its output.
const TEMP_STEMS: [&str; 2] = [".synth-tmp-", ".synth-old-"];

/// Refuses to replace `out` unless it is a directory synth wrote holding nothing synth (or place)
/// did not write.
fn check_replaceable(out: &Path) -> Result<(), SynthError> {
    let refuse = |why: String| Err(SynthError::NotReplaceable { path: out.to_path_buf(), why });
    match std::fs::symlink_metadata(out) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return refuse("it is not a directory".into()),
        Err(source) => return Err(SynthError::Io { path: out.to_path_buf(), source }),
    }
    let marked = std::fs::read_to_string(out.join(MARKER))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|v| v["files"].as_array().map(|a| a.iter().filter_map(|x| x.as_str().map(String::from)).collect()));
    let files: Vec<String> = match marked {
        Some(f) => f,
        // Written by a synth from before the marker: its config says so, and it holds only the
        // files synth writes (checked below against this list).
        None if is_synthetic(out) => std::fs::read_dir(out)
            .map_err(|source| SynthError::Io { path: out.to_path_buf(), source })?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| LEGACY_FILES.contains(&n.as_str()) || (n.starts_with("model") && n.ends_with(".safetensors")))
            .collect(),
        None => {
            return refuse(format!("it has no {MARKER} (not written by synth); delete it yourself if it should go"));
        }
    };
    let rd = std::fs::read_dir(out).map_err(|source| SynthError::Io { path: out.to_path_buf(), source })?;
    let mut extra: Vec<String> = rd
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| {
            n != MARKER && !files.contains(n) && !ADDED_LATER.contains(&n.as_str()) && !n.starts_with(".placement")
        })
        .collect();
    if !extra.is_empty() {
        extra.sort();
        let more = if extra.len() > 5 { format!(" and {} more", extra.len() - 5) } else { String::new() };
        extra.truncate(5);
        return refuse(format!(
            "it also holds files synth did not write ({}{more}); move them out or delete the directory yourself",
            extra.join(", ")
        ));
    }
    Ok(())
}

/// Shape of a synthetic model (field names follow config.json).
#[derive(Clone, Debug, serde::Serialize)]
pub struct SynthSpec {
    pub hidden: usize,
    pub layers: usize,
    /// Total vocabulary, including the 256 reserved specials.
    pub vocab: usize,
    pub attn_res_block: usize,
    pub kda_heads: usize,
    pub kda_head_dim: usize,
    pub conv_width: usize,
    /// Every `mla_every`-th layer (1-based) is MLA, and so is the last layer.
    pub mla_every: usize,
    pub mla_heads: usize,
    pub q_lora: usize,
    pub kv_lora: usize,
    pub qk_nope: usize,
    pub qk_rope: usize,
    pub v_head: usize,
    pub dense_layers: usize,
    pub dense_inter: usize,
    pub experts: usize,
    pub top_k: usize,
    pub shared_experts: usize,
    pub expert_inter: usize,
    pub expert_latent: usize,
    pub max_context: usize,
    pub seed: u64,
    /// Target shard size in bytes (a shard holds whole layers or whole experts).
    pub shard_bytes: u64,
    /// Scale of the token embeddings: large values (64) make the embedding dominate the residual
    /// stream, so greedy decode falls into short cycles (repetitive output, for drafter benchmarks).
    #[serde(skip_serializing_if = "is_unit_scale")]
    pub embed_scale: f32,
    /// Draw the trunk's bf16 matrices from this trained model's values (per tensor role, scaled by
    /// a power of two to the fan-in) instead of uniform random values: a K3-shaped trunk whose
    /// exponent / mantissa distribution is a trained model's (what the coded trunk is measured on).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trunk_values_from: Option<PathBuf>,
}

fn is_unit_scale(x: &f32) -> bool {
    *x == 1.0
}

impl SynthSpec {
    /// The built-in demo: small, K3-shaped (KDA + MLA, AttnRes, dense layer 0, latent MoE).
    pub fn demo() -> Self {
        SynthSpec {
            hidden: 256,
            layers: 8,
            vocab: 2048,
            attn_res_block: 4,
            kda_heads: 4,
            kda_head_dim: 32,
            conv_width: 4,
            mla_every: 4,
            mla_heads: 4,
            q_lora: 64,
            kv_lora: 64,
            qk_nope: 32,
            qk_rope: 16,
            v_head: 32,
            dense_layers: 1,
            dense_inter: 512,
            experts: 32,
            top_k: 4,
            shared_experts: 2,
            expert_inter: 128,
            expert_latent: 128,
            max_context: 8192,
            seed: 1,
            shard_bytes: 4 << 20,
            embed_scale: 1.0,
            trunk_values_from: None,
        }
    }

    /// Kimi K3's own shape (`/work/shared/K3.md`): 93 layers (69 KDA + 24 MLA, layer 0 dense),
    /// hidden 7168, vocab 163840, 896 experts top-16 + 2 shared. Too large to write; `deltafin
    /// plan` parses its config for the memory arithmetic of the real model.
    pub fn k3() -> Self {
        SynthSpec {
            hidden: 7168,
            layers: 93,
            vocab: 163_840,
            attn_res_block: 12,
            kda_heads: 96,
            kda_head_dim: 128,
            conv_width: 4,
            mla_every: 4,
            mla_heads: 96,
            q_lora: 1536,
            kv_lora: 512,
            qk_nope: 128,
            qk_rope: 64,
            v_head: 128,
            dense_layers: 1,
            dense_inter: 33_792,
            experts: 896,
            top_k: 16,
            shared_experts: 2,
            expert_inter: 3072,
            expert_latent: 3584,
            max_context: 1 << 20,
            seed: 1,
            shard_bytes: 4 << 30,
            embed_scale: 1.0,
            trunk_values_from: None,
        }
    }

    /// Real K3 expert dimensions (hidden 7168, latent 3584, FFN 3072: 17.55 MB per expert) with
    /// fewer layers and experts and a light trunk.
    pub fn k3_experts() -> Self {
        SynthSpec {
            hidden: 7168,
            layers: 8,
            vocab: 8192,
            attn_res_block: 12,
            kda_heads: 4,
            kda_head_dim: 128,
            conv_width: 4,
            mla_every: 4,
            mla_heads: 4,
            q_lora: 256,
            kv_lora: 512,
            qk_nope: 128,
            qk_rope: 64,
            v_head: 128,
            dense_layers: 1,
            dense_inter: 2048,
            experts: 64,
            top_k: 16,
            shared_experts: 2,
            expert_inter: 3072,
            expert_latent: 3584,
            max_context: 1 << 20,
            seed: 1,
            shard_bytes: 4 << 30,
            embed_scale: 1.0,
            trunk_values_from: None,
        }
    }

    pub fn is_mla(&self, l: usize) -> bool {
        (l + 1).is_multiple_of(self.mla_every) || l + 1 == self.layers
    }

    pub fn validate(&self) -> Result<(), SynthError> {
        if !(self.embed_scale.is_finite() && self.embed_scale > 0.0) {
            return Err(SynthError::Spec(format!("embed scale {} must be a positive number", self.embed_scale)));
        }
        let bad = |m: String| Err(SynthError::Spec(m));
        if self.layers < 1 || self.hidden < 1 || self.kda_heads < 1 || self.kda_head_dim < 1 || self.mla_heads < 1 {
            return bad("layers, hidden and head counts must be >= 1".into());
        }
        // The same bounds config.json is held to, so synth never writes a model `run` refuses.
        use super::config::{MAX_EXPERTS, MAX_LAYERS};
        let out_of_range =
            |setting: Setting, value: usize, expected: String| Err(SynthError::Setting { setting, value, expected });
        if self.layers > MAX_LAYERS {
            return out_of_range(Setting::Layers, self.layers, format!("at most {MAX_LAYERS}"));
        }
        if self.experts < 1 || self.experts > MAX_EXPERTS {
            let expected = format!("1..={MAX_EXPERTS} (K3's MoE layers route to experts)");
            return out_of_range(Setting::Experts, self.experts, expected);
        }
        if self.dense_layers >= self.layers {
            let expected = format!("at most {} (it leaves no MoE layer of {})", self.layers - 1, self.layers);
            return out_of_range(Setting::DenseLayers, self.dense_layers, expected);
        }
        if self.vocab < 256 + NUM_SPECIALS {
            let expected = format!("at least {} (256 byte tokens + {NUM_SPECIALS} specials)", 256 + NUM_SPECIALS);
            return out_of_range(Setting::Vocab, self.vocab, expected);
        }
        if self.top_k < 1 || self.top_k > self.experts {
            return out_of_range(Setting::TopK, self.top_k, format!("1..={} (the number of experts)", self.experts));
        }
        for (setting, value) in [(Setting::ExpertInter, self.expert_inter), (Setting::ExpertLatent, self.expert_latent)]
        {
            if !value.is_multiple_of(32) {
                return out_of_range(setting, value, "a multiple of 32 (the MXFP4 block)".into());
            }
        }
        for (setting, value) in [
            (Setting::ConvWidth, self.conv_width),
            (Setting::AttnResBlock, self.attn_res_block),
            (Setting::MlaEvery, self.mla_every),
        ] {
            if value < 1 {
                return out_of_range(setting, value, "at least 1".into());
            }
        }
        Ok(())
    }

    fn n_base(&self) -> usize {
        self.vocab - NUM_SPECIALS
    }

    /// config.json in the shipped format.
    pub fn config_json(&self) -> Value {
        let kda: Vec<usize> = (0..self.layers).filter(|&l| !self.is_mla(l)).map(|l| l + 1).collect();
        let mla: Vec<usize> = (0..self.layers).filter(|&l| self.is_mla(l)).map(|l| l + 1).collect();
        let nb = self.n_base();
        json!({
            "model_type": "kimi_k3",
            "architectures": ["KimiK3ForConditionalGeneration"],
            "text_config": {
                "model_type": "kimi_linear",
                "hidden_size": self.hidden, "num_hidden_layers": self.layers, "vocab_size": self.vocab,
                "rms_norm_eps": 1e-5, "hidden_act": "situ", "intermediate_size": self.dense_inter,
                "tie_word_embeddings": false, "max_position_embeddings": self.max_context,
                "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
                "attn_res_block_size": self.attn_res_block,
                "linear_attn_config": {
                    "kda_layers": kda, "full_attn_layers": mla, "num_heads": self.kda_heads,
                    "head_dim": self.kda_head_dim, "short_conv_kernel_size": self.conv_width,
                    "use_full_rank_gate": true, "gate_lower_bound": -5.0
                },
                "num_attention_heads": self.mla_heads, "q_lora_rank": self.q_lora, "kv_lora_rank": self.kv_lora,
                "qk_nope_head_dim": self.qk_nope, "qk_rope_head_dim": self.qk_rope, "v_head_dim": self.v_head,
                "mla_use_nope": true, "mla_use_output_gate": true,
                "num_experts": self.experts, "num_experts_per_token": self.top_k,
                "num_shared_experts": self.shared_experts, "moe_intermediate_size": self.expert_inter,
                "routed_expert_hidden_size": self.expert_latent, "latent_moe_use_norm": true,
                "moe_renormalize": true, "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 1.0,
                "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": self.dense_layers,
                "moe_layer_freq": 1, "num_nextn_predict_layers": 0,
                "bos_token_id": nb, "eos_token_id": nb + 2, "pad_token_id": nb + 255
            },
            "quantization_config": {
                "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                "config_groups": {"group_0": {
                    "format": "mxfp4-pack-quantized",
                    "targets": ["re:.*block_sparse_moe\\.experts\\..*"],
                    "weights": {"num_bits": 4, "type": "float", "symmetric": true, "group_size": 32,
                                "strategy": "group", "scale_dtype": "torch.uint8"},
                    "input_activations": null
                }},
                "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\..*"]
            },
            "deltafin_synth": {"random_weights": true, "spec": self}
        })
    }

    /// Bytes of one routed expert (w1, w3, w2: packed nibbles + one scale per 32 inputs).
    pub fn expert_bytes(&self) -> u64 {
        (3 * self.expert_inter * self.expert_latent / 32 * 17) as u64
    }

    /// Bytes of all tensors.
    pub fn total_bytes(&self) -> u64 {
        self.plan().iter().flatten().map(|t| t.bytes()).sum()
    }
}

/// A small chat template in K3's format (messages, thinking-effort system message, generation
/// prompt inside `<|open|>think<|sep|>`), for synthetic models.
pub const SYNTH_CHAT_TEMPLATE: &str = r#"{%- if thinking is undefined -%}{%- set thinking = true -%}{%- endif -%}
{%- if thinking_effort is undefined -%}{%- set thinking_effort = 'max' -%}{%- endif -%}
{%- if thinking -%}
{{- '<|open|>message role="system" type="thinking-effort"<|sep|>Now the system is invoked with `thinking_effort=' + thinking_effort + '`.<|close|>message<|sep|><|end_of_msg|>' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if 'role' not in message -%}{{- raise_exception('messages require a role.') -}}{%- endif -%}
{{- '<|open|>message role="' + message.role + '"<|sep|>' -}}
{%- if message.role == 'assistant' -%}
{%- if thinking -%}{{- '<|open|>think<|sep|>' + (message.get('reasoning_content') or '') + '<|close|>think<|sep|>' -}}{%- endif -%}
{{- '<|open|>response<|sep|>' + (message.content or '') + '<|close|>response<|sep|>' -}}
{%- elif message.content is string -%}
{{- message.content -}}
{%- else -%}
{%- for part in message.content -%}{{- part.text -}}{%- endfor -%}
{%- endif -%}
{{- '<|close|>message<|sep|><|end_of_msg|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|open|>message role="assistant"<|sep|>' -}}{{- '<|open|>think<|sep|>' if thinking else '<|open|>response<|sep|>' -}}
{%- endif -%}
"#;

/// Writes the model to `out` (atomically: a temporary sibling renamed at the end).
/// `progress(done, total)` is called as bytes are written.
pub fn write(
    spec: &SynthSpec,
    out: &Path,
    force: bool,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<(), SynthError> {
    spec.validate()?;
    // symlink_metadata: a dangling link at `out` still counts as something there.
    let exists = std::fs::symlink_metadata(out).is_ok();
    if exists && !force {
        return Err(SynthError::Exists(out.to_path_buf()));
    }
    if exists {
        check_replaceable(out)?;
    }
    let name = out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|source| SynthError::Io { path: parent.to_path_buf(), source })?;
    for p in crate::util::remove_stale_temps(parent, &TEMP_STEMS) {
        eprintln!("deltafin: removed {} (left by an interrupted synth)", p.display());
    }
    // The whole model is written before the old one (if any) is removed, so it must fit beside it.
    let need = spec.total_bytes();
    if let Ok(have) = crate::util::free_bytes(parent)
        && need > have
    {
        return Err(SynthError::NoSpace { dir: parent.to_path_buf(), have, need });
    }
    let tmp = parent.join(format!(".{name}.synth-tmp-{}", std::process::id()));
    let result = write_into(spec, &tmp, progress).and_then(|()| {
        if exists {
            let old = parent.join(format!(".{name}.synth-old-{}", std::process::id()));
            std::fs::rename(out, &old).map_err(|source| SynthError::Io { path: out.to_path_buf(), source })?;
            std::fs::rename(&tmp, out).map_err(|source| SynthError::Io { path: out.to_path_buf(), source })?;
            let _ = std::fs::remove_dir_all(&old);
        } else {
            std::fs::rename(&tmp, out).map_err(|source| SynthError::Io { path: out.to_path_buf(), source })?;
        }
        Ok(())
    });
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> SynthError + '_ {
    move |source| SynthError::Io { path: path.to_path_buf(), source }
}

fn write_into(spec: &SynthSpec, dir: &Path, progress: &(dyn Fn(u64, u64) + Sync)) -> Result<(), SynthError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let text = |name: &str, body: &str| -> Result<(), SynthError> {
        let p = dir.join(name);
        std::fs::write(&p, body).map_err(io(&p))
    };
    text("config.json", &serde_json::to_string_pretty(&spec.config_json()).unwrap_or_default())?;
    let vocab = train_ranks(TRAINING_TEXT, spec.n_base());
    text("tiktoken.model", &rank_file(&vocab))?;
    text(
        "tokenizer_config.json",
        &serde_json::to_string_pretty(&k3_tokenizer_config(spec.n_base())).unwrap_or_default(),
    )?;
    text("chat_template.jinja", SYNTH_CHAT_TEMPLATE)?;

    // Pack groups into shards of about `shard_bytes`.
    let mut groups = spec.plan();
    if let Some(from) = &spec.trunk_values_from {
        tensors::draw_from_trained(&mut groups, from)?;
    }
    let mut shards: Vec<Vec<TensorPlan>> = vec![Vec::new()];
    let mut size = 0u64;
    for g in groups {
        let gb: u64 = g.iter().map(|t| t.bytes()).sum();
        if size > 0 && size + gb > spec.shard_bytes {
            shards.push(Vec::new());
            size = 0;
        }
        size += gb;
        if let Some(s) = shards.last_mut() {
            s.extend(g);
        }
    }
    let total: u64 = shards.iter().flatten().map(|t| t.bytes()).sum();
    let n = shards.len();
    let mut done = 0u64;
    let mut weight_map = serde_json::Map::new();
    for (si, mut tensors) in shards.into_iter().enumerate() {
        let file =
            if n == 1 { "model.safetensors".to_string() } else { format!("model-{:05}-of-{n:05}.safetensors", si + 1) };
        write_safetensors(&dir.join(&file), &mut tensors, spec.seed, &mut done, total, progress)?;
        for t in &tensors {
            weight_map.insert(t.name.clone(), json!(file));
        }
    }
    if n > 1 {
        let idx = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        text("model.safetensors.index.json", &serde_json::to_string_pretty(&idx).unwrap_or_default())?;
    }
    // The marker last: a directory with it is a complete synth output (see `check_replaceable`).
    let mut files: Vec<String> = std::fs::read_dir(dir)
        .map_err(io(dir))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    text(
        MARKER,
        &serde_json::to_string_pretty(&json!({"written_by": "deltafin synth", "files": files})).unwrap_or_default(),
    )?;
    Ok(())
}

/// True when `dir` holds a synthetic (random-weight) model written by `synth`.
pub fn is_synthetic(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .is_some_and(|v| v["deltafin_synth"]["random_weights"] == json!(true))
}
