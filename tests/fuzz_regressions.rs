//! Inputs the fuzz targets (fuzz/, bench/fuzz.sh) found, one test per input class, named after
//! it: each must now be a clear error naming the file, never a panic or an accepted bad value.

use deltafin::model::checkpoint::parse_header;
use deltafin::store::pack::{self, PackError};
use std::path::Path;

/// A pack file's first bytes (version 2): the fixed part, a model fingerprint and an index of
/// `entries` (expert, offset, length), with a valid header checksum, as `pack_header` builds them
/// after its checksum fix-up.
fn pack_head(expert_len: u64, entries: &[(u32, u64, u64)]) -> Vec<u8> {
    let mut idx = Vec::new();
    for &(e, off, len) in entries {
        idx.extend_from_slice(&e.to_le_bytes());
        idx.extend_from_slice(&0u32.to_le_bytes());
        idx.extend_from_slice(&off.to_le_bytes());
        idx.extend_from_slice(&len.to_le_bytes());
        idx.extend_from_slice(&0u64.to_le_bytes());
    }
    let model = [7u8; 32];
    let mut h = pack::MAGIC.to_vec();
    for v in [pack::VERSION, 3, entries.len() as u32, 0] {
        h.extend_from_slice(&v.to_le_bytes());
    }
    for v in [expert_len, pack::ALIGN, pack::header_sum(&model, &idx)] {
        h.extend_from_slice(&v.to_le_bytes());
    }
    h.resize(64, 0);
    h.extend_from_slice(&model);
    h.extend_from_slice(&idx);
    h
}

#[test]
fn pack_record_end_past_u64_max() {
    // Found by `pack_header`: offset + length overflowed (a panic with overflow checks; without
    // them it wrapped below the file length and the record was accepted).
    let len = u64::MAX - 4095 + 100;
    let head = pack_head(len, &[(3, 4096, len)]);
    let err = pack::parse_header(Path::new("L3.pack"), &head, 8192).unwrap_err();
    assert!(matches!(err, PackError::Invalid { .. }), "{err}");
    assert!(err.to_string().contains("L3.pack") && err.to_string().contains("misplaced or truncated"), "{err}");
    // The same through a file on disk.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("L3.pack");
    let mut file = head.clone();
    file.resize(8192, 0);
    std::fs::write(&path, &file).unwrap();
    assert!(pack::read_header(&path).is_err());
    // A sane record in the same layout still parses.
    let head = pack_head(100, &[(3, 4096, 100)]);
    assert_eq!(pack::parse_header(Path::new("L3.pack"), &head, 8192).unwrap().entries.len(), 1);
}

/// One header entry: name, dtype, shape, data_offsets.
type Entry<'a> = (&'a str, &'a str, Vec<u64>, (u64, u64));

/// A safetensors file: `tensors` in the header, padded to `header_len` bytes, then `data` bytes.
fn safetensors(tensors: &[Entry], header_len: usize, data: usize) -> Vec<u8> {
    let mut h = serde_json::Map::new();
    for (name, dtype, shape, (s, e)) in tensors {
        h.insert(name.to_string(), serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [s, e]}));
    }
    let mut text = serde_json::to_vec(&h).unwrap();
    assert!(text.len() <= header_len);
    text.resize(header_len, b' ');
    let mut out = (header_len as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.resize(out.len() + data, 0);
    out
}

#[test]
fn safetensors_data_end_past_u64_max() {
    // Eight U8 tensors of 2^61 - 1 bytes each: every offset is valid in sequence, but 8 + header
    // + their end overflows u64 (a panic with overflow checks on).
    let size = (1u64 << 61) - 1;
    let names: Vec<String> = (0..8).map(|i| format!("t{i}")).collect();
    let tensors: Vec<Entry> = names
        .iter()
        .enumerate()
        .map(|(i, n)| (n.as_str(), "U8", vec![size], (i as u64 * size, (i as u64 + 1) * size)))
        .collect();
    let bytes = safetensors(&tensors, 1024, 0);
    let err = parse_header(Path::new("model-00001.safetensors"), &bytes).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("model-00001.safetensors") && msg.contains("overflows"), "{msg}");
    // One small tensor in the same layout still parses.
    let ok = safetensors(&[("t0", "U8", vec![16], (0, 16))], 64, 16);
    assert_eq!(parse_header(Path::new("m.safetensors"), &ok).unwrap().0, 64);
}

#[test]
fn index_shard_name_naming_the_model_directory() {
    // "", "." and ".." as a shard name would open the directory itself (or its parent).
    for name in ["", ".", "..", "a/b", "..\\x"] {
        let text = serde_json::json!({"weight_map": {"t": name}}).to_string();
        let err = deltafin::model::checkpoint::parse_index(Path::new("model.safetensors.index.json"), &text)
            .unwrap_err()
            .to_string();
        assert!(err.contains("plain file name") && err.contains("index.json"), "{name:?}: {err}");
    }
}

