//! Per-tensor checksums of a model's shards and checksums of its other files, recorded once and
//! checked on every read: the record's format ([`ShardRecord`], [`FileRecord`]) and the hashing
//! ([`TensorHasher`], [`hash_file`]). Where the record is kept (`MODEL/.deltafin-checksums.json`
//! and its second copy in the cache) is `model::sidecar`; which records apply to the files as
//! they are is `model::integrity`.
//!
//! Contract:
//! - A shard's record is the xxh3-64 of every tensor in it (in the order of their data offsets,
//!   16 hex digits each, `-` x 16 where unknown), bound to the file: its name, length, the xxh3 of
//!   its header bytes, and its identity when recorded (mtime, inode, device). A record whose
//!   header hash or length is not the file's is another file's and is not used; a file whose
//!   identity changed since keeps its record as the expectation (it was modified or replaced:
//!   its bytes are checked against what they were).
//! - Where each record came from is kept: `download` (hashed from the very bytes whose sha256
//!   matched the hub's), `written` (as `deltafin synth` wrote them) or `files` (hashed from the
//!   file as first found: nothing older to compare against). `deltafin verify` marks a shard
//!   `damaged` when its bytes differ; `setup` fetches such a shard again.
//! - Writes are atomic (temporary file, fsync, rename) and merge with what is there (two
//!   processes recording different shards both keep theirs).
//!
//! [`TensorHasher`] computes a shard's record from its bytes in file order (a download stream, a
//! sequential read); [`hash_file`] reads a file through it.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

pub const SIDECAR: &str = ".deltafin-checksums.json";
const UNKNOWN: &str = "----------------";
/// Chunk of a sequential read.
const CHUNK: usize = 8 << 20;

/// Where a shard's checksums came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// Hashed from the downloaded bytes whose sha256 matched the hub's.
    Download,
    /// Hashed as `deltafin synth` wrote the file.
    Written,
    /// Hashed from the file as deltafin first found it.
    Files,
}

impl Source {
    pub fn describe(self) -> &'static str {
        match self {
            Source::Download => "recorded from the download, whose sha256 matched the hub's",
            Source::Written => "recorded as synth wrote it",
            Source::Files => "recorded from the file as first found",
        }
    }
}

/// A file's identity: changes when it is modified (mtime) or replaced (inode, device).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileId {
    pub len: u64,
    pub mtime_ns: i64,
    pub ino: u64,
    pub dev: u64,
}

impl FileId {
    pub fn of_meta(m: &std::fs::Metadata) -> FileId {
        use std::os::unix::fs::MetadataExt;
        FileId {
            len: m.len(),
            mtime_ns: m.mtime().saturating_mul(1_000_000_000).saturating_add(m.mtime_nsec()),
            ino: m.ino(),
            dev: m.dev(),
        }
    }

    pub fn of(path: &Path) -> std::io::Result<FileId> {
        Ok(FileId::of_meta(&std::fs::metadata(path)?))
    }
}

/// One shard's record in the sidecar.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ShardRecord {
    /// File name in the model directory.
    pub name: String,
    pub file: FileId,
    /// xxh3 of the 8-byte length and the header JSON, hex.
    pub header_xxh3: String,
    pub source: Source,
    /// The hub's sha256 of the file (source `download`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// Unix seconds when recorded.
    pub recorded: u64,
    /// Set by `deltafin verify` when the file's bytes differ from this record.
    #[serde(default)]
    pub damaged: bool,
    /// Every tensor's xxh3 in data-offset order, 16 hex digits each (`-` x 16: unknown).
    pub xxh3: String,
    /// Every tensor's header entry (name, dtype, shape, offsets: [`entry_hash`]) in the same
    /// order, 16 hex digits each: what lets a checksum outlive a change elsewhere in the header.
    /// Empty in records of deltafin before 2026-12-07.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub entries: String,
}

