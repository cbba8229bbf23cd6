//! The crate's structure, from its own source: no import cycle among the top-level modules of
//! `src/`, none among the direct submodules of any module at any depth, and imports run downhill
//! — `cli` -> `serve` -> `service` / `bench` / `tools` -> `engine` -> `forward` / `hub` / `memory` /
//! `demo` / `draft` / `api` -> `k3` / `stats` / `constrain` -> `model` / `store` / `sample` ->
//! `backend` -> `util` — with no exception. A module that is not on a floor yet fails the test
//! until it is given one. The HTTP server is a front end of its own: no other CLI file than
//! `cli/serve.rs` imports it.
//!
//! Imports are the `crate::` and `super::` paths of each file (use declarations, grouped `{..}`
//! imports and paths in code), comments and string literals left out; a file's test module
//! (from its `#[cfg(test)]` on) does not count. `crate::cpu` is `backend::cpu` (lib.rs re-exports it).
//!
//! Files at their seams: no source file over [`MAX_FILE_LINES`] lines, no CLI file over
//! [`MAX_CLI_FILE_LINES`] (argument parsing and printing; the work is in the library). Front ends
//! (the CLI's subcommands, the server, the generation service they share and the protocol it
//! speaks) reach the model only through `Engine` / `Session`: they import nothing of `k3`,
//! `backend` or `forward`, and touch none of the engine's parts.
//!
//! One step core: a forward runs in one place (`Engine::forward_rows`, engine/scheduler/step.rs), a
//! token is picked and rows are kept in one place (engine/scheduler/lane.rs), and drafting has one trait
//! (`draft::Drafter`): a second decode loop or drafting trait fails a test.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Floors, lowest first: a module may import from its own floor (without a cycle) and below.
const FLOORS: &[&[&str]] = &[
    &["util", "setting"],
    &["backend"],
    &["model", "store", "sample"],
    &["k3", "stats", "constrain"],
    &["forward", "hub", "memory", "demo", "draft", "api"],
    &["engine"],
    &["service", "bench", "tools"],
    &["serve"],
    &["cli"],
];

/// At most this many (importing module, imported module) pairs may run up the floors.
const MAX_UPHILL: usize = 0;

/// The only CLI file that may import the HTTP server (`crate::serve`); the other commands use the
/// generation service (`crate::service`) and the protocol (`crate::api`).
const SERVER_FRONT_END: &str = "cli/serve.rs";

/// Directories whose files are front ends (or what front ends share) for
/// [`front_ends_reach_the_model_only_through_the_engine`].
const FRONT_END_DIRS: &[&str] = &["cli/", "serve/", "service/", "api/"];

/// No source file under `src/` is longer (lines).
const MAX_FILE_LINES: usize = 650;

/// No file under `src/cli/` is longer (lines): a subcommand parses its arguments, calls the
/// library and prints.
const MAX_CLI_FILE_LINES: usize = 300;

/// CLI subcommands that are tools over files rather than front ends of the engine, and may use
/// the model's modules directly: `synth --dspark` writes a DSpark checkpoint (`k3::dspark::synth`).
const FILE_TOOLS: &[&str] = &["cli/synth.rs"];

/// Top-level modules a front end must not import: the model math, the backend, the forward and its
/// expert schedule.
const ENGINE_INSIDES: &[&str] = &["k3", "backend", "forward"];

/// Parts of an `Engine` a front end must not touch (`engine.<part>` / `engine().<part>`); it asks
/// the engine's methods instead (`engine/facts.rs`).
const ENGINE_PARTS: &[&str] =
    &["model", "checkpoint", "roster", "plan", "k3_config", "dspark_model", "device", "source", "store"];

/// Calls that make a decode loop, and the one file each may appear in (besides its definition):
/// a forward (the step core's), a token picked from logits and rows kept (a lane's).
const ONE_PLACE_CALLS: &[(&str, &str)] = &[
    ("forward::run(", "engine/scheduler/step.rs"),
    ("forward::forward(", "forward/mod.rs"),
    (".pick_on(", "engine/scheduler/lane.rs"),
    (".commit_rows(", "engine/scheduler/lane.rs"),
];

/// The one drafting trait: the only trait that proposes tokens or is named for drafts.
const DRAFTING_TRAIT: &str = "draft/mod.rs: Drafter";

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// The module path of a file under `src/` (`store/pread.rs` -> [store, pread]; `mod.rs` is its
/// directory's module; `lib.rs` is the root).
fn module_of(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel.iter().map(|s| s.to_string_lossy().into_owned()).collect();
    let last = parts.pop().unwrap_or_default();
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" && stem != "lib" {
        parts.push(stem.to_string());
    }
    parts
}

