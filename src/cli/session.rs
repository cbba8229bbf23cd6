//! `run --session FILE`: a conversation that outlives the process. The first run creates FILE
//! with the session's state after its answer (engine/state_file.rs); a later run loads it and
//! feeds only what is new — the answer's last token, which generation never feeds, then the new
//! prompt (with `--chat`, the new user turn as the chat template renders it after the saved
//! messages) — so its output is what one uninterrupted process would have produced. Without a
//! prompt it goes on generating where the last run stopped, with the saved sampler (unless
//! `--temperature` or `--seed` is given anew).
//!
//! With `--chat` the next turn is what `chat` and `serve` would feed: the whole conversation as
//! the template renders it (each answer closed, `<|close|>response...<|end_of_msg|>`, also one cut
//! by `--max-new`), of which the session's tokens are a prefix; only the rest is fed. Where they
//! are not (an answer the template renders otherwise than it was generated), the conversation is
//! prefilled anew in a fresh session, as the server does when no kept session is a prefix: the
//! same greedy conversation gives the same tokens in all three.

use super::run_args::RunArgs;
use crate::engine::{Engine, SamplerPosition, Session, SessionNotes};
use crate::model::chat::{ChatOptions, ChatTemplate};
use crate::model::tokenizer::Tokenizer;
use crate::sample::{Sampler, SamplingSpec};
use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A session file and what it held.
pub struct SessionFile {
    pub path: PathBuf,
    /// Tokens the file's session holds (0 for a new file).
    pub tokens: usize,
    pub notes: SessionNotes,
    pub exists: bool,
    /// The saved session's tokens (read for `--chat`).
    ids: Vec<u32>,
    /// The saved session is not a prefix of the next chat turn: a fresh session runs it whole.
    fresh: bool,
    /// Held while this process uses the file: a second `run --session FILE` fails at once.
    _lock: crate::util::FileLock,
}

impl SessionFile {
    /// Locks `path` for this process and looks at it (its checked header; a missing file is a
    /// new session). A file another process is using, or one that is not a regular file (a FIFO,
    /// a device), is refused at once.
    pub fn peek(path: &Path) -> Result<Self> {
        if let Some(kind) = crate::util::special_file_kind(path) {
            bail!("the session file {} is {kind}, not a regular file", path.display());
        }
        let lock = crate::util::FileLock::acquire(&crate::util::FileLock::beside(path))
            .with_context(|| format!("cannot use the session file {}", path.display()))?;
        // A save killed mid-write left its temp file: gone now that no one else writes this file.
        if let (Some(dir), Some(name)) = (path.parent(), path.file_name()) {
            let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
            crate::util::remove_stale_temps(dir, &[&format!(".{}.tmp.", name.to_string_lossy())]);
        }
        if !path.exists() {
            crate::util::check_output_path(path)
                .with_context(|| format!("cannot create the session file {}", path.display()))?;
            let notes = SessionNotes::default();
            let (ids, fresh) = (Vec::new(), false);
            return Ok(SessionFile { path: path.into(), tokens: 0, notes, exists: false, ids, fresh, _lock: lock });
        }
        let p = crate::engine::state_file::peek(path, true)?;
        let (tokens, notes, ids, fresh) = (p.tokens, p.notes, p.ids, false);
        Ok(SessionFile { path: path.into(), tokens, notes, exists: true, ids, fresh, _lock: lock })
    }

    /// The saved chat messages.
    fn messages(&self) -> Vec<Value> {
        self.notes.meta.get("messages").and_then(Value::as_array).cloned().unwrap_or_default()
    }

