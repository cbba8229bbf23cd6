//! Counters and phase timers with the stable names of DESIGN.md, their JSON and text reports, and
//! the header every benchmark record starts with ([`bench_record`]: kind, date, machine, git
//! revision, command).
//!
//! The forward pass adds to a [`Stats`]; the CLI fills the run-level fields (ttft, rates) and
//! prints its text report or writes its JSON. Counters that a component does not measure yet are
//! reported as null, never as a made-up zero.
//!
//! Contract: counters are grouped by who writes them — [`Reads`] (the forward's expert schedule and
//! the source's reads over it), [`Phases`] (the forward's phase timers), [`Drafts`] (the step core's
//! drafting lanes), [`Routes`] (routing and lookahead, per layer) — beside the run-level fields the
//! sessions and front ends fill. Every counter's size is bounded by the model (layers, experts,
//! draft widths), never by the tokens run: only the per-layer-pass [`Traces`] grow with the run,
//! and a `Stats` keeps them only when asked ([`Stats::traced`], `Session::keep_traces`: benchmarks
//! that replay or time them). The JSON names are published and do not follow the grouping.

use serde_json::{Value, json};
use std::collections::{BTreeMap, HashSet};

#[derive(Default, Clone, Debug)]
pub struct Stats {
    // Work.
    pub forward_calls: u64,
    pub rows: u64,
    /// What the MoE layer passes read.
    pub reads: Reads,
    /// Seconds per phase of the forward.
    pub phases: Phases,
    /// Drafts proposed, accepted and verified.
    pub drafts: Drafts,
    /// Routing counts and lookahead predictions per layer.
    pub routes: Routes,
    // Run level.
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    pub ttft_s: f64,
    pub prefill_s: f64,
    pub decode_s: f64,
    /// Expert bytes handed over during generation (cache hits included).
    pub decode_expert_bytes: u64,
    /// The expert source's counters (filled at the end of a run).
    pub source: Option<crate::store::SourceReport>,
    /// The trunk encoding the engine ran (`bf16`, `coded`, `int8`) and whether that is the shipped
    /// model bit for bit (int8 is not).
    pub trunk: Option<(&'static str, bool)>,
    /// The per-layer-pass traces, when kept (None: not asked for; see the module contract).
    traces: Option<Box<Traces>>,
}

/// What the MoE layer passes read: written by the forward's expert schedule (`forward::moe`), the
/// drive figures (`expert_bytes_read`, cache hits and misses) by the step core from the source's
/// reports around a forward.
#[derive(Default, Clone, Debug)]
pub struct Reads {
    /// MoE layers passed over (one pass reads that layer's expert union once).
    pub layer_passes: u64,
    /// Sum over layer passes of the distinct experts needed.
    pub experts_fetched: u64,
    /// Expert-row products computed.
    pub expert_rows: u64,
    /// Bytes handed over by the expert source (cache hits included).
    pub expert_bytes_requested: u64,
    /// Bytes actually read from drives (None when the source cannot tell, e.g. mmap).
    pub expert_bytes_read: Option<u64>,
    pub cache_hits: Option<u64>,
    pub cache_misses: Option<u64>,
    /// Experts the backend ran from its own device memory (`--gpu-cache-gb`), not fetched.
    pub device_expert_hits: u64,
    /// Routed-expert bytes a GPU backend got through a staging buffer and a copy on the device,
    /// and those it wrote once, straight into device-visible memory (unified memory: the staging
    /// copy avoided), while this run's layers ran.
    pub device_expert_staged_bytes: u64,
    pub device_expert_in_place_bytes: u64,
    /// Distinct (layer, expert) pairs used over the whole run.
    pub distinct_experts: HashSet<(u32, u32)>,
    pub expert_bytes: u64,
}

/// Seconds per phase of the forward: written by its phase clock and expert schedule (`forward`).
#[derive(Default, Clone, Debug)]
pub struct Phases {
    pub read_wait_s: f64,
    pub expert_kernel_s: f64,
    /// Of `expert_kernel_s`: the routed experts themselves (queued, run, outputs placed) and the
    /// layer's combine (weighted sum, latent norm, up-projection, shared experts).
    pub moe_experts_s: f64,
    pub moe_combine_s: f64,
    pub attention_s: f64,
    pub router_s: f64,
    pub other_s: f64,
    /// Dense (non-MoE) MLP layers.
    pub dense_mlp_s: f64,
    /// Compute time spent waiting for expert reads, per MoE layer.
    pub layer_read_wait_s: BTreeMap<u32, f64>,
}

/// Speculative decoding's counters: written by the step core's drafting lanes (`engine::scheduler`)
/// and `Session::verify`.
#[derive(Default, Clone, Debug)]
pub struct Drafts {
    pub proposed: u64,
    pub accepted: u64,
    /// Drafts proposed / accepted at each draft position (index 0: the first draft of a verify).
    pub proposed_at: Vec<u64>,
    pub accepted_at: Vec<u64>,
    /// Verify batches run for drafts.
    pub verify_calls: u64,
    /// Draft widths asked for at each decode step of a drafting sequence (index = width; 0: a
    /// single step, the policy judging drafts not to pay there).
    pub widths: Vec<u64>,
    /// The drafter generation used (None: drafting off).
    pub drafter: Option<String>,
    /// Time in verification forwards (draft checking).
    pub verify_s: f64,
    /// Time drafters spent proposing.
    pub draft_s: f64,
    /// The drafters' own forwards: DSpark draft blocks run, and context rows folded into its
    /// latents (none while the policy asks for no DSpark draft; the rows wait as taps).
    pub drafter_forwards: u64,
    pub drafter_rows: u64,
    /// Per drafter that made drafts (`--draft auto` chooses among several): verifies, drafts
    /// proposed, drafts accepted.
    pub by_drafter: BTreeMap<String, [u64; 3]>,
}

/// Routing per layer: written by the forward's expert schedule.
#[derive(Default, Clone, Debug)]
pub struct Routes {
    /// Routing counts per (layer, expert), for `--trace-routes`.
    pub counts: BTreeMap<u32, Vec<u64>>,
    /// Lookahead prediction per layer: (predicted, actually needed, predicted and needed).
    pub predictions: BTreeMap<u32, (u64, u64, u64)>,
}

/// One entry per MoE layer pass, in order: what grows with the tokens run, kept only when asked.
#[derive(Default, Clone, Debug, PartialEq)]
pub struct Traces {
    /// Every expert-union fetch in order: (layer, experts), for judging the cache against the
    /// optimum on the same trace (`store::cache::belady_misses`).
    pub fetches: Vec<(u32, Vec<u32>)>,
    /// Seconds of each of those fetches, from the request to the last expert run (a layer's MoE
    /// time as its reads set it), in the same order.
    pub fetch_s: Vec<f32>,
    /// Beside each fetch: the rows routed to each of its experts when the pass ran several rows
    /// (empty for one row), so a replay gives the cache the same counts.
    pub rows: Vec<Vec<u32>>,
}

/// The traces of a `Stats` that keeps none.
static NO_TRACES: Traces = Traces { fetches: Vec::new(), fetch_s: Vec::new(), rows: Vec::new() };

impl Reads {
    fn merge(&mut self, o: &Reads) {
        self.layer_passes += o.layer_passes;
        self.experts_fetched += o.experts_fetched;
        self.expert_rows += o.expert_rows;
        self.expert_bytes_requested += o.expert_bytes_requested;
        self.device_expert_hits += o.device_expert_hits;
        self.device_expert_staged_bytes += o.device_expert_staged_bytes;
        self.device_expert_in_place_bytes += o.device_expert_in_place_bytes;
        self.distinct_experts.extend(o.distinct_experts.iter().copied());
        self.expert_bytes = self.expert_bytes.max(o.expert_bytes);
    }
}

impl Phases {
    fn merge(&mut self, o: &Phases) {
        self.read_wait_s += o.read_wait_s;
        self.expert_kernel_s += o.expert_kernel_s;
        self.moe_experts_s += o.moe_experts_s;
        self.moe_combine_s += o.moe_combine_s;
        self.attention_s += o.attention_s;
        self.router_s += o.router_s;
        self.other_s += o.other_s;
        self.dense_mlp_s += o.dense_mlp_s;
        for (l, s) in &o.layer_read_wait_s {
            *self.layer_read_wait_s.entry(*l).or_insert(0.0) += s;
        }
    }
}

impl Drafts {
    /// Adds another run's drafts (the drafter kept when this one has none).
    pub fn merge(&mut self, o: &Drafts) {
        self.verify_s += o.verify_s;
        self.draft_s += o.draft_s;
        self.proposed += o.proposed;
        self.accepted += o.accepted;
        add_at(&mut self.proposed_at, &o.proposed_at);
        add_at(&mut self.accepted_at, &o.accepted_at);
        add_at(&mut self.widths, &o.widths);
        self.verify_calls += o.verify_calls;
        self.drafter_forwards += o.drafter_forwards;
        self.drafter_rows += o.drafter_rows;
        for (k, v) in &o.by_drafter {
            let e = self.by_drafter.entry(k.clone()).or_default();
            e.iter_mut().zip(v).for_each(|(a, b)| *a += b);
        }
        if self.drafter.is_none() {
            self.drafter.clone_from(&o.drafter);
        }
    }
}

impl Routes {
    fn merge(&mut self, o: &Routes) {
        for (l, c) in &o.counts {
            let mine = self.counts.entry(*l).or_insert_with(|| vec![0; c.len()]);
            for (a, b) in mine.iter_mut().zip(c) {
                *a += b;
            }
        }
        for (l, (p, n, h)) in &o.predictions {
            let e = self.predictions.entry(*l).or_insert((0, 0, 0));
            e.0 += p;
            e.1 += n;
            e.2 += h;
        }
    }
}

impl Stats {
    /// Empty counters that keep the per-layer-pass traces when `on` (see the module contract).
    pub fn traced(on: bool) -> Stats {
        let mut s = Stats::default();
        s.keep_traces(on);
        s
    }

