//! The expert cache's memory: one page-aligned slab of fixed-size slots (each holds one expert
//! read, widened for O_DIRECT; pages of at least 4 KiB, Apple Silicon's 16 KiB there, so an
//! F_NOCACHE read lands in whole pages and a slot can be shared with the GPU as it is), and the optimal (Belady) cache the store is judged against. The
//! eviction order of cached slots is [`EvictionOrder`] (shared with the GPU's device cache).
//!
//! Contract: slot memory is only written by the reader that owns the slot's in-flight read and only
//! read while the slot is pinned Ready; the store's state machine enforces both.

pub use crate::util::EvictionOrder;
use std::alloc::{Layout, alloc_zeroed, dealloc};

pub struct Slab {
    ptr: *mut u8,
    layout: Option<Layout>,
    pub slot_size: usize,
    pub slots: usize,
}

// SAFETY: the slab is plain memory; concurrent access to distinct slots is coordinated by the
// store (a slot is written by exactly one read and read only after that read completed).
unsafe impl Send for Slab {}
// SAFETY: as above.
unsafe impl Sync for Slab {}

impl Slab {
    /// `slots` slots of `slot_size` bytes (rounded up to whole pages), page-aligned ([`page`]).
    /// Pages are committed lazily by the OS as reads land.
    pub fn new(slots: usize, slot_size: usize) -> std::io::Result<Self> {
        let page = page();
        let slot_size = slot_size.div_ceil(page) * page;
        let bytes = slots.checked_mul(slot_size).ok_or_else(|| std::io::Error::other("expert cache size overflows"))?;
        if bytes == 0 {
            return Ok(Slab { ptr: std::ptr::null_mut(), layout: None, slot_size, slots });
        }
        let layout = Layout::from_size_align(bytes, page).map_err(|e| std::io::Error::other(e.to_string()))?;
        // SAFETY: the layout has non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::OutOfMemory,
                format!("cannot allocate a {bytes}-byte expert cache"),
            ));
        }
        Ok(Slab { ptr, layout: Some(layout), slot_size, slots })
    }

    pub fn slot_ptr(&self, i: usize) -> *mut u8 {
        assert!(i < self.slots);
        // SAFETY: i < slots, so the offset stays inside the allocation.
        unsafe { self.ptr.add(i * self.slot_size) }
    }

    /// Bytes `[start, start+len)` of slot `i`.
    ///
    /// # Safety
    /// The slot must not be written while the returned slice is alive (the store pins it).
    pub unsafe fn slot_bytes(&self, i: usize, start: usize, len: usize) -> &[u8] {
        assert!(start + len <= self.slot_size);
        // SAFETY: in bounds by the assert; no concurrent writer per the caller's contract.
        unsafe { std::slice::from_raw_parts(self.slot_ptr(i).add(start), len) }
    }

    /// (pointer, length) of every slot, for registering with io_uring.
    pub fn iovecs(&self) -> Vec<(*mut u8, usize)> {
        (0..self.slots).map(|i| (self.slot_ptr(i), self.slot_size)).collect()
    }
}

/// The alignment and size unit of slab slots: the VM page (4 KiB on x86 Linux, 16 KiB on Apple
/// Silicon), at least the 4 KiB O_DIRECT needs.
pub fn page() -> usize {
    // SAFETY: sysconf reads a system constant.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|p| p.is_power_of_two()).unwrap_or(4096).max(4096)
}

impl Drop for Slab {
    fn drop(&mut self) {
        if let Some(l) = self.layout {
            // SAFETY: allocated in `new` with this layout.
            unsafe { dealloc(self.ptr, l) };
        }
    }
}

/// Misses of the optimal (Belady) cache of `capacity` experts on a trace of fetches: each fetch
/// needs all of its experts at once (they cannot evict each other); on a miss with a full cache the
/// cached expert needed again farthest in the future is evicted, or the new one is not kept when it
/// is itself needed farthest. Starts cold.
pub fn belady_misses(trace: &[(u32, Vec<u32>)], capacity: usize) -> u64 {
    use std::collections::{BTreeSet, HashMap};
    // next[f][i]: the next fetch index after f that needs trace[f].1[i] (usize::MAX: never).
    let mut last_seen: HashMap<(u32, u32), usize> = HashMap::new();
    let mut next: Vec<Vec<usize>> = trace.iter().map(|(_, es)| vec![usize::MAX; es.len()]).collect();
    for f in (0..trace.len()).rev() {
        let (l, es) = &trace[f];
        for (i, &e) in es.iter().enumerate() {
            next[f][i] = last_seen.get(&(*l, e)).copied().unwrap_or(usize::MAX);
            last_seen.insert((*l, e), f);
        }
    }
    let mut cached: HashMap<(u32, u32), usize> = HashMap::new();
    let mut by_next: BTreeSet<(usize, (u32, u32))> = BTreeSet::new();
    let mut misses = 0u64;
    for (f, (l, es)) in trace.iter().enumerate() {
        let mut incoming = Vec::new();
        for (i, &e) in es.iter().enumerate() {
            let key = (*l, e);
            let nu = next[f][i];
            match cached.get(&key).copied() {
                Some(old) => {
                    by_next.remove(&(old, key));
                    by_next.insert((nu, key));
                    cached.insert(key, nu);
                }
                None => {
                    misses += 1;
                    incoming.push((nu, key));
                }
            }
        }
        // Admit this fetch's misses where the cache has room or holds something needed later.
        for (nu, key) in incoming {
            if capacity == 0 || nu == usize::MAX {
                continue;
            }
            if cached.len() >= capacity {
                let Some(&(far, victim)) = by_next.iter().next_back() else { continue };
                // Only evict what is needed after the new one (never what this fetch still needs:
                // those have next uses after f and stay comparable).
                if far <= nu {
                    continue;
                }
                by_next.remove(&(far, victim));
                cached.remove(&victim);
            }
            cached.insert(key, nu);
            by_next.insert((nu, key));
        }
    }
    misses
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn belady_on_a_known_trace() {
        // One layer, capacity 2: 1 2 3 1 2 4 1 2 -> misses 1 2 3 4 (3 and 4 are never kept).
        let t: Vec<(u32, Vec<u32>)> = [1u32, 2, 3, 1, 2, 4, 1, 2].iter().map(|&e| (0, vec![e])).collect();
        assert_eq!(belady_misses(&t, 2), 4);
        assert_eq!(belady_misses(&t, 0), 8);
        assert_eq!(belady_misses(&t, 10), 4);
        // A cyclic walk larger than the cache: LRU would miss everything, the optimum does not.
        let cyc: Vec<(u32, Vec<u32>)> = (0..30).map(|i| (0, vec![i % 3])).collect();
        // Keeping 0 and 1 and never admitting 2 (needed last): 2 cold misses + every 2 (10).
        assert_eq!(belady_misses(&cyc, 2), 12);
    }

    #[test]
    fn slab_alignment() {
        let s = Slab::new(3, 5000).unwrap();
        assert_eq!(s.slot_size, 5000usize.div_ceil(page()) * page());
        assert!(page() >= 4096 && page().is_power_of_two());
        for i in 0..3 {
            assert_eq!(s.slot_ptr(i) as usize % page(), 0);
        }
    }
}
