//! The GPU backend: WGSL kernels (`kernels/`) through wgpu — Vulkan on Linux and Windows, Metal on
//! macOS (compiled by wgpu from the same WGSL; not run on Apple hardware here).
//!
//! Contract: the bf16 and MXFP4 matrix products run on the GPU in the CPU kernels' operation order
//! (16 lanes, fused multiply-add, the fixed reduction tree), so on an adapter whose `fma` is fused
//! ([`GpuBackend::fma_is_fused`]) they give the CPU's bits; on any adapter they stay within the
//! fp64 reference's tolerance. Trunk matrices are uploaded once ([`super::Device::prepare`], or on first
//! use) and kept resident, split into bindings no larger than the adapter allows; expert bytes are
//! uploaded from the store's buffers (decoded in the kernel, never re-encoded): per call for
//! `matmul_mxfp4`, or a layer's experts in groups of one submission per phase through
//! [`Backend::expert_batch`] (`experts.rs`); on unified memory (Apple silicon, integrated GPUs,
//! lavapipe: `device/uma.rs`, [`UmaMode`]) the batch writes each expert once, straight into
//! device-visible memory, with no staging buffer and no copy on the device. RMSNorm, SiTU, the AttnRes mix, routing top-k,
//! argmax, the KDA recurrence (update and replay) and the MLA core run on the GPU too (`ops`), with
//! the same rule (CPU order, `detmath` for transcendentals and division, explicit fma), from
//! [`DEFAULT_OPS_MIN`] elements of work (smaller calls, the chunked KDA form and calls past
//! `ops::Limits` run on the CPU kernels); top-k and argmax pick the CPU's indices on every
//! adapter. Every call uploads its inputs and reads its results back, except per-sequence state
//! (`state.rs`): a KDA [`StateBuf`] that the GPU updated stays in device memory and is read from
//! there by the next update or replay, and an MLA latent cache ([`AppendBuf`]) is mirrored there,
//! so that decode moves only each token's rows and outputs; other activations are not resident.

#[cfg(feature = "gpu-bench")]
mod bench;
mod device;
mod expert_cache;
mod experts;
mod kernels;
mod ops;
mod profile;
#[cfg(feature = "gpu-bench")]
mod residency;
mod state;
#[cfg(feature = "gpu-bench")]
mod transfer_bench;

#[cfg(feature = "gpu-bench")]
pub use bench::VariantTiming;
#[cfg(feature = "gpu-bench")]
pub use residency::ResidencyPoint;
#[cfg(feature = "gpu-bench")]
pub use transfer_bench::TransferRates;

