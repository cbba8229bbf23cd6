//! A lane: one sequence's part in the step core (`step.rs`) — what it feeds next, how it picks,
//! and how it keeps its rows of a step: the accept/commit rule, written once.
//!
//! Contract: a lane is a session, its sampler, (optionally) its [`Speculator`] and its [`Track`]
//! (the prompt still to feed, the tokens emitted, why it stopped). Before a step a lane that has
//! fed its prompt picks its next token with its own sampler ([`Seq::next_token`]: K3's pick at
//! a rejected draft's row when the last verify drew one), emits it (`on_token`; false cancels the
//! lane after it) and, unless it stopped, feeds it — alone, or followed by its drafter's proposals
//! ([`Seq::propose`]) as a verify block of k+1 rows. A lane still feeding its prompt feeds its
//! next chunk. After the forward it keeps its own rows ([`Seq::settle`]): a prompt chunk or a
//! single row all of them; a verify block the longest prefix of drafts equal to K3's picks (drawn
//! by its sampler row by row, so a sampling lane emits the tokens of plain sampling with the same
//! seed), emitted exactly as plain decoding would — an end among them keeps only the rows plain
//! decoding would have fed — and the rest roll back (`Session::commit_rows`). A drafter that taps
//! K3's hidden rows sees every committed row. Emitting ends a lane at a stop token, at `max_new`
//! tokens or when `on_token` says so ([`emit`], the one rule).
//!
//! [`Lane`] owns its parts, for front ends that keep sequences running over many steps
//! (continuous batching); the `Session` and `Engine` methods of `run.rs` lend theirs for a call.

use crate::backend::Backend;
use crate::draft::Speculator;
use crate::engine::{GenerateOptions, Generation, Session, StopReason};
use crate::forward::{LogitRows, RowsOut};
use crate::k3::ForwardError;
use crate::sample::{History, Sampler};
use crate::stats::Stats;
use std::time::Instant;

/// What a lane's prompt rows are for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PromptUse {
    /// A prompt: counted (prompt tokens, prefill time) and watched (`Session::watch_prefill`);
    /// the last row's logits kept.
    Prefill,
    /// Text scored: every row's logits kept ([`Track::take_scored`]); watched, not a prompt.
    Score,
    /// Tokens fed as they are (`Session::step`): neither counted nor watched.
    Feed,
}

/// Where the counters of the forwards a lane takes part in go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Counting {
    /// Into its session's `stats` (each shared forward's counters to every session in it): a
    /// `Session` or `Engine` call.
    Own,
    /// Into the lane's `shared` counters (its session's `stats` keep only what is its own):
    /// continuous batching, where a request's own figures and the batch's are told apart.
    Shared,
}

/// A lane's progress: the prompt still to feed, the tokens emitted, why it stopped.
pub(crate) struct Track {
    prompt: Vec<u32>,
    fed: usize,
    prompt_use: PromptUse,
    opts: GenerateOptions,
    /// Tokens the session held before the prompt.
    base: usize,
    tokens: Vec<u32>,
    /// K3's pick at a rejected draft's row: the next token, already drawn.
    picked: Option<u32>,
    reason: Option<StopReason>,
    started: Instant,
    decode: Option<(Instant, u64)>,
    /// The most sequences that shared a forward with this one (itself included).
    pub(super) peak_batch: usize,
    /// Counters of the forwards it took part in (with [`Counting::Shared`]).
    pub(super) shared: Stats,
    pub(super) counting: Counting,
    /// Every prompt row's logits ([`PromptUse::Score`]).
    scored: Vec<f32>,
    /// Expert bytes its prompt's finished forwards asked for (a watcher's progress).
    pub(super) prompt_bytes: u64,
}

