//! Hedged reads: a demanded read that is late on its drive is issued again on another drive that
//! holds a copy of the expert; whichever copy lands first (its bytes checked as any read's) is
//! used, the other is dropped from its queue or, once submitted, ignored and its slot freed when
//! it completes.
//!
//! Contract:
//! - A read is late once it has been in flight longer than its drive's learned p95 read time
//!   (after [`MIN_SAMPLES`] reads of that drive, at most 4 medians, never below [`FLOOR`]). The fetch waiting on it
//!   checks whenever anything lands and wakes at the earliest deadline, so a late read is hedged
//!   whether or not the layer's other reads have landed (once they have, it is the only one left).
//!   Hedging the last read of every layer merely for being last would re-read the tail of every
//!   layer on an even ladder; the learned p95 keeps the extra reads near 5% of a drive's reads.
//! - Only demanded reads that are submitted are hedged, each at most once, onto a drive that has
//!   not failed for it, into a free slot only (a hedge never evicts a cached expert).
//! - The copy that lands first completes the expert for every waiter; a failed copy while its twin
//!   is still reading hands the waiters to the twin (no retry); with no twin left, failover is as
//!   before. Output bits cannot depend on which copy won: both hold the same checked bytes.
//! - Counted: `hedged_reads` (second reads issued), `hedge_wins` (the second read landed first).
//!
//! Everything here runs under the store's lock.

use super::*;
use std::collections::HashSet;

/// Reads of a drive before its p95 is trusted as the hedging deadline.
pub(super) const MIN_SAMPLES: u64 = 16;
/// No read is late before this (a very fast drive's p95 would hedge on noise).
pub(super) const FLOOR: Duration = Duration::from_millis(5);
/// The deadline is at most this many medians: a straggling spell long enough to fill a drive's
/// tail (5% of its reads) must not teach the store to wait for it; the median stays put until
/// half of the drive's reads are slow.
const MEDIANS: f64 = 4.0;

/// Hedge bookkeeping, by request index.
#[derive(Default)]
pub(super) struct Hedges {
    /// Each hedged read's twin (both directions).
    twin: HashMap<usize, usize>,
    /// Reads whose twin landed first: their bytes are not used, their slot is freed on completion.
    lost: HashSet<usize>,
    /// Reads already hedged or without another usable copy: not considered again.
    done: HashSet<usize>,
    pub issued: u64,
    pub wins: u64,
    /// Per drive, an injected delay before each batch of completions is handled (tests, drills).
    pub delay: Vec<Option<Duration>>,
}

impl Hedges {
    pub(super) fn new(drives: usize) -> Self {
        Hedges { delay: vec![None; drives], ..Default::default() }
    }

    /// Forgets request `r` (its index is about to be reused); returns (its twin if still linked,
    /// whether it had lost to that twin).
    pub(super) fn forget(&mut self, r: usize) -> (Option<usize>, bool) {
        let twin = self.twin.remove(&r);
        if let Some(t) = twin {
            self.twin.remove(&t);
        }
        self.done.remove(&r);
        (twin, self.lost.remove(&r))
    }
}

/// The age after which a read on drive `d` is late, once the drive has enough reads to say.
fn deadline(st: &State, d: u16) -> Option<Duration> {
    let c = &st.drives[d as usize].counters;
    if c.reads < MIN_SAMPLES {
        return None;
    }
    let p95 = c.latency.quantile_ms(0.95)?;
    let p50 = c.latency.quantile_ms(0.5)?;
    Some(Duration::from_secs_f64(p95.min(MEDIANS * p50) / 1000.0).max(FLOOR))
}

/// Hedges the reads of `waiting` (experts of `layer` this fetch waits for) that are late; returns
/// how long until the next one becomes late, if any may.
pub(super) fn hedge_late(sh: &Shared, st: &mut State, layer: u32, waiting: &[u32]) -> Option<Duration> {
    let now = Instant::now();
    let mut next: Option<Duration> = None;
    for &e in waiting {
        let key = (layer, e);
        let Some(KeyState::Loading { req }) = st.keys.get(&key) else { continue };
        let r = *req;
        if st.hedges.twin.contains_key(&r) || st.hedges.done.contains(&r) {
            continue;
        }
        let Some(q) = st.reqs[r].as_ref() else { continue };
        let (Some(t0), Some(late)) = (q.submitted, deadline(st, q.drive)) else { continue };
        let age = now.saturating_duration_since(t0);
        if age < late {
            next = Some(next.map_or(late - age, |n| n.min(late - age)));
            continue;
        }
        start_hedge(sh, st, key, r);
    }
    next
}

/// Issues a second read of `key` (whose read `r` is late) on another drive, at the front of its
/// queue. Without another usable copy, `r` is marked done; without a free slot, nothing happens
/// (the next wake-up tries again).
fn start_hedge(sh: &Shared, st: &mut State, key: Key, r: usize) {
    let Some(q) = st.reqs[r].as_ref() else { return };
    let mut exclude = q.tried.clone();
    exclude.push(q.drive);
    if choose_holder(sh, st, key, &exclude).is_none() {
        st.hedges.done.insert(r);
        return;
    }
    let Some(slot) = st.free.pop() else { return };
    // start_read makes the new read the key's read; the late one stays it (waiters join it).
    if !start_read(sh, st, key, slot, false, &exclude) {
        st.free.push(slot);
        st.keys.insert(key, KeyState::Loading { req: r });
        st.hedges.done.insert(r);
        return;
    }
    let Some(KeyState::Loading { req: h }) = st.keys.insert(key, KeyState::Loading { req: r }) else { return };
    if let Some(hq) = st.reqs[h].as_ref() {
        let dr = &mut st.drives[hq.drive as usize];
        dr.demand.retain(|&x| x != h);
        dr.demand.push_front(h);
    }
    st.hedges.twin.insert(r, h);
    st.hedges.twin.insert(h, r);
    st.hedges.done.insert(r);
    st.hedges.done.insert(h);
    st.hedges.issued += 1;
}

/// Drops request `t`, whose twin just landed: unsubmitted, it leaves its queue and frees its slot
/// now; in flight, it is marked lost and its completion frees the slot.
pub(super) fn abandon(sh: &Shared, st: &mut State, t: usize) {
    let Some(q) = st.reqs[t].as_ref() else { return };
    if q.submitted.is_some() {
        st.hedges.lost.insert(t);
        return;
    }
    let (d, slot, len) = (q.drive as usize, q.slot, q.op_len);
    st.hedges.forget(t);
    let dr = &mut st.drives[d];
    dr.demand.retain(|&x| x != t);
    dr.prefetch.retain(|&x| x != t);
    dr.queued_bytes = dr.queued_bytes.saturating_sub(len);
    st.reqs[t] = None;
    st.free_reqs.push(t);
    st.slots[slot] = Slot::Free;
    st.free.push(slot);
    sh.done_cv.notify_all();
}

/// A hedged read `req` (index `r`) failed while its twin `t` still reads: the twin becomes the
/// key's read and takes over its waiters. The caller frees or poisons `req`'s slot.
pub(super) fn hand_over(st: &mut State, req: &Req, r: usize, t: usize) {
    let key = req.key;
    if matches!(st.keys.get(&key), Some(KeyState::Loading { req }) if *req == r) {
        st.keys.insert(key, KeyState::Loading { req: t });
        if let Some(tq) = st.reqs[t].as_mut() {
            tq.waiters += req.waiters;
        }
    }
}
