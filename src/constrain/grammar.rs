//! What a constraint enforces ([`Spec`]) and its grammar in llguidance's Lark syntax ([`lark`]),
//! written in the K3 chat template's own tags (see the module contract of `constrain`).

use super::{ConstrainError, MAX_SCHEMA_BYTES, Tags};
use serde_json::{Value, json};

/// The answer's payload.
#[derive(Clone, Debug, PartialEq)]
pub enum Payload {
    /// A JSON value of this schema (`{"type": "object"}` for JSON mode).
    Json(Value),
    /// Tool calls (at least one; exactly one unless `parallel`) of these tools, (name, parameters
    /// schema) each.
    Tools { tools: Vec<(String, Value)>, parallel: bool },
}

impl Payload {
    /// What the request asked for, in its own words.
    pub fn what(&self) -> &'static str {
        match self {
            Payload::Json(_) => "response_format",
            Payload::Tools { .. } => "tool_choice",
        }
    }
}

/// A constraint on one chat answer.
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    pub payload: Payload,
    /// The answer starts in the thinking channel (the generation prompt opened it).
    pub thinking: bool,
}

/// Whitespace allowed between two JSON tokens: none, one space, or a newline and up to 20 spaces
/// or tabs of indent (llama.cpp's rule): pretty-printed JSON passes, and a model cannot loop on
/// whitespace inside a value (with any whitespace allowed, the demo model wrote newlines until
/// max_tokens).
const JSON_WS: &str = r"(?:\x20|\n[\x20\t]{0,20})";

/// A JSON text for the grammar: a schema (with llguidance's JSON options: [`JSON_WS`] unless the
/// schema sets its own `x-guidance`), checked for size.
fn schema_text(what: &'static str, v: &Value) -> Result<String, ConstrainError> {
    super::budget::check(v, what)?;
    let mut v = match v {
        Value::Bool(true) => json!({}),
        v => v.clone(),
    };
    if let Some(m) = v.as_object_mut()
        && !m.contains_key("x-guidance")
    {
        m.insert("x-guidance".into(), json!({"whitespace_pattern": JSON_WS}));
    }
    let text = v.to_string();
    if text.len() > MAX_SCHEMA_BYTES {
        return Err(ConstrainError::TooLarge { what, bytes: text.len() });
    }
    Ok(text)
}

/// A Lark string literal (JSON string syntax; DEL, which it does not take raw, escaped).
fn lit(s: &str) -> String {
    Value::String(s.to_string()).to_string().replace('\u{7f}', "\\u007f")
}

/// The Lark grammar of `spec` over the template's tags `t`.
pub fn lark(spec: &Spec, t: &Tags) -> Result<String, ConstrainError> {
    let (o, c, s) = (format!("<[{}]>", t.open), format!("<[{}]>", t.close), format!("<[{}]>", t.sep));
    let stops = t.stops.iter().map(|x| format!("<[{x}]>")).collect::<Vec<_>>().join(" | ");
    let mut g = String::new();
    // The thinking channel: any text without a special token, then the response opens.
    let think = if spec.thinking {
        g.push_str("THINK: /(?s:.*)/\n");
        format!("THINK? {c} \"think\" {s} {o} \"response\" {s} ")
    } else {
        String::new()
    };
    let tail = format!("{c} \"message\" {s} end\nend: {stops}\n");
    match &spec.payload {
        Payload::Json(schema) => {
            let text = schema_text("response_format's schema", schema)?;
            g.push_str(&format!("start: {think}json {c} \"response\" {s} {tail}json: %json {text}\n"));
        }
        Payload::Tools { tools, parallel } => {
            let calls = if *parallel { "call+" } else { "call" };
            g.push_str(&format!(
                "start: {think}{c} \"response\" {s} {o} \"tools\" {s} {calls} {c} \"tools\" {s} {tail}"
            ));
            g.push_str("INDEX: /[1-9][0-9]{0,2}/\n");
            let names: Vec<String> = (0..tools.len()).map(|i| format!("call_{i}")).collect();
            g.push_str(&format!("call: {}\n", names.join(" | ")));
            let mut total = 0;
            for (i, (name, params)) in tools.iter().enumerate() {
                let text = schema_text("a tool's parameters", params)?;
                total += text.len();
                if total > MAX_SCHEMA_BYTES {
                    return Err(ConstrainError::TooLarge { what: "the tools' parameters", bytes: total });
                }
                // The template's attribute escaping (&, ") applied to the name.
                let attr = name.replace('&', "&amp;").replace('"', "&quot;");
                g.push_str(&format!(
                    "call_{i}: {o} {} INDEX \"\\\"\" {s} {o} \"json type=\\\"object\\\"\" {s} args_{i} {c} \"json\" {s} {c} \"call\" {s}\nargs_{i}: %json {text}\n",
                    lit(&format!("call tool=\"{attr}\" index=\""))
                ));
            }
        }
    }
    Ok(g)
}

/// A tool's parameters schema as the grammar takes it: none (or an empty one) is an object with
/// no properties.
pub fn parameters_schema(params: Option<&Value>) -> Value {
    match params {
        None => json!({"type": "object", "properties": {}, "additionalProperties": false}),
        Some(Value::Object(m)) if m.is_empty() => {
            json!({"type": "object", "properties": {}, "additionalProperties": false})
        }
        Some(p) => p.clone(),
    }
}
