//! The expert cache's policy: which slot a read takes, which cached expert is evicted, how reads
//! ahead of a batch rank, and when an expert finished with stays cached.
//!
//! Two signals rank a cached expert (measured against the optimal cache in bench/cache_sim.py,
//! which replays this policy exactly): the route replay's forecast ([`crate::store::replay`]) keeps
//! what the forecast needs soonest; the rest are ranked by how often they were requested, a
//! prompt's or the route heat's counts weighing only as a few passes' worth (they predict later
//! routes poorly: ranked by them alone, the cache misses ~2x the optimum's misses).
//!
//! Contract: every function runs under the store's lock (`&mut State`); a pinned or loading slot
//! is never evicted; ranks are weighted request counts (a prefetched guess ranks 0, a read ahead
//! above any demanded expert until its layer is fetched), so eviction honours the same ranks as
//! admission.

use super::*;

/// Starts reads of `experts[from..]` of `layer` that a batch will surely need (a prompt chunk's
/// next layer, predicted by its router on all rows), once every read of the current fetch has
/// been started: they run while the batch computes attention, so the drives do not idle. Each
/// takes a free slot or the least-used cached one (never one of `layer`'s own, never a pinned
/// one), at most half of the cache or the read slots beside it (without a cache, a decode step's
/// reads ahead stream through those), and ranks above every demanded expert until `layer` is
/// fetched ([`demote_read_ahead`]). Counted as prefetches (`prefetch_issued` / `prefetch_used`).
/// Returns where to resume when slots free up (the experts before it are started or skipped).
pub(super) fn read_ahead(
    sh: &Shared,
    st: &mut State,
    from_layer: usize,
    layer: usize,
    experts: &[u32],
    from: usize,
) -> usize {
    if from >= experts.len() {
        return from;
    }
    // Only reads still ahead count against the cap (a demanded one is no longer ahead).
    let slots = std::mem::take(&mut st.sure_slots);
    st.sure_slots = slots.into_iter().filter(|s| still_ahead(&st.slots[s.slot])).collect();
    let staging = st.slots.len().saturating_sub(sh.cache_slots);
    let cap = (sh.cache_slots / 2).max(staging).saturating_sub(st.sure_slots.len());
    let mut started = 0;
    for (i, &e) in experts.iter().enumerate().skip(from) {
        if started >= cap {
            return i;
        }
        let key = (layer as u32, e);
        if st.keys.contains_key(&key) || choose_holder(sh, st, key, &[]).is_none() {
            continue;
        }
        // A free slot, else a cached expert it outranks (not one of `layer`'s own): reads ahead
        // must not evict experts the cache ranks as high, which the step's later layers need.
        let slot = match st.free.pop() {
            Some(s) => s,
            None => match st.lru.first() {
                Some((_, v))
                    if !matches!(st.slots[v], Slot::Ready { key: k, sure, .. } if k.0 == key.0 || sure)
                        && outranks(st, key, v) =>
                {
                    evict_slot(st, v);
                    v
                }
                _ => return i,
            },
        };
        if !start_read(sh, st, key, slot, false, &[]) {
            st.free.push(slot);
            continue;
        }
        if let Some(KeyState::Loading { req }) = st.keys.get(&key)
            && let Some(q) = st.reqs[*req].as_mut()
        {
            q.sure = true;
        }
        st.sure_slots.push(SureSlot { slot, target: layer as u32, reader: Some(from_layer as u32) });
        st.prefetch_issued += 1;
        started += 1;
    }
    experts.len()
}

/// A slot read ahead: for layer `target`, by a fetch of layer `reader` (None once `target` has
/// been fetched).
#[derive(Clone, Copy)]
pub(super) struct SureSlot {
    slot: usize,
    target: u32,
    reader: Option<u32>,
}

/// Whether a slot listed in `sure_slots` may still hold (or be reading) an expert read ahead.
pub(super) fn still_ahead(slot: &Slot) -> bool {
    matches!(slot, Slot::Ready { sure: true, .. } | Slot::Loading)
}

