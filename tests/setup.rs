//! `deltafin setup` against a real HTTP server on 127.0.0.1 in the hub's layout (tests/common/hub.rs):
//! full installs with faults, kill -9 and resume, corrupted bytes, auth and 404 errors, a too-small
//! disk, the Hugging Face cache, the draft, and stream installs that give bit-identical output to
//! the full model and fetch nothing on their second run.

mod common;
#[path = "common/hub.rs"]
mod hub;

use common::{deltafin_cmd, ids_arg, run_ok, skipped, synth_small};
use hub::{FaultKind, HubServer};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
const REPO: &str = "org/tiny";
const TOKEN: &str = "hf_test_token";
const PROMPT: [u32; 6] = [5, 17, 42, 99, 3, 250];

/// A small synthetic model and a server holding it as `org/tiny`.
fn served(tmp: &Path) -> (HubServer, PathBuf) {
    let src = tmp.join("src");
    synth_small(&src, Some("7"));
    // A hub repo has no checksum sidecar (synth wrote one beside its model).
    let _ = std::fs::remove_file(src.join(".deltafin-checksums.json"));
    let s = HubServer::start();
    s.add_repo_dir(REPO, COMMIT, &src);
    (s, src)
}

fn setup(s: &HubServer, tmp: &Path) -> Command {
    let mut c = deltafin_cmd();
    c.arg("setup")
        .env("HF_ENDPOINT", &s.url)
        .env_remove("HF_TOKEN")
        .env_remove("HUGGING_FACE_HUB_TOKEN")
        .env("HF_HUB_CACHE", tmp.join("no-hf-cache"))
        .env("DELTAFIN_HUB_BACKOFF_MS", "5")
        .env("DELTAFIN_HUB_TIMEOUT_S", "5")
        .args(["--repo", REPO]);
    c
}

fn fail(c: &mut Command) -> String {
    let o = c.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(1), "expected failure; stderr:\n{err}");
    err
}

fn same_files(a: &Path, b: &Path) {
    for e in std::fs::read_dir(a).unwrap().flatten() {
        let n = e.file_name();
        // Each directory's own checksum records (their files' inodes and times differ).
        if e.path().is_file() && n != ".deltafin-checksums.json" {
            assert!(std::fs::read(e.path()).unwrap() == std::fs::read(b.join(&n)).unwrap(), "{n:?} differs");
        }
    }
}

/// Greedy ids and score logits (as bytes) of the model in `dir`, and the run's stderr.
fn outputs(dir: &Path, tmp: &Path, env: &[(&str, &str)]) -> (String, Vec<u8>) {
    let mut c = deltafin_cmd();
    c.args(["run", "--model"]).arg(dir).args(["--prompt-ids", &ids_arg(&PROMPT), "--max-new", "6", "--format", "json"]);
    c.args(["--memory-gb", "2"]);
    for (k, v) in env {
        c.env(k, v);
    }
    let (out, _) = run_ok(&mut c);
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    let logits = tmp.join(format!("logits-{}.safetensors", std::process::id() as u64 ^ dir.as_os_str().len() as u64));
    let mut c = deltafin_cmd();
    c.args(["score", "--model"])
        .arg(dir)
        .args(["--prompt-ids", &ids_arg(&PROMPT), "--memory-gb", "2", "--logits-out"])
        .arg(&logits);
    for (k, v) in env {
        c.env(k, v);
    }
    run_ok(&mut c);
    (j["output_ids"].to_string(), std::fs::read(&logits).unwrap())
}

