//! Unified memory (`backend/gpu/device/uma.rs`): routed experts written once, straight into
//! device-visible memory that the kernels read, give the bits of the staged path (a staging buffer
//! and a copy on the device) and of the CPU, and the counters say which way every byte went. Runs
//! where wgpu finds an adapter that maps storage buffers (CI's lavapipe is a CPU adapter, so unified
//! memory): the batch path at decode and prompt shapes, arenas reused across groups and batches,
//! with the device cache (admitted experts staged, the others in place) and without; the engine
//! through the CLI with `DELTAFIN_GPU_UMA` on and off (the logits of `score`, the tokens of `run`,
//! the stats' byte counts) against `--backend cpu`.
#![cfg(feature = "gpu")]

mod common;
use common::*;
use deltafin::backend::gpu::{GpuBackend, UMA_ENV, UmaMode};
use deltafin::backend::{Backend, CpuBackend, Device, ExpertLayout, Situ, run_expert};
use deltafin::cpu::deinterleave_mxfp4_input;

/// The backend with experts written in place, and one with them staged; None (skipped) where the
/// adapter cannot map storage buffers.
fn pair() -> Option<(GpuBackend, GpuBackend)> {
    let on = match GpuBackend::open(true, UmaMode::On) {
        Ok(g) => g,
        Err(e) => {
            no_gpu("tests/gpu_uma.rs", &e);
            return None;
        }
    };
    if !on.experts_in_place() {
        skipped("tests/gpu_uma.rs", &format!("{} cannot map storage buffers", on.adapter().name));
        return None;
    }
    let off = GpuBackend::open(true, UmaMode::Off).ok()?;
    assert!(!off.experts_in_place());
    assert!(on.describe().contains("experts written in place"), "{}", on.describe());
    Some((on, off))
}

