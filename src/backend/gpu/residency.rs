//! The residency bench (`bench kernels --backend gpu`, feature `gpu-bench`): what one submission of
//! a decode step's experts costs as the device expert cache grows, with the cache's slots in a few
//! arenas (as deltafin keeps them, `expert_cache.rs`) and, for comparison, in one buffer each (the
//! layout whose per-submission cost peers saw grow with the cache on Metal without residency sets:
//! FIELD.md).
//!
//! Contract: each point fills its own cache of `slots` experts (small ones: what is measured is
//! per buffer and per submission, not per byte) through the batch path; then every point times
//! `groups` groups of 16 experts drawn from its cache (a fixed pseudo-random draw, the same for
//! both layouts of a size), each as a decode step runs them: claimed, queued from the cache, one
//! submission, one readback; the groups are spread over rounds that visit the points in turn, so
//! that a shared machine's drifting load weighs on every point alike. All the caches are held at
//! once (swapped into the backend in turn). It reports
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

/// Rounds each point's groups are spread over, the points in a rotated order each round, so that
/// a shared machine's load drifting during the run weighs on every point alike.
const ROUNDS: usize = 5;

/// A group's samples: host seconds in `queue.submit`, wall seconds, buffers it referenced.
type Sample = (f64, f64, usize);

/// splitmix64 from `state`, reduced below `k`.
fn below(state: &mut u64, k: usize) -> usize {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    ((z ^ (z >> 31)) % k.max(1) as u64) as usize
}

/// The `q` quantile of `v`'s values, in microseconds.
fn quantile_us(mut v: Vec<f64>, q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(((v.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(0.0) * 1e6
}

impl GpuBackend {
    /// The ladder: for each of `slots` and each layout, one [`ResidencyPoint`] of `groups` groups.
    pub fn residency(&self, slots: &[usize], groups: usize) -> Result<Vec<ResidencyPoint>, BackendError> {
        let l = layout();
        let slot = super::experts::slot_layout(&l).1 as u64;
        // Weights any bytes, scales 2^-7 (no subnormal or huge weights).
        let mut bytes: Vec<u8> = (0..l.len).map(|i| (i * 37 % 251) as u8).collect();
        for &(o, n) in l.parts.iter().skip(1).step_by(2) {
            bytes[o..o + n].fill(120);
        }
        let zd: Vec<f32> = (0..l.latent).map(|i| ((i % 13) as f32 - 6.0) / 8.0).collect();
        let situ = Situ { beta: 4.0, linear_beta: 0.0 };
        // Every point's cache, filled once through the batch path (free slots admit anyone).
        let mut points: Vec<(&'static str, usize, DeviceCache)> = Vec::new();
        for &n in slots {
            for (name, arena) in [("arena", None), ("per_expert", Some(slot))] {
                let fresh = DeviceCache::new(n as u64 * slot);
                let fresh = match arena {
                    Some(b) => fresh.with_arena_bytes(b),
                    None => fresh,
                };
                self.with_cache(|c| *c = fresh);
                self.plan_experts(&l, n)?;
                for first in (0..n).step_by(PER_LAYER) {
                    let mut b = self.expert_batch(first / PER_LAYER, &l, situ);
                    for e in 0..PER_LAYER.min(n - first) {
                        b.add(e as u32, &bytes, &zd)?;
                    }
                    b.finish()?;
                }
                points.push((name, n, self.with_cache(|c| std::mem::replace(c, DeviceCache::new(0)))));
            }
        }
        // The same draw of groups for both layouts of a size.
        let mut draws: Vec<u64> = points.iter().map(|&(_, n, _)| 0x5eed ^ n as u64).collect();
        let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); points.len()];
        let per_round = groups.div_ceil(ROUNDS).max(1);
        let m = points.len();
        for round in 0..=ROUNDS {
            for k in (0..m).map(|k| (k + round) % m) {
                let n = points[k].1;
                self.with_cache(|c| std::mem::swap(c, &mut points[k].2));
                // Round 0 warms up.
                let count = if round == 0 { per_round.div_ceil(4) } else { per_round };
                let got = (0..count).map(|_| self.time_group(&l, situ, &zd, n, &mut draws[k]));
                let got: Result<Vec<Sample>, BackendError> = got.collect();
                self.with_cache(|c| std::mem::swap(c, &mut points[k].2));
                if round > 0 {
                    samples[k].extend(got?);
                } else {
                    got?;
                }
            }
        }
        let out = points
            .iter()
            .zip(samples)
            .map(|((name, n, cache), s)| ResidencyPoint {
                layout: name,
                slots: *n,
                buffers: cache.buffers(),
                buffers_per_group: s.iter().map(|x| x.2).sum::<usize>() as f64 / s.len().max(1) as f64,
                submit_us: quantile_us(s.iter().map(|x| x.0).collect(), 0.5),
                submit_us_p90: quantile_us(s.iter().map(|x| x.0).collect(), 0.9),
                group_us: quantile_us(s.iter().map(|x| x.1).collect(), 0.5),
                group_us_p90: quantile_us(s.iter().map(|x| x.1).collect(), 0.9),
                groups: s.len(),
            })
            .collect();
        self.with_cache(|c| *c = DeviceCache::new(0));
        Ok(out)
    }

    /// One decode group of 16 experts drawn (with `draw`) from the cache in place, which holds
    /// `n` experts: claimed, queued from the cache, submitted, read back.
    fn time_group(
        &self,
        l: &ExpertLayout,
        situ: Situ,
        zd: &[f32],
        n: usize,
        draw: &mut u64,
    ) -> Result<Sample, BackendError> {
        let layer = below(draw, n.div_ceil(PER_LAYER));
        let in_layer = PER_LAYER.min(n - layer * PER_LAYER);
        let mut ids: Vec<u32> = Vec::new();
        while ids.len() < GROUP.min(in_layer) {
            let e = below(draw, in_layer) as u32;
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
        let mut b = self.expert_batch(layer, l, situ);
        for (&e, held) in ids.iter().zip(b.claim_held(&ids)) {
            // Every expert of the point is held: it was filled and nothing evicts.
            if !held {
                return Err(BackendError::Gpu(super::GpuError::Probe(format!("residency: expert {e} not held"))));
            }
            b.add_held(e, zd)?;
        }
        b.finish()?;
        let sub = (self.gpu.traffic.expert_submit_ns.load(Relaxed) - sub) as f64 * 1e-9;
        Ok((sub, t.elapsed().as_secs_f64(), bufs.len()))
    }
}
