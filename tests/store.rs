//! The expert store against the in-memory path: every placement (1, 2, 3 directory drives;
//! spread, mirror, hot), cache size (0, small, large) and reader (`readers()`: io_uring and pread)
//! must give bit-identical logits; faults (corrupt, truncated or missing copies, short reads, packs cut
//! before the run or between two forward calls, missing drives) fail over to other holders with
//! identical output, or fail loudly when no holder is left, never with a wrong output.

mod common;
use common::*;
use deltafin::store::expert_store::ExpertStore;
use deltafin::store::io::reader::ReaderKind;
use deltafin::store::placement::{Manifest, Policy, RouteTrace, ShardUse};
use deltafin::store::{ExpertSource, StoreError};
use std::path::PathBuf;
use std::sync::Arc;

use common::open_model as open;

fn prompt() -> Vec<u32> {
    reference("k3-tiny-a").prompt[..60].to_vec()
}

/// Logits of a prefill plus 6 greedy decode steps (so caches and decode reads are exercised).
fn logits_with(m: &Model, src: Arc<dyn ExpertSource>) -> Result<Vec<f32>, deltafin::k3::ForwardError> {
    let e = engine_with(&m.dir, src);
    let mut s = e.new_session();
    let mut out = s.score(&prompt())?;
    for _ in 0..6 {
        let last = &out[out.len() - m.cfg.vocab..];
        let t = deltafin::k3::argmax(last);
        out.extend(s.score(&[t])?);
    }
    Ok(out)
}

fn reference_logits(m: &Model) -> Vec<f32> {
    logits_with(m, Arc::new(m.mmap_source())).unwrap()
}

fn route_trace(m: &Model) -> RouteTrace {
    let e = engine_with(&m.dir, Arc::new(m.mmap_source()));
    let mut s = e.new_session();
    s.prefill(&prompt()).unwrap();
    s.stats.route_trace().for_model(&m.ck)
}

fn do_place(m: &Model, drives: &[PathBuf], policy: Policy, shards: ShardUse, trace: Option<RouteTrace>) -> Manifest {
    // Different given speeds so spread and hot are not symmetric.
    place_model(m, drives, |i| 1.0 + i as f64, policy, shards, trace)
}

fn open_store(m: &Model, man: &Manifest, cache_bytes: u64, reader: ReaderKind) -> Arc<ExpertStore> {
    manifest_store(m, man, cache_bytes, reader, 1)
}

fn bits_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
fn every_placement_cache_and_reader_gives_identical_bits() {
    let tmp = copy_fixture("k3-tiny-a");
    let m = open(tmp.path());
    let want = reference_logits(&m);
    let trace = route_trace(&m);
    let expert = m.cfg.expert_bytes() as u64;
    let mut combos = 0;
    for n in 1..=3usize {
        for policy in [Policy::Spread, Policy::Mirror, Policy::Hot] {
            let drives: Vec<PathBuf> = (0..n).map(|i| tmp.path().join(format!("drives-{n}-{policy:?}/d{i}"))).collect();
            let man = do_place(&m, &drives, policy, ShardUse::Off, Some(trace.clone()));
            for cache in [0, 3 * expert, 1 << 30] {
                for &reader in readers() {
                    let store = open_store(&m, &man, cache, reader);
                    let got = logits_with(&m, store.clone()).unwrap();
                    assert!(
                        bits_equal(&got, &want),
                        "{n} drives, {policy:?}, cache {cache}, {reader:?}: logits differ"
                    );
                    let r = store.report();
                    assert!(r.drives.iter().take(n).all(|d| d.failures == 0));
                    assert_eq!(r.drives[n].reads, 0, "shards are off: no reads from them");
                    if cache == 0 {
                        assert_eq!(r.cache_hits, Some(0), "no cache, no hits");
                    }
                    if cache == 1 << 30 {
                        // Everything fits: each distinct expert is read once, plus at most one
                        // second copy per hedged read (a read late on a loaded machine is hedged
                        // where a mirror holds the expert; the loser may complete unused).
                        let distinct: u64 = r.cache_misses.unwrap();
                        let hedged = r.hedged_reads.unwrap_or(0);
                        let reads: u64 = r.drives.iter().map(|d| d.reads).sum();
                        assert!(
                            (distinct..=distinct + hedged).contains(&reads),
                            "{reads} drive reads for {distinct} distinct experts and {hedged} hedged reads"
                        );
                    }
                    combos += 1;
                }
            }
        }
    }
    assert_eq!(combos, 27 * readers().len());
}

