//! Batch jobs share every expert read: N prompts prefilled in shared expert-major passes and
//! decoded in lockstep give each sequence exactly what it gets alone (logits bit for bit, the
//! same greedy and seeded-sampled tokens), read each pass's expert union once, and a pass that
//! fails leaves every session as it was; sequences that join and leave a running batch at step
//! boundaries (their prompt chunks riding along the others' decode rows) get what they get alone;
//! `run` with several prompts prints each prompt's answer alone.

mod common;
use common::*;
use deltafin::engine::{BatchSeq, Engine, EngineConfig, GenerateOptions, Lane, Session, prefill_passes};
use deltafin::k3::KdaMode;
use deltafin::sample::{Sampler, SamplingSpec};
use deltafin::store::expert_store::{ExpertStore, StoreOptions};
use deltafin::store::placement::{Policy, ShardUse};
use deltafin::store::{ExpertSink, ExpertSource, StoreError};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

fn reads(s: &ExpertStore) -> u64 {
    s.report().drives.iter().map(|d| d.reads).sum()
}

fn config(dir: &std::path::Path, prefill_rows: usize) -> EngineConfig {
    EngineConfig { prefill_rows, ..test_config(dir, KdaMode::Recurrent) }
}

/// Prompts of different lengths from the fixture's reference prompt.
fn prompts(r: &Reference) -> Vec<Vec<u32>> {
    vec![r.prompt[..40].to_vec(), r.prompt[40..70].to_vec(), r.prompt[70..75].to_vec(), r.prompt[5..60].to_vec()]
}

#[test]
fn passes_pack_prompts_in_order_up_to_the_row_bound() {
    assert_eq!(prefill_passes(&[3, 2], 8), vec![vec![(0, 0, 3), (1, 0, 2)]]);
    assert_eq!(
        prefill_passes(&[5, 6, 1], 4),
        vec![vec![(0, 0, 4)], vec![(0, 4, 5), (1, 0, 3)], vec![(1, 3, 6), (2, 0, 1)]]
    );
    assert_eq!(prefill_passes(&[4], 4), vec![vec![(0, 0, 4)]]);
}

#[test]
fn a_batched_prefill_equals_each_prompt_alone_and_reads_each_union_once_per_pass() {
    let dir = fixture("k3-tiny-a");
    let m = open_model(&dir);
    let r = reference("k3-tiny-a");
    let ps = prompts(&r);
    let moe = m.cfg.moe_layers() as u64;
    // Alone, each on its own store without a cache.
    let mut alone_reads = 0;
    let mut alone = Vec::new();
    for p in &ps {
        let store = shard_store(&m, 0, 2, 0);
        let e = Engine::open_with_source(config(&dir, 4096), store.clone()).unwrap();
        let mut s = e.new_session();
        s.prefill(p).unwrap();
        alone.push(bits(s.logits().unwrap()));
        alone_reads += reads(&store);
    }
    // Together: 130 rows in passes of 64, prompts spanning passes.
    for rows in [4096, 64] {
        let store = shard_store(&m, 0, 2, 0);
        let e = Engine::open_with_source(config(&dir, rows), store.clone()).unwrap();
        let mut sessions: Vec<Session> = ps.iter().map(|_| e.new_session()).collect();
        let mut refs: Vec<&mut Session> = sessions.iter_mut().collect();
        let lists: Vec<&[u32]> = ps.iter().map(Vec::as_slice).collect();
        let stats = e.prefill_sessions(&mut refs, &lists).unwrap();
        for (i, (s, p)) in sessions.iter().zip(&ps).enumerate() {
            assert_eq!(s.tokens(), &p[..]);
            assert_eq!(bits(s.logits().unwrap()), alone[i], "prompt {i} differs in a batch (rows {rows})");
        }
        let passes = prefill_passes(&ps.iter().map(Vec::len).collect::<Vec<_>>(), rows).len() as u64;
        assert_eq!(stats.reads.layer_passes, passes * moe, "one pass per MoE layer per sweep (rows {rows})");
        assert_eq!(stats.prompt_tokens, 130);
        if rows == 4096 {
            // One sweep: each distinct expert of a layer read once for all four prompts.
            let together = reads(&store);
            assert!(together < alone_reads, "shared reads {together} vs {alone_reads} alone");
            assert!(together <= (m.cfg.experts * m.cfg.moe_layers()) as u64);
        }
    }
}

