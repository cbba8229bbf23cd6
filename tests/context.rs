//! The context reserved per sequence (`EngineConfig::context`, `--context`): refused clearly at 0
//! or past the model's maximum; no sequence grows past it (the forward refuses, the CLI names the
//! setting before any work); the memory plan reserves it for each sequence run together and gives
//! what a small one frees to the expert cache; the tokens are the same whatever it is.

mod common;
use common::*;
use deltafin::engine::{Engine, EngineConfig, EngineError, ExpertsFrom, ForwardError};
use deltafin::k3::KdaMode;
use deltafin::setting::Setting;

fn config(context: Option<usize>) -> EngineConfig {
    EngineConfig { context, ..test_config(&fixture("k3-tiny-a"), KdaMode::Recurrent) }
}

#[test]
fn a_context_of_zero_or_past_the_models_maximum_is_refused() {
    let max = open_model(&fixture("k3-tiny-a")).cfg.max_context;
    for bad in [0, max + 1] {
        match Engine::open(config(Some(bad))) {
            Err(EngineError::Setting { setting: Setting::Context, value, problem }) => {
                assert_eq!(value, bad.to_string());
                assert!(!problem.is_empty());
            }
            Err(e) => panic!("context {bad}: {e}"),
            Ok(_) => panic!("context {bad} was accepted"),
        }
    }
    assert_eq!(Engine::open(config(Some(max))).unwrap().context_bound(), max);
    // The default: the model's maximum (64 here), up to 32768.
    assert_eq!(Engine::open(config(None)).unwrap().context_bound(), max.min(32_768));
}

#[test]
fn a_sequence_never_grows_past_its_context_and_its_tokens_do_not_depend_on_it() {
    let r = reference("k3-tiny-a");
    let prompt = &r.prompt[..6];
    let e = Engine::open(config(Some(10))).unwrap();
    assert_eq!(e.context_bound(), 10);
    let mut s = e.new_session();
    match s.prefill(&r.prompt[..11]) {
        Err(ForwardError::ContextFull { have: 0, new: 11, max: 10 }) => {}
        other => panic!("an 11-token prompt in a context of 10: {:?}", other.map(<[f32]>::len)),
    }
    assert_eq!(s.pos(), 0, "a refused forward leaves the session as it was");
    s.prefill(prompt).unwrap();
    for &t in &r.prompt[6..10] {
        s.step(t).unwrap();
    }
    assert!(matches!(s.step(1), Err(ForwardError::ContextFull { have: 10, new: 1, max: 10 })));
    // Up to its context a sequence gets what it gets in the model's whole context.
    let small = greedy(&Engine::open(config(Some(10))).unwrap(), prompt, 4);
    assert_eq!(small, greedy(&Engine::open(config(None)).unwrap(), prompt, 4));
}

#[test]
fn the_cache_gets_what_a_small_context_frees_for_the_sequences_run_together() {
    // Experts through the store (a cache to size); a budget that the default context of 8
    // sequences leaves only part of the experts' cache.
    let open = |context: Option<usize>| {
        Engine::open(EngineConfig {
            experts_from: ExpertsFrom::Store,
            memory_gb: Some(0.0119),
            sequences: 8,
            prefill_rows: 8,
            ..config(context)
        })
        .unwrap()
    };
    let (wide, narrow) = (open(None), open(Some(8)));
    assert!(wide.plan().expert_cache > 0, "the default context leaves some cache: {}", wide.plan().summary());
    assert!(
        narrow.plan().expert_cache > wide.plan().expert_cache,
        "context 8 frees memory for the cache: {} vs {}",
        narrow.plan().summary(),
        wide.plan().summary()
    );
    // 8 sequences of their full context still fit beside the bigger cache.
    narrow.sequences_fit(&[8; 8]).unwrap();
    wide.sequences_fit(&[wide.context_bound(); 8]).unwrap();
    assert_eq!((narrow.plan().context, narrow.plan().sequences), (8, 8));
    assert!(narrow.startup_line().contains("context <= 8 tokens x 8 sequences"), "{}", narrow.startup_line());
    // Several sequences read the next layer's experts ahead into read slots of their own (the
    // plan counts them), not into the cache's.
    let one =
        Engine::open(EngineConfig { experts_from: ExpertsFrom::Store, prefill_rows: 8, ..config(Some(8)) }).unwrap();
    let m = open_model(&fixture("k3-tiny-a"));
    let spec = deltafin::store::placement::shard_spec(&m.ck, &m.roster, &m.dir, 4, 1.0).unwrap();
    let slot = deltafin::store::expert_store::slot_size_for(&spec) as u64;
    let ahead = deltafin::forward::moe::read_ahead_depth(4, 8) as u64;
    assert_eq!(
        narrow.plan().staging - one.plan().staging,
        ahead * slot,
        "{} vs {}",
        narrow.plan().summary(),
        one.plan().summary()
    );
}

#[test]
fn run_names_the_context_when_a_prompt_and_its_new_tokens_do_not_fit() {
    let o = deltafin_cmd()
        .args(["run", "--model"])
        .arg(fixture("k3-tiny-a"))
        .args(["--prompt-ids", "1,2,3", "--max-new", "2", "--context", "4"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("exceeds the usable context of 4 tokens") && err.contains("--context"), "{err}");
    assert!(!err.contains("context <="), "refused before the startup line:\n{err}");
    let o = deltafin_cmd()
        .args(["run", "--model"])
        .arg(fixture("k3-tiny-a"))
        .args(["--prompt-ids", "1,2,3", "--max-new", "2", "--context", "0"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--context 0"), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn run_reserves_the_context_its_prompts_need_unless_told() {
    let run = |extra: &[&str]| {
        let o = deltafin_cmd()
            .args(["run", "--demo", "--temperature", "0", "--max-new", "6", "--format", "json", "--prompt", "Hello"])
            .args(extra)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{err}");
        // One JSON line a prompt (and a summary line with several): the first is "Hello"'s.
        let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
        let out: serde_json::Value = serde_json::from_str(stdout.lines().next().unwrap_or_default()).unwrap();
        (err, out["output_ids"].clone())
    };
    // The prompt and its new tokens in whole 64s; with several prompts, the longest.
    let (sized, ids) = run(&[]);
    assert!(sized.contains("context <= 64 tokens |"), "{sized}");
    let (many, many_ids) = run(&["--prompt", &"the sea ".repeat(40)]);
    assert!(many.contains("context <= 128 tokens x 2 sequences"), "{many}");
    assert_eq!(ids, many_ids);
    // --context stands, and the tokens are the same.
    let (told, told_ids) = run(&["--context", "4096"]);
    assert!(told.contains("context <= 4096 tokens |"), "{told}");
    assert_eq!(ids, told_ids);
}
