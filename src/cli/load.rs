//! Opening a model directory for a subcommand: config, checkpoint, roster, trunk, expert source —
//! in that order, so the first error reported is the most fundamental one.

use crate::k3::K3;
use crate::model::{Checkpoint, K3Config, Roster};
use crate::store::ShardExperts;
use anyhow::{Context, Result};
use std::path::Path;

pub struct Opened {
    pub cfg: K3Config,
    pub ck: Checkpoint,
    pub roster: Roster,
}

pub fn open(dir: &Path) -> Result<Opened> {
    let cfg = K3Config::load(dir)
        .with_context(|| format!("cannot load the model config in {}", dir.display()))?;
    let ck = Checkpoint::open(dir)
        .with_context(|| format!("cannot open the checkpoint in {}", dir.display()))?;
    let roster = Roster::build(&cfg, &ck)?;
    Ok(Opened { cfg, ck, roster })
}

impl Opened {
    pub fn experts(&self) -> Option<ShardExperts<'_>> {
        ShardExperts::new(&self.ck, &self.roster)
    }

    pub fn model<'a>(&'a self, experts: Option<&'a ShardExperts<'a>>) -> Result<K3<'a>> {
        let src = experts.map(|s| s as &dyn crate::store::ExpertSource);
        Ok(K3::new(self.cfg.clone(), &self.ck, &self.roster, src)?)
    }
}
