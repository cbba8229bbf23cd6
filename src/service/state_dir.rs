//! `serve --state-dir DIR`: the generator's kept sessions (a conversation after its last prompt
//! and after its answer, a long shared prefix) spilled to state files, so that they survive a
//! restart; a request whose tokens extend a saved session resumes from it and reports those
//! tokens as cached (`usage.prompt_tokens_details.cached_tokens`).
//!
//! Contract: files are named by the xxh3 of their tokens (`<16 hex>.dfstate`), written through
//! [`crate::engine::Session::save_state`] (atomic, durable) and loaded through
//! [`crate::engine::Engine::load_session`] (every check: a damaged file is never used). The
//! directory is bounded: after every spill the least recently used files go until the total is
//! at most the cap (the newest file always stays). Files of another model are left alone and
//! not counted. A spill or load that fails never fails the request: it runs from scratch, and
//! the failure is returned for the server's log.

use crate::engine::{Engine, Session, SessionNotes, StateFileError, state_file};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

const EXT: &str = "dfstate";

struct Entry {
    path: PathBuf,
    ids: Vec<u32>,
    bytes: u64,
    used: SystemTime,
}

/// The state files of one model in a directory, most recently used last.
pub struct StateDir {
    dir: PathBuf,
    cap: u64,
    model: String,
    entries: Vec<Entry>,
    /// Held while the server runs: a second server on the directory fails at start.
    _lock: crate::util::FileLock,
}

impl StateDir {
    /// Opens (creating) `dir` for `engine`'s model with a cap of `cap` bytes; returns it with a
    /// note for each file it could not use.
    pub fn open(engine: &Engine, dir: &Path, cap: u64) -> std::io::Result<(Self, Vec<String>)> {
        if let Ok(m) = std::fs::metadata(dir)
            && !m.is_dir()
        {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!("the state directory {} exists and is not a directory", dir.display()),
            ));
        }
        std::fs::create_dir_all(dir)?;
        let lock = crate::util::FileLock::acquire(&dir.join(".deltafin-state.lock")).map_err(|e| {
            std::io::Error::new(e.kind(), format!("the state directory {} cannot be used: {e}", dir.display()))
        })?;
        crate::util::remove_stale_temps(dir, &[&format!(".{EXT}.tmp.")]);
        let model = engine.model_fingerprint();
        let mut notes = Vec::new();
        let mut entries = Vec::new();
        for d in std::fs::read_dir(dir)? {
            let path = d?.path();
            if path.extension().is_none_or(|e| e != EXT) {
                continue;
            }
            if let Some(kind) = crate::util::special_file_kind(&path) {
                notes.push(format!("state dir: skipping {}: it is {kind}, not a regular file", path.display()));
                continue;
            }
            match state_file::peek(&path, true) {
                Ok(p) if p.model == model => {
                    let m = std::fs::metadata(&path)?;
                    entries.push(Entry { path, ids: p.ids, bytes: m.len(), used: m.modified()? });
                }
                Ok(_) => {}
                Err(e) => notes.push(format!("state dir: skipping {e}")),
            }
        }
        entries.sort_by_key(|e| e.used);
        let mut s = StateDir { dir: dir.into(), cap, model, entries, _lock: lock };
        s.evict();
        Ok((s, notes))
    }

    /// Saved sessions.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes of the saved sessions.
    pub fn bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    /// The longest saved session that `prompt` extends, as (index, tokens).
    pub fn best(&self, prompt: &[u32]) -> Option<(usize, usize)> {
        (self.entries.iter().enumerate())
            .filter(|(_, e)| e.ids.len() <= prompt.len() && prompt.starts_with(&e.ids))
            .max_by_key(|(_, e)| e.ids.len())
            .map(|(i, e)| (i, e.ids.len()))
    }

    /// Loads entry `i` (marking it used); a file that fails its checks is dropped from the index.
    pub fn load(&mut self, engine: &std::sync::Arc<Engine>, i: usize) -> Result<Session, StateFileError> {
        let e = self.entries.remove(i);
        let (s, _) = engine.load_session(&e.path)?;
        self.touch(e);
        Ok(s)
    }

    /// Saves `s` unless a file of its tokens is there already (then it is marked used).
    pub fn keep(&mut self, s: &Session) -> Result<(), StateFileError> {
        let ids = s.tokens();
        if ids.is_empty() || s.logits().is_none() {
            return Ok(());
        }
        if let Some(i) = self.entries.iter().position(|e| e.ids == ids) {
            let e = self.entries.remove(i);
            self.touch(e);
            return Ok(());
        }
        let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        let path = self.dir.join(format!("{:016x}.{EXT}", xxhash_rust::xxh3::xxh3_64(&bytes)));
        let size = s.save_state(&path, &SessionNotes::default())?;
        // A file of the same name held other tokens (a hash collision): it was just replaced.
        self.entries.retain(|e| e.path != path);
        self.entries.push(Entry { path, ids: ids.to_vec(), bytes: size, used: SystemTime::now() });
        self.evict();
        Ok(())
    }

    fn touch(&mut self, mut e: Entry) {
        e.used = SystemTime::now();
        // The file's time is the order a restart sees.
        if let Ok(f) = std::fs::File::options().append(true).open(&e.path) {
            let _ = f.set_modified(e.used);
        }
        self.entries.push(e);
    }

    /// Removes the least recently used files until the total is at most the cap.
    fn evict(&mut self) {
        while self.entries.len() > 1 && self.bytes() > self.cap {
            let e = self.entries.remove(0);
            let _ = std::fs::remove_file(&e.path);
        }
    }

    /// The model the directory's files are kept for (its fingerprint).
    pub fn model(&self) -> &str {
        &self.model
    }
}
