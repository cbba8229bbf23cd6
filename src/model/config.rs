//! `config.json` as Moonshot ships it: top level `model_type: kimi_k3`, the language model under
//! `text_config` (`model_type: kimi_linear`), and a compressed-tensors `quantization_config` whose
//! routed experts are `mxfp4-pack-quantized`. [`K3Config::load`] validates every field the engine
//! relies on and returns a typed config; any missing, malformed or inconsistent field is a
//! [`ModelError::Config`] naming the file and the field.

use super::ModelError;
use serde::Deserialize;
use serde_json::Value;
use std::path::Path;

/// Attention kind of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKind {
    Kda,
    Mla,
}

/// Feed-forward kind of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnKind {
    Dense,
    Moe,
}

/// Validated language-model configuration.
#[derive(Clone, Debug)]
pub struct K3Config {
    pub hidden: usize,
    pub layers: usize,
    pub vocab: usize,
    pub rms_eps: f32,
    pub max_context: usize,
    pub attn_res_block: usize,
    pub situ_beta: f32,
    pub situ_linear_beta: f32,
    pub logit_scale: f32,
    pub attn: Vec<AttnKind>,
    pub ffn: Vec<FfnKind>,
    // KDA
    pub kda_heads: usize,
    pub kda_head_dim: usize,
    pub conv_width: usize,
    pub kda_gate_lower_bound: f32,
    // MLA
    pub mla_heads: usize,
    pub q_lora: usize,
    pub kv_lora: usize,
    pub qk_nope: usize,
    pub qk_rope: usize,
    pub v_head: usize,
    pub mla_norm_eps: f32,
    // MLP / MoE
    pub dense_inter: usize,
    pub experts: usize,
    pub top_k: usize,
    pub shared_experts: usize,
    pub expert_inter: usize,
    pub expert_latent: usize,
    pub latent_norm: bool,
    pub renormalize: bool,
    pub routed_scaling: f32,
    // tokens
    pub bos_token: Option<u32>,
    pub eos_token: Option<u32>,
    pub pad_token: Option<u32>,
}

/// eps of the KDA query/key l2 normalisation (fixed in the reference kernels, not a config field).
pub const KDA_L2_EPS: f32 = 1e-6;
/// eps of MLA's `q_a_layernorm` / `kv_a_layernorm` (Moonshot's modelling code; vLLM uses 1e-5).
pub const MLA_LATENT_NORM_EPS: f32 = 1e-6;
/// Upper bounds on config.json's sizes: far above K3 (93 layers, 896 experts, hidden 7168,
/// vocabulary 163,840), low enough that a typo (1e12) is an error naming the field rather than an
/// allocation abort while building per-layer or per-expert tables.
pub const MAX_LAYERS: usize = 4096;
pub const MAX_EXPERTS: usize = 1 << 16;
pub const MAX_HIDDEN: usize = 1 << 20;
pub const MAX_VOCAB: usize = 1 << 24;

/// KDA chunk length for prompt processing.
pub const KDA_CHUNK: usize = 64;

#[derive(Deserialize)]
struct LinearAttnConfig {
    kda_layers: Vec<usize>,
    full_attn_layers: Vec<usize>,
    num_heads: usize,
    head_dim: usize,
    short_conv_kernel_size: usize,
    gate_lower_bound: Option<f32>,
    use_full_rank_gate: Option<bool>,
}

struct Fields<'a> {
    path: &'a Path,
    obj: &'a serde_json::Map<String, Value>,
    prefix: &'a str,
}

