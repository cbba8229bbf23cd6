//! The wgpu device, the kernels' pipelines, resident matrices and the dispatch/readback of one
//! product. Every product is one submission that ends with its result read back (the rest of the
//! forward pass runs on the CPU between products).

use crate::cpu::{Bf16Mat, Mxfp4Mat};
use std::time::Instant;
use wgpu::util::DeviceExt;

const SHADER: &str = include_str!("../../../kernels/matmul.wgsl");
const ROWS_PER_GROUP: usize = 16;
/// Input rows per workgroup (`XR` in the kernel).
const XR: usize = 4;
/// Weight rows per workgroup of the one-input-row kernel (`matvec`).
const MATVEC_ROWS: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no GPU adapter found (wgpu saw: {seen}); use --backend cpu")]
    NoAdapter { seen: String },
    #[error("cannot open the GPU device {adapter}: {msg}")]
    Device { adapter: String, msg: String },
    #[error("the GPU probe failed: {0}")]
    Probe(String),
}

/// What the startup line says about the adapter.
#[derive(Clone, Debug)]
pub struct AdapterSummary {
    pub name: String,
    pub device_type: wgpu::DeviceType,
    pub backend: String,
    pub driver: String,
    pub max_binding: u64,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    Bf16 = 0,
    Mxfp4 = 1,
}

/// A matrix in device memory, split by rows into bindings the adapter allows.
pub struct Resident {
    pub rows: usize,
    pub cols: usize,
    pub bytes: u64,
    chunks: Vec<Chunk>,
}

impl Resident {
    /// The weight buffer when the matrix is one binding (the MLA kernel reads kv_b whole).
    pub fn whole(&self) -> Option<&wgpu::Buffer> {
        match self.chunks.as_slice() {
            [c] => Some(&c.w),
            _ => None,
        }
    }
}

struct Chunk {
    row0: usize,
    rows: usize,
    w: wgpu::Buffer,
    scales: wgpu::Buffer,
}

/// Buffers of one call kept for the next (creating device buffers per product costs more than
/// the product): by usage and power-of-two size.
#[derive(Default)]
struct Pool {
    free: std::sync::Mutex<std::collections::HashMap<(u32, u64), Vec<wgpu::Buffer>>>,
}

pub struct Gpu {
    pool: Pool,
    pub(super) device: wgpu::Device,
    pub(super) queue: wgpu::Queue,
    layout: wgpu::BindGroupLayout,
    matmul: wgpu::ComputePipeline,
    matvec: wgpu::ComputePipeline,
    read_all: wgpu::ComputePipeline,
    fma_probe: wgpu::ComputePipeline,
    empty: wgpu::Buffer,
    pub summary: AdapterSummary,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Params {
    rows: u32,
    cols: u32,
    n: u32,
    kind: u32,
    row0: u32,
    out_rows: u32,
    pad: [u32; 2],
}

impl Params {
    fn bytes(&self) -> Vec<u8> {
        [self.rows, self.cols, self.n, self.kind, self.row0, self.out_rows, self.pad[0], self.pad[1]]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect()
    }
}

pub(super) const STAGED: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE.union(wgpu::BufferUsages::COPY_DST);
pub(super) const OUTPUT: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE.union(wgpu::BufferUsages::COPY_SRC);
const READBACK: wgpu::BufferUsages = wgpu::BufferUsages::MAP_READ.union(wgpu::BufferUsages::COPY_DST);

fn rank(t: wgpu::DeviceType) -> u8 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    }
}

/// Bytes padded to whole u32 words (storage bindings are arrays of u32).
fn padded(b: &[u8]) -> Vec<u8> {
    let mut v = b.to_vec();
    v.resize(b.len().div_ceil(4).max(1) * 4, 0);
    v
}