pub use device::{AdapterSummary, GpuError, UMA_ENV, UmaMode, fail_readback_in, set_timestamps};
use ops::{Dst, Limits, Ops, Src};
use state::{DeviceState, LatentMirror};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Elements of work below which an operation other than a product stays on the CPU kernels (its
/// upload, submission and readback cost more than the work); `DELTAFIN_GPU_OPS_MIN` or
/// [`set_ops_min`] change it for backends opened afterwards (0: every operation on the GPU).
pub const DEFAULT_OPS_MIN: usize = 1 << 16;
/// Elements from which RMSNorm and SiTU run on the host's threads instead: a prefill's rows (a
/// few to a few dozen operations per element) are done there before they would have gone up and
/// come back (on the H200, 8192 rows of 7168 took 0.3 s a norm on the GPU and a shared-expert
/// SiTU of 8192 x 6144 about 0.6 s, almost all of it transfers; the host's SiTU takes ~3 ns an
/// element on one core).
const HOST_FROM: usize = 1 << 22;

static OPS_MIN: AtomicUsize = AtomicUsize::new(usize::MAX);

/// Sets the size threshold of [`DEFAULT_OPS_MIN`] for GPU backends opened after the call.
pub fn set_ops_min(elems: usize) {
    OPS_MIN.store(elems, Ordering::Relaxed);
}

fn ops_min() -> usize {
    match OPS_MIN.load(Ordering::Relaxed) {
        usize::MAX => match std::env::var("DELTAFIN_GPU_OPS_MIN") {
            Ok(v) => v.trim().parse().unwrap_or_else(|_| {
                tracing::warn!("DELTAFIN_GPU_OPS_MIN={v:?} is not a number of elements; using {DEFAULT_OPS_MIN}");
                DEFAULT_OPS_MIN
            }),
            Err(_) => DEFAULT_OPS_MIN,
        },
        v => v,
    }
}

use super::{
    AppendBuf, Backend, BackendError, Bf16Mat, CpuBackend, Device, EachExpert, ExpertBatch, ExpertLayout, HeadIn,
    MlaDims, Mxfp4Mat, RouteRule, SequenceState, Situ, StateBuf, Visible,
};
use device::{Gpu, Kind, Resident};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// A resident copy and the matrix it copies (held, so that its address — the key — cannot be
/// reused by another matrix while the copy is cached).
type Entry = (Bf16Mat, Arc<Resident>);

pub struct GpuBackend {
    gpu: Gpu,
    ops: Ops,
    resident: Mutex<HashMap<(usize, usize, usize), Entry>>,
    cache: Mutex<expert_cache::DeviceCache>,
    /// Device memory of the batch path's staging images (set by the first batch).
    staging: AtomicUsize,
    cpu: CpuBackend,
    fused: bool,
    ops_min: usize,
    /// The model's per-sequence state, for the description of device memory.
    sequence: Mutex<SequenceState>,
    profile: profile::Profile,
}

impl GpuBackend {
    /// The first adapter wgpu offers (a discrete or integrated GPU before a CPU one), or an error
    /// saying why there is none. `allow_cpu`: accept a software adapter (lavapipe) too. Experts
    /// reach it as `DELTAFIN_GPU_UMA` says ([`UmaMode::from_env`]).
    pub fn new(allow_cpu: bool) -> Result<Self, GpuError> {
        Self::open(allow_cpu, UmaMode::from_env())
    }

    /// [`GpuBackend::new`] with the way experts reach the device given (`uma`).
    pub fn open(allow_cpu: bool, uma: UmaMode) -> Result<Self, GpuError> {
        let gpu = Gpu::new(allow_cpu, uma)?;
        let fused = gpu.fma_is_fused()?;
        if let Some(n) = device::fail_readback_wanted() {
            fail_readback_in(n);
        }
        let ops = Ops::new(&gpu);
        Ok(GpuBackend {
            gpu,
            ops,
            resident: Mutex::new(HashMap::new()),
            cache: Mutex::new(expert_cache::DeviceCache::new(0)),
            staging: AtomicUsize::new(0),
            cpu: CpuBackend,
            fused,
            ops_min: ops_min(),
            sequence: Mutex::new(SequenceState::default()),
            profile: profile::Profile::default(),
        })
    }

    /// The same backend with a device expert cache of `bytes` (`--gpu-cache-gb`; 0: none).
    pub fn with_device_cache(self, bytes: u64) -> Self {
        self.with_cache(|c| *c = expert_cache::DeviceCache::new(bytes));
        self
    }

    fn with_cache<T>(&self, f: impl FnOnce(&mut expert_cache::DeviceCache) -> T) -> T {
        match self.cache.lock() {
            Ok(mut c) => f(&mut c),
            Err(p) => f(&mut p.into_inner()),
        }
    }

    /// Elements of work from which the non-product operations run on the GPU.
    pub fn ops_min(&self) -> usize {
        self.ops_min
    }

    /// The same backend with another threshold (0: every operation on the GPU; tests).
    pub fn with_ops_min(mut self, elems: usize) -> Self {
        self.ops_min = elems;
        self
    }

    fn on_gpu(&self, work: usize) -> bool {
        work >= self.ops_min.max(1)
    }

    /// Whether buffers of `floats` f32 fit one binding once padded to whole 16-byte words, as
    /// staged buffers and state copies are (larger calls stay on the CPU).
    fn fits(&self, floats: usize) -> bool {
        (floats as u64).saturating_mul(4).div_ceil(16).saturating_mul(16) <= self.gpu.summary.max_binding
    }

    /// Whether a KDA update or replay of `heads` over a state of `state` floats runs here: within
    /// the kernel's key width, above the size threshold, and within one binding.
    fn kda_on_gpu(&self, heads: &[HeadIn], dk: usize, state: usize) -> bool {
        let n = heads.first().map_or(0, |h| h.beta.len());
        !heads.is_empty()
            && dk <= Limits::KDA_DK
            && self.on_gpu(state)
            && self.fits((3 * heads.len() * n * dk).max(state))
    }

    /// The binding of state `s`: its device copy when this GPU holds the current values, else
    /// its host values (kept in `host` and uploaded with the call; read back first from another
    /// device's copy).
    fn state_input<'a>(
        &self,
        s: &'a StateBuf,
        host: &'a mut Option<std::borrow::Cow<'a, [f32]>>,
    ) -> Result<Src<'a>, BackendError> {
        Ok(match s.current_device().and_then(|d| DeviceState::of(&self.gpu, d, s.len())) {
            Some(b) => Src::Buf(b),
            None => Src::F32(host.insert(s.host_values()?)),
        })
    }

    /// The device buffer a kernel writes state `s` of `floats` values into: its copy on this
    /// GPU, made on first use (it then holds the current values only once the kernel has run and
    /// the caller marked it written); None when the device has no memory for it.
    fn device_state<'a>(&self, s: &'a mut StateBuf, floats: usize) -> Option<&'a wgpu::Buffer> {
        if s.device().and_then(|d| DeviceState::of(&self.gpu, d, floats)).is_none() {
            s.set_device(Box::new(DeviceState::new(&self.gpu, floats)?));
        }
        s.device().and_then(|d| DeviceState::of(&self.gpu, d, floats))
    }

    pub fn adapter(&self) -> &AdapterSummary {
        &self.gpu.summary
    }

    /// True when routed experts are written in place, into device-visible memory (unified
    /// memory), instead of staged and copied.
    pub fn experts_in_place(&self) -> bool {
        self.gpu.in_place
    }

    /// True when the adapter's `fma` rounds once (then the products give the CPU's bits).
    pub fn fma_is_fused(&self) -> bool {
        self.fused
    }

    /// Bytes of trunk matrices resident in device memory.
    pub fn resident_bytes(&self) -> u64 {
        self.resident.lock().map(|m| m.values().map(|(_, r)| r.bytes).sum()).unwrap_or(0)
    }

    fn resident(&self, w: &Bf16Mat) -> Arc<Resident> {
        let mut map = match self.resident.lock() {
            Ok(m) => m,
            Err(p) => p.into_inner(),
        };
        let entry =
            map.entry((w.id(), w.rows, w.cols)).or_insert_with(|| (w.clone(), Arc::new(self.gpu.upload_bf16(w))));
        Arc::clone(&entry.1)
    }

    /// Seconds per dispatch of the product (weights resident) and of a plain read of the same
    /// bytes, each averaged over `reps` dispatches in one submission (for `bench kernels`).
    #[cfg(feature = "gpu-bench")]
    pub fn time_product(&self, kind: BenchKind, rows: usize, cols: usize, n: usize, reps: usize) -> (f64, f64) {
        self.gpu.time_product(kind, rows, cols, n, reps)
    }

    /// [`Gpu::time_matmul_variants`] (for `bench kernels --matmul-variants`).
    #[cfg(feature = "gpu-bench")]
    pub fn time_matmul_variants(
        &self,
        dir: &std::path::Path,
        rows: usize,
        cols: usize,
        n: usize,
        reps: usize,
    ) -> Vec<VariantTiming> {
        self.gpu.time_matmul_variants(dir, rows, cols, n, reps)
    }

    /// The adapter's measured f32 fused-multiply-adds per second ([`Gpu::fma_peak`], for `bench
    /// kernels`).
    #[cfg(feature = "gpu-bench")]
    pub fn fma_peak(&self, reps: usize) -> f64 {
        self.gpu.fma_peak(reps)
    }

    /// [`Gpu::transfer_rates`] (for `bench kernels`).
    #[cfg(feature = "gpu-bench")]
    pub fn transfer_rates(&self, bytes: usize) -> TransferRates {
        self.gpu.transfer_rates(bytes)
    }

    /// [`Gpu::time_matvec_variants`] (for `bench kernels --matvec-variants`).
    #[cfg(feature = "gpu-bench")]
    pub fn time_matvec_variants(
        &self,
        dir: &std::path::Path,
        rows: usize,
        cols: usize,
        reps: usize,
    ) -> Vec<VariantTiming> {
        self.gpu.time_matvec_variants(dir, rows, cols, reps)
    }
}

