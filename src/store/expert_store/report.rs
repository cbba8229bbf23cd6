//! What the store reports: its counters and each drive's (bytes, reads, read-time quantiles,
//! rate, failures), and the log of reads issued when recording. Read under the store's lock.

use super::*;

impl ExpertStore {
    pub fn report(&self) -> SourceReport {
        let sh = &*self.shared;
        let st = lock(sh);
        SourceReport {
            expert_bytes_requested: st.requested,
            expert_bytes_read: Some(st.read),
            cache_hits: Some(st.hits),
            cache_misses: Some(st.misses),
            inflight_joins: Some(st.joins),
            cache_slots: Some(sh.cache_slots),
            prefetch_issued: st.prefetch_issued,
            prefetch_used: st.prefetch_used,
            hedged_reads: Some(st.hedges.issued),
            hedge_wins: Some(st.hedges.wins),
            drives: st
                .drives
                .iter()
                .enumerate()
                .map(|(i, d)| DriveReport {
                    drive: i,
                    root: sh.spec.drives[i].root.display().to_string(),
                    reader: d.reader.map_or("none", ReaderKind::name).to_string(),
                    direct_io: sh
                        .spec
                        .files
                        .iter()
                        .zip(&sh.files)
                        .any(|((fd, _), f)| *fd as usize == i && f.as_ref().is_some_and(|f| f.direct)),
                    bytes_read: d.counters.bytes_read,
                    reads: d.counters.reads,
                    read_ms_p50: d.counters.latency.quantile_ms(0.5),
                    read_ms_p99: d.counters.latency.quantile_ms(0.99),
                    read_ms_max: d.counters.latency.max_ms(),
                    lands_last: d.counters.lands_last,
                    failures: d.counters.failures,
                    failed: d.failed.clone(),
                    last_failure: d.last_failure.clone(),
                    rate_gbps: d.rate / 1e9,
                })
                .collect(),
        }
    }

    /// The read counters of [`ExpertStore::report`] alone (no drive figures).
    pub fn read_counters(&self) -> SourceReport {
        let st = lock(&self.shared);
        SourceReport {
            expert_bytes_requested: st.requested,
            expert_bytes_read: Some(st.read),
            cache_hits: Some(st.hits),
            cache_misses: Some(st.misses),
            ..Default::default()
        }
    }

    /// Reads issued so far as (path, offset, length), when `record_reads` was set.
    pub fn read_log(&self) -> Vec<(PathBuf, u64, u64)> {
        let sh = &*self.shared;
        let st = lock(sh);
        st.read_log.iter().flatten().map(|&(f, o, l)| (sh.spec.files[f as usize].1.clone(), o, l)).collect()
    }
}
