//! `bench run --batch N`: N prompts prefilled in shared expert-major passes and decoded in
//! lockstep, timed, bounded, and checked against each prompt run alone.
//!
//! Contract: [`run`] opens one engine, prefills the N prompts together
//! (`Engine::prefill_sessions`), decodes them greedily together for `decode` tokens each
//! (`Engine::generate_sessions`), then runs each prompt alone on a fresh session of the same
//! engine and compares (`ids_identical`: every sequence's prefill logits bit for bit and its
//! tokens). The disk ceiling is measured by the caller's `measure` before prefill, between the
//! phases and after decode; each phase's bound uses the mean of the two probes around it.
//! - prefill: `bound_s` = max(union bytes / ceiling, compute), where union bytes are the distinct
//!   experts the shared passes touched and compute is the batch's measured compute (its wall
//!   minus the time it waited for reads: every prompt's rows at the rate the kernels ran);
//! - decode: `bound_s` = the union-read bound summed over steps: each step's per-layer union of
//!   the active sequences' experts (the recorded routes) x expert bytes / ceiling.
//!
//! Ratios: `prefill.ratio` = wall / bound (goal <= 1.1), `decode.bound_over_wall` = bound / wall
//! (goal >= 0.9). Timings of the alone runs come after the batch on a warm engine, so they are
//! context, not a bound.

use crate::engine::{BatchSeq, Engine, EngineConfig, EngineError, ForwardError, GenerateOptions, Session};
use crate::sample::Sampler;
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
/// permitted); the record gets `page_cache_dropped`.
pub fn runs(
    files: &crate::model::ModelFiles,
    config: EngineConfig,
    prompt_tokens: usize,
    n: usize,
    decode: usize,
    ceiling_seconds: f64,
) -> Result<Value, BatchBenchError> {
    use super::ceiling::{CeilingProbe, drop_page_cache};
    use crate::store::placement::{Manifest, manifest_path};
    let all = super::prompt::tokens(files, prompt_tokens * n)?;
    let prompts: Vec<Vec<u32>> = all.chunks(prompt_tokens.max(1)).map(<[u32]>::to_vec).collect();
    let mp = manifest_path(config.placement.as_deref(), &config.model);
    let manifest = mp.as_ref().map(|p| Manifest::load(p)).transpose().map_err(super::BenchError::from)?;
    let qd = manifest.as_ref().map_or(config.qd, |m| m.drives.iter().map(|d| d.qd).sum());
    let dropped = drop_page_cache();
    let probe = CeilingProbe::new(files, manifest.as_ref(), config.use_drives.as_deref(), qd, ceiling_seconds)?;
    let mut measure = || probe.measure().map(|c| c.map(|c| c.gbps)).map_err(|e| e.to_string());
    let mut rec = run(config, &prompts, decode, &mut measure)?;
    rec["page_cache_dropped"] = json!(dropped);
    Ok(rec)
}

/// A disk-ceiling probe: GB/s, or None when probes are off.
pub type Measure<'a> = &'a mut dyn FnMut() -> Result<Option<f64>, String>;

fn mean(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some((a + b) / 2.0),
        (x, None) | (None, x) => x,
    }
}

/// Distinct experts per MoE layer pass of `trace` (one entry per pass, in order).
fn union_sizes(trace: &[(u32, Vec<u32>)]) -> Vec<usize> {
    trace.iter().map(|(_, u)| u.len()).collect()
}

