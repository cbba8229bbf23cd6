//! The OpenAI-compatible protocol, apart from any transport: what a request may say and what an
//! answer looks like, for every front end that speaks it (the HTTP server, `batch`'s lines, the
//! terminal chat's transcript).
//!
//! Contract: [`request`] turns a JSON document into a checked [`GenRequest`] or an [`ApiError`]
//! naming the field (with `request/tools.rs`: tools, tool choice, response formats); [`json`]
//! parses a body within a budget of values; [`response`] gives an answer ([`Output`], streamed as
//! [`Delta`]s) its shapes: whole responses, streamed chunks, usage, log-probabilities. Nothing here
//! reads a socket, runs the model or panics on any input; the types below `api` it uses are the
//! model's text types (chat template settings, tool calls), the sampler's ([`SamplingSpec`],
//! log-probabilities) and enforced output's.
//!
//! [`SamplingSpec`]: crate::sample::SamplingSpec

pub mod json;
pub mod request;
pub mod response;

pub use request::{
    GenRequest, JsonBody, Kind, Owned, ParseContext, Prompt, ResponseFormat, ToolChoice, parse_batch_line, parse_chat,
    parse_completion, template_vars,
};
pub use response::{Delta, Output};
use serde_json::Value;

/// An error response: HTTP status and OpenAI's `{"error": {message, type, param, code}}`.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.into()),
            code: Some("invalid_value"),
        }
    }

    pub fn new(status: u16, kind: &'static str, code: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), kind, param: None, code: Some(code) }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn body(&self) -> Value {
        serde_json::json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.param {
            Some(p) => write!(f, "{p}: {}", self.message),
            None => write!(f, "{}", self.message),
        }
    }
}
