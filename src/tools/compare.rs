//! `deltafin score --compare`: how far one configuration's next-token distributions are from a
//! base's on the same text — two trunk encodings of one model, or two model directories — with
//! the definitions of llama.cpp's `llama-perplexity --kl-divergence`, so the two tools' figures
//! can be set side by side.
//!
//! The text is cut into the windows of `score --text` ([`super::perplexity`]: every token after
//! BOS predicted once, each window a fresh sequence). Per predicted token, with `lp_b` / `lp` the
//! base's and the judged side's log-softmax (f64 from the f32 logits):
//! - `kl = sum_i exp(lp_b[i]) * (lp_b[i] - lp[i])`, KL(base || judged) in nats (llama.cpp skips
//!   terms with `lp_b < -16` because it stores the base in 16 bits; here every term counts);
//! - top-1 agreement: the two argmaxes (the first index of the maximum) are equal;
//! - `nll = -lp[target]`, `nll_base = -lp_b[target]`.
//!
//! Summary: `kl_mean`, `kl_median`, `kl_p99` (percentiles by linear interpolation between the
//! sorted values, as llama.cpp and numpy's default), `kl_max`, `top1_agreement` (a fraction),
//! `ppl = exp(mean nll)`, `ppl_base = exp(mean nll_base)`, `nll_delta = mean(nll - nll_base)`
//! (= ln(ppl / ppl_base), llama.cpp's "Mean ln(PPL(Q)/PPL(base))").
//!
//! Contract: the base runs first and its logits go to a scratch file (f32, tokens x vocab: only
//! one engine is open at a time, so two trunks never need RAM together); the judged side then
//! runs window by window against it. The result depends only on the two models, the text and the
//! window (fixed-order sums; the logits are the same bits whatever the threads, cache or backend).
//! Every figure is finite or the comparison is an error naming the position
//! ([`PerplexityError::NotFinite`]): no NaN is printed as a result.

use super::perplexity::{self, PerplexityError};
use crate::engine::Engine;
use std::io::{Read, Seek, Write};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum CompareError {
    #[error(transparent)]
    Score(#[from] PerplexityError),
    #[error(
        "the base has a vocabulary of {base} tokens and the judged model {judged}: their distributions cannot be compared"
    )]
    Vocab { base: usize, judged: usize },
    #[error("the scratch file of the base's logits: {0}")]
    Scratch(#[from] std::io::Error),
}

/// One predicted token compared.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenCompare {
    /// KL(base || judged) in nats.
    pub kl: f64,
    pub nll_base: f64,
    pub nll: f64,
    pub same_top: bool,
}

/// The f64 log-softmax of f32 logits (max-shifted, summed in index order) and the first argmax.
fn log_softmax(logits: &[f32]) -> (Vec<f64>, usize) {
    let (mut imax, mut max) = (0usize, f32::NEG_INFINITY);
    for (i, &x) in logits.iter().enumerate() {
        if x > max || i == 0 {
            (imax, max) = (i, x);
        }
    }
    let m = f64::from(max);
    let sum: f64 = logits.iter().map(|&x| (f64::from(x) - m).exp()).sum();
    let lse = m + sum.ln();
    (logits.iter().map(|&x| f64::from(x) - lse).collect(), imax)
}

/// Compares one position's logits (`base`, `judged`, both one vocabulary wide) at `target`.
pub fn token_compare(base: &[f32], judged: &[f32], target: u32) -> TokenCompare {
    let (lb, ib) = log_softmax(base);
    let (lj, ij) = log_softmax(judged);
    let kl = lb.iter().zip(&lj).map(|(&b, &j)| if b == f64::NEG_INFINITY { 0.0 } else { b.exp() * (b - j) }).sum();
    let t = target as usize;
    let at = |v: &[f64]| v.get(t).map_or(f64::NAN, |x| -x);
    TokenCompare { kl, nll_base: at(&lb), nll: at(&lj), same_top: ib == ij }
}

