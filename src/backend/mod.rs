//! Backends: tensors and the operations the forward pass calls, behind one narrow trait. A
//! backend knows nothing of K3: it sees matrices, rows and the shapes in [`types`].
//!
//! Contract: the forward pass (`k3/`) never calls a kernel directly; it calls the operations of
//! [`Backend`], each of which returns `Result`: a failed dispatch, mapping or readback is a
//! [`BackendError`] that reaches the caller, never NaN or a stale output (a backend may instead
//! run an operation on the CPU kernels where that keeps the bits, saying so in a warning).
//! Weights reach a backend as [`Bf16Mat`] (trunk) and [`Mxfp4Mat`] (an expert's shipped bytes,
//! valid for the call); a backend may keep its own copy of the trunk, prepared once by
//! [`Device::prepare`] and found again by the matrix's identity (`Bf16Mat::id`). Activations cross
//! the seam as f32 rows. Every implementation must give the fp64 reference's tolerance and the same
//! greedy tokens; the CPU backend is the bit-exact definition (see `cpu/`). What is not an
//! operation — the description, planning before work, the device expert cache and the counters —
//! is the [`Device`] trait, which the engine holds and the model never sees.
//!
//! `types` holds the seam types; `cpu/` the CPU kernels (scalar reference beside AVX2 / AVX-512 /
//! NEON) and [`CpuBackend`] (`cpu/backend.rs`), their implementation of the traits; `gpu/`
//! (feature `gpu`) runs WGSL kernels from `kernels/` through wgpu. [`open`] picks one for a
//! [`BackendKind`].

pub mod append_buf;
pub mod coded;
pub mod cpu;
pub mod detmath;
#[cfg(feature = "gpu")]
pub mod gpu;
pub mod int8;
pub mod state_buf;
pub mod types;

pub use append_buf::AppendBuf;
pub use cpu::CpuBackend;
use rayon::prelude::*;
pub use state_buf::StateBuf;
use std::sync::Arc;
pub use types::{
    Bf16Mat, ExpertLayout, HeadIn, MXFP4_BLOCK, MatStore, MlaDims, Mxfp4Mat, RouteRule, SharedBytes, Situ, Visible,
};

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
    #[error("this build has no GPU backend (built without the `gpu` feature); use the CPU backend")]
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
pub fn open(kind: BackendKind, opts: BackendOptions) -> Result<Arc<dyn Device>, BackendError> {
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
                tracing::info!("{} auto: {e}; using the CPU", crate::setting::Setting::Backend);
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
    /// Routed-expert bytes that reached device memory through a staging buffer and a copy on the
    /// device (a discrete GPU; on any GPU an expert admitted to the device cache).
    pub expert_staged_bytes: u64,
    /// Routed-expert bytes written once, straight into device-visible memory that the kernels read
    /// (unified memory: the copy through a staging buffer avoided).
    pub expert_in_place_bytes: u64,
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
            expert_staged_bytes: self.expert_staged_bytes.saturating_sub(earlier.expert_staged_bytes),
            expert_in_place_bytes: self.expert_in_place_bytes.saturating_sub(earlier.expert_in_place_bytes),
            wait_s: (self.wait_s - earlier.wait_s).max(0.0),
            device_s: (self.device_s - earlier.device_s).max(0.0),
        }
    }
}

/// Calls of one backend operation and the wall time spent in them since the backend opened
/// ([`Device::op_times`]).
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

/// The operations the forward pass calls. Every one returns `Err` when the backend could not
/// compute it (a failed dispatch, mapping or readback on a device): the caller gets an error,
/// never NaN or stale values in `out`. A backend may instead run an operation on the CPU kernels
/// where that gives the same bits (a documented fallback, with a warning).
pub trait Backend: Send + Sync {
    /// out[i, r] = W[r] . xs[i] for `n = xs.len() / W.cols` rows.
    fn matmul_bf16(&self, w: &Bf16Mat, xs: &[f32], out: &mut [f32]) -> Result<(), BackendError>;

