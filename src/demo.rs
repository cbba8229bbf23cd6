//! The built-in demo (`--demo`): the model and DSpark drafter the binary carries (embedded by
//! `build.rs` from `demo/kimi-k3-demo/` and `demo/kimi-k3-demo-dspark/`), laid out as model
//! directories under deltafin's cache directory on first use. A binary built without `demo/`
//! carries none and lays out the random-weight synth demo (and a random drafter for it) instead.
//!
//! Contract: [`model_dir`] and [`dspark_dir`] return a directory holding exactly the demo's files.
//! Each is built in a temporary sibling (`.NAME.demo-tmp-PID`), fsynced, and renamed into place,
//! so a directory under the final name is always complete; a run that loses the race to another
//! (its rename finds the winner's directory there) uses the winner's copy. A small manifest
//! ([`MANIFEST`]: each file's size and xxh3-128) is written last; every use checks the files
//! against it, and for an embedded demo the manifest against the embedded files, so a truncated or
//! stale copy is detected and replaced (the new copy is renamed in the moment the old one is moved
//! aside). Temporaries of runs that died are removed. Files other processes add to the directory
//! (a placement) are not checked.

use crate::model::K3Config;
use crate::model::synth::{self, SynthError, SynthSpec};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

mod files {
    include!(concat!(env!("OUT_DIR"), "/demo_files.rs"));
}

/// The embedded model's directory name under the cache directory.
pub const MODEL_NAME: &str = "demo-v2";
/// The embedded DSpark drafter's directory name, beside the model.
pub const DSPARK_NAME: &str = "demo-v2-dspark";
/// The random-weight demo's directory name (a binary built without `demo/`); bump it (and the
/// drafter's) when `SynthSpec::demo` or `DSparkSynthSpec::for_target` changes, since a random copy
/// is checked only against its own manifest.
pub const RANDOM_MODEL_NAME: &str = "demo-v1";
/// Its random DSpark drafter's directory name.
pub const RANDOM_DSPARK_NAME: &str = "demo-v1-dspark";
/// The manifest written last into every laid-out copy.
pub const MANIFEST: &str = ".deltafin-demo.json";
/// Name stems of the temporaries beside the copies (followed by the process id).
const TEMP_STEMS: [&str; 2] = [".demo-tmp-", ".demo-old-"];
/// Rounds of "check, build, rename" before giving up on a directory other runs keep replacing.
const ATTEMPTS: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("cannot create the demo in {}: {source}", path.display())]
    Synth { path: PathBuf, source: SynthError },
    #[error("cannot read the demo model's config in {}: {source}", path.display())]
    Model { path: PathBuf, source: crate::model::ModelError },
    #[error("{}: other runs kept replacing it ({ATTEMPTS} attempts); last problem: {why}", path.display())]
    Unsettled { path: PathBuf, why: String },
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> DemoError + '_ {
    move |source| DemoError::Io { path: path.to_path_buf(), source }
}

/// True when this binary carries a trained demo model (built with `demo/kimi-k3-demo/`).
pub fn embedded() -> bool {
    !files::MODEL_FILES.is_empty()
}

/// The demo model's directory name under the cache directory.
pub fn model_name() -> &'static str {
    if embedded() { MODEL_NAME } else { RANDOM_MODEL_NAME }
}

/// The demo drafter's directory name under the cache directory.
pub fn dspark_name() -> &'static str {
    if embedded() { DSPARK_NAME } else { RANDOM_DSPARK_NAME }
}

/// One file of a copy: its name, size and xxh3-128 (hex).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Entry {
    pub name: String,
    pub bytes: u64,
    pub xxh3_128: String,
}

fn hex128(h: u128) -> String {
    format!("{h:032x}")
}

/// The entries of embedded files, computed once per process.
fn embedded_entries(
    list: &'static [(&'static str, &'static [u8])],
    cell: &'static OnceLock<Vec<Entry>>,
) -> &'static [Entry] {
    cell.get_or_init(|| {
        list.iter()
            .map(|(name, b)| Entry {
                name: (*name).to_string(),
                bytes: b.len() as u64,
                xxh3_128: hex128(xxhash_rust::xxh3::xxh3_128(b)),
            })
            .collect()
    })
}

