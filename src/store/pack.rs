//! Expert pack files `L{layer}.pack`: copies of one layer's experts on another drive, byte-identical
//! to the shard bytes, laid out for O_DIRECT reads. They live in a directory per model on each
//! drive (`DRIVE/<fingerprint prefix>/`, see placement), and each carries its model's fingerprint.
//!
//! Layout (little-endian):
//! ```text
//! 0   magic "DFPACK\0\x01"          8 bytes
//! 8   version u32 = 2, layer u32, count u32, reserved u32
//! 24  expert_len u64, header_len u64 (multiple of 4096), xxh3 of (fingerprint, index) u64, reserved 16 bytes
//! 64  model fingerprint: 32 bytes (sha256, model::fingerprint)
//! 96  index: count x { expert u32, reserved u32, offset u64, length u64, xxh3 u64 }
//! ... zero padding to header_len; then payload records at 4096-aligned offsets, each padded to 4096
//! ```
//! Contract: a pack file exists under its final name only when complete (written as
//! `L{layer}.pack.partial`, fsynced, renamed); `read_header` (the file) and `parse_header` (its
//! bytes) validate magic, version, sizes, the header checksum and that every record lies inside
//! the file. Version 1 packs (no fingerprint) are refused with a request to re-run `deltafin place`.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use xxhash_rust::xxh3::xxh3_64;

pub const MAGIC: &[u8; 8] = b"DFPACK\0\x01";
pub const ALIGN: u64 = 4096;
pub const VERSION: u32 = 2;
const FIXED: usize = 96;
const ENTRY: usize = 32;

#[derive(Debug, thiserror::Error)]
pub enum PackError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{}: not a valid expert pack: {msg}", path.display())]
    Invalid { path: PathBuf, msg: String },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackEntry {
    pub expert: u32,
    pub offset: u64,
    pub length: u64,
    pub xxh3: u64,
}

#[derive(Clone, Debug)]
pub struct PackHeader {
    /// The model's fingerprint (raw sha256).
    pub model: [u8; 32],
    pub layer: u32,
    pub expert_len: u64,
    pub header_len: u64,
    pub entries: Vec<PackEntry>,
}

pub fn pack_name(layer: usize) -> String {
    format!("L{layer}.pack")
}

pub fn align_up(x: u64) -> u64 {
    x.div_ceil(ALIGN) * ALIGN
}

fn header_len(count: usize) -> u64 {
    align_up((FIXED + count * ENTRY) as u64)
}

/// Checksum of an expert's bytes (the one every holder is verified against).
pub fn checksum(bytes: &[u8]) -> u64 {
    xxh3_64(bytes)
}

/// Writes `L{layer}.pack` in `dir` from `experts` (id, bytes), atomically. `on_bytes` is called
/// with the number of payload bytes written after each record.
pub fn write_pack<'a>(
    dir: &Path,
    model: &[u8; 32],
    layer: usize,
    expert_len: u64,
    experts: impl ExactSizeIterator<Item = (u32, std::borrow::Cow<'a, [u8]>)>,
    on_bytes: &mut dyn FnMut(u64),
) -> Result<PackHeader, PackError> {
    write_pack_named(dir, &pack_name(layer), model, layer, expert_len, experts, on_bytes)
}

