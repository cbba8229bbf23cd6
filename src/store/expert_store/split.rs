//! Split reads, work stealing and the drives' rates: what makes a layer's reads finish on every
//! drive at the same moment.
//!
//! Contract:
//! - A demanded expert with whole-range copies on several drives (the best usable tier, the same
//!   offset within a 4 KiB page, files read with O_DIRECT) is read as contiguous page-aligned
//!   byte ranges, one per drive, sized by water-filling: each drive's queue (bytes queued or in
//!   flight over its rate) plus its range ends at the same moment. A range below the store's
//!   `split_min` is given to the other drives; one drive left reads the expert whole. The ranges
//!   land in place in one slot and the expert is checked whole, as any read.
//! - A drive with room and no demanded read queued takes the last queued demanded part of the
//!   drive that would finish latest, when the expert has a copy on it at the same page offset and
//!   it would land that part sooner than its drive would (by their queues and rates).
//! - A drive's rate is bytes over busy time of its last [`RATE_SAMPLES`] completed parts: each
//!   part counts the time since the later of its submission and the drive's previous completion,
//!   so overlapping reads are not counted twice and idle time not at all.
//!
//! Runs under the store's lock.

use super::*;

/// The engine's smallest range of a split read: below ~1 MiB a read's fixed cost starts to show.
pub const SPLIT_MIN: u64 = 1 << 20;
/// Completions a drive's rate is measured over (at ~4 MB parts, about a second of a slow drive).
const RATE_SAMPLES: usize = 12;
/// Completions before the measured rate replaces the placement's.
const RATE_MIN_SAMPLES: usize = 3;
const PAGE: u64 = 4096;

/// A drive's last completions: (bytes, busy seconds).
#[derive(Default)]
pub(super) struct Rate {
    samples: VecDeque<(u64, f64)>,
}

impl Rate {
    /// Counts a completed read; the drive's rate once enough reads say.
    pub(super) fn record(&mut self, bytes: u64, busy_s: f64) -> Option<f64> {
        self.samples.push_back((bytes, busy_s.max(1e-6)));
        if self.samples.len() > RATE_SAMPLES {
            self.samples.pop_front();
        }
        if self.samples.len() < RATE_MIN_SAMPLES {
            return None;
        }
        let (b, t) = self.samples.iter().fold((0u64, 0f64), |(b, t), &(x, y)| (b + x, t + y));
        Some(b as f64 / t)
    }
}

/// Seconds until drive `d` has read everything queued on it (and `more` bytes after).
pub(super) fn drain_s(st: &State, d: usize, more: u64) -> f64 {
    let dr = &st.drives[d];
    (dr.queued_bytes + more) as f64 / dr.rate
}

/// The holder of `key` on drive `d` a part of a read at page offset `page_off` can move to.
fn holder_on(sh: &Shared, st: &State, key: Key, d: u16, page_off: u64, tier: u8) -> Option<Holder> {
    let holders = sh.spec.holders.get(key.0 as usize)?.as_ref()?.get(key.1 as usize)?;
    holders
        .iter()
        .find(|h| {
            h.drive == d
                && h.tier == tier
                && h.extents.is_none()
                && h.offset % PAGE == page_off
                && st.drives[d as usize].failed.is_none()
                && !st.suspects.holds_back(key, h, Instant::now())
                && sh.files.get(h.file as usize).and_then(|f| f.as_ref()).is_some_and(|f| f.direct)
        })
        .cloned()
}

/// Whether a read from `h` can be split or moved: one range of a file read with O_DIRECT.
pub(super) fn movable(sh: &Shared, h: &Holder) -> bool {
    h.extents.is_none() && sh.files.get(h.file as usize).and_then(|f| f.as_ref()).is_some_and(|f| f.direct)
}

