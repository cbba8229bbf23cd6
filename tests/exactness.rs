//! The engine against the independent fp64 reference (tests/reference/k3_reference.py) on every
//! committed fixture, and the invariances the design promises: incremental decode equals full
//! recompute, thread count and expert arrival order do not change a single bit.

mod common;
use common::*;
use deltafin::engine::Engine;
use deltafin::k3::KdaMode;
use deltafin::model::roster::ExpertLayout;
use deltafin::store::{ExpertSink, ExpertSource, StoreError};
use std::sync::Arc;

/// Tolerance of the f32 engine against the fp64 reference: relative L2 error per position.
const REL_TOL: f64 = 1e-4;

#[test]
fn logits_match_fp64_reference_at_every_position() {
    for name in FIXTURES {
        let r = reference(name);
        for mode in [KdaMode::Recurrent, KdaMode::Chunked] {
            let got = score(&Engine::open(test_config(&fixture(name), mode)).unwrap(), &r.prompt);
            let (err, row) = max_rel_l2(&got, &r.logits, r.vocab);
            println!("{name} ({mode:?}): max relative L2 error {err:.3e} at position {row}");
            assert!(
                err <= REL_TOL,
                "{name} ({mode:?}): relative error {err:.3e} at position {row} exceeds {REL_TOL:e}"
            );
        }
    }
}

#[test]
fn greedy_continuation_matches_reference() {
    for name in FIXTURES {
        let r = reference(name);
        let got = greedy(&engine(&fixture(name)), &r.prompt, r.greedy.len());
        assert_eq!(got, r.greedy, "{name}: greedy continuation differs from the fp64 reference");
    }
}

/// Prefill of the first `split` tokens, then one token at a time, against one full forward.
fn incremental_vs_full(name: &str, mode: KdaMode, split: usize) -> (Vec<f32>, Vec<f32>) {
    let r = reference(name);
    let toks = &r.prompt[..split + 40];
    let e = Engine::open(test_config(&fixture(name), mode)).unwrap();
    let full = score(&e, toks);
    let mut s = e.new_session();
    let mut inc = s.score(&toks[..split]).unwrap();
    for &t in &toks[split..] {
        inc.extend(s.score(&[t]).unwrap());
    }
    (full, inc)
}

#[test]
fn incremental_decode_equals_full_recompute() {
    for name in FIXTURES {
        // The engine's default (token recurrence everywhere): the same operations, so the same bits.
        let (full, inc) = incremental_vs_full(name, KdaMode::Recurrent, 70);
        assert!(full == inc, "{name}: prefill + decode differs from full recompute");
        // Chunked prompt form: equal to rounding.
        let (full, inc) = incremental_vs_full(name, KdaMode::Chunked, 70);
        let (err, row) = max_rel_l2(&inc, &full, full.len() / 110);
        assert!(err <= 2e-5, "{name}: chunked prefill + decode vs full recompute: {err:.3e} at {row}");
    }
}

#[test]
fn one_thread_and_two_threads_give_identical_bits() {
    for name in FIXTURES {
        let r = reference(name);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let m = engine(&fixture(name));
                let mut all = score(&m, &r.prompt);
                all.extend(greedy(&m, &r.prompt[..50], 8).iter().map(|&t| t as f32));
                all
            })
        };
        let one = run(1);
        let two = run(2);
        assert!(one.iter().zip(&two).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}: 1 vs 2 threads differ");
    }
}

/// Delivers experts in reverse order: the sum must still follow router order.
struct Reversed(Arc<dyn ExpertSource>);

impl ExpertSource for Reversed {
    fn layout(&self) -> &ExpertLayout {
        self.0.layout()
    }
    fn fetch<'s>(&'s self, layer: usize, experts: &[u32], sink: &mut dyn ExpertSink<'s>) -> Result<(), StoreError> {
        let mut rev = experts.to_vec();
        rev.reverse();
        self.0.fetch(layer, &rev, sink)
    }
    fn describe(&self) -> String {
        "reversed".into()
    }
}

#[test]
fn expert_arrival_order_does_not_change_bits() {
    let name = "k3-tiny-a";
    let r = reference(name);
    let dir = fixture(name);
    let forward = score(&engine(&dir), &r.prompt);
    let m = open_model(&dir);
    let rev = Reversed(Arc::new(m.mmap_source()));
    let backward = score(&engine_with(&dir, Arc::new(rev)), &r.prompt);
    assert!(forward.iter().zip(&backward).all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[test]
fn fixtures_cover_the_required_shapes() {
    use deltafin::model::K3Config;
    use deltafin::model::config::{AttnKind, FfnKind};
    let mut blocks2 = false;
    let mut mla_last = false;
    let mut dense0 = false;
    let mut experts = false;
    let mut shared2 = false;
    let mut a_log_longer = false;
    let mut long_seq = false;
    let mut sharded = false;
    for name in FIXTURES {
        let dir = fixture(name);
        let c = K3Config::load(&dir).unwrap();
        blocks2 |= c.layers.div_ceil(c.attn_res_block) >= 2;
        mla_last |= c.attn.contains(&AttnKind::Kda) && c.attn[c.layers - 1] == AttnKind::Mla;
        dense0 |= c.ffn[0] == FfnKind::Dense && c.ffn[1..].iter().all(|f| *f == FfnKind::Moe);
        experts |= c.experts >= 16 && c.top_k >= 4;
        shared2 |= c.shared_experts == 2;
        let ck = deltafin::model::Checkpoint::open(&dir).unwrap();
        let kda_layer = c.attn.iter().position(|a| *a == AttnKind::Kda).unwrap();
        let a_log = ck.get(&deltafin::model::roster::layer(kda_layer, "self_attn.A_log")).unwrap();
        a_log_longer |= a_log.shape.iter().product::<usize>() > c.kda_heads;
        long_seq |= reference(name).prompt.len() >= 130;
        sharded |= ck.shards.len() >= 2 && dir.join("model.safetensors.index.json").exists();
    }
    assert!(blocks2 && mla_last && dense0 && experts && shared2 && a_log_longer && long_seq && sharded);
}
