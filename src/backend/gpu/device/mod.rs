//! The wgpu device: opening it (the adapter chosen, its limits checked, the product pipelines
//! compiled), its pooled buffers, its traffic counters and the device errors reported outside an
//! error scope. [`Gpu::matmul`] is one submission that ends with its result read back; the batched
//! expert path (`experts.rs`) encodes many products into one submission.
//!
//! Contract: a device error never panics and is never lost: wgpu's uncaptured errors are recorded
//! ([`Traffic::record_error`]) and fail the next readback. Buffers are pooled by usage and size;
//! a buffer is given back only when nothing may still be using it.
//!
//! Beside it: `products.rs` (resident matrices and the product kernels, with the layout contract
//! shared with the kernels), `readback.rs` (waiting and mapping; the injected-failure hook),
//! `timing.rs` (device timestamps) and `pipeline.rs` (shader modules, bind groups, layouts).

use super::kernels::Kernel;
use crate::setting::Setting;
use wgpu::util::DeviceExt;

mod pipeline;
mod products;
mod readback;
mod staging;
mod timing;
mod uma;

use pipeline::product_shader;
pub(super) use pipeline::{ComputeLayout, bind_group, shader};
pub(super) use products::{Chunk, MatvecJob, f32_bytes};
pub use products::{Kind, Resident};
use readback::SPIN_WAIT;
pub use readback::fail_readback_in;
pub(super) use readback::{fail_readback_wanted, map_read, map_words};
pub(super) use staging::{UMA_ARENA, floats_of, par_copy, write_mapped};
pub(super) use timing::Stamp;
pub use uma::{UMA_ENV, UmaMode};

