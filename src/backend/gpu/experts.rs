//! The batched routed-expert path: a layer's experts are queued as they land and run in groups of
//! one submission each — w1 and w3 of every expert, SiTU written in the MXFP4 input order, then w2
//! — with one readback. A submitted group runs while the next group's experts are still read and
//! uploaded; a group is read back only when the one after it is submitted (or at `finish`).
//! Experts of one input row each (decode) run as two dispatches per image buffer and one between
//! them: every w1 and w3 of the buffer's experts in one, SiTU over the whole group, every w2 in
//! one (`Gpu::encode_image_matvecs`); images come from the device cache's arenas (a few large
//! buffers) or the group's staging arena, so a group's images are in a few buffers. Otherwise
//! (several rows) each product is its own dispatch.
//!
//! Contract: every product is the same kernel on the same bytes and inputs as
//! `GpuBackend::matmul_mxfp4`, and SiTU is the `ops` kernel, so the outputs equal the per-expert
//! path on the GPU bit for bit (the CPU's bits where fma is fused); outputs come back in the order
//! the experts were queued. An expert's bytes are copied before `add` returns (the store may
//! reuse its buffer at once): its six records at 16-byte-aligned offsets of one image, in a slot
//! of the device expert cache when it is admitted there (`expert_cache.rs`), else in a slot of
//! the group's arena. How they get there: on unified memory (`device/uma.rs`) an arena slot is
//! written once, straight from the store's bytes into the arena's mapping, which the kernels then
//! read (no staging buffer, no copy on the device, no submission per expert; the arena is unmapped
//! when its group is submitted); otherwise, and for a cache slot, the image is written into a
//! mapped staging buffer and copied into place on the device, submitted at once, so host staging
//! memory stays about one expert. The traffic counters say which way each byte went. Device
//! memory besides the cache: at most two groups' arenas ([`staging_bytes`]).

use super::GpuBackend;
use super::device::{
    Chunk, Gpu, GpuError, Kind, MatvecJob, OUTPUT, READBACK, Resident, STAGED, Stamp, UMA_ARENA, floats_of, map_read,
    write_mapped,
};
use super::expert_cache::Place;
use crate::backend::{BackendError, ExpertBatch, ExpertLayout, Situ};
use std::collections::VecDeque;

/// Experts per group (one submission): a decode step's 16 routed experts in one group.
const GROUP: usize = 16;

/// Where each of the six records goes in an expert's image, and the image's size.
pub(super) fn slot_layout(l: &ExpertLayout) -> ([usize; 6], usize) {
    let mut offs = [0usize; 6];
    let mut at = 0;
    for (o, (_, len)) in offs.iter_mut().zip(l.parts) {
        *o = at;
        at += len.div_ceil(16) * 16;
    }
    (offs, at)
}

/// Images per staging arena: a group's worth, or as many as one binding holds (at least one).
fn arena_images(slot_bytes: usize, max_binding: u64) -> usize {
    ((max_binding / slot_bytes.max(1) as u64) as usize).clamp(1, GROUP)
}

/// Device memory of the staging arenas the batch path may hold at once (the group being filled
/// and the one running: each as many whole arenas as a group of [`GROUP`] needs).
pub(super) fn staging_bytes(l: &ExpertLayout, max_binding: u64) -> u64 {
    let slot = slot_layout(l).1;
    let per = arena_images(slot, max_binding);
    2 * GROUP.div_ceil(per) as u64 * super::device::pool_size((per * slot) as u64, max_binding)
}

/// Where a queued expert's image is, and the device cache slot it pins (None: staged).
struct Image {
    place: Place,
    slot: Option<usize>,
}

struct Queued {
    image: Image,
    /// Floats of its input rows, and the mapped staging buffer they were written into (copied
    /// into the group's input after the experts queued ahead, at the flush).
    floats: usize,
    rows: wgpu::Buffer,
    index: usize,
}

/// A submitted group: its readback (mapped when done), where each output goes, and the buffers
/// to give back once it is done.
struct InFlight {
    submission: wgpu::SubmissionIndex,
    read: wgpu::Buffer,
    /// (output index, floats) in readback order.
    parts: Vec<(usize, usize)>,
    images: Vec<Image>,
    temps: Vec<(wgpu::BufferUsages, wgpu::Buffer)>,
    stamp: Option<Stamp>,
}

