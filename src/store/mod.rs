//! Expert store: the one way the forward pass obtains routed-expert bytes.
//!
//! Contract: [`ExpertSource::fetch`] delivers, for one layer, the raw shipped MXFP4 bytes of each
//! requested expert exactly once, in any order (arrival order), laid out as [`ExpertLayout`]
//! describes, to an [`ExpertSink`] that may stop the fetch or fail it, and that releases each
//! expert's memory when it drops the [`Landed`] bytes. Callers must not depend on the delivery
//! order for their results. Counters are reported, not part of the delivery.
//!
//! Implementations: [`expert_store::ExpertStore`] (holders on drives, O_DIRECT readers, balancer,
//! cache, failover — the engine's path) and [`ShardExperts`] (slices of the memory-mapped shards —
//! the in-memory reference the store is tested against). `pack` is the on-drive format of expert
//! copies, `placement` decides and writes where they go, `probe` measures drives, `heat` keeps route heat across runs, `replay` forecasts the cache's next requests from its fetch history.

pub mod cache;
pub mod counters;
pub mod drive_io;
pub mod expert_store;
pub mod heat;
pub mod pack;
pub mod placement;
pub mod pread;
pub mod probe;
pub mod reader;
pub mod replay;
#[cfg(target_os = "linux")]
pub mod uring;

pub use counters::SourceReport;

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

    /// One line for the startup summary.
    fn describe(&self) -> String;
}

/// Experts sliced straight out of the mapped shards (the page cache does the reading).
pub struct ShardExperts {
    ck: Arc<Checkpoint>,
    layout: ExpertLayout,
    experts: Vec<Option<Vec<crate::model::roster::ExpertLoc>>>,
    requested: AtomicU64,
}

impl ShardExperts {
    /// Returns None when the model has no routed experts.
    pub fn new(ck: Arc<Checkpoint>, roster: &Roster) -> Option<Self> {
        Some(ShardExperts {
            ck,
            layout: roster.expert_layout.clone()?,
            experts: roster.experts.clone(),
            requested: AtomicU64::new(0),
        })
    }
}

impl ExpertSource for ShardExperts {
    fn layout(&self) -> &ExpertLayout {
        &self.layout
    }

    fn fetch<'s>(&'s self, layer: usize, experts: &[u32], sink: &mut dyn ExpertSink<'s>) -> Result<(), StoreError> {
        let locs = self.experts.get(layer).and_then(|l| l.as_ref());
        for &e in experts {
            let loc = locs.and_then(|l| l.get(e as usize)).ok_or(StoreError::NoHolder { layer, expert: e })?;
            let bytes = loc.bytes(&self.ck);
            self.requested.fetch_add(bytes.len() as u64, Ordering::Relaxed);
            if sink.land(e, Landed { bytes, release: None })? == Flow::Stop {
                break;
            }
        }
        Ok(())
    }

    fn report(&self) -> SourceReport {
        SourceReport { expert_bytes_requested: self.requested.load(Ordering::Relaxed), ..Default::default() }
    }

    fn describe(&self) -> String {
        "experts via mmap".into()
    }
}