/// What `time_product` measures.
#[cfg(feature = "gpu-bench")]
#[derive(Clone, Copy, Debug)]
pub enum BenchKind {
    Bf16,
    Mxfp4,
}

impl Device for GpuBackend {
    fn describe(&self) -> String {
        let a = &self.gpu.summary;
        let hb = crate::util::human_bytes;
        let (trunk, staging) = (self.resident_bytes(), self.staging.load(Ordering::Relaxed) as u64);
        let (cache, slots) = self.with_cache(|c| (c.planned_bytes(), c.slots().1));
        let cache_part =
            if cache > 0 { format!(" + expert cache {} ({slots} experts)", hb(cache)) } else { String::new() };
        let staging_part = if staging > 0 { format!(" + expert staging {}", hb(staging)) } else { String::new() };
        let seq = self.sequence.lock().map(|s| *s).unwrap_or_default();
        let kda = seq.kda_layers as u64 * 2 * 4 * seq.kda_state_floats as u64;
        let kda_on_gpu = kda > 0 && seq.kda_head_dim <= Limits::KDA_DK && self.on_gpu(seq.kda_state_floats);
        let mla = seq.mla_layers as u64 * 4 * seq.mla_token_floats as u64;
        let mut per_seq = Vec::new();
        if kda_on_gpu {
            per_seq.push(format!("KDA state {}", hb(kda)));
        }
        if mla > 0 {
            per_seq.push(format!("MLA cache {}/token", hb(mla)));
        }
        let seq_part =
            if per_seq.is_empty() { String::new() } else { format!("; per sequence {}", per_seq.join(" + ")) };
        format!(
            "gpu {} ({:?}, {}, fma {}{}{}, device memory: trunk {}{cache_part}{staging_part} = {}{seq_part}) + {}",
            a.name,
            a.device_type,
            a.backend,
            if self.fused { "fused" } else { "not fused" },
            if self.gpu.timed() { ", passes timed" } else { "" },
            if a.experts_in_place { ", unified memory: experts written in place" } else { "" },
            hb(trunk),
            hb(trunk + cache + staging),
            self.cpu.describe()
        )
    }

