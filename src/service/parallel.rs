//! A request as a lane of a running batch, for `serve --parallel N` and `batch --parallel N`
//! (both drive their lanes with `Engine::run_continuous`).
//!
//! Contract: [`Generator::start_lane`] turns a prepared request into an `engine::Lane` on a fresh
//! session — its own sampler (seeded as the request says), stop tokens, log-probabilities and,
//! when the generator drafts (`GenConfig::draft`), its own drafter — or answers it at once (a bad
//! sampling setting, the memo). [`LaneRequest::token`] turns each emitted token into text for the
//! request's sink, and [`Generator::finish_lane`] gives the finished request's [`Output`]: the
//! same tokens, text, stop strings and log-probabilities as [`Generator::generate_prepared`]
//! alone (rows do not change each other's bits, each request samples with its own seed, drafts
//! change only speed). Lanes start from fresh sessions (no conversation reuse), or from a fork of
//! the prefix the requests share (`prefix.rs`), feeding only the rest of their prompt.
//!
//! Counters: `batch` in the `deltafin` object is the most requests that shared a step with this
//! one. A request that shared its forwards with others has no expert reads of its own: its
//! `bytes_read`, `expert_bytes_requested`, `read_amplification`, `cache_hits` and `cache_misses`
//! are null and `shared` holds the counters of the forwards it took part in (the other requests'
//! reads included: summing them over requests counts a read once per request that shared it).
//! A request that ran alone has them as its own, as without `--parallel`.

use super::answer::Answer;
use super::generator::{Begin, GenError, Generator, Prepared, Ran, Reads};
use crate::api::response::Echo;
use crate::api::{Delta, GenRequest, Output};
use crate::engine::{GenerateOptions, Lane};
use crate::sample::Sampler;
use serde_json::{Value, json};
use std::time::Instant;

/// A running request's side of its lane: its sampling and memo key, and its answer so far.
pub struct LaneRequest {
    begin: Begin,
    answer: Answer,
    queued_s: f64,
    prompt_len: usize,
    /// Prompt tokens it did not prefill (the shared prefix it was forked from).
    reused: usize,
    /// Its prompt as `echo` shows it.
    echo: Option<Echo>,
}

/// What [`Generator::start_lane`] made of a request.
pub enum Started {
    /// It runs as this lane.
    Lane(Box<(Lane, LaneRequest)>),
    /// It is answered already (the memo), or refused.
    Answered(Result<Box<Output>, GenError>),
}

impl LaneRequest {
    /// Its lane emitted `id`: the text goes to `sink` (false cancels the request).
    pub fn token(&mut self, id: u32, sink: &mut dyn FnMut(&Delta) -> bool) -> bool {
        self.answer.token(id, sink)
    }
}

impl Generator {
    /// Starts a request as a lane (see the module contract); `queued_s` is how long it waited.
    pub fn start_lane(
        &mut self,
        req: &GenRequest,
        prepared: Prepared,
        queued_s: f64,
        sink: &mut dyn FnMut(&Delta) -> bool,
    ) -> Started {
        let t0 = Instant::now();
        let Prepared { prompt, max_new } = prepared;
        let begin = match self.begin(req, &prompt, max_new) {
            Ok(b) => b,
            Err(e) => return Started::Answered(Err(e)),
        };
        if let Some(out) = self.memo_answer(&begin, prompt.len(), queued_s, t0, sink) {
            return Started::Answered(Ok(Box::new(out)));
        }
        let mut sampler = Sampler::new(begin.params.clone());
        match self.enc.constraint(req) {
            Ok(Some(m)) => sampler.constrain(m),
            Ok(None) => {}
            Err(e) => return Started::Answered(Err(GenError::Request(e))),
        }
        let lp = req.logprobs.map(|n| sampler.record_logprobs(n));
        let answer = Answer::new(req, self.enc.clone(), self.stops.clone(), t0, lp).with_call_seed(begin.seed);
        let opts = GenerateOptions { max_new, stop: self.stops.clone() };
        let prompt_len = prompt.len();
        // The prompt's log-probabilities need its rows' logits: a fresh session, no drafter.
        let scored = req.echo && req.logprobs.is_some();
        // A drafter that cannot be built was refused at startup; here it only may be absent.
        let spec = if scored { None } else { self.engine.speculator(self.cfg.draft).ok().flatten() };
        // A drafter that reads K3's hidden rows must see the whole prompt: no shared prefix.
        let whole = spec.as_ref().is_some_and(crate::draft::Speculator::needs_whole_prompt);
        let shared = if whole || scored { 0 } else { self.shared_len(&prompt) };
        let (mut session, reused) = match (shared > 0).then(|| self.fork_shared()).flatten() {
            Some(s) => (s, shared),
            None => (self.engine.new_session(), 0),
        };
        // Scoring the prompt's rows runs here, before the lane joins the batch.
        let (echo, from) = match self.echo(req, &mut session, &prompt) {
            Ok(x) => x,
            Err(e) => return Started::Answered(Err(e.into())),
        };
        let lane = match Lane::new(session, prompt[reused.max(from)..].to_vec(), opts, sampler) {
            Ok(l) => l,
            Err(e) => return Started::Answered(Err(e.into())),
        };
        let lane = match spec {
            Some(d) => lane.with_drafts(d),
            None => lane,
        };
        Started::Lane(Box::new((lane, LaneRequest { begin, answer, queued_s, prompt_len, reused, echo })))
    }

    /// The finished lane's output (see the module contract); its last text goes to `sink`.
    pub fn finish_lane(&mut self, lane: Lane, r: LaneRequest, sink: &mut dyn FnMut(&Delta) -> bool) -> Output {
        let LaneRequest { begin, mut answer, queued_s, prompt_len, reused, echo } = r;
        answer.finish(sink);
        let st = &lane.session.stats;
        let sh = lane.shared();
        let alone = lane.peak_batch() <= 1;
        // Alone, the forwards' counters are its own.
        let mut own = st.clone();
        if alone {
            own.reads.expert_bytes_requested = sh.reads.expert_bytes_requested;
            own.reads.distinct_experts.clone_from(&sh.reads.distinct_experts);
            own.reads.expert_bytes = sh.reads.expert_bytes;
        }
        let reads = Reads {
            bytes_read: sh.reads.expert_bytes_read,
            cache_hits: sh.reads.cache_hits,
            cache_misses: sh.reads.cache_misses,
        };
        let ran = Ran { prompt_len, reused, queued_s, prefilled_s: st.prefill_s, reads };
        let mut out = self.output(&begin, answer, lane.generation(), &own, &ran, lane.sampler.constraint_error());
        out.echo = echo;
        out.ext["batch"] = json!(lane.peak_batch());
        if !alone {
            for k in ["bytes_read", "expert_bytes_requested", "read_amplification", "cache_hits", "cache_misses"] {
                out.ext[k] = Value::Null;
            }
            out.ext["shared"] = json!({
                "forwards": sh.forward_calls,
                "bytes_read": sh.reads.expert_bytes_read,
                "expert_bytes_requested": sh.reads.expert_bytes_requested,
                "cache_hits": sh.reads.cache_hits,
                "cache_misses": sh.reads.cache_misses,
            });
        }
        self.remember(begin, &out);
        out
    }
}
