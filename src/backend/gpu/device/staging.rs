//! Host <-> device copies of a prefill's sizes: uploads through pooled, persistently mapped
//! staging buffers filled across threads, and readbacks copied out of the mapping across threads.
//!
//! Why: on the H200 host (`bench kernels --backend gpu`, `transfer` in its record) a queued write
//! moved 3.7 GB/s and a one-thread copy out of a mapping, or into a freshly allocated vector
//! (page faults), 1.8 GB/s, while a mapped staging buffer filled by 16 threads took 31 GB/s and a
//! threaded copy-out 17-44 GB/s: batched prefill moves GBs a layer, so these copies were most of
//! its wall time.
//!
//! Contract: [`Gpu::mapped`] hands out a MAP_WRITE | COPY_SRC buffer that is mapped now
//! ([`Gpu::mapped_as`]: of another mappable usage, such as the unified-memory expert arenas of
//! [`UMA_ARENA`], which the kernels read where the host wrote them); [`Gpu::remap`] takes it back
//! once the submissions using it are submitted (it is mapped again when the device is done with
//! it and only then handed out again; one whose mapping fails is dropped), [`Gpu::keep_mapped`]
//! one that no submission used.
//! Copies below [`PAR_MIN`] bytes stay on the calling thread. Bytes are copied as they are (the
//! device's words are little-endian, as is every host this runs on; others convert).

use super::Gpu;
use rayon::prelude::*;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Bytes from which a copy is split across threads (below, the hand-off costs more).
pub(in crate::backend::gpu) const PAR_MIN: usize = 1 << 20;
/// Bytes each thread copies at a time.
const PIECE: usize = 1 << 20;
/// Mapped buffers kept per size class (of large ones, no more than [`KEEP_BYTES`] together).
const KEEP: usize = 32;
const KEEP_BYTES: u64 = 1 << 30;

pub(in crate::backend::gpu) const MAPPED: wgpu::BufferUsages =
    wgpu::BufferUsages::MAP_WRITE.union(wgpu::BufferUsages::COPY_SRC);

/// A storage buffer the host writes through a mapping (`MAPPABLE_PRIMARY_BUFFERS`): on unified
/// memory the expert images of a group are written straight into one and the kernels read them
/// there (Metal: shared storage; Vulkan: host-visible memory).
pub(in crate::backend::gpu) const UMA_ARENA: wgpu::BufferUsages =
    wgpu::BufferUsages::MAP_WRITE.union(wgpu::BufferUsages::STORAGE);

/// Mapped buffers ready to be written, by (usage bits, size).
type Free = Mutex<HashMap<(u32, u64), Vec<wgpu::Buffer>>>;

#[derive(Default)]
pub(super) struct MappedPool {
    free: Arc<Free>,
}

/// Buffers of `size` bytes a pool keeps.
fn keep(size: u64) -> usize {
    ((KEEP_BYTES / size.max(1)) as usize).clamp(2, KEEP)
}

/// Puts mapped `b` back into `free` (dropped when its class is full).
fn put_back(free: &Free, b: wgpu::Buffer) {
    if let Ok(mut m) = free.lock() {
        let v = m.entry((b.usage().bits(), b.size())).or_default();
        if v.len() < keep(b.size()) {
            v.push(b);
        }
    }
}

/// `src` copied into `dst` (at least as long) at byte `at`, across threads when large.
pub(in crate::backend::gpu) fn write_mapped(dst: &mut wgpu::BufferViewMut, at: usize, src: &[u8]) {
    let mut view = dst.slice(at..at + src.len());
    if src.len() < PAR_MIN {
        view.copy_from_slice(src);
        return;
    }
    let base = view.as_raw_ptr().cast::<u8>().as_ptr() as usize;
    src.par_chunks(PIECE).enumerate().for_each(|(i, s)| {
        // SAFETY: piece i writes only bytes [i * PIECE, i * PIECE + s.len()) of `view`, which is
        // `src.len()` bytes long (the slice above checked it against the mapping) and borrowed
        // exclusively by this call until every piece is written; pieces are disjoint.
        unsafe { std::ptr::copy_nonoverlapping(s.as_ptr(), (base as *mut u8).add(i * PIECE), s.len()) }
    });
}

/// `src` copied into `dst` (same length), across threads when large.
pub(in crate::backend::gpu) fn par_copy<T: Copy + Send + Sync>(dst: &mut [T], src: &[T]) {
    let bytes = std::mem::size_of_val(src);
    if bytes < PAR_MIN {
        dst.copy_from_slice(src);
        return;
    }
    let n = (PIECE / std::mem::size_of::<T>().max(1)).max(1);
    dst.par_chunks_mut(n).zip(src.par_chunks(n)).for_each(|(d, s)| d.copy_from_slice(s));
}

