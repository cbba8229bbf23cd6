//! `generation_config.json`, Hugging Face's file of a model's suggested sampling settings: the
//! `temperature` and `top_p` that `--demo` uses as defaults.
//!
//! Contract: [`GenerationDefaults::load`] is `Ok(None)` when the file is absent. A file that is
//! present is checked: malformed JSON, or a `temperature` / `top_p` that is not a number the
//! sampler takes (temperature 0..=2, top_p 0..=1), is a [`ModelError`] naming the file and the
//! field. `do_sample: false` (HF's switch for greedy decoding) makes the temperature 0 whatever
//! the file says. Other fields are ignored.

use super::ModelError;
use std::path::Path;

/// The file's name in a model directory.
pub const FILE: &str = "generation_config.json";

/// Sampling defaults a model suggests (None: the file does not say).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GenerationDefaults {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
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
        match v.get("do_sample") {
            None | Some(serde_json::Value::Null) | Some(serde_json::Value::Bool(true)) => {}
            Some(serde_json::Value::Bool(false)) => temperature = Some(0.0),
            Some(x) => return Err(bad("do_sample", format!("expected true or false, got {x}"))),
        }
        Ok(GenerationDefaults { temperature, top_p })
    }
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
        assert_eq!(g, GenerationDefaults { temperature: Some(0.7), top_p: Some(0.9) });
        assert_eq!(parse("{}").unwrap(), GenerationDefaults::default());
        let g = parse(r#"{"temperature": 0.7, "do_sample": false}"#).unwrap();
        assert_eq!(g.temperature, Some(0.0));
        for (t, field) in [
            (r#"{"temperature": -1}"#, "temperature"),
            (r#"{"temperature": "hot"}"#, "temperature"),
            (r#"{"top_p": 1.5}"#, "top_p"),
            (r#"{"do_sample": 1}"#, "do_sample"),
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
