//! The expert schedule of each MoE layer, over every row in flight: the layer's expert union is
//! fetched once, experts the backend holds in device memory run from there, every other expert
//! runs on all of its rows as soon as it lands (`k3::moe::RoutedExperts` puts its outputs in
//! router order). Lookahead: the next MoE layer's router on this layer's input predicts its
//! experts, which are prefetched into idle drive capacity once every demanded read of this layer
//! is queued. A batch of several rows reads them ahead with the fetch itself, most-named first: a
//! large batch every expert named for two rows or more, a decode step of a few rows the first
//! [`read_ahead_depth`] of them (enough to keep the drives busy while the step computes attention
//! and the next router, little to waste on a wrong guess).
//!
//! Contract: the schedule changes what is read and when, never a result; it counts every layer
//! pass, expert, row and byte, and times the phases (`Stats`).

use super::{Options, PhaseClock};
use crate::backend::Device;
use crate::k3::forward::{Phase, Schedule};
use crate::k3::moe::{self, RoutedExperts, Routes};
use crate::k3::{ForwardError, K3};
use crate::stats::Stats;
use crate::store::{ExpertSource, Flow, Landed};
use std::time::Instant;

/// Rows from which a batch reads the next MoE layer's predicted experts ahead (whatever
/// `--prefetch` says): with this many rows the next layer's router on this layer's input names
/// nearly all of that layer's union, so the reads it starts while the batch computes attention are
/// reads the batch needs anyway (prefill stays one read per expert), and the drives do not idle.
pub const READ_AHEAD_ROWS: usize = 128;

/// Experts the next layer's router names for at least this many rows are read ahead by a batch of
/// [`READ_AHEAD_ROWS`] rows or more.
const READ_AHEAD_MIN_ROWS: usize = 2;

/// Experts a batch of `rows` rows, fewer than [`READ_AHEAD_ROWS`] (but two or more: a decode step
/// of several sequences), reads ahead, most-named first: two reads per slot of the drives' queues
/// (`queue_depth`, all drives together) and one more for every two rows, what the drives get
/// through while the step runs attention, norms and the next layer's router, which grow with the
/// rows (on the bench's K3-shaped synth, 2 cores: ~12 ms between MoE layers at 8 rows, ~40 ms at
/// 32, where an expert read takes ~2.4 ms). With several sequences the router's guess is nearly
/// always needed; a wrong one costs one read of the drive's time. The engine reserves read slots
/// for them ([`crate::store::expert_store::StoreOptions::read_ahead_slots`]).
pub fn read_ahead_depth(queue_depth: usize, rows: usize) -> usize {
    2 * queue_depth.max(1) + rows / 2
}

/// Read slots a store on `drives` keeps for the reads ahead of `sequences` sequences decoding
/// together (none for one sequence: it reads nothing ahead unless `--prefetch`).
pub fn read_ahead_slots(drives: &[crate::store::expert_store::DriveSpec], sequences: usize) -> usize {
    let qd = drives.iter().map(|d| d.qd.max(1)).sum();
    if sequences >= 2 { read_ahead_depth(qd, sequences.min(READ_AHEAD_ROWS - 1)) } else { 0 }
}

/// The schedule of one forward: its expert source, the device's expert cache, the lookahead
/// carried from one MoE layer to the next, and the counters and phase clock.
pub struct StoreSchedule<'a> {
    model: &'a K3,
    device: &'a dyn Device,
    source: Option<&'a dyn ExpertSource>,
    opts: Options,
    /// Rows of the whole batch.
    rows: usize,
    /// The experts predicted for the next MoE layer (by the last one's lookahead).
    predicted: Option<Vec<u32>>,
    stats: &'a mut Stats,
    clock: PhaseClock,
    /// Told after each MoE layer (`super::run`); false stops the forward.
    watch: Option<&'a mut super::LayerWatch<'a>>,
    moe_done: usize,
}

impl<'a> StoreSchedule<'a> {
    pub fn new(
        model: &'a K3,
        device: &'a dyn Device,
        source: Option<&'a dyn ExpertSource>,
        opts: Options,
        rows: usize,
        stats: &'a mut Stats,
    ) -> Self {
        StoreSchedule {
            model,
            device,
            source,
            opts,
            rows,
            predicted: None,
            stats,
            clock: PhaseClock::new(),
            watch: None,
            moe_done: 0,
        }
    }

    /// The schedule telling `watch` after each MoE layer (see `super::run`).
    pub fn watched(mut self, watch: &'a mut super::LayerWatch<'a>) -> Self {
        self.watch = Some(watch);
        self
    }

    /// Ends the last phase; the counters, for the caller's own.
    pub fn close(mut self) -> &'a mut Stats {
        self.clock.enter(None, self.stats);
        self.stats
    }

    /// `experts` of MoE layer `layer` less those the backend keeps in device memory.
    fn not_held(&self, layer: usize, experts: &[u32]) -> Vec<u32> {
        experts.iter().zip(self.device.holds_experts(layer, experts)).filter(|(_, h)| !*h).map(|(&e, _)| e).collect()
    }
}