    /// Keeps the per-layer-pass traces from now on (`on`), or drops them and keeps none.
    pub fn keep_traces(&mut self, on: bool) {
        match (on, self.traces.is_some()) {
            (true, false) => self.traces = Some(Box::default()),
            (false, true) => self.traces = None,
            _ => {}
        }
    }

    /// Whether these counters keep the per-layer-pass traces.
    pub fn keeps_traces(&self) -> bool {
        self.traces.is_some()
    }

    /// The per-layer-pass traces kept (empty when none are kept).
    pub fn traces(&self) -> &Traces {
        self.traces.as_deref().unwrap_or(&NO_TRACES)
    }

    /// One MoE layer pass of `layer` for the traces, when kept: its expert union, its fetch's
    /// seconds and the rows of each of its experts.
    pub fn trace_fetch(&mut self, layer: usize, union: Vec<u32>, fetch_s: f64, rows: Vec<u32>) {
        if let Some(t) = self.traces.as_deref_mut() {
            t.fetches.push((layer as u32, union));
            t.fetch_s.push(fetch_s as f32);
            t.rows.push(rows);
        }
    }

    /// Adds another run's work counters and timers (run-level fields like TTFT are kept); its
    /// traces only where these keep traces.
    pub fn merge(&mut self, o: &Stats) {
        self.forward_calls += o.forward_calls;
        self.rows += o.rows;
        self.reads.merge(&o.reads);
        self.phases.merge(&o.phases);
        self.drafts.merge(&o.drafts);
        self.decode_expert_bytes += o.decode_expert_bytes;
        self.routes.merge(&o.routes);
        if let (Some(mine), Some(theirs)) = (self.traces.as_deref_mut(), o.traces.as_deref()) {
            mine.fetches.extend(theirs.fetches.iter().cloned());
            mine.fetch_s.extend_from_slice(&theirs.fetch_s);
            mine.rows.extend(theirs.rows.iter().cloned());
        }
    }

