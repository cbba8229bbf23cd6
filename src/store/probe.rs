//! Drive read ceilings: random 16 MiB O_DIRECT reads at the engine's queue depth, through the same
//! readers the store uses, over a probe file (or over existing data, e.g. the shards).

use super::cache::Slab;
use super::io::reader::{DirectFile, Done, ReadOp, ReaderKind, new_reader};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Size of one probe read.
pub const PROBE_READ: u64 = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    /// No expert holder to read (a model without routed experts, or no pack on the drives asked).
    #[error("nothing to measure: no expert holder to read")]
    NothingToMeasure,
    #[error("cannot allocate the probe's read buffers ({slots} x {len} bytes): {source}")]
    Buffers { slots: usize, len: u64, source: std::io::Error },
    #[error("cannot start the reader ({kind:?}): {source}")]
    Reader { kind: ReaderKind, source: std::io::Error },
    /// A read of `path` (None: waiting for completions) failed.
    #[error("read failed{}: {source}", path.as_ref().map(|p| format!(" ({})", p.display())).unwrap_or_default())]
    Read { path: Option<PathBuf>, source: std::io::Error },
}

/// Result of a measurement.
#[derive(Clone, Debug)]
pub struct Ceiling {
    pub gbps: f64,
    pub bytes: u64,
    pub seconds: f64,
    pub direct: bool,
    /// Rates (GB/s) of the successive windows of [`WINDOW`].
    pub windows: Vec<f64>,
    /// True when the last [`STABLE_WINDOWS`] windows agreed within [`STABLE_SPREAD`] of their mean
    /// (the measurement stopped there); false when it ran to its time cap first.
    pub stable: bool,
}

/// Length of one rate window of a measurement.
pub const WINDOW: Duration = Duration::from_millis(500);
/// Windows that must agree before a measurement may stop.
pub const STABLE_WINDOWS: usize = 4;
/// Their largest allowed relative distance from their mean.
pub const STABLE_SPREAD: f64 = 0.05;

/// True when the last [`STABLE_WINDOWS`] rates lie within [`STABLE_SPREAD`] of their mean.
pub fn is_stable(windows: &[f64]) -> bool {
    if windows.len() < STABLE_WINDOWS {
        return false;
    }
    let last = &windows[windows.len() - STABLE_WINDOWS..];
    let mean = last.iter().sum::<f64>() / last.len() as f64;
    mean > 0.0 && last.iter().all(|r| (r - mean).abs() <= STABLE_SPREAD * mean)
}

pub use crate::util::free_bytes;

/// Writes a probe file of `size` bytes in `dir`, measures it, deletes it.
pub fn measure_dir(
    dir: &Path,
    size: u64,
    qd: usize,
    reader: ReaderKind,
    time: Duration,
) -> Result<Ceiling, ProbeError> {
    let path = dir.join(".deltafin-probe");
    let io = |source| ProbeError::Io { path: path.clone(), source };
    let size = size.max(PROBE_READ * 2) / PROBE_READ * PROBE_READ;
    {
        let mut f = std::fs::File::create(&path).map_err(io)?;
        // macOS: cached pages of the probe file would be what its F_NOCACHE reads measure.
        super::io::reader::keep_writes_uncached(&f);
        // Incompressible, non-zero content so no layer can shortcut the reads.
        let mut rng = crate::util::XorShift(0x9E37_79B9_7F4A_7C15);
        let chunk: Vec<u8> = (0..(1 << 20)).map(|_| rng.next_u64() as u8).collect();
        let mut left = size;
        while left > 0 {
            let n = left.min(chunk.len() as u64) as usize;
            if let Err(e) = f.write_all(&chunk[..n]) {
                drop(f);
                let _ = std::fs::remove_file(&path);
                return Err(io(e));
            }
            left -= n as u64;
        }
        crate::util::sync_file(&f).map_err(io)?;
    }
    let ranges: Vec<(PathBuf, u64)> = (0..size / PROBE_READ).map(|i| (path.clone(), i * PROBE_READ)).collect();
    let r = measure_ranges(&ranges, PROBE_READ, qd, reader, time);
    let _ = std::fs::remove_file(&path);
    r
}

