//! The files a command writes, checked in one place before any work: every flag that names an
//! output (`run --stats-json` and `--trace-routes`, `score --logits-out`, `batch --out`, `bench
//! run --out`, `--fetch-trace` and `--plot`, every engine's `--expert-heat FILE`) is listed here
//! with the kind of file deltafin writes there, beside the command's input files.
//!
//! Contract ([`Outputs::check`]): an output is refused, the message naming its flag and its file,
//! when it
//! - is the same file as one of the command's inputs, by any path, link or hard link, or as
//!   standard input when that is a file (`run --prompt-file p.txt --stats-json p.txt`): always,
//!   `--force` or not;
//! - is the same file as another output of the command (the second write would replace the
//!   first);
//! - exists, holds something, and is not what deltafin writes there (each [`Kind`] recognises its
//!   own files by their content: an earlier run's counters, logits, records, ...), unless `--force`
//!   is given — an empty file (`mktemp`) holds nothing to lose; `batch --out` is told apart by
//!   `batch_io`, whose message says which line is not a record;
//! - cannot be written: a directory, device, FIFO or socket, or a directory that does not exist
//!   (`util::check_output_path`, `util::check_append_path`).
//!
//! Nothing is written here; the writes themselves stay atomic (`util::write_atomic`) or appended
//! one whole record at a time.

use super::engine::EngineArgs;
use crate::engine::ExpertHeat;
use anyhow::{Result, bail};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// What deltafin writes to an output, and so what an existing file there must be to be replaced
/// (or appended to) without `--force`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// The counters as one JSON object (`--stats-json`).
    Stats,
    /// A route trace (`--trace-routes`).
    Routes,
    /// A safetensors file holding the tensor `logits` alone (`score --logits-out`).
    Logits,
    /// Bench records, one JSON object a line, appended (`bench run --out`).
    BenchRecords,
    /// An expert fetch trace (`bench run --fetch-trace`).
    FetchTrace,
    /// Route heat (`--expert-heat FILE`).
    Heat,
    /// A plot (`bench run --plot`'s SVG files).
    Plot,
    /// Batch result records, one a line, appended (`batch --out`; its own checks in `batch_io`).
    Batch,
}

/// Largest existing file read to tell whether it is one of ours (JSON kinds; larger is not).
const MAX_READ: u64 = 256 << 20;

impl Kind {
    /// What deltafin writes there, for messages.
    fn what(self) -> &'static str {
        match self {
            Kind::Stats => "counters deltafin wrote (JSON)",
            Kind::Routes => "a route trace deltafin wrote",
            Kind::Logits => "logits deltafin wrote (safetensors)",
            Kind::BenchRecords => "bench records deltafin wrote",
            Kind::FetchTrace => "a fetch trace deltafin wrote",
            Kind::Heat => "route heat deltafin wrote",
            Kind::Plot => "a plot deltafin drew",
            Kind::Batch => "a batch output",
        }
    }

    /// Written by appending (an existing file of ours is added to, never replaced).
    fn appended(self) -> bool {
        matches!(self, Kind::BenchRecords | Kind::Batch)
    }

    /// Whether `bytes`, an existing file's content, are a file of this kind.
    pub fn recognises(self, bytes: &[u8]) -> bool {
        let obj = || serde_json::from_slice::<Value>(bytes).ok().filter(Value::is_object);
        let has = |v: &Value, keys: &[&str]| keys.iter().all(|k| v.get(*k).is_some());
        match self {
            Kind::Stats => obj().is_some_and(|v| has(&v, &["prompt_tokens", "generated_tokens", "read_amplification"])),
            Kind::Routes => obj().is_some_and(|v| v["version"].is_u64() && v["layers"].is_object()),
            Kind::FetchTrace => obj().is_some_and(|v| has(&v, &["cache_slots", "trace"])),
            Kind::Heat => obj().is_some_and(|v| v["format"] == crate::store::heat::FORMAT),
            Kind::Logits => safetensors_logits(bytes),
            Kind::BenchRecords => bytes
                .split(|&b| b == b'\n')
                .filter(|l| !l.iter().all(u8::is_ascii_whitespace))
                .all(|l| serde_json::from_slice::<Value>(l).is_ok_and(|v| has(&v, &["bench", "date", "machine"]))),
            Kind::Plot => bytes.starts_with(b"<svg") && memfind(bytes, b"xmlns=\"http://www.w3.org/2000/svg\""),
            Kind::Batch => crate::service::batch::read_output(bytes).is_ok(),
        }
    }
}

