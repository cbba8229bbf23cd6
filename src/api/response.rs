//! Answers of the OpenAI API: what a finished request holds ([`Output`]) and what each token adds
//! to it ([`Delta`]), and their shapes: whole responses, streamed chunks, usage and
//! log-probabilities.
//!
//! Contract: a stream is the role chunk (chat), one chunk per token that has text or
//! log-probabilities, a final chunk with `finish_reason` (carrying the deltafin extension object
//! when usage is not asked for), then — with `stream_options.include_usage` — a chunk with empty
//! `choices`, `usage` and the extension object; how chunks travel (server-sent events, then
//! `[DONE]`) is the transport's.

use super::Kind;
use crate::model::tool_calls::ToolCall;
use crate::sample::TokenLogprob;
use serde_json::{Value, json};

/// A finished request.
#[derive(Clone, Debug)]
pub struct Output {
    pub tokens: Vec<u32>,
    pub content: String,
    pub reasoning: String,
    /// The model's tool calls (a chat answer to a request with tools).
    pub tool_calls: Vec<ToolCall>,
    /// "stop", "length", "tool_calls", "cancelled", or "error" (the output constraint failed).
    pub finish_reason: &'static str,
    pub logprobs: Vec<TokenLogprob>,
    pub prompt_tokens: usize,
    /// The deltafin extension object.
    pub ext: Value,
}

/// One token's visible text, split into the chat template's channels.
#[derive(Clone, Debug, Default)]
pub struct Delta {
    pub content: String,
    pub reasoning: String,
    pub logprobs: Option<TokenLogprob>,
    /// Tool calls made whole at this token, with their index in the answer.
    pub tool_calls: Vec<(usize, ToolCall)>,
}

/// Identity of one response: id, creation time, model.
#[derive(Clone, Debug)]
pub struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub kind: Kind,
}

/// A token id's bytes, for log-probabilities (shown as text, U+FFFD where a token holds part of a
/// character, and as `bytes`, exact, so a client can join partial characters).
pub type TokenText<'a> = &'a dyn Fn(u32) -> Vec<u8>;

fn lossy(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn object(kind: Kind, chunk: bool) -> &'static str {
    match (kind, chunk) {
        (Kind::Chat, false) => "chat.completion",
        (Kind::Chat, true) => "chat.completion.chunk",
        (Kind::Completion, _) => "text_completion",
    }
}

pub fn usage(out: &Output) -> Value {
    let reused = out.ext.get("prompt_tokens_reused").cloned().unwrap_or(json!(0));
    json!({
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.tokens.len(),
        "total_tokens": out.prompt_tokens + out.tokens.len(),
        "prompt_tokens_details": {"cached_tokens": reused},
    })
}

fn chat_logprob(l: &TokenLogprob, text: TokenText) -> Value {
    let entry = |t: u32, lp: f64| {
        let b = text(t);
        json!({"token": lossy(&b), "logprob": lp, "bytes": b})
    };
    let mut e = entry(l.token, l.logprob);
    e["top_logprobs"] = Value::Array(l.top.iter().map(|&(t, lp)| entry(t, lp)).collect());
    e
}

