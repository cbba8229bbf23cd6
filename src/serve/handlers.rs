//! The server's request handlers: the chat page, `/health`, the model list, `/metrics`, and the
//! two generation endpoints.
//!
//! Contract: a generation request is parsed off the async threads, a few at a time, within a
//! budget of JSON values sized by the context (`api::json`), then prepared (tokenised, checked
//! against the context) before it queues, so every request error is a 4xx before any wait; a full
//! queue is a 429 with `Retry-After` (how long the last generation took). A non-streamed answer's
//! status is its first message's: an error before any token is an error response. A stream
//! starts at once (headers, the chat role chunk) and sends a comment line while nothing else
//! comes (a queue wait, a long prefill), so clients and proxies do not time out; a failure after
//! it started is an error event. Handlers count nothing: `/metrics` counts answers in one place
//! (`metrics::count`).

use super::access::{self, Entry};
use super::{AppState, Job, KEEPALIVE, Msg};
use crate::api::response::{self, Meta, TokenText};
use crate::api::{self, ApiError, GenRequest, Kind, Output, Owned, ParseContext};
use crate::service::generator::Prepared;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;
use tokio::sync::mpsc as tmpsc;

pub(super) fn error_response(e: &ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, [(header::CONTENT_TYPE, "application/json")], e.body().to_string()).into_response()
}

fn json_response(v: &Value) -> Response {
    (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// One server-sent event.
fn event(data: &str) -> String {
    format!("data: {data}\n\n")
}

pub(super) async fn not_found() -> Response {
    error_response(&ApiError::new(404, "invalid_request_error", "not_found", "Unknown endpoint."))
}

pub(super) async fn method_not_allowed() -> Response {
    error_response(&ApiError::new(
        405,
        "invalid_request_error",
        "method_not_allowed",
        "Method not allowed on this endpoint.",
    ))
}

pub(super) async fn page() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], include_str!("page.html")).into_response()
}

pub(super) async fn health(State(st): State<Arc<AppState>>) -> Response {
    if st.shutting_down.load(Ordering::SeqCst) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::CONTENT_TYPE, "application/json")],
            r#"{"status":"shutting_down"}"#,
        )
            .into_response();
    }
    // Storage that fails reads now (a drive given up, a file suspect after a failed read).
    let storage = st.engine.storage_health();
    json_response(&json!({
        "status": if storage.degraded { "degraded" } else { "ok" },
        "model": st.opts.model_id,
        "queue_depth": st.metrics.pending.load(Ordering::Relaxed),
        "storage": storage,
    }))
}

fn model_object(st: &AppState, id: &str) -> Value {
    json!({"id": id, "object": "model", "created": st.created, "owned_by": "deltafin"})
}

pub(super) async fn models(State(st): State<Arc<AppState>>) -> Response {
    json_response(&json!({"object": "list", "data": [model_object(&st, &st.opts.model_id)]}))
}

pub(super) async fn model(
    State(st): State<Arc<AppState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    if id != st.opts.model_id {
        return error_response(&ApiError::new(
            404,
            "invalid_request_error",
            "model_not_found",
            format!("The model '{id}' does not exist"),
        ));
    }
    json_response(&model_object(&st, &id))
}

/// A small JSON body of the tokenizer endpoints (parsed within the value budget).
fn small_json(body: &[u8], budget: usize) -> Result<serde_json::Map<String, Value>, ApiError> {
    match api::json::parse(body, budget)? {
        Value::Object(m) => Ok(m),
        _ => Err(ApiError::invalid("body", "expected a JSON object")),
    }
}

/// The model's tokenizer, or the error of a model without one.
fn tokenizer(st: &AppState) -> Result<&crate::model::tokenizer::Tokenizer, ApiError> {
    st.encoder.tokenizer().ok_or_else(|| ApiError::invalid("prompt", "this model has no tokenizer"))
}

