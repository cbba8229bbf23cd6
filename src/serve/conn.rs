//! The server's connections: accept, serve each one with HTTP/1.1 (hyper), time out clients
//! that stall, answer clients that half-close, and refuse oversized bodies in a way clients that
//! write their whole body first can read.
//!
//! Contract: a connection must deliver a request's head within `read_timeout` of the server
//! starting to wait for it (a new connection, or the end of the previous answer on a kept-alive
//! one), else it is closed without an answer; a request's body must arrive within `read_timeout`
//! of its head ([`read_body`], called by the handlers: 408 and the connection closed). So a client
//! that trickles or stalls holds a connection for at most about twice `read_timeout`. Answers are
//! never timed: a long generation streams as long as it takes. When `shutdown` resolves, [`run`]
//! stops accepting, asks every connection to finish its current answer and close, and returns
//! once all have closed.
//!
//! The end of a client's bytes (read EOF) while its request is being answered is not taken for a
//! client gone: it may have shut down only its write side and wait for the answer (a half-close).
//! Until the answer starts, the connection sends `HTTP/1.1 100 Continue` once, an interim
//! response every HTTP/1.1 client skips: a client that closed its socket answers it with a reset,
//! and the request is then dropped (its generation cancelled) as before; one that half-closed gets
//! its answer. A body the client ended short is a 400 at once. A body over the limit is read and discarded (up to [`DRAIN_MAX`] bytes, within the
//! read timeout, and not where the client waits for `100 Continue`) before the 413, so a client
//! that writes its whole body before reading (Python's http.client) reads the 413 instead of a
//! broken pipe.

use crate::api::ApiError;
use axum::Router;
use axum::body::{Body, Bytes, HttpBody};
use axum::extract::Request;
use axum::http::{Version, header};
use futures_util::StreamExt;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// Most bytes of an oversized body read and discarded before its 413; past this the connection is
/// closed at once (the client may see a reset instead of the answer).
pub const DRAIN_MAX: u64 = 1 << 30;

/// The interim response that finds out whether a client that stopped sending is still there.
const PROBE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// How often a connection whose client stopped sending is checked for a reset.
const GONE_CHECK: Duration = Duration::from_millis(100);

/// Accepts connections on `listener` and serves `app` on each until `shutdown` resolves, then
/// waits for the open connections to finish (the caller bounds that wait).
pub async fn run(listener: TcpListener, app: Router, read_timeout: Duration, shutdown: impl Future<Output = ()>) {
    // Dropping `close` tells every connection to finish; each holds a clone of `open`, so
    // `open_rx` ends once the last one has closed.
    let (close, close_rx) = tokio::sync::watch::channel(());
    let (open, mut open_rx) = tokio::sync::mpsc::channel::<()>(1);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    // Out of descriptors and the like: wait rather than spin; the listener stays.
                    tracing::warn!("accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Streamed tokens go out as they are written, not when a segment fills.
        let _ = stream.set_nodelay(true);
        let watch = Arc::new(ConnWatch::default());
        // The client's address, for the access log.
        let routed = app.clone().layer(axum::Extension(axum::extract::ConnectInfo(peer)));
        let svc = watched_service(routed, Arc::clone(&watch));
        let io = Watched { io: stream, watch, eof: false, probed: 0, tick: None };
        let (mut close_rx, open) = (close_rx.clone(), open.clone());
        tokio::spawn(async move {
            let mut b = hyper::server::conn::http1::Builder::new();
            b.timer(TokioTimer::new()).header_read_timeout(read_timeout);
            let conn = b.serve_connection(TokioIo::new(io), svc);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!("connection ended: {e}");
                    }
                }
                _ = close_rx.changed() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
            drop(open);
        });
    }
    drop(listener);
    drop(close);
    drop(open);
    let _ = open_rx.recv().await;
}

/// No request is being answered (between requests).
const IDLE: u8 = 0;
/// A request is with its handler; its answer has not started.
const ANSWERING: u8 = 1;
/// Its answer is being written.
const RESPONDING: u8 = 2;

