//! The GPU backend (runs where wgpu finds an adapter; CI installs Mesa's lavapipe): its bf16 and
//! MXFP4 products against an fp64 dot within 1e-5 and, on an adapter whose fma is fused, bit for
//! bit against the CPU kernels (tail shapes included); the other operations
//! (RMSNorm, SiTU, AttnRes mix, routing, argmax, KDA recurrence, MLA core) within 1e-5 of the CPU
//! backend (normwise) and bit for bit when fma is fused, routing and argmax choosing the CPU's
//! indices everywhere; the fixtures through `--backend gpu` (every operation on the GPU) within
//! 1e-4 of the fp64 reference with identical greedy tokens; `auto` falls back to the CPU without
//! a real GPU.
#![cfg(feature = "gpu")]

mod common;
use common::*;
use deltafin::backend::gpu::GpuBackend;
use deltafin::backend::{
    AppendBuf, Backend, BackendKind, Bf16Mat, CpuBackend, Device, ExpertLayout, Mxfp4Mat, Situ, StateBuf, run_expert,
};
use deltafin::cpu::{decode_mxfp4_row, deinterleave_mxfp4_input};
use deltafin::engine::{Engine, EngineConfig, EngineError};
use deltafin::k3::KdaMode;
use deltafin::setting::Setting;

fn gpu() -> Option<GpuBackend> {
    match GpuBackend::new(true) {
        Ok(g) => Some(g),
        Err(e) => {
            no_gpu("tests/gpu.rs", &e);
            None
        }
    }
}

fn rel_err_f64(got: &[f32], w: &[Vec<f32>], xs: &[f32], cols: usize) -> f64 {
    let rows = w.len();
    let mut worst = 0f64;
    for (i, x) in xs.chunks(cols).enumerate() {
        for (r, wr) in w.iter().enumerate() {
            let exact: f64 = wr.iter().zip(x).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
            let mag: f64 = wr.iter().zip(x).map(|(a, b)| (f64::from(*a) * f64::from(*b)).abs()).sum();
            worst = worst.max((f64::from(got[i * rows + r]) - exact).abs() / mag.max(1e-30));
        }
    }
    worst
}

#[test]
fn gpu_products_match_fp64_and_the_cpu_bits_when_fma_is_fused() {
    let Some(g) = gpu() else { return };
    eprintln!("{} (fma fused: {})", g.describe(), g.fma_is_fused());
    products_match(&g);
}

/// A random MXFP4 matrix's packed bytes and scales and `n` deinterleaved input rows. The scales
/// stay clear of byte 0 (2^-127, which makes subnormal weights): the H200 flushes those (measured:
/// one output of 37 differed by 1.7e-39), so the CPU's bits are not promised for them.
fn random_mxfp4(rng: &mut Rng, rows: usize, cols: usize, n: usize) -> (Vec<u8>, Vec<u8>, Vec<f32>) {
    let packed = rng.bytes(rows * cols / 2);
    let scales: Vec<u8> = (0..rows * cols / 32).map(|i| 114 + (i % 13) as u8).collect();
    let x = rng.vec(n * cols);
    let mut xd = vec![0f32; x.len()];
    for (s, d) in x.chunks(cols).zip(xd.chunks_mut(cols)) {
        deinterleave_mxfp4_input(s, d);
    }
    (packed, scales, xd)
}

fn random_bf16(rng: &mut Rng, rows: usize, cols: usize) -> Bf16Mat {
    let bytes: Vec<u8> =
        (0..rows * cols).flat_map(|_| half::bf16::from_f32(rng.f32() * 2.0 - 1.0).to_le_bytes()).collect();
    Bf16Mat::from_vec(bytes, rows, cols)
}

#[test]
fn gpu_products_at_tail_shapes_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let cpu = CpuBackend;
    let mut rng = Rng(23);
    // One input row (matvec): rows not a multiple of the 16 per workgroup; MXFP4 rows of 1 and 3
    // blocks (below the 4-block unroll), 5 (a remainder), 112 and 224 (K3's), 225 (7168 + 32:
    // rows whose scales do not start on a word). Several rows (matmul): input rows not a
    // multiple of its 4, weight rows not a multiple of its 128, columns past one 256-column tile.
    // The matvec's tiles of 8 blocks: exactly one (256), one and a tail of 4 (384), none (128).
    let mx = [
        (37usize, 32usize, 1usize),
        (70, 96, 1),
        (5, 160, 1),
        (131, 3584, 1),
        (67, 7168, 1),
        (33, 7200, 1),
        (45, 256, 1),
        (29, 384, 1),
        (19, 128, 1),
    ];
    let mm = [(37, 32, 2), (130, 96, 9), (5, 3584, 17), (131, 7200, 3), (67, 288, 8)];
    for (rows, cols, n) in mx.into_iter().chain(mm) {
        let (packed, scales, xd) = random_mxfp4(&mut rng, rows, cols, n);
        let w = Mxfp4Mat::new(&packed, &scales, rows, cols);
        let (mut a, mut b) = (vec![0f32; n * rows], vec![0f32; n * rows]);
        g.matmul_mxfp4(&w, &xd, &mut a).unwrap();
        cpu.matmul_mxfp4(&w, &xd, &mut b).unwrap();
        check(&g, &format!("mxfp4 {rows}x{cols} x{n}"), &a, &b, 1e-5);
    }
    // bf16: columns not a multiple of 16 (7, 333), fewer chunks than a step (16, 48), K3's 7168
    // and a remainder of the unroll (7168 + 16).
    let bf = [(37usize, 7usize, 1usize), (70, 333, 1), (5, 16, 1), (131, 48, 1), (67, 7168, 1), (33, 7184, 1)];
    let bm = [(37, 7, 2), (130, 333, 9), (5, 16, 17), (131, 7184, 3), (67, 272, 8)];
    for (rows, cols, n) in bf.into_iter().chain(bm) {
        let w = random_bf16(&mut rng, rows, cols);
        let x = rng.vec(n * cols);
        let (mut a, mut b) = (vec![0f32; n * rows], vec![0f32; n * rows]);
        g.matmul_bf16(&w, &x, &mut a).unwrap();
        cpu.matmul_bf16(&w, &x, &mut b).unwrap();
        check(&g, &format!("bf16 {rows}x{cols} x{n}"), &a, &b, 1e-5);
    }
    // More rows than 65535 workgroups of 16: the matvec's second dispatch dimension.
    let rows = 65_535 * 16 + 5;
    let (packed, scales, xd) = random_mxfp4(&mut rng, rows, 32, 1);
    let w = Mxfp4Mat::new(&packed, &scales, rows, 32);
    let (mut a, mut b) = (vec![0f32; rows], vec![0f32; rows]);
    g.matmul_mxfp4(&w, &xd, &mut a).unwrap();
    cpu.matmul_mxfp4(&w, &xd, &mut b).unwrap();
    check(&g, &format!("mxfp4 {rows}x32 x1"), &a, &b, 1e-5);
}

