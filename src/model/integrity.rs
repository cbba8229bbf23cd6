//! Which recorded checksums a checkpoint's files are held to when it opens: the directory's own
//! record (or the cache's copy of it), a header that changed since, a copy of a model recorded in
//! another directory, and the model's files beside its shards.
//!
//! Contract:
//! - A shard whose header is the recorded one takes every recorded checksum. A shard whose header
//!   (or length) changed keeps the checksum of every tensor whose name, dtype, shape and offsets
//!   are unchanged ([`checksums::entry_hash`]); its other tensors are unchecked and said so, and
//!   the record is never re-taken from the changed file unless asked (`verify --rehash`).
//! - A directory with no record of its own (copied without its hidden sidecar, or the sidecar
//!   emptied or malformed and no copy of it kept) is checked against a record the cache keeps for a
//!   model of the same layout in another directory, when the bytes of a few small tensors show it
//!   is that model; it says so on stderr. Otherwise its shards are recorded as found, and that is
//!   said on stderr too: damage already present cannot be found that way.
//! - [`checksums::MODEL_FILES`] present in the directory are recorded once seen; a recorded file
//!   that changed or went missing is an error naming it (strict open), or a finding (`verify`).

use super::ModelError;
use super::checkpoint::{Checkpoint, ShardSums};
use super::checksums::{self, FileProblem, FileRecord, ShardRecord, Source};
use super::sidecar::{self, KeptRecord, Origin};
use std::collections::HashMap;

/// How shard `s` took its record.
enum Applied {
    /// Every recorded checksum applies.
    Whole,
    /// The header changed: `kept` tensors keep theirs, `changed` are unchecked.
    Partial { kept: usize, changed: usize },
}

/// Shards sampled (one tensor each) to tell a copy of a recorded model from another model of the
/// same layout; every sample must match.
const SAMPLES: usize = 8;
/// The least bytes a sampled tensor has.
const SAMPLE_MIN: u64 = 4096;

impl Checkpoint {
    /// Loads the expectations of the module contract; with `strict`, a model file that changed is
    /// an error (else it is kept for `verify` in [`Checkpoint::file_problems`]).
    pub(super) fn load_records(&self, strict: bool) -> Result<(), ModelError> {
        let loaded = sidecar::Sidecar::load(&self.dir);
        for n in &loaded.notes {
            tracing::warn!("{n}");
        }
        let mut side = loaded.sidecar;
        let elsewhere = self.fill_missing(&mut side, loaded.origin);
        for (si, sh) in self.shards.iter().enumerate() {
            let name = shard_name(&sh.path);
            let Some(rec) = side.get(&name) else { continue };
            match self.apply(si, rec) {
                None => continue,
                Some(Applied::Whole) => {}
                Some(Applied::Partial { kept, changed }) => tracing::warn!(
                    "{}: its header differs from the one recorded; {kept} tensor(s) unchanged keep their checksums, {changed} changed one(s) are unchecked until {} records them",
                    sh.path.display(),
                    crate::setting::Action::Rehash
                ),
            }
            if let Some((dir, names)) = &elsewhere
                && names.contains(&name)
            {
                self.state_mut()[si].origin = Some(dir.clone());
            }
        }
        let (problems, new) = self.check_files(&side);
        if !new.is_empty()
            && let Err(e) = sidecar::save_all(&self.dir, Vec::new(), new, &[])
        {
            tracing::warn!("{}: the model files' checksums were not saved: {e}", self.dir.display());
        }
        if strict && let Some(p) = problems.first() {
            return Err(ModelError::FileChanged { path: p.path.clone(), what: p.what.clone(), hint: self.file_hint() });
        }
        *self.file_problems.lock().unwrap_or_else(|p| p.into_inner()) = problems;
        Ok(())
    }

