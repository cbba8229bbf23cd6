//! The DSpark drafter: its block logits match the fp64 reference (tests/reference/
//! dspark_reference.py) within 1e-4 with the same proposals, fed by the engine's own taps; with it
//! drafting the output is bit-identical to drafting off (1 and 2 threads, with and without the
//! cost model), and a drafter whose Markov head knows K3's bigrams really gets drafts accepted;
//! the CLI path (`synth --dspark`, `--draft dspark|auto --draft-model`) gives the same ids; bad
//! checkpoints are refused naming the file and what is wrong.

mod common;
use common::*;
use deltafin::draft::{DSparkDrafter, Drafter, Speculator};
use deltafin::engine::{Engine, EngineConfig, GenerateOptions};
use deltafin::k3::KdaMode;
use deltafin::k3::dspark::synth::{self as ds, DSparkSynthSpec};
use std::path::Path;
use std::sync::Arc;

const TARGET: &str = "k3-tiny-a";
const DRAFT: &str = "dspark-tiny-a";

fn config(target: &Path, draft: &Path) -> EngineConfig {
    EngineConfig { draft_model: Some(draft.to_path_buf()), ..test_config(target, KdaMode::Recurrent) }
}

fn draft_engine(target: &Path, draft: &Path) -> Arc<Engine> {
    Engine::open(config(target, draft)).unwrap()
}

/// A drafter whose context is the rows of `tokens`, taken from a prefill on `e`.
fn drafter_after(e: &Arc<Engine>, tokens: &[u32]) -> DSparkDrafter {
    let model = e.dspark_model().expect("a draft model");
    let mut d = DSparkDrafter::new(std::sync::Arc::clone(model));
    let taps = model.cfg.target_layers.clone();
    let mut s = e.new_session();
    // One forward whose rows the drafter sees, kept: what a prefill with drafts hands it.
    let rows = s.verify(tokens, &taps).unwrap();
    d.observe(0, &rows, tokens.len()).unwrap();
    s.commit(tokens.len()).unwrap();
    assert_eq!(d.context_rows(), tokens.len());
    d
}

#[test]
fn drafter_logits_and_proposals_match_the_fp64_reference() {
    let j: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture(DRAFT).join("reference.json")).unwrap()).unwrap();
    let prompt: Vec<u32> = j["prompt_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    let (want, shape) = read_f32_tensor(&fixture(DRAFT).join("reference.safetensors"), "logits");
    let vocab = shape[1];
    for threads in [1, 2] {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            let e = draft_engine(&fixture(TARGET), &fixture(DRAFT));
            let block = e.dspark_model().unwrap().cfg.block;
            for (ci, case) in j["cases"].as_array().unwrap().iter().enumerate() {
                let l = case["context_len"].as_u64().unwrap() as usize;
                let mut d = drafter_after(&e, &prompt[..l]);
                let drafts = d.draft(prompt[l], l).unwrap();
                let want_rows = &want[ci * block * vocab..(ci + 1) * block * vocab];
                let (err, row) = max_rel_l2(&d.last_logits, want_rows, vocab);
                assert!(err <= 1e-4, "case {ci} (context {l}), {threads} threads: row {row} relative error {err:.2e}");
                let want_drafts: Vec<u32> =
                    case["drafts"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
                assert_eq!(drafts, want_drafts, "case {ci}: proposals");
                // Through the Drafter trait: the first k of the block, for the pending token.
                let mut ctx = prompt[..=l].to_vec();
                assert_eq!(d.propose(&ctx, 3).unwrap(), want_drafts[..3].to_vec());
                ctx.push(1);
                assert!(d.propose(&ctx, 3).unwrap().is_empty(), "a context the drafter has not seen: no proposal");
                eprintln!("case {ci}: context {l}, {threads} threads, relative error {err:.2e}");
            }
        });
    }
}

fn plain(e: &Arc<Engine>, prompt: &[u32], max_new: usize) -> (Vec<u32>, Vec<u32>) {
    let mut s = e.new_session();
    s.prefill(prompt).unwrap();
    let g = s.generate(&GenerateOptions { max_new, stop: Vec::new() }, &mut |_| true).unwrap();
    (g.tokens, bits(s.logits().unwrap()))
}

