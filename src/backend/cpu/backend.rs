//! The CPU kernels as a backend: [`CpuBackend`] implements `backend::Backend` and
//! `backend::Device` on the kernels of this folder, as `gpu/` implements them on WGSL.
//!
//! Contract: every operation returns `Ok` (nothing here can fail), and each is the kernels' bits:
//! rows split across threads are independent, so the results never depend on the thread count.

use super::{kda, mla, ops};
use crate::backend::{
    AppendBuf, Backend, BackendError, Bf16Mat, Device, HeadIn, MlaDims, Mxfp4Mat, RouteRule, Situ, StateBuf, Visible,
};
use rayon::prelude::*;

/// The CPU kernels as a backend (infallible: every operation returns `Ok`).
#[derive(Default)]
pub struct CpuBackend;

impl Device for CpuBackend {
    fn describe(&self) -> String {
        format!("cpu {} x{}", super::isa().name(), rayon::current_num_threads())
    }
}

impl Backend for CpuBackend {
    fn matmul_bf16(&self, w: &Bf16Mat, xs: &[f32], out: &mut [f32]) -> Result<(), BackendError> {
        super::matmul_bf16(w, xs, out);
        Ok(())
    }

    fn matmul_mxfp4(&self, w: &Mxfp4Mat, xds: &[f32], out: &mut [f32]) -> Result<(), BackendError> {
        super::matmul_mxfp4(w, xds, out);
        Ok(())
    }

    fn rms_norm_rows(&self, x: &mut [f32], w: &[f32], eps: f32) -> Result<(), BackendError> {
        // Rows are independent: across threads (a prefill's rows), the same bits.
        if x.len() >= 1 << 16 && !w.is_empty() {
            x.par_chunks_exact_mut(w.len()).for_each(|r| ops::rms_norm_inplace(r, w, eps));
            return Ok(());
        }
        for r in x.chunks_exact_mut(w.len()) {
            ops::rms_norm_inplace(r, w, eps);
        }
        Ok(())
    }

    fn situ(&self, situ: Situ, gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<(), BackendError> {
        // Element-wise, so splitting it across threads changes no bit; a prompt's experts apply it
        // to millions of elements (two tanh, two divisions and a sigmoid each).
        const CHUNK: usize = 16 << 10;
        if out.len() < 2 * CHUNK {
            situ.apply_rows(gate, up, out);
            return Ok(());
        }
        out.par_chunks_mut(CHUNK)
            .zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)))
            .for_each(|(o, (g, u))| situ.apply_rows(g, u, o));
        Ok(())
    }

    fn kda_update(
        &self,
        s_in: &StateBuf,
        s_out: &mut StateBuf,
        heads: &[HeadIn],
        dk: usize,
        dv: usize,
        o: &mut [f32],
        chunked: bool,
    ) -> Result<(), BackendError> {
        let n = heads.first().map_or(0, |h| h.beta.len());
        let s_in = s_in.host_values()?;
        if n == 0 {
            // No rows: the state after them is the state before.
            s_out.overwrite().copy_from_slice(&s_in);
            return Ok(());
        }
        s_out
            .overwrite()
            .par_chunks_mut(dk * dv)
            .zip(s_in.par_chunks(dk * dv))
            .zip(o.par_chunks_mut((n * dv).max(1)))
            .zip(heads.par_iter())
            .for_each(|(((s, s0), o), x)| {
                if chunked {
                    s.copy_from_slice(s0);
                    kda::chunked_head(s, dk, dv, x, o)
                } else {
                    kda::recurrent_head(Some(s0), s, dk, dv, x, Some(o))
                }
            });
        Ok(())
    }

    fn kda_replay(
        &self,
        s_in: &StateBuf,
        s_out: &mut StateBuf,
        heads: &[HeadIn],
        dk: usize,
        dv: usize,
    ) -> Result<(), BackendError> {
        let s_in = s_in.host_values()?;
        let s_out = s_out.overwrite();
        if heads.first().is_none_or(|h| h.beta.is_empty()) {
            // No rows: the state after them is the state before.
            s_out.copy_from_slice(&s_in);
            return Ok(());
        }
        s_out
            .par_chunks_mut(dk * dv)
            .zip(s_in.par_chunks(dk * dv))
            .zip(heads.par_iter())
            .for_each(|((s, s0), x)| kda::recurrent_head(Some(s0), s, dk, dv, x, None));
        Ok(())
    }

    fn mla_attention_with(
        &self,
        q: &[f32],
        cache: &AppendBuf,
        past: usize,
        kv_b: &Bf16Mat,
        dims: MlaDims,
        scale: f32,
        visible: Visible,
        out: &mut [f32],
    ) -> Result<(), BackendError> {
        mla::attention_with(q, cache, past, kv_b, dims, scale, visible, out);
        Ok(())
    }

    fn attn_res_mix(&self, sources: &[&[f32]], score_w: &[f32], eps: f32, out: &mut [f32]) -> Result<(), BackendError> {
        ops::attn_res_mix(sources, score_w, eps, out);
        Ok(())
    }

    fn route_top_k(
        &self,
        logits: &[f32],
        bias: &[f32],
        rule: RouteRule,
        experts: &mut [u32],
        weights: &mut [f32],
    ) -> Result<(), BackendError> {
        ops::route_rows(logits, bias, rule, experts, weights);
        Ok(())
    }

    fn argmax(&self, logits: &[f32]) -> Result<u32, BackendError> {
        Ok(ops::argmax(logits))
    }
}
