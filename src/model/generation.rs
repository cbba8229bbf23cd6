//! `generation_config.json`, Hugging Face's file of a model's suggested sampling settings: the
//! `temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty` that `--demo` uses as
//! defaults (the fields vLLM reads from it), and the chat defaults every front end takes from any model's file:
//! `chat_template_kwargs` (named after vLLM's option of that name), here `thinking` (false: the
//! chat template's thinking channel is off unless a request asks for it) and `thinking_effort`.
//!
//! Contract: [`GenerationDefaults::load`] is `Ok(None)` when the file is absent. A file that is
//! present is checked: malformed JSON, a `temperature` / `top_p` / `top_k` / `min_p` /
//! `repetition_penalty` that is not a number the sampler takes (temperature 0..=2, top_p and min_p
//! 0..=1, top_k a whole number, repetition_penalty above 0), or a
//! `chat_template_kwargs` other than `{"thinking": bool, "thinking_effort": "low"|"high"|"max"}`
//! is a [`ModelError`] naming the file and the field. `do_sample: false` (HF's switch for greedy
//! decoding) makes the temperature 0 whatever the file says. Other fields are ignored.

use super::ModelError;
use super::chat::Thinking;
use crate::sample::SamplingDefaults;
use std::path::Path;

/// The file's name in a model directory.
pub const FILE: &str = "generation_config.json";

/// The defaults a model suggests (None: the file does not say).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GenerationDefaults {
    /// Its sampling.
    pub sampling: SamplingDefaults,
    /// The chat template's thinking when a request does not say (None: the template's default).
    pub thinking: Option<Thinking>,
}

impl GenerationDefaults {
    /// Reads `dir/generation_config.json` (see the module contract).
    pub fn load(dir: &Path) -> Result<Option<Self>, ModelError> {
        let path = dir.join(FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(ModelError::Io { path, source }),
        };
        Self::parse(&path, &text).map(Some)
    }

    /// Parses the file's text; `path` names it in errors.
    pub fn parse(path: &Path, text: &str) -> Result<Self, ModelError> {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|source| ModelError::Json { path: path.to_path_buf(), source })?;
        let bad = |field: &str, msg: String| ModelError::Config { path: path.to_path_buf(), field: field.into(), msg };
        if !v.is_object() {
            return Err(bad("(top level)", "expected a JSON object".into()));
        }
        let number = |field: &str, hi: f64| -> Result<Option<f64>, ModelError> {
            match v.get(field) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(x) => match x.as_f64() {
                    Some(f) if f.is_finite() && (0.0..=hi).contains(&f) => Ok(Some(f)),
                    _ => Err(bad(field, format!("expected a number from 0 to {hi}, got {x}"))),
                },
            }
        };
        let mut temperature = number("temperature", 2.0)?;
        let top_p = number("top_p", 1.0)?;
        let min_p = number("min_p", 1.0)?;
        let top_k = match v.get("top_k") {
            None | Some(serde_json::Value::Null) => None,
            Some(x) => match x.as_u64() {
                Some(k) => Some(usize::try_from(k).unwrap_or(usize::MAX)),
                None => return Err(bad("top_k", format!("expected a whole number (0: off), got {x}"))),
            },
        };
        match v.get("do_sample") {
            None | Some(serde_json::Value::Null) | Some(serde_json::Value::Bool(true)) => {}
            Some(serde_json::Value::Bool(false)) => temperature = Some(0.0),
            Some(x) => return Err(bad("do_sample", format!("expected true or false, got {x}"))),
        }
        let thinking = match v.get("chat_template_kwargs") {
            None | Some(serde_json::Value::Null) => None,
            Some(k) => thinking_kwargs(k).map_err(|(field, msg)| match field.as_str() {
                "" => bad("chat_template_kwargs", msg),
                f => bad(&format!("chat_template_kwargs.{f}"), msg),
            })?,
        };
        let repetition_penalty = match number("repetition_penalty", f64::MAX)? {
            Some(r) if r <= 0.0 => {
                return Err(bad("repetition_penalty", format!("expected a number above 0, got {r}")));
            }
            r => r,
        };
        let sampling = SamplingDefaults { temperature, top_p, top_k, min_p, repetition_penalty, ..Default::default() };
        Ok(GenerationDefaults { sampling, thinking })
    }
}