    fn prepare(&self, mats: &[&Bf16Mat]) -> Result<(), BackendError> {
        for m in mats {
            self.resident(m);
        }
        // An upload that failed shows as a recorded device error.
        Ok(self.gpu.traffic.check()?)
    }

    fn plan_sequence_state(&self, state: SequenceState) {
        if let Ok(mut s) = self.sequence.lock() {
            *s = state;
        }
    }

    fn plan_experts(&self, layout: &ExpertLayout, experts: usize) -> Result<(), BackendError> {
        let (_, image) = experts::slot_layout(layout);
        let staging = experts::staging_bytes(layout, self.gpu.summary.max_binding);
        self.staging.store(staging as usize, Ordering::Relaxed);
        self.with_cache(|c| {
            c.fit(image as u64);
            c.limit_slots(experts);
            c.reserve(&self.gpu.device, self.gpu.summary.max_binding)
        })?;
        Ok(())
    }

    fn holds_experts(&self, layer: usize, experts: &[u32]) -> Vec<bool> {
        self.with_cache(|c| experts.iter().map(|&e| c.holds(layer, e)).collect())
    }

    fn device_expert_slots(&self) -> usize {
        self.with_cache(|c| c.slots().0)
    }

    fn device_expert_bytes(&self) -> u64 {
        self.with_cache(|c| c.bytes()) + self.staging.load(Ordering::Relaxed) as u64
    }

    fn device_memory_bytes(&self) -> u64 {
        let staging = self.staging.load(Ordering::Relaxed) as u64;
        let state = self.gpu.traffic.resident_state_bytes.load(Ordering::Relaxed);
        self.resident_bytes() + self.with_cache(|c| c.bytes()) + staging + state
    }

    fn op_times(&self) -> Vec<crate::backend::OpTime> {
        self.profile.snapshot()
    }

    fn device_traffic(&self) -> crate::backend::DeviceTraffic {
        self.gpu.traffic.snapshot()
    }
}

impl Backend for GpuBackend {
    fn matmul_bf16(&self, w: &Bf16Mat, xs: &[f32], out: &mut [f32]) -> Result<(), BackendError> {
        self.profile.time("matmul_bf16", &self.gpu.traffic, || {
            let r = self.resident(w);
            Ok(self.gpu.matmul(&r, Kind::Bf16, xs, out)?)
        })
    }

    fn matmul_bf16_many(&self, ws: &[&Bf16Mat], xs: &[f32], outs: &mut [&mut [f32]]) -> Result<(), BackendError> {
        self.profile.time("matmul_bf16_many", &self.gpu.traffic, || {
            // One input binding serves all only when the widths agree.
            if ws.iter().any(|w| w.cols != ws[0].cols) {
                for (w, out) in ws.iter().zip(outs.iter_mut()) {
                    self.gpu.matmul(&self.resident(w), Kind::Bf16, xs, out)?;
                }
                return Ok(());
            }
            let rs: Vec<Arc<Resident>> = ws.iter().map(|w| self.resident(w)).collect();
            let refs: Vec<&Resident> = rs.iter().map(|r| &**r).collect();
            Ok(self.gpu.matmul_many(&refs, Kind::Bf16, xs, outs)?)
        })
    }

