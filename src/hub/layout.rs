//! `setup --stream`: the local layout of a stream install.
//!
//! Layout (docs/setup.md): every non-shard file of the repo (config, tokenizer, chat template,
//! index, ...) downloaded whole and verified; each safetensors shard as a **sparse file of its
//! full size** holding its real header, every tensor that is not a routed expert
//! (`*.block_sparse_moe.experts.*`), and the 4 KiB windows the model fingerprint samples, at their
//! own offsets, with holes where the routed experts are. So `Checkpoint::open` reads it like the
//! full checkpoint, the trunk is the shipped bytes, and the fingerprint equals the full model's
//! (placements and route traces of the full model fit). `stream.json` marks the install: written
//! first with `complete: false` (so a half-written directory is never taken for a full model) and
//! set complete after the last shard.
//!
//! Contract: a shard appears under its final name only when all its ranges were written and
//! fsynced (built as `NAME.partial`, renamed); a rerun skips finished shards and redoes others.
//! Each shard is downloaded whole once (kept ranges written, the rest only hashed): it gets its
//! final name only if its sha256 is the hub's, and its tensors' xxh3 — the routed experts' too —
//! are recorded from those same bytes (`model::checksums`, source `download`). So the trunk is
//! verified whatever the server's headers say, and every expert streamed later is checked
//! against a checksum that traces to the hub's sha256 (`stream`). Every response is checked to be
//! exactly what was asked for, from the file version the hub listed (ETag = LFS sha256, when
//! sent). Free space for the trunk is checked before any shard is written.

use super::client::{Hub, HubError, RepoFile, RepoInfo};
use super::download::{self, DownloadOptions, Job};
use super::hfcache::HfRepoCache;
use super::stream::{RECORD, StreamInstall};
use crate::model::checksums::{self, TensorHasher};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

const INDEX: &str = "model.safetensors.index.json";
/// Ranges closer than this are fetched as one (the gap's bytes are few; a request costs a round trip).
const MERGE_GAP: u64 = 64 << 10;
/// The fingerprint's sample window (model::fingerprint).
const WINDOW: u64 = 4096;

/// True for tensors the stream install leaves as holes.
pub use crate::model::checksums::is_routed_expert;

/// The repo's safetensors shards: those of the index's weight map, else `model.safetensors`.
pub fn shard_names(info: &RepoInfo, dir: &Path) -> Result<Vec<String>, HubError> {
    if info.file(INDEX).is_some() {
        let p = dir.join(INDEX);
        let text = std::fs::read_to_string(&p).map_err(|source| HubError::Io { path: p.clone(), source })?;
        let (names, _) = crate::model::checkpoint::parse_index(&p, &text)?;
        return Ok(names);
    }
    if info.file("model.safetensors").is_some() {
        return Ok(vec!["model.safetensors".into()]);
    }
    Err(HubError::NotSafetensors { repo: info.repo.clone(), revision: info.revision.clone(), index: INDEX })
}

/// What `install_stream` did.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct StreamReport {
    pub small_files: download::DownloadReport,
    pub shards: usize,
    pub shards_skipped: usize,
    /// Bytes of headers and trunk tensors kept in the sparse shards.
    pub trunk_bytes: u64,
    /// Bytes downloaded to check the shards whole (each once).
    pub bytes_downloaded: u64,
    /// Bytes of routed experts left to stream on demand.
    pub expert_bytes: u64,
    pub requests: u64,
}

/// One shard's plan: its header bytes and the ranges to fetch.
struct ShardPlan {
    file: RepoFile,
    header: Vec<u8>,
    ranges: Vec<(u64, u64)>,
    expert_bytes: u64,
}

fn plan_shard(hub: &Hub, info: &RepoInfo, file: &RepoFile) -> Result<ShardPlan, HubError> {
    let url = hub.file_url(&info.repo, &info.commit, &file.path);
    let bad = |msg: String| HubError::Protocol { url: url.clone(), msg };
    if file.size < 8 {
        return Err(bad(format!("{} bytes: too short for a safetensors file", file.size)));
    }
    let n8 = hub.get_range(&info.repo, &info.commit, file, 0, 8)?;
    let n = u64::from_le_bytes(n8.as_slice().try_into().map_err(|_| bad("short header length".into()))?);
    if n > 100 << 20 || 8 + n > file.size {
        return Err(bad(format!("header length {n} does not fit a {}-byte safetensors file", file.size)));
    }
    let json = hub.get_range(&info.repo, &info.commit, file, 8, 8 + n)?;
    let mut header = n8;
    header.extend_from_slice(&json);
    let (ranges, expert_bytes) = kept_ranges(&header, file.size).map_err(bad)?;
    Ok(ShardPlan { file: file.clone(), header, ranges, expert_bytes })
}

