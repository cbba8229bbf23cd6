//! `place --verify`: re-reads every holder a manifest names (pack records and shard ranges) and
//! checks each expert's bytes against the manifest's checksum.
//!
//! Contract: reads only; every problem found is returned (drive, layer, expert, what), none stops
//! the check.

use super::Manifest;
use crate::model::Checkpoint;
use crate::model::fingerprint;
use crate::model::roster::Roster;
use crate::store::pack::{self, PackHeader};

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