/// Size and xxh3-128 of the file at `path`, read in pieces.
fn hash_file(path: &Path) -> std::io::Result<(u64, String)> {
    let mut f = std::fs::File::open(path)?;
    let mut h = xxhash_rust::xxh3::Xxh3Default::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf)?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
    Ok((n, hex128(h.digest128())))
}

/// Why the copy in `dir` is not the demo (None: it is). `expected`: the embedded files' entries.
fn mismatch(dir: &Path, expected: Option<&[Entry]>) -> Option<String> {
    let text = match std::fs::read(dir.join(MANIFEST)) {
        Ok(t) => t,
        Err(e) => return Some(format!("no readable {MANIFEST}: {e}")),
    };
    let recorded: Vec<Entry> = match serde_json::from_slice::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| serde_json::from_value(v["files"].clone()).ok())
    {
        Some(r) => r,
        None => return Some(format!("{MANIFEST} is malformed")),
    };
    if let Some(want) = expected
        && recorded != want
    {
        return Some("it holds other files than this binary's demo".into());
    }
    for e in &recorded {
        if e.name.contains(['/', '\\']) || e.name == ".." || e.name == MANIFEST {
            return Some(format!("{MANIFEST} names `{}`", e.name));
        }
        let p = dir.join(&e.name);
        // The size first: a truncated file is found without reading it.
        match std::fs::metadata(&p) {
            Ok(m) if m.len() == e.bytes => {}
            Ok(m) => return Some(format!("{} has {} bytes, expected {}", e.name, m.len(), e.bytes)),
            Err(err) => return Some(format!("{}: {err}", e.name)),
        }
        match hash_file(&p) {
            Ok((n, h)) if n == e.bytes && h == e.xxh3_128 => {}
            Ok(_) => return Some(format!("{} does not hash to its recorded xxh3-128", e.name)),
            Err(err) => return Some(format!("{}: {err}", e.name)),
        }
    }
    None
}

/// Fsyncs every file in `dir`, writes the manifest of them last (fsynced) and syncs `dir`.
fn seal(dir: &Path) -> Result<(), DemoError> {
    let mut names = Vec::new();
    for e in std::fs::read_dir(dir).map_err(io(dir))? {
        let e = e.map_err(io(dir))?;
        if e.file_type().map_err(io(dir))?.is_file() {
            names.push(e.file_name().to_string_lossy().into_owned());
        }
    }
    names.sort();
    let mut entries = Vec::new();
    for name in names.into_iter().filter(|n| n != MANIFEST) {
        let p = dir.join(&name);
        std::fs::File::open(&p).and_then(|f| crate::util::sync_file(&f)).map_err(io(&p))?;
        let (bytes, xxh3_128) = hash_file(&p).map_err(io(&p))?;
        entries.push(Entry { name, bytes, xxh3_128 });
    }
    let p = dir.join(MANIFEST);
    let body = serde_json::to_vec_pretty(&serde_json::json!({"format": 1, "files": entries}))
        .map_err(|e| DemoError::Io { path: p.clone(), source: e.into() })?;
    let mut f = std::fs::File::create(&p).map_err(io(&p))?;
    f.write_all(&body).and_then(|()| crate::util::sync_file(&f)).map_err(io(&p))?;
    crate::util::sync_dir(dir);
    Ok(())
}

/// Removes a file, link or directory tree at `p` (nothing there is fine).
fn remove_any(p: &Path) {
    let _ = match std::fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(p),
        Ok(_) => std::fs::remove_file(p),
        Err(_) => Ok(()),
    };
}

