//! The Engine/Session library: sessions stepped together equal sessions run alone (one expert read
//! per shared expert), verify-then-commit equals feeding tokens one by one, a failed forward leaves
//! a session exactly as it was, truncate goes back exactly, hidden rows are tapped after the asked
//! layers, and the expert cache never evicts a request's own hits.

mod common;
use common::*;
use deltafin::engine::{Engine, Session};
use deltafin::k3::ForwardError;
use deltafin::model::roster::ExpertLayout;
use deltafin::store::expert_store::ExpertStore;
use deltafin::store::{ExpertSink, ExpertSource, StoreError};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

fn reads(s: &ExpertStore) -> u64 {
    s.report().drives.iter().map(|d| d.reads).sum()
}

/// The next `n` greedy tokens and every step's logits, from a session's current logits.
fn continue_greedy(s: &mut Session, n: usize) -> (Vec<u32>, Vec<u32>) {
    let mut toks = Vec::new();
    let mut all = Vec::new();
    for _ in 0..n {
        let t = deltafin::k3::argmax(s.logits().unwrap());
        toks.push(t);
        all.extend(bits(s.step(t).unwrap()));
    }
    (toks, all)
}

#[test]
fn two_sessions_stepped_together_equal_each_alone_and_share_reads() {
    let dir = fixture("k3-tiny-a");
    let m = open_model(&dir);
    let r = reference("k3-tiny-a");
    let (pa, pb) = (&r.prompt[..40], &r.prompt[60..100]);
    // Alone.
    let alone = |p: &[u32]| {
        let e = engine(&dir);
        let mut s = e.new_session();
        s.prefill(p).unwrap();
        continue_greedy(&mut s, 6)
    };
    let (ta, la) = alone(pa);
    let (tb, lb) = alone(pb);
    // Together: one layer loop per step for both, through a store without cache.
    let store = shard_store(&m, 0, 2, 0);
    let e = engine_with(&dir, store.clone());
    let (mut a, mut b) = (e.new_session(), e.new_session());
    e.forward_sessions(&mut [&mut a, &mut b], &[pa, pb]).unwrap();
    let (mut ga, mut gb, mut ya, mut yb) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (reads0, ahead0) = (reads(&store), store.report());
    for _ in 0..6 {
        let na = deltafin::k3::argmax(a.logits().unwrap());
        let nb = deltafin::k3::argmax(b.logits().unwrap());
        ga.push(na);
        gb.push(nb);
        let passes_before = a.stats.reads.layer_passes;
        let out = e.forward_sessions(&mut [&mut a, &mut b], &[&[na], &[nb]]).unwrap();
        ya.extend(bits(&out[0]));
        yb.extend(bits(&out[1]));
        // One pass per MoE layer for both.
        assert_eq!(a.stats.reads.layer_passes - passes_before, m.cfg.moe_layers() as u64);
    }
    // Each distinct expert of a layer read once a step, plus the reads ahead (a step of two rows
    // reads the next layer's predicted experts ahead) that no fetch demanded.
    let ahead = store.report();
    let wasted = (ahead.prefetch_issued - ahead0.prefetch_issued) - (ahead.prefetch_used - ahead0.prefetch_used);
    let step_reads = reads(&store) - reads0;
    assert!(
        step_reads <= 6 * (2 * m.cfg.top_k * m.cfg.moe_layers()) as u64 + wasted,
        "{step_reads} reads, {wasted} ahead unused"
    );
    assert_eq!((&ga, &ya), (&ta, &la), "session a differs when stepped together");
    assert_eq!((&gb, &yb), (&tb, &lb), "session b differs when stepped together");
    assert_eq!(a.pos(), pa.len() + 6);
    assert_eq!(b.tokens().len(), pb.len() + 6);
    // Shared experts really are shared: a joint step reads the union, not the sum.
    let joint = {
        let store = shard_store(&m, 0, 2, 0);
        let e = engine_with(&dir, store.clone());
        let (mut a, mut b) = (e.new_session(), e.new_session());
        e.forward_sessions(&mut [&mut a, &mut b], &[pa, pb]).unwrap();
        let (before, r0) = (reads(&store), store.report());
        e.forward_sessions(&mut [&mut a, &mut b], &[&[ta[0]], &[tb[0]]]).unwrap();
        // Less the reads ahead no fetch demanded (counted apart above).
        let r1 = store.report();
        reads(&store) - before - ((r1.prefetch_issued - r0.prefetch_issued) - (r1.prefetch_used - r0.prefetch_used))
    };
    let separate = {
        let store = shard_store(&m, 0, 2, 0);
        let e = engine_with(&dir, store.clone());
        let (mut a, mut b) = (e.new_session(), e.new_session());
        a.prefill(pa).unwrap();
        b.prefill(pb).unwrap();
        let before = reads(&store);
        a.step(ta[0]).unwrap();
        b.step(tb[0]).unwrap();
        reads(&store) - before
    };
    assert!(joint < separate, "a joint step read {joint} experts, two separate steps {separate}");
}

