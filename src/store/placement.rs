//! Placement: which drives hold each expert. Decides a plan (spread / mirror / hot), writes the
//! expert pack files, records everything in `placement.json`, verifies it, and turns it into the
//! store's holder map.
//!
//! Contract: `placement.json` is written last and atomically, only after every pack file it names
//! is complete (fsynced and renamed); an interrupted `place` leaves either the previous manifest
//! or none, never one that points at incomplete data. A rerun resumes: the plan (with the measured
//! drive rates) is kept in `.placement-plan.json` and complete pack files that match it are
//! reused.

use super::expert_store::{DriveSpec, Holder, StoreSpec};
use super::pack::{self, PackHeader};
use crate::model::roster::{ExpertLayout, Roster};
use crate::model::{Checkpoint, K3Config};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub const MANIFEST: &str = "placement.json";
const PLAN: &str = ".placement-plan.json";

#[derive(Debug, thiserror::Error)]
pub enum PlacementError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{}: {msg}", path.display())]
    Invalid { path: PathBuf, msg: String },
    #[error(transparent)]
    Pack(#[from] pack::PackError),
    #[error("{0}")]
    Other(String),
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

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub version: u32,
    pub policy: Policy,
    pub shards: ShardUse,
    pub expert_bytes: u64,
    pub drives: Vec<ManifestDrive>,
    /// The model directory as a drive (its shards), with its measured ceiling.
    pub shard_drive: ManifestDrive,
    pub layers: Vec<ManifestLayer>,
}

/// The saved plan of an unfinished `place` run.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
struct Plan {
    policy: Policy,
    shards: ShardUse,
    drives: Vec<ManifestDrive>,
    shard_drive: ManifestDrive,
    /// [moe layer index in `layers`] -> [expert] -> drives.
    layers: Vec<usize>,
    assign: Vec<Vec<Vec<u16>>>,
    /// (drive, layer) packs this placement has completed (written and checksummed from the shards).
    #[serde(default)]
    done: Vec<(u16, usize)>,
}

impl Manifest {
    pub fn load(path: &Path) -> Result<Self, PlacementError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| PlacementError::Io { path: path.to_path_buf(), source })?;
        Self::parse(path, &text)
    }

    /// Parses and checks manifest text; `path` is only used in error messages.
    pub fn parse(path: &Path, text: &str) -> Result<Self, PlacementError> {
        let m: Manifest = serde_json::from_str(text)
            .map_err(|e| PlacementError::Invalid { path: path.to_path_buf(), msg: format!("malformed: {e}") })?;
        if m.version != 1 {
            return Err(PlacementError::Invalid {
                path: path.to_path_buf(),
                msg: format!("unsupported version {}", m.version),
            });
        }
        for l in &m.layers {
            for (e, x) in l.experts.iter().enumerate() {
                if let Some(&d) = x.drives.iter().find(|&&d| d as usize >= m.drives.len()) {
                    return Err(PlacementError::Invalid {
                        path: path.to_path_buf(),
                        msg: format!(
                            "expert {e} of layer {} names drive {d}, but only {} drives are listed",
                            l.layer,
                            m.drives.len()
                        ),
                    });
                }
                if u64::from_str_radix(&x.xxh3, 16).is_err() {
                    return Err(PlacementError::Invalid {
                        path: path.to_path_buf(),
                        msg: format!("expert {e} of layer {}: bad checksum", l.layer),
                    });
                }
            }
        }
        Ok(m)
    }
}

/// Route counts per (layer, expert), recorded by `run --trace-routes`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RouteTrace {
    pub version: u32,
    /// layer (as a string key) -> count per expert.
    pub layers: std::collections::BTreeMap<String, Vec<u64>>,
}

