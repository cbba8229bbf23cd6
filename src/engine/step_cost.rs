//! What a lane's rows cost in a shared step: a running fit of step time against rows.
//!
//! Contract: [`StepCost::observe`] takes each shared step's rows and seconds; [`StepCost::share`]
//! is one lane's part of a step — the step's fixed part split among the lanes plus its own rows
//! at the per-row rate — from a least-squares fit `seconds = a + b x rows` over recent steps
//! (moving averages), or the whole step's time while the fit cannot say (too few steps, rows
//! spread too little, or a lane alone). A lane's drafter judges its drafts by this share: in a
//! batch the fixed part is paid once for every lane, so a verify's extra rows cost the lane only
//! the rows' rate; where rows are all the cost (compute-bound) drafts pay only if nearly all are
//! accepted. It changes only whether lanes draft, never what they emit.

/// Weight of the newest step in the moving averages.
const W: f64 = 0.1;
/// Steps seen before the fit is used.
const MIN_STEPS: u32 = 4;
/// Least variance of rows (rows²) for a slope.
const MIN_VAR: f64 = 0.25;

/// Moving averages of rows, seconds, rows² and rows x seconds over the steps seen.
#[derive(Clone, Debug, Default)]
pub(super) struct StepCost {
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
