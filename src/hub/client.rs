//! The hub client: speaks the Hugging Face hub's conventions over blocking HTTP (ureq).
//!
//! Contract:
//! - The endpoint is `HF_ENDPOINT` (default `https://huggingface.co`); `HF_TOKEN` (or the older
//!   `HUGGING_FACE_HUB_TOKEN`) is sent as `Authorization: Bearer` only to the endpoint's own origin
//!   (scheme, host, port): redirects are followed here, hop by hop, and a hop to any other origin
//!   (the hub's CDN) goes without it.
//! - [`Hub::repo_info`] resolves a revision to its commit and lists that commit's files with sizes
//!   and checksums (`/api/models/{repo}/revision/{rev}?blobs=true`); every file is then taken from
//!   `{endpoint}/{repo}/resolve/{commit}/{file}`, never from a moving branch.
//! - [`Hub::get_range`] returns exactly the bytes asked for or an error: the status must be 206 and
//!   `Content-Range` must name exactly that range of a file of the expected size; 5xx, 429 and
//!   dropped connections are retried with exponential backoff; 401/403 give a token hint, 404 names
//!   the repo, revision and file.
//! - Failing fast: a hub that cannot be reached (DNS failure, connection refused, no answer to the
//!   connection within 10 s) is retried once, then [`HubError::Unreachable`] says what to check;
//!   an endpoint that is not an http(s) URL, other 4xx answers and TLS failures are final at once.
//!   Each retry is announced (a warning) with its wait.
//! - `HF_HUB_OFFLINE=1` (as `huggingface_hub` reads it): no request is sent ([`HubError::Offline`]
//!   names what was needed); listings and files come from the Hugging Face cache (`hfcache::list`).
//!   How failures are classified and URLs handled is `net`'s.

use crate::setting::{Action, Setting};
use serde::Deserialize;
use std::io::Read;
use std::time::Duration;

pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error(
        "{url}: HTTP {status}: access denied{}. Set HF_TOKEN to a token that can read {repo} (https://huggingface.co/settings/tokens){}",
        if *.had_token { " with the HF_TOKEN given" } else { "" },
        if *.had_token { "" } else { "; none is set" }
    )]
    Denied { url: String, status: u16, repo: String, had_token: bool },
    #[error("{what} not found (HTTP 404 from {url})")]
    NotFound { url: String, what: String },
    #[error("{url}: HTTP {status}{}", if *.tries > 1 { format!(" (after {} tries)", .tries) } else { String::new() })]
    Status { url: String, status: u16, tries: u32 },
    #[error("{url}: {msg}{}", if *.tries > 1 { format!(" (after {} tries)", .tries) } else { String::new() })]
    Transport { url: String, msg: String, tries: u32 },
    #[error("{url}: {msg}")]
    Protocol { url: String, msg: String },
    /// The hub cannot be reached at all (name, route, refusal): retried once, not for minutes.
    #[error(
        "cannot reach the hub: {url}: {msg}{}. Check the network and HF_ENDPOINT (default {DEFAULT_ENDPOINT}); with HF_HUB_OFFLINE=1, {} installs from the Hugging Face cache only",
        if *.tries > 1 { format!(" (after {} tries)", .tries) } else { String::new() }, Action::Setup
    )]
    Unreachable { url: String, msg: String, tries: u32 },
    /// HF_ENDPOINT is not a URL requests can go to.
    #[error("HF_ENDPOINT {endpoint:?} is not a hub URL: {msg} (expected http://HOST[:PORT] or https://HOST[:PORT])")]
    BadEndpoint { endpoint: String, msg: String },
    /// HF_HUB_OFFLINE is set and what is needed is not in the Hugging Face cache.
    #[error("HF_HUB_OFFLINE is set, and {what} is not in the Hugging Face cache; unset HF_HUB_OFFLINE to download it")]
    Offline { what: String },
    #[error("{}: {source}", path.display())]
    Io { path: std::path::PathBuf, source: std::io::Error },
    #[error(
        "{}: the disk is full ({written} of {size} bytes of {file} written). Free some space and run the same {} again: it resumes from here",
        path.display(), Action::Setup
    )]
    DiskFull { path: std::path::PathBuf, file: String, written: u64, size: u64 },
    #[error(
        "not enough free space in {}: {} needed, {} free. Free some space or choose another {} ({} needs room for the trunk only)",
        dir.display(), crate::util::human_bytes(*.need), crate::util::human_bytes(*.free), Setting::Dir, Action::SetupStream
    )]
    NoSpace { dir: std::path::PathBuf, need: u64, free: u64 },
    #[error(
        "{file}: downloaded bytes have {what} {got}, the hub says {want} (fetched {tries} times; the server or the network corrupts data)"
    )]
    Checksum { file: String, what: &'static str, got: String, want: String, tries: u32 },
    #[error("{} {repo:?}: expected ORG/NAME", Setting::Repo)]
    BadRepo { repo: String },
    /// A stream install asked into a directory that holds a full checkpoint.
    #[error("{} already holds a checkpoint; give {} an empty {}", dir.display(), Action::SetupStream, Setting::Dir)]
    HoldsCheckpoint { dir: std::path::PathBuf },
    /// A stream install of one commit asked to become another's.
    #[error("{} is a stream install of commit {have}, not {want}; use another {}", dir.display(), Setting::Dir)]
    OtherCommit { dir: std::path::PathBuf, have: String, want: String },
    /// A stream install that did not finish.
    #[error("{}: {} did not finish here; run it again to complete the install", dir.display(), Action::SetupStream)]
    Unfinished { dir: std::path::PathBuf },
    /// A stream install's drive is full.
    #[error(
        "{}: the drive is full; the streamed experts of layer {layer} cannot be kept (free space, or add a {} to the install)",
        path.display(), Setting::Drive
    )]
    DriveFull { path: std::path::PathBuf, layer: usize },
    /// A file deltafin wrote (an install record, a registry) that does not parse as one.
    #[error("{}: not a valid {what}: {msg}", path.display())]
    Malformed { path: std::path::PathBuf, what: &'static str, msg: String },
    /// A record of a format version this deltafin does not read.
    #[error("{}: unsupported version {got} (this deltafin reads version {expected})", path.display())]
    Version { path: std::path::PathBuf, expected: u32, got: u32 },
    /// A stream install's registry of streamed packs belongs to another model.
    #[error("{}: registered for model {theirs}, but {} is model {ours}", path.display(), dir.display())]
    OtherModel { path: std::path::PathBuf, dir: std::path::PathBuf, theirs: String, ours: String },
    /// An expert the model does not have (`expert` None: the layer has no routed experts).
    #[error("{}", match expert { Some(e) => format!("expert {e} of layer {layer} does not exist"), None => format!("layer {layer} has no routed experts") })]
    NoExpert { layer: usize, expert: Option<u32> },
    /// A repo file the hub lists with neither a sha256 (LFS) nor a git blob id.
    #[error("{0}: the hub gave no checksum to verify it against")]
    NoChecksum(String),
    /// A repo that is not a safetensors checkpoint (neither an index nor `model.safetensors`).
    #[error("{repo} at {revision} has neither {index} nor model.safetensors: not a safetensors checkpoint")]
    NotSafetensors { repo: String, revision: String, index: &'static str },
    /// A shard the checkpoint's index names that the repo does not have.
    #[error("{index} names shard {shard}, which {repo} at {revision} does not have")]
    MissingShard { index: &'static str, shard: String, repo: String, revision: String },
    /// A download stopped (another file failed, or its hashing thread ended) before it finished.
    #[error("{file}: download stopped: {why}")]
    Stopped { file: String, why: &'static str },
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    #[error(transparent)]
    Pack(#[from] crate::store::pack::PackError),
    #[error("{0}")]
    Other(String),
}

use super::net::{Failure, check_endpoint};
pub use super::net::{check_file_path, encode_path, encode_segment, join_url, origin};

/// Retries of a request to a hub that cannot be reached (see the module contract).
const UNREACHABLE_RETRIES: u32 = 1;

impl HubError {
    /// Worth retrying: the server or the connection failed, not the request.
    fn retryable(&self) -> bool {
        match self {
            HubError::Status { status, .. } => *status >= 500 || *status == 429 || *status == 408,
            HubError::Transport { .. } | HubError::Unreachable { .. } => true,
            _ => false,
        }
    }

    /// How many retries this failure gets of the `budget` (`HubOptions::retries`).
    fn retry_budget(&self, budget: u32) -> u32 {
        match self {
            HubError::Unreachable { .. } => budget.min(UNREACHABLE_RETRIES),
            _ => budget,
        }
    }
}

/// Retry and timeout policy (environment overrides for tests: `DELTAFIN_HUB_RETRIES`,
/// `DELTAFIN_HUB_BACKOFF_MS`, `DELTAFIN_HUB_TIMEOUT_S`).
#[derive(Clone, Debug)]
pub struct HubOptions {
    /// Attempts after the first for one request (a download that makes progress starts over).
    pub retries: u32,
    /// First backoff; doubled per retry, capped at 30 s.
    pub backoff: Duration,
    /// A connection that delivers nothing for this long is dropped (and retried).
    pub read_timeout: Duration,
}

impl Default for HubOptions {
    fn default() -> Self {
        HubOptions { retries: 6, backoff: Duration::from_millis(500), read_timeout: Duration::from_secs(60) }
    }
}

impl HubOptions {
    pub fn from_env() -> Self {
        let mut o = HubOptions::default();
        let num = |k: &str| std::env::var(k).ok().and_then(|v| v.trim().parse::<u64>().ok());
        if let Some(n) = num("DELTAFIN_HUB_RETRIES") {
            o.retries = n.min(100) as u32;
        }
        if let Some(n) = num("DELTAFIN_HUB_BACKOFF_MS") {
            o.backoff = Duration::from_millis(n);
        }
        if let Some(n) = num("DELTAFIN_HUB_TIMEOUT_S") {
            o.read_timeout = Duration::from_secs(n.max(1));
        }
        o
    }

    /// The wait before retry `n` (1-based): the backoff doubled per retry, at most 30 s.
    pub fn delay(&self, n: u32) -> Duration {
        self.backoff.saturating_mul(1u32 << (n.saturating_sub(1)).min(16)).min(Duration::from_secs(30))
    }

    /// Sleep before retry `n` (1-based).
    pub fn pause(&self, n: u32) {
        std::thread::sleep(self.delay(n));
    }
}

/// One file of a repo at a commit.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RepoFile {
    /// Path in the repo (checked: relative, no `..`).
    pub path: String,
    pub size: u64,
    /// LFS sha256 (hex), for files stored in LFS.
    pub sha256: Option<String>,
    /// Git blob id (sha1 hex of "blob {len}\0" + bytes): the checksum of non-LFS files.
    pub blob_id: Option<String>,
}

impl RepoFile {
    /// A name for the file's content (its LFS sha256 or blob id).
    pub fn content_key(&self) -> &str {
        self.sha256.as_deref().or(self.blob_id.as_deref()).unwrap_or("unknown")
    }
}

/// A revision resolved to a commit, with that commit's files.
#[derive(Clone, Debug)]
pub struct RepoInfo {
    pub repo: String,
    pub revision: String,
    pub commit: String,
    pub files: Vec<RepoFile>,
}

impl RepoInfo {
    pub fn file(&self, path: &str) -> Option<&RepoFile> {
        self.files.iter().find(|f| f.path == path)
    }
}

#[derive(Deserialize)]
struct ApiModel {
    sha: Option<String>,
    #[serde(default)]
    siblings: Vec<ApiSibling>,
}

#[derive(Deserialize)]
struct ApiSibling {
    rfilename: String,
    size: Option<u64>,
    #[serde(rename = "blobId")]
    blob_id: Option<String>,
    lfs: Option<ApiLfs>,
}

#[derive(Deserialize)]
struct ApiLfs {
    sha256: String,
    size: Option<u64>,
}

/// A response whose status was accepted, after redirects.
pub struct Fetched {
    pub status: u16,
    /// The final URL (after redirects).
    pub url: String,
    /// The hub's ETag for the file: `X-Linked-Etag` (or `ETag`) of the first hop, unquoted.
    pub hub_etag: Option<String>,
    pub content_range: Option<String>,
    pub content_length: Option<u64>,
    pub body: ureq::Body,
}

/// A client for one endpoint (cheap to clone; connections are pooled).
#[derive(Clone)]
pub struct Hub {
    pub endpoint: String,
    origin: String,
    token: Option<String>,
    agent: ureq::Agent,
    pub opts: HubOptions,
    /// `HF_HUB_OFFLINE`: send nothing (see the module contract).
    pub offline: bool,
}

impl Hub {
    /// The endpoint and token from the environment.
    pub fn from_env() -> Self {
        let endpoint = std::env::var("HF_ENDPOINT").ok().filter(|s| !s.trim().is_empty());
        let mut hub = Hub::new(endpoint.as_deref().unwrap_or(DEFAULT_ENDPOINT), env_token(), HubOptions::from_env());
        hub.offline = super::net::offline_from_env();
        hub
    }

    pub fn new(endpoint: &str, token: Option<String>, opts: HubOptions) -> Self {
        let endpoint = endpoint.trim().trim_end_matches('/').to_string();
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            // Redirects are followed by hand, so the token's origin rule is ours to enforce.
            .max_redirects(0)
            .accept_encoding("identity")
            .user_agent(concat!("deltafin/", env!("CARGO_PKG_VERSION")))
            // A hub that does not answer a connection in 10 s is not there (see `Unreachable`).
            .timeout_connect(Some(Duration::from_secs(10)))
            .timeout_recv_response(Some(opts.read_timeout))
            .timeout_per_read(Some(opts.read_timeout))
            .build()
            .new_agent();
        Hub { origin: origin(&endpoint), endpoint, token, agent, opts, offline: false }
    }

    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    /// `{endpoint}/{repo}/resolve/{commit}/{file}`.
    pub fn file_url(&self, repo: &str, commit: &str, file: &str) -> String {
        format!("{}/{repo}/resolve/{commit}/{}", self.endpoint, encode_path(file))
    }

    /// One request (with redirects followed, the token only to the endpoint's origin); no retry.
    fn send(&self, url: &str, range: Option<(u64, Option<u64>)>) -> Result<Fetched, HubError> {
        if self.offline {
            return Err(HubError::Offline { what: url.to_string() });
        }
        let mut url = url.to_string();
        let mut hub_etag = None;
        for hop in 0..10 {
            let mut req = self.agent.get(&url);
            if let Some(t) = &self.token
                && origin(&url) == self.origin
            {
                req = req.header("Authorization", format!("Bearer {t}"));
            }
            if let Some((a, b)) = range {
                req = req.header("Range", b.map_or(format!("bytes={a}-"), |b| format!("bytes={a}-{b}")));
            }
            let resp = req.call().map_err(|e| match super::net::classify(e) {
                Failure::Unreachable(msg) => HubError::Unreachable { url: url.clone(), msg, tries: 1 },
                Failure::Final(msg) => HubError::Protocol { url: url.clone(), msg },
                Failure::Transient(msg) => HubError::Transport { url: url.clone(), msg, tries: 1 },
            })?;
            let status = resp.status().as_u16();
            let header = |k: &str| resp.headers().get(k).and_then(|v| v.to_str().ok()).map(str::to_string);
            if hop == 0 {
                hub_etag = header("x-linked-etag").or_else(|| header("etag")).map(|e| unquote_etag(&e));
            }
            if (300..400).contains(&status) && status != 304 {
                let Some(loc) = header("location") else {
                    return Err(HubError::Protocol { url, msg: format!("HTTP {status} without a Location") });
                };
                url = join_url(&url, &loc);
                continue;
            }
            let content_range = header("content-range");
            let content_length = header("content-length").and_then(|v| v.trim().parse().ok());
            let (_, body) = resp.into_parts();
            return Ok(Fetched { status, url, hub_etag, content_range, content_length, body });
        }
        Err(HubError::Protocol { url, msg: "more than 10 redirects".into() })
    }

    /// [`Self::send`] with the status checked (2xx, and 416 for a range past the end) and errors
    /// classified; retried on 5xx/429/transport failures. `what` names the thing for a 404.
    pub fn open(
        &self,
        url: &str,
        range: Option<(u64, Option<u64>)>,
        repo: &str,
        what: &str,
    ) -> Result<Fetched, HubError> {
        if self.offline {
            return Err(HubError::Offline { what: what.to_string() });
        }
        let mut tries = 0u32;
        loop {
            tries += 1;
            let r = self.send(url, range).and_then(|f| match f.status {
                200..=299 | 416 => Ok(f),
                401 | 403 => Err(HubError::Denied {
                    url: url.to_string(),
                    status: f.status,
                    repo: repo.to_string(),
                    had_token: self.has_token(),
                }),
                404 => Err(HubError::NotFound { url: url.to_string(), what: what.to_string() }),
                s => Err(HubError::Status { url: f.url, status: s, tries }),
            });
            match r {
                Err(e) if e.retryable() && tries <= e.retry_budget(self.opts.retries) => {
                    let d = self.opts.delay(tries);
                    let what = match &e {
                        HubError::Unreachable { url, msg, .. } => format!("cannot reach the hub: {url}: {msg}"),
                        e => e.to_string(),
                    };
                    tracing::warn!("{what}; retrying in {:.1} s", d.as_secs_f64());
                    std::thread::sleep(d);
                }
                Err(HubError::Status { url, status, .. }) => return Err(HubError::Status { url, status, tries }),
                Err(HubError::Transport { url, msg, .. }) => return Err(HubError::Transport { url, msg, tries }),
                Err(HubError::Unreachable { url, msg, .. }) => return Err(HubError::Unreachable { url, msg, tries }),
                r => return r,
            }
        }
    }

    /// Resolves `revision` to a commit and lists that commit's files.
    pub fn repo_info(&self, repo: &str, revision: &str) -> Result<RepoInfo, HubError> {
        check_repo(repo)?;
        check_endpoint(&self.endpoint).map_err(|msg| HubError::BadEndpoint { endpoint: self.endpoint.clone(), msg })?;
        let url = format!("{}/api/models/{repo}/revision/{}?blobs=true", self.endpoint, encode_segment(revision));
        let what = format!("repo {repo} at revision {revision}");
        let mut tries = 0;
        let body = loop {
            tries += 1;
            let mut f = self.open(&url, None, repo, &what)?;
            match f.body.with_config().limit(256 << 20).read_to_vec() {
                Ok(b) => break b,
                Err(e) if tries <= self.opts.retries => {
                    tracing::info!("{url}: {e}; retrying");
                    self.opts.pause(tries);
                }
                Err(e) => return Err(HubError::Transport { url, msg: e.to_string(), tries }),
            }
        };
        let api: ApiModel = serde_json::from_slice(&body)
            .map_err(|e| HubError::Protocol { url: url.clone(), msg: format!("not the hub's model JSON: {e}") })?;
        let bad = |msg: String| HubError::Protocol { url: url.clone(), msg };
        let commit = api.sha.ok_or_else(|| bad("no `sha` (commit) in the answer".into()))?;
        if commit.len() != 40 || !commit.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad(format!("`sha` {commit:?} is not a commit id")));
        }
        let mut files = Vec::with_capacity(api.siblings.len());
        for s in api.siblings {
            check_file_path(&s.rfilename).map_err(|m| bad(format!("file {:?}: {m}", s.rfilename)))?;
            let size = s
                .lfs
                .as_ref()
                .and_then(|l| l.size)
                .or(s.size)
                .ok_or_else(|| bad(format!("file {} has no size (is blobs=true supported?)", s.rfilename)))?;
            let sha256 = s.lfs.map(|l| l.sha256.to_ascii_lowercase());
            let hexlen = |h: &Option<String>, n: usize| {
                h.as_ref().is_none_or(|h| h.len() == n && h.bytes().all(|b| b.is_ascii_hexdigit()))
            };
            if !hexlen(&sha256, 64) || !hexlen(&s.blob_id, 40) {
                return Err(bad(format!("file {}: malformed sha256 or blobId", s.rfilename)));
            }
            if sha256.is_none() && s.blob_id.is_none() {
                return Err(bad(format!("file {} has neither an LFS sha256 nor a blobId to verify", s.rfilename)));
            }
            files.push(RepoFile {
                path: s.rfilename,
                size,
                sha256,
                blob_id: s.blob_id.map(|b| b.to_ascii_lowercase()),
            });
        }
        Ok(RepoInfo {
            repo: repo.to_string(),
            revision: revision.to_string(),
            commit: commit.to_ascii_lowercase(),
            files,
        })
    }

    /// Exactly bytes `[start, end)` of `file` (of `size` bytes) at `commit`, checked against the
    /// response's status, `Content-Range` and length, and — when the hub sends one and `etag` is
    /// given — its ETag. Retried like [`Self::open`], also when the body breaks off.
    pub fn get_range(
        &self,
        repo: &str,
        commit: &str,
        file: &RepoFile,
        start: u64,
        end: u64,
    ) -> Result<Vec<u8>, HubError> {
        let url = self.file_url(repo, commit, &file.path);
        if start >= end || end > file.size {
            return Err(HubError::Other(format!("{url}: bad range {start}..{end} of a {}-byte file", file.size)));
        }
        let what = format!("file {} of repo {repo} at commit {commit}", file.path);
        let mut tries = 0;
        loop {
            tries += 1;
            // Only a broken body is retried here: `open` has retried the request itself.
            let f = self.open(&url, Some((start, Some(end - 1))), repo, &what)?;
            let r = (|| {
                check_range(&url, &f, file, start, end)?;
                let mut out = Vec::with_capacity((end - start) as usize);
                let mut rd = f.body.into_reader().take(end - start + 1);
                rd.read_to_end(&mut out).map_err(|e| HubError::Transport {
                    url: url.clone(),
                    msg: e.to_string(),
                    tries,
                })?;
                if out.len() as u64 != end - start {
                    return Err(HubError::Transport {
                        url: url.clone(),
                        msg: format!("got {} bytes of the {} asked for", out.len(), end - start),
                        tries,
                    });
                }
                Ok(out)
            })();
            match r {
                // A response that is not the range asked for (a confused proxy) is asked again too.
                Err(e) if (e.retryable() || matches!(e, HubError::Protocol { .. })) && tries <= self.opts.retries => {
                    tracing::info!("{e}; retrying");
                    self.opts.pause(tries);
                }
                r => return r,
            }
        }
    }
}

/// `HF_TOKEN` (or the older `HUGGING_FACE_HUB_TOKEN`), when set and not empty.
pub fn env_token() -> Option<String> {
    ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"]
        .iter()
        .find_map(|k| std::env::var(k).ok().map(|t| t.trim().to_string()).filter(|t| !t.is_empty()))
}

/// Checks a range response: 206, `Content-Range: bytes start-(end-1)/size`, the length, the ETag.
pub fn check_range(url: &str, f: &Fetched, file: &RepoFile, start: u64, end: u64) -> Result<(), HubError> {
    let bad = |msg: String| HubError::Protocol { url: url.to_string(), msg };
    if f.status != 206 {
        return Err(bad(format!("asked for bytes {start}-{} and got HTTP {} instead of 206", end - 1, f.status)));
    }
    let want = format!("bytes {start}-{}/{}", end - 1, file.size);
    match &f.content_range {
        Some(cr) if cr.trim() == want => {}
        Some(cr) => return Err(bad(format!("Content-Range is `{cr}`, expected `{want}`"))),
        None => return Err(bad(format!("no Content-Range in a 206 response (expected `{want}`)"))),
    }
    if let Some(n) = f.content_length
        && n != end - start
    {
        return Err(bad(format!("Content-Length {n} for a {}-byte range", end - start)));
    }
    check_etag(url, f, file)
}

/// The hub's ETag of an LFS file is its sha256: a different one means another version of the file.
pub fn check_etag(url: &str, f: &Fetched, file: &RepoFile) -> Result<(), HubError> {
    if let (Some(tag), Some(sha)) = (&f.hub_etag, &file.sha256)
        && tag.len() == 64
        && !tag.eq_ignore_ascii_case(sha)
    {
        return Err(HubError::Protocol {
            url: url.to_string(),
            msg: format!("the hub's ETag {tag} is not the file's sha256 {sha}: the file changed under this commit?"),
        });
    }
    Ok(())
}

fn unquote_etag(e: &str) -> String {
    e.trim().trim_start_matches("W/").trim_matches('"').to_string()
}

/// `ORG/NAME` with plain characters.
pub fn check_repo(repo: &str) -> Result<(), HubError> {
    let ok = repo.split('/').count() == 2
        && repo.split('/').all(|p| {
            !p.is_empty()
                && p != "."
                && p != ".."
                && p.bytes().all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b))
        });
    if ok { Ok(()) } else { Err(HubError::BadRepo { repo: repo.to_string() }) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_and_joins() {
        assert_eq!(origin("https://huggingface.co/x"), "https://huggingface.co:443");
        assert_eq!(origin("http://127.0.0.1:8080/a?b"), "http://127.0.0.1:8080");
        assert_ne!(origin("http://127.0.0.1:8080/"), origin("http://127.0.0.1:8081/"));
        assert_eq!(join_url("http://a:1/x/y/z", "/q"), "http://a:1/q");
        assert_eq!(join_url("http://a:1/x/y/z", "w"), "http://a:1/x/y/w");
        assert_eq!(join_url("http://a:1/x", "http://b:2/c"), "http://b:2/c");
        assert_eq!(join_url("https://a/x", "//cdn/c"), "https://cdn/c");
        assert_eq!(encode_segment("refs/pr/1"), "refs%2Fpr%2F1");
        assert_eq!(encode_path("a b/c.json"), "a%20b/c.json");
        assert!(check_file_path("../x").is_err() && check_file_path("a//b").is_err() && check_file_path("a/b").is_ok());
        assert!(check_repo("moonshotai/Kimi-K3").is_ok() && check_repo("a/../b").is_err() && check_repo("a").is_err());
    }
}