impl Fields<'_> {
    fn err(&self, field: &str, msg: impl Into<String>) -> ModelError {
        ModelError::Config {
            path: self.path.to_path_buf(),
            field: format!("{}{}", self.prefix, field),
            msg: msg.into(),
        }
    }
    fn get(&self, field: &str) -> Option<&Value> {
        self.obj.get(field).filter(|v| !v.is_null())
    }
    fn usize(&self, field: &str) -> Result<usize, ModelError> {
        match self.get(field) {
            None => Err(self.err(field, "missing (expected a non-negative integer)")),
            Some(v) => v
                .as_u64()
                .map(|x| x as usize)
                .ok_or_else(|| self.err(field, format!("expected a non-negative integer, found {v}"))),
        }
    }
    fn pos(&self, field: &str) -> Result<usize, ModelError> {
        let v = self.usize(field)?;
        if v == 0 {
            return Err(self.err(field, "must be > 0"));
        }
        Ok(v)
    }
    /// A positive integer no larger than `max`.
    fn bounded(&self, field: &str, max: usize) -> Result<usize, ModelError> {
        let v = self.pos(field)?;
        if v > max {
            return Err(self.err(field, format!("{v} is implausibly large (at most {max} is accepted)")));
        }
        Ok(v)
    }
    fn f32(&self, field: &str) -> Result<f32, ModelError> {
        match self.get(field) {
            None => Err(self.err(field, "missing (expected a number)")),
            Some(v) => {
                v.as_f64().map(|x| x as f32).ok_or_else(|| self.err(field, format!("expected a number, found {v}")))
            }
        }
    }
    fn usize_or(&self, field: &str, default: usize) -> Result<usize, ModelError> {
        if self.get(field).is_none() { Ok(default) } else { self.usize(field) }
    }
    fn f32_or(&self, field: &str, default: f32) -> Result<f32, ModelError> {
        if self.get(field).is_none() { Ok(default) } else { self.f32(field) }
    }
    fn bool_or(&self, field: &str, default: bool) -> Result<bool, ModelError> {
        match self.get(field) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| self.err(field, format!("expected true or false, found {v}"))),
        }
    }
    fn str_opt(&self, field: &str) -> Result<Option<&str>, ModelError> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| self.err(field, format!("expected a string, found {v}"))),
        }
    }
    fn token(&self, field: &str) -> Result<Option<u32>, ModelError> {
        match self.get(field) {
            None => Ok(None),
            // Some configs list several EOS ids; the first is the end-of-message token.
            Some(Value::Array(a)) if !a.is_empty() => a[0]
                .as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| self.err(field, format!("expected a token id, found {}", a[0]))),
            Some(v) => v
                .as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| self.err(field, format!("expected a token id, found {v}"))),
        }
    }
}

/// `parse`'s KDA phase: `linear_attn_config` read and checked, and every layer's attention kind
/// from its 1-based `kda_layers` / `full_attn_layers` (each layer in exactly one); with the KDA
/// gate's lower bound.
fn layer_split(t: &Fields, layers: usize) -> Result<(Vec<AttnKind>, LinearAttnConfig, f32), ModelError> {
    let lac_val = t.get("linear_attn_config").ok_or_else(|| t.err("linear_attn_config", "missing"))?;
    let lac: LinearAttnConfig =
        serde_json::from_value(lac_val.clone()).map_err(|e| t.err("linear_attn_config", format!("malformed: {e}")))?;
    let lf = |f: &str, m: String| t.err(&format!("linear_attn_config.{f}"), m);
    let mut attn = vec![None; layers];
    for (list, kind, name) in
        [(&lac.kda_layers, AttnKind::Kda, "kda_layers"), (&lac.full_attn_layers, AttnKind::Mla, "full_attn_layers")]
    {
        for &l1 in list {
            if l1 == 0 || l1 > layers {
                return Err(lf(name, format!("layer {l1} is outside 1..={layers} (the lists are 1-based)")));
            }
            if attn[l1 - 1].is_some() {
                return Err(lf(name, format!("layer {l1} is listed twice")));
            }
            attn[l1 - 1] = Some(kind);
        }
    }
    let attn: Vec<AttnKind> = attn
        .into_iter()
        .enumerate()
        .map(|(i, a)| {
            a.ok_or_else(|| lf("kda_layers", format!("layer {} is in neither kda_layers nor full_attn_layers", i + 1)))
        })
        .collect::<Result<_, _>>()?;
    if lac.num_heads == 0 || lac.head_dim == 0 {
        return Err(lf("num_heads", "num_heads and head_dim must be > 0".into()));
    }
    if lac.short_conv_kernel_size < 1 {
        return Err(lf("short_conv_kernel_size", "must be >= 1".into()));
    }
    // Products of these sizes (projection widths, state sizes) must not overflow.
    for (f, v) in [
        ("num_heads", lac.num_heads),
        ("head_dim", lac.head_dim),
        ("short_conv_kernel_size", lac.short_conv_kernel_size),
    ] {
        if v > MAX_HIDDEN {
            return Err(lf(f, format!("{v} is implausibly large (at most {MAX_HIDDEN} is accepted)")));
        }
    }
    if lac.use_full_rank_gate == Some(false) {
        return Err(lf("use_full_rank_gate", "only K3's full-rank output gate is supported".into()));
    }
    let kda_gate_lower_bound = lac
        .gate_lower_bound
        .ok_or_else(|| lf("gate_lower_bound", "missing: K3's KDA gate is lower_bound * sigmoid(...)".into()))?;
    if kda_gate_lower_bound >= 0.0 {
        return Err(lf("gate_lower_bound", format!("expected a negative bound, found {kda_gate_lower_bound}")));
    }
    Ok((attn, lac, kda_gate_lower_bound))
}

