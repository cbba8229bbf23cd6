//! Checking a checkpoint's files against their recorded checksums (`model::checksums`): what is
//! verified (for the startup line), the background pass that records a large directory never
//! seen, `deltafin verify` (every byte re-hashed and compared), and the check that tells a
//! damaged shard from another model when a fingerprint differs.
//!
//! Contract: nothing here trusts a file it has not hashed; a mismatch is reported (file, tensor,
//! both checksums) and marked `damaged` in the sidecar, never recorded over the good checksum
//! unless asked (`rehash`: the files were changed on purpose).

use super::ModelError;
use super::checkpoint::Checkpoint;
use super::checksums::{self, ShardRecord, Source};
use super::sidecar;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// What is verified of a checkpoint's bytes now.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Verification {
    pub shards: usize,
    /// Shards with recorded checksums.
    pub recorded: usize,
    /// Where those came from (each once).
    pub sources: Vec<Source>,
    /// Shards modified or replaced since they were recorded (read against what they were).
    pub touched: Vec<String>,
    /// Shards `deltafin verify` found damaged.
    pub damaged: Vec<String>,
    /// A background pass is recording the rest.
    pub recording: bool,
}

impl Verification {
    pub fn complete(&self) -> bool {
        self.recorded == self.shards
    }

    /// A few words for the startup line.
    pub fn describe(&self) -> String {
        let mut s = if self.complete() {
            let src: Vec<&str> = self
                .sources
                .iter()
                .map(|s| match s {
                    Source::Download => "from the verified download",
                    Source::Written => "as written",
                    Source::Files => "from the files as first found",
                })
                .collect();
            format!("every byte checked against xxh3 recorded {}", src.join(" and "))
        } else {
            format!(
                "UNVERIFIED: {} of {} shards have no checksums yet ({}; {} records them now)",
                self.shards - self.recorded,
                self.shards,
                if self.recording { "being recorded in the background" } else { "not recorded" },
                crate::setting::Action::Verify
            )
        };
        if !self.damaged.is_empty() {
            s.push_str(&format!("; DAMAGED: {}", self.damaged.join(", ")));
        }
        s
    }
}

/// One tensor whose bytes are not what was recorded.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Damage {
    pub path: PathBuf,
    pub tensor: String,
    pub got: String,
    pub want: String,
}

/// What [`Checkpoint::verify`] did.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct VerifyReport {
    pub shards: usize,
    pub bytes: u64,
    /// Shards that had no record and were recorded now.
    pub recorded_now: usize,
    pub damage: Vec<Damage>,
    /// Tensors no record covers (their shard's header changed since it was recorded).
    pub unchecked: Vec<String>,
    /// Model files that differ from their records.
    pub changed_files: Vec<checksums::FileProblem>,
}

impl Checkpoint {
    /// What is verified now (see [`Verification`]).
    pub fn verification(&self) -> Verification {
        let st = self.state_mut();
        let mut v = Verification {
            shards: self.shards.len(),
            recording: self.recording.load(Ordering::Relaxed),
            ..Default::default()
        };
        for (s, x) in st.iter().enumerate() {
            let name = self.shard_path(s).display().to_string();
            let Some(r) = &x.record else { continue };
            v.recorded += 1;
            if !v.sources.contains(&r.source) {
                v.sources.push(r.source);
            }
            if x.touched {
                v.touched.push(name.clone());
            }
            if r.damaged {
                v.damaged.push(name);
            }
        }
        v
    }

    /// Starts recording, on a thread of its own, the shards without a record (a large directory
    /// never seen; one shard at a time, each saved as it is done, so a later run resumes). The
    /// thread ends when the checkpoint is dropped.
    pub fn record_in_background(self: &Arc<Self>) {
        if self.unrecorded().is_empty() || self.recording.swap(true, Ordering::SeqCst) {
            return;
        }
        tracing::warn!("{} (in the background)", self.recorded_as_found(self.unrecorded().len()));
        let weak = Arc::downgrade(self);
        let spawned = std::thread::Builder::new().name("deltafin-checksums".into()).spawn(move || {
            loop {
                let Some(ck) = weak.upgrade() else { return };
                let Some(&s) = ck.unrecorded().first() else { break };
                let t0 = std::time::Instant::now();
                match ck.hash_shard(s, &mut |_| {}) {
                    Ok((rec, _)) => {
                        ck.adopt(s, &rec, false);
                        if let Err(e) = sidecar::save(&ck.dir, vec![rec]) {
                            tracing::warn!("{}: checksums not saved: {e}", ck.dir.display());
                        }
                        let left = ck.unrecorded().len();
                        tracing::info!(
                            "checksums of {} recorded in {:.1} s; {left} shard(s) to go",
                            ck.shard_path(s).display(),
                            t0.elapsed().as_secs_f64()
                        );
                    }
                    Err(e) => {
                        tracing::warn!("recording checksums stopped: {e}; the rest stays unverified");
                        break;
                    }
                }
            }
            if let Some(ck) = weak.upgrade() {
                ck.recording.store(false, Ordering::SeqCst);
            }
        });
        if let Err(e) = spawned {
            tracing::warn!("cannot start recording checksums: {e}");
            self.recording.store(false, Ordering::SeqCst);
        }
    }

