//! The built-in demo as a new user meets it, whichever demo this binary carries (the trained one
//! embedded from `demo/`, or the random synth one): several first-time runs at once on an empty
//! cache (real processes) all succeed with the same output; a damaged copy is found and replaced
//! and leftovers of killed runs removed; the startup line names the demo directory and the
//! random-weights label follows the model's config, not `--demo`; `--draft dspark` and
//! `--draft auto` use the drafter beside it without `--draft-model`; `serve`, `batch` and `score`
//! use the same demo; its generation_config.json gives `--demo`'s sampling defaults only.

mod common;
use common::*;
use deltafin::model::generation::GenerationDefaults;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

fn deltafin(cache: &Path) -> Command {
    let mut c = deltafin_cmd();
    c.env("DELTAFIN_CACHE", cache);
    c
}

fn demo_dir(cache: &Path) -> PathBuf {
    cache.join(deltafin::demo::model_name())
}

fn run_demo(cache: &Path, extra: &[&str]) -> (String, String) {
    run_ok(deltafin(cache).args(["run", "--demo", "--prompt", "Hello", "--max-new", "8"]).args(extra))
}

/// Entries of the cache directory that are leftovers of laying out (temporaries).
fn leftovers(cache: &Path) -> Vec<String> {
    std::fs::read_dir(cache)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("-tmp-") || n.contains("-old-"))
        .collect()
}

#[test]
fn first_runs_at_once_on_an_empty_cache_all_succeed_alike() {
    let cache = tempfile::tempdir().unwrap();
    // Greedy (the demo's own defaults may sample); every other run drafts, which changes no output.
    let children: Vec<_> = (0..6)
        .map(|i| {
            let mut c = deltafin(cache.path());
            c.args(["run", "--demo", "--prompt", "Hello", "--max-new", "8", "--temperature", "0", "-q"]);
            if i % 2 == 1 {
                c.args(["--draft", "dspark"]);
            }
            c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
        })
        .collect();
    let outs: Vec<String> = children
        .into_iter()
        .map(|c| {
            let o = c.wait_with_output().unwrap();
            assert!(o.status.success(), "a first-time run failed:\n{}", String::from_utf8_lossy(&o.stderr));
            String::from_utf8(o.stdout).unwrap()
        })
        .collect();
    assert!(!outs[0].trim().is_empty());
    assert!(outs.iter().all(|o| *o == outs[0]), "{outs:?}");
    assert!(demo_dir(cache.path()).join(deltafin::demo::MANIFEST).exists());
    assert!(cache.path().join(deltafin::demo::dspark_name()).join(deltafin::demo::MANIFEST).exists());
    assert_eq!(leftovers(cache.path()), Vec::<String>::new());
}

#[test]
fn a_damaged_copy_is_replaced_and_leftovers_of_killed_runs_removed() {
    let cache = tempfile::tempdir().unwrap();
    let (first, _) = run_demo(cache.path(), &["--temperature", "0", "-q"]);
    let dir = demo_dir(cache.path());
    // The largest file (a shard), cut to half its size.
    let (shard, size) = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.path(), e.metadata().unwrap().len())
        })
        .max_by_key(|(_, n)| *n)
        .unwrap();
    std::fs::OpenOptions::new().write(true).open(&shard).unwrap().set_len(size / 2).unwrap();
    // A temporary left by a run that was killed (its process is gone).
    let mut gone = Command::new("true").spawn().unwrap();
    let pid = gone.id();
    gone.wait().unwrap();
    let stale = cache.path().join(format!(".{}.demo-tmp-{pid}", deltafin::demo::model_name()));
    std::fs::create_dir_all(&stale).unwrap();
    std::fs::write(stale.join("config.json"), "{").unwrap();
    let (again, err) = run_demo(cache.path(), &["--temperature", "0", "-q"]);
    assert!(err.contains("is not an intact copy of the demo") && err.contains("replacing it"), "{err}");
    assert!(err.contains("left by an interrupted run"), "{err}");
    assert_eq!(std::fs::metadata(&shard).unwrap().len(), size);
    assert!(!stale.exists());
    assert_eq!(again, first);
    // An intact copy is used as it is.
    let (_, err) = run_demo(cache.path(), &["--temperature", "0", "-q"]);
    assert!(!err.contains("replacing") && !err.contains("creating"), "{err}");
}

