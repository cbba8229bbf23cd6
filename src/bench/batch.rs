//! `bench run --batch N`: N prompts prefilled in shared expert-major passes and decoded in
//! lockstep, timed, bounded, and checked against each prompt run alone.
//!
//! Contract: [`run`] opens one engine (its shared passes cut to fewer rows while the N
//! sequences' states do not fit the memory budget beside their activations; the record's
//! `engine_config.prefill_rows` is what ran), prefills the N prompts together
//! (`Engine::prefill_sessions`), decodes them greedily together for `decode` tokens each
//! (`Engine::generate_sessions`), then runs each prompt alone on a fresh session of the same
//! engine and compares (`ids_identical`: every sequence's prefill logits bit for bit and its
//! tokens). The disk ceiling is measured by the caller's `measure` before prefill, between the
//! phases (right before decode) and right after decode. Prefill's bound uses the mean of the two
//! probes around it; decode's the conservative ceiling (below), since a shared or bursting disk's
//! probes move by 2x within a run and the mean of two slow ones can sit below what decode itself
//! read at.
//! - prefill: `bound_s` = max(union bytes / ceiling, compute), where union bytes are the distinct
//!   experts the shared passes touched and compute is the work of every prompt at the rate the
//!   kernels run on this machine, measured in the same run apart from any read: each (pass,
//!   expert) of the shared passes at its row count, timed by `Engine::expert_seconds` on a
//!   resident expert (powers of two up to a pass's rows, interpolated between them; the mean
//!   of [`RATE_REPS`] timings each, half taken right before the prefill and half right after,
//!   `expert_kernel_bound_s`, their drift `expert_rate_after_over_before`; at the fastest timing of each,
//!   `expert_kernel_bound_fastest_s` and `ratio_at_fastest_rate`), plus the trunk (attention, dense layers, routers, the routed input
//!   and combine, the output head: phases that never wait for a read, timed as they ran;
//!   `trunk_s`). Not the wall minus the read waits, which is the bound by construction;
//! - decode: `bound_s` = the union-read bound summed over steps: each step's per-layer union of
//!   the active sequences' experts (the recorded routes) x expert bytes / ceiling, where the
//!   ceiling is the fastest of the run's three probes or the rate decode's own reads reached
//!   (bytes read / decode wall), whichever is higher ([`decode_ceiling`]): a ceiling no probe or
//!   read of the run exceeded. `bound_s_mean_ceiling` is the bound at the mean of the two probes
//!   around decode (the definition before 2026-12-03's session 5, looser), for comparison.
//!
//! Ratios: `prefill.ratio` = wall / bound (goal <= 1.1), `decode.bound_over_wall` = bound / wall
//! (goal >= 0.9). Timings of the alone runs come after the batch on a warm engine, so they are
//! context, not a bound.

