//! Sampling: the same seed gives the same tokens bit for bit (1 or 2 threads, drafts on or off);
//! with drafts the emitted tokens follow K3's own distribution exactly (chi-square against the
//! distribution computed from the logits, on a tiny fixture, with a drafter whose proposals are
//! sometimes accepted and sometimes rejected); greedy parameters are plain greedy; top-k and min-p
//! filter the distribution that drafts are judged against too (same tokens with drafts as without,
//! same seed); logit biases and repetition, frequency and presence penalties follow their
//! definitions (computed apart, step by step) and drafts change none of their tokens; the CLI
//! flags.

mod common;
use common::*;
use deltafin::backend::BackendError;
use deltafin::draft::{Drafter, NgramDrafter, Speculator};
use deltafin::engine::{Engine, GenerateOptions, Session};
use deltafin::sample::{Sampler, SamplingSpec, probabilities};
use std::sync::Arc;

/// Always proposes the same tokens.
struct Fixed(Vec<u32>);

impl Drafter for Fixed {
    fn name(&self) -> &str {
        "fixed"
    }
    fn propose(&mut self, _context: &[u32], k: usize) -> Result<Vec<u32>, BackendError> {
        Ok(self.0.iter().copied().take(k).collect())
    }
}

fn opts(max_new: usize) -> GenerateOptions {
    GenerateOptions { max_new, stop: Vec::new() }
}

fn sampled(base: &Session, params: &SamplingSpec, max_new: usize, drafter: Option<Box<dyn Drafter>>) -> Vec<u32> {
    let mut s = base.fork().unwrap();
    let mut sampler = Sampler::new(params.clone());
    let g = match drafter {
        Some(d) => {
            let mut spec = Speculator::without_cost_model(d);
            s.generate_speculative_sampled(&opts(max_new), &mut spec, &mut sampler, &mut |_| true)
        }
        None => s.generate_sampled(&opts(max_new), &mut sampler, &mut |_| true),
    };
    g.unwrap().tokens
}

fn prefilled(e: &Arc<Engine>, prompt: &[u32]) -> Session {
    let mut s = e.new_session();
    s.prefill(prompt).unwrap();
    s
}

#[test]
fn same_seed_same_tokens_with_any_threads_and_drafts() {
    let r = reference("k3-tiny-b");
    let prompt = &r.prompt[..8];
    let p = SamplingSpec::new(0.9, 0.95, 1234).unwrap();
    let mut runs = Vec::new();
    for threads in [1, 2] {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        runs.push(pool.install(|| {
            let e = engine(&fixture("k3-tiny-b"));
            let base = prefilled(&e, prompt);
            let plain = sampled(&base, &p, 24, None);
            let ngram = sampled(&base, &p, 24, Some(Box::new(NgramDrafter::default())));
            let fixed = sampled(&base, &p, 24, Some(Box::new(Fixed(r.greedy[..4].to_vec()))));
            assert_eq!(ngram, plain, "{threads} threads: n-gram drafts change nothing");
            assert_eq!(fixed, plain, "{threads} threads: fixed drafts change nothing");
            plain
        }));
    }
    assert_eq!(runs[0], runs[1], "1 and 2 threads");
    let e = engine(&fixture("k3-tiny-b"));
    let base = prefilled(&e, prompt);
    assert_ne!(
        sampled(&base, &SamplingSpec { seed: Some(99), ..p.clone() }, 24, None),
        runs[0],
        "another seed, other tokens"
    );
    let greedy = sampled(&base, &SamplingSpec::greedy(), 24, None);
    assert_eq!(greedy, greedy_tokens(&e, prompt, 24), "temperature 0 is greedy");
}