/// `parse`'s MLA phase: the MLA sizes (heads, q and kv LoRA ranks, nope / rope / v head dims) when
/// some layer is MLA (`has_mla`), else zeros.
fn mla_sizes(t: &Fields, has_mla: bool) -> Result<(usize, usize, usize, usize, usize, usize), ModelError> {
    Ok(if has_mla {
        if !t.bool_or("mla_use_nope", false)? {
            return Err(t.err("mla_use_nope", "K3's MLA has no RoPE; expected true"));
        }
        if !t.bool_or("mla_use_output_gate", true)? {
            return Err(t.err("mla_use_output_gate", "K3's MLA is gated; expected true"));
        }
        (
            t.bounded("num_attention_heads", MAX_HIDDEN)?,
            t.bounded("q_lora_rank", MAX_HIDDEN)?,
            t.bounded("kv_lora_rank", MAX_HIDDEN)?,
            t.bounded("qk_nope_head_dim", MAX_HIDDEN)?,
            match t.usize("qk_rope_head_dim")? {
                r if r > MAX_HIDDEN => {
                    return Err(t.err("qk_rope_head_dim", format!("{r} is implausibly large")));
                }
                r => r,
            },
            t.bounded("v_head_dim", MAX_HIDDEN)?,
        )
    } else {
        (0, 0, 0, 0, 0, 0)
    })
}

/// `parse`'s feed-forward split: each layer dense or MoE, and their sizes.
struct Ffn {
    ffn: Vec<FfnKind>,
    dense_inter: usize,
    experts: usize,
    top_k: usize,
    shared_experts: usize,
    expert_inter: usize,
    expert_latent: usize,
}

/// `parse`'s feed-forward phase: which layers are MoE (`first_k_dense_replace`, `moe_layer_freq`,
/// `num_experts`), the dense and expert sizes, and the router's settings checked.
fn ffn_split(t: &Fields, layers: usize) -> Result<Ffn, ModelError> {
    let first_dense = t.usize_or("first_k_dense_replace", 0)?;
    let moe_freq = t.usize_or("moe_layer_freq", 1)?.max(1);
    let experts = t.usize_or("num_experts", 0)?;
    if experts > MAX_EXPERTS {
        return Err(t.err("num_experts", format!("{experts} is implausibly large (at most {MAX_EXPERTS} is accepted)")));
    }
    let ffn: Vec<FfnKind> = (0..layers)
        .map(|l| if experts > 0 && l >= first_dense && l % moe_freq == 0 { FfnKind::Moe } else { FfnKind::Dense })
        .collect();
    let dense_inter = if ffn.contains(&FfnKind::Dense) { t.bounded("intermediate_size", MAX_HIDDEN)? } else { 0 };
    let has_moe = ffn.contains(&FfnKind::Moe);
    let (top_k, shared_experts, expert_inter, expert_latent) = if has_moe {
        let k = t.pos("num_experts_per_token")?;
        if k > experts {
            return Err(t.err("num_experts_per_token", format!("{k} is more than num_experts = {experts}")));
        }
        let inter = t.bounded("moe_intermediate_size", MAX_HIDDEN)?;
        let latent = t.bounded("routed_expert_hidden_size", MAX_HIDDEN)?;
        for (f, v) in [("moe_intermediate_size", inter), ("routed_expert_hidden_size", latent)] {
            if v % 32 != 0 {
                return Err(t.err(f, format!("{v} is not a multiple of 32 (the MXFP4 block)")));
            }
        }
        let shared = t.usize_or("num_shared_experts", 0)?;
        if shared > MAX_EXPERTS {
            return Err(t.err("num_shared_experts", format!("{shared} is implausibly large")));
        }
        (k, shared, inter, latent)
    } else {
        (0, 0, 0, 0)
    };
    if has_moe {
        if let Some(f) = t.str_opt("moe_router_activation_func")?
            && f != "sigmoid"
        {
            return Err(t.err("moe_router_activation_func", format!("expected \"sigmoid\", found \"{f}\"")));
        }
        for f in ["num_expert_group", "topk_group"] {
            if let Some(v) = t.get(f)
                && v.as_u64() != Some(1)
            {
                return Err(t.err(f, format!("group-limited routing is not supported (expected 1, found {v})")));
            }
        }
    }
    Ok(Ffn { ffn, dense_inter, experts, top_k, shared_experts, expert_inter, expert_latent })
}

