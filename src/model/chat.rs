//! Chat template: renders a model directory's own `chat_template.jinja` like Hugging Face's
//! `apply_chat_template` (Jinja with trim_blocks/lstrip_blocks, loop controls, Python-style
//! string/dict methods, `raise_exception`, Python-compatible `tojson`), then tokenises the result.
//!
//! Contract: text that comes from the caller (message contents, names, tool definitions and
//! arguments) can never become special tokens. Before rendering, every caller string has a
//! private-use marker inserted after each character that can start a special-token name; the
//! marker keeps any special name from matching inside caller text (including across two adjacent
//! caller strings) and preserves string ordering, so the template behaves as it would on the raw
//! text. After rendering, special names are matched in the template's own text only, and the
//! markers are removed from the ordinary text before BPE. A render is bounded by
//! [`RENDER_FUEL`] steps: a runaway template is a [`ChatError::Render`], never a hang.

use super::tokenizer::Tokenizer;
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use std::path::{Path, PathBuf};

/// Private-use marker (not a special, never produced by the template's own text).
const MARK: char = '\u{F8F0}';

/// Steps (and, at about 64 bytes a unit, memory) one render may use: K3's template renders a
/// 9,000-message conversation inside it (tests/fuzz_regressions.rs), and a runaway template
/// (nested loops, a string doubled in a loop) is an error in about a second instead of a hang or
/// an allocation abort.
pub const RENDER_FUEL: u64 = 10_000_000;

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{}: the chat template does not compile: {msg}", path.display())]
    Compile { path: PathBuf, msg: String },
    #[error("rendering the chat template failed: {0}")]
    Render(String),
    /// The rendered prompt is longer than allowed (found before tokenising it).
    #[error("the rendered prompt is at least {at_least} tokens ({bytes} bytes)")]
    TooLong { at_least: usize, bytes: usize },
}

/// How much the model should think before answering (the template's `thinking_effort`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Thinking {
    /// No thinking channel: the answer starts right away.
    Off,
    Low,
    High,
    Max,
}

/// Options passed to the template besides the messages.
#[derive(Clone, Debug)]
pub struct ChatOptions {
    pub thinking: Thinking,
    pub add_generation_prompt: bool,
    /// Tool definitions (JSON schema list), if any.
    pub tools: Option<serde_json::Value>,
    /// The template's `tool_choice` (`"required"` / `"none"` add its instruction), if any.
    pub tool_choice: Option<String>,
    /// The template's `response_format` (`{"type": "json_object"}` or `{"type": "json_schema",
    /// "json_schema": {...}}` add its instruction), if any.
    pub response_format: Option<serde_json::Value>,
}

impl Default for ChatOptions {
    fn default() -> Self {
        ChatOptions {
            thinking: Thinking::Max,
            add_generation_prompt: true,
            tools: None,
            tool_choice: None,
            response_format: None,
        }
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    path: PathBuf,
    /// Characters that start some special-token name, escaped in caller text.
    special_first: Vec<char>,
    /// Values for `bos_token` / `eos_token` in the template context.
    bos: String,
    eos: String,
}

impl ChatTemplate {
    /// Loads `dir/chat_template.jinja`; `tok` supplies the special-token names.
    pub fn load(dir: &Path, tok: &Tokenizer) -> Result<Self, ChatError> {
        let path = dir.join("chat_template.jinja");
        let source = std::fs::read_to_string(&path).map_err(|source| ChatError::Io { path: path.clone(), source })?;
        Self::from_source(&path, source, tok)
    }