#[test]
fn full_install_survives_faults_and_keeps_the_token_on_the_hub() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, src) = served(tmp.path());
    s.require_token(Some(TOKEN));
    // 500s, a dropped connection mid-file, wrong bytes, a slow body: all absorbed.
    s.fault("/resolve/", FaultKind::Status(500), 2);
    s.fault("/cdn/", FaultKind::Drop(20_000), 1);
    s.fault("/cdn/", FaultKind::Corrupt, 1);
    s.fault("tokenizer_config.json", FaultKind::Slow(Duration::from_millis(20)), 1);
    let dir = tmp.path().join("k3");
    let (out, err) = run_ok(setup(&s, tmp.path()).env("HF_TOKEN", TOKEN).arg("--dir").arg(&dir).arg("--json"));
    assert!(err.contains("choosing --full"), "{err}");
    assert!(err.contains(COMMIT), "{err}");
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(j["download"]["checksum_failures"].as_u64().unwrap() >= 1, "{j}");
    same_files(&src, &dir);
    assert!(!dir.join(".deltafin-partial").exists());
    let log = s.log();
    assert!(log.iter().any(|l| l.host == "cdn"), "large files are redirected");
    assert!(log.iter().filter(|l| l.host == "cdn").all(|l| l.auth.is_none()), "the token went to another origin");
    assert!(log.iter().filter(|l| l.host == "hub").all(|l| l.auth.as_deref() == Some("Bearer hf_test_token")));
    // Every file came from the resolved commit, none from the branch.
    assert!(log.iter().filter(|l| l.path.contains("/resolve/")).all(|l| l.path.contains(COMMIT)));
    // A rerun downloads nothing.
    s.clear_log();
    run_ok(setup(&s, tmp.path()).env("HF_TOKEN", TOKEN).arg("--full").arg("--dir").arg(&dir));
    assert!(s.file_requests().is_empty(), "{:?}", s.file_requests());
}

#[test]
fn auth_and_missing_things_give_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, _) = served(tmp.path());
    s.require_token(Some(TOKEN));
    let dir = tmp.path().join("k3");
    let err = fail(setup(&s, tmp.path()).arg("--full").arg("--dir").arg(&dir));
    assert!(err.contains("HTTP 401") && err.contains("HF_TOKEN") && err.contains("none is set"), "{err}");
    let err = fail(setup(&s, tmp.path()).env("HF_TOKEN", "wrong").arg("--full").arg("--dir").arg(&dir));
    assert!(err.contains("HTTP 403") && err.contains("with the HF_TOKEN given"), "{err}");
    s.require_token(None);
    let err = fail(setup(&s, tmp.path()).args(["--full", "--revision", "nope"]).arg("--dir").arg(&dir));
    assert!(err.contains("repo org/tiny at revision nope not found"), "{err}");
    // A file the listing names but the server lost: 404 naming repo, commit and file.
    let hub = deltafin::hub::Hub::new(&s.url, None, deltafin::hub::HubOptions::default());
    let info = hub.repo_info(REPO, "main").unwrap();
    let mut f = info.file("config.json").unwrap().clone();
    f.path = "missing.json".into();
    let e = hub.get_range(REPO, COMMIT, &f, 0, 1).unwrap_err().to_string();
    assert!(e.contains("file missing.json of repo org/tiny at commit 0123") && e.contains("404"), "{e}");
    // 5xx that never stop: the error says how often it tried.
    s.fault("config.json", FaultKind::Status(503), 100);
    let err = fail(setup(&s, tmp.path()).env("DELTAFIN_HUB_RETRIES", "2").arg("--full").arg("--dir").arg(&dir));
    assert!(err.contains("HTTP 503") && err.contains("after 3 tries"), "{err}");
    assert!(!dir.join("config.json").exists());
}

#[test]
fn a_killed_download_resumes_from_its_partial_file() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, src) = served(tmp.path());
    s.throttle(400_000);
    let dir = tmp.path().join("k3");
    let mut child = setup(&s, tmp.path())
        .args(["--full", "--workers", "2"])
        .arg("--dir")
        .arg(&dir)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let partial = dir.join(".deltafin-partial");
    let t0 = std::time::Instant::now();
    loop {
        let big = std::fs::read_dir(&partial)
            .map(|r| r.flatten().any(|e| e.metadata().is_ok_and(|m| m.len() > 300_000)))
            .unwrap_or(false);
        if big {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "no partial file appeared");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    // Nothing half-downloaded looks complete.
    let big_shard = "model-00001-of-00002.safetensors";
    assert!(!dir.join(big_shard).exists());
    s.throttle(0);
    s.clear_log();
    let (out, _) = run_ok(setup(&s, tmp.path()).args(["--full", "--json"]).arg("--dir").arg(&dir));
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(j["download"]["bytes_resumed"].as_u64().unwrap() > 300_000, "{j}");
    let resumed = s.file_requests().into_iter().any(|l| l.range.as_deref().is_some_and(|r| r != "bytes=0-"));
    assert!(resumed, "{:?}", s.file_requests());
    same_files(&src, &dir);
}