impl ShardRecord {
    /// A record of `digest` for the file at `path` as it is now.
    pub fn new(path: &Path, digest: &ShardDigest, source: Source) -> std::io::Result<Self> {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let recorded = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        Ok(ShardRecord {
            name,
            file: FileId::of(path)?,
            header_xxh3: format!("{:016x}", digest.header_xxh3),
            source,
            sha256: None,
            recorded,
            damaged: false,
            xxh3: digest.sums.iter().map(|s| s.map_or_else(|| UNKNOWN.to_string(), |x| format!("{x:016x}"))).collect(),
            entries: digest.entries.iter().map(|x| format!("{x:016x}")).collect(),
        })
    }

    /// The tensors' header entries ([`entry_hash`]), or None when the record has none (older) or
    /// the field is malformed.
    pub fn entry_hashes(&self) -> Option<Vec<u64>> {
        if self.entries.is_empty() || !self.entries.len().is_multiple_of(16) || !self.entries.is_ascii() {
            return None;
        }
        (0..self.entries.len() / 16).map(|i| u64::from_str_radix(&self.entries[16 * i..16 * i + 16], 16).ok()).collect()
    }

    /// The tensors' checksums (None where unknown), or None when the field is malformed.
    pub fn sums(&self) -> Option<Vec<Option<u64>>> {
        if !self.xxh3.len().is_multiple_of(16) || !self.xxh3.is_ascii() {
            return None;
        }
        (0..self.xxh3.len() / 16)
            .map(|i| {
                let s = &self.xxh3[16 * i..16 * i + 16];
                if s == UNKNOWN { Some(None) } else { u64::from_str_radix(s, 16).ok().map(Some) }
            })
            .collect()
    }
}

/// The files of a model beside its shards that change what it computes or says: each is in the
/// record once seen, and a change is an error until re-recorded on purpose.
pub const MODEL_FILES: &[&str] = &[
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer_config.json",
    "tiktoken.model",
    "tokenizer.json",
    "special_tokens_map.json",
    "chat_template.jinja",
];

/// One model file's record (see [`MODEL_FILES`]).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct FileRecord {
    pub name: String,
    pub len: u64,
    /// xxh3 of the whole file, hex.
    pub xxh3: String,
    pub source: Source,
    /// Unix seconds when recorded.
    pub recorded: u64,
}

impl FileRecord {
    /// The record of `bytes`, the contents of file `name`.
    pub fn new(name: &str, bytes: &[u8], source: Source) -> Self {
        FileRecord {
            name: name.into(),
            len: bytes.len() as u64,
            xxh3: format!("{:016x}", xxh3_64(bytes)),
            source,
            recorded: unix_now(),
        }
    }
}

pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// A model file that is not what its record says.
#[derive(Clone, Debug, serde::Serialize)]
pub struct FileProblem {
    pub path: PathBuf,
    /// What is wrong, in words.
    pub what: String,
}

impl std::fmt::Display for FileProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.what)
    }
}

/// What [`TensorHasher`] computed for one shard.
#[derive(Clone, Debug, Default)]
pub struct ShardDigest {
    pub header_xxh3: u64,
    /// The tensors' names, in data-offset order.
    pub names: Vec<String>,
    /// Their checksums (None: not hashed, e.g. a stream install's holes).
    pub sums: Vec<Option<u64>>,
    /// Their header entries ([`entry_hash`]).
    pub entries: Vec<u64>,
}

/// xxh3 of a tensor's header entry: its name, dtype, shape and data offsets. A recorded checksum
/// still applies after a header change (its `__metadata__`, another tensor) while this is unchanged.
pub fn entry_hash(name: &str, info: &safetensors::tensor::TensorInfo) -> u64 {
    let text = format!("{name}\0{:?}\0{:?}\0{}\0{}", info.dtype, info.shape, info.data_offsets.0, info.data_offsets.1);
    xxh3_64(text.as_bytes())
}

/// The header entries ([`entry_hash`]) of a shard's tensors in data-offset order
/// ([`tensor_order`]).
pub fn entry_hashes(meta: &safetensors::tensor::Metadata, order: &[(String, u64, u64)]) -> Vec<u64> {
    order.iter().map(|(n, _, _)| meta.info(n).map_or(0, |i| entry_hash(n, i))).collect()
}

