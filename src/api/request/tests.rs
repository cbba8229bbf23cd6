//! Unit tests of `api::request` (a file of their own to keep the module under the file-size guide).

use super::*;
use serde_json::json;

const CTX: ParseContext =
    ParseContext { model_id: "m", template_takes_tools: false, sampling: SamplingSpec::GREEDY, max_tokens: None };

fn chat(v: Value) -> Result<GenRequest, ApiError> {
    parse_chat(&v, &CTX)
}

#[test]
fn a_full_chat_request_parses() {
    let r = chat(json!({"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, {"role": "user", "content": "hi"}],
        "max_completion_tokens": 5, "stop": ["x"], "temperature": 0.5, "top_p": 0.9, "seed": -1, "logprobs": true, "top_logprobs": 3,
        "stream": true, "stream_options": {"include_usage": true}, "reasoning_effort": "none", "n": 1, "user": "u"}))
    .unwrap();
    assert_eq!(r.max_tokens, Some(5));
    assert_eq!(r.sampling.seed, Some(u64::MAX));
    assert_eq!(r.logprobs, Some(3));
    assert_eq!(r.thinking, Some(Thinking::Off));
    assert!(r.include_usage);
    assert_eq!(
        r.prompt,
        Prompt::Messages(json!([{"role": "system", "content": "ab"}, {"role": "user", "content": "hi"}]))
    );
}

#[test]
fn bad_fields_are_named() {
    let base = || json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    let cases = [
        ("n", json!(0), "n"),
        ("n", json!(17), "n"),
        ("bogus", json!(1), "bogus"),
        ("temperature", json!(3), "temperature"),
        ("temperature", json!("hot"), "temperature"),
        ("max_tokens", json!(0), "max_tokens"),
        ("tools", json!([]), "tools"),
        ("stream_options", json!({"include_usage": true}), "stream_options"),
        ("top_logprobs", json!(2), "top_logprobs"),
    ];
    for (k, v, param) in cases {
        let mut b = base();
        b[k] = v;
        let e = chat(b).unwrap_err();
        assert_eq!((e.status, e.param.as_deref()), (400, Some(param)), "{k}: {e:?}");
    }
    let mut b = base();
    b["messages"][0]["content"] = json!([{"type": "image_url", "image_url": {"url": "x"}}]);
    assert_eq!(chat(b).unwrap_err().param.as_deref(), Some("messages[0].content[0].type"));
    let mut b = base();
    b["model"] = json!("other");
    assert_eq!(chat(b).unwrap_err().status, 404);
    assert_eq!(chat(json!([1])).unwrap_err().status, 400);
}

#[test]
fn completions_and_batch_lines() {
    let r = parse_completion(&json!({"model": "m", "prompt": [[1, 2]], "logprobs": 2}), &CTX).unwrap();
    assert_eq!((r.prompt, r.max_tokens, r.logprobs), (Prompt::Ids(vec![1, 2]), Some(16), Some(2)));
    assert_eq!(
        parse_completion(&json!({"model": "m", "prompt": ["a", "b"]}), &CTX).unwrap_err().param.as_deref(),
        Some("prompt")
    );
    assert_eq!(
        parse_completion(&json!({"model": "m", "prompt": "a", "echo": true, "stream": true}), &CTX)
            .unwrap_err()
            .param
            .as_deref(),
        Some("echo")
    );
    // lm-evaluation-harness's loglikelihood request.
    let r = parse_completion(
        &json!({"model": "m", "prompt": [[1, 2, 3]], "echo": true, "logprobs": 1, "max_tokens": 0, "temperature": 0, "seed": 1234}),
        &CTX,
    )
    .unwrap();
    assert_eq!((r.echo, r.logprobs, r.max_tokens), (true, Some(1), Some(0)));
    let (_, r) = parse_batch_line(&json!({"id": 1, "prompt": "hi", "n": 2}), &CTX);
    assert_eq!(r.unwrap_err().param.as_deref(), Some("n"));
    let (id, r) = parse_batch_line(&json!({"id": 7, "prompt": "hi", "max_tokens": 3}), &CTX);
    assert_eq!((id.as_deref(), r.unwrap().max_tokens), (Some("7"), Some(3)));
    let (id, r) = parse_batch_line(&json!({"id": "a", "prompt": "hi", "stream": true}), &CTX);
    assert_eq!((id.as_deref(), r.unwrap_err().param.as_deref()), (Some("a"), Some("stream")));
    assert!(parse_batch_line(&json!({"prompt": "hi"}), &CTX).1.is_err());
}

