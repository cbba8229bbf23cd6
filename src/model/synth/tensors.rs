//! The tensors of a synthetic checkpoint: every tensor K3's layout has for a spec (names, shapes,
//! dtypes, how each is filled) and the safetensors writer that streams their bytes.
//!
//! Contract: a tensor's bytes are a pure function of (seed, tensor name, chunk, and the trained
//! model its values are drawn from, if any) — independent of
//! thread count, shard split and write order; a file is written in chunks of `CHUNK` bytes (so
//! memory does not grow with the model) and fsynced; routed experts come first in a shard and the
//! data section starts 4 KiB-aligned, so real-size experts need no O_DIRECT widening.

use super::{SynthError, SynthSpec, io};
use crate::model::roster::{LM_HEAD, expert, layer, top};
use crate::sample::Rng;
use rayon::prelude::*;
use serde_json::{Value, json};
use std::io::Write;
use std::path::Path;

impl SynthSpec {
    /// Every tensor, grouped: [trunk of the model and each layer] then one group per expert.
    pub(super) fn plan(&self) -> Vec<Vec<TensorPlan>> {
        let (h, v) = (self.hidden, self.vocab);
        let mut groups = vec![vec![
            TensorPlan::bf16(top("embed_tokens.weight"), vec![v, h], Fill::Uniform(self.embed_scale)),
            TensorPlan::bf16(LM_HEAD.into(), vec![v, h], Fill::Uniform(3.0 / (h as f32).sqrt())),
            TensorPlan::bf16(top("norm.weight"), vec![h], Fill::Norm),
            TensorPlan::bf16(top("output_attn_res_norm.weight"), vec![h], Fill::Norm),
            TensorPlan::bf16(top("output_attn_res_proj.weight"), vec![1, h], Fill::Uniform(1.0 / (h as f32).sqrt())),
        ]];
        let lin = |name: String, o: usize, i: usize| {
            TensorPlan::bf16(name, vec![o, i], Fill::Uniform(1.0 / (i as f32).sqrt()))
        };
        for l in 0..self.layers {
            let n = |s: &str| layer(l, s);
            let mut g = vec![
                TensorPlan::bf16(n("input_layernorm.weight"), vec![h], Fill::Norm),
                TensorPlan::bf16(n("post_attention_layernorm.weight"), vec![h], Fill::Norm),
                TensorPlan::bf16(n("self_attention_res_norm.weight"), vec![h], Fill::Norm),
                TensorPlan::bf16(n("mlp_res_norm.weight"), vec![h], Fill::Norm),
                TensorPlan::bf16(
                    n("self_attention_res_proj.weight"),
                    vec![1, h],
                    Fill::Uniform(1.0 / (h as f32).sqrt()),
                ),
                TensorPlan::bf16(n("mlp_res_proj.weight"), vec![1, h], Fill::Uniform(1.0 / (h as f32).sqrt())),
            ];
            if self.is_mla(l) {
                let nh = self.mla_heads;
                g.push(lin(n("self_attn.q_a_proj.weight"), self.q_lora, h));
                g.push(TensorPlan::bf16(n("self_attn.q_a_layernorm.weight"), vec![self.q_lora], Fill::Norm));
                g.push(lin(n("self_attn.q_b_proj.weight"), nh * (self.qk_nope + self.qk_rope), self.q_lora));
                g.push(lin(n("self_attn.kv_a_proj_with_mqa.weight"), self.kv_lora + self.qk_rope, h));
                g.push(TensorPlan::bf16(n("self_attn.kv_a_layernorm.weight"), vec![self.kv_lora], Fill::Norm));
                g.push(lin(n("self_attn.kv_b_proj.weight"), nh * (self.qk_nope + self.v_head), self.kv_lora));
                g.push(lin(n("self_attn.g_proj.weight"), nh * self.v_head, h));
                g.push(lin(n("self_attn.o_proj.weight"), h, nh * self.v_head));
            } else {
                let (dk, p) = (self.kda_head_dim, self.kda_heads * self.kda_head_dim);
                for q in ["q", "k", "v"] {
                    g.push(lin(n(&format!("self_attn.{q}_proj.weight")), p, h));
                    g.push(TensorPlan::f32(
                        n(&format!("self_attn.{q}_conv1d.weight")),
                        vec![p, 1, self.conv_width],
                        Fill::Uniform(0.8),
                    ));
                }
                g.push(lin(n("self_attn.f_a_proj.weight"), dk, h));
                g.push(lin(n("self_attn.f_b_proj.weight"), p, dk));
                g.push(lin(n("self_attn.b_proj.weight"), self.kda_heads, h));
                g.push(lin(n("self_attn.g_proj.weight"), p, h));
                g.push(TensorPlan::f32(n("self_attn.A_log"), vec![self.kda_heads], Fill::Uniform(0.8)));
                g.push(TensorPlan::f32(n("self_attn.dt_bias"), vec![p], Fill::Uniform(1.5)));
                g.push(TensorPlan::bf16(n("self_attn.o_norm.weight"), vec![dk], Fill::Norm));
                g.push(lin(n("self_attn.o_proj.weight"), h, p));
            }
            let moe = self.experts > 0 && l >= self.dense_layers;
            if !moe {
                g.push(lin(n("mlp.gate_proj.weight"), self.dense_inter, h));
                g.push(lin(n("mlp.up_proj.weight"), self.dense_inter, h));
                g.push(lin(n("mlp.down_proj.weight"), h, self.dense_inter));
                groups.push(g);
                continue;
            }
            let (e, lat, fi) = (self.experts, self.expert_latent, self.expert_inter);
            g.push(TensorPlan::bf16(
                n("block_sparse_moe.gate.weight"),
                vec![e, h],
                Fill::Uniform(2.0 / (h as f32).sqrt()),
            ));
            g.push(TensorPlan::f32(n("block_sparse_moe.gate.e_score_correction_bias"), vec![e], Fill::Uniform(0.05)));
            g.push(lin(n("block_sparse_moe.routed_expert_down_proj.weight"), lat, h));
            g.push(TensorPlan::bf16(n("block_sparse_moe.routed_expert_norm.weight"), vec![lat], Fill::Norm));
            g.push(lin(n("block_sparse_moe.routed_expert_up_proj.weight"), h, lat));
            if self.shared_experts > 0 {
                let si = self.shared_experts * fi;
                g.push(lin(n("block_sparse_moe.shared_experts.gate_proj.weight"), si, h));
                g.push(lin(n("block_sparse_moe.shared_experts.up_proj.weight"), si, h));
                g.push(lin(n("block_sparse_moe.shared_experts.down_proj.weight"), h, si));
            }
            groups.push(g);
            for x in 0..e {
                let mut eg = Vec::with_capacity(6);
                for (proj, rows, cols) in [("w1", fi, lat), ("w3", fi, lat), ("w2", lat, fi)] {
                    // rms(w) ~ 1/sqrt(cols): E2M1 codes have rms ~3.2.
                    let centre = 127 - (3.2 * (cols as f32).sqrt()).log2().round() as i32;
                    eg.push(TensorPlan::u8(expert(l, x, proj, "weight_packed"), vec![rows, cols / 2], Fill::Bytes));
                    eg.push(TensorPlan::u8(
                        expert(l, x, proj, "weight_scale"),
                        vec![rows, cols / 32],
                        Fill::Scale(centre as u8),
                    ));
                }
                groups.push(eg);
            }
        }
        groups
    }
}