/// Slots read ahead lose their place above demanded experts once a fetch of a layer other than
/// the one they were read for comes (the batch has moved past them), except a fetch of the layer
/// that read them ahead before their own layer's (more of the reading layer's experts: they stay
/// ahead, whether or not their reads have landed yet); called when `layer` is fetched.
pub(super) fn demote_read_ahead(st: &mut State, layer: usize) {
    let layer = layer as u32;
    let slots = std::mem::take(&mut st.sure_slots);
    for mut sure_slot in slots {
        let slot = sure_slot.slot;
        if sure_slot.target == layer {
            // Their layer's fetch: what it does not demand goes at the next other fetch.
            sure_slot.reader = None;
            if still_ahead(&st.slots[slot]) {
                st.sure_slots.push(sure_slot);
            }
            continue;
        }
        match st.slots[slot] {
            Slot::Ready { sure: true, pins, .. } if sure_slot.reader != Some(layer) => {
                if let Slot::Ready { sure, .. } = &mut st.slots[slot] {
                    *sure = false;
                }
                if pins == 0 {
                    let r = rank(st, slot);
                    st.lru.rerank(slot, r);
                }
            }
            s if still_ahead(&s) => st.sure_slots.push(sure_slot),
            _ => {}
        }
    }
}

/// Frees an unpinned Ready slot.
pub(super) fn evict_slot(st: &mut State, slot: usize) {
    st.lru.remove(slot);
    if let Slot::Ready { key, .. } = st.slots[slot]
        && matches!(st.keys.get(&key), Some(KeyState::Ready { slot: s }) if *s == slot)
    {
        st.keys.remove(&key);
    }
    st.slots[slot] = Slot::Free;
}

/// One request of an expert by a fetch, in rank units (a prompt's share is a fraction of it).
pub(super) const RANK_UNIT: u32 = 256;
/// A batch's routes (a prompt) weigh as this many fetches, each expert by the share of the rows
/// routed to it: a prompt's counts foretell the continuation's routes poorly.
pub(super) const PROMPT_PRIOR_PASSES: f64 = 8.0;
/// The route heat of earlier runs weighs as this many fetches, each expert by its count against
/// its layer's hottest.
pub(super) const HEAT_PRIOR_PASSES: f64 = 4.0;
/// Cached experts looked at, least-requested first, for one not in the replay's forecast.
const VICTIM_SCAN: usize = 64;

/// Starting ranks from the route heat's counts ([`HEAT_PRIOR_PASSES`]).
pub(super) fn heat_ranks(seed: &HashMap<Key, u32>) -> HashMap<Key, u32> {
    let mut hottest: HashMap<u32, u32> = HashMap::new();
    for (&(l, _), &c) in seed {
        let h = hottest.entry(l).or_insert(0);
        *h = (*h).max(c);
    }
    seed.iter()
        .map(|(&k, &c)| {
            let h = hottest.get(&k.0).copied().unwrap_or(1).max(1);
            (k, (HEAT_PRIOR_PASSES * f64::from(RANK_UNIT) * f64::from(c) / f64::from(h)).round() as u32)
        })
        .collect()
}

/// Adds `n` requests to an expert's count (kept for the route heat) and `units` to its rank; a
/// cached expert keeps its place in the eviction order under its new rank.
pub(super) fn add_uses(st: &mut State, key: Key, n: u32, units: u32) {
    let u = st.uses.entry(key).or_insert(0);
    *u = u.saturating_add(n);
    let r = st.ranks.entry(key).or_insert(0);
    *r = r.saturating_add(units);
    if let Some(KeyState::Ready { slot }) = st.keys.get(&key) {
        let slot = *slot;
        let r = rank(st, slot);
        st.lru.rerank(slot, r);
    }
}

/// A cached slot's eviction rank: its expert's weighted request count, so eviction honours the
/// same ranks as admission; a prefetched guess nobody asked for yet ranks below anything demanded.
pub(super) fn rank(st: &State, slot: usize) -> u32 {
    match st.slots[slot] {
        Slot::Ready { sure: true, .. } => u32::MAX - 1,
        Slot::Ready { prefetched: true, .. } => 0,
        Slot::Ready { key, .. } => st.ranks.get(&key).copied().unwrap_or(0),
        _ => u32::MAX,
    }
}

/// How an expert ranks for staying cached: in the replay's forecast (sooner first) above out of
/// it, then by weighted request count. Tuples compare in that order.
fn standing(st: &State, key: Key) -> (bool, std::cmp::Reverse<u64>, u32) {
    let soon = st.replay.next_use(key);
    (soon.is_some(), std::cmp::Reverse(soon.unwrap_or(0)), st.ranks.get(&key).copied().unwrap_or(0))
}

