//! A store that heals: holders that failed a read are suspect for a while, then tried again.
//!
//! Contract:
//! - A read that fails with an I/O error or comes back short makes its file suspect; bytes that
//!   are not the recorded ones make that expert's holder on that drive suspect (the rest of the
//!   file may be fine). A suspect holder is not used for [`FIRST_BACKOFF`], doubling with each
//!   further failure up to [`MAX_BACKOFF`]; meanwhile reads go to other copies, and a fetch with
//!   none fails at once with an error naming the file, the failure and when it is retried.
//! - After its backoff a suspect holder takes the next read that needs it (a probe): a file
//!   replaced since it was opened (another inode at its path) is opened again first; a clean,
//!   verified read restores it, a failed one doubles the wait.
//! - Only a reader that keeps failing gives a whole drive up (`drive.rs`); a drive given up, a
//!   missing drive directory or a file that cannot be opened stays out for the store's life.
//! - [`ExpertStore::health`] reports what is suspect now (the server's `/health`).
//!
//! Runs under the store's lock.

use super::*;
use serde::Serialize;

pub(super) const FIRST_BACKOFF: Duration = Duration::from_millis(250);
pub(super) const MAX_BACKOFF: Duration = Duration::from_secs(8);

/// A holder that failed recently.
#[derive(Clone, Debug)]
pub(super) struct Suspect {
    /// The expert whose read failed (what a probe reads again).
    pub key: Key,
    pub msg: String,
    pub at: Instant,
    pub until: Instant,
    pub strikes: u32,
    /// The probe after this strike checked whether the file was replaced.
    pub reopened: u32,
}

impl Suspect {
    fn strike(old: Option<&Suspect>, key: Key, msg: String, now: Instant) -> Suspect {
        let strikes = old.map_or(1, |s| s.strikes + 1);
        let wait = FIRST_BACKOFF.saturating_mul(1 << (strikes - 1).min(16)).min(MAX_BACKOFF);
        Suspect { key, msg, at: now, until: now + wait, strikes, reopened: old.map_or(0, |s| s.reopened) }
    }

    fn describe(&self, now: Instant) -> String {
        let ago = now.saturating_duration_since(self.at).as_secs_f64();
        let next = self.until.saturating_duration_since(now).as_secs_f64();
        format!(
            "{} ({ago:.1} s ago, {} failure{} in a row; {})",
            self.msg,
            self.strikes,
            if self.strikes == 1 { "" } else { "s" },
            if next > 0.0 { format!("tried again in {next:.1} s") } else { "tried again by the next read".into() }
        )
    }
}

/// The suspect holders of a store.
#[derive(Default)]
pub(super) struct Suspects {
    /// By file index.
    files: HashMap<u32, Suspect>,
    /// By (expert, drive).
    experts: HashMap<(Key, u16), Suspect>,
    pub restored: u64,
}

/// The files a holder reads.
fn files_of(h: &Holder) -> impl Iterator<Item = u32> + '_ {
    std::iter::once(h.file).chain(h.extents.iter().flat_map(|x| x.iter().map(|x| x.file)))
}

impl Suspects {
    /// Whether `h` (a holder of `key`) waits out a backoff now.
    pub(super) fn holds_back(&self, key: Key, h: &Holder, now: Instant) -> bool {
        if self.files.is_empty() && self.experts.is_empty() {
            return false;
        }
        files_of(h).any(|f| self.files.get(&f).is_some_and(|s| now < s.until))
            || self.experts.get(&(key, h.drive)).is_some_and(|s| now < s.until)
    }

    pub(super) fn mark_file(&mut self, file: u32, key: Key, msg: String, now: Instant) {
        let s = Suspect::strike(self.files.get(&file), key, msg, now);
        self.files.insert(file, s);
    }

    pub(super) fn mark_expert(&mut self, key: Key, drive: u16, msg: String, now: Instant) {
        let s = Suspect::strike(self.experts.get(&(key, drive)), key, msg, now);
        self.experts.insert((key, drive), s);
    }

    /// Suspects whose backoff has ended (at most `n`): what to probe.
    fn due(&self, now: Instant, n: usize) -> Vec<Probe> {
        let files = self.files.iter().filter(|(_, s)| now >= s.until).map(|(&f, s)| Probe {
            file: Some(f),
            drive: None,
            key: s.key,
            strikes: s.strikes,
        });
        let experts = self.experts.iter().filter(|(_, s)| now >= s.until).map(|(&(key, d), s)| Probe {
            file: None,
            drive: Some(d),
            key,
            strikes: s.strikes,
        });
        files.chain(experts).take(n).collect()
    }

