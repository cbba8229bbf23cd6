//! What every drive reader shares: one read into caller-owned memory ([`ReadOp`]) and its
//! completion ([`Done`]), the [`DriveIo`] trait a reader implements, its kind, and the table of
//! open files a read is addressed by. `reader` picks a reader; `pread` and `uring` implement it.
//!
//! Contract: a read's buffer belongs to the reader from `submit` until its completion is reaped
//! (see [`DriveIo::submit`]); completions carry the read's tag, in any order.

use std::io;
use std::os::fd::RawFd;

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

/// The most bytes one read syscall (or io_uring read) asks for: 1 GiB, a multiple of every O_DIRECT
/// alignment and below `INT_MAX`, past which Darwin refuses a read with EINVAL (Linux shortens it).
/// A longer read is several, each resubmitting the remainder.
pub const MAX_SYSCALL_READ: usize = 1 << 30;

/// Descriptors of the files a reader reads, indexed by `ReadOp::file` (-1: not open).
pub type FileTable = std::sync::Arc<[RawFd]>;

/// Resolves a read's file index; an index without an open file is an error of that read.
pub(crate) fn fd_of(files: &FileTable, file: u32) -> io::Result<RawFd> {
    match files.get(file as usize) {
        Some(&fd) if fd >= 0 => Ok(fd),
        _ => Err(io::Error::new(io::ErrorKind::NotFound, format!("file {file} is not open"))),
    }
}