/// The cached slot to give up next: among the [`VICTIM_SCAN`] least-requested, the first the
/// forecast does not need (a prefetched guess at once), else the one it needs last; a slot read
/// ahead only when nothing else is cached.
fn victim(st: &State) -> Option<usize> {
    let mut last: Option<(u64, usize)> = None;
    for (_, slot) in st.lru.iter().take(VICTIM_SCAN) {
        match st.slots[slot] {
            Slot::Ready { sure: true, .. } => {}
            Slot::Ready { prefetched: true, .. } => return Some(slot),
            Slot::Ready { key, .. } => match st.replay.next_use(key) {
                None => return Some(slot),
                Some(d) if last.is_none_or(|(ld, _)| d > ld) => last = Some((d, slot)),
                Some(_) => {}
            },
            _ => {}
        }
    }
    last.map(|(_, s)| s).or_else(|| st.lru.first().map(|(_, s)| s))
}

/// Whether `key`, just used, should take `victim`'s place in a full cache.
fn outranks(st: &State, key: Key, victim: usize) -> bool {
    match st.slots[victim] {
        Slot::Ready { sure: true, .. } => false,
        Slot::Ready { prefetched: true, .. } => true,
        Slot::Ready { key: v, .. } => standing(st, key) > standing(st, v),
        _ => false,
    }
}

/// Caches a Ready, unpinned slot (most recently used among its rank).
pub(super) fn cache_slot(st: &mut State, slot: usize) {
    let r = rank(st, slot);
    st.lru.push(slot, r);
}

/// Frees the cached slot [`victim`] names. Slots of the current request are pinned or loading, so
/// never candidates.
pub(super) fn evict_victim(st: &mut State) -> Option<usize> {
    let slot = victim(st)?;
    evict_slot(st, slot);
    Some(slot)
}

/// A slot for a read that must get one (a retry of a failed read): a free one, else the cached one
/// [`victim`] names.
pub(super) fn alloc_slot(st: &mut State) -> Option<usize> {
    st.free.pop().or_else(|| evict_victim(st))
}

/// A slot for a demanded read of `key`: a free one, else the cached one [`victim`] names if `key`
/// [`outranks`] it (the same test its release will make), else none: the read waits for a read
/// slot to come free instead of evicting an expert the cache ranks as high (a decode step of many
/// sequences names nearly every expert of each layer, and misses evicting the least-requested
/// would cycle the cache through the bank, each expert gone before its next use). `force`: the
/// caller has nothing in flight that could free a slot, so it evicts anyway.
pub(super) fn alloc_demand_slot(st: &mut State, key: Key, force: bool) -> Option<usize> {
    if let Some(s) = st.free.pop() {
        return Some(s);
    }
    let v = victim(st)?;
    (force || outranks(st, key, v)).then(|| {
        evict_slot(st, v);
        v
    })
}

/// Pins a Ready slot for a fetcher.
pub(super) fn pin_ready(st: &mut State, slot: usize) {
    st.lru.remove(slot);
    if let Slot::Ready { pins, prefetched, sure, .. } = &mut st.slots[slot] {
        *pins += 1;
        *sure = false;
        if *prefetched {
            *prefetched = false;
            st.prefetch_used += 1;
        }
    }
}

/// Releases a pin after the forward pass consumed the bytes and keeps the expert as cache when
/// there is room, or when it [`outranks`] the cached expert [`victim`] names (which it then
/// replaces); otherwise the slot is freed.
pub(super) fn unpin(sh: &Shared, st: &mut State, key: Key, slot: usize) {
    if let Slot::Ready { pins, .. } = &mut st.slots[slot] {
        *pins = pins.saturating_sub(1);
        if *pins > 0 {
            return;
        }
    }
    let keep = if st.lru.len() < sh.cache_slots {
        true
    } else {
        match victim(st) {
            Some(v) if sh.cache_slots > 0 && outranks(st, key, v) => {
                evict_slot(st, v);
                st.free.push(v);
                true
            }
            _ => false,
        }
    };
    if keep {
        cache_slot(st, slot);
    } else {
        st.keys.remove(&key);
        st.slots[slot] = Slot::Free;
        st.free.push(slot);
    }
    sh.done_cv.notify_all();
}