/// The little-endian words of `bytes` as floats in a new vector (a mapped readback's copy-out).
pub(in crate::backend::gpu) fn floats_of(bytes: &[u8]) -> Vec<f32> {
    let n = bytes.len() / 4;
    let mut v = vec![0f32; n];
    if cfg!(target_endian = "little") {
        par_copy(bytemuck::cast_slice_mut::<f32, u8>(&mut v), &bytes[..n * 4]);
    } else {
        for (o, c) in v.iter_mut().zip(bytes.chunks_exact(4)) {
            *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
    }
    v
}

impl Gpu {
    /// A staging buffer of at least `size` bytes, mapped for writing now.
    pub(in crate::backend::gpu) fn mapped(&self, size: u64) -> wgpu::Buffer {
        self.mapped_as(MAPPED, size)
    }

    /// A buffer of `usage` (which includes MAP_WRITE) of at least `size` bytes, mapped for
    /// writing now: one the pool holds, else (after letting the device hand back those it is
    /// done with) a new one.
    pub(in crate::backend::gpu) fn mapped_as(&self, usage: wgpu::BufferUsages, size: u64) -> wgpu::Buffer {
        let size = super::pool_size(size.max(16), self.summary.max_binding).div_ceil(16) * 16;
        let key = (usage.bits(), size);
        let ready = || self.mapped_pool.free.lock().ok().and_then(|mut m| m.get_mut(&key).and_then(|v| v.pop()));
        if let Some(b) = ready() {
            return b;
        }
        // A large buffer the device finished with may only wait for its mapping's callback.
        if size >= PAR_MIN as u64 {
            let _ = self.device.poll(wgpu::PollType::Poll);
            if let Some(b) = ready() {
                return b;
            }
        }
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(if usage == UMA_ARENA { "expert arena (unified memory)" } else { "staging" }),
            size,
            usage,
            mapped_at_creation: true,
        })
    }

    /// Takes back a buffer of [`Gpu::mapped_as`] whose submissions have been submitted: mapped
    /// again once the device has run them, then handed out again.
    pub(in crate::backend::gpu) fn remap(&self, b: wgpu::Buffer) {
        let free = Arc::clone(&self.mapped_pool.free);
        let again = b.clone();
        b.map_async(wgpu::MapMode::Write, .., move |r| {
            if r.is_ok() {
                put_back(&free, again);
            }
        });
    }

    /// Takes back a buffer of [`Gpu::mapped_as`] that is still mapped (no submission used it).
    pub(in crate::backend::gpu) fn keep_mapped(&self, b: wgpu::Buffer) {
        put_back(&self.mapped_pool.free, b);
    }

    /// `bytes` in a staging buffer of [`Gpu::mapped`], zero-padded to a multiple of `pad` bytes
    /// (4 or 16), and unmapped: copy its first `padded` bytes (the second value) on the device,
    /// then give it to [`Gpu::remap`]. A mapping that fails is recorded as a device error (the
    /// next readback fails with it; the copy then carries stale bytes nobody reads).
    pub(in crate::backend::gpu) fn fill(&self, bytes: &[u8], pad: usize) -> (wgpu::Buffer, u64) {
        let len = bytes.len().div_ceil(pad).max(1) * pad;
        let staging = self.fill_with(len, |view| {
            let whole = bytes.len() / pad * pad;
            write_mapped(view, 0, &bytes[..whole]);
            if whole < len {
                let mut tail = [0u8; 16];
                tail[..bytes.len() - whole].copy_from_slice(&bytes[whole..]);
                write_mapped(view, whole, &tail[..len - whole]);
            }
        });
        (staging, len as u64)
    }

    /// A staging buffer of [`Gpu::mapped`] whose first `len` bytes `write` fills (through
    /// [`write_mapped`]), unmapped; a mapping that fails is recorded as [`Gpu::fill`] says.
    pub(in crate::backend::gpu) fn fill_with(
        &self,
        len: usize,
        write: impl FnOnce(&mut wgpu::BufferViewMut),
    ) -> wgpu::Buffer {
        let staging = self.mapped(len as u64);
        match staging.get_mapped_range_mut(..len as u64) {
            Ok(mut view) => write(&mut view),
            Err(e) => self.traffic.record_failure(format!("mapping a staging buffer for an upload: {e}")),
        }
        staging.unmap();
        staging
    }
}
