//! The engine's output bits, pinned: the logits at every position of each fixture's prompt (both
//! KDA forms), of the trained demo model's and of its int8 trunk's, hashed (xxh3-64 of the f32
//! bits), and their greedy continuations, against tests/fixtures/isa_bits.json, written on x86-64.
//! The fixed reduction order gives the same bits on every instruction set, so the same pins hold
//! for scalar, AVX2, AVX-512 and NEON, on Linux and on macOS: `.ci/aarch64.sh` runs this file under
//! qemu-user for aarch64 and the macOS workflow on Apple Silicon. The fp64 tests (exactness.rs,
//! trained.rs) bound the error against the reference; this one says a port changed no bit.
//!
//! A change that moves the bits on purpose pins them again, on x86-64 only:
//! `DELTAFIN_PIN_BITS=1 cargo test --release --test isa_bits` (it prints what moved).

mod common;
use common::*;
use deltafin::engine::{Engine, EngineConfig};
use deltafin::k3::KdaMode;
use deltafin::k3::weights::Trunk;
use serde_json::{Map, Value, json};
use std::path::{Path, PathBuf};

fn pins_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/isa_bits.json")
}

fn demo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("demo/kimi-k3-demo")
}

fn trained_prompt() -> Vec<u32> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/trained/fixture.json");
    let j: Value = serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap();
    j["prompt_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// xxh3-64 of the bits of `v`, as 16 hex digits.
fn hash(v: &[f32]) -> String {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect();
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes))
}

/// The pin of one engine on one prompt: the hash of its logits at every position (a prefill in
/// chunks: the matrix-matrix kernels), and `new` greedy tokens (decode: the matrix-vector ones).
fn pin(config: EngineConfig, prompt: &[u32], new: usize) -> Value {
    let e = Engine::open(config).unwrap();
    json!({"logits_xxh3": hash(&score(&e, prompt)), "greedy": greedy(&e, prompt, new)})
}

/// Every pinned case, computed here.
fn computed() -> Map<String, Value> {
    let mut m = Map::new();
    for name in FIXTURES {
        let r = reference(name);
        for (mode, label) in [(KdaMode::Recurrent, "recurrent"), (KdaMode::Chunked, "chunked")] {
            m.insert(format!("{name}/{label}"), pin(test_config(&fixture(name), mode), &r.prompt, 8));
        }
    }
    let prompt = trained_prompt();
    let trained = || test_config(&demo(), KdaMode::Recurrent);
    m.insert("trained/bf16".into(), pin(trained(), &prompt, 8));
    m.insert("trained/int8".into(), pin(EngineConfig { trunk: Trunk::Int8, ..trained() }, &prompt, 8));
    m
}

#[test]
fn output_bits_equal_the_x86_pins() {
    let got = computed();
    if std::env::var("DELTAFIN_PIN_BITS").is_ok_and(|v| v == "1") {
        assert_eq!(
            std::env::consts::ARCH,
            "x86_64",
            "the pins are x86-64's: DELTAFIN_PIN_BITS=1 writes them there only"
        );
        let old: Map<String, Value> = std::fs::read(pins_path())
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .and_then(|v| v["pins"].as_object().cloned())
            .unwrap_or_default();
        for (k, v) in &got {
            if old.get(k) != Some(v) {
                println!("pin {k}: {} -> {v}", old.get(k).map_or("(none)".into(), Value::to_string));
            }
        }
        // One line per pin, so a re-pin's diff names the cases that moved.
        let lines: Vec<String> = got.iter().map(|(k, v)| format!("    {}: {v}", Value::from(k.as_str()))).collect();
        let body = format!(
            "{{\n  \"written_by\": \"DELTAFIN_PIN_BITS=1 cargo test --release --test isa_bits (x86-64)\",\n  \"isa\": \"{}\",\n  \"pins\": {{\n{}\n  }}\n}}\n",
            deltafin::cpu::isa().name(),
            lines.join(",\n")
        );
        std::fs::write(pins_path(), body).unwrap();
        return;
    }
    let pins: Value = serde_json::from_slice(&std::fs::read(pins_path()).unwrap()).unwrap();
    let want = pins["pins"].as_object().unwrap();
    assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "the pinned cases");
    let moved: Vec<String> = got
        .iter()
        .filter(|(k, v)| want.get(*k) != Some(v))
        .map(|(k, v)| format!("{k}: {v}, pinned {}", want[k]))
        .collect();
    assert!(
        moved.is_empty(),
        "output bits on {} ({}) differ from the pins written on x86-64 ({}):\n{}",
        std::env::consts::ARCH,
        deltafin::cpu::isa().name(),
        pins["isa"],
        moved.join("\n")
    );
}
