//! pread thread-pool reader: `qd` threads per drive, each doing positional reads into the slab slot
//! it was given. Used where io_uring is unavailable (and on macOS, with F_NOCACHE files).

use super::drive_io::{Done, DriveIo, FileTable, ReadOp, ReaderKind, fd_of};
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
    let fd = fd_of(files, op.file)?;
    let mut done = 0usize;
    while done < op.len {
        let want = op.len - done;
        // SAFETY: the store guarantees `buf[..len]` is valid and exclusively ours until completion.
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
