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
use crate::draft::{DraftKind, OracleDrafter, Speculator};
use crate::engine::{Engine, EngineConfig, EngineError, GenerateOptions};
use crate::model::ModelFiles;
use crate::store::placement::{Manifest, manifest_path};
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

/// One measured run of `prompt` on an engine of `config` (its drive subset and prefetch set).
fn one_run(
    files: &ModelFiles,
    a: &RunOptions,
    config: &EngineConfig,
    prompt: &[u32],
    probe: &CeilingProbe,
    emptied: Emptied,
) -> Result<Value, BenchError> {
    let opts = GenerateOptions { max_new: a.decode.max(1), stop: Vec::new() };
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
            let g = s.generate(&opts, &mut |_| true).map_err(decode_failed)?;
            let truth = prompt.iter().chain(&g.tokens).copied().collect();
            Some(Speculator::without_cost_model(Box::new(OracleDrafter::new(truth))))
        }
        _ => None,
    };
    let emptied = if cold::drop_page_cache() { Emptied::Dropped } else { emptied };
    let engine = open_engine(config)?;
    let mut spec = match a.draft {
        BenchDraft::Off => None,
        BenchDraft::Ngram => engine.speculator(DraftKind::Ngram)?,
        BenchDraft::Dspark => engine.speculator(DraftKind::Dspark)?,
        BenchDraft::Oracle => oracle.take(),
    };
    let plan = engine.plan().clone();
    let mut session = engine.new_session();
    // The per-layer traces: the decode layers' fetch times, the fetch trace and the cache's optimum.
    session.keep_traces(true);
    let ceiling_before = probe.measure()?;
    let traffic_start = engine.device_traffic();
    let unix = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
    let prefill_start = unix();
    let t0 = Instant::now();
    match &mut spec {
        Some(sp) => session.prefill_with(prompt, sp),
        None => session.prefill(prompt),
    }
    .map_err(prefill_failed)?;
    let ttft = t0.elapsed().as_secs_f64();
    session.stats.ttft_s = ttft;
    session.stats.prefill_s = ttft;
    let pre = session.stats.clone();
    let traffic_prefill = engine.device_traffic();
    let ops_prefill = engine.op_times();
    let pre_src = engine.source_report();
    let prefill_read = pre_src.expert_bytes_read.unwrap_or(0);
    let unique = pre.expert_bytes_unique();
    let prefill_end = unix();
    let ceiling_mid = probe.measure()?;
    let decode_start = unix();
    let t1 = Instant::now();
    let generation = match &mut spec {
        Some(sp) => session.generate_speculative(&opts, sp, &mut |_| true),
        None => session.generate(&opts, &mut |_| true),
    }
    .map_err(decode_failed)?;
    let out_ids = generation.tokens;
    let decode_s = t1.elapsed().as_secs_f64();
    let traffic_decode = engine.device_traffic().since(traffic_prefill);
    let ops_decode = crate::backend::op_times_since(&engine.op_times(), &ops_prefill);
    let decode_end = unix();
    let ceiling_after = probe.measure()?;
    let prefill_ceiling = mean_gbps(&ceiling_before, &ceiling_mid);
    let decode_ceiling = mean_gbps(&ceiling_mid, &ceiling_after);
    let mut stats = session.stats.clone();
    stats.decode_s = decode_s;
    stats.generated_tokens = out_ids.len() as u64;
    stats.source = Some(engine.source_report());
    let steps = out_ids.len().saturating_sub(1);
    let decode_read = stats.bytes_read().unwrap_or(0).saturating_sub(prefill_read);
    let compute = ttft - pre.phases.read_wait_s;
    let prefill_read_s = prefill_ceiling.map(|c| unique as f64 / (c * 1e9));
    let ttft_bound = prefill_read_s.map(|r| r + compute);
    let ttft_bound_max = prefill_read_s.map(|r| r.max(compute));
    // A decode layer's fetch times (the straggler and hedging measure: its p99).
    let mut decode_layers: Vec<f32> = stats.traces().fetch_s.get(pre.traces().fetch_s.len()..).unwrap_or(&[]).to_vec();
    decode_layers.sort_by(f32::total_cmp);
    let layer_q = |q: f64| {
        let n = decode_layers.len();
        (n > 0).then(|| decode_layers[((q * n as f64).ceil() as usize).clamp(1, n) - 1] as f64)
    };
    let per_token_read = if steps > 0 { decode_read as f64 / steps as f64 } else { 0.0 };
    let decode_bound = decode_ceiling.filter(|_| steps > 0 && per_token_read > 0.0).map(|c| per_token_read / (c * 1e9));
    if stats.bytes_read().is_some() && unique > 0 && prefill_read > unique {
        eprintln!(
            "deltafin bench: note: prefill read {} bytes for {} distinct ({:.4}x)",
            prefill_read,
            unique,
            prefill_read as f64 / unique as f64
        );
    }
    if let Some(p) = &a.fetch_trace {
        let body = serde_json::to_vec(
            &json!({"cache_slots": engine.source_report().cache_slots, "prefill_passes": pre.traces().fetches.len(), "trace": stats.traces().fetches, "rows_of": stats.traces().rows}),
        )
        .map_err(|source| BenchError::Json { path: p.clone(), source })?;
        crate::util::write_atomic(p, &body).map_err(|source| BenchError::Io { path: p.clone(), source })?;
    }
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
    let decode_ops = (steps > 0 && !ops_decode.is_empty()).then(|| {
        let n = steps as f64;
        ops_decode
            .iter()
            .map(|o| {
                let per = json!({"calls": o.calls as f64 / n, "s": o.seconds / n, "device_s": o.device_seconds / n});
                (o.op.to_string(), per)
            })
            .collect::<serde_json::Map<_, _>>()
    });
    let layers_moe = files.cfg.moe_layers() as u64;
    let chunks = prompt.len().div_ceil(engine.config().prefill_rows.max(1)) as u64;
    let mut record = crate::stats::bench_record(
        "run",
        json!({
            "model": files.dir.display().to_string(),
            "engine_config": engine.config(),
            "backend_used": engine.backend_used(),
            "expert_bytes_total": files.expert_bytes_total(),
            "moe_layers": layers_moe,
            "drives_used": engine.config().use_drives,
            "prefetch": engine.config().prefetch,
            "page_cache_dropped": emptied == Emptied::Dropped,
            "memory_budget": plan.budget,
            "expert_cache_bytes": plan.expert_cache,
            "ceiling_gbps": ceiling_before.as_ref().map(|c| c.gbps),
            "ceilings": {
                "before_prompt": ceiling_json(&ceiling_before),
                "after_prompt": ceiling_json(&ceiling_mid),
                "after_decode": ceiling_json(&ceiling_after),
                "prefill_gbps": prefill_ceiling,
                "decode_gbps": decode_ceiling,
            },
            "phase_unix_s": {"prefill": [prefill_start, prefill_end], "decode": [decode_start, decode_end]},
            "prompt_tokens": prompt.len(),
            "ttft_s": ttft,
            "prefill_tok_s": prompt.len() as f64 / ttft,
            "prefill": {
                "layer_passes": pre.reads.layer_passes,
                "layer_passes_expected": layers_moe * chunks,
                "expert_bytes_read": prefill_read,
                "expert_bytes_unique": unique,
                "read_amplification": if unique > 0 { Some(prefill_read as f64 / unique as f64) } else { None },
                "read_wait_s": pre.phases.read_wait_s,
                "expert_kernel_s": pre.phases.expert_kernel_s,
                "moe_experts_s": pre.phases.moe_experts_s,
                "moe_combine_s": pre.phases.moe_combine_s,
                "attention_s": pre.phases.attention_s,
                "router_s": pre.phases.router_s,
                "other_s": pre.phases.other_s,
                "compute_s": compute,
            },
            "ttft_bound_s": ttft_bound,
            "ttft_bound_ratio": ttft_bound.map(|b| ttft / b),
            "ttft_bound_max_s": ttft_bound_max,
            "ttft_over_max": ttft_bound_max.map(|b| ttft / b),
            "prefill_read_bound_s": prefill_read_s,
            "decode": {
                "steps": steps,
                "seconds_per_token": if steps > 0 { Some(decode_s / steps as f64) } else { None },
                "decode_tok_s": if steps > 0 { steps as f64 / decode_s } else { 0.0 },
                "bytes_read_per_token": per_token_read,
                "layer_fetches": decode_layers.len(),
                "layer_s_p50": layer_q(0.5),
                "layer_s_p99": layer_q(0.99),
                "layer_s_max": layer_q(1.0),
                "draft": spec.as_ref().map_or("off", |s| s.name()),
                "drafts_proposed": stats.drafts.proposed,
                "drafts_accepted": stats.drafts.accepted,
                "draft_acceptance": stats.acceptance(),
                "verify_calls": stats.drafts.verify_calls,
                "cost_model_pauses": spec.as_ref().and_then(|s| s.cost.as_ref()).map(|c| c.pauses),
                "expert_bytes_requested_per_token": stats.decode_expert_bytes_per_token(),
                "phase_s_per_token": decode_phases,
                "backend_ops_per_token": decode_ops,
            },
            "decode_bound_s_per_token": decode_bound,
            "decode_sustained_gbps": if decode_s > 0.0 && steps > 0 { Some(decode_read as f64 / decode_s / 1e9) } else { None },
            "decode_bound_ratio": decode_bound.map(|b| (decode_s / steps as f64) / b),
            "cache_slots": report.cache_slots,
            "gpu_cache_slots": device_slots,
            // Submissions (round trips and upload flushes) and bytes to and from the device.
            "device_traffic": {
                "prefill": traffic_prefill.since(traffic_start),
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
            },
            "device_expert_bytes": engine.device_expert_bytes(),
            "expert_heat_runs_before": engine.store().and_then(|s| s.heat_runs()),
            "cache_misses": report.cache_misses,
            "cache_misses_opt": cache_opt,
            "cache_misses_vs_opt": cache_vs_opt,
            "output_ids": out_ids,
            "stats": stats.to_json(),
        }),
    );
    // Beside the rest (one json! of them all would pass the macro's recursion limit).
    record["page_cache"] = json!(emptied);
    record["cold"] = json!(cold);
    record["cold_note"] = json!(cold::warm_note(cold, emptied, &report.drives));
    Ok(record)
}