    /// A probe's outcome: restored, or struck again (unless something else changed it meanwhile).
    fn settle(&mut self, p: &Probe, failed: Option<String>, now: Instant) {
        let slot = match (p.file, p.drive) {
            (Some(f), _) => self.files.get(&f),
            (None, Some(d)) => self.experts.get(&(p.key, d)),
            _ => None,
        };
        if slot.is_none_or(|s| s.strikes != p.strikes) {
            return;
        }
        match (failed, p.file, p.drive) {
            (None, Some(f), _) => {
                if let Some(s) = self.files.remove(&f) {
                    tracing::info!(
                        "a probe of expert {} of layer {} reads clean again; restored after: {}",
                        p.key.1,
                        p.key.0,
                        s.msg
                    );
                    self.restored += 1;
                }
            }
            (None, None, Some(d)) => {
                if let Some(s) = self.experts.remove(&(p.key, d)) {
                    tracing::info!(
                        "a probe of expert {} of layer {} reads clean again; restored after: {}",
                        p.key.1,
                        p.key.0,
                        s.msg
                    );
                    self.restored += 1;
                }
            }
            (Some(msg), Some(f), _) => self.mark_file(f, p.key, msg, now),
            (Some(msg), None, Some(d)) => self.mark_expert(p.key, d, msg, now),
            _ => {}
        }
    }

    /// A clean read of `key` from `files` on `drive`: those holders are trusted again. Returns
    /// what was restored.
    pub(super) fn clear(&mut self, key: Key, drive: u16, files: &[u32]) -> Vec<String> {
        let mut back = Vec::new();
        if self.files.is_empty() && self.experts.is_empty() {
            return back;
        }
        for f in files {
            if let Some(s) = self.files.remove(f) {
                back.push(s.msg);
            }
        }
        if let Some(s) = self.experts.remove(&(key, drive)) {
            back.push(s.msg);
        }
        self.restored += back.len() as u64;
        back
    }

    /// What is suspect now, one line each (files first), for messages and `/health`.
    pub(super) fn lines(&self, sh: &Shared, now: Instant) -> Vec<String> {
        let mut v: Vec<String> = self
            .files
            .iter()
            .map(|(&f, s)| format!("{}: {}", sh.spec.files[f as usize].1.display(), s.describe(now)))
            .collect();
        v.sort();
        let mut e: Vec<String> = self
            .experts
            .iter()
            .map(|(&((l, x), d), s)| {
                format!(
                    "expert {x} of layer {l} on drive {d} ({}): {}",
                    sh.spec.drives[d as usize].root.display(),
                    s.describe(now)
                )
            })
            .collect();
        e.sort();
        v.extend(e);
        v
    }

    /// Why each holder of `key` is held back now (for a fetch that found none usable).
    pub(super) fn why(&self, sh: &Shared, key: Key, now: Instant) -> Vec<String> {
        let Some(hs) = sh.spec.holders.get(key.0 as usize).and_then(|h| h.as_ref()).and_then(|h| h.get(key.1 as usize))
        else {
            return Vec::new();
        };
        let mut v = Vec::new();
        for h in hs {
            for f in files_of(h) {
                if let Some(s) = self.files.get(&f).filter(|s| now < s.until) {
                    v.push(format!("{}: {}", sh.spec.files[f as usize].1.display(), s.describe(now)));
                }
            }
            if let Some(s) = self.experts.get(&(key, h.drive)).filter(|s| now < s.until) {
                v.push(format!(
                    "drive {} ({}): {}",
                    h.drive,
                    sh.spec.drives[h.drive as usize].root.display(),
                    s.describe(now)
                ));
            }
        }
        v.dedup();
        v
    }

    /// Before a probe of `h`: a suspect file whose backoff ended and that was replaced at its
    /// path since it was opened is opened again (once per failure).
    pub(super) fn before_probe(&mut self, sh: &Shared, h: &Holder) {
        for f in files_of(h) {
            let Some(s) = self.files.get_mut(&f) else { continue };
            if s.reopened == s.strikes {
                continue;
            }
            s.reopened = s.strikes;
            reopen_if_replaced(sh, f);
        }
    }
}

/// A suspect holder to read again: on `file`, or the expert's holder on `drive`.
struct Probe {
    file: Option<u32>,
    drive: Option<u16>,
    key: Key,
    strikes: u32,
}

/// Suspects whose backoff ended are probed by each `health` call, at most this many.
const PROBES_PER_CALL: usize = 2;

