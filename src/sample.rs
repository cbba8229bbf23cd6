//! Choosing the next token from K3's logits: greedy argmax, or sampling with temperature and
//! top-k, min-p and nucleus (top-p) filtering from a seeded generator, with optional
//! log-probabilities; logit biases and repetition, frequency and presence penalties first.
//!
//! Contract: the logits are first adjusted ([`adjusted`], only when a bias or penalty is set;
//! otherwise they are used as they are, bit for bit), in this fixed order (llama.cpp's and vLLM's):
//! OpenAI's `logit_bias` added to its tokens; llama.cpp's repeat penalty on every distinct token
//! of the last [`REPEAT_LAST_N`] tokens of the context (prompt included): a positive logit divided
//! by it, any other multiplied; then OpenAI's frequency and presence penalties: minus
//! `count * frequency_penalty + presence_penalty` for each token the generation has emitted so
//! far (`count` times; the prompt not counted). The arithmetic is f64 rounded once to f32, per
//! token, in a fixed order. What was emitted before comes as a [`History`], so the same tokens
//! give the same pick however they were reached (drafts included). Temperature 0 then picks
//! exactly [`crate::backend::cpu::ops::argmax`] of those logits and draws no
//! randomness (the filters cannot change the most likely token). Otherwise the token is drawn
//! from [`probabilities`]: softmax(logits / T), then, in this order, only the `top_k` most likely
//! tokens (0: all), only the tokens of probability at least `min_p` times the most likely one's
//! (0: all), and only the smallest set of the most likely remaining tokens whose mass (of the
//! remaining mass) reaches `top_p`, renormalised — vLLM's order; ties are broken by lower id
//! everywhere. The math is single-threaded f64 in a fixed order and the generator is a splitmix64
//! stream from `seed`, so the same logits, parameters and seed give the same tokens bit for bit on
//! any thread count. Every pick draws exactly one uniform number, which is what lets speculative
//! sampling ([`crate::draft`]; verified where `engine/scheduler/lane.rs` picks) reproduce plain sampling
//! token for token: it draws from the same filtered distribution ([`Sampler::distribution`]: the
//! adjusted logits' too). Log-probabilities are the model's own (the raw logits, as vLLM's
//! default), whatever the adjustments.
//!
//! A [`TokenMask`] (a grammar: `crate::constrain`) restricts the pick without changing it when it
//! may stand: the unconstrained pick is made as above, and kept when the mask allows it (the same
//! bits, the same draws as without the mask); otherwise greedy takes the argmax of the allowed
//! tokens, and sampling draws a second uniform number from the filtered distribution restricted to
//! the allowed tokens (renormalised; where the filters left none of them, from the distribution of
//! the logits with every other token removed) — so the token is distributed exactly as the filtered
//! distribution conditioned on the mask (llama.cpp's resample-on-reject).

use crate::backend::cpu::ops::argmax;
use std::sync::{Arc, Mutex};

/// How tokens are chosen: one value from a command's flags or a request's fields to the pick
/// ([`Sampler`]), saved whole with a session's sampler. A field a saved or sent value lacks takes
/// its default here (`#[serde(default)]`: greedy, top-p 1, filters off, no seed), so a session file
/// written before a field existed still loads.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SamplingSpec {
    /// 0 is greedy; OpenAI's range is 0..=2.
    pub temperature: f64,
    /// Nucleus mass in 0..=1 (1 keeps every token).
    pub top_p: f64,
    /// Keep only the k most likely tokens (0 keeps every token).
    pub top_k: usize,
    /// Keep only tokens at least this fraction (0..=1) as likely as the most likely (0 keeps every token).
    pub min_p: f64,
    /// The generator's seed. None: not chosen yet — a front end draws a fresh one (or takes a
    /// request's) before it samples; a sampler made without one starts from 0.
    pub seed: Option<u64>,
    /// llama.cpp's repeat penalty over the last [`REPEAT_LAST_N`] tokens (1 is off; above 0).
    #[serde(skip_serializing_if = "is_one")]
    pub repetition_penalty: f64,
    /// OpenAI's frequency penalty, -2..=2 (0 is off): per earlier emission of a token.
    #[serde(skip_serializing_if = "is_zero")]
    pub frequency_penalty: f64,
    /// OpenAI's presence penalty, -2..=2 (0 is off): once for a token emitted before.
    #[serde(skip_serializing_if = "is_zero")]
    pub presence_penalty: f64,
    /// OpenAI's `logit_bias`: (token id, bias in -100..=100), ascending ids, each once.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub logit_bias: Vec<(u32, f64)>,
}

