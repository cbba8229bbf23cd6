//! `deltafin verify --against-hub`: each shard's sha256 compared with the hub's own, so a model
//! whose checksums were recorded from its files as found (copied in, converted, installed by
//! another tool) gets a record that damage already present cannot hide in.
//!
//! Contract: the expected sha256 of a shard comes from, in order, the record of its verified
//! download, the name of the Hugging Face cache blob the file links to (a snapshot directory),
//! or the hub's listing of the repository at a revision (when given). A shard that matches gets a
//! `download` record from the very bytes that matched (replacing one learned from other bytes,
//! which is reported); one that does not is marked damaged. Nothing else is trusted.

use super::client::{HubError, RepoFile, RepoInfo};
use super::download::{record_verified, verify_file_sums};
use crate::model::Checkpoint;
use crate::model::sidecar;
use std::path::Path;

/// What [`verify_against_hub`] found, shard file names in each list.
#[derive(Debug, Default, serde::Serialize)]
pub struct HubCheck {
    /// The hub's sha256 matched; recorded from these bytes now.
    pub matched: Vec<String>,
    /// Of those, shards whose earlier record differed (it was learned from other bytes).
    pub relearned: Vec<String>,
    /// The sha256 did not match: marked damaged.
    pub mismatched: Vec<String>,
    /// No sha256 of the hub's is known for them (give the repository and revision).
    pub unknown: Vec<String>,
}

/// The hub's sha256 of shard `name` at `path`, if one is known (see the module contract).
fn expected(path: &Path, name: &str, recorded: Option<&str>, listing: Option<&RepoInfo>) -> Option<String> {
    if let Some(s) = recorded {
        return Some(s.to_string());
    }
    let blob = std::fs::read_link(path).ok().and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()));
    if let Some(b) = blob.filter(|b| b.len() == 64 && b.bytes().all(|c| c.is_ascii_hexdigit())) {
        return Some(b);
    }
    listing.and_then(|l| l.file(name)).and_then(|f| f.sha256.clone())
}

/// Checks every shard of `ck` against the hub's sha256 (see the module contract); `each` is told
/// of every shard as it is done (name, matched or not, unknown).
pub fn verify_against_hub(
    ck: &Checkpoint,
    listing: Option<&RepoInfo>,
    each: &mut dyn FnMut(&str, Option<bool>),
) -> Result<HubCheck, HubError> {
    let mut out = HubCheck::default();
    let sums = ck.shard_sums();
    for (s, sh) in ck.shards.iter().enumerate() {
        let name = sh.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let old = sums.get(s).and_then(|x| x.record.clone());
        let recorded = old.as_ref().and_then(|r| r.sha256.clone());
        let Some(sha) = expected(&sh.path, &name, recorded.as_deref(), listing) else {
            each(&name, None);
            out.unknown.push(name);
            continue;
        };
        let want = RepoFile { path: name.clone(), size: sh.file_id.len, sha256: Some(sha), blob_id: None };
        match verify_file_sums(&sh.path, &want)? {
            Some(Some(digest)) => {
                if old
                    .as_ref()
                    .and_then(|r| r.sums())
                    .is_some_and(|v| v.iter().zip(&digest.sums).any(|(a, b)| a.is_some() && b.is_some() && a != b))
                {
                    out.relearned.push(name.clone());
                }
                record_verified(&sh.path, &want, &digest);
                each(&name, Some(true));
                out.matched.push(name);
            }
            _ => {
                let dir = &ck.dir;
                sidecar::save_with(dir, Vec::new(), &[name.as_str()])
                    .map_err(|source| HubError::Io { path: dir.clone(), source })?;
                each(&name, Some(false));
                out.mismatched.push(name);
            }
        }
    }
    Ok(out)
}
