//! `deltafin place` end to end: measuring, writing, verifying, running from the placement, and the
//! failure cases a user meets (corrupt copy, full disk, bad arguments).

mod common;
use common::*;
use std::path::Path;
use std::process::Command;

/// Where drive `drive` of `model`'s placement keeps the pack of `layer`.
fn pack_path(model: &Path, drive: usize, layer: usize) -> std::path::PathBuf {
    deltafin::store::placement::Manifest::load(&model.join("placement.json")).unwrap().pack_path(drive, layer)
}

/// The directory of `model`'s packs on a drive: named by the model's fingerprint.
fn model_dir_on(model: &Path, drive: &Path) -> std::path::PathBuf {
    let ck = deltafin::model::Checkpoint::open(model).unwrap();
    drive.join(deltafin::model::fingerprint::short(&deltafin::model::fingerprint::fingerprint(&ck)))
}

fn place(model: &Path, args: &[&str]) -> Command {
    // `place` never creates a drive directory (an unmounted drive must not fill another disk):
    // the drives given here are made first, as a user would.
    for w in args.windows(2).filter(|w| w[0] == "--drive") {
        let _ = std::fs::create_dir_all(w[1].rsplit_once('=').map_or(w[1], |(p, _)| p));
    }
    let mut c = deltafin_cmd();
    c.args(["place", "--model"]).arg(model).args(["--probe-mb", "32", "--probe-seconds", "0.2"]).args(args);
    c
}

#[test]
fn place_measure_run_verify() {
    let tmp = copy_fixture("k3-tiny-a");
    let d0 = tmp.path().join("fast");
    let d1 = tmp.path().join("slow");
    let (_, err) =
        run_ok(&mut place(tmp.path(), &["--drive", d0.to_str().unwrap(), "--drive", &format!("{}=0.5", d1.display())]));
    assert!(err.contains("measuring") && err.contains("GB/s"), "{err}");
    assert!(err.contains("drive 1:") && err.contains("(given)"), "{err}");
    let r = reference("k3-tiny-a");
    let sj = tmp.path().join("stats.json");
    let (out, err) = run_ok(deltafin_cmd().args(["run", "--model"]).arg(tmp.path()).args([
        "--prompt-ids",
        &ids_arg(&r.prompt),
        "--max-new",
        "32",
        "--ignore-eos",
        "--stats",
        "--stats-json",
        sj.to_str().unwrap(),
        "-v",
    ]));
    assert_eq!(out.trim(), ids_arg(&r.greedy));
    assert!(err.contains("experts via store: 3 drive(s)"), "{err}");
    let j: serde_json::Value = serde_json::from_slice(&std::fs::read(&sj).unwrap()).unwrap();
    let drives = j["drives"].as_array().unwrap();
    assert_eq!(drives.len(), 3);
    for key in ["bytes_read", "reads", "read_ms_p50", "read_ms_p99", "read_ms_max", "lands_last"] {
        assert!(drives[0].get(key).is_some(), "{key} missing");
    }
    assert!(j["read_amplification"].as_f64().unwrap() > 0.0);
    assert!(j["cache_hits"].as_u64().is_some() && j["cache_misses"].as_u64().unwrap() > 0);
    run_ok(&mut place(tmp.path(), &["--verify"]));

    // Corrupt one record: verify names the drive, layer and expert and exits 1.
    let pack = pack_path(tmp.path(), 0, 2);
    let h = deltafin::store::pack::read_header(&pack).unwrap();
    let mut b = std::fs::read(&pack).unwrap();
    b[h.entries[0].offset as usize] ^= 1;
    std::fs::write(&pack, b).unwrap();
    let o = place(tmp.path(), &["--verify"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        err.contains(&format!("expert {} of layer 2", h.entries[0].expert))
            && err.contains("fast")
            && err.contains("checksum mismatch"),
        "{err}"
    );
    // Running still gives the right tokens: the corrupt copy is detected and another holder used.
    let (out, err) = run_ok(deltafin_cmd().args(["run", "--model"]).arg(tmp.path()).args([
        "--prompt-ids",
        &ids_arg(&r.prompt),
        "--max-new",
        "32",
        "--ignore-eos",
        "--expert-cache-gb",
        "0",
    ]));
    assert_eq!(out.trim(), ids_arg(&r.greedy));
    assert!(err.contains("checksum mismatch") && err.contains("avoided for a while"), "{err}");
}

#[test]
fn a_full_disk_is_a_clear_error_and_leaves_no_manifest() {
    let tmp = copy_fixture("k3-tiny-a");
    let mnt = tmp.path().join("small");
    std::fs::create_dir_all(&mnt).unwrap();
    // A real small file system: 256 KiB of tmpfs (each spread half needs ~180 KiB).
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=256k", "tmpfs"])
        .arg(&mnt)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        skipped("a_full_disk_is_a_clear_error_and_leaves_no_manifest", "cannot mount a tmpfs here (needs root)");
        return;
    }
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(self.0).status();
        }
    }
    let _guard = Unmount(&mnt);
    // Too big for one drive: refused before writing.
    let o = place(tmp.path(), &["--drive", &format!("{}/a=1", mnt.display()), "--policy", "mirror"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("free but this placement needs"), "{err}");
    // Two drives on the same small file system: each would fit alone, together they do not.
    let o = place(
        tmp.path(),
        &[
            "--drive",
            &format!("{}/a=1", mnt.display()),
            "--drive",
            &format!("{}/b=1", mnt.display()),
            "--policy",
            "spread",
        ],
    )
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("share a file system"), "{err}");
    assert!(!tmp.path().join("placement.json").exists(), "no manifest may point at incomplete data");
    assert!(walk(&mnt).iter().all(|p| !p.ends_with(".pack")), "nothing was written");
}

