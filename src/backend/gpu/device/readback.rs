//! Results back from the device: waiting for a submission, mapping its readback buffer, and the
//! test hook that makes a readback fail.
//!
//! Contract: a readback returns the words the device wrote or a [`GpuError::Readback`] /
//! [`GpuError::Dispatch`] (a failed wait or mapping, or a device error recorded since the last
//! readback) — never made-up values; a buffer whose readback failed is dropped, not pooled.

use super::{Gpu, GpuError, READBACK, Traffic};

/// How long a readback checks for its result before it blocks until the device is done.
pub(super) const SPIN_WAIT: std::time::Duration = std::time::Duration::from_micros(500);

/// How long a readback waits for its mapping's callback once the device has finished the
/// submission (far longer than it ever takes; past it the readback fails).
const MAP_CALLBACK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Readbacks left before an injected failure (0: none armed); see [`fail_readback_in`].
static FAIL_COUNTDOWN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Test hook: the `n`th readback from now (of any GPU backend in the process; `n` >= 1) fails as
/// a failed mapping would, after its buffer was read and unmapped (so the device stays usable);
/// 0 disarms. `DELTAFIN_GPU_FAIL_READBACK=n` arms it when a backend opens (counting from then).
pub fn fail_readback_in(n: u64) {
    FAIL_COUNTDOWN.store(n, std::sync::atomic::Ordering::SeqCst);
}

/// Whether this readback is the one [`fail_readback_in`] armed (counting it down).
fn injected_failure() -> bool {
    use std::sync::atomic::Ordering::SeqCst;
    FAIL_COUNTDOWN.fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1)).is_ok_and(|n| n == 1)
}

/// The first `floats` words of the mappable buffer `read` once `submission` (None: the latest)
/// has run on `device`; `read` is unmapped again. Checks the device for up to `traffic.spin_ns`
/// before it blocks. A failed wait or mapping, or a device error recorded since the last readback
/// (a failed dispatch: [`Traffic::uncaptured`]), is an error; then `read` may still be mapped or
/// pending and must not be reused.
pub(in crate::backend::gpu) fn map_words(
    device: &wgpu::Device,
    traffic: &Traffic,
    read: &wgpu::Buffer,
    floats: usize,
    submission: Option<wgpu::SubmissionIndex>,
) -> Result<Vec<u32>, GpuError> {
    map_read(device, traffic, read, floats, submission, |bytes| {
        if cfg!(target_endian = "little") {
            let mut v = vec![0u32; bytes.len() / 4];
            super::par_copy(bytemuck::cast_slice_mut::<u32, u8>(&mut v), bytes);
            v
        } else {
            bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        }
    })
}

/// [`map_words`], handing the first `floats` words' bytes of the mapping to `take` (which copies
/// out what it keeps) instead of copying them into one vector.
pub(in crate::backend::gpu) fn map_read<T>(
    device: &wgpu::Device,
    traffic: &Traffic,
    read: &wgpu::Buffer,
    floats: usize,
    submission: Option<wgpu::SubmissionIndex>,
    take: impl FnOnce(&[u8]) -> T,
) -> Result<T, GpuError> {
    use std::sync::atomic::Ordering;
    let waited = std::time::Instant::now();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let failed = std::sync::Arc::new(std::sync::Mutex::new(None::<String>));
    let (flag, fail) = (std::sync::Arc::clone(&done), std::sync::Arc::clone(&failed));
    read.map_async(wgpu::MapMode::Read, .., move |r| {
        if let Err(e) = r {
            *fail.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
        }
        flag.store(true, Ordering::Release);
    });
    // Decode waits on a round trip about thirty times a token, most of them shorter than a
    // blocking wait's wake-up: check for a while before blocking.
    let spin = std::time::Duration::from_nanos(traffic.spin_ns.load(Ordering::Relaxed));
    while !done.load(Ordering::Acquire) && waited.elapsed() < spin {
        if device.poll(wgpu::PollType::Poll).is_err() {
            // The blocking wait below reports it.
            break;
        }
    }
    let wait = if done.load(Ordering::Acquire) {
        Ok(())
    } else {
        device.poll(wgpu::PollType::Wait { submission_index: submission, timeout: None }).map(|_| ())
    };
    let readback = |msg: String| GpuError::Readback { msg };
    wait.map_err(|e| readback(format!("waiting for the device: {e}")))?;
    // The submission has run; the mapping's callback may still be on its way from another
    // thread's poll (the operations of parallel rows poll the same device).
    let mapped = std::time::Instant::now();
    while !done.load(Ordering::Acquire) {
        if mapped.elapsed() > MAP_CALLBACK_WAIT {
            return Err(readback(format!("the buffer was not mapped {MAP_CALLBACK_WAIT:?} after the device finished")));
        }
        device.poll(wgpu::PollType::Poll).map_err(|e| readback(format!("polling the device: {e}")))?;
        std::thread::yield_now();
    }
    let ns = waited.elapsed().as_nanos().min(u64::MAX as u128) as u64;
    traffic.wait_ns.fetch_add(ns, Ordering::Relaxed);
    if let Some(msg) = failed.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(readback(msg));
    }
    let v = match read.get_mapped_range(..) {
        // Copied out across threads (a prefill's readbacks are hundreds of MB: one thread copying
        // them, or faulting in a new vector's pages, ran at 1.8 GB/s on the H200 host).
        Ok(view) => take(&view[..(floats * 4).min(view.len() / 4 * 4)]),
        // Not mapped: nothing to unmap either (unmapping would be one more error).
        Err(e) => return Err(readback(e.to_string())),
    };
    read.unmap();
    traffic.check()?;
    if injected_failure() {
        return Err(readback("injected failure (DELTAFIN_GPU_FAIL_READBACK or gpu::fail_readback_in)".into()));
    }
    Ok(v)
}

