//! Backends: the operations the forward pass calls, behind one trait.
//!
//! Contract: the forward pass (`k3/`, `sched/`) never calls a kernel directly; it calls these
//! operations. Weights reach a backend as [`Bf16Mat`] (trunk) and [`Mxfp4Mat`] (an expert's shipped
//! bytes, valid for the call); a backend may keep its own copy of the trunk, prepared once by
//! [`Backend::prepare`] and found again by the matrix's identity (`Bf16Mat::id`). Activations cross
//! the seam as f32 rows. Every implementation must give the fp64 reference's tolerance and the same
//! greedy tokens; the CPU backend is the bit-exact definition (see `cpu/`).
//!
//! `cpu/` holds the CPU kernels (scalar reference beside AVX2 / AVX-512 / NEON), `CpuBackend` below
//! is their implementation of the trait; `gpu/` (feature `gpu`) runs WGSL kernels from `kernels/`
//! through wgpu. [`open`] picks one for a [`BackendKind`].

pub mod append_buf;
pub mod cpu;
pub mod detmath;
#[cfg(feature = "gpu")]
pub mod gpu;
pub mod state_buf;

use crate::k3::moe::RouteRule;
use crate::k3::weights::Weights;
use crate::model::roster::ExpertLayout;
pub use append_buf::AppendBuf;
use cpu::kda::HeadIn;
use cpu::mla::{MlaDims, Visible};
use cpu::ops::Situ;
use cpu::{Bf16Mat, Mxfp4Mat};
use rayon::prelude::*;
pub use state_buf::StateBuf;
use std::sync::Arc;

/// Which backend runs the forward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// The CPU kernels.
    #[default]
    Cpu,
    /// The GPU kernels (any Vulkan/Metal adapter, a software one such as lavapipe included).
    Gpu,
    /// A discrete or integrated GPU when there is one, else the CPU.
    Auto,
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[cfg(feature = "gpu")]
    #[error(transparent)]
    Gpu(#[from] gpu::GpuError),
    #[error("this build has no GPU backend (built without the `gpu` feature); use --backend cpu")]
    NotBuilt,
}

/// What a backend is opened with besides its kind.
#[derive(Clone, Copy, Debug, Default)]
pub struct BackendOptions {
    /// Bytes of device memory for routed experts kept across layers and tokens (`--gpu-cache-gb`;
    /// 0: none). Only a device backend has one.
    pub device_cache_bytes: u64,
}

/// The backend for `kind`.
pub fn open(kind: BackendKind, opts: BackendOptions) -> Result<Arc<dyn Backend>, BackendError> {
    #[cfg(feature = "gpu")]
    let gpu = |allow_cpu| gpu::GpuBackend::new(allow_cpu).map(|g| g.with_device_cache(opts.device_cache_bytes));
    match kind {
        BackendKind::Cpu => Ok(Arc::new(CpuBackend)),
        #[cfg(feature = "gpu")]
        BackendKind::Gpu => Ok(Arc::new(gpu(true)?)),
        #[cfg(feature = "gpu")]
        BackendKind::Auto => match gpu(false) {
            Ok(g) => Ok(Arc::new(g)),
            Err(e) => {
                tracing::info!("--backend auto: {e}; using the CPU");
                Ok(Arc::new(CpuBackend))
            }
        },
        #[cfg(not(feature = "gpu"))]
        BackendKind::Gpu => Err(BackendError::NotBuilt),
        #[cfg(not(feature = "gpu"))]
        BackendKind::Auto => {
            let _ = opts;
            Ok(Arc::new(CpuBackend))
        }
    }
}

/// One sequence's per-layer state as the model defines it: a KDA state of `kda_state_floats` per
/// KDA layer (twice while a forward is pending) and `mla_token_floats` per token per MLA layer.
#[derive(Clone, Copy, Debug, Default)]
pub struct SequenceState {
    pub kda_layers: usize,
    pub kda_state_floats: usize,
    pub kda_head_dim: usize,
    pub mla_layers: usize,
    pub mla_token_floats: usize,
}

