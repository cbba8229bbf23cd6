//! What a batch records and says: each result written (one synced write a record, or a line on
//! standard output), the progress over the input's lines, and the end — what Ctrl-C left, or the
//! summary line and an error listing every failed line (this run's and an earlier run's).
//!
//! Contract: a request cancelled by Ctrl-C is not recorded (a rerun runs it); every other result
//! is, whole, before the next starts; the failed lines are reported by number, sorted.

use super::batch_io::is_std;
use super::signals::interrupted;
use anyhow::Result;
use serde_json::Value;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

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
        // Stopped by Ctrl-C: not done, so not recorded (a rerun runs it).
        if record["finish_reason"] == "cancelled" {
            return Ok(());
        }
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

    /// The batch's end: what Ctrl-C left, or the summary line; an error listing every failed line
    /// (this run's and those an earlier run recorded) when any failed.
    pub fn finish(
        self,
        output: &Path,
        skipped: u64,
        failed_before: Vec<u64>,
        summary: &str,
        t0: Instant,
    ) -> Result<()> {
        if interrupted() {
            eprintln!("{}", interrupted_note(&self, skipped, output));
            return Ok(());
        }
        let (ok, errors) = (self.ok, self.failed.len());
        eprintln!(
            "deltafin: batch: {ok} done, {errors} failed, {skipped} already in the output, in {:.1} s{summary}",
            t0.elapsed().as_secs_f64(),
        );
        let mut failed = self.failed;
        let earlier = failed_before.len();
        failed.extend(failed_before);
        if !failed.is_empty() {
            let whose =
                if earlier > 0 { format!(" ({earlier} of them recorded by an earlier run)") } else { String::new() };
            let at = if is_std(output) { "standard output".to_string() } else { output.display().to_string() };
            anyhow::bail!(
                "{} of the batch's requests failed{whose}: {} (their error records are in {at})",
                failed.len(),
                line_list(&failed)
            );
        }
        Ok(())
    }
}

/// What Ctrl-C on a batch leaves: the lines done (this run and before) and how to go on.
fn interrupted_note(r: &Results, skipped: u64, out: &Path) -> String {
    let done = r.ok + r.failed.len() as u64;
    let left = r.lines.saturating_sub(done + skipped);
    let resume = match is_std(out) {
        true => "the results went to standard output".to_string(),
        false => {
            format!("run the same command again to do the other {left} ({} holds every finished line)", out.display())
        }
    };
    format!(
        "deltafin: batch: interrupted (Ctrl-C): {done} line(s) done in this run ({} failed), {skipped} before it, \
         {left} not done; {resume}",
        r.failed.len()
    )
}

/// "lines 4, 5 and 9" (the first 10, then how many more).
fn line_list(lines: &[u64]) -> String {
    let mut v = lines.to_vec();
    v.sort_unstable();
    let shown: Vec<String> = v.iter().take(10).map(u64::to_string).collect();
    let more = if v.len() > 10 { format!(" and {} more", v.len() - 10) } else { String::new() };
    format!("line{} {}{more}", if v.len() == 1 { "" } else { "s" }, shown.join(", "))
}
