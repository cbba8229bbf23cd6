//! The step core: the one loop body every decode, prefill, verify and batch path runs — DESIGN.md's
//! "one step": rows of every active sequence (decode rows, prompt chunks, verify blocks) → one
//! forward → each sequence picks or accepts its drafts → commits.
//!
//! Contract: [`Engine::step`] advances every unfinished lane (`lane.rs`) by one step in ONE
//! forward (one expert-union read per MoE layer for all of their rows). Rows are capped at
//! `prefill_rows` a step: every decoding lane's own row first (it picks and emits its token before
//! the forward; a running sequence never waits for a newcomer's prompt), then prompt chunks of the
//! lanes still feeding theirs, in order (the first one always moves, so a batch of prompts cannot
//! stall; prompts are packed as `prefill_passes` says), then drafts in the room left. After the
//! forward each lane keeps its own rows (`Seq::settle`: accept, emit, commit), whatever its
//! neighbours do. Each lane's tokens equal its `prefill` then `generate_sampled` alone, bit for bit,
//! whatever joins or leaves beside it and whether it or its neighbours draft: rows do not change
//! each other's bits, prompt chunks of any size give the same state, and a draft only changes how
//! many tokens one step emits. A failed forward leaves every session as it was before the step
//! (the tokens picked in it were already emitted); the caller decides what a failure undoes
//! (`run.rs`: all or nothing for prompts).
//!
//! A session's prefill watcher (`Session::watch_prefill`) is told after every MoE layer of a step
//! that feeds its prompt; one returning false cancels the step (`ForwardError::Cancelled`).
//!
//! Counters: each forward's once to the `total` the caller passes; a lane counting its own
//! (`Counting::Own`: `Session` and `Engine` calls) gets them in its session's `stats`; a lane of a
//! running batch (`Counting::Shared`) keeps in its session's `stats` only what is its own (prompt
//! and generated tokens, its prefill and decode time, its drafts) and gets the forwards' counters —
//! with the source's reads over them — in `Lane::shared`. The per-layer traces are recorded only
//! when the total or a session counting its own keeps them (`Stats::traced`), and go only to those
//! (never to a lane's shared counters: a lane holding every shared step's trace would repeat it N
//! times). A drafting lane's
//! width policy learns from each step's counters (`draft::ForwardCost`: rows, expert union, bytes read
//! — the source's reads are taken over every forward a drafting lane takes part in — read wait,
//! kernel time) and, under the published policy, judges its drafts by its share of each step
//! (`draft::StepCost`).
//!
//! [`Engine::forward_rows`] is the only place a forward runs (tests/structure.rs checks it).

use super::lane::Lane;
use super::lane::{Counting, Feed, Seq};
use crate::draft::{ForwardCost, Speculator};
use crate::engine::{Engine, PrefillProgress};
use crate::forward::{self, LayerWatch, RowsOut, SeqRows};
use crate::k3::ForwardError;
use crate::stats::Stats;
use crate::store::SourceReport;
use std::time::Instant;