fn is_one(x: &f64) -> bool {
    *x == 1.0
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

/// The window of llama.cpp's repeat penalty (its `--repeat-last-n` default): the last 64 tokens.
pub const REPEAT_LAST_N: usize = 64;

/// Most `logit_bias` entries a spec takes.
pub const MAX_LOGIT_BIAS: usize = 4096;

impl Default for SamplingSpec {
    fn default() -> Self {
        SamplingSpec::GREEDY
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SampleError {
    #[error("temperature {0} is outside 0..=2")]
    Temperature(f64),
    #[error("top_p {0} is outside 0..=1")]
    TopP(f64),
    #[error("min_p {0} is outside 0..=1")]
    MinP(f64),
    #[error("repetition_penalty {0} must be above 0 (1 is off)")]
    RepetitionPenalty(f64),
    #[error("frequency_penalty {0} is outside -2..=2")]
    FrequencyPenalty(f64),
    #[error("presence_penalty {0} is outside -2..=2")]
    PresencePenalty(f64),
    #[error("logit_bias: {0}")]
    LogitBias(String),
}

impl SampleError {
    /// The request field (and flag's library name) the error is about.
    pub fn field(&self) -> &'static str {
        match self {
            SampleError::Temperature(_) => "temperature",
            SampleError::TopP(_) => "top_p",
            SampleError::MinP(_) => "min_p",
            SampleError::RepetitionPenalty(_) => "repetition_penalty",
            SampleError::FrequencyPenalty(_) => "frequency_penalty",
            SampleError::PresencePenalty(_) => "presence_penalty",
            SampleError::LogitBias(_) => "logit_bias",
        }
    }
}

impl SamplingSpec {
    /// Greedy: temperature 0, top-p 1, filters off, no seed (the default of every field).
    pub const GREEDY: SamplingSpec = SamplingSpec {
        temperature: 0.0,
        top_p: 1.0,
        top_k: 0,
        min_p: 0.0,
        seed: None,
        repetition_penalty: 1.0,
        frequency_penalty: 0.0,
        presence_penalty: 0.0,
        logit_bias: Vec::new(),
    };

    pub fn greedy() -> Self {
        SamplingSpec::GREEDY
    }

    /// A checked spec with `seed` (top-k and min-p off: see [`Self::with_filters`]).
    pub fn new(temperature: f64, top_p: f64, seed: u64) -> Result<Self, SampleError> {
        if !(temperature.is_finite() && (0.0..=2.0).contains(&temperature)) {
            return Err(SampleError::Temperature(temperature));
        }
        if !(top_p.is_finite() && (0.0..=1.0).contains(&top_p)) {
            return Err(SampleError::TopP(top_p));
        }
        Ok(SamplingSpec { temperature, top_p, seed: Some(seed), ..SamplingSpec::GREEDY })
    }

    /// This spec with top-k (0: off) and min-p (0: off), checked.
    pub fn with_filters(self, top_k: usize, min_p: f64) -> Result<Self, SampleError> {
        if !(min_p.is_finite() && (0.0..=1.0).contains(&min_p)) {
            return Err(SampleError::MinP(min_p));
        }
        Ok(SamplingSpec { top_k, min_p, ..self })
    }

    /// The values are in the ranges [`SamplingSpec::new`] and [`SamplingSpec::with_filters`]
    /// accept (for values read from a file, a flag or a request rather than built by them).
    pub fn check(&self) -> Result<(), SampleError> {
        let seed = self.seed.unwrap_or(0);
        SamplingSpec::new(self.temperature, self.top_p, seed)?.with_filters(self.top_k, self.min_p)?;
        let r = self.repetition_penalty;
        if !(r.is_finite() && r > 0.0) {
            return Err(SampleError::RepetitionPenalty(r));
        }
        for (x, e) in [
            (self.frequency_penalty, SampleError::FrequencyPenalty as fn(f64) -> SampleError),
            (self.presence_penalty, SampleError::PresencePenalty),
        ] {
            if !(x.is_finite() && (-2.0..=2.0).contains(&x)) {
                return Err(e(x));
            }
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return Err(SampleError::LogitBias(format!("at most {MAX_LOGIT_BIAS} tokens")));
        }
        if let Some(&(t, b)) = self.logit_bias.iter().find(|(_, b)| !(b.is_finite() && (-100.0..=100.0).contains(b))) {
            return Err(SampleError::LogitBias(format!("token {t}'s bias {b} is outside -100..=100")));
        }
        if self.logit_bias.windows(2).any(|w| w[0].0 >= w[1].0) {
            return Err(SampleError::LogitBias("token ids must be ascending, each once".into()));
        }
        Ok(())
    }

    /// Whether any bias or penalty adjusts the logits before the pick ([`adjusted`]).
    pub fn adjusts(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
            || !self.logit_bias.is_empty()
    }

    /// This spec for the `i`-th of several choices of one request (`n`): seed + i (wrapping), so
    /// choice 0 is the request's own and each choice's seed is distinct and fixed by the request's.
    pub fn for_choice(&self, i: usize) -> SamplingSpec {
        SamplingSpec { seed: self.seed.map(|s| s.wrapping_add(i as u64)), ..self.clone() }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// Sampling settings each of which may be unset: what a model's generation_config.json suggests
/// (`model::generation`), what a command's flags give. Laid over one another ([`Self::or`]) and
/// then over the default of each field ([`Self::spec`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// 0: off (as HF's and vLLM's `top_k: 0`).
    pub top_k: Option<usize>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
}

impl SamplingDefaults {
    /// Each setting of `self`, else `under`'s.
    pub fn or(self, under: SamplingDefaults) -> Self {
        SamplingDefaults {
            temperature: self.temperature.or(under.temperature),
            top_p: self.top_p.or(under.top_p),
            top_k: self.top_k.or(under.top_k),
            min_p: self.min_p.or(under.min_p),
            repetition_penalty: self.repetition_penalty.or(under.repetition_penalty),
            frequency_penalty: self.frequency_penalty.or(under.frequency_penalty),
            presence_penalty: self.presence_penalty.or(under.presence_penalty),
        }
    }

    /// The spec: each setting, else its default ([`SamplingSpec::GREEDY`]'s); no seed.
    pub fn spec(self) -> SamplingSpec {
        let d = SamplingSpec::GREEDY;
        SamplingSpec {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_p: self.top_p.unwrap_or(d.top_p),
            top_k: self.top_k.unwrap_or(d.top_k),
            min_p: self.min_p.unwrap_or(d.min_p),
            seed: None,
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            logit_bias: Vec::new(),
        }
    }
}

/// One step of splitmix64 on `state`: the next 64 random bits.
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// splitmix64: small, fast, and fully determined by its seed.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        splitmix64(&mut self.0)
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// What came before the token being picked: the context's tokens (`committed`, then `pending`:
/// rows not yet committed, such as a verify block's), the last `generated` of which this
/// generation emitted. The default is an empty context.
#[derive(Clone, Copy, Debug, Default)]
pub struct History<'a> {
    pub committed: &'a [u32],
    pub pending: &'a [u32],
    pub generated: usize,
}

impl History<'_> {
    /// The last `n` tokens of the context, oldest first.
    fn last(&self, n: usize) -> impl Iterator<Item = u32> + '_ {
        let len = self.committed.len() + self.pending.len();
        self.committed.iter().chain(self.pending).copied().skip(len.saturating_sub(n))
    }
}