#[test]
fn spread_puts_each_expert_on_one_drive_and_mirror_on_all() {
    let tmp = copy_fixture("k3-tiny-a");
    let m = open(tmp.path());
    let drives = drive_dirs(tmp.path(), 3);
    let man = do_place(&m, &drives, Policy::Spread, ShardUse::Fallback, None);
    assert!(man.layers.iter().flat_map(|l| &l.experts).all(|e| e.drives.len() == 1));
    let per: Vec<usize> =
        (0..3).map(|d| man.layers.iter().flat_map(|l| &l.experts).filter(|e| e.drives[0] == d).count()).collect();
    // Speeds 1, 2, 3: bytes proportional.
    assert!(per[2] > per[1] && per[1] > per[0], "{per:?}");
    let man = do_place(&m, &drives, Policy::Mirror, ShardUse::Fallback, None);
    assert!(man.layers.iter().flat_map(|l| &l.experts).all(|e| e.drives == vec![0, 1, 2]));
}

#[test]
fn a_corrupt_copy_fails_over_with_identical_output() {
    let tmp = copy_fixture("k3-tiny-a");
    let m = open(tmp.path());
    let want = reference_logits(&m);
    let drives = drive_dirs(tmp.path(), 2);
    let man = do_place(&m, &drives, Policy::Mirror, ShardUse::Off, None);
    // Flip one byte in every record of drive 0's layer-1 pack.
    corrupt_pack(&man, 0, 1);
    for &reader in readers() {
        // Drive 1 is slower (given 2 GB/s vs 1) but the balancer sends the first reads to drive 0.
        let store = open_store(&m, &man, 0, reader);
        let got = logits_with(&m, store.clone()).unwrap();
        assert!(bits_equal(&got, &want), "{reader:?}: output changed after failover");
        let r = store.report();
        assert!(r.drives[0].failures >= 1, "{reader:?}: {:?}", r.drives[0]);
        let why = r.drives[0].last_failure.clone().unwrap();
        assert!(why.contains("checksum mismatch") && why.contains("layer 1"), "{why}");
    }
}

#[test]
fn a_copy_truncated_mid_run_fails_over() {
    let tmp = copy_fixture("k3-tiny-a");
    let m = open(tmp.path());
    let want = reference_logits(&m);
    let drives = drive_dirs(tmp.path(), 2);
    for &reader in readers() {
        let man = do_place(&m, &drives, Policy::Mirror, ShardUse::Off, None);
        let store = open_store(&m, &man, 0, reader);
        // The files are open; now the drive "loses" data.
        for l in 1..6 {
            let f = std::fs::OpenOptions::new().write(true).open(man.pack_path(1, l)).unwrap();
            f.set_len(4096).unwrap();
        }
        let got = logits_with(&m, store.clone()).unwrap();
        assert!(bits_equal(&got, &want), "{reader:?}");
        let r = store.report();
        assert!(
            r.drives[1].last_failure.as_ref().is_some_and(|w| w.contains("short read")),
            "{reader:?}: {:?}",
            r.drives[1]
        );
    }
}

/// Prefill, then `fault()`, then 6 greedy decode steps: the logits so far and the first error.
/// Whatever it returns must be a prefix of `want` (a fault may stop the run, never change it).
fn logits_with_fault(
    m: &Model,
    src: Arc<dyn ExpertSource>,
    fault: impl FnOnce(),
    want: &[f32],
) -> (Vec<f32>, Option<deltafin::k3::ForwardError>) {
    let e = engine_with(&m.dir, src);
    let mut s = e.new_session();
    let mut out = s.score(&prompt()).unwrap();
    fault();
    let mut err = None;
    for _ in 0..6 {
        let t = deltafin::k3::argmax(&out[out.len() - m.cfg.vocab..]);
        match s.score(&[t]) {
            Ok(l) => out.extend(l),
            Err(e) => {
                err = Some(e);
                break;
            }
        }
    }
    assert!(bits_equal(&out, &want[..out.len().min(want.len())]), "a fault changed the output");
    (out, err)
}

