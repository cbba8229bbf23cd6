//! Hostile input to the real binary: output paths that are devices, FIFOs, links or directories;
//! numbers at the edge of their type; configs with absurd sizes; `synth --force` over directories
//! it did not write; outputs over inputs or over files deltafin did not write. Each must be a clear error (exit 1, or 2 for usage), never a panic, an abort
//! or a destroyed file.

mod common;
use common::*;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::process::{Command, Output};

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs `c`; asserts the exit code and that stderr holds every needle, never a panic.
fn expect(c: &mut Command, code: i32, needles: &[&str]) -> String {
    let o = c.output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(code), "expected exit code {code}; stderr:\n{err}");
    assert!(!err.contains("panicked") && !err.contains("RUST_BACKTRACE"), "panic:\n{err}");
    for n in needles {
        assert!(err.contains(n), "stderr should mention `{n}`:\n{err}");
    }
    err
}

fn score_to(out: &Path) -> Command {
    score_model(&fixture("k3-tiny-a"), out)
}

fn score_model(model: &Path, out: &Path) -> Command {
    let mut c = deltafin_cmd();
    c.args(["score", "--model"]).arg(model).args(["--prompt-ids", "1,2,3", "--logits-out"]).arg(out);
    c
}

fn mkfifo(p: &Path) {
    let s = Command::new("mkfifo").arg(p).status().unwrap();
    assert!(s.success());
}

#[test]
fn outputs_never_replace_devices_fifos_or_directories() {
    let tmp = tempfile::tempdir().unwrap();
    // A character device (as root, renaming over it would replace the device node).
    expect(&mut score_to(Path::new("/dev/full")), 1, &["--logits-out /dev/full", "character device"]);
    assert!(std::fs::metadata("/dev/full").unwrap().file_type().is_char_device());
    // A FIFO: refused up front (opening it for writing would also block without a reader).
    let fifo = tmp.path().join("fifo");
    mkfifo(&fifo);
    expect(&mut score_to(&fifo), 1, &["FIFO", "refusing to replace it"]);
    assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
    // A directory.
    let d = tmp.path().join("dir");
    std::fs::create_dir(&d).unwrap();
    expect(&mut score_to(&d), 1, &["a directory"]);
    assert!(d.is_dir());
    // A link to a FIFO: refused, and the message says where the link points.
    let link = tmp.path().join("to-fifo");
    std::os::unix::fs::symlink(&fifo, &link).unwrap();
    expect(&mut score_to(&link), 1, &["links to", "FIFO"]);
    // Run's outputs are checked at the start, before the prompt is processed.
    let err = expect(
        deltafin_cmd()
            .args(["run", "--model"])
            .arg(fixture("k3-tiny-a"))
            .args(["--prompt-ids", "1,2", "--max-new", "2", "--stats-json"])
            .arg(&fifo),
        1,
        &["--stats-json", "FIFO"],
    );
    assert!(!err.contains("context <="), "checked before the startup line:\n{err}");
    expect(
        deltafin_cmd().args(["bench", "run", "--model"]).arg(fixture("k3-tiny-a")).args(["--out", "/dev/full"]),
        1,
        &["--out /dev/full", "character device"],
    );
    expect(
        deltafin_cmd()
            .args(["run", "--model"])
            .arg(fixture("k3-tiny-a"))
            .args(["--prompt-ids", "1,2", "--trace-routes"])
            .arg(tmp.path().join("no/such/dir/routes.json")),
        1,
        &["--trace-routes", "does not exist"],
    );
}

#[test]
fn outputs_write_through_links_to_their_target() {
    let tmp = tempfile::tempdir().unwrap();
    let real = tmp.path().join("real.safetensors");
    std::fs::write(&real, b"old").unwrap();
    let link = tmp.path().join("link.safetensors");
    std::os::unix::fs::symlink("real.safetensors", &link).unwrap();
    // A link to a file deltafin did not write is refused as the file itself is; --force replaces.
    expect(&mut score_to(&link), 1, &["--logits-out", "link.safetensors", "not overwritten", "--force"]);
    assert_eq!(std::fs::read(&real).unwrap(), b"old");
    run_ok(score_to(&link).arg("--force"));
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link stays a link");
    let (_, shape) = read_f32_tensor(&real, "logits");
    assert_eq!(shape[0], 3, "the target got the logits");
    // A dangling link creates its target.
    let dangling = tmp.path().join("dangling");
    std::os::unix::fs::symlink("made.safetensors", &dangling).unwrap();
    run_ok(&mut score_to(&dangling));
    assert!(tmp.path().join("made.safetensors").is_file());
}

