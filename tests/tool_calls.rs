//! Tool calls and constrained decoding as users meet them: the model's tool-call syntax read back
//! from the shipped chat template's own rendering (round trip), and `deltafin serve` on the demo
//! model driven by the official `openai` Python client (tests/serve/tools.py): tool calls plain
//! and streamed, `tool_choice` required / named always giving a call, `response_format`
//! json_object / json_schema output that always parses and validates, and hostile requests
//! refused with a 400 that says why.

mod common;
use common::*;
use deltafin::model::chat::{ChatOptions, ChatTemplate, Thinking};
use deltafin::model::tokenizer::{StreamDecoder, Tokenizer};
use deltafin::model::tool_calls::{Piece, ToolCallParser, ToolEvent};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

fn demo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("demo/kimi-k3-demo")
}

/// The calls the parser reads from `ids`, and any text it gave back as content.
fn parse_ids(tok: &Tokenizer, ids: &[u32]) -> (Vec<(String, Value)>, String) {
    let mut p = ToolCallParser::new(1);
    let mut text = String::new();
    let mut calls = Vec::new();
    let mut take = |ev: Vec<ToolEvent>| {
        for e in ev {
            match e {
                ToolEvent::Call { call, .. } => calls.push((call.name, serde_json::from_str(&call.arguments).unwrap())),
                ToolEvent::Text(t) => text.push_str(&t),
            }
        }
    };
    // Text as the server's answer decodes it: a character split over tokens comes whole.
    let mut dec = StreamDecoder::default();
    for &id in ids {
        let bytes = tok.token_bytes(id).unwrap();
        if tok.is_special(id) {
            take(p.push(Piece::Special(&String::from_utf8_lossy(bytes))));
        } else {
            take(p.push(Piece::Text(&dec.push(bytes))));
        }
    }
    take(p.finish());
    (calls, text)
}

#[test]
fn calls_rendered_by_the_template_parse_back_to_the_same_calls() {
    let tok = Tokenizer::load(&demo(), None).unwrap();
    let chat = ChatTemplate::load(&demo(), &tok).unwrap();
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let args = [
        json!({"city": "Paris", "days": 2, "ratio": 0.5, "ok": true, "none": null, "list": [1, "two", {"z": 1}], "quote": "a \"b\" & <|open|> c", "num_text": "42"}),
        json!({"city": "東京"}),
        json!({}),
    ];
    for thinking in [Thinking::Off, Thinking::Max] {
        for as_string in [false, true] {
            let calls: Vec<Value> = args
                .iter()
                .enumerate()
                .map(|(i, a)| {
                    let arguments = if as_string { json!(a.to_string()) } else { a.clone() };
                    json!({"id": format!("c{i}"), "type": "function", "function": {"name": format!("tool_{i}&\"x\""), "arguments": arguments}})
                })
                .collect();
            let messages = json!([
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c0", "content": "sun"},
                {"role": "tool", "tool_call_id": "c1", "content": "rain"},
                {"role": "tool", "tool_call_id": "c2", "content": "ok"},
                {"role": "assistant", "content": "Done.", "tool_calls": [calls[1].clone()]},
            ]);
            let opts =
                ChatOptions { thinking, add_generation_prompt: true, tools: Some(tools.clone()), ..Default::default() };
            let ids = chat.encode(&tok, &messages, &opts).unwrap();
            let (got, text) = parse_ids(&tok, &ids);
            assert_eq!(text, "", "no text was given back as content");
            let want: Vec<(String, Value)> =
                [0, 1, 2, 1].iter().map(|&i| (format!("tool_{i}&\"x\""), args[i].clone())).collect();
            assert_eq!(got, want, "thinking {thinking:?}, arguments as a string: {as_string}");
        }
    }
}

const MODEL: &str = "demo";

/// A scenario of tests/serve/tools.py against a demo server started with `extra`; its stdout.
fn scenario(name: &str, extra: &[&str]) -> String {
    let mut args = vec!["--demo", "--model-name", MODEL, "--prefill-rows", "256", "--memory-gb", "2", "-q"];
    args.extend_from_slice(extra);
    let s = served::Served::start(&args);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/serve/tools.py");
    let o = python().arg(script).args([&format!("http://{}", s.addr), MODEL, name]).output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "scenario {name} ({extra:?}) failed:\n{out}\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&o.stderr),
        s.log.lock().unwrap()
    );
    out
}

