//! A chat request's enforced output: its `tool_choice` (required, a named function) or
//! `response_format` (json_object, json_schema) as a `constrain::Spec`, checked when the request
//! is prepared (a schema that cannot be enforced is a 400 before the request queues) and set on
//! its sampler when it starts (the template variables that tell the model about them are
//! `api::template_vars`).
//!
//! Contract: a request asks for at most one constraint (`api` refuses both); tool choice `auto`
//! and `none` and response format `text` ask for none. The grammar engine over the model's
//! tokenizer is built on first use, once per server, and shared.

use super::generator::Encoder;
use crate::api::{ApiError, GenRequest, Kind, ResponseFormat, ToolChoice};
use crate::constrain::{ConstrainError, Grammars, Payload, Spec, parameters_schema};
use crate::model::chat::Thinking;
use crate::sample::TokenMask;
use serde_json::{Value, json};

/// The param a constraint's error names.
fn param(req: &GenRequest) -> &'static str {
    if req.response_format != ResponseFormat::Text { "response_format" } else { "tool_choice" }
}

impl Encoder {
    /// The constraint `req` asks for, if any.
    pub fn constraint_spec(&self, req: &GenRequest) -> Option<Spec> {
        if req.kind != Kind::Chat {
            return None;
        }
        let tools = || -> Vec<(String, Value)> {
            req.tools
                .iter()
                .flat_map(|t| t.as_array().into_iter().flatten())
                .map(|t| {
                    let f = &t["function"];
                    (f["name"].as_str().unwrap_or_default().to_string(), parameters_schema(f.get("parameters")))
                })
                .collect()
        };
        let payload = match (&req.response_format, &req.tool_choice) {
            (ResponseFormat::JsonObject, _) => Payload::Json(json!({"type": "object"})),
            (ResponseFormat::JsonSchema { schema, .. }, _) => Payload::Json(schema.clone()),
            (ResponseFormat::Text, ToolChoice::Required) => {
                Payload::Tools { tools: tools(), parallel: req.parallel_tool_calls }
            }
            (ResponseFormat::Text, ToolChoice::Named(n)) => {
                Payload::Tools { tools: tools().into_iter().filter(|(t, _)| t == n).collect(), parallel: false }
            }
            (ResponseFormat::Text, ToolChoice::Auto | ToolChoice::None) => return None,
        };
        Some(Spec { payload, thinking: self.thinking_of(req) != Thinking::Off })
    }

    /// The grammar engine (built on first use).
    fn grammars(&self, req: &GenRequest) -> Result<&Grammars, ApiError> {
        let g = self.grammars.get_or_init(|| {
            let tok = self.tokenizer().ok_or("this model has no tokenizer")?;
            let stops = self.engine.stop_tokens(Some(tok));
            Grammars::new(tok, self.engine.vocab(), &stops).map_err(|e| e.to_string())
        });
        g.as_ref().map_err(|e| {
            ApiError::invalid(param(req), format!("enforced output is not available for this model: {e}"))
                .with_code("unsupported_value")
        })
    }

    /// `req`'s constraint can be enforced (none, or one that compiles).
    pub fn check_constraint(&self, req: &GenRequest) -> Result<(), ApiError> {
        let Some(spec) = self.constraint_spec(req) else { return Ok(()) };
        self.grammars(req)?.check(&spec).map_err(|e| refused(req, e))
    }

    /// A fresh mask for one answer to `req`, if it asks for a constraint.
    pub fn constraint(&self, req: &GenRequest) -> Result<Option<Box<dyn TokenMask>>, ApiError> {
        let Some(spec) = self.constraint_spec(req) else { return Ok(None) };
        self.grammars(req)?.mask(&spec).map(Some).map_err(|e| refused(req, e))
    }
}

/// The answer to a constraint that cannot be compiled: a 400 naming the param, or a 503 when
/// the compilations at once are taken (a client may retry).
fn refused(req: &GenRequest, e: ConstrainError) -> ApiError {
    match e {
        ConstrainError::Busy => ApiError::new(503, "server_error", "busy", e.to_string()),
        e => ApiError::invalid(param(req), e.to_string()),
    }
}