/// (token, count) of `tokens`, ascending ids.
fn counted(tokens: impl Iterator<Item = u32>) -> Vec<(u32, u32)> {
    let mut v: Vec<u32> = tokens.collect();
    v.sort_unstable();
    let mut out: Vec<(u32, u32)> = Vec::new();
    for t in v {
        match out.last_mut() {
            Some((x, c)) if *x == t => *c += 1,
            _ => out.push((t, 1)),
        }
    }
    out
}

/// The logits after `p`'s logit bias and penalties given `h` (see the module contract), or None
/// when `p` sets none (the logits stand as they are).
pub fn adjusted(logits: &[f32], p: &SamplingSpec, h: History) -> Option<Vec<f32>> {
    if !p.adjusts() {
        return None;
    }
    let mut out = logits.to_vec();
    let at = |out: &mut Vec<f32>, t: u32, f: &dyn Fn(f64) -> f64| {
        if let Some(l) = out.get_mut(t as usize) {
            *l = f(*l as f64) as f32;
        }
    };
    for &(t, b) in &p.logit_bias {
        at(&mut out, t, &|l| l + b);
    }
    let r = p.repetition_penalty;
    if r != 1.0 {
        for (t, _) in counted(h.last(REPEAT_LAST_N)) {
            at(&mut out, t, &|l| if l > 0.0 { l / r } else { l * r });
        }
    }
    let (fp, pp) = (p.frequency_penalty, p.presence_penalty);
    if fp != 0.0 || pp != 0.0 {
        for (t, c) in counted(h.last(h.generated)) {
            at(&mut out, t, &|l| l - (c as f64 * fp + pp));
        }
    }
    Some(out)
}

/// The sampling distribution over the whole vocabulary (zeros outside the nucleus), summing to 1.
/// Greedy parameters give a point mass on the argmax.
pub fn probabilities(logits: &[f32], p: &SamplingSpec) -> Vec<f64> {
    let mut probs = vec![0.0; logits.len()];
    if logits.is_empty() {
        return probs;
    }
    if p.is_greedy() {
        probs[argmax(logits) as usize] = 1.0;
        return probs;
    }
    let max = logits.iter().copied().filter(|x| !x.is_nan()).fold(f32::NEG_INFINITY, f32::max) as f64;
    if !max.is_finite() {
        // No usable logit: fall back to the argmax rule rather than divide by zero.
        probs[argmax(logits) as usize] = 1.0;
        return probs;
    }
    for (w, &l) in probs.iter_mut().zip(logits) {
        *w = if l.is_nan() { 0.0 } else { ((l as f64 - max) / p.temperature).exp() };
    }
    if p.top_k > 0 || p.min_p > 0.0 || p.top_p < 1.0 {
        // Tokens with mass, most likely first (ties: lower id first); each filter keeps a prefix.
        let mut order: Vec<u32> = (0..probs.len() as u32).filter(|&i| probs[i as usize] > 0.0).collect();
        let w = probs.clone();
        let rank = |a: &u32, b: &u32| w[*b as usize].total_cmp(&w[*a as usize]).then(a.cmp(b));
        if p.top_k > 0 && p.top_k < order.len() {
            // Only the top k need ordering.
            order.select_nth_unstable_by(p.top_k - 1, rank);
            for &i in &order[p.top_k..] {
                probs[i as usize] = 0.0;
            }
            order.truncate(p.top_k);
        }
        order.sort_unstable_by(rank);
        if p.min_p > 0.0 && !order.is_empty() {
            let bound = p.min_p * w[order[0] as usize];
            let keep = order.partition_point(|&i| w[i as usize] >= bound).max(1);
            for &i in &order[keep..] {
                probs[i as usize] = 0.0;
            }
            order.truncate(keep);
        }
        if p.top_p < 1.0 {
            // The mass of what the filters above kept, summed in id order (as with no filter).
            let total: f64 = probs.iter().sum();
            let mut cum = 0.0;
            let mut keep = order.len();
            for (n, &i) in order.iter().enumerate() {
                cum += probs[i as usize];
                if cum >= p.top_p * total {
                    keep = n + 1;
                    break;
                }
            }
            for &i in &order[keep..] {
                probs[i as usize] = 0.0;
            }
        }
    }
    let total: f64 = probs.iter().sum();
    for w in &mut probs {
        *w /= total;
    }
    probs
}

