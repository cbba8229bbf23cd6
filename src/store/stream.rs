//! The expert source of a stream install (`setup --stream`): experts already streamed are read from
//! local pack files through the expert store, the others are streamed in from their origin (the
//! hub, by HTTP range: `hub::stream::HubOrigin`) and kept locally the first time they are needed.
//!
//! Contract:
//! - Streamed experts live in pack files (`store::pack` format) that the origin writes and
//!   registers ([`StreamOrigin::keep`]): a pack is complete before it is registered, so a killed run
//!   leaves at most an unregistered pack, never a registered partial one.
//! - Each streamed expert's bytes must hash to the checkpoint's recorded xxh3 (`store::sums`) before
//!   they are kept or handed on: a mismatch is asked once more, then is an error. Within the run
//!   that streamed it, an expert is read back from its pack and checked against the pack's record
//!   ([`StreamSource`]'s `read_kept`); a local pack that fails is a failed copy: the expert is
//!   streamed again.
//! - One stream-in at a time per process: a fetch of experts another thread is streaming waits for
//!   them instead of fetching them again.

use super::counters::{DriveReport, SourceReport};
use super::expert_store::ExpertStore;
use super::sums::{ExpertSums, Verdict};
use super::{ExpertSink, ExpertSource, Flow, Landed, StoreError, pack};
use crate::model::roster::ExpertLayout;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// [layer] -> [expert] -> held locally (None for layers without routed experts).
pub type Held = Vec<Option<Vec<bool>>>;

/// An origin's error, shown as it is (the hub's `HubError`).
pub type OriginError = Box<dyn std::error::Error + Send + Sync>;

/// Where a streamed expert was kept: its pack and its record there.
#[derive(Clone, Debug)]
pub struct Kept {
    pub expert: u32,
    pub path: PathBuf,
    pub offset: u64,
    pub xxh3: u64,
}

/// Where a stream install's missing experts come from and where they are kept once streamed: the
/// hub's side of stream mode (HTTP ranges, the install's packs and registry).
pub trait StreamOrigin: Send + Sync {
    /// The endpoint the experts come from, for messages.
    fn endpoint(&self) -> &str;
    /// The origin for the startup line (`endpoint/repo`).
    fn describe(&self) -> String;
    /// The origin as a drive of the source's report (`endpoint/repo@commit`).
    fn report_root(&self) -> String;
    /// The bytes of `missing` experts of `layer`, in that order, one expert long each.
    fn fetch(&self, layer: usize, missing: &[u32]) -> Result<Vec<Vec<u8>>, OriginError>;
    /// Writes `ids`' bytes into a new pack and registers it; where each one now is.
    fn keep(&self, layer: usize, ids: &[u32], images: &[Vec<u8>]) -> Result<Vec<Kept>, OriginError>;
    /// Bytes fetched and requests made by this process.
    fn counts(&self) -> (u64, u64);
}

/// The expert source of a stream install; see the module contract.
pub struct StreamSource {
    origin: Box<dyn StreamOrigin>,
    layout: ExpertLayout,
    /// Routed experts of the model (all layers).
    experts: usize,
    local: Arc<ExpertStore>,
    held: Held,
    /// What each expert's bytes must hash to (the checkpoint's records from setup).
    sums: Option<ExpertSums>,
    /// Experts streamed by this process; the lock also serialises streaming, so one expert is never
    /// fetched twice by concurrent fetches.
    kept: Mutex<HashMap<(usize, u32), Kept>>,
    streamed: AtomicU64,
    reread: AtomicU64,
}

impl StreamSource {
    /// The source over `local` (the store of the packs registered at open, `held` their experts)
    /// streaming the rest from `origin`; `experts` routed experts in all, `sums` what their bytes
    /// must hash to.
    pub fn new(
        origin: Box<dyn StreamOrigin>,
        layout: ExpertLayout,
        experts: usize,
        local: Arc<ExpertStore>,
        held: Held,
        sums: Option<ExpertSums>,
    ) -> Self {
        StreamSource {
            origin,
            layout,
            experts,
            local,
            held,
            sums,
            kept: Mutex::new(HashMap::new()),
            streamed: AtomicU64::new(0),
            reread: AtomicU64::new(0),
        }
    }