#[test]
fn mxfp4_scale_bytes_above_240_give_the_cpus_products() {
    // Blocks 1, 4, 7, ... of every row have scale bytes 241..250 (2^114 .. 2^123, whose E2M1
    // products need the two-step form on the GPU) and inputs near 2^-100, so that every product
    // and sum stays a normal float; the rest have ordinary scales and inputs. 384 columns: one
    // tile of 8 blocks (taken by the two-step path as a whole) and a tail of 4 (block by block).
    // One input row runs the matvec kernel, several the matmul (5: a partial group of its 4).
    let Some(g) = gpu() else { return };
    let cpu = CpuBackend;
    let mut rng = Rng(41);
    for (rows, cols, n) in [(37usize, 384usize, 1usize), (20, 7168, 1), (9, 96, 1), (37, 384, 5), (130, 96, 3)] {
        let blocks = cols / 32;
        let packed = rng.bytes(rows * cols / 2);
        let wide = |b: usize| b % 3 == 1;
        let scales: Vec<u8> = (0..rows * blocks)
            .map(|i| if wide(i % blocks) { 241 + (i % 10) as u8 } else { 114 + (i % 13) as u8 })
            .collect();
        let x: Vec<f32> = (0..n * cols)
            .map(|i| {
                let c = i % cols;
                let v = (0.5 + rng.f32() / 2.0) * if c % 2 == 0 { 1.0 } else { -1.0 };
                if wide(c / 32) { v * 2f32.powi(-100) } else { v }
            })
            .collect();
        let mut xd = vec![0f32; n * cols];
        for (row, out) in x.chunks(cols).zip(xd.chunks_mut(cols)) {
            deinterleave_mxfp4_input(row, out);
        }
        let w = Mxfp4Mat::new(&packed, &scales, rows, cols);
        let (mut a, mut b) = (vec![0f32; n * rows], vec![0f32; n * rows]);
        g.matmul_mxfp4(&w, &xd, &mut a).unwrap();
        cpu.matmul_mxfp4(&w, &xd, &mut b).unwrap();
        assert!(b.iter().all(|v| v.is_finite()), "the CPU's products stay finite");
        check(&g, &format!("mxfp4 wide scales {rows}x{cols} x{n}"), &a, &b, 1e-5);
    }
}

fn products_match(g: &GpuBackend) {
    let mut rng = Rng(3);
    let cpu = CpuBackend;
    // Tails: rows not a multiple of the workgroup's 16, columns not a multiple of 16 (one input
    // row: the matvec kernel; several: the matmul), fewer chunks than the 4-way unroll.
    for (rows, cols, n) in
        [(37usize, 80usize, 1usize), (64, 7168, 1), (19, 333, 5), (130, 512, 9), (21, 333, 1), (5, 7, 1), (17, 1000, 1)]
    {
        let bytes: Vec<u8> =
            (0..rows * cols).flat_map(|_| half::bf16::from_f32(rng.f32() * 2.0 - 1.0).to_le_bytes()).collect();
        let w = Bf16Mat::from_vec(bytes, rows, cols);
        let xs = rng.vec(n * cols);
        let (mut a, mut b) = (vec![0f32; n * rows], vec![0f32; n * rows]);
        g.matmul_bf16(&w, &xs, &mut a).unwrap();
        cpu.matmul_bf16(&w, &xs, &mut b).unwrap();
        let dec: Vec<Vec<f32>> = (0..rows)
            .map(|r| {
                let mut o = vec![0f32; cols];
                w.decode_row(r, &mut o);
                o
            })
            .collect();
        let err = rel_err_f64(&a, &dec, &xs, cols);
        assert!(err < 1e-5, "bf16 {rows}x{cols} x{n}: relative error {err:.2e}");
        let same = a.iter().zip(&b).filter(|(x, y)| x.to_bits() == y.to_bits()).count();
        eprintln!("bf16 {rows}x{cols} x{n}: error {err:.2e}, {same} of {} bit-identical to the CPU", a.len());
        if g.fma_is_fused() {
            assert_eq!(same, a.len(), "fused fma: the CPU's bits");
        }
    }
    // MXFP4: 1, 3, 5 and 112 blocks per row (the 4-block unroll and its remainder), odd row counts.
    for (rows, cols, n) in
        [(33usize, 64usize, 1usize), (96, 3584, 1), (40, 3072, 6), (7, 32, 1), (49, 96, 1), (18, 160, 1), (3, 160, 2)]
    {
        let packed = rng.bytes(rows * cols / 2);
        let scales: Vec<u8> = (0..rows * cols / 32).map(|i| 118 + (i % 5) as u8).collect();
        let w = Mxfp4Mat::new(&packed, &scales, rows, cols);
        let x = rng.vec(n * cols);
        let mut xd = vec![0f32; x.len()];
        for (s, d) in x.chunks(cols).zip(xd.chunks_mut(cols)) {
            deinterleave_mxfp4_input(s, d);
        }
        let (mut a, mut b) = (vec![0f32; n * rows], vec![0f32; n * rows]);
        g.matmul_mxfp4(&w, &xd, &mut a).unwrap();
        cpu.matmul_mxfp4(&w, &xd, &mut b).unwrap();
        let dec: Vec<Vec<f32>> = (0..rows)
            .map(|r| {
                let mut o = vec![0f32; cols];
                decode_mxfp4_row(
                    &packed[r * cols / 2..(r + 1) * cols / 2],
                    &scales[r * cols / 32..(r + 1) * cols / 32],
                    &mut o,
                );
                o
            })
            .collect();
        let err = rel_err_f64(&a, &dec, &xd, cols);
        assert!(err < 1e-5, "mxfp4 {rows}x{cols} x{n}: relative error {err:.2e}");
        let same = a.iter().zip(&b).filter(|(x, y)| x.to_bits() == y.to_bits()).count();
        eprintln!("mxfp4 {rows}x{cols} x{n}: error {err:.2e}, {same} of {} bit-identical to the CPU", a.len());
        if g.fma_is_fused() {
            assert_eq!(same, a.len(), "fused fma: the CPU's bits");
        }
    }
}

