//! The server's access log: one line on stderr per request, when its answer has been sent (a
//! stream: when it ends or the client leaves), like uvicorn's under vLLM and llama-server's.
//!
//! Contract: [`log`] (a middleware around every route) writes
//! `deltafin: request ADDR METHOD PATH STATUS [in=N out=N ttft=Ss finish=R] time=Ss`: the client's
//! address (`-` when the connection did not say), the path without its query (the page may carry
//! an API key there), the status of the response head, and for a generation the prompt and
//! completion tokens, time to first token and why it ended, which the handler records with
//! [`usage`] while the request runs. A line is written once, whatever the answer's path (error,
//! stream, disconnect). A request whose client left before its answer was all sent (a
//! disconnect, a stream stopped) says `finish=cancelled`; one that left before the answer's head
//! was sent has status 499 (nginx's "client closed request"). [`is_loopback`] tells whether a listening host is reachable only from this
//! machine.

use crate::api::Output;
use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Request};
use axum::middleware::Next;
use axum::response::Response;
use hyper::body::{Frame, SizeHint};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

tokio::task_local! {
    static ENTRY: Arc<Entry>;
}

/// One request's line, written when the last holder lets go of it.
pub struct Entry {
    client: Option<SocketAddr>,
    method: String,
    path: String,
    start: Instant,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    status: u16,
    /// (prompt tokens, completion tokens, seconds to the first token, finish reason).
    usage: Option<(usize, usize, Option<f64>, &'static str)>,
    /// The answer's body was sent to its end.
    ended: bool,
}

impl Entry {
    /// The line (without its end).
    fn line(&self) -> String {
        let st = self.state.lock().map(|s| (s.status, s.usage, s.ended)).unwrap_or_default();
        let client = self.client.map_or("-".to_string(), |a| a.to_string());
        // No head was sent: the client left while the handler ran.
        let status = if st.0 == 0 { 499 } else { st.0 };
        let mut out = format!("deltafin: request {client} {} {} {status}", self.method, self.path);
        let cancelled = !st.2;
        if let Some((p, c, ttft, finish)) = st.1 {
            out.push_str(&format!(" in={p} out={c}"));
            if let Some(t) = ttft {
                out.push_str(&format!(" ttft={t:.3}s"));
            }
            out.push_str(&format!(" finish={}", if cancelled { "cancelled" } else { finish }));
        } else if cancelled {
            out.push_str(" finish=cancelled");
        }
        out.push_str(&format!(" time={:.3}s", self.start.elapsed().as_secs_f64()));
        out
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        eprintln!("{}", self.line());
    }
}

/// The running request's entry, for the handler to record its usage into (None when the access
/// log is off, or outside a request).
pub fn current() -> Option<Arc<Entry>> {
    ENTRY.try_with(Arc::clone).ok()
}

/// Records a finished generation's tokens, TTFT and finish reason in `entry`'s line (of several
/// choices: the prompt once, every choice's tokens, the first's TTFT and finish reason).
pub fn usage(entry: &Option<Arc<Entry>>, outs: &[Output]) {
    if let Some(e) = entry
        && let Some(out) = outs.first()
        && let Ok(mut s) = e.state.lock()
    {
        let ttft = out.ext.get("ttft_s").and_then(serde_json::Value::as_f64);
        let tokens = outs.iter().map(|o| o.tokens.len()).sum();
        s.usage = Some((out.prompt_tokens, tokens, ttft, out.finish_reason));
    }
}

/// The middleware: runs the request with its entry in reach of the handler, then holds the entry
/// until the response body is done.
pub async fn log(req: Request, next: Next) -> Response {
    let entry = Arc::new(Entry {
        client: req.extensions().get::<ConnectInfo<SocketAddr>>().map(|c| c.0),
        method: req.method().to_string(),
        path: req.uri().path().to_string(),
        start: Instant::now(),
        state: Mutex::new(State::default()),
    });
    let res = ENTRY.scope(Arc::clone(&entry), next.run(req)).await;
    if let Ok(mut s) = entry.state.lock() {
        s.status = res.status().as_u16();
    }
    let (parts, body) = res.into_parts();
    Response::from_parts(parts, Body::new(Held { body, entry }))
}

/// A response body that holds its request's entry until it is done (or dropped), and is
/// otherwise the body itself (its length too, so a sized answer keeps its Content-Length).
struct Held {
    body: Body,
    entry: Arc<Entry>,
}

impl hyper::body::Body for Held {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let p = Pin::new(&mut self.body).poll_frame(cx);
        if matches!(p, Poll::Ready(None)) {
            self.mark_ended();
        }
        p
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Held {
    fn mark_ended(&self) {
        if let Ok(mut s) = self.entry.state.lock() {
            s.ended = true;
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        // A sized body may be done without a last poll.
        if hyper::body::Body::is_end_stream(&self.body) {
            self.mark_ended();
        }
    }
}

/// `host` (as given to listen on) is reachable only from this machine: a loopback address or
/// `localhost`.
pub fn is_loopback(host: &str) -> bool {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    h.eq_ignore_ascii_case("localhost") || h.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_hosts() {
        for h in ["127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost", "LOCALHOST"] {
            assert!(is_loopback(h), "{h}");
        }
        for h in ["0.0.0.0", "::", "192.168.1.2", "example.com", ""] {
            assert!(!is_loopback(h), "{h}");
        }
    }

    #[test]
    fn the_line_names_the_request_and_its_usage() {
        let e = Entry {
            client: Some("127.0.0.1:5000".parse().unwrap()),
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            start: Instant::now(),
            state: Mutex::new(State { status: 200, usage: Some((12, 64, Some(0.0811), "stop")), ended: true }),
        };
        let l = e.line();
        let want = "deltafin: request 127.0.0.1:5000 POST /v1/chat/completions 200 in=12 out=64 ttft=0.081s";
        assert!(l.starts_with(want) && l.contains(" finish=stop time="), "{l}");
        // The client left mid-stream; before the answer's head.
        e.state.lock().unwrap().ended = false;
        assert!(e.line().contains(" 200 in=12 out=64 ttft=0.081s finish=cancelled time="), "{}", e.line());
        *e.state.lock().unwrap() = State::default();
        assert!(e.line().contains("/v1/chat/completions 499 finish=cancelled time="), "{}", e.line());
        e.state.lock().unwrap().ended = true;
    }
}