/// The tokens `opts` and `params` give from a prompt alone.
fn generate_alone(e: &Arc<Engine>, p: &[u32], opts: &GenerateOptions, params: SamplingSpec) -> Vec<u32> {
    let mut s = e.new_session();
    s.prefill(p).unwrap();
    s.generate_sampled(opts, &mut Sampler::new(params), &mut |_| true).unwrap().tokens
}

#[test]
fn lockstep_decode_equals_each_sequence_alone_as_they_leave() {
    let dir = fixture("k3-tiny-a");
    let r = reference("k3-tiny-a");
    let e = Engine::open(config(&dir, 64)).unwrap();
    let ps = prompts(&r);
    let greedy = SamplingSpec::new(0.0, 1.0, 0).unwrap();
    let warm = SamplingSpec::new(0.9, 0.95, 7).unwrap();
    // Different lengths (they leave at different steps), one sampled, one stopping on a token.
    let stop_tok = r.greedy[2];
    let setups: Vec<(GenerateOptions, SamplingSpec)> = vec![
        (GenerateOptions { max_new: 9, stop: vec![] }, greedy.clone()),
        (GenerateOptions { max_new: 3, stop: vec![] }, greedy.clone()),
        (GenerateOptions { max_new: 12, stop: vec![] }, warm),
        (GenerateOptions { max_new: 10, stop: vec![stop_tok] }, greedy.clone()),
    ];
    let want: Vec<Vec<u32>> = ps.iter().zip(&setups).map(|(p, (o, sp))| generate_alone(&e, p, o, sp.clone())).collect();
    let mut sessions: Vec<Session> = ps.iter().map(|_| e.new_session()).collect();
    {
        let mut refs: Vec<&mut Session> = sessions.iter_mut().collect();
        let lists: Vec<&[u32]> = ps.iter().map(Vec::as_slice).collect();
        e.prefill_sessions(&mut refs, &lists).unwrap();
    }
    let mut samplers: Vec<Sampler> = setups.iter().map(|(_, p)| Sampler::new(p.clone())).collect();
    let mut seen = vec![0usize; ps.len()];
    let mut cbs: Vec<_> = seen
        .iter_mut()
        .map(|n| {
            move |_: u32| {
                *n += 1;
                true
            }
        })
        .collect();
    let mut seqs: Vec<BatchSeq> = sessions
        .iter_mut()
        .zip(samplers.iter_mut())
        .zip(cbs.iter_mut())
        .zip(&setups)
        .map(|(((session, sampler), on_token), (opts, _))| BatchSeq { session, opts: opts.clone(), sampler, on_token })
        .collect();
    let (gens, stats) = e.generate_sessions(&mut seqs).unwrap();
    drop(seqs);
    drop(cbs);
    for (i, g) in gens.iter().enumerate() {
        assert_eq!(g.tokens, want[i], "sequence {i} differs in lockstep");
        assert_eq!(seen[i], g.tokens.len());
        assert_eq!(sessions[i].pos(), ps[i].len() + g.tokens.len() - 1, "the last token is not fed");
    }
    // The longest runs every step; each step is one forward (one pass per MoE layer).
    let steps = gens.iter().map(|g| g.tokens.len()).max().unwrap() as u64 - 1;
    assert_eq!(stats.reads.layer_passes, steps * open_model(&dir).cfg.moe_layers() as u64);
}

