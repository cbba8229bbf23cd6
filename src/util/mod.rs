//! Small shared helpers: durable writes ([`sync_file`], [`sync_dir`]: the one place a file is made
//! durable, `F_FULLFSYNC` on macOS), atomic file writes (never through a non-regular file) and
//! output-path checks (also for a file appended to: a regular file, not the input), the process's
//! cancel request (Ctrl-C), f32 safetensors output, stale temp cleanup, cache directory, byte
//! formatting, dates, free space on a file system, macOS `sysctl` values, and the eviction order of
//! cache slots (the store's RAM cache and
//! the GPU's device cache).
//!
//! Contract: the lowest floor of the crate — it imports nothing of it, so every module may use it.

use std::io::Write;
use std::path::{Path, PathBuf};

/// Follows `path` through symbolic links (relative ones against their own directory) to the file
/// a write should replace; a dangling link resolves to the path it names.
pub fn resolve_links(path: &Path) -> std::io::Result<PathBuf> {
    let mut p = path.to_path_buf();
    // Linux gives up after 40 hops (ELOOP); so do we, so a link cycle is an error, not a hang.
    for _ in 0..40 {
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                let t = std::fs::read_link(&p)?;
                p = if t.is_absolute() { t } else { p.parent().unwrap_or(Path::new("")).join(t) };
            }
            _ => return Ok(p),
        }
    }
    Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "too many levels of symbolic links"))
}

/// What kind of non-regular file `m` is, for error messages.
fn file_kind(m: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = m.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// The regular file (existing or not) that an atomic write of `path` replaces: `path` with links
/// followed. Refuses a directory, FIFO, device or socket (renaming over one would destroy it).
fn write_target(path: &Path) -> std::io::Result<PathBuf> {
    let target = resolve_links(path)?;
    match std::fs::metadata(&target) {
        Ok(m) if !m.is_file() => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "{}is {}, not a regular file; refusing to replace it",
                if target == path { String::new() } else { format!("links to {} which ", target.display()) },
                file_kind(&m)
            ),
        )),
        _ => Ok(target),
    }
}

/// The identity of the file `path` names (links followed): (device, inode). Two paths with the
/// same identity are the same file, whatever links or hard links lead there.
pub fn file_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// The identity of the file open as descriptor `fd` (standard input 0, output 1), if any.
pub fn fd_id(fd: i32) -> Option<(u64, u64)> {
    // SAFETY: fstat writes only into the zeroed struct we pass; a bad descriptor is an error.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    (unsafe { libc::fstat(fd, &mut st) } == 0).then_some((st.st_dev as u64, st.st_ino as u64))
}

/// Checks a file that results are appended to (and read back, to resume): it is a regular file
/// or does not exist yet (links followed), in a directory that exists. A directory, FIFO, device
/// or socket is refused (reading one back never ends or blocks; appending to one loses the
/// results or fails late), saying what it is.
pub fn check_append_path(path: &Path) -> std::io::Result<()> {
    let target = resolve_links(path)?;
    let via = if target == path { String::new() } else { format!("links to {} which ", target.display()) };
    match std::fs::metadata(&target) {
        Ok(m) if m.is_file() => Ok(()),
        Ok(m) => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{via}is {}, not a regular file", file_kind(&m)),
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let dir = parent_dir(&target);
            if dir.is_dir() {
                Ok(())
            } else {
                Err(std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("the directory {} does not exist", dir.display()),
                ))
            }
        }
        Err(e) => Err(e),
    }
}

/// What kind of file `path` is when it is not a regular file or a directory (a FIFO, device or
/// socket: what a tool that reads it to the end should not be given), links followed.
pub fn special_file_kind(path: &Path) -> Option<&'static str> {
    let m = std::fs::metadata(path).ok()?;
    (!m.is_file() && !m.is_dir()).then(|| file_kind(&m))
}

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

fn parent_dir(path: &Path) -> &Path {
    path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

fn temp_beside(target: &Path) -> PathBuf {
    let name = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "out".into());
    parent_dir(target).join(format!(".{name}.tmp.{}", std::process::id()))
}

/// Checks, before the work that produces it, that `write_atomic(path, ..)` can succeed: the target
/// is (or will be) a regular file and its directory accepts a new file (a temp file is created and
/// removed).
pub fn check_output_path(path: &Path) -> std::io::Result<()> {
    let target = write_target(path)?;
    let dir = parent_dir(&target);
    if !dir.is_dir() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("the directory {} does not exist", dir.display()),
        ));
    }
    let tmp = temp_beside(&target);
    std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
    std::fs::remove_file(&tmp)
}

