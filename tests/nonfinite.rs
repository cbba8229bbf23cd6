//! Weights that make NaN or infinity never give an answer: an expert scale byte of 0xFF (E8M0's
//! NaN) in a copy of a fixture, embedding rows set to NaN or infinity, and `synth --embed-scale
//! 1e30` (every value overflows) fail the step with an error naming the layer, the tensors and the
//! position, and leave the session as it was — through the library (CPU, and the GPU backend where
//! wgpu finds an adapter: CI's lavapipe), `run`, `score` (logits and `--text`), `batch` (error
//! records) and `serve` (a 500 in OpenAI's error shape; a stream ends with an error event, never
//! `"\u0000"` tokens). Before, every logit was NaN, the ids came out 0,0,0 and the exit code was 0.

mod common;
use common::served::Served;
use common::*;
use deltafin::engine::{Engine, EngineConfig};
use deltafin::k3::finite::Site;
use deltafin::k3::{ForwardError, KdaMode};
use std::path::Path;
use std::sync::Arc;

/// The routed expert of layer 1 the corrupted copies break (one the fixture's prompt routes to).
const EXPERT: u32 = 8;

/// Sets byte `at` of tensor `name` in the safetensors shards of `dir` to `value`.
fn set_tensor_byte(dir: &Path, name: &str, at: usize, value: u8) {
    for e in std::fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_none_or(|x| x != "safetensors") {
            continue;
        }
        let mut b = std::fs::read(&path).unwrap();
        let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        let h: serde_json::Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
        if let Some(t) = h.get(name) {
            let start = t["data_offsets"][0].as_u64().unwrap() as usize;
            b[8 + n + start + at] = value;
            std::fs::write(&path, b).unwrap();
            return;
        }
    }
    panic!("no tensor {name} in {}", dir.display());
}

/// A copy of k3-tiny-a whose layer-1 expert [`EXPERT`] has a w1 scale byte of 0xFF.
fn nan_expert_copy() -> tempfile::TempDir {
    let tmp = copy_fixture("k3-tiny-a");
    let name = format!("language_model.model.layers.1.block_sparse_moe.experts.{EXPERT}.w1.weight_scale");
    set_tensor_byte(tmp.path(), &name, 0, 0xFF);
    // Made so on purpose: the NaN is what the engine must find, not a checksum mismatch.
    rerecord(tmp.path());
    tmp
}

/// A copy of k3-tiny-a whose embedding rows of tokens 7 and 9 are NaN and infinity.
fn bad_rows_copy() -> tempfile::TempDir {
    let tmp = copy_fixture("k3-tiny-a");
    let h = open_model(tmp.path()).cfg.hidden;
    let mut changed = 0;
    for e in std::fs::read_dir(tmp.path()).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_some_and(|x| x == "safetensors") {
            changed += edit_bf16_tensors(&path, &|n| n.ends_with("embed_tokens.weight"), &mut |_, i, x| match i / h {
                7 => f32::NAN,
                9 if i % h == 3 => f32::INFINITY,
                _ => x,
            });
        }
    }
    assert_eq!(changed, 1);
    rerecord(tmp.path());
    tmp
}

fn prompt() -> Vec<u32> {
    reference("k3-tiny-a").prompt[..32].to_vec()
}

fn non_finite(e: &ForwardError) -> (Site, usize) {
    match e {
        ForwardError::NonFinite { site, pos, value, .. } => {
            assert!(!value.is_finite(), "{e}");
            (*site, *pos)
        }
        other => panic!("expected a non-finite error, got: {other}"),
    }
}

/// The checks of a NaN expert on engine `e` (whatever its backend).
fn a_nan_expert_fails_the_prefill_and_names_it(e: &Arc<Engine>) {
    let p = prompt();
    let mut s = e.new_session();
    let err = s.prefill(&p).unwrap_err();
    let (site, pos) = non_finite(&err);
    assert_eq!(site, Site::Expert(1, EXPERT), "{err}");
    assert!(pos < p.len());
    let msg = err.to_string();
    assert!(msg.contains("layer 1's routed expert 8") && msg.contains("layers.1.block_sparse_moe.experts.8."), "{msg}");
    assert!(msg.contains("NaN") && msg.contains(&format!("position {pos}")), "{msg}");
    assert_eq!((s.pos(), s.tokens().len(), s.logits().is_none()), (0, 0, true), "nothing kept");
    // Prompt rows before the first bad one run and generate (the expert is not theirs).
    if pos > 1 {
        s.prefill(&p[..pos]).unwrap();
        assert!(s.logits().unwrap().iter().all(|x| x.is_finite()));
    }
}

