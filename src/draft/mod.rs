//! Drafting for speculative decoding: drafters propose, K3 decides every token.
//!
//! Contract: a [`Drafter`] is any proposer of the tokens that follow a context — [`NgramDrafter`]
//! (prompt lookup), [`DSparkDrafter`] (the DSpark draft model, which asks for K3's hidden rows
//! through [`Drafter::taps`], receives them in [`Drafter::observe`] and folds them into its latents
//! only when it drafts), [`OracleDrafter`] (replays a recorded run, for benchmarks) and
//! [`AutoDrafter`] (n-gram and DSpark together: `--draft auto`). A [`Speculator`] is one sequence's
//! drafters with the policy that says, per step, whether to draft, with which drafter and how many
//! drafts: by default the union-aware [`UnionPolicy`] (the choice that maximises expected emitted
//! tokens per expected second, the cost of a verify's expert union read from what is resident and
//! the drives' rate, each drafter's call and catch-up as measured); with
//! `DELTAFIN_DRAFT_POLICY=published` (for A/B runs) the published probe-2 / widen-to-7
//! [`WidthPolicy`] under the [`CostModel`] (whether drafting pays, measured on its own steps; in a
//! step shared with other sequences, on its share of it: [`StepCost`]). This module only proposes
//! and learns: the engine's step core (`engine/scheduler/step.rs`) feeds the pending token with the
//! drafts as one verify block, accepts the longest prefix equal to K3's own picks (for a sampling
//! sequence, K3's draws: the speculative-sampling rule for point-mass drafts, [`sampling`]) and
//! commits those rows. Drafts change only speed, never output. The engine builds a sequence's
//! drafters from a [`DraftKind`] (it holds the draft model): `Engine::speculator`.

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
pub use union::{ForwardCost, Offer, UnionPolicy};
pub use width::{GOOD_RECORD, WidthPolicy};

use crate::backend::BackendError;
use crate::k3::forward::RowsOut;
use crate::setting::Setting;
use std::sync::Arc;
use std::time::Instant;

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
    /// Its proposals cost next to nothing (a lookup): the policy asks it first, for as many as it
    /// may use, to see whether it has any.
    fn cheap(&self) -> bool {
        false
    }
    /// The kind of its last proposal, for acceptance learnt apart (n-gram: the matched suffix's
    /// length less one).
    fn class(&self) -> usize {
        0
    }
    /// Whether it could propose after `context` now (false: not asked).
    fn ready(&self, _context: &[u32]) -> bool {
        true
    }
    /// Context rows it would fold before its next draft.
    fn backlog(&self) -> usize {
        0
    }
    /// What its last `propose` cost, split, when it times itself.
    fn last_call(&self) -> Option<CallCost> {
        None
    }
    /// Its own forwards so far: (draft passes, context rows folded).
    fn counters(&self) -> (u64, u64) {
        (0, 0)
    }
    /// The drafters it is made of, taken out, for a policy that chooses among them per step
    /// (None: it drafts alone; [`AutoDrafter`] is made of several).
    fn take_arms(&mut self) -> Option<Vec<Box<dyn Drafter>>> {
        None
    }
}

/// One drafter call's cost: context rows folded first and their seconds, and the block's seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CallCost {
    pub rows: usize,
    pub fold_s: f64,
    pub block_s: f64,
}

/// Several drafters as one (`--draft auto`: n-gram lookup, and DSpark when a draft model is
/// configured); a [`Speculator`] takes it apart and chooses among them per step. Driven as one
/// drafter it proposes the first non-empty proposal, in order.
pub struct AutoDrafter {
    pub arms: Vec<Box<dyn Drafter>>,
    used: Option<usize>,
}

impl AutoDrafter {
    pub fn new(arms: Vec<Box<dyn Drafter>>) -> Self {
        AutoDrafter { arms, used: None }
    }
}

impl Drafter for AutoDrafter {
    fn name(&self) -> &str {
        "auto"
    }