/// Cuts every layer's pack on drive `d` to `keep(header)` bytes (the files may be open).
fn truncate_packs(man: &Manifest, d: usize, keep: impl Fn(&deltafin::store::pack::PackHeader) -> u64) {
    for l in 1..6 {
        let path = man.pack_path(d, l);
        let h = deltafin::store::pack::read_header(&path).unwrap();
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(keep(&h)).unwrap();
    }
}

/// Keeps the header and the first half of the first record: every read of the pack comes back
/// short (part of a record, or nothing).
fn mid_first_record(h: &deltafin::store::pack::PackHeader) -> u64 {
    let first = h.entries.iter().min_by_key(|e| e.offset).unwrap();
    first.offset + first.length / 2
}

#[test]
fn a_short_read_mid_record_fails_over_with_identical_output() {
    let tmp = copy_fixture("k3-tiny-a");
    let m = open(tmp.path());
    let want = reference_logits(&m);
    for &reader in readers() {
        let drives: Vec<PathBuf> = (0..2).map(|i| tmp.path().join(format!("{reader:?}/d{i}"))).collect();
        let man = do_place(&m, &drives, Policy::Mirror, ShardUse::Off, None);
        let store = open_store(&m, &man, 0, reader);
        // Open files, then every pack on drive 0 is cut in the middle of its first record.
        truncate_packs(&man, 0, mid_first_record);
        let got = logits_with(&m, store.clone()).unwrap();
        assert!(bits_equal(&got, &want), "{reader:?}: output changed after a short read");
        let r = store.report();
        assert!(
            r.drives[0].last_failure.as_ref().is_some_and(|w| w.contains("short read")),
            "{reader:?}: {:?}",
            r.drives[0]
        );
    }
}

#[test]
fn a_pack_truncated_before_the_run_is_not_used() {
    let tmp = copy_fixture("k3-tiny-a");
    let m = open(tmp.path());
    let want = reference_logits(&m);
    let drives = drive_dirs(tmp.path(), 2);
    for &reader in readers() {
        // Mirror: the truncated packs' header check drops drive 0's copies; drive 1 serves everything.
        let man = do_place(&m, &drives, Policy::Mirror, ShardUse::Off, None);
        truncate_packs(&man, 0, mid_first_record);
        let store = open_store(&m, &man, 0, reader);
        assert!(bits_equal(&logits_with(&m, store.clone()).unwrap(), &want), "{reader:?}");
        let r = store.report();
        assert_eq!(r.drives[0].reads, 0, "{reader:?}: the truncated packs are never read");
        assert!(r.drives[1].reads > 0);
        // Spread without shards: the experts only drive 0 held have no holder left, a clear error.
        let man = do_place(&m, &drives, Policy::Spread, ShardUse::Off, None);
        truncate_packs(&man, 0, mid_first_record);
        let store = open_store(&m, &man, 0, reader);
        let err = logits_with(&m, store.clone()).unwrap_err();
        assert!(matches!(err, deltafin::k3::ForwardError::Store(StoreError::NoHolderLeft(_))), "{reader:?}: {err}");
        assert!(err.to_string().contains("no usable holder"), "{reader:?}: {err}");
    }
}