/// The summary of a comparison (the JSON keys of `score --compare`).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct CompareSummary {
    pub kl_mean: f64,
    pub kl_median: f64,
    pub kl_p99: f64,
    pub kl_max: f64,
    pub top1_agreement: f64,
    pub ppl_base: f64,
    pub ppl: f64,
    pub nll_delta: f64,
    pub tokens: usize,
}

impl CompareSummary {
    /// The human table of `score --compare` (llama.cpp's names in brackets where they differ).
    pub fn table(&self, judged: &str, base: &str) -> String {
        format!(
            "judged {judged} against base {base}, {} tokens\n\
             {:<30} {:>12} {:>12}\n\
             {:<30} {:>12.4} {:>12.4}\n\
             {:<30} {:>12.6}   (ln(PPL/PPL_base))\n\
             {:<30} {:>12.6}\n\
             {:<30} {:>12.6}\n\
             {:<30} {:>12.6}\n\
             {:<30} {:>12.6}\n\
             {:<30} {:>11.3} %   (same top p)\n",
            self.tokens,
            "",
            "base",
            "judged",
            "perplexity",
            self.ppl_base,
            self.ppl,
            "mean NLL delta",
            self.nll_delta,
            "KL divergence, mean (nats)",
            self.kl_mean,
            "KL divergence, median",
            self.kl_median,
            "KL divergence, 99%",
            self.kl_p99,
            "KL divergence, max",
            self.kl_max,
            "top-1 agreement",
            100.0 * self.top1_agreement,
        )
    }
}

/// `fraction` of the sorted values, linearly interpolated (numpy's default, llama.cpp's).
pub fn percentile(sorted: &[f64], fraction: f64) -> f64 {
    match sorted {
        [] => f64::NAN,
        [x] => *x,
        _ => {
            let p = fraction.clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
            let i = (p.floor() as usize).min(sorted.len() - 1);
            let f = p - i as f64;
            let next = sorted[(i + 1).min(sorted.len() - 1)];
            (1.0 - f) * sorted[i] + f * next
        }
    }
}

/// The summary of per-token comparisons (in position order).
pub fn summarize(t: &[TokenCompare]) -> CompareSummary {
    let n = t.len() as f64;
    let mut kl: Vec<f64> = t.iter().map(|x| x.kl).collect();
    let kl_mean = kl.iter().sum::<f64>() / n;
    kl.sort_by(f64::total_cmp);
    let nll: f64 = t.iter().map(|x| x.nll).sum();
    let nll_base: f64 = t.iter().map(|x| x.nll_base).sum();
    CompareSummary {
        kl_mean,
        kl_median: percentile(&kl, 0.5),
        kl_p99: percentile(&kl, 0.99),
        kl_max: kl.last().copied().unwrap_or(f64::NAN),
        top1_agreement: t.iter().filter(|x| x.same_top).count() as f64 / n,
        ppl_base: (nll_base / n).exp(),
        ppl: (nll / n).exp(),
        nll_delta: t.iter().map(|x| x.nll - x.nll_base).sum::<f64>() / n,
        tokens: t.len(),
    }
}

/// The base's side: runs every window of `ids` and appends its logits to `scratch` (f32, little
/// endian, row after row); `progress` gets the tokens done so far.
pub fn base_pass(
    engine: &Arc<Engine>,
    ids: &[u32],
    window: usize,
    scratch: &mut std::fs::File,
    progress: &mut dyn FnMut(usize),
) -> Result<usize, CompareError> {
    let spans = spans(ids, window)?;
    let mut w = std::io::BufWriter::new(scratch);
    let mut done = 0;
    for &(s, e) in &spans {
        let logits = engine.new_session().score(&ids[s..e]).map_err(PerplexityError::from)?;
        for x in &logits {
            w.write_all(&x.to_le_bytes())?;
        }
        done += e - s;
        progress(done);
    }
    w.flush()?;
    Ok(engine.vocab())
}

