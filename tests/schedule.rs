//! Read schedules: expert-major prefill reads each distinct expert once per layer pass and gives the
//! same bits as processing the prompt one token at a time; chunking past --prefill-rows and the
//! lookahead prefetch change timing only, never output.

mod common;
use common::*;
use deltafin::k3::{ForwardStats, K3, Logits};
use deltafin::store::expert_store::{ExpertStore, StoreOptions};
use deltafin::store::reader::ReaderKind;
use deltafin::store::{ExpertSource, ShardExperts};
use std::path::Path;

use common::open_model as open;

fn store(m: &Model, dir: &Path, cache: u64, prefetch_depth: usize) -> ExpertStore {
    let spec = deltafin::store::placement::shard_spec(&m.ck, &m.roster, dir, 2, 1.0).unwrap();
    ExpertStore::open(
        spec,
        StoreOptions { cache_bytes: cache, reader: ReaderKind::Auto, prefetch_depth, record_reads: false },
    )
    .unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn expert_major_prefill_equals_token_at_a_time_bit_for_bit() {
    for name in FIXTURES {
        let dir = fixture(name);
        let m = open(&dir);
        let prompt = reference(name).prompt;
        let src = store(&m, &dir, 0, 0);
        let model = K3::new(m.cfg.clone(), &m.ck, &m.roster, Some(&src as &dyn ExpertSource)).unwrap();
        // Whole prompt in one expert-major pass.
        let mut fs = ForwardStats::default();
        let mut st = model.new_state();
        let whole = model.prefill(&mut st, &prompt, 4096, &mut fs).unwrap();
        assert_eq!(fs.layer_passes as usize, m.cfg.moe_layers(), "{name}: one pass per MoE layer");
        // One token at a time (the decode path).
        let mut st1 = model.new_state();
        let mut fs1 = ForwardStats::default();
        let mut last = Vec::new();
        for &t in &prompt {
            last = model.forward(&mut st1, &[t], Logits::Last, &mut fs1).unwrap();
        }
        assert_eq!(bits(&whole), bits(&last), "{name}: expert-major prefill differs from token-at-a-time");
        // Chunked past --prefill-rows: same bits, one pass per MoE layer per chunk.
        let mut fs2 = ForwardStats::default();
        let mut st2 = model.new_state();
        let chunked = model.prefill(&mut st2, &prompt, 50, &mut fs2).unwrap();
        assert_eq!(bits(&whole), bits(&chunked), "{name}: chunked prefill differs");
        assert_eq!(fs2.layer_passes as usize, m.cfg.moe_layers() * prompt.len().div_ceil(50));
    }
}

#[test]
fn a_cold_prefill_reads_each_distinct_expert_once() {
    for name in FIXTURES {
        let dir = fixture(name);
        let m = open(&dir);
        let prompt = reference(name).prompt;
        for cache in [0u64, 1 << 30] {
            let src = store(&m, &dir, cache, 0);
            let model = K3::new(m.cfg.clone(), &m.ck, &m.roster, Some(&src as &dyn ExpertSource)).unwrap();
            let mut fs = ForwardStats::default();
            model.prefill(&mut model.new_state(), &prompt, 4096, &mut fs).unwrap();
            let r = src.report();
            let reads: u64 = r.drives.iter().map(|d| d.reads).sum();
            assert_eq!(reads as usize, fs.distinct_experts.len(), "{name}, cache {cache}: reads != distinct experts");
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
    let mmap = ShardExperts::new(&m.ck, &m.roster).unwrap();
    let run = |src: &dyn ExpertSource, prefetch: bool| {
        let mut model = K3::new(m.cfg.clone(), &m.ck, &m.roster, Some(src)).unwrap();
        model.prefetch = prefetch;
        let mut st = model.new_state();
        let mut fs = ForwardStats::default();
        let mut out = model.prefill(&mut st, &r.prompt, 4096, &mut fs).unwrap();
        for _ in 0..12 {
            let t = deltafin::k3::argmax(&out[out.len() - m.cfg.vocab..]);
            out.extend(model.forward(&mut st, &[t], Logits::Last, &mut fs).unwrap());
        }
        (out, fs)
    };
    let (want, _) = run(&mmap, false);
    for cache in [0u64, 1 << 20] {
        let src = store(&m, &dir, cache, 2);
        let (got, fs) = run(&src, true);
        assert_eq!(bits(&got), bits(&want), "cache {cache}: prefetch changed the output");
        let (recall, precision) = fs.prediction_quality().expect("predictions were scored");
        assert!((0.0..=1.0).contains(&recall) && (0.0..=1.0).contains(&precision));
        let rep = src.report();
        assert!(rep.prefetch_issued > 0, "cache {cache}: nothing was prefetched");
        assert!(rep.prefetch_used <= rep.prefetch_issued);
    }
}
