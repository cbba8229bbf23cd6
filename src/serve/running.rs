//! The generation thread: one request at a time, or with `serve --parallel N` up to N as one
//! running batch.
//!
//! Contract: alone ([`worker`] with N <= 1), requests run in arrival order, each streaming its
//! deltas as they come; a panic in one is a 500 for it. With N > 1 the worker is a host of the
//! engine's lane driver (`Engine::run_continuous`): between
//! steps it admits waiting requests (up to N running; the HTTP side queues `queue` more and
//! answers 429 beyond), each becoming a lane on a fresh session (`Generator::start_lane`, with
//! its own drafter when the server drafts), and every lane advances in one forward per step — a
//! newcomer's prompt chunk in the same sweep as the running ones' decode and verify rows — so a
//! request joins at the next step and leaves at the step where it stops. Each answer (tokens,
//! text, stop strings, log-probabilities) is the one the same request gets served alone, drafts
//! on or off: the forward's bits do not depend on the rows beside a row and each request samples
//! with its own seed. Requests in a running batch start from fresh sessions (no conversation
//! reuse); the memo still answers a repeated greedy request. `deltafin.batch` in an answer is the
//! most requests that shared a step with it (its counters: `service::parallel`). A failed or
//! panicking step fails every running request (500); the server goes on. Either way a request's
//! place in the queue is freed before its last message goes, and the generator's totals are
//! published for `/metrics` as each request leaves.

use super::metrics::Metrics;
use super::{Job, Msg};
use crate::api::{ApiError, Delta};
use crate::engine::{Lane, LaneError, LaneHost};
use crate::service::generator::{GenError, Generator};
use crate::service::parallel::{LaneRequest, Started};
use serde_json::Value;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Instant;

/// What the worker shares with the HTTP side.
pub(super) struct Shared {
    pub metrics: Arc<Metrics>,
    pub stop: Arc<AtomicBool>,
    pub last_gen_s: Arc<Mutex<f64>>,
}

impl Shared {
    /// A request is answered: its place is free (first, so a client that sends its next request
    /// as soon as this answer arrives does not find the queue full), then its message goes.
    fn answer(&self, gen_: &Generator, tx: &tokio::sync::mpsc::UnboundedSender<Msg>, msg: Msg) {
        self.release(gen_);
        let _ = tx.send(msg);
    }

    /// A request leaves: the totals are published and its place is freed.
    fn release(&self, gen_: &Generator) {
        if let Ok(mut t) = self.metrics.totals.lock() {
            *t = gen_.totals.clone();
        }
        self.metrics.pending.fetch_sub(1, Ordering::SeqCst);
    }
}

fn failed(e: GenError) -> ApiError {
    match e {
        GenError::Request(e) => e,
        e => ApiError::new(500, "server_error", "generation_failed", e.to_string()),
    }
}

/// The worker as the lane driver's host.
struct Host {
    gen_: Generator,
    jobs: mpsc::Receiver<Job>,
    sh: Shared,
}

/// A running request.
struct Live {
    job: Job,
    req: LaneRequest,
}

impl LaneHost for Host {
    type Tag = Live;

    fn next(&mut self, idle: bool) -> Option<(Live, Lane)> {
        loop {
            // Wait only when nothing runs.
            let job = if idle { self.jobs.recv().ok()? } else { self.jobs.try_recv().ok()? };
            if let Some(x) = self.admit(job) {
                return Some(x);
            }
        }
    }

    fn token(&mut self, l: &mut Live, id: u32) -> bool {
        let (tx, stop) = (&l.job.tx, &self.sh.stop);
        l.req.token(id, &mut |d: &Delta| !stop.load(Ordering::SeqCst) && tx.send(Msg::Delta(d.clone())).is_ok())
    }

    fn finished(&mut self, l: Live, lane: Lane) {
        let Live { job, req } = l;
        let (prefill_s, decode_s) = (lane.session.stats.prefill_s, lane.session.stats.decode_s);
        let tx = &job.tx;
        let out = self.gen_.finish_lane(lane, req, &mut |d: &Delta| tx.send(Msg::Delta(d.clone())).is_ok());
        if let Some(t) = out.ext.get("ttft_s").and_then(Value::as_f64) {
            self.sh.metrics.ttft(t);
        }
        // Retry-After: how long a request took to run here.
        if let Ok(mut s) = self.sh.last_gen_s.lock() {
            *s = prefill_s + decode_s;
        }
        self.sh.answer(&self.gen_, tx, Msg::Done(Box::new(out)));
    }

    fn failed(&mut self, l: Live, _lane: Lane, e: &LaneError) {
        let e = match e {
            LaneError::Panicked => {
                ApiError::new(500, "server_error", "internal_error", "The generation failed unexpectedly.")
            }
            e => ApiError::new(500, "server_error", "generation_failed", e.to_string()),
        };
        self.sh.answer(&self.gen_, &l.job.tx, Msg::Failed(e));
    }
}

impl Host {
    /// Starts a request: refused (shutting down), dropped (its client left), answered at once (a
    /// bad setting, the memo) or a new lane.
    fn admit(&mut self, job: Job) -> Option<(Live, Lane)> {
        let sh = &self.sh;
        if sh.stop.load(Ordering::SeqCst) {
            let e = ApiError::new(503, "server_error", "shutting_down", "The server is shutting down.");
            sh.answer(&self.gen_, &job.tx, Msg::Failed(e));
            return None;
        }
        if job.tx.is_closed() {
            // The client left while waiting.
            self.gen_.totals.cancelled += 1;
            sh.release(&self.gen_);
            return None;
        }
        let queued_s = job.arrived.elapsed().as_secs_f64();
        let tx = job.tx.clone();
        let mut sink = |d: &Delta| tx.send(Msg::Delta(d.clone())).is_ok();
        match self.gen_.start_lane(&job.req, job.prepared.clone(), queued_s, &mut sink) {
            Started::Lane(b) => {
                let (lane, req) = *b;
                Some((Live { job, req }, lane))
            }
            Started::Answered(Ok(out)) => {
                sh.answer(&self.gen_, &job.tx, Msg::Done(out));
                None
            }
            Started::Answered(Err(e)) => {
                sh.answer(&self.gen_, &job.tx, Msg::Failed(failed(e)));
                None
            }
        }
    }
}

/// The generation thread (see the module contract): `parallel` requests at most at once.
pub(super) fn worker(gen_: Generator, jobs: mpsc::Receiver<Job>, sh: Shared, parallel: usize) {
    if parallel <= 1 {
        return one_at_a_time(gen_, jobs, sh);
    }
    let engine = Arc::clone(gen_.engine());
    let mut host = Host { gen_, jobs, sh };
    engine.run_continuous(parallel, &mut host);
}

/// One job at a time, in arrival order.
fn one_at_a_time(mut gen_: Generator, jobs: mpsc::Receiver<Job>, sh: Shared) {
    let Shared { metrics, stop, last_gen_s } = sh;
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
