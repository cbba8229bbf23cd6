//! The generation core shared by `serve` and `batch`: one request in, text (streamed as deltas)
//! and an [`Output`] with usage and the deltafin extension object out.
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

pub use super::answer::Delta;
use super::answer::{Answer, Tokens};
use super::api::{ApiError, GenRequest, Kind, Prompt};
use crate::draft::DraftKind;
use crate::engine::{Engine, ForwardError, GenerateOptions, Generation, Session, StopReason};
use crate::model::chat::{ChatError, ChatOptions, ChatTemplate, Thinking};
use crate::model::tokenizer::Tokenizer;
use crate::sample::{Sampler, SamplingParams, TokenLogprob};
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

/// A finished request.
#[derive(Clone, Debug)]
pub struct Output {
    pub tokens: Vec<u32>,
    pub content: String,
    pub reasoning: String,
    /// The model's tool calls (a chat answer to a request with tools).
    pub tool_calls: Vec<crate::model::tool_calls::ToolCall>,
    /// "stop", "length", "tool_calls", "cancelled", or "error" (the output constraint failed).
    pub finish_reason: &'static str,
    pub logprobs: Vec<TokenLogprob>,
    pub prompt_tokens: usize,
    /// The deltafin extension object.
    pub ext: Value,
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

/// Prompt ids, kind, max_new, stop strings, log-probabilities, thinking, and the output constraint
/// and tool handling (which the prompt does not always show).
pub(super) type MemoKey = (Vec<u32>, Kind, usize, Vec<String>, Option<usize>, Option<Thinking>, String);

/// Turns requests into checked prompt ids; shared (`Send + Sync`) so that a server can validate a
/// request on its HTTP threads before it queues.
pub struct Encoder {
    pub(super) engine: Arc<Engine>,
    codec: PromptCodec,
    /// The grammar engine of enforced output (serve/constrained.rs), built on first use.
    pub(super) grammars: std::sync::OnceLock<Result<crate::constrain::Grammars, String>>,
}

/// A model's tokenizer and chat template: a request's prompt into ids, without an engine (so a
/// batch can size its sequences' context from its requests before the engine opens).
pub struct PromptCodec {
    tok: Option<Tokenizer>,
    chat: Option<ChatTemplate>,
    /// The thinking of a chat request that sets none: the model's generation_config.json
    /// (`chat_template_kwargs`), else the template's default (max).
    thinking: Thinking,
}

/// A request's prompt ids and how many tokens it may produce (it fits the context).
#[derive(Clone, Debug)]
pub struct Prepared {
    pub prompt: Vec<u32>,
    pub max_new: usize,
}

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

/// The chat template of the model in `dir` can take tool definitions (it mentions `tools`).
pub fn template_takes_tools(dir: &std::path::Path) -> bool {
    std::fs::read_to_string(dir.join("chat_template.jinja")).is_ok_and(|s| s.contains("tools"))
}

impl PromptCodec {
    /// The tokenizer and chat template of the model in `dir` (none where it has none).
    pub fn load(dir: &std::path::Path) -> Result<Self, crate::engine::EngineError> {
        let tok = if dir.join("tiktoken.model").exists() { Some(crate::engine::load_tokenizer(dir)?) } else { None };
        let chat = tok.as_ref().and_then(|t| ChatTemplate::load(dir, t).ok());
        let g = crate::model::generation::GenerationDefaults::load(dir)?.unwrap_or_default();
        Ok(PromptCodec { tok, chat, thinking: g.thinking.unwrap_or(Thinking::Max) })
    }

    /// The thinking a chat request gets: its own, else the model's default.
    pub fn thinking(&self, req: &GenRequest) -> Thinking {
        req.thinking.unwrap_or(self.thinking)
    }

    /// The prompt's length in tokens, or past `most` the fewest tokens its size implies (found
    /// without tokenising it); None where it cannot be encoded (its error comes when the request
    /// is prepared).
    pub fn prompt_len(&self, req: &GenRequest, most: usize) -> Option<usize> {
        match self.encode_at_most(req, most) {
            Ok(ids) => Some(ids.ok()?.len()),
            Err(least) => Some(least),
        }
    }

    /// The prompt's token ids, where it encodes in at most `most` tokens.
    pub fn prompt_ids(&self, req: &GenRequest, most: usize) -> Option<Vec<u32>> {
        self.encode_at_most(req, most).ok()?.ok()
    }

