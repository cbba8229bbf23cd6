//! The WGSL modules the GPU backend compiles, each as the text wgpu is given. WGSL has no
//! includes, so shared pieces go in front: `products.wgsl` before the two product kernels,
//! `detmath.wgsl` and `ops_common.wgsl` before the others.
//!
//! Contract: [`Kernel::source`] is the one place a module's text is put together, so what the
//! tests translate (SPIR-V through wgpu on every adapter, Metal Shading Language through naga in
//! the unit test below) is exactly what runs.

/// Prepended to both product kernels: their parameters, shared bindings and MXFP4 decoders.
pub(super) const PRODUCTS: &str = include_str!("../../../kernels/products.wgsl");
pub(super) const MATVEC: &str = include_str!("../../../kernels/matvec.wgsl");
const MATMUL: &str = include_str!("../../../kernels/matmul.wgsl");
const DETMATH: &str = include_str!("../../../kernels/detmath.wgsl");
const OPS_COMMON: &str = include_str!("../../../kernels/ops_common.wgsl");
const NORM: &str = include_str!("../../../kernels/norm.wgsl");
const ROUTE: &str = include_str!("../../../kernels/route.wgsl");
const KDA: &str = include_str!("../../../kernels/kda.wgsl");
const MLA: &str = include_str!("../../../kernels/mla.wgsl");

/// The most workgroup memory any module declares, in bytes (`kda.wgsl`: its column of the state
/// and three rows), and the most threads in any workgroup: what an adapter must allow. A unit test
/// keeps both equal to what the modules declare.
pub(super) const WORKGROUP_STORAGE_BYTES: u32 = 17_920;
pub(super) const WORKGROUP_INVOCATIONS: u32 = 256;
/// The most storage buffers any module binds (the ops layout in ops.rs: three read, two written).
pub(super) const STORAGE_BUFFERS: u32 = 5;

/// Which of the adapter's limits is below what the kernels need (None: all of them suffice).
/// Checked before any module is compiled, so that an adapter that cannot run them is an error
/// that names the limit (and `--backend auto` takes the CPU) rather than a failed pipeline.
pub(super) fn limit_shortfall(limits: &wgpu::Limits) -> Option<String> {
    let checks = [
        ("bytes of workgroup memory", limits.max_compute_workgroup_storage_size, WORKGROUP_STORAGE_BYTES),
        ("threads per workgroup", limits.max_compute_invocations_per_workgroup, WORKGROUP_INVOCATIONS),
        ("threads in a workgroup's x dimension", limits.max_compute_workgroup_size_x, WORKGROUP_INVOCATIONS),
        ("storage buffers per shader stage", limits.max_storage_buffers_per_shader_stage, STORAGE_BUFFERS),
    ];
    checks
        .iter()
        .find(|(_, have, need)| have < need)
        .map(|(what, have, need)| format!("it allows {have} {what}, the kernels need {need}"))
}

/// One compiled module.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Kernel {
    Matmul,
    Matvec,
    Norm,
    Route,
    Kda,
    Mla,
}

impl Kernel {
    #[cfg(test)]
    const ALL: [Kernel; 6] = [Kernel::Matmul, Kernel::Matvec, Kernel::Norm, Kernel::Route, Kernel::Kda, Kernel::Mla];

