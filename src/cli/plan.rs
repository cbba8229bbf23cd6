//! `deltafin plan`: the memory plan of Kimi K3 itself (its real config, built in) on a machine of
//! `--memory-gb`: the trunk under each encoding, what is left for the expert cache after state,
//! activations and the OS, the cache's expected hit rate and the decode lower bound per number
//! of drives. Arithmetic only: nothing is read (`crate::memory::plan_encodings`). An encoding that
//! cannot fit is marked so, with the memory it needs, and a closing sentence says plainly when the
//! machine cannot hold K3 at all and why.

use crate::memory::{PlanInputs, PlanRow, plan_encodings};
use crate::model::K3Config;
use crate::model::synth::SynthSpec;
use anyhow::{Context, Result};
use clap::Args;
use std::io::Write;

#[derive(Args)]
pub struct PlanArgs {
    /// Memory of the machine in GB (10^9 bytes; default: this machine's).
    #[arg(long, value_parser = super::parse_gb_positive)]
    memory_gb: Option<f64>,
    /// GB kept for the OS and everything else.
    #[arg(long, default_value_t = 8.0, value_parser = super::parse_gb)]
    os_gb: f64,
    /// Tokens of context reserved for one sequence.
    #[arg(long, default_value_t = 32_768)]
    context: usize,
    /// Prompt rows processed together (their activations are reserved).
    #[arg(long, default_value_t = 512)]
    prefill_rows: usize,
    /// Sequential read rate of one drive in GB/s.
    #[arg(long, default_value_t = 7.0, value_parser = super::parse_gb_positive)]
    drive_gbps: f64,
    /// Memory read rate in GB/s: a token reads its whole resident trunk and its cached experts
    /// from memory, which floors the decode time however many drives there are (a Mac M5 Max
    /// reads about 500; a desktop's DDR5 about 60).
    #[arg(long, default_value_t = 100.0, value_parser = super::parse_gb_positive)]
    ram_gbps: f64,
    /// Escapes per coded trunk value (default: the trained demo model's, measured by pack-trunk).
    #[arg(long, default_value_t = 0.0239)]
    escape_fraction: f64,
    /// One JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

pub fn run(mut a: PlanArgs) -> Result<()> {
    let spec = SynthSpec::k3();
    let cfg = K3Config::parse(std::path::Path::new("(built-in K3 config)"), &spec.config_json().to_string())
        .context("the built-in K3 config")?;
    if a.context > cfg.max_context {
        anyhow::bail!("--context {}: Kimi K3 holds at most {} tokens of context", a.context, cfg.max_context);
    }
    let memory_gb = match a.memory_gb {
        Some(g) => g,
        None => {
            let m = crate::util::machine_memory().context("this machine's memory is unknown: give --memory-gb")?;
            eprintln!("deltafin plan: this machine's memory, {:.1} GB (--memory-gb for another)", m as f64 / 1e9);
            m as f64 / 1e9
        }
    };
    a.memory_gb = Some(memory_gb);
    let inputs = PlanInputs {
        memory_bytes: (memory_gb * 1e9) as u64,
        os_bytes: (a.os_gb * 1e9) as u64,
        context: a.context,
        prefill_rows: a.prefill_rows.max(1),
        drive_bytes_per_s: a.drive_gbps * 1e9,
        escape_fraction: a.escape_fraction.clamp(0.0, 1.0),
    };
    let mut rows = plan_encodings(&cfg, &inputs);
    // The drives' bound alone reaches 0 as the cache holds more: a token still reads its trunk and
    // its cached experts from memory.
    let routed = (cfg.moe_layers() * cfg.top_k * cfg.expert_bytes()) as f64;
    for r in &mut rows {
        let floor = (r.trunk_bytes as f64 + routed * r.hit_rate) / (a.ram_gbps * 1e9);
        for (_, s) in &mut r.decode_s_per_token {
            *s = s.max(floor);
        }
    }
    let mut out = std::io::stdout().lock();
    if a.json {
        writeln!(out, "{}", serde_json::json!({"model": "Kimi K3", "inputs": inputs, "plans": rows}))?;
        return Ok(());
    }
    let gb = |b: u64| b as f64 / 1e9;
    writeln!(
        out,
        "Kimi K3 on {:.0} GB: OS {:.0} GB, one sequence of {} tokens, {} prefill rows, {:.1} GB/s per drive; {} experts of {:.2} MB, {:.1} GB routed per token",
        memory_gb,
        a.os_gb,
        a.context,
        inputs.prefill_rows,
        a.drive_gbps,
        cfg.moe_layers() * cfg.experts,
        cfg.expert_bytes() as f64 / 1e6,
        (cfg.moe_layers() * cfg.top_k * cfg.expert_bytes()) as f64 / 1e9,
    )?;
    writeln!(
        out,
        "{:<17} {:>9} {:>9} {:>11} {:>10} {:>13} {:>9}   decode lower bound, s/token: 1 / 2 / 4 / 8 drives",
        "trunk", "trunk GB", "state GB", "activ. GB", "needs GB", "expert cache", "hit rate"
    )?;
    for r in &rows {
        let label = if r.exact { r.trunk.to_string() } else { format!("{} (NOT EXACT)", r.trunk) };
        let tail = if r.fits {
            let d: Vec<String> = r.decode_s_per_token.iter().map(|(_, s)| format!("{s:.2}")).collect();
            format!("{:>10.1} GB {:>8.1}%   {}", gb(r.expert_cache_bytes), 100.0 * r.hit_rate, d.join(" / "))
        } else {
            format!("DOES NOT FIT: needs {:.1} GB more", gb(r.min_memory_bytes - inputs.memory_bytes))
        };
        writeln!(
            out,
            "{label:<17} {:>9.1} {:>9.1} {:>11.1} {:>10.1} {tail}",
            gb(r.trunk_bytes),
            gb(r.state_bytes),
            gb(r.activation_bytes),
            gb(r.min_memory_bytes),
        )?;
    }
    writeln!(
        out,
        "(needs = trunk + state + activations + read slots + the OS's {:.0} GB, with no expert cache; hit rate = the fraction of all experts the cache holds, as for uniform routes: real routes are skewed and hit more, so the bounds are the pessimistic end; a bound is never below reading the trunk and the cached experts from memory at {:.0} GB/s, --ram-gbps; kernel time is not counted)",
        a.os_gb, a.ram_gbps
    )?;
    if let Some(w) = verdict(&rows, memory_gb, a.context) {
        writeln!(out, "{w}")?;
    }
    Ok(())
}

/// A plain sentence when some trunk encoding cannot run on the machine: which, why (its trunk
/// alone, or with the rest, is more than the memory), and the least memory each needs.
fn verdict(rows: &[PlanRow], memory_gb: f64, context: usize) -> Option<String> {
    let gb = |b: u64| b as f64 / 1e9;
    let name = |r: &PlanRow| if r.exact { r.trunk.to_string() } else { format!("{} (not exact)", r.trunk) };
    let mins = rows.iter().map(|r| format!("{} {:.1} GB", name(r), gb(r.min_memory_bytes))).collect::<Vec<_>>();
    let least = format!("The least memory that works, per trunk: {} (less with a smaller --context)", mins.join(", "));
    let fit: Vec<String> = rows.iter().filter(|r| r.fits).map(name).collect();
    if fit.len() == rows.len() {
        return None;
    }
    let smallest = rows.iter().min_by_key(|r| r.min_memory_bytes)?;
    let why = if smallest.trunk_bytes as f64 > memory_gb * 1e9 {
        format!("its smallest trunk, {}, alone is {:.1} GB", name(smallest), gb(smallest.trunk_bytes))
    } else {
        format!(
            "even its smallest trunk, {} at {:.1} GB, with one {context}-token sequence, activations, read slots and the OS needs {:.1} GB",
            name(smallest),
            gb(smallest.trunk_bytes),
            gb(smallest.min_memory_bytes)
        )
    };
    Some(if fit.is_empty() {
        format!("Kimi K3 CANNOT RUN on {memory_gb:.0} GB: {why}. {least}.")
    } else {
        format!("On {memory_gb:.0} GB Kimi K3 runs only with the {} trunk. {least}.", fit.join(" or "))
    })
}