/// `POST /tokenize` (vLLM's): `{"prompt": text}` to `{"tokens", "count", "max_model_len"}`, the
/// ids the completions endpoint gives that text (special tokens' names are plain text; no BOS
/// is added, whatever `add_special_tokens` says). Evaluation harnesses (lm-evaluation-harness's
/// remote tokenizer) count a prompt's tokens with it.
pub(super) async fn tokenize(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let body = match super::conn::body(req, st.opts.max_request_bytes, st.opts.read_timeout).await {
        Ok(b) => b,
        Err(e) => return error_response(&e),
    };
    let run = || -> Result<Value, ApiError> {
        let mut m = small_json(&body, api::json::value_budget(st.engine.context_bound()))?;
        let tok = tokenizer(&st)?;
        let _ = m.remove("add_special_tokens");
        let _ = m.remove("model");
        let text = match m.remove("prompt") {
            Some(Value::String(t)) => t,
            _ => return Err(ApiError::invalid("prompt", "'prompt' must be a string")),
        };
        if let Some(k) = m.keys().next() {
            return Err(ApiError::invalid(k.clone(), format!("Unrecognized request argument supplied: {k}")));
        }
        let ids = tok.encode(&text);
        Ok(json!({"count": ids.len(), "max_model_len": st.engine.context_bound(), "tokens": ids}))
    };
    match tokio::task::block_in_place(run) {
        Ok(v) => json_response(&v),
        Err(e) => error_response(&e),
    }
}

/// `POST /detokenize` (vLLM's): `{"tokens": [ids]}` to `{"prompt": text}` (special tokens by name).
pub(super) async fn detokenize(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let body = match super::conn::body(req, st.opts.max_request_bytes, st.opts.read_timeout).await {
        Ok(b) => b,
        Err(e) => return error_response(&e),
    };
    let run = || -> Result<Value, ApiError> {
        let mut m = small_json(&body, api::json::value_budget(st.engine.context_bound()))?;
        let tok = tokenizer(&st)?;
        let _ = m.remove("model");
        let bad = || ApiError::invalid("tokens", "'tokens' must be a list of token ids in the vocabulary");
        let ids: Vec<u32> = match m.remove("tokens") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
                .collect::<Option<_>>()
                .ok_or_else(bad)?,
            _ => return Err(bad()),
        };
        if let Some(k) = m.keys().next() {
            return Err(ApiError::invalid(k.clone(), format!("Unrecognized request argument supplied: {k}")));
        }
        let text = tok.decode(&ids).map_err(|_| bad())?;
        Ok(json!({"prompt": text}))
    };
    match tokio::task::block_in_place(run) {
        Ok(v) => json_response(&v),
        Err(e) => error_response(&e),
    }
}

/// `GET /tokenizer_info` (vLLM's): the tokenizer's special tokens and the context bound.
pub(super) async fn tokenizer_info(State(st): State<Arc<AppState>>) -> Response {
    match tokenizer(&st) {
        Ok(t) => json_response(&json!({
            "tokenizer_class": "TikTokenTokenizer",
            "bos_token": t.special_id("[BOS]").map(|_| "[BOS]"),
            "eos_token": t.special_id("[EOS]").map(|_| "[EOS]"),
            "eos_token_id": t.special_id("[EOS]"),
            "end_of_message_token_id": t.special_id("<|end_of_msg|>"),
            "pad_token": t.special_id("[PAD]").map(|_| "[PAD]"),
            "model_max_length": st.engine.context_bound(),
            "vocab_size": st.engine.vocab(),
        })),
        Err(e) => error_response(&e),
    }
}

pub(super) async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let text = st.metrics.render(&st.engine.source_report(), st.opts.queue);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

pub(super) async fn chat(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let body = super::conn::body(req, st.opts.max_request_bytes, st.opts.read_timeout).await;
    generate(st, Kind::Chat, body).await
}

pub(super) async fn completions(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let body = super::conn::body(req, st.opts.max_request_bytes, st.opts.read_timeout).await;
    generate(st, Kind::Completion, body).await
}

/// The request in `body`, parsed on a blocking thread once one of the server's `PARSERS` places is
/// free, within the value budget of the engine's context ([`api::json::value_budget`]).
async fn parse(st: &AppState, kind: Kind, body: Result<Bytes, ApiError>) -> Result<GenRequest, ApiError> {
    let body = body?;
    let failed = || ApiError::new(500, "server_error", "internal_error", "Parsing the request failed.");
    let place = Arc::clone(&st.parsers).acquire_owned().await.map_err(|_| failed())?;
    let (model_id, template_takes_tools) = (st.opts.model_id.clone(), st.template_takes_tools);
    let (sampling, max_tokens) = (st.opts.sampling.clone(), st.opts.max_tokens);
    let budget = api::json::value_budget(st.engine.context_bound());
    let parsed = tokio::task::spawn_blocking(move || {
        let _place = place;
        let v = api::json::parse(&body, budget)?;
        // The raw bytes are not needed past here.
        drop(body);
        let ctx = ParseContext { model_id: &model_id, template_takes_tools, sampling, max_tokens };
        match kind {
            Kind::Chat => api::parse_chat(Owned(v), &ctx),
            Kind::Completion => api::parse_completion(Owned(v), &ctx),
        }
    });
    parsed.await.unwrap_or_else(|_| Err(failed()))
}

