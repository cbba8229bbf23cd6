//! Stream mode's hub side: the record of a `setup --stream` install, the registry of the experts
//! it has streamed, and the origin its expert source (`store::stream::StreamSource`) streams the
//! others from, by HTTP range, keeping each one locally the first time it is needed.
//!
//! Contract:
//! - A stream install is a model directory with `stream.json` ([`StreamInstall`]): the engine
//!   opens it like a full checkpoint (its shards are sparse files whose routed-expert ranges are
//!   holes), but experts come only from its stream source ([`source`]). An install whose `complete`
//!   is false is refused (a `setup --stream` was interrupted).
//! - Streamed experts live in pack files (`store::pack` format, version 2, with the model's
//!   fingerprint) under `DRIVE/<fingerprint prefix>/stream/`, and are registered in
//!   `stream-placement.json` ([`StreamPlacement`]) in the model directory. A pack is complete
//!   (fsynced, renamed) before the registry names it; the registry is rewritten atomically under a
//!   lock, so a killed run leaves at most an unregistered pack, never a registered partial one.
//! - What is verified: each HTTP response must be exactly the range asked for (206, the exact
//!   `Content-Range` of a file of the size the hub listed, the length) and its hub ETag, when sent,
//!   must be the file's LFS sha256 (the same file version as at setup). Each streamed expert's
//!   bytes must hash to the xxh3 of its records that setup recorded while checking the whole
//!   shard's sha256 (`layout`, `model::checksums`), ETag or not (checked by the source). Its pack
//!   records its xxh3 and every later read is checked against that (by the store, on every run;
//!   within the run that streamed it, by the source).
//! - Experts of one layer that are adjacent in a shard are fetched in one request (up to
//!   [`MAX_REQUEST`] bytes); requests of one fetch run in parallel.

use super::client::{Hub, HubError, HubOptions, RepoFile};
use crate::model::Checkpoint;
use crate::model::fingerprint;
use crate::model::roster::{ExpertLayout, ExpertLoc, Roster};
use crate::store::expert_store::{DriveSpec, ExpertStore, Holder, StoreSpec};
use crate::store::pack;
use crate::store::stream::{Held, Kept, OriginError, StreamOrigin, StreamSource};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub const RECORD: &str = "stream.json";
pub const REGISTRY: &str = "stream-placement.json";
const LOCK: &str = ".stream.lock";
/// Most bytes asked for in one range request.
pub const MAX_REQUEST: u64 = 128 << 20;
/// Range requests of one fetch in flight at once.
const PARALLEL: usize = 8;

/// `stream.json`: where a stream install's experts come from.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StreamInstall {
    pub version: u32,
    /// False until `setup --stream` has written every shard's header and trunk tensors.
    pub complete: bool,
    pub endpoint: String,
    pub repo: String,
    pub revision: String,
    pub commit: String,
    /// Drives streamed experts are written to (a layer's packs go to drive `layer % len`).
    pub drives: Vec<PathBuf>,
    /// The shards as the hub lists them (path, size, LFS sha256).
    pub shards: Vec<RepoFile>,
    #[serde(skip)]
    pub dir: PathBuf,
}

/// One registered pack of streamed experts.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct StreamPack {
    pub drive: usize,
    pub layer: usize,
    /// File name in `DRIVE/<fingerprint prefix>/stream/`.
    pub file: String,
    pub experts: Vec<u32>,
}

/// `stream-placement.json`: every pack of streamed experts.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StreamPlacement {
    pub version: u32,
    /// The model's fingerprint (64 hex digits).
    pub model: String,
    pub packs: Vec<StreamPack>,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> HubError + '_ {
    move |source| HubError::Io { path: path.to_path_buf(), source }
}