    /// One verify of `proposed` drafts of which the first `accepted` were K3's own picks.
    pub fn record_drafts(&mut self, proposed: usize, accepted: usize) {
        self.drafts.verify_calls += 1;
        self.drafts.proposed += proposed as u64;
        self.drafts.accepted += accepted as u64;
        let ones = |n: usize| vec![1u64; n];
        add_at(&mut self.drafts.proposed_at, &ones(proposed));
        add_at(&mut self.drafts.accepted_at, &ones(accepted));
    }

    /// A verify of `proposed` drafts made by drafter `name` kept `accepted`.
    pub fn record_drafter(&mut self, name: &str, proposed: usize, accepted: usize) {
        let e = self.drafts.by_drafter.entry(name.to_string()).or_default();
        e[0] += 1;
        e[1] += proposed as u64;
        e[2] += accepted as u64;
    }

    /// A drafting sequence's decision: `width` drafts asked for this step.
    pub fn record_width(&mut self, width: usize) {
        let widths = &mut self.drafts.widths;
        if widths.len() <= width {
            widths.resize(width + 1, 0);
        }
        widths[width] += 1;
    }

    /// Accepted / proposed drafts (None before any proposal).
    pub fn acceptance(&self) -> Option<f64> {
        (self.drafts.proposed > 0).then(|| self.drafts.accepted as f64 / self.drafts.proposed as f64)
    }