    /// Several products of the same input rows (`outs[j] = ws[j] . xs`; every matrix `xs`'s width):
    /// one upload and one submission on the GPU instead of one each. Each product gives exactly
    /// `matmul_bf16`'s bits.
    fn matmul_bf16_many(&self, ws: &[&Bf16Mat], xs: &[f32], outs: &mut [&mut [f32]]) -> Result<(), BackendError> {
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            self.matmul_bf16(w, xs, out)?;
        }
        Ok(())
    }

    /// Several products, each of its own input rows (`outs[j] = ws[j] . xs[j]`): one submission on
    /// the GPU instead of one each. Each product gives exactly `matmul_bf16`'s bits.
    fn matmul_bf16_each(&self, ws: &[&Bf16Mat], xs: &[&[f32]], outs: &mut [&mut [f32]]) -> Result<(), BackendError> {
        for ((w, x), out) in ws.iter().zip(xs).zip(outs.iter_mut()) {
            self.matmul_bf16(w, x, out)?;
        }
        Ok(())
    }

    /// The same for an expert matrix; `xds` holds deinterleaved inputs (`cpu::deinterleave_mxfp4_input`).
    fn matmul_mxfp4(&self, w: &Mxfp4Mat, xds: &[f32], out: &mut [f32]) -> Result<(), BackendError>;

    /// A batch of gated MXFP4 experts of group `layer` (the key of a device expert cache): each is
    /// queued with its rows and may run at once or with others (one submission for many on the
    /// GPU). The default runs each expert as it is queued ([`run_expert`], so the CPU path keeps
    /// its order and overlap).
    fn expert_batch<'a>(&'a self, _layer: usize, layout: &'a ExpertLayout, situ: Situ) -> Box<dyn ExpertBatch + 'a> {
        Box::new(EachExpert { be: self, layout, situ, outs: Vec::new() })
    }

    /// RMSNorm of every row of `x` (rows of `w.len()`), in place.
    fn rms_norm_rows(&self, x: &mut [f32], w: &[f32], eps: f32) -> Result<(), BackendError>;

    /// out = situ(gate, up) element-wise.
    fn situ(&self, situ: Situ, gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<(), BackendError>;

    /// KDA state update of every head over its rows: reads the start state from `s_in`, writes the
    /// state after the last row to `s_out` (whole; a device backend may leave it in device memory)
    /// and the outputs o [heads][n, dv]. On an error `s_out` holds no valid state.
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
    ) -> Result<(), BackendError>;

    /// The state after rows' updates without outputs (committing verified rows): reads the start
    /// state from `s_in` and writes the result to `s_out` (whole), exactly the state `kda_update`
    /// over the same rows writes. On an error `s_out` holds no valid state.
    fn kda_replay(
        &self,
        s_in: &StateBuf,
        s_out: &mut StateBuf,
        heads: &[HeadIn],
        dk: usize,
        dv: usize,
    ) -> Result<(), BackendError>;

    /// MLA attention core over the latent cache with a given softmax scale and visibility
    /// (`cpu::mla::attention_with`). A device backend may mirror the cache in device memory (only
    /// new rows go up).
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
    ) -> Result<(), BackendError>;

    /// Mix of one row: out = sum_s softmax_s(score(v_s)) v_s over `sources` in order
    /// (`cpu::ops::attn_res_mix`).
    fn attn_res_mix(&self, sources: &[&[f32]], score_w: &[f32], eps: f32, out: &mut [f32]) -> Result<(), BackendError>;

    /// [`Backend::attn_res_mix`] of every row in one call: `sources[s]` and `out` are [n, h] (h =
    /// `score_w.len()`), row r mixes row r of each source. The default runs the rows across
    /// threads (rows are independent: the same bits as one call per row).
    fn attn_res_mix_rows(
        &self,
        sources: &[&[f32]],
        score_w: &[f32],
        eps: f32,
        out: &mut [f32],
    ) -> Result<(), BackendError> {
        let h = score_w.len().max(1);
        let mix_row = |(r, o): (usize, &mut [f32])| {
            let src: Vec<&[f32]> = sources.iter().map(|s| &s[r * h..(r + 1) * h]).collect();
            self.attn_res_mix(&src, score_w, eps, o)
        };
        if out.len() > h {
            out.par_chunks_mut(h).enumerate().try_for_each(mix_row)
        } else {
            out.chunks_mut(h).enumerate().try_for_each(mix_row)
        }
    }

    /// The top-k choice for rows of router logits [n, e] by `rule` (`cpu::ops::route_rows`:
    /// experts in selection order and their weights, [n, k] each).
    fn route_top_k(
        &self,
        logits: &[f32],
        bias: &[f32],
        rule: RouteRule,
        experts: &mut [u32],
        weights: &mut [f32],
    ) -> Result<(), BackendError>;

    /// Index of the largest logit, lowest index on ties, NaN never wins (`cpu::ops::argmax`).
    fn argmax(&self, logits: &[f32]) -> Result<u32, BackendError>;

    /// Each row of `x` (rows of `width`) scaled to unit L2 norm, x / sqrt(x.x + eps), each row on
    /// its own (KDA's q and k heads). On the CPU for every backend: a few floats a head.
    fn l2_norm_rows(&self, x: &mut [f32], width: usize, eps: f32) -> Result<(), BackendError> {
        x.chunks_exact_mut(width.max(1)).for_each(|r| cpu::ops::l2_norm_inplace(r, eps));
        Ok(())
    }

    /// acc = fma(a, x, acc), element-wise: one expert's weighted output added to a row's routed
    /// sum (fused, as a GPU kernel would).
    fn axpy(&self, acc: &mut [f32], a: f32, x: &[f32]) {
        cpu::ops::axpy(acc, a, x)
    }

    /// An MXFP4 product's input rows in the order the kernels read them (each 32-value block's
    /// even values, then its odd ones).
    fn deinterleave_mxfp4_input(&self, x: &[f32], out: &mut [f32]) {
        cpu::deinterleave_mxfp4_input(x, out)
    }
}