/// The code of a file without comments, string and char literals (each replaced by a space),
/// cut at its test module.
fn code_of(src: &str) -> String {
    lex(src).0
}

/// The code of `src` as [`code_of`] gives it, and the text of its string literals (escapes left
/// as written).
fn lex(src: &str) -> (String, Vec<String>) {
    let mut literals = Vec::new();
    let src = match src.find("#[cfg(test)]\nmod ") {
        Some(i) => &src[..i],
        None => src,
    };
    let b: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if c == 'r' && (next == Some('"') || next == Some('#')) && starts_word(&b, i) {
            // A raw string: r"..." or r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            j += 1;
            let start = j;
            let mut end = b.len();
            loop {
                match b.get(j) {
                    None => break,
                    Some('"') if (0..hashes).all(|k| b.get(j + 1 + k) == Some(&'#')) => {
                        end = j;
                        j += 1 + hashes;
                        break;
                    }
                    _ => j += 1,
                }
            }
            literals.push(b[start..end].iter().collect());
            i = j;
            out.push(' ');
        } else if c == '"' {
            i += 1;
            let start = i;
            while i < b.len() && b[i] != '"' {
                i += if b[i] == '\\' { 2 } else { 1 };
            }
            literals.push(b[start.min(b.len())..i.min(b.len())].iter().collect());
            i += 1;
            out.push(' ');
        } else if c == '\'' {
            // A char literal ('x', '\n', '\u{..}'), or a lifetime (left as it is).
            if next == Some('\\') {
                let mut j = i + 2;
                while j < b.len() && b[j] != '\'' {
                    j += 1;
                }
                i = j + 1;
                out.push(' ');
            } else if b.get(i + 2) == Some(&'\'') {
                i += 3;
                out.push(' ');
            } else {
                out.push(c);
                i += 1;
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    (out, literals)
}

/// Whether `b[i]` starts a token (a `b` prefix of a byte string counts as part of it).
fn starts_word(b: &[char], i: usize) -> bool {
    let ident = |k: usize| b.get(k).is_some_and(|p| p.is_alphanumeric() || *p == '_');
    match i.checked_sub(1) {
        None => true,
        Some(k) if b[k] == 'b' => k == 0 || !ident(k - 1),
        Some(k) => !ident(k),
    }
}

/// Expands `a::{b, c::{d, e}}` into [a::b, a::c::d, a::c::e] (segments).
fn expand(prefix: &[String], body: &str, out: &mut Vec<Vec<String>>) {
    let mut depth = 0;
    let mut cur = String::new();
    let mut items = Vec::new();
    for ch in body.chars() {
        match ch {
            '{' => depth += 1,
            '}' => depth -= 1,
            _ => {}
        }
        if ch == ',' && depth == 0 {
            items.push(std::mem::take(&mut cur));
        } else {
            cur.push(ch);
        }
    }
    items.push(cur);
    for item in items {
        let item = item.trim();
        if item.is_empty() {
            continue;
        }
        match item.find('{') {
            Some(open) => {
                let head: Vec<String> = segments(item[..open].trim_end_matches(':'));
                let inner = &item[open + 1..item.rfind('}').unwrap_or(item.len())];
                expand(&[prefix, &head[..]].concat(), inner, out);
            }
            None => {
                let path = item.split(" as ").next().unwrap_or(item);
                out.push([prefix, &segments(path)[..]].concat());
            }
        }
    }
}

fn segments(path: &str) -> Vec<String> {
    path.split("::").map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect()
}

/// Every `crate::` / `super::` path in `code`, made absolute for a file of module `module`.
fn paths_in(code: &str, module: &[String]) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    for start in ["crate::", "super::"] {
        let mut from = 0;
        while let Some(at) = code[from..].find(start).map(|k| k + from) {
            from = at + start.len();
            // A whole word: not `xcrate::` or `a::super::`.
            if at > 0 && (bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_' || bytes[at - 1] == b':') {
                continue;
            }
            // The longest run of path characters, then a `{..}` group if one follows.
            let mut end = at;
            while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_' || bytes[end] == b':')
            {
                end += 1;
            }
            let text = &code[at..end];
            let mut base: Vec<String> = Vec::new();
            let mut rest = text;
            if let Some(r) = rest.strip_prefix("crate::") {
                rest = r;
            } else {
                base = module[..module.len().saturating_sub(1)].to_vec();
                rest = &rest["super::".len()..];
                while let Some(r) = rest.strip_prefix("super::") {
                    base.pop();
                    rest = r;
                }
            }
            let prefix = [&base[..], &segments(rest)[..]].concat();
            if (rest.is_empty() || rest.ends_with("::")) && code[end..].starts_with('{') {
                let mut depth = 0;
                let mut close = end;
                for (k, ch) in code[end..].char_indices() {
                    match ch {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                close = end + k;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                expand(&prefix, &code[end + 1..close], &mut out);
            } else {
                out.push(prefix);
            }
        }
    }
    out
}

struct Graph {
    /// Every module (of a file) and the modules each imports.
    edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
}

fn graph() -> Graph {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rs_files(&root, &mut files);
    let mut modules = BTreeSet::new();
    let mut parsed = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(&root).unwrap().to_path_buf();
        if rel == Path::new("main.rs") {
            // The binary: a crate of its own.
            continue;
        }
        let m = module_of(&rel);
        modules.insert(m.clone());
        parsed.push((m, code_of(&std::fs::read_to_string(f).unwrap())));
    }
    // `pub use x::y;` in lib.rs makes `crate::y` an alias of `crate::x::y`.
    let lib = code_of(&std::fs::read_to_string(root.join("lib.rs")).unwrap());
    let mut aliases: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in lib.lines() {
        if let Some(p) = line.trim().strip_prefix("pub use ").and_then(|p| p.strip_suffix(';')) {
            let segs = segments(p);
            if let Some(last) = segs.last() {
                aliases.insert(last.clone(), segs.clone());
            }
        }
    }
    let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for (m, code) in parsed {
        let set = edges.entry(m.clone()).or_default();
        for mut p in paths_in(&code, &m) {
            if let Some(full) = p.first().and_then(|s| aliases.get(s)) {
                p = [&full[..], &p[1..]].concat();
            }
            // The module a path names: its longest prefix that is a module.
            let target = (1..=p.len()).rev().map(|k| p[..k].to_vec()).find(|k| modules.contains(k));
            if let Some(t) = target
                && t != m
            {
                set.insert(t);
            }
        }
    }
    Graph { edges }
}

/// Strongly connected components of more than one node (Tarjan).
fn cycles(g: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        let i = t.index.len();
        t.index.insert(v, i);
        t.low.insert(v, i);
        t.stack.push(v);
        t.on.insert(v);
        if let Some(ws) = t.g.get(v) {
            for w in ws {
                if !t.index.contains_key(w.as_str()) {
                    visit(t, w);
                    let lw = t.low[w.as_str()];
                    let lv = t.low.get_mut(v).unwrap();
                    *lv = (*lv).min(lw);
                } else if t.on.contains(w.as_str()) {
                    let iw = t.index[w.as_str()];
                    let lv = t.low.get_mut(v).unwrap();
                    *lv = (*lv).min(iw);
                }
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                t.out.push(comp);
            }
        }
    }
    let mut t =
        T { g, index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), on: BTreeSet::new(), out: Vec::new() };
    for v in g.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out
}

