//! Speculative decoding: drafters propose, K3 decides every token.
//!
//! Contract: [`Session::generate_speculative`] emits exactly the tokens of
//! [`Session::generate`] (same tokens, `on_token` once per token in order, same stop, `max_new`
//! and cancel semantics) and leaves the session in the same state (committed tokens and logits).
//! Each step feeds the pending token with up to k drafts as one verify batch
//! (`Session::verify`: one expert-union read per MoE layer for all k+1 rows, nothing committed),
//! accepts the longest prefix of drafts equal to K3's own greedy picks, emits those and commits
//! their rows (`Session::commit`, bit-identical to feeding them one by one); K3's pick after the
//! last kept row is the next pending token. Drafters only change speed, never output. With a
//! sampling [`Sampler`], K3's pick at each row is a draw and a draft is kept when the draw equals
//! it — the speculative-sampling rule for point-mass drafts ([`sampling`]), giving the tokens of
//! plain sampling with the same seed.
//!
//! How wide to draft is the [`WidthPolicy`] (the published probe-2 / widen-to-7 policy) and
//! whether to draft at all is also up to the [`CostModel`] (measured verify vs single-step time).
//! A [`Drafter`] is any proposer: [`NgramDrafter`] (prompt lookup), [`DSparkDrafter`] (the
//! DSpark draft model, which asks for K3's hidden rows through [`Drafter::taps`] and receives
//! them in [`Drafter::observe`]), and [`OracleDrafter`] (replays a recorded run, for benchmarks).

pub mod dspark;
mod lane;
mod ngram;
mod oracle;
pub mod sampling;

pub use crate::k3::dspark::DSparkModel;
pub use dspark::DSparkDrafter;
pub use ngram::NgramDrafter;
pub use oracle::OracleDrafter;

use crate::backend::BackendError;
use crate::engine::session::emit;
use crate::engine::{Engine, GenerateOptions, Generation, Session, StopReason};
use crate::k3::ForwardError;
use crate::sample::Sampler;
use crate::sched::RowsOut;
use crate::setting::Setting;
use std::sync::Arc;
use std::time::Instant;

/// Proposes draft tokens from the context; K3 verifies them.
pub trait Drafter: Send {
    /// Short name for startup lines and reports.
    fn name(&self) -> &str;
    /// Up to `k` tokens predicted to follow `context` (prompt + output, the pending token last).
    /// Fewer (or none) is fine; more than `k` are ignored. A drafter that computes on the
    /// backend fails with its error.
    fn propose(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, BackendError>;
    /// K3 layers whose hidden rows this drafter reads (none for n-gram). When non-empty every
    /// feed goes through `verify` so that each committed row's taps reach [`Drafter::observe`].
    fn taps(&self) -> &[usize] {
        &[]
    }
    /// Called after each feed with the forward's output, the position of its first row and how
    /// many of its rows were committed. On an error the drafter keeps a context it can draft
    /// from (at worst none).
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
pub enum SpecError {
    #[error(
        "{} dspark needs a DSpark checkpoint: give {} DIR (or use {} ngram / auto)",
        Setting::Draft,
        Setting::DraftModel,
        Setting::Draft
    )]
    NoDraftModel,
}

/// The drafter for `kind` on `engine` (None for `Off`); DSpark uses the engine's draft model.
pub fn drafter_for(kind: DraftKind, engine: &Engine) -> Result<Option<Box<dyn Drafter>>, SpecError> {
    let dspark = || engine.draft.as_ref().map(|m| Box::new(DSparkDrafter::new(Arc::clone(m))) as Box<dyn Drafter>);
    match kind {
        DraftKind::Off => Ok(None),
        DraftKind::Ngram => Ok(Some(Box::new(NgramDrafter::default()))),
        DraftKind::Auto => Ok(Some(dspark().unwrap_or_else(|| Box::new(NgramDrafter::default())))),
        DraftKind::Dspark => dspark().map(Some).ok_or(SpecError::NoDraftModel),
    }
}