#[derive(Clone, Copy, Debug)]
pub(crate) enum Fill {
    /// Uniform in [-a, a].
    Uniform(f32),
    /// 1 + uniform in [-0.1, 0.1] (norm weights).
    Norm,
    /// Uniformly random bytes (MXFP4 codes).
    Bytes,
    /// E8M0 scale bytes in centre-1 ..= centre+1.
    Scale(u8),
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Dtype {
    Bf16,
    F32,
    U8,
}

pub(crate) struct TensorPlan {
    pub(super) name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    fill: Fill,
    /// Drawn from a trained tensor's values instead of `fill` (`SynthSpec::trunk_values_from`).
    trained: Option<Trained>,
}

/// A trained tensor's bf16 values to draw from, and the power of two they are scaled down by.
#[derive(Clone)]
pub(crate) struct Trained {
    pool: std::sync::Arc<Vec<u16>>,
    shift: u8,
}

impl TensorPlan {
    pub(crate) fn bf16(name: String, shape: Vec<usize>, fill: Fill) -> Self {
        TensorPlan { name, dtype: Dtype::Bf16, shape, fill, trained: None }
    }
    pub(crate) fn f32(name: String, shape: Vec<usize>, fill: Fill) -> Self {
        TensorPlan { name, dtype: Dtype::F32, shape, fill, trained: None }
    }
    fn u8(name: String, shape: Vec<usize>, fill: Fill) -> Self {
        TensorPlan { name, dtype: Dtype::U8, shape, fill, trained: None }
    }
    fn elem(&self) -> usize {
        match self.dtype {
            Dtype::Bf16 => 2,
            Dtype::F32 => 4,
            Dtype::U8 => 1,
        }
    }
    pub(crate) fn bytes(&self) -> u64 {
        (self.shape.iter().product::<usize>() * self.elem()) as u64
    }
    fn dtype_name(&self) -> &'static str {
        match self.dtype {
            Dtype::Bf16 => "BF16",
            Dtype::F32 => "F32",
            Dtype::U8 => "U8",
        }
    }

