//! The CPU's measured fused multiply-add peak: every thread runs independent register-resident FMA
//! chains (enough of them to cover the FMA latency on every port) with the widest vectors the CPU
//! has, so kernel throughput can be reported as a fraction of what these cores really do, not of a
//! datasheet number. The loops are the `fma_peak` family (`dispatch.rs`): the best instruction set
//! this CPU runs, whatever `DELTAFIN_ISA` chose.

use super::Isa;
use super::dispatch::FMA_PEAK;
use std::time::Instant;

/// Fused multiply-adds per second over all of rayon's threads, each thread running for about
/// `seconds`; and the vector width (f32 lanes) used.
pub fn fma_peak(seconds: f64) -> (f64, usize) {
    let kernel = FMA_PEAK.get(Isa::best());
    let (lanes, chains) = (kernel.lanes(), kernel.chains());
    let per_thread: Vec<f64> = rayon::broadcast(|_| {
        let mut iters = 1u64 << 16;
        loop {
            let t = Instant::now();
            let sink = kernel.call(iters);
            let s = t.elapsed().as_secs_f64();
            std::hint::black_box(sink);
            if s >= seconds || iters >= 1 << 40 {
                return (iters * (chains * lanes) as u64) as f64 / s;
            }
            iters = (iters as f64 * (seconds / s.max(1e-6)).clamp(1.5, 16.0)) as u64;
        }
    });
    (per_thread.iter().sum(), lanes)
}

#[cfg(test)]
mod tests {
    #[test]
    fn peak_is_positive_and_finite() {
        let (fma_s, lanes) = super::fma_peak(0.01);
        assert!(fma_s.is_finite() && fma_s > 0.0 && lanes >= 1);
    }
}
