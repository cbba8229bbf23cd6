//! The union-aware policy on synthetic costs (see the module contract of `draft/union.rs`).
use super::*;

const L: u64 = 10;
const EB: u64 = 1 << 20;

/// A forward of `rows` rows with `u` experts per layer, `read` of them read from the drive at
/// `per_byte` seconds a byte, kernels at 0.5 ms an expert and 10 us an expert row, and a trunk
/// of 20 ms + 1 ms a row.
fn forward(rows: usize, u: u64, read: f64, per_byte: f64) -> ForwardCost {
    let bytes = (read * (u * L * EB) as f64) as u64;
    let kernel = L as f64 * (0.0005 * u as f64 + 0.00001 * (8 * rows) as f64);
    let wait = bytes as f64 * per_byte;
    ForwardCost {
        rows,
        layers: L,
        experts: u * L,
        expert_rows: 8 * rows as u64 * L,
        expert_bytes: EB,
        bytes_read: Some(bytes),
        read_wait_s: wait,
        kernel_s: kernel,
        secs: 0.02 + 0.001 * rows as f64 + kernel + wait,
    }
}

fn taught(read: f64, per_byte: f64) -> UnionPolicy {
    let mut p = UnionPolicy::new(7, 64);
    for _ in 0..4 {
        for (rows, u) in [(1, 8), (2, 15), (1, 8), (4, 26), (1, 8), (8, 40)] {
            p.observe(&forward(rows, u, read, per_byte));
        }
    }
    p
}

#[test]
fn a_slow_drive_and_low_acceptance_keep_drafts_off() {
    // Every expert read from a 200 MB/s drive; the drafter's first draft kept once in six.
    let mut p = taught(1.0, 1.0 / 200e6);
    assert_eq!(p.best(0).unwrap().0, 0, "even at the prior acceptance a verify's union costs more than it emits");
    for _ in 0..8 {
        p.verified(2, 0);
    }
    assert!(p.acceptance()[0] < 0.1);
    assert_eq!(p.decide(0), 0);
    let c1 = p.forward_s(1).unwrap();
    let c2 = p.forward_s(2).unwrap();
    assert!(c2 / c1 > 1.7, "two rows read nearly twice the experts: {c2} / {c1}");
}

#[test]
fn everything_resident_and_high_acceptance_draft_wide() {
    let mut p = taught(0.0, 1.0 / 200e6);
    for _ in 0..20 {
        p.verified(7, 7);
    }
    let w = p.decide(0);
    assert!(w >= 5, "resident experts and drafts that are kept: draft wide (got {w})");
    // The same costs with drafts that miss: single steps.
    for _ in 0..20 {
        p.verified(7, 0);
    }
    assert_eq!(p.best(0).unwrap().0, 0);
}

#[test]
fn resident_experts_on_a_slow_drive_still_pay() {
    // The drive is slow but nothing is read: only compute counts.
    let mut p = taught(0.0, 1.0 / 1e6);
    for _ in 0..20 {
        p.verified(4, 3);
    }
    assert!(p.decide(0) >= 2);
}

#[test]
fn expected_tokens_multiply_conditional_acceptance() {
    let mut p = UnionPolicy::new(3, 0);
    assert_eq!(p.emitted(0), 1.0);
    assert!((p.emitted(2) - (1.0 + 0.5 + 0.25)).abs() < 1e-12);
    p.verified(3, 1);
    // Position 1 kept, position 2 rejected, position 3 not seen: the mean with the prior as
    // one verify.
    let a = p.acceptance().to_vec();
    assert!((a[0] - 0.75).abs() < 1e-12 && (a[1] - 0.25).abs() < 1e-12 && a[2] == PRIOR_ACCEPT, "{a:?}");
    p.verified(3, 1);
    let a = p.acceptance().to_vec();
    assert!((a[0] - (0.75 + 0.25 / 3.0)).abs() < 1e-12, "{a:?}");
}