impl K3Config {
    /// Reads and validates `dir/config.json`.
    pub fn load(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io { path: path.clone(), source })?;
        Self::parse(&path, &text)
    }

    /// Parses config text; `path` is only used in error messages. In phases: the model types and
    /// the quantization, the trunk's sizes and scalars, the attention layer split (`layer_split`,
    /// `mla_sizes`), the feed-forward split (`ffn_split`), the special tokens.
    pub fn parse(path: &Path, text: &str) -> Result<Self, ModelError> {
        let root: Value =
            serde_json::from_str(text).map_err(|source| ModelError::Json { path: path.to_path_buf(), source })?;
        let root_obj = root.as_object().ok_or_else(|| ModelError::Config {
            path: path.to_path_buf(),
            field: "(root)".into(),
            msg: "expected a JSON object".into(),
        })?;
        let top = Fields { path, obj: root_obj, prefix: "" };
        match top.str_opt("model_type")? {
            Some("kimi_k3") => {}
            other => {
                let found = other.map_or_else(|| "nothing".to_string(), |o| format!("\"{o}\""));
                return Err(top.err("model_type", format!("expected \"kimi_k3\", found {found}")));
            }
        }
        let text_obj = top
            .get("text_config")
            .ok_or_else(|| top.err("text_config", "missing (the language model's configuration)"))?
            .as_object()
            .ok_or_else(|| top.err("text_config", "expected an object"))?;
        let t = Fields { path, obj: text_obj, prefix: "text_config." };
        match t.str_opt("model_type")? {
            Some("kimi_linear") | None => {}
            Some(other) => {
                return Err(t.err("model_type", format!("expected \"kimi_linear\", found \"{other}\"")));
            }
        }
        check_quantization(path, root_obj, text_obj)?;

        let hidden = t.bounded("hidden_size", MAX_HIDDEN)?;
        let layers = t.bounded("num_hidden_layers", MAX_LAYERS)?;
        let vocab = t.bounded("vocab_size", MAX_VOCAB)?;
        let rms_eps = t.f32("rms_norm_eps")?;
        if !(rms_eps > 0.0 && rms_eps < 1.0) {
            return Err(t.err("rms_norm_eps", format!("expected a small positive number, found {rms_eps}")));
        }
        if let Some(act) = t.str_opt("hidden_act")?
            && act != "situ"
        {
            return Err(t.err("hidden_act", format!("expected \"situ\", found \"{act}\"")));
        }
        if t.bool_or("tie_word_embeddings", false)? {
            return Err(t.err("tie_word_embeddings", "K3 has an untied lm_head; tied embeddings are not supported"));
        }
        let attn_res_block = t.pos("attn_res_block_size")?;
        let situ_beta = t.f32("activation_situ_beta")?;
        if situ_beta <= 0.0 {
            return Err(t.err("activation_situ_beta", "must be > 0"));
        }
        let situ_linear_beta = t.f32_or("activation_situ_linear_beta", 0.0)?;
        let logit_scale = t.f32_or("logit_scale", 1.0)?;
        let max_context = t.usize_or("max_position_embeddings", 1 << 20)?;

        // Linear attention (KDA) and the layer split.
        let (attn, lac, kda_gate_lower_bound) = layer_split(&t, layers)?;
        // MLA.
        let (mla_heads, q_lora, kv_lora, qk_nope, qk_rope, v_head) = mla_sizes(&t, attn.contains(&AttnKind::Mla))?;
        // Feed-forward split.
        let Ffn { ffn, dense_inter, experts, top_k, shared_experts, expert_inter, expert_latent } =
            ffn_split(&t, layers)?;
        let latent_norm = t.bool_or("latent_moe_use_norm", true)?;
        let renormalize = t.bool_or("moe_renormalize", true)?;
        let routed_scaling = t.f32_or("routed_scaling_factor", 1.0)?;

        let token = |f: &str| -> Result<Option<u32>, ModelError> {
            let v = t.token(f)?;
            if v.is_some() { Ok(v) } else { top.token(f) }
        };
        let (bos_token, eos_token, pad_token) =
            (token("bos_token_id")?, token("eos_token_id")?, token("pad_token_id")?);

        Ok(K3Config {
            hidden,
            layers,
            vocab,
            rms_eps,
            max_context,
            attn_res_block,
            situ_beta,
            situ_linear_beta,
            logit_scale,
            attn,
            ffn,
            kda_heads: lac.num_heads,
            kda_head_dim: lac.head_dim,
            conv_width: lac.short_conv_kernel_size,
            kda_gate_lower_bound,
            mla_heads,
            q_lora,
            kv_lora,
            qk_nope,
            qk_rope,
            v_head,
            mla_norm_eps: MLA_LATENT_NORM_EPS,
            dense_inter,
            experts,
            top_k,
            shared_experts,
            expert_inter,
            expert_latent,
            latent_norm,
            renormalize,
            routed_scaling,
            bos_token,
            eos_token,
            pad_token,
        })
    }

    /// KDA projection width (heads x head_dim).
    pub fn kda_dim(&self) -> usize {
        self.kda_heads * self.kda_head_dim
    }

    /// Number of MoE layers.
    pub fn moe_layers(&self) -> usize {
        self.ffn.iter().filter(|f| **f == FfnKind::Moe).count()
    }

    /// Bytes of one routed expert in MXFP4 (packed nibbles + E8M0 scales of w1, w3 and w2).
    pub fn expert_bytes(&self) -> usize {
        let mat = |rows: usize, cols: usize| rows * cols / 2 + rows * cols / 32;
        2 * mat(self.expert_inter, self.expert_latent) + mat(self.expert_latent, self.expert_inter)
    }
}

