//! Expert store: the one way the forward pass obtains routed-expert bytes.
//!
//! Contract: [`ExpertSource::fetch`] delivers, for one layer, the raw shipped MXFP4 bytes of each
//! requested expert exactly once, in any order (arrival order), laid out as [`ExpertLayout`]
//! describes, to an [`ExpertSink`] that may stop the fetch or fail it, and that releases each
//! expert's memory when it drops the [`Landed`] bytes. Callers must not depend on the delivery
//! order for their results. Counters are reported, not part of the delivery.
//!
//! Every expert's bytes are checked against what they must hash to (`sums`: a placement's
//! checksums, or the checkpoint's recorded ones) before a sink sees them, whichever source read
//! them; what is not recorded yet is delivered unverified and the startup line says so.
//!
//! Implementations: [`expert_store::ExpertStore`] (holders on drives, O_DIRECT readers, balancer,
//! cache, failover, healing — the engine's path) and [`ShardExperts`] (`--experts-from mmap`: the
//! shards through the page cache, read with `pread` so a file cut short is an error, not SIGBUS —
//! the reference the store is tested against). `pack` is the on-drive format of expert
//! copies, `placement` decides and writes where they go, `probe` measures drives, `heat` keeps route heat across runs, `replay` forecasts the cache's next requests from its fetch history.

pub mod cache;
pub mod counters;
pub mod expert_store;
pub mod heat;
pub mod io;
pub mod pack;
pub mod placement;
pub mod probe;
pub mod replay;
pub mod stream;
pub mod sums;

pub use counters::SourceReport;
pub use expert_store::StorageHealth;

use crate::model::Checkpoint;
use crate::model::roster::{ExpertLayout, Roster};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("expert {expert} of layer {layer} has no holder (layer has no routed experts or the id is out of range)")]
    NoHolder { layer: usize, expert: u32 },
    #[error("{0}")]
    NoHolderLeft(String),
    #[error("expert store setup: {0}")]
    Setup(String),
    /// The consumer of the bytes failed (e.g. a device copy); the fetch stopped.
    #[error("expert {expert} of layer {layer}: {msg}")]
    Sink { layer: usize, expert: u32, msg: String },
}

/// An expert's bytes handed to a sink. The memory they live in (a cache slot) stays reserved until
/// this is dropped, so a consumer may keep it while it copies the bytes elsewhere asynchronously.
pub struct Landed<'s> {
    bytes: std::borrow::Cow<'s, [u8]>,
    release: Option<Box<dyn FnOnce() + Send + 's>>,
}

impl<'s> Landed<'s> {
    /// Bytes that need no release (e.g. slices of mapped shards).
    pub fn borrowed(bytes: &'s [u8]) -> Self {
        Landed { bytes: bytes.into(), release: None }
    }

    /// Bytes owned by the value itself (e.g. an expert just fetched over the network).
    pub fn owned(bytes: Vec<u8>) -> Self {
        Landed { bytes: bytes.into(), release: None }
    }

    /// Bytes whose holder is released by `release` when they are dropped.
    pub fn with_release(bytes: &'s [u8], release: Box<dyn FnOnce() + Send + 's>) -> Self {
        Landed { bytes: bytes.into(), release: Some(release) }
    }

    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for Landed<'_> {
    fn drop(&mut self) {
        if let Some(r) = self.release.take() {
            r();
        }
    }
}

/// What a sink wants after an expert landed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    Continue,
    /// Deliver nothing more (reads already in flight complete and are released).
    Stop,
}

/// The consumer of a fetch: receives each expert once, in arrival order.
pub trait ExpertSink<'s> {
    fn land(&mut self, expert: u32, bytes: Landed<'s>) -> Result<Flow, StoreError>;
}

impl<'s, F: FnMut(u32, Landed<'s>) -> Result<Flow, StoreError>> ExpertSink<'s> for F {
    fn land(&mut self, expert: u32, bytes: Landed<'s>) -> Result<Flow, StoreError> {
        self(expert, bytes)
    }
}

/// A source of raw expert bytes.
pub trait ExpertSource: Send + Sync {
    /// The byte layout shared by every expert.
    fn layout(&self) -> &ExpertLayout;

    /// Hands each of `experts` (distinct ids) of `layer` to `sink` once, in arrival order, until
    /// the sink stops or fails. A failed fetch delivers no bytes of a failed read.
    fn fetch<'s>(&'s self, layer: usize, experts: &[u32], sink: &mut dyn ExpertSink<'s>) -> Result<(), StoreError>;