/// A random expert whose records sit at unaligned offsets (3 bytes between them), as in tests/gpu.rs.
fn random_expert(rng: &mut Rng, inter: usize, latent: usize) -> (ExpertLayout, Vec<u8>) {
    let (packed, scales) = (inter * latent / 2, inter * latent / 32);
    let sizes = [packed, scales, packed, scales, packed, scales];
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

fn rows_input(rng: &mut Rng, rows: usize, latent: usize) -> Vec<f32> {
    let x = rng.vec(rows * latent);
    let mut xd = vec![0f32; x.len()];
    for (s, d) in x.chunks(latent).zip(xd.chunks_mut(latent)) {
        deinterleave_mxfp4_input(s, d);
    }
    xd
}

fn shipped(l: &ExpertLayout) -> u64 {
    l.parts.iter().map(|&(_, n)| n as u64).sum()
}

/// Runs `experts` on `inputs` as one batch of `g`; the outputs, the (staged, in place) bytes and
/// the submissions.
fn batch(g: &GpuBackend, layout: &ExpertLayout, situ: Situ, experts: &[Vec<u8>], inputs: &[Vec<f32>]) -> Out {
    let before = g.device_traffic();
    let mut b = g.expert_batch(3, layout, situ);
    for (i, (e, zd)) in experts.iter().zip(inputs).enumerate() {
        b.add(i as u32, e, zd).unwrap();
    }
    let outs = b.finish().unwrap();
    let t = g.device_traffic().since(before);
    (outs, t.expert_staged_bytes, t.expert_in_place_bytes, t.submissions)
}

type Out = (Vec<Vec<f32>>, u64, u64, u64);

#[test]
fn experts_written_in_place_give_the_staged_bits_and_the_cpus_and_stage_no_byte() {
    let Some((on, off)) = pair() else { return };
    eprintln!("{} (fma fused: {})", on.describe(), on.fma_is_fused());
    let mut rng = Rng(41);
    // 37 experts (two full groups and a part: arenas filled, submitted, mapped again and reused),
    // decode rows (one each: the image matvecs) and prompt rows (0, 1, 3, 6: a product per
    // dispatch), a 3584-wide latent (the matvec's tiled path).
    let cases = [((96usize, 64usize), [1usize, 1, 1, 1]), ((64, 3584), [1; 4]), ((96, 64), [0, 1, 3, 6])];
    for ((inter, latent), rows) in cases {
        let situ = Situ { beta: 4.0, linear_beta: 25.0 };
        // Twice, other experts the second time: a reused arena must hold the new images.
        for round in 0..2 {
            let experts: Vec<(ExpertLayout, Vec<u8>)> =
                (0..37).map(|_| random_expert(&mut rng, inter, latent)).collect();
            let layout = experts[0].0.clone();
            let bytes: Vec<Vec<u8>> = experts.into_iter().map(|(_, b)| b).collect();
            let inputs: Vec<Vec<f32>> = (0..37).map(|i| rows_input(&mut rng, rows[i % 4], latent)).collect();
            let run = inputs.iter().filter(|x| !x.is_empty()).count() as u64;
            let what = format!("{inter}x{latent}, rows {rows:?}, round {round}");
            // Groups of 16 queued experts (those without rows are not queued): one submission each.
            let groups = run.div_ceil(16);
            let (got, staged, in_place, subs) = batch(&on, &layout, situ, &bytes, &inputs);
            assert_eq!((staged, in_place), (0, run * shipped(&layout)), "{what}: in place, nothing staged");
            assert_eq!(subs, groups, "{what}: in place, no copy submitted per expert");
            let (want, staged, in_place, subs) = batch(&off, &layout, situ, &bytes, &inputs);
            assert_eq!((staged, in_place), (run * shipped(&layout), 0), "{what}: all staged");
            assert_eq!(subs, groups + run, "{what}: staged, a copy submitted per expert");
            let (mut same_cpu, mut total) = (0, 0);
            for (i, (b, zd)) in bytes.iter().zip(&inputs).enumerate() {
                assert_eq!(bits(&got[i]), bits(&want[i]), "{what}, expert {i}: in place differs from staged");
                let c = run_expert(&CpuBackend, &layout, b, situ, zd).unwrap();
                assert_eq!(got[i].len(), c.len(), "{what}, expert {i}");
                let (err, _) = max_rel_l2(&got[i], &c, latent);
                assert!(err < 1e-5, "{what}, expert {i}: {err:.2e} from the CPU");
                same_cpu += got[i].iter().zip(&c).filter(|(a, b)| a.to_bits() == b.to_bits()).count();
                total += c.len();
            }
            if on.fma_is_fused() {
                assert_eq!(same_cpu, total, "{what}: fused fma gives the CPU's bits");
            }
        }
    }
}

#[test]
fn with_the_device_cache_admitted_experts_are_staged_and_the_rest_written_in_place_with_the_same_bits() {
    let Some((on, off)) = pair() else { return };
    let (inter, latent) = (64usize, 512usize);
    let mut rng = Rng(43);
    let experts: Vec<(ExpertLayout, Vec<u8>)> = (0..16).map(|_| random_expert(&mut rng, inter, latent)).collect();
    let layout = experts[0].0.clone();
    let slot: u64 = layout.parts.iter().map(|&(_, len)| len.div_ceil(16) as u64 * 16).sum();
    // Seven slots for sixteen experts: each group mixes cache slots and the in-place arena.
    let (on, off) = (on.with_device_cache(slot * 7), off.with_device_cache(slot * 7));
    for g in [&on, &off] {
        g.plan_experts(&layout, 100).unwrap();
        assert_eq!(g.device_expert_slots(), 7);
    }
    let situ = Situ { beta: 4.0, linear_beta: 0.0 };
    let ids: Vec<u32> = (0..16).collect();
    let (mut staged_on, mut in_place_on, mut held_on) = (0, 0, 0);
    for round in 0..3 {
        let inputs: Vec<Vec<f32>> = (0..16).map(|_| rows_input(&mut rng, 1, latent)).collect();
        let mut outs = Vec::new();
        for g in [&on, &off] {
            let before = g.device_traffic();
            let mut b = g.expert_batch(1, &layout, situ);
            let held = b.claim_held(&ids);
            let order: Vec<usize> = (0..16).filter(|&i| held[i]).chain((0..16).filter(|&i| !held[i])).collect();
            for &i in &order {
                if held[i] {
                    b.add_held(i as u32, &inputs[i]).unwrap();
                } else {
                    b.add(i as u32, &experts[i].1, &inputs[i]).unwrap();
                }
            }
            let got = b.finish().unwrap();
            let t = g.device_traffic().since(before);
            let fresh = held.iter().filter(|h| !**h).count() as u64;
            assert_eq!(t.expert_staged_bytes + t.expert_in_place_bytes, fresh * shipped(&layout), "round {round}");
            if std::ptr::eq(g, &on) {
                (staged_on, in_place_on) = (staged_on + t.expert_staged_bytes, in_place_on + t.expert_in_place_bytes);
                held_on += 16 - fresh;
            } else {
                assert_eq!(t.expert_in_place_bytes, 0, "round {round}: staged without unified memory");
            }
            // By expert id, whatever came from where.
            let mut by_id = vec![Vec::new(); 16];
            for (q, &i) in order.iter().enumerate() {
                by_id[i] = got[q].clone();
            }
            outs.push(by_id);
        }
        for i in 0..16 {
            let c = run_expert(&CpuBackend, &layout, &experts[i].1, situ, &inputs[i]).unwrap();
            assert_eq!(bits(&outs[0][i]), bits(&outs[1][i]), "round {round}, expert {i}: in place vs staged");
            if on.fma_is_fused() {
                assert_eq!(bits(&outs[0][i]), bits(&c), "round {round}, expert {i}: the CPU's bits");
            }
        }
    }
    assert!(held_on > 0, "no expert ran from the device cache");
    assert!(staged_on > 0 && in_place_on > 0, "staged {staged_on}, in place {in_place_on}: both ways taken");
}

/// The engine through the binary with `DELTAFIN_GPU_UMA` set as given (None: `--backend cpu`):
/// the prompt's logits (`score`), and `run`'s greedy tokens, stats and stderr.
fn engine_run(uma: Option<&str>, prompt: &str, dir: &std::path::Path) -> (Vec<u32>, serde_json::Value, String) {
    let backend = if uma.is_some() { "gpu" } else { "cpu" };
    let out = dir.join(format!("logits-{}.safetensors", uma.unwrap_or("cpu")));
    let mut c = deltafin_cmd();
    c.env(UMA_ENV, uma.unwrap_or("auto")).args(["score", "--model"]).arg(fixture("k3-tiny-b"));
    c.args(["--prompt-ids", prompt, "--backend", backend, "--logits-out"]).arg(&out);
    run_ok(&mut c);
    let (logits, _) = read_f32_tensor(&out, "logits");
    let mut c = deltafin_cmd();
    c.env(UMA_ENV, uma.unwrap_or("auto")).args(["run", "--model"]).arg(fixture("k3-tiny-b"));
    c.args(["--prompt-ids", prompt, "--max-new", "10", "--ignore-eos", "--format", "json", "--backend", backend]);
    let (stdout, stderr) = run_ok(&mut c);
    let j: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    (bits(&logits), j, stderr)
}

#[test]
fn the_engine_with_experts_in_place_gives_the_staged_engines_and_the_cpus_logits_and_tokens() {
    let Some((on_gpu, _)) = pair() else { return };
    let r = reference("k3-tiny-b");
    let prompt = ids_arg(&r.prompt[..30]);
    let tmp = tempfile::tempdir().unwrap();
    let (cpu_logits, cpu, _) = engine_run(None, &prompt, tmp.path());
    let (on_logits, on, on_err) = engine_run(Some("on"), &prompt, tmp.path());
    let (off_logits, off, off_err) = engine_run(Some("off"), &prompt, tmp.path());
    assert!(on_err.contains("experts written in place"), "{on_err}");
    assert!(!off_err.contains("experts written in place"), "{off_err}");
    assert_eq!(on_logits, off_logits, "prompt logits: in place vs staged");
    assert_eq!(on["output_ids"], off["output_ids"], "greedy tokens: in place vs staged");
    assert_eq!(on["output_ids"], cpu["output_ids"], "greedy tokens: GPU vs CPU");
    let same = on_logits.iter().zip(&cpu_logits).filter(|(a, b)| a == b).count();
    eprintln!("engine: {same} of {} prompt logits bit-identical to the CPU's", cpu_logits.len());
    let f = |b: &[u32]| b.iter().map(|&w| f32::from_bits(w)).collect::<Vec<_>>();
    let (err, row) = max_rel_l2(&f(&on_logits), &f(&cpu_logits), r.vocab);
    assert!(err <= 1e-4, "prompt logits: row {row} {err:.2e} from the CPU's");
    if on_gpu.fma_is_fused() {
        assert_eq!(same, cpu_logits.len(), "fused fma: the CPU's logits");
    }
    let n = |j: &serde_json::Value, k: &str| j["stats"][k].as_u64().unwrap_or_else(|| panic!("{k}: {j}"));
    let requested = n(&on, "expert_bytes_requested");
    assert!(requested > 0);
    assert_eq!(n(&on, "expert_bytes_requested"), n(&off, "expert_bytes_requested"));
    // Every routed expert's bytes reach the device once: all in place, or all staged.
    assert_eq!((n(&on, "device_expert_staged_bytes"), n(&on, "device_expert_in_place_bytes")), (0, requested));
    assert_eq!((n(&off, "device_expert_staged_bytes"), n(&off, "device_expert_in_place_bytes")), (requested, 0));
    assert_eq!((n(&cpu, "device_expert_staged_bytes"), n(&cpu, "device_expert_in_place_bytes")), (0, 0));
}
