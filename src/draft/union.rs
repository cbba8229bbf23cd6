//! The union-aware draft policy: per step, which drafter (a single step, or one of the sequence's
//! drafters: n-gram lookup, DSpark) and how many drafts, the choice that maximises expected emitted
//! tokens per expected second (bench/results/2026-12-05-route-overlap/README.md, "What the live
//! union-aware policy needs"; bench/results/2026-12-07-drafts-auto/).
//!
//! Contract: [`UnionPolicy::choose`] picks among the drafts on offer now ([`Offer`]: a drafter, the
//! class of its proposal, the most drafts it gives, what asking it would cost) or a single step
//! (none), from what it learnt of its own sequence: [`UnionPolicy::observe`] takes every forward it
//! took part in ([`ForwardCost`]: rows, expert union, bytes read, read wait, kernel time),
//! [`UnionPolicy::verified_by`] each verify's outcome per drafter and class, [`UnionPolicy::called`]
//! what a drafter's call cost (its block pass and the context rows it folded first),
//! [`UnionPolicy::ran`] each step's seconds (the probes' budget). It decides only how many tokens
//! are drafted and by whom, never which tokens are emitted. [`UnionPolicy::decide`] is the one-drafter
//! form (a drafter always on offer, its call cost learnt from `drafted`).
//!
//! The model: E_w = 1 + sum over r = 1..w of a_1 x ... x a_r, with a_i the conditional acceptance
//! at draft position i for that drafter and class (a moving average over this sequence's verifies,
//! from a prior: 0.5 greedy, 0.3 sampled — a sampled pick agrees with a point-mass draft less
//! often). C(n), the seconds of a forward of n rows, is trunk(n) + L x [kernel(U(n), n) + M(n) x
//! expert bytes x seconds per byte read], with L the MoE layers a forward passes; U(n) the expert
//! union per layer of n rows (a moving average per row count from the forwards seen; a row count
//! not seen yet scaled from the nearest one seen as independent routing over `n_experts` would);
//! M(n) the part of it not resident: the single steps' missing share of the first row's experts
//! plus the verifies' missing share of the experts the other rows add (read from drives: bytes read
//! over one expert's bytes, so RAM- and device-cache hits count as resident); seconds per byte from
//! the forwards' read waits over their bytes read (what a read costs after overlap with compute);
//! kernel time a fit of per-layer expert kernel seconds against (union, expert rows); trunk time
//! (the rest of a forward) a fit against rows (`StepCost`). A verify of w drafts costs
//! C(others + 1 + w) − C(others) (`others`: the rows other lanes feed in the same step) plus the
//! drafter's call: nothing for a proposal already made (n-gram lookup is made to see whether it
//! matches), else its block's seconds (a moving average) plus its backlog of context rows at its
//! measured seconds a row (a DSpark drafter folds the rows it has not seen yet before it drafts).
//! A drafter whose call has not been timed yet is chosen only by a probe.
//! Single step when it is best; after `EXPLORE_FIRST` single steps in a row (doubling to
//! `EXPLORE_MOST`) it probes two drafts with the offer closest to paying, so text that turns
//! predictable (or costs that change) is found again — but only while the probes' measured cost
//! over the single steps they replaced stays within [`PROBE_SHARE`] of the sequence's seconds.

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
/// The same for a sampling sequence.
pub const PRIOR_ACCEPT_SAMPLED: f64 = 0.3;
/// The most the probes may cost (their seconds over the single steps they replaced) as a share of
/// the seconds of the steps the sequence took part in.
pub const PROBE_SHARE: f64 = 0.01;
/// Single steps in a row before a probe (two drafts), then doubling up to the most (each within
/// the probes' budget).
const EXPLORE_FIRST: usize = 4;
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

