//! Sessions on disk (engine/state_file.rs): a session saved at any point — mid-prompt, mid-
//! generation, greedy or sampled, with drafts or without — and loaded back goes on bit for bit
//! as the session that never stopped; a file from another model, another format, truncated or
//! with any byte changed is refused with an error naming the file, and never loaded.

mod common;
use common::*;
use deltafin::draft::{NgramDrafter, Speculator};
use deltafin::engine::{Engine, GenerateOptions, SamplerPosition, Session, SessionNotes, StateFileError};
use deltafin::k3::KdaMode;
use deltafin::sample::{Sampler, SamplingSpec};
use std::path::Path;
use std::sync::Arc;

fn engine(name: &str) -> Arc<Engine> {
    Engine::open(test_config(&fixture(name), KdaMode::Recurrent)).unwrap()
}

fn params(sampled: bool) -> SamplingSpec {
    if sampled { SamplingSpec::new(0.9, 0.95, 7).unwrap() } else { SamplingSpec::greedy() }
}

/// `n` tokens from the session's logits, with or without drafts; the last one is not fed.
fn generate(s: &mut Session, sampler: &mut Sampler, n: usize, drafts: bool) -> Vec<u32> {
    let opts = GenerateOptions { max_new: n, stop: vec![] };
    let g = if drafts {
        let mut spec = Speculator::without_cost_model(Box::new(NgramDrafter::default()));
        s.generate_speculative_sampled(&opts, &mut spec, sampler, &mut |_| true).unwrap()
    } else {
        s.generate_sampled(&opts, sampler, &mut |_| true).unwrap()
    };
    g.tokens
}

#[test]
fn a_loaded_session_goes_on_as_one_that_never_stopped() {
    let e = engine("k3-tiny-a");
    let r = reference("k3-tiny-a");
    let prompt = &r.prompt[..48];
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("s.dfstate");
    for sampled in [false, true] {
        let mut s = e.new_session();
        s.prefill(prompt).unwrap();
        let whole = generate(&mut s, &mut Sampler::new(params(sampled)), 24, false);
        for drafts in [false, true] {
            for cut in [1, 9, 23] {
                let mut s = e.new_session();
                s.prefill(prompt).unwrap();
                let mut sampler = Sampler::new(params(sampled));
                let first = generate(&mut s, &mut sampler, cut, drafts);
                let last = *first.last().unwrap();
                let notes =
                    SessionNotes { sampler: Some(SamplerPosition::of(&sampler)), unfed: vec![last], meta: "x".into() };
                s.save_state(&file, &notes).unwrap();
                drop(s);
                let (mut s, notes) = e.load_session(&file).unwrap();
                assert_eq!(s.pos(), prompt.len() + cut - 1);
                assert_eq!(notes.meta, "x");
                for &t in &notes.unfed {
                    s.step(t).unwrap();
                }
                let mut sampler = notes.sampler.unwrap().sampler();
                let rest = generate(&mut s, &mut sampler, 24 - cut, drafts);
                let got: Vec<u32> = first.iter().chain(&rest).copied().collect();
                assert_eq!(got, whole, "sampled {sampled}, drafts {drafts}, cut after {cut} tokens");
            }
        }
    }
}

#[test]
fn a_prompt_cut_anywhere_resumes_to_the_same_logits() {
    let e = engine("k3-tiny-a");
    let r = reference("k3-tiny-a");
    let mut whole = e.new_session();
    whole.prefill(&r.prompt).unwrap();
    let want = bits(whole.logits().unwrap());
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("p.dfstate");
    for cut in [1, 17, r.prompt.len() - 1] {
        let mut s = e.new_session();
        s.prefill(&r.prompt[..cut]).unwrap();
        // Unverified rows are not part of the saved sequence.
        s.verify(&r.prompt[cut..cut + 1], &[]).unwrap();
        s.save_state(&file, &SessionNotes::default()).unwrap();
        let (mut s, _) = e.load_session(&file).unwrap();
        assert_eq!(s.tokens(), &r.prompt[..cut]);
        s.prefill(&r.prompt[cut..]).unwrap();
        assert_eq!(bits(s.logits().unwrap()), want, "cut at {cut}");
    }
    // An empty session saves and loads too.
    e.new_session().save_state(&file, &SessionNotes::default()).unwrap();
    assert_eq!(e.load_session(&file).unwrap().0.pos(), 0);
}

