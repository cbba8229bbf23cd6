//! Engine options shared by `run`, `score` and `bench`: where experts come from (the store with a
//! placement, the store over the shards, or the memory-mapped shards), the expert cache, the
//! reader, the memory budget — and building the expert source and memory plan from them.

use super::load::Opened;
use crate::memory::{MemoryPlan, activation_bytes, machine_available};
use crate::store::expert_store::{self, ExpertStore, StoreOptions, StoreSpec};
use crate::store::placement::{MANIFEST, Manifest, manifest_spec, shard_spec};
use crate::store::reader::ReaderKind;
use crate::store::{ExpertSource, ShardExperts};
use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ExpertsFrom {
    /// The expert store: O_DIRECT reads from the placement's drives (or the shards), with cache.
    Store,
    /// The memory-mapped shards through the page cache (reference path; no counters of reads).
    Mmap,
}

#[derive(Args, Clone, Debug)]
pub struct EngineArgs {
    /// Placement manifest (default: MODEL/placement.json if present, else read the shards).
    #[arg(long)]
    pub placement: Option<PathBuf>,
    /// Expert cache size in GB (default: what the memory budget leaves, up to all experts).
    #[arg(long, value_parser = super::parse_gb)]
    pub expert_cache_gb: Option<f64>,
    /// I/O reader.
    #[arg(long, value_enum, default_value_t = ReaderKind::Auto)]
    pub reader: ReaderKind,
    /// Reads in flight per drive when reading the shards without a placement.
    #[arg(long, default_value_t = 4, value_parser = super::parse_qd)]
    pub qd: usize,
    /// Where experts come from.
    #[arg(long, value_enum, default_value_t = ExpertsFrom::Store)]
    pub experts_from: ExpertsFrom,
    /// Memory budget in GB (default: what the machine, or its memory cgroup, has available).
    #[arg(long, value_parser = super::parse_gb_positive)]
    pub memory_gb: Option<f64>,
    /// Prompt rows processed together (expert-major); longer prompts are chunked.
    #[arg(long, default_value_t = 4096)]
    pub prefill_rows: usize,
    /// Predict the next MoE layer's experts and read them into idle drive capacity.
    #[arg(long, value_enum, default_value_t = OnOff::Off)]
    pub prefetch: OnOff,
    /// Use only these drives of the placement (comma-separated indices), e.g. for a ladder.
    #[arg(long, value_delimiter = ',')]
    pub use_drives: Option<Vec<usize>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OnOff {
    On,
    Off,
}

/// The expert source chosen by the options.
pub enum Source<'a> {
    Store(ExpertStore),
    Mmap(ShardExperts<'a>),
}

impl Source<'_> {
    pub fn as_dyn(&self) -> &dyn ExpertSource {
        match self {
            Source::Store(s) => s,
            Source::Mmap(m) => m,
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Source::Store(s) => {
                let r = s.report();
                let drives: Vec<String> = r
                    .drives
                    .iter()
                    .map(|d| format!("{} ({}{})", d.root, d.reader, if d.direct_io { ", O_DIRECT" } else { "" }))
                    .collect();
                format!("experts via store: {} drive(s) [{}], {} slots", r.drives.len(), drives.join(", "), s.slots())
            }
            Source::Mmap(_) => "experts via mmap".into(),
        }
    }
}

/// Drops holders on placement drives not in `keep` (the shards, the last drive, stay as placed);
/// fails if an expert is left without any holder, warns when some must come from the shards.
fn restrict_drives(spec: &mut StoreSpec, keep: &[usize], placement_drives: usize) -> Result<()> {
    let list = keep.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(",");
    let (mut none, mut shards_only) = (0usize, 0usize);
    for per_layer in spec.holders.iter_mut().flatten() {
        for hs in per_layer.iter_mut() {
            hs.retain(|h| h.drive as usize >= placement_drives || keep.contains(&(h.drive as usize)));
            if hs.is_empty() {
                none += 1;
            } else if hs.iter().all(|h| h.drive as usize >= placement_drives) {
                shards_only += 1;
            }
        }
    }
    if none > 0 {
        bail!(
            "--use-drives {list}: {none} experts have no holder on those drives (and the placement does not fall back to the shards); use a mirror placement for drive subsets"
        );
    }
    if shards_only > 0 {
        eprintln!(
            "deltafin: warning: --use-drives {list}: {shards_only} experts are not on those drives and will be read from the shards"
        );
    }
    Ok(())
}