use crate::backend::OpTime;
use crate::engine::{BatchSeq, Engine, EngineConfig, EngineError, ForwardError, GenerateOptions, Generation, Session};
use crate::sample::Sampler;
use crate::stats::Stats;
use crate::store::SourceReport;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum BatchBenchError {
    #[error(transparent)]
    Bench(#[from] super::BenchError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("batched run failed: {0}")]
    Forward(#[from] ForwardError),
    #[error(transparent)]
    Memory(#[from] crate::memory::SequencesError),
    #[error("measuring the disk ceiling: {0}")]
    Ceiling(String),
    #[error("no prompts")]
    NoPrompts,
}

/// `bench run --batch N`: N prompts of `prompt_tokens` from different places of the fixed text,
/// the disk ceiling probed on the run's own expert holders (page cache dropped first, where
/// permitted; `assume_purged`: the caller purged it just before); the record gets
/// `page_cache_dropped`, and `cold` as [`super::cold`] judges it.
pub fn runs(
    files: &crate::model::ModelFiles,
    config: EngineConfig,
    prompt_tokens: usize,
    n: usize,
    decode: usize,
    ceiling_seconds: f64,
    assume_purged: bool,
) -> Result<Value, BatchBenchError> {
    use super::ceiling::CeilingProbe;
    use crate::store::placement::{Manifest, manifest_path};
    let all = super::prompt::tokens(files, prompt_tokens * n)?;
    let prompts: Vec<Vec<u32>> = all.chunks(prompt_tokens.max(1)).map(<[u32]>::to_vec).collect();
    let mp = manifest_path(config.placement.as_deref(), &config.model);
    let manifest = mp.as_ref().map(|p| Manifest::load(p)).transpose().map_err(super::BenchError::from)?;
    let qd = manifest.as_ref().map_or(config.qd, |m| m.drives.iter().map(|d| d.qd).sum());
    let emptied = super::cold::empty_page_cache(assume_purged);
    let probe = CeilingProbe::new(files, manifest.as_ref(), config.use_drives.as_deref(), qd, ceiling_seconds)?;
    let mut measure = || probe.measure().map(|c| c.map(|c| c.gbps)).map_err(|e| e.to_string());
    let mut rec = run(config, &prompts, decode, &mut measure, emptied)?;
    rec["page_cache_dropped"] = json!(emptied == super::cold::Emptied::Dropped);
    Ok(rec)
}

/// A disk-ceiling probe: GB/s, or None when probes are off.
pub type Measure<'a> = &'a mut dyn FnMut() -> Result<Option<f64>, String>;

/// Whether any probe ran (with probes off, decode's own rate is no ceiling either: no bound).
fn probes_on(a: Option<f64>, b: Option<f64>, c: Option<f64>) -> bool {
    a.is_some() || b.is_some() || c.is_some()
}

fn mean(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some((a + b) / 2.0),
        (x, None) | (None, x) => x,
    }
}

/// The ceiling decode's bound divides by (GB/s): the fastest of `probes` or `own_gbps` (the rate
/// decode's own reads reached over its wall), whichever is higher; None when nothing was measured.
pub fn decode_ceiling(probes: &[Option<f64>], own_gbps: Option<f64>) -> Option<f64> {
    probes.iter().flatten().chain(own_gbps.iter()).copied().filter(|g| g.is_finite() && *g > 0.0).reduce(f64::max)
}

/// Distinct experts per MoE layer pass of `trace` (one entry per pass, in order).
fn union_sizes(trace: &[(u32, Vec<u32>)]) -> Vec<usize> {
    trace.iter().map(|(_, u)| u.len()).collect()
}

/// Runs the batch and returns its record (see the module contract); `emptied`: what emptied the
/// page cache before it, for its `cold` label. In phases: the engine and its traced sessions,
/// [`prefill_batch`] and [`decode_batch`] (each between disk-ceiling probes), each prompt alone
/// ([`alone_runs`]), then the record and its bounds ([`Batch::record`]).
pub fn run(
    config: EngineConfig,
    prompts: &[Vec<u32>],
    decode: usize,
    measure: Measure,
    emptied: super::cold::Emptied,
) -> Result<Value, BatchBenchError> {
    if prompts.is_empty() {
        return Err(BatchBenchError::NoPrompts);
    }
    let n = prompts.len();
    let max_new = decode.max(1);
    let lens: Vec<usize> = prompts.iter().map(|p| p.len() + max_new).collect();
    let engine = open_fitting(config, &lens)?;
    // Sessions that keep the per-layer traces (and so do the shared calls' totals): the unions per
    // layer and the rows of each expert the record reports.
    let traced = || {
        let mut s = engine.new_session();
        s.keep_traces(true);
        s
    };
    let mut sessions: Vec<Session> = (0..n).map(|_| traced()).collect();
    let pre = prefill_batch(&engine, &mut sessions, prompts, measure)?;
    let opts = GenerateOptions { max_new, stop: Vec::new() };
    let dec = decode_batch(&engine, &mut sessions, &opts, measure)?;
    // Each prompt alone: the batch must give each the same logits and tokens.
    let alone = alone_runs(&engine, prompts, &opts)?;
    let ids_identical = alone.iter().enumerate().all(|(i, (logits, toks, _, _))| {
        let same_logits = logits.len() == pre.first_logits[i].len()
            && logits.iter().zip(&pre.first_logits[i]).all(|(a, b)| a.to_bits() == b.to_bits());
        same_logits && *toks == dec.gens[i].tokens
    });
    Ok(Batch { engine: &engine, prompts, emptied, pre, dec, alone, ids_identical }.record())
}

/// A disk-ceiling probe's GB/s (None when probes are off), its failure a [`BatchBenchError`].
fn probe(measure: Measure) -> Result<Option<f64>, BatchBenchError> {
    measure().map_err(BatchBenchError::Ceiling)
}

/// What the batch's prefill saw, from the probe before it to the probe after it.
struct Prefilled {
    /// The ceiling probed before the prefill (GB/s).
    c0: Option<f64>,
    /// The source's expert bytes read before the prefill.
    read0: u64,
    /// The row counts the kernels are timed at, and their timings before and after the prefill.
    grid: Vec<usize>,
    rate_before: Option<Vec<Vec<f64>>>,
    rate_after: Option<Vec<Vec<f64>>>,
    rss_before: Option<u64>,
    /// The shared calls' counters.
    stats: Stats,
    wall: f64,
    peak_rss: Option<u64>,
    /// A device backend's operations during the prefill (empty on the CPU).
    ops: Vec<OpTime>,
    /// The source's report after the prefill, and its expert bytes read.
    rep: SourceReport,
    read1: u64,
    /// Each session's logits after the prefill.
    first_logits: Vec<Vec<f32>>,
    /// The ceiling probed after the prefill (GB/s).
    c1: Option<f64>,
}

/// Phase 1: the ceiling probed, the kernels timed, the prompts prefilled together (timed, with the
/// peak resident set), the kernels timed again, the counters taken, the ceiling probed again.
fn prefill_batch(
    engine: &Arc<Engine>,
    sessions: &mut [Session],
    prompts: &[Vec<u32>],
    measure: Measure,
) -> Result<Prefilled, BatchBenchError> {
    let lists: Vec<&[u32]> = prompts.iter().map(|p| &p[..]).collect();
    let c0 = probe(measure)?;
    let read0 = engine.source_report().expert_bytes_read.unwrap_or(0);
    // The kernels' rate is timed on both sides of the prefill (half the rounds each): a shared
    // VM's speed drifts by ~17% over minutes, and one moment's timing follows the drift.
    let grid = rate_grid(engine.config().prefill_rows.min(prompts.iter().map(Vec::len).sum()));
    let rate_before = engine.expert_seconds(&grid, RATE_REPS / 2).map_err(ForwardError::from)?;
    let rss_before = reset_peak_rss();
    let t0 = Instant::now();
    let stats = {
        let mut refs: Vec<&mut Session> = sessions.iter_mut().collect();
        engine.prefill_sessions(&mut refs, &lists)?
    };
    let wall = t0.elapsed().as_secs_f64();
    let peak_rss = proc_status_bytes("VmHWM:");
    let rate_after = engine.expert_seconds(&grid, RATE_REPS - RATE_REPS / 2).map_err(ForwardError::from)?;
    let ops = engine.op_times();
    let rep = engine.source_report();
    let read1 = rep.expert_bytes_read.unwrap_or(0);
    let first_logits: Vec<Vec<f32>> =
        sessions.iter().map(|s| s.logits().map(<[f32]>::to_vec).unwrap_or_default()).collect();
    let c1 = probe(measure)?;
    Ok(Prefilled {
        c0,
        read0,
        grid,
        rate_before,
        rate_after,
        rss_before,
        stats,
        wall,
        peak_rss,
        ops,
        rep,
        read1,
        first_logits,
        c1,
    })
}

/// What the batch's decode saw, to the probe after it.
struct Decoded {
    gens: Vec<Generation>,
    /// The shared calls' counters.
    stats: Stats,
    wall: f64,
    /// The source's report after the decode, and its expert bytes read.
    rep: SourceReport,
    read2: u64,
    /// The ceiling probed after the decode (GB/s).
    c2: Option<f64>,
}

/// Phase 2: the sequences decoded together (greedy, each to `opts.max_new` tokens) and timed, the
/// counters taken, the ceiling probed after them.
fn decode_batch(
    engine: &Arc<Engine>,
    sessions: &mut [Session],
    opts: &GenerateOptions,
    measure: Measure,
) -> Result<Decoded, BatchBenchError> {
    let n = sessions.len();
    let mut samplers: Vec<Sampler> = (0..n).map(|_| Sampler::greedy()).collect();
    let t1 = Instant::now();
    let (gens, stats) = {
        // Every sequence takes every token (it stops at `max_new`).
        let mut each: Vec<fn(u32) -> bool> = vec![|_| true; n];
        let mut seqs: Vec<BatchSeq> = sessions
            .iter_mut()
            .zip(samplers.iter_mut())
            .zip(each.iter_mut())
            .map(|((session, sampler), on_token)| BatchSeq { session, opts: opts.clone(), sampler, on_token })
            .collect();
        engine.generate_sessions(&mut seqs)?
    };
    let wall = t1.elapsed().as_secs_f64();
    let rep = engine.source_report();
    let read2 = rep.expert_bytes_read.unwrap_or(0);
    let c2 = probe(measure)?;
    Ok(Decoded { gens, stats, wall, rep, read2, c2 })
}

/// A measured batch, for its record.
struct Batch<'a> {
    engine: &'a Arc<Engine>,
    prompts: &'a [Vec<u32>],
    emptied: super::cold::Emptied,
    pre: Prefilled,
    dec: Decoded,
    /// Each prompt alone ([`alone_runs`]).
    alone: Vec<Alone>,
    ids_identical: bool,
}

/// The seconds of the trunk's phases in `s`: attention, dense MLP, router, the rest, and the
/// expert phases less the expert kernels themselves.
fn trunk(s: &Stats) -> f64 {
    s.phases.attention_s
        + s.phases.dense_mlp_s
        + s.phases.router_s
        + s.phases.other_s
        + (s.phases.expert_kernel_s - s.phases.moe_experts_s).max(0.0)
}

/// Mean distinct experts per layer pass of `u` (0 without passes).
fn per_layer_mean(u: &[usize]) -> f64 {
    if u.is_empty() { 0.0 } else { u.iter().sum::<usize>() as f64 / u.len() as f64 }
}

impl Batch<'_> {
    /// Phase 3: the batch's record, its prefill's and decode's bounds computed by
    /// [`Batch::prefill_json`] and [`Batch::decode_json`].
    fn record(&self) -> Value {
        let (engine, prompts, emptied, rep2) = (self.engine, self.prompts, self.emptied, &self.dec.rep);
        let cold = super::cold::is_cold(emptied, &rep2.drives);
        crate::stats::bench_record(
            "run",
            json!({
                "model": engine.dir().display().to_string(),
                "engine_config": engine.config(),
                "backend_used": engine.backend_used(),
                "expert_bytes_total": engine.expert_bytes_total(),
                "memory_budget": engine.plan().budget,
                "expert_cache_bytes": engine.plan().expert_cache,
                "page_cache": emptied,
                "cold": cold,
                "cold_note": super::cold::warm_note(cold, emptied, &rep2.drives),
                "batch": prompts.len(),
                "prompt_tokens": prompts.iter().map(Vec::len).collect::<Vec<_>>(),
                "ids_identical": self.ids_identical,
                "ceilings_gbps": {"before_prefill": self.pre.c0, "after_prefill": self.pre.c1, "after_decode": self.dec.c2},
                "prefill": self.prefill_json(),
                "decode": self.decode_json(),
                "output_ids": self.dec.gens.iter().map(|g| &g.tokens).collect::<Vec<_>>(),
            }),
        )
    }

    /// Expert bytes (the larger of the prefill's and decode's record of it).
    fn expert_bytes(&self) -> u64 {
        self.pre.stats.reads.expert_bytes.max(self.dec.stats.reads.expert_bytes)
    }

    /// The record's `prefill`: wall, bounds, kernel rates, memory, phases and reads.
    fn prefill_json(&self) -> Value {
        let (p, pre, prefill_wall) = (&self.pre, &self.pre.stats, self.pre.wall);
        let prefill_ceiling = mean(p.c0, p.c1);
        let union_bytes = pre.expert_bytes_unique();
        let rate = kernel_rate(&p.grid, p.rate_before.clone(), p.rate_after.clone(), &pre.traces().rows);
        // Phases of the trunk (none waits for a read); the expert phases less the kernels themselves
        // are the routed input, the setup of each layer's experts and the combine.
        let trunk_s = trunk(pre);
        let compute = rate.as_ref().map_or((prefill_wall - pre.phases.read_wait_s).max(0.0), |r| r.bound_s + trunk_s);
        let prefill_read_s = prefill_ceiling.map(|c| union_bytes as f64 / (c * 1e9));
        let prefill_bound = prefill_read_s.map(|r| r.max(compute));
        // The same bound with every expert at its row count's fastest timing: a stricter reading.
        let bound_fastest = rate.as_ref().zip(prefill_read_s).map(|(r, read)| read.max(r.bound_fastest_s + trunk_s));
        json!({
            "wall_s": prefill_wall,
            "bound_s": prefill_bound,
            "ratio": prefill_bound.map(|b| prefill_wall / b),
            "read_bound_s": prefill_read_s,
            "compute_s": compute,
            "expert_kernel_bound_s": rate.as_ref().map(|r| r.bound_s),
            "trunk_s": trunk_s,
            "expert_rate_points": rate.as_ref().map(|r| &r.points),
            "expert_kernel_bound_fastest_s": rate.as_ref().map(|r| r.bound_fastest_s),
            "expert_rate_points_fastest": rate.as_ref().map(|r| &r.fastest),
            "expert_rate_after_over_before": rate.as_ref().map(|r| r.after_over_before),
            "ratio_at_fastest_rate": bound_fastest.map(|b| prefill_wall / b),
            "expert_rows": pre.reads.expert_rows,
            "peak_rss_bytes": p.peak_rss,
            "rss_before_bytes": p.rss_before,
            "ops": (!p.ops.is_empty()).then_some(&p.ops),
            "read_wait_s": pre.phases.read_wait_s,
            "expert_kernel_s": pre.phases.expert_kernel_s,
            "attention_s": pre.phases.attention_s,
            "phases": {
                "attention_s": pre.phases.attention_s,
                "dense_mlp_s": pre.phases.dense_mlp_s,
                "router_s": pre.phases.router_s,
                "experts_s": pre.phases.moe_experts_s,
                "expert_phase_s": pre.phases.expert_kernel_s,
                "combine_s": pre.phases.moe_combine_s,
                "other_s": pre.phases.other_s,
            },
            "layer_passes": pre.reads.layer_passes,
            "union_expert_bytes": union_bytes,
            "expert_bytes_read": p.read1.saturating_sub(p.read0),
            "expert_bytes": self.expert_bytes(),
            "distinct_experts_per_layer": per_layer_mean(&union_sizes(&pre.traces().fetches)),
            "tok_s": self.prompts.iter().map(Vec::len).sum::<usize>() as f64 / prefill_wall,
            "alone_wall_s": self.alone.iter().map(|a| a.2).collect::<Vec<_>>(),
        })
    }

    /// The record's `decode`: wall, bounds and their ceiling, reads ahead, unions and rates.
    fn decode_json(&self) -> Value {
        let (pre, dec, decode_wall) = (&self.pre.stats, &self.dec.stats, self.dec.wall);
        let (rep1, rep2, read1, read2) = (&self.pre.rep, &self.dec.rep, self.pre.read1, self.dec.read2);
        let (c0, c1, c2) = (self.pre.c0, self.pre.c1, self.dec.c2);
        let decode_mean_ceiling = mean(c1, c2);
        let decode_read_gbps = (probes_on(c0, c1, c2) && decode_wall > 0.0)
            .then(|| read2.saturating_sub(read1) as f64 / decode_wall / 1e9)
            .filter(|g| *g > 0.0);
        let decode_ceiling = decode_ceiling(&[c0, c1, c2], decode_read_gbps);
        let dec_unions = union_sizes(&dec.traces().fetches);
        let dec_union_bytes = dec_unions.iter().sum::<usize>() as u64 * self.expert_bytes();
        let decode_bound = decode_ceiling.map(|c| dec_union_bytes as f64 / (c * 1e9));
        let decode_bound_mean = decode_mean_ceiling.map(|c| dec_union_bytes as f64 / (c * 1e9));
        let steps = dec.forward_calls;
        let moe_layers =
            pre.reads.layer_passes.checked_div(prefill_passes(self.engine, self.prompts)).unwrap_or(0).max(1);
        let generated: usize = self.dec.gens.iter().map(|g| g.tokens.len()).sum();
        json!({
            "wall_s": decode_wall,
            "bound_s": decode_bound,
            "bound_over_wall": decode_bound.map(|b| b / decode_wall),
            "ceiling_gbps": decode_ceiling,
            "ceiling_is": match (decode_ceiling, decode_read_gbps) {
                (None, _) => None,
                (Some(c), Some(r)) if c == r => Some("decode's own read rate (above every probe)"),
                _ => Some("the run's fastest probe"),
            },
            "read_gbps": decode_read_gbps,
            "bound_s_mean_ceiling": decode_bound_mean,
            "bound_over_wall_mean_ceiling": decode_bound_mean.map(|b| b / decode_wall),
            "expert_kernel_s": dec.phases.moe_experts_s,
            "trunk_s": trunk(dec),
            "reads_ahead": rep2.prefetch_issued.saturating_sub(rep1.prefetch_issued),
            "reads_ahead_used": rep2.prefetch_used.saturating_sub(rep1.prefetch_used),
            "prediction_recall": dec.prediction_quality().map(|q| q.0),
            "prediction_precision": dec.prediction_quality().map(|q| q.1),
            "steps": steps,
            "generated_tokens": generated,
            "union_expert_bytes": dec_union_bytes,
            "expert_bytes_read": read2.saturating_sub(read1),
            "distinct_experts_per_layer": per_layer_mean(&dec_unions),
            "distinct_experts_per_layer_alone": per_layer_mean(&self.alone.iter().flat_map(|a| union_sizes(&a.3)).collect::<Vec<_>>()),
            "moe_layers": moe_layers,
            "read_wait_s": dec.phases.read_wait_s,
            "tok_s": generated as f64 / decode_wall,
            "s_per_step": if steps > 0 { Some(decode_wall / steps as f64) } else { None },
        })
    }
}