/// k3-tiny-a's config.json with `edit` applied, parsed.
fn parse_config(edit: impl FnOnce(&mut serde_json::Value)) -> Result<deltafin::model::K3Config, String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/k3-tiny-a");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    edit(&mut v);
    deltafin::model::K3Config::parse(Path::new("config.json"), &v.to_string()).map_err(|e| e.to_string())
}

#[test]
fn config_sizes_whose_products_overflow() {
    // `config_json` derives kda_dim (heads x head_dim) and expert_bytes (inter x latent): with
    // 2^32 each they overflowed (a panic with overflow checks, a wrong size without).
    let big = serde_json::Value::from(1u64 << 32);
    for (field, path) in [
        ("linear_attn_config.num_heads", &["linear_attn_config", "num_heads"][..]),
        ("linear_attn_config.head_dim", &["linear_attn_config", "head_dim"][..]),
        ("moe_intermediate_size", &["moe_intermediate_size"][..]),
        ("routed_expert_hidden_size", &["routed_expert_hidden_size"][..]),
        ("kv_lora_rank", &["kv_lora_rank"][..]),
        ("num_shared_experts", &["num_shared_experts"][..]),
    ] {
        let err = parse_config(|v| {
            let mut x = &mut v["text_config"];
            for p in path {
                x = &mut x[*p];
            }
            *x = big.clone();
        })
        .unwrap_err();
        assert!(err.contains("config.json") && err.contains(field) && err.contains("implausibly large"), "{err}");
    }
    assert!(parse_config(|_| {}).is_ok());
}

#[test]
fn config_layer_count_that_cannot_be_allocated() {
    // 10^12 layers: the per-layer tables were allocated before any other check (an abort).
    let err = parse_config(|v| v["text_config"]["num_hidden_layers"] = 1_000_000_000_000u64.into()).unwrap_err();
    assert!(err.contains("text_config.num_hidden_layers") && err.contains("implausibly large"), "{err}");
}

#[test]
fn config_token_id_past_u32() {
    // 2^32 + 2 was cut to 2 without a word.
    for v in [serde_json::json!(4294967298u64), serde_json::json!([4294967298u64, 1])] {
        let err = parse_config(|c| c["text_config"]["eos_token_id"] = v.clone()).unwrap_err();
        assert!(err.contains("text_config.eos_token_id") && err.contains("expected a token id"), "{err}");
    }
}

/// A byte-level tokenizer with K3's special names after its 256 tokens.
fn byte_tokenizer() -> deltafin::model::tokenizer::Tokenizer {
    use deltafin::model::tokenizer::{K3_SPECIALS, NUM_SPECIALS, Tokenizer};
    let mut names: Vec<String> = (0..NUM_SPECIALS).map(|i| format!("<|reserved_token_{}|>", 256 + i)).collect();
    for (off, name) in K3_SPECIALS {
        names[off] = name.to_string();
    }
    Tokenizer::from_parts((0..=255u8).map(|b| vec![b]).collect(), names).unwrap()
}

fn render(template: &str, messages: &serde_json::Value) -> Result<String, String> {
    use deltafin::model::chat::{ChatOptions, ChatTemplate};
    let tok = byte_tokenizer();
    let t = ChatTemplate::from_source(Path::new("chat_template.jinja"), template.to_string(), &tok).unwrap();
    t.render(messages, &ChatOptions::default()).map_err(|e| e.to_string())
}

#[test]
fn chat_template_that_never_ends() {
    // Hand-written inputs run through `chat_template`: nested loops (10^10 steps, a timeout) and
    // a string doubled 60 times (an allocation abort) now stop at the step limit.
    let msgs = serde_json::json!([{"role": "user", "content": "hi"}]);
    for (what, src) in [
        ("nested loops", "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"),
        (
            "doubling string",
            "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
        ),
    ] {
        let t = std::time::Instant::now();
        let err = render(src, &msgs).unwrap_err();
        assert!(err.contains("steps"), "{what}: {err}");
        assert!(t.elapsed().as_secs() < 30, "{what}: took {:?}", t.elapsed());
    }
}

#[test]
fn chat_long_conversation_fits_the_step_limit() {
    // K3's own template on 3000 turns (9001 messages, with tool calls and reasoning) stays inside.
    let template =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/chat/k3_chat_template.jinja"))
            .unwrap();
    let mut msgs = vec![serde_json::json!({"role": "system", "content": "Be brief."})];
    for i in 0..3000 {
        msgs.push(serde_json::json!({"role": "user", "content": format!("question {i}: {}", "words ".repeat(30))}));
        msgs.push(serde_json::json!({"role": "assistant", "content": "", "reasoning_content": "think",
            "tool_calls": [{"id": format!("c{i}"), "type": "function", "function": {"name": "f", "arguments": {"q": i}}}]}));
        msgs.push(serde_json::json!({"role": "tool", "tool_call_id": format!("c{i}"), "content": "result"}));
    }
    let text = render(&template, &serde_json::Value::Array(msgs)).unwrap();
    assert!(text.contains("question 2999"));
}