#[test]
fn the_startup_line_names_the_demo_and_the_random_label_follows_the_config() {
    let cache = tempfile::tempdir().unwrap();
    let (_, err) = run_demo(cache.path(), &["--temperature", "0"]);
    let dir = demo_dir(cache.path());
    assert!(err.contains(&format!("deltafin: {} ", dir.display())), "{err}");
    let random = deltafin::model::synth::is_synthetic(&dir);
    assert_eq!(err.contains("[RANDOM WEIGHTS]"), random, "{err}");
    assert_eq!(err.contains("has RANDOM weights"), random, "{err}");
    // A model with trained weights (no synth marker) is not labelled, with or without --demo.
    let o = deltafin(cache.path())
        .args(["run", "--model"])
        .arg(fixture("k3-tiny-a"))
        .args(["--prompt-ids", "1,2,3", "--max-new", "2"])
        .output()
        .unwrap();
    assert!(o.status.success());
    assert!(!String::from_utf8_lossy(&o.stderr).contains("RANDOM"));
    // A synth model is labelled without --demo.
    let m = cache.path().join("m");
    synth_small(&m, None);
    let (_, err) =
        run_ok(deltafin(cache.path()).args(["run", "--model"]).arg(&m).args(["--prompt", "Hi", "--max-new", "2"]));
    assert!(err.contains("[RANDOM WEIGHTS]") && err.contains("has RANDOM weights"), "{err}");
}

#[test]
fn draft_dspark_and_auto_use_the_drafter_beside_the_demo() {
    let cache = tempfile::tempdir().unwrap();
    let (plain, _) = run_demo(cache.path(), &["--temperature", "0", "--format", "json", "-q"]);
    let drafter = cache.path().join(deltafin::demo::dspark_name());
    for kind in ["dspark", "auto"] {
        let (out, err) = run_demo(cache.path(), &["--temperature", "0", "--format", "json", "--draft", kind]);
        assert!(err.contains(&format!("drafting: drafter {kind}")), "--draft {kind}: {err}");
        assert!(err.contains(&format!("dspark {}", drafter.display())), "--draft {kind}: {err}");
        let (a, b): (Value, Value) = (serde_json::from_str(&plain).unwrap(), serde_json::from_str(&out).unwrap());
        assert_eq!(a["output_ids"], b["output_ids"], "--draft {kind} changes no output");
    }
    assert!(drafter.join("config.json").exists());
    // --draft-model still wins over the demo's drafter; without --demo nothing is laid out.
    let o = deltafin(cache.path())
        .args(["run", "--demo", "--prompt", "Hi", "--draft", "dspark", "--draft-model"])
        .arg(cache.path().join("none"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("none"));
}

/// The demo's sampling defaults as the file says (greedy when it has none).
fn demo_defaults(dir: &Path) -> (f64, f64) {
    let g = GenerationDefaults::load(dir).unwrap().unwrap_or_default();
    (g.sampling.temperature.unwrap_or(0.0), g.sampling.top_p.unwrap_or(1.0))
}

/// A server for `args` on 127.0.0.1; returns it, its base URL and its stderr up to listening.
struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(cache: &Path, args: &[&str]) -> (Server, String, String) {
    let mut child = deltafin(cache)
        .arg("serve")
        .args(args)
        .args(["--port", "0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let err = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        let mut seen = String::new();
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            seen.push_str(&line);
            seen.push('\n');
            if let Some(rest) = line.split("on http://").nth(1) {
                let _ = tx.send((rest.split_whitespace().next().unwrap_or_default().to_string(), seen.clone()));
            }
        }
    });
    let (addr, seen) = rx.recv_timeout(Duration::from_secs(60)).expect("the server did not start");
    (Server(child), format!("http://{addr}"), seen)
}

