//! Whether a benchmark's expert reads were cold, and what emptied the page cache before them.
//!
//! Linux reads experts with O_DIRECT, which never serves a page from the page cache: those reads
//! are cold whatever the cache holds. macOS has no O_DIRECT: `F_NOCACHE` stops new caching but
//! still serves pages already cached (after a buffered run, a `place`, a copy), so a figure there
//! is cold only when the cache was emptied (`sudo purge`) just before.
//!
//! Contract: [`empty_page_cache`] empties the page cache where this process may (Linux:
//! `drop_caches`, root only; macOS: `purge`, root only) or takes the caller's word that it was
//! purged just before (`assume_purged`), and says which ([`Emptied`]). [`is_cold`] labels a run:
//! true only when every drive that read did so uncached (O_DIRECT / F_NOCACHE) and, on macOS, the
//! cache had been emptied; reads from memory-mapped shards (no drive reads) are cold only after
//! the cache was emptied. A warm run is never labelled cold; [`warm_note`] says what to do.

use crate::setting::Setting;
use crate::store::counters::DriveReport;

/// What emptied the page cache before a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Emptied {
    /// This process did (`drop_caches` on Linux, `purge` on macOS; both need root).
    Dropped,
    /// The caller says the cache was purged just before this run (macOS: `sudo purge`).
    AssumedPurged,
    /// Nothing: the page cache holds whatever it held.
    No,
}

/// Empties the page cache where this process may; see the module contract.
pub fn empty_page_cache(assume_purged: bool) -> Emptied {
    if drop_page_cache() {
        Emptied::Dropped
    } else if assume_purged {
        Emptied::AssumedPurged
    } else {
        Emptied::No
    }
}

/// Linux: writes back dirty pages and drops the page cache (root only); true when it worked.
#[cfg(target_os = "linux")]
pub fn drop_page_cache() -> bool {
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3\n").is_ok()
}

/// macOS: `purge` (root only; as another user it would ask for nothing and fail); true when it
/// worked.
#[cfg(target_os = "macos")]
pub fn drop_page_cache() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return false;
    }
    std::process::Command::new("/usr/sbin/purge")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Elsewhere there is no way to empty the page cache.
#[cfg(not(any(target_os = "linux", target_os = "macos")))]
pub fn drop_page_cache() -> bool {
    false
}

/// Whether reads can be served from pages cached before the run: true where uncached reads
/// (`F_NOCACHE`) still serve cached pages (macOS), false where they never do (Linux's O_DIRECT).
pub const UNCACHED_READS_SERVE_CACHED_PAGES: bool = cfg!(not(target_os = "linux"));

/// Whether a run whose drives report `drives` was cold; see the module contract.
pub fn is_cold(emptied: Emptied, drives: &[DriveReport]) -> bool {
    is_cold_on(UNCACHED_READS_SERVE_CACHED_PAGES, emptied, drives)
}

fn is_cold_on(serves_cached: bool, emptied: Emptied, drives: &[DriveReport]) -> bool {
    let emptied = emptied != Emptied::No;
    let read: Vec<&DriveReport> = drives.iter().filter(|d| d.bytes_read > 0).collect();
    if read.is_empty() {
        return emptied;
    }
    read.iter().all(|d| d.direct_io) && (emptied || !serves_cached)
}

/// What to tell the user of a run that was not cold, None for a cold one.
pub fn warm_note(cold: bool, emptied: Emptied, drives: &[DriveReport]) -> Option<String> {
    if cold {
        return None;
    }
    let cached_open = drives.iter().any(|d| d.bytes_read > 0 && !d.direct_io);
    Some(if cached_open {
        "some expert files could not be opened for uncached reads (O_DIRECT / F_NOCACHE refused: a \
         RAM file system?), so these reads may come from the page cache; the record says \"cold\": false"
            .to_string()
    } else if UNCACHED_READS_SERVE_CACHED_PAGES && emptied == Emptied::No {
        format!(
            "on macOS F_NOCACHE still serves pages already in the page cache, so these figures may be \
             warm (the record says \"cold\": false); for a cold figure run `sudo purge` just before and \
             pass {} (or run as root, which purges itself)",
            Setting::AssumePurged
        )
    } else {
        "the page cache could not be emptied (needs root) and the reads went through it; the record \
         says \"cold\": false"
            .to_string()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drive(bytes_read: u64, direct_io: bool) -> DriveReport {
        DriveReport {
            drive: 0,
            root: "d".into(),
            reader: "pread".into(),
            direct_io,
            bytes_read,
            reads: 1,
            read_ms_p50: None,
            read_ms_p99: None,
            read_ms_max: None,
            lands_last: 0,
            failures: 0,
            failed: None,
            last_failure: None,
            rate_gbps: 1.0,
        }
    }

    #[test]
    fn a_warm_run_is_never_called_cold() {
        let direct = [drive(100, true), drive(0, false)];
        let cached = [drive(100, true), drive(100, false)];
        // Linux: O_DIRECT reads are cold whether or not the cache was dropped.
        assert!(is_cold_on(false, Emptied::No, &direct));
        assert!(!is_cold_on(false, Emptied::Dropped, &cached), "a cached open reads the page cache");
        // macOS: F_NOCACHE reads are cold only after a purge, by us or by the user.
        assert!(!is_cold_on(true, Emptied::No, &direct));
        assert!(is_cold_on(true, Emptied::AssumedPurged, &direct));
        assert!(is_cold_on(true, Emptied::Dropped, &direct));
        assert!(!is_cold_on(true, Emptied::AssumedPurged, &cached));
        // No drive reads (mapped shards): cold only after the cache was emptied.
        assert!(!is_cold_on(false, Emptied::No, &[]));
        assert!(is_cold_on(false, Emptied::Dropped, &[]));
        // The note says what to do; a cold run has none.
        assert!(warm_note(true, Emptied::No, &direct).is_none());
        assert!(warm_note(false, Emptied::Dropped, &cached).unwrap().contains("uncached"));
    }
}