pub(super) struct GpuExperts<'a> {
    be: &'a GpuBackend,
    layer: usize,
    layout: &'a ExpertLayout,
    situ: Situ,
    offs: [usize; 6],
    slot_bytes: usize,
    group: Vec<Queued>,
    /// The group's arenas (the last one is being filled) and the slots used in the last; on
    /// unified memory of [`UMA_ARENA`] usage and mapped until the group is submitted.
    staging: Vec<wgpu::Buffer>,
    staged_in_last: usize,
    /// Images per staging arena: a group's worth, or fewer where a binding holds fewer.
    per_arena: usize,
    flying: VecDeque<InFlight>,
    outs: Vec<Vec<f32>>,
    /// Device cache slots this batch wrote an expert into: forgotten if the batch fails (an
    /// upload that failed must not be found there again).
    written: Vec<usize>,
}

impl<'a> GpuExperts<'a> {
    pub(super) fn new(be: &'a GpuBackend, layer: usize, layout: &'a ExpertLayout, situ: Situ) -> Self {
        let (offs, slot_bytes) = slot_layout(layout);
        be.with_cache(|c| c.fit(slot_bytes as u64));
        // `expert_batch` sends images larger than a binding elsewhere: at least one fits.
        let per_arena = arena_images(slot_bytes, be.gpu.summary.max_binding);
        GpuExperts {
            be,
            layer,
            layout,
            situ,
            offs,
            slot_bytes,
            group: Vec::new(),
            staging: Vec::new(),
            staged_in_last: 0,
            per_arena,
            flying: VecDeque::new(),
            outs: Vec::new(),
            written: Vec::new(),
        }
    }

    /// The usage of the group's arenas.
    fn arena_usage(&self) -> wgpu::BufferUsages {
        if self.be.gpu.in_place { UMA_ARENA } else { STAGED }
    }

    /// A free slot of the group's arena (a new arena when the last is full: mapped on unified
    /// memory).
    fn staging_slot(&mut self) -> Place {
        if self.staging.is_empty() || self.staged_in_last == self.per_arena {
            let size = (self.per_arena * self.slot_bytes) as u64;
            let g = &self.be.gpu;
            self.staging.push(if g.in_place { g.mapped_as(UMA_ARENA, size) } else { g.take(STAGED, size) });
            self.staged_in_last = 0;
        }
        let at = (self.staged_in_last * self.slot_bytes) as u64;
        self.staged_in_last += 1;
        let buf = self.staging.last().cloned().unwrap_or_else(|| unreachable!("an arena was just pushed"));
        Place { buf, at }
    }

    fn gpu(&self) -> &Gpu {
        &self.be.gpu
    }

    /// Words of matrix `i`'s (0: w1, 1: w3, 2: w2) weights and scales in the image's buffer.
    fn words(&self, image: &Image, i: usize) -> (u32, u32) {
        let at = image.place.at as usize;
        (((at + self.offs[2 * i]) / 4) as u32, ((at + self.offs[2 * i + 1]) / 4) as u32)
    }

    /// Matrix `i` (0: w1, 1: w3, 2: w2) of an expert's image.
    fn mat(&self, image: &Image, i: usize) -> Resident {
        let l = self.layout;
        let (rows, cols) = if i == 2 { (l.latent, l.inter) } else { (l.inter, l.latent) };
        let (w_off, s_off) = self.words(image, i);
        let buf = &image.place.buf;
        let chunk = Chunk { row0: 0, rows, w: buf.clone(), scales: buf.clone(), w_off, s_off };
        Resident { rows, cols, stride: cols, bytes: (rows * cols / 2 + rows * cols / 32) as u64, chunks: vec![chunk] }
    }

