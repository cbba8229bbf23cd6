//! Ending at the user's word: Ctrl-C and a reader that closed the pipe.
//!
//! Contract: [`catch_ctrl_c`] (called by subcommands that can stop cleanly: `run`, `synth`,
//! `batch`) turns the first SIGINT into a cancel request (`util::request_cancel`) that the work
//! polls — `run` stops generating and prints what it has with `"interrupted": true`, `synth`
//! removes its temporary directory, `batch` cancels its running requests (not recorded) and says
//! how many lines are done and how to go on — and the process then exits [`INTERRUPTED`] (130, 128 + SIGINT); a second
//! Ctrl-C kills at once as usual. A write to standard output that fails with a broken pipe (the
//! reader, e.g. `head`, has what it wanted) ends the process quietly by the SIGPIPE convention:
//! no message, killed by SIGPIPE as `cat` would be (the shell sees 141), after the work's other
//! outputs (stats on stderr, files) are done.

use std::sync::atomic::{AtomicBool, Ordering};

/// Exit status after Ctrl-C (128 + SIGINT, as shells report a process killed by it).
pub const INTERRUPTED: u8 = 130;

static CAUGHT: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    // Async-signal-safe: two atomic stores. SA_RESETHAND makes the next SIGINT kill.
    crate::util::request_cancel();
    CAUGHT.store(true, Ordering::SeqCst);
}

/// Makes the first Ctrl-C a cancel request (see the module contract).
pub fn catch_ctrl_c() {
    // SAFETY: a zeroed sigaction with a handler that only stores atomics; sigemptyset fills the
    // mask of the struct we own.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigint as *const () as libc::sighandler_t;
        sa.sa_flags = libc::SA_RESETHAND | libc::SA_RESTART;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGINT, &sa, std::ptr::null_mut());
    }
}

/// True once Ctrl-C was pressed (after [`catch_ctrl_c`]).
pub fn interrupted() -> bool {
    CAUGHT.load(Ordering::SeqCst)
}

/// True when `e` (or a cause) is a write to a closed pipe.
pub fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe))
}

/// Ends the process as a write to a closed pipe ends `cat`: killed by SIGPIPE (status 141 in the
/// shell), without a message.
pub fn die_of_sigpipe() -> ! {
    // SAFETY: restoring the default disposition and raising the signal; nothing else runs.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        libc::raise(libc::SIGPIPE);
    }
    std::process::exit(128 + libc::SIGPIPE)
}