/// Mounts a tmpfs of `mb` MiB at `at`; None (with a message) where that is not allowed.
fn tmpfs(at: &Path, mb: u64) -> Option<Mount> {
    std::fs::create_dir_all(at).unwrap();
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={mb}m"), "tmpfs"])
        .arg(at)
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        skipped("a full-disk setup test", &format!("cannot mount a tmpfs at {} (needs root)", at.display()));
        return None;
    }
    Some(Mount(at.to_path_buf()))
}

struct Mount(PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn a_too_small_disk_is_a_clear_error_and_leaves_nothing_registered() {
    let tmp = tempfile::tempdir().unwrap();
    // Experts are 40% of this model: the full install (8.4 MiB) does not fit the 7 MiB disk, the
    // stream install (5.3 MiB) does.
    let src = tmp.path().join("src");
    run_ok(deltafin_cmd().args(["synth", "--out"]).arg(&src).args([
        "--layers",
        "3",
        "--experts",
        "64",
        "--top-k",
        "2",
    ]));
    let s = HubServer::start();
    s.add_repo_dir(REPO, COMMIT, &src);
    let Some(_m) = tmpfs(&tmp.path().join("small"), 7) else { return };
    let dir = tmp.path().join("small/k3");
    let err = fail(setup(&s, tmp.path()).arg("--full").arg("--dir").arg(&dir));
    assert!(err.contains("not enough free space") && err.contains("--stream"), "{err}");
    assert!(!dir.join("config.json").exists());
    // Past the up-front check, the disk fills mid-way: a clear error, nothing looks complete,
    // and a rerun on a larger disk resumes.
    let err =
        fail(setup(&s, tmp.path()).args(["--full", "--skip-space-check", "--workers", "1"]).arg("--dir").arg(&dir));
    assert!(err.contains("the disk is full") && err.contains("resumes"), "{err}");
    // Whatever has its final name is complete and verified.
    let mut complete = 0;
    for e in std::fs::read_dir(&dir).unwrap().flatten() {
        if e.path().is_file() && e.file_name() != ".deltafin-checksums.json" {
            assert!(std::fs::read(e.path()).unwrap() == std::fs::read(src.join(e.file_name())).unwrap());
            complete += 1;
        }
    }
    assert!(complete < 8, "everything fit?");
    std::fs::remove_dir_all(&dir).unwrap();
    // With neither flag, the small disk chooses stream and says why.
    let sdir = tmp.path().join("small/auto");
    let err = run_ok(setup(&s, tmp.path()).arg("--dir").arg(&sdir)).1;
    assert!(err.contains("choosing --stream"), "{err}");
    assert!(sdir.join("stream.json").exists());
    // Streamed experts onto a full drive: the run fails clearly and registers nothing.
    let _m2 = tmpfs(&tmp.path().join("tiny-drive"), 1);
    let drive = tmp.path().join("tiny-drive");
    let filler = drive.join("filler");
    let _ = std::fs::write(&filler, vec![1u8; 1 << 20]);
    let st = tmp.path().join("st");
    run_ok(setup(&s, tmp.path()).arg("--stream").arg("--dir").arg(&st).arg("--drive").arg(&drive));
    let o = deltafin_cmd()
        .args(["run", "--model"])
        .arg(&st)
        .args(["--prompt-ids", &ids_arg(&PROMPT), "--max-new", "2", "--memory-gb", "2"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("full"), "{err}");
    assert!(!st.join("stream-placement.json").exists());
    let mut stack = vec![drive.clone()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            assert!(!n.ends_with(".pack") && !n.ends_with(".partial"), "left behind: {n}");
            if e.path().is_dir() {
                stack.push(e.path());
            }
        }
    }
}

#[test]
fn stream_install_is_bit_identical_and_its_second_run_fetches_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, src) = served(tmp.path());
    let dir = tmp.path().join("st");
    let drive = tmp.path().join("drive");
    let (out, _) =
        run_ok(setup(&s, tmp.path()).args(["--stream", "--json"]).arg("--dir").arg(&dir).arg("--drive").arg(&drive));
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(j["stream"]["expert_bytes"].as_u64().unwrap() > 0, "{j}");
    // The expert bytes were not kept (each shard passed through whole once, to check its sha256
    // and record every tensor's checksum): far fewer bytes on disk than the shards.
    let shard_bytes: u64 = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        .iter()
        .map(|n| std::fs::metadata(src.join(n)).unwrap().len())
        .sum();
    assert!(j["stream"]["trunk_bytes"].as_u64().unwrap() < shard_bytes, "{j}");
    let (want_ids, want_logits) = outputs(&src, tmp.path(), &[]);
    // Faults on expert ranges: a wrong range, a dropped connection, a 500 — all asked again.
    s.clear_log();
    s.fault("/cdn/", FaultKind::WrongRange, 1);
    s.fault("/cdn/", FaultKind::Drop(100), 1);
    s.fault("/cdn/", FaultKind::Status(500), 1);
    let env = [("DELTAFIN_HUB_BACKOFF_MS", "5")];
    let (ids, logits) = outputs(&dir, tmp.path(), &env);
    assert_eq!(ids, want_ids);
    assert!(logits == want_logits, "stream-mode logits differ from the full model's");
    // What --stats shows of the first run: the hub as one more "drive".
    let o = deltafin_cmd()
        .args(["run", "--model"])
        .arg(&dir)
        .args(["--prompt-ids", &ids_arg(&PROMPT), "--max-new", "2", "--memory-gb", "2", "--stats"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.contains(&format!("{}/org/tiny@0123456789abcdef", s.url)), "{err}");
    assert!(!s.file_requests().is_empty());
    let reg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("stream-placement.json")).unwrap()).unwrap();
    assert!(!reg["packs"].as_array().unwrap().is_empty());
    // Second run: everything local.
    s.clear_log();
    let (ids, logits) = outputs(&dir, tmp.path(), &env);
    assert_eq!(ids, want_ids);
    assert!(logits == want_logits);
    assert!(s.file_requests().is_empty(), "second run fetched {:?}", s.file_requests());
    // `place` and mmap experts are refused on a stream install.
    let o = deltafin_cmd().args(["place", "--model"]).arg(&dir).arg("--drive").arg(&drive).output().unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("stream install"));

    // Prefetching a route trace recorded on the full model: the run after fetches nothing.
    let routes = tmp.path().join("routes.json");
    run_ok(
        deltafin_cmd()
            .args(["run", "--model"])
            .arg(&src)
            .args(["--prompt-ids", &ids_arg(&PROMPT), "--max-new", "6", "--memory-gb", "2", "--trace-routes"])
            .arg(&routes),
    );
    let dir2 = tmp.path().join("st2");
    run_ok(setup(&s, tmp.path()).arg("--stream").arg("--dir").arg(&dir2));
    let (out, _) =
        run_ok(setup(&s, tmp.path()).arg("--dir").arg(&dir2).arg("--fetch-routes").arg(&routes).arg("--json"));
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(j["fetched"].as_u64().unwrap() > 0, "{j}");
    s.clear_log();
    let (ids, _) = outputs(&dir2, tmp.path(), &env);
    assert_eq!(ids, want_ids);
    assert!(s.file_requests().is_empty(), "{:?}", s.file_requests());
}

