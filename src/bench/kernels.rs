//! `bench kernels`: the CPU's compute kernels at K3's real shapes — an MXFP4 expert matrix
//! (matvec, the decode product, and matmul over a prompt's rows), bf16 projections of the trunk
//! (also held coded and int8, `--trunk`), SiTU over a prompt's expert rows, the KDA state update
//! (recurrent and chunked) — each also against the core's measured FMA peak. The record names the
//! instruction set (`machine.isa`; `DELTAFIN_ISA` picks another, docs/kernels-neon.md).
//!
//! Contract: [`cpu`] takes `rows` (prompt rows, 1..=[`MAX_ROWS`]) and `heads` (>= 1) as given
//! (the caller checks them), times each kernel for at least a second after a warm-up call, on
//! fixed pseudo-random inputs, and returns one record.

use crate::backend::coded::CodedMat;
use crate::backend::int8::Int8Mat;
use crate::backend::{Bf16Mat, Mxfp4Mat, Situ};
use crate::cpu::{matmul_bf16, matmul_mxfp4, matvec_bf16, matvec_mxfp4};
use std::sync::Arc;
use std::time::Instant;

/// The most prompt rows `bench kernels` takes: the prompt-sized products hold `rows` x 7168 f32
/// inputs, 470 MB at this limit.
pub const MAX_ROWS: usize = 16_384;

