//! Perplexity of a text under the model (`deltafin score --text`), defined exactly as the demo's
//! training code computes it, so that the two agree:
//!
//! `ids = [BOS] + encode(text)` (BOS: the config's `bos_token_id`, else the tokenizer's `[BOS]`;
//! ordinary-text encoding, no specials from the text), `N = len(ids)`. Windows start at
//! `s = 0, W, 2W, ...` while `s < N - 1`; each feeds `ids[s..e]`, `e = min(s + W, N - 1)`, to a
//! fresh session (no state carried between windows) and scores the next-token log-probabilities
//! of `ids[s + 1..e + 1]`, so every token after the first is predicted exactly once.
//! `nll = -sum log_softmax(logits)[target]`, the log-softmax computed in f64 from the f32 logits
//! and the sum accumulated in f64 in position order; `ppl = exp(nll / tokens)`,
//! `bits_per_byte = nll / ln 2 / (UTF-8 bytes of the text)`.
//!
//! Contract: the result depends only on the model, the text and `W` (the logits are the same bits
//! whatever the threads, cache or backend, and the sums run in a fixed order). It is finite or an
//! error: the forward refuses non-finite logits, and a token's log-likelihood that still is not
//! finite is [`PerplexityError::NotFinite`], never a NaN printed as a result.

use crate::engine::Engine;
use crate::k3::ForwardError;
use crate::model::K3Config;
use crate::model::tokenizer::Tokenizer;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum PerplexityError {
    #[error("the model has no BOS token: its config.json has no `bos_token_id` and its tokenizer no `[BOS]`")]
    NoBos,
    #[error("the text is empty: there is no token to predict")]
    Empty,
    #[error("the window must hold at least one token")]
    Window,
    #[error("the log-likelihood of the token at position {pos} is {value}: its logits give it no probability")]
    NotFinite { pos: usize, value: f64 },
    #[error(transparent)]
    Forward(#[from] ForwardError),
}

/// `value`, the log-likelihood term of the token at `pos`, if it is finite.
pub fn finite(value: f64, pos: usize) -> Result<f64, PerplexityError> {
    if value.is_finite() { Ok(value) } else { Err(PerplexityError::NotFinite { pos, value }) }
}

/// The summed negative log-likelihood of a text and what it was over.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Perplexity {
    /// `-sum log p(target)` in nats.
    pub nll: f64,
    /// Tokens predicted (`N - 1`).
    pub tokens: usize,
    /// UTF-8 bytes of the text.
    pub bytes: usize,
    /// Windows run (fresh sessions).
    pub windows: usize,
}

impl Perplexity {
    pub fn ppl(&self) -> f64 {
        (self.nll / self.tokens as f64).exp()
    }

    pub fn bits_per_byte(&self) -> f64 {
        self.nll / std::f64::consts::LN_2 / self.bytes as f64
    }
}

/// `[BOS] + encode(text)`.
pub fn text_ids(tok: &Tokenizer, cfg: &K3Config, text: &str) -> Result<Vec<u32>, PerplexityError> {
    let bos = cfg.bos_token.or_else(|| tok.special_id("[BOS]")).ok_or(PerplexityError::NoBos)?;
    let mut ids = vec![bos];
    ids.extend(tok.encode(text));
    Ok(ids)
}

/// The windows over `n` ids: `(s, e)` feeds `ids[s..e]` and predicts `ids[s + 1..e + 1]`.
pub fn windows(n: usize, window: usize) -> Vec<(usize, usize)> {
    let last = n.saturating_sub(1);
    (0..last).step_by(window.max(1)).map(|s| (s, s.saturating_add(window).min(last))).collect()
}

/// `-log_softmax(logits)[target]`, in f64 from the f32 logits (max-shifted, summed in index order).
pub fn token_nll(logits: &[f32], target: u32) -> f64 {
    let max = logits.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
    let sum: f64 = logits.iter().map(|&x| (f64::from(x) - max).exp()).sum();
    let x = logits.get(target as usize).map_or(f64::NAN, |&x| f64::from(x));
    max + sum.ln() - x
}

/// The perplexity of `ids` (already holding BOS) in windows of `window` tokens; `bytes` is the
/// text's UTF-8 length; `progress` gets the number of tokens predicted so far after each window.
pub fn score_ids(
    engine: &Arc<Engine>,
    ids: &[u32],
    bytes: usize,
    window: usize,
    progress: &mut dyn FnMut(usize),
) -> Result<Perplexity, PerplexityError> {
    if window == 0 {
        return Err(PerplexityError::Window);
    }
    let spans = windows(ids.len(), window);
    if spans.is_empty() {
        return Err(PerplexityError::Empty);
    }
    let vocab = engine.vocab();
    let (mut nll, mut tokens) = (0f64, 0usize);
    for &(s, e) in &spans {
        let logits = engine.new_session().score(&ids[s..e])?;
        for (row, &target) in ids[s + 1..=e].iter().enumerate() {
            nll += finite(token_nll(&logits[row * vocab..(row + 1) * vocab], target), s + 1 + row)?;
        }
        tokens += e - s;
        progress(tokens);
    }
    Ok(Perplexity { nll, tokens, bytes, windows: spans.len() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_predict_every_token_after_the_first_once() {
        for n in 0..40 {
            for w in 1..12 {
                let ws = windows(n, w);
                let predicted: Vec<usize> = ws.iter().flat_map(|&(s, e)| s + 1..=e).collect();
                assert_eq!(predicted, (1..n).collect::<Vec<_>>(), "n {n} w {w}");
                assert!(ws.iter().all(|&(s, e)| e - s <= w && s % w == 0));
            }
        }
        assert_eq!(windows(10, 4), vec![(0, 4), (4, 8), (8, 9)]);
        assert_eq!(windows(9, 4), vec![(0, 4), (4, 8)]);
    }

    #[test]
    fn token_nll_is_the_f64_log_softmax() {
        let logits = [1.0f32, 2.0, 3.0, -1e30];
        let z: f64 = [1.0f64, 2.0, 3.0].iter().map(|x| x.exp()).sum();
        for t in 0..3 {
            let want = z.ln() - f64::from(logits[t]);
            assert!((token_nll(&logits, t as u32) - want).abs() < 1e-12);
        }
        // Large logits do not overflow.
        assert!((token_nll(&[1000.0, 1000.0], 0) - std::f64::consts::LN_2).abs() < 1e-12);
        // Nor do the largest finite ones; only a non-finite term is refused.
        assert!(finite(token_nll(&[f32::MAX, f32::MIN, 0.0], 1), 1).is_ok_and(f64::is_finite));
        assert!(matches!(finite(token_nll(&[f32::NAN, 0.0], 1), 4), Err(PerplexityError::NotFinite { pos: 4, .. })));
    }
}
