//! `/metrics`: the server's counters in the Prometheus text exposition format (version 0.0.4).
//!
//! Contract: every metric is named `deltafin_*`, has `# HELP` and `# TYPE` lines, and counters
//! only grow. Request counts by endpoint and status, queue depth, 429s, tokens (prompt, reused,
//! generated), memo hits, cancellations, the TTFT histogram, drafts, and the expert source's
//! live counters (per-drive bytes, reads and read latency; cache hits and hit rate).
//!
//! Requests are counted in one place, [`count`], a layer around the API's routes (outside the
//! key check): by path and status, every answer of a route marked with [`counted`] (the model's
//! endpoints) and every request refused for its key; handlers count nothing themselves.

use crate::service::generator::Totals;
use crate::store::SourceReport;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Upper bounds (seconds) of the TTFT histogram's buckets.
const TTFT_BUCKETS: [f64; 14] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0, 600.0];

#[derive(Default)]
pub struct Metrics {
    /// (endpoint, status) -> count.
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    pub rejected: AtomicU64,
    /// Requests running or waiting.
    pub pending: AtomicUsize,
    ttft: Mutex<([u64; TTFT_BUCKETS.len()], u64, f64)>,
    pub totals: Mutex<Totals>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic elsewhere must not take the counters down with it.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// An answer of a route whose every answer [`count`] counts.
#[derive(Clone, Copy)]
struct Counted;

/// Marks the answers of the routes it wraps as counted (see the module contract).
pub async fn counted(req: Request, next: Next) -> Response {
    let mut r = next.run(req).await;
    r.extensions_mut().insert(Counted);
    r
}

/// Counts a request by its path and its answer's status (see the module contract).
pub async fn count(State(m): State<Arc<Metrics>>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let r = next.run(req).await;
    let status = r.status().as_u16();
    if status == 401 || r.extensions().get::<Counted>().is_some() {
        m.request(&path, status);
    }
    r
}

impl Metrics {
    fn request(&self, endpoint: &str, status: u16) {
        *lock(&self.requests).entry((endpoint.to_string(), status)).or_default() += 1;
    }

    pub fn ttft(&self, secs: f64) {
        let mut h = lock(&self.ttft);
        for (i, b) in TTFT_BUCKETS.iter().enumerate() {
            if secs <= *b {
                h.0[i] += 1;
            }
        }
        h.1 += 1;
        h.2 += secs;
    }

    /// The exposition text; `source` is the expert source's report now.
    pub fn render(&self, source: &SourceReport, queue_cap: usize) -> String {
        let mut o = String::new();
        let head = |o: &mut String, name: &str, kind: &str, help: &str| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
        };
        head(&mut o, "deltafin_requests_total", "counter", "HTTP requests by endpoint and status.");
        for ((e, s), n) in lock(&self.requests).iter() {
            let _ = writeln!(o, "deltafin_requests_total{{endpoint=\"{e}\",status=\"{s}\"}} {n}");
        }
        head(&mut o, "deltafin_queue_depth", "gauge", "Generations running or waiting.");
        let _ = writeln!(o, "deltafin_queue_depth {}", self.pending.load(Ordering::Relaxed));
        head(&mut o, "deltafin_queue_capacity", "gauge", "Generations that may wait besides the running one.");
        let _ = writeln!(o, "deltafin_queue_capacity {queue_cap}");
        head(&mut o, "deltafin_rejected_total", "counter", "Requests refused with 429 (queue full).");
        let _ = writeln!(o, "deltafin_rejected_total {}", self.rejected.load(Ordering::Relaxed));
        let t = lock(&self.totals).clone();
        for (name, help, v) in [
            ("deltafin_generations_total", "Generations run (memo hits included).", t.requests),
            ("deltafin_prompt_tokens_total", "Prompt tokens of all generations.", t.prompt_tokens),
            (
                "deltafin_prompt_tokens_reused_total",
                "Prompt tokens resumed from a kept session instead of computed.",
                t.prompt_tokens_reused,
            ),
            ("deltafin_generated_tokens_total", "Tokens generated.", t.completion_tokens),
            ("deltafin_memo_hits_total", "Requests answered from the exact-response memo.", t.memo_hits),
            ("deltafin_cancelled_total", "Generations cancelled by a disconnect or shutdown.", t.cancelled),
            ("deltafin_drafts_proposed_total", "Draft tokens proposed.", t.drafts_proposed),
            ("deltafin_drafts_accepted_total", "Draft tokens accepted.", t.drafts_accepted),
        ] {
            head(&mut o, name, "counter", help);
            let _ = writeln!(o, "{name} {v}");
        }
        head(&mut o, "deltafin_ttft_seconds", "histogram", "Time to first token, from arrival.");
        let h = *lock(&self.ttft);
        for (i, b) in TTFT_BUCKETS.iter().enumerate() {
            let _ = writeln!(o, "deltafin_ttft_seconds_bucket{{le=\"{b}\"}} {}", h.0[i]);
        }
        let _ = writeln!(
            o,
            "deltafin_ttft_seconds_bucket{{le=\"+Inf\"}} {}\ndeltafin_ttft_seconds_sum {}\ndeltafin_ttft_seconds_count {}",
            h.1, h.2, h.1
        );
        head(&mut o, "deltafin_expert_bytes_requested_total", "counter", "Expert bytes the forward passes asked for.");
        let _ = writeln!(o, "deltafin_expert_bytes_requested_total {}", source.expert_bytes_requested);
        if let Some(b) = source.expert_bytes_read {
            head(&mut o, "deltafin_expert_bytes_read_total", "counter", "Expert bytes read from drives.");
            let _ = writeln!(o, "deltafin_expert_bytes_read_total {b}");
        }
        if let (Some(h), Some(m)) = (source.cache_hits, source.cache_misses) {
            head(&mut o, "deltafin_cache_hits_total", "counter", "Expert cache hits.");
            let _ = writeln!(o, "deltafin_cache_hits_total {h}");
            head(&mut o, "deltafin_cache_misses_total", "counter", "Expert cache misses.");
            let _ = writeln!(o, "deltafin_cache_misses_total {m}");
            head(&mut o, "deltafin_cache_hit_rate", "gauge", "Expert cache hits / (hits + misses) since start.");
            let rate = if h + m > 0 { h as f64 / (h + m) as f64 } else { 0.0 };
            let _ = writeln!(o, "deltafin_cache_hit_rate {rate}");
        }
        if !source.drives.is_empty() {
            head(&mut o, "deltafin_drive_bytes_read_total", "counter", "Bytes read per drive.");
            for d in &source.drives {
                let _ = writeln!(o, "deltafin_drive_bytes_read_total{{drive=\"{}\"}} {}", d.drive, d.bytes_read);
            }
            head(&mut o, "deltafin_drive_reads_total", "counter", "Reads per drive.");
            for d in &source.drives {
                let _ = writeln!(o, "deltafin_drive_reads_total{{drive=\"{}\"}} {}", d.drive, d.reads);
            }
            head(&mut o, "deltafin_drive_read_latency_ms", "gauge", "Read latency per drive (quantiles since start).");
            for d in &source.drives {
                for (q, v) in [("0.5", d.read_ms_p50), ("0.99", d.read_ms_p99), ("1", d.read_ms_max)] {
                    if let Some(v) = v {
                        let _ =
                            writeln!(o, "deltafin_drive_read_latency_ms{{drive=\"{}\",quantile=\"{q}\"}} {v}", d.drive);
                    }
                }
            }
        }
        o
    }
}
