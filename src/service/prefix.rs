//! A prompt prefix that a batch's requests share, prefilled once and forked for each request
//! (`deltafin batch`, also with `--parallel`).
//!
//! Contract: [`shared_prefix`] is the longest common prefix of the token ids of an input's
//! requests, cut so that every request keeps at least one token of its own; empty where fewer
//! than two requests share at least [`MIN_SHARED`] tokens. [`Generator::share_prefix`] prefills
//! it once on a session the generator keeps; from then on a request whose prompt starts with it —
//! run alone (`Generator::generate_prepared`) or as a lane of a running batch
//! (`Generator::start_lane`) — starts from a fork of that session (`Session::fork`) and prefills
//! only its own tokens. Answers are bit-identical to those without sharing (a prefill split
//! anywhere commits exactly as one prefill does, and a fork copies the state); each request
//! reports the prefix as its `cached_tokens`, and the prefix's own prefill counters are what
//! [`Generator::share_prefix`] returns (counted once). A generator whose drafter reads K3's
//! hidden rows (DSpark) prefills every prompt whole: the drafter must see every prompt row.

use super::generator::{GenError, Generator, PromptCodec, Reads};
use crate::api::{ParseContext, parse_batch_line};
use crate::engine::{PrefillWatcher, Session};
use crate::stats::Stats;
use serde_json::Value;
use std::path::Path;

/// A shorter common prefix is not shared: it would save little prefill and cost a kept sequence
/// state and a fork per request.
pub const MIN_SHARED: usize = 32;

/// The prefix the requests of `lines` share (see the module contract), `done` telling the ids
/// that will not run (an earlier run's). Lines that do not parse or encode do not count (their
/// error comes when they run); nothing where the model's config or tokenizer cannot be read.
pub fn shared_prefix(dir: &Path, lines: &[&str], ctx: &ParseContext, done: &dyn Fn(&str) -> bool) -> Vec<u32> {
    let (Ok(cfg), Ok(codec)) = (crate::model::K3Config::load(dir), PromptCodec::load(dir)) else {
        return Vec::new();
    };
    let mut prefix: Option<Vec<u32>> = None;
    let (mut requests, mut shortest) = (0usize, usize::MAX);
    for line in lines.iter().filter(|l| !l.trim().is_empty()) {
        let Ok(v) = serde_json::from_str::<Value>(line) else { continue };
        let (Some(id), Ok(req)) = parse_batch_line(&v, ctx) else { continue };
        if done(&id) {
            continue;
        }
        let Some(ids) = codec.prompt_ids(&req, cfg.max_context) else { continue };
        requests += 1;
        shortest = shortest.min(ids.len());
        let p = prefix.get_or_insert(ids.clone());
        let common = p.iter().zip(&ids).take_while(|(a, b)| a == b).count();
        p.truncate(common);
        if p.len() < MIN_SHARED {
            return Vec::new();
        }
    }
    let mut p = prefix.unwrap_or_default();
    // Ids given past the vocabulary are their requests' errors, not the prefix's.
    p.truncate(p.iter().position(|&t| t as usize >= cfg.vocab).unwrap_or(p.len()));
    // Each request keeps a token of its own: a lane starts by feeding its prompt.
    p.truncate(shortest.saturating_sub(1));
    if requests < 2 || p.len() < MIN_SHARED {
        return Vec::new();
    }
    p
}

impl Generator {
    /// Prefills `prefix` once and keeps it for the requests that start with it (see the module
    /// contract); `watcher` follows the prefill. Returns its counters, with the expert bytes it
    /// read (`expert_bytes_read`).
    pub fn share_prefix(&mut self, prefix: &[u32], watcher: Option<Box<PrefillWatcher>>) -> Result<Stats, GenError> {
        self.shared = None;
        let mut s = self.engine.new_session();
        s.watch_prefill(watcher);
        let src0 = self.engine.source_report();
        let prefilled = s.prefill(prefix).map(|_| ());
        s.watch_prefill(None);
        prefilled?;
        let mut st = std::mem::take(&mut s.stats);
        st.reads.expert_bytes_read = Reads::between(&src0, &self.engine.source_report()).bytes_read;
        self.shared = Some(s);
        Ok(st)
    }

    /// Tokens of the shared prefix that `prompt` starts with and goes past (0: none).
    pub(super) fn shared_len(&self, prompt: &[u32]) -> usize {
        self.shared
            .as_ref()
            .filter(|s| s.pos() < prompt.len() && prompt.starts_with(s.tokens()))
            .map_or(0, Session::pos)
    }

    /// A fork of the shared prefix's session; None where forking fails (the request then
    /// prefills its whole prompt).
    pub(super) fn fork_shared(&self) -> Option<Session> {
        match self.shared.as_ref()?.fork() {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!("cannot fork the shared prefix ({e}); the request prefills its whole prompt");
                None
            }
        }
    }
}
