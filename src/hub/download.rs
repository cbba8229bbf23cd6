//! Resumable, verified, parallel downloads of whole repo files.
//!
//! Contract:
//! - A file appears under its final name only after all its bytes were checked against the hub's
//!   checksum (LFS sha256, or the git blob id for small non-LFS files), fsynced and renamed; so a
//!   final-named file of the right size is complete, and a rerun skips it.
//! - Bytes in flight live in `PARTIAL_DIR/<content key>.part` (named by content, so a partial file
//!   can only ever be resumed with the same bytes). After an interruption (kill -9, a dropped
//!   connection, a full disk) the next run re-hashes the partial file and asks for the rest with
//!   `Range`; a server that ignores the range restarts the file. A checksum mismatch discards the
//!   partial file and fetches the file again (up to the retry budget).
//! - Free space is checked before anything is written; a disk that fills anyway is
//!   [`HubError::DiskFull`], naming the file, and a rerun resumes.
//! - Files found in a Hugging Face cache are verified like downloads and linked (or copied) in
//!   instead of downloaded.
//! - A shard's tensors are hashed (xxh3) from the same bytes as its sha256 and, once it verifies,
//!   recorded in the model directory's checksum sidecar (`model::checksums`, source `download`).
//!   A shard already in place counts as complete only while it is known intact (recorded from its
//!   download, unchanged since, not found damaged by `deltafin verify`); otherwise it is hashed
//!   again, kept if it matches the hub's sha256 and fetched again if not.

use super::client::{Hub, HubError, RepoFile};
use super::hfcache::HfRepoCache;
use crate::model::checksums::{FileId, ShardDigest, ShardRecord, Source, TensorHasher};
use crate::model::sidecar;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use sha2::Digest;
use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// Where partial files live, under the target directory.
pub const PARTIAL_DIR: &str = ".deltafin-partial";

/// One file to fetch to `dest`.
#[derive(Clone, Debug)]
pub struct Job {
    pub file: RepoFile,
    pub dest: PathBuf,
}

#[derive(Clone, Debug)]
pub struct DownloadOptions {
    pub workers: usize,
    /// Draw progress bars (on stderr, when it is a terminal).
    pub progress: bool,
    /// Skip the up-front free-space check (tests of a disk that fills mid-way).
    pub skip_space_check: bool,
}

/// What a download did.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct DownloadReport {
    pub files: usize,
    /// Files already complete before this run.
    pub skipped: usize,
    /// Files taken from a Hugging Face cache.
    pub from_hf_cache: usize,
    /// Shards already in place that were not known intact, verified again and kept.
    pub reverified: usize,
    pub bytes_downloaded: u64,
    /// Bytes of partial files resumed rather than fetched again.
    pub bytes_resumed: u64,
    pub checksum_failures: u64,
    pub seconds: f64,
}

/// Incremental checksum matching what the hub publishes for a file; for a safetensors shard, also
/// each tensor's xxh3 (`model::checksums`), from the same bytes.
struct Checker {
    sum: Sum,
    tensors: Option<TensorHasher>,
}

enum Sum {
    Sha256(sha2::Sha256, String),
    GitSha1(sha1::Sha1, String),
}

/// What a verified file yields: its tensors' checksums when it is a shard.
type Verified = Option<ShardDigest>;

impl Checker {
    fn new(f: &RepoFile) -> Result<Checker, HubError> {
        let tensors = f.path.ends_with(".safetensors").then(TensorHasher::new);
        if let Some(s) = &f.sha256 {
            return Ok(Checker { sum: Sum::Sha256(sha2::Sha256::new(), s.clone()), tensors });
        }
        if let Some(b) = &f.blob_id {
            let mut h = sha1::Sha1::new();
            h.update(format!("blob {}\0", f.size).as_bytes());
            return Ok(Checker { sum: Sum::GitSha1(h, b.clone()), tensors });
        }
        Err(HubError::NoChecksum(f.path.clone()))
    }

    fn update(&mut self, b: &[u8]) {
        match &mut self.sum {
            Sum::Sha256(h, _) => h.update(b),
            Sum::GitSha1(h, _) => h.update(b),
        }
        if let Some(t) = self.tensors.as_mut() {
            t.update(b);
        }
    }

