//! Shader modules, bind groups and the shared layout of a kernel family: how a WGSL kernel becomes
//! a compute pipeline.
//!
//! Contract: a family's kernels share one bind group layout — storage buffers at bindings 0..
//! (read-only where declared), then one uniform — so a bind group made for the layout fits every
//! pipeline of the family. Only the product kernels are compiled without wgpu's injected bounds
//! checks (`product_shader`; the reason is at the `unsafe` block).

use crate::backend::gpu::kernels::Kernel;

/// A kernel's shader module.
pub(in crate::backend::gpu) fn shader(device: &wgpu::Device, kernel: Kernel) -> wgpu::ShaderModule {
    device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some(kernel.label()),
        source: wgpu::ShaderSource::Wgsl(kernel.source().into()),
    })
}

/// A product kernel's module, without the bounds clamps and loop counters wgpu would inject
/// (measured on the H200: the MXFP4 matvec ran 5-7% faster without them).
pub(super) fn product_shader(device: &wgpu::Device, kernel: Kernel) -> wgpu::ShaderModule {
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
pub(in crate::backend::gpu) fn bind_group(
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
pub(in crate::backend::gpu) struct ComputeLayout {
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
