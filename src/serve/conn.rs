//! The server's connections: accept, serve each one with HTTP/1.1 (hyper), and time out clients
//! that stall.
//!
//! Contract: a connection must deliver a request's head within `read_timeout` of the server
//! starting to wait for it (a new connection, or the end of the previous answer on a kept-alive
//! one), else it is closed without an answer; a request's body must arrive within `read_timeout`
//! of its head ([`read_body`], called by the handlers: 408 and the connection closed). So a client
//! that trickles or stalls holds a connection for at most about twice `read_timeout`. Answers are
//! never timed: a long generation streams as long as it takes. When `shutdown` resolves, [`run`]
//! stops accepting, asks every connection to finish its current answer and close, and returns
//! once all have closed.

use super::api::ApiError;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::header;
use futures_util::StreamExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::time::Duration;
use tokio::net::TcpListener;

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
        // The client's address, for the access log.
        let svc = TowerToHyperService::new(app.clone().layer(axum::Extension(axum::extract::ConnectInfo(peer))));
        let (mut close_rx, open) = (close_rx.clone(), open.clone());
        tokio::spawn(async move {
            let mut b = hyper::server::conn::http1::Builder::new();
            b.timer(TokioTimer::new()).header_read_timeout(read_timeout);
            let conn = b.serve_connection(TokioIo::new(stream), svc);
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

/// Why a request body could not be read.
#[derive(Debug, PartialEq, Eq)]
pub enum BodyError {
    /// Longer than the limit (by its Content-Length, or as it arrived).
    TooLarge,
    /// Not complete within the read timeout.
    TimedOut,
    /// The connection failed mid-body.
    Failed(String),
}

/// Reads a whole request body of at most `limit` bytes within `timeout`; a declared length over
/// the limit is refused before anything is read.
pub async fn read_body(body: Body, declared: Option<u64>, limit: usize, timeout: Duration) -> Result<Bytes, BodyError> {
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(BodyError::TooLarge);
    }
    let read = async {
        let mut stream = body.into_data_stream();
        let mut buf = Vec::with_capacity(declared.map_or(0, |n| n as usize));
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| BodyError::Failed(e.to_string()))?;
            if buf.len() + chunk.len() > limit {
                return Err(BodyError::TooLarge);
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(buf))
    };
    tokio::time::timeout(timeout, read).await.map_err(|_| BodyError::TimedOut)?
}

/// A request's body as the API answers it: read within `timeout` and `limit` bytes, else the
/// error to send (413 `request_too_large`, 408 `request_timeout`, 400 `invalid_body`).
pub async fn body(req: Request, limit: usize, timeout: Duration) -> Result<Bytes, ApiError> {
    let declared =
        req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    read_body(req.into_body(), declared, limit, timeout).await.map_err(|e| match e {
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
    })
}
