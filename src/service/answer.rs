//! One answer's text as its tokens come: the chat template's channels (thinking and response),
//! stop strings held back until they are decided, UTF-8 split over tokens held back, and the
//! per-token deltas a server streams.
//!
//! Contract: [`Answer::token`] takes each emitted token in order and hands its visible text to
//! the sink (false from the sink: cancelled, the generation ends at that token; a stop string
//! ends it too); [`Answer::finish`] drops an unfinished character and shows text held back for a
//! stop string that never came. Stop strings apply to the whole generated text, the thinking
//! channel included (as vLLM applies them): a stop string in the reasoning ends the answer there.
//! Each channel's text is held back on its own (a stop string does not span the two); text held in
//! one is shown once the other speaks. The same tokens give the same text whether the answer was
//! generated alone or in a batch.
//! No answer shows a special token or the template's syntax (as vLLM's `skip_special_tokens`):
//! in a chat, tags, channel markers and end-of-message tokens route or end the text and are not
//! part of it, and a tools section that is not whole calls — malformed, or cut off by the end of
//! the answer (`max_tokens`) — is dropped, not shown as content (the answer says so:
//! [`Answer::dropped_tools`]); in a plain completion special tokens carry no text.

use crate::api::{Delta, GenRequest, Kind, Prompt, ToolChoice};
use crate::model::chat::Thinking;
use crate::model::tokenizer::{StreamDecoder, Tokenizer};
use crate::model::tool_calls::{Piece, ToolCall, ToolCallParser, ToolEvent};
use crate::sample::{SamplingSpec, TokenLogprob};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Where an answer finds the model's tokenizer (the server's request encoder).
pub trait Tokens: Send + Sync {
    fn tokenizer(&self) -> Option<&Tokenizer>;

    /// The thinking `req` runs with (its own, else the model's default).
    fn thinking(&self, req: &GenRequest) -> Thinking {
        req.thinking.unwrap_or(Thinking::Max)
    }
}

impl Tokens for Tokenizer {
    fn tokenizer(&self) -> Option<&Tokenizer> {
        Some(self)
    }
}

/// The text of one answer so far (see the module contract).
pub struct Answer {
    enc: Arc<dyn Tokens>,
    is_chat: bool,
    /// The model's end tokens (not shown).
    stops: Vec<u32>,
    t0: Instant,
    lp_sink: Option<Arc<Mutex<Vec<TokenLogprob>>>>,
    channels: Channels,
    stop_text: StopText,
    /// The stop strings in the thinking channel.
    stop_reasoning: StopText,
    decoder: StreamDecoder,
    /// Reads the model's tool calls (a chat answer; see `model::tool_calls`).
    calls: ToolCallParser,
    /// The request wants calls (it has tools and does not say `tool_choice: none`).
    wants_calls: bool,
    n: usize,
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
    pub reasoning: String,
    /// Seconds from `t0` to the first token.
    pub ttft: Option<f64>,
    pub logprobs: Vec<TokenLogprob>,
    /// The sink refused a delta (the client has gone).
    pub cancelled: bool,
    /// A tools section that was not whole calls was dropped (see the module contract).
    pub dropped_tools: bool,
}

impl Answer {
    /// An empty answer to `req`; `lp_sink` is where the sampler records log-probabilities.
    pub fn new(
        req: &GenRequest,
        enc: Arc<dyn Tokens>,
        stops: Vec<u32>,
        t0: Instant,
        lp_sink: Option<Arc<Mutex<Vec<TokenLogprob>>>>,
    ) -> Self {
        let is_chat = req.kind == Kind::Chat;
        let wants_calls = req.tools.is_some() && req.tool_choice != ToolChoice::None;
        let tok = enc.tokenizer();
        let sp = |n: &str| tok.and_then(|t| t.special_id(n));
        let channels = Channels {
            open: sp("<|open|>"),
            close: sp("<|close|>"),
            sep: sp("<|sep|>"),
            state: if is_chat && enc.thinking(req) != Thinking::Off { Chan::Reasoning } else { Chan::Content },
        };
        Answer {
            is_chat,
            stops,
            t0,
            lp_sink,
            channels,
            stop_text: StopText { stops: req.stop.clone(), held: String::new(), hit: false },
            stop_reasoning: StopText { stops: req.stop.clone(), held: String::new(), hit: false },
            decoder: StreamDecoder::default(),
            calls: if wants_calls { ToolCallParser::new(0) } else { ToolCallParser::new(0).calls_as_text() },
            wants_calls,
            n: 0,
            content: String::new(),
            tool_calls: Vec::new(),
            reasoning: String::new(),
            ttft: None,
            logprobs: Vec::new(),
            cancelled: false,
            dropped_tools: false,
            enc,
        }
    }

    /// Tool call ids derive from `seed` (the request's: a repeat gets the same ids).
    pub fn with_call_seed(mut self, seed: u64) -> Self {
        self.calls = ToolCallParser::new(seed);
        if !self.wants_calls {
            self.calls = self.calls.calls_as_text();
        }
        self
    }

    /// A chat answer outside the server (`run --chat`, `deltafin chat`): the template's channels
    /// as `thinking` opened them, the model's end tokens `stops`, no stop strings.
    pub fn chat(tok: Arc<Tokenizer>, stops: Vec<u32>, thinking: Thinking) -> Self {
        let mut req =
            GenRequest::new(Kind::Chat, Prompt::Messages(serde_json::Value::Null), SamplingSpec::GREEDY, None);
        req.thinking = Some(thinking);
        Answer::new(&req, tok, stops, Instant::now(), None)
    }

