//! Continuous batching: sequences join and leave a running batch at step boundaries, each with
//! or without drafts.
//!
//! Contract: a [`Lane`] is one sequence of a running batch — its session, prompt, options,
//! sampler and (optionally) its drafter ([`LaneDrafts`], e.g. `spec::Speculator`).
//! [`Engine::step_lanes`] advances every unfinished lane by one step in ONE forward (one
//! expert-union read per MoE layer for all of their rows): a lane whose prompt is fed picks its
//! next token with its own sampler, emits it (`on_token(lane, token)`; false cancels that lane)
//! and, unless it stopped, feeds it — alone, or followed by its drafter's proposals as a verify
//! block of k+1 rows; a lane still prefilling feeds its next prompt chunk in the same forward, so
//! running sequences' decode and verify rows ride along a newcomer's prefill sweep. Rows are
//! capped at `prefill_rows` a step: every decode lane's own row first, then prompt chunks (the
//! first prompt always moves), then drafts in the room left. After the forward each lane keeps its own rows: a
//! verify lane accepts the longest prefix of drafts equal to K3's picks (drawn by its sampler,
//! row by row, as `Session::generate_speculative_sampled` does), emits them and commits only
//! those rows; the others roll back. A drafter that taps K3's hidden rows sees every committed
//! row (prompt chunks included). Each lane's tokens equal its `prefill` then `generate_sampled`
//! alone, bit for bit, whatever joins or leaves beside it and whether it or its neighbours draft
//! (rows do not change each other's bits, prompt chunks of any size give the same state, and a
//! draft only changes how many tokens one step emits). A failed forward leaves every session as
//! it was before the step (the tokens picked in it were already emitted).
//!
//! A drafting lane's cost model judges its drafts by its share of each step (`step_cost`): the
//! step's fixed part split among the lanes plus its own rows at the fitted per-row rate.
//!
//! Counters: a lane's `session.stats` holds only what is its own (prompt and generated tokens,
//! its prefill and decode time, its drafts); the counters of the shared forwards it took part in
//! (expert bytes, reads, cache hits and misses — the other lanes' too) go to `Lane::shared`, and
//! each forward's once to the `total` the caller passes.

use super::session::emit;
use super::step_cost::StepCost;
use super::{Engine, GenerateOptions, Generation, Session, StopReason};
use crate::backend::BackendError;
use crate::k3::ForwardError;
use crate::sample::Sampler;
use crate::sched::{LogitRows, RowsOut};
use crate::stats::Stats;
use crate::store::SourceReport;
use std::time::Instant;

/// A lane's drafter: what `spec::Speculator` does for a lane (the engine sits below `spec`).
pub trait LaneDrafts: Send {
    /// Short name for reports.
    fn name(&self) -> &str;
    /// Drafts to ask for now (0: feed one row).
    fn width(&self) -> usize;
    /// Up to `k` tokens predicted to follow `context` (prompt + output, the pending token last).
    fn propose(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, BackendError>;
    /// K3 layers whose hidden rows the drafter reads (none: nothing to observe).
    fn taps(&self) -> &[usize];
    /// A forward's rows from position `start`, of which `committed` were kept.
    fn observe(&mut self, start: usize, rows: &RowsOut, committed: usize) -> Result<(), BackendError>;
    /// One row was fed without drafts; the step took `secs`.
    fn stepped(&mut self, secs: f64);
    /// A verify of `proposed` drafts kept `accepted`; it took `secs` (drafting included).
    fn verified(&mut self, proposed: usize, accepted: usize, secs: f64);
}

/// One sequence of a running batch (see the module contract).
pub struct Lane {
    pub session: Session,
    pub opts: GenerateOptions,
    pub sampler: Sampler,
    drafts: Option<Box<dyn LaneDrafts>>,
    prompt: Vec<u32>,
    fed: usize,
    /// Tokens the session held before the prompt.
    base: usize,
    /// Tokens emitted so far.
    pub tokens: Vec<u32>,
    /// K3's pick at a rejected draft's row: the next token, already drawn.
    picked: Option<u32>,
    /// Why it stopped, once it has.
    pub reason: Option<StopReason>,
    admitted: Instant,
    decode: Option<(Instant, u64)>,
    /// The most sequences that shared a forward with this one (itself included).
    pub peak_batch: usize,
    /// Counters of the forwards this lane took part in, shared with the lanes beside it
    /// (`expert_bytes_read`, `cache_hits`, `cache_misses` from the source over those forwards).
    pub shared: Stats,
    /// What its rows cost in the shared steps (its drafter's cost model reads its share).
    cost: StepCost,
}

/// What a lane feeds in a step.
enum Feed {
    /// Prompt rows `fed..fed + n`.
    Prompt(usize),
    /// Its pending token and drafts, drafting having taken `draft_s`.
    Decode { rows: Vec<u32>, draft_s: f64 },
}

impl Lane {
    /// A lane that will prefill `prompt` on `session` (a fresh one, or one whose committed tokens
    /// precede `prompt`), then generate with `opts` and `sampler`.
    pub fn new(
        session: Session,
        prompt: Vec<u32>,
        opts: GenerateOptions,
        sampler: Sampler,
    ) -> Result<Lane, ForwardError> {
        if prompt.is_empty() {
            return Err(ForwardError::Empty);
        }
        Ok(Lane {
            base: session.pos(),
            session,
            opts,
            sampler,
            drafts: None,
            prompt,
            fed: 0,
            tokens: Vec::new(),
            picked: None,
            reason: None,
            admitted: Instant::now(),
            decode: None,
            peak_batch: 0,
            shared: Stats::default(),
            cost: StepCost::default(),
        })
    }