/// A backend as the engine holds it: what it is, what it is told before work starts, its device
/// expert cache and its counters. None of these is an operation of the forward pass; the model
/// sees only [`Backend`].
pub trait Device: Backend {
    /// For the startup line, e.g. "cpu avx512 x2".
    fn describe(&self) -> String;

    /// Called once with the trunk's matrices before the first forward (a device backend uploads
    /// them here).
    fn prepare(&self, _mats: &[&Bf16Mat]) -> Result<(), BackendError> {
        Ok(())
    }

    /// Called once with the routed experts' layout and count (every layer's) before the first
    /// forward: a device backend sizes and allocates its expert cache here (device memory it
    /// cannot have is an error before any work), so that the startup line states the device
    /// memory the plan uses.
    fn plan_experts(&self, _layout: &ExpertLayout, _experts: usize) -> Result<(), BackendError> {
        Ok(())
    }

    /// The shape of one sequence's recurrent state and attention cache, which a device backend
    /// may keep in its memory (shown in its description); the CPU ignores it.
    fn plan_sequence_state(&self, _state: SequenceState) {}

    /// Which of `experts` of group `layer` this backend keeps in its own memory (a device expert
    /// cache), so that they need not be fetched. The default: none.
    fn holds_experts(&self, _layer: usize, experts: &[u32]) -> Vec<bool> {
        vec![false; experts.len()]
    }

    /// Bytes of device memory the backend uses for routed experts (its cache and staging), for
    /// the memory plan's line; 0 for the CPU.
    fn device_expert_bytes(&self) -> u64 {
        0
    }

    /// Bytes of device memory the backend holds now (trunk, expert cache and staging, sequence
    /// state kept there): what counts against a unified-memory machine's wired limit; 0 for the
    /// CPU.
    fn device_memory_bytes(&self) -> u64 {
        0
    }