fn with_dspark(e: &Arc<Engine>, prompt: &[u32], max_new: usize, cost: bool) -> (Vec<u32>, Vec<u32>, u64, u64) {
    let d = Box::new(DSparkDrafter::new(std::sync::Arc::clone(e.dspark_model().unwrap())));
    let mut spec = if cost { Speculator::union(d, 0) } else { Speculator::without_cost_model(d) };
    let mut s = e.new_session();
    s.prefill_with(prompt, &mut spec).unwrap();
    let g = s.generate_speculative(&GenerateOptions { max_new, stop: Vec::new() }, &mut spec, &mut |_| true).unwrap();
    assert_eq!(s.stats.drafts.drafter.as_deref(), Some("dspark"));
    (g.tokens, bits(s.logits().unwrap()), s.stats.drafts.proposed, s.stats.drafts.accepted)
}

#[test]
fn dspark_drafting_gives_plain_greedy_output_with_1_and_2_threads() {
    let r = reference(TARGET);
    let prompts = [r.prompt[..1].to_vec(), r.prompt[..9].to_vec(), r.prompt[30..75].to_vec()];
    for threads in [1, 2] {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            let e = draft_engine(&fixture(TARGET), &fixture(DRAFT));
            let mut proposed = 0;
            for (pi, p) in prompts.iter().enumerate() {
                for max_new in [1, 4, 25] {
                    let want = plain(&e, p, max_new);
                    for cost in [false, true] {
                        let (tokens, logits, prop, _) = with_dspark(&e, p, max_new, cost);
                        assert_eq!((tokens, logits), want.clone(), "prompt {pi}, max_new {max_new}, cost {cost}");
                        proposed += prop;
                    }
                }
            }
            assert!(proposed > 0, "drafts were proposed and verified");
        });
    }
}

/// A drafter for `target` whose Markov head predicts K3's own bigrams seen in `text`: markov_w1
/// rows are random +-1 codes and markov_w2[next] = 8 x code(prev) for each bigram (prev, next).
fn bigram_drafter(target: &Path, out: &Path, text: &[u32]) {
    let tc = deltafin::model::K3Config::load(target).unwrap();
    let spec = DSparkSynthSpec::for_target(&tc);
    ds::write(&spec, &tc, out, false, &|_, _| {}).unwrap();
    let rank = spec.markov_rank;
    let code =
        |t: usize, k: usize| if (t * 2_654_435_761 + k * 40_503).count_ones().is_multiple_of(2) { 1.0 } else { -1.0 };
    let mut next_of = std::collections::HashMap::new();
    for w in text.windows(2) {
        next_of.insert(w[1] as usize, w[0] as usize);
    }
    let st = out.join("model.safetensors");
    let n = edit_bf16_tensors(&st, &|n| n.starts_with("markov_head."), &mut |name, i, _| {
        let (row, k) = (i / rank, i % rank);
        if name.ends_with("markov_w1.weight") {
            code(row, k)
        } else {
            next_of.get(&row).map_or(0.0, |&prev| 8.0 * code(prev, k))
        }
    });
    assert_eq!(n, 2);
    // Made so on purpose (the bigrams are what is tested): recorded so.
    rerecord(out);
}

#[test]
fn a_drafter_that_knows_k3s_bigrams_gets_drafts_accepted_and_changes_nothing() {
    let target = repeating_copy(TARGET);
    let r = reference(TARGET);
    let e = engine(target.path());
    let prompt = &r.prompt[..12];
    let (truth, _) = plain(&e, prompt, 60);
    let tmp = tempfile::tempdir().unwrap();
    let draft = tmp.path().join("dspark");
    bigram_drafter(target.path(), &draft, &[prompt, &truth[..]].concat());
    let e = draft_engine(target.path(), &draft);
    for max_new in [5, 33, 60] {
        let want = plain(&e, prompt, max_new);
        let (tokens, logits, proposed, accepted) = with_dspark(&e, prompt, max_new, false);
        assert_eq!((tokens, logits), want, "max_new {max_new}");
        eprintln!("max_new {max_new}: {accepted} of {proposed} DSpark drafts accepted");
        if max_new == 60 {
            assert!(accepted > 0 && accepted * 2 > proposed, "{accepted} of {proposed} accepted");
        }
    }
}