/// Work a device backend has sent to its device, counted since it opened: what `bench run`
/// reports per phase, so that every round trip and re-upload shows.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct DeviceTraffic {
    pub submissions: u64,
    pub upload_bytes: u64,
    pub readback_bytes: u64,
    /// Device memory held by per-sequence state kept there (KDA states in [`StateBuf`]s, MLA
    /// latent caches mirrored from [`AppendBuf`]s) at the time of the reading (a level, not a
    /// count: [`DeviceTraffic::since`] keeps the later one).
    pub resident_state_bytes: u64,
    /// Seconds the host spent blocked until the device had finished a submission.
    pub wait_s: f64,
    /// Seconds the device spent in compute passes, from its timestamps (only with
    /// `DELTAFIN_GPU_TIMESTAMPS=1` on an adapter that has them; else 0).
    pub device_s: f64,
}

impl DeviceTraffic {
    /// The traffic since `earlier`.
    pub fn since(self, earlier: DeviceTraffic) -> DeviceTraffic {
        DeviceTraffic {
            submissions: self.submissions.saturating_sub(earlier.submissions),
            upload_bytes: self.upload_bytes.saturating_sub(earlier.upload_bytes),
            readback_bytes: self.readback_bytes.saturating_sub(earlier.readback_bytes),
            resident_state_bytes: self.resident_state_bytes,
            wait_s: (self.wait_s - earlier.wait_s).max(0.0),
            device_s: (self.device_s - earlier.device_s).max(0.0),
        }
    }
}

/// Calls of one backend operation and the wall time spent in them since the backend opened
/// ([`Backend::op_times`]).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct OpTime {
    pub op: &'static str,
    pub calls: u64,
    pub seconds: f64,
    /// Of which the device ran compute passes (timestamps; 0 unless they are taken).
    pub device_seconds: f64,
}

/// Per operation, the calls and seconds of `later` since `earlier` (operations with no new calls
/// left out).
pub fn op_times_since(later: &[OpTime], earlier: &[OpTime]) -> Vec<OpTime> {
    later
        .iter()
        .filter_map(|l| {
            let e = earlier.iter().find(|e| e.op == l.op);
            let calls = l.calls.saturating_sub(e.map_or(0, |e| e.calls));
            (calls > 0).then(|| OpTime {
                op: l.op,
                calls,
                seconds: l.seconds - e.map_or(0.0, |e| e.seconds),
                device_seconds: l.device_seconds - e.map_or(0.0, |e| e.device_seconds),
            })
        })
        .collect()
}

pub trait Backend: Send + Sync {
    /// For the startup line, e.g. "cpu avx512 x2".
    fn describe(&self) -> String;

    /// Called once with the trunk before the first forward (a device backend uploads it here).
    fn prepare(&self, _weights: &Weights) {}

    /// out[i, r] = W[r] . xs[i] for `n = xs.len() / W.cols` rows.
    fn matmul_bf16(&self, w: &Bf16Mat, xs: &[f32], out: &mut [f32]);

