//! The wgpu device, the product kernels' pipelines, pooled buffers, resident matrices and the
//! encoding, dispatch and readback of products. [`Gpu::matmul`] is one submission that ends with its result
//! read back; the batched expert path (`experts.rs`) encodes many products into one submission.
//!
//! Layout contract shared with the kernels: bf16 rows are stored padded with zeros to a multiple
//! of 16 elements (`Resident::stride`); a matrix may sit at a word offset inside a larger buffer
//! (`Chunk::w_off`, `s_off`); the one-input-row kernel (`matvec.wgsl`) reads its input as
//! `vec4<f32>` from a float offset that is a multiple of 4, zero past `cols` up to the stride.

use crate::backend::{Bf16Mat, Mxfp4Mat};
use wgpu::util::DeviceExt;

use super::kernels::Kernel;

/// A kernel's shader module.
pub(super) fn shader(device: &wgpu::Device, kernel: Kernel) -> wgpu::ShaderModule {
    device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some(kernel.label()),
        source: wgpu::ShaderSource::Wgsl(kernel.source().into()),
    })
}

/// A product kernel's module, without the bounds clamps and loop counters wgpu would inject
/// (measured on the H200: the MXFP4 matvec ran 5-7% faster without them).
fn product_shader(device: &wgpu::Device, kernel: Kernel) -> wgpu::ShaderModule {
    let desc = wgpu::ShaderModuleDescriptor {
        label: Some(kernel.label()),
        source: wgpu::ShaderSource::Wgsl(kernel.source().into()),
    };
    // SAFETY: the product kernels index only within their bindings and workgroup arrays: every
    // buffer index is bounded by the shapes and offsets the host sets from the matrices it bound
    // (tests/gpu.rs covers every tail, the 2-D dispatch fold and matrices inside larger buffers),
    // workgroup indices are bounded by the fixed workgroup size, and every loop's trip count is
    // set by the parameters. Where the driver bounds buffer accesses itself (Vulkan's robust
    // buffer access, which wgpu enables), it still does.
    unsafe { device.create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked()) }
}

/// A bind group of whole buffers at bindings 0, 1, ... in order.
pub(super) fn bind_group(
    device: &wgpu::Device,
    layout: &wgpu::BindGroupLayout,
    bufs: &[&wgpu::Buffer],
) -> wgpu::BindGroup {
    let entries: Vec<wgpu::BindGroupEntry> = bufs
        .iter()
        .enumerate()
        .map(|(i, b)| wgpu::BindGroupEntry { binding: i as u32, resource: b.as_entire_binding() })
        .collect();
    device.create_bind_group(&wgpu::BindGroupDescriptor { label: None, layout, entries: &entries })
}

/// The bind group layout every kernel of a family shares — storage buffers at bindings 0.. (read
/// only where `read_only` says so), then one uniform — and its pipeline layout.
pub(super) struct ComputeLayout {
    pub bind: wgpu::BindGroupLayout,
    pipeline: wgpu::PipelineLayout,
}

impl ComputeLayout {
    pub fn new(device: &wgpu::Device, label: &str, read_only: &[bool]) -> Self {
        let buffer = |binding: usize, ty| wgpu::BindGroupLayoutEntry {
            binding: binding as u32,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer { ty, has_dynamic_offset: false, min_binding_size: None },
            count: None,
        };
        let mut entries: Vec<_> = read_only
            .iter()
            .enumerate()
            .map(|(i, &read_only)| buffer(i, wgpu::BufferBindingType::Storage { read_only }))
            .collect();
        entries.push(buffer(read_only.len(), wgpu::BufferBindingType::Uniform));
        let bind =
            device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor { label: Some(label), entries: &entries });
        let pipeline = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some(label),
            bind_group_layouts: &[Some(&bind)],
            immediate_size: 0,
        });
        ComputeLayout { bind, pipeline }
    }

    /// The compute pipeline of `entry` in `module` on this layout.
    pub fn pipeline(&self, device: &wgpu::Device, module: &wgpu::ShaderModule, entry: &str) -> wgpu::ComputePipeline {
        device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(entry),
            layout: Some(&self.pipeline),
            module,
            entry_point: Some(entry),
            compilation_options: Default::default(),
            cache: None,
        })
    }
}