#[test]
fn cli_dspark_and_auto_give_the_same_ids_as_drafting_off() {
    let r = reference(TARGET);
    let tmp = tempfile::tempdir().unwrap();
    let draft = tmp.path().join("dspark");
    let target = fixture(TARGET);
    let t = target.to_str().unwrap();
    let d = draft.to_str().unwrap();
    let (_, err) = run_ok(deltafin_cmd().args(["synth", "--dspark", "--target", t, "--out", d]));
    assert!(err.contains("DSpark drafter"), "{err}");
    // Again without --force: refused; with it: replaced.
    let again = deltafin_cmd().args(["synth", "--dspark", "--target", t, "--out", d]).output().unwrap();
    assert!(!again.status.success() && String::from_utf8_lossy(&again.stderr).contains("already exists"));
    run_ok(deltafin_cmd().args(["synth", "--dspark", "--target", t, "--out", d, "--force", "--seed", "9"]));
    let ids = ids_arg(&r.prompt[..20]);
    let run = |extra: &[&str]| {
        let mut c = deltafin_cmd();
        c.args(["run", "--model", t, "--prompt-ids", &ids, "--max-new", "24", "--format", "json"]);
        c.args(["--experts-from", "mmap", "--memory-gb", "4"]).args(extra);
        let (out, err) = run_ok(&mut c);
        let j: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        (j["output_ids"].clone(), j["stats"]["drafter"].clone(), err)
    };
    let (off, _, _) = run(&["--draft", "off"]);
    let (ds, who, err) = run(&["--draft", "dspark", "--draft-model", d]);
    assert_eq!(ds, off);
    assert_eq!(who, "dspark");
    assert!(err.contains("drafting: drafter dspark") && err.contains("weights"), "{err}");
    let (auto, who, err) = run(&["--draft", "auto", "--draft-model", d]);
    assert_eq!((auto, who), (off.clone(), serde_json::json!("auto")));
    assert!(err.contains("drafting: drafter auto of ngram, dspark") && err.contains("weights"), "{err}");
    let (auto, who, err) = run(&["--draft", "auto"]);
    assert_eq!((auto, who), (off, serde_json::json!("auto")));
    assert!(err.contains("drafting: drafter auto of ngram (") && err.contains("drafter memory: none"), "{err}");
    let no_model =
        deltafin_cmd().args(["run", "--model", t, "--prompt-ids", &ids, "--draft", "dspark"]).output().unwrap();
    assert!(!no_model.status.success());
    assert!(String::from_utf8_lossy(&no_model.stderr).contains("--draft-model"));
}

#[test]
fn a_dspark_drafter_the_policy_does_not_ask_runs_no_forward() {
    let e = draft_engine(&fixture(TARGET), &fixture(DRAFT));
    let r = reference(TARGET);
    let prompt = &r.prompt[..20];
    let (want, _) = plain(&e, prompt, 150);
    let spec = || Speculator::union(Box::new(DSparkDrafter::new(Arc::clone(e.dspark_model().unwrap()))), 0);
    let generate = |spec: &mut Speculator, max_new: usize| {
        let mut s = e.new_session();
        s.prefill_with(prompt, spec).unwrap();
        let g = s.generate_speculative(&GenerateOptions { max_new, stop: Vec::new() }, spec, &mut |_| true).unwrap();
        (g.tokens, s)
    };
    // 15 tokens: a drafter whose call was never timed is asked only by a probe, and a probe only
    // once its expected cost fits in 1% of the seconds run: width 0 throughout.
    let mut quiet = spec();
    let (tokens, s) = generate(&mut quiet, 15);
    assert_eq!(tokens, want[..15]);
    assert_eq!(s.stats.drafts.widths.iter().skip(1).sum::<u64>(), 0, "{:?}", s.stats.drafts.widths);
    assert_eq!((s.stats.drafts.drafter_forwards, s.stats.drafts.drafter_rows), (0, 0), "no drafter forward at width 0");
    // Every committed row waits as taps, to be folded when a draft is asked for.
    assert_eq!(quiet.drafters[0].backlog(), s.pos());
    // Longer: probes ask it, and each of its forwards is one of its drafts, after folding the rows
    // that waited.
    let mut asked = spec();
    let (tokens, s) = generate(&mut asked, 150);
    assert_eq!(tokens, want);
    let d = &s.stats.drafts;
    let verifies = d.by_drafter.get("dspark").map_or(0, |v| v[0]);
    assert!(d.drafter_forwards > 0 && d.drafter_forwards == verifies, "{d:?}");
    assert!(d.drafter_rows as usize + asked.drafters[0].backlog() == s.pos(), "{d:?}");
}

