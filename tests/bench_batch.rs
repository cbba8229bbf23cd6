//! `bench run --batch N`'s record (issue 31): every sequence identical to its run alone, and the
//! prefill bound's compute term made of the expert kernels' measured rate and the trunk's phases
//! (not the wall less the read waits).

mod common;
use common::*;

#[test]
fn the_batch_record_bounds_prefill_by_the_measured_kernel_rate() {
    let (out, _) = run_ok(deltafin_cmd().args(["bench", "run", "--model"]).arg(fixture("k3-tiny-a")).args([
        "--batch",
        "3",
        "--prompt-tokens",
        "12",
        "--decode",
        "3",
        "--ceiling-seconds",
        "0",
    ]));
    let line = out.lines().rev().find(|l| l.starts_with('{')).expect("a record line");
    let r: serde_json::Value = serde_json::from_str(line).expect("the record is JSON");
    assert_eq!(r["batch"], 3);
    assert_eq!(r["ids_identical"], true, "{line}");
    // The sequences' context: 12 prompt + 3 decode tokens, in whole 64s.
    assert_eq!(r["engine_config"]["context"], 64, "{line}");
    let p = &r["prefill"];
    let points = p["expert_rate_points"].as_array().expect("rate points");
    assert!(!points.is_empty(), "{line}");
    // Row counts ascending, each timed.
    let rows: Vec<u64> = points.iter().map(|pt| pt[0].as_u64().expect("rows")).collect();
    assert!(rows.windows(2).all(|w| w[0] < w[1]), "{rows:?}");
    assert!(points.iter().all(|pt| pt[1].as_f64().is_some_and(|s| s > 0.0)), "{line}");
    let (k, t, c) = (p["expert_kernel_bound_s"].as_f64(), p["trunk_s"].as_f64(), p["compute_s"].as_f64());
    let (k, t, c) = (k.expect("kernel bound"), t.expect("trunk"), c.expect("compute"));
    assert!(k > 0.0 && t >= 0.0);
    assert!((c - (k + t)).abs() <= 1e-9 * c.max(1.0), "compute {c} = kernels {k} + trunk {t}");
    assert!(p["expert_rows"].as_u64().is_some_and(|n| n > 0));
    // The bound at each count's mean timing is never below the one at its fastest.
    let kf = p["expert_kernel_bound_fastest_s"].as_f64().expect("fastest kernel bound");
    assert!(kf > 0.0 && kf <= k * (1.0 + 1e-12), "fastest {kf} vs mean {k}");
    let fastest = p["expert_rate_points_fastest"].as_array().expect("fastest points");
    assert_eq!(fastest.len(), points.len(), "{line}");
    // The rate is timed on both sides of the prefill; their ratio is recorded.
    let drift = p["expert_rate_after_over_before"].as_f64().expect("the rate's drift");
    assert!(drift.is_finite() && drift > 0.0, "{line}");
    // The timed counts reach the largest pass (3 x 12 rows in one pass).
    assert_eq!(rows.last(), Some(&36), "{rows:?}");
}
