//! `bench kernels --backend gpu`: the GPU's kernels at K3's shapes through the harness of
//! `backend/gpu/bench.rs` (development only: it times kernels, and WGSL variants of them, against
//! plain reads of the same bytes and the adapter's FMA peak).
//!
//! Contract: [`open`] gives the adapter to time (None: time the CPU's kernels instead); [`run`]
//! times it with the options as given (the caller checks them) and returns one record. The
//! microbench is a development tool, not in the shipped binary: without the `gpu-bench` feature
//! [`Gpu`] has no value and [`open`] refuses the GPU ([`BenchError::GpuMicrobenchNotBuilt`]).

use super::BenchError;
use crate::backend::BackendKind;
use std::path::PathBuf;

/// The adapter whose kernels are timed.
#[cfg(feature = "gpu-bench")]
pub type Gpu = crate::backend::gpu::GpuBackend;
/// Without the `gpu-bench` feature there is no adapter to time.
#[cfg(not(feature = "gpu-bench"))]
pub type Gpu = std::convert::Infallible;

/// What the GPU kernels are timed on.
pub struct GpuKernelOptions {
    /// Prompt rows of the matmuls.
    pub rows: usize,
    /// Dispatches averaged per measurement.
    pub reps: usize,
    /// Rows of the MXFP4 matvec matrix (a positive multiple of 16).
    pub matvec_rows: usize,
    /// Time every `*.wgsl` here as the one-row MXFP4 kernel (entry `matvec`).
    pub matvec_variants: Option<PathBuf>,
    /// Time every `*.wgsl` here as the MXFP4 matmul (entry `matmul`).
    pub matmul_variants: Option<PathBuf>,
}

/// Cache sizes (experts) of the residency ladder.
#[cfg(feature = "gpu-bench")]
const RESIDENCY_SLOTS: [usize; 5] = [16, 256, 1024, 4096, 16384];

/// The GPU kernels at K3's shapes: the MXFP4 matvec over one MoE layer's 16 routed w1 matrices
/// (49152 x 3584, larger than any GPU's L2; `--matvec-rows` for other heights) and the bf16
/// trunk matvec (12288 x 7168), each against a plain read of the same bytes; one expert's w1 alone (3072 x 3584); the `rows`-row MXFP4
/// matmul on one expert's w1 and bf16 matmul on `routed_expert_down_proj` (3584 x 7168), each
/// also as a fraction of the adapter's measured f32 FMA peak. `round_trip_us`: one tiny product's upload, submission and readback.
#[cfg(feature = "gpu-bench")]
pub fn run(g: &Gpu, a: &GpuKernelOptions) -> Result<serde_json::Value, BenchError> {
    use crate::backend::gpu::BenchKind;
    use crate::backend::{Backend, Device};
    let reps = a.reps;
    let mr = a.matvec_rows;
    let mc = 3584usize;
    let mx_bytes = (mr * mc / 2 + mr * mc / 32) as f64;
    let (er, ec) = (3072usize, 3584usize);
    let (br, bc) = (12288usize, 7168usize);
    let bf_bytes = (br * bc * 2) as f64;
    let (dr, dc) = (3584usize, 7168usize);
    let mut rec = serde_json::Map::new();
    let mut put = |k: &str, v: serde_json::Value| {
        rec.insert(k.to_string(), v);
    };
    put("backend", "gpu".into());
    put("adapter", g.describe().into());
    put("fma_fused", g.fma_is_fused().into());
    put("reps", reps.into());
    put(
        "plain_read",
        "vec4<u32> per thread per load, 4 loads in flight, consecutive threads on consecutive 16 bytes".into(),
    );
    let (mv, mread) = g.time_product(BenchKind::Mxfp4, mr, mc, 1, reps);
    let (ev, _) = g.time_product(BenchKind::Mxfp4, er, ec, 1, reps);
    let (bv, bread) = g.time_product(BenchKind::Bf16, br, bc, 1, reps);
    put("mxfp4_matvec_shape", serde_json::json!([mr, mc]));
    put("mxfp4_matvec_s", mv.into());
    put("mxfp4_matvec_weight_gb_s", (mx_bytes / mv / 1e9).into());
    put("mxfp4_plain_read_gb_s", (mx_bytes / mread / 1e9).into());
    put("mxfp4_matvec_vs_read", (mread / mv).into());
    put("mxfp4_matvec_3072x3584_s", ev.into());
    put("bf16_matvec_12288x7168_s", bv.into());
    put("bf16_matvec_weight_gb_s", (bf_bytes / bv / 1e9).into());
    put("bf16_plain_read_gb_s", (bf_bytes / bread / 1e9).into());
    put("bf16_matvec_vs_read", (bread / bv).into());
    let (mm, _) = g.time_product(BenchKind::Mxfp4, er, ec, a.rows, reps.div_ceil(4));
    let (bm, _) = g.time_product(BenchKind::Bf16, dr, dc, a.rows, reps.div_ceil(4));
    let mx_gmac = (er * ec * a.rows) as f64 / mm / 1e9;
    let bf_gmac = (dr * dc * a.rows) as f64 / bm / 1e9;
    let peak_g = g.fma_peak(reps) / 1e9;
    put("mxfp4_matmul_rows", a.rows.into());
    put("mxfp4_matmul_gmac_s", mx_gmac.into());
    put("bf16_matmul_shape", serde_json::json!([dr, dc]));
    put("bf16_matmul_gmac_s", bf_gmac.into());
    put("fma_peak", "32 independent f32 fma chains per thread, no loads (fma_peak in kernels/matmul.wgsl)".into());
    put("fma_peak_gfma_s", peak_g.into());
    put("mxfp4_matmul_fraction_of_peak", (mx_gmac / peak_g).into());
    put("bf16_matmul_fraction_of_peak", (bf_gmac / peak_g).into());
    // One tiny product with its upload, submission and readback: what every GPU call costs beyond
    // its work (a decode step makes about ten per layer).
    let w = crate::backend::Bf16Mat::from_vec(vec![0x3c; 16 * 64 * 2], 16, 64);
    let (x, mut o) = (vec![0.5f32; 64], vec![0f32; 16]);
    for _ in 0..20 {
        g.matmul_bf16(&w, &x, &mut o)?;
    }
    let calls = 500;
    let t = std::time::Instant::now();
    for _ in 0..calls {
        g.matmul_bf16(&w, &x, &mut o)?;
    }
    put("round_trip_us", (t.elapsed().as_secs_f64() / calls as f64 * 1e6).into());
    // Host <-> device rates of a prefill's activation size (a K3 MoE layer's 8192 latent rows).
    put("transfer", serde_json::to_value(g.transfer_rates(8192 * 3584 * 4)).unwrap_or_default());
    // What one decode group's submission costs as the device expert cache grows, its slots in
    // arenas (deltafin's) or one buffer each (backend/gpu/residency.rs).
    put("experts_in_place", g.experts_in_place().into());
    put("residency", serde_json::to_value(g.residency(&RESIDENCY_SLOTS, (5 * reps).max(20))?).unwrap_or_default());
    if let Some(dir) = &a.matvec_variants {
        for v in variant_timings(dir, g.time_matvec_variants(dir, mr, mc, reps)) {
            let n = &v.name;
            match v.secs {
                Some(s) => {
                    put(&format!("variant_{n}_gb_s"), (mx_bytes / s / 1e9).into());
                    put(&format!("variant_{n}_vs_read"), (v.read_secs / s).into());
                    put(&format!("variant_{n}_bits_equal"), v.bits_equal.into());
                }
                None => put(&format!("variant_{n}_error"), v.error.unwrap_or_default().into()),
            }
        }
    }
    if let Some(dir) = &a.matmul_variants {
        for v in variant_timings(dir, g.time_matmul_variants(dir, er, ec, a.rows, reps.div_ceil(4))) {
            let n = &v.name;
            match v.secs {
                Some(s) => {
                    let gmac = (er * ec * a.rows) as f64 / s / 1e9;
                    put(&format!("matmul_variant_{n}_gmac_s"), gmac.into());
                    put(&format!("matmul_variant_{n}_fraction_of_peak"), (gmac / peak_g).into());
                    put(&format!("matmul_variant_{n}_bits_equal"), v.bits_equal.into());
                }
                None => put(&format!("matmul_variant_{n}_error"), v.error.unwrap_or_default().into()),
            }
        }
    }
    Ok(crate::stats::bench_record("kernels", serde_json::Value::Object(rec)))
}

