//! `place`: runs (or resumes) a placement — measures the drives, writes each drive's pack files,
//! then `placement.json`.
//!
//! Contract: see the module above (`placement`): the manifest is written last and atomically,
//! after every pack it names is complete; a rerun resumes from the saved plan and reuses a pack
//! only when its header names this model and its records hash to the shards' checksums; one
//! `place` at a time per model directory and per drive directory. The shards are checked against
//! their recorded checksums first (recorded now for shards never seen): a damaged shard is never
//! copied into a pack, and a good pack record whose shard copy is damaged is kept.

use super::plan::{RouteTrace, plan_assignment};
use super::{
    LOCK, MANIFEST, Manifest, ManifestDrive, ManifestExpert, ManifestLayer, ManifestModel, PLAN, PlacementError,
    Policy, ShardUse, VERSION,
};
use crate::model::fingerprint;
use crate::model::roster::{ExpertLoc, Roster};
use crate::model::{Checkpoint, K3Config};
use crate::store::pack;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

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

/// Runs (or resumes) a placement and writes `placement.json`, in phases: `claim` (the drives
/// checked, the locks taken, an interrupted run's leftovers removed, the shards checked),
/// `resume_or_plan` (the saved plan, else the drives measured and a new plan saved), the room on
/// every drive, `Packing::write_packs` (each pack reused when intact, else written),
/// `fill_checksums`, then `write_manifest`.
pub fn place(c: &K3Config, ck: &Checkpoint, roster: &Roster, o: &PlaceOptions) -> Result<Manifest, PlacementError> {
    let layout =
        roster.expert_layout.clone().ok_or_else(|| PlacementError::NoRoutedExperts(o.model_dir.to_path_buf()))?;
    let layers: Vec<usize> = (0..c.layers).filter(|&l| roster.experts[l].is_some()).collect();
    // Its locks are held until we return.
    let claim = claim(ck, o)?;
    let plan_path = o.model_dir.join(PLAN);
    let plan = resume_or_plan(c, o, &claim.fp, &layers, &plan_path)?;

    // Room on every drive before writing anything.
    let len = layout.len as u64;
    let need = room_needed(&plan, len);
    check_room(&plan, &need, &claim.ns, &layers)?;

    let mut packing = Packing {
        ck,
        roster,
        o,
        ns: &claim.ns,
        raw_fp: &claim.raw_fp,
        experts: c.experts,
        len,
        total: need.iter().sum(),
        done: 0,
        checksums: HashMap::new(),
        damaged_shard: Vec::new(),
    };
    packing.write_packs(&plan)?;
    let Packing { mut checksums, damaged_shard, .. } = packing;
    fill_checksums(ck, roster, &plan, &mut checksums)?;
    if !damaged_shard.is_empty() {
        eprintln!(
            "deltafin place: warning: the shards' copies of {} expert(s) are damaged (e.g. expert {} of layer {}); the placement keeps its good copies; {} lists the damage",
            damaged_shard.len(),
            damaged_shard[0].1,
            damaged_shard[0].0,
            crate::setting::Action::Verify
        );
    }
    let manifest = write_manifest(c, o, &plan, &claim, len, &checksums)?;
    let _ = std::fs::remove_file(&plan_path);
    Ok(manifest)
}

/// What [`claim`] established: the model's identity and the locks a `place` holds while it runs.
struct Claim {
    fp: String,
    /// The model's namespace on the drives (its short fingerprint).
    ns: String,
    raw_fp: [u8; 32],
    _locks: Vec<std::fs::File>,
}

/// Phase 1: the drives created and checked to be distinct (and none the model directory), the
/// model fingerprinted (and the route trace checked against it), the locks taken, an interrupted
/// run's leftovers removed, the shards checked.
fn claim(ck: &Checkpoint, o: &PlaceOptions) -> Result<Claim, PlacementError> {
    for (root, _) in &o.drives {
        std::fs::create_dir_all(root).map_err(|source| PlacementError::Io { path: root.clone(), source })?;
    }
    // The same directory twice would have two "drives" overwrite each other's pack files.
    let canon: Vec<PathBuf> = o.drives.iter().map(|(r, _)| canonical(r)).collect();
    for (i, a) in canon.iter().enumerate() {
        if canon[..i].contains(a) {
            return Err(PlacementError::DriveTwice { drive: a.clone() });
        }
        if canonical(o.model_dir) == *a {
            return Err(PlacementError::DriveIsModel(a.clone()));
        }
    }
    let fp = fingerprint::fingerprint(ck);
    let ns = fingerprint::short(&fp).to_string();
    let raw_fp = fingerprint::raw(&fp);
    if let Some(t) = &o.trace {
        t.check_model(&fp, o.model_dir)?;
    }
    // One place per model directory, and per model directory on each drive (two copies of one
    // model in different directories share the drive's namespace). Held until `place` returns.
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
    check_shards(ck, o)?;
    Ok(Claim { fp, ns, raw_fp, _locks })
}

