//! Fault injection on real files: damaged bytes in every tensor class (an expert's packed values,
//! an expert's scales, a trunk matrix, a trunk vector), with and without a placement, through the
//! store and `--experts-from mmap`; `place` after a shard changed; zeros written into a shard
//! while `serve` answers; a shard cut short and restored under a running server. Each must give
//! a clear error (naming the file, and the layer and expert or the tensor) or the right answer —
//! never a different answer with exit 0 or a 200.

mod common;
use common::served::Served;
use common::*;
use deltafin::model::roster::{expert, layer, top};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

const PROMPT: [u32; 12] = [5, 17, 42, 99, 3, 250, 7, 7, 120, 64, 1, 300];

/// `deltafin run` on `dir` with `extra` flags: (success, stdout, stderr).
fn run(dir: &Path, extra: &[&str]) -> (bool, String, String) {
    let o = deltafin_cmd()
        .args(["run", "--model"])
        .arg(dir)
        .args(["--prompt-ids", &ids_arg(&PROMPT), "--max-new", "6", "--memory-gb", "2"])
        .args(extra)
        .output()
        .unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// The file and byte range of tensor `name` in the model at `dir`.
fn tensor_at(dir: &Path, name: &str) -> (PathBuf, u64, u64) {
    let ck = deltafin::model::Checkpoint::open(dir).unwrap();
    let e = ck.get(name).unwrap_or_else(|| panic!("no tensor {name}"));
    (ck.shard_path(e.shard).to_path_buf(), e.start, e.end)
}

/// XORs `mask` into the byte at `frac` of tensor `name`'s bytes (in place: the file keeps its inode).
fn flip(dir: &Path, name: &str, frac: f64, mask: u8) {
    flip_if(dir, name, frac, mask, |_, _| true);
}

/// [`flip`], only where the byte is not one the model fingerprint samples (a placement is bound
/// to the fingerprint; damage there is reported as damage, which the placement tests do not want).
fn flip_outside_fingerprint(dir: &Path, name: &str, frac: f64, mask: u8) -> bool {
    flip_if(dir, name, frac, mask, |len, at| {
        ![(0, 4096), (len / 2, len / 2 + 4096), (len.saturating_sub(4096), len)].iter().any(|&(a, b)| a <= at && at < b)
    })
}

fn flip_if(dir: &Path, name: &str, frac: f64, mask: u8, ok: impl Fn(u64, u64) -> bool) -> bool {
    use std::os::unix::fs::FileExt;
    let (path, a, z) = tensor_at(dir, name);
    let at = a + ((z - a - 1) as f64 * frac) as u64;
    if !ok(std::fs::metadata(&path).unwrap().len(), at) {
        return false;
    }
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ mask], at).unwrap();
    true
}

fn experts_of(dir: &Path) -> usize {
    let cfg = deltafin::model::K3Config::load(dir).unwrap();
    cfg.experts
}

/// The classes of tensors a damaged byte can hit, each as the names to damage (every expert of
/// layer 1 for the expert classes, so whichever the prompt routes to is hit) and what the error
/// must name.
fn classes(dir: &Path) -> Vec<(&'static str, Vec<String>, String)> {
    let n = experts_of(dir);
    let all = |proj: &str, part: &str| (0..n).map(|e| expert(1, e, proj, part)).collect::<Vec<_>>();
    vec![
        ("expert packed values", all("w2", "weight_packed"), "layer 1".into()),
        ("expert scales", all("w1", "weight_scale"), "layer 1".into()),
        ("trunk matrix", vec![layer(2, "self_attn.o_proj.weight")], layer(2, "self_attn.o_proj.weight")),
        ("trunk vector", vec![top("norm.weight")], top("norm.weight")),
    ]
}

#[test]
fn a_damaged_byte_in_any_tensor_is_an_error_naming_it_never_other_text() {
    let clean = copy_fixture("k3-tiny-a");
    let (ok, want, err) = run(clean.path(), &[]);
    assert!(ok, "{err}");
    for (class, names, named) in classes(clean.path()) {
        for from in [&[][..], &["--experts-from", "mmap"][..]] {
            let tmp = copy_fixture("k3-tiny-a");
            // The checksums are recorded from the intact files at first open.
            assert_eq!(run(tmp.path(), from).1, want);
            for n in &names {
                flip(tmp.path(), n, 0.37, 0x10);
            }
            let (ok, out, err) = run(tmp.path(), from);
            assert!(!ok, "{class} {from:?}: a damaged model answered {out:?}\n{err}");
            assert!(
                err.contains("checksum") && err.contains("safetensors") && err.contains(&named),
                "{class} {from:?}: {err}"
            );
            assert!(err.contains("deltafin verify"), "{class}: the error says what to do: {err}");
            // `deltafin verify` lists it and marks the shard damaged.
            let o = deltafin_cmd().args(["verify", "--model"]).arg(tmp.path()).output().unwrap();
            let verr = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(1), "{verr}");
            assert!(verr.contains(&names[0]) && verr.contains("damaged"), "{verr}");
        }
    }
}