/// The timings of `dir`'s variants, with a warning for each that failed and for a directory
/// without any.
#[cfg(feature = "gpu-bench")]
fn variant_timings(
    dir: &std::path::Path,
    variants: Vec<crate::backend::gpu::VariantTiming>,
) -> Vec<crate::backend::gpu::VariantTiming> {
    if variants.len() == 1 {
        eprintln!("deltafin: warning: {}: no .wgsl file there", dir.display());
    }
    for v in &variants {
        if let Some(e) = &v.error {
            // Line numbers in parse errors count what the harness puts in front of the file.
            eprintln!(
                "deltafin: warning: variant {} in {} failed: {e} (line numbers in shader errors count \
                 products.wgsl and the harness's text before the file, unless it says `// standalone`)",
                v.name,
                dir.display()
            );
        }
    }
    variants
}

/// The GPU whose kernels `bench kernels` times: with `--backend gpu` any adapter (lavapipe
/// included), with `auto` a real GPU if there is one (else None: the CPU's kernels, as for the
/// engine), with `cpu` None.
#[cfg(feature = "gpu-bench")]
pub fn open(kind: BackendKind) -> Result<Option<Gpu>, BenchError> {
    use crate::backend::gpu::GpuBackend;
    match kind {
        BackendKind::Cpu => Ok(None),
        BackendKind::Gpu => Ok(Some(GpuBackend::new(true)?)),
        BackendKind::Auto => match GpuBackend::new(false) {
            Ok(g) => Ok(Some(g)),
            Err(e) => {
                tracing::info!("{} auto: {e}; timing the CPU's kernels", crate::setting::Setting::Backend);
                Ok(None)
            }
        },
    }
}

#[cfg(not(feature = "gpu-bench"))]
pub fn run(g: &Gpu, _: &GpuKernelOptions) -> Result<serde_json::Value, BenchError> {
    match *g {}
}

#[cfg(not(feature = "gpu-bench"))]
pub fn open(kind: BackendKind) -> Result<Option<Gpu>, BenchError> {
    match kind {
        BackendKind::Gpu => Err(BenchError::GpuMicrobenchNotBuilt),
        _ => Ok(None),
    }
}