/// What a connection's I/O knows of the request on it, shared with the request's handler (a
/// request extension): whether its answer has started, and whether the client has sent its last
/// byte.
#[derive(Debug, Default)]
pub struct ConnWatch {
    phase: AtomicU8,
    /// The request is HTTP/1.0 (no interim responses may be sent to it).
    http10: AtomicBool,
    /// The client has sent its last byte (told once to a body being read).
    ended: tokio::sync::Notify,
}

/// `app` as the connection's service: each request carries the connection's [`ConnWatch`], and
/// its answer's end sets the watch back to idle.
fn watched_service(
    app: Router,
    watch: Arc<ConnWatch>,
) -> impl hyper::service::Service<
    hyper::Request<Incoming>,
    Response = axum::response::Response,
    Error = std::convert::Infallible,
    Future = impl Future<Output = Result<axum::response::Response, std::convert::Infallible>> + Send,
> + Clone {
    let inner = TowerToHyperService::new(app);
    hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
        watch.phase.store(ANSWERING, Ordering::SeqCst);
        watch.http10.store(req.version() <= Version::HTTP_10, Ordering::SeqCst);
        req.extensions_mut().insert(Arc::clone(&watch));
        let answer = hyper::service::Service::call(&inner, req);
        let watch = Arc::clone(&watch);
        async move {
            let r = answer.await?;
            Ok(r.map(|body| Body::new(Tracked { body, watch })))
        }
    })
}

/// An answer's body that sets its connection's watch back to idle when it has been sent (or
/// dropped).
struct Tracked {
    body: Body,
    watch: Arc<ConnWatch>,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.watch.phase.store(IDLE, Ordering::SeqCst);
    }
}

/// A connection's socket as hyper reads and writes it, telling a client that half-closed from one
/// that has gone (see the module contract).
struct Watched {
    io: TcpStream,
    watch: Arc<ConnWatch>,
    /// The client has sent its last byte.
    eof: bool,
    /// Bytes of [`PROBE`] written.
    probed: usize,
    /// When to look for a reset next.
    tick: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Watched {
    /// The client sends no more while a request waits for (or gets) its answer: Pending while it
    /// may still read, an error once it is known to have gone (its reset to the probe, or to the
    /// answer's bytes).
    fn poll_gone(&mut self, cx: &mut Context<'_>, may_probe: bool) -> Poll<io::Result<()>> {
        if may_probe && !self.watch.http10.load(Ordering::SeqCst) {
            while self.probed < PROBE.len() {
                match Pin::new(&mut self.io).poll_write(cx, &PROBE[self.probed..]) {
                    Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                    Poll::Ready(Ok(n)) => self.probed += n,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => break,
                }
            }
        }
        if let Some(e) = self.io.take_error()? {
            return Poll::Ready(Err(e));
        }
        let tick = self.tick.get_or_insert_with(|| Box::pin(tokio::time::sleep(GONE_CHECK)));
        while tick.as_mut().poll(cx).is_ready() {
            tick.as_mut().reset(tokio::time::Instant::now() + GONE_CHECK);
        }
        Poll::Pending
    }

    /// Hyper writes: an answer has started.
    fn writing(&self, n: usize) {
        if n > 0 {
            let _ = self.watch.phase.compare_exchange(ANSWERING, RESPONDING, Ordering::SeqCst, Ordering::SeqCst);
        }
    }
}

impl AsyncRead for Watched {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        if !me.eof {
            let before = buf.filled().len();
            ready!(Pin::new(&mut me.io).poll_read(cx, buf))?;
            if buf.filled().len() > before || buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            me.eof = true;
            // Hyper asks for more only when it holds nothing more of the request: a body still
            // being read has ended short.
            me.watch.ended.notify_one();
        }
        match me.watch.phase.load(Ordering::SeqCst) {
            // Between requests: the end of the connection.
            IDLE => Poll::Ready(Ok(())),
            phase => me.poll_gone(cx, phase == ANSWERING),
        }
    }
}

