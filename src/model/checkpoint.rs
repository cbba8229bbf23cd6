//! Safetensors checkpoint: `model.safetensors.index.json` + shards, or one `model.safetensors`.
//! Owns the shards (open files, and read-only mappings for offline tools), every tensor's byte
//! location (shard path, absolute file offset) so that expert readers can fetch the same bytes
//! from disk, and every tensor's recorded checksum (`checksums`: the sidecar, loaded at open).
//!
//! Contract: [`Checkpoint::shared_bytes`] — how the engine loads its resident trunk — reads the
//! tensor into memory and checks it against its recorded checksum, so a damaged trunk byte is an
//! error naming the file and tensor, and a shard truncated later cannot fault the process (the
//! engine never reads the mappings while it serves). At open, a directory with shards no record
//! describes and at most [`SYNC_RECORD_BYTES`] of them is hashed and recorded at once; larger
//! ones are recorded by [`Checkpoint::record_in_background`] or `deltafin verify` (until then
//! their bytes are unverified, and [`Checkpoint::verification`] says so).

use super::ModelError;
use super::checksums::{self, FileId, ShardRecord, Source};
use super::sidecar;
use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

/// Unrecorded shards up to this size are hashed and recorded when the checkpoint opens.
pub const SYNC_RECORD_BYTES: u64 = 4 << 30;

/// One tensor's place in a shard.
#[derive(Clone, Debug)]
pub struct TensorEntry {
    pub shard: usize,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Absolute byte range in the shard file.
    pub start: u64,
    pub end: u64,
    /// Index of the tensor's checksum (shards in order, each's tensors in data-offset order).
    pub id: u32,
}

pub struct Shard {
    pub path: PathBuf,
    pub mmap: Arc<Mmap>,
    pub(crate) file: File,
    /// xxh3 of the header bytes (8-byte length + JSON).
    pub header_xxh3: u64,
    /// The file's identity at open.
    pub file_id: FileId,
    /// Ids of its tensors: `first_id..first_id + tensors`.
    pub first_id: u32,
    pub tensors: u32,
    /// Its tensors' header entries in id order (`checksums::entry_hash`).
    pub(crate) entries: Vec<u64>,
}

/// What is known of a shard's checksums.
#[derive(Clone, Debug, Default)]
pub struct ShardSums {
    /// The record its checksums come from (None: not recorded yet).
    pub record: Option<ShardRecord>,
    /// The file was modified or replaced since it was recorded.
    pub touched: bool,
    /// The record is the cache's copy for the same model in this other directory.
    pub origin: Option<String>,
    /// The shard's header is not the recorded one (some tensors may be unchecked).
    pub header_changed: bool,
}

/// An opened checkpoint directory.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub shards: Vec<Shard>,
    tensors: HashMap<String, TensorEntry>,
    /// Each tensor's recorded xxh3, by [`TensorEntry::id`] (set later by a recording pass).
    pub(crate) sums: Vec<OnceLock<u64>>,
    pub(crate) state: Mutex<Vec<ShardSums>>,
    /// A stream install: the routed experts' ranges are holes, their checksums come only from setup.
    pub(crate) stream: bool,
    /// A background pass is recording checksums (`record_in_background`).
    pub(crate) recording: std::sync::atomic::AtomicBool,
    /// Model files that differ from their records (kept by a non-strict open, for `verify`).
    pub(crate) file_problems: Mutex<Vec<checksums::FileProblem>>,
}

#[derive(serde::Deserialize)]
struct Index {
    weight_map: HashMap<String, String>,
}

