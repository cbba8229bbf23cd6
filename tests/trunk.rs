//! The trunk encodings (`--trunk bf16|coded|int8`, `deltafin pack-trunk`): coded products
//! bit-identical to bf16 on every instruction set; logits of the coded trunk bit-identical to the
//! bf16 trunk's on the fixtures and the trained demo model; the pack's resumability, checksum and
//! model identity; int8 labelled not exact wherever it is printed, and refused on the GPU.

mod common;
use common::*;
use deltafin::backend::coded::CodedMat;
use deltafin::backend::{Bf16Mat, int8::Int8Mat};
use deltafin::cpu::*;
use deltafin::engine::{Engine, EngineConfig};
use deltafin::k3::KdaMode;
use deltafin::k3::weights::Trunk;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// bf16 values shaped like trained weights (a spread of exponents, some far out, some zeros).
fn trained_like(rng: &mut Rng, n: usize) -> Vec<u8> {
    (0..n)
        .flat_map(|_| {
            let g = (rng.f32() + rng.f32() + rng.f32() - 1.5) * 0.05;
            let x = match rng.below(200) {
                0 => 0.0,
                1 => g * 1e-6,
                2 => g * 300.0,
                _ => g,
            };
            half::bf16::from_f32(x).to_le_bytes()
        })
        .collect()
}

#[test]
fn coded_products_are_bit_identical_to_bf16_on_every_isa() {
    let mut rng = Rng(7);
    for &(rows, cols) in &[(1, 1), (5, 17), (9, 33), (16, 64), (13, 100), (33, 257), (70, 1000), (7, 1300)] {
        let w = trained_like(&mut rng, rows * cols);
        let b = Bf16Mat::from_vec(w.clone(), rows, cols);
        let c = Bf16Mat::coded(Arc::new(CodedMat::encode(&w, rows, cols)));
        if cols >= 1000 {
            assert!(c.byte_len() * 100 < b.byte_len() * 73, "{rows}x{cols}: {} vs {}", c.byte_len(), b.byte_len());
        }
        for n in [1, 3, 9] {
            let x = rng.vec(n * cols);
            for isa in Isa::available() {
                let (mut want, mut got) = (vec![0f32; n * rows], vec![0f32; n * rows]);
                matmul_bf16_isa(isa, &b, &x, &mut want);
                matmul_bf16_isa(isa, &c, &x, &mut got);
                assert_eq!(bits(&got), bits(&want), "{rows}x{cols}, {n} rows, {isa:?}");
            }
        }
        let mut row = vec![0f32; cols];
        let mut want = vec![0f32; cols];
        c.decode_row(rows - 1, &mut row);
        b.decode_row(rows - 1, &mut want);
        assert_eq!(bits(&row), bits(&want));
    }
}

#[test]
fn int8_products_are_the_same_bits_on_every_isa() {
    let mut rng = Rng(8);
    let (rows, cols) = (37, 300);
    let w = trained_like(&mut rng, rows * cols);
    let q = Bf16Mat::int8(Arc::new(Int8Mat::quantize(&w, rows, cols)));
    let x = rng.vec(4 * cols);
    let mut want = vec![0f32; 4 * rows];
    matmul_bf16_isa(Isa::Scalar, &q, &x, &mut want);
    for isa in Isa::available() {
        for n in [1, 4] {
            let mut got = vec![0f32; n * rows];
            matmul_bf16_isa(isa, &q, &x[..n * cols], &mut got);
            assert_eq!(bits(&got), bits(&want[..n * rows]), "{isa:?}, {n} rows");
        }
    }
}

/// A model directory whose files link to `src`'s, so a coded trunk can be written beside them.
fn linked(src: &Path, tmp: &Path) -> PathBuf {
    let dir = tmp.join(src.file_name().unwrap());
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::os::unix::fs::symlink(e.path(), dir.join(e.file_name())).unwrap();
        }
    }
    dir
}

fn pack(dir: &Path) -> Value {
    let (out, _) = run_ok(deltafin_cmd().args(["pack-trunk", "--json", "--model"]).arg(dir));
    serde_json::from_str(&out).unwrap()
}