/// Writes `bytes` to `path` atomically: temp file in the same directory, fsync, rename. A symbolic
/// link is followed and its target replaced (the link stays); a directory, FIFO, device or socket
/// is refused, never replaced. An existing file keeps its permissions.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_atomic_parts(path, &[bytes])
}

/// [`write_atomic`] of the concatenation of `parts`, without building it in memory.
pub fn write_atomic_parts(path: &Path, parts: &[&[u8]]) -> std::io::Result<()> {
    write_atomic_with(path, &mut |f| parts.iter().try_for_each(|b| f.write_all(b)))
}

/// [`write_atomic`] of what `write` writes into the temp file (streamed: large files need not be
/// built in memory); an error from `write` leaves the target as it was and removes the temp file.
pub fn write_atomic_with(
    path: &Path,
    write: &mut dyn FnMut(&mut std::fs::File) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let target = write_target(path)?;
    let dir = parent_dir(&target);
    let tmp = temp_beside(&target);
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        write(&mut f)?;
        if let Ok(m) = std::fs::metadata(&target) {
            f.set_permissions(m.permissions())?;
        }
        sync_file(&f)?;
        std::fs::rename(&tmp, &target)?;
        sync_dir(dir);
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Makes `f`'s bytes and metadata durable: on the drive's media, not only handed to the drive.
/// Linux: `fsync`. macOS: `fcntl(F_FULLFSYNC)`, because there `fsync` leaves the data in the
/// drive's own volatile cache; a file system that refuses F_FULLFSYNC (some network and FAT
/// volumes) gets `fsync`, the best it offers. Every durable write of the crate ends here.
pub fn sync_file(f: &std::fs::File) -> std::io::Result<()> {
    if full_fsync(f) {
        return Ok(());
    }
    f.sync_all()
}

/// [`sync_file`] for a file whose size and other metadata need not be durable yet (appended
/// records): `fdatasync` on Linux; on macOS F_FULLFSYNC, which flushes everything.
pub fn sync_data(f: &std::fs::File) -> std::io::Result<()> {
    if full_fsync(f) {
        return Ok(());
    }
    f.sync_data()
}

/// Makes the entries of `dir` durable after files were created or renamed in it. Best effort:
/// where a platform or file system refuses to sync a directory there is nothing better to do.
pub fn sync_dir(dir: &Path) {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = sync_file(&d);
    }
}

/// F_FULLFSYNC on `f`: true when the file system did it.
#[cfg(target_os = "macos")]
fn full_fsync(f: &std::fs::File) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: fcntl on an open descriptor we borrow, with no pointer argument.
    unsafe { libc::fcntl(f.as_raw_fd(), libc::F_FULLFSYNC) != -1 }
}

/// No F_FULLFSYNC outside macOS: `fsync` reaches the media there.
#[cfg(not(target_os = "macos"))]
fn full_fsync(_: &std::fs::File) -> bool {
    false
}

/// True when process `pid` exists (signal 0 probes without delivering anything).
pub fn pid_alive(pid: u32) -> bool {
    let Ok(p) = libc::pid_t::try_from(pid) else { return false };
    // SAFETY: kill with signal 0 only checks for existence and permission.
    let r = unsafe { libc::kill(p, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Removes the leftovers of interrupted runs in `dir`: entries named `.…{stem}{pid}` (for any of
/// `stems`, e.g. ".synth-tmp-") whose process `pid` is gone. Returns what was removed. Entries of
/// live processes (a concurrent run) are left alone.
pub fn remove_stale_temps(dir: &Path, stems: &[&str]) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else { return removed };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with('.') {
            continue;
        }
        let pid = stems.iter().find_map(|stem| {
            let (_, tail) = name.rsplit_once(stem)?;
            if tail.is_empty() || !tail.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            tail.parse::<u32>().ok()
        });
        let Some(pid) = pid else { continue };
        if pid == std::process::id() || pid_alive(pid) {
            continue;
        }
        let p = e.path();
        let gone = match e.file_type() {
            Ok(t) if t.is_dir() => std::fs::remove_dir_all(&p),
            _ => std::fs::remove_file(&p),
        };
        if gone.is_ok() {
            removed.push(p);
        }
    }
    removed
}

/// Serialises one f32 tensor as a safetensors file, atomically.
pub fn write_f32_safetensors(path: &Path, name: &str, shape: &[usize], data: &[f32]) -> std::io::Result<()> {
    let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.to_vec(), &bytes)
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    let out = safetensors::serialize([(name, view)], None).map_err(|e| std::io::Error::other(e.to_string()))?;
    write_atomic(path, &out)
}

/// deltafin's cache directory: `$DELTAFIN_CACHE`, else `$XDG_CACHE_HOME/deltafin`, else
/// `~/.cache/deltafin`.
pub fn cache_dir() -> std::path::PathBuf {
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
