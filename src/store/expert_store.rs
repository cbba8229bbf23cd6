//! The expert store: where experts are read. Holders on several drives, one reader thread per
//! drive, a read balancer, the expert cache, integrity checks and failover.
//!
//! Contract:
//! - `fetch(layer, experts, land)` delivers each requested expert's exact shipped bytes once, in
//!   arrival order; bytes are verified against the placement checksum when one is known.
//! - A read already in flight for an expert is joined, never issued twice.
//! - Each read goes to the holder with the earliest expected completion (bytes queued on its
//!   drive / the drive's measured rate, plus this read); rates follow completions. An expert is
//!   read whole from one drive.
//! - A failed read (I/O error, short read, checksum mismatch) names the drive and the expert; the
//!   drive is then avoided and the read retried on another holder. With no holder left the fetch
//!   fails with a clear error; no bytes of a failed read are ever delivered.

use super::cache::{Lru, Slab};
use super::counters::{DriveCounters, DriveReport, SourceReport};
use super::reader::{DirectFile, Done, ReadOp, ReaderKind, new_reader, widen};
use super::{ExpertSource, StoreError};
use crate::model::roster::ExpertLayout;
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One place an expert's bytes can be read.
#[derive(Clone, Copy, Debug)]
pub struct Holder {
    pub drive: u16,
    pub file: u32,
    /// Offset of the expert's first byte in the file.
    pub offset: u64,
    /// 0 = primary; 1 = fallback, used only when no primary holder is usable.
    pub tier: u8,
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
    /// [layer] -> [expert] -> xxh3 of the expert's bytes, when known.
    pub checksums: Option<Vec<Option<Vec<u64>>>>,
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
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions { cache_bytes: 0, reader: ReaderKind::Auto, prefetch_depth: 1, record_reads: false }
    }
}

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
    drive: u16,
    /// Drives already tried (failed) for this read.
    tried: Vec<u16>,
    prefetch: bool,
    /// Fetchers waiting for this read; they each hold a pin once it completes.
    waiters: u32,
    submitted: Option<Instant>,
    op_len: u64,
    start: u32,
    offset: u64,
    fd: i32,
    file: u32,
}

struct DriveState {
    demand: VecDeque<usize>,
    prefetch: VecDeque<usize>,
    queued_bytes: u64,
    /// Bytes per second.
    rate: f64,
    failed: Option<String>,
    in_flight: usize,
    last_completion: Option<Instant>,
    counters: DriveCounters,
    reader: Option<ReaderKind>,
}

struct State {
    slots: Vec<Slot>,
    keys: HashMap<Key, KeyState>,
    free: Vec<usize>,
    /// Ready, unpinned slots (cached or prefetched), least recently used first.
    lru: Lru,
    /// How often each expert has been requested: a used expert enters a full cache only by
    /// displacing a less-used one, so decode's cyclic walk over layers cannot flush it.
    uses: HashMap<Key, u32>,
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
    shutdown: bool,
    /// (file, offset, length) of reads issued, when recording.
    read_log: Option<Vec<(u32, u64, u64)>>,
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
}

pub struct ExpertStore {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

fn lock(s: &Shared) -> MutexGuard<'_, State> {
    // A panicking reader thread must not take the whole engine down with a poisoned lock.
    s.st.lock().unwrap_or_else(|p| p.into_inner())
}

/// How long a drive thread waits for completions before looking for newly queued work.
const REAP_TICK: Duration = Duration::from_millis(1);
/// Consecutive reader errors after which a drive is given up.
const MAX_READER_ERRORS: u32 = 50;

/// Bytes of one slab slot for experts of `len` bytes: widened O_DIRECT reads need up to one extra
/// 4 KiB page on each side.
pub fn slot_size(len: usize) -> usize {
    len.div_ceil(4096) * 4096 + 8192
}

