//! Where a model's checksum record is kept: the sidecar `MODEL/.deltafin-checksums.json` and its
//! second copy in the user's cache (`CACHE/checksums/layouts/<layout>/<directory>.json`), so that
//! a copy of the model without its hidden sidecar, or a sidecar emptied or damaged, is checked
//! against what was recorded before.
//!
//! Contract: writes are atomic (temporary file, fsync, rename) and merge with what is there (two
//! processes recording different shards both keep theirs), and go to both places (the directory's
//! when it is writable). A malformed sidecar is kept aside as `NAME.malformed-TIME`, never
//! replaced in place, and the cache's copy is used; records are never taken from the bytes of a
//! file whose record was lost (that is `model::integrity`'s side: it records only what no copy
//! describes, and says so).

use super::checksums::{FileRecord, MODEL_FILES, SIDECAR, ShardRecord, Source, hash_file, unix_now};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use xxhash_rust::xxh3::xxh3_64;

const VERSION: u32 = 1;

/// The sidecar: one record per shard, and one per model file.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Sidecar {
    pub version: u32,
    pub shards: Vec<ShardRecord>,
    #[serde(default)]
    pub files: Vec<FileRecord>,
}

/// The places a model directory's sidecar may be: in the directory, else (an older deltafin's
/// place for a directory it could not write) in the cache under the directory's path.
pub fn sidecar_paths(dir: &Path) -> [PathBuf; 2] {
    [dir.join(SIDECAR), crate::util::cache_dir().join("checksums").join(format!("{:016x}.json", dir_key(dir)))]
}

fn dir_key(dir: &Path) -> u64 {
    let canon = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    xxh3_64(canon.as_os_str().as_encoded_bytes())
}

/// What identifies a model's layout whatever directory holds it: its shard names and lengths (a
/// copy keeps both). The key of the record's second copy, in the cache.
pub fn layout_key<'a>(shards: impl Iterator<Item = (&'a str, u64)>) -> u64 {
    let mut v: Vec<(&str, u64)> = shards.collect();
    v.sort();
    let mut text = String::new();
    for (n, len) in v {
        text.push_str(&format!("{n}\0{len}\n"));
    }
    xxh3_64(text.as_bytes())
}

/// The second copy of every record, outside the model directory: `CACHE/checksums/layouts/
/// <layout key>/<directory key>.json`, one file per directory a model of that layout was
/// recorded in (at most [`KEPT_COPIES`], the least recently saved go). A model copied without its
/// sidecar, or whose sidecar was emptied or damaged, is checked against what was recorded
/// before, here.
fn layout_dir(layout: u64) -> PathBuf {
    crate::util::cache_dir().join("checksums").join("layouts").join(format!("{layout:016x}"))
}

/// Directories of one layout whose records the cache keeps.
const KEPT_COPIES: usize = 8;

/// A record kept in the cache for a directory.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct KeptRecord {
    /// The directory it was recorded for (canonical path).
    pub dir: String,
    /// Unix seconds when saved.
    pub saved: u64,
    pub sidecar: Sidecar,
}

/// The layout key ([`layout_key`]) of the `*.safetensors` files in `dir`.
pub fn dir_layout_key(dir: &Path) -> u64 {
    let files: Vec<(String, u64)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            let shard = n.ends_with(".safetensors") && !n.starts_with('.');
            Some((n, e.metadata().ok().filter(|m| m.is_file() && shard)?.len()))
        })
        .collect();
    layout_key(files.iter().map(|(n, l)| (n.as_str(), *l)))
}

/// Where a directory's record was found.
#[derive(Clone, Debug, PartialEq)]
pub enum Origin {
    /// Its own sidecar (or the cache's copy for that very directory).
    Own,
    /// Nothing was found for the directory.
    None,
}

/// What [`Sidecar::load`] found: the record (empty when none), where, and what was wrong on the
/// way (a malformed sidecar kept aside), for the caller to report.
pub struct Loaded {
    pub sidecar: Sidecar,
    pub origin: Origin,
    pub notes: Vec<String>,
}

/// A malformed record is never replaced in place: it is renamed `NAME.malformed-UNIXTIME` and
/// kept for the user to look at. Returns the note to print.
fn keep_aside(p: &Path, why: &str) -> String {
    let aside = p.with_file_name(format!(
        "{}.malformed-{}",
        p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        unix_now()
    ));
    match std::fs::rename(p, &aside) {
        Ok(()) => format!("{}: {why}; kept aside as {}", p.display(), aside.display()),
        Err(e) => format!("{}: {why}; it could not be kept aside ({e}) and is not used", p.display()),
    }
}