    /// A whole chat answer's (content, reasoning) from its tokens, as [`Answer::chat`] streams it.
    pub fn chat_text(tok: Arc<Tokenizer>, ids: &[u32], stops: &[u32], thinking: Thinking) -> (String, String) {
        let mut a = Answer::chat(tok, stops.to_vec(), thinking);
        for &id in ids {
            a.token(id, &mut |_| true);
        }
        a.finish(&mut |_| true);
        (a.content, a.reasoning)
    }

    /// Takes the next emitted token, handing its delta to `sink`; false ends the generation at it
    /// (the sink refused it, or a stop string appeared).
    pub fn token(&mut self, id: u32, sink: &mut dyn FnMut(&Delta) -> bool) -> bool {
        self.n += 1;
        let n = self.n;
        self.ttft.get_or_insert_with(|| self.t0.elapsed().as_secs_f64());
        let lp = self.lp_sink.as_ref().and_then(|s| s.lock().ok().and_then(|v| v.get(n - 1).cloned()));
        if let Some(l) = &lp {
            self.logprobs.push(l.clone());
        }
        let mut d = Delta { logprobs: lp, ..Default::default() };
        if !self.stops.contains(&id) {
            let tok = self.enc.tokenizer();
            let special = tok.is_some_and(|t| t.is_special(id));
            let piece = match tok {
                Some(_) if special => String::new(),
                Some(t) => self.decoder.push(t.token_bytes(id).unwrap_or_default()),
                None => format!("{}{id}", if n > 1 { "," } else { "" }),
            };
            let mut events = Vec::new();
            if self.is_chat {
                let name = tok.filter(|_| special).and_then(|t| t.token_bytes(id).ok());
                let name = name.map(String::from_utf8_lossy);
                events = self.calls.push(match &name {
                    Some(n) => Piece::Special(n),
                    None => Piece::Text(&piece),
                });
            }
            let (c, r) = if self.is_chat { self.channels.route(id, piece, special) } else { (piece, String::new()) };
            for e in events {
                match e {
                    ToolEvent::Call { index, call } => {
                        self.tool_calls.push(call.clone());
                        d.tool_calls.push((index, call));
                    }
                    // Template syntax, never content.
                    ToolEvent::Text(_) => self.dropped_tools = true,
                }
            }
            if !r.is_empty() {
                d.content = self.stop_text.release();
                d.reasoning = self.stop_reasoning.push(&r);
            } else if !c.is_empty() {
                d.reasoning = self.stop_reasoning.release();
                d.content = self.stop_text.push(&c);
            }
        }
        self.content.push_str(&d.content);
        self.reasoning.push_str(&d.reasoning);
        if !sink(&d) {
            self.cancelled = true;
            return false;
        }
        // A stop string ends the answer at this token.
        !self.stop_text.hit && !self.stop_reasoning.hit
    }

    /// The generation has ended: an unfinished UTF-8 character at the end is dropped (it would
    /// show as U+FFFD); text held back for a stop string that never came is shown.
    pub fn finish(&mut self, sink: &mut dyn FnMut(&Delta) -> bool) {
        self.decoder.finish();
        // A tools section cut off by the end is dropped: its text is template syntax.
        if self.calls.finish().iter().any(|e| matches!(e, ToolEvent::Text(_))) {
            self.dropped_tools = true;
        }
        let (content, reasoning) = (self.stop_text.release(), self.stop_reasoning.release());
        if !content.is_empty() || !reasoning.is_empty() {
            self.content.push_str(&content);
            self.reasoning.push_str(&reasoning);
            sink(&Delta { content, reasoning, ..Default::default() });
        }
    }
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

    /// The text held back, to show now (none once a stop string appeared).
    fn release(&mut self) -> String {
        std::mem::take(&mut self.held)
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

    struct NoTokenizer;
    impl Tokens for NoTokenizer {
        fn tokenizer(&self) -> Option<&Tokenizer> {
            None
        }
    }

    /// The text of a chat answer (thinking on) to tokens 1, 2, ... with `stop`, and where it ended.
    fn thinking_answer(stop: &[&str]) -> (String, String, u32) {
        let req = GenRequest {
            kind: Kind::Chat,
            prompt: Prompt::Ids(vec![1]),
            max_tokens: None,
            default_max_tokens: None,
            stop: stop.iter().map(|s| s.to_string()).collect(),
            sampling: SamplingSpec::GREEDY,
            n: 1,
            logprobs: None,
            echo: false,
            stream: false,
            include_usage: false,
            thinking: None,
            tools: None,
            tool_choice: ToolChoice::Auto,
            parallel_tool_calls: true,
            response_format: Default::default(),
        };
        let mut a = Answer::new(&req, Arc::new(NoTokenizer), vec![], Instant::now(), None);
        let mut streamed = String::new();
        let mut sink = |d: &Delta| {
            streamed.push_str(&d.reasoning);
            true
        };
        let ended = (1..=12).find(|&id| !a.token(id, &mut sink)).unwrap_or(13);
        a.finish(&mut sink);
        assert_eq!(streamed, a.reasoning, "the deltas add up to the answer");
        (a.content, a.reasoning, ended)
    }

    #[test]
    fn a_stop_string_in_the_thinking_channel_ends_the_answer() {
        // Without a tokenizer a chat answer's tokens show as ids, all in the thinking channel.
        assert_eq!(thinking_answer(&[]), (String::new(), "1,2,3,4,5,6,7,8,9,10,11,12".into(), 13));
        assert_eq!(thinking_answer(&[",5,"]), (String::new(), "1,2,3,4".into(), 6));
        // A stop string never completed is shown at the end.
        assert_eq!(thinking_answer(&["12,"]).1, "1,2,3,4,5,6,7,8,9,10,11,12");
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