/// The served repo in a Hugging Face cache at `tmp/hf`, as huggingface_hub lays it out (snapshot
/// entries are links into blobs/): (cache root, repo directory, snapshot, the repo's listing).
fn hf_cache(s: &HubServer, src: &Path, tmp: &Path) -> (PathBuf, PathBuf, PathBuf, deltafin::hub::RepoInfo) {
    let cache = tmp.join("hf");
    let repo = cache.join("models--org--tiny");
    let snap = repo.join("snapshots").join(COMMIT);
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), COMMIT).unwrap();
    let hub = deltafin::hub::Hub::new(&s.url, None, deltafin::hub::HubOptions::default());
    let info = hub.repo_info(REPO, "main").unwrap();
    for f in &info.files {
        let blob = repo.join("blobs").join(f.content_key());
        std::fs::copy(src.join(&f.path), &blob).unwrap();
        std::os::unix::fs::symlink(format!("../../blobs/{}", f.content_key()), snap.join(&f.path)).unwrap();
    }
    (cache, repo, snap, info)
}

#[test]
fn hugging_face_cache_is_reused_and_works_as_model() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, src) = served(tmp.path());
    let (cache, repo, snap, info) = hf_cache(&s, &src, tmp.path());
    let dir = tmp.path().join("k3");
    s.clear_log();
    let (out, _) =
        run_ok(setup(&s, tmp.path()).env("HF_HUB_CACHE", &cache).args(["--full", "--json"]).arg("--dir").arg(&dir));
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j["download"]["from_hf_cache"].as_u64().unwrap() as usize, info.files.len(), "{j}");
    assert!(s.file_requests().is_empty());
    same_files(&src, &dir);
    // A damaged cached blob is not trusted.
    let shard = "model-00002-of-00002.safetensors";
    let blob = repo.join("blobs").join(info.file(shard).unwrap().content_key());
    let mut b = std::fs::read(&blob).unwrap();
    b[1000] ^= 1;
    std::fs::write(&blob, &b).unwrap();
    let dir2 = tmp.path().join("k3b");
    run_ok(setup(&s, tmp.path()).env("HF_HUB_CACHE", &cache).arg("--full").arg("--dir").arg(&dir2));
    assert!(std::fs::read(dir2.join(shard)).unwrap() == std::fs::read(src.join(shard)).unwrap());
    b[1000] ^= 1;
    std::fs::write(&blob, &b).unwrap();
    // The snapshot directory itself is a model directory.
    assert_eq!(outputs(&snap, tmp.path(), &[]), outputs(&src, tmp.path(), &[]));
}

