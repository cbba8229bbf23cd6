//! A session: one sequence on an engine — its state, token history and counters.
//!
//! Contract: `prefill`, `step` and `score` consume tokens after `pos()`; each call either commits
//! all of its tokens or, when it fails (e.g. an expert read error in layer 40), leaves the session
//! exactly as it was. `verify` runs rows without committing them and `commit(j)` keeps the first j
//! (bit-identical to feeding those j tokens one by one). `truncate(pos)` goes back to an earlier
//! position (by recomputing the prefix: KDA state cannot be run backwards). A front end may watch
//! a long `prefill` / `score` ([`Session::watch_prefill`]: called after every MoE layer of every
//! chunk) and stop it there; a stopped prefill fails with `ForwardError::Cancelled`, all or
//! nothing like any other failure.

use super::Engine;
use crate::forward::{LogitRows, RowsOut, SeqRows};
use crate::k3::ForwardError;
use crate::k3::state::SeqState;
use crate::stats::Stats;
use std::sync::Arc;
use std::time::Instant;

pub struct Session {
    engine: Arc<Engine>,
    state: SeqState,
    tokens: Vec<u32>,
    /// Logits after the last committed token (None before the first forward).
    last_logits: Option<Vec<f32>>,
    /// Tokens of a pending verification, with their logits.
    verifying: Option<(Vec<u32>, Vec<f32>)>,
    pub stats: Stats,
    /// The prefill's watcher ([`Session::watch_prefill`]).
    pub(super) watcher: Option<Box<PrefillWatcher>>,
}

/// A prefill's watcher: told where the prefill is; returning false stops it.
pub type PrefillWatcher = dyn FnMut(&PrefillProgress) -> bool + Send;

/// Where a prefill (or `score`) is, after one MoE layer of one chunk.
#[derive(Clone, Copy, Debug)]
pub struct PrefillProgress {
    /// Tokens of the call's chunks already committed.
    pub tokens_done: usize,
    /// Tokens of the chunk running.
    pub chunk: usize,
    /// Tokens of the whole call.
    pub tokens: usize,
    /// MoE layers of the running chunk done, of `layers`.
    pub layers_done: usize,
    pub layers: usize,
    /// Routed expert bytes the call asked the expert source for so far.
    pub expert_bytes: u64,
}

impl PrefillProgress {
    /// Tokens' worth of work done: finished chunks plus the running chunk's share of its layers.
    pub fn tokens_equivalent(&self) -> f64 {
        self.tokens_done as f64 + self.chunk as f64 * self.layers_done as f64 / self.layers.max(1) as f64
    }
}

/// A session's committed sequence as it was (see [`Session::checkpoint`]).
pub(super) struct Checkpoint {
    state: SeqState,
    tokens: usize,
    logits: Option<Vec<f32>>,
}

/// Options of [`Session::generate`].
#[derive(Clone, Debug, Default)]
pub struct GenerateOptions {
    /// Tokens to produce at most.
    pub max_new: usize,
    /// Generation ends after emitting one of these.
    pub stop: Vec<u32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// A stop token was emitted.
    Stop,
    /// `max_new` tokens were produced.
    Length,
    /// The callback asked to stop.
    Cancelled,
}

/// What [`Session::generate`] produced.
#[derive(Clone, Debug)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub reason: StopReason,
}

impl Session {
    pub(super) fn new(engine: Arc<Engine>) -> Self {
        let mut state = engine.model.new_state();
        // The context reserved for a sequence is its cap: the forward refuses rows past it.
        state.cap = engine.plan.context_bound;
        let mut stats = Stats::default();
        stats.trunk = Some((engine.trunk.name(), engine.trunk.exact()));
        Session { engine, state, tokens: Vec::new(), last_logits: None, verifying: None, stats, watcher: None }
    }

    /// Keeps the per-layer-pass traces in this session's `stats` from now on (`Stats::traces`: every
    /// MoE layer pass's expert union, fetch time and rows), or drops them. Off by default: they grow
    /// with every token run, and only benchmarks that replay or time them ask for them. A fork
    /// keeps them as this session does.
    pub fn keep_traces(&mut self, on: bool) {
        self.stats.keep_traces(on);
    }

