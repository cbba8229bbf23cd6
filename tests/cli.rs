//! The `run` and `score` subcommands end to end (real binary, real files), including bit-identical
//! results whatever instruction set and thread count the kernels use; the help a new user meets:
//! every option of every subcommand described, examples, tips on usage errors, `run --help` under
//! headings with a short `-h`, `--version`, shell completions, `--demo` wherever a model is taken;
//! `plan` saying when K3 cannot fit; and how a run ends: `| head` quietly, Ctrl-C with what was
//! done, a one-line summary, counters only when they mean something, prefill progress on request.

mod common;
use common::*;

fn score_file(name: &str, out: &std::path::Path, isa: Option<&str>, threads: Option<usize>) {
    let r = reference(name);
    let mut cmd = deltafin_cmd();
    cmd.arg("score");
    if let Some(t) = threads {
        cmd.args(["--threads", &t.to_string()]);
    }
    cmd.args(["--model"]).arg(fixture(name)).args(["--prompt-ids", &ids_arg(&r.prompt), "--logits-out"]).arg(out);
    if let Some(i) = isa {
        cmd.env("DELTAFIN_ISA", i);
    }
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn score_writes_logits_matching_the_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("logits.safetensors");
    score_file("k3-tiny-b", &out, None, None);
    let (got, shape) = read_f32_tensor(&out, "logits");
    let r = reference("k3-tiny-b");
    assert_eq!(shape, vec![r.prompt.len(), r.vocab]);
    let (err, _) = max_rel_l2(&got, &r.logits, r.vocab);
    assert!(err < 1e-4, "{err}");
}

#[test]
fn every_instruction_set_and_thread_count_gives_the_same_bits() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base.safetensors");
    score_file("k3-tiny-a", &base, Some("scalar"), Some(1));
    let want = std::fs::read(&base).unwrap();
    for isa in deltafin::cpu::Isa::available() {
        for threads in [1, 2] {
            let out = tmp.path().join(format!("{}-{threads}.safetensors", isa.name()));
            score_file("k3-tiny-a", &out, Some(isa.name()), Some(threads));
            assert!(std::fs::read(&out).unwrap() == want, "{} with {threads} threads differs from scalar", isa.name());
        }
    }
}

#[test]
fn run_json_reports_ids_and_stats() {
    let r = reference("k3-tiny-c");
    let o = deltafin_cmd()
        .args(["run", "--model"])
        .arg(fixture("k3-tiny-c"))
        .args(["--prompt-ids", &ids_arg(&r.prompt), "--max-new", "32", "--ignore-eos", "--format", "json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let ids = |k: &str| v[k].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect::<Vec<_>>();
    assert_eq!(ids("prompt_ids"), r.prompt);
    assert_eq!(ids("output_ids"), r.greedy);
    let stats = &v["stats"];
    assert_eq!(stats["generated_tokens"], 32);
    assert_eq!(stats["prompt_tokens"], r.prompt.len());
    // One pass over the MoE layers for the prompt, then one per decoded token.
    assert_eq!(stats["layer_passes"], 3 * 32);
    assert!(stats["decode_tok_s"].as_f64().unwrap() > 0.0);
}

#[test]
fn run_text_streams_comma_separated_ids() {
    let r = reference("k3-tiny-c");
    let o = deltafin_cmd()
        .args(["run", "--model"])
        .arg(fixture("k3-tiny-c"))
        .args(["--prompt-ids", &ids_arg(&r.prompt), "--max-new", "5", "--ignore-eos"])
        .output()
        .unwrap();
    assert!(o.status.success());
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), ids_arg(&r.greedy[..5]));
}

