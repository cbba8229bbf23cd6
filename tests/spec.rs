//! Speculative decoding changes speed, never output: n-gram (and scripted) drafts verified in
//! batches give the tokens, callbacks, stop reasons and final session state of plain greedy decode
//! on every fixture, with 1 and 2 threads; on copies of the fixtures made to repeat (embeddings
//! x64) n-gram drafts are really accepted, at every position up to width 7; scripted drafts (the true continuation with corrupted
//! positions) are accepted fully, partly and not at all, with stops, `max_new` and cancels landing
//! inside an accepted run; perfect drafts hand over fewer expert bytes per token; the CLI's
//! `--draft` gives the same ids.

mod common;
use common::*;
use deltafin::backend::BackendError;
use deltafin::draft::{Drafter, NgramDrafter, Speculator};
use deltafin::engine::{Engine, GenerateOptions, Generation, Session};
use deltafin::forward::RowsOut;
use std::sync::Arc;

/// What a generation left behind, to compare bit for bit.
#[derive(Debug, PartialEq)]
struct Outcome {
    tokens: Vec<u32>,
    reason: String,
    callbacks: Vec<u32>,
    committed: Vec<u32>,
    logits: Vec<u32>,
}

fn outcome(s: &Session, g: Generation, callbacks: Vec<u32>) -> Outcome {
    Outcome {
        tokens: g.tokens,
        reason: format!("{:?}", g.reason),
        callbacks,
        committed: s.tokens().to_vec(),
        logits: bits(s.logits().unwrap()),
    }
}

/// Plain greedy from `prompt`, cancelling after `cancel_after` tokens when given.
fn plain(e: &Arc<Engine>, prompt: &[u32], opts: &GenerateOptions, cancel_after: Option<usize>) -> Outcome {
    let mut s = e.new_session();
    s.prefill(prompt).unwrap();
    let mut seen = Vec::new();
    let g = s
        .generate(opts, &mut |t| {
            seen.push(t);
            cancel_after.is_none_or(|n| seen.len() < n)
        })
        .unwrap();
    outcome(&s, g, seen)
}

/// Speculative greedy from `prompt`; returns the outcome and the session's stats.
fn speculative(
    e: &Arc<Engine>,
    prompt: &[u32],
    opts: &GenerateOptions,
    spec: &mut Speculator,
    cancel_after: Option<usize>,
) -> (Outcome, deltafin::stats::Stats) {
    let mut s = e.new_session();
    s.prefill(prompt).unwrap();
    let mut seen = Vec::new();
    let g = s
        .generate_speculative(opts, spec, &mut |t| {
            seen.push(t);
            cancel_after.is_none_or(|n| seen.len() < n)
        })
        .unwrap();
    let stats = s.stats.clone();
    (outcome(&s, g, seen), stats)
}

fn opts(max_new: usize, stop: Vec<u32>) -> GenerateOptions {
    GenerateOptions { max_new, stop }
}

/// Prompts of several lengths and kinds from a fixture's reference prompt.
fn prompts(r: &Reference) -> Vec<Vec<u32>> {
    let p = &r.prompt;
    let mut repetitive = p[..6].to_vec();
    for _ in 0..4 {
        repetitive.extend_from_slice(&p[..6]);
    }
    vec![p[..1].to_vec(), p[..4].to_vec(), p[10..27].to_vec(), p[..60].to_vec(), repetitive]
}

#[test]
fn ngram_drafts_give_plain_greedy_output_with_1_and_2_threads() {
    for name in FIXTURES {
        let r = reference(name);
        let dir = fixture(name);
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let (accepted, proposed) = pool.install(|| {
                let e = engine(&dir);
                let (mut accepted, mut proposed) = (0, 0);
                for (pi, prompt) in prompts(&r).iter().enumerate() {
                    for max_new in [1, 2, 3, 8, 30] {
                        let o = opts(max_new, Vec::new());
                        let want = plain(&e, prompt, &o, None);
                        let mut spec = Speculator::without_cost_model(Box::new(NgramDrafter::default()));
                        let (got, st) = speculative(&e, prompt, &o, &mut spec, None);
                        assert_eq!(got, want, "{name}, {threads} threads, prompt {pi}, max_new {max_new}");
                        assert!(got.tokens.len() <= max_new);
                        accepted += st.drafts.accepted;
                        proposed += st.drafts.proposed;
                        assert_eq!(st.drafts.proposed_at.first().copied().unwrap_or(0), st.drafts.verify_calls);
                    }
                }
                (accepted, proposed)
            });
            // These fixtures do not fall into greedy cycles (measured: 0 of ~12 n-gram drafts
            // accepted over 400 tokens), so n-gram drafts are proposed and verified here but rarely
            // accepted; acceptance at every position is covered by the scripted drafter below.
            assert!(proposed > 0, "{name}, {threads} threads: no draft proposed");
            eprintln!("{name}, {threads} threads: {accepted} of {proposed} n-gram drafts accepted");
        }
    }
}

