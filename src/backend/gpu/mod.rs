//! The GPU backend: WGSL kernels (`kernels/`) through wgpu — Vulkan on Linux and Windows, Metal on
//! macOS (compiled by wgpu from the same WGSL; not run on Apple hardware here).
//!
//! Contract: the bf16 and MXFP4 matrix products run on the GPU in the CPU kernels' operation order
//! (16 lanes, fused multiply-add, the fixed reduction tree), so on an adapter whose `fma` is fused
//! ([`GpuBackend::fma_is_fused`]) they give the CPU's bits; on any adapter they stay within the
//! fp64 reference's tolerance. Trunk matrices are uploaded once ([`Backend::prepare`], or on first
//! use) and kept resident, split into bindings no larger than the adapter allows; expert bytes are
//! uploaded from the store's buffers (decoded in the kernel, never re-encoded): per call for
//! `matmul_mxfp4`, or a layer's experts in groups of one submission per phase through
//! [`Backend::expert_batch`] (`experts.rs`). Every other operation (norms, SiTU, KDA, MLA,
//! AttnRes) runs on the CPU kernels for now.

mod bench;
mod device;
mod experts;

pub use device::{AdapterSummary, GpuError, MatvecKernel};

use super::cpu::kda::HeadIn;
use super::cpu::mla::{MlaDims, Visible};
use super::cpu::ops::Situ;
use super::cpu::{Bf16Mat, Mxfp4Mat};
use super::{Backend, CpuBackend, EachExpert, ExpertBatch};
use crate::k3::weights::{Attn, Ffn, Weights};
use crate::model::roster::ExpertLayout;
use device::{Gpu, Kind, Resident};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// A resident copy and the matrix it copies (held, so that its address — the key — cannot be
/// reused by another matrix while the copy is cached).
type Entry = (Bf16Mat, Arc<Resident>);

pub struct GpuBackend {
    gpu: Gpu,
    resident: Mutex<HashMap<(usize, usize, usize), Entry>>,
    cpu: CpuBackend,
    fused: bool,
}

impl GpuBackend {
    /// The first adapter wgpu offers (a discrete or integrated GPU before a CPU one), or an error
    /// saying why there is none. `allow_cpu`: accept a software adapter (lavapipe) too.
    pub fn new(allow_cpu: bool) -> Result<Self, GpuError> {
        let gpu = Gpu::new(allow_cpu)?;
        let fused = gpu.fma_is_fused()?;
        Ok(GpuBackend { gpu, resident: Mutex::new(HashMap::new()), cpu: CpuBackend, fused })
    }

    pub fn adapter(&self) -> &AdapterSummary {
        &self.gpu.summary
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

    /// Seconds per dispatch of the product (weights resident; `mv`: the kernel for one input
    /// row) and of a plain read of the same bytes, each averaged over `reps` dispatches in one
    /// submission (for `bench kernels`).
    pub fn time_product(
        &self,
        kind: BenchKind,
        rows: usize,
        cols: usize,
        n: usize,
        reps: usize,
        mv: MatvecKernel,
    ) -> (f64, f64) {
        self.gpu.time_product(kind, rows, cols, n, reps, mv)
    }

    /// The kernel products with one input row use.
    pub fn matvec_kernel(&self) -> MatvecKernel {
        self.gpu.matvec_kernel
    }

    /// Picks the kernel for one input row (tests; `DELTAFIN_GPU_MATVEC` at start otherwise).
    pub fn set_matvec_kernel(&mut self, k: MatvecKernel) {
        self.gpu.matvec_kernel = k;
    }
}

/// What `time_product` measures.
#[derive(Clone, Copy, Debug)]
pub enum BenchKind {
    Bf16,
    Mxfp4,
}

impl Backend for GpuBackend {
    fn describe(&self) -> String {
        let a = &self.gpu.summary;
        format!(
            "gpu {} ({:?}, {}, fma {}, {} of trunk resident) + {}",
            a.name,
            a.device_type,
            a.backend,
            if self.fused { "fused" } else { "not fused" },
            crate::util::human_bytes(self.resident_bytes()),
            self.cpu.describe()
        )
    }

    fn prepare(&self, weights: &Weights) {
        let mut mats: Vec<&Bf16Mat> = vec![&weights.embed, &weights.lm_head];
        for l in &weights.layers {
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
        for m in mats {
            self.resident(m);
        }
    }

    fn matmul_bf16(&self, w: &Bf16Mat, xs: &[f32], out: &mut [f32]) {
        let r = self.resident(w);
        self.gpu.matmul(&r, Kind::Bf16, xs, out);
    }

    fn matmul_mxfp4(&self, w: &Mxfp4Mat, xds: &[f32], out: &mut [f32]) {
        let r = self.gpu.upload_mxfp4(w, false);
        self.gpu.matmul(&r, Kind::Mxfp4, xds, out);
        self.gpu.release(r);
    }

    fn expert_batch<'a>(&'a self, layout: &'a ExpertLayout, situ: Situ) -> Box<dyn ExpertBatch + 'a> {
        // One expert image per staging buffer: one that exceeds a binding goes matrix by matrix.
        if (experts::slot_layout(layout).1 as u64) > self.gpu.summary.max_binding {
            return Box::new(EachExpert { be: self, layout, situ, outs: Vec::new() });
        }
        Box::new(experts::GpuExperts::new(self, layout, situ))
    }

    fn rms_norm_rows(&self, x: &mut [f32], w: &[f32], eps: f32) {
        self.cpu.rms_norm_rows(x, w, eps)
    }

    fn situ(&self, situ: Situ, gate: &[f32], up: &[f32], out: &mut [f32]) {
        self.cpu.situ(situ, gate, up, out)
    }

    fn kda_update(
        &self,
        s_in: &[f32],
        s_out: &mut [f32],
        heads: &[HeadIn],
        dk: usize,
        dv: usize,
        o: &mut [f32],
        chunked: bool,
    ) {
        self.cpu.kda_update(s_in, s_out, heads, dk, dv, o, chunked)
    }

    fn kda_replay(&self, s: &mut [f32], heads: &[HeadIn], dk: usize, dv: usize) {
        self.cpu.kda_replay(s, heads, dk, dv)
    }

    fn mla_attention_with(
        &self,
        q: &[f32],
        cache: &[f32],
        past: usize,
        kv_b: &Bf16Mat,
        dims: MlaDims,
        scale: f32,
        visible: Visible,
        out: &mut [f32],
    ) {
        self.cpu.mla_attention_with(q, cache, past, kv_b, dims, scale, visible, out)
    }

    fn attn_res_mix(&self, sources: &[&[f32]], score_w: &[f32], eps: f32, out: &mut [f32]) {
        self.cpu.attn_res_mix(sources, score_w, eps, out)
    }
}
