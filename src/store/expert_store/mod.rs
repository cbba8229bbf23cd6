//! The expert store: where experts are read. Holders on several drives, one reader thread per
//! drive, a read balancer, the expert cache, integrity checks and failover.
//!
//! Contract:
//! - `fetch(layer, experts, land)` delivers each requested expert's exact shipped bytes once, in
//!   arrival order; bytes are verified against the placement checksum when one is known.
//! - A read already in flight for an expert is joined, never issued twice.
//! - Each read goes to the holder with the earliest expected completion (bytes queued on its
//!   drive / the drive's measured rate, plus this read); rates follow completions (bytes over busy
//!   time). A demanded expert with copies on several drives is split into page-aligned byte ranges
//!   across them, sized so every drive finishes its queue at the same moment (`split`); an idle
//!   drive takes queued ranges off a drive that would finish them later. The expert is checked
//!   whole once every range has landed.
//! - Every read is checked as it lands against what the expert's bytes must hash to (a placement's
//!   checksums, or the checkpoint's recorded ones: `StoreSpec::checksums`), so bytes changed on a
//!   drive are never delivered.
//! - A failed read (I/O error, short read, checksum mismatch) names the file and the expert; the
//!   holder is suspect for a while and the read retried on another holder; after its backoff the
//!   holder is tried again and restored once it reads clean (`heal`). With no holder usable the
//!   fetch fails with a clear error; no bytes of a failed read are ever delivered.
//!
//! Here: the store's types, its shared state and its public methods. Beside it: `fetch.rs`
//! ([`ExpertSource::fetch`]), `balance.rs` (which holder serves a read), `split.rs` (split reads,
//! stealing, the drives' rates), `hedge.rs` (hedged reads), `policy.rs` (the cache: slots,
//! eviction ranks, reads ahead), `drive.rs` (one reader thread per drive: submission, completion,
//! verification, failover), `heal.rs` (suspect holders, backoff, `/health`), `report.rs` (the
//! counters) and `spec.rs` (what a store is opened from: holders, drives, options).

use super::cache::{EvictionOrder, Slab};
use super::counters::{DriveCounters, DriveReport, SourceReport};
use super::heat::Heat;
use super::io::reader::{DirectFile, Done, ReadOp, ReaderKind, new_reader, widen};
use super::sums::Verdict;
use super::{ExpertSink, ExpertSource, Flow, Landed, StoreError};
use crate::model::roster::ExpertLayout;
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

mod balance;
mod drive;
mod fetch;
mod heal;
mod hedge;
mod policy;
mod report;
mod spec;
mod split;
pub use heal::StorageHealth;
pub use spec::{DriveSpec, Holder, HolderExtent, StoreOptions, StoreSpec};
pub use split::SPLIT_MIN;

use super::replay::RouteReplay;
use balance::{choose_holder, join_read, start_read, start_read_as};
use drive::drive_loop;
use policy::{
    SureSlot, add_uses, alloc_demand_slot, alloc_slot, cache_slot, demote_read_ahead, pin_ready, read_ahead, unpin,
};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

type Key = (u32, u32);

#[derive(Clone, Copy, Debug)]
enum Slot {
    Free,
    Loading,
    Ready {
        key: Key,
        pins: u32,
        start: u32,
        drive: u16,
        at: Instant,
        prefetched: bool,
        /// Read ahead for a batch that will surely need it (`read_ahead`): kept above every
        /// demanded expert until that layer is fetched.
        sure: bool,
    },
    /// Its read may still be in the kernel after its reader failed: never reused.
    Poisoned,
}

enum KeyState {
    Loading { req: usize },
    Ready { slot: usize },
    Failed { msg: String, waiters: u32 },
}

struct Req {
    key: Key,
    slot: usize,
    /// The drive of its first part (a prefetch's only drive).
    drive: u16,
    /// Drives already tried (failed) for this read.
    tried: Vec<u16>,
    prefetch: bool,
    /// A read ahead (see `read_ahead`).
    sure: bool,
    /// Fetchers waiting for this read; they each hold a pin once it completes.
    waiters: u32,
    submitted: Option<Instant>,
    /// Bytes of all reads of this request (widened).
    op_len: u64,
    /// Where the expert's image starts in the slot once complete.
    start: u32,
    parts: Vec<Part>,
    /// Reads still in flight or queued.
    parts_left: usize,
    /// The first failed part's drive, its file (when the file is to blame) and what failed.
    part_error: Option<(u16, Option<u32>, String)>,
    bytes_got: u64,
    /// Parts may move between drives holding the expert at the same page offset (`split`).
    movable: bool,
    /// A part was lost in flight on a drive given up: the slot may still be written, never reuse it.
    poison: bool,
}

