//! Hugging Face's own download cache (`huggingface_hub`): files already there are reused by
//! `setup`, and a snapshot directory works as `--model` as it is.
//!
//! Layout (read only, never written): `HUB/models--ORG--NAME/` with `refs/<branch>` (a commit id),
//! `snapshots/<commit>/<file>` (symbolic links into `blobs/`) and `blobs/<sha256 or git blob id>`.
//! `HUB` is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else
//! `~/.cache/huggingface/hub`. Contract: [`HfRepoCache::find`] only proposes a file of the right
//! size; the caller verifies its checksum before using it. [`HfRepoCache::repo_info`] lists a
//! snapshot as the hub would (for `HF_HUB_OFFLINE`): each file's checksum is the name of the blob
//! its link points to, so a file that is not such a link is left out (and so never trusted).

use super::client::{Hub, HubError, RepoFile, RepoInfo};
use std::path::{Path, PathBuf};

/// The hub cache root, if one can be named.
pub fn hub_cache_dir() -> Option<PathBuf> {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    env("HF_HUB_CACHE")
        .or_else(|| env("HF_HOME").map(|h| h.join("hub")))
        .or_else(|| env("XDG_CACHE_HOME").map(|c| c.join("huggingface/hub")))
        .or_else(|| env("HOME").map(|h| h.join(".cache/huggingface/hub")))
}

/// `repo` at `revision` as [`Hub::repo_info`] lists it, or, with `HF_HUB_OFFLINE` set, as the
/// Hugging Face cache holds it ([`HfRepoCache::repo_info`]; what it lacks is the error).
pub fn list(hub: &Hub, repo: &str, revision: &str) -> Result<RepoInfo, HubError> {
    if !hub.offline {
        return hub.repo_info(repo, revision);
    }
    let cached = hub_cache_dir().and_then(|h| HfRepoCache::open(&h, repo));
    let listed =
        cached.map_or_else(|| Err(format!("repo {repo} at revision {revision}")), |c| c.repo_info(repo, revision));
    listed.map_err(|what| HubError::Offline { what })
}

/// One repo's directory in the cache.
#[derive(Clone, Debug)]
pub struct HfRepoCache {
    pub root: PathBuf,
}

impl HfRepoCache {
    /// `HUB/models--ORG--NAME`, when it exists.
    pub fn open(hub: &Path, repo: &str) -> Option<Self> {
        let root = hub.join(format!("models--{}", repo.replace('/', "--")));
        root.is_dir().then_some(HfRepoCache { root })
    }

    /// The snapshot directory of `commit`, or of the commit `refs/<revision>` names.
    pub fn snapshot(&self, revision: &str) -> Option<PathBuf> {
        let commit = if revision.len() == 40 && revision.bytes().all(|b| b.is_ascii_hexdigit()) {
            revision.to_string()
        } else {
            std::fs::read_to_string(self.root.join("refs").join(revision)).ok()?.trim().to_string()
        };
        let p = self.root.join("snapshots").join(commit);
        p.is_dir().then_some(p)
    }

    /// The snapshot of `revision` as the hub lists a commit: each file linked into `blobs/`, with
    /// its size and the checksum its blob is named by (a 64-hex sha256, or a 40-hex git blob id).
    /// Err names what the cache lacks: the snapshot, or a file whose blob is gone.
    pub fn repo_info(&self, repo: &str, revision: &str) -> Result<RepoInfo, String> {
        let lacks = format!("repo {repo} at revision {revision}");
        let snap = self.snapshot(revision).ok_or_else(|| lacks.clone())?;
        let commit = snap.file_name().map(|n| n.to_string_lossy().into_owned()).ok_or_else(|| lacks.clone())?;
        let mut files = Vec::new();
        let mut dirs = vec![snap.clone()];
        while let Some(d) = dirs.pop() {
            for e in std::fs::read_dir(&d).map_err(|_| lacks.clone())?.flatten() {
                let p = e.path();
                if p.is_dir() {
                    dirs.push(p);
                    continue;
                }
                let Ok(target) = std::fs::read_link(&p) else { continue };
                let key = target.file_name().map(|n| n.to_string_lossy().to_ascii_lowercase()).unwrap_or_default();
                let hex = |n: usize| key.len() == n && key.bytes().all(|b| b.is_ascii_hexdigit());
                let Ok(rel) = p.strip_prefix(&snap) else { continue };
                let path = rel.to_string_lossy().replace('\\', "/");
                let Ok(m) = std::fs::metadata(&p) else {
                    return Err(format!("file {path} of repo {repo} at commit {commit} (its blob {key} is gone)"));
                };
                let (sha256, blob_id) = match (hex(64), hex(40)) {
                    (true, _) => (Some(key.clone()), None),
                    (_, true) => (None, Some(key.clone())),
                    _ => continue,
                };
                files.push(RepoFile { path, size: m.len(), sha256, blob_id });
            }
        }
        files.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(RepoInfo { repo: repo.to_string(), revision: revision.to_string(), commit, files })
    }

    /// A cached file with `f`'s content (by the snapshot of `commit`, else by blob name) whose
    /// size matches; unverified.
    pub fn find(&self, commit: &str, f: &RepoFile) -> Option<PathBuf> {
        let size_ok = |p: &Path| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.len() == f.size);
        let snap = self.root.join("snapshots").join(commit).join(&f.path);
        if size_ok(&snap) {
            return Some(snap);
        }
        let blob = self.root.join("blobs").join(f.content_key());
        size_ok(&blob).then_some(blob)
    }
}
