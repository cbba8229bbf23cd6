//! Drafting for speculative decoding: drafters propose, K3 decides every token.
//!
//! Contract: a [`Drafter`] is any proposer of the tokens that follow a context — [`NgramDrafter`]
//! (prompt lookup), [`DSparkDrafter`] (the DSpark draft model, which asks for K3's hidden rows
//! through [`Drafter::taps`] and receives them in [`Drafter::observe`]) and [`OracleDrafter`]
//! (replays a recorded run, for benchmarks). A [`Speculator`] is one sequence's drafter with the
//! policy that says how many drafts to ask for: by default the union-aware [`UnionPolicy`] (the
//! width that maximises expected emitted tokens per expected second, the cost of a verify's expert
//! union read from what is resident and the drives' rate); with `DELTAFIN_DRAFT_POLICY=published`
//! (for A/B runs) the published probe-2 / widen-to-7 [`WidthPolicy`] under the [`CostModel`]
//! (whether drafting pays, measured on its own steps; in a step shared with other sequences, on
//! its share of it: [`StepCost`]). This module only proposes and learns: the engine's
//! step core (`engine/scheduler/step.rs`) feeds the pending token with the drafts as one verify block,
//! accepts the longest prefix equal to K3's own picks (for a sampling sequence, K3's draws: the
//! speculative-sampling rule for point-mass drafts, [`sampling`]) and commits those rows. Drafts
//! change only speed, never output. The engine builds a sequence's drafter from a [`DraftKind`]
//! (it holds the draft model): `Engine::speculator`.

mod cost;
pub mod dspark;
mod ngram;
mod oracle;
pub mod sampling;
mod union;
mod width;

pub use crate::k3::dspark::DSparkModel;
pub use cost::{CostModel, StepCost};
pub use dspark::DSparkDrafter;
pub use ngram::NgramDrafter;
pub use oracle::OracleDrafter;
pub use union::{ForwardCost, UnionPolicy};
pub use width::{GOOD_RECORD, WidthPolicy};

use crate::backend::BackendError;
use crate::k3::forward::RowsOut;
use crate::setting::Setting;
use std::sync::Arc;

/// Weight of the newest sample in the width policy's and the cost model's moving averages.
const EWMA: f64 = 0.3;

/// Proposes draft tokens from the context; K3 verifies them.
pub trait Drafter: Send {
    /// Short name for startup lines and reports.
    fn name(&self) -> &str;
    /// Up to `k` tokens predicted to follow `context` (prompt + output, the pending token last).
    /// Fewer (or none) is fine; more than `k` are ignored. A drafter that computes on the
    /// backend fails with its error.
    fn propose(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, BackendError>;
    /// K3 layers whose hidden rows this drafter reads (none for n-gram). When non-empty every
    /// forward of its sequence returns those rows, and each committed row reaches
    /// [`Drafter::observe`] (prompt chunks included).
    fn taps(&self) -> &[usize] {
        &[]
    }
    /// Called after each forward of its sequence with the forward's output, the position of its
    /// first row and how many of its rows were committed. On an error the drafter keeps a context
    /// it can draft from (at worst none).
    fn observe(&mut self, _start: usize, _rows: &RowsOut, _committed: usize) -> Result<(), BackendError> {
        Ok(())
    }
}

/// Which drafter to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DraftKind {
    /// No drafting: plain greedy decode.
    #[default]
    Off,
    /// n-gram prompt lookup over prompt + output.
    Ngram,
    /// The DSpark draft model (`--draft-model DIR`).
    Dspark,
    /// DSpark when a draft model is configured, else n-gram.
    Auto,
}

#[derive(Debug, thiserror::Error)]
pub enum DraftError {
    #[error(
        "{} dspark needs a DSpark checkpoint: give {} DIR (or use {} ngram / auto)",
        Setting::Draft,
        Setting::DraftModel,
        Setting::Draft
    )]
    NoDraftModel,
}

/// The drafter for `kind` (None for `Off`); DSpark drafts with `model`, the engine's draft model.
pub fn drafter_for(kind: DraftKind, model: Option<&Arc<DSparkModel>>) -> Result<Option<Box<dyn Drafter>>, DraftError> {
    let dspark = || model.map(|m| Box::new(DSparkDrafter::new(Arc::clone(m))) as Box<dyn Drafter>);
    match kind {
        DraftKind::Off => Ok(None),
        DraftKind::Ngram => Ok(Some(Box::new(NgramDrafter::default()))),
        DraftKind::Auto => Ok(Some(dspark().unwrap_or_else(|| Box::new(NgramDrafter::default())))),
        DraftKind::Dspark => dspark().map(Some).ok_or(DraftError::NoDraftModel),
    }
}

/// The environment variable that picks the width policy: `union` (the default) or `published`.
pub const POLICY_ENV: &str = "DELTAFIN_DRAFT_POLICY";

