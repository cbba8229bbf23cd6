//! Per-sequence state kept in device memory between calls: the GPU's [`DeviceCopy`] of a
//! [`crate::backend::StateBuf`] (the KDA state S of one layer of one sequence) and the mirror of
//! an MLA latent cache ([`LatentMirror`]).
//!
//! Contract: a [`DeviceState`] is one storage buffer of the state's floats on the device that
//! made it (`Gpu::id`); reading it back is one copy and one submission, counted as readback. A
//! [`LatentMirror`] holds a valid prefix of its cache and uploads only the floats past it. Both
//! count in `Traffic::resident_state_bytes` while they live.

use super::device::{Gpu, READBACK, Traffic, map_words};
use crate::backend::state_buf::DeviceCopy;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

/// A storage buffer of sequence state on one device, counted in
/// `Traffic::resident_state_bytes` from its allocation until it is dropped.
pub(super) struct SeqBuffer {
    pub buf: wgpu::Buffer,
    gpu_id: u64,
    traffic: Arc<Traffic>,
}

impl SeqBuffer {
    /// Room for `floats` values (whole 16-byte words), or None when the device is out of memory
    /// (the caller keeps the state on the host and runs the CPU kernel).
    fn new(gpu: &Gpu, label: &str, floats: usize, usage: wgpu::BufferUsages) -> Option<Self> {
        let size = (floats.max(4) * 4).div_ceil(16) as u64 * 16;
        let scope = gpu.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buf = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage,
            mapped_at_creation: false,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                tracing::warn!("GPU out of memory for sequence state ({e}); such state stays on the CPU")
            });
            return None;
        }
        gpu.traffic.resident_state_bytes.fetch_add(size, Relaxed);
        Some(SeqBuffer { buf, gpu_id: gpu.id, traffic: gpu.traffic.clone() })
    }

    fn of(&self, gpu: &Gpu) -> bool {
        self.gpu_id == gpu.id
    }
}

impl Drop for SeqBuffer {
    fn drop(&mut self) {
        self.traffic.resident_state_bytes.fetch_sub(self.buf.size(), Relaxed);
    }
}

pub(super) struct DeviceState {
    pub mem: SeqBuffer,
    floats: usize,
    device: wgpu::Device,
    queue: wgpu::Queue,
}

impl DeviceState {
    /// Uninitialised storage for `floats` values (the kernel that writes it writes every one);
    /// None when the device is out of memory.
    pub fn new(gpu: &Gpu, floats: usize) -> Option<Self> {
        let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC;
        let mem = SeqBuffer::new(gpu, "resident state", floats, usage)?;
        Some(DeviceState { mem, floats, device: gpu.device.clone(), queue: gpu.queue.clone() })
    }

    /// `copy`'s buffer if it is a state of `gpu` with room for `floats` values.
    pub fn of<'a>(gpu: &Gpu, copy: &'a dyn DeviceCopy, floats: usize) -> Option<&'a wgpu::Buffer> {
        let s = copy.as_any().downcast_ref::<DeviceState>()?;
        (s.mem.of(gpu) && s.floats == floats).then_some(&s.mem.buf)
    }
}

impl DeviceCopy for DeviceState {
    fn read(&self, out: &mut [f32]) -> Result<(), crate::backend::BackendError> {
        let size = self.mem.buf.size();
        let read = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("state readback"),
            size,
            usage: READBACK,
            mapped_at_creation: false,
        });
        let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        enc.copy_buffer_to_buffer(&self.mem.buf, 0, &read, 0, size);
        self.mem.traffic.submitted(size);
        let idx = self.queue.submit([enc.finish()]);
        let words = map_words(&self.device, &self.mem.traffic, &read, self.floats, Some(idx))?;
        for (o, w) in out.iter_mut().zip(words) {
            *o = f32::from_bits(w);
        }
        Ok(())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// The device copy of an MLA latent cache's prefix ([`crate::backend::AppendBuf`]): room for
/// `capacity` floats, grown by doubling (the valid prefix copied on the device).
pub(super) struct LatentMirror {
    mem: SeqBuffer,
    capacity: usize,
}

impl crate::backend::append_buf::DeviceMirror for LatentMirror {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl LatentMirror {
    fn new(gpu: &Gpu, capacity: usize) -> Option<Self> {
        let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC;
        Some(LatentMirror { mem: SeqBuffer::new(gpu, "latent cache", capacity, usage)?, capacity })
    }

    fn ours<'a>(gpu: &Gpu, m: &'a crate::backend::append_buf::Mirror) -> Option<&'a LatentMirror> {
        m.copy.as_any().downcast_ref::<LatentMirror>().filter(|l| l.mem.of(gpu))
    }

    /// Brings `cache`'s mirror up to date (made or grown as needed, then only the floats past its
    /// valid prefix uploaded) and runs `f` with its buffer while the mirror is locked; None (and
    /// `f` not run) when the device has no memory for it.
    pub fn with<R>(gpu: &Gpu, cache: &crate::backend::AppendBuf, f: impl FnOnce(&wgpu::Buffer) -> R) -> Option<R> {
        let len = cache.len();
        let mut guard = cache.mirror();
        let fits = guard.as_ref().and_then(|m| Self::ours(gpu, m)).is_some_and(|l| l.capacity >= len);
        if !fits {
            // Double past what is needed, within one binding; the old valid prefix moves on the device.
            // Whole 16-byte words: the buffer's padded size must stay within one binding.
            let max = (gpu.summary.max_binding / 16 * 4) as usize;
            let capacity = (len.max(1024) * 2).min(max).max(len);
            let grown = LatentMirror::new(gpu, capacity)?;
            let mut valid = 0;
            if let Some((old, v)) = guard.as_ref().and_then(|m| Self::ours(gpu, m).map(|l| (l, m.valid)))
                && v > 0
            {
                let mut enc = gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
                enc.copy_buffer_to_buffer(&old.mem.buf, 0, &grown.mem.buf, 0, (v * 4) as u64);
                gpu.traffic.submitted(0);
                gpu.queue.submit([enc.finish()]);
                valid = v;
            }
            *guard = Some(crate::backend::append_buf::Mirror { copy: Box::new(grown), valid });
        }
        let Some(m) = guard.as_mut() else { unreachable!("the mirror was made just above") };
        let Some(l) = Self::ours(gpu, m) else { unreachable!("the mirror is this device's") };
        let valid = m.valid.min(len);
        if valid < len {
            let bytes = super::device::f32_bytes(&cache[valid..len]);
            gpu.traffic.uploaded(bytes.len() as u64);
            gpu.queue.write_buffer(&l.mem.buf, (valid * 4) as u64, &bytes);
        }
        let r = f(&l.mem.buf);
        m.valid = len;
        Some(r)
    }
}