    /// `fetch`, and once every read of `experts` has started, reads of `then`'s experts (a later
    /// layer's, which a large batch will surely need) into the cache, so the drives keep reading
    /// while that batch computes attention. The default ignores `then`.
    fn fetch_then<'s>(
        &'s self,
        layer: usize,
        experts: &[u32],
        _then: Option<(usize, &[u32])>,
        sink: &mut dyn ExpertSink<'s>,
    ) -> Result<(), StoreError> {
        self.fetch(layer, experts, sink)
    }

    /// Starts reading experts a later layer will probably need (only into idle capacity).
    fn prefetch(&self, _layer: usize, _experts: &[u32]) {}

    /// Drops queued prefetches of `layer` that are not in `keep`.
    fn cancel_prefetch(&self, _layer: usize, _keep: &[u32]) {}

    /// The routes of a batch of `rows` rows at `layer` before its union is fetched: each expert of
    /// the union and how many rows it serves. A cache may weigh what to keep by them.
    fn note_routes(&self, _layer: usize, _experts: &[u32], _rows_of: &[usize], _rows: usize) {}

    /// Counters for `--stats` (what this source can measure; unknown ones are None).
    fn report(&self) -> SourceReport {
        SourceReport::default()
    }

    /// `report`'s read counters alone (bytes requested and read, cache hits and misses; no drive
    /// figures): what the step core takes around every forward, so it should cost nothing.
    fn read_counters(&self) -> SourceReport {
        self.report()
    }

    /// Whether reads are failing now (a drive given up, holders suspect): `/health`'s storage.
    fn health(&self) -> StorageHealth {
        StorageHealth::default()
    }

    /// One line for the startup summary.
    fn describe(&self) -> String;
}

/// The storage health of an engine's expert source (healthy without one).
pub fn health(source: Option<&dyn ExpertSource>) -> StorageHealth {
    source.map(|s| s.health()).unwrap_or_default()
}

/// Experts read from the shards through the page cache (`--experts-from mmap`), each checked
/// against the checkpoint's recorded checksums as it is read.
pub struct ShardExperts {
    ck: Arc<Checkpoint>,
    layout: ExpertLayout,
    experts: Vec<Option<Vec<crate::model::roster::ExpertLoc>>>,
    sums: Option<sums::ExpertSums>,
    requested: AtomicU64,
    /// The last failed read and when (reported by `health` until a fetch succeeds).
    failure: std::sync::Mutex<Option<(String, std::time::Instant)>>,
}

impl ShardExperts {
    /// Returns None when the model has no routed experts.
    pub fn new(ck: Arc<Checkpoint>, roster: &Roster) -> Option<Self> {
        Some(ShardExperts {
            sums: sums::ExpertSums::records(&ck, roster),
            ck,
            layout: roster.expert_layout.clone()?,
            experts: roster.experts.clone(),
            requested: AtomicU64::new(0),
            failure: std::sync::Mutex::new(None),
        })
    }

    /// Expert `e` of `layer` read and checked.
    fn read(&self, layer: usize, e: u32) -> Result<Vec<u8>, StoreError> {
        let loc = self
            .experts
            .get(layer)
            .and_then(|l| l.as_ref())
            .and_then(|l| l.get(e as usize))
            .ok_or(StoreError::NoHolder { layer, expert: e })?;
        let mut buf = vec![0u8; self.layout.len];
        let fail = |msg: String| StoreError::NoHolderLeft(format!("expert {e} of layer {layer}: {msg}"));
        for x in &loc.extents {
            let dst = &mut buf[x.dest as usize..(x.dest + x.len) as usize];
            self.ck.read_at(x.shard, x.start, dst).map_err(|err| fail(err.to_string()))?;
        }
        match self.sums.as_ref().map(|s| s.check(layer, e, &buf)) {
            Some(sums::Verdict::Bad(what)) => {
                let shard = loc.extents[0].shard;
                let path = self.ck.shard_path(shard).display();
                let why = self.sums.as_ref().map(|s| s.explain(layer, e)).unwrap_or_default();
                Err(fail(format!("{path}: {what} ({why})")))
            }
            _ => Ok(buf),
        }
    }
}

impl ExpertSource for ShardExperts {
    fn layout(&self) -> &ExpertLayout {
        &self.layout
    }

    fn fetch<'s>(&'s self, layer: usize, experts: &[u32], sink: &mut dyn ExpertSink<'s>) -> Result<(), StoreError> {
        use rayon::prelude::*;
        // Read and checked in parallel, a bounded batch at a time (a prompt's union of a large
        // model's experts would not fit in memory at once), landed in order.
        let batch = rayon::current_num_threads().max(1);
        for ids in experts.chunks(batch) {
            let got: Vec<Result<Vec<u8>, StoreError>> = ids.par_iter().map(|&e| self.read(layer, e)).collect();
            for (&e, r) in ids.iter().zip(got) {
                let bytes = r.inspect_err(|err| {
                    if let Ok(mut f) = self.failure.lock() {
                        *f = Some((err.to_string(), std::time::Instant::now()));
                    }
                })?;
                self.requested.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                if sink.land(e, Landed::owned(bytes))? == Flow::Stop {
                    return Ok(());
                }
            }
        }
        if let Ok(mut f) = self.failure.lock() {
            *f = None;
        }
        Ok(())
    }

    fn report(&self) -> SourceReport {
        SourceReport { expert_bytes_requested: self.requested.load(Ordering::Relaxed), ..Default::default() }
    }

    fn health(&self) -> StorageHealth {
        match self.failure.lock().ok().and_then(|f| f.clone()) {
            Some((msg, at)) => StorageHealth {
                degraded: true,
                problems: vec![format!("{msg} ({:.1} s ago)", at.elapsed().as_secs_f64())],
                ..Default::default()
            },
            None => StorageHealth::default(),
        }
    }

    fn describe(&self) -> String {
        let sums = self.sums.as_ref().map_or_else(|| "UNVERIFIED".to_string(), sums::ExpertSums::describe);
        format!("experts via the page cache (pread) | {sums}")
    }
}
