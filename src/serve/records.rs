//! The records of a batch run (`deltafin batch`): one JSON object per input line, a result or an
//! error, and running a group of lines together.
//!
//! Contract: a result record is `{"id", "line", "text", "finish_reason", "usage", "deltafin"}`
//! plus `reasoning_content` and `logprobs` when there are any; an error record is `{"id", "line",
//! "error"}` in OpenAI's error shape. [`group_records`] answers a group of checked requests
//! together (`Generator::generate_batch`), one record per request in order, after checking that
//! their sequence states fit the memory budget together.

use super::api::{ApiError, GenRequest};
use super::generator::{Delta, GenError, Generator, Output, Prepared};
use super::parallel::BatchJob;
use crate::memory::SequencesError;
use serde_json::{Value, json};

/// A line waiting for its group: its id as given, its line number, the request and its prompt.
pub struct Waiting {
    pub id: Value,
    pub line: u64,
    pub req: GenRequest,
    pub prepared: Prepared,
}

pub fn error_record(id: &Value, line: u64, e: &ApiError) -> Value {
    json!({"id": id, "line": line, "error": e.body()["error"]})
}

pub fn result_record(id: &Value, line: u64, out: &Output, logprobs: bool, text: &dyn Fn(u32) -> String) -> Value {
    let mut r = json!({
        "id": id,
        "line": line,
        "text": out.content,
        "finish_reason": out.finish_reason,
        "usage": crate::serve::sse::usage(out),
        "deltafin": out.ext,
    });
    if !out.reasoning.is_empty() {
        r["reasoning_content"] = json!(out.reasoning);
    }
    if logprobs {
        r["logprobs"] = out
            .logprobs
            .iter()
            .map(|l| {
                json!({"token": text(l.token), "logprob": l.logprob,
                       "top_logprobs": l.top.iter().map(|&(t, lp)| json!({"token": text(t), "logprob": lp})).collect::<Vec<_>>()})
            })
            .collect();
    }
    r
}

/// Answers `group` together; one record per request, in order. A failed shared forward is an
/// error record for every request of the group.
pub fn group_records(generator: &mut Generator, group: &[Waiting]) -> Result<Vec<Value>, SequencesError> {
    if group.is_empty() {
        return Ok(Vec::new());
    }
    let lens: Vec<usize> = group.iter().map(|w| w.prepared.prompt.len() + w.prepared.max_new).collect();
    generator.engine().sequences_fit(&lens)?;
    let mut sinks: Vec<_> = group.iter().map(|_| |_: &Delta| true).collect();
    let mut jobs: Vec<BatchJob> = group
        .iter()
        .zip(sinks.iter_mut())
        .map(|(w, sink)| BatchJob { req: &w.req, prepared: w.prepared.clone(), sink })
        .collect();
    let failed = |e: &dyn std::fmt::Display| ApiError::new(500, "server_error", "generation_failed", e.to_string());
    Ok(match generator.generate_batch(&mut jobs) {
        Ok(rs) => group
            .iter()
            .zip(rs)
            .map(|(w, r)| match r {
                Ok(o) => result_record(&w.id, w.line, &o, w.req.logprobs.is_some(), &|t| generator.token_text(t)),
                Err(GenError::Request(e)) => error_record(&w.id, w.line, &e),
                Err(e) => error_record(&w.id, w.line, &failed(&e)),
            })
            .collect(),
        Err(e) => group.iter().map(|w| error_record(&w.id, w.line, &failed(&e))).collect(),
    })
}
