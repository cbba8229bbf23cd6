//! Routed "latent" mixture of experts with shared experts, and the dense SiTU MLP.
//!
//! Router: s = sigmoid(x W_gate^T); the top-k of (s + correction bias) are selected (ties: lower
//! expert id first) — this selection order is the *router order*; weights are the unbiased s of the
//! selected experts, renormalised (sum + 1e-20) and scaled. Routed path: z = down_proj(x); each
//! expert computes w2(situ(w1 z, w3 z)) from its raw MXFP4 bytes; outputs are summed per row in
//! router order (never arrival order); then up_proj(RMSNorm(sum)). Shared experts see x itself.
//!
//! Contract: the layer is [`route`], [`expert_input`], the routed experts and [`combine`] (put
//! together in `forward`); the routed experts come from the forward's schedule, which decides which
//! bytes to read and when and feeds them to [`RoutedExperts`] in any order;
//! [`RoutedExperts::finish`] sums each row's outputs in router order, so the layer's result
//! does not depend on the order the experts arrived in.

use super::finite::{Site, first_non_finite};
use super::weights::{MlpWeights, MoeWeights};
use super::{ForwardError, PAR_MIN_ROWS, situ};
use crate::backend::{Backend, BackendError, ExpertBatch, ExpertLayout, RouteRule, Situ};
use crate::model::K3Config;
use rayon::prelude::*;

/// Dense SiTU-GLU MLP on rows `xn` [n, hidden].
pub fn mlp(be: &dyn Backend, w: &MlpWeights, situ: Situ, xn: &[f32]) -> Result<Vec<f32>, BackendError> {
    let (inter, h) = (w.gate.rows, w.down.rows);
    let n = xn.len() / w.gate.cols;
    let mut g = vec![0f32; n * inter];
    let mut u = vec![0f32; n * inter];
    be.matmul_bf16_many(&[&w.gate, &w.up], xn, &mut [&mut g, &mut u])?;
    let mut a = vec![0f32; n * inter];
    be.situ(situ, &g, &u, &mut a)?;
    let mut out = vec![0f32; n * h];
    be.matmul_bf16(&w.down, &a, &mut out)?;
    Ok(out)
}

/// Each row's selected experts and weights, in router order: [n, k].
pub struct Routes {
    pub k: usize,
    pub experts: Vec<u32>,
    pub weights: Vec<f32>,
}

impl Routes {
    /// Distinct experts over all rows, ascending.
    pub fn union(&self) -> Vec<u32> {
        let mut u = self.experts.clone();
        u.sort_unstable();
        u.dedup();
        u
    }
}

/// Routes every row of `xn`.
pub fn route(be: &dyn Backend, c: &K3Config, w: &MoeWeights, xn: &[f32]) -> Result<Routes, BackendError> {
    let n = xn.len() / c.hidden;
    let e = c.experts;
    let k = c.top_k;
    let mut logits = vec![0f32; n * e];
    be.matmul_bf16(&w.router, xn, &mut logits)?;
    let mut experts = vec![0u32; n * k];
    let mut weights = vec![0f32; n * k];
    let rule = RouteRule { k, renormalize: c.renormalize, scaling: c.routed_scaling };
    be.route_top_k(&logits, &w.bias, rule, &mut experts, &mut weights)?;
    Ok(Routes { k, experts, weights })
}

/// One MoE layer's routed experts as they run: a schedule feeds it the experts of the routes'
/// union in any order (held by the backend, or their bytes as they land); each runs through the
/// backend's [`ExpertBatch`] on the rows routed to it.
pub struct RoutedExperts<'a> {
    union: Vec<u32>,
    /// (row, router slot) pairs of each expert of the union.
    targets_of: Vec<Vec<(usize, usize)>>,
    zd: &'a [f32],
    latent: usize,
    k: usize,
    rows: usize,
    be: &'a dyn Backend,
    batch: Box<dyn ExpertBatch + 'a>,
    /// Union indices in the order they were queued (the batch's output order).
    queued: Vec<usize>,
    rows_run: usize,
    layer: usize,
}