/// From a shard's header bytes (8-byte length + JSON): the ranges a stream install keeps (every
/// tensor but the routed experts, and the fingerprint's windows; near ones merged), sorted, and
/// the routed experts' bytes.
fn kept_ranges(header: &[u8], size: u64) -> Result<(Vec<(u64, u64)>, u64), String> {
    let n = header.get(..8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes).ok_or("short header length")?;
    let json = header.get(8..).filter(|j| j.len() as u64 == n).ok_or("header cut short")?;
    let meta: safetensors::tensor::Metadata =
        serde_json::from_slice(json).map_err(|e| format!("malformed safetensors header: {e}"))?;
    let data = 8 + n;
    let mut ranges = vec![(0, WINDOW.min(size))];
    let mut expert_bytes = 0;
    for (name, t) in meta.tensors() {
        let (a, b) = (data + t.data_offsets.0 as u64, data + t.data_offsets.1 as u64);
        if b > size || a > b {
            return Err(format!("tensor {name} ({a}..{b}) lies outside the {size}-byte file"));
        }
        if is_routed_expert(&name) {
            expert_bytes += b - a;
        } else if b > a {
            ranges.push((a, b));
        }
    }
    let half = size / 2;
    ranges.push((half, (half + WINDOW).min(size)));
    ranges.push((size.saturating_sub(WINDOW), size));
    // The header itself is written whole at the end; the first window covers its start only.
    ranges.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::new();
    for (a, b) in ranges {
        match merged.last_mut() {
            Some(m) if a <= m.1 + MERGE_GAP => m.1 = m.1.max(b),
            _ => merged.push((a, b)),
        }
    }
    Ok((merged, expert_bytes))
}

/// Options of a stream install.
#[derive(Clone, Debug)]
pub struct StreamOptions {
    pub download: DownloadOptions,
    /// Drives streamed experts go to.
    pub drives: Vec<PathBuf>,
}

/// Installs `info` in `dir` as a stream install; see the module contract. In phases: a full
/// checkpoint refused, the small files downloaded, the record written (incomplete), the shards
/// planned ([`plan_shard`]) and the room checked, the unfinished shards written ([`write_shards`]),
/// then the record set complete.
pub fn install_stream(
    hub: &Hub,
    info: &RepoInfo,
    dir: &Path,
    cache: Option<&HfRepoCache>,
    opts: &StreamOptions,
) -> Result<StreamReport, HubError> {
    let mut report = StreamReport::default();
    std::fs::create_dir_all(dir).map_err(|source| HubError::Io { path: dir.to_path_buf(), source })?;
    // A directory holding a full checkpoint is not turned into a stream install.
    if !dir.join(RECORD).exists()
        && (dir.join(INDEX).exists() || dir.join("model.safetensors").exists())
        && !dir.join(download::PARTIAL_DIR).exists()
    {
        return Err(HubError::HoldsCheckpoint { dir: dir.to_path_buf() });
    }
    let is_shard_name = |p: &str| p == "model.safetensors" || p.ends_with(".safetensors") && !p.contains('/');
    // The small files first (the index names the shards).
    let small: Vec<Job> = info
        .files
        .iter()
        .filter(|f| !is_shard_name(&f.path) && f.path != checksums::SIDECAR)
        .map(|f| Job { file: f.clone(), dest: dir.join(&f.path) })
        .collect();
    let partial = dir.join(download::PARTIAL_DIR);
    report.small_files = download::download_all(hub, &info.repo, &info.commit, small, &partial, cache, &opts.download)?;
    let shards = shard_files(info, dir)?;
    let mut record = StreamInstall {
        version: 1,
        complete: false,
        endpoint: hub.endpoint.clone(),
        repo: info.repo.clone(),
        revision: info.revision.clone(),
        commit: info.commit.clone(),
        drives: opts.drives.clone(),
        shards: shards.clone(),
        dir: dir.to_path_buf(),
    };
    if let Some(old) = StreamInstall::load(dir)?
        && old.commit != info.commit
    {
        return Err(HubError::OtherCommit { dir: dir.to_path_buf(), have: old.commit, want: info.commit.clone() });
    }
    record.save()?;
    report.shards = shards.len();
    // A shard under its final name is finished (see the contract).
    let (done, todo): (Vec<RepoFile>, Vec<RepoFile>) =
        shards.iter().cloned().partition(|s| std::fs::metadata(dir.join(&s.path)).is_ok_and(|m| m.len() == s.size));
    report.shards_skipped = done.len();
    let plans: Vec<ShardPlan> = todo.iter().map(|s| plan_shard(hub, info, s)).collect::<Result<_, _>>()?;
    report.requests += 2 * plans.len() as u64;
    let need: u64 = plans.iter().map(|p| p.header.len() as u64 + p.ranges.iter().map(|r| r.1 - r.0).sum::<u64>()).sum();
    report.expert_bytes = plans.iter().map(|p| p.expert_bytes).sum();
    if !opts.download.skip_space_check {
        let free = download::free_bytes(dir).map_err(|source| HubError::Io { path: dir.to_path_buf(), source })?;
        let headroom = need / 100 + (1 << 20);
        if need + headroom > free {
            return Err(HubError::NoSpace { dir: dir.to_path_buf(), need: need + headroom, free });
        }
    }
    // Every shard passes through whole once: its sha256 must be the hub's, and it yields every
    // tensor's checksum (the experts' too), against which each streamed range is checked later.
    let download: u64 = plans.iter().map(|p| p.file.size).sum();
    let bar = shards_bar(download, opts.download.progress);
    report.requests += write_shards(hub, info, dir, &plans, opts.download.workers, &bar)?;
    report.bytes_downloaded = download;
    report.trunk_bytes =
        plans.iter().map(|p| p.header.len() as u64 + p.ranges.iter().map(|r| r.1 - r.0).sum::<u64>()).sum();
    bar.finish_and_clear();
    record.complete = true;
    record.save()?;
    let _ = std::fs::remove_dir(&partial);
    Ok(report)
}