/// A draft on offer this step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Offer {
    /// Which drafter (its index in the sequence's drafters).
    pub arm: usize,
    /// Which kind of proposal (an n-gram lookup: the length of the suffix it matched, less one).
    pub class: usize,
    /// The most drafts it gives now.
    pub most: usize,
    /// Its proposal is already made (asking costs nothing more).
    pub sunk: bool,
    /// Context rows it folds before it drafts.
    pub backlog: usize,
}

/// What one drafter has shown: acceptance per class and position, and its call's cost.
#[derive(Clone, Debug, Default)]
struct Arm {
    accept: Vec<Vec<f64>>,
    /// Verifies that reached each position, per class (the average's weight while few).
    trials: Vec<Vec<u32>>,
    block_s: Avg,
    row_s: Avg,
}

/// The union-aware draft policy of one sequence (see the module contract).
#[derive(Clone, Debug)]
pub struct UnionPolicy {
    pub max: usize,
    /// Routed experts per MoE layer (for scaling unions to row counts not seen; 0: unknown).
    pub n_experts: usize,
    /// The conditional acceptance a class starts from.
    prior: f64,
    arms: Vec<Arm>,
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
    zeros: usize,
    explore_every: usize,
    /// The last choice was a probe (not verified yet).
    probing: bool,
    /// Seconds of the steps it took part in, and what its probes cost over single steps.
    pub run_s: f64,
    pub probe_s: f64,
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
            prior: PRIOR_ACCEPT,
            arms: Vec::new(),
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
            zeros: 0,
            explore_every: EXPLORE_FIRST,
            probing: false,
            run_s: 0.0,
            probe_s: 0.0,
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

    /// A sampling sequence: classes not seen yet start from the lower prior.
    pub fn set_sampled(&mut self, sampled: bool) {
        self.prior = if sampled { PRIOR_ACCEPT_SAMPLED } else { PRIOR_ACCEPT };
    }

    /// The acceptance per position of drafter `arm`'s class `class` (made at the prior).
    fn accept_mut(&mut self, arm: usize, class: usize) -> &mut Vec<f64> {
        if self.arms.len() <= arm {
            self.arms.resize_with(arm + 1, Arm::default);
        }
        let (max, prior) = (self.max, self.prior);
        let a = &mut self.arms[arm].accept;
        if a.len() <= class {
            a.resize_with(class + 1, || vec![prior; max]);
        }
        &mut a[class]
    }

    /// A verify of `proposed` drafts of drafter `arm` (proposal class `class`) kept the first
    /// `accepted`.
    pub fn verified_by(&mut self, arm: usize, class: usize, proposed: usize, accepted: usize) {
        let max = self.max;
        self.accept_mut(arm, class);
        let a = &mut self.arms[arm];
        if a.trials.len() <= class {
            a.trials.resize_with(class + 1, || vec![0; max]);
        }
        let (acc, trials) = (&mut a.accept[class], &mut a.trials[class]);
        for (i, (a, n)) in acc.iter_mut().zip(trials.iter_mut()).enumerate().take(proposed.min(accepted + 1)) {
            let hit = if i < accepted { 1.0 } else { 0.0 };
            // The mean of the verifies with the prior as one, until it is a moving average.
            *n += 1;
            *a += W_ACCEPT.max(1.0 / (*n as f64 + 1.0)) * (hit - *a);
        }
        if self.probing && accepted == proposed && proposed > 0 {
            // A probe kept whole: probe again at once (it cost nothing), so a loop is learnt fast.
            self.zeros = self.explore_every;
        }
        self.probing = false;
    }

    /// A verify of `proposed` drafts kept the first `accepted` (the one-drafter form).
    pub fn verified(&mut self, proposed: usize, accepted: usize) {
        self.verified_by(0, 0, proposed, accepted);
    }