#[test]
fn verify_then_commit_j_equals_feeding_j_tokens() {
    for name in ["k3-tiny-a", "k3-tiny-c"] {
        let dir = fixture(name);
        let e = engine(&dir);
        let r = reference(name);
        let prompt = &r.prompt[..30];
        let drafts: Vec<u32> = r.prompt[30..35].to_vec(); // k + 1 = 5 rows
        for j in 0..=drafts.len() {
            // Feed j tokens one by one.
            let mut fed = e.new_session();
            fed.prefill(prompt).unwrap();
            for &t in &drafts[..j] {
                fed.step(t).unwrap();
            }
            // Verify all rows, commit j.
            let mut ver = e.new_session();
            ver.prefill(prompt).unwrap();
            let out = ver.verify(&drafts, &[]).unwrap();
            assert_eq!(out.logits.len(), drafts.len() * e.k3_config().vocab);
            ver.commit(j).unwrap();
            assert_eq!(ver.pos(), fed.pos(), "{name} j={j}");
            assert_eq!(ver.tokens(), fed.tokens(), "{name} j={j}");
            assert_eq!(bits(ver.logits().unwrap()), bits(fed.logits().unwrap()), "{name} j={j}: logits after commit");
            // The committed state is the same state: the continuation is bit-identical.
            assert_eq!(continue_greedy(&mut ver, 5), continue_greedy(&mut fed, 5), "{name} j={j}: continuation");
        }
    }
}

#[test]
fn verify_rows_have_the_logits_of_one_by_one_steps() {
    let dir = fixture("k3-tiny-b");
    let e = engine(&dir);
    let r = reference("k3-tiny-b");
    let (prompt, rows) = (&r.prompt[..20], &r.prompt[20..24]);
    let mut s = e.new_session();
    s.prefill(prompt).unwrap();
    let out = s.verify(rows, &[]).unwrap();
    let mut one = e.new_session();
    one.prefill(prompt).unwrap();
    let v = e.k3_config().vocab;
    for (i, &t) in rows.iter().enumerate() {
        assert_eq!(bits(one.step(t).unwrap()), bits(&out.logits[i * v..(i + 1) * v]), "row {i}");
    }
    // Committing more rows than were verified is an error, not a panic.
    assert!(matches!(s.commit(9), Err(ForwardError::NothingPending { .. })));
}

/// An injected read fault: fails every fetch of one layer while `armed`, or from its `fail_from`-th
/// fetch of that layer on; passes everything else through.
struct FailingLayer {
    inner: Arc<dyn ExpertSource>,
    layer: usize,
    armed: AtomicBool,
    fail_from: AtomicUsize,
    fetches: AtomicUsize,
}

impl FailingLayer {
    fn new(inner: Arc<dyn ExpertSource>, layer: usize) -> Self {
        FailingLayer {
            inner,
            layer,
            armed: AtomicBool::new(false),
            fail_from: AtomicUsize::new(usize::MAX),
            fetches: AtomicUsize::new(0),
        }
    }
}

impl ExpertSource for FailingLayer {
    fn layout(&self) -> &ExpertLayout {
        self.inner.layout()
    }
    fn fetch<'s>(&'s self, layer: usize, experts: &[u32], sink: &mut dyn ExpertSink<'s>) -> Result<(), StoreError> {
        if layer == self.layer {
            let n = self.fetches.fetch_add(1, Ordering::Relaxed);
            if self.armed.load(Ordering::Relaxed) || n >= self.fail_from.load(Ordering::Relaxed) {
                return Err(StoreError::NoHolderLeft(format!("injected read error in layer {layer}")));
            }
        }
        self.inner.fetch(layer, experts, sink)
    }
    fn describe(&self) -> String {
        "failing".into()
    }
}

