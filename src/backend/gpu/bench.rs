//! Timing of the product kernels for `bench kernels --backend gpu`: a product with its weights
//! resident, and a plain read of the same bytes for comparison; the adapter's f32 FMA peak.
//!
//! Contract: both are timed as `reps` dispatches in one submission, ended by a one-float readback,
//! after one untimed warm-up submission. The plain read (`read_all` in `kernels/matvec.wgsl`) loads
//! the weight and scale buffers with the matvec kernel's access width (one vec4<u32> per thread
//! per load, four loads in flight), consecutive threads on consecutive 16 bytes, about 16 of them
//! per thread, and writes one partial per thread (under 2% of the bytes read).

use super::BenchKind;
use super::device::{Gpu, Kind, MATVEC_ROWS, MAX_GROUPS, Params, ROWS_PER_GROUP, XR};
use super::kernels::PRODUCTS;
use crate::backend::{Bf16Mat, Mxfp4Mat};
use std::time::Instant;

/// The parameter binding of a variant kernel that is not standalone, and matmul.wgsl's scale
/// lookup on it (the variants were written when both were in products.wgsl).
const VARIANT_PARAMS: &str = "@group(0) @binding(4) var<uniform> p: Params;
fn scale_at(idx: u32) -> f32 {
    let i = p.s_off * 4u + idx;
    return e8m0((scales[i >> 2u] >> ((i & 3u) * 8u)) & 0xffu);
}";

/// 32-bit words each thread of the plain read covers (the grid is sized from it).
const WORDS_PER_THREAD: u64 = 64;

/// One candidate matvec kernel measured by [`Gpu::time_matvec_variants`].
pub struct VariantTiming {
    pub name: String,
    /// Seconds per dispatch (None: it did not compile or run; `error` says why).
    pub secs: Option<f64>,
    /// Seconds per plain read of the same bytes, the mean of one timed just before and one just
    /// after the variant (the read drifts by several percent within a run).
    pub read_secs: f64,
    /// Whether every output has the same bits as the shipped `matvec` kernel's.
    pub bits_equal: bool,
    pub error: Option<String>,
}

impl VariantTiming {
    fn failed(name: String, error: String) -> Self {
        VariantTiming { name, secs: None, read_secs: 0.0, bits_equal: false, error: Some(error) }
    }
}

/// A compiled variant kernel.
struct Variant {
    name: String,
    src: String,
    pipe: wgpu::ComputePipeline,
}

impl Variant {
    /// The number in the variant's header line `// KEY: N` (None: no such line; an error: not a
    /// positive number).
    fn header(&self, key: &str) -> Result<Option<usize>, String> {
        let prefix = format!("// {key}:");
        let Some(v) = self.src.lines().find_map(|l| l.trim().strip_prefix(prefix.as_str())) else {
            return Ok(None);
        };
        match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(Some(n)),
            _ => Err(format!("`// {key}:{v}` is not a positive number")),
        }
    }
}

/// What a variant harness times its kernels on.
struct VariantBench {
    files: Vec<std::path::PathBuf>,
    r: super::device::Resident,
    x: wgpu::Buffer,
    o: wgpu::Buffer,
}

/// Whether two outputs have the same length and the same bits everywhere.
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The `*.wgsl` files of `dir`, sorted (an unreadable directory: one failed timing naming it).
fn variant_files(dir: &std::path::Path) -> Result<Vec<std::path::PathBuf>, VariantTiming> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| VariantTiming::failed(dir.display().to_string(), e.to_string()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "wgsl"))
        .collect();
    files.sort();
    Ok(files)
}

/// The bench matrices' pseudo-random bytes (a fixed LCG, so every run times the same matrix).
fn bench_bytes() -> impl FnMut() -> u8 {
    let mut seed = 7u64;
    move || {
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        (seed >> 33) as u8
    }
}

/// The packed bytes and scales of a random MXFP4 matrix with normal scales.
fn bench_mxfp4(rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>) {
    let mut byte = bench_bytes();
    let packed: Vec<u8> = (0..rows * cols / 2).map(|_| byte()).collect();
    let scales: Vec<u8> = (0..rows * cols / 32).map(|i| 115 + (i % 13) as u8).collect();
    (packed, scales)
}

