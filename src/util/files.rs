//! Files: durable writes ([`sync_file`], [`sync_dir`]: the one place a file is made durable,
//! `F_FULLFSYNC` on macOS), atomic writes (a temp file created new, never through a link, under an
//! unpredictable name; never over a non-regular file), output-path checks (also for a file
//! appended to: a regular file, not the input), exclusive locks ([`FileLock`]), opens that refuse
//! FIFOs and devices without blocking ([`open_regular`]), and the removal of stale temps of
//! killed writers.
//!
//! Contract: part of `util`, the lowest floor: it imports nothing of the crate.

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

/// Opens `path` for reading if it is a regular file (links followed). A FIFO, device, socket or
/// directory is refused at once ("is a FIFO, not a regular file"; the caller names the path) and
/// never opened in a way that could block: a FIFO with no writer would hang a plain `open`.
pub fn open_regular(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY).open(path)?;
    let m = f.metadata()?;
    if !m.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("is {}, not a regular file", file_kind(&m)),
        ));
    }
    // Regular files ignore O_NONBLOCK; clear it so the descriptor behaves as a plain open's.
    // SAFETY: fcntl on a descriptor we own, with integer arguments only.
    unsafe {
        let fl = libc::fcntl(f.as_raw_fd(), libc::F_GETFL);
        if fl != -1 {
            libc::fcntl(f.as_raw_fd(), libc::F_SETFL, fl & !libc::O_NONBLOCK);
        }
    }
    Ok(f)
}

/// An exclusive advisory lock (`flock`) on a lock file, held until dropped: what keeps two
/// processes from writing one session file or state directory at once. The lock file is created
/// beside what it guards (never through a symbolic link) and holds the owner's pid, for the
/// message the second process prints; it is left in place (removing it would race a new owner).
#[derive(Debug)]
pub struct FileLock {
    _file: std::fs::File,
    path: PathBuf,
}

impl FileLock {
    /// Takes the lock on `lock_path` at once, or fails: `WouldBlock` with a message naming the
    /// pid that holds it.
    pub fn acquire(lock_path: &Path) -> std::io::Result<FileLock> {
        use std::io::{Read, Seek};
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
            .mode(0o644)
            .open(lock_path)?;
        let m = f.metadata()?;
        if !m.is_file() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("the lock file {} is {}, not a regular file", lock_path.display(), file_kind(&m)),
            ));
        }
        // SAFETY: flock on a descriptor we own; no memory is involved.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                let mut held = String::new();
                let _ = f.read_to_string(&mut held);
                let who = held
                    .trim()
                    .parse::<u32>()
                    .map_or_else(|_| "another process".to_string(), |p| format!("process {p}"));
                return Err(std::io::Error::new(
                    std::io::ErrorKind::WouldBlock,
                    format!("it is in use by {who} (lock {})", lock_path.display()),
                ));
            }
            return Err(e);
        }
        f.set_len(0)?;
        f.rewind()?;
        f.write_all(format!("{}\n", std::process::id()).as_bytes())?;
        Ok(FileLock { _file: f, path: lock_path.to_path_buf() })
    }

    /// The lock file of `path`: `.NAME.lock` in the same directory.
    pub fn beside(path: &Path) -> PathBuf {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "out".into());
        parent_dir(path).join(format!(".{name}.lock"))
    }

    pub fn path(&self) -> &Path {
        &self.path
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

fn parent_dir(path: &Path) -> &Path {
    path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

/// The prefix of the temp files written beside `target`: `.NAME.tmp.` (then the writer's pid and
/// a random suffix).
fn temp_prefix(target: &Path) -> String {
    let name = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "out".into());
    format!(".{name}.tmp.")
}

/// A random 64-bit value without a dependency: the clock, the pid, a counter and an address,
/// mixed by xxh3. Not for secrets; for names nobody can predict well enough to plant a link.
fn random_u64() -> u64 {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let local = 0u8;
    let addr = &local as *const u8 as usize as u64;
    let mut b = [0u8; 32];
    b[..8].copy_from_slice(&t.to_le_bytes());
    b[8..16].copy_from_slice(&u64::from(std::process::id()).to_le_bytes());
    b[16..24].copy_from_slice(&n.to_le_bytes());
    b[24..].copy_from_slice(&addr.to_le_bytes());
    xxhash_rust::xxh3::xxh3_64(&b)
}

/// Creates a new temp file beside `target`, named `.NAME.tmp.PID.RANDOM`: created new
/// (`O_EXCL`), never through a symbolic link (`O_NOFOLLOW`), retried under another name on a
/// collision, so a file or link planted under a guessed name is never written through.
fn create_temp_beside(target: &Path) -> std::io::Result<(PathBuf, std::fs::File)> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = parent_dir(target);
    let prefix = temp_prefix(target);
    let mut last = None;
    for _ in 0..16 {
        let tmp = dir.join(format!("{prefix}{}.{:016x}", std::process::id(), random_u64()));
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .mode(0o666)
            .open(&tmp)
        {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("no free temp file name")))
}

