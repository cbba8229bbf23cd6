//! The plan of a placement: which drives hold each expert of each MoE layer, from the policy,
//! the drives' measured rates and (for `hot`) a route trace recorded on this model.
//!
//! Contract: `plan_assignment` is deterministic (ties go to the lower drive and expert index);
//! `spread` gives each drive experts in proportion to its rate; `mirror` puts every expert on every
//! drive; `hot` puts the most-routed experts on the fastest drive (its share by rate) and spreads
//! the rest. A route trace names its model, and one of another model is refused.

use super::{OtherModel, PlacementError, Policy};
use crate::model::{Checkpoint, fingerprint};
use crate::setting::Action;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Route counts per (layer, expert), recorded by `run --trace-routes`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RouteTrace {
    pub version: u32,
    /// Fingerprint of the model the routes were recorded on (absent in traces of older versions).
    #[serde(default)]
    pub model: Option<String>,
    /// layer (as a string key) -> count per expert.
    pub layers: std::collections::BTreeMap<String, Vec<u64>>,
    /// Where it was loaded from (for messages); not stored.
    #[serde(skip)]
    pub path: PathBuf,
}

impl RouteTrace {
    pub fn load(path: &Path) -> Result<Self, PlacementError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| PlacementError::Io { path: path.to_path_buf(), source })?;
        let mut t: RouteTrace = serde_json::from_str(&text).map_err(|e| PlacementError::Invalid {
            path: path.to_path_buf(),
            msg: format!("malformed route trace: {e}"),
        })?;
        t.path = path.to_path_buf();
        Ok(t)
    }

    pub fn counts(&self, layer: usize) -> Option<&Vec<u64>> {
        self.layers.get(&layer.to_string())
    }

    /// This trace, marked as recorded on the model in `ck`.
    pub fn for_model(mut self, ck: &Checkpoint) -> Self {
        self.version = 2;
        self.model = Some(fingerprint::fingerprint(ck));
        self
    }

    /// Refuses a trace recorded on another model (or on an unknown one).
    pub fn check_model(&self, ours: &str, dir: &Path) -> Result<(), PlacementError> {
        match &self.model {
            Some(theirs) if theirs == ours => Ok(()),
            Some(theirs) => Err(PlacementError::OtherModel(Box::new(OtherModel {
                path: self.path.clone(),
                what: "the routes were recorded on".into(),
                theirs: theirs.clone(),
                ours: ours.into(),
                dir: dir.to_path_buf(),
                fix: format!("record a trace on this model ({}) with {}", dir.display(), Action::RecordRoutes),
            }))),
            None => Err(PlacementError::Invalid {
                path: self.path.clone(),
                msg: format!(
                    "this route trace does not say which model it was recorded on (an older deltafin wrote it); record it again on this model ({}) with {}",
                    dir.display(),
                    Action::RecordRoutes
                ),
            }),
        }
    }
}

/// Which drives hold each expert of each MoE layer.
pub fn plan_assignment(
    policy: Policy,
    rates: &[f64],
    layers: &[usize],
    experts: usize,
    trace: Option<&RouteTrace>,
) -> Vec<Vec<Vec<u16>>> {
    let n = rates.len();
    let spread = |ids: &[usize], drives: &[usize], out: &mut Vec<Vec<u16>>| {
        let mut load = vec![0f64; n];
        for &e in ids {
            let d = *drives
                .iter()
                .min_by(|&&a, &&b| {
                    ((load[a] + 1.0) / rates[a]).total_cmp(&((load[b] + 1.0) / rates[b])).then(a.cmp(&b))
                })
                .unwrap_or(&0);
            load[d] += 1.0;
            out[e] = vec![d as u16];
        }
    };
    let all: Vec<usize> = (0..n).collect();
    layers
        .iter()
        .map(|&l| {
            let mut out = vec![Vec::new(); experts];
            match policy {
                Policy::Mirror => out.iter_mut().for_each(|v| *v = (0..n as u16).collect()),
                Policy::Spread => spread(&(0..experts).collect::<Vec<_>>(), &all, &mut out),
                Policy::Hot => {
                    let counts = trace.and_then(|t| t.counts(l));
                    let mut order: Vec<usize> = (0..experts).collect();
                    order.sort_by_key(|&e| (std::cmp::Reverse(counts.and_then(|c| c.get(e)).copied().unwrap_or(0)), e));
                    let fastest = (0..n).max_by(|&a, &b| rates[a].total_cmp(&rates[b]).then(b.cmp(&a))).unwrap_or(0);
                    let share = if n == 1 {
                        experts
                    } else {
                        ((rates[fastest] / rates.iter().sum::<f64>()) * experts as f64).round() as usize
                    };
                    for &e in &order[..share.min(experts)] {
                        out[e] = vec![fastest as u16];
                    }
                    let others: Vec<usize> = all.iter().copied().filter(|&d| d != fastest).collect();
                    let rest: Vec<usize> = order[share.min(experts)..].to_vec();
                    let mut rest_sorted = rest.clone();
                    rest_sorted.sort_unstable();
                    spread(&rest_sorted, if others.is_empty() { &all } else { &others }, &mut out);
                }
            }
            out
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_is_proportional_to_speed() {
        let a = plan_assignment(Policy::Spread, &[3.0, 1.0], &[1], 400, None);
        let on0 = a[0].iter().filter(|d| d == &&vec![0u16]).count();
        assert_eq!(on0, 300);
        assert!(a[0].iter().all(|d| d.len() == 1));
    }

    #[test]
    fn mirror_and_hot() {
        let m = plan_assignment(Policy::Mirror, &[1.0, 1.0, 1.0], &[1, 2], 8, None);
        assert!(m.iter().flatten().all(|d| d == &vec![0, 1, 2]));
        let mut t = RouteTrace::default();
        t.layers.insert("1".into(), vec![0, 9, 0, 7, 0, 0, 5, 0]);
        let h = plan_assignment(Policy::Hot, &[1.0, 3.0], &[1], 8, Some(&t));
        // Fastest drive (1) gets 3/4 of the experts, the hottest first.
        for e in [1, 3, 6] {
            assert_eq!(h[0][e], vec![1]);
        }
        assert_eq!(h[0].iter().filter(|d| d == &&vec![1u16]).count(), 6);
    }
}