fn refused(e: &Arc<Engine>, file: &Path) -> String {
    match e.load_session(file) {
        Ok(_) => panic!("{} was loaded", file.display()),
        Err(err) => {
            let msg = err.to_string();
            assert!(msg.contains(&file.display().to_string()) || matches!(err, StateFileError::Backend(_)), "{msg}");
            msg
        }
    }
}

#[test]
fn foreign_old_truncated_or_damaged_files_are_refused() {
    let e = engine("k3-tiny-a");
    let r = reference("k3-tiny-a");
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("s.dfstate");
    let mut s = e.new_session();
    s.prefill(&r.prompt[..20]).unwrap();
    s.save_state(&file, &SessionNotes { unfed: vec![3], ..Default::default() }).unwrap();
    let good = std::fs::read(&file).unwrap();
    let bad = tmp.path().join("bad.dfstate");

    // Another model (same shapes, other weights) and another format.
    let other = engine("k3-tiny-b");
    let msg = refused(&other, &file);
    assert!(msg.contains("model") && msg.contains("fingerprint"), "{msg}");
    let mut v = good.clone();
    v[8..12].copy_from_slice(&2u32.to_le_bytes());
    std::fs::write(&bad, &v).unwrap();
    assert!(refused(&e, &bad).contains("format 2"));
    std::fs::write(&bad, b"{\"not\": \"a state\"}").unwrap();
    assert!(refused(&e, &bad).contains("not a deltafin state file"));

    // Truncated anywhere, or a byte appended.
    for cut in [0, 5, 14, 40, good.len() / 2, good.len() - 1] {
        std::fs::write(&bad, &good[..cut]).unwrap();
        refused(&e, &bad);
    }
    let mut v = good.clone();
    v.push(0);
    std::fs::write(&bad, &v).unwrap();
    assert!(refused(&e, &bad).contains("expected"));

    // One flipped bit anywhere: header, tokens, logits, states, trailer.
    let mut rng = Rng(44);
    let mut at: Vec<usize> = (0..48).map(|_| rng.below(good.len())).collect();
    at.extend([16, 40, good.len() - 8, good.len() - 1]);
    for i in at {
        let mut v = good.clone();
        v[i] ^= 1 << rng.below(8);
        std::fs::write(&bad, &v).unwrap();
        refused(&e, &bad);
    }
    // The good file still loads.
    assert_eq!(e.load_session(&file).unwrap().1.unfed, vec![3]);
}

#[test]
fn a_save_replaces_the_file_whole_and_leaves_no_temp() {
    let e = engine("k3-tiny-a");
    let r = reference("k3-tiny-a");
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("s.dfstate");
    let mut s = e.new_session();
    s.prefill(&r.prompt[..10]).unwrap();
    s.save_state(&file, &SessionNotes::default()).unwrap();
    s.prefill(&r.prompt[10..30]).unwrap();
    let size = s.save_state(&file, &SessionNotes::default()).unwrap();
    assert_eq!(std::fs::metadata(&file).unwrap().len(), size);
    assert_eq!(e.load_session(&file).unwrap().0.pos(), 30);
    let names: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().map(|d| d.unwrap().file_name()).collect();
    assert_eq!(names.len(), 1, "{names:?}");
    // A directory in the way is refused, not replaced.
    let dir = tmp.path().join("d");
    std::fs::create_dir(&dir).unwrap();
    assert!(s.save_state(&dir, &SessionNotes::default()).is_err());
}