/// The parts of a demanded read of `key` split across the drives holding it, `h` (the balancer's
/// pick) among them; None when it is read whole (one drive, or ranges too small).
pub(super) fn plan(sh: &Shared, st: &State, key: Key, exclude: &[u16], h: &Holder) -> Option<Vec<Part>> {
    let min = sh.split_min?;
    if !movable(sh, h) {
        return None;
    }
    let len = sh.spec.layout.len as u64;
    let s0 = h.offset % PAGE;
    let holders = sh.spec.holders.get(key.0 as usize)?.as_ref()?.get(key.1 as usize)?;
    let mut cands: Vec<Holder> = Vec::new();
    for x in holders {
        if !exclude.contains(&x.drive)
            && !cands.iter().any(|c| c.drive == x.drive)
            && holder_on(sh, st, key, x.drive, s0, h.tier).is_some_and(|y| y.file == x.file && y.offset == x.offset)
        {
            cands.push(x.clone());
        }
    }
    if cands.len() < 2 {
        return None;
    }
    // Water-filling: drop the drive with the smallest share until every share reaches `min`.
    let shares = loop {
        let mut by_drain: Vec<(f64, f64, usize)> = cands
            .iter()
            .enumerate()
            .map(|(i, c)| (drain_s(st, c.drive as usize, 0), st.drives[c.drive as usize].rate, i))
            .collect();
        by_drain.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (mut sum_tr, mut sum_r, mut t) = (0.0, 0.0, 0.0);
        for (k, &(ti, ri, _)) in by_drain.iter().enumerate() {
            sum_tr += ti * ri;
            sum_r += ri;
            t = (len as f64 + sum_tr) / sum_r;
            if by_drain.get(k + 1).is_none_or(|n| t <= n.0) {
                break;
            }
        }
        let mut shares: Vec<(usize, f64)> = by_drain.iter().map(|&(ti, ri, i)| (i, ((t - ti) * ri).max(0.0))).collect();
        shares.sort_by_key(|s| s.0);
        match shares.iter().min_by(|a, b| a.1.total_cmp(&b.1)) {
            Some(&(i, s)) if (s as u64) < min && cands.len() > 2 => {
                cands.remove(i);
            }
            Some(&(_, s)) if (s as u64) < min => return None,
            _ => break shares,
        }
    };
    // Page-aligned boundaries in the slot (whose image starts s0 into its first page).
    let end = (s0 + len).div_ceil(PAGE) * PAGE;
    let mut bounds = vec![0u64];
    let mut acc = 0.0;
    for &(_, s) in &shares[..shares.len() - 1] {
        acc += s;
        let b = ((s0 as f64 + acc) / PAGE as f64).round() as u64 * PAGE;
        if b <= *bounds.last()? || b >= end {
            return None;
        }
        bounds.push(b);
    }
    bounds.push(end);
    let parts = cands
        .iter()
        .zip(bounds.windows(2))
        .map(|(c, w)| {
            let (x0, x1) = (w[0], w[1]);
            let (from, to) = (x0.max(s0), x1.min(s0 + len));
            Part {
                drive: c.drive,
                at: None,
                due: None,
                done: false,
                file: c.file,
                offset: c.offset / PAGE * PAGE + x0,
                op_len: x1 - x0,
                skip: from - x0,
                pos: x0,
                dest: from - s0,
                len: to - from,
            }
        })
        .collect();
    Some(parts)
}

/// Drive `d` is idle of demanded reads: moves to it the last queued demanded part of the drive
/// that would finish latest, if `d` lands it sooner. Returns the part's tag (queued on `d`).
pub(super) fn steal(sh: &Shared, st: &mut State, d: usize) -> Option<usize> {
    sh.split_min?;
    let mut best: Option<(f64, usize, usize)> = None;
    for (e, dr) in st.drives.iter().enumerate() {
        if e == d || dr.failed.is_some() {
            continue;
        }
        let Some(&t) = dr.demand.back() else { continue };
        let (r, i) = untag(t);
        let Some(q) = st.reqs[r].as_ref().filter(|q| q.movable && !q.tried.contains(&(d as u16))) else { continue };
        let Some(p) = q.parts.get(i).filter(|p| p.at.is_none() && !p.done) else { continue };
        let theirs = drain_s(st, e, 0);
        let ours = drain_s(st, d, p.op_len);
        if ours < theirs && best.is_none_or(|b| theirs > b.0) {
            best = Some((theirs, e, t));
        }
    }
    let (_, e, t) = best?;
    let (r, i) = untag(t);
    let q = st.reqs[r].as_ref()?;
    let p = q.parts[i];
    // The part keeps its place in the slot: the copy on `d` must sit at the same page offset.
    let holders = sh.spec.holders.get(q.key.0 as usize)?.as_ref()?.get(q.key.1 as usize)?;
    let old = holders.iter().find(|x| x.drive == p.drive && x.file == p.file)?;
    let h = holder_on(sh, st, q.key, d as u16, old.offset % PAGE, old.tier)?;
    st.drives[e].demand.pop_back();
    st.drives[e].queued_bytes = st.drives[e].queued_bytes.saturating_sub(p.op_len);
    st.drives[d].queued_bytes += p.op_len;
    let part = &mut st.reqs[r].as_mut()?.parts[i];
    part.drive = d as u16;
    part.file = h.file;
    part.offset = h.offset / PAGE * PAGE + part.pos;
    Some(t)
}