/// The repo files of the shards [`shard_names`] lists; each must be in the repo.
fn shard_files(info: &RepoInfo, dir: &Path) -> Result<Vec<RepoFile>, HubError> {
    let names = shard_names(info, dir)?;
    names
        .iter()
        .map(|n| {
            info.file(n).cloned().ok_or_else(|| HubError::MissingShard {
                index: INDEX,
                shard: n.clone(),
                repo: info.repo.clone(),
                revision: info.revision.clone(),
            })
        })
        .collect()
}

/// The shards' progress bar over `download` bytes (drawn when `progress`).
fn shards_bar(download: u64, progress: bool) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(
        Some(download),
        if progress { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() },
    );
    bar.set_style(
        ProgressStyle::with_template(
            "shards [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta} (checked whole, trunk kept) {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    bar
}

/// Writes the shards of `plans` ([`write_shard`]) on up to `workers` threads (at most 16); the
/// first error stops them and is returned; else the requests made.
fn write_shards(
    hub: &Hub,
    info: &RepoInfo,
    dir: &Path,
    plans: &[ShardPlan],
    workers: usize,
    bar: &ProgressBar,
) -> Result<u64, HubError> {
    let next = AtomicUsize::new(0);
    let failed: Mutex<Option<HubError>> = Mutex::new(None);
    let requests = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..workers.clamp(1, 16).min(plans.len()) {
            s.spawn(|| {
                loop {
                    if failed.lock().map_or(true, |e| e.is_some()) {
                        break;
                    }
                    let Some(p) = plans.get(next.fetch_add(1, Ordering::Relaxed)) else { break };
                    match write_shard(hub, info, dir, p, bar) {
                        Ok(n) => {
                            requests.fetch_add(n, Ordering::Relaxed);
                        }
                        Err(e) => {
                            if let Ok(mut g) = failed.lock() {
                                g.get_or_insert(e);
                            }
                        }
                    }
                }
            });
        }
    });
    if let Some(e) = failed.into_inner().ok().flatten() {
        return Err(e);
    }
    Ok(requests.load(Ordering::Relaxed))
}