impl Track {
    /// A lane on `session` that feeds `prompt` (a fresh session, or one whose committed tokens
    /// precede it) as `prompt_use` says, then generates with `opts` (`max_new` 0: none). An empty
    /// prompt generates from the session's logits.
    pub(crate) fn new(
        session: &Session,
        prompt: Vec<u32>,
        prompt_use: PromptUse,
        opts: GenerateOptions,
        counting: Counting,
    ) -> Result<Track, ForwardError> {
        let decode = match prompt.is_empty() {
            true if session.logits().is_none() => return Err(ForwardError::Empty),
            true => Some(session.decode_start()),
            false => None,
        };
        Ok(Track {
            prompt,
            fed: 0,
            prompt_use,
            base: session.pos(),
            tokens: Vec::with_capacity(opts.max_new),
            opts,
            picked: None,
            reason: None,
            started: Instant::now(),
            decode,
            peak_batch: 0,
            shared: Stats::default(),
            counting,
            scored: Vec::new(),
            prompt_bytes: 0,
        })
    }

    pub(crate) fn done(&self) -> bool {
        self.reason.is_some()
    }

    pub(crate) fn prefilled(&self) -> bool {
        self.fed == self.prompt.len()
    }

    /// Prompt rows not fed yet.
    pub(super) fn prompt_left(&self) -> usize {
        self.prompt.len() - self.fed
    }

    /// The next `n` prompt rows.
    pub(super) fn prompt_rows(&self, n: usize) -> &[u32] {
        &self.prompt[self.fed..self.fed + n]
    }

    /// Which logits its prompt rows need.
    pub(super) fn prompt_logits(&self) -> LogitRows {
        if self.prompt_use == PromptUse::Score { LogitRows::All } else { LogitRows::Last }
    }

    /// Whether a watcher follows its prompt, and where the prompt is: (fed, total).
    pub(super) fn watched(&self) -> Option<(usize, usize)> {
        (self.prompt_use != PromptUse::Feed).then_some((self.fed, self.prompt.len()))
    }

    pub(crate) fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub(crate) fn generation(&self) -> Generation {
        Generation { tokens: self.tokens.clone(), reason: self.reason.unwrap_or(StopReason::Length) }
    }

    pub(crate) fn take_scored(&mut self) -> Vec<f32> {
        std::mem::take(&mut self.scored)
    }

    /// Prompt tokens plus the most it may generate: the length its state is budgeted for.
    pub(crate) fn budget_len(&self) -> usize {
        self.base + self.prompt.len() + self.opts.max_new
    }
}

/// A lane's parts lent to a step.
pub(crate) struct Seq<'a> {
    pub session: &'a mut Session,
    pub sampler: &'a mut Sampler,
    pub drafts: Option<&'a mut Speculator>,
    pub track: &'a mut Track,
}

/// What a lane feeds in a step.
pub(super) enum Feed {
    /// Its next `n` prompt rows.
    Prompt(usize),
    /// Its pending token and drafts, drafting having taken `draft_s`.
    Decode { rows: Vec<u32>, draft_s: f64 },
}

