//! `deltafin batch`'s files: the input read whole, the output appended to, and the checks that
//! keep a user's file safe.
//!
//! Contract: `--out` is a regular file (or `-`, standard output), never the input itself (same
//! file by any path, link or hard link, also when the input is standard input or the output is
//! redirected into the input), and, when it exists, a batch output already: every line a record
//! (`service::batch::read_output`). Anything else is refused before the model is opened, the
//! file untouched: a FIFO or device would block or never end when read back to resume, and a
//! file of someone else's would be appended to and its last line cut. `--in` is a file, a pipe
//! or `-`; a device (`/dev/zero`, a terminal) is refused. Each result is one write, synced.

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
/// what it holds: refused (untouched) unless it is a batch output; a torn last line is cut.
pub fn open_output(out: &Path) -> Result<(std::fs::File, Done)> {
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
    let (done, torn) = read_output(&bytes).map_err(|e| {
        anyhow::anyhow!(
            "--out {} exists and is not a batch output ({e}); refusing to append to it. Give a new file, or the output \
             of an earlier run to resume it",
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
    Ok((f, done))
}

/// Where result records go: the output file (one synced write each) or standard output; what
/// went well and which lines failed.
pub struct Results {
    pub file: Option<std::fs::File>,
    pub ok: u64,
    pub failed: Vec<u64>,
    pub progress: super::progress::Progress,
    /// Lines of the input (for the progress).
    pub lines: u64,
}

impl Results {
    /// Shows the lines done (written, failed, or `skipped` as already in the output).
    pub fn tick(&mut self, skipped: u64) {
        let done = self.ok + self.failed.len() as u64 + skipped;
        let failed = self.failed.len();
        self.progress.update(done, self.lines, |d, t, rate| {
            let rate = rate.map(|r| format!(", {r:.2} lines/s")).unwrap_or_default();
            format!("{d}/{t} lines, {failed} failed{rate}")
        });
    }

    pub fn write(&mut self, record: &Value) -> std::io::Result<()> {
        if record.get("error").is_some() {
            self.failed.push(record["line"].as_u64().unwrap_or(0));
        } else {
            self.ok += 1;
        }
        // One write per record: a kill leaves whole lines (and at worst one torn last line).
        let mut text = record.to_string();
        text.push('\n');
        match &mut self.file {
            Some(f) => f.write_all(text.as_bytes()).and_then(|_| crate::util::sync_data(f)),
            None => {
                let mut o = std::io::stdout().lock();
                o.write_all(text.as_bytes()).and_then(|_| o.flush())
            }
        }
    }
}

/// "lines 4, 5 and 9" (the first 10, then how many more).
pub fn line_list(lines: &[u64]) -> String {
    let mut v = lines.to_vec();
    v.sort_unstable();
    let shown: Vec<String> = v.iter().take(10).map(u64::to_string).collect();
    let more = if v.len() > 10 { format!(" and {} more", v.len() - 10) } else { String::new() };
    format!("line{} {}{more}", if v.len() == 1 { "" } else { "s" }, shown.join(", "))
}
