//! Read schedules: expert-major prefill reads each distinct expert once per layer pass and gives the
//! same bits as processing the prompt one token at a time; chunking past --prefill-rows and the
//! lookahead prefetch change timing only, never output.

mod common;
use common::*;
use deltafin::engine::{Engine, EngineConfig};
use deltafin::k3::KdaMode;
use deltafin::store::ExpertSource;
use std::path::Path;
use std::sync::Arc;

use common::open_model as open;

fn cfg(dir: &Path, prefill_rows: usize, prefetch: bool) -> EngineConfig {
    EngineConfig { prefill_rows, prefetch, ..test_config(dir, KdaMode::Recurrent) }
}

#[test]
fn expert_major_prefill_equals_token_at_a_time_bit_for_bit() {
    for name in FIXTURES {
        let dir = fixture(name);
        let m = open(&dir);
        let prompt = reference(name).prompt;
        let src = shard_store(&m, 0, 2, 0);
        let e = Engine::open_with_source(cfg(&dir, 4096, false), src.clone()).unwrap();
        // Whole prompt in one expert-major pass.
        let mut s = e.new_session();
        let whole = s.prefill(&prompt).unwrap().to_vec();
        assert_eq!(s.stats.reads.layer_passes as usize, m.cfg.moe_layers(), "{name}: one pass per MoE layer");
        // One token at a time (the decode path).
        let mut s1 = e.new_session();
        let mut last = Vec::new();
        for &t in &prompt {
            last = s1.step(t).unwrap().to_vec();
        }
        assert_eq!(bits(&whole), bits(&last), "{name}: expert-major prefill differs from token-at-a-time");
        // Chunked past --prefill-rows: same bits, one pass per MoE layer per chunk.
        let e50 = Engine::open_with_source(cfg(&dir, 50, false), src.clone()).unwrap();
        let mut s2 = e50.new_session();
        let chunked = s2.prefill(&prompt).unwrap().to_vec();
        assert_eq!(bits(&whole), bits(&chunked), "{name}: chunked prefill differs");
        assert_eq!(s2.stats.reads.layer_passes as usize, m.cfg.moe_layers() * prompt.len().div_ceil(50));
    }
}

#[test]
fn a_cold_prefill_reads_each_distinct_expert_once() {
    for name in FIXTURES {
        let dir = fixture(name);
        let m = open(&dir);
        let prompt = reference(name).prompt;
        for cache in [0u64, 1 << 30] {
            let src = shard_store(&m, cache, 2, 0);
            let e = engine_with(&dir, src.clone());
            let mut s = e.new_session();
            s.prefill(&prompt).unwrap();
            let r = src.report();
            let reads: u64 = r.drives.iter().map(|d| d.reads).sum();
            assert_eq!(
                reads as usize,
                s.stats.reads.distinct_experts.len(),
                "{name}, cache {cache}: reads != distinct experts"
            );
            // Bytes read = distinct experts x (expert size rounded to the 4 KiB O_DIRECT unit).
            let unit = (m.cfg.expert_bytes() as u64).div_ceil(4096) * 4096 + 4096;
            assert!(r.expert_bytes_read.unwrap() <= reads * unit);
        }
    }
}

#[test]
fn prefetch_changes_timing_not_bits_and_is_scored() {
    let name = "k3-tiny-a";
    let dir = fixture(name);
    let m = open(&dir);
    let r = reference(name);
    let run = |src: Arc<dyn ExpertSource>, prefetch: bool| {
        let e = Engine::open_with_source(cfg(&dir, 4096, prefetch), src).unwrap();
        let mut s = e.new_session();
        let mut out = s.prefill(&r.prompt).unwrap().to_vec();
        for _ in 0..12 {
            let t = deltafin::k3::argmax(&out[out.len() - m.cfg.vocab..]);
            out.extend_from_slice(s.step(t).unwrap());
        }
        (out, s.stats.clone())
    };
    let (want, _) = run(Arc::new(m.mmap_source()), false);
    for cache in [0u64, 1 << 20] {
        let src = shard_store(&m, cache, 2, 2);
        let (got, fs) = run(src.clone(), true);
        assert_eq!(bits(&got), bits(&want), "cache {cache}: prefetch changed the output");
        let (recall, precision) = fs.prediction_quality().expect("predictions were scored");
        assert!((0.0..=1.0).contains(&recall) && (0.0..=1.0).contains(&precision));
        let rep = src.report();
        assert!(rep.prefetch_issued > 0, "cache {cache}: nothing was prefetched");
        assert!(rep.prefetch_used <= rep.prefetch_issued);
    }
}