#[test]
fn a_disk_that_fills_up_while_writing_leaves_no_manifest() {
    // /dev/full fails every write with ENOSPC: the free-space check passes, the write does not.
    let tmp = copy_fixture("k3-tiny-a");
    let d = tmp.path().join("d");
    let ns = model_dir_on(tmp.path(), &d);
    std::fs::create_dir_all(&ns).unwrap();
    std::os::unix::fs::symlink("/dev/full", ns.join("L3.pack.partial")).unwrap();
    let o = place(tmp.path(), &["--drive", &format!("{}=1", d.display())]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("No space left on device") && err.contains("L3.pack.partial"), "{err}");
    assert!(!tmp.path().join("placement.json").exists(), "no manifest may point at incomplete data");
    assert!(!ns.join("L3.pack").exists() && !ns.join("L3.pack.partial").exists());
    // Packs completed before the failure are kept and reused by the next run.
    let (_, _) = run_ok(&mut place(tmp.path(), &["--drive", &format!("{}=1", d.display())]));
    assert!(tmp.path().join("placement.json").exists());
}

#[test]
fn the_same_directory_twice_is_refused() {
    let tmp = copy_fixture("k3-tiny-a");
    let d = tmp.path().join("d");
    let o =
        place(tmp.path(), &["--drive", &format!("{}=1", d.display()), "--drive", &format!("{}/../d=1", d.display())])
            .output()
            .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("given twice"));
}

#[test]
fn packs_of_another_model_are_not_reused() {
    // Place model A, then a model B of the same shape onto the same drive: B's packs must be B's bytes.
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, d) = (tmp.path().join("a"), tmp.path().join("b"), tmp.path().join("d"));
    for (dir, seed) in [(&a, "1"), (&b, "2")] {
        synth_small(dir, Some(seed));
    }
    run_ok(&mut place(&a, &["--drive", &format!("{}=1", d.display())]));
    run_ok(&mut place(&b, &["--drive", &format!("{}=1", d.display())]));
    run_ok(&mut place(&b, &["--verify"]));
}

fn walk(p: &Path) -> Vec<String> {
    let mut v = Vec::new();
    for e in std::fs::read_dir(p).unwrap().flatten() {
        if e.path().is_dir() {
            v.extend(walk(&e.path()));
        } else {
            v.push(e.path().display().to_string());
        }
    }
    v
}

#[test]
fn bad_place_arguments() {
    let tmp = copy_fixture("k3-tiny-a");
    let o = place(tmp.path(), &[]).output().unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("at least one --drive"));
    let x = tmp.path().join("x");
    let o = place(tmp.path(), &["--drive", &format!("{}=fast", x.display())]).output().unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("not a speed in GB/s"));
    let o = place(tmp.path(), &["--drive", &format!("{}=1", x.display()), "--policy", "hot"]).output().unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("needs --trace"));
    let o = place(tmp.path(), &["--verify"]).output().unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("placement.json"));
}

