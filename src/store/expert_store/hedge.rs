//! Hedged reads: a demanded read that is late on its drive is issued again on other drives that
//! hold a copy of the expert; whichever copy lands first (its bytes checked as any read's) is
//! used, the other is dropped from its queues or, once submitted, ignored and its slot freed when
//! its parts complete.
//!
//! Contract:
//! - A read (any of its parts, for a split read) is late once it has been in flight longer than
//!   its drive's learned p95 read time (after [`MIN_SAMPLES`] reads of that drive, at most 4
//!   medians, never below [`FLOOR`]), or once it is overdue while drives holding a copy are idle
//!   (the layer's other reads there have landed): past when its drive's queue and rate said it
//!   would land by more than a quarter of that time and more than the idle drives would take to
//!   read the expert again. The fetch waiting on it checks whenever anything lands and wakes at
//!   the earliest deadline. An even ladder's last reads land about when due, so they are not
//!   re-read merely for being last.
//! - The second read excludes the late drives and goes where it lands first (by the drives'
//!   queues and rates; split across several where it can be), at the front of their queues.
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
/// A part is overdue this fraction of its expected time past its due time (see `hedge_late`).
const DUE_SLACK: f64 = 0.25;

/// Hedge bookkeeping, by request index.
#[derive(Default)]
pub(super) struct Hedges {
    /// Each hedged read's twin (both directions).
    twin: HashMap<usize, usize>,
    /// Reads whose twin landed first: their bytes are not used, their slot is freed on completion.
    pub(super) lost: HashSet<usize>,
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
/// how long until the next one may become late.
pub(super) fn hedge_late(sh: &Shared, st: &mut State, layer: u32, waiting: &[u32]) -> Option<Duration> {
    let now = Instant::now();
    let mut next: Option<Duration> = None;
    let mut soon = |d: Duration| next = Some(next.map_or(d, |n: Duration| n.min(d)));
    for &e in waiting {
        let key = (layer, e);
        let Some(KeyState::Loading { req }) = st.keys.get(&key) else { continue };
        let r = *req;
        if st.hedges.twin.contains_key(&r) || st.hedges.done.contains(&r) {
            continue;
        }
        let Some(q) = st.reqs[r].as_ref() else { continue };
        // Idle drives holding a copy (the layer's other reads there have landed): how long they
        // would take to read the expert again, split across them.
        let holders = sh.spec.holders.get(layer as usize).and_then(|h| h.as_ref()).and_then(|h| h.get(e as usize));
        let reread = |busy: u16| {
            let idle_rate: f64 = holders
                .iter()
                .flat_map(|hs| hs.iter())
                .filter(|h| {
                    let dr = &st.drives[h.drive as usize];
                    h.drive != busy && !q.tried.contains(&h.drive) && dr.failed.is_none() && dr.queued_bytes == 0
                })
                .map(|h| st.drives[h.drive as usize].rate)
                .sum();
            (idle_rate > 0.0).then(|| Duration::from_secs_f64(sh.spec.layout.len as f64 / idle_rate))
        };
        let mut late: Vec<u16> = Vec::new();
        for p in q.parts.iter().filter(|p| !p.done) {
            let (Some(t0), Some(due)) = (p.at, p.due) else { continue };
            // Only onto idle copies: a hedge must not queue ahead of the layer's other reads.
            let Some(again) = reread(p.drive) else { continue };
            // In flight past its drive's learned p95, or overdue (past when its drive's queue and
            // rate said it would land) -- either by longer than a read of the copies would take.
            let by_p95 = deadline(st, p.drive).map(|l| t0 + l.max(again));
            let by_due = due + (due - t0).mul_f64(DUE_SLACK).max(FLOOR).max(again);
            let when = by_p95.map_or(by_due, |t| t.min(by_due));
            if now >= when {
                late.push(p.drive);
            } else {
                soon(when - now);
            }
        }
        if !late.is_empty() {
            start_hedge(sh, st, key, r, &late);
        }
    }
    next
}

/// Issues a second read of `key` (whose read `r` is late on the drives `late`) on the other
/// drives, at the front of their queues (split across them where it can be). Without another
/// usable copy, `r` is marked done; without a free slot, nothing happens (the next wake-up tries
/// again).
fn start_hedge(sh: &Shared, st: &mut State, key: Key, r: usize, late: &[u16]) {
    let Some(q) = st.reqs[r].as_ref() else { return };
    let mut exclude = q.tried.clone();
    exclude.extend_from_slice(late);
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
        for (i, p) in hq.parts.iter().enumerate() {
            let dr = &mut st.drives[p.drive as usize];
            dr.demand.retain(|&x| x != tag(h, i));
            dr.demand.push_front(tag(h, i));
        }
    }
    st.hedges.twin.insert(r, h);
    st.hedges.twin.insert(h, r);
    st.hedges.done.insert(r);
    st.hedges.done.insert(h);
    st.hedges.issued += 1;
}

/// Drops request `t`, whose twin just landed: its queued parts leave their queues now; with none
/// in flight its slot is freed now, else it is marked lost and its last completion frees the slot.
pub(super) fn abandon(sh: &Shared, st: &mut State, t: usize) {
    let Some(q) = st.reqs[t].as_mut() else { return };
    let mut dropped = 0;
    for (i, p) in q.parts.iter_mut().enumerate().filter(|(_, p)| p.at.is_none() && !p.done) {
        p.done = true;
        dropped += 1;
        let dr = &mut st.drives[p.drive as usize];
        dr.demand.retain(|&x| x != tag(t, i));
        dr.prefetch.retain(|&x| x != tag(t, i));
        dr.queued_bytes = dr.queued_bytes.saturating_sub(p.op_len);
    }
    q.parts_left = q.parts_left.saturating_sub(dropped);
    if q.parts_left > 0 {
        st.hedges.lost.insert(t);
        return;
    }
    let slot = q.slot;
    st.hedges.forget(t);
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