/// The routed experts must be compressed-tensors MXFP4: 4-bit floats, groups of 32.
fn check_quantization(
    path: &Path,
    root: &serde_json::Map<String, Value>,
    text: &serde_json::Map<String, Value>,
) -> Result<(), ModelError> {
    let (q, prefix) = match (root.get("quantization_config"), text.get("quantization_config")) {
        (Some(q), _) => (q, ""),
        (None, Some(q)) => (q, "text_config."),
        (None, None) => {
            return Err(ModelError::Config {
                path: path.to_path_buf(),
                field: "quantization_config".into(),
                msg: "missing: the routed experts are expected as compressed-tensors mxfp4-pack-quantized".into(),
            });
        }
    };
    let err = |field: &str, msg: String| ModelError::Config {
        path: path.to_path_buf(),
        field: format!("{prefix}quantization_config.{field}"),
        msg,
    };
    // A field's JSON text as written (or "nothing"), never Rust debug text.
    let shown = |v: Option<&Value>| v.map_or_else(|| "nothing".to_string(), Value::to_string);
    let method = q.get("quant_method").and_then(Value::as_str);
    if method != Some("compressed-tensors") {
        return Err(err(
            "quant_method",
            format!("expected \"compressed-tensors\", found {}", shown(q.get("quant_method"))),
        ));
    }
    let groups = q
        .get("config_groups")
        .and_then(Value::as_object)
        .ok_or_else(|| err("config_groups", "missing or not an object".into()))?;
    let top_format = q.get("format").and_then(Value::as_str);
    let mut found = false;
    for (name, g) in groups {
        let format = g.get("format").and_then(Value::as_str).or(top_format);
        if format != Some("mxfp4-pack-quantized") {
            continue;
        }
        let w = g.get("weights").ok_or_else(|| err(&format!("config_groups.{name}.weights"), "missing".into()))?;
        let bits = w.get("num_bits").and_then(Value::as_u64);
        let typ = w.get("type").and_then(Value::as_str);
        let gs = w.get("group_size").and_then(Value::as_u64);
        if bits != Some(4) || typ != Some("float") || gs != Some(32) {
            return Err(err(
                &format!("config_groups.{name}.weights"),
                format!(
                    "expected num_bits 4, type \"float\", group_size 32; found {}, {}, {}",
                    shown(w.get("num_bits")),
                    shown(w.get("type")),
                    shown(w.get("group_size"))
                ),
            ));
        }
        found = true;
    }
    if !found {
        return Err(err("config_groups", "no group has format \"mxfp4-pack-quantized\"".into()));
    }
    Ok(())
}