#[test]
fn run_stops_at_end_of_message() {
    // The fixture's eos id is vocab-2; force it by starting generation where the reference emits it
    // is not possible with random weights, so check the flag's effect instead: with eos set to the
    // first greedy token, generation ends after one token.
    let r = reference("k3-tiny-c");
    let tmp = copy_fixture("k3-tiny-c");
    let p = tmp.path().join("config.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    v["text_config"]["eos_token_id"] = r.greedy[0].into();
    std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
    let o = deltafin_cmd()
        .args(["run", "--model"])
        .arg(tmp.path())
        .args(["--prompt-ids", &ids_arg(&r.prompt), "--max-new", "10"])
        .output()
        .unwrap();
    assert!(o.status.success());
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), r.greedy[0].to_string());
}

#[test]
fn engine_options_that_cannot_apply_are_errors_not_silent() {
    let r = reference("k3-tiny-a");
    let ids = ids_arg(&r.prompt[..8]);
    let run = |extra: &[&str], env: Option<(&str, &str)>| {
        let mut cmd = deltafin_cmd();
        cmd.args(["run", "--model"]).arg(fixture("k3-tiny-a")).args(["--prompt-ids", &ids, "--max-new", "2", "-q"]);
        cmd.args(extra);
        if let Some((k, v)) = env {
            cmd.env(k, v);
        }
        cmd.output().unwrap()
    };
    // A misspelled instruction set is named, with what is available.
    let o = run(&[], Some(("DELTAFIN_ISA", "avx521")));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("DELTAFIN_ISA=\"avx521\"") && err.contains("scalar"), "{err}");
    // A placement cannot be used when experts come from the mapped shards.
    let o = run(&["--experts-from", "mmap", "--placement", "/nonexistent/placement.json"], None);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("--experts-from mmap"), "{err}");
    let o = run(&["--memory-gb", "nan"], None);
    assert!(String::from_utf8_lossy(&o.stderr).contains("--memory-gb"), "{}", String::from_utf8_lossy(&o.stderr));
    // Options in conflict are the options' fault, not the model's: no "cannot open the model".
    let o = run(&["--gpu-cache-gb", "2"], None);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("--gpu-cache-gb 2") && !err.contains("cannot open the model"), "{err}");
    // Backend names are taken in any case; the JSON says which backend ran.
    let o = run(&["--backend", "CPU", "--format", "json"], None);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["backend_used"].as_str().is_some_and(|b| b.starts_with("cpu")), "{v}");
    // Library diagnostics go through DELTAFIN_LOG: the resolved engine config is an info event.
    let quiet = run(&[], None);
    assert!(!String::from_utf8_lossy(&quiet.stderr).contains("engine config"));
    let o = run(&[], Some(("DELTAFIN_LOG", "info")));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success() && err.contains("deltafin: info: engine config") && err.contains("\"prefill_rows\":4096"),
        "{err}"
    );
}

