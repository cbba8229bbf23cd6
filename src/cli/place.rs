//! `deltafin place`: decides which drives hold each expert, writes the expert pack files and
//! `placement.json`; `--verify` re-checks every checksum of an existing placement.
//!
//! A drive is a directory that exists: it is never created here, so a drive that is not mounted
//! (its mount point absent, or listed in /etc/fstab but not mounted: an empty directory on the
//! disk under it) is an error naming the fix, not packs filling the wrong disk.

use super::load;
use super::progress::{self, Progress};
use crate::store::io::reader::ReaderKind;
use crate::store::placement::{self, MANIFEST, Manifest, PlaceOptions, PlacementError, Policy, RouteTrace, ShardUse};
use crate::store::probe;
use crate::util::human_bytes;
use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Args)]
pub struct PlaceArgs {
    /// Model directory (the shipped checkpoint); placement.json is written here.
    #[arg(long, required_unless_present = "demo", conflicts_with = "demo")]
    model: Option<PathBuf>,
    /// Use the built-in demo model (laid out under deltafin's cache directory on first use).
    #[arg(long)]
    demo: bool,
    /// A drive: an existing directory (on a mounted drive) for expert pack files, optionally with
    /// its read ceiling in GB/s (PATH=GBPS; measured when omitted). Repeat for several drives.
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
    /// Size of the probe file written to measure a drive (default: the model's expert bytes,
    /// from 32 to 512 MiB: a small model is not placed after writing half a gigabyte per drive).
    #[arg(long)]
    probe_mb: Option<u64>,
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

/// Refuses a drive that is not an existing directory, or one whose mount is missing (see the
/// module contract); warns when two drives share a file system (they share its bandwidth).
fn check_drives(drives: &[(PathBuf, Option<f64>)]) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let mut devs: Vec<(u64, &Path)> = Vec::new();
    for (p, _) in drives {
        let m = match std::fs::metadata(p) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!(
                "--drive {}: no such directory (nothing is created). If it is a drive, mount it first; if it is a new \
                 directory on a mounted drive, create it: mkdir -p {}",
                p.display(),
                p.display()
            ),
            Err(e) => bail!("--drive {}: {e}", p.display()),
        };
        if !m.is_dir() {
            bail!("--drive {}: not a directory (a drive is a directory that holds expert pack files)", p.display());
        }
        let abs = std::fs::canonicalize(p).with_context(|| format!("--drive {}", p.display()))?;
        let fstab = std::fs::read_to_string("/etc/fstab").unwrap_or_default();
        let mounted = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        if let Some(mp) = unmounted_mount_point(&abs, &fstab, &mounted) {
            bail!(
                "--drive {}: {} is listed in /etc/fstab but not mounted, so this directory is on the disk under it; \
                 mount it first (sudo mount {})",
                p.display(),
                mp.display(),
                mp.display()
            );
        }
        if let Some((_, other)) = devs.iter().find(|(d, _)| *d == m.dev()) {
            tracing::warn!(
                "--drive {} and --drive {} are on the same file system: they share one drive's bandwidth",
                other.display(),
                p.display()
            );
        }
        devs.push((m.dev(), p));
    }
    Ok(())
}

/// The mount point of `/etc/fstab` (text `fstab`) that holds `abs` (a canonical path) but is not
/// mounted (`/proc/self/mountinfo` text `mounted`), if any; the deepest such entry.
fn unmounted_mount_point(abs: &Path, fstab: &str, mounted: &str) -> Option<PathBuf> {
    // Both files write a space in a path as \040.
    let unescape = |s: &str| PathBuf::from(s.replace("\\040", " ").replace("\\011", "\t"));
    let is_mounted: Vec<PathBuf> = mounted.lines().filter_map(|l| l.split_whitespace().nth(4)).map(unescape).collect();
    fstab
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_whitespace().nth(1))
        .filter(|m| m.starts_with('/'))
        .map(unescape)
        .filter(|m| abs.starts_with(m) && !is_mounted.contains(m))
        .max_by_key(|m| m.components().count())
}

