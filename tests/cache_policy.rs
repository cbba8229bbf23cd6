//! The expert cache's policy against the optimal (Belady) cache on real routes. Two fetch traces
//! of the trained demo model (tests/fixtures/routes, recorded by `bench run --fetch-trace` on
//! held-out prompts: one whose greedy continuation repeats itself, one that does not) are replayed
//! through a real store over the demo model's shards, its cache sized to a quarter and to a half of
//! each layer's experts, the prompt pass's routes noted as the engine notes them. The store's
//! misses must stay within a stated bound of the optimum's, computed here on the same trace. The
//! bounds are what the policy measured (bench/cache_sim.py, and this test) plus a little slack, and
//! each one fails the policy before route replay (LFU: 1.23x, 2.10x, 1.51x, 1.75x in the order
//! checked). Counts, not time; one drive at queue depth 1, so reads land in the order asked for.

mod common;
use common::*;
use deltafin::store::cache::belady_misses;
use deltafin::store::{ExpertSource, Flow, Landed};
use std::path::PathBuf;

struct Trace {
    passes: Vec<(u32, Vec<u32>)>,
    /// Beside each pass of several rows: the rows routed to each of its experts.
    rows_of: Vec<Vec<usize>>,
}

fn load(name: &str) -> Trace {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/routes").join(name);
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let ids =
        |x: &serde_json::Value| -> Vec<u64> { x.as_array().unwrap().iter().map(|e| e.as_u64().unwrap()).collect() };
    let passes = v["trace"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p[0].as_u64().unwrap() as u32, ids(&p[1]).into_iter().map(|e| e as u32).collect()))
        .collect();
    let rows_of =
        v["rows_of"].as_array().unwrap().iter().map(|r| ids(r).into_iter().map(|c| c as usize).collect()).collect();
    Trace { passes, rows_of }
}

