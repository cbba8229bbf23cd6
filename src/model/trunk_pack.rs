//! The coded trunk on disk (`deltafin pack-trunk --encoding coded`): the trunk's bf16 matrices in
//! the lossless code of `backend::coded`, inside the model directory as `trunk-coded/`, one file
//! per layer (`L{n}.dftc`) and one for the rest (`top.dftc`), then `manifest.json`.
//!
//! File layout (little-endian):
//! ```text
//! 0   magic "DFTRUNK\x02"   8 bytes (format 2: 3-bit index planes, byte escapes)
//! 8   header_len u64, payload_len u64, xxh3 of bytes [32, end) u64
//! 32  JSON header: {"fingerprint", "group", "tensors": [{"name", "rows", "cols", "table": [8],
//!     "parts": [[offset, length] x 4]}]}   (parts: sm, idx, esc_start, esc; offsets from the payload)
//! ... zero padding to a multiple of 64, then the payload (every part 64-aligned)
//! ```
//! Contract: a file exists under its final name only when complete (written to a temporary beside
//! it, fsynced, renamed), and `manifest.json` (the model's fingerprint, the files and their sizes) is
//! written the same way after the last one: a trunk without a manifest is unfinished and is not
//! used. A re-run keeps every file that is whole and of this model (resumable). Reading checks the
//! magic, the checksum over header and payload, the fingerprint against the model's and every
//! matrix's parts (`CodedMat::check`), so a damaged or foreign file is an error naming it.

use crate::backend::SharedBytes;
use crate::backend::coded::{CodedMat, CodedParts};
use memmap2::Mmap;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use xxhash_rust::xxh3::xxh3_64;

/// The coded trunk's directory inside the model directory.
pub const DIR: &str = "trunk-coded";
pub const MANIFEST: &str = "manifest.json";
const MAGIC: &[u8; 8] = b"DFTRUNK\x02";
const FIXED: usize = 32;
const ALIGN: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum TrunkPackError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{}: {msg}", path.display())]
    Bad { path: PathBuf, msg: String },
    #[error("{} is the coded trunk of another model (fingerprint {found}, this model {want}); re-run `deltafin pack-trunk`", path.display())]
    Foreign { path: PathBuf, found: String, want: String },
}

#[derive(serde::Serialize, serde::Deserialize)]
struct TensorHeader {
    name: String,
    rows: usize,
    cols: usize,
    table: [u8; 8],
    parts: [(usize, usize); 4],
}

#[derive(serde::Serialize, serde::Deserialize)]
struct FileHeader {
    fingerprint: String,
    group: String,
    tensors: Vec<TensorHeader>,
}

/// What `manifest.json` records.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Manifest {
    pub format: String,
    pub fingerprint: String,
    pub files: Vec<String>,
    /// Values coded, their bf16 bytes, the coded bytes held in memory and the escapes.
    pub values: u64,
    pub bf16_bytes: u64,
    pub coded_bytes: u64,
    pub escapes: u64,
}

const FORMAT: &str = "deltafin-trunk-coded-v2";

/// The group (file stem) of a tensor: `L{n}` for `...layers.{n}....`, else `top`.
pub fn group_of(name: &str) -> String {
    name.split_once(".layers.")
        .and_then(|(_, rest)| rest.split('.').next())
        .and_then(|n| n.parse::<usize>().ok())
        .map_or_else(|| "top".to_string(), |n| format!("L{n}"))
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> TrunkPackError + '_ {
    move |source| TrunkPackError::Io { path: path.to_path_buf(), source }
}

fn bad(path: &Path, msg: impl Into<String>) -> TrunkPackError {
    TrunkPackError::Bad { path: path.to_path_buf(), msg: msg.into() }
}

/// Writes `parts` to `path` atomically (`util::write_atomic_parts`: a temporary beside it, fsynced,
/// renamed).
fn write_atomic(path: &Path, parts: &[&[u8]]) -> Result<(), TrunkPackError> {
    crate::util::write_atomic_parts(path, parts).map_err(io(path))
}

