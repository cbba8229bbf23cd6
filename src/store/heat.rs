//! Route heat kept across runs: how often each routed expert was requested, decayed once per run,
//! in a small JSON file next to the placement (or in the user's cache directory). The store seeds
//! its eviction counts with it, so the experts this model routes to most stay cached from the first
//! token on instead of being read again and again until this run's counts catch up.
//!
//! Contract: heat only decides which experts stay cached — never an output bit. A missing file
//! starts from nothing; a malformed or mismatched one (other MoE layers or expert count) is ignored
//! with a warning naming the file and the problem, and replaced at the end of the run. The file is
//! written atomically (temp, fsync, rename). A path that is not a regular file (a device such as
//! `/dev/full`, a FIFO, a directory) is neither read nor replaced, with a warning; a file larger
//! than any heat of the model could be ([`max_bytes`]) is not read into memory.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

/// Weight of the earlier runs' heat against this run's counts when the file is rewritten.
pub const DECAY: f64 = 0.5;
/// The `format` of a heat file (what tells one from any other file).
pub const FORMAT: &str = "deltafin-expert-heat";

type Key = (u32, u32);

#[derive(Debug, thiserror::Error)]
pub enum HeatError {
    #[error("{}: {msg}", path.display())]
    Invalid { path: PathBuf, msg: String },
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
}

/// The heat of one model's experts: a decayed request count per (layer, expert).
#[derive(Clone, Debug)]
pub struct Heat {
    pub path: PathBuf,
    /// MoE layer ids and the expert count the file must describe.
    layers: Vec<u32>,
    experts: usize,
    /// Runs folded in so far.
    pub runs: u64,
    pub counts: HashMap<Key, f64>,
    /// The path may be written at the end of the run (it is a regular file, or none yet).
    keep: bool,
}

/// The largest heat file of a model with `layers` MoE layers of `experts` experts: at most 32
/// bytes a count (a decayed count with two decimals and its comma), plus room for the rest.
pub fn max_bytes(layers: usize, experts: usize) -> u64 {
    (layers as u64).saturating_mul(experts as u64).saturating_mul(32).saturating_add(1 << 20)
}

