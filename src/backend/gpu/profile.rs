//! Wall time of each backend operation on the GPU backend, and time blocked waiting for the
//! device: what `bench run` reports per decode token, so that time spent outside the kernels
//! (uploads, submissions, readbacks, the CPU's share) shows per operation.
//!
//! Contract: every timed call adds one call and its elapsed seconds under its operation's name,
//! whatever path it took (GPU kernel or CPU fallback); the numbers only grow.

use crate::backend::OpTime;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Instant;

#[derive(Default)]
pub(super) struct Profile {
    ops: Mutex<BTreeMap<&'static str, (u64, f64)>>,
}

impl Profile {
    /// Runs `f`, counted under `op`.
    pub fn time<T>(&self, op: &'static str, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let v = f();
        self.add(op, t.elapsed().as_secs_f64());
        v
    }

    pub fn add(&self, op: &'static str, seconds: f64) {
        let mut m = match self.ops.lock() {
            Ok(m) => m,
            Err(p) => p.into_inner(),
        };
        let e = m.entry(op).or_default();
        e.0 += 1;
        e.1 += seconds;
    }

    pub fn snapshot(&self) -> Vec<OpTime> {
        let m = match self.ops.lock() {
            Ok(m) => m,
            Err(p) => p.into_inner(),
        };
        m.iter().map(|(&op, &(calls, seconds))| OpTime { op, calls, seconds }).collect()
    }
}