/// Builds one sparse shard as `NAME.partial` from one pass over the whole file — every byte into
/// its sha256 and its tensors' xxh3, the kept ranges written at their offsets — publishes it once
/// the sha256 is the hub's and records the tensors' checksums; returns the requests made. A broken
/// transfer resumes where it stopped (the hashes carry on); a sha256 mismatch starts the shard over.
/// In phases: the partial file created at its full size, [`ShardWrite::download`] (passes until
/// one is the hub's), then the header written, the file synced, renamed and its checksums recorded.
fn write_shard(hub: &Hub, info: &RepoInfo, dir: &Path, p: &ShardPlan, bar: &ProgressBar) -> Result<u64, HubError> {
    use std::os::unix::fs::FileExt;
    let dest = dir.join(&p.file.path);
    let w = ShardWrite {
        hub,
        info,
        p,
        bar,
        url: hub.file_url(&info.repo, &info.commit, &p.file.path),
        what: format!("file {} of repo {} at commit {}", p.file.path, info.repo, info.commit),
        tmp: dir.join(format!("{}.partial", p.file.path)),
    };
    let f = std::fs::File::create(&w.tmp).map_err(|e| w.io(e))?;
    f.set_len(p.file.size).map_err(|e| w.io(e))?;
    let mut requests = 0u64;
    let (digest, head) = match w.download(&f, &mut requests) {
        Ok(d) => d,
        Err(e) => {
            let _ = std::fs::remove_file(&w.tmp);
            return Err(e);
        }
    };
    // The header as the verified stream had it (the kept ranges cover only its first window).
    f.write_all_at(&head, 0).map_err(|e| w.io(e))?;
    crate::util::sync_file(&f).map_err(|e| w.io(e))?;
    std::fs::rename(&w.tmp, &dest).map_err(|source| HubError::Io { path: dest.clone(), source })?;
    crate::util::sync_dir(dir);
    super::download::record_verified(&dest, &p.file, &digest);
    Ok(requests)
}

/// A shard being written ([`write_shard`]): where it comes from, what its errors name, where it
/// is built.
struct ShardWrite<'a> {
    hub: &'a Hub,
    info: &'a RepoInfo,
    p: &'a ShardPlan,
    bar: &'a ProgressBar,
    url: String,
    /// The file as a transfer's errors name it.
    what: String,
    /// `NAME.partial`: the shard while it is built.
    tmp: PathBuf,
}

/// One pass over a shard's bytes: the sha256 and the tensors' xxh3 so far, the header as this
/// (verified) stream has it, and the ranges kept, from it.
struct Pass {
    sha: sha2::Sha256,
    tensors: TensorHasher,
    head: Vec<u8>,
    keep: Option<Vec<(u64, u64)>>,
}

