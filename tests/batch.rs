//! `deltafin batch`: prompts and messages with the server's option names, error records for bad
//! lines while the batch goes on (a line that is not UTF-8 included) and exit 1 naming them, the
//! same text as `deltafin run`, resumable reruns (also after kill -9 and with a torn last line),
//! `-` for standard input and output, errored lines run again on a rerun, Ctrl-C saying what is
//! done, and files never damaged: the output is never the input, a device, a FIFO or a file that
//! is not a batch output (unless `--force`).

mod common;
use common::*;
use serde_json::Value;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn model() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    synth_small(&tmp.path().join("m"), Some("3"));
    tmp
}

fn batch(dir: &Path, input: &Path, out: &Path) -> Command {
    let mut c = deltafin_cmd();
    c.args(["batch", "--model"]).arg(dir).arg("--in").arg(input).arg("--out").arg(out);
    c.args(["--prefill-rows", "256", "--memory-gb", "2", "-q"]);
    c
}

/// Runs a batch that must end with failed lines (exit 1); returns its stderr.
fn run_failing(c: &mut Command) -> String {
    let o = c.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(1), "expected exit 1 (failed lines):\n{err}");
    err
}

fn records(p: &Path) -> Vec<Value> {
    std::fs::read_to_string(p).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[test]
fn lines_errors_and_reruns() {
    let tmp = model();
    let dir = tmp.path().join("m");
    let input = tmp.path().join("in.jsonl");
    let out = tmp.path().join("out.jsonl");
    std::fs::write(
        &input,
        [
            r#"{"id": "a", "prompt": "Hello", "max_tokens": 5}"#,
            r#"{"id": 2, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "reasoning_effort": "none"}"#,
            "",
            "{broken",
            r#"{"id": "c", "prompt": "x", "n": 3}"#,
            r#"{"prompt": "no id"}"#,
            r#"{"id": "d", "prompt": "Hello", "max_tokens": 6, "temperature": 0.9, "seed": 4, "logprobs": 2}"#,
        ]
        .join("\n"),
    )
    .unwrap();
    let err = run_failing(&mut batch(&dir, &input, &out));
    assert!(err.contains("3 done, 3 failed"), "{err}");
    assert!(err.contains("3 of the batch's requests failed: lines 4, 5, 6"), "{err}");
    let r = records(&out);
    assert_eq!(r.len(), 6);
    assert_eq!(r.iter().map(|x| x["line"].as_u64().unwrap()).collect::<Vec<_>>(), vec![1, 2, 4, 5, 6, 7]);
    assert_eq!((&r[0]["id"], &r[0]["finish_reason"]), (&Value::from("a"), &Value::from("length")));
    assert_eq!(r[1]["id"], 2, "ids keep their type");
    assert_eq!(r[0]["usage"]["completion_tokens"], 5);
    assert_eq!(r[2]["error"]["code"], "invalid_json");
    assert_eq!(r[3]["error"]["param"], "n");
    assert_eq!(r[4]["error"]["param"], "id");
    assert_eq!(r[5]["logprobs"].as_array().unwrap().len(), 6);
    // The same text as `deltafin run` on the same prompt.
    let (run_out, _) = run_ok(deltafin_cmd().args(["run", "--model"]).arg(&dir).args([
        "--prompt",
        "Hello",
        "--max-new",
        "5",
        "--format",
        "json",
        "-q",
    ]));
    let run: Value = serde_json::from_str(&run_out).unwrap();
    assert_eq!(r[0]["text"], run["text"]);
    let (run_out, _) = run_ok(deltafin_cmd().args(["run", "--model"]).arg(&dir).args([
        "--prompt",
        "Hello",
        "--max-new",
        "6",
        "--temperature",
        "0.9",
        "--seed",
        "4",
        "--format",
        "json",
        "-q",
    ]));
    let run: Value = serde_json::from_str(&run_out).unwrap();
    assert_eq!(r[5]["text"], run["text"], "sampling with a seed matches run");
    // A rerun runs the failed lines again (the user may have fixed them): unfixed, they fail
    // again, each keeping one record (exit 1).
    let err = run_failing(&mut batch(&dir, &input, &out));
    assert!(err.contains("0 done, 3 failed, 3 already in the output"), "{err}");
    assert!(err.contains("3 of the batch's requests failed: lines 4, 5, 6"), "{err}");
    assert_eq!(records(&out).len(), 6);
    // Fixed, they run: every line has its result, once, and the batch is clean (exit 0).
    let fixed = std::fs::read_to_string(&input)
        .unwrap()
        .replace("{broken", r#"{"id": "b", "prompt": "Hi", "max_tokens": 2}"#)
        .replace(r#""n": 3"#, r#""max_tokens": 2"#)
        .replace(r#"{"prompt": "no id"}"#, r#"{"id": "e", "prompt": "no id", "max_tokens": 2}"#);
    std::fs::write(&input, fixed).unwrap();
    let (_, err) = run_ok(&mut batch(&dir, &input, &out));
    assert!(err.contains("3 done, 0 failed, 3 already in the output"), "{err}");
    let r = records(&out);
    assert!(r.iter().all(|x| x.get("error").is_none()), "{r:?}");
    let mut numbers: Vec<u64> = r.iter().map(|x| x["line"].as_u64().unwrap()).collect();
    numbers.sort_unstable();
    assert_eq!(numbers, [1, 2, 4, 5, 6, 7], "each line once");
    // A second run on an output another run is writing (it holds the lock) refuses, touching nothing.
    let before = std::fs::read(&out).unwrap();
    let holder = std::fs::OpenOptions::new().append(true).open(&out).unwrap();
    holder.try_lock().unwrap();
    std::fs::write(tmp.path().join("more.jsonl"), r#"{"id": "new", "prompt": "Hi", "max_tokens": 2}"#).unwrap();
    let o = batch(&dir, &tmp.path().join("more.jsonl"), &out).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("is being written by another `deltafin batch` run"), "{err}");
    assert_eq!(std::fs::read(&out).unwrap(), before);
    drop(holder);
    let (_, err) = run_ok(&mut batch(&dir, &tmp.path().join("more.jsonl"), &out));
    assert!(err.contains("1 done, 0 failed, 0 already"), "{err}");
}

#[test]
fn resumes_after_kill_9_with_each_id_once_and_the_same_results() {
    let tmp = model();
    let dir = tmp.path().join("m");
    let input = tmp.path().join("in.jsonl");
    let lines: Vec<String> =
        (0..12).map(|i| format!(r#"{{"id": "q{i}", "prompt": "Prompt number {i}", "max_tokens": 300}}"#)).collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let clean = tmp.path().join("clean.jsonl");
    run_ok(&mut batch(&dir, &input, &clean));
    let out = tmp.path().join("out.jsonl");
    let mut child = batch(&dir, &input, &out).stderr(Stdio::null()).spawn().unwrap();
    let t0 = Instant::now();
    while std::fs::read_to_string(&out).map_or(0, |s| s.lines().count()) < 3 {
        assert!(t0.elapsed() < Duration::from_secs(60), "no progress");
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let done = records(&out).len();
    assert!(done < 12, "killed before the end ({done} done)");
    // As if the kill had torn a line in two.
    std::fs::OpenOptions::new().append(true).open(&out).unwrap().write_all(br#"{"id": "q11", "te"#).unwrap();
    let (_, err) = run_ok(&mut batch(&dir, &input, &out));
    assert!(err.contains("cut a torn last line"), "{err}");
    let got = records(&out);
    let want = records(&clean);
    let ids: Vec<&Value> = got.iter().map(|r| &r["id"]).collect();
    assert_eq!(ids, want.iter().map(|r| &r["id"]).collect::<Vec<_>>(), "each id once, in order");
    for (g, w) in got.iter().zip(&want) {
        assert_eq!((&g["text"], &g["finish_reason"]), (&w["text"], &w["finish_reason"]), "{}", g["id"]);
    }
}

#[test]
fn dash_reads_stdin_and_writes_stdout() {
    let tmp = model();
    let dir = tmp.path().join("m");
    let mut child = batch(&dir, Path::new("-"), Path::new("-"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"{\"id\": 1, \"prompt\": \"Hi\", \"max_tokens\": 2}\n{\"id\": 2}\n")
        .unwrap();
    let o = child.wait_with_output().unwrap();
    // Line 2 failed (no prompt): exit 1, its record on standard output with the other's.
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("line 2 (their error records are in standard output)"), "{err}");
    let lines: Vec<Value> =
        String::from_utf8(o.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["usage"]["completion_tokens"], 2);
    assert_eq!(lines[1]["error"]["param"], "prompt");
}

/// Records by id (errors without an id by line).
fn by_id(rs: &[Value]) -> std::collections::BTreeMap<String, Value> {
    rs.iter()
        .map(|r| (if r["id"].is_null() { format!("line {}", r["line"]) } else { r["id"].to_string() }, r.clone()))
        .collect()
}

#[test]
fn parallel_answers_equal_serial_ones_and_resume_after_kill_9() {
    let tmp = model();
    let dir = tmp.path().join("m");
    let input = tmp.path().join("in.jsonl");
    let mut lines: Vec<String> = (0..9)
        .map(|i| {
            format!(
                r#"{{"id": "q{i}", "prompt": "Prompt number {i} {}", "max_tokens": {}}}"#,
                "x ".repeat(i),
                200 + 20 * i
            )
        })
        .collect();
    lines.push(
        r#"{"id": "s", "prompt": "Hello", "max_tokens": 30, "temperature": 0.9, "seed": 4, "logprobs": 2}"#.into(),
    );
    lines.push(
        r#"{"id": "c", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20, "reasoning_effort": "none"}"#
            .into(),
    );
    lines.push("{broken".into());
    lines.push(r#"{"id": "st", "prompt": "Prompt number 3", "max_tokens": 50, "stop": [" "]}"#.into());
    std::fs::write(&input, lines.join("\n")).unwrap();
    let serial = tmp.path().join("serial.jsonl");
    run_failing(&mut batch(&dir, &input, &serial));
    let want = by_id(&records(&serial));
    // Together, in groups of 4: the same answers, counters showing the shared group.
    let par = tmp.path().join("par.jsonl");
    let err = run_failing(batch(&dir, &input, &par).args(["--parallel", "4"]));
    assert!(err.contains("12 done, 1 failed"), "{err}");
    let got = by_id(&records(&par));
    assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>());
    for (id, w) in &want {
        let g = &got[id];
        for k in ["text", "finish_reason", "usage", "logprobs", "reasoning_content", "error"] {
            assert_eq!(g.get(k), w.get(k), "{id}: {k}");
        }
        if w.get("error").is_none() {
            assert_eq!(g["deltafin"]["batch"], 4, "{id}");
        }
    }
    // Killed while a group runs: the rerun finishes with each id once and the same answers.
    let out = tmp.path().join("out.jsonl");
    let mut child = batch(&dir, &input, &out).args(["--parallel", "4"]).stderr(Stdio::null()).spawn().unwrap();
    let t0 = Instant::now();
    while std::fs::read_to_string(&out).map_or(0, |s| s.lines().count()) < 2 {
        assert!(t0.elapsed() < Duration::from_secs(60), "no progress");
        std::thread::sleep(Duration::from_millis(2));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(records(&out).len() < 13, "killed before the end");
    run_failing(batch(&dir, &input, &out).args(["--parallel", "3"]));
    let got = records(&out);
    assert_eq!(got.len(), 13, "each line once");
    let got = by_id(&got);
    for (id, w) in &want {
        assert_eq!(got[id].get("text"), w.get("text"), "{id}");
    }
}

#[test]
fn drafts_in_a_running_batch_give_each_answer_alone_on_the_demo_model() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in.jsonl");
    let starts = ["The ship", "In the beginning", "It is a truth", "Fellow citizens", "Call me", "And the Lord"];
    let lines: Vec<String> = (0..10)
        .map(|i| {
            let sampled =
                if i % 2 == 1 { format!(r#", "temperature": 0.8, "seed": {i}, "logprobs": 2"#) } else { String::new() };
            format!(r#"{{"id": "d{i}", "prompt": "{} {i}", "max_tokens": {}{sampled}}}"#, starts[i % 6], 16 + 4 * i)
        })
        .collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let demo = |out: &Path, extra: &[&str]| {
        let mut c = deltafin_cmd();
        c.args(["batch", "--demo", "--temperature", "0", "-q", "--in"]).arg(&input).arg("--out").arg(out).args(extra);
        // With dspark, the published width policy, which drafts whenever it may, so drafts really
        // ride in the batch (the default policy may judge them not to pay on short requests);
        // auto under its own policy.
        if extra.contains(&"dspark") {
            c.env("DELTAFIN_DRAFT_POLICY", "published");
        }
        run_ok(&mut c).1
    };
    let serial = tmp.path().join("serial.jsonl");
    demo(&serial, &[]);
    let want = by_id(&records(&serial));
    assert_eq!(want.len(), 10);
    for (n, draft) in [("1", "dspark"), ("3", "dspark"), ("8", "dspark"), ("3", "auto"), ("1", "auto")] {
        let out = tmp.path().join(format!("p{n}-{draft}.jsonl"));
        let err = demo(&out, &["--parallel", n, "--draft", draft]);
        assert!(err.contains("10 done, 0 failed"), "{err}");
        let got = by_id(&records(&out));
        assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>());
        for (id, w) in &want {
            for k in ["text", "finish_reason", "usage", "logprobs"] {
                assert_eq!(got[id].get(k), w.get(k), "--parallel {n} --draft {draft}, {id}: {k}");
            }
        }
        let accepted: u64 = got.values().map(|r| r["deltafin"]["drafts_accepted"].as_u64().unwrap()).sum();
        assert!(accepted > 0 || draft == "auto", "--parallel {n} --draft {draft}: no draft accepted");
        if n != "1" {
            // Shared reads are labelled so, never counted as one request's own.
            let r = &got["\"d0\""]["deltafin"];
            assert!(r["bytes_read"].is_null() && r["shared"]["forwards"].as_u64().unwrap() > 0, "{r}");
        }
    }
}

#[test]
fn the_context_each_request_gets_is_what_the_longest_needs_unless_told() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in.jsonl");
    // The longest: a chat message's template tokens plus its 100 new tokens (under 320); a bad
    // line counts nothing and still gets its error record.
    let lines = [
        r#"{"id": "a", "prompt": "Hello there", "max_tokens": 20}"#,
        r#"{"id": "b", "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 100}"#,
        r#"{"id": "c", "prompt": "x", "max_tokens": -1}"#,
    ];
    std::fs::write(&input, lines.join("\n")).unwrap();
    let go = |name: &str, extra: &[&str]| {
        let out = tmp.path().join(name);
        let mut c = deltafin_cmd();
        c.args(["batch", "--demo", "--temperature", "0", "--parallel", "2", "--in"]).arg(&input).arg("--out").arg(&out);
        // Line c fails (max_tokens -1): exit 1.
        let err = run_failing(c.args(extra));
        (err, by_id(&records(&out)))
    };
    let (sized, got) = go("sized.jsonl", &[]);
    let ctx: usize = sized
        .split("context <= ")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no context in the startup line: {sized}"));
    let b = &got[r#""b""#]["usage"];
    let need = b["prompt_tokens"].as_u64().unwrap() as usize + 100;
    assert!(ctx >= need && ctx < need + 64 && ctx.is_multiple_of(64), "context {ctx} for a request of {need} tokens");
    assert!(got[r#""c""#].get("error").is_some(), "{:?}", got[r#""c""#]);
    // --context stands; the answers are the same.
    let (told, same) = go("told.jsonl", &["--context", "4096"]);
    assert!(told.contains("context <= 4096 tokens x 2 sequences"), "{told}");
    for id in [r#""a""#, r#""b""#] {
        assert_eq!(got[id]["text"], same[id]["text"], "{id}");
    }
}

#[test]
fn the_output_is_never_the_input_a_device_a_fifo_or_someone_elses_file() {
    let tmp = model();
    let dir = tmp.path().join("m");
    let t = tmp.path();
    let input = t.join("in.jsonl");
    let requests = "{\"id\": \"a\", \"prompt\": \"Hi\", \"max_tokens\": 2}\n";
    std::fs::write(&input, requests).unwrap();
    std::os::unix::fs::symlink(&input, t.join("link.jsonl")).unwrap();
    std::fs::hard_link(&input, t.join("hard.jsonl")).unwrap();
    std::fs::create_dir(t.join("sub")).unwrap();
    let precious = t.join("precious.txt");
    std::fs::write(&precious, "my notes\nnot results").unwrap();
    let torn_other = t.join("other.jsonl");
    std::fs::write(&torn_other, "{\"id\": \"x\", \"line\": 1, \"text\": \"t\"}\nsomething else").unwrap();
    let fifo = t.join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let refused = |out: &Path, stdin: Option<&Path>, want: &str| {
        let mut c = batch(&dir, if stdin.is_some() { Path::new("-") } else { &input }, out);
        if let Some(f) = stdin {
            c.stdin(std::fs::File::open(f).unwrap());
        }
        // A FIFO or device must be refused at once, not read (it would block or never end).
        let mut child = c.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
        let t0 = Instant::now();
        while child.try_wait().unwrap().is_none() {
            assert!(t0.elapsed() < Duration::from_secs(120), "--out {} hangs", out.display());
            std::thread::sleep(Duration::from_millis(20));
        }
        let o = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(o.status.code(), Some(1), "--out {}: {err}", out.display());
        assert!(err.contains(want), "--out {}: expected {want:?} in\n{err}", out.display());
    };
    for same in ["in.jsonl", "link.jsonl", "hard.jsonl", "sub/../in.jsonl"] {
        refused(&t.join(same), None, "is the same file as --in");
    }
    refused(&input, Some(&input), "is the same file as standard input");
    refused(&precious, None, "is not a batch output (line 1 is not JSON); refusing to append");
    refused(&torn_other, None, "is not a batch output (line 2 is not a result record");
    refused(&fifo, None, "is a FIFO, not a regular file");
    for dev in ["/dev/full", "/dev/null"] {
        refused(Path::new(dev), None, "is a character device, not a regular file");
    }
    refused(&t.join("sub"), None, "is a directory");
    refused(&t.join("no/such/dir/out.jsonl"), None, "does not exist");
    // Nothing was touched.
    assert_eq!(std::fs::read_to_string(&input).unwrap(), requests);
    assert_eq!(std::fs::read_to_string(&precious).unwrap(), "my notes\nnot results");
    assert!(std::fs::read_to_string(&torn_other).unwrap().ends_with("something else"));
    // An input that never ends is refused too; standard output stays open to `--out -`.
    let o = batch(&dir, Path::new("/dev/zero"), &t.join("out.jsonl")).output().unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("--in /dev/zero: is a character device"));
    assert!(!t.join("out.jsonl").exists());
    let o = batch(&dir, &input, Path::new("-")).output().unwrap();
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("\"id\":\"a\""));
    // --force replaces someone else's file with the results; the input never, even so.
    let o = batch(&dir, &input, &input).arg("--force").output().unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("is the same file as --in"));
    assert_eq!(std::fs::read_to_string(&input).unwrap(), requests);
    run_ok(batch(&dir, &input, &precious).arg("--force"));
    assert_eq!(records(&precious).len(), 1);
}

/// Ctrl-C on a batch: no new request starts, the running ones are cancelled and not recorded,
/// stderr says how many lines are done and how to go on (exit 130); the same command again
/// finishes the rest, each id once.
#[test]
fn ctrl_c_on_a_batch_says_what_is_done_and_a_rerun_goes_on() {
    let tmp = model();
    let dir = tmp.path().join("m");
    let input = tmp.path().join("in.jsonl");
    let lines: Vec<String> =
        (0..12).map(|i| format!(r#"{{"id": "q{i}", "prompt": "Prompt number {i}", "max_tokens": 300}}"#)).collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let out = tmp.path().join("out.jsonl");
    for parallel in ["1", "3"] {
        let _ = std::fs::remove_file(&out);
        let child = batch(&dir, &input, &out).args(["--parallel", parallel]).stderr(Stdio::piped()).spawn().unwrap();
        let t0 = Instant::now();
        while std::fs::read_to_string(&out).map_or(0, |s| s.lines().count()) < 2 {
            assert!(t0.elapsed() < Duration::from_secs(60), "no progress");
            std::thread::sleep(Duration::from_millis(5));
        }
        // SAFETY: signalling the child we started.
        unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        let o = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(130), "--parallel {parallel}: {err}");
        let done = records(&out);
        assert!(done.len() < 12, "interrupted before the end");
        assert!(done.iter().all(|r| r["finish_reason"] != "cancelled" && r.get("text").is_some()), "{done:?}");
        assert!(err.contains("interrupted (Ctrl-C)") && err.contains("run the same command again"), "{err}");
        assert!(err.contains(&format!("{} line(s) done in this run", done.len())), "{err}");
        let (_, err) = run_ok(batch(&dir, &input, &out).args(["--parallel", parallel]));
        assert!(err.contains(&format!("{} already in the output", done.len())), "{err}");
        let mut ids: Vec<String> = records(&out).iter().map(|r| r["id"].as_str().unwrap().to_string()).collect();
        ids.sort();
        ids.dedup();
        assert_eq!((ids.len(), records(&out).len()), (12, 12), "each id once");
    }
}

#[test]
fn a_line_that_is_not_utf8_is_that_lines_error_record() {
    let tmp = model();
    let dir = tmp.path().join("m");
    let input = tmp.path().join("in.jsonl");
    let mut bytes = b"{\"id\": \"a\", \"prompt\": \"Hi\", \"max_tokens\": 2}\n".to_vec();
    bytes.extend_from_slice(b"{\"id\": \"b\", \"prompt\": \"caf\xe9\", \"max_tokens\": 2}\r\n");
    bytes.extend_from_slice(b"{\"id\": \"c\", \"prompt\": \"Yo\", \"max_tokens\": 2}");
    std::fs::write(&input, &bytes).unwrap();
    let out = tmp.path().join("out.jsonl");
    let err = run_failing(&mut batch(&dir, &input, &out));
    assert!(err.contains("2 done, 1 failed") && err.contains(": line 2 ("), "{err}");
    let r = by_id(&records(&out));
    let bad = &r["line 2"]["error"];
    assert_eq!(bad["code"], "invalid_utf8", "{bad}");
    assert!(bad["message"].as_str().unwrap().contains("line 2 is not UTF-8 text (invalid bytes at byte 27"), "{bad}");
    assert!(r[r#""a""#].get("text").is_some() && r[r#""c""#].get("text").is_some());
    // A rerun runs it again (it may have been fixed): still not UTF-8, it fails again (exit 1),
    // its record replaced.
    let err = run_failing(&mut batch(&dir, &input, &out));
    assert!(err.contains("0 done, 1 failed, 2 already in the output"), "{err}");
    assert_eq!(records(&out).len(), 3, "one record a line");
}

#[test]
fn a_shared_prompt_prefix_is_prefilled_once_and_changes_no_answer() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in.jsonl");
    let system = "You are a careful assistant for a shipping company. Answer in one short paragraph, \
                  name the port, the vessel and the date, and never invent a figure you were not given. "
        .repeat(3);
    let lines: Vec<String> = (0..7)
        .map(|i| {
            let sampled =
                if i % 2 == 1 { format!(r#", "temperature": 0.8, "seed": {i}, "logprobs": true, "top_logprobs": 2"#) } else { String::new() };
            let m = serde_json::json!([{"role": "system", "content": system}, {"role": "user", "content": format!("Question {i}: where is ship {i}?")}]);
            format!(r#"{{"id": "p{i}", "messages": {m}, "max_tokens": {}{sampled}}}"#, 6 + 3 * i)
        })
        .collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let demo = |name: &str, extra: &[&str]| {
        let out = tmp.path().join(name);
        let mut c = deltafin_cmd();
        c.args(["batch", "--demo", "--temperature", "0", "-q", "--in"]).arg(&input).arg("--out").arg(&out).args(extra);
        let err = run_ok(&mut c).1;
        assert!(err.contains("7 done, 0 failed"), "{err}");
        // "prefill rows N" and, with sharing, "prefill rows N (L of them the shared prefix, once)".
        let at = err.find("prefill rows ").expect("the summary counts prefill rows") + "prefill rows ".len();
        let rows: u64 = err[at..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap();
        let shared = err[at..]
            .split_once(' ')
            .filter(|(_, rest)| rest.starts_with('('))
            .map(|(_, rest)| rest[1..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse::<u64>().unwrap());
        (by_id(&records(&out)), rows, shared)
    };
    let (want, rows_alone, _) = demo("alone.jsonl", &["--no-reuse"]);
    assert_eq!(want.len(), 7);
    let prompt_rows: u64 = want.values().map(|r| r["usage"]["prompt_tokens"].as_u64().unwrap()).sum();
    assert_eq!(rows_alone, prompt_rows, "without sharing every prompt row is prefilled");
    for extra in [&[][..], &["--parallel", "3"][..]] {
        let (got, rows, shared) = demo("shared.jsonl", extra);
        let _ = std::fs::remove_file(tmp.path().join("shared.jsonl"));
        let shared = shared.expect("the summary names the shared prefix");
        assert!(shared >= 64, "{extra:?}: a {shared}-token prefix");
        // The prefix's rows once, each request's own rows once.
        assert_eq!(rows, prompt_rows - 6 * shared, "{extra:?}");
        assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>());
        for (id, w) in &want {
            let (mut g, mut w) = (got[id].clone(), w.clone());
            assert_eq!(g["usage"]["prompt_tokens_details"]["cached_tokens"], shared, "{extra:?} {id}");
            assert_eq!(w["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{id}");
            g["usage"]["prompt_tokens_details"]["cached_tokens"] = 0.into();
            // The record less its counters and timings is the same, byte for byte.
            for r in [&mut g, &mut w] {
                r.as_object_mut().unwrap().remove("deltafin");
            }
            assert_eq!(g.to_string(), w.to_string(), "{extra:?} {id}");
        }
    }
}
