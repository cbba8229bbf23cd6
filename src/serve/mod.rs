//! `deltafin serve`: an OpenAI-compatible HTTP server (axum on tokio) in front of one engine —
//! HTTP only: the protocol is `crate::api`'s, the generation `crate::service`'s.
//!
//! Contract: HTTP is handled on a small tokio runtime; generations run on a dedicated worker
//! thread that owns the `service::generator::Generator` (and so the kept sessions and the memo):
//! one at a time, or with `parallel` N > 1 up to N together in one running batch that requests
//! join and leave at step boundaries ([`running`]). A request waits in a bounded queue (`queue`
//! places besides the running ones); past it the answer is a 429 with `Retry-After`. Every request
//! is validated before it is queued ([`handlers`]); the worker's sink fails once the client has
//! gone, which cancels the generation at the next token. A panic in a generation is a 500 for that
//! request, never a dead server. A client that stalls or trickles its request head or body is
//! closed after the read timeout ([`conn`]); a prompt whose size alone exceeds the context is
//! refused before it is tokenised. A body is parsed off the async threads, a few at a time, within
//! a budget of JSON values sized by the context (`api::json`): memory per request is bounded by
//! what a request can use, and `/health` answers while large bodies are read and parsed. Requests
//! are counted for `/metrics` in one layer around the API ([`metrics::count`]), logged in another
//! ([`access`]). SIGINT/SIGTERM stop accepting connections, cancel the running generation at its
//! next token, answer queued requests with 503, and return once connections are closed.

pub mod access;
pub mod conn;
mod handlers;
pub mod metrics;
mod running;

use crate::api::{ApiError, Delta, GenRequest, Output};
use crate::engine::Engine;
use crate::sample::SamplingSpec;
use crate::service::generator::{Encoder, GenConfig, Generator, Prepared};
use axum::Router;
use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::{Next, from_fn, from_fn_with_state};
use axum::response::Response;
use axum::routing::{get, post};
use metrics::Metrics;
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
    /// Sampling of requests that set no `temperature` / `top_p` / `top_k` / `min_p`.
    pub sampling: SamplingSpec,
    /// The `max_tokens` of a chat request that sets none (None: up to the context bound).
    pub max_tokens: Option<usize>,
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
    /// Response ids: this process's random prefix, then a counter (unique across restarts).
    id_prefix: String,
    next_id: AtomicU64,
    /// `/v1/models`' `created`: the model directory's modification time, else the server's start.
    created: u64,
    /// Seconds the last generation took (for Retry-After).
    last_gen_s: Arc<std::sync::Mutex<f64>>,
    /// Places for bodies being parsed ([`PARSERS`]).
    parsers: Arc<tokio::sync::Semaphore>,
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
    let shared = running::Shared {
        metrics: Arc::clone(&metrics),
        stop: Arc::clone(&shutting_down),
        last_gen_s: Arc::clone(&last_gen_s),
    };
    let parallel = opts.parallel;
    let worker = std::thread::Builder::new()
        .name("deltafin-generate".into())
        .spawn(move || running::worker(gen_, jobs_rx, shared, parallel))
        .map_err(ServeError::Io)?;
    let engine_dir = engine.dir().to_path_buf();
    let state = Arc::new(AppState {
        opts: opts.clone(),
        jobs: std::sync::Mutex::new(Some(jobs_tx)),
        metrics,
        shutting_down: Arc::clone(&shutting_down),
        template_takes_tools,
        encoder,
        engine,
        token_text,
        id_prefix: format!("{:012x}", crate::util::fresh_seed() >> 16),
        next_id: AtomicU64::new(1),
        created: model_created(engine_dir.as_path()),
        last_gen_s,
        parsers: Arc::new(tokio::sync::Semaphore::new(PARSERS)),
    });
    let result = rt.block_on(listen(Arc::clone(&state), ready));
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