    /// Calls `w` after every MoE layer of every chunk of the next prefills and scores (progress
    /// displays); `w` returning false stops the call with `ForwardError::Cancelled`, the session
    /// as before it. None removes the watcher.
    pub fn watch_prefill(&mut self, w: Option<Box<PrefillWatcher>>) {
        self.watcher = w;
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// Tokens committed so far.
    pub fn pos(&self) -> usize {
        self.state.pos
    }

    /// The committed tokens.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Logits after the last committed token.
    pub fn logits(&self) -> Option<&[f32]> {
        self.last_logits.as_deref()
    }

    /// The committed sequence — state, tokens, logits — for the state file (`state_file.rs`).
    pub(super) fn saved_parts(&self) -> (&SeqState, &[u32], Option<&[f32]>) {
        (&self.state, &self.tokens, self.last_logits.as_deref())
    }

    /// A session continuing a sequence read back from a state file (`state_file.rs`).
    pub(super) fn from_saved(engine: Arc<Engine>, state: SeqState, tokens: Vec<u32>, logits: Option<Vec<f32>>) -> Self {
        let mut s = Session::new(engine);
        (s.state, s.tokens, s.last_logits) = (state, tokens, logits);
        s
    }

    pub(super) fn state_mut(&mut self) -> &mut SeqState {
        self.verifying = None;
        &mut self.state
    }

    /// A copy of the committed sequence (state, token count, logits) to come back to with
    /// [`Session::restore`] when a later step of a multi-pass forward fails.
    pub(super) fn checkpoint(&self) -> Result<Checkpoint, ForwardError> {
        Ok(Checkpoint { state: self.state.try_clone()?, tokens: self.tokens.len(), logits: self.last_logits.clone() })
    }

    /// Goes back to a [`Session::checkpoint`] of this session.
    pub(super) fn restore(&mut self, c: Checkpoint) {
        self.state = c.state;
        self.tokens.truncate(c.tokens);
        self.last_logits = c.logits;
        self.verifying = None;
    }

    /// Keeps the first `j` of the rows of `tokens` that a shared forward left pending (the rest
    /// roll back), with `logits` after the last kept row. All or nothing, as `commit`.
    pub(super) fn commit_rows(&mut self, tokens: &[u32], j: usize, logits: Vec<f32>) -> Result<(), ForwardError> {
        self.state.commit(&*self.engine.model.be, &self.engine.cfg, j)?;
        self.tokens.extend_from_slice(&tokens[..j]);
        self.last_logits = Some(logits);
        Ok(())
    }

    /// Runs `tokens` with logits for every row and the hidden rows after `taps`, without
    /// committing them; `commit(j)` keeps the first j. Any other call drops the verification.
    pub fn verify(&mut self, tokens: &[u32], taps: &[usize]) -> Result<RowsOut, ForwardError> {
        let e = Arc::clone(&self.engine);
        self.verifying = None;
        let t0 = Instant::now();
        let mut stats = Stats::traced(self.stats.keeps_traces());
        let ran = {
            let mut batch = [SeqRows { state: &mut self.state, tokens, logits: LogitRows::All, taps }];
            e.forward_rows(&mut batch, &mut stats, &mut |_, _, _| true)
        };
        self.stats.merge(&stats);
        let out = ran?.into_iter().next().unwrap_or_default();
        self.verifying = Some((tokens.to_vec(), out.logits.clone()));
        self.stats.drafts.verify_s += t0.elapsed().as_secs_f64();
        Ok(out)
    }

    /// Commits the first `j` rows of the pending verification. If it fails (a replay the backend
    /// could not run), the verification is dropped and the session is as before it.
    pub fn commit(&mut self, j: usize) -> Result<(), ForwardError> {
        let have = self.state.pending_rows();
        let Some((tokens, logits)) = self.verifying.take().filter(|_| j <= have) else {
            return Err(ForwardError::NothingPending { want: j, have });
        };
        self.state.commit(&*self.engine.model.be, &self.engine.cfg, j)?;
        self.tokens.extend_from_slice(&tokens[..j]);
        let v = self.engine.cfg.vocab;
        if j > 0 {
            self.last_logits = Some(logits[(j - 1) * v..j * v].to_vec());
        }
        Ok(())
    }

    /// An independent copy of this sequence (state, tokens, logits) with fresh counters (keeping
    /// the per-layer traces when this session does): what a server keeps to resume a conversation from, or a test branches from. Fails only when a
    /// state kept in device memory cannot be read back.
    pub fn fork(&self) -> Result<Session, ForwardError> {
        Ok(Session {
            engine: Arc::clone(&self.engine),
            state: self.state.try_clone()?,
            tokens: self.tokens.clone(),
            last_logits: self.last_logits.clone(),
            verifying: None,
            stats: Stats::traced(self.stats.keeps_traces()),
            watcher: None,
        })
    }

    /// Goes back to position `pos` (<= `pos()`): the state is recomputed from the first `pos`
    /// tokens (bit-identical to having stopped there). On failure the session is unchanged.
    pub fn truncate(&mut self, pos: usize) -> Result<(), ForwardError> {
        if pos >= self.pos() {
            return Ok(());
        }
        self.verifying = None;
        self.state.rollback();
        let keep = self.tokens[..pos].to_vec();
        let mut fresh = Session::new(Arc::clone(&self.engine));
        fresh.keep_traces(self.stats.keeps_traces());
        if !keep.is_empty() {
            fresh.prefill(&keep)?;
        }
        // The recompute's work is this session's work too.
        let mut stats = std::mem::take(&mut self.stats);
        stats.merge(&fresh.stats);
        fresh.stats = stats;
        *self = fresh;
        Ok(())
    }

    /// The clock and counters a generation's decode figures start from.
    pub(super) fn decode_start(&self) -> (Instant, u64) {
        (Instant::now(), self.stats.reads.expert_bytes_requested)
    }

    /// Adds a finished generation of `emitted` tokens to the decode counters.
    pub(super) fn decode_end(&mut self, (t0, bytes0): (Instant, u64), emitted: usize) {
        self.stats.decode_s += t0.elapsed().as_secs_f64();
        self.stats.generated_tokens += emitted as u64;
        self.stats.decode_expert_bytes += self.stats.reads.expert_bytes_requested - bytes0;
    }
}
