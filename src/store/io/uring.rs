//! io_uring reader (Linux): one ring per drive, reads straight into slab slots, using registered
//! (fixed) buffers when the kernel accepts them. Short reads are resubmitted for the remainder.

use super::drive_io::{Done, DriveIo, FileTable, MAX_SYSCALL_READ, ReadOp, ReaderKind, fd_of};
use io_uring::{IoUring, opcode, types};
use std::collections::HashMap;
use std::io;

struct Pending {
    op: ReadOp,
    done: usize,
}

pub struct Uring {
    ring: IoUring,
    pending: HashMap<u64, Pending>,
    registered: bool,
    files: FileTable,
}

impl Uring {
    pub fn new(qd: usize, buffers: &[(*mut u8, usize)], files: FileTable) -> io::Result<Self> {
        let ring = IoUring::new((qd.max(1) * 2).next_power_of_two() as u32)?;
        let mut registered = false;
        if !buffers.is_empty() && buffers.len() <= u16::MAX as usize {
            let iovecs: Vec<libc::iovec> =
                buffers.iter().map(|&(p, l)| libc::iovec { iov_base: p.cast(), iov_len: l }).collect();
            // SAFETY: the buffers belong to the store's slab, which outlives this ring (the store
            // drops its readers before the slab).
            registered = unsafe { ring.submitter().register_buffers(&iovecs) }.is_ok();
        }
        Ok(Uring { ring, pending: HashMap::new(), registered, files })
    }

    pub fn uses_registered_buffers(&self) -> bool {
        self.registered
    }

    /// Queues the SQE for the unread remainder of `p`. Once the SQE is in the submission queue
    /// the read counts as pending: a failed `submit` is retried by the next `reap`, never
    /// abandoned (the kernel may still consume the SQE and write the buffer).
    fn push(&mut self, tag: u64) -> io::Result<()> {
        let p = &self.pending[&tag];
        let op = p.op;
        // SAFETY: `done < len`, so the pointer stays inside the caller's buffer.
        let buf = unsafe { op.buf.add(p.done) };
        let len = (op.len - p.done).min(MAX_SYSCALL_READ) as u32;
        let off = op.offset + p.done as u64;
        let fd = fd_of(&self.files, op.file)?;
        let sqe = match (self.registered, op.buf_index) {
            (true, Some(i)) => opcode::ReadFixed::new(types::Fd(fd), buf, len, i).offset(off).build(),
            _ => opcode::Read::new(types::Fd(fd), buf, len).offset(off).build(),
        }
        .user_data(tag);
        // SAFETY: the SQE points at memory the caller guaranteed valid until completion.
        unsafe {
            if self.ring.submission().push(&sqe).is_err() {
                // Make room by handing queued entries to the kernel; if even that fails, nothing of
                // this read has been queued and the error is final.
                self.ring.submit()?;
                self.ring.submission().push(&sqe).map_err(|_| io::Error::other("io_uring submission queue full"))?;
            }
        }
        // Queued: a submit error here is transient (EAGAIN/EBUSY); `reap` submits again.
        let _ = self.ring.submit();
        Ok(())
    }
}

impl DriveIo for Uring {
    fn kind(&self) -> ReaderKind {
        ReaderKind::Uring
    }

    unsafe fn submit(&mut self, op: ReadOp) -> io::Result<()> {
        self.pending.insert(op.tag, Pending { op, done: 0 });
        if let Err(e) = self.push(op.tag) {
            self.pending.remove(&op.tag);
            return Err(e);
        }
        Ok(())
    }

    fn reap(&mut self, wait: Option<std::time::Duration>, out: &mut Vec<Done>) -> io::Result<()> {
        let waited = match wait {
            Some(t) if !self.pending.is_empty() => {
                let ts = types::Timespec::from(t);
                let args = types::SubmitArgs::new().timespec(&ts);
                match self.ring.submitter().submit_with_args(1, &args) {
                    // Kernels without timed waits: block until one completes.
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => self.ring.submit_and_wait(1),
                    r => r,
                }
            }
            _ => self.ring.submit(),
        };
        match waited {
            Ok(_) => {}
            // Timed out, interrupted or busy: collect whatever finished; queued SQEs go next time.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ETIME | libc::EINTR | libc::EBUSY | libc::EAGAIN)) => {}
            Err(e) => return Err(e),
        }
        let cqes: Vec<(u64, i32)> = self.ring.completion().map(|c| (c.user_data(), c.result())).collect();
        for (tag, res) in cqes {
            let Some(p) = self.pending.get_mut(&tag) else { continue };
            if res < 0 {
                let err = io::Error::from_raw_os_error(-res);
                self.pending.remove(&tag);
                out.push(Done { tag, result: Err(err) });
            } else if res == 0 {
                let done = p.done;
                self.pending.remove(&tag);
                out.push(Done { tag, result: Ok(done) });
            } else {
                p.done += res as usize;
                if p.done >= p.op.len {
                    let done = p.done;
                    self.pending.remove(&tag);
                    out.push(Done { tag, result: Ok(done) });
                } else if let Err(e) = self.push(tag) {
                    self.pending.remove(&tag);
                    out.push(Done { tag, result: Err(e) });
                }
            }
        }
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.pending.len()
    }
}
