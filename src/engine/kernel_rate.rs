//! The routed-expert kernels' own rate on this machine, measured apart from any read: what the
//! compute term of `bench run --batch`'s prefill bound is made of (the work of all prompts at the
//! measured rate, not the run's wall less its read waits).
//!
//! Contract: [`Engine::expert_seconds`] runs one expert of the model's shipped layout (fixed
//! pseudo-random codes, every scale 2^-6, so values stay normal) through the engine's backend
//! exactly as a MoE layer composes it (`backend::run_expert`: w1 and w3, SiTU, w2), resident in
//! memory, on `m` rows for each `m` asked, `reps` times each, and returns every timing (None when
//! the engine has no routed experts). The repetitions run in rounds, each round timing every row
//! count once, so a slow spell of a shared machine falls on all counts alike rather than on one;
//! one untimed round comes first (warm-up).
//! It reads nothing and changes no engine state.

use super::Engine;
use crate::backend::{BackendError, run_expert};
use std::time::Instant;

/// The E8M0 byte of 2^-6: decoded weights of at most 6 x 2^-6, so no product overflows.
const SCALE: u8 = 121;

impl Engine {
    /// Seconds of one routed expert on `m` rows, `reps` timings for each `m` of `rows` (see the
    /// module contract).
    pub fn expert_seconds(&self, rows: &[usize], reps: usize) -> Result<Option<Vec<Vec<f64>>>, BackendError> {
        let Some(src) = self.source.as_ref() else { return Ok(None) };
        let layout = src.layout().clone();
        let mut rng = crate::util::XorShift(0x9E37_79B9_7F4A_7C15);
        let mut bytes: Vec<u8> = (0..layout.len).map(|_| rng.next_u64() as u8).collect();
        // Records 1, 3 and 5 are the scales of w1, w3 and w2.
        for i in [1, 3, 5] {
            let (o, n) = layout.parts[i];
            bytes[o..o + n].fill(SCALE);
        }
        let situ = crate::k3::situ(&self.cfg);
        let most = rows.iter().copied().max().unwrap_or(0);
        let zd: Vec<f32> = (0..most * layout.latent).map(|i| ((i % 17) as f32 - 8.0) / 8.0).collect();
        let mut out = vec![Vec::with_capacity(reps.max(1)); rows.len()];
        // Round 0 is not kept: the first products of a process pay for its thread pool's start
        // and the allocator's first pages (a bench run's first round timed 1.4x its last).
        for round in 0..=reps.max(1) {
            for (&m, times) in rows.iter().zip(out.iter_mut()) {
                let z = &zd[..m * layout.latent];
                let t = Instant::now();
                run_expert(&*self.model.be, &layout, &bytes, situ, z)?;
                if round > 0 {
                    times.push(t.elapsed().as_secs_f64());
                }
            }
        }
        Ok(Some(out))
    }
}