    /// Expert bytes handed over per generated token, during generation.
    pub fn decode_expert_bytes_per_token(&self) -> Option<f64> {
        (self.generated_tokens > 0).then(|| self.decode_expert_bytes as f64 / self.generated_tokens as f64)
    }

    /// Adds one routing decision per (row, selected expert) of `layer`.
    pub fn record_routes(&mut self, layer: usize, experts: &[u32], n_experts: usize) {
        let counts = self.routes.counts.entry(layer as u32).or_insert_with(|| vec![0; n_experts]);
        for &e in experts {
            if let Some(c) = counts.get_mut(e as usize) {
                *c += 1;
            }
        }
    }

    /// Scores one lookahead prediction for `layer`.
    pub fn record_prediction(&mut self, layer: usize, predicted: usize, needed: usize, hit: usize) {
        let e = self.routes.predictions.entry(layer as u32).or_insert((0, 0, 0));
        e.0 += predicted as u64;
        e.1 += needed as u64;
        e.2 += hit as u64;
    }

    /// (recall, precision) of the lookahead predictions over all layers.
    pub fn prediction_quality(&self) -> Option<(f64, f64)> {
        let (p, n, h) = self.routes.predictions.values().fold((0, 0, 0), |a, v| (a.0 + v.0, a.1 + v.1, a.2 + v.2));
        (p > 0 && n > 0).then(|| (h as f64 / n as f64, h as f64 / p as f64))
    }

    /// The route counts in the trace format `place --policy hot` reads (mark it with the model
    /// through `RouteTrace::for_model`: place refuses traces of unknown models).
    pub fn route_trace(&self) -> crate::store::placement::RouteTrace {
        crate::store::placement::RouteTrace {
            version: 1,
            model: None,
            layers: self.routes.counts.iter().map(|(l, c)| (l.to_string(), c.clone())).collect(),
            path: Default::default(),
        }
    }

    pub fn expert_bytes_unique(&self) -> u64 {
        self.reads.distinct_experts.len() as u64 * self.reads.expert_bytes
    }

    /// Bytes read from drives (from the source's report when present).
    pub fn bytes_read(&self) -> Option<u64> {
        self.source.as_ref().and_then(|s| s.expert_bytes_read).or(self.reads.expert_bytes_read)
    }

    /// Bytes read from drives / bytes of the distinct experts needed.
    pub fn read_amplification(&self) -> Option<f64> {
        let unique = self.expert_bytes_unique();
        self.bytes_read().filter(|_| unique > 0).map(|r| r as f64 / unique as f64)
    }

    pub fn prefill_tok_s(&self) -> f64 {
        if self.prefill_s > 0.0 { self.prompt_tokens as f64 / self.prefill_s } else { 0.0 }
    }

    /// Decode rate over the tokens produced after the first one.
    pub fn decode_tok_s(&self) -> f64 {
        let n = self.generated_tokens.saturating_sub(1);
        if n > 0 && self.decode_s > 0.0 { n as f64 / self.decode_s } else { 0.0 }
    }