/// Phase 2: the plan saved at `plan_path` when it was made for this model, policy, shard use,
/// layers, drives and queue depth (and given rates), else the drives measured, the experts
/// assigned and the new plan saved there.
fn resume_or_plan(
    c: &K3Config,
    o: &PlaceOptions,
    fp: &str,
    layers: &[usize],
    plan_path: &Path,
) -> Result<Plan, PlacementError> {
    let saved: Option<Plan> = std::fs::read_to_string(plan_path).ok().and_then(|t| serde_json::from_str(&t).ok());
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
            let assign = plan_assignment(o.policy, &rates, layers, c.experts, o.trace.as_ref());
            let p = Plan {
                model: fp.to_string(),
                policy: o.policy,
                shards: o.shards,
                drives,
                shard_drive,
                layers: layers.to_vec(),
                assign,
            };
            let body = serde_json::to_vec_pretty(&p).map_err(|e| PlacementError::Other(e.to_string()))?;
            crate::util::write_atomic(plan_path, &body)
                .map_err(|source| PlacementError::Io { path: plan_path.to_path_buf(), source })?;
            p
        }
    };
    Ok(plan)
}

/// Phase 4's state: what the packs are written from, the progress, and each expert's checksum as
/// its pack holds it.
struct Packing<'a> {
    ck: &'a Checkpoint,
    roster: &'a Roster,
    o: &'a PlaceOptions<'a>,
    ns: &'a str,
    raw_fp: &'a [u8; 32],
    /// Experts per layer.
    experts: usize,
    /// Bytes of one expert.
    len: u64,
    /// Bytes to write in all (progress).
    total: u64,
    done: u64,
    checksums: HashMap<(usize, u32), u64>,
    /// Experts whose shard copy is damaged but that a good pack holds: kept, reported at the end.
    damaged_shard: Vec<(usize, u32)>,
}