impl Gpu {
    /// Times the shipped one-row MXFP4 kernel (as `shipped`) and each `*.wgsl` file of `dir` in
    /// its place on a `rows` x `cols` matrix, each between two plain reads of the same bytes, and
    /// says whether each one's outputs have the shipped kernel's bits. A variant's entry point is
    /// `matvec`; `products.wgsl` is prepended (the variant declares its weights at binding 0 and
    /// its input at binding 2, as the shipped kernels do) unless it has a line `// standalone`;
    /// `// rows_per_group: N` sets its dispatch (default 16); `// trusted` compiles it without
    /// wgpu's injected bounds clamps and loop counters. A development tool
    /// (`bench kernels --matvec-variants DIR`; `bench/data/gpu-variants/matvec/`).
    pub fn time_matvec_variants(
        &self,
        dir: &std::path::Path,
        rows: usize,
        cols: usize,
        reps: usize,
    ) -> Vec<VariantTiming> {
        let VariantBench { files, r, x, o } = match self.variant_setup(dir, rows, cols, 1) {
            Ok(v) => v,
            Err(e) => return vec![e],
        };
        let c = &r.chunks[0];
        let p = self.uniform_jobs(&[Params {
            rows: c.rows as u32,
            cols: cols as u32,
            n: 1,
            kind: Kind::Mxfp4 as u32,
            row0: 0,
            out_rows: rows as u32,
            stride: r.stride as u32,
            ..Default::default()
        }]);
        let bg = self.bind(&c.w, &c.scales, &x, &o, &p);
        // The 2-D fold past 65535 workgroups, as the shipped kernel is dispatched.
        let grid = |per_group: usize| {
            let groups = rows.div_ceil(per_group);
            let gx = groups.clamp(1, MAX_GROUPS);
            (gx as u32, groups.div_ceil(gx) as u32)
        };
        let reference = self.dispatch_grid(&self.matvec, &bg, &o, rows, grid(MATVEC_ROWS), None);
        let read = PlainRead::new(self, &r, Kind::Mxfp4, &x);
        read.secs(self, 1);
        // A checked run, then the kernel timed between two timed plain reads.
        let time = |name: String, pipe: &wgpu::ComputePipeline, per_group: usize| {
            let got = self.dispatch_grid(pipe, &bg, &o, rows, grid(per_group), None);
            let before = read.secs(self, reps);
            let mut secs = 0.0;
            self.dispatch_grid(pipe, &bg, &o, rows, grid(per_group), Some((reps, &mut secs)));
            let read_secs = (before + read.secs(self, reps)) / 2.0 / reps as f64;
            VariantTiming {
                name,
                secs: Some(secs / reps as f64),
                read_secs,
                bits_equal: same_bits(&got, &reference),
                error: None,
            }
        };
        let shipped = time("shipped".into(), &self.matvec, MATVEC_ROWS);
        // Variants read one `Params` as `p` (the shipped kernel's list of jobs holds it as job 0).
        let prelude = |src: &str| [PRODUCTS, VARIANT_PARAMS, src].join("\n");
        let variants = files.iter().map(|f| match self.variant(f, "matvec", &prelude) {
            Ok(v) => match v.header("rows_per_group") {
                Ok(per_group) => time(v.name, &v.pipe, per_group.unwrap_or(MATVEC_ROWS)),
                Err(e) => VariantTiming::failed(v.name, e),
            },
            Err(e) => e,
        });
        std::iter::once(shipped).chain(variants).collect()
    }

