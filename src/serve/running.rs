//! `serve --parallel N`: the generation thread runs up to N requests as one running batch.
//!
//! Contract: between steps the worker admits waiting requests (up to N running; the HTTP side
//! queues `queue` more and answers 429 beyond); each admitted request becomes an
//! `engine::Lane` on a fresh session, and `Engine::step_lanes` advances every lane in one forward
//! per step — a newcomer's prompt chunk in the same sweep as the running ones' decode rows — so
//! a request joins at the next step and leaves at the step where it stops. Each answer (tokens,
//! text, stop strings, log-probabilities) is the one the same request gets served alone: the
//! forward's bits do not depend on the rows beside a row and each request samples with its own
//! seed. Requests in a running batch start from fresh sessions (no conversation reuse) and run
//! without drafts; the memo still answers a repeated greedy request. `deltafin.batch` in an
//! answer is the most requests that shared a step with it. A failed or panicking step fails
//! every running request (500); the server goes on.

use super::answer::Answer;
use super::api::ApiError;
use super::generator::{Begin, Delta, GenError, Generator, Ran};
use super::metrics::Metrics;
use super::{Job, Msg};
use crate::engine::{GenerateOptions, Lane};
use crate::sample::Sampler;
use crate::stats::Stats;
use crate::store::SourceReport;
use serde_json::{Value, json};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Instant;

/// A running request: its job, its start, its text so far, and the source's counters at its start.
struct Live {
    job: Job,
    begin: Begin,
    answer: Answer,
    queued_s: f64,
    src0: SourceReport,
}

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

/// The generation thread of `serve --parallel N` (see the module contract).
pub(super) fn worker(mut gen_: Generator, jobs: mpsc::Receiver<Job>, sh: Shared, parallel: usize) {
    let engine = Arc::clone(gen_.engine());
    let mut lanes: Vec<Lane> = Vec::new();
    let mut live: Vec<Live> = Vec::new();
    let mut open = true;
    loop {
        // Admit waiting requests: block only when nothing runs.
        while open && lanes.len() < parallel.max(1) {
            let job = if lanes.is_empty() {
                match jobs.recv() {
                    Ok(j) => j,
                    Err(_) => {
                        open = false;
                        break;
                    }
                }
            } else {
                match jobs.try_recv() {
                    Ok(j) => j,
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            };
            if let Some((lane, l)) = admit(&mut gen_, job, &sh) {
                lanes.push(lane);
                live.push(l);
            }
        }
        if lanes.is_empty() {
            if open {
                continue;
            }
            return;
        }
        let stop = &sh.stop;
        let step = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut on_token = |i: usize, id: u32| {
                let l = &mut live[i];
                let tx = &l.job.tx;
                l.answer
                    .token(id, &mut |d: &Delta| !stop.load(Ordering::SeqCst) && tx.send(Msg::Delta(d.clone())).is_ok())
            };
            engine.step_lanes(&mut lanes, &mut on_token, &mut Stats::default())
        }));
        let fail = match step {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(ApiError::new(500, "server_error", "generation_failed", e.to_string())),
            Err(_) => {
                tracing::error!("a batched step panicked; its requests get a 500");
                Some(ApiError::new(500, "server_error", "internal_error", "The generation failed unexpectedly."))
            }
        };
        if let Some(e) = fail {
            for l in live.drain(..) {
                sh.answer(&gen_, &l.job.tx, Msg::Failed(e.clone()));
            }
            lanes.clear();
            continue;
        }
        // Finished lanes leave, in order.
        let mut i = 0;
        while i < lanes.len() {
            if !lanes[i].done() {
                i += 1;
                continue;
            }
            let lane = lanes.remove(i);
            let l = live.remove(i);
            finish(&mut gen_, &engine, lane, l, &sh);
        }
    }
}

/// Starts a request: refused (shutting down), dropped (its client left), answered at once (a
/// bad setting, the memo) or a new lane.
fn admit(gen_: &mut Generator, job: Job, sh: &Shared) -> Option<(Lane, Live)> {
    if sh.stop.load(Ordering::SeqCst) {
        let e = ApiError::new(503, "server_error", "shutting_down", "The server is shutting down.");
        sh.answer(gen_, &job.tx, Msg::Failed(e));
        return None;
    }
    if job.tx.is_closed() {
        // The client left while waiting.
        gen_.totals.cancelled += 1;
        sh.release(gen_);
        return None;
    }
    let t0 = Instant::now();
    let queued_s = job.arrived.elapsed().as_secs_f64();
    let (prompt, max_new) = (job.prepared.prompt.clone(), job.prepared.max_new);
    let begin = match gen_.begin(&job.req, &prompt, max_new) {
        Ok(b) => b,
        Err(e) => {
            sh.answer(gen_, &job.tx, Msg::Failed(failed(e)));
            return None;
        }
    };
    let tx = job.tx.clone();
    let mut sink = |d: &Delta| tx.send(Msg::Delta(d.clone())).is_ok();
    if let Some(out) = gen_.memo_answer(&begin, prompt.len(), queued_s, t0, &mut sink) {
        sh.answer(gen_, &job.tx, Msg::Done(Box::new(out)));
        return None;
    }
    let mut sampler = Sampler::new(begin.params);
    let lp = job.req.logprobs.map(|n| sampler.record_logprobs(n));
    let answer = Answer::new(&job.req, gen_.encoder(), gen_.stops.clone(), t0, lp);
    let opts = GenerateOptions { max_new, stop: gen_.stops.clone() };
    let src0 = gen_.engine().source_report();
    match Lane::new(gen_.engine().new_session(), prompt, opts, sampler) {
        Ok(lane) => Some((lane, Live { job, begin, answer, queued_s, src0 })),
        Err(e) => {
            sh.answer(gen_, &job.tx, Msg::Failed(failed(GenError::Forward(e))));
            None
        }
    }
}

/// Answers a finished lane's request.
fn finish(gen_: &mut Generator, engine: &Arc<crate::engine::Engine>, lane: Lane, l: Live, sh: &Shared) {
    let Live { job, begin, mut answer, queued_s, src0 } = l;
    let tx = &job.tx;
    answer.finish(&mut |d: &Delta| tx.send(Msg::Delta(d.clone())).is_ok());
    let src1 = engine.source_report();
    let st = &lane.session.stats;
    let ran = Ran {
        prompt_len: job.prepared.prompt.len(),
        reused: 0,
        queued_s,
        prefilled_s: st.prefill_s,
        src0: &src0,
        src1: &src1,
    };
    let mut out = gen_.output(&begin, answer, lane.generation(), st, &ran);
    out.ext["batch"] = json!(lane.peak_batch);
    gen_.remember(begin, &out);
    if let Some(t) = out.ext.get("ttft_s").and_then(Value::as_f64) {
        sh.metrics.ttft(t);
    }
    // Retry-After: how long a request took to run here.
    if let Ok(mut s) = sh.last_gen_s.lock() {
        *s = st.prefill_s + st.decode_s;
    }
    sh.answer(gen_, tx, Msg::Done(Box::new(out)));
}
