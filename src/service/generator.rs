//! The generation core every front end shares (`serve`, `batch`, `chat`): one request in, text
//! (streamed as deltas) and an [`Output`] with usage and the deltafin extension object out.
//!
//! Contract: [`Generator::generate`] tokenises the request (chat template for messages), picks
//! the session to run it on and generates with the request's sampling, stop strings and
//! log-probabilities. Conversation reuse: after a request the session is kept twice — as it was
//! after the prompt (when the memory budget has room for a second sequence state) and as it is
//! after the answer — and a later request whose tokens extend one
//! of them resumes from the longer one instead of prefilling again (the output is bit-identical to
//! a fresh session's: prefill chunks commit exactly like one long prefill). A prefix that the
//! requests to come share (`batch`: [`Generator::share_prefix`], `prefix.rs`) is prefilled once
//! and kept; a request that starts with it runs on a fork of it. An exact-response
//! memo answers a repeated identical greedy request without any compute. `sink` receives each
//! token's visible text; returning false cancels the generation at that token.

use super::answer::Answer;
pub use super::encoder::{Encoder, Prepared, PromptCodec, template_takes_tools};
use crate::api::response::Echo;
use crate::api::{ApiError, Delta, GenRequest, Kind, Output, Prompt};
use crate::draft::{DraftKind, Speculator};
use crate::engine::{Engine, ForwardError, GenerateOptions, Generation, Session, StopReason};
use crate::model::chat::Thinking;
use crate::sample::{Sampler, SamplingSpec};
use crate::stats::Stats;
use crate::store::SourceReport;
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

/// Generator settings.
#[derive(Clone, Debug)]
pub struct GenConfig {
    pub draft: DraftKind,
    /// Keep sessions for conversation reuse (a second sequence state, taken only when the memory
    /// budget has room for it).
    pub reuse: bool,
    /// Entries of the exact-response memo (0: off).
    pub memo_entries: usize,
    /// Also keep sessions in this directory, with at most this many bytes (`state_dir.rs`).
    pub state_dir: Option<(std::path::PathBuf, u64)>,
}