/// `bytes` start a safetensors file whose header holds the tensor `logits` and nothing else.
fn safetensors_logits(bytes: &[u8]) -> bool {
    let Some(len) = bytes.get(..8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default())) else {
        return false;
    };
    let head = usize::try_from(len).ok().and_then(|n| bytes.get(8..8usize.checked_add(n)?));
    let Some(Value::Object(m)) = head.and_then(|h| serde_json::from_slice::<Value>(h).ok()) else { return false };
    m.contains_key("logits") && m.keys().all(|k| k == "logits" || k == "__metadata__")
}

fn memfind(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// A command's outputs and inputs (see the module contract).
pub struct Outputs<'a> {
    outs: Vec<(&'static str, PathBuf, Kind)>,
    ins: Vec<(&'static str, &'a Path)>,
    force: bool,
}

impl<'a> Outputs<'a> {
    /// `force`: the command's `--force` (an existing file deltafin did not write may be replaced).
    pub fn new(force: bool) -> Self {
        Outputs { outs: Vec::new(), ins: Vec::new(), force }
    }

    /// An output flag and its file, if given.
    pub fn write(mut self, flag: &'static str, path: Option<&Path>, kind: Kind) -> Self {
        if let Some(p) = path.filter(|p| p.as_os_str() != "-") {
            self.outs.push((flag, p.to_path_buf(), kind));
        }
        self
    }

    /// An input flag and its file, if given ("-": standard input).
    pub fn read(mut self, flag: &'static str, path: Option<&'a Path>) -> Self {
        self.ins.extend(path.map(|p| (flag, p)));
        self
    }

    /// An input flag given several times.
    pub fn read_all(mut self, flag: &'static str, paths: impl IntoIterator<Item = &'a Path>) -> Self {
        self.ins.extend(paths.into_iter().map(|p| (flag, p)));
        self
    }

    /// The engine's files: `--expert-heat FILE` (written at the end of a run), `--placement` (read).
    pub fn engine(self, e: &'a EngineArgs) -> Self {
        let heat = match &e.expert_heat {
            ExpertHeat::At(p) => Some(p.as_path()),
            _ => None,
        };
        self.write("--expert-heat", heat, Kind::Heat).read("--placement", e.placement.as_deref())
    }

    /// Refuses what the module contract refuses, before any work.
    pub fn check(&self) -> Result<()> {
        for (i, (flag, path, kind)) in self.outs.iter().enumerate() {
            let at = path.display();
            for (in_flag, input) in &self.ins {
                if same_as_input(path, input) {
                    let input = if input.as_os_str() == "-" {
                        format!("standard input ({in_flag} -)")
                    } else {
                        format!("{in_flag} {}", input.display())
                    };
                    bail!(
                        "{flag} {at} is the same file as {input}: refusing to write over an input; give another {flag}"
                    );
                }
            }
            if let Some((other, p, _)) = self.outs[..i].iter().find(|(_, p, _)| same_path(p, path)) {
                bail!("{flag} {at} is the same file as {other} {}: each output needs its own file", p.display());
            }
            // A batch output is told apart by `batch_io`, which says why a file is not one.
            if !self.force && *kind != Kind::Batch && !ours_or_empty(path, *kind) {
                let done = if kind.appended() { "appended to" } else { "overwritten" };
                bail!(
                    "{flag} {at}: exists and is not {}: not {done}. Give another path, or --force to replace it",
                    kind.what()
                );
            }
            let writable = match kind {
                // Heat at a path that is not a regular file is neither read nor written (a
                // warning, `store::heat`); a batch output is checked by `batch_io`.
                Kind::Batch | Kind::Heat => Ok(()),
                Kind::BenchRecords => crate::util::check_append_path(path),
                // The plot's directory is made when missing.
                Kind::Plot if !path.parent().is_some_and(Path::is_dir) => Ok(()),
                _ => crate::util::check_output_path(path),
            };
            writable.map_err(|e| anyhow::anyhow!("{flag} {at}: {e}"))?;
        }
        Ok(())
    }
}

/// An existing file at `path` that holds something and is not of `kind` (what `--force` replaces).
pub fn foreign(path: &Path, kind: Kind) -> bool {
    !ours_or_empty(path, kind)
}

/// True where `path` does not exist, is not a regular file (the write checks refuse what must be
/// refused), is empty, or holds a file of `kind`.
fn ours_or_empty(path: &Path, kind: Kind) -> bool {
    let Ok(m) = std::fs::metadata(path) else { return true };
    if !m.is_file() || m.len() == 0 {
        return true;
    }
    let limit = match kind {
        Kind::Batch => u64::MAX,
        // A safetensors header is at its start.
        Kind::Logits => 100 << 20,
        _ => MAX_READ,
    };
    if m.len() > limit && kind != Kind::Logits {
        return false;
    }
    use std::io::Read;
    let mut bytes = Vec::new();
    let read = crate::util::open_regular(path).and_then(|f| f.take(limit).read_to_end(&mut bytes));
    read.is_ok() && kind.recognises(&bytes)
}

/// `out` is the file `input` names ("-": standard input, when that is a file).
fn same_as_input(out: &Path, input: &Path) -> bool {
    if input.as_os_str() == "-" {
        let stdin = crate::util::fd_id(0);
        return stdin.is_some() && crate::util::file_id(out) == stdin;
    }
    same_path(out, input)
}

/// `a` and `b` name the same file: the same file system object when both exist, else the same
/// absolute path (directories resolved).
fn same_path(a: &Path, b: &Path) -> bool {
    match (crate::util::file_id(a), crate::util::file_id(b)) {
        (Some(x), Some(y)) => x == y,
        (None, None) => absolute(a).is_some_and(|x| absolute(b) == Some(x)),
        _ => false,
    }
}

/// `p` with its directory resolved (the file itself may not exist yet).
fn absolute(p: &Path) -> Option<PathBuf> {
    let dir = p.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    Some(dir.canonicalize().ok()?.join(p.file_name()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_knows_its_own_files_and_no_others() {
        let notes = b"my notes\n".as_slice();
        let cases: [(Kind, &[u8]); 7] = [
            (Kind::Stats, br#"{"prompt_tokens":3,"generated_tokens":2,"read_amplification":null}"#),
            (Kind::Routes, br#"{"version":1,"model":"x","layers":{"1":[0,2]}}"#),
            (Kind::FetchTrace, br#"{"cache_slots":4,"trace":[]}"#),
            (Kind::Heat, br#"{"format":"deltafin-expert-heat","runs":1}"#),
            (Kind::BenchRecords, b"{\"bench\":\"run\",\"date\":\"d\",\"machine\":{}}\n\n{\"bench\":\"run\",\"date\":\"d\",\"machine\":{}}\n"),
            (Kind::Plot, br#"<svg width="9" height="4" xmlns="http://www.w3.org/2000/svg"></svg>"#),
            (Kind::Batch, b"{\"id\":\"a\",\"line\":1,\"text\":\"t\"}\n"),
        ];
        for (kind, ours) in cases {
            assert!(kind.recognises(ours), "{kind:?}");
            assert!(!kind.recognises(notes), "{kind:?}");
            assert!(!kind.recognises(br#"{"a":1}"#), "{kind:?}");
        }
        let head = br#"{"logits":{"dtype":"F32","shape":[1,2],"data_offsets":[0,8]}}"#;
        let mut st = (head.len() as u64).to_le_bytes().to_vec();
        st.extend_from_slice(head);
        assert!(Kind::Logits.recognises(&st));
        assert!(!Kind::Logits.recognises(notes) && !Kind::Logits.recognises(&st[..12]));
        let other = br#"{"weights":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
        let mut st = (other.len() as u64).to_le_bytes().to_vec();
        st.extend_from_slice(other);
        assert!(!Kind::Logits.recognises(&st), "another safetensors file is not logits of ours");
    }
}
