//! The expert cache's memory: one 4 KiB-aligned slab of fixed-size slots (each holds one expert
//! read, widened for O_DIRECT), and an O(1) LRU list of slot indices.
//!
//! Contract: slot memory is only written by the reader that owns the slot's in-flight read and only
//! read while the slot is pinned Ready; the store's state machine enforces both.

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
    /// `slots` slots of `slot_size` bytes (rounded up to 4 KiB), 4 KiB-aligned. Pages are committed
    /// lazily by the OS as reads land.
    pub fn new(slots: usize, slot_size: usize) -> std::io::Result<Self> {
        let slot_size = slot_size.div_ceil(4096) * 4096;
        let bytes = slots.checked_mul(slot_size).ok_or_else(|| std::io::Error::other("expert cache size overflows"))?;
        if bytes == 0 {
            return Ok(Slab { ptr: std::ptr::null_mut(), layout: None, slot_size, slots });
        }
        let layout = Layout::from_size_align(bytes, 4096).map_err(|e| std::io::Error::other(e.to_string()))?;
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

impl Drop for Slab {
    fn drop(&mut self) {
        if let Some(l) = self.layout {
            // SAFETY: allocated in `new` with this layout.
            unsafe { dealloc(self.ptr, l) };
        }
    }
}

const NIL: u32 = u32::MAX;

/// Doubly linked list over slot indices: least recently used at the front.
pub struct Lru {
    prev: Vec<u32>,
    next: Vec<u32>,
    linked: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl Lru {
    pub fn new(n: usize) -> Self {
        Lru { prev: vec![NIL; n], next: vec![NIL; n], linked: vec![false; n], head: NIL, tail: NIL, len: 0 }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn contains(&self, i: usize) -> bool {
        self.linked[i]
    }

    /// Marks `i` most recently used.
    pub fn push_back(&mut self, i: usize) {
        if self.linked[i] {
            self.remove(i);
        }
        let i32_ = i as u32;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail != NIL {
            self.next[self.tail as usize] = i32_;
        } else {
            self.head = i32_;
        }
        self.tail = i32_;
        self.linked[i] = true;
        self.len += 1;
    }

    pub fn remove(&mut self, i: usize) {
        if !self.linked[i] {
            return;
        }
        let (p, n) = (self.prev[i], self.next[i]);
        if p != NIL {
            self.next[p as usize] = n;
        } else {
            self.head = n;
        }
        if n != NIL {
            self.prev[n as usize] = p;
        } else {
            self.tail = p;
        }
        self.linked[i] = false;
        self.len -= 1;
    }

    /// Indices from least to most recently used.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let i = cur as usize;
            cur = self.next[i];
            Some(i)
        })
    }

    /// The least recently used index, without removing it.
    pub fn front(&self) -> Option<usize> {
        (self.head != NIL).then_some(self.head as usize)
    }

    /// Removes and returns the least recently used index.
    pub fn pop_front(&mut self) -> Option<usize> {
        if self.head == NIL {
            return None;
        }
        let h = self.head as usize;
        self.remove(h);
        Some(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_order() {
        let mut l = Lru::new(5);
        for i in [3, 1, 4] {
            l.push_back(i);
        }
        l.push_back(3);
        l.remove(4);
        assert_eq!(l.pop_front(), Some(1));
        assert_eq!(l.pop_front(), Some(3));
        assert_eq!(l.pop_front(), None);
        assert!(l.is_empty());
    }

    #[test]
    fn slab_alignment() {
        let s = Slab::new(3, 5000).unwrap();
        assert_eq!(s.slot_size, 8192);
        for i in 0..3 {
            assert_eq!(s.slot_ptr(i) as usize % 4096, 0);
        }
    }
}