/// One read of a request: `op_len` bytes at `offset` of `file` (on `drive`) into the slot at
/// `pos`; the wanted `len` bytes start `skip` into it and belong at `dest` of the image.
#[derive(Clone, Copy, Debug)]
struct Part {
    drive: u16,
    /// When it was submitted (None: queued), and when its drive's queue and rate said it would land.
    at: Option<Instant>,
    due: Option<Instant>,
    done: bool,
    file: u32,
    offset: u64,
    op_len: u64,
    skip: u64,
    pos: u64,
    dest: u64,
    len: u64,
}

/// Request index and part index packed into a reader tag (and a drive queue's entry).
const PART_BITS: u32 = 6;

fn tag(r: usize, part: usize) -> usize {
    (r << PART_BITS) | part
}

fn untag(t: usize) -> (usize, usize) {
    (t >> PART_BITS, t & ((1 << PART_BITS) - 1))
}

struct DriveState {
    /// Queued parts (`tag`s), demanded and prefetched.
    demand: VecDeque<usize>,
    prefetch: VecDeque<usize>,
    /// Bytes of the parts queued or in flight, and of those in flight.
    queued_bytes: u64,
    flight_bytes: u64,
    /// Bytes per second: bytes over busy time of the last completions (`split::Rate`).
    rate: f64,
    samples: split::Rate,
    /// Given up for the store's life (its reader keeps failing, its directory or a file is missing).
    failed: Option<String>,
    /// The last read that failed here (the holder is suspect for a while, see `heal`).
    last_failure: Option<String>,
    in_flight: usize,
    last_completion: Option<Instant>,
    counters: DriveCounters,
    reader: Option<ReaderKind>,
}

struct State {
    slots: Vec<Slot>,
    keys: HashMap<Key, KeyState>,
    free: Vec<usize>,
    /// Ready, unpinned slots (cached or prefetched) in eviction order (see `rank`).
    lru: EvictionOrder,
    /// How often each expert has been requested (a prompt's rows counted), for the route heat.
    uses: HashMap<Key, u32>,
    /// Each expert's rank when out of the replay's forecast: requests weighted (see `policy`).
    ranks: HashMap<Key, u32>,
    /// The fetch history and its forecast of the next requests.
    replay: RouteReplay,
    reqs: Vec<Option<Req>>,
    free_reqs: Vec<usize>,
    drives: Vec<DriveState>,
    requested: u64,
    read: u64,
    hits: u64,
    misses: u64,
    joins: u64,
    prefetch_issued: u64,
    prefetch_used: u64,
    /// Prefetch reads queued or in flight (capped).
    prefetch_outstanding: usize,
    /// Slots read ahead and not yet demanded (see `read_ahead`).
    sure_slots: Vec<SureSlot>,
    shutdown: bool,
    /// (file, offset, length) of reads issued, when recording.
    read_log: Option<Vec<(u32, u64, u64)>>,
    /// Injected faults still to happen (tests and fault drills).
    faults: Vec<FaultPlan>,
    hedges: hedge::Hedges,
    /// Holders that failed recently, retried after a backoff (`heal`).
    suspects: heal::Suspects,
}

/// What an injected fault does to a completed read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// The read fails with EIO.
    Eio,
    /// The read returns only half of the expert.
    Short,
}

/// An injected fault: on drive `drive`, after `skip` completed reads pass, the next `times` reads
/// complete with `kind` instead of their real result. The rest of the store (verification,
/// failover, errors) handles them exactly like real faults.
#[derive(Clone, Copy, Debug)]
pub struct FaultPlan {
    pub drive: usize,
    pub kind: FaultKind,
    pub skip: u64,
    pub times: u64,
}

struct Shared {
    st: Mutex<State>,
    done_cv: Condvar,
    drive_cv: Vec<Condvar>,
    slab: Slab,
    spec: StoreSpec,
    files: Vec<Option<DirectFile>>,
    cache_slots: usize,
    prefetch_depth: usize,
    /// Cap on prefetch reads queued or in flight over all drives.
    prefetch_cap: usize,
    hedge: bool,
    split_min: Option<u64>,
}