/// Reads `p`'s expert from its suspect holder (through the page cache, by path, so a file replaced
/// since is read as it is now) and checks it; the failure, if any.
fn probe(sh: &Shared, p: &Probe) -> Option<String> {
    use std::os::unix::fs::FileExt;
    let hs = sh.spec.holders.get(p.key.0 as usize)?.as_ref()?.get(p.key.1 as usize)?;
    let h = hs.iter().find(|h| match (p.file, p.drive) {
        (Some(f), _) => files_of(h).any(|x| x == f),
        (None, Some(d)) => h.drive == d,
        _ => false,
    })?;
    let len = sh.spec.layout.len as u64;
    let pieces: Vec<HolderExtent> = match &h.extents {
        None => vec![HolderExtent { file: h.file, offset: h.offset, len, dest: 0 }],
        Some(xs) => xs.to_vec(),
    };
    let mut buf = vec![0u8; len as usize];
    for x in &pieces {
        // A file restored by a rename: the store reads the new one from now on too.
        reopen_if_replaced(sh, x.file);
        let path = &sh.spec.files[x.file as usize].1;
        let dst = &mut buf[x.dest as usize..(x.dest + x.len) as usize];
        if let Err(e) = std::fs::File::open(path).and_then(|f| f.read_exact_at(dst, x.offset)) {
            return Some(format!("{}: {e}", path.display()));
        }
    }
    match sh.spec.checksums.as_ref().map(|c| c.check(p.key.0 as usize, p.key.1, &buf)) {
        Some(Verdict::Bad(what)) => Some(what),
        _ => None,
    }
}

/// Points file `f`'s descriptor at the file now at its path, if that is another file than the
/// one open (restored by a rename); the descriptor number stays, so readers need not know.
fn reopen_if_replaced(sh: &Shared, f: u32) {
    use std::os::unix::fs::MetadataExt;
    let (_, path) = &sh.spec.files[f as usize];
    let Some(open) = sh.files.get(f as usize).and_then(|x| x.as_ref()) else { return };
    let (Ok(now), Ok(was)) = (std::fs::metadata(path), open.file.metadata()) else { return };
    if (now.dev(), now.ino()) == (was.dev(), was.ino()) {
        return;
    }
    match DirectFile::open(path) {
        Ok(new) if new.direct == open.direct => {
            // SAFETY: both descriptors are open and owned by `DirectFile`s; dup2 atomically makes
            // the old number refer to the new file (reads in flight keep the file they started on).
            let r = unsafe { libc::dup2(new.fd(), open.fd()) };
            if r < 0 {
                tracing::warn!("{}: cannot reopen: {}", path.display(), std::io::Error::last_os_error());
            } else {
                tracing::info!("{}: replaced since it was opened; reading the new file", path.display());
            }
        }
        Ok(_) => tracing::warn!("{}: replaced by a file that opens differently; not reopened", path.display()),
        Err(e) => tracing::debug!("{}: cannot reopen yet: {e}", path.display()),
    }
}

/// The store's storage as `/health` shows it.
#[derive(Clone, Debug, Default, Serialize)]
pub struct StorageHealth {
    /// Some holder is given up or suspect now: reads may fail or go to other copies.
    pub degraded: bool,
    /// What, one line each.
    pub problems: Vec<String>,
    /// Holders restored after failing (since the store opened).
    pub restored: u64,
    /// Failed reads (since the store opened).
    pub failures: u64,
    /// How far the model's checksums are recorded (a background pass's progress), when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checksums: Option<crate::model::verify::Verification>,
}

impl ExpertStore {
    /// Drives given up and holders suspect now (see the module contract). Suspects whose backoff
    /// ended are read again first (a few), so a holder that is fine again is restored even when
    /// no request needs it.
    pub fn health(&self) -> StorageHealth {
        let sh = &*self.shared;
        let due = lock(sh).suspects.due(Instant::now(), PROBES_PER_CALL);
        for p in &due {
            let failed = probe(sh, p);
            lock(sh).suspects.settle(p, failed, Instant::now());
        }
        let st = lock(sh);
        let now = Instant::now();
        let mut problems: Vec<String> = st
            .drives
            .iter()
            .enumerate()
            .filter_map(|(i, d)| {
                d.failed.as_ref().map(|m| format!("drive {i} ({}): {m}", sh.spec.drives[i].root.display()))
            })
            .collect();
        problems.extend(st.suspects.lines(sh, now));
        StorageHealth {
            degraded: !problems.is_empty(),
            problems,
            restored: st.suspects.restored,
            failures: st.drives.iter().map(|d| d.counters.failures).sum(),
            checksums: None,
        }
    }
}