impl AsyncWrite for Watched {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        me.writing(buf.len());
        Pin::new(&mut me.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        me.writing(bufs.iter().map(|b| b.len()).sum());
        Pin::new(&mut me.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// Why a request body could not be read.
#[derive(Debug, PartialEq, Eq)]
pub enum BodyError {
    /// Longer than the limit (by its Content-Length, or as it arrived).
    TooLarge,
    /// Not complete within the read timeout.
    TimedOut,
    /// The connection failed mid-body.
    Failed(String),
    /// The client sent its last byte before the body's end (after `got` bytes of it).
    EndedShort { got: u64 },
}

/// Reads a whole request body of at most `limit` bytes within `timeout`. A longer one (by its
/// declared length or as it arrives) is [`BodyError::TooLarge`]; with `drain`, after the rest of
/// it has been read and discarded (at most [`DRAIN_MAX`] bytes in all, within the timeout), so
/// that the client, still writing, can read the answer. `ended` is told when the client has sent
/// its last byte: a body still incomplete then is [`BodyError::EndedShort`].
pub async fn read_body(
    body: Body,
    declared: Option<u64>,
    limit: usize,
    timeout: Duration,
    drain: bool,
    ended: Option<&tokio::sync::Notify>,
) -> Result<Bytes, BodyError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut over = declared.is_some_and(|n| n > limit as u64);
    if over && !(drain && declared.is_some_and(|n| n <= DRAIN_MAX)) {
        return Err(BodyError::TooLarge);
    }
    let mut stream = body.into_data_stream();
    let mut buf = Vec::with_capacity(if over { 0 } else { declared.map_or(0, |n| n as usize) });
    let mut seen = 0u64;
    let never = tokio::sync::Notify::new();
    let ended = ended.unwrap_or(&never);
    loop {
        let next = tokio::select! {
            biased;
            next = tokio::time::timeout_at(deadline, stream.next()) => next,
            () = ended.notified() => {
                if over {
                    return Err(BodyError::TooLarge);
                }
                return Err(BodyError::EndedShort { got: seen });
            }
        };
        let next = match next {
            Ok(next) => next,
            // Drained as much as came in time: the 413 all the same.
            Err(_) if over => return Err(BodyError::TooLarge),
            Err(_) => return Err(BodyError::TimedOut),
        };
        let chunk = match next {
            None => break,
            Some(Ok(c)) => c,
            Some(Err(_)) if over => return Err(BodyError::TooLarge),
            Some(Err(e)) => return Err(BodyError::Failed(e.to_string())),
        };
        seen += chunk.len() as u64;
        if over {
            if seen > DRAIN_MAX {
                return Err(BodyError::TooLarge);
            }
        } else if buf.len() + chunk.len() > limit {
            if !drain {
                return Err(BodyError::TooLarge);
            }
            over = true;
            buf = Vec::new();
        } else {
            buf.extend_from_slice(&chunk);
        }
    }
    if over { Err(BodyError::TooLarge) } else { Ok(Bytes::from(buf)) }
}

/// A request's body as the API answers it: read within `timeout` and `limit` bytes, else the
/// error to send (413 `request_too_large`, 408 `request_timeout`, 400 `invalid_body`).
pub async fn body(req: Request, limit: usize, timeout: Duration) -> Result<Bytes, ApiError> {
    let headers = req.headers();
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    // A client that waits for `100 Continue` has not sent its body: nothing to drain.
    let drain = !headers.get(header::EXPECT).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    let watch = req.extensions().get::<Arc<ConnWatch>>().cloned();
    let ended = watch.as_deref().map(|w| &w.ended);
    read_body(req.into_body(), declared, limit, timeout, drain, ended).await.map_err(|e| match e {
        BodyError::TooLarge => ApiError::new(
            413,
            "invalid_request_error",
            "request_too_large",
            format!("The request body is over {limit} bytes."),
        ),
        BodyError::TimedOut => ApiError::new(
            408,
            "invalid_request_error",
            "request_timeout",
            format!("The request body did not arrive within {} s.", timeout.as_secs_f64()),
        ),
        BodyError::Failed(e) => {
            ApiError::new(400, "invalid_request_error", "invalid_body", format!("Cannot read the request body: {e}"))
        }
        BodyError::EndedShort { got } => ApiError::new(
            400,
            "invalid_request_error",
            "invalid_body",
            match declared {
                Some(n) => format!("The request body ended after {got} of its {n} bytes."),
                None => format!("The request body ended after {got} bytes, before its last chunk."),
            },
        ),
    })
}
