//! The resident trunk: its matrices as `--trunk` asks — bf16 (zero-copy views that keep the mapped
//! shards alive), losslessly coded (from the model's `trunk-coded/` pack, `model::trunk_pack`) or
//! int8 (quantised at load; not exact) — and small vectors converted to f32 once at load. Built
//! only after the roster check has passed.

use crate::backend::Bf16Mat;
use crate::backend::int8::Int8Mat;
use crate::model::config::{AttnKind, FfnKind};
use crate::model::roster::{LM_HEAD, layer, top};
use crate::model::{Checkpoint, K3Config, ModelError};
use safetensors::tensor::Dtype;
use std::sync::Arc;

pub struct KdaWeights {
    pub q_proj: Bf16Mat,
    pub k_proj: Bf16Mat,
    pub v_proj: Bf16Mat,
    /// Depthwise conv taps, [P, width] row-major; the last tap multiplies the current token.
    pub q_conv: Vec<f32>,
    pub k_conv: Vec<f32>,
    pub v_conv: Vec<f32>,
    pub f_a: Bf16Mat,
    pub f_b: Bf16Mat,
    pub b_proj: Bf16Mat,
    pub g_proj: Bf16Mat,
    /// exp(A_log[h]) for each head (the first `heads` entries of the shipped tensor).
    pub a_exp: Vec<f32>,
    pub dt_bias: Vec<f32>,
    pub o_norm: Vec<f32>,
    pub o_proj: Bf16Mat,
}

pub struct MlaWeights {
    pub q_a: Bf16Mat,
    pub q_a_norm: Vec<f32>,
    pub q_b: Bf16Mat,
    pub kv_a: Bf16Mat,
    pub kv_a_norm: Vec<f32>,
    pub kv_b: Bf16Mat,
    pub g_proj: Bf16Mat,
    pub o_proj: Bf16Mat,
}

pub struct MlpWeights {
    pub gate: Bf16Mat,
    pub up: Bf16Mat,
    pub down: Bf16Mat,
}

pub struct MoeWeights {
    pub router: Bf16Mat,
    pub bias: Vec<f32>,
    pub down_proj: Bf16Mat,
    pub routed_norm: Option<Vec<f32>>,
    pub up_proj: Bf16Mat,
    pub shared: Option<MlpWeights>,
}

// One per layer, built once: the size difference between variants costs nothing worth a Box.
#[allow(clippy::large_enum_variant)]
pub enum Attn {
    Kda(KdaWeights),
    Mla(MlaWeights),
}

#[allow(clippy::large_enum_variant)]
pub enum Ffn {
    Dense(MlpWeights),
    Moe(MoeWeights),
}

pub struct LayerWeights {
    pub input_norm: Vec<f32>,
    pub post_attn_norm: Vec<f32>,
    /// AttnRes score weights: norm weight * proj weight (computed once in f32).
    pub attn_res_score: Vec<f32>,
    pub mlp_res_score: Vec<f32>,
    pub attn: Attn,
    pub ffn: Ffn,
}

/// How the trunk's bf16 matrices are held (`--trunk`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Trunk {
    /// Coded when the model directory has a coded trunk (`deltafin pack-trunk`), else bf16.
    #[default]
    Auto,
    /// bf16 as shipped, mapped from the shards.
    Bf16,
    /// Losslessly coded (bit-identical output, about 3/4 of bf16's memory).
    Coded,
    /// int8 with a scale per row (per-row absmax): NOT exact, opt-in.
    Int8,
}

impl Trunk {
    pub fn name(self) -> &'static str {
        match self {
            Trunk::Auto => "auto",
            Trunk::Bf16 => "bf16",
            Trunk::Coded => "coded",
            Trunk::Int8 => "int8",
        }
    }

    /// Whether the model computed is the shipped model, bit for bit.
    pub fn exact(self) -> bool {
        self != Trunk::Int8
    }
}