#[test]
fn numbers_at_the_edge_are_errors_not_panics() {
    let run = |extra: &[&str]| {
        let mut c = deltafin_cmd();
        c.args(["run", "--model"]).arg(fixture("k3-tiny-a")).args(["--prompt-ids", "1,2"]).args(extra);
        c
    };
    expect(&mut run(&["--max-new", "18446744073709551615"]), 1, &["exceeds the usable context"]);
    expect(&mut run(&["--qd", "100000", "--reader", "pread"]), 2, &["queue depth 100000 is outside 1..=1024"]);
    expect(&mut run(&["--qd", "0"]), 2, &["queue depth 0"]);
    expect(&mut run(&["--threads", "100000"]), 2, &["outside 1..=1024"]);
    expect(&mut run(&["--threads", "0"]), 2, &["outside 1..=1024"]);
    expect(run(&[]).env("RAYON_NUM_THREADS", "100000"), 2, &["RAYON_NUM_THREADS=100000"]);
    for bad in ["NaN", "inf", "-inf", "1e300"] {
        expect(&mut run(&[&format!("--memory-gb={bad}")]), 2, &["--memory-gb", "not a size in GB"]);
    }
    expect(&mut run(&["--memory-gb=-1"]), 2, &["not a size in GB"]);
    expect(&mut run(&["--memory-gb", "0"]), 2, &["must be > 0"]);
    expect(&mut run(&["--expert-cache-gb", "NaN"]), 2, &["--expert-cache-gb"]);
    let tmp = copy_fixture("k3-tiny-a");
    expect(
        deltafin_cmd().args(["place", "--model"]).arg(tmp.path()).args(["--qd", "5000", "--drive", "x=1"]),
        2,
        &["queue depth 5000"],
    );
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&p, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
}

#[test]
fn absurd_config_sizes_name_config_json_and_the_field() {
    for (field, value) in [
        ("num_hidden_layers", serde_json::json!(1_000_000_000_000u64)),
        ("num_experts", serde_json::json!(1_000_000_000_000u64)),
        ("num_hidden_layers", serde_json::json!(1e12)),
        ("hidden_size", serde_json::json!(1u64 << 40)),
        ("vocab_size", serde_json::json!(1u64 << 40)),
    ] {
        let tmp = copy_fixture("k3-tiny-a");
        edit_config(tmp.path(), |v| v["text_config"][field] = value.clone());
        expect(
            &mut score_model(tmp.path(), &tmp.path().join("out.safetensors")),
            1,
            &["config.json", &format!("text_config.{field}")],
        );
    }
}

#[test]
fn error_text_has_each_cause_once_and_no_debug_text() {
    let tmp = tempfile::tempdir().unwrap();
    let err = expect(
        deltafin_cmd().args(["run", "--model"]).arg(tmp.path()).args(["--prompt-ids", "1"]),
        1,
        &["no config.json", "not a model directory"],
    );
    // Said once, in words, not as the OS error of a failed open.
    assert_eq!(err.matches("config.json").count(), 2, "{err}");
    assert!(!err.contains("(os error"), "{err}");
    let m = copy_fixture("k3-tiny-a");
    edit_config(m.path(), |v| v["model_type"] = "llama".into());
    let err = expect(&mut score_model(m.path(), &m.path().join("o")), 1, &["model_type", "found \"llama\""]);
    assert!(!err.contains("Some("), "{err}");
    edit_config(m.path(), |v| {
        v["model_type"] = "kimi_k3".into();
        v["quantization_config"]["quant_method"] = "gptq".into();
    });
    let err = expect(&mut score_model(m.path(), &m.path().join("o")), 1, &["quant_method", "found \"gptq\""]);
    assert!(!err.contains("Some("), "{err}");
}