    fn is_held(&self, layer: usize, e: u32) -> bool {
        self.held.get(layer).and_then(|l| l.as_ref()).and_then(|l| l.get(e as usize)).copied().unwrap_or(false)
    }

    /// Experts registered locally (at open, plus streamed since).
    pub fn local_count(&self) -> usize {
        let at_open: usize = self.held.iter().flatten().map(|l| l.iter().filter(|h| **h).count()).sum();
        at_open + self.kept.lock().map_or(0, |k| k.len())
    }

    /// Bytes fetched over HTTP and range requests made by this process.
    pub fn http_counts(&self) -> (u64, u64) {
        self.origin.counts()
    }

    /// Fetches `missing` experts of `layer` from the origin, checks each against its recorded
    /// checksums (asking once more for one that does not match), has the origin keep them;
    /// returns their bytes.
    fn stream_in(&self, layer: usize, missing: &[u32]) -> Result<Vec<(u32, Vec<u8>)>, OriginError> {
        let mut images = self.origin.fetch(layer, missing)?;
        let check = |e: u32, b: &[u8]| self.sums.as_ref().map_or(Verdict::Unknown, |s| s.check(layer, e, b));
        for (i, &e) in missing.iter().enumerate() {
            if let Verdict::Bad(what) = check(e, &images[i]) {
                tracing::warn!("expert {e} of layer {layer} from {}: {what}; asking again", self.origin.endpoint());
                let again = self.origin.fetch(layer, &[e])?.pop().unwrap_or_default();
                if let Verdict::Bad(what) = check(e, &again) {
                    return Err(format!(
                        "expert {e} of layer {layer} as {} sends it is not the model's: {what} (the checksum recorded from the shard whose sha256 matched the hub's at setup); twice, so it is not used",
                        self.origin.endpoint()
                    )
                    .into());
                }
                images[i] = again;
            }
        }
        let kept = self.origin.keep(layer, missing, &images)?;
        if let Ok(mut k) = self.kept.lock() {
            for x in kept {
                k.insert((layer, x.expert), x);
            }
        }
        self.streamed.fetch_add(missing.len() as u64, Ordering::Relaxed);
        Ok(missing.iter().copied().zip(images).collect())
    }

    /// An expert this process streamed before, read back from its pack and checked.
    fn read_kept(&self, layer: usize, e: u32, k: &Kept) -> Result<Vec<u8>, StoreError> {
        use std::os::unix::fs::FileExt;
        let mut buf = vec![0u8; self.layout.len];
        let r = std::fs::File::open(&k.path).and_then(|f| f.read_exact_at(&mut buf, k.offset));
        match r {
            Ok(()) if pack::checksum(&buf) == k.xxh3 => {
                self.reread.fetch_add(1, Ordering::Relaxed);
                Ok(buf)
            }
            Ok(()) => Err(StoreError::NoHolderLeft(format!(
                "expert {e} of layer {layer}: {} does not hold the bytes just written (checksum mismatch)",
                k.path.display()
            ))),
            Err(err) => {
                Err(StoreError::NoHolderLeft(format!("expert {e} of layer {layer}: {}: {err}", k.path.display())))
            }
        }
    }