    /// The prompt's token ids (unchecked against the vocabulary), unless its size alone shows it
    /// is more than `most` tokens: then the outer `Err` holds the fewest tokens it can be, found
    /// without tokenising it.
    fn encode_at_most(&self, req: &GenRequest, most: usize) -> Result<Result<Vec<u32>, ApiError>, usize> {
        let Some(tok) = self.tok.as_ref() else {
            return match &req.prompt {
                Prompt::Ids(ids) if ids.len() > most => Err(ids.len()),
                Prompt::Ids(ids) => Ok(Ok(ids.clone())),
                _ => Ok(Err(ApiError::invalid("prompt", "this model has no tokenizer: give token ids"))),
            };
        };
        let ids = match &req.prompt {
            Prompt::Ids(ids) if ids.len() > most => return Err(ids.len()),
            Prompt::Ids(ids) => ids.clone(),
            Prompt::Text(t) => {
                let least = tok.min_tokens(t.len());
                if least > most {
                    return Err(least);
                }
                tok.encode(t)
            }
            Prompt::Messages(m) => {
                let Some(chat) = self.chat.as_ref() else {
                    return Ok(Err(ApiError::invalid("messages", "this model has no chat template")));
                };
                // The template renders every message's content: refused by their size before the
                // rendering copies them (a 50 MB message took the server's peak RSS to 315 MB).
                let content: usize =
                    m.as_array().map_or(0, |a| a.iter().filter_map(|x| x["content"].as_str()).map(str::len).sum());
                let least = tok.min_tokens(content);
                if least > most {
                    return Err(least);
                }
                let (tool_choice, response_format) = super::api::template_vars(req);
                let opts = ChatOptions {
                    thinking: self.thinking(req),
                    add_generation_prompt: true,
                    tools: req.tools.clone(),
                    tool_choice,
                    response_format,
                };
                match chat.encode_at_most(tok, m, &opts, most) {
                    Ok(ids) => ids,
                    Err(ChatError::TooLong { at_least, .. }) => return Err(at_least),
                    Err(e) => return Ok(Err(ApiError::invalid("messages", e.to_string()))),
                }
            }
        };
        Ok(Ok(ids))
    }
}

impl Encoder {
    /// The model's tokenizer (None for a model given token ids only).
    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.codec.tok.as_ref()
    }

    /// The chat template can take tool definitions.
    pub fn template_takes_tools(&self) -> bool {
        template_takes_tools(self.engine.dir())
    }

    /// The prompt's token ids.
    pub fn encode(&self, req: &GenRequest) -> Result<Vec<u32>, ApiError> {
        self.encode_at_most(req, usize::MAX).map_err(|least| {
            ApiError::invalid(self.prompt_param(req), format!("the prompt is at least {least} tokens"))
        })?
    }

    /// The thinking `req` runs with.
    pub fn thinking_of(&self, req: &GenRequest) -> Thinking {
        self.codec.thinking(req)
    }