#[test]
fn a_pack_truncated_between_forward_calls_fails_over_or_stops() {
    let tmp = copy_fixture("k3-tiny-a");
    let m = open(tmp.path());
    let want = reference_logits(&m);
    let drives = drive_dirs(tmp.path(), 2);
    for &reader in readers() {
        // Mirror: the other drive's copy.
        let man = do_place(&m, &drives, Policy::Mirror, ShardUse::Off, None);
        let store = open_store(&m, &man, 0, reader);
        let (got, err) = logits_with_fault(&m, store.clone(), || truncate_packs(&man, 0, |h| h.header_len), &want);
        assert!(err.is_none(), "{err:?}");
        assert_eq!(got.len(), want.len());
        // Spread with the shards as fallback: the shards.
        let man = do_place(&m, &drives, Policy::Spread, ShardUse::Fallback, None);
        let store = open_store(&m, &man, 0, reader);
        let shard_reads = store.report().drives[2].reads;
        let (got, err) = logits_with_fault(&m, store.clone(), || truncate_packs(&man, 0, |h| h.header_len), &want);
        assert!(err.is_none(), "{err:?}");
        assert_eq!(got.len(), want.len());
        let r = store.report();
        assert!(r.drives[0].last_failure.as_ref().is_some_and(|w| w.contains("short read")), "{:?}", r.drives[0]);
        assert!(r.drives[2].reads > shard_reads, "the shards served drive 0's experts");
        // Spread, no shards: no holder is left, and the run stops with a clear error.
        let man = do_place(&m, &drives, Policy::Spread, ShardUse::Off, None);
        let store = open_store(&m, &man, 0, reader);
        let (got, err) = logits_with_fault(&m, store.clone(), || truncate_packs(&man, 0, |h| h.header_len), &want);
        assert!(got.len() < want.len());
        let err = err.expect("no holder left must be an error");
        assert!(matches!(err, deltafin::k3::ForwardError::Store(StoreError::NoHolderLeft(_))), "{err}");
        let msg = err.to_string();
        let clear = msg.contains("of layer") && msg.contains("short read") && msg.contains("d0");
        assert!(clear && (msg.contains("no holder left") || msg.contains("no usable holder")), "{msg}");
    }
}

#[test]
fn a_missing_drive_degrades_to_remaining_holders() {
    let tmp = copy_fixture("k3-tiny-a");
    let m = open(tmp.path());
    let want = reference_logits(&m);
    let drives = drive_dirs(tmp.path(), 3);
    // Mirror: every expert survives losing a drive.
    let man = do_place(&m, &drives, Policy::Mirror, ShardUse::Off, None);
    std::fs::remove_dir_all(&drives[1]).unwrap();
    let store = open_store(&m, &man, 1 << 20, ReaderKind::Auto);
    assert!(bits_equal(&logits_with(&m, store.clone()).unwrap(), &want));
    assert!(store.report().drives[1].failed.as_ref().unwrap().contains("missing"));
    // Spread with the shards as fallback: the shards serve what the lost drive held.
    let tmp2 = copy_fixture("k3-tiny-a");
    let m2 = open(tmp2.path());
    let drives2 = drive_dirs(tmp2.path(), 2);
    let man2 = do_place(&m2, &drives2, Policy::Spread, ShardUse::Fallback, None);
    std::fs::remove_dir_all(&drives2[0]).unwrap();
    let store2 = open_store(&m2, &man2, 0, ReaderKind::Pread);
    assert!(bits_equal(&logits_with(&m2, store2.clone()).unwrap(), &want));
    let r = store2.report();
    assert!(r.drives[2].reads > 0, "the shards served the lost drive's experts");
}

#[test]
fn a_drive_directory_removed_mid_run_changes_nothing() {
    let tmp = copy_fixture("k3-tiny-a");
    let m = open(tmp.path());
    let want = reference_logits(&m);
    let drives = drive_dirs(tmp.path(), 2);
    let man = do_place(&m, &drives, Policy::Spread, ShardUse::Fallback, None);
    // One store per reader, both open before the directory goes.
    let stores: Vec<_> = readers().iter().map(|&reader| (reader, open_store(&m, &man, 0, reader))).collect();
    // The files are open: their data stays readable after the directory is gone.
    std::fs::remove_dir_all(&drives[0]).unwrap();
    for (reader, store) in stores {
        assert!(bits_equal(&logits_with(&m, store.clone()).unwrap(), &want), "{reader:?}");
    }
}

