//! The disk ceiling a benchmark's bounds divide by, measured the way the engine reads: random
//! whole-expert O_DIRECT reads on the run's own expert holders at the store's total queue depth,
//! until the rate is stable.
//!
//! Contract: a [`CeilingProbe`] lists the holders once and measures as often as asked (a run
//! probes before its prompt, between prompt and decode, and after decode, since a shared or
//! bursting disk drifts over minutes); with zero seconds it measures nothing (`None`).

use super::BenchError;
use crate::model::ModelFiles;
use crate::store::io::reader::widen;
use crate::store::placement::Manifest;
use crate::store::probe;
use serde_json::{Value, json};
use std::path::PathBuf;
use std::time::Duration;

/// The read ceiling of the drives a run uses, measured on its expert holders (random whole-expert
/// O_DIRECT reads at the store's total queue depth); the holders are listed once for the three
/// probes of a run.
pub struct CeilingProbe {
    ranges: Vec<(PathBuf, u64)>,
    read_len: u64,
    qd: usize,
    secs: f64,
}

impl CeilingProbe {
    /// The holders of `files`' experts: the packs of `manifest` on `drives` (all when None), else
    /// the shards; `secs` of reads (at least) per probe, 0 for none.
    pub fn new(
        files: &ModelFiles,
        manifest: Option<&Manifest>,
        drives: Option<&[usize]>,
        qd: usize,
        secs: f64,
    ) -> Result<Self, BenchError> {
        if secs <= 0.0 {
            return Ok(CeilingProbe { ranges: Vec::new(), read_len: 0, qd, secs });
        }
        let layout =
            files.roster.expert_layout.clone().ok_or_else(|| BenchError::NoRoutedExperts(files.dir.clone()))?;
        let (ranges, read_len) = match manifest {
            Some(m) => {
                let mut ranges: Vec<(PathBuf, u64)> = Vec::new();
                for ml in &m.layers {
                    for d in 0..m.drives.len() {
                        if drives.is_some_and(|k| !k.contains(&d)) {
                            continue;
                        }
                        let path = m.pack_path(d, ml.layer);
                        if let Ok(h) = crate::store::pack::read_header(&path) {
                            ranges.extend(h.entries.iter().map(|e| (path.clone(), e.offset)));
                        }
                    }
                }
                (ranges, widen(0, layout.len as u64).1)
            }
            None => crate::store::placement::shard_read_ranges(&files.ck, &files.roster),
        };
        Ok(CeilingProbe { ranges, read_len, qd, secs })
    }

    /// One probe (None when probes are off).
    pub fn measure(&self) -> Result<Option<probe::Ceiling>, BenchError> {
        if self.secs <= 0.0 {
            return Ok(None);
        }
        Ok(Some(probe::measure_ranges(
            &self.ranges,
            self.read_len,
            self.qd,
            crate::store::io::reader::ReaderKind::Auto,
            Duration::from_secs_f64(self.secs),
        )?))
    }
}

/// A probe's result as a record shows it.
pub fn ceiling_json(c: &Option<probe::Ceiling>) -> Value {
    match c {
        Some(c) => json!({"gbps": c.gbps, "seconds": c.seconds, "stable": c.stable, "windows_gbps": c.windows}),
        None => Value::Null,
    }
}

/// The ceiling of a phase: the mean of the probes around it (either one alone when the other is
/// missing).
pub fn mean_gbps(a: &Option<probe::Ceiling>, b: &Option<probe::Ceiling>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some((a.gbps + b.gbps) / 2.0),
        (Some(c), None) | (None, Some(c)) => Some(c.gbps),
        (None, None) => None,
    }
}