    /// Times the shipped MXFP4 matmul (as `shipped`) and each `*.wgsl` file of `dir` in its place
    /// on a `rows` x `cols` matrix times `n` input rows, and says whether each one's outputs have
    /// the shipped kernel's bits. A variant replaces `kernels/matmul.wgsl` (entry `matmul`, the
    /// same bindings and `Params`; `products.wgsl` is prepended unless `// standalone`);
    /// `// rows_per_group: N` and `// inputs_per_group: M` set its dispatch (default: the shipped
    /// kernel's),
    /// `// trusted` as for the matvec variants (`bench kernels --matmul-variants DIR`).
    pub fn time_matmul_variants(
        &self,
        dir: &std::path::Path,
        rows: usize,
        cols: usize,
        n: usize,
        reps: usize,
    ) -> Vec<VariantTiming> {
        let VariantBench { files, r, x, o } = match self.variant_setup(dir, rows, cols, n) {
            Ok(v) => v,
            Err(e) => return vec![e],
        };
        let c = &r.chunks[0];
        let p = self.uniform(Params {
            rows: c.rows as u32,
            cols: cols as u32,
            n: n as u32,
            kind: Kind::Mxfp4 as u32,
            out_rows: rows as u32,
            stride: r.stride as u32,
            count: 1,
            ..Default::default()
        });
        let bg = self.bind(&c.w, &c.scales, &x, &o, &p);
        let outputs = n * rows;
        let grid = |(per_group, inputs): (usize, usize)| (rows.div_ceil(per_group) as u32, n.div_ceil(inputs) as u32);
        let shipped_shape = (ROWS_PER_GROUP, XR);
        let reference = self.dispatch_grid(&self.matmul, &bg, &o, outputs, grid(shipped_shape), None);
        // A checked run (which also warms up), then the timed one.
        let time = |name: String, pipe: &wgpu::ComputePipeline, shape: (usize, usize)| {
            let got = self.dispatch_grid(pipe, &bg, &o, outputs, grid(shape), None);
            let mut secs = 0.0;
            self.dispatch_grid(pipe, &bg, &o, outputs, grid(shape), Some((reps, &mut secs)));
            VariantTiming {
                name,
                secs: Some(secs / reps as f64),
                read_secs: 0.0,
                bits_equal: same_bits(&got, &reference),
                error: None,
            }
        };
        let shipped = time("shipped".into(), &self.matmul, shipped_shape);
        let prelude = |src: &str| [PRODUCTS, src].join("\n");
        let variants = files.iter().map(|f| match self.variant(f, "matmul", &prelude) {
            Ok(v) => match (v.header("rows_per_group"), v.header("inputs_per_group")) {
                (Ok(per_group), Ok(inputs)) => {
                    let shape = (per_group.unwrap_or(ROWS_PER_GROUP), inputs.unwrap_or(XR));
                    let (gx, gy) = grid(shape);
                    if gx as usize > MAX_GROUPS || gy as usize > MAX_GROUPS {
                        let why = format!("its dispatch of {gx} x {gy} workgroups passes the limit of {MAX_GROUPS}");
                        return VariantTiming::failed(v.name, why);
                    }
                    time(v.name, &v.pipe, shape)
                }
                (Err(e), _) | (_, Err(e)) => VariantTiming::failed(v.name, e),
            },
            Err(e) => e,
        });
        std::iter::once(shipped).chain(variants).collect()
    }

    /// The variant files of `dir`, the bench's `rows` x `cols` MXFP4 matrix (resident), `n` input
    /// rows and an output for the products. A variant is one dispatch over one binding: a matrix
    /// the adapter splits over several would leave the other chunks' rows unwritten on both sides
    /// and compare nothing there.
    fn variant_setup(
        &self,
        dir: &std::path::Path,
        rows: usize,
        cols: usize,
        n: usize,
    ) -> Result<VariantBench, VariantTiming> {
        let files = variant_files(dir)?;
        let (packed, scales) = bench_mxfp4(rows, cols);
        let r = self.upload_mxfp4(&Mxfp4Mat::new(&packed, &scales, rows, cols), true);
        if r.chunks.len() > 1 {
            let why =
                format!("{rows} x {cols} is split over {} bindings on this adapter; take fewer rows", r.chunks.len());
            return Err(VariantTiming::failed("shipped".into(), why));
        }
        let xs: Vec<f32> = (0..n * cols).map(|i| ((i * 7 % 23) as f32 - 11.0) / 16.0).collect();
        let x = self.storage("x", &Gpu::input_bytes(&xs, cols, r.stride));
        let o = self.checked_output(n * rows);
        Ok(VariantBench { files, r, x, o })
    }