/// Top-level module -> the top-level modules it imports.
fn top_level(g: &Graph) -> BTreeMap<String, BTreeSet<String>> {
    let mut top: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (from, tos) in &g.edges {
        let Some(a) = from.first() else { continue };
        let set = top.entry(a.clone()).or_default();
        for to in tos {
            if let Some(b) = to.first().filter(|b| *b != a) {
                set.insert(b.clone());
            }
        }
    }
    top
}

#[test]
fn no_import_cycle_among_top_level_modules() {
    let top = top_level(&graph());
    let found = cycles(&top);
    assert!(found.is_empty(), "import cycles among top-level modules: {found:?}\n(imports: {top:#?})");
}

/// For every module at any depth (the crate's root included, as ""), its direct submodules and the
/// imports between them: an import from `a::x::..` to `a::y::..` (x != y) is an arrow x -> y among
/// the submodules of `a`, the module both sit in (an import of or from a module's own file is not
/// one: a parent and its children are one room).
fn within_every_module(g: &Graph) -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
    let mut within: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for (from, tos) in &g.edges {
        for to in tos {
            let k = from.iter().zip(to).take_while(|(a, b)| a == b).count();
            if k < from.len() && k < to.len() {
                let module = from[..k].join("::");
                within.entry(module).or_default().entry(from[k].clone()).or_default().insert(to[k].clone());
            }
        }
    }
    within
}