#[test]
fn auto_drafts_by_lookup_where_the_text_repeats_and_changes_nothing() {
    // A copy of the target whose greedy output falls into short cycles (embeddings x64).
    let target = repeating_copy(TARGET);
    let e = draft_engine(target.path(), &fixture(DRAFT));
    let r = reference(TARGET);
    let prompt = &r.prompt[..24];
    let (want, want_logits) = plain(&e, prompt, 90);
    let mut spec = e.speculator(deltafin::draft::DraftKind::Auto).unwrap().unwrap();
    assert_eq!(spec.drafters.iter().map(|d| d.name()).collect::<Vec<_>>(), ["ngram", "dspark"]);
    let mut s = e.new_session();
    s.prefill_with(prompt, &mut spec).unwrap();
    let g =
        s.generate_speculative(&GenerateOptions { max_new: 90, stop: Vec::new() }, &mut spec, &mut |_| true).unwrap();
    assert_eq!((g.tokens, bits(s.logits().unwrap())), (want, want_logits));
    let d = &s.stats.drafts;
    let by = |name: &str| d.by_drafter.get(name).copied().unwrap_or_default();
    let (ngram, dspark) = (by("ngram"), by("dspark"));
    eprintln!("auto on a repeating text: ngram {ngram:?}, dspark {dspark:?}, widths {:?}", d.widths);
    assert!(ngram[2] > 0 && ngram[0] > dspark[0], "n-gram drafts chosen on a loop: {d:?}");
    assert!(d.accepted * 2 > d.proposed, "{d:?}");
    // How wide it drafts after that is the cost model's (timed on this machine): not asserted.
}

#[test]
fn the_draft_model_counts_in_the_memory_plan() {
    let e = draft_engine(&fixture(TARGET), &fixture(DRAFT));
    let m = e.dspark_model().unwrap();
    assert_eq!(e.plan().draft, m.weight_bytes() + m.cache_bytes());
    assert!(e.plan().draft > 0 && e.startup_line().contains("draft model"));
    let plain = engine(&fixture(TARGET));
    assert_eq!(plain.plan().draft, 0);
    assert!(plain.plan().context_bound >= e.plan().context_bound);
    // Too small a budget names the draft model among the parts.
    let tiny = EngineConfig { memory_gb: Some(0.004), ..config(&fixture(TARGET), &fixture(DRAFT)) };
    let err = Engine::open(tiny).err().unwrap().to_string();
    assert!(err.contains("draft model"), "{err}");
}

/// A copy of the DSpark fixture (config and weights only).
fn draft_copy() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture(DRAFT).join(f), tmp.path().join(f)).unwrap();
    }
    tmp
}

fn open_err(draft: &Path) -> String {
    Engine::open(config(&fixture(TARGET), draft)).err().expect("refused").to_string()
}