#[test]
fn ngram_drafts_are_accepted_on_models_that_repeat_and_change_nothing() {
    for name in FIXTURES {
        let r = reference(name);
        let dir = repeating_copy(name);
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let (accepted, proposed, deepest) = pool.install(|| {
                let e = engine(dir.path());
                let (mut accepted, mut proposed, mut deepest) = (0, 0, 0);
                for (pi, prompt) in prompts(&r).iter().enumerate() {
                    for max_new in [6, 41, 90] {
                        let o = opts(max_new, Vec::new());
                        let want = plain(&e, prompt, &o, None);
                        // No cost model, the published policy under it, the union-aware policy.
                        for policy in 0..3 {
                            let d = Box::new(NgramDrafter::default());
                            let cost_model = policy > 0;
                            let mut spec = match policy {
                                0 => Speculator::without_cost_model(d),
                                1 => Speculator::published(d),
                                _ => Speculator::union(d, 0),
                            };
                            let (got, st) = speculative(&e, prompt, &o, &mut spec, None);
                            let what =
                                format!("{name}, {threads} threads, prompt {pi}, max_new {max_new}, policy {policy}");
                            assert_eq!(got, want, "{what}");
                            if !cost_model {
                                accepted += st.drafts.accepted;
                                proposed += st.drafts.proposed;
                                deepest = deepest.max(st.drafts.accepted_at.iter().filter(|&&a| a > 0).count());
                            }
                        }
                    }
                }
                (accepted, proposed, deepest)
            });
            eprintln!("{name} (repeating), {threads} threads: {accepted} of {proposed} n-gram drafts accepted");
            assert!(accepted > 0 && accepted * 2 > proposed, "{name}: {accepted} of {proposed} accepted");
            assert_eq!(deepest, 7, "{name}: drafts accepted at every position up to the max width");
        }
    }
}

#[test]
fn with_the_live_cost_model_the_output_is_the_same() {
    for name in FIXTURES {
        let r = reference(name);
        let e = engine(&fixture(name));
        for prompt in prompts(&r).iter().skip(2) {
            let o = opts(40, Vec::new());
            let want = plain(&e, prompt, &o, None);
            for union in [false, true] {
                let d = Box::new(NgramDrafter::default());
                let mut spec = if union { Speculator::union(d, 0) } else { Speculator::published(d) };
                let (got, _) = speculative(&e, prompt, &o, &mut spec, None);
                assert_eq!(got, want, "{name}, union-aware policy {union}");
            }
        }
    }
}

/// Proposes the known greedy continuation, corrupting some drafts on a fixed schedule, so that
/// full, partial and zero acceptance at every position all occur. Optionally asks for taps.
struct Scripted {
    truth: Vec<u32>,
    rng: Rng,
    wrong_one_in: u64,
    taps: Vec<usize>,
    observed: usize,
    vocab: u32,
}