    /// Bytes `[chunk * CHUNK, ..)` of this tensor, a pure function of (seed, name, chunk).
    fn chunk_bytes(&self, seed: u64, chunk: usize) -> Vec<u8> {
        let total = self.bytes() as usize;
        let start = chunk * CHUNK;
        let len = CHUNK.min(total - start);
        let mut rng = Rng::new(seed ^ fnv(self.name.as_bytes()) ^ (chunk as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let mut out = Vec::with_capacity(len);
        match (self.dtype, self.fill) {
            (_, Fill::Bytes) => {
                while out.len() < len {
                    out.extend_from_slice(&rng.next_u64().to_le_bytes());
                }
                out.truncate(len);
            }
            (_, Fill::Scale(c)) => {
                out.extend((0..len).map(|_| c.wrapping_add((rng.next_u64() % 3) as u8).wrapping_sub(1)))
            }
            (Dtype::Bf16, _) if self.trained.is_some() => {
                let Some(t) = &self.trained else { return out };
                for _ in 0..len / 2 {
                    let b = t.pool[(rng.next_u64() % t.pool.len() as u64) as usize];
                    out.extend_from_slice(&scale_down(b, t.shift).to_le_bytes());
                }
            }
            (Dtype::Bf16, f) => {
                for _ in 0..len / 2 {
                    let x = sample(&mut rng, f);
                    out.extend_from_slice(&bf16_bits(x).to_le_bytes());
                }
            }
            (Dtype::F32, f) => {
                for _ in 0..len / 4 {
                    out.extend_from_slice(&sample(&mut rng, f).to_le_bytes());
                }
            }
            (Dtype::U8, _) => out.resize(len, 0),
        }
        out
    }
}

/// `b` (bf16 bits) divided by `2^shift`, exactly where the result is normal (its exponent field
/// stays above 0); smaller results flush to a signed zero. Zeros, infinities and NaNs stay.
fn scale_down(b: u16, shift: u8) -> u16 {
    let e = (b >> 7) & 0xff;
    match e {
        0 | 0xff => b,
        e if e > shift as u16 => (b & 0x807f) | ((e - shift as u16) << 7),
        _ => b & 0x8000,
    }
}

/// The role of a tensor: its name with the layer number taken out.
fn role(name: &str) -> String {
    match name.split_once(".layers.") {
        Some((a, rest)) => match rest.split_once('.') {
            Some((_, tail)) => format!("{a}.layers.*.{tail}"),
            None => name.to_string(),
        },
        None => name.to_string(),
    }
}

/// Makes every bf16 matrix of `groups` that would be uniform random draw its values from the
/// trained model in `dir` instead: from all of that model's tensors of the same role (the name
/// without its layer number), else from all its bf16 matrices; scaled down by the power of two
/// nearest to `sqrt(cols / trained cols)`, as a wider fan-in's initialisation would be. So the
/// synth trunk has the trained model's per-tensor joint sign / exponent / mantissa distribution.
pub(crate) fn draw_from_trained(groups: &mut [Vec<TensorPlan>], dir: &Path) -> Result<(), SynthError> {
    use std::collections::HashMap;
    use std::sync::Arc;
    let bad = |msg: String| SynthError::Trained { path: dir.to_path_buf(), msg };
    let ck = crate::model::Checkpoint::open(dir).map_err(|e| bad(e.to_string()))?;
    let mut names: Vec<&str> = ck.tensor_names().collect();
    names.sort_unstable();
    // role -> (values, cols of the first such tensor)
    let mut pools: HashMap<String, (Vec<u16>, usize)> = HashMap::new();
    let mut all: Vec<u16> = Vec::new();
    let mut all_cols = 0;
    for n in names {
        let Some(e) = ck.get(n) else { continue };
        if e.dtype != safetensors::Dtype::BF16 || e.shape.len() != 2 || e.shape[0] < 2 {
            continue;
        }
        let vals: Vec<u16> = ck.bytes(e).chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
        all.extend_from_slice(&vals);
        all_cols = all_cols.max(e.shape[1]);
        let p = pools.entry(role(n)).or_insert_with(|| (Vec::new(), e.shape[1]));
        p.0.extend(vals);
    }
    if all.is_empty() {
        return Err(bad("it has no bf16 matrices to draw trunk values from".into()));
    }
    let all = (Arc::new(all), all_cols);
    let pools: HashMap<String, (Arc<Vec<u16>>, usize)> =
        pools.into_iter().map(|(k, (v, c))| (k, (Arc::new(v), c))).collect();
    for t in groups.iter_mut().flatten() {
        if t.dtype != Dtype::Bf16 || t.shape.len() != 2 || !matches!(t.fill, Fill::Uniform(_)) {
            continue;
        }
        let (pool, cols) = pools.get(&role(&t.name)).map_or_else(|| all.clone(), |(p, c)| (p.clone(), *c));
        let shift = (0.5 * (t.shape[1] as f64 / cols as f64).log2()).round().clamp(0.0, 60.0) as u8;
        t.trained = Some(Trained { pool, shift });
    }
    Ok(())
}

/// Generation chunk (bytes); a multiple of 4 so element boundaries never straddle chunks.
const CHUNK: usize = 1 << 20;

fn sample(rng: &mut Rng, f: Fill) -> f32 {
    let u = (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
    match f {
        Fill::Uniform(a) => u * a,
        Fill::Norm => 1.0 + 0.1 * u,
        _ => 0.0,
    }
}

fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// Writes `tensors` as one safetensors file at `path` (fsynced), adding the bytes written to
/// `done` and reporting `progress(done, total)`; content is a pure function of (`seed`, names).
pub(crate) fn write_safetensors(
    path: &Path,
    tensors: &mut [TensorPlan],
    seed: u64,
    done: &mut u64,
    total: u64,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<(), SynthError> {
    // Routed experts first (so with the header padded to 4 KiB, experts of real K3 size start
    // 4 KiB-aligned and O_DIRECT reads need no widening); then the usual order: larger element
    // alignment first, then by name. Safetensors does not prescribe an order.
    let is_expert = |t: &TensorPlan| t.dtype == Dtype::U8;
    tensors.sort_by(|a, b| {
        is_expert(b).cmp(&is_expert(a)).then_with(|| b.elem().cmp(&a.elem())).then_with(|| a.name.cmp(&b.name))
    });
    let mut header = serde_json::Map::new();
    let mut off = 0u64;
    for t in tensors.iter() {
        header.insert(
            t.name.clone(),
            json!({"dtype": t.dtype_name(), "shape": t.shape, "data_offsets": [off, off + t.bytes()]}),
        );
        off += t.bytes();
    }
    let mut h = serde_json::to_vec(&Value::Object(header)).unwrap_or_default();
    // Pad so the data section starts 4 KiB-aligned (8-byte length prefix + header).
    while !(h.len() + 8).is_multiple_of(4096) {
        h.push(b' ');
    }
    let f = std::fs::File::create(path).map_err(io(path))?;
    let mut w = std::io::BufWriter::with_capacity(8 << 20, f);
    // Every tensor's checksum, from the bytes as written (`model::checksums`, source `written`).
    let mut sums = crate::model::checksums::TensorHasher::new();
    sums.update(&(h.len() as u64).to_le_bytes());
    sums.update(&h);
    w.write_all(&(h.len() as u64).to_le_bytes()).map_err(io(path))?;
    w.write_all(&h).map_err(io(path))?;
    for t in tensors.iter() {
        let chunks = (t.bytes() as usize).div_ceil(CHUNK);
        // Generate a batch of chunks in parallel, write them in order.
        for batch in (0..chunks).collect::<Vec<_>>().chunks(16) {
            let data: Vec<Vec<u8>> = batch.par_iter().map(|&c| t.chunk_bytes(seed, c)).collect();
            for d in data {
                sums.update(&d);
                w.write_all(&d).map_err(io(path))?;
                *done += d.len() as u64;
            }
            progress(*done, total);
            // Ctrl-C: stop here; the caller removes the temporary directory.
            if crate::util::cancel_requested() {
                return Err(SynthError::Interrupted);
            }
        }
    }
    let f = w.into_inner().map_err(|e| SynthError::Io { path: path.to_path_buf(), source: e.into_error() })?;
    crate::util::sync_file(&f).map_err(io(path))?;
    drop(f);
    use crate::model::checksums::{ShardRecord, Source};
    use crate::model::sidecar::save;
    let digest =
        sums.finish().map_err(|e| SynthError::Io { path: path.to_path_buf(), source: std::io::Error::other(e) })?;
    let rec = ShardRecord::new(path, &digest, Source::Written).map_err(io(path))?;
    save(path.parent().unwrap_or(Path::new(".")), vec![rec]).map_err(io(path))?;
    Ok(())
}