    pub fn to_json(&self) -> Value {
        let mut v = self.work_json();
        if let Value::Object(m) = &mut v {
            if let Some((t, exact)) = self.trunk {
                m.insert("trunk".into(), json!(t));
                m.insert("exact".into(), json!(exact));
            }
            m.insert("drafter".into(), json!(self.drafts.drafter));
            m.insert("verify_calls".into(), json!(self.drafts.verify_calls));
            m.insert("draft_acceptance".into(), json!(self.acceptance()));
            let by_pos: Vec<Value> = (self.drafts.proposed_at.iter().enumerate())
                .map(|(i, &p)| {
                    let a = self.drafts.accepted_at.get(i).copied().unwrap_or(0);
                    let rate = if p > 0 { a as f64 / p as f64 } else { 0.0 };
                    json!({"position": i + 1, "proposed": p, "accepted": a, "rate": rate})
                })
                .collect();
            m.insert("draft_acceptance_by_position".into(), Value::Array(by_pos));
            m.insert("draft_widths".into(), json!(self.drafts.widths));
            m.insert("drafter_forwards".into(), json!(self.drafts.drafter_forwards));
            m.insert("drafter_context_rows".into(), json!(self.drafts.drafter_rows));
            let by: serde_json::Map<String, Value> = (self.drafts.by_drafter.iter())
                .map(|(k, v)| (k.clone(), json!({"verifies": v[0], "proposed": v[1], "accepted": v[2]})))
                .collect();
            m.insert("drafts_by_drafter".into(), Value::Object(by));
            m.insert("decode_expert_bytes".into(), json!(self.decode_expert_bytes));
            m.insert("decode_expert_bytes_per_token".into(), json!(self.decode_expert_bytes_per_token()));
        }
        v
    }

    fn work_json(&self) -> Value {
        let mut v = self.counters_json();
        if let Value::Object(m) = &mut v {
            let src = self.source.as_ref();
            m.insert("hedged_reads".into(), json!(src.and_then(|s| s.hedged_reads)));
            m.insert("hedge_wins".into(), json!(src.and_then(|s| s.hedge_wins)));
            m.insert("device_expert_staged_bytes".into(), json!(self.reads.device_expert_staged_bytes));
            m.insert("device_expert_in_place_bytes".into(), json!(self.reads.device_expert_in_place_bytes));
        }
        v
    }

    fn counters_json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "ttft_s": self.ttft_s,
            "prefill_tok_s": self.prefill_tok_s(),
            "decode_tok_s": self.decode_tok_s(),
            "decode_s": self.decode_s,
            "layer_passes": self.reads.layer_passes,
            "experts_fetched": self.reads.experts_fetched,
            "expert_rows": self.reads.expert_rows,
            "expert_bytes_requested": self.reads.expert_bytes_requested,
            "expert_bytes_read": self.bytes_read(),
            "expert_bytes_unique": self.expert_bytes_unique(),
            "read_amplification": self.read_amplification(),
            "cache_hits": self.source.as_ref().and_then(|s| s.cache_hits).or(self.reads.cache_hits),
            "cache_misses": self.source.as_ref().and_then(|s| s.cache_misses).or(self.reads.cache_misses),
            "device_expert_hits": self.reads.device_expert_hits,
            "inflight_joins": self.source.as_ref().and_then(|s| s.inflight_joins),
            "prefetch_issued": self.source.as_ref().map(|s| s.prefetch_issued),
            "prefetch_used": self.source.as_ref().map(|s| s.prefetch_used),
            "drives": self.source.as_ref().map(|s| serde_json::to_value(&s.drives).unwrap_or_default()),
            "read_wait_s": self.phases.read_wait_s,
            "expert_kernel_s": self.phases.expert_kernel_s,
            "moe_experts_s": self.phases.moe_experts_s,
            "moe_combine_s": self.phases.moe_combine_s,
            "attention_s": self.phases.attention_s,
            "router_s": self.phases.router_s,
            "other_s": self.phases.other_s,
            "dense_mlp_s": self.phases.dense_mlp_s,
            "verify_s": self.drafts.verify_s,
            "draft_s": self.drafts.draft_s,
            "prefetch_recall": self.prediction_quality().map(|q| q.0),
            "prefetch_precision": self.prediction_quality().map(|q| q.1),
            "prefetch_per_layer": self.routes.predictions.iter().map(|(l, (p, n, h))| json!({"layer": l, "predicted": p, "needed": n, "hit": h,
                "recall": if *n > 0 { *h as f64 / *n as f64 } else { 0.0 }, "precision": if *p > 0 { *h as f64 / *p as f64 } else { 0.0 }})).collect::<Vec<_>>(),
            "layer_read_wait_s": self.phases.layer_read_wait_s.iter().map(|(l, s)| json!({"layer": l, "read_wait_s": s})).collect::<Vec<_>>(),
            "drafts_proposed": self.drafts.proposed,
            "drafts_accepted": self.drafts.accepted,
            "peak_rss_bytes": peak_rss_bytes(),
            "forward_calls": self.forward_calls,
            "threads": rayon::current_num_threads(),
            "isa": crate::cpu::isa().name(),
        })
    }

    /// Human-readable report, one counter per line.
    pub fn to_text(&self) -> String {
        let j = self.to_json();
        let mut s = String::from("stats:\n");
        if let Value::Object(m) = j {
            for (k, v) in m {
                if k == "prefetch_per_layer" || k == "layer_read_wait_s" {
                    continue;
                }
                if k == "draft_acceptance_by_position" {
                    if let Value::Array(ps) = &v
                        && !ps.is_empty()
                    {
                        let rates: Vec<String> =
                            ps.iter().map(|p| format!("{:.2}", p["rate"].as_f64().unwrap_or(0.0))).collect();
                        s.push_str(&format!("  {k:<24} {}\n", rates.join(" ")));
                    }
                    continue;
                }
                if k == "drives" {
                    if let Value::Array(ds) = &v {
                        for d in ds {
                            s.push_str(&format!(
                                "  drive {} {}: {} in {} reads, p50 {} ms, p99 {} ms, max {} ms, lands_last {}, failures {}{}\n",
                                d["drive"], d["root"].as_str().unwrap_or(""), crate::util::human_bytes(d["bytes_read"].as_u64().unwrap_or(0)),
                                d["reads"], fmt_ms(&d["read_ms_p50"]), fmt_ms(&d["read_ms_p99"]), fmt_ms(&d["read_ms_max"]),
                                d["lands_last"], d["failures"], d["failed"].as_str().map(|f| format!(" (FAILED: {f})")).unwrap_or_default()
                            ));
                        }
                    }
                    continue;
                }
                let shown = match &v {
                    Value::Null => "n/a".to_string(),
                    Value::Number(n) if n.is_f64() => format!("{:.4}", n.as_f64().unwrap_or(0.0)),
                    other => other.to_string().trim_matches('"').to_string(),
                };
                s.push_str(&format!("  {k:<24} {shown}\n"));
            }
        }
        s
    }
}