    /// An output buffer the variant harness can fill with NaN before a checked run, so that a
    /// variant that leaves outputs unwritten cannot pass for the shipped kernel.
    fn checked_output(&self, floats: usize) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("variant out"),
            size: (floats.max(1) * 4) as u64,
            usage: super::device::OUTPUT | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// One dispatch of `pipe` over `grid` workgroups into `out` (first filled with NaN: `out` needs
    /// COPY_DST, see `checked_output`), whose `outputs` floats it returns; or, with `timed` =
    /// (reps, seconds), `reps` dispatches in one submission ended by a one-float readback, whose
    /// wall time it adds to the seconds.
    fn dispatch_grid(
        &self,
        pipe: &wgpu::ComputePipeline,
        bg: &wgpu::BindGroup,
        out: &wgpu::Buffer,
        outputs: usize,
        grid: (u32, u32),
        timed: Option<(usize, &mut f64)>,
    ) -> Vec<f32> {
        if timed.is_none() {
            let nan = f32::NAN.to_le_bytes().repeat(outputs.max(1));
            self.queue.write_buffer(out, 0, &nan);
        }
        let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        {
            let mut pass =
                enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("variant"), timestamp_writes: None });
            pass.set_pipeline(pipe);
            pass.set_bind_group(0, bg, &[]);
            for _ in 0..timed.as_ref().map_or(1, |t| t.0) {
                pass.dispatch_workgroups(grid.0, grid.1, 1);
            }
        }
        match timed {
            // A failed readback gives no outputs: the variant's check then fails.
            None => self.finish(enc, out, outputs).unwrap_or_default(),
            Some((_, secs)) => {
                let t = Instant::now();
                if let Err(e) = self.finish(enc, out, 1) {
                    tracing::warn!("variant timing: {e}");
                }
                *secs += t.elapsed().as_secs_f64();
                Vec::new()
            }
        }
    }

    /// Compiles the variant kernel in `path` at `entry`, with `prelude` around its text unless it
    /// says `// standalone`, and without wgpu's injected checks if it says `// trusted`.
    fn variant(
        &self,
        path: &std::path::Path,
        entry: &str,
        prelude: &dyn Fn(&str) -> String,
    ) -> Result<Variant, VariantTiming> {
        let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        let fail = |e: String| VariantTiming::failed(name.clone(), e);
        if name == "shipped" {
            let why = "the name `shipped` is the reference's; rename the file".to_string();
            return Err(VariantTiming::failed("shipped_file".into(), why));
        }
        let src = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
        let trusted = src.lines().any(|l| l.trim() == "// trusted");
        let standalone = src.lines().any(|l| l.trim() == "// standalone");
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let source = if standalone { src.clone() } else { prelude(&src) };
        let desc = wgpu::ShaderModuleDescriptor { label: Some(&name), source: wgpu::ShaderSource::Wgsl(source.into()) };
        let module = if trusted {
            // SAFETY: a development kernel run on the bench's own matrix; on Vulkan the driver's
            // robust buffer access still bounds its buffer accesses, and its output is checked
            // against the shipped kernel's bits.
            unsafe { self.device.create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked()) }
        } else {
            self.device.create_shader_module(desc)
        };
        let pipe = self.pipeline_of(&module, entry);
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(fail(e.to_string()));
        }
        Ok(Variant { name, src, pipe })
    }

    /// The adapter's f32 fused-multiply-adds per second (`fma_peak` in `kernels/matmul.wgsl`: 32
    /// independent chains per thread, no memory traffic to speak of). The grid grows fourfold
    /// from 64 workgroups until one dispatch takes 5 ms (or reaches the dispatch limit), so that
    /// a GPU is full and a CPU adapter is not kept for seconds; then `reps` dispatches (at most
    /// 10) are timed in one submission.
    pub fn fma_peak(&self, reps: usize) -> f64 {
        const STEPS: f64 = 1024.0;
        const PER_THREAD_STEP: f64 = 32.0;
        let pipe = self.pipeline_of(&self.matmul_module, "fma_peak");
        // m just under 1 and a small c: every chain converges to c / (1 - m), no denormals.
        let mut consts = vec![0.999f32, 0.998, 0.997, 0.996, 0.001, 0.002, 0.003, 0.004];
        consts.resize(16, 0.0);
        let x = self.storage("peak consts", &consts.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>());
        let p = self.uniform(Params::default());
        let time = |groups: usize, reps: usize| {
            let o = self.output(groups * 256);
            let bg = self.bind(&self.empty, &self.empty, &x, &o, &p);
            let mut secs = 0.0;
            self.dispatch_grid(&pipe, &bg, &o, 1, (groups as u32, 1), Some((reps, &mut secs)));
            secs
        };
        time(64, 1);
        let mut groups = 64;
        while groups < MAX_GROUPS && time(groups, 1) < 0.005 {
            groups = (groups * 4).min(MAX_GROUPS);
        }
        let reps = reps.clamp(1, 10);
        let secs = time(groups, reps);
        (groups * 256) as f64 * STEPS * PER_THREAD_STEP * reps as f64 / secs
    }

    /// Seconds per product dispatch (weights resident, `n` input rows) and per
    /// plain read of the same weight bytes, each averaged over `reps` dispatches.
    pub fn time_product(&self, kind: BenchKind, rows: usize, cols: usize, n: usize, reps: usize) -> (f64, f64) {
        let mut byte = bench_bytes();
        let (r, k) = match kind {
            BenchKind::Bf16 => {
                // Normal values of moderate size (random bits would include NaNs and denormals).
                let b: Vec<u8> = (0..rows * cols).flat_map(|_| [byte(), (byte() & 0x80) | 0x3d]).collect();
                (self.upload_bf16(&Bf16Mat::from_vec(b, rows, cols)), Kind::Bf16)
            }
            BenchKind::Mxfp4 => {
                let packed: Vec<u8> = (0..rows * cols / 2).map(|_| byte()).collect();
                let scales = vec![121u8; rows * cols / 32];
                (self.upload_mxfp4(&Mxfp4Mat::new(&packed, &scales, rows, cols), true), Kind::Mxfp4)
            }
        };
        let xs: Vec<f32> = (0..n * cols).map(|i| ((i % 17) as f32 - 8.0) / 8.0).collect();
        let x = self.storage("x", &Gpu::input_bytes(&xs, cols, r.stride));
        let o = self.output(n * rows);
        let run = |reps: usize| {
            let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
            {
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("product"),
                    timestamp_writes: None,
                });
                for _ in 0..reps {
                    self.encode_products(&mut pass, &r, k, &x, 0, &o, 0, n);
                }
            }
            let t = Instant::now();
            if let Err(e) = self.finish(enc, &o, 1) {
                tracing::warn!("product timing: {e}");
            }
            t.elapsed().as_secs_f64()
        };
        run(1);
        let product = run(reps) / reps as f64;
        let read = PlainRead::new(self, &r, k, &x);
        read.secs(self, 1);
        (product, read.secs(self, reps) / reps as f64)
    }
}

