//! Text in, text out: the built-in demo on a fresh cache, `synth` output checked by the loader and
//! by the independent fp64 reference, prompts from flags, files and stdin, chat mode, output
//! formats, counters, and exit codes.

mod common;
use common::*;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

fn deltafin(cache: &Path) -> Command {
    let mut c = deltafin_cmd();
    c.env("DELTAFIN_CACHE", cache);
    c
}

/// `run --format json -q` with a fixed seed (the demo's defaults may sample).
fn json_run(cache: &Path, args: &[&str]) -> serde_json::Value {
    let (out, _) = run_ok(deltafin(cache).args(["run", "--format", "json", "-q", "--seed", "1"]).args(args));
    serde_json::from_str(&out).unwrap()
}

/// The demo model's directory under `cache` (which demo depends on how the binary was built).
fn demo_dir(cache: &Path) -> std::path::PathBuf {
    cache.join(deltafin::demo::model_name())
}

#[test]
fn demo_works_on_a_fresh_machine_and_says_whether_it_is_random() {
    let cache = tempfile::tempdir().unwrap();
    let args = ["run", "--demo", "--prompt", "Hello", "--max-new", "12", "--seed", "1"];
    let (out, err) = run_ok(deltafin(cache.path()).args(args));
    assert!(err.contains("creating the demo checkpoint"), "{err}");
    let random = deltafin::model::synth::is_synthetic(&demo_dir(cache.path()));
    assert_eq!(err.contains("RANDOM weights"), random, "{err}");
    assert!(err.contains("context <="), "startup line: {err}");
    assert!(!out.trim().is_empty());
    // Second run reuses the checkpoint and gives the same text.
    let (out2, err2) = run_ok(deltafin(cache.path()).args(args));
    assert!(!err2.contains("creating the demo checkpoint"));
    assert_eq!(out, out2);
}

#[test]
fn synth_writes_the_shipped_layout_and_matches_the_fp64_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    run_ok(deltafin_cmd().args(["synth", "--out"]).arg(&dir).args([
        "--layers",
        "4",
        "--experts",
        "16",
        "--top-k",
        "4",
        "--hidden",
        "64",
        "--vocab",
        "768",
        "--expert-inter",
        "64",
        "--expert-latent",
        "32",
        "--kda-heads",
        "2",
        "--head-dim",
        "16",
        "--mla-heads",
        "2",
        "--block",
        "2",
        "--mla-every",
        "2",
        "--dense-inter",
        "96",
        "--shard-gb",
        "0.0005",
    ]));
    for f in [
        "config.json",
        "model.safetensors.index.json",
        "tiktoken.model",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        assert!(dir.join(f).exists(), "{f} missing");
    }
    let shards = std::fs::read_dir(&dir)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().ends_with(".safetensors"))
        .count();
    assert!(shards >= 2, "expected several shards, got {shards}");
    // Refuses to overwrite without --force.
    let o = deltafin_cmd().args(["synth", "--out"]).arg(&dir).output().unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("already exists"));

    // Logits for a short prompt, engine vs the independent reference.
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 500).collect();
    let out = tmp.path().join("l.safetensors");
    run_ok(
        deltafin_cmd()
            .args(["score", "--model"])
            .arg(&dir)
            .args(["--prompt-ids", &ids_arg(&prompt), "--logits-out"])
            .arg(&out),
    );
    let err = reference_rel_error(&dir, &prompt, &out);
    assert!(err < 1e-4, "synth model: relative error vs fp64 reference {err}");
}

#[test]
fn synth_is_deterministic() {
    let tmp = tempfile::tempdir().unwrap();
    for d in ["a", "b"] {
        synth_small(&tmp.path().join(d), None);
    }
    for e in std::fs::read_dir(tmp.path().join("a")).unwrap() {
        let name = e.unwrap().file_name();
        if name == ".deltafin-checksums.json" {
            continue; // the checksum record names each file's identity on this disk (inode, time)
        }
        assert!(
            std::fs::read(tmp.path().join("a").join(&name)).unwrap()
                == std::fs::read(tmp.path().join("b").join(&name)).unwrap(),
            "{name:?} differs"
        );
    }
}

