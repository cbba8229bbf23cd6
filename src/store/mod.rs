//! Expert store: the one way the forward pass obtains routed-expert bytes.
//!
//! Contract: [`ExpertSource::fetch`] delivers, for one layer, the raw shipped MXFP4 bytes of each
//! requested expert exactly once, in any order (arrival order), laid out as [`ExpertLayout`]
//! describes. Callers must not depend on the delivery order for their results.
//!
//! Implementations: [`expert_store::ExpertStore`] (holders on drives, O_DIRECT readers, balancer,
//! cache, failover — the engine's path) and [`ShardExperts`] (slices of the memory-mapped shards —
//! the in-memory reference the store is tested against). `pack` is the on-drive format of expert
//! copies, `placement` decides and writes where they go, `probe` measures drives.

pub mod cache;
pub mod counters;
pub mod expert_store;
pub mod pack;
pub mod placement;
pub mod pread;
pub mod probe;
pub mod reader;
#[cfg(target_os = "linux")]
pub mod uring;

pub use counters::SourceReport;

use crate::model::Checkpoint;
use crate::model::roster::{ExpertLayout, Roster};
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("expert {expert} of layer {layer} has no holder (layer has no routed experts or the id is out of range)")]
    NoHolder { layer: usize, expert: u32 },
    #[error("{0}")]
    NoHolderLeft(String),
    #[error("expert store setup: {0}")]
    Setup(String),
}

/// A source of raw expert bytes.
pub trait ExpertSource: Send + Sync {
    /// The byte layout shared by every expert.
    fn layout(&self) -> &ExpertLayout;

    /// Calls `land(expert, bytes)` once for each of `experts` (distinct ids) of `layer`.
    fn fetch(&self, layer: usize, experts: &[u32], land: &mut dyn FnMut(u32, &[u8])) -> Result<(), StoreError>;

    /// Bytes handed to the forward pass so far.
    fn bytes_requested(&self) -> u64;

    /// Starts reading experts a later layer will probably need (only into idle capacity).
    fn prefetch(&self, _layer: usize, _experts: &[u32]) {}

    /// Drops queued prefetches of `layer` that are not in `keep`.
    fn cancel_prefetch(&self, _layer: usize, _keep: &[u32]) {}

    /// Counters for `--stats`.
    fn report(&self) -> SourceReport {
        SourceReport { expert_bytes_requested: self.bytes_requested(), ..Default::default() }
    }
}

/// Experts sliced straight out of the mapped shards (the page cache does the reading).
pub struct ShardExperts<'a> {
    ck: &'a Checkpoint,
    layout: ExpertLayout,
    experts: Vec<Option<Vec<crate::model::roster::ExpertLoc>>>,
    requested: AtomicU64,
}

impl<'a> ShardExperts<'a> {
    /// Returns None when the model has no routed experts.
    pub fn new(ck: &'a Checkpoint, roster: &Roster) -> Option<Self> {
        Some(ShardExperts {
            ck,
            layout: roster.expert_layout.clone()?,
            experts: roster.experts.clone(),
            requested: AtomicU64::new(0),
        })
    }
}

impl ExpertSource for ShardExperts<'_> {
    fn layout(&self) -> &ExpertLayout {
        &self.layout
    }

    fn fetch(&self, layer: usize, experts: &[u32], land: &mut dyn FnMut(u32, &[u8])) -> Result<(), StoreError> {
        let locs = self.experts.get(layer).and_then(|l| l.as_ref());
        for &e in experts {
            let loc = locs.and_then(|l| l.get(e as usize)).ok_or(StoreError::NoHolder { layer, expert: e })?;
            let bytes = self.ck.range(loc.shard, loc.start, loc.start + self.layout.len as u64);
            self.requested.fetch_add(bytes.len() as u64, Ordering::Relaxed);
            land(e, bytes);
        }
        Ok(())
    }

    fn bytes_requested(&self) -> u64 {
        self.requested.load(Ordering::Relaxed)
    }
}