/// A random expert in a layout whose records sit at unaligned offsets (a gap of 3 bytes between
/// them), so that staging must copy record by record.
fn random_expert(rng: &mut Rng, inter: usize, latent: usize) -> (ExpertLayout, Vec<u8>) {
    let sizes = [
        inter * latent / 2,
        inter * latent / 32,
        inter * latent / 2,
        inter * latent / 32,
        latent * inter / 2,
        latent * inter / 32,
    ];
    let mut parts = [(0usize, 0usize); 6];
    let mut bytes = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        bytes.extend_from_slice(&[0xee; 3]);
        parts[i] = (bytes.len(), n);
        if i % 2 == 1 {
            bytes.extend((0..n).map(|j| 119 + (j % 6) as u8));
        } else {
            bytes.extend(rng.bytes(n));
        }
    }
    (ExpertLayout { parts, len: bytes.len(), inter, latent }, bytes)
}

#[test]
fn the_batched_expert_path_equals_the_per_expert_path() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(11);
    // 21 experts (more than one group of 16), with 1, 0, 2 and 5 rows (a product per dispatch),
    // or one row each as in decode (all w1 and w3 of a group in one dispatch, all w2 in another;
    // 3584 columns take the matvec's tiled path), SiTU with and without its linear clamp.
    let cases = [
        ((96usize, 64usize), [1, 0, 2, 5], 0.0),
        ((64, 3584), [1, 0, 2, 5], 0.0),
        ((96, 64), [1; 4], 0.0),
        ((64, 3584), [1; 4], 25.0),
    ];
    for ((inter, latent), rows, linear_beta) in cases {
        let situ = Situ { beta: 4.0, linear_beta };
        let experts: Vec<(ExpertLayout, Vec<u8>)> = (0..21).map(|_| random_expert(&mut rng, inter, latent)).collect();
        let layout = experts[0].0.clone();
        let inputs: Vec<Vec<f32>> = (0..21)
            .map(|i| {
                let x = rng.vec(rows[i % 4] * latent);
                let mut xd = vec![0f32; x.len()];
                for (s, d) in x.chunks(latent).zip(xd.chunks_mut(latent)) {
                    deinterleave_mxfp4_input(s, d);
                }
                xd
            })
            .collect();
        let mut batch = g.expert_batch(1, &layout, situ);
        for (i, ((l, b), zd)) in experts.iter().zip(&inputs).enumerate() {
            assert_eq!(l.parts.map(|p| p.1), layout.parts.map(|p| p.1));
            // Same sizes and offsets: the layout of the first describes every one.
            batch.add(i as u32, b, zd).unwrap();
        }
        let got = batch.finish().unwrap();
        assert_eq!(got.len(), 21);
        let cpu = CpuBackend;
        // The per-expert path with every op on the GPU (the batch runs SiTU there at any size).
        let Some(g0) = gpu() else { return };
        let g0 = g0.with_ops_min(0);
        let mut same_cpu = 0usize;
        let mut total = 0usize;
        for (i, ((_, b), zd)) in experts.iter().zip(&inputs).enumerate() {
            let one = run_expert(&g0, &layout, b, situ, zd).unwrap();
            assert_eq!(got[i].len(), zd.len(), "expert {i}: output rows");
            assert!(
                got[i].iter().zip(&one).all(|(a, b)| a.to_bits() == b.to_bits()),
                "expert {i} ({inter}x{latent}, rows {rows:?}): the batch differs from the per-expert GPU path"
            );
            let c = run_expert(&cpu, &layout, b, situ, zd).unwrap();
            // Two products and SiTU between unfused and fused fma: relative L2 distance.
            let d: f64 = got[i].iter().zip(&c).map(|(a, b)| f64::from(a - b).powi(2)).sum();
            let m: f64 = c.iter().map(|b| f64::from(*b).powi(2)).sum();
            let rel = (d / m.max(1e-30)).sqrt();
            assert!(rel < 1e-5, "expert {i}: relative L2 distance {rel:.2e} from the CPU");
            same_cpu += got[i].iter().zip(&c).filter(|(a, b)| a.to_bits() == b.to_bits()).count();
            total += c.len();
        }
        eprintln!(
            "batched experts {inter}x{latent}, rows {rows:?}: equal to per-expert; {same_cpu} of {total} bit-identical to the CPU"
        );
        if g.fma_is_fused() {
            assert_eq!(same_cpu, total, "fused fma: the CPU's bits");
        }
    }
}