    /// Records for the shards `side` lacks: the cache's copy of this directory's record, then
    /// (when the directory had none at all) the record of the same model kept for another
    /// directory. What was taken is saved as this directory's record, so it stays the
    /// expectation. Returns the other directory and the shards taken from it.
    fn fill_missing(&self, side: &mut sidecar::Sidecar, origin: Origin) -> Option<(String, Vec<String>)> {
        let missing = |side: &sidecar::Sidecar| -> Vec<String> {
            self.shards.iter().map(|sh| shard_name(&sh.path)).filter(|n| side.get(n).is_none()).collect()
        };
        let mut taken = Vec::new();
        if !missing(side).is_empty()
            && let Some((p, kept)) = sidecar::kept_for(&self.dir)
        {
            for n in missing(side) {
                if let Some(r) = kept.get(&n) {
                    tracing::warn!(
                        "{}: its record lacks {n}; the copy kept in {} is used",
                        self.dir.display(),
                        p.display()
                    );
                    taken.push(r.clone());
                    side.shards.push(r.clone());
                }
            }
            for f in kept.files {
                if side.file(&f.name).is_none() {
                    side.files.push(f);
                }
            }
        }
        let mut elsewhere = None;
        if origin == Origin::None
            && !missing(side).is_empty()
            && let Some(k) = self.recorded_elsewhere()
        {
            tracing::warn!(
                "{} has no checksum record of its own ({} is missing); its files are checked against the record of the same model in {}: a different model of the same layout would be reported as damaged; if it is one, {} records it",
                self.dir.display(),
                checksums::SIDECAR,
                k.dir,
                crate::setting::Action::Rehash
            );
            let mut names = Vec::new();
            for n in missing(side) {
                if let Some(r) = k.sidecar.get(&n) {
                    // What a verify found about the other directory's files says nothing of these.
                    let r = ShardRecord { damaged: false, ..r.clone() };
                    names.push(n);
                    taken.push(r.clone());
                    side.shards.push(r);
                }
            }
            for f in k.sidecar.files {
                if side.file(&f.name).is_none() {
                    side.files.push(f);
                }
            }
            elsewhere = Some((k.dir, names));
        }
        if !taken.is_empty() {
            let files = side.files.clone();
            if let Err(e) = sidecar::save_all(&self.dir, taken, files, &[]) {
                tracing::warn!("{}: checksums not saved: {e}", self.dir.display());
            }
        }
        elsewhere
    }

    fn file_hint(&self) -> String {
        format!(
            "restore it from a good copy (or the hub: {}), or, if it was changed on purpose, {} records it as it is",
            crate::setting::Action::Setup,
            crate::setting::Action::Rehash
        )
    }