/// Draft width: probe with `probe` tokens; all accepted -> `max`; some -> max(probe, min(max,
/// 2 x accepted)); none -> pause for `pause_steps` single steps (doubling while probes keep
/// failing, up to `max_pause_steps`), then probe again — unless the drafter's recent record is good
/// (a moving average of the accepted share of at least [`GOOD_RECORD`]): then one miss only sends
/// it back to the probe width. A trained drafter's first draft is wrong now and then (on the demo
/// model about one verify in four); pausing it for 8+ steps each time threw away a third of its
/// tokens, while a drafter that keeps missing still pauses after its record falls.
#[derive(Clone, Debug)]
pub struct WidthPolicy {
    pub probe: usize,
    pub max: usize,
    pub pause_steps: usize,
    pub max_pause_steps: usize,
    width: usize,
    paused: usize,
    next_pause: usize,
    /// Moving average of accepted / proposed per verify (0 before any).
    record: f64,
}

/// A drafter whose moving average of accepted drafts is at least this is not paused by one miss.
pub const GOOD_RECORD: f64 = 0.5;

impl Default for WidthPolicy {
    fn default() -> Self {
        WidthPolicy::new(2, 7, 8, 128)
    }
}

impl WidthPolicy {
    pub fn new(probe: usize, max: usize, pause_steps: usize, max_pause_steps: usize) -> Self {
        let probe = probe.max(1);
        let max = max.max(probe);
        WidthPolicy {
            probe,
            max,
            pause_steps,
            max_pause_steps,
            width: probe,
            paused: 0,
            next_pause: pause_steps,
            record: 0.0,
        }
    }

    /// Drafts to ask for now (0 while paused).
    pub fn width(&self) -> usize {
        if self.paused > 0 { 0 } else { self.width }
    }

    /// One token fed without drafts: a pause runs down.
    pub fn tick(&mut self) {
        self.paused = self.paused.saturating_sub(1);
    }

    /// The outcome of one verify: `accepted` of `proposed` drafts.
    pub fn record(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        let good = self.record >= GOOD_RECORD;
        self.record += EWMA * (accepted as f64 / proposed as f64 - self.record);
        if accepted == 0 && good {
            self.width = self.probe;
            return;
        }
        if accepted == 0 {
            // The published runtime stops for the request; pausing lets a later cycle in the
            // output still be found (a paused drafter costs nothing).
            self.paused = self.next_pause;
            self.next_pause = (self.next_pause * 2).clamp(1, self.max_pause_steps.max(1));
            self.width = self.probe;
            return;
        }
        self.next_pause = self.pause_steps;
        self.width = if accepted >= proposed { self.max } else { (2 * accepted).clamp(self.probe, self.max) };
    }
}

/// Whether drafting pays, from measured times: a single step's seconds (moving average) against
/// each verify's seconds (draft + verify + commit) for the tokens it emitted. The credit is a
/// moving average of (emitted x step seconds - verify seconds); drafting pauses for `retry_steps`
/// single steps (doubling up to `max_retry_steps` while it keeps not paying) when the credit is
/// negative after `min_verifies` verifies, then tries again with a fresh credit.
#[derive(Clone, Debug)]
pub struct CostModel {
    pub retry_steps: usize,
    pub max_retry_steps: usize,
    pub min_verifies: usize,
    step_s: Option<f64>,
    credit: f64,
    verifies: usize,
    paused: usize,
    next_retry: usize,
    /// Times drafting was paused for not paying.
    pub pauses: u64,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel::new(16, 256, 2)
    }
}

/// Weight of the newest sample in the moving averages.
const EWMA: f64 = 0.3;