    fn matmul_bf16_each(&self, ws: &[&Bf16Mat], xs: &[&[f32]], outs: &mut [&mut [f32]]) -> Result<(), BackendError> {
        self.profile.time("matmul_bf16_each", &self.gpu.traffic, || {
            let rs: Vec<Arc<Resident>> = ws.iter().map(|w| self.resident(w)).collect();
            let refs: Vec<&Resident> = rs.iter().map(|r| &**r).collect();
            Ok(self.gpu.matmul_each(&refs, Kind::Bf16, xs, outs)?)
        })
    }

    fn matmul_mxfp4(&self, w: &Mxfp4Mat, xds: &[f32], out: &mut [f32]) -> Result<(), BackendError> {
        self.profile.time("matmul_mxfp4", &self.gpu.traffic, || {
            let r = self.gpu.upload_mxfp4(w, false);
            // An expert's matrix, staged (counted as uploaded by the upload itself).
            let bytes = (w.packed.len() + w.scales.len()) as u64;
            self.gpu.traffic.expert_staged_bytes.fetch_add(bytes, Ordering::Relaxed);
            let done = self.gpu.matmul(&r, Kind::Mxfp4, xds, out);
            self.gpu.release(r);
            Ok(done?)
        })
    }

    fn expert_batch<'a>(&'a self, layer: usize, layout: &'a ExpertLayout, situ: Situ) -> Box<dyn ExpertBatch + 'a> {
        // One expert image per staging buffer: one that exceeds a binding goes matrix by matrix.
        if (experts::slot_layout(layout).1 as u64) > self.gpu.summary.max_binding {
            return Box::new(EachExpert { be: self, layout, situ, outs: Vec::new() });
        }
        Box::new(experts::GpuExperts::new(self, layer, layout, situ))
    }

    fn rms_norm_rows(&self, x: &mut [f32], w: &[f32], eps: f32) -> Result<(), BackendError> {
        self.profile.time("rms_norm_rows", &self.gpu.traffic, || {
            if !self.on_gpu(x.len()) || w.is_empty() || !self.fits(x.len()) || x.len() > HOST_FROM {
                return self.cpu.rms_norm_rows(x, w, eps);
            }
            Ok(self.ops.rms_norm_rows(&self.gpu, x, w, eps)?)
        })
    }

