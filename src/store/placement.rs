//! Placement: which drives hold each expert. Decides a plan (spread / mirror / hot), writes the
//! expert pack files, records everything in `placement.json`, verifies it, and turns it into the
//! store's holder map.
//!
//! Contract: `placement.json` is written last and atomically, only after every pack file it names
//! is complete (fsynced and renamed); an interrupted `place` leaves either the previous manifest
//! or none, never one that points at incomplete data. A rerun resumes: the plan (with the measured
//! drive rates) is kept in `.placement-plan.json`, and a pack file on a drive is reused only when
//! its header names this model and every record's bytes hash to the shards' checksum (so a
//! flipped byte is rewritten, and another model's pack is never trusted).
//!
//! Identity: a placement belongs to one model. Packs live in `DRIVE/<fingerprint prefix>/`, so
//! models placed on one drive do not overwrite each other; packs, the manifest and route traces
//! carry the model fingerprint (`model::fingerprint`), and `manifest_spec` refuses a manifest of
//! another model. One `place` at a time per model directory and per drive directory (a lock file).

use super::expert_store::{DriveSpec, Holder, StoreSpec};
use super::pack::{self, PackHeader};
use crate::model::fingerprint;
use crate::model::roster::{ExpertLayout, Roster};
use crate::model::{Checkpoint, K3Config};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub const MANIFEST: &str = "placement.json";

/// The placement manifest a run uses: the one given, else `MODEL/placement.json` when it exists.
pub fn manifest_path(given: Option<&Path>, model_dir: &Path) -> Option<PathBuf> {
    given.map(Path::to_path_buf).or_else(|| Some(model_dir.join(MANIFEST)).filter(|p| p.exists()))
}
pub const VERSION: u32 = 2;
const PLAN: &str = ".placement-plan.json";
/// Lock file, in the model directory and in each drive's model directory, held while placing.
pub const LOCK: &str = ".place.lock";

#[derive(Debug, thiserror::Error)]
pub enum PlacementError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{}: {msg}", path.display())]
    Invalid { path: PathBuf, msg: String },
    #[error(transparent)]
    Pack(#[from] pack::PackError),
    #[error("{0}")]
    OtherModel(Box<OtherModel>),
    #[error("{}: another `deltafin place` is running here (it holds this lock); wait for it to finish", path.display())]
    Locked { path: PathBuf },
    #[error("{0}")]
    Other(String),
}

/// A placement, pack or route trace of another model than the one at hand.
#[derive(Debug, thiserror::Error)]
#[error(
    "{} belongs to another model: {what} model {}, but {} is model {}; {fix}",
    path.display(), fingerprint::short(theirs), dir.display(), fingerprint::short(ours)
)]
pub struct OtherModel {
    pub path: PathBuf,
    /// How the file names its model, e.g. "it was placed for".
    pub what: String,
    pub theirs: String,
    pub ours: String,
    pub dir: PathBuf,
    /// What to do about it.
    pub fix: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    /// Each expert on one drive; bytes per drive proportional to its speed.
    Spread,
    /// A full copy on every drive.
    Mirror,
    /// The most-routed experts (from a route trace) on the fastest drive, the rest spread.
    Hot,
}