    /// Re-hashes every shard and compares each tensor with its record; records shards that had
    /// none; marks shards with differences `damaged` in the sidecar and refreshes the identity of
    /// the ones that match. A shard whose header changed since it was recorded keeps its record
    /// (its tensors the record does not cover are reported `unchecked`). `rehash`: take the files
    /// as they are now as the new record, model files included (they were changed on purpose).
    /// `progress` gets (bytes done, bytes total).
    pub fn verify(&self, rehash: bool, progress: &mut dyn FnMut(u64, u64)) -> Result<VerifyReport, ModelError> {
        let total: u64 = self.shards.iter().map(|s| s.file_id.len).sum();
        let mut rep = VerifyReport { shards: self.shards.len(), bytes: total, ..Default::default() };
        let mut done = 0u64;
        let mut records = Vec::new();
        let mut damaged: Vec<String> = Vec::new();
        for s in 0..self.shards.len() {
            let (rec, digest) = self.hash_shard(s, &mut |n| progress(done + n, total))?;
            done += self.shards[s].file_id.len;
            let (old, header_changed) = {
                let st = self.state_mut();
                (st[s].record.clone(), st[s].header_changed)
            };
            let Some(old) = old.filter(|_| !rehash) else {
                rep.recorded_now += usize::from(!rehash);
                self.adopt(s, &rec, true);
                records.push(rec);
                continue;
            };
            let first = self.shards[s].first_id;
            let mut bad = 0;
            for (i, got) in digest.sums.iter().enumerate() {
                let Some(got) = got else { continue };
                let Some(want) = self.sum_of(first + i as u32) else {
                    rep.unchecked.push(format!("{}: tensor `{}`", self.shards[s].path.display(), digest.names[i]));
                    continue;
                };
                if *got != want {
                    bad += 1;
                    rep.damage.push(Damage {
                        path: self.shards[s].path.clone(),
                        tensor: digest.names[i].clone(),
                        got: format!("{got:016x}"),
                        want: format!("{want:016x}"),
                    });
                }
            }
            if bad > 0 {
                damaged.push(old.name.clone());
                continue;
            }
            if header_changed {
                // The record stays the expectation: a changed header is taken only when asked.
                continue;
            }
            records.push(self.confirmed(s, &old, rec));
        }
        let files = self.verify_files(rehash, &mut rep);
        let names: Vec<&str> = damaged.iter().map(String::as_str).collect();
        let saved = if rehash {
            sidecar::save_replacing_files(&self.dir, records, files)
        } else {
            sidecar::save_all(&self.dir, records, files, &names)
        };
        saved.map_err(|source| ModelError::Io { path: self.dir.clone(), source })?;
        let mut st = self.state_mut();
        for x in st.iter_mut() {
            if let Some(r) = x.record.as_mut()
                && names.contains(&r.name.as_str())
            {
                r.damaged = true;
            }
        }
        Ok(rep)
    }

    /// Shard `s`, re-hashed as `now`, holds the very bytes `old` recorded: `now` becomes its record
    /// with `old`'s origin (source, sha256, date) and the file's identity as it is now (a copy, a
    /// restored file: checked whole, so later reads need not suspect it). Returns the record.
    fn confirmed(&self, s: usize, old: &ShardRecord, mut now: ShardRecord) -> ShardRecord {
        now.source = old.source;
        now.sha256 = old.sha256.clone();
        now.recorded = old.recorded;
        self.adopt(s, &now, false);
        now
    }

    /// After a whole-shard check found shard `s`'s bytes as recorded (`now`: its record as the
    /// file is now), saves its new identity; nothing when its header changed since it was
    /// recorded (that record stays as it is until `verify --rehash`).
    pub fn confirm_shard(&self, s: usize, now: ShardRecord) -> Result<(), ModelError> {
        let (old, header_changed) = {
            let st = self.state_mut();
            (st[s].record.clone(), st[s].header_changed)
        };
        let Some(old) = old.filter(|_| !header_changed) else { return Ok(()) };
        let rec = self.confirmed(s, &old, now);
        sidecar::save(&self.dir, vec![rec])
            .map(|_| ())
            .map_err(|source| ModelError::Io { path: self.dir.clone(), source })
    }

    /// The model files' part of [`Checkpoint::verify`]: with `rehash` every present file's record
    /// taken anew; otherwise the files that differ from their records reported in `rep`.
    fn verify_files(&self, rehash: bool, rep: &mut VerifyReport) -> Vec<checksums::FileRecord> {
        if !rehash {
            rep.changed_files = self.file_problems();
            return Vec::new();
        }
        checksums::MODEL_FILES
            .iter()
            .filter_map(|&n| {
                let b = std::fs::read(self.dir.join(n)).ok()?;
                Some(checksums::FileRecord::new(n, &b, Source::Files))
            })
            .collect()
    }

    /// When the model's fingerprint is not what a placement recorded: whether damage explains
    /// it. Checks the tensors holding the bytes the fingerprint samples (`model::fingerprint`)
    /// against their recorded checksums; the first mismatch is returned as the error it is.
    pub fn damage_in_fingerprint(&self) -> Option<ModelError> {
        const WINDOW: u64 = 4096;
        for (s, sh) in self.shards.iter().enumerate() {
            let len = sh.file_id.len;
            let windows = [(0, WINDOW), (len / 2, len / 2 + WINDOW), (len.saturating_sub(WINDOW), len)];
            for (id, name) in self.shard_tensors(s) {
                let Some(e) = self.get(name) else { continue };
                // A stream install's routed experts are holes beside the windows it keeps.
                let hole = self.stream && checksums::is_routed_expert(name);
                if hole || !windows.iter().any(|&(a, b)| e.start < b && a < e.end) || self.sum_of(id).is_none() {
                    continue;
                }
                let mut buf = vec![0u8; (e.end - e.start) as usize];
                if let Err(err) = self.read_at(s, e.start, &mut buf).and_then(|()| self.check(e, &buf)) {
                    return Some(err);
                }
            }
        }
        None
    }
}