    pub fn from_source(path: &Path, source: String, tok: &Tokenizer) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| ChatError::Compile { path: path.to_path_buf(), msg: e.to_string() })?;
        env.set_syntax(syntax);
        env.set_fuel(Some(RENDER_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat", source)
            .map_err(|e| ChatError::Compile { path: path.to_path_buf(), msg: format!("{e:#}") })?;
        let mut special_first: Vec<char> = tok.special_names().iter().filter_map(|s| s.chars().next()).collect();
        special_first.sort_unstable();
        special_first.dedup();
        let name = |id: Option<u32>| {
            id.and_then(|i| tok.token_bytes(i).ok())
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_default()
        };
        Ok(ChatTemplate {
            env,
            path: path.to_path_buf(),
            special_first,
            bos: name(tok.special_id("[BOS]")),
            eos: name(tok.special_id("[EOS]")),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Renders `messages` (a JSON list of {role, content, ...}) to the template's text, with caller
    /// strings escaped (see the module doc). Use [`Self::encode`] to get token ids.
    fn render_escaped(&self, messages: &serde_json::Value, opts: &ChatOptions) -> Result<String, ChatError> {
        let tmpl = self.env.get_template("chat").map_err(|e| ChatError::Render(format!("{e:#}")))?;
        let escape = |v: &serde_json::Value| Value::from(minijinja::value::Serde(escape_json(v, &self.special_first)));
        let (thinking, effort) = match opts.thinking {
            Thinking::Off => (false, None),
            Thinking::Low => (true, Some("low")),
            Thinking::High => (true, Some("high")),
            Thinking::Max => (true, Some("max")),
        };
        let mut ctx = vec![
            ("messages", escape(messages)),
            ("add_generation_prompt", Value::from(opts.add_generation_prompt)),
            ("thinking", Value::from(thinking)),
            ("bos_token", Value::from(self.bos.clone())),
            ("eos_token", Value::from(self.eos.clone())),
        ];
        if let Some(e) = effort {
            ctx.push(("thinking_effort", Value::from(e)));
        }
        if let Some(t) = &opts.tools {
            ctx.push(("tools", escape(t)));
        }
        if let Some(c) = &opts.tool_choice {
            ctx.push(("tool_choice", escape(&serde_json::Value::String(c.clone()))));
        }
        if let Some(f) = &opts.response_format {
            ctx.push(("response_format", escape(f)));
        }
        let ctx: std::collections::BTreeMap<&str, Value> = ctx.into_iter().collect();
        tmpl.render(ctx).map_err(|e| ChatError::Render(render_error(&e)))
    }

    /// The rendered prompt as plain text (caller strings unescaped), for display and tests.
    pub fn render(&self, messages: &serde_json::Value, opts: &ChatOptions) -> Result<String, ChatError> {
        Ok(unescape(&self.render_escaped(messages, opts)?))
    }

    /// Renders and tokenises: specials from the template become special ids, caller text never does.
    pub fn encode(
        &self,
        tok: &Tokenizer,
        messages: &serde_json::Value,
        opts: &ChatOptions,
    ) -> Result<Vec<u32>, ChatError> {
        self.encode_at_most(tok, messages, opts, usize::MAX)
    }

    /// [`Self::encode`], but a rendered prompt whose length in bytes already implies more than
    /// `max_tokens` tokens is refused ([`ChatError::TooLong`]) before it is tokenised, so the
    /// cost of an over-long message is bounded by the context, not by its size.
    pub fn encode_at_most(
        &self,
        tok: &Tokenizer,
        messages: &serde_json::Value,
        opts: &ChatOptions,
        max_tokens: usize,
    ) -> Result<Vec<u32>, ChatError> {
        let text = self.render_escaped(messages, opts)?;
        let bytes = unescaped_len(&text);
        let at_least = tok.min_tokens(bytes);
        if at_least > max_tokens {
            return Err(ChatError::TooLong { at_least, bytes });
        }
        Ok(tok.encode_with_specials_mapped(&text, unescape))
    }
}

fn render_error(e: &Error) -> String {
    if e.kind() == ErrorKind::OutOfFuel {
        return format!("the template ran past its limit of {RENDER_FUEL} steps (a runaway loop or string?)");
    }
    // raise_exception's message is the useful part; other errors keep minijinja's detail.
    if e.kind() == ErrorKind::InvalidOperation
        && let Some(d) = e.detail()
    {
        return d.to_string();
    }
    format!("{e:#}")
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `strftime_now(fmt)` as HF provides it; only the common date fields are supported.
fn strftime_now(fmt: String) -> Result<Value, Error> {
    let (y, m, d) = crate::util::civil_today();
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let out = fmt
        .replace("%Y", &y.to_string())
        .replace("%m", &format!("{m:02}"))
        .replace("%d", &format!("{d:02}"))
        .replace("%B", MONTHS[(m - 1) as usize])
        .replace("%b", &MONTHS[(m - 1) as usize][..3]);
    Ok(Value::from(out))
}

/// Inserts MARK after every character that can start a special name (and doubles MARK itself).
fn escape_str(s: &str, first: &[char]) -> String {
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        out.push(c);
        if c == MARK || first.contains(&c) {
            out.push(MARK);
        }
    }
    out
}

fn escape_json(v: &serde_json::Value, first: &[char]) -> serde_json::Value {
    use serde_json::Value as J;
    match v {
        J::String(s) => J::String(escape_str(s, first)),
        J::Array(a) => J::Array(a.iter().map(|x| escape_json(x, first)).collect()),
        J::Object(o) => J::Object(o.iter().map(|(k, x)| (escape_str(k, first), escape_json(x, first))).collect()),
        other => other.clone(),
    }
}

/// The length in bytes of `unescape(s)`, without building it.
fn unescaped_len(s: &str) -> usize {
    let mut n = 0;
    let mut it = s.chars().peekable();
    while let Some(c) = it.next() {
        if c == MARK {
            if it.peek() == Some(&MARK) {
                it.next();
                n += MARK.len_utf8();
            }
        } else {
            n += c.len_utf8();
        }
    }
    n
}

/// Removes the markers: a doubled MARK is a literal MARK, a single one is dropped.
pub(crate) fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut it = s.chars().peekable();
    while let Some(c) = it.next() {
        if c == MARK {
            if it.peek() == Some(&MARK) {
                it.next();
                out.push(MARK);
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Python `json.dumps` semantics: separators ", " and ": ", `ensure_ascii` (HF default False),
/// `indent`, `sort_keys`.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let seps = match separators.filter(|v| !v.is_none()) {
        None => None,
        Some(v) => {
            let parts: Vec<String> = v.try_iter()?.map(|x| x.as_str().unwrap_or_default().to_string()).collect();
            match parts.as_slice() {
                [item, key] => Some((item.clone(), key.clone())),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be (item_separator, key_separator)",
                    ));
                }
            }
        }
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(n.max(0) as usize)),
            None => Some(v.as_str().unwrap_or("").to_string()),
        },
    };
    let mut out = String::new();
    let opts = JsonOpts { ascii: ensure_ascii.unwrap_or(false), indent, sort_keys: sort_keys.unwrap_or(false), seps };
    write_json(&mut out, value, &opts, 0)?;
    Ok(Value::from_safe_string(out))
}