#[test]
fn draft_goes_into_dspark() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, _) = served(tmp.path());
    let cfg = br#"{"model_type": "k3_dspark", "architectures": ["K3DSparkModel"]}"#.to_vec();
    let st = vec![7u8; 200_000];
    s.add_repo(
        "Inferact/Kimi-K3-DSpark",
        "fedcba9876543210fedcba9876543210fedcba98",
        vec![
            ("config.json".into(), cfg.clone()),
            ("model.safetensors".into(), st.clone()),
            ("README.md".into(), b"x".to_vec()),
        ],
    );
    let dir = tmp.path().join("k3");
    run_ok(setup(&s, tmp.path()).args(["--stream", "--draft"]).arg("--dir").arg(&dir));
    assert_eq!(std::fs::read(dir.join("dspark/config.json")).unwrap(), cfg);
    assert!(std::fs::read(dir.join("dspark/model.safetensors")).unwrap() == st);
    assert!(!dir.join("dspark/README.md").exists());
}

#[test]
fn a_stalled_connection_times_out_and_the_file_resumes_mid_way() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, src) = served(tmp.path());
    // The first body of the big shard pauses 3 s after each 16 KiB piece; the client gives up
    // after 1 s without a byte and resumes with a Range from where it stopped.
    s.fault("/cdn/", FaultKind::Slow(Duration::from_secs(3)), 1);
    let dir = tmp.path().join("k3");
    let (out, _) = run_ok(
        setup(&s, tmp.path())
            .env("DELTAFIN_HUB_TIMEOUT_S", "1")
            .args(["--full", "--workers", "1", "--json"])
            .arg("--dir")
            .arg(&dir),
    );
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(j["download"]["bytes_resumed"].as_u64().unwrap() > 0, "{j}");
    let mid =
        s.file_requests().into_iter().any(|l| l.host == "cdn" && l.range.as_deref().is_some_and(|r| r != "bytes=0-"));
    assert!(mid, "{:?}", s.file_requests());
    same_files(&src, &dir);
}

#[test]
fn an_interrupted_stream_install_is_refused_then_resumed() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, src) = served(tmp.path());
    s.throttle(1_000_000);
    let dir = tmp.path().join("st");
    let mut child = setup(&s, tmp.path())
        .args(["--stream", "--workers", "1"])
        .arg("--dir")
        .arg(&dir)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while !std::fs::read_dir(&dir)
        .is_ok_and(|r| r.flatten().any(|e| e.file_name().to_string_lossy().ends_with(".partial")))
    {
        assert!(t0.elapsed() < Duration::from_secs(60), "no shard was started");
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    // Half-installed: refused, never read as a model with zero experts.
    let o = deltafin_cmd()
        .args(["run", "--model"])
        .arg(&dir)
        .args(["--prompt-ids", "1,2", "--max-new", "1", "--memory-gb", "2"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("did not finish") && err.contains("run it again"), "{err}");
    s.throttle(0);
    run_ok(setup(&s, tmp.path()).arg("--stream").arg("--dir").arg(&dir));
    let st: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("stream.json")).unwrap()).unwrap();
    assert_eq!(st["complete"], serde_json::json!(true));
    assert_eq!(outputs(&dir, tmp.path(), &[]), outputs(&src, tmp.path(), &[]));
}

