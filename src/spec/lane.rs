//! A speculator drafting for a lane of a running batch (`engine::LaneDrafts`).
//!
//! Contract: the same drafter, width policy and cost model as [`Session::generate_speculative`]
//! (`crate::engine::Session`), driven by `Engine::step_lanes` instead: it proposes when the width
//! policy and the cost model allow, sees every committed row it taps, and learns from each step
//! (a single step's time, or a verify's drafts and time; in a batch both are the shared step's).
//! Output never depends on it: the lane's tokens are K3's.

use super::Speculator;
use crate::backend::BackendError;
use crate::engine::LaneDrafts;
use crate::sched::RowsOut;

impl LaneDrafts for Speculator {
    fn name(&self) -> &str {
        self.drafter.name()
    }

    fn width(&self) -> usize {
        Speculator::width(self)
    }

    fn propose(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, BackendError> {
        self.drafter.propose(context, k)
    }

    fn taps(&self) -> &[usize] {
        self.drafter.taps()
    }

    fn observe(&mut self, start: usize, rows: &RowsOut, committed: usize) -> Result<(), BackendError> {
        self.drafter.observe(start, rows, committed)
    }

    fn stepped(&mut self, secs: f64) {
        self.width.tick();
        if let Some(c) = &mut self.cost {
            c.record_step(secs);
        }
    }

    fn verified(&mut self, proposed: usize, accepted: usize, secs: f64) {
        self.width.record(proposed, accepted);
        if let Some(c) = &mut self.cost {
            c.record_verify(accepted + 1, secs);
        }
    }
}
