//! MLA attention core (CPU) in absorbed form: keys and values are never expanded. For each new row
//! and head the query's nope part is absorbed through kv_b's key rows (score = (W_k^T q_nope) . c +
//! q_pe . k_pe), the causal softmax mixes cached latents, and kv_b's value rows map the mixed latent
//! to the head's value. One task per (row, head); each task is a fixed sequential order, so the
//! result does not depend on threading. The tests check it against the textbook form (keys and
//! values expanded through kv_b) in f64.

use super::dot_f32;
use super::ops::{axpy, softmax_of_products};
use crate::backend::types::{Bf16Mat, MlaDims, Visible};
use rayon::prelude::*;

/// `q` [n, heads, nope + rope] for the `n` rows that follow `past` cached tokens; `cache` holds
/// [past + n, lora + rope] latents (the new rows included). Writes `out` [n, heads, v_head].
/// Causal, scale (nope + rope)^-1/2.
pub fn attention(q: &[f32], cache: &[f32], past: usize, kv_b: &Bf16Mat, d: MlaDims, out: &mut [f32]) {
    let scale = 1.0 / ((d.nope + d.rope) as f32).sqrt();
    attention_with(q, cache, past, kv_b, d, scale, Visible::Causal, out)
}

/// [`attention`] with a given softmax scale and visibility.
#[allow(clippy::too_many_arguments)]
pub fn attention_with(
    q: &[f32],
    cache: &[f32],
    past: usize,
    kv_b: &Bf16Mat,
    d: MlaDims,
    scale: f32,
    visible: Visible,
    out: &mut [f32],
) {
    let (nh, nope, rope, lora, vd) = (d.heads, d.nope, d.rope, d.lora, d.v_head);
    let qd = nope + rope;
    let lat = lora + rope;
    let all = cache.len() / lat;
    out.par_chunks_mut(vd).enumerate().for_each(|(idx, out)| {
        let (t, hd) = (idx / nh, idx % nh);
        let qh = &q[(t * nh + hd) * qd..][..qd];
        let (q_nope, q_pe) = qh.split_at(nope);
        // q_abs = W_k^T q_nope, accumulated over the head's key rows in order.
        let mut q_abs = vec![0f32; lora];
        let mut wrow = vec![0f32; lora];
        for (i, &qi) in q_nope.iter().enumerate() {
            kv_b.decode_row(hd * (nope + vd) + i, &mut wrow);
            axpy(&mut q_abs, qi, &wrow);
        }
        let len = if visible == Visible::All { all } else { past + t + 1 };
        let mut p: Vec<f32> = (0..len)
            .map(|s| {
                let cs = &cache[s * lat..(s + 1) * lat];
                dot_f32(&q_abs, &cs[..lora]) + dot_f32(q_pe, &cs[lora..])
            })
            .collect();
        // The scale is applied inside the softmax's fma (no separate product a GPU could contract).
        softmax_of_products(&mut p, &[scale]);
        let mut mixed = vec![0f32; lora];
        for (s, &ps) in p.iter().enumerate() {
            axpy(&mut mixed, ps, &cache[s * lat..s * lat + lora]);
        }
        for (j, o) in out.iter_mut().enumerate() {
            kv_b.decode_row(hd * (nope + vd) + nope + j, &mut wrow);
            *o = dot_f32(&wrow, &mixed);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same attention with keys and values expanded through kv_b (the textbook form), in f64:
    /// an independent reference for [`attention`].
    fn attention_expanded_f64(q: &[f32], cache: &[f32], past: usize, kv_b: &Bf16Mat, d: MlaDims) -> Vec<f64> {
        let (nh, nope, rope, lora, vd) = (d.heads, d.nope, d.rope, d.lora, d.v_head);
        let qd = nope + rope;
        let lat = lora + rope;
        let n = q.len() / (nh * qd);
        let tokens = past + n;
        let w = |r: usize| -> Vec<f64> {
            let mut row = vec![0f32; lora];
            kv_b.decode_row(r, &mut row);
            row.into_iter().map(f64::from).collect()
        };
        let mut out = vec![0f64; n * nh * vd];
        for hd in 0..nh {
            let wk: Vec<Vec<f64>> = (0..nope).map(|i| w(hd * (nope + vd) + i)).collect();
            let wv: Vec<Vec<f64>> = (0..vd).map(|j| w(hd * (nope + vd) + nope + j)).collect();
            let dotl = |a: &[f64], c: &[f32]| a.iter().zip(c).map(|(x, y)| x * f64::from(*y)).sum::<f64>();
            let keys: Vec<Vec<f64>> =
                (0..tokens).map(|s| wk.iter().map(|r| dotl(r, &cache[s * lat..s * lat + lora])).collect()).collect();
            let vals: Vec<Vec<f64>> =
                (0..tokens).map(|s| wv.iter().map(|r| dotl(r, &cache[s * lat..s * lat + lora])).collect()).collect();
            for t in 0..n {
                let qh = &q[(t * nh + hd) * qd..][..qd];
                let len = past + t + 1;
                let scores: Vec<f64> = (0..len)
                    .map(|s| {
                        let nope_part: f64 = keys[s].iter().zip(&qh[..nope]).map(|(k, q)| k * f64::from(*q)).sum();
                        let pe: f64 = cache[s * lat + lora..(s + 1) * lat]
                            .iter()
                            .zip(&qh[nope..])
                            .map(|(k, q)| f64::from(*k) * f64::from(*q))
                            .sum();
                        (nope_part + pe) / (qd as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for j in 0..vd {
                    out[(t * nh + hd) * vd + j] = (0..len).map(|s| e[s] / z * vals[s][j]).sum();
                }
            }
        }
        out
    }

    #[test]
    fn absorbed_attention_matches_the_expanded_f64_form() {
        let d = MlaDims { heads: 3, nope: 16, rope: 8, lora: 32, v_head: 16 };
        let mut seed = 5u64;
        let mut rnd = |n: usize| crate::cpu::kda::lcg_values(&mut seed, n);
        let rows = d.heads * (d.nope + d.v_head);
        let wbytes: Vec<u8> = rnd(rows * d.lora).iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect();
        let kv_b = Bf16Mat::from_vec(wbytes, rows, d.lora);
        let (past, n) = (5usize, 3usize);
        let cache = rnd((past + n) * (d.lora + d.rope));
        let q = rnd(n * d.heads * (d.nope + d.rope));
        let mut got = vec![0f32; n * d.heads * d.v_head];
        attention(&q, &cache, past, &kv_b, d, &mut got);
        let want = attention_expanded_f64(&q, &cache, past, &kv_b, d);
        let num: f64 = got.iter().zip(&want).map(|(a, b)| (f64::from(*a) - b).powi(2)).sum();
        let den: f64 = want.iter().map(|b| b * b).sum();
        assert!((num / den).sqrt() < 1e-5, "relative error {}", (num / den).sqrt());
    }
}
