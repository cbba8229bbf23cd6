//! A conversation held in one process (`deltafin chat`): its messages, its settings, its turns
//! through the shared generator, its commands and its transcript.
//!
//! Contract: [`Conversation::say`] adds the user's message, renders the whole conversation with
//! the model's chat template and runs it through the [`Generator`], which resumes the session it
//! kept after the previous turn (so a turn prefills only its own new tokens, and its answer is the
//! one a fresh session would give), streaming the answer's deltas to the sink (false stops the
//! answer at that token). The answer joins the history — cut short or not, as long as it has
//! text; a turn that fails (a forward error, a message too long for the context even alone) or
//! is stopped before any text leaves the history as it was. With a seed, turn n (from 0) samples
//! with seed + n, so a scripted conversation replays exactly.
//!
//! The context's end ([`Conversation::plan`]): a turn keeps room for an answer of `max_tokens`
//! (at most a quarter of the context, at least one token); when the conversation leaves less, its
//! oldest turns (a user message and its answer) stop being sent, one turn at a time, the system
//! message always kept — llama.cpp's context shift and Ollama's truncation, at turn boundaries
//! (the model then reads the rest anew: one prefill, bit-identical to a fresh session's). The
//! turns dropped stay in the transcript. An answer the context cut is told from one `max_tokens`
//! cut ([`turn_note`]). [`Command::parse`] reads one input line;
//! [`Conversation::save`] writes the transcript (OpenAI's message shape, so it can be sent to
//! `serve` as is), atomically, and never over a file that is not a transcript.

use super::generator::{GenConfig, GenError, Generator};
use crate::api::{ApiError, Delta, GenRequest, Kind, Output, Prompt};
use crate::engine::Engine;
use crate::model::chat::Thinking;
use crate::sample::SamplingSpec;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The `object` of a transcript file (what [`Conversation::save`] may overwrite).
pub const TRANSCRIPT: &str = "deltafin.chat.transcript";

/// Largest existing file `save` reads to see whether it is a transcript.
const MAX_TRANSCRIPT_BYTES: u64 = 256 << 20;

/// What every turn is generated with.
#[derive(Clone, Debug)]
pub struct ChatSettings {
    /// Temperature, top-p, top-k, min-p, and the seed: turn n samples with seed + n (None: a
    /// fresh seed each turn).
    pub sampling: SamplingSpec,
    /// Tokens an answer may take (None: up to the context bound).
    pub max_tokens: Option<usize>,
    /// None: the model's default.
    pub thinking: Option<Thinking>,
}

pub struct Conversation {
    gen_: Generator,
    pub settings: ChatSettings,
    system: Option<String>,
    /// The user's and the model's messages, in order.
    messages: Vec<Value>,
    /// Where the messages the model still sees start (those before were dropped to fit the
    /// context; the transcript keeps them).
    seen_from: usize,
    /// Turns asked for (each takes the next seed).
    asked: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{} exists and is not a chat transcript: not overwritten (save to another name)", path.display())]
    NotTranscript { path: PathBuf },
}

impl Conversation {
    pub fn new(
        engine: Arc<Engine>,
        cfg: GenConfig,
        settings: ChatSettings,
    ) -> Result<Self, crate::engine::EngineError> {
        let gen_ = Generator::new(engine, cfg)?;
        Ok(Conversation { gen_, settings, system: None, messages: Vec::new(), seen_from: 0, asked: 0 })
    }

    /// Whether the model can chat at all (a tokenizer, a chat template that renders): the error a
    /// first message would get, found before any.
    pub fn check(&self) -> Result<(), ApiError> {
        let probe = Prompt::Messages(json!([{"role": "user", "content": "Hi"}]));
        self.gen_.encoder().encode(&self.request(probe)).map(|_| ())
    }

    /// The thinking the next turn runs with.
    pub fn thinking(&self) -> Thinking {
        use super::answer::Tokens;
        let req = self.request(Prompt::Messages(Value::Null));
        self.gen_.encoder().thinking(&req)
    }

    /// A turn's request for `prompt` with the settings (its seed not drawn yet).
    fn request(&self, prompt: Prompt) -> GenRequest {
        let s = &self.settings;
        let mut req = GenRequest::new(Kind::Chat, prompt, s.sampling.clone(), s.max_tokens);
        req.thinking = s.thinking;
        req
    }

    /// The system message, if any.
    pub fn system(&self) -> Option<&str> {
        self.system.as_deref()
    }

