//! The device-memory expert cache (`--gpu-cache-gb`): routed experts kept in GPU memory across
//! layers and tokens, in front of the store's RAM cache. An expert it holds is neither fetched
//! from the store nor uploaded again.
//!
//! Contract: a slot holds one expert's staging image (`experts::slot_layout`) with exactly the
//! shipped bytes, so running an expert from its slot gives the bits of running it from a fresh
//! upload. Slots live side by side in a few large buffers (arenas of at most [`ARENA_BYTES`], each
//! one binding), so the experts a layer runs from the cache are in few bindings for the batch
//! path's dispatches (which do not steer where an expert goes: any free slot, any victim). Every slot the budget allows (at most one per routed expert) is allocated when the
//! engine opens ([`DeviceCache::reserve`]): device memory the adapter cannot give is an error
//! before any work, never a failure halfway through a prompt. A slot
//! claimed or filled by a batch is pinned until that batch finishes, so a layer never overwrites
//! an expert it still runs. Eviction takes the unpinned slot with the fewest uses (counted for
//! every expert seen, halved every few thousand admissions so old heat fades), then the least
//! recently used — the store's [`EvictionOrder`]; a newcomer with fewer uses than that victim is not
//! admitted (it runs from a staging buffer instead), so one pass over cold experts cannot flush the
//! hot ones.

use crate::util::EvictionOrder;
use std::collections::HashMap;

type Key = (u32, u32);

/// Bytes of one arena at most (also bounded by the adapter's largest binding). Large, so that a
/// layer's experts are in few buffers (each buffer a group's images are in costs it two
/// dispatches); the word offsets the kernels take reach 16 GiB.
const ARENA_BYTES: u64 = 4 << 30;

/// Where a slot's image is: its arena and the byte offset in it (a multiple of 16).
#[derive(Clone)]
pub(super) struct Place {
    pub buf: wgpu::Buffer,
    pub at: u64,
}

struct Slot {
    arena: usize,
    at: u64,
    key: Option<Key>,
    pins: u32,
}

pub(super) struct DeviceCache {
    budget: u64,
    /// Bytes of one arena at most ([`ARENA_BYTES`]; the residency bench also times one slot each).
    arena_bytes: u64,
    slot_bytes: u64,
    arenas: Vec<wgpu::Buffer>,
    slots: Vec<Slot>,
    /// Slots holding no expert.
    free: Vec<usize>,
    /// Unpinned slots holding an expert, in eviction order (rank: the expert's uses).
    order: EvictionOrder,
    map: HashMap<Key, usize>,
    uses: HashMap<Key, u32>,
    since_decay: usize,
    /// Experts there are (no use for more slots than that).
    max_slots: Option<usize>,
}

/// Admissions between halvings of every use count (in slots of the cache, at least this many).
const DECAY_EVERY: usize = 4096;

impl DeviceCache {
    pub fn new(budget: u64) -> Self {
        DeviceCache {
            budget,
            arena_bytes: ARENA_BYTES,
            slot_bytes: 0,
            arenas: Vec::new(),
            slots: Vec::new(),
            free: Vec::new(),
            order: EvictionOrder::new(0),
            map: HashMap::new(),
            uses: HashMap::new(),
            since_decay: 0,
            max_slots: None,
        }
    }

    /// The same cache with arenas of at most `bytes` (at least one slot each): one buffer per
    /// expert when `bytes` is a slot's, the layout the residency bench compares the arenas with.
    #[cfg(feature = "gpu-bench")]
    pub fn with_arena_bytes(mut self, bytes: u64) -> Self {
        self.arena_bytes = bytes;
        self
    }

    /// Device buffers holding the slots.
    #[cfg(feature = "gpu-bench")]
    pub fn buffers(&self) -> usize {
        self.arenas.len()
    }

    /// Device memory held by allocated slots.
    pub fn bytes(&self) -> u64 {
        self.slots.len() as u64 * self.slot_bytes
    }

    /// Slots the budget allows for experts of `slot_bytes`, at most one per expert there is.
    fn capacity(&self) -> usize {
        let n = self.budget.checked_div(self.slot_bytes).unwrap_or(0) as usize;
        self.max_slots.map_or(n, |m| n.min(m))
    }

    /// No more slots than `experts` (the model's routed experts).
    pub fn limit_slots(&mut self, experts: usize) {
        self.max_slots = Some(experts);
    }

    /// Device memory the cache will hold when full.
    pub fn planned_bytes(&self) -> u64 {
        self.capacity() as u64 * self.slot_bytes
    }

    /// Slots for images of `slot_bytes`: a different expert layout empties the cache (it holds no
    /// slot until [`DeviceCache::reserve`] again).
    pub fn fit(&mut self, slot_bytes: u64) {
        if self.slot_bytes != slot_bytes {
            self.slots.clear();
            self.arenas.clear();
            self.free.clear();
            self.order = EvictionOrder::new(0);
            self.map.clear();
            self.slot_bytes = slot_bytes;
        }
    }

    pub fn holds(&self, layer: usize, expert: u32) -> bool {
        self.map.contains_key(&(layer as u32, expert))
    }

    fn uses_of(&self, key: Key) -> u32 {
        self.uses.get(&key).copied().unwrap_or(0)
    }

    /// Counts one use of `key`; returns its count.
    fn count_use(&mut self, key: Key) -> u32 {
        let u = self.uses.entry(key).or_insert(0);
        *u = u.saturating_add(1);
        *u
    }