/// A drafter with its width policy: the union-aware one, or the published one with (optionally)
/// the cost model; one per sequence.
pub struct Speculator {
    pub drafter: Box<dyn Drafter>,
    /// Some: it decides the width (`width` and `cost` are not used).
    pub union: Option<UnionPolicy>,
    pub width: WidthPolicy,
    /// None: draft whenever the width policy allows (tests, benchmarks of acceptance).
    pub cost: Option<CostModel>,
    /// Its sequence's share of the steps it takes part in.
    share: StepCost,
    /// Drafts asked for at the last decision (for the drafter's seconds per draft).
    asked: usize,
}

impl Speculator {
    /// `drafter` with the union-aware policy over MoE layers of `n_experts` routed experts (0:
    /// unknown), or — `DELTAFIN_DRAFT_POLICY=published` — the published width policy under the
    /// live cost model.
    pub fn new(drafter: Box<dyn Drafter>, n_experts: usize) -> Self {
        match std::env::var(POLICY_ENV).as_deref() {
            Ok("published") => Speculator::published(drafter),
            Ok("union") | Err(_) => Speculator::union(drafter, n_experts),
            Ok(other) => {
                tracing::warn!("{POLICY_ENV}={other:?} is not union or published; using union");
                Speculator::union(drafter, n_experts)
            }
        }
    }

    /// `drafter` with the union-aware width policy.
    pub fn union(drafter: Box<dyn Drafter>, n_experts: usize) -> Self {
        let max = WidthPolicy::default().max;
        Speculator { union: Some(UnionPolicy::new(max, n_experts)), ..Speculator::without_cost_model(drafter) }
    }

    /// `drafter` with the published width policy and the live cost model.
    pub fn published(drafter: Box<dyn Drafter>) -> Self {
        Speculator { cost: Some(CostModel::default()), ..Speculator::without_cost_model(drafter) }
    }

    /// `drafter` drafting whenever the published width policy allows.
    pub fn without_cost_model(drafter: Box<dyn Drafter>) -> Self {
        Speculator {
            drafter,
            union: None,
            width: WidthPolicy::default(),
            cost: None,
            share: StepCost::default(),
            asked: 0,
        }
    }

    /// One line for the startup report.
    pub fn describe(&self) -> String {
        let policy = match (&self.union, &self.cost) {
            (Some(u), _) => format!("width 0..{} where expected tokens per second are most", u.max),
            (None, Some(_)) => format!("width {}..{}, pauses while it does not pay", self.width.probe, self.width.max),
            (None, None) => format!("width {}..{}, cost model off", self.width.probe, self.width.max),
        };
        format!("drafter {} ({policy})", self.drafter.name())
    }

    pub fn name(&self) -> &str {
        self.drafter.name()
    }

    /// K3 layers whose hidden rows the drafter reads.
    pub fn taps(&self) -> &[usize] {
        self.drafter.taps()
    }

    /// Drafts to ask for now (0: feed one row), `others` rows of other sequences being in the
    /// step: the union-aware policy's, or the published width policy's unless the cost model
    /// pauses.
    pub fn decide(&mut self, others: usize) -> usize {
        self.asked = match &mut self.union {
            Some(u) => u.decide(others),
            None if self.cost.as_ref().is_some_and(|c| !c.allows()) => 0,
            None => self.width.width(),
        };
        self.asked
    }

    /// At most `k` drafts after `context` (the pending token last).
    pub fn propose(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, BackendError> {
        let mut d = self.drafter.propose(context, k)?;
        d.truncate(k);
        Ok(d)
    }

    /// Hands the drafter a forward's rows from position `start`, `committed` of them kept (only
    /// when it taps K3's rows).
    pub fn observe(&mut self, start: usize, rows: &RowsOut, committed: usize) -> Result<(), BackendError> {
        if self.drafter.taps().is_empty() {
            return Ok(());
        }
        self.drafter.observe(start, rows, committed)
    }

    /// A step its sequence took part in ran `f.rows` rows in all in `f.secs`.
    pub fn step_ran(&mut self, f: &ForwardCost) {
        self.share.observe(f.rows, f.secs);
        if let Some(u) = &mut self.union {
            u.observe(f);
        }
    }

    /// Its sequence fed one row without drafts in a step of `secs` shared by `lanes` sequences;
    /// asking the drafter took `draft_s`.
    pub fn stepped(&mut self, lanes: usize, secs: f64, draft_s: f64) {
        let mine = self.share.share(1, lanes, secs) + draft_s;
        if let Some(u) = &mut self.union {
            u.drafted(self.asked, draft_s);
        }
        self.width.tick();
        if let Some(c) = &mut self.cost {
            c.record_step(mine);
        }
    }

    /// A verify of `proposed` drafts kept `accepted`, in a step of `secs` shared by `lanes`
    /// sequences; drafting took `draft_s`.
    pub fn verified(&mut self, proposed: usize, accepted: usize, lanes: usize, secs: f64, draft_s: f64) {
        let mine = self.share.share(proposed + 1, lanes, secs) + draft_s;
        if let Some(u) = &mut self.union {
            u.drafted(self.asked, draft_s);
            u.verified(proposed, accepted);
        }
        self.width.record(proposed, accepted);
        if let Some(c) = &mut self.cost {
            c.record_verify(accepted + 1, mine);
        }
    }
}
