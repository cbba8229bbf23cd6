//! The reader layer: how the expert store reads a drive. `drive_io` holds what every reader shares
//! (a read into caller-owned memory and its completion, the [`DriveIo`](drive_io::DriveIo) trait,
//! the file table); `reader` picks one ([`reader::new_reader`]) and opens files for uncached reads;
//! `uring` (Linux, io_uring with O_DIRECT) and `pread` (a thread pool, `F_NOCACHE` on macOS) are the
//! readers.
//!
//! Contract: a read's buffer belongs to the reader from submit until its completion is reaped;
//! completions carry the read's tag, in any order; a short read is resubmitted for the remainder and
//! one that reaches end-of-file completes with the bytes it got.

pub mod drive_io;
pub mod pread;
pub mod reader;
#[cfg(target_os = "linux")]
pub mod uring;
