//! One forward over a batch, and its MoE expert schedule: which experts are read and when, and
//! the phase timers. The model itself is `k3::forward`; this module drives it (the request
//! scheduler, which decides whose rows go into a forward, is `engine::scheduler`).
//!
//! Contract of [`run`]: the rows of every sequence in the batch (a prompt's chunk of up to
//! `prefill_rows` rows — the chunking is `engine::Session`'s —, one row per sequence of a decode
//! step, a verify block of k+1 rows) go through one pass of `k3::forward`, whose contract holds:
//! every row passes layer L before any row enters layer L+1, results do not depend on grouping,
//! threads or expert arrival order, rows stay pending in each sequence's state, and a failed
//! forward leaves every sequence as it was. Each MoE layer's routed experts come from
//! [`moe::StoreSchedule`]: one fetch of the layer's expert union for all rows, each expert run as
//! it lands, the next layer's experts predicted and prefetched. The time of each phase and the
//! counters of the pass are added to `stats`.

pub mod moe;

pub use crate::k3::forward::{LogitRows, RowsOut, SeqRows};

use crate::backend::Device;
use crate::k3::forward::Phase;
use crate::k3::{ForwardError, K3, KdaMode};
use crate::stats::Stats;
use crate::store::ExpertSource;
use std::time::Instant;

/// How the loop runs (changes timing or the reference path, never the result's meaning).
#[derive(Clone, Copy, Debug, Default)]
pub struct Options {
    pub kda_mode: KdaMode,
    /// Predict and prefetch the next MoE layer's experts.
    pub prefetch: bool,
    /// Reads the expert source keeps in flight, all drives together (sizes a decode step's reads
    /// ahead: [`moe::read_ahead_depth`]).
    pub queue_depth: usize,
}

/// Told after each MoE layer of a forward: (MoE layers done, MoE layers, counters so far); false
/// stops the forward ([`run`]).
pub type LayerWatch<'a> = dyn FnMut(usize, usize, &Stats) -> bool + 'a;

/// Runs every sequence's rows through the model; see the module contract. `device` is the
/// backend the model computes on, as the engine holds it (its device expert cache). `watch` is
/// called after each MoE layer (a long prefill's progress); returning false fails the forward
/// there with [`ForwardError::Cancelled`] (every sequence as it was, as for any failure).
pub fn run(
    model: &K3,
    device: &dyn Device,
    source: Option<&dyn ExpertSource>,
    opts: Options,
    batch: &mut [SeqRows],
    stats: &mut Stats,
    watch: &mut LayerWatch<'_>,
) -> Result<Vec<RowsOut>, ForwardError> {
    let rows: usize = batch.iter().map(|s| s.tokens.len()).sum();
    let mut schedule = moe::StoreSchedule::new(model, device, source, opts, rows, stats).watched(watch);
    let out = crate::k3::forward::forward(model, batch, opts.kda_mode, &mut schedule);
    let stats = schedule.close();
    if out.is_ok() {
        stats.forward_calls += 1;
        stats.rows += rows as u64;
    }
    out
}

/// The phase a forward is in since when, adding each phase's time to its counter when the next
/// one starts; before the first phase and in the output phase the time is `other_s`.
struct PhaseClock {
    since: Instant,
    phase: Option<Phase>,
}

impl PhaseClock {
    fn new() -> Self {
        PhaseClock { since: Instant::now(), phase: None }
    }

    /// Ends the current phase (its time added to `stats`) and starts `next`.
    fn enter(&mut self, next: Option<Phase>, stats: &mut Stats) {
        let now = Instant::now();
        let dt = (now - self.since).as_secs_f64();
        match self.phase {
            Some(Phase::Attention) => stats.phases.attention_s += dt,
            Some(Phase::DenseMlp) => stats.phases.dense_mlp_s += dt,
            Some(Phase::Router) => stats.phases.router_s += dt,
            // The routed input counts as expert work (the experts themselves are timed by the
            // expert schedule, their reads apart).
            Some(Phase::Experts) => stats.phases.expert_kernel_s += dt,
            Some(Phase::Combine) => {
                stats.phases.expert_kernel_s += dt;
                stats.phases.moe_combine_s += dt;
            }
            Some(Phase::Output) | None => stats.phases.other_s += dt,
        }
        self.since = now;
        self.phase = next;
    }

    /// Starts `next` now without counting the time since the last phase ended (it was counted
    /// by whoever ran meanwhile).
    fn restart(&mut self, next: Phase) {
        self.since = Instant::now();
        self.phase = Some(next);
    }
}
