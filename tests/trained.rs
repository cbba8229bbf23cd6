//! The trained demo model (demo/kimi-k3-demo, made by train/): deltafin's logits at every position
//! of held-out text against the training code's own fp32 forward pass and against the independent
//! fp64 reference (tests/fixtures/trained, written by train/make_fixture.py), identical greedy
//! tokens, and its DSpark drafter: drafts accepted and output ids identical to drafting off.

mod common;
use common::*;
use deltafin::draft::Speculator;
use deltafin::engine::{Engine, EngineConfig, GenerateOptions};
use deltafin::k3::KdaMode;
use std::path::PathBuf;
use std::sync::Arc;

/// Tolerance of the f32 engine: relative L2 error per position (as for the fp64 fixtures).
const REL_TOL: f64 = 1e-4;

fn demo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("demo/kimi-k3-demo")
}

fn demo_dspark() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("demo/kimi-k3-demo-dspark")
}

fn trained_fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/trained")
}

fn fixture_json() -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(trained_fixture().join("fixture.json")).unwrap()).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn trained_logits_match_the_training_forward_and_the_fp64_reference() {
    let j = fixture_json();
    let prompt = ids(&j["prompt_ids"]);
    let file = trained_fixture().join("logits.safetensors");
    let (torch, shape) = read_f32_tensor(&file, "torch_logits");
    let (reference, _) = read_f32_tensor(&file, "reference_logits");
    let vocab = shape[1];
    assert_eq!(shape[0], prompt.len());
    for mode in [KdaMode::Recurrent, KdaMode::Chunked] {
        let got = score(&Engine::open(test_config(&demo(), mode)).unwrap(), &prompt);
        for (name, want) in [("training forward (fp32)", &torch), ("fp64 reference", &reference)] {
            let (err, row) = max_rel_l2(&got, want, vocab);
            println!("trained model ({mode:?}) vs {name}: max relative L2 {err:.3e} at position {row}");
            assert!(err <= REL_TOL, "{mode:?} vs {name}: relative error {err:.3e} at position {row}");
        }
    }
    let e = engine(&demo());
    let g = greedy(&e, &prompt, ids(&j["torch_greedy"]).len());
    assert_eq!(g, ids(&j["torch_greedy"]), "greedy tokens differ from the training forward's");
    assert_eq!(g, ids(&j["reference_greedy"]), "greedy tokens differ from the fp64 reference's");
}

fn plain(e: &Arc<Engine>, prompt: &[u32], max_new: usize) -> Vec<u32> {
    let mut s = e.new_session();
    s.prefill(prompt).unwrap();
    s.generate(&GenerateOptions { max_new, stop: Vec::new() }, &mut |_| true).unwrap().tokens
}

#[test]
fn trained_drafter_gets_drafts_accepted_and_changes_no_id() {
    let j = fixture_json();
    let prompt = ids(&j["prompt_ids"]);
    let e = Engine::open(EngineConfig { draft_model: Some(demo_dspark()), ..test_config(&demo(), KdaMode::Recurrent) })
        .unwrap();
    let (mut proposed, mut accepted) = (0, 0);
    for p in [&prompt[..40], &prompt[..], &prompt[70..]] {
        let want = plain(&e, p, 48);
        let d = Box::new(deltafin::draft::DSparkDrafter::new(std::sync::Arc::clone(e.dspark_model().unwrap())));
        let mut spec = Speculator::without_cost_model(d);
        let mut s = e.new_session();
        s.prefill_with(p, &mut spec).unwrap();
        let g = s
            .generate_speculative(&GenerateOptions { max_new: 48, stop: Vec::new() }, &mut spec, &mut |_| true)
            .unwrap();
        assert_eq!(g.tokens, want, "drafting changed the output");
        proposed += s.stats.drafts.proposed;
        accepted += s.stats.drafts.accepted;
    }
    let rate = accepted as f64 / proposed as f64;
    println!("trained drafter: {accepted} of {proposed} drafts accepted ({rate:.3})");
    // Behaviour, not speed: a trained drafter gets a good share of its drafts accepted (a random one
    // gets almost none). The figure on held-out prompts is bench/trained.py's. (0.25: the drafter of
    // 2026-12-07 is distilled on sampled text, not on greedy loops, and gets 0.28 on these greedy
    // continuations; the one before, trained on greedy loops, got more here and less on prose.)
    assert!(rate >= 0.25, "acceptance {rate:.3}");
}

#[test]
fn score_text_equals_the_training_scripts_perplexity() {
    let j = fixture_json();
    let want = &j["score"];
    let window = want["window"].as_u64().unwrap().to_string();
    let text = trained_fixture().join(want["file"].as_str().unwrap());
    let (out, _) = run_ok(
        deltafin_cmd()
            .args(["score", "--model"])
            .arg(demo())
            .arg("--text")
            .arg(&text)
            .args(["--window", &window, "--format", "json"]),
    );
    let got: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(got["tokens"], want["tokens"], "predicted tokens");
    for key in ["ppl", "bits_per_byte"] {
        let (g, w) = (got[key].as_f64().unwrap(), want[key].as_f64().unwrap());
        let rel = (g - w).abs() / w;
        println!("score --text {key}: deltafin {g:.6}, training script {w:.6} (relative difference {rel:.1e})");
        assert!(rel <= 1e-3, "{key}: deltafin {g}, training script {w}");
    }
}