    /// Sets (or, with None, removes) the system message; the history stays.
    pub fn set_system(&mut self, text: Option<String>) {
        self.system = text.filter(|t| !t.trim().is_empty());
    }

    /// Forgets the messages (the system message stays).
    pub fn reset(&mut self) {
        self.messages.clear();
        self.seen_from = 0;
    }

    /// The context each conversation may fill, in tokens.
    pub fn context(&self) -> usize {
        self.gen_.engine().context_bound()
    }

    /// Turns taken (answers in the history).
    pub fn turns(&self) -> usize {
        self.messages.iter().filter(|m| m["role"] == "assistant").count()
    }

    /// The conversation as the template gets it: the system message, then the turns.
    pub fn messages(&self) -> Vec<Value> {
        let system = self.system.as_ref().map(|s| json!({"role": "system", "content": s}));
        system.into_iter().chain(self.messages.iter().cloned()).collect()
    }

    /// One turn (see the module contract): [`Conversation::plan`], then [`Conversation::run`].
    pub fn say(&mut self, text: &str, sink: &mut dyn FnMut(&Delta) -> bool) -> Result<Output, GenError> {
        let plan = self.plan(text)?;
        self.run(plan, sink)
    }

    /// The request of a turn saying `text`, the messages before `from` left out.
    fn turn_request(&self, text: &str, from: usize) -> GenRequest {
        let system = self.system.as_ref().map(|s| json!({"role": "system", "content": s}));
        let mut messages: Vec<Value> = system.into_iter().chain(self.messages[from..].iter().cloned()).collect();
        messages.push(json!({"role": "user", "content": text}));
        self.request(Prompt::Messages(Value::Array(messages)))
    }

    /// A turn saying `text`, fitted to the context (see the module contract): the oldest turns
    /// left out until the prompt leaves room for the answer, or none is left to drop.
    pub fn plan(&self, text: &str) -> Result<Plan, GenError> {
        let bound = self.context();
        let room = self.settings.max_tokens.unwrap_or(usize::MAX).min(bound / 4).max(1);
        let enc = self.gen_.encoder();
        let mut from = self.seen_from;
        loop {
            let req = self.turn_request(text, from);
            let fits = enc.prepare(&req);
            // The next turn boundary: the next user message, else past the last turn.
            let len = self.messages.len();
            let next = (from + 1..len).find(|&i| self.messages[i]["role"] == "user").or((from < len).then_some(len));
            match (fits, next) {
                (Ok(p), Some(n)) if p.prompt.len().saturating_add(room) > bound => from = n,
                (Err(e), Some(n)) if e.code == Some("context_length_exceeded") => from = n,
                (Ok(prepared), _) => {
                    let dropped = self.messages[self.seen_from..from].iter().filter(|m| m["role"] == "user").count();
                    let limited = prepared.max_new < self.settings.max_tokens.unwrap_or(usize::MAX);
                    return Ok(Plan { text: text.to_string(), req, prepared, from, dropped, limited });
                }
                (Err(e), _) => return Err(GenError::Request(e)),
            }
        }
    }

    /// Runs a planned turn: its answer streamed to `sink`, then joined to the history (and the
    /// turns the plan dropped no longer sent), as the module contract says.
    pub fn run(&mut self, plan: Plan, sink: &mut dyn FnMut(&Delta) -> bool) -> Result<Output, GenError> {
        let Plan { text, mut req, prepared, from, limited, .. } = plan;
        req.sampling.seed = self.settings.sampling.seed.map(|s| s.wrapping_add(self.asked));
        self.asked += 1;
        let mut out = self.gen_.generate_prepared(&req, prepared, 0.0, sink)?;
        if limited && out.finish_reason == "length" {
            out.ext["cut_by_context"] = json!(self.context());
        }
        if !(out.content.is_empty() && out.reasoning.is_empty()) {
            self.seen_from = from;
            self.messages.push(json!({"role": "user", "content": text}));
            let mut answer = json!({"role": "assistant", "content": out.content});
            if !out.reasoning.is_empty() {
                answer["reasoning_content"] = json!(out.reasoning);
            }
            self.messages.push(answer);
        }
        Ok(out)
    }