#[test]
fn damaged_streamed_packs_are_caught() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, src) = served(tmp.path());
    let dir = tmp.path().join("st");
    run_ok(setup(&s, tmp.path()).arg("--stream").arg("--dir").arg(&dir));
    let want = outputs(&src, tmp.path(), &[]);
    assert_eq!(outputs(&dir, tmp.path(), &[]), want);
    let reg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("stream-placement.json")).unwrap()).unwrap();
    let packs: Vec<PathBuf> = std::fs::read_dir(
        std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .find(|e| e.path().join("stream").is_dir())
            .unwrap()
            .path()
            .join("stream"),
    )
    .unwrap()
    .flatten()
    .map(|e| e.path())
    .collect();
    assert_eq!(packs.len(), reg["packs"].as_array().unwrap().len());
    // A flipped payload byte: the record's xxh3 catches it on read, the run says where, and the
    // hub's copy serves instead (streamed again, checked): the same output.
    let p = &packs[0];
    let mut b = std::fs::read(p).unwrap();
    let n = b.len();
    b[n - 4096 - 100] ^= 0xff;
    std::fs::write(p, &b).unwrap();
    s.clear_log();
    let o = deltafin_cmd()
        .args(["run", "--model"])
        .arg(&dir)
        .args(["--prompt-ids", &ids_arg(&PROMPT), "--max-new", "6", "--memory-gb", "2"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.contains("checksum") && err.contains("streamed again"), "{err}");
    assert!(!s.file_requests().is_empty());
    assert_eq!(outputs(&dir, tmp.path(), &[]), want);
    // A damaged header: the pack is not used; its experts come from the hub or from the packs
    // they were streamed into again above. Output unchanged.
    b[n - 4096 - 100] ^= 0xff;
    b[100] ^= 0xff;
    std::fs::write(p, &b).unwrap();
    assert_eq!(outputs(&dir, tmp.path(), &[]), want);
}

#[test]
fn stream_mode_checks_every_byte_against_the_hubs_sha256_with_or_without_etags() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, src) = served(tmp.path());
    let want = outputs(&src, tmp.path(), &[]);
    // A server (or proxy) that sends no ETags: nothing in a response names the file's version.
    s.no_etags(true);
    // One shard body with a byte changed: its sha256 does not match, it is fetched again.
    s.fault("/cdn/", FaultKind::CorruptWhole, 1);
    let dir = tmp.path().join("st");
    run_ok(setup(&s, tmp.path()).arg("--stream").arg("--dir").arg(&dir));
    assert_eq!(outputs(&dir, tmp.path(), &[]), want);
    // Every try changed: a clear error naming the file; the shard never gets its final name.
    s.fault("/cdn/", FaultKind::CorruptWhole, 1000);
    let bad = tmp.path().join("bad");
    let err = fail(setup(&s, tmp.path()).arg("--stream").arg("--dir").arg(&bad));
    assert!(err.contains("sha256") && err.contains("safetensors"), "{err}");
    assert!(!std::fs::read_dir(&bad).unwrap().flatten().any(|e| {
        let n = e.file_name().to_string_lossy().into_owned();
        n.ends_with(".safetensors") && !n.ends_with(".partial")
    }));
    s.clear_faults();
    // Streamed expert ranges with a changed byte, no ETag: caught against the checksums recorded at
    // setup, asked again: the same output.
    let dir2 = tmp.path().join("st2");
    run_ok(setup(&s, tmp.path()).arg("--stream").arg("--dir").arg(&dir2));
    s.fault("/cdn/", FaultKind::Corrupt, 1);
    assert_eq!(outputs(&dir2, tmp.path(), &[("DELTAFIN_HUB_BACKOFF_MS", "5")]), want);
    // Always changed: the run fails naming the expert, never another answer.
    let dir3 = tmp.path().join("st3");
    s.clear_faults();
    run_ok(setup(&s, tmp.path()).arg("--stream").arg("--dir").arg(&dir3));
    s.fault("/cdn/", FaultKind::Corrupt, 100_000);
    let o = deltafin_cmd()
        .args(["run", "--model"])
        .arg(&dir3)
        .args(["--prompt-ids", &ids_arg(&PROMPT), "--max-new", "6", "--memory-gb", "2"])
        .env("DELTAFIN_HUB_BACKOFF_MS", "5")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("not the model's") && err.contains("of layer"), "{err}");
}

