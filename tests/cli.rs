//! The `run` and `score` subcommands end to end (real binary, real files), including bit-identical
//! results whatever instruction set and thread count the kernels use; and the help a new user
//! meets: every option of every subcommand described, examples, tips on usage errors.

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
