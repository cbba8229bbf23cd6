//! The calls that run the step core (`step.rs`) until their sequences stop: every `Session` call
//! that feeds rows (prefill, score, step, generate, with or without drafts) is a batch of one
//! lane, and `Engine::prefill_sessions` / `generate_sessions` / `forward_sessions` a batch of
//! several; continuous batching, whose lanes join and leave, is `continuous.rs`.
//!
//! Contract: [`Engine::run`] steps its lanes until each has stopped. Rows fed as a prompt are all
//! or nothing: when they take more than one step and a later one fails (an expert read error, a
//! watcher's cancel), every session is restored to where it was before the call. A generation
//! keeps what it committed before a failed step and returns the error. `Session::prefill` of a
//! prompt runs it expert-major in chunks of at most `prefill_rows` rows (each chunk passes every
//! layer, one read of each layer's expert union, before the next starts); `prefill_sessions`
//! packs several prompts' rows in order into the same steps ([`prefill_passes`]), so each MoE
//! layer reads the union of every packed row's experts once for all of them, and leaves each
//! session exactly as its own `prefill` would. `generate_sessions` decodes several prefilled
//! sessions together, one row each a step (a sequence leaves at the step where it stops); each
//! one's tokens equal its `generate_sampled` alone. The counters of every forward go to each
//! session that took part (its `stats`), and those of the shared calls also to the `Stats` they
//! return (with the per-layer traces when a session taking part keeps its own).

use super::lane::{Counting, PromptUse, Seq, Track};
use crate::draft::Speculator;
use crate::engine::{Engine, GenerateOptions, Generation, Session};
use crate::k3::ForwardError;
use crate::sample::Sampler;
use crate::stats::Stats;
use std::sync::Arc;
use std::time::Instant;

/// One sequence of [`Engine::generate_sessions`]: a prefilled session, its options, its sampler
/// and the callback that sees each token (false: stop after it).
pub struct BatchSeq<'a> {
    pub session: &'a mut Session,
    pub opts: GenerateOptions,
    pub sampler: &'a mut Sampler,
    pub on_token: &'a mut dyn FnMut(u32) -> bool,
}

/// The passes of a batched prefill: for each pass, (sequence, start, end) of the rows it takes;
/// at most `rows` rows a pass, prompts taken in order (how [`Engine::step`] packs prompt chunks).
pub fn prefill_passes(lens: &[usize], rows: usize) -> Vec<Vec<(usize, usize, usize)>> {
    let rows = rows.max(1);
    let mut passes = Vec::new();
    let mut pass = Vec::new();
    let mut used = 0;
    for (i, &len) in lens.iter().enumerate() {
        let mut start = 0;
        while start < len {
            let take = (len - start).min(rows - used);
            pass.push((i, start, start + take));
            start += take;
            used += take;
            if used == rows {
                passes.push(std::mem::take(&mut pass));
                used = 0;
            }
        }
    }
    if !pass.is_empty() {
        passes.push(pass);
    }
    passes
}