impl<'a> RoutedExperts<'a> {
    /// The experts of `routes` for MoE layer `layer` on the deinterleaved latent rows `zd`
    /// [n, latent], to run on `be` (their bytes laid out as `layout`).
    pub fn new(
        be: &'a dyn Backend,
        c: &K3Config,
        layer: usize,
        layout: &'a ExpertLayout,
        routes: &Routes,
        zd: &'a [f32],
    ) -> Self {
        let (k, latent) = (routes.k, c.expert_latent);
        let union = routes.union();
        let mut targets_of: Vec<Vec<(usize, usize)>> = vec![Vec::new(); union.len()];
        for (i, e) in routes.experts.iter().enumerate() {
            if let Ok(u) = union.binary_search(e) {
                targets_of[u].push((i / k, i % k));
            }
        }
        let rows = zd.len() / latent.max(1);
        let batch = be.expert_batch(layer, layout, situ(c));
        RoutedExperts { union, targets_of, zd, latent, k, rows, be, batch, queued: Vec::new(), rows_run: 0, layer }
    }

    /// The distinct experts routed to, ascending.
    pub fn union(&self) -> &[u32] {
        &self.union
    }

    /// How many rows each expert of the union serves.
    pub fn rows_of(&self) -> Vec<usize> {
        self.targets_of.iter().map(Vec::len).collect()
    }

    /// Rows of expert work queued so far (an expert on m rows counts m).
    pub fn rows_run(&self) -> usize {
        self.rows_run
    }

    /// Which experts of the union the backend holds in its own memory (claimed until
    /// [`RoutedExperts::finish`]; queue them with [`RoutedExperts::add_held`]).
    pub fn claim_held(&mut self) -> Vec<bool> {
        self.batch.claim_held(&self.union)
    }

    /// The rows of union expert `u`, gathered.
    fn rows_in(&self, u: usize) -> Vec<f32> {
        let lat = self.latent;
        let targets = &self.targets_of[u];
        let mut v = vec![0f32; targets.len() * lat];
        let gather = |(d, &(r, _)): (&mut [f32], &(usize, usize))| d.copy_from_slice(&self.zd[r * lat..(r + 1) * lat]);
        // A prefill expert's rows are MBs: gathered across threads; a decode step's few in place.
        if targets.len() >= PAR_MIN_ROWS {
            v.par_chunks_mut(lat.max(1)).zip(targets.par_iter()).for_each(gather);
        } else {
            v.chunks_mut(lat.max(1)).zip(targets.iter()).for_each(gather);
        }
        v
    }

    /// Queues union expert `u` (one [`RoutedExperts::claim_held`] said is held) from the
    /// backend's copy.
    pub fn add_held(&mut self, u: usize) -> Result<(), BackendError> {
        let rows = self.rows_in(u);
        self.batch.add_held(self.union[u], &rows)?;
        self.queue(u);
        Ok(())
    }

    /// Queues expert `e` from its shipped bytes; false (and nothing queued) when it is not in
    /// the union.
    pub fn add(&mut self, e: u32, bytes: &[u8]) -> Result<bool, BackendError> {
        let Ok(u) = self.union.binary_search(&e) else { return Ok(false) };
        let rows = self.rows_in(u);
        self.batch.add(e, bytes, &rows)?;
        self.queue(u);
        Ok(true)
    }

    fn queue(&mut self, u: usize) {
        self.queued.push(u);
        self.rows_run += self.targets_of[u].len();
    }

    /// Each row's routed sum [n, latent]: its experts' outputs weighted by `weights` [n, k] and
    /// added in router order (slot 0 first), straight from the experts' outputs — no
    /// [n][k][latent] slot buffer (a 2048-row pass's was 128 MB, allocated zeroed and read back).
    /// A slot no queued expert filled adds a weighted zero, as a zeroed slot did. A non-finite
    /// sum is an error naming the expert whose output made it ([`Site::Expert`]; the router's
    /// weight or the sum itself: [`Site::Moe`]), its `pos` the row of the pass (the forward
    /// turns it into the sequence's position).
    pub fn finish(self, weights: &[f32]) -> Result<Vec<f32>, ForwardError> {
        let (lat, k, be) = (self.latent, self.k, self.be);
        let outs = self.batch.finish()?;
        // Where each slot's row comes from: (queued output, its row).
        let mut from = vec![None; self.rows * k];
        for (q, &u) in self.queued.iter().enumerate() {
            for (i, &(r, j)) in self.targets_of[u].iter().enumerate() {
                from[r * k + j] = Some((q, i));
            }
        }
        let zero = vec![0f32; lat];
        let mut routed = vec![0f32; self.rows * lat];
        // Rows are independent (each its own sum in router order): across threads, same bits.
        let sum_row = |(r, acc): (usize, &mut [f32])| {
            for j in 0..k {
                let x = match from[r * k + j] {
                    Some((q, i)) => &outs[q][i * lat..(i + 1) * lat],
                    None => &zero[..],
                };
                be.axpy(acc, weights[r * k + j], x);
            }
        };
        if self.rows >= PAR_MIN_ROWS {
            routed.par_chunks_mut(lat.max(1)).enumerate().for_each(sum_row);
        } else {
            routed.chunks_mut(lat.max(1)).enumerate().for_each(sum_row);
        }
        if let Some(i) = first_non_finite(&routed) {
            let r = i / lat.max(1);
            // The first slot in router order whose output is not finite names the expert.
            let expert = (0..k).find_map(|j| {
                let (q, i) = from[r * k + j]?;
                first_non_finite(&outs[q][i * lat..(i + 1) * lat]).map(|_| self.union[self.queued[q]])
            });
            let site = expert.map_or(Site::Moe(self.layer), |e| Site::Expert(self.layer, e));
            return Err(ForwardError::NonFinite { site, value: routed[i], pos: r, seq: 0 });
        }
        Ok(routed)
    }
}

