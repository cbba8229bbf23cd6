//! Never silent, second pass: what a hostile or careless user did to the files around a model,
//! each answered by an error that names the file (or a correct answer), never a different answer
//! with exit 0. Checksums that survive a copy without their record and a damaged or emptied
//! record, a header change beside data damage, changed config and tokenizer files, a shard a
//! verify marked damaged; session files used by two processes at once, planted links, FIFOs where
//! files belong, forged state files; `serve --parallel N --state-dir`; `batch --out /dev/stdout`.

mod common;
use common::*;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

const PROMPT: [u32; 12] = [5, 17, 42, 99, 3, 250, 7, 7, 120, 64, 1, 300];

thread_local! {
    /// This test's own deltafin cache (each test runs on a thread of its own).
    static CACHE: std::cell::RefCell<Option<tempfile::TempDir>> = const { std::cell::RefCell::new(None) };
}

/// `deltafin` with a cache of this test's own: the second copy of a checksum record lives there,
/// and tests must not see each other's models (all copies of one fixture share a layout).
fn cmd(_dir: &Path) -> std::process::Command {
    let mut c = deltafin_cmd();
    CACHE.with(|x| {
        let mut x = x.borrow_mut();
        let cache = x.get_or_insert_with(|| tempfile::tempdir().unwrap());
        c.env("DELTAFIN_CACHE", cache.path());
    });
    c
}

/// `deltafin run` on `dir`: (success, stdout, stderr).
fn run(dir: &Path, extra: &[&str]) -> (bool, String, String) {
    let o = cmd(dir)
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

/// XORs a bit into one byte of every routed expert scale of layer 1 (whichever the prompt routes
/// to is hit), in place, reading the shards' headers directly.
fn damage_expert_scales(dir: &Path) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let path = e.path();
        if !e.file_name().to_string_lossy().starts_with("model-") {
            continue;
        }
        let mut b = std::fs::read(&path).unwrap();
        let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        let h: serde_json::Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
        let mut hit = false;
        for (name, t) in h.as_object().unwrap() {
            if name.contains(".layers.1.block_sparse_moe.experts.") && name.ends_with("w1.weight_scale") {
                let (s, e) =
                    (t["data_offsets"][0].as_u64().unwrap() as usize, t["data_offsets"][1].as_u64().unwrap() as usize);
                b[8 + n + s + (e - s) / 3] ^= 0x10;
                hit = true;
            }
        }
        if hit {
            std::fs::write(&path, b).unwrap();
        }
    }
}

/// A copy of `src`'s files (not its hidden ones: `cp dir/*`) in a new directory.
fn copy_visible(src: &Path) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        let n = e.file_name().to_string_lossy().into_owned();
        if !n.starts_with('.') && e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), tmp.path().join(&n)).unwrap();
        }
    }
    tmp
}

fn refused(what: &str, r: (bool, String, String), needles: &[&str]) {
    let (ok, out, err) = r;
    assert!(!ok, "{what}: answered {out:?} with exit 0\n{err}");
    for n in needles {
        assert!(err.contains(n), "{what}: the error does not say {n:?}:\n{err}");
    }
}