/// Ensures `cache/name` holds a checked copy built by `build` (see the module contract).
fn lay_out(
    cache: &Path,
    name: &str,
    expected: Option<&[Entry]>,
    what: &str,
    build: &dyn Fn(&Path) -> Result<(), DemoError>,
    note: &dyn Fn(&str),
) -> Result<PathBuf, DemoError> {
    // Threads of one process share its temporaries' names: one of them lays out at a time.
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _guard = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    std::fs::create_dir_all(cache).map_err(io(cache))?;
    for p in crate::util::remove_stale_temps(cache, &TEMP_STEMS) {
        note(&format!("removed {} (left by an interrupted run)", p.display()));
    }
    let target = cache.join(name);
    let pid = std::process::id();
    let tmp = cache.join(format!(".{name}.demo-tmp-{pid}"));
    let old = cache.join(format!(".{name}.demo-old-{pid}"));
    let mut why = String::new();
    for _ in 0..ATTEMPTS {
        let present = std::fs::symlink_metadata(&target).is_ok();
        if present {
            match mismatch(&target, expected) {
                None => return Ok(recorded(target)),
                Some(w) => {
                    note(&format!("{} is not an intact copy of the demo ({w}); replacing it", target.display()));
                    why = w;
                }
            }
        } else {
            note(&format!("creating {what} in {} ...", target.display()));
        }
        remove_any(&tmp);
        if let Err(e) = build(&tmp).and_then(|()| seal(&tmp)) {
            remove_any(&tmp);
            return Err(e);
        }
        if present {
            match std::fs::rename(&target, &old) {
                // Gone already: another run moved it aside first.
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    remove_any(&tmp);
                    return Err(DemoError::Io { path: target, source: e });
                }
                _ => {}
            }
        }
        let placed = std::fs::rename(&tmp, &target);
        remove_any(&old);
        match placed {
            Ok(()) => {
                crate::util::sync_dir(cache);
                return Ok(recorded(target));
            }
            // Lost the race: the winner's directory is there; check it on the next round.
            Err(e) if matches!(e.kind(), std::io::ErrorKind::DirectoryNotEmpty | std::io::ErrorKind::AlreadyExists) => {
                remove_any(&tmp);
            }
            Err(e) => {
                remove_any(&tmp);
                return Err(DemoError::Io { path: target, source: e });
            }
        }
    }
    Err(DemoError::Unsettled { path: target, why })
}

/// `dir` (just checked against the demo's own manifest) with checksum records of its shards and
/// model files, as written by deltafin: a first run then has nothing to record from unverified
/// files. A failure to record is a warning (the checkpoint records it at open as usual).
fn recorded(dir: PathBuf) -> PathBuf {
    if !dir.join(crate::model::checksums::SIDECAR).exists()
        && let Err(e) = crate::model::sidecar::record_dir(&dir, crate::model::checksums::Source::Written)
    {
        tracing::warn!("{}: checksums not recorded: {e}", dir.display());
    }
    dir
}

/// Writes embedded files into `dir` (created).
fn write_files(dir: &Path, list: &[(&str, &[u8])]) -> Result<(), DemoError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    for (name, bytes) in list {
        let p = dir.join(name);
        std::fs::write(&p, bytes).map_err(io(&p))?;
    }
    Ok(())
}

static MODEL_ENTRIES: OnceLock<Vec<Entry>> = OnceLock::new();
static DSPARK_ENTRIES: OnceLock<Vec<Entry>> = OnceLock::new();

/// The demo model's directory under `cache`, laid out on first use. `note` receives what is being
/// done (creating, replacing a damaged copy, removing leftovers), for the user.
pub fn model_dir(cache: &Path, note: &dyn Fn(&str)) -> Result<PathBuf, DemoError> {
    if embedded() {
        let expected = embedded_entries(files::MODEL_FILES, &MODEL_ENTRIES);
        return lay_out(
            cache,
            MODEL_NAME,
            Some(expected),
            "the demo checkpoint (K3 layout)",
            &|d| write_files(d, files::MODEL_FILES),
            note,
        );
    }
    lay_out(
        cache,
        RANDOM_MODEL_NAME,
        None,
        "the demo checkpoint (random weights, K3 layout)",
        &|d| {
            synth::write(&SynthSpec::demo(), d, false, &|_, _| {})
                .map_err(|source| DemoError::Synth { path: d.to_path_buf(), source })
        },
        note,
    )
}

