//! Tensor roster: the full list of tensors the engine reads, derived from the config, checked
//! against the checkpoint (presence, dtype, shape) before any compute, plus the routed-expert map:
//! each expert's six MXFP4 records, wherever they lie (one contiguous range as shipped, or apart,
//! or split over shards), as extents that assemble one byte image with the same layout for every
//! expert.

use super::{Checkpoint, K3Config, ModelError};
use crate::model::config::{AttnKind, FfnKind};
use safetensors::tensor::Dtype;

/// Prefix of the language model's tensors in the shipped checkpoint (vision tensors are ignored).
pub const MODEL_PREFIX: &str = "language_model.model.";
pub const LM_HEAD: &str = "language_model.lm_head.weight";

/// Full name of a top-level model tensor, e.g. `top("norm.weight")`.
pub fn top(name: &str) -> String {
    format!("{MODEL_PREFIX}{name}")
}

/// Full name of a per-layer tensor, e.g. `layer(3, "self_attn.q_proj.weight")`.
pub fn layer(l: usize, name: &str) -> String {
    format!("{MODEL_PREFIX}layers.{l}.{name}")
}

/// Full name of one routed expert record, e.g. `expert(1, 7, "w1", "weight_packed")`.
pub fn expert(l: usize, e: usize, proj: &str, part: &str) -> String {
    layer(l, &format!("block_sparse_moe.experts.{e}.{proj}.{part}"))
}

/// The six records of one expert, in the order the engine reads them.
pub const EXPERT_PARTS: [(&str, &str); 6] = [
    ("w1", "weight_packed"),
    ("w1", "weight_scale"),
    ("w3", "weight_packed"),
    ("w3", "weight_scale"),
    ("w2", "weight_packed"),
    ("w2", "weight_scale"),
];

/// Offsets of an expert's records relative to the start of its byte range (same for all experts),
/// in `EXPERT_PARTS` order: the backend's description of a gated MXFP4 expert.
pub use crate::backend::ExpertLayout;

/// One byte range of an expert in a shard, and where it goes in the expert's byte image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub shard: usize,
    /// Absolute offset in the shard file.
    pub start: u64,
    pub len: u64,
    /// Offset in the expert's image (the layout all experts share).
    pub dest: u64,
}

/// Where one expert's bytes live in the shipped shards: one extent when its six records are
/// adjacent in one shard (as shipped), else several (records apart, or split over shards); adjacent
/// records are coalesced into one extent. Sorted by `dest`; together they cover the image once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertLoc {
    pub extents: Vec<Extent>,
}

impl ExpertLoc {
    /// The expert's image: borrowed from the mapping when it is one extent, else assembled.
    pub fn bytes<'c>(&self, ck: &'c Checkpoint) -> std::borrow::Cow<'c, [u8]> {
        match self.extents.as_slice() {
            [x] => std::borrow::Cow::Borrowed(ck.range(x.shard, x.start, x.start + x.len)),
            xs => {
                let total = xs.iter().map(|x| x.dest + x.len).max().unwrap_or(0) as usize;
                let mut out = vec![0u8; total];
                for x in xs {
                    out[x.dest as usize..(x.dest + x.len) as usize].copy_from_slice(ck.range(
                        x.shard,
                        x.start,
                        x.start + x.len,
                    ));
                }
                std::borrow::Cow::Owned(out)
            }
        }
    }
}

/// The result of a successful roster check.
pub struct Roster {
    pub expert_layout: Option<ExpertLayout>,
    /// Per layer: the shard location of each expert (None for dense layers).
    pub experts: Vec<Option<Vec<ExpertLoc>>>,
}

#[derive(Clone, Copy)]
enum Kind {
    /// A matrix the bf16 kernels read in place.
    Bf16,
    /// A small tensor converted to f32 at load: F32, BF16 or F16 (each converts exactly).
    Vec,
    U8,
}