    /// Drafter `arm`'s call folded `rows` context rows in `fold_s` and ran its block in `block_s`.
    pub fn called(&mut self, arm: usize, rows: usize, fold_s: f64, block_s: f64) {
        if self.arms.len() <= arm {
            self.arms.resize_with(arm + 1, Arm::default);
        }
        let a = &mut self.arms[arm];
        a.block_s.add(block_s, W);
        if rows > 0 {
            a.row_s.add(fold_s / rows as f64, W);
        }
    }

    /// Asking the (only) drafter for `asked` drafts took `secs` in all (the one-drafter form: a
    /// call's cost, whatever the width).
    pub fn drafted(&mut self, asked: usize, secs: f64) {
        if asked > 0 {
            self.called(0, 0, 0.0, secs);
        }
    }

    /// A step it took part in cost it `secs` (its share and its drafting); `probe`: the step was
    /// a probe that emitted `emitted` tokens, a single step costing `single_s`.
    pub fn ran(&mut self, secs: f64, probe: Option<(usize, f64)>) {
        if !secs.is_finite() {
            return;
        }
        self.run_s += secs;
        if let Some((emitted, single_s)) = probe {
            self.probe_s += (secs - emitted as f64 * single_s).max(0.0);
        }
    }

    /// The conditional acceptance the first drafter holds for each draft position (its first class).
    pub fn acceptance(&self) -> Vec<f64> {
        self.arms.first().and_then(|a| a.accept.first()).cloned().unwrap_or_else(|| vec![self.prior; self.max])
    }

    /// Expected tokens a verify of `w` drafts of the first drafter emits.
    pub fn emitted(&self, w: usize) -> f64 {
        self.emitted_by(0, 0, w)
    }

    /// Expected tokens a verify of `w` drafts of drafter `arm`'s class `class` emits.
    pub fn emitted_by(&self, arm: usize, class: usize, w: usize) -> f64 {
        let acc = self.arms.get(arm).and_then(|a| a.accept.get(class));
        let mut p = 1.0;
        let mut e = 1.0;
        for i in 0..w.min(self.max) {
            p *= acc.map_or(self.prior, |a| a[i]);
            e += p;
        }
        e
    }

