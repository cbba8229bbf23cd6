//! Route replay: predicts when an expert will be requested again from the store's own history of
//! fetches. Generated text repeats itself (phrases, and greedy decoding's loops), and so do its
//! routes: the passes that followed the best earlier match of the latest passes are the forecast
//! for the passes to come. The expert cache keeps what the forecast needs soonest (an estimate of
//! the optimal cache's rule) and judges the rest by how often they were requested.
//!
//! Measured on the trained demo model's held-out text (bench/cache_sim.py replays `bench run
//! --fetch-trace` traces): a match is found for 79% of decode's passes, and the pass that followed
//! it shares 85% of the next token's experts of that layer, against 18% for the previous token and
//! 12.5% for random routes.
//!
//! Contract: a forecast only decides which experts stay cached, never an output bit; it depends
//! on nothing but the sequence of `record` calls (the same fetches give the same forecasts); the
//! history is bounded (`HISTORY_TOKENS` passes per MoE layer), and so is the work per pass.

use std::collections::{HashMap, VecDeque};

type Key = (u32, u32);

/// Passes matched at once: the latest pass and the one before it (same layers at both ends).
const MATCH_PASSES: usize = 2;
/// A match counts when its passes share at least this share of their experts on average.
const MIN_MATCH: f64 = 0.6;
// A match must share experts with the latest pass (what `record`'s candidate index relies on).
const _: () = assert!(MIN_MATCH * MATCH_PASSES as f64 > (MATCH_PASSES - 1) as f64);
/// History kept, in passes per MoE layer (tokens of decode).
const HISTORY_TOKENS: usize = 256;
/// How far a forecast reaches, in passes per MoE layer.
const HORIZON_TOKENS: usize = 16;

/// The fetch history and the current forecast (see the module doc).
pub struct RouteReplay {
    /// Passes per token: the model's MoE layers (at least 1).
    layers: usize,
    /// The latest passes: (layer, its experts ascending); `hist[0]` is pass `base`.
    hist: VecDeque<(u32, Vec<u32>)>,
    base: u64,
    /// Passes (absolute indices, ascending) that requested each expert, within the history.
    seen: HashMap<Key, VecDeque<u64>>,
    /// The earlier pass matching the latest one best (None: no match good enough).
    matched: Option<u64>,
}

impl RouteReplay {
    pub fn new(moe_layers: usize) -> Self {
        RouteReplay { layers: moe_layers.max(1), hist: VecDeque::new(), base: 0, seen: HashMap::new(), matched: None }
    }

    /// Index of the latest pass (None before the first).
    fn now(&self) -> Option<u64> {
        (self.base + self.hist.len() as u64).checked_sub(1).filter(|_| !self.hist.is_empty())
    }

    fn pass(&self, i: u64) -> &(u32, Vec<u32>) {
        &self.hist[(i - self.base) as usize]
    }

    /// Records one fetch of `layer` (its experts in any order) and renews the forecast: the
    /// earlier pass of the same layer whose last [`MATCH_PASSES`] passes share the most experts
    /// with the latest ones (newest first among equals).
    pub fn record(&mut self, layer: u32, experts: &[u32]) {
        let mut es = experts.to_vec();
        es.sort_unstable();
        es.dedup();
        let now = self.base + self.hist.len() as u64;
        for &e in &es {
            self.seen.entry((layer, e)).or_default().push_back(now);
        }
        self.hist.push_back((layer, es));
        while self.hist.len() > HISTORY_TOKENS * self.layers {
            let (l, old) = self.hist.pop_front().unwrap_or_default();
            for e in old {
                if let Some(q) = self.seen.get_mut(&(l, e)) {
                    q.pop_front();
                    if q.is_empty() {
                        self.seen.remove(&(l, e));
                    }
                }
            }
            self.base += 1;
        }
        self.matched = None;
        let mut best = 0.0f64;
        // Only earlier passes sharing an expert with the latest can score enough (the passes
        // before them alone give at most 1 of the MIN_MATCH * MATCH_PASSES needed): the expert
        // index names them and their shared counts, so the work is bounded by the experts'
        // requests in the history, not by its length. Candidates keep their predecessor inside
        // the history; newest first among equals.
        let mut overlap: HashMap<u64, usize> = HashMap::new();
        for &e in &self.pass(now).1 {
            for &p in self.seen.get(&(layer, e)).into_iter().flatten() {
                if p > self.base && p < now {
                    *overlap.entry(p).or_insert(0) += 1;
                }
            }
        }
        let mut candidates: Vec<(u64, usize)> = overlap.into_iter().collect();
        candidates.sort_unstable_by_key(|&(q, _)| std::cmp::Reverse(q));
        for (q, n) in candidates {
            let latest = self.pass(now).1.len().max(self.pass(q).1.len());
            let mut score = n as f64 / latest as f64;
            for j in 1..MATCH_PASSES as u64 {
                let (la, a) = self.pass(now - j);
                let (lb, b) = self.pass(q - j);
                if la == lb && !a.is_empty() && !b.is_empty() {
                    score += shared(a, b) as f64 / a.len().max(b.len()) as f64;
                }
            }
            if score > best {
                best = score;
                self.matched = Some(q);
            }
        }
        if best < MIN_MATCH * MATCH_PASSES as f64 {
            self.matched = None;
        }
    }

