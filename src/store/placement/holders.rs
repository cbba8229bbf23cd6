//! The store's holder map (`StoreSpec`) from the shipped shards alone, or from a placement
//! manifest (its pack files plus the shards as the manifest says).
//!
//! Contract: a manifest of another model is refused (`Manifest::check_model`); a pack whose header
//! names another model, or that cannot be read, is skipped with a warning and its experts served by
//! the other holders; a pack record is used only when its checksum and length are the manifest's.
//! Reads are checked against the checkpoint's per-record checksums when all are recorded, else
//! against the manifest's.

use super::{Manifest, PlacementError, ShardUse};
use crate::model::Checkpoint;
use crate::model::fingerprint;
use crate::model::roster::{ExpertLayout, Roster};
use crate::store::expert_store::{DriveSpec, Holder, StoreSpec};
use crate::store::pack;
use std::path::{Path, PathBuf};

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
            (
                ck.shard_path(loc.extents[0].shard).to_path_buf(),
                crate::store::io::reader::widen(loc.extents[0].start, len).0,
            )
        })
        .collect();
    (ranges, crate::store::io::reader::widen(0, len).1 + crate::store::io::reader::DIRECT_ALIGN)
}

/// The shards as a holder of one expert (file index = shard index): one range, or its pieces.
fn shard_holder(loc: &crate::model::roster::ExpertLoc, drive: u16, tier: u8) -> Holder {
    let first = loc.extents[0];
    let mut h = Holder::whole(drive, first.shard as u32, first.start, tier);
    if loc.extents.len() > 1 {
        h.extents = Some(
            loc.extents
                .iter()
                .map(|x| crate::store::expert_store::HolderExtent {
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

/// Holder map for experts read straight from the shipped shards (no placement), each read checked
/// against the checkpoint's recorded checksums of its records.
pub fn shard_spec(
    ck: &std::sync::Arc<Checkpoint>,
    roster: &Roster,
    model_dir: &Path,
    qd: usize,
    gbps: f64,
) -> Option<StoreSpec> {
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
        checksums: crate::store::sums::ExpertSums::records(ck, roster),
    })
}

/// Holder map from a placement manifest: pack holders (validated against their headers) plus the
/// shards as the manifest says. Pack files that cannot be read are reported and skipped.
pub fn manifest_spec(
    m: &Manifest,
    ck: &std::sync::Arc<Checkpoint>,
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
        let mismatch =
            |model: usize| PlacementError::LayerMismatch { layer: ml.layer, listed: ml.experts.len(), model };
        let locs = roster.experts.get(ml.layer).and_then(|x| x.as_ref()).ok_or_else(|| mismatch(0))?;
        if ml.experts.len() != locs.len() {
            return Err(mismatch(locs.len()));
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
    // The checkpoint's per-record checksums where all are recorded (the same bytes `place` copied,
    // checked against them; hashed on several cores), else the manifest's whole-expert ones.
    let checksums = match crate::store::sums::ExpertSums::records(ck, roster) {
        Some(r) if r.complete() => r,
        _ => crate::store::sums::ExpertSums::whole(sums),
    };
    Ok(StoreSpec { layout, drives, files, holders, checksums: Some(checksums) })
}