    /// Encodes the group into `gu`, `act` and `y`, expert k's rows after the `before[k]` rows of
    /// the experts queued ahead of it (`total` rows in all): w1 into `gu` at `before[k] * inter`
    /// and w3 at `(total + before[k]) * inter`, one SiTU over the whole group into `act`, w2 into
    /// `y` at `before[k] * lat`. With one row per expert the products of each image buffer are two
    /// dispatches (every w1 and w3, then every w2); otherwise each product is its own.
    fn encode_group(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        group: &[Queued],
        before: &[usize],
        x: &wgpu::Buffer,
        [gu, act, y]: [&wgpu::Buffer; 3],
    ) {
        let (inter, lat) = (self.layout.inter, self.layout.latent);
        let g = self.gpu();
        let rows = |k: usize| group[k].floats / lat;
        let total = before.last().map_or(0, |&b| b + rows(group.len() - 1));
        let one_row = (0..group.len()).all(|k| rows(k) == 1);
        let mut buffers: Vec<&wgpu::Buffer> = Vec::new();
        for q in group {
            if !buffers.contains(&&q.image.place.buf) {
                buffers.push(&q.image.place.buf);
            }
        }
        let on = |buf: &wgpu::Buffer| -> Vec<usize> {
            (0..group.len()).filter(|&k| group[k].image.place.buf == *buf).collect()
        };
        // (matrix, output offset in `gu`) of expert k's w1 and w3.
        let gate_up = |k: usize| [(0, before[k] * inter), (1, (total + before[k]) * inter)];
        if one_row {
            for &buf in &buffers {
                let jobs: Vec<MatvecJob> = on(buf)
                    .into_iter()
                    .flat_map(|k| {
                        gate_up(k).map(|(i, out_off)| {
                            let (w_off, s_off) = self.words(&group[k].image, i);
                            MatvecJob { w_off, s_off, x_off: before[k] * lat, out_off }
                        })
                    })
                    .collect();
                g.encode_image_matvecs(pass, buf, inter, lat, &jobs, x, gu);
            }
        } else {
            for k in 0..group.len() {
                for (i, out_off) in gate_up(k) {
                    let m = self.mat(&group[k].image, i);
                    g.encode_products(pass, &m, Kind::Mxfp4, x, before[k] * lat, gu, out_off, rows(k));
                }
            }
        }
        let (beta, lb) = (self.situ.beta, self.situ.linear_beta);
        self.be.ops.encode_situ_deinterleave(g, pass, gu, gu, act, total * inter, total * inter, beta, lb);
        if one_row {
            for &buf in &buffers {
                let jobs: Vec<MatvecJob> = on(buf)
                    .into_iter()
                    .map(|k| {
                        let (w_off, s_off) = self.words(&group[k].image, 2);
                        MatvecJob { w_off, s_off, x_off: before[k] * inter, out_off: before[k] * lat }
                    })
                    .collect();
                g.encode_image_matvecs(pass, buf, lat, inter, &jobs, act, y);
            }
        } else {
            for k in 0..group.len() {
                let m = self.mat(&group[k].image, 2);
                g.encode_products(pass, &m, Kind::Mxfp4, act, before[k] * inter, y, before[k] * lat, rows(k));
            }
        }
    }

