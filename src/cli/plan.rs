//! `deltafin plan`: the memory plan of Kimi K3 itself (its real config, built in) on a machine of
//! `--memory-gb`: the trunk under each encoding, what is left for the expert cache after state,
//! activations and the OS, the cache's expected hit rate and the decode lower bound per number
//! of drives. Arithmetic only: nothing is read (`crate::memory::plan_encodings`).

use crate::memory::{PlanInputs, plan_encodings};
use crate::model::K3Config;
use crate::model::synth::SynthSpec;
use anyhow::{Context, Result};
use clap::Args;

#[derive(Args)]
pub struct PlanArgs {
    /// Memory of the machine in GB (10^9 bytes).
    #[arg(long, value_parser = super::parse_gb_positive)]
    memory_gb: f64,
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
    /// Escapes per coded trunk value (default: the trained demo model's, measured by pack-trunk).
    #[arg(long, default_value_t = 0.0239)]
    escape_fraction: f64,
    /// One JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

pub fn run(a: PlanArgs) -> Result<()> {
    let spec = SynthSpec::k3();
    let cfg = K3Config::parse(std::path::Path::new("(built-in K3 config)"), &spec.config_json().to_string())
        .context("the built-in K3 config")?;
    let inputs = PlanInputs {
        memory_bytes: (a.memory_gb * 1e9) as u64,
        os_bytes: (a.os_gb * 1e9) as u64,
        context: a.context,
        prefill_rows: a.prefill_rows.max(1),
        drive_bytes_per_s: a.drive_gbps * 1e9,
        escape_fraction: a.escape_fraction.clamp(0.0, 1.0),
    };
    let rows = plan_encodings(&cfg, &inputs);
    if a.json {
        println!("{}", serde_json::json!({"model": "Kimi K3", "inputs": inputs, "plans": rows}));
        return Ok(());
    }
    let gb = |b: u64| b as f64 / 1e9;
    println!(
        "Kimi K3 on {:.0} GB: OS {:.0} GB, one sequence of {} tokens, {} prefill rows, {:.1} GB/s per drive; {} experts of {:.2} MB, {:.1} GB routed per token",
        a.memory_gb,
        a.os_gb,
        a.context,
        inputs.prefill_rows,
        a.drive_gbps,
        cfg.moe_layers() * cfg.experts,
        cfg.expert_bytes() as f64 / 1e6,
        (cfg.moe_layers() * cfg.top_k * cfg.expert_bytes()) as f64 / 1e9,
    );
    println!(
        "{:<17} {:>9} {:>9} {:>11} {:>13} {:>9}   decode lower bound, s/token: 1 / 2 / 4 / 8 drives",
        "trunk", "trunk GB", "state GB", "activ. GB", "expert cache", "hit rate"
    );
    for r in &rows {
        let label = if r.exact { r.trunk.to_string() } else { format!("{} (NOT EXACT)", r.trunk) };
        let d: Vec<String> = r.decode_s_per_token.iter().map(|(_, s)| format!("{s:.2}")).collect();
        println!(
            "{label:<17} {:>9.1} {:>9.1} {:>11.1} {:>10.1} GB {:>8.1}%   {}",
            gb(r.trunk_bytes),
            gb(r.state_bytes),
            gb(r.activation_bytes),
            gb(r.expert_cache_bytes),
            100.0 * r.hit_rate,
            d.join(" / ")
        );
    }
    println!(
        "(hit rate = the fraction of all experts the cache holds, as for uniform routes: real routes are skewed and hit more, so the bounds are the pessimistic end)"
    );
    Ok(())
}
