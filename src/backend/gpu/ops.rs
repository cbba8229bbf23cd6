//! The GPU kernels of the forward pass besides the products: RMSNorm of rows, SiTU, the AttnRes
//! mix, routing top-k, argmax, the KDA token recurrence and the MLA attention core
//! (`kernels/{norm,route,kda,mla}.wgsl`, each with `kernels/detmath.wgsl` prepended).
//!
//! Contract: each kernel repeats the CPU kernel's operation order (16-lane dots with the fixed
//! tree, `mul_add` as `fma`, `detmath` for exp / tanh / sigmoid / division / rsqrt), so on an
//! adapter whose `fma` is fused the results are the CPU backend's bits; selections (top-k,
//! argmax) are total orders and pick the CPU's indices on any adapter. Each call uploads its
//! inputs, runs one submission and reads its results back, except the KDA state and the MLA
//! latent cache, which stay in device memory between calls (`state.rs`); other activations are
//! not resident.
//! The callers in `gpu/mod.rs` decide by size which calls come here and check the kernels' limits
//! (see [`Limits`]).

use super::device::{ComputeLayout, Gpu, GpuError, Stamp, shader};
use super::kernels::Kernel;
use crate::backend::{HeadIn, MlaDims, RouteRule};

/// The kernels' fixed sizes; larger calls stay on the CPU.
pub struct Limits;

impl Limits {
    /// Sources of one AttnRes mix (16 lanes each in one workgroup of 256).
    pub const ATTN_RES_SOURCES: usize = 16;
    /// Experts per router row and selected experts (workgroup arrays).
    pub const EXPERTS: usize = 1024;
    pub const TOP_K: usize = 64;
    /// MLA latent width and rope width (workgroup arrays).
    pub const LORA: usize = 1024;
    pub const ROPE: usize = 256;
    /// KDA key width (the state column in workgroup memory).
    pub const KDA_DK: usize = 128;
}

/// One output binding: read back (words), scratch (words, not read back), or a given buffer
/// that keeps the result on the device.
pub enum Dst<'a> {
    Read(usize),
    Scratch(usize),
    Into(&'a wgpu::Buffer),
}