    /// Experts the backend's device cache has room for now (slots allocated); 0 for the CPU.
    fn device_expert_slots(&self) -> usize {
        0
    }

    /// Calls and wall time per operation since the backend opened (a device backend's profile;
    /// the CPU backend keeps none).
    fn op_times(&self) -> Vec<OpTime> {
        Vec::new()
    }

    /// The device traffic so far (submissions, bytes uploaded, bytes read back); zero for the CPU.
    fn device_traffic(&self) -> DeviceTraffic {
        DeviceTraffic::default()
    }
}

/// Gated experts queued for one group ([`Backend::expert_batch`]).
pub trait ExpertBatch {
    /// Claims those of `experts` that the backend holds for this group (see
    /// [`Device::holds_experts`]): they stay held until [`ExpertBatch::finish`], and only those
    /// may be queued with [`ExpertBatch::add_held`]. The default holds none.
    fn claim_held(&mut self, experts: &[u32]) -> Vec<bool> {
        vec![false; experts.len()]
    }

    /// Queues expert `expert` (its shipped bytes in the group's `ExpertLayout`) on deinterleaved
    /// latent rows `zd` [m, latent]. `bytes` is not used after this returns.
    fn add(&mut self, expert: u32, bytes: &[u8], zd: &[f32]) -> Result<(), BackendError>;

    /// Queues an expert that [`ExpertBatch::claim_held`] claimed, from the backend's own copy.
    fn add_held(&mut self, expert: u32, _zd: &[f32]) -> Result<(), BackendError> {
        unreachable!("expert {expert} was queued as held, but this batch holds no experts")
    }

    /// The outputs [m, latent] of every queued expert, in the order they were queued.
    fn finish(self: Box<Self>) -> Result<Vec<Vec<f32>>, BackendError>;
}

/// One gated MXFP4 expert on `m` deinterleaved latent rows `zd` [m, latent], composed of the
/// backend's operations: w2(situ(w1 z, w3 z)); returns [m, latent].
pub fn run_expert<B: Backend + ?Sized>(
    be: &B,
    layout: &ExpertLayout,
    bytes: &[u8],
    situ: Situ,
    zd: &[f32],
) -> Result<Vec<f32>, BackendError> {
    let [w1, w3, w2] = layout.mats(bytes);
    let m = zd.len() / layout.latent;
    let mut g = vec![0f32; m * layout.inter];
    let mut u = vec![0f32; m * layout.inter];
    be.matmul_mxfp4(&w1, zd, &mut g)?;
    be.matmul_mxfp4(&w3, zd, &mut u)?;
    let mut a = vec![0f32; m * layout.inter];
    be.situ(situ, &g, &u, &mut a)?;
    let mut ad = vec![0f32; m * layout.inter];
    for (src, dst) in a.chunks_exact(layout.inter).zip(ad.chunks_exact_mut(layout.inter)) {
        cpu::deinterleave_mxfp4_input(src, dst);
    }
    let mut out = vec![0f32; m * layout.latent];
    be.matmul_mxfp4(&w2, &ad, &mut out)?;
    Ok(out)
}

/// The default batch: each expert runs when it is queued.
pub struct EachExpert<'a, B: Backend + ?Sized> {
    pub be: &'a B,
    pub layout: &'a ExpertLayout,
    pub situ: Situ,
    pub outs: Vec<Vec<f32>>,
}

impl<B: Backend + ?Sized> ExpertBatch for EachExpert<'_, B> {
    fn add(&mut self, _expert: u32, bytes: &[u8], zd: &[f32]) -> Result<(), BackendError> {
        self.outs.push(run_expert(self.be, self.layout, bytes, self.situ, zd)?);
        Ok(())
    }

    fn finish(self: Box<Self>) -> Result<Vec<Vec<f32>>, BackendError> {
        Ok(self.outs)
    }
}