impl Seq<'_> {
    fn finish(&mut self, r: StopReason) {
        if let Some(d) = self.track.decode.take() {
            self.session.decode_end(d, self.track.tokens.len());
        }
        self.track.reason = Some(r);
    }

    /// Picks and emits its next token; Some(token) when it is to be fed.
    pub(super) fn next_token(
        &mut self,
        be: &dyn Backend,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Option<u32>, ForwardError> {
        let t = &mut *self.track;
        if t.tokens.len() >= t.opts.max_new {
            self.finish(StopReason::Length);
            return Ok(None);
        }
        let next = match t.picked.take() {
            Some(x) => x,
            None => {
                // Every token emitted so far is committed: the context is the session's.
                let h = History { committed: self.session.tokens(), pending: &[], generated: t.tokens.len() };
                self.sampler.pick_on(be, self.session.logits().ok_or(ForwardError::Empty)?, h)?
            }
        };
        match emit(&mut t.tokens, next, &t.opts, on_token) {
            Some(r) => {
                self.finish(r);
                Ok(None)
            }
            None => Ok(Some(next)),
        }
    }

    /// Its drafter's proposals after `next`, at most `room` (and never past `max_new`), `others`
    /// rows of other lanes being in the step (the policy may choose a single step: none).
    pub(super) fn propose(&mut self, next: u32, room: usize, others: usize) -> Result<Vec<u32>, ForwardError> {
        let Some(d) = self.drafts.as_deref_mut() else { return Ok(Vec::new()) };
        // Accepting all k drafts emits k + 1 tokens: stay within max_new.
        let left = self.track.opts.max_new - self.track.tokens.len() - 1;
        let mut ctx = Vec::with_capacity(self.session.pos() + 1);
        ctx.extend_from_slice(self.session.tokens());
        ctx.push(next);
        let sampled = !self.sampler.position().0.is_greedy();
        let (drafts, k) = d.draft(&ctx, others, left.min(room), sampled)?;
        self.session.stats.record_width(k);
        let (forwards, rows) = d.take_counters();
        self.session.stats.drafts.drafter_forwards += forwards;
        self.session.stats.drafts.drafter_rows += rows;
        Ok(drafts)
    }

    /// Keeps its rows of a step's forward (see the module contract); `step` is the step's
    /// (seconds, lanes that fed rows).
    pub(super) fn settle(
        &mut self,
        be: &dyn Backend,
        vocab: usize,
        feed: Feed,
        out: RowsOut,
        (secs, lanes): (f64, usize),
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<(), ForwardError> {
        let start = self.session.pos();
        match feed {
            Feed::Prompt(n) => {
                let t = &mut *self.track;
                let last = out.logits[out.logits.len().saturating_sub(vocab)..].to_vec();
                self.session.commit_rows(&t.prompt[t.fed..t.fed + n], n, last)?;
                if t.prompt_use == PromptUse::Score {
                    t.scored.extend_from_slice(&out.logits);
                }
                t.fed += n;
                if let Some(d) = self.drafts.as_deref_mut() {
                    d.observe(start, &out, n)?;
                    let (forwards, rows) = d.take_counters();
                    self.session.stats.drafts.drafter_forwards += forwards;
                    self.session.stats.drafts.drafter_rows += rows;
                }
                if self.track.prefilled() {
                    self.prefilled();
                }
            }
            Feed::Decode { rows, draft_s } if rows.len() == 1 => {
                self.session.commit_rows(&rows, 1, out.logits.clone())?;
                if let Some(d) = self.drafts.as_deref_mut() {
                    d.observe(start, &out, 1)?;
                    d.stepped(lanes, secs, draft_s);
                    let (forwards, rows) = d.take_counters();
                    self.session.stats.drafts.drafter_forwards += forwards;
                    self.session.stats.drafts.drafter_rows += rows;
                }
            }
            Feed::Decode { rows, draft_s } => {
                let drafts = &rows[1..];
                let t = &mut *self.track;
                // K3's pick after row i is the check of draft i (row i + 1), with what plain
                // decoding would have had before it: the committed tokens, then rows 0..=i (row 0
                // was emitted already; rows 1..=i are the drafts accepted so far).
                let mut accepted = 0;
                for (i, &d) in drafts.iter().enumerate() {
                    let h = History {
                        committed: self.session.tokens(),
                        pending: &rows[..=i],
                        generated: t.tokens.len() + i,
                    };
                    let x = self.sampler.pick_on(be, &out.logits[i * vocab..(i + 1) * vocab], h)?;
                    if x != d {
                        t.picked = Some(x);
                        break;
                    }
                    accepted += 1;
                }
                self.session.stats.record_drafts(drafts.len(), accepted);
                if let Some(name) = self.drafts.as_deref().and_then(Speculator::drafted_by) {
                    self.session.stats.record_drafter(name, drafts.len(), accepted);
                }
                self.session.stats.drafts.verify_s += secs;
                // Emit the accepted drafts exactly as plain decoding would; an end among them
                // keeps only the rows it would have fed (the ending token itself is not fed).
                let mut keep = 1 + accepted;
                let mut ended = None;
                for (i, &d) in drafts[..accepted].iter().enumerate() {
                    ended = emit(&mut t.tokens, d, &t.opts, on_token);
                    if ended.is_some() {
                        keep = 1 + i;
                        break;
                    }
                }
                let last = out.logits[(keep - 1) * vocab..keep * vocab].to_vec();
                self.session.commit_rows(&rows, keep, last)?;
                if let Some(d) = self.drafts.as_deref_mut() {
                    d.observe(start, &out, keep)?;
                    d.verified(drafts.len(), accepted, lanes, secs, draft_s);
                    let (forwards, rows) = d.take_counters();
                    self.session.stats.drafts.drafter_forwards += forwards;
                    self.session.stats.drafts.drafter_rows += rows;
                }
                if let Some(r) = ended {
                    self.track.picked = None;
                    self.finish(r);
                }
            }
        }
        Ok(())
    }

    /// Its whole prompt is fed: counted, then it decodes (or, asked for no tokens, stops).
    fn prefilled(&mut self) {
        let t = &mut *self.track;
        if t.prompt_use == PromptUse::Prefill {
            self.session.stats.prompt_tokens += t.prompt.len() as u64;
            self.session.stats.prefill_s += t.started.elapsed().as_secs_f64();
        }
        if t.opts.max_new == 0 {
            t.reason = Some(StopReason::Length);
        } else {
            t.decode = Some(self.session.decode_start());
        }
    }
}

/// Emits `token` into `out` and says whether generation ends with it — cancelled by `on_token`,
/// a stop token, or `max_new` reached: the one rule of every lane, drafting or not.
fn emit(
    out: &mut Vec<u32>,
    token: u32,
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Option<StopReason> {
    out.push(token);
    if !on_token(token) {
        Some(StopReason::Cancelled)
    } else if opts.stop.contains(&token) {
        Some(StopReason::Stop)
    } else if out.len() >= opts.max_new {
        Some(StopReason::Length)
    } else {
        None
    }
}

/// One sequence of a running batch: a [`Track`] with its parts owned (see the module contract).
pub struct Lane {
    pub session: Session,
    pub sampler: Sampler,
    drafts: Option<Speculator>,
    track: Track,
}

impl Lane {
    /// A lane that will prefill `prompt` on `session` (a fresh one, or one whose committed tokens
    /// precede `prompt`), then generate with `opts` and `sampler`; its forwards' counters go to
    /// [`Lane::shared`].
    pub fn new(
        session: Session,
        prompt: Vec<u32>,
        opts: GenerateOptions,
        sampler: Sampler,
    ) -> Result<Lane, ForwardError> {
        if prompt.is_empty() {
            return Err(ForwardError::Empty);
        }
        let track = Track::new(&session, prompt, PromptUse::Prefill, opts, Counting::Shared)?;
        Ok(Lane { session, sampler, drafts: None, track })
    }

    /// This lane drafts with `drafts` (before its first step: a tapping drafter must see the
    /// prompt's rows).
    pub fn with_drafts(mut self, drafts: Speculator) -> Lane {
        self.session.stats.drafts.drafter = Some(drafts.name().to_string());
        self.drafts = Some(drafts);
        self
    }

    pub fn done(&self) -> bool {
        self.track.done()
    }

    /// Whether its whole prompt has been fed.
    pub fn prefilled(&self) -> bool {
        self.track.prefilled()
    }

    /// Prompt tokens plus the most it may generate: the length its state is budgeted for.
    pub fn budget_len(&self) -> usize {
        self.track.budget_len()
    }

    /// Tokens emitted so far.
    pub fn tokens(&self) -> &[u32] {
        self.track.tokens()
    }

    /// What it generated (its reason is `Length` while it still runs).
    pub fn generation(&self) -> Generation {
        self.track.generation()
    }

    /// The most sequences that shared a forward with this one (itself included).
    pub fn peak_batch(&self) -> usize {
        self.track.peak_batch
    }

    /// Counters of the forwards this lane took part in, shared with the lanes beside it
    /// (`expert_bytes_read`, `cache_hits`, `cache_misses` from the source over those forwards).
    pub fn shared(&self) -> &Stats {
        &self.track.shared
    }

    /// Its parts, lent to a step.
    pub(super) fn seq(&mut self) -> Seq<'_> {
        Seq {
            session: &mut self.session,
            sampler: &mut self.sampler,
            drafts: self.drafts.as_mut(),
            track: &mut self.track,
        }
    }
}
