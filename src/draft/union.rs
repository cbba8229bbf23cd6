//! The union-aware draft width: per verify, the width w in 0..=max that maximises expected emitted
//! tokens per expected second (bench/results/2026-12-05-route-overlap/README.md, "What the live
//! union-aware policy needs").
//!
//! Contract: [`UnionPolicy::decide`] is the drafts to ask for now (0: a single step), from what it
//! learnt of its own sequence: [`UnionPolicy::observe`] takes every forward it took part in
//! ([`ForwardCost`]: rows, expert union, bytes read, read wait, kernel time), [`UnionPolicy::verified`]
//! each verify's outcome and [`UnionPolicy::drafted`] what asking the drafter cost. It decides only
//! how many tokens are drafted, never which tokens are emitted.
//!
//! The model: E_w = 1 + sum over r = 1..w of a_1 x ... x a_r, with a_i the conditional acceptance
//! at draft position i (a moving average over this sequence's verifies, from a prior). C(n), the
//! seconds of a forward of n rows, is trunk(n) + L x [kernel(U(n), n) + M(n) x expert bytes x
//! seconds per byte read], with L the MoE layers a forward passes; U(n) the expert union per layer
//! of n rows (a moving average per row count from the forwards seen; a row count not seen yet
//! scaled from the nearest one seen as independent routing over `n_experts` would); M(n) the part
//! of it not resident: the single steps' missing share of the first row's experts plus the verifies'
//! missing share of the experts the other rows add (read from drives: bytes read over one expert's
//! bytes, so RAM- and device-cache hits count as resident); seconds per byte from the forwards'
//! read waits over their bytes read (what a read costs after overlap with compute); kernel time
//! a fit of per-layer expert kernel seconds against (union, expert rows); trunk time (the rest of a
//! forward) a fit against rows (`StepCost`). A lane's verify costs C(others + 1 + w) − C(others)
//! (`others`: the rows other lanes feed in the same step) plus, for w > 0, the drafter's seconds a
//! call (a moving average).
//! w = 0 when a single step is best; after `EXPLORE_FIRST` single steps in a row (doubling to
//! `EXPLORE_MOST`) it drafts one token anyway, so a sequence whose text turns predictable (or whose
//! costs change) is found again.

use super::StepCost;
use crate::stats::Stats;

/// Forwards of more rows than this teach nothing about verifies (prompt chunks).
pub const MAX_ROWS: usize = 16;
/// Weight of the newest sample in the moving averages of costs.
const W: f64 = 0.2;
/// Weight of the newest verify in the per-position acceptance.
const W_ACCEPT: f64 = 0.2;
/// Conditional acceptance per position before any verify of this sequence.
pub const PRIOR_ACCEPT: f64 = 0.5;
/// Single steps in a row before a probe (two drafts), then doubling up to the most.
const EXPLORE_FIRST: usize = 16;
const EXPLORE_MOST: usize = 256;

/// One forward's cost and reads, the policy's observation.
#[derive(Clone, Copy, Debug, Default)]
pub struct ForwardCost {
    pub rows: usize,
    /// MoE layer passes.
    pub layers: u64,
    /// Sum over passes of the distinct experts needed.
    pub experts: u64,
    /// Expert-row products.
    pub expert_rows: u64,
    /// One expert's bytes.
    pub expert_bytes: u64,
    /// Bytes read from drives (None: the source cannot tell; then every expert is taken as read).
    pub bytes_read: Option<u64>,
    pub read_wait_s: f64,
    pub kernel_s: f64,
    pub secs: f64,
}

impl ForwardCost {
    /// A forward of `rows` rows that took `secs`, from its counters.
    pub fn from_stats(rows: usize, secs: f64, s: &Stats) -> Self {
        ForwardCost {
            rows,
            layers: s.reads.layer_passes,
            experts: s.reads.experts_fetched,
            expert_rows: s.reads.expert_rows,
            expert_bytes: s.reads.expert_bytes,
            bytes_read: s.reads.expert_bytes_read,
            read_wait_s: s.phases.read_wait_s,
            kernel_s: s.phases.expert_kernel_s,
            secs,
        }
    }
}

/// A moving average (None before the first sample).
#[derive(Clone, Copy, Debug, Default)]
struct Avg(Option<f64>);

impl Avg {
    fn add(&mut self, x: f64, w: f64) {
        if x.is_finite() {
            self.0 = Some(self.0.map_or(x, |a| a + w * (x - a)));
        }
    }
}

