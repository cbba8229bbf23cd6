//! The generation core shared by `serve` and `batch`: one request in, text (streamed as deltas)
//! and an [`Output`] with usage and the deltafin extension object out.
//!
//! Contract: [`Generator::generate`] tokenises the request (chat template for messages), picks
//! the session to run it on and generates with the request's sampling, stop strings and
//! log-probabilities. Conversation reuse: after a request the session is kept twice — as it was
//! after the prompt (when the memory budget has room for a second sequence state) and as it is
//! after the answer — and a later request whose tokens extend one
//! of them resumes from the longer one instead of prefilling again (the output is bit-identical to
//! a fresh session's: prefill chunks commit exactly like one long prefill). An exact-response
//! memo answers a repeated identical greedy request without any compute. `sink` receives each
//! token's visible text; returning false cancels the generation at that token.

use super::api::{ApiError, GenRequest, Kind, Prompt};
use crate::engine::ForwardError;
use crate::engine::{Engine, GenerateOptions, Session, StopReason};
use crate::model::chat::{ChatError, ChatOptions, ChatTemplate, Thinking};
use crate::model::tokenizer::{StreamDecoder, Tokenizer};
use crate::sample::{Sampler, SamplingParams, TokenLogprob};
use crate::spec::{DraftKind, Speculator};
use crate::stats::Stats;
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
}

impl Default for GenConfig {
    fn default() -> Self {
        GenConfig { draft: DraftKind::Off, reuse: true, memo_entries: 64 }
    }
}

/// One token's visible text, split into the chat template's channels.
#[derive(Clone, Debug, Default)]
pub struct Delta {
    pub content: String,
    pub reasoning: String,
    pub logprobs: Option<TokenLogprob>,
}

/// A finished request.
#[derive(Clone, Debug)]
pub struct Output {
    pub tokens: Vec<u32>,
    pub content: String,
    pub reasoning: String,
    /// "stop", "length", or "cancelled".
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
    pub ttft_s_sum: f64,
    pub ttft_count: u64,
}

type MemoKey = (Vec<u32>, Kind, usize, Vec<String>, Option<usize>, Option<Thinking>);

/// Turns requests into checked prompt ids; shared (`Send + Sync`) so that a server can validate a
/// request on its HTTP threads before it queues.
pub struct Encoder {
    engine: Arc<Engine>,
    tok: Option<Tokenizer>,
    chat: Option<ChatTemplate>,
}

/// A request's prompt ids and how many tokens it may produce (it fits the context).
#[derive(Clone, Debug)]
pub struct Prepared {
    pub prompt: Vec<u32>,
    pub max_new: usize,
}

pub struct Generator {
    engine: Arc<Engine>,
    enc: Arc<Encoder>,
    stops: Vec<u32>,
    cfg: GenConfig,
    kept: Vec<Session>,
    memo: VecDeque<(MemoKey, Output)>,
    pub totals: Totals,
}

/// Routes tokens into the template's channels: thinking (`<|open|>think<|sep|>`) and response
/// (`<|open|>response<|sep|>`); tags and other structure are not shown.
struct Channels {
    open: Option<u32>,
    close: Option<u32>,
    sep: Option<u32>,
    state: Chan,
}

#[derive(Clone, Debug, PartialEq)]
enum Chan {
    Reasoning,
    Content,
    Tag { opening: bool, name: String },
    Hidden,
}

impl Channels {
    fn route(&mut self, id: u32, piece: String, special: bool) -> (String, String) {
        let is = |x: Option<u32>| x == Some(id);
        if is(self.open) || is(self.close) {
            self.state = Chan::Tag { opening: is(self.open), name: String::new() };
            return Default::default();
        }
        if is(self.sep) {
            if let Chan::Tag { opening, name } = &self.state {
                self.state = match (opening, name.trim()) {
                    (true, "response") => Chan::Content,
                    (true, "think") => Chan::Reasoning,
                    _ => Chan::Hidden,
                };
            }
            return Default::default();
        }
        if special {
            return Default::default();
        }
        match &mut self.state {
            Chan::Reasoning => (String::new(), piece),
            Chan::Content => (piece, String::new()),
            Chan::Tag { name, .. } => {
                name.push_str(&piece);
                Default::default()
            }
            Chan::Hidden => Default::default(),
        }
    }
}

/// Holds back text that could be the start of a stop string; finds the first stop.
struct StopText {
    stops: Vec<String>,
    held: String,
    hit: bool,
}