/// The store's misses and the optimum's on `trace`, the cache holding `share` of each layer's
/// experts.
fn misses(trace: &Trace, share: f64) -> (u64, u64) {
    let m = open_model(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("demo/kimi-k3-demo"));
    let layers = trace.passes.iter().map(|p| p.0).collect::<std::collections::BTreeSet<_>>().len();
    let slots = (share * m.cfg.experts as f64) as usize * layers;
    let spec = deltafin::store::placement::shard_spec(&m.ck, &m.roster, &m.dir, 1, 1.0).unwrap();
    let slot = deltafin::store::expert_store::slot_size_for(&spec) as u64;
    let store = shard_store(&m, slots as u64 * slot, 1, 0);
    assert_eq!(store.report().cache_slots, Some(slots));
    let top_k = m.cfg.top_k;
    for ((layer, experts), rows_of) in trace.passes.iter().zip(&trace.rows_of) {
        if !rows_of.is_empty() {
            let rows = rows_of.iter().sum::<usize>() / top_k;
            store.note_routes(*layer as usize, experts, rows_of, rows);
        }
        store.fetch(*layer as usize, experts, &mut |_e: u32, _b: Landed<'_>| Ok(Flow::Continue)).unwrap();
    }
    (store.report().cache_misses.unwrap(), belady_misses(&trace.passes, slots))
}

fn check(name: &str, share: f64, bound: f64) {
    let (got, opt) = misses(&load(name), share);
    let ratio = got as f64 / opt as f64;
    eprintln!("{name} at {share}: {got} misses, the optimum {opt}: {ratio:.3}x (bound {bound}x)");
    assert!(
        ratio <= bound,
        "{name}, cache at {share} of the experts: {got} misses vs the optimum's {opt} = {ratio:.3}x > {bound}x"
    );
}

#[test]
fn a_repeating_continuation_stays_near_the_optimum() {
    // Measured 1.09x and 1.32x: the replay forecasts what the repeated text routes to next.
    check("heldout-3-repeating.json", 0.25, 1.15);
    check("heldout-3-repeating.json", 0.5, 1.40);
}

#[test]
fn a_continuation_that_does_not_repeat_stays_within_its_bound() {
    // Measured 1.43x and 1.64x: without repetition only request counts are left to go by.
    check("heldout-9.json", 0.25, 1.48);
    check("heldout-9.json", 0.5, 1.70);
}

/// Cache hits and misses of `store` so far.
fn counts(store: &deltafin::store::expert_store::ExpertStore) -> (u64, u64) {
    let r = store.report();
    (r.cache_hits.unwrap_or(0), r.cache_misses.unwrap_or(0))
}

#[test]
fn a_decode_step_of_many_sequences_keeps_the_cache_it_cannot_hold_the_step_in() {
    // Many sequences in lockstep name every expert of every MoE layer each step (124.6 of 128 at
    // N = 32 on the bench's synth): a cache of C slots can only keep C of them. It must save C
    // reads a step (misses that do not outrank a cached expert stream through the read slots,
    // and reads ahead of the next layer take no cached expert of the step) rather than cycle the
    // cache through the bank, each expert evicted before its next use (0 hits).
    let m = open_model(&fixture("k3-tiny-a"));
    let moe: Vec<usize> =
        (0..m.cfg.layers).filter(|&l| m.cfg.ffn[l] == deltafin::model::config::FfnKind::Moe).collect();
    let all: Vec<u32> = (0..m.cfg.experts as u32).collect();
    let bank = (moe.len() * all.len()) as u64;
    let spec = deltafin::store::placement::shard_spec(&m.ck, &m.roster, &m.dir, 2, 1.0).unwrap();
    let slot = deltafin::store::expert_store::slot_size_for(&spec) as u64;
    let cached = bank / 4;
    let store = shard_store(&m, cached * slot, 2, 0);
    let ahead: Vec<u32> = all.iter().rev().take(4).copied().collect();
    let step = |store: &deltafin::store::expert_store::ExpertStore| {
        for (i, &l) in moe.iter().enumerate() {
            let then = moe.get(i + 1).map(|&nl| (nl, &ahead[..]));
            store.fetch_then(l, &all, then, &mut |_e: u32, _b: Landed<'_>| Ok(Flow::Continue)).unwrap();
        }
    };
    for _ in 0..2 {
        step(&store);
    }
    let before = counts(&store);
    let steps = 4;
    for _ in 0..steps {
        step(&store);
    }
    let (hits, misses) = (counts(&store).0 - before.0, counts(&store).1 - before.1);
    assert_eq!(hits + misses, steps * bank);
    eprintln!("{steps} steps of {bank} experts, cache of {cached}: {hits} hits, {misses} misses");
    assert!(hits >= steps * (cached - 2), "{hits} hits in {steps} steps with {cached} cached (misses {misses})");
}

/// bench/cache_sim.py replays a trace whose passes need more slots than the cache and its read
/// slots hold (every slot taken by an expert of that pass, nothing to evict): a prompt pass on a
/// K3-shaped model does. It once failed there (`victim` of an empty cache), which lost the cache
/// comparison of every peer run.
#[test]
fn the_cache_simulator_replays_passes_larger_than_the_cache() {
    if std::process::Command::new("python3").arg("--version").output().is_err() {
        eprintln!("skipped: python3 is not on PATH (the simulator is a Python script)");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let trace: Vec<serde_json::Value> = (0..12u32)
        .map(|t| serde_json::json!([t % 3, (0..24u32).map(|e| (e * 5 + t) % 64).collect::<Vec<_>>()]))
        .collect();
    let path = tmp.path().join("trace.json");
    std::fs::write(&path, serde_json::json!({"trace": trace, "cache_slots": 4}).to_string()).unwrap();
    let sim = concat!(env!("CARGO_MANIFEST_DIR"), "/bench/cache_sim.py");
    for extra in [&[][..], &["--fractions", "0.125,0.5"][..]] {
        let o = std::process::Command::new("python3").arg(sim).arg(&path).args(extra).output().unwrap();
        assert!(o.status.success(), "cache_sim.py failed: {}", String::from_utf8_lossy(&o.stderr));
        let rec: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        for (_, row) in rec["sizes"].as_object().unwrap() {
            let (opt, store) = (row["belady_misses"].as_u64().unwrap(), row["store"]["misses"].as_u64().unwrap());
            assert!(store >= opt, "no policy misses less than Belady's: {row}");
        }
    }
}
