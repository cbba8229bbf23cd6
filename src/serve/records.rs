//! The records of a batch run (`deltafin batch`): one JSON object per input line, a result or an
//! error, and running a group of lines together.
//!
//! Contract: a result record is `{"id", "line", "text", "finish_reason", "usage", "deltafin"}`
//! plus `reasoning_content` and `logprobs` when there are any; an error record is `{"id", "line",
//! "error"}` in OpenAI's error shape. [`run_lanes`] runs checked requests as a running batch
//! (`Engine::drive_lanes`, each request a lane: `Generator::start_lane`): when one finishes its
//! record is written and the next request joins at the next step, its prompt's rows in the same
//! forward as the running ones' decode rows; records come in the order requests finish.
//! [`longest_request`] is the context the longest line of an input needs; [`done_records`] what
//! an output already holds.

use super::api::{ApiError, GenRequest, ParseContext};
use super::generator::{GenError, Generator, Output, Prepared, PromptCodec};
use super::parallel::{LaneRequest, Started};
use crate::engine::{Lane, LaneError, LaneHost};
use crate::memory::SequencesError;
use crate::stats::Stats;
use serde_json::{Value, json};
use std::collections::HashSet;
use std::path::Path;

/// A line waiting for its group: its id as given, its line number, the request and its prompt.
pub struct Waiting {
    pub id: Value,
    pub line: u64,
    pub req: GenRequest,
    pub prepared: Prepared,
}

/// Tokens the longest request of `input` needs (its prompt plus its `max_tokens`, else
/// `max_tokens`): the context each sequence is given when `--context` is not (capped by the
/// model's maximum, `cli::load::run_context`), so the rest of the memory budget goes to the
/// expert cache. A prompt past the maximum is not tokenised (its size says enough); lines that
/// do not parse or encode count nothing (they get their error record later). None where the
/// model's config or tokenizer cannot be read (opening the engine names why).
pub fn longest_request(dir: &Path, input: &str, ctx: &ParseContext, max_tokens: usize) -> Option<usize> {
    let most = crate::model::K3Config::load(dir).ok()?.max_context;
    let codec = PromptCodec::load(dir).ok()?;
    let need = |line: &str| -> Option<usize> {
        let v: Value = serde_json::from_str(line).ok()?;
        let req = super::api::parse_batch_line(&v, ctx).1.ok()?;
        codec.prompt_len(&req, most)?.checked_add(req.max_tokens.unwrap_or(max_tokens))
    };
    Some(input.lines().filter(|l| !l.trim().is_empty()).filter_map(need).max().unwrap_or(1))
}

/// The ids of the records in `bytes` (whole lines of a batch output), and the line numbers of
/// id-less ones: what a rerun skips.
pub fn done_records(bytes: &[u8]) -> (HashSet<String>, HashSet<u64>) {
    let mut ids = HashSet::new();
    let mut lines = HashSet::new();
    for line in bytes.split(|&b| b == b'\n') {
        let Ok(v) = serde_json::from_slice::<Value>(line) else { continue };
        match v.get("id") {
            Some(Value::String(s)) => {
                ids.insert(s.clone());
            }
            Some(Value::Number(n)) => {
                ids.insert(n.to_string());
            }
            _ => {
                if let Some(n) = v.get("line").and_then(Value::as_u64) {
                    lines.insert(n);
                }
            }
        }
    }
    (ids, lines)
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

/// What a batch's walk over its input yields: a record to write now (an error, a skipped
/// line's), or a checked request to run.
pub enum Line {
    Record(Value),
    Job(Box<Waiting>),
}

/// Why [`run_lanes`] stopped before the end.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot write a result: {0}")]
    Write(std::io::Error),
    #[error(transparent)]
    Memory(#[from] SequencesError),
}

/// Runs the requests `next` yields as a running batch of up to `parallel` lanes
/// (`Engine::drive_lanes`; see the module contract) and writes every record with `write`: a
/// line's error at once, a result as soon as its request finishes. A failed step is an error
/// record for each request it failed. A write that fails, or a request whose state cannot fit
/// the memory budget even alone, stops the run: the requests still running are cancelled and
/// not written (a rerun redoes them). Returns the counters of the whole batch (each shared
/// forward once).
pub fn run_lanes(
    generator: &mut Generator,
    parallel: usize,
    next: &mut dyn FnMut() -> Option<Line>,
    write: &mut dyn FnMut(&Value) -> std::io::Result<()>,
) -> Result<Stats, RunError> {
    let engine = std::sync::Arc::clone(generator.engine());
    let mut host = Host { generator, next, write, stopped: None };
    let stats = engine.drive_lanes(parallel, &mut host);
    host.stopped.map_or(Ok(stats), Err)
}

struct Host<'a> {
    generator: &'a mut Generator,
    next: &'a mut dyn FnMut() -> Option<Line>,
    write: &'a mut dyn FnMut(&Value) -> std::io::Result<()>,
    stopped: Option<RunError>,
}

impl Host<'_> {
    fn put(&mut self, r: &Value) {
        if self.stopped.is_none()
            && let Err(e) = (self.write)(r)
        {
            self.stopped = Some(RunError::Write(e));
        }
    }
}

impl LaneHost for Host<'_> {
    type Tag = (Waiting, LaneRequest);

    fn next(&mut self, _idle: bool) -> Option<(Self::Tag, Lane)> {
        while self.stopped.is_none() {
            let w = match (self.next)()? {
                Line::Record(r) => {
                    self.put(&r);
                    continue;
                }
                Line::Job(w) => w,
            };
            let r = match self.generator.start_lane(&w.req, w.prepared.clone(), 0.0, &mut |_| true) {
                Started::Lane(b) => {
                    let (lane, req) = *b;
                    return Some(((*w, req), lane));
                }
                Started::Answered(Ok(o)) => {
                    result_record(&w.id, w.line, &o, w.req.logprobs.is_some(), &|t| self.generator.token_text(t))
                }
                Started::Answered(Err(GenError::Request(e))) => error_record(&w.id, w.line, &e),
                Started::Answered(Err(e)) => error_record(&w.id, w.line, &failed(&e)),
            };
            self.put(&r);
        }
        None
    }

    fn token(&mut self, (_, req): &mut Self::Tag, id: u32) -> bool {
        // A stopped run cancels what still runs.
        self.stopped.is_none() && req.token(id, &mut |_| true)
    }

    fn finished(&mut self, (w, req): Self::Tag, lane: Lane) {
        let o = self.generator.finish_lane(lane, req, &mut |_| true);
        let r = result_record(&w.id, w.line, &o, w.req.logprobs.is_some(), &|t| self.generator.token_text(t));
        self.put(&r);
    }

    fn failed(&mut self, (w, _): Self::Tag, _lane: Lane, e: &LaneError) {
        match e {
            LaneError::Memory(m) => {
                self.stopped.get_or_insert(RunError::Memory(m.clone()));
            }
            e => self.put(&error_record(&w.id, w.line, &failed(e))),
        }
    }
}

fn failed(e: &dyn std::fmt::Display) -> ApiError {
    ApiError::new(500, "server_error", "generation_failed", e.to_string())
}