impl Checkpoint {
    /// Opens `dir` from its index (or single file), maps every shard and reads every header, and
    /// records the checksums of unrecorded shards of at most [`SYNC_RECORD_BYTES`] in all.
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        Self::open_with(dir, SYNC_RECORD_BYTES)
    }

    /// [`Checkpoint::open`], recording unrecorded shards now only when they hold at most
    /// `sync_record` bytes (0: never; see [`Checkpoint::record_in_background`]).
    pub fn open_with(dir: &Path, sync_record: u64) -> Result<Self, ModelError> {
        Self::open_inner(dir, sync_record, true)
    }

    /// [`Checkpoint::open`] for `deltafin verify`: a model file that differs from its record is
    /// a finding ([`Checkpoint::file_problems`]), not an error, and nothing is recorded at open.
    pub fn open_for_verify(dir: &Path) -> Result<Self, ModelError> {
        Self::open_inner(dir, 0, false)
    }

    fn open_inner(dir: &Path, sync_record: u64, strict: bool) -> Result<Self, ModelError> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let (shard_names, weight_map): (Vec<String>, Option<HashMap<String, String>>) = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .map_err(|source| ModelError::Io { path: index_path.clone(), source })?;
            let (names, weight_map) = parse_index(&index_path, &text)?;
            (names, Some(weight_map))
        } else if single.exists() {
            (vec!["model.safetensors".to_string()], None)
        } else {
            return Err(ModelError::NoCheckpoint { dir: dir.to_path_buf() });
        };

        let mut shards = Vec::with_capacity(shard_names.len());
        let mut tensors = HashMap::new();
        let mut next_id = 0u32;
        for (si, name) in shard_names.iter().enumerate() {
            let path = dir.join(name);
            let file = File::open(&path).map_err(|source| ModelError::Io { path: path.clone(), source })?;
            let file_id =
                FileId::of_meta(&file.metadata().map_err(|source| ModelError::Io { path: path.clone(), source })?);
            // SAFETY: the file is mapped read-only and read only by offline tools (placing,
            // fingerprints, checks at open); the engine reads tensors with `pread` (see the
            // module contract), so a file truncated while it serves is an I/O error, not SIGBUS.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|source| ModelError::Io { path: path.clone(), source })?;
            let meta = parse_header(&path, &mmap)?;
            let (n, meta) = meta;
            let header_xxh3 = xxhash_rust::xxh3::xxh3_64(&mmap[..8 + n]);
            let order = checksums::tensor_order(&meta, n);
            let entries = checksums::entry_hashes(&meta, &order);
            let first_id = next_id;
            let rank: HashMap<&str, u32> =
                order.iter().enumerate().map(|(i, t)| (t.0.as_str(), first_id + i as u32)).collect();
            next_id += order.len() as u32;
            let data_start = 8 + n as u64;
            for (tname, info) in meta.tensors() {
                let entry = TensorEntry {
                    shard: si,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: data_start + info.data_offsets.0 as u64,
                    end: data_start + info.data_offsets.1 as u64,
                    id: rank.get(tname.as_str()).copied().unwrap_or(u32::MAX),
                };
                if let Some(prev) = tensors.insert(tname.clone(), entry) {
                    return Err(ModelError::Safetensors {
                        path: path.clone(),
                        msg: format!(
                            "tensor `{tname}` is also in {}: a tensor must be in exactly one shard",
                            dir.join(&shard_names[prev.shard]).display()
                        ),
                    });
                }
            }
            shards.push(Shard {
                path,
                mmap: Arc::new(mmap),
                file,
                header_xxh3,
                file_id,
                first_id,
                tensors: order.len() as u32,
                entries,
            });
        }
        // The index must agree with the shards' own headers.
        if let Some(wm) = weight_map {
            for (tname, file) in &wm {
                match tensors.get(tname) {
                    Some(e) if shard_names[e.shard] == *file => {}
                    Some(e) => {
                        return Err(ModelError::Config {
                            path: index_path,
                            field: format!("weight_map.{tname}"),
                            msg: format!("says {file} but the tensor is in {}", shard_names[e.shard]),
                        });
                    }
                    None => {
                        return Err(ModelError::Safetensors {
                            path: dir.join(file),
                            msg: format!(
                                "tensor `{tname}` is listed in model.safetensors.index.json but not in this shard"
                            ),
                        });
                    }
                }
            }
        }
        let ck = Checkpoint {
            dir: dir.to_path_buf(),
            sums: (0..next_id).map(|_| OnceLock::new()).collect(),
            state: Mutex::new(vec![ShardSums::default(); shards.len()]),
            stream: dir.join(STREAM_RECORD).exists(),
            recording: Default::default(),
            file_problems: Default::default(),
            shards,
            tensors,
        };
        ck.load_records(strict)?;
        let unrecorded: u64 = ck.unrecorded().iter().map(|&s| ck.shards[s].file_id.len).sum();
        if unrecorded > 0 && unrecorded <= sync_record {
            match ck.record_missing(&mut |_, _| {}) {
                Ok(_) => {}
                Err(e) => tracing::warn!("checksums not recorded: {e}; its bytes are unverified"),
            }
        }
        Ok(ck)
    }

    pub(crate) fn state_mut(&self) -> std::sync::MutexGuard<'_, Vec<ShardSums>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Shards without a record.
    pub fn unrecorded(&self) -> Vec<usize> {
        let st = self.state_mut();
        (0..self.shards.len()).filter(|&s| st[s].record.is_none()).collect()
    }

    /// What is known of each shard's checksums.
    pub fn shard_sums(&self) -> Vec<ShardSums> {
        self.state_mut().clone()
    }

    pub fn get(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.get(name)
    }

    /// The tensor's recorded checksum, if recorded.
    pub fn sum(&self, e: &TensorEntry) -> Option<u64> {
        self.sum_of(e.id)
    }

    /// The recorded checksum of tensor `id`.
    pub fn sum_of(&self, id: u32) -> Option<u64> {
        self.sums.get(id as usize).and_then(|c| c.get().copied())
    }

    /// The name of tensor `id` (for messages: a scan).
    pub fn name_of(&self, id: u32) -> &str {
        self.tensors.iter().find(|(_, e)| e.id == id).map_or("?", |(n, _)| n.as_str())
    }

    /// The tensor's bytes (mapped, not copied, not checked): for offline tools.
    pub fn bytes(&self, e: &TensorEntry) -> &[u8] {
        &self.shards[e.shard].mmap[e.start as usize..e.end as usize]
    }

    /// The tensor's bytes as a view of the mapping (not read, not checked): for offline tools.
    pub fn mapped_bytes(&self, e: &TensorEntry) -> crate::backend::SharedBytes {
        let map: Arc<dyn AsRef<[u8]> + Send + Sync> = self.shards[e.shard].mmap.clone();
        crate::backend::SharedBytes::new(map, e.start as usize, (e.end - e.start) as usize)
    }

    /// The tensor's bytes read into memory and checked against its recorded checksum.
    pub fn shared_bytes(&self, e: &TensorEntry) -> Result<crate::backend::SharedBytes, ModelError> {
        let mut buf = vec![0u8; (e.end - e.start) as usize];
        self.read_at(e.shard, e.start, &mut buf)?;
        self.check(e, &buf)?;
        Ok(crate::backend::SharedBytes::from_vec(buf))
    }

    /// Checks `bytes` (tensor `e`'s) against its recorded checksum; unrecorded passes.
    pub fn check(&self, e: &TensorEntry, bytes: &[u8]) -> Result<(), ModelError> {
        let Some(want) = self.sum(e) else { return Ok(()) };
        let got = xxhash_rust::xxh3::xxh3_64(bytes);
        if got == want {
            return Ok(());
        }
        Err(self.mismatch(e.shard, format!("tensor `{}`", self.name_of(e.id)), got, want))
    }

    /// The error for bytes of shard `shard` (`what`) that hash to `got`, not the recorded `want`.
    pub fn mismatch(&self, shard: usize, what: String, got: u64, want: u64) -> ModelError {
        ModelError::Checksum(Box::new(checksums::Mismatch {
            path: self.shards[shard].path.clone(),
            what,
            got,
            want,
            how: self.how_recorded(shard),
            hint: checksums::mismatch_hint(&self.dir),
        }))
    }

    /// Where shard `shard`'s checksums came from, and whether the file changed since.
    pub fn how_recorded(&self, shard: usize) -> String {
        let st = self.state_mut();
        let x = st.get(shard);
        let how = x.and_then(|x| x.record.as_ref()).map_or("recorded", |r| r.source.describe());
        let copy =
            x.and_then(|x| x.origin.as_ref()).map_or_else(String::new, |d| format!(" for the same model in {d}"));
        let changed = if x.is_some_and(|x| x.touched) { "; the file was modified or replaced since" } else { "" };
        format!("{how}{copy}{changed}")
    }

    /// The shard holding tensor `id`.
    pub fn shard_of(&self, id: u32) -> Option<usize> {
        self.shards.iter().position(|s| (s.first_id..s.first_id + s.tensors).contains(&id))
    }

    /// Reads `buf.len()` bytes of shard `shard` at `offset` (in parallel pieces when large).
    pub fn read_at(&self, shard: usize, offset: u64, buf: &mut [u8]) -> Result<(), ModelError> {
        use rayon::prelude::*;
        use std::os::unix::fs::FileExt;
        const PIECE: usize = 8 << 20;
        let sh = &self.shards[shard];
        let r = if buf.len() <= 2 * PIECE {
            sh.file.read_exact_at(buf, offset)
        } else {
            buf.par_chunks_mut(PIECE)
                .enumerate()
                .try_for_each(|(i, c)| sh.file.read_exact_at(c, offset + (i * PIECE) as u64))
        };
        match r {
            Ok(()) => {
                #[cfg(target_os = "linux")]
                if buf.len() >= 16 << 20 {
                    use std::os::fd::AsRawFd;
                    // The bytes now live in our buffer: the page cache need not keep a second copy.
                    // SAFETY: advice on an open descriptor; no memory is involved.
                    unsafe {
                        libc::posix_fadvise(
                            sh.file.as_raw_fd(),
                            offset as i64,
                            buf.len() as i64,
                            libc::POSIX_FADV_DONTNEED,
                        )
                    };
                }
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(ModelError::Truncated {
                path: sh.path.clone(),
                expected: offset + buf.len() as u64,
                actual: sh.file.metadata().map_or(0, |m| m.len()),
            }),
            Err(source) => Err(ModelError::Io { path: sh.path.clone(), source }),
        }
    }

    /// Hashes and records every shard without a record ("files": as found), saving the sidecar;
    /// `progress` gets (bytes done, bytes total). Returns the shards recorded.
    pub fn record_missing(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<usize, ModelError> {
        let todo = self.unrecorded();
        let total: u64 = todo.iter().map(|&s| self.shards[s].file_id.len).sum();
        let mut done = 0u64;
        let mut recs = Vec::new();
        for &s in &todo {
            let (rec, _) = self.hash_shard(s, &mut |n| progress(done + n, total))?;
            done += self.shards[s].file_id.len;
            self.adopt(s, &rec, false);
            recs.push(rec);
        }
        if !recs.is_empty() {
            sidecar::save(&self.dir, recs).map_err(|source| ModelError::Io { path: self.dir.clone(), source })?;
            tracing::warn!("{}", self.recorded_as_found(todo.len()));
        }
        Ok(todo.len())
    }

    /// Hashes shard `s` as it is now: its record ("files"; a stream install's expert holes not
    /// hashed) and the digest. Fails if the file is not the one opened (header changed).
    pub fn hash_shard(
        &self,
        s: usize,
        progress: &mut dyn FnMut(u64),
    ) -> Result<(ShardRecord, checksums::ShardDigest), ModelError> {
        let sh = &self.shards[s];
        let io = |source| ModelError::Io { path: sh.path.clone(), source };
        let mut d = checksums::hash_file(&sh.path, progress).map_err(io)?;
        if d.header_xxh3 != sh.header_xxh3 || d.sums.len() != sh.tensors as usize {
            return Err(ModelError::Safetensors {
                path: sh.path.clone(),
                msg: "its header changed while it was open".into(),
            });
        }
        if self.stream {
            for (x, n) in d.sums.iter_mut().zip(&d.names) {
                if checksums::is_routed_expert(n) {
                    *x = None;
                }
            }
        }
        let rec = ShardRecord::new(&sh.path, &d, Source::Files).map_err(io)?;
        Ok((rec, d))
    }

    /// Takes `rec` as shard `s`'s record: its checksums become the expectation (`replace`: even
    /// over ones recorded before, as `verify --rehash` does).
    pub(crate) fn adopt(&self, s: usize, rec: &ShardRecord, replace: bool) {
        let sh = &self.shards[s];
        if let Some(v) = rec.sums() {
            for (i, x) in v.into_iter().enumerate().take(sh.tensors as usize) {
                if let Some(x) = x {
                    let cell = &self.sums[sh.first_id as usize + i];
                    if cell.get() != Some(&x) && replace {
                        tracing::debug!("tensor {} of {} takes its new checksum", i, sh.path.display());
                    }
                    let _ = cell.set(x);
                }
            }
        }
        self.state_mut()[s] = ShardSums { record: Some(rec.clone()), ..Default::default() };
    }

    /// What recording `n` shards from the files as found means, for stderr.
    pub fn recorded_as_found(&self, n: usize) -> String {
        format!(
            "{}: checksums of {n} shard(s) recorded now from the files as found: damage already present cannot be found that way; {} checks them against the hub's sha256",
            self.dir.display(),
            crate::setting::Action::VerifyAgainstHub
        )
    }

    /// Bytes of an absolute range in a shard.
    pub fn range(&self, shard: usize, start: u64, end: u64) -> &[u8] {
        &self.shards[shard].mmap[start as usize..end as usize]
    }

    /// The ids of shard `s`'s tensors with their names, in data-offset order.
    pub fn shard_tensors(&self, s: usize) -> Vec<(u32, &str)> {
        let mut v: Vec<(u32, &str)> =
            self.tensors.iter().filter(|(_, e)| e.shard == s).map(|(n, e)| (e.id, n.as_str())).collect();
        v.sort_unstable();
        v
    }

    pub fn shard_path(&self, shard: usize) -> &Path {
        &self.shards[shard].path
    }

    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }
}

