//! Safetensors checkpoint: `model.safetensors.index.json` + shards, or one `model.safetensors`,
//! memory-mapped read-only. Owns the mappings; hands out tensor byte slices and byte locations
//! (shard path, absolute file offset) so that expert readers can fetch the same bytes from disk.

use super::ModelError;
use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// One tensor's place in a shard.
#[derive(Clone, Debug)]
pub struct TensorEntry {
    pub shard: usize,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Absolute byte range in the shard file.
    pub start: u64,
    pub end: u64,
}

pub struct Shard {
    pub path: PathBuf,
    pub mmap: Arc<Mmap>,
}

/// An opened checkpoint directory.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub shards: Vec<Shard>,
    tensors: HashMap<String, TensorEntry>,
}

#[derive(serde::Deserialize)]
struct Index {
    weight_map: HashMap<String, String>,
}

impl Checkpoint {
    /// Opens `dir` from its index (or single file), maps every shard and reads every header.
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
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
        for (si, name) in shard_names.iter().enumerate() {
            let path = dir.join(name);
            let file = File::open(&path).map_err(|source| ModelError::Io { path: path.clone(), source })?;
            // SAFETY: the file is mapped read-only; the engine never writes checkpoint files and
            // treats a concurrent external modification as user error (as every mmap loader does).
            let mmap = unsafe { Mmap::map(&file) }.map_err(|source| ModelError::Io { path: path.clone(), source })?;
            let meta = parse_header(&path, &mmap)?;
            let (n, meta) = meta;
            let data_start = 8 + n as u64;
            for (tname, info) in meta.tensors() {
                let entry = TensorEntry {
                    shard: si,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: data_start + info.data_offsets.0 as u64,
                    end: data_start + info.data_offsets.1 as u64,
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
            shards.push(Shard { path, mmap: Arc::new(mmap) });
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
        Ok(Checkpoint { dir: dir.to_path_buf(), shards, tensors })
    }

    pub fn get(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.get(name)
    }

    /// The tensor's bytes (mapped, not copied).
    pub fn bytes(&self, e: &TensorEntry) -> &[u8] {
        &self.shards[e.shard].mmap[e.start as usize..e.end as usize]
    }

    /// The tensor's bytes as a shared handle that keeps the mapping alive.
    pub fn shared_bytes(&self, e: &TensorEntry) -> crate::backend::SharedBytes {
        let map: Arc<dyn AsRef<[u8]> + Send + Sync> = self.shards[e.shard].mmap.clone();
        crate::backend::SharedBytes::new(map, e.start as usize, (e.end - e.start) as usize)
    }

    /// Bytes of an absolute range in a shard.
    pub fn range(&self, shard: usize, start: u64, end: u64) -> &[u8] {
        &self.shards[shard].mmap[start as usize..end as usize]
    }

    pub fn shard_path(&self, shard: usize) -> &Path {
        &self.shards[shard].path
    }

    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }
}

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