#[test]
fn batched_experts_from_the_device_cache_and_staging_in_one_group_equal_the_per_expert_path() {
    let Some(g) = gpu() else { return };
    let (inter, latent) = (64usize, 512usize);
    let mut rng = Rng(23);
    let experts: Vec<(ExpertLayout, Vec<u8>)> = (0..16).map(|_| random_expert(&mut rng, inter, latent)).collect();
    let layout = experts[0].0.clone();
    // Seven slots: each round's group of 16 runs some experts from the cache's arena and the
    // others from the group's staging arena (two image buffers, so five dispatches).
    let slot: u64 = layout.parts.iter().map(|&(_, len)| len.div_ceil(16) as u64 * 16).sum();
    let g = g.with_device_cache(slot * 7 + slot / 2);
    g.plan_experts(&layout, 100).unwrap();
    assert_eq!(g.device_expert_slots(), 7);
    let Some(per_expert) = gpu() else { return };
    let per_expert = per_expert.with_ops_min(0);
    let situ = Situ { beta: 4.0, linear_beta: 25.0 };
    let ids: Vec<u32> = (0..16).collect();
    let mut held_total = 0;
    for round in 0..3 {
        let inputs: Vec<Vec<f32>> = (0..16)
            .map(|_| {
                let x = rng.vec(latent);
                let mut xd = vec![0f32; latent];
                deinterleave_mxfp4_input(&x, &mut xd);
                xd
            })
            .collect();
        let mut batch = g.expert_batch(1, &layout, situ);
        let held = batch.claim_held(&ids);
        // Held experts first, then the rest as they would land: outputs come in queue order.
        let order: Vec<usize> = (0..16).filter(|&i| held[i]).chain((0..16).filter(|&i| !held[i])).collect();
        for &i in &order {
            if held[i] {
                batch.add_held(i as u32, &inputs[i]).unwrap();
            } else {
                batch.add(i as u32, &experts[i].1, &inputs[i]).unwrap();
            }
        }
        let got = batch.finish().unwrap();
        for (q, &i) in order.iter().enumerate() {
            let one = run_expert(&per_expert, &layout, &experts[i].1, situ, &inputs[i]).unwrap();
            assert!(
                got[q].len() == one.len() && got[q].iter().zip(&one).all(|(a, b)| a.to_bits() == b.to_bits()),
                "round {round}, expert {i} (held: {}): the batch differs from the per-expert GPU path",
                held[i]
            );
        }
        held_total += held.iter().filter(|&&h| h).count();
    }
    assert!(held_total > 0, "no expert ran from the device cache");
}

/// Worst |a - b| / max |b| over a vector (0 for equal vectors), and how many elements are
/// bit-identical.
fn compare(a: &[f32], b: &[f32]) -> (f64, usize) {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f64, |m, v| m.max(f64::from(*v).abs())).max(1e-30);
    let worst = a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((f64::from(*x) - f64::from(*y)).abs() / scale));
    (worst, a.iter().zip(b).filter(|(x, y)| x.to_bits() == y.to_bits()).count())
}

/// On lavapipe (fma not fused) within `tol` of the CPU, normwise; bit-identical when fused.
fn check(g: &GpuBackend, what: &str, a: &[f32], b: &[f32], tol: f64) {
    let (err, same) = compare(a, b);
    eprintln!("{what}: error {err:.2e} vs the CPU, {same} of {} bit-identical", a.len());
    assert!(err <= tol, "{what}: error {err:.2e} > {tol:.0e}");
    if g.fma_is_fused() {
        assert_eq!(same, a.len(), "{what}: fused fma must give the CPU's bits");
    }
}