pub fn run(a: PlaceArgs) -> Result<()> {
    let model = load::model_dir(&a.model, a.demo)?;
    if crate::hub::stream::StreamInstall::load(&model)?.is_some() {
        bail!(
            "{} is a stream install: its shards hold no routed experts to place (streamed experts are kept on the install's drives)",
            model.display()
        );
    }
    let opened = load::open(&model)?;
    if a.verify {
        return verify(&model, &opened);
    }
    if a.drives.is_empty() {
        bail!("give at least one --drive PATH[=GBPS]");
    }
    let drives: Vec<(PathBuf, Option<f64>)> = a.drives.iter().map(|d| parse_drive(d)).collect::<Result<_>>()?;
    check_drives(&drives)?;
    let trace = match (&a.trace, a.policy) {
        (Some(t), _) => Some(RouteTrace::load(t)?),
        (None, Policy::Hot) => bail!("--policy hot needs --trace ROUTES (record one with `run --trace-routes FILE`)"),
        (None, _) => None,
    };
    opened.roster.expert_layout.as_ref().context("the model has no routed experts to place")?;
    let experts = opened.expert_bytes_total();
    let probe_size = a.probe_mb.map_or_else(|| experts.clamp(2 * probe::PROBE_READ, 512 << 20), |m| m << 20);
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
                format!(" (no {} on this file system)", crate::store::io::reader::UNCACHED)
            }
        );
        Ok(c.gbps)
    };
    let opened_ref = &opened;
    let measure_shards = |qd: usize| -> Result<f64, PlacementError> {
        let (ranges, len) = placement::shard_read_ranges(&opened_ref.ck, &opened_ref.roster);
        let c = probe::measure_ranges(&ranges, len, qd, reader, time)
            .map_err(|e| PlacementError::Other(format!("measuring the shards: {e}")))?;
        eprintln!("deltafin place: shards in {}: {:.2} GB/s", model.display(), c.gbps);
        Ok(c.gbps)
    };
    let pb = std::cell::RefCell::new(Progress::new(progress::mode(false), "writing packs"));
    let progress = |done: u64, total: u64| pb.borrow_mut().bytes(done, total);
    let o = PlaceOptions {
        model_dir: &model,
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
    pb.borrow().finish();
    summarize(&m, &model.join(MANIFEST));
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

fn verify(model: &Path, opened: &load::Opened) -> Result<()> {
    let path = model.join(MANIFEST);
    let m = Manifest::load(&path)?;
    m.check_model(&opened.ck, &opened.roster)?;
    let pb = std::cell::RefCell::new(Progress::new(progress::mode(false), "verifying"));
    let problems = placement::verify(&m, &opened.ck, &opened.roster, &|d, t| pb.borrow_mut().bytes(d, t));
    pb.borrow().finish();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_drive_under_an_unmounted_fstab_entry_is_found() {
        let fstab = "# comment\nUUID=1 / ext4 defaults 0 1\nUUID=2 /mnt/nvme1 ext4 nofail 0 2\n/dev/sdb1 /mnt/my\\040disk xfs 0 0\nnone swap swap 0 0\n";
        let mounted = "22 1 259:1 / / rw - ext4 /dev/a rw\n23 22 259:2 / /mnt/my\\040disk rw - xfs /dev/b rw\n";
        let find = |p: &str| unmounted_mount_point(Path::new(p), fstab, mounted);
        assert_eq!(find("/mnt/nvme1"), Some(PathBuf::from("/mnt/nvme1")));
        assert_eq!(find("/mnt/nvme1/packs"), Some(PathBuf::from("/mnt/nvme1")));
        assert_eq!(find("/mnt/my disk/packs"), None, "mounted");
        assert_eq!(find("/home/u/packs"), None, "on the root file system, which is mounted");
        assert_eq!(find("/mnt/nvme10"), None, "a path prefix is not a parent directory");
    }
}
