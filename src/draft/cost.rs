//! Whether drafting pays, from measured times: [`CostModel`] (a verify's time against the
//! tokens it emitted at the single-step rate) and [`StepCost`] (a lane's share of a step it
//! shares with other sequences).
//!
//! Contract: both only decide whether a sequence drafts, never what it emits.

use super::EWMA;

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

// What a lane's rows cost in a shared step: a running fit of step time against rows.
//
// Contract: [`StepCost::observe`] takes each shared step's rows and seconds; [`StepCost::share`]
// is one lane's part of a step — the step's fixed part split among the lanes plus its own rows
// at the per-row rate — from a least-squares fit `seconds = a + b x rows` over recent steps
// (moving averages), or the whole step's time while the fit cannot say (too few steps, rows
// spread too little, or a lane alone). A lane's drafter judges its drafts by this share: in a
// batch the fixed part is paid once for every lane, so a verify's extra rows cost the lane only
// the rows' rate; where rows are all the cost (compute-bound) drafts pay only if nearly all are
// accepted. It changes only whether lanes draft, never what they emit.

/// Weight of the newest step in the moving averages.
const W: f64 = 0.1;
/// Steps seen before the fit is used.
const MIN_STEPS: u32 = 4;
/// Least variance of rows (rows²) for a slope.
const MIN_VAR: f64 = 0.25;

/// Moving averages of rows, seconds, rows² and rows x seconds over the steps seen.
#[derive(Clone, Debug, Default)]
pub struct StepCost {
    n: u32,
    r: f64,
    t: f64,
    rr: f64,
    rt: f64,
}

impl StepCost {
    /// A shared step of `rows` rows took `secs`.
    pub fn observe(&mut self, rows: usize, secs: f64) {
        let r = rows as f64;
        let w = if self.n == 0 { 1.0 } else { W };
        self.r += w * (r - self.r);
        self.t += w * (secs - self.t);
        self.rr += w * (r * r - self.rr);
        self.rt += w * (r * secs - self.rt);
        self.n = self.n.saturating_add(1);
    }

    /// (fixed seconds a step, seconds a row), when the steps seen can say.
    fn fit(&self) -> Option<(f64, f64)> {
        let var = self.rr - self.r * self.r;
        if self.n < MIN_STEPS || var.is_nan() || var < MIN_VAR {
            return None;
        }
        let b = ((self.rt - self.r * self.t) / var).max(0.0);
        Some(((self.t - b * self.r).max(0.0), b))
    }

    /// A lane's part of a step of `secs` shared by `lanes` lanes, for its `mine` rows.
    pub fn share(&self, mine: usize, lanes: usize, secs: f64) -> f64 {
        match self.fit() {
            Some((a, b)) if lanes > 1 => a / lanes as f64 + b * mine as f64,
            _ => secs,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn the_fit_finds_the_fixed_part_and_the_row_rate() {
        let mut c = StepCost::default();
        assert_eq!(c.share(3, 4, 1.0), 1.0, "no steps: the whole step");
        for rows in [8, 12, 10, 20, 8, 16, 9, 30] {
            c.observe(rows, 0.5 + 0.01 * rows as f64);
        }
        let (a, b) = c.fit().unwrap();
        assert!((a - 0.5).abs() < 1e-9 && (b - 0.01).abs() < 1e-9, "{a} {b}");
        assert!((c.share(3, 4, 9.0) - (0.125 + 0.03)).abs() < 1e-9);
        assert_eq!(c.share(3, 1, 9.0), 9.0, "a lane alone: its step");
        let mut flat = StepCost::default();
        for _ in 0..10 {
            flat.observe(8, 0.3);
        }
        assert_eq!(flat.share(2, 8, 0.3), 0.3, "rows that never change say nothing of their rate");
    }
}