/// The expert kernels' measured time for a run's passes: `points` (rows, mean seconds of one
/// expert) and `bound_s`, every (pass, expert) at its rows; `fastest` and `bound_fastest_s` the
/// same at each count's fastest timing; `after_over_before` the bound at the timings taken after
/// the prefill over the bound at those taken before (the machine's drift across the run).
struct KernelRate {
    points: Vec<(usize, f64)>,
    bound_s: f64,
    fastest: Vec<(usize, f64)>,
    bound_fastest_s: f64,
    after_over_before: f64,
}

/// Timings of each row count (in rounds over the counts; see `Engine::expert_seconds`), half
/// before the prefill and half after. The bound takes their mean: the run's thousands of
/// streamed experts are a sum over the same machine's ups and downs, and on a shared VM one
/// count's fastest of a few timings swung the bound by 15% from run to run (2026-12-03: 28.1 vs
/// 33.1 ms at 256 rows, same binary) while the streamed experts' median matched the resident
/// median within 4%; a mean of 12 taken at one moment still moved 17% between two runs
/// (2026-12-04: 86.6 vs 101.8 s for the same streamed 101 s), hence both sides of the run.
const RATE_REPS: usize = 12;

/// The row counts an expert is timed at for passes of at most `rows` rows: powers of two up to
/// it, and it (an expert of a pass serves at most every row of the pass).
fn rate_grid(rows: usize) -> Vec<usize> {
    let rows = rows.max(1);
    let mut grid: Vec<usize> = std::iter::successors(Some(1usize), |m| Some(m * 2)).take_while(|&m| m < rows).collect();
    grid.push(rows);
    grid
}