    /// The transcript: the messages in OpenAI's shape with the settings they were generated with
    /// (the sampling as its spec has it, then `max_tokens`, the seed and the thinking).
    pub fn transcript(&self, model: &str) -> Value {
        let s = &self.settings;
        let mut settings = serde_json::to_value(&s.sampling).unwrap_or_default();
        if let Some(m) = settings.as_object_mut() {
            let seed = m.shift_remove("seed").unwrap_or_default();
            m.insert("max_tokens".into(), json!(s.max_tokens));
            m.insert("seed".into(), seed);
            m.insert("thinking".into(), json!(thinking_name(self.thinking())));
        }
        json!({"object": TRANSCRIPT, "model": model, "settings": settings, "messages": self.messages()})
    }

    /// Writes the transcript to `path` (see the module contract).
    pub fn save(&self, path: &Path, model: &str) -> Result<(), SaveError> {
        let io = |source| SaveError::Io { path: path.to_path_buf(), source };
        if let Ok(meta) = std::fs::metadata(path) {
            let ours = meta.is_file()
                && meta.len() <= MAX_TRANSCRIPT_BYTES
                && std::fs::read(path)
                    .ok()
                    .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
                    .is_some_and(|v| v["object"] == TRANSCRIPT);
            if !ours {
                return Err(SaveError::NotTranscript { path: path.to_path_buf() });
            }
        }
        let mut body = serde_json::to_vec_pretty(&self.transcript(model)).map_err(|e| io(e.into()))?;
        body.push(b'\n');
        crate::util::write_atomic(path, &body).map_err(io)
    }
}

impl Conversation {
    /// Carries out a command (a message does nothing here): `None` to leave, else what to tell
    /// the user (maybe nothing).
    pub fn command(&mut self, c: Command, model: &str) -> Option<String> {
        let s = &mut self.settings;
        Some(match c {
            Command::Exit => return None,
            Command::Help => HELP.to_string(),
            Command::Reset => {
                self.reset();
                "(a new conversation)".into()
            }
            Command::System(t) => {
                self.set_system(t);
                String::new()
            }
            Command::Temperature(t) => {
                s.sampling.temperature = t;
                String::new()
            }
            Command::Thinking(t) => {
                s.thinking = t;
                format!("(thinking {})", thinking_name(self.thinking()))
            }
            Command::MaxTokens(n) => {
                s.max_tokens = n;
                String::new()
            }
            Command::Save(p) => match self.save(&p, model) {
                Ok(()) => format!("(saved {} messages to {})", self.messages().len(), p.display()),
                Err(e) => format!("deltafin: {e}"),
            },
            Command::Say(_) => String::new(),
        })
    }
}

/// A turn fitted to the context ([`Conversation::plan`]), to run with [`Conversation::run`].
pub struct Plan {
    text: String,
    req: GenRequest,
    prepared: super::generator::Prepared,
    /// The first message still sent.
    from: usize,
    /// Turns this one stops sending (the oldest), to fit.
    pub dropped: usize,
    /// The context, not `max_tokens`, bounds the answer.
    limited: bool,
}

/// What to say after an answer: why it ended early (`stopped`: the user stopped it), if it did —
/// the user, `max_tokens` (/max), or the context.
pub fn turn_note(out: &Output, stopped: bool) -> Option<String> {
    let n = out.tokens.len();
    if stopped || out.finish_reason == "cancelled" {
        Some("(stopped)".into())
    } else if let Some(ctx) = out.ext.get("cut_by_context").and_then(Value::as_u64) {
        Some(format!(
            "(cut at {n} tokens: the context of {ctx} tokens is full; the next message drops the oldest turns)"
        ))
    } else if out.finish_reason == "length" {
        Some(format!("(cut at {n} tokens: /max N allows more)"))
    } else {
        None
    }
}

/// What to say before an answer whose turn dropped `dropped` turns to fit the context.
pub fn shift_note(dropped: usize, context: usize) -> String {
    let turns = if dropped == 1 { "turn".to_string() } else { format!("{dropped} turns") };
    format!(
        "(the context of {context} tokens is full: the oldest {turns} left the model's view; the system message stays)"
    )
}

/// An answer's numbers: its tokens, the prompt's and how many of them were resumed, TTFT, rate.
pub fn turn_stats(out: &Output) -> String {
    let f = |k: &str| out.ext.get(k).and_then(Value::as_f64).unwrap_or(0.0);
    format!(
        "{} tokens, prompt {} ({} reused), ttft {:.3} s, {:.1} tok/s",
        out.tokens.len(),
        out.prompt_tokens,
        f("prompt_tokens_reused"),
        f("ttft_s"),
        f("decode_tok_s")
    )
}