#[test]
fn no_holder_left_is_a_clear_error() {
    let tmp = copy_fixture("k3-tiny-a");
    let m = open(tmp.path());
    let drives = drive_dirs(tmp.path(), 2);
    let man = do_place(&m, &drives, Policy::Spread, ShardUse::Off, None);
    std::fs::remove_dir_all(&drives[1]).unwrap();
    for &reader in readers() {
        let store = open_store(&m, &man, 0, reader);
        let err = logits_with(&m, store.clone()).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, deltafin::k3::ForwardError::Store(StoreError::NoHolderLeft(_))), "{reader:?}: {msg}");
        assert!(msg.contains("of layer 1") && msg.contains("no usable holder") && msg.contains("d1"), "{msg}");
    }
}

#[test]
fn concurrent_fetches_share_reads_and_get_the_right_bytes() {
    let tmp = copy_fixture("k3-tiny-a");
    let m = open(tmp.path());
    let drives = drive_dirs(tmp.path(), 2);
    let man = do_place(&m, &drives, Policy::Spread, ShardUse::Off, None);
    for &reader in readers() {
        let store = open_store(&m, &man, 1 << 20, reader);
        let mmap = m.mmap_source();
        let want: std::collections::HashMap<u32, Vec<u8>> =
            fetch_all(&mmap, 2, &(0..16).collect::<Vec<u32>>()).into_iter().collect();
        std::thread::scope(|s| {
            for t in 0..4 {
                let (store, want) = (&store, &want);
                s.spawn(move || {
                    let ids: Vec<u32> = (0..16).map(|i| (i + t * 3) % 16).collect();
                    let mut seen = 0;
                    fetch_each(&**store, 2, &ids, |e, b| {
                        assert_eq!(b, want[&e].as_slice(), "thread {t}: expert {e} bytes differ");
                        seen += 1;
                    });
                    assert_eq!(seen, 16);
                });
            }
        });
        let r = store.report();
        let reads: u64 = r.drives.iter().map(|d| d.reads).sum();
        assert_eq!(reads, 16, "{reader:?}: each expert read once across 4 concurrent fetches");
        assert_eq!(r.cache_hits.unwrap() + r.inflight_joins.unwrap() + r.cache_misses.unwrap(), 64);
    }
}

#[test]
fn place_resumes_and_never_publishes_incomplete_data() {
    let tmp = copy_fixture("k3-tiny-a");
    let m = open(tmp.path());
    let drives = drive_dirs(tmp.path(), 2);
    let man0 = do_place(&m, &drives, Policy::Spread, ShardUse::Fallback, None);
    let first = std::fs::metadata(man0.pack_path(0, 1)).unwrap().modified().unwrap();
    // An interrupted run: manifest gone, one pack half written, another missing.
    std::fs::remove_file(tmp.path().join("placement.json")).unwrap();
    std::fs::remove_file(man0.pack_path(1, 3)).unwrap();
    std::fs::write(man0.pack_path(1, 3).with_extension("pack.partial"), b"half").unwrap();
    let man = do_place(&m, &drives, Policy::Spread, ShardUse::Fallback, None);
    assert_eq!(std::fs::metadata(man.pack_path(0, 1)).unwrap().modified().unwrap(), first, "complete packs are reused");
    assert!(man.pack_path(1, 3).exists());
    assert!(!man.pack_path(1, 3).with_extension("pack.partial").exists());
    let problems = deltafin::store::placement::verify(&man, &m.ck, &m.roster, &|_, _| {});
    assert!(problems.is_empty(), "{problems:?}");
}

/// Fetches `ids` of `layer`, calling `f` on each expert's bytes.
fn fetch_each(src: &dyn ExpertSource, layer: usize, ids: &[u32], mut f: impl FnMut(u32, &[u8])) {
    src.fetch(layer, ids, &mut |e: u32, b: deltafin::store::Landed<'_>| {
        f(e, b.bytes());
        Ok(deltafin::store::Flow::Continue)
    })
    .unwrap()
}

/// Runs `f` on another thread and fails the test if it does not finish in time (a hang).
fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(secs)).expect("the store hung")
}