    /// The ids to feed after the saved session: its unfed tokens, then the new prompt (`text`,
    /// or `ids`); with `--chat` the new user turn.
    fn continue_with(
        &mut self,
        a: &RunArgs,
        dir: &Path,
        tok: Option<&Tokenizer>,
        text: Option<&str>,
        ids: Option<&[u32]>,
    ) -> Result<Vec<u32>> {
        let mut out = self.notes.unfed.clone();
        match (a.chat, text, ids) {
            (true, Some(text), _) => {
                let tok = tok.context("--chat needs the model's tokenizer")?;
                let chat = ChatTemplate::load(dir, tok).context("cannot load the chat template")?;
                let opts = ChatOptions { thinking: a.thinking(dir)?, ..ChatOptions::default() };
                let old = self.messages();
                let mut all = old.clone();
                if let (true, Some(s)) = (old.is_empty(), &a.system) {
                    all.push(json!({"role": "system", "content": s}));
                }
                all.push(json!({"role": "user", "content": text}));
                let full = chat.encode(tok, &Value::Array(all.clone()), &opts)?;
                let held: Vec<u32> = self.ids.iter().chain(&self.notes.unfed).copied().collect();
                match (old.is_empty(), full.strip_prefix(&held[..])) {
                    // Not a chat session yet: the conversation starts after what it holds.
                    (true, _) => out.extend_from_slice(&full),
                    // Its unfed tokens, then the rest of the conversation.
                    (false, Some(_)) => out = full[self.ids.len()..].to_vec(),
                    (false, None) => {
                        self.fresh = true;
                        self.tokens = 0;
                        out = full;
                    }
                }
                self.notes.meta = json!({"messages": all});
            }
            (true, None, _) if !self.exists => bail!("--chat --session needs a prompt for a new session"),
            (_, Some(text), _) => out.extend(tok.context("text prompts need a tokenizer")?.encode(text)),
            (_, None, Some(ids)) => out.extend_from_slice(ids),
            _ => {}
        }
        if out.is_empty() && !self.exists {
            bail!("{} is a new session: give a prompt", self.path.display());
        }
        Ok(out)
    }

    /// The file's session (loaded and checked), or a new one.
    pub fn open(&self, engine: &Arc<Engine>) -> Result<Session> {
        if !self.exists || self.fresh {
            return Ok(engine.new_session());
        }
        Ok(engine.load_session(&self.path)?.0)
    }

    /// The saved sampler, unless the flags choose anew.
    pub fn sampler(&self, a: &RunArgs, fresh: SamplingSpec) -> Sampler {
        match (&self.notes.sampler, a.sampling.temperature, a.seed) {
            (Some(p), None, None) => p.sampler(),
            _ => Sampler::new(fresh),
        }
    }

    /// [`SessionFile::save`] when the session has run, reported on stderr unless `quiet`.
    pub fn save_after(
        &mut self,
        session: &Session,
        sampler: &Sampler,
        emitted: &[u32],
        answer: Option<(&str, &str)>,
        quiet: bool,
    ) -> Result<()> {
        if session.logits().is_none() {
            return Ok(());
        }
        let bytes = self.save(session, sampler, emitted, answer)?;
        if !quiet {
            let size = crate::util::human_bytes(bytes);
            eprintln!("deltafin: session saved to {} ({} tokens, {size})", self.path.display(), session.pos());
        }
        Ok(())
    }

    /// Saves `session` after a run that emitted `emitted` (the last one unfed), with the sampler
    /// and, with `--chat`, the answer appended to the messages.
    pub fn save(
        &mut self,
        session: &Session,
        sampler: &Sampler,
        emitted: &[u32],
        answer: Option<(&str, &str)>,
    ) -> Result<u64> {
        self.notes.unfed = emitted.last().map(|&t| vec![t]).unwrap_or_default();
        self.notes.sampler = Some(SamplerPosition::of(sampler));
        if let (Some((content, reasoning)), Some(m)) =
            (answer, self.notes.meta.get_mut("messages").and_then(Value::as_array_mut))
        {
            m.push(json!({"role": "assistant", "content": content, "reasoning_content": reasoning}));
        }
        Ok(session.save_state(&self.path, &self.notes)?)
    }
}

/// The ids `run --session` feeds after the saved session (see [`SessionFile::continue_with`]).
pub fn continuation(
    a: &RunArgs,
    dir: &Path,
    tok: Option<&Tokenizer>,
    texts: &[String],
    f: &mut SessionFile,
) -> Result<Vec<u32>> {
    if texts.len() > 1 {
        bail!("--session keeps one conversation: give one prompt");
    }
    let ids = a.prompt_ids.as_ref().map(|i| &i.0[..]);
    f.continue_with(a, dir, tok, texts.first().map(String::as_str), ids)
}
