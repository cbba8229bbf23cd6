//! KDA state update kernels (CPU): the token recurrence the engine runs, and the chunked (WY) form
//! kept as an independent reference for it.
//!
//! Per token and head: S = diag(exp(g)) S; u = beta (v - S^T k); S += k (x) u; o = S^T q. The
//! recurrence is a fixed sequential order (bit-identical whatever the thread count or how tokens
//! are split into calls); the chunked form agrees to rounding (tests below).

use super::dot_f32;
use super::ops::{l2_norm_inplace, sigmoid};
use crate::backend::detmath;
use crate::backend::types::HeadIn;
use rayon::prelude::*;

/// Rows per chunk of the chunked form.
pub const KDA_CHUNK: usize = 64;

/// eps of the l2 normalisation of the benchmark's and tests' random q and k (K3's).
const INPUT_L2_EPS: f32 = 1e-6;

detmath::fma_fn! {
    /// Token recurrence for one head. `s` is [dk][dv]; with `s_in` the first token reads the start
    /// state from there (so the caller's committed state stays untouched), else `s` is updated in
    /// place. Writes o [n, dv] when `o` is given (a replay of committed rows needs only the state).
    /// Each column j of the state is updated by its own fixed sequence (`exp` from `detmath`, every
    /// product-sum a `mul_add`), which `kernels/kda.wgsl` repeats thread by thread.
    pub fn recurrent_head(
        s_in: Option<&[f32]>,
        s: &mut [f32],
        dk: usize,
        dv: usize,
        x: &HeadIn,
        o: Option<&mut [f32]>,
    ) {
        let mut o = o;
        let n = x.beta.len();
        let mut u = vec![0f32; dv];
        for t in 0..n {
            let (kt, vt, gt) = (&x.k[t * dk..][..dk], &x.v[t * dv..][..dv], &x.g[t * dk..][..dk]);
            u.fill(0.0);
            for i in 0..dk {
                let e = detmath::exp(gt[i]);
                let row = &mut s[i * dv..(i + 1) * dv];
                match s_in {
                    // The same multiply as the in-place update, reading the start state elsewhere.
                    Some(src) if t == 0 => {
                        for ((sj, &s0), uj) in row.iter_mut().zip(&src[i * dv..(i + 1) * dv]).zip(u.iter_mut()) {
                            *sj = s0 * e;
                            *uj = kt[i].mul_add(*sj, *uj);
                        }
                    }
                    _ => {
                        for (sj, uj) in row.iter_mut().zip(u.iter_mut()) {
                            *sj *= e;
                            *uj = kt[i].mul_add(*sj, *uj);
                        }
                    }
                }
            }
            let b = x.beta[t];
            for (uj, &vj) in u.iter_mut().zip(vt) {
                *uj = b * (vj - *uj);
            }
            match o.as_deref_mut() {
                Some(o) => {
                    let qt = &x.q[t * dk..][..dk];
                    let ot = &mut o[t * dv..(t + 1) * dv];
                    ot.fill(0.0);
                    for i in 0..dk {
                        let row = &mut s[i * dv..(i + 1) * dv];
                        for ((sj, &dj), oj) in row.iter_mut().zip(&u).zip(ot.iter_mut()) {
                            *sj = kt[i].mul_add(dj, *sj);
                            *oj = qt[i].mul_add(*sj, *oj);
                        }
                    }
                }
                None => {
                    for i in 0..dk {
                        let row = &mut s[i * dv..(i + 1) * dv];
                        for (sj, &dj) in row.iter_mut().zip(&u) {
                            *sj = kt[i].mul_add(dj, *sj);
                        }
                    }
                }
            }
        }
        if n == 0
            && let Some(src) = s_in
        {
            s.copy_from_slice(src);
        }
    }
}