    /// Hands `local` experts (held at open) to `sink` through the store; those whose local copy
    /// fails are added to `rest`, to be streamed again. Returns whether the sink stopped.
    fn fetch_local<'s>(
        &'s self,
        layer: usize,
        local: &[u32],
        rest: &mut Vec<u32>,
        sink: &mut dyn ExpertSink<'s>,
    ) -> Result<bool, StoreError> {
        let stopped = std::cell::Cell::new(false);
        let sink_failed = std::cell::Cell::new(false);
        let landed = std::cell::RefCell::new(Vec::new());
        let mut wrap = |e: u32, b: Landed<'s>| -> Result<Flow, StoreError> {
            let f = sink.land(e, b).inspect_err(|_| sink_failed.set(true))?;
            landed.borrow_mut().push(e);
            stopped.set(stopped.get() || f == Flow::Stop);
            Ok(f)
        };
        if let Err(e) = self.local.fetch(layer, local, &mut wrap) {
            if sink_failed.get() {
                return Err(e);
            }
            // A local copy failed (a damaged pack): the hub holds another. Each expert not
            // landed is read alone, and streamed again where its local copy fails.
            tracing::warn!("{e}; such experts are streamed again from {}", self.origin.endpoint());
            let left: Vec<u32> = local.iter().copied().filter(|x| !landed.borrow().contains(x)).collect();
            for x in left {
                if stopped.get() {
                    break;
                }
                if let Err(e) = self.local.fetch(layer, &[x], &mut wrap) {
                    if sink_failed.get() {
                        return Err(e);
                    }
                    rest.push(x);
                }
            }
        }
        Ok(stopped.get())
    }

    /// The bytes of `rest` (not held at open): read back where this process kept them, else
    /// streamed in. Held while streaming: a concurrent fetch of the same experts waits, then
    /// re-reads them.
    fn fetch_streamed(&self, layer: usize, rest: &[u32]) -> Result<Vec<(u32, Vec<u8>)>, StoreError> {
        let mut ready: Vec<(u32, Vec<u8>)> = Vec::with_capacity(rest.len());
        let _one = STREAMING.lock();
        let kept: Vec<Option<Kept>> = {
            let k = self.kept.lock().map_err(|_| StoreError::Setup("stream state poisoned".into()))?;
            rest.iter().map(|&e| k.get(&(layer, e)).cloned()).collect()
        };
        let mut missing = Vec::new();
        for (&e, k) in rest.iter().zip(kept) {
            match k {
                Some(k) => ready.push((e, self.read_kept(layer, e, &k)?)),
                None => missing.push(e),
            }
        }
        if !missing.is_empty() {
            let got = self.stream_in(layer, &missing).map_err(|err| {
                StoreError::NoHolderLeft(format!(
                    "experts {missing:?} of layer {layer} are not local and streaming them from {} failed: {err}",
                    self.origin.endpoint()
                ))
            })?;
            ready.extend(got);
        }
        Ok(ready)
    }
}

impl ExpertSource for StreamSource {
    fn layout(&self) -> &ExpertLayout {
        &self.layout
    }

    fn fetch<'s>(&'s self, layer: usize, experts: &[u32], sink: &mut dyn ExpertSink<'s>) -> Result<(), StoreError> {
        let (local, mut rest): (Vec<u32>, Vec<u32>) = experts.iter().partition(|&&e| self.is_held(layer, e));
        if !local.is_empty() && self.fetch_local(layer, &local, &mut rest, sink)? {
            return Ok(());
        }
        if rest.is_empty() {
            return Ok(());
        }
        for (e, bytes) in self.fetch_streamed(layer, &rest)? {
            if sink.land(e, Landed::owned(bytes))? == Flow::Stop {
                break;
            }
        }
        Ok(())
    }

    fn note_routes(&self, layer: usize, experts: &[u32], rows_of: &[usize], rows: usize) {
        self.local.note_routes(layer, experts, rows_of, rows)
    }

    fn health(&self) -> super::StorageHealth {
        self.local.health()
    }

    fn report(&self) -> SourceReport {
        let mut r = self.local.report();
        let (bytes, reqs) = self.http_counts();
        let reread = self.reread.load(Ordering::Relaxed) * self.layout.len as u64;
        r.expert_bytes_requested += self.streamed.load(Ordering::Relaxed) * self.layout.len as u64 + reread;
        // Bytes over HTTP and re-reads of packs written in this run count as reads, so read
        // amplification stays bytes read / distinct bytes needed.
        r.expert_bytes_read = Some(r.expert_bytes_read.unwrap_or(0) + bytes + reread);
        r.drives.push(DriveReport {
            drive: r.drives.len(),
            root: self.origin.report_root(),
            reader: "http".into(),
            direct_io: false,
            bytes_read: bytes,
            reads: reqs,
            read_ms_p50: None,
            read_ms_p99: None,
            read_ms_max: None,
            lands_last: 0,
            failures: 0,
            failed: None,
            last_failure: None,
            rate_gbps: 0.0,
        });
        r
    }

    fn describe(&self) -> String {
        let sums = self.sums.as_ref().map_or_else(|| "UNVERIFIED".to_string(), |s| s.describe());
        format!(
            "experts streamed: {} of {} local, the rest on demand from {}, {sums} | {}",
            self.local_count(),
            self.experts,
            self.origin.describe(),
            self.local.describe()
        )
    }
}

/// One stream-in at a time per process: the registry and the drives see one writer, and a fetch
/// of experts another thread is streaming waits for them instead of fetching them again.
static STREAMING: Mutex<()> = Mutex::new(());