/// Where a trunk matrix comes from while loading.
pub enum TrunkSource<'a> {
    Bf16,
    Int8,
    /// A coded matrix by tensor name (the pack has been checked against the model).
    Coded(&'a dyn Fn(&str) -> Option<Arc<crate::backend::coded::CodedMat>>),
    /// bf16, recording each matrix's tensor name in load order (what `pack-trunk` codes).
    Names(&'a std::cell::RefCell<Vec<String>>),
}

pub struct Weights {
    pub embed: Bf16Mat,
    pub lm_head: Bf16Mat,
    pub final_norm: Vec<f32>,
    pub output_res_score: Vec<f32>,
    pub layers: Vec<LayerWeights>,
}

struct Loader<'a> {
    ck: &'a Checkpoint,
    src: &'a TrunkSource<'a>,
}

impl<'a> Loader<'a> {
    fn entry(&self, name: &str) -> Result<&'a crate::model::checkpoint::TensorEntry, ModelError> {
        self.ck.get(name).ok_or_else(|| ModelError::Roster {
            dir: self.ck.dir.clone(),
            problems: vec![format!("missing tensor `{name}`")],
        })
    }

    fn mat(&self, name: &str) -> Result<Bf16Mat, ModelError> {
        let e = self.entry(name)?;
        let (rows, cols) = match e.shape.as_slice() {
            [r, c] => (*r, *c),
            s => {
                return Err(ModelError::Safetensors {
                    path: self.ck.shard_path(e.shard).to_path_buf(),
                    msg: format!("tensor `{name}` has shape {s:?}, expected a matrix"),
                });
            }
        };
        // Read into memory and checked against the recorded checksum (`Checkpoint::shared_bytes`).
        let bf16 = || self.ck.shared_bytes(e).map(|b| Bf16Mat::new(b, rows, cols));
        Ok(match self.src {
            TrunkSource::Bf16 => bf16()?,
            TrunkSource::Names(names) => {
                // Only the names are wanted (`pack-trunk`): a view of the mapping, nothing read.
                names.borrow_mut().push(name.to_string());
                Bf16Mat::new(self.ck.mapped_bytes(e), rows, cols)
            }
            TrunkSource::Int8 => Bf16Mat::int8(Arc::new(Int8Mat::quantize(&self.ck.shared_bytes(e)?, rows, cols))),
            TrunkSource::Coded(get) => match get(name) {
                Some(m) if (m.rows, m.cols) == (rows, cols) => Bf16Mat::coded(m),
                Some(m) => {
                    return Err(ModelError::Safetensors {
                        path: self.ck.dir.join(crate::model::trunk_pack::DIR),
                        msg: format!(
                            "coded tensor `{name}` is {} x {}, the checkpoint's {rows} x {cols}",
                            m.rows, m.cols
                        ),
                    });
                }
                None => {
                    return Err(ModelError::Safetensors {
                        path: self.ck.dir.join(crate::model::trunk_pack::DIR),
                        msg: format!("the coded trunk has no tensor `{name}`; re-run `deltafin pack-trunk`"),
                    });
                }
            },
        })
    }

    /// Any F32/BF16/F16 tensor, flattened to f32 (exact conversions).
    fn vec(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        let e = self.entry(name)?;
        let b = self.ck.shared_bytes(e)?;
        match e.dtype {
            Dtype::F32 => Ok(b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()),
            Dtype::BF16 => Ok(b.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect()),
            Dtype::F16 => Ok(b.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect()),
            d => Err(ModelError::Safetensors {
                path: self.ck.shard_path(e.shard).to_path_buf(),
                msg: format!("tensor `{name}` has dtype {d:?}, expected F32, BF16 or F16"),
            }),
        }
    }

    fn score(&self, norm: &str, proj: &str) -> Result<Vec<f32>, ModelError> {
        let n = self.vec(norm)?;
        let p = self.vec(proj)?;
        Ok(n.iter().zip(&p).map(|(a, b)| a * b).collect())
    }

    fn mlp(&self, prefix: &str) -> Result<MlpWeights, ModelError> {
        Ok(MlpWeights {
            gate: self.mat(&format!("{prefix}gate_proj.weight"))?,
            up: self.mat(&format!("{prefix}up_proj.weight"))?,
            down: self.mat(&format!("{prefix}down_proj.weight"))?,
        })
    }
}

