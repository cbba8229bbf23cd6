//! Requests of the OpenAI-compatible API (and of batch input lines), validated strictly.
//!
//! Contract: [`parse_chat`], [`parse_completion`] and [`parse_batch_line`] turn a JSON body into a
//! [`GenRequest`] or an [`ApiError`] in OpenAI's error shape that names the offending field
//! (`param`): unknown fields, wrong types, out-of-range values and unsupported features (image
//! parts, `echo` in a stream, `n > 1` in a batch line, tools when the chat template cannot take
//! them; tools, `tool_choice` and `response_format` are `tools`') are all 400s.
//! Standard fields that cannot change the answer (`store`, `metadata`, `service_tier`, `user`,
//! `prediction`, ...: [`IGNORED`]) are accepted and ignored, each named in a debug log line; a
//! standard field that would change it is honoured (`top_k`, `min_p`, `chat_template_kwargs`'
//! thinking) or, where this server cannot do it, a 400 — never silently dropped.
//! Nothing here panics on any input. A body is taken apart, not copied: the server hands its
//! parsed document over ([`JsonBody`]); how it was parsed within a memory bound is `json`'s.

use super::ApiError;
use crate::model::chat::Thinking;
use crate::sample::{MAX_LOGIT_BIAS, SamplingSpec};
use serde_json::{Map, Value};
pub use tools::{ResponseFormat, ToolChoice, template_vars};

mod tools;

/// Most choices (`n`) one request may ask for.
pub const MAX_N: usize = 16;

/// Longest stop sequence accepted.
pub const MAX_STOP_BYTES: usize = 1024;

/// Fields of OpenAI's API (and vLLM's, llama.cpp's) that do not change what is generated here,
/// accepted and ignored: platform bookkeeping, and a speed hint (`prediction`).
pub const IGNORED: [&str; 7] =
    ["store", "metadata", "service_tier", "user", "safety_identifier", "prompt_cache_key", "prediction"];

/// What to generate from.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// Raw text (completions).
    Text(String),
    /// Token ids (completions).
    Ids(Vec<u32>),
    /// Chat messages, normalised to {role, content: string, ...} for the template.
    Messages(Value),
}

/// Which endpoint shape the answer takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completion,
}

/// One validated generation request.
#[derive(Clone, Debug, PartialEq)]
pub struct GenRequest {
    pub kind: Kind,
    pub prompt: Prompt,
    /// Tokens to produce at most (None: up to the context bound, and at most
    /// `default_max_tokens`); a prompt plus these past the context is an error.
    pub max_tokens: Option<usize>,
    /// Without `max_tokens`: at most this many, fewer when the context has less room (a chat
    /// request's bounded default, [`ParseContext::max_tokens`]).
    pub default_max_tokens: Option<usize>,
    pub stop: Vec<String>,
    /// How its tokens are picked: the request's `temperature`, `top_p`, `top_k`, `min_p` and
    /// `seed` over the server's defaults (no seed: a fresh one when it runs).
    pub sampling: SamplingSpec,
    /// Choices to generate (`n`): choice i samples with the seed + i
    /// ([`SamplingSpec::for_choice`]).
    pub n: usize,
    /// Log-probabilities with this many alternatives (None: off).
    pub logprobs: Option<usize>,
    /// A completion's answer starts with its prompt (with `logprobs`: the prompt's too).
    pub echo: bool,
    pub stream: bool,
    pub include_usage: bool,
    /// The chat template's thinking setting (None: the model's default, from its
    /// generation_config.json's `chat_template_kwargs`, else the template's).
    pub thinking: Option<Thinking>,
    pub tools: Option<Value>,
    pub tool_choice: ToolChoice,
    /// Several calls in one answer may be enforced (`tool_choice` required); true by default.
    pub parallel_tool_calls: bool,
    pub response_format: ResponseFormat,
}

/// What the parser needs to know about the model.
pub struct ParseContext<'a> {
    /// The served model's id; a request naming another model gets a 404.
    pub model_id: &'a str,
    /// The chat template mentions `tools`.
    pub template_takes_tools: bool,
    /// The sampling of a request that sets no `temperature` / `top_p` / `top_k` / `min_p`: greedy
    /// unless the server was started with others (its flags, or the demo's generation_config.json).
    pub sampling: SamplingSpec,
    /// The most tokens a chat request that sets no `max_tokens` gets (fewer where the context has
    /// less room; None: up to the context bound).
    pub max_tokens: Option<usize>,
}