#[test]
fn top_k_and_min_p_give_the_same_tokens_with_drafts_as_without() {
    let r = reference("k3-tiny-b");
    let e = engine(&fixture("k3-tiny-b"));
    let base = prefilled(&e, &r.prompt[..8]);
    let hot = SamplingSpec::new(1.5, 1.0, 77).unwrap();
    let mut seen = Vec::new();
    for (k, m) in [(3, 0.0), (0, 0.2), (5, 0.1), (1, 0.0)] {
        let p = hot.clone().with_filters(k, m).unwrap();
        let plain = sampled(&base, &p, 24, None);
        assert_eq!(
            sampled(&base, &p, 24, Some(Box::new(NgramDrafter::default()))),
            plain,
            "top_k {k} min_p {m}: n-gram"
        );
        // Drafts K3's greedy tokens: often inside the filtered set, sometimes outside it.
        let fixed = sampled(&base, &p, 24, Some(Box::new(Fixed(r.greedy[..6].to_vec()))));
        assert_eq!(fixed, plain, "top_k {k} min_p {m}: fixed drafts");
        seen.push(plain);
    }
    assert_eq!(seen[3], greedy_tokens(&e, &r.prompt[..8], 24), "top_k 1 is greedy");
    assert_ne!(seen[0], sampled(&base, &hot, 24, None), "top_k 3 changes a hot sampler's tokens");
    // Every token drawn with top_k 3 is among the 3 most likely at its position.
    let p = hot.clone().with_filters(3, 0.0).unwrap();
    let mut s = base.fork().unwrap();
    for &t in &seen[0] {
        let probs = probabilities(s.logits().unwrap(), &p);
        assert!(probs[t as usize] > 0.0 && probs.iter().filter(|&&x| x > 0.0).count() <= 3);
        s.step(t).unwrap();
    }
}

/// The logits after llama.cpp's repeat penalty (the last 64 tokens of `ctx`) and OpenAI's
/// frequency and presence penalties (its last `generated` tokens), written apart from
/// `deltafin::sample`, in f64.
fn penalised(logits: &[f32], p: &SamplingSpec, ctx: &[u32], generated: usize) -> Vec<f64> {
    let window = &ctx[ctx.len().saturating_sub(64)..];
    let emitted = &ctx[ctx.len() - generated..];
    logits
        .iter()
        .enumerate()
        .map(|(t, &l)| {
            let t = t as u32;
            let mut l = l as f64 + p.logit_bias.iter().find(|b| b.0 == t).map_or(0.0, |b| b.1);
            if window.contains(&t) {
                l = if l > 0.0 { l / p.repetition_penalty } else { l * p.repetition_penalty };
            }
            let c = emitted.iter().filter(|&&x| x == t).count() as f64;
            l - c * p.frequency_penalty - if c > 0.0 { p.presence_penalty } else { 0.0 }
        })
        .collect()
}

#[test]
fn penalties_follow_their_definition_and_drafts_change_no_token() {
    let r = reference("k3-tiny-b");
    let e = engine(&fixture("k3-tiny-b"));
    let prompt = &r.prompt[..8];
    let base = prefilled(&e, prompt);
    let pen = SamplingSpec {
        repetition_penalty: 1.3,
        frequency_penalty: 0.4,
        presence_penalty: 0.3,
        logit_bias: vec![(r.greedy[0], -2.0)],
        ..SamplingSpec::greedy()
    };
    // Greedy under penalties is the argmax of the penalised logits, step by step.
    let got = sampled(&base, &pen, 24, None);
    let mut s = base.fork().unwrap();
    let mut ctx = prompt.to_vec();
    for (i, &t) in got.iter().enumerate() {
        let l = penalised(s.logits().unwrap(), &pen, &ctx, i);
        let best = (0..l.len()).max_by(|&a, &b| l[a].total_cmp(&l[b]).then(b.cmp(&a))).unwrap() as u32;
        assert_eq!(t, best, "token {i}");
        ctx.push(t);
        s.step(t).unwrap();
    }
    assert_ne!(got, greedy_tokens(&e, prompt, 24), "the penalties change greedy tokens here");
    // Sampled: each token is drawn from the penalised softmax (its distribution matches by hand).
    let hot = SamplingSpec { temperature: 1.2, seed: Some(5), ..pen.clone() };
    let drawn = sampled(&base, &hot, 24, None);
    let mut s = base.fork().unwrap();
    let mut ctx = prompt.to_vec();
    for (i, &t) in drawn.iter().enumerate() {
        let l = penalised(s.logits().unwrap(), &hot, &ctx, i);
        let max = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = l.iter().map(|x| ((x - max) / 1.2).exp()).sum();
        let want: Vec<f64> = l.iter().map(|x| ((x - max) / 1.2).exp() / z).collect();
        let history = deltafin::sample::History { committed: &ctx, pending: &[], generated: i };
        let got = Sampler::new(hot.clone()).distribution(s.logits().unwrap(), history);
        assert!(got.iter().zip(&want).all(|(g, w)| (g - w).abs() < 1e-6), "token {i}");
        ctx.push(t);
        s.step(t).unwrap();
    }
    // Drafts (accepted and rejected) change no token, greedy or sampled.
    for p in [pen, hot] {
        let plain = sampled(&base, &p, 24, None);
        assert_eq!(sampled(&base, &p, 24, Some(Box::new(NgramDrafter::default()))), plain, "n-gram");
        let fixed = sampled(&base, &p, 24, Some(Box::new(Fixed(plain[..6].to_vec()))));
        assert_eq!(fixed, plain, "fixed drafts of its own tokens");
        let off = sampled(&base, &p, 24, Some(Box::new(Fixed(r.greedy[..6].to_vec()))));
        assert_eq!(off, plain, "fixed drafts of the unpenalised tokens");
    }
}