#[test]
fn many_fetchers_on_a_tiny_slab_do_not_hang() {
    let tmp = copy_fixture("k3-tiny-a");
    let dir = tmp.path().to_path_buf();
    within(60, move || {
        let m = open(&dir);
        // qd 2, no cache: a handful of slots for 4 threads x 16 experts each.
        let store = shard_store(&m, 0, 2, 1);
        let want: std::collections::HashMap<u32, Vec<u8>> =
            fetch_all(&m.mmap_source(), 3, &(0..16).collect::<Vec<u32>>()).into_iter().collect();
        std::thread::scope(|s| {
            for t in 0..4u32 {
                let (store, want) = (&store, &want);
                s.spawn(move || {
                    for round in 0..20u32 {
                        let ids: Vec<u32> = (0..16).map(|i| (i * 5 + t + round) % 16).collect();
                        let mut n = 0;
                        fetch_each(&**store, 3, &ids, |e, b| {
                            assert_eq!(b, want[&e].as_slice());
                            n += 1;
                        });
                        assert_eq!(n, 16);
                    }
                });
            }
        });
    });
}

#[test]
fn a_full_cache_keeps_the_more_used_experts() {
    let tmp = copy_fixture("k3-tiny-a");
    let m = open(tmp.path());
    let slot = deltafin::store::expert_store::slot_size(m.cfg.expert_bytes()) as u64;
    let store = shard_store(&m, 4 * slot, 2, 0);
    let fetch = |ids: &[u32]| {
        let before = store.report();
        fetch_each(&*store, 1, ids, |_, _| {});
        let after = store.report();
        (
            after.cache_hits.unwrap() - before.cache_hits.unwrap(),
            after.cache_misses.unwrap() - before.cache_misses.unwrap(),
        )
    };
    assert_eq!(fetch(&[0, 1, 2, 3]), (0, 4)); // cache: 0 1 2 3
    assert_eq!(fetch(&[4, 5]), (0, 2)); // used once, no more than the cached ones: not admitted
    assert_eq!(fetch(&[0, 1, 2, 3]), (4, 0), "one-off experts do not flush the cache (decode walks layers cyclically)");
    assert_eq!(fetch(&[4, 5]), (0, 2)); // used twice, as often as the cached ones: still out
    assert_eq!(fetch(&[4, 5]), (0, 2)); // three times: admitted, replacing the least recently used (0, 1)
    assert_eq!(fetch(&[4, 5, 2, 3]), (4, 0));
    assert_eq!(fetch(&[0]), (0, 1));
}

#[test]
fn prefetched_experts_are_used_and_cancelled_ones_are_not_read() {
    let tmp = copy_fixture("k3-tiny-a");
    let m = open(tmp.path());
    let store = shard_store(&m, 1 << 20, 2, 2);
    store.prefetch(2, &[1, 2, 3]);
    let mut seen = Vec::new();
    fetch_each(&*store, 2, &[1, 2, 3, 4], |e, _| seen.push(e));
    seen.sort();
    assert_eq!(seen, vec![1, 2, 3, 4]);
    let r = store.report();
    assert_eq!(r.prefetch_issued, 3);
    assert_eq!(r.prefetch_used, 3, "all three predictions were needed");
    assert_eq!(r.drives[0].reads, 4, "no expert read twice");
    // Predictions for a layer that the real route rejects are dropped if not yet read.
    store.prefetch(4, &(0..16).collect::<Vec<u32>>());
    store.cancel_prefetch(4, &[7]);
    fetch_each(&*store, 4, &[7], |_, _| {});
    let r2 = store.report();
    assert!(r2.drives[0].reads - 4 < 1 + 16, "cancelled prefetches were not all read");
}

/// A shard store over a copy of the tiny fixture with eight cache slots and no guessing prefetch
/// (the temp dir must outlive it).
fn eight_slot_store() -> (tempfile::TempDir, Arc<ExpertStore>) {
    let tmp = copy_fixture("k3-tiny-a");
    let m = open(tmp.path());
    let slot = deltafin::store::expert_store::slot_size(m.cfg.expert_bytes()) as u64;
    let store = shard_store(&m, 8 * slot, 2, 0);
    (tmp, store)
}