impl Kind {
    fn accepts(self, d: Dtype) -> bool {
        match self {
            Kind::Bf16 => d == Dtype::BF16,
            Kind::Vec => matches!(d, Dtype::BF16 | Dtype::F32 | Dtype::F16),
            Kind::U8 => d == Dtype::U8,
        }
    }
    fn describe(self) -> &'static str {
        match self {
            Kind::Bf16 => "BF16 (matrices are read in place by the bf16 kernels)",
            Kind::Vec => "F32, BF16 or F16",
            Kind::U8 => "U8",
        }
    }
}

/// Accepted shapes of one tensor.
enum Shape {
    Exact(Vec<usize>),
    /// Any of these shapes.
    OneOf(Vec<Vec<usize>>),
    /// A vector of at least this many elements, stored 1-D or with extra unit dimensions.
    AtLeast(usize),
}

impl Shape {
    fn accepts(&self, s: &[usize]) -> bool {
        match self {
            Shape::Exact(e) => s == e.as_slice(),
            Shape::OneOf(v) => v.iter().any(|e| s == e.as_slice()),
            Shape::AtLeast(n) => s.iter().filter(|&&d| d != 1).count() <= 1 && s.iter().product::<usize>() >= *n,
        }
    }
    fn describe(&self) -> String {
        match self {
            Shape::Exact(e) => format!("{e:?}"),
            Shape::OneOf(v) => v.iter().map(|e| format!("{e:?}")).collect::<Vec<_>>().join(" or "),
            Shape::AtLeast(n) => format!("a vector of >= {n} elements"),
        }
    }
}

struct Expect {
    name: String,
    kind: Kind,
    shape: Shape,
}

fn ex(name: String, kind: Kind, shape: Vec<usize>) -> Expect {
    Expect { name, kind, shape: Shape::Exact(shape) }
}

/// The trunk's bf16 matrices as (name, rows, cols), and how many values its small vectors hold
/// (they are kept as f32): what the trunk weighs under any encoding, without a checkpoint. An
/// AttnRes norm is not held: it is folded into its projection's score vector at load
/// (`k3::weights`), so the count is the resident trunk's, byte for byte (tests/plan_agrees.rs).
pub fn trunk_shapes(c: &K3Config) -> (Vec<(String, usize, usize)>, usize) {
    let (mut mats, mut vecs) = (Vec::new(), 0);
    for x in trunk_expectations(c).into_iter().filter(|x| !x.name.ends_with("_res_norm.weight")) {
        match (x.kind, &x.shape) {
            (Kind::Bf16, Shape::Exact(s)) if s.len() == 2 => mats.push((x.name, s[0], s[1])),
            (_, Shape::Exact(s)) => vecs += s.iter().product::<usize>(),
            (_, Shape::OneOf(v)) => vecs += v.first().map_or(0, |s| s.iter().product::<usize>()),
            (_, Shape::AtLeast(n)) => vecs += n,
        }
    }
    (mats, vecs)
}