/// The union-aware width policy of one sequence (see the module contract).
#[derive(Clone, Debug)]
pub struct UnionPolicy {
    pub max: usize,
    /// Routed experts per MoE layer (for scaling unions to row counts not seen; 0: unknown).
    pub n_experts: usize,
    accept: Vec<f64>,
    /// Union per layer by rows (index = rows).
    union: Vec<Avg>,
    layers: Avg,
    /// Expert rows per row per layer (top-k).
    topk: Avg,
    expert_bytes: f64,
    miss_first: Avg,
    miss_extra: Avg,
    /// Moving averages of read wait and bytes read (their ratio: seconds per byte).
    wait_s: Avg,
    read_bytes: Avg,
    /// Moments of (union, expert rows) -> kernel seconds, per layer.
    k: [Avg; 5],
    trunk: StepCost,
    trunk_mean: Avg,
    draft_s: Avg,
    zeros: usize,
    explore_every: usize,
    /// Decisions made at each width (index = width) and probes among them.
    pub widths: Vec<u64>,
    pub probes: u64,
}

impl UnionPolicy {
    /// Widths up to `max`, over MoE layers of `n_experts` routed experts (0: unknown).
    pub fn new(max: usize, n_experts: usize) -> Self {
        UnionPolicy {
            max,
            n_experts,
            accept: vec![PRIOR_ACCEPT; max],
            union: vec![Avg::default(); MAX_ROWS + 1],
            layers: Avg::default(),
            topk: Avg::default(),
            expert_bytes: 0.0,
            miss_first: Avg::default(),
            miss_extra: Avg::default(),
            wait_s: Avg::default(),
            read_bytes: Avg::default(),
            k: [Avg::default(); 5],
            trunk: StepCost::default(),
            trunk_mean: Avg::default(),
            draft_s: Avg::default(),
            zeros: 0,
            explore_every: EXPLORE_FIRST,
            widths: vec![0; max + 1],
            probes: 0,
        }
    }

    /// A forward this sequence took part in.
    pub fn observe(&mut self, f: &ForwardCost) {
        if f.rows == 0 || f.rows > MAX_ROWS || !f.secs.is_finite() {
            return;
        }
        let n = f.rows;
        let mut rest = f.secs - f.kernel_s - f.read_wait_s;
        if f.layers > 0 && f.experts > 0 {
            let l = f.layers as f64;
            let u = f.experts as f64 / l;
            self.layers.add(l, W);
            self.union[n].add(u, W);
            self.topk.add(f.expert_rows as f64 / l / n as f64, W);
            self.expert_bytes = self.expert_bytes.max(f.expert_bytes as f64);
            let eb = f.expert_bytes.max(1) as f64;
            let missing = f.bytes_read.map_or(u, |b| (b as f64 / eb / l).min(u));
            if n == 1 {
                self.miss_first.add(missing / u, W);
            } else if let (Some(u1), Some(m1)) = (self.union_at(1), self.miss_first.0) {
                let extra = u - u1;
                if extra >= 0.5 {
                    self.miss_extra.add(((missing - m1 * u1) / extra).clamp(0.0, 1.0), W);
                }
            }
            let read = f.bytes_read.unwrap_or(f.experts * f.expert_bytes) as f64;
            if read > 0.0 {
                self.wait_s.add(f.read_wait_s, W);
                self.read_bytes.add(read, W);
            }
            let (x1, x2, y) = (u, f.expert_rows as f64 / l, f.kernel_s / l);
            for (m, v) in self.k.iter_mut().zip([x1 * x1, x1 * x2, x2 * x2, x1 * y, x2 * y]) {
                m.add(v, W);
            }
        } else {
            rest = f.secs;
        }
        self.trunk.observe(n, rest.max(0.0));
        self.trunk_mean.add(rest.max(0.0), W);
    }

    /// A verify of `proposed` drafts kept the first `accepted`.
    pub fn verified(&mut self, proposed: usize, accepted: usize) {
        for (i, a) in self.accept.iter_mut().enumerate().take(proposed.min(accepted + 1)) {
            let hit = if i < accepted { 1.0 } else { 0.0 };
            *a += W_ACCEPT * (hit - *a);
        }
    }

    /// Asking the drafter for `asked` drafts took `secs` (a call's cost: DSpark drafts its whole
    /// block in one pass whatever the width, n-gram lookup costs next to nothing).
    pub fn drafted(&mut self, asked: usize, secs: f64) {
        if asked > 0 {
            self.draft_s.add(secs, W);
        }
    }

    /// The conditional acceptance it holds for each draft position.
    pub fn acceptance(&self) -> &[f64] {
        &self.accept
    }

    /// Expected tokens a verify of `w` drafts emits.
    pub fn emitted(&self, w: usize) -> f64 {
        let mut p = 1.0;
        let mut e = 1.0;
        for a in self.accept.iter().take(w) {
            p *= a;
            e += p;
        }
        e
    }