fn completion_logprobs(ls: &[TokenLogprob], text: TokenText) -> Value {
    let mut offset = 0;
    let mut offsets = Vec::new();
    for l in ls {
        offsets.push(offset);
        offset += lossy(&text(l.token)).len();
    }
    json!({
        "tokens": ls.iter().map(|l| lossy(&text(l.token))).collect::<Vec<_>>(),
        "token_logprobs": ls.iter().map(|l| l.logprob).collect::<Vec<_>>(),
        "top_logprobs": ls.iter().map(|l| l.top.iter().map(|&(t, lp)| (lossy(&text(t)), json!(lp))).collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

fn logprobs_value(kind: Kind, ls: &[TokenLogprob], text: TokenText) -> Value {
    match kind {
        Kind::Chat => json!({"content": ls.iter().map(|l| chat_logprob(l, text)).collect::<Vec<_>>()}),
        Kind::Completion => completion_logprobs(ls, text),
    }
}

/// The whole (non-streamed) response.
pub fn response(m: &Meta, out: &Output, want_logprobs: bool, text: TokenText) -> Value {
    let lp = if want_logprobs { logprobs_value(m.kind, &out.logprobs, text) } else { Value::Null };
    let choice = match m.kind {
        Kind::Chat => {
            let mut msg = json!({"role": "assistant", "content": out.content});
            if !out.reasoning.is_empty() {
                msg["reasoning_content"] = json!(out.reasoning);
            }
            if !out.tool_calls.is_empty() {
                if out.content.is_empty() {
                    msg["content"] = Value::Null;
                }
                msg["tool_calls"] = out
                    .tool_calls
                    .iter()
                    .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
                    .collect();
            }
            json!({"index": 0, "message": msg, "logprobs": lp, "finish_reason": out.finish_reason})
        }
        Kind::Completion => {
            json!({"index": 0, "text": out.content, "logprobs": lp, "finish_reason": out.finish_reason})
        }
    };
    json!({
        "id": m.id, "object": object(m.kind, false), "created": m.created, "model": m.model,
        "choices": [choice], "usage": usage(out), "deltafin": out.ext,
    })
}

fn chunk(m: &Meta, choice: Value) -> Value {
    json!({"id": m.id, "object": object(m.kind, true), "created": m.created, "model": m.model, "choices": [choice]})
}

/// The chat stream's first chunk (the role).
pub fn role_chunk(m: &Meta) -> Value {
    chunk(
        m,
        json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}),
    )
}

/// One token's chunk, or None when it has nothing to show.
pub fn delta_chunk(m: &Meta, d: &Delta, text: TokenText) -> Option<Value> {
    if d.content.is_empty() && d.reasoning.is_empty() && d.logprobs.is_none() {
        return None;
    }
    let lp = d.logprobs.as_ref().map_or(Value::Null, |l| logprobs_value(m.kind, std::slice::from_ref(l), text));
    Some(match m.kind {
        Kind::Chat => {
            let mut delta = json!({"content": d.content});
            if !d.reasoning.is_empty() {
                delta["reasoning_content"] = json!(d.reasoning);
            }
            chunk(m, json!({"index": 0, "delta": delta, "logprobs": lp, "finish_reason": null}))
        }
        Kind::Completion => chunk(m, json!({"index": 0, "text": d.content, "logprobs": lp, "finish_reason": null})),
    })
}

/// The chunks of the tool calls made whole at one token, as OpenAI streams them: per call, one
/// with its index, id, type and name (arguments empty), then one with its arguments.
pub fn tool_call_chunks(m: &Meta, d: &Delta) -> Vec<Value> {
    let mut out = Vec::new();
    for (i, c) in &d.tool_calls {
        let head = json!({"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}});
        let args = json!({"index": i, "function": {"arguments": c.arguments}});
        for call in [head, args] {
            out.push(chunk(
                m,
                json!({"index": 0, "delta": {"tool_calls": [call]}, "logprobs": null, "finish_reason": null}),
            ));
        }
    }
    out
}

/// The chunk carrying `finish_reason` (and the extension object unless a usage chunk follows).
pub fn finish_chunk(m: &Meta, out: &Output, with_ext: bool) -> Value {
    let mut c = match m.kind {
        Kind::Chat => chunk(m, json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": out.finish_reason})),
        Kind::Completion => {
            chunk(m, json!({"index": 0, "text": "", "logprobs": null, "finish_reason": out.finish_reason}))
        }
    };
    if with_ext {
        c["deltafin"] = out.ext.clone();
    }
    c
}

/// The usage chunk of `stream_options.include_usage`.
pub fn usage_chunk(m: &Meta, out: &Output) -> Value {
    json!({"id": m.id, "object": object(m.kind, true), "created": m.created, "model": m.model, "choices": [], "usage": usage(out), "deltafin": out.ext})
}