#[test]
fn a_forward_that_fails_half_way_leaves_the_session_as_it_was() {
    let dir = fixture("k3-tiny-a");
    let m = open_model(&dir);
    let r = reference("k3-tiny-a");
    let last_moe = m.cfg.layers - 1;
    let src = Arc::new(FailingLayer::new(Arc::new(m.mmap_source()), last_moe));
    let e = engine_with(&dir, src.clone());
    let mut want = e.new_session();
    want.prefill(&r.prompt[..50]).unwrap();
    let (want_toks, want_logits) = continue_greedy(&mut want, 6);

    let mut s = e.new_session();
    s.prefill(&r.prompt[..50]).unwrap();
    let (pos, logits) = (s.pos(), bits(s.logits().unwrap()));
    src.armed.store(true, Ordering::Relaxed);
    let t = deltafin::k3::argmax(s.logits().unwrap());
    // A step, a verification and a multi-chunk-free prefill all fail in the last layer ...
    assert!(matches!(s.step(t), Err(ForwardError::Store(_))));
    assert!(s.verify(&[t, 1, 2], &[]).is_err());
    assert!(s.prefill(&r.prompt[50..60]).is_err());
    assert!(src.fetches.load(Ordering::Relaxed) > 0);
    // ... and the session is untouched: same position, tokens, logits, and the same continuation.
    assert_eq!(s.pos(), pos);
    assert_eq!(s.tokens(), &r.prompt[..50]);
    assert_eq!(bits(s.logits().unwrap()), logits);
    src.armed.store(false, Ordering::Relaxed);
    assert_eq!(continue_greedy(&mut s, 6), (want_toks, want_logits));
}

#[test]
fn a_chunked_prefill_that_fails_late_leaves_the_session_as_it_was() {
    let dir = fixture("k3-tiny-a");
    let m = open_model(&dir);
    let r = reference("k3-tiny-a");
    let src = Arc::new(FailingLayer::new(Arc::new(m.mmap_source()), 1));
    let cfg =
        deltafin::engine::EngineConfig { prefill_rows: 16, ..test_config(&dir, deltafin::k3::KdaMode::Recurrent) };
    let e = Engine::open_with_source(cfg, src.clone()).unwrap();
    let mut s = e.new_session();
    s.prefill(&r.prompt[..20]).unwrap();
    let before = bits(s.logits().unwrap());
    // The next prefill is 3 chunks; its second chunk fails in layer 1 after the first committed.
    let done = src.fetches.load(Ordering::Relaxed);
    src.fail_from.store(done + 1, Ordering::Relaxed);
    assert!(s.prefill(&r.prompt[20..60]).is_err());
    assert_eq!(src.fetches.load(Ordering::Relaxed), done + 2, "the first chunk ran, the second failed");
    assert_eq!(s.pos(), 20);
    assert_eq!(s.tokens(), &r.prompt[..20]);
    assert_eq!(bits(s.logits().unwrap()), before);
    src.fail_from.store(usize::MAX, Ordering::Relaxed);
    let mut fresh = e.new_session();
    fresh.prefill(&r.prompt[..20]).unwrap();
    assert_eq!(continue_greedy(&mut s, 4), continue_greedy(&mut fresh, 4));
}

#[test]
fn truncate_goes_back_exactly() {
    let dir = fixture("k3-tiny-c");
    let e = engine(&dir);
    let r = reference("k3-tiny-c");
    let mut s = e.new_session();
    s.prefill(&r.prompt[..80]).unwrap();
    continue_greedy(&mut s, 3);
    s.truncate(50).unwrap();
    assert_eq!(s.pos(), 50);
    let mut fresh = e.new_session();
    fresh.prefill(&r.prompt[..50]).unwrap();
    assert_eq!(bits(s.logits().unwrap()), bits(fresh.logits().unwrap()));
    assert_eq!(continue_greedy(&mut s, 4), continue_greedy(&mut fresh, 4));
}

