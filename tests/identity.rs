//! A placement belongs to one model, tried as a careless user would: placement.json copied from
//! another model of the same shape, two models placed on one drive, a pack rewritten by another
//! model or with a flipped byte, two `place` runs at once, a route trace of another model, files
//! of an older deltafin. The real binary on real files throughout.

mod common;
use common::*;
use deltafin::model::fingerprint;
use deltafin::store::placement::Manifest;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Two random-weight models of the same shape (different seeds) and a drive directory.
fn two_models() -> (tempfile::TempDir, PathBuf, PathBuf, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, d) = (tmp.path().join("a"), tmp.path().join("b"), tmp.path().join("drive"));
    for (dir, seed) in [(&a, "1"), (&b, "2")] {
        synth_small(dir, Some(seed));
    }
    (tmp, a, b, d)
}

fn place(model: &Path, args: &[&str]) -> Command {
    // `place` never creates a drive directory (an unmounted drive must not fill another disk):
    // the drives given here are made first, as a user would.
    for w in args.windows(2).filter(|w| w[0] == "--drive") {
        let _ = std::fs::create_dir_all(w[1].rsplit_once('=').map_or(w[1], |(p, _)| p));
    }
    let mut c = deltafin_cmd();
    c.args(["place", "--model"]).arg(model).args(args);
    c
}

fn drive(d: &Path) -> String {
    format!("{}=1", d.display())
}

fn fp(model: &Path) -> String {
    fingerprint::fingerprint(&deltafin::model::Checkpoint::open(model).unwrap())
}

fn run(model: &Path, extra: &[&str]) -> Command {
    let mut c = deltafin_cmd();
    c.args(["run", "--model"])
        .arg(model)
        .args(["--prompt-ids", "5,6,7,8", "--max-new", "6", "--ignore-eos"])
        .args(extra);
    c
}

/// Output tokens read from the mapped shards (no placement involved).
fn reference_tokens(model: &Path) -> String {
    run_ok(&mut run(model, &["--experts-from", "mmap"])).0
}

fn fails(c: &mut Command, needles: &[&str]) -> String {
    let o = c.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(1), "expected exit code 1:\n{err}");
    assert!(!err.contains("panicked"), "{err}");
    for n in needles {
        assert!(err.contains(n), "stderr should mention `{n}`:\n{err}");
    }
    err
}

#[test]
fn run_refuses_a_placement_copied_from_another_model() {
    let (_tmp, a, b, d) = two_models();
    run_ok(&mut place(&b, &["--drive", &drive(&d)]));
    std::fs::copy(b.join("placement.json"), a.join("placement.json")).unwrap();
    let (fa, fb) = (fp(&a), fp(&b));
    assert_ne!(fa, fb);
    let err = fails(
        &mut run(&a, &[]),
        &[
            "belongs to another model",
            fingerprint::short(&fa),
            fingerprint::short(&fb),
            "placement.json",
            "deltafin place",
        ],
    );
    assert!(err.contains(&a.join("placement.json").display().to_string()), "{err}");
    // The same through --placement, and for place --verify.
    fails(&mut run(&a, &["--placement", b.join("placement.json").to_str().unwrap()]), &["belongs to another model"]);
    fails(&mut place(&a, &["--verify"]), &["belongs to another model"]);
}

#[test]
fn two_models_on_one_drive_keep_their_own_packs() {
    let (_tmp, a, b, d) = two_models();
    run_ok(&mut place(&a, &["--drive", &drive(&d)]));
    run_ok(&mut place(&b, &["--drive", &drive(&d)]));
    // Each model has its own directory on the drive, named by its fingerprint.
    for m in [&a, &b] {
        assert!(d.join(fingerprint::short(&fp(m))).join("L1.pack").is_file());
    }
    // Placing B did not touch A's copies: A still verifies and runs as from its shards.
    run_ok(&mut place(&a, &["--verify"]));
    run_ok(&mut place(&b, &["--verify"]));
    for m in [&a, &b] {
        let (out, err) = run_ok(&mut run(m, &["--expert-cache-gb", "0", "-v"]));
        assert!(err.contains("experts via store: 2 drive(s)"), "{err}");
        assert_eq!(out, reference_tokens(m));
    }
}

