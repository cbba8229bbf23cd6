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