#[test]
fn with_a_placement_the_other_copy_answers_and_the_trunk_has_none() {
    let clean = copy_fixture("k3-tiny-a");
    let (_, want, _) = run(clean.path(), &[]);
    for (class, names, named) in classes(clean.path()) {
        let tmp = copy_fixture("k3-tiny-a");
        let drive = tmp.path().join("d0");
        std::fs::create_dir_all(&drive).unwrap(); // place creates no drive directory
        run_ok(&mut place_cmd(tmp.path(), &drive));
        let mut flipped = 0;
        for n in &names {
            flipped += usize::from(flip_outside_fingerprint(tmp.path(), n, 0.61, 0x01));
        }
        assert!(flipped > 0);
        let (ok, out, err) = run(tmp.path(), &[]);
        if class.starts_with("expert") {
            // The shards' copies are damaged: the packs answer, the same text.
            assert!(ok && out == want, "{class}: {out:?} vs {want:?}\n{err}");
            assert!(!err.contains("re-run"), "{class}: not a stale placement: {err}");
        } else {
            assert!(!ok && err.contains("checksum") && err.contains(&named), "{class}: {out:?}\n{err}");
        }
    }
    // A damaged pack with intact shards: the shards (the fallback) answer, the same text.
    let tmp = copy_fixture("k3-tiny-a");
    let drive = tmp.path().join("d0");
    std::fs::create_dir_all(&drive).unwrap(); // place creates no drive directory
    run_ok(&mut place_cmd(tmp.path(), &drive));
    let packs: Vec<PathBuf> = walk(&drive).into_iter().filter(|p| p.extension().is_some_and(|x| x == "pack")).collect();
    assert!(!packs.is_empty());
    for p in &packs {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().read(true).write(true).open(p).unwrap();
        let len = f.metadata().unwrap().len();
        // Every record's middle (records are 4 KiB-aligned after a 4 KiB-aligned header).
        let mut at = 4096 + 100;
        while at < len {
            let mut b = [0u8; 1];
            f.read_exact_at(&mut b, at).unwrap();
            f.write_all_at(&[b[0] ^ 0x40], at).unwrap();
            at += 4096;
        }
    }
    let (ok, out, err) = run(tmp.path(), &[]);
    assert!(ok && out == want, "{out:?}\n{err}");
}

fn walk(d: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![d.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.path().is_dir() {
                stack.push(e.path());
            } else {
                out.push(e.path());
            }
        }
    }
    out.sort();
    out
}

#[test]
fn place_after_a_shard_changed_keeps_the_good_pack_and_never_copies_the_damage() {
    let tmp = copy_fixture("k3-tiny-a");
    let (_, want, _) = run(tmp.path(), &[]);
    let drive = tmp.path().join("d0");
    std::fs::create_dir_all(&drive).unwrap(); // place creates no drive directory
    let place = || place_cmd(tmp.path(), &drive).output().unwrap();
    assert!(place().status.success());
    let before: Vec<Vec<u8>> = walk(&drive).iter().map(|p| std::fs::read(p).unwrap()).collect();
    // Expert 0 of layer 1 is the one a run spot-checks against the manifest: damaged, it must read
    // as a damaged shard, not as another model's placement.
    let times: Vec<(PathBuf, std::time::SystemTime)> = shards(tmp.path())
        .into_iter()
        .map(|p| (p.clone(), std::fs::metadata(&p).unwrap().modified().unwrap()))
        .collect();
    for e in 0..experts_of(tmp.path()) {
        flip_outside_fingerprint(tmp.path(), &expert(1, e, "w1", "weight_scale"), 0.5, 0x08);
    }
    let o = place();
    let err = String::from_utf8_lossy(&o.stderr);
    // The shard changed since its checksums were recorded: place stops before writing, naming it.
    assert!(!o.status.success() && err.contains("checksum") && err.contains("weight_scale"), "{err}");
    let after: Vec<Vec<u8>> = walk(&drive).iter().map(|p| std::fs::read(p).unwrap()).collect();
    assert!(before == after, "a pack was rewritten from a damaged shard");
    let (ok, out, err) = run(tmp.path(), &[]);
    assert!(ok && out == want, "{out:?}\n{err}");
    // The same damage with the file's time put back (as bit rot leaves it): found per expert, the
    // good pack records kept, a warning, the placement still answers the same.
    for (p, t) in &times {
        std::fs::File::options().write(true).open(p).unwrap().set_modified(*t).unwrap();
    }
    let o = place();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.contains("damaged"), "{err}");
    let after: Vec<Vec<u8>> = walk(&drive).iter().map(|p| std::fs::read(p).unwrap()).collect();
    assert!(before == after, "a good pack was rewritten");
    let (ok, out, err) = run(tmp.path(), &[]);
    assert!(ok && out == want, "{out:?}\n{err}");
}