    fn place(&self, i: usize) -> Place {
        let s = &self.slots[i];
        Place { buf: self.arenas[s.arena].clone(), at: s.at }
    }

    /// The held expert's slot as it is (no pin, no use counted).
    pub fn slot_of(&self, layer: usize, expert: u32) -> Option<(usize, Place)> {
        let &i = self.map.get(&(layer as u32, expert))?;
        Some((i, self.place(i)))
    }

    /// The held expert's slot, pinned, or None.
    pub fn claim(&mut self, layer: usize, expert: u32) -> Option<(usize, Place)> {
        let key = (layer as u32, expert);
        let &i = self.map.get(&key)?;
        self.count_use(key);
        self.order.remove(i);
        self.slots[i].pins += 1;
        Some((i, self.place(i)))
    }

    /// Allocates every slot the budget allows (see the module contract), in arenas of as many
    /// slots as fit in [`ARENA_BYTES`] and in `max_binding` (at least one each).
    pub fn reserve(&mut self, device: &wgpu::Device, max_binding: u64) -> Result<(), super::GpuError> {
        let wanted = self.capacity();
        if wanted == 0 && self.budget > 0 {
            tracing::warn!(
                "{}: {} is less than one expert ({}); no device expert cache",
                crate::setting::Setting::GpuCacheGb,
                crate::util::human_bytes(self.budget),
                crate::util::human_bytes(self.slot_bytes)
            );
        }
        let per_arena = (self.arena_bytes.min(max_binding) / self.slot_bytes.max(1)).max(1) as usize;
        while self.slots.len() < wanted {
            let n = per_arena.min(wanted - self.slots.len());
            match self.allocate(device, n as u64 * self.slot_bytes) {
                Ok(buf) => {
                    let arena = self.arenas.len();
                    self.arenas.push(buf);
                    let slot_bytes = self.slot_bytes;
                    self.slots.extend((0..n as u64).map(|k| Slot { arena, at: k * slot_bytes, key: None, pins: 0 }));
                }
                Err(msg) => {
                    let got = self.slots.len();
                    // Free them again: the engine does not open.
                    self.slots.clear();
                    self.arenas.clear();
                    let fits_gb = got as f64 * self.slot_bytes as f64 / 1e9;
                    return Err(super::GpuError::DeviceCache { wanted, got, fits_gb, msg });
                }
            }
        }
        self.free = (0..self.slots.len()).rev().collect();
        self.order = EvictionOrder::new(self.slots.len());
        Ok(())
    }

    /// A pinned slot for an expert about to be uploaded (a free one, or the victim's), or None
    /// when it is not worth a place.
    pub fn admit(&mut self, layer: usize, expert: u32) -> Option<(usize, Place)> {
        if self.slots.is_empty() {
            return None;
        }
        if let Some(hit) = self.claim(layer, expert) {
            return Some(hit);
        }
        let key = (layer as u32, expert);
        let uses = self.count_use(key);
        self.since_decay += 1;
        if self.since_decay >= DECAY_EVERY.max(self.capacity()) {
            self.since_decay = 0;
            self.uses.retain(|_, u| {
                *u /= 2;
                *u > 0
            });
            for i in 0..self.slots.len() {
                if let Some(k) = self.slots[i].key.filter(|_| self.order.contains(i)) {
                    self.order.rerank(i, self.uses_of(k));
                }
            }
        }
        let i = match self.free.pop() {
            Some(i) => i,
            None => {
                let (victim_uses, v) = self.order.first()?;
                if victim_uses > uses {
                    return None;
                }
                self.order.remove(v);
                v
            }
        };
        if let Some(old) = self.slots[i].key.take() {
            self.map.remove(&old);
        }
        let s = &mut self.slots[i];
        s.key = Some(key);
        s.pins += 1;
        self.map.insert(key, i);
        Some((i, self.place(i)))
    }

    fn allocate(&mut self, device: &wgpu::Device, size: u64) -> Result<wgpu::Buffer, String> {
        let scope = device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buf = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("expert cache arena"),
            size,
            usage: super::device::STAGED,
            mapped_at_creation: false,
        });
        match pollster::block_on(scope.pop()) {
            None => Ok(buf),
            Some(e) => Err(e.to_string()),
        }
    }

    /// Releases one pin; an unpinned slot joins the eviction order as its most recent entry (or
    /// the free slots, when its expert was forgotten meanwhile).
    pub fn unpin(&mut self, slot: usize) {
        let Some(s) = self.slots.get_mut(slot) else { return };
        if s.pins == 0 {
            return;
        }
        s.pins -= 1;
        if s.pins > 0 {
            return;
        }
        match s.key {
            Some(key) => {
                let rank = self.uses_of(key);
                self.order.push(slot, rank);
            }
            None => self.free.push(slot),
        }
    }

    /// Drops the expert in `slot`, whose upload may not have completed (a batch that failed):
    /// no one finds it again; the slot is free at once, or when its last pin is released.
    pub fn forget(&mut self, slot: usize) {
        let Some(s) = self.slots.get_mut(slot) else { return };
        let Some(key) = s.key.take() else { return };
        self.map.remove(&key);
        if s.pins == 0 {
            self.order.remove(slot);
            self.free.push(slot);
        }
    }

    /// (slots allocated, slots the budget allows) for the startup line.
    pub fn slots(&self) -> (usize, usize) {
        (self.slots.len(), self.capacity())
    }
}