#[test]
fn a_decode_step_of_several_rows_reads_ahead_and_reads_nothing_twice() {
    // A copy: the placement is written beside the model.
    let copy = copy_fixture("k3-tiny-a");
    let dir = copy.path().to_path_buf();
    let m = open_model(&dir);
    let ps = prompts(&reference("k3-tiny-a"));
    let greedy = SamplingSpec::new(0.0, 1.0, 0).unwrap();
    let plain = Engine::open(config(&fixture("k3-tiny-a"), 64)).unwrap();
    // One decode step (the prefill gives the first token), then several.
    for max_new in [2, 5] {
        let opts = GenerateOptions { max_new, stop: vec![] };
        let want: Vec<Vec<u32>> = ps.iter().map(|p| generate_alone(&plain, p, &opts, greedy.clone())).collect();
        // Placed in a pack (each expert at its own page-aligned offset, so a read names its
        // expert); no cache: a step's experts are read (ahead or on demand) into the read slots.
        let tmp = tempfile::tempdir().unwrap();
        let man = place_model(&m, &drive_dirs(tmp.path(), 1), |_| 1.0, Policy::Spread, ShardUse::Off, None);
        let layout = m.roster.expert_layout.clone().unwrap();
        let spec = deltafin::store::placement::manifest_spec(&man, &m.ck, &m.roster, layout).unwrap();
        let so = StoreOptions { cache_bytes: 0, prefetch_depth: 0, record_reads: true, ..Default::default() };
        let store = Arc::new(ExpertStore::open(spec, so).unwrap());
        let e = Engine::open_with_source(config(&dir, 64), store.clone()).unwrap();
        let mut sessions: Vec<Session> = ps.iter().map(|_| e.new_session()).collect();
        {
            let mut refs: Vec<&mut Session> = sessions.iter_mut().collect();
            let lists: Vec<&[u32]> = ps.iter().map(Vec::as_slice).collect();
            e.prefill_sessions(&mut refs, &lists).unwrap();
        }
        let before = store.report();
        let logged = store.read_log().len();
        let mut samplers: Vec<Sampler> = ps.iter().map(|_| Sampler::new(greedy.clone())).collect();
        let mut each: Vec<fn(u32) -> bool> = vec![|_| true; ps.len()];
        let mut seqs: Vec<BatchSeq> = sessions
            .iter_mut()
            .zip(samplers.iter_mut())
            .zip(each.iter_mut())
            .map(|((session, sampler), on_token)| BatchSeq { session, opts: opts.clone(), sampler, on_token })
            .collect();
        let (gens, _) = e.generate_sessions(&mut seqs).unwrap();
        for (i, g) in gens.iter().enumerate() {
            assert_eq!(g.tokens, want[i], "sequence {i}: reading ahead changed its tokens");
        }
        let after = store.report();
        let (issued, used) =
            (after.prefetch_issued - before.prefetch_issued, after.prefetch_used - before.prefetch_used);
        assert!(issued > 0 && used > 0, "a decode step of {} rows read nothing ahead ({used} of {issued})", ps.len());
        if max_new == 2 {
            // One step reads each (layer, expert) at most once, ahead or on demand.
            let mut step: Vec<_> = store.read_log()[logged..].to_vec();
            let n = step.len();
            step.sort();
            step.dedup();
            assert_eq!(step.len(), n, "a decode step read something twice ({used} of {issued} ahead used)");
        }
    }
}

/// Fails every fetch of `layer` from the `fail_from`-th on.
struct FailLate {
    inner: Arc<dyn ExpertSource>,
    layer: usize,
    fail_from: AtomicUsize,
    fetches: AtomicUsize,
}

impl ExpertSource for FailLate {
    fn layout(&self) -> &deltafin::model::roster::ExpertLayout {
        self.inner.layout()
    }
    fn fetch<'s>(&'s self, layer: usize, experts: &[u32], sink: &mut dyn ExpertSink<'s>) -> Result<(), StoreError> {
        if layer == self.layer && self.fetches.fetch_add(1, Ordering::Relaxed) >= self.fail_from.load(Ordering::Relaxed)
        {
            return Err(StoreError::NoHolderLeft(format!("injected read error in layer {layer}")));
        }
        self.inner.fetch(layer, experts, sink)
    }
    fn describe(&self) -> String {
        "failing".into()
    }
}