    fn propose(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, BackendError> {
        self.used = None;
        for (i, d) in self.arms.iter_mut().enumerate() {
            if d.ready(context) {
                let p = d.propose(context, k)?;
                if !p.is_empty() {
                    self.used = Some(i);
                    return Ok(p);
                }
            }
        }
        Ok(Vec::new())
    }

    fn taps(&self) -> &[usize] {
        self.arms.iter().map(|d| d.taps()).find(|t| !t.is_empty()).unwrap_or(&[])
    }

    fn observe(&mut self, start: usize, rows: &RowsOut, committed: usize) -> Result<(), BackendError> {
        for d in self.arms.iter_mut().filter(|d| !d.taps().is_empty()) {
            d.observe(start, rows, committed)?;
        }
        Ok(())
    }

    fn counters(&self) -> (u64, u64) {
        self.arms.iter().map(|d| d.counters()).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    }

    fn take_arms(&mut self) -> Option<Vec<Box<dyn Drafter>>> {
        Some(std::mem::take(&mut self.arms))
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
    /// Per step, whichever pays most by expected tokens per second: a single step, an n-gram
    /// draft, or a DSpark draft when a draft model is configured.
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
        DraftKind::Auto => {
            let mut arms: Vec<Box<dyn Drafter>> = vec![Box::new(NgramDrafter::default())];
            arms.extend(dspark());
            Ok(Some(Box::new(AutoDrafter::new(arms))))
        }
        DraftKind::Dspark => dspark().map(Some).ok_or(DraftError::NoDraftModel),
    }
}

/// The environment variable that picks the width policy: `union` (the default) or `published`.
pub const POLICY_ENV: &str = "DELTAFIN_DRAFT_POLICY";

/// The draft made for one step: which drafter, its proposal's class, the width asked for, whether
/// it is a probe, and what a single step would have cost.
#[derive(Clone, Copy, Debug, Default)]
struct Made {
    arm: usize,
    class: usize,
    probe: bool,
    single_s: f64,
}

/// A sequence's drafters with their policy: the union-aware one (which drafter and how wide, per
/// step), or the published width policy with (optionally) the cost model; one per sequence.
pub struct Speculator {
    /// Its drafters: one, or those `--draft auto` chooses among (n-gram, DSpark).
    pub drafters: Vec<Box<dyn Drafter>>,
    name: String,
    /// Some: it decides the width (`width` and `cost` are not used).
    pub union: Option<UnionPolicy>,
    pub width: WidthPolicy,
    /// None: draft whenever the width policy allows (tests, benchmarks of acceptance).
    pub cost: Option<CostModel>,
    /// Its sequence's share of the steps it takes part in.
    share: StepCost,
    /// The draft of the current step (None: a single step).
    made: Option<Made>,
    /// Drafts asked for at the last decision.
    asked: usize,
    /// The drafters' own forwards counted so far (draft passes, context rows folded).
    counted: (u64, u64),
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

    /// `drafter` with the union-aware policy.
    pub fn union(drafter: Box<dyn Drafter>, n_experts: usize) -> Self {
        let max = WidthPolicy::default().max;
        Speculator { union: Some(UnionPolicy::new(max, n_experts)), ..Speculator::without_cost_model(drafter) }
    }

    /// `drafter` with the published width policy and the live cost model.
    pub fn published(drafter: Box<dyn Drafter>) -> Self {
        Speculator { cost: Some(CostModel::default()), ..Speculator::without_cost_model(drafter) }
    }

    /// `drafter` drafting whenever the published width policy allows (of several, the first with
    /// a proposal).
    pub fn without_cost_model(mut drafter: Box<dyn Drafter>) -> Self {
        let name = drafter.name().to_string();
        let drafters = drafter.take_arms().unwrap_or_else(|| vec![drafter]);
        Speculator {
            drafters,
            name,
            union: None,
            width: WidthPolicy::default(),
            cost: None,
            share: StepCost::default(),
            made: None,
            asked: 0,
            counted: (0, 0),
        }
    }