/// Removes temp files of earlier writes of `target` whose writer is gone (killed mid-write):
/// `.NAME.tmp.PID` and `.NAME.tmp.PID.RANDOM` where process PID no longer exists. Best effort.
fn remove_stale_temps_of(target: &Path) {
    let prefix = temp_prefix(target);
    let Ok(rd) = std::fs::read_dir(parent_dir(target)) else { return };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(tail) = name.strip_prefix(&prefix) else { continue };
        let pid = tail.split('.').next().and_then(|p| p.parse::<u32>().ok());
        let Some(pid) = pid else { continue };
        if pid == std::process::id() || pid_alive(pid) {
            continue;
        }
        // Only plain files (never follow or remove a link's target, never a directory).
        if e.file_type().is_ok_and(|t| t.is_file()) {
            let _ = std::fs::remove_file(e.path());
        }
    }
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
    let (tmp, _f) = create_temp_beside(&target)?;
    std::fs::remove_file(&tmp)
}

/// Writes `bytes` to `path` atomically: temp file in the same directory (created new, never
/// through a link, under an unpredictable name; stale ones of killed writers removed), fsync,
/// rename. A symbolic link at `path` is followed and its target replaced (the link stays); a
/// directory, FIFO, device or socket is refused, never replaced. An existing file keeps its
/// permissions (a new one gets the umask's default).
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
    remove_stale_temps_of(&target);
    let (tmp, mut f) = create_temp_beside(&target)?;
    let result = (|| {
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

/// Removes the leftovers of interrupted runs in `dir`: entries named `.…{stem}{pid}` or
/// `.…{stem}{pid}.{hex}` (for any of `stems`, e.g. ".synth-tmp-") whose process `pid` is gone. Returns what was removed. Entries of
/// live processes (a concurrent run) are left alone.
pub fn remove_stale_temps(dir: &Path, stems: &[&str]) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else { return removed };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with('.') {
            continue;
        }
        // `{stem}PID`, or `{stem}PID.RANDOM` as atomic writes name their temp files.
        let pid = stems.iter().find_map(|stem| {
            let (_, tail) = name.rsplit_once(stem)?;
            let (pid, rest) = tail.split_once('.').unwrap_or((tail, ""));
            let digits =
                |s: &str, hex: bool| s.bytes().all(|b| if hex { b.is_ascii_hexdigit() } else { b.is_ascii_digit() });
            if pid.is_empty() || !digits(pid, false) || !digits(rest, true) {
                return None;
            }
            pid.parse::<u32>().ok()
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A link planted where an older deltafin put its temp file (`.NAME.tmp.PID`), and under every
    /// name of that form a writer of this pid could pick without its random part, is never
    /// written through; the target is replaced, the victim untouched.
    #[test]
    fn atomic_writes_never_follow_a_planted_link() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        let out = dir.path().join("out.json");
        let planted = dir.path().join(format!(".out.json.tmp.{}", std::process::id()));
        std::os::unix::fs::symlink(&victim, &planted).unwrap();
        write_atomic(&out, b"new").unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "new");
        // Names are unpredictable: two writes never pick the same temp name.
        let a = create_temp_beside(&out).unwrap().0;
        let b = create_temp_beside(&out).unwrap().0;
        assert_ne!(a, b);
        assert!(
            a.file_name().unwrap().to_string_lossy().starts_with(&format!(".out.json.tmp.{}.", std::process::id()))
        );
    }

    #[test]
    fn temps_of_dead_writers_go_and_live_ones_stay() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("s.dfstate");
        let dead = dir.path().join(".s.dfstate.tmp.999999999.00000000deadbeef");
        let old_style = dir.path().join(".s.dfstate.tmp.999999998");
        let live = dir.path().join(format!(".s.dfstate.tmp.{}.0000000000000001", std::process::id()));
        for p in [&dead, &old_style, &live] {
            std::fs::write(p, "x").unwrap();
        }
        write_atomic(&out, b"state").unwrap();
        assert!(!dead.exists() && !old_style.exists());
        assert!(live.exists(), "a live writer's temp was removed");
        let removed = remove_stale_temps(dir.path(), &[".s.dfstate.tmp."]);
        assert!(removed.is_empty());
    }

    #[test]
    fn a_second_lock_holder_is_refused_with_the_first_ones_pid() {
        let dir = tempfile::tempdir().unwrap();
        let l = dir.path().join(".x.lock");
        let first = FileLock::acquire(&l).unwrap();
        // flock locks belong to open file descriptions: a second open in this process conflicts.
        let e = FileLock::acquire(&l).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock);
        assert!(e.to_string().contains(&format!("process {}", std::process::id())), "{e}");
        drop(first);
        FileLock::acquire(&l).unwrap();
    }

    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("fifo");
        let c = std::ffi::CString::new(f.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mkfifo with a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = open_regular(&f).unwrap_err();
        assert!(e.to_string().contains("FIFO"), "{e}");
    }
}
