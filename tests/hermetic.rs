//! The test suite keeps out of the user's files: every test starts the binary through
//! `common::deltafin_cmd()`, whose `HOME` and `DELTAFIN_CACHE` are the test process's own
//! directory, so route heat, converted tokenizers and demo copies land there and never in
//! `~/.cache/deltafin`. Checked from the tests' source (no other way of starting the binary) and
//! by a run that writes route heat. `.ci/run` checks the whole suite too: it points
//! `XDG_CACHE_HOME` at an empty directory and fails if a `deltafin` cache appears there.

mod common;
use common::*;
use std::path::Path;

#[test]
fn every_test_starts_the_binary_through_deltafin_cmd() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let mut offenders = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.extend(std::fs::read_dir(dir.join("common")).unwrap().map(|e| e.unwrap().path()));
    for f in files.iter().filter(|p| p.extension().is_some_and(|e| e == "rs")) {
        let text = std::fs::read_to_string(f).unwrap();
        // common/mod.rs defines deltafin_cmd(); this file names what it looks for.
        let is_common = f.ends_with("common/mod.rs") || f.ends_with("hermetic.rs");
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            let spawns = !is_common && code.contains("Command::new(") && code.contains("bin())");
            let names_exe = !is_common && code.contains("CARGO_BIN_EXE_deltafin");
            if spawns || names_exe {
                offenders.push(format!("{}:{}: {}", f.display(), i + 1, line.trim()));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "start the binary with deltafin_cmd() (a cache of the test's own):\n{}",
        offenders.join("\n")
    );
}

#[test]
fn route_heat_of_a_test_run_lands_in_the_tests_own_cache() {
    let cache = test_home().join("deltafin-cache");
    let heat = cache.join("heat");
    let before = std::fs::read_dir(&heat).map(|d| d.count()).unwrap_or(0);
    let r = reference("k3-tiny-a");
    run_ok(deltafin_cmd().args(["run", "--model"]).arg(fixture("k3-tiny-a")).args([
        "--prompt-ids",
        &ids_arg(&r.prompt[..4]),
        "--max-new",
        "2",
        "--expert-heat",
        "auto",
        "-q",
    ]));
    let after = std::fs::read_dir(&heat).map(|d| d.count()).unwrap_or(0);
    assert!(after > before, "no route heat written under {}", heat.display());
    // And the HOME the binary saw is the test's, so `~` means that directory too.
    assert!(test_home().starts_with(env!("CARGO_TARGET_TMPDIR")));
    assert!(!test_home().join(".cache").exists(), "a cache under the test's HOME, not its DELTAFIN_CACHE");
}

#[test]
fn a_fresh_home_stays_empty_through_the_demo_a_text_score_and_route_heat() {
    // A HOME of this test alone, so whatever lands in it came from these commands.
    let home = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let cmd = || {
        let mut c = deltafin_cmd();
        c.env("HOME", home.path()).env("DELTAFIN_CACHE", cache.path());
        c
    };
    let text = cache.path().join("notes.txt");
    std::fs::write(&text, "It was a bright cold day in April, and the clocks were striking thirteen.\n").unwrap();
    run_ok(cmd().args(["run", "--demo", "--prompt", "Hello", "--max-new", "2", "--temperature", "0", "-q"]));
    run_ok(cmd().args(["run", "--demo", "--prompt", "Hello", "--max-new", "2", "--expert-heat", "auto", "-q"]));
    run_ok(cmd().args(["score", "--demo", "--text"]).arg(&text));
    let left: Vec<_> = std::fs::read_dir(home.path()).unwrap().map(|e| e.unwrap().path()).collect();
    assert!(left.is_empty(), "the commands wrote into HOME: {left:?}");
    // They did write their cache (the demo copy, route heat, the converted tokenizer): there.
    for sub in ["heat", "tokenizers"] {
        assert!(cache.path().join(sub).is_dir(), "no {sub}/ in the test's cache");
    }
}
