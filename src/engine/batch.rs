//! Several sequences through one sweep: batched prefill and lockstep decode.
//!
//! Contract: [`Engine::prefill_sessions`] runs N prompts expert-major together — each pass packs
//! up to `prefill_rows` rows taken from the prompts in order (a prompt may span passes), so each
//! MoE layer reads the union of every packed row's experts once for all of them — and leaves
//! each session exactly as its own `prefill` would (bit for bit: every kernel gives the same bits
//! whatever rows run beside it, experts are summed in router order, and attention runs per
//! sequence on its own state). All or nothing: if a pass fails, every session is as before the
//! call. [`Engine::generate_sessions`] then decodes in lockstep: each step feeds every running
//! sequence's last token as one row of one forward (one expert-union read per layer for all of
//! them); a sequence leaves at the step where it stops (stop token, `max_new`, or its callback),
//! the others go on. Each sequence's tokens equal its `generate_sampled` alone, at any N. The
//! shared passes' counters go to the `Stats` the caller passes and, as in
//! [`Engine::forward_sessions`], to every session that took part.

use super::session::emit;
use super::{Engine, GenerateOptions, Generation, Session, StopReason};
use crate::k3::ForwardError;
use crate::memory::SequencesError;
use crate::sample::Sampler;
use crate::sched::{self, LogitRows, RowsOut, SeqRows};
use crate::stats::Stats;
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
/// at most `rows` rows a pass, prompts taken in order.
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
    /// Runs `tokens[i]` on `sessions[i]` for every i in one layer loop (one expert-union read per
    /// MoE layer for all of them) and commits every row; returns each session's last-row logits.
    /// If it fails, every session is as it was. The shared forward's counters are added to every
    /// session that took part.
    pub fn forward_sessions(
        &self,
        sessions: &mut [&mut Session],
        tokens: &[&[u32]],
    ) -> Result<Vec<Vec<f32>>, ForwardError> {
        self.forward_sessions_counted(sessions, tokens, &mut Stats::default())
    }

    /// [`Engine::forward_sessions`] that also adds the shared forward's counters to `total`.
    pub fn forward_sessions_counted(
        &self,
        sessions: &mut [&mut Session],
        tokens: &[&[u32]],
        total: &mut Stats,
    ) -> Result<Vec<Vec<f32>>, ForwardError> {
        if sessions.len() != tokens.len() {
            return Err(ForwardError::BatchMismatch { sessions: sessions.len(), lists: tokens.len() });
        }
        if sessions.iter().any(|s| !std::ptr::eq(&**s.engine(), self)) {
            return Err(ForwardError::ForeignSession);
        }
        let mut stats = Stats::default();
        let outs = {
            let mut batch: Vec<SeqRows> = sessions
                .iter_mut()
                .zip(tokens)
                .map(|(s, t)| SeqRows { state: s.state_mut(), tokens: t, logits: LogitRows::Last, taps: &[] })
                .collect();
            sched::forward(&self.model, &*self.device, self.source(), self.sched_options(), &mut batch, &mut stats)?
        };
        let mut logits = Vec::with_capacity(outs.len());
        for ((s, t), o) in sessions.iter_mut().zip(tokens).zip(outs) {
            // Every row is kept: no replay runs, so this commit cannot fail midway.
            logits.push(s.commit_fed(t, o.logits, &stats)?.to_vec());
        }
        total.merge(&stats);
        Ok(logits)
    }

    /// Runs `rows[i]` (tokens, which logits, which taps) on `sessions[i]` for every i in one layer
    /// loop and leaves every row pending (each session keeps what it will with `commit_rows`);
    /// returns each session's rows. If it fails, every session is as it was.
    pub(super) fn forward_pending(
        &self,
        sessions: &mut [&mut Session],
        rows: &[(&[u32], LogitRows, Vec<usize>)],
        stats: &mut Stats,
    ) -> Result<Vec<RowsOut>, ForwardError> {
        if sessions.len() != rows.len() {
            return Err(ForwardError::BatchMismatch { sessions: sessions.len(), lists: rows.len() });
        }
        if sessions.iter().any(|s| !std::ptr::eq(&**s.engine(), self)) {
            return Err(ForwardError::ForeignSession);
        }
        let mut batch: Vec<SeqRows> = sessions
            .iter_mut()
            .zip(rows)
            .map(|(s, (t, l, taps))| SeqRows { state: s.state_mut(), tokens: t, logits: *l, taps })
            .collect();
        sched::forward(&self.model, &*self.device, self.source(), self.sched_options(), &mut batch, stats)
    }

    /// Checks that sequences of `lens` tokens each fit the memory budget together (a batch
    /// holds all their states at once); the error names the budget.
    pub fn sequences_fit(&self, lens: &[usize]) -> Result<(), SequencesError> {
        self.plan.sequences_fit(lens)
    }

    /// Prefills `prompts[i]` on `sessions[i]` for every i in shared passes (see the module
    /// contract); returns the counters of the shared passes. All or nothing.
    pub fn prefill_sessions(&self, sessions: &mut [&mut Session], prompts: &[&[u32]]) -> Result<Stats, ForwardError> {
        if sessions.len() != prompts.len() {
            return Err(ForwardError::BatchMismatch { sessions: sessions.len(), lists: prompts.len() });
        }
        if sessions.iter().any(|s| !std::ptr::eq(&**s.engine(), self)) {
            return Err(ForwardError::ForeignSession);
        }
        if prompts.iter().any(|p| p.is_empty()) {
            return Err(ForwardError::Empty);
        }
        let t0 = Instant::now();
        let lens: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
        let passes = prefill_passes(&lens, self.config.prefill_rows);
        // Several passes commit one by one: keep every state to come back to on a late failure.
        let before = match passes.len() > 1 {
            true => Some(sessions.iter().map(|s| s.checkpoint()).collect::<Result<Vec<_>, _>>()?),
            false => None,
        };
        let mut total = Stats::default();
        for pass in &passes {
            if let Err(e) = self.prefill_pass(sessions, prompts, pass, &mut total) {
                if let Some(b) = before {
                    for (s, c) in sessions.iter_mut().zip(b) {
                        s.restore(c);
                    }
                }
                return Err(e);
            }
        }
        let dt = t0.elapsed().as_secs_f64();
        for (s, p) in sessions.iter_mut().zip(prompts) {
            s.stats.prompt_tokens += p.len() as u64;
            s.stats.prefill_s += dt;
        }
        total.prompt_tokens += lens.iter().sum::<usize>() as u64;
        total.prefill_s += dt;
        Ok(total)
    }

    /// One pass of a batched prefill: the rows `pass` names, committed on success.
    fn prefill_pass(
        &self,
        sessions: &mut [&mut Session],
        prompts: &[&[u32]],
        pass: &[(usize, usize, usize)],
        total: &mut Stats,
    ) -> Result<(), ForwardError> {
        let mut stats = Stats::default();
        let outs = {
            // `pass` names each sequence at most once, in order.
            let mut batch: Vec<SeqRows> = Vec::with_capacity(pass.len());
            let mut rest = &mut sessions[..];
            let mut at = 0;
            for &(i, a, b) in pass {
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(i - at + 1);
                rest = tail;
                at = i + 1;
                let s = head.last_mut().ok_or(ForwardError::Empty)?;
                batch.push(SeqRows {
                    state: s.state_mut(),
                    tokens: &prompts[i][a..b],
                    logits: LogitRows::Last,
                    taps: &[],
                });
            }
            sched::forward(&self.model, &*self.device, self.source(), self.sched_options(), &mut batch, &mut stats)?
        };
        for (&(i, a, b), o) in pass.iter().zip(outs) {
            // Every row is kept: no replay runs, so this commit cannot fail midway.
            sessions[i].commit_fed(&prompts[i][a..b], o.logits, &stats)?;
        }
        total.merge(&stats);
        Ok(())
    }

    /// Decodes every sequence from its current logits in lockstep (see the module contract);
    /// returns each one's generation and the counters of the shared steps. On a failed step
    /// every session keeps the tokens committed before it and the error is returned.
    pub fn generate_sessions(&self, seqs: &mut [BatchSeq]) -> Result<(Vec<Generation>, Stats), ForwardError> {
        let mut total = Stats::default();
        let mut out: Vec<Vec<u32>> = seqs.iter().map(|s| Vec::with_capacity(s.opts.max_new)).collect();
        let mut reason: Vec<Option<StopReason>> = vec![None; seqs.len()];
        let starts: Vec<_> = seqs.iter().map(|s| s.session.decode_start()).collect();
        let mut logits: Vec<Option<Vec<f32>>> = seqs.iter().map(|s| s.session.logits().map(<[f32]>::to_vec)).collect();
        if logits.iter().any(Option::is_none) {
            return Err(ForwardError::Empty);
        }
        let t0 = Instant::now();
        loop {
            // Each running sequence picks and emits its next token; those that go on feed it.
            let mut feed: Vec<(usize, u32)> = Vec::new();
            for (i, s) in seqs.iter_mut().enumerate() {
                if reason[i].is_some() {
                    continue;
                }
                let r = if out[i].len() >= s.opts.max_new {
                    Some(StopReason::Length)
                } else {
                    let l = logits[i].take().ok_or(ForwardError::Empty)?;
                    let t = s.sampler.pick_on(&*self.model.be, &l)?;
                    let r = emit(&mut out[i], t, &s.opts, s.on_token);
                    if r.is_none() {
                        feed.push((i, t));
                    }
                    r
                };
                if r.is_some() {
                    // Its decode ends here, not when the last sequence of the batch ends.
                    s.session.decode_end(starts[i], out[i].len());
                    reason[i] = r;
                }
            }
            if feed.is_empty() {
                break;
            }
            let toks: Vec<[u32; 1]> = feed.iter().map(|&(_, t)| [t]).collect();
            let mut stepping: Vec<&mut Session> = Vec::with_capacity(feed.len());
            let mut want = feed.iter().map(|&(i, _)| i).peekable();
            for (i, s) in seqs.iter_mut().enumerate() {
                if want.peek() == Some(&i) {
                    want.next();
                    stepping.push(&mut *s.session);
                }
            }
            let lists: Vec<&[u32]> = toks.iter().map(|t| &t[..]).collect();
            let step = self.forward_sessions_counted(&mut stepping, &lists, &mut total)?;
            for (&(i, _), l) in feed.iter().zip(step) {
                logits[i] = Some(l);
            }
        }
        total.decode_s += t0.elapsed().as_secs_f64();
        let mut gens = Vec::with_capacity(seqs.len());
        for (toks, r) in out.into_iter().zip(reason) {
            total.generated_tokens += toks.len() as u64;
            gens.push(Generation { tokens: toks, reason: r.unwrap_or(StopReason::Length) });
        }
        Ok((gens, total))
    }
}