impl Schedule for StoreSchedule<'_> {
    fn phase(&mut self, phase: Phase) {
        self.clock.enter(Some(phase), self.stats);
    }

    fn routed(&mut self, layer: usize, xn: &[f32], routes: &Routes, zd: &[f32]) -> Result<Vec<f32>, ForwardError> {
        // The routed input so far: expert work; this call's time is counted part by part below.
        self.clock.enter(None, self.stats);
        let t_start = Instant::now();
        let src = self.source.ok_or(ForwardError::NoExpertSource)?;
        let c = &self.model.cfg;
        let n = xn.len() / c.hidden;
        self.stats.record_routes(layer, &routes.experts, c.experts);
        let union = routes.union();
        if let Some(pred) = self.predicted.take() {
            // Score the prediction and drop queued prefetches the real route does not need.
            let hit = pred.iter().filter(|e| union.binary_search(e).is_ok()).count();
            self.stats.record_prediction(layer, pred.len(), union.len(), hit);
            src.cancel_prefetch(layer, &union);
        }
        let ahead = self.look_ahead(layer, xn, n)?;
        let t_routed = Instant::now();
        self.stats.phases.router_s += (t_routed - t_start).as_secs_f64();
        let mut pass = self.run_experts(src, layer, routes, zd, &union, &ahead)?;
        self.count_pass(layer, union, &mut pass, t_routed);
        self.predicted = ahead.predicted.map(|(_, p)| p);
        // Everything since the routed input was counted above.
        self.clock.restart(Phase::Experts);
        self.moe_done += 1;
        let layers = c.moe_layers();
        if let Some(w) = self.watch.as_mut()
            && !w(self.moe_done, layers, self.stats)
        {
            return Err(ForwardError::Cancelled);
        }
        Ok(pass.routed)
    }
}

/// The next MoE layer as this one's input predicts it: its layer and expert union (to prefetch,
/// and to score against its real route), and the experts a batch reads ahead with this layer's
/// fetch, most-named first.
struct Lookahead {
    /// Rows of this layer's pass.
    rows: usize,
    predicted: Option<(usize, Vec<u32>)>,
    read_ahead: Option<(usize, Vec<u32>)>,
}

/// What one MoE layer pass ran and how long it took.
struct Pass {
    /// The routed experts' weighted sum, [n, hidden].
    routed: Vec<f32>,
    /// Rows routed to each expert of the union (empty for one row).
    rows_of: Vec<u32>,
    /// Experts the device held (run from its memory, not fetched).
    held: usize,
    expert_rows: usize,
    /// Bytes of one expert.
    expert_len: usize,
    /// From the fetch's start to the last expert run; of that, the experts' kernels (the weighted
    /// sum included) and the weighted sum alone.
    t_fetch: Instant,
    fetch_s: f64,
    kernel_s: f64,
    sum_s: f64,
    uploaded: crate::backend::DeviceTraffic,
}