    /// Submits the queued group as one chain: w1 and w3 of every expert, SiTU into w2's input
    /// order, w2, one readback.
    fn flush(&mut self) -> Result<(), GpuError> {
        let group = std::mem::take(&mut self.group);
        if group.is_empty() {
            return Ok(());
        }
        let (inter, lat) = (self.layout.inter, self.layout.latent);
        let g = self.gpu();
        let mut before = Vec::with_capacity(group.len());
        let mut total = 0;
        for q in &group {
            before.push(total);
            total += q.floats / lat;
        }
        // Each expert's rows, staged as it was queued, copied into place on the device; the last
        // with its zero padding to whole 16-byte words (the bindings are vec4 arrays).
        let x = g.take(STAGED, (total * lat * 4).max(16) as u64);
        let mut enc = g.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("experts") });
        for (k, q) in group.iter().enumerate() {
            let len = if k + 1 == group.len() { (q.floats * 4).div_ceil(16) * 16 } else { q.floats * 4 };
            enc.copy_buffer_to_buffer(&q.rows, 0, &x, (before[k] * lat * 4) as u64, len as u64);
        }
        let bufs = [g.output(2 * total * inter), g.output(total * inter), g.output(total * lat)];
        let stamp = g.stamp();
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("experts"),
                timestamp_writes: Stamp::writes(&stamp),
            });
            self.encode_group(&mut pass, &group, &before, &x, [&bufs[0], &bufs[1], &bufs[2]]);
        }
        let read = g.take(READBACK, (total.max(1) * lat * 4) as u64);
        enc.copy_buffer_to_buffer(&bufs[2], 0, &read, 0, (total * lat * 4) as u64);
        g.stamp_resolve(&mut enc, &stamp);
        g.traffic.submitted((total * lat * 4) as u64);
        let usage = self.arena_usage();
        if usage == UMA_ARENA {
            // Written in place: the kernels may read them once they are unmapped.
            self.staging.iter().for_each(wgpu::Buffer::unmap);
        }
        let t = std::time::Instant::now();
        let submission = g.queue.submit([enc.finish()]);
        let submit_ns = t.elapsed().as_nanos() as u64;
        g.traffic.expert_submit_ns.fetch_add(submit_ns, std::sync::atomic::Ordering::Relaxed);
        for q in &group {
            g.remap(q.rows.clone());
        }
        let parts = group.iter().map(|q| (q.index, q.floats)).collect();
        let mut temps: Vec<(wgpu::BufferUsages, wgpu::Buffer)> = vec![(STAGED, x)];
        temps.extend(bufs.into_iter().map(|b| (OUTPUT, b)));
        // The arenas go back to their pool when the group has run.
        temps.extend(std::mem::take(&mut self.staging).into_iter().map(|b| (usage, b)));
        let images = group.into_iter().map(|q| q.image).collect();
        self.flying.push_back(InFlight { submission, read, parts, images, temps, stamp });
        // Keep one group running while the next is filled; older ones are read back now.
        while self.flying.len() > 1 {
            self.land_oldest()?;
        }
        Ok(())
    }

    /// Waits for the oldest submitted group, takes its outputs and gives its buffers back (on
    /// an error its buffers are dropped instead: the device may not be done with them).
    fn land_oldest(&mut self) -> Result<(), GpuError> {
        let Some(f) = self.flying.pop_front() else { return Ok(()) };
        let g = &self.be.gpu;
        let total = f.parts.iter().map(|&(_, n)| n).sum();
        // Each expert's outputs copied out of the mapping into its own vector (across threads).
        let parts = &f.parts;
        let outs = map_read(&g.device, &g.traffic, &f.read, total, Some(f.submission.clone()), |bytes| {
            let mut at = 0;
            parts
                .iter()
                .map(|&(index, n)| {
                    let v = floats_of(&bytes[at * 4..(at + n) * 4]);
                    at += n;
                    (index, v)
                })
                .collect::<Vec<_>>()
        });
        for slot in f.images.iter().filter_map(|i| i.slot) {
            self.be.with_cache(|c| c.unpin(slot));
        }
        let outs = outs?;
        g.give(READBACK, f.read);
        // Only this group's submission: the next group may still be running.
        g.stamp_read(f.stamp, Some(f.submission));
        for (index, v) in outs {
            self.outs[index] = v;
        }
        for (usage, b) in f.temps {
            if usage == UMA_ARENA {
                // Mapped again for the next group's writes once the device lets go of it.
                g.remap(b);
            } else {
                g.give(usage, b);
            }
        }
        Ok(())
    }

    fn queue(&mut self, image: Image, zd: &[f32]) -> Result<(), GpuError> {
        let index = self.outs.len();
        self.outs.push(Vec::new());
        let (rows, _) = self.be.gpu.fill(&super::device::f32_bytes(zd), 16);
        self.group.push(Queued { image, floats: zd.len(), rows, index });
        if self.group.len() >= GROUP {
            self.flush()?;
        }
        Ok(())
    }

    /// Forgets every device cache slot this batch wrote (see `written`).
    fn forget_written(&mut self) {
        let written = std::mem::take(&mut self.written);
        self.be.with_cache(|c| written.iter().for_each(|&slot| c.forget(slot)));
    }

    /// `r`, after forgetting what this batch wrote when it is a failure.
    fn failed<T>(&mut self, r: Result<T, GpuError>) -> Result<T, BackendError> {
        if r.is_err() {
            self.forget_written();
        }
        Ok(r?)
    }
}

