//! Split reads (issue 32): an expert held on several drives is read as page-aligned byte ranges
//! across them (real files read with O_DIRECT, by each of `readers()`) into one slot and checked
//! whole. The bytes and the greedy ids are those of whole reads whatever the split; a range that
//! fails or a copy that is corrupt fails over to the other copies with the same bytes.

mod common;
use common::*;
use deltafin::store::ExpertSource;
use deltafin::store::expert_store::{ExpertStore, FaultKind, FaultPlan, StoreOptions};
use deltafin::store::io::reader::ReaderKind;
use deltafin::store::placement::{Manifest, Policy, ShardUse};
use std::sync::Arc;

/// Ranges down to one page, so that the test model's 51 KiB experts split.
const MIN: Option<u64> = Some(4096);

/// A small random model whose experts span 13 pages (3 layers, 8 experts, top-2).
fn model() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = deltafin_cmd();
    c.args(["synth", "--out"]).arg(tmp.path().join("m"));
    c.args(["--layers", "3", "--experts", "8", "--top-k", "2", "--expert-inter", "256", "--seed", "7"]);
    run_ok(&mut c);
    tmp
}

fn store(m: &Model, man: &Manifest, split_min: Option<u64>, reader: ReaderKind) -> Arc<ExpertStore> {
    let spec =
        deltafin::store::placement::manifest_spec(man, &m.ck, &m.roster, m.roster.expert_layout.clone().unwrap())
            .unwrap();
    let opts = StoreOptions { reader, prefetch_depth: 0, record_reads: true, split_min, ..Default::default() };
    Arc::new(ExpertStore::open(spec, opts).unwrap())
}

/// (id, bytes) of every expert of every MoE layer, fetched four at a time, sorted by id.
fn all_experts(m: &Model, src: &dyn ExpertSource) -> Vec<Vec<(u32, Vec<u8>)>> {
    let mut out = Vec::new();
    for (l, locs) in m.roster.experts.iter().enumerate() {
        let Some(locs) = locs else { continue };
        let ids: Vec<u32> = (0..locs.len() as u32).collect();
        let mut got: Vec<(u32, Vec<u8>)> = ids.chunks(4).flat_map(|c| fetch_all(src, l, c)).collect();
        got.sort_by_key(|x| x.0);
        out.push(got);
    }
    out
}

/// Three mirrors, the first twice as fast as the others.
fn mirrors(m: &Model, root: &std::path::Path) -> Manifest {
    place_model(m, &drive_dirs(root, 3), |i| if i == 0 { 2.0 } else { 1.0 }, Policy::Mirror, ShardUse::Off, None)
}

#[test]
fn experts_split_across_mirrors_land_whole_with_the_same_bytes_and_output() {
    let tmp = model();
    let dir = tmp.path().join("m");
    let m = open_model(&dir);
    let prompt: Vec<u32> = (1..25).collect();
    let want_ids = greedy(&engine(&dir), &prompt, 4);
    let want_bytes = all_experts(&m, &m.mmap_source());
    let len = m.roster.expert_layout.as_ref().unwrap().len as u64;
    assert!(len >= 3 * 4096, "experts of {len} bytes are too small to split in three");
    let man = mirrors(&m, tmp.path());
    for &reader in readers() {
        let st = store(&m, &man, MIN, reader);
        assert_eq!(all_experts(&m, &*st), want_bytes, "{reader:?}: split reads changed the bytes");
        let log = st.read_log();
        let ranges = log.iter().filter(|(_, _, l)| *l < len).count();
        assert!(ranges * 2 >= log.len(), "{ranges} of {} reads are ranges of an expert ({len} bytes)", log.len());
        let r = st.report();
        assert!(r.drives[..3].iter().all(|d| d.reads > 0 && d.failed.is_none()), "{:?}", r.drives);
        assert_eq!(greedy(&engine_with(&dir, st.clone()), &prompt, 4), want_ids);
        // Split reads off: every read is a whole expert, same bytes.
        let whole = store(&m, &man, None, reader);
        assert_eq!(all_experts(&m, &*whole), want_bytes);
        assert!(whole.read_log().iter().all(|(_, _, l)| *l >= len));
    }
}

#[test]
fn a_failed_range_or_a_corrupt_copy_fails_over_with_the_same_bytes() {
    let tmp = model();
    let m = open_model(&tmp.path().join("m"));
    let want_bytes = all_experts(&m, &m.mmap_source());
    let man = mirrors(&m, tmp.path());
    let len = m.roster.expert_layout.as_ref().unwrap().len as u64;
    for &reader in readers() {
        // Drive 1's reads fail after two: its ranges are read again from the other copies.
        let st = store(&m, &man, MIN, reader);
        st.inject_fault(FaultPlan { drive: 1, kind: FaultKind::Eio, skip: 2, times: 1000 });
        assert_eq!(all_experts(&m, &*st), want_bytes, "{reader:?}");
        assert!(st.read_log().iter().any(|(_, _, l)| *l < len), "{reader:?}: no read was split");
        let r = st.report();
        assert!(r.drives[1].last_failure.is_some() && r.drives[0].last_failure.is_none(), "{reader:?}: {:?}", r.drives);
        // A short range on drive 2: the same.
        let st = store(&m, &man, MIN, reader);
        st.inject_fault(FaultPlan { drive: 2, kind: FaultKind::Short, skip: 1, times: 1 });
        assert_eq!(all_experts(&m, &*st), want_bytes, "{reader:?}");
    }
    // One byte flipped in every record of drive 0's layer-1 pack: a split read's checksum fails
    // (no one drive to blame), it is read again whole, and drive 0 is avoided once a whole read
    // of it fails.
    corrupt_pack(&man, 0, 1);
    for &reader in readers() {
        let st = store(&m, &man, MIN, reader);
        assert_eq!(all_experts(&m, &*st), want_bytes, "{reader:?}: a corrupt copy's bytes were delivered");
        assert_eq!(all_experts(&m, &*st), want_bytes, "{reader:?}");
    }
}
