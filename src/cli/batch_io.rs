//! `deltafin batch`'s files: the input read whole, the output appended to, and the checks that
//! keep a user's file safe.
//!
//! Contract: `--out` is a regular file (or `-`, standard output), never the input itself (same
//! file by any path, link or hard link, also when the input is standard input or the output is
//! redirected into the input), and, when it exists, a batch output already: every line a record
//! (`service::batch::read_output`). Anything else is refused before the model is opened, the
//! file untouched: a FIFO or device would block or never end when read back to resume, and a
//! file of someone else's would be appended to and its last line cut. `--in` is a file, a pipe
//! or `-`; a device (`/dev/zero`, a terminal) is refused. (The results written into it:
//! `batch_results`.)

use crate::service::batch::{Done, read_output};
use anyhow::{Context, Result, bail};
use serde_json::Value;
use std::io::{Read, Seek, Write};
use std::path::Path;

pub fn is_std(p: &Path) -> bool {
    p.as_os_str() == "-"
}

/// True when `out` names this process's standard output and that is a pipe or a socket
/// (`--out /dev/stdout | cat`): it is written as `--out -` is, never opened to be read back (a
/// pipe read back would wait forever). A device (`/dev/null`, a terminal) is refused as before.
pub fn names_stdout(out: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    let stdout = crate::util::fd_id(1);
    !is_std(out)
        && std::fs::metadata(out).is_ok_and(|m| m.file_type().is_fifo() || m.file_type().is_socket())
        && stdout.is_some()
        && crate::util::file_id(out) == stdout
}

/// Refuses an input or output the run must not use (see the module contract), before any work.
pub fn check_paths(input: &Path, out: &Path) -> Result<()> {
    if !is_std(input) {
        if let Some(kind) = crate::util::special_file_kind(input).filter(|k| *k != "a FIFO" && *k != "a socket") {
            bail!(
                "--in {}: is {kind}, not a file of requests; give a file, or `--in -` to read standard input",
                input.display()
            );
        }
        if std::fs::metadata(input).is_ok_and(|m| m.is_dir()) {
            bail!("--in {}: is a directory, not a file of requests (one JSON request a line)", input.display());
        }
    }
    if is_std(out) {
        // `--out - >> requests.jsonl` would append the results to the requests.
        let stdout = crate::util::fd_id(1);
        let inp = if is_std(input) { None } else { crate::util::file_id(input) };
        if stdout.is_some() && stdout == inp {
            bail!(
                "standard output is the input file {}: the results would be appended to the requests",
                input.display()
            );
        }
        return Ok(());
    }
    if let Some(kind) = crate::util::special_file_kind(out) {
        bail!(
            "--out {}: is {kind}, not a regular file. batch appends each result to a file and reads it back to resume; \
             give a file path, or `--out -` for standard output",
            out.display()
        );
    }
    crate::util::check_append_path(out).map_err(|e| {
        anyhow::anyhow!(
            "--out {}: {e}. batch appends each result to a regular file and reads it back to resume; give a file \
             path, or `--out -` for standard output (e.g. `--out - > /dev/null` to discard the results)",
            out.display()
        )
    })?;
    let inp = if is_std(input) { crate::util::fd_id(0) } else { crate::util::file_id(input) };
    if let Some(id) = crate::util::file_id(out)
        && Some(id) == inp
    {
        let input =
            if is_std(input) { "standard input (--in -)".to_string() } else { format!("--in {}", input.display()) };
        bail!(
            "--out {} is the same file as {input}: the results would be appended to the requests; give another --out",
            out.display(),
        );
    }
    Ok(())
}

/// The input's bytes (standard input for `-`).
pub fn read_input(input: &Path) -> Result<Vec<u8>> {
    let mut bytes = Vec::new();
    if is_std(input) {
        std::io::stdin().read_to_end(&mut bytes).context("cannot read the batch from standard input")?;
    } else {
        bytes = std::fs::read(input).with_context(|| format!("cannot read {}", input.display()))?;
    }
    Ok(bytes)
}

