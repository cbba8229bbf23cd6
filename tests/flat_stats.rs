//! Statistics that cost nothing unless asked (issue 55): a session's counters hold no per-layer-pass
//! traces unless it is asked to keep them (`Session::keep_traces`, what the benchmarks set), so
//! what they hold does not grow with the tokens generated, and the process's peak RSS grows with
//! the generated length by the KV cache (the MLA layers' latent rows) and little more.

mod common;
use common::*;
use deltafin::engine::GenerateOptions;

#[test]
fn a_session_keeps_traces_only_when_asked_and_its_tokens_do_not_change() {
    let dir = fixture("k3-tiny-a");
    let r = reference("k3-tiny-a");
    let e = engine(&dir);
    let opts = GenerateOptions { max_new: 24, stop: Vec::new() };
    let run = |keep: bool| {
        let mut s = e.new_session();
        s.keep_traces(keep);
        s.prefill(&r.prompt[..40]).unwrap();
        let g = s.generate(&opts, &mut |_| true).unwrap();
        (g.tokens, s.stats)
    };
    let (plain, off) = run(false);
    let (traced, on) = run(true);
    assert_eq!(plain, traced, "keeping traces changes no token");
    assert_eq!(off.reads.layer_passes, on.reads.layer_passes);
    // Off: nothing per layer pass, however long the run.
    assert!(!off.keeps_traces());
    let t = off.traces();
    assert!(t.fetches.is_empty() && t.fetch_s.is_empty() && t.rows.is_empty());
    // On: one entry per MoE layer pass, prompt and generation.
    let t = on.traces();
    assert_eq!(t.fetches.len() as u64, on.reads.layer_passes);
    assert_eq!((t.fetch_s.len(), t.rows.len()), (t.fetches.len(), t.fetches.len()));
    // A fork keeps them as its session does; a shared call's totals when a session keeps its own.
    let mut s = e.new_session();
    s.keep_traces(true);
    assert!(s.fork().unwrap().stats.keeps_traces());
    let mut b = e.new_session();
    let total = e.prefill_sessions(&mut [&mut s, &mut b], &[&r.prompt[..20], &r.prompt[20..40]]).unwrap();
    assert_eq!(total.traces().fetches.len() as u64, total.reads.layer_passes);
    assert!(b.stats.traces().fetches.is_empty(), "a session that did not ask keeps none");
}

/// `deltafin run --demo` generating `n` tokens greedily (past end of text): its peak RSS.
fn demo_peak_rss(n: usize) -> u64 {
    let out = tempfile::tempdir().unwrap();
    let json = out.path().join("stats.json");
    let max_new = n.to_string();
    run_ok(
        deltafin_cmd().args(["run", "--demo", "--prompt", "Hello", "--ignore-eos", "--temperature", "0", "-q"]).args([
            "--max-new",
            &max_new,
            "--stats-json",
            json.to_str().unwrap(),
        ]),
    );
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(v["generated_tokens"].as_u64(), Some(n as u64), "{v}");
    v["peak_rss_bytes"].as_u64().expect("peak RSS is reported on Linux")
}

#[test]
fn peak_rss_is_flat_in_the_generated_length_beyond_the_kv_cache() {
    if !cfg!(target_os = "linux") {
        return skipped("peak_rss_is_flat_in_the_generated_length_beyond_the_kv_cache", "VmHWM is Linux's");
    }
    let (short, long) = (200, 4000);
    // The short run first: it lays the demo out under the test's cache.
    let rss_short = demo_peak_rss(short);
    let rss_long = demo_peak_rss(long);
    let demo = test_home().join("deltafin-cache").join(deltafin::demo::model_name());
    let cfg = deltafin::model::K3Config::load(&demo).unwrap();
    // The KV cache the longer run holds beyond the shorter one's.
    let kv = deltafin::memory::state_reserve(&cfg, long, 1) - deltafin::memory::state_reserve(&cfg, short, 1);
    let beyond = rss_long.saturating_sub(rss_short).saturating_sub(kv);
    // Beyond the KV cache: its growth's transients (a doubling vector copied; up to ~1.6 MB on the
    // demo from 200 to 8,000 tokens, not growing with them) and a few bytes a token (the token ids).
    // The per-layer traces kept for every request used to add ~1.8 KB a token: 7 MB here.
    let bound = 3_000_000;
    assert!(
        beyond < bound,
        "peak RSS grew {} bytes from {short} to {long} tokens, {beyond} beyond the KV cache's {kv} (at most {bound})",
        rss_long.saturating_sub(rss_short)
    );
}