/// Unix seconds of the model directory's last change, else now.
fn model_created(dir: &std::path::Path) -> u64 {
    let secs = |t: std::time::SystemTime| t.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    std::fs::metadata(dir).and_then(|m| m.modified()).map(secs).unwrap_or_else(|_| secs(std::time::SystemTime::now()))
}

/// Where a browser on this machine reaches a server bound to `addr` — a loopback address for an
/// unspecified one (0.0.0.0, ::) — and, for that case, a note naming the other machines' address.
pub fn browser_address(addr: SocketAddr) -> (SocketAddr, Option<String>) {
    if !addr.ip().is_unspecified() {
        return (addr, None);
    }
    let local = match addr {
        SocketAddr::V4(_) => SocketAddr::from(([127, 0, 0, 1], addr.port())),
        SocketAddr::V6(_) => SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, addr.port())),
    };
    let host = hostname().unwrap_or_else(|| "THIS-MACHINE".into());
    let note = format!("listening on all interfaces ({addr}); from other machines: http://{host}:{}", addr.port());
    (local, Some(note))
}

/// This machine's host name.
fn hostname() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname(2) writes at most `buf.len()` bytes into our buffer.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0)?;
    let name = String::from_utf8_lossy(&buf[..end]).into_owned();
    (rc == 0 && !name.is_empty()).then_some(name)
}

/// Binds the address and serves connections until a signal and its grace period.
async fn listen(state: Arc<AppState>, ready: impl FnOnce(SocketAddr)) -> Result<(), ServeError> {
    let addr = format!("{}:{}", state.opts.host, state.opts.port);
    let listener =
        tokio::net::TcpListener::bind(&addr).await.map_err(|source| ServeError::Bind { addr: addr.clone(), source })?;
    let local = listener.local_addr().map_err(ServeError::Io)?;
    ready(local);
    let app = router(Arc::clone(&state));
    let read_timeout = state.opts.read_timeout;
    let (signalled_tx, mut signalled) = tokio::sync::watch::channel(false);
    let signal = async move {
        shutdown_signal().await;
        tracing::info!("shutting down");
        state.shutting_down.store(true, Ordering::SeqCst);
        // No new jobs: the worker drains what is queued (503s) and exits.
        if let Ok(mut j) = state.jobs.lock() {
            j.take();
        }
        let _ = signalled_tx.send(true);
    };
    let server = conn::run(listener, app, read_timeout, signal);
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

/// The routes. The API is behind the key ([`auth`]); `/metrics` counts, in one layer around it
/// ([`metrics::count`]), every answer of the routes marked [`metrics::counted`] (the model's
/// endpoints) and every request refused for its key.
fn router(state: Arc<AppState>) -> Router {
    let api = Router::new()
        .route("/v1/models", get(handlers::models))
        .route("/v1/chat/completions", post(handlers::chat))
        .route("/v1/completions", post(handlers::completions))
        .route_layer(from_fn(metrics::counted))
        .route("/v1/models/{id}", get(handlers::model))
        .route("/tokenize", post(handlers::tokenize))
        .route("/detokenize", post(handlers::detokenize))
        .route("/tokenizer_info", get(handlers::tokenizer_info))
        .route("/metrics", get(handlers::metrics))
        .route_layer(from_fn_with_state(Arc::clone(&state), auth))
        .route_layer(from_fn_with_state(Arc::clone(&state.metrics), metrics::count));
    let access_log = state.opts.access_log;
    let app = Router::new()
        .route("/", get(handlers::page))
        .route("/health", get(handlers::health))
        .merge(api)
        .fallback(handlers::not_found)
        .method_not_allowed_fallback(handlers::method_not_allowed)
        .with_state(state);
    if access_log { app.layer(from_fn(access::log)) } else { app }
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
            return handlers::error_response(&ApiError::new(
                401,
                "invalid_request_error",
                "invalid_api_key",
                "Incorrect API key provided.",
            ));
        }
    }
    next.run(req).await
}
