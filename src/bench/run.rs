//! `bench run`: an exact prompt, cold, then a few decode steps; one record per run with every
//! counter and timer, the disk ceiling measured in the same run and the bound ratios:
//! - TTFT / (distinct expert bytes / ceiling + measured compute), where compute = TTFT minus the
//!   time the prefill waited for reads (the serial bound), and TTFT / max(read, compute) (the bound
//!   of a schedule that overlaps reads and compute completely);
//! - decode seconds per token / (bytes read per token / ceiling).
//!
//! Contract: [`runs`] measures the prompt once per drive subset (`ladder`: drives {0}, {0,1}, ...
//! of the placement; else the config's) and prefetch setting, each on a fresh engine after the
//! page cache is dropped (where root may), and hands each record to the caller's sink as it is
//! made. The ceiling is probed ([`super::ceiling`]) before the prompt, between prompt and decode,
//! and after decode; each phase's bound uses the mean of the two probes around it. Drafting
//! changes no output token (the record shows acceptance). Each record says whether its reads were
//! cold (`cold`, `page_cache`; [`super::cold`]) and, when not, why (`cold_note`).

use super::BenchError;
use super::ceiling::{CeilingProbe, ceiling_json, mean_gbps};
use super::cold::{self, Emptied};
use crate::backend::{DeviceTraffic, OpTime};
use crate::draft::{DraftKind, OracleDrafter, Speculator};
use crate::engine::{Engine, EngineConfig, EngineError, GenerateOptions, Session};
use crate::memory::MemoryPlan;
use crate::model::ModelFiles;
use crate::stats::Stats;
use crate::store::placement::{Manifest, manifest_path};
use crate::store::probe::Ceiling;
use serde_json::{Value, json};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PrefetchRuns {
    Off,
    On,
    /// Each configuration twice: prefetch off, then on.
    Both,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchDraft {
    Off,
    /// n-gram prompt lookup (with the live cost model).
    Ngram,
    /// The DSpark drafter of --draft-model (with the live cost model).
    Dspark,
    /// K3's own greedy continuation, recorded by a plain run first (acceptance 1.0, no cost model):
    /// what batching alone gives.
    Oracle,
}

/// What `bench run` measures besides the engine's configuration.
pub struct RunOptions {
    /// Decode steps after the prompt.
    pub decode: usize,
    /// Drafting during the decode steps.
    pub draft: BenchDraft,
    /// Repeat over drive subsets of the placement: drives {0}, {0,1}, ...
    pub ladder: bool,
    pub prefetch_runs: PrefetchRuns,
    /// Seconds of reads (at least) for each of the three disk ceiling probes (0 skips them).
    pub ceiling_seconds: f64,
    /// Write the run's expert fetch trace (one [layer, [experts...]] per MoE layer pass, prefill
    /// then decode, with `rows_of`: each pass's rows per expert, empty for one row) here as JSON.
    pub fetch_trace: Option<PathBuf>,
    /// The caller purged the page cache just before (macOS: `sudo purge`), so uncached reads are
    /// cold there; see [`super::cold`].
    pub assume_purged: bool,
}

/// A record sink: prints it, keeps it; an error stops the runs.
pub type Sink<'a> = &'a mut dyn FnMut(&Value) -> std::io::Result<()>;

/// Measures `prompt` on engines of `config` (see the module contract); returns every record.
pub fn runs(
    files: &ModelFiles,
    config: &EngineConfig,
    prompt: &[u32],
    a: &RunOptions,
    sink: Sink,
) -> Result<Vec<Value>, BenchError> {
    let manifest_path = manifest_path(config.placement.as_deref(), &config.model);
    let manifest = manifest_path.as_ref().map(|p| Manifest::load(p)).transpose()?;
    let subsets: Vec<Option<Vec<usize>>> = if a.ladder {
        let m = manifest.as_ref().ok_or(BenchError::LadderNeedsPlacement)?;
        (1..=m.drives.len()).map(|k| Some((0..k).collect())).collect()
    } else {
        vec![config.use_drives.clone()]
    };
    let prefetch: Vec<bool> = match a.prefetch_runs {
        PrefetchRuns::Off => vec![false],
        PrefetchRuns::On => vec![true],
        PrefetchRuns::Both => vec![false, true],
    };
    let mut records: Vec<Value> = Vec::new();
    for subset in &subsets {
        let qd_total = manifest.as_ref().map_or(config.qd, |m| {
            m.drives
                .iter()
                .enumerate()
                .filter(|(i, _)| subset.as_ref().is_none_or(|k| k.contains(i)))
                .map(|(_, d)| d.qd)
                .sum()
        });
        let emptied = cold::empty_page_cache(a.assume_purged);
        let probe = CeilingProbe::new(files, manifest.as_ref(), subset.as_deref(), qd_total, a.ceiling_seconds)?;
        for &pf in &prefetch {
            let config = EngineConfig { use_drives: subset.clone(), prefetch: pf, ..config.clone() };
            let rec = one_run(files, a, &config, prompt, &probe, emptied)?;
            sink(&rec).map_err(BenchError::Sink)?;
            records.push(rec);
        }
    }
    Ok(records)
}

/// Opens an engine; the error names the model directory, except for settings that conflict
/// with each other (those name the settings, and the model is not at fault).
fn open_engine(config: EngineConfig) -> Result<Arc<Engine>, BenchError> {
    let dir = config.model.clone();
    Engine::open(config).map_err(|e| match e {
        e @ EngineError::Setting { .. } => BenchError::from(e),
        source => BenchError::Open { dir, source: Box::new(source) },
    })
}

/// One measured run of `prompt` on an engine of `config` (its drive subset and prefetch set), in
/// phases: `open_measured` (the oracle's truth, the page cache, the engine and its drafter),
/// `measure_prefill`, `measure_decode` (each between disk-ceiling probes), `Bounds::of`, then the
/// record (`Run::record`).
fn one_run(
    files: &ModelFiles,
    a: &RunOptions,
    config: &EngineConfig,
    prompt: &[u32],
    probe: &CeilingProbe,
    emptied: Emptied,
) -> Result<Value, BenchError> {
    let opts = GenerateOptions { max_new: a.decode.max(1), stop: Vec::new() };
    let (engine, mut spec, emptied) = open_measured(a, config, prompt, &opts, emptied)?;
    let plan = engine.plan().clone();
    let mut session = engine.new_session();
    // The per-layer traces: the decode layers' fetch times, the fetch trace and the cache's optimum.
    session.keep_traces(true);
    let pre = measure_prefill(&engine, &mut session, &mut spec, prompt, probe)?;
    let dec = measure_decode(&engine, &mut session, &mut spec, &opts, probe, &pre)?;
    let bounds = Bounds::of(&pre, &dec);
    if dec.stats.bytes_read().is_some() && pre.unique > 0 && pre.read > pre.unique {
        eprintln!(
            "deltafin bench: note: prefill read {} bytes for {} distinct ({:.4}x)",
            pre.read,
            pre.unique,
            pre.read as f64 / pre.unique as f64
        );
    }
    if let Some(p) = &a.fetch_trace {
        let body = serde_json::to_vec(
            &json!({"cache_slots": engine.source_report().cache_slots, "prefill_passes": pre.stats.traces().fetches.len(), "trace": dec.stats.traces().fetches, "rows_of": dec.stats.traces().rows}),
        )
        .map_err(|source| BenchError::Json { path: p.clone(), source })?;
        crate::util::write_atomic(p, &body).map_err(|source| BenchError::Io { path: p.clone(), source })?;
    }
    let run = Run { files, prompt, engine: &engine, spec: spec.as_ref(), plan: &plan, emptied, pre, dec, bounds };
    Ok(run.record())
}

/// Phase 1: the engine measured, opened after the page cache is dropped (where it may be), and its
/// drafter; for `BenchDraft::Oracle`, K3's own greedy continuation recorded first on an engine of
/// its own. Returns what emptied the page cache last.
fn open_measured(
    a: &RunOptions,
    config: &EngineConfig,
    prompt: &[u32],
    opts: &GenerateOptions,
    emptied: Emptied,
) -> Result<(Arc<Engine>, Option<Speculator>, Emptied), BenchError> {
    // A verify batch holds the pending token and up to 7 drafts.
    let rows = if a.draft == BenchDraft::Off { prompt.len() } else { prompt.len().max(8) };
    let config = EngineConfig { batch_rows: Some(rows.clamp(1, config.prefill_rows.max(1))), ..config.clone() };
    let prefill_failed = |source| BenchError::Forward { phase: "prefill", source };
    let decode_failed = |source| BenchError::Forward { phase: "decode", source };
    let mut oracle = match a.draft {
        BenchDraft::Oracle => {
            // Recorded on an engine of its own, so the measured run starts as cold as the others.
            let engine = open_engine(config.clone())?;
            let mut s = engine.new_session();
            s.prefill(prompt).map_err(prefill_failed)?;
            let g = s.generate(opts, &mut |_| true).map_err(decode_failed)?;
            let truth = prompt.iter().chain(&g.tokens).copied().collect();
            Some(Speculator::without_cost_model(Box::new(OracleDrafter::new(truth))))
        }
        _ => None,
    };
    let emptied = if cold::drop_page_cache() { Emptied::Dropped } else { emptied };
    let engine = open_engine(config)?;
    let spec = match a.draft {
        BenchDraft::Off => None,
        BenchDraft::Ngram => engine.speculator(DraftKind::Ngram)?,
        BenchDraft::Dspark => engine.speculator(DraftKind::Dspark)?,
        BenchDraft::Oracle => oracle.take(),
    };
    Ok((engine, spec, emptied))
}

/// Seconds since the Unix epoch (the record's `phase_unix_s`).
fn unix() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// What the prefill saw, from the probe before it to the probe after it.
struct Prefilled {
    ceiling_before: Option<Ceiling>,
    traffic_start: DeviceTraffic,
    start_unix: f64,
    ttft: f64,
    /// The session's counters after the prefill.
    stats: Stats,
    traffic: DeviceTraffic,
    ops: Vec<OpTime>,
    /// Expert bytes the source read.
    read: u64,
    /// Distinct expert bytes the prefill's passes touched.
    unique: u64,
    end_unix: f64,
    ceiling_mid: Option<Ceiling>,
}

/// Phase 2: the disk ceiling probed, the prompt prefilled (with `spec`'s drafter, if any) and
/// timed, the counters taken, the ceiling probed again.
fn measure_prefill(
    engine: &Arc<Engine>,
    session: &mut Session,
    spec: &mut Option<Speculator>,
    prompt: &[u32],
    probe: &CeilingProbe,
) -> Result<Prefilled, BenchError> {
    let ceiling_before = probe.measure()?;
    let traffic_start = engine.device_traffic();
    let start_unix = unix();
    let t0 = Instant::now();
    match spec {
        Some(sp) => session.prefill_with(prompt, sp),
        None => session.prefill(prompt),
    }
    .map_err(|source| BenchError::Forward { phase: "prefill", source })?;
    let ttft = t0.elapsed().as_secs_f64();
    session.stats.ttft_s = ttft;
    session.stats.prefill_s = ttft;
    let stats = session.stats.clone();
    let traffic = engine.device_traffic();
    let ops = engine.op_times();
    let read = engine.source_report().expert_bytes_read.unwrap_or(0);
    let unique = stats.expert_bytes_unique();
    let end_unix = unix();
    let ceiling_mid = probe.measure()?;
    Ok(Prefilled {
        ceiling_before,
        traffic_start,
        start_unix,
        ttft,
        stats,
        traffic,
        ops,
        read,
        unique,
        end_unix,
        ceiling_mid,
    })
}

/// What the decode saw, to the probe after it.
struct Decoded {
    start_unix: f64,
    out_ids: Vec<u32>,
    decode_s: f64,
    /// The device traffic and operations of the decode alone.
    traffic: DeviceTraffic,
    ops: Vec<OpTime>,
    end_unix: f64,
    ceiling_after: Option<Ceiling>,
    /// The session's counters after the decode, with its time, tokens and the source's report.
    stats: Stats,
}

/// Phase 3: the decode steps (with `spec`'s drafter, if any) timed, their counters taken, the
/// ceiling probed after them.
fn measure_decode(
    engine: &Arc<Engine>,
    session: &mut Session,
    spec: &mut Option<Speculator>,
    opts: &GenerateOptions,
    probe: &CeilingProbe,
    pre: &Prefilled,
) -> Result<Decoded, BenchError> {
    let start_unix = unix();
    let t1 = Instant::now();
    let generation = match spec {
        Some(sp) => session.generate_speculative(opts, sp, &mut |_| true),
        None => session.generate(opts, &mut |_| true),
    }
    .map_err(|source| BenchError::Forward { phase: "decode", source })?;
    let out_ids = generation.tokens;
    let decode_s = t1.elapsed().as_secs_f64();
    let traffic = engine.device_traffic().since(pre.traffic);
    let ops = crate::backend::op_times_since(&engine.op_times(), &pre.ops);
    let end_unix = unix();
    let ceiling_after = probe.measure()?;
    let mut stats = session.stats.clone();
    stats.decode_s = decode_s;
    stats.generated_tokens = out_ids.len() as u64;
    stats.source = Some(engine.source_report());
    Ok(Decoded { start_unix, out_ids, decode_s, traffic, ops, end_unix, ceiling_after, stats })
}

/// Phase 4: the run's bounds (see the module contract) and what they are made of.
struct Bounds {
    prefill_ceiling: Option<f64>,
    decode_ceiling: Option<f64>,
    steps: usize,
    decode_read: u64,
    compute: f64,
    prefill_read_s: Option<f64>,
    ttft_bound: Option<f64>,
    ttft_bound_max: Option<f64>,
    /// A decode layer's fetch times, sorted (the straggler and hedging measure: its p99).
    decode_layers: Vec<f32>,
    per_token_read: f64,
    decode_bound: Option<f64>,
}

impl Bounds {
    fn of(pre: &Prefilled, dec: &Decoded) -> Bounds {
        let prefill_ceiling = mean_gbps(&pre.ceiling_before, &pre.ceiling_mid);
        let decode_ceiling = mean_gbps(&pre.ceiling_mid, &dec.ceiling_after);
        let stats = &dec.stats;
        let steps = dec.out_ids.len().saturating_sub(1);
        let decode_read = stats.bytes_read().unwrap_or(0).saturating_sub(pre.read);
        let compute = pre.ttft - pre.stats.phases.read_wait_s;
        let prefill_read_s = prefill_ceiling.map(|c| pre.unique as f64 / (c * 1e9));
        let ttft_bound = prefill_read_s.map(|r| r + compute);
        let ttft_bound_max = prefill_read_s.map(|r| r.max(compute));
        let mut decode_layers: Vec<f32> =
            stats.traces().fetch_s.get(pre.stats.traces().fetch_s.len()..).unwrap_or(&[]).to_vec();
        decode_layers.sort_by(f32::total_cmp);
        let per_token_read = if steps > 0 { decode_read as f64 / steps as f64 } else { 0.0 };
        let decode_bound =
            decode_ceiling.filter(|_| steps > 0 && per_token_read > 0.0).map(|c| per_token_read / (c * 1e9));
        Bounds {
            prefill_ceiling,
            decode_ceiling,
            steps,
            decode_read,
            compute,
            prefill_read_s,
            ttft_bound,
            ttft_bound_max,
            decode_layers,
            per_token_read,
            decode_bound,
        }
    }

    /// The decode layers' fetch time at quantile `q` (None without decode layers).
    fn layer_q(&self, q: f64) -> Option<f64> {
        let n = self.decode_layers.len();
        (n > 0).then(|| self.decode_layers[((q * n as f64).ceil() as usize).clamp(1, n) - 1] as f64)
    }
}

/// A measured run, for its record.
struct Run<'a> {
    files: &'a ModelFiles,
    prompt: &'a [u32],
    engine: &'a Arc<Engine>,
    spec: Option<&'a Speculator>,
    plan: &'a MemoryPlan,
    emptied: Emptied,
    pre: Prefilled,
    dec: Decoded,
    bounds: Bounds,
}

