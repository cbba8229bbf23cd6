//! The bf16 and MXFP4 products on the device: resident matrices (uploaded by rows into bindings
//! the adapter allows), their parameters, and the encoding, submission and readback of products.
//!
//! Contract: bf16 rows are stored padded with zeros to a multiple of 16 elements
//! (`Resident::stride`); a matrix may sit at a word offset inside a larger buffer (`Chunk::w_off`,
//! `s_off`); the one-input-row kernel (`matvec.wgsl`) reads its input as `vec4<f32>` from a float
//! offset that is a multiple of 4, zero past `cols` up to the stride. A product's bits do not
//! depend on how products are batched into submissions. Every failure is a [`GpuError`].

use super::pipeline::bind_group;
use super::timing::Stamp;
use super::{Gpu, GpuError, OUTPUT, STAGED};
use crate::backend::{Bf16Mat, Mxfp4Mat};
use wgpu::util::DeviceExt;

/// Weight rows and input rows per workgroup of `matmul` (64 `MM_ROWS` and `MM_XR` in the kernel).
pub(in crate::backend::gpu) const ROWS_PER_GROUP: usize = 128;
pub(in crate::backend::gpu) const XR: usize = 4;
/// Weight rows per workgroup of `matvec.wgsl`.
pub(in crate::backend::gpu) const MATVEC_ROWS: usize = 16;
/// Products one matvec dispatch may run (`MAX_JOBS` in `matvec.wgsl`): its uniform block holds
/// that many `Params`.
pub(in crate::backend::gpu) const MATVEC_JOBS: usize = 64;
/// Bytes of one `Params` in a uniform block.
const PARAMS_BYTES: usize = 48;
/// Workgroups per dispatch dimension (WebGPU's guaranteed limit).
pub(in crate::backend::gpu) const MAX_GROUPS: usize = 65_535;
/// Input rows one product dispatch takes (65535 workgroups of `XR` rows).
const PRODUCT_ROWS: usize = 65_535 * XR;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    Bf16 = 0,
    Mxfp4 = 1,
}

/// One product of [`Gpu::encode_image_matvecs`]: its weights and scales at these words of the
/// image, its input at float `x_off`, its output at float `out_off`.
pub(in crate::backend::gpu) struct MatvecJob {
    pub w_off: u32,
    pub s_off: u32,
    pub x_off: usize,
    pub out_off: usize,
}

/// A matrix in device memory, split by rows into bindings the adapter allows.
pub struct Resident {
    pub rows: usize,
    pub cols: usize,
    /// Elements per stored row (bf16: `cols` rounded up to 16; MXFP4: `cols`).
    pub stride: usize,
    pub bytes: u64,
    pub(in crate::backend::gpu) chunks: Vec<Chunk>,
}

impl Resident {
    /// The weight buffer when the matrix is one binding starting at its first word (the MLA
    /// kernel reads kv_b whole, rows `stride` elements apart).
    pub fn whole(&self) -> Option<&wgpu::Buffer> {
        match self.chunks.as_slice() {
            [c] if c.w_off == 0 => Some(&c.w),
            _ => None,
        }
    }
}

pub(in crate::backend::gpu) struct Chunk {
    pub row0: usize,
    pub rows: usize,
    pub w: wgpu::Buffer,
    pub scales: wgpu::Buffer,
    /// Word offsets of this chunk's weights and scales in `w` and `scales`.
    pub w_off: u32,
    pub s_off: u32,
}

#[derive(Clone, Copy, Default)]
pub(in crate::backend::gpu) struct Params {
    pub rows: u32,
    pub cols: u32,
    pub n: u32,
    pub kind: u32,
    pub row0: u32,
    pub out_rows: u32,
    pub w_off: u32,
    pub s_off: u32,
    pub stride: u32,
    pub x_off: u32,
    pub out_off: u32,
    /// The jobs of a matvec dispatch (job 0's; see [`MATVEC_JOBS`]).
    pub count: u32,
}

impl Params {
    fn bytes(&self) -> Vec<u8> {
        [
            self.rows,
            self.cols,
            self.n,
            self.kind,
            self.row0,
            self.out_rows,
            self.w_off,
            self.s_off,
            self.stride,
            self.x_off,
            self.out_off,
            self.count,
        ]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect()
    }
}