impl StreamInstall {
    /// The install record of `dir`, None when `dir` is not a stream install.
    pub fn load(dir: &Path) -> Result<Option<Self>, HubError> {
        let p = dir.join(RECORD);
        if !p.exists() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&p).map_err(io(&p))?;
        let mut s: StreamInstall = serde_json::from_str(&text).map_err(|e| HubError::Malformed {
            path: p.clone(),
            what: "stream install record",
            msg: e.to_string(),
        })?;
        if s.version != 1 {
            return Err(HubError::Version { path: p, expected: 1, got: s.version });
        }
        if s.drives.is_empty() {
            let msg = "it lists no drives".into();
            return Err(HubError::Malformed { path: p, what: "stream install record", msg });
        }
        s.dir = dir.to_path_buf();
        Ok(Some(s))
    }

    pub fn save(&self) -> Result<(), HubError> {
        let p = self.dir.join(RECORD);
        let body = serde_json::to_vec_pretty(self).map_err(|e| HubError::Other(e.to_string()))?;
        crate::util::write_atomic(&p, &body).map_err(io(&p))
    }

    /// Refuses an interrupted install.
    pub fn check_complete(&self) -> Result<(), HubError> {
        if self.complete { Ok(()) } else { Err(HubError::Unfinished { dir: self.dir.clone() }) }
    }

    /// Where drive `d` keeps this model's streamed packs.
    pub fn pack_dir(&self, d: usize, fp: &str) -> PathBuf {
        self.drives[d].join(fingerprint::short(fp)).join("stream")
    }

    fn shard(&self, name: &str) -> Option<&RepoFile> {
        self.shards.iter().find(|s| s.path == name)
    }
}

impl StreamPlacement {
    pub fn load(dir: &Path) -> Result<Self, HubError> {
        let p = dir.join(REGISTRY);
        if !p.exists() {
            return Ok(StreamPlacement { version: 1, ..Default::default() });
        }
        let text = std::fs::read_to_string(&p).map_err(io(&p))?;
        serde_json::from_str(&text).map_err(|e| HubError::Malformed {
            path: p.clone(),
            what: "stream registry",
            msg: e.to_string(),
        })
    }
}

/// Experts of the install's registry that are held locally: a store spec over their packs (each
/// pack validated: this model's fingerprint, layer and expert size), and [layer] -> [expert] ->
/// held. Packs that fail validation are warned about and not used (their experts stream again).
pub fn local_spec(
    install: &StreamInstall,
    ck: &Checkpoint,
    roster: &Roster,
    layout: &ExpertLayout,
) -> Result<(StoreSpec, Held), HubError> {
    install.check_complete()?;
    let fp = fingerprint::fingerprint(ck);
    let reg = StreamPlacement::load(&install.dir)?;
    if !reg.model.is_empty() && reg.model != fp {
        return Err(HubError::OtherModel {
            path: install.dir.join(REGISTRY),
            dir: install.dir.clone(),
            theirs: fingerprint::short(&reg.model).to_string(),
            ours: fingerprint::short(&fp).to_string(),
        });
    }
    let raw = fingerprint::raw(&fp);
    let drives: Vec<DriveSpec> =
        install.drives.iter().map(|d| DriveSpec { root: d.clone(), gbps: 1.0, qd: 4 }).collect();
    let mut files = Vec::new();
    let mut holders: Vec<Option<Vec<Vec<Holder>>>> =
        roster.experts.iter().map(|l| l.as_ref().map(|v| vec![Vec::new(); v.len()])).collect();
    let mut sums: Vec<Option<Vec<u64>>> = roster.experts.iter().map(|l| l.as_ref().map(|v| vec![0; v.len()])).collect();
    for p in &reg.packs {
        if p.drive >= install.drives.len() {
            tracing::warn!("{REGISTRY}: pack {} names drive {}, which is not listed; skipped", p.file, p.drive);
            continue;
        }
        let path = install.pack_dir(p.drive, &fp).join(&p.file);
        let h = match pack::read_header(&path) {
            Ok(h) if h.model == raw && h.layer as usize == p.layer && h.expert_len == layout.len as u64 => h,
            Ok(_) => {
                tracing::warn!(
                    "{}: not this model's layer {} pack; its experts will stream again",
                    path.display(),
                    p.layer
                );
                continue;
            }
            Err(e) => {
                tracing::warn!("{e}; its experts will stream again");
                continue;
            }
        };
        let (Some(Some(hl)), Some(Some(sl))) = (holders.get_mut(p.layer), sums.get_mut(p.layer)) else { continue };
        let file = files.len() as u32;
        files.push((p.drive as u16, path.clone()));
        for e in &h.entries {
            let i = e.expert as usize;
            // Every pack holding an expert is a holder (one damaged, another serves); the first
            // registered gives the checksum (each was computed from bytes checked when streamed).
            if i < hl.len() && p.experts.contains(&e.expert) && (hl[i].is_empty() || sl[i] == e.xxh3) {
                if hl[i].is_empty() {
                    sl[i] = e.xxh3;
                }
                hl[i].push(Holder::whole(p.drive as u16, file, e.offset, 0));
            }
        }
    }
    let held = holders.iter().map(|l| l.as_ref().map(|v| v.iter().map(|h| !h.is_empty()).collect())).collect();
    let checksums = Some(crate::store::sums::ExpertSums::whole(sums));
    Ok((StoreSpec { layout: layout.clone(), drives, files, holders, checksums }, held))
}