#[test]
fn no_import_cycle_among_the_submodules_of_any_module() {
    let within = within_every_module(&graph());
    let found: Vec<(String, Vec<Vec<String>>)> =
        within.iter().map(|(m, sub)| (m.clone(), cycles(sub))).filter(|(_, c)| !c.is_empty()).collect();
    assert!(found.is_empty(), "import cycles among the submodules of a module (\"\" is the crate): {found:?}");
}

#[test]
fn the_cycle_check_sees_every_depth() {
    // a::b::c::x <-> a::b::c::y three levels down, and a::p -> a::q::r -> a::p::s one level down.
    let path = |s: &str| s.split("::").map(str::to_string).collect::<Vec<String>>();
    let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for (from, to) in [
        ("a::b::c::x", "a::b::c::y::z"),
        ("a::b::c::y::z", "a::b::c::x"),
        ("a::p", "a::q::r"),
        ("a::q::r", "a::p::s"),
        ("a::b", "a::b::c::x"),
    ] {
        edges.entry(path(from)).or_default().insert(path(to));
    }
    let within = within_every_module(&Graph { edges });
    let found: BTreeMap<String, Vec<Vec<String>>> =
        within.iter().map(|(m, sub)| (m.clone(), cycles(sub))).filter(|(_, c)| !c.is_empty()).collect();
    let want: BTreeMap<String, Vec<Vec<String>>> = [
        ("a".to_string(), vec![vec!["p".to_string(), "q".to_string()]]),
        ("a::b::c".to_string(), vec![vec!["x".to_string(), "y".to_string()]]),
    ]
    .into_iter()
    .collect();
    assert_eq!(found, want);
}

#[test]
// The bar is 0 today; it stays a number so that a move in progress may name its exceptions.
#[allow(clippy::absurd_extreme_comparisons)]
fn imports_run_downhill() {
    let top = top_level(&graph());
    let floor = |m: &str| FLOORS.iter().position(|f| f.contains(&m));
    let unplaced: Vec<&String> = top.keys().filter(|m| floor(m).is_none()).collect();
    assert!(unplaced.is_empty(), "modules on no floor: {unplaced:?} (give them one in tests/structure.rs)");
    let uphill: Vec<(String, String)> = top
        .iter()
        .flat_map(|(a, bs)| bs.iter().map(move |b| (a.clone(), b.clone())))
        .filter(|(a, b)| floor(a) < floor(b))
        .collect();
    eprintln!("imports running up the floors: {uphill:?}");
    assert!(
        uphill.len() <= MAX_UPHILL,
        "{} imports run up the floors (at most {MAX_UPHILL}): {uphill:?}",
        uphill.len()
    );
}

#[test]
fn the_parser_sees_grouped_relative_and_aliased_imports() {
    let m: Vec<String> = ["store", "pread"].iter().map(|s| s.to_string()).collect();
    let code = code_of(
        "use super::reader::{Done, DriveIo};\nuse crate::{a::b, c::{d, e::f}};\n// crate::comment::x\nlet s = \"crate::string::y\";\nlet x = crate::k3::argmax(&v);\nlet c = '\"'; let d = crate::after_char::z;\n",
    );
    let got: BTreeSet<String> = paths_in(&code, &m).iter().map(|p| p.join("::")).collect();
    let want: BTreeSet<String> =
        ["store::reader::Done", "store::reader::DriveIo", "a::b", "c::d", "c::e::f", "k3::argmax", "after_char::z"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    assert_eq!(got, want);
    let g = graph();
    let backend: Vec<String> = vec!["backend".into()];
    assert!(g.edges.keys().any(|k| k.starts_with(&backend)), "the graph has the backend's files");
}

/// Every `.rs` file under `src/`, as (path relative to `src/` with `/` separators, text).
fn sources() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rs_files(&root, &mut files);
    files
        .iter()
        .map(|f| {
            let rel = f.strip_prefix(&root).unwrap().iter().map(|s| s.to_string_lossy()).collect::<Vec<_>>().join("/");
            (rel, std::fs::read_to_string(f).unwrap())
        })
        .collect()
}

