//! `bench io`: one expert set read through the expert store, and through fio replaying exactly the
//! same reads (same files, offsets, lengths, total queue depth, uncached: O_DIRECT with io_uring on
//! Linux, F_NOCACHE with posixaio on macOS) in the same run; the record holds both rates and their
//! ratio.
//!
//! Contract: [`io`] alternates the two sides `repeat` times so drift in the device (or the
//! host's cache) hits both alike, and reports the best and the median of each. The store reads
//! with no cache and no compute. fio missing or failing is not an error: the record then has no
//! fio rate, and [`IoOutcome::fio_error`] says why. On macOS the page cache is emptied first where
//! this process may; the record's `cold` is true only when every run's reads were cold
//! ([`super::cold`]: never on macOS unless the cache was purged), and `cold_note` says why not.

use super::BenchError;
use crate::model::ModelFiles;
use crate::store::ExpertSource;
use crate::store::expert_store::{ExpertStore, StoreOptions};
use crate::store::io::reader::ReaderKind;
use crate::store::placement::{Manifest, manifest_path, manifest_spec, shard_spec};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What `bench io` reads and how.
pub struct IoOptions {
    /// Placement manifest (default: MODEL/placement.json if present, else the shards).
    pub placement: Option<PathBuf>,
    /// Bytes of distinct experts to read, in GB (capped by the model's experts).
    pub gb: f64,
    /// Reads in flight per drive when there is no placement.
    pub qd: usize,
    pub reader: ReaderKind,
    /// The fio binary.
    pub fio: String,
    /// Runs of each side (alternating).
    pub repeat: usize,
    /// Label added to the record.
    pub label: Option<String>,
    /// The caller purged the page cache just before (macOS: `sudo purge`); see [`super::cold`].
    pub assume_purged: bool,
}

/// A `bench io` record, and why fio gave no rate when it did not.
pub struct IoOutcome {
    pub record: serde_json::Value,
    pub fio_error: Option<FioError>,
}

/// Why fio could not replay the reads.
#[derive(Debug, thiserror::Error)]
pub enum FioError {
    #[error("no reads to replay")]
    NoReads,
    #[error("fio's iolog format cannot name {} (it contains whitespace)", .0.display())]
    Whitespace(PathBuf),
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("cannot run `{fio}` (install fio, e.g. {FIO_INSTALL}): {source}")]
    Run { fio: String, source: std::io::Error },
    #[error("fio failed: {stderr}")]
    Failed { stderr: String },
    /// fio's output is not the JSON report expected (`problem` says what is missing).
    #[error("{problem}")]
    Output { problem: String },
}

/// Reads the expert set through the store and through fio (see the module contract).
pub fn io(files: &ModelFiles, o: &IoOptions) -> Result<IoOutcome, BenchError> {
    let model = &files.dir;
    let layout = files.roster.expert_layout.clone().ok_or_else(|| BenchError::NoRoutedExperts(model.clone()))?;
    let manifest_path = manifest_path(o.placement.as_deref(), model);
    let manifest = manifest_path.as_ref().map(|p| Manifest::load(p)).transpose()?;
    // The expert set: experts of every MoE layer in a fixed shuffled order, up to `gb`.
    let layers: Vec<usize> = (0..files.cfg.layers).filter(|&l| files.roster.experts[l].is_some()).collect();
    let mut all: Vec<(usize, u32)> =
        layers.iter().flat_map(|&l| (0..files.cfg.experts as u32).map(move |e| (l, e))).collect();
    let mut rng = crate::util::XorShift(0x9E37_79B9);
    for i in (1..all.len()).rev() {
        all.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let want = ((o.gb * 1e9) as u64 / layout.len as u64).max(1) as usize;
    all.truncate(want);
    let mut by_layer: std::collections::BTreeMap<usize, Vec<u32>> = Default::default();
    for &(l, e) in &all {
        by_layer.entry(l).or_default().push(e);
    }

    let make_spec = || -> Result<_, BenchError> {
        Ok(match &manifest {
            Some(m) => manifest_spec(m, &files.ck, &files.roster, layout.clone())?,
            None => shard_spec(&files.ck, &files.roster, model, o.qd, 1.0)
                .ok_or_else(|| BenchError::NoRoutedExperts(model.clone()))?,
        })
    };
    let (drives, qd_total) = match &manifest {
        Some(m) => (m.drives.len(), m.drives.iter().map(|d| d.qd).sum::<usize>()),
        None => (1, o.qd),
    };

    // Alternate ours and fio so drift in the device (or the host's cache) hits both alike.
    let mut ours: Vec<f64> = Vec::new();
    let mut theirs: Vec<f64> = Vec::new();
    let mut reader_name = String::new();
    let mut bytes_read = 0u64;
    let mut fio_error = None;
    // Linux's O_DIRECT reads are cold whatever the page cache holds: it is emptied only where
    // uncached reads can be served from it (macOS).
    let emptied = if super::cold::UNCACHED_READS_SERVE_CACHED_PAGES {
        super::cold::empty_page_cache(o.assume_purged)
    } else {
        super::cold::Emptied::No
    };
    let mut cold = true;
    let mut cold_note = None;
    for _ in 0..o.repeat.max(1) {
        // Ours: the store with no cache, reading every expert of the set once, no compute.
        let store = ExpertStore::open(
            make_spec()?,
            StoreOptions {
                cache_bytes: 0,
                reader: o.reader,
                prefetch_depth: 0,
                record_reads: true,
                heat: None,
                hedge: false,
                // Whole experts, as fio reads them.
                split_min: None,
                read_ahead_slots: 0,
            },
        )?;
        let t0 = Instant::now();
        for (&l, es) in &by_layer {
            store.fetch(l, es, &mut |_, _: crate::store::Landed<'_>| Ok(crate::store::Flow::Continue))?;
        }
        let secs = t0.elapsed().as_secs_f64();
        let r = store.report();
        bytes_read = r.expert_bytes_read.unwrap_or(0);
        ours.push(bytes_read as f64 / secs / 1e9);
        reader_name = r.drives.first().map(|d| d.reader.clone()).unwrap_or_default();
        let this_cold = super::cold::is_cold(emptied, &r.drives);
        cold &= this_cold;
        cold_note = cold_note.or_else(|| super::cold::warm_note(this_cold, emptied, &r.drives));
        let log = store.read_log();
        drop(store);
        // fio: replay the exact reads, same total queue depth.
        if fio_error.is_none() {
            match fio_replay(&o.fio, &log, qd_total) {
                Ok(g) => theirs.push(g),
                Err(e) => fio_error = Some(e),
            }
        }
    }
    let best = |v: &[f64]| v.iter().copied().fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x))));
    let ours_best = best(&ours).unwrap_or(0.0);
    let fio_gbps = best(&theirs);
    let record = crate::stats::bench_record(
        "io",
        serde_json::json!({
            "label": o.label,
            "model": model.display().to_string(),
            "placement": manifest_path.map(|p| p.display().to_string()),
            "drives": drives,
            "qd_total": qd_total,
            "reader": reader_name,
            "page_cache": emptied,
            "cold": cold,
            "cold_note": cold_note,
            "experts": all.len(),
            "expert_bytes": layout.len,
            "bytes_read": bytes_read,
            "deltafin_gbps": ours_best,
            "fio_gbps": fio_gbps,
            "deltafin_runs_gbps": ours,
            "fio_runs_gbps": theirs,
            "ratio_of_medians": median(&theirs).map(|f| median(&ours).unwrap_or(0.0) / f),
            "ratio": fio_gbps.map(|f| ours_best / f),
        }),
    );
    Ok(IoOutcome { record, fio_error })
}