impl Sidecar {
    /// The record of `dir`: its own sidecar, else the cache's copy for that directory (the
    /// layout copy of [`layout_dir`], or an older deltafin's path-keyed file). A malformed or
    /// empty sidecar is kept aside (never silently replaced) and the cache's copy used.
    pub fn load(dir: &Path) -> Loaded {
        let mut notes = Vec::new();
        let own = dir.join(SIDECAR);
        match read_sidecar(&own) {
            Ok(Some(s)) => return Loaded { sidecar: s, origin: Origin::Own, notes },
            Ok(None) => {}
            Err(why) => notes.push(keep_aside(&own, &why)),
        }
        if let Some((p, s)) = kept_for(dir) {
            if !notes.is_empty() {
                notes.push(format!("using the copy of its record kept in {}", p.display()));
            }
            return Loaded { sidecar: s, origin: Origin::Own, notes };
        }
        Loaded { sidecar: Sidecar { version: VERSION, ..Default::default() }, origin: Origin::None, notes }
    }

    pub fn get(&self, name: &str) -> Option<&ShardRecord> {
        self.shards.iter().find(|r| r.name == name)
    }

    pub fn file(&self, name: &str) -> Option<&FileRecord> {
        self.files.iter().find(|r| r.name == name)
    }
}

/// The copy of `dir`'s own record the cache keeps (or an older deltafin's path-keyed file), with
/// where it was found.
pub fn kept_for(dir: &Path) -> Option<(PathBuf, Sidecar)> {
    let key = dir_key(dir);
    let kept = std::fs::read_dir(crate::util::cache_dir().join("checksums").join("layouts"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|l| l.path().join(format!("{key:016x}.json")));
    for p in kept.chain([sidecar_paths(dir)[1].clone()]) {
        let found = match read_kept(&p) {
            Ok(Some(k)) if k.sidecar.version == VERSION => Some(k.sidecar),
            Ok(_) => None,
            // The path-keyed file of an older deltafin is a bare sidecar.
            Err(_) => read_sidecar(&p).ok().flatten(),
        };
        if let Some(s) = found {
            return Some((p, s));
        }
    }
    None
}

/// A sidecar file: None when absent; an error (why) when it is there but not a usable record
/// (malformed or emptied, another version).
fn read_sidecar(p: &Path) -> Result<Option<Sidecar>, String> {
    let text = match std::fs::read_to_string(p) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("unreadable ({e})")),
    };
    match serde_json::from_str::<Sidecar>(&text) {
        Ok(s) if s.version != VERSION => Err(format!("version {} is not {VERSION}", s.version)),
        Ok(s) => Ok(Some(s)),
        Err(e) => Err(format!("malformed ({e})")),
    }
}

