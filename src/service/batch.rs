//! The records of a batch run (`deltafin batch`): one JSON object per input line, a result or an
//! error, and running a group of lines together.
//!
//! Contract: a result record is `{"id", "line", "text", "finish_reason", "usage", "deltafin"}`
//! plus `reasoning_content` and `logprobs` when there are any; an error record is `{"id", "line",
//! "error"}` in OpenAI's error shape. [`run_lanes`] runs checked requests as a running batch
//! (`Engine::run_continuous`, each request a lane: `Generator::start_lane`): when one finishes its
//! record is written and the next request joins at the next step, its prompt's rows in the same
//! forward as the running ones' decode rows; records come in the order requests finish.
//! [`walk_line`] is what becomes of each input line (skipped when the output holds it, a record,
//! or a checked request); [`longest_request`] is the context the longest line of an input needs;
//! [`input_lines`] an input's lines (a line that is not UTF-8 is that line's error, not the
//! batch's); [`read_output`] what an output already holds, and whether a file is a batch output
//! at all (a run appends only to its own kind of file).

use super::generator::{Encoder, GenError, Generator, Prepared, PromptCodec};
use super::parallel::{LaneRequest, Started};
use crate::api::{ApiError, GenRequest, Output, ParseContext};
use crate::engine::{Lane, LaneError, LaneHost};
use crate::memory::SequencesError;
use crate::stats::Stats;
use serde_json::{Value, json};
use std::collections::{HashMap, HashSet};
use std::path::Path;

/// A line waiting for its group: its id as given, its line number, the request and its prompt.
pub struct Waiting {
    pub id: Value,
    pub line: u64,
    pub req: GenRequest,
    pub prepared: Prepared,
}

/// Tokens the longest request of `lines` needs (its prompt plus its `max_tokens`, else
/// `max_tokens`): the context each sequence is given when `--context` is not (capped by the
/// model's maximum, `cli::load::run_context`), so the rest of the memory budget goes to the
/// expert cache. A prompt past the maximum is not tokenised (its size says enough); lines that
/// do not parse or encode count nothing (they get their error record later). None where the
/// model's config or tokenizer cannot be read (opening the engine names why).
pub fn longest_request(dir: &Path, lines: &[&str], ctx: &ParseContext, max_tokens: usize) -> Option<usize> {
    let most = crate::model::K3Config::load(dir).ok()?.max_context;
    let codec = PromptCodec::load(dir).ok()?;
    let need = |line: &str| -> Option<usize> {
        let v: Value = serde_json::from_str(line).ok()?;
        let req = crate::api::parse_batch_line(&v, ctx).1.ok()?;
        codec.prompt_len(&req, most)?.checked_add(req.max_tokens.unwrap_or(max_tokens))
    };
    Some(lines.iter().filter(|l| !l.trim().is_empty()).filter_map(|l| need(l)).max().unwrap_or(1))
}

/// The lines of a batch input, numbered from 1: each one's text, or (Err) the offset in the line
/// where its bytes stop being UTF-8, so one bad line is that line's error record, not the whole
/// batch's. A `\r` before the newline is dropped, as `str::lines` does.
pub fn input_lines(bytes: &[u8]) -> Vec<(u64, Result<&str, usize>)> {
    let body = bytes.strip_suffix(b"\n").unwrap_or(bytes);
    if body.is_empty() {
        return Vec::new();
    }
    body.split(|&b| b == b'\n')
        .enumerate()
        .map(|(i, l)| {
            let l = l.strip_suffix(b"\r").unwrap_or(l);
            (i as u64 + 1, std::str::from_utf8(l).map_err(|e| e.valid_up_to()))
        })
        .collect()
}

/// What a batch output already holds: the ids of its records and the line numbers of id-less
/// ones (what a rerun skips), each with whether the record is an error.
#[derive(Debug, Default)]
pub struct Done {
    pub ids: HashMap<String, bool>,
    pub lines: HashMap<u64, bool>,
}

/// Why an existing file is not a batch output (so a run must not append to it or cut it).
#[derive(Debug, thiserror::Error)]
#[error("line {line} is {why}")]
pub struct NotAnOutput {
    pub line: u64,
    pub why: String,
}