    /// The union per layer of `n` rows: seen, or scaled from the nearest row count seen.
    fn union_at(&self, n: usize) -> Option<f64> {
        if let Some(u) = self.union.get(n).and_then(|a| a.0) {
            return Some(u);
        }
        let (m, um) =
            (1..=MAX_ROWS).filter_map(|m| self.union[m].0.map(|u| (m, u))).min_by_key(|&(m, _)| m.abs_diff(n))?;
        let k = self.topk.0.unwrap_or(um / m as f64).max(1e-9);
        let f = |r: usize| match self.n_experts {
            0 => k * r as f64,
            e => {
                let e = e as f64;
                e * (1.0 - (1.0 - (k / e).min(1.0)).powi(r as i32))
            }
        };
        Some(um * f(n) / f(m))
    }

    /// Kernel seconds per layer for per-expert and per-expert-row work.
    fn kernel_rates(&self) -> Option<(f64, f64)> {
        let [s11, s12, s22, s1y, s2y] = self.k.map(|a| a.0);
        let (s11, s12, s22, s1y, s2y) = (s11?, s12?, s22?, s1y?, s2y?);
        let det = s11 * s22 - s12 * s12;
        if det > 1e-6 * s11 * s22 {
            let ke = (s22 * s1y - s12 * s2y) / det;
            let kr = (s11 * s2y - s12 * s1y) / det;
            if ke >= 0.0 && kr >= 0.0 {
                return Some((ke, kr));
            }
        }
        (s11 > 0.0).then(|| (s1y / s11, 0.0))
    }

    /// Expected seconds of a forward of `n` rows (0 for none; None before enough is seen).
    pub fn forward_s(&self, n: usize) -> Option<f64> {
        if n == 0 {
            return Some(0.0);
        }
        let trunk = match self.trunk.fit() {
            Some((a, b)) => a + b * n as f64,
            // Until rows have spread enough for a slope, extra rows are taken to cost the trunk
            // nothing (its weights are read once a forward): verifies run and teach the slope.
            None => self.trunk_mean.0?,
        };
        let Some(l) = self.layers.0 else { return Some(trunk) };
        let (u1, u) = (self.union_at(1)?, self.union_at(n)?);
        let m1 = self.miss_first.0.unwrap_or(1.0);
        let mx = self.miss_extra.0.unwrap_or(m1);
        let missing = m1 * u1.min(u) + mx * (u - u1).max(0.0);
        let per_byte = match (self.wait_s.0, self.read_bytes.0) {
            (Some(w), Some(b)) if b > 0.0 => w / b,
            _ => 0.0,
        };
        let (ke, kr) = self.kernel_rates().unwrap_or((0.0, 0.0));
        let k = self.topk.0.unwrap_or(u1);
        Some(trunk + l * (ke * u + kr * k * n as f64 + missing * self.expert_bytes * per_byte))
    }

    /// The width that maximises E_w / cost_w with `others` rows of other lanes in the step, and
    /// its score (tokens per second) for each width: None before a forward has been seen.
    pub fn best(&self, others: usize) -> Option<(usize, Vec<f64>)> {
        let base = self.forward_s(others)?;
        let draft = self.draft_s.0.unwrap_or(0.0);
        let mut scores = Vec::with_capacity(self.max + 1);
        for w in 0..=self.max {
            let c = self.forward_s(others + 1 + w)? - base + if w > 0 { draft } else { 0.0 };
            scores.push(self.emitted(w) / c.max(1e-12));
        }
        let mut best = 0;
        for (w, &s) in scores.iter().enumerate() {
            if s > scores[best] {
                best = w;
            }
        }
        Some((best, scores))
    }

