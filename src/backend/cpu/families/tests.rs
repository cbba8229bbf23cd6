//! The family list held to the source (on any machine: a NEON form missing from an x86 build
//! fails here too, not only under an aarch64 runner).

use super::{FAMILIES, Form, Isa};
use crate::backend::cpu::dispatch::native_kernels;
use std::path::{Path, PathBuf};

fn backend_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src/backend")
}

/// Every `.rs` file under `src/backend/`, as (path relative to it, text without `//` comments).
fn sources() -> Vec<(String, String)> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(&backend_dir(), &mut files);
    files
        .iter()
        .map(|f| {
            let rel = f.strip_prefix(backend_dir()).unwrap().to_string_lossy().replace('\\', "/");
            let text = std::fs::read_to_string(f).unwrap();
            let code: Vec<&str> = text.lines().map(|l| l.split("//").next().unwrap_or("")).collect();
            (rel, code.join("\n"))
        })
        .collect()
}

/// Whole-word occurrences of `name` in `code`.
fn words(code: &str, name: &str) -> usize {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    code.match_indices(name)
        .filter(|(i, _)| {
            let before = code[..*i].chars().next_back();
            let after = code[i + name.len()..].chars().next();
            !before.is_some_and(ident) && !after.is_some_and(ident)
        })
        .count()
}

const ISAS: [Isa; 4] = Isa::ALL;

#[test]
fn every_family_has_a_form_on_every_isa() {
    let mut bad = Vec::new();
    for f in FAMILIES {
        for isa in ISAS {
            let n = f.forms.iter().filter(|(i, _)| *i == isa).count();
            if n != 1 {
                bad.push(format!("{}: {n} forms on {isa:?}", f.name));
            }
        }
    }
    assert!(bad.is_empty(), "every family lists one form per instruction set: {bad:#?}");
}

#[test]
fn every_family_with_an_x86_kernel_has_its_neon_kernel() {
    let mut missing = Vec::new();
    let native = |f: &super::Family, isa| f.forms.iter().any(|&(i, form)| i == isa && matches!(form, Form::Native(_)));
    for f in FAMILIES {
        let x86 = native(f, Isa::Avx2) || native(f, Isa::Avx512);
        if x86 && !native(f, Isa::Neon) {
            missing.push(format!("{}: {:?} on NEON", f.name, f.forms.iter().find(|(i, _)| *i == Isa::Neon)));
        }
    }
    assert!(missing.is_empty(), "x86 kernel families without a NEON kernel: {missing:#?}");
    let mut names: Vec<&str> = FAMILIES.iter().map(|f| f.name).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), FAMILIES.len(), "a family listed twice");
}

#[test]
fn every_listed_kernel_is_defined_in_its_file_and_called() {
    let src = sources();
    let mut bad = Vec::new();
    for f in FAMILIES {
        for &(isa, form) in f.forms {
            let (Form::Native(path) | Form::Reference(path)) = form else { continue };
            let Some((file, name)) = path.split_once("::") else {
                bad.push(format!("{}/{isa:?}: {path} is not file::function", f.name));
                continue;
            };
            let Some((_, code)) = src.iter().find(|(rel, _)| rel == file) else {
                bad.push(format!("{}/{isa:?}: no file src/backend/{file}", f.name));
                continue;
            };
            let defined = [format!("fn {name}("), format!("fn {name}<")].iter().any(|d| code.contains(d.as_str()));
            // Called: named again somewhere (a call, a dispatch arm, a function pointer), beyond
            // its definition.
            let uses: usize = src.iter().map(|(_, c)| words(c, name)).sum();
            if !defined {
                bad.push(format!("{}/{isa:?}: {file} defines no fn {name}", f.name));
            } else if uses < 2 {
                bad.push(format!("{}/{isa:?}: {name} is never called", f.name));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Public `#[target_feature]` functions of the SIMD files that are parts of a listed kernel, not
/// kernels a dispatch calls.
const PARTS: &[&str] = &[
    "cpu/x86/coded.rs::block_avx512",
    "cpu/x86/coded.rs::table_avx512",
    "cpu/neon/coded.rs::block",
    "cpu/neon/coded.rs::table",
];

#[test]
fn every_simd_kernel_is_on_the_list() {
    let listed: Vec<&str> = FAMILIES
        .iter()
        .flat_map(|f| f.forms.iter().map(|&(_, form)| form))
        .filter_map(|form| match form {
            Form::Native(p) | Form::Reference(p) => Some(p),
            Form::Composed(_) => None,
        })
        .collect();
    let mut unlisted = Vec::new();
    let mut seen = 0;
    for (rel, code) in sources() {
        let lines: Vec<&str> = code.lines().collect();
        for (i, l) in lines.iter().enumerate() {
            if !l.trim_start().starts_with("#[target_feature(") {
                continue;
            }
            // The function the attribute is on: the next line that declares one.
            let Some(decl) = lines[i + 1..].iter().find(|l| l.contains("fn ")) else { continue };
            let public = decl.trim_start().starts_with("pub");
            let name: String = decl[decl.find("fn ").unwrap() + 3..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            let path = format!("{rel}::{name}");
            if public && !PARTS.contains(&path.as_str()) {
                seen += 1;
                if !listed.contains(&path.as_str()) {
                    unlisted.push(path);
                }
            }
        }
    }
    assert!(seen >= 20, "found only {seen} SIMD kernels: the scan is broken");
    assert!(unlisted.is_empty(), "SIMD kernels on no family of cpu/families.rs: {unlisted:#?}");
}

#[test]
fn the_tables_have_a_kernel_where_the_list_names_a_native_form() {
    let tables = native_kernels();
    let mut bad = Vec::new();
    for f in FAMILIES {
        let Some((_, natives)) = tables.iter().find(|(name, _)| *name == f.name) else {
            bad.push(format!("{}: no table in dispatch.rs", f.name));
            continue;
        };
        // The instruction sets of this build's architecture (the tables hold no other).
        for isa in ISAS.into_iter().filter(|i| i.arch() == Some(std::env::consts::ARCH)) {
            let form = f.forms.iter().find(|(i, _)| *i == isa).map(|&(_, form)| form);
            let listed = matches!(form, Some(Form::Native(_)));
            if listed != natives.contains(&isa) {
                bad.push(format!("{} on {isa:?}: listed {form:?}, table has a kernel: {}", f.name, !listed));
            }
        }
    }
    for (name, _) in &tables {
        if !FAMILIES.iter().any(|f| f.name == *name) {
            bad.push(format!("{name}: a table of no family in families.rs"));
        }
    }
    assert!(bad.is_empty(), "families.rs and dispatch.rs disagree:\n{}", bad.join("\n"));
}