impl Packing<'_> {
    /// Phase 4: each drive's pack of each layer of `plan`, reused when it is intact
    /// ([`Packing::check_pack`]), else written ([`Packing::rewrite_pack`]).
    fn write_packs(&mut self, plan: &Plan) -> Result<(), PlacementError> {
        for (li, &l) in plan.layers.iter().enumerate() {
            let roster = self.roster;
            let locs = roster.experts[l]
                .as_ref()
                .ok_or_else(|| PlacementError::NoRoutedExperts(self.o.model_dir.to_path_buf()))?;
            for (d, drive) in plan.drives.iter().enumerate() {
                let ids: Vec<u32> =
                    (0..self.experts as u32).filter(|&e| plan.assign[li][e as usize].contains(&(d as u16))).collect();
                if ids.is_empty() {
                    continue;
                }
                let dir = drive.root.join(self.ns);
                let path = dir.join(pack::pack_name(l));
                let Some(keep_from_pack) = self.check_pack(l, locs, &path, &ids)? else { continue };
                self.rewrite_pack(l, locs, &dir, &path, &ids, &keep_from_pack)?;
            }
        }
        Ok(())
    }

    /// The pack of layer `l` at `path`, meant to hold experts `ids`: None when it is complete and
    /// intact (its checksums taken, its bytes counted done), else the records to keep from it
    /// when it is rewritten (those whose shard copy is damaged).
    ///
    /// Reuse a complete pack only if it is this model's and every record's bytes (read back, not
    /// just the recorded checksums) hash to the shards' checksum: a resumed run must not trust a
    /// pack another run rewrote, and a flipped byte is repaired by rewriting. A record whose shard
    /// copy is damaged is kept when its own bytes are intact: a good pack is never rewritten from
    /// a bad shard.
    fn check_pack(
        &mut self,
        l: usize,
        locs: &[ExpertLoc],
        path: &Path,
        ids: &[u32],
    ) -> Result<Option<HashMap<u32, pack::PackEntry>>, PlacementError> {
        let ck = self.ck;
        let mut shard_sum =
            |e: u32| *self.checksums.entry((l, e)).or_insert_with(|| pack::checksum(&locs[e as usize].bytes(ck)));
        let bad_shard = |e: u32| super::shard_copy_damaged(ck, l, e as usize);
        let header = pack::read_header(path);
        if let Ok(h) = &header
            && h.model != *self.raw_fp
        {
            eprintln!(
                "deltafin place: {} belongs to model {}; rewriting it with this model's experts",
                path.display(),
                fingerprint::short(&fingerprint::hex(&h.model))
            );
        }
        let mut keep_from_pack: HashMap<u32, pack::PackEntry> = HashMap::new();
        if let Ok(h) = header
            && h.model == *self.raw_fp
            && h.layer as usize == l
            && h.expert_len == self.len
            && h.entries.iter().map(|e| e.expert).eq(ids.iter().copied())
        {
            let bad = pack::bad_records(path, &h).unwrap_or_else(|_| ids.to_vec());
            let mut stale: Vec<u32> = Vec::new();
            for x in &h.entries {
                if let Some(err) = bad_shard(x.expert) {
                    if bad.contains(&x.expert) {
                        return Err(no_good_copy(path, l, x.expert, err));
                    }
                    keep_from_pack.insert(x.expert, *x);
                    self.damaged_shard.push((l, x.expert));
                } else if bad.contains(&x.expert) || x.xxh3 != shard_sum(x.expert) {
                    stale.push(x.expert);
                }
            }
            if stale.is_empty() {
                for x in &h.entries {
                    self.checksums.insert((l, x.expert), x.xxh3);
                }
                self.done += ids.len() as u64 * pack::align_up(self.len);
                (self.o.progress)(self.done, self.total);
                return Ok(None);
            }
            eprintln!(
                "deltafin place: {}: {} record(s) differ from the shards (experts {}); rewriting it",
                path.display(),
                stale.len(),
                stale.iter().take(8).map(|e| e.to_string()).collect::<Vec<_>>().join(", ")
            );
        }
        Ok(Some(keep_from_pack))
    }

    /// Writes the pack of layer `l` (experts `ids`) in `dir`: each record from the shards, or,
    /// where the shard copy is damaged, from the old pack at `path` (`keep_from_pack`).
    fn rewrite_pack(
        &mut self,
        l: usize,
        locs: &[ExpertLoc],
        dir: &Path,
        path: &Path,
        ids: &[u32],
        keep_from_pack: &HashMap<u32, pack::PackEntry>,
    ) -> Result<(), PlacementError> {
        let ck = self.ck;
        let mut images: Vec<(u32, std::borrow::Cow<[u8]>)> = Vec::with_capacity(ids.len());
        for &e in ids {
            match keep_from_pack.get(&e) {
                Some(x) => images.push((e, read_record(path, x)?.into())),
                None => {
                    if let Some(err) = super::shard_copy_damaged(ck, l, e as usize) {
                        return Err(no_good_copy(path, l, e, err));
                    }
                    images.push((e, locs[e as usize].bytes(ck)));
                }
            }
        }
        let (o, total) = (self.o, self.total);
        let done = &mut self.done;
        let mut on_bytes = |n: u64| {
            *done += pack::align_up(n);
            (o.progress)(*done, total);
        };
        let h = pack::write_pack(dir, self.raw_fp, l, self.len, images.into_iter(), &mut on_bytes)?;
        for e in &h.entries {
            self.checksums.insert((l, e.expert), e.xxh3);
        }
        Ok(())
    }
}

/// Phase 5: every expert's checksum, from the shards (all are on some drive, but do not rely on
/// it).
fn fill_checksums(
    ck: &Checkpoint,
    roster: &Roster,
    plan: &Plan,
    checksums: &mut HashMap<(usize, u32), u64>,
) -> Result<(), PlacementError> {
    for &l in &plan.layers {
        if let Some(locs) = roster.experts[l].as_ref() {
            for (e, loc) in locs.iter().enumerate() {
                if let std::collections::hash_map::Entry::Vacant(v) = checksums.entry((l, e as u32)) {
                    if let Some(err) = super::shard_copy_damaged(ck, l, e) {
                        return Err(PlacementError::Damaged(err));
                    }
                    v.insert(pack::checksum(&loc.bytes(ck)));
                }
            }
        }
    }
    Ok(())
}

