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
//!
//! Here: the manifest (its types, parsing and model check) and the errors. Beside it: `plan.rs`
//! (route traces, which drives hold each expert), `place.rs` (a `place` run: packs, then the
//! manifest), `verify.rs` (`place --verify`) and `holders.rs` (the store's holder map from the
//! shards or a manifest).

use super::pack;
use crate::model::Checkpoint;
use crate::model::fingerprint;
use crate::model::roster::Roster;
use crate::setting::{Action, Setting};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

mod holders;
mod place;
mod plan;
mod subset;
mod verify;

pub use holders::{manifest_spec, shard_read_ranges, shard_spec};
pub use place::{PlaceOptions, place};
pub use plan::{RouteTrace, plan_assignment};
pub use subset::{DriveSubsetError, restrict_drives};
pub use verify::{VerifyProblem, verify};

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
    #[error("{}: another {} is running here (it holds this lock); wait for it to finish", path.display(), Action::Place)]
    Locked { path: PathBuf },
    /// One directory given as two drives (they would overwrite each other's packs).
    #[error("drive {} is given twice (each {} must be its own directory)", drive.display(), Setting::Drive)]
    DriveTwice { drive: PathBuf },
    /// A manifest whose layers are not the model's: a layer without routed experts, or another
    /// count of experts.
    #[error("{MANIFEST}: layer {layer} has {listed} experts, the model {model}")]
    LayerMismatch { layer: usize, listed: usize, model: usize },
    /// A model without routed experts has nothing to place.
    #[error("{}: the model has no routed experts to place", .0.display())]
    NoRoutedExperts(PathBuf),
    /// A drive directory that is the model directory itself.
    #[error("drive {} is the model directory itself; use a directory of its own", .0.display())]
    DriveIsModel(PathBuf),
    /// Drives (named, with their roots) whose free space is less than the packs they would hold.
    #[error(
        "{drives} {} {} free but this placement needs {} there",
        if *shared { "share a file system with" } else { "has" },
        crate::util::human_bytes(*free), crate::util::human_bytes(*need)
    )]
    NoRoom { drives: String, shared: bool, free: u64, need: u64 },
    /// The model's own files are damaged (a shard's bytes are not the ones recorded for it).
    #[error(transparent)]
    Damaged(crate::model::ModelError),
    #[error("{0}")]
    Other(String),
}

/// The first of expert `e` of `layer`'s records in the shards that does not match its recorded
/// checksum, as the error it is.
pub fn shard_copy_damaged(ck: &Checkpoint, layer: usize, e: usize) -> Option<crate::model::ModelError> {
    crate::model::roster::EXPERT_PARTS.iter().find_map(|(proj, part)| {
        let t = ck.get(&crate::model::roster::expert(layer, e, proj, part))?;
        ck.check(t, ck.bytes(t)).err()
    })
}

/// Whether checksums are recorded for all of expert `e` of `layer`'s records.
pub fn shard_copy_recorded(ck: &Checkpoint, layer: usize, e: usize) -> bool {
    crate::model::roster::EXPERT_PARTS.iter().all(|(proj, part)| {
        ck.get(&crate::model::roster::expert(layer, e, proj, part)).is_some_and(|t| ck.sum(t).is_some())
    })
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
                return Err(invalid(format!(
                    "written by an older deltafin (version 1, without the model fingerprint); re-run {} for this model",
                    Action::Place
                )));
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
            if !(1..=super::io::reader::MAX_QD).contains(&drive.qd) {
                return Err(invalid(format!(
                    "drive {d}: qd {} is outside 1..={}",
                    drive.qd,
                    super::io::reader::MAX_QD
                )));
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
                fix: format!(
                    "re-run {} for {}, or give this model's {}",
                    Action::Place,
                    ck.dir.display(),
                    Setting::Placement
                ),
            }))
        };
        if self.model.fingerprint != ours {
            // A damaged byte where the fingerprint samples changes it too: that is not another model.
            if let Some(err) = ck.damage_in_fingerprint() {
                return Err(PlacementError::Damaged(err));
            }
            return Err(other("it was placed for"));
        }
        let model_len = roster.expert_layout.as_ref().map_or(0, |l| l.len as u64);
        if self.expert_bytes != model_len {
            return Err(PlacementError::Invalid {
                path: self.path.clone(),
                msg: format!(
                    "its experts are {} bytes, this model's {model_len}; re-run {} for {}",
                    self.expert_bytes,
                    Action::Place,
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
                // The shard changed since it was placed (its bytes are not the ones recorded for
                // it): the placement is this model's, and its packs serve (every read checked).
                match shard_copy_damaged(ck, ml.layer, e) {
                    Some(err) => {
                        tracing::warn!("{err}; its copies in the placement's packs are used instead");
                        continue;
                    }
                    None if !shard_copy_recorded(ck, ml.layer, e) => {
                        tracing::warn!(
                            "{}: expert {e} of layer {}: the shards' bytes are not the placement's and no checksums were recorded for them; the placement's copies are used (each read checked); {} checks the shards",
                            self.path.display(),
                            ml.layer,
                            Action::Verify
                        );
                        continue;
                    }
                    None => {}
                }
                // Same fingerprint, other bytes: edited, or a model the fingerprint's samples missed.
                return Err(PlacementError::Invalid {
                    path: self.path.clone(),
                    msg: format!(
                        "its checksum of expert {e} of layer {} ({}) is not the shards' ({got:016x}), so it is not this model's placement; re-run {} for {}",
                        ml.layer,
                        x.xxh3,
                        Action::Place,
                        ck.dir.display()
                    ),
                });
            }
        }
        Ok(())
    }
}
