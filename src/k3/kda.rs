//! Kimi Delta Attention (linear attention with a per-channel decay and a delta-rule update).
//!
//! Per token and head: q, k, v = SiLU(causal depthwise conv(x W^T)); q = l2norm(q) / sqrt(dk);
//! k = l2norm(k); g = lower_bound * sigmoid(exp(A_log[h]) * (f_b(f_a(x)) + dt_bias));
//! beta = sigmoid(x W_b^T); S = diag(exp(g)) S; S += k (x) beta (v - S^T k); o = S^T q;
//! out = o_proj(RMSNorm_head(o) * sigmoid(g_proj(x))).
//!
//! Contract: the layer is split into the projection (a pure function of the rows and the committed
//! conv tail), the state update (a backend kernel) and the output. [`forward`] never writes the
//! committed [`KdaState`]: it returns a [`KdaPending`] with the state after all rows and the rows'
//! update inputs. Keeping the first j rows is two steps: [`KdaPending::keep_first`] (the only one
//! that can fail, a backend call that changes nothing committed) makes the pending state the
//! state after j rows — as it is for all of them, else by replaying them onto the committed
//! state — and [`commit`] (infallible) swaps it in and advances the conv tail. Replaying j rows
//! runs the very operations that feeding those j tokens one by one runs, so the bits are the same.

use super::PAR_MIN_ROWS;
use super::weights::KdaWeights;
use crate::backend::detmath::{sigmoid, silu};
use crate::backend::{Backend, BackendError, HeadIn, StateBuf};
use crate::model::K3Config;
use crate::model::config::KDA_L2_EPS;
use rayon::prelude::*;

/// One sequence's committed state of one KDA layer.
pub struct KdaState {
    /// [heads][dk][dv], row i of a head = key channel i; a GPU backend keeps it in device memory.
    pub s: StateBuf,
    /// Conv tails for q, k, v: each [width-1][P], oldest row first (zeros before the sequence).
    pub tail: [Vec<f32>; 3],
}

impl KdaState {
    /// A zero state for the layers of `c`.
    pub fn new(c: &K3Config) -> Self {
        KdaState {
            s: StateBuf::zeros(c.kda_heads * c.kda_head_dim * c.kda_head_dim),
            tail: std::array::from_fn(|_| vec![0.0; (c.conv_width - 1) * c.kda_dim()]),
        }
    }

    /// A host copy (the state read back from a device that holds it).
    pub fn try_clone(&self) -> Result<Self, BackendError> {
        Ok(KdaState { s: self.s.try_clone()?, tail: self.tail.clone() })
    }
}

/// How the KDA state update is evaluated for a batch of rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KdaMode {
    /// The token recurrence, for prompts and decode alike: on CPU an order of magnitude faster
    /// than the chunked form (`deltafin bench kernels`) and bit-identical to token-at-a-time decode.
    #[default]
    Recurrent,
    /// The chunked (WY) form, kept as a reference; agrees with the recurrence to rounding.
    Chunked,
}

/// A KDA layer's uncommitted result: the state after its rows and what a replay needs.
pub struct KdaPending {
    /// The state after the first `after` rows.
    s_after: StateBuf,
    /// Pre-conv projections of q, k, v for each row: [n, P] each.
    conv_in: [Vec<f32>; 3],
    heads: Vec<HeadIn>,
    rows: usize,
    after: usize,
}

impl KdaPending {
    /// The state buffer, for reuse by the next forward.
    pub fn into_spare(self) -> StateBuf {
        self.s_after
    }

    /// Makes the pending state the state after the first `j` rows (at most all of them) of the
    /// committed state `st`, replaying them when fewer than all: the fallible half of keeping
    /// them, which changes nothing committed. On an error the pending state is no longer valid
    /// (the forward must be rolled back).
    pub fn keep_first(&mut self, be: &dyn Backend, c: &K3Config, st: &KdaState, j: usize) -> Result<(), BackendError> {
        let j = j.min(self.rows);
        if j == self.after || j == 0 {
            return Ok(());
        }
        let dk = c.kda_head_dim;
        let first: Vec<HeadIn> = self
            .heads
            .iter()
            .map(|x| HeadIn {
                q: Vec::new(),
                k: x.k[..j * dk].to_vec(),
                v: x.v[..j * dk].to_vec(),
                g: x.g[..j * dk].to_vec(),
                beta: x.beta[..j].to_vec(),
            })
            .collect();
        self.after = 0;
        be.kda_replay(&st.s, &mut self.s_after, &first, dk, dk)?;
        self.after = j;
        Ok(())
    }
}