    /// The tensors' checksums (when a shard) if the file matched, or (what, got, want).
    fn finish(self) -> Result<Verified, (&'static str, String, String)> {
        let (what, got, want) = match self.sum {
            Sum::Sha256(h, w) => ("sha256", crate::model::fingerprint::hex(&h.finalize()), w),
            Sum::GitSha1(h, w) => ("git blob id", crate::model::fingerprint::hex(&h.finalize()), w),
        };
        if !got.eq_ignore_ascii_case(&want) {
            return Err((what, got, want));
        }
        Ok(self.tensors.and_then(|t| t.finish().map_err(|e| tracing::warn!("tensor checksums not recorded: {e}")).ok()))
    }
}

/// Hashes `len` bytes of `path` into `c`.
fn hash_prefix(path: &Path, len: u64, c: &mut Checker) -> std::io::Result<()> {
    let mut f = File::open(path)?.take(len);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        c.update(&buf[..n]);
    }
}

/// Verifies a whole local file against the hub's checksum.
pub fn verify_file(path: &Path, f: &RepoFile) -> Result<bool, HubError> {
    Ok(verify_file_sums(path, f)?.is_some())
}

/// [`verify_file`], with the tensors' checksums of a verified shard: None when it does not match.
pub fn verify_file_sums(path: &Path, f: &RepoFile) -> Result<Option<Verified>, HubError> {
    let mut c = Checker::new(f)?;
    let len = std::fs::metadata(path).map_err(|source| HubError::Io { path: path.to_path_buf(), source })?.len();
    if len != f.size {
        return Ok(None);
    }
    hash_prefix(path, len, &mut c).map_err(|source| HubError::Io { path: path.to_path_buf(), source })?;
    Ok(c.finish().ok())
}

/// Records a verified shard's tensor checksums in its model directory's sidecar (source
/// `download`): what every later read of it is checked against.
pub fn record_verified(dest: &Path, f: &RepoFile, digest: &ShardDigest) {
    // Workers publish concurrently; the sidecar is read, merged and rewritten by one at a time.
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE.lock();
    let Some(dir) = dest.parent() else { return };
    let r = ShardRecord::new(dest, digest, Source::Download).and_then(|mut rec| {
        rec.sha256 = f.sha256.clone();
        sidecar::save(dir, vec![rec])
    });
    if let Err(e) = r {
        tracing::warn!("{}: tensor checksums not recorded: {e}", dest.display());
    }
}

/// Whether a shard at `dest` is known intact: recorded from its verified download, unchanged since
/// (same identity) and not found damaged.
fn known_intact(dest: &Path, f: &RepoFile) -> bool {
    let (Some(dir), Some(name)) = (dest.parent(), dest.file_name()) else { return false };
    let side = sidecar::Sidecar::load(dir).sidecar;
    let Some(rec) = side.get(&name.to_string_lossy()) else { return false };
    rec.source == Source::Download
        && !rec.damaged
        && rec.sha256.as_deref().is_some_and(|s| f.sha256.as_deref().is_some_and(|w| s.eq_ignore_ascii_case(w)))
        && FileId::of(dest).is_ok_and(|id| id == rec.file)
}

pub use crate::util::free_bytes;

/// Complete: a final-named file of the right size; a shard must also be known intact (else it is
/// verified again, and fetched again if it does not match).
fn is_complete(j: &Job) -> bool {
    std::fs::metadata(&j.dest).is_ok_and(|m| m.is_file() && m.len() == j.file.size)
        && (!j.file.path.ends_with(".safetensors") || known_intact(&j.dest, &j.file))
}

fn partial_path(partial_dir: &Path, f: &RepoFile) -> PathBuf {
    partial_dir.join(format!("{}.part", f.content_key()))
}

fn fsync_dir(p: &Path) {
    if let Some(d) = p.parent() {
        crate::util::sync_dir(d);
    }
}

/// Publishes a verified partial file under its final name.
fn publish(part: &Path, dest: &Path) -> Result<(), HubError> {
    let io = |source| HubError::Io { path: dest.to_path_buf(), source };
    if let Some(d) = dest.parent() {
        std::fs::create_dir_all(d).map_err(io)?;
    }
    File::open(part)
        .and_then(|f| crate::util::sync_file(&f))
        .map_err(|source| HubError::Io { path: part.to_path_buf(), source })?;
    std::fs::rename(part, dest).map_err(io)?;
    fsync_dir(dest);
    Ok(())
}

fn is_disk_full(e: &std::io::Error) -> bool {
    e.raw_os_error() == Some(libc::ENOSPC) || e.raw_os_error() == Some(libc::EDQUOT)
}