/// The bound of every (pass, expert) of `fetch_rows` (the rows of each expert of each pass) at
/// the timings of `grid` taken before and after the run, interpolated linearly between the two
/// nearest counts. None without routed experts or timings.
fn kernel_rate(
    grid: &[usize],
    before: Option<Vec<Vec<f64>>>,
    after: Option<Vec<Vec<f64>>>,
    fetch_rows: &[Vec<u32>],
) -> Option<KernelRate> {
    let all: Vec<usize> = fetch_rows.iter().flatten().map(|&m| m as usize).filter(|&m| m > 0).collect();
    let (before, after) = (before?, after?);
    if all.is_empty() {
        return None;
    }
    let mean_of = |t: &[f64]| t.iter().sum::<f64>() / t.len().max(1) as f64;
    let least = |t: &[f64]| t.iter().copied().fold(f64::INFINITY, f64::min);
    let at = |times: &[Vec<f64>], f: &dyn Fn(&[f64]) -> f64| -> Vec<(usize, f64)> {
        grid.iter().copied().zip(times.iter().map(|t| f(t))).collect()
    };
    let bound = |points: &[(usize, f64)]| all.iter().map(|&m| interpolate(points, m)).sum::<f64>();
    let both: Vec<Vec<f64>> = before.iter().zip(&after).map(|(b, a)| b.iter().chain(a).copied().collect()).collect();
    let points = at(&both, &mean_of);
    let fastest = at(&both, &least);
    let (b, a) = (bound(&at(&before, &mean_of)), bound(&at(&after, &mean_of)));
    Some(KernelRate {
        bound_s: bound(&points),
        bound_fastest_s: bound(&fastest),
        points,
        fastest,
        after_over_before: if b > 0.0 { a / b } else { 1.0 },
    })
}

