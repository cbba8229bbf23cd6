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