/// A request's JSON document: borrowed (a test's or a batch line's, copied first) or [`Owned`]
/// (the server's, taken apart without a copy).
pub trait JsonBody {
    fn into_value(self) -> Value;
}

/// A document the parser may take apart.
pub struct Owned(pub Value);

impl JsonBody for Owned {
    fn into_value(self) -> Value {
        self.0
    }
}

impl JsonBody for &Value {
    fn into_value(self) -> Value {
        self.clone()
    }
}

/// A JSON object whose fields are taken one by one; whatever is left is an unknown field.
struct Fields {
    map: Map<String, Value>,
    prefix: String,
}

impl Fields {
    fn new(v: impl JsonBody, prefix: &str) -> Result<Self, ApiError> {
        match v.into_value() {
            Value::Object(map) => Ok(Fields { map, prefix: prefix.to_string() }),
            _ => Err(ApiError::invalid(
                if prefix.is_empty() { "body".to_string() } else { prefix.trim_end_matches('.').to_string() },
                "expected a JSON object",
            )),
        }
    }

    fn name(&self, k: &str) -> String {
        format!("{}{k}", self.prefix)
    }

    /// The field, with JSON null treated as absent (as OpenAI does).
    fn take(&mut self, k: &str) -> Option<Value> {
        self.map.remove(k).filter(|v| !v.is_null())
    }

    fn bool(&mut self, k: &str) -> Result<Option<bool>, ApiError> {
        match self.take(k) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            Some(_) => Err(ApiError::invalid(self.name(k), format!("'{}' must be a boolean", self.name(k)))),
        }
    }

    fn number(&mut self, k: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
        match self.take(k) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
                Some(x) => Err(ApiError::invalid(
                    self.name(k),
                    format!("'{}' is {x}; it must be in {lo}..={hi}", self.name(k)),
                )),
                None => Err(ApiError::invalid(self.name(k), format!("'{}' must be a number", self.name(k)))),
            },
        }
    }

    fn integer(&mut self, k: &str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
        match self.take(k) {
            None => Ok(None),
            Some(v) => match v.as_i64().or_else(|| v.as_u64().map(|_| i64::MAX)) {
                Some(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
                Some(_) => Err(ApiError::invalid(
                    self.name(k),
                    format!("'{}' must be an integer in {lo}..={hi}", self.name(k)),
                )),
                None => Err(ApiError::invalid(self.name(k), format!("'{}' must be an integer", self.name(k)))),
            },
        }
    }

    fn string(&mut self, k: &str) -> Result<Option<String>, ApiError> {
        match self.take(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(ApiError::invalid(self.name(k), format!("'{}' must be a string", self.name(k)))),
        }
    }

    /// Takes the standard fields that change nothing here ([`IGNORED`]), naming each in a debug
    /// log line.
    fn ignore_standard(&mut self) {
        for k in IGNORED {
            if self.map.remove(k).is_some() {
                tracing::debug!("request field '{}' ignored (it does not change the answer here)", self.name(k));
            }
        }
    }

    /// Any field left over is not part of the API (or not supported here).
    fn finish(self) -> Result<(), ApiError> {
        match self.map.keys().next() {
            None => Ok(()),
            Some(k) => Err(ApiError::invalid(
                self.name(k),
                format!("Unrecognized request argument supplied: {}", self.name(k)),
            )
            .with_code("unknown_parameter")),
        }
    }
}

fn unsupported(param: &str, what: &str) -> ApiError {
    ApiError::invalid(param, format!("'{param}': {what} is not supported by this server"))
        .with_code("unsupported_value")
}

