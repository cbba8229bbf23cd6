//! Recurrent state kept in device memory between calls: the GPU's [`DeviceCopy`] of a
//! [`crate::backend::StateBuf`] (the KDA state S of one layer of one sequence).
//!
//! Contract: a [`DeviceState`] is one storage buffer of the state's floats on the device that
//! made it (`Gpu::id`), counted in `Traffic::resident_state_bytes` while it lives; reading it back
//! is one copy and one submission, counted as readback.

use super::device::{Gpu, READBACK, Traffic};
use crate::backend::state_buf::DeviceCopy;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

pub(super) struct DeviceState {
    pub buf: wgpu::Buffer,
    floats: usize,
    gpu_id: u64,
    device: wgpu::Device,
    queue: wgpu::Queue,
    traffic: Arc<Traffic>,
}

impl DeviceState {
    /// Uninitialised storage for `floats` values (the kernel that writes it writes every one).
    pub fn new(gpu: &Gpu, floats: usize) -> Self {
        let size = (floats.max(1) * 4).div_ceil(16) as u64 * 16;
        let buf = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("resident state"),
            size,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        gpu.traffic.resident_state_bytes.fetch_add(size, Relaxed);
        DeviceState {
            buf,
            floats,
            gpu_id: gpu.id,
            device: gpu.device.clone(),
            queue: gpu.queue.clone(),
            traffic: gpu.traffic.clone(),
        }
    }

    /// `copy`'s buffer if it is a state of `gpu` with room for `floats` values.
    pub fn of<'a>(gpu: &Gpu, copy: &'a dyn DeviceCopy, floats: usize) -> Option<&'a wgpu::Buffer> {
        let s = copy.as_any().downcast_ref::<DeviceState>()?;
        (s.gpu_id == gpu.id && s.floats == floats).then_some(&s.buf)
    }
}

impl Drop for DeviceState {
    fn drop(&mut self) {
        self.traffic.resident_state_bytes.fetch_sub(self.buf.size(), Relaxed);
    }
}

impl DeviceCopy for DeviceState {
    fn device_id(&self) -> u64 {
        self.gpu_id
    }

    fn read(&self, out: &mut [f32]) {
        let size = self.buf.size();
        let read = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("state readback"),
            size,
            usage: READBACK,
            mapped_at_creation: false,
        });
        let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        enc.copy_buffer_to_buffer(&self.buf, 0, &read, 0, size);
        self.traffic.submitted(size);
        let idx = self.queue.submit([enc.finish()]);
        read.map_async(wgpu::MapMode::Read, .., |r| {
            if let Err(e) = r {
                tracing::error!("GPU state readback failed: {e}");
            }
        });
        if let Err(e) = self.device.poll(wgpu::PollType::Wait { submission_index: Some(idx), timeout: None }) {
            tracing::error!("GPU wait failed: {e}");
        }
        match read.get_mapped_range(..) {
            Ok(view) => {
                for (o, c) in out.iter_mut().zip(view.chunks_exact(4)).take(self.floats) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            Err(e) => {
                tracing::error!("GPU state readback failed: {e}");
                out.fill(f32::NAN);
            }
        }
        read.unmap();
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
