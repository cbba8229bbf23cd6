use super::*;
use crate::model::tool_calls::{Piece, ToolCallParser, ToolEvent};
use crate::sample::{Sampler, SamplingSpec, splitmix64};
use serde_json::{Value, json};

fn demo_tokenizer() -> Tokenizer {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("demo/kimi-k3-demo");
    Tokenizer::load(&dir, None).unwrap()
}

fn grammars(tok: &Tokenizer) -> (Grammars, Vec<u32>) {
    let stops: Vec<u32> = ["<|end_of_msg|>", "[EOS]"].iter().filter_map(|n| tok.special_id(n)).collect();
    (Grammars::new(tok, tok.vocab_size(), &stops).unwrap(), stops)
}

/// Tokens sampled from random logits under `spec` until a stop token (None past `limit`).
fn sample_under(g: &Grammars, spec: &Spec, stops: &[u32], seed: u64, limit: usize) -> Option<Vec<u32>> {
    let vocab = g.vocab;
    let mut s = Sampler::new(SamplingSpec::new(1.0, 1.0, seed).unwrap());
    s.constrain(g.mask(spec).unwrap());
    let mut rng = seed ^ 0x55;
    let mut out = Vec::new();
    for _ in 0..limit {
        // Random logits that favour short tokens' ends: any token may be K3's first choice.
        let logits: Vec<f32> = (0..vocab).map(|_| (splitmix64(&mut rng) >> 40) as f32 / (1 << 22) as f32).collect();
        let t = s.pick(&logits);
        assert!(s.constraint_error().is_none(), "{:?}", s.constraint_error());
        out.push(t);
        if stops.contains(&t) {
            return Some(out);
        }
    }
    None
}

/// The answer's pieces: (specials by name, text), and its response channel's text.
fn pieces(tok: &Tokenizer, ids: &[u32]) -> Vec<(bool, String)> {
    ids.iter()
        .map(|&id| (tok.is_special(id), String::from_utf8_lossy(tok.token_bytes(id).unwrap()).into_owned()))
        .collect()
}

#[test]
fn random_logits_under_a_schema_always_give_valid_json() {
    let tok = demo_tokenizer();
    let (g, stops) = grammars(&tok);
    let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["x", "y"]}},
        "required": ["ok", "pick"], "additionalProperties": false});
    let mut whole = 0;
    for thinking in [false, true] {
        let spec = Spec { payload: Payload::Json(schema.clone()), thinking };
        for seed in 0..6 {
            let Some(ids) = sample_under(&g, &spec, &stops, seed, 400) else { continue };
            whole += 1;
            let p = pieces(&tok, &ids);
            // The response: from after the thinking channel's `response<|sep|>` (or the start) to `<|close|>`.
            let start =
                if thinking { p.iter().position(|(sp, t)| *sp && t == "<|sep|>").map_or(0, |i| i + 3) } else { 0 };
            let end = p[start..].iter().position(|(sp, _)| *sp).map_or(p.len(), |i| start + i);
            let text: String = p[start..end].iter().map(|(_, t)| t.as_str()).collect();
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert!(v["ok"].is_boolean() && (v["pick"] == "x" || v["pick"] == "y"), "{v}");
            assert_eq!(v.as_object().unwrap().len(), 2, "{v}");
        }
    }
    assert!(whole >= 4, "only {whole} answers ended within the limit");
}

#[test]
fn random_logits_under_a_tool_choice_always_give_a_call_the_parser_reads() {
    let tok = demo_tokenizer();
    let (g, stops) = grammars(&tok);
    let tools = vec![
        (
            "get_weather".to_string(),
            json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": false}),
        ),
        ("now".to_string(), parameters_schema(None)),
    ];
    let mut whole = 0;
    for parallel in [false, true] {
        let spec = Spec { payload: Payload::Tools { tools: tools.clone(), parallel }, thinking: false };
        for seed in 0..6 {
            let Some(ids) = sample_under(&g, &spec, &stops, seed, 300) else { continue };
            whole += 1;
            let mut parser = ToolCallParser::new(0);
            let mut events = Vec::new();
            for (sp, t) in pieces(&tok, &ids) {
                events.extend(parser.push(if sp { Piece::Special(&t) } else { Piece::Text(&t) }));
            }
            events.extend(parser.finish());
            assert!(events.iter().all(|e| matches!(e, ToolEvent::Call { .. })), "{events:?}");
            let calls = parser.calls();
            assert!(!calls.is_empty() && (parallel || calls.len() == 1), "{calls:?}");
            for c in calls {
                let args: Value = serde_json::from_str(&c.arguments).unwrap();
                match c.name.as_str() {
                    "get_weather" => {
                        // The schema's integer has no bound: any integer literal, however long.
                        let n = c.arguments.split_once(':').map(|(_, v)| v.trim_end().trim_end_matches('}').trim());
                        let digits = n.map(|n| n.strip_prefix('-').unwrap_or(n)).unwrap_or_default();
                        let integer = !digits.is_empty()
                            && digits.bytes().all(|b| b.is_ascii_digit())
                            && (digits == "0" || !digits.starts_with('0'));
                        assert!(args["n"].is_number() && integer && args.as_object().unwrap().len() == 1, "{args}");
                    }
                    "now" => assert_eq!(args, json!({})),
                    other => panic!("a call of {other}"),
                }
            }
        }
    }
    assert!(whole >= 4, "only {whole} answers ended within the limit");
}

#[test]
fn what_cannot_be_enforced_is_refused_with_a_reason() {
    let tok = demo_tokenizer();
    let (g, _) = grammars(&tok);
    let bad = |schema: Value| {
        let e = g.check(&Spec { payload: Payload::Json(schema), thinking: true }).unwrap_err().to_string();
        assert!(e.starts_with("cannot enforce response_format") || e.contains("bytes of JSON"), "{e}");
        e
    };
    bad(json!({"type": "frobnicate"}));
    bad(json!({"$ref": "#/definitions/missing"}));
    bad(json!({"type": "string", "pattern": "("}));
    let huge: serde_json::Map<String, Value> =
        (0..20_000).map(|i| (format!("p{i}"), json!({"type": "string"}))).collect();
    assert!(bad(json!({"type": "object", "properties": huge})).contains("bytes of JSON"));
    g.check(&Spec { payload: Payload::Json(json!({"type": "object"})), thinking: false }).unwrap();
}

#[test]
fn first_line_drops_the_grammar_and_its_places() {
    assert_eq!(
        super::first_line("at 3(7): failed to compile JSON schema: Invalid type: x\n%llguidance {}\nstart: x"),
        "failed to compile JSON schema: Invalid type: x"
    );
    assert_eq!(
        super::first_line(
            "at 3(7): failed to compile JSON schema: regex parse error:\n    ((\n    ^\nerror: unclosed group"
        ),
        "failed to compile JSON schema: regex parse error: error: unclosed group"
    );
}
