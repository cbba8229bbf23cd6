//! One MoE layer's schedule over every row in flight: route all rows, fetch the layer's expert
//! union once, run each expert on all of its rows as soon as it lands (results go to per-(row,
//! router slot) slots), then combine in router order. Lookahead: the next MoE layer's router on
//! this layer's input predicts its experts, which are prefetched into idle drive capacity once
//! every demanded read of this layer is queued.

use crate::cpu::ops::Situ;
use crate::k3::K3;
use crate::k3::moe::{self, Routes};
use crate::k3::weights::MoeWeights;
use crate::stats::Stats;
use crate::store::{ExpertSource, Flow, Landed, StoreError};
use std::time::Instant;

/// Rows from which a batch reads the next MoE layer's predicted experts ahead (whatever
/// `--prefetch` says): with this many rows the next layer's router on this layer's input names
/// nearly all of that layer's union, so the reads it starts while the batch computes attention are
/// reads the batch needs anyway (prefill stays one read per expert), and the drives do not idle.
pub const READ_AHEAD_ROWS: usize = 128;

/// Experts the next layer's router names for at least this many rows are read ahead.
const READ_AHEAD_MIN_ROWS: usize = 2;

/// Lookahead prefetch around one MoE layer: the experts predicted for this layer earlier (to score
/// and cancel), and the next MoE layer's router (to predict and prefetch its experts).
#[derive(Default)]
pub struct Lookahead<'a> {
    pub predicted_here: Option<&'a [u32]>,
    pub next: Option<(usize, &'a MoeWeights)>,
}

