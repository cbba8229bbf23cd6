//! The read balancer: which holder serves a read, and the queueing of a read on its drive.
//!
//! Contract: a read goes to the usable holder (drive not failed, not excluded, files open, not
//! waiting out a backoff after a failure: `heal`) with the
//! earliest expected completion (bytes queued on its drive plus this read, over the drive's rate),
//! primary holders before fallback ones; a demanded read with copies on several drives is split
//! across them (`split`); a read already in flight is joined, never issued twice. Runs under the
//! store's lock.

use super::*;

/// The usable holder of `key` with the earliest expected completion, avoiding failed drives and
/// `exclude`; primary holders before fallback ones.
pub(super) fn choose_holder(sh: &Shared, st: &State, key: Key, exclude: &[u16]) -> Option<Holder> {
    let holders = sh.spec.holders.get(key.0 as usize)?.as_ref()?.get(key.1 as usize)?;
    let len = sh.spec.layout.len as f64;
    let open = |f: u32| sh.files.get(f as usize).is_some_and(|f| f.is_some());
    let now = Instant::now();
    let usable = |h: &&Holder| {
        st.drives[h.drive as usize].failed.is_none()
            && !exclude.contains(&h.drive)
            && open(h.file)
            && h.extents.as_ref().is_none_or(|xs| xs.iter().all(|x| open(x.file)))
            && !st.suspects.holds_back(key, h, now)
    };
    let best_tier = holders.iter().filter(usable).map(|h| h.tier).min()?;
    holders.iter().filter(usable).filter(|h| h.tier == best_tier).cloned().min_by(|a, b| {
        let cost = |h: &Holder| {
            let d = &st.drives[h.drive as usize];
            (d.queued_bytes as f64 + len) / d.rate
        };
        cost(a).total_cmp(&cost(b)).then(a.drive.cmp(&b.drive))
    })
}

/// Queues a read of `key` into `slot`; false if no holder is usable (then nothing changed).
pub(super) fn start_read(sh: &Shared, st: &mut State, key: Key, slot: usize, prefetch: bool, exclude: &[u16]) -> bool {
    start_read_as(sh, st, key, slot, prefetch, exclude, false)
}

/// [`start_read`]; `whole`: from one drive, never split or moved (a demanded read is split across
/// the drives holding it otherwise, see `split`).
pub(super) fn start_read_as(
    sh: &Shared,
    st: &mut State,
    key: Key,
    slot: usize,
    prefetch: bool,
    exclude: &[u16],
    whole: bool,
) -> bool {
    let Some(h) = choose_holder(sh, st, key, exclude) else { return false };
    st.suspects.before_probe(sh, &h);
    let len = sh.spec.layout.len as u64;
    let split = if prefetch || whole { None } else { split::plan(sh, st, key, exclude, &h) };
    let movable = !whole && sh.split_min.is_some() && split::movable(sh, &h);
    let parts = match split {
        Some(parts) => parts,
        None => {
            let pieces: Vec<HolderExtent> = match &h.extents {
                None => vec![HolderExtent { file: h.file, offset: h.offset, len, dest: 0 }],
                Some(xs) => xs.to_vec(),
            };
            let mut parts = Vec::with_capacity(pieces.len());
            let mut pos = 0u64;
            for x in &pieces {
                let Some(file) = sh.files[x.file as usize].as_ref() else { return false };
                let (offset, op_len, skip) = if file.direct { widen(x.offset, x.len) } else { (x.offset, x.len, 0) };
                let (drive, at, due, done) = (h.drive, None, None, false);
                parts.push(Part {
                    drive,
                    at,
                    due,
                    done,
                    file: x.file,
                    offset,
                    op_len,
                    skip,
                    pos,
                    dest: x.dest,
                    len: x.len,
                });
                pos += op_len.div_ceil(4096) * 4096;
            }
            parts
        }
    };
    // One piece stays where it lands; several are assembled at the start of the slot.
    let start = if parts.len() == 1 { parts[0].skip } else { 0 };
    let op_len: u64 = parts.iter().map(|p| p.op_len).sum();
    let n_parts = parts.len();
    let req = Req {
        key,
        slot,
        drive: parts[0].drive,
        tried: exclude.to_vec(),
        prefetch,
        sure: false,
        waiters: 0,
        submitted: None,
        op_len,
        start: start as u32,
        parts,
        parts_left: n_parts,
        part_error: None,
        bytes_got: 0,
        movable,
        poison: false,
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
    for i in 0..n_parts {
        let Some(p) = st.reqs[r].as_ref().map(|q| q.parts[i]) else { continue };
        let d = &mut st.drives[p.drive as usize];
        d.queued_bytes += p.op_len;
        if prefetch {
            d.prefetch.push_back(tag(r, i));
        } else {
            d.demand.push_back(tag(r, i));
        }
        sh.drive_cv[p.drive as usize].notify_one();
    }
    st.slots[slot] = Slot::Loading;
    st.keys.insert(key, KeyState::Loading { req: r });
    true
}

/// Moves request `r`'s queued parts between a drive's prefetch and demand queues.
pub(super) fn requeue(st: &mut State, r: usize, to_demand: bool) {
    let Some(q) = st.reqs[r].as_ref() else { return };
    for (i, p) in q.parts.iter().enumerate() {
        if p.at.is_some() || p.done {
            continue;
        }
        let dr = &mut st.drives[p.drive as usize];
        let t = tag(r, i);
        dr.prefetch.retain(|&x| x != t);
        dr.demand.retain(|&x| x != t);
        if to_demand {
            dr.demand.push_back(t);
        } else {
            dr.prefetch.push_back(t);
        }
    }
}

/// Adds a waiter to the read in flight for `key` (promoting a prefetch to a demanded read).
pub(super) fn join_read(st: &mut State, r: usize) {
    let Some(q) = st.reqs[r].as_mut() else { return };
    q.waiters += 1;
    if q.sure {
        q.sure = false;
        st.prefetch_used += 1;
    }
    if q.prefetch {
        q.prefetch = false;
        st.prefetch_used += 1;
        st.prefetch_outstanding = st.prefetch_outstanding.saturating_sub(1);
        requeue(st, r, true);
    }
}