/// `deltafin run` on the fixture with `args`; its output ids and stats.
fn run_ids(args: &[&str]) -> (Vec<u32>, serde_json::Value) {
    let o = deltafin_cmd()
        .args(["run", "--model"])
        .arg(fixture("k3-tiny-a"))
        .args(["--ignore-eos", "--format", "json", "-q"])
        .args(args)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    (v["output_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect(), v["stats"].clone())
}

#[test]
fn run_session_resumes_to_the_ids_of_an_uninterrupted_run() {
    let r = reference("k3-tiny-a");
    let prompt = ids_arg(&r.prompt[..40]);
    let more = ids_arg(&r.prompt[50..60]);
    let tmp = tempfile::tempdir().unwrap();
    for (i, flags) in [&["--temperature", "0"][..], &["--temperature", "0.8", "--seed", "5"], &["--draft", "ngram"]]
        .into_iter()
        .enumerate()
    {
        let file = tmp.path().join(format!("s{i}.dfstate"));
        let f = file.to_str().unwrap();
        let (whole, _) = run_ids(&[&["--prompt-ids", &prompt, "--max-new", "20"], flags].concat());
        let (a, _) = run_ids(&[&["--prompt-ids", &prompt, "--max-new", "8", "--session", f], flags].concat());
        // No prompt: generation goes on, with the saved sampler; only the unfed token is prefilled.
        let (b, stats) = run_ids(&["--max-new", "12", "--session", f]);
        assert_eq!([a, b.clone()].concat(), whole, "{flags:?}");
        assert_eq!(stats["prompt_tokens"], 1);
        // A new prompt appended: as one run of the whole sequence.
        let (c, stats) = run_ids(&["--prompt-ids", &more, "--max-new", "6", "--session", f, "--temperature", "0"]);
        let mut all: Vec<u32> = r.prompt[..40].to_vec();
        all.extend(&whole);
        all.extend(&r.prompt[50..60]);
        let (want, _) = run_ids(&["--prompt-ids", &ids_arg(&all), "--max-new", "6", "--temperature", "0"]);
        assert_eq!(c, want, "{flags:?}");
        assert_eq!(stats["prompt_tokens"], 11);
    }
    // Another model's session is refused, naming the file.
    let file = tmp.path().join("s0.dfstate");
    let o = deltafin_cmd()
        .args(["run", "--model"])
        .arg(fixture("k3-tiny-b"))
        .args(["--max-new", "2", "--session"])
        .arg(&file)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("s0.dfstate") && err.contains("fingerprint"), "{err}");
}

/// A session file written before the sampler had `top_k` and `min_p` (its header's sampler
/// `params` without them) loads with the two at their defaults (off) and goes on as the session
/// that never stopped: the sampler's spec is saved with serde defaults, the format unchanged.
#[test]
fn a_session_saved_before_top_k_and_min_p_existed_still_loads() {
    use xxhash_rust::xxh3::xxh3_64;
    let e = engine("k3-tiny-a");
    let r = reference("k3-tiny-a");
    let prompt = &r.prompt[..32];
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("old.dfstate");
    let mut s = e.new_session();
    s.prefill(prompt).unwrap();
    let want = generate(&mut s, &mut Sampler::new(params(true)), 16, false);
    let mut s = e.new_session();
    s.prefill(prompt).unwrap();
    let mut sampler = Sampler::new(params(true));
    let first = generate(&mut s, &mut sampler, 6, false);
    let notes = SessionNotes {
        sampler: Some(SamplerPosition::of(&sampler)),
        unfed: vec![*first.last().unwrap()],
        meta: "x".into(),
    };
    s.save_state(&file, &notes).unwrap();
    // The header as the older deltafin wrote it, its checksums made again.
    let b = std::fs::read(&file).unwrap();
    let hlen = u32::from_le_bytes(b[12..16].try_into().unwrap()) as usize;
    let mut head: serde_json::Value = serde_json::from_slice(&b[16..16 + hlen]).unwrap();
    let p = head["notes"]["sampler"]["params"].as_object_mut().unwrap();
    assert!(p.remove("top_k").is_some() && p.remove("min_p").is_some());
    let json = serde_json::to_vec(&head).unwrap();
    let mut old = b[..12].to_vec();
    old.extend_from_slice(&(json.len() as u32).to_le_bytes());
    old.extend_from_slice(&json);
    old.extend_from_slice(&xxh3_64(&json).to_le_bytes());
    old.extend_from_slice(&b[16 + hlen + 8..b.len() - 8]);
    let sum = xxh3_64(&old);
    old.extend_from_slice(&sum.to_le_bytes());
    std::fs::write(&file, old).unwrap();
    let (mut s, notes) = e.load_session(&file).unwrap();
    let saved = notes.sampler.unwrap();
    assert_eq!(saved.params, params(true), "top_k and min_p at their defaults");
    for &t in &notes.unfed {
        s.step(t).unwrap();
    }
    let rest = generate(&mut s, &mut saved.sampler(), 10, false);
    let got: Vec<u32> = first.iter().chain(&rest).copied().collect();
    assert_eq!(got, want);
}