fn read_kept(p: &Path) -> Result<Option<KeptRecord>, String> {
    match std::fs::read_to_string(p) {
        Ok(t) => serde_json::from_str::<KeptRecord>(&t).map(Some).map_err(|e| e.to_string()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

/// The records the cache keeps for models of layout `layout` in other directories than `dir`,
/// most recently saved first: the candidates a copy without its own record is checked against.
pub fn kept_elsewhere(dir: &Path, layout: u64) -> Vec<KeptRecord> {
    let own = format!("{:016x}.json", dir_key(dir));
    let mut v: Vec<KeptRecord> = std::fs::read_dir(layout_dir(layout))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy() != own)
        .filter_map(|e| read_kept(&e.path()).ok().flatten())
        .filter(|k| k.sidecar.version == VERSION)
        .collect();
    v.sort_by_key(|k| std::cmp::Reverse(k.saved));
    v
}

/// Merges `records` into `dir`'s sidecar (a record replaces the one of the same shard) and writes
/// it atomically: in the directory when it is writable, and always its copy in the cache
/// ([`layout_dir`]). Returns where the directory's own record went.
pub fn save(dir: &Path, records: Vec<ShardRecord>) -> std::io::Result<PathBuf> {
    save_all(dir, records, Vec::new(), &[])
}

/// [`save`], also setting `damaged` on the records of the shards named in `damaged`.
pub fn save_with(dir: &Path, records: Vec<ShardRecord>, damaged: &[&str]) -> std::io::Result<PathBuf> {
    save_all(dir, records, Vec::new(), damaged)
}

/// [`save_with`], also merging model file records (`files`: a record replaces the one of the same
/// file).
pub fn save_all(
    dir: &Path,
    records: Vec<ShardRecord>,
    files: Vec<FileRecord>,
    damaged: &[&str],
) -> std::io::Result<PathBuf> {
    save_merged(dir, records, files, damaged, false)
}

/// [`save`], with `files` as the whole list of model file records (a file no longer there is no
/// longer recorded: `verify --rehash`).
pub fn save_replacing_files(dir: &Path, records: Vec<ShardRecord>, files: Vec<FileRecord>) -> std::io::Result<PathBuf> {
    save_merged(dir, records, files, &[], true)
}

fn save_merged(
    dir: &Path,
    records: Vec<ShardRecord>,
    files: Vec<FileRecord>,
    damaged: &[&str],
    replace_files: bool,
) -> std::io::Result<PathBuf> {
    let loaded = Sidecar::load(dir);
    for n in &loaded.notes {
        tracing::warn!("{n}");
    }
    let mut s = loaded.sidecar;
    s.version = VERSION;
    for r in records {
        match s.shards.iter_mut().find(|x| x.name == r.name) {
            Some(x) => *x = r,
            None => s.shards.push(r),
        }
    }
    if replace_files {
        s.files.clear();
    }
    for f in files {
        match s.files.iter_mut().find(|x| x.name == f.name) {
            Some(x) => *x = f,
            None => s.files.push(f),
        }
    }
    for r in s.shards.iter_mut().filter(|r| damaged.contains(&r.name.as_str())) {
        r.damaged = true;
    }
    s.shards.sort_by(|a, b| a.name.cmp(&b.name));
    s.files.sort_by(|a, b| a.name.cmp(&b.name));
    let body = serde_json::to_vec_pretty(&s).map_err(std::io::Error::other)?;
    let kept = save_kept(dir, &s);
    let own = dir.join(SIDECAR);
    match crate::util::write_atomic(&own, &body) {
        Ok(()) => {
            if let Err(e) = kept {
                tracing::warn!("the copy of {}'s checksums in the cache was not saved: {e}", dir.display());
            }
            Ok(own)
        }
        Err(e) => {
            tracing::debug!("{}: {e}; keeping checksums in the cache only", own.display());
            kept
        }
    }
}

/// Writes `s` as `dir`'s copy in the cache, and drops the oldest copies of its layout past
/// [`KEPT_COPIES`]. Returns its path.
fn save_kept(dir: &Path, s: &Sidecar) -> std::io::Result<PathBuf> {
    let ldir = layout_dir(dir_layout_key(dir));
    std::fs::create_dir_all(&ldir)?;
    let canon = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let k = KeptRecord { dir: canon.display().to_string(), saved: unix_now(), sidecar: s.clone() };
    let path = ldir.join(format!("{:016x}.json", dir_key(dir)));
    crate::util::write_atomic(&path, &serde_json::to_vec(&k).map_err(std::io::Error::other)?)?;
    let mut all: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(&ldir)?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    all.sort();
    while all.len() > KEPT_COPIES {
        let (_, p) = all.remove(0);
        let _ = std::fs::remove_file(p);
    }
    Ok(path)
}

/// Records every `*.safetensors` shard of `dir` and its [`MODEL_FILES`] as `source`: for files
/// deltafin wrote or checked itself (synth, the demo), never for files found.
pub fn record_dir(dir: &Path, source: Source) -> std::io::Result<PathBuf> {
    let mut shards = Vec::new();
    let mut files = Vec::new();
    for e in std::fs::read_dir(dir)?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let p = e.path();
        if name.ends_with(".safetensors") && !name.starts_with('.') && e.file_type()?.is_file() {
            let d = hash_file(&p, &mut |_| {})?;
            shards.push(ShardRecord::new(&p, &d, source)?);
        } else if MODEL_FILES.contains(&name.as_str()) {
            files.push(FileRecord::new(&name, &std::fs::read(&p)?, source));
        }
    }
    if shards.is_empty() {
        // Not a model directory: nothing to record.
        return Ok(dir.join(SIDECAR));
    }
    save_all(dir, shards, files, &[])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(tensors: &[(&str, Vec<u8>)]) -> Vec<u8> {
        let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
            .iter()
            .map(|(n, b)| {
                (n.to_string(), safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![b.len()], b).unwrap())
            })
            .collect();
        safetensors::serialize(views, None).unwrap()
    }

    #[test]
    fn records_round_trip_and_merge() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.safetensors");
        std::fs::write(&p, shard(&[("x", vec![1, 2, 3])])).unwrap();
        let d = hash_file(&p, &mut |_| {}).unwrap();
        let mut r = ShardRecord::new(&p, &d, Source::Files).unwrap();
        assert_eq!(r.sums().unwrap(), vec![Some(xxh3_64(&[1, 2, 3]))]);
        save(dir.path(), vec![r.clone()]).unwrap();
        r.name = "other.safetensors".into();
        save(dir.path(), vec![r]).unwrap();
        let s = Sidecar::load(dir.path()).sidecar;
        assert_eq!(s.shards.len(), 2);
        save_with(dir.path(), Vec::new(), &["m.safetensors"]).unwrap();
        assert!(Sidecar::load(dir.path()).sidecar.get("m.safetensors").unwrap().damaged);
    }
}