impl ShardWrite<'_> {
    /// An I/O error on the partial file (a full disk named as such).
    fn io(&self, source: std::io::Error) -> HubError {
        let p = self.p;
        if source.raw_os_error() == Some(libc::ENOSPC) {
            HubError::DiskFull { path: self.tmp.clone(), file: p.file.path.clone(), written: 0, size: p.file.size }
        } else {
            HubError::Io { path: self.tmp.clone(), source }
        }
    }

    /// A response that is not what was asked for.
    fn proto(&self, msg: String) -> HubError {
        HubError::Protocol { url: self.url.clone(), msg }
    }

    /// Passes over the whole file ([`ShardWrite::pass`]) until one's sha256 is the hub's (a
    /// mismatch starts over, at most the retries): its tensors' checksums and its header.
    fn download(&self, f: &std::fs::File, requests: &mut u64) -> Result<(checksums::ShardDigest, Vec<u8>), HubError> {
        use sha2::Digest;
        let p = self.p;
        let mut bad_sums = 0u32;
        loop {
            let Pass { sha, tensors, head, .. } = self.pass(f, requests)?;
            let got_sha = crate::model::fingerprint::hex(&sha.finalize());
            match &p.file.sha256 {
                Some(w) if !got_sha.eq_ignore_ascii_case(w) => {
                    bad_sums += 1;
                    tracing::warn!("{}: sha256 {got_sha} is not the hub's {w}; fetching it again", p.file.path);
                    if bad_sums > self.hub.opts.retries.max(1) {
                        return Err(HubError::Checksum {
                            file: p.file.path.clone(),
                            what: "sha256",
                            got: got_sha,
                            want: w.clone(),
                            tries: bad_sums,
                        });
                    }
                }
                Some(_) => {
                    if head != p.header {
                        tracing::warn!(
                            "{}: the header fetched to plan the install was not the file's (only the space check used it)",
                            p.file.path
                        );
                    }
                    let d = tensors.finish().map_err(|e| self.proto(format!("shard {}: {e}", p.file.path)))?;
                    return Ok((d, head));
                }
                None => return Err(HubError::NoChecksum(p.file.path.clone())),
            }
        }
    }

    /// One pass over the whole file into `f` (a broken transfer resumed where it stopped, within
    /// the retries); `requests` counts the requests made.
    fn pass(&self, f: &std::fs::File, requests: &mut u64) -> Result<Pass, HubError> {
        use sha2::Digest;
        use std::io::Read;
        let (hub, url, size) = (self.hub, &self.url, self.p.file.size);
        let mut pass = Pass { sha: sha2::Sha256::new(), tensors: TensorHasher::new(), head: Vec::new(), keep: None };
        let (mut got, mut tries, mut shown) = (0u64, 0u32, 0u64);
        let mut buf = vec![0u8; 1 << 20];
        while got < size {
            tries += 1;
            *requests += 1;
            let resp = hub.open(url, (got > 0).then_some((got, None)), &self.info.repo, &self.what)?;
            super::client::check_etag(url, &resp, &self.p.file)?;
            match resp.status {
                200 if got > 0 => {
                    return Err(self.proto("HTTP 200 (the whole file) for a resumed range".into()));
                }
                200 => {}
                206 => {
                    let want = format!("bytes {got}-{}/{size}", size - 1);
                    if resp.content_range.as_deref().map(str::trim) != Some(want.as_str()) {
                        return Err(self.proto(format!("Content-Range {:?}, expected `{want}`", resp.content_range)));
                    }
                }
                s => return Err(self.proto(format!("HTTP {s} for a shard download"))),
            }
            let mut rd = resp.body.into_reader();
            let err = loop {
                if got >= size {
                    break None;
                }
                let want = buf.len().min((size - got) as usize);
                match rd.read(&mut buf[..want]) {
                    Ok(0) => break Some(format!("connection closed after {got} of {size} bytes")),
                    Ok(n) => {
                        self.take(&mut pass, f, got, &buf[..n])?;
                        got += n as u64;
                        if got > shown {
                            self.bar.inc(got - shown);
                            shown = got;
                        }
                        tries = 0;
                    }
                    Err(e) => break Some(e.to_string()),
                }
            };
            if let Some(msg) = err {
                if tries > hub.opts.retries {
                    return Err(HubError::Transport { url: url.clone(), msg, tries });
                }
                tracing::info!("{url}: {msg}; resuming");
                hub.opts.pause(tries.max(1));
            }
        }
        Ok(pass)
    }

    /// The file's bytes `b` from offset `at`, into `pass`: hashed, the header collected until it is
    /// whole (then the ranges kept, from it), the kept ranges written to `f`.
    fn take(&self, pass: &mut Pass, f: &std::fs::File, at: u64, b: &[u8]) -> Result<(), HubError> {
        use sha2::Digest;
        pass.sha.update(b);
        pass.tensors.update(b);
        // Until the header is whole, every byte is the header's.
        let hdr_len = |h: &[u8]| 8 + u64::from_le_bytes(h[..8].try_into().unwrap_or_default()).min(100 << 20) as usize;
        let mut off = 0;
        while pass.keep.is_none() && off < b.len() {
            let need = if pass.head.len() < 8 { 8 } else { hdr_len(&pass.head) };
            let take = (need - pass.head.len()).min(b.len() - off);
            pass.head.extend_from_slice(&b[off..off + take]);
            off += take;
            if pass.head.len() >= 8 && pass.head.len() == hdr_len(&pass.head) {
                pass.keep = Some(kept_ranges(&pass.head, self.p.file.size).map_err(|m| self.proto(m))?.0);
            }
        }
        if let Some(k) = &pass.keep {
            write_kept(f, k, at, b).map_err(|e| self.io(e))?;
        }
        Ok(())
    }
}

/// Writes the parts of `b` (the file's bytes from `at`) that fall in `ranges` (sorted) at their
/// offsets.
fn write_kept(f: &std::fs::File, ranges: &[(u64, u64)], at: u64, b: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let end = at + b.len() as u64;
    let first = ranges.partition_point(|r| r.1 <= at);
    for &(a, z) in ranges[first..].iter().take_while(|r| r.0 < end) {
        let (x, y) = (a.max(at), z.min(end));
        if y > x {
            f.write_all_at(&b[(x - at) as usize..(y - at) as usize], x)?;
        }
    }
    Ok(())
}