impl StopText {
    /// Text that is safe to show now; sets `hit` when a stop string appeared (text cut before it).
    fn push(&mut self, piece: &str) -> String {
        if self.hit {
            return String::new();
        }
        self.held.push_str(piece);
        if let Some(pos) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            self.hit = true;
            let out = self.held[..pos].to_string();
            self.held.clear();
            return out;
        }
        // The longest suffix that is a prefix of some stop string stays held.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in self.held.char_indices() {
                if s.starts_with(&self.held[i..]) {
                    keep = keep.max(self.held.len() - i);
                    break;
                }
            }
        }
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        out
    }

    fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

fn ms(s: f64) -> Value {
    json!((s * 1e6).round() / 1e6)
}

impl Generator {
    pub fn new(engine: Arc<Engine>, cfg: GenConfig) -> Result<Self, crate::engine::EngineError> {
        let tok = if engine.dir().join("tiktoken.model").exists() { Some(engine.tokenizer()?) } else { None };
        let chat = tok.as_ref().and_then(|t| ChatTemplate::load(engine.dir(), t).ok());
        let stops = engine.stop_tokens(tok.as_ref());
        let enc = Arc::new(Encoder { engine: Arc::clone(&engine), tok, chat });
        Ok(Generator { engine, enc, stops, cfg, kept: Vec::new(), memo: VecDeque::new(), totals: Totals::default() })
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
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

impl Encoder {
    /// The chat template can take tool definitions.
    pub fn template_takes_tools(&self) -> bool {
        self.engine.dir().join("chat_template.jinja").exists()
            && std::fs::read_to_string(self.engine.dir().join("chat_template.jinja")).is_ok_and(|s| s.contains("tools"))
    }

    /// The prompt's token ids.
    pub fn encode(&self, req: &GenRequest) -> Result<Vec<u32>, ApiError> {
        self.encode_at_most(req, usize::MAX).map_err(|least| {
            ApiError::invalid(self.prompt_param(req), format!("the prompt is at least {least} tokens"))
        })?
    }

    /// The request field that holds the prompt.
    fn prompt_param(&self, req: &GenRequest) -> &'static str {
        if req.kind == Kind::Chat { "messages" } else { "prompt" }
    }

    /// The prompt's token ids, unless its size alone shows it is more than `most` tokens: then
    /// the outer `Err` holds the fewest tokens it can be, found without tokenising it.
    fn encode_at_most(&self, req: &GenRequest, most: usize) -> Result<Result<Vec<u32>, ApiError>, usize> {
        let Some(tok) = self.tok.as_ref() else {
            return match &req.prompt {
                Prompt::Ids(ids) if ids.len() > most => Err(ids.len()),
                Prompt::Ids(ids) => Ok(self.checked_ids(req, ids.clone())),
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
                let opts = ChatOptions {
                    thinking: req.thinking.unwrap_or(Thinking::Max),
                    add_generation_prompt: true,
                    tools: req.tools.clone(),
                };
                match chat.encode_at_most(tok, m, &opts, most) {
                    Ok(ids) => ids,
                    Err(ChatError::TooLong { at_least, .. }) => return Err(at_least),
                    Err(e) => return Ok(Err(ApiError::invalid("messages", e.to_string()))),
                }
            }
        };
        Ok(self.checked_ids(req, ids))
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
        match &self.tok {
            Some(t) => t.token_bytes(id).map(|b| String::from_utf8_lossy(b).into_owned()).unwrap_or_default(),
            None => id.to_string(),
        }
    }

    /// The prompt ids, checked against the context bound with the request's `max_tokens` (default:
    /// the rest of the context). A prompt whose size in bytes already implies too many tokens is
    /// refused with the same error before it is tokenised.
    pub fn prepare(&self, req: &GenRequest) -> Result<Prepared, ApiError> {
        let bound = self.engine.context_bound();
        // The longest prompt that leaves room for max_tokens new tokens (and at least one).
        let most = bound.saturating_sub(req.max_tokens.unwrap_or(0).max(1));
        let prompt = match self.encode_at_most(req, most) {
            Ok(ids) => ids?,
            Err(least) => return Err(self.too_long(req, &format!("at least {least} tokens"), least, bound)),
        };
        let room = bound.saturating_sub(prompt.len());
        let max_new = req.max_tokens.unwrap_or(room);
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
        self.engine.states_fit(2, (2 * prompt_len + max_new) as u64)
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
        self.totals.requests += 1;
        let seed = req.seed.unwrap_or_else(crate::util::fresh_seed);
        let params = SamplingParams::new(req.temperature, req.top_p, seed)
            .map_err(|e| GenError::Request(ApiError::invalid("temperature", e.to_string())))?;
        let key: MemoKey = (prompt.clone(), req.kind, max_new, req.stop.clone(), req.logprobs, req.thinking);
        let memo_ok = params.is_greedy() && req.logprobs.is_none() && self.cfg.memo_entries > 0;
        if memo_ok && let Some((_, hit)) = self.memo.iter().find(|(k, _)| *k == key) {
            let mut out = hit.clone();
            sink(&Delta { content: out.content.clone(), reasoning: out.reasoning.clone(), logprobs: None });
            self.totals.memo_hits += 1;
            self.totals.prompt_tokens += prompt.len() as u64;
            out.ext["memo_hit"] = json!(true);
            out.ext["queue_s"] = ms(queued_s);
            out.ext["ttft_s"] = ms(queued_s + t0.elapsed().as_secs_f64());
            for k in ["prefill_s", "decode_s", "bytes_read", "expert_bytes_requested", "cache_hits", "cache_misses"] {
                out.ext[k] = json!(0);
            }
            return Ok(out);
        }
        let mut spec = crate::spec::drafter_for(self.cfg.draft, &self.engine).ok().flatten().map(Speculator::new);
        // A drafter that reads K3's hidden rows (DSpark) must see the whole prompt: no resume.
        let taps = spec.as_ref().is_some_and(|s| !s.drafter.taps().is_empty());
        let (mut session, reused) =
            if self.cfg.reuse && !taps { self.session_for(&prompt) } else { (self.engine.new_session(), 0) };
        session.stats = Stats::default();
        let src0 = self.engine.source_report();
        if reused < prompt.len() {
            match &mut spec {
                Some(sp) if taps => sp.prefill(&mut session, &prompt)?,
                _ => session.prefill(&prompt[reused..])?,
            };
        }
        let prefilled_s = t0.elapsed().as_secs_f64();
        let snapshot =
            (self.cfg.reuse && self.snapshot_fits(prompt.len(), max_new)).then(|| session.fork()).transpose()?;
        let mut sampler = Sampler::new(params);
        let lp_sink = req.logprobs.map(|n| sampler.record_logprobs(n));
        let is_chat = req.kind == Kind::Chat;
        let enc = Arc::clone(&self.enc);
        let tok = enc.tok.as_ref();
        let sp = |n: &str| tok.and_then(|t| t.special_id(n));
        let mut channels = Channels {
            open: sp("<|open|>"),
            close: sp("<|close|>"),
            sep: sp("<|sep|>"),
            state: if is_chat && req.thinking != Some(Thinking::Off) { Chan::Reasoning } else { Chan::Content },
        };
        let mut stop_text = StopText { stops: req.stop.clone(), held: String::new(), hit: false };
        let mut decoder = StreamDecoder::default();
        let (mut content, mut reasoning) = (String::new(), String::new());
        let mut ttft = None;
        let mut logprobs = Vec::new();
        let mut cancelled = false;
        let mut n = 0;
        let stops = self.stops.clone();
        let opts = GenerateOptions { max_new, stop: stops.clone() };
        let mut on_token = |id: u32| {
            n += 1;
            ttft.get_or_insert_with(|| t0.elapsed().as_secs_f64());
            let lp = lp_sink.as_ref().and_then(|s| s.lock().ok().and_then(|v| v.get(n - 1).cloned()));
            if let Some(l) = &lp {
                logprobs.push(l.clone());
            }
            let mut d = Delta { logprobs: lp, ..Default::default() };
            if !stops.contains(&id) {
                let special = tok.is_some_and(|t| t.is_special(id));
                let piece = match tok {
                    Some(t) if special && (is_chat || t.is_reserved(id)) => String::new(),
                    // A named special's text goes through the decoder too: its name cuts short an
                    // unfinished character before it, as in `Tokenizer::decode` and `run`.
                    Some(t) => decoder.push(t.token_bytes(id).unwrap_or_default()),
                    None => format!("{}{id}", if n > 1 { "," } else { "" }),
                };
                let (c, r) = if is_chat { channels.route(id, piece, special) } else { (piece, String::new()) };
                d.content = stop_text.push(&c);
                d.reasoning = r;
            }
            content.push_str(&d.content);
            reasoning.push_str(&d.reasoning);
            if !sink(&d) {
                cancelled = true;
                return false;
            }
            // A stop string ends the answer at this token.
            !stop_text.hit
        };
        let g = match &mut spec {
            Some(s) => session.generate_speculative_sampled(&opts, s, &mut sampler, &mut on_token),
            None => session.generate_sampled(&opts, &mut sampler, &mut on_token),
        }?;
        // An unfinished UTF-8 character at the end is dropped (it would show as U+FFFD); text held
        // back for a stop string that never came is shown.
        decoder.finish();
        let tail = if stop_text.hit { String::new() } else { stop_text.finish() };
        if !tail.is_empty() {
            content.push_str(&tail);
            sink(&Delta { content: tail, reasoning: String::new(), logprobs: None });
        }
        let finish_reason = match g.reason {
            _ if cancelled => "cancelled",
            StopReason::Cancelled => "stop",
            StopReason::Stop => "stop",
            StopReason::Length => "length",
        };
        let src1 = self.engine.source_report();
        let st = &session.stats;
        let bytes_read = match (src0.expert_bytes_read, src1.expert_bytes_read) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a)),
            _ => None,
        };
        let diff = |a: Option<u64>, b: Option<u64>| a.zip(b).map(|(a, b)| b.saturating_sub(a));
        let unique = st.expert_bytes_unique();
        let ttft_s = queued_s + ttft.unwrap_or(prefilled_s);
        let ext = json!({
            "ttft_s": ms(ttft_s),
            "queue_s": ms(queued_s),
            "prefill_s": ms(st.prefill_s),
            "decode_s": ms(st.decode_s),
            "decode_tok_s": ms(st.decode_tok_s()),
            "prompt_tokens_reused": reused,
            "memo_hit": false,
            "bytes_read": bytes_read,
            "expert_bytes_requested": st.expert_bytes_requested,
            "read_amplification": bytes_read.filter(|_| unique > 0).map(|b| b as f64 / unique as f64),
            "cache_hits": diff(src0.cache_hits, src1.cache_hits),
            "cache_misses": diff(src0.cache_misses, src1.cache_misses),
            "drafts_proposed": st.drafts_proposed,
            "drafts_accepted": st.drafts_accepted,
            "seed": seed,
        });
        let t = &mut self.totals;
        t.prompt_tokens += prompt.len() as u64;
        t.prompt_tokens_reused += reused as u64;
        t.completion_tokens += g.tokens.len() as u64;
        t.cancelled += u64::from(cancelled);
        t.drafts_proposed += st.drafts_proposed;
        t.drafts_accepted += st.drafts_accepted;
        t.ttft_s_sum += ttft_s;
        t.ttft_count += 1;
        let out =
            Output { tokens: g.tokens, content, reasoning, finish_reason, logprobs, prompt_tokens: prompt.len(), ext };
        if self.cfg.reuse {
            self.kept = snapshot.into_iter().chain(std::iter::once(session)).collect();
        }
        if memo_ok && !cancelled {
            if self.memo.len() >= self.cfg.memo_entries {
                self.memo.pop_front();
            }
            self.memo.push_back((key, out.clone()));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_are_held_back_and_cut() {
        let mut s = StopText { stops: vec!["END".into()], held: String::new(), hit: false };
        assert_eq!(s.push("abc E"), "abc ");
        assert_eq!(s.push("N"), "");
        assert_eq!(s.push("x"), "ENx");
        assert_eq!(s.push("yyEND zz"), "yy");
        assert!(s.hit);
        let mut s = StopText { stops: vec![], held: String::new(), hit: false };
        assert_eq!(s.push("free"), "free");
    }

    #[test]
    fn channels_split_thinking_from_the_response() {
        let mut c = Channels { open: Some(1), close: Some(2), sep: Some(3), state: Chan::Reasoning };
        let mut out = (String::new(), String::new());
        for (id, p, sp) in [
            (10, "hm", false),
            (2, "", true),
            (11, "think", false),
            (3, "", true),
            (1, "", true),
            (12, "response", false),
            (3, "", true),
            (13, "Hi", false),
            (2, "", true),
            (14, "response", false),
        ] {
            let (a, b) = c.route(id, p.to_string(), sp);
            out.0.push_str(&a);
            out.1.push_str(&b);
        }
        assert_eq!(out, ("Hi".to_string(), "hm".to_string()));
    }
}
