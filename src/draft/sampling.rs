//! The speculative-sampling accept/reject rule (Leviathan et al. 2023; Chen et al. 2023), which
//! keeps K3's sampling distribution exactly whatever the drafter proposes.
//!
//! Contract: for a draft token `d` drawn from the drafter's distribution `q`, with K3's
//! distribution `p` at the same row (the one that plain sampling draws from:
//! [`crate::sample::Sampler::distribution`], the logits adjusted by the request's logit bias and
//! penalties given the tokens before that row, then filtered by its temperature, top-k, min-p and
//! top-p),
//! [`verdict`] accepts `d` with probability min(1, p(d)/q(d)); on rejection it returns a token
//! drawn from norm(max(0, p - q)). The emitted token is then distributed exactly as p.
//!
//! The drafters of this crate (n-gram lookup, scripted, oracle) propose deterministically: q is a
//! point mass on d, so the rule becomes "accept with probability p(d), else draw from p without
//! d". Drawing x ~ p with the row's one uniform number and accepting iff x == d is that rule
//! exactly (P(accept) = p(d); given x != d, x ~ p restricted to tokens other than d), and it uses
//! the same number and the same adjusted, filtered p plain sampling would (the step core hands
//! the sampler the same history at a verify row as plain decoding has; a draft the filters exclude has
//! p(d) = 0 and is never kept) — so [`crate::engine::Session::generate_speculative_sampled`]
//! emits the tokens of plain sampling with the same seed, bit for bit. [`verdict`] is for a
//! drafter that samples its proposals (a model drafter at temperature > 0).

use crate::sample::{Sampler, inverse_cdf};

/// Outcome of checking one draft.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The draft is kept.
    Accept,
    /// The draft is rejected; this token (from the residual distribution) is emitted instead and
    /// ends the verified run.
    Reject(u32),
}

/// The accept/reject rule for draft `d` proposed from distribution `q`, K3's distribution `p`
/// (both over the vocabulary, summing to 1). Draws one uniform number, and a second on rejection.
pub fn verdict(p: &[f64], q: &[f64], d: u32, sampler: &mut Sampler) -> Verdict {
    let (pd, qd) = (p.get(d as usize).copied().unwrap_or(0.0), q.get(d as usize).copied().unwrap_or(0.0));
    let u = sampler.uniform();
    if qd > 0.0 && u < (pd / qd).min(1.0) {
        return Verdict::Accept;
    }
    let mut residual: Vec<f64> = p.iter().zip(q).map(|(a, b)| (a - b).max(0.0)).collect();
    let total: f64 = residual.iter().sum();
    if total <= 0.0 {
        // p == q (up to rounding) and the draft was still rejected by rounding: p itself.
        residual = p.to_vec();
    } else {
        for r in &mut residual {
            *r /= total;
        }
    }
    Verdict::Reject(inverse_cdf(&residual, sampler.uniform()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::SamplingSpec;

    /// Chi-square of `counts` against `probs` (categories with mass only).
    fn chi2(probs: &[f64], counts: &[f64]) -> f64 {
        let n: f64 = counts.iter().sum();
        probs.iter().zip(counts).filter(|(p, _)| **p > 0.0).map(|(p, c)| (c - n * p).powi(2) / (n * p)).sum()
    }

    #[test]
    fn emitted_tokens_follow_p_for_any_draft_distribution() {
        let p = [0.5, 0.2, 0.2, 0.1, 0.0];
        let q = [0.1, 0.6, 0.1, 0.1, 0.1];
        let mut s = Sampler::new(SamplingSpec::new(1.0, 1.0, 7).unwrap());
        let mut counts = [0.0; 5];
        let mut accepted = 0;
        let n = 40_000;
        for _ in 0..n {
            let d = inverse_cdf(&q, s.uniform());
            let t = match verdict(&p, &q, d, &mut s) {
                Verdict::Accept => {
                    accepted += 1;
                    d
                }
                Verdict::Reject(x) => x,
            };
            counts[t as usize] += 1.0;
        }
        assert_eq!(counts[4], 0.0, "a token K3 gives no mass is never emitted");
        // 3 degrees of freedom: the 99.9% point is 16.3.
        let c = chi2(&p, &counts);
        assert!(c < 16.3, "chi2 {c}: {counts:?}");
        // Acceptance rate is sum(min(p, q)) = 0.1 + 0.2 + 0.1 + 0.1 = 0.5.
        let rate = accepted as f64 / n as f64;
        assert!((rate - 0.5).abs() < 0.02, "{rate}");
    }

    #[test]
    fn a_point_mass_draft_is_accepted_with_probability_p_of_it() {
        let p = [0.3, 0.6, 0.1];
        let q = [0.0, 1.0, 0.0];
        let mut s = Sampler::new(SamplingSpec::new(1.0, 1.0, 9).unwrap());
        let mut counts = [0.0; 3];
        for _ in 0..30_000 {
            let t = match verdict(&p, &q, 1, &mut s) {
                Verdict::Accept => 1,
                Verdict::Reject(x) => {
                    assert_ne!(x, 1, "the residual of a point mass excludes the draft");
                    x
                }
            };
            counts[t as usize] += 1.0;
        }
        let c = chi2(&p, &counts);
        assert!(c < 13.8, "chi2 {c}: {counts:?}");
    }

    #[test]
    fn a_draft_the_filters_exclude_is_never_kept() {
        let logits = [1.0f32, 3.0, 2.9, 2.8, 0.5];
        let params = SamplingSpec::new(1.0, 1.0, 5).unwrap().with_filters(2, 0.0).unwrap();
        let p = crate::sample::probabilities(&logits, &params);
        let mut s = Sampler::new(params);
        for d in [0u32, 3, 4] {
            let mut q = [0.0; 5];
            q[d as usize] = 1.0;
            for _ in 0..2000 {
                match verdict(&p, &q, d, &mut s) {
                    Verdict::Accept => panic!("draft {d} is outside the top 2"),
                    Verdict::Reject(x) => assert!(x == 1 || x == 2, "{x}"),
                }
            }
        }
    }
}