    /// This lane drafts with `drafts` (before its first step: a tapping drafter must see the
    /// prompt's rows).
    pub fn with_drafts(mut self, drafts: Box<dyn LaneDrafts>) -> Lane {
        self.session.stats.drafter = Some(drafts.name().to_string());
        self.drafts = Some(drafts);
        self
    }

    pub fn done(&self) -> bool {
        self.reason.is_some()
    }

    /// Whether its whole prompt has been fed.
    pub fn prefilled(&self) -> bool {
        self.fed == self.prompt.len()
    }

    /// Prompt tokens plus the most it may generate: the length its state is budgeted for.
    pub fn budget_len(&self) -> usize {
        self.base + self.prompt.len() + self.opts.max_new
    }

    /// What it generated (its reason is `Length` while it still runs).
    pub fn generation(&self) -> Generation {
        Generation { tokens: self.tokens.clone(), reason: self.reason.unwrap_or(StopReason::Length) }
    }

    fn finish(&mut self, r: StopReason) {
        if let Some(d) = self.decode.take() {
            self.session.decode_end(d, self.tokens.len());
        }
        self.reason = Some(r);
    }

    fn taps(&self) -> Vec<usize> {
        self.drafts.as_ref().map(|d| d.taps().to_vec()).unwrap_or_default()
    }

    /// Picks and emits the next token; Some(token) when it is to be fed.
    fn next_token(&mut self, e: &Engine, on_token: &mut dyn FnMut(u32) -> bool) -> Result<Option<u32>, ForwardError> {
        if self.tokens.len() >= self.opts.max_new {
            self.finish(StopReason::Length);
            return Ok(None);
        }
        let t = match self.picked.take() {
            Some(t) => t,
            None => {
                let logits = self.session.logits().ok_or(ForwardError::Empty)?;
                self.sampler.pick_on(&*e.model.be, logits)?
            }
        };
        match emit(&mut self.tokens, t, &self.opts, on_token) {
            Some(r) => {
                self.finish(r);
                Ok(None)
            }
            None => Ok(Some(t)),
        }
    }

    /// Its drafter's proposals after `next`, at most `room` (and never past `max_new`).
    fn propose(&mut self, next: u32, room: usize) -> Result<Vec<u32>, ForwardError> {
        let Some(d) = self.drafts.as_mut() else { return Ok(Vec::new()) };
        // Accepting all k drafts emits k + 1 tokens: stay within max_new.
        let k = d.width().min(self.opts.max_new - self.tokens.len() - 1).min(room);
        if k == 0 {
            return Ok(Vec::new());
        }
        let mut ctx = Vec::with_capacity(self.session.pos() + 1);
        ctx.extend_from_slice(self.session.tokens());
        ctx.push(next);
        let mut drafts = d.propose(&ctx, k)?;
        drafts.truncate(k);
        Ok(drafts)
    }