/// Causal depthwise conv (taps [P, width], last tap = current token) followed by SiLU of the rows
/// `x` [n, P]; `tail` holds the previous width-1 input rows (not advanced here). Returns [n, P].
fn conv_silu(x: &[f32], tail: &[f32], taps: &[f32], p: usize, width: usize) -> Vec<f32> {
    let n = x.len() / p;
    let hist = width - 1;
    let mut ext = Vec::with_capacity((hist + n) * p);
    ext.extend_from_slice(tail);
    ext.extend_from_slice(x);
    let mut out = vec![0f32; n * p];
    let row = |(t, row): (usize, &mut [f32])| {
        for (c, y) in row.iter_mut().enumerate() {
            let w = &taps[c * width..(c + 1) * width];
            let mut acc = 0f32;
            for (j, &wj) in w.iter().enumerate() {
                acc += wj * ext[(t + j) * p + c];
            }
            *y = silu(acc);
        }
    };
    // Rows are independent: a prompt's across threads (same bits).
    if n >= PAR_MIN_ROWS {
        out.par_chunks_mut(p.max(1)).enumerate().for_each(row);
    } else {
        out.chunks_mut(p.max(1)).enumerate().for_each(row);
    }
    out
}

/// The conv tail after `rows` ([j, P] pre-conv inputs): the last width-1 rows of [tail, rows].
fn advance_tail(tail: &mut [f32], rows: &[f32], p: usize) {
    let hist = tail.len() / p;
    let n = rows.len() / p;
    if n >= hist {
        tail.copy_from_slice(&rows[(n - hist) * p..]);
    } else if n > 0 {
        tail.copy_within(n * p.., 0);
        let keep = (hist - n) * p;
        tail[keep..].copy_from_slice(rows);
    }
}

/// Runs one KDA layer on `n` rows of normalised input `xn` [n, hidden] after the committed state
/// `st`; returns [n, hidden] and the pending state. `spare` is a state-sized buffer to reuse.
pub fn forward(
    be: &dyn Backend,
    c: &K3Config,
    w: &KdaWeights,
    st: &KdaState,
    xn: &[f32],
    mode: KdaMode,
    spare: Option<StateBuf>,
) -> Result<(Vec<f32>, KdaPending), BackendError> {
    let h = c.hidden;
    let n = xn.len() / h;
    let p = c.kda_dim();
    let (nh, dk) = (c.kda_heads, c.kda_head_dim);
    let dv = dk;

    // The six projections of the input in one call (one submission on the GPU).
    let mut conv_in: [Vec<f32>; 3] = std::array::from_fn(|_| vec![0f32; n * p]);
    let mut fa = vec![0f32; n * dk];
    let mut beta = vec![0f32; n * nh];
    let mut gate = vec![0f32; n * p];
    {
        let [cq, ck, cv] = &mut conv_in;
        let ws = [&w.q_proj, &w.k_proj, &w.v_proj, &w.f_a, &w.b_proj, &w.g_proj];
        be.matmul_bf16_many(&ws, xn, &mut [cq, ck, cv, &mut fa, &mut beta, &mut gate])?;
    }
    let proj: [Vec<f32>; 3] = std::array::from_fn(|i| {
        let taps = [&w.q_conv, &w.k_conv, &w.v_conv][i];
        conv_silu(&conv_in[i], &st.tail[i], taps, p, c.conv_width)
    });
    let mut g = vec![0f32; n * p];
    be.matmul_bf16(&w.f_b, &fa, &mut g)?;
    let lb = c.kda_gate_lower_bound;
    let gate_row = |row: &mut [f32]| {
        for (ch, gv) in row.iter_mut().enumerate() {
            *gv = lb * sigmoid(w.a_exp[ch / dk] * (*gv + w.dt_bias[ch]));
        }
    };
    if n >= PAR_MIN_ROWS {
        g.par_chunks_exact_mut(p).for_each(gate_row);
    } else {
        g.chunks_exact_mut(p).for_each(gate_row);
    }
    beta.iter_mut().for_each(|b| *b = sigmoid(*b));

    // Gather per-head inputs; normalise q and k per head.
    let q_scale = 1.0 / (dk as f32).sqrt();
    let head = |hd: usize| {
        let gather = |src: &[f32]| -> Vec<f32> {
            let mut out = Vec::with_capacity(n * dk);
            for t in 0..n {
                out.extend_from_slice(&src[t * p + hd * dk..t * p + (hd + 1) * dk]);
            }
            out
        };
        let mut q = gather(&proj[0]);
        let mut k = gather(&proj[1]);
        // Each row on its own: normalising all of q, then all of k, gives the same bits.
        be.l2_norm_rows(&mut q, dk, KDA_L2_EPS)?;
        q.iter_mut().for_each(|x| *x *= q_scale);
        be.l2_norm_rows(&mut k, dk, KDA_L2_EPS)?;
        Ok(HeadIn { q, k, v: gather(&proj[2]), g: gather(&g), beta: (0..n).map(|t| beta[t * nh + hd]).collect() })
    };
    let heads: Vec<HeadIn> = if n >= PAR_MIN_ROWS {
        (0..nh).into_par_iter().map(head).collect::<Result<_, BackendError>>()?
    } else {
        (0..nh).map(head).collect::<Result<_, BackendError>>()?
    };

    let mut s_after = spare.filter(|s| s.len() == st.s.len()).unwrap_or_else(|| StateBuf::zeros(st.s.len()));
    let mut o_heads = vec![0f32; nh * n * dv];
    be.kda_update(&st.s, &mut s_after, &heads, dk, dv, &mut o_heads, mode == KdaMode::Chunked)?;

    // Per-head RMSNorm (every head's every row in one call), output gate, o_proj.
    be.rms_norm_rows(&mut o_heads, &w.o_norm, c.rms_eps)?;
    let mut o = vec![0f32; n * p];
    let out_row = |(t, row): (usize, &mut [f32])| {
        for hd in 0..nh {
            let dst = &mut row[hd * dv..(hd + 1) * dv];
            dst.copy_from_slice(&o_heads[hd * n * dv + t * dv..][..dv]);
            for (x, &gv) in dst.iter_mut().zip(&gate[t * p + hd * dv..t * p + (hd + 1) * dv]) {
                *x *= sigmoid(gv);
            }
        }
    };
    if n >= PAR_MIN_ROWS {
        o.par_chunks_mut(p.max(1)).enumerate().for_each(out_row);
    } else {
        o.chunks_mut(p.max(1)).enumerate().for_each(out_row);
    }
    let mut out = vec![0f32; n * h];
    be.matmul_bf16(&w.o_proj, &o, &mut out)?;
    // Only the update inputs a replay needs are kept (q is not).
    let heads = heads.into_iter().map(|x| HeadIn { q: Vec::new(), ..x }).collect();
    Ok((out, KdaPending { s_after, conv_in, heads, rows: n, after: n }))
}