/// How a user of this platform installs fio.
const FIO_INSTALL: &str = if cfg!(target_os = "macos") { "brew install fio" } else { "apt-get install fio" };

/// fio's engine for the replay: the one the store's reader matches on each platform.
const FIO_ENGINE: &str = if cfg!(target_os = "linux") { "io_uring" } else { "posixaio" };

/// Replays `reads` with fio (uncached, [`FIO_ENGINE`], `iodepth`); returns GB/s.
fn fio_replay(fio: &str, reads: &[(PathBuf, u64, u64)], iodepth: usize) -> Result<f64, FioError> {
    if reads.is_empty() {
        return Err(FioError::NoReads);
    }
    if let Some((p, _, _)) = reads.iter().find(|(p, _, _)| p.to_string_lossy().chars().any(char::is_whitespace)) {
        return Err(FioError::Whitespace(p.clone()));
    }
    let dir = std::env::temp_dir().join(format!("deltafin-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|source| FioError::Io { path: dir.clone(), source })?;
    let result = fio_run(fio, reads, iodepth, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn fio_run(fio: &str, reads: &[(PathBuf, u64, u64)], iodepth: usize, dir: &Path) -> Result<f64, FioError> {
    let log_path = dir.join("replay.iolog");
    write_iolog(&log_path, reads).map_err(|source| FioError::Io { path: log_path.clone(), source })?;
    let out = std::process::Command::new(fio)
        // --direct=1: O_DIRECT on Linux, F_NOCACHE on macOS (as the store opens its files).
        .args(["--name=replay", "--direct=1", "--output-format=json"])
        .arg(format!("--ioengine={FIO_ENGINE}"))
        .arg(format!("--read_iolog={}", log_path.display()))
        .arg(format!("--iodepth={iodepth}"))
        .output()
        .map_err(|source| FioError::Run { fio: fio.to_string(), source })?;
    if !out.status.success() {
        return Err(FioError::Failed { stderr: String::from_utf8_lossy(&out.stderr).into_owned() });
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let bad = |problem: &str| FioError::Output { problem: problem.to_string() };
    // fio may print notes before the JSON object.
    let json_start = text.find('{').ok_or_else(|| bad("fio printed no JSON"))?;
    let j: serde_json::Value = serde_json::from_str(&text[json_start..])
        .map_err(|e| FioError::Output { problem: format!("cannot parse fio's JSON: {e}") })?;
    let bw = j["jobs"][0]["read"]["bw_bytes"].as_f64().ok_or_else(|| bad("fio JSON has no read bandwidth"))?;
    Ok(bw / 1e9)
}

/// fio's iolog (version 2) of `reads`: every file added and opened, the reads in order, closed.
fn write_iolog(path: &Path, reads: &[(PathBuf, u64, u64)]) -> std::io::Result<()> {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    writeln!(f, "fio version 2 iolog")?;
    let mut files: Vec<&Path> = reads.iter().map(|(p, _, _)| p.as_path()).collect();
    files.sort();
    files.dedup();
    for p in &files {
        writeln!(f, "{} add", p.display())?;
        writeln!(f, "{} open", p.display())?;
    }
    for (p, off, len) in reads {
        writeln!(f, "{} read {off} {len}", p.display())?;
    }
    for p in &files {
        writeln!(f, "{} close", p.display())?;
    }
    f.flush()
}

fn median(v: &[f64]) -> Option<f64> {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    (!s.is_empty()).then(|| if s.len() % 2 == 1 { s[s.len() / 2] } else { (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0 })
}