fn synth(out: &Path, extra: &[&str]) -> Command {
    let mut c = deltafin_cmd();
    c.args(["synth", "--out"]).arg(out).args(["--layers", "2", "--experts", "4", "--top-k", "2"]).args(extra);
    c
}

#[test]
fn synth_force_replaces_only_its_own_output() {
    let tmp = tempfile::tempdir().unwrap();
    // A directory synth did not write survives --force, contents and all.
    let v = tmp.path().join("v");
    std::fs::create_dir(&v).unwrap();
    std::fs::write(v.join("notes"), "x").unwrap();
    expect(&mut synth(&v, &["--force"]), 1, &["not written by synth"]);
    assert_eq!(std::fs::read_to_string(v.join("notes")).unwrap(), "x");
    // A plain file is not a model either.
    let f = tmp.path().join("file");
    std::fs::write(&f, "keep").unwrap();
    expect(&mut synth(&f, &["--force"]), 1, &["not a directory"]);
    assert_eq!(std::fs::read_to_string(&f).unwrap(), "keep");
    // synth's own output is replaced, but not once someone has added a file to it.
    let m = tmp.path().join("m");
    run_ok(&mut synth(&m, &[]));
    expect(&mut synth(&m, &[]), 1, &["already exists"]);
    std::fs::write(m.join("notes.txt"), "mine").unwrap();
    expect(&mut synth(&m, &["--force"]), 1, &["notes.txt"]);
    assert!(m.join("notes.txt").exists());
    std::fs::remove_file(m.join("notes.txt")).unwrap();
    run_ok(&mut synth(&m, &["--force", "--seed", "7"]));
    assert!(m.join("config.json").exists());
    // Output of a synth from before the marker: recognised by its config, if it holds nothing else.
    std::fs::remove_file(m.join(".deltafin-synth.json")).unwrap();
    std::fs::write(m.join("notes.txt"), "mine").unwrap();
    expect(&mut synth(&m, &["--force"]), 1, &["notes.txt"]);
    std::fs::remove_file(m.join("notes.txt")).unwrap();
    run_ok(&mut synth(&m, &["--force"]));
    assert!(m.join(".deltafin-synth.json").exists());
}

#[test]
fn synth_refuses_unrunnable_or_oversized_models_and_cleans_stale_temps() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("z");
    expect(deltafin_cmd().args(["synth", "--out"]).arg(&out).args(["--experts", "0"]), 1, &["--experts"]);
    expect(&mut synth(&out, &["--dense-layers", "2"]), 1, &["--dense-layers"]);
    assert!(!out.exists());
    // Far more than any test machine's free space: refused before writing anything.
    expect(
        deltafin_cmd().args(["synth", "--out"]).arg(&out).args([
            "--preset",
            "k3-experts",
            "--layers",
            "4000",
            "--experts",
            "1000",
        ]),
        1,
        &["free but the model needs"],
    );
    assert!(std::fs::read_dir(tmp.path()).unwrap().next().is_none(), "nothing written");
    // A temp dir of a dead process is removed at the next start; a live one (ours) is kept.
    let stale = tmp.path().join(".old.synth-tmp-4300000");
    let live = tmp.path().join(format!(".other.synth-tmp-{}", std::process::id()));
    std::fs::create_dir_all(stale.join("sub")).unwrap();
    std::fs::create_dir_all(&live).unwrap();
    let err = run_ok(&mut synth(&out, &[])).1;
    assert!(err.contains("left by an interrupted synth"), "{err}");
    assert!(!stale.exists() && live.exists());
}