#[test]
fn an_unreachable_hub_or_a_bad_endpoint_fails_fast_and_says_what_to_check() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("k3");
    let go = |endpoint: &str| {
        let mut c = deltafin_cmd();
        c.arg("setup").env("HF_ENDPOINT", endpoint).env_remove("HF_HUB_OFFLINE").env("DELTAFIN_HUB_BACKOFF_MS", "5");
        c.args(["--repo", REPO, "--full", "--dir"]).arg(&dir);
        fail(&mut c)
    };
    // Connection refused: one retry, not six with backoff.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let err = go(&format!("http://127.0.0.1:{port}"));
    assert!(err.contains("cannot reach the hub") && err.contains("(after 2 tries)"), "{err}");
    assert!(err.contains("HF_ENDPOINT") && err.contains("HF_HUB_OFFLINE=1"), "{err}");
    assert_eq!(err.matches("retrying in").count(), 1, "each retry announced, once:\n{err}");
    // A name that does not resolve (RFC 6761's .invalid).
    let err = go("http://hub.invalid");
    assert!(err.contains("cannot reach the hub") && err.contains("does not resolve"), "{err}");
    // Not a URL at all: final at once, nothing retried.
    for (bad, says) in [
        ("ftp://example.org", "scheme \"ftp\" is not http or https"),
        ("huggingface.co", "no scheme"),
        ("http://:80", "no host"),
        ("http://h:99999", "port"),
    ] {
        let err = go(bad);
        assert!(err.contains(&format!("HF_ENDPOINT {bad:?} is not a hub URL")) && err.contains(says), "{bad}: {err}");
        assert!(!err.contains("retrying"), "{err}");
    }
    assert!(!dir.join("config.json").exists());
}

#[test]
fn a_4xx_answer_is_final() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, _) = served(tmp.path());
    let dir = tmp.path().join("k3");
    s.fault("config.json", FaultKind::Status(410), 100);
    s.clear_log();
    let err = fail(setup(&s, tmp.path()).arg("--full").arg("--dir").arg(&dir));
    assert!(err.contains("HTTP 410") && !err.contains("tries") && !err.contains("retrying"), "{err}");
    let asked = s.log().iter().filter(|l| l.path.ends_with("/config.json")).count();
    assert_eq!(asked, 1, "asked once: {:?}", s.log());
}

#[test]
fn hf_hub_offline_installs_from_the_cache_alone_or_names_what_is_missing() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, src) = served(tmp.path());
    let (cache, repo, _, info) = hf_cache(&s, &src, tmp.path());
    let offline = |cache: &Path| {
        let mut c = setup(&s, tmp.path());
        c.env("HF_HUB_OFFLINE", "1").env("HF_HUB_CACHE", cache);
        c
    };
    s.clear_log();
    let dir = tmp.path().join("k3");
    let (_, err) = run_ok(offline(&cache).arg("--dir").arg(&dir));
    assert!(err.contains("HF_HUB_OFFLINE is set: installing from the Hugging Face cache only"), "{err}");
    assert!(s.log().is_empty(), "offline, yet the hub was asked: {:?}", s.log());
    same_files(&src, &dir);
    // --stream needs the hub.
    let err = fail(offline(&cache).arg("--stream").arg("--dir").arg(tmp.path().join("st")));
    assert!(err.contains("--stream fetches routed experts from the hub") && err.contains("HF_HUB_OFFLINE"), "{err}");
    // Not in the cache: the repo, or one of its files.
    let err = fail(offline(&tmp.path().join("empty")).arg("--dir").arg(tmp.path().join("k3b")));
    assert!(
        err.contains("HF_HUB_OFFLINE is set, and repo org/tiny at revision main is not in the Hugging Face cache"),
        "{err}"
    );
    let shard = "model-00002-of-00002.safetensors";
    std::fs::remove_file(repo.join("blobs").join(info.file(shard).unwrap().content_key())).unwrap();
    let err = fail(offline(&cache).arg("--dir").arg(tmp.path().join("k3c")));
    assert!(
        err.contains(shard) && err.contains("is not in the Hugging Face cache") && err.contains("unset HF_HUB_OFFLINE"),
        "{err}"
    );
    assert!(s.log().is_empty(), "{:?}", s.log());
}