/// Random reads of `len` bytes at the given (file, offset) places (offsets 4 KiB-aligned), `qd`
/// in flight, for at least `time` (and 2 x qd reads), then on until the rate is stable
/// ([`is_stable`]) or 3 x `time` has passed. The rate is over the whole measurement.
pub fn measure_ranges(
    ranges: &[(PathBuf, u64)],
    len: u64,
    qd: usize,
    reader: ReaderKind,
    time: Duration,
) -> Result<Ceiling, ProbeError> {
    if ranges.is_empty() {
        return Err(ProbeError::NothingToMeasure);
    }
    let mut files: Vec<(PathBuf, DirectFile)> = Vec::new();
    let mut idx = Vec::with_capacity(ranges.len());
    for (p, off) in ranges {
        let i = match files.iter().position(|(q, _)| q == p) {
            Some(i) => i,
            None => {
                let f = DirectFile::open(p).map_err(|source| ProbeError::Io { path: p.clone(), source })?;
                files.push((p.clone(), f));
                files.len() - 1
            }
        };
        idx.push((i, *off));
    }
    let direct = files.iter().all(|(_, f)| f.direct);
    let qd = qd.max(1);
    let slab = Slab::new(qd, len as usize).map_err(|source| ProbeError::Buffers { slots: qd, len, source })?;
    let table: super::io::reader::FileTable = files.iter().map(|(_, f)| f.fd()).collect();
    let mut rd =
        new_reader(reader, qd, &slab.iovecs(), table).map_err(|source| ProbeError::Reader { kind: reader, source })?;
    // The file each slot's read is of (for a failed read's message).
    let mut slot_file = vec![0usize; qd];
    let mut free: Vec<usize> = (0..qd).collect();
    let mut rng = crate::util::XorShift(0x2545_F491_4F6C_DD1D);
    let mut next = || rng.next_u64();
    let t0 = Instant::now();
    let (mut issued, mut bytes) = (0usize, 0u64);
    let min_reads = 2 * qd;
    let mut done: Vec<Done> = Vec::new();
    let (mut windows, mut window_start, mut window_bytes) = (Vec::new(), t0, 0u64);
    let mut stable = false;
    loop {
        let now = Instant::now();
        if now - window_start >= WINDOW {
            windows.push(window_bytes as f64 / (now - window_start).as_secs_f64() / 1e9);
            (window_start, window_bytes) = (now, 0);
            stable = is_stable(&windows);
        }
        let elapsed = now - t0;
        let keep_issuing = (elapsed < time || !stable) && elapsed < 3 * time || issued < min_reads;
        while keep_issuing && let Some(slot) = free.pop() {
            let (fi, off) = idx[(next() % idx.len() as u64) as usize];
            let op = ReadOp {
                tag: slot as u64,
                file: fi as u32,
                offset: off,
                len: len as usize,
                buf: slab.slot_ptr(slot),
                buf_index: Some(slot as u16),
            };
            slot_file[slot] = fi;
            let failed = |source| ProbeError::Read { path: Some(files[fi].0.clone()), source };
            // SAFETY: slot buffers are exclusively owned by this read until it completes.
            unsafe { rd.submit(op) }.map_err(failed)?;
            issued += 1;
        }
        if rd.in_flight() == 0 {
            break;
        }
        rd.reap(Some(Duration::from_secs(5)), &mut done).map_err(|source| ProbeError::Read { path: None, source })?;
        for d in done.drain(..) {
            let path = slot_file.get(d.tag as usize).map(|&fi| files[fi].0.clone());
            let n = d.result.map_err(|source| ProbeError::Read { path, source })?;
            bytes += n as u64;
            window_bytes += n as u64;
            free.push(d.tag as usize);
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    Ok(Ceiling { gbps: bytes as f64 / seconds / 1e9, bytes, seconds, direct, windows, stable })
}

#[cfg(test)]
mod tests {
    use super::is_stable;

    #[test]
    fn stability_needs_enough_windows_that_agree() {
        assert!(!is_stable(&[1.0, 1.0, 1.0]));
        assert!(is_stable(&[0.2, 1.0, 1.02, 0.98, 1.01]));
        assert!(!is_stable(&[1.0, 1.0, 1.0, 1.3]));
        assert!(!is_stable(&[0.0; 6]));
    }
}
