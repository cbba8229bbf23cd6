//! What an expert store is opened from: [`StoreSpec`] (the layout, the drives, the files and
//! every expert's holders and checksums) and [`StoreOptions`] (cache, reader, prefetch, hedged
//! and split reads).
//!
//! Contract: plain data; `placement` builds a spec from a manifest or the shards, and
//! [`super::ExpertStore::open`] checks it. Nothing here reads a file.

use crate::model::roster::ExpertLayout;
use crate::store::io::reader::ReaderKind;
use std::path::PathBuf;
use std::sync::Arc;

/// One place an expert's bytes can be read.
#[derive(Clone, Debug)]
pub struct Holder {
    pub drive: u16,
    pub file: u32,
    /// Offset of the expert's first byte in the file.
    pub offset: u64,
    /// 0 = primary; 1 = fallback, used only when no primary holder is usable.
    pub tier: u8,
    /// When the expert is not one range of `file`: its pieces (files of the same drive), which
    /// are read separately and assembled into the expert's image.
    pub extents: Option<Arc<[HolderExtent]>>,
}

/// One piece of an expert held in several ranges.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HolderExtent {
    pub file: u32,
    pub offset: u64,
    pub len: u64,
    /// Offset of the piece in the expert's image.
    pub dest: u64,
}

impl Holder {
    /// A holder of the whole expert in one range.
    pub fn whole(drive: u16, file: u32, offset: u64, tier: u8) -> Self {
        Holder { drive, file, offset, tier, extents: None }
    }

    /// Number of reads this holder takes.
    pub fn pieces(&self) -> usize {
        self.extents.as_ref().map_or(1, |x| x.len())
    }
}

#[derive(Clone, Debug)]
pub struct DriveSpec {
    pub root: PathBuf,
    /// Expected read rate in GB/s (measured by `place`, or a default).
    pub gbps: f64,
    pub qd: usize,
}

/// Everything the store needs to know about where experts are.
pub struct StoreSpec {
    pub layout: ExpertLayout,
    pub drives: Vec<DriveSpec>,
    /// (drive, path) of every file holding experts.
    pub files: Vec<(u16, PathBuf)>,
    /// [layer] -> [expert] -> holders (None for layers without routed experts).
    pub holders: Vec<Option<Vec<Vec<Holder>>>>,
    /// What each expert's bytes must hash to, when known (checked as every read lands).
    pub checksums: Option<crate::store::sums::ExpertSums>,
}

#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// Bytes of expert cache kept across layers and tokens (0 = keep nothing).
    pub cache_bytes: u64,
    pub reader: ReaderKind,
    /// Maximum prefetch reads in flight per drive (0 disables prefetch).
    pub prefetch_depth: usize,
    /// Keep a log of every read issued (file, offset, length), for replaying with fio.
    pub record_reads: bool,
    /// Route heat kept across runs ([`super::heat`]): seeds the cache's request counts at open and
    /// is rewritten with this run folded in when the store closes. None: no heat.
    pub heat: Option<PathBuf>,
    /// Hedged reads: a demanded read late on its drive is issued again on another copy's drive
    /// (see `hedge`).
    pub hedge: bool,
    /// Split reads: a demanded expert held on several drives is read as byte ranges of at least
    /// this many bytes across them (see `split`); None reads every expert whole from one drive.
    pub split_min: Option<u64>,
    /// Read slots beyond [`staging_slots`] for a batch's reads ahead of its next MoE layer (a
    /// decode step of several sequences: `forward::moe::read_ahead_depth`), so they need not evict
    /// cached experts; 0: none.
    pub read_ahead_slots: usize,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            cache_bytes: 0,
            reader: ReaderKind::Auto,
            prefetch_depth: 1,
            record_reads: false,
            heat: None,
            hedge: true,
            split_min: Some(super::split::SPLIT_MIN),
            read_ahead_slots: 0,
        }
    }
}

impl StoreSpec {
    /// The most pieces any holder of any expert has.
    pub fn max_pieces(&self) -> usize {
        self.holders.iter().flatten().flatten().flatten().map(Holder::pieces).max().unwrap_or(1)
    }
}