struct JsonOpts {
    ascii: bool,
    indent: Option<String>,
    sort_keys: bool,
    /// (item, key) separators; Python's defaults when None.
    seps: Option<(String, String)>,
}

fn write_json(out: &mut String, v: &Value, o: &JsonOpts, depth: usize) -> Result<(), Error> {
    let newline = |out: &mut String, d: usize| {
        if let Some(ind) = &o.indent {
            out.push('\n');
            for _ in 0..d {
                out.push_str(ind);
            }
        }
    };
    let (item_sep, key_sep) = match &o.seps {
        Some((i, k)) => (i.as_str(), k.as_str()),
        None if o.indent.is_some() => (",", ": "),
        None => (", ", ": "),
    };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else if let Ok(f) = f64::try_from(v.clone()) {
                out.push_str(&py_float(f));
            } else {
                out.push_str(&v.to_string());
            }
        }
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or(""), o.ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_json(out, x, o, depth + 1)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if o.sort_keys {
                keys.sort_by_key(|k| k.to_string());
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                let ks = if let Some(s) = k.as_str() { s.to_string() } else { k.to_string() };
                write_json_str(out, &ks, o.ascii);
                out.push_str(key_sep);
                write_json(out, &v.get_item(k)?, o, depth + 1)?;
            }
            newline(out, depth);
            out.push('}');
        }
        _ => write_json_str(out, &v.to_string(), o.ascii),
    }
    Ok(())
}