/// [`write_pack`] under another file name (stream mode keeps several packs per layer).
pub fn write_pack_named<'a>(
    dir: &Path,
    name: &str,
    model: &[u8; 32],
    layer: usize,
    expert_len: u64,
    experts: impl ExactSizeIterator<Item = (u32, std::borrow::Cow<'a, [u8]>)>,
    on_bytes: &mut dyn FnMut(u64),
) -> Result<PackHeader, PackError> {
    let final_path = dir.join(name);
    let tmp = dir.join(format!("{name}.partial"));
    let io = |source| PackError::Io { path: tmp.clone(), source };
    let count = experts.len();
    let hlen = header_len(count);
    let mut f = File::create(&tmp).map_err(io)?;
    let mut entries = Vec::with_capacity(count);
    let mut off = hlen;
    let pad = vec![0u8; ALIGN as usize];
    let result = (|| -> Result<(), PackError> {
        f.write_all(&vec![0u8; hlen as usize]).map_err(io)?;
        for (expert, bytes) in experts {
            f.write_all(&bytes).map_err(io)?;
            let padded = align_up(bytes.len() as u64);
            f.write_all(&pad[..(padded - bytes.len() as u64) as usize]).map_err(io)?;
            entries.push(PackEntry { expert, offset: off, length: bytes.len() as u64, xxh3: checksum(&bytes) });
            off += padded;
            on_bytes(bytes.len() as u64);
        }
        let header = encode_header(model, layer as u32, expert_len, hlen, &entries);
        f.seek(SeekFrom::Start(0)).map_err(io)?;
        f.write_all(&header).map_err(io)?;
        crate::util::sync_file(&f).map_err(io)?;
        std::fs::rename(&tmp, &final_path).map_err(|source| PackError::Io { path: final_path.clone(), source })?;
        crate::util::sync_dir(dir);
        Ok(())
    })();
    if let Err(e) = result {
        drop(f);
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(PackHeader { model: *model, layer: layer as u32, expert_len, header_len: hlen, entries })
}

/// The header checksum: over the fingerprint and the index, so neither can change unnoticed.
pub fn header_sum(model: &[u8], idx: &[u8]) -> u64 {
    let mut b = Vec::with_capacity(model.len() + idx.len());
    b.extend_from_slice(model);
    b.extend_from_slice(idx);
    xxh3_64(&b)
}

fn encode_header(model: &[u8; 32], layer: u32, expert_len: u64, hlen: u64, entries: &[PackEntry]) -> Vec<u8> {
    let mut idx = Vec::with_capacity(entries.len() * ENTRY);
    for e in entries {
        idx.extend_from_slice(&e.expert.to_le_bytes());
        idx.extend_from_slice(&0u32.to_le_bytes());
        idx.extend_from_slice(&e.offset.to_le_bytes());
        idx.extend_from_slice(&e.length.to_le_bytes());
        idx.extend_from_slice(&e.xxh3.to_le_bytes());
    }
    let mut h = Vec::with_capacity(hlen as usize);
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(&VERSION.to_le_bytes());
    h.extend_from_slice(&layer.to_le_bytes());
    h.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h.extend_from_slice(&expert_len.to_le_bytes());
    h.extend_from_slice(&hlen.to_le_bytes());
    h.extend_from_slice(&header_sum(model, &idx).to_le_bytes());
    h.resize(64, 0);
    h.extend_from_slice(model);
    h.extend_from_slice(&idx);
    h.resize(hlen as usize, 0);
    h
}

/// Reads and validates a pack file's header and index.
pub fn read_header(path: &Path) -> Result<PackHeader, PackError> {
    let bad = |msg: String| PackError::Invalid { path: path.to_path_buf(), msg };
    let io = |source| PackError::Io { path: path.to_path_buf(), source };
    let mut f = File::open(path).map_err(io)?;
    let file_len = f.metadata().map_err(io)?.len();
    // Magic and version first: a version 1 pack is shorter than FIXED when empty.
    let mut head = vec![0u8; 12];
    f.read_exact(&mut head).map_err(|_| bad("shorter than its header".into()))?;
    check_magic_version(path, &head)?;
    head.resize(FIXED, 0);
    f.read_exact(&mut head[12..]).map_err(|_| bad("shorter than its header".into()))?;
    // The fixed part is checked (sizes against the file) before the index is allocated and read.
    let index_end = parse_fixed(path, &head, file_len)?.index_end;
    head.resize(index_end, 0);
    f.read_exact(&mut head[FIXED..]).map_err(|_| bad("truncated index".into()))?;
    parse_header(path, &head, file_len)
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or([0; 8]))
}

fn check_magic_version(path: &Path, head: &[u8]) -> Result<(), PackError> {
    let bad = |msg: String| PackError::Invalid { path: path.to_path_buf(), msg };
    let first = head.get(..12).ok_or_else(|| bad("shorter than its header".into()))?;
    if &first[..8] != MAGIC {
        return Err(bad("wrong magic".into()));
    }
    match u32_at(first, 8) {
        VERSION => Ok(()),
        1 => Err(bad(format!(
            "written by an older deltafin (pack version 1, without the model fingerprint); re-run {}",
            crate::setting::Action::Place
        ))),
        v => Err(bad(format!("unsupported version {v} (this deltafin reads version {VERSION})"))),
    }
}

/// The fixed part of a pack header.
struct Fixed {
    model: [u8; 32],
    layer: u32,
    count: usize,
    expert_len: u64,
    hlen: u64,
    idx_sum: u64,
    /// End of the index: FIXED + count x ENTRY.
    index_end: usize,
}

fn parse_fixed(path: &Path, head: &[u8], file_len: u64) -> Result<Fixed, PackError> {
    let bad = |msg: String| PackError::Invalid { path: path.to_path_buf(), msg };
    check_magic_version(path, head)?;
    let fixed = head.get(..FIXED).ok_or_else(|| bad("shorter than its header".into()))?;
    let count = u32_at(fixed, 16) as usize;
    let hlen = u64_at(fixed, 32);
    if hlen != header_len(count) || hlen > file_len {
        return Err(bad(format!("header length {hlen} does not fit {count} entries in a {file_len}-byte file")));
    }
    let mut model = [0u8; 32];
    model.copy_from_slice(&fixed[64..96]);
    Ok(Fixed {
        model,
        layer: u32_at(fixed, 12),
        count,
        expert_len: u64_at(fixed, 24),
        hlen,
        idx_sum: u64_at(fixed, 40),
        index_end: FIXED + count * ENTRY,
    })
}