#[test]
fn gpu_ops_match_the_cpu_within_tolerance_and_bit_for_bit_when_fma_is_fused() {
    use deltafin::backend::{HeadIn, MlaDims, RouteRule, Visible};
    let Some(g) = gpu() else { return };
    let g = g.with_ops_min(0);
    let cpu = CpuBackend;
    let mut rng = Rng(17);
    const TOL: f64 = 1e-5;

    // RMSNorm: odd widths, several rows.
    for (rows, cols) in [(1usize, 16usize), (5, 333), (3, 7168)] {
        let x: Vec<f32> = rng.vec(rows * cols).iter().map(|v| v * 3.0).collect();
        let w = rng.vec(cols);
        let (mut a, mut b) = (x.clone(), x);
        g.rms_norm_rows(&mut a, &w, 1e-5).unwrap();
        cpu.rms_norm_rows(&mut b, &w, 1e-5).unwrap();
        check(&g, &format!("rms_norm {rows}x{cols}"), &a, &b, TOL);
    }
    // SiTU over the activation range, with and without the up transform.
    let gate: Vec<f32> = rng.vec(3000).iter().map(|v| v * 30.0).collect();
    let up: Vec<f32> = rng.vec(3000).iter().map(|v| v * 60.0).collect();
    for linear_beta in [25.0f32, 0.0] {
        let s = Situ { beta: 4.0, linear_beta };
        let (mut a, mut b) = (vec![0f32; 3000], vec![0f32; 3000]);
        g.situ(s, &gate, &up, &mut a).unwrap();
        cpu.situ(s, &gate, &up, &mut b).unwrap();
        check(&g, &format!("situ linear_beta {linear_beta}"), &a, &b, TOL);
    }
    // AttnRes mix: 1 to 9 sources.
    for ns in [1usize, 2, 9] {
        let h = 517;
        let src: Vec<Vec<f32>> = (0..ns).map(|i| rng.vec(h).iter().map(|v| v * (1.0 + i as f32)).collect()).collect();
        let refs: Vec<&[f32]> = src.iter().map(|v| v.as_slice()).collect();
        let w = rng.vec(h);
        let (mut a, mut b) = (vec![0f32; h], vec![0f32; h]);
        g.attn_res_mix(&refs, &w, 1e-5, &mut a).unwrap();
        cpu.attn_res_mix(&refs, &w, 1e-5, &mut b).unwrap();
        check(&g, &format!("attn_res_mix {ns} sources"), &a, &b, TOL);
    }
    // Routing: ties in the biased score (repeated logits, zero bias) and a NaN must pick the CPU's
    // experts in the CPU's order on any adapter.
    for renormalize in [true, false] {
        let (n, e, k) = (4usize, 37usize, 8usize);
        let mut logits: Vec<f32> = rng.vec(n * e).iter().map(|v| v * 4.0).collect();
        for r in 0..n {
            for j in 0..e / 3 {
                logits[r * e + 3 * j + 1] = logits[r * e + 3 * j];
            }
        }
        logits[5] = f32::NAN;
        let bias: Vec<f32> = (0..e).map(|j| if j % 4 == 0 { 0.0 } else { 0.01 * (j % 7) as f32 }).collect();
        let rule = RouteRule { k, renormalize, scaling: 2.5 };
        let (mut ea, mut eb) = (vec![0u32; n * k], vec![0u32; n * k]);
        let (mut wa, mut wb) = (vec![0f32; n * k], vec![0f32; n * k]);
        g.route_top_k(&logits, &bias, rule, &mut ea, &mut wa).unwrap();
        cpu.route_top_k(&logits, &bias, rule, &mut eb, &mut wb).unwrap();
        assert_eq!(ea, eb, "routing: the CPU's experts in router order");
        check(&g, &format!("route weights (renormalize {renormalize})"), &wa, &wb, TOL);
    }
    // Argmax: ties (first index wins), NaN never wins, all-NaN gives 0.
    let mut logits = rng.vec(70_001);
    logits[123] = 5.0;
    logits[40_000] = 5.0;
    logits[7] = f32::NAN;
    assert_eq!(g.argmax(&logits).unwrap(), cpu.argmax(&logits).unwrap());
    assert_eq!(g.argmax(&logits).unwrap(), 123);
    assert_eq!(g.argmax(&[f32::NAN, f32::NAN, 1.0, 1.0]).unwrap(), 2);
    assert_eq!(g.argmax(&[f32::NAN; 3]).unwrap(), 0);
    // KDA recurrence: update from a start state, then replay; small and K3's head size.
    for (nh, n, dk, dv) in [(3usize, 5usize, 16usize, 12usize), (2, 3, 128, 128)] {
        let heads: Vec<HeadIn> = (0..nh)
            .map(|_| {
                let unit = |v: Vec<f32>| -> Vec<f32> {
                    v.chunks(dk)
                        .flat_map(|c| {
                            let norm = c.iter().map(|x| x * x).sum::<f32>().sqrt();
                            c.iter().map(move |x| x / norm).collect::<Vec<_>>()
                        })
                        .collect()
                };
                HeadIn {
                    q: unit(rng.vec(n * dk)),
                    k: unit(rng.vec(n * dk)),
                    v: rng.vec(n * dv),
                    g: rng.vec(n * dk).iter().map(|x| -2.5 * (x + 1.0)).collect(),
                    beta: rng.vec(n).iter().map(|x| 0.5 + 0.4 * x).collect(),
                }
            })
            .collect();
        let s0 = StateBuf::from(rng.vec(nh * dk * dv));
        let (mut sa, mut sb) = (StateBuf::zeros(s0.len()), StateBuf::zeros(s0.len()));
        let (mut oa, mut ob) = (vec![0f32; nh * n * dv], vec![0f32; nh * n * dv]);
        g.kda_update(&s0, &mut sa, &heads, dk, dv, &mut oa, false).unwrap();
        cpu.kda_update(&s0, &mut sb, &heads, dk, dv, &mut ob, false).unwrap();
        assert!(sa.on_device(), "the GPU's state stays in device memory");
        check(&g, &format!("kda_update state dk {dk}"), &sa.host_values().unwrap(), &sb.host_values().unwrap(), TOL);
        check(&g, &format!("kda_update outputs dk {dk}"), &oa, &ob, TOL);
        // A second step from the resident state into a buffer that was used before (as decode
        // does with its spare): the state neither goes up nor comes back, only the rows and o.
        let (mut sa2, mut sb2) = (StateBuf::zeros(s0.len()), StateBuf::zeros(s0.len()));
        let before = g.device_traffic();
        g.kda_update(&s0, &mut sa2, &heads, dk, dv, &mut oa, false).unwrap();
        let from_host = g.device_traffic().since(before);
        g.kda_update(&sa, &mut sa2, &heads, dk, dv, &mut oa, false).unwrap();
        let step = g.device_traffic().since(before).since(from_host);
        cpu.kda_update(&sb, &mut sb2, &heads, dk, dv, &mut ob, false).unwrap();
        let state_bytes = 4 * s0.len() as u64;
        assert_eq!(step.readback_bytes, 4 * oa.len() as u64, "only o comes back: {step:?}");
        assert_eq!(
            step.upload_bytes + state_bytes,
            from_host.upload_bytes,
            "the resident state is not uploaded: {step:?} vs {from_host:?}"
        );
        assert!(step.resident_state_bytes >= 2 * state_bytes);
        check(
            &g,
            &format!("kda_update from a resident state dk {dk}"),
            &sa2.host_values().unwrap(),
            &sb2.host_values().unwrap(),
            TOL,
        );
        check(&g, &format!("kda_update outputs from a resident state dk {dk}"), &oa, &ob, TOL);
        // Replay from the host and from a resident state, with rows that carry no q (as a
        // commit's do); the CPU backend reads a resident state through the host.
        let no_q: Vec<HeadIn> = heads.iter().map(|x| HeadIn { q: Vec::new(), ..x.clone() }).collect();
        let (mut ra, mut rb) = (StateBuf::zeros(s0.len()), StateBuf::zeros(s0.len()));
        g.kda_replay(&s0, &mut ra, &no_q, dk, dv).unwrap();
        cpu.kda_replay(&s0, &mut rb, &no_q, dk, dv).unwrap();
        assert!(ra.on_device(), "the replayed state stays in device memory");
        check(&g, &format!("kda_replay state dk {dk}"), &ra.host_values().unwrap(), &rb.host_values().unwrap(), TOL);
        assert_eq!(bits(&ra.host_values().unwrap()), bits(&sa.host_values().unwrap()));
        let mut rd = StateBuf::zeros(s0.len());
        g.kda_update(&s0, &mut rd, &heads, dk, dv, &mut oa, false).unwrap();
        let (mut re, mut rc) = (StateBuf::zeros(s0.len()), StateBuf::zeros(s0.len()));
        g.kda_replay(&rd, &mut re, &no_q, dk, dv).unwrap();
        cpu.kda_replay(&sa, &mut rc, &no_q, dk, dv).unwrap();
        assert!(rd.on_device() && re.on_device());
        check(
            &g,
            &format!("kda_replay of a resident state dk {dk}"),
            &re.host_values().unwrap(),
            &rc.host_values().unwrap(),
            TOL,
        );
        let (mut on_cpu, mut from_host) = (StateBuf::zeros(s0.len()), StateBuf::zeros(s0.len()));
        cpu.kda_update(&sa, &mut on_cpu, &heads, dk, dv, &mut ob, false).unwrap();
        let sa_host = StateBuf::from(sa.host_values().unwrap().into_owned());
        cpu.kda_update(&sa_host, &mut from_host, &heads, dk, dv, &mut oa, false).unwrap();
        assert_eq!(
            bits(&on_cpu.host_values().unwrap()),
            bits(&from_host.host_values().unwrap()),
            "the CPU reads a GPU state"
        );
    }
    // MLA core: causal over a cache, and every row seeing every token; small and K3's widths.
    for d in [
        MlaDims { heads: 3, nope: 16, rope: 8, lora: 40, v_head: 16 },
        MlaDims { heads: 2, nope: 128, rope: 64, lora: 512, v_head: 128 },
    ] {
        let rows = d.heads * (d.nope + d.v_head);
        let wbytes: Vec<u8> = (0..rows * d.lora).flat_map(|_| half::bf16::from_f32(rng.f32()).to_le_bytes()).collect();
        let kv_b = Bf16Mat::from_vec(wbytes, rows, d.lora);
        let (past, n) = (6usize, 3usize);
        let lat = d.lora + d.rope;
        let mut cache = AppendBuf::from(rng.vec((past + n) * lat).iter().map(|v| v * 2.0).collect::<Vec<f32>>());
        let q = rng.vec(n * d.heads * (d.nope + d.rope));
        for visible in [Visible::Causal, Visible::All] {
            let (mut a, mut b) = (vec![0f32; n * d.heads * d.v_head], vec![0f32; n * d.heads * d.v_head]);
            g.mla_attention_with(&q, &cache, past, &kv_b, d, 0.2, visible, &mut a).unwrap();
            cpu.mla_attention_with(&q, &cache, past, &kv_b, d, 0.2, visible, &mut b).unwrap();
            check(&g, &format!("mla {visible:?} lora {}", d.lora), &a, &b, TOL);
        }
        // Decode steps on the mirrored cache: one row appended each, past the mirror's first
        // capacity; then a rollback (truncation) and other rows in their place.
        let q1 = rng.vec(d.heads * (d.nope + d.rope));
        let (mut a, mut b) = (vec![0f32; d.heads * d.v_head], vec![0f32; d.heads * d.v_head]);
        for step in 0..60 {
            if step == 50 {
                cache.truncate((past + n + 40) * lat);
            }
            let tokens = cache.len() / lat;
            cache.extend_from_slice(&rng.vec(lat));
            let before = g.device_traffic();
            g.mla_attention_with(&q1, &cache, tokens, &kv_b, d, 0.2, Visible::Causal, &mut a).unwrap();
            let t = g.device_traffic().since(before);
            cpu.mla_attention_with(&q1, &cache, tokens, &kv_b, d, 0.2, Visible::Causal, &mut b).unwrap();
            check(&g, &format!("mla step {step} lora {}", d.lora), &a, &b, TOL);
            assert_eq!(
                t.upload_bytes,
                4 * (q1.len() + lat) as u64,
                "step {step}: only q and the new row go up ({t:?})"
            );
            assert!(t.resident_state_bytes >= 4 * cache.len() as u64);
        }
    }
}