/// One range request's outcome.
type Slot = Mutex<Option<Result<Vec<u8>, HubError>>>;

/// The expert source of the stream install `install`: the store `local` over its registered packs
/// (`held`: their experts, from [`local_spec`]), streaming the rest from the install's hub.
pub fn source(
    install: StreamInstall,
    local: Arc<ExpertStore>,
    held: Held,
    ck: Arc<Checkpoint>,
    roster: &Roster,
) -> Result<StreamSource, HubError> {
    let layout =
        roster.expert_layout.clone().ok_or_else(|| HubError::Other("the model has no routed experts".into()))?;
    let sums = crate::store::sums::ExpertSums::records(&ck, roster);
    let experts = roster.experts.iter().flatten().map(Vec::len).sum();
    let origin = HubOrigin::new(install, ck, roster, layout.len);
    Ok(StreamSource::new(Box::new(origin), layout, experts, local, held, sums))
}

/// Where a stream install's experts come from: its hub, by HTTP range; streamed experts are kept
/// in packs on the install's drives and registered in its registry.
pub struct HubOrigin {
    install: StreamInstall,
    hub: Hub,
    fp: String,
    ck: Arc<Checkpoint>,
    /// Bytes of one expert.
    expert_len: usize,
    locs: Vec<Option<Vec<ExpertLoc>>>,
    requests: AtomicU64,
    http_bytes: AtomicU64,
}

impl HubOrigin {
    /// The origin of `install`'s experts (the hub token from the environment).
    pub fn new(install: StreamInstall, ck: Arc<Checkpoint>, roster: &Roster, expert_len: usize) -> Self {
        let token = super::client::env_token();
        let hub = Hub::new(&install.endpoint, token, HubOptions::from_env());
        let fp = fingerprint::fingerprint(&ck);
        HubOrigin {
            install,
            hub,
            fp,
            ck,
            expert_len,
            locs: roster.experts.clone(),
            requests: AtomicU64::new(0),
            http_bytes: AtomicU64::new(0),
        }
    }