fn post(base: &str, body: &Value) -> Value {
    // A plain HTTP/1.1 request: this test is about the demo's defaults, not the client.
    use std::io::{Read, Write};
    let mut t = std::net::TcpStream::connect(base.trim_start_matches("http://")).unwrap();
    t.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let body = body.to_string();
    write!(
        t,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    t.read_to_string(&mut out).unwrap();
    let (head, json) = out.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no HTTP response: {out:?}"));
    assert!(head.starts_with("HTTP/1.1 200"), "{head}\n{json}");
    serde_json::from_str(json).unwrap()
}

#[test]
fn generation_config_gives_the_demo_defaults_for_run_serve_and_batch() {
    let cache = tempfile::tempdir().unwrap();
    let (greedy, _) = run_demo(cache.path(), &["--temperature", "0", "--format", "json", "-q"]);
    let greedy: Value = serde_json::from_str(&greedy).unwrap();
    let dir = demo_dir(cache.path());
    // A demo without sampling defaults gets some here (a file the copy's manifest does not hold).
    if !dir.join("generation_config.json").exists() {
        std::fs::write(dir.join("generation_config.json"), r#"{"temperature": 0.9, "top_p": 0.95}"#).unwrap();
    }
    let (t, p) = demo_defaults(&dir);
    let sampled = |extra: &[&str]| {
        let (out, err) = run_demo(cache.path(), &[&["--format", "json"], extra].concat());
        (serde_json::from_str::<Value>(&out).unwrap(), err)
    };
    let (a, err) = sampled(&["--seed", "3"]);
    if t > 0.0 {
        assert!(err.contains(&format!("sampling: temperature {t} top-p {p} seed 3")), "{err}");
    }
    assert_eq!(a["sampling"]["temperature"], t);
    assert_eq!(a["sampling"]["top_p"], p);
    let (b, _) = sampled(&["--seed", "3"]);
    assert_eq!(a["output_ids"], b["output_ids"], "the same seed gives the same text");
    // Without --seed a fresh one is drawn and printed.
    let (_, err) = sampled(&[]);
    if t > 0.0 {
        assert!(err.contains("sampling: temperature") && err.contains(" seed "), "{err}");
    }
    // --temperature 0 stays greedy; so does --model DIR, the same files without --demo.
    let (g, err) = sampled(&["--temperature", "0"]);
    assert!(!err.contains("sampling:"), "{err}");
    assert_eq!(g["output_ids"], greedy["output_ids"]);
    let (out, err) = run_ok(deltafin(cache.path()).args(["run", "--model"]).arg(&dir).args([
        "--prompt",
        "Hello",
        "--max-new",
        "8",
        "--format",
        "json",
    ]));
    assert!(!err.contains("sampling:"), "{err}");
    assert_eq!(serde_json::from_str::<Value>(&out).unwrap()["output_ids"], greedy["output_ids"]);
    // --top-p alone keeps the file's temperature.
    let (c, _) = sampled(&["--seed", "3", "--top-p", "0.5"]);
    assert_eq!((&c["sampling"]["temperature"], &c["sampling"]["top_p"]), (&Value::from(t), &Value::from(0.5)));

    // batch --demo: a line without temperature samples like run --demo with its seed.
    let (input, results) = (cache.path().join("in.jsonl"), cache.path().join("out.jsonl"));
    std::fs::write(&input, r#"{"id": "a", "prompt": "Hello", "max_tokens": 8, "seed": 3}"#).unwrap();
    let (_, err) =
        run_ok(deltafin(cache.path()).args(["batch", "--demo", "--in"]).arg(&input).arg("--out").arg(&results));
    assert!(err.contains(&format!("deltafin: {} ", dir.display())), "batch uses the same demo: {err}");
    let r: Value = serde_json::from_str(std::fs::read_to_string(&results).unwrap().trim()).unwrap();
    assert_eq!(r["text"], a["text"], "{r}");

    // serve --demo: the same, for a request that sets no temperature.
    let (_server, base, seen) = serve(cache.path(), &["--demo"]);
    assert!(seen.contains(&format!("deltafin: {} ", dir.display())), "serve uses the same demo: {seen}");
    let model = deltafin::demo::model_name();
    let answer = post(&base, &serde_json::json!({"model": model, "prompt": "Hello", "max_tokens": 8, "seed": 3}));
    assert_eq!(answer["choices"][0]["text"], a["text"], "{answer}");
    let answer =
        post(&base, &serde_json::json!({"model": model, "prompt": "Hello", "max_tokens": 8, "temperature": 0}));
    assert_eq!(answer["choices"][0]["text"], g["text"], "{answer}");
    if t > 0.0 {
        assert!(seen.contains(&format!("use temperature {t} top-p {p}")), "{seen}");
    }
}

#[test]
fn score_uses_the_demo_too() {
    let cache = tempfile::tempdir().unwrap();
    let text = cache.path().join("t.txt");
    std::fs::write(&text, "The engine reads each expert once. ".repeat(4)).unwrap();
    let (out, _) = run_ok(
        deltafin(cache.path())
            .args(["score", "--demo", "--text"])
            .arg(&text)
            .args(["--format", "json", "--window", "8"]),
    );
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["model"].as_str().unwrap(), demo_dir(cache.path()).to_str().unwrap());
    assert!(v["ppl"].as_f64().unwrap() > 1.0 && v["windows"].as_u64().unwrap() > 1, "{v}");
}