impl Gpu {
    pub fn new(allow_cpu: bool) -> Result<Self, GpuError> {
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        desc.backends = wgpu::Backends::VULKAN | wgpu::Backends::METAL;
        let instance = wgpu::Instance::new(desc);
        let mut adapters =
            pollster::block_on(instance.enumerate_adapters(wgpu::Backends::VULKAN | wgpu::Backends::METAL));
        let seen = adapters
            .iter()
            .map(|a| {
                let i = a.get_info();
                format!("{} ({:?})", i.name, i.device_type)
            })
            .collect::<Vec<_>>()
            .join(", ");
        adapters.retain(|a| allow_cpu || a.get_info().device_type != wgpu::DeviceType::Cpu);
        adapters.sort_by_key(|a| rank(a.get_info().device_type));
        let Some(adapter) = adapters.into_iter().next() else {
            return Err(GpuError::NoAdapter { seen: if seen.is_empty() { "none".into() } else { seen } });
        };
        let info = adapter.get_info();
        let limits = adapter.limits();
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("deltafin"),
            required_features: wgpu::Features::empty(),
            required_limits: limits.clone(),
            ..Default::default()
        }))
        .map_err(|e| GpuError::Device { adapter: info.name.clone(), msg: e.to_string() })?;
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("matmul.wgsl"),
            source: wgpu::ShaderSource::Wgsl(SHADER.into()),
        });
        let storage = |binding, read_only| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Storage { read_only },
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        };
        let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("matmul"),
            entries: &[
                storage(0, true),
                storage(1, true),
                storage(2, true),
                storage(3, false),
                wgpu::BindGroupLayoutEntry {
                    binding: 4,
                    visibility: wgpu::ShaderStages::COMPUTE,
                    ty: wgpu::BindingType::Buffer {
                        ty: wgpu::BufferBindingType::Uniform,
                        has_dynamic_offset: false,
                        min_binding_size: None,
                    },
                    count: None,
                },
            ],
        });
        let pl = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some("matmul"),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        let pipeline = |entry: &str| {
            device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: Some(&pl),
                module: &module,
                entry_point: Some(entry),
                compilation_options: Default::default(),
                cache: None,
            })
        };
        let (matmul, matvec) = (pipeline("matmul"), pipeline("matvec"));
        let (read_all, fma_probe) = (pipeline("read_all"), pipeline("fma_probe"));
        let empty = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("empty"),
            contents: &[0u8; 16],
            usage: wgpu::BufferUsages::STORAGE,
        });
        let summary = AdapterSummary {
            name: info.name.clone(),
            device_type: info.device_type,
            backend: format!("{:?}", info.backend).to_lowercase(),
            driver: format!("{} {}", info.driver, info.driver_info).trim().to_string(),
            max_binding: limits.max_storage_buffer_binding_size.min(limits.max_buffer_size),
        };
        Ok(Gpu { pool: Pool::default(), device, queue, layout, matmul, matvec, read_all, fma_probe, empty, summary })
    }

    /// A pooled buffer of at least `size` bytes with `usage`.
    pub(super) fn take(&self, usage: wgpu::BufferUsages, size: u64) -> wgpu::Buffer {
        let pow2 = size.max(256).next_power_of_two();
        let size = if pow2 <= self.summary.max_binding { pow2 } else { size.div_ceil(4) * 4 };
        let key = (usage.bits(), size);
        if let Some(b) = self.pool.free.lock().ok().and_then(|mut m| m.get_mut(&key).and_then(|v| v.pop())) {
            return b;
        }
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("pooled"),
            size,
            usage,
            mapped_at_creation: false,
        })
    }

    pub(super) fn give(&self, usage: wgpu::BufferUsages, b: wgpu::Buffer) {
        if let Ok(mut m) = self.pool.free.lock() {
            let v = m.entry((usage.bits(), b.size())).or_default();
            // A few per size are enough (one call's worth, plus the chunks of a large matrix).
            if v.len() < 8 {
                v.push(b);
            }
        }
    }

    /// `bytes` in a pooled storage buffer (uploaded through the queue).
    pub(super) fn staged(&self, bytes: &[u8]) -> wgpu::Buffer {
        let b = self.take(STAGED, bytes.len() as u64);
        self.queue.write_buffer(&b, 0, &padded(bytes));
        b
    }

    fn storage(&self, label: &str, bytes: &[u8]) -> wgpu::Buffer {
        self.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some(label),
            contents: &padded(bytes),
            usage: wgpu::BufferUsages::STORAGE,
        })
    }

    /// Rows per binding so that one chunk's bytes stay within the adapter's binding limit.
    fn rows_per_chunk(&self, row_bytes: usize, rows: usize) -> usize {
        let max = (self.summary.max_binding as usize).saturating_sub(4).max(row_bytes);
        (max / row_bytes.max(1)).clamp(1, rows.max(1))
    }

    pub fn upload_bf16(&self, w: &Bf16Mat) -> Resident {
        let (rows, cols) = (w.rows, w.cols);
        let per = self.rows_per_chunk(cols * 2, rows);
        let chunks = (0..rows)
            .step_by(per)
            .map(|r0| {
                let n = per.min(rows - r0);
                let mut bytes = Vec::with_capacity(n * cols * 2);
                for r in r0..r0 + n {
                    bytes.extend_from_slice(w.row(r));
                }
                Chunk { row0: r0, rows: n, w: self.storage("bf16", &bytes), scales: self.empty.clone() }
            })
            .collect();
        Resident { rows, cols, bytes: (rows * cols * 2) as u64, chunks }
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
                }
            })
            .collect();
        Resident { rows, cols, bytes: (rows * (pb + sb)) as u64, chunks }
    }

    fn bind(
        &self,
        w: &wgpu::Buffer,
        s: &wgpu::Buffer,
        x: &wgpu::Buffer,
        out: &wgpu::Buffer,
        p: &wgpu::Buffer,
    ) -> wgpu::BindGroup {
        let entries: Vec<wgpu::BindGroupEntry> = [w, s, x, out, p]
            .iter()
            .enumerate()
            .map(|(i, b)| wgpu::BindGroupEntry { binding: i as u32, resource: b.as_entire_binding() })
            .collect();
        self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &self.layout,
            entries: &entries,
        })
    }

    fn uniform(&self, p: Params) -> wgpu::Buffer {
        self.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("params"),
            contents: &p.bytes(),
            usage: wgpu::BufferUsages::UNIFORM,
        })
    }

    pub(super) fn output(&self, floats: usize) -> wgpu::Buffer {
        self.take(OUTPUT, (floats.max(1) * 4) as u64)
    }

    /// Gives a per-call matrix's buffers back to the pool.
    pub fn release(&self, r: Resident) {
        for c in r.chunks {
            self.give(STAGED, c.w);
            self.give(STAGED, c.scales);
        }
    }

    /// Submits `encoder` after copying `out` to a mapped buffer; returns its floats.
    fn finish(&self, encoder: wgpu::CommandEncoder, out: &wgpu::Buffer, floats: usize) -> Vec<f32> {
        self.finish_words(encoder, &[(out, floats)]).pop().unwrap_or_default().into_iter().map(f32::from_bits).collect()
    }

    /// Submits `encoder` after copying each (buffer, words) to a mapped buffer; returns their
    /// 32-bit words (NaN on a failed readback).
    pub(super) fn finish_words(
        &self,
        mut encoder: wgpu::CommandEncoder,
        outs: &[(&wgpu::Buffer, usize)],
    ) -> Vec<Vec<u32>> {
        let reads: Vec<(wgpu::Buffer, usize)> = outs
            .iter()
            .map(|&(out, words)| {
                let size = (words.max(1) * 4) as u64;
                let read = self.take(READBACK, size);
                encoder.copy_buffer_to_buffer(out, 0, &read, 0, size);
                (read, words)
            })
            .collect();
        self.queue.submit([encoder.finish()]);
        reads.into_iter().map(|(read, words)| self.read_mapped(read, words)).collect()
    }

    fn read_mapped(&self, read: wgpu::Buffer, floats: usize) -> Vec<u32> {
        read.map_async(wgpu::MapMode::Read, .., |r| {
            if let Err(e) = r {
                tracing::error!("GPU readback failed: {e}");
            }
        });
        if let Err(e) = self.device.poll(wgpu::PollType::wait_indefinitely()) {
            tracing::error!("GPU wait failed: {e}");
        }
        let v = match read.get_mapped_range(..) {
            Ok(view) => {
                view.chunks_exact(4).take(floats).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
            }
            Err(e) => {
                tracing::error!("GPU readback failed: {e}");
                vec![f32::NAN.to_bits(); floats]
            }
        };
        read.unmap();
        self.give(READBACK, read);
        v
    }

    fn encode_products(
        &self,
        enc: &mut wgpu::CommandEncoder,
        r: &Resident,
        kind: Kind,
        x: &wgpu::Buffer,
        out: &wgpu::Buffer,
        n: usize,
    ) {
        let groups: Vec<(wgpu::BindGroup, u32)> = r
            .chunks
            .iter()
            .map(|c| {
                let p = self.uniform(Params {
                    rows: c.rows as u32,
                    cols: r.cols as u32,
                    n: n as u32,
                    kind: kind as u32,
                    row0: c.row0 as u32,
                    out_rows: r.rows as u32,
                    pad: [0; 2],
                });
                let per_group = if n == 1 { MATVEC_ROWS } else { ROWS_PER_GROUP };
                (self.bind(&c.w, &c.scales, x, out, &p), c.rows.div_ceil(per_group) as u32)
            })
            .collect();
        let mut pass =
            enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("matmul"), timestamp_writes: None });
        pass.set_pipeline(if n == 1 { &self.matvec } else { &self.matmul });
        for (bg, wx) in &groups {
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_workgroups(*wx, n.div_ceil(XR) as u32, 1);
        }
    }

    /// out[i, r] = W[r] . xs[i] for every row i of `xs` (batches of at most 65535 rows).
    pub fn matmul(&self, r: &Resident, kind: Kind, xs: &[f32], out: &mut [f32]) {
        let n = xs.len() / r.cols.max(1);
        const BATCH: usize = 65_535 * XR;
        for b0 in (0..n).step_by(BATCH) {
            let nb = BATCH.min(n - b0);
            let xb: Vec<u8> = xs[b0 * r.cols..(b0 + nb) * r.cols].iter().flat_map(|v| v.to_le_bytes()).collect();
            let x = self.staged(&xb);
            let o = self.output(nb * r.rows);
            let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
            self.encode_products(&mut enc, r, kind, &x, &o, nb);
            let v = self.finish(enc, &o, nb * r.rows);
            out[b0 * r.rows..(b0 + nb) * r.rows].copy_from_slice(&v);
            self.give(STAGED, x);
            self.give(OUTPUT, o);
        }
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
        let p = self.uniform(Params { rows: 0, cols: 0, n: 0, kind: 0, row0: 0, out_rows: 0, pad: [0; 2] });
        let bg = self.bind(&self.empty, &self.empty, &x, &o, &p);
        let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        {
            let mut pass =
                enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("fma"), timestamp_writes: None });
            pass.set_pipeline(&self.fma_probe);
            pass.set_bind_group(0, &bg, &[]);
            pass.dispatch_workgroups(n as u32, 1, 1);
        }
        let got = self.finish(enc, &o, n);
        if got.iter().any(|v| v.is_nan()) {
            return Err(GpuError::Probe("the fma probe returned NaN".into()));
        }
        Ok(triples.chunks_exact(3).zip(&got).all(|(t, g)| t[0].mul_add(t[1], t[2]).to_bits() == g.to_bits()))
    }

    /// Seconds per product dispatch (weights resident, `n` input rows) and per plain read of the
    /// same weight bytes, each averaged over `reps` dispatches in one submission.
    pub fn time_product(&self, kind: super::BenchKind, rows: usize, cols: usize, n: usize, reps: usize) -> (f64, f64) {
        let mut seed = 7u64;
        let mut byte = || {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            (seed >> 33) as u8
        };
        let r = match kind {
            super::BenchKind::Bf16 => {
                // Normal values of moderate size (random bits would include NaNs and denormals).
                let b: Vec<u8> = (0..rows * cols).flat_map(|_| [byte(), (byte() & 0x80) | 0x3d]).collect();
                self.upload_bf16(&Bf16Mat::from_vec(b, rows, cols))
            }
            super::BenchKind::Mxfp4 => {
                let packed: Vec<u8> = (0..rows * cols / 2).map(|_| byte()).collect();
                let scales = vec![121u8; rows * cols / 32];
                self.upload_mxfp4(&Mxfp4Mat::new(&packed, &scales, rows, cols), true)
            }
        };
        let xb: Vec<u8> = (0..n * cols).flat_map(|i| (((i % 17) as f32 - 8.0) / 8.0).to_le_bytes()).collect();
        let x = self.storage("x", &xb);
        let o = self.output(n * rows);
        let run = |reps: usize| {
            let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
            for _ in 0..reps {
                self.encode_products(&mut enc, &r, kind_of(kind), &x, &o, n);
            }
            let t = Instant::now();
            self.finish(enc, &o, 1);
            t.elapsed().as_secs_f64()
        };
        run(1);
        let product = run(reps) / reps as f64;
        let threads = 65_535usize.min(r.bytes.div_ceil(1024) as usize).max(1);
        let partial = self.output(threads * 256);
        let read = |reps: usize| {
            let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
            let p = self.uniform(Params { rows: 0, cols: 0, n: 0, kind: 0, row0: 0, out_rows: 0, pad: [0; 2] });
            let groups: Vec<wgpu::BindGroup> =
                r.chunks.iter().map(|c| self.bind(&c.w, &c.scales, &x, &partial, &p)).collect();
            {
                let mut pass = enc
                    .begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("read"), timestamp_writes: None });
                pass.set_pipeline(&self.read_all);
                for _ in 0..reps {
                    for bg in &groups {
                        pass.set_bind_group(0, bg, &[]);
                        pass.dispatch_workgroups(threads as u32, 1, 1);
                    }
                }
            }
            let t = Instant::now();
            self.finish(enc, &partial, 1);
            t.elapsed().as_secs_f64()
        };
        read(1);
        (product, read(reps) / reps as f64)
    }
}

fn kind_of(k: super::BenchKind) -> Kind {
    match k {
        super::BenchKind::Bf16 => Kind::Bf16,
        super::BenchKind::Mxfp4 => Kind::Mxfp4,
    }
}