/// Options shared by chat, completions and batch lines.
fn common(f: &mut Fields, kind: Kind, r: &mut GenRequest) -> Result<(), ApiError> {
    // A completion may ask for none (with `echo`: only the prompt's log-probabilities).
    let least = if kind == Kind::Completion { 0 } else { 1 };
    let max_tokens = f.integer("max_tokens", least, i64::MAX)?;
    let max_completion = if kind == Kind::Chat { f.integer("max_completion_tokens", 1, i64::MAX)? } else { None };
    r.max_tokens = max_completion.or(max_tokens).map(|n| usize::try_from(n).unwrap_or(usize::MAX));
    r.stop = match f.take("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(a)) if a.len() <= 4 => a
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| ApiError::invalid(f.name("stop"), "'stop' must be a string or a list of strings"))?,
        Some(Value::Array(_)) => return Err(ApiError::invalid(f.name("stop"), "'stop' takes at most 4 sequences")),
        Some(_) => return Err(ApiError::invalid(f.name("stop"), "'stop' must be a string or a list of strings")),
    };
    if r.stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid(f.name("stop"), "'stop' sequences must not be empty"));
    }
    // Held-back text is checked against every stop at each token: keep that small.
    if r.stop.iter().any(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::invalid(f.name("stop"), format!("'stop' sequences are at most {MAX_STOP_BYTES} bytes")));
    }
    sampling(f, &mut r.sampling)?;
    r.n = f.integer("n", 1, MAX_N as i64)?.map_or(1, |n| n as usize);
    r.stream = f.bool("stream")?.unwrap_or(false);
    if let Some(o) = f.take("stream_options") {
        if !r.stream {
            return Err(ApiError::invalid(
                f.name("stream_options"),
                "'stream_options' is only allowed when 'stream' is true",
            ));
        }
        let mut so = Fields::new(Owned(o), &f.name("stream_options."))?;
        r.include_usage = so.bool("include_usage")?.unwrap_or(false);
        // Random padding against length side channels: none here.
        if so.bool("include_obfuscation")?.is_some() {
            tracing::debug!("request field '{}' ignored", so.name("include_obfuscation"));
        }
        so.finish()?;
    }
    Ok(())
}

/// OpenAI's `logit_bias`: {"token id": bias in -100..=100}, at most [`MAX_LOGIT_BIAS`] tokens
/// (ids past the vocabulary are refused when the request is prepared), as ascending pairs.
fn logit_bias(v: Value, name: &str) -> Result<Vec<(u32, f64)>, ApiError> {
    let Value::Object(m) = v else {
        return Err(ApiError::invalid(name, format!("'{name}' must be an object of token ids to biases")));
    };
    if m.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::invalid(name, format!("'{name}' takes at most {MAX_LOGIT_BIAS} tokens")));
    }
    let mut out = Vec::with_capacity(m.len());
    for (k, b) in m {
        let id: u32 =
            k.parse().map_err(|_| ApiError::invalid(name, format!("'{name}': key '{k}' is not a token id")))?;
        let b = b.as_f64().filter(|b| (-100.0..=100.0).contains(b)).ok_or_else(|| {
            ApiError::invalid(name, format!("'{name}': the bias of {k} must be a number in -100..=100"))
        })?;
        out.push((id, b));
    }
    out.sort_by_key(|e| e.0);
    if out.windows(2).any(|w| w[0].0 == w[1].0) {
        return Err(ApiError::invalid(name, format!("'{name}' names a token twice")));
    }
    Ok(out)
}

/// The sampling fields over `s` (the server's defaults): `temperature`, `top_p`, vLLM's and
/// llama.cpp's `top_k`, `min_p` and `repetition_penalty`, OpenAI's `frequency_penalty`,
/// `presence_penalty` and `logit_bias`, and `seed`.
fn sampling(f: &mut Fields, s: &mut SamplingSpec) -> Result<(), ApiError> {
    s.temperature = f.number("temperature", 0.0, 2.0)?.unwrap_or(s.temperature);
    s.top_p = f.number("top_p", 0.0, 1.0)?.unwrap_or(s.top_p);
    // -1 is vLLM's "off", as 0 is.
    if let Some(k) = f.integer("top_k", -1, i64::MAX)? {
        s.top_k = usize::try_from(k).unwrap_or(0);
    }
    s.min_p = f.number("min_p", 0.0, 1.0)?.unwrap_or(s.min_p);
    // vLLM's and llama.cpp's multiplicative penalty (1 is none), OpenAI's additive ones.
    if let Some(x) = f.number("repetition_penalty", 0.0, f64::MAX)? {
        if x <= 0.0 {
            return Err(ApiError::invalid(f.name("repetition_penalty"), "'repetition_penalty' must be above 0"));
        }
        s.repetition_penalty = x;
    }
    s.frequency_penalty = f.number("frequency_penalty", -2.0, 2.0)?.unwrap_or(s.frequency_penalty);
    s.presence_penalty = f.number("presence_penalty", -2.0, 2.0)?.unwrap_or(s.presence_penalty);
    if let Some(v) = f.take("logit_bias") {
        s.logit_bias = logit_bias(v, &f.name("logit_bias"))?;
    }
    // OpenAI seeds are signed 64-bit; the bits seed the sampler.
    s.seed = f.integer("seed", i64::MIN, i64::MAX)?.map(|s| s as u64);
    Ok(())
}