/// Codes `tensors` (name, bf16 bytes, rows, cols) of one group into `path`.
pub fn write_group(
    path: &Path,
    fingerprint: &str,
    group: &str,
    tensors: &[(String, &[u8], usize, usize)],
) -> Result<(), TrunkPackError> {
    let mut payload: Vec<u8> = Vec::new();
    let mut headers = Vec::with_capacity(tensors.len());
    for (name, bf16, rows, cols) in tensors {
        let p = CodedParts::encode(bf16, *rows, *cols);
        let mut parts = [(0usize, 0usize); 4];
        for (i, b) in [&p.sm, &p.idx, &p.esc_start, &p.esc].into_iter().enumerate() {
            payload.resize(payload.len().div_ceil(ALIGN) * ALIGN, 0);
            parts[i] = (payload.len(), b.len());
            payload.extend_from_slice(b);
        }
        headers.push(TensorHeader { name: name.clone(), rows: *rows, cols: *cols, table: p.table, parts });
    }
    let h = FileHeader { fingerprint: fingerprint.to_string(), group: group.to_string(), tensors: headers };
    let mut json = serde_json::to_vec(&h).map_err(|e| bad(path, e.to_string()))?;
    let start = (FIXED + json.len()).div_ceil(ALIGN) * ALIGN;
    let hlen = json.len();
    json.resize(start - FIXED, 0);
    let mut sum = xxhash_rust::xxh3::Xxh3::new();
    sum.update(&json);
    sum.update(&payload);
    let mut fixed = Vec::with_capacity(FIXED);
    fixed.extend_from_slice(MAGIC);
    fixed.extend((hlen as u64).to_le_bytes());
    fixed.extend((payload.len() as u64).to_le_bytes());
    fixed.extend(sum.digest().to_le_bytes());
    write_atomic(path, &[&fixed, &json, &payload])
}

/// One group file, mapped and checked: its tensors by name.
pub fn read_group(path: &Path, fingerprint: &str) -> Result<Vec<(String, Arc<CodedMat>)>, TrunkPackError> {
    let f = std::fs::File::open(path).map_err(io(path))?;
    // SAFETY: the file is mapped read-only; as with the shards, a concurrent external
    // modification is user error (and the checksum below is taken over the mapped bytes).
    let map = Arc::new(unsafe { Mmap::map(&f) }.map_err(io(path))?);
    if map.len() < FIXED || &map[..8] != MAGIC {
        return Err(bad(path, "not a coded trunk file of this format (bad magic): re-run `deltafin pack-trunk`"));
    }
    let u = |i: usize| u64::from_le_bytes(map[i..i + 8].try_into().unwrap_or([0; 8])) as usize;
    let (hlen, plen, sum) = (u(8), u(16), u(24) as u64);
    let start = (FIXED + hlen).div_ceil(ALIGN) * ALIGN;
    if start.checked_add(plen) != Some(map.len()) {
        return Err(bad(
            path,
            format!("truncated: header and payload promise {} bytes, the file has {}", start + plen, map.len()),
        ));
    }
    if xxh3_64(&map[FIXED..]) != sum {
        return Err(bad(path, "checksum mismatch: the file is damaged; re-run `deltafin pack-trunk`"));
    }
    let h: FileHeader =
        serde_json::from_slice(&map[FIXED..FIXED + hlen]).map_err(|e| bad(path, format!("header: {e}")))?;
    if h.fingerprint != fingerprint {
        return Err(TrunkPackError::Foreign {
            path: path.to_path_buf(),
            found: h.fingerprint,
            want: fingerprint.to_string(),
        });
    }
    let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = map;
    let mut out = Vec::with_capacity(h.tensors.len());
    for t in h.tensors {
        if t.parts.iter().any(|&(o, n)| o.checked_add(n).is_none_or(|e| e > plen)) {
            return Err(bad(path, format!("tensor `{}`: a part lies outside the payload", t.name)));
        }
        let part = |i: usize| SharedBytes::new(Arc::clone(&owner), start + t.parts[i].0, t.parts[i].1);
        let m = CodedMat {
            rows: t.rows,
            cols: t.cols,
            table: t.table,
            sm: part(0),
            idx: part(1),
            esc_start: part(2),
            esc: part(3),
        };
        m.check().map_err(|e| bad(path, format!("tensor `{}`: {e}", t.name)))?;
        out.push((t.name, Arc::new(m)));
    }
    Ok(out)
}

/// The manifest of the coded trunk in `model_dir`, if it is complete.
pub fn manifest(model_dir: &Path) -> Result<Option<Manifest>, TrunkPackError> {
    let path = model_dir.join(DIR).join(MANIFEST);
    match std::fs::read(&path) {
        Ok(b) => serde_json::from_slice(&b).map(Some).map_err(|e| bad(&path, format!("malformed manifest: {e}"))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io(&path)(e)),
    }
}