/// Phase 6: the manifest of `plan` with every expert's checksum, written atomically (the last
/// file a placement writes).
fn write_manifest(
    c: &K3Config,
    o: &PlaceOptions,
    plan: &Plan,
    claim: &Claim,
    len: u64,
    checksums: &HashMap<(usize, u32), u64>,
) -> Result<Manifest, PlacementError> {
    let mut manifest = Manifest {
        version: VERSION,
        model: ManifestModel { fingerprint: claim.fp.clone(), experts_sha256: String::new() },
        namespace: claim.ns.clone(),
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
    Ok(manifest)
}

/// Bytes each drive of `plan` will hold: its packs of experts of `len` bytes, with their headers
/// and indexes.
fn room_needed(plan: &Plan, len: u64) -> Vec<u64> {
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
    need
}

/// Fails unless every file system of `plan`'s drives has room for what its drives `need` (packs
/// of namespace `ns` already there for `layers` count as room: they are replaced).
fn check_room(plan: &Plan, need: &[u64], ns: &str, layers: &[usize]) -> Result<(), PlacementError> {
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
        let have = crate::store::probe::free_bytes(root)
            .map_err(|source| PlacementError::Io { path: root.clone(), source })?;
        let drives = &plan.drives;
        let existing: u64 = ds
            .iter()
            .flat_map(|&d| {
                let dir = drives[d].root.join(ns);
                layers.iter().filter_map(move |&l| std::fs::metadata(dir.join(pack::pack_name(l))).ok())
            })
            .map(|m| m.len())
            .sum();
        let needed: u64 = ds.iter().map(|&d| need[d]).sum();
        if needed > have + existing {
            let names: Vec<String> =
                ds.iter().map(|&d| format!("drive {d} ({})", plan.drives[d].root.display())).collect();
            return Err(PlacementError::NoRoom {
                drives: names.join(" and "),
                shared: ds.len() > 1,
                free: have + existing,
                need: needed,
            });
        }
    }
    Ok(())
}

/// Before anything is written: checksums recorded for shards never seen, and every shard that
/// changed since it was recorded re-hashed; a shard whose bytes are not the recorded ones stops
/// the run (it would be copied into the packs), naming the file and tensor.
fn check_shards(ck: &Checkpoint, o: &PlaceOptions) -> Result<(), PlacementError> {
    let damaged = |e: crate::model::ModelError| PlacementError::Damaged(e);
    if !ck.unrecorded().is_empty() {
        eprintln!("deltafin place: recording the checksums of {} shard(s) first", ck.unrecorded().len());
        ck.record_missing(&mut |d, t| (o.progress)(d, t)).map_err(damaged)?;
    }
    for (s, x) in ck.shard_sums().iter().enumerate() {
        if !x.touched && !x.record.as_ref().is_some_and(|r| r.damaged) {
            continue;
        }
        let (now, digest) = ck.hash_shard(s, &mut |_| {}).map_err(damaged)?;
        let first = ck.shards[s].first_id;
        for (i, got) in digest.sums.iter().enumerate() {
            let (Some(got), Some(want)) = (got, ck.sum_of(first + i as u32)) else { continue };
            if *got != want {
                let what = format!("tensor `{}`", digest.names[i]);
                return Err(damaged(ck.mismatch(s, what, *got, want)));
            }
        }
        // Every byte as recorded: the file as it is now is the one recorded.
        if !x.record.as_ref().is_some_and(|r| r.damaged) {
            ck.confirm_shard(s, now).map_err(damaged)?;
        }
    }
    if let Some(e) = ck.damage_in_fingerprint() {
        return Err(damaged(e));
    }
    Ok(())
}

/// A record of a pack file, read back.
fn read_record(path: &Path, x: &pack::PackEntry) -> Result<Vec<u8>, PlacementError> {
    use std::os::unix::fs::FileExt;
    let io = |source| PlacementError::Io { path: path.to_path_buf(), source };
    let mut buf = vec![0u8; x.length as usize];
    std::fs::File::open(path).and_then(|f| f.read_exact_at(&mut buf, x.offset)).map_err(io)?;
    Ok(buf)
}

/// Neither the shards nor the pack at `path` hold expert `e` of `layer` intact.
fn no_good_copy(path: &Path, layer: usize, e: u32, shard: crate::model::ModelError) -> PlacementError {
    PlacementError::Other(format!(
        "expert {e} of layer {layer}: no intact copy: {shard}; and its record in {} is damaged too",
        path.display()
    ))
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