fn model(f: &mut Fields, ctx: &ParseContext, required: bool) -> Result<(), ApiError> {
    match f.string("model")? {
        None if required => {
            Err(ApiError::invalid("model", "you must provide a model parameter")
                .with_code("missing_required_parameter"))
        }
        Some(m) if m != ctx.model_id => Err(ApiError {
            status: 404,
            message: format!("The model '{m}' does not exist; this server serves '{}'", ctx.model_id),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }),
        _ => Ok(()),
    }
}

/// A request with every option at its default (the context's sampling and `max_tokens`).
fn empty_request(kind: Kind, prompt: Prompt, ctx: &ParseContext) -> GenRequest {
    GenRequest::new(kind, prompt, ctx.sampling.clone(), ctx.max_tokens)
}

impl GenRequest {
    /// A request with every option at its default: `sampling` (without its seed), for chat
    /// `max_tokens` as the default bound, no stop strings, no log-probabilities, not streamed, the
    /// model's thinking.
    pub fn new(kind: Kind, prompt: Prompt, sampling: SamplingSpec, max_tokens: Option<usize>) -> Self {
        GenRequest {
            kind,
            prompt,
            max_tokens: None,
            default_max_tokens: if kind == Kind::Chat { max_tokens } else { None },
            stop: Vec::new(),
            sampling: SamplingSpec { seed: None, ..sampling },
            n: 1,
            logprobs: None,
            echo: false,
            stream: false,
            include_usage: false,
            thinking: None,
            tools: None,
            tool_choice: ToolChoice::Auto,
            parallel_tool_calls: true,
            response_format: ResponseFormat::Text,
        }
    }
}

/// Messages normalised for the template: text parts joined, `developer` as `system`.
fn messages(v: Value, prefix: &str) -> Result<Value, ApiError> {
    let Value::Array(list) = v else {
        return Err(ApiError::invalid(format!("{prefix}messages"), "'messages' must be a list"));
    };
    if list.is_empty() {
        return Err(ApiError::invalid(format!("{prefix}messages"), "'messages' must not be empty"));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.into_iter().enumerate() {
        let at = format!("{prefix}messages[{i}]");
        let mut f = Fields::new(Owned(m), &format!("{at}."))?;
        let role =
            f.string("role")?.ok_or_else(|| ApiError::invalid(format!("{at}.role"), "each message needs a 'role'"))?;
        let role = match role.as_str() {
            "system" | "user" | "assistant" | "tool" => role,
            "developer" => "system".to_string(),
            other => return Err(ApiError::invalid(format!("{at}.role"), format!("unknown role '{other}'"))),
        };
        let content = match f.take("content") {
            None if role == "assistant" => String::new(),
            None => return Err(ApiError::invalid(format!("{at}.content"), "the message has no 'content'")),
            Some(Value::String(s)) => s,
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for (j, p) in parts.into_iter().enumerate() {
                    let mut pf = Fields::new(Owned(p), &format!("{at}.content[{j}]."))?;
                    match pf.string("type")?.as_deref() {
                        Some("text") => {}
                        Some(t) => {
                            return Err(unsupported(
                                &format!("{at}.content[{j}].type"),
                                &format!("content part type '{t}'"),
                            ));
                        }
                        None => {
                            return Err(ApiError::invalid(
                                format!("{at}.content[{j}].type"),
                                "each content part needs a 'type'",
                            ));
                        }
                    }
                    text.push_str(&pf.string("text")?.ok_or_else(|| {
                        ApiError::invalid(format!("{at}.content[{j}].text"), "a text part needs 'text'")
                    })?);
                    pf.finish()?;
                }
                text
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    format!("{at}.content"),
                    "'content' must be a string or a list of parts",
                ));
            }
        };
        let mut msg = serde_json::json!({"role": role, "content": content});
        if let Some(n) = f.string("name")? {
            msg["name"] = Value::String(n);
        }
        if let Some(r) = f.string("reasoning_content")? {
            msg["reasoning_content"] = Value::String(r);
        }
        if role == "tool"
            && let Some(id) = f.string("tool_call_id")?
        {
            msg["tool_call_id"] = Value::String(id);
        }
        if role == "assistant"
            && let Some(tc) = f.take("tool_calls")
        {
            msg["tool_calls"] = tc;
        }
        f.finish()?;
        out.push(msg);
    }
    Ok(Value::Array(out))
}