    /// The request field that holds the prompt.
    fn prompt_param(&self, req: &GenRequest) -> &'static str {
        if req.kind == Kind::Chat { "messages" } else { "prompt" }
    }

    /// The prompt's checked token ids, unless its size alone shows it is more than `most` tokens:
    /// then the outer `Err` holds the fewest tokens it can be, found without tokenising it.
    fn encode_at_most(&self, req: &GenRequest, most: usize) -> Result<Result<Vec<u32>, ApiError>, usize> {
        Ok(self.codec.encode_at_most(req, most)?.and_then(|ids| self.checked_ids(req, ids)))
    }

    /// `ids` if they are a prompt: not empty, every id in the vocabulary.
    fn checked_ids(&self, req: &GenRequest, ids: Vec<u32>) -> Result<Vec<u32>, ApiError> {
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= self.engine.vocab()) {
            return Err(ApiError::invalid(
                "prompt",
                format!("token id {bad} is outside the vocabulary ({})", self.engine.vocab()),
            ));
        }
        if ids.is_empty() {
            return Err(ApiError::invalid(self.prompt_param(req), "the prompt is empty"));
        }
        Ok(ids)
    }

    /// The printable text of one token (specials by name).
    pub fn token_text(&self, id: u32) -> String {
        match &self.codec.tok {
            Some(t) => t.token_bytes(id).map(|b| String::from_utf8_lossy(b).into_owned()).unwrap_or_default(),
            None => id.to_string(),
        }
    }

    /// The prompt ids, checked against the context bound with the request's `max_tokens` (default:
    /// the rest of the context, at most `default_max_tokens`). A prompt whose size in bytes
    /// already implies too many tokens is refused with the same error before it is tokenised.
    pub fn prepare(&self, req: &GenRequest) -> Result<Prepared, ApiError> {
        let bound = self.engine.context_bound();
        // The longest prompt that leaves room for max_tokens new tokens (and at least one).
        let most = bound.saturating_sub(req.max_tokens.unwrap_or(0).max(1));
        self.check_constraint(req)?;
        let prompt = match self.encode_at_most(req, most) {
            Ok(ids) => ids?,
            Err(least) => return Err(self.too_long(req, &format!("at least {least} tokens"), least, bound)),
        };
        let room = bound.saturating_sub(prompt.len());
        let max_new = req.max_tokens.unwrap_or(room.min(req.default_max_tokens.unwrap_or(usize::MAX)));
        if room == 0 || max_new > room {
            return Err(self.too_long(req, &format!("{} tokens", prompt.len()), prompt.len(), bound));
        }
        Ok(Prepared { prompt, max_new })
    }

    /// The context error: the prompt (`len` tokens, described as `what`) and the new tokens do
    /// not fit in `bound`.
    fn too_long(&self, req: &GenRequest, what: &str, len: usize, bound: usize) -> ApiError {
        let max_new = req.max_tokens.unwrap_or(bound.saturating_sub(len));
        let param = if req.max_tokens.is_some() { "max_tokens" } else { self.prompt_param(req) };
        ApiError::invalid(
            param,
            format!("the prompt ({what}) plus {max_new} new tokens exceeds the context of {bound} tokens"),
        )
        .with_code("context_length_exceeded")
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
        let mut spec = self.engine.speculator(self.cfg.draft).ok().flatten();
        // A drafter that reads K3's hidden rows (DSpark) must see the whole prompt: no resume.
        let taps = spec.as_ref().is_some_and(|s| !s.taps().is_empty());
        let (mut session, reused) =
            if self.cfg.reuse && !taps { self.session_for(&prompt) } else { (self.engine.new_session(), 0) };
        session.stats = Stats::default();
        let src0 = self.engine.source_report();
        if reused < prompt.len() {
            match &mut spec {
                Some(sp) if taps => session.prefill_with(&prompt, sp)?,
                _ => session.prefill(&prompt[reused..])?,
            };
        }
        let prefilled_s = t0.elapsed().as_secs_f64();
        let snapshot =
            (self.cfg.reuse && self.snapshot_fits(prompt.len(), max_new)).then(|| session.fork()).transpose()?;
        let mut sampler = Sampler::new(begin.params);
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
        let out = self.output(&begin, answer, g, &session.stats, &ran, sampler.constraint_error());
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

    /// Counts a request and fixes its sampling (its seed drawn now when it gives none) and its
    /// memo key (when the memo may answer it: greedy, no log-probabilities).
    pub(super) fn begin(&mut self, req: &GenRequest, prompt: &[u32], max_new: usize) -> Result<Begin, GenError> {
        self.totals.requests += 1;
        let seed = req.seed.unwrap_or_else(crate::util::fresh_seed);
        let params = SamplingParams::new(req.temperature, req.top_p, seed)
            .and_then(|p| p.with_filters(req.top_k, req.min_p))
            .map_err(|e| GenError::Request(ApiError::invalid("temperature", e.to_string())))?;
        let memo_ok = params.is_greedy() && req.logprobs.is_none() && self.cfg.memo_entries > 0;
        let tools = format!("{:?}{:?}{:?}{}", req.tools, req.tool_choice, req.response_format, req.parallel_tool_calls);
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
            "expert_bytes_requested": st.expert_bytes_requested,
            "read_amplification": bytes_read.filter(|_| unique > 0).map(|b| b as f64 / unique as f64),
            "cache_hits": ran.reads.cache_hits,
            "cache_misses": ran.reads.cache_misses,
            "drafts_proposed": st.drafts_proposed,
            "drafts_accepted": st.drafts_accepted,
            "seed": begin.seed,
        });
        if let Some(e) = failed {
            tracing::warn!("{e}");
            ext["constraint_error"] = json!(e);
        }
        let t = &mut self.totals;
        t.prompt_tokens += ran.prompt_len as u64;
        t.prompt_tokens_reused += ran.reused as u64;
        t.completion_tokens += g.tokens.len() as u64;
        t.cancelled += u64::from(cancelled);
        t.drafts_proposed += st.drafts_proposed;
        t.drafts_accepted += st.drafts_accepted;
        t.expert_bytes_requested += st.expert_bytes_requested;
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
    pub params: SamplingParams,
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

impl Tokens for Encoder {
    fn tokenizer(&self) -> Option<&Tokenizer> {
        self.codec.tok.as_ref()
    }

    fn thinking(&self, req: &GenRequest) -> Thinking {
        self.codec.thinking(req)
    }
}
