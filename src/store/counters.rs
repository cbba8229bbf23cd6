//! I/O counters of the expert store: per drive bytes, reads, latency percentiles (a log-bucket
//! histogram with 2% resolution), how often the drive finished a layer's reads last, failures; and
//! the store-level hits, misses and bytes.

use serde::Serialize;

/// Latency histogram: bucket i holds samples in [1.02^i, 1.02^(i+1)) microseconds.
#[derive(Clone, Debug)]
pub struct LatencyHist {
    buckets: Vec<u64>,
    count: u64,
    max_us: f64,
}

const GROWTH: f64 = 1.02;
const BUCKETS: usize = 1000; // up to ~400 s

impl Default for LatencyHist {
    fn default() -> Self {
        LatencyHist { buckets: vec![0; BUCKETS], count: 0, max_us: 0.0 }
    }
}

impl LatencyHist {
    pub fn record(&mut self, secs: f64) {
        let us = (secs * 1e6).max(1.0);
        let i = ((us.ln() / GROWTH.ln()) as usize).min(BUCKETS - 1);
        self.buckets[i] += 1;
        self.count += 1;
        self.max_us = self.max_us.max(us);
    }

    /// The q-quantile in milliseconds (upper edge of its bucket), None without samples.
    pub fn quantile_ms(&self, q: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let target = ((q * self.count as f64).ceil() as u64).clamp(1, self.count);
        let mut seen = 0;
        for (i, &b) in self.buckets.iter().enumerate() {
            seen += b;
            if seen >= target {
                return Some((GROWTH.powi(i as i32 + 1) / 1000.0).min(self.max_us / 1000.0));
            }
        }
        Some(self.max_us / 1000.0)
    }

    pub fn max_ms(&self) -> Option<f64> {
        (self.count > 0).then_some(self.max_us / 1000.0)
    }
}

#[derive(Clone, Debug, Default)]
pub struct DriveCounters {
    pub bytes_read: u64,
    pub reads: u64,
    pub latency: LatencyHist,
    pub lands_last: u64,
    pub failures: u64,
    pub prefetch_reads: u64,
}

/// One drive's line in the report.
#[derive(Clone, Debug, Serialize)]
pub struct DriveReport {
    pub drive: usize,
    pub root: String,
    pub reader: String,
    pub direct_io: bool,
    pub bytes_read: u64,
    /// Read operations completed on this drive: an expert split across drives, or stored in
    /// pieces (one spanning two safetensors files), counts one per piece.
    pub reads: u64,
    pub read_ms_p50: Option<f64>,
    pub read_ms_p99: Option<f64>,
    pub read_ms_max: Option<f64>,
    pub lands_last: u64,
    pub failures: u64,
    /// Given up for the store's life (see `expert_store::heal`).
    pub failed: Option<String>,
    /// The last read that failed here (its holder was suspect for a while, then tried again).
    pub last_failure: Option<String>,
    pub rate_gbps: f64,
}

/// What an expert source reports at the end of a run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SourceReport {
    pub expert_bytes_requested: u64,
    /// Bytes transferred from drives; None when unknown (memory-mapped shards).
    pub expert_bytes_read: Option<u64>,
    pub cache_hits: Option<u64>,
    pub cache_misses: Option<u64>,
    /// Requests that joined a read already in flight.
    pub inflight_joins: Option<u64>,
    pub cache_slots: Option<usize>,
    pub drives: Vec<DriveReport>,
    /// Prefetch reads issued, and how many were later demanded.
    pub prefetch_issued: u64,
    pub prefetch_used: u64,
    /// Second reads issued for late reads on another copy's drive, and how many landed first.
    pub hedged_reads: Option<u64>,
    pub hedge_wins: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let mut h = LatencyHist::default();
        for i in 1..=100 {
            h.record(i as f64 / 1000.0);
        }
        let p50 = h.quantile_ms(0.5).unwrap();
        let p99 = h.quantile_ms(0.99).unwrap();
        assert!((p50 - 50.0).abs() / 50.0 < 0.03, "{p50}");
        assert!((p99 - 99.0).abs() / 99.0 < 0.03, "{p99}");
        assert!((h.max_ms().unwrap() - 100.0).abs() < 1e-6);
    }
}