/// Opens `out` for appending, locked against a second run appending the same results, and reads
/// what it holds: refused (untouched) unless it is a batch output (`force`: emptied instead); a
/// torn last line is cut.
pub fn open_output(out: &Path, force: bool, input: &Keys) -> Result<(std::fs::File, Done)> {
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .append(true)
        .create(true)
        .open(out)
        .with_context(|| format!("cannot open {} for appending", out.display()))?;
    match f.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => bail!(
            "{} is being written by another `deltafin batch` run: wait for it to finish (this run would repeat its \
             requests), or choose another --out",
            out.display()
        ),
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(e).with_context(|| format!("cannot lock {}", out.display()));
        }
    }
    let mut bytes = Vec::new();
    f.read_to_end(&mut bytes).with_context(|| format!("cannot read {}", out.display()))?;
    if force && read_output(&bytes).is_err() {
        f.set_len(0).with_context(|| format!("cannot empty {}", out.display()))?;
        bytes.clear();
    }
    let (done, torn) = read_output(&bytes).map_err(|e| {
        anyhow::anyhow!(
            "--out {} exists and is not a batch output ({e}); refusing to append to it. Give a new file, the output \
             of an earlier run to resume it, or --force to replace it",
            out.display()
        )
    })?;
    if torn > 0 {
        // A run killed mid-write left part of a record: drop it, its request is redone.
        let whole = (bytes.len() - torn) as u64;
        f.set_len(whole).with_context(|| format!("cannot repair {}", out.display()))?;
        f.seek(std::io::SeekFrom::End(0))?;
        eprintln!("deltafin: batch: cut a torn last line ({torn} bytes) from {}", out.display());
    }
    bytes.truncate(bytes.len() - torn);
    let (kept, dropped, done) = without_errors(&bytes, done, input);
    if dropped > 0 {
        f = rewrite(out, &kept)?;
        eprintln!("deltafin: batch: {dropped} line(s) an earlier run failed run again (their error records replaced)");
    }
    Ok((f, done))
}

/// The ids of an input's lines and the numbers of its lines that hold anything: which error
/// records of an earlier run name a line this run can run again.
#[derive(Default)]
pub struct Keys {
    ids: std::collections::HashSet<String>,
    lines: std::collections::HashSet<u64>,
}

impl Keys {
    pub fn of(lines: &[(u64, Result<&str, usize>)]) -> Keys {
        let mut k = Keys::default();
        for (n, l) in lines {
            let text = l.as_ref().map_or("x", |t| *t);
            if !text.trim().is_empty() {
                k.lines.insert(*n);
            }
            if let Some(id) = l.ok().and_then(|t| serde_json::from_str::<Value>(t).ok()).and_then(|v| id_key(&v["id"]))
            {
                k.ids.insert(id);
            }
        }
        k
    }
}

/// A record's or a line's id as the output keys it (a string, or a number's digits).
fn id_key(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// A batch output's records less the errors of lines to run again — an error record whose id
/// has no result and is in `input` (an id-less one: whose line is), a line the user may have
/// fixed since — how many went, and what is done: the ids with a result. Other error records
/// stay (an id repeated in the input beside its result, a line of another input).
fn without_errors(bytes: &[u8], mut done: Done, input: &Keys) -> (Vec<u8>, usize, Done) {
    done.ids.retain(|_, error| !*error);
    let mut kept = Vec::with_capacity(bytes.len());
    let mut dropped = 0;
    for line in bytes.split_inclusive(|&b| b == b'\n') {
        let v: Value = serde_json::from_slice(line).unwrap_or_default();
        let again = match id_key(&v["id"]) {
            Some(id) => !done.ids.contains_key(&id) && input.ids.contains(&id),
            None => v["line"].as_u64().is_some_and(|n| input.lines.contains(&n)),
        };
        if v.get("error").is_some() && again {
            dropped += 1;
            if let Some(n) = v["line"].as_u64() {
                done.lines.remove(&n);
            }
        } else {
            kept.extend_from_slice(line);
        }
    }
    (kept, dropped, done)
}

/// Replaces `out` with `bytes` atomically and returns the new file, locked before it takes the
/// name (so no second run can slip in) and positioned for appending.
fn rewrite(out: &Path, bytes: &[u8]) -> Result<std::fs::File> {
    let mut new = None;
    crate::util::write_atomic_with(out, &mut |f| {
        f.try_lock().map_err(|e| std::io::Error::other(e.to_string()))?;
        f.write_all(bytes)?;
        new = Some(f.try_clone()?);
        Ok(())
    })
    .with_context(|| format!("cannot rewrite {}", out.display()))?;
    let mut f = new.context("the rewritten output")?;
    f.seek(std::io::SeekFrom::End(0))?;
    Ok(f)
}