/// A thinking setting as the commands and the transcript name it.
pub fn thinking_name(t: Thinking) -> &'static str {
    match t {
        Thinking::Off => "off",
        Thinking::Low => "low",
        Thinking::High => "high",
        Thinking::Max => "max",
    }
}

/// One line of input.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    /// A message to the model.
    Say(String),
    Reset,
    Save(PathBuf),
    /// Set (Some) or remove (None) the system message; the history stays.
    System(Option<String>),
    Temperature(f64),
    /// None: the model's default.
    Thinking(Option<Thinking>),
    /// None: up to the context bound.
    MaxTokens(Option<usize>),
    Help,
    Exit,
}

/// The commands, for `/help`.
pub const HELP: &str = "\
/reset            forget the conversation (the system message stays)
/system [TEXT]    set the system message (none: remove it); the conversation stays
/save FILE        write the conversation as JSON (OpenAI's messages)
/temp T           sampling temperature (0: greedy)
/think [LEVEL]    thinking: off, low, high, max (none: the model's default)
/max N            tokens an answer may take (0: up to the context)
/help             this list
/exit             leave (also Ctrl-D)
A line ending in \\ continues on the next line. Ctrl-C stops an answer.";

impl Command {
    /// A line: `/command args`, else a message (a line starting `//` is a message starting `/`).
    pub fn parse(line: &str) -> Result<Command, String> {
        let line = line.trim();
        let Some(rest) = line.strip_prefix('/').filter(|r| !r.starts_with('/')) else {
            return Ok(Command::Say(line.strip_prefix('/').unwrap_or(line).to_string()));
        };
        let (name, arg) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
        let arg = arg.trim();
        let need = |what: &str| if arg.is_empty() { Err(format!("/{name} needs {what}")) } else { Ok(arg) };
        Ok(match name {
            "reset" | "clear" => Command::Reset,
            "save" => Command::Save(PathBuf::from(need("a file name")?)),
            "system" => Command::System((!arg.is_empty()).then(|| arg.to_string())),
            "temp" | "temperature" => match need("a temperature")?.parse::<f64>() {
                Ok(t) if (0.0..=2.0).contains(&t) => Command::Temperature(t),
                _ => return Err(format!("/{name} {arg}: a temperature is a number from 0 to 2")),
            },
            "think" | "thinking" => Command::Thinking(match arg {
                "" => None,
                "off" | "none" => Some(Thinking::Off),
                "low" => Some(Thinking::Low),
                "high" => Some(Thinking::High),
                "max" => Some(Thinking::Max),
                _ => return Err(format!("/{name} {arg}: off, low, high or max")),
            }),
            "max" | "max_tokens" => match need("a number of tokens")?.parse::<usize>() {
                Ok(n) => Command::MaxTokens((n > 0).then_some(n)),
                Err(_) => return Err(format!("/{name} {arg}: a number of tokens (0: up to the context)")),
            },
            "help" | "?" => Command::Help,
            "exit" | "quit" | "bye" => Command::Exit,
            _ => {
                return Err(format!("unknown command /{name} (/help lists them; start a message with // to send a /)"));
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_parse() {
        assert_eq!(Command::parse("  hello "), Ok(Command::Say("hello".into())));
        assert_eq!(Command::parse("//etc/passwd"), Ok(Command::Say("/etc/passwd".into())));
        assert_eq!(Command::parse("/reset"), Ok(Command::Reset));
        assert_eq!(Command::parse("/save a b.json"), Ok(Command::Save("a b.json".into())));
        assert_eq!(Command::parse("/system Be brief."), Ok(Command::System(Some("Be brief.".into()))));
        assert_eq!(Command::parse("/system"), Ok(Command::System(None)));
        assert_eq!(Command::parse("/temp 0.7"), Ok(Command::Temperature(0.7)));
        assert_eq!(Command::parse("/think off"), Ok(Command::Thinking(Some(Thinking::Off))));
        assert_eq!(Command::parse("/think"), Ok(Command::Thinking(None)));
        assert_eq!(Command::parse("/max 0"), Ok(Command::MaxTokens(None)));
        assert_eq!(Command::parse("/bye"), Ok(Command::Exit));
        for bad in ["/save", "/temp 3", "/temp x", "/think medium", "/max -1", "/frobnicate"] {
            assert!(Command::parse(bad).is_err(), "{bad}");
        }
    }
}