#[test]
fn bad_draft_checkpoints_are_refused_naming_the_problem() {
    let edit_config = |f: &dyn Fn(&mut serde_json::Value)| {
        let tmp = draft_copy();
        let p = tmp.path().join("config.json");
        let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        f(&mut v);
        std::fs::write(&p, v.to_string()).unwrap();
        open_err(tmp.path())
    };
    let e = edit_config(&|v| v["hidden_size"] = 80.into());
    assert!(e.contains("config.json") && e.contains("hidden_size") && e.contains("64"), "{e}");
    let e = edit_config(&|v| v["target_layer_ids"] = serde_json::json!([0, 9]));
    assert!(e.contains("target_layer_ids") && e.contains("layer 9"), "{e}");
    let e = edit_config(&|v| v["model_type"] = "kimi_k3".into());
    assert!(e.contains("model_type") && e.contains("k3_dspark"), "{e}");
    let e = edit_config(&|v| v["mask_token_id"] = 600.into());
    assert!(e.contains("mask_token_id"), "{e}");
    let e = edit_config(&|v| {
        v.as_object_mut().unwrap().remove("markov_rank");
    });
    assert!(e.contains("markov_rank") && e.contains("missing"), "{e}");
    let e = edit_config(&|v| v["rope_scaling"]["factor"] = (-1.0).into());
    assert!(e.contains("rope_scaling.factor"), "{e}");
    // A config that says more heads than the tensors have: shapes are checked per tensor.
    let e = edit_config(&|v| v["num_attention_heads"] = 8.into());
    assert!(e.contains("q_b_proj") && e.contains("expected"), "{e}");
    // Malformed JSON, a truncated weights file, no directory.
    let tmp = draft_copy();
    std::fs::write(tmp.path().join("config.json"), "{\"model_type\": ").unwrap();
    let e = open_err(tmp.path());
    assert!(e.contains("config.json") && e.contains("malformed JSON"), "{e}");
    let tmp = draft_copy();
    let st = tmp.path().join("model.safetensors");
    let len = std::fs::metadata(&st).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&st).unwrap().set_len(len / 2).unwrap();
    let e = open_err(tmp.path());
    assert!(e.contains("model.safetensors"), "{e}");
    let e = open_err(&tmp.path().join("missing"));
    assert!(e.contains("missing"), "{e}");
}

#[test]
fn every_drafter_gives_the_same_bits_over_drive_layouts_and_cache_sizes() {
    use deltafin::store::ExpertSource;
    use deltafin::store::io::reader::ReaderKind;
    use deltafin::store::placement::{Policy, ShardUse};
    let target = repeating_copy(TARGET);
    let r = reference(TARGET);
    let prompt = &r.prompt[..10];
    let (truth, _) = plain(&engine(target.path()), prompt, 40);
    let tmp = tempfile::tempdir().unwrap();
    let draft = tmp.path().join("dspark");
    bigram_drafter(target.path(), &draft, &[prompt, &truth[..]].concat());
    let m = open_model(target.path());
    let expert = m.cfg.expert_bytes() as u64;
    let drives = drive_dirs(tmp.path(), 3);
    let spread = place_model(&m, &drives, |i| 1.0 + i as f64, Policy::Spread, ShardUse::Off, None);
    let sources: Vec<(&str, Arc<dyn ExpertSource>)> = vec![
        ("mmap", Arc::new(m.mmap_source())),
        ("shards, no cache", shard_store(&m, 0, 2, 0)),
        ("shards, 3-expert cache", shard_store(&m, 3 * expert, 1, 0)),
        ("3 drives spread, 5-expert cache", manifest_store(&m, &spread, 5 * expert, ReaderKind::Pread, 1)),
    ];
    let mut want = None;
    for (what, src) in sources {
        let e = Engine::open_with_source(config(target.path(), &draft), src).unwrap();
        let off = plain(&e, prompt, 40);
        let want = want.get_or_insert_with(|| off.clone());
        assert_eq!(&off, want, "{what}: drafting off");
        for kind in
            [deltafin::draft::DraftKind::Ngram, deltafin::draft::DraftKind::Dspark, deltafin::draft::DraftKind::Auto]
        {
            let mut spec = Speculator::without_cost_model(e.drafter(kind).unwrap().unwrap());
            let mut s = e.new_session();
            s.prefill_with(prompt, &mut spec).unwrap();
            let g = s
                .generate_speculative(&GenerateOptions { max_new: 40, stop: Vec::new() }, &mut spec, &mut |_| true)
                .unwrap();
            assert_eq!((g.tokens, bits(s.logits().unwrap())), want.clone(), "{what}: {kind:?}");
            assert!(s.stats.drafts.accepted > 0, "{what}: {kind:?} drafts accepted");
        }
    }
}