/// Waits until drive 0 has completed `n` reads (reads ahead land in the background), then checks
/// that it did.
fn wait_for_reads(store: &ExpertStore, n: u64) {
    for _ in 0..1000 {
        if store.report().drives[0].reads >= n {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(store.report().drives[0].reads, n, "{n} reads landed");
}

#[test]
fn experts_read_ahead_for_a_large_batch_are_kept_until_their_layer_and_read_once() {
    // Eight cache slots and no guessing prefetch: read-ahead works without `--prefetch`.
    let (_tmp, store) = eight_slot_store();
    let next: Vec<u32> = (5..11).collect();
    store
        .fetch_then(1, &[0, 1, 2, 3], Some((2, &next)), &mut |_e: u32, _b: deltafin::store::Landed<'_>| {
            Ok(deltafin::store::Flow::Continue)
        })
        .unwrap();
    // Half the cache at most: 5, 6, 7, 8 (in the order given).
    assert_eq!(store.report().prefetch_issued, 4);
    // Let the reads ahead land first (on a loaded machine they may or may not have by now).
    wait_for_reads(&store, 8);
    // More of layer 1 before layer 2 comes: the experts read ahead are not what gets evicted.
    fetch_each(&*store, 1, &[11, 12, 13, 14, 15], |_, _| {});
    let before = store.report();
    let mut seen = Vec::new();
    fetch_each(&*store, 2, &[5, 6, 7, 8, 9], |e, _| seen.push(e));
    seen.sort();
    assert_eq!(seen, vec![5, 6, 7, 8, 9]);
    let r = store.report();
    assert_eq!(r.prefetch_used, 4, "every expert read ahead was used");
    // Read ahead is still read: misses for the cache's count, not hits.
    assert_eq!(r.cache_misses.unwrap() - before.cache_misses.unwrap(), 5);
    assert_eq!(r.cache_hits.unwrap() - before.cache_hits.unwrap(), 0);
    assert_eq!(r.drives[0].reads - before.drives[0].reads, 1, "only expert 9 read for layer 2");
    assert_eq!(r.drives[0].reads, 4 + 4 + 5 + 1, "no expert read twice");
}

#[test]
fn read_ahead_continues_layer_after_layer() {
    let (_tmp, store) = eight_slot_store();
    let land = |_e: u32, _b: deltafin::store::Landed<'_>| Ok(deltafin::store::Flow::Continue);
    store.fetch_then(1, &[0, 1], Some((2, &[5, 6, 7, 8][..])), &mut land.clone()).unwrap();
    // Layer 2 uses what was read ahead for it, and reads ahead for layer 3 as much again.
    store.fetch_then(2, &[5, 6, 7, 8], Some((3, &[1, 2, 3, 4][..])), &mut land.clone()).unwrap();
    fetch_each(&*store, 3, &[1, 2, 3, 4], |_, _| {});
    let r = store.report();
    assert_eq!((r.prefetch_issued, r.prefetch_used), (8, 8));
    assert_eq!(r.drives[0].reads, 2 + 4 + 4, "every expert read once");
}

#[test]
fn experts_read_ahead_but_not_demanded_lose_their_place_when_the_next_pass_begins() {
    let (_tmp, store) = eight_slot_store();
    let land = |_e: u32, _b: deltafin::store::Landed<'_>| Ok(deltafin::store::Flow::Continue);
    // Layer 1 reads 5..8 ahead for layer 2, which then asks for 5 alone: 6, 7, 8 were not needed.
    store.fetch_then(1, &[0, 1], Some((2, &[5, 6, 7, 8][..])), &mut land.clone()).unwrap();
    wait_for_reads(&store, 6);
    fetch_each(&*store, 2, &[5], |_, _| {});
    // The next pass (layer 1 again, as in a model of two MoE layers) reads ahead for layer 2
    // anew: the stale 6, 7, 8 no longer hold half of the cache against it.
    store.fetch_then(1, &[0, 1], Some((2, &[9, 10, 11, 12][..])), &mut land.clone()).unwrap();
    assert!(store.report().prefetch_issued > 5, "read-ahead still blocked by experts nobody asked for");
}