/// Little-endian bytes of floats: the floats' own memory on a little-endian host (activations of
/// a batched prefill are hundreds of MB a call: a per-float copy cost more than the kernels).
pub(in crate::backend::gpu) fn f32_bytes(v: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        std::borrow::Cow::Borrowed(bytemuck::cast_slice(v))
    } else {
        std::borrow::Cow::Owned(v.iter().flat_map(|f| f.to_le_bytes()).collect())
    }
}

impl Gpu {
    /// Rows per binding so that one chunk's bytes stay within the adapter's binding limit.
    fn rows_per_chunk(&self, row_bytes: usize, rows: usize) -> usize {
        let max = (self.summary.max_binding as usize).saturating_sub(4).max(row_bytes);
        (max / row_bytes.max(1)).clamp(1, rows.max(1))
    }

    /// A trunk matrix in device memory, each row padded with zeros to `stride` elements (so the
    /// kernels' tail is fma(0, 0, acc) and every row starts on a 32-byte boundary).
    pub fn upload_bf16(&self, w: &Bf16Mat) -> Resident {
        let (rows, cols) = (w.rows, w.cols);
        let stride = cols.div_ceil(16) * 16;
        let per = self.rows_per_chunk(stride * 2, rows);
        let chunks = (0..rows)
            .step_by(per)
            .map(|r0| {
                let n = per.min(rows - r0);
                let mut bytes = vec![0u8; n * stride * 2];
                for (r, dst) in (r0..r0 + n).zip(bytes.chunks_exact_mut(stride * 2)) {
                    w.copy_bf16_row(r, &mut dst[..cols * 2]);
                }
                Chunk {
                    row0: r0,
                    rows: n,
                    w: self.storage("bf16", &bytes),
                    scales: self.empty.clone(),
                    w_off: 0,
                    s_off: 0,
                }
            })
            .collect();
        Resident { rows, cols, stride, bytes: (rows * stride * 2) as u64, chunks }
    }

    /// An expert's matrix for one call (pooled buffers, given back by [`Gpu::release`]); `exact`:
    /// buffers of exactly its size instead (for measuring reads of exactly those bytes).
    pub fn upload_mxfp4(&self, w: &Mxfp4Mat, exact: bool) -> Resident {
        let (rows, cols) = (w.rows, w.cols);
        let (pb, sb) = (cols / 2, cols / 32);
        let per = self.rows_per_chunk(pb, rows);
        let chunks = (0..rows)
            .step_by(per)
            .map(|r0| {
                let n = per.min(rows - r0);
                Chunk {
                    row0: r0,
                    rows: n,
                    w: if exact {
                        self.storage("mxfp4", &w.packed[r0 * pb..(r0 + n) * pb])
                    } else {
                        self.staged(&w.packed[r0 * pb..(r0 + n) * pb])
                    },
                    scales: if exact {
                        self.storage("scales", &w.scales[r0 * sb..(r0 + n) * sb])
                    } else {
                        self.staged(&w.scales[r0 * sb..(r0 + n) * sb])
                    },
                    w_off: 0,
                    s_off: 0,
                }
            })
            .collect();
        Resident { rows, cols, stride: cols, bytes: (rows * (pb + sb)) as u64, chunks }
    }

    /// The pipeline of `entry` in `module` on the product kernels' layout (for the kernel
    /// microbench's variants).
    #[cfg(feature = "gpu-bench")]
    pub(in crate::backend::gpu) fn pipeline_of(
        &self,
        module: &wgpu::ShaderModule,
        entry: &str,
    ) -> wgpu::ComputePipeline {
        self.products_layout.pipeline(&self.device, module, entry)
    }

    pub(in crate::backend::gpu) fn bind(
        &self,
        w: &wgpu::Buffer,
        s: &wgpu::Buffer,
        x: &wgpu::Buffer,
        out: &wgpu::Buffer,
        p: &wgpu::Buffer,
    ) -> wgpu::BindGroup {
        bind_group(&self.device, &self.products_layout.bind, &[w, s, x, out, p])
    }

    /// The uniform block of one `matmul.wgsl` product (one `Params`).
    pub(in crate::backend::gpu) fn uniform(&self, p: Params) -> wgpu::Buffer {
        self.uniform_bytes(&p.bytes())
    }