    /// One line for the startup report.
    pub fn describe(&self) -> String {
        let policy = match (&self.union, &self.cost) {
            (Some(u), _) if self.drafters.len() > 1 => {
                format!(
                    "per step a single step or a draft of width 1..{}, whichever gives most tokens per second",
                    u.max
                )
            }
            (Some(u), _) => format!("width 0..{} where expected tokens per second are most", u.max),
            (None, Some(_)) => format!("width {}..{}, pauses while it does not pay", self.width.probe, self.width.max),
            (None, None) => format!("width {}..{}, cost model off", self.width.probe, self.width.max),
        };
        let names: Vec<&str> = self.drafters.iter().map(|d| d.name()).collect();
        match names.as_slice() {
            [one] if *one == self.name => format!("drafter {} ({policy})", self.name),
            _ => format!("drafter {} of {} ({policy})", self.name, names.join(", ")),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether one of its drafters drafts with the engine's draft model (DSpark).
    pub fn uses_draft_model(&self) -> bool {
        self.drafters.iter().any(|d| d.name() == "dspark")
    }

    /// K3 layers whose hidden rows a drafter reads.
    pub fn taps(&self) -> &[usize] {
        self.drafters.iter().map(|d| d.taps()).find(|t| !t.is_empty()).unwrap_or(&[])
    }

    /// Whether it drafts only from K3's hidden rows, so it must see every row of a prompt (a
    /// session resumed from a shared prefix would leave it nothing to draft with). With n-gram
    /// lookup beside it, a resumed session drafts by lookup alone.
    pub fn needs_whole_prompt(&self) -> bool {
        self.drafters.iter().all(|d| !d.taps().is_empty())
    }

    /// Drafts to ask for now (0: feed one row), `others` rows of other sequences being in the
    /// step, with its first drafter: the union-aware policy's, or the published width policy's
    /// unless the cost model pauses.
    pub fn decide(&mut self, others: usize) -> usize {
        self.asked = match &mut self.union {
            Some(u) => u.decide(others),
            None if self.cost.as_ref().is_some_and(|c| !c.allows()) => 0,
            None => self.width.width(),
        };
        self.made = (self.asked > 0).then(Made::default);
        self.asked
    }

    /// At most `k` drafts of its first drafter after `context` (the pending token last).
    pub fn propose(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, BackendError> {
        let mut d = self.drafters[0].propose(context, k)?;
        d.truncate(k);
        Ok(d)
    }

    /// This step's drafts after `context` (the pending token last), at most `limit`, `others`
    /// rows of other sequences being in the step, `sampled` for a sampling sequence: the policy
    /// chooses a single step (none) or a drafter and a width; asked first are the drafters whose
    /// lookups cost nothing, to see what they offer. Returns the drafts and the width decided
    /// (before a drafter's proposal fell short).
    pub fn draft(
        &mut self,
        context: &[u32],
        others: usize,
        limit: usize,
        sampled: bool,
    ) -> Result<(Vec<u32>, usize), BackendError> {
        self.made = None;
        let Some(u) = self.union.as_mut() else {
            // The published width policy: the first drafter with a proposal.
            let k = self.decide(others).min(limit);
            self.made = None;
            if k == 0 {
                return Ok((Vec::new(), 0));
            }
            for (arm, d) in self.drafters.iter_mut().enumerate() {
                if d.ready(context) {
                    let mut p = d.propose(context, k)?;
                    p.truncate(k);
                    if !p.is_empty() {
                        self.made = Some(Made { arm, class: d.class(), ..Made::default() });
                        return Ok((p, k));
                    }
                }
            }
            return Ok((Vec::new(), k));
        };
        u.set_sampled(sampled);
        let most = u.max.min(limit);
        let mut looked: Vec<Option<Vec<u32>>> = Vec::with_capacity(self.drafters.len());
        let mut offers = Vec::new();
        for (arm, d) in self.drafters.iter_mut().enumerate() {
            let mut seen = None;
            if most > 0 && d.ready(context) {
                if d.cheap() {
                    let p = d.propose(context, most)?;
                    if !p.is_empty() {
                        offers.push(Offer { arm, class: d.class(), most: p.len(), sunk: true, backlog: 0 });
                    }
                    seen = Some(p);
                } else {
                    offers.push(Offer { arm, class: 0, most, sunk: false, backlog: d.backlog() });
                }
            }
            looked.push(seen);
        }
        let (pick, w, probe) = u.choose(others, &offers);
        let single_s = u.single_s(others).unwrap_or(0.0);
        self.asked = w;
        let Some(o) = pick.map(|i| offers[i]).filter(|_| w > 0) else { return Ok((Vec::new(), w)) };
        let d = &mut self.drafters[o.arm];
        let mut p = match looked[o.arm].take() {
            Some(p) => p,
            None => {
                let t0 = Instant::now();
                let p = d.propose(context, w)?;
                let c =
                    d.last_call().unwrap_or(CallCost { block_s: t0.elapsed().as_secs_f64(), ..CallCost::default() });
                u.called(o.arm, c.rows, c.fold_s, c.block_s);
                p
            }
        };
        p.truncate(w);
        if !p.is_empty() {
            self.made = Some(Made { arm: o.arm, class: o.class, probe, single_s });
        }
        Ok((p, w))
    }

    /// The drafter that made this step's drafts (None: a single step).
    pub fn drafted_by(&self) -> Option<&str> {
        self.made.map(|m| self.drafters[m.arm].name())
    }

    /// The drafters' forwards since the last call: (draft passes, context rows folded).
    pub fn take_counters(&mut self) -> (u64, u64) {
        let now = self.drafters.iter().map(|d| d.counters()).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        let d = (now.0 - self.counted.0, now.1 - self.counted.1);
        self.counted = now;
        d
    }

    /// Hands its drafters that tap K3's rows a forward's rows from position `start`, `committed`
    /// of them kept.
    pub fn observe(&mut self, start: usize, rows: &RowsOut, committed: usize) -> Result<(), BackendError> {
        for d in self.drafters.iter_mut().filter(|d| !d.taps().is_empty()) {
            d.observe(start, rows, committed)?;
        }
        Ok(())
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
            u.ran(mine, self.made.filter(|m| m.probe).map(|m| (1, m.single_s)));
        }
        self.made = None;
        self.width.tick();
        if let Some(c) = &mut self.cost {
            c.record_step(mine);
        }
    }

    /// A verify of `proposed` drafts kept `accepted`, in a step of `secs` shared by `lanes`
    /// sequences; drafting took `draft_s`.
    pub fn verified(&mut self, proposed: usize, accepted: usize, lanes: usize, secs: f64, draft_s: f64) {
        let mine = self.share.share(proposed + 1, lanes, secs) + draft_s;
        let made = self.made.take().unwrap_or_default();
        if let Some(u) = &mut self.union {
            u.verified_by(made.arm, made.class, proposed, accepted);
            u.ran(mine, made.probe.then_some((accepted + 1, made.single_s)));
        }
        self.width.record(proposed, accepted);
        if let Some(c) = &mut self.cost {
            c.record_verify(accepted + 1, mine);
        }
    }
}