#[test]
fn no_source_file_over_650_lines_and_no_cli_file_over_300() {
    let mut long = Vec::new();
    for (rel, text) in sources() {
        let n = text.lines().count();
        if n > MAX_FILE_LINES {
            long.push(format!("{rel}: {n} lines (at most {MAX_FILE_LINES}: split it at a seam)"));
        } else if rel.starts_with("cli/") && n > MAX_CLI_FILE_LINES {
            long.push(format!(
                "{rel}: {n} lines (a CLI file parses, calls the library and prints: at most {MAX_CLI_FILE_LINES})"
            ));
        }
    }
    assert!(long.is_empty(), "files past their seams:\n{}", long.join("\n"));
}

/// Whether `code` has `engine.<part>` or `engine().<part>` (whole words; `self.engine.cfg` counts,
/// and so would a field of the CLI's `EngineArgs` of the same name, which is why none has one).
fn touches_engine_part(code: &str, part: &str) -> bool {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    ["engine.", "engine()."].iter().any(|head| {
        let pat = format!("{head}{part}");
        code.match_indices(&pat).any(|(at, _)| {
            let before = code[..at].chars().next_back();
            let after = code[at + pat.len()..].chars().next();
            !before.is_some_and(ident) && !after.is_some_and(ident)
        })
    })
}

#[test]
fn front_ends_reach_the_model_only_through_the_engine() {
    let g = graph();
    let mut found = Vec::new();
    for (rel, text) in sources() {
        let front_end = FRONT_END_DIRS.iter().any(|d| rel.starts_with(d));
        if !front_end || FILE_TOOLS.contains(&rel.as_str()) {
            continue;
        }
        let m = module_of(Path::new(&rel));
        for to in g.edges.get(&m).into_iter().flatten() {
            if to.first().is_some_and(|t| ENGINE_INSIDES.contains(&t.as_str())) {
                found.push(format!("{rel} imports {} (ask Engine / Session instead)", to.join("::")));
            }
        }
        let code = code_of(&text);
        for part in ENGINE_PARTS {
            if touches_engine_part(&code, part) {
                found.push(format!("{rel} touches engine.{part} (add a narrow Engine method instead)"));
            }
        }
    }
    assert!(found.is_empty(), "front ends reaching past the engine:\n{}", found.join("\n"));
}

#[test]
fn only_the_serve_command_imports_the_http_server() {
    let g = graph();
    let mut found = Vec::new();
    for (rel, _) in sources() {
        if !rel.starts_with("cli/") || rel == SERVER_FRONT_END {
            continue;
        }
        let m = module_of(Path::new(&rel));
        for to in g.edges.get(&m).into_iter().flatten() {
            if to.first().is_some_and(|t| t == "serve") {
                found.push(format!("{rel} imports {} (use crate::service or crate::api)", to.join("::")));
            }
        }
    }
    assert!(found.is_empty(), "CLI files importing the HTTP server:\n{}", found.join("\n"));
}

#[test]
fn the_engine_part_check_sees_fields_not_arguments() {
    assert!(touches_engine_part("let b = engine.plan.context_bound;", "plan"));
    assert!(touches_engine_part("self.engine().model.be.argmax(x)", "model"));
    assert!(touches_engine_part("(&engine.dspark_model, 1)", "dspark_model"));
    assert!(touches_engine_part("self.engine.cfg.vocab", "cfg"));
    assert!(!touches_engine_part("engine.draft_model_description()", "dspark_model"));
    assert!(touches_engine_part("engine.dspark_model()", "dspark_model"));
    assert!(!touches_engine_part("my_engine.cfg", "cfg"));
}

/// The CLI flags (`--name`) that `text` spells.
fn flags_in(text: &str) -> Vec<String> {
    let b = text.as_bytes();
    let mut found = Vec::new();
    for (at, _) in text.match_indices("--") {
        let before_ok = at == 0 || !(b[at - 1].is_ascii_alphanumeric() || b[at - 1] == b'-');
        let name: String =
            text[at + 2..].chars().take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-').collect();
        if before_ok && name.starts_with(|c: char| c.is_ascii_lowercase()) {
            found.push(format!("--{name}"));
        }
    }
    found
}

/// Library messages name settings through `crate::setting` (a front end shows its own names for
/// them); a CLI flag spelled in a string literal outside `cli/` is a front end's syntax leaking
/// into the library.
#[test]
fn no_cli_flag_names_in_library_strings() {
    let mut found = Vec::new();
    for (rel, text) in sources() {
        if rel.starts_with("cli/") {
            continue;
        }
        for lit in lex(&text).1 {
            // One argument for another program (fio's `--direct=1`), not a message.
            if lit.starts_with("--") && !lit.contains(char::is_whitespace) {
                continue;
            }
            for flag in flags_in(&lit) {
                found.push(format!("{rel}: {flag} in {lit:?} (use a crate::setting::Setting)"));
            }
        }
    }
    assert!(found.is_empty(), "CLI flags named in the library:\n{}", found.join("\n"));
}

