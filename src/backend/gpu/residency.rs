//! The residency bench (`bench kernels --backend gpu`, feature `gpu-bench`): what one submission of
//! a decode step's experts costs as the device expert cache grows, with the cache's slots in a few
//! arenas (as deltafin keeps them, `expert_cache.rs`) and, for comparison, in one buffer each (the
//! layout whose per-submission cost peers saw grow with the cache on Metal without residency sets:
//! FIELD.md).
//!
//! Contract: each point fills a fresh cache of `slots` experts (small ones: what is measured is
//! per buffer and per submission, not per byte) through the batch path, then times `groups` groups
//! of 16 experts drawn from it (a fixed pseudo-random draw, the same for both layouts), each as a
//! decode step runs them: claimed, queued from the cache, one submission, one readback. It reports
//! the host's time inside `queue.submit` and the whole group's wall time (median and 90th
//! percentile over the groups: robust to a shared machine), the buffers the cache holds and those
//! a group's submission references. The backend's own cache is replaced meanwhile and emptied at the end.

use super::GpuBackend;
use super::expert_cache::DeviceCache;
use crate::backend::{Backend, BackendError, Device, ExpertLayout, Situ};
use std::sync::atomic::Ordering::Relaxed;

/// One point of the residency ladder.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ResidencyPoint {
    /// "arena" (deltafin's layout) or "per_expert" (one buffer per slot).
    pub layout: &'static str,
    pub slots: usize,
    /// Device buffers holding the cache.
    pub buffers: usize,
    /// Of them, referenced by one group's submission (mean).
    pub buffers_per_group: f64,
    /// Host microseconds inside `queue.submit` per group: median and 90th percentile.
    pub submit_us: f64,
    pub submit_us_p90: f64,
    /// Wall microseconds per group (claim, queue 16 experts, submit, wait, read back): median
    /// and 90th percentile.
    pub group_us: f64,
    pub group_us_p90: f64,
    pub groups: usize,
}

/// Experts per layer of the ladder's keys, and per group (a decode step's routed experts).
const PER_LAYER: usize = 256;
const GROUP: usize = 16;

/// The ladder's expert: 64 x 512 (52 KB an image), so that thousands of slots take little memory.
fn layout() -> ExpertLayout {
    let (inter, latent) = (64usize, 512usize);
    let (w, s) = (inter * latent / 2, inter * latent / 32);
    let parts = [(0, w), (w, s), (w + s, w), (2 * w + s, s), (2 * w + 2 * s, w), (3 * w + 2 * s, s)];
    ExpertLayout { parts, len: 3 * (w + s), inter, latent }
}

impl GpuBackend {
    /// The ladder: for each of `slots` and each layout, one [`ResidencyPoint`] of `groups` groups.
    pub fn residency(&self, slots: &[usize], groups: usize) -> Result<Vec<ResidencyPoint>, BackendError> {
        let l = layout();
        let slot = super::experts::slot_layout(&l).1 as u64;
        // Scales clear of the extremes (no subnormal or huge weights), weights any bytes.
        let bytes: Vec<u8> =
            (0..l.len).map(|i| if (i / 1024) % 17 == 16 { 120 } else { (i * 37 % 251) as u8 }).collect();
        let zd: Vec<f32> = (0..l.latent).map(|i| ((i % 13) as f32 - 6.0) / 8.0).collect();
        let situ = Situ { beta: 4.0, linear_beta: 0.0 };
        let mut out = Vec::new();
        for &n in slots {
            for (name, arena) in [("arena", None), ("per_expert", Some(slot))] {
                self.with_cache(|c| {
                    let fresh = DeviceCache::new(n as u64 * slot);
                    *c = match arena {
                        Some(b) => fresh.with_arena_bytes(b),
                        None => fresh,
                    }
                });
                self.plan_experts(&l, n)?;
                // Every slot filled through the batch path (admitted: free slots take anyone).
                for first in (0..n).step_by(PER_LAYER) {
                    let mut b = self.expert_batch(first / PER_LAYER, &l, situ);
                    for e in 0..PER_LAYER.min(n - first) {
                        b.add(e as u32, &bytes, &zd)?;
                    }
                    b.finish()?;
                }
                let mut state = 0x5eed_u64;
                // splitmix64: the same draw for every point.
                let mut below = move |k: usize| {
                    state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
                    let mut z = state;
                    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                    ((z ^ (z >> 31)) % k.max(1) as u64) as usize
                };
                // Per group: (host seconds in queue.submit, wall seconds, buffers it referenced).
                let mut time_groups = |count: usize| -> Result<Vec<(f64, f64, usize)>, BackendError> {
                    let mut samples = Vec::with_capacity(count);
                    for _ in 0..count {
                        let layer = below(n.div_ceil(PER_LAYER));
                        let in_layer = PER_LAYER.min(n - layer * PER_LAYER);
                        let mut ids: Vec<u32> = Vec::new();
                        while ids.len() < GROUP.min(in_layer) {
                            let e = below(in_layer) as u32;
                            if !ids.contains(&e) {
                                ids.push(e);
                            }
                        }
                        let mut bufs: Vec<wgpu::Buffer> = Vec::new();
                        for &e in &ids {
                            if let Some((_, p)) = self.with_cache(|c| c.slot_of(layer, e))
                                && !bufs.contains(&p.buf)
                            {
                                bufs.push(p.buf);
                            }
                        }
                        let (t, sub) = (std::time::Instant::now(), self.gpu.traffic.expert_submit_ns.load(Relaxed));
                        let mut b = self.expert_batch(layer, &l, situ);
                        let held = b.claim_held(&ids);
                        for (&e, h) in ids.iter().zip(held) {
                            if h {
                                b.add_held(e, &zd)?;
                            } else {
                                b.add(e, &bytes, &zd)?;
                            }
                        }
                        b.finish()?;
                        let sub = (self.gpu.traffic.expert_submit_ns.load(Relaxed) - sub) as f64 * 1e-9;
                        samples.push((sub, t.elapsed().as_secs_f64(), bufs.len()));
                    }
                    Ok(samples)
                };
                time_groups(groups.div_ceil(4))?;
                let samples = time_groups(groups)?;
                let buffers = self.with_cache(|c| c.buffers());
                let us = |pick: fn(&(f64, f64, usize)) -> f64, q: f64| {
                    let mut v: Vec<f64> = samples.iter().map(pick).collect();
                    v.sort_by(f64::total_cmp);
                    v.get(((v.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(0.0) * 1e6
                };
                let referenced = samples.iter().map(|s| s.2).sum::<usize>() as f64 / samples.len().max(1) as f64;
                out.push(ResidencyPoint {
                    layout: name,
                    slots: n,
                    buffers,
                    buffers_per_group: referenced,
                    submit_us: us(|s| s.0, 0.5),
                    submit_us_p90: us(|s| s.0, 0.9),
                    group_us: us(|s| s.1, 0.5),
                    group_us_p90: us(|s| s.1, 0.9),
                    groups,
                });
            }
        }
        self.with_cache(|c| *c = DeviceCache::new(0));
        Ok(out)
    }
}