// The kernel microbench's view of the product kernels' layout.
#[cfg(feature = "gpu-bench")]
pub(super) use products::{MATVEC_ROWS, MAX_GROUPS, Params, ROWS_PER_GROUP, XR};
pub use timing::set_timestamps;
use timing::timestamps_wanted;

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no GPU adapter found (wgpu saw: {seen}); use {} cpu", Setting::Backend)]
    NoAdapter { seen: String },
    #[error("the GPU adapter {adapter} cannot run deltafin's kernels: {why}; use {} cpu", Setting::Backend)]
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
        "{}: the adapter ran out of device memory after {got} of {wanted} expert slots ({msg}); give at most {fits_gb:.1} GB",
        Setting::GpuCacheGb
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
    /// Routed experts are written once, straight into device-visible memory the kernels read
    /// (unified memory, `uma.rs`), instead of staged and copied on the device.
    pub experts_in_place: bool,
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
    /// Routed-expert bytes that reached device memory through a staging buffer and a copy on the
    /// device, and those written once straight into device-visible memory (unified memory).
    pub expert_staged_bytes: std::sync::atomic::AtomicU64,
    pub expert_in_place_bytes: std::sync::atomic::AtomicU64,
    /// Nanoseconds the host spent inside `queue.submit` for the expert groups (what a submission
    /// costs the host, growing with what it references; `bench kernels --residency`).
    pub expert_submit_ns: std::sync::atomic::AtomicU64,
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

    /// `bytes` of a routed expert uploaded: written in place (`in_place`) or staged.
    pub fn expert_uploaded(&self, bytes: u64, in_place: bool) {
        self.uploaded(bytes);
        let c = if in_place { &self.expert_in_place_bytes } else { &self.expert_staged_bytes };
        c.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// Records a device error reported outside an error scope (the first until one is taken).
    pub fn record_error(&self, e: wgpu::Error) {
        self.record_failure(e.to_string());
    }

    /// A failure outside a readback (a mapping for an upload): the next readback fails with it.
    pub fn record_failure(&self, msg: String) {
        tracing::error!("GPU error: {msg}");
        self.uncaptured.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(msg);
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
            expert_staged_bytes: self.expert_staged_bytes.load(Relaxed),
            expert_in_place_bytes: self.expert_in_place_bytes.load(Relaxed),
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
    mapped_pool: staging::MappedPool,
    pub(super) traffic: std::sync::Arc<Traffic>,
    /// Tells this device's buffers from another's (each `Gpu` gets its own).
    pub(super) id: u64,
    pub(super) device: wgpu::Device,
    pub(super) queue: wgpu::Queue,
    products_layout: ComputeLayout,
    pub(super) matmul: wgpu::ComputePipeline,
    pub(super) matvec: wgpu::ComputePipeline,
    // The plain read and the matmul module serve the kernel microbench only (feature gpu-bench);
    // built in every build all the same, so that the device opens the same way in both.
    #[cfg_attr(not(feature = "gpu-bench"), allow(dead_code))]
    pub(super) read_all: wgpu::ComputePipeline,
    fma_probe: wgpu::ComputePipeline,
    /// The compiled `matmul.wgsl`, for the bench's pipelines of its other entry points.
    #[cfg_attr(not(feature = "gpu-bench"), allow(dead_code))]
    pub(super) matmul_module: wgpu::ShaderModule,
    pub(super) empty: wgpu::Buffer,
    pub summary: AdapterSummary,
    /// [`AdapterSummary::experts_in_place`]: buffers of [`UMA_ARENA`] usage can be made.
    pub(super) in_place: bool,
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

/// The size a pooled buffer of at least `size` bytes is made with: powers of two up to 16 MiB;
/// larger in eighths of their power of two (at least whole MiB), so that a pool of expert-sized
/// buffers wastes at most an eighth of its memory, while a prefill's activation buffers, whose
/// sizes move a little from call to call, still find one of their size class in the pool (a new
/// buffer of hundreds of MB each call, mapped ones above all, cost more than the kernels).
pub(in crate::backend::gpu) fn pool_size(size: u64, max_binding: u64) -> u64 {
    let pow2 = size.max(256).next_power_of_two();
    if pow2 <= 16 << 20 && pow2 <= max_binding {
        return pow2;
    }
    let step = (pow2 / 16).max(1 << 20);
    if size.div_ceil(step) * step <= max_binding {
        size.div_ceil(step) * step
    } else if size.div_ceil(1 << 20) << 20 <= max_binding {
        size.div_ceil(1 << 20) << 20
    } else {
        size.div_ceil(16) * 16
    }
}

/// Bytes padded to whole vec4 words (storage bindings are arrays of u32 or vec4).
fn padded(b: &[u8]) -> Vec<u8> {
    let mut v = b.to_vec();
    v.resize(b.len().div_ceil(16).max(1) * 16, 0);
    v
}

impl Gpu {
    /// The best-ranked adapter whose limits fit the kernels (a CPU one only with `allow_cpu`),
    /// opened; `uma` chooses how routed experts reach it (`uma.rs`).
    pub fn new(allow_cpu: bool, uma: UmaMode) -> Result<Self, GpuError> {
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
        let mappable = adapter.features().contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS);
        let (in_place, why) = uma::in_place(uma, info.device_type, mappable);
        if let Some(why) = why {
            tracing::warn!("{why}");
        }
        let mut features = wgpu::Features::empty();
        features.set(wgpu::Features::TIMESTAMP_QUERY, timed);
        // Only where it is used: wgpu warns about it on a discrete GPU.
        features.set(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS, in_place);
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("deltafin"),
            required_features: features,
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
            experts_in_place: in_place,
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
            mapped_pool: staging::MappedPool::default(),
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
            in_place,
        })
    }

    /// A pooled buffer of at least `size` bytes with `usage`.
    pub(super) fn take(&self, usage: wgpu::BufferUsages, size: u64) -> wgpu::Buffer {
        let size = pool_size(size, self.summary.max_binding);
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

    /// `bytes` in a pooled storage buffer, padded to whole 16-byte words with zeros. Large ones go
    /// through a mapped staging buffer filled across threads and one copy on the device (a
    /// prefill's activations are hundreds of MB: a queued write of them ran at 3.7 GB/s on the
    /// H200 host, the mapped path at 31 GB/s; `staging.rs`); small ones through the queue.
    pub(super) fn staged(&self, bytes: &[u8]) -> wgpu::Buffer {
        let b = self.take(STAGED, bytes.len() as u64);
        self.traffic.uploaded(bytes.len() as u64);
        if bytes.len() >= staging::PAR_MIN {
            let (staging, len) = self.fill(bytes, 16);
            let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("upload") });
            enc.copy_buffer_to_buffer(&staging, 0, &b, 0, len);
            self.queue.submit([enc.finish()]);
            self.remap(staging);
            return b;
        }
        let whole = bytes.len() / 16 * 16;
        if whole > 0 {
            self.queue.write_buffer(&b, 0, &bytes[..whole]);
        }
        if whole < bytes.len() || bytes.is_empty() {
            self.queue.write_buffer(&b, whole as u64, &padded(&bytes[whole..]));
        }
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
}