/// Adds `b` element-wise into `a`, growing `a` as needed.
fn add_at(a: &mut Vec<u64>, b: &[u64]) {
    if a.len() < b.len() {
        a.resize(b.len(), 0);
    }
    for (x, y) in a.iter_mut().zip(b) {
        *x += y;
    }
}

fn fmt_ms(v: &Value) -> String {
    v.as_f64().map_or("n/a".into(), |x| format!("{x:.2}"))
}

/// Machine facts for benchmark records: CPU model, cores, kernel, memory.
pub fn machine_info() -> serde_json::Value {
    serde_json::json!({
        "cpu": cpu_model().unwrap_or_else(|| std::env::consts::ARCH.to_string()),
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "kernel": kernel_release().unwrap_or_default(),
        "os": std::env::consts::OS,
        "mem_bytes": crate::util::machine_memory(),
        "isa": crate::backend::cpu::isa().name(),
    })
}

#[cfg(target_os = "macos")]
fn cpu_model() -> Option<String> {
    crate::util::sysctl_string("machdep.cpu.brand_string")
}

#[cfg(not(target_os = "macos"))]
fn cpu_model() -> Option<String> {
    let c = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    c.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|s| s.trim().to_string())
}

#[cfg(target_os = "macos")]
fn kernel_release() -> Option<String> {
    crate::util::sysctl_string("kern.osrelease")
}

#[cfg(not(target_os = "macos"))]
fn kernel_release() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").ok().map(|s| s.trim().to_string())
}

/// The fields every benchmark record starts with: kind, date, machine, git revision, command.
pub fn bench_header(kind: &str) -> serde_json::Map<String, serde_json::Value> {
    let mut m = serde_json::Map::new();
    m.insert("bench".into(), kind.into());
    m.insert("date".into(), crate::util::today().into());
    m.insert("machine".into(), machine_info());
    m.insert("git".into(), crate::util::git_revision().into());
    m.insert("command".into(), std::env::args().collect::<Vec<_>>().join(" ").into());
    m
}

/// `header` followed by the fields of `body` (an object).
pub fn bench_record(kind: &str, body: serde_json::Value) -> serde_json::Value {
    let mut m = bench_header(kind);
    if let serde_json::Value::Object(b) = body {
        m.extend(b);
    }
    serde_json::Value::Object(m)
}

/// Peak resident set size of this process (VmHWM), where the OS reports it.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