/// The judged side: runs every window of `ids` and compares each position with the base's logits
/// in `scratch` (written by [`base_pass`] with a vocabulary of `base_vocab`).
pub fn judged_pass(
    engine: &Arc<Engine>,
    ids: &[u32],
    window: usize,
    scratch: &mut std::fs::File,
    base_vocab: usize,
    progress: &mut dyn FnMut(usize),
) -> Result<Vec<TokenCompare>, CompareError> {
    let vocab = engine.vocab();
    if vocab != base_vocab {
        return Err(CompareError::Vocab { base: base_vocab, judged: vocab });
    }
    let spans = spans(ids, window)?;
    scratch.rewind()?;
    let mut r = std::io::BufReader::new(scratch);
    let mut out = Vec::with_capacity(ids.len());
    let mut buf = Vec::new();
    for &(s, e) in &spans {
        let logits = engine.new_session().score(&ids[s..e]).map_err(PerplexityError::from)?;
        buf.resize((e - s) * vocab * 4, 0);
        r.read_exact(&mut buf)?;
        let base: Vec<f32> = buf.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        for (row, &target) in ids[s + 1..=e].iter().enumerate() {
            let span = row * vocab..(row + 1) * vocab;
            let t = token_compare(&base[span.clone()], &logits[span], target);
            let pos = s + 1 + row;
            for v in [t.kl, t.nll, t.nll_base] {
                perplexity::finite(v, pos)?;
            }
            out.push(t);
        }
        progress(out.len());
    }
    Ok(out)
}

/// A scratch file for the base's logits in the temporary directory (`TMPDIR`), removed from the
/// directory at once on Unix (it lives until closed) and left for the OS to clean elsewhere.
pub fn scratch_file() -> std::io::Result<std::fs::File> {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let path = std::env::temp_dir().join(format!("deltafin-compare-{}-{nanos}.f32", std::process::id()));
    let f = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path)?;
    if cfg!(unix) {
        std::fs::remove_file(&path)?;
    }
    Ok(f)
}

fn spans(ids: &[u32], window: usize) -> Result<Vec<(usize, usize)>, PerplexityError> {
    if window == 0 {
        return Err(PerplexityError::Window);
    }
    let spans = perplexity::windows(ids.len(), window);
    if spans.is_empty() {
        return Err(PerplexityError::Empty);
    }
    Ok(spans)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_distributions_have_zero_kl_and_agree() {
        let l = [0.5f32, -1.0, 3.0, 3.0, 2.0];
        let t = token_compare(&l, &l, 1);
        assert_eq!(t.kl, 0.0);
        assert!(t.same_top);
        assert_eq!(t.nll, t.nll_base);
        let s = summarize(&[t, t]);
        assert_eq!((s.kl_mean, s.kl_max, s.top1_agreement, s.nll_delta), (0.0, 0.0, 1.0, 0.0));
        assert_eq!(s.ppl, s.ppl_base);
    }

    #[test]
    fn kl_is_of_the_judged_from_the_base() {
        let (b, j) = ([0.0f32, 1.0, 2.0], [2.0f32, 1.0, 0.0]);
        let pb: Vec<f64> = {
            let z: f64 = [0f64, 1.0, 2.0].iter().map(|x| x.exp()).sum();
            [0f64, 1.0, 2.0].iter().map(|x| x.exp() / z).collect()
        };
        let pj: Vec<f64> = pb.iter().rev().copied().collect();
        let want: f64 = pb.iter().zip(&pj).map(|(p, q)| p * (p / q).ln()).sum();
        let t = token_compare(&b, &j, 0);
        assert!((t.kl - want).abs() < 1e-12);
        assert!(!t.same_top);
        // Ties: the first maximum, as llama.cpp takes it.
        assert!(token_compare(&[1.0, 3.0, 3.0], &[1.0, 3.0, 2.0], 0).same_top);
    }

    #[test]
    fn percentiles_interpolate_linearly() {
        let v = [0.0, 1.0, 2.0, 3.0];
        assert_eq!(percentile(&v, 0.5), 1.5);
        assert!((percentile(&v, 0.99) - 2.97).abs() < 1e-12);
        assert_eq!(percentile(&v, 1.0), 3.0);
        assert_eq!(percentile(&[7.0], 0.5), 7.0);
    }
}