/// The request parsed and prepared (tokenising, and the chat template, run off the async threads),
/// or the error response: every request error is known before the request queues.
async fn admit(st: &AppState, kind: Kind, body: Result<Bytes, ApiError>) -> Result<(GenRequest, Prepared), Response> {
    let req = match parse(st, kind, body).await {
        Ok(r) => r,
        Err(e) => {
            let mut r = error_response(&e);
            if matches!(e.status, 408 | 413) || e.code == Some("invalid_body") {
                // The body was not read to its end: the connection cannot carry another request.
                r.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            return Err(r);
        }
    };
    let enc = Arc::clone(&st.encoder);
    let prepared = tokio::task::spawn_blocking(move || {
        let p = enc.prepare(&req);
        (req, p)
    });
    match prepared.await {
        Ok((req, Ok(p))) => Ok((req, p)),
        Ok((_, Err(e))) => Err(error_response(&e)),
        Err(_) => {
            Err(error_response(&ApiError::new(500, "server_error", "internal_error", "Preparing the prompt failed.")))
        }
    }
}

/// Counts the request in the queue, or says it is full.
fn enqueue(st: &AppState, job: Job) -> Result<(), ApiError> {
    let cap = st.opts.parallel.max(1) + st.opts.queue;
    let busy = st.metrics.pending.fetch_add(1, Ordering::SeqCst);
    let refuse = |st: &AppState, e: ApiError| {
        st.metrics.pending.fetch_sub(1, Ordering::SeqCst);
        Err(e)
    };
    if busy >= cap {
        st.metrics.rejected.fetch_add(1, Ordering::Relaxed);
        return refuse(
            st,
            ApiError::new(
                429,
                "rate_limit_exceeded",
                "queue_full",
                format!("The server is busy ({busy} requests running or queued); retry later."),
            ),
        );
    }
    let sent = st.jobs.lock().ok().and_then(|j| j.as_ref().map(|tx| tx.send(job).is_ok())).unwrap_or(false);
    if !sent {
        return refuse(st, ApiError::new(503, "server_error", "shutting_down", "The server is shutting down."));
    }
    Ok(())
}

/// The answer to a request the queue refused: a 429 says when to retry.
fn refused(st: &AppState, e: &ApiError) -> Response {
    let mut r = error_response(e);
    if e.status == 429 {
        let secs = st.last_gen_s.lock().map_or(1.0, |s| *s).ceil().max(1.0) as u64;
        if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
            r.headers_mut().insert(header::RETRY_AFTER, v);
        }
    }
    r
}

/// A generation request (see the module contract): admitted, queued, then answered whole or
/// streamed. A request for `n` choices is `n` jobs (choice i sampling with the seed + i, a seed
/// drawn here when the request gives none), answered as one.
async fn generate(st: Arc<AppState>, kind: Kind, body: Result<Bytes, ApiError>) -> Response {
    let arrived = Instant::now();
    let access = access::current();
    let (mut req, prepared) = match admit(&st, kind, body).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    let n = req.n.max(1);
    if n > 1 && req.sampling.seed.is_none() {
        req.sampling.seed = Some(crate::util::fresh_seed());
    }
    let (stream, include_usage, want_lp) = (req.stream, req.include_usage, req.logprobs.is_some());
    let (all_tx, rx) = tmpsc::unbounded_channel();
    for i in 0..n {
        let mut one = req.clone();
        one.n = 1;
        if n > 1 {
            one.sampling = req.sampling.for_choice(i);
        }
        let (tx, mut choice_rx) = tmpsc::unbounded_channel();
        if let Err(e) = enqueue(&st, Job { req: one, prepared: prepared.clone(), arrived, tx }) {
            // Choices already queued end at their first token: their answers have no reader.
            return refused(&st, &e);
        }
        // Each choice's messages, tagged, into the answer's one channel; a reader gone ends it
        // (the choice's generation then ends at its next token).
        let all_tx = all_tx.clone();
        tokio::spawn(async move {
            while let Some(m) = choice_rx.recv().await {
                if all_tx.send((i, m)).is_err() {
                    break;
                }
            }
        });
    }
    drop(all_tx);
    let id = st.next_id.fetch_add(1, Ordering::Relaxed);
    let prefix = if kind == Kind::Chat { "chatcmpl" } else { "cmpl" };
    let meta = Meta {
        id: format!("{prefix}-{}{id}", st.id_prefix),
        created: unix_now(),
        model: st.opts.model_id.clone(),
        kind,
    };
    let tt = Arc::clone(&st.token_text);
    if stream {
        streamed(rx, n, meta, tt, include_usage, access)
    } else {
        whole(rx, n, &meta, &*tt, want_lp, &access).await
    }
}