/// Weight rows and input rows per workgroup of `matmul` (64 `MM_ROWS` and `MM_XR` in the kernel).
pub(super) const ROWS_PER_GROUP: usize = 128;
pub(super) const XR: usize = 4;
/// Weight rows per workgroup of `matvec.wgsl`.
pub(super) const MATVEC_ROWS: usize = 16;
/// Products one matvec dispatch may run (`MAX_JOBS` in `matvec.wgsl`): its uniform block holds
/// that many `Params`.
pub(super) const MATVEC_JOBS: usize = 64;
/// Bytes of one `Params` in a uniform block.
const PARAMS_BYTES: usize = 48;
/// Workgroups per dispatch dimension (WebGPU's guaranteed limit).
pub(super) const MAX_GROUPS: usize = 65_535;
/// Input rows one product dispatch takes (65535 workgroups of `XR` rows).
const PRODUCT_ROWS: usize = 65_535 * XR;

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no GPU adapter found (wgpu saw: {seen}); use --backend cpu")]
    NoAdapter { seen: String },
    #[error("the GPU adapter {adapter} cannot run deltafin's kernels: {why}; use --backend cpu")]
    Limits { adapter: String, why: String },
    #[error("cannot open the GPU device {adapter}: {msg}")]
    Device { adapter: String, msg: String },
    #[error("the GPU probe failed: {0}")]
    Probe(String),
    #[error("GPU readback failed: {msg}")]
    Readback { msg: String },
    #[error("GPU error during a dispatch: {msg}")]
    Dispatch { msg: String },
    #[error(
        "--gpu-cache-gb: the adapter ran out of device memory after {got} of {wanted} expert slots ({msg}); give at most {fits_gb:.1} GB"
    )]
    DeviceCache { wanted: usize, got: usize, fits_gb: f64, msg: String },
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

/// One product of [`Gpu::encode_image_matvecs`]: its weights and scales at these words of the
/// image, its input at float `x_off`, its output at float `out_off`.
pub(super) struct MatvecJob {
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
    pub(super) chunks: Vec<Chunk>,
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

pub(super) struct Chunk {
    pub row0: usize,
    pub rows: usize,
    pub w: wgpu::Buffer,
    pub scales: wgpu::Buffer,
    /// Word offsets of this chunk's weights and scales in `w` and `scales`.
    pub w_off: u32,
    pub s_off: u32,
}

/// Buffers of one call kept for the next (creating device buffers per product costs more than
/// the product): by usage and power-of-two size.
#[derive(Default)]
struct Pool {
    free: std::sync::Mutex<std::collections::HashMap<(u32, u64), Vec<wgpu::Buffer>>>,
}

/// [`crate::backend::DeviceTraffic`] as it accumulates.
#[derive(Default)]
pub(super) struct Traffic {
    pub submissions: std::sync::atomic::AtomicU64,
    pub upload_bytes: std::sync::atomic::AtomicU64,
    pub readback_bytes: std::sync::atomic::AtomicU64,
    /// Device memory of the sequence state kept resident (`state.rs`: KDA states, MLA cache
    /// mirrors), now.
    pub resident_state_bytes: std::sync::atomic::AtomicU64,
    /// Nanoseconds blocked in [`map_words`] until the device had finished.
    pub wait_ns: std::sync::atomic::AtomicU64,
    /// Nanoseconds the device spent in timed compute passes ([`Stamp`], with
    /// `DELTAFIN_GPU_TIMESTAMPS`), from its own timestamps.
    pub device_ns: std::sync::atomic::AtomicU64,
    /// Nanoseconds [`map_words`] checks for a result before it blocks: [`SPIN_WAIT`] on a GPU,
    /// 0 on a CPU adapter (lavapipe), whose own threads need the cores.
    pub spin_ns: std::sync::atomic::AtomicU64,
    /// The first device error wgpu reported outside an error scope (a failed dispatch, upload or
    /// allocation) since the last readback took it: the next readback fails with it.
    pub uncaptured: std::sync::Mutex<Option<String>>,
}

impl Traffic {
    pub fn submitted(&self, readback: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        self.submissions.fetch_add(1, Relaxed);
        self.readback_bytes.fetch_add(readback, Relaxed);
    }

