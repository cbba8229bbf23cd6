//! `fetch`: the forward pass's view of the store. Pins every cached expert of the request first
//! (so the request's own misses can never evict its hits), joins reads in flight, then starts reads
//! for the misses as slots allow; lands experts in arrival order outside the lock, and releases each
//! slot to the cache when the sink drops its bytes.

use super::*;

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

    fn fetch<'s>(&'s self, layer: usize, experts: &[u32], sink: &mut dyn ExpertSink<'s>) -> Result<(), StoreError> {
        self.fetch_then(layer, experts, None, sink)
    }

    fn fetch_then<'s>(
        &'s self,
        layer: usize,
        experts: &[u32],
        then: Option<(usize, &[u32])>,
        sink: &mut dyn ExpertSink<'s>,
    ) -> Result<(), StoreError> {
        let sh = &*self.shared;
        let len = sh.spec.layout.len;
        let l = layer as u32;
        let mut wants: Vec<(u32, Want)> = experts.iter().map(|&e| (e, Want::Deferred)).collect();
        {
            let mut st = lock(sh);
            let st = &mut *st;
            demote_read_ahead(st, layer);
            if !experts.is_empty() {
                st.replay.record(l, experts);
            }
            for &e in experts {
                add_uses(st, (l, e), 1, policy::RANK_UNIT);
            }
        }
        let mut remaining = wants.len();
        let mut started: Vec<u32> = Vec::new();
        let mut last_land: Option<(Instant, u16)> = None;
        let mut error: Option<StoreError> = None;
        let mut stopped = false;
        let mut first_pass = true;
        let mut ahead_armed = false;
        // Where the read-ahead resumes in `then`'s list.
        let mut ahead_at = 0;
        while remaining > 0 {
            let mut ready: Vec<(u32, usize, usize)> = Vec::new();
            {
                let mut st = lock(sh);
                loop {
                    let st_ref = &mut *st;
                    // Whether a read of this fetch is still to land (its slot then comes back, or
                    // the cache's order changes): else a miss may evict to make progress.
                    let mut in_flight = !ready.is_empty() || wants.iter().any(|(_, w)| matches!(w, Want::Waiting));
                    // Hits are pinned (and reads in flight joined) before any miss may allocate.
                    for phase in [0, 1] {
                        for (e, w) in wants.iter_mut() {
                            let key = (l, *e);
                            // Resolve Deferred entries against what other fetches and prefetches did.
                            if let Want::Deferred = w {
                                if phase == 0 && !st_ref.keys.contains_key(&key) {
                                    continue;
                                }
                                if error.is_some() || stopped {
                                    *w = Want::Done;
                                    remaining -= 1;
                                    continue;
                                }
                                match st_ref.keys.get(&key) {
                                    Some(KeyState::Ready { slot }) => {
                                        let slot = *slot;
                                        // An expert read ahead for this fetch was read, not
                                        // kept: a miss for the cache's count.
                                        let ahead = matches!(st_ref.slots[slot], Slot::Ready { sure: true, .. });
                                        pin_ready(st_ref, slot);
                                        if first_pass {
                                            if ahead {
                                                st_ref.misses += 1;
                                            } else {
                                                st_ref.hits += 1;
                                            }
                                        }
                                        *w = Want::Ready(slot);
                                    }
                                    Some(KeyState::Loading { req }) => {
                                        let r = *req;
                                        let ahead = st_ref.reqs[r].as_ref().is_some_and(|q| q.sure);
                                        join_read(st_ref, r);
                                        if first_pass {
                                            if ahead {
                                                st_ref.misses += 1;
                                            } else {
                                                st_ref.joins += 1;
                                            }
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
                                        if let Some(slot) = alloc_demand_slot(st_ref, key, !in_flight) {
                                            if start_read(sh, st_ref, key, slot, false, &[]) {
                                                if let Some(KeyState::Loading { req }) = st_ref.keys.get(&key) {
                                                    let r = *req;
                                                    if let Some(q) = st_ref.reqs[r].as_mut() {
                                                        q.waiters += 1;
                                                    }
                                                }
                                                started.push(*e);
                                                *w = Want::Waiting;
                                                in_flight = true;
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
                    }
                    first_pass = false;
                    // Once every read of this fetch has a slot, the next layer's reads start, as
                    // many as slots allow now and more as this layer's experts are released.
                    ahead_armed = ahead_armed || !wants.iter().any(|(_, w)| matches!(w, Want::Deferred));
                    if let Some((nl, next)) = then.filter(|_| ahead_armed) {
                        ahead_at = read_ahead(sh, st_ref, layer, nl, next, ahead_at);
                    }
                    if !ready.is_empty() || remaining == 0 {
                        break;
                    }
                    // Reads late on their drive get a second copy; wake when the next one is due.
                    let wake = if sh.hedge {
                        let waiting: Vec<u32> =
                            wants.iter().filter(|(_, w)| matches!(w, Want::Waiting)).map(|(e, _)| *e).collect();
                        hedge::hedge_late(sh, st_ref, l, &waiting)
                    } else {
                        None
                    };
                    st = match wake {
                        Some(t) => sh.done_cv.wait_timeout(st, t).map_or_else(|p| p.into_inner().0, |(g, _)| g),
                        None => sh.done_cv.wait(st).unwrap_or_else(|p| p.into_inner()),
                    };
                }
            }
            // Land outside the lock; each slot stays pinned until the sink drops its bytes.
            for &(e, slot, start) in &ready {
                let release = move || {
                    let mut st = lock(sh);
                    unpin(sh, &mut st, (l, e), slot);
                };
                if error.is_some() || stopped {
                    release();
                    continue;
                }
                // SAFETY: the slot is pinned Ready; no reader writes it until it is unpinned,
                // which happens only when `Landed` is dropped.
                let bytes = unsafe { sh.slab.slot_bytes(slot, start, len) };
                lock(sh).requested += len as u64;
                match sink.land(e, Landed::with_release(bytes, Box::new(release))) {
                    Ok(Flow::Continue) => {}
                    Ok(Flow::Stop) => stopped = true,
                    Err(err) => error = Some(err),
                }
            }
        }
        if let Some((_, drive)) = last_land {
            lock(sh).drives[drive as usize].counters.lands_last += 1;
        }
        // Every expert of this layer has been released by now: read ahead into what it frees.
        if let Some((nl, next)) = then.filter(|_| error.is_none() && !stopped) {
            read_ahead(sh, &mut lock(sh), layer, nl, next, ahead_at);
        }
        match error {
            Some(e) => Err(e),
            None => Ok(()),
        }
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

    fn note_routes(&self, layer: usize, experts: &[u32], rows_of: &[usize], rows: usize) {
        ExpertStore::note_routes(self, layer, experts, rows_of, rows)
    }

    fn health(&self) -> super::StorageHealth {
        ExpertStore::health(self)
    }

    fn describe(&self) -> String {
        let r = self.report();
        let drives: Vec<String> = r
            .drives
            .iter()
            .map(|d| {
                format!(
                    "{} ({}{})",
                    d.root,
                    d.reader,
                    if d.direct_io { format!(", {}", crate::store::io::reader::UNCACHED) } else { String::new() }
                )
            })
            .collect();
        let sums = self.shared.spec.checksums.as_ref().map_or_else(
            || "experts UNVERIFIED (no checksums recorded)".to_string(),
            crate::store::sums::ExpertSums::describe,
        );
        format!(
            "experts via store: {} drive(s) [{}], {} slots | {sums}",
            r.drives.len(),
            drives.join(", "),
            self.slots()
        )
    }
}

fn no_holder(sh: &Shared, st: &State, layer: usize, e: u32) -> StoreError {
    let holders = sh.spec.holders.get(layer).and_then(|h| h.as_ref()).and_then(|h| h.get(e as usize));
    let mut why: Vec<String> = st
        .drives
        .iter()
        .enumerate()
        // The drives of its holders; with none left (their files could not be used), every drive.
        .filter(|(i, _)| holders.is_none_or(|hs| hs.is_empty() || hs.iter().any(|h| h.drive as usize == *i)))
        .filter_map(|(i, d)| {
            d.failed.as_ref().map(|m| format!("drive {i} ({}): {m}", sh.spec.drives[i].root.display()))
        })
        .collect();
    why.extend(st.suspects.why(sh, (layer as u32, e), Instant::now()));
    StoreError::NoHolderLeft(format!(
        "expert {e} of layer {layer}: no usable holder{}",
        if why.is_empty() { String::new() } else { format!(" ({})", why.join("; ")) }
    ))
}