/// Fetches every job to its destination; see the module contract.
pub fn download_all(
    hub: &Hub,
    repo: &str,
    commit: &str,
    jobs: Vec<Job>,
    partial_dir: &Path,
    cache: Option<&HfRepoCache>,
    opts: &DownloadOptions,
) -> Result<DownloadReport, HubError> {
    let t0 = Instant::now();
    let mut report = DownloadReport { files: jobs.len(), ..Default::default() };
    let (done, mut todo): (Vec<Job>, Vec<Job>) = jobs.into_iter().partition(is_complete);
    report.skipped = done.len();
    std::fs::create_dir_all(partial_dir).map_err(|source| HubError::Io { path: partial_dir.to_path_buf(), source })?;
    // A shard already in place (to be verified again) needs no room unless it must be fetched.
    let in_place = |j: &Job| std::fs::metadata(&j.dest).is_ok_and(|m| m.len() == j.file.size);
    let have = |j: &Job| {
        if in_place(j) {
            return j.file.size;
        }
        std::fs::metadata(partial_path(partial_dir, &j.file)).map_or(0, |m| m.len().min(j.file.size))
    };
    let need: u64 = todo.iter().map(|j| j.file.size - have(j)).sum();
    if !opts.skip_space_check {
        let free =
            free_bytes(partial_dir).map_err(|source| HubError::Io { path: partial_dir.to_path_buf(), source })?;
        // Headroom: filesystems refuse writes a little before zero.
        let headroom = if need == 0 { 0 } else { need / 100 + (1 << 20) };
        if need + headroom > free {
            return Err(HubError::NoSpace {
                dir: partial_dir.parent().unwrap_or(partial_dir).to_path_buf(),
                need: need + headroom,
                free,
            });
        }
    }
    // Largest first, so the workers finish together.
    todo.sort_by_key(|j| std::cmp::Reverse(j.file.size));
    let total: u64 = todo.iter().map(|j| j.file.size).sum();
    let mp = MultiProgress::with_draw_target(if opts.progress {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    });
    let overall = mp.add(ProgressBar::new(total));
    overall.set_style(
        ProgressStyle::with_template(
            "{prefix} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta} ({msg})",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    overall.set_prefix("download");
    let n_todo = todo.len();
    overall.set_message(format!("0/{n_todo} files"));
    let queue = Mutex::new(VecDeque::from(todo));
    let stop = AtomicBool::new(false);
    let first_err: Mutex<Option<HubError>> = Mutex::new(None);
    let counters = Counters::default();
    let files_done = AtomicU64::new(0);
    let workers = opts.workers.clamp(1, 64).min(n_todo.max(1));
    std::thread::scope(|s| {
        for _ in 0..workers {
            let bar = mp.add(ProgressBar::new(0));
            bar.set_style(
                ProgressStyle::with_template("  {msg} {bytes}/{total_bytes}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            let (queue, stop, first_err, counters, overall, files_done) =
                (&queue, &stop, &first_err, &counters, &overall, &files_done);
            s.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let Some(job) = queue.lock().ok().and_then(|mut q| q.pop_front()) else { break };
                    bar.set_length(job.file.size);
                    bar.set_position(0);
                    bar.set_message(job.file.path.clone());
                    let r = fetch_one(hub, repo, commit, &job, partial_dir, cache, counters, stop, &|n| {
                        bar.inc(n);
                        overall.inc(n);
                    });
                    match r {
                        Ok(()) => {
                            let d = files_done.fetch_add(1, Ordering::Relaxed) + 1;
                            overall.set_message(format!("{d}/{n_todo} files"));
                        }
                        Err(e) => {
                            stop.store(true, Ordering::Relaxed);
                            if let Ok(mut g) = first_err.lock()
                                && g.is_none()
                            {
                                *g = Some(e);
                            }
                        }
                    }
                }
                bar.finish_and_clear();
            });
        }
    });
    overall.finish_and_clear();
    report.bytes_downloaded = counters.downloaded.load(Ordering::Relaxed);
    report.bytes_resumed = counters.resumed.load(Ordering::Relaxed);
    report.checksum_failures = counters.bad.load(Ordering::Relaxed);
    report.from_hf_cache = counters.cached.load(Ordering::Relaxed) as usize;
    report.reverified = counters.reverified.load(Ordering::Relaxed) as usize;
    report.seconds = t0.elapsed().as_secs_f64();
    if let Some(e) = first_err.into_inner().ok().flatten() {
        return Err(e);
    }
    Ok(report)
}

#[derive(Default)]
struct Counters {
    reverified: AtomicU64,
    downloaded: AtomicU64,
    resumed: AtomicU64,
    bad: AtomicU64,
    cached: AtomicU64,
}

/// Links or copies a file of the Hugging Face cache into the partial file.
fn take_from_cache(src: &Path, part: &Path) -> std::io::Result<()> {
    let _ = std::fs::remove_file(part);
    // Snapshot entries are symbolic links into blobs/: link the blob, not the (relative) link.
    let src = std::fs::canonicalize(src)?;
    let src = src.as_path();
    if std::fs::hard_link(src, part).is_ok() {
        return Ok(());
    }
    std::fs::copy(src, part).map(|_| ())
}

#[allow(clippy::too_many_arguments)]
fn fetch_one(
    hub: &Hub,
    repo: &str,
    commit: &str,
    job: &Job,
    partial_dir: &Path,
    cache: Option<&HfRepoCache>,
    counters: &Counters,
    stop: &AtomicBool,
    on_bytes: &dyn Fn(u64),
) -> Result<(), HubError> {
    let f = &job.file;
    let part = partial_path(partial_dir, f);
    let pio = |source| HubError::Io { path: part.clone(), source };
    // A shard already in place that is not known intact: verified again, kept if it matches.
    if std::fs::metadata(&job.dest).is_ok_and(|m| m.is_file() && m.len() == f.size) {
        match verify_file_sums(&job.dest, f)? {
            Some(sums) => {
                if let Some(d) = &sums {
                    record_verified(&job.dest, f, d);
                }
                on_bytes(f.size);
                counters.reverified.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            None => {
                tracing::warn!("{}: does not match the hub's checksum; downloading it again", job.dest.display());
                counters.bad.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    if let Some(src) = cache.and_then(|c| c.find(commit, f)) {
        if take_from_cache(&src, &part).is_ok()
            && let Some(sums) = verify_file_sums(&part, f)?
        {
            on_bytes(f.size);
            counters.cached.fetch_add(1, Ordering::Relaxed);
            publish(&part, &job.dest)?;
            if let Some(d) = &sums {
                record_verified(&job.dest, f, d);
            }
            return Ok(());
        }
        tracing::warn!(
            "{}: the Hugging Face cache's copy does not match the hub's checksum; downloading",
            src.display()
        );
        let _ = std::fs::remove_file(&part);
    }
    let url = hub.file_url(repo, commit, &f.path);
    let what = format!("file {} of repo {repo} at commit {commit}", f.path);
    let mut bad_sums = 0u32;
    let mut tries = 0u32;
    // Bytes of this file shown on the bars so far (a restarted file is not counted twice).
    let shown = std::cell::Cell::new(0u64);
    let show = |to: u64| {
        if to > shown.get() {
            on_bytes(to - shown.get());
            shown.set(to);
        }
    };
    loop {
        let mut have = std::fs::metadata(&part).map_or(0, |m| m.len());
        if have > f.size {
            std::fs::remove_file(&part).map_err(pio)?;
            have = 0;
        }
        let mut checker = Checker::new(f)?;
        if have > 0 {
            hash_prefix(&part, have, &mut checker).map_err(pio)?;
            counters.resumed.fetch_add(have, Ordering::Relaxed);
        }
        show(have);
        let r = if have == f.size {
            Ok(())
        } else {
            tries += 1;
            // `open` retries the request itself; only a broken transfer is resumed below.
            let resp = hub.open(&url, Some((have, None)), repo, &what)?;
            receive(resp, &url, f, &part, have, &mut checker, &mut tries, counters, stop, &show)
        };
        match r {
            Ok(()) => match checker.finish() {
                Ok(sums) => {
                    publish(&part, &job.dest)?;
                    if let Some(d) = &sums {
                        record_verified(&job.dest, f, d);
                    }
                    return Ok(());
                }
                Err((what, got, want)) => {
                    bad_sums += 1;
                    counters.bad.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!("{}: {what} {got} is not the hub's {want}; fetching it again", f.path);
                    std::fs::remove_file(&part).map_err(pio)?;
                    if bad_sums > hub.opts.retries.max(1) {
                        return Err(HubError::Checksum { file: f.path.clone(), what, got, want, tries: bad_sums });
                    }
                }
            },
            Err(e @ (HubError::Transport { .. } | HubError::Protocol { .. })) if tries <= hub.opts.retries => {
                tracing::info!("{e}; resuming");
                hub.opts.pause(tries.max(1));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Appends the response's bytes to the partial file (which holds `have` bytes), hashing them.
#[allow(clippy::too_many_arguments)]
fn receive(
    resp: super::client::Fetched,
    url: &str,
    f: &RepoFile,
    part: &Path,
    have: u64,
    checker: &mut Checker,
    tries: &mut u32,
    counters: &Counters,
    stop: &AtomicBool,
    show: &dyn Fn(u64),
) -> Result<(), HubError> {
    let pio = |source| HubError::Io { path: part.to_path_buf(), source };
    let proto = |msg: String| HubError::Protocol { url: url.to_string(), msg };
    super::client::check_etag(url, &resp, f)?;
    let mut out = OpenOptions::new().create(true).append(true).open(part).map_err(pio)?;
    let mut got = have;
    match resp.status {
        206 => {
            let want = format!("bytes {have}-{}/{}", f.size - 1, f.size);
            if resp.content_range.as_deref().map(str::trim) != Some(want.as_str()) {
                return Err(proto(format!("Content-Range {:?}, expected `{want}`", resp.content_range)));
            }
        }
        200 => {
            if let Some(n) = resp.content_length
                && n != f.size
            {
                return Err(proto(format!("Content-Length {n}, but the hub lists {} bytes", f.size)));
            }
            // The server sent the whole file: start over.
            if have > 0 {
                out.set_len(0).map_err(pio)?;
                *checker = Checker::new(f)?;
                counters.resumed.fetch_sub(have, Ordering::Relaxed);
                got = 0;
            }
        }
        s => return Err(proto(format!("HTTP {s} for a file download"))),
    }
    let disk_full =
        |got: u64| HubError::DiskFull { path: part.to_path_buf(), file: f.path.clone(), written: got, size: f.size };
    let mut rd = resp.body.into_reader();
    // Hashing runs beside the transfer (a thread fed through a short queue), so the rate is that
    // of the slower of the two rather than of both in turn.
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<u8>>(8);
        let hasher = s.spawn(move || {
            for b in rx {
                checker.update(&b);
            }
        });
        let mut scratch = vec![0u8; 1 << 20];
        let r = (|| {
            while got < f.size {
                if stop.load(Ordering::Relaxed) {
                    return Err(HubError::Stopped { file: f.path.clone(), why: "another download failed" });
                }
                // Fill a whole chunk (reads return much less) so writes and queue hops are few.
                let want = (1 << 20).min((f.size - got) as usize);
                let mut n = 0;
                while n < want {
                    match rd.read(&mut scratch[n..want]) {
                        Ok(0) => break,
                        Ok(k) => n += k,
                        Err(e) if n > 0 => {
                            tracing::info!("{url}: {e}");
                            break;
                        }
                        Err(e) => {
                            return Err(HubError::Transport {
                                url: url.to_string(),
                                msg: e.to_string(),
                                tries: *tries,
                            });
                        }
                    }
                }
                if n == 0 {
                    return Err(HubError::Transport {
                        url: url.to_string(),
                        msg: format!("connection closed after {got} of {} bytes", f.size),
                        tries: *tries,
                    });
                }
                let buf = scratch[..n].to_vec();
                if let Err(e) = out.write_all(&buf) {
                    // Keep what was written whole, so the rerun resumes from a clean end.
                    let _ = out.set_len(got);
                    return Err(if is_disk_full(&e) { disk_full(got) } else { pio(e) });
                }
                got += n as u64;
                counters.downloaded.fetch_add(n as u64, Ordering::Relaxed);
                show(got);
                // Progress earns a fresh retry budget: a long download over a flaky link goes on.
                *tries = 0;
                if tx.send(buf).is_err() {
                    return Err(HubError::Stopped { file: f.path.clone(), why: "the hashing thread ended" });
                }
            }
            Ok(())
        })();
        drop(tx);
        let joined = hasher.join();
        r?;
        joined.map_err(|_| HubError::Stopped { file: f.path.clone(), why: "the hashing thread panicked" })
    })?;
    crate::util::sync_file(&out).map_err(|e| if is_disk_full(&e) { disk_full(got) } else { pio(e) })
}
