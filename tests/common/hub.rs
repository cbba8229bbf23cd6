//! A real HTTP server on 127.0.0.1 that serves model repos in the Hugging Face hub's layout, for
//! the setup and stream tests: the model API (`/api/models/{repo}/revision/{rev}?blobs=true` with
//! sizes, blob ids and LFS sha256), `/{repo}/resolve/{rev}/{file}` with ETags and `Range`, LFS
//! files redirected to a second listener (another origin, like the hub's CDN), optional Bearer
//! auth, a request log, and injected faults (dropped connections, wrong bytes, 5xx, slow bodies,
//! wrong ranges). std only: one thread per connection, `Connection: close`.
#![allow(dead_code)]

use sha1::Digest as _;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Files at or above this size are LFS files (sha256, redirected to the CDN).
pub const LFS_MIN: usize = 64 * 1024;

#[derive(Clone, Debug)]
pub struct Logged {
    /// "hub" or "cdn".
    pub host: &'static str,
    pub path: String,
    pub range: Option<String>,
    pub auth: Option<String>,
    pub status: u16,
}

#[derive(Clone, Debug, PartialEq)]
pub enum FaultKind {
    /// Answer with this status and no body.
    Status(u16),
    /// Send the headers and this many body bytes, then close the connection.
    Drop(usize),
    /// Flip one body byte.
    Corrupt,
    /// Flip one body byte of a response that is the whole file (a request without `Range`).
    CorruptWhole,
    /// Send the body in 16 KiB pieces with this pause between them.
    Slow(Duration),
    /// A 206 whose Content-Range and bytes start one byte late.
    WrongRange,
}

#[derive(Clone, Debug)]
pub struct Fault {
    /// Applies to requests whose path contains this.
    pub path_contains: String,
    pub kind: FaultKind,
    /// How many matching requests it applies to.
    pub times: usize,
}

struct File {
    bytes: Arc<Vec<u8>>,
    sha256: String,
    blob_id: String,
}

struct Repo {
    commit: String,
    files: Vec<(String, File)>,
}

#[derive(Default)]
struct State {
    repos: Mutex<HashMap<String, Repo>>,
    log: Mutex<Vec<Logged>>,
    token: Mutex<Option<String>>,
    faults: Mutex<Vec<Fault>>,
    redirect_lfs: Mutex<bool>,
    cdn: Mutex<String>,
    /// Bytes per second of every body (0 = unthrottled).
    throttle: Mutex<u64>,
    /// Send no ETag and no X-Linked-Etag (a server or proxy that strips them).
    no_etags: Mutex<bool>,
}

pub struct HubServer {
    pub url: String,
    pub cdn_url: String,
    state: Arc<State>,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl HubServer {
    /// Starts the hub and its CDN listener (threads live until the test process ends).
    pub fn start() -> HubServer {
        let state = Arc::new(State::default());
        *state.redirect_lfs.lock().unwrap() = true;
        let hub = TcpListener::bind("127.0.0.1:0").unwrap();
        let cdn = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", hub.local_addr().unwrap());
        let cdn_url = format!("http://{}", cdn.local_addr().unwrap());
        *state.cdn.lock().unwrap() = cdn_url.clone();
        for (l, host) in [(hub, "hub"), (cdn, "cdn")] {
            let st = Arc::clone(&state);
            std::thread::spawn(move || {
                for c in l.incoming().flatten() {
                    let st = Arc::clone(&st);
                    std::thread::spawn(move || {
                        let _ = serve(&st, c, host);
                    });
                }
            });
        }
        HubServer { url, cdn_url, state }
    }

    /// Adds (or replaces) a repo with every file of `dir` (recursively, relative names).
    pub fn add_repo_dir(&self, repo: &str, commit: &str, dir: &Path) {
        let mut files = Vec::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap().flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else {
                    let rel = p.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
                    files.push((rel, std::fs::read(&p).unwrap()));
                }
            }
        }
        self.add_repo(repo, commit, files);
    }

    pub fn add_repo(&self, repo: &str, commit: &str, files: Vec<(String, Vec<u8>)>) {
        let mut fs: Vec<(String, File)> = files
            .into_iter()
            .map(|(name, bytes)| {
                let sha256 = hex(&sha2::Sha256::digest(&bytes));
                let mut h = sha1::Sha1::new();
                h.update(format!("blob {}\0", bytes.len()).as_bytes());
                h.update(&bytes);
                let blob_id = hex(&h.finalize());
                (name, File { bytes: Arc::new(bytes), sha256, blob_id })
            })
            .collect();
        fs.sort_by(|a, b| a.0.cmp(&b.0));
        self.state.repos.lock().unwrap().insert(repo.to_string(), Repo { commit: commit.to_string(), files: fs });
    }

    /// Replaces one file's bytes but keeps the listed checksums (a server that serves wrong data).
    pub fn tamper(&self, repo: &str, file: &str, f: impl FnOnce(&mut Vec<u8>)) {
        let mut repos = self.state.repos.lock().unwrap();
        let r = repos.get_mut(repo).unwrap();
        let e = r.files.iter_mut().find(|x| x.0 == file).unwrap();
        let mut b = (*e.1.bytes).clone();
        f(&mut b);
        e.1.bytes = Arc::new(b);
    }

    pub fn require_token(&self, t: Option<&str>) {
        *self.state.token.lock().unwrap() = t.map(str::to_string);
    }

    pub fn redirect_lfs(&self, on: bool) {
        *self.state.redirect_lfs.lock().unwrap() = on;
    }

    /// Stops (or resumes) sending ETags: nothing in a response then names the file's version.
    pub fn no_etags(&self, on: bool) {
        *self.state.no_etags.lock().unwrap() = on;
    }

    pub fn throttle(&self, bytes_per_s: u64) {
        *self.state.throttle.lock().unwrap() = bytes_per_s;
    }

    pub fn fault(&self, path_contains: &str, kind: FaultKind, times: usize) {
        self.state.faults.lock().unwrap().push(Fault { path_contains: path_contains.into(), kind, times });
    }

    pub fn clear_faults(&self) {
        self.state.faults.lock().unwrap().clear();
    }

    pub fn log(&self) -> Vec<Logged> {
        self.state.log.lock().unwrap().clone()
    }

    pub fn clear_log(&self) {
        self.state.log.lock().unwrap().clear();
    }

    /// Requests for file bodies (resolve or CDN), not the API.
    pub fn file_requests(&self) -> Vec<Logged> {
        self.log().into_iter().filter(|l| !l.path.starts_with("/api/")).collect()
    }
}

