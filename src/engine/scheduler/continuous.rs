//! Continuous batching: the one loop of every front end that runs requests as a running batch
//! (`serve --parallel`, `batch --parallel`, `run` with several prompts), sequences joining and
//! leaving at step boundaries.
//!
//! Contract: [`Engine::run_continuous`] keeps up to `parallel` lanes running. Before each step it
//! asks the host for newcomers ([`LaneHost::next`]; whether to wait when nothing runs is the
//! host's choice) and admits each one whose sequence state fits the memory budget beside the
//! running lanes' (one that does not waits, asking for no other, until lanes leave; one that does
//! not fit alone fails with the budget's error). Then it steps every lane in one forward
//! ([`Engine::step_lanes`]) and hands each finished lane back ([`LaneHost::finished`]) at the
//! step where it stops, so the next newcomer joins at the next step: continuous batching, its
//! prompt's rows in the same forward as the running lanes' decode rows. A failed or panicking
//! step fails every running lane ([`LaneHost::failed`]) and the driver goes on with the next
//! newcomers. It returns when the host has no more and nothing runs, with the batch's totals:
//! the counters of every step (each forward counted once) and the finished lanes' own tokens and
//! drafts.

use super::lane::Lane;
use crate::engine::Engine;
use crate::k3::ForwardError;
use crate::memory::SequencesError;
use crate::stats::{Drafts, Stats};

/// What a front end gives [`Engine::run_continuous`]: newcomers, and what to do with their tokens
/// and their ends. `Tag` is the front end's own record of a request.
pub trait LaneHost {
    type Tag;
    /// The next newcomer, or None: none now — and, when `idle` (no lane runs), none ever: the
    /// run ends. An idle host may block until one comes.
    fn next(&mut self, idle: bool) -> Option<(Self::Tag, Lane)>;
    /// A token its lane emitted; false cancels the lane (it stops after this token).
    fn token(&mut self, tag: &mut Self::Tag, token: u32) -> bool;
    /// A lane that stopped (its generation and counters in `lane`).
    fn finished(&mut self, tag: Self::Tag, lane: Lane);
    /// A lane that failed: its step failed, or its state cannot fit the memory budget.
    fn failed(&mut self, tag: Self::Tag, lane: Lane, error: &LaneError);
}

/// Why a lane failed.
#[derive(Debug, thiserror::Error)]
pub enum LaneError {
    #[error(transparent)]
    Forward(#[from] ForwardError),
    #[error("a batched step panicked")]
    Panicked,
    #[error(transparent)]
    Memory(#[from] SequencesError),
}

/// Adds what a lane's session counted as its own (tokens, drafts) to the batch's totals.
fn add_own(total: &mut Stats, s: &Stats) {
    total.prompt_tokens += s.prompt_tokens;
    total.generated_tokens += s.generated_tokens;
    let d = &s.drafts;
    let own = Drafts {
        proposed: d.proposed,
        accepted: d.accepted,
        proposed_at: d.proposed_at.clone(),
        accepted_at: d.accepted_at.clone(),
        verify_calls: d.verify_calls,
        draft_s: d.draft_s,
        drafter: d.drafter.clone(),
        ..Drafts::default()
    };
    total.drafts.merge(&own);
}

impl Engine {
    /// Runs the host's requests as a running batch of up to `parallel` lanes (see the module
    /// contract); returns the counters of every step.
    pub fn run_continuous<H: LaneHost>(&self, parallel: usize, host: &mut H) -> Stats {
        let parallel = parallel.max(1);
        let mut total = Stats::default();
        let mut lanes: Vec<Lane> = Vec::new();
        let mut tags: Vec<H::Tag> = Vec::new();
        let mut waiting: Option<(H::Tag, Lane)> = None;
        loop {
            while lanes.len() < parallel {
                let Some((tag, lane)) = waiting.take().or_else(|| host.next(lanes.is_empty())) else { break };
                let mut lens: Vec<usize> = lanes.iter().map(Lane::budget_len).collect();
                lens.push(lane.budget_len());
                match self.sequences_fit(&lens) {
                    Ok(()) => {
                        lanes.push(lane);
                        tags.push(tag);
                    }
                    Err(e) if lanes.is_empty() => host.failed(tag, lane, &LaneError::Memory(e)),
                    Err(_) => {
                        // It fits once some of the running lanes have left.
                        waiting = Some((tag, lane));
                        break;
                    }
                }
            }
            if lanes.is_empty() {
                if waiting.is_some() {
                    continue;
                }
                return total;
            }
            let step = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let mut on_token = |i: usize, t: u32| host.token(&mut tags[i], t);
                self.step_lanes(&mut lanes, &mut on_token, &mut total)
            }));
            let fail = match step {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(LaneError::Forward(e)),
                Err(_) => {
                    tracing::error!("a batched step panicked; its requests fail");
                    Some(LaneError::Panicked)
                }
            };
            if let Some(e) = fail {
                for (tag, lane) in tags.drain(..).zip(lanes.drain(..)) {
                    host.failed(tag, lane, &e);
                }
                continue;
            }
            // Finished lanes leave, in order.
            let mut i = 0;
            while i < lanes.len() {
                if lanes[i].done() {
                    add_own(&mut total, &lanes[i].session.stats);
                    host.finished(tags.remove(i), lanes.remove(i));
                } else {
                    i += 1;
                }
            }
        }
    }
}