impl Engine {
    /// One step of `seqs` (see the module contract); `on_token(lane, token)` sees each emitted
    /// token (false: that lane stops after it).
    pub(crate) fn step(
        &self,
        seqs: &mut [Seq<'_>],
        on_token: &mut dyn FnMut(usize, u32) -> bool,
        total: &mut Stats,
    ) -> Result<(), ForwardError> {
        let be = &*self.model.be;
        let budget = self.config.prefill_rows.max(1);
        let mut feeds: Vec<Option<Feed>> = seqs.iter().map(|_| None).collect();
        // The rows: decode rows first, then prompt chunks, then drafts.
        let mut used = 0;
        for (i, s) in seqs.iter_mut().enumerate() {
            if s.track.done() || !s.track.prefilled() {
                continue;
            }
            if let Some(t) = s.next_token(be, &mut |t| on_token(i, t))? {
                feeds[i] = Some(Feed::Decode { rows: vec![t], draft_s: 0.0 });
                used += 1;
            }
        }
        for (s, f) in seqs.iter().zip(feeds.iter_mut()) {
            if s.track.done() || s.track.prefilled() {
                continue;
            }
            let room = if used == 0 { budget } else { budget.saturating_sub(used) };
            let take = s.track.prompt_left().min(room);
            if take > 0 {
                *f = Some(Feed::Prompt(take));
                used += take;
            }
        }
        for (s, f) in seqs.iter_mut().zip(feeds.iter_mut()) {
            if let Some(Feed::Decode { rows, draft_s }) = f
                && s.drafts.is_some()
            {
                let t0 = Instant::now();
                let d = s.propose(rows[0], budget.saturating_sub(used), used - 1)?;
                used += d.len();
                rows.extend(d);
                *draft_s = t0.elapsed().as_secs_f64();
                s.session.stats.drafts.draft_s += *draft_s;
            }
        }
        let running = feeds.iter().flatten().count();
        if running == 0 {
            return Ok(());
        }
        // One forward of every lane's rows.
        // The source's reads over the forward: for lanes that count shared steps, and for the
        // drafters' width policies (what a verify's union costs to read).
        let shared = seqs.iter().zip(&feeds).any(|(s, f)| f.is_some() && s.track.counting == Counting::Shared);
        let drafting = seqs.iter().zip(&feeds).any(|(s, f)| f.is_some() && s.drafts.is_some());
        let src0 = (shared || drafting).then(|| self.read_counters());
        let t0 = Instant::now();
        // The traces are made only for counters that keep them.
        let traced = total.keeps_traces()
            || seqs
                .iter()
                .zip(&feeds)
                .any(|(s, f)| f.is_some() && s.track.counting == Counting::Own && s.session.stats.keeps_traces());
        let mut stats = Stats::traced(traced);
        let outs = self.forward_fed(seqs, &feeds, &mut stats)?;
        let secs = t0.elapsed().as_secs_f64();
        if let Some(a) = src0 {
            reads_between(&a, &self.read_counters(), &mut stats);
        }
        // Each lane picks or accepts and commits its own rows.
        let vocab = self.cfg.vocab;
        let mut outs = outs.into_iter();
        let mut failed = None;
        for (i, (s, f)) in seqs.iter_mut().zip(feeds).enumerate() {
            let Some(f) = f else { continue };
            let out = outs.next().unwrap_or_default();
            s.track.peak_batch = s.track.peak_batch.max(running);
            match s.track.counting {
                // The per-layer traces go where they are kept: never to shared counters.
                Counting::Own => s.session.stats.merge(&stats),
                Counting::Shared => add_forward(&mut s.track.shared, &stats),
            }
            if let Some(d) = s.drafts.as_deref_mut() {
                d.step_ran(&ForwardCost::from_stats(used, secs, &stats));
            }
            // Every lane settles (keeping the others' rows) even when one cannot.
            if let Err(e) = s.settle(be, vocab, f, out, (secs, running), &mut |t| on_token(i, t)) {
                failed.get_or_insert(e);
            }
        }
        add_forward(total, &stats);
        failed.map_or(Ok(()), Err)
    }

    /// The forward of a step: the rows `feeds` name, pending, with the prompts' watchers told
    /// after every MoE layer.
    fn forward_fed(
        &self,
        seqs: &mut [Seq<'_>],
        feeds: &[Option<Feed>],
        stats: &mut Stats,
    ) -> Result<Vec<RowsOut>, ForwardError> {
        // Watchers are taken out of their sessions for the forward: (lane, watcher, progress).
        let mut watching = Vec::new();
        for (i, (s, f)) in seqs.iter_mut().zip(feeds).enumerate() {
            if let (Some(Feed::Prompt(n)), Some((fed, tokens))) = (f, s.track.watched())
                && let Some(w) = s.session.watcher.take()
            {
                let p =
                    PrefillProgress { tokens_done: fed, chunk: *n, tokens, layers_done: 0, layers: 0, expert_bytes: 0 };
                watching.push((i, w, p, s.track.prompt_bytes));
            }
        }
        let mut watch = |layers_done: usize, layers: usize, st: &Stats| {
            let mut go = true;
            for (_, w, p, bytes0) in watching.iter_mut() {
                let p = PrefillProgress {
                    layers_done,
                    layers,
                    expert_bytes: *bytes0 + st.reads.expert_bytes_requested,
                    ..*p
                };
                go &= w(&p);
            }
            go
        };
        let ran = {
            let mut batch: Vec<SeqRows> = Vec::with_capacity(feeds.len());
            for (s, f) in seqs.iter_mut().zip(feeds) {
                let Seq { session, drafts, track, .. } = s;
                let taps = drafts.as_deref().map_or(&[][..], Speculator::taps);
                let (tokens, logits) = match f {
                    Some(Feed::Prompt(n)) => (track.prompt_rows(*n), track.prompt_logits()),
                    Some(Feed::Decode { rows, .. }) => (&rows[..], rows_logits(rows.len())),
                    None => continue,
                };
                batch.push(SeqRows { state: session.state_mut(), tokens, logits, taps });
            }
            self.forward_rows(&mut batch, stats, &mut watch)
        };
        for (i, w, ..) in watching {
            seqs[i].session.watcher = Some(w);
        }
        if ran.is_ok() {
            for (s, f) in seqs.iter_mut().zip(feeds) {
                if let Some(Feed::Prompt(_)) = f {
                    s.track.prompt_bytes += stats.reads.expert_bytes_requested;
                }
            }
        }
        ran
    }

    /// Runs the rows of `batch` (each sequence's tokens, which logits, which taps) through one
    /// forward and leaves them pending in each sequence's state: the only place a forward runs.
    pub(in crate::engine) fn forward_rows(
        &self,
        batch: &mut [SeqRows],
        stats: &mut Stats,
        watch: &mut LayerWatch<'_>,
    ) -> Result<Vec<RowsOut>, ForwardError> {
        forward::run(&self.model, &*self.device, self.source(), self.forward_options(), batch, stats, watch)
    }

    /// One step of a running batch (see the module contract); the shared forward's counters are
    /// added to `total` and to every lane that took part (`Lane::shared`).
    pub fn step_lanes(
        &self,
        lanes: &mut [Lane],
        on_token: &mut dyn FnMut(usize, u32) -> bool,
        total: &mut Stats,
    ) -> Result<(), ForwardError> {
        let mut seqs: Vec<Seq> = lanes.iter_mut().map(Lane::seq).collect();
        self.step(&mut seqs, on_token, total)
    }
}

/// The logits a decode feed of `rows` rows needs: every row's for a verify block.
fn rows_logits(rows: usize) -> forward::LogitRows {
    if rows > 1 { forward::LogitRows::All } else { forward::LogitRows::Last }
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
    into.reads.expert_bytes_read = diff(a.expert_bytes_read, b.expert_bytes_read);
    into.reads.cache_hits = diff(a.cache_hits, b.cache_hits);
    into.reads.cache_misses = diff(a.cache_misses, b.cache_misses);
}

/// Adds a forward's counters, its reads included.
pub(super) fn add_forward(into: &mut Stats, s: &Stats) {
    into.merge(s);
    let (to, from) = (&mut into.reads, &s.reads);
    to.expert_bytes_read = add_known(to.expert_bytes_read, from.expert_bytes_read);
    to.cache_hits = add_known(to.cache_hits, from.cache_hits);
    to.cache_misses = add_known(to.cache_misses, from.cache_misses);
}
