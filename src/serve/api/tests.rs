//! Unit tests of `serve::api` (a file of their own to keep the module under the file-size guide).

use super::*;
use serde_json::json;

const CTX: ParseContext = ParseContext {
    model_id: "m",
    template_takes_tools: false,
    sampling: SamplingDefaults { temperature: 0.0, top_p: 1.0 },
};

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
    assert_eq!(r.seed, Some(u64::MAX));
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
        ("n", json!(2), "n"),
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
        parse_completion(&json!({"model": "m", "prompt": "a", "echo": true}), &CTX).unwrap_err().param.as_deref(),
        Some("echo")
    );
    let (id, r) = parse_batch_line(&json!({"id": 7, "prompt": "hi", "max_tokens": 3}), &CTX);
    assert_eq!((id.as_deref(), r.unwrap().max_tokens), (Some("7"), Some(3)));
    let (id, r) = parse_batch_line(&json!({"id": "a", "prompt": "hi", "stream": true}), &CTX);
    assert_eq!((id.as_deref(), r.unwrap_err().param.as_deref()), (Some("a"), Some("stream")));
    assert!(parse_batch_line(&json!({"prompt": "hi"}), &CTX).1.is_err());
}
