//! The read balancer: which holder serves a read, and the queueing of a read on its drive.
//!
//! Contract: a read goes to the usable holder (drive not failed, not excluded, files open) with the
//! earliest expected completion (bytes queued on its drive plus this read, over the drive's rate),
//! primary holders before fallback ones; an expert is read whole from one drive; a read already in
//! flight is joined, never issued twice. Runs under the store's lock.

use super::*;

/// The usable holder of `key` with the earliest expected completion, avoiding failed drives and
/// `exclude`; primary holders before fallback ones.
pub(super) fn choose_holder(sh: &Shared, st: &State, key: Key, exclude: &[u16]) -> Option<Holder> {
    let holders = sh.spec.holders.get(key.0 as usize)?.as_ref()?.get(key.1 as usize)?;
    let len = sh.spec.layout.len as f64;
    let open = |f: u32| sh.files.get(f as usize).is_some_and(|f| f.is_some());
    let usable = |h: &&Holder| {
        st.drives[h.drive as usize].failed.is_none()
            && !exclude.contains(&h.drive)
            && open(h.file)
            && h.extents.as_ref().is_none_or(|xs| xs.iter().all(|x| open(x.file)))
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
    let Some(h) = choose_holder(sh, st, key, exclude) else { return false };
    let len = sh.spec.layout.len as u64;
    let pieces: Vec<HolderExtent> = match &h.extents {
        None => vec![HolderExtent { file: h.file, offset: h.offset, len, dest: 0 }],
        Some(xs) => xs.to_vec(),
    };
    let mut parts = Vec::with_capacity(pieces.len());
    let mut pos = 0u64;
    for x in &pieces {
        let Some(file) = sh.files[x.file as usize].as_ref() else { return false };
        let (offset, op_len, skip) = if file.direct { widen(x.offset, x.len) } else { (x.offset, x.len, 0) };
        parts.push(Part { file: x.file, offset, op_len, skip, pos, dest: x.dest, len: x.len });
        pos += op_len.div_ceil(4096) * 4096;
    }
    // One piece stays where it lands; several are assembled at the start of the slot.
    let start = if parts.len() == 1 { parts[0].skip } else { 0 };
    let op_len: u64 = parts.iter().map(|p| p.op_len).sum();
    let n_parts = parts.len();
    let req = Req {
        key,
        slot,
        drive: h.drive,
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
        if q.submitted.is_none() {
            let dr = &mut st.drives[q.drive as usize];
            dr.prefetch.retain(|&x| x != r);
            dr.demand.push_back(r);
        }
    }
}
