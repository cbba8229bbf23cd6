//! The reader thread of each drive: takes queued reads (demanded first, prefetches only into idle
//! capacity), submits them to the drive's reader, verifies each completion (length, checksum) and
//! publishes it — or fails over to another holder, poisoning slots a dead reader may still write.

use super::*;

/// The reader thread of drive `d`.
pub(super) fn drive_loop(sh: Arc<Shared>, d: usize, mut reader: Box<dyn crate::store::io::reader::DriveIo>) {
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
                let on_d =
                    |q: &Req| q.parts.iter().filter(|p| p.drive as usize == d && p.at.is_some() && !p.done).count();
                let prefetch_in_flight: usize = st_ref.reqs.iter().flatten().filter(|q| q.prefetch).map(on_d).sum();
                while in_flight + batch.len() < qd {
                    // Demanded parts first, then one taken off a drive that would land it later;
                    // prefetch only into idle capacity, never while a demanded read waits.
                    let t = match st_ref.drives[d].demand.pop_front() {
                        Some(t) => t,
                        None => match split::steal(&sh, st_ref, d) {
                            Some(t) => t,
                            None if prefetch_in_flight + batch.len() < sh.prefetch_depth => {
                                match st_ref.drives[d].prefetch.pop_front() {
                                    Some(t) => t,
                                    None => break,
                                }
                            }
                            None => break,
                        },
                    };
                    let (r, i) = untag(t);
                    let (rate, ahead) = (st_ref.drives[d].rate, st_ref.drives[d].flight_bytes);
                    let Some(req) = st_ref.reqs[r].as_mut() else { continue };
                    let slot = req.slot;
                    let Some(p) = req.parts.get_mut(i).filter(|p| p.at.is_none() && !p.done && p.drive as usize == d)
                    else {
                        continue;
                    };
                    let now = Instant::now();
                    p.at = Some(now);
                    p.due = Some(now + Duration::from_secs_f64((ahead + p.op_len) as f64 / rate));
                    let p = *p;
                    req.submitted.get_or_insert(now);
                    st_ref.drives[d].in_flight += 1;
                    st_ref.drives[d].flight_bytes += p.op_len;
                    if let Some(log) = st_ref.read_log.as_mut() {
                        log.push((p.file, p.offset, p.op_len));
                    }
                    // SAFETY: pos + op_len lies inside the slot (slot_size_for counts every piece).
                    let buf = unsafe { sh.slab.slot_ptr(slot).add(p.pos as usize) };
                    batch.push(ReadOp {
                        tag: t as u64,
                        file: p.file,
                        offset: p.offset,
                        len: p.op_len as usize,
                        buf,
                        buf_index: u16::try_from(slot).ok(),
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
        // An emulated slow drive (tests, drills): its completions arrive late (slept unlocked).
        let delay = if done.is_empty() { None } else { lock(&sh).hedges.delay.get(d).copied().flatten() };
        if let Some(delay) = delay {
            std::thread::sleep(delay);
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
    tracing::warn!("drive {d} ({}): {msg}; avoiding this drive", sh.spec.drives[d].root.display());
    st.drives[d].failed = Some(msg.to_string());
    st.drives[d].counters.failures += 1;
    let here = |p: &Part| p.drive as usize == d && !p.done;
    let mine: Vec<usize> =
        (0..st.reqs.len()).filter(|&r| st.reqs[r].as_ref().is_some_and(|q| q.parts.iter().any(here))).collect();
    st.drives[d].demand.clear();
    st.drives[d].prefetch.clear();
    for r in mine {
        let Some(q) = st.reqs[r].as_mut() else { continue };
        if q.parts.iter().any(|p| p.drive as usize != d && !p.done) {
            // A split read with parts on other drives: it fails (and is retried) once they land;
            // a part lost in flight here may still write its slot.
            q.poison |= q.parts.iter().any(|p| here(p) && p.at.is_some());
            let lost = q.parts.iter().filter(|p| here(p)).count();
            q.parts.iter_mut().filter(|p| here(p)).for_each(|p| p.done = true);
            q.parts_left = q.parts_left.saturating_sub(lost);
            q.part_error.get_or_insert((d as u16, None, msg.to_string()));
            continue;
        }
        let in_flight_here = q.parts.iter().any(|p| here(p) && p.at.is_some());
        let Some(req) = st.reqs[r].take() else { continue };
        st.free_reqs.push(r);
        let (twin, lost) = st.hedges.forget(r);
        let twin = twin.filter(|&t| st.reqs[t].is_some());
        if lost || twin.is_some() {
            // A hedged read: the other copy serves (or served) the expert.
            if let Some(t) = twin.filter(|_| !lost) {
                hedge::hand_over(st, &req, r, t);
            }
            st.slots[req.slot] = if in_flight_here || req.poison { Slot::Poisoned } else { Slot::Free };
            if !(in_flight_here || req.poison) {
                st.free.push(req.slot);
            }
            continue;
        }
        let mut slot = req.slot;
        if in_flight_here || req.poison {
            st.slots[slot] = Slot::Poisoned;
            match alloc_slot(st) {
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
        retry_or_fail(sh, st, req, slot, d, true, msg);
    }
    sh.done_cv.notify_all();
}

/// Retries `req` on another holder (into `slot`), or marks its key failed. `blame`: drive `d`
/// failed it and is not tried again; otherwise (a split read whose checksum failed: no one drive
/// to blame) it is read again whole from one drive.
fn retry_or_fail(sh: &Shared, st: &mut State, req: Req, slot: usize, d: usize, blame: bool, msg: &str) {
    let mut tried = req.tried.clone();
    if blame {
        tried.push(d as u16);
    }
    let prefetch = req.prefetch && req.waiters == 0;
    if start_read_as(sh, st, req.key, slot, prefetch, &tried, !blame) {
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

/// A read whose last part has landed: what its checks need.
struct Finished {
    r: usize,
    key: Key,
    slot: usize,
    start: usize,
    /// Its parts (none when its hedged twin landed first: nothing to check).
    parts: Vec<Part>,
    /// The first failure of a part: (drive, file, message).
    error: Option<(u16, Option<u32>, String)>,
    bytes_got: u64,
}

/// Who failed a read: the drive (None: no one drive read every part), the file (None: this copy
/// of the expert), and why.
type Blame = (Option<u16>, Option<u32>, String);

/// A finished read taken out of the table, with its hedged twin (if one is still running), whether
/// it lost to that twin, and whether it is the key's read (the one holding the waiters).
struct Taken {
    req: Req,
    twin: Option<usize>,
    lost: bool,
    primary: bool,
    now: Instant,
}

/// Checks a finished part; with the request's last part, checks the expert and moves it to Ready,
/// or fails over.
fn complete(sh: &Shared, d: usize, c: Done) {
    let Some(f) = record_part(sh, d, c) else { return };
    assemble(sh, &f);
    let (verdict, files) = verify(sh, &f);
    let now = Instant::now();
    let mut st = lock(sh);
    let st = &mut *st;
    let Some(req) = st.reqs[f.r].take() else { return };
    st.free_reqs.push(f.r);
    let (twin, lost) = st.hedges.forget(f.r);
    let twin = twin.filter(|&t| st.reqs[t].is_some());
    if req.prefetch {
        st.prefetch_outstanding = st.prefetch_outstanding.saturating_sub(1);
    }
    // The key's read (the first one issued) holds the waiters; a hedge that wins takes them.
    let primary = matches!(st.keys.get(&f.key), Some(KeyState::Loading { req }) if *req == f.r);
    let taken = Taken { req, twin, lost, primary, now };
    match verdict {
        Ok(_) => publish(sh, st, d, &f, taken, &files),
        Err(blame) => fail_over(sh, st, &f, taken, blame),
    }
    sh.done_cv.notify_all();
}

/// Counts part `c` of a read on drive `d` (an injected fault applied) under the lock; with the
/// read's last part, the read as it finished (None before, or when it is gone).
fn record_part(sh: &Shared, d: usize, c: Done) -> Option<Finished> {
    let (r, part) = untag(c.tag as usize);
    let mut st = lock(sh);
    let fault = st.faults.iter_mut().find(|f| f.drive == d && f.times > 0).and_then(|f| {
        if f.skip > 0 {
            f.skip -= 1;
            None
        } else {
            f.times -= 1;
            Some(f.kind)
        }
    });
    let st = &mut *st;
    let now = Instant::now();
    let dr = &mut st.drives[d];
    dr.in_flight = dr.in_flight.saturating_sub(1);
    let req = st.reqs[r].as_mut()?;
    let p = req.parts.get(part).copied().filter(|p| !p.done && p.drive as usize == d)?;
    let dr = &mut st.drives[d];
    dr.flight_bytes = dr.flight_bytes.saturating_sub(p.op_len);
    dr.queued_bytes = dr.queued_bytes.saturating_sub(p.op_len);
    let result = match (fault, c.result) {
        (Some(FaultKind::Eio), _) => Err(std::io::Error::from_raw_os_error(libc::EIO)),
        (Some(FaultKind::Short), Ok(_)) => Ok((p.skip + p.len / 2) as usize),
        (_, r) => r,
    };
    let file = || sh.spec.files[p.file as usize].1.display();
    match result {
        Err(e) => {
            req.part_error.get_or_insert((d as u16, Some(p.file), format!("{}: I/O error: {e}", file())));
        }
        Ok(n) if (n as u64) < p.skip + p.len => {
            let got = (n as u64).saturating_sub(p.skip);
            let msg = format!("{}: short read: got {got} of {} bytes", file(), p.len);
            req.part_error.get_or_insert((d as u16, Some(p.file), msg));
        }
        Ok(n) => {
            let n = n as u64;
            req.bytes_got += n;
            if let Some(t0) = p.at {
                dr.counters.latency.record((now - t0).as_secs_f64());
                let busy_since = dr.last_completion.map_or(t0, |l| l.max(t0));
                if let Some(rate) = dr.samples.record(n, (now - busy_since).as_secs_f64()) {
                    dr.rate = rate;
                }
            }
            dr.last_completion = Some(now);
            dr.counters.bytes_read += n;
            dr.counters.reads += 1;
            if req.prefetch {
                dr.counters.prefetch_reads += 1;
            }
            st.read += n;
        }
    }
    req.parts[part].done = true;
    req.parts_left = req.parts_left.saturating_sub(1);
    if req.parts_left > 0 {
        return None;
    }
    let (key, slot, start) = (req.key, req.slot, req.start as usize);
    Some(if st.hedges.lost.contains(&r) {
        // Its twin landed first (and parts of it may never have been read): nothing to check.
        Finished { r, key, slot, start, parts: Vec::new(), error: None, bytes_got: 0 }
    } else {
        let (parts, error, bytes_got) = (req.parts.clone(), req.part_error.clone(), req.bytes_got);
        Finished { r, key, slot, start, parts, error, bytes_got }
    })
}

/// Moves a split read's pieces to their places in the slot (outside the lock: the slot is still
/// Loading and owned by this read).
fn assemble(sh: &Shared, f: &Finished) {
    if f.error.is_some() || f.parts.len() <= 1 {
        return;
    }
    // Pieces sit in image order at aligned positions >= their destinations, so moving each
    // left in order never overwrites a piece not yet moved (split ranges are in place).
    for p in f.parts.iter().filter(|p| p.pos + p.skip != p.dest) {
        // SAFETY: every read into this slot has completed; both ranges lie inside the slot.
        unsafe {
            let base = sh.slab.slot_ptr(f.slot);
            std::ptr::copy(base.add((p.pos + p.skip) as usize), base.add(p.dest as usize), p.len as usize);
        }
    }
}

/// The read's verdict (outside the lock): its bytes, or the failure and who is to blame — a file
/// (I/O error, short read), or this expert's holder on one drive (bytes that are not the recorded
/// ones); and the files it was read from.
fn verify(sh: &Shared, f: &Finished) -> (Result<u64, Blame>, Vec<u32>) {
    let (key, parts) = (f.key, &f.parts);
    // A checksum mismatch names a drive only when one drive read every part.
    let one_drive = parts.first().map(|p0| p0.drive).filter(|&d0| parts.iter().all(|p| p.drive == d0));
    let mut files: Vec<u32> = parts.iter().map(|p| p.file).collect();
    files.dedup();
    let verdict = match &f.error {
        Some((bad, file, e)) => Err((Some(*bad), *file, e.clone())),
        None if parts.is_empty() => Ok(0),
        None => match &sh.spec.checksums {
            Some(c) => {
                // SAFETY: the read into this slot has completed and nobody else touches it.
                let bytes = unsafe { sh.slab.slot_bytes(f.slot, f.start, sh.spec.layout.len) };
                match c.check(key.0 as usize, key.1, bytes) {
                    Verdict::Ok | Verdict::Unknown => Ok(f.bytes_got),
                    Verdict::Bad(what) => {
                        let names: Vec<String> =
                            files.iter().map(|&f| sh.spec.files[f as usize].1.display().to_string()).collect();
                        let why = c.explain(key.0 as usize, key.1);
                        Err((one_drive, None, format!("{}: {what} ({why})", names.join(" + "))))
                    }
                }
            }
            None => Ok(f.bytes_got),
        },
    };
    (verdict, files)
}

/// A read that checked clean: its slot Ready for its waiters (or cached, when prefetched), its
/// holder's suspicion cleared, a hedged twin abandoned; nothing when the twin landed first.
fn publish(sh: &Shared, st: &mut State, d: usize, f: &Finished, t: Taken, files: &[u32]) {
    let (key, slot) = (f.key, f.slot);
    for was in if f.parts.is_empty() { Vec::new() } else { st.suspects.clear(key, d as u16, files) } {
        tracing::info!("expert {} of layer {} read clean again; restored after: {was}", key.1, key.0);
    }
    if t.lost {
        // Its twin landed first: these bytes are not used.
        st.slots[slot] = Slot::Free;
        st.free.push(slot);
        return;
    }
    let (mut waiters, mut sure_read) = (t.req.waiters, t.req.sure);
    if let Some(tw) = t.twin {
        if !t.primary
            && let Some(tq) = st.reqs[tw].as_ref()
        {
            (waiters, sure_read) = (tq.waiters, tq.sure);
            st.hedges.wins += 1;
        }
        hedge::abandon(sh, st, tw);
    }
    let prefetched = waiters == 0;
    let sure = sure_read && prefetched;
    st.slots[slot] =
        Slot::Ready { key, pins: waiters, start: f.start as u32, drive: d as u16, at: t.now, prefetched, sure };
    st.keys.insert(key, KeyState::Ready { slot });
    if waiters == 0 {
        // Prefetched: evictable until demanded.
        cache_slot(st, slot);
    }
}

/// A read that failed: the blamed drive's file or copy marked suspect, then the expert read again
/// from another holder (into a fresh slot when a lost part may still write this one), handed to a
/// hedged twin, or failed.
fn fail_over(sh: &Shared, st: &mut State, f: &Finished, t: Taken, (bad, file, msg): Blame) {
    let (key, req) = (f.key, t.req);
    if let Some(b) = bad {
        let dr = &mut st.drives[b as usize];
        dr.counters.failures += 1;
        let what = format!("expert {} of layer {}: {msg}", key.1, key.0);
        dr.last_failure = Some(what.clone());
        tracing::warn!(
            "drive {b} ({}): {what}; {} is avoided for a while, then tried again",
            sh.spec.drives[b as usize].root.display(),
            if file.is_some() { "the file" } else { "this copy of the expert" }
        );
        match file {
            Some(fl) => st.suspects.mark_file(fl, key, msg.clone(), t.now),
            None => st.suspects.mark_expert(key, b, msg.clone(), t.now),
        }
    }
    // A part lost in flight on a drive given up may still write the slot.
    let mut slot = f.slot;
    if req.poison {
        st.slots[slot] = Slot::Poisoned;
    }
    if t.lost || t.twin.is_some() {
        // A hedged read: the other copy serves (or served) the expert.
        if let Some(tw) = t.twin.filter(|_| !t.lost) {
            hedge::hand_over(st, &req, f.r, tw);
        }
        if !req.poison {
            st.slots[slot] = Slot::Free;
            st.free.push(slot);
        }
        return;
    }
    if req.prefetch {
        // Counted again by start_read's retry only if it stays a prefetch.
        st.prefetch_outstanding += usize::from(req.waiters == 0);
    }
    if req.poison {
        match alloc_slot(st) {
            Some(s) => slot = s,
            None => {
                st.prefetch_outstanding =
                    st.prefetch_outstanding.saturating_sub(usize::from(req.prefetch && req.waiters == 0));
                fail_key(sh, st, req.key, req.waiters, bad.unwrap_or(req.drive) as usize, &msg);
                return;
            }
        }
    }
    let blamed = bad.unwrap_or(req.drive) as usize;
    retry_or_fail(sh, st, req, slot, blamed, bad.is_some(), &msg);
}