/// A shard's tensors as (name, absolute start, absolute end), in the order records list them
/// (data offset, then end, then name). `header_len` is the JSON's length.
pub fn tensor_order(meta: &safetensors::tensor::Metadata, header_len: usize) -> Vec<(String, u64, u64)> {
    let base = 8 + header_len as u64;
    let mut v: Vec<(String, u64, u64)> = meta
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, base + t.data_offsets.0 as u64, base + t.data_offsets.1 as u64))
        .collect();
    v.sort_by(|a, b| (a.1, a.2, &a.0).cmp(&(b.1, b.2, &b.0)));
    v
}

/// True for the records of routed experts (the tensors a stream install leaves as holes).
pub fn is_routed_expert(name: &str) -> bool {
    name.contains(".block_sparse_moe.experts.")
}

/// Hashes a safetensors file's bytes fed in file order: the header, then each tensor's range.
#[derive(Default)]
pub struct TensorHasher {
    pos: u64,
    head: Vec<u8>,
    /// Header JSON length, once known.
    n: Option<u64>,
    ranges: Vec<(u64, u64)>,
    names: Vec<String>,
    entries: Vec<u64>,
    cur: usize,
    h: Option<Box<Xxh3>>,
    sums: Vec<Option<u64>>,
    header_xxh3: u64,
    error: Option<String>,
}

impl TensorHasher {
    pub fn new() -> Self {
        TensorHasher::default()
    }

    /// Feeds the next bytes of the file.
    pub fn update(&mut self, mut b: &[u8]) {
        while !b.is_empty() && self.error.is_none() {
            let want = match self.n {
                None => 8,
                Some(n) => 8 + n,
            };
            if self.pos < want {
                let take = ((want - self.pos) as usize).min(b.len());
                self.head.extend_from_slice(&b[..take]);
                self.pos += take as u64;
                b = &b[take..];
                if self.pos == 8 && self.n.is_none() {
                    let n = u64::from_le_bytes(self.head[..8].try_into().unwrap_or([0; 8]));
                    if n > 100 << 20 {
                        self.error = Some(format!("header length {n} is implausible"));
                        return;
                    }
                    self.n = Some(n);
                    if n == 0 {
                        self.start_data();
                    }
                } else if self.n.is_some_and(|n| self.pos == 8 + n) {
                    self.start_data();
                }
                continue;
            }
            let end = self.pos + b.len() as u64;
            self.hash_until(b, end);
            self.pos = end;
            b = &[];
        }
    }

    fn start_data(&mut self) {
        self.header_xxh3 = xxh3_64(&self.head);
        let n = self.n.unwrap_or(0) as usize;
        let meta: safetensors::tensor::Metadata = match serde_json::from_slice(&self.head[8..]) {
            Ok(m) => m,
            Err(e) => {
                self.error = Some(format!("malformed header: {e}"));
                return;
            }
        };
        let order = tensor_order(&meta, n);
        if order.windows(2).any(|w| w[1].1 < w[0].2) {
            self.error = Some("tensors overlap".into());
            return;
        }
        self.ranges = order.iter().map(|t| (t.1, t.2)).collect();
        self.entries = entry_hashes(&meta, &order);
        self.names = order.into_iter().map(|t| t.0).collect();
        self.head.truncate(0);
        self.head.shrink_to_fit();
        self.hash_until(&[], self.pos);
    }

    /// Hashes `b` (the bytes from `self.pos` to `end`) into the tensors it overlaps.
    fn hash_until(&mut self, b: &[u8], end: u64) {
        let pos = self.pos;
        while let Some(&(s, e)) = self.ranges.get(self.cur) {
            // A range past these bytes waits for more (an empty one at their end is done now).
            if s > end || (s == end && e > s && s > pos) {
                break;
            }
            let (a, z) = (s.max(pos), e.min(end));
            if z > a {
                let h = self.h.get_or_insert_with(|| Box::new(Xxh3::new()));
                h.update(&b[(a - pos) as usize..(z - pos) as usize]);
            }
            if e <= end {
                let h = self.h.take().unwrap_or_else(|| Box::new(Xxh3::new()));
                self.sums.push(Some(h.digest()));
                self.cur += 1;
            } else {
                break;
            }
        }
    }