/// Reads an existing batch output: every whole line must be a record (a JSON object with an
/// `id`, a numeric `line`, and `text` or `error`: what [`result_record`] and [`error_record`]
/// write; blank lines pass), else the file is someone else's and `Err` names the first line that
/// is not. A last line without its newline is a write of ours a kill tore when it starts as a
/// record does (`{"id":`); its length is returned so the caller cuts it (its request is redone).
/// Returns what is done and the bytes of the torn line (0 if none).
pub fn read_output(bytes: &[u8]) -> Result<(Done, usize), NotAnOutput> {
    let whole = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    let mut done = Done::default();
    let mut n = 0u64;
    for line in bytes[..whole].split_inclusive(|&b| b == b'\n') {
        n += 1;
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let bad = |why: &str| NotAnOutput { line: n, why: why.to_string() };
        let v: Value = serde_json::from_slice(line).map_err(|_| bad("not JSON"))?;
        let Value::Object(m) = &v else { return Err(bad("not a JSON object")) };
        let is_error = m.contains_key("error");
        if !m.contains_key("id") || !m.get("line").is_some_and(Value::is_u64) || !(is_error || m.contains_key("text")) {
            return Err(bad("not a result record (expected `id`, `line` and `text` or `error`)"));
        }
        match &m["id"] {
            Value::String(s) => {
                done.ids.insert(s.clone(), is_error);
            }
            Value::Number(x) => {
                done.ids.insert(x.to_string(), is_error);
            }
            _ => {
                done.lines.insert(m["line"].as_u64().unwrap_or(0), is_error);
            }
        }
    }
    let torn = &bytes[whole..];
    // Records are written compact, their id first: a torn one begins with (part of) this.
    let head = &torn[..torn.len().min(6)];
    if !br#"{"id":"#.starts_with(head) {
        return Err(NotAnOutput { line: n + 1, why: "not a result record (and has no newline)".into() });
    }
    Ok((done, torn.len()))
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
        "usage": crate::api::response::usage(out),
        "deltafin": out.ext,
    });
    if !out.reasoning.is_empty() {
        r["reasoning_content"] = json!(out.reasoning);
    }
    if !out.tool_calls.is_empty() {
        r["tool_calls"] = out
            .tool_calls
            .iter()
            .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
            .collect();
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

/// What a batch does with one input line ([`walk_line`]).
pub enum Step {
    /// The output holds it already (true: as an error record): skipped.
    Skip(bool),
    /// Its record now, or its request to run.
    Take(Line),
}

/// Line `n` of a batch's input (its text, or where its bytes stop being UTF-8), for a run whose
/// output already holds `done`: skipped (its id, or for a line without one its number, is
/// done), an error record (not JSON, not UTF-8, a bad field, no id, an id `seen` before, a prompt
/// that does not encode), or a checked request (`max_tokens` when the line sets none).
pub fn walk_line(
    n: u64,
    line: Result<&str, usize>,
    done: &Done,
    seen: &mut HashSet<String>,
    ctx: &ParseContext,
    enc: &Encoder,
    max_tokens: usize,
) -> Step {
    let parsed = match line {
        Ok(l) => serde_json::from_str::<Value>(l).map_err(|e| format!("line {n} is not JSON: {e}")),
        Err(at) => Err(format!("line {n} is not UTF-8 text (invalid bytes at byte {} of the line)", at + 1)),
    };
    let v = match parsed {
        Err(_) if done.lines.contains_key(&n) => return Step::Skip(done.lines[&n]),
        Err(e) => {
            let code = if line.is_ok() { "invalid_json" } else { "invalid_utf8" };
            let e = ApiError::new(400, "invalid_request_error", code, e);
            return Step::Take(Line::Record(error_record(&Value::Null, n, &e)));
        }
        Ok(v) => v,
    };
    let (id, req) = crate::api::parse_batch_line(&v, ctx);
    // Records carry the id as given (a string or a number).
    let id_val = v.get("id").filter(|_| id.is_some()).cloned().unwrap_or(Value::Null);
    let record = match (&id, req) {
        (Some(id), _) if done.ids.contains_key(id) => return Step::Skip(done.ids[id]),
        (None, _) if done.lines.contains_key(&n) => return Step::Skip(done.lines[&n]),
        (_, Err(e)) => error_record(&id_val, n, &e),
        (Some(id), Ok(_)) if !seen.insert(id.clone()) => {
            error_record(&id_val, n, &ApiError::invalid("id", format!("id {id} appears twice in the input")))
        }
        (Some(_), Ok(mut req)) => {
            req.max_tokens = req.max_tokens.or(Some(max_tokens));
            match enc.prepare(&req) {
                Ok(p) => return Step::Take(Line::Job(Box::new(Waiting { id: id_val, line: n, req, prepared: p }))),
                Err(e) => error_record(&id_val, n, &e),
            }
        }
        (None, Ok(_)) => error_record(&Value::Null, n, &ApiError::invalid("id", "the line has no id")),
    };
    Step::Take(Line::Record(record))
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
/// (`Engine::run_continuous`; see the module contract) and writes every record with `write`: a
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
    let stats = engine.run_continuous(parallel, &mut host);
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
        // A stopped run cancels what still runs; so does a cancel request (Ctrl-C): the answer
        // then ends "cancelled", which the batch does not record as done.
        self.stopped.is_none() && req.token(id, &mut |_| !crate::util::cancel_requested())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_are_told_from_other_files_and_torn_lines_are_ours() {
        let rec = br#"{"id":"a","line":1,"text":"t"}"#;
        let mut ours = rec.to_vec();
        ours.extend_from_slice(b"\n{\"id\":null,\"line\":2,\"error\":{}}\n");
        let (done, torn) = read_output(&ours).unwrap();
        assert_eq!((done.ids.get("a"), done.lines.get(&2), torn), (Some(&false), Some(&true), 0));
        ours.extend_from_slice(br#"{"id":"b","li"#);
        assert_eq!(read_output(&ours).unwrap().1, 13, "a torn record of ours is cut");
        assert_eq!(read_output(b"{\"i").unwrap().1, 3);
        assert_eq!(read_output(b"").unwrap().1, 0);
        for (other, line) in [(&b"notes\n"[..], 1), (b"{\"id\":\"a\"}\n", 1), (b"[1]\n", 1), (b"hello", 1)] {
            assert_eq!(read_output(other).unwrap_err().line, line, "{}", String::from_utf8_lossy(other));
        }
        let mut tail = rec.to_vec();
        tail.extend_from_slice(b"\nsomething else");
        assert_eq!(read_output(&tail).unwrap_err().line, 2);
    }

    #[test]
    fn input_lines_number_every_line_and_mark_the_ones_that_are_not_utf8() {
        let lines = input_lines(b"a\r\n\n\xff b\nc\n");
        assert_eq!(lines, vec![(1, Ok("a")), (2, Ok("")), (3, Err(0)), (4, Ok("c"))]);
        assert!(input_lines(b"").is_empty());
        assert_eq!(input_lines(b"x"), vec![(1, Ok("x"))]);
    }
}