fn gpu_engine(dir: &std::path::Path) -> std::sync::Arc<Engine> {
    Engine::open(EngineConfig { backend: BackendKind::Gpu, ..test_config(dir, KdaMode::Recurrent) }).unwrap()
}

#[test]
fn fixtures_on_the_gpu_match_the_fp64_reference_with_the_same_greedy_tokens() {
    if gpu().is_none() {
        return;
    }
    // Every operation on the GPU, however small (the fixtures are far below the threshold).
    deltafin::backend::gpu::set_ops_min(0);
    for name in FIXTURES {
        let r = reference(name);
        let e = gpu_engine(&fixture(name));
        assert!(e.startup_line().contains("gpu "), "{}", e.startup_line());
        let logits = score(&e, &r.prompt);
        let (err, row) = max_rel_l2(&logits, &r.logits, r.vocab);
        assert!(err <= 1e-4, "{name}: row {row} relative error {err:.2e}");
        let g = greedy(&e, &r.prompt, 12);
        assert_eq!(g, r.greedy[..12].to_vec(), "{name}: greedy tokens");
        eprintln!("{name}: max relative error {err:.2e} on the GPU, greedy identical");
    }
}

#[test]
fn sequence_state_kept_on_the_gpu_survives_partial_commits_and_forks_with_the_cpus_tokens() {
    let Some(g) = gpu() else { return };
    // Every operation on the GPU, so that the fixture's KDA states and MLA caches live in device memory.
    deltafin::backend::gpu::set_ops_min(0);
    let dir = fixture("k3-tiny-b");
    let r = reference("k3-tiny-b");
    let drive = |e: &std::sync::Arc<Engine>| -> (Vec<f32>, Vec<u32>, u64) {
        let mut s = e.new_session();
        s.prefill(&r.prompt[..20]).unwrap();
        // Five rows verified, two kept: a replay onto the committed (resident) state.
        s.verify(&r.prompt[20..25], &[]).unwrap();
        s.commit(2).unwrap();
        s.verify(&r.prompt[22..24], &[]).unwrap();
        s.commit(0).unwrap();
        let mut f = s.fork().unwrap();
        let mut logits = Vec::new();
        let mut forked = Vec::new();
        for &t in &r.prompt[22..26] {
            logits.extend_from_slice(s.step(t).unwrap());
            forked.extend_from_slice(f.step(t).unwrap());
        }
        assert_eq!(bits(&logits), bits(&forked), "a fork continues with the same bits");
        let opts = deltafin::engine::GenerateOptions { max_new: 6, stop: Vec::new() };
        let tokens = s.generate(&opts, &mut |_| true).unwrap().tokens;
        let resident = e.device_traffic().resident_state_bytes;
        (logits, tokens, resident)
    };
    let cpu = Engine::open(test_config(&dir, KdaMode::Recurrent)).unwrap();
    let on_gpu = gpu_engine(&dir);
    let (gl, gt, resident) = drive(&on_gpu);
    let (cl, ct, _) = drive(&cpu);
    assert!(resident > 0, "the KDA states and MLA caches were kept in device memory");
    assert_eq!(gt, ct, "greedy tokens");
    check(&g, "logits after partial commits and a fork", &gl, &cl, 1e-4);
    assert_eq!(on_gpu.device_traffic().resident_state_bytes, 0, "dropped sessions free their states");
}