#[test]
fn the_flag_check_sees_flags_in_literals_only() {
    let (_, lits) =
        lex("// --not-this\nlet a = \"raise --memory-gb\"; let b = r#\"x --draft y\"#; let c = \"a--b -- c\";");
    let flags: Vec<String> = lits.iter().flat_map(|l| flags_in(l)).collect();
    assert_eq!(flags, ["--memory-gb", "--draft"]);
}

#[test]
fn every_durable_write_goes_through_the_util_helpers() {
    // util::sync_file / sync_data / sync_dir: F_FULLFSYNC on macOS, where fsync leaves the data in
    // the drive's cache. A direct call elsewhere would be durable on Linux only.
    let mut direct = Vec::new();
    for (rel, text) in sources().into_iter().filter(|(rel, _)| !rel.starts_with("util")) {
        let code = code_of(&text);
        for call in [".sync_all()", ".sync_data()", "libc::fsync", "libc::fdatasync"] {
            if code.contains(call) {
                direct.push(format!("{rel}: {call}"));
            }
        }
    }
    assert!(
        direct.is_empty(),
        "make these durable with util::sync_file (or sync_data, sync_dir):\n{}",
        direct.join("\n")
    );
}

/// The traits `code` declares that draft: (name, whether its body declares `fn propose`) for
/// every trait named for drafts or proposing tokens.
fn drafting_traits(code: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (at, _) in code.match_indices("trait ") {
        if at > 0 && code[..at].chars().next_back().is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &code[at + 6..];
        let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        let Some(open) = rest.find('{') else { continue };
        let mut depth = 0;
        let mut end = rest.len();
        for (i, c) in rest[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + i;
                        break;
                    }
                }
                _ => {}
            }
        }
        if name.contains("Draft") || rest[open..end].contains("fn propose") {
            found.push(name);
        }
    }
    found
}

#[test]
fn one_step_core_and_one_drafting_trait() {
    let mut found = Vec::new();
    let mut traits = Vec::new();
    for (rel, text) in sources() {
        let code = code_of(&text);
        for (call, home) in ONE_PLACE_CALLS {
            if code.contains(call) && rel != *home {
                found.push(format!("{rel} calls {call} (only {home} may: run rows through the step core)"));
            }
        }
        traits.extend(drafting_traits(&code).into_iter().map(|t| format!("{rel}: {t}")));
    }
    for (call, home) in ONE_PLACE_CALLS {
        let at_home = sources().into_iter().any(|(rel, text)| rel == *home && code_of(&text).contains(call));
        assert!(at_home, "{home} no longer calls {call}: update the check with the core's new home");
    }
    if traits != [DRAFTING_TRAIT] {
        found.push(format!("drafting traits {traits:?} (one: {DRAFTING_TRAIT})"));
    }
    assert!(found.is_empty(), "a second decode loop or drafting trait:\n{}", found.join("\n"));
}

#[test]
fn the_drafting_trait_check_sees_traits_that_propose() {
    assert_eq!(drafting_traits("pub trait Drafter: Send { fn name(&self); }"), ["Drafter"]);
    assert_eq!(drafting_traits("trait Lanes { fn propose(&mut self, k: usize); } fn f() {}"), ["Lanes"]);
    assert!(drafting_traits("pub trait LaneHost { fn next(&mut self); } // Drafter").is_empty());
    assert!(drafting_traits("pub trait Schedule { fn begin(&mut self) {} }").is_empty());
    assert!(drafting_traits("impl Subtrait for X {}").is_empty());
}

#[test]
fn the_model_reaches_kernels_only_through_the_backend() {
    // backend/mod.rs: the model never calls a kernel directly; `backend::detmath` (the defined
    // scalar functions every backend's kernels follow) is not a kernel.
    let direct: Vec<String> = sources()
        .into_iter()
        .filter(|(rel, text)| rel.starts_with("k3/") && code_of(text).contains("cpu::"))
        .map(|(rel, _)| rel)
        .collect();
    assert!(direct.is_empty(), "k3/ files calling CPU kernels (go through the Backend trait):\n{}", direct.join("\n"));
}
