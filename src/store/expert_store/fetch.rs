//! `fetch`: the forward pass's view of the store. Pins every cached expert of the request first
//! (so the request's own misses can never evict its hits), joins reads in flight, then starts reads
//! for the misses as slots allow; lands experts in arrival order outside the lock, and releases each
//! slot to the cache when the sink drops its bytes.

use super::*;

#[derive(Clone, Copy)]
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

/// An expert ready to land: (expert, slot, start of its bytes in the slot).
type ReadyExpert = (u32, usize, usize);

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
        let mut f = Fetch::begin(&self.shared, layer, experts);
        while f.remaining > 0 {
            let ready = f.next_ready(then);
            f.land(&ready, sink);
        }
        f.finish(then)
    }

    fn report(&self) -> SourceReport {
        ExpertStore::report(self)
    }

    fn read_counters(&self) -> SourceReport {
        ExpertStore::read_counters(self)
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

/// One fetch in progress: what each wanted expert waits for, and what the fetch has seen.
struct Fetch<'s> {
    sh: &'s Shared,
    layer: usize,
    l: u32,
    wants: Vec<(u32, Want)>,
    /// Wanted experts not landed (or abandoned) yet.
    remaining: usize,
    /// Experts whose reads this fetch started.
    started: Vec<u32>,
    /// When and on which drive the last of those reads landed.
    last_land: Option<(Instant, u16)>,
    error: Option<StoreError>,
    stopped: bool,
    /// Whether the cache's hits and misses are still to be counted (the first pass only).
    first_pass: bool,
    /// Whether every read of this fetch has a slot (the next layer's reads may start).
    ahead_armed: bool,
    /// Where the read-ahead resumes in `then`'s list.
    ahead_at: usize,
}

impl<'s> Fetch<'s> {
    /// A fetch of `experts` of `layer`: its uses counted, the layer's read-ahead demoted.
    fn begin(sh: &'s Shared, layer: usize, experts: &[u32]) -> Self {
        let l = layer as u32;
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
        Fetch {
            sh,
            layer,
            l,
            wants: experts.iter().map(|&e| (e, Want::Deferred)).collect(),
            remaining: experts.len(),
            started: Vec::new(),
            last_land: None,
            error: None,
            stopped: false,
            first_pass: true,
            ahead_armed: false,
            ahead_at: 0,
        }
    }

    /// Waits under the lock until some wanted experts are ready (or none remain): hits are pinned
    /// and reads in flight joined before any miss may allocate, misses read as slots allow, the
    /// next layer's reads started once every read of this one has a slot, late reads hedged.
    fn next_ready(&mut self, then: Option<(usize, &[u32])>) -> Vec<ReadyExpert> {
        let sh = self.sh;
        let mut ready: Vec<ReadyExpert> = Vec::new();
        let mut st = lock(sh);
        loop {
            let st_ref = &mut *st;
            // Whether a read of this fetch is still to land (its slot then comes back, or
            // the cache's order changes): else a miss may evict to make progress.
            let mut in_flight = !ready.is_empty() || self.wants.iter().any(|(_, w)| matches!(w, Want::Waiting));
            // Hits are pinned (and reads in flight joined) before any miss may allocate.
            for phase in [0, 1] {
                for i in 0..self.wants.len() {
                    let (e, w) = self.wants[i];
                    self.wants[i].1 = self.visit(st_ref, e, w, phase, &mut in_flight, &mut ready);
                }
            }
            self.first_pass = false;
            // Once every read of this fetch has a slot, the next layer's reads start, as
            // many as slots allow now and more as this layer's experts are released.
            self.ahead_armed = self.ahead_armed || !self.wants.iter().any(|(_, w)| matches!(w, Want::Deferred));
            if let Some((nl, next)) = then.filter(|_| self.ahead_armed) {
                self.ahead_at = read_ahead(sh, st_ref, self.layer, nl, next, self.ahead_at);
            }
            if !ready.is_empty() || self.remaining == 0 {
                return ready;
            }
            // Reads late on their drive get a second copy; wake when the next one is due.
            let wake = if sh.hedge {
                let waiting: Vec<u32> =
                    self.wants.iter().filter(|(_, w)| matches!(w, Want::Waiting)).map(|(e, _)| *e).collect();
                hedge::hedge_late(sh, st_ref, self.l, &waiting)
            } else {
                None
            };
            st = match wake {
                Some(t) => sh.done_cv.wait_timeout(st, t).map_or_else(|p| p.into_inner().0, |(g, _)| g),
                None => sh.done_cv.wait(st).unwrap_or_else(|p| p.into_inner()),
            };
        }
    }

    /// Marks one wanted expert landed or abandoned.
    fn done(&mut self) -> Want {
        self.remaining -= 1;
        Want::Done
    }

    /// Expert `e`'s turn in a pass (`phase` 0: only experts the cache or a read in flight already
    /// knows; 1: misses too): a deferred one resolved, then one that is ready collected into
    /// `ready`. Returns its new state.
    fn visit(
        &mut self,
        st: &mut State,
        e: u32,
        w: Want,
        phase: usize,
        in_flight: &mut bool,
        ready: &mut Vec<ReadyExpert>,
    ) -> Want {
        let w = match w {
            Want::Deferred => match self.resolve(st, e, phase, in_flight) {
                Ok(w) => w,
                // Settled, or left for the next phase: nothing to collect this turn.
                Err(w) => return w,
            },
            w => w,
        };
        self.collect(st, e, w, ready)
    }

