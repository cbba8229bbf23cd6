//! `deltafin place`: decides which drives hold each expert, writes the expert pack files and
//! `placement.json`; `--verify` re-checks every checksum of an existing placement.

use super::load;
use crate::store::placement::{self, MANIFEST, Manifest, PlaceOptions, PlacementError, Policy, RouteTrace, ShardUse};
use crate::store::probe;
use crate::store::reader::ReaderKind;
use crate::util::human_bytes;
use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Args)]
pub struct PlaceArgs {
    /// Model directory (the shipped checkpoint); placement.json is written here.
    #[arg(long)]
    model: PathBuf,
    /// A drive: a directory for expert pack files, optionally with its read ceiling in GB/s
    /// (PATH=GBPS; measured when omitted). Repeat for several drives.
    #[arg(long = "drive", value_name = "PATH[=GBPS]")]
    drives: Vec<String>,
    /// How experts are distributed over the drives.
    #[arg(long, value_enum, default_value_t = Policy::Spread)]
    policy: Policy,
    /// Route trace from `run --trace-routes` (needed by --policy hot).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// How the shipped shards serve as holders.
    #[arg(long, value_enum, default_value_t = ShardUse::Fallback)]
    shards: ShardUse,
    /// Reads in flight per drive (used for measuring and recorded for the engine).
    #[arg(long, default_value_t = 4, value_parser = super::parse_qd)]
    qd: usize,
    /// Reader used to measure drives.
    #[arg(long, value_enum, default_value_t = ReaderKind::Auto)]
    reader: ReaderKind,
    /// Size of the probe file written to measure a drive.
    #[arg(long, default_value_t = 512)]
    probe_mb: u64,
    /// Seconds of random reads per measurement.
    #[arg(long, default_value_t = 2.0)]
    probe_seconds: f64,
    /// Re-check every checksum of the existing placement instead of placing.
    #[arg(long)]
    verify: bool,
}

fn parse_drive(s: &str) -> Result<(PathBuf, Option<f64>)> {
    match s.rsplit_once('=') {
        Some((p, g)) => {
            let gbps: f64 = g.parse().with_context(|| format!("--drive {s}: `{g}` is not a speed in GB/s"))?;
            if gbps.is_nan() || gbps <= 0.0 {
                bail!("--drive {s}: the speed must be > 0");
            }
            Ok((PathBuf::from(p), Some(gbps)))
        }
        None => Ok((PathBuf::from(s), None)),
    }
}

fn bar(total: u64) -> ProgressBar {
    let b = ProgressBar::new(total);
    b.set_style(
        ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    b
}

pub fn run(a: PlaceArgs) -> Result<()> {
    if crate::hub::stream::StreamInstall::load(&a.model)?.is_some() {
        bail!(
            "{} is a stream install: its shards hold no routed experts to place (streamed experts are kept on the install's drives)",
            a.model.display()
        );
    }
    let opened = load::open(&a.model)?;
    if a.verify {
        return verify(&a, &opened);
    }
    if a.drives.is_empty() {
        bail!("give at least one --drive PATH[=GBPS]");
    }
    let drives: Vec<(PathBuf, Option<f64>)> = a.drives.iter().map(|d| parse_drive(d)).collect::<Result<_>>()?;
    let trace = match (&a.trace, a.policy) {
        (Some(t), _) => Some(RouteTrace::load(t)?),
        (None, Policy::Hot) => bail!("--policy hot needs --trace ROUTES (record one with `run --trace-routes FILE`)"),
        (None, _) => None,
    };
    opened.roster.expert_layout.as_ref().context("the model has no routed experts to place")?;
    let probe_size = a.probe_mb << 20;
    let time = Duration::from_secs_f64(a.probe_seconds);
    let reader = a.reader;
    let measure = |root: &Path, qd: usize| -> Result<f64, PlacementError> {
        eprintln!("deltafin place: measuring {} ({} MiB probe, qd {qd}) ...", root.display(), probe_size >> 20);
        let c = probe::measure_dir(root, probe_size, qd, reader, time)
            .map_err(|e| PlacementError::Other(format!("measuring {}: {e}", root.display())))?;
        eprintln!(
            "deltafin place:   {:.2} GB/s{}",
            c.gbps,
            if c.direct {
                String::new()
            } else {
                format!(" (no {} on this file system)", crate::store::reader::UNCACHED)
            }
        );
        Ok(c.gbps)
    };
    let opened_ref = &opened;
    let measure_shards = |qd: usize| -> Result<f64, PlacementError> {
        let (ranges, len) = placement::shard_read_ranges(&opened_ref.ck, &opened_ref.roster);
        let c = probe::measure_ranges(&ranges, len, qd, reader, time)
            .map_err(|e| PlacementError::Other(format!("measuring the shards: {e}")))?;
        eprintln!("deltafin place: shards in {}: {:.2} GB/s", a.model.display(), c.gbps);
        Ok(c.gbps)
    };
    let pb = bar(0);
    let progress = |done: u64, total: u64| {
        pb.set_length(total);
        pb.set_position(done);
    };
    let o = PlaceOptions {
        model_dir: &a.model,
        drives,
        policy: a.policy,
        shards: a.shards,
        trace,
        qd: a.qd,
        measure: &measure,
        measure_shards: &measure_shards,
        progress: &progress,
    };
    let m = placement::place(&opened.cfg, &opened.ck, &opened.roster, &o)?;
    pb.finish_and_clear();
    summarize(&m, &a.model.join(MANIFEST));
    Ok(())
}

fn summarize(m: &Manifest, path: &Path) {
    let name = |v: &dyn Fn() -> Option<clap::builder::PossibleValue>| {
        v().map(|p| p.get_name().to_string()).unwrap_or_default()
    };
    eprintln!(
        "deltafin place: wrote {} ({} policy, shards as {})",
        path.display(),
        name(&|| m.policy.to_possible_value()),
        name(&|| m.shards.to_possible_value())
    );
    for (d, drive) in m.drives.iter().enumerate() {
        let n: usize =
            m.layers.iter().map(|l| l.experts.iter().filter(|e| e.drives.contains(&(d as u16))).count()).sum();
        eprintln!(
            "  drive {d}: {} {:.2} GB/s ({}), {n} experts, {}",
            drive.root.display(),
            drive.gbps,
            if drive.measured { "measured" } else { "given" },
            human_bytes(n as u64 * m.expert_bytes)
        );
    }
}

fn verify(a: &PlaceArgs, opened: &load::Opened) -> Result<()> {
    let path = a.model.join(MANIFEST);
    let m = Manifest::load(&path)?;
    m.check_model(&opened.ck, &opened.roster)?;
    let pb = bar(0);
    let problems = placement::verify(&m, &opened.ck, &opened.roster, &|d, t| {
        pb.set_length(t);
        pb.set_position(d);
    });
    pb.finish_and_clear();
    if problems.is_empty() {
        let n: usize = m.layers.iter().map(|l| l.experts.iter().map(|e| e.drives.len() + 1).sum::<usize>()).sum();
        eprintln!("deltafin place: {} verified: {n} holders, every checksum matches", path.display());
        return Ok(());
    }
    for p in problems.iter().take(50) {
        eprintln!("  {}: expert {} of layer {}: {}", p.drive, p.expert, p.layer, p.msg);
    }
    bail!("{} problem(s) in {}", problems.len(), path.display())
}
