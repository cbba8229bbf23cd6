//! `deltafin serve`: an OpenAI-compatible HTTP server (axum on tokio) in front of one engine.
//!
//! Contract: HTTP is handled on a small tokio runtime; generations run on a dedicated worker
//! thread that owns the [`generator::Generator`] (and so the kept sessions and the memo): one at
//! a time, or with `parallel` N > 1 up to N together in one running batch that requests join and
//! leave at step boundaries ([`running`]). A request waits in a bounded queue (`queue` places
//! besides the running ones); past it the answer is a 429 with `Retry-After`. Every request is validated before it is queued
//! ([`api`]); the worker's sink fails once the client has gone, which cancels the generation at
//! the next token. A panic in a generation is a 500 for that request, never a dead server.
//! A client that stalls or trickles its request head or body is closed after the read timeout
//! ([`conn`]); a prompt whose size alone exceeds the context is refused before it is tokenised.
//! A body is parsed off the async threads, a few at a time, within a budget of JSON values
//! sized by the context ([`json`]): memory per request is bounded by what a request can use, and
//! `/health` answers while large bodies are read and parsed.
//! SIGINT/SIGTERM stop accepting connections, cancel the running generation at its next token,
//! answer queued requests with 503, and return once connections are closed.

pub mod access;
pub mod answer;
pub mod api;
pub mod conn;
pub mod constrained;
pub mod conversation;
pub mod encoder;
pub mod generator;
pub mod json;
pub mod metrics;
pub mod parallel;
pub mod prefix;
pub mod records;
mod running;
pub mod sse;
pub mod state_dir;

use crate::engine::Engine;
use api::{ApiError, GenRequest, Kind, ParseContext};
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use generator::{Delta, Encoder, GenConfig, GenError, Generator, Output, Prepared};
use metrics::Metrics;
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};
use tokio::sync::mpsc as tmpsc;

/// Server settings (the CLI's flags).
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub host: String,
    pub port: u16,
    pub api_key: Option<String>,
    /// Requests that may wait besides the running ones.
    pub queue: usize,
    /// Requests generated together in one running batch (`--parallel`; 1: one at a time).
    pub parallel: usize,
    pub max_request_bytes: usize,
    /// Longest wait for a request's head (from the connection's start or its previous answer)
    /// and, after it, for its body; a slower client is disconnected.
    pub read_timeout: Duration,
    /// The id clients name in `model` (default: the model directory's name).
    pub model_id: String,
    pub generation: GenConfig,
    /// Sampling of requests that set no `temperature` / `top_p` / `top_k` / `min_p`, and the
    /// `max_tokens` of a chat request that sets none.
    pub sampling: api::SamplingDefaults,
    /// One line per request on stderr ([`access`]).
    pub access_log: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
    #[error("cannot start the server runtime: {0}")]
    Runtime(std::io::Error),
    #[error("server error: {0}")]
    Io(std::io::Error),
    #[error(transparent)]
    Engine(#[from] crate::engine::EngineError),
}

/// Longest silence in a stream before a keep-alive comment.
const KEEPALIVE: Duration = Duration::from_secs(15);

/// How long connections may take to finish after SIGINT/SIGTERM.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Request bodies parsed at once (each on a blocking thread): their memory is this many budgets.
const PARSERS: usize = 2;

/// What the worker sends back for one request.
enum Msg {
    Delta(Delta),
    Done(Box<Output>),
    Failed(ApiError),
}

struct Job {
    req: GenRequest,
    prepared: Prepared,
    arrived: Instant,
    tx: tmpsc::UnboundedSender<Msg>,
}

struct AppState {
    opts: ServeOptions,
    jobs: std::sync::Mutex<Option<mpsc::Sender<Job>>>,
    metrics: Arc<Metrics>,
    shutting_down: Arc<AtomicBool>,
    template_takes_tools: bool,
    encoder: Arc<Encoder>,
    engine: Arc<Engine>,
    token_text: Arc<dyn Fn(u32) -> Vec<u8> + Send + Sync>,
    next_id: AtomicU64,
    /// Seconds the last generation took (for Retry-After).
    last_gen_s: Arc<std::sync::Mutex<f64>>,
    /// Places for bodies being parsed ([`PARSERS`]).
    parsers: Arc<tokio::sync::Semaphore>,
}