fn greedy_tokens(e: &Arc<Engine>, prompt: &[u32], n: usize) -> Vec<u32> {
    greedy(e, prompt, n)
}

/// A (first, second) token pair; None: any token not listed.
type Category = Option<(u32, Option<u32>)>;

/// Upper 99.9% point of chi-square with `df` degrees of freedom (Wilson–Hilferty).
fn chi2_999(df: f64) -> f64 {
    let z = 3.0902;
    df * (1.0 - 2.0 / (9.0 * df) + z * (2.0 / (9.0 * df)).sqrt()).powi(3)
}

#[test]
fn with_drafts_sampled_tokens_follow_k3s_distribution() {
    let r = reference("k3-tiny-a");
    let e = engine(&fixture("k3-tiny-a"));
    let prompt = &r.prompt[..6];
    let params = SamplingSpec::new(0.7, 1.0, 0).unwrap();
    let base = prefilled(&e, prompt);
    let p1 = probabilities(base.logits().unwrap(), &params);
    // Exact joint distribution of (t1, t2) for the most likely first tokens.
    let mut firsts: Vec<u32> = (0..p1.len() as u32).collect();
    firsts.sort_by(|&a, &b| p1[b as usize].total_cmp(&p1[a as usize]));
    firsts.truncate(3);
    let mut p2 = Vec::new();
    for &t1 in &firsts {
        let mut s = base.fork().unwrap();
        s.step(t1).unwrap();
        p2.push(probabilities(s.logits().unwrap(), &params));
    }
    // The draft for t2 is K3's most likely second token after the most likely first one: accepted
    // often after that first token, rarely after the others.
    let d = p2[0].iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i as u32).unwrap();
    // Categories: (t1, t2) for t1 among `firsts` and t2 among its 4 likeliest, (t1, other), other t1.
    let mut cats: Vec<(Category, f64)> = Vec::new();
    for (i, &t1) in firsts.iter().enumerate() {
        let mut seconds: Vec<u32> = (0..p2[i].len() as u32).collect();
        seconds.sort_by(|&a, &b| p2[i][b as usize].total_cmp(&p2[i][a as usize]));
        let mut rest = p1[t1 as usize];
        for &t2 in &seconds[..4] {
            let pj = p1[t1 as usize] * p2[i][t2 as usize];
            cats.push((Some((t1, Some(t2))), pj));
            rest -= pj;
        }
        cats.push((Some((t1, None)), rest));
    }
    let top: f64 = firsts.iter().map(|&t| p1[t as usize]).sum();
    cats.push((None, 1.0 - top));
    let n = 3000;
    let mut counts = vec![0f64; cats.len()];
    let (mut accepted, mut proposed) = (0, 0);
    for seed in 0..n {
        let mut s = base.fork().unwrap();
        let mut sampler = Sampler::new(SamplingSpec { seed: Some(seed), ..params.clone() });
        let mut spec = Speculator::without_cost_model(Box::new(Fixed(vec![d])));
        // max_new 3: after t1 one draft (for t2) fits.
        let g = s.generate_speculative_sampled(&opts(3), &mut spec, &mut sampler, &mut |_| true).unwrap();
        accepted += s.stats.drafts.accepted;
        proposed += s.stats.drafts.proposed;
        let (t1, t2) = (g.tokens[0], g.tokens[1]);
        let cat = cats
            .iter()
            .position(|(c, _)| *c == Some((t1, Some(t2))))
            .or_else(|| cats.iter().position(|(c, _)| *c == Some((t1, None))))
            .unwrap_or(cats.len() - 1);
        counts[cat] += 1.0;
    }
    assert!(proposed >= n, "every generation verified a draft ({proposed})");
    assert!(accepted > 0 && accepted < proposed, "drafts both accepted and rejected: {accepted} of {proposed}");
    let nf = n as f64;
    let used: Vec<(f64, f64)> =
        cats.iter().map(|c| c.1).zip(counts.iter().copied()).filter(|(p, _)| *p > 1e-12).collect();
    let chi2: f64 = used.iter().map(|(p, c)| (c - nf * p).powi(2) / (nf * p)).sum();
    let bound = chi2_999((used.len() - 1) as f64);
    eprintln!("chi2 {chi2:.1} (bound {bound:.1}), {accepted} of {proposed} drafts accepted, counts {counts:?}");
    assert!(
        chi2 < bound,
        "chi2 {chi2} >= {bound}: {counts:?} vs {:?}",
        cats.iter().map(|c| c.1 * nf).collect::<Vec<_>>()
    );
}