/// No output is ever written over a user's file (`src/cli/outputs.rs`): a file deltafin did not
/// write is refused by every output flag, naming the flag and the file, unless `--force`; an
/// output that is one of the command's inputs (by any path, or standard input) or another output
/// is refused even with `--force`; an earlier output of deltafin's own, or an empty file, is
/// replaced. Everything is checked before any work.
#[test]
fn outputs_never_replace_an_input_or_a_file_deltafin_did_not_write() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let notes = t.join("notes.txt");
    let precious = "precious, not deltafin's\n";
    std::fs::write(&notes, precious).unwrap();
    let n = notes.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut c = deltafin_cmd();
        c.args(["run", "--model"]).arg(fixture("k3-tiny-a")).args(["--prompt-ids", "1,2,3", "--max-new", "2", "-q"]);
        c.args(extra);
        c
    };
    for flag in ["--stats-json", "--trace-routes", "--expert-heat"] {
        let err = expect(&mut run(&[flag, n]), 1, &[flag, n, "not overwritten", "--force"]);
        assert!(!err.contains("context <="), "refused before the model opened:\n{err}");
        assert_eq!(std::fs::read_to_string(&notes).unwrap(), precious, "{flag}");
    }
    // chat and serve write the route heat too: refused the same way, before a model opens or a
    // port is taken.
    for cmd in [&["chat", "--demo"][..], &["serve", "--demo", "--port", "0"]] {
        let mut c = deltafin_cmd();
        c.args(cmd).args(["--expert-heat", n]).stdin(std::process::Stdio::null());
        expect(&mut c, 1, &["--expert-heat", n, "not overwritten", "--force"]);
    }
    expect(&mut score_to(&notes), 1, &["--logits-out", n, "not overwritten"]);
    let bench = |extra: &[&str]| {
        let mut c = deltafin_cmd();
        c.args(["bench", "run", "--model"]).arg(fixture("k3-tiny-a")).args(extra);
        c
    };
    expect(&mut bench(&["--out", n]), 1, &["--out", n, "not appended to"]);
    expect(&mut bench(&["--fetch-trace", n]), 1, &["--fetch-trace", n]);
    std::fs::write(t.join("ladder.svg"), precious).unwrap();
    expect(&mut bench(&["--plot", t.to_str().unwrap()]), 1, &["--plot", "ladder.svg", "not overwritten"]);
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), precious);

    // --force replaces it; it is deltafin's then, and a later run replaces it without asking.
    run_ok(&mut run(&["--stats-json", n, "--force"]));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&notes).unwrap()).unwrap();
    assert_eq!(v["generated_tokens"], 2);
    run_ok(&mut run(&["--stats-json", n]));
    let logits = t.join("logits.safetensors");
    run_ok(&mut score_to(&logits));
    run_ok(&mut score_to(&logits));
    // An empty file (mktemp's) holds nothing to lose.
    let empty = t.join("empty.json");
    std::fs::write(&empty, b"").unwrap();
    run_ok(&mut run(&["--trace-routes", empty.to_str().unwrap()]));
    assert!(std::fs::metadata(&empty).unwrap().len() > 0);

    // An input, by its own path, a link or standard input: refused even with --force.
    let prompt = t.join("p.txt");
    std::fs::write(&prompt, "Hello").unwrap();
    let link = t.join("link.txt");
    std::os::unix::fs::symlink(&prompt, &link).unwrap();
    let p = prompt.to_str().unwrap();
    for out in [p, link.to_str().unwrap()] {
        let mut c = deltafin_cmd();
        c.args(["run", "--demo", "--prompt-file", p, "--stats-json", out, "--force"]);
        expect(&mut c, 1, &["--stats-json", "is the same file as --prompt-file", "refusing to write over an input"]);
    }
    let mut c = deltafin_cmd();
    c.args(["run", "--demo", "--prompt-file", "-", "--stats-json", p]).stdin(std::fs::File::open(&prompt).unwrap());
    expect(&mut c, 1, &["is the same file as standard input"]);
    let session = t.join("s.dfstate");
    let s = session.to_str().unwrap();
    expect(&mut run(&["--session", s, "--stats-json", s]), 1, &["is the same file as --session"]);
    assert_eq!(std::fs::read_to_string(&prompt).unwrap(), "Hello");
    assert!(!session.exists());
    // Two outputs on one file.
    let both = t.join("both.json");
    let b = both.to_str().unwrap();
    expect(
        &mut run(&["--stats-json", b, "--trace-routes", b]),
        1,
        &["--trace-routes", "is the same file as --stats-json"],
    );
}
