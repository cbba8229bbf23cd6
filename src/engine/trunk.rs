//! How `Engine::open` resolves `--trunk` (auto: coded when packed) and loads the trunk in that
//! form, and the startup line's words for it. Packing a trunk (`deltafin pack-trunk`) is an offline
//! tool: `crate::tools::pack_trunk`.
//!
//! Contract: [`resolve`] picks the encoding the engine runs (never `Auto`; int8 only on the CPU);
//! [`load`] builds the model with its trunk in that form, a coded trunk read from the files
//! `pack-trunk` wrote and checked against the checkpoint's fingerprint.

use super::{BackendKind, Engine, EngineConfig, EngineError};
use crate::backend::Device;
use crate::k3::K3;
use crate::k3::weights::{Trunk, TrunkSource};
use crate::model::trunk_pack;
use crate::model::{Checkpoint, K3Config};
use crate::setting::Setting;
use std::path::Path;
use std::sync::Arc;

/// The trunk encoding `config` asks for, resolved (`Auto`: coded when `dir` has a coded trunk,
/// else bf16); int8 is refused on a backend other than the CPU's.
pub(super) fn resolve(config: &EngineConfig, dir: &Path) -> Result<Trunk, EngineError> {
    let t = match config.trunk {
        Trunk::Auto if trunk_pack::manifest(dir)?.is_some() => Trunk::Coded,
        Trunk::Auto => Trunk::Bf16,
        t => t,
    };
    if t == Trunk::Int8 && config.backend != BackendKind::Cpu {
        return Err(EngineError::Setting {
            setting: Setting::Backend,
            value: format!("{:?}", config.backend).to_lowercase(),
            problem: "the int8 trunk runs on the CPU backend only (the GPU kernels read bf16)".into(),
        });
    }
    Ok(t)
}

/// The model with its trunk held as `trunk` (coded: read from `dir`'s coded trunk, checked).
pub(super) fn load(
    trunk: Trunk,
    cfg: &K3Config,
    dir: &Path,
    ck: &Checkpoint,
    device: &Arc<dyn Device>,
) -> Result<K3, EngineError> {
    let coded = match trunk {
        Trunk::Coded => trunk_pack::open(dir, &crate::model::fingerprint::fingerprint(ck))?,
        _ => Default::default(),
    };
    let get = |n: &str| coded.get(n).cloned();
    let src = match trunk {
        Trunk::Coded => TrunkSource::Coded(&get),
        Trunk::Int8 => TrunkSource::Int8,
        _ => TrunkSource::Bf16,
    };
    Ok(K3::load_from(cfg.clone(), ck, device, &src)?)
}

impl Engine {
    /// The trunk encoding as the startup line says it; int8 is labelled not exact.
    pub fn trunk_label(&self) -> String {
        match self.trunk {
            Trunk::Int8 => "trunk int8 [NOT EXACT: per-row absmax int8, not the shipped weights]".into(),
            Trunk::Coded => "trunk coded (lossless, bit-identical to bf16)".into(),
            t => format!("trunk {}", t.name()),
        }
    }
}