/// The record a stream install keeps (`hub::stream::RECORD`): its shards' expert ranges are holes.
const STREAM_RECORD: &str = "stream.json";

/// Parses `model.safetensors.index.json` text: the shard file names (sorted, distinct, each a plain
/// file name in the model directory) and the tensor -> shard map. `path` is only used in errors.
pub fn parse_index(path: &Path, text: &str) -> Result<(Vec<String>, HashMap<String, String>), ModelError> {
    let idx: Index =
        serde_json::from_str(text).map_err(|source| ModelError::Json { path: path.to_path_buf(), source })?;
    let mut names: Vec<String> = idx.weight_map.values().cloned().collect();
    names.sort();
    names.dedup();
    for n in &names {
        if n.is_empty() || n == "." || n == ".." || n.contains('/') || n.contains('\\') {
            return Err(ModelError::Config {
                path: path.to_path_buf(),
                field: "weight_map".into(),
                msg: format!("shard name {n:?} must be a plain file name in the model directory"),
            });
        }
    }
    Ok((names, idx.weight_map))
}

/// Parses and validates a shard's header from the whole file's bytes `buf`; the file must hold
/// exactly the data it describes. Returns the header length and the tensors' metadata.
pub fn parse_header(path: &Path, buf: &[u8]) -> Result<(usize, Metadata), ModelError> {
    let bad = |msg: String| ModelError::Safetensors { path: path.to_path_buf(), msg };
    if buf.len() < 8 {
        return Err(ModelError::Truncated { path: path.to_path_buf(), expected: 8, actual: buf.len() as u64 });
    }
    let n = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
    if n > 100 << 20 {
        return Err(bad(format!("header length {n} is implausible (over 100 MiB): not a safetensors file?")));
    }
    let n = n as usize;
    if buf.len() < 8 + n {
        return Err(ModelError::Truncated {
            path: path.to_path_buf(),
            expected: 8 + n as u64,
            actual: buf.len() as u64,
        });
    }
    let header = std::str::from_utf8(&buf[8..8 + n]).map_err(|e| bad(format!("header is not UTF-8: {e}")))?;
    let meta: Metadata = serde_json::from_str(header).map_err(|e| bad(format!("malformed header: {e}")))?;
    // Tensor offsets are validated in sequence but not against the file: their end may overflow.
    let expected = (8 + n as u64)
        .checked_add(meta.data_len() as u64)
        .ok_or_else(|| bad(format!("tensor data end {} overflows", meta.data_len())))?;
    if (buf.len() as u64) < expected {
        return Err(ModelError::Truncated { path: path.to_path_buf(), expected, actual: buf.len() as u64 });
    }
    if (buf.len() as u64) > expected {
        return Err(bad(format!("{} trailing bytes after the last tensor", buf.len() as u64 - expected)));
    }
    Ok((n, meta))
}
