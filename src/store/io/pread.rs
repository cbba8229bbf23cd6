//! pread thread-pool reader: `qd` threads per drive, each reading one whole expert (or one part of
//! a split expert) with positional reads into the slab slot it was given. Used where io_uring is
//! unavailable, on Linux with `--reader pread`, and on macOS, where the files are opened with
//! `F_NOCACHE` (`reader::DirectFile`): the pattern Apple's SSDs serve fastest (parallel `pread` of
//! whole experts into page-aligned buffers; mmap and dispatch_io were slower there).
//!
//! Contract: each syscall asks for at most [`MAX_SYSCALL_READ`] bytes (Darwin refuses a single read
//! over `INT_MAX` with EINVAL, where Linux shortens it); a short read resubmits the remainder, and a
//! read that reaches end-of-file completes with the bytes it got.

use super::drive_io::{Done, DriveIo, FileTable, MAX_SYSCALL_READ, ReadOp, ReaderKind, fd_of};
use std::io;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

pub struct PreadPool {
    jobs: Option<Sender<ReadOp>>,
    done: Receiver<Done>,
    workers: Vec<JoinHandle<()>>,
    in_flight: usize,
}

fn read_fully(op: &ReadOp, files: &FileTable) -> io::Result<usize> {
    read_in_syscalls(op, files, MAX_SYSCALL_READ)
}

/// `op` in `pread`s of at most `max` bytes each (see the module contract).
fn read_in_syscalls(op: &ReadOp, files: &FileTable, max: usize) -> io::Result<usize> {
    let fd = fd_of(files, op.file)?;
    let mut done = 0usize;
    while done < op.len {
        let want = (op.len - done).min(max);
        // SAFETY: the store guarantees `buf[..len]` is valid and exclusively ours until completion,
        // and `done + want <= len`.
        let r = unsafe { libc::pread(fd, op.buf.add(done).cast(), want, (op.offset + done as u64) as libc::off_t) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            break;
        }
        done += r as usize;
    }
    Ok(done)
}

impl PreadPool {
    /// Starts `qd` reader threads; fails (rather than panics) when the system refuses a thread.
    pub fn new(qd: usize, files: FileTable) -> io::Result<Self> {
        let (jobs_tx, jobs_rx) = channel::<ReadOp>();
        let (done_tx, done_rx) = channel::<Done>();
        let jobs_rx = Arc::new(Mutex::new(jobs_rx));
        let workers = (0..qd.max(1))
            .map(|_| {
                let rx = Arc::clone(&jobs_rx);
                let tx = done_tx.clone();
                let files = files.clone();
                std::thread::Builder::new().name("deltafin-pread".into()).spawn(move || {
                    loop {
                        let op = match rx.lock() {
                            Ok(guard) => guard.recv(),
                            Err(_) => return,
                        };
                        let Ok(op) = op else { return };
                        if tx.send(Done { tag: op.tag, result: read_fully(&op, &files) }).is_err() {
                            return;
                        }
                    }
                })
            })
            .collect::<io::Result<Vec<_>>>()?;
        Ok(PreadPool { jobs: Some(jobs_tx), done: done_rx, workers, in_flight: 0 })
    }
}

impl DriveIo for PreadPool {
    fn kind(&self) -> ReaderKind {
        ReaderKind::Pread
    }

    unsafe fn submit(&mut self, op: ReadOp) -> io::Result<()> {
        let jobs = self.jobs.as_ref().ok_or_else(|| io::Error::other("reader is shut down"))?;
        jobs.send(op).map_err(|_| io::Error::other("reader threads exited"))?;
        self.in_flight += 1;
        Ok(())
    }

    fn reap(&mut self, wait: Option<std::time::Duration>, out: &mut Vec<Done>) -> io::Result<()> {
        if let Some(timeout) = wait
            && self.in_flight > 0
        {
            match self.done.recv_timeout(timeout) {
                Ok(d) => {
                    self.in_flight -= 1;
                    out.push(d);
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(io::Error::other("reader threads exited"));
                }
            }
        }
        while let Ok(d) = self.done.try_recv() {
            self.in_flight -= 1;
            out.push(d);
        }
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }
}

impl Drop for PreadPool {
    fn drop(&mut self) {
        // Closing the job channel ends the workers once in-flight reads finish.
        self.jobs = None;
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_read_is_split_into_syscalls_of_at_most_the_cap_and_stops_at_end_of_file() {
        let bytes: Vec<u8> = (0..40_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let dir = std::env::temp_dir().join(format!("deltafin-pread-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f");
        std::fs::write(&path, &bytes).unwrap();
        let f = std::fs::File::open(&path).unwrap();
        let files: FileTable = std::sync::Arc::from(vec![f.as_raw_fd()]);
        let mut buf = vec![0u8; 40_000];
        let op = |offset: u64, len: usize, buf: &mut [u8]| ReadOp {
            tag: 1,
            file: 0,
            offset,
            len,
            buf: buf.as_mut_ptr(),
            buf_index: None,
        };
        // 30_000 bytes from 5_000 in syscalls of at most 4096: every byte in place.
        assert_eq!(read_in_syscalls(&op(5_000, 30_000, &mut buf), &files, 4096).unwrap(), 30_000);
        assert_eq!(&buf[..30_000], &bytes[5_000..35_000]);
        // Past the end: the bytes that exist.
        assert_eq!(read_in_syscalls(&op(36_000, 10_000, &mut buf), &files, 4096).unwrap(), 4_000);
        assert_eq!(&buf[..4_000], &bytes[36_000..]);
        // A file index with no open file is an error of the read, not a panic.
        let bad = ReadOp { file: 3, ..op(0, 10, &mut buf) };
        assert!(read_in_syscalls(&bad, &files, 4096).is_err());
        drop(f);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