/// Seconds at `m` rows, linear between the two nearest of `points` (ascending rows).
fn interpolate(points: &[(usize, f64)], m: usize) -> f64 {
    let i = points.partition_point(|&(g, _)| g < m);
    match (i.checked_sub(1).map(|j| points[j]), points.get(i)) {
        (_, Some(&(g, t))) if g == m => t,
        (Some((g0, t0)), Some(&(g1, t1))) => t0 + (t1 - t0) * (m - g0) as f64 / (g1 - g0) as f64,
        // Below the smallest count (1 when any pass has one row): scaled down from it.
        (None, Some(&(g1, t1))) => t1 * m as f64 / g1 as f64,
        (Some((_, t)), None) => t,
        (None, None) => 0.0,
    }
}

/// A `/proc/self/status` line's value in bytes (`VmHWM:`, `VmRSS:`); None where there is none.
fn proc_status_bytes(key: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line[key.len()..].trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kb * 1024)
}

/// Resets the process's peak resident set to its current one (Linux: `5` to
/// `/proc/self/clear_refs`), so that `VmHWM` after the prefill is the prefill's peak; returns
/// the resident set now.
fn reset_peak_rss() -> Option<u64> {
    // Where the kernel refuses, VmHWM stays the process's peak so far: still an upper bound.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    proc_status_bytes("VmRSS:")
}