impl CostModel {
    pub fn new(retry_steps: usize, max_retry_steps: usize, min_verifies: usize) -> Self {
        CostModel {
            retry_steps,
            max_retry_steps,
            min_verifies: min_verifies.max(1),
            step_s: None,
            credit: 0.0,
            verifies: 0,
            paused: 0,
            next_retry: retry_steps,
            pauses: 0,
        }
    }

    /// Drafting is allowed: a target-only step has been measured and no pause is running.
    pub fn allows(&self) -> bool {
        self.step_s.is_some() && self.paused == 0
    }

    /// The measured single-step seconds (moving average).
    pub fn step_s(&self) -> Option<f64> {
        self.step_s
    }

    /// A single step took `secs`.
    pub fn record_step(&mut self, secs: f64) {
        self.step_s = Some(self.step_s.map_or(secs, |s| s + EWMA * (secs - s)));
        self.paused = self.paused.saturating_sub(1);
    }

    /// A verify took `secs` in all and emitted `emitted` tokens.
    pub fn record_verify(&mut self, emitted: usize, secs: f64) {
        let Some(step) = self.step_s else { return };
        let gain = emitted as f64 * step - secs;
        self.credit = if self.verifies == 0 { gain } else { self.credit + EWMA * (gain - self.credit) };
        self.verifies += 1;
        if self.verifies >= self.min_verifies {
            if self.credit < 0.0 {
                self.paused = self.next_retry.max(1);
                self.next_retry = (self.next_retry * 2).clamp(1, self.max_retry_steps.max(1));
                self.credit = 0.0;
                self.verifies = 0;
                self.pauses += 1;
            } else {
                self.next_retry = self.retry_steps;
            }
        }
    }
}

/// A drafter with its width policy and (optionally) the cost model; one per request.
pub struct Speculator {
    pub drafter: Box<dyn Drafter>,
    pub width: WidthPolicy,
    /// None: draft whenever the width policy allows (tests, benchmarks of acceptance).
    pub cost: Option<CostModel>,
}

impl Speculator {
    /// `drafter` with the published width policy and the live cost model.
    pub fn new(drafter: Box<dyn Drafter>) -> Self {
        Speculator { drafter, width: WidthPolicy::default(), cost: Some(CostModel::default()) }
    }

    /// `drafter` drafting whenever the width policy allows.
    pub fn without_cost_model(drafter: Box<dyn Drafter>) -> Self {
        Speculator { drafter, width: WidthPolicy::default(), cost: None }
    }

    /// One line for the startup report.
    pub fn describe(&self) -> String {
        format!(
            "drafter {} (width {}..{}, {})",
            self.drafter.name(),
            self.width.probe,
            self.width.max,
            if self.cost.is_some() { "pauses while it does not pay" } else { "cost model off" }
        )
    }

    /// Drafts to ask for now.
    fn width(&self) -> usize {
        if self.cost.as_ref().is_some_and(|c| !c.allows()) { 0 } else { self.width.width() }
    }

    /// Prefills `tokens` on `session`, handing the drafter the prompt rows it taps.
    pub fn prefill<'s>(&mut self, session: &'s mut Session, tokens: &[u32]) -> Result<&'s [f32], ForwardError> {
        let taps = self.drafter.taps().to_vec();
        if taps.is_empty() {
            return session.prefill(tokens);
        }
        let drafter = &mut self.drafter;
        // The drafter's failure (its backend) ends the prefill as one of the model's would.
        let mut failed = None;
        let logits = session.prefill_observed(tokens, &taps, &mut |start, rows, n| {
            if failed.is_none()
                && let Err(e) = drafter.observe(start, rows, n)
            {
                failed = Some(e);
            }
        });
        match failed {
            Some(e) => Err(e.into()),
            None => logits,
        }
    }
}