impl Weights {
    /// Borrows the bf16 trunk from a checkpoint whose roster has been checked.
    pub fn load(c: &K3Config, ck: &Checkpoint) -> Result<Self, ModelError> {
        Self::load_from(c, ck, &TrunkSource::Bf16)
    }

    /// The trunk with its matrices from `src`.
    pub fn load_from(c: &K3Config, ck: &Checkpoint, src: &TrunkSource) -> Result<Self, ModelError> {
        let ld = Loader { ck, src };
        let mut layers = Vec::with_capacity(c.layers);
        for l in 0..c.layers {
            let n = |s: &str| layer(l, s);
            let attn = match c.attn[l] {
                AttnKind::Kda => {
                    let a_log = ld.vec(&n("self_attn.A_log"))?;
                    Attn::Kda(KdaWeights {
                        q_proj: ld.mat(&n("self_attn.q_proj.weight"))?,
                        k_proj: ld.mat(&n("self_attn.k_proj.weight"))?,
                        v_proj: ld.mat(&n("self_attn.v_proj.weight"))?,
                        q_conv: ld.vec(&n("self_attn.q_conv1d.weight"))?,
                        k_conv: ld.vec(&n("self_attn.k_conv1d.weight"))?,
                        v_conv: ld.vec(&n("self_attn.v_conv1d.weight"))?,
                        f_a: ld.mat(&n("self_attn.f_a_proj.weight"))?,
                        f_b: ld.mat(&n("self_attn.f_b_proj.weight"))?,
                        b_proj: ld.mat(&n("self_attn.b_proj.weight"))?,
                        g_proj: ld.mat(&n("self_attn.g_proj.weight"))?,
                        a_exp: a_log[..c.kda_heads].iter().map(|a| a.exp()).collect(),
                        dt_bias: ld.vec(&n("self_attn.dt_bias"))?,
                        o_norm: ld.vec(&n("self_attn.o_norm.weight"))?,
                        o_proj: ld.mat(&n("self_attn.o_proj.weight"))?,
                    })
                }
                AttnKind::Mla => Attn::Mla(MlaWeights {
                    q_a: ld.mat(&n("self_attn.q_a_proj.weight"))?,
                    q_a_norm: ld.vec(&n("self_attn.q_a_layernorm.weight"))?,
                    q_b: ld.mat(&n("self_attn.q_b_proj.weight"))?,
                    kv_a: ld.mat(&n("self_attn.kv_a_proj_with_mqa.weight"))?,
                    kv_a_norm: ld.vec(&n("self_attn.kv_a_layernorm.weight"))?,
                    kv_b: ld.mat(&n("self_attn.kv_b_proj.weight"))?,
                    g_proj: ld.mat(&n("self_attn.g_proj.weight"))?,
                    o_proj: ld.mat(&n("self_attn.o_proj.weight"))?,
                }),
            };
            let ffn = match c.ffn[l] {
                FfnKind::Dense => Ffn::Dense(ld.mlp(&n("mlp."))?),
                FfnKind::Moe => Ffn::Moe(MoeWeights {
                    router: ld.mat(&n("block_sparse_moe.gate.weight"))?,
                    bias: ld.vec(&n("block_sparse_moe.gate.e_score_correction_bias"))?,
                    down_proj: ld.mat(&n("block_sparse_moe.routed_expert_down_proj.weight"))?,
                    routed_norm: if c.latent_norm {
                        Some(ld.vec(&n("block_sparse_moe.routed_expert_norm.weight"))?)
                    } else {
                        None
                    },
                    up_proj: ld.mat(&n("block_sparse_moe.routed_expert_up_proj.weight"))?,
                    shared: if c.shared_experts > 0 {
                        Some(ld.mlp(&n("block_sparse_moe.shared_experts."))?)
                    } else {
                        None
                    },
                }),
            };
            layers.push(LayerWeights {
                input_norm: ld.vec(&n("input_layernorm.weight"))?,
                post_attn_norm: ld.vec(&n("post_attention_layernorm.weight"))?,
                attn_res_score: ld.score(&n("self_attention_res_norm.weight"), &n("self_attention_res_proj.weight"))?,
                mlp_res_score: ld.score(&n("mlp_res_norm.weight"), &n("mlp_res_proj.weight"))?,
                attn,
                ffn,
            });
        }
        Ok(Weights {
            embed: ld.mat(&top("embed_tokens.weight"))?,
            lm_head: ld.mat(LM_HEAD)?,
            final_norm: ld.vec(&top("norm.weight"))?,
            output_res_score: ld.score(&top("output_attn_res_norm.weight"), &top("output_attn_res_proj.weight"))?,
            layers,
        })
    }