#[test]
fn standard_fields_are_honoured_ignored_or_refused() {
    let base = || json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    // Honoured: top_k and min_p (vLLM's -1 is off, as 0), the template's thinking.
    let mut b = base();
    b["top_k"] = json!(40);
    b["min_p"] = json!(0.05);
    b["chat_template_kwargs"] = json!({"thinking": false});
    let r = chat(b).unwrap();
    assert_eq!((r.sampling.top_k, r.sampling.min_p, r.thinking), (40, 0.05, Some(Thinking::Off)));
    let mut b = base();
    b["top_k"] = json!(-1);
    assert_eq!(chat(b).unwrap().sampling.top_k, 0);
    // Ignored: bookkeeping and hints that cannot change the answer.
    let mut b = base();
    for (k, v) in [
        ("store", json!(true)),
        ("metadata", json!({"a": "b"})),
        ("service_tier", json!("auto")),
        ("user", json!("u")),
        ("safety_identifier", json!("s")),
        ("prompt_cache_key", json!("k")),
        ("prediction", json!({"type": "content", "content": "x"})),
        ("parallel_tool_calls", json!(false)),
        ("modalities", json!(["text"])),
        ("verbosity", json!("medium")),
        ("repetition_penalty", json!(1.0)),
        ("presence_penalty", json!(0)),
    ] {
        b[k] = v;
    }
    b["stream"] = json!(true);
    b["stream_options"] = json!({"include_usage": true, "include_obfuscation": false});
    let r = chat(b).unwrap();
    assert_eq!((r.sampling.top_k, r.sampling.min_p, r.thinking), (0, 0.0, None));
    // Honoured: penalties, logit_bias (ascending ids), n.
    let mut b = base();
    b["repetition_penalty"] = json!(1.1);
    b["frequency_penalty"] = json!(0.5);
    b["presence_penalty"] = json!(-0.5);
    b["logit_bias"] = json!({"9": -100, "3": 5.5});
    b["n"] = json!(3);
    let r = chat(b).unwrap();
    let s = &r.sampling;
    assert_eq!((s.repetition_penalty, s.frequency_penalty, s.presence_penalty), (1.1, 0.5, -0.5));
    assert_eq!((s.logit_bias.clone(), r.n), (vec![(3, 5.5), (9, -100.0)], 3));
    // Refused: out of range, or they would change the answer.
    for (k, v) in [
        ("repetition_penalty", json!(0)),
        ("frequency_penalty", json!(2.5)),
        ("logit_bias", json!({"1": 200})),
        ("logit_bias", json!({"one": 2})),
        ("logit_bias", json!([1])),
        ("top_k", json!(-2)),
        ("min_p", json!(1.5)),
        ("modalities", json!(["text", "audio"])),
        ("verbosity", json!("low")),
        ("audio", json!({"voice": "x"})),
        ("web_search_options", json!({})),
        ("functions", json!([])),
        ("function_call", json!("auto")),
        ("chat_template_kwargs", json!({"enable_thinking": false})),
        ("max_token", json!(5)),
    ] {
        let mut b = base();
        b[k] = v;
        let e = chat(b).unwrap_err();
        assert_eq!(e.status, 400, "{k}");
        assert!(e.param.as_deref().is_some_and(|p| p.starts_with(k)), "{k}: {e:?}");
    }
    let mut b = base();
    b["reasoning_effort"] = json!("high");
    b["chat_template_kwargs"] = json!({"thinking": false});
    assert_eq!(chat(b).unwrap_err().param.as_deref(), Some("chat_template_kwargs"));
    // Completions take the standard ones too.
    let r =
        parse_completion(&json!({"model": "m", "prompt": "a", "store": false, "top_k": 5, "user": "u"}), &CTX).unwrap();
    assert_eq!(r.sampling.top_k, 5);
}

#[test]
fn a_chat_without_max_tokens_gets_the_servers_default() {
    let ctx = ParseContext { max_tokens: Some(2048), ..CTX };
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let r = parse_chat(&json!({"model": "m", "messages": msgs}), &ctx).unwrap();
    assert_eq!((r.max_tokens, r.default_max_tokens), (None, Some(2048)));
    assert_eq!(
        parse_chat(&json!({"model": "m", "messages": msgs, "max_tokens": 9}), &ctx).unwrap().max_tokens,
        Some(9)
    );
    // Completions keep OpenAI's 16.
    assert_eq!(parse_completion(&json!({"model": "m", "prompt": "a"}), &ctx).unwrap().max_tokens, Some(16));
}

#[test]
fn tool_choice_and_response_format_are_parsed_and_checked() {
    let ctx = ParseContext { template_takes_tools: true, ..CTX };
    let tools = json!([{"type": "function", "function": {"name": "f"}}]);
    let with = |extra: Value| {
        let mut b = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        parse_chat(&b, &ctx)
    };
    let r = with(json!({"tool_choice": {"type": "function", "function": {"name": "f"}}, "parallel_tool_calls": false}))
        .unwrap();
    assert_eq!((r.tool_choice, r.parallel_tool_calls), (ToolChoice::Named("f".into()), false));
    assert_eq!(with(json!({"tool_choice": "required"})).unwrap().tool_choice, ToolChoice::Required);
    let r = with(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": true}}})).unwrap();
    assert!(matches!(r.response_format, ResponseFormat::JsonSchema { strict: true, .. }));
    for (extra, param) in [
        (json!({"tool_choice": {"type": "function", "function": {"name": "g"}}}), "tool_choice.function.name"),
        (json!({"tool_choice": "maybe"}), "tool_choice"),
        (json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}), "tools[0].function.name"),
        (json!({"tools": [], "tool_choice": "required"}), "tool_choice"),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}),
            "response_format.json_schema.name",
        ),
        (json!({"response_format": {"type": "json_object"}, "tool_choice": "required"}), "response_format"),
    ] {
        let e = with(extra.clone()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(param), "{extra}: {e:?}");
    }
}