/// `DELTAFIN_GPU_FAIL_READBACK=n` (n >= 1): the readback to fail, counted from a backend's open
/// ([`fail_readback_in`]); another value says so in a warning and arms nothing.
pub(in crate::backend::gpu) fn fail_readback_wanted() -> Option<u64> {
    let v = std::env::var("DELTAFIN_GPU_FAIL_READBACK").ok()?;
    match v.trim().parse::<u64>() {
        Ok(n) if n > 0 => Some(n),
        _ => {
            tracing::warn!(
                "DELTAFIN_GPU_FAIL_READBACK={v:?} is not a readback number (1, 2, ...); nothing is injected"
            );
            None
        }
    }
}

impl Gpu {
    /// Submits `encoder` after copying `out` to a mapped buffer; returns its floats.
    pub(in crate::backend::gpu) fn finish(
        &self,
        encoder: wgpu::CommandEncoder,
        out: &wgpu::Buffer,
        floats: usize,
    ) -> Result<Vec<f32>, GpuError> {
        let size = (floats.max(1) * 4) as u64;
        Ok(self.finish_many(encoder, &[(out, size)])?.into_iter().take(floats).collect())
    }

    /// Submits `encoder` after copying each (buffer, bytes) in turn into one mapped buffer (one
    /// readback for many products); returns the floats of all of them, in order.
    pub(in crate::backend::gpu) fn finish_many(
        &self,
        mut encoder: wgpu::CommandEncoder,
        outs: &[(&wgpu::Buffer, u64)],
    ) -> Result<Vec<f32>, GpuError> {
        let total: u64 = outs.iter().map(|(_, n)| n).sum::<u64>().max(4);
        let floats = (total / 4) as usize;
        let read = self.take(READBACK, total);
        let mut at = 0;
        for (b, n) in outs {
            encoder.copy_buffer_to_buffer(b, 0, &read, at, *n);
            at += n;
        }
        self.traffic.submitted(total);
        self.queue.submit([encoder.finish()]);
        let v = map_read(&self.device, &self.traffic, &read, floats, None, super::floats_of)?;
        self.give(READBACK, read);
        Ok(v)
    }

    /// Submits `encoder` after copying each (buffer, words) to a mapped buffer; returns their
    /// 32-bit words.
    pub(in crate::backend::gpu) fn finish_words(
        &self,
        mut encoder: wgpu::CommandEncoder,
        outs: &[(&wgpu::Buffer, usize)],
    ) -> Result<Vec<Vec<u32>>, GpuError> {
        let reads: Vec<(wgpu::Buffer, usize)> = outs
            .iter()
            .map(|&(out, words)| {
                let size = (words.max(1) * 4) as u64;
                let read = self.take(READBACK, size);
                encoder.copy_buffer_to_buffer(out, 0, &read, 0, size);
                (read, words)
            })
            .collect();
        self.traffic.submitted(reads.iter().map(|(_, w)| (w.max(&1) * 4) as u64).sum());
        self.queue.submit([encoder.finish()]);
        // Every buffer is read (and given back) even after one failed, then the first error wins.
        let got: Vec<Result<Vec<u32>, GpuError>> =
            reads.into_iter().map(|(read, words)| self.read_back(read, words, None)).collect();
        got.into_iter().collect()
    }

    /// The first `floats` words of `read` once `submission` (None: the latest) has run; gives
    /// `read` back to the pool (on an error it is dropped instead: it may still be mapped).
    pub(in crate::backend::gpu) fn read_back(
        &self,
        read: wgpu::Buffer,
        floats: usize,
        submission: Option<wgpu::SubmissionIndex>,
    ) -> Result<Vec<u32>, GpuError> {
        let v = map_words(&self.device, &self.traffic, &read, floats, submission)?;
        self.give(READBACK, read);
        Ok(v)
    }
}