#[test]
fn a_batched_prefill_that_fails_late_leaves_every_session_as_it_was() {
    let dir = fixture("k3-tiny-a");
    let m = open_model(&dir);
    let r = reference("k3-tiny-a");
    let src = Arc::new(FailLate {
        inner: Arc::new(m.mmap_source()),
        layer: 1,
        fail_from: AtomicUsize::new(usize::MAX),
        fetches: AtomicUsize::new(0),
    });
    let e = Engine::open_with_source(config(&dir, 32), src.clone()).unwrap();
    let (mut a, mut b) = (e.new_session(), e.new_session());
    a.prefill(&r.prompt[..10]).unwrap();
    let before = bits(a.logits().unwrap());
    // 60 rows in passes of 32: the second pass fails after the first committed.
    src.fail_from.store(src.fetches.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    assert!(e.prefill_sessions(&mut [&mut a, &mut b], &[&r.prompt[10..40], &r.prompt[40..70]]).is_err());
    assert_eq!((a.pos(), a.tokens()), (10, &r.prompt[..10]));
    assert_eq!(bits(a.logits().unwrap()), before);
    assert_eq!((b.pos(), b.logits().is_none()), (0, true));
    src.fail_from.store(usize::MAX, Ordering::Relaxed);
    e.prefill_sessions(&mut [&mut a, &mut b], &[&r.prompt[10..40], &r.prompt[40..70]]).unwrap();
    let mut fresh = e.new_session();
    fresh.prefill(&r.prompt[..40]).unwrap();
    assert_eq!(bits(a.logits().unwrap()), bits(fresh.logits().unwrap()));
}

#[test]
fn run_with_several_prompts_prints_each_answer_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    synth_small(&dir, Some("5"));
    let run = |extra: &[&str]| {
        let mut c = deltafin_cmd();
        c.args(["run", "--model"]).arg(&dir).args(["--max-new", "7", "--format", "json", "-q", "--memory-gb", "2"]);
        c.args(extra);
        run_ok(&mut c).0
    };
    let texts = ["Once upon a time", "The", "A much longer prompt about the sea and the sky"];
    let alone: Vec<serde_json::Value> = texts
        .iter()
        .map(|t| serde_json::from_str(&run(&["--prompt", t, "--seed", "3", "--temperature", "0.7"])).unwrap())
        .collect();
    let mut args = vec!["--seed", "3", "--temperature", "0.7"];
    for t in &texts {
        args.extend(["--prompt", t]);
    }
    let lines_file = tmp.path().join("prompts.txt");
    std::fs::write(&lines_file, format!("{}\n\n{}\n{}\n", texts[0], texts[1], texts[2])).unwrap();
    let by_lines = run(&["--prompt-lines", lines_file.to_str().unwrap(), "--seed", "3", "--temperature", "0.7"]);
    // Two at a time: the third prompt joins when one of the first two finishes; drafting too.
    let mut two = args.clone();
    two.extend(["--parallel", "2", "--draft", "ngram"]);
    for out in [run(&args), by_lines, run(&two)] {
        let lines: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), texts.len() + 1, "{out}");
        for (got, want) in lines.iter().zip(&alone) {
            for k in ["prompt_ids", "output_ids", "text"] {
                assert_eq!(got[k], want[k], "{k}");
            }
        }
        assert_eq!(
            lines[texts.len()]["stats"]["prompt_tokens"],
            alone.iter().map(|a| a["prompt_ids"].as_array().unwrap().len()).sum::<usize>()
        );
    }
}

