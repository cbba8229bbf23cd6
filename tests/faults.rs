//! Injected store faults (EIO, short reads) take the real failover and error paths: the same output
//! from another holder, or a clear error that leaves the session as it was — never a wrong output.

mod common;
use common::*;
use deltafin::store::expert_store::{ExpertStore, FaultKind, FaultPlan};
use deltafin::store::io::reader::ReaderKind;
use deltafin::store::placement::{Manifest, Policy, ShardUse};
use std::path::PathBuf;
use std::sync::Arc;

fn do_place(m: &Model, drives: &[PathBuf], policy: Policy, shards: ShardUse) -> Manifest {
    place_model(m, drives, |_| 1.0, policy, shards, None)
}

fn open_store(m: &Model, man: &Manifest, reader: ReaderKind) -> Arc<ExpertStore> {
    manifest_store(m, man, 0, reader, 0)
}

fn generate(
    e: &Arc<deltafin::engine::Engine>,
    prompt: &[u32],
) -> Result<(Vec<u32>, Vec<u32>), deltafin::k3::ForwardError> {
    let mut s = e.new_session();
    let mut all = bits(s.prefill(prompt)?);
    let mut toks = Vec::new();
    for _ in 0..4 {
        let t = deltafin::k3::argmax(s.logits().unwrap());
        toks.push(t);
        all.extend(bits(s.step(t)?));
    }
    Ok((toks, all))
}

#[test]
fn eio_and_short_reads_fail_over_to_another_copy_with_identical_output() {
    let r = reference("k3-tiny-a");
    let prompt = &r.prompt[..40];
    for (kind, why) in [(FaultKind::Eio, "I/O error"), (FaultKind::Short, "short read")] {
        for &reader in readers() {
            let tmp = copy_fixture("k3-tiny-a");
            let m = open_model(tmp.path());
            let want = generate(&engine(tmp.path()), prompt).unwrap();
            let drives = drive_dirs(tmp.path(), 2);
            let man = do_place(&m, &drives, Policy::Mirror, ShardUse::Off);
            let store = open_store(&m, &man, reader);
            // Both drives fail once after a few reads; each failure moves its reads to the other.
            store.inject_fault(FaultPlan { drive: 0, kind, skip: 3, times: 1 });
            let got = generate(&engine_with(tmp.path(), store.clone()), prompt).unwrap();
            assert_eq!(got, want, "{kind:?} {reader:?}: output changed after failover");
            let rep = store.report();
            assert!(rep.drives[0].failures >= 1, "{kind:?}: {:?}", rep.drives[0]);
            assert!(rep.drives[0].last_failure.as_deref().is_some_and(|w| w.contains(why)), "{:?}", rep.drives[0]);
        }
    }
}

#[test]
fn eio_with_no_other_copy_is_a_clear_error_and_the_session_is_unchanged() {
    let tmp = copy_fixture("k3-tiny-a");
    let m = open_model(tmp.path());
    let r = reference("k3-tiny-a");
    let drives = vec![tmp.path().join("d0")];
    let man = do_place(&m, &drives, Policy::Spread, ShardUse::Off);
    for &reader in readers() {
        let store = open_store(&m, &man, reader);
        let e = engine_with(tmp.path(), store.clone());
        let mut s = e.new_session();
        s.prefill(&r.prompt[..30]).unwrap();
        let (pos, logits) = (s.pos(), bits(s.logits().unwrap()));
        store.inject_fault(FaultPlan { drive: 0, kind: FaultKind::Eio, skip: 0, times: 1 });
        let err = s.step(deltafin::k3::argmax(s.logits().unwrap())).unwrap_err().to_string();
        assert!(err.contains("no holder left") || err.contains("no usable holder"), "{reader:?}: {err}");
        assert!(err.contains("I/O error") || err.contains("d0"), "{reader:?}: {err}");
        assert_eq!(s.pos(), pos);
        assert_eq!(bits(s.logits().unwrap()), logits);
    }
}
