//! Constrained decoding: a grammar over a chat answer (a JSON value of a schema, or tool calls of
//! the given tools) turned into a per-step token mask, with llguidance (the grammar engine
//! llama.cpp and vLLM use) over deltafin's tokenizer.
//!
//! Contract: [`Grammars::new`] builds the tokenizer's token trie once (specials as llguidance's
//! 0xFF-prefixed names, ids past the tokenizer empty: never allowed). [`Grammars::check`] compiles
//! a [`Spec`] and reports what cannot be compiled — an unsupported or invalid schema, a grammar
//! past the size limits — as a [`ConstrainError`] whose text says what (the server's 400);
//! [`Grammars::mask`] gives a compiled spec's [`crate::sample::TokenMask`] for one generation.
//! The grammar covers the whole answer after the chat template's generation prompt: the
//! thinking channel's free text (no special token) when thinking is on, then the response — the
//! JSON value, or an empty response followed by the template's tools section whose calls name
//! only the allowed tools, with their arguments as a JSON block of each tool's parameters
//! schema — then the end of the message and a stop token. The model still picks every token
//! among those allowed (see `sample`'s contract): where the grammar allows K3's own choice, it
//! is kept bit for bit. A mask that fails mid-answer (the grammar engine's error) ends the answer
//! at a stop token and says why ([`crate::sample::TokenMask::error`]); the front end reports it.

mod budget;
mod grammar;

pub use grammar::{Payload, Spec, lark, parameters_schema};

use crate::model::tokenizer::Tokenizer;
use crate::sample::TokenMask;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use std::sync::Arc;

/// Largest schema or tool list (its JSON text) a constraint takes: llguidance compiles it per
/// request, and its own limits bound the work per token.
pub const MAX_SCHEMA_BYTES: usize = 256 * 1024;
/// Grammar symbols a compiled constraint may have (llguidance's default is 500,000: a few MB of
/// JSON schema; the budget walk of `budget.rs` stops the expansions that would reach it slowly).
const MAX_GRAMMAR_SIZE: usize = 100_000;
/// Constraints compiled at once; a request past them waits at most [`COMPILE_WAIT`].
const COMPILING_AT_ONCE: usize = 2;
const COMPILE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum ConstrainError {
    #[error("the tokenizer has no special token {0} (the K3 chat template's tags)")]
    NoSpecial(&'static str),
    #[error("the grammar engine could not start over this tokenizer: {0}")]
    Setup(String),
    #[error("{what} is {bytes} bytes of JSON; at most {MAX_SCHEMA_BYTES} are supported")]
    TooLarge { what: &'static str, bytes: usize },
    #[error("cannot enforce {what}: {msg}")]
    Compile { what: &'static str, msg: String },
    #[error("{COMPILING_AT_ONCE} output constraints are being compiled already; try again in a moment")]
    Busy,
}

/// The special tokens a grammar names: the template's tags and the model's stop tokens.
#[derive(Clone, Debug)]
pub struct Tags {
    pub open: u32,
    pub close: u32,
    pub sep: u32,
    pub stops: Vec<u32>,
}

/// The grammar engine over one tokenizer (built once, shared by every request).
pub struct Grammars {
    factory: ParserFactory,
    tags: Tags,
    vocab: usize,
    /// Compilations running now (at most [`COMPILING_AT_ONCE`]).
    compiling: std::sync::Mutex<usize>,
    freed: std::sync::Condvar,
}

/// A compilation slot, given back when dropped.
struct Slot<'a>(&'a Grammars);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        *self.0.compiling.lock().unwrap_or_else(|p| p.into_inner()) -= 1;
        self.0.freed.notify_one();
    }
}