impl RouteTrace {
    pub fn load(path: &Path) -> Result<Self, PlacementError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| PlacementError::Io { path: path.to_path_buf(), source })?;
        serde_json::from_str(&text).map_err(|e| PlacementError::Invalid {
            path: path.to_path_buf(),
            msg: format!("malformed route trace: {e}"),
        })
    }

    pub fn counts(&self, layer: usize) -> Option<&Vec<u64>> {
        self.layers.get(&layer.to_string())
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
    let plan_path = o.model_dir.join(PLAN);
    let saved: Option<Plan> = std::fs::read_to_string(&plan_path).ok().and_then(|t| serde_json::from_str(&t).ok());
    let roots: Vec<PathBuf> = o.drives.iter().map(|(r, _)| canonical(r)).collect();
    let mut plan = match saved {
        Some(p)
            if p.policy == o.policy
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
                policy: o.policy,
                shards: o.shards,
                drives,
                shard_drive,
                layers: layers.clone(),
                assign,
                done: Vec::new(),
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
                layers.iter().filter_map(move |&l| std::fs::metadata(drives[d].root.join(pack::pack_name(l))).ok())
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
            let path = drive.root.join(pack::pack_name(l));
            // Reuse a complete pack only if this placement wrote it, or if every record matches the
            // shards' bytes (a pack left by another model of the same shape must not be trusted).
            if let Ok(h) = pack::read_header(&path)
                && h.layer as usize == l
                && h.expert_len == len
                && h.entries.iter().map(|e| e.expert).eq(ids.iter().copied())
                && (plan.done.contains(&(d as u16, l))
                    || h.entries.iter().all(|e| {
                        let loc = locs[e.expert as usize];
                        pack::checksum(ck.range(loc.shard, loc.start, loc.start + len)) == e.xxh3
                    }))
            {
                for e in &h.entries {
                    checksums.insert((l, e.expert), e.xxh3);
                }
                done += ids.len() as u64 * pack::align_up(len);
                (o.progress)(done, total);
                continue;
            }
            let bytes = ids.iter().map(|&e| {
                let loc = locs[e as usize];
                (e, ck.range(loc.shard, loc.start, loc.start + len))
            });
            let mut on_bytes = |n: u64| {
                done += pack::align_up(n);
                (o.progress)(done, total);
            };
            let h = pack::write_pack(&drive.root, l, len, bytes, &mut on_bytes)?;
            for e in &h.entries {
                checksums.insert((l, e.expert), e.xxh3);
            }
            plan.done.push((d as u16, l));
            let body = serde_json::to_vec(&plan).map_err(|e| PlacementError::Other(e.to_string()))?;
            crate::util::write_atomic(&plan_path, &body)
                .map_err(|source| PlacementError::Io { path: plan_path.clone(), source })?;
        }
    }
    let manifest = Manifest {
        version: 1,
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
    };
    let path = o.model_dir.join(MANIFEST);
    let body = serde_json::to_vec_pretty(&manifest).map_err(|e| PlacementError::Other(e.to_string()))?;
    crate::util::write_atomic(&path, &body).map_err(|source| PlacementError::Io { path: path.clone(), source })?;
    let _ = std::fs::remove_file(&plan_path);
    Ok(manifest)
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
    let total: u64 =
        manifest.layers.iter().map(|l| l.experts.iter().map(|e| e.drives.len() as u64 + 1).sum::<u64>()).sum::<u64>()
            * len;
    let mut done = 0u64;
    for ml in &manifest.layers {
        let want = |e: usize| u64::from_str_radix(&ml.experts[e].xxh3, 16).unwrap_or(0);
        // Shard holders.
        if let Some(Some(locs)) = roster.experts.get(ml.layer) {
            for (e, loc) in locs.iter().enumerate() {
                let got = pack::checksum(ck.range(loc.shard, loc.start, loc.start + len));
                if e < ml.experts.len() && got != want(e) {
                    problems.push(VerifyProblem {
                        drive: format!("shards ({})", ck.shard_path(loc.shard).display()),
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
            let path = drive.root.join(pack::pack_name(ml.layer));
            let name = format!("drive {d} ({})", drive.root.display());
            let fail = |problems: &mut Vec<VerifyProblem>, e: u32, msg: String| {
                problems.push(VerifyProblem { drive: name.clone(), layer: ml.layer, expert: e, msg })
            };
            let header: Result<PackHeader, _> = pack::read_header(&path);
            let h = match header {
                Ok(h) => h,
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
        .map(|loc| (ck.shard_path(loc.shard).to_path_buf(), super::reader::widen(loc.start, len).0))
        .collect();
    (ranges, super::reader::widen(0, len).1 + super::reader::DIRECT_ALIGN)
}

/// Holder map for experts read straight from the shipped shards (no placement).
pub fn shard_spec(ck: &Checkpoint, roster: &Roster, model_dir: &Path, qd: usize, gbps: f64) -> Option<StoreSpec> {
    let layout = roster.expert_layout.clone()?;
    let files: Vec<(u16, PathBuf)> = (0..ck.shards.len()).map(|s| (0u16, ck.shard_path(s).to_path_buf())).collect();
    let holders = roster
        .experts
        .iter()
        .map(|l| {
            l.as_ref().map(|locs| {
                locs.iter()
                    .map(|loc| vec![Holder { drive: 0, file: loc.shard as u32, offset: loc.start, tier: 0 }])
                    .collect()
            })
        })
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
            let path = drive.root.join(pack::pack_name(ml.layer));
            let h = match pack::read_header(&path) {
                Ok(h) => h,
                Err(e) => {
                    if drive.root.is_dir() {
                        eprintln!("deltafin: warning: drive {d}: {e}; its copies of layer {} are not used", ml.layer);
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
                        per[e].push(Holder { drive: d as u16, file, offset: x.offset, tier: 0 })
                    }
                    _ => eprintln!(
                        "deltafin: warning: drive {d}: {} does not hold expert {e} as the manifest says; skipped",
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
            per[e].push(Holder { drive: shard_drive, file: loc.shard as u32, offset: loc.start, tier });
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