fn error_response(e: &ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, [(header::CONTENT_TYPE, "application/json")], e.body().to_string()).into_response()
}

fn json_response(v: &Value) -> Response {
    (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Runs the server until SIGINT/SIGTERM; `ready` gets the bound address (port 0 picks one).
pub fn serve(engine: Arc<Engine>, opts: ServeOptions, ready: impl FnOnce(SocketAddr)) -> Result<(), ServeError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("deltafin-http")
        .build()
        .map_err(ServeError::Runtime)?;
    let gen_ = Generator::new(Arc::clone(&engine), opts.generation.clone())?;
    let template_takes_tools = gen_.template_takes_tools();
    let encoder = gen_.encoder();
    let tok = engine.tokenizer().ok();
    let token_text: Arc<dyn Fn(u32) -> Vec<u8> + Send + Sync> = Arc::new(move |id| match &tok {
        Some(t) => t.token_bytes(id).map(<[u8]>::to_vec).unwrap_or_default(),
        None => id.to_string().into_bytes(),
    });
    let metrics = Arc::new(Metrics::default());
    let shutting_down = Arc::new(AtomicBool::new(false));
    let last_gen_s = Arc::new(std::sync::Mutex::new(1.0));
    let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
    let parallel = opts.parallel;
    let worker = {
        let (metrics, stop, last) = (Arc::clone(&metrics), Arc::clone(&shutting_down), Arc::clone(&last_gen_s));
        std::thread::Builder::new()
            .name("deltafin-generate".into())
            .spawn(move || match parallel {
                0 | 1 => worker(gen_, jobs_rx, metrics, stop, last),
                n => running::worker(gen_, jobs_rx, running::Shared { metrics, stop, last_gen_s: last }, n),
            })
            .map_err(ServeError::Io)?
    };
    let state = Arc::new(AppState {
        opts: opts.clone(),
        jobs: std::sync::Mutex::new(Some(jobs_tx)),
        metrics,
        shutting_down: Arc::clone(&shutting_down),
        template_takes_tools,
        encoder,
        engine,
        token_text,
        next_id: AtomicU64::new(1),
        last_gen_s,
        parsers: Arc::new(tokio::sync::Semaphore::new(PARSERS)),
    });
    let result = rt.block_on(async {
        let addr = format!("{}:{}", opts.host, opts.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .map_err(|source| ServeError::Bind { addr: addr.clone(), source })?;
        let local = listener.local_addr().map_err(ServeError::Io)?;
        ready(local);
        let app = router(Arc::clone(&state));
        let stop = Arc::clone(&state);
        let (signalled_tx, mut signalled) = tokio::sync::watch::channel(false);
        let signal = async move {
            shutdown_signal().await;
            tracing::info!("shutting down");
            stop.shutting_down.store(true, Ordering::SeqCst);
            // No new jobs: the worker drains what is queued (503s) and exits.
            if let Ok(mut j) = stop.jobs.lock() {
                j.take();
            }
            let _ = signalled_tx.send(true);
        };
        let server = conn::run(listener, app, opts.read_timeout, signal);
        // A client that never reads its stream must not keep the process alive after a signal.
        let deadline = async move {
            let _ = signalled.wait_for(|s| *s).await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        };
        tokio::select! {
            () = server => Ok(()),
            _ = deadline => {
                tracing::warn!("connections still open {} s after the signal: closing them", SHUTDOWN_GRACE.as_secs());
                Ok(())
            }
        }
    });
    shutting_down.store(true, Ordering::SeqCst);
    if let Ok(mut j) = state.jobs.lock() {
        j.take();
    }
    drop(state);
    let _ = worker.join();
    // Connections still open (a client that never reads) must not hold the process.
    rt.shutdown_timeout(Duration::from_secs(2));
    result
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}

fn router(state: Arc<AppState>) -> Router {
    let api = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/metrics", get(metrics_handler))
        .route_layer(axum::middleware::from_fn_with_state(Arc::clone(&state), auth));
    let access_log = state.opts.access_log;
    let app = Router::new()
        .route("/", get(page))
        .route("/health", get(health))
        .merge(api)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state);
    if access_log { app.layer(axum::middleware::from_fn(access::log)) } else { app }
}

async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.opts.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        // Compare every byte so the time taken does not tell how much of the key was right.
        let ok = given.is_some_and(|g| {
            g.len() == key.len() && g.bytes().zip(key.bytes()).fold(0u8, |a, (x, y)| a | (x ^ y)) == 0
        });
        if !ok {
            st.metrics.request(req.uri().path(), 401);
            return error_response(&ApiError::new(
                401,
                "invalid_request_error",
                "invalid_api_key",
                "Incorrect API key provided.",
            ));
        }
    }
    next.run(req).await
}