fn write_json_str(out: &mut String, s: &str, ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            // The escaping marker stays raw so it can be removed after rendering.
            MARK => out.push(MARK),
            c if (c as u32) < 0x20 || (ascii && (c as u32) > 0x7e) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: shortest round-trip digits, fixed notation for exponents in
/// [-4, 16), scientific otherwise (`1e+16`, `1e-05`).
fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    let sci = format!("{f:e}"); // e.g. "-1.5e-7"
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let neg = mant.starts_with('-');
    let digits: String = mant.chars().filter(|c| c.is_ascii_digit()).collect();
    let sign = if neg { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let s = if point <= 0 {
            format!("0.{}{}", "0".repeat((-point) as usize), digits)
        } else if point as usize >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
        };
        format!("{sign}{s}")
    } else {
        let m = if digits.len() > 1 { format!("{}.{}", &digits[..1], &digits[1..]) } else { digits };
        format!("{sign}{m}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_float_repr() {
        for (f, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1e-5, "1e-05"),
            (123.456, "123.456"),
            (-2.5e-7, "-2.5e-07"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
        ] {
            assert_eq!(py_float(f), want);
        }
    }

    fn tiny_tokenizer() -> Tokenizer {
        let bytes: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        let mut sp: Vec<String> = (0..256).map(|i| format!("<|reserved_token_{}|>", 256 + i)).collect();
        sp[0] = "<|open|>".into();
        Tokenizer::from_parts(bytes, sp).unwrap()
    }

    #[test]
    fn tojson_follows_python_options() {
        let tok = tiny_tokenizer();
        let src =
            "{{ messages[0] | tojson(separators=(',', ':')) }}|{{ messages[0].content | tojson(ensure_ascii=true) }}"
                .to_string();
        let t = ChatTemplate::from_source(Path::new("t.jinja"), src, &tok).unwrap();
        let msgs = serde_json::json!([{"role": "user", "content": "<|open|> é"}]);
        let out = t.render(&msgs, &ChatOptions::default()).unwrap();
        assert_eq!(out, r#"{"role":"user","content":"<|open|> é"}|"<|open|> \u00e9""#);
        // The caller's "<|open|>" stays text even inside JSON.
        let ids = t.encode(&tok, &msgs, &ChatOptions::default()).unwrap();
        assert!(ids.iter().all(|&i| i < 256), "{ids:?}");
    }

    #[test]
    fn an_over_long_prompt_is_refused_by_its_size_before_tokenising() {
        let tok = tiny_tokenizer();
        let src = "{% for m in messages %}<|open|>{{ m.content | trim }}{% endfor %}".to_string();
        let t = ChatTemplate::from_source(Path::new("t.jinja"), src, &tok).unwrap();
        let msgs = serde_json::json!([{"role": "user", "content": format!("  {}  ", "x<|open|>y".repeat(100))}]);
        let opts = ChatOptions::default();
        let ids = t.encode(&tok, &msgs, &opts).unwrap();
        // The bound from the size never exceeds the real count, so a prompt that fits passes.
        let bytes = t.render(&msgs, &opts).unwrap().len();
        assert!(tok.min_tokens(bytes) <= ids.len());
        assert_eq!(t.encode_at_most(&tok, &msgs, &opts, ids.len()).unwrap(), ids);
        let limit = tok.min_tokens(bytes) - 1;
        match t.encode_at_most(&tok, &msgs, &opts, limit) {
            Err(ChatError::TooLong { at_least, bytes: b }) => assert_eq!((at_least, b), (limit + 1, bytes)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn escaping_round_trips_and_blocks_specials() {
        let first = ['<', '['];
        for s in ["plain", "<|open|>", "[BOS]", "a\u{F8F0}b", "\u{F8F0}\u{F8F0}<", ""] {
            let e = escape_str(s, &first);
            assert!(!e.contains("<|") && !e.contains("[B"), "{e:?}");
            assert_eq!(unescape(&e), s);
            assert_eq!(unescaped_len(&e), s.len());
        }
        // Order is preserved, so dictsort sees the same order.
        let mut a = vec!["b", "<a", "a<", "a", "[x", "a[", "a\u{F8F0}"];
        let mut b: Vec<String> = a.iter().map(|s| escape_str(s, &first)).collect();
        a.sort();
        b.sort();
        assert_eq!(b.iter().map(|s| unescape(s)).collect::<Vec<_>>(), a);
    }
}