    pub fn uploaded(&self, bytes: u64) {
        self.upload_bytes.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// Records a device error reported outside an error scope (the first until one is taken).
    pub fn record_error(&self, e: wgpu::Error) {
        tracing::error!("GPU error: {e}");
        self.uncaptured.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert_with(|| e.to_string());
    }

    /// The device error recorded since the last check, as an error (taken: reported once).
    pub fn check(&self) -> Result<(), GpuError> {
        match self.uncaptured.lock().unwrap_or_else(|p| p.into_inner()).take() {
            Some(msg) => Err(GpuError::Dispatch { msg }),
            None => Ok(()),
        }
    }

    pub fn snapshot(&self) -> crate::backend::DeviceTraffic {
        use std::sync::atomic::Ordering::Relaxed;
        crate::backend::DeviceTraffic {
            submissions: self.submissions.load(Relaxed),
            upload_bytes: self.upload_bytes.load(Relaxed),
            readback_bytes: self.readback_bytes.load(Relaxed),
            resident_state_bytes: self.resident_state_bytes.load(Relaxed),
            wait_s: self.wait_ns.load(Relaxed) as f64 * 1e-9,
            device_s: self.device_ns.load(Relaxed) as f64 * 1e-9,
        }
    }
}

static NEXT_GPU_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

pub struct Gpu {
    /// Nanoseconds per timestamp tick when passes are timed ([`Stamp`]).
    timestamp_period: Option<f32>,
    pool: Pool,
    pub(super) traffic: std::sync::Arc<Traffic>,
    /// Tells this device's buffers from another's (each `Gpu` gets its own).
    pub(super) id: u64,
    pub(super) device: wgpu::Device,
    pub(super) queue: wgpu::Queue,
    products_layout: ComputeLayout,
    pub(super) matmul: wgpu::ComputePipeline,
    pub(super) matvec: wgpu::ComputePipeline,
    pub(super) read_all: wgpu::ComputePipeline,
    fma_probe: wgpu::ComputePipeline,
    /// The compiled `matmul.wgsl`, for the bench's pipelines of its other entry points.
    pub(super) matmul_module: wgpu::ShaderModule,
    pub(super) empty: wgpu::Buffer,
    pub summary: AdapterSummary,
}

#[derive(Clone, Copy, Default)]
pub(super) struct Params {
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

pub(super) const STAGED: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE.union(wgpu::BufferUsages::COPY_DST);
pub(super) const OUTPUT: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE.union(wgpu::BufferUsages::COPY_SRC);
pub(super) const READBACK: wgpu::BufferUsages = wgpu::BufferUsages::MAP_READ.union(wgpu::BufferUsages::COPY_DST);

fn rank(t: wgpu::DeviceType) -> u8 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    }
}

/// Bytes padded to whole vec4 words (storage bindings are arrays of u32 or vec4).
fn padded(b: &[u8]) -> Vec<u8> {
    let mut v = b.to_vec();
    v.resize(b.len().div_ceil(16).max(1) * 16, 0);
    v
}

/// How long a readback checks for its result before it blocks until the device is done.
const SPIN_WAIT: std::time::Duration = std::time::Duration::from_micros(500);

/// How long a readback waits for its mapping's callback once the device has finished the
/// submission (far longer than it ever takes; past it the readback fails).
const MAP_CALLBACK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Readbacks left before an injected failure (0: none armed); see [`fail_readback_in`].
static FAIL_COUNTDOWN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Test hook: the `n`th readback from now (of any GPU backend in the process; `n` >= 1) fails as
/// a failed mapping would, after its buffer was read and unmapped (so the device stays usable);
/// 0 disarms. `DELTAFIN_GPU_FAIL_READBACK=n` arms it when a backend opens (counting from then).
pub fn fail_readback_in(n: u64) {
    FAIL_COUNTDOWN.store(n, std::sync::atomic::Ordering::SeqCst);
}

/// Whether this readback is the one [`fail_readback_in`] armed (counting it down).
fn injected_failure() -> bool {
    use std::sync::atomic::Ordering::SeqCst;
    FAIL_COUNTDOWN.fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1)).is_ok_and(|n| n == 1)
}

