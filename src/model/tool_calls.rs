//! The model's tool calls, read back from what it generates: the inverse of the K3 chat
//! template's rendering of an assistant message's `tool_calls`.
//!
//! The template writes calls after the response channel as
//! `<|open|>tools<|sep|>` then, per call, `<|open|>call tool="NAME" index="N"<|sep|>` with the
//! arguments either as one `<|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|>`
//! per key (a string's VALUE raw, any other type's as JSON) or as one
//! `<|open|>json type="object"<|sep|>{...}<|close|>json<|sep|>` block, then
//! `<|close|>call<|sep|>`, and `<|close|>tools<|sep|>` after the last call (attribute values
//! escape `&` and `"` as `&amp;` and `&quot;`).
//!
//! Contract: [`ToolCallParser`] is fed an answer's tokens in order as [`Piece`]s (a special token
//! by name, or a normal token's text) and watches only its `tools` sections. A call is reported
//! ([`ToolEvent::Call`]) once its closing tag arrives and it is whole: a name, and arguments that
//! form a JSON object (each typed argument's value parsing as its type). Anything malformed — an
//! unknown tag, a bad attribute, a value that is not its type, invalid JSON, a call cut off by the
//! end of the answer — is never an error: that call's raw text (specials by name) and everything
//! after it up to the end of its tools section come back as [`ToolEvent::Text`], to be shown as
//! content. Calls before it are kept. A parser made with [`ToolCallParser::calls_as_text`] gives
//! every tools section back as text. Nothing here panics on any input.

use serde_json::{Map, Value};

/// One token of an answer, as the parser sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Piece<'a> {
    /// A special token, by name (`<|open|>`, `<|sep|>`, ...).
    Special(&'a str),
    /// A normal token's text.
    Text(&'a str),
}

/// One whole call, in OpenAI's terms: `arguments` is a JSON object's text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// What a piece produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolEvent {
    /// Call number `index` (0-based, in order) is whole.
    Call { index: usize, call: ToolCall },
    /// Text of a malformed tools section, to show as content.
    Text(String),
}

const OPEN: &str = "<|open|>";
const CLOSE: &str = "<|close|>";
const SEP: &str = "<|sep|>";

#[derive(Clone, Debug)]
enum State {
    /// Not in a tools section.
    Outside,
    /// Between calls of a tools section.
    Tools,
    /// Inside a call.
    Call { name: String, args: Map<String, Value>, json: Option<String> },
    /// Inside a typed argument.
    Arg { name: String, args: Map<String, Value>, key: String, ty: String, text: String },
    /// Inside a JSON block.
    Json { name: String, args: Map<String, Value>, text: String },
    /// A malformed tools section: its text is content until it closes.
    Broken,
}

/// Reads tool calls from an answer's tokens; see the module contract.
#[derive(Clone, Debug)]
pub struct ToolCallParser {
    state: State,
    /// A tag being read: (opening, its text so far), from `<|open|>` / `<|close|>` to `<|sep|>`.
    tag: Option<(bool, String)>,
    /// The raw text of the current call (or of the broken section).
    raw: String,
    calls: Vec<ToolCall>,
    id_seed: u64,
    /// Calls are not wanted: a tools section is text.
    as_text: bool,
}

/// Limit on one call's raw text kept for degrading it to content (a runaway argument ends as
/// content, not as an ever-growing buffer).
const MAX_RAW: usize = 1 << 24;

impl ToolCallParser {
    /// A parser whose call ids derive from `id_seed` (the request's seed: a repeated request gets
    /// the same ids).
    pub fn new(id_seed: u64) -> Self {
        ToolCallParser {
            state: State::Outside,
            tag: None,
            raw: String::new(),
            calls: Vec::new(),
            id_seed,
            as_text: false,
        }
    }

    /// A parser that reads no calls: every tools section comes back whole as
    /// [`ToolEvent::Text`] (for an answer to a request without tools, or with `tool_choice` none).
    pub fn calls_as_text(mut self) -> Self {
        self.as_text = true;
        self
    }

    /// The whole calls so far.
    pub fn calls(&self) -> &[ToolCall] {
        &self.calls
    }

    /// Inside a tools section (its pieces are the parser's, not the answer's text).
    pub fn in_tools(&self) -> bool {
        !matches!(self.state, State::Outside)
    }

    /// Takes the next piece of the answer.
    pub fn push(&mut self, p: Piece) -> Vec<ToolEvent> {
        let mut ev = Vec::new();
        let inside = self.in_tools();
        if inside && self.raw.len() < MAX_RAW {
            self.raw.push_str(match p {
                Piece::Special(s) | Piece::Text(s) => s,
            });
        }
        match p {
            Piece::Special(OPEN) | Piece::Special(CLOSE) => {
                if self.tag.is_some() && inside {
                    self.broken();
                }
                self.tag = Some((p == Piece::Special(OPEN), String::new()));
            }
            Piece::Special(SEP) => {
                if let Some((opening, text)) = self.tag.take() {
                    self.on_tag(opening, &text, &mut ev);
                }
            }
            Piece::Special(_) => {
                self.tag = None;
                if inside && !matches!(self.state, State::Tools | State::Broken) {
                    // An end of message inside a call: the call is cut off.
                    self.broken();
                }
            }
            Piece::Text(t) => {
                if let Some((_, text)) = &mut self.tag {
                    if text.len() < 4096 {
                        text.push_str(t);
                    }
                } else {
                    self.on_text(t);
                }
            }
        }
        if !inside && self.in_tools() {
            // The section's opening tag starts its raw text.
            self.raw = format!("{OPEN}tools{SEP}");
        }
        ev
    }