    /// Several products of the same input rows (`outs[j] = ws[j] . xs`; every matrix `xs`'s width):
    /// one upload and one submission on the GPU instead of one each. Each product gives exactly
    /// `matmul_bf16`'s bits.
    fn matmul_bf16_many(&self, ws: &[&Bf16Mat], xs: &[f32], outs: &mut [&mut [f32]]) {
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            self.matmul_bf16(w, xs, out);
        }
    }

    /// Several products, each of its own input rows (`outs[j] = ws[j] . xs[j]`): one submission on
    /// the GPU instead of one each. Each product gives exactly `matmul_bf16`'s bits.
    fn matmul_bf16_each(&self, ws: &[&Bf16Mat], xs: &[&[f32]], outs: &mut [&mut [f32]]) {
        for ((w, x), out) in ws.iter().zip(xs).zip(outs.iter_mut()) {
            self.matmul_bf16(w, x, out);
        }
    }

    /// The same for an expert matrix; `xds` holds deinterleaved inputs (`cpu::deinterleave_mxfp4_input`).
    fn matmul_mxfp4(&self, w: &Mxfp4Mat, xds: &[f32], out: &mut [f32]);

    /// A batch for MoE layer `layer`'s routed experts: each is queued with its rows and may run at
    /// once or with others (one submission for many on the GPU). The default runs each expert as
    /// it is queued, exactly `k3::moe::run_expert` (so the CPU path keeps its order and overlap).
    fn expert_batch<'a>(&'a self, _layer: usize, layout: &'a ExpertLayout, situ: Situ) -> Box<dyn ExpertBatch + 'a> {
        Box::new(EachExpert { be: self, layout, situ, outs: Vec::new() })
    }

    /// Called once with the routed experts' layout and count (every layer's) before the first
    /// forward: a device backend sizes and allocates its expert cache here (device memory it
    /// cannot have is an error before any work), so that the startup line states the device
    /// memory the plan uses.
    fn plan_experts(&self, _layout: &ExpertLayout, _experts: usize) -> Result<(), BackendError> {
        Ok(())
    }

    /// Which of `experts` of MoE layer `layer` this backend keeps in its own memory (a device
    /// expert cache), so that they need not be fetched (the lookahead skips them). The default:
    /// none.
    fn holds_experts(&self, _layer: usize, experts: &[u32]) -> Vec<bool> {
        vec![false; experts.len()]
    }

    /// Bytes of device memory the backend uses for routed experts (its cache and staging), for
    /// the memory plan's line; 0 for the CPU.
    fn device_expert_bytes(&self) -> u64 {
        0
    }

    /// Experts the backend's device cache has room for now (slots allocated); 0 for the CPU.
    fn device_expert_slots(&self) -> usize {
        0
    }

    /// The shape of one sequence's recurrent state and attention cache, which a device backend
    /// may keep in its memory (shown in its description); the CPU ignores it.
    fn plan_sequence_state(&self, _state: SequenceState) {}

    /// Calls and wall time per operation since the backend opened (a device backend's profile;
    /// the CPU backend keeps none).
    fn op_times(&self) -> Vec<OpTime> {
        Vec::new()
    }

    /// The device traffic so far (submissions, bytes uploaded, bytes read back); zero for the CPU.
    fn device_traffic(&self) -> DeviceTraffic {
        DeviceTraffic::default()
    }

    /// RMSNorm of every row of `x` (rows of `w.len()`), in place.
    fn rms_norm_rows(&self, x: &mut [f32], w: &[f32], eps: f32);

    /// out = situ(gate, up) element-wise.
    fn situ(&self, situ: Situ, gate: &[f32], up: &[f32], out: &mut [f32]);

    /// KDA state update of every head over its rows: reads the start state from `s_in`, writes the
    /// state after the last row to `s_out` (whole; a device backend may leave it in device memory)
    /// and the outputs o [heads][n, dv].
    #[allow(clippy::too_many_arguments)]
    fn kda_update(
        &self,
        s_in: &StateBuf,
        s_out: &mut StateBuf,
        heads: &[HeadIn],
        dk: usize,
        dv: usize,
        o: &mut [f32],
        chunked: bool,
    );

    /// Applies rows' updates to `s` in place without outputs (committing verified rows).
    fn kda_replay(&self, s: &mut StateBuf, heads: &[HeadIn], dk: usize, dv: usize);

    /// MLA attention core over the latent cache with a given softmax scale and visibility
    /// (`cpu::mla::attention_with`): K3's layers are causal, DSpark's draft block sees every row.
    /// A device backend may mirror the cache in device memory (only new rows go up).
    #[allow(clippy::too_many_arguments)]
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
    );

    /// AttnRes mix of one row: out = sum_s softmax_s(score(v_s)) v_s over `sources` in order.
    fn attn_res_mix(&self, sources: &[&[f32]], score_w: &[f32], eps: f32, out: &mut [f32]);

    /// The router's choice for rows of logits [n, e] (`k3::moe::route_rows`: experts in router
    /// order and their weights, [n, k] each).
    fn route_top_k(&self, logits: &[f32], bias: &[f32], rule: RouteRule, experts: &mut [u32], weights: &mut [f32]) {
        crate::k3::moe::route_rows(logits, bias, rule, experts, weights)
    }

    /// Index of the largest logit, lowest index on ties, NaN never wins ([`crate::k3::argmax`]).
    fn argmax(&self, logits: &[f32]) -> u32 {
        crate::k3::argmax(logits)
    }
}