/// Validates a pack header from the file's first bytes `head` (at least the fixed part and the
/// index; anything after is ignored) and the file's length. `path` is only used in errors.
pub fn parse_header(path: &Path, head: &[u8], file_len: u64) -> Result<PackHeader, PackError> {
    let bad = |msg: String| PackError::Invalid { path: path.to_path_buf(), msg };
    let Fixed { model, layer, count, expert_len, hlen, idx_sum, index_end } = parse_fixed(path, head, file_len)?;
    let idx = head.get(FIXED..index_end).ok_or_else(|| bad("truncated index".into()))?;
    if header_sum(&model, idx) != idx_sum {
        return Err(bad("header checksum mismatch".into()));
    }
    let mut entries = Vec::with_capacity(count);
    for e in idx.chunks_exact(ENTRY) {
        let ent = PackEntry { expert: u32_at(e, 0), offset: u64_at(e, 8), length: u64_at(e, 16), xxh3: u64_at(e, 24) };
        // checked_add: a crafted length must not wrap past the file's end.
        if !ent.offset.is_multiple_of(ALIGN)
            || ent.offset < hlen
            || ent.offset.checked_add(ent.length).is_none_or(|end| end > file_len)
            || ent.length != expert_len
        {
            return Err(bad(format!(
                "record of expert {} ({}+{}) is misplaced or truncated",
                ent.expert, ent.offset, ent.length
            )));
        }
        entries.push(ent);
    }
    Ok(PackHeader { model, layer, expert_len, header_len: hlen, entries })
}

/// Reads every record's bytes and checks them against the index's xxh3; returns the experts whose
/// data does not match (a flipped byte, a short file).
pub fn bad_records(path: &Path, h: &PackHeader) -> Result<Vec<u32>, PackError> {
    use std::os::unix::fs::FileExt;
    let f = File::open(path).map_err(|source| PackError::Io { path: path.to_path_buf(), source })?;
    let mut buf = vec![0u8; h.expert_len as usize];
    let mut bad = Vec::new();
    for e in &h.entries {
        match f.read_exact_at(&mut buf, e.offset) {
            Ok(()) if checksum(&buf) == e.xxh3 => {}
            _ => bad.push(e.expert),
        }
    }
    Ok(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_corruption() {
        let dir = tempfile::tempdir().unwrap();
        let a = vec![7u8; 5000];
        let b: Vec<u8> = (0..5000u32).map(|i| i as u8).collect();
        let fp = [5u8; 32];
        let h = write_pack(
            dir.path(),
            &fp,
            3,
            5000,
            [(4u32, a.as_slice().into()), (9u32, b.as_slice().into())].into_iter(),
            &mut |_| {},
        )
        .unwrap();
        let r = read_header(&dir.path().join("L3.pack")).unwrap();
        assert_eq!(r.entries, h.entries);
        assert_eq!(r.model, fp);
        assert!(bad_records(&dir.path().join("L3.pack"), &r).unwrap().is_empty());
        assert_eq!(r.entries[1].offset % ALIGN, 0);
        let bytes = std::fs::read(dir.path().join("L3.pack")).unwrap();
        let e = r.entries[1];
        assert_eq!(&bytes[e.offset as usize..(e.offset + e.length) as usize], b.as_slice());
        assert_eq!(checksum(&b), e.xxh3);
        // A flipped index byte is detected.
        let mut bad = bytes.clone();
        bad[FIXED + 9] ^= 1;
        std::fs::write(dir.path().join("bad.pack"), &bad).unwrap();
        assert!(read_header(&dir.path().join("bad.pack")).is_err());
        // So is a flipped fingerprint byte.
        let mut bad = bytes.clone();
        bad[70] ^= 1;
        std::fs::write(dir.path().join("bad.pack"), &bad).unwrap();
        assert!(read_header(&dir.path().join("bad.pack")).is_err());
        // A flipped data byte passes the header check but not the data check.
        let mut bad = bytes.clone();
        bad[e.offset as usize + 10] ^= 1;
        std::fs::write(dir.path().join("bad.pack"), &bad).unwrap();
        let hb = read_header(&dir.path().join("bad.pack")).unwrap();
        assert_eq!(bad_records(&dir.path().join("bad.pack"), &hb).unwrap(), vec![9]);
        // A version 1 pack asks for a re-run of place.
        let mut old = bytes.clone();
        old[8] = 1;
        std::fs::write(dir.path().join("old.pack"), &old).unwrap();
        let err = read_header(&dir.path().join("old.pack")).unwrap_err().to_string();
        assert!(err.contains("pack version 1") && err.contains("re-run"), "{err}");
        // A truncated file is detected.
        std::fs::write(dir.path().join("short.pack"), &bytes[..bytes.len() - 5000]).unwrap();
        assert!(read_header(&dir.path().join("short.pack")).is_err());
        assert!(!dir.path().join("L3.pack.partial").exists());
    }
}