impl Session {
    /// Greedy generation with drafts verified in batches; see the module contract. The output is
    /// that of [`Session::generate`] with the same options.
    pub fn generate_speculative(
        &mut self,
        opts: &GenerateOptions,
        spec: &mut Speculator,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Generation, ForwardError> {
        self.generate_speculative_sampled(opts, spec, &mut Sampler::greedy(), on_token)
    }

    /// [`Session::generate_speculative`] with tokens chosen by `sampler`: K3's pick at each row is
    /// `sampler.pick`, and a draft is accepted when the pick equals it (see [`sampling`]: for a
    /// drafter's point-mass proposal this is the speculative-sampling accept/reject rule, and the
    /// tokens equal [`Session::generate_sampled`]'s with the same sampler bit for bit).
    pub fn generate_speculative_sampled(
        &mut self,
        opts: &GenerateOptions,
        spec: &mut Speculator,
        sampler: &mut Sampler,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Generation, ForwardError> {
        let Some(first) = self.logits() else { return Err(ForwardError::Empty) };
        let mut logits = first.to_vec();
        let vocab = self.engine().cfg.vocab;
        let taps: Vec<usize> = spec.drafter.taps().to_vec();
        let mut out = Vec::with_capacity(opts.max_new);
        // Prompt + output; the pending (emitted, not yet fed) token is last.
        let mut ctx = self.tokens().to_vec();
        let started = self.decode_start();
        // K3's pick at a rejected draft's row, already drawn: the next pending token.
        let mut picked = None;
        let reason = loop {
            if out.len() >= opts.max_new {
                break StopReason::Length;
            }
            let next = match picked.take() {
                Some(t) => t,
                None => sampler.pick_on(&*self.engine().model.be, &logits)?,
            };
            ctx.push(next);
            if let Some(r) = emit(&mut out, next, opts, on_token) {
                break r;
            }
            // Accepting all k drafts emits k + 1 tokens: stay within max_new.
            let k = spec.width().min(opts.max_new - out.len() - 1);
            let mut drafts = Vec::new();
            let mut draft_s = 0.0;
            if k > 0 {
                let td = Instant::now();
                drafts = spec.drafter.propose(&ctx, k)?;
                drafts.truncate(k);
                draft_s = td.elapsed().as_secs_f64();
                self.stats.draft_s += draft_s;
            }
            if drafts.is_empty() {
                let ts = Instant::now();
                if taps.is_empty() {
                    logits = self.step(next)?.to_vec();
                } else {
                    let start = self.pos();
                    let rows = self.verify(&[next], &taps)?;
                    self.commit(1)?;
                    spec.drafter.observe(start, &rows, 1)?;
                    logits = rows.logits;
                }
                spec.width.tick();
                if let Some(c) = &mut spec.cost {
                    c.record_step(ts.elapsed().as_secs_f64());
                }
                continue;
            }
            let tv = Instant::now();
            let mut rows = Vec::with_capacity(drafts.len() + 1);
            rows.push(next);
            rows.extend_from_slice(&drafts);
            let start = self.pos();
            let got = self.verify(&rows, &taps)?;
            // K3's pick after row i is the check of draft i (row i + 1).
            let mut accepted = 0;
            for (i, &d) in drafts.iter().enumerate() {
                let x = sampler.pick_on(&*self.engine().model.be, &got.logits[i * vocab..(i + 1) * vocab])?;
                if x != d {
                    picked = Some(x);
                    break;
                }
                accepted += 1;
            }
            self.stats.record_drafts(drafts.len(), accepted);
            // Emit the accepted drafts exactly as `generate` would; an end among them keeps only
            // the rows `generate` would have fed (the ending token itself is not fed).
            let mut keep = 1 + accepted;
            let mut ended = None;
            for (i, &d) in drafts[..accepted].iter().enumerate() {
                ctx.push(d);
                ended = emit(&mut out, d, opts, on_token);
                if ended.is_some() {
                    keep = 1 + i;
                    break;
                }
            }
            self.commit(keep)?;
            spec.drafter.observe(start, &got, keep)?;
            spec.width.record(drafts.len(), accepted);
            if let Some(c) = &mut spec.cost {
                c.record_verify(accepted + 1, tv.elapsed().as_secs_f64() + draft_s);
            }
            if let Some(r) = ended {
                break r;
            }
            logits = got.logits[accepted * vocab..(accepted + 1) * vocab].to_vec();
        };
        self.decode_end(started, out.len());
        self.stats.drafter = Some(spec.drafter.name().to_string());
        Ok(Generation { tokens: out, reason })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn width_policy_as_published() {
        let mut w = WidthPolicy::default();
        assert_eq!(w.width(), 2);
        w.record(2, 2);
        assert_eq!(w.width(), 7, "full match widens to the max");
        w.record(7, 3);
        assert_eq!(w.width(), 6, "partial: 2 x accepted");
        w.record(6, 1);
        assert_eq!(w.width(), 2, "partial: at least the probe");
        w.record(2, 1);
        assert_eq!(w.width(), 2);
        w.record(2, 2);
        w.record(7, 5);
        assert_eq!(w.width(), 7, "partial: at most the max");
        w.record(3, 3);
        assert_eq!(w.width(), 7, "all of a short proposal is a full match");
        w.record(0, 0);
        assert_eq!(w.width(), 7, "no proposal changes nothing");
    }

    #[test]
    fn zero_accepted_pauses_then_probes_again_with_backoff() {
        let mut w = WidthPolicy::new(2, 7, 3, 8);
        w.record(2, 2);
        w.record(7, 0);
        for _ in 0..3 {
            assert_eq!(w.width(), 0);
            w.tick();
        }
        assert_eq!(w.width(), 2, "after the pause it probes at 2");
        w.record(2, 0);
        for _ in 0..6 {
            assert_eq!(w.width(), 0, "a second failure pauses twice as long");
            w.tick();
        }
        assert_eq!(w.width(), 2);
        w.record(2, 0);
        for _ in 0..8 {
            assert_eq!(w.width(), 0, "the pause is capped");
            w.tick();
        }
        w.record(2, 1);
        w.record(2, 0);
        assert_eq!(w.width(), 0);
        for _ in 0..3 {
            w.tick();
        }
        assert_eq!(w.width(), 2, "an acceptance resets the backoff");
    }

    #[test]
    fn a_drafter_with_a_good_record_is_not_paused_by_one_miss() {
        let mut w = WidthPolicy::new(2, 7, 3, 8);
        for _ in 0..6 {
            w.record(7, 7);
        }
        w.record(7, 0);
        assert_eq!(w.width(), 2, "one miss: back to the probe, no pause");
        w.record(2, 0);
        assert_eq!(w.width(), 2, "the record (0.62) is still good");
        w.record(2, 0);
        assert_eq!(w.width(), 0, "a third miss in a row: the record fell below the bar, so it pauses");
    }

    #[test]
    fn cost_model_needs_a_step_first_and_pauses_while_drafting_does_not_pay() {
        let mut c = CostModel::new(4, 8, 2);
        assert!(!c.allows(), "a target-only step is measured first");
        c.record_step(1.0);
        assert!(c.allows());
        // 3 tokens for 1.5 steps' time: pays.
        c.record_verify(3, 1.5);
        c.record_verify(3, 1.5);
        assert!(c.allows());
        // 1 token for 3 steps' time, twice: the credit turns negative.
        c.record_verify(1, 3.0);
        c.record_verify(1, 3.0);
        assert!(!c.allows());
        assert_eq!(c.pauses, 1);
        for _ in 0..4 {
            assert!(!c.allows());
            c.record_step(1.0);
        }
        assert!(c.allows(), "retries after the pause");
        c.record_verify(1, 3.0);
        c.record_verify(1, 3.0);
        assert!(!c.allows());
        for _ in 0..8 {
            assert!(!c.allows(), "a second pause is twice as long");
            c.record_step(1.0);
        }
        assert!(c.allows());
    }
}