/// How the shipped shards serve as holders besides the pack files.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ShardUse {
    /// Only when every pack holder of an expert has failed.
    Fallback,
    /// As an equal holder (the model directory counts as one more drive).
    Use,
    /// Never.
    Off,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ManifestDrive {
    pub root: PathBuf,
    /// Read ceiling in GB/s.
    pub gbps: f64,
    /// Queue depth the store uses on this drive.
    pub qd: usize,
    /// True when measured by `place`, false when given on the command line.
    pub measured: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ManifestExpert {
    /// Indices into `drives`.
    pub drives: Vec<u16>,
    /// xxh3-64 of the expert's bytes, hex.
    pub xxh3: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ManifestLayer {
    pub layer: usize,
    pub experts: Vec<ManifestExpert>,
}

/// The model a placement belongs to.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ManifestModel {
    /// `model::fingerprint` of the checkpoint (64 hex digits).
    pub fingerprint: String,
    /// `fingerprint::experts_digest` of the experts' checksums listed in `layers`.
    pub experts_sha256: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub version: u32,
    pub model: ManifestModel,
    /// Directory under each drive root holding this model's packs (the fingerprint's prefix).
    pub namespace: String,
    pub policy: Policy,
    pub shards: ShardUse,
    pub expert_bytes: u64,
    pub drives: Vec<ManifestDrive>,
    /// The model directory as a drive (its shards), with its measured ceiling.
    pub shard_drive: ManifestDrive,
    pub layers: Vec<ManifestLayer>,
    /// Where it was loaded from (for messages); not stored.
    #[serde(skip)]
    pub path: PathBuf,
}

/// The saved plan of an unfinished `place` run.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
struct Plan {
    /// The model's fingerprint: a plan made for another model (the directory was rewritten) is
    /// discarded.
    model: String,
    policy: Policy,
    shards: ShardUse,
    drives: Vec<ManifestDrive>,
    shard_drive: ManifestDrive,
    /// [moe layer index in `layers`] -> [expert] -> drives.
    layers: Vec<usize>,
    assign: Vec<Vec<Vec<u16>>>,
}

impl Manifest {
    pub fn load(path: &Path) -> Result<Self, PlacementError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| PlacementError::Io { path: path.to_path_buf(), source })?;
        Self::parse(path, &text)
    }

    /// Parses and checks manifest text; `path` is where it came from (for messages and `path`).
    pub fn parse(path: &Path, text: &str) -> Result<Self, PlacementError> {
        let invalid = |msg: String| PlacementError::Invalid { path: path.to_path_buf(), msg };
        // The version first, so an old manifest gets "re-run place" rather than a missing field.
        let raw: serde_json::Value = serde_json::from_str(text).map_err(|e| invalid(format!("malformed: {e}")))?;
        match raw.get("version").and_then(serde_json::Value::as_u64) {
            Some(v) if v == u64::from(VERSION) => {}
            Some(1) => {
                return Err(invalid(
                    "written by an older deltafin (version 1, without the model fingerprint); re-run `deltafin place` for this model".into(),
                ));
            }
            Some(v) => return Err(invalid(format!("unsupported version {v} (this deltafin reads version {VERSION})"))),
            None => return Err(invalid("no version field".into())),
        }
        let mut m: Manifest = serde_json::from_value(raw).map_err(|e| invalid(format!("malformed: {e}")))?;
        m.path = path.to_path_buf();
        if !fingerprint::is_valid(&m.model.fingerprint) || !fingerprint::is_valid(&m.model.experts_sha256) {
            return Err(invalid("model.fingerprint and model.experts_sha256 must be 64 hex digits".into()));
        }
        // The namespace names a directory under each drive: never a path that leaves it.
        if m.namespace != fingerprint::short(&m.model.fingerprint) {
            return Err(invalid(format!(
                "namespace `{}` is not the fingerprint's prefix `{}`",
                m.namespace,
                fingerprint::short(&m.model.fingerprint)
            )));
        }
        for (d, drive) in m.drives.iter().chain(std::iter::once(&m.shard_drive)).enumerate() {
            if !(1..=super::reader::MAX_QD).contains(&drive.qd) {
                return Err(invalid(format!("drive {d}: qd {} is outside 1..={}", drive.qd, super::reader::MAX_QD)));
            }
            if !(drive.gbps.is_finite() && drive.gbps >= 0.0) {
                return Err(invalid(format!("drive {d}: gbps {} is not a speed", drive.gbps)));
            }
        }
        for l in &m.layers {
            for (e, x) in l.experts.iter().enumerate() {
                if let Some(&d) = x.drives.iter().find(|&&d| d as usize >= m.drives.len()) {
                    return Err(invalid(format!(
                        "expert {e} of layer {} names drive {d}, but only {} drives are listed",
                        l.layer,
                        m.drives.len()
                    )));
                }
                if u64::from_str_radix(&x.xxh3, 16).is_err() {
                    return Err(invalid(format!("expert {e} of layer {}: bad checksum", l.layer)));
                }
            }
        }
        if m.experts_digest() != m.model.experts_sha256 {
            return Err(invalid("the expert checksums do not match model.experts_sha256 (edited or damaged)".into()));
        }
        Ok(m)
    }

    /// `fingerprint::experts_digest` of the checksums this manifest lists.
    pub fn experts_digest(&self) -> String {
        fingerprint::experts_digest(self.layers.iter().flat_map(|l| {
            l.experts
                .iter()
                .enumerate()
                .map(|(e, x)| (l.layer, e as u32, u64::from_str_radix(&x.xxh3, 16).unwrap_or(0)))
        }))
    }

    /// Where drive `d` keeps the pack of `layer`.
    pub fn pack_path(&self, d: usize, layer: usize) -> PathBuf {
        self.drives[d].root.join(&self.namespace).join(pack::pack_name(layer))
    }

    /// Refuses this manifest unless it belongs to the model in `ck`: the fingerprints must be equal,
    /// and a few experts' checksums are re-computed from the shards (a cheap tie between the
    /// manifest's checksums and this model's bytes; `place --verify` checks them all).
    pub fn check_model(&self, ck: &Checkpoint, roster: &Roster) -> Result<(), PlacementError> {
        let ours = fingerprint::fingerprint(ck);
        let other = |what: &str| {
            PlacementError::OtherModel(Box::new(OtherModel {
                path: self.path.clone(),
                what: what.into(),
                theirs: self.model.fingerprint.clone(),
                ours: ours.clone(),
                dir: ck.dir.clone(),
                fix: format!("re-run `deltafin place --model {}`, or pass this model's --placement", ck.dir.display()),
            }))
        };
        if self.model.fingerprint != ours {
            return Err(other("it was placed for"));
        }
        let model_len = roster.expert_layout.as_ref().map_or(0, |l| l.len as u64);
        if self.expert_bytes != model_len {
            return Err(PlacementError::Invalid {
                path: self.path.clone(),
                msg: format!(
                    "its experts are {} bytes, this model's {model_len}; re-run `deltafin place --model {}`",
                    self.expert_bytes,
                    ck.dir.display()
                ),
            });
        }
        // First expert of the first MoE layer, last of the last: two reads, far apart.
        let first = self.layers.first().map(|ml| (ml, 0));
        let last = self.layers.last().map(|ml| (ml, ml.experts.len().saturating_sub(1)));
        for (ml, e) in first.into_iter().chain(last) {
            let Some(loc) = roster.experts.get(ml.layer).and_then(|x| x.as_ref()).and_then(|l| l.get(e)) else {
                continue;
            };
            let Some(x) = ml.experts.get(e) else { continue };
            let got = pack::checksum(&loc.bytes(ck));
            if u64::from_str_radix(&x.xxh3, 16).ok() != Some(got) {
                // Same fingerprint, other bytes: edited, or a model the fingerprint's samples missed.
                return Err(PlacementError::Invalid {
                    path: self.path.clone(),
                    msg: format!(
                        "its checksum of expert {e} of layer {} ({}) is not the shards' ({got:016x}), so it is not this model's placement; re-run `deltafin place --model {}`",
                        ml.layer,
                        x.xxh3,
                        ck.dir.display()
                    ),
                });
            }
        }
        Ok(())
    }
}