/// The token whose cumulative probability (in id order) first exceeds `u` in [0, 1).
pub fn inverse_cdf(probs: &[f64], u: f64) -> u32 {
    let mut cum = 0.0;
    let mut last = 0;
    for (i, &w) in probs.iter().enumerate() {
        if w > 0.0 {
            cum += w;
            last = i;
            if u < cum {
                return i as u32;
            }
        }
    }
    // Rounding left the sum just under u: the last token with mass.
    last as u32
}

/// One token's log-probability and the most likely alternatives (OpenAI's `logprobs` content).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f64,
    /// (token, logprob), most likely first.
    pub top: Vec<(u32, f64)>,
}

/// log-softmax of the raw logits (the model's own distribution, temperature 1) at `token`, with the
/// `top` most likely tokens.
pub fn logprobs(logits: &[f32], token: u32, top: usize) -> TokenLogprob {
    let max = logits.iter().copied().filter(|x| !x.is_nan()).fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + logits.iter().map(|&l| (l as f64 - max).exp()).filter(|x| !x.is_nan()).sum::<f64>().ln();
    let lp = |i: u32| logits.get(i as usize).map_or(f64::NEG_INFINITY, |&l| l as f64 - lse);
    let mut best: Vec<u32> = Vec::with_capacity(top + 1);
    if top > 0 {
        for i in 0..logits.len() as u32 {
            let li = logits[i as usize];
            if li.is_nan() {
                continue;
            }
            let pos = best.partition_point(|&b| logits[b as usize] >= li);
            if pos < top {
                best.insert(pos, i);
                best.truncate(top);
            }
        }
    }
    TokenLogprob { token, logprob: lp(token), top: best.into_iter().map(|i| (i, lp(i))).collect() }
}

/// Which tokens may come next (a grammar over the answer); see the module contract.
pub trait TokenMask: Send {
    /// `token` may come next (cheap: asked of every pick).
    fn allows(&mut self, token: u32) -> bool;
    /// Every token that may come next, over a vocabulary of `vocab` (asked only when the pick was
    /// refused); None when the constraint has failed (see [`TokenMask::error`]).
    fn allowed(&mut self, vocab: usize) -> Option<Vec<bool>>;
    /// `token` was picked.
    fn accept(&mut self, token: u32);
    /// The token to end with once the constraint has failed (a stop token).
    fn stop_token(&self) -> u32;
    /// Why the constraint failed, if it has.
    fn error(&self) -> Option<String>;
}

/// Picks tokens for one generation; see the module contract.
pub struct Sampler {
    pub params: SamplingSpec,
    rng: Rng,
    /// The constraint on every pick, if any.
    mask: Option<Box<dyn TokenMask>>,
    /// When set, every pick appends its log-probabilities (with this many alternatives) here.
    logprobs: Option<(usize, Arc<Mutex<Vec<TokenLogprob>>>)>,
    picks: u64,
}

impl Sampler {
    /// A sampler from `params`' seed (0 when it has none).
    pub fn new(params: SamplingSpec) -> Self {
        Sampler { rng: Rng::new(params.seed.unwrap_or(0)), params, mask: None, logprobs: None, picks: 0 }
    }

    pub fn greedy() -> Self {
        Sampler::new(SamplingSpec::greedy())
    }

    /// Records each pick's log-probabilities with `top` alternatives; the returned list grows by
    /// one entry per pick, in order (pick j is the j-th emitted token; a speculative generation may
    /// leave extra entries after its last emitted token).
    pub fn record_logprobs(&mut self, top: usize) -> Arc<Mutex<Vec<TokenLogprob>>> {
        let sink = Arc::new(Mutex::new(Vec::new()));
        self.logprobs = Some((top, Arc::clone(&sink)));
        sink
    }

    /// Every pick from now on obeys `mask` (see the module contract).
    pub fn constrain(&mut self, mask: Box<dyn TokenMask>) {
        self.mask = Some(mask);
    }

    /// Why the constraint failed, if one was set and it has (the generation ended at its stop token).
    pub fn constraint_error(&self) -> Option<String> {
        self.mask.as_ref().and_then(|m| m.error())
    }