#[test]
fn cli_sampling_flags_are_reproducible_and_checked() {
    let dir = fixture("k3-tiny-b");
    let r = reference("k3-tiny-b");
    let run = |extra: &[&str]| {
        let mut c = deltafin_cmd();
        c.args(["run", "--model"]).arg(&dir).args([
            "--experts-from",
            "mmap",
            "--format",
            "json",
            "-q",
            "--max-new",
            "12",
        ]);
        c.args(["--prompt-ids", &ids_arg(&r.prompt[..8])]).args(extra);
        let (out, _) = run_ok(&mut c);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        (v["output_ids"].clone(), v["sampling"].clone())
    };
    let sampling = |extra: &[&str]| run(extra).1;
    let run = |extra: &[&str]| run(extra).0;
    let a = run(&["--temperature", "0.8", "--seed", "7"]);
    assert_eq!(a, run(&["--temperature", "0.8", "--seed", "7", "--threads", "1"]));
    assert_eq!(a, run(&["--temperature", "0.8", "--seed", "7", "--draft", "ngram"]));
    let k = run(&["--temperature", "0.8", "--seed", "7", "--top-k", "2", "--min-p", "0.1"]);
    assert_eq!(k, run(&["--temperature", "0.8", "--seed", "7", "--top-k", "2", "--min-p", "0.1", "--draft", "ngram"]));
    assert_eq!(run(&["--temperature", "0.8", "--top-k", "1"]), run(&[]), "top-k 1 is greedy");
    assert_eq!(run(&["--temperature", "0"]), run(&[]), "temperature 0 is greedy");
    let pen = ["--repeat-penalty", "1.3", "--frequency-penalty", "0.4", "--presence-penalty", "0.3"];
    let s = sampling(&pen);
    let got = (&s["repetition_penalty"], &s["frequency_penalty"], &s["presence_penalty"]);
    assert_eq!(got, (&1.3.into(), &0.4.into(), &0.3.into()), "{s}");
    let hot = ["--temperature", "0.9", "--seed", "3", "--repeat-penalty", "1.5", "--presence-penalty", "1"];
    let g = run(&hot);
    assert_eq!(g, run(&[&hot[..], &["--draft", "ngram"]].concat()), "drafts change no penalised token");
    let o = deltafin_cmd()
        .args(["run", "--model"])
        .arg(&dir)
        .args(["--prompt-ids", "1,2", "--frequency-penalty", "2.5"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("`2.5` is not a penalty"), "{o:?}");
    let o = deltafin_cmd()
        .args(["run", "--model"])
        .arg(&dir)
        .args(["--prompt-ids", "1,2", "--temperature", "3"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("`3` is not a temperature"));
    let o = deltafin_cmd()
        .args(["run", "--model"])
        .arg(&dir)
        .args(["--prompt-ids", "1,2", "--temperature", "1", "--min-p", "1.5"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("`1.5` is not a min-p"), "{o:?}");
}