/// Route counts per (layer, expert), recorded by `run --trace-routes`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RouteTrace {
    pub version: u32,
    /// Fingerprint of the model the routes were recorded on (absent in traces of older versions).
    #[serde(default)]
    pub model: Option<String>,
    /// layer (as a string key) -> count per expert.
    pub layers: std::collections::BTreeMap<String, Vec<u64>>,
    /// Where it was loaded from (for messages); not stored.
    #[serde(skip)]
    pub path: PathBuf,
}

impl RouteTrace {
    pub fn load(path: &Path) -> Result<Self, PlacementError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| PlacementError::Io { path: path.to_path_buf(), source })?;
        let mut t: RouteTrace = serde_json::from_str(&text).map_err(|e| PlacementError::Invalid {
            path: path.to_path_buf(),
            msg: format!("malformed route trace: {e}"),
        })?;
        t.path = path.to_path_buf();
        Ok(t)
    }

    pub fn counts(&self, layer: usize) -> Option<&Vec<u64>> {
        self.layers.get(&layer.to_string())
    }

    /// This trace, marked as recorded on the model in `ck`.
    pub fn for_model(mut self, ck: &Checkpoint) -> Self {
        self.version = 2;
        self.model = Some(fingerprint::fingerprint(ck));
        self
    }

    /// Refuses a trace recorded on another model (or on an unknown one).
    pub fn check_model(&self, ours: &str, dir: &Path) -> Result<(), PlacementError> {
        match &self.model {
            Some(theirs) if theirs == ours => Ok(()),
            Some(theirs) => Err(PlacementError::OtherModel(Box::new(OtherModel {
                path: self.path.clone(),
                what: "the routes were recorded on".into(),
                theirs: theirs.clone(),
                ours: ours.into(),
                dir: dir.to_path_buf(),
                fix: format!(
                    "record a trace on this model with `deltafin run --model {} --trace-routes FILE`",
                    dir.display()
                ),
            }))),
            None => Err(PlacementError::Invalid {
                path: self.path.clone(),
                msg: format!(
                    "this route trace does not say which model it was recorded on (an older deltafin wrote it); record it again with `deltafin run --model {} --trace-routes FILE`",
                    dir.display()
                ),
            }),
        }
    }
}

/// Which drives hold each expert of each MoE layer.
pub fn plan_assignment(
    policy: Policy,
    rates: &[f64],
    layers: &[usize],
    experts: usize,
    trace: Option<&RouteTrace>,
) -> Vec<Vec<Vec<u16>>> {
    let n = rates.len();
    let spread = |ids: &[usize], drives: &[usize], out: &mut Vec<Vec<u16>>| {
        let mut load = vec![0f64; n];
        for &e in ids {
            let d = *drives
                .iter()
                .min_by(|&&a, &&b| {
                    ((load[a] + 1.0) / rates[a]).total_cmp(&((load[b] + 1.0) / rates[b])).then(a.cmp(&b))
                })
                .unwrap_or(&0);
            load[d] += 1.0;
            out[e] = vec![d as u16];
        }
    };
    let all: Vec<usize> = (0..n).collect();
    layers
        .iter()
        .map(|&l| {
            let mut out = vec![Vec::new(); experts];
            match policy {
                Policy::Mirror => out.iter_mut().for_each(|v| *v = (0..n as u16).collect()),
                Policy::Spread => spread(&(0..experts).collect::<Vec<_>>(), &all, &mut out),
                Policy::Hot => {
                    let counts = trace.and_then(|t| t.counts(l));
                    let mut order: Vec<usize> = (0..experts).collect();
                    order.sort_by_key(|&e| (std::cmp::Reverse(counts.and_then(|c| c.get(e)).copied().unwrap_or(0)), e));
                    let fastest = (0..n).max_by(|&a, &b| rates[a].total_cmp(&rates[b]).then(b.cmp(&a))).unwrap_or(0);
                    let share = if n == 1 {
                        experts
                    } else {
                        ((rates[fastest] / rates.iter().sum::<f64>()) * experts as f64).round() as usize
                    };
                    for &e in &order[..share.min(experts)] {
                        out[e] = vec![fastest as u16];
                    }
                    let others: Vec<usize> = all.iter().copied().filter(|&d| d != fastest).collect();
                    let rest: Vec<usize> = order[share.min(experts)..].to_vec();
                    let mut rest_sorted = rest.clone();
                    rest_sorted.sort_unstable();
                    spread(&rest_sorted, if others.is_empty() { &all } else { &others }, &mut out);
                }
            }
            out
        })
        .collect()
}