    /// Picks made so far.
    pub fn picks(&self) -> u64 {
        self.picks
    }

    /// The next token after `logits` (the greedy argmax on the CPU), with nothing before it (see
    /// [`Sampler::pick_after`]).
    pub fn pick(&mut self, logits: &[f32]) -> u32 {
        self.pick_after(logits, History::default())
    }

    /// The next token after `logits`, `h` having come before it (for the penalties).
    pub fn pick_after(&mut self, logits: &[f32], h: History) -> u32 {
        self.pick_with(logits, h, |l| Ok::<u32, std::convert::Infallible>(crate::backend::cpu::ops::argmax(l)))
            .unwrap_or_else(|e| match e {})
    }

    /// [`Sampler::pick_after`] with the greedy argmax run by `be` (the same index on every
    /// backend); a backend that fails is an error and no pick is made.
    pub fn pick_on(
        &mut self,
        be: &dyn crate::backend::Backend,
        logits: &[f32],
        h: History,
    ) -> Result<u32, crate::backend::BackendError> {
        self.pick_with(logits, h, |l| be.argmax(l))
    }

    /// The distribution this sampler draws from after `logits` with `h` before them: the adjusted
    /// logits' ([`adjusted`]), filtered ([`probabilities`]); what a sampled draft is judged against
    /// (`draft::sampling`).
    pub fn distribution(&self, logits: &[f32], h: History) -> Vec<f64> {
        let adj = adjusted(logits, &self.params, h);
        probabilities(adj.as_deref().unwrap_or(logits), &self.params)
    }

    fn pick_with<E>(
        &mut self,
        raw: &[f32],
        h: History,
        argmax: impl FnOnce(&[f32]) -> Result<u32, E>,
    ) -> Result<u32, E> {
        let adj = adjusted(raw, &self.params, h);
        let logits = adj.as_deref().unwrap_or(raw);
        let mut t = if self.params.is_greedy() {
            argmax(logits)?
        } else {
            let u = self.rng.uniform();
            inverse_cdf(&probabilities(logits, &self.params), u)
        };
        if let Some(mask) = &mut self.mask {
            t = masked_pick(&mut **mask, logits, t, &self.params, &mut self.rng);
        }
        if let Some((top, sink)) = &self.logprobs {
            let lp = logprobs(raw, t, *top);
            if let Ok(mut v) = sink.lock() {
                v.push(lp);
            }
        }
        self.picks += 1;
        Ok(t)
    }

    /// A uniform number from this sampler's stream (for accept/reject decisions).
    pub fn uniform(&mut self) -> f64 {
        self.rng.uniform()
    }

    /// Where this sampler is — parameters, generator state, picks — to resume it later
    /// ([`Sampler::resume`]: a state file, `engine::state_file`).
    pub fn position(&self) -> (SamplingSpec, u64, u64) {
        (self.params.clone(), self.rng.0, self.picks)
    }

    /// A sampler that continues where [`Sampler::position`] was taken: the same picks from here on.
    pub fn resume(params: SamplingSpec, rng: u64, picks: u64) -> Self {
        Sampler { params, rng: Rng(rng), mask: None, logprobs: None, picks }
    }
}