/// The first `floats` words of the mappable buffer `read` once `submission` (None: the latest)
/// has run on `device`; `read` is unmapped again. Checks the device for up to `traffic.spin_ns`
/// before it blocks. A failed wait or mapping, or a device error recorded since the last readback
/// (a failed dispatch: [`Traffic::uncaptured`]), is an error; then `read` may still be mapped or
/// pending and must not be reused.
pub(super) fn map_words(
    device: &wgpu::Device,
    traffic: &Traffic,
    read: &wgpu::Buffer,
    floats: usize,
    submission: Option<wgpu::SubmissionIndex>,
) -> Result<Vec<u32>, GpuError> {
    use std::sync::atomic::Ordering;
    let waited = std::time::Instant::now();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let failed = std::sync::Arc::new(std::sync::Mutex::new(None::<String>));
    let (flag, fail) = (std::sync::Arc::clone(&done), std::sync::Arc::clone(&failed));
    read.map_async(wgpu::MapMode::Read, .., move |r| {
        if let Err(e) = r {
            *fail.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
        }
        flag.store(true, Ordering::Release);
    });
    // Decode waits on a round trip about thirty times a token, most of them shorter than a
    // blocking wait's wake-up: check for a while before blocking.
    let spin = std::time::Duration::from_nanos(traffic.spin_ns.load(Ordering::Relaxed));
    while !done.load(Ordering::Acquire) && waited.elapsed() < spin {
        if device.poll(wgpu::PollType::Poll).is_err() {
            // The blocking wait below reports it.
            break;
        }
    }
    let wait = if done.load(Ordering::Acquire) {
        Ok(())
    } else {
        device.poll(wgpu::PollType::Wait { submission_index: submission, timeout: None }).map(|_| ())
    };
    let readback = |msg: String| GpuError::Readback { msg };
    wait.map_err(|e| readback(format!("waiting for the device: {e}")))?;
    // The submission has run; the mapping's callback may still be on its way from another
    // thread's poll (the operations of parallel rows poll the same device).
    let mapped = std::time::Instant::now();
    while !done.load(Ordering::Acquire) {
        if mapped.elapsed() > MAP_CALLBACK_WAIT {
            return Err(readback(format!("the buffer was not mapped {MAP_CALLBACK_WAIT:?} after the device finished")));
        }
        device.poll(wgpu::PollType::Poll).map_err(|e| readback(format!("polling the device: {e}")))?;
        std::thread::yield_now();
    }
    let ns = waited.elapsed().as_nanos().min(u64::MAX as u128) as u64;
    traffic.wait_ns.fetch_add(ns, Ordering::Relaxed);
    if let Some(msg) = failed.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(readback(msg));
    }
    let v = match read.get_mapped_range(..) {
        Ok(view) => {
            view.chunks_exact(4).take(floats).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect::<Vec<_>>()
        }
        // Not mapped: nothing to unmap either (unmapping would be one more error).
        Err(e) => return Err(readback(e.to_string())),
    };
    read.unmap();
    traffic.check()?;
    if injected_failure() {
        return Err(readback("injected failure (DELTAFIN_GPU_FAIL_READBACK or gpu::fail_readback_in)".into()));
    }
    Ok(v)
}

/// Little-endian bytes of floats.
pub(super) fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|f| f.to_le_bytes()).collect()
}

/// Timestamps around one compute pass (profiling: `DELTAFIN_GPU_TIMESTAMPS=1` on an adapter
/// with timestamp queries): written at the pass's start and end, resolved and copied to `read`
/// in the same submission, read once it has run.
pub(super) struct Stamp {
    set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    read: wgpu::Buffer,
}

impl Stamp {
    /// The pass descriptor's timestamp writes for this stamp (None: not timing).
    pub fn writes(s: &Option<Stamp>) -> Option<wgpu::ComputePassTimestampWrites<'_>> {
        s.as_ref().map(|s| wgpu::ComputePassTimestampWrites {
            query_set: &s.set,
            beginning_of_pass_write_index: Some(0),
            end_of_pass_write_index: Some(1),
        })
    }
}

/// `DELTAFIN_GPU_FAIL_READBACK=n` (n >= 1): the readback to fail, counted from a backend's open
/// ([`fail_readback_in`]); another value says so in a warning and arms nothing.
pub(super) fn fail_readback_wanted() -> Option<u64> {
    let v = std::env::var("DELTAFIN_GPU_FAIL_READBACK").ok()?;
    match v.trim().parse::<u64>() {
        Ok(n) if n > 0 => Some(n),
        _ => {
            tracing::warn!(
                "DELTAFIN_GPU_FAIL_READBACK={v:?} is not a readback number (1, 2, ...); nothing is injected"
            );
            None
        }
    }
}