/// One input binding.
pub enum Src<'a> {
    F32(&'a [f32]),
    Buf(&'a wgpu::Buffer),
    None,
}

pub struct Ops {
    layout: wgpu::BindGroupLayout,
    rms: wgpu::ComputePipeline,
    situ: wgpu::ComputePipeline,
    situ_deinterleave: wgpu::ComputePipeline,
    /// A writable binding for entry points that have no second output.
    spare: wgpu::Buffer,
    mix: wgpu::ComputePipeline,
    route: wgpu::ComputePipeline,
    argmax: wgpu::ComputePipeline,
    kda: wgpu::ComputePipeline,
    mla: wgpu::ComputePipeline,
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Workgroups for `n` items: (x, y) with x at most 65535 (the kernels index `y * 65535 + x`).
fn grid(n: usize) -> (u32, u32) {
    let n = n.max(1);
    if n <= 65_535 { (n as u32, 1) } else { (65_535, n.div_ceil(65_535) as u32) }
}

impl Ops {
    pub fn new(gpu: &Gpu) -> Self {
        let device = &gpu.device;
        // a, b, wq (read), out, out2 (written), then the parameters.
        let layout = ComputeLayout::new(device, "ops", &[true, true, true, false, false]);
        let module = |k| shader(device, k);
        let (norm, route, kda, mla) =
            (module(Kernel::Norm), module(Kernel::Route), module(Kernel::Kda), module(Kernel::Mla));
        let pipeline = |m: &wgpu::ShaderModule, entry: &str| layout.pipeline(device, m, entry);
        Ops {
            rms: pipeline(&norm, "rms_norm_rows"),
            situ: pipeline(&norm, "situ"),
            situ_deinterleave: pipeline(&norm, "situ_deinterleave"),
            spare: gpu.output(4),
            mix: pipeline(&norm, "attn_res_mix"),
            route: pipeline(&route, "route_top_k"),
            argmax: pipeline(&route, "argmax"),
            kda: pipeline(&kda, "kda_recurrent"),
            mla: pipeline(&mla, "mla_attention"),
            layout: layout.bind,
        }
    }

    /// One dispatch of `pipe` over `groups` with inputs `ins` (bindings 0-2), outputs `outs`
    /// (bindings 3-4) and `params`; returns the words of the outputs that are [`Dst::Read`].
    fn run(
        &self,
        gpu: &Gpu,
        pipe: &wgpu::ComputePipeline,
        ins: [Src; 3],
        outs: [Dst; 2],
        params: [u32; 16],
        groups: (u32, u32),
    ) -> Result<[Vec<u32>; 2], GpuError> {
        let staged: Vec<Option<wgpu::Buffer>> = ins
            .iter()
            .map(|s| match s {
                Src::F32(v) => Some(gpu.staged(&f32_bytes(v))),
                Src::Buf(_) => None,
                Src::None => Some(gpu.staged(&[0u8; 16])),
            })
            .collect();
        let bufs: Vec<&wgpu::Buffer> = ins
            .iter()
            .zip(&staged)
            .map(|(s, st)| match (s, st) {
                (Src::Buf(b), _) => *b,
                (_, Some(b)) => b,
                // Every other case was staged just above.
                (_, None) => unreachable!("input neither staged nor given"),
            })
            .collect();
        let pooled: Vec<Option<wgpu::Buffer>> = outs
            .iter()
            .map(|d| match d {
                Dst::Read(w) | Dst::Scratch(w) => Some(gpu.output(*w)),
                Dst::Into(_) => None,
            })
            .collect();
        let o: Vec<&wgpu::Buffer> = outs
            .iter()
            .zip(&pooled)
            .map(|(d, p)| match (d, p) {
                (Dst::Into(b), _) => *b,
                (_, Some(b)) => b,
                (_, None) => unreachable!("output neither pooled nor given"),
            })
            .collect();
        let bg = self.bind_all(gpu, [bufs[0], bufs[1], bufs[2], o[0], o[1]], params);
        let mut enc = gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        let stamp = gpu.stamp();
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("op"),
                timestamp_writes: Stamp::writes(&stamp),
            });
            pass.set_pipeline(pipe);
            pass.set_bind_group(0, &bg, &[]);
            pass.dispatch_workgroups(groups.0, groups.1, 1);
        }
        gpu.stamp_resolve(&mut enc, &stamp);
        let want: Vec<(&wgpu::Buffer, usize)> = o
            .iter()
            .zip(&outs)
            .filter_map(|(b, d)| match d {
                Dst::Read(w) if *w > 0 => Some((*b, *w)),
                _ => None,
            })
            .collect();
        let got = gpu.finish_words(enc, &want);
        for b in staged.into_iter().flatten() {
            gpu.give(super::device::STAGED, b);
        }
        let mut got = got?.into_iter();
        gpu.stamp_read(stamp, None);
        let res = outs.map(|d| match d {
            Dst::Read(w) if w > 0 => got.next().unwrap_or_default(),
            _ => Vec::new(),
        });
        for b in pooled.into_iter().flatten() {
            gpu.give(super::device::OUTPUT, b);
        }
        Ok(res)
    }

    /// RMSNorm of every row of `x` (rows of `w.len()`), in place.
    pub fn rms_norm_rows(&self, gpu: &Gpu, x: &mut [f32], w: &[f32], eps: f32) -> Result<(), GpuError> {
        let cols = w.len();
        let rows = x.len() / cols.max(1);
        let mut p = [0u32; 16];
        p[..3].copy_from_slice(&[cols as u32, rows as u32, eps.to_bits()]);
        let [o, _] = self.run(
            gpu,
            &self.rms,
            [Src::F32(x), Src::F32(w), Src::None],
            [Dst::Read(x.len()), Dst::Scratch(0)],
            p,
            grid(rows.div_ceil(16)),
        )?;
        copy_f32(&o, x);
        Ok(())
    }

    pub fn situ(
        &self,
        gpu: &Gpu,
        beta: f32,
        linear_beta: f32,
        gate: &[f32],
        up: &[f32],
        out: &mut [f32],
    ) -> Result<(), GpuError> {
        let n = out.len();
        let mut p = [0u32; 16];
        p[..3].copy_from_slice(&[n as u32, beta.to_bits(), linear_beta.to_bits()]);
        let (gx, gy) = grid(n.div_ceil(256));
        let [o, _] = self.run(
            gpu,
            &self.situ,
            [Src::F32(gate), Src::F32(up), Src::None],
            [Dst::Read(n), Dst::Scratch(0)],
            p,
            (gx, gy),
        )?;
        copy_f32(&o, out);
        Ok(())
    }

    /// The bind group of a, b, wq, out, out2 and a uniform block holding `params`.
    fn bind_all(&self, gpu: &Gpu, bufs: [&wgpu::Buffer; 5], params: [u32; 16]) -> wgpu::BindGroup {
        use wgpu::util::DeviceExt;
        let pbytes: Vec<u8> = params.iter().flat_map(|v| v.to_le_bytes()).collect();
        let p = gpu.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("op params"),
            contents: &pbytes,
            usage: wgpu::BufferUsages::UNIFORM,
        });
        let [a, b, wq, out, out2] = bufs;
        super::device::bind_group(&gpu.device, &self.layout, &[a, b, wq, out, out2, &p])
    }

    /// Encodes SiTU of `n` elements of device buffers `gate` and `up` (from float `up_off` of
    /// `up`) into `out` in the MXFP4 input order (`situ_deinterleave`; `n` a multiple of 32), for
    /// a chain of dispatches in one submission (the batched experts' w1/w3 -> SiTU -> w2).
    #[allow(clippy::too_many_arguments)]
    pub fn encode_situ_deinterleave(
        &self,
        gpu: &Gpu,
        pass: &mut wgpu::ComputePass<'_>,
        gate: &wgpu::Buffer,
        up: &wgpu::Buffer,
        out: &wgpu::Buffer,
        up_off: usize,
        n: usize,
        beta: f32,
        linear_beta: f32,
    ) {
        let mut params = [0u32; 16];
        params[..4].copy_from_slice(&[n as u32, beta.to_bits(), linear_beta.to_bits(), up_off as u32]);
        // Bindings 2 (wq) and 4 (out2) are not read by this entry point; any buffers of their
        // kinds do (`out` itself cannot be bound twice as writable; `spare` is never written).
        let bg = self.bind_all(gpu, [gate, up, &gpu.empty, out, &self.spare], params);
        pass.set_pipeline(&self.situ_deinterleave);
        pass.set_bind_group(0, &bg, &[]);
        let (gx, gy) = grid(n.div_ceil(256));
        pass.dispatch_workgroups(gx, gy, 1);
    }

    /// At most [`Limits::ATTN_RES_SOURCES`] sources.
    pub fn attn_res_mix(
        &self,
        gpu: &Gpu,
        sources: &[&[f32]],
        score_w: &[f32],
        eps: f32,
        out: &mut [f32],
    ) -> Result<(), GpuError> {
        let h = score_w.len();
        let packed: Vec<f32> = sources.iter().flat_map(|s| s.iter().copied()).collect();
        let mut p = [0u32; 16];
        p[..3].copy_from_slice(&[h as u32, sources.len() as u32, eps.to_bits()]);
        let [o, _] = self.run(
            gpu,
            &self.mix,
            [Src::F32(&packed), Src::F32(score_w), Src::None],
            [Dst::Read(h), Dst::Scratch(0)],
            p,
            (1, 1),
        )?;
        copy_f32(&o, out);
        Ok(())
    }

    /// At most [`Limits::EXPERTS`] experts and [`Limits::TOP_K`] selected.
    pub fn route_top_k(
        &self,
        gpu: &Gpu,
        logits: &[f32],
        bias: &[f32],
        rule: RouteRule,
        experts: &mut [u32],
        weights: &mut [f32],
    ) -> Result<(), GpuError> {
        let e = bias.len();
        let n = logits.len() / e.max(1);
        let mut p = [0u32; 16];
        p[..4].copy_from_slice(&[e as u32, rule.k as u32, rule.renormalize as u32, rule.scaling.to_bits()]);
        let [w, x] = self.run(
            gpu,
            &self.route,
            [Src::F32(logits), Src::F32(bias), Src::None],
            [Dst::Read(n * rule.k), Dst::Read(n * rule.k)],
            p,
            grid(n),
        )?;
        copy_f32(&w, weights);
        for (e, v) in experts.iter_mut().zip(&x) {
            *e = *v;
        }
        Ok(())
    }

    pub fn argmax(&self, gpu: &Gpu, logits: &[f32]) -> Result<u32, GpuError> {
        let mut p = [0u32; 16];
        p[0] = logits.len() as u32;
        let [_, i] = self.run(
            gpu,
            &self.argmax,
            [Src::F32(logits), Src::None, Src::None],
            [Dst::Scratch(0), Dst::Read(1)],
            p,
            (1, 1),
        )?;
        i.first().copied().ok_or_else(|| GpuError::Readback { msg: "argmax returned no index".into() })
    }

    /// The recurrence of every head over `n` rows from the state `s_in` into `s_out` (the final
    /// state [heads, dk, dv]; its words are returned when it is [`Dst::Read`]) and, with
    /// `with_o`, the outputs [heads, n, dv] (returned second).
    #[allow(clippy::too_many_arguments)]
    pub fn kda_recurrent(
        &self,
        gpu: &Gpu,
        s_in: Src,
        s_out: Dst,
        heads: &[HeadIn],
        dk: usize,
        dv: usize,
        with_o: bool,
    ) -> Result<(Vec<u32>, Vec<u32>), GpuError> {
        let nh = heads.len();
        let n = heads.first().map_or(0, |h| h.beta.len());
        // q only where outputs are wanted (a replay's rows carry no q).
        let mut a = Vec::with_capacity(3 * nh * n * dk);
        for part in if with_o { 0..3 } else { 1..3 } {
            for h in heads {
                a.extend_from_slice(match part {
                    0 => &h.q,
                    1 => &h.k,
                    _ => &h.g,
                });
            }
        }
        let mut vb: Vec<f32> = Vec::with_capacity(nh * n * (dv + 1));
        for h in heads {
            vb.extend_from_slice(&h.v);
        }
        for h in heads {
            vb.extend_from_slice(&h.beta);
        }
        let mut p = [0u32; 16];
        p[..5].copy_from_slice(&[nh as u32, n as u32, dk as u32, dv as u32, with_o as u32]);
        let [s, o] = self.run(
            gpu,
            &self.kda,
            [Src::F32(&a), s_in, Src::F32(&vb)],
            [s_out, if with_o { Dst::Read(nh * n * dv) } else { Dst::Scratch(0) }],
            p,
            // 32 columns per workgroup (`kda.wgsl`).
            (dv.div_ceil(32) as u32, nh as u32),
        )?;
        Ok((s, o))
    }

    /// The MLA core over the first `cache_floats` of the device cache `cache`, with kv_b resident
    /// in `kv_b` (one binding, bf16 rows `stride` elements apart); sizes within [`Limits`].
    #[allow(clippy::too_many_arguments)]
    pub fn mla_attention(
        &self,
        gpu: &Gpu,
        q: &[f32],
        (cache, cache_floats): (Src, usize),
        past: usize,
        (kv_b, stride): (&wgpu::Buffer, usize),
        d: MlaDims,
        scale: f32,
        causal: bool,
        out: &mut [f32],
    ) -> Result<(), GpuError> {
        let qd = d.nope + d.rope;
        let lat = d.lora + d.rope;
        let n = q.len() / (d.heads * qd).max(1);
        let all = cache_floats / lat.max(1);
        let vals = [
            d.heads,
            d.nope,
            d.rope,
            d.lora,
            d.v_head,
            past,
            all,
            causal as usize,
            scale.to_bits() as usize,
            n,
            all,
            stride,
        ];
        let mut p = [0u32; 16];
        for (dst, v) in p.iter_mut().zip(vals) {
            *dst = v as u32;
        }
        let [o, _] = self.run(
            gpu,
            &self.mla,
            [Src::F32(q), cache, Src::Buf(kv_b)],
            [Dst::Read(out.len()), Dst::Scratch(n * d.heads * all)],
            p,
            grid(n * d.heads),
        )?;
        copy_f32(&o, out);
        Ok(())
    }
}

fn copy_f32(words: &[u32], out: &mut [f32]) {
    for (o, w) in out.iter_mut().zip(words) {
        *o = f32::from_bits(*w);
    }
}