    /// The images of `missing` experts of `layer`, by HTTP range (adjacent ones in one request).
    fn fetch_images(&self, layer: usize, missing: &[u32]) -> Result<Vec<Vec<u8>>, HubError> {
        let locs = self.locs.get(layer).and_then(|l| l.as_ref()).ok_or(HubError::NoExpert { layer, expert: None })?;
        // Pieces (shard, start, len, expert index in `missing`, dest), merged into requests.
        let mut pieces = Vec::new();
        for (i, &e) in missing.iter().enumerate() {
            let loc = locs.get(e as usize).ok_or(HubError::NoExpert { layer, expert: Some(e) })?;
            for x in &loc.extents {
                pieces.push((x.shard, x.start, x.len, i, x.dest));
            }
        }
        pieces.sort_by_key(|p| (p.0, p.1));
        let mut reqs: Vec<(usize, u64, u64, Vec<usize>)> = Vec::new();
        for (pi, p) in pieces.iter().enumerate() {
            match reqs.last_mut() {
                Some(r) if r.0 == p.0 && r.2 == p.1 && r.2 + p.2 - r.1 <= MAX_REQUEST => {
                    r.2 += p.2;
                    r.3.push(pi);
                }
                _ => reqs.push((p.0, p.1, p.1 + p.2, vec![pi])),
            }
        }
        let mut images: Vec<Vec<u8>> = vec![vec![0u8; self.expert_len]; missing.len()];
        let next = std::sync::atomic::AtomicUsize::new(0);
        let out: Vec<Slot> = reqs.iter().map(|_| Mutex::new(None)).collect();
        std::thread::scope(|s| {
            for _ in 0..PARALLEL.min(reqs.len()) {
                s.spawn(|| {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(r) = reqs.get(i) else { break };
                        let res = self.fetch_range(r.0, r.1, r.2);
                        if let Ok(mut g) = out[i].lock() {
                            *g = Some(res);
                        }
                    }
                });
            }
        });
        let results = out.into_iter().map(|m| {
            m.into_inner().ok().flatten().unwrap_or_else(|| Err(HubError::Other("range request not run".into())))
        });
        for (r, res) in reqs.iter().zip(results) {
            let bytes = res?;
            for &pi in &r.3 {
                let (_, start, plen, i, dest) = pieces[pi];
                let at = (start - r.1) as usize;
                images[i][dest as usize..(dest + plen) as usize].copy_from_slice(&bytes[at..at + plen as usize]);
            }
        }
        Ok(images)
    }

    fn fetch_range(&self, shard: usize, start: u64, end: u64) -> Result<Vec<u8>, HubError> {
        let name = self.ck.shard_path(shard).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let file = self.install.shard(&name).ok_or_else(|| {
            HubError::Other(format!("{}: shard {name} is not listed in {RECORD}", self.install.dir.display()))
        })?;
        let b = self.hub.get_range(&self.install.repo, &self.install.commit, file, start, end)?;
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.http_bytes.fetch_add(b.len() as u64, Ordering::Relaxed);
        Ok(b)
    }

    /// Writes the experts into a new pack on the layer's drive and registers it (atomically, under
    /// the install's lock, merged with what other processes registered meanwhile).
    fn keep_pack(&self, layer: usize, ids: &[u32], images: &[Vec<u8>]) -> Result<Vec<Kept>, HubError> {
        let d = layer % self.install.drives.len();
        let dir = self.install.pack_dir(d, &self.fp);
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |t| t.as_nanos());
        let name = format!("L{layer}-e{}-n{}-{}-{nanos}.pack", ids[0], ids.len(), std::process::id());
        let raw = fingerprint::raw(&self.fp);
        let h = pack::write_pack_named(
            &dir,
            &name,
            &raw,
            layer,
            self.expert_len as u64,
            ids.iter().zip(images).map(|(&e, b)| (e, std::borrow::Cow::Borrowed(b.as_slice()))),
            &mut |_| {},
        )
        .map_err(|e| match e {
            pack::PackError::Io { path, source } if source.raw_os_error() == Some(libc::ENOSPC) => {
                HubError::DriveFull { path, layer }
            }
            e => HubError::Pack(e),
        })?;
        let lock_path = self.install.dir.join(LOCK);
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io(&lock_path))?;
        lock.lock().map_err(io(&lock_path))?;
        let mut reg = StreamPlacement::load(&self.install.dir)?;
        reg.version = 1;
        reg.model = self.fp.clone();
        reg.packs.push(StreamPack { drive: d, layer, file: name.clone(), experts: ids.to_vec() });
        let p = self.install.dir.join(REGISTRY);
        let body = serde_json::to_vec_pretty(&reg).map_err(|e| HubError::Other(e.to_string()))?;
        crate::util::write_atomic(&p, &body).map_err(io(&p))?;
        drop(lock);
        let path = dir.join(&name);
        Ok(h.entries
            .iter()
            .map(|e| Kept { expert: e.expert, path: path.clone(), offset: e.offset, xxh3: e.xxh3 })
            .collect())
    }
}

impl StreamOrigin for HubOrigin {
    fn endpoint(&self) -> &str {
        &self.install.endpoint
    }

    fn describe(&self) -> String {
        format!("{}/{}", self.install.endpoint, self.install.repo)
    }

    fn report_root(&self) -> String {
        format!("{}/{}@{}", self.install.endpoint, self.install.repo, fingerprint::short(&self.install.commit))
    }

    fn fetch(&self, layer: usize, missing: &[u32]) -> Result<Vec<Vec<u8>>, OriginError> {
        Ok(self.fetch_images(layer, missing)?)
    }

    fn keep(&self, layer: usize, ids: &[u32], images: &[Vec<u8>]) -> Result<Vec<Kept>, OriginError> {
        Ok(self.keep_pack(layer, ids, images)?)
    }

    fn counts(&self) -> (u64, u64) {
        (self.http_bytes.load(Ordering::Relaxed), self.requests.load(Ordering::Relaxed))
    }
}
