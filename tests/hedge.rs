//! Hedged reads (issue 32): a read late on a slow drive is issued again on another drive holding a
//! copy; the first copy to land is used (with each of `readers()`). The slow drive is real files
//! read with O_DIRECT whose completions the store hands over late (`delay_drive`), so the late
//! read really is in flight when its hedge lands. Output bits never change; only the counters say what happened.

mod common;
use common::*;
use deltafin::store::expert_store::{ExpertStore, FaultKind, FaultPlan, StoreOptions};
use deltafin::store::io::reader::ReaderKind;
use deltafin::store::placement::{Manifest, Policy, ShardUse};
use deltafin::store::{ExpertSource, SourceReport};
use std::sync::Arc;
use std::time::Duration;

/// How late the slow drive's completions arrive: far past any p95 of reads of a few KB.
const SLOW: Duration = Duration::from_millis(120);

fn store(m: &Model, man: &Manifest, hedge: bool, reader: ReaderKind) -> Arc<ExpertStore> {
    let spec =
        deltafin::store::placement::manifest_spec(man, &m.ck, &m.roster, m.roster.expert_layout.clone().unwrap())
            .unwrap();
    let opts = StoreOptions { reader, prefetch_depth: 0, hedge, ..Default::default() };
    Arc::new(ExpertStore::open(spec, opts).unwrap())
}

/// (id, bytes) of a layer's experts.
type Experts = Vec<(u32, Vec<u8>)>;

/// Every expert of every MoE layer, fetched through `src` four at a time (as a decode step of
/// this model fetches them), sorted by id.
fn all_experts(m: &Model, src: &dyn ExpertSource) -> Vec<(usize, Experts)> {
    let mut out = Vec::new();
    for (l, locs) in m.roster.experts.iter().enumerate() {
        let Some(locs) = locs else { continue };
        let ids: Vec<u32> = (0..locs.len() as u32).collect();
        let mut got: Experts = ids.chunks(4).flat_map(|c| fetch_all(src, l, c)).collect();
        got.sort_by_key(|x| x.0);
        out.push((l, got));
    }
    out
}

fn hedges(r: &SourceReport) -> (u64, u64) {
    (r.hedged_reads.unwrap_or(0), r.hedge_wins.unwrap_or(0))
}

#[test]
fn late_reads_are_hedged_on_the_mirror_with_the_same_bytes_and_output() {
    let tmp = copy_fixture("k3-tiny-a");
    let m = open_model(tmp.path());
    let prompt = &reference("k3-tiny-a").prompt[..24];
    let want_ids = greedy(&engine(tmp.path()), prompt, 4);
    let want_bytes = all_experts(&m, &m.mmap_source());
    let man = place_model(&m, &drive_dirs(tmp.path(), 2), |_| 1.0, Policy::Mirror, ShardUse::Off, None);
    for &reader in readers() {
        let st = store(&m, &man, true, reader);
        // Each drive learns its read times first.
        assert_eq!(all_experts(&m, &*st), want_bytes);
        assert_eq!(all_experts(&m, &*st), want_bytes);
        assert!(st.report().drives[..2].iter().all(|d| d.reads >= 16), "{:?}", st.report().drives);
        let before = hedges(&st.report());
        st.delay_drive(0, Some(SLOW));
        assert_eq!(all_experts(&m, &*st), want_bytes, "{reader:?}: hedged bytes differ");
        let (issued, wins) = hedges(&st.report());
        assert!(
            issued > before.0 && wins > before.1,
            "{reader:?}: a read late on drive 0 was not hedged and won: {issued} hedged, {wins} wins \
             (before: {before:?})"
        );
        assert_eq!(greedy(&engine_with(tmp.path(), st.clone()), prompt, 4), want_ids);
        // The losers land later and give their slots back: the store still serves everything.
        st.delay_drive(0, None);
        assert_eq!(all_experts(&m, &*st), want_bytes);
    }
}

#[test]
fn no_hedge_without_a_second_copy_or_with_hedging_off() {
    let tmp = copy_fixture("k3-tiny-a");
    let m = open_model(tmp.path());
    let want_bytes = all_experts(&m, &m.mmap_source());
    for (policy, hedge) in [(Policy::Spread, true), (Policy::Mirror, false)] {
        let drives = drive_dirs(&tmp.path().join(format!("{policy:?}")), 2);
        let man = place_model(&m, &drives, |_| 1.0, policy, ShardUse::Off, None);
        for &reader in readers() {
            let st = store(&m, &man, hedge, reader);
            all_experts(&m, &*st);
            all_experts(&m, &*st);
            st.delay_drive(0, Some(SLOW / 4));
            assert_eq!(all_experts(&m, &*st), want_bytes, "{policy:?} hedge {hedge} {reader:?}");
            assert_eq!(hedges(&st.report()), (0, 0), "{policy:?} hedge {hedge} {reader:?}");
        }
    }
}

#[test]
fn a_failed_copy_of_a_hedged_read_leaves_the_other_to_serve_it() {
    let tmp = copy_fixture("k3-tiny-a");
    let m = open_model(tmp.path());
    let want_bytes = all_experts(&m, &m.mmap_source());
    let man = place_model(&m, &drive_dirs(tmp.path(), 2), |_| 1.0, Policy::Mirror, ShardUse::Off, None);
    for &reader in readers() {
        let st = store(&m, &man, true, reader);
        all_experts(&m, &*st);
        all_experts(&m, &*st);
        // Drive 0 is slow, so its reads are hedged on drive 1, whose reads then fail: every expert
        // still lands, from drive 0, with its checked bytes.
        st.delay_drive(0, Some(SLOW / 2));
        st.inject_fault(FaultPlan { drive: 1, kind: FaultKind::Eio, skip: 0, times: 1000 });
        assert_eq!(all_experts(&m, &*st), want_bytes, "{reader:?}");
        let r = st.report();
        assert!(r.drives[1].last_failure.is_some(), "{reader:?}: {:?}", r.drives[1]);
    }
}