#[test]
fn rerunning_place_repairs_a_flipped_byte_and_another_models_pack() {
    let (_tmp, a, b, d) = two_models();
    run_ok(&mut place(&a, &["--drive", &drive(&d)]));
    run_ok(&mut place(&b, &["--drive", &drive(&d)]));
    let ma = Manifest::load(&a.join("placement.json")).unwrap();
    let mb = Manifest::load(&b.join("placement.json")).unwrap();
    // A flipped data byte (the recorded checksums still match each other; the data does not).
    let p = ma.pack_path(0, 1);
    let h = deltafin::store::pack::read_header(&p).unwrap();
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[h.entries[3].offset as usize + 100] ^= 0x20;
    std::fs::write(&p, &bytes).unwrap();
    // Another model's pack where A's should be (as an old, un-namespaced layout allowed).
    std::fs::copy(mb.pack_path(0, 2), ma.pack_path(0, 2)).unwrap();
    fails(&mut place(&a, &["--verify"]), &["checksum mismatch"]);
    let (_, err) = run_ok(&mut place(&a, &["--drive", &drive(&d)]));
    assert!(err.contains("differ from the shards") && err.contains("rewriting"), "{err}");
    run_ok(&mut place(&a, &["--verify"]));
    assert_eq!(run_ok(&mut run(&a, &["--expert-cache-gb", "0"])).0, reference_tokens(&a));
}

#[test]
fn a_resumed_place_rechecks_the_packs_it_reuses() {
    let (_tmp, a, b, d) = two_models();
    run_ok(&mut place(&b, &["--drive", &drive(&d)]));
    // Interrupt A's place after its layer-1 pack: layer 2's write hits a full device.
    let ns = d.join(fingerprint::short(&fp(&a)));
    std::fs::create_dir_all(&ns).unwrap();
    std::os::unix::fs::symlink("/dev/full", ns.join("L2.pack.partial")).unwrap();
    fails(&mut place(&a, &["--drive", &drive(&d)]), &["No space left on device"]);
    assert!(a.join(".placement-plan.json").exists() && ns.join("L1.pack").exists());
    let _ = std::fs::remove_file(ns.join("L2.pack.partial"));
    // Meanwhile B's bytes landed in A's finished pack (same shape, so the same record layout).
    let mb = Manifest::load(&b.join("placement.json")).unwrap();
    std::fs::copy(mb.pack_path(0, 1), ns.join("L1.pack")).unwrap();
    let (_, err) = run_ok(&mut place(&a, &["--drive", &drive(&d)]));
    assert!(err.contains("rewriting"), "{err}");
    run_ok(&mut place(&a, &["--verify"]));
    assert_eq!(run_ok(&mut run(&a, &["--expert-cache-gb", "0"])).0, reference_tokens(&a));
}

#[test]
fn one_place_at_a_time() {
    let (_tmp, a, _b, d) = two_models();
    // Hold the model directory's lock as a running `place` would.
    let lock = std::fs::File::create(a.join(".place.lock")).unwrap();
    lock.lock().unwrap();
    fails(&mut place(&a, &["--drive", &drive(&d)]), &["another `deltafin place` is running", ".place.lock"]);
    assert!(!a.join("placement.json").exists());
    drop(lock);
    // Two started together: one wins, the other fails clearly (or, if the first is already done,
    // both succeed); never a mixed result.
    let kids: Vec<_> = (0..2)
        .map(|_| place(&a, &["--drive", &drive(&d)]).stderr(std::process::Stdio::piped()).spawn().unwrap())
        .collect();
    for k in kids {
        let o = k.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success() || err.contains("another `deltafin place` is running"), "{err}");
    }
    run_ok(&mut place(&a, &["--verify"]));
}

#[test]
fn hot_placement_refuses_a_trace_of_another_model() {
    let (tmp, a, b, d) = two_models();
    let trace = tmp.path().join("routes-b.json");
    run_ok(&mut run(&b, &["--trace-routes", trace.to_str().unwrap()]));
    let t: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    assert_eq!(t["model"].as_str().unwrap(), fp(&b));
    let hot = |t: &Path| {
        let mut c = place(&a, &["--drive", &drive(&d), "--drive", &drive(&tmp.path().join("d2")), "--policy", "hot"]);
        c.arg("--trace").arg(t);
        c
    };
    fails(&mut hot(&trace), &["routes-b.json", "routes were recorded on", fingerprint::short(&fp(&b))]);
    // A trace that does not say its model (an older deltafin's) is refused too.
    let mut old = t.clone();
    old.as_object_mut().unwrap().remove("model");
    let old_path = tmp.path().join("old.json");
    std::fs::write(&old_path, serde_json::to_vec(&old).unwrap()).unwrap();
    fails(&mut hot(&old_path), &["does not say which model"]);
    // A's own trace works.
    let ta = tmp.path().join("routes-a.json");
    run_ok(&mut run(&a, &["--trace-routes", ta.to_str().unwrap()]));
    run_ok(&mut hot(&ta));
}

