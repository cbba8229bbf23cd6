//! `--use-drives`: a store that reads only some drives of a placement.
//!
//! Contract: [`restrict_drives`] keeps the holders on the placement drives listed (the shards, the
//! last drive of a store's spec, stay as placed) and fails — naming what is wrong, for the
//! setting's message — when a listed drive is not in the placement or an expert is left with no
//! holder; it warns when some experts must come from the shards instead.

use crate::setting::Setting;
use crate::store::expert_store::StoreSpec;

/// Why a list of drives cannot restrict a placement: the value at fault and the problem.
#[derive(Debug, thiserror::Error)]
#[error("{} {value}: {problem}", Setting::UseDrives)]
pub struct DriveSubsetError {
    pub value: String,
    pub problem: String,
}

/// Drops holders on placement drives not in `keep` from `spec`, a placement of
/// `placement_drives` drives (see the module contract).
pub fn restrict_drives(spec: &mut StoreSpec, keep: &[usize], placement_drives: usize) -> Result<(), DriveSubsetError> {
    if let Some(&bad) = keep.iter().find(|&&d| d >= placement_drives) {
        return Err(DriveSubsetError {
            value: bad.to_string(),
            problem: format!("the placement has {placement_drives} drives (0..{placement_drives})"),
        });
    }
    let list = keep.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(",");
    let (mut none, mut shards_only) = (0usize, 0usize);
    for per_layer in spec.holders.iter_mut().flatten() {
        for hs in per_layer.iter_mut() {
            hs.retain(|h| h.drive as usize >= placement_drives || keep.contains(&(h.drive as usize)));
            if hs.is_empty() {
                none += 1;
            } else if hs.iter().all(|h| h.drive as usize >= placement_drives) {
                shards_only += 1;
            }
        }
    }
    if none > 0 {
        return Err(DriveSubsetError {
            value: list,
            problem: format!(
                "{none} experts have no holder on those drives (and the placement does not fall back to the shards); use a mirror placement for drive subsets"
            ),
        });
    }
    if shards_only > 0 {
        tracing::warn!(
            "{} {list}: {shards_only} experts are not on those drives and will be read from the shards",
            Setting::UseDrives
        );
    }
    Ok(())
}