impl StoreSchedule<'_> {
    /// The next MoE layer's route on this layer's input `xn` of `n` rows (when prefetching, or for
    /// a batch of two rows or more), and what a batch reads ahead of it: a large one the experts
    /// named for several rows, a decode step of a few rows the first few.
    fn look_ahead(&self, layer: usize, xn: &[f32], n: usize) -> Result<Lookahead, ForwardError> {
        let (model, c) = (self.model, &self.model.cfg);
        let next = if self.opts.prefetch || self.rows >= 2 { model.next_moe(layer) } else { None };
        let next_routes = match next {
            Some((nl, nw)) => Some((nl, moe::route(&*model.be, c, nw, xn)?)),
            None => None,
        };
        let predicted = next_routes.as_ref().map(|(nl, r)| (*nl, r.union()));
        let read_ahead = match (&next_routes, &predicted) {
            (Some((_, r)), Some((nl, pred))) if n >= 2 => {
                let mut count = vec![0usize; c.experts];
                for &e in &r.experts {
                    count[e as usize] += 1;
                }
                let mut sure = self.not_held(*nl, pred);
                if n >= READ_AHEAD_ROWS {
                    sure.retain(|&e| count[e as usize] >= READ_AHEAD_MIN_ROWS);
                }
                // Ties keep the union's order (stable sort): the same list every run.
                sure.sort_by_key(|&e| std::cmp::Reverse(count[e as usize]));
                if n < READ_AHEAD_ROWS {
                    sure.truncate(read_ahead_depth(self.opts.queue_depth, n));
                }
                Some((*nl, sure))
            }
            _ => None,
        };
        Ok(Lookahead { rows: n, predicted, read_ahead })
    }

    /// Runs the layer's routed experts: those the device holds from its memory, the rest of
    /// `union` each on its rows as it lands from `src`'s fetch (the next layer's reads ahead riding
    /// on it, or its prediction prefetched into idle capacity once every demanded read is queued).
    fn run_experts(
        &self,
        src: &dyn ExpertSource,
        layer: usize,
        routes: &Routes,
        zd: &[f32],
        union: &[u32],
        ahead: &Lookahead,
    ) -> Result<Pass, ForwardError> {
        let (model, c) = (self.model, &self.model.cfg);
        let layout = src.layout().clone();
        let mut work = RoutedExperts::new(&*model.be, c, layer, &layout, routes, zd);
        let n = ahead.rows;
        // The rows of each expert, for the traces when they are kept (nothing made otherwise).
        let rows_of: Vec<u32> = match n > 1 && self.stats.keeps_traces() {
            true => work.rows_of().iter().map(|&r| r as u32).collect(),
            false => Vec::new(),
        };
        if n > 1 {
            src.note_routes(layer, work.union(), &work.rows_of(), n);
        }
        let mut kernel_s = 0f64;
        // Experts the backend keeps in device memory run from there and are not fetched.
        let held = work.claim_held();
        let t = Instant::now();
        for (u, _) in held.iter().enumerate().filter(|(_, h)| **h) {
            work.add_held(u)?;
        }
        kernel_s += t.elapsed().as_secs_f64();
        let held_n = held.iter().filter(|h| **h).count();
        let wanted: Vec<u32> = union.iter().zip(&held).filter(|(_, h)| !**h).map(|(&e, _)| e).collect();
        let mut prefetch_pending = (ahead.predicted.as_ref())
            .filter(|_| ahead.read_ahead.is_none())
            .map(|(nl, pred)| (*nl, self.not_held(*nl, pred)));
        if wanted.is_empty()
            && let Some((nl, pred)) = prefetch_pending.take()
        {
            src.prefetch(nl, &pred);
        }
        let t_fetch = Instant::now();
        let traffic = self.device.device_traffic();
        let then = ahead.read_ahead.as_ref().map(|(nl, sure)| (*nl, sure.as_slice()));
        // A backend failure stops the fetch (reads in flight complete and are released) and is
        // the layer's error.
        let mut failed = None;
        src.fetch_then(layer, &wanted, then, &mut |e: u32, bytes: Landed<'_>| {
            // Every demanded read of this layer is queued by now; predictions fill idle capacity.
            if let Some((nl, pred)) = prefetch_pending.take() {
                src.prefetch(nl, &pred);
            }
            let t = Instant::now();
            let ran = work.add(e, bytes.bytes());
            drop(bytes);
            kernel_s += t.elapsed().as_secs_f64();
            match ran {
                Ok(_) => Ok(Flow::Continue),
                Err(e) => {
                    failed = Some(e);
                    Ok(Flow::Stop)
                }
            }
        })?;
        if let Some(e) = failed {
            return Err(e.into());
        }
        let expert_rows = work.rows_run();
        let t = Instant::now();
        let routed = work.finish(&routes.weights)?;
        // The weighted sum is the combine's work (it never waits for a read): expert phase, not
        // expert kernels.
        let sum_s = t.elapsed().as_secs_f64();
        kernel_s += sum_s;
        let fetch_s = t_fetch.elapsed().as_secs_f64();
        let uploaded = self.device.device_traffic().since(traffic);
        Ok(Pass {
            routed,
            rows_of,
            held: held_n,
            expert_rows,
            expert_len: layout.len,
            t_fetch,
            fetch_s,
            kernel_s,
            sum_s,
            uploaded,
        })
    }

    /// Counts one layer pass: its expert union, rows, bytes and device hits, its read wait, the
    /// traces when they are kept, and its expert time (setting up the experts counts as expert
    /// work, as the experts themselves do).
    fn count_pass(&mut self, layer: usize, union: Vec<u32>, p: &mut Pass, t_routed: Instant) {
        let reads = &mut self.stats.reads;
        reads.layer_passes += 1;
        reads.device_expert_hits += p.held as u64;
        reads.device_expert_staged_bytes += p.uploaded.expert_staged_bytes;
        reads.device_expert_in_place_bytes += p.uploaded.expert_in_place_bytes;
        reads.experts_fetched += union.len() as u64;
        reads.expert_rows += p.expert_rows as u64;
        reads.expert_bytes_requested += ((union.len() - p.held) * p.expert_len) as u64;
        reads.expert_bytes = p.expert_len as u64;
        reads.distinct_experts.extend(union.iter().map(|&e| (layer as u32, e)));
        let phases = &mut self.stats.phases;
        phases.read_wait_s += (p.fetch_s - p.kernel_s).max(0.0);
        *phases.layer_read_wait_s.entry(layer as u32).or_insert(0.0) += (p.fetch_s - p.kernel_s).max(0.0);
        // Setting up the experts counts as expert work, as the experts themselves do.
        phases.expert_kernel_s += p.kernel_s + (p.t_fetch - t_routed).as_secs_f64();
        phases.moe_experts_s += p.kernel_s - p.sum_s;
        self.stats.trace_fetch(layer, union, p.fetch_s, std::mem::take(&mut p.rows_of));
    }
}