/// Every tensor the forward pass reads, except routed experts.
fn trunk_expectations(c: &K3Config) -> Vec<Expect> {
    let h = c.hidden;
    let mut v = vec![
        ex(top("embed_tokens.weight"), Kind::Bf16, vec![c.vocab, h]),
        ex(LM_HEAD.to_string(), Kind::Bf16, vec![c.vocab, h]),
        ex(top("norm.weight"), Kind::Vec, vec![h]),
        ex(top("output_attn_res_norm.weight"), Kind::Vec, vec![h]),
        Expect {
            name: top("output_attn_res_proj.weight"),
            kind: Kind::Vec,
            shape: Shape::OneOf(vec![vec![1, h], vec![h]]),
        },
    ];
    for l in 0..c.layers {
        let n = |s: &str| layer(l, s);
        for norm in [
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "self_attention_res_norm.weight",
            "mlp_res_norm.weight",
        ] {
            v.push(ex(n(norm), Kind::Vec, vec![h]));
        }
        for proj in ["self_attention_res_proj.weight", "mlp_res_proj.weight"] {
            v.push(Expect { name: n(proj), kind: Kind::Vec, shape: Shape::OneOf(vec![vec![1, h], vec![h]]) });
        }
        match c.attn[l] {
            AttnKind::Kda => {
                let p = c.kda_dim();
                let dk = c.kda_head_dim;
                for q in ["q", "k", "v"] {
                    v.push(ex(n(&format!("self_attn.{q}_proj.weight")), Kind::Bf16, vec![p, h]));
                    v.push(Expect {
                        name: n(&format!("self_attn.{q}_conv1d.weight")),
                        kind: Kind::Vec,
                        shape: Shape::OneOf(vec![vec![p, 1, c.conv_width], vec![p, c.conv_width]]),
                    });
                }
                v.push(ex(n("self_attn.f_a_proj.weight"), Kind::Bf16, vec![dk, h]));
                v.push(ex(n("self_attn.f_b_proj.weight"), Kind::Bf16, vec![p, dk]));
                v.push(ex(n("self_attn.b_proj.weight"), Kind::Bf16, vec![c.kda_heads, h]));
                v.push(ex(n("self_attn.g_proj.weight"), Kind::Bf16, vec![p, h]));
                v.push(Expect { name: n("self_attn.A_log"), kind: Kind::Vec, shape: Shape::AtLeast(c.kda_heads) });
                v.push(ex(n("self_attn.dt_bias"), Kind::Vec, vec![p]));
                v.push(ex(n("self_attn.o_norm.weight"), Kind::Vec, vec![dk]));
                v.push(ex(n("self_attn.o_proj.weight"), Kind::Bf16, vec![h, p]));
            }
            AttnKind::Mla => {
                let nh = c.mla_heads;
                v.push(ex(n("self_attn.q_a_proj.weight"), Kind::Bf16, vec![c.q_lora, h]));
                v.push(ex(n("self_attn.q_a_layernorm.weight"), Kind::Vec, vec![c.q_lora]));
                v.push(ex(n("self_attn.q_b_proj.weight"), Kind::Bf16, vec![nh * (c.qk_nope + c.qk_rope), c.q_lora]));
                v.push(ex(n("self_attn.kv_a_proj_with_mqa.weight"), Kind::Bf16, vec![c.kv_lora + c.qk_rope, h]));
                v.push(ex(n("self_attn.kv_a_layernorm.weight"), Kind::Vec, vec![c.kv_lora]));
                v.push(ex(n("self_attn.kv_b_proj.weight"), Kind::Bf16, vec![nh * (c.qk_nope + c.v_head), c.kv_lora]));
                v.push(ex(n("self_attn.g_proj.weight"), Kind::Bf16, vec![nh * c.v_head, h]));
                v.push(ex(n("self_attn.o_proj.weight"), Kind::Bf16, vec![h, nh * c.v_head]));
            }
        }
        match c.ffn[l] {
            FfnKind::Dense => {
                v.push(ex(n("mlp.gate_proj.weight"), Kind::Bf16, vec![c.dense_inter, h]));
                v.push(ex(n("mlp.up_proj.weight"), Kind::Bf16, vec![c.dense_inter, h]));
                v.push(ex(n("mlp.down_proj.weight"), Kind::Bf16, vec![h, c.dense_inter]));
            }
            FfnKind::Moe => {
                let lat = c.expert_latent;
                v.push(ex(n("block_sparse_moe.gate.weight"), Kind::Bf16, vec![c.experts, h]));
                v.push(ex(n("block_sparse_moe.gate.e_score_correction_bias"), Kind::Vec, vec![c.experts]));
                v.push(ex(n("block_sparse_moe.routed_expert_down_proj.weight"), Kind::Bf16, vec![lat, h]));
                if c.latent_norm {
                    v.push(ex(n("block_sparse_moe.routed_expert_norm.weight"), Kind::Vec, vec![lat]));
                }
                v.push(ex(n("block_sparse_moe.routed_expert_up_proj.weight"), Kind::Bf16, vec![h, lat]));
                if c.shared_experts > 0 {
                    let si = c.shared_experts * c.expert_inter;
                    v.push(ex(n("block_sparse_moe.shared_experts.gate_proj.weight"), Kind::Bf16, vec![si, h]));
                    v.push(ex(n("block_sparse_moe.shared_experts.up_proj.weight"), Kind::Bf16, vec![si, h]));
                    v.push(ex(n("block_sparse_moe.shared_experts.down_proj.weight"), Kind::Bf16, vec![h, si]));
                }
            }
        }
    }
    v
}

