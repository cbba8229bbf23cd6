//! A GPU readback that fails (injected with `backend::gpu::fail_readback_in`, or
//! `DELTAFIN_GPU_FAIL_READBACK` for the binary) reaches the caller as an error naming the
//! readback, never as NaN or a wrong token, and leaves the session as it was (position, tokens and
//! the bits of its logits): a prefill failing at several points of its pass, a step, a verify, a
//! generation; afterwards the same calls give the logits of an engine that never failed (within
//! 1e-5: on lavapipe a GPU engine's later sessions differ from its first in the last bits, failure
//! or not) and its greedy tokens. The CLI exits with the error and prints only correct tokens. A
//! test binary of its own: the hook is process-wide. Runs where wgpu finds an adapter (CI installs
//! Mesa's lavapipe).
#![cfg(feature = "gpu")]

mod common;
use common::*;
use deltafin::backend::BackendKind;
use deltafin::backend::gpu::{GpuBackend, fail_readback_in, set_ops_min};
use deltafin::engine::{Engine, EngineConfig, GenerateOptions, Session};
use deltafin::k3::KdaMode;

/// Held by each test: the hook counts every readback of the process (a GPU's open included).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// What a caller can see of a session: position, tokens and the bits of its last logits.
fn seen(s: &Session) -> (usize, Vec<u32>, Option<Vec<u32>>) {
    (s.pos(), s.tokens().to_vec(), s.logits().map(bits))
}

/// The session's last logits are those of `want` within 1e-5 (relative L2), at the same position.
fn same_as(s: &Session, want: &Session, what: &str) {
    assert_eq!((s.pos(), s.tokens()), (want.pos(), want.tokens()), "{what}");
    let (got, want) = (s.logits().unwrap(), want.logits().unwrap());
    let (err, _) = max_rel_l2(got, want, want.len());
    assert!(err <= 1e-5, "{what}: logits {err:.2e} from an engine that never failed");
}

fn is_readback_failure(e: &impl std::fmt::Display) -> bool {
    let msg = e.to_string();
    msg.contains("GPU readback failed") && msg.contains("injected")
}

#[test]
fn a_failed_readback_is_an_error_that_leaves_the_session_as_it_was() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    if let Err(e) = GpuBackend::new(true) {
        no_gpu("tests/gpu_faults.rs", &e);
        return;
    }
    // Every operation on the GPU: every one of them reads its result back.
    set_ops_min(0);
    let dir = fixture("k3-tiny-b");
    let r = reference("k3-tiny-b");
    let open = || Engine::open(EngineConfig { backend: BackendKind::Gpu, ..test_config(&dir, KdaMode::Recurrent) });
    let (clean, e) = (open().unwrap(), open().unwrap());
    let (prompt, next) = (&r.prompt[..20], &r.prompt[20..26]);
    let mut want = clean.new_session();
    want.prefill(prompt).unwrap();

    let mut s = e.new_session();
    // A prompt failing at its first readback, a few layers in, and late in the pass: nothing of
    // it is kept, and then it runs as if nothing had happened.
    for k in [1, 5, 25] {
        fail_readback_in(k);
        let err = s.prefill(prompt).expect_err("the prefill reads back more than 25 times");
        assert!(is_readback_failure(&err), "{err}");
        assert_eq!(seen(&s), (0, Vec::new(), None), "readback {k}: the failed prefill left nothing");
    }
    fail_readback_in(0);
    s.prefill(prompt).unwrap();
    same_as(&s, &want, "the prefill after the failures");

    // Decode steps failing at several points.
    for (i, &t) in next.iter().enumerate() {
        let before = seen(&s);
        fail_readback_in(1 + 4 * i as u64);
        let err = s.step(t).expect_err("a step reads back more than 21 times");
        assert!(is_readback_failure(&err), "{err}");
        assert_eq!(seen(&s), before, "step {i}: the failed step changed the session");
        fail_readback_in(0);
        s.step(t).unwrap();
        want.step(t).unwrap();
        same_as(&s, &want, &format!("step {i} after the failure"));
    }

    // A verify that fails leaves nothing pending: a commit after it is refused.
    let before = seen(&s);
    fail_readback_in(3);
    let err = s.verify(&r.prompt[26..30], &[]).unwrap_err();
    assert!(is_readback_failure(&err), "{err}");
    assert!(s.commit(1).is_err(), "nothing to commit after a failed verify");
    assert_eq!(seen(&s), before);

    // A generation that fails emits only the tokens K3 chose before the failure.
    let opts = GenerateOptions { max_new: 6, stop: Vec::new() };
    let right = want.generate(&opts, &mut |_| true).unwrap().tokens;
    let mut emitted = Vec::new();
    fail_readback_in(60);
    let err = s
        .generate(&opts, &mut |t| {
            emitted.push(t);
            true
        })
        .unwrap_err();
    fail_readback_in(0);
    assert!(is_readback_failure(&err), "{err}");
    assert!(emitted.len() < right.len() && emitted[..] == right[..emitted.len()], "{emitted:?} vs {right:?}");
    eprintln!("generation failed after {} correct tokens: {err}", emitted.len());
}

#[test]
fn the_cli_exits_with_the_failure_and_prints_only_correct_tokens() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    if GpuBackend::new(true).is_err() {
        return;
    }
    let r = reference("k3-tiny-c");
    for n in ["1", "150"] {
        let o = deltafin_cmd()
            .args(["run", "--backend", "gpu", "--model"])
            .arg(fixture("k3-tiny-c"))
            .args(["--prompt-ids", &ids_arg(&r.prompt), "--max-new", "8", "--ignore-eos"])
            .env("DELTAFIN_GPU_OPS_MIN", "0")
            .env("DELTAFIN_GPU_FAIL_READBACK", n)
            .output()
            .unwrap();
        let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(!o.status.success(), "readback {n}: the run must fail\n{err}");
        assert!(err.contains("GPU readback failed"), "readback {n}: {err}");
        let printed = out.trim().trim_end_matches(',');
        assert!(ids_arg(&r.greedy[..8]).starts_with(printed), "readback {n}: printed {printed:?}");
        assert!(!out.contains("NaN"));
    }
}