#[test]
fn enforced_calls_and_json_always_come_and_drafts_or_batching_change_no_token() {
    let plain = scenario("enforced", &["--no-reuse"]);
    let answers: Value = serde_json::from_str(plain.trim()).unwrap();
    assert!(answers.as_array().is_some_and(|a| a.len() >= 20), "{answers}");
    // Drafts checked against the grammar (a draft it forbids is never kept), alone and in a
    // running batch: the same tokens, so the same calls and text.
    for extra in [&["--draft", "dspark"][..], &["--parallel", "4", "--draft", "dspark"]] {
        assert_eq!(scenario("enforced", extra).trim(), plain.trim(), "with {extra:?}");
    }
}

#[test]
fn hostile_tool_and_format_requests_are_refused_with_a_reason() {
    let s =
        served::Served::start(&["--demo", "--model-name", MODEL, "--prefill-rows", "256", "--memory-gb", "2", "-q"]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/serve/tools.py");
    let o = python().arg(script).args([&format!("http://{}", s.addr), MODEL, "hostile"]).output().unwrap();
    assert!(
        o.status.success(),
        "scenario hostile failed:\n{}\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
        s.log.lock().unwrap()
    );
    // Schema bombs included, the server never held more than 1 GB.
    let status = std::fs::read_to_string(format!("/proc/{}/status", s.pid())).unwrap_or_default();
    if let Some(kb) = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
    {
        assert!(kb < 1 << 20, "the server's peak RSS reached {kb} kB");
    }
}

#[test]
fn batch_lines_take_the_same_fields_and_give_the_same_answers_with_drafts_in_parallel() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in.jsonl");
    let tools = r#"[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": false}}}]"#;
    let schema = r#"{"type": "json_schema", "json_schema": {"name": "n", "strict": true, "schema": {"type": "object", "properties": {"n": {"type": "integer"}, "w": {"enum": ["x", "y"]}}, "required": ["n", "w"], "additionalProperties": false}}}"#;
    let lines: Vec<String> = (0..8)
        .map(|i| {
            let ask = format!(r#""messages": [{{"role": "user", "content": "Weather in city {i}?"}}], "max_tokens": 96, "reasoning_effort": "none", "seed": {i}, "temperature": {}"#, if i % 2 == 1 { "0.8" } else { "0" });
            match i % 3 {
                0 => format!(r#"{{"id": "t{i}", {ask}, "tools": {tools}, "tool_choice": "required"}}"#),
                1 => format!(r#"{{"id": "j{i}", {ask}, "response_format": {schema}}}"#),
                _ => format!(r#"{{"id": "o{i}", {ask}, "response_format": {{"type": "json_object"}}}}"#),
            }
        })
        .chain([r#"{"id": "bad", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "frobnicate"}}}}"#.to_string()])
        .collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let run = |name: &str, extra: &[&str]| -> Vec<Value> {
        let out = tmp.path().join(name);
        let mut c = deltafin_cmd();
        c.args(["batch", "--demo", "-q", "--in"]).arg(&input).arg("--out").arg(&out).args(extra);
        let o = c.output().unwrap();
        assert!(o.status.success() || o.status.code() == Some(1), "{}", String::from_utf8_lossy(&o.stderr));
        let mut recs: Vec<Value> =
            std::fs::read_to_string(&out).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        recs.sort_by_key(|r| r["line"].as_u64());
        recs
    };
    let serial = run("serial.jsonl", &[]);
    assert_eq!(serial.len(), 9);
    for r in &serial {
        let id = r["id"].as_str().unwrap();
        if id == "bad" {
            assert!(r["error"]["message"].as_str().unwrap().contains("cannot enforce response_format"), "{r}");
            continue;
        }
        if r["finish_reason"] == "length" {
            continue;
        }
        if id.starts_with('t') {
            assert_eq!(r["finish_reason"], "tool_calls", "{r}");
            let args: Value =
                serde_json::from_str(r["tool_calls"][0]["function"]["arguments"].as_str().unwrap()).unwrap();
            assert!(args["city"].is_string() && args.as_object().unwrap().len() == 1, "{r}");
        } else {
            let v: Value = serde_json::from_str(r["text"].as_str().unwrap()).unwrap_or_else(|e| panic!("{r}: {e}"));
            assert!(v.is_object(), "{r}");
            if id.starts_with('j') {
                assert!(
                    v["n"].is_i64() && (v["w"] == "x" || v["w"] == "y") && v.as_object().unwrap().len() == 2,
                    "{r}"
                );
            }
        }
    }
    for (name, extra) in
        [("drafts.jsonl", &["--draft", "dspark"][..]), ("lanes.jsonl", &["--parallel", "3", "--draft", "dspark"])]
    {
        let got = run(name, extra);
        for (a, b) in got.iter().zip(&serial) {
            for k in ["text", "finish_reason", "tool_calls", "error"] {
                assert_eq!(a.get(k), b.get(k), "{extra:?}, {}: {k}", b["id"]);
            }
        }
    }
}