#[test]
fn a_nan_expert_scale_fails_the_step_naming_layer_and_expert_on_the_cpu() {
    let m = nan_expert_copy();
    a_nan_expert_fails_the_prefill_and_names_it(&engine(m.path()));
    // Chunked prefill: all or nothing.
    let e = Engine::open(EngineConfig { prefill_rows: 4, ..test_config(m.path(), KdaMode::Recurrent) }).unwrap();
    let mut s = e.new_session();
    let (site, _) = non_finite(&s.prefill(&prompt()).unwrap_err());
    assert_eq!(site, Site::Expert(1, EXPERT));
    assert_eq!((s.pos(), s.logits().is_none()), (0, true));
}

#[cfg(feature = "gpu")]
#[test]
fn a_nan_expert_scale_fails_the_step_naming_layer_and_expert_on_the_gpu() {
    use deltafin::backend::BackendKind;
    use deltafin::backend::gpu::{GpuBackend, set_ops_min};
    if let Err(e) = GpuBackend::new(true) {
        no_gpu("tests/nonfinite.rs", &e);
        return;
    }
    // Every operation on the GPU, the experts included: each reads its result back.
    set_ops_min(0);
    let m = nan_expert_copy();
    let cfg = EngineConfig { backend: BackendKind::Gpu, ..test_config(m.path(), KdaMode::Recurrent) };
    a_nan_expert_fails_the_prefill_and_names_it(&Engine::open(cfg.clone()).unwrap());
    // Experts held in device memory (run from there, not from landed bytes) too.
    let held = Engine::open(EngineConfig { gpu_cache_gb: Some(0.5), ..cfg }).unwrap();
    a_nan_expert_fails_the_prefill_and_names_it(&held);
    a_nan_expert_fails_the_prefill_and_names_it(&held);
}

#[test]
fn a_bad_embedding_row_fails_its_step_at_its_position_and_the_session_goes_on() {
    let m = bad_rows_copy();
    let e = engine(m.path());
    let mut s = e.new_session();
    s.prefill(&[1, 2, 3]).unwrap();
    let before = (s.pos(), s.tokens().to_vec(), bits(s.logits().unwrap()));
    for (bad, what) in [(7u32, "NaN"), (9, "inf")] {
        let err = s.step(bad).unwrap_err();
        assert_eq!(non_finite(&err), (Site::Embedding, 3), "{err}");
        assert!(err.to_string().contains(what) && err.to_string().contains("embed_tokens"), "{err}");
        assert_eq!((s.pos(), s.tokens().to_vec(), bits(s.logits().unwrap())), before, "the failed step kept nothing");
    }
    // A prompt holding the bad token fails at its place; a generation that would emit it stops.
    let mut t = e.new_session();
    let err = t.prefill(&[1, 2, 7, 4]).unwrap_err();
    assert_eq!(non_finite(&err), (Site::Embedding, 2));
    s.step(4).unwrap();
    let clean = engine(&fixture("k3-tiny-a"));
    let mut c = clean.new_session();
    c.prefill(&[1, 2, 3, 4]).unwrap();
    assert_eq!(bits(s.logits().unwrap()), bits(c.logits().unwrap()), "the session goes on as the clean model's");
    // Two sessions in one forward: the bad one fails the pass and both are as before.
    let (mut a, mut b) = (e.new_session(), e.new_session());
    a.prefill(&[5]).unwrap();
    b.prefill(&[6, 5]).unwrap();
    let err = e.forward_sessions(&mut [&mut a, &mut b], &[&[4], &[9]]).unwrap_err();
    let (site, pos) = non_finite(&err);
    assert_eq!((site, pos), (Site::Embedding, 2), "{err}");
    assert_eq!((a.pos(), b.pos()), (1, 2));
}

/// A synth model (tokenizer and chat template included) whose embeddings are scaled by 1e30: every
/// value overflows in the first layer.
fn overflowing_model() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    run_ok(deltafin_cmd().args(["synth", "--out"]).arg(&dir).args([
        "--layers",
        "3",
        "--experts",
        "8",
        "--top-k",
        "2",
        "--embed-scale",
        "1e30",
    ]));
    tmp
}