/// Makes the first `j` rows of `pending` part of the committed state once
/// [`KdaPending::keep_first`] made its state the state after them (`j` of 0 keeps none); returns
/// the spare buffer.
pub fn commit(c: &K3Config, st: &mut KdaState, pending: KdaPending, j: usize) -> StateBuf {
    let p = c.kda_dim();
    let j = j.min(pending.rows);
    if j == 0 {
        return pending.s_after;
    }
    debug_assert_eq!(j, pending.after, "keep_first({j}) comes before commit");
    for (tail, rows) in st.tail.iter_mut().zip(&pending.conv_in) {
        advance_tail(tail, &rows[..j * p], p);
    }
    let mut s_after = pending.s_after;
    std::mem::swap(&mut st.s, &mut s_after);
    s_after
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conv_uses_the_last_tap_for_the_current_token() {
        // One channel, taps [1, 10, 100, 1000]: y_t = x_{t-3} + 10 x_{t-2} + 100 x_{t-1} + 1000 x_t.
        let taps = [1.0f32, 10.0, 100.0, 1000.0];
        let tail = vec![0f32; 3];
        let x = conv_silu(&[0.001f32, 0.0, 0.0, 0.0], &tail, &taps, 1, 4);
        let want: Vec<f32> = [1.0f32, 0.1, 0.01, 0.001].iter().map(|&v| silu(v)).collect();
        for (a, b) in x.iter().zip(&want) {
            assert!((a - b).abs() < 1e-6, "{x:?} vs {want:?}");
        }
        assert_eq!(tail, vec![0.0, 0.0, 0.0]);
    }

    #[test]
    fn tails_advance_by_any_number_of_rows() {
        let mut tail = vec![1.0f32, 2.0, 3.0];
        advance_tail(&mut tail, &[4.0], 1);
        assert_eq!(tail, vec![2.0, 3.0, 4.0]);
        advance_tail(&mut tail, &[5.0, 6.0], 1);
        assert_eq!(tail, vec![4.0, 5.0, 6.0]);
        advance_tail(&mut tail, &[7.0, 8.0, 9.0, 10.0], 1);
        assert_eq!(tail, vec![8.0, 9.0, 10.0]);
        advance_tail(&mut tail, &[], 1);
        assert_eq!(tail, vec![8.0, 9.0, 10.0]);
    }
}
