//! Model identity: the fingerprint that ties placements, pack files and route traces to one
//! checkpoint, so that one model's copies are never read as another's.
//!
//! Contract: [`fingerprint`] is a pure function of the checkpoint's tensor table and sampled bytes,
//! cheap enough for every `run` (it reads the shard headers, which are mapped already, and three
//! 4 KiB windows per shard): sha256 over
//! ```text
//! "deltafin-model-fingerprint-v1\n"
//! per tensor, sorted by name: name, dtype, shape, shard file name, start, end   (the shard headers)
//! per shard, in index order: file name, length, bytes [0, 4K), [len/2, +4K), [len-4K, len)
//! ```
//! Two checkpoints with the same shapes written by the same tool (same headers) are told apart by
//! the sampled bytes, which fall mostly inside routed experts (they are most of every shard). The
//! expert bytes themselves are covered by [`experts_digest`] over every expert's xxh3, which
//! `place` computes from the shards and records beside the fingerprint; `run` re-checks a sample
//! of those checksums against the shards, and `place --verify` all of them.

use super::Checkpoint;
use sha2::{Digest, Sha256};

const DOMAIN: &[u8] = b"deltafin-model-fingerprint-v1\n";
const WINDOW: usize = 4096;
/// Hex digits of the fingerprint used to name a model's directory on a drive.
pub const SHORT: usize = 16;

/// The model's fingerprint as 64 hex digits.
pub fn fingerprint(ck: &Checkpoint) -> String {
    let mut h = Sha256::new();
    h.update(DOMAIN);
    let mut names: Vec<&str> = ck.tensor_names().collect();
    names.sort_unstable();
    for name in names {
        let Some(t) = ck.get(name) else { continue };
        field(&mut h, name.as_bytes());
        field(&mut h, format!("{:?}", t.dtype).as_bytes());
        field(&mut h, t.shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(",").as_bytes());
        field(&mut h, shard_name(ck, t.shard).as_bytes());
        h.update(t.start.to_le_bytes());
        h.update(t.end.to_le_bytes());
    }
    for (s, shard) in ck.shards.iter().enumerate() {
        let b: &[u8] = &shard.mmap;
        field(&mut h, shard_name(ck, s).as_bytes());
        h.update((b.len() as u64).to_le_bytes());
        for at in [0, b.len() / 2, b.len().saturating_sub(WINDOW)] {
            field(&mut h, &b[at.min(b.len())..(at + WINDOW).min(b.len())]);
        }
    }
    hex(&h.finalize())
}

/// sha256 over every routed expert's xxh3, as (layer, expert, xxh3) in layer then expert order.
pub fn experts_digest(sums: impl IntoIterator<Item = (usize, u32, u64)>) -> String {
    let mut h = Sha256::new();
    h.update(b"deltafin-experts-v1\n");
    for (l, e, x) in sums {
        h.update((l as u64).to_le_bytes());
        h.update(e.to_le_bytes());
        h.update(x.to_le_bytes());
    }
    hex(&h.finalize())
}

/// The first [`SHORT`] hex digits (for directory names and messages).
pub fn short(fp: &str) -> &str {
    fp.get(..SHORT).unwrap_or(fp)
}

/// True for 64 lowercase hex digits.
pub fn is_valid(fp: &str) -> bool {
    fp.len() == 64 && fp.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The fingerprint's 32 raw bytes (zeros where `fp` is not valid hex).
pub fn raw(fp: &str) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = fp.get(2 * i..2 * i + 2).and_then(|x| u8::from_str_radix(x, 16).ok()).unwrap_or(0);
    }
    out
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn shard_name(ck: &Checkpoint, s: usize) -> String {
    ck.shard_path(s).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

/// Length-prefixed, so that field boundaries cannot shift between inputs.
fn field(h: &mut Sha256, b: &[u8]) {
    h.update((b.len() as u64).to_le_bytes());
    h.update(b);
}