/// Runs the batch and returns its record (see the module contract).
pub fn run(
    config: EngineConfig,
    prompts: &[Vec<u32>],
    decode: usize,
    measure: Measure,
) -> Result<Value, BatchBenchError> {
    if prompts.is_empty() {
        return Err(BatchBenchError::NoPrompts);
    }
    let n = prompts.len();
    let engine = Engine::open(config)?;
    let max_new = decode.max(1);
    let lens: Vec<usize> = prompts.iter().map(|p| p.len() + max_new).collect();
    engine.sequences_fit(&lens)?;
    let mut sessions: Vec<Session> = (0..n).map(|_| engine.new_session()).collect();
    let lists: Vec<&[u32]> = prompts.iter().map(|p| &p[..]).collect();
    let m = |measure: &mut dyn FnMut() -> Result<Option<f64>, String>| measure().map_err(BatchBenchError::Ceiling);
    let c0 = m(measure)?;
    let read0 = engine.source_report().expert_bytes_read.unwrap_or(0);
    let t0 = Instant::now();
    let pre = {
        let mut refs: Vec<&mut Session> = sessions.iter_mut().collect();
        engine.prefill_sessions(&mut refs, &lists)?
    };
    let prefill_wall = t0.elapsed().as_secs_f64();
    let read1 = engine.source_report().expert_bytes_read.unwrap_or(0);
    let first_logits: Vec<Vec<f32>> =
        sessions.iter().map(|s| s.logits().map(<[f32]>::to_vec).unwrap_or_default()).collect();
    let c1 = m(measure)?;
    let opts = GenerateOptions { max_new, stop: Vec::new() };
    let mut samplers: Vec<Sampler> = (0..n).map(|_| Sampler::greedy()).collect();
    let t1 = Instant::now();
    let (gens, dec) = {
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
    let decode_wall = t1.elapsed().as_secs_f64();
    let read2 = engine.source_report().expert_bytes_read.unwrap_or(0);
    let c2 = m(measure)?;
    let alone = alone_runs(&engine, prompts, &opts)?;
    let ids_identical = alone.iter().enumerate().all(|(i, (logits, toks, _, _))| {
        let same_logits = logits.len() == first_logits[i].len()
            && logits.iter().zip(&first_logits[i]).all(|(a, b)| a.to_bits() == b.to_bits());
        same_logits && *toks == gens[i].tokens
    });
    let expert_bytes = pre.expert_bytes.max(dec.expert_bytes);
    let prefill_ceiling = mean(c0, c1);
    let decode_ceiling = mean(c1, c2);
    let union_bytes = pre.expert_bytes_unique();
    let compute = (prefill_wall - pre.read_wait_s).max(0.0);
    let prefill_read_s = prefill_ceiling.map(|c| union_bytes as f64 / (c * 1e9));
    let prefill_bound = prefill_read_s.map(|r| r.max(compute));
    let steps = dec.forward_calls;
    let dec_unions = union_sizes(&dec.fetch_trace);
    let dec_union_bytes = dec_unions.iter().sum::<usize>() as u64 * expert_bytes;
    let decode_bound = decode_ceiling.map(|c| dec_union_bytes as f64 / (c * 1e9));
    let moe_layers = pre.layer_passes.checked_div(prefill_passes(&engine, prompts)).unwrap_or(0).max(1);
    let per_layer_mean = |u: &[usize]| if u.is_empty() { 0.0 } else { u.iter().sum::<usize>() as f64 / u.len() as f64 };
    let generated: usize = gens.iter().map(|g| g.tokens.len()).sum();
    Ok(crate::stats::bench_record(
        "run",
        json!({
            "model": engine.dir().display().to_string(),
            "engine_config": engine.config,
            "backend_used": engine.backend_used(),
            "expert_bytes_total": engine.expert_bytes_total(),
            "memory_budget": engine.plan.budget,
            "expert_cache_bytes": engine.plan.expert_cache,
            "batch": n,
            "prompt_tokens": prompts.iter().map(Vec::len).collect::<Vec<_>>(),
            "ids_identical": ids_identical,
            "ceilings_gbps": {"before_prefill": c0, "after_prefill": c1, "after_decode": c2},
            "prefill": {
                "wall_s": prefill_wall,
                "bound_s": prefill_bound,
                "ratio": prefill_bound.map(|b| prefill_wall / b),
                "read_bound_s": prefill_read_s,
                "compute_s": compute,
                "read_wait_s": pre.read_wait_s,
                "expert_kernel_s": pre.expert_kernel_s,
                "attention_s": pre.attention_s,
                "layer_passes": pre.layer_passes,
                "union_expert_bytes": union_bytes,
                "expert_bytes_read": read1.saturating_sub(read0),
                "expert_bytes": expert_bytes,
                "distinct_experts_per_layer": per_layer_mean(&union_sizes(&pre.fetch_trace)),
                "tok_s": prompts.iter().map(Vec::len).sum::<usize>() as f64 / prefill_wall,
                "alone_wall_s": alone.iter().map(|a| a.2).collect::<Vec<_>>(),
            },
            "decode": {
                "wall_s": decode_wall,
                "bound_s": decode_bound,
                "bound_over_wall": decode_bound.map(|b| b / decode_wall),
                "steps": steps,
                "generated_tokens": generated,
                "union_expert_bytes": dec_union_bytes,
                "expert_bytes_read": read2.saturating_sub(read1),
                "distinct_experts_per_layer": per_layer_mean(&dec_unions),
                "distinct_experts_per_layer_alone": per_layer_mean(&alone.iter().flat_map(|a| union_sizes(&a.3)).collect::<Vec<_>>()),
                "moe_layers": moe_layers,
                "read_wait_s": dec.read_wait_s,
                "tok_s": generated as f64 / decode_wall,
                "s_per_step": if steps > 0 { Some(decode_wall / steps as f64) } else { None },
            },
            "output_ids": gens.iter().map(|g| &g.tokens).collect::<Vec<_>>(),
        }),
    ))
}

/// The number of shared prefill passes `prompts` take on `engine`.
fn prefill_passes(engine: &Arc<Engine>, prompts: &[Vec<u32>]) -> u64 {
    let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    crate::engine::prefill_passes(&lens, engine.config.prefill_rows).len() as u64
}

/// Each prompt alone on a fresh session: its prefill logits, its greedy tokens, its prefill wall
/// and its decode fetch trace.
#[allow(clippy::type_complexity)]
fn alone_runs(
    engine: &Arc<Engine>,
    prompts: &[Vec<u32>],
    opts: &GenerateOptions,
) -> Result<Vec<(Vec<f32>, Vec<u32>, f64, Vec<(u32, Vec<u32>)>)>, ForwardError> {
    let mut out = Vec::with_capacity(prompts.len());
    for p in prompts {
        let mut s = engine.new_session();
        let t = Instant::now();
        let logits = s.prefill(p)?.to_vec();
        let wall = t.elapsed().as_secs_f64();
        let before = s.stats.fetch_trace.len();
        let g = s.generate(opts, &mut |_| true)?;
        let trace: Vec<(u32, Vec<u32>)> = s.stats.fetch_trace.get(before..).unwrap_or_default().to_vec();
        out.push((logits, g.tokens, wall, trace));
    }
    Ok(out)
}