pub struct ExpertStore {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    /// The heat this store was seeded with, folded and saved on drop.
    heat: Mutex<Option<Heat>>,
}

fn lock(s: &Shared) -> MutexGuard<'_, State> {
    // A panicking reader thread must not take the whole engine down with a poisoned lock.
    s.st.lock().unwrap_or_else(|p| p.into_inner())
}

/// A batch of routes above this many rows counts as this many ([`ExpertStore::note_routes`]):
/// measured on the peer model's trace (bench/cache_sim.py), 128 to 2048 all land within 1% of
/// each other, far better than unweighted counts.
const PROMPT_HEAT_ROWS: usize = 256;

/// How long a drive thread waits for completions before looking for newly queued work.
const REAP_TICK: Duration = Duration::from_millis(1);
/// Consecutive reader errors after which a drive is given up.
const MAX_READER_ERRORS: u32 = 50;

/// Bytes of one slab slot for experts of `len` bytes read in one range: widened O_DIRECT reads need
/// up to one extra 4 KiB page on each side.
pub fn slot_size(len: usize) -> usize {
    len.div_ceil(4096) * 4096 + 8192
}

/// Bytes of one slab slot for the experts of `spec` (each piece of a split expert is widened).
pub fn slot_size_for(spec: &StoreSpec) -> usize {
    spec.layout.len.div_ceil(4096) * 4096 + 8192 * spec.max_pieces().max(1)
}

/// Slots besides the cache: each drive's reads in flight (demand and prefetch), plus two.
pub fn staging_slots(drives: &[DriveSpec], prefetch_depth: usize) -> usize {
    drives.iter().map(|d| d.qd.max(1) + prefetch_depth).sum::<usize>() + 2
}

/// Each drive's state, and every holder file opened for uncached reads (None where its drive's
/// directory is missing or the file cannot be opened: that drive is failed, the other holders serve).
fn open_drives(spec: &StoreSpec) -> (Vec<DriveState>, Vec<Option<DirectFile>>) {
    let mut drives: Vec<DriveState> = spec
        .drives
        .iter()
        .map(|d| DriveState {
            demand: VecDeque::new(),
            prefetch: VecDeque::new(),
            queued_bytes: 0,
            flight_bytes: 0,
            rate: (d.gbps.max(0.01)) * 1e9,
            samples: split::Rate::default(),
            failed: None,
            last_failure: None,
            in_flight: 0,
            last_completion: None,
            counters: DriveCounters::default(),
            reader: None,
        })
        .collect();
    for (i, d) in spec.drives.iter().enumerate() {
        if !d.root.is_dir() {
            let msg = format!("directory {} is missing", d.root.display());
            tracing::warn!("drive {i} ({}): {msg}; using the remaining holders", d.root.display());
            drives[i].failed = Some(msg);
        }
    }
    let mut files = Vec::with_capacity(spec.files.len());
    for (drive, path) in &spec.files {
        let d = *drive as usize;
        if drives[d].failed.is_some() {
            files.push(None);
            continue;
        }
        match DirectFile::open(path) {
            Ok(f) => files.push(Some(f)),
            Err(e) => {
                let msg = format!("cannot open {}: {e}", path.display());
                tracing::warn!("drive {d} ({}): {msg}; avoiding this drive", spec.drives[d].root.display());
                drives[d].failed = Some(msg);
                drives[d].counters.failures += 1;
                files.push(None);
            }
        }
    }
    (drives, files)
}

impl State {
    /// The state of a store of `n_slots` slots, all free, over `drives`: the cache's ranks seeded
    /// from `uses` (the route heat of earlier runs), reads logged when `record_reads`.
    fn new(
        drives: Vec<DriveState>,
        n_slots: usize,
        uses: HashMap<Key, u32>,
        moe_layers: usize,
        record_reads: bool,
    ) -> Self {
        let n_drives = drives.len();
        State {
            slots: vec![Slot::Free; n_slots],
            keys: HashMap::new(),
            free: (0..n_slots).rev().collect(),
            lru: EvictionOrder::new(n_slots),
            ranks: policy::heat_ranks(&uses),
            uses,
            replay: RouteReplay::new(moe_layers),
            reqs: Vec::new(),
            free_reqs: Vec::new(),
            drives,
            requested: 0,
            read: 0,
            hits: 0,
            misses: 0,
            joins: 0,
            prefetch_issued: 0,
            prefetch_used: 0,
            prefetch_outstanding: 0,
            sure_slots: Vec::new(),
            shutdown: false,
            read_log: record_reads.then(Vec::new),
            faults: Vec::new(),
            hedges: hedge::Hedges::new(n_drives),
            suspects: heal::Suspects::default(),
        }
    }
}

