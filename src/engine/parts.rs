//! The engine's parts, read-only, for the library's own tools and for tests: the settings it was
//! opened with, the model's config, checkpoint and roster, the model, the trunk in use, the draft
//! model and the memory plan.
//!
//! Contract: these lend what the engine opened; nothing here changes it, and an `Engine` has no
//! public fields (its parts are built and owned in `mod.rs`). Front ends (`cli`, `serve`) ask the
//! plain answers of `facts.rs` instead of these parts (tests/structure.rs checks it); `config` is
//! the exception, the settings a front end itself passed.

use super::{Engine, EngineConfig, Trunk};
use crate::k3::K3;
use crate::k3::dspark::DSparkModel;
use crate::memory::MemoryPlan;
use crate::model::{Checkpoint, K3Config, Roster};
use std::sync::Arc;

impl Engine {
    /// The settings the engine was opened with.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The model's config (`config.json`): layers, experts, vocabulary.
    pub fn k3_config(&self) -> &K3Config {
        &self.cfg
    }

    /// The checkpoint's tensors.
    pub fn checkpoint(&self) -> &Arc<Checkpoint> {
        &self.ck
    }

    /// Where every routed expert lies in the checkpoint.
    pub fn roster(&self) -> &Roster {
        &self.roster
    }

    /// The model the engine runs.
    pub fn model(&self) -> &K3 {
        &self.model
    }

    /// The trunk encoding in use (`EngineConfig::trunk` resolved: never `Auto`).
    pub fn trunk(&self) -> Trunk {
        self.trunk
    }

    /// The DSpark draft model (`EngineConfig::draft_model`), shared by every session's drafter.
    pub fn dspark_model(&self) -> Option<&Arc<DSparkModel>> {
        self.draft.as_ref()
    }

    /// The memory plan the engine was opened with (`memory::MemoryPlan`).
    pub fn plan(&self) -> &MemoryPlan {
        &self.plan
    }
}