impl Engine {
    /// Steps `seqs` until every one has stopped (see the module contract); `whole`: the prompt
    /// rows are all or nothing.
    pub(crate) fn run(
        &self,
        seqs: &mut [Seq<'_>],
        on_token: &mut dyn FnMut(usize, u32) -> bool,
        total: &mut Stats,
        whole: bool,
    ) -> Result<(), ForwardError> {
        if seqs.iter().any(|s| !std::ptr::eq(&**s.session.engine(), self)) {
            return Err(ForwardError::ForeignSession);
        }
        // Several steps of prompt rows commit one by one: keep every state to come back to.
        let rows: usize = seqs.iter().map(|s| s.track.prompt_left()).sum();
        let before = match whole && rows > self.config.prefill_rows.max(1) {
            true => Some(seqs.iter().map(|s| s.session.checkpoint()).collect::<Result<Vec<_>, _>>()?),
            false => None,
        };
        while seqs.iter().any(|s| !s.track.done()) {
            if let Err(e) = self.step(seqs, on_token, total) {
                for (s, c) in seqs.iter_mut().zip(before.into_iter().flatten()) {
                    s.session.restore(c);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Runs `tokens[i]` on `sessions[i]` for every i together (one expert-union read per MoE layer
    /// for all of them a step) and commits every row; returns each session's last-row logits.
    /// All or nothing. The forwards' counters are added to every session that took part.
    pub fn forward_sessions(
        &self,
        sessions: &mut [&mut Session],
        tokens: &[&[u32]],
    ) -> Result<Vec<Vec<f32>>, ForwardError> {
        self.feed_sessions(sessions, tokens, PromptUse::Feed)?;
        Ok(sessions.iter().map(|s| s.logits().unwrap_or_default().to_vec()).collect())
    }

    /// Checks that sequences of `lens` tokens each fit the memory budget together (a batch
    /// holds all their states at once); the error names the budget.
    pub fn sequences_fit(&self, lens: &[usize]) -> Result<(), crate::memory::SequencesError> {
        self.plan.sequences_fit(lens)
    }

    /// Prefills `prompts[i]` on `sessions[i]` for every i in shared steps (see the module
    /// contract); returns the counters of the shared forwards. All or nothing.
    pub fn prefill_sessions(&self, sessions: &mut [&mut Session], prompts: &[&[u32]]) -> Result<Stats, ForwardError> {
        let t0 = Instant::now();
        let mut total = self.feed_sessions(sessions, prompts, PromptUse::Prefill)?;
        total.prompt_tokens += prompts.iter().map(|p| p.len() as u64).sum::<u64>();
        total.prefill_s += t0.elapsed().as_secs_f64();
        Ok(total)
    }

    /// Feeds `rows[i]` to `sessions[i]` as `prompt_use` says, all or nothing.
    fn feed_sessions(
        &self,
        sessions: &mut [&mut Session],
        rows: &[&[u32]],
        prompt_use: PromptUse,
    ) -> Result<Stats, ForwardError> {
        if sessions.len() != rows.len() {
            return Err(ForwardError::BatchMismatch { sessions: sessions.len(), lists: rows.len() });
        }
        if rows.iter().any(|p| p.is_empty()) {
            return Err(ForwardError::Empty);
        }
        let none = GenerateOptions::default();
        let mut tracks = sessions
            .iter()
            .zip(rows)
            .map(|(s, p)| Track::new(s, p.to_vec(), prompt_use, none.clone(), Counting::Own))
            .collect::<Result<Vec<_>, _>>()?;
        let mut samplers: Vec<Sampler> = sessions.iter().map(|_| Sampler::greedy()).collect();
        let mut seqs: Vec<Seq> = sessions
            .iter_mut()
            .zip(&mut tracks)
            .zip(&mut samplers)
            .map(|((session, track), sampler)| Seq { session, sampler, drafts: None, track })
            .collect();
        let mut total = Stats::traced(seqs.iter().any(|s| s.session.stats.keeps_traces()));
        self.run(&mut seqs, &mut |_, _| true, &mut total, true)?;
        Ok(total)
    }

    /// Decodes every sequence from its current logits together (see the module contract);
    /// returns each one's generation and the counters of the shared steps. On a failed step
    /// every session keeps the tokens committed before it and the error is returned.
    pub fn generate_sessions(&self, seqs: &mut [BatchSeq]) -> Result<(Vec<Generation>, Stats), ForwardError> {
        let t0 = Instant::now();
        let mut tracks = seqs
            .iter()
            .map(|b| Track::new(b.session, Vec::new(), PromptUse::Prefill, b.opts.clone(), Counting::Own))
            .collect::<Result<Vec<_>, _>>()?;
        let mut calls: Vec<&mut dyn FnMut(u32) -> bool> = Vec::with_capacity(seqs.len());
        let mut views: Vec<Seq> = Vec::with_capacity(seqs.len());
        for (b, track) in seqs.iter_mut().zip(&mut tracks) {
            calls.push(&mut *b.on_token);
            views.push(Seq { session: &mut *b.session, sampler: &mut *b.sampler, drafts: None, track });
        }
        let mut total = Stats::traced(views.iter().any(|s| s.session.stats.keeps_traces()));
        self.run(&mut views, &mut |i, t| calls[i](t), &mut total, false)?;
        total.decode_s += t0.elapsed().as_secs_f64();
        let gens: Vec<Generation> = tracks.iter().map(Track::generation).collect();
        total.generated_tokens += gens.iter().map(|g| g.tokens.len() as u64).sum::<u64>();
        Ok((gens, total))
    }
}

impl Session {
    /// Feeds `tokens` as `prompt_use` says, a batch of one lane (`drafts` seeing the rows it
    /// taps); all or nothing.
    fn feed(
        &mut self,
        tokens: &[u32],
        prompt_use: PromptUse,
        drafts: Option<&mut Speculator>,
    ) -> Result<Track, ForwardError> {
        if tokens.is_empty() {
            return Err(ForwardError::Empty);
        }
        let e = Arc::clone(self.engine());
        let mut track = Track::new(self, tokens.to_vec(), prompt_use, GenerateOptions::default(), Counting::Own)?;
        let mut sampler = Sampler::greedy();
        let mut one = [Seq { session: self, sampler: &mut sampler, drafts, track: &mut track }];
        e.run(&mut one, &mut |_, _| true, &mut Stats::default(), true)?;
        Ok(track)
    }

    /// Runs a prompt expert-major in chunks of at most `prefill_rows` rows (see the module
    /// contract); returns the last row's logits. All or nothing: on failure the session is as
    /// before the call.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32], ForwardError> {
        self.feed(tokens, PromptUse::Prefill, None)?;
        Ok(self.logits().unwrap_or_default())
    }

    /// [`Session::prefill`] whose rows `spec`'s drafter sees (the hidden rows it taps: its
    /// context). If a later chunk fails the session is restored but earlier chunks were
    /// observed: a drafter drops rows at or past the session's position when it next sees one
    /// (see `DSparkDrafter`).
    pub fn prefill_with(&mut self, tokens: &[u32], spec: &mut Speculator) -> Result<&[f32], ForwardError> {
        self.feed(tokens, PromptUse::Prefill, Some(spec))?;
        Ok(self.logits().unwrap_or_default())
    }

    /// Feeds one token; returns the logits after it.
    pub fn step(&mut self, token: u32) -> Result<&[f32], ForwardError> {
        self.feed(&[token], PromptUse::Feed, None)?;
        Ok(self.logits().unwrap_or_default())
    }

    /// Logits at every position of `tokens` (chunked at `prefill_rows`), committed; all or nothing.
    pub fn score(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ForwardError> {
        Ok(self.feed(tokens, PromptUse::Score, None)?.take_scored())
    }

    /// Greedy generation from the current logits: emits K3's argmax, feeds it, repeats; stops after
    /// a stop token, `max_new` tokens, or when `on_token` returns false. The last emitted token
    /// is not fed (its logits are not needed).
    pub fn generate(
        &mut self,
        opts: &GenerateOptions,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Generation, ForwardError> {
        self.decode(opts, &mut Sampler::greedy(), None, on_token)
    }

    /// [`Session::generate`] with each token chosen by `sampler` (greedy: the same tokens bit for
    /// bit; sampling: one pick per emitted token, in order).
    pub fn generate_sampled(
        &mut self,
        opts: &GenerateOptions,
        sampler: &mut Sampler,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Generation, ForwardError> {
        self.decode(opts, sampler, None, on_token)
    }

    /// Greedy generation with `spec`'s drafts verified in blocks: the tokens, callbacks, stop and
    /// cancel of [`Session::generate`] and the same state after; drafts change only speed.
    pub fn generate_speculative(
        &mut self,
        opts: &GenerateOptions,
        spec: &mut Speculator,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Generation, ForwardError> {
        self.decode(opts, &mut Sampler::greedy(), Some(spec), on_token)
    }

    /// [`Session::generate_speculative`] with tokens chosen by `sampler`: K3's pick at each row is
    /// `sampler`'s draw, and a draft is accepted when the draw equals it (`draft::sampling`), so
    /// the tokens equal [`Session::generate_sampled`]'s with the same sampler, bit for bit.
    pub fn generate_speculative_sampled(
        &mut self,
        opts: &GenerateOptions,
        spec: &mut Speculator,
        sampler: &mut Sampler,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Generation, ForwardError> {
        self.decode(opts, sampler, Some(spec), on_token)
    }

    /// Generation from the current logits: a batch of one lane.
    fn decode(
        &mut self,
        opts: &GenerateOptions,
        sampler: &mut Sampler,
        drafts: Option<&mut Speculator>,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Generation, ForwardError> {
        let e = Arc::clone(self.engine());
        let mut track = Track::new(self, Vec::new(), PromptUse::Prefill, opts.clone(), Counting::Own)?;
        if let Some(d) = &drafts {
            self.stats.drafts.drafter = Some(d.name().to_string());
        }
        let mut one = [Seq { session: self, sampler, drafts, track: &mut track }];
        e.run(&mut one, &mut |_, t| on_token(t), &mut Stats::default(), false)?;
        Ok(track.generation())
    }
}