#[test]
fn damage_in_a_copy_without_its_record_is_found_against_the_record_kept_before() {
    let a = copy_fixture("k3-tiny-a");
    let (ok, want, err) = run(a.path(), &[]);
    assert!(ok, "{err}");
    // `cp a/* b/`: the hidden record stays behind; then one bit of an expert's scales flips.
    let b = copy_visible(a.path());
    assert!(!b.path().join(".deltafin-checksums.json").exists());
    damage_expert_scales(b.path());
    refused("a damaged copy without its record", run(b.path(), &[]), &["checksum", "safetensors"]);
    // An intact copy answers as the original, and says where its record came from.
    let c = copy_visible(a.path());
    let (ok, got, err) = run(c.path(), &[]);
    assert!(ok && got == want, "{err}");
    assert!(err.contains("no checksum record of its own"), "{err}");
    // `deltafin verify` on the damaged copy finds the damage (it does not record it as good).
    let o = cmd(b.path()).args(["verify", "--model"]).arg(b.path()).output().unwrap();
    assert!(!o.status.success(), "verify passed a damaged copy: {}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn an_emptied_or_malformed_record_is_kept_aside_and_never_relearned_from_damage() {
    for body in [&b""[..], b"{\"version\": 1, \"shards\": [", b"null"] {
        let a = copy_fixture("k3-tiny-a");
        let (ok, _, err) = run(a.path(), &[]);
        assert!(ok, "{err}");
        let side = a.path().join(".deltafin-checksums.json");
        std::fs::write(&side, body).unwrap();
        damage_expert_scales(a.path());
        let r = run(a.path(), &[]);
        assert!(r.2.contains("kept aside"), "{}", r.2);
        refused("damage after the record was emptied", r, &["checksum"]);
        let aside = std::fs::read_dir(a.path())
            .unwrap()
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with(".deltafin-checksums.json.malformed-"));
        assert!(aside, "the malformed record was not kept");
    }
}

/// Sets the `__metadata__` of `path`'s header (the header may grow: data offsets are relative to
/// its end, so every tensor's entry stays the same).
fn edit_metadata(path: &Path) {
    let b = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let mut v: serde_json::Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    v["__metadata__"] = serde_json::json!({"note": "edited by hand"});
    let mut text = serde_json::to_string(&v).unwrap();
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(&b[8 + n..]);
    std::fs::write(path, out).unwrap();
}

#[test]
fn a_header_change_keeps_the_checks_of_every_unchanged_tensor() {
    let a = copy_fixture("k3-tiny-a");
    let (ok, want, err) = run(a.path(), &[]);
    assert!(ok, "{err}");
    for e in std::fs::read_dir(a.path()).unwrap().flatten() {
        if e.file_name().to_string_lossy().starts_with("model-") {
            edit_metadata(&e.path());
        }
    }
    // The header alone: the same answer, and a word about it.
    let (ok, got, err) = run(a.path(), &[]);
    assert!(ok && got == want, "{err}");
    assert!(err.contains("header differs from the one recorded"), "{err}");
    // Then a data bit: found.
    damage_expert_scales(a.path());
    refused("header and data changed", run(a.path(), &[]), &["checksum"]);
}

#[test]
fn a_changed_config_or_tokenizer_is_an_error_naming_the_file_until_rerecorded() {
    let a = copy_fixture("k3-tiny-a");
    let (ok, _, err) = run(a.path(), &[]);
    assert!(ok, "{err}");
    let cfg = a.path().join("config.json");
    let text = std::fs::read_to_string(&cfg).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["text_config"]["routed_scaling_factor"] = serde_json::json!(1.5);
    std::fs::write(&cfg, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    refused("routed_scaling_factor 1.0 -> 1.5", run(a.path(), &[]), &["config.json", "differs", "--rehash"]);
    // A file that is recorded and then removed is named too.
    let generation = a.path().join("generation_config.json");
    if generation.exists() {
        std::fs::remove_file(&generation).unwrap();
        refused("generation_config.json removed", run(a.path(), &[]), &["generation_config.json", "missing"]);
    }
    // On purpose: `verify --rehash` records it, and it runs.
    let o = cmd(a.path()).args(["verify", "--rehash", "--model"]).arg(a.path()).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (ok, _, err) = run(a.path(), &[]);
    assert!(ok, "after --rehash: {err}");
}

#[test]
fn a_tokenizer_with_two_ranks_swapped_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("m");
    synth_small(&m, None);
    let (ok, _, err) = run(&m, &[]);
    assert!(ok, "{err}");
    let tok = m.join("tiktoken.model");
    if !tok.exists() {
        return skipped("the tokenizer check", "this synth has no tiktoken.model");
    }
    let text = std::fs::read_to_string(&tok).unwrap();
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    let (a, b) = (lines[300].split(' ').next().unwrap().to_string(), lines[301].split(' ').next().unwrap().to_string());
    lines[300] = format!("{b} 300");
    lines[301] = format!("{a} 301");
    std::fs::write(&tok, lines.join("\n") + "\n").unwrap();
    refused("two tokenizer ranks swapped", run(&m, &[]), &["tiktoken.model", "differs"]);
}