#[test]
fn nothing_seen_no_drafts_and_zeros_probe_now_and_then() {
    let mut p = UnionPolicy::new(7, 64);
    assert_eq!(p.decide(0), 0, "no forward seen yet: a single step first");
    let mut p = taught(1.0, 1.0 / 200e6);
    // Probes that would cost more than the budget wait: none before any seconds are run.
    assert!((0..48).all(|_| p.decide(0) == 0));
    let mut p = taught(1.0, 1.0 / 200e6);
    p.ran(1e6, None);
    let ws: Vec<usize> = (0..48).map(|_| p.decide(0)).collect();
    let probes: Vec<usize> = (0..48).filter(|&i| ws[i] > 0).collect();
    assert_eq!(probes, vec![3, 11, 27], "a probe after 4 single steps, then after 8, 16");
    assert_eq!(p.probes, 3);
    assert_eq!(p.widths[0], 45);
}

#[test]
fn unions_of_rows_not_seen_scale_from_the_nearest_seen() {
    let mut p = UnionPolicy::new(7, 64);
    p.observe(&forward(1, 8, 1.0, 1e-9));
    let u2 = p.union_at(2).unwrap();
    assert!((u2 - 64.0 * (1.0 - (56.0f64 / 64.0).powi(2))).abs() < 1e-9, "{u2}");
    p.observe(&forward(4, 20, 1.0, 1e-9));
    let u3 = p.union_at(3).unwrap();
    assert!(u3 > 8.0 && u3 < 20.0, "{u3}");
    assert_eq!(p.union_at(4), Some(20.0));
}

fn offer(arm: usize, sunk: bool) -> Offer {
    Offer { arm, class: 0, most: 7, sunk, backlog: 0 }
}

#[test]
fn of_two_drafters_the_one_whose_drafts_are_kept_is_chosen() {
    let mut p = taught(0.0, 1.0 / 200e6);
    for _ in 0..20 {
        p.verified_by(0, 0, 7, 0);
        p.verified_by(1, 0, 7, 7);
    }
    p.called(1, 0, 0.0, 1e-4);
    let (pick, w, probe) = p.choose(0, &[offer(0, true), offer(1, false)]);
    assert_eq!((pick, probe), (Some(1), false));
    assert!(w >= 5, "{w}");
    // Its call made dear (a backlog of rows to fold at a second a row): a single step instead.
    p.called(1, 10, 10.0, 1e-4);
    let dear = Offer { backlog: 100, ..offer(1, false) };
    assert_eq!(p.choose(0, &[offer(0, true), dear]).1, 0);
}

#[test]
fn a_drafter_never_timed_is_asked_only_by_a_probe_and_probes_keep_to_their_budget() {
    let mut p = taught(0.0, 1.0 / 200e6);
    for _ in 0..20 {
        p.verified_by(0, 0, 7, 7);
    }
    p.ran(100.0, None);
    let ws: Vec<(Option<usize>, usize, bool)> = (0..4).map(|_| p.choose(0, &[offer(0, false)])).collect();
    assert!(ws[..3].iter().all(|c| c.1 == 0), "{ws:?}");
    assert_eq!(ws[3], (Some(0), 2, true), "the 4th single step in a row is a probe");
    // A class of proposal never verified: only a probe too.
    let fresh = Offer { class: 3, ..offer(0, true) };
    assert_eq!(p.choose(0, &[fresh]).1, 0);
    // Probes that cost more than their share of the run's seconds wait.
    p.ran(10.0, Some((1, 0.001)));
    assert!(p.probe_s > PROBE_SHARE * p.run_s);
    let ws: Vec<usize> = (0..300).map(|_| p.choose(0, &[offer(0, false)]).1).collect();
    assert!(ws.iter().all(|&w| w == 0), "no probe over budget");
    p.ran(1000.0, None);
    assert!((0..300).any(|_| p.choose(0, &[offer(0, false)]).2), "within budget again: probes");
}

#[test]
fn sampled_sequences_start_from_the_lower_prior() {
    let mut p = UnionPolicy::new(3, 0);
    p.set_sampled(true);
    assert!((p.emitted_by(2, 1, 1) - (1.0 + PRIOR_ACCEPT_SAMPLED)).abs() < 1e-12);
}
