//! The CPU's measured fused multiply-add peak: every thread runs independent register-resident FMA
//! chains (enough of them to cover the FMA latency on every port) with the widest vectors the CPU
//! has, so kernel throughput can be reported as a fraction of what these cores really do, not of a
//! datasheet number.

use std::time::Instant;

/// Independent accumulator chains per thread (latency 4 x 2 ports, with room to spare).
const CHAINS: usize = 12;
/// The same with NEON: Apple's performance cores have four FMA pipes of latency 4 (and 32 vector
/// registers to hold the chains).
#[cfg(target_arch = "aarch64")]
const NEON_CHAINS: usize = 16;

/// Fused multiply-adds per second over all of rayon's threads, each thread running for about
/// `seconds`; and the vector width (f32 lanes) used.
pub fn fma_peak(seconds: f64) -> (f64, usize) {
    let (lanes, chains) = (lanes(), chains());
    let per_thread: Vec<f64> = rayon::broadcast(|_| {
        let mut iters = 1u64 << 16;
        loop {
            let t = Instant::now();
            let sink = run(iters);
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

fn lanes() -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            return 16;
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            return 8;
        }
    }
    #[cfg(target_arch = "aarch64")]
    if std::arch::is_aarch64_feature_detected!("neon") {
        return 4;
    }
    1
}

fn chains() -> usize {
    #[cfg(target_arch = "aarch64")]
    if std::arch::is_aarch64_feature_detected!("neon") {
        return NEON_CHAINS;
    }
    CHAINS
}

fn run(iters: u64) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F (checked above).
            return unsafe { run_avx512(iters) };
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports AVX2 and FMA (checked above).
            return unsafe { run_avx2(iters) };
        }
    }
    #[cfg(target_arch = "aarch64")]
    if std::arch::is_aarch64_feature_detected!("neon") {
        // SAFETY: the CPU has NEON (checked above).
        return unsafe { run_neon(iters) };
    }
    run_scalar(iters)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn run_avx512(iters: u64) -> f32 {
    use std::arch::x86_64::*;
    let a = _mm512_set1_ps(0.999_999);
    let b = _mm512_set1_ps(1e-7);
    let mut acc = [_mm512_set1_ps(1.0); CHAINS];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm512_fmadd_ps(*x, a, b);
        }
    }
    let mut s = _mm512_setzero_ps();
    for x in acc {
        s = _mm512_add_ps(s, x);
    }
    _mm512_reduce_add_ps(s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2(iters: u64) -> f32 {
    use std::arch::x86_64::*;
    let a = _mm256_set1_ps(0.999_999);
    let b = _mm256_set1_ps(1e-7);
    let mut acc = [_mm256_set1_ps(1.0); CHAINS];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm256_fmadd_ps(*x, a, b);
        }
    }
    let mut out = [0f32; 8];
    let mut s = _mm256_setzero_ps();
    for x in acc {
        s = _mm256_add_ps(s, x);
    }
    // SAFETY: `out` holds 8 f32s, what one 256-bit store writes.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), s) };
    out.iter().sum()
}

#[cfg(target_arch = "aarch64")]
#[target_feature(enable = "neon")]
unsafe fn run_neon(iters: u64) -> f32 {
    use std::arch::aarch64::*;
    let a = vdupq_n_f32(0.999_999);
    let b = vdupq_n_f32(1e-7);
    let mut acc = [vdupq_n_f32(1.0); NEON_CHAINS];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = vfmaq_f32(b, *x, a);
        }
    }
    let mut s = vdupq_n_f32(0.0);
    for x in acc {
        s = vaddq_f32(s, x);
    }
    vaddvq_f32(s)
}

fn run_scalar(iters: u64) -> f32 {
    let mut acc = [1.0f32; CHAINS];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = x.mul_add(0.999_999, 1e-7);
        }
    }
    acc.iter().sum()
}

#[cfg(test)]
mod tests {
    #[test]
    fn peak_is_positive_and_finite() {
        let (fma_s, lanes) = super::fma_peak(0.01);
        assert!(fma_s.is_finite() && fma_s > 0.0 && lanes >= 1);
    }
}