#[test]
fn older_or_edited_files_ask_for_a_new_place() {
    let (_tmp, a, _b, d) = two_models();
    run_ok(&mut place(&a, &["--drive", &drive(&d)]));
    let path = a.join("placement.json");
    let good = std::fs::read(&path).unwrap();
    let edit = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut v: serde_json::Value = serde_json::from_slice(&good).unwrap();
        f(&mut v);
        std::fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    };
    // A version 1 manifest (no fingerprint).
    edit(&|v| {
        v["version"] = 1.into();
        v.as_object_mut().unwrap().remove("model");
    });
    fails(&mut run(&a, &[]), &["older deltafin", "re-run `deltafin place`"]);
    // A changed checksum is caught by the digest; with the digest recomputed, by the spot check.
    edit(&|v| v["layers"][0]["experts"][0]["xxh3"] = "0123456789abcdef".into());
    fails(&mut run(&a, &[]), &["experts_sha256"]);
    let mut m = Manifest::load(&{
        std::fs::write(&path, &good).unwrap();
        path.clone()
    })
    .unwrap();
    m.layers[0].experts[0].xxh3 = "0123456789abcdef".into();
    m.model.experts_sha256 = m.experts_digest();
    std::fs::write(&path, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    fails(&mut run(&a, &[]), &["is not the shards'"]);
    // A namespace that would leave the drive directory.
    edit(&|v| v["namespace"] = "../../etc".into());
    fails(&mut run(&a, &[]), &["namespace"]);
    // A version 1 pack: the run warns and reads the shards; verify names it.
    std::fs::write(&path, &good).unwrap();
    let m = Manifest::load(&path).unwrap();
    let p = m.pack_path(0, 1);
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[8] = 1;
    std::fs::write(&p, &bytes).unwrap();
    fails(&mut place(&a, &["--verify"]), &["pack version 1", "re-run `deltafin place`"]);
    let (out, err) = run_ok(&mut run(&a, &[]));
    assert!(err.contains("pack version 1"), "{err}");
    assert_eq!(out, reference_tokens(&a));
}

#[test]
fn stale_temps_of_an_interrupted_place_are_removed() {
    let (_tmp, a, _b, d) = two_models();
    let stale = a.join(".placement-plan.json.tmp.4300000");
    let live = a.join(format!(".placement.json.tmp.{}", std::process::id()));
    std::fs::write(&stale, b"{").unwrap();
    std::fs::write(&live, b"{").unwrap();
    let ns = d.join(fingerprint::short(&fp(&a)));
    std::fs::create_dir_all(&ns).unwrap();
    std::fs::write(ns.join("L2.pack.partial"), b"half").unwrap();
    let (_, err) = run_ok(&mut place(&a, &["--drive", &drive(&d)]));
    assert!(err.contains("left by an interrupted place"), "{err}");
    assert!(!stale.exists() && live.exists(), "only the dead process's temp goes");
    assert!(!ns.join("L2.pack.partial").exists());
}

#[test]
fn the_fingerprint_follows_the_bytes_not_the_path() {
    let (_tmp, a, b, _d) = two_models();
    // A copy elsewhere is the same model (its placement stays valid after a move).
    let copy = copy_fixture("k3-tiny-a");
    assert_eq!(fp(copy.path()), fp(&fixture("k3-tiny-a")));
    assert_ne!(fp(&a), fp(&b), "same headers, different weights");
    // One byte in a sampled window (the middle of a shard) changes it.
    let shard = std::fs::read_dir(copy.path())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .unwrap();
    let before = fp(copy.path());
    let mut bytes = std::fs::read(&shard).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 1;
    std::fs::write(&shard, &bytes).unwrap();
    assert_ne!(fp(copy.path()), before);
}
