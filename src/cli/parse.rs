//! The CLI's value parsers: each checks its range and says what it expected, so a bad value is a
//! usage error (exit 2) naming the flag, never a late failure or a clamp.

/// Most kernel threads accepted: far past any core count, short of exhausting the process's threads.
pub(crate) const MAX_THREADS: usize = 1024;

/// `--threads N`: 1..=MAX_THREADS.
pub(crate) fn parse_threads(s: &str) -> Result<usize, String> {
    let n: usize = s.parse().map_err(|_| format!("`{s}` is not a thread count (expected 1..={MAX_THREADS})"))?;
    if !(1..=MAX_THREADS).contains(&n) {
        return Err(format!("{n} threads is outside 1..={MAX_THREADS}"));
    }
    Ok(n)
}

/// `--qd N` (reads in flight per drive): 1..=MAX_QD.
pub(crate) fn parse_qd(s: &str) -> Result<usize, String> {
    use crate::store::io::reader::MAX_QD;
    let n: usize = s.parse().map_err(|_| format!("`{s}` is not a queue depth (expected 1..={MAX_QD})"))?;
    if !(1..=MAX_QD).contains(&n) {
        return Err(format!("queue depth {n} is outside 1..={MAX_QD}"));
    }
    Ok(n)
}

/// A size in GB that must be a finite number > 0 (`--memory-gb`).
pub(crate) fn parse_gb_positive(s: &str) -> Result<f64, String> {
    let g = parse_gb(s)?;
    if g == 0.0 {
        return Err("must be > 0".into());
    }
    Ok(g)
}

/// A size in GB that must be a finite number >= 0 (`--expert-cache-gb`).
pub(crate) fn parse_gb(s: &str) -> Result<f64, String> {
    let g: f64 = s.parse().map_err(|_| format!("`{s}` is not a number of GB"))?;
    // Far above any machine (1 EB), so that g * 1e9 stays exact enough and fits u64.
    if !g.is_finite() || !(0.0..=1e9).contains(&g) {
        return Err(format!("`{s}` is not a size in GB (expected a finite number from 0 to 1e9)"));
    }
    Ok(g)
}

/// A duration in seconds: a finite number > 0 and at most a day (`serve --read-timeout`).
pub(crate) fn parse_seconds(s: &str) -> Result<f64, String> {
    let t: f64 = s.parse().map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if !t.is_finite() || t <= 0.0 || t > 86_400.0 {
        return Err(format!("`{s}` is not a duration (expected seconds above 0, at most 86400)"));
    }
    Ok(t)
}

/// A sampling temperature: 0 (greedy: K3's argmax) to 2, as the server accepts.
pub(crate) fn parse_temperature(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(t) if t.is_finite() && (0.0..=2.0).contains(&t) => Ok(t),
        _ => Err(format!("`{s}` is not a temperature (expected a number from 0, greedy, to 2)")),
    }
}

/// A nucleus mass: 0 to 1 (0 keeps only the most likely token), as the server accepts.
pub(crate) fn parse_top_p(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(p) if p.is_finite() && (0.0..=1.0).contains(&p) => Ok(p),
        _ => Err(format!("`{s}` is not a top-p (expected a probability mass from 0 to 1)")),
    }
}

/// A min-p ratio: 0 to 1 (0 keeps every token).
pub(crate) fn parse_min_p(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(p) if p.is_finite() && (0.0..=1.0).contains(&p) => Ok(p),
        _ => Err(format!("`{s}` is not a min-p (expected a ratio from 0 to 1)")),
    }
}