impl Heat {
    /// The heat at `path` for a model whose MoE layers are `layers` with `experts` experts each.
    /// Never fails: a missing file gives empty heat, a bad one empty heat and a warning.
    pub fn open(path: &Path, layers: &[u32], experts: usize) -> Heat {
        let empty = Heat {
            path: path.to_path_buf(),
            layers: layers.to_vec(),
            experts,
            runs: 0,
            counts: HashMap::new(),
            keep: true,
        };
        match Self::read(path, max_bytes(layers.len(), experts)) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => empty,
            Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => {
                tracing::warn!("{}: {e}: the expert heat is neither read nor kept", path.display());
                Heat { keep: false, ..empty }
            }
            Err(e) => {
                tracing::warn!("{}: {e}; starting the expert heat afresh", path.display());
                empty
            }
            Ok(bytes) => match Self::parse(&bytes, path, layers, experts) {
                Ok(h) => h,
                Err(e) => {
                    tracing::warn!("{e}; starting the expert heat afresh");
                    empty
                }
            },
        }
    }

    /// The bytes of the heat file at `path`: InvalidInput for a path that is not a regular file
    /// (links followed) and for a file over `max` bytes.
    fn read(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
        let m = std::fs::metadata(path)?;
        if !m.is_file() {
            let what = if m.is_dir() { "a directory" } else { "not a regular file (a device, FIFO or socket)" };
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("is {what}")));
        }
        let too_big = || {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("is over {max} bytes, more than this model's expert heat can be"),
            )
        };
        if m.len() > max {
            return Err(too_big());
        }
        // The file may grow between the look and the read: never more than `max`.
        let mut bytes = Vec::with_capacity(m.len() as usize);
        std::fs::File::open(path)?.take(max + 1).read_to_end(&mut bytes)?;
        if bytes.len() as u64 > max {
            return Err(too_big());
        }
        Ok(bytes)
    }

    fn parse(bytes: &[u8], path: &Path, layers: &[u32], experts: usize) -> Result<Heat, HeatError> {
        let bad = |msg: String| HeatError::Invalid { path: path.to_path_buf(), msg };
        let v: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| bad(format!("not JSON: {e}")))?;
        if v["format"] != FORMAT {
            return Err(bad(format!("expected \"format\": \"{FORMAT}\"")));
        }
        if v["experts"].as_u64() != Some(experts as u64) {
            return Err(bad(format!("describes {} experts per layer, the model has {experts}", v["experts"])));
        }
        let runs = v["runs"].as_u64().ok_or_else(|| bad("expected \"runs\": a count".into()))?;
        let map = v["layers"].as_object().ok_or_else(|| bad("expected \"layers\": an object".into()))?;
        let mut counts = HashMap::new();
        for (name, row) in map {
            let layer: u32 = name.parse().map_err(|_| bad(format!("layer key {name:?} is not a number")))?;
            if !layers.contains(&layer) {
                return Err(bad(format!("layer {layer} is not a MoE layer of this model")));
            }
            let row = row
                .as_array()
                .filter(|r| r.len() == experts)
                .ok_or_else(|| bad(format!("layer {layer}: expected an array of {experts} non-negative counts")))?;
            for (e, c) in row.iter().enumerate() {
                let c = c
                    .as_f64()
                    .filter(|c| c.is_finite() && *c >= 0.0)
                    .ok_or_else(|| bad(format!("layer {layer}, expert {e}: expected a non-negative count, got {c}")))?;
                if c > 0.0 {
                    counts.insert((layer, e as u32), c);
                }
            }
        }
        Ok(Heat { path: path.to_path_buf(), layers: layers.to_vec(), experts, runs, counts, keep: true })
    }

    /// Starting request counts for the store (rounded heat).
    pub fn seed(&self) -> HashMap<Key, u32> {
        self.counts.iter().map(|(&k, &c)| (k, c.round().min(u32::MAX as f64) as u32)).filter(|&(_, c)| c > 0).collect()
    }

    /// Folds one run in: `uses` are the store's counts at the end of the run (seeded with
    /// [`Heat::seed`]), so this run's own requests are `uses - seed`.
    pub fn fold(&mut self, uses: &HashMap<Key, u32>) {
        let seed = self.seed();
        let mut next: HashMap<Key, f64> = self.counts.iter().map(|(&k, &c)| (k, c * DECAY)).collect();
        for (&k, &u) in uses {
            let own = u.saturating_sub(seed.get(&k).copied().unwrap_or(0));
            if own > 0 && self.layers.contains(&k.0) && (k.1 as usize) < self.experts {
                *next.entry(k).or_insert(0.0) += own as f64;
            }
        }
        next.retain(|_, c| *c >= 0.01);
        self.counts = next;
        self.runs += 1;
    }

    /// Writes the heat atomically (creating the directory if needed); nothing where the path is
    /// not a regular file ([`Heat::open`] said so).
    pub fn save(&self) -> Result<(), HeatError> {
        if !self.keep {
            return Ok(());
        }
        let io = |source| HeatError::Io { path: self.path.clone(), source };
        let layers: serde_json::Map<String, serde_json::Value> = self
            .layers
            .iter()
            .map(|&l| {
                let row: Vec<f64> = (0..self.experts as u32)
                    .map(|e| self.counts.get(&(l, e)).map_or(0.0, |c| (c * 100.0).round() / 100.0))
                    .collect();
                (l.to_string(), serde_json::json!(row))
            })
            .collect();
        let body = serde_json::json!({
            "format": FORMAT,
            "version": 1,
            "decay": DECAY,
            "experts": self.experts,
            "runs": self.runs,
            "layers": layers,
        });
        if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let text = serde_json::to_vec(&body).map_err(|e| io(std::io::Error::other(e)))?;
        crate::util::write_atomic(&self.path, &text).map_err(io)
    }
}