    /// Keeps its rows of a step's forward (see the module contract).
    fn settle(
        &mut self,
        e: &Engine,
        feed: Feed,
        out: RowsOut,
        (secs, lanes): (f64, usize),
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<(), ForwardError> {
        let start = self.session.pos();
        let vocab = e.cfg.vocab;
        match feed {
            Feed::Prompt(n) => {
                let rows = &self.prompt[self.fed..self.fed + n];
                let last = out.logits[out.logits.len().saturating_sub(vocab)..].to_vec();
                self.session.commit_rows(rows, n, last)?;
                if let Some(d) = self.drafts.as_mut().filter(|d| !d.taps().is_empty()) {
                    d.observe(start, &out, n)?;
                }
                self.fed += n;
                if self.prefilled() {
                    self.session.stats.prompt_tokens += self.prompt.len() as u64;
                    self.session.stats.prefill_s += self.admitted.elapsed().as_secs_f64();
                    self.decode = Some(self.session.decode_start());
                }
            }
            Feed::Decode { rows, draft_s } if rows.len() == 1 => {
                self.session.commit_rows(&rows, 1, out.logits.clone())?;
                if let Some(d) = self.drafts.as_mut() {
                    if !d.taps().is_empty() {
                        d.observe(start, &out, 1)?;
                    }
                    d.stepped(self.cost.share(1, lanes, secs) + draft_s);
                }
            }
            Feed::Decode { rows, draft_s } => {
                let drafts = &rows[1..];
                // K3's pick after row i is the check of draft i (row i + 1).
                let mut accepted = 0;
                for (i, &d) in drafts.iter().enumerate() {
                    let x = self.sampler.pick_on(&*e.model.be, &out.logits[i * vocab..(i + 1) * vocab])?;
                    if x != d {
                        self.picked = Some(x);
                        break;
                    }
                    accepted += 1;
                }
                self.session.stats.record_drafts(drafts.len(), accepted);
                self.session.stats.verify_s += secs;
                // Emit the accepted drafts exactly as plain decoding would; an end among them
                // keeps only the rows it would have fed (the ending token itself is not fed).
                let mut keep = 1 + accepted;
                let mut ended = None;
                for (i, &d) in drafts[..accepted].iter().enumerate() {
                    ended = emit(&mut self.tokens, d, &self.opts, on_token);
                    if ended.is_some() {
                        keep = 1 + i;
                        break;
                    }
                }
                let last = out.logits[(keep - 1) * vocab..keep * vocab].to_vec();
                self.session.commit_rows(&rows, keep, last)?;
                if let Some(d) = self.drafts.as_mut() {
                    if !d.taps().is_empty() {
                        d.observe(start, &out, keep)?;
                    }
                    d.verified(drafts.len(), accepted, self.cost.share(rows.len(), lanes, secs) + draft_s);
                }
                if let Some(r) = ended {
                    self.picked = None;
                    self.finish(r);
                }
            }
        }
        Ok(())
    }
}

/// `a + b` where either is known.
fn add_known(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
    }
}

/// The source's reads between two reports, as a forward's counters.
fn reads_between(a: &SourceReport, b: &SourceReport, into: &mut Stats) {
    let diff = |x: Option<u64>, y: Option<u64>| x.zip(y).map(|(x, y)| y.saturating_sub(x));
    into.expert_bytes_read = diff(a.expert_bytes_read, b.expert_bytes_read);
    into.cache_hits = diff(a.cache_hits, b.cache_hits);
    into.cache_misses = diff(a.cache_misses, b.cache_misses);
}

/// Adds a forward's counters, its reads included.
pub(super) fn add_forward(into: &mut Stats, s: &Stats) {
    into.merge(s);
    into.expert_bytes_read = add_known(into.expert_bytes_read, s.expert_bytes_read);
    into.cache_hits = add_known(into.cache_hits, s.cache_hits);
    into.cache_misses = add_known(into.cache_misses, s.cache_misses);
}

impl Engine {
    /// One step of a running batch (see the module contract); the shared forward's counters are
    /// added to `total` and to every lane that took part (`Lane::shared`).
    pub fn step_lanes(
        &self,
        lanes: &mut [Lane],
        on_token: &mut dyn FnMut(usize, u32) -> bool,
        total: &mut Stats,
    ) -> Result<(), ForwardError> {
        let budget = self.config.prefill_rows.max(1);
        let mut feeds: Vec<Option<Feed>> = lanes.iter().map(|_| None).collect();
        // Decode rows first: a running sequence never waits for a newcomer's prompt.
        let mut used = 0;
        for (i, l) in lanes.iter_mut().enumerate() {
            if l.reason.is_some() || !l.prefilled() {
                continue;
            }
            if let Some(t) = l.next_token(self, &mut |t| on_token(i, t))? {
                feeds[i] = Some(Feed::Decode { rows: vec![t], draft_s: 0.0 });
                used += 1;
            }
        }
        for (l, f) in lanes.iter_mut().zip(feeds.iter_mut()) {
            if l.reason.is_some() || l.prefilled() {
                continue;
            }
            // The first prompt always moves, so a batch of newcomers cannot stall.
            let room = if used == 0 { budget } else { budget.saturating_sub(used) };
            let take = (l.prompt.len() - l.fed).min(room);
            if take > 0 {
                *f = Some(Feed::Prompt(take));
                used += take;
            }
        }
        // Then drafts, in the room the decode rows and prompt chunks leave.
        for (l, f) in lanes.iter_mut().zip(feeds.iter_mut()) {
            if let Some(Feed::Decode { rows, draft_s }) = f {
                let t0 = Instant::now();
                let d = l.propose(rows[0], budget.saturating_sub(used))?;
                used += d.len();
                rows.extend(d);
                *draft_s = t0.elapsed().as_secs_f64();
                l.session.stats.draft_s += *draft_s;
            }
        }
        let running = feeds.iter().filter(|f| f.is_some()).count();
        if running == 0 {
            return Ok(());
        }
        let t0 = Instant::now();
        let src0 = self.source_report();
        let mut stats = Stats::default();
        let outs = {
            let mut sessions: Vec<&mut Session> = Vec::with_capacity(running);
            let mut rows: Vec<(&[u32], LogitRows, Vec<usize>)> = Vec::with_capacity(running);
            for (l, f) in lanes.iter_mut().zip(&feeds) {
                let taps = l.taps();
                let Lane { session, prompt, fed, .. } = l;
                match f {
                    Some(Feed::Prompt(n)) => rows.push((&prompt[*fed..*fed + n], LogitRows::Last, taps)),
                    Some(Feed::Decode { rows: r, .. }) => {
                        let logits = if r.len() > 1 { LogitRows::All } else { LogitRows::Last };
                        rows.push((r, logits, taps));
                    }
                    None => continue,
                }
                sessions.push(session);
            }
            self.forward_pending(&mut sessions, &rows, &mut stats)?
        };
        let secs = t0.elapsed().as_secs_f64();
        reads_between(&src0, &self.source_report(), &mut stats);
        let mut outs = outs.into_iter();
        // Each lane keeps the forward's counters but not its per-layer traces: those go to the
        // batch's total once (a lane holding every shared step's trace would repeat it N times).
        let trace = (
            std::mem::take(&mut stats.fetch_trace),
            std::mem::take(&mut stats.layer_fetch_s),
            std::mem::take(&mut stats.fetch_rows),
        );
        let mut failed = None;
        for (i, (l, f)) in lanes.iter_mut().zip(feeds).enumerate() {
            let Some(f) = f else { continue };
            let out = outs.next().unwrap_or_default();
            l.peak_batch = l.peak_batch.max(running);
            add_forward(&mut l.shared, &stats);
            l.cost.observe(used, secs);
            // Every lane settles (keeping the others' rows) even when one cannot.
            if let Err(e) = l.settle(self, f, out, (secs, running), &mut |t| on_token(i, t)) {
                failed.get_or_insert(e);
            }
        }
        (stats.fetch_trace, stats.layer_fetch_s, stats.fetch_rows) = trace;
        add_forward(total, &stats);
        failed.map_or(Ok(()), Err)
    }
}
