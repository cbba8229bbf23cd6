//! Gated multi-head latent attention without RoPE (K3's full-attention layers).
//!
//! q = q_b(RMSNorm(q_a(x))) split per head into [nope | pe]; [c | k_pe] = kv_a(x); the cache keeps
//! [RMSNorm(c) | k_pe] per token. Keys and values are never expanded: the query's nope part is
//! absorbed through kv_b's key rows (score = (W_k^T q_nope) . c + q_pe . k_pe), the softmax mixes
//! cached latents, and kv_b's value rows map the mixed latent to the head's value. Then
//! out = o_proj(attention * sigmoid(g_proj(x))). Causal; scale (nope + pe)^-1/2.

use super::state::MlaState;
use super::weights::MlaWeights;
use crate::cpu::ops::{rms_norm_inplace, sigmoid, softmax_inplace};
use crate::cpu::{decode_bf16_row, dot_f32, matmul_bf16};
use crate::model::K3Config;
use rayon::prelude::*;

/// Runs one MLA layer on `n` new rows `xn` [n, hidden] after `st.latent`'s cached tokens.
pub fn forward(c: &K3Config, w: &MlaWeights, st: &mut MlaState, xn: &[f32]) -> Vec<f32> {
    let h = c.hidden;
    let n = xn.len() / h;
    let nh = c.mla_heads;
    let (nope, rope, lora, vd) = (c.qk_nope, c.qk_rope, c.kv_lora, c.v_head);
    let qd = nope + rope;
    let lat = lora + rope;

    let mut qa = vec![0f32; n * c.q_lora];
    matmul_bf16(&w.q_a, xn, &mut qa);
    for r in qa.chunks_exact_mut(c.q_lora) {
        rms_norm_inplace(r, &w.q_a_norm, c.mla_norm_eps);
    }
    let mut q = vec![0f32; n * nh * qd];
    matmul_bf16(&w.q_b, &qa, &mut q);

    let mut ckv = vec![0f32; n * lat];
    matmul_bf16(&w.kv_a, xn, &mut ckv);
    for r in ckv.chunks_exact_mut(lat) {
        rms_norm_inplace(&mut r[..lora], &w.kv_a_norm, c.mla_norm_eps);
    }
    let past = st.latent.len() / lat;
    st.latent.extend_from_slice(&ckv);
    let cache = &st.latent;

    let scale = 1.0 / (qd as f32).sqrt();
    // One task per (row, head): absorbed query, scores over the causal prefix, latent mix, value.
    let mut att = vec![0f32; n * nh * vd];
    att.par_chunks_mut(vd).enumerate().for_each(|(idx, out)| {
        let (t, hd) = (idx / nh, idx % nh);
        let qh = &q[(t * nh + hd) * qd..][..qd];
        let (q_nope, q_pe) = qh.split_at(nope);
        // q_abs = W_k^T q_nope, accumulated over the head's key rows in order.
        let mut q_abs = vec![0f32; lora];
        let mut wrow = vec![0f32; lora];
        for (i, &qi) in q_nope.iter().enumerate() {
            decode_bf16_row(w.kv_b.row(hd * (nope + vd) + i), &mut wrow);
            crate::cpu::ops::axpy(&mut q_abs, qi, &wrow);
        }
        let len = past + t + 1;
        let mut p: Vec<f32> = (0..len)
            .map(|s| {
                let cs = &cache[s * lat..(s + 1) * lat];
                (dot_f32(&q_abs, &cs[..lora]) + dot_f32(q_pe, &cs[lora..])) * scale
            })
            .collect();
        softmax_inplace(&mut p);
        let mut mixed = vec![0f32; lora];
        for (s, &ps) in p.iter().enumerate() {
            crate::cpu::ops::axpy(&mut mixed, ps, &cache[s * lat..s * lat + lora]);
        }
        for (j, o) in out.iter_mut().enumerate() {
            decode_bf16_row(w.kv_b.row(hd * (nope + vd) + nope + j), &mut wrow);
            *o = dot_f32(&wrow, &mixed);
        }
    });

    let mut gate = vec![0f32; n * nh * vd];
    matmul_bf16(&w.g_proj, xn, &mut gate);
    for (a, &g) in att.iter_mut().zip(&gate) {
        *a *= sigmoid(g);
    }
    let mut out = vec![0f32; n * h];
    matmul_bf16(&w.o_proj, &att, &mut out);
    out
}
