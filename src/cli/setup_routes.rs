//! `deltafin setup --fetch-routes`: streams ahead, into a stream install, every routed expert a
//! route trace (`run --trace-routes`) used, so later runs of such prompts read none from the hub.

use crate::hub::stream::{self, StreamInstall};
use crate::model::{Checkpoint, K3Config, Roster};
use crate::store::expert_store::{ExpertStore, StoreOptions};
use crate::store::placement::RouteTrace;
use crate::store::{ExpertSource, Flow};
use crate::util::human_bytes;
use anyhow::{Context, Result};
use std::io::Write as _;
use std::path::Path;
use std::sync::Arc;

/// Streams every expert a route trace used that is not local yet.
pub fn fetch_routes(dir: &Path, trace: &Path, json: bool) -> Result<()> {
    let install = StreamInstall::load(dir)?
        .with_context(|| format!("{} is not a stream install (no {})", dir.display(), stream::RECORD))?;
    let cfg = K3Config::load(dir).with_context(|| format!("cannot load the model config in {}", dir.display()))?;
    let ck =
        Arc::new(Checkpoint::open(dir).with_context(|| format!("cannot open the checkpoint in {}", dir.display()))?);
    let roster = Roster::build(&cfg, &ck)?;
    let t = RouteTrace::load(trace)?;
    t.check_model(&crate::model::fingerprint::fingerprint(&ck), dir)?;
    let layout = roster.expert_layout.clone().context("the model has no routed experts")?;
    let (spec, held) = stream::local_spec(&install, &ck, &roster, &layout)?;
    let store = Arc::new(ExpertStore::open(spec, StoreOptions { cache_bytes: 0, ..Default::default() })?);
    let src = stream::source(install, store, held, Arc::clone(&ck), &roster)?;
    let before = src.local_count();
    let t0 = std::time::Instant::now();
    let mut used = 0usize;
    for (l, locs) in roster.experts.iter().enumerate() {
        let (Some(locs), Some(counts)) = (locs, t.counts(l)) else { continue };
        let ids: Vec<u32> =
            (0..locs.len() as u32).filter(|&e| counts.get(e as usize).is_some_and(|&c| c > 0)).collect();
        used += ids.len();
        src.fetch(l, &ids, &mut |_e, _b| Ok(Flow::Continue)).with_context(|| format!("layer {l}"))?;
    }
    let (bytes, reqs) = src.http_counts();
    let fetched = src.local_count() - before;
    eprintln!(
        "deltafin setup: the trace used {used} experts; {fetched} fetched now ({} in {reqs} requests, {:.1} s), {} local in all",
        human_bytes(bytes),
        t0.elapsed().as_secs_f64(),
        src.local_count()
    );
    if json {
        writeln!(
            std::io::stdout(),
            "{}",
            serde_json::json!({"experts_used": used, "fetched": fetched, "http_bytes": bytes, "requests": reqs, "local": src.local_count()})
        )?;
    }
    Ok(())
}