#[test]
fn lanes_that_join_and_leave_a_running_batch_equal_each_sequence_alone() {
    let dir = fixture("k3-tiny-a");
    let r = reference("k3-tiny-a");
    // 16 rows a step: the 40- and 55-token prompts take several steps beside decode rows.
    let e = Engine::open(config(&dir, 16)).unwrap();
    let ps = prompts(&r);
    let greedy = SamplingSpec::new(0.0, 1.0, 0).unwrap();
    let warm = SamplingSpec::new(0.9, 0.95, 11).unwrap();
    let stop_tok = r.greedy[1];
    let setups: Vec<(GenerateOptions, SamplingSpec)> = vec![
        (GenerateOptions { max_new: 14, stop: vec![] }, greedy.clone()),
        (GenerateOptions { max_new: 4, stop: vec![] }, warm.clone()),
        (GenerateOptions { max_new: 9, stop: vec![stop_tok] }, greedy.clone()),
        (GenerateOptions { max_new: 7, stop: vec![] }, warm.clone()),
    ];
    let want: Vec<Vec<u32>> = ps.iter().zip(&setups).map(|(p, (o, sp))| generate_alone(&e, p, o, sp.clone())).collect();
    // Sequence i joins at step joins[i]; finished ones leave between steps.
    let joins = [0usize, 0, 3, 6];
    let mut lanes: Vec<(usize, Lane)> = Vec::new();
    let mut got: Vec<Option<Vec<u32>>> = vec![None; ps.len()];
    let mut peak = 0;
    let mut step = 0;
    while got.iter().any(Option::is_none) {
        for (i, &j) in joins.iter().enumerate() {
            if j == step {
                let (o, sp) = &setups[i];
                lanes
                    .push((i, Lane::new(e.new_session(), ps[i].clone(), o.clone(), Sampler::new(sp.clone())).unwrap()));
            }
        }
        let (ids, mut ls): (Vec<usize>, Vec<Lane>) = lanes.drain(..).unzip();
        let mut streamed: Vec<Vec<u32>> = vec![Vec::new(); ls.len()];
        let mut on_token = |k: usize, t: u32| {
            streamed[k].push(t);
            true
        };
        e.step_lanes(&mut ls, &mut on_token, &mut Default::default()).unwrap();
        peak = peak.max(ls.iter().map(|l| l.peak_batch()).max().unwrap_or(0));
        for ((l, i), seen) in ls.into_iter().zip(ids).zip(streamed) {
            // The callback saw each token as it was emitted.
            assert!(seen.len() <= 1 && l.tokens().ends_with(&seen));
            if l.done() {
                got[i] = Some(l.tokens().to_vec());
            } else {
                lanes.push((i, l));
            }
        }
        step += 1;
        assert!(step < 200, "the batch never finished");
    }
    for (i, g) in got.into_iter().enumerate() {
        assert_eq!(g.unwrap(), want[i], "sequence {i} differs in a running batch");
    }
    assert!(peak >= 3, "sequences shared steps (peak {peak})");
}

#[test]
fn run_with_more_prompts_than_fit_names_the_parallel_that_does() {
    let tmp = tempfile::tempdir().unwrap();
    let lines: Vec<String> = (0..40).map(|i| format!("Prompt number {i} about the sea")).collect();
    let file = tmp.path().join("prompts.txt");
    std::fs::write(&file, lines.join("\n")).unwrap();
    let run = |extra: &[&str]| {
        let mut c = deltafin_cmd();
        c.args([
            "run",
            "--demo",
            "--temperature",
            "0",
            "--max-new",
            "4",
            "-q",
            "--memory-gb",
            "0.04",
            "--prompt-lines",
        ]);
        c.arg(&file).args(extra);
        c.output().unwrap()
    };
    let out = run(&[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("memory budget"), "{err}");
    let k: u32 = err
        .rsplit("--parallel ")
        .next()
        .and_then(|t| t.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no --parallel suggested: {err}"));
    assert!((1..40).contains(&k), "{err}");
    // What it names runs.
    let out = run(&["--parallel", &k.to_string()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let answers = String::from_utf8_lossy(&out.stdout).lines().filter(|l| !l.is_empty()).count();
    assert!(answers >= 40, "{answers} lines for 40 prompts");
}
