//! Readers: one per drive, behind the [`DriveIo`] trait (`drive_io`: the types every reader
//! shares). Linux: io_uring with O_DIRECT (`uring`, registered buffers where the kernel allows);
//! everywhere: a pread thread pool (`pread`, `F_NOCACHE` on macOS). Both complete short reads by
//! resubmitting the remainder; a read that ends early at end-of-file completes with the bytes it
//! got. [`new_reader`] picks one; [`DirectFile`] opens a file for uncached reads.

pub use super::drive_io::{Done, DriveIo, FileTable, MAX_QD, MAX_SYSCALL_READ, ReadOp, ReaderKind};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;

/// What an uncached open is called on this platform, for reports.
pub const UNCACHED: &str = if cfg!(target_os = "macos") { "F_NOCACHE" } else { "O_DIRECT" };

/// O_DIRECT needs offsets, lengths and buffers aligned to the logical block size; 4 KiB is safe.
pub const DIRECT_ALIGN: u64 = 4096;

/// Creates a reader for one drive. `registered` are (ptr, len) buffers to register with io_uring.
pub fn new_reader(
    kind: ReaderKind,
    qd: usize,
    registered: &[(*mut u8, usize)],
    files: FileTable,
) -> io::Result<Box<dyn DriveIo>> {
    if !(1..=MAX_QD).contains(&qd) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("queue depth {qd} is outside 1..={MAX_QD}")));
    }
    match kind {
        ReaderKind::Pread => Ok(Box::new(super::pread::PreadPool::new(qd, files)?)),
        #[cfg(target_os = "linux")]
        ReaderKind::Uring => Ok(Box::new(super::uring::Uring::new(qd, registered, files)?)),
        #[cfg(target_os = "linux")]
        ReaderKind::Auto => match super::uring::Uring::new(qd, registered, files.clone()) {
            Ok(u) => Ok(Box::new(u)),
            Err(_) => Ok(Box::new(super::pread::PreadPool::new(qd, files)?)),
        },
        #[cfg(not(target_os = "linux"))]
        ReaderKind::Uring => {
            let _ = (registered, files);
            Err(io::Error::new(io::ErrorKind::Unsupported, "io_uring is Linux-only"))
        }
        #[cfg(not(target_os = "linux"))]
        ReaderKind::Auto => Ok(Box::new(super::pread::PreadPool::new(qd, files)?)),
    }
}

/// A file opened for uncached reads: O_DIRECT on Linux (falling back to a cached open on file
/// systems that refuse it, e.g. tmpfs), F_NOCACHE on macOS.
pub struct DirectFile {
    pub file: File,
    pub direct: bool,
}

impl DirectFile {
    pub fn open(path: &Path) -> io::Result<Self> {
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::fs::OpenOptionsExt;
            match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path) {
                Ok(file) => return Ok(DirectFile { file, direct: true }),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                Err(e) => return Err(e),
            }
            Ok(DirectFile { file: File::open(path)?, direct: false })
        }
        #[cfg(target_os = "macos")]
        {
            let file = File::open(path)?;
            // SAFETY: fcntl on an owned, open descriptor with a plain integer argument.
            let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_NOCACHE, 1) };
            Ok(DirectFile { file, direct: r != -1 })
        }
        #[cfg(not(any(target_os = "linux", target_os = "macos")))]
        {
            Ok(DirectFile { file: File::open(path)?, direct: false })
        }
    }

    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

/// Keeps what is written through `f` out of the page cache where uncached reads would be served
/// from it (macOS: `F_NOCACHE` on the writer too), so a file written to be measured is read from
/// the drive. Elsewhere nothing: O_DIRECT reads never see the page cache. Best effort.
pub fn keep_writes_uncached(f: &File) {
    #[cfg(target_os = "macos")]
    // SAFETY: fcntl on an open descriptor we borrow, with a plain integer argument.
    unsafe {
        libc::fcntl(f.as_raw_fd(), libc::F_NOCACHE, 1);
    }
    #[cfg(not(target_os = "macos"))]
    let _ = f;
}

/// Reads `[offset, offset+len)` widened to `DIRECT_ALIGN`: returns (aligned offset, aligned length,
/// position of the wanted bytes inside the aligned read).
pub fn widen(offset: u64, len: u64) -> (u64, u64, u64) {
    let start = offset / DIRECT_ALIGN * DIRECT_ALIGN;
    let end = (offset + len).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
    (start, end - start, offset - start)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widening() {
        assert_eq!(widen(0, 4096), (0, 4096, 0));
        assert_eq!(widen(100, 10), (0, 4096, 100));
        assert_eq!(widen(4000, 200), (0, 8192, 4000));
        assert_eq!(widen(8192, 17_547_264), (8192, 17_547_264, 0));
    }
}