/// What the MoE layer computes from its input before the experts: the routed input z =
/// down_proj(x), deinterleaved for the MXFP4 kernels ([n, latent]), and the shared experts'
/// gate and up projections (one backend call for the three: one submission on the GPU).
pub struct ExpertInput {
    pub zd: Vec<f32>,
    shared_gate_up: Option<(Vec<f32>, Vec<f32>)>,
}

/// [`ExpertInput`] of rows `xn`.
pub fn expert_input(be: &dyn Backend, c: &K3Config, w: &MoeWeights, xn: &[f32]) -> Result<ExpertInput, BackendError> {
    let lat = c.expert_latent;
    let n = xn.len() / c.hidden;
    let mut z = vec![0f32; n * lat];
    let shared_gate_up = match &w.shared {
        Some(sh) => {
            let mut g = vec![0f32; n * sh.gate.rows];
            let mut u = vec![0f32; n * sh.up.rows];
            be.matmul_bf16_many(&[&w.down_proj, &sh.gate, &sh.up], xn, &mut [&mut z, &mut g, &mut u])?;
            Some((g, u))
        }
        None => {
            be.matmul_bf16(&w.down_proj, xn, &mut z)?;
            None
        }
    };
    let mut zd = vec![0f32; n * lat];
    if n >= PAR_MIN_ROWS {
        zd.par_chunks_exact_mut(lat)
            .zip(z.par_chunks_exact(lat))
            .for_each(|(dst, src)| be.deinterleave_mxfp4_input(src, dst));
    } else {
        for (src_row, dst) in z.chunks_exact(lat).zip(zd.chunks_exact_mut(lat)) {
            be.deinterleave_mxfp4_input(src_row, dst);
        }
    }
    Ok(ExpertInput { zd, shared_gate_up })
}

/// The layer's output from the routed sum [n, latent] ([`RoutedExperts::finish`]): the latent
/// norm, the up-projection, plus the shared experts (from `input`'s gate and up projections;
/// their down projection goes with the up-projection: one call).
pub fn combine(
    be: &dyn Backend,
    c: &K3Config,
    w: &MoeWeights,
    mut routed: Vec<f32>,
    input: ExpertInput,
) -> Result<Vec<f32>, BackendError> {
    let lat = c.expert_latent;
    let n = input.zd.len() / lat.max(1);
    if let Some(norm) = &w.routed_norm {
        be.rms_norm_rows(&mut routed, norm, c.rms_eps)?;
    }
    let mut out = vec![0f32; n * c.hidden];
    match (&w.shared, input.shared_gate_up) {
        (Some(sh), Some((g, u))) => {
            let mut a = vec![0f32; g.len()];
            be.situ(situ(c), &g, &u, &mut a)?;
            let mut s = vec![0f32; n * sh.down.rows];
            be.matmul_bf16_each(&[&w.up_proj, &sh.down], &[&routed, &a], &mut [&mut out, &mut s])?;
            let add = |(o, v): (&mut [f32], &[f32])| o.iter_mut().zip(v).for_each(|(o, v)| *o += v);
            if n >= PAR_MIN_ROWS {
                out.par_chunks_mut(c.hidden.max(1)).zip(s.par_chunks(c.hidden.max(1))).for_each(add);
            } else {
                add((&mut out, &s));
            }
        }
        (None, _) => be.matmul_bf16(&w.up_proj, &routed, &mut out)?,
        (Some(_), None) => unreachable!("the shared experts' gate and up come with the expert input"),
    }
    Ok(out)
}