/// Times the CPU kernels (see the module contract).
pub fn cpu(a_rows: usize, heads: usize) -> serde_json::Value {
    let mut rng = crate::util::XorShift(0x9E37_79B9_7F4A_7C15);
    let mut bytes = |n: usize| -> Vec<u8> { (0..n).map(|_| rng.next_u64() as u8).collect() };
    let time = |f: &mut dyn FnMut()| {
        f();
        let t = Instant::now();
        let mut n = 0;
        while n < 3 || t.elapsed().as_secs_f64() < 1.0 {
            f();
            n += 1;
        }
        t.elapsed().as_secs_f64() / n as f64
    };
    // One K3 expert matrix: w1 [3072, 3584] MXFP4 (scales near 2^-6 keep values tame).
    let (rows, cols) = (3072usize, 3584usize);
    let packed = bytes(rows * cols / 2);
    let scales = vec![121u8; rows * cols / 32];
    let w = Mxfp4Mat::new(&packed, &scales, rows, cols);
    let xv: Vec<f32> = (0..cols * a_rows).map(|i| ((i % 17) as f32 - 8.0) / 8.0).collect();
    let mut out = vec![0f32; rows * a_rows];
    let mv = time(&mut || matvec_mxfp4(&w, &xv[..cols], &mut out[..rows]));
    let m_rows = (a_rows * 16 / 896).max(1);
    let mm = time(&mut || matmul_mxfp4(&w, &xv[..cols * m_rows], &mut out[..rows * m_rows]));
    // A bf16 projection of the trunk: [12288, 7168].
    let (br, bc) = (12288usize, 7168usize);
    // Normal bf16 values in +-[0.5, 1) x 2^-4 (random denormals would measure microcode assists).
    let bw = bytes(br * bc * 2).chunks(2).flat_map(|c| [c[0], (c[1] & 0x80) | 0x3d]).collect::<Vec<u8>>();
    let b = Bf16Mat::from_vec(bw.clone(), br, bc);
    let bx: Vec<f32> = (0..bc * 4).map(|i| ((i % 13) as f32 - 6.0) / 6.0).collect();
    let mut bout = vec![0f32; br * 4];
    let bv = time(&mut || matvec_bf16(&b, &bx[..bc], &mut bout[..br]));
    let bm = time(&mut || matmul_bf16(&b, &bx, &mut bout));
    // The same projection as the coded and the int8 trunk hold it (decoded inside the kernels).
    let coded = Bf16Mat::coded(Arc::new(CodedMat::encode(&bw, br, bc)));
    let cv = time(&mut || matvec_bf16(&coded, &bx[..bc], &mut bout[..br]));
    let int8 = Bf16Mat::int8(Arc::new(Int8Mat::quantize(&bw, br, bc)));
    let iv = time(&mut || matvec_bf16(&int8, &bx[..bc], &mut bout[..br]));
    // SiTU over a prompt's rows of one expert's hidden width (K3: 3072), K3's betas.
    let sn = 3072 * a_rows.min(64);
    let (sg, su): (Vec<f32>, Vec<f32>) =
        (0..sn).map(|i| (((i % 29) as f32 - 14.0) / 3.0, ((i % 23) as f32 - 11.0) / 2.0)).unzip();
    let mut so = vec![0f32; sn];
    let sv = time(&mut || Situ { beta: 4.0, linear_beta: 25.0 }.apply_rows(&sg, &su, &mut so));
    // A prompt-sized product: routed_expert_down_proj [3584, 7168] on `rows` rows.
    let (dr, dc) = (3584usize, 7168usize);
    let dw = bw[..dr * dc * 2].to_vec();
    let dm = Bf16Mat::from_vec(dw.clone(), dr, dc);
    let dx: Vec<f32> = (0..dc * a_rows).map(|i| ((i % 11) as f32 - 5.0) / 5.0).collect();
    let mut dout = vec![0f32; dr * a_rows];
    let dmm = time(&mut || matmul_bf16(&dm, &dx, &mut dout));
    let mxx: Vec<f32> = (0..cols * a_rows).map(|i| ((i % 7) as f32 - 3.0) / 3.0).collect();
    let mut mxo = vec![0f32; rows * a_rows];
    let mxm = time(&mut || matmul_mxfp4(&w, &mxx, &mut mxo));
    let kda_rec = crate::cpu::kda::time_state_update(a_rows, heads, 128, false);
    let kda_chunk = crate::cpu::kda::time_state_update(a_rows, heads, 128, true);
    let macs = (rows * cols) as f64;
    let (peak, peak_lanes) = crate::cpu::peak::fma_peak(0.5);
    let peak_g = peak / 1e9;
    let prompt_gmac = macs * a_rows as f64 / mxm / 1e9;
    let expert_gmac = macs * m_rows as f64 / mm / 1e9;
    crate::stats::bench_record(
        "kernels",
        serde_json::json!({
            "threads": rayon::current_num_threads(),
            "fma_peak_gfma_s": peak_g,
            "fma_peak_lanes": peak_lanes,
            "mxfp4_matmul_fraction_of_peak": expert_gmac / peak_g,
            "mxfp4_matmul_prompt_fraction_of_peak": prompt_gmac / peak_g,
            "mxfp4_matvec_3072x3584_s": mv,
            "mxfp4_matvec_gmac_s": macs / mv / 1e9,
            "mxfp4_matvec_weight_gb_s": (packed.len() + scales.len()) as f64 / mv / 1e9,
            "mxfp4_matmul_rows": m_rows,
            "mxfp4_matmul_gmac_s": expert_gmac,
            "bf16_matvec_12288x7168_s": bv,
            "bf16_matvec_weight_gb_s": bw.len() as f64 / bv / 1e9,
            "bf16_matmul4_gmac_s": (br * bc * 4) as f64 / bm / 1e9,
            "coded_matvec_12288x7168_s": cv,
            "coded_matvec_weight_gb_s": coded.byte_len() as f64 / cv / 1e9,
            "coded_matvec_bf16_equivalent_gb_s": bw.len() as f64 / cv / 1e9,
            "int8_matvec_12288x7168_s": iv,
            "int8_matvec_weight_gb_s": int8.byte_len() as f64 / iv / 1e9,
            "situ_elements": sn,
            "situ_gelem_s": sn as f64 / sv / 1e9,
            "bf16_matmul_prompt_gmac_s": (dr * dc * a_rows) as f64 / dmm / 1e9,
            "mxfp4_matmul_prompt_gmac_s": prompt_gmac,
            "kda_rows": a_rows,
            "kda_heads": heads,
            "kda_recurrent_s": kda_rec,
            "kda_chunked_s": kda_chunk,
        }),
    )
}