#[test]
fn prompt_from_flag_file_and_stdin_agree() {
    let cache = tempfile::tempdir().unwrap();
    let text = "Grüße, 世界! 😀 The experts are read once.";
    let a = json_run(cache.path(), &["--demo", "--prompt", text, "--max-new", "4"]);
    let f = cache.path().join("p.txt");
    std::fs::write(&f, text).unwrap();
    let b = json_run(cache.path(), &["--demo", "--prompt-file", f.to_str().unwrap(), "--max-new", "4"]);
    let mut child = deltafin(cache.path())
        .args(["run", "--demo", "--prompt-file", "-", "--max-new", "4", "--format", "json", "-q", "--seed", "1"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success());
    let c: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(a["prompt_ids"], b["prompt_ids"]);
    assert_eq!(a["prompt_ids"], c["prompt_ids"]);
    assert_eq!(a["output_ids"], c["output_ids"]);
    assert!(a["text"].is_string());
}

#[test]
fn chat_mode_uses_the_template_and_text_output_is_the_decoded_ids() {
    let cache = tempfile::tempdir().unwrap();
    // synth's own chat template (the demo preset), whatever demo the binary carries.
    let dir = cache.path().join("m");
    run_ok(deltafin_cmd().args(["synth", "--out"]).arg(&dir));
    let v = json_run(
        cache.path(),
        &[
            "--model",
            dir.to_str().unwrap(),
            "--chat",
            "--prompt",
            "Hi <|open|> there",
            "--thinking",
            "low",
            "--max-new",
            "8",
            "--ignore-eos",
        ],
    );
    let ids: Vec<u32> = v["prompt_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    let tok = deltafin::model::tokenizer::Tokenizer::load(&dir, None).unwrap();
    let rendered = tok.decode(&ids).unwrap();
    assert!(
        rendered.contains("<|open|>message role=\"user\"<|sep|>Hi <|open|> there<|close|>message<|sep|><|end_of_msg|>"),
        "{rendered}"
    );
    assert!(rendered.ends_with("<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>"), "{rendered}");
    // Only the template's specials: thinking-effort message (5) + user message (5) + generation prompt (4).
    assert_eq!(ids.iter().filter(|&&i| tok.is_special(i)).count(), 14);
    // A chat answer shows no special token: the thinking channel is `reasoning`, the response
    // channel `text` (tests/chat_cli.rs checks this on long outputs).
    let (text, reasoning) = (v["text"].as_str().unwrap(), v["reasoning"].as_str().unwrap());
    for tag in ["<|", "[BOS]", "[EOS]"] {
        assert!(!text.contains(tag) && !reasoning.contains(tag), "{v}");
    }
    // Without --chat, streamed text equals decoding the output ids (reserved specials carry no
    // text), less an unfinished character at the very end (never shown).
    let v = json_run(
        cache.path(),
        &["--model", dir.to_str().unwrap(), "--prompt-ids", &ids_arg(&ids), "--max-new", "8", "--ignore-eos"],
    );
    let out: Vec<u32> = v["output_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    let visible: Vec<u8> =
        out.iter().filter(|&&i| !tok.is_reserved(i)).flat_map(|&i| tok.token_bytes(i).unwrap().to_vec()).collect();
    assert_eq!(v["text"].as_str().unwrap(), String::from_utf8_lossy(without_unfinished_tail(&visible)));
}

/// `b` without an unfinished UTF-8 character at its end: the last character's start (the last
/// byte that is not a continuation byte, within four of the end) begins a sequence cut short.
fn without_unfinished_tail(b: &[u8]) -> &[u8] {
    let start = (b.len().saturating_sub(4)..b.len()).rev().find(|&i| b[i] & 0xC0 != 0x80);
    match start {
        Some(i) if std::str::from_utf8(&b[i..]).is_err_and(|e| e.valid_up_to() == 0 && e.error_len().is_none()) => {
            &b[..i]
        }
        _ => b,
    }
}

#[test]
fn stats_are_printed_and_written() {
    let cache = tempfile::tempdir().unwrap();
    let sj = cache.path().join("stats.json");
    let (_, err) = run_ok(
        deltafin(cache.path())
            .args(["run", "--demo", "--prompt", "Hello", "--max-new", "5", "--ignore-eos", "--stats", "--stats-json"])
            .arg(&sj),
    );
    for name in [
        "expert_bytes_requested",
        "layer_passes",
        "read_wait_s",
        "expert_kernel_s",
        "attention_s",
        "router_s",
        "ttft_s",
        "decode_tok_s",
        "peak_rss_bytes",
    ] {
        assert!(err.contains(name), "--stats lacks {name}:\n{err}");
    }
    let j: serde_json::Value = serde_json::from_slice(&std::fs::read(&sj).unwrap()).unwrap();
    let moe_layers = deltafin::model::K3Config::load(&demo_dir(cache.path())).unwrap().moe_layers();
    assert_eq!(j["layer_passes"], moe_layers * 5, "each MoE layer: prompt pass + 4 decode steps");
    assert!(j["expert_bytes_unique"].as_u64().unwrap() > 0);
    // With memory to spare the cache holds every expert: each is read once, later uses are hits;
    // the prompt's rows also read ahead the next layer's predicted experts, and those no fetch
    // demanded are read beside the demanded ones (one read ahead and demanded later is a hit).
    let eb = m_expert_bytes(cache.path());
    let unique = j["expert_bytes_unique"].as_u64().unwrap();
    let wasted = j["prefetch_issued"].as_u64().unwrap() - j["prefetch_used"].as_u64().unwrap();
    assert!(j["cache_misses"].as_u64().unwrap() * eb <= unique, "an expert missed twice");
    assert_eq!(j["cache_hits"].as_u64().unwrap() + j["cache_misses"].as_u64().unwrap(), j["experts_fetched"]);
    // Drive reads are operations: one expert of the demo spans two safetensors files (two reads).
    let reads: u64 = j["drives"].as_array().unwrap().iter().map(|d| d["reads"].as_u64().unwrap()).sum();
    let once = unique + wasted * eb;
    assert!(
        reads * eb >= once && reads * eb <= once + eb,
        "reads {reads} for {unique} unique bytes, {wasted} ahead unused"
    );
    assert!(j["expert_bytes_read"].as_u64().unwrap() >= unique);
}

/// Bytes of one routed expert of the demo model.
fn m_expert_bytes(cache: &Path) -> u64 {
    let c = deltafin::model::K3Config::load(&demo_dir(cache)).unwrap();
    c.expert_bytes() as u64
}

#[test]
fn exit_codes_and_messages() {
    let cache = tempfile::tempdir().unwrap();
    // Usage: no prompt at all.
    let o = deltafin(cache.path()).args(["run", "--demo"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    // Runtime: a text prompt on a model without a tokenizer.
    let o = deltafin(cache.path())
        .args(["run", "--model"])
        .arg(fixture("k3-tiny-a"))
        .args(["--prompt", "hi"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("has no tiktoken.model"));
    // Runtime: context too small for the request.
    let o =
        deltafin(cache.path()).args(["run", "--demo", "--prompt", "hi", "--max-new", "1000000000"]).output().unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("exceeds the usable context"));
    // Runtime: drive subsets need a placement.
    let o = deltafin(cache.path()).args(["run", "--demo", "--prompt", "hi", "--use-drives", "0"]).output().unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--use-drives 0: selects drives of a placement"));
    // Runtime: a memory budget below the trunk.
    let o = deltafin(cache.path()).args(["run", "--demo", "--prompt", "hi", "--memory-gb", "0.001"]).output().unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("memory budget"));
}