/// The demo's DSpark drafter directory under `cache` (beside the model, which is laid out too),
/// laid out on first use; None when this binary carries a trained model without a drafter.
pub fn dspark_dir(cache: &Path, note: &dyn Fn(&str)) -> Result<Option<PathBuf>, DemoError> {
    let model = model_dir(cache, note)?;
    if embedded() {
        if files::DSPARK_FILES.is_empty() {
            return Ok(None);
        }
        let expected = embedded_entries(files::DSPARK_FILES, &DSPARK_ENTRIES);
        return lay_out(
            cache,
            DSPARK_NAME,
            Some(expected),
            "the demo's DSpark drafter",
            &|d| write_files(d, files::DSPARK_FILES),
            note,
        )
        .map(Some);
    }
    let target = K3Config::load(&model).map_err(|source| DemoError::Model { path: model.clone(), source })?;
    lay_out(
        cache,
        RANDOM_DSPARK_NAME,
        None,
        "the demo's DSpark drafter (random weights)",
        &|d| {
            use crate::k3::dspark::synth::{self as ds, DSparkSynthSpec};
            ds::write(&DSparkSynthSpec::for_target(&target), &target, d, false, &|_, _| {})
                .map_err(|source| DemoError::Synth { path: d.to_path_buf(), source })
        },
        note,
    )
    .map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files_of(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> =
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    }

    #[test]
    fn a_copy_is_checked_against_its_manifest_and_replaced_when_damaged() {
        let cache = tempfile::tempdir().unwrap();
        let list: &[(&str, &[u8])] = &[("a.txt", b"hello"), ("b.bin", &[0, 1, 2, 3])];
        let expected: Vec<Entry> = list
            .iter()
            .map(|(n, b)| Entry {
                name: n.to_string(),
                bytes: b.len() as u64,
                xxh3_128: hex128(xxhash_rust::xxh3::xxh3_128(b)),
            })
            .collect();
        let notes = Mutex::new(Vec::<String>::new());
        let note = |m: &str| notes.lock().unwrap().push(m.to_string());
        let build = |d: &Path| write_files(d, list);
        let dir = lay_out(cache.path(), "x", Some(&expected), "x", &build, &note).unwrap();
        assert_eq!(files_of(&dir), vec![MANIFEST, "a.txt", "b.bin"]);
        assert!(mismatch(&dir, Some(&expected)).is_none());
        // Truncated: found by size; same size, other bytes: found by hash; both replaced.
        std::fs::write(dir.join("a.txt"), b"hel").unwrap();
        assert!(mismatch(&dir, Some(&expected)).unwrap().contains("a.txt has 3 bytes, expected 5"));
        lay_out(cache.path(), "x", Some(&expected), "x", &build, &note).unwrap();
        assert_eq!(std::fs::read(dir.join("a.txt")).unwrap(), b"hello");
        std::fs::write(dir.join("b.bin"), [9, 9, 9, 9]).unwrap();
        assert!(mismatch(&dir, Some(&expected)).unwrap().contains("does not hash"));
        lay_out(cache.path(), "x", Some(&expected), "x", &build, &note).unwrap();
        assert_eq!(std::fs::read(dir.join("b.bin")).unwrap(), [0, 1, 2, 3]);
        // Another version's copy (its manifest differs from the embedded files) is replaced too.
        let other = [Entry { name: "a.txt".into(), bytes: 5, xxh3_128: expected[0].xxh3_128.clone() }];
        assert!(mismatch(&dir, Some(&other)).unwrap().contains("other files"));
        // Only the copy is left: no temporaries.
        assert_eq!(files_of(cache.path()), vec!["x"]);
        let notes = notes.lock().unwrap();
        assert!(notes[0].starts_with("creating x in"), "{notes:?}");
        assert_eq!(notes.iter().filter(|n| n.contains("replacing it")).count(), 2, "{notes:?}");
    }

    #[test]
    fn temporaries_of_dead_runs_are_removed() {
        let cache = tempfile::tempdir().unwrap();
        // A process that has exited: its id names no live process (for the moment this test needs).
        let mut dead = std::process::Command::new("true").spawn().unwrap();
        let pid = dead.id();
        dead.wait().unwrap();
        let stale = cache.path().join(format!(".x.demo-tmp-{pid}"));
        std::fs::create_dir_all(&stale).unwrap();
        std::fs::write(stale.join("half"), b"..").unwrap();
        let list: &[(&str, &[u8])] = &[("a", b"1")];
        lay_out(cache.path(), "x", None, "x", &|d| write_files(d, list), &|_| {}).unwrap();
        assert!(!stale.exists());
        assert_eq!(files_of(cache.path()), vec!["x"]);
    }
}