    /// The trunk matrices a device backend keeps in its memory from the start (`Device::prepare`):
    /// the embeddings, lm_head and every layer's projections (MLA's kv_b goes up on first use).
    pub fn device_matrices(&self) -> Vec<&Bf16Mat> {
        let mut mats: Vec<&Bf16Mat> = vec![&self.embed, &self.lm_head];
        for l in &self.layers {
            match &l.attn {
                Attn::Kda(k) => {
                    mats.extend([&k.q_proj, &k.k_proj, &k.v_proj, &k.f_a, &k.f_b, &k.b_proj, &k.g_proj, &k.o_proj])
                }
                Attn::Mla(m) => mats.extend([&m.q_a, &m.q_b, &m.kv_a, &m.g_proj, &m.o_proj]),
            }
            match &l.ffn {
                Ffn::Dense(d) => mats.extend([&d.gate, &d.up, &d.down]),
                Ffn::Moe(m) => {
                    mats.extend([&m.router, &m.down_proj, &m.up_proj]);
                    if let Some(s) = &m.shared {
                        mats.extend([&s.gate, &s.up, &s.down]);
                    }
                }
            }
        }
        mats
    }

    /// Bytes of the resident trunk (everything but routed experts).
    pub fn resident_bytes(&self) -> usize {
        let m = |m: &Bf16Mat| m.byte_len();
        let v = |v: &Vec<f32>| v.len() * 4;
        let mut total = m(&self.embed) + m(&self.lm_head) + v(&self.final_norm) + v(&self.output_res_score);
        for l in &self.layers {
            total += v(&l.input_norm) + v(&l.post_attn_norm) + v(&l.attn_res_score) + v(&l.mlp_res_score);
            total += match &l.attn {
                Attn::Kda(k) => {
                    [&k.q_proj, &k.k_proj, &k.v_proj, &k.f_a, &k.f_b, &k.b_proj, &k.g_proj, &k.o_proj]
                        .iter()
                        .map(|x| m(x))
                        .sum::<usize>()
                        + [&k.q_conv, &k.k_conv, &k.v_conv, &k.a_exp, &k.dt_bias, &k.o_norm]
                            .iter()
                            .map(|x| v(x))
                            .sum::<usize>()
                }
                Attn::Mla(a) => {
                    [&a.q_a, &a.q_b, &a.kv_a, &a.kv_b, &a.g_proj, &a.o_proj].iter().map(|x| m(x)).sum::<usize>()
                        + v(&a.q_a_norm)
                        + v(&a.kv_a_norm)
                }
            };
            let mlp = |w: &MlpWeights| m(&w.gate) + m(&w.up) + m(&w.down);
            total += match &l.ffn {
                Ffn::Dense(w) => mlp(w),
                Ffn::Moe(w) => {
                    m(&w.router)
                        + v(&w.bias)
                        + m(&w.down_proj)
                        + m(&w.up_proj)
                        + w.routed_norm.as_ref().map_or(0, v)
                        + w.shared.as_ref().map_or(0, mlp)
                }
            };
        }
        total
    }
}