fn open(dir: &Path, trunk: Trunk) -> Result<Arc<Engine>, deltafin::engine::EngineError> {
    Engine::open(EngineConfig { trunk, ..test_config(dir, KdaMode::Recurrent) })
}

fn demo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("demo/kimi-k3-demo")
}

#[test]
fn coded_logits_are_bit_identical_on_the_fixtures_and_the_trained_model() {
    let tmp = tempfile::tempdir().unwrap();
    for src in [fixture("k3-tiny-a"), fixture("k3-tiny-b"), fixture("k3-tiny-c"), demo()] {
        let dir = linked(&src, tmp.path());
        let report = pack(&dir);
        // 11 bits a value, a byte per escape, and per-row overheads that weigh on the tiny
        // fixtures' short rows; the trained model's trunk within the 72%.
        let ratio = report["ratio"].as_f64().unwrap();
        let most = if src == demo() { 0.72 } else { 0.9 };
        assert!(ratio > 0.65 && ratio < most, "{report}");
        let (bf16, coded) = (open(&dir, Trunk::Bf16).unwrap(), open(&dir, Trunk::Auto).unwrap());
        assert_eq!(coded.trunk(), Trunk::Coded, "auto takes the coded trunk when there is one");
        let prompt: Vec<u32> = (0..24u32).map(|i| (i * 37 + 5) % bf16.k3_config().vocab as u32).collect();
        assert_eq!(bits(&score(&coded, &prompt)), bits(&score(&bf16, &prompt)), "{}", src.display());
        assert_eq!(greedy(&coded, &prompt[..5], 6), greedy(&bf16, &prompt[..5], 6));
        // The memory plan counts the coded size.
        assert!(
            (coded.plan().trunk as f64) < (most + 0.02) * bf16.plan().trunk as f64,
            "{} vs {}",
            coded.plan().trunk,
            bf16.plan().trunk
        );
    }
}

#[test]
fn the_gpu_backend_runs_a_coded_trunk_with_the_bf16_bits() {
    if let Err(e) = deltafin::backend::gpu::GpuBackend::new(true) {
        return no_gpu("tests/trunk.rs", &e);
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = linked(&fixture("k3-tiny-a"), tmp.path());
    pack(&dir);
    let gpu = |trunk| {
        let c = EngineConfig {
            trunk,
            backend: deltafin::backend::BackendKind::Gpu,
            ..test_config(&dir, KdaMode::Recurrent)
        };
        Engine::open(c).unwrap()
    };
    // The device holds the decoded bf16, so its products are those of the bf16 trunk.
    let prompt = [1u32, 5, 9, 13, 2, 7];
    assert_eq!(bits(&score(&gpu(Trunk::Coded), &prompt)), bits(&score(&gpu(Trunk::Bf16), &prompt)));
}

#[test]
fn the_pack_resumes_and_is_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = linked(&fixture("k3-tiny-a"), tmp.path());
    let first = pack(&dir);
    assert!(first["files_written"].as_u64().unwrap() >= 2);
    // A second run keeps every whole file.
    let again = pack(&dir);
    assert_eq!(
        (again["files_written"].as_u64(), again["files_kept"].clone()),
        (Some(0), first["files_written"].clone())
    );
    // A damaged file is an error naming it; pack-trunk rewrites just that one.
    let f = dir.join("trunk-coded/L1.dftc");
    let mut b = std::fs::read(&f).unwrap();
    let n = b.len();
    b[n - 3] ^= 0x40;
    std::fs::write(&f, &b).unwrap();
    let e = open(&dir, Trunk::Coded).err().expect("a damaged coded trunk is refused").to_string();
    assert!(e.contains("L1.dftc") && e.contains("checksum"), "{e}");
    assert_eq!(pack(&dir)["files_written"].as_u64(), Some(1));
    open(&dir, Trunk::Coded).unwrap();
    // Another model's coded trunk is refused by its fingerprint.
    let other = linked(&fixture("k3-tiny-b"), tmp.path());
    std::fs::create_dir_all(other.join("trunk-coded")).unwrap();
    for e in std::fs::read_dir(dir.join("trunk-coded")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), other.join("trunk-coded").join(e.file_name())).unwrap();
    }
    let e = open(&other, Trunk::Auto).err().expect("a foreign coded trunk is refused").to_string();
    assert!(e.contains("another model"), "{e}");
    // --trunk coded without a pack says how to make one.
    let plain = linked(&fixture("k3-tiny-c"), tmp.path());
    let e = open(&plain, Trunk::Coded).err().unwrap().to_string();
    assert!(e.contains("pack-trunk"), "{e}");
}