#[test]
fn hidden_rows_are_tapped_after_the_asked_layers() {
    let dir = fixture("k3-tiny-a");
    let e = engine(&dir);
    let r = reference("k3-tiny-a");
    let h = e.k3_config().hidden;
    let mut s = e.new_session();
    s.prefill(&r.prompt[..10]).unwrap();
    let taps = [1usize, 4];
    let out = s.verify(&r.prompt[10..13], &taps).unwrap();
    assert_eq!(out.taps.iter().map(|t| t.0).collect::<Vec<_>>(), taps);
    for (_, rows) in &out.taps {
        assert_eq!(rows.len(), 3 * h);
        assert!(rows.iter().all(|x| x.is_finite()));
    }
    // The same rows, one at a time, give the same tapped bits.
    let mut one = e.new_session();
    one.prefill(&r.prompt[..10]).unwrap();
    let o1 = one.verify(&r.prompt[10..11], &taps).unwrap();
    assert_eq!(bits(&o1.taps[0].1), bits(&out.taps[0].1[..h]));
    assert_eq!(bits(&o1.taps[1].1), bits(&out.taps[1].1[..h]));
}

#[test]
fn route_heat_from_an_earlier_run_keeps_its_hot_experts_cached() {
    let dir = fixture("k3-tiny-a");
    let m = open_model(&dir);
    let slot = deltafin::store::expert_store::slot_size(m.cfg.expert_bytes()) as u64;
    let tmp = tempfile::tempdir().unwrap();
    let heat = tmp.path().join("expert-heat.json");
    // Run 1: experts 0 and 1 are the hot ones.
    {
        let s = shard_store_with_heat(&m, 2 * slot, 2, 0, Some(heat.clone()));
        assert_eq!(s.heat_runs(), Some(0));
        for _ in 0..3 {
            fetch_all(&*s, 1, &[0, 1]);
        }
        fetch_all(&*s, 1, &[2, 3]);
    }
    let text = std::fs::read_to_string(&heat).unwrap();
    assert!(text.contains("\"runs\":1"), "{text}");
    // Run 2 meets the cold experts first: with the heat, the hot pair displaces them and is hit
    // on its next request; without it, the first comers stay (equal counts) and the pair misses.
    let replay = |heat: Option<std::path::PathBuf>| {
        let s = shard_store_with_heat(&m, 2 * slot, 2, 0, heat);
        fetch_all(&*s, 1, &[2, 3]);
        fetch_all(&*s, 1, &[0, 1]);
        let before = s.report().cache_hits.unwrap();
        let got = fetch_all(&*s, 1, &[0, 1]);
        assert_eq!(got.len(), 2);
        (s.report().cache_hits.unwrap() - before, s.heat_runs())
    };
    assert_eq!(replay(None), (0, None));
    assert_eq!(replay(Some(heat.clone())), (2, Some(1)));
    assert!(std::fs::read_to_string(&heat).unwrap().contains("\"runs\":2"));
}

#[test]
fn a_fetch_never_evicts_its_own_cache_hits() {
    let dir = fixture("k3-tiny-a");
    let m = open_model(&dir);
    let slot = deltafin::store::expert_store::slot_size(m.cfg.expert_bytes()) as u64;
    let store = shard_store(&m, 4 * slot, 2, 0);
    fetch_all(&*store, 1, &[4, 5, 6, 7]);
    let before = reads(&store);
    let got = fetch_all(&*store, 1, &(0..8).collect::<Vec<u32>>());
    assert_eq!(got.len(), 8);
    assert_eq!(reads(&store) - before, 4, "only the four misses are read; the cached 4..7 are hits");
    let r = store.report();
    assert_eq!(r.cache_hits, Some(4));
    // A prefetch guess never evicts a cached expert.
    let cached_before = reads(&store);
    store.prefetch(2, &(0..16).collect::<Vec<u32>>());
    let _ = fetch_all(&*store, 1, &[4, 5, 6, 7]);
    let r2 = store.report();
    assert!(r2.cache_hits.unwrap() >= 8, "the cached experts survived the prefetch: {r2:?}");
    let _ = cached_before;
}