/// The thinking a chat in the model in `dir` gets when it asks for none: its
/// generation_config.json's `chat_template_kwargs`, else the template's default (max).
pub fn default_thinking(dir: &Path) -> Result<Thinking, ModelError> {
    Ok(GenerationDefaults::load(dir)?.and_then(|g| g.thinking).unwrap_or(Thinking::Max))
}

/// The thinking setting of a `chat_template_kwargs` object (`thinking`, `thinking_effort`, the
/// template's own variables): None when it names neither; Err((field, what is wrong)).
pub fn thinking_kwargs(k: &serde_json::Value) -> Result<Option<Thinking>, (String, String)> {
    let Some(m) = k.as_object() else {
        return Err((String::new(), format!("expected an object, got {k}")));
    };
    if let Some(other) = m.keys().find(|k| !matches!(k.as_str(), "thinking" | "thinking_effort")) {
        return Err((other.clone(), "unknown key (thinking and thinking_effort are taken)".into()));
    }
    let on = match m.get("thinking") {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::Bool(b)) => Some(*b),
        Some(x) => return Err(("thinking".into(), format!("expected true or false, got {x}"))),
    };
    let effort = match m.get("thinking_effort") {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(e)) => Some(match e.as_str() {
            "low" => Thinking::Low,
            "high" => Thinking::High,
            "max" => Thinking::Max,
            _ => return Err(("thinking_effort".into(), format!("expected low, high or max, got \"{e}\""))),
        }),
        Some(x) => return Err(("thinking_effort".into(), format!("expected low, high or max, got {x}"))),
    };
    Ok(match (on, effort) {
        (Some(false), _) => Some(Thinking::Off),
        (_, Some(e)) => Some(e),
        (Some(true), None) => Some(Thinking::Max),
        (None, None) => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(t: &str) -> Result<GenerationDefaults, ModelError> {
        GenerationDefaults::parse(Path::new("m/generation_config.json"), t)
    }

    #[test]
    fn reads_hf_fields_and_names_bad_ones() {
        let g = parse(r#"{"temperature": 0.7, "top_p": 0.9, "bos_token_id": 1}"#).unwrap();
        let sampling = SamplingDefaults { temperature: Some(0.7), top_p: Some(0.9), ..Default::default() };
        assert_eq!(g, GenerationDefaults { sampling, ..Default::default() });
        let g = parse(r#"{"top_k": 40, "min_p": 0.05, "chat_template_kwargs": {"thinking": false}}"#).unwrap();
        assert_eq!((g.sampling.top_k, g.sampling.min_p, g.thinking), (Some(40), Some(0.05), Some(Thinking::Off)));
        for (kw, want) in [
            (r#"{"thinking": true}"#, Some(Thinking::Max)),
            (r#"{"thinking_effort": "low"}"#, Some(Thinking::Low)),
            (r#"{"thinking": false, "thinking_effort": "high"}"#, Some(Thinking::Off)),
            (r#"{}"#, None),
        ] {
            let g = parse(&format!(r#"{{"chat_template_kwargs": {kw}}}"#)).unwrap();
            assert_eq!(g.thinking, want, "{kw}");
        }
        assert_eq!(parse("{}").unwrap(), GenerationDefaults::default());
        let g = parse(r#"{"temperature": 0.7, "do_sample": false}"#).unwrap();
        assert_eq!(g.sampling.temperature, Some(0.0));
        for (t, field) in [
            (r#"{"temperature": -1}"#, "temperature"),
            (r#"{"temperature": "hot"}"#, "temperature"),
            (r#"{"top_p": 1.5}"#, "top_p"),
            (r#"{"do_sample": 1}"#, "do_sample"),
            (r#"{"top_k": -1}"#, "top_k"),
            (r#"{"min_p": 2}"#, "min_p"),
            (r#"{"chat_template_kwargs": {"thinking": "no"}}"#, "chat_template_kwargs.thinking"),
            (r#"{"chat_template_kwargs": {"thinking_effort": "medium"}}"#, "chat_template_kwargs.thinking_effort"),
            (r#"{"chat_template_kwargs": {"enable_thinking": false}}"#, "chat_template_kwargs.enable_thinking"),
        ] {
            let e = parse(t).unwrap_err().to_string();
            assert!(e.contains("m/generation_config.json") && e.contains(field), "{t}: {e}");
        }
        assert!(parse("[1]").is_err());
        assert!(parse("{").unwrap_err().to_string().contains("malformed JSON"));
        let none = tempfile::tempdir().unwrap();
        assert_eq!(GenerationDefaults::load(none.path()).unwrap(), None);
    }
}