/// Chunked form for one head (chunks of `KDA_CHUNK` rows); same contract as `recurrent_head`.
///
/// Within a chunk with cumulative log-decay G_t and start state S0:
///   u_t = beta_t (v_t - S0^T (e^{G_t} k_t)) - sum_{i<t} beta_t (k_t . e^{G_t-G_i} k_i) u_i
///   o_t = S0^T (e^{G_t} q_t) + sum_{i<=t} (q_t . e^{G_t-G_i} k_i) u_i
///   S   = e^{G_C} S0 + sum_t e^{G_C-G_t} k_t u_t^T
pub fn chunked_head(s: &mut [f32], dk: usize, dv: usize, x: &HeadIn, o: &mut [f32]) {
    let n = x.beta.len();
    let mut t0 = 0;
    while t0 < n {
        let c = KDA_CHUNK.min(n - t0);
        let k = &x.k[t0 * dk..(t0 + c) * dk];
        let q = &x.q[t0 * dk..(t0 + c) * dk];
        let v = &x.v[t0 * dv..(t0 + c) * dv];
        let beta = &x.beta[t0..t0 + c];
        // Cumulative log-decay per channel, in f64: differences G_t - G_i of sums that reach
        // hundreds would otherwise lose the precision the recurrence keeps.
        let mut gc = vec![0f64; c * dk];
        for t in 0..c {
            for i in 0..dk {
                let prev = if t == 0 { 0.0 } else { gc[(t - 1) * dk + i] };
                gc[t * dk + i] = prev + x.g[(t0 + t) * dk + i] as f64;
            }
        }
        // Start-state terms: w_t = beta (v - S0^T kd_t), o_t = S0^T qd_t.
        let mut u = vec![0f32; c * dv];
        let ot = &mut o[t0 * dv..(t0 + c) * dv];
        ot.fill(0.0);
        for t in 0..c {
            let ut = &mut u[t * dv..(t + 1) * dv];
            let oc = &mut ot[t * dv..(t + 1) * dv];
            for i in 0..dk {
                let decay = (gc[t * dk + i] as f32).exp();
                let kd = k[t * dk + i] * decay;
                let qd = q[t * dk + i] * decay;
                let row = &s[i * dv..(i + 1) * dv];
                for j in 0..dv {
                    ut[j] += kd * row[j];
                    oc[j] += qd * row[j];
                }
            }
            for j in 0..dv {
                ut[j] = beta[t] * (v[t * dv + j] - ut[j]);
            }
        }
        // Pairwise decayed products, then the triangular solve for u and the intra-chunk output.
        let mut e = vec![0f32; dk];
        let mut kq = vec![0f32; dk];
        for t in 0..c {
            let (done, rest) = u.split_at_mut(t * dv);
            let ut = &mut rest[..dv];
            let oc = &mut ot[t * dv..(t + 1) * dv];
            for i in 0..=t {
                for ch in 0..dk {
                    e[ch] = ((gc[t * dk + ch] - gc[i * dk + ch]) as f32).exp();
                    kq[ch] = k[i * dk + ch] * e[ch];
                }
                let qk = dot_f32(&q[t * dk..(t + 1) * dk], &kq);
                if i < t {
                    let a = beta[t] * dot_f32(&k[t * dk..(t + 1) * dk], &kq);
                    let ui = &done[i * dv..(i + 1) * dv];
                    for j in 0..dv {
                        ut[j] -= a * ui[j];
                    }
                }
                // u_t is final once every i < t has been subtracted; i == t comes last.
                let ui: &[f32] = if i < t { &done[i * dv..(i + 1) * dv] } else { ut };
                for j in 0..dv {
                    oc[j] += qk * ui[j];
                }
            }
        }
        // State at the end of the chunk.
        let last = &gc[(c - 1) * dk..c * dk];
        for i in 0..dk {
            let row = &mut s[i * dv..(i + 1) * dv];
            let d0 = (last[i] as f32).exp();
            for sj in row.iter_mut() {
                *sj *= d0;
            }
            for t in 0..c {
                let f = ((last[i] - gc[t * dk + i]) as f32).exp() * k[t * dk + i];
                let ut = &u[t * dv..(t + 1) * dv];
                for j in 0..dv {
                    row[j] += f * ut[j];
                }
            }
        }
        t0 += c;
    }
}

/// Deterministic pseudo-random values in [-1, 1) (benchmark and test inputs).
pub(crate) fn lcg_values(seed: &mut u64, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((*seed >> 40) as f32 / (1u64 << 23) as f32) - 1.0
        })
        .collect()
}