impl ExpertStore {
    /// Opens every holder file and starts one reader thread per usable drive.
    pub fn open(spec: StoreSpec, opts: StoreOptions) -> Result<Self, StoreError> {
        if spec.max_pieces() > 1 << PART_BITS {
            return Err(StoreError::Setup(format!(
                "an expert is held in {} pieces; at most {} are supported",
                spec.max_pieces(),
                1 << PART_BITS
            )));
        }
        let slot_size = slot_size_for(&spec);
        let staging = staging_slots(&spec.drives, opts.prefetch_depth) + opts.read_ahead_slots;
        let cache_slots = (opts.cache_bytes / slot_size as u64) as usize;
        let slab =
            Slab::new(cache_slots + staging, slot_size).map_err(|e| StoreError::Setup(format!("expert cache: {e}")))?;

        let (drives, files) = open_drives(&spec);
        let heat = opts.heat.as_deref().map(|path| {
            let layers: Vec<u32> =
                spec.holders.iter().enumerate().filter(|(_, h)| h.is_some()).map(|(l, _)| l as u32).collect();
            let experts = spec.holders.iter().flatten().map(|h| h.len()).max().unwrap_or(0);
            Heat::open(path, &layers, experts)
        });
        let uses = heat.as_ref().map(Heat::seed).unwrap_or_default();
        let moe_layers = spec.holders.iter().filter(|h| h.is_some()).count();
        let st = State::new(drives, slab.slots, uses, moe_layers, opts.record_reads);
        let n_drives = spec.drives.len();
        let prefetch_cap = 2 * n_drives * opts.prefetch_depth;
        let shared = Arc::new(Shared {
            st: Mutex::new(st),
            done_cv: Condvar::new(),
            drive_cv: (0..n_drives).map(|_| Condvar::new()).collect(),
            slab,
            spec,
            files,
            cache_slots,
            prefetch_depth: opts.prefetch_depth,
            prefetch_cap,
            hedge: opts.hedge,
            split_min: opts.split_min,
        });
        // Threads are owned by the store as they start, so an error below still shuts them down.
        let mut store = ExpertStore { shared, threads: Vec::new(), heat: Mutex::new(heat) };
        store.start_readers(opts.reader)?;
        Ok(store)
    }

    /// Starts one reader thread of kind `kind` per usable drive.
    fn start_readers(&mut self, kind: ReaderKind) -> Result<(), StoreError> {
        for d in 0..self.shared.spec.drives.len() {
            if lock(&self.shared).drives[d].failed.is_some() {
                continue;
            }
            let qd = self.shared.spec.drives[d].qd.max(1);
            let table: super::io::reader::FileTable =
                self.shared.files.iter().map(|f| f.as_ref().map_or(-1, |f| f.fd())).collect();
            let reader = new_reader(kind, qd, &self.shared.slab.iovecs(), table)
                .map_err(|e| StoreError::Setup(format!("{} reader for drive {d}: {e}", kind.name())))?;
            lock(&self.shared).drives[d].reader = Some(reader.kind());
            let sh = Arc::clone(&self.shared);
            let t = std::thread::Builder::new()
                .name(format!("deltafin-drive{d}"))
                .spawn(move || drive_loop(sh, d, reader))
                .map_err(|e| StoreError::Setup(format!("cannot start the reader thread for drive {d}: {e}")))?;
            self.threads.push(t);
        }
        Ok(())
    }

    /// Starts reading experts a later layer will probably need, into idle drive capacity only.
    /// Skips experts already cached or in flight; takes free slots only (a guess never evicts a
    /// cached expert); at most `prefetch_cap` prefetches are outstanding.
    pub fn prefetch(&self, layer: usize, experts: &[u32]) {
        if self.shared.prefetch_depth == 0 {
            return;
        }
        let sh = &*self.shared;
        let mut st = lock(sh);
        let st = &mut *st;
        for &e in experts {
            if st.prefetch_outstanding >= sh.prefetch_cap {
                break;
            }
            let key = (layer as u32, e);
            if st.keys.contains_key(&key) || choose_holder(sh, st, key, &[]).is_none() {
                continue;
            }
            let Some(slot) = st.free.pop() else { break };
            if start_read(sh, st, key, slot, true, &[]) {
                st.prefetch_issued += 1;
                st.prefetch_outstanding += 1;
            } else {
                st.free.push(slot);
            }
        }
    }