impl ExpertBatch for GpuExperts<'_> {
    fn claim_held(&mut self, experts: &[u32]) -> Vec<bool> {
        // Pinned from now until their group lands, so nothing this layer admits can evict them.
        let layer = self.layer;
        self.be.with_cache(|c| experts.iter().map(|&e| c.claim(layer, e).is_some()).collect())
    }

    fn add_held(&mut self, expert: u32, zd: &[f32]) -> Result<(), BackendError> {
        let be = self.be;
        be.profile.time("experts_add_held", &be.gpu.traffic, || {
            let layer = self.layer;
            let Some((slot, place)) = self.be.with_cache(|c| c.slot_of(layer, expert)) else {
                unreachable!("expert {expert} of layer {layer} was claimed as held but is not in the device cache")
            };
            if zd.is_empty() {
                self.be.with_cache(|c| c.unpin(slot));
                self.outs.push(Vec::new());
                return Ok(());
            }
            let r = self.queue(Image { place, slot: Some(slot) }, zd);
            self.failed(r)
        })
    }

    fn add(&mut self, expert: u32, bytes: &[u8], zd: &[f32]) -> Result<(), BackendError> {
        let be = self.be;
        be.profile.time("experts_add", &be.gpu.traffic, || {
            if zd.is_empty() {
                self.outs.push(Vec::new());
                return Ok(());
            }
            let image = match self.be.with_cache(|c| c.admit(self.layer, expert)) {
                Some((slot, place)) => {
                    self.written.push(slot);
                    Image { place, slot: Some(slot) }
                }
                None => Image { place: self.staging_slot(), slot: None },
            };
            let g = &self.be.gpu;
            let (buf, base) = (&image.place.buf, image.place.at);
            // Each record zero-padded to its 16-byte slot, written across threads.
            let write_image = |view: &mut wgpu::BufferViewMut| {
                for (&(o, len), &at) in self.layout.parts.iter().zip(&self.offs) {
                    write_mapped(view, at, &bytes[o..o + len]);
                    let pad = len.div_ceil(16) * 16 - len;
                    write_mapped(view, at + len, &[0u8; 16][..pad]);
                }
            };
            let expert_bytes = self.layout.parts.iter().map(|&(_, len)| len as u64).sum();
            if image.slot.is_none() && g.in_place {
                // Unified memory: straight into the group's mapped arena, where the kernels read it.
                match buf.get_mapped_range_mut(base..base + self.slot_bytes as u64) {
                    Ok(mut view) => write_image(&mut view),
                    Err(e) => g.traffic.record_failure(format!("mapping an expert arena for an upload: {e}")),
                }
                g.traffic.expert_uploaded(expert_bytes, true);
            } else {
                // Laid out in a mapped staging buffer and copied into place on the device at once:
                // a group's worth (16 x 17.55 MB for K3) held in host staging would be host
                // memory outside the budget.
                let staging = g.fill_with(self.slot_bytes, write_image);
                let mut enc =
                    g.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("expert") });
                enc.copy_buffer_to_buffer(&staging, 0, buf, base, self.slot_bytes as u64);
                g.traffic.expert_uploaded(expert_bytes, false);
                g.traffic.submitted(0);
                g.queue.submit([enc.finish()]);
                g.remap(staging);
                // Only to let the device start; a failure of the device shows at the readback.
                let _ = g.device.poll(wgpu::PollType::Poll);
            }
            let r = self.queue(image, zd);
            self.failed(r)
        })
    }

    fn finish(mut self: Box<Self>) -> Result<Vec<Vec<f32>>, BackendError> {
        let be = self.be;
        be.profile.time("experts_finish", &be.gpu.traffic, || {
            let mut r = self.flush();
            while r.is_ok() && !self.flying.is_empty() {
                r = self.land_oldest();
            }
            self.failed(r)
        })?;
        Ok(std::mem::take(&mut self.outs))
    }
}

impl Drop for GpuExperts<'_> {
    /// A batch dropped without `finish` (a failed fetch, or a failure in one of its groups)
    /// still waits for its groups and releases what it pinned; their outputs are not used.
    fn drop(&mut self) {
        while !self.flying.is_empty() {
            if self.land_oldest().is_err() {
                // The slots it wrote may hold a failed upload.
                self.forget_written();
            }
        }
        for slot in std::mem::take(&mut self.group).iter().filter_map(|q| q.image.slot) {
            self.be.with_cache(|c| c.unpin(slot));
        }
        let usage = self.arena_usage();
        for b in std::mem::take(&mut self.staging) {
            if usage == UMA_ARENA {
                // Never submitted: still mapped.
                self.be.gpu.keep_mapped(b);
            } else {
                self.be.gpu.give(STAGED, b);
            }
        }
    }
}
