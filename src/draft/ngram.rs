//! n-gram prompt lookup: the drafter that needs no model.
//!
//! Contract: `propose(context, k)` takes the longest suffix of `context` of length
//! `n_max..=n_min` that occurs earlier in `context` (prompt + output), picks its most recent
//! earlier occurrence, and proposes up to `k` tokens that followed it. When that continuation
//! runs into the end of the context, it goes on with the tokens it has just proposed (the same
//! period repeats), so a short greedy cycle still yields `k` drafts. No match: no drafts.
//! Deterministic: the same context always gives the same proposal.

use super::Drafter;
use crate::backend::BackendError;

/// Prompt-lookup drafter over the session's own tokens.
#[derive(Clone, Debug)]
pub struct NgramDrafter {
    n_max: usize,
    n_min: usize,
    /// The length of the suffix the last proposal matched (0: none).
    last_n: usize,
}

impl Default for NgramDrafter {
    fn default() -> Self {
        NgramDrafter { n_max: 4, n_min: 1, last_n: 0 }
    }
}

impl NgramDrafter {
    /// Matches suffixes of `n_max` down to `n_min` tokens (both at least 1).
    pub fn new(n_max: usize, n_min: usize) -> Self {
        let n_min = n_min.max(1);
        NgramDrafter { n_max: n_max.max(n_min), n_min, last_n: 0 }
    }

    /// Start of the most recent earlier occurrence of the longest matching suffix, and its length.
    pub fn find(&self, context: &[u32]) -> Option<(usize, usize)> {
        let len = context.len();
        for n in (self.n_min..=self.n_max).rev() {
            if len <= n {
                continue;
            }
            let suffix = &context[len - n..];
            // Starts before len - n: the suffix itself is not an earlier occurrence.
            if let Some(i) = (0..len - n).rev().find(|&i| &context[i..i + n] == suffix) {
                return Some((i, n));
            }
        }
        None
    }
}

impl Drafter for NgramDrafter {
    fn name(&self) -> &str {
        "ngram"
    }

    fn propose(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, BackendError> {
        self.last_n = 0;
        if k == 0 {
            return Ok(Vec::new());
        }
        let Some((i, n)) = self.find(context) else { return Ok(Vec::new()) };
        self.last_n = n;
        let start = i + n;
        let mut out: Vec<u32> = Vec::with_capacity(k);
        for j in 0..k {
            // Position start + j of context ++ out: past the end it reads what was just proposed.
            let p = start + j;
            let t = if p < context.len() { context[p] } else { out[p - context.len()] };
            out.push(t);
        }
        Ok(out)
    }

    fn cheap(&self) -> bool {
        true
    }

    /// Acceptance is learnt per matched suffix length: a 4-token match is kept far more often
    /// than a 1-token one.
    fn class(&self) -> usize {
        self.last_n.saturating_sub(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_suffix_wins_over_a_more_recent_shorter_one() {
        let d = NgramDrafter::new(4, 1);
        // Suffix [1,2,3] occurs at 0 (followed by 9); [3] alone occurs more recently at 5 (followed by 7).
        let ctx = [1, 2, 3, 9, 8, 3, 7, 1, 2, 3];
        assert_eq!(d.find(&ctx), Some((0, 3)));
        assert_eq!(NgramDrafter::new(4, 1).propose(&ctx, 2).unwrap(), vec![9, 8]);
    }

    #[test]
    fn most_recent_occurrence_first() {
        // [5,6] occurs at 0 (then 1) and at 3 (then 2): the later one is used.
        let ctx = [5, 6, 1, 5, 6, 2, 0, 5, 6];
        let mut d = NgramDrafter::new(2, 1);
        assert_eq!(d.find(&ctx), Some((3, 2)));
        assert_eq!(d.propose(&ctx, 3).unwrap(), vec![2, 0, 5]);
    }

    #[test]
    fn no_match_no_drafts_and_k_limits() {
        let mut d = NgramDrafter::default();
        assert!(d.propose(&[1, 2, 3, 4], 5).unwrap().is_empty());
        assert!(d.propose(&[], 5).unwrap().is_empty());
        assert!(d.propose(&[7], 5).unwrap().is_empty());
        assert!(d.propose(&[7, 7], 0).unwrap().is_empty());
        assert_eq!(d.propose(&[1, 2, 3, 1, 2, 3, 4, 1], 1).unwrap(), vec![2]);
    }

    #[test]
    fn n_min_bounds_the_shortest_match() {
        let ctx = [4, 9, 1, 2, 4];
        assert_eq!(NgramDrafter::new(3, 2).find(&ctx), None);
        assert_eq!(NgramDrafter::new(3, 1).find(&ctx), Some((0, 1)));
    }

    #[test]
    fn a_cycle_continues_past_the_end() {
        // Period 2: the most recent match of [a,b,a,b] is 2 back; the continuation repeats.
        let ctx = [3, 1, 2, 1, 2, 1, 2];
        let mut d = NgramDrafter::default();
        assert_eq!(d.propose(&ctx, 7).unwrap(), vec![1, 2, 1, 2, 1, 2, 1]);
        // A period-1 cycle.
        assert_eq!(d.propose(&[8, 5, 5], 4).unwrap(), vec![5, 5, 5, 5]);
    }
}