    /// Drops queued (not yet submitted) prefetch reads of `layer` for experts not in `keep`.
    pub fn cancel_prefetch(&self, layer: usize, keep: &[u32]) {
        let sh = &*self.shared;
        let mut st = lock(sh);
        let st = &mut *st;
        let mut freed = false;
        for d in 0..st.drives.len() {
            let queued: Vec<usize> = st.drives[d].prefetch.iter().copied().collect();
            for t in queued {
                let r = untag(t).0;
                let Some(req) = st.reqs[r].as_ref() else { continue };
                if req.key.0 != layer as u32
                    || keep.contains(&req.key.1)
                    || req.waiters > 0
                    || !req.prefetch
                    || req.parts.iter().any(|p| p.at.is_some())
                {
                    continue;
                }
                let (key, slot, len) = (req.key, req.slot, req.op_len);
                st.drives[d].prefetch.retain(|&x| untag(x).0 != r);
                st.drives[d].queued_bytes = st.drives[d].queued_bytes.saturating_sub(len);
                st.keys.remove(&key);
                st.slots[slot] = Slot::Free;
                st.free.push(slot);
                st.reqs[r] = None;
                st.free_reqs.push(r);
                st.prefetch_outstanding = st.prefetch_outstanding.saturating_sub(1);
                freed = true;
            }
        }
        if freed {
            sh.done_cv.notify_all();
        }
    }

    /// Counts a batch's routes into the cache's request counts: for the route heat, each row
    /// routed to an expert counts as one request, scaled down for batches above
    /// [`PROMPT_HEAT_ROWS`] rows so one long prompt weighs as much as that many decode steps; for
    /// the cache's ranks the batch weighs as [`policy::PROMPT_PRIOR_PASSES`] fetches (a prompt's
    /// routes foretell its continuation's only weakly). Single rows are counted by `fetch`.
    pub fn note_routes(&self, layer: usize, experts: &[u32], rows_of: &[usize], rows: usize) {
        if rows <= 1 {
            return;
        }
        let scale = PROMPT_HEAT_ROWS.min(rows) as f64 / rows as f64;
        let prior = policy::PROMPT_PRIOR_PASSES * f64::from(policy::RANK_UNIT) / rows as f64;
        let mut st = lock(&self.shared);
        for (&e, &c) in experts.iter().zip(rows_of) {
            add_uses(&mut st, (layer as u32, e), (c as f64 * scale).round() as u32, (c as f64 * prior).round() as u32);
        }
    }

    /// Runs folded into the heat this store was seeded with (None without heat).
    pub fn heat_runs(&self) -> Option<u64> {
        self.heat.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(|h| h.runs)
    }

    /// Makes future reads fail as `plan` says (fault drills and tests of failover).
    pub fn inject_fault(&self, plan: FaultPlan) {
        lock(&self.shared).faults.push(plan);
    }

    /// Emulates a slow drive (tests of hedged reads, drills): from now on each batch of drive
    /// `drive`'s completed reads is handed over `delay` late (None: on time again).
    pub fn delay_drive(&self, drive: usize, delay: Option<Duration>) {
        if let Some(d) = lock(&self.shared).hedges.delay.get_mut(drive) {
            *d = delay;
        }
    }

    /// Number of slots in the slab (cache + staging).
    pub fn slots(&self) -> usize {
        self.shared.slab.slots
    }

    /// Reads kept in flight, all drives together (each drive's queue depth).
    pub fn queue_depth(&self) -> usize {
        self.shared.spec.drives.iter().map(|d| d.qd.max(1)).sum()
    }
}

impl Drop for ExpertStore {
    fn drop(&mut self) {
        if let Some(mut heat) = self.heat.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let st = lock(&self.shared);
            if st.requested > 0 {
                heat.fold(&st.uses);
                drop(st);
                if let Err(e) = heat.save() {
                    tracing::warn!("expert heat not saved: {e}");
                }
            }
        }
        lock(&self.shared).shutdown = true;
        for cv in &self.shared.drive_cv {
            cv.notify_all();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