/// A non-streamed answer of `n` choices: an error of any is the answer's.
async fn whole(
    mut rx: tmpsc::UnboundedReceiver<(usize, Msg)>,
    n: usize,
    meta: &Meta,
    tt: &(dyn Fn(u32) -> Vec<u8> + Send + Sync),
    want_lp: bool,
    access: &Option<Arc<Entry>>,
) -> Response {
    let mut started = false;
    let mut outs: Vec<Option<Output>> = vec![None; n];
    loop {
        match rx.recv().await {
            Some((i, Msg::Done(out))) => {
                outs[i] = Some(*out);
                if outs.iter().all(Option::is_some) {
                    let outs: Vec<Output> = outs.into_iter().flatten().collect();
                    access::usage(access, &outs);
                    return json_response(&response::responses(meta, &outs, want_lp, tt));
                }
            }
            Some((_, Msg::Failed(e))) => return error_response(&e),
            Some((_, Msg::Delta(_))) => started = true,
            None => {
                let why = if started { "The generation stopped." } else { "The generation ended without an answer." };
                return error_response(&ApiError::new(500, "server_error", "internal_error", why));
            }
        }
    }
}

/// A stream's progress: each choice's output once it is done.
struct Streaming {
    outs: Vec<Option<Output>>,
    include_usage: bool,
}

/// The events of one message of choice `i`, pushed last first (`pending` is a stack); true when
/// they end the stream.
fn events(
    (i, msg): (usize, Msg),
    meta: &Meta,
    tt: TokenText,
    s: &mut Streaming,
    access: &Option<Arc<Entry>>,
    pending: &mut Vec<String>,
) -> bool {
    match msg {
        Msg::Delta(d) => {
            let mut chunks: Vec<_> = response::delta_chunk(meta, &d, tt).into_iter().collect();
            chunks.extend(response::tool_call_chunks(meta, &d));
            for c in chunks.into_iter().rev() {
                pending.push(event(&response::for_choice(c, i).to_string()));
            }
            false
        }
        Msg::Done(out) => {
            let last = s.outs.iter().filter(|o| o.is_none()).count() == 1;
            let finish = response::finish_chunk(meta, &out, !s.include_usage);
            s.outs[i] = Some(*out);
            if last {
                let outs: Vec<Output> = s.outs.iter().flatten().cloned().collect();
                access::usage(access, &outs);
                pending.push(event("[DONE]"));
                if s.include_usage {
                    pending.push(event(&response::usage_chunk(meta, &outs).to_string()));
                }
            }
            pending.push(event(&response::for_choice(finish, i).to_string()));
            last
        }
        Msg::Failed(e) => {
            pending.push(event(&e.body().to_string()));
            true
        }
    }
}

/// A streamed answer (see the module contract).
fn streamed(
    rx: tmpsc::UnboundedReceiver<(usize, Msg)>,
    n: usize,
    meta: Meta,
    tt: Arc<dyn Fn(u32) -> Vec<u8> + Send + Sync>,
    include_usage: bool,
    access: Option<Arc<Entry>>,
) -> Response {
    let mut pending = vec![];
    if meta.kind == Kind::Chat {
        for i in (0..n).rev() {
            pending.push(event(&response::for_choice(response::role_chunk(&meta), i).to_string()));
        }
    }
    let s = Streaming { outs: vec![None; n], include_usage };
    let state = (rx, meta, tt, pending, false, s);
    let body = futures_util::stream::unfold(state, move |(mut rx, meta, tt, mut pending, mut done, mut s)| {
        let access = access.clone();
        async move {
            loop {
                if let Some(ev) = pending.pop() {
                    let next = (rx, meta, tt, pending, done, s);
                    return Some((Ok::<_, std::convert::Infallible>(Bytes::from(ev)), next));
                }
                if done {
                    return None;
                }
                match tokio::time::timeout(KEEPALIVE, rx.recv()).await {
                    Ok(Some(m)) => done = events(m, &meta, &*tt, &mut s, &access, &mut pending),
                    Ok(None) => return None,
                    Err(_) => pending.push(": keep-alive\n\n".to_string()),
                }
            }
        }
    });
    let mut headers = HeaderMap::new();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    (headers, Body::from_stream(body)).into_response()
}