#[test]
fn a_shard_a_verify_found_damaged_is_refused_until_verified_again() {
    let a = copy_fixture("k3-tiny-a");
    assert!(run(a.path(), &[]).0);
    damage_expert_scales(a.path());
    let o = cmd(a.path()).args(["verify", "--model"]).arg(a.path()).output().unwrap();
    assert!(!o.status.success());
    // Any prompt, even one that never reads the damaged tensor, is refused at start.
    refused("a shard marked damaged", run(a.path(), &[]), &["damaged", "deltafin verify"]);
}

#[test]
fn two_processes_on_one_session_file_the_second_fails_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let sess = tmp.path().join("s.dfstate");
    let model = fixture("k3-tiny-a");
    let long = |sess: &Path| {
        deltafin_cmd()
            .args(["run", "--model"])
            .arg(&model)
            .args(["--prompt-ids", &ids_arg(&PROMPT), "--max-new", "4000", "--ignore-eos", "-q", "--session"])
            .arg(sess)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut first = long(&sess);
    // The first holds the lock from its start.
    let t0 = Instant::now();
    while !tmp.path().join(".s.dfstate.lock").exists() && t0.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let o = deltafin_cmd()
        .args(["run", "--model"])
        .arg(&model)
        .args(["--prompt-ids", "1,2,3", "--max-new", "2", "--session"])
        .arg(&sess)
        .output()
        .unwrap();
    let _ = first.kill();
    let _ = first.wait();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "a second writer of the session ran: {err}");
    assert!(err.contains("in use by process"), "{err}");
}

