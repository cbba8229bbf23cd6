//! bench/ stays a place a reader can use: its top level holds only the scripts a user runs, its
//! README, `results/` and `data/`; every measurement is a `results/DATE-WHAT/` directory with a
//! README giving the command and machine of its records; and every `bench/...` path the docs cite
//! exists (result files moved once; a stale path would send a reader nowhere).

use std::path::Path;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn names(dir: &Path) -> Vec<(String, bool)> {
    let mut v: Vec<(String, bool)> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| {
            let e = e.unwrap();
            (e.file_name().to_string_lossy().into_owned(), e.path().is_dir())
        })
        .collect();
    v.sort();
    v
}

#[test]
fn bench_top_level_holds_scripts_readme_results_and_data_only() {
    let mut stray = Vec::new();
    for (name, is_dir) in names(&root().join("bench")) {
        let ok = if is_dir {
            name == "results" || name == "data"
        } else {
            name == "README.md" || name.ends_with(".sh") || name.ends_with(".py")
        };
        if !ok {
            stray.push(name);
        }
    }
    assert!(stray.is_empty(), "bench/ holds {stray:?}: results go to bench/results/DATE-WHAT/, inputs to bench/data/");
}

#[test]
fn every_result_is_a_dated_directory_with_its_command_and_machine() {
    let mut bad = Vec::new();
    for (name, is_dir) in names(&root().join("bench/results")) {
        let dated = name.len() > 11
            && name.as_bytes()[..10]
                .iter()
                .enumerate()
                .all(|(i, b)| if i == 4 || i == 7 { *b == b'-' } else { b.is_ascii_digit() })
            && name.as_bytes()[10] == b'-';
        let dir = root().join("bench/results").join(&name);
        if !is_dir || !dated {
            bad.push(format!("{name}: not a DATE-WHAT directory"));
            continue;
        }
        let files = names(&dir);
        if !files.iter().any(|(n, _)| n == "README.md") {
            bad.push(format!("{name}: no README.md (the command and machine of its records)"));
        }
        if files.iter().all(|(n, _)| n == "README.md") {
            bad.push(format!("{name}: no record"));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn every_bench_path_the_docs_cite_exists() {
    let mut docs = vec![root().join("README.md"), root().join("bench/README.md")];
    for dir in ["docs", "bench/data/gpu-variants/matvec", "bench/data/gpu-variants/matmul"] {
        for (n, _) in names(&root().join(dir)) {
            if n.ends_with(".md") {
                docs.push(root().join(dir).join(n));
            }
        }
    }
    let mut missing = Vec::new();
    for doc in &docs {
        let text = std::fs::read_to_string(doc).unwrap();
        let mut rest = text.as_str();
        while let Some(at) = rest.find("bench/") {
            let tail = &rest[at..];
            let len = tail.find(|c: char| !(c.is_ascii_alphanumeric() || "_./-".contains(c))).unwrap_or(tail.len());
            let path = tail[..len].trim_end_matches('.');
            let next = tail[len..].chars().next();
            rest = &tail[len..];
            // A glob or a brace list names several files; a placeholder (DATE-WHAT, DIR) none.
            let placeholder =
                path.split('/').any(|s| s.as_bytes().windows(3).any(|w| w.iter().all(u8::is_ascii_uppercase)));
            // `src/bench/run.rs` is a source file, not a path under bench/.
            let preceded = at > 0 && {
                let b = text.as_bytes()[text.len() - tail.len() - 1];
                b.is_ascii_alphanumeric() || b"/_.-".contains(&b)
            };
            if matches!(next, Some('*' | '{')) || placeholder || preceded {
                continue;
            }
            if !root().join(path).exists() {
                missing.push(format!("{}: {path}", doc.strip_prefix(root()).unwrap().display()));
            }
        }
    }
    assert!(missing.is_empty(), "paths cited but absent:\n{}", missing.join("\n"));
}
