//! Host <-> device copy rates for `bench kernels --backend gpu` (its record's `transfer`): what
//! each way of moving a prefill's activations costs on this host, so that the backend's choice
//! (`device/staging.rs`) can be checked on a new machine.
//!
//! Contract: every rate is the best of three rounds over buffers made for the measurement;
//! nothing is left mapped or pooled.

use super::device::Gpu;
use std::time::Instant;

/// Host <-> device transfer rates of `bytes`-byte buffers, in GB/s, each the best of three:
/// the paths the backend uses (a queued write into a storage buffer; a copy into a mapped
/// readback buffer, then its words copied out) split into their steps, against a reused
/// MAP_WRITE staging buffer copied on the device, and the host's own memcpy into a fresh and a
/// reused vector (what a readback's copy-out costs at best).
#[derive(Debug, Default, serde::Serialize)]
pub struct TransferRates {
    pub bytes: u64,
    pub queued_write_gb_s: f64,
    pub mapped_write_copy_gb_s: f64,
    pub mapped_write_map_s: f64,
    pub mapped_write_dma_gb_s: f64,
    pub readback_dma_gb_s: f64,
    pub readback_map_s: f64,
    pub readback_copy_out_gb_s: f64,
    pub readback_copy_out_threads_gb_s: f64,
    pub host_memcpy_fresh_gb_s: f64,
    pub host_memcpy_reused_gb_s: f64,
    pub host_memcpy_fresh_threads_gb_s: f64,
    /// Into a fresh mapping advised to use transparent huge pages (Linux; elsewhere plain).
    pub host_memcpy_fresh_huge_gb_s: f64,
    pub mapped_write_copy_threads_gb_s: f64,
}

impl Gpu {
    fn wait_idle(&self) {
        let _ = self.device.poll(wgpu::PollType::Wait { submission_index: None, timeout: None });
    }

    fn map_wait(&self, b: &wgpu::Buffer, mode: wgpu::MapMode) {
        b.map_async(mode, .., |_| {});
        self.wait_idle();
    }

    pub fn transfer_rates(&self, bytes: usize) -> TransferRates {
        use rayon::prelude::*;
        let bytes = bytes / 16 * 16;
        let gb = |s: f64| bytes as f64 / s / 1e9;
        let src: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8).collect();
        let usage = |u| wgpu::BufferDescriptor {
            label: Some("transfer"),
            size: bytes as u64,
            usage: u,
            mapped_at_creation: false,
        };
        let dst = self.device.create_buffer(&usage(
            wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
        ));
        let up = self.device.create_buffer(&usage(wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC));
        let down = self.device.create_buffer(&usage(wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST));
        let mut r = TransferRates { bytes: bytes as u64, ..Default::default() };
        let best = |v: &mut f64, x: f64| *v = if *v == 0.0 { x } else { v.min(x) };
        let (mut qw, mut wc, mut wm, mut wd, mut rd, mut rm, mut rc, mut rt, mut hf, mut hr) =
            (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
        let (mut ft, mut fh, mut wt) = (0.0, 0.0, 0.0);
        let mut reused = vec![0u8; bytes];
        for _ in 0..3 {
            let t = Instant::now();
            self.queue.write_buffer(&dst, 0, &src);
            self.queue.submit([]);
            self.wait_idle();
            best(&mut qw, t.elapsed().as_secs_f64());

            let t = Instant::now();
            self.map_wait(&up, wgpu::MapMode::Write);
            best(&mut wm, t.elapsed().as_secs_f64());
            let t = Instant::now();
            if let Ok(mut view) = up.get_mapped_range_mut(..) {
                view.copy_from_slice(&src);
            }
            best(&mut wc, t.elapsed().as_secs_f64());
            up.unmap();
            let t = Instant::now();
            let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
            enc.copy_buffer_to_buffer(&up, 0, &dst, 0, bytes as u64);
            self.queue.submit([enc.finish()]);
            self.wait_idle();
            best(&mut wd, t.elapsed().as_secs_f64());

            let t = Instant::now();
            let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
            enc.copy_buffer_to_buffer(&dst, 0, &down, 0, bytes as u64);
            self.queue.submit([enc.finish()]);
            self.wait_idle();
            best(&mut rd, t.elapsed().as_secs_f64());
            let t = Instant::now();
            self.map_wait(&down, wgpu::MapMode::Read);
            best(&mut rm, t.elapsed().as_secs_f64());
            if let Ok(view) = down.get_mapped_range(..) {
                let t = Instant::now();
                let mut fresh = vec![0u8; bytes];
                fresh.copy_from_slice(&view);
                best(&mut rc, t.elapsed().as_secs_f64());
                let t = Instant::now();
                reused.par_chunks_mut(1 << 20).zip(view.par_chunks(1 << 20)).for_each(|(d, s)| d.copy_from_slice(s));
                best(&mut rt, t.elapsed().as_secs_f64());
                std::hint::black_box(&fresh);
            }
            down.unmap();

            let t = Instant::now();
            let mut fresh = vec![0u8; bytes];
            fresh.copy_from_slice(&src);
            best(&mut hf, t.elapsed().as_secs_f64());
            std::hint::black_box(&fresh);
            let t = Instant::now();
            reused.copy_from_slice(&src);
            best(&mut hr, t.elapsed().as_secs_f64());
            let t = Instant::now();
            let mut fresh = vec![0u8; bytes];
            fresh.par_chunks_mut(1 << 20).zip(src.par_chunks(1 << 20)).for_each(|(d, s)| d.copy_from_slice(s));
            best(&mut ft, t.elapsed().as_secs_f64());
            std::hint::black_box(&fresh);
            drop(fresh);
            let t = Instant::now();
            // SAFETY: a private anonymous mapping of `len` bytes, written only inside it and unmapped once.
            unsafe {
                let len = bytes.div_ceil(2 << 20) * (2 << 20);
                let p = libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                );
                if p != libc::MAP_FAILED {
                    // Transparent huge pages are Linux's (macOS: a plain fresh mapping).
                    #[cfg(target_os = "linux")]
                    libc::madvise(p, len, libc::MADV_HUGEPAGE);
                    std::ptr::copy_nonoverlapping(src.as_ptr(), p as *mut u8, bytes);
                    best(&mut fh, t.elapsed().as_secs_f64());
                    libc::munmap(p, len);
                }
            }
            self.map_wait(&up, wgpu::MapMode::Write);
            let t = Instant::now();
            if let Ok(mut view) = up.get_mapped_range_mut(..) {
                super::device::write_mapped(&mut view, 0, &src);
            }
            best(&mut wt, t.elapsed().as_secs_f64());
            up.unmap();
        }
        r.host_memcpy_fresh_threads_gb_s = gb(ft);
        r.host_memcpy_fresh_huge_gb_s = gb(fh);
        r.mapped_write_copy_threads_gb_s = gb(wt);
        r.queued_write_gb_s = gb(qw);
        r.mapped_write_map_s = wm;
        r.mapped_write_copy_gb_s = gb(wc);
        r.mapped_write_dma_gb_s = gb(wd);
        r.readback_dma_gb_s = gb(rd);
        r.readback_map_s = rm;
        r.readback_copy_out_gb_s = gb(rc);
        r.readback_copy_out_threads_gb_s = gb(rt);
        r.host_memcpy_fresh_gb_s = gb(hf);
        r.host_memcpy_reused_gb_s = gb(hr);
        r
    }
}
