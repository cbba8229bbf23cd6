//! Small shared helpers: files (`files.rs`: durable and atomic writes, locks, output-path checks,
//! stale temps, regular-file opens), the process's cancel request (Ctrl-C), f32 safetensors
//! output, the cache directory, byte formatting, dates, free space on a file system, macOS
//! `sysctl` values, and the eviction order of cache slots (the store's RAM cache and the GPU's
//! device cache).
//!
//! Contract: the lowest floor of the crate — it imports nothing of it, so every module may use it.

mod files;

pub use files::*;

use std::path::{Path, PathBuf};

/// Set once the user asked the process to stop (the CLI's Ctrl-C handler); long library work
/// that can stop cleanly (e.g. `synth`, which then removes its temporary files) polls it.
static CANCEL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Asks long work to stop at its next check (async-signal-safe: one atomic store).
pub fn request_cancel() {
    CANCEL.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// True once [`request_cancel`] was called.
pub fn cancel_requested() -> bool {
    CANCEL.load(std::sync::atomic::Ordering::SeqCst)
}
/// Serialises one f32 tensor as a safetensors file, atomically.
pub fn write_f32_safetensors(path: &Path, name: &str, shape: &[usize], data: &[f32]) -> std::io::Result<()> {
    let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.to_vec(), &bytes)
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    let out = safetensors::serialize([(name, view)], None).map_err(|e| std::io::Error::other(e.to_string()))?;
    write_atomic(path, &out)
}

static CACHE_DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// Makes [`cache_dir`] `dir` for the rest of this process (the first call wins): for a program
/// that embeds the library and keeps its own cache (the tests keep each test process's apart, as
/// `DELTAFIN_CACHE` does for the binary).
pub fn use_cache_dir(dir: PathBuf) {
    let _ = CACHE_DIR.set(dir);
}

/// deltafin's cache directory: the one [`use_cache_dir`] set, else `$DELTAFIN_CACHE`, else
/// `$XDG_CACHE_HOME/deltafin`, else `~/.cache/deltafin`.
pub fn cache_dir() -> std::path::PathBuf {
    // The library's own unit tests never touch the user's cache (.ci/run checks it).
    #[cfg(test)]
    use_cache_dir(std::env::temp_dir().join(format!("deltafin-unit-tests-{}", std::process::id())));
    if let Some(d) = CACHE_DIR.get() {
        return d.clone();
    }
    if let Some(d) = std::env::var_os("DELTAFIN_CACHE") {
        return d.into();
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return std::path::PathBuf::from(d).join("deltafin");
    }
    match std::env::var_os("HOME") {
        Some(h) => std::path::PathBuf::from(h).join(".cache/deltafin"),
        None => std::path::PathBuf::from(".deltafin-cache"),
    }
}

/// Human-readable byte count (binary units).
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{b} B") } else { format!("{v:.1} {}", UNITS[u]) }
}

/// The git revision the binary was built from ("unknown" outside a checkout).
pub fn git_revision() -> String {
    env!("DELTAFIN_GIT_REV").to_string()
}

/// Today's date (UTC) as YYYY-MM-DD.
pub fn today() -> String {
    let (y, m, d) = civil_today();
    format!("{y:04}-{m:02}-{d:02}")
}

/// Today's (year, month, day) in UTC (Howard Hinnant's civil-from-days algorithm).
pub fn civil_today() -> (i64, i64, i64) {
    let days =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() / 86_400).unwrap_or(0)
            as i64;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// xorshift64: cheap deterministic pseudo-random numbers for benchmark inputs and probe data.
pub struct XorShift(pub u64);

impl XorShift {
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
}

/// A seed for a sampler nobody gave one: the clock's nanoseconds mixed with the process id.
pub fn fresh_seed() -> u64 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    t ^ (u64::from(std::process::id()) << 32)
}

/// Cached slots in eviction order: lowest rank (how often the expert was requested) first, least
/// recently cached first among equals. O(log n) per change, so finding the victim is not a scan of
/// the cache on every landing expert.
pub struct EvictionOrder {
    /// (rank, recency) of each slot in the order.
    keys: Vec<Option<(u32, u64)>>,
    order: std::collections::BTreeSet<(u32, u64, usize)>,
    seq: u64,
}

impl EvictionOrder {
    pub fn new(n: usize) -> Self {
        EvictionOrder { keys: vec![None; n], order: std::collections::BTreeSet::new(), seq: 0 }
    }