fn take_fault(st: &State, path: &str, ranged: bool) -> Option<FaultKind> {
    let mut f = st.faults.lock().unwrap();
    let i = f.iter().position(|x| {
        x.times > 0 && path.contains(&x.path_contains) && !(ranged && x.kind == FaultKind::CorruptWhole)
    })?;
    f[i].times -= 1;
    Some(f[i].kind.clone())
}

fn respond(c: &mut TcpStream, status: u16, headers: &[(String, String)], body: &[u8]) -> std::io::Result<()> {
    let mut h = format!("HTTP/1.1 {status} X\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        h.push_str(&format!("{k}: {v}\r\n"));
    }
    h.push_str("\r\n");
    c.write_all(h.as_bytes())?;
    c.write_all(body)
}

fn serve(st: &State, mut c: TcpStream, host: &'static str) -> std::io::Result<()> {
    let mut rd = BufReader::new(c.try_clone()?);
    let mut line = String::new();
    rd.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let (_method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or("").to_string());
    let mut headers = HashMap::new();
    loop {
        let mut l = String::new();
        if rd.read_line(&mut l)? == 0 || l == "\r\n" || l == "\n" {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let path = target.split('?').next().unwrap_or("").to_string();
    let auth = headers.get("authorization").cloned();
    let range = headers.get("range").cloned();
    let log = |status: u16| {
        st.log.lock().unwrap().push(Logged {
            host,
            path: path.clone(),
            range: range.clone(),
            auth: auth.clone(),
            status,
        })
    };
    if host == "hub"
        && let Some(t) = st.token.lock().unwrap().clone()
        && auth.as_deref() != Some(&format!("Bearer {t}"))
    {
        let s = if auth.is_some() { 403 } else { 401 };
        log(s);
        return respond(&mut c, s, &[], b"{\"error\":\"auth\"}");
    }
    let fault = take_fault(st, &path, range.is_some());
    if let Some(FaultKind::Status(s)) = fault {
        log(s);
        return respond(&mut c, s, &[], b"");
    }
    // Find what is asked for.
    let decoded = percent_decode(&path);
    let (body, etag, extra): (Arc<Vec<u8>>, String, Vec<(String, String)>) = {
        let repos = st.repos.lock().unwrap();
        if let Some(rest) = decoded.strip_prefix("/api/models/") {
            let Some((repo, rev)) = rest.split_once("/revision/") else {
                log(404);
                return respond(&mut c, 404, &[], b"");
            };
            let Some(r) = repos.get(repo).filter(|r| rev == "main" || rev == r.commit) else {
                log(404);
                return respond(&mut c, 404, &[], b"{\"error\":\"Repository not found\"}");
            };
            let siblings: Vec<serde_json::Value> = r
                .files
                .iter()
                .map(|(n, f)| {
                    let mut v = serde_json::json!({"rfilename": n, "size": f.bytes.len(), "blobId": f.blob_id});
                    if f.bytes.len() >= LFS_MIN {
                        v["lfs"] = serde_json::json!({"sha256": f.sha256, "size": f.bytes.len(), "pointerSize": 134});
                        v["size"] = 134.into();
                    }
                    v
                })
                .collect();
            let j = serde_json::json!({"id": repo, "sha": r.commit, "siblings": siblings});
            (Arc::new(serde_json::to_vec(&j).unwrap()), String::new(), Vec::new())
        } else if let Some(sha) = decoded.strip_prefix("/cdn/") {
            let Some(f) = repos.values().flat_map(|r| r.files.iter()).find(|f| f.1.sha256 == sha) else {
                log(404);
                return respond(&mut c, 404, &[], b"");
            };
            (Arc::clone(&f.1.bytes), format!("\"cdn-{}\"", &sha[..8]), Vec::new())
        } else {
            let found = repos.iter().find_map(|(name, r)| {
                let rest = decoded.strip_prefix(&format!("/{name}/resolve/"))?;
                let (rev, file) = rest.split_once('/')?;
                (rev == r.commit || rev == "main").then_some((r, file.to_string()))
            });
            let Some((r, file)) = found else {
                log(404);
                return respond(&mut c, 404, &[], b"Entry not found");
            };
            let Some((_, f)) = r.files.iter().find(|x| x.0 == file) else {
                log(404);
                return respond(&mut c, 404, &[("X-Error-Code".into(), "EntryNotFound".into())], b"Entry not found");
            };
            let lfs = f.bytes.len() >= LFS_MIN;
            if lfs && *st.redirect_lfs.lock().unwrap() {
                let loc = format!("{}/cdn/{}", st.cdn.lock().unwrap(), f.sha256);
                log(302);
                let mut h = vec![
                    ("Location".into(), loc),
                    ("X-Linked-Size".into(), f.bytes.len().to_string()),
                    ("X-Repo-Commit".into(), r.commit.clone()),
                ];
                if !*st.no_etags.lock().unwrap() {
                    h.push(("X-Linked-Etag".into(), format!("\"{}\"", f.sha256)));
                }
                return respond(&mut c, 302, &h, b"");
            }
            let tag = if lfs { f.sha256.clone() } else { f.blob_id.clone() };
            (Arc::clone(&f.bytes), format!("\"{tag}\""), vec![("X-Repo-Commit".into(), r.commit.clone())])
        }
    };
    let len = body.len();
    let (status, start, end) = match range.as_deref().and_then(|r| r.strip_prefix("bytes=")) {
        Some(spec) => {
            let (a, b) = spec.split_once('-').unwrap_or((spec, ""));
            let a: usize = a.parse().unwrap_or(0);
            let b: usize = if b.is_empty() {
                len.saturating_sub(1)
            } else {
                b.parse::<usize>().unwrap_or(0).min(len.saturating_sub(1))
            };
            if a >= len {
                log(416);
                return respond(&mut c, 416, &[("Content-Range".into(), format!("bytes */{len}"))], b"");
            }
            (206, a, b + 1)
        }
        None => (200, 0, len),
    };
    let (start, end, shift) = match (&fault, status) {
        (Some(FaultKind::WrongRange), 206) if end < len => (start + 1, end + 1, true),
        _ => (start, end, false),
    };
    let _ = shift;
    let mut hdr = format!(
        "HTTP/1.1 {status} X\r\nConnection: close\r\nContent-Length: {}\r\nAccept-Ranges: bytes\r\n",
        end - start
    );
    if !etag.is_empty() && !*st.no_etags.lock().unwrap() {
        hdr.push_str(&format!("ETag: {etag}\r\n"));
    }
    if status == 206 {
        hdr.push_str(&format!("Content-Range: bytes {start}-{}/{len}\r\n", end - 1));
    }
    for (k, v) in extra {
        hdr.push_str(&format!("{k}: {v}\r\n"));
    }
    hdr.push_str("\r\n");
    log(status);
    c.write_all(hdr.as_bytes())?;
    let mut data = body[start..end].to_vec();
    if let Some(FaultKind::Corrupt | FaultKind::CorruptWhole) = fault
        && !data.is_empty()
    {
        let m = data.len() / 2;
        data[m] ^= 0x55;
    }
    let limit = match fault {
        Some(FaultKind::Drop(n)) => n.min(data.len()),
        _ => data.len(),
    };
    let throttle = *st.throttle.lock().unwrap();
    let piece = 16 << 10;
    let mut at = 0;
    while at < limit {
        let n = piece.min(limit - at);
        c.write_all(&data[at..at + n])?;
        at += n;
        if let Some(FaultKind::Slow(d)) = fault {
            std::thread::sleep(d);
        }
        if throttle > 0 {
            std::thread::sleep(Duration::from_secs_f64(n as f64 / throttle as f64));
        }
    }
    c.flush()?;
    let _ = c.shutdown(std::net::Shutdown::Both);
    Ok(())
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16)
        {
            out.push(v);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
