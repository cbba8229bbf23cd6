//! `deltafin score --text`: the perplexity of a text, against an independent oracle (token ids
//! from Python's tiktoken, logits from the fp64 reference: tests/reference/perplexity.py) over
//! several windows; its text and JSON outputs, standard input, and its errors.

mod common;
use common::*;
use serde_json::Value;
use std::io::Write;
use std::process::Stdio;

const TEXT: &str = "It is a truth universally acknowledged, that a single man in possession of a good \
fortune, must be in want of a wife. However little known the feelings or views of such a man may be on \
his first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding \
families, that he is considered the rightful property of some one or other of their daughters. \
Caf\u{e9} na\u{ef}ve \u{2014} 42 \u{20ac}.\n";

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs()
}

#[test]
fn perplexity_matches_the_fp64_reference_over_several_windows() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    // A vocabulary of learned merges only, as a trained BPE tokenizer has: synth's filler tokens
    // past them are not BPE-ordered (" go" ranks before "go"), and on those deltafin's encoder and
    // tiktoken disagree, which would make the two sides score different ids.
    let merges = deltafin::model::bpe_train::learn_merges(deltafin::model::bpe_train::TRAINING_TEXT, usize::MAX).len();
    let vocab = (merges + 256).to_string();
    run_ok(deltafin_cmd().args(["synth", "--out"]).arg(&dir).args([
        "--layers",
        "3",
        "--experts",
        "8",
        "--top-k",
        "2",
        "--seed",
        "9",
        "--vocab",
        &vocab,
    ]));
    let text = tmp.path().join("t.txt");
    std::fs::write(&text, TEXT).unwrap();
    let score = |window: &str, extra: &[&str]| {
        let mut c = deltafin_cmd();
        c.env("DELTAFIN_CACHE", tmp.path().join("cache")).args(["score", "--model"]).arg(&dir);
        c.arg("--text").arg(&text).args(["--window", window]).args(extra);
        run_ok(&mut c).0
    };
    let got: Value = serde_json::from_str(&score("24", &["--format", "json"])).unwrap();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/perplexity.py");
    let o = python().arg(script).arg(&dir).arg(&text).arg("24").output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let want: Value = serde_json::from_slice(&o.stdout).unwrap();
    let n_ids = want["ids"].as_array().unwrap().len();
    assert_eq!(got["tokens"], want["tokens"], "every token after BOS is predicted once");
    assert_eq!(got["tokens"].as_u64().unwrap() as usize, n_ids - 1);
    assert!(got["windows"].as_u64().unwrap() >= 3, "several windows: {got}");
    assert_eq!(got["windows"], want["windows"]);
    assert_eq!(got["bytes"].as_u64().unwrap() as usize, TEXT.len());
    for k in ["ppl", "bits_per_byte"] {
        let (g, w) = (got[k].as_f64().unwrap(), want[k].as_f64().unwrap());
        assert!(rel(g, w) <= 1e-6, "{k}: deltafin {g}, fp64 reference {w} (relative {:e})", rel(g, w));
    }
    // The summary says the same; standard input gives the same numbers.
    let summary = score("24", &[]);
    assert!(summary.starts_with(&format!("perplexity {:.4}", got["ppl"].as_f64().unwrap())), "{summary}");
    let mut child = deltafin_cmd()
        .env("DELTAFIN_CACHE", tmp.path().join("cache"))
        .args(["score", "--model"])
        .arg(&dir)
        .args(["--text", "-", "--window", "24", "--format", "json"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(TEXT.as_bytes()).unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success());
    let stdin: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(stdin["ppl"], got["ppl"]);

    // A window wider than the text: one window, the same tokens.
    let one: Value = serde_json::from_str(&score("100000", &["--format", "json"])).unwrap();
    assert_eq!((&one["windows"], &one["tokens"]), (&Value::from(1), &got["tokens"]));

    // Errors: an empty text (nothing to predict) and a window of 0 (usage).
    let empty = tmp.path().join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let o = deltafin_cmd().args(["score", "--model"]).arg(&dir).arg("--text").arg(&empty).output().unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("the text is empty"));
    let o = deltafin_cmd()
        .args(["score", "--model"])
        .arg(&dir)
        .arg("--text")
        .arg(&text)
        .args(["--window", "0"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
}
