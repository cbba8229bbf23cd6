//! Readers: one per drive, behind the [`DriveIo`] trait. Linux: io_uring with O_DIRECT (registered
//! buffers where the kernel allows); everywhere: a pread thread pool (`F_NOCACHE` on macOS). Both
//! complete short reads by resubmitting the remainder; a read that ends early at end-of-file
//! completes with the bytes it got.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;

/// O_DIRECT needs offsets, lengths and buffers aligned to the logical block size; 4 KiB is safe.
pub const DIRECT_ALIGN: u64 = 4096;

/// One read into caller-owned memory, addressed by the index of a file in the reader's file table
/// (so a reader of another kind, e.g. HTTP ranges, can resolve the same index its own way).
#[derive(Clone, Copy, Debug)]
pub struct ReadOp {
    pub tag: u64,
    pub file: u32,
    pub offset: u64,
    pub len: usize,
    pub buf: *mut u8,
    /// Index of the registered buffer holding `buf`, if buffers are registered.
    pub buf_index: Option<u16>,
}

// SAFETY: the pointer designates a slab slot owned by the store; the store guarantees the slot is
// neither read nor reused until the read's completion has been returned.
unsafe impl Send for ReadOp {}

#[derive(Debug)]
pub struct Done {
    pub tag: u64,
    /// Bytes read (fewer than asked only at end-of-file) or the error.
    pub result: io::Result<usize>,
}

pub trait DriveIo: Send {
    fn kind(&self) -> ReaderKind;
    /// Queues a read.
    ///
    /// # Safety
    /// `op.buf` must be valid for writes of `op.len` bytes and must not be accessed by anyone else
    /// until the completion with `op.tag` has been returned by `reap`.
    unsafe fn submit(&mut self, op: ReadOp) -> io::Result<()>;
    /// Appends finished reads to `out`. With `wait` and reads in flight, waits up to that long
    /// for at least one; with None, only collects what has already finished.
    fn reap(&mut self, wait: Option<std::time::Duration>, out: &mut Vec<Done>) -> io::Result<()>;
    fn in_flight(&self) -> usize;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReaderKind {
    /// io_uring when the kernel allows it, else pread.
    Auto,
    Uring,
    Pread,
}

impl ReaderKind {
    pub fn name(self) -> &'static str {
        match self {
            ReaderKind::Auto => "auto",
            ReaderKind::Uring => "io_uring",
            ReaderKind::Pread => "pread",
        }
    }
}

/// Most reads in flight per drive: past this a pread pool would be thousands of threads and an
/// io_uring ring larger than the kernel allows, for no gain on any SSD.
pub const MAX_QD: usize = 1024;

/// Descriptors of the files a reader reads, indexed by `ReadOp::file` (-1: not open).
pub type FileTable = std::sync::Arc<[RawFd]>;

/// Resolves a read's file index; an index without an open file is an error of that read.
pub(crate) fn fd_of(files: &FileTable, file: u32) -> io::Result<RawFd> {
    match files.get(file as usize) {
        Some(&fd) if fd >= 0 => Ok(fd),
        _ => Err(io::Error::new(io::ErrorKind::NotFound, format!("file {file} is not open"))),
    }
}

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