/// A running `deltafin serve` of the model in a directory (common::served, with its requests).
struct Server(Served);

impl Server {
    fn start(dir: &Path, extra: &[&str]) -> Server {
        let dir = dir.to_str().unwrap();
        let mut args = vec!["--model", dir, "--memory-gb", "2", "--model-name", "m"];
        args.extend_from_slice(extra);
        Server(Served::start(&args))
    }

    /// A greedy completion of `prompt`: (status, its text or the error message).
    fn complete(&self, prompt: &[u32], n: usize) -> (u16, String) {
        let body = serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0}).to_string();
        let (status, b) = self.0.post("/v1/completions", &body);
        let j: serde_json::Value = serde_json::from_str(&b).unwrap_or_default();
        let text = if status == 200 { j["choices"][0]["text"].to_string() } else { j["error"]["message"].to_string() };
        (status, text)
    }

    fn health(&self) -> serde_json::Value {
        serde_json::from_str(&self.0.get("/health").1).unwrap()
    }
}

impl std::ops::Deref for Server {
    type Target = Served;
    fn deref(&self) -> &Served {
        &self.0
    }
}

impl std::ops::DerefMut for Server {
    fn deref_mut(&mut self) -> &mut Served {
        &mut self.0
    }
}

/// `deltafin place` of the model in `model` onto the one drive directory `drive`.
fn place_cmd(model: &Path, drive: &Path) -> std::process::Command {
    let mut c = deltafin_cmd();
    c.args(["place", "--model"]).arg(model).arg("--drive").arg(format!("{}=1.0", drive.display()));
    c.args(["--probe-seconds", "0.1"]);
    c
}

fn prompts() -> Vec<Vec<u32>> {
    (0..6u32).map(|i| (0..8).map(|j| (i * 37 + j * 11 + 3) % 200 + 10).collect()).collect()
}

/// A small model with more experts than the store's read slots hold: without an expert cache
/// (and without the server's memo and reuse), every request reads experts.
fn many_experts(dir: &Path, seed: &str) {
    let mut c = deltafin_cmd();
    c.args(["synth", "--out"]).arg(dir).args(["--layers", "4", "--experts", "64", "--top-k", "4", "--seed", seed]);
    run_ok(&mut c);
}

/// The shards of the model in `dir`.
fn shards(dir: &Path) -> Vec<PathBuf> {
    walk(dir).into_iter().filter(|p| p.extension().is_some_and(|x| x == "safetensors")).collect()
}

#[test]
fn zeros_written_into_a_shard_while_serving_never_give_other_text() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    many_experts(&dir, "5");
    let s = Server::start(&dir, &["--parallel", "4", "--memo", "0", "--no-reuse", "--expert-cache-gb", "0"]);
    let ps = prompts();
    let want: Vec<(u16, String)> = ps.iter().map(|p| s.complete(p, 24)).collect();
    assert!(want.iter().all(|w| w.0 == 200), "{want:?}");
    // Requests in flight while the shards' middles are overwritten with zeros.
    let server = Arc::new(s);
    let handles: Vec<_> = ps
        .iter()
        .cloned()
        .map(|p| {
            let sv = Arc::clone(&server);
            std::thread::spawn(move || sv.complete(&p, 24))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(30));
    for p in shards(&dir) {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        let len = f.metadata().unwrap().len();
        f.write_all_at(&vec![0u8; (len / 2) as usize], len / 4).unwrap();
    }
    let mut got: Vec<(u16, String)> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    // And every prompt again, after.
    got.extend(ps.iter().map(|p| server.complete(p, 24)));
    let mut errors = 0;
    for (i, (status, text)) in got.iter().enumerate() {
        let w = &want[i % ps.len()];
        if *status == 200 {
            assert_eq!(text, &w.1, "request {i}: 200 with other text");
        } else {
            errors += 1;
            assert!(text.contains("checksum") || text.contains("holder"), "request {i}: {status} {text}");
        }
    }
    assert!(errors > 0, "no request read a damaged expert: the test reads nothing");
    assert_eq!(server.health()["status"], "degraded", "{}", server.health());
    let mut server = Arc::try_unwrap(server).ok().unwrap();
    assert!(server.alive(), "{}", server.log.lock().unwrap());
}

