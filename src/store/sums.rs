//! What an expert's bytes must hash to, wherever they were read from: [`ExpertSums`].
//!
//! Contract: [`ExpertSums::check`] says whether an expert's image is the recorded one — `Whole`
//! (the xxh3 of the whole image: a placement manifest, a stream install's packs) or `Records`
//! (the checkpoint's recorded xxh3 of each of the expert's six records, looked up as the expert
//! lands, so checksums a background pass records while the engine runs apply from then on). A
//! mismatch names the record and both checksums; an expert with nothing recorded is `Unknown`
//! (its bytes are used unverified, and the startup line says so).

use crate::model::Checkpoint;
use crate::model::roster::{EXPERT_PARTS, Roster};
use std::sync::Arc;
use xxhash_rust::xxh3::xxh3_64;

/// What an expert's bytes must hash to.
#[derive(Clone)]
pub enum ExpertSums {
    /// [layer] -> [expert] -> xxh3 of the whole image.
    Whole(Arc<Vec<Option<Vec<u64>>>>),
    /// [layer] -> [expert] -> the checkpoint's tensor ids of its six records (EXPERT_PARTS order),
    /// with where each record lies in the image.
    Records { ck: Arc<Checkpoint>, ids: Arc<Vec<Option<Vec<[u32; 6]>>>>, parts: [(usize, usize); 6] },
}

/// The outcome of a check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Ok,
    /// Nothing recorded for this expert (yet).
    Unknown,
    /// Not the recorded bytes: which part, and both checksums.
    Bad(String),
}

impl ExpertSums {
    pub fn whole(sums: Vec<Option<Vec<u64>>>) -> Self {
        ExpertSums::Whole(Arc::new(sums))
    }

    /// The checkpoint's records of every routed expert (None for a model without routed experts).
    pub fn records(ck: &Arc<Checkpoint>, roster: &Roster) -> Option<Self> {
        let layout = roster.expert_layout.as_ref()?;
        let id = |l: usize, e: usize, i: usize| {
            let (proj, part) = EXPERT_PARTS[i];
            ck.get(&crate::model::roster::expert(l, e, proj, part)).map_or(u32::MAX, |t| t.id)
        };
        let ids = roster
            .experts
            .iter()
            .enumerate()
            .map(|(l, locs)| {
                locs.as_ref().map(|v| (0..v.len()).map(|e| std::array::from_fn(|i| id(l, e, i))).collect())
            })
            .collect();
        Some(ExpertSums::Records { ck: Arc::clone(ck), ids: Arc::new(ids), parts: layout.parts })
    }

    /// Whether every expert has all its records' checksums recorded now.
    pub fn complete(&self) -> bool {
        let (known, all) = self.coverage();
        known == all
    }

    /// Whether `bytes` (expert `e` of `layer`'s image) are the recorded bytes.
    pub fn check(&self, layer: usize, e: u32, bytes: &[u8]) -> Verdict {
        match self {
            ExpertSums::Whole(v) => {
                let Some(&want) = v.get(layer).and_then(|l| l.as_ref()).and_then(|l| l.get(e as usize)) else {
                    return Verdict::Unknown;
                };
                let got = xxh3_64(bytes);
                if got == want {
                    Verdict::Ok
                } else {
                    Verdict::Bad(format!("checksum mismatch (xxh3 {got:016x}, expected {want:016x})"))
                }
            }
            ExpertSums::Records { ck, ids, parts } => {
                let Some(ids) = ids.get(layer).and_then(|l| l.as_ref()).and_then(|l| l.get(e as usize)) else {
                    return Verdict::Unknown;
                };
                if parts.iter().any(|&(at, n)| at + n > bytes.len()) {
                    return Verdict::Bad("too short".into());
                }
                // Hashed on the calling thread (a drive's reader: beside the compute, never queued
                // behind it; one thread hashes ~10 GB/s, a K3 expert is 17.5 MB).
                let got: Vec<u64> = parts.iter().map(|&(at, n)| xxh3_64(&bytes[at..at + n])).collect();
                let mut known = 0;
                for (i, (&id, &got)) in ids.iter().zip(&got).enumerate() {
                    let Some(want) = ck.sum_of(id) else { continue };
                    if got != want {
                        let (proj, part) = EXPERT_PARTS[i];
                        return Verdict::Bad(format!(
                            "checksum mismatch in {proj}.{part} (xxh3 {got:016x}, expected {want:016x})"
                        ));
                    }
                    known += 1;
                }
                if known == 6 { Verdict::Ok } else { Verdict::Unknown }
            }
        }
    }

    /// Where the checksum expert `e` of `layer` failed came from and what to do, for its error.
    pub fn explain(&self, layer: usize, e: u32) -> String {
        match self {
            ExpertSums::Whole(_) => format!(
                "expected: the checksum recorded when the expert was copied there; {} checks every copy",
                crate::setting::Action::Verify
            ),
            ExpertSums::Records { ck, ids, .. } => {
                let shard = ids
                    .get(layer)
                    .and_then(|l| l.as_ref())
                    .and_then(|l| l.get(e as usize))
                    .and_then(|x| ck.shard_of(x[0]));
                format!(
                    "expected: {}; {}",
                    shard.map_or_else(|| "recorded".to_string(), |s| ck.how_recorded(s)),
                    crate::model::checksums::mismatch_hint(&ck.dir)
                )
            }
        }
    }

    /// Experts with something recorded, of all experts.
    pub fn coverage(&self) -> (usize, usize) {
        match self {
            ExpertSums::Whole(v) => {
                let n: usize = v.iter().flatten().map(Vec::len).sum();
                (n, n)
            }
            ExpertSums::Records { ck, ids, .. } => {
                let all = ids.iter().flatten().flatten();
                let known = all.clone().filter(|x| x.iter().all(|&id| ck.sum_of(id).is_some())).count();
                (known, all.count())
            }
        }
    }

    /// A few words for the startup line: what the expert bytes are checked against.
    pub fn describe(&self) -> String {
        match self {
            ExpertSums::Whole(_) => "experts checked against the placement's xxh3".into(),
            ExpertSums::Records { ck, .. } => ck.verification().describe(),
        }
    }
}