impl Grammars {
    /// The engine over `tok`'s tokens, for logits of `vocab` entries, ending answers with `stops`.
    pub fn new(tok: &Tokenizer, vocab: usize, stops: &[u32]) -> Result<Self, ConstrainError> {
        let sp = |n: &'static str| tok.special_id(n).ok_or(ConstrainError::NoSpecial(n));
        let tags = Tags { open: sp("<|open|>")?, close: sp("<|close|>")?, sep: sp("<|sep|>")?, stops: stops.to_vec() };
        let first_stop = *stops.first().ok_or(ConstrainError::NoSpecial("<|end_of_msg|>"))?;
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| match tok.token_bytes(id) {
                Ok(b) if tok.is_special(id) => [&[TokTrie::SPECIAL_TOKEN_MARKER][..], b].concat(),
                Ok(b) => b.to_vec(),
                Err(_) => Vec::new(),
            })
            .collect();
        let trie = TokTrie::from(&TokRxInfo::new(vocab as u32, first_stop), &words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| ConstrainError::Setup(e.to_string()))?;
        factory.quiet();
        let limits = factory.limits_mut();
        limits.max_grammar_size = MAX_GRAMMAR_SIZE;
        // Errors reach clients: the engine's state and grammar dump stay out of them.
        limits.verbose_errors = false;
        Ok(Grammars { factory, tags, vocab, compiling: Default::default(), freed: Default::default() })
    }

    /// A compilation slot, waiting at most [`COMPILE_WAIT`] for one.
    fn slot(&self) -> Result<Slot<'_>, ConstrainError> {
        let mut n = self.compiling.lock().unwrap_or_else(|p| p.into_inner());
        let deadline = std::time::Instant::now() + COMPILE_WAIT;
        while *n >= COMPILING_AT_ONCE {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(ConstrainError::Busy);
            }
            n = self.freed.wait_timeout(n, left).unwrap_or_else(|p| p.into_inner()).0;
        }
        *n += 1;
        Ok(Slot(self))
    }

    fn matcher(&self, spec: &Spec) -> Result<Matcher, ConstrainError> {
        let what = spec.payload.what();
        let text = lark(spec, &self.tags)?;
        let _slot = self.slot()?;
        let parser = self
            .factory
            .create_parser(TopLevelGrammar::from_lark(text))
            .map_err(|e| ConstrainError::Compile { what, msg: first_line(&e.to_string()) })?;
        let mut m = Matcher::new(Ok(parser));
        // The first mask: a grammar no answer can start (an unsatisfiable schema) fails here.
        if m.get_error().is_none() {
            let _ = m.compute_mask();
        }
        match m.get_error() {
            Some(msg) => Err(ConstrainError::Compile { what, msg: first_line(&msg) }),
            None => Ok(m),
        }
    }

    /// Compiles `spec`, reporting why it cannot be enforced.
    pub fn check(&self, spec: &Spec) -> Result<(), ConstrainError> {
        self.matcher(spec).map(|_| ())
    }

    /// A fresh mask enforcing `spec` over one answer.
    pub fn mask(&self, spec: &Spec) -> Result<Box<dyn TokenMask>, ConstrainError> {
        let stop = self.tags.stops[0];
        Ok(Box::new(GrammarMask { m: self.matcher(spec)?, vocab: self.vocab, stop, error: None }))
    }
}

/// The first line of a grammar engine message (the rest is its internal state), without the
/// place in the internal grammar it starts with (`at 3(7): `); a first line that only announces
/// what follows (`regex parse error:`) gets the message's last line, which says what is wrong.
fn first_line(s: &str) -> String {
    let mut lines = s.lines().map(str::trim).filter(|l| !l.is_empty());
    let first = lines.next().unwrap_or_default();
    let first = match first.strip_prefix("at ").and_then(|r| r.split_once("): ")) {
        Some((_, rest)) => rest,
        None => first,
    };
    match lines.next_back() {
        Some(last) if first.ends_with(':') => format!("{first} {last}"),
        _ => first.to_string(),
    }
}

/// One answer's grammar state.
struct GrammarMask {
    m: Matcher,
    vocab: usize,
    stop: u32,
    error: Option<String>,
}

impl GrammarMask {
    fn failed(&mut self, e: impl std::fmt::Display) {
        if self.error.is_none() {
            self.error = Some(format!("the output constraint failed: {e}"));
        }
    }
}

impl TokenMask for GrammarMask {
    fn allows(&mut self, token: u32) -> bool {
        // Past the grammar's end (its stop token taken) only a speculative pick after the answer
        // can come: it is never emitted.
        if self.m.is_stopped() && self.error.is_none() {
            return true;
        }
        self.error.is_none() && (token as usize) < self.vocab && self.m.validate_tokens(&[token]).is_ok_and(|n| n == 1)
    }

    fn allowed(&mut self, vocab: usize) -> Option<Vec<bool>> {
        if self.error.is_some() {
            return None;
        }
        match self.m.compute_mask() {
            Ok(v) => Some((0..vocab).map(|t| t < self.vocab && v.is_allowed(t as u32)).collect()),
            Err(e) => {
                self.failed(e);
                None
            }
        }
    }

    fn accept(&mut self, token: u32) {
        if self.error.is_none()
            && !self.m.is_stopped()
            && let Err(e) = self.m.consume_token(token)
        {
            self.failed(e);
        }
    }

    fn stop_token(&self) -> u32 {
        self.stop
    }

    fn error(&self) -> Option<String> {
        self.error.clone()
    }
}

#[cfg(test)]
mod tests;