fn chat_fields(f: &mut Fields, ctx: &ParseContext, r: &mut GenRequest) -> Result<(), ApiError> {
    let lp = f.bool("logprobs")?.unwrap_or(false);
    let top = f.integer("top_logprobs", 0, 20)?;
    if top.is_some() && !lp {
        return Err(ApiError::invalid(f.name("top_logprobs"), "'top_logprobs' needs 'logprobs' set to true"));
    }
    r.logprobs = lp.then(|| top.unwrap_or(0) as usize);
    r.thinking = match f.string("reasoning_effort")?.as_deref() {
        None => None,
        Some("none" | "minimal") => Some(Thinking::Off),
        Some("low") => Some(Thinking::Low),
        Some("medium") => Some(Thinking::High),
        Some("high" | "max") => Some(Thinking::Max),
        Some(o) => {
            return Err(ApiError::invalid(
                f.name("reasoning_effort"),
                format!("unknown reasoning_effort '{o}' (none, minimal, low, medium, high, max)"),
            ));
        }
    };
    tools::fields(f, ctx, r)?;
    // vLLM's way to set the template's variables; the K3 template's thinking ones are taken.
    if let Some(k) = f.take("chat_template_kwargs") {
        let name = f.name("chat_template_kwargs");
        match crate::model::generation::thinking_kwargs(&k) {
            Ok(Some(t)) if r.thinking.is_some_and(|r| r != t) => {
                return Err(ApiError::invalid(name, "'chat_template_kwargs' and 'reasoning_effort' disagree"));
            }
            Ok(t) => r.thinking = r.thinking.or(t),
            Err((field, msg)) if field.is_empty() => return Err(ApiError::invalid(name, msg)),
            Err((field, msg)) => return Err(ApiError::invalid(format!("{name}.{field}"), msg)),
        }
    }
    // Standard fields whose only supported value changes nothing; any other would change the answer.
    match f.take("modalities") {
        None => {}
        Some(Value::Array(a)) if a.iter().all(|m| m.as_str() == Some("text")) => {}
        Some(_) => return Err(unsupported(&f.name("modalities"), "an output modality other than text")),
    }
    match f.string("verbosity")?.as_deref() {
        None | Some("medium") => {}
        Some(_) => return Err(unsupported(&f.name("verbosity"), "verbosity other than medium")),
    }
    for (k, what) in [
        ("audio", "audio output"),
        ("web_search_options", "web search"),
        ("functions", "'functions' (deprecated; give 'tools')"),
        ("function_call", "'function_call' (deprecated; give 'tool_choice')"),
    ] {
        if f.take(k).is_some() {
            return Err(unsupported(&f.name(k), what));
        }
    }
    Ok(())
}

/// `POST /v1/chat/completions`.
pub fn parse_chat(body: impl JsonBody, ctx: &ParseContext) -> Result<GenRequest, ApiError> {
    let mut f = Fields::new(body, "")?;
    model(&mut f, ctx, true)?;
    let msgs = f.take("messages").ok_or_else(|| {
        ApiError::invalid("messages", "you must provide 'messages'").with_code("missing_required_parameter")
    })?;
    let mut r = empty_request(Kind::Chat, Prompt::Messages(messages(msgs, "")?), ctx);
    common(&mut f, Kind::Chat, &mut r)?;
    chat_fields(&mut f, ctx, &mut r)?;
    f.ignore_standard();
    f.finish()?;
    Ok(r)
}

