//! Continuous batching: sequences join and leave a running batch at step boundaries.
//!
//! Contract: a [`Lane`] is one sequence of a running batch — its session, prompt, options and
//! sampler. [`Engine::step_lanes`] advances every unfinished lane by one step in ONE forward (one
//! expert-union read per MoE layer for all of them): a lane whose prompt is fed picks its next
//! token with its own sampler, emits it (`on_token(lane, token)`; false cancels that lane) and,
//! unless it stopped, feeds it as one row; a lane still prefilling feeds its next prompt chunk in
//! the same forward, so running sequences' decode rows ride along a newcomer's prefill sweep
//! (prompt rows are capped at `prefill_rows` per step beside the decode rows). The caller adds
//! lanes and removes finished ones between steps. Each lane's tokens equal its `prefill` then
//! `generate_sampled` alone, bit for bit, whatever joins or leaves beside it (rows do not change
//! each other's bits, and prompt chunks of any size give the same state). A failed forward leaves
//! every session as it was before the step (the tokens picked in it were already emitted).

use super::session::emit;
use super::{Engine, GenerateOptions, Generation, Session, StopReason};
use crate::k3::ForwardError;
use crate::sample::Sampler;
use crate::stats::Stats;
use std::time::Instant;

/// One sequence of a running batch (see the module contract).
pub struct Lane {
    pub session: Session,
    pub opts: GenerateOptions,
    pub sampler: Sampler,
    prompt: Vec<u32>,
    fed: usize,
    /// Tokens emitted so far.
    pub tokens: Vec<u32>,
    /// Why it stopped, once it has.
    pub reason: Option<StopReason>,
    admitted: Instant,
    decode: Option<(Instant, u64)>,
    /// The most sequences that shared a forward with this one (itself included).
    pub peak_batch: usize,
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
            session,
            opts,
            sampler,
            prompt,
            fed: 0,
            tokens: Vec::new(),
            reason: None,
            admitted: Instant::now(),
            decode: None,
            peak_batch: 0,
        })
    }

    pub fn done(&self) -> bool {
        self.reason.is_some()
    }

    /// Whether its whole prompt has been fed.
    pub fn prefilled(&self) -> bool {
        self.fed == self.prompt.len()
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
}

impl Engine {
    /// One step of a running batch (see the module contract); the shared forward's counters are
    /// added to `total` and to every lane's session that took part.
    pub fn step_lanes(
        &self,
        lanes: &mut [Lane],
        on_token: &mut dyn FnMut(usize, u32) -> bool,
        total: &mut Stats,
    ) -> Result<(), ForwardError> {
        let mut rows: Vec<Option<Vec<u32>>> = vec![None; lanes.len()];
        let mut used = 0;
        // Decode rows first: a running sequence never waits for a newcomer's prompt.
        for (i, l) in lanes.iter_mut().enumerate() {
            if l.reason.is_some() || !l.prefilled() {
                continue;
            }
            if l.tokens.len() >= l.opts.max_new {
                l.finish(StopReason::Length);
                continue;
            }
            let logits = l.session.logits().ok_or(ForwardError::Empty)?;
            let t = l.sampler.pick_on(&*self.model.be, logits)?;
            match emit(&mut l.tokens, t, &l.opts, &mut |t| on_token(i, t)) {
                Some(r) => l.finish(r),
                None => {
                    rows[i] = Some(vec![t]);
                    used += 1;
                }
            }
        }
        let budget = self.config.prefill_rows.max(1);
        for (i, l) in lanes.iter_mut().enumerate() {
            if l.reason.is_some() || l.prefilled() {
                continue;
            }
            // The first prompt always moves, so a batch of newcomers cannot stall.
            let room = if used == 0 { budget } else { budget.saturating_sub(used) };
            let take = (l.prompt.len() - l.fed).min(room);
            if take > 0 {
                rows[i] = Some(l.prompt[l.fed..l.fed + take].to_vec());
                used += take;
            }
        }
        let running = rows.iter().filter(|r| r.is_some()).count();
        if running == 0 {
            return Ok(());
        }
        {
            let mut sessions: Vec<&mut Session> = Vec::with_capacity(running);
            let mut lists: Vec<&[u32]> = Vec::with_capacity(running);
            for (l, r) in lanes.iter_mut().zip(&rows) {
                if let Some(r) = r {
                    sessions.push(&mut l.session);
                    lists.push(r);
                }
            }
            self.forward_sessions_counted(&mut sessions, &lists, total)?;
        }
        for (l, r) in lanes.iter_mut().zip(&rows) {
            let Some(r) = r else { continue };
            l.peak_batch = l.peak_batch.max(running);
            if !l.prefilled() {
                l.fed += r.len();
                if l.prefilled() {
                    l.session.stats.prompt_tokens += l.prompt.len() as u64;
                    l.session.stats.prefill_s += l.admitted.elapsed().as_secs_f64();
                    l.decode = Some(l.session.decode_start());
                }
            }
        }
        Ok(())
    }
}