    /// The uniform block of a `matvec.wgsl` dispatch of `jobs` (at most [`MATVEC_JOBS`]), sized
    /// for all [`MATVEC_JOBS`] that the kernel declares; job 0 carries the count.
    pub(in crate::backend::gpu) fn uniform_jobs(&self, jobs: &[Params]) -> wgpu::Buffer {
        // More would be dropped from the block (and none leave its output unwritten).
        assert!(!jobs.is_empty() && jobs.len() <= MATVEC_JOBS, "1 to {MATVEC_JOBS} matvec jobs, not {}", jobs.len());
        let mut contents = vec![0u8; MATVEC_JOBS * PARAMS_BYTES];
        for (slot, p) in contents.chunks_exact_mut(PARAMS_BYTES).zip(jobs) {
            slot.copy_from_slice(&p.bytes());
        }
        contents[PARAMS_BYTES - 4..PARAMS_BYTES].copy_from_slice(&(jobs.len() as u32).to_le_bytes());
        self.uniform_bytes(&contents)
    }

    fn uniform_bytes(&self, contents: &[u8]) -> wgpu::Buffer {
        self.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("params"),
            contents,
            usage: wgpu::BufferUsages::UNIFORM,
        })
    }

    /// Encodes `jobs` (one-row products, each `Params` with its own offsets) as matvec dispatches
    /// of at most [`MATVEC_JOBS`] over the same bindings; every job has `jobs[0]`'s row count.
    #[allow(clippy::too_many_arguments)]
    fn dispatch_matvecs(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        w: &wgpu::Buffer,
        s: &wgpu::Buffer,
        x: &wgpu::Buffer,
        out: &wgpu::Buffer,
        jobs: &[Params],
    ) {
        pass.set_pipeline(&self.matvec);
        for batch in jobs.chunks(MATVEC_JOBS) {
            let u = self.uniform_jobs(batch);
            pass.set_bind_group(0, &self.bind(w, s, x, out, &u), &[]);
            let groups = (batch[0].rows as usize).div_ceil(MATVEC_ROWS) * batch.len();
            // Workgroups past 65535 go to a second dimension (the kernel folds it back).
            let gx = groups.clamp(1, MAX_GROUPS);
            pass.dispatch_workgroups(gx as u32, groups.div_ceil(gx) as u32, 1);
        }
    }

    pub(in crate::backend::gpu) fn output(&self, floats: usize) -> wgpu::Buffer {
        self.take(OUTPUT, (floats.max(1) * 4) as u64)
    }

    /// Gives a per-call matrix's buffers back to the pool.
    pub fn release(&self, r: Resident) {
        for c in r.chunks {
            self.give(STAGED, c.w);
            self.give(STAGED, c.scales);
        }
    }

    /// Encodes `out[out_off + i * rows + r] = W[r] . x[x_off + i * cols ..]` for the `n` input
    /// rows (`n == 1`: the matvec kernel, whose input is padded to the stride; else the matmul).
    #[allow(clippy::too_many_arguments)]
    pub(in crate::backend::gpu) fn encode_products(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        r: &Resident,
        kind: Kind,
        x: &wgpu::Buffer,
        x_off: usize,
        out: &wgpu::Buffer,
        out_off: usize,
        n: usize,
    ) {
        if n != 1 {
            pass.set_pipeline(&self.matmul);
        }
        for c in &r.chunks {
            let p = Params {
                rows: c.rows as u32,
                cols: r.cols as u32,
                n: n as u32,
                kind: kind as u32,
                row0: c.row0 as u32,
                out_rows: r.rows as u32,
                w_off: c.w_off,
                s_off: c.s_off,
                stride: r.stride as u32,
                x_off: x_off as u32,
                out_off: out_off as u32,
                count: 1,
            };
            if n == 1 {
                self.dispatch_matvecs(pass, &c.w, &c.scales, x, out, &[p]);
            } else {
                let u = self.uniform(p);
                pass.set_bind_group(0, &self.bind(&c.w, &c.scales, x, out, &u), &[]);
                pass.dispatch_workgroups(c.rows.div_ceil(ROWS_PER_GROUP) as u32, n.div_ceil(XR) as u32, 1);
            }
        }
    }

    /// Encodes one-row MXFP4 products of equal shape (`rows` x `cols`) whose weights and scales
    /// are all in `image` (expert images): `out[job.out_off + r] = W_job[r] . x[job.x_off ..]`,
    /// up to [`MATVEC_JOBS`] products per dispatch. Each product's bits are those of
    /// [`Gpu::encode_products`] on the same matrix (the same kernel, job by job).
    #[allow(clippy::too_many_arguments)]
    pub(in crate::backend::gpu) fn encode_image_matvecs(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        image: &wgpu::Buffer,
        rows: usize,
        cols: usize,
        jobs: &[MatvecJob],
        x: &wgpu::Buffer,
        out: &wgpu::Buffer,
    ) {
        if rows == 0 {
            return;
        }
        let params: Vec<Params> = jobs
            .iter()
            .map(|j| Params {
                rows: rows as u32,
                cols: cols as u32,
                n: 1,
                kind: Kind::Mxfp4 as u32,
                out_rows: rows as u32,
                w_off: j.w_off,
                s_off: j.s_off,
                stride: cols as u32,
                x_off: j.x_off as u32,
                out_off: j.out_off as u32,
                ..Default::default()
            })
            .collect();
        self.dispatch_matvecs(pass, image, image, x, out, &params);
    }

    /// The input rows `xs` (`cols` each) as the product kernels read them: for `n == 1` padded
    /// with zeros to `stride`.
    pub(in crate::backend::gpu) fn input_bytes(xs: &[f32], cols: usize, stride: usize) -> std::borrow::Cow<'_, [u8]> {
        if xs.len() == cols && stride > cols {
            let mut v = xs.to_vec();
            v.resize(stride, 0.0);
            return std::borrow::Cow::Owned(f32_bytes(&v).into_owned());
        }
        f32_bytes(xs)
    }

    /// out[i, r] = W[r] . xs[i] for every row i of `xs` (batches of at most 65535 rows).
    pub fn matmul(&self, r: &Resident, kind: Kind, xs: &[f32], out: &mut [f32]) -> Result<(), GpuError> {
        self.matmul_many(&[r], kind, xs, &mut [out])
    }

    /// [`Gpu::matmul`] of several matrices on the same input rows (every one `rs[0]`'s width and
    /// stride): one upload of the inputs and one submission and readback per batch of rows.
    pub fn matmul_many(
        &self,
        rs: &[&Resident],
        kind: Kind,
        xs: &[f32],
        outs: &mut [&mut [f32]],
    ) -> Result<(), GpuError> {
        let Some(first) = rs.first() else { return Ok(()) };
        let (cols, stride) = (first.cols, first.stride);
        let n = xs.len() / cols.max(1);
        for b0 in (0..n).step_by(PRODUCT_ROWS) {
            let nb = PRODUCT_ROWS.min(n - b0);
            let x = self.staged(&Self::input_bytes(&xs[b0 * cols..(b0 + nb) * cols], cols, stride));
            let jobs: Vec<(&Resident, &wgpu::Buffer, usize)> = rs.iter().map(|r| (*r, &x, nb)).collect();
            let all = self.submit_products(&jobs, kind, "matmul");
            self.give(STAGED, x);
            let all = all?;
            let mut at = 0;
            for (out, r) in outs.iter_mut().zip(rs) {
                let k = nb * r.rows;
                super::par_copy(&mut out[b0 * r.rows..(b0 + nb) * r.rows], &all[at..at + k]);
                at += k;
            }
        }
        Ok(())
    }

    /// Products of several matrices, each on its own input rows (`outs[j] = rs[j] . xs[j]`): each
    /// input uploaded, every product in one submission with one readback. Inputs of more rows
    /// than one dispatch takes go product by product ([`Gpu::matmul`]).
    pub fn matmul_each(
        &self,
        rs: &[&Resident],
        kind: Kind,
        xs: &[&[f32]],
        outs: &mut [&mut [f32]],
    ) -> Result<(), GpuError> {
        debug_assert!(rs.len() == xs.len() && rs.len() == outs.len(), "one input and one output per matrix");
        let rows = |i: usize| xs[i].len() / rs[i].cols.max(1);
        // Products of no rows have nothing to do.
        let live: Vec<usize> = (0..rs.len()).filter(|&i| rows(i) > 0).collect();
        if live.iter().any(|&i| rows(i) > PRODUCT_ROWS) {
            for &i in &live {
                self.matmul(rs[i], kind, xs[i], outs[i])?;
            }
            return Ok(());
        }
        if live.is_empty() {
            return Ok(());
        }
        let inputs: Vec<wgpu::Buffer> =
            live.iter().map(|&i| self.staged(&Self::input_bytes(xs[i], rs[i].cols, rs[i].stride))).collect();
        let jobs: Vec<(&Resident, &wgpu::Buffer, usize)> =
            live.iter().zip(&inputs).map(|(&i, x)| (rs[i], x, rows(i))).collect();
        let all = self.submit_products(&jobs, kind, "matmul each");
        for x in inputs {
            self.give(STAGED, x);
        }
        let all = all?;
        let mut at = 0;
        for &i in &live {
            let k = rows(i) * rs[i].rows;
            super::par_copy(&mut outs[i][..k], &all[at..at + k]);
            at += k;
        }
        Ok(())
    }

    /// One submission of `jobs` (matrix, input buffer, input rows), each product into its own
    /// output; returns the floats of all of them, in order (one readback).
    fn submit_products(
        &self,
        jobs: &[(&Resident, &wgpu::Buffer, usize)],
        kind: Kind,
        label: &str,
    ) -> Result<Vec<f32>, GpuError> {
        let bufs: Vec<(wgpu::Buffer, u64)> = jobs
            .iter()
            .map(|(r, _, n)| {
                let k = n * r.rows;
                (self.output(k), (k * 4) as u64)
            })
            .collect();
        let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        let stamp = self.stamp();
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(label),
                timestamp_writes: Stamp::writes(&stamp),
            });
            for ((r, x, n), (o, _)) in jobs.iter().zip(&bufs) {
                self.encode_products(&mut pass, r, kind, x, 0, o, 0, *n);
            }
        }
        self.stamp_resolve(&mut enc, &stamp);
        let list: Vec<(&wgpu::Buffer, u64)> = bufs.iter().map(|(b, len)| (b, *len)).collect();
        let all = self.finish_many(enc, &list)?;
        self.stamp_read(stamp, None);
        for (b, _) in bufs {
            self.give(OUTPUT, b);
        }
        Ok(all)
    }

    /// Whether the adapter's `fma` rounds once: a case where fused and unfused differ, plus
    /// random triples, against the CPU's `mul_add`.
    pub fn fma_is_fused(&self) -> Result<bool, GpuError> {
        let e = 1.0 + f32::EPSILON * 2048.0;
        let mut triples = vec![e, e, -(1.0 + f32::EPSILON * 4096.0)];
        let mut seed = 0x1234_5678u64;
        for _ in 0..63 {
            for _ in 0..3 {
                seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                triples.push(((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0);
            }
        }
        let n = triples.len() / 3;
        let xb: Vec<u8> = triples.iter().flat_map(|v| v.to_le_bytes()).collect();
        let x = self.storage("x", &xb);
        let o = self.output(n);
        let p = self.uniform(Params::default());
        let bg = self.bind(&self.empty, &self.empty, &x, &o, &p);
        let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        {
            let mut pass =
                enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("fma"), timestamp_writes: None });
            pass.set_pipeline(&self.fma_probe);
            pass.set_bind_group(0, &bg, &[]);
            pass.dispatch_workgroups(n as u32, 1, 1);
        }
        let got = self.finish(enc, &o, n)?;
        if got.iter().any(|v| v.is_nan()) {
            return Err(GpuError::Probe("the fma probe returned NaN".into()));
        }
        Ok(triples.chunks_exact(3).zip(&got).all(|(t, g)| t[0].mul_add(t[1], t[2]).to_bits() == g.to_bits()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_matvec_kernel_declares_as_many_jobs_as_its_uniform_block_holds() {
        let decl = format!("const MAX_JOBS: u32 = {MATVEC_JOBS}u;");
        assert!(crate::backend::gpu::kernels::MATVEC.contains(&decl), "kernels/matvec.wgsl must declare `{decl}`");
        assert_eq!(Params::default().bytes().len(), PARAMS_BYTES);
    }
}