fn completion_prompt(v: Value, name: &str) -> Result<Prompt, ApiError> {
    let bad = || ApiError::invalid(name, "'prompt' must be a string, a list of token ids, or a list with one of those");
    let ids = |a: &[Value]| -> Option<Vec<u32>> {
        a.iter().map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok())).collect()
    };
    match v {
        Value::String(s) => Ok(Prompt::Text(s)),
        Value::Array(a) if a.iter().all(Value::is_number) && !a.is_empty() => ids(&a).map(Prompt::Ids).ok_or_else(bad),
        Value::Array(a) if a.len() == 1 => match &a[0] {
            Value::String(s) => Ok(Prompt::Text(s.clone())),
            Value::Array(inner) if !inner.is_empty() => ids(inner).map(Prompt::Ids).ok_or_else(bad),
            _ => Err(bad()),
        },
        Value::Array(a) if a.len() > 1 && a.iter().all(|x| x.is_string() || x.is_array()) => {
            Err(unsupported(name, "more than one prompt per request"))
        }
        _ => Err(bad()),
    }
}

/// `POST /v1/completions`.
pub fn parse_completion(body: impl JsonBody, ctx: &ParseContext) -> Result<GenRequest, ApiError> {
    let mut f = Fields::new(body, "")?;
    model(&mut f, ctx, true)?;
    let p = f.take("prompt").ok_or_else(|| {
        ApiError::invalid("prompt", "you must provide 'prompt'").with_code("missing_required_parameter")
    })?;
    let mut r = empty_request(Kind::Completion, completion_prompt(p, "prompt")?, ctx);
    common(&mut f, Kind::Completion, &mut r)?;
    // OpenAI's completions default.
    r.max_tokens = r.max_tokens.or(Some(16));
    r.logprobs = f.integer("logprobs", 0, 5)?.map(|n| n as usize);
    r.echo = f.bool("echo")?.unwrap_or(false);
    if r.echo && r.stream {
        return Err(unsupported("echo", "echo in a stream"));
    }
    if f.string("suffix")?.is_some() {
        return Err(unsupported("suffix", "suffix"));
    }
    if let Some(b) = f.integer("best_of", i64::MIN, i64::MAX)?
        && b != 1
    {
        return Err(unsupported("best_of", "best_of other than 1"));
    }
    f.ignore_standard();
    f.finish()?;
    Ok(r)
}

/// One batch input line: `{"id", "prompt" | "messages", ...}` with the server's option names
/// (`stream` is not allowed). Returns the id (a string or number, as text) and the request.
pub fn parse_batch_line(line: &Value, ctx: &ParseContext) -> (Option<String>, Result<GenRequest, ApiError>) {
    let id = match line.get("id") {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Number(n)) => Some(n.to_string()),
        _ => None,
    };
    let parse = || -> Result<GenRequest, ApiError> {
        let mut f = Fields::new(line, "")?;
        match f.take("id") {
            Some(Value::String(_) | Value::Number(_)) => {}
            _ => return Err(ApiError::invalid("id", "each line needs an 'id' (a string or a number)")),
        }
        model(&mut f, ctx, false)?;
        let mut r = match (f.take("prompt"), f.take("messages")) {
            (Some(p), None) => {
                let mut r = empty_request(Kind::Completion, completion_prompt(p, "prompt")?, ctx);
                r.logprobs = f.integer("logprobs", 0, 20)?.map(|n| n as usize);
                r
            }
            (None, Some(m)) => {
                let mut r = empty_request(Kind::Chat, Prompt::Messages(messages(m, "")?), ctx);
                chat_fields(&mut f, ctx, &mut r)?;
                r
            }
            (Some(_), Some(_)) => return Err(ApiError::invalid("prompt", "give 'prompt' or 'messages', not both")),
            (None, None) => return Err(ApiError::invalid("prompt", "each line needs 'prompt' or 'messages'")),
        };
        let kind = r.kind;
        common(&mut f, kind, &mut r)?;
        if r.stream {
            return Err(unsupported("stream", "streaming in a batch"));
        }
        if r.n != 1 {
            return Err(unsupported("n", "n other than 1 in a batch line"));
        }
        f.ignore_standard();
        f.finish()?;
        Ok(r)
    };
    (id, parse())
}

#[cfg(test)]
mod tests;