fn fails(c: &mut std::process::Command, needles: &[&str]) -> (String, String) {
    let o = c.output().unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned());
    assert_eq!(o.status.code(), Some(1), "exit code; stdout:\n{out}\nstderr:\n{err}");
    assert!(!err.contains("panicked"), "{err}");
    for n in needles {
        assert!(err.contains(n), "stderr should mention `{n}`:\n{err}");
    }
    (out, err)
}

#[test]
fn run_and_score_exit_with_the_error_and_print_no_result() {
    let m = nan_expert_copy();
    let ids = ids_arg(&prompt());
    let (out, _) = fails(
        deltafin_cmd().args(["run", "--model"]).arg(m.path()).args(["--prompt-ids", &ids, "--max-new", "4"]),
        &["layer 1's routed expert 8", "non-finite value (NaN)"],
    );
    assert!(out.trim().is_empty(), "no ids printed: {out:?}");
    let logits = m.path().join("logits.safetensors");
    fails(
        deltafin_cmd()
            .args(["score", "--model"])
            .arg(m.path())
            .args(["--prompt-ids", &ids, "--logits-out"])
            .arg(&logits),
        &["layer 1's routed expert 8"],
    );
    assert!(!logits.exists(), "no logits written");
    // Overflow, not a damaged byte: named at layer 0's attention; perplexity is never printed.
    let o = overflowing_model();
    let dir = o.path().join("m");
    let text = o.path().join("t.txt");
    std::fs::write(&text, "A few words to score.").unwrap();
    let (out, err) = fails(
        deltafin_cmd().args(["score", "--model"]).arg(&dir).arg("--text").arg(&text),
        &["layer 0's attention", "non-finite"],
    );
    assert!(!out.to_lowercase().contains("nan") && !out.contains("perplexity"), "{out}\n{err}");
    fails(
        deltafin_cmd().args(["run", "--model"]).arg(&dir).args(["--prompt", "Hello", "--max-new", "3"]),
        &["non-finite"],
    );
}

#[test]
fn batch_writes_an_error_record_for_each_request() {
    let o = overflowing_model();
    let (input, output) = (o.path().join("in.jsonl"), o.path().join("out.jsonl"));
    std::fs::write(
        &input,
        "{\"id\": \"a\", \"prompt\": \"Hi\", \"max_tokens\": 3}\n{\"id\": 2, \"prompt\": [1, 2, 3]}\n",
    )
    .unwrap();
    let _ = deltafin_cmd()
        .args(["batch", "--model"])
        .arg(o.path().join("m"))
        .arg("--in")
        .arg(&input)
        .arg("--out")
        .arg(&output)
        .output()
        .unwrap();
    let text = std::fs::read_to_string(&output).unwrap();
    let recs: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(recs.len(), 2, "{text}");
    for r in &recs {
        let msg = r["error"]["message"].as_str().unwrap_or_else(|| panic!("an error record: {r}"));
        assert!(msg.contains("non-finite") && msg.contains("layer 0"), "{r}");
        assert!(r.get("text").is_none() && r.get("choices").is_none(), "{r}");
    }
}

#[test]
fn serve_answers_500_and_streams_end_with_an_error_event() {
    let o = overflowing_model();
    let dir = o.path().join("m");
    let s = Served::start(&["--model", dir.to_str().unwrap(), "--model-name", "m", "--memory-gb", "2", "-q"]);
    let (status, body) = s.post("/v1/completions", r#"{"model":"m","prompt":"Hi","max_tokens":4}"#);
    assert_eq!(status, 500, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["type"], "server_error", "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("non-finite") && msg.contains("layer 0's attention"), "{msg}");
    for (path, body) in [
        ("/v1/completions", r#"{"model":"m","prompt":"Hi","max_tokens":4,"stream":true}"#),
        (
            "/v1/chat/completions",
            r#"{"model":"m","messages":[{"role":"user","content":"Hi"}],"max_tokens":4,"stream":true}"#,
        ),
    ] {
        let (status, events) = s.post(path, body);
        assert_eq!(status, 200, "{events}");
        assert!(!events.contains("\\u0000") && !events.contains("[DONE]"), "{events}");
        let last = events.lines().rfind(|l| l.starts_with("data: ")).unwrap_or_else(|| panic!("{events}"));
        let v: serde_json::Value = serde_json::from_str(&last["data: ".len()..]).unwrap();
        assert!(v["error"]["message"].as_str().unwrap().contains("non-finite"), "{v}");
    }
    let (status, body, _) = s.get("/health");
    assert_eq!(status, 200, "the server is fine: {body}");
}