    /// Passes until `key` is requested again by the forecast (what followed the matched pass, as
    /// far as the history and the horizon reach); None: not in the forecast.
    pub fn next_use(&self, key: Key) -> Option<u64> {
        let (q, now) = (self.matched?, self.now()?);
        let seen = self.seen.get(&key)?;
        let at = *seen.get(seen.partition_point(|&p| p <= q))?;
        let d = at - q;
        (at <= now && d <= (HORIZON_TOKENS * self.layers) as u64).then_some(d)
    }
}

/// Elements two ascending lists share.
fn shared(a: &[u32], b: &[u32]) -> usize {
    let (mut i, mut j, mut n) = (0, 0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                n += 1;
                i += 1;
                j += 1;
            }
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_route_sequence_is_forecast() {
        // Two layers; tokens cycle through three route patterns.
        let pat = |t: usize, l: u32| -> Vec<u32> { (0..4).map(|i| (t % 3) as u32 * 10 + i + l * 100).collect() };
        let mut r = RouteReplay::new(2);
        for t in 0..3 {
            for l in 0..2 {
                r.record(l, &pat(t, l));
            }
        }
        // Nothing seen twice yet: no match.
        assert_eq!(r.next_use((0, 0)), None);
        r.record(0, &pat(3, 0));
        r.record(1, &pat(3, 1));
        // Token 3 = token 0: what followed token 0 (layer 1's pass is the latest) forecasts next.
        // Token 1's layer 0 came 1 pass after the match; token 2's layer 0, 3 passes after.
        assert_eq!(r.next_use((0, 10)), Some(1));
        assert_eq!(r.next_use((0, 20)), Some(3));
        assert_eq!(r.next_use((1, 110)), Some(2));
        // An expert the forecast does not hold.
        assert_eq!(r.next_use((0, 55)), None);
    }

    /// The earlier pass matching the latest best, by scanning the whole history.
    fn scanned_match(r: &RouteReplay) -> Option<u64> {
        let now = r.now()?;
        let (mut best, mut matched) = (0.0f64, None);
        let mut q = now;
        while q > r.base + 1 {
            q -= 1;
            if r.pass(q).0 != r.pass(now).0 {
                continue;
            }
            let mut score = 0.0;
            for j in 0..MATCH_PASSES as u64 {
                let ((la, a), (lb, b)) = (r.pass(now - j), r.pass(q - j));
                if la == lb && !a.is_empty() && !b.is_empty() {
                    score += shared(a, b) as f64 / a.len().max(b.len()) as f64;
                }
            }
            if score > best {
                (best, matched) = (score, Some(q));
            }
        }
        matched.filter(|_| best >= MIN_MATCH * MATCH_PASSES as f64)
    }

    #[test]
    fn the_indexed_match_is_the_best_of_the_whole_history() {
        // Three layers, routes from a few phrases with noise, past the history bound.
        let mut x = 12345u64;
        let mut next = || {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 33) as u32
        };
        let mut r = RouteReplay::new(3);
        let mut matches = 0;
        for t in 0..HISTORY_TOKENS * 2 {
            let phrase = next() % 5;
            for l in 0..3u32 {
                let mut es: Vec<u32> = (0..6).map(|i| (phrase * 7 + i * 3 + l) % 32).collect();
                if next() % 3 == 0 {
                    es[(next() % 6) as usize] = next() % 32;
                }
                r.record(l, &es);
                assert_eq!(r.matched, scanned_match(&r), "token {t} layer {l}");
                matches += usize::from(r.matched.is_some());
            }
        }
        assert!(matches > HISTORY_TOKENS, "the trace repeats: most passes match ({matches})");
    }

    #[test]
    fn history_is_bounded() {
        let mut r = RouteReplay::new(1);
        for t in 0..(HISTORY_TOKENS * 3) as u32 {
            r.record(0, &[t % 7, 100 + t % 5]);
        }
        assert_eq!(r.hist.len(), HISTORY_TOKENS);
        assert!(r.seen.values().all(|q| q.front().is_some_and(|&p| p >= r.base)));
        assert!(r.next_use((0, 3)).is_some());
    }
}