/// Where the heat of a model lives when none is named: beside the placement manifest when there is
/// one (heat describes the experts that manifest places), else under deltafin's cache directory
/// (`util::cache_dir`), keyed by the model directory's canonical path.
pub fn default_path(model_dir: &Path, placement: Option<&Path>) -> PathBuf {
    if let Some(p) = placement {
        return p.parent().unwrap_or(Path::new(".")).join("expert-heat.json");
    }
    let canon = std::fs::canonicalize(model_dir).unwrap_or_else(|_| model_dir.to_path_buf());
    let key = xxhash_rust::xxh3::xxh3_64(canon.as_os_str().as_encoded_bytes());
    let name = canon.file_name().map_or("model".into(), |n| n.to_string_lossy().into_owned());
    crate::util::cache_dir().join("heat").join(format!("{name}-{key:016x}.json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heat_round_trips_and_decays() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.json");
        let mut h = Heat::open(&path, &[1, 2], 4);
        assert!(h.counts.is_empty());
        let mut uses = h.seed();
        *uses.entry((1, 3)).or_insert(0) += 8;
        *uses.entry((2, 0)).or_insert(0) += 2;
        h.fold(&uses);
        h.save().unwrap();
        let mut h2 = Heat::open(&path, &[1, 2], 4);
        assert_eq!(h2.runs, 1);
        assert_eq!(h2.counts.get(&(1, 3)), Some(&8.0));
        let mut uses = h2.seed();
        *uses.entry((1, 3)).or_insert(0) += 2;
        h2.fold(&uses);
        assert_eq!(h2.counts.get(&(1, 3)), Some(&(8.0 * DECAY + 2.0)));
        assert_eq!(h2.counts.get(&(2, 0)), Some(&(2.0 * DECAY)));
    }

    #[test]
    fn a_mismatched_or_malformed_file_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.json");
        let mut h = Heat::open(&path, &[1], 4);
        let mut uses = h.seed();
        uses.insert((1, 1), 5);
        h.fold(&uses);
        h.save().unwrap();
        assert!(Heat::open(&path, &[1], 8).counts.is_empty(), "other expert count");
        assert!(Heat::open(&path, &[2], 4).counts.is_empty(), "other layers");
        std::fs::write(&path, b"{\"format\": 3").unwrap();
        assert!(Heat::open(&path, &[1], 4).counts.is_empty(), "malformed");
        let e = Heat::parse(
            b"{\"format\":\"deltafin-expert-heat\",\"experts\":4,\"runs\":1,\"layers\":{\"1\":[1,2]}}",
            &path,
            &[1],
            4,
        )
        .unwrap_err();
        assert!(e.to_string().contains("layer 1: expected an array of 4"), "{e}");
    }

    #[test]
    fn special_files_and_oversized_files_are_neither_read_nor_replaced() {
        use std::os::unix::fs::FileTypeExt;
        // /dev/zero and /dev/full read zeros without end: refused by their kind, not read.
        for dev in ["/dev/full", "/dev/zero"] {
            let h = Heat::open(Path::new(dev), &[1], 4);
            assert!(h.counts.is_empty() && !h.keep, "{dev}");
            h.save().unwrap();
            assert!(std::fs::metadata(dev).unwrap().file_type().is_char_device(), "{dev} is still a device");
        }
        let dir = tempfile::tempdir().unwrap();
        assert!(!Heat::open(dir.path(), &[1], 4).keep, "a directory");
        // A link to a device is the device.
        let link = dir.path().join("to-full");
        std::os::unix::fs::symlink("/dev/full", &link).unwrap();
        assert!(!Heat::open(&link, &[1], 4).keep);
        // A file larger than this model's heat can be is not read (and not kept).
        let big = dir.path().join("big.json");
        std::fs::write(&big, vec![b' '; max_bytes(1, 4) as usize + 1]).unwrap();
        let h = Heat::open(&big, &[1], 4);
        assert!(h.counts.is_empty() && !h.keep);
        assert_eq!(std::fs::metadata(&big).unwrap().len(), max_bytes(1, 4) + 1, "left as it was");
    }
}