#[test]
fn hot_placement_from_a_recorded_trace() {
    let tmp = copy_fixture("k3-tiny-a");
    let r = reference("k3-tiny-a");
    let trace = tmp.path().join("routes.json");
    run_ok(
        deltafin_cmd()
            .args(["run", "--model"])
            .arg(tmp.path())
            .args(["--prompt-ids", &ids_arg(&r.prompt), "--max-new", "4", "--trace-routes"])
            .arg(&trace),
    );
    let (d0, d1) = (tmp.path().join("nvme"), tmp.path().join("sata"));
    run_ok(&mut place(
        tmp.path(),
        &[
            "--drive",
            &format!("{}=6", d0.display()),
            "--drive",
            &format!("{}=0.5", d1.display()),
            "--policy",
            "hot",
            "--trace",
            trace.to_str().unwrap(),
        ],
    ));
    let man: serde_json::Value =
        serde_json::from_slice(&std::fs::read(tmp.path().join("placement.json")).unwrap()).unwrap();
    let t: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    // The most-routed expert of each layer is on the fastest drive.
    for l in man["layers"].as_array().unwrap() {
        let layer = l["layer"].as_u64().unwrap().to_string();
        let counts: Vec<u64> = t["layers"][&layer].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
        let hottest = (0..counts.len()).max_by_key(|&e| (counts[e], std::cmp::Reverse(e))).unwrap();
        assert_eq!(l["experts"][hottest]["drives"], serde_json::json!([0]), "layer {layer}");
    }
    let (out, _) = run_ok(deltafin_cmd().args(["run", "--model"]).arg(tmp.path()).args([
        "--prompt-ids",
        &ids_arg(&r.prompt),
        "--max-new",
        "32",
        "--ignore-eos",
    ]));
    assert_eq!(out.trim(), ids_arg(&r.greedy));
}

#[test]
fn a_drive_that_does_not_exist_is_refused_never_created() {
    let tmp = copy_fixture("k3-tiny-a");
    // As an unmounted /mnt/nvme1 would be: its packs must not silently fill another disk.
    let missing = tmp.path().join("mnt/nvme1");
    let mut c = deltafin_cmd();
    c.args(["place", "--model"]).arg(tmp.path()).arg("--drive").arg(format!("{}=1", missing.display()));
    let o = c.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("no such directory (nothing is created)"), "{err}");
    assert!(err.contains("mount it first") && err.contains(&format!("mkdir -p {}", missing.display())), "{err}");
    assert!(!missing.exists() && !tmp.path().join("mnt").exists(), "a drive directory was created");
    assert!(!tmp.path().join("placement.json").exists());
    // A file is not a drive either.
    let file = tmp.path().join("afile");
    std::fs::write(&file, "x").unwrap();
    let mut c = deltafin_cmd();
    c.args(["place", "--model"]).arg(tmp.path()).arg("--drive").arg(format!("{}=1", file.display()));
    let err = String::from_utf8_lossy(&c.output().unwrap().stderr).into_owned();
    assert!(err.contains("not a directory"), "{err}");
    // An existing directory is placed on, as before.
    std::fs::create_dir_all(&missing).unwrap();
    let mut c = deltafin_cmd();
    c.args(["place", "--model"]).arg(tmp.path()).arg("--drive").arg(format!("{}=1", missing.display()));
    run_ok(&mut c);
    assert!(tmp.path().join("placement.json").exists());
}

#[test]
fn place_takes_the_demo() {
    let cache = tempfile::tempdir().unwrap();
    let d = cache.path().join("d0");
    std::fs::create_dir(&d).unwrap();
    let mut c = deltafin_cmd();
    c.env("DELTAFIN_CACHE", cache.path()).args(["place", "--demo", "--drive"]).arg(format!("{}=1", d.display()));
    let (_, err) = run_ok(&mut c);
    assert!(err.contains("deltafin place: wrote") && err.contains("placement.json"), "{err}");
    let mut c = deltafin_cmd();
    c.env("DELTAFIN_CACHE", cache.path()).args(["place", "--demo", "--verify"]);
    run_ok(&mut c);
}