    /// The drafts to ask for now, `others` rows of other lanes being in the step (see the module
    /// contract); counted in `widths`.
    pub fn decide(&mut self, others: usize) -> usize {
        let best = self.best(others);
        let mut w = best.as_ref().map_or(0, |(w, _)| *w);
        if w == 0 && best.is_some() {
            self.zeros += 1;
            if self.zeros >= self.explore_every && self.max > 0 {
                self.zeros = 0;
                self.explore_every = (self.explore_every * 2).min(EXPLORE_MOST);
                self.probes += 1;
                // Two wide, so the second position learns too (a one-token probe left it at the prior).
                w = 2.min(self.max);
            }
        } else if w > 0 {
            self.zeros = 0;
            self.explore_every = EXPLORE_FIRST;
        }
        self.widths[w] += 1;
        w
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: u64 = 10;
    const EB: u64 = 1 << 20;

    /// A forward of `rows` rows with `u` experts per layer, `read` of them read from the drive at
    /// `per_byte` seconds a byte, kernels at 0.5 ms an expert and 10 us an expert row, and a trunk
    /// of 20 ms + 1 ms a row.
    fn forward(rows: usize, u: u64, read: f64, per_byte: f64) -> ForwardCost {
        let bytes = (read * (u * L * EB) as f64) as u64;
        let kernel = L as f64 * (0.0005 * u as f64 + 0.00001 * (8 * rows) as f64);
        let wait = bytes as f64 * per_byte;
        ForwardCost {
            rows,
            layers: L,
            experts: u * L,
            expert_rows: 8 * rows as u64 * L,
            expert_bytes: EB,
            bytes_read: Some(bytes),
            read_wait_s: wait,
            kernel_s: kernel,
            secs: 0.02 + 0.001 * rows as f64 + kernel + wait,
        }
    }

    fn taught(read: f64, per_byte: f64) -> UnionPolicy {
        let mut p = UnionPolicy::new(7, 64);
        for _ in 0..4 {
            for (rows, u) in [(1, 8), (2, 15), (1, 8), (4, 26), (1, 8), (8, 40)] {
                p.observe(&forward(rows, u, read, per_byte));
            }
        }
        p
    }

    #[test]
    fn a_slow_drive_and_low_acceptance_keep_drafts_off() {
        // Every expert read from a 200 MB/s drive; the drafter's first draft kept once in six.
        let mut p = taught(1.0, 1.0 / 200e6);
        assert_eq!(p.best(0).unwrap().0, 0, "even at the prior acceptance a verify's union costs more than it emits");
        for _ in 0..8 {
            p.verified(2, 0);
        }
        assert!(p.acceptance()[0] < 0.1);
        assert_eq!(p.decide(0), 0);
        let c1 = p.forward_s(1).unwrap();
        let c2 = p.forward_s(2).unwrap();
        assert!(c2 / c1 > 1.7, "two rows read nearly twice the experts: {c2} / {c1}");
    }

    #[test]
    fn everything_resident_and_high_acceptance_draft_wide() {
        let mut p = taught(0.0, 1.0 / 200e6);
        for _ in 0..20 {
            p.verified(7, 7);
        }
        let w = p.decide(0);
        assert!(w >= 5, "resident experts and drafts that are kept: draft wide (got {w})");
        // The same costs with drafts that miss: single steps.
        for _ in 0..20 {
            p.verified(7, 0);
        }
        assert_eq!(p.best(0).unwrap().0, 0);
    }

    #[test]
    fn resident_experts_on_a_slow_drive_still_pay() {
        // The drive is slow but nothing is read: only compute counts.
        let mut p = taught(0.0, 1.0 / 1e6);
        for _ in 0..20 {
            p.verified(4, 3);
        }
        assert!(p.decide(0) >= 2);
    }

    #[test]
    fn expected_tokens_multiply_conditional_acceptance() {
        let mut p = UnionPolicy::new(3, 0);
        assert_eq!(p.emitted(0), 1.0);
        assert!((p.emitted(2) - (1.0 + 0.5 + 0.25)).abs() < 1e-12);
        p.verified(3, 1);
        // Position 1 kept, position 2 rejected, position 3 not seen.
        let a = p.acceptance().to_vec();
        assert!((a[0] - 0.6).abs() < 1e-12 && (a[1] - 0.4).abs() < 1e-12 && a[2] == PRIOR_ACCEPT, "{a:?}");
    }

    #[test]
    fn nothing_seen_no_drafts_and_zeros_probe_now_and_then() {
        let mut p = UnionPolicy::new(7, 64);
        assert_eq!(p.decide(0), 0, "no forward seen yet: a single step first");
        let mut p = taught(1.0, 1.0 / 200e6);
        let ws: Vec<usize> = (0..48).map(|_| p.decide(0)).collect();
        let probes: Vec<usize> = (0..48).filter(|&i| ws[i] > 0).collect();
        assert_eq!(probes, vec![15, 47], "a probe after 16 single steps, then after 32");
        assert_eq!(p.probes, 2);
        assert_eq!(p.widths[0], 46);
    }

    #[test]
    fn unions_of_rows_not_seen_scale_from_the_nearest_seen() {
        let mut p = UnionPolicy::new(7, 64);
        p.observe(&forward(1, 8, 1.0, 1e-9));
        let u2 = p.union_at(2).unwrap();
        assert!((u2 - 64.0 * (1.0 - (56.0f64 / 64.0).powi(2))).abs() < 1e-9, "{u2}");
        p.observe(&forward(4, 20, 1.0, 1e-9));
        let u3 = p.union_at(3).unwrap();
        assert!(u3 > 8.0 && u3 < 20.0, "{u3}");
        assert_eq!(p.union_at(4), Some(20.0));
    }
}