/// Options of a `place` run.
pub struct PlaceOptions<'a> {
    pub model_dir: &'a Path,
    /// (root, given GB/s) per drive.
    pub drives: Vec<(PathBuf, Option<f64>)>,
    pub policy: Policy,
    pub shards: ShardUse,
    pub trace: Option<RouteTrace>,
    pub qd: usize,
    /// Measures a drive's ceiling (root, qd) -> GB/s.
    pub measure: &'a dyn Fn(&Path, usize) -> Result<f64, PlacementError>,
    /// Measures the shard drive from its own data.
    pub measure_shards: &'a dyn Fn(usize) -> Result<f64, PlacementError>,
    /// Progress: (bytes done, bytes total).
    pub progress: &'a dyn Fn(u64, u64),
}

/// Runs (or resumes) a placement and writes `placement.json`.
pub fn place(c: &K3Config, ck: &Checkpoint, roster: &Roster, o: &PlaceOptions) -> Result<Manifest, PlacementError> {
    let layout = roster
        .expert_layout
        .clone()
        .ok_or_else(|| PlacementError::Other("the model has no routed experts to place".into()))?;
    let layers: Vec<usize> = (0..c.layers).filter(|&l| roster.experts[l].is_some()).collect();
    for (root, _) in &o.drives {
        std::fs::create_dir_all(root).map_err(|source| PlacementError::Io { path: root.clone(), source })?;
    }
    // The same directory twice would have two "drives" overwrite each other's pack files.
    let canon: Vec<PathBuf> = o.drives.iter().map(|(r, _)| canonical(r)).collect();
    for (i, a) in canon.iter().enumerate() {
        if canon[..i].contains(a) {
            return Err(PlacementError::Other(format!(
                "drive {} is given twice (each --drive must be its own directory)",
                a.display()
            )));
        }
        if canonical(o.model_dir) == *a {
            return Err(PlacementError::Other(format!(
                "drive {} is the model directory itself; use a directory of its own",
                a.display()
            )));
        }
    }
    let fp = fingerprint::fingerprint(ck);
    let ns = fingerprint::short(&fp).to_string();
    let raw_fp = fingerprint::raw(&fp);
    if let Some(t) = &o.trace {
        t.check_model(&fp, o.model_dir)?;
    }
    // One place per model directory, and per model directory on each drive (two copies of one
    // model in different directories share the drive's namespace). Held until we return.
    let mut _locks = vec![take_lock(&o.model_dir.join(LOCK))?];
    for p in crate::util::remove_stale_temps(o.model_dir, &[".placement-plan.json.tmp.", ".placement.json.tmp."]) {
        eprintln!("deltafin place: removed {} (left by an interrupted place)", p.display());
    }
    for (root, _) in &o.drives {
        let dir = root.join(&ns);
        std::fs::create_dir_all(&dir).map_err(|source| PlacementError::Io { path: dir.clone(), source })?;
        _locks.push(take_lock(&dir.join(LOCK))?);
        remove_partials(&dir);
    }
    let plan_path = o.model_dir.join(PLAN);
    let saved: Option<Plan> = std::fs::read_to_string(&plan_path).ok().and_then(|t| serde_json::from_str(&t).ok());
    let roots: Vec<PathBuf> = o.drives.iter().map(|(r, _)| canonical(r)).collect();
    let plan = match saved {
        Some(p)
            if p.model == fp
                && p.policy == o.policy
                && p.shards == o.shards
                && p.layers == layers
                && p.drives.iter().map(|d| &d.root).eq(roots.iter())
                && p.drives.iter().all(|d| d.qd == o.qd)
                && p.drives
                    .iter()
                    .zip(&o.drives)
                    .all(|(d, (_, given))| given.is_none_or(|g| g == d.gbps && !d.measured)) =>
        {
            p
        }
        _ => {
            let mut drives = Vec::new();
            for ((_, given), root) in o.drives.iter().zip(&roots) {
                let (gbps, measured) = match given {
                    Some(g) => (*g, false),
                    None => ((o.measure)(root, o.qd)?, true),
                };
                drives.push(ManifestDrive { root: root.clone(), gbps, qd: o.qd, measured });
            }
            let shard_gbps = (o.measure_shards)(o.qd)?;
            let shard_drive =
                ManifestDrive { root: canonical(o.model_dir), gbps: shard_gbps, qd: o.qd, measured: true };
            let rates: Vec<f64> = drives.iter().map(|d| d.gbps).collect();
            let assign = plan_assignment(o.policy, &rates, &layers, c.experts, o.trace.as_ref());
            let p = Plan {
                model: fp.clone(),
                policy: o.policy,
                shards: o.shards,
                drives,
                shard_drive,
                layers: layers.clone(),
                assign,
            };
            let body = serde_json::to_vec_pretty(&p).map_err(|e| PlacementError::Other(e.to_string()))?;
            crate::util::write_atomic(&plan_path, &body)
                .map_err(|source| PlacementError::Io { path: plan_path.clone(), source })?;
            p
        }
    };

    // Room on every drive before writing anything.
    let len = layout.len as u64;
    let mut need = vec![0u64; plan.drives.len()];
    for per_layer in &plan.assign {
        let mut count = vec![0usize; plan.drives.len()];
        for ds in per_layer {
            for &d in ds {
                need[d as usize] += pack::align_up(len);
                count[d as usize] += 1;
            }
        }
        // Each pack file also has its header and index.
        for (d, &n) in count.iter().enumerate() {
            if n > 0 {
                need[d] += pack::align_up((64 + 32 * n) as u64);
            }
        }
    }
    // Drives on one file system share its free space.
    let mut by_fs: Vec<(u64, Vec<usize>)> = Vec::new();
    for (d, drive) in plan.drives.iter().enumerate() {
        use std::os::unix::fs::MetadataExt;
        let dev = std::fs::metadata(&drive.root)
            .map_err(|source| PlacementError::Io { path: drive.root.clone(), source })?
            .dev();
        match by_fs.iter_mut().find(|(x, _)| *x == dev) {
            Some((_, v)) => v.push(d),
            None => by_fs.push((dev, vec![d])),
        }
    }
    for (_, ds) in &by_fs {
        let root = &plan.drives[ds[0]].root;
        let have =
            super::probe::free_bytes(root).map_err(|source| PlacementError::Io { path: root.clone(), source })?;
        let drives = &plan.drives;
        let existing: u64 = ds
            .iter()
            .flat_map(|&d| {
                let dir = drives[d].root.join(&ns);
                layers.iter().filter_map(move |&l| std::fs::metadata(dir.join(pack::pack_name(l))).ok())
            })
            .map(|m| m.len())
            .sum();
        let needed: u64 = ds.iter().map(|&d| need[d]).sum();
        if needed > have + existing {
            let names: Vec<String> =
                ds.iter().map(|&d| format!("drive {d} ({})", plan.drives[d].root.display())).collect();
            return Err(PlacementError::Other(format!(
                "{} {} {} free but this placement needs {} there",
                names.join(" and "),
                if ds.len() > 1 { "share a file system with" } else { "has" },
                crate::util::human_bytes(have + existing),
                crate::util::human_bytes(needed)
            )));
        }
    }

    let total: u64 = need.iter().sum();
    let mut done = 0u64;
    let mut checksums: HashMap<(usize, u32), u64> = HashMap::new();
    for (li, &l) in plan.layers.iter().enumerate() {
        let locs =
            roster.experts[l].as_ref().ok_or_else(|| PlacementError::Other(format!("layer {l} has no experts")))?;
        for (d, drive) in plan.drives.iter().enumerate() {
            let ids: Vec<u32> =
                (0..c.experts as u32).filter(|&e| plan.assign[li][e as usize].contains(&(d as u16))).collect();
            if ids.is_empty() {
                continue;
            }
            let dir = drive.root.join(&ns);
            let path = dir.join(pack::pack_name(l));
            let mut shard_sum =
                |e: u32| *checksums.entry((l, e)).or_insert_with(|| pack::checksum(&locs[e as usize].bytes(ck)));
            // Reuse a complete pack only if it is this model's and every record's bytes (read back,
            // not just the recorded checksums) hash to the shards' checksum: a resumed run must not
            // trust a pack another run rewrote, and a flipped byte is repaired by rewriting.
            let header = pack::read_header(&path);
            if let Ok(h) = &header
                && h.model != raw_fp
            {
                eprintln!(
                    "deltafin place: {} belongs to model {}; rewriting it with this model's experts",
                    path.display(),
                    fingerprint::short(&fingerprint::hex(&h.model))
                );
            }
            if let Ok(h) = header
                && h.model == raw_fp
                && h.layer as usize == l
                && h.expert_len == len
                && h.entries.iter().map(|e| e.expert).eq(ids.iter().copied())
            {
                let bad = pack::bad_records(&path, &h).unwrap_or_else(|_| ids.clone());
                let stale: Vec<u32> = h
                    .entries
                    .iter()
                    .filter(|e| bad.contains(&e.expert) || e.xxh3 != shard_sum(e.expert))
                    .map(|e| e.expert)
                    .collect();
                if stale.is_empty() {
                    done += ids.len() as u64 * pack::align_up(len);
                    (o.progress)(done, total);
                    continue;
                }
                eprintln!(
                    "deltafin place: {}: {} record(s) differ from the shards (experts {}); rewriting it",
                    path.display(),
                    stale.len(),
                    stale.iter().take(8).map(|e| e.to_string()).collect::<Vec<_>>().join(", ")
                );
            }
            let bytes = ids.iter().map(|&e| (e, locs[e as usize].bytes(ck)));
            let mut on_bytes = |n: u64| {
                done += pack::align_up(n);
                (o.progress)(done, total);
            };
            let h = pack::write_pack(&dir, &raw_fp, l, len, bytes, &mut on_bytes)?;
            for e in &h.entries {
                checksums.insert((l, e.expert), e.xxh3);
            }
        }
    }
    // Every expert's checksum, from the shards (all are on some drive, but do not rely on it).
    for &l in &plan.layers {
        if let Some(locs) = roster.experts[l].as_ref() {
            for (e, loc) in locs.iter().enumerate() {
                checksums.entry((l, e as u32)).or_insert_with(|| pack::checksum(&loc.bytes(ck)));
            }
        }
    }
    let mut manifest = Manifest {
        version: VERSION,
        model: ManifestModel { fingerprint: fp.clone(), experts_sha256: String::new() },
        namespace: ns.clone(),
        policy: plan.policy,
        shards: plan.shards,
        expert_bytes: len,
        drives: plan.drives.clone(),
        shard_drive: plan.shard_drive.clone(),
        layers: plan
            .layers
            .iter()
            .enumerate()
            .map(|(li, &l)| ManifestLayer {
                layer: l,
                experts: (0..c.experts)
                    .map(|e| ManifestExpert {
                        drives: plan.assign[li][e].clone(),
                        xxh3: format!("{:016x}", checksums.get(&(l, e as u32)).copied().unwrap_or(0)),
                    })
                    .collect(),
            })
            .collect(),
        path: o.model_dir.join(MANIFEST),
    };
    manifest.model.experts_sha256 = manifest.experts_digest();
    let path = o.model_dir.join(MANIFEST);
    let body = serde_json::to_vec_pretty(&manifest).map_err(|e| PlacementError::Other(e.to_string()))?;
    crate::util::write_atomic(&path, &body).map_err(|source| PlacementError::Io { path: path.clone(), source })?;
    let _ = std::fs::remove_file(&plan_path);
    Ok(manifest)
}