#[test]
fn int8_is_labelled_not_exact_and_cpu_only() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixture("k3-tiny-a");
    let stats = tmp.path().join("stats.json");
    let (out, err) = run_ok(
        deltafin_cmd()
            .env("DELTAFIN_CACHE", tmp.path().join("cache"))
            .args(["run", "--model"])
            .arg(&dir)
            .args(["--prompt-ids", "1,2,3", "--max-new", "2", "--trunk", "int8", "--format", "json", "--stats-json"])
            .arg(&stats),
    );
    assert!(err.contains("trunk int8 [NOT EXACT"), "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (&v["engine_config"]["trunk"], &v["stats"]["exact"]),
        (&Value::from("int8"), &Value::from(false)),
        "{v}"
    );
    let s: Value = serde_json::from_slice(&std::fs::read(&stats).unwrap()).unwrap();
    assert_eq!((&s["trunk"], &s["exact"]), (&Value::from("int8"), &Value::from(false)));
    // bf16 is exact and says so.
    let (out, _) = run_ok(deltafin_cmd().args(["run", "--model"]).arg(&dir).args([
        "--prompt-ids",
        "1,2,3",
        "--max-new",
        "2",
        "--format",
        "json",
    ]));
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!((&v["stats"]["trunk"], &v["stats"]["exact"]), (&Value::from("bf16"), &Value::from(true)));
    // Not on the GPU.
    let e = open_gpu_int8(&dir);
    assert!(e.contains("int8") && e.contains("CPU"), "{e}");
}

fn open_gpu_int8(dir: &Path) -> String {
    let c = EngineConfig {
        trunk: Trunk::Int8,
        backend: deltafin::backend::BackendKind::Gpu,
        ..test_config(dir, KdaMode::Recurrent)
    };
    Engine::open(c).err().map(|e| e.to_string()).unwrap_or_default()
}

#[test]
fn the_k3_plan_for_128_gb() {
    let (out, _) = run_ok(deltafin_cmd().args(["plan", "--memory-gb", "128", "--json"]));
    let v: Value = serde_json::from_str(&out).unwrap();
    let plans = v["plans"].as_array().unwrap();
    let get = |t: &str| plans.iter().find(|p| p["trunk"] == t).unwrap();
    let (bf16, coded, int8) = (get("bf16"), get("coded"), get("int8"));
    let tb = |p: &Value| p["trunk_bytes"].as_f64().unwrap();
    // K3's trunk is about 57B values: 107-114 GB in bf16 (K3.md).
    assert!(tb(bf16) > 107e9 && tb(bf16) < 116e9, "{bf16}");
    assert!(tb(coded) < 0.72 * tb(bf16) && tb(coded) > 0.68 * tb(bf16), "{coded}");
    assert!(tb(int8) < 0.51 * tb(bf16), "{int8}");
    assert_eq!((&int8["exact"], &coded["exact"]), (&Value::from(false), &Value::from(true)));
    // The coded trunk leaves room for a cache, and the cache lowers the decode bound.
    let cache = |p: &Value| p["expert_cache_bytes"].as_f64().unwrap();
    assert!(cache(coded) > cache(bf16) + 20e9, "{coded} vs {bf16}");
    let bound = |p: &Value, i: usize| p["decode_s_per_token"][i][1].as_f64().unwrap();
    assert!(bound(coded, 0) < bound(bf16, 0));
    assert!(bound(coded, 1) < bound(coded, 0), "more drives, lower bound");
    // The table names the encodings and marks int8.
    let (table, _) = run_ok(deltafin_cmd().args(["plan", "--memory-gb", "128"]));
    assert!(table.contains("int8 (NOT EXACT)") && table.contains("coded"), "{table}");
}