#[test]
fn bench_kernels_options_out_of_range_are_errors_before_any_work() {
    let bench = |args: &[&str]| {
        let o = deltafin_cmd().args(["bench", "kernels"]).args(args).output().unwrap();
        (o.status.code(), String::from_utf8_lossy(&o.stderr).into_owned())
    };
    for (args, says) in [
        (&["--rows", "0"][..], "--rows, --heads and --reps must be at least 1"),
        (&["--reps", "0"][..], "--reps must be at least 1"),
        (&["--rows", "300000"][..], "--rows 300000: at most 16384"),
        (
            &["--backend", "gpu", "--matvec-variants", "/nonexistent/variants"][..],
            "/nonexistent/variants: not a directory",
        ),
        (&["--matvec-rows", "49152"][..], "add --backend gpu"),
        (&["--matmul-variants", "/tmp"][..], "add --backend gpu"),
        (
            &["--backend", "gpu", "--matmul-variants", "/nonexistent/variants"][..],
            "--matmul-variants /nonexistent/variants: not a directory",
        ),
        (&["--backend", "gpu", "--matvec-rows", "17"][..], "--matvec-rows must be a positive multiple of 16, got 17"),
    ] {
        let (code, err) = bench(args);
        assert_eq!(code, Some(1), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// Every subcommand's `--help`, by its words (`["bench", "io"]`).
const SUBCOMMANDS: &[&[&str]] = &[
    &["run"],
    &["score"],
    &["synth"],
    &["place"],
    &["bench"],
    &["bench", "io"],
    &["bench", "kernels"],
    &["bench", "run"],
    &["setup"],
    &["batch"],
    &["serve"],
    &["plan"],
    &["pack-trunk"],
    &["completions"],
];

fn help(words: &[&str]) -> String {
    let o = deltafin_cmd().args(words).arg("--help").output().unwrap();
    assert!(o.status.success(), "{words:?} --help: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

/// The options of a long `--help` text whose description is missing: nothing but a default or
/// the list of possible values under the option's line.
fn undescribed(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let t = l.trim_start();
        let indent = l.len() - t.len();
        if !(2..=6).contains(&indent) || !(t.starts_with("--") || t.starts_with("-")) || t.starts_with("- ") {
            continue;
        }
        let name = t.split([' ', ',']).find(|w| w.starts_with("--")).unwrap_or(t).to_string();
        // Short help puts the description on the option's line, long help under it.
        let same_line = t.split_whitespace().any(|w| !w.starts_with('-') && !w.starts_with('<') && !w.ends_with('>'));
        if same_line {
            continue;
        }
        let desc = lines.get(i + 1).map(|n| n.trim()).unwrap_or("");
        if desc.is_empty() || desc.starts_with("[default") || desc.starts_with("Possible values") {
            out.push(name);
        }
    }
    out
}

#[test]
fn help_describes_every_option_with_examples_and_no_files_the_user_lacks() {
    let mut blank = Vec::new();
    for words in SUBCOMMANDS {
        let text = help(words);
        for name in undescribed(&text) {
            blank.push(format!("{} {name}", words.join(" ")));
        }
        if words.len() == 1 {
            assert!(text.contains("Examples:\n  deltafin "), "{words:?}: no examples in\n{text}");
        }
        for file in ["DESIGN.md", "K3.md", "docs/", "bench/", ".sh"] {
            assert!(!text.contains(file), "{words:?} --help cites {file}, which a user of the binary lacks");
        }
    }
    assert!(blank.is_empty(), "options without a description: {blank:?}");
    // Only the subcommands whose kernels use threads take --threads.
    for words in [&["setup"][..], &["place"], &["bench", "io"]] {
        assert!(!help(words).contains("--threads"), "{words:?} offers --threads, which does nothing there");
    }
    for words in
        [&["run"][..], &["score"], &["synth"], &["serve"], &["batch"], &["bench", "run"], &["bench", "kernels"]]
    {
        assert!(help(words).contains("--threads"), "{words:?}");
    }
}

#[test]
fn usage_errors_point_the_way() {
    let err = |args: &[&str]| {
        let o = deltafin_cmd().args(args).output().unwrap();
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    // A swapped pair of letters is not a near spelling to clap; it is to us.
    let e = err(&["rnu", "--demo"]);
    assert!(e.contains("unrecognized subcommand 'rnu'") && e.contains("'run'"), "{e}");
    assert!(err(&["sreve"]).contains("'serve'"));
    assert!(!err(&["frobnicate"]).contains("similar"));
    // No model: the demo is one flag away.
    for sub in ["run", "score", "serve", "batch"] {
        let e = err(&[sub, "--prompt-ids", "1"]);
        if e.contains("--model") {
            assert!(e.contains(&format!("deltafin {sub} --demo")), "{sub}: {e}");
        }
    }
    let e = err(&["run", "--prompt", "Hello"]);
    assert!(e.contains("--model") && e.contains("deltafin run --demo"), "{e}");
}

/// The GPU kernel microbench is not in the shipped binary (feature `gpu-bench`): asking for it
/// says how to get it, before any work.
#[cfg(not(feature = "gpu-bench"))]
#[test]
fn the_gpu_kernel_microbench_is_not_in_the_shipped_binary() {
    let o = deltafin_cmd().args(["bench", "kernels", "--backend", "gpu"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("feature gpu-bench"), "{err}");
}

#[test]
fn run_help_is_grouped_common_options_first_and_short_help_is_short() {
    let long = help(&["run"]);
    let short = {
        let o = deltafin_cmd().args(["run", "-h"]).output().unwrap();
        String::from_utf8(o.stdout).unwrap()
    };
    let at = |text: &str, s: &str| text.find(s).unwrap_or_else(|| panic!("no {s:?} in\n{text}"));
    for text in [&long, &short] {
        assert!(at(text, "Model:") < at(text, "Prompt:") && at(text, "Prompt:") < at(text, "Generation:"));
        assert!(at(text, "Generation:") < at(text, "Output:") && at(text, "Output:") < at(text, "\nEngine:"));
        assert!(at(text, "--prompt <PROMPT>") < at(text, "--memory-gb"), "common options first");
    }
    // The tuning knobs only in --help.
    for knob in ["--split-reads", "--hedge", "--qd", "--reader", "--expert-heat", "Engine tuning:"] {
        assert!(long.contains(knob) && !short.contains(knob), "{knob}");
    }
    assert!(short.lines().count() < 70, "run -h is {} lines:\n{short}", short.lines().count());
}

#[test]
fn version_names_the_commit_features_and_instruction_set() {
    let o = deltafin_cmd().arg("--version").output().unwrap();
    let v = String::from_utf8(o.stdout).unwrap();
    assert!(o.status.success());
    let rev = deltafin::util::git_revision();
    assert!(v.starts_with(&format!("deltafin {} (commit {rev})", env!("CARGO_PKG_VERSION"))), "{v}");
    assert!(v.contains("\nfeatures: ") && v.contains("\ncpu kernels: ") && v.contains("\ntarget: "), "{v}");
    let isa = deltafin::cpu::isa().name();
    assert!(v.contains(&format!("cpu kernels: {isa}")), "{v}");
    assert_eq!(v.contains("gpu (Vulkan, Metal)"), cfg!(feature = "gpu"), "{v}");
    let o = deltafin_cmd().arg("-V").output().unwrap();
    assert_eq!(
        String::from_utf8(o.stdout).unwrap().trim(),
        format!("deltafin {} (commit {rev})", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn completions_for_every_shell() {
    for (shell, mark) in [
        ("bash", "complete -F"),
        ("zsh", "#compdef deltafin"),
        ("fish", "complete -c deltafin"),
        ("elvish", "deltafin"),
        ("powershell", "deltafin"),
    ] {
        let (out, _) = run_ok(deltafin_cmd().args(["completions", shell]));
        assert!(out.contains(mark) && out.contains("prompt-lines"), "{shell}: {}", &out[..out.len().min(300)]);
    }
    let o = deltafin_cmd().args(["completions", "tcsh"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn demo_is_taken_wherever_a_model_is() {
    for words in [
        &["run"][..],
        &["score"],
        &["batch"],
        &["serve"],
        &["place"],
        &["pack-trunk"],
        &["bench", "run"],
        &["bench", "io"],
    ] {
        assert!(help(words).contains("--demo"), "{words:?} takes --model but not --demo");
    }
}

#[test]
fn negative_sampling_values_are_range_errors_not_unknown_flags() {
    for (args, says) in [
        (&["--temperature", "-1"][..], "`-1` is not a temperature (expected a number from 0, greedy, to 2)"),
        (&["--temperature", "2.5"], "`2.5` is not a temperature"),
        (&["--top-p", "-0.5"], "`-0.5` is not a top-p"),
    ] {
        let o = deltafin_cmd().args(["run", "--demo", "--prompt", "hi"]).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says) && !err.contains("unexpected argument"), "{args:?}: {err}");
    }
}

#[test]
fn plan_says_plainly_when_k3_cannot_fit_and_what_would() {
    let plan = |gb: &str| run_ok(deltafin_cmd().args(["plan", "--memory-gb", gb])).0;
    for gb in ["16", "64"] {
        let out = plan(gb);
        assert!(out.contains(&format!("Kimi K3 CANNOT RUN on {gb} GB")), "{out}");
        assert_eq!(out.matches("DOES NOT FIT: needs").count(), 3, "{out}");
        assert!(out.contains("The least memory that works, per trunk: bf16 "), "{out}");
        assert_eq!(out.matches(" / ").count(), 3, "no decode bounds (only the header's) where it cannot run:\n{out}");
    }
    assert!(plan("16").contains("alone is"), "16 GB: the trunk alone does not fit");
    let out = plan("100");
    assert!(
        out.contains("runs only with the coded or int8 (not exact) trunk") && out.matches("DOES NOT FIT").count() == 1,
        "{out}"
    );
    let out = plan("256");
    assert!(!out.contains("DOES NOT FIT") && !out.contains("CANNOT") && out.matches(" / ").count() >= 9, "{out}");
    let (j, _) = run_ok(deltafin_cmd().args(["plan", "--memory-gb", "100", "--json"]));
    let j: serde_json::Value = serde_json::from_str(&j).unwrap();
    let fits: Vec<bool> = j["plans"].as_array().unwrap().iter().map(|p| p["fits"].as_bool().unwrap()).collect();
    assert_eq!(fits, [false, true, true]);
    assert!(j["plans"][0]["min_memory_bytes"].as_u64().unwrap() > 100_000_000_000);
}

/// `run --demo` with a long generation, stdout piped.
fn long_run(extra: &[&str]) -> std::process::Command {
    let mut c = deltafin_cmd();
    c.args([
        "run",
        "--demo",
        "--prompt",
        "Once upon a time",
        "--max-new",
        "3000",
        "--ignore-eos",
        "--temperature",
        "0",
    ]);
    c.args(extra).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    c
}

#[test]
fn a_reader_that_closes_the_pipe_ends_run_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let stats = tempfile::tempdir().unwrap();
    let file = stats.path().join("stats.json");
    let mut run = long_run(&["--stats"]).arg("--stats-json").arg(&file).spawn().unwrap();
    let head = std::process::Command::new("head")
        .args(["-c", "20"])
        .stdin(std::process::Stdio::from(run.stdout.take().unwrap()))
        .output()
        .unwrap();
    assert_eq!(head.stdout.len(), 20);
    let o = run.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    // Killed by SIGPIPE as `cat` would be (the shell's 141), without a word about it.
    assert_eq!(o.status.signal(), Some(libc::SIGPIPE), "{:?}: {err}", o.status);
    assert!(!err.contains("rror") && !err.contains("Broken pipe"), "{err}");
    // What goes elsewhere was still done: the summary and counters on stderr, the stats file.
    assert!(err.contains("prompt tokens, first token after") && err.contains("stats:"), "{err}");
    let j: serde_json::Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    assert!(j["generated_tokens"].as_u64().unwrap() < 3000, "generation stopped with the reader");
}

/// Sends SIGINT to `child` once `ready` holds for what it wrote to stderr so far (read by a thread).
fn interrupt_when(child: &mut std::process::Child, ready: impl Fn(&str) -> bool) -> String {
    use std::io::Read;
    let mut stderr = child.stderr.take().unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let s2 = seen.clone();
    let reader = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = stderr.read(&mut buf) {
            if n == 0 {
                break;
            }
            s2.lock().unwrap().push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    let t0 = std::time::Instant::now();
    while !ready(&seen.lock().unwrap()) {
        assert!(t0.elapsed().as_secs() < 120, "never ready: {}", seen.lock().unwrap());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // Long enough for a first token on a loaded machine (the JSON prints nothing before the end).
    std::thread::sleep(std::time::Duration::from_millis(1500));
    // SAFETY: signalling our own child.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    reader.join().unwrap();
    seen.lock().unwrap().clone()
}

#[test]
fn ctrl_c_on_run_prints_what_was_done() {
    // JSON: the object with what was generated, marked interrupted; stats to stderr; exit 130.
    let mut child = long_run(&["--format", "json", "--stats"]).spawn().unwrap();
    let err = interrupt_when(&mut child, |e| e.contains("context <="));
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(130), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["interrupted"], true);
    let n = v["output_ids"].as_array().unwrap().len();
    assert!(n > 0 && n < 3000, "{n} tokens");
    assert_eq!(v["stats"]["generated_tokens"].as_u64().unwrap() as usize, n, "the counters cover what was printed");
    assert!(
        err.contains(&format!("interrupted (Ctrl-C) after {n} generated tokens")) && err.contains("stats:"),
        "{err}"
    );
    // Text: the text so far, then the summary.
    let mut child = long_run(&[]).spawn().unwrap();
    let err = interrupt_when(&mut child, |e| e.contains("context <="));
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(130), "{err}");
    assert!(!o.stdout.is_empty() && err.contains("prompt tokens, first token after"), "{err}");
}

#[test]
fn a_run_ends_with_a_summary_and_counters_that_mean_something() {
    let (_, err) = run_ok(deltafin_cmd().args([
        "run",
        "--demo",
        "--prompt",
        "Hello",
        "--max-new",
        "8",
        "--ignore-eos",
        "--temperature",
        "0",
        "--stats",
    ]));
    let summary =
        err.lines().find(|l| l.contains("prompt tokens, first token after")).unwrap_or_else(|| panic!("{err}"));
    assert!(
        summary.contains("tok/s prefill") && summary.contains("8 tokens at") && summary.contains("of experts read"),
        "{summary}"
    );
    // The startup line is short; -v gives the engine's full one.
    let start = err.lines().find(|l| l.contains("context <=")).unwrap_or_else(|| panic!("{err}"));
    assert!(start.len() < 250 && start.contains("context <=") && start.contains("(-v: details)"), "{start}");
    // No drafts, no second copies, no GPU: their counters are not shown.
    for key in ["drafts_proposed", "draft_acceptance", "verify_s", "hedged_reads", "device_expert_hits"] {
        assert!(!err.lines().any(|l| l.split_whitespace().next() == Some(key)), "{key} shown:\n{err}");
    }
    assert!(err.contains("read_amplification") && err.contains("prefill_tok_s"), "{err}");
    let (_, err) = run_ok(deltafin_cmd().args([
        "run",
        "--demo",
        "--prompt",
        "Hello",
        "--max-new",
        "8",
        "-v",
        "--stats",
        "--draft",
        "dspark",
    ]));
    assert!(err.contains("memory: trunk") && err.contains("prefill rows"), "-v: the full startup line\n{err}");
    assert!(err.lines().any(|l| l.split_whitespace().next() == Some("drafts_proposed")), "drafting: shown\n{err}");
    // -q: nothing but the answer.
    let (_, err) = run_ok(deltafin_cmd().args(["run", "--demo", "--prompt", "Hello", "--max-new", "4", "-q"]));
    assert!(!err.contains("context <=") && !err.contains("first token after"), "{err}");
}

#[test]
fn prefill_progress_shows_when_asked_and_never_in_pipes() {
    let prompt = "The sea was calm and the ship sailed on. ".repeat(12);
    let run = |progress: Option<&str>| {
        let mut c = deltafin_cmd();
        c.args(["run", "--demo", "--prompt", &prompt, "--max-new", "2", "--temperature", "0"]);
        match progress {
            Some(p) => c.env("DELTAFIN_PROGRESS", p),
            None => c.env_remove("DELTAFIN_PROGRESS"),
        };
        run_ok(&mut c).1
    };
    let shown = run(Some("1"));
    let line = shown.lines().find(|l| l.starts_with("deltafin: prefill: ")).unwrap_or_else(|| panic!("{shown}"));
    assert!(line.contains(" tokens, layer ") && line.contains(" of experts"), "{line}");
    assert!(!run(None).contains("deltafin: prefill:"), "stderr is a pipe: no progress");
    assert!(!run(Some("0")).contains("deltafin: prefill:"));
}

#[test]
fn several_prompts_answers_come_under_separators() {
    let (out, _) = run_ok(deltafin_cmd().args([
        "run",
        "--demo",
        "--temperature",
        "0",
        "--max-new",
        "6",
        "-q",
        "--prompt",
        "The ship",
        "--prompt",
        "In the beginning",
    ]));
    let heads: Vec<&str> = out.lines().filter(|l| l.starts_with("--- ")).collect();
    assert_eq!(heads, ["--- 1/2: The ship ---", "--- 2/2: In the beginning ---"], "{out}");
}

#[test]
fn ctrl_c_on_synth_removes_its_temporary_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    let mut child = deltafin_cmd()
        .args(["synth", "--preset", "k3-experts", "--layers", "2", "--experts", "16", "--out"])
        .arg(&out)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Once its hidden temporary directory holds part of a shard.
    let writing = || {
        std::fs::read_dir(tmp.path()).unwrap().flatten().any(|e| {
            e.file_name().to_string_lossy().contains(".synth-tmp-")
                && std::fs::read_dir(e.path()).into_iter().flatten().flatten().any(|f| {
                    f.file_name().to_string_lossy().ends_with(".safetensors") && f.metadata().is_ok_and(|m| m.len() > 0)
                })
        })
    };
    let t0 = std::time::Instant::now();
    while !writing() {
        assert!(child.try_wait().unwrap().is_none(), "synth ended before it could be interrupted");
        assert!(t0.elapsed().as_secs() < 120, "synth never started writing");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    // SAFETY: signalling our own child.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(130), "{err}");
    assert!(err.contains("interrupted: the partly written model was removed"), "{err}");
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// `plan` as a user on this machine runs it: its memory by default, a context K3 cannot hold
/// refused, and no decode bound below reading the trunk from memory (a huge machine is not 0.00 s
/// a token).
#[test]
fn plan_defaults_to_this_machine_refuses_contexts_past_k3_and_floors_its_bounds() {
    let (out, err) = run_ok(deltafin_cmd().arg("plan"));
    assert!(err.contains("this machine's memory"), "{err}");
    assert!(out.contains("Kimi K3 on "), "{out}");
    let o = deltafin_cmd().args(["plan", "--memory-gb", "256", "--context", "99999999"]).output().unwrap();
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("at most"), "{o:?}");
    let (j, _) = run_ok(deltafin_cmd().args(["plan", "--memory-gb", "4000", "--json"]));
    let j: serde_json::Value = serde_json::from_str(&j).unwrap();
    for p in j["plans"].as_array().unwrap() {
        for b in p["decode_s_per_token"].as_array().unwrap() {
            assert!(b[1].as_f64().unwrap() > 0.3, "a bound below reading the trunk from memory: {p}");
        }
    }
}

/// Small things users of llama.cpp and Ollama trip on: `--prompt-ids 1,,2` is an error (not 1,2),
/// `DELTAFIN_LOG=verbose` is taken (and an unknown value said), `setup --json` fails in JSON.
#[test]
fn empty_ids_unknown_log_levels_and_setup_json_failures_are_said() {
    let o = deltafin_cmd().args(["run", "--demo", "--prompt-ids", "1,,2"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("empty entry"), "{o:?}");
    let o = deltafin_cmd().env("DELTAFIN_LOG", "loud").args(["plan", "--memory-gb", "64"]).output().unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("DELTAFIN_LOG=\"loud\" is not a level"), "{o:?}");
    let o = deltafin_cmd().env("DELTAFIN_LOG", "verbose").args(["plan", "--memory-gb", "64"]).output().unwrap();
    assert!(!String::from_utf8_lossy(&o.stderr).contains("is not a level"), "{o:?}");
    let dir = tempfile::tempdir().unwrap();
    let o = deltafin_cmd()
        .env("HF_ENDPOINT", "http://127.0.0.1:9")
        .args(["setup", "--repo", "no/such", "--json", "--dir"])
        .arg(dir.path().join("m"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {o:?}"));
    assert!(j["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{j}");
}

/// `list` shows the models deltafin has seen, `info` what one is.
#[test]
fn list_and_info_show_the_models_seen_and_what_one_is() {
    let (_, _) = run_ok(deltafin_cmd().args(["run", "--demo", "--prompt", "Hi", "--max-new", "2", "-q"]));
    let (out, _) = run_ok(deltafin_cmd().arg("list"));
    assert!(out.contains("demo"), "{out}");
    let (out, _) = run_ok(deltafin_cmd().args(["info", "--demo"]));
    assert!(out.contains("Kimi K3 architecture") && out.contains("hidden 256") && out.contains("checksums"), "{out}");
    let (j, _) = run_ok(deltafin_cmd().args(["info", "--demo", "--json"]));
    let j: serde_json::Value = serde_json::from_str(&j).unwrap();
    assert_eq!(j["experts"], 64);
}

/// llama.cpp's habits: `-m`, `-p`, `-n` (`--n-predict`), `-c` (`--ctx-size`) and the prompt as
/// the words after the options (as `ollama run` takes it) give what the long flags give; help
/// lists them on run, chat and serve.
#[test]
fn run_takes_a_positional_prompt_and_the_short_flags_of_llama_cpp() {
    let json = |args: &[&str]| -> serde_json::Value {
        let (out, _) =
            run_ok(deltafin_cmd().arg("run").args(args).args(["--format", "json", "-q", "--temperature", "0"]));
        serde_json::from_str(&out).unwrap()
    };
    let long = json(&["--demo", "--prompt", "Why is the sky blue", "--max-new", "4", "--context", "256"]);
    for short in [
        &["--demo", "-p", "Why is the sky blue", "-n", "4", "-c", "256"][..],
        &["--demo", "-n", "4", "--ctx-size", "256", "Why", "is", "the", "sky", "blue"],
        &["--demo", "Why is the sky blue", "--n-predict", "4", "-c", "256"],
    ] {
        let v = json(short);
        for k in ["prompt_ids", "output_ids"] {
            assert_eq!(v[k], long[k], "{short:?}: {k}");
        }
        assert_eq!(v["engine_config"]["context"], 256, "{short:?}");
    }
    let (out, _) = run_ok(deltafin_cmd().args(["run", "-m"]).arg(fixture("k3-tiny-a")).args([
        "--prompt-ids",
        "1,2",
        "-n",
        "3",
        "--ignore-eos",
        "-q",
    ]));
    assert_eq!(out.trim().split(',').count(), 3, "{out}");
    for (words, flags) in [
        (&["run"][..], &["-m, --model", "-p, --prompt", "-n, --max-new", "-c, --context", "[PROMPT]"][..]),
        (&["chat"], &["-m, --model", "-p, --prompt", "-n, --max-tokens", "-c, --context", "-v, --verbose"]),
        (&["serve"], &["-m, --model", "-n, --max-tokens-default", "-c, --context"]),
    ] {
        let text = help(words);
        for f in flags {
            assert!(text.contains(f), "{words:?} --help lacks {f}:\n{text}");
        }
    }
}

/// A `--draft-model` that cannot be used is named as the flag gave it, never as a fault of the
/// model it drafts for (nor of the demo, when the model is not the demo).
#[test]
fn a_draft_model_that_cannot_be_used_is_what_the_error_names() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("m");
    synth_small(&m, None);
    let none = tmp.path().join("none");
    for model in [&["--model", m.to_str().unwrap()][..], &["--demo"]] {
        for draft in [&none, &m] {
            let o = deltafin_cmd()
                .arg("run")
                .args(model)
                .args(["--prompt", "Hi", "-n", "2", "--draft", "dspark", "--draft-model"])
                .arg(draft)
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(1), "{err}");
            let line = err.lines().find(|l| l.starts_with("error:")).unwrap_or_default();
            assert!(line.contains(&format!("--draft-model {}", draft.display())), "{model:?}: {err}");
            assert!(!line.contains("cannot open the model in"), "{model:?}: {err}");
            if model[0] == "--model" {
                assert!(!line.contains("demo"), "the demo named for a model that is not it: {err}");
            }
        }
    }
}