    /// Resolves a deferred expert against what other fetches and prefetches did: a hit pinned, a
    /// read in flight joined, a failed one the fetch's error, a miss read into a slot when one is
    /// free. Ok: the state to collect from now; Err: the state to keep this turn.
    fn resolve(&mut self, st: &mut State, e: u32, phase: usize, in_flight: &mut bool) -> Result<Want, Want> {
        let key = (self.l, e);
        if phase == 0 && !st.keys.contains_key(&key) {
            return Err(Want::Deferred);
        }
        if self.error.is_some() || self.stopped {
            return Err(self.done());
        }
        match st.keys.get(&key) {
            Some(KeyState::Ready { slot }) => {
                let slot = *slot;
                // An expert read ahead for this fetch was read, not kept: a miss for the cache's count.
                let ahead = matches!(st.slots[slot], Slot::Ready { sure: true, .. });
                pin_ready(st, slot);
                if self.first_pass {
                    if ahead {
                        st.misses += 1;
                    } else {
                        st.hits += 1;
                    }
                }
                Ok(Want::Ready(slot))
            }
            Some(KeyState::Loading { req }) => {
                let r = *req;
                let ahead = st.reqs[r].as_ref().is_some_and(|q| q.sure);
                join_read(st, r);
                if self.first_pass {
                    if ahead {
                        st.misses += 1;
                    } else {
                        st.joins += 1;
                    }
                }
                Ok(Want::Waiting)
            }
            Some(KeyState::Failed { msg, .. }) => {
                self.error.get_or_insert_with(|| StoreError::NoHolderLeft(msg.clone()));
                Err(self.done())
            }
            None => {
                if self.first_pass {
                    st.misses += 1;
                }
                let Some(slot) = alloc_demand_slot(st, key, !*in_flight) else { return Ok(Want::Deferred) };
                if !start_read(self.sh, st, key, slot, false, &[]) {
                    st.free.push(slot);
                    self.error = Some(no_holder(self.sh, st, self.layer, e));
                    return Err(self.done());
                }
                if let Some(KeyState::Loading { req }) = st.keys.get(&key) {
                    let r = *req;
                    if let Some(q) = st.reqs[r].as_mut() {
                        q.waiters += 1;
                    }
                }
                self.started.push(e);
                *in_flight = true;
                Ok(Want::Waiting)
            }
        }
    }

    /// Collects expert `e` into `ready` when its slot is ready; a failed read is the fetch's error,
    /// a joined read that vanished (cancelled) starts over.
    fn collect(&mut self, st: &mut State, e: u32, w: Want, ready: &mut Vec<ReadyExpert>) -> Want {
        let key = (self.l, e);
        match w {
            Want::Ready(slot) => {
                if let Slot::Ready { start, .. } = st.slots[slot] {
                    ready.push((e, slot, start as usize));
                }
                self.done()
            }
            Want::Waiting => match st.keys.get_mut(&key) {
                Some(KeyState::Ready { slot }) => {
                    let slot = *slot;
                    if let Slot::Ready { start, drive, at, .. } = st.slots[slot] {
                        if self.started.contains(&e) && self.last_land.is_none_or(|(t, _)| at > t) {
                            self.last_land = Some((at, drive));
                        }
                        ready.push((e, slot, start as usize));
                    }
                    self.done()
                }
                Some(KeyState::Failed { msg, waiters }) => {
                    self.error.get_or_insert_with(|| StoreError::NoHolderLeft(msg.clone()));
                    *waiters = waiters.saturating_sub(1);
                    if *waiters == 0 {
                        st.keys.remove(&key);
                    }
                    self.done()
                }
                Some(KeyState::Loading { .. }) => Want::Waiting,
                // The read we joined vanished (cancelled): start over.
                None => Want::Deferred,
            },
            w @ (Want::Deferred | Want::Done) => w,
        }
    }

    /// Lands `ready` outside the lock in order; each slot stays pinned until the sink drops its
    /// bytes. After an error or a stop the rest are released unlanded.
    fn land(&mut self, ready: &[ReadyExpert], sink: &mut dyn ExpertSink<'s>) {
        let sh = self.sh;
        let (l, len) = (self.l, sh.spec.layout.len);
        for &(e, slot, start) in ready {
            let release = move || {
                let mut st = lock(sh);
                unpin(sh, &mut st, (l, e), slot);
            };
            if self.error.is_some() || self.stopped {
                release();
                continue;
            }
            // SAFETY: the slot is pinned Ready; no reader writes it until it is unpinned,
            // which happens only when `Landed` is dropped.
            let bytes = unsafe { sh.slab.slot_bytes(slot, start, len) };
            lock(sh).requested += len as u64;
            match sink.land(e, Landed::with_release(bytes, Box::new(release))) {
                Ok(Flow::Continue) => {}
                Ok(Flow::Stop) => self.stopped = true,
                Err(err) => self.error = Some(err),
            }
        }
    }

    /// Ends the fetch: the drive that landed its last read counted, the next layer read ahead into
    /// what this layer's experts freed; the fetch's error, if any.
    fn finish(self, then: Option<(usize, &[u32])>) -> Result<(), StoreError> {
        let sh = self.sh;
        if let Some((_, drive)) = self.last_land {
            lock(sh).drives[drive as usize].counters.lands_last += 1;
        }
        // Every expert of this layer has been released by now: read ahead into what it frees.
        if let Some((nl, next)) = then.filter(|_| self.error.is_none() && !self.stopped) {
            read_ahead(sh, &mut lock(sh), self.layer, nl, next, self.ahead_at);
        }
        match self.error {
            Some(e) => Err(e),
            None => Ok(()),
        }
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