static TIMESTAMPS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Times the passes of GPU backends opened after the call, as `DELTAFIN_GPU_TIMESTAMPS=1` does.
pub fn set_timestamps(on: bool) {
    TIMESTAMPS.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether passes should be timed on the device: `DELTAFIN_GPU_TIMESTAMPS` 1 / true / yes / on,
/// or [`set_timestamps`] (possible when the adapter has timestamp queries). Another value says so
/// in a warning and times nothing.
fn timestamps_wanted() -> bool {
    if TIMESTAMPS.load(std::sync::atomic::Ordering::Relaxed) {
        return true;
    }
    let Ok(v) = std::env::var("DELTAFIN_GPU_TIMESTAMPS") else { return false };
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => true,
        "" | "0" | "false" | "no" | "off" => false,
        _ => {
            tracing::warn!("DELTAFIN_GPU_TIMESTAMPS={v:?} is not 1 or 0; passes are not timed");
            false
        }
    }
}

impl Gpu {
    /// Whether compute passes are timed on the device ([`Stamp`]).
    pub(super) fn timed(&self) -> bool {
        self.timestamp_period.is_some()
    }

    /// A stamp for the next pass, or None when passes are not timed.
    pub(super) fn stamp(&self) -> Option<Stamp> {
        self.timestamp_period?;
        let set = self.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("pass time"),
            ty: wgpu::QueryType::Timestamp,
            count: 2,
        });
        let resolve = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("pass time resolve"),
            size: 16,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let read = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("pass time read"),
            size: 16,
            usage: READBACK,
            mapped_at_creation: false,
        });
        Some(Stamp { set, resolve, read })
    }

    /// Encodes the copy of `s`'s timestamps after its pass (before the submission).
    pub(super) fn stamp_resolve(&self, enc: &mut wgpu::CommandEncoder, s: &Option<Stamp>) {
        if let Some(s) = s {
            enc.resolve_query_set(&s.set, 0..2, &s.resolve, 0);
            enc.copy_buffer_to_buffer(&s.resolve, 0, &s.read, 0, 16);
        }
    }

    /// Adds the time between `s`'s timestamps to the device time, once `submission` (None: the
    /// latest), which carried them, has run.
    pub(super) fn stamp_read(&self, s: Option<Stamp>, submission: Option<wgpu::SubmissionIndex>) {
        let (Some(s), Some(period)) = (s, self.timestamp_period) else { return };
        s.read.map_async(wgpu::MapMode::Read, .., |_| {});
        if self.device.poll(wgpu::PollType::Wait { submission_index: submission, timeout: None }).is_err() {
            return;
        }
        let ticks = match s.read.get_mapped_range(..) {
            Ok(view) => {
                let tick = |i: usize| {
                    let mut b = [0u8; 8];
                    b.copy_from_slice(&view[i * 8..i * 8 + 8]);
                    u64::from_le_bytes(b)
                };
                tick(1).saturating_sub(tick(0))
            }
            // Not mapped (the map failed): no time, and nothing to unmap.
            Err(_) => return,
        };
        s.read.unmap();
        let ns = (ticks as f64 * period as f64) as u64;
        self.traffic.device_ns.fetch_add(ns, std::sync::atomic::Ordering::Relaxed);
    }

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
        if adapters.is_empty() {
            return Err(GpuError::NoAdapter { seen: if seen.is_empty() { "none".into() } else { seen } });
        }
        // The best-ranked adapter whose limits fit the kernels; if none does, the best one's reason.
        let fit = adapters.iter().position(|a| super::kernels::limit_shortfall(&a.limits()).is_none());
        let Some(adapter) = fit.map(|i| adapters.swap_remove(i)) else {
            let best = &adapters[0];
            let why = super::kernels::limit_shortfall(&best.limits()).unwrap_or_default();
            return Err(GpuError::Limits { adapter: best.get_info().name, why });
        };
        let info = adapter.get_info();
        let limits = adapter.limits();
        let wanted = timestamps_wanted();
        let timed = wanted && adapter.features().contains(wgpu::Features::TIMESTAMP_QUERY);
        if wanted && !timed {
            tracing::warn!("DELTAFIN_GPU_TIMESTAMPS: {} has no timestamp queries; passes are not timed", info.name);
        }
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("deltafin"),
            required_features: if timed { wgpu::Features::TIMESTAMP_QUERY } else { wgpu::Features::empty() },
            required_limits: limits.clone(),
            ..Default::default()
        }))
        .map_err(|e| GpuError::Device { adapter: info.name.clone(), msg: e.to_string() })?;
        let module = product_shader(&device, Kernel::Matmul);
        let mv_module = product_shader(&device, Kernel::Matvec);
        // w, scales, x (read), out (written), then the uniform parameters.
        let layout = ComputeLayout::new(&device, "matmul", &[true, true, true, false]);
        let pipeline = |module: &wgpu::ShaderModule, entry: &str| layout.pipeline(&device, module, entry);
        let matmul = pipeline(&module, "matmul");
        let (matvec, read_all) = (pipeline(&mv_module, "matvec"), pipeline(&mv_module, "read_all"));
        let fma_probe = pipeline(&module, "fma_probe");
        let empty = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("empty"),
            contents: &[0u8; 64],
            usage: wgpu::BufferUsages::STORAGE,
        });
        let summary = AdapterSummary {
            name: info.name.clone(),
            device_type: info.device_type,
            backend: format!("{:?}", info.backend).to_lowercase(),
            driver: format!("{} {}", info.driver, info.driver_info).trim().to_string(),
            max_binding: limits.max_storage_buffer_binding_size.min(limits.max_buffer_size),
        };
        let timestamp_period = timed.then(|| queue.get_timestamp_period());
        let traffic = std::sync::Arc::new(Traffic::default());
        if info.device_type != wgpu::DeviceType::Cpu {
            traffic.spin_ns.store(SPIN_WAIT.as_nanos() as u64, std::sync::atomic::Ordering::Relaxed);
        }
        // Errors outside an error scope (a failed dispatch or upload) fail the next readback
        // instead of wgpu's default, a panic.
        let sink = std::sync::Arc::clone(&traffic);
        device.on_uncaptured_error(std::sync::Arc::new(move |e| sink.record_error(e)));
        Ok(Gpu {
            timestamp_period,
            pool: Pool::default(),
            traffic,
            id: NEXT_GPU_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            device,
            queue,
            products_layout: layout,
            matmul,
            matvec,
            read_all,
            fma_probe,
            matmul_module: module,
            empty,
            summary,
        })
    }

    /// A pooled buffer of at least `size` bytes with `usage`.
    pub(super) fn take(&self, usage: wgpu::BufferUsages, size: u64) -> wgpu::Buffer {
        // Powers of two up to 16 MiB; larger (an expert's image) in whole MiB, so that a pool of
        // expert-sized buffers does not waste up to half of its device memory.
        let pow2 = size.max(256).next_power_of_two();
        let size = if pow2 <= 16 << 20 && pow2 <= self.summary.max_binding {
            pow2
        } else if size.div_ceil(1 << 20) << 20 <= self.summary.max_binding {
            size.div_ceil(1 << 20) << 20
        } else {
            size.div_ceil(16) * 16
        };
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
            // One batch's worth (two outputs per expert of a group, the chunks of a large matrix).
            if v.len() < 64 {
                v.push(b);
            }
        }
    }

    /// `bytes` in a pooled storage buffer (uploaded through the queue).
    pub(super) fn staged(&self, bytes: &[u8]) -> wgpu::Buffer {
        let b = self.take(STAGED, bytes.len() as u64);
        self.traffic.uploaded(bytes.len() as u64);
        self.queue.write_buffer(&b, 0, &padded(bytes));
        b
    }

    pub(super) fn storage(&self, label: &str, bytes: &[u8]) -> wgpu::Buffer {
        self.traffic.uploaded(bytes.len() as u64);
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
                    dst[..cols * 2].copy_from_slice(w.row(r));
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

    /// The pipeline of `entry` in `module` on the product kernels' layout.
    pub(super) fn pipeline_of(&self, module: &wgpu::ShaderModule, entry: &str) -> wgpu::ComputePipeline {
        self.products_layout.pipeline(&self.device, module, entry)
    }

    pub(super) fn bind(
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
    pub(super) fn uniform(&self, p: Params) -> wgpu::Buffer {
        self.uniform_bytes(&p.bytes())
    }

    /// The uniform block of a `matvec.wgsl` dispatch of `jobs` (at most [`MATVEC_JOBS`]), sized
    /// for all [`MATVEC_JOBS`] that the kernel declares; job 0 carries the count.
    pub(super) fn uniform_jobs(&self, jobs: &[Params]) -> wgpu::Buffer {
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
    pub(super) fn finish(
        &self,
        encoder: wgpu::CommandEncoder,
        out: &wgpu::Buffer,
        floats: usize,
    ) -> Result<Vec<f32>, GpuError> {
        let size = (floats.max(1) * 4) as u64;
        Ok(self.finish_many(encoder, &[(out, size)])?.into_iter().take(floats).collect())
    }

    /// Submits `encoder` after copying each (buffer, bytes) in turn into one mapped buffer (one
    /// readback for many products); returns the floats of all of them, in order.
    pub(super) fn finish_many(
        &self,
        mut encoder: wgpu::CommandEncoder,
        outs: &[(&wgpu::Buffer, u64)],
    ) -> Result<Vec<f32>, GpuError> {
        let total: u64 = outs.iter().map(|(_, n)| n).sum::<u64>().max(4);
        let floats = (total / 4) as usize;
        let read = self.take(READBACK, total);
        let mut at = 0;
        for (b, n) in outs {
            encoder.copy_buffer_to_buffer(b, 0, &read, at, *n);
            at += n;
        }
        self.traffic.submitted(total);
        self.queue.submit([encoder.finish()]);
        Ok(self.read_back(read, floats, None)?.into_iter().map(f32::from_bits).collect())
    }

    /// Submits `encoder` after copying each (buffer, words) to a mapped buffer; returns their
    /// 32-bit words.
    pub(super) fn finish_words(
        &self,
        mut encoder: wgpu::CommandEncoder,
        outs: &[(&wgpu::Buffer, usize)],
    ) -> Result<Vec<Vec<u32>>, GpuError> {
        let reads: Vec<(wgpu::Buffer, usize)> = outs
            .iter()
            .map(|&(out, words)| {
                let size = (words.max(1) * 4) as u64;
                let read = self.take(READBACK, size);
                encoder.copy_buffer_to_buffer(out, 0, &read, 0, size);
                (read, words)
            })
            .collect();
        self.traffic.submitted(reads.iter().map(|(_, w)| (w.max(&1) * 4) as u64).sum());
        self.queue.submit([encoder.finish()]);
        // Every buffer is read (and given back) even after one failed, then the first error wins.
        let got: Vec<Result<Vec<u32>, GpuError>> =
            reads.into_iter().map(|(read, words)| self.read_back(read, words, None)).collect();
        got.into_iter().collect()
    }

    /// The first `floats` words of `read` once `submission` (None: the latest) has run; gives
    /// `read` back to the pool (on an error it is dropped instead: it may still be mapped).
    pub(super) fn read_back(
        &self,
        read: wgpu::Buffer,
        floats: usize,
        submission: Option<wgpu::SubmissionIndex>,
    ) -> Result<Vec<u32>, GpuError> {
        let v = map_words(&self.device, &self.traffic, &read, floats, submission)?;
        self.give(READBACK, read);
        Ok(v)
    }

    /// Encodes `out[out_off + i * rows + r] = W[r] . x[x_off + i * cols ..]` for the `n` input
    /// rows (`n == 1`: the matvec kernel, whose input is padded to the stride; else the matmul).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn encode_products(
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
    pub(super) fn encode_image_matvecs(
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
    pub(super) fn input_bytes(xs: &[f32], cols: usize, stride: usize) -> Vec<u8> {
        if xs.len() == cols && stride > cols {
            let mut v = xs.to_vec();
            v.resize(stride, 0.0);
            return f32_bytes(&v);
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
                out[b0 * r.rows..(b0 + nb) * r.rows].copy_from_slice(&all[at..at + k]);
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
            outs[i][..k].copy_from_slice(&all[at..at + k]);
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
        assert!(super::super::kernels::MATVEC.contains(&decl), "kernels/matvec.wgsl must declare `{decl}`");
        assert_eq!(Params::default().bytes().len(), PARAMS_BYTES);
    }
}
