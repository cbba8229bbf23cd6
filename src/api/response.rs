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
    /// The prompt, shown before the answer (a completion's `echo`).
    pub echo: Option<Echo>,
}

/// A completion's prompt as `echo` shows it: its text, its tokens and (with `logprobs`) each
/// token's log-probability after the tokens before it (None for the first, which has none).
#[derive(Clone, Debug, Default)]
pub struct Echo {
    pub text: String,
    pub tokens: Vec<u32>,
    pub logprobs: Option<Vec<Option<TokenLogprob>>>,
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

/// OpenAI's completions shape over (token, its log-probability: None for an echoed prompt's
/// first token, null as vLLM gives it).
fn completion_logprobs(ls: &[(u32, Option<&TokenLogprob>)], text: TokenText) -> Value {
    let mut offset = 0;
    let mut offsets = Vec::new();
    for &(t, _) in ls {
        offsets.push(offset);
        offset += lossy(&text(t)).len();
    }
    let top = |l: &TokenLogprob| {
        Value::Object(l.top.iter().map(|&(t, lp)| (lossy(&text(t)), json!(lp))).collect::<serde_json::Map<_, _>>())
    };
    json!({
        "tokens": ls.iter().map(|&(t, _)| lossy(&text(t))).collect::<Vec<_>>(),
        "token_logprobs": ls.iter().map(|(_, l)| l.map_or(Value::Null, |l| json!(l.logprob))).collect::<Vec<_>>(),
        "top_logprobs": ls.iter().map(|(_, l)| l.map_or(Value::Null, top)).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

fn logprobs_value(kind: Kind, ls: &[TokenLogprob], text: TokenText) -> Value {
    match kind {
        Kind::Chat => json!({"content": ls.iter().map(|l| chat_logprob(l, text)).collect::<Vec<_>>()}),
        Kind::Completion => completion_logprobs(&ls.iter().map(|l| (l.token, Some(l))).collect::<Vec<_>>(), text),
    }
}

/// A completion's log-probabilities with its echoed prompt's first.
fn echoed_logprobs(e: &Echo, ls: &[TokenLogprob], text: TokenText) -> Value {
    let none = Vec::new();
    let prompt = e.logprobs.as_ref().unwrap_or(&none);
    let mut all: Vec<(u32, Option<&TokenLogprob>)> =
        e.tokens.iter().enumerate().map(|(i, &t)| (t, prompt.get(i).and_then(Option::as_ref))).collect();
    all.extend(ls.iter().map(|l| (l.token, Some(l))));
    completion_logprobs(&all, text)
}

/// The usage of several choices of one request: one prompt, every choice's tokens.
pub fn usage_of(outs: &[Output]) -> Value {
    let Some(first) = outs.first() else { return Value::Null };
    let mut u = usage(first);
    let completion: usize = outs.iter().map(|o| o.tokens.len()).sum();
    u["completion_tokens"] = json!(completion);
    u["total_tokens"] = json!(first.prompt_tokens + completion);
    u
}

/// One choice of a whole response.
fn choice(m: &Meta, index: usize, out: &Output, want_logprobs: bool, text: TokenText) -> Value {
    let lp = match (&out.echo, want_logprobs) {
        (_, false) => Value::Null,
        (Some(e), true) if m.kind == Kind::Completion => echoed_logprobs(e, &out.logprobs, text),
        (_, true) => logprobs_value(m.kind, &out.logprobs, text),
    };
    match m.kind {
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
            json!({"index": index, "message": msg, "logprobs": lp, "finish_reason": out.finish_reason})
        }
        Kind::Completion => {
            let shown = match &out.echo {
                Some(e) => format!("{}{}", e.text, out.content),
                None => out.content.clone(),
            };
            json!({"index": index, "text": shown, "logprobs": lp, "finish_reason": out.finish_reason})
        }
    }
}

/// The whole (non-streamed) response.
pub fn response(m: &Meta, out: &Output, want_logprobs: bool, text: TokenText) -> Value {
    responses(m, std::slice::from_ref(out), want_logprobs, text)
}

/// The whole response of a request's choices (`n`), in order; usage counts the prompt once, and
/// the extension object is the first choice's (with each choice's `seed` in `seeds`).
pub fn responses(m: &Meta, outs: &[Output], want_logprobs: bool, text: TokenText) -> Value {
    let choices: Vec<Value> = outs.iter().enumerate().map(|(i, o)| choice(m, i, o, want_logprobs, text)).collect();
    let mut ext = outs.first().map_or(Value::Null, |o| o.ext.clone());
    if outs.len() > 1 {
        ext["seeds"] = outs.iter().map(|o| o.ext.get("seed").cloned().unwrap_or(Value::Null)).collect();
    }
    json!({
        "id": m.id, "object": object(m.kind, false), "created": m.created, "model": m.model,
        "choices": choices, "usage": usage_of(outs), "deltafin": ext,
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

/// The usage chunk of `stream_options.include_usage`, after every choice's last chunk.
pub fn usage_chunk(m: &Meta, outs: &[Output]) -> Value {
    let ext = outs.first().map_or(Value::Null, |o| o.ext.clone());
    json!({"id": m.id, "object": object(m.kind, true), "created": m.created, "model": m.model, "choices": [], "usage": usage_of(outs), "deltafin": ext})
}

/// `chunk` as choice `index`'s (chunks are made as choice 0's).
pub fn for_choice(mut chunk: Value, index: usize) -> Value {
    if let Some(c) = chunk.get_mut("choices").and_then(|c| c.get_mut(0)) {
        c["index"] = json!(index);
    }
    chunk
}