    /// The file under `kernels/` (the module's label).
    pub fn label(self) -> &'static str {
        match self {
            Kernel::Matmul => "matmul.wgsl",
            Kernel::Matvec => "matvec.wgsl",
            Kernel::Norm => "norm.wgsl",
            Kernel::Route => "route.wgsl",
            Kernel::Kda => "kda.wgsl",
            Kernel::Mla => "mla.wgsl",
        }
    }

    /// The module's whole text.
    pub fn source(self) -> String {
        let parts: &[&str] = match self {
            Kernel::Matmul => &[PRODUCTS, MATMUL],
            Kernel::Matvec => &[PRODUCTS, MATVEC],
            Kernel::Norm => &[DETMATH, OPS_COMMON, NORM],
            Kernel::Route => &[DETMATH, OPS_COMMON, ROUTE],
            Kernel::Kda => &[DETMATH, OPS_COMMON, KDA],
            Kernel::Mla => &[DETMATH, OPS_COMMON, MLA],
        };
        parts.join("\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The module's workgroup variables (all of them, whichever entry point uses them: an upper
    /// bound) in bytes, its largest workgroup, and its storage buffers.
    fn workgroup_needs(k: Kernel) -> (u32, u32, u32) {
        let module = naga::front::wgsl::parse_str(&k.source()).expect("kernel parses");
        let mut layouter = naga::proc::Layouter::default();
        layouter.update(module.to_ctx()).expect("kernel types lay out");
        let bytes = module
            .global_variables
            .iter()
            .filter(|(_, v)| v.space == naga::AddressSpace::WorkGroup)
            // WebGPU counts each variable rounded up to 16 bytes.
            .map(|(_, v)| layouter[v.ty].size.next_multiple_of(16))
            .sum();
        // The limit checks treat every workgroup as one-dimensional.
        for e in &module.entry_points {
            assert_eq!(e.workgroup_size[1..], [1, 1], "{}: {} is not one-dimensional", k.label(), e.name);
        }
        let threads = module.entry_points.iter().map(|e| e.workgroup_size.iter().product::<u32>()).max().unwrap_or(1);
        let storage = module
            .global_variables
            .iter()
            .filter(|(_, v)| matches!(v.space, naga::AddressSpace::Storage { .. }))
            .count();
        (bytes, threads, storage as u32)
    }

    #[test]
    fn the_stated_workgroup_needs_are_the_modules_own() {
        let needs: Vec<(u32, u32, u32)> = Kernel::ALL.iter().map(|&k| workgroup_needs(k)).collect();
        for (k, (bytes, threads, storage)) in Kernel::ALL.iter().zip(&needs) {
            eprintln!("{}: {bytes} bytes of workgroup memory, {threads} threads, {storage} storage buffers", k.label());
        }
        assert_eq!(needs.iter().map(|n| n.0).max(), Some(WORKGROUP_STORAGE_BYTES));
        assert_eq!(needs.iter().map(|n| n.1).max(), Some(WORKGROUP_INVOCATIONS));
        assert_eq!(needs.iter().map(|n| n.2).max(), Some(STORAGE_BUFFERS));
        // Apple GPUs give a compute pass 32 KiB of threadgroup memory.
        let apple = 32 * 1024;
        assert!(needs.iter().all(|n| n.0 <= apple), "a module needs more than an Apple GPU's 32 KiB");
    }

    #[test]
    fn an_adapter_below_the_kernels_needs_is_named_and_one_at_them_is_not() {
        let at = wgpu::Limits { max_compute_workgroup_storage_size: WORKGROUP_STORAGE_BYTES, ..Default::default() };
        assert_eq!(limit_shortfall(&at), None);
        // WebGPU's default limits allow 16 KiB of workgroup memory: less than kda.wgsl's.
        let small = wgpu::Limits::default();
        let why = limit_shortfall(&small).expect("16 KiB of workgroup memory is short");
        assert!(why.contains("workgroup memory") && why.contains("17920"), "{why}");
        let narrow = wgpu::Limits { max_compute_invocations_per_workgroup: 128, ..at.clone() };
        assert!(limit_shortfall(&narrow).is_some_and(|w| w.contains("threads per workgroup")));
    }

    /// No Apple hardware runs here, so this is the Metal path's check: each module goes through
    /// the WGSL front end, naga's validator and its Metal Shading Language writer, as wgpu does on
    /// macOS before Apple's compiler sees it (which only a Mac can run).
    #[test]
    fn every_kernel_translates_to_metal_shading_language() {
        for k in Kernel::ALL {
            let module = naga::front::wgsl::parse_str(&k.source())
                .unwrap_or_else(|e| panic!("{}: {}", k.label(), e.emit_to_string(&k.source())));
            // What wgpu gives a shader on Metal without optional features: every downlevel flag,
            // `unpack2x16float`'s f16-in-f32 among them.
            let caps = naga::valid::Capabilities::SHADER_FLOAT16_IN_FLOAT32;
            let info = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), caps)
                .validate(&module)
                .unwrap_or_else(|e| panic!("{}: {e:?}", k.label()));
            let options = naga::back::msl::Options { lang_version: (2, 4), ..Default::default() };
            let (msl, _) =
                naga::back::msl::write_string(&module, &info, &options, &naga::back::msl::PipelineOptions::default())
                    .unwrap_or_else(|e| panic!("{}: no Metal Shading Language: {e:?}", k.label()));
            eprintln!("{}: {} bytes of MSL", k.label(), msl.len());
            for ep in &module.entry_points {
                assert!(msl.contains(&ep.name), "{}: entry point {} missing from the MSL", k.label(), ep.name);
            }
        }
    }
}
