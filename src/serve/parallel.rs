//! Several requests generated together: their prompts prefilled in shared expert-major passes
//! and their answers decoded in lockstep, one expert-union read per layer for all of them.
//!
//! Contract: [`Generator::generate_batch`] answers every job exactly as
//! [`Generator::generate_prepared`] would alone — the same tokens (the forward's bits do not
//! depend on what runs beside a row, and each job samples with its own seed), the same text,
//! stop strings and log-probabilities — but reads each layer's experts once for the whole batch
//! (`Engine::prefill_sessions`, `Engine::generate_sessions`). Jobs start from fresh sessions
//! (no conversation reuse) and without drafts; the memo still answers a repeated greedy request.
//! A job whose sampling settings are bad gets its own error; a failed shared forward fails every
//! job still running (the outer `Err`). Each output's `deltafin` object counts the shared passes
//! (`batch`: how many jobs shared them).

use super::answer::Answer;
use super::api::GenRequest;
use super::generator::{Delta, GenError, Generator, Output, Prepared, Ran};
use crate::engine::ForwardError;
use crate::engine::{BatchSeq, GenerateOptions, Session};
use crate::sample::Sampler;
use serde_json::json;
use std::time::Instant;

/// One request of a batch: the request, its checked prompt and where its text goes (false from
/// the sink cancels that job alone).
pub struct BatchJob<'a> {
    pub req: &'a GenRequest,
    pub prepared: Prepared,
    pub sink: &'a mut dyn FnMut(&Delta) -> bool,
}

impl Generator {
    /// Generates every job together (see the module contract); one result per job, in order.
    pub fn generate_batch(&mut self, jobs: &mut [BatchJob]) -> Result<Vec<Result<Output, GenError>>, ForwardError> {
        let t0 = Instant::now();
        let mut results: Vec<Option<Result<Output, GenError>>> = Vec::with_capacity(jobs.len());
        let mut begins = Vec::with_capacity(jobs.len());
        for j in jobs.iter_mut() {
            let p = &j.prepared;
            match self.begin(j.req, &p.prompt, p.max_new) {
                Err(e) => {
                    results.push(Some(Err(e)));
                    begins.push(None);
                }
                Ok(b) => {
                    let memo = self.memo_answer(&b, p.prompt.len(), 0.0, t0, j.sink);
                    results.push(memo.map(Ok));
                    begins.push(Some(b).filter(|_| results.last().is_some_and(Option::is_none)));
                }
            }
        }
        // The jobs that run, in order.
        let run: Vec<usize> = (0..jobs.len()).filter(|&i| begins[i].is_some()).collect();
        let mut sessions: Vec<Session> = run.iter().map(|_| self.engine.new_session()).collect();
        let prompts: Vec<&[u32]> = run.iter().map(|&i| &jobs[i].prepared.prompt[..]).collect();
        let src0 = self.engine.source_report();
        if !run.is_empty() {
            let mut refs: Vec<&mut Session> = sessions.iter_mut().collect();
            self.engine.prefill_sessions(&mut refs, &prompts)?;
        }
        let prefilled_s = t0.elapsed().as_secs_f64();
        let mut samplers: Vec<Sampler> = Vec::with_capacity(run.len());
        let mut answers: Vec<Answer> = Vec::with_capacity(run.len());
        for &i in &run {
            let b = begins[i].as_ref().ok_or(ForwardError::Empty)?;
            let mut sampler = Sampler::new(b.params);
            let lp = jobs[i].req.logprobs.map(|n| sampler.record_logprobs(n));
            answers.push(Answer::new(jobs[i].req, self.enc.clone(), self.stops.clone(), t0, lp));
            samplers.push(sampler);
        }
        let max_new: Vec<usize> = run.iter().map(|&i| jobs[i].prepared.max_new).collect();
        let gens = {
            let mut sinks: Vec<&mut dyn FnMut(&Delta) -> bool> = Vec::with_capacity(run.len());
            let mut want = run.iter().peekable();
            for (i, j) in jobs.iter_mut().enumerate() {
                if want.peek() == Some(&&i) {
                    want.next();
                    sinks.push(&mut *j.sink);
                }
            }
            let mut on_token: Vec<Box<dyn FnMut(u32) -> bool + '_>> = answers
                .iter_mut()
                .zip(sinks)
                .map(|(a, sink)| Box::new(move |id| a.token(id, sink)) as Box<dyn FnMut(u32) -> bool>)
                .collect();
            let mut seqs: Vec<BatchSeq> = sessions
                .iter_mut()
                .zip(samplers.iter_mut())
                .zip(on_token.iter_mut())
                .zip(&max_new)
                .map(|(((session, sampler), on_token), &max_new)| BatchSeq {
                    session,
                    opts: GenerateOptions { max_new, stop: self.stops.clone() },
                    sampler,
                    on_token: &mut **on_token,
                })
                .collect();
            if seqs.is_empty() { Vec::new() } else { self.engine.generate_sessions(&mut seqs)?.0 }
        };
        let src1 = self.engine.source_report();
        let n = run.len();
        for (((&i, mut answer), g), session) in run.iter().zip(answers).zip(gens).zip(&sessions) {
            answer.finish(jobs[i].sink);
            let ran = Ran {
                prompt_len: jobs[i].prepared.prompt.len(),
                reused: 0,
                queued_s: 0.0,
                prefilled_s,
                src0: &src0,
                src1: &src1,
            };
            let Some(begin) = begins[i].take() else { continue };
            let mut out = self.output(&begin, answer, g, &session.stats, &ran);
            out.ext["batch"] = json!(n);
            self.remember(begin, &out);
            results[i] = Some(Ok(out));
        }
        Ok(results.into_iter().map(|r| r.unwrap_or(Err(GenError::Forward(ForwardError::Empty)))).collect())
    }
}