fn expert_expectations(c: &K3Config, l: usize, e: usize) -> [Expect; 6] {
    let (i, lat) = (c.expert_inter, c.expert_latent);
    let shape = |proj: &str, part: &str| -> Vec<usize> {
        let (rows, cols) = if proj == "w2" { (lat, i) } else { (i, lat) };
        if part == "weight_packed" { vec![rows, cols / 2] } else { vec![rows, cols / 32] }
    };
    EXPERT_PARTS.map(|(proj, part)| ex(expert(l, e, proj, part), Kind::U8, shape(proj, part)))
}

impl Roster {
    /// Checks every expected tensor and maps the routed experts. All problems are reported at once.
    pub fn build(c: &K3Config, ck: &Checkpoint) -> Result<Roster, ModelError> {
        let mut problems: Vec<String> = Vec::new();
        let check = |x: &Expect, problems: &mut Vec<String>| -> bool {
            match ck.get(&x.name) {
                None => {
                    problems.push(format!("missing tensor `{}`", x.name));
                    false
                }
                Some(t) => {
                    let file = ck.shard_path(t.shard).display();
                    let mut ok = true;
                    if !x.kind.accepts(t.dtype) {
                        problems.push(format!(
                            "{file}: tensor `{}` has dtype {:?}, expected {}",
                            x.name,
                            t.dtype,
                            x.kind.describe()
                        ));
                        ok = false;
                    }
                    if !x.shape.accepts(&t.shape) {
                        problems.push(format!(
                            "{file}: tensor `{}` has shape {:?}, expected {}",
                            x.name,
                            t.shape,
                            x.shape.describe()
                        ));
                        ok = false;
                    }
                    ok
                }
            }
        };
        for x in trunk_expectations(c) {
            check(&x, &mut problems);
        }
        let mut layout: Option<ExpertLayout> = None;
        let mut experts = vec![None; c.layers];
        for l in (0..c.layers).filter(|&l| c.ffn[l] == FfnKind::Moe) {
            let mut locs = Vec::with_capacity(c.experts);
            for e in 0..c.experts {
                let exps = expert_expectations(c, l, e);
                let mut all_ok = true;
                for x in &exps {
                    all_ok &= check(x, &mut problems);
                }
                if !all_ok {
                    continue;
                }
                let ents: Vec<_> = exps.iter().filter_map(|x| ck.get(&x.name)).collect();
                // The image puts records in file order (shard, offset) of the first expert, so a
                // shipped contiguous expert is its own image, read in one range.
                let mut order: Vec<usize> = (0..6).collect();
                order.sort_by_key(|&i| (ents[i].shard, ents[i].start));
                let mut parts = [(0usize, 0usize); 6];
                match &layout {
                    None => {
                        let mut at = 0usize;
                        for &i in &order {
                            let n = (ents[i].end - ents[i].start) as usize;
                            parts[i] = (at, n);
                            at += n;
                        }
                        layout = Some(ExpertLayout { parts, len: at, inter: c.expert_inter, latent: c.expert_latent });
                    }
                    Some(first) => parts = first.parts,
                }
                let mut extents: Vec<Extent> = Vec::with_capacity(6);
                let mut by_dest: Vec<usize> = (0..6).collect();
                by_dest.sort_by_key(|&i| parts[i].0);
                for i in by_dest {
                    let t = ents[i];
                    let x = Extent { shard: t.shard, start: t.start, len: t.end - t.start, dest: parts[i].0 as u64 };
                    match extents.last_mut() {
                        Some(p) if p.shard == x.shard && p.start + p.len == x.start && p.dest + p.len == x.dest => {
                            p.len += x.len
                        }
                        _ => extents.push(x),
                    }
                }
                locs.push(ExpertLoc { extents });
            }
            experts[l] = Some(locs);
        }
        if !problems.is_empty() {
            return Err(ModelError::Roster { dir: ck.dir.clone(), problems });
        }
        Ok(Roster { expert_layout: layout, experts })
    }
}