/// Routed experts queued for one layer ([`Backend::expert_batch`]).
pub trait ExpertBatch {
    /// Claims those of `experts` that the backend holds for this layer (see
    /// [`Backend::holds_experts`]): they stay held until [`ExpertBatch::finish`], and only those
    /// may be queued with [`ExpertBatch::add_held`]. The default holds none.
    fn claim_held(&mut self, experts: &[u32]) -> Vec<bool> {
        vec![false; experts.len()]
    }

    /// Queues expert `expert` (its shipped bytes in the layer's `ExpertLayout`) on deinterleaved
    /// latent rows `zd` [m, latent]. `bytes` is not used after this returns.
    fn add(&mut self, expert: u32, bytes: &[u8], zd: &[f32]);

    /// Queues an expert that [`ExpertBatch::claim_held`] claimed, from the backend's own copy.
    fn add_held(&mut self, expert: u32, _zd: &[f32]) {
        unreachable!("expert {expert} was queued as held, but this batch holds no experts")
    }

    /// The outputs [m, latent] of every queued expert, in the order they were queued.
    fn finish(self: Box<Self>) -> Vec<Vec<f32>>;
}

/// The default batch: each expert runs when it is queued.
pub struct EachExpert<'a, B: Backend + ?Sized> {
    pub be: &'a B,
    pub layout: &'a ExpertLayout,
    pub situ: Situ,
    pub outs: Vec<Vec<f32>>,
}

impl<B: Backend + ?Sized> ExpertBatch for EachExpert<'_, B> {
    fn add(&mut self, _expert: u32, bytes: &[u8], zd: &[f32]) {
        self.outs.push(crate::k3::moe::run_expert(self.be, self.layout, bytes, self.situ, zd));
    }

    fn finish(self: Box<Self>) -> Vec<Vec<f32>> {
        self.outs
    }
}

/// The CPU kernels as a backend.
#[derive(Default)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn describe(&self) -> String {
        format!("cpu {} x{}", cpu::isa().name(), rayon::current_num_threads())
    }

    fn matmul_bf16(&self, w: &Bf16Mat, xs: &[f32], out: &mut [f32]) {
        cpu::matmul_bf16(w, xs, out)
    }

    fn matmul_mxfp4(&self, w: &Mxfp4Mat, xds: &[f32], out: &mut [f32]) {
        cpu::matmul_mxfp4(w, xds, out)
    }

    fn rms_norm_rows(&self, x: &mut [f32], w: &[f32], eps: f32) {
        for r in x.chunks_exact_mut(w.len()) {
            cpu::ops::rms_norm_inplace(r, w, eps);
        }
    }

    fn situ(&self, situ: Situ, gate: &[f32], up: &[f32], out: &mut [f32]) {
        // Element-wise, so splitting it across threads changes no bit; a prompt's experts apply it
        // to millions of elements (two tanh, two divisions and a sigmoid each).
        const CHUNK: usize = 16 << 10;
        if out.len() < 2 * CHUNK {
            return situ.apply_rows(gate, up, out);
        }
        out.par_chunks_mut(CHUNK)
            .zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)))
            .for_each(|(o, (g, u))| situ.apply_rows(g, u, o));
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
    ) {
        let n = heads.first().map_or(0, |h| h.beta.len());
        let s_in = s_in.host_values();
        if n == 0 {
            // No rows: the state after them is the state before.
            s_out.overwrite().copy_from_slice(&s_in);
            return;
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
                    cpu::kda::chunked_head(s, dk, dv, x, o)
                } else {
                    cpu::kda::recurrent_head(Some(s0), s, dk, dv, x, Some(o))
                }
            });
    }

    fn kda_replay(&self, s: &mut StateBuf, heads: &[HeadIn], dk: usize, dv: usize) {
        s.host_mut()
            .par_chunks_mut(dk * dv)
            .zip(heads.par_iter())
            .for_each(|(s, x)| cpu::kda::recurrent_head(None, s, dk, dv, x, None));
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
    ) {
        cpu::mla::attention_with(q, cache, past, kv_b, dims, scale, visible, out)
    }

    fn attn_res_mix(&self, sources: &[&[f32]], score_w: &[f32], eps: f32, out: &mut [f32]) {
        crate::k3::attn_res::mix(sources, score_w, eps, out)
    }
}
