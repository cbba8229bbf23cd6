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
mod tests;
