//! Wall time of each backend operation on the GPU backend, and the device's own time in it when
//! passes are timed (`DELTAFIN_GPU_TIMESTAMPS`): what `bench run` reports per decode token, so
//! that time spent outside the kernels (uploads, submissions, readbacks, idle gaps, the CPU's
//! share) shows per operation.
//!
//! Contract: every timed call adds one call, its elapsed seconds and the device seconds counted
//! meanwhile under its operation's name, whatever path it took (GPU kernel or CPU fallback); the
//! numbers only grow. Device time goes to the operation during which its submission was read
//! (a group of experts lands in a later call of the batch).

use super::device::Traffic;
use crate::backend::OpTime;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

#[derive(Default)]
pub(super) struct Profile {
    ops: Mutex<BTreeMap<&'static str, (u64, f64, f64)>>,
}

impl Profile {
    /// Runs `f`, counted under `op` (with the device time `traffic` gains meanwhile).
    pub fn time<T>(&self, op: &'static str, traffic: &Traffic, f: impl FnOnce() -> T) -> T {
        let (t, dev) = (Instant::now(), traffic.device_ns.load(Relaxed));
        let v = f();
        let dev_s = traffic.device_ns.load(Relaxed).saturating_sub(dev) as f64 * 1e-9;
        let mut m = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let e = m.entry(op).or_default();
        e.0 += 1;
        e.1 += t.elapsed().as_secs_f64();
        e.2 += dev_s;
        v
    }

    pub fn snapshot(&self) -> Vec<OpTime> {
        let m = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        m.iter().map(|(&op, &(calls, seconds, device_seconds))| OpTime { op, calls, seconds, device_seconds }).collect()
    }
}