/// Every coded matrix of the model's coded trunk, checked to belong to the model of `fingerprint`.
pub fn open(model_dir: &Path, fingerprint: &str) -> Result<HashMap<String, Arc<CodedMat>>, TrunkPackError> {
    let dir = model_dir.join(DIR);
    let m = manifest(model_dir)?
        .ok_or_else(|| bad(&dir, "no coded trunk here (no manifest.json): run `deltafin pack-trunk` on the model"))?;
    if m.format != FORMAT {
        return Err(bad(
            &dir.join(MANIFEST),
            format!(
                "format `{}`, expected `{FORMAT}` (written by another deltafin): re-run `deltafin pack-trunk`",
                m.format
            ),
        ));
    }
    if m.fingerprint != fingerprint {
        return Err(TrunkPackError::Foreign {
            path: dir.join(MANIFEST),
            found: m.fingerprint,
            want: fingerprint.to_string(),
        });
    }
    let mut all = HashMap::new();
    for f in &m.files {
        all.extend(read_group(&dir.join(f), fingerprint)?);
    }
    Ok(all)
}

/// What one `pack-trunk` run did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PackReport {
    pub manifest: Manifest,
    pub files_written: usize,
    pub files_kept: usize,
}

/// Codes the tensors `names` of the checkpoint into `model_dir/trunk-coded/`, keeping group files
/// already whole (resumable); `progress` gets (groups done, groups).
pub fn write(
    ck: &super::Checkpoint,
    fingerprint: &str,
    names: &[String],
    progress: &mut dyn FnMut(usize, usize),
) -> Result<PackReport, TrunkPackError> {
    let dir = ck.dir.join(DIR);
    std::fs::create_dir_all(&dir).map_err(io(&dir))?;
    let mut groups: Vec<(String, Vec<&String>)> = Vec::new();
    for n in names {
        let g = group_of(n);
        match groups.iter_mut().find(|(k, _)| *k == g) {
            Some((_, v)) => v.push(n),
            None => groups.push((g, vec![n])),
        }
    }
    let (mut written, mut kept) = (0, 0);
    let (mut values, mut coded, mut escapes) = (0u64, 0u64, 0u64);
    let mut files = Vec::new();
    for (i, (g, members)) in groups.iter().enumerate() {
        let file = format!("{g}.dftc");
        let path = dir.join(&file);
        let whole = read_group(&path, fingerprint)
            .ok()
            .filter(|t| t.len() == members.len() && t.iter().zip(members).all(|((a, _), b)| a == *b));
        let mats = match whole {
            Some(t) => {
                kept += 1;
                t
            }
            None => {
                let mut tensors = Vec::with_capacity(members.len());
                for n in members {
                    let e = ck.get(n).ok_or_else(|| bad(&ck.dir, format!("no tensor `{n}`")))?;
                    let (rows, cols) = match e.shape.as_slice() {
                        [r, c] => (*r, *c),
                        s => return Err(bad(&ck.dir, format!("tensor `{n}` has shape {s:?}, expected a matrix"))),
                    };
                    tensors.push(((*n).clone(), ck.bytes(e), rows, cols));
                }
                write_group(&path, fingerprint, g, &tensors)?;
                written += 1;
                read_group(&path, fingerprint)?
            }
        };
        for (_, m) in &mats {
            values += (m.rows * m.cols) as u64;
            coded += m.byte_len() as u64;
            escapes += m.escape_count() as u64;
        }
        files.push(file);
        progress(i + 1, groups.len());
    }
    let manifest = Manifest {
        format: FORMAT.to_string(),
        fingerprint: fingerprint.to_string(),
        files,
        values,
        bf16_bytes: 2 * values,
        coded_bytes: coded,
        escapes,
    };
    let json = serde_json::to_vec_pretty(&manifest).map_err(|e| bad(&dir, e.to_string()))?;
    write_atomic(&dir.join(MANIFEST), &[&json])?;
    Ok(PackReport { manifest, files_written: written, files_kept: kept })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups() {
        assert_eq!(group_of("language_model.model.layers.12.self_attn.q_proj.weight"), "L12");
        assert_eq!(group_of("language_model.lm_head.weight"), "top");
        assert_eq!(group_of("language_model.model.embed_tokens.weight"), "top");
    }
}
