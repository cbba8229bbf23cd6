//! The batched routed-expert path: a layer's experts are queued as they land and run in groups,
//! each group in two submissions with one readback each (w1 and w3 of every expert; then, after
//! SiTU, w2 of every expert), instead of a submission and readback per product.
//!
//! Contract: every product is the same kernel on the same bytes and inputs as
//! `GpuBackend::matmul_mxfp4`, so the outputs equal the per-expert path bit for bit; outputs come
//! back in the order the experts were queued. An expert's bytes are copied into a pooled staging
//! buffer before `add` returns (the store may reuse its buffer at once): its six records at
//! 16-byte-aligned offsets, each matrix addressed by word offsets in that one buffer; the copy is
//! submitted at once, so host staging memory stays about one expert. Device memory: one group's
//! staging buffers (16 images, 281 MB for K3), pooled across layers.

use super::GpuBackend;
use super::device::{Chunk, Gpu, Kind, OUTPUT, Resident, STAGED, f32_bytes};
use crate::backend::{Backend, ExpertBatch};
use crate::cpu::deinterleave_mxfp4_input;
use crate::cpu::ops::Situ;
use crate::model::roster::ExpertLayout;

/// Experts per group (one pair of submissions): a decode step's 16 routed experts in one group.
const GROUP: usize = 16;

/// Where each of the six records goes in a staging slot, and the slot's size.
pub(super) fn slot_layout(l: &ExpertLayout) -> ([usize; 6], usize) {
    let mut offs = [0usize; 6];
    let mut at = 0;
    for (o, (_, len)) in offs.iter_mut().zip(l.parts) {
        *o = at;
        at += len.div_ceil(16) * 16;
    }
    (offs, at)
}

struct Queued {
    slot: wgpu::Buffer,
    zd: Vec<f32>,
    index: usize,
}

pub(super) struct GpuExperts<'a> {
    be: &'a GpuBackend,
    layout: &'a ExpertLayout,
    situ: Situ,
    offs: [usize; 6],
    slot_bytes: usize,
    group: Vec<Queued>,
    outs: Vec<Vec<f32>>,
}

impl<'a> GpuExperts<'a> {
    pub(super) fn new(be: &'a GpuBackend, layout: &'a ExpertLayout, situ: Situ) -> Self {
        let (offs, slot_bytes) = slot_layout(layout);
        GpuExperts { be, layout, situ, offs, slot_bytes, group: Vec::new(), outs: Vec::new() }
    }

    fn gpu(&self) -> &Gpu {
        &self.be.gpu
    }

    /// Matrix `i` (0: w1, 1: w3, 2: w2) of a staged expert.
    fn mat(&self, slot: &wgpu::Buffer, i: usize) -> Resident {
        let l = self.layout;
        let (rows, cols) = if i == 2 { (l.latent, l.inter) } else { (l.inter, l.latent) };
        let chunk = Chunk {
            row0: 0,
            rows,
            w: slot.clone(),
            scales: slot.clone(),
            w_off: (self.offs[2 * i] / 4) as u32,
            s_off: (self.offs[2 * i + 1] / 4) as u32,
        };
        Resident { rows, cols, stride: cols, bytes: (rows * cols / 2 + rows * cols / 32) as u64, chunks: vec![chunk] }
    }