/// The pick `t` when `mask` allows it, else the allowed token the module contract names; the
/// mask is told the token taken.
fn masked_pick(mask: &mut dyn TokenMask, logits: &[f32], t: u32, p: &SamplingSpec, rng: &mut Rng) -> u32 {
    if mask.allows(t) {
        mask.accept(t);
        return t;
    }
    let Some(ok) = mask.allowed(logits.len()).filter(|ok| ok.iter().any(|&a| a)) else {
        return mask.stop_token();
    };
    let masked: Vec<f32> = logits.iter().zip(&ok).map(|(&l, &a)| if a { l } else { f32::NEG_INFINITY }).collect();
    let t = if p.is_greedy() {
        // argmax of a row whose only finite values are the allowed ones: an allowed token (a NaN
        // logit loses to any number in `argmax`; all allowed NaN: the first allowed).
        let t = argmax(&masked);
        if ok[t as usize] { t } else { ok.iter().position(|&a| a).unwrap_or(0) as u32 }
    } else {
        let mut q = probabilities(logits, p);
        for (w, &a) in q.iter_mut().zip(&ok) {
            if !a {
                *w = 0.0;
            }
        }
        let total: f64 = q.iter().sum();
        if total > 0.0 {
            for w in &mut q {
                *w /= total;
            }
        } else {
            q = probabilities(&masked, p);
        }
        let t = inverse_cdf(&q, rng.uniform());
        if ok[t as usize] { t } else { ok.iter().position(|&a| a).unwrap_or(0) as u32 }
    };
    mask.accept(t);
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_argmax_and_draws_nothing() {
        let logits = [0.1f32, 3.0, -1.0, 3.0];
        let mut s = Sampler::greedy();
        assert_eq!(s.pick(&logits), argmax(&logits));
        assert_eq!(probabilities(&logits, &SamplingSpec::greedy())[argmax(&logits) as usize], 1.0);
    }

    #[test]
    fn top_p_keeps_the_smallest_nucleus() {
        let logits = [2.0f32.ln(), 5.0f32.ln(), 3.0f32.ln(), 0.0];
        let p = SamplingSpec::new(1.0, 0.7, 0).unwrap();
        let probs = probabilities(&logits, &p);
        // Masses 2/11, 5/11, 3/11, 1/11: 5 + 3 = 8/11 >= 0.7.
        assert!((probs[1] - 5.0 / 8.0).abs() < 1e-6 && (probs[2] - 3.0 / 8.0).abs() < 1e-6, "{probs:?}");
        assert_eq!((probs[0], probs[3]), (0.0, 0.0));
        let p0 = SamplingSpec::new(1.0, 0.0, 0).unwrap();
        assert_eq!(probabilities(&logits, &p0)[1], 1.0, "top_p 0 keeps the top token");
    }

    #[test]
    fn top_k_and_min_p_keep_a_prefix_before_top_p() {
        // Masses 2, 5, 3, 1, 3 (of 14).
        let logits = [2.0f32.ln(), 5.0f32.ln(), 3.0f32.ln(), 0.0, 3.0f32.ln()];
        let at = |top_k, min_p, top_p| {
            let p = SamplingSpec::new(1.0, top_p, 0).unwrap().with_filters(top_k, min_p).unwrap();
            probabilities(&logits, &p)
        };
        let close = |got: Vec<f64>, want: [f64; 5]| {
            assert!(got.iter().zip(want).all(|(g, w)| (g - w).abs() < 1e-6), "{got:?} vs {want:?}");
        };
        close(at(1, 0.0, 1.0), [0.0, 1.0, 0.0, 0.0, 0.0]);
        // k = 2: 5 and the first of the two 3s (ties go to the lower id).
        close(at(2, 0.0, 1.0), [0.0, 5.0 / 8.0, 3.0 / 8.0, 0.0, 0.0]);
        close(at(0, 0.0, 1.0), [2.0 / 14.0, 5.0 / 14.0, 3.0 / 14.0, 1.0 / 14.0, 3.0 / 14.0]);
        close(at(99, 0.0, 1.0), at(0, 0.0, 1.0).try_into().unwrap());
        // min_p 0.55 of 5 is 2.75: the 3s stay, 2 and 1 go.
        close(at(0, 0.55, 1.0), [0.0, 5.0 / 11.0, 3.0 / 11.0, 0.0, 3.0 / 11.0]);
        close(at(0, 1.0, 1.0), [0.0, 1.0, 0.0, 0.0, 0.0]);
        // top_p counts the mass the other filters left: of 5 + 3 + 3, 0.7 needs 5 + 3.
        close(at(0, 0.55, 0.7), [0.0, 5.0 / 8.0, 3.0 / 8.0, 0.0, 0.0]);
        close(at(3, 0.0, 0.4), [0.0, 1.0, 0.0, 0.0, 0.0]);
        // The filters never change the greedy pick.
        let g = SamplingSpec::greedy().with_filters(2, 0.5).unwrap();
        assert_eq!(Sampler::new(g).pick(&logits), 1);
        assert_eq!(SamplingSpec::greedy().with_filters(0, 1.5), Err(SampleError::MinP(1.5)));
        // Off, the distribution is the one without the filters, bit for bit.
        let p = SamplingSpec::new(0.8, 0.9, 3).unwrap();
        assert_eq!(probabilities(&logits, &p), probabilities(&logits, &p.with_filters(0, 0.0).unwrap()));
    }

    #[test]
    fn same_seed_same_tokens_and_frequencies_follow_the_distribution() {
        let logits: Vec<f32> = (0..16).map(|i| (i as f32 * 0.37).sin() * 2.0).collect();
        let p = SamplingSpec::new(0.8, 1.0, 42).unwrap();
        let run = |seed| {
            let mut s = Sampler::new(SamplingSpec { seed: Some(seed), ..p.clone() });
            (0..20000).map(|_| s.pick(&logits)).collect::<Vec<_>>()
        };
        let a = run(42);
        assert_eq!(a, run(42));
        assert_ne!(a, run(43));
        let probs = probabilities(&logits, &p);
        let mut counts = [0f64; 16];
        for &t in &a {
            counts[t as usize] += 1.0;
        }
        let n = a.len() as f64;
        let chi2: f64 =
            probs.iter().zip(&counts).filter(|(p, _)| **p > 0.0).map(|(p, c)| (c - n * p).powi(2) / (n * p)).sum();
        // 15 degrees of freedom: the 99.9% point is 37.7.
        assert!(chi2 < 37.7, "chi2 {chi2}");
    }

    #[test]
    fn bad_parameters_are_refused() {
        assert_eq!(SamplingSpec::new(2.5, 1.0, 0), Err(SampleError::Temperature(2.5)));
        assert!(SamplingSpec::new(f64::NAN, 1.0, 0).is_err());
        assert_eq!(SamplingSpec::new(1.0, 1.5, 0), Err(SampleError::TopP(1.5)));
    }

    #[test]
    fn a_spec_saved_without_a_field_loads_with_its_default() {
        // What a session file written before top_k and min_p existed holds.
        let old: SamplingSpec = serde_json::from_str(r#"{"temperature":0.5,"top_p":0.9,"seed":3}"#).unwrap();
        assert_eq!(old, SamplingSpec::new(0.5, 0.9, 3).unwrap());
        assert_eq!(serde_json::from_str::<SamplingSpec>("{}").unwrap(), SamplingSpec::GREEDY);
        // Written as before: every field, the seed a number.
        let p = SamplingSpec::new(0.5, 0.9, 3).unwrap().with_filters(40, 0.05).unwrap();
        let text = serde_json::to_string(&p).unwrap();
        assert_eq!(text, r#"{"temperature":0.5,"top_p":0.9,"top_k":40,"min_p":0.05,"seed":3}"#);
        assert_eq!(serde_json::from_str::<SamplingSpec>(&text).unwrap(), p);
        // Penalties and biases are written only when set, and read back whole.
        let q = SamplingSpec { repetition_penalty: 1.1, presence_penalty: -0.5, logit_bias: vec![(7, -100.0)], ..p };
        let text = serde_json::to_string(&q).unwrap();
        assert!(text.contains(r#""repetition_penalty":1.1"#) && !text.contains("frequency_penalty"), "{text}");
        assert_eq!(serde_json::from_str::<SamplingSpec>(&text).unwrap(), q);
    }

    /// llama.cpp's repeat penalty and OpenAI's frequency and presence penalties, computed apart
    /// from `adjusted`, over the context `ctx` whose last `generated` tokens were emitted.
    fn by_hand(logits: &[f32], p: &SamplingSpec, ctx: &[u32], generated: usize) -> Vec<f64> {
        let mut l: Vec<f64> = logits.iter().map(|&x| x as f64).collect();
        for &(t, b) in &p.logit_bias {
            l[t as usize] += b;
        }
        let window = &ctx[ctx.len().saturating_sub(REPEAT_LAST_N)..];
        for (t, x) in l.iter_mut().enumerate() {
            if window.contains(&(t as u32)) {
                *x = if *x > 0.0 { *x / p.repetition_penalty } else { *x * p.repetition_penalty };
            }
            let count = ctx[ctx.len() - generated..].iter().filter(|&&c| c == t as u32).count() as f64;
            *x -= count * p.frequency_penalty + if count > 0.0 { p.presence_penalty } else { 0.0 };
        }
        l
    }

    #[test]
    fn penalties_and_bias_adjust_the_logits_as_llama_cpp_and_openai_say() {
        let logits = [2.0f32, -1.0, 0.5, 3.0, -0.2, 1.0];
        // Context: prompt 1 5, then emitted 3 0 3 (two of them still pending, as in a verify block).
        let ctx = [1u32, 5, 3, 0, 3];
        let h = History { committed: &ctx[..3], pending: &ctx[3..], generated: 3 };
        let p = SamplingSpec {
            temperature: 1.0,
            repetition_penalty: 1.5,
            frequency_penalty: 1.0,
            presence_penalty: 0.2,
            logit_bias: vec![(4, 1.0)],
            ..SamplingSpec::GREEDY
        };
        p.check().unwrap();
        let got = adjusted(&logits, &p, h).unwrap();
        let want = by_hand(&logits, &p, &ctx, 3);
        for (g, w) in got.iter().zip(&want) {
            assert!((*g as f64 - w).abs() < 1e-6, "{got:?} vs {want:?}");
        }
        // 3 (logit 3) was the argmax; penalised twice it is not: the biased 4 is.
        assert_eq!(argmax(&logits), 3);
        assert_eq!(Sampler::new(SamplingSpec { temperature: 0.0, ..p.clone() }).pick_after(&logits, h), 4);
        // The distribution sampled from is the adjusted logits' softmax.
        let probs = Sampler::new(p.clone()).distribution(&logits, h);
        let z: f64 = want.iter().map(|x| x.exp()).sum();
        for (q, w) in probs.iter().zip(&want) {
            assert!((q - w.exp() / z).abs() < 1e-6, "{probs:?}");
        }
        // The repeat penalty sees only the last 64 tokens; the others only what was emitted.
        let mut long = vec![2u32];
        long.extend(std::iter::repeat_n(1u32, REPEAT_LAST_N));
        let h = History { committed: &long, pending: &[], generated: 0 };
        let only_repeat = SamplingSpec { repetition_penalty: 2.0, ..SamplingSpec::GREEDY };
        let got = adjusted(&logits, &only_repeat, h).unwrap();
        assert_eq!((got[1], got[2]), (-2.0, 0.5), "token 2 is out of the window");
        let h = History { committed: &long, pending: &[], generated: 0 };
        let freq = SamplingSpec { frequency_penalty: 2.0, presence_penalty: 1.0, ..SamplingSpec::GREEDY };
        assert_eq!(adjusted(&logits, &freq, h).unwrap(), logits.to_vec(), "the prompt is not counted");
        // Off: no copy, the logits as they are.
        assert!(adjusted(&logits, &SamplingSpec::GREEDY, h).is_none());
        // Out of range.
        let bad = |s: SamplingSpec| s.check().unwrap_err().field();
        assert_eq!(bad(SamplingSpec { repetition_penalty: 0.0, ..SamplingSpec::GREEDY }), "repetition_penalty");
        assert_eq!(bad(SamplingSpec { frequency_penalty: 2.5, ..SamplingSpec::GREEDY }), "frequency_penalty");
        assert_eq!(bad(SamplingSpec { presence_penalty: -3.0, ..SamplingSpec::GREEDY }), "presence_penalty");
        assert_eq!(bad(SamplingSpec { logit_bias: vec![(1, 101.0)], ..SamplingSpec::GREEDY }), "logit_bias");
        assert_eq!(bad(SamplingSpec { logit_bias: vec![(2, 1.0), (1, 1.0)], ..SamplingSpec::GREEDY }), "logit_bias");
    }

    #[test]
    fn choices_take_the_seed_plus_their_index() {
        let p = SamplingSpec::new(0.8, 1.0, u64::MAX).unwrap();
        assert_eq!(p.for_choice(0), p);
        assert_eq!(p.for_choice(1).seed, Some(0));
        assert_eq!(p.for_choice(2).seed, Some(1));
    }

    #[test]
    fn defaults_lay_over_one_another_then_over_greedy() {
        let flags = SamplingDefaults { temperature: Some(0.7), ..Default::default() };
        let model = SamplingDefaults { temperature: Some(1.0), top_k: Some(40), ..Default::default() };
        let s = flags.or(model).spec();
        assert_eq!(s, SamplingSpec { temperature: 0.7, top_k: 40, ..SamplingSpec::GREEDY });
        assert_eq!(SamplingDefaults::default().spec(), SamplingSpec::GREEDY);
    }

    #[test]
    fn logprobs_are_log_softmax_with_sorted_alternatives() {
        let logits = [1.0f32, 2.0, 3.0];
        let lp = logprobs(&logits, 0, 2);
        let lse = (1f64.exp() + 2f64.exp() + 3f64.exp()).ln();
        assert!((lp.logprob - (1.0 - lse)).abs() < 1e-9);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 1]);
    }

    /// A mask allowing a fixed set of tokens.
    struct Only(Vec<bool>, Vec<u32>);
    impl TokenMask for Only {
        fn allows(&mut self, t: u32) -> bool {
            self.0[t as usize]
        }
        fn allowed(&mut self, _vocab: usize) -> Option<Vec<bool>> {
            Some(self.0.clone())
        }
        fn accept(&mut self, t: u32) {
            self.1.push(t);
        }
        fn stop_token(&self) -> u32 {
            0
        }
        fn error(&self) -> Option<String> {
            None
        }
    }

    #[test]
    fn a_mask_keeps_allowed_picks_bit_for_bit_and_conditions_the_rest() {
        let logits: Vec<f32> = (0..8).map(|i| (i as f32 * 0.9).cos() * 2.0).collect();
        let best = argmax(&logits);
        let mut all = vec![true; 8];
        let mut g = Sampler::greedy();
        g.constrain(Box::new(Only(all.clone(), vec![])));
        assert_eq!(g.pick(&logits), best);
        all[best as usize] = false;
        let mut g = Sampler::greedy();
        g.constrain(Box::new(Only(all.clone(), vec![])));
        let masked: Vec<f32> =
            logits.iter().enumerate().map(|(i, &l)| if i == best as usize { f32::MIN } else { l }).collect();
        assert_eq!(g.pick(&logits), argmax(&masked), "greedy takes the best allowed token");
        // Sampling: while every pick is allowed, the tokens are those of no mask.
        let p = SamplingSpec::new(1.0, 1.0, 11).unwrap();
        let (mut a, mut b) = (Sampler::new(p.clone()), Sampler::new(p.clone()));
        b.constrain(Box::new(Only(vec![true; 8], vec![])));
        assert!((0..500).all(|_| a.pick(&logits) == b.pick(&logits)));
        // Some tokens forbidden: the picks follow the distribution conditioned on the allowed.
        let ok = [true, false, true, false, true, true, false, true];
        let mut s = Sampler::new(p.clone());
        s.constrain(Box::new(Only(ok.to_vec(), vec![])));
        let probs = probabilities(&logits, &p);
        let mass: f64 = probs.iter().zip(ok).filter(|(_, a)| *a).map(|(w, _)| w).sum();
        let want: Vec<f64> = probs.iter().zip(ok).map(|(w, a)| if a { w / mass } else { 0.0 }).collect();
        let mut counts = [0f64; 8];
        let n = 20000;
        for _ in 0..n {
            counts[s.pick(&logits) as usize] += 1.0;
        }
        assert!(ok.iter().zip(&counts).all(|(a, c)| *a || *c == 0.0), "a forbidden token was picked");
        let chi2: f64 = want
            .iter()
            .zip(&counts)
            .filter(|(w, _)| **w > 0.0)
            .map(|(w, c)| (c - n as f64 * w).powi(2) / (n as f64 * w))
            .sum();
        // 4 degrees of freedom: the 99.9% point is 18.5.
        assert!(chi2 < 18.5, "chi2 {chi2}");
    }
}
