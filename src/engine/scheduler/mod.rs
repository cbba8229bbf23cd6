//! The request scheduler: which sequences' rows go into each forward, and what each sequence does
//! with its rows after it — the step core every front end runs.
//!
//! Contract: `step.rs` ([`Engine::step`](crate::engine::Engine), `forward_rows`: the only place a
//! forward runs) advances a set of lanes by one forward; `lane.rs` ([`Lane`]) is one sequence's
//! part in it (its pick, drafts, and the accept/commit rule, written once); `run.rs` steps lanes
//! until they stop (every `Session` call that feeds rows, `Engine::prefill_sessions` /
//! `generate_sessions` / `forward_sessions`); `continuous.rs` ([`LaneHost`],
//! `Engine::run_continuous`) is the lane driver of a running batch whose lanes join and leave. The
//! forward itself and its MoE expert schedule are `crate::forward`.

mod continuous;
mod lane;
mod run;
mod step;

pub use continuous::{LaneError, LaneHost};
pub use lane::Lane;
pub use run::{BatchSeq, prefill_passes};