#[test]
fn special_files_where_a_session_or_state_file_belongs_never_hang() {
    let tmp = tempfile::tempdir().unwrap();
    let fifo = tmp.path().join("s.dfstate");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let t0 = Instant::now();
    let o = deltafin_cmd()
        .args(["run", "--model"])
        .arg(fixture("k3-tiny-a"))
        .args(["--prompt-ids", "1,2,3", "--max-new", "2", "--session"])
        .arg(&fifo)
        .output()
        .unwrap();
    assert!(!o.status.success() && t0.elapsed() < Duration::from_secs(20));
    assert!(String::from_utf8_lossy(&o.stderr).contains("FIFO"), "{}", String::from_utf8_lossy(&o.stderr));
    // A FIFO in the state directory is skipped with a note; the server listens.
    let dir = tmp.path().join("state");
    std::fs::create_dir(&dir).unwrap();
    assert!(std::process::Command::new("mkfifo").arg(dir.join("0000.dfstate")).status().unwrap().success());
    let s = common::served::Served::start(&[
        "--model",
        fixture("k3-tiny-a").to_str().unwrap(),
        "--state-dir",
        dir.to_str().unwrap(),
    ]);
    let (code, _, _) = s.get("/v1/models");
    assert_eq!(code, 200);
    assert!(s.log.lock().unwrap().contains("not a regular file"), "{}", s.log.lock().unwrap());
    // A second server on the same directory is refused at start.
    let o = deltafin_cmd()
        .args(["serve", "--port", "0", "--model"])
        .arg(fixture("k3-tiny-a"))
        .arg("--state-dir")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("in use"), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn a_state_dir_that_is_a_file_or_parallel_without_persistence_is_said_plainly() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("f");
    std::fs::write(&file, "x").unwrap();
    let o = deltafin_cmd()
        .args(["serve", "--port", "0", "--model"])
        .arg(fixture("k3-tiny-a"))
        .arg("--state-dir")
        .arg(&file)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("not a directory"), "{err}");
    let o = deltafin_cmd()
        .args(["serve", "--port", "0", "--parallel", "4", "--model"])
        .arg(fixture("k3-tiny-a"))
        .arg("--state-dir")
        .arg(tmp.path().join("d"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--parallel"), "{err}");
}

/// Rewrites a state file's header JSON with `edit` and fixes both of its checksums, as a forger
/// who knows the format would.
fn forge(path: &Path, edit: impl Fn(&mut serde_json::Value)) {
    use xxhash_rust::xxh3::xxh3_64;
    let b = std::fs::read(path).unwrap();
    let hlen = u32::from_le_bytes(b[12..16].try_into().unwrap()) as usize;
    let mut head: serde_json::Value = serde_json::from_slice(&b[16..16 + hlen]).unwrap();
    edit(&mut head);
    let json = serde_json::to_vec(&head).unwrap();
    let mut out = b[..12].to_vec();
    out.extend_from_slice(&(json.len() as u32).to_le_bytes());
    out.extend_from_slice(&json);
    out.extend_from_slice(&xxh3_64(&json).to_le_bytes());
    out.extend_from_slice(&b[16 + hlen + 8..b.len() - 8]);
    let sum = xxh3_64(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    std::fs::write(path, out).unwrap();
}

#[test]
fn forged_state_files_with_values_the_command_line_refuses_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let sess = tmp.path().join("s.dfstate");
    let model = fixture("k3-tiny-a");
    let go = |extra: &[&str]| {
        deltafin_cmd()
            .args(["run", "--model"])
            .arg(&model)
            .args(extra)
            .arg("--session")
            .arg(&sess)
            .args(["--max-new", "3"])
            .output()
            .unwrap()
    };
    assert!(go(&["--prompt-ids", "1,2,3", "--temperature", "0.5", "--seed", "3"]).status.success());
    let pristine = std::fs::read(&sess).unwrap();
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit)> = vec![
        ("temperature", Box::new(|h| h["notes"]["sampler"]["params"]["temperature"] = serde_json::json!(7.5))),
        ("top_p", Box::new(|h| h["notes"]["sampler"]["params"]["top_p"] = serde_json::json!(-1.0))),
        ("vocabulary", Box::new(|h| h["notes"]["unfed"] = serde_json::json!([4_000_000_000u64]))),
    ];
    for (what, edit) in cases {
        std::fs::write(&sess, &pristine).unwrap();
        forge(&sess, edit);
        let o = go(&[]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "a forged {what} was taken: {err}");
        assert!(err.contains("corrupt") && err.contains(what), "{what}: {err}");
    }
}

#[test]
fn a_killed_save_leaves_no_temp_behind_the_next_run() {
    let tmp = tempfile::tempdir().unwrap();
    let sess = tmp.path().join("s.dfstate");
    // What a save killed mid-write leaves: its temp file, named after a process that is gone.
    let stale = tmp.path().join(".s.dfstate.tmp.999999999.0123456789abcdef");
    std::fs::write(&stale, vec![0u8; 4096]).unwrap();
    let o = deltafin_cmd()
        .args(["run", "--model"])
        .arg(fixture("k3-tiny-a"))
        .args(["--prompt-ids", "1,2,3", "--max-new", "2", "--session"])
        .arg(&sess)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!stale.exists(), "the stale temp file is still there");
}

#[test]
fn batch_to_dev_stdout_into_a_pipe_writes_and_ends() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in.jsonl");
    std::fs::write(&input, "{\"id\": 1, \"prompt\": [1, 2, 3], \"max_tokens\": 2}\n").unwrap();
    let mut child = deltafin_cmd()
        .args(["batch", "--model"])
        .arg(fixture("k3-tiny-a"))
        .arg("--in")
        .arg(&input)
        .args(["--out", "/dev/stdout"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "batch --out /dev/stdout into a pipe hangs");
        std::thread::sleep(Duration::from_millis(50));
    }
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("\"line\":1"), "{}", String::from_utf8_lossy(&o.stdout));
}