impl Run<'_> {
    /// Phase 5: the run's record.
    fn record(&self) -> Value {
        let (files, prompt, engine, plan, emptied) = (self.files, self.prompt, self.engine, self.plan, self.emptied);
        let (pre, dec, b) = (&self.pre, &self.dec, &self.bounds);
        let (stats, ttft, decode_s, steps) = (&dec.stats, pre.ttft, dec.decode_s, b.steps);
        // Our cache against the optimal one of the same size on the same fetch trace (cold start);
        // with a device expert cache in front, the optimum has the slots of both.
        let report = engine.source_report();
        let cold = cold::is_cold(emptied, &report.drives);
        let device_slots = engine.device_expert_slots();
        let cache_opt = report
            .cache_slots
            .map(|slots| crate::store::cache::belady_misses(&stats.traces().fetches, slots + device_slots));
        let cache_vs_opt = match (report.cache_misses, cache_opt) {
            (Some(ours), Some(opt)) if opt > 0 => Some(ours as f64 / opt as f64),
            _ => None,
        };
        let mut record = crate::stats::bench_record(
            "run",
            json!({
                "model": files.dir.display().to_string(),
                "engine_config": engine.config(),
                "backend_used": engine.backend_used(),
                "expert_bytes_total": files.expert_bytes_total(),
                "moe_layers": files.cfg.moe_layers() as u64,
                "drives_used": engine.config().use_drives,
                "prefetch": engine.config().prefetch,
                "page_cache_dropped": emptied == Emptied::Dropped,
                "memory_budget": plan.budget,
                "expert_cache_bytes": plan.expert_cache,
                "ceiling_gbps": pre.ceiling_before.as_ref().map(|c| c.gbps),
                "ceilings": {
                    "before_prompt": ceiling_json(&pre.ceiling_before),
                    "after_prompt": ceiling_json(&pre.ceiling_mid),
                    "after_decode": ceiling_json(&dec.ceiling_after),
                    "prefill_gbps": b.prefill_ceiling,
                    "decode_gbps": b.decode_ceiling,
                },
                "phase_unix_s": {"prefill": [pre.start_unix, pre.end_unix], "decode": [dec.start_unix, dec.end_unix]},
                "prompt_tokens": prompt.len(),
                "ttft_s": ttft,
                "prefill_tok_s": prompt.len() as f64 / ttft,
                "prefill": self.prefill_json(),
                "ttft_bound_s": b.ttft_bound,
                "ttft_bound_ratio": b.ttft_bound.map(|x| ttft / x),
                "ttft_bound_max_s": b.ttft_bound_max,
                "ttft_over_max": b.ttft_bound_max.map(|x| ttft / x),
                "prefill_read_bound_s": b.prefill_read_s,
                "decode": self.decode_json(),
                "decode_bound_s_per_token": b.decode_bound,
                "decode_sustained_gbps": if decode_s > 0.0 && steps > 0 { Some(b.decode_read as f64 / decode_s / 1e9) } else { None },
                "decode_bound_ratio": b.decode_bound.map(|x| (decode_s / steps as f64) / x),
                "cache_slots": report.cache_slots,
                "gpu_cache_slots": device_slots,
                // Submissions (round trips and upload flushes) and bytes to and from the device.
                "device_traffic": self.device_traffic_json(),
                "device_expert_bytes": engine.device_expert_bytes(),
                "expert_heat_runs_before": engine.store().and_then(|s| s.heat_runs()),
                "cache_misses": report.cache_misses,
                "cache_misses_opt": cache_opt,
                "cache_misses_vs_opt": cache_vs_opt,
                "output_ids": dec.out_ids,
                "stats": stats.to_json(),
            }),
        );
        // Beside the rest (one json! of them all would pass the macro's recursion limit).
        record["page_cache"] = json!(emptied);
        record["cold"] = json!(cold);
        record["cold_note"] = json!(cold::warm_note(cold, emptied, &report.drives));
        record
    }

    /// The record's `prefill`: its passes, reads and phase timers.
    fn prefill_json(&self) -> Value {
        let (pre, unique) = (&self.pre, self.pre.unique);
        let layers_moe = self.files.cfg.moe_layers() as u64;
        let chunks = self.prompt.len().div_ceil(self.engine.config().prefill_rows.max(1)) as u64;
        json!({
            "layer_passes": pre.stats.reads.layer_passes,
            "layer_passes_expected": layers_moe * chunks,
            "expert_bytes_read": pre.read,
            "expert_bytes_unique": unique,
            "read_amplification": if unique > 0 { Some(pre.read as f64 / unique as f64) } else { None },
            "read_wait_s": pre.stats.phases.read_wait_s,
            "expert_kernel_s": pre.stats.phases.expert_kernel_s,
            "moe_experts_s": pre.stats.phases.moe_experts_s,
            "moe_combine_s": pre.stats.phases.moe_combine_s,
            "attention_s": pre.stats.phases.attention_s,
            "router_s": pre.stats.phases.router_s,
            "other_s": pre.stats.phases.other_s,
            "compute_s": self.bounds.compute,
        })
    }

    /// The record's `decode`: per-token rates and reads, fetch-time quantiles, drafting, and where
    /// a decode token's time goes.
    fn decode_json(&self) -> Value {
        let (pre, stats, b, spec) = (&self.pre.stats, &self.dec.stats, &self.bounds, self.spec);
        let (decode_s, steps) = (self.dec.decode_s, b.steps);
        // Where a decode token's time goes (the phase timers' growth over decode).
        let decode_phases = (steps > 0).then(|| {
            let n = steps as f64;
            json!({
                "read_wait_s": (stats.phases.read_wait_s - pre.phases.read_wait_s) / n,
                "attention_s": (stats.phases.attention_s - pre.phases.attention_s) / n,
                "router_s": (stats.phases.router_s - pre.phases.router_s) / n,
                "moe_experts_s": (stats.phases.moe_experts_s - pre.phases.moe_experts_s) / n,
                "moe_combine_s": (stats.phases.moe_combine_s - pre.phases.moe_combine_s) / n,
                "dense_mlp_s": (stats.phases.dense_mlp_s - pre.phases.dense_mlp_s) / n,
                "other_s": (stats.phases.other_s - pre.phases.other_s) / n,
            })
        });
        // A device backend's operations per decode token: calls and wall seconds of each.
        let decode_ops = (steps > 0 && !self.dec.ops.is_empty()).then(|| {
            let n = steps as f64;
            self.dec
                .ops
                .iter()
                .map(|o| {
                    let per =
                        json!({"calls": o.calls as f64 / n, "s": o.seconds / n, "device_s": o.device_seconds / n});
                    (o.op.to_string(), per)
                })
                .collect::<serde_json::Map<_, _>>()
        });
        json!({
            "steps": steps,
            "seconds_per_token": if steps > 0 { Some(decode_s / steps as f64) } else { None },
            "decode_tok_s": if steps > 0 { steps as f64 / decode_s } else { 0.0 },
            "bytes_read_per_token": b.per_token_read,
            "layer_fetches": b.decode_layers.len(),
            "layer_s_p50": b.layer_q(0.5),
            "layer_s_p99": b.layer_q(0.99),
            "layer_s_max": b.layer_q(1.0),
            "draft": spec.map_or("off", |s| s.name()),
            "drafts_proposed": stats.drafts.proposed,
            "drafts_accepted": stats.drafts.accepted,
            "draft_acceptance": stats.acceptance(),
            "verify_calls": stats.drafts.verify_calls,
            "cost_model_pauses": spec.and_then(|s| s.cost.as_ref()).map(|c| c.pauses),
            "expert_bytes_requested_per_token": stats.decode_expert_bytes_per_token(),
            "phase_s_per_token": decode_phases,
            "backend_ops_per_token": decode_ops,
        })
    }

    /// The record's `device_traffic`: the prefill's, the decode's, and the decode's per token.
    fn device_traffic_json(&self) -> Value {
        let (traffic_decode, steps) = (self.dec.traffic, self.bounds.steps);
        json!({
            "prefill": self.pre.traffic.since(self.pre.traffic_start),
            "decode": traffic_decode,
            "decode_per_token": (steps > 0).then(|| {
                let n = steps as f64;
                json!({
                    "submissions": traffic_decode.submissions as f64 / n,
                    "upload_bytes": traffic_decode.upload_bytes as f64 / n,
                    "readback_bytes": traffic_decode.readback_bytes as f64 / n,
                    "wait_s": traffic_decode.wait_s / n,
                    "device_s": traffic_decode.device_s / n,
                })
            }),
        })
    }
}
