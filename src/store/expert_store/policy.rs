//! The expert cache's policy: which slot a read takes, which cached expert is evicted, how reads
//! ahead of a batch rank, and when an expert finished with stays cached.
//!
//! Contract: every function runs under the store's lock (`&mut State`); a pinned or loading slot
//! is never evicted; ranks are request counts (a prefetched guess ranks 0, a read ahead above any
//! demanded expert until its layer is fetched), so eviction honours the same counts as admission.

use super::*;

/// Starts reads of `experts[from..]` of `layer` that a batch will surely need (a prompt chunk's
/// next layer, predicted by its router on all rows), once every read of the current fetch has
/// been started: they run while the batch computes attention, so the drives do not idle. Each
/// takes a free slot or the least-used cached one (never one of `layer`'s own, never a pinned
/// one), at most half of the cache, and ranks above every demanded expert until `layer` is
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
    let cap = (sh.cache_slots / 2).saturating_sub(st.sure_slots.len());
    let mut started = 0;
    for (i, &e) in experts.iter().enumerate().skip(from) {
        if started >= cap {
            return i;
        }
        let key = (layer as u32, e);
        if st.keys.contains_key(&key) || choose_holder(sh, st, key, &[]).is_none() {
            continue;
        }
        let slot = match st.free.pop() {
            Some(s) => s,
            None => match st.lru.first() {
                Some((_, v)) if !matches!(st.slots[v], Slot::Ready { key: k, sure, .. } if k.0 == key.0 || sure) => {
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

/// Adds `n` requests to an expert's count; a cached expert keeps its place in the eviction order
/// under its new count.
pub(super) fn add_uses(st: &mut State, key: Key, n: u32) {
    let u = st.uses.entry(key).or_insert(0);
    *u = u.saturating_add(n);
    if let Some(KeyState::Ready { slot }) = st.keys.get(&key) {
        let slot = *slot;
        let r = rank(st, slot);
        st.lru.rerank(slot, r);
    }
}

/// A cached slot's eviction rank: how often its expert has been requested, so eviction honours the
/// same counts as admission; a prefetched guess nobody asked for yet ranks below anything demanded.
pub(super) fn rank(st: &State, slot: usize) -> u32 {
    match st.slots[slot] {
        Slot::Ready { sure: true, .. } => u32::MAX - 1,
        Slot::Ready { prefetched: true, .. } => 0,
        Slot::Ready { key, .. } => st.uses.get(&key).copied().unwrap_or(0),
        _ => u32::MAX,
    }
}

/// Caches a Ready, unpinned slot (most recently used among its rank).
pub(super) fn cache_slot(st: &mut State, slot: usize) {
    let r = rank(st, slot);
    st.lru.push(slot, r);
}

/// Frees the cached slot whose expert has been requested least often (least recently used first
/// among equals). Slots of the current request are pinned or loading, so never candidates.
pub(super) fn evict_least_used(st: &mut State) -> Option<usize> {
    let (_, slot) = st.lru.first()?;
    evict_slot(st, slot);
    Some(slot)
}

/// A slot for a demanded read: a free one, else the least-used cached one.
pub(super) fn alloc_slot(st: &mut State) -> Option<usize> {
    st.free.pop().or_else(|| evict_least_used(st))
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
/// there is room, or when it has been requested more often than the least-used cached expert
/// (which it then replaces); otherwise the slot is freed.
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
        let uses = st.uses.get(&key).copied().unwrap_or(0);
        match st.lru.first() {
            Some((victim_uses, victim)) if sh.cache_slots > 0 && uses > victim_uses => {
                evict_slot(st, victim);
                st.free.push(victim);
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