/// The plain read of a resident matrix's bytes: each buffer (an MXFP4 chunk's weights and its
/// scales) read by its own dispatch of `read_all`, sized for its words.
struct PlainRead {
    groups: Vec<(wgpu::BindGroup, u32)>,
    sink: wgpu::Buffer,
}

impl PlainRead {
    fn new(gpu: &Gpu, r: &super::device::Resident, k: Kind, x: &wgpu::Buffer) -> Self {
        let bufs: Vec<&wgpu::Buffer> =
            r.chunks.iter().flat_map(|c| if k == Kind::Mxfp4 { vec![&c.w, &c.scales] } else { vec![&c.w] }).collect();
        let groups = bufs
            .into_iter()
            .map(|b| {
                let words = b.size() / 4;
                let wgs = words.div_ceil(256 * WORDS_PER_THREAD).clamp(1, 65_535) as u32;
                let partial = gpu.output(wgs as usize * 256);
                // `read_all` is in the matvec module, whose parameter binding is its job list.
                let p = gpu.uniform_jobs(&[Params::default()]);
                (gpu.bind(b, b, x, &partial, &p), wgs)
            })
            .collect();
        PlainRead { groups, sink: gpu.output(1) }
    }

    /// Seconds for `reps` reads in one submission (ended by a one-float readback).
    fn secs(&self, gpu: &Gpu, reps: usize) -> f64 {
        let mut enc = gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        {
            let mut pass =
                enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("read"), timestamp_writes: None });
            pass.set_pipeline(&gpu.read_all);
            for _ in 0..reps {
                for (bg, wgs) in &self.groups {
                    pass.set_bind_group(0, bg, &[]);
                    pass.dispatch_workgroups(*wgs, 1, 1);
                }
            }
        }
        let t = Instant::now();
        if let Err(e) = gpu.finish(enc, &self.sink, 1) {
            tracing::warn!("read timing: {e}");
        }
        t.elapsed().as_secs_f64()
    }
}
