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

    /// In phases, three rounds of: [`Gpu::time_writes`], [`Gpu::time_readback`],
    /// [`time_host_copies`], then the mapped staging buffer written on threads; each rate from
    /// its step's best round.
    pub fn transfer_rates(&self, bytes: usize) -> TransferRates {
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
        let mut b = Best::default();
        let mut reused = vec![0u8; bytes];
        for _ in 0..3 {
            self.time_writes(&src, &dst, &up, &mut b);
            self.time_readback(&dst, &down, &mut reused, &mut b);
            time_host_copies(&src, &mut reused, &mut b);
            // The mapped staging buffer written on threads (`write_mapped`).
            self.map_wait(&up, wgpu::MapMode::Write);
            let t = Instant::now();
            if let Ok(mut view) = up.get_mapped_range_mut(..) {
                super::device::write_mapped(&mut view, 0, &src);
            }
            best(&mut b.wt, t.elapsed().as_secs_f64());
            up.unmap();
        }
        r.host_memcpy_fresh_threads_gb_s = gb(b.ft);
        r.host_memcpy_fresh_huge_gb_s = gb(b.fh);
        r.mapped_write_copy_threads_gb_s = gb(b.wt);
        r.queued_write_gb_s = gb(b.qw);
        r.mapped_write_map_s = b.wm;
        r.mapped_write_copy_gb_s = gb(b.wc);
        r.mapped_write_dma_gb_s = gb(b.wd);
        r.readback_dma_gb_s = gb(b.rd);
        r.readback_map_s = b.rm;
        r.readback_copy_out_gb_s = gb(b.rc);
        r.readback_copy_out_threads_gb_s = gb(b.rt);
        r.host_memcpy_fresh_gb_s = gb(b.hf);
        r.host_memcpy_reused_gb_s = gb(b.hr);
        r
    }

    /// A round's writes of `src`: queued into `dst` (`qw`); `up` mapped (`wm`), `src` copied into
    /// it (`wc`), then `up` copied into `dst` on the device (`wd`).
    fn time_writes(&self, src: &[u8], dst: &wgpu::Buffer, up: &wgpu::Buffer, b: &mut Best) {
        let bytes = src.len();
        let t = Instant::now();
        self.queue.write_buffer(dst, 0, src);
        self.queue.submit([]);
        self.wait_idle();
        best(&mut b.qw, t.elapsed().as_secs_f64());

        let t = Instant::now();
        self.map_wait(up, wgpu::MapMode::Write);
        best(&mut b.wm, t.elapsed().as_secs_f64());
        let t = Instant::now();
        if let Ok(mut view) = up.get_mapped_range_mut(..) {
            view.copy_from_slice(src);
        }
        best(&mut b.wc, t.elapsed().as_secs_f64());
        up.unmap();
        let t = Instant::now();
        let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        enc.copy_buffer_to_buffer(up, 0, dst, 0, bytes as u64);
        self.queue.submit([enc.finish()]);
        self.wait_idle();
        best(&mut b.wd, t.elapsed().as_secs_f64());
    }

    /// A round's readback: `dst` copied into `down` on the device (`rd`), `down` mapped (`rm`),
    /// its bytes copied out into a fresh vector (`rc`) and, on threads, into `reused` (`rt`).
    fn time_readback(&self, dst: &wgpu::Buffer, down: &wgpu::Buffer, reused: &mut [u8], b: &mut Best) {
        use rayon::prelude::*;
        let bytes = reused.len();
        let t = Instant::now();
        let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        enc.copy_buffer_to_buffer(dst, 0, down, 0, bytes as u64);
        self.queue.submit([enc.finish()]);
        self.wait_idle();
        best(&mut b.rd, t.elapsed().as_secs_f64());
        let t = Instant::now();
        self.map_wait(down, wgpu::MapMode::Read);
        best(&mut b.rm, t.elapsed().as_secs_f64());
        if let Ok(view) = down.get_mapped_range(..) {
            let t = Instant::now();
            let mut fresh = vec![0u8; bytes];
            fresh.copy_from_slice(&view);
            best(&mut b.rc, t.elapsed().as_secs_f64());
            let t = Instant::now();
            reused.par_chunks_mut(1 << 20).zip(view.par_chunks(1 << 20)).for_each(|(d, s)| d.copy_from_slice(s));
            best(&mut b.rt, t.elapsed().as_secs_f64());
            std::hint::black_box(&fresh);
        }
        down.unmap();
    }
}

/// The best (least) seconds of each step over the rounds, 0 until a round has run: queued write
/// (`qw`); mapped write: map (`wm`), copy (`wc`), DMA (`wd`), copy on threads (`wt`); readback:
/// DMA (`rd`), map (`rm`), copy-out (`rc`), on threads (`rt`); host memcpy: fresh (`hf`), reused
/// (`hr`), fresh on threads (`ft`), fresh huge-page mapping (`fh`).
#[derive(Default)]
struct Best {
    qw: f64,
    wc: f64,
    wm: f64,
    wd: f64,
    rd: f64,
    rm: f64,
    rc: f64,
    rt: f64,
    hf: f64,
    hr: f64,
    ft: f64,
    fh: f64,
    wt: f64,
}

/// Keeps the least of `v` and `x` in `v` (`x` when `v` is still 0).
fn best(v: &mut f64, x: f64) {
    *v = if *v == 0.0 { x } else { v.min(x) };
}

/// A round's host copies of `src`: into a fresh vector (`hf`), into `reused` (`hr`), into a fresh
/// vector on threads (`ft`), into a fresh mapping advised to use huge pages (`fh`).
fn time_host_copies(src: &[u8], reused: &mut [u8], b: &mut Best) {
    use rayon::prelude::*;
    let bytes = src.len();
    let t = Instant::now();
    let mut fresh = vec![0u8; bytes];
    fresh.copy_from_slice(src);
    best(&mut b.hf, t.elapsed().as_secs_f64());
    std::hint::black_box(&fresh);
    let t = Instant::now();
    reused.copy_from_slice(src);
    best(&mut b.hr, t.elapsed().as_secs_f64());
    let t = Instant::now();
    let mut fresh = vec![0u8; bytes];
    fresh.par_chunks_mut(1 << 20).zip(src.par_chunks(1 << 20)).for_each(|(d, s)| d.copy_from_slice(s));
    best(&mut b.ft, t.elapsed().as_secs_f64());
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
            best(&mut b.fh, t.elapsed().as_secs_f64());
            libc::munmap(p, len);
        }
    }
}
