//! DSpark's math: context rows into per-layer latents, and one draft block (see the module
//! contract in `mod.rs`). f32 throughout, every reduction in a fixed order, so drafts do not
//! depend on threading.

use super::DSparkModel;
use crate::backend::detmath::sigmoid;
use crate::backend::{AppendBuf, BackendError, MlaDims, Visible};

impl DSparkModel {
    /// Rotates the interleaved pairs (x[2i], x[2i+1]) of `x` by pos x inv_freq[i].
    fn rope(&self, x: &mut [f32], pos: usize) {
        for (i, pair) in x.chunks_exact_mut(2).enumerate() {
            let angle = pos as f64 * self.inv_freq[i];
            let (cos, sin) = ((angle.cos() * self.rope_mscale) as f32, (angle.sin() * self.rope_mscale) as f32);
            let (a, b) = (pair[0], pair[1]);
            pair[0] = a * cos - b * sin;
            pair[1] = b * cos + a * sin;
        }
    }

    /// `[kv_a_layernorm(c) | RoPE(k_pe)]` rows of layer `l` for inputs `x` [n, hidden] at
    /// positions `start..`.
    fn latents(&self, l: usize, x: &[f32], start: usize) -> Result<Vec<f32>, BackendError> {
        let c = &self.cfg;
        let lat = c.latent_width();
        let w = &self.layers[l];
        let mut out = vec![0f32; x.len() / c.hidden * lat];
        self.be.matmul_bf16(&w.kv_a, x, &mut out)?;
        for (i, row) in out.chunks_exact_mut(lat).enumerate() {
            let (latent, pe) = row.split_at_mut(c.kv_lora);
            self.be.rms_norm_rows(latent, &w.kv_a_norm, c.rms_eps)?;
            self.rope(pe, start + i);
        }
        Ok(out)
    }

    /// Context rows from the taps: `taps[j]` holds the rows [n, target hidden] after
    /// `target_layers[j]` for the tokens at positions `start..start + n`. Returns each draft
    /// layer's latent rows [n, kv_lora + rope].
    pub fn context_latents(&self, taps: &[&[f32]], start: usize) -> Result<Vec<Vec<f32>>, BackendError> {
        let c = &self.cfg;
        let th = c.target_hidden;
        let n = taps.first().map_or(0, |t| t.len() / th);
        let mut x = Vec::with_capacity(n * c.context_width());
        for r in 0..n {
            for t in taps {
                x.extend_from_slice(&t[r * th..(r + 1) * th]);
            }
        }
        let mut ctx = vec![0f32; n * c.hidden];
        self.be.matmul_bf16(&self.context_proj, &x, &mut ctx)?;
        self.be.rms_norm_rows(&mut ctx, &self.context_norm, c.rms_eps)?;
        (0..c.layers).map(|l| self.latents(l, &ctx, start)).collect()
    }

    /// One draft block after the context in `caches` (per layer [rows, kv_lora + rope]; the
    /// block's rows are appended for its attention and taken off again):
    /// `[anchor, mask x (block - 1)]` at positions `pos..`. Returns the logits of every row
    /// [block, vocab] (Markov term included) and the block's greedy drafts, one per row.
    /// On an error the caches are as before the call.
    pub fn block(
        &self,
        caches: &mut [AppendBuf],
        anchor: u32,
        pos: usize,
    ) -> Result<(Vec<f32>, Vec<u32>), BackendError> {
        let c = &self.cfg;
        let (h, n, nh) = (c.hidden, c.block, c.heads);
        let be = &*self.be;
        let lat = c.latent_width();
        let qd = c.nope + c.rope;
        let mut hs = vec![0f32; n * h];
        for (r, row) in hs.chunks_exact_mut(h).enumerate() {
            let t = if r == 0 { anchor } else { c.mask_token };
            self.embed.decode_row(t as usize, row);
        }
        let dims = MlaDims { heads: nh, nope: c.nope, rope: c.rope, lora: c.kv_lora, v_head: c.v_head };
        let scale = c.softmax_scale() as f32;
        for (l, w) in self.layers.iter().enumerate() {
            // Attention: h += o_proj(MLA(RMSNorm(h))).
            let mut x = hs.clone();
            be.rms_norm_rows(&mut x, &w.input_norm, c.rms_eps)?;
            let mut qa = vec![0f32; n * c.q_lora];
            be.matmul_bf16(&w.q_a, &x, &mut qa)?;
            be.rms_norm_rows(&mut qa, &w.q_a_norm, c.rms_eps)?;
            let mut q = vec![0f32; n * nh * qd];
            be.matmul_bf16(&w.q_b, &qa, &mut q)?;
            for (r, row) in q.chunks_exact_mut(nh * qd).enumerate() {
                for head in row.chunks_exact_mut(qd) {
                    self.rope(&mut head[c.nope..], pos + r);
                }
            }
            // Keys and values: the context cache, then the block's own rows (not kept).
            let kv = &mut caches[l];
            let context = kv.len();
            kv.extend_from_slice(&self.latents(l, &x, pos)?);
            let mut att = vec![0f32; n * nh * c.v_head];
            let done = be.mla_attention_with(&q, kv, context / lat, &w.kv_b, dims, scale, Visible::All, &mut att);
            kv.truncate(context);
            done?;
            let mut o = vec![0f32; n * h];
            be.matmul_bf16(&w.o_proj, &att, &mut o)?;
            add(&mut hs, &o);

            // MLP: h += down(silu(gate(x)) * up(x)), x = RMSNorm(h).
            let mut x = hs.clone();
            be.rms_norm_rows(&mut x, &w.post_norm, c.rms_eps)?;
            let (mut g, mut u) = (vec![0f32; n * c.intermediate], vec![0f32; n * c.intermediate]);
            be.matmul_bf16(&w.mlp.gate, &x, &mut g)?;
            be.matmul_bf16(&w.mlp.up, &x, &mut u)?;
            for (gi, ui) in g.iter_mut().zip(&u) {
                *gi = *gi * sigmoid(*gi) * ui;
            }
            let mut d = vec![0f32; n * h];
            be.matmul_bf16(&w.mlp.down, &g, &mut d)?;
            add(&mut hs, &d);
        }
        be.rms_norm_rows(&mut hs, &self.final_norm, c.rms_eps)?;
        let v = c.vocab;
        let mut logits = vec![0f32; n * v];
        be.matmul_bf16(&self.lm_head, &hs, &mut logits)?;
        if c.logit_scale != 1.0 {
            logits.iter_mut().for_each(|x| *x *= c.logit_scale);
        }
        // Markov head, row by row: each row's transition term follows the previous row's draft.
        let mut drafts = Vec::with_capacity(n);
        let mut prev = anchor;
        let mut emb = vec![0f32; c.markov_rank];
        let mut bias = vec![0f32; v];
        for row in logits.chunks_exact_mut(v) {
            self.markov_w1.decode_row(prev as usize, &mut emb);
            be.matmul_bf16(&self.markov_w2, &emb, &mut bias)?;
            add(row, &bias);
            prev = be.argmax(row)?;
            drafts.push(prev);
        }
        Ok((logits, drafts))
    }
}

fn add(acc: &mut [f32], x: &[f32]) {
    for (a, b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}