    /// One submission: `mats[e][j]` applied to expert e's input at `x_off[e]`, each product into
    /// its own output buffer (no barrier between the dispatches); one readback of all of them.
    fn run(&self, x: &wgpu::Buffer, jobs: &[(Resident, usize, usize)]) -> Vec<Vec<f32>> {
        let g = self.gpu();
        let outs: Vec<(wgpu::Buffer, usize)> =
            jobs.iter().map(|(r, _, m)| (g.output(m * r.rows), m * r.rows)).collect();
        let mut enc = g.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("experts") });
        {
            let mut pass =
                enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("experts"), timestamp_writes: None });
            for ((r, x_off, m), (o, _)) in jobs.iter().zip(&outs) {
                g.encode_products(&mut pass, r, Kind::Mxfp4, x, *x_off, o, 0, *m, g.matvec_kernel);
            }
        }
        let list: Vec<(&wgpu::Buffer, u64)> = outs.iter().map(|(b, n)| (b, (n * 4) as u64)).collect();
        let all = g.finish_many(enc, &list);
        let mut at = 0;
        let split = outs
            .iter()
            .map(|(_, n)| {
                let v = all[at..at + n].to_vec();
                at += n;
                v
            })
            .collect();
        for (b, _) in outs {
            g.give(OUTPUT, b);
        }
        split
    }

    /// Runs the queued group: w1 and w3 of every expert, SiTU on the CPU side of the backend,
    /// then w2 of every expert.
    fn flush(&mut self) {
        let group = std::mem::take(&mut self.group);
        if group.is_empty() {
            return;
        }
        let (inter, lat) = (self.layout.inter, self.layout.latent);
        let be = self.be;
        let g = &be.gpu;
        let rows: Vec<usize> = group.iter().map(|q| q.zd.len() / lat).collect();
        let mut xs = Vec::new();
        let mut x_off = Vec::new();
        for q in &group {
            x_off.push(xs.len());
            xs.extend_from_slice(&q.zd);
        }
        let x = g.staged(&f32_bytes(&xs));
        let mut jobs = Vec::new();
        for ((q, &off), &m) in group.iter().zip(&x_off).zip(&rows) {
            jobs.push((self.mat(&q.slot, 0), off, m));
            jobs.push((self.mat(&q.slot, 1), off, m));
        }
        let gu = self.run(&x, &jobs);
        g.give(STAGED, x);
        let mut ads = Vec::new();
        let mut a_off = Vec::new();
        for (e, &m) in rows.iter().enumerate() {
            let mut a = vec![0f32; m * inter];
            self.be.situ(self.situ, &gu[2 * e], &gu[2 * e + 1], &mut a);
            a_off.push(ads.len());
            let start = ads.len();
            ads.resize(start + m * inter, 0.0);
            for (src, dst) in a.chunks_exact(inter).zip(ads[start..].chunks_exact_mut(inter)) {
                deinterleave_mxfp4_input(src, dst);
            }
        }
        let x2 = g.staged(&f32_bytes(&ads));
        let jobs: Vec<(Resident, usize, usize)> =
            group.iter().zip(&a_off).zip(&rows).map(|((q, &off), &m)| (self.mat(&q.slot, 2), off, m)).collect();
        let ys = self.run(&x2, &jobs);
        g.give(STAGED, x2);
        for (q, y) in group.into_iter().zip(ys) {
            self.outs[q.index] = y;
            g.give(STAGED, q.slot);
        }
    }
}

impl ExpertBatch for GpuExperts<'_> {
    fn add(&mut self, bytes: &[u8], zd: &[f32]) {
        let index = self.outs.len();
        self.outs.push(Vec::new());
        if zd.is_empty() {
            return;
        }
        let g = self.gpu();
        let slot = g.take(STAGED, self.slot_bytes as u64);
        for (&(o, len), &at) in self.layout.parts.iter().zip(&self.offs) {
            let part = &bytes[o..o + len];
            // Queue writes must be whole words: the last partial word goes padded.
            let whole = len / 4 * 4;
            if whole > 0 {
                g.queue.write_buffer(&slot, at as u64, &part[..whole]);
            }
            if whole < len {
                let mut tail = [0u8; 4];
                tail[..len - whole].copy_from_slice(&part[whole..]);
                g.queue.write_buffer(&slot, (at + whole) as u64, &tail);
            }
        }
        // Hand the writes to the GPU now: queued writes sit in host staging memory until a submit,
        // and a group's worth (16 x 17.55 MB for K3) would be host memory outside the budget.
        g.queue.submit([]);
        if let Err(e) = g.device.poll(wgpu::PollType::Poll) {
            tracing::error!("GPU poll failed: {e}");
        }
        self.group.push(Queued { slot, zd: zd.to_vec(), index });
        if self.group.len() >= GROUP {
            self.flush();
        }
    }

    fn finish(mut self: Box<Self>) -> Vec<Vec<f32>> {
        self.flush();
        std::mem::take(&mut self.outs)
    }
}