async fn not_found() -> Response {
    error_response(&ApiError::new(404, "invalid_request_error", "not_found", "Unknown endpoint."))
}

async fn method_not_allowed() -> Response {
    error_response(&ApiError::new(
        405,
        "invalid_request_error",
        "method_not_allowed",
        "Method not allowed on this endpoint.",
    ))
}

async fn page() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], include_str!("page.html")).into_response()
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
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

fn model_object(id: &str) -> Value {
    json!({"id": id, "object": "model", "created": 0, "owned_by": "deltafin"})
}

async fn models(State(st): State<Arc<AppState>>) -> Response {
    st.metrics.request("/v1/models", 200);
    json_response(&json!({"object": "list", "data": [model_object(&st.opts.model_id)]}))
}

async fn model(State(st): State<Arc<AppState>>, axum::extract::Path(id): axum::extract::Path<String>) -> Response {
    if id != st.opts.model_id {
        return error_response(&ApiError::new(
            404,
            "invalid_request_error",
            "model_not_found",
            format!("The model '{id}' does not exist"),
        ));
    }
    json_response(&model_object(&id))
}

async fn metrics_handler(State(st): State<Arc<AppState>>) -> Response {
    let text = st.metrics.render(&st.engine.source_report(), st.opts.queue);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

async fn chat(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let body = conn::body(req, st.opts.max_request_bytes, st.opts.read_timeout).await;
    generate(st, Kind::Chat, body).await
}

async fn completions(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let body = conn::body(req, st.opts.max_request_bytes, st.opts.read_timeout).await;
    generate(st, Kind::Completion, body).await
}

/// The request in `body`, parsed on a blocking thread once one of the [`PARSERS`] places is free,
/// within the value budget of the engine's context ([`json::value_budget`]).
async fn parse(st: &AppState, kind: Kind, body: Result<Bytes, ApiError>) -> Result<GenRequest, ApiError> {
    let body = body?;
    let failed = || ApiError::new(500, "server_error", "internal_error", "Parsing the request failed.");
    let place = Arc::clone(&st.parsers).acquire_owned().await.map_err(|_| failed())?;
    let (model_id, template_takes_tools, sampling) =
        (st.opts.model_id.clone(), st.template_takes_tools, st.opts.sampling);
    let budget = json::value_budget(st.engine.context_bound());
    let parsed = tokio::task::spawn_blocking(move || {
        let _place = place;
        let v = json::parse(&body, budget)?;
        // The raw bytes are not needed past here.
        drop(body);
        let ctx = ParseContext { model_id: &model_id, template_takes_tools, sampling };
        match kind {
            Kind::Chat => api::parse_chat(api::Owned(v), &ctx),
            Kind::Completion => api::parse_completion(api::Owned(v), &ctx),
        }
    });
    parsed.await.unwrap_or_else(|_| Err(failed()))
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

async fn generate(st: Arc<AppState>, kind: Kind, body: Result<Bytes, ApiError>) -> Response {
    let endpoint = if kind == Kind::Chat { "/v1/chat/completions" } else { "/v1/completions" };
    let arrived = Instant::now();
    let access = access::current();
    let req = match parse(&st, kind, body).await {
        Ok(r) => r,
        Err(e) => {
            st.metrics.request(endpoint, e.status);
            let mut r = error_response(&e);
            if matches!(e.status, 408 | 413) || e.code == Some("invalid_body") {
                // The body was not read to its end: the connection cannot carry another request.
                r.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            return r;
        }
    };
    // Tokenising (the chat template may take a while) runs off the async threads, and every
    // request error is known before the request queues.
    let enc = Arc::clone(&st.encoder);
    let (req, prepared) = match tokio::task::spawn_blocking(move || {
        let p = enc.prepare(&req);
        (req, p)
    })
    .await
    {
        Ok((req, Ok(p))) => (req, p),
        Ok((_, Err(e))) => {
            st.metrics.request(endpoint, e.status);
            return error_response(&e);
        }
        Err(_) => {
            st.metrics.request(endpoint, 500);
            return error_response(&ApiError::new(
                500,
                "server_error",
                "internal_error",
                "Preparing the prompt failed.",
            ));
        }
    };
    let (tx, mut rx) = tmpsc::unbounded_channel();
    let (stream, include_usage, want_lp) = (req.stream, req.include_usage, req.logprobs.is_some());
    if let Err(e) = enqueue(&st, Job { req, prepared, arrived, tx }) {
        st.metrics.request(endpoint, e.status);
        let mut r = error_response(&e);
        if e.status == 429 {
            let secs = st.last_gen_s.lock().map_or(1.0, |s| *s).ceil().max(1.0) as u64;
            if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        return r;
    }
    let n = st.next_id.fetch_add(1, Ordering::Relaxed);
    let prefix = if kind == Kind::Chat { "chatcmpl" } else { "cmpl" };
    let meta = sse::Meta { id: format!("{prefix}-{n}"), created: unix_now(), model: st.opts.model_id.clone(), kind };
    let tt = Arc::clone(&st.token_text);
    if !stream {
        // The first message decides the status: an error before any token is an error response.
        let first = match rx.recv().await {
            Some(Msg::Failed(e)) => {
                st.metrics.request(endpoint, e.status);
                return error_response(&e);
            }
            None => {
                let e = ApiError::new(500, "server_error", "internal_error", "The generation ended without an answer.");
                st.metrics.request(endpoint, 500);
                return error_response(&e);
            }
            Some(m) => m,
        };
        st.metrics.request(endpoint, 200);
        let mut msg = first;
        loop {
            match msg {
                Msg::Done(out) => {
                    access::usage(&access, &out);
                    return json_response(&sse::response(&meta, &out, want_lp, &*tt));
                }
                Msg::Failed(e) => return error_response(&e),
                Msg::Delta(_) => {}
            }
            msg = match rx.recv().await {
                Some(m) => m,
                None => {
                    return error_response(&ApiError::new(
                        500,
                        "server_error",
                        "internal_error",
                        "The generation stopped.",
                    ));
                }
            };
        }
    }
    // A stream starts at once (headers, the role chunk) and sends a comment line while nothing
    // else comes (a queue wait, a long prefill), so clients and proxies do not time out.
    st.metrics.request(endpoint, 200);
    let first: Option<Msg> = None;
    let mut pending = vec![];
    if kind == Kind::Chat {
        pending.push(sse::event(&sse::role_chunk(&meta).to_string()));
    }
    let state = (first, rx, meta, tt, pending, false);
    let body = futures_util::stream::unfold(state, move |(mut first, mut rx, meta, tt, mut pending, done)| {
        let access = access.clone();
        async move {
            loop {
                if let Some(ev) = pending.pop() {
                    return Some((
                        Ok::<_, std::convert::Infallible>(Bytes::from(ev)),
                        (first, rx, meta, tt, pending, done),
                    ));
                }
                if done {
                    return None;
                }
                let msg = match first.take() {
                    Some(m) => m,
                    None => match tokio::time::timeout(KEEPALIVE, rx.recv()).await {
                        Ok(Some(m)) => m,
                        Ok(None) => return None,
                        Err(_) => {
                            pending.push(": keep-alive\n\n".to_string());
                            continue;
                        }
                    },
                };
                // `pending` is a stack: push the last event first.
                match msg {
                    Msg::Delta(d) => {
                        let mut chunks: Vec<_> = sse::delta_chunk(&meta, &d, &*tt).into_iter().collect();
                        chunks.extend(sse::tool_call_chunks(&meta, &d));
                        for c in chunks.iter().rev() {
                            pending.push(sse::event(&c.to_string()));
                        }
                    }
                    Msg::Done(out) => {
                        access::usage(&access, &out);
                        pending.push(sse::event("[DONE]"));
                        if include_usage {
                            pending.push(sse::event(&sse::usage_chunk(&meta, &out).to_string()));
                        }
                        pending.push(sse::event(&sse::finish_chunk(&meta, &out, !include_usage).to_string()));
                        return pending.pop().map(|ev| (Ok(Bytes::from(ev)), (first, rx, meta, tt, pending, true)));
                    }
                    Msg::Failed(e) => {
                        pending.push(sse::event(&e.body().to_string()));
                        return pending.pop().map(|ev| (Ok(Bytes::from(ev)), (first, rx, meta, tt, pending, true)));
                    }
                }
            }
        }
    });
    let mut headers = HeaderMap::new();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    (headers, Body::from_stream(body)).into_response()
}

/// The generation thread: one job at a time, in arrival order.
fn worker(
    mut gen_: Generator,
    jobs: mpsc::Receiver<Job>,
    metrics: Arc<Metrics>,
    stop: Arc<AtomicBool>,
    last_gen_s: Arc<std::sync::Mutex<f64>>,
) {
    while let Ok(job) = jobs.recv() {
        let t0 = Instant::now();
        if stop.load(Ordering::SeqCst) {
            let _ = job.tx.send(Msg::Failed(ApiError::new(
                503,
                "server_error",
                "shutting_down",
                "The server is shutting down.",
            )));
        } else if job.tx.is_closed() {
            // The client left while waiting.
            gen_.totals.cancelled += 1;
            if let Ok(mut t) = metrics.totals.lock() {
                *t = gen_.totals.clone();
            }
        } else {
            let queued = job.arrived.elapsed().as_secs_f64();
            let tx = &job.tx;
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                gen_.generate_prepared(&job.req, job.prepared.clone(), queued, &mut |d| {
                    !stop.load(Ordering::SeqCst) && tx.send(Msg::Delta(d.clone())).is_ok()
                })
            }));
            let msg = match run {
                Ok(Ok(out)) => {
                    if let Some(t) = out.ext.get("ttft_s").and_then(Value::as_f64) {
                        metrics.ttft(t);
                    }
                    Msg::Done(Box::new(out))
                }
                Ok(Err(GenError::Request(e))) => Msg::Failed(e),
                Ok(Err(e @ GenError::Forward(_))) => {
                    Msg::Failed(ApiError::new(500, "server_error", "generation_failed", e.to_string()))
                }
                Err(_) => {
                    tracing::error!("a generation panicked; its request gets a 500");
                    Msg::Failed(ApiError::new(
                        500,
                        "server_error",
                        "internal_error",
                        "The generation failed unexpectedly.",
                    ))
                }
            };
            if let Ok(mut t) = metrics.totals.lock() {
                *t = gen_.totals.clone();
            }
            if let Ok(mut s) = last_gen_s.lock() {
                *s = t0.elapsed().as_secs_f64();
            }
            // Free the place first: a client that sends its next request as soon as this answer
            // arrives must not find the queue still full.
            metrics.pending.fetch_sub(1, Ordering::SeqCst);
            let _ = job.tx.send(msg);
            continue;
        }
        metrics.pending.fetch_sub(1, Ordering::SeqCst);
    }
}