    /// The answer has ended: a section still open is malformed unless it is between calls.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        match self.state {
            State::Outside | State::Tools => Vec::new(),
            _ => {
                self.state = State::Outside;
                let text = std::mem::take(&mut self.raw);
                if text.is_empty() { Vec::new() } else { vec![ToolEvent::Text(text)] }
            }
        }
    }

    fn broken(&mut self) {
        self.state = State::Broken;
    }

    fn on_text(&mut self, t: &str) {
        match &mut self.state {
            State::Outside | State::Broken => {}
            State::Arg { text, .. } | State::Json { text, .. } => {
                if text.len() < MAX_RAW {
                    text.push_str(t);
                }
            }
            State::Tools | State::Call { .. } => {
                if !t.trim().is_empty() {
                    self.broken();
                }
            }
        }
    }

    fn on_tag(&mut self, opening: bool, text: &str, ev: &mut Vec<ToolEvent>) {
        let (tag, attrs) = match split_tag(text) {
            Some(x) => x,
            None if matches!(self.state, State::Outside) => return,
            None => return self.broken(),
        };
        let state = std::mem::replace(&mut self.state, State::Broken);
        self.state = match (state, opening, tag) {
            (State::Outside, true, "tools") if self.as_text => State::Broken,
            (State::Outside, true, "tools") => State::Tools,
            (s @ State::Outside, ..) => s,
            (State::Broken, false, "tools") => {
                ev.push(ToolEvent::Text(std::mem::take(&mut self.raw)));
                State::Outside
            }
            (State::Broken, ..) => State::Broken,
            (State::Tools, false, "tools") => {
                self.raw.clear();
                State::Outside
            }
            (State::Tools, true, "call") => match attr(&attrs, "tool") {
                Some(name) if !name.is_empty() => {
                    // The call's raw text starts at its own opening tag.
                    self.raw = format!("{OPEN}{text}{SEP}");
                    State::Call { name, args: Map::new(), json: None }
                }
                _ => State::Broken,
            },
            (State::Call { name, args, json: None }, true, "argument") => {
                match (attr(&attrs, "key"), attr(&attrs, "type")) {
                    (Some(key), Some(ty)) if !args.contains_key(&key) => {
                        State::Arg { name, args, key, ty, text: String::new() }
                    }
                    _ => State::Broken,
                }
            }
            (State::Call { name, args, json: None }, true, "json") if args.is_empty() => {
                State::Json { name, args, text: String::new() }
            }
            (State::Arg { name, mut args, key, ty, text }, false, "argument") => match typed(&ty, text) {
                Some(v) => {
                    args.insert(key, v);
                    State::Call { name, args, json: None }
                }
                None => State::Broken,
            },
            (State::Json { name, args, text }, false, "json") => match serde_json::from_str::<Value>(text.trim()) {
                Ok(Value::Object(_)) => State::Call { name, args, json: Some(text.trim().to_string()) },
                _ => State::Broken,
            },
            (State::Call { name, args, json }, false, "call") => {
                let arguments = json.unwrap_or_else(|| Value::Object(args).to_string());
                let index = self.calls.len();
                let call = ToolCall { id: call_id(self.id_seed, index), name, arguments };
                self.calls.push(call.clone());
                ev.push(ToolEvent::Call { index, call });
                self.raw.clear();
                State::Tools
            }
            _ => State::Broken,
        };
    }
}

/// An OpenAI-style call id, fixed by the seed and the call's index.
fn call_id(seed: u64, index: usize) -> String {
    let mut s = seed ^ (index as u64).wrapping_mul(0xA24B_AED4_963E_E407);
    let a = crate::sample::splitmix64(&mut s);
    let b = crate::sample::splitmix64(&mut s);
    format!("call_{a:016x}{:08x}", b >> 32)
}

/// A tag's name and its attributes, `name k="v" k2="v2"` (values unescaped).
fn split_tag(text: &str) -> Option<(&str, Vec<(String, String)>)> {
    let text = text.trim();
    let (name, mut rest) = text.split_once(' ').unwrap_or((text, ""));
    let mut attrs = Vec::new();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        let (k, r) = rest.split_once("=\"")?;
        let (v, r) = r.split_once('"')?;
        if k.is_empty() || k.contains(char::is_whitespace) {
            return None;
        }
        attrs.push((k.to_string(), v.replace("&quot;", "\"").replace("&amp;", "&")));
        rest = r;
    }
    (!name.is_empty()).then_some((name, attrs))
}

fn attr(attrs: &[(String, String)], k: &str) -> Option<String> {
    attrs.iter().find(|(a, _)| a == k).map(|(_, v)| v.clone())
}

/// A typed argument's value: a string as it stands, any other type parsed as JSON of that type.
fn typed(ty: &str, text: String) -> Option<Value> {
    if ty == "string" {
        return Some(Value::String(text));
    }
    let v: Value = serde_json::from_str(text.trim()).ok()?;
    let ok = match ty {
        "number" => v.is_number(),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        "object" => v.is_object(),
        "array" => v.is_array(),
        _ => false,
    };
    ok.then_some(v)
}

#[cfg(test)]
mod tests;
