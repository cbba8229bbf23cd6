//! Unit tests of `sample` (a file of their own to keep the module under the file-size guide).

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
