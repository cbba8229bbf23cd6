//! Gated multi-head latent attention without RoPE (K3's full-attention layers).
//!
//! q = q_b(RMSNorm(q_a(x))) split per head into [nope | pe]; [c | k_pe] = kv_a(x); the cache keeps
//! [RMSNorm(c) | k_pe] per token; the backend's absorbed attention core mixes cached latents;
//! out = o_proj(attention * sigmoid(g_proj(x))). Causal; scale (nope + pe)^-1/2 (the same f32 as
//! `cpu::mla::attention`).
//!
//! Contract: [`forward`] appends the new rows' latents to the cache; a forward that is not
//! committed is undone by truncating the cache back (`MlaState::truncate`).

use super::weights::MlaWeights;
use crate::backend::detmath::sigmoid;
use crate::backend::{AppendBuf, Backend, BackendError, MlaDims, Visible};
use crate::model::K3Config;

/// One sequence's cache of one MLA layer.
#[derive(Clone)]
pub struct MlaState {
    /// [tokens][kv_lora + rope]: the normalised latent then the shared key part; a GPU backend
    /// mirrors it in device memory.
    pub latent: AppendBuf,
}

/// Runs one MLA layer on `n` new rows `xn` [n, hidden] after `st.latent`'s cached tokens. On an
/// error the new rows may have been appended (the caller truncates them: a rollback).
pub fn forward(
    be: &dyn Backend,
    c: &K3Config,
    w: &MlaWeights,
    st: &mut MlaState,
    xn: &[f32],
) -> Result<Vec<f32>, BackendError> {
    let h = c.hidden;
    let n = xn.len() / h;
    let nh = c.mla_heads;
    let (nope, rope, lora, vd) = (c.qk_nope, c.qk_rope, c.kv_lora, c.v_head);
    let qd = nope + rope;
    let lat = lora + rope;

    // The three projections of the input in one call (one submission on the GPU).
    let mut qa = vec![0f32; n * c.q_lora];
    let mut ckv = vec![0f32; n * lat];
    let mut gate = vec![0f32; n * nh * vd];
    be.matmul_bf16_many(&[&w.q_a, &w.kv_a, &w.g_proj], xn, &mut [&mut qa, &mut ckv, &mut gate])?;
    be.rms_norm_rows(&mut qa, &w.q_a_norm, c.mla_norm_eps)?;
    let mut q = vec![0f32; n * nh * qd];
    be.matmul_bf16(&w.q_b, &qa, &mut q)?;

    // The latent part of every row in one call (gathered: each row's rope part stays as it is).
    let mut c_kv: Vec<f32> = ckv.chunks_exact(lat).flat_map(|r| &r[..lora]).copied().collect();
    be.rms_norm_rows(&mut c_kv, &w.kv_a_norm, c.mla_norm_eps)?;
    for (r, cn) in ckv.chunks_exact_mut(lat).zip(c_kv.chunks_exact(lora)) {
        r[..lora].copy_from_slice(cn);
    }
    let past = st.latent.len() / lat;
    st.latent.extend_from_slice(&ckv);

    let dims = MlaDims { heads: nh, nope, rope, lora, v_head: vd };
    let mut att = vec![0f32; n * nh * vd];
    let scale = 1.0 / (qd as f32).sqrt();
    be.mla_attention_with(&q, &st.latent, past, &w.kv_b, dims, scale, Visible::Causal, &mut att)?;

    for (a, &g) in att.iter_mut().zip(&gate) {
        *a *= sigmoid(g);
    }
    let mut out = vec![0f32; n * h];
    be.matmul_bf16(&w.o_proj, &att, &mut out)?;
    Ok(out)
}