impl Drafter for Scripted {
    fn name(&self) -> &str {
        "scripted"
    }
    fn propose(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, BackendError> {
        let from = context.len().min(self.truth.len());
        let mut d: Vec<u32> = self.truth[from..(from + k).min(self.truth.len())].to_vec();
        for t in d.iter_mut() {
            if self.wrong_one_in > 0 && self.rng.next_u64().is_multiple_of(self.wrong_one_in) {
                *t = (*t + 1) % self.vocab;
            }
        }
        Ok(d)
    }
    fn taps(&self) -> &[usize] {
        &self.taps
    }
    fn observe(&mut self, _start: usize, rows: &RowsOut, committed: usize) -> Result<(), BackendError> {
        assert!(committed >= 1);
        assert_eq!(rows.taps.len(), self.taps.len(), "asked taps arrive");
        self.observed += committed;
        Ok(())
    }
}

#[test]
fn partial_acceptance_stops_and_cancels_end_as_in_plain_greedy() {
    for name in FIXTURES {
        let r = reference(name);
        let e = engine(&fixture(name));
        let vocab = e.k3_config().vocab as u32;
        let prompt = &r.prompt[..20];
        let full = plain(&e, prompt, &opts(40, Vec::new()), None).tokens;
        let truth: Vec<u32> = prompt.iter().chain(&full).copied().collect();
        let scripted = |seed: u64, wrong_one_in: u64, taps: Vec<usize>| {
            Speculator::without_cost_model(Box::new(Scripted {
                truth: truth.clone(),
                rng: Rng(seed),
                wrong_one_in,
                taps,
                observed: 0,
                vocab,
            }))
        };
        // Stop tokens taken from the output (a first occurrence late and early), and none.
        let stops = [vec![full[17]], vec![full[3]], vec![full[0]], Vec::new()];
        let (mut accepted, mut rejected) = (0, 0);
        for (si, stop) in stops.iter().enumerate() {
            for max_new in [1, 2, 5, 9, 40] {
                for cancel in [None, Some(1), Some(4), Some(11)] {
                    let o = opts(max_new, stop.clone());
                    let want = plain(&e, prompt, &o, cancel);
                    for (seed, wrong) in [(1, 0), (2, 3), (3, 7)] {
                        let mut spec = scripted(seed, wrong, Vec::new());
                        let (got, st) = speculative(&e, prompt, &o, &mut spec, cancel);
                        let what = format!("{name}: stop {si}, max_new {max_new}, cancel {cancel:?}, wrong 1/{wrong}");
                        assert_eq!(got, want, "{what}");
                        if wrong == 0 {
                            assert_eq!(st.drafts.accepted, st.drafts.proposed, "{what}: perfect drafts all accepted");
                        }
                        accepted += st.drafts.accepted;
                        rejected += st.drafts.proposed - st.drafts.accepted;
                    }
                }
            }
        }
        assert!(accepted > 0 && rejected > 0, "{name}: {accepted} accepted, {rejected} rejected");
        // A drafter that taps hidden rows: the asked taps arrive with every feed (see observe).
        let o = opts(30, Vec::new());
        let want = plain(&e, prompt, &o, None);
        let mut spec = scripted(4, 4, vec![0, 1]);
        let (got, _) = speculative(&e, prompt, &o, &mut spec, None);
        assert_eq!(got, want, "{name}: with taps");
    }
}

#[test]
fn perfect_drafts_hand_over_fewer_expert_bytes_per_token() {
    let name = "k3-tiny-a";
    let r = reference(name);
    let e = engine(&fixture(name));
    let prompt = &r.prompt[..30];
    let n = 36;
    let mut s = e.new_session();
    s.prefill(prompt).unwrap();
    let g = s.generate(&opts(n, Vec::new()), &mut |_| true).unwrap();
    let plain_bytes = s.stats.decode_expert_bytes_per_token().unwrap();
    let truth: Vec<u32> = prompt.iter().chain(&g.tokens).copied().collect();
    let mut spec = Speculator::without_cost_model(Box::new(Scripted {
        truth,
        rng: Rng(0),
        wrong_one_in: 0,
        taps: Vec::new(),
        observed: 0,
        vocab: e.k3_config().vocab as u32,
    }));
    let (got, st) = speculative(&e, prompt, &opts(n, Vec::new()), &mut spec, None);
    assert_eq!(got.tokens, g.tokens);
    assert_eq!(st.drafts.accepted, st.drafts.proposed);
    // Widened to 7 after the probe: positions 1..=7 were all proposed and accepted.
    assert_eq!(st.drafts.accepted_at.len(), 7);
    assert_eq!(st.drafts.accepted_at, st.drafts.proposed_at);
    let spec_bytes = st.decode_expert_bytes_per_token().unwrap();
    assert!(spec_bytes < plain_bytes, "{spec_bytes} bytes per token with drafts, {plain_bytes} without");
    let j = st.to_json();
    assert_eq!(j["drafter"], "scripted");
    assert_eq!(j["draft_acceptance"], 1.0);
    assert_eq!(j["draft_acceptance_by_position"].as_array().unwrap().len(), 7);
    assert_eq!(j["draft_acceptance_by_position"][0]["rate"], 1.0);
}

#[test]
fn cli_draft_ngram_prints_the_same_ids_and_dspark_without_a_model_is_refused() {
    let r = reference("k3-tiny-c");
    let ids = ids_arg(&r.prompt[..24]);
    let run = |draft: &str| {
        let o = deltafin_cmd()
            .args(["run", "--model"])
            .arg(fixture("k3-tiny-c"))
            .args(["--prompt-ids", &ids, "--max-new", "40", "--ignore-eos", "--format", "json", "--draft", draft])
            .output()
            .unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let (c0, off, _) = run("off");
    assert_eq!(c0, Some(0));
    let off: serde_json::Value = serde_json::from_str(&off).unwrap();
    for draft in ["ngram", "auto"] {
        let (c, out, err) = run(draft);
        assert_eq!(c, Some(0), "{err}");
        // `auto` without a draft model chooses between single steps and n-gram drafts.
        let who = if draft == "auto" { "auto of ngram" } else { "ngram" };
        assert!(err.contains(&format!("drafting: drafter {who} (")), "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["output_ids"], off["output_ids"], "--draft {draft}");
        assert_eq!(v["stats"]["drafter"], draft);
        assert!(v["stats"]["drafts_proposed"].as_u64().is_some());
    }
    let (c, _, err) = run("dspark");
    assert_eq!(c, Some(1));
    assert!(err.contains("--draft dspark needs --draft-model DIR"), "{err}");
}

#[test]
fn bench_run_records_the_same_ids_with_every_drafter_and_the_oracle_accepts_all() {
    let run = |draft: &str| {
        let (out, _) = run_ok(deltafin_cmd().args(["bench", "run", "--model"]).arg(fixture("k3-tiny-b")).args([
            "--prompt-tokens",
            "24",
            "--decode",
            "30",
            "--ceiling-seconds",
            "0",
            "--draft",
            draft,
        ]));
        serde_json::from_str::<serde_json::Value>(out.lines().next().unwrap()).unwrap()
    };
    let off = run("off");
    assert_eq!(off["decode"]["draft"], "off");
    for draft in ["ngram", "oracle"] {
        let v = run(draft);
        assert_eq!(v["output_ids"], off["output_ids"], "--draft {draft}");
        assert_eq!(v["decode"]["draft"], draft);
    }
    let v = run("oracle");
    let accepted = v["decode"]["drafts_accepted"].as_u64().unwrap();
    assert!(accepted > 0);
    assert_eq!(v["decode"]["drafts_proposed"].as_u64(), Some(accepted));
    assert_eq!(v["decode"]["draft_acceptance"], 1.0);
}

/// `bench run --prompt-ids @FILE` runs on exactly those ids, and its decoded tokens pass the fp64
/// reference's teacher-forced greedy check (tests/reference/check_greedy.py, the path the peer
/// benchmark checks its big model with); a changed token fails that check.
#[test]
fn bench_run_on_given_ids_matches_the_fp64_greedy_check() {
    let tmp = tempfile::tempdir().unwrap();
    let ids: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 200).collect();
    let ids_file = tmp.path().join("ids.json");
    std::fs::write(&ids_file, serde_json::to_string(&ids).unwrap()).unwrap();
    let model = fixture("k3-tiny-a");
    let (out, _) = run_ok(
        deltafin_cmd()
            .args(["bench", "run", "--model"])
            .arg(&model)
            .arg(format!("--prompt-ids=@{}", ids_file.display()))
            .args(["--decode", "6", "--ceiling-seconds", "0", "--expert-heat", "off"]),
    );
    let rec: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert_eq!(rec["prompt_tokens"], 40);
    let generated: Vec<u64> = rec["output_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    let check = |tokens: &[u64]| {
        let gen_file = tmp.path().join("gen.json");
        std::fs::write(&gen_file, serde_json::to_string(tokens).unwrap()).unwrap();
        python()
            .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/check_greedy.py"))
            .arg(&model)
            .arg("--prompt-ids")
            .arg(&ids_file)
            .arg("--generated")
            .arg(&gen_file)
            .output()
            .unwrap()
    };
    let ok = check(&generated);
    let verdict: serde_json::Value = serde_json::from_slice(&ok.stdout).unwrap();
    assert!(ok.status.success() && verdict["identical"] == true, "{verdict}");
    let mut wrong = generated.clone();
    wrong[3] = (wrong[3] + 1) % 200;
    assert_eq!(check(&wrong).status.code(), Some(1), "a changed token must fail the check");
    // Inline ids give the same run; ids outside the vocabulary are refused.
    let inline = ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",");
    let (out2, _) = run_ok(deltafin_cmd().args(["bench", "run", "--model"]).arg(&model).args([
        "--prompt-ids",
        &inline,
        "--decode",
        "6",
        "--ceiling-seconds",
        "0",
        "--expert-heat",
        "off",
    ]));
    let rec2: serde_json::Value = serde_json::from_str(out2.lines().next().unwrap()).unwrap();
    assert_eq!(rec2["output_ids"], rec["output_ids"]);
    let o = deltafin_cmd()
        .args(["bench", "run", "--model"])
        .arg(&model)
        .args(["--prompt-ids", "1,2,999999", "--ceiling-seconds", "0"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("outside the vocabulary"));
}