#[test]
fn a_shard_cut_short_and_restored_under_a_running_server_heals() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    many_experts(&dir, "9");
    let mut s = Server::start(&dir, &["--expert-cache-gb", "0", "--memo", "0", "--no-reuse"]);
    let ps: Vec<Vec<u32>> = (0..3u32).map(|i| (0..20).map(|j| 20 + i * 50 + j).collect()).collect();
    let want: Vec<(u16, String)> = ps.iter().map(|p| s.complete(p, 12)).collect();
    assert!(want.iter().all(|w| w.0 == 200), "{want:?}");
    let p = &ps[0];
    let want = want[0].clone();
    for restore_by_rename in [false, true] {
        let shard = shards(&dir).into_iter().max_by_key(|p| std::fs::metadata(p).unwrap().len()).unwrap();
        let bytes = std::fs::read(&shard).unwrap();
        // Cut short (the resident trunk is in memory: no SIGBUS), then restored half a second later.
        std::fs::OpenOptions::new().write(true).open(&shard).unwrap().set_len(0).unwrap();
        let mut failed = 0;
        for (i, q) in ps.iter().enumerate() {
            let during = s.complete(q, 12);
            if during.0 == 200 {
                assert_eq!(during, s.complete(q, 12), "prompt {i}: answers differ while the shard is empty");
            } else {
                failed += 1;
                assert!(during.1.contains("short read") || during.1.contains("holder"), "{during:?}");
            }
        }
        assert!(failed > 0, "every request was served from memory: the test reads nothing");
        assert_eq!(s.health()["status"], "degraded", "{}", s.health());
        std::thread::sleep(Duration::from_millis(500));
        if restore_by_rename {
            let tmpf = dir.join("restore.tmp");
            std::fs::write(&tmpf, &bytes).unwrap();
            std::fs::rename(&tmpf, &shard).unwrap();
        } else {
            std::fs::OpenOptions::new().write(true).open(&shard).unwrap().write_all(&bytes).unwrap();
        }
        // Healed within the longest backoff: the same text again, and /health says ok.
        let t0 = Instant::now();
        let got = loop {
            let r = s.complete(p, 12);
            if r.0 == 200 || t0.elapsed() > Duration::from_secs(30) {
                break r;
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        assert_eq!(got, want, "rename {restore_by_rename}: {}", s.log.lock().unwrap());
        for _ in 0..2 {
            assert_eq!(s.complete(p, 12), want);
        }
        let t0 = Instant::now();
        while s.health()["status"] != "ok" {
            assert!(t0.elapsed() < Duration::from_secs(30), "{}", s.health());
            std::thread::sleep(Duration::from_millis(200));
        }
        assert!(s.alive());
    }
}

#[test]
fn a_directory_recorded_in_the_background_is_checked_from_then_on() {
    use deltafin::store::{ExpertSource, Flow};
    let tmp = copy_fixture("k3-tiny-a");
    // A model never seen anywhere: its own config (else it is a copy of the fixture, checked
    // against a record kept for another copy).
    let cfg_path = tmp.path().join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    cfg["_test_never_seen"] = serde_json::json!(std::process::id());
    std::fs::write(&cfg_path, serde_json::to_vec(&cfg).unwrap()).unwrap();
    // As a large directory never seen: nothing recorded at open.
    let ck = Arc::new(deltafin::model::Checkpoint::open_with(tmp.path(), 0).unwrap());
    let v = ck.verification();
    assert!(!v.complete() && v.describe().contains("UNVERIFIED"), "{}", v.describe());
    let cfg = deltafin::model::K3Config::load(tmp.path()).unwrap();
    let roster = deltafin::model::Roster::build(&cfg, &ck).unwrap();
    // The source exists before the checksums do; it checks with them once they are recorded.
    let src = deltafin::store::ShardExperts::new(Arc::clone(&ck), &roster).unwrap();
    assert!(src.describe().contains("UNVERIFIED"), "{}", src.describe());
    ck.record_in_background();
    let t0 = Instant::now();
    while !ck.verification().complete() {
        assert!(t0.elapsed() < Duration::from_secs(60), "not recorded");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(tmp.path().join(".deltafin-checksums.json").exists());
    assert!(src.describe().contains("every byte checked"), "{}", src.describe());
    let ids: Vec<u32> = (0..cfg.experts as u32).collect();
    let mut n = 0;
    src.fetch(1, &ids, &mut |_, _| {
        n += 1;
        Ok(Flow::Continue)
    })
    .unwrap();
    assert_eq!(n, ids.len());
    for e in 0..cfg.experts {
        flip(tmp.path(), &expert(1, e, "w2", "weight_packed"), 0.8, 0x20);
    }
    let err = src.fetch(1, &ids, &mut |_, _| Ok(Flow::Continue)).unwrap_err().to_string();
    assert!(err.contains("checksum mismatch in w2.weight_packed") && err.contains("layer 1"), "{err}");
    // A later open finds the record and checks from the start.
    let again = deltafin::model::Checkpoint::open_with(tmp.path(), 0).unwrap();
    assert!(again.verification().complete());
}
