//! Progress on long waits (model load, prompt prefill, pack writing, synth, batch lines), on
//! stderr only: a bar redrawn in place when stderr is a terminal, nothing in pipes and tests —
//! unless asked with `DELTAFIN_PROGRESS=1` (then one plain line every 2 seconds, for logs), or
//! silenced with `DELTAFIN_PROGRESS=0`.
//!
//! Contract: the rate and the ETA are computed here from the work done since the first update
//! (time spent before the work began, e.g. measuring drives, and work found already done do not
//! count), so an ETA is remaining work / measured rate, shown only once a rate is known.

use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::time::{Duration, Instant};

/// How progress is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Off,
    /// Redrawn in place (stderr is a terminal).
    Bar,
    /// One line every few seconds (asked for where stderr is not a terminal).
    Lines,
}

static QUIET: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Turns progress off for the rest of the process (a subcommand's `-q`).
pub fn set_quiet(quiet: bool) {
    if quiet {
        QUIET.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The mode for this process: `DELTAFIN_PROGRESS` (1/always: shown; 0/never: not), else a bar
/// when stderr is a terminal; `quiet` (or [`set_quiet`]) turns it off.
pub fn mode(quiet: bool) -> Mode {
    let tty = std::io::stderr().is_terminal();
    let quiet = quiet || QUIET.load(std::sync::atomic::Ordering::Relaxed);
    match std::env::var("DELTAFIN_PROGRESS").unwrap_or_default().trim() {
        _ if quiet => Mode::Off,
        "0" | "never" | "off" => Mode::Off,
        "1" | "always" | "on" if !tty => Mode::Lines,
        _ if tty => Mode::Bar,
        _ => Mode::Off,
    }
}

/// A duration for an ETA: "12s", "3m04s", "1h02m".
pub fn fmt_eta(s: f64) -> String {
    let s = s.max(0.0).round() as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

/// Bytes as GB / MB (decimal, like drive rates): "12.3 GB".
pub fn fmt_bytes(b: f64) -> String {
    if b >= 1e9 { format!("{:.1} GB", b / 1e9) } else { format!("{:.1} MB", b / 1e6) }
}

/// One long task's progress (see the module contract).
pub struct Progress {
    mode: Mode,
    label: String,
    bar: Option<ProgressBar>,
    /// (when, done) at the first update: where the rate is measured from.
    first: Option<(Instant, u64)>,
    last_line: Option<Instant>,
    started: Instant,
    /// The bar redraws itself (its elapsed time) since its first update.
    ticking: bool,
}

impl Progress {
    pub fn new(mode: Mode, label: &str) -> Self {
        let bar = (mode == Mode::Bar).then(|| {
            let b = ProgressBar::new(1);
            // The elapsed time moves between updates (a K3 layer of a long prompt takes seconds).
            b.set_style(
                ProgressStyle::with_template("{prefix} {bar:30} {elapsed} {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> "),
            );
            b.set_prefix(label.to_string());
            b
        });
        Progress {
            mode,
            label: label.to_string(),
            bar,
            first: None,
            last_line: None,
            started: Instant::now(),
            ticking: false,
        }
    }

    /// A spinner with the time waited so far, for waits without a measure (model load).
    pub fn spinner(mode: Mode, what: &str) -> Self {
        let mut p = Progress::new(Mode::Off, what);
        p.mode = mode;
        match mode {
            Mode::Bar => {
                let b = ProgressBar::new_spinner();
                b.set_style(
                    ProgressStyle::with_template("{spinner} {msg} {elapsed}")
                        .unwrap_or_else(|_| ProgressStyle::default_spinner()),
                );
                b.set_message(what.to_string());
                b.enable_steady_tick(Duration::from_millis(120));
                p.bar = Some(b);
            }
            Mode::Lines => eprintln!("deltafin: {what} ..."),
            Mode::Off => {}
        }
        p
    }

    /// Measured rate (units a second) and ETA in seconds, once known.
    fn rate(&mut self, done: u64, total: u64) -> Option<(f64, f64)> {
        let now = Instant::now();
        let (t0, d0) = *self.first.get_or_insert((now, done));
        let dt = (now - t0).as_secs_f64();
        (dt >= 0.5 && done > d0).then(|| {
            let rate = (done - d0) as f64 / dt;
            (rate, total.saturating_sub(done) as f64 / rate)
        })
    }

    /// `done` of `total` units; `what(done, total, rate)` writes the text after the bar (units,
    /// rate); the ETA is appended.
    pub fn update(&mut self, done: u64, total: u64, what: impl Fn(u64, u64, Option<f64>) -> String) {
        if self.mode == Mode::Off {
            return;
        }
        let r = self.rate(done, total);
        let mut msg = what(done, total, r.map(|(rate, _)| rate));
        if let Some((_, eta)) = r.filter(|_| done < total) {
            msg.push_str(&format!(", eta {}", fmt_eta(eta)));
        }
        match (&self.bar, self.mode) {
            (Some(b), _) => {
                b.set_length(total.max(1));
                b.set_position(done.min(total));
                b.set_message(msg);
                if !self.ticking {
                    self.ticking = true;
                    b.enable_steady_tick(Duration::from_millis(250));
                }
            }
            (None, Mode::Lines) => {
                let now = Instant::now();
                if self.last_line.is_none_or(|t| now - t >= Duration::from_secs(2)) || done >= total {
                    self.last_line = Some(now);
                    let elapsed = fmt_eta((now - self.started).as_secs_f64());
                    eprintln!("deltafin: {}: {msg} ({elapsed} so far)", self.label);
                }
            }
            _ => {}
        }
    }

    /// Bytes done of total, with the byte rate.
    pub fn bytes(&mut self, done: u64, total: u64) {
        self.update(done, total, |d, t, r| {
            let rate = r.map(|r| format!(", {}/s", fmt_bytes(r))).unwrap_or_default();
            format!("{} of {}{rate}", fmt_bytes(d as f64), fmt_bytes(t as f64))
        });
    }

    /// Removes the bar (nothing is left on the terminal).
    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etas_read_as_durations() {
        assert_eq!(fmt_eta(4.4), "4s");
        assert_eq!(fmt_eta(184.0), "3m04s");
        assert_eq!(fmt_eta(3720.0), "1h02m");
    }
}
