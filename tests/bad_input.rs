//! Bad model directories: every case must exit non-zero with a message naming the file and the
//! tensor or field, before any compute.

mod common;
use common::*;
use serde_json::{Map, Value};
use std::path::Path;

/// Rewrites a safetensors file's header with `edit`, keeping the data bytes.
fn edit_header(path: &Path, edit: impl FnOnce(&mut Map<String, Value>)) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(&mut header);
    let mut h = serde_json::to_vec(&header).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(path, out).unwrap();
}

/// The shard file holding `tensor`, from the index.
fn shard_of(dir: &Path, tensor: &str) -> String {
    let idx: Value = serde_json::from_slice(&std::fs::read(dir.join("model.safetensors.index.json")).unwrap()).unwrap();
    idx["weight_map"][tensor].as_str().unwrap().to_string()
}

fn edit_json(path: &Path, edit: impl FnOnce(&mut Value)) {
    let mut v: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
}

/// Runs `score` on `dir`; asserts exit code 1 and that stderr contains every `needle`.
fn expect_failure(dir: &Path, needles: &[&str]) {
    let out = deltafin_cmd()
        .args(["score", "--model"])
        .arg(dir)
        .args(["--prompt-ids", "1,2,3", "--logits-out"])
        .arg(dir.join("out.safetensors"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "expected exit code 1; stderr:\n{err}");
    for n in needles {
        assert!(err.contains(n), "stderr should mention `{n}`:\n{err}");
    }
    assert!(!dir.join("out.safetensors").exists(), "no output may be written on failure");
}

const A: &str = "k3-tiny-a";
const QB: &str = "language_model.model.layers.2.self_attn.q_b_proj.weight";
const QPROJ: &str = "language_model.model.layers.1.self_attn.q_proj.weight";

#[test]
fn missing_tensor() {
    let tmp = copy_fixture(A);
    let shard = shard_of(tmp.path(), QPROJ);
    edit_header(&tmp.path().join(&shard), |h| {
        let v = h.remove(QPROJ).unwrap();
        h.insert(format!("{QPROJ}_renamed"), v);
    });
    edit_json(&tmp.path().join("model.safetensors.index.json"), |v| {
        v["weight_map"].as_object_mut().unwrap().remove(QPROJ);
    });
    expect_failure(tmp.path(), &["missing tensor", QPROJ]);
}

#[test]
fn tensor_listed_in_index_but_absent_from_shard() {
    let tmp = copy_fixture(A);
    let shard = shard_of(tmp.path(), QPROJ);
    edit_header(&tmp.path().join(&shard), |h| {
        let v = h.remove(QPROJ).unwrap();
        h.insert(format!("{QPROJ}_renamed"), v);
    });
    expect_failure(tmp.path(), &[&shard, QPROJ]);
}

#[test]
fn wrong_shape() {
    let tmp = copy_fixture(A);
    let shard = shard_of(tmp.path(), QB);
    edit_header(&tmp.path().join(&shard), |h| {
        let shape = h[QB]["shape"].as_array_mut().unwrap();
        shape.reverse();
    });
    expect_failure(tmp.path(), &[&shard, QB, "shape [32, 96]", "expected [96, 32]"]);
}

#[test]
fn wrong_dtype() {
    let tmp = copy_fixture(A);
    let shard = shard_of(tmp.path(), QB);
    edit_header(&tmp.path().join(&shard), |h| h[QB]["dtype"] = Value::from("F16"));
    expect_failure(tmp.path(), &[&shard, QB, "dtype F16", "expected BF16"]);
}

#[test]
fn wrong_expert_shape() {
    let tmp = copy_fixture(A);
    let name = "language_model.model.layers.3.block_sparse_moe.experts.5.w2.weight_packed";
    let shard = shard_of(tmp.path(), name);
    edit_header(&tmp.path().join(&shard), |h| h[name]["shape"] = serde_json::json!([16, 32]));
    expect_failure(tmp.path(), &[&shard, name, "expected [32, 16]"]);
}

#[test]
fn truncated_shard() {
    let tmp = copy_fixture(A);
    let path = tmp.path().join("model-00002-of-00003.safetensors");
    let len = std::fs::metadata(&path).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(len - 1000).unwrap();
    expect_failure(tmp.path(), &["model-00002-of-00003.safetensors", "truncated", &format!("{len} bytes")]);
}

#[test]
fn missing_shard() {
    let tmp = copy_fixture(A);
    std::fs::remove_file(tmp.path().join("model-00003-of-00003.safetensors")).unwrap();
    expect_failure(tmp.path(), &["model-00003-of-00003.safetensors"]);
}

#[test]
fn malformed_config_json() {
    let tmp = copy_fixture(A);
    let p = tmp.path().join("config.json");
    let text = std::fs::read_to_string(&p).unwrap();
    std::fs::write(&p, &text[..text.len() / 2]).unwrap();
    expect_failure(tmp.path(), &["config.json", "malformed JSON"]);
}

#[test]
fn missing_config_field() {
    let tmp = copy_fixture(A);
    edit_json(&tmp.path().join("config.json"), |v| {
        v["text_config"].as_object_mut().unwrap().remove("hidden_size");
    });
    expect_failure(tmp.path(), &["config.json", "text_config.hidden_size", "missing"]);
}

#[test]
fn inconsistent_config_top_k() {
    let tmp = copy_fixture(A);
    edit_json(&tmp.path().join("config.json"), |v| v["text_config"]["num_experts_per_token"] = Value::from(99));
    expect_failure(tmp.path(), &["config.json", "text_config.num_experts_per_token", "more than num_experts"]);
}

#[test]
fn inconsistent_config_layer_lists() {
    let tmp = copy_fixture(A);
    edit_json(&tmp.path().join("config.json"), |v| {
        v["text_config"]["linear_attn_config"]["kda_layers"] = serde_json::json!([1, 2, 3, 4, 5]);
    });
    expect_failure(tmp.path(), &["config.json", "layer 3 is listed twice"]);
}

#[test]
fn wrong_quantization() {
    let tmp = copy_fixture(A);
    edit_json(&tmp.path().join("config.json"), |v| {
        v["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = Value::from(16);
    });
    expect_failure(tmp.path(), &["config.json", "quantization_config.config_groups.group_0.weights", "group_size 32"]);
}

#[test]
fn config_disagrees_with_checkpoint() {
    let tmp = copy_fixture(A);
    edit_json(&tmp.path().join("config.json"), |v| v["text_config"]["vocab_size"] = Value::from(1000));
    expect_failure(tmp.path(), &["embed_tokens.weight", "expected [1000, 64]", "lm_head.weight"]);
}

#[test]
fn token_outside_vocabulary_is_a_runtime_error() {
    let dir = fixture(A);
    let out = deltafin_cmd()
        .args(["run", "--model"])
        .arg(&dir)
        .args(["--prompt-ids", "1,99999", "--max-new", "2"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("token id 99999 at position 1 is outside the vocabulary"), "{err}");
}

#[test]
fn usage_errors_exit_with_2() {
    let dir = fixture(A);
    let out = deltafin_cmd().args(["run", "--model"]).arg(&dir).args(["--prompt-ids", "1,x"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("`x` is not a token id"));
    let out = deltafin_cmd().args(["run", "--bogus"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
}

/// `run` on `model` with a text prompt and with token ids: both must fail with the same first
/// message (the fix one suggests must not lead to a second error), exit 1.
fn run_both(model: &Path) -> String {
    let mut first = None;
    for prompt in [&["--prompt", "Hello"][..], &["--prompt-ids", "1,2,3"]] {
        let o = deltafin_cmd().args(["run", "--model"]).arg(model).args(prompt).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(o.status.code(), Some(1), "{prompt:?}: {err}");
        assert!(!err.contains("tiktoken.model: text prompts"), "{prompt:?}: {err}");
        match &first {
            None => first = Some(err),
            Some(f) => assert_eq!(&err, f, "{prompt:?}"),
        }
    }
    first.unwrap_or_default()
}

#[test]
fn a_model_path_that_is_not_a_model_says_what_it_is() {
    let tmp = tempfile::tempdir().unwrap();
    // Nothing there.
    let err = run_both(&tmp.path().join("nope"));
    assert!(err.contains("nope: no such directory") && err.contains("deltafin setup --dir"), "{err}");
    // A file, and a model's own file: its directory is named.
    let f = tmp.path().join("notes.txt");
    std::fs::write(&f, "hi").unwrap();
    let err = run_both(&f);
    assert!(err.contains("notes.txt: is a file, not a model directory"), "{err}");
    let m = copy_fixture(A);
    let err = run_both(&m.path().join("config.json"));
    assert!(err.contains(&format!("its directory is one: --model {}", m.path().display())), "{err}");
    // A directory without config.json; one whose model is a level down.
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let err = run_both(&empty);
    assert!(err.contains("empty: not a model directory: it has no config.json"), "{err}");
    let outer = tmp.path().join("outer");
    std::fs::create_dir(&outer).unwrap();
    let err = run_both(&outer.join("..").join("outer"));
    assert!(err.contains("no config.json"), "{err}");
    std::os::unix::fs::symlink(m.path(), outer.join("k3")).unwrap();
    let err = run_both(&outer);
    assert!(err.contains(&format!("the model seems to be in {}", outer.join("k3").display())), "{err}");
    // A config.json that is not K3's.
    let other = tmp.path().join("other");
    std::fs::create_dir(&other).unwrap();
    std::fs::write(other.join("config.json"), r#"{"model_type": "llama", "hidden_size": 4096}"#).unwrap();
    let err = run_both(&other);
    assert!(err.contains("other: not a Kimi K3 model"), "{err}");
}