/// Fewest rows a shared prefill pass is cut down to so that the sequences' states fit.
const MIN_PASS_ROWS: usize = 256;

/// The engine of `config`, with its shared prefill passes cut to half their rows (and the
/// activations the memory plan reserves with them) while the states of sequences of `lens`
/// tokens do not fit beside them, down to [`MIN_PASS_ROWS`]; then the plan's error, which names
/// the budget.
fn open_fitting(mut config: EngineConfig, lens: &[usize]) -> Result<Arc<Engine>, BatchBenchError> {
    loop {
        let engine = Engine::open(config.clone())?;
        match engine.sequences_fit(lens) {
            Ok(()) => return Ok(engine),
            Err(e) if config.prefill_rows / 2 < MIN_PASS_ROWS => return Err(e.into()),
            Err(_) => {
                drop(engine);
                config.prefill_rows /= 2;
                config.batch_rows = config.batch_rows.map(|r| r.min(config.prefill_rows));
            }
        }
    }
}

/// The number of shared prefill passes `prompts` take on `engine`.
fn prefill_passes(engine: &Arc<Engine>, prompts: &[Vec<u32>]) -> u64 {
    let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    crate::engine::prefill_passes(&lens, engine.config().prefill_rows).len() as u64
}

/// One prompt alone: its prefill logits, its greedy tokens, its prefill wall and its decode fetch
/// trace.
type Alone = (Vec<f32>, Vec<u32>, f64, Vec<(u32, Vec<u32>)>);

