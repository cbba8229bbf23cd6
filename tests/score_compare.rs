//! `deltafin score --compare`: llama.cpp's KL-divergence statistics between two models against an
//! independent oracle (tests/reference/compare.py: tiktoken ids, fp64 reference logits, numpy
//! statistics) over several windows; a model against itself (KL 0, full agreement); the table.

mod common;
use common::*;
use serde_json::Value;
use std::path::Path;

const TEXT: &str = "It is a truth universally acknowledged, that a single man in possession of a good \
fortune, must be in want of a wife. However little known the feelings or views of such a man may be on \
his first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families.\n";

fn rel(a: f64, b: f64) -> f64 {
    if a == b { 0.0 } else { (a - b).abs() / b.abs().max(1e-12) }
}

fn synth(dir: &Path, seed: &str, vocab: &str) {
    run_ok(deltafin_cmd().args(["synth", "--out"]).arg(dir).args([
        "--layers",
        "3",
        "--experts",
        "8",
        "--top-k",
        "2",
        "--seed",
        seed,
        "--vocab",
        vocab,
    ]));
}

#[test]
fn compare_matches_the_fp64_reference_and_a_model_matches_itself() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    // Learned merges only, as in tests/score_text.rs: deltafin's encoder and tiktoken agree there.
    let merges = deltafin::model::bpe_train::learn_merges(deltafin::model::bpe_train::TRAINING_TEXT, usize::MAX).len();
    let vocab = (merges + 256).to_string();
    synth(&a, "9", &vocab);
    synth(&b, "10", &vocab);
    let text = tmp.path().join("t.txt");
    std::fs::write(&text, TEXT).unwrap();
    let score = |judged: &Path, base: &str, extra: &[&str]| {
        let mut c = deltafin_cmd();
        c.env("DELTAFIN_CACHE", tmp.path().join("cache")).args(["score", "--model"]).arg(judged);
        c.arg("--text").arg(&text).args(["--window", "16", "--compare", base]).args(extra);
        run_ok(&mut c).0
    };
    let got: Value = serde_json::from_str(&score(&a, b.to_str().unwrap(), &["--format", "json"])).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/compare.py");
    let o = python().arg(script).arg(&a).arg(&b).arg(&text).arg("16").output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let want: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(got["tokens"], want["tokens"]);
    assert!(got["windows"].as_u64().unwrap() >= 3, "several windows: {got}");
    assert_eq!(got["top1_agreement"], want["top1_agreement"], "{got}\n{want}");
    for (k, tol) in [
        ("ppl", 1e-6),
        ("ppl_base", 1e-6),
        ("nll_delta", 1e-5),
        ("kl_mean", 1e-5),
        ("kl_median", 1e-4),
        ("kl_p99", 1e-4),
        ("kl_max", 1e-4),
    ] {
        let (g, w) = (got[k].as_f64().unwrap(), want[k].as_f64().unwrap());
        assert!(rel(g, w) <= tol, "{k}: deltafin {g}, fp64 reference {w} (relative {:e})", rel(g, w));
    }
    assert!(got["kl_mean"].as_f64().unwrap() > 0.01, "two different models differ: {got}");

    // A model against itself, as `bf16` and as a directory: KL 0, full agreement, no NLL change.
    for base in ["bf16", a.to_str().unwrap()] {
        let same: Value = serde_json::from_str(&score(&a, base, &["--format", "json"])).unwrap();
        assert_eq!(same["kl_max"], Value::from(0.0), "{same}");
        assert_eq!(same["top1_agreement"], Value::from(1.0));
        assert_eq!(same["nll_delta"], Value::from(0.0));
        assert_eq!(same["ppl"], same["ppl_base"]);
        assert_eq!(same["ppl"], got["ppl"]);
    }
    // The table says the same.
    let table = score(&a, b.to_str().unwrap(), &[]);
    assert!(table.contains("KL divergence, mean"), "{table}");
    assert!(table.contains(&format!("{:.6}", got["kl_mean"].as_f64().unwrap())), "{table}");
    // --compare needs --text.
    let o = deltafin_cmd().args(["score", "--model"]).arg(&a).args(["--compare", "bf16"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn the_demo_against_itself() {
    let tmp = tempfile::tempdir().unwrap();
    let text = tmp.path().join("t.txt");
    std::fs::write(&text, TEXT).unwrap();
    let (out, _) = run_ok(
        deltafin_cmd()
            .env("DELTAFIN_CACHE", tmp.path().join("cache"))
            .args(["score", "--demo", "--text"])
            .arg(&text)
            .args(["--compare", "bf16", "--format", "json"]),
    );
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (&v["kl_mean"], &v["kl_max"], &v["top1_agreement"]),
        (&Value::from(0.0), &Value::from(0.0), &Value::from(1.0))
    );
    assert_eq!(v["nll_delta"], Value::from(0.0));
}