/// Seconds to run the state update of `heads` heads over `n` tokens (random inputs, head dim
/// `dk`), with the recurrence or the chunked form; for `deltafin bench kernels`.
pub fn time_state_update(n: usize, heads: usize, dk: usize, chunked: bool) -> f64 {
    let mut seed = 0x2545_F491u64;
    let mut rnd = |k: usize| lcg_values(&mut seed, k);
    let xs: Vec<HeadIn> = (0..heads)
        .map(|_| {
            let mut q = rnd(n * dk);
            let mut k = rnd(n * dk);
            for (qt, kt) in q.chunks_exact_mut(dk).zip(k.chunks_exact_mut(dk)) {
                l2_norm_inplace(qt, INPUT_L2_EPS);
                l2_norm_inplace(kt, INPUT_L2_EPS);
            }
            let g = rnd(n * dk).iter().map(|x| -2.5 * (x + 1.0)).collect();
            HeadIn { q, k, v: rnd(n * dk), g, beta: rnd(n).iter().map(|x| sigmoid(*x)).collect() }
        })
        .collect();
    let mut states = vec![0f32; heads * dk * dk];
    let mut out = vec![0f32; heads * n * dk];
    let t = std::time::Instant::now();
    states.par_chunks_mut(dk * dk).zip(out.par_chunks_mut(n * dk)).zip(xs.par_iter()).for_each(|((s, o), x)| {
        if chunked { chunked_head(s, dk, dk, x, o) } else { recurrent_head(None, s, dk, dk, x, Some(o)) }
    });
    t.elapsed().as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic pseudo-random values in [-1, 1).
    use super::lcg_values as rand_vec;

    fn inputs(seed: &mut u64, n: usize, dk: usize, dv: usize, gate_floor: f32) -> HeadIn {
        let mut q = rand_vec(seed, n * dk);
        let mut k = rand_vec(seed, n * dk);
        for (qt, kt) in q.chunks_exact_mut(dk).zip(k.chunks_exact_mut(dk)) {
            l2_norm_inplace(qt, INPUT_L2_EPS);
            l2_norm_inplace(kt, INPUT_L2_EPS);
        }
        // g in (gate_floor, 0): the shipped gate lies in (-5, 0).
        let g = rand_vec(seed, n * dk).iter().map(|x| gate_floor * 0.5 * (x + 1.0)).collect();
        let beta = rand_vec(seed, n).iter().map(|x| sigmoid(3.0 * x)).collect();
        HeadIn { q, k, v: rand_vec(seed, n * dv), g, beta }
    }

    fn rel(a: &[f32], b: &[f32]) -> f64 {
        let num: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).powi(2)).sum();
        let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
        (num / den.max(1e-30)).sqrt()
    }

    #[test]
    fn chunked_form_equals_recurrence() {
        let mut seed = 42u64;
        for &(n, dk, floor) in &[
            (1usize, 16usize, -5.0f32),
            (5, 8, -5.0),
            (63, 16, -5.0),
            (64, 16, -0.1),
            (65, 24, -5.0),
            (130, 16, -1.0),
            (200, 32, -5.0),
        ] {
            let dv = dk;
            let x = inputs(&mut seed, n, dk, dv, floor);
            let s0 = rand_vec(&mut seed, dk * dv);
            let (mut s_rec, mut s_chk) = (s0.clone(), s0.clone());
            let (mut o_rec, mut o_chk) = (vec![0f32; n * dv], vec![0f32; n * dv]);
            recurrent_head(None, &mut s_rec, dk, dv, &x, Some(&mut o_rec));
            chunked_head(&mut s_chk, dk, dv, &x, &mut o_chk);
            for t in 0..n {
                let e = rel(&o_chk[t * dv..(t + 1) * dv], &o_rec[t * dv..(t + 1) * dv]);
                assert!(e < 1e-5, "n={n} dk={dk}: output of token {t} differs by {e:.2e}");
            }
            let e = rel(&s_chk, &s_rec);
            assert!(e < 1e-5, "n={n} dk={dk}: final state differs by {e:.2e}");
        }
    }

    #[test]
    fn chunked_calls_compose() {
        // Two chunked calls (state carried) equal one call over the concatenation, to rounding.
        let mut seed = 7u64;
        let (n, dk) = (150usize, 16usize);
        let x = inputs(&mut seed, n, dk, dk, -5.0);
        let split = |a: usize, b: usize| HeadIn {
            q: x.q[a * dk..b * dk].to_vec(),
            k: x.k[a * dk..b * dk].to_vec(),
            v: x.v[a * dk..b * dk].to_vec(),
            g: x.g[a * dk..b * dk].to_vec(),
            beta: x.beta[a..b].to_vec(),
        };
        let mut s1 = vec![0f32; dk * dk];
        let mut o1 = vec![0f32; n * dk];
        chunked_head(&mut s1, dk, dk, &x, &mut o1);
        let mut s2 = vec![0f32; dk * dk];
        let mut o2 = vec![0f32; n * dk];
        chunked_head(&mut s2, dk, dk, &split(0, 37), &mut o2[..37 * dk]);
        chunked_head(&mut s2, dk, dk, &split(37, n), &mut o2[37 * dk..]);
        assert!(rel(&o2, &o1) < 1e-5);
        assert!(rel(&s2, &s1) < 1e-5);
    }

    #[test]
    fn separate_start_state_and_replay_equal_the_in_place_update() {
        let mut seed = 9u64;
        let (n, dk) = (7usize, 16usize);
        let x = inputs(&mut seed, n, dk, dk, -5.0);
        let s0 = rand_vec(&mut seed, dk * dk);
        let mut s_inplace = s0.clone();
        let mut o1 = vec![0f32; n * dk];
        recurrent_head(None, &mut s_inplace, dk, dk, &x, Some(&mut o1));
        let mut s_sep = vec![0f32; dk * dk];
        let mut o2 = vec![0f32; n * dk];
        recurrent_head(Some(&s0), &mut s_sep, dk, dk, &x, Some(&mut o2));
        let mut s_replay = s0.clone();
        recurrent_head(None, &mut s_replay, dk, dk, &x, None);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&s_sep), bits(&s_inplace));
        assert_eq!(bits(&o2), bits(&o1));
        assert_eq!(bits(&s_replay), bits(&s_inplace));
    }
}