    /// Model files that differ from their records (what a non-strict open found).
    pub fn file_problems(&self) -> Vec<FileProblem> {
        self.file_problems.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Takes `rec` as shard `si`'s expectation as far as it applies (see the module contract);
    /// None when the record is unusable (a malformed checksum field).
    fn apply(&self, si: usize, rec: &ShardRecord) -> Option<Applied> {
        let sh = &self.shards[si];
        let Some(sums) = rec.sums() else {
            tracing::warn!("{}: its record's checksums are malformed; not used", sh.path.display());
            return None;
        };
        let same_header = rec.header_xxh3 == format!("{:016x}", sh.header_xxh3) && rec.file.len == sh.file_id.len;
        let applied = if same_header && sums.len() == sh.tensors as usize {
            for (i, x) in sums.into_iter().enumerate() {
                if let Some(x) = x {
                    let _ = self.sums[sh.first_id as usize + i].set(x);
                }
            }
            Applied::Whole
        } else {
            let by_entry: HashMap<u64, u64> = match rec.entry_hashes() {
                Some(e) if e.len() == sums.len() => {
                    e.into_iter().zip(sums).filter_map(|(e, s)| Some((e, s?))).collect()
                }
                _ => HashMap::new(),
            };
            let mut kept = 0;
            for (i, e) in sh.entries.iter().enumerate() {
                if let Some(&x) = by_entry.get(e) {
                    let _ = self.sums[sh.first_id as usize + i].set(x);
                    kept += 1;
                }
            }
            Applied::Partial { kept, changed: sh.entries.len() - kept }
        };
        let touched = !matches!(applied, Applied::Whole) || rec.file != sh.file_id;
        self.state_mut()[si] =
            ShardSums { record: Some(rec.clone()), touched, origin: None, header_changed: !same_header };
        Some(applied)
    }

    /// The cache's record of a model of this layout in another directory whose sampled small
    /// tensors this directory's files match (see the module contract).
    /// Only a record whose model files (config, tokenizer, ...) are these very files: a copy whose
    /// config differs is another variant of the model, not a copy to hold to that record. Of
    /// several, the most recently saved.
    fn recorded_elsewhere(&self) -> Option<KeptRecord> {
        let key = sidecar::dir_layout_key(&self.dir);
        sidecar::kept_elsewhere(&self.dir, key)
            .into_iter()
            .filter(|k| !k.sidecar.files.is_empty() && self.check_files(&k.sidecar).0.is_empty())
            .find(|k| self.samples_match(&k.sidecar))
    }

    /// A few tensors (one per sampled shard, spread over the shards) hash to what `side` recorded
    /// for them: of each, its smallest tensor of at least [`SAMPLE_MIN`] bytes whose first bytes
    /// are not one value repeated (a norm of ones or a zero bias is the same in every model of a
    /// shape, and tells nothing).
    fn samples_match(&self, side: &sidecar::Sidecar) -> bool {
        let step = self.shards.len().div_ceil(SAMPLES).max(1);
        let mut tried = 0;
        for si in (0..self.shards.len()).step_by(step) {
            let sh = &self.shards[si];
            let Some(rec) = side.get(&shard_name(&sh.path)) else { continue };
            let (Some(sums), Some(entries)) = (rec.sums(), rec.entry_hashes()) else { continue };
            let recorded: HashMap<u64, u64> =
                entries.into_iter().zip(sums).filter_map(|(e, s)| Some((e, s?))).collect();
            let mut candidates: Vec<(u64, super::checkpoint::TensorEntry, u64)> = self
                .shard_tensors(si)
                .into_iter()
                .filter_map(|(id, name)| {
                    let e = self.get(name)?;
                    let want = recorded.get(&sh.entries[(id - sh.first_id) as usize])?;
                    Some((e.end - e.start, e.clone(), *want))
                })
                .filter(|(len, _, _)| *len >= SAMPLE_MIN)
                .collect();
            candidates.sort_by_key(|(len, _, _)| *len);
            let Some((_, e, want)) = candidates.into_iter().find(|(len, e, _)| {
                let mut head = vec![0u8; (*len).min(4096) as usize];
                self.read_at(si, e.start, &mut head).is_ok() && !head.chunks(4).all(|c| c == &head[..c.len()])
            }) else {
                continue;
            };
            let mut buf = vec![0u8; (e.end - e.start) as usize];
            tried += 1;
            if self.read_at(si, e.start, &mut buf).is_err() || xxhash_rust::xxh3::xxh3_64(&buf) != want {
                return false;
            }
        }
        tried > 0
    }

    /// Checks the model files against `side`'s records; returns the problems and the records of
    /// files seen for the first time.
    fn check_files(&self, side: &sidecar::Sidecar) -> (Vec<FileProblem>, Vec<FileRecord>) {
        let (mut problems, mut new) = (Vec::new(), Vec::new());
        for &name in checksums::MODEL_FILES {
            let path = self.dir.join(name);
            let rec = side.file(name);
            let bytes = match crate::util::open_regular(&path).and_then(|mut f| {
                let mut b = Vec::new();
                std::io::Read::read_to_end(&mut f, &mut b).map(|_| b)
            }) {
                Ok(b) => b,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    if rec.is_some() {
                        problems.push(FileProblem { path, what: "is recorded but missing".into() });
                    }
                    continue;
                }
                Err(e) => {
                    problems.push(FileProblem { path, what: format!("cannot be read: {e}") });
                    continue;
                }
            };
            let now = FileRecord::new(name, &bytes, Source::Files);
            match rec {
                Some(r) if r.xxh3 == now.xxh3 && r.len == now.len => {}
                Some(r) => problems.push(FileProblem {
                    path,
                    what: format!(
                        "differs from its recorded checksum (xxh3 {}, recorded {}, {})",
                        now.xxh3,
                        r.xxh3,
                        r.source.describe()
                    ),
                }),
                None => new.push(now),
            }
        }
        (problems, new)
    }

    /// The error for shards `deltafin verify` marked damaged, if any: the engine refuses them
    /// until they are restored and verified again.
    pub fn damaged_error(&self) -> Option<ModelError> {
        let v = self.verification();
        (!v.damaged.is_empty()).then(|| ModelError::Damaged {
            dir: self.dir.clone(),
            shards: v.damaged.join(", "),
            hint: format!(
                "restore them ({} downloads a damaged shard again); then {} checks them and clears the mark",
                crate::setting::Action::Setup,
                crate::setting::Action::Verify
            ),
        })
    }
}

fn shard_name(p: &std::path::Path) -> String {
    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}