/// Slots besides the cache: each drive's reads in flight (demand and prefetch), plus two.
pub fn staging_slots(drives: &[DriveSpec], prefetch_depth: usize) -> usize {
    drives.iter().map(|d| d.qd.max(1) + prefetch_depth).sum::<usize>() + 2
}

impl ExpertStore {
    /// Opens every holder file and starts one reader thread per usable drive.
    pub fn open(spec: StoreSpec, opts: StoreOptions) -> Result<Self, StoreError> {
        let slot_size = slot_size(spec.layout.len);
        let staging = staging_slots(&spec.drives, opts.prefetch_depth);
        let cache_slots = (opts.cache_bytes / slot_size as u64) as usize;
        let slab =
            Slab::new(cache_slots + staging, slot_size).map_err(|e| StoreError::Setup(format!("expert cache: {e}")))?;

        let mut drives: Vec<DriveState> = spec
            .drives
            .iter()
            .map(|d| DriveState {
                demand: VecDeque::new(),
                prefetch: VecDeque::new(),
                queued_bytes: 0,
                rate: (d.gbps.max(0.01)) * 1e9,
                failed: None,
                in_flight: 0,
                last_completion: None,
                counters: DriveCounters::default(),
                reader: None,
            })
            .collect();
        for (i, d) in spec.drives.iter().enumerate() {
            if !d.root.is_dir() {
                let msg = format!("directory {} is missing", d.root.display());
                eprintln!("deltafin: warning: drive {i} ({}): {msg}; using the remaining holders", d.root.display());
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
                    eprintln!(
                        "deltafin: warning: drive {d} ({}): {msg}; avoiding this drive",
                        spec.drives[d].root.display()
                    );
                    drives[d].failed = Some(msg);
                    drives[d].counters.failures += 1;
                    files.push(None);
                }
            }
        }
        let n_slots = slab.slots;
        let st = State {
            slots: vec![Slot::Free; n_slots],
            keys: HashMap::new(),
            free: (0..n_slots).rev().collect(),
            lru: Lru::new(n_slots),
            uses: HashMap::new(),
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
            shutdown: false,
            read_log: opts.record_reads.then(Vec::new),
        };
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
        });
        // Threads are owned by the store as they start, so an error below still shuts them down.
        let mut store = ExpertStore { shared, threads: Vec::new() };
        for d in 0..n_drives {
            if lock(&store.shared).drives[d].failed.is_some() {
                continue;
            }
            let qd = store.shared.spec.drives[d].qd.max(1);
            let reader = new_reader(opts.reader, qd, &store.shared.slab.iovecs())
                .map_err(|e| StoreError::Setup(format!("{} reader for drive {d}: {e}", opts.reader.name())))?;
            lock(&store.shared).drives[d].reader = Some(reader.kind());
            let sh = Arc::clone(&store.shared);
            let t = std::thread::Builder::new()
                .name(format!("deltafin-drive{d}"))
                .spawn(move || drive_loop(sh, d, reader))
                .map_err(|e| StoreError::Setup(format!("cannot start the reader thread for drive {d}: {e}")))?;
            store.threads.push(t);
        }
        Ok(store)
    }

    /// Starts reading experts a later layer will probably need, into idle drive capacity only.
    /// Skips experts already cached or in flight; takes free slots, or evicts cached experts only
    /// when a holder is available; at most `prefetch_cap` prefetches are outstanding.
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
            let Some(slot) = alloc_slot(st) else { break };
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
            for r in queued {
                let Some(req) = st.reqs[r].as_ref() else { continue };
                if req.key.0 != layer as u32 || keep.contains(&req.key.1) || req.waiters > 0 || !req.prefetch {
                    continue;
                }
                let (key, slot, len) = (req.key, req.slot, req.op_len);
                st.drives[d].prefetch.retain(|&x| x != r);
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

    pub fn report(&self) -> SourceReport {
        let sh = &*self.shared;
        let st = lock(sh);
        SourceReport {
            expert_bytes_requested: st.requested,
            expert_bytes_read: Some(st.read),
            cache_hits: Some(st.hits),
            cache_misses: Some(st.misses),
            inflight_joins: Some(st.joins),
            cache_slots: Some(sh.cache_slots),
            prefetch_issued: st.prefetch_issued,
            prefetch_used: st.prefetch_used,
            drives: st
                .drives
                .iter()
                .enumerate()
                .map(|(i, d)| DriveReport {
                    drive: i,
                    root: sh.spec.drives[i].root.display().to_string(),
                    reader: d.reader.map_or("none", ReaderKind::name).to_string(),
                    direct_io: sh
                        .spec
                        .files
                        .iter()
                        .zip(&sh.files)
                        .any(|((fd, _), f)| *fd as usize == i && f.as_ref().is_some_and(|f| f.direct)),
                    bytes_read: d.counters.bytes_read,
                    reads: d.counters.reads,
                    read_ms_p50: d.counters.latency.quantile_ms(0.5),
                    read_ms_p99: d.counters.latency.quantile_ms(0.99),
                    read_ms_max: d.counters.latency.max_ms(),
                    lands_last: d.counters.lands_last,
                    failures: d.counters.failures,
                    failed: d.failed.clone(),
                    rate_gbps: d.rate / 1e9,
                })
                .collect(),
        }
    }

    /// Reads issued so far as (path, offset, length), when `record_reads` was set.
    pub fn read_log(&self) -> Vec<(PathBuf, u64, u64)> {
        let sh = &*self.shared;
        let st = lock(sh);
        st.read_log.iter().flatten().map(|&(f, o, l)| (sh.spec.files[f as usize].1.clone(), o, l)).collect()
    }

    /// Number of slots in the slab (cache + staging).
    pub fn slots(&self) -> usize {
        self.shared.slab.slots
    }
}