    /// Expected seconds of asking for `o`'s drafts (None: its call was never timed).
    fn call_s(&self, o: &Offer) -> Option<f64> {
        if o.sunk {
            return Some(0.0);
        }
        let a = self.arms.get(o.arm)?;
        let block = a.block_s.0?;
        Some(block + o.backlog as f64 * a.row_s.0.unwrap_or(0.0))
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

    /// The seconds a single step adds to a step of `others` rows of other lanes.
    pub fn single_s(&self, others: usize) -> Option<f64> {
        Some(self.forward_s(others + 1)? - self.forward_s(others)?)
    }

    /// Seconds a verify of `w` drafts of offer `o` adds to a step of `others` rows of other
    /// lanes, its call included (a call never timed: `untimed` seconds).
    fn verify_s(&self, others: usize, o: &Offer, w: usize, untimed: f64) -> Option<f64> {
        let call = if w > 0 { self.call_s(o).unwrap_or(untimed) } else { 0.0 };
        Some(self.forward_s(others + 1 + w)? - self.forward_s(others)? + call)
    }

    /// Whether drafter `arm` has been verified in class `class` (a class never verified is tried
    /// only by a probe).
    fn seen(&self, arm: usize, class: usize) -> bool {
        self.arms.get(arm).is_some_and(|a| a.accept.get(class).is_some())
    }

    /// Tokens per second of each width 0..=o.most for offer `o` (index 0: a single step), or None
    /// before a forward has been seen; `probe`: a call never timed counts as free.
    fn scores(&self, others: usize, o: &Offer, probe: bool) -> Option<Vec<f64>> {
        let untimed = if probe { 0.0 } else { f64::INFINITY };
        let mut scores = Vec::with_capacity(o.most.min(self.max) + 1);
        for w in 0..=o.most.min(self.max) {
            let c = self.verify_s(others, o, w, untimed)?;
            scores.push(self.emitted_by(o.arm, o.class, w) / c.max(1e-12));
        }
        Some(scores)
    }

    /// The width that maximises E_w / cost_w for the one drafter (always on offer, `max` wide)
    /// with `others` rows of other lanes in the step, and its score (tokens per second) for each
    /// width: None before a forward has been seen.
    pub fn best(&self, others: usize) -> Option<(usize, Vec<f64>)> {
        let o = Offer { arm: 0, class: 0, most: self.max, sunk: false, backlog: 0 };
        // Before its call is timed, the one drafter's call counts as free (as it always did).
        let probe = self.arms.first().is_none_or(|a| a.block_s.0.is_none());
        let scores = self.scores(others, &o, probe)?;
        let mut best = 0;
        for (w, &s) in scores.iter().enumerate() {
            if s > scores[best] {
                best = w;
            }
        }
        Some((best, scores))
    }

    /// Which offer (its index in `offers`; None: a single step) and how many drafts, `others`
    /// rows of other lanes being in the step (see the module contract); counted in `widths`. The
    /// third value says whether the choice is a probe. A drafter whose call was never timed, or a
    /// class of proposal never verified, is chosen only by a probe; a probe is made only when its
    /// expected cost over the single steps it would replace (a call never timed taken as one
    /// single step) fits in what is left of the probes' budget.
    pub fn choose(&mut self, others: usize, offers: &[Offer]) -> (Option<usize>, usize, bool) {
        let mut pick = (None, 0);
        let single = self.single_s(others).filter(|s| s.is_finite() && *s > 0.0);
        if let Some(single) = single {
            let mut top = 1.0 / single;
            for (i, o) in offers.iter().enumerate() {
                if !self.seen(o.arm, o.class) {
                    continue;
                }
                let Some(sc) = self.scores(others, o, false) else { continue };
                for (w, &v) in sc.iter().enumerate().skip(1) {
                    if v > top {
                        top = v;
                        pick = (Some(i), w);
                    }
                }
            }
        }
        let mut probe = false;
        if let (0, Some(single)) = (pick.1, single) {
            self.zeros += 1;
            if self.zeros >= self.explore_every && self.max > 0 {
                let left = PROBE_SHARE * self.run_s - self.probe_s;
                // Two wide, so the second position learns too; the offer expected to cost least.
                let over = |o: &Offer| {
                    let w = 2.min(self.max).min(o.most);
                    let c = self.verify_s(others, o, w, single)?;
                    Some((c - self.emitted_by(o.arm, o.class, w) * single, w))
                };
                let best = (offers.iter().enumerate())
                    .filter(|(_, o)| o.most >= 1)
                    .filter_map(|(i, o)| over(o).map(|(x, w)| (i, x, w)))
                    .min_by(|a, b| a.1.total_cmp(&b.1));
                if let Some((i, _, w)) = best.filter(|b| b.1 <= left) {
                    self.zeros = 0;
                    self.explore_every = (self.explore_every * 2).min(EXPLORE_MOST);
                    self.probes += 1;
                    probe = true;
                    pick = (Some(i), w);
                }
            }
        } else if pick.1 > 0 {
            self.zeros = 0;
            self.explore_every = EXPLORE_FIRST;
        }
        self.widths[pick.1] += 1;
        self.probing = probe;
        (pick.0, pick.1, probe)
    }

    /// The drafts to ask the one drafter for now, `others` rows of other lanes being in the step
    /// (see the module contract); counted in `widths`.
    pub fn decide(&mut self, others: usize) -> usize {
        // Before its call is timed, the one drafter's call counts as free (a probe times it).
        let timed = self.arms.first().is_some_and(|a| a.block_s.0.is_some());
        let o = Offer { arm: 0, class: 0, most: self.max, sunk: !timed, backlog: 0 };
        self.accept_mut(0, 0);
        self.choose(others, &[o]).1
    }
}

#[cfg(test)]
mod tests;
