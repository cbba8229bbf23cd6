//! One memory plan: for a set of budgets, contexts and prompt rows, the split the engine makes at
//! startup (`Engine::plan`) equals the line `deltafin plan` prints for the same machine
//! (`memory::plan_encodings`) — trunk, state, activations, read slots and expert cache, byte for
//! byte — and a budget the engine refuses is one `plan` says does not fit. Both size the expert
//! cache with `memory::Split`, the one formula.

mod common;
use common::*;
use deltafin::engine::{Engine, EngineConfig, ExpertsFrom, Trunk};
use deltafin::k3::KdaMode;
use deltafin::memory::{PlanInputs, plan_encodings};

#[test]
fn the_engines_startup_split_equals_plans() {
    let dir = fixture("k3-tiny-a");
    let cfg = open_model(&dir).cfg;
    let mut checked = 0;
    for memory_gb in [0.0119, 0.02, 0.05, 1.0] {
        for context in [Some(8), Some(40), None] {
            for prefill_rows in [1, 8, 64] {
                let config = EngineConfig {
                    experts_from: ExpertsFrom::Store,
                    memory_gb: Some(memory_gb),
                    context,
                    prefill_rows,
                    trunk: Trunk::Bf16,
                    ..test_config(&dir, KdaMode::Recurrent)
                };
                let what = format!("{memory_gb} GB, context {context:?}, {prefill_rows} prompt rows");
                let inputs = PlanInputs {
                    memory_bytes: (memory_gb * 1e9) as u64,
                    os_bytes: 0,
                    context: context.unwrap_or(cfg.max_context.min(deltafin::memory::DEFAULT_CONTEXT)),
                    prefill_rows,
                    drive_bytes_per_s: 1e9,
                    escape_fraction: 0.0,
                };
                let row = plan_encodings(&cfg, &inputs).into_iter().find(|r| r.trunk == "bf16").unwrap();
                let e = match Engine::open(config) {
                    Ok(e) => e,
                    Err(err) => {
                        assert!(!row.fits, "{what}: the engine refused ({err}) a budget plan fits");
                        continue;
                    }
                };
                let p = e.plan();
                let state = p.state_fixed + p.state_per_token * inputs.context as u64;
                assert_eq!(
                    (p.trunk, state, p.activations, p.staging, p.expert_cache),
                    (
                        row.trunk_bytes,
                        row.state_bytes,
                        row.activation_bytes,
                        row.read_slot_bytes,
                        row.expert_cache_bytes
                    ),
                    "{what}: engine {} vs plan {row:?}",
                    p.summary()
                );
                assert!(row.fits, "{what}");
                checked += 1;
            }
        }
    }
    assert!(checked >= 20, "only {checked} configurations opened");
}