#[test]
fn auto_uses_the_cpu_without_a_real_gpu_and_the_cli_takes_backend_gpu() {
    let real = GpuBackend::new(false).is_ok();
    let e = Engine::open(EngineConfig {
        backend: BackendKind::Auto,
        ..test_config(&fixture("k3-tiny-b"), KdaMode::Recurrent)
    })
    .unwrap();
    let line = e.startup_line();
    assert_eq!(line.contains("| gpu "), real, "{line}");
    if gpu().is_none() {
        return;
    }
    let r = reference("k3-tiny-b");
    let ids = ids_arg(&r.prompt[..30]);
    let run = |backend: &str| {
        let mut c = deltafin_cmd();
        c.args(["run", "--model"]).arg(fixture("k3-tiny-b"));
        c.args(["--prompt-ids", &ids, "--max-new", "10", "--ignore-eos", "--format", "json", "--backend", backend]);
        let (out, err) = run_ok(&mut c);
        let j: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        (j["output_ids"].clone(), err)
    };
    let (cpu_ids, _) = run("cpu");
    let (gpu_ids, err) = run("gpu");
    assert_eq!(gpu_ids, cpu_ids);
    assert!(err.contains("| gpu "), "{err}");
    // The same with every operation on the GPU.
    let mut c = deltafin_cmd();
    c.env("DELTAFIN_GPU_OPS_MIN", "0").args(["run", "--model"]).arg(fixture("k3-tiny-b"));
    c.args(["--prompt-ids", &ids, "--max-new", "10", "--ignore-eos", "--format", "json", "--backend", "gpu"]);
    let (out, _) = run_ok(&mut c);
    let j: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(j["output_ids"], cpu_ids, "every op on the GPU");
}

#[test]
fn the_device_expert_cache_changes_no_bit_and_serves_repeated_experts() {
    if gpu().is_none() {
        return;
    }
    let dir = fixture("k3-tiny-b");
    let r = reference("k3-tiny-b");
    let run = |gb: Option<f64>| {
        let config =
            EngineConfig { backend: BackendKind::Gpu, gpu_cache_gb: gb, ..test_config(&dir, KdaMode::Recurrent) };
        let e = Engine::open(config).unwrap();
        let mut s = e.new_session();
        let first: Vec<u32> = s.prefill(&r.prompt[..24]).unwrap().iter().map(|v| v.to_bits()).collect();
        let opts = deltafin::engine::GenerateOptions { max_new: 8, stop: Vec::new() };
        let tokens = s.generate(&opts, &mut |_| true).unwrap().tokens;
        let last: Vec<u32> = s.logits().unwrap().iter().map(|v| v.to_bits()).collect();
        (first, tokens, last, s.stats.reads.device_expert_hits, s.stats.reads.expert_bytes_requested, e)
    };
    let (first, tokens, last, hits, requested, e) = run(None);
    assert_eq!(hits, 0);
    let expert = e.k3_config().expert_bytes() as f64;
    // Every expert fits; then three slots, so that nearly every layer evicts.
    for (gb, what) in [(1.0, "every expert held"), (3.5 * expert / 1e9, "three slots")] {
        let (f, t, l, h, req, e2) = run(Some(gb));
        assert_eq!(f, first, "{what}: prompt logits");
        assert_eq!(t, tokens, "{what}: greedy tokens");
        assert_eq!(l, last, "{what}: last logits");
        assert!(h > 0, "{what}: no expert served from device memory");
        // Experts run from device memory are not fetched from the expert source.
        assert_eq!(req + h * e.k3_config().expert_bytes() as u64, requested, "{what}: bytes fetched");
        assert!(e2.startup_line().contains("expert cache"), "{}", e2.startup_line());
        eprintln!("device expert cache, {what}: {h} experts from device memory, same bits");
    }
    // The slots are allocated when the engine opens (at most one per routed expert), not during
    // the first prompt.
    let config =
        EngineConfig { backend: BackendKind::Gpu, gpu_cache_gb: Some(1.0), ..test_config(&dir, KdaMode::Recurrent) };
    let opened = Engine::open(config).unwrap();
    assert_eq!(opened.device_expert_slots(), opened.k3_config().moe_layers() * opened.k3_config().experts);
    // The CPU backend has no device memory to keep experts in.
    let config = EngineConfig { gpu_cache_gb: Some(1.0), ..test_config(&dir, KdaMode::Recurrent) };
    let err = Engine::open(config).err();
    assert!(
        matches!(&err, Some(EngineError::Setting { setting: Setting::GpuCacheGb, problem, .. }) if problem.contains("gpu or auto")),
        "{err:?}"
    );
}

#[test]
fn several_products_of_one_input_in_one_submission_give_each_products_bits() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(17);
    let mut mat = |rows: usize, cols: usize| random_bf16(&mut rng, rows, cols);
    // Widths not a multiple of 16 (padded rows), one input row (matvec) and several (matmul).
    for (cols, n) in [(333usize, 1usize), (333, 4), (512, 1)] {
        let ws = [mat(37, cols), mat(5, cols), mat(130, cols)];
        let xs = Rng(cols as u64 + n as u64).vec(n * cols);
        let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![0f32; n * w.rows]).collect();
        {
            let mut slices: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
            g.matmul_bf16_many(&ws.iter().collect::<Vec<_>>(), &xs, &mut slices).unwrap();
        }
        for (w, got) in ws.iter().zip(&outs) {
            let mut one = vec![0f32; n * w.rows];
            g.matmul_bf16(w, &xs, &mut one).unwrap();
            assert!(
                got.iter().zip(&one).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{}x{cols} x{n}: one submission differs from the single product",
                w.rows
            );
        }
    }
}