impl EngineArgs {
    /// Builds the memory plan and the expert source for a run that processes `rows` prompt rows at
    /// a time and keeps `outputs` bytes of results (e.g. all-position logits).
    pub fn open<'a>(
        &self,
        opened: &'a Opened,
        trunk: u64,
        rows: usize,
        outputs: u64,
    ) -> Result<(Source<'a>, MemoryPlan)> {
        let c = &opened.cfg;
        let budget = self.memory_gb.map_or_else(machine_available, |g| (g * 1e9) as u64);
        let manifest_path = self.placement.clone().or_else(|| Some(opened.dir.join(MANIFEST)).filter(|p| p.exists()));
        let manifest = match &manifest_path {
            Some(p) if self.experts_from == ExpertsFrom::Store => {
                Some(Manifest::load(p).with_context(|| format!("cannot use the placement {}", p.display()))?)
            }
            _ => None,
        };
        if self.use_drives.is_some() && manifest.is_none() {
            bail!(
                "--use-drives selects drives of a placement, but there is none (run `deltafin place`, or drop --use-drives)"
            );
        }
        let layout = opened.roster.expert_layout.clone();
        let prefetch_depth = usize::from(self.prefetch == OnOff::On);
        // The holder map decides the drives and queue depths, hence the slots the store allocates.
        let spec: Option<StoreSpec> = match (&layout, self.experts_from) {
            (Some(layout), ExpertsFrom::Store) => Some(match &manifest {
                Some(m) => {
                    let mut spec = manifest_spec(m, &opened.ck, &opened.roster, layout.clone())?;
                    if let Some(keep) = &self.use_drives {
                        if let Some(&bad) = keep.iter().find(|&&d| d >= m.drives.len()) {
                            bail!(
                                "--use-drives {bad}: the placement has {} drives (0..{})",
                                m.drives.len(),
                                m.drives.len()
                            );
                        }
                        restrict_drives(&mut spec, keep, m.drives.len())?;
                    }
                    spec
                }
                None => shard_spec(&opened.ck, &opened.roster, &opened.dir, self.qd, 1.0)
                    .context("the model has no routed experts")?,
            }),
            _ => None,
        };
        let slot = layout.as_ref().map_or(0, |l| expert_store::slot_size(l.len) as u64);
        let staging =
            spec.as_ref().map_or(0, |sp| expert_store::staging_slots(&sp.drives, prefetch_depth) as u64 * slot);
        let n_experts = (c.moe_layers() * c.experts) as u64;
        let cache = match (&spec, self.expert_cache_gb) {
            (None, _) => 0,
            (Some(_), Some(g)) => (g * 1e9) as u64,
            (Some(_), None) => {
                let (fixed, per_token) = crate::k3::state::SeqState::footprint(c);
                let reserve = fixed as u64 + per_token as u64 * c.max_context.min(32_768) as u64;
                let committed = trunk + staging + reserve + activation_bytes(c, rows.max(1)) + outputs;
                (budget.saturating_sub(committed) as f64 * 0.9) as u64
            }
        };
        // Whole slots only, and never more than every expert.
        let cache = cache.checked_div(slot).map_or(0, |n| n.min(n_experts) * slot);
        let plan = MemoryPlan::new(c, budget, trunk, cache, staging, rows, outputs)?;
        let source = match spec {
            None => {
                Source::Mmap(ShardExperts::new(&opened.ck, &opened.roster).context("the model has no routed experts")?)
            }
            Some(spec) => {
                let opts =
                    StoreOptions { cache_bytes: cache, reader: self.reader, prefetch_depth, record_reads: false };
                Source::Store(ExpertStore::open(spec, opts)?)
            }
        };
        Ok((source, plan))
    }
}
