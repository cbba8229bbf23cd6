//! Conversation reuse in the generator, at the library level: a prompt that extends the previous
//! prompt, or the previous prompt plus its answer, resumes from the kept session and gives exactly
//! what a fresh session gives (tokens and log-probabilities, bit for bit), with the reuse counted;
//! the memo answers a repeated greedy request without compute.

mod common;
use common::*;
use deltafin::api::{GenRequest, Kind, Output, Prompt};
use deltafin::sample::SamplingSpec;
use deltafin::service::generator::{GenConfig, Generator};

fn request(ids: Vec<u32>, max_tokens: usize) -> GenRequest {
    GenRequest {
        kind: Kind::Completion,
        prompt: Prompt::Ids(ids),
        max_tokens: Some(max_tokens),
        default_max_tokens: None,
        stop: Vec::new(),
        sampling: SamplingSpec::GREEDY,
        n: 1,
        logprobs: Some(2),
        echo: false,
        stream: false,
        include_usage: false,
        thinking: None,
        tools: None,
        tool_choice: Default::default(),
        parallel_tool_calls: true,
        response_format: Default::default(),
    }
}

fn run(g: &mut Generator, r: &GenRequest) -> Output {
    g.generate(r, 0.0, &mut |_| true).unwrap()
}

#[test]
fn resumed_prompts_give_fresh_output_and_count_the_reuse() {
    let r = reference("k3-tiny-c");
    let e = engine(&fixture("k3-tiny-c"));
    let mut kept = Generator::new(e.clone(), GenConfig::default()).unwrap();
    let mut fresh = Generator::new(e, GenConfig { reuse: false, memo_entries: 0, ..GenConfig::default() }).unwrap();
    let p = r.prompt[..12].to_vec();
    let first = run(&mut kept, &request(p.clone(), 6));
    assert_eq!(first.ext["prompt_tokens_reused"], 0);
    // The prompt plus the whole answer plus more: resumes after the answer's fed tokens.
    let mut next = p.clone();
    next.extend_from_slice(&first.tokens);
    next.extend_from_slice(&r.prompt[20..25]);
    let a = run(&mut kept, &request(next.clone(), 8));
    let b = run(&mut fresh, &request(next.clone(), 8));
    assert_eq!(a.ext["prompt_tokens_reused"], p.len() + first.tokens.len() - 1);
    assert_eq!(a.tokens, b.tokens);
    assert_eq!(a.logprobs, b.logprobs, "log-probabilities bit for bit");
    // A prompt that extends only the previous prompt resumes from the snapshot after it.
    let mut branch = next.clone();
    branch.extend_from_slice(&r.prompt[30..33]);
    let a = run(&mut kept, &request(branch.clone(), 5));
    let b = run(&mut fresh, &request(branch, 5));
    assert_eq!(a.ext["prompt_tokens_reused"], next.len());
    assert_eq!((a.tokens, a.logprobs), (b.tokens, b.logprobs));
    // Unrelated prompt: nothing reused, still the same output.
    let other = r.prompt[40..50].to_vec();
    let a = run(&mut kept, &request(other.clone(), 4));
    assert_eq!(a.ext["prompt_tokens_reused"], 0);
    assert_eq!(a.tokens, run(&mut fresh, &request(other.clone(), 4)).tokens);
    // The memo: greedy without logprobs, repeated.
    let mut plain = request(other, 4);
    plain.logprobs = None;
    let m1 = run(&mut kept, &plain);
    let m2 = run(&mut kept, &plain);
    assert_eq!((m1.ext["memo_hit"].as_bool(), m2.ext["memo_hit"].as_bool()), (Some(false), Some(true)));
    assert_eq!(m1.tokens, m2.tokens);
    assert_eq!(kept.totals.memo_hits, 1);
    assert!(kept.totals.prompt_tokens_reused > 0);
    assert_eq!(fresh.totals.prompt_tokens_reused, 0);
}

#[test]
fn a_state_dir_keeps_conversations_across_a_restart_within_its_cap() {
    let r = reference("k3-tiny-c");
    let e = engine(&fixture("k3-tiny-c"));
    let tmp = tempfile::tempdir().unwrap();
    let disk = |cap: u64| GenConfig {
        memo_entries: 0,
        state_dir: Some((tmp.path().to_path_buf(), cap)),
        ..GenConfig::default()
    };
    let mut fresh =
        Generator::new(e.clone(), GenConfig { reuse: false, memo_entries: 0, ..GenConfig::default() }).unwrap();
    let p = r.prompt[..12].to_vec();
    let first = {
        let mut g = Generator::new(e.clone(), disk(1 << 30)).unwrap();
        run(&mut g, &request(p.clone(), 6))
    };
    // A restart: a new generator on the same directory resumes the conversation from disk.
    let mut g = Generator::new(e.clone(), disk(1 << 30)).unwrap();
    let mut next = p.clone();
    next.extend_from_slice(&first.tokens);
    next.extend_from_slice(&r.prompt[20..25]);
    let a = run(&mut g, &request(next.clone(), 8));
    let b = run(&mut fresh, &request(next, 8));
    assert_eq!(a.ext["prompt_tokens_reused"], p.len() + first.tokens.len() - 1);
    assert_eq!((a.tokens, a.logprobs), (b.tokens, b.logprobs), "bit for bit");
    // A damaged file is a miss, never a wrong answer.
    for f in std::fs::read_dir(tmp.path()).unwrap() {
        let f = f.unwrap().path();
        // The state files (not the directory's lock).
        if f.extension().is_none_or(|x| x != "dfstate") {
            continue;
        }
        let mut v = std::fs::read(&f).unwrap();
        let n = v.len();
        v[n - 100] ^= 4;
        std::fs::write(&f, v).unwrap();
    }
    // Another restart: the server before it ends first (one server holds a state directory).
    drop(g);
    let mut g = Generator::new(e.clone(), disk(1 << 30)).unwrap();
    let mut again = p.clone();
    again.extend_from_slice(&r.prompt[40..44]);
    let a = run(&mut g, &request(again.clone(), 4));
    assert_eq!(a.ext["prompt_tokens_reused"], 0);
    assert_eq!(a.tokens, run(&mut fresh, &request(again, 4)).tokens);
    // The cap: a tiny one keeps only the newest file.
    drop(g);
    let _g = Generator::new(e, disk(1)).unwrap();
    let states = std::fs::read_dir(tmp.path())
        .unwrap()
        .flatten()
        .filter(|f| f.path().extension().is_some_and(|x| x == "dfstate"));
    assert_eq!(states.count(), 1);
}