    /// The digest, or what went wrong (a malformed header, bytes missing).
    pub fn finish(self) -> Result<ShardDigest, String> {
        if let Some(e) = self.error {
            return Err(e);
        }
        if self.n.is_none_or(|n| self.pos < 8 + n) || self.cur < self.ranges.len() {
            return Err(format!("ends at byte {} before its last tensor", self.pos));
        }
        Ok(ShardDigest { header_xxh3: self.header_xxh3, names: self.names, sums: self.sums, entries: self.entries })
    }
}

/// Hashes the file at `path` through a [`TensorHasher`], reading it in order; `progress` gets
/// the bytes read so far. Errors name nothing (the caller names the file).
pub fn hash_file(path: &Path, progress: &mut dyn FnMut(u64)) -> std::io::Result<ShardDigest> {
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let big = f.metadata()?.len() > 1 << 30;
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: advice on an open descriptor; no memory is involved.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_SEQUENTIAL) };
    }
    let mut h = TensorHasher::new();
    let mut buf = vec![0u8; CHUNK];
    let mut done = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        done += n as u64;
        progress(done);
        #[cfg(target_os = "linux")]
        if big {
            use std::os::fd::AsRawFd;
            // A pass over a large model must not push everything else out of the page cache.
            // SAFETY: advice on an open descriptor; no memory is involved.
            unsafe {
                libc::posix_fadvise(f.as_raw_fd(), (done - n as u64) as i64, n as i64, libc::POSIX_FADV_DONTNEED)
            };
        }
    }
    let _ = big;
    h.finish().map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// Bytes of a file that do not hash to their recorded checksum.
#[derive(Debug, thiserror::Error)]
#[error("{}: {what} does not match its recorded checksum (xxh3 {got:016x}, recorded {want:016x}, {how}): the file is damaged or was changed. {hint}", path.display())]
pub struct Mismatch {
    pub path: PathBuf,
    /// What the bytes are, e.g. "tensor `NAME`".
    pub what: String,
    pub got: u64,
    pub want: u64,
    /// Where the checksum came from (and whether the file changed since).
    pub how: String,
    /// What to do.
    pub hint: String,
}

/// What to do about a checksum mismatch in `dir`.
pub fn mismatch_hint(dir: &Path) -> String {
    format!(
        "{} (DIR = {}) lists every damaged tensor; restore the file ({} downloads a damaged shard again), or, if it was changed on purpose, {} records it as it is",
        crate::setting::Action::Verify,
        dir.display(),
        crate::setting::Action::Setup,
        crate::setting::Action::Rehash
    )
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
    fn any_chunking_gives_each_tensors_xxh3() {
        let a: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
        let b = vec![3u8; 1];
        let c: Vec<u8> = (0..70_000u32).map(|i| (i >> 3) as u8).collect();
        let file = shard(&[("a", a.clone()), ("b", b.clone()), ("c", c.clone()), ("e", Vec::new())]);
        let mut want: Option<ShardDigest> = None;
        for chunk in [1usize, 7, 4096, 100_000] {
            let mut h = TensorHasher::new();
            for piece in file.chunks(chunk) {
                h.update(piece);
            }
            let d = h.finish().unwrap();
            let by_name = |n: &str| d.sums[d.names.iter().position(|x| x == n).unwrap()].unwrap();
            assert_eq!(by_name("a"), xxh3_64(&a));
            assert_eq!(by_name("b"), xxh3_64(&b));
            assert_eq!(by_name("c"), xxh3_64(&c));
            assert_eq!(by_name("e"), xxh3_64(&[]));
            if let Some(w) = &want {
                assert_eq!(w.sums, d.sums);
                assert_eq!(w.header_xxh3, d.header_xxh3);
            }
            want = Some(d);
        }
        // A file cut short is an error, not a digest of what was there.
        let mut h = TensorHasher::new();
        h.update(&file[..file.len() - 10]);
        assert!(h.finish().is_err());
    }
}