    fn situ(&self, situ: Situ, gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<(), BackendError> {
        self.profile.time("situ", &self.gpu.traffic, || {
            if !self.on_gpu(out.len()) || !self.fits(out.len()) || out.len() > HOST_FROM {
                return self.cpu.situ(situ, gate, up, out);
            }
            Ok(self.ops.situ(&self.gpu, situ.beta, situ.linear_beta, gate, up, out)?)
        })
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
        self.profile.time("kda_update", &self.gpu.traffic, || {
            // The chunked form stays on the CPU (its order is not the recurrence's).
            if chunked || !self.kda_on_gpu(heads, dk, s_in.len()) {
                return self.cpu.kda_update(s_in, s_out, heads, dk, dv, o, chunked);
            }
            let Some(dst) = self.device_state(s_out, s_in.len()) else {
                return self.cpu.kda_update(s_in, s_out, heads, dk, dv, o, chunked);
            };
            let mut host = None;
            let src = self.state_input(s_in, &mut host)?;
            let (_, out) = self.ops.kda_recurrent(&self.gpu, src, Dst::Into(dst), heads, dk, dv, true)?;
            copy_bits(&out, o);
            s_out.mark_device_written();
            Ok(())
        })
    }

    fn kda_replay(
        &self,
        s_in: &StateBuf,
        s_out: &mut StateBuf,
        heads: &[HeadIn],
        dk: usize,
        dv: usize,
    ) -> Result<(), BackendError> {
        self.profile.time("kda_replay", &self.gpu.traffic, || {
            if !self.kda_on_gpu(heads, dk, s_in.len()) {
                return self.cpu.kda_replay(s_in, s_out, heads, dk, dv);
            }
            let Some(dst) = self.device_state(s_out, s_in.len()) else {
                return self.cpu.kda_replay(s_in, s_out, heads, dk, dv);
            };
            let mut host = None;
            let src = self.state_input(s_in, &mut host)?;
            self.ops.kda_recurrent(&self.gpu, src, Dst::Into(dst), heads, dk, dv, false)?;
            s_out.mark_device_written();
            Ok(())
        })
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
        self.profile.time("mla_attention_with", &self.gpu.traffic, || {
            let lat = dims.lora + dims.rope;
            let work = out.len() / dims.v_head.max(1) * (cache.len() / lat.max(1)) * lat;
            let scores = out.len() / dims.v_head.max(1) * (cache.len() / lat.max(1));
            let fits = dims.lora <= Limits::LORA
                && dims.rope <= Limits::ROPE
                && dims.v_head > 0
                && lat > 0
                && self.fits(scores.max(cache.len()).max(q.len()));
            let r = if fits && self.on_gpu(work) { Some(self.resident(kv_b)) } else { None };
            match r.as_deref().and_then(|r| r.whole().map(|w| (w, r.stride))) {
                // The cache's rows stay mirrored in device memory: only those added since go up.
                Some((w, stride)) => {
                    let mut run = |src: Src| {
                        self.ops.mla_attention(
                            &self.gpu,
                            q,
                            (src, cache.len()),
                            past,
                            (w, stride),
                            dims,
                            scale,
                            visible == Visible::Causal,
                            out,
                        )
                    };
                    match LatentMirror::with(&self.gpu, cache, |buf| run(Src::Buf(buf))) {
                        Some(done) => Ok(done?),
                        None => self.cpu.mla_attention_with(q, cache, past, kv_b, dims, scale, visible, out),
                    }
                }
                None => self.cpu.mla_attention_with(q, cache, past, kv_b, dims, scale, visible, out),
            }
        })
    }

    fn attn_res_mix(&self, sources: &[&[f32]], score_w: &[f32], eps: f32, out: &mut [f32]) -> Result<(), BackendError> {
        self.profile.time("attn_res_mix", &self.gpu.traffic, || {
            let work = sources.len() * score_w.len();
            if sources.is_empty() || sources.len() > Limits::ATTN_RES_SOURCES || !self.on_gpu(work) || !self.fits(work)
            {
                return self.cpu.attn_res_mix(sources, score_w, eps, out);
            }
            Ok(self.ops.attn_res_mix(&self.gpu, sources, score_w, eps, out)?)
        })
    }

    fn attn_res_mix_rows(
        &self,
        sources: &[&[f32]],
        score_w: &[f32],
        eps: f32,
        out: &mut [f32],
    ) -> Result<(), BackendError> {
        if out.len() <= score_w.len() {
            return self.attn_res_mix(sources, score_w, eps, out);
        }
        // Many rows mix on the host's cores, timed as one call: the mix is a few operations per
        // element, less than a round trip of every source's rows would cost.
        self.profile
            .time("attn_res_mix_rows", &self.gpu.traffic, || self.cpu.attn_res_mix_rows(sources, score_w, eps, out))
    }

    fn route_top_k(
        &self,
        logits: &[f32],
        bias: &[f32],
        rule: RouteRule,
        experts: &mut [u32],
        weights: &mut [f32],
    ) -> Result<(), BackendError> {
        self.profile.time("route_top_k", &self.gpu.traffic, || {
            let fits =
                !bias.is_empty() && bias.len() <= Limits::EXPERTS && rule.k <= Limits::TOP_K && rule.k <= bias.len();
            if !fits || !self.on_gpu(logits.len()) || !self.fits(logits.len()) {
                return self.cpu.route_top_k(logits, bias, rule, experts, weights);
            }
            Ok(self.ops.route_top_k(&self.gpu, logits, bias, rule, experts, weights)?)
        })
    }

    fn argmax(&self, logits: &[f32]) -> Result<u32, BackendError> {
        self.profile.time("argmax", &self.gpu.traffic, || {
            if logits.is_empty() || !self.on_gpu(logits.len()) || !self.fits(logits.len()) {
                return self.cpu.argmax(logits);
            }
            Ok(self.ops.argmax(&self.gpu, logits)?)
        })
    }
}

fn copy_bits(words: &[u32], out: &mut [f32]) {
    for (o, w) in out.iter_mut().zip(words) {
        *o = f32::from_bits(*w);
    }
}
