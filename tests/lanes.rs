//! Drafts inside a running batch, on the trained demo model and its DSpark drafter: requests run
//! as lanes of `Engine::run_continuous` (N = 1, 3, 8 at once, more requests than lanes so newcomers
//! join as others leave, prompts chunked so their rows ride beside decode and verify rows), some
//! drafting and some not, greedy and seeded sampling, a stop token met among accepted drafts —
//! every request's tokens identical to its run alone with drafts off, drafts accepted.

mod common;
use common::*;
use deltafin::draft::{DSparkDrafter, Speculator};
use deltafin::engine::{Engine, EngineConfig, GenerateOptions, Lane, LaneError, LaneHost};
use deltafin::k3::KdaMode;
use deltafin::sample::{Sampler, SamplingSpec};
use std::path::PathBuf;
use std::sync::Arc;

fn demo(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("demo").join(name)
}

fn config(prefill_rows: usize) -> EngineConfig {
    EngineConfig {
        draft_model: Some(demo("kimi-k3-demo-dspark")),
        prefill_rows,
        ..test_config(&demo("kimi-k3-demo"), KdaMode::Recurrent)
    }
}

/// One request: prompt, options, sampling, and whether it drafts.
#[derive(Clone)]
struct Req {
    prompt: Vec<u32>,
    opts: GenerateOptions,
    params: SamplingSpec,
    draft: bool,
}

fn alone(e: &Arc<Engine>, r: &Req) -> Vec<u32> {
    let mut s = e.new_session();
    s.prefill(&r.prompt).unwrap();
    s.generate_sampled(&r.opts, &mut Sampler::new(r.params.clone()), &mut |_| true).unwrap().tokens
}

/// The requests as the driver's host: each joins when there is room, its tokens kept by index.
struct Host<'a> {
    e: &'a Arc<Engine>,
    reqs: &'a [Req],
    next: usize,
    got: Vec<Option<Vec<u32>>>,
    streamed: Vec<Vec<u32>>,
    peak: usize,
}

impl LaneHost for Host<'_> {
    type Tag = usize;

    fn next(&mut self, _idle: bool) -> Option<(usize, Lane)> {
        let i = self.next;
        let r = self.reqs.get(i)?;
        self.next += 1;
        let lane =
            Lane::new(self.e.new_session(), r.prompt.clone(), r.opts.clone(), Sampler::new(r.params.clone())).unwrap();
        let lane = match r.draft {
            true => {
                let d = DSparkDrafter::new(Arc::clone(self.e.dspark_model().unwrap()));
                lane.with_drafts(Speculator::without_cost_model(Box::new(d)))
            }
            false => lane,
        };
        Some((i, lane))
    }

    fn token(&mut self, i: &mut usize, t: u32) -> bool {
        self.streamed[*i].push(t);
        true
    }

    fn finished(&mut self, i: usize, lane: Lane) {
        self.peak = self.peak.max(lane.peak_batch());
        self.got[i] = Some(lane.tokens().to_vec());
    }

    fn failed(&mut self, i: usize, _: Lane, e: &LaneError) {
        panic!("request {i} failed: {e}");
    }
}

fn requests(e: &Arc<Engine>, draft: bool) -> Vec<Req> {
    let j: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture("trained").join("fixture.json")).unwrap()).unwrap();
    let ids: Vec<u32> = j["prompt_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    let greedy = SamplingSpec::new(0.0, 1.0, 0).unwrap();
    let mut reqs: Vec<Req> = (0..10)
        .map(|i| Req {
            prompt: ids[7 * i..7 * i + 5 + 6 * i].to_vec(),
            opts: GenerateOptions { max_new: 12 + 3 * i, stop: vec![] },
            params: if i % 2 == 1 { SamplingSpec::new(0.8, 0.95, 40 + i as u64).unwrap() } else { greedy.clone() },
            // Drafting and plain requests share steps.
            draft: draft && i % 3 != 2,
        })
        .collect();
    // Request 0 stops at a token of its own greedy continuation: an end among accepted drafts.
    let t = alone(e, &reqs[0])[6];
    reqs[0].opts.stop = vec![t];
    reqs
}

fn drive(e: &Arc<Engine>, reqs: &[Req], n: usize) -> (Vec<Vec<u32>>, u64, usize) {
    let mut host =
        Host { e, reqs, next: 0, got: vec![None; reqs.len()], streamed: vec![Vec::new(); reqs.len()], peak: 0 };
    let stats = e.run_continuous(n, &mut host);
    let got: Vec<Vec<u32>> = host.got.into_iter().map(Option::unwrap).collect();
    assert_eq!(host.streamed, got, "the callback saw every token once, in order");
    (got, stats.drafts.accepted, host.peak)
}

#[test]
fn drafting_lanes_equal_each_request_alone_with_drafts_off() {
    // 40 rows a step: prompts take several steps beside decode and verify rows, drafts fit too.
    for (rows, ns) in [(40, &[1usize, 3, 8][..])] {
        let e = Engine::open(config(rows)).unwrap();
        let reqs = requests(&e, true);
        let want: Vec<Vec<u32>> = reqs.iter().map(|r| alone(&e, r)).collect();
        assert!(want[0].len() <= 7 && reqs[0].opts.stop.contains(want[0].last().unwrap()));
        for &n in ns {
            let (got, accepted, peak) = drive(&e, &reqs, n);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g, w, "request {i} (drafts {}), {n} at once, prefill rows {rows}", reqs[i].draft);
            }
            assert!(accepted > 0, "{n} at once: no draft accepted");
            assert_eq!(peak, n, "{n} lanes shared steps");
            // Drafts off in the same batch: the same tokens.
            let (off, none, _) = drive(&e, &requests(&e, false), n);
            assert_eq!(off, got, "{n} at once: drafts off vs on");
            assert_eq!(none, 0);
            eprintln!("{n} at once, prefill rows {rows}: identical, {accepted} drafts accepted");
        }
    }
}