#[test]
fn products_of_their_own_inputs_in_one_submission_give_each_products_bits() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(23);
    let mut mat = |rows: usize, cols: usize| random_bf16(&mut rng, rows, cols);
    // Different widths (one padded), one row (matvec) and several (matmul) in the same call,
    // and an empty input.
    let ws = [mat(37, 333), mat(64, 512), mat(130, 96), mat(9, 48)];
    let rows = [1usize, 4, 1, 0];
    let xs: Vec<Vec<f32>> = ws.iter().zip(rows).map(|(w, n)| Rng(w.cols as u64 + n as u64).vec(n * w.cols)).collect();
    let mut outs: Vec<Vec<f32>> = ws.iter().zip(rows).map(|(w, n)| vec![0f32; n * w.rows]).collect();
    {
        let refs: Vec<&[f32]> = xs.iter().map(|x| x.as_slice()).collect();
        let mut slices: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
        g.matmul_bf16_each(&ws.iter().collect::<Vec<_>>(), &refs, &mut slices).unwrap();
    }
    for ((w, x), got) in ws.iter().zip(&xs).zip(&outs) {
        let mut one = vec![0f32; got.len()];
        g.matmul_bf16(w, x, &mut one).unwrap();
        assert!(
            got.iter().zip(&one).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{}x{} on {} rows: one submission differs from the single product",
            w.rows,
            w.cols,
            x.len() / w.cols
        );
    }
}

#[test]
fn timed_passes_count_device_time_and_change_no_bit() {
    // Every backend is timed when the environment asks for it: nothing untimed to compare with.
    if std::env::var("DELTAFIN_GPU_TIMESTAMPS").is_ok_and(|v| ["1", "true", "yes", "on"].contains(&v.trim())) {
        return;
    }
    let Some(plain) = gpu() else { return };
    deltafin::backend::gpu::set_timestamps(true);
    let timed = GpuBackend::new(true);
    deltafin::backend::gpu::set_timestamps(false);
    let Ok(timed) = timed else { return };
    let mut rng = Rng(31);
    let w = random_bf16(&mut rng, 64, 512);
    let xs = Rng(5).vec(512);
    let (mut a, mut b) = (vec![0f32; 64], vec![0f32; 64]);
    plain.matmul_bf16(&w, &xs, &mut a).unwrap();
    timed.matmul_bf16(&w, &xs, &mut b).unwrap();
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "timed passes changed a product");
    assert_eq!(plain.device_traffic().device_s, 0.0, "untimed passes report device time");
    let ops = timed.op_times();
    let op = ops.iter().find(|o| o.op == "matmul_bf16").expect("the product is in the profile");
    assert_eq!(op.calls, 1);
    assert!(op.seconds > 0.0);
    if timed.describe().contains("timed") {
        assert!(timed.device_traffic().device_s > 0.0, "a timed pass counted no device time");
        assert!(op.device_seconds > 0.0 && op.device_seconds <= op.seconds);
    }
}

/// The kernel microbench is a build feature (`gpu-bench`, off in the shipped binary): `cargo test
/// --release --features gpu-bench --test gpu` runs this.
#[cfg(feature = "gpu-bench")]
#[test]
fn bench_kernels_on_the_gpu_gives_each_kernel_against_its_reference() {
    if gpu().is_none() {
        return;
    }
    // The shipped matmul as a variant of itself: the harness must find its bits equal.
    let variants = std::env::temp_dir().join(format!("deltafin-mm-variants-{}", std::process::id()));
    std::fs::create_dir_all(&variants).unwrap();
    let shipped = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/matmul.wgsl")).unwrap();
    std::fs::write(variants.join("same.wgsl"), &shipped).unwrap();
    // Dispatched for twice the rows per workgroup it covers: half the outputs stay unwritten,
    // which the harness must not take for the shipped kernel's bits.
    std::fs::write(variants.join("half.wgsl"), format!("// rows_per_group: 256\n{shipped}")).unwrap();
    let mut c = deltafin_cmd();
    // Small shapes and one repetition: the record's fields, not the speeds (lavapipe is a CPU).
    c.args(["bench", "kernels", "--backend", "gpu", "--reps", "1", "--matvec-rows", "256", "--rows", "4"]);
    c.arg("--matmul-variants").arg(&variants);
    let (out, _) = run_ok(&mut c);
    let j: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let num = |k: &str| j[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {j}"));
    for k in
        ["mxfp4_matvec_vs_read", "bf16_matvec_vs_read", "mxfp4_matmul_fraction_of_peak", "bf16_matmul_fraction_of_peak"]
    {
        // A product reads its bytes or does its FMAs no faster than the reference kernels.
        let r = num(k);
        assert!(r > 0.0 && r < 1.5, "{k} = {r}: {j}");
    }
    assert!(num("fma_peak_gfma_s") > num("mxfp4_matmul_gmac_s"), "{j}");
    assert_eq!(j["mxfp4_matvec_shape"], serde_json::json!([256, 3584]));
    assert_eq!(j["matmul_variant_same_bits_equal"], true, "{j}");
    assert_eq!(j["matmul_variant_half_bits_equal"], false, "{j}");
    assert_eq!(j["matmul_variant_shipped_bits_equal"], true, "{j}");
    // The residency ladder: both layouts at each size; one buffer per slot references a buffer
    // per expert of a group, the arenas a few.
    let ladder = j["residency"].as_array().unwrap_or_else(|| panic!("residency missing: {j}"));
    assert_eq!(ladder.len(), 10, "{j}");
    for p in ladder {
        let f = |k: &str| p[k].as_f64().unwrap_or_else(|| panic!("{k}: {p}"));
        assert!(f("group_us") > 0.0 && f("submit_us") > 0.0 && f("groups") >= 20.0, "{p}");
        if p["layout"] == "per_expert" {
            assert_eq!((f("buffers"), f("buffers_per_group")), (f("slots"), 16.0_f64.min(f("slots"))), "{p}");
        } else {
            assert!(f("buffers_per_group") <= 2.0 && f("buffers") < f("slots").max(2.0), "{p}");
        }
    }
    std::fs::remove_dir_all(&variants).ok();
}