impl Default for GenConfig {
    fn default() -> Self {
        GenConfig { draft: DraftKind::Off, reuse: true, memo_entries: 64, state_dir: None }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GenError {
    #[error("{0}")]
    Request(ApiError),
    #[error("generation failed: {0}")]
    Forward(#[from] ForwardError),
}

/// Totals since start, for /metrics.
#[derive(Clone, Debug, Default)]
pub struct Totals {
    pub requests: u64,
    pub prompt_tokens: u64,
    pub prompt_tokens_reused: u64,
    pub completion_tokens: u64,
    pub memo_hits: u64,
    pub cancelled: u64,
    pub drafts_proposed: u64,
    pub drafts_accepted: u64,
    /// Prompt rows the requests prefilled (their prompts less what they reused; a memo answer
    /// none).
    pub prefill_rows: u64,
    /// Routed expert bytes the requests' forwards asked for (each request's own; a running
    /// batch's shared forwards are counted by its totals instead).
    pub expert_bytes_requested: u64,
    /// Expert bytes read from the drives during the requests (alone; a running batch's reads are
    /// counted by its totals).
    pub expert_bytes_read: u64,
    pub ttft_s_sum: f64,
    pub ttft_count: u64,
}

/// Prompt ids, kind, max_new, stop strings, log-probabilities, thinking, and the output constraint,
/// tool handling (which the prompt does not always show) and the logit bias and penalties.
pub(super) type MemoKey = (Vec<u32>, Kind, usize, Vec<String>, Option<usize>, Option<Thinking>, String);

pub struct Generator {
    pub(super) engine: Arc<Engine>,
    pub(super) enc: Arc<Encoder>,
    pub(super) stops: Vec<u32>,
    pub(super) cfg: GenConfig,
    kept: Vec<Session>,
    /// Kept sessions spilled to disk (`serve --state-dir`).
    disk: Option<super::state_dir::StateDir>,
    /// The prefix the requests share, prefilled once (`prefix.rs`).
    pub(super) shared: Option<Session>,
    memo: VecDeque<(MemoKey, Output)>,
    pub totals: Totals,
}

fn ms(s: f64) -> Value {
    json!((s * 1e6).round() / 1e6)
}

impl Generator {
    pub fn new(engine: Arc<Engine>, cfg: GenConfig) -> Result<Self, crate::engine::EngineError> {
        let codec = PromptCodec::load(engine.dir())?;
        if let Some(t) = &codec.tok {
            engine.check_tokenizer(t)?;
        }
        let stops = engine.stop_tokens(codec.tok.as_ref());
        let enc = Arc::new(Encoder { engine: Arc::clone(&engine), codec, grammars: Default::default() });
        let disk = match &cfg.state_dir {
            Some((dir, cap)) => {
                let (d, notes) = super::state_dir::StateDir::open(&engine, dir, *cap).map_err(|e| {
                    let value = dir.display().to_string();
                    crate::engine::EngineError::Setting {
                        setting: crate::setting::Setting::StateDir,
                        value,
                        problem: e.to_string(),
                    }
                })?;
                notes.iter().for_each(|n| eprintln!("deltafin: {n}"));
                Some(d)
            }
            None => None,
        };
        Ok(Generator {
            engine,
            enc,
            stops,
            cfg,
            kept: Vec::new(),
            disk,
            shared: None,
            memo: VecDeque::new(),
            totals: Totals::default(),
        })
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// Keeps sessions in `dir` too (see `state_dir`), loading those it holds on demand.
    pub fn attach_state_dir(&mut self, dir: super::state_dir::StateDir) {
        self.disk = Some(dir);
    }

    /// The request encoder (for validating requests elsewhere).
    pub fn encoder(&self) -> Arc<Encoder> {
        Arc::clone(&self.enc)
    }

    /// The chat template can take tool definitions.
    pub fn template_takes_tools(&self) -> bool {
        self.enc.template_takes_tools()
    }

    /// The printable text of one token (specials by name).
    pub fn token_text(&self, id: u32) -> String {
        self.enc.token_text(id)
    }
}

impl Generator {
    /// A second sequence state (the snapshot after the prompt) fits in the memory budget beside
    /// the running one, at their lengths: the plan only reserves one.
    fn snapshot_fits(&self, prompt_len: usize, max_new: usize) -> bool {
        // The shared prefix is held beside them.
        let (states, held) = self.shared.as_ref().map_or((2, 0), |s| (3, s.pos()));
        self.engine.states_fit(states, (2 * prompt_len + max_new + held) as u64)
    }

    /// The kept session that `prompt` extends the most (dropping the others), or a new one.
    fn session_for(&mut self, prompt: &[u32]) -> (Session, usize) {
        let best = self
            .kept
            .iter()
            .enumerate()
            .filter(|(_, s)| s.logits().is_some() && s.pos() <= prompt.len() && prompt.starts_with(s.tokens()))
            .max_by_key(|(_, s)| s.pos())
            .map(|(i, _)| i);
        let mut kept = std::mem::take(&mut self.kept);
        let in_memory = best.map_or(0, |i| kept[i].pos());
        let shared = self.shared_len(prompt);
        // A longer saved session on disk wins; one that fails its checks is a miss.
        if let Some(d) = &mut self.disk
            && let Some((i, n)) = d.best(prompt).filter(|&(_, n)| n > in_memory.max(shared))
        {
            match d.load(&self.engine, i) {
                Ok(s) => return (s, n),
                Err(e) => eprintln!("deltafin: state dir: {e}"),
            }
        }
        // The shared prefix, when it is the longest, runs as a fork (kept for the next request).
        if shared > in_memory
            && let Some(s) = self.fork_shared()
        {
            return (s, shared);
        }
        match best {
            Some(i) => {
                let s = kept.swap_remove(i);
                let n = s.pos();
                (s, n)
            }
            None => (self.engine.new_session(), 0),
        }
    }

    /// Runs one request; see the module contract. `queued_s` is how long it waited to start.
    pub fn generate(
        &mut self,
        req: &GenRequest,
        queued_s: f64,
        sink: &mut dyn FnMut(&Delta) -> bool,
    ) -> Result<Output, GenError> {
        let prepared = self.enc.prepare(req).map_err(GenError::Request)?;
        self.generate_prepared(req, prepared, queued_s, sink)
    }

    /// [`Generator::generate`] for a request already prepared by [`Encoder::prepare`].
    pub fn generate_prepared(
        &mut self,
        req: &GenRequest,
        prepared: Prepared,
        queued_s: f64,
        sink: &mut dyn FnMut(&Delta) -> bool,
    ) -> Result<Output, GenError> {
        let t0 = Instant::now();
        let Prepared { prompt, max_new } = prepared;
        let begin = self.begin(req, &prompt, max_new)?;
        if let Some(out) = self.memo_answer(&begin, prompt.len(), queued_s, t0, sink) {
            return Ok(out);
        }
        // The prompt's log-probabilities need its rows' logits: a fresh session, no drafter.
        let scored = req.echo && req.logprobs.is_some();
        let mut spec = if scored { None } else { self.engine.speculator(self.cfg.draft).ok().flatten() };
        // A drafter that drafts only from K3's hidden rows (DSpark) must see the whole prompt: no
        // resume. With n-gram lookup beside it (`auto`) a resumed session drafts by lookup alone.
        let whole = spec.as_ref().is_some_and(Speculator::needs_whole_prompt);
        let (mut session, reused) = if self.cfg.reuse && !whole && !scored {
            self.session_for(&prompt)
        } else {
            (self.engine.new_session(), 0)
        };
        let taps = reused == 0 && spec.as_ref().is_some_and(|s| !s.taps().is_empty());
        session.stats = Stats::default();
        let src0 = self.engine.source_report();
        let (echo, from) = self.echo(req, &mut session, &prompt)?;
        let from = from.max(reused);
        if from < prompt.len() {
            match &mut spec {
                Some(sp) if taps => session.prefill_with(&prompt, sp)?,
                _ => session.prefill(&prompt[from..])?,
            };
        }
        let prefilled_s = t0.elapsed().as_secs_f64();
        let snapshot =
            (self.cfg.reuse && self.snapshot_fits(prompt.len(), max_new)).then(|| session.fork()).transpose()?;
        let mut sampler = Sampler::new(begin.params.clone());
        if let Some(m) = self.enc.constraint(req).map_err(GenError::Request)? {
            sampler.constrain(m);
        }
        let lp_sink = req.logprobs.map(|n| sampler.record_logprobs(n));
        let mut answer = Answer::new(req, self.enc.clone(), self.stops.clone(), t0, lp_sink).with_call_seed(begin.seed);
        let opts = GenerateOptions { max_new, stop: self.stops.clone() };
        let mut on_token = |id: u32| answer.token(id, sink);
        let g = match &mut spec {
            Some(s) => session.generate_speculative_sampled(&opts, s, &mut sampler, &mut on_token),
            None => session.generate_sampled(&opts, &mut sampler, &mut on_token),
        }?;
        answer.finish(sink);
        let reads = Reads::between(&src0, &self.engine.source_report());
        let ran = Ran { prompt_len: prompt.len(), reused, queued_s, prefilled_s, reads };
        let mut out = self.output(&begin, answer, g, &session.stats, &ran, sampler.constraint_error());
        out.echo = echo;
        if self.cfg.reuse {
            self.kept = snapshot.into_iter().chain(std::iter::once(session)).collect();
            if let Some(d) = &mut self.disk {
                for s in &self.kept {
                    // A full or failing disk costs the reuse, never the request.
                    if let Err(e) = d.keep(s) {
                        eprintln!("deltafin: state dir: {e}");
                    }
                }
            }
        }
        self.remember(begin, &out);
        Ok(out)
    }

    /// A completion's `echo` (None without it): its prompt's text and tokens and, with
    /// `logprobs`, the log-probabilities of its tokens, from scoring all of it but the last token
    /// on `session` (fresh); with them, where the rest of the prompt starts (0 when nothing was
    /// fed).
    pub(super) fn echo(
        &self,
        req: &GenRequest,
        session: &mut Session,
        prompt: &[u32],
    ) -> Result<(Option<Echo>, usize), ForwardError> {
        if !req.echo {
            return Ok((None, 0));
        }
        let text = match (&req.prompt, self.enc.tokenizer()) {
            (Prompt::Text(t), _) => t.clone(),
            (_, Some(tok)) => tok.decode(prompt).unwrap_or_default(),
            (_, None) => prompt.iter().map(u32::to_string).collect::<Vec<_>>().join(","),
        };
        let Some(top) = req.logprobs else {
            return Ok((Some(Echo { text, tokens: prompt.to_vec(), logprobs: None }), 0));
        };
        let n = prompt.len();
        let mut lps = vec![None];
        if n > 1 {
            let vocab = self.engine.vocab();
            let rows = session.score(&prompt[..n - 1])?;
            for (j, row) in rows.chunks_exact(vocab).enumerate() {
                lps.push(Some(crate::sample::logprobs(row, prompt[j + 1], top)));
            }
        }
        Ok((Some(Echo { text, tokens: prompt.to_vec(), logprobs: Some(lps) }), n.saturating_sub(1)))
    }

    /// Counts a request and fixes its sampling (its seed drawn now when it gives none) and its
    /// memo key (when the memo may answer it: greedy, no log-probabilities).
    pub(super) fn begin(&mut self, req: &GenRequest, prompt: &[u32], max_new: usize) -> Result<Begin, GenError> {
        self.totals.requests += 1;
        let seed = req.sampling.seed.unwrap_or_else(crate::util::fresh_seed);
        let params = SamplingSpec { seed: Some(seed), ..req.sampling.clone() };
        params.check().map_err(|e| GenError::Request(ApiError::invalid(e.field(), e.to_string())))?;
        let memo_ok = params.is_greedy() && req.logprobs.is_none() && !req.echo && self.cfg.memo_entries > 0;
        // Greedy picks still depend on the logit bias and penalties.
        let (r, f, p, b) =
            (params.repetition_penalty, params.frequency_penalty, params.presence_penalty, &params.logit_bias);
        let tools = format!(
            "{:?}{:?}{:?}{}{:?}",
            req.tools,
            req.tool_choice,
            req.response_format,
            req.parallel_tool_calls,
            (r, f, p, b)
        );
        let key =
            memo_ok.then(|| (prompt.to_vec(), req.kind, max_new, req.stop.clone(), req.logprobs, req.thinking, tools));
        Ok(Begin { seed, params, key })
    }

    /// The memo's answer to a request, when it has one (its text handed to `sink` at once).
    pub(super) fn memo_answer(
        &mut self,
        begin: &Begin,
        prompt_len: usize,
        queued_s: f64,
        t0: Instant,
        sink: &mut dyn FnMut(&Delta) -> bool,
    ) -> Option<Output> {
        let key = begin.key.as_ref()?;
        let (_, hit) = self.memo.iter().find(|(k, _)| k == key)?;
        let mut out = hit.clone();
        let tool_calls = out.tool_calls.iter().cloned().enumerate().collect();
        sink(&Delta { content: out.content.clone(), reasoning: out.reasoning.clone(), logprobs: None, tool_calls });
        self.totals.memo_hits += 1;
        self.totals.prompt_tokens += prompt_len as u64;
        out.ext["memo_hit"] = json!(true);
        out.ext["queue_s"] = ms(queued_s);
        out.ext["ttft_s"] = ms(queued_s + t0.elapsed().as_secs_f64());
        for k in ["prefill_s", "decode_s", "bytes_read", "expert_bytes_requested", "cache_hits", "cache_misses"] {
            out.ext[k] = json!(0);
        }
        if let Some(o) = out.ext.as_object_mut() {
            o.remove("shared");
        }
        Some(out)
    }

    /// A finished request's output (usage, the deltafin object) from its answer, generation and
    /// counters; adds it to the totals.
    /// `failed`: why the answer's output constraint failed, if it did (the answer is cut short: its
    /// finish_reason is "error", and the extension object says why).
    pub(super) fn output(
        &mut self,
        begin: &Begin,
        answer: Answer,
        g: Generation,
        st: &Stats,
        ran: &Ran,
        failed: Option<String>,
    ) -> Output {
        let cancelled = answer.cancelled;
        let finish_reason = match g.reason {
            _ if cancelled => "cancelled",
            _ if failed.is_some() => "error",
            StopReason::Stop if !answer.tool_calls.is_empty() => "tool_calls",
            StopReason::Cancelled => "stop",
            StopReason::Stop => "stop",
            StopReason::Length => "length",
        };
        let bytes_read = ran.reads.bytes_read;
        let unique = st.expert_bytes_unique();
        let ttft_s = ran.queued_s + answer.ttft.unwrap_or(ran.prefilled_s);
        let mut ext = json!({
            "ttft_s": ms(ttft_s),
            "queue_s": ms(ran.queued_s),
            "prefill_s": ms(st.prefill_s),
            "decode_s": ms(st.decode_s),
            "decode_tok_s": ms(st.decode_tok_s()),
            "prompt_tokens_reused": ran.reused,
            "memo_hit": false,
            "bytes_read": bytes_read,
            "expert_bytes_requested": st.reads.expert_bytes_requested,
            "read_amplification": bytes_read.filter(|_| unique > 0).map(|b| b as f64 / unique as f64),
            "cache_hits": ran.reads.cache_hits,
            "cache_misses": ran.reads.cache_misses,
            "drafts_proposed": st.drafts.proposed,
            "drafts_accepted": st.drafts.accepted,
            "seed": begin.seed,
        });
        if let Some(e) = failed {
            tracing::warn!("{e}");
            ext["constraint_error"] = json!(e);
        }
        if answer.dropped_tools {
            ext["tool_section_dropped"] = json!(true);
        }
        let t = &mut self.totals;
        t.prompt_tokens += ran.prompt_len as u64;
        t.prompt_tokens_reused += ran.reused as u64;
        t.completion_tokens += g.tokens.len() as u64;
        t.cancelled += u64::from(cancelled);
        t.drafts_proposed += st.drafts.proposed;
        t.drafts_accepted += st.drafts.accepted;
        t.expert_bytes_requested += st.reads.expert_bytes_requested;
        t.expert_bytes_read += ran.reads.bytes_read.unwrap_or(0);
        t.prefill_rows += ran.prompt_len.saturating_sub(ran.reused) as u64;
        t.ttft_s_sum += ttft_s;
        t.ttft_count += 1;
        let Answer { content, reasoning, logprobs, tool_calls, .. } = answer;
        Output {
            tokens: g.tokens,
            content,
            reasoning,
            tool_calls,
            finish_reason,
            logprobs,
            prompt_tokens: ran.prompt_len,
            ext,
            echo: None,
        }
    }

    /// Keeps a finished answer in the memo when it may answer a repeat.
    pub(super) fn remember(&mut self, begin: Begin, out: &Output) {
        if let Some(key) = begin.key
            && out.finish_reason != "cancelled"
        {
            if self.memo.len() >= self.cfg.memo_entries {
                self.memo.pop_front();
            }
            self.memo.push_back((key, out.clone()));
        }
    }
}

/// A request's sampling and memo key, fixed when it starts ([`Generator::begin`]).
pub(super) struct Begin {
    pub seed: u64,
    pub params: SamplingSpec,
    pub key: Option<MemoKey>,
}

/// How a request ran, for its output: prompt length, tokens reused, queue and prefill seconds,
/// and the expert reads it made.
pub(super) struct Ran {
    pub prompt_len: usize,
    pub reused: usize,
    pub queued_s: f64,
    pub prefilled_s: f64,
    pub reads: Reads,
}

/// Expert reads from drives and the cache's hits and misses (None where the source does not
/// count them).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Reads {
    pub bytes_read: Option<u64>,
    pub cache_hits: Option<u64>,
    pub cache_misses: Option<u64>,
}

impl Reads {
    /// The reads between two reports of the source.
    pub fn between(a: &SourceReport, b: &SourceReport) -> Reads {
        let diff = |a: Option<u64>, b: Option<u64>| a.zip(b).map(|(a, b)| b.saturating_sub(a));
        Reads {
            bytes_read: diff(a.expert_bytes_read, b.expert_bytes_read),
            cache_hits: diff(a.cache_hits, b.cache_hits),
            cache_misses: diff(a.cache_misses, b.cache_misses),
        }
    }
}