/// Takes the exclusive lock on `path` (created if missing), or fails at once if someone holds it.
fn take_lock(path: &Path) -> Result<std::fs::File, PlacementError> {
    let io = |source| PlacementError::Io { path: path.to_path_buf(), source };
    let f = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(path).map_err(io)?;
    match f.try_lock() {
        Ok(()) => Ok(f),
        Err(std::fs::TryLockError::WouldBlock) => Err(PlacementError::Locked { path: path.to_path_buf() }),
        Err(std::fs::TryLockError::Error(e)) => Err(io(e)),
    }
}

/// Removes `*.pack.partial` files an interrupted `place` left in a drive's model directory (the
/// caller holds its lock, so no run is writing them). Only regular files: anything else is left
/// for `write_pack` to report.
fn remove_partials(dir: &Path) {
    let Ok(rd) = std::fs::read_dir(dir) else { return };
    for e in rd.flatten() {
        if e.file_name().to_string_lossy().ends_with(".pack.partial") && e.file_type().is_ok_and(|t| t.is_file()) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

fn canonical(p: &Path) -> PathBuf {
    std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf())
}

/// A problem found by `verify`.
#[derive(Clone, Debug)]
pub struct VerifyProblem {
    pub drive: String,
    pub layer: usize,
    pub expert: u32,
    pub msg: String,
}

/// Re-reads every holder in the manifest (pack records and shard ranges) and checks checksums.
pub fn verify(
    manifest: &Manifest,
    ck: &Checkpoint,
    roster: &Roster,
    progress: &dyn Fn(u64, u64),
) -> Vec<VerifyProblem> {
    let mut problems = Vec::new();
    let len = manifest.expert_bytes;
    // Shard ranges are cut with the manifest's length: it must be the model's (see check_model).
    if roster.expert_layout.as_ref().map(|l| l.len as u64) != Some(len) {
        problems.push(VerifyProblem {
            drive: "manifest".into(),
            layer: 0,
            expert: 0,
            msg: format!("expert_bytes {len} is not this model's expert size"),
        });
        return problems;
    }
    let total: u64 =
        manifest.layers.iter().map(|l| l.experts.iter().map(|e| e.drives.len() as u64 + 1).sum::<u64>()).sum::<u64>()
            * len;
    let mut done = 0u64;
    for ml in &manifest.layers {
        let want = |e: usize| u64::from_str_radix(&ml.experts[e].xxh3, 16).unwrap_or(0);
        // Shard holders.
        if let Some(Some(locs)) = roster.experts.get(ml.layer) {
            for (e, loc) in locs.iter().enumerate() {
                let got = pack::checksum(&loc.bytes(ck));
                if e < ml.experts.len() && got != want(e) {
                    problems.push(VerifyProblem {
                        drive: format!("shards ({})", ck.shard_path(loc.extents[0].shard).display()),
                        layer: ml.layer,
                        expert: e as u32,
                        msg: "checksum differs from the manifest".into(),
                    });
                }
                done += len;
                progress(done, total);
            }
        }
        for (d, drive) in manifest.drives.iter().enumerate() {
            let ids: Vec<u32> =
                (0..ml.experts.len() as u32).filter(|&e| ml.experts[e as usize].drives.contains(&(d as u16))).collect();
            if ids.is_empty() {
                continue;
            }
            let path = manifest.pack_path(d, ml.layer);
            let name = format!("drive {d} ({})", drive.root.display());
            let fail = |problems: &mut Vec<VerifyProblem>, e: u32, msg: String| {
                problems.push(VerifyProblem { drive: name.clone(), layer: ml.layer, expert: e, msg })
            };
            let header: Result<PackHeader, _> = pack::read_header(&path);
            let h = match header {
                Ok(h) if h.model == fingerprint::raw(&manifest.model.fingerprint) => h,
                Ok(h) => {
                    let msg = format!(
                        "{} belongs to model {}, not this placement's {}",
                        path.display(),
                        fingerprint::short(&fingerprint::hex(&h.model)),
                        fingerprint::short(&manifest.model.fingerprint)
                    );
                    for &e in &ids {
                        fail(&mut problems, e, msg.clone());
                    }
                    continue;
                }
                Err(err) => {
                    for &e in &ids {
                        fail(&mut problems, e, err.to_string());
                    }
                    continue;
                }
            };
            let data = match std::fs::File::open(&path) {
                Ok(f) => f,
                Err(err) => {
                    for &e in &ids {
                        fail(&mut problems, e, format!("{}: {err}", path.display()));
                    }
                    continue;
                }
            };
            let mut buf = vec![0u8; len as usize];
            for &e in &ids {
                let Some(entry) = h.entries.iter().find(|x| x.expert == e) else {
                    fail(&mut problems, e, format!("{} has no record for this expert", path.display()));
                    continue;
                };
                use std::os::unix::fs::FileExt;
                match data.read_exact_at(&mut buf, entry.offset) {
                    Ok(()) if pack::checksum(&buf) == want(e as usize) && entry.xxh3 == want(e as usize) => {}
                    Ok(()) => fail(&mut problems, e, format!("{}: checksum mismatch", path.display())),
                    Err(err) => fail(&mut problems, e, format!("{}: {err}", path.display())),
                }
                done += len;
                progress(done, total);
            }
        }
    }
    problems
}

/// Every routed expert's place in the shipped shards as an O_DIRECT read: (shard path, 4 KiB-aligned
/// offset), plus a read length that covers the widest widening. For measuring the shards' ceiling.
pub fn shard_read_ranges(ck: &Checkpoint, roster: &Roster) -> (Vec<(PathBuf, u64)>, u64) {
    let Some(layout) = &roster.expert_layout else { return (Vec::new(), 0) };
    let len = layout.len as u64;
    let ranges = roster
        .experts
        .iter()
        .flatten()
        .flatten()
        .map(|loc| {
            (ck.shard_path(loc.extents[0].shard).to_path_buf(), super::reader::widen(loc.extents[0].start, len).0)
        })
        .collect();
    (ranges, super::reader::widen(0, len).1 + super::reader::DIRECT_ALIGN)
}

/// The shards as a holder of one expert (file index = shard index): one range, or its pieces.
fn shard_holder(loc: &crate::model::roster::ExpertLoc, drive: u16, tier: u8) -> Holder {
    let first = loc.extents[0];
    let mut h = Holder::whole(drive, first.shard as u32, first.start, tier);
    if loc.extents.len() > 1 {
        h.extents = Some(
            loc.extents
                .iter()
                .map(|x| super::expert_store::HolderExtent {
                    file: x.shard as u32,
                    offset: x.start,
                    len: x.len,
                    dest: x.dest,
                })
                .collect(),
        );
    }
    h
}

/// Holder map for experts read straight from the shipped shards (no placement).
pub fn shard_spec(ck: &Checkpoint, roster: &Roster, model_dir: &Path, qd: usize, gbps: f64) -> Option<StoreSpec> {
    let layout = roster.expert_layout.clone()?;
    let files: Vec<(u16, PathBuf)> = (0..ck.shards.len()).map(|s| (0u16, ck.shard_path(s).to_path_buf())).collect();
    let holders = roster
        .experts
        .iter()
        .map(|l| l.as_ref().map(|locs| locs.iter().map(|loc| vec![shard_holder(loc, 0, 0)]).collect()))
        .collect();
    Some(StoreSpec {
        layout,
        drives: vec![DriveSpec { root: model_dir.to_path_buf(), gbps, qd }],
        files,
        holders,
        checksums: None,
    })
}

/// Holder map from a placement manifest: pack holders (validated against their headers) plus the
/// shards as the manifest says. Pack files that cannot be read are reported and skipped.
pub fn manifest_spec(
    m: &Manifest,
    ck: &Checkpoint,
    roster: &Roster,
    layout: ExpertLayout,
) -> Result<StoreSpec, PlacementError> {
    m.check_model(ck, roster)?;
    let raw_fp = fingerprint::raw(&m.model.fingerprint);
    let nd = m.drives.len();
    let shard_drive = nd as u16;
    let mut drives: Vec<DriveSpec> =
        m.drives.iter().map(|d| DriveSpec { root: d.root.clone(), gbps: d.gbps, qd: d.qd }).collect();
    drives.push(DriveSpec { root: m.shard_drive.root.clone(), gbps: m.shard_drive.gbps, qd: m.shard_drive.qd });
    let mut files: Vec<(u16, PathBuf)> =
        (0..ck.shards.len()).map(|s| (shard_drive, ck.shard_path(s).to_path_buf())).collect();
    let n_layers = roster.experts.len();
    let mut holders: Vec<Option<Vec<Vec<Holder>>>> = vec![None; n_layers];
    let mut sums: Vec<Option<Vec<u64>>> = vec![None; n_layers];
    for ml in &m.layers {
        let locs = roster.experts.get(ml.layer).and_then(|x| x.as_ref()).ok_or_else(|| {
            PlacementError::Other(format!("{MANIFEST} lists layer {} which has no routed experts", ml.layer))
        })?;
        if ml.experts.len() != locs.len() {
            return Err(PlacementError::Other(format!(
                "{MANIFEST}: layer {} has {} experts, the model {}",
                ml.layer,
                ml.experts.len(),
                locs.len()
            )));
        }
        let mut per: Vec<Vec<Holder>> = vec![Vec::new(); locs.len()];
        for (d, drive) in m.drives.iter().enumerate() {
            let ids: Vec<usize> = (0..locs.len()).filter(|&e| ml.experts[e].drives.contains(&(d as u16))).collect();
            if ids.is_empty() {
                continue;
            }
            let path = m.pack_path(d, ml.layer);
            let h = match pack::read_header(&path) {
                Ok(h) if h.model == raw_fp => h,
                Ok(h) => {
                    tracing::warn!(
                        "drive {d}: {} belongs to model {}, not {}; its copies of layer {} are not used",
                        path.display(),
                        fingerprint::short(&fingerprint::hex(&h.model)),
                        fingerprint::short(&m.model.fingerprint),
                        ml.layer
                    );
                    continue;
                }
                Err(e) => {
                    if drive.root.is_dir() {
                        tracing::warn!("drive {d}: {e}; its copies of layer {} are not used", ml.layer);
                    }
                    continue;
                }
            };
            let file = files.len() as u32;
            files.push((d as u16, path.clone()));
            for e in ids {
                let want = u64::from_str_radix(&ml.experts[e].xxh3, 16).unwrap_or(0);
                match h.entries.iter().find(|x| x.expert as usize == e) {
                    Some(x) if x.xxh3 == want && x.length == m.expert_bytes => {
                        per[e].push(Holder::whole(d as u16, file, x.offset, 0))
                    }
                    _ => tracing::warn!(
                        "drive {d}: {} does not hold expert {e} as the manifest says; skipped",
                        path.display()
                    ),
                }
            }
        }
        for (e, loc) in locs.iter().enumerate() {
            let tier = match m.shards {
                ShardUse::Off => continue,
                ShardUse::Use => 0,
                ShardUse::Fallback => 1,
            };
            per[e].push(shard_holder(loc, shard_drive, tier));
        }
        sums[ml.layer] = Some(ml.experts.iter().map(|x| u64::from_str_radix(&x.xxh3, 16).unwrap_or(0)).collect());
        holders[ml.layer] = Some(per);
    }
    Ok(StoreSpec { layout, drives, files, holders, checksums: Some(sums) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_is_proportional_to_speed() {
        let a = plan_assignment(Policy::Spread, &[3.0, 1.0], &[1], 400, None);
        let on0 = a[0].iter().filter(|d| d == &&vec![0u16]).count();
        assert_eq!(on0, 300);
        assert!(a[0].iter().all(|d| d.len() == 1));
    }

    #[test]
    fn mirror_and_hot() {
        let m = plan_assignment(Policy::Mirror, &[1.0, 1.0, 1.0], &[1, 2], 8, None);
        assert!(m.iter().flatten().all(|d| d == &vec![0, 1, 2]));
        let mut t = RouteTrace::default();
        t.layers.insert("1".into(), vec![0, 9, 0, 7, 0, 0, 5, 0]);
        let h = plan_assignment(Policy::Hot, &[1.0, 3.0], &[1], 8, Some(&t));
        // Fastest drive (1) gets 3/4 of the experts, the hottest first.
        for e in [1, 3, 6] {
            assert_eq!(h[0][e], vec![1]);
        }
        assert_eq!(h[0].iter().filter(|d| d == &&vec![1u16]).count(), 6);
    }
}