/// Each prompt alone on a fresh session: its prefill logits, its greedy tokens, its prefill wall
/// and its decode fetch trace.
fn alone_runs(engine: &Arc<Engine>, prompts: &[Vec<u32>], opts: &GenerateOptions) -> Result<Vec<Alone>, ForwardError> {
    let mut out = Vec::with_capacity(prompts.len());
    for p in prompts {
        let mut s = engine.new_session();
        s.keep_traces(true);
        let t = Instant::now();
        let logits = s.prefill(p)?.to_vec();
        let wall = t.elapsed().as_secs_f64();
        let before = s.stats.traces().fetches.len();
        let g = s.generate(opts, &mut |_| true)?;
        let trace: Vec<(u32, Vec<u32>)> = s.stats.traces().fetches.get(before..).unwrap_or_default().to_vec();
        out.push((logits, g.tokens, wall, trace));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::{decode_ceiling, interpolate, rate_grid};

    #[test]
    fn the_rate_grid_spans_every_row_count_of_a_pass() {
        assert_eq!(rate_grid(0), vec![1]);
        assert_eq!(rate_grid(1), vec![1]);
        assert_eq!(rate_grid(8), vec![1, 2, 4, 8]);
        assert_eq!(rate_grid(36), vec![1, 2, 4, 8, 16, 32, 36]);
        let points: Vec<(usize, f64)> = rate_grid(36).iter().map(|&m| (m, m as f64 * 2.0)).collect();
        // Linear in the rows between the timed counts, exact at them.
        for m in 1..=36 {
            assert!((interpolate(&points, m) - m as f64 * 2.0).abs() < 1e-12, "{m}");
        }
    }

    #[test]
    fn the_decode_ceiling_is_the_fastest_probe_or_the_runs_own_rate() {
        assert_eq!(decode_ceiling(&[Some(1.0), Some(2.0), Some(1.5)], Some(1.7)), Some(2.0));
        // Decode read faster than every probe: its own rate is the ceiling.
        assert_eq!(decode_ceiling(&[Some(1.0), None, Some(0.9)], Some(1.7)), Some(1.7));
        assert_eq!(decode_ceiling(&[None, None, None], None), None);
        assert_eq!(decode_ceiling(&[Some(f64::NAN), Some(0.0)], None), None);
    }
}