    pub fn len(&self) -> usize {
        self.order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    pub fn contains(&self, i: usize) -> bool {
        self.keys[i].is_some()
    }

    /// Adds `i` (or moves it) as the most recently cached slot of rank `rank`.
    pub fn push(&mut self, i: usize, rank: u32) {
        self.remove(i);
        self.seq += 1;
        self.keys[i] = Some((rank, self.seq));
        self.order.insert((rank, self.seq, i));
    }

    /// Changes the rank of a cached slot, keeping its recency.
    pub fn rerank(&mut self, i: usize, rank: u32) {
        if let Some((r, seq)) = self.keys[i].filter(|&(r, _)| r != rank) {
            self.order.remove(&(r, seq, i));
            self.keys[i] = Some((rank, seq));
            self.order.insert((rank, seq, i));
        }
    }

    pub fn remove(&mut self, i: usize) {
        if let Some((r, seq)) = self.keys[i].take() {
            self.order.remove(&(r, seq, i));
        }
    }

    /// The next victim and its rank.
    pub fn first(&self) -> Option<(u32, usize)> {
        self.order.iter().next().map(|&(r, _, i)| (r, i))
    }

    /// Every slot with its rank, next victim first.
    pub fn iter(&self) -> impl Iterator<Item = (u32, usize)> + '_ {
        self.order.iter().map(|&(r, _, i)| (r, i))
    }
}

/// Free bytes of the file system holding `path` (or its nearest existing ancestor).
pub fn free_bytes(path: &Path) -> std::io::Result<u64> {
    let mut p = path.to_path_buf();
    while !p.exists() {
        if !p.pop() {
            p = PathBuf::from(".");
            break;
        }
    }
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: statvfs writes only into the zeroed struct we pass; the path is NUL-terminated.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(s.f_bavail as u64 * s.f_frsize as u64)
}

/// Bytes of memory this machine has: `MemTotal` (Linux), `hw.memsize` (macOS); None where it
/// cannot be read. What a process may use of it is `memory::machine_available`'s.
pub fn machine_memory() -> Option<u64> {
    #[cfg(target_os = "macos")]
    {
        sysctl_u64("hw.memsize")
    }
    #[cfg(not(target_os = "macos"))]
    {
        meminfo("MemTotal:")
    }
}

/// A field of `/proc/meminfo` (e.g. "MemAvailable:") in bytes.
#[cfg(not(target_os = "macos"))]
pub fn meminfo(field: &str) -> Option<u64> {
    let m = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = m.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
}

/// macOS: the integer sysctl `name` (4 or 8 bytes, e.g. `hw.memsize`), None where it cannot be read.
#[cfg(target_os = "macos")]
pub fn sysctl_u64(name: &str) -> Option<u64> {
    let c = std::ffi::CString::new(name).ok()?;
    let mut buf = [0u8; 8];
    let mut len: libc::size_t = buf.len();
    // SAFETY: sysctlbyname writes at most `len` bytes into `buf` and stores the length it wrote;
    // the name is NUL-terminated; no new value is set.
    let r = unsafe { libc::sysctlbyname(c.as_ptr(), buf.as_mut_ptr().cast(), &mut len, std::ptr::null_mut(), 0) };
    match (r, len) {
        (0, 4) => Some(u64::from(u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]))),
        (0, 8) => Some(u64::from_ne_bytes(buf)),
        _ => None,
    }
}

/// macOS: the string sysctl `name` (e.g. `machdep.cpu.brand_string`), None where it cannot be read.
#[cfg(target_os = "macos")]
pub fn sysctl_string(name: &str) -> Option<String> {
    let c = std::ffi::CString::new(name).ok()?;
    let mut len: libc::size_t = 0;
    // SAFETY: a null buffer asks only for the length, stored in `len`.
    if unsafe { libc::sysctlbyname(c.as_ptr(), std::ptr::null_mut(), &mut len, std::ptr::null_mut(), 0) } != 0 {
        return None;
    }
    let mut buf = vec![0u8; len];
    // SAFETY: as in sysctl_u64: at most `len` bytes into a buffer of that size.
    if unsafe { libc::sysctlbyname(c.as_ptr(), buf.as_mut_ptr().cast(), &mut len, std::ptr::null_mut(), 0) } != 0 {
        return None;
    }
    buf.truncate(len);
    let text = String::from_utf8_lossy(&buf);
    Some(text.trim_end_matches('\0').trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_order() {
        // Equal ranks: least recently cached first (the order the LRU list kept).
        let mut l = EvictionOrder::new(5);
        for i in [3, 1, 4] {
            l.push(i, 0);
        }
        l.push(3, 0);
        l.remove(4);
        let mut pop = || l.first().map(|(_, i)| i).inspect(|&i| l.remove(i));
        assert_eq!(pop(), Some(1));
        assert_eq!(pop(), Some(3));
        assert_eq!(pop(), None);
        assert!(l.is_empty());
        // Lower rank first whatever the recency; a rerank keeps recency.
        let mut o = EvictionOrder::new(4);
        o.push(0, 5);
        o.push(1, 2);
        o.push(2, 2);
        assert_eq!(o.first(), Some((2, 1)));
        o.rerank(1, 9);
        assert_eq!(o.first(), Some((2, 2)));
        o.rerank(2, 5);
        assert_eq!(o.first(), Some((5, 0)), "equal rank: the earlier cached goes first");
    }
}