impl Drop for ExpertStore {
    fn drop(&mut self) {
        lock(&self.shared).shutdown = true;
        for cv in &self.shared.drive_cv {
            cv.notify_all();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Frees the least recently used unpinned Ready slot.
fn evict_lru(st: &mut State) -> Option<usize> {
    let slot = st.lru.pop_front()?;
    if let Slot::Ready { key, .. } = st.slots[slot]
        && matches!(st.keys.get(&key), Some(KeyState::Ready { slot: s }) if *s == slot)
    {
        st.keys.remove(&key);
    }
    st.slots[slot] = Slot::Free;
    Some(slot)
}

/// A slot for a new read: a free one, else the least recently used cached one.
fn alloc_slot(st: &mut State) -> Option<usize> {
    st.free.pop().or_else(|| evict_lru(st))
}

/// The usable holder of `key` with the earliest expected completion, avoiding failed drives and
/// `exclude`; primary holders before fallback ones.
fn choose_holder(sh: &Shared, st: &State, key: Key, exclude: &[u16]) -> Option<Holder> {
    let holders = sh.spec.holders.get(key.0 as usize)?.as_ref()?.get(key.1 as usize)?;
    let len = sh.spec.layout.len as f64;
    let usable = |h: &&Holder| {
        st.drives[h.drive as usize].failed.is_none()
            && !exclude.contains(&h.drive)
            && sh.files[h.file as usize].is_some()
    };
    let best_tier = holders.iter().filter(usable).map(|h| h.tier).min()?;
    holders.iter().filter(usable).filter(|h| h.tier == best_tier).copied().min_by(|a, b| {
        let cost = |h: &Holder| {
            let d = &st.drives[h.drive as usize];
            (d.queued_bytes as f64 + len) / d.rate
        };
        cost(a).total_cmp(&cost(b)).then(a.drive.cmp(&b.drive))
    })
}

/// Queues a read of `key` into `slot`; false if no holder is usable (then nothing changed).
fn start_read(sh: &Shared, st: &mut State, key: Key, slot: usize, prefetch: bool, exclude: &[u16]) -> bool {
    let Some(h) = choose_holder(sh, st, key, exclude) else { return false };
    let Some(file) = sh.files[h.file as usize].as_ref() else { return false };
    let len = sh.spec.layout.len as u64;
    let (off, op_len, start) = if file.direct { widen(h.offset, len) } else { (h.offset, len, 0) };
    let req = Req {
        key,
        slot,
        drive: h.drive,
        tried: exclude.to_vec(),
        prefetch,
        waiters: 0,
        submitted: None,
        op_len,
        start: start as u32,
        offset: off,
        fd: file.fd(),
        file: h.file,
    };
    let r = match st.free_reqs.pop() {
        Some(r) => {
            st.reqs[r] = Some(req);
            r
        }
        None => {
            st.reqs.push(Some(req));
            st.reqs.len() - 1
        }
    };
    let d = &mut st.drives[h.drive as usize];
    d.queued_bytes += op_len;
    if prefetch {
        d.prefetch.push_back(r);
    } else {
        d.demand.push_back(r);
    }
    st.slots[slot] = Slot::Loading;
    st.keys.insert(key, KeyState::Loading { req: r });
    sh.drive_cv[h.drive as usize].notify_one();
    true
}

/// Adds a waiter to the read in flight for `key` (promoting a prefetch to a demanded read).
fn join_read(st: &mut State, r: usize) {
    let Some(q) = st.reqs[r].as_mut() else { return };
    q.waiters += 1;
    if q.prefetch {
        q.prefetch = false;
        st.prefetch_used += 1;
        st.prefetch_outstanding = st.prefetch_outstanding.saturating_sub(1);
        if q.submitted.is_none() {
            let dr = &mut st.drives[q.drive as usize];
            dr.prefetch.retain(|&x| x != r);
            dr.demand.push_back(r);
        }
    }
}

/// Pins a Ready slot for a fetcher.
fn pin_ready(st: &mut State, slot: usize) {
    st.lru.remove(slot);
    if let Slot::Ready { pins, prefetched, .. } = &mut st.slots[slot] {
        *pins += 1;
        if *prefetched {
            *prefetched = false;
            st.prefetch_used += 1;
        }
    }
}

/// The reader thread of drive `d`.
fn drive_loop(sh: Arc<Shared>, d: usize, mut reader: Box<dyn super::reader::DriveIo>) {
    let qd = sh.spec.drives[d].qd.max(1);
    let mut done: Vec<Done> = Vec::new();
    let mut errors = 0u32;
    loop {
        let mut batch: Vec<ReadOp> = Vec::new();
        let mut work_waiting;
        {
            let mut st = lock(&sh);
            loop {
                let in_flight = reader.in_flight();
                if st.shutdown && in_flight == 0 {
                    return;
                }
                let st_ref = &mut *st;
                let prefetch_in_flight = st_ref
                    .reqs
                    .iter()
                    .flatten()
                    .filter(|r| r.drive as usize == d && r.prefetch && r.submitted.is_some())
                    .count();
                while in_flight + batch.len() < qd {
                    let dr = &mut st_ref.drives[d];
                    // Prefetch only into idle capacity: never while a demanded read waits.
                    let r = match dr.demand.pop_front() {
                        Some(r) => r,
                        None if prefetch_in_flight + batch.len() < sh.prefetch_depth => match dr.prefetch.pop_front() {
                            Some(r) => r,
                            None => break,
                        },
                        None => break,
                    };
                    let Some(req) = st_ref.reqs[r].as_mut() else { continue };
                    st_ref.drives[d].in_flight += 1;
                    req.submitted = Some(Instant::now());
                    if let Some(log) = st_ref.read_log.as_mut() {
                        log.push((req.file, req.offset, req.op_len));
                    }
                    batch.push(ReadOp {
                        tag: r as u64,
                        fd: req.fd,
                        offset: req.offset,
                        len: req.op_len as usize,
                        buf: sh.slab.slot_ptr(req.slot),
                        buf_index: u16::try_from(req.slot).ok(),
                    });
                }
                work_waiting = !st_ref.drives[d].demand.is_empty() || !st_ref.drives[d].prefetch.is_empty();
                if batch.is_empty() && in_flight == 0 {
                    st = sh.drive_cv[d].wait(st).unwrap_or_else(|p| p.into_inner());
                    continue;
                }
                break;
            }
        }
        for op in batch {
            // SAFETY: the slot is Loading and owned by this request until its completion is handled.
            if let Err(e) = unsafe { reader.submit(op) } {
                done.push(Done { tag: op.tag, result: Err(e) });
            }
        }
        if reader.in_flight() > 0 {
            // Wait for a completion, but come back soon when more work is queued (a demanded read
            // must not wait behind a whole read for an idle queue slot).
            let wait = if work_waiting { REAP_TICK } else { REAP_TICK * 20 };
            match reader.reap(Some(wait), &mut done) {
                Ok(()) => errors = 0,
                Err(e) => {
                    errors += 1;
                    if errors >= MAX_READER_ERRORS {
                        give_up_drive(&sh, d, &format!("reader failed repeatedly: {e}"));
                        return;
                    }
                }
            }
        }
        for c in done.drain(..) {
            complete(&sh, d, c);
        }
    }
}

/// A reader that keeps failing: its in-flight reads may still land, so their slots are poisoned
/// (never reused); every request of the drive is retried elsewhere or failed.
fn give_up_drive(sh: &Shared, d: usize, msg: &str) {
    let mut st = lock(sh);
    let st = &mut *st;
    eprintln!("deltafin: warning: drive {d} ({}): {msg}; avoiding this drive", sh.spec.drives[d].root.display());
    st.drives[d].failed = Some(msg.to_string());
    st.drives[d].counters.failures += 1;
    let mine: Vec<usize> =
        (0..st.reqs.len()).filter(|&r| st.reqs[r].as_ref().is_some_and(|q| q.drive as usize == d)).collect();
    st.drives[d].demand.clear();
    st.drives[d].prefetch.clear();
    for r in mine {
        let Some(req) = st.reqs[r].take() else { continue };
        st.free_reqs.push(r);
        let mut slot = req.slot;
        if req.submitted.is_some() {
            st.slots[slot] = Slot::Poisoned;
            match st.free.pop().or_else(|| evict_lru(st)) {
                Some(s) => slot = s,
                None => {
                    if req.prefetch {
                        st.prefetch_outstanding = st.prefetch_outstanding.saturating_sub(1);
                    }
                    fail_key(sh, st, req.key, req.waiters, d, msg);
                    continue;
                }
            }
        }
        retry_or_fail(sh, st, req, slot, d, msg);
    }
    sh.done_cv.notify_all();
}

/// Retries `req` on another holder (into `slot`), or marks its key failed.
fn retry_or_fail(sh: &Shared, st: &mut State, req: Req, slot: usize, d: usize, msg: &str) {
    let mut tried = req.tried.clone();
    tried.push(d as u16);
    let prefetch = req.prefetch && req.waiters == 0;
    if start_read(sh, st, req.key, slot, prefetch, &tried) {
        if let Some(KeyState::Loading { req: nr }) = st.keys.get(&req.key)
            && let Some(newreq) = st.reqs[*nr].as_mut()
        {
            newreq.waiters = req.waiters;
        }
        return;
    }
    if prefetch {
        st.prefetch_outstanding = st.prefetch_outstanding.saturating_sub(1);
    }
    st.slots[slot] = Slot::Free;
    st.free.push(slot);
    fail_key(sh, st, req.key, req.waiters, d, msg);
}

fn fail_key(sh: &Shared, st: &mut State, key: Key, waiters: u32, d: usize, msg: &str) {
    if waiters > 0 {
        let root = sh.spec.drives[d].root.display();
        let msg =
            format!("expert {} of layer {}: no holder left (last failure on drive {d} ({root}): {msg})", key.1, key.0);
        st.keys.insert(key, KeyState::Failed { msg, waiters });
    } else {
        st.keys.remove(&key);
    }
}

/// Checks a finished read and moves its expert to Ready, or fails over.
fn complete(sh: &Shared, d: usize, c: Done) {
    let r = c.tag as usize;
    let len = sh.spec.layout.len;
    // Verify outside the lock: the slot is still Loading and owned by this read.
    let (key, slot, start, submitted, op_len) = {
        let st = lock(sh);
        let Some(req) = st.reqs[r].as_ref() else { return };
        (req.key, req.slot, req.start as usize, req.submitted, req.op_len)
    };
    let verdict: Result<u64, String> = match c.result {
        Err(e) => Err(format!("I/O error: {e}")),
        Ok(n) if n < start + len => Err(format!("short read: got {} of {} bytes", n.saturating_sub(start), len)),
        Ok(n) => {
            let want =
                sh.spec.checksums.as_ref().and_then(|c| c.get(key.0 as usize)?.as_ref()?.get(key.1 as usize).copied());
            match want {
                Some(w) => {
                    // SAFETY: the read into this slot has completed and nobody else touches it.
                    let bytes = unsafe { sh.slab.slot_bytes(slot, start, len) };
                    let got = super::pack::checksum(bytes);
                    if got == w {
                        Ok(n as u64)
                    } else {
                        Err(format!("checksum mismatch (xxh3 {got:016x}, expected {w:016x})"))
                    }
                }
                None => Ok(n as u64),
            }
        }
    };
    let now = Instant::now();
    let mut st = lock(sh);
    let st = &mut *st;
    let dr = &mut st.drives[d];
    dr.in_flight = dr.in_flight.saturating_sub(1);
    dr.queued_bytes = dr.queued_bytes.saturating_sub(op_len);
    let Some(req) = st.reqs[r].take() else { return };
    st.free_reqs.push(r);
    if req.prefetch {
        st.prefetch_outstanding = st.prefetch_outstanding.saturating_sub(1);
    }
    match verdict {
        Ok(n) => {
            let dr = &mut st.drives[d];
            if let Some(t0) = submitted {
                dr.counters.latency.record((now - t0).as_secs_f64());
                let busy_since = dr.last_completion.map_or(t0, |l| l.max(t0));
                let dt = (now - busy_since).as_secs_f64().max(1e-6);
                dr.rate = 0.8 * dr.rate + 0.2 * (n as f64 / dt);
            }
            dr.last_completion = Some(now);
            dr.counters.bytes_read += n;
            dr.counters.reads += 1;
            if req.prefetch {
                dr.counters.prefetch_reads += 1;
            }
            st.read += n;
            let prefetched = req.waiters == 0;
            st.slots[slot] =
                Slot::Ready { key, pins: req.waiters, start: start as u32, drive: d as u16, at: now, prefetched };
            st.keys.insert(key, KeyState::Ready { slot });
            if req.waiters == 0 {
                // Prefetched: evictable until demanded.
                st.lru.push_back(slot);
            }
        }
        Err(msg) => {
            let dr = &mut st.drives[d];
            dr.counters.failures += 1;
            if dr.failed.is_none() {
                eprintln!(
                    "deltafin: warning: drive {d} ({}): expert {} of layer {}: {msg}; avoiding this drive",
                    sh.spec.drives[d].root.display(),
                    key.1,
                    key.0
                );
                dr.failed = Some(format!("expert {} of layer {}: {msg}", key.1, key.0));
            }
            if req.prefetch {
                // Counted again by start_read's retry only if it stays a prefetch.
                st.prefetch_outstanding += usize::from(req.waiters == 0);
            }
            retry_or_fail(sh, st, req, slot, d, &msg);
        }
    }
    sh.done_cv.notify_all();
}

/// Releases a pin after the forward pass consumed the bytes and keeps the expert as cache when
/// there is room, or when it has been requested more often than the least recently used cached
/// expert (which it then replaces); otherwise the slot is freed.
fn unpin(sh: &Shared, st: &mut State, key: Key, slot: usize) {
    if let Slot::Ready { pins, .. } = &mut st.slots[slot] {
        *pins = pins.saturating_sub(1);
        if *pins > 0 {
            return;
        }
    }
    let keep = if st.lru.len() < sh.cache_slots {
        true
    } else {
        let victim = st.lru.front().and_then(|v| match st.slots[v] {
            Slot::Ready { key: vk, .. } => Some(vk),
            _ => None,
        });
        let uses = |k: &Key| st.uses.get(k).copied().unwrap_or(0);
        match victim {
            Some(vk) if sh.cache_slots > 0 && uses(&key) > uses(&vk) => {
                if let Some(old) = evict_lru(st) {
                    st.free.push(old);
                }
                true
            }
            _ => false,
        }
    };
    if keep {
        st.lru.push_back(slot);
    } else {
        st.keys.remove(&key);
        st.slots[slot] = Slot::Free;
        st.free.push(slot);
    }
    sh.done_cv.notify_all();
}

enum Want {
    /// Pinned and ready to land.
    Ready(usize),
    /// Waiting for a read (a pin is reserved for us at completion).
    Waiting,
    /// No read yet (no slot was free).
    Deferred,
    /// Landed (or abandoned after an error).
    Done,
}

impl ExpertSource for ExpertStore {
    fn layout(&self) -> &ExpertLayout {
        &self.shared.spec.layout
    }

    fn fetch(&self, layer: usize, experts: &[u32], land: &mut dyn FnMut(u32, &[u8])) -> Result<(), StoreError> {
        let sh = &*self.shared;
        let len = sh.spec.layout.len;
        let l = layer as u32;
        let mut wants: Vec<(u32, Want)> = experts.iter().map(|&e| (e, Want::Deferred)).collect();
        {
            let mut st = lock(sh);
            for &e in experts {
                *st.uses.entry((l, e)).or_insert(0) += 1;
            }
        }
        let mut remaining = wants.len();
        let mut started: Vec<u32> = Vec::new();
        let mut last_land: Option<(Instant, u16)> = None;
        let mut error: Option<StoreError> = None;
        let mut first_pass = true;
        while remaining > 0 {
            let mut ready: Vec<(u32, usize, usize)> = Vec::new();
            {
                let mut st = lock(sh);
                loop {
                    let st_ref = &mut *st;
                    for (e, w) in wants.iter_mut() {
                        let key = (l, *e);
                        // Resolve Deferred entries against what other fetches and prefetches did.
                        if let Want::Deferred = w {
                            if error.is_some() {
                                *w = Want::Done;
                                remaining -= 1;
                                continue;
                            }
                            match st_ref.keys.get(&key) {
                                Some(KeyState::Ready { slot }) => {
                                    let slot = *slot;
                                    pin_ready(st_ref, slot);
                                    if first_pass {
                                        st_ref.hits += 1;
                                    }
                                    *w = Want::Ready(slot);
                                }
                                Some(KeyState::Loading { req }) => {
                                    let r = *req;
                                    join_read(st_ref, r);
                                    if first_pass {
                                        st_ref.joins += 1;
                                    }
                                    *w = Want::Waiting;
                                }
                                Some(KeyState::Failed { msg, .. }) => {
                                    error.get_or_insert_with(|| StoreError::NoHolderLeft(msg.clone()));
                                    *w = Want::Done;
                                    remaining -= 1;
                                    continue;
                                }
                                None => {
                                    if first_pass {
                                        st_ref.misses += 1;
                                    }
                                    if let Some(slot) = alloc_slot(st_ref) {
                                        if start_read(sh, st_ref, key, slot, false, &[]) {
                                            if let Some(KeyState::Loading { req }) = st_ref.keys.get(&key) {
                                                let r = *req;
                                                if let Some(q) = st_ref.reqs[r].as_mut() {
                                                    q.waiters += 1;
                                                }
                                            }
                                            started.push(*e);
                                            *w = Want::Waiting;
                                        } else {
                                            st_ref.free.push(slot);
                                            error = Some(no_holder(sh, st_ref, layer, *e));
                                            *w = Want::Done;
                                            remaining -= 1;
                                            continue;
                                        }
                                    }
                                }
                            }
                        }
                        match w {
                            Want::Ready(slot) => {
                                if let Slot::Ready { start, .. } = st_ref.slots[*slot] {
                                    ready.push((*e, *slot, start as usize));
                                }
                                *w = Want::Done;
                                remaining -= 1;
                            }
                            Want::Waiting => match st_ref.keys.get_mut(&key) {
                                Some(KeyState::Ready { slot }) => {
                                    let slot = *slot;
                                    if let Slot::Ready { start, drive, at, .. } = st_ref.slots[slot] {
                                        if started.contains(e) && last_land.is_none_or(|(t, _)| at > t) {
                                            last_land = Some((at, drive));
                                        }
                                        ready.push((*e, slot, start as usize));
                                    }
                                    *w = Want::Done;
                                    remaining -= 1;
                                }
                                Some(KeyState::Failed { msg, waiters }) => {
                                    error.get_or_insert_with(|| StoreError::NoHolderLeft(msg.clone()));
                                    *waiters = waiters.saturating_sub(1);
                                    if *waiters == 0 {
                                        st_ref.keys.remove(&key);
                                    }
                                    *w = Want::Done;
                                    remaining -= 1;
                                }
                                Some(KeyState::Loading { .. }) => {}
                                // The read we joined vanished (cancelled): start over.
                                None => *w = Want::Deferred,
                            },
                            Want::Deferred | Want::Done => {}
                        }
                    }
                    first_pass = false;
                    if !ready.is_empty() || remaining == 0 {
                        break;
                    }
                    st = sh.done_cv.wait(st).unwrap_or_else(|p| p.into_inner());
                }
            }
            // Land outside the lock; the slots stay pinned until unpinned below.
            for &(e, slot, start) in &ready {
                if error.is_none() {
                    // SAFETY: the slot is pinned Ready; no reader writes it until it is unpinned.
                    let bytes = unsafe { sh.slab.slot_bytes(slot, start, len) };
                    land(e, bytes);
                }
                let mut st = lock(sh);
                st.requested += len as u64;
                unpin(sh, &mut st, (l, e), slot);
            }
        }
        if let Some((_, drive)) = last_land {
            lock(sh).drives[drive as usize].counters.lands_last += 1;
        }
        match error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn bytes_requested(&self) -> u64 {
        lock(&self.shared).requested
    }

    fn report(&self) -> SourceReport {
        ExpertStore::report(self)
    }

    fn prefetch(&self, layer: usize, experts: &[u32]) {
        ExpertStore::prefetch(self, layer, experts)
    }

    fn cancel_prefetch(&self, layer: usize, keep: &[u32]) {
        ExpertStore::cancel_prefetch(self, layer, keep)
    }
}

fn no_holder(sh: &Shared, st: &State, layer: usize, e: u32) -> StoreError {
    let failed: Vec<String> = st
        .drives
        .iter()
        .enumerate()
        .filter_map(|(i, d)| {
            d.failed.as_ref().map(|m| format!("drive {i} ({}): {m}", sh.spec.drives[i].root.display()))
        })
        .collect();
    StoreError::NoHolderLeft(format!(
        "expert {e} of layer {layer}: no usable holder{}",
        if failed.is_empty() { String::new() } else { format!(" (failed: {})", failed.join("; ")) }
    ))
}