/// Runs MoE layer `layer` on rows `xn` [n, hidden]; returns [n, hidden] and the experts predicted
/// for the next MoE layer (when `look.next` is given).
pub fn layer(
    model: &K3,
    w: &MoeWeights,
    layer: usize,
    src: &dyn ExpertSource,
    xn: &[f32],
    stats: &mut Stats,
    look: Lookahead,
) -> Result<(Vec<f32>, Option<Vec<u32>>), StoreError> {
    let be = &*model.be;
    let c = &model.cfg;
    let t_start = Instant::now();
    let n = xn.len() / c.hidden;
    let lat = c.expert_latent;
    let situ = Situ { beta: c.situ_beta, linear_beta: c.situ_linear_beta };
    let routes: Routes = moe::route(be, c, w, xn);
    let k = routes.k;
    stats.record_routes(layer, &routes.experts, c.experts);
    let union = routes.union();
    if let Some(pred) = look.predicted_here {
        // Score the prediction and drop queued prefetches the real route does not need.
        let hit = pred.iter().filter(|e| union.binary_search(e).is_ok()).count();
        stats.record_prediction(layer, pred.len(), union.len(), hit);
        src.cancel_prefetch(layer, &union);
    }
    let next_routes = look.next.map(|(nl, nw)| (nl, moe::route(be, c, nw, xn)));
    let predicted_next = next_routes.as_ref().map(|(nl, r)| (*nl, r.union()));
    // A large batch reads ahead the next layer's experts its router names for several rows, the
    // most-named first.
    let read_ahead: Option<(usize, Vec<u32>)> = match (&next_routes, &predicted_next) {
        (Some((_, r)), Some((nl, pred))) if n >= READ_AHEAD_ROWS => {
            let mut count = vec![0usize; c.experts];
            for &e in &r.experts {
                count[e as usize] += 1;
            }
            let mut sure = not_held(be, *nl, pred);
            sure.retain(|&e| count[e as usize] >= READ_AHEAD_MIN_ROWS);
            sure.sort_by_key(|&e| std::cmp::Reverse(count[e as usize]));
            Some((*nl, sure))
        }
        _ => None,
    };
    let t_routed = Instant::now();
    stats.router_s += (t_routed - t_start).as_secs_f64();

    let input = moe::expert_input(be, c, w, xn);
    let zd = &input.zd;
    // Expert outputs land in slots [row][k] so the sum can follow router order.
    let mut slots = vec![0f32; n * k * lat];
    let layout = src.layout().clone();
    // (row, router slot) pairs of each expert of the union, built once for the layer.
    let mut targets_of: Vec<Vec<(usize, usize)>> = vec![Vec::new(); union.len()];
    for (i, e) in routes.experts.iter().enumerate() {
        if let Ok(u) = union.binary_search(e) {
            targets_of[u].push((i / k, i % k));
        }
    }
    if n > 1 {
        let rows_of: Vec<usize> = targets_of.iter().map(Vec::len).collect();
        src.note_routes(layer, &union, &rows_of, n);
    }
    let mut kernel_s = 0f64;
    let mut expert_rows = 0usize;
    // The backend may run each expert as it is queued (CPU) or several in one submission (GPU);
    // outputs come back in queue order, recorded here as union indices.
    let mut batch = be.expert_batch(layer, &layout, situ);
    let mut queued: Vec<usize> = Vec::with_capacity(union.len());
    let rows_in = |u: usize| -> Vec<f32> {
        let mut v = Vec::with_capacity(targets_of[u].len() * lat);
        for &(r, _) in &targets_of[u] {
            v.extend_from_slice(&zd[r * lat..(r + 1) * lat]);
        }
        v
    };
    // Experts the backend keeps in device memory run from there and are not fetched.
    let held = batch.claim_held(&union);
    let t = Instant::now();
    for (u, _) in held.iter().enumerate().filter(|(_, h)| **h) {
        batch.add_held(union[u], &rows_in(u));
        queued.push(u);
        expert_rows += targets_of[u].len();
    }
    kernel_s += t.elapsed().as_secs_f64();
    let held_n = queued.len();
    let wanted: Vec<u32> = union.iter().zip(&held).filter(|(_, h)| !**h).map(|(&e, _)| e).collect();
    let mut prefetch_pending =
        predicted_next.as_ref().filter(|_| read_ahead.is_none()).map(|(nl, pred)| (*nl, not_held(be, *nl, pred)));
    if wanted.is_empty()
        && let Some((nl, pred)) = prefetch_pending.take()
    {
        src.prefetch(nl, &pred);
    }
    let t_fetch = Instant::now();
    let then = read_ahead.as_ref().map(|(nl, sure)| (*nl, sure.as_slice()));
    src.fetch_then(layer, &wanted, then, &mut |e: u32, bytes: Landed<'_>| {
        // Every demanded read of this layer is queued by now; predictions fill idle capacity.
        if let Some((nl, pred)) = prefetch_pending.take() {
            src.prefetch(nl, &pred);
        }
        let t = Instant::now();
        let Ok(u) = union.binary_search(&e) else { return Ok(Flow::Continue) };
        batch.add(e, bytes.bytes(), &rows_in(u));
        drop(bytes);
        queued.push(u);
        expert_rows += targets_of[u].len();
        kernel_s += t.elapsed().as_secs_f64();
        Ok(Flow::Continue)
    })?;
    let t = Instant::now();
    for (u, y) in queued.into_iter().zip(batch.finish()) {
        for (i, &(r, j)) in targets_of[u].iter().enumerate() {
            slots[(r * k + j) * lat..][..lat].copy_from_slice(&y[i * lat..(i + 1) * lat]);
        }
    }
    kernel_s += t.elapsed().as_secs_f64();
    let fetch_s = t_fetch.elapsed().as_secs_f64();
    stats.layer_passes += 1;
    stats.device_expert_hits += held_n as u64;
    stats.experts_fetched += union.len() as u64;
    stats.expert_rows += expert_rows as u64;
    stats.expert_bytes_requested += ((union.len() - held_n) * layout.len) as u64;
    stats.expert_bytes = layout.len as u64;
    stats.distinct_experts.extend(union.iter().map(|&e| (layer as u32, e)));
    stats.fetch_trace.push((layer as u32, union.clone()));
    stats.read_wait_s += (fetch_s - kernel_s).max(0.0);
    *stats.layer_read_wait_s.entry(layer as u32).or_insert(0.0) += (fetch_s - kernel_s).max(0.0);
    let t_tail = Instant::now();
    let out = moe::combine(be, c, w, &routes, &slots, input);
    let combine_s = t_tail.elapsed().as_secs_f64();
    // z, the weighted sum, the latent norm/up-projection and shared experts count as expert work.
    stats.expert_kernel_s += kernel_s + combine_s + (t_fetch - t_routed).as_secs_f64();
    stats.moe_experts_s += kernel_s;
    stats.moe_combine_s += combine_s;
    Ok((out, predicted_next.map(|(_, p)| p)))
}

/// `experts` of MoE layer `layer` less those the backend keeps in device memory.
fn not_held(be: &dyn crate::backend::Backend, layer: usize, experts: &[u32]) -> Vec<u32> {
    experts.iter().zip(be.holds_experts(layer, experts)).filter(|(_, h)| !*h).map(|(&e, _)| e).collect()
}
